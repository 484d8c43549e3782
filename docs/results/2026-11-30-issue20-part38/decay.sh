#!/bin/bash
# Alternated runs: jemalloc's dirty decay as built (1 s, muzzy 0) against a longer one, set through _RJEM_MALLOC_CONF.
# usage: decay.sh SF "QUERIES" CONF TAG ROUNDS
sf=$1; qs=$2; conf=$3; tag=$4; rounds=${5:-2}
qargs=""; for q in $qs; do qargs="$qargs --query $q"; done
for r in $(seq 1 $rounds); do
  for v in base alt; do
    if [ $v = alt ]; then export _RJEM_MALLOC_CONF="$conf"; else unset _RJEM_MALLOC_CONF; fi
    /work/sieve-p37d bench tpch --sf $sf --nodes 3 --link loopback --runs ${RUNS:-1} --modes ndp --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true $EXTRA $qargs > d-$tag-$v-$r.md 2> d-$tag-$v-$r.err
    grep "^- ndp" d-$tag-$v-$r.md | sed "s/^/$v $r: /"
  done
done
