#!/bin/bash
# Point 4 on one machine: part 39's build (p39c, ef3f6cf) against p46, alternating, SF 1 over 1 Gbit, R = 3.
cd /work/p46
common="--nodes 3 --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true --sf 1 --runs 3 --link 1gbit --modes ndp"
for i in 1 2; do
  for b in p39c p46; do
    /work/sieve-$b bench tpch $common --out /work/p46/h-a4cmp-$b-$i > a4cmp-$b-$i.md 2>&1
    echo "$b $i $(grep '| total' a4cmp-$b-$i.md)" >> a4cmp.txt
  done
done
