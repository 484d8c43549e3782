"""Drive `sieve serve` the way Python users do: the ADBC Flight SQL driver
and psycopg 3, both over TLS with a password.

Usage: clients.py INPUT.json OUTPUT_DIRECTORY

INPUT names the server (pg_host, pg_port, flight_uri, user, password,
ca_cert) and the queries ({name: sql}). For each driver, every query's rows
go to OUTPUT/<driver>/<name>.json as lists of cells, each the text of the
Python value (None as "NULL"); the test compares them with plain
DataFusion. Checks that need no reference (errors, settings, metadata) are
asserted here; any failure exits non-zero with its traceback.
"""

import datetime
import decimal
import json
import os
import sys

import adbc_driver_flightsql
import adbc_driver_flightsql.dbapi as flightsql
import adbc_driver_manager
import psycopg


def cell(value):
    if value is None:
        return "NULL"
    return str(value)


def write(directory, name, rows):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, name + ".json"), "w") as out:
        json.dump([[cell(value) for value in row] for row in rows], out)


# TPC-H Q6 with its five values as parameters (the reference runs the
# literal Q6 with the same values).
Q6_PARAMETERS = (
    datetime.date(1994, 1, 1),
    datetime.date(1995, 1, 1),
    decimal.Decimal("0.05"),
    decimal.Decimal("0.07"),
    decimal.Decimal("24"),
)
Q6_TEMPLATE = """
select sum(l_extendedprice * l_discount) as revenue
from lineitem
where l_shipdate >= {0} and l_shipdate < {1}
  and l_discount between {2} and {3} and l_quantity < {4}
"""


def flight(config, queries, out):
    def connect(password):
        return flightsql.connect(
            config["flight_uri"],
            db_kwargs={
                "username": config["user"],
                "password": password,
                adbc_driver_flightsql.DatabaseOptions.TLS_ROOT_CERTS.value: open(
                    config["ca_cert"]
                ).read(),
            },
            autocommit=True,
        )

    # A wrong password is refused.
    try:
        connect(config["password"] + "x").cursor().execute("select 1")
        raise AssertionError("Flight SQL accepted a wrong password")
    except adbc_driver_manager.Error as error:
        assert "UNAUTHENTICATED" in str(error), error

    conn = connect(config["password"])
    cur = conn.cursor()
    for name, sql in queries.items():
        cur.execute(sql)
        write(out, name, cur.fetchall())

    # A prepared statement with parameters ($1 ... $5), run twice.
    for _ in range(2):
        cur.execute(Q6_TEMPLATE.format("$1", "$2", "$3", "$4", "$5"), Q6_PARAMETERS)
        write(out, "q6_parameters", cur.fetchall())

    # A bad statement is an error with its SQLSTATE; the session goes on.
    try:
        cur.execute("select no_such_column from lineitem")
        raise AssertionError("a bad column was accepted")
    except adbc_driver_manager.ProgrammingError as error:
        assert "42703" in str(error), error
    cur.execute("select 41 + 1")
    assert cur.fetchall() == [(42,)]

    # EXPLAIN and EXPLAIN ANALYZE.
    cur.execute("EXPLAIN " + queries["q6"])
    plan = "\n".join(row[1] for row in cur.fetchall())
    assert "SieveScanExec" in plan, plan
    cur.execute("EXPLAIN ANALYZE " + queries["q6"])
    plan = "\n".join(row[1] for row in cur.fetchall())
    assert "SieveScanExec" in plan and "output_rows" in plan, plan

    # Settings belong to the session: off here, still on in another one.
    cur.execute("SET sieve.ndp = off")
    cur.execute("SHOW sieve.ndp")
    assert cur.fetchall() == [("sieve.ndp", "off")]
    other = connect(config["password"])
    other_cur = other.cursor()
    other_cur.execute("SHOW sieve.ndp")
    assert other_cur.fetchall() == [("sieve.ndp", "on")]
    cur.execute(queries["q6"])
    write(out, "q6_ndp_off", cur.fetchall())
    other.close()

    # Metadata: catalogs, schemas, tables (with a filter, with columns),
    # table types, SQL info.
    objects = conn.adbc_get_objects(depth="tables").read_all().to_pylist()
    tables = sorted(
        table["table_name"]
        for catalog in objects
        for schema in catalog["catalog_db_schemas"]
        for table in schema["db_schema_tables"]
        if schema["db_schema_name"] == "public"
    )
    assert tables == sorted(
        ["customer", "lineitem", "nation", "orders", "part", "partsupp", "region", "supplier"]
    ), tables
    filtered = conn.adbc_get_objects(
        depth="columns", db_schema_filter="public", table_name_filter="line%"
    ).read_all().to_pylist()
    found = [
        (table["table_name"], [column["column_name"] for column in table["table_columns"]])
        for catalog in filtered
        for schema in catalog["catalog_db_schemas"]
        for table in schema["db_schema_tables"]
    ]
    assert len(found) == 1 and found[0][0] == "lineitem", found
    assert "l_shipdate" in found[0][1] and len(found[0][1]) == 16, found
    schema = conn.adbc_get_table_schema("orders", db_schema_filter="public")
    assert "o_orderdate" in schema.names, schema
    assert "TABLE" in conn.adbc_get_table_types()
    info = conn.adbc_get_info()
    assert info["vendor_name"] == "Sieve", info
    conn.close()


def postgres(config, queries, out):
    def connect(password):
        return psycopg.connect(
            host=config["pg_host"],
            port=config["pg_port"],
            user=config["user"],
            password=password,
            dbname="sieve",
            sslmode="verify-ca",
            sslrootcert=config["ca_cert"],
            autocommit=True,
        )

    try:
        connect(config["password"] + "x")
        raise AssertionError("PostgreSQL port accepted a wrong password")
    except psycopg.OperationalError as error:
        assert "password" in str(error).lower(), error

    conn = connect(config["password"])
    cur = conn.cursor()
    for name, sql in queries.items():
        cur.execute(sql)
        write(out, name, cur.fetchall())

    # A server-side prepared statement with parameters, run twice.
    for _ in range(2):
        cur.execute(
            Q6_TEMPLATE.format("%s", "%s", "%s", "%s", "%s"), Q6_PARAMETERS, prepare=True
        )
        write(out, "q6_parameters", cur.fetchall())

    try:
        cur.execute("select no_such_column from lineitem")
        raise AssertionError("a bad column was accepted")
    except psycopg.errors.UndefinedColumn:
        pass
    cur.execute("select 41 + 1")
    assert cur.fetchall() == [(42,)]

    cur.execute("EXPLAIN ANALYZE " + queries["q6"])
    plan = "\n".join(str(row[-1]) for row in cur.fetchall())
    assert "SieveScanExec" in plan and "output_rows" in plan, plan
    cur.execute("SET sieve.ndp = off")
    cur.execute("SHOW sieve.ndp")
    assert cur.fetchall() == [("sieve.ndp", "off")]
    with connect(config["password"]) as other:
        assert other.execute("SHOW sieve.ndp").fetchall() == [("sieve.ndp", "on")]
    cur.execute(queries["q6"])
    write(out, "q6_ndp_off", cur.fetchall())

    conn.close()


def main():
    config = json.load(open(sys.argv[1]))
    out = sys.argv[2]
    queries = config["queries"]
    flight(config, queries, os.path.join(out, "adbc"))
    postgres(config, queries, os.path.join(out, "psycopg"))
    print("python clients: done")


if __name__ == "__main__":
    main()
