"""Loads into sieve serve (release, embedded SF 0.01 cluster): rows/s of each way, 3 runs, median."""
import time, statistics, datetime, decimal, io, os, sys
import pyarrow as pa, pyarrow.csv as pacsv
import adbc_driver_flightsql.dbapi as flightsql
import psycopg
N = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
tbl = pa.table({
    'k': pa.array(range(N), pa.int64()),
    'name': pa.array([None if i % 7 == 0 else f"name-{i % 1000}" for i in range(N)]),
    'price': pa.array([decimal.Decimal(i % 100000) / 100 for i in range(N)], pa.decimal128(12, 2)),
    'day': pa.array([datetime.date(2020,1,1) + datetime.timedelta(days=i % 2000) for i in range(N)], pa.date32()),
})
csv_path = '/work/p40/load.csv'
pacsv.write_csv(tbl, csv_path, pacsv.WriteOptions(include_header=False))
csv_bytes = open(csv_path, 'rb').read()
fl = flightsql.connect("grpc://127.0.0.1:5434", db_kwargs={"username": "sieve", "password": "secret"}, autocommit=True)
fc = fl.cursor()
pg = psycopg.connect("host=127.0.0.1 port=5433 user=sieve password=secret dbname=sieve", autocommit=True)
pc = pg.cursor()
def fresh():
    pc.execute("drop table if exists ld")
    pc.execute("create table ld (k bigint, name varchar, price decimal(12,2), day date)")
def check():
    pc.execute("select count(*), sum(k) from ld"); return pc.fetchone()
results = {}
def run(name, f, rows):
    times = []
    for _ in range(3):
        fresh()
        t = time.perf_counter(); f(); times.append(time.perf_counter() - t)
        c = check(); assert c[0] == rows, (name, c)
    med = statistics.median(times)
    results[name] = (med, rows / med)
    print(f"{name}: median {med:.2f} s over 3, {rows/med/1e6:.2f} M rows/s", flush=True)
# ADBC sends a table as its batches, each one gRPC message: at most
# 16 MiB by default on both sides, so a large table goes in chunks.
chunks = lambda: pa.RecordBatchReader.from_batches(tbl.schema, tbl.to_batches(max_chunksize=65536))
run("adbc_ingest (Flight SQL bulk ingest)", lambda: fc.adbc_ingest("ld", chunks(), mode="append"), N)
def copy_stdin():
    with pc.copy("COPY ld FROM STDIN (FORMAT csv)") as cp:
        for i in range(0, len(csv_bytes), 1 << 20): cp.write(csv_bytes[i:i + (1 << 20)])
run("COPY FROM STDIN csv (psycopg)", copy_stdin, N)
run("COPY FROM 'file' csv (server side)", lambda: pc.execute(f"COPY ld FROM '{csv_path}' WITH (FORMAT csv)"), N)
M = 100_000
small = tbl.slice(0, M)
rows = list(zip(*[c.to_pylist() for c in small.columns]))
run("executemany INSERT ... VALUES ($1..$4) (ADBC, 100k rows)", lambda: fc.executemany("insert into ld values ($1, $2, $3, $4)", rows), M)
pc.execute("drop table if exists ld")
