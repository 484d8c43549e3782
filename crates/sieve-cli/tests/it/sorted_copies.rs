//! Sorted copies (issue 19): `CREATE TABLE c WITH (copy_of = 't', sort_key
//! = '...')` keeps `t`'s rows sorted by another key; a scan of `t` reads the
//! copy where its slices' ranges leave fewer rows to read, for the query's
//! own predicate and for the join filters that arrive at run time, and
//! EXPLAIN names it. Checked against plain DataFusion over the same rows
//! (NULLs in every key, strings, every join type), and after `t` changes
//! (the copy is then not read) and for statements that would change the
//! copy alone (refused).

use std::sync::Arc;

use arrow::array::{ArrayRef, Date32Array, Int64Array, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use datafusion::prelude::SessionContext;
use sieve_cli::compare::{rows_as_text, run};

use crate::common::{self, NODES};
use crate::join_sides::check;

/// `fact`: 40,000 rows in `k` order; `d` spread over 4,000 days, unrelated
/// to `k`. `dim`: one row per day, `flag` 1 on a narrow run of days.
fn tables() -> Vec<(&'static str, RecordBatch)> {
    let rows = 40_000i64;
    let fact = RecordBatch::try_new(
        Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, true),
            Field::new("d", DataType::Date32, true),
            Field::new("s", DataType::Utf8, true),
            Field::new("v", DataType::Int64, false),
        ])),
        vec![
            Arc::new(Int64Array::from_iter(
                (0..rows).map(|i| (i % 29 != 0).then_some(i)),
            )) as ArrayRef,
            Arc::new(Date32Array::from_iter((0..rows).map(|i| {
                (i % 31 != 0).then_some(10_000 + (i * 7_919 % 4_000) as i32)
            }))),
            Arc::new(StringArray::from_iter((0..rows).map(|i| {
                (i % 37 != 0).then(|| format!("s{:05}", i * 104_729 % 50_000))
            }))),
            Arc::new(Int64Array::from_iter_values((0..rows).map(|i| i % 101))),
        ],
    )
    .unwrap();
    let days = 4_000i32;
    let dim = RecordBatch::try_new(
        Arc::new(Schema::new(vec![
            Field::new("d", DataType::Date32, true),
            Field::new("flag", DataType::Int64, false),
        ])),
        vec![
            Arc::new(Date32Array::from_iter(
                (0..days).map(|i| (i % 97 != 5).then_some(10_000 + i)),
            )) as ArrayRef,
            Arc::new(Int64Array::from_iter_values(
                (0..days).map(|i| i64::from((1_200..1_400).contains(&i))),
            )),
        ],
    )
    .unwrap();
    vec![("fact", fact), ("dim", dim)]
}

const QUERIES: &[&str] = &[
    "SELECT count(*), sum(v) FROM fact WHERE d BETWEEN DATE '1997-05-01' AND DATE '1997-06-15'",
    "SELECT d, count(*), sum(v) FROM fact WHERE d < DATE '1997-07-01' GROUP BY d",
    "SELECT count(*), sum(v) FROM fact WHERE k BETWEEN 1000 AND 3000",
    "SELECT count(*), min(s), max(s) FROM fact WHERE s >= 's40000'",
    "SELECT count(*), count(d) FROM fact WHERE d IS NULL OR d > DATE '1998-01-01'",
    "SELECT count(*), sum(fact.v) FROM fact JOIN dim ON fact.d = dim.d WHERE dim.flag = 1",
    "SELECT dim.flag, count(*), sum(fact.v) FROM fact JOIN dim ON fact.d = dim.d \
     WHERE dim.flag = 1 AND fact.v < 50 GROUP BY dim.flag",
    "SELECT count(*), count(fact.d), sum(dim.flag) FROM fact LEFT JOIN \
     (SELECT * FROM dim WHERE flag = 1) AS dim ON fact.d = dim.d",
    "SELECT count(*), count(fact.d), sum(dim.flag) FROM fact RIGHT JOIN \
     (SELECT * FROM dim WHERE flag = 1) AS dim ON fact.d = dim.d",
    "SELECT count(*), sum(fact.v) FROM fact FULL JOIN \
     (SELECT * FROM dim WHERE flag = 1) AS dim ON fact.d = dim.d",
    "SELECT count(*), sum(v) FROM fact WHERE d IN (SELECT d FROM dim WHERE flag = 1)",
    "SELECT count(*) FROM fact WHERE d NOT IN (SELECT d FROM dim WHERE flag = 1)",
    "SELECT count(*), sum(fact.v) FROM fact JOIN dim ON fact.d IS NOT DISTINCT FROM dim.d \
     WHERE dim.flag = 1",
    // Nothing matches.
    "SELECT count(*), sum(v) FROM fact WHERE d > DATE '2030-01-01'",
    "SELECT count(*), sum(fact.v) FROM fact JOIN dim ON fact.d = dim.d WHERE dim.flag = 7",
];

/// The line of `plan` that scans `fact` or its copy.
fn fact_scan(plan: &str) -> String {
    plan.lines()
        .find(|line| {
            line.contains("SieveScanExec: table=fact@")
                || line.contains("SieveScanExec: table=fact_by_d@")
        })
        .unwrap_or_else(|| panic!("no scan of fact:\n{plan}"))
        .to_string()
}

async fn explain_analyze(session: &sieve_compute::SieveSession, sql: &str) -> String {
    let batches = run(&session.context, &format!("EXPLAIN ANALYZE {sql}"))
        .await
        .unwrap();
    rows_as_text(&batches, false).unwrap().join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scan_reads_the_sorted_copy_that_skips_the_most_and_explain_names_it() {
    let root = common::empty_root("sorted-copies", NODES);
    let (cluster, session) = common::cluster_with_catalog(&root, NODES).await;
    let reference = SessionContext::new();
    // One partition loads the rows in order: fact's slices hold ranges of k.
    session
        .sql("SET datafusion.execution.target_partitions = 1")
        .await
        .unwrap();
    common::create_owned_tables(
        &session,
        &reference,
        tables(),
        "slice_rows = 4000, page_rows = 512",
    )
    .await;
    session
        .sql("SET datafusion.execution.target_partitions = 2")
        .await
        .unwrap();
    let made = session
        .sql("CREATE TABLE fact_by_d WITH (copy_of = 'fact', sort_key = 'd')")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    assert_eq!(
        rows_as_text(&made, false).unwrap(),
        vec!["40000".to_string()],
        "the copy holds every row"
    );

    // The query's own predicate on d: the copy, named in EXPLAIN.
    let on_d = fact_scan(&common::explain(&session.context, QUERIES[0]).await);
    assert!(on_d.contains("table=fact_by_d@"), "{on_d}");
    assert!(
        on_d.contains("reads copy fact_by_d (sorted by d)"),
        "{on_d}"
    );
    // On k, the table's own order: the table, fewer slices than it has.
    let on_k = fact_scan(&common::explain(&session.context, QUERIES[2]).await);
    assert!(on_k.contains("table=fact@"), "{on_k}");
    assert!(on_k.contains("reads the table: 1 of 10 slices"), "{on_k}");
    // A join filter on d (dim's narrow run of days), known at run time.
    let joined = fact_scan(&explain_analyze(&session, QUERIES[5]).await);
    assert!(
        joined.contains("reads copy fact_by_d (sorted by d)"),
        "{joined}"
    );
    // Switched off: the table.
    session
        .sql("SET sieve.sorted_copies = false")
        .await
        .unwrap();
    let off = fact_scan(&common::explain(&session.context, QUERIES[0]).await);
    assert!(
        off.contains("table=fact@") && !off.contains("copy"),
        "{off}"
    );
    let joined_off = fact_scan(&explain_analyze(&session, QUERIES[5]).await);
    assert!(!joined_off.contains("copy"), "{joined_off}");
    session.sql("SET sieve.sorted_copies = true").await.unwrap();

    // Same answers as plain DataFusion, with the copy, and fewer rows
    // scanned for the predicate on d than the table holds.
    for sql in QUERIES {
        let rows = check(&session, &reference, sql, "fact_by_d").await;
        if *sql == QUERIES[0] {
            assert!(
                rows > 0 && rows < 40_000,
                "{sql}: the copy yielded {rows} rows"
            );
        }
    }

    // Statements that would change the copy alone are refused.
    for sql in [
        "INSERT INTO fact_by_d SELECT * FROM fact WHERE k < 10",
        "DELETE FROM fact_by_d WHERE k < 10",
        "UPDATE fact_by_d SET v = 0 WHERE k < 10",
        "TRUNCATE TABLE fact_by_d",
    ] {
        let result = match session.sql(sql).await {
            Ok(frame) => frame.collect().await.map(|_| ()),
            Err(error) => Err(error),
        };
        let error = result.expect_err(sql).to_string();
        assert!(error.contains("sorted copy"), "{sql}: {error}");
    }
    // Bad copies: a clear error each.
    for (sql, expected) in [
        (
            "CREATE TABLE c1 WITH (copy_of = 'nothing', sort_key = 'd')",
            "not a table a user owns",
        ),
        ("CREATE TABLE c2 WITH (copy_of = 'fact')", "needs sort_key"),
        (
            "CREATE TABLE c3 WITH (copy_of = 'fact', sort_key = 'nope')",
            "not a column",
        ),
        (
            "CREATE TABLE c4 WITH (copy_of = 'fact_by_d', sort_key = 'k')",
            "itself a sorted copy",
        ),
        (
            "CREATE TABLE c5 (a INT) WITH (copy_of = 'fact', sort_key = 'd')",
            "without columns",
        ),
    ] {
        let error = session
            .sql(sql)
            .await
            .map(|_| ())
            .expect_err(sql)
            .to_string();
        assert!(error.contains(expected), "{sql}: {error}");
    }

    // fact changes: the copy no longer holds its rows and is not read;
    // answers stay right.
    let insert = "INSERT INTO fact SELECT * FROM fact WHERE k < 500";
    session.sql(insert).await.unwrap().collect().await.unwrap();
    reference
        .sql(insert)
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let stale = fact_scan(&common::explain(&session.context, QUERIES[0]).await);
    assert!(
        stale.contains("table=fact@") && !stale.contains("copy"),
        "{stale}"
    );
    for sql in QUERIES {
        check(&session, &reference, sql, "fact").await;
    }
    // Made again, it is read again.
    session
        .sql("DROP TABLE fact_by_d")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    session
        .sql("CREATE TABLE fact_by_d WITH (copy_of = 'fact', sort_key = 'd')")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let again = fact_scan(&common::explain(&session.context, QUERIES[0]).await);
    assert!(again.contains("reads copy fact_by_d"), "{again}");
    for sql in QUERIES {
        check(&session, &reference, sql, "fact_by_d").await;
    }
    drop(session);
    drop(cluster);
    let _ = std::fs::remove_dir_all(&root);
}
