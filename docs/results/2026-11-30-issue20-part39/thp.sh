#!/bin/bash
# A/B: jemalloc thp:always vs as built, one query, alternating.
q=$1; sf=$2; n=$3
for i in $(seq 1 $n); do
 for v in base thp; do
  if [ $v = thp ]; then export _RJEM_MALLOC_CONF=thp:always; else unset _RJEM_MALLOC_CONF; fi
  /work/sieve-p37d bench tpch --sf $sf --nodes 3 --link loopback --runs 1 --modes ndp --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true --set sieve.query_memory_limit=512M --query $q > t-$q-$sf-$v-$i.md 2> t-$q-$sf-$v-$i.err
  cp bench-results/results.json t-$q-$sf-$v-$i.json
  python3 -c "
import json;d=json.load(open('t-$q-$sf-$v-$i.json'))
for q in d['queries']:
  x=q['modes'][0];print('$v $i',q['name'],round(x['wall_ms_median']/1000,2),'cpu c',x['compute_cpu_seconds'],'s',x['storage_cpu_seconds'],'peak',x['compute_peak_rss_bytes']>>20,x['storage_peak_rss_bytes']>>20)"
 done
done
