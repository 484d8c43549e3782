#!/bin/bash
common="--nodes 3 --link loopback --runs 1 --modes ndp --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true --set sieve.query_memory_limit=512M"
for q in q21 q9 q10; do
 for i in 1 2; do
  for b in p34f p35b; do
   /work/sieve-$b bench tpch --sf 100 $common --query $q > pair2-$q-$b-$i.md 2>/dev/null
   echo "$(date +%T) $q $b $i" >> pair2.log
  done
 done
done
echo end >> pair2.log
