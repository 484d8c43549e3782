#!/bin/bash
# Q16 alone at SF 100 under 512M: part 35's build (p35h) against this part's final one (p36c), alternated.
common="--nodes 3 --link loopback --runs 1 --modes ndp --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true --set sieve.query_memory_limit=512M"
for i in 1 2 3; do
  for b in p35h p36c; do
   /work/sieve-$b bench tpch --sf 100 $common --query q16 > pair3-q16-$b-$i.md 2>/dev/null
   echo "$(date +%T) q16 $b $i" >> pair3.log
  done
done
common="--nodes 3 --modes ndp --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true"
/work/sieve-p36c bench tpch --sf 100 --runs 1 --link loopback $common --set sieve.query_memory_limit=512M > k-sf100-512-p36c.md 2>/dev/null
echo "$(date +%T) sf100 512" >> pair3.log
/work/sieve-p36c bench tpch --sf 10 --runs 1 --link loopback $common --set sieve.query_memory_limit=512M > k-sf10-512-p36c.md 2>/dev/null
echo "$(date +%T) sf10 512 end" >> pair3.log
