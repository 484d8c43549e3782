//! Tables a user owns (issue 18): files written the way users have them
//! (CSV with quoted fields, commas, quotes and line breaks inside values,
//! NULLs; Parquet with NULLs), loaded with COPY into tables made with
//! CREATE TABLE, changed with INSERT, CREATE ... AS, TRUNCATE and DROP,
//! queried with pushdown (NDP on) and without it, and compared with plain
//! DataFusion over the same source files. Bad input fails with a clear
//! error and leaves the table as it was; a restart of the whole cluster
//! finds every committed table.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{ArrayRef, Date32Array, Decimal128Array, Int64Array, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use datafusion::datasource::MemTable;
use datafusion::prelude::{CsvReadOptions, ParquetReadOptions, SessionConfig, SessionContext};
use sieve_cli::cluster::EmbeddedCluster;
use sieve_cli::compare::{rows_as_text, run};
use sieve_compute::{connect_session_with_tables, SieveSession};
use sieve_format::node_directory;

const NODES: usize = 3;
const CUSTOMERS: usize = 2_000;
const SALES: usize = 5_000;

fn root(name: &str) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("owned-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    for node in 0..NODES {
        std::fs::create_dir_all(node_directory(&root, node)).unwrap();
    }
    std::fs::create_dir_all(root.join("files")).unwrap();
    root
}

/// A CSV file as people have them: a header, quoted fields with the
/// delimiter, doubled quotes and line breaks inside, empty fields for NULL.
fn write_customers_csv(path: &Path) {
    let cities = ["Oslo", "Lima", "Pune", "São Paulo", "Kraków, PL"];
    let mut text = String::from("id,name,city,balance,visits,joined,last_seen,active,score\n");
    for id in 0..CUSTOMERS {
        let name = match id % 7 {
            0 => format!("\"Smith, John {id}\""),
            1 => format!("\"The \"\"Best\"\" {id}\""),
            2 => format!("\"two\nlines {id}\""),
            3 => String::new(),
            _ => format!("name{id}"),
        };
        let city = cities[id % cities.len()];
        let city = if city.contains(',') {
            format!("\"{city}\"")
        } else {
            city.to_string()
        };
        let balance = if id % 11 == 0 {
            String::new()
        } else {
            format!("{}.{:02}", (id * 37) % 10_000, id % 100)
        };
        let visits = if id % 13 == 0 {
            String::new()
        } else {
            format!("{}", (id * 7) % 50)
        };
        let joined = format!(
            "20{:02}-{:02}-{:02}",
            10 + id % 16,
            1 + id % 12,
            1 + id % 28
        );
        let last_seen = if id % 17 == 0 {
            String::new()
        } else {
            format!(
                "2026-{:02}-{:02}T{:02}:{:02}:00",
                1 + id % 12,
                1 + id % 28,
                id % 24,
                id % 60
            )
        };
        let active = if id % 19 == 0 {
            ""
        } else if id % 3 == 0 {
            "false"
        } else {
            "true"
        };
        let score = if id % 23 == 0 {
            String::new()
        } else {
            format!("{}", (id as f64) * 0.25 - 100.0)
        };
        writeln!(
            text,
            "{id},{name},{city},{balance},{visits},{joined},{last_seen},{active},{score}"
        )
        .unwrap();
    }
    std::fs::write(path, text).unwrap();
}

fn sales_batch(start: usize, rows: usize) -> RecordBatch {
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("customer_id", DataType::Int64, true),
        Field::new("amount", DataType::Decimal128(12, 2), true),
        Field::new("note", DataType::Utf8, true),
        Field::new("sold_on", DataType::Date32, true),
    ]));
    let range = start..start + rows;
    RecordBatch::try_new(
        schema,
        vec![
            Arc::new(Int64Array::from_iter_values(
                range.clone().map(|i| i as i64),
            )) as ArrayRef,
            // Some sales have no customer, some a customer that does not exist.
            Arc::new(Int64Array::from_iter(range.clone().map(|i| {
                (i % 9 != 0).then_some(((i * 31) % (CUSTOMERS + 300)) as i64)
            }))),
            Arc::new(
                Decimal128Array::from_iter(
                    range
                        .clone()
                        .map(|i| (i % 29 != 0).then_some((i * 173 % 100_000) as i128)),
                )
                .with_precision_and_scale(12, 2)
                .unwrap(),
            ),
            Arc::new(StringArray::from_iter(
                range
                    .clone()
                    .map(|i| (i % 4 != 0).then(|| format!("note {}", i % 97))),
            )),
            Arc::new(Date32Array::from_iter(
                range.map(|i| (i % 31 != 0).then_some(20_000 + (i % 600) as i32)),
            )),
        ],
    )
    .unwrap()
}

fn write_parquet(path: &Path, batches: &[RecordBatch]) {
    let file = std::fs::File::create(path).unwrap();
    let mut writer = parquet::arrow::ArrowWriter::try_new(file, batches[0].schema(), None).unwrap();
    for batch in batches {
        writer.write(batch).unwrap();
    }
    writer.close().unwrap();
}

const CREATE_CUSTOMERS: &str = "CREATE TABLE customers (id BIGINT NOT NULL, name VARCHAR, city VARCHAR, \
     balance DECIMAL(12, 2), visits INT, joined DATE, last_seen TIMESTAMP, active BOOLEAN, score DOUBLE) \
     WITH (sort_key = 'id', slice_rows = 300, replicas = 2)";
const CREATE_SALES: &str =
    "CREATE TABLE sales (id BIGINT NOT NULL, customer_id BIGINT, amount DECIMAL(12, 2), \
     note VARCHAR, sold_on DATE) WITH (sort_key = 'sold_on,id', slice_rows = 1000)";

const QUERIES: &[&str] = &[
    "SELECT count(*), count(name), count(balance), sum(balance), min(joined), max(last_seen), count(active), sum(score) FROM customers",
    "SELECT * FROM customers WHERE id BETWEEN 100 AND 130",
    "SELECT id, name FROM customers WHERE name LIKE '%\"%' OR name LIKE '%,%' OR name LIKE '%\n%'",
    "SELECT city, count(*), sum(visits), avg(score) FROM customers WHERE active GROUP BY city",
    "SELECT count(*) FROM customers WHERE name IS NULL OR balance IS NULL OR visits IS NULL",
    "SELECT count(*), sum(amount), count(note), min(sold_on), max(sold_on) FROM sales",
    "SELECT * FROM sales WHERE sold_on = DATE '2024-10-01'",
    "SELECT c.city, count(*), sum(s.amount) FROM sales s JOIN customers c ON s.customer_id = c.id WHERE s.sold_on >= DATE '2025-01-01' GROUP BY c.city",
    "SELECT count(*), count(c.id), sum(s.amount) FROM sales s LEFT JOIN customers c ON s.customer_id = c.id",
    "SELECT count(*) FROM customers c WHERE NOT EXISTS (SELECT 1 FROM sales s WHERE s.customer_id = c.id)",
    "SELECT count(*) FROM sales s WHERE s.customer_id NOT IN (SELECT id FROM customers WHERE visits < 10)",
    "SELECT c.id, c.name, count(s.id) FROM customers c FULL JOIN sales s ON s.customer_id = c.id AND s.amount > 500 WHERE c.id < 40 OR c.id IS NULL GROUP BY c.id, c.name",
    "SELECT date_trunc('month', last_seen), count(*) FROM customers WHERE last_seen IS NOT NULL GROUP BY 1",
];

async fn check(session: &SieveSession, reference: &SessionContext, what: &str) {
    for ndp in [true, false] {
        session.set_ndp(ndp).unwrap();
        for sql in QUERIES {
            let expected = run(reference, sql)
                .await
                .unwrap_or_else(|error| panic!("plain DataFusion: {sql}: {error}"));
            let actual = sql_rows(session, sql)
                .await
                .unwrap_or_else(|error| panic!("{what}, ndp {ndp}: {sql}: {error}"));
            assert_eq!(
                actual,
                rows_as_text(&expected, true).unwrap(),
                "{what}, ndp {ndp}: {sql}"
            );
        }
    }
    session.set_ndp(true).unwrap();
}

async fn sql_rows(session: &SieveSession, sql: &str) -> datafusion::common::Result<Vec<String>> {
    let batches = session.sql(sql).await?.collect().await?;
    rows_as_text(&batches, true)
}

async fn count(session: &SieveSession, table: &str) -> String {
    sql_rows(session, &format!("SELECT count(*), sum(id) FROM {table}"))
        .await
        .unwrap()
        .join("")
}

/// The reference: plain DataFusion over the source files, the tables
/// in memory (so the same INSERTs can run there).
async fn reference(
    files: &Path,
    customers_schema: Arc<Schema>,
    sales_schema: Arc<Schema>,
) -> SessionContext {
    let context = SessionContext::new_with_config(
        SessionConfig::new().set_bool("datafusion.optimizer.enable_dynamic_filter_pushdown", false),
    );
    let csv = context
        .read_csv(
            files.join("customers.csv").to_string_lossy().as_ref(),
            CsvReadOptions::new()
                .has_header(true)
                .newlines_in_values(true)
                .schema(&customers_schema),
        )
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    context
        .register_table(
            "customers",
            Arc::new(MemTable::try_new(customers_schema, vec![csv]).unwrap()),
        )
        .unwrap();
    let parquet = context
        .read_parquet(
            files.join("sales.parquet").to_string_lossy().as_ref(),
            ParquetReadOptions::default(),
        )
        .await
        .unwrap();
    let columns: Vec<_> = sales_schema
        .fields()
        .iter()
        .map(|field| {
            datafusion::prelude::cast(
                datafusion::prelude::col(field.name()),
                field.data_type().clone(),
            )
            .alias(field.name())
        })
        .collect();
    let sales = parquet.select(columns).unwrap().collect().await.unwrap();
    context
        .register_table(
            "sales",
            Arc::new(MemTable::try_new(sales_schema, vec![sales]).unwrap()),
        )
        .unwrap();
    context
}

async fn start(root: &Path) -> (EmbeddedCluster, SieveSession) {
    crate::common::cluster_with_catalog(root, NODES).await
}

fn table_schema(session: &SieveSession, table: &str) -> Arc<Schema> {
    let frame = futures::executor::block_on(session.context.table(table)).unwrap();
    Arc::clone(frame.schema().inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_loaded_with_copy_equal_plain_datafusion_and_bad_input_changes_nothing() {
    let root = root("copy");
    let files = root.join("files");
    write_customers_csv(&files.join("customers.csv"));
    write_parquet(
        &files.join("sales.parquet"),
        &[sales_batch(0, SALES / 2), sales_batch(SALES / 2, SALES / 2)],
    );
    let (cluster, session) = start(&root).await;

    session
        .sql(CREATE_CUSTOMERS)
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    session
        .sql(CREATE_SALES)
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let loaded = sql_rows(
        &session,
        &format!(
            "COPY customers FROM '{}' WITH (FORMAT csv, HEADER true)",
            files.join("customers.csv").display()
        ),
    )
    .await
    .unwrap();
    assert_eq!(loaded, vec![CUSTOMERS.to_string()]);
    let loaded = sql_rows(
        &session,
        &format!("COPY sales FROM '{}'", files.join("*.parquet").display()),
    )
    .await
    .unwrap();
    assert_eq!(loaded, vec![SALES.to_string()]);

    let reference = reference(
        &files,
        table_schema(&session, "customers"),
        table_schema(&session, "sales"),
    )
    .await;
    check(&session, &reference, "after COPY").await;

    // Bad input: each fails with a clear error and the table is unchanged.
    let before = count(&session, "customers").await;
    let mut bad = std::fs::read_to_string(files.join("customers.csv")).unwrap();
    bad.push_str(
        "5000,ok,Oslo,1.00,3,2020-01-01,,true,1.5\n5001,bad,Oslo,1.00,many,2020-01-01,,true,1.5\n",
    );
    std::fs::write(files.join("bad.csv"), &bad).unwrap();
    let error = session
        .sql(&format!(
            "COPY customers FROM '{}' WITH (FORMAT csv, HEADER true)",
            files.join("bad.csv").display()
        ))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("bad.csv") && error.contains("many"),
        "{error}"
    );
    // The bad row is the file's last line; rows with line breaks inside
    // quotes make the record count differ from the line count.
    let bad_line = bad.lines().count();
    let records = CUSTOMERS + 2;
    assert!(
        error.contains(&format!("line {} ", records + 1))
            || error.contains(&format!("line {}.", records + 1))
            || error.contains(&format!("line {bad_line}")),
        "{error}"
    );
    assert_eq!(count(&session, "customers").await, before);

    let error = session
        .sql(&format!(
            "COPY customers FROM '{}' WITH (FORMAT csv)",
            files.join("missing.csv").display()
        ))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("missing.csv") && error.contains("No such file"),
        "{error}"
    );
    assert_eq!(count(&session, "customers").await, before);

    // A Parquet file whose `amount` holds text: a type mismatch.
    let text_amounts = RecordBatch::try_new(
        Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("customer_id", DataType::Int64, true),
            Field::new("amount", DataType::Utf8, true),
            Field::new("note", DataType::Utf8, true),
            Field::new("sold_on", DataType::Date32, true),
        ])),
        vec![
            Arc::new(Int64Array::from(vec![1, 2])) as ArrayRef,
            Arc::new(Int64Array::from(vec![Some(1), None])),
            Arc::new(StringArray::from(vec![Some("12.50"), Some("twelve")])),
            Arc::new(StringArray::from(vec![Some("a"), None])),
            Arc::new(Date32Array::from(vec![Some(20_000), None])),
        ],
    )
    .unwrap();
    write_parquet(&files.join("mismatch.parquet"), &[text_amounts]);
    let sales_before = count(&session, "sales").await;
    let error = session
        .sql(&format!(
            "COPY sales FROM '{}'",
            files.join("mismatch.parquet").display()
        ))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("mismatch.parquet") && error.contains("twelve"),
        "{error}"
    );
    assert_eq!(count(&session, "sales").await, sales_before);

    // A NULL marker of the file's own (NULL 'NA'), in the options of 9.0
    // and in the older ones psql's \copy still writes: the marker is a
    // NULL in a column of any type, and any other text is a value.
    std::fs::write(
        files.join("marked.txt"),
        "1|a|2020-01-01\n2|NA|NA\nNA|NAN|2021-02-03\n4||1999-12-31\n",
    )
    .unwrap();
    session
        .sql("CREATE TABLE marked (k BIGINT, v VARCHAR, d DATE)")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    for options in [
        "WITH (FORMAT csv, DELIMITER '|', NULL 'NA')",
        "CSV DELIMITER '|' NULL 'NA'",
    ] {
        let loaded = sql_rows(
            &session,
            &format!(
                "COPY marked FROM '{}' {options}",
                files.join("marked.txt").display()
            ),
        )
        .await
        .unwrap();
        assert_eq!(loaded, vec!["4".to_string()], "{options}");
    }
    let marked = sql_rows(&session, "SELECT k, v, d FROM marked")
        .await
        .unwrap();
    let expected = [
        "1 | a | 2020-01-01",
        "2 | NULL | NULL",
        "NULL | NAN | 2021-02-03",
        "4 |  | 1999-12-31",
    ];
    let mut expected: Vec<String> = expected
        .iter()
        .chain(expected.iter())
        .map(|row| row.to_string())
        .collect();
    expected.sort();
    assert_eq!(marked, expected);

    // A NULL into a NOT NULL column, through INSERT.
    let error = session
        .sql("INSERT INTO customers (id, name) VALUES (NULL, 'x')")
        .await;
    let error = match error {
        Ok(frame) => frame.collect().await.unwrap_err().to_string(),
        Err(error) => error.to_string(),
    };
    assert!(error.to_lowercase().contains("null"), "{error}");
    assert_eq!(count(&session, "customers").await, before);

    // Layout options are checked.
    for (sql, words) in [
        ("CREATE TABLE t1 (a INT) WITH (sort_key = 'b')", "sort_key"),
        ("CREATE TABLE t1 (a INT) WITH (replicas = 9)", "replicas"),
        (
            "CREATE TABLE t1 (a INT) WITH (colour = 'red')",
            "unknown table option",
        ),
        ("CREATE TABLE \"T-1\" (a INT)", "not allowed"),
        ("CREATE TABLE customers (a INT)", "already exists"),
    ] {
        let error = session.sql(sql).await.unwrap_err().to_string();
        assert!(error.contains(words), "{sql}: {error}");
    }
    drop(session);
    drop(cluster);
    std::fs::remove_dir_all(&root).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inserts_create_as_truncate_and_drop_commit_whole_and_survive_a_restart() {
    let root = root("writes");
    let files = root.join("files");
    write_customers_csv(&files.join("customers.csv"));
    write_parquet(&files.join("sales.parquet"), &[sales_batch(0, SALES)]);
    let (cluster, session) = start(&root).await;
    session
        .sql(CREATE_CUSTOMERS)
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    session
        .sql(CREATE_SALES)
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    for sql in [
        format!(
            "COPY customers FROM '{}' WITH (FORMAT csv, HEADER true)",
            files.join("customers.csv").display()
        ),
        format!(
            "COPY sales FROM '{}' WITH (FORMAT parquet)",
            files.join("sales.parquet").display()
        ),
    ] {
        session.sql(&sql).await.unwrap().collect().await.unwrap();
    }
    let reference = reference(
        &files,
        table_schema(&session, "customers"),
        table_schema(&session, "sales"),
    )
    .await;

    // The same statements in Sieve and in plain DataFusion's memory tables.
    for sql in [
        "INSERT INTO customers VALUES (9001, 'New, one', 'Oslo', 10.50, NULL, DATE '2026-11-01', NULL, true, 0.5), \
         (9002, NULL, NULL, NULL, 3, NULL, TIMESTAMP '2026-11-02 10:00:00', false, NULL)",
        "INSERT INTO sales SELECT id + 100000, customer_id, amount * 2, note, sold_on FROM sales WHERE id % 10 = 3",
        "INSERT INTO customers SELECT id + 20000, name, city, balance, visits, joined, last_seen, active, score FROM customers WHERE id < 50",
    ] {
        let ours = sql_rows(&session, sql).await.unwrap();
        let theirs = rows_as_text(&run(&reference, sql).await.unwrap(), true).unwrap();
        assert_eq!(ours, theirs, "{sql}");
    }
    check(&session, &reference, "after INSERT").await;

    // CREATE ... AS: one commit, the rows of the query.
    let made = sql_rows(
        &session,
        "CREATE TABLE big_sales WITH (sort_key = 'amount', slice_rows = 700) AS SELECT * FROM sales WHERE amount > 300",
    )
    .await
    .unwrap();
    let expected = rows_as_text(
        &run(&reference, "SELECT count(*) FROM sales WHERE amount > 300")
            .await
            .unwrap(),
        true,
    )
    .unwrap();
    assert_eq!(made, expected);
    let ours = sql_rows(&session, "SELECT * FROM big_sales").await.unwrap();
    let theirs = rows_as_text(
        &run(&reference, "SELECT * FROM sales WHERE amount > 300")
            .await
            .unwrap(),
        true,
    )
    .unwrap();
    assert_eq!(ours, theirs);
    // A CREATE ... AS that fails leaves no table.
    let failed = session
        .sql("CREATE TABLE broken AS SELECT id, 1 / (id - id) AS boom FROM sales")
        .await;
    assert!(failed.is_err() || failed.unwrap().collect().await.is_err());
    assert!(session.context.table("broken").await.is_err());

    // TRUNCATE empties; DROP forgets; a dropped name can be made again.
    let truncated = sql_rows(&session, "TRUNCATE big_sales").await.unwrap();
    assert_eq!(truncated, expected);
    assert_eq!(count(&session, "big_sales").await, "0 | NULL");
    session
        .sql("DROP TABLE big_sales")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    assert!(session.context.table("big_sales").await.is_err());
    session
        .sql("CREATE TABLE big_sales (id BIGINT, label VARCHAR)")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    session
        .sql("INSERT INTO big_sales VALUES (1, 'again')")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    assert_eq!(
        sql_rows(&session, "SELECT * FROM big_sales").await.unwrap(),
        vec!["1 | again"]
    );

    // Everything committed is there after the whole cluster restarts.
    let customers = count(&session, "customers").await;
    let sales = count(&session, "sales").await;
    drop(session);
    drop(cluster);
    let (cluster, session) = start(&root).await;
    assert_eq!(count(&session, "customers").await, customers);
    assert_eq!(count(&session, "sales").await, sales);
    assert_eq!(
        sql_rows(&session, "SELECT * FROM big_sales").await.unwrap(),
        vec!["1 | again"]
    );
    check(&session, &reference, "after a restart").await;
    drop(session);
    drop(cluster);
    std::fs::remove_dir_all(&root).unwrap();
}

const EVENTS: usize = 300_000;

fn events_batch(start: usize, rows: usize) -> RecordBatch {
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("k", DataType::Int64, true),
        Field::new("amount", DataType::Decimal128(12, 2), true),
        Field::new("label", DataType::Utf8, true),
        Field::new("day", DataType::Date32, true),
    ]));
    let range = start..start + rows;
    RecordBatch::try_new(
        schema,
        vec![
            Arc::new(Int64Array::from_iter_values(
                range.clone().map(|i| i as i64),
            )) as ArrayRef,
            Arc::new(Int64Array::from_iter(
                range
                    .clone()
                    .map(|i| (i % 17 != 0).then_some((i % 7) as i64)),
            )),
            Arc::new(
                Decimal128Array::from_iter(
                    range
                        .clone()
                        .map(|i| (i % 13 != 0).then_some((i * 7 % 10_000) as i128)),
                )
                .with_precision_and_scale(12, 2)
                .unwrap(),
            ),
            Arc::new(StringArray::from_iter(
                range
                    .clone()
                    .map(|i| (i % 5 != 0).then(|| format!("l{}", i % 11))),
            )),
            Arc::new(Date32Array::from_iter(
                range.map(|i| Some(19_000 + (i / 100) as i32)),
            )),
        ],
    )
    .unwrap()
}

/// The table equals the model's, with NDP on and off.
async fn same(session: &SieveSession, model: &SessionContext, what: &str) {
    for ndp in [true, false] {
        session.set_ndp(ndp).unwrap();
        for sql in [
            "SELECT * FROM events",
            "SELECT count(*), sum(amount), count(k), count(label), min(id), max(id) FROM events",
            "SELECT k, count(*), sum(amount) FROM events WHERE day > DATE '2022-01-01' GROUP BY k",
        ] {
            let expected = rows_as_text(&run(model, sql).await.unwrap(), true).unwrap();
            assert_eq!(
                sql_rows(session, sql).await.unwrap(),
                expected,
                "{what}, ndp {ndp}: {sql}"
            );
        }
    }
    session.set_ndp(true).unwrap();
}

/// Pages of table `name` at the latest version.
fn table_pages(session: &SieveSession, name: &str) -> usize {
    let owned = session.catalog.owned.as_ref().unwrap();
    let version = owned.store().latest_version().unwrap();
    let snapshot = owned.store().snapshot(name, version).unwrap().unwrap();
    snapshot
        .slices
        .iter()
        .map(|slice| slice.summary.pages as usize)
        .sum()
}

/// Pages the scans of `sql` considered and read, and its rows.
async fn pages(session: &SieveSession, sql: &str) -> (usize, usize, Vec<String>) {
    let frame = session.sql(sql).await.unwrap();
    let plan = frame.create_physical_plan().await.unwrap();
    let batches = datafusion::physical_plan::collect(Arc::clone(&plan), session.context.task_ctx())
        .await
        .unwrap();
    let (mut considered, mut read) = (0, 0);
    let mut stack = vec![plan];
    while let Some(node) = stack.pop() {
        if node.name() == "SieveScanExec" {
            let metrics = node.metrics().unwrap();
            considered += metrics
                .sum_by_name("pages_considered")
                .map_or(0, |value| value.as_usize());
            read += metrics
                .sum_by_name("pages_read")
                .map_or(0, |value| value.as_usize());
        }
        stack.extend(node.children().into_iter().cloned());
    }
    (considered, read, rows_as_text(&batches, true).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletes_and_updates_equal_plain_datafusion_and_keep_pages_pruned() {
    let root = root("deletes");
    let files = root.join("files");
    write_parquet(
        &files.join("events.parquet"),
        &[
            events_batch(0, EVENTS / 2),
            events_batch(EVENTS / 2, EVENTS / 2),
        ],
    );
    let (cluster, session) = start(&root).await;
    session
        .sql("CREATE TABLE events (id BIGINT NOT NULL, k BIGINT, amount DECIMAL(12, 2), label VARCHAR, day DATE) \
              WITH (sort_key = 'id', slice_rows = 20000)")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    sql_rows(
        &session,
        &format!(
            "COPY events FROM '{}'",
            files.join("events.parquet").display()
        ),
    )
    .await
    .unwrap();
    // The model: the same rows in a DataFusion memory table, which runs
    // DELETE and UPDATE itself.
    let model = SessionContext::new();
    let schema = table_schema(&session, "events");
    let rows = model
        .read_parquet(
            files.join("events.parquet").to_string_lossy().as_ref(),
            ParquetReadOptions::default(),
        )
        .await
        .unwrap();
    let columns: Vec<_> = schema
        .fields()
        .iter()
        .map(|field| {
            datafusion::prelude::cast(
                datafusion::prelude::col(field.name()),
                field.data_type().clone(),
            )
            .alias(field.name())
        })
        .collect();
    let rows = rows.select(columns).unwrap().collect().await.unwrap();
    model
        .register_table(
            "events",
            Arc::new(MemTable::try_new(Arc::clone(&schema), vec![rows]).unwrap()),
        )
        .unwrap();
    same(&session, &model, "loaded").await;

    // 30% of the rows deleted, compaction held back: pruning is unchanged.
    sql_rows(&session, "SET sieve.compact_deleted_share = 2")
        .await
        .unwrap();
    let range = "SELECT * FROM events WHERE id BETWEEN 50000 AND 50499";
    for sql in [
        "DELETE FROM events WHERE id % 10 < 3",
        "UPDATE events SET amount = amount * 2, label = 'doubled' WHERE k = 3",
        "DELETE FROM events WHERE label IS NULL AND id > 90000",
        "UPDATE events SET k = NULL, day = day + INTERVAL '1' DAY WHERE id BETWEEN 1000 AND 1999",
        "DELETE FROM events WHERE id < 200",
        "DELETE FROM events WHERE id < 0",
    ] {
        let ours = sql_rows(&session, sql)
            .await
            .unwrap_or_else(|error| panic!("{sql}: {error}"));
        let theirs = rows_as_text(&run(&model, sql).await.unwrap(), true).unwrap();
        assert_eq!(ours, theirs, "{sql}");
        same(&session, &model, sql).await;
    }
    let (considered, read, rows) = pages(&session, range).await;
    assert_eq!(
        rows,
        rows_as_text(&run(&model, range).await.unwrap(), true).unwrap()
    );
    let table = table_pages(&session, "events");
    println!("pages: read {read} of {considered} considered, {table} in the table");
    assert!(
        read * 10 < table,
        "after deletes: read {read} of {considered} pages considered, {table} in the table"
    );
    let owned = session.catalog.owned.as_ref().unwrap();
    let deleted = |owned: &Arc<sieve_compute::tables::OwnedTables>| {
        let version = owned.store().latest_version().unwrap();
        let snapshot = owned.store().snapshot("events", version).unwrap().unwrap();
        let past_share = snapshot
            .slices
            .iter()
            .filter(|slice| slice.deleted_rows * 10 >= slice.summary.rows * 3)
            .count();
        (
            snapshot.slices.len(),
            snapshot
                .slices
                .iter()
                .map(|slice| slice.deleted_rows)
                .sum::<u64>(),
            past_share,
        )
    };
    let (slices_before, deleted_before, past_before) = deleted(owned);
    assert!(
        deleted_before as usize >= EVENTS * 3 / 10,
        "{deleted_before} rows deleted"
    );
    assert!(past_before >= 5, "{past_before} slices past 30% deleted");

    // A DELETE with compaction on rewrites the slices past 30% deleted.
    sql_rows(&session, "SET sieve.compact_deleted_share = 0.3")
        .await
        .unwrap();
    sql_rows(&session, "DELETE FROM events WHERE id = -1")
        .await
        .unwrap();
    let (slices_after, deleted_after, past_after) = deleted(owned);
    assert_eq!(past_after, 0, "a slice past 30% deleted was not rewritten");
    assert!(
        deleted_after * 10 < deleted_before,
        "{deleted_after} deleted rows left of {deleted_before}"
    );
    assert!(
        slices_after <= slices_before,
        "{slices_after} slices from {slices_before}"
    );
    same(&session, &model, "after compaction").await;
    let (considered, read, rows) = pages(&session, range).await;
    assert_eq!(
        rows,
        rows_as_text(&run(&model, range).await.unwrap(), true).unwrap()
    );
    let table = table_pages(&session, "events");
    println!("pages: read {read} of {considered} considered, {table} in the table");
    assert!(
        read * 10 < table,
        "after compaction: read {read} of {considered} pages considered, {table} in the table"
    );

    // A WHERE the storage nodes cannot run is refused, changing nothing.
    // (DataFusion 55 would hand the table only the subquery's own filter.)
    for sql in [
        "DELETE FROM events WHERE id IN (SELECT id FROM events WHERE k = 1)",
        "UPDATE events SET k = 0 WHERE EXISTS (SELECT 1 FROM events e WHERE e.id = events.id + 1)",
        "UPDATE events SET k = (SELECT max(k) FROM events) WHERE id = 7",
    ] {
        let error = session.sql(sql).await.unwrap_err().to_string();
        assert!(
            error.contains("subquery is not supported"),
            "{sql}: {error}"
        );
    }
    same(&session, &model, "after a refused DELETE").await;

    // Over raw slices (every node too busy to run fragments), the same rows.
    drop(session);
    drop(cluster);
    let cluster = EmbeddedCluster::start_raw(&root, NODES).await.unwrap();
    let session = connect_session_with_tables(
        &cluster.urls(),
        Some(cluster.secret()),
        SessionConfig::new(),
        Some(&root.join("catalog.sqlite")),
    )
    .await
    .unwrap();
    let sql = "UPDATE events SET label = 'raw' WHERE k = 5";
    let ours = sql_rows(&session, sql).await.unwrap();
    let theirs = rows_as_text(&run(&model, sql).await.unwrap(), true).unwrap();
    assert_eq!(ours, theirs, "raw: {sql}");
    same(&session, &model, "raw slices").await;
    drop(session);
    drop(cluster);
    std::fs::remove_dir_all(&root).unwrap();
}

/// Snapshot isolation: transfers between accounts (each UPDATE keeps the
/// total), new empty accounts and the compactions they set off commit
/// while other sessions read. Every read sees one committed version: the
/// total is never off, and a scan planned before a run of commits and run
/// after them counts the rows of the version it was planned at.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_see_one_committed_version_while_writers_commit() {
    const ACCOUNTS: i64 = 400;
    let root = root("isolation");
    let (cluster, session) = start(&root).await;
    session
        .sql("CREATE TABLE accounts (id BIGINT NOT NULL, balance BIGINT NOT NULL) WITH (sort_key = 'id', slice_rows = 50)")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let values: Vec<String> = (0..ACCOUNTS).map(|id| format!("({id}, 100)")).collect();
    sql_rows(
        &session,
        &format!("INSERT INTO accounts VALUES {}", values.join(", ")),
    )
    .await
    .unwrap();
    let total = (ACCOUNTS * 100).to_string();
    // Other sessions of the same compute node (one catalog, one pool).
    let runtime = session.context.runtime_env();
    let other = || {
        sieve_compute::session_over(
            Arc::clone(&session.catalog),
            Some(cluster.secret()),
            SessionConfig::new(),
            Arc::clone(&runtime),
        )
        .unwrap()
    };
    let writer = other();
    sql_rows(&writer, "SET sieve.compact_deleted_share = 0.1")
        .await
        .unwrap();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writes = {
        let done = Arc::clone(&done);
        tokio::spawn(async move {
            let mut random = 7u64;
            let mut next = || {
                random = random
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (random >> 33) as i64
            };
            for step in 0..60 {
                let (a, b, amount) = (next() % ACCOUNTS, next() % ACCOUNTS, next() % 50);
                let sql = if step % 10 == 9 {
                    format!("INSERT INTO accounts VALUES ({}, 0)", ACCOUNTS + step)
                } else {
                    format!(
                        "UPDATE accounts SET balance = CASE WHEN id = {a} THEN balance - {amount} \
                         WHEN id = {b} THEN balance + {amount} ELSE balance END WHERE id = {a} OR id = {b}"
                    )
                };
                sql_rows(&writer, &sql)
                    .await
                    .unwrap_or_else(|error| panic!("{sql}: {error}"));
            }
            done.store(true, std::sync::atomic::Ordering::SeqCst);
        })
    };
    let mut reads = 0;
    let mut long_scans = 0;
    let reader = other();
    let owned = Arc::clone(session.catalog.owned.as_ref().unwrap());
    while !done.load(std::sync::atomic::Ordering::SeqCst) {
        // A read: the total holds whatever commits meanwhile.
        let answer = sql_rows(&reader, "SELECT sum(balance), count(balance) FROM accounts")
            .await
            .unwrap();
        let (sum, _) = answer[0].split_once(" | ").unwrap();
        assert_eq!(sum, total, "read {reads}: a read saw a transfer half done");
        reads += 1;
        // A long scan: planned now, run after more commits.
        let before = owned.store().latest_version().unwrap();
        let plan = reader
            .sql("SELECT sum(balance), count(balance) FROM accounts")
            .await
            .unwrap()
            .create_physical_plan()
            .await
            .unwrap();
        let after = owned.store().latest_version().unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        let batches = datafusion::physical_plan::collect(plan, reader.context.task_ctx())
            .await
            .unwrap();
        let answer = rows_as_text(&batches, false).unwrap();
        let (sum, count) = answer[0].split_once(" | ").unwrap();
        assert_eq!(sum, total, "a long scan saw a transfer half done");
        if before == after && owned.store().latest_version().unwrap() > after {
            let snapshot = owned.store().snapshot("accounts", before).unwrap().unwrap();
            let rows: u64 = snapshot
                .slices
                .iter()
                .map(|slice| slice.summary.rows - slice.deleted_rows)
                .sum();
            assert_eq!(
                count,
                rows.to_string(),
                "a long scan counted rows of another version"
            );
            long_scans += 1;
        }
    }
    writes.await.unwrap();
    println!("{reads} reads, {long_scans} long scans across commits");
    assert!(
        reads >= 3 && long_scans >= 2,
        "{reads} reads, {long_scans} long scans across commits"
    );
    let answer = sql_rows(&session, "SELECT sum(balance), count(*) FROM accounts")
        .await
        .unwrap();
    assert_eq!(answer, vec![format!("{total} | {}", ACCOUNTS + 6)]);
    drop(session);
    drop(cluster);
    std::fs::remove_dir_all(&root).unwrap();
}

/// A statement reads every table it names at one version, whenever its
/// tables were looked up: a table found before a commit and read in the
/// same statement as one found after it, and a view (whose plan holds the
/// tables as they were when it was created), read the version the
/// statement runs at.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_reads_all_its_tables_and_views_at_one_version() {
    let root = root("one-version");
    let (cluster, session) = start(&root).await;
    for statement in [
        "CREATE TABLE a (id BIGINT NOT NULL)",
        "CREATE TABLE b (id BIGINT NOT NULL)",
        "INSERT INTO a VALUES (1)",
        "INSERT INTO b VALUES (1)",
        "CREATE VIEW both_counts AS SELECT (SELECT count(*) FROM a) AS a_rows, (SELECT count(*) FROM b) AS b_rows",
    ] {
        sql_rows(&session, statement).await.unwrap();
    }
    // `a` as a statement planned before the next commit found it.
    let a_before = session.context.table_provider("a").await.unwrap();
    sql_rows(&session, "INSERT INTO a VALUES (2)")
        .await
        .unwrap();
    session
        .context
        .register_table("a_as_found_before", a_before)
        .unwrap();
    // Both tables at the version the statement runs at: `a` with its
    // second row, as `b` was read after that commit.
    assert_eq!(
        sql_rows(
            &session,
            "SELECT (SELECT count(*) FROM a_as_found_before) AS a_rows, (SELECT count(*) FROM b) AS b_rows"
        )
        .await
        .unwrap(),
        vec!["2 | 1"]
    );
    // A prepared statement, planned once, reads the version of each run.
    sql_rows(
        &session,
        "PREPARE b_rows_over(BIGINT) AS SELECT count(*) FROM b WHERE id > $1",
    )
    .await
    .unwrap();
    assert_eq!(
        sql_rows(&session, "EXECUTE b_rows_over(0)").await.unwrap(),
        vec!["1"]
    );
    // A view made before three commits reads what they committed.
    sql_rows(&session, "INSERT INTO b VALUES (2), (3)")
        .await
        .unwrap();
    assert_eq!(
        sql_rows(&session, "EXECUTE b_rows_over(0)").await.unwrap(),
        vec!["3"]
    );
    sql_rows(&session, "DELETE FROM a WHERE id = 1")
        .await
        .unwrap();
    assert_eq!(
        sql_rows(&session, "SELECT * FROM both_counts")
            .await
            .unwrap(),
        vec!["1 | 3"]
    );
    assert_eq!(
        sql_rows(&session, "SELECT count(*) FROM a_as_found_before")
            .await
            .unwrap(),
        vec!["1"]
    );
    // A table dropped after it was found: the statement fails clearly.
    sql_rows(&session, "DROP TABLE a").await.unwrap();
    let error = sql_rows(&session, "SELECT count(*) FROM a_as_found_before")
        .await
        .expect_err("a table dropped before the statement ran");
    assert!(error.to_string().contains("dropped"), "{error}");
    drop(session);
    drop(cluster);
    std::fs::remove_dir_all(&root).unwrap();
}

/// With two copies of every slice, a table a user owns answers with a
/// storage node dead, with pushdown (slice requests) and without it (byte
/// ranges), each going to the other copy; and takes INSERT, UPDATE and
/// DELETE, new slices going to the nodes that are up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owned_table_answers_and_takes_writes_with_a_node_dead() {
    let root = root("dead-node");
    let (cluster, session) = start(&root).await;
    sql_rows(
        &session,
        "CREATE TABLE r (id BIGINT NOT NULL, v BIGINT) WITH (sort_key = 'id', slice_rows = 300, replicas = 2)",
    )
    .await
    .unwrap();
    let mut model: Vec<(i64, i64)> = (0..3_000).map(|id| (id, id % 7)).collect();
    let values = |rows: &[(i64, i64)]| {
        rows.iter()
            .map(|(id, v)| format!("({id}, {v})"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    sql_rows(
        &session,
        &format!("INSERT INTO r VALUES {}", values(&model)),
    )
    .await
    .unwrap();
    sql_rows(&session, "DELETE FROM r WHERE v = 3")
        .await
        .unwrap();
    model.retain(|(_, v)| *v != 3);
    let check = |model: Vec<(i64, i64)>, when: &'static str| {
        let session = &session;
        async move {
            let in_range = model
                .iter()
                .filter(|(id, _)| (1000..=1999).contains(id))
                .count();
            let per_v = |v: i64| model.iter().filter(|row| row.1 == v).count();
            let queries = [
                (
                    "SELECT count(*), sum(id) FROM r".to_string(),
                    format!(
                        "{} | {}",
                        model.len(),
                        model.iter().map(|row| row.0).sum::<i64>()
                    ),
                ),
                (
                    "SELECT count(*) FROM r WHERE id BETWEEN 1000 AND 1999".to_string(),
                    in_range.to_string(),
                ),
                (
                    "SELECT v, count(*) FROM r WHERE v > 4 GROUP BY v ORDER BY v".to_string(),
                    format!("5 | {}; 6 | {}", per_v(5), per_v(6)),
                ),
            ];
            for ndp in [true, false] {
                session.set_ndp(ndp).unwrap();
                for (sql, expected) in &queries {
                    let answer = sql_rows(session, sql)
                        .await
                        .unwrap_or_else(|error| panic!("ndp {ndp}, {when}: {sql}: {error}"));
                    assert_eq!(&answer.join("; "), expected, "ndp {ndp}, {when}: {sql}");
                }
            }
            session.set_ndp(true).unwrap();
        }
    };
    let owned = Arc::clone(session.catalog.owned.as_ref().unwrap());
    let slices_of_r = || {
        let store = owned.store();
        let snapshot = store
            .snapshot("r", store.latest_version().unwrap())
            .unwrap()
            .unwrap();
        snapshot
            .slices
            .iter()
            .map(|slice| (slice.summary.slice, slice.nodes.clone()))
            .collect::<Vec<_>>()
    };
    let last_before = slices_of_r().iter().map(|(slice, _)| *slice).max().unwrap();
    cluster.nodes[1].faults().kill();
    check(model.clone(), "node 1 dead").await;
    // Writes with node 1 dead: new slices on nodes 0 and 2.
    let more: Vec<(i64, i64)> = (3_000..3_900).map(|id| (id, id % 7)).collect();
    sql_rows(&session, &format!("INSERT INTO r VALUES {}", values(&more)))
        .await
        .unwrap_or_else(|error| panic!("INSERT with node 1 dead: {error}"));
    model.extend(more);
    sql_rows(&session, "UPDATE r SET v = 5 WHERE v = 6 AND id < 1500")
        .await
        .unwrap_or_else(|error| panic!("UPDATE with node 1 dead: {error}"));
    for row in &mut model {
        if row.1 == 6 && row.0 < 1500 {
            row.1 = 5;
        }
    }
    sql_rows(&session, "DELETE FROM r WHERE id % 10 = 0")
        .await
        .unwrap_or_else(|error| panic!("DELETE with node 1 dead: {error}"));
    model.retain(|(id, _)| id % 10 != 0);
    check(model.clone(), "after writes with node 1 dead").await;
    let new_slices: Vec<_> = slices_of_r()
        .into_iter()
        .filter(|(slice, _)| *slice > last_before)
        .collect();
    assert!(new_slices.len() >= 3, "{new_slices:?}");
    for (slice, nodes) in new_slices {
        assert_eq!(nodes.len(), 2, "slice {slice} has two copies: {nodes:?}");
        assert!(
            !nodes.contains(&1),
            "slice {slice} is on the dead node: {nodes:?}"
        );
    }
    drop(session);
    drop(cluster);
    std::fs::remove_dir_all(&root).unwrap();
}

/// Two compute processes on one catalog (two opens of it in this process
/// stand for them: each has its own row in the catalog's `processes`).
/// The versions one reads are kept while the other deletes, compacts and
/// removes slices; a load running in one is not taken for a crashed
/// statement's when the other opens the catalog.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_compute_processes_share_a_catalog_without_losing_reads_or_loads() {
    let root = root("two-processes");
    let (cluster, first) = start(&root).await;
    sql_rows(
        &first,
        "CREATE TABLE t (id BIGINT NOT NULL) WITH (sort_key = 'id', slice_rows = 100, replicas = 1)",
    )
    .await
    .unwrap();
    let values: Vec<String> = (0..1_000).map(|id| format!("({id})")).collect();
    sql_rows(
        &first,
        &format!("INSERT INTO t VALUES {}", values.join(", ")),
    )
    .await
    .unwrap();
    let urls = cluster.urls();
    let catalog = root.join("catalog.sqlite");
    let open_second = || {
        connect_session_with_tables(
            &urls,
            Some(cluster.secret()),
            SessionConfig::new(),
            Some(&catalog),
        )
    };
    let second = open_second().await.unwrap();

    // The second process plans a scan of the version it sees...
    let plan = second
        .sql("SELECT count(*), sum(id) FROM t")
        .await
        .unwrap()
        .create_physical_plan()
        .await
        .unwrap();
    // ...the first deletes half the rows, which compacts every slice
    // (their old files are removed from the catalog's latest version)...
    sql_rows(&first, "SET sieve.compact_deleted_share = 0.1")
        .await
        .unwrap();
    sql_rows(&first, "DELETE FROM t WHERE id % 2 = 0")
        .await
        .unwrap();
    let owned = Arc::clone(first.catalog.owned.as_ref().unwrap());
    owned.purge().await.unwrap();
    // ...and the scan still reads its version's files.
    let batches = datafusion::physical_plan::collect(plan, second.context.task_ctx())
        .await
        .expect("a version the other process reads keeps its files");
    assert_eq!(
        rows_as_text(&batches, false).unwrap(),
        vec!["1000 | 499500"]
    );
    assert_eq!(count(&second, "t").await, "500 | 250000");

    // A load in the first process, its slice on the nodes but not yet
    // committed, while another process opens the catalog.
    let table = owned
        .store()
        .tables_at(owned.store().latest_version().unwrap())
        .unwrap()
        .remove("t")
        .unwrap();
    let mut writer = sieve_compute::tables::TableWriter::new(Arc::clone(&owned), table);
    let batch = RecordBatch::try_new(
        Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, false)])),
        vec![Arc::new(Int64Array::from_iter_values(5_000..5_100)) as ArrayRef],
    )
    .unwrap();
    let slice_files = || {
        (0..NODES)
            .flat_map(|node| std::fs::read_dir(node_directory(&root, node)).unwrap())
            .map(|entry| entry.unwrap().path())
            .filter(|path| {
                path.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with("t@")
            })
            .flat_map(|table| std::fs::read_dir(table).unwrap())
            .filter(|file| {
                file.as_ref()
                    .unwrap()
                    .path()
                    .extension()
                    .is_some_and(|e| e == "parquet")
            })
            .count()
    };
    let files_before = slice_files();
    writer.write(batch).await.unwrap();
    writer.end_slice().await.unwrap();
    // The slice is on its node before the other process opens the catalog.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while slice_files() == files_before {
        assert!(
            std::time::Instant::now() < deadline,
            "the slice never reached its node"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let third = open_second().await.unwrap();
    writer
        .commit(Default::default(), "INSERT INTO t (test)")
        .await
        .expect("a load running elsewhere survives another process opening the catalog");
    assert_eq!(
        count(&third, "t").await,
        format!("600 | {}", 250_000 + (5_000..5_100).sum::<i64>())
    );
    drop(third);
    drop(second);
    drop(first);
    drop(cluster);
    std::fs::remove_dir_all(&root).unwrap();
}
