#!/bin/bash
cd /work/p46
echo "$(date +%T) series start" >> all.log
./series.sh /work/sieve-p46 c1 > series-c1.log 2>&1
echo "$(date +%T) series end" >> all.log
./acc.sh /work/sieve-p46 c1
echo "$(date +%T) acc end" >> all.log
