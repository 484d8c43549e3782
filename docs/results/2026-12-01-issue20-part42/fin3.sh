set -x
B=/work/sieve-p42c
S="--nodes 3 --link loopback --modes ndp --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true --set sieve.query_memory_limit=512M"
$B bench tpch --sf 10 --runs 3 $S --out /work/p42/h10 > f-sf10-512-r3-p42c-2.md 2>&1
$B bench tpch --sf 100 --runs 1 --warmups 1 $S --out /work/p42/h100w > f-sf100-512-warm-p42c-2.md 2>&1
echo finished
