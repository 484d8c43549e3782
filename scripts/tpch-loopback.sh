#!/usr/bin/env bash
# TPC-H on three storage-node processes on loopback, NDP on vs off, median of
# RUNS after a warm-up. The storage nodes are separate processes, so the CPU
# columns of the table are the compute node's alone.
#
#   scripts/tpch-loopback.sh [SF] [RUNS] [extra `sieve demo` arguments...]
#
# SIEVE_IPC_COMPRESSION=auto|zstd|lz4|none picks the storage nodes' IPC codec (auto:
# lz4 for a compute node on the same host, zstd across a network);
# SIEVE_STORAGE_ARGS adds arguments to `sieve storage` (e.g. --late-materialization).
# Builds the release binary, generates the data into sieve-data/tpch-sfSF if
# missing, and stops the storage nodes on exit (also on Ctrl-C or failure).
set -euo pipefail
cd "$(dirname "$0")/.."
SF=${1:-1}
RUNS=${2:-3}
shift $(( $# > 2 ? 2 : $# ))
DATA=${SIEVE_DATA:-sieve-data}/tpch-sf$SF

cargo build --release --workspace --bins
SIEVE=${CARGO_TARGET_DIR:-target}/release/sieve

if ! grep -q '"format_version": 5' "$DATA/_SUCCESS" 2>/dev/null; then
  rm -rf "$DATA"
  "$SIEVE" gen tpch --sf "$SF" --out "$DATA" --nodes 3
fi

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM
urls=()
for node in 0 1 2; do
  "$SIEVE" storage --data "$DATA/node-$node" \
    --listen "127.0.0.1:$((50151 + node))" --range-listen "127.0.0.1:$((50161 + node))" \
    --ipc-compression "${SIEVE_IPC_COMPRESSION:-auto}" ${SIEVE_STORAGE_ARGS:-} &
  pids+=($!)
  urls+=("http://127.0.0.1:$((50151 + node))")
done
# Wait until every node answers on its Flight port.
for node in 0 1 2; do
  for _ in $(seq 1 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$((50151 + node))") 2>/dev/null && break
    sleep 0.1
  done
done
"$SIEVE" demo --sf "$SF" --runs "$RUNS" --cluster "$(IFS=,; echo "${urls[*]}")" --catalog "$DATA/catalog.sqlite" "$@"
