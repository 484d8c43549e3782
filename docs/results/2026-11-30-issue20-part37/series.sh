#!/bin/bash
# Part 37's series with one build: SF 10 (R = 3), SF 100 under 512M, SF 100, SF 10 under 512M, SF 1 (R = 3), SF 10 ndp,off.
B=/work/sieve-$1; tag=$1
common="--nodes 3 --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true"
log() { echo "$(date +%T) $1" >> series.log; }
run() { name=$1; shift; log "start $name"; $B bench tpch "$@" $common > $name-$tag.md 2>$name-$tag.err; cp bench-results/results.json $name-$tag.json; }
run s-sf10-def-r3 --sf 10 --runs 3 --link loopback --modes ndp
run s-sf100-512 --sf 100 --runs 1 --link loopback --modes ndp --set sieve.query_memory_limit=512M
run s-sf100-def --sf 100 --runs 1 --link loopback --modes ndp
run s-sf10-512 --sf 10 --runs 1 --link loopback --modes ndp --set sieve.query_memory_limit=512M
run s-sf1-r3 --sf 1 --runs 3 --link loopback --modes ndp
run a1-sf10-ndp-off --sf 10 --runs 1 --link loopback --modes ndp,off
log end
