#!/bin/bash
# Series under 512M: SF 10 (R=3) then SF 100 (R=1) per variant, build p39a.
# Variants: jemalloc's oversize threshold (env) x purge when a statement ends (idle 0).
B=/work/sieve-p39a
run() { # tag sf runs env idle
  local tag=$1 sf=$2 r=$3 e=$4 idle=$5
  env $e $B bench tpch --sf $sf --nodes 3 --link loopback --runs $r --modes ndp --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true --set sieve.query_memory_limit=512M --set sieve.release_memory_idle_ms=$idle > r-$tag.md 2> r-$tag.err
  cp bench-results/results.json r-$tag.json
  echo "$(date +%T) $tag $(grep -i '| total' r-$tag.md | head -1)"
}
for v in "$@"; do
  case $v in
    base) e=X=1; idle=1000;;
    purge) e=X=1; idle=0;;
    ov0p) e=_RJEM_MALLOC_CONF=oversize_threshold:0; idle=0;;
    ov64p) e=_RJEM_MALLOC_CONF=oversize_threshold:67108864; idle=0;;
  esac
  run sf10-$v 10 3 $e $idle
  run sf100-$v 100 1 $e $idle
done
