#!/bin/bash
# usage: io.sh SF q...   runs each query via serve; prints utime/stime and pgpgin deltas
SF=$1; shift
SIEVE_PASSWORD=secret /work/sieve-p41a serve --sf $SF --data /work/dk --set datafusion.execution.parquet.pushdown_filters=true --set sieve.query_memory_limit=512M > serve-io-$SF.log 2>&1 &
P=$!
for i in $(seq 1 120); do PGPASSWORD=secret psql -X -q "postgresql://sieve@127.0.0.1:5433/sieve?sslmode=disable" -c "select 1" >/dev/null 2>&1 && break; sleep 1; done
st(){ awk '{print $14, $15}' /proc/$P/stat; }
vm(){ awk '/^pgpgin /{print $2}' /proc/vmstat; }
for q in "$@"; do
  read u0 s0 < <(st); p0=$(vm); t0=$(date +%s.%N)
  PGPASSWORD=secret psql -X -q "postgresql://sieve@127.0.0.1:5433/sieve?sslmode=disable" -f /work/main/queries/tpch/$q.sql > /dev/null
  read u1 s1 < <(st); p1=$(vm); t1=$(date +%s.%N)
  echo "$q wall $(echo "$t1-$t0"|bc) user $(( (u1-u0) )) sys $(( (s1-s0) )) ticks  pgpgin_MB $(( (p1-p0)/1024 ))"
done
kill $P; sleep 2
