#!/bin/bash
B=/work/sieve-$1; tag=$1
common="--nodes 3 --modes ndp --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true"
log() { echo "$(date +%T) $1" >> series.log; }
log "start sf10 def r3"; $B bench tpch --sf 10 --runs 3 --link loopback $common > f-sf10-def-r3-$tag.md 2>/dev/null
log "start sf100 512"; $B bench tpch --sf 100 --runs 1 --link loopback $common --set sieve.query_memory_limit=512M > f-sf100-512-$tag.md 2>/dev/null
log "start sf100 def"; $B bench tpch --sf 100 --runs 1 --link loopback $common > f-sf100-def-$tag.md 2>/dev/null
log "start sf10 512"; $B bench tpch --sf 10 --runs 1 --link loopback $common --set sieve.query_memory_limit=512M > f-sf10-512-$tag.md 2>/dev/null
log "start sf1 r3"; $B bench tpch --sf 1 --runs 3 --link loopback $common > f-sf1-r3-$tag.md 2>/dev/null
log "start a1"; $B bench tpch --sf 10 --runs 1 --link loopback --nodes 3 --modes ndp,off --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true > a1-sf10-ndp-off-$tag.md 2>/dev/null
log "start a4"; $B bench tpch --sf 1 --runs 3 --link 1gbit $common > a4-sf1-1gbit-runs3-$tag.md 2> a4.err
log "end"
