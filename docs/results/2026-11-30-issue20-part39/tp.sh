#!/bin/bash
# A/B over target_partitions for some queries at one SF, alternating.
sf=$1; n=$2; shift 2; qs="$*"
for i in $(seq 1 $n); do
 for tp in 2 8; do
  /work/sieve-p37d bench tpch --sf $sf --nodes 3 --link loopback --runs 1 --modes ndp --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true --set sieve.query_memory_limit=512M --set datafusion.execution.target_partitions=$tp $(for q in $qs; do echo --query $q; done) > p-$sf-$tp-$i.md 2> p-$sf-$tp-$i.err
  cp bench-results/results.json p-$sf-$tp-$i.json
  python3 -c "
import json;d=json.load(open('p-$sf-$tp-$i.json'))
for q in d['queries']:
  x=q['modes'][0];print('tp$tp $i',q['name'],round(x['wall_ms_median']/1000,2),'cpu c',round(x['compute_cpu_seconds'],2),'s',round(x['storage_cpu_seconds'],2),'peak',x['compute_peak_rss_bytes']>>20,x['storage_peak_rss_bytes']>>20)"
 done
done
