#!/bin/bash
# Whole-series profile, SF 10 and SF 100 (R=1, 512M), p37d.
for sf in 10 100; do
perf record -o pf-$sf.data -a -F 199 -- /work/sieve-p37d bench tpch --sf $sf --nodes 3 --link loopback --runs 1 --modes ndp --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true --set sieve.query_memory_limit=512M > pf-$sf.md 2> pf-$sf.err
done
