#!/bin/bash
# Series: SF10 R=3 and SF100 R=1, under 512M and default, jemalloc thp:always vs as built.
run() { # tag sf runs bound env
  local tag=$1 sf=$2 r=$3 b=$4 e=$5
  local set=""; [ "$b" = 512 ] && set="--set sieve.query_memory_limit=512M"
  env $e /work/sieve-p37d bench tpch --sf $sf --nodes 3 --link loopback --runs $r --modes ndp --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true $set > s-$tag.md 2> s-$tag.err
  cp bench-results/results.json s-$tag.json
  echo "$(date +%T) $tag $(grep -i total s-$tag.md | head -2 | tr '\n' ' ')"
}
run sf10-512-thp 10 3 512 _RJEM_MALLOC_CONF=thp:always
run sf100-512-thp 100 1 512 _RJEM_MALLOC_CONF=thp:always
run sf10-512-base 10 3 512 X=1
run sf100-512-base 100 1 512 X=1
run sf10-def-thp 10 3 def _RJEM_MALLOC_CONF=thp:always
run sf100-def-thp 100 1 def _RJEM_MALLOC_CONF=thp:always
