#!/bin/bash
# Part 38's series with build p38a (jemalloc's oversize threshold at 64 MiB, compiled in).
B=/work/sieve-p38a; tag=p38a
common="--nodes 3 --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true"
log() { echo "$(date +%T) $1" >> fin.log; }
run() { name=$1; shift; log "start $name"; $B bench tpch "$@" $common > $name-$tag.md 2>$name-$tag.err; cp bench-results/results.json $name-$tag.json; grep "^- " $name-$tag.md >> fin.log; }
unset _RJEM_MALLOC_CONF
run f-sf10-def-r3 --sf 10 --runs 3 --link loopback --modes ndp
run f-sf100-def --sf 100 --runs 1 --link loopback --modes ndp
run f-sf100-512 --sf 100 --runs 1 --link loopback --modes ndp --set sieve.query_memory_limit=512M
run f-sf10-512-r3 --sf 10 --runs 3 --link loopback --modes ndp --set sieve.query_memory_limit=512M
run f-sf1-r3 --sf 1 --runs 3 --link loopback --modes ndp
run a1-sf10-ndp-off --sf 10 --runs 1 --link loopback --modes ndp,off
log end
