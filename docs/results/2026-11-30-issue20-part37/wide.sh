#!/bin/bash
# Wide joins (sieve.join_wide_partitions) at SF 100 and SF 10 on the largest joins, alternated with off.
B=/work/sieve-p37d
common="--nodes 3 --link loopback --modes ndp --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true"
qs="--query q3 --query q5 --query q8 --query q9 --query q10 --query q13 --query q18 --query q21"
log() { echo "$(date +%T) $1" >> wide.log; }
wide="--set sieve.join_wide_partitions=16 --set sieve.join_wide_build_rows=$1"
log "sf100 wide $1"; $B bench tpch --sf 100 --runs 1 $common $qs $wide > w-sf100-wide-$1.md 2>/dev/null
log "sf100 off"; $B bench tpch --sf 100 --runs 1 $common $qs > w-sf100-off.md 2>/dev/null
log "sf10 wide $1"; $B bench tpch --sf 10 --runs 3 $common $qs $wide > w-sf10-wide-$1.md 2>/dev/null
log "sf10 off"; $B bench tpch --sf 10 --runs 3 $common $qs > w-sf10-off.md 2>/dev/null
log end
