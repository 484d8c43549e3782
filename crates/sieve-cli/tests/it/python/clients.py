"""Drive `sieve serve` the way Python users do: the ADBC Flight SQL driver,
psycopg 3 and SQLAlchemy over it, all over TLS with a password.

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

    # Loads: Arrow batches through bulk ingest (what pandas' and polars'
    # ADBC writers use) and rows of parameters through executemany; what
    # is read back is what was sent.
    import pyarrow

    days = [datetime.date(2020, 1, 1) + datetime.timedelta(days=i % 900) for i in range(30000)]
    sent = pyarrow.table(
        {
            "k": pyarrow.array(range(30000), pyarrow.int64()),
            "name": pyarrow.array([None if i % 7 == 0 else f"n{i % 97}" for i in range(30000)]),
            "price": pyarrow.array(
                [decimal.Decimal(i % 1000) / 100 for i in range(30000)], pyarrow.decimal128(12, 2)
            ),
            "day": pyarrow.array(days, pyarrow.date32()),
        }
    )
    assert cur.adbc_ingest("py_loaded", sent, mode="create") == 30000
    assert cur.adbc_ingest("py_loaded", sent.slice(0, 100), mode="append") == 100
    cur.execute("select count(*), count(name), sum(k), sum(price), min(day), max(day) from py_loaded")
    expected_names = sum(1 for i in range(30000) if i % 7 != 0) + sum(
        1 for i in range(100) if i % 7 != 0
    )
    assert cur.fetchall() == [
        (
            30100,
            expected_names,
            sum(range(30000)) + sum(range(100)),
            sum(decimal.Decimal(i % 1000) / 100 for i in range(30000))
            + sum(decimal.Decimal(i % 1000) / 100 for i in range(100)),
            min(days),
            max(days),
        )
    ]
    try:
        cur.adbc_ingest("py_loaded", sent, mode="create")
        raise AssertionError("a second create of the same table was accepted")
    except adbc_driver_manager.Error as error:
        assert "already exists" in str(error), error
    bad = pyarrow.table(
        {
            "k": pyarrow.array(["1", "not a number"]),
            "name": pyarrow.array(["a", "b"]),
            "price": pyarrow.array([1.0, 2.0]),
            "day": pyarrow.array(days[:2], pyarrow.date32()),
        }
    )
    try:
        cur.adbc_ingest("py_loaded", bad, mode="append")
        raise AssertionError("a value that is not a number was loaded")
    except adbc_driver_manager.Error as error:
        assert "column 'k'" in str(error), error
    # A load the client abandons halfway leaves the table as it was.
    def failing():
        for offset in (0, 10000):
            yield sent.slice(offset, 10000).to_batches()[0]
        raise RuntimeError("the client fails halfway")

    try:
        cur.adbc_ingest(
            "py_loaded", pyarrow.RecordBatchReader.from_batches(sent.schema, failing()), mode="append"
        )
        raise AssertionError("a load that failed halfway was accepted")
    except adbc_driver_manager.Error:
        pass
    cur.execute("select count(*) from py_loaded")
    assert cur.fetchall() == [(30100,)]
    assert cur.adbc_ingest("py_loaded", sent.slice(5, 3), mode="replace") == 3
    cur.execute("select k from py_loaded order by k")
    assert cur.fetchall() == [(5,), (6,), (7,)]
    cur.executemany(
        "insert into py_loaded (name, k) values ($1, $2 * 10)",
        [("x", 1), (None, 2), ("z", 3)],
    )
    cur.execute("select k, name, price from py_loaded where k >= 10 order by k")
    assert cur.fetchall() == [(10, "x", None), (20, None, None), (30, "z", None)]
    cur.executemany("update py_loaded set name = $1 where k = $2", [("six", 6), ("none", 99)])
    cur.execute("select name from py_loaded where k = 6")
    assert cur.fetchall() == [("six",)]
    cur.execute("drop table py_loaded")
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

    # A table of one's own, changed through prepared statements with
    # parameters of every kind: each statement's row count is what changed.
    cur.execute("create table py_owned (k bigint, v varchar, d decimal(12, 2), day date)")
    rows = [
        (1, "one", decimal.Decimal("1.50"), datetime.date(2020, 1, 1)),
        (2, "two", None, datetime.date(2021, 6, 30)),
        (3, None, decimal.Decimal("-3.10"), None),
        (4, "", decimal.Decimal("0.00"), datetime.date(1970, 1, 1)),
    ]
    for row in rows:
        cur.execute("insert into py_owned values (%s, %s, %s, %s)", row)
        assert cur.rowcount == 1 and cur.statusmessage == "INSERT 0 1", cur.statusmessage
    cur.execute("update py_owned set v = %s, d = d * 2 where k >= %s", ("many", 2))
    assert cur.rowcount == 3 and cur.statusmessage == "UPDATE 3", cur.statusmessage
    cur.execute("delete from py_owned where day < %s", (datetime.date(2021, 1, 1),))
    assert cur.rowcount == 2 and cur.statusmessage == "DELETE 2", cur.statusmessage
    cur.execute("delete from py_owned where k = %s", (99,))
    assert cur.rowcount == 0 and cur.statusmessage == "DELETE 0", cur.statusmessage
    cur.execute("update py_owned set v = 'simple' where k = 3")
    assert cur.statusmessage == "UPDATE 1", cur.statusmessage
    cur.execute("select k, v, d, day from py_owned order by k")
    got = cur.fetchall()
    assert got == [
        (2, "many", None, datetime.date(2021, 6, 30)),
        (3, "simple", decimal.Decimal("-6.20"), None),
    ], got
    # COPY FROM STDIN the way psycopg writes rows (PostgreSQL's text
    # format, a column list), and a copy the client abandons.
    copied = [
        (10, "tab\there", decimal.Decimal("1.05"), datetime.date(2010, 10, 10)),
        (11, None, None, None),
        (12, "", decimal.Decimal("-0.50"), datetime.date(2012, 1, 2)),
        (13, "back\\slash\nline \"quoted\"", decimal.Decimal("0.00"), None),
    ]
    with cur.copy("COPY py_owned (k, v, d, day) FROM STDIN") as copy:
        for row in copied:
            copy.write_row(row)
    assert cur.statusmessage == "COPY 4", cur.statusmessage
    with cur.copy("COPY py_owned (day, k) FROM STDIN") as copy:
        copy.write_row((datetime.date(2014, 4, 4), 14))
    try:
        with cur.copy("COPY py_owned FROM STDIN") as copy:
            copy.write_row((15, "x", None, None))
            raise RuntimeError("the client fails halfway")
    except RuntimeError:
        pass
    cur.execute("select k, v, d, day from py_owned where k >= 10 order by k")
    got = cur.fetchall()
    assert got == copied + [(14, None, None, datetime.date(2014, 4, 4))], got
    cur.execute("drop table py_owned")
    assert cur.statusmessage == "DROP TABLE", cur.statusmessage

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


def sqlalchemy_core(config):
    """SQLAlchemy's PostgreSQL dialect over psycopg (what pandas'
    read_sql and to_sql use): it parses version(), asks for the
    transaction isolation level and looks types up inside a savepoint
    when it connects, checks whether a table exists before it creates
    it, and inserts many rows in a BEGIN ... COMMIT block."""
    import sqlalchemy as sa

    url = sa.engine.URL.create(
        "postgresql+psycopg",
        username=config["user"],
        password=config["password"],
        host=config["pg_host"],
        port=config["pg_port"],
        database="sieve",
        query={"sslmode": "verify-ca", "sslrootcert": config["ca_cert"]},
    )
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        # TPC-H's nation 3 is CANADA by the specification.
        name = conn.execute(
            sa.text("select n_name from nation where n_nationkey = :k"), {"k": 3}
        ).scalar()
        assert name == "CANADA", name
    meta = sa.MetaData()
    table = sa.Table(
        "py_sqla",
        meta,
        sa.Column("id", sa.BigInteger),
        sa.Column("name", sa.String),
        sa.Column("price", sa.Numeric(12, 2)),
        sa.Column("day", sa.Date),
    )
    meta.create_all(engine)
    rows = [
        {"id": i, "name": None if i % 3 == 0 else f"n{i}", "price": decimal.Decimal(i) / 4,
         "day": datetime.date(2020, 1, 1) + datetime.timedelta(days=i)}
        for i in range(50)
    ]
    with engine.begin() as conn:
        conn.execute(table.insert(), rows)
    with engine.connect() as conn:
        got = conn.execute(sa.select(table).order_by(table.c.id)).all()
    assert [tuple(row) for row in got] == [
        (row["id"], row["name"], row["price"], row["day"]) for row in rows
    ], got
    assert "py_sqla" in sa.inspect(engine).get_table_names()
    meta.drop_all(engine)
    assert "py_sqla" not in sa.inspect(engine).get_table_names()
    engine.dispose()


def main():
    config = json.load(open(sys.argv[1]))
    out = sys.argv[2]
    queries = config["queries"]
    flight(config, queries, os.path.join(out, "adbc"))
    postgres(config, queries, os.path.join(out, "psycopg"))
    sqlalchemy_core(config)
    print("python clients: done")


if __name__ == "__main__":
    main()
