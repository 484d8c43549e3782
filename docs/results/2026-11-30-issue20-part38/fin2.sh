#!/bin/bash
# A second run of fin.sh's bounded pair (build p38a): SF 100 and SF 10 (R = 3) under 512M.
B=/work/sieve-p38a; tag=p38a-2
common="--nodes 3 --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true --link loopback --modes ndp --set sieve.query_memory_limit=512M"
log() { echo "$(date +%T) $1" >> fin2.log; }
run() { name=$1; shift; log "start $name"; $B bench tpch "$@" $common > $name-$tag.md 2>$name-$tag.err; cp bench-results/results.json $name-$tag.json; grep "^- " $name-$tag.md >> fin2.log; }
unset _RJEM_MALLOC_CONF
run f-sf100-512 --sf 100 --runs 1
run f-sf10-512-r3 --sf 10 --runs 3
log end
