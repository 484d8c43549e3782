#!/bin/bash
# Q16 alone, SF 100, 512M, repeated; keep each results.json
b=$1; n=$2
common="--nodes 3 --link loopback --runs 1 --modes ndp --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true --set sieve.query_memory_limit=512M"
for i in $(seq 1 $n); do
  ./sieve-$b bench tpch --sf 100 $common --query q16 > rep-$b-$i.md 2>rep-$b-$i.err
  cp bench-results/results.json rep-$b-$i.json
  echo "$(date +%T) $b $i $(grep -c failed rep-$b-$i.md)" >> rep.log
done
