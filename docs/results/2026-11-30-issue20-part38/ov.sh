#!/bin/bash
# Alternated series: jemalloc as built (base) against _RJEM_MALLOC_CONF=$1 (alt), build p37d.
# SF 10 (R = 3) and SF 100 (R = 1), default and under sieve.query_memory_limit=512M.
conf=$1; tag=$2
B=/work/sieve-p37d
common="--nodes 3 --data /work/dk --link loopback --modes ndp --set datafusion.execution.parquet.pushdown_filters=true"
log() { echo "$(date +%T) $1" >> ov-$tag.log; }
run() { name=$1; v=$2; shift 2
  if [ $v = alt ]; then export _RJEM_MALLOC_CONF="$conf"; else unset _RJEM_MALLOC_CONF; fi
  log "start $name $v"; $B bench tpch "$@" $common > $name-$tag-$v.md 2>$name-$tag-$v.err; cp bench-results/results.json $name-$tag-$v.json; grep "^- ndp" $name-$tag-$v.md >> ov-$tag.log; }
for v in base alt; do run o-sf10-def $v --sf 10 --runs 3; done
for v in base alt; do run o-sf100-def $v --sf 100 --runs 1; done
for v in base alt; do run o-sf100-512 $v --sf 100 --runs 1 --set sieve.query_memory_limit=512M; done
for v in base alt; do run o-sf10-512 $v --sf 10 --runs 3 --set sieve.query_memory_limit=512M; done
log end
