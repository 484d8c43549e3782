#!/bin/bash
cd /work/p46
for sf in 10 1 100; do
  s=$(date +%s); /usr/bin/time -v /work/sieve-p46 gen tpch --sf $sf --out /work/dk/tpch-sf$sf > gen-sf$sf.log 2>&1; echo "sf$sf $(( $(date +%s)-s )) s" >> gen.times
done
echo done >> gen.times
