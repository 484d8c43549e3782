#!/bin/bash
# Two more jemalloc settings, one series each (build p37d), set through _RJEM_MALLOC_CONF.
B=/work/sieve-p37d
common="--nodes 3 --data /work/dk --link loopback --modes ndp --set datafusion.execution.parquet.pushdown_filters=true"
log() { echo "$(date +%T) $1" >> ov2.log; }
run() { name=$1; conf=$2; tag=$3; shift 3
  export _RJEM_MALLOC_CONF="$conf"
  log "start $name $tag ($conf)"; $B bench tpch "$@" $common > $name-$tag.md 2>$name-$tag.err; cp bench-results/results.json $name-$tag.json; grep "^- ndp" $name-$tag.md >> ov2.log; }
for c in "oversize_threshold:67108864 ov64" "oversize_threshold:0,dirty_decay_ms:300 ov0d300"; do
  set -- $c; conf=$1; tag=$2
  run o-sf10-def $conf $tag --sf 10 --runs 3
  run o-sf100-def $conf $tag --sf 100 --runs 1
  run o-sf100-512 $conf $tag --sf 100 --runs 1 --set sieve.query_memory_limit=512M
  run o-sf10-512 $conf $tag --sf 10 --runs 3 --set sieve.query_memory_limit=512M
done
log end
