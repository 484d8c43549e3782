#!/bin/bash
common="--nodes 3 --link loopback --runs 1 --modes ndp --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true --set sieve.query_memory_limit=512M"
for q in q21 q9 q10; do
 for i in 1 2; do
  for b in p34f p35a; do
   /work/sieve-$b bench tpch --sf 100 $common --query $q > pair-$q-$b-$i.md 2>/dev/null
   echo "$(date +%T) $q $b $i" >> pair.log
  done
 done
done
echo end >> pair.log
