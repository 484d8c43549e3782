#!/bin/bash
B=/work/sieve-$1; tag=$1
common="--nodes 3 --modes ndp --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true"
log() { echo "$(date +%T) $1" >> series-b.log; }
log "start sf10 def r3"; $B bench tpch --sf 10 --runs 3 --link loopback $common > h-sf10-def-r3-$tag.md 2>/dev/null
log "start sf100 512"; $B bench tpch --sf 100 --runs 1 --link loopback $common --set sieve.query_memory_limit=512M > h-sf100-512-$tag.md 2>/dev/null
log "start sf100 def"; $B bench tpch --sf 100 --runs 1 --link loopback $common > h-sf100-def-$tag.md 2>/dev/null
log "start sf10 512"; $B bench tpch --sf 10 --runs 1 --link loopback $common --set sieve.query_memory_limit=512M > h-sf10-512-$tag.md 2>/dev/null
log "end"
