#!/bin/bash
# Q16 alone at SF 100 under 512M: part 35's build (p35h) against this part's final one (p36b), alternated.
common="--nodes 3 --link loopback --runs 1 --modes ndp --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true --set sieve.query_memory_limit=512M"
for i in 1 2 3; do
  for b in p35h p36b; do
   /work/sieve-$b bench tpch --sf 100 $common --query q16 > pair2-q16-$b-$i.md 2>/dev/null
   echo "$(date +%T) q16 $b $i" >> pair2.log
  done
done
echo end >> pair2.log
