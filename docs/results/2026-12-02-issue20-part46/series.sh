#!/bin/bash
# usage: series.sh BIN TAG
set -x
B=$1; T=$2
S="--nodes 3 --link loopback --modes ndp --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true --set sieve.query_memory_limit=512M"
cd /work/p46
$B bench tpch --sf 10 --runs 3 $S --out /work/p46/h10-$T > f-sf10-$T.md 2>&1
$B bench tpch --sf 100 --runs 1 --warmups 1 $S --out /work/p46/h100-$T > f-sf100-$T.md 2>&1
python3 ratio.py h10-$T/results.json h100-$T/results.json > ratio-$T.txt
echo finished
