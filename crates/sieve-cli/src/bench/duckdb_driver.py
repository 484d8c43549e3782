"""DuckDB for `sieve bench`: reads JSON requests on stdin, one per line, and
answers each with one JSON line on stdout.

  {"op": "views", "tables": {"lineitem": ["http://.../slices/lineitem/x.parquet", ...]}}
  {"op": "query", "sql": "select ..."}  ->  {"ok": true, "wall_seconds": s, "rows": [[...], ...]}

The httpfs extension is loaded from the `duckdb-ext-httpfs` package by its
file path, so nothing is downloaded. DuckDB's external file cache is off so
every run reads its Parquet ranges across the link, as Sieve does.
"""
import datetime
import decimal
import glob
import json
import os
import sys
import time

import duckdb


def cell(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, (datetime.date, datetime.datetime)):
        return value.isoformat()
    return str(value)


def quoted(text):
    return "'" + text.replace("'", "''") + "'"


def main():
    pattern = os.path.join(sys.prefix, "lib", "python*", "site-packages", "duckdb_ext",
                           "extensions", "v" + duckdb.__version__, "*", "httpfs.duckdb_extension")
    extensions = glob.glob(pattern)
    if not extensions:
        print(json.dumps({"ok": False, "error": "no httpfs extension matches " + pattern}), flush=True)
        return
    con = duckdb.connect()
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    con.execute("LOAD " + quoted(extensions[0]))
    con.execute("SET enable_external_file_cache = false")
    secret = os.environ.pop("SIEVE_SECRET", None)
    if secret:
        # The storage nodes refuse requests without their shared secret.
        header = quoted("Bearer " + secret)
        con.execute("CREATE SECRET sieve_storage (TYPE HTTP, "
                    "EXTRA_HTTP_HEADERS MAP {'Authorization': " + header + "})")
    print(json.dumps({"ok": True, "version": duckdb.__version__, "extension": extensions[0]}), flush=True)
    for line in sys.stdin:
        try:
            request = json.loads(line)
            if request["op"] == "views":
                for table, urls in request["tables"].items():
                    files = "[" + ", ".join(quoted(url) for url in urls) + "]"
                    con.execute(f'CREATE OR REPLACE VIEW "{table}" AS SELECT * FROM read_parquet({files})')
                reply = {"ok": True}
            elif request["op"] == "query":
                started = time.perf_counter()
                rows = con.execute(request["sql"]).fetchall()
                wall = time.perf_counter() - started
                reply = {"ok": True, "wall_seconds": wall,
                         "rows": [[cell(value) for value in row] for row in rows]}
            else:
                reply = {"ok": False, "error": "unknown op " + repr(request.get("op"))}
        except Exception as error:  # every failure is an answer, never a hang
            reply = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
