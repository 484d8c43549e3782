//! Group columns a unique key decides, joined back after the aggregation
//! (`sieve.late_group_columns`, TPC-H Q10's customer strings): tables a
//! user owns, a key proven unique from the slices' summaries, every join
//! type around it, against plain DataFusion; keys that are not unique (a
//! duplicate in another slice, a NULL) are left as they are.

use std::sync::Arc;

use arrow::array::{ArrayRef, Float64Array, Int64Array, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use datafusion::prelude::SessionContext;

use crate::common::{self, NODES};
use crate::join_sides::check;

const CUSTOMERS: i64 = 6_000;

/// A customer table: key `k` (in order, so that each slice holds a key
/// range), name, nation, a comment with NULLs.
fn customers(keys: impl Iterator<Item = Option<i64>>) -> RecordBatch {
    let keys: Vec<Option<i64>> = keys.collect();
    RecordBatch::try_new(
        Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, true),
            Field::new("name", DataType::Utf8, false),
            Field::new("nation", DataType::Int64, false),
            Field::new("note", DataType::Utf8, true),
            Field::new("bal", DataType::Float64, true),
        ])),
        vec![
            Arc::new(Int64Array::from(keys.clone())) as ArrayRef,
            Arc::new(StringArray::from_iter_values(
                (0..keys.len()).map(|i| format!("Customer#{i:09}")),
            )),
            Arc::new(Int64Array::from_iter_values(
                (0..keys.len() as i64).map(|i| i % 7),
            )),
            Arc::new(StringArray::from_iter((0..keys.len()).map(|i| {
                (i % 9 != 0).then(|| format!("note {} {}", i % 13, "x".repeat(i % 40)))
            }))),
            // Both zeros, which DataFusion's GROUP BY gives as 0.0.
            Arc::new(Float64Array::from_iter(
                (0..keys.len()).map(|i| [Some(-0.0), Some(0.0), Some(-2.5), None][i % 4]),
            )),
        ],
    )
    .unwrap()
}

fn tables() -> Vec<(&'static str, RecordBatch)> {
    let rows = 40_000i64;
    let orders = RecordBatch::try_new(
        Arc::new(Schema::new(vec![
            Field::new("ck", DataType::Int64, true),
            Field::new("amount", DataType::Int64, false),
            Field::new("tag", DataType::Utf8, false),
        ])),
        vec![
            // Keys of no customer past CUSTOMERS, and NULLs.
            Arc::new(Int64Array::from_iter(
                (0..rows).map(|i| (i % 23 != 0).then_some(i * 7919 % (CUSTOMERS + 500))),
            )) as ArrayRef,
            Arc::new(Int64Array::from_iter_values((0..rows).map(|i| i % 1_000))),
            Arc::new(StringArray::from_iter_values(
                (0..rows).map(|i| format!("t{}", i % 5)),
            )),
        ],
    )
    .unwrap();
    vec![
        ("cust", customers((0..CUSTOMERS).map(Some))),
        // Key 10 again in the last slice: not unique.
        (
            "cust_dup",
            customers((0..CUSTOMERS).map(|k| Some(if k == CUSTOMERS - 1 { 10 } else { k }))),
        ),
        // One NULL key: not a key the rule may join on.
        (
            "cust_null",
            customers((0..CUSTOMERS).map(|k| (k != 2_500).then_some(k))),
        ),
        ("ord", orders),
    ]
}

/// Queries over `{c}` (a customer table) and `ord`.
const QUERIES: &[&str] = &[
    // Q10's shape.
    "SELECT c.k, c.name, c.note, sum(o.amount) AS revenue, count(*) FROM {c} c \
     JOIN ord o ON c.k = o.ck WHERE c.nation < 5 \
     GROUP BY c.k, c.name, c.note ORDER BY revenue DESC, c.k LIMIT 20",
    "SELECT c.name, c.k, c.nation, o.tag, sum(o.amount), count(DISTINCT o.amount % 7) \
     FROM {c} c JOIN ord o ON c.k = o.ck GROUP BY c.name, c.k, c.nation, o.tag \
     HAVING count(*) > 1",
    "SELECT c.k, c.note, o.amount % 3 AS m, avg(o.amount) FROM ord o, {c} c \
     WHERE o.ck = c.k AND o.tag <> 't1' GROUP BY c.k, c.note, o.amount % 3",
    // The customer side padded: a group with a NULL key.
    "SELECT c.k, c.name, c.note, count(*), sum(o.amount) FROM ord o \
     LEFT JOIN (SELECT * FROM {c} WHERE nation <> 3) c ON o.ck = c.k \
     GROUP BY c.k, c.name, c.note",
    "SELECT c.k, c.name, count(o.ck), sum(o.amount) FROM {c} c \
     LEFT JOIN ord o ON o.ck = c.k GROUP BY c.k, c.name",
    "SELECT c.k, c.name, count(*), sum(o.amount) FROM ord o \
     RIGHT JOIN {c} c ON o.ck = c.k GROUP BY c.k, c.name",
    "SELECT c.k, c.name, count(*), sum(o.amount) FROM ord o \
     FULL JOIN (SELECT * FROM {c} WHERE nation < 4) c ON o.ck = c.k \
     GROUP BY c.k, c.name",
    "SELECT c.k, c.name, sum(o.amount) AS revenue FROM {c} c JOIN ord o ON c.k = o.ck \
     GROUP BY c.k, c.name ORDER BY revenue, c.k DESC LIMIT 5 OFFSET 3",
    // A float moved with the strings, with both zeros.
    "SELECT c.k, c.name, c.bal, sum(o.amount) FROM {c} c JOIN ord o ON c.k = o.ck \
     GROUP BY c.k, c.name, c.bal",
    // Renamed under a subquery alias.
    "SELECT x.id, x.label, sum(o.amount) FROM \
     (SELECT k AS id, name AS label FROM {c} WHERE nation > 1) x \
     JOIN ord o ON x.id = o.ck GROUP BY x.id, x.label",
    // Semi join below, and few rows.
    "SELECT c.k, c.name, count(*) FROM {c} c WHERE c.k IN \
     (SELECT ck FROM ord WHERE amount < 10) GROUP BY c.k, c.name",
    "SELECT c.k, c.name, sum(o.amount) FROM {c} c JOIN ord o ON c.k = o.ck \
     WHERE o.amount > 990 GROUP BY c.k, c.name",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_columns_a_unique_key_decides_are_joined_after_the_aggregation() {
    let root = common::empty_root("late-columns", NODES);
    let (cluster, session) = common::cluster_with_catalog(&root, NODES).await;
    let reference = SessionContext::new();
    // One partition loads the rows in order: each slice holds a key range.
    session
        .sql("SET datafusion.execution.target_partitions = 1")
        .await
        .unwrap();
    common::create_owned_tables(
        &session,
        &reference,
        tables(),
        "slice_rows = 1000, page_rows = 256",
    )
    .await;
    session
        .sql("SET datafusion.execution.target_partitions = 2")
        .await
        .unwrap();

    for on in [true, false] {
        session
            .sql(&format!("SET sieve.late_group_columns = {on}"))
            .await
            .unwrap();
        for table in ["cust", "cust_dup", "cust_null"] {
            for (index, template) in QUERIES.iter().enumerate() {
                let sql = template.replace("{c}", table);
                check(&session, &reference, &sql, "ord").await;
                let plan = common::explain(&session.context, &sql).await;
                // Every query is rewritten where the key is unique.
                let rewritten = plan.contains("__sieve_late");
                assert_eq!(
                    rewritten,
                    on && table == "cust",
                    "query {index} over {table}, late_group_columns = {on}:\n{plan}"
                );
            }
        }
    }
    // The rewrite reads the customer table again for the 20 groups'
    // strings; the joins below carry keys only.
    session
        .sql("SET sieve.late_group_columns = true")
        .await
        .unwrap();
    let plan = common::explain(&session.context, &QUERIES[0].replace("{c}", "cust")).await;
    let aggregate = plan
        .lines()
        .find(|line| line.contains("Aggregate: groupBy="))
        .unwrap_or_else(|| panic!("no aggregation in\n{plan}"));
    assert!(!aggregate.contains("name"), "{aggregate}");
    // The top 20 groups are taken below the join, and again above it.
    let sorts = plan
        .lines()
        .filter(|line| {
            line.contains("Sort: revenue DESC") || line.contains("Sort: sum(o.amount) DESC")
        })
        .count();
    assert_eq!(sorts, 2, "{plan}");
    drop(session);
    drop(cluster);
    let _ = std::fs::remove_dir_all(&root);
}
