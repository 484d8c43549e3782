#!/bin/bash
# Q16 alone, SF 100, 512M: builds alternated; keep each results.json
common="--nodes 3 --link loopback --runs 1 --modes ndp --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true --set sieve.query_memory_limit=512M"
n=$1; shift
for i in $(seq 1 $n); do
  for b in "$@"; do
    ./sieve-$b bench tpch --sf 100 $common --query q16 > alt-$b-$i.md 2>alt-$b-$i.err
    cp bench-results/results.json alt-$b-$i.json
    echo "$(date +%T) $b $i $(grep q16 alt-$b-$i.md | cut -c1-60)" >> alt.log
  done
done
