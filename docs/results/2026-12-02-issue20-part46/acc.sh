#!/bin/bash
# Every acceptance point of issue 20 with one build (main's), one after the other (written in part 45, first run here).
# Run in part 46 after series.sh (all.sh).
# usage: acc.sh BIN TAG
B=$1; tag=$2
cd /work/p46
common="--nodes 3 --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true"
log() { echo "$(date +%T) $1" >> acc.log; }
run() { name=$1; shift; log "start $name"; $B bench tpch "$@" $common --out /work/p46/h-$name-$tag > $name-$tag.md 2>$name-$tag.err; grep "| total" $name-$tag.md >> acc.log; }
run a1-sf10-ndp-off --sf 10 --runs 1 --link loopback --modes ndp,off
run a1-sf1-ndp-off-r3 --sf 1 --runs 3 --link loopback --modes ndp,off
run a4-sf1-1gbit-r3 --sf 1 --runs 3 --link 1gbit --modes ndp,off
run a3-sf100-ndp-off --sf 100 --runs 1 --link loopback --modes ndp,off
log end
