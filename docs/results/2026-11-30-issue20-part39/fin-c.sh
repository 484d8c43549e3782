#!/bin/bash
# Part 39's series with build p39c (the releaser, purge when the last statement ends; jemalloc's 8 MiB threshold).
B=/work/sieve-p39c; tag=p39c
common="--nodes 3 --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true"
log() { echo "$(date +%T) $1" >> fin.log; }
run() { name=$1; shift; log "start $name"; $B bench tpch "$@" $common > $name-$tag.md 2>$name-$tag.err; cp bench-results/results.json $name-$tag.json; grep "| total" $name-$tag.md >> fin.log; }
unset _RJEM_MALLOC_CONF
run f-sf10-512-r3 --sf 10 --runs 3 --link loopback --modes ndp --set sieve.query_memory_limit=512M
run f-sf100-512 --sf 100 --runs 1 --link loopback --modes ndp --set sieve.query_memory_limit=512M
run a4-sf1-1gbit-r3 --sf 1 --runs 3 --link 1gbit --modes ndp
run f-sf1-r3 --sf 1 --runs 3 --link loopback --modes ndp
run f-sf10-def-r3 --sf 10 --runs 3 --link loopback --modes ndp
run f-sf100-def --sf 100 --runs 1 --link loopback --modes ndp
run f-sf10-512-r3-2 --sf 10 --runs 3 --link loopback --modes ndp --set sieve.query_memory_limit=512M
run f-sf100-512-2 --sf 100 --runs 1 --link loopback --modes ndp --set sieve.query_memory_limit=512M
log end
