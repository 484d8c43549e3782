//! Grouped `count(DISTINCT x)` over joins counted by sets of (group,
//! value) pairs (`sieve.count_distinct_by_sets`, TPC-H Q16's distinct
//! suppliers): integers of several widths, NULLs, unmatched keys, a
//! skewed group, an empty table, left and inner joins, other aggregates beside it,
//! against plain DataFusion; the shapes DataFusion's regrouping keeps (no
//! GROUP BY, a string argument, one table's scan) are left to it.

use std::sync::Arc;

use arrow::array::{ArrayRef, Int32Array, Int64Array, StringArray, UInt16Array};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use datafusion::prelude::SessionContext;
use sieve_compute::SETS_BATCH_ROWS;

use crate::common::{self, NODES};
use crate::join_sides::check;

fn tables() -> Vec<(&'static str, RecordBatch)> {
    let rows = 30_000i64;
    let fact = RecordBatch::try_new(
        Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("k", DataType::Int64, true),
            Field::new("x", DataType::Int64, true),
            Field::new("y", DataType::Int32, true),
            Field::new("u", DataType::UInt16, true),
            Field::new("s", DataType::Utf8, true),
        ])),
        vec![
            Arc::new(Int64Array::from_iter_values(0..rows)) as ArrayRef,
            // Skewed: half the facts have key 1; keys past 1,000 find no
            // dimension row; some are NULL.
            Arc::new(Int64Array::from_iter((0..rows).map(|i| match i % 31 {
                0 => None,
                _ if i % 2 == 0 => Some(1),
                _ => Some((i * 7) % 1_100),
            }))),
            // Many repeated values per group, and NULLs.
            Arc::new(Int64Array::from_iter(
                (0..rows).map(|i| (i % 13 != 0).then_some((i * 11) % 4_001 - 2_000)),
            )),
            Arc::new(Int32Array::from_iter(
                (0..rows).map(|i| (i % 17 != 0).then_some((i % 97) as i32 - 50)),
            )),
            Arc::new(UInt16Array::from_iter(
                (0..rows).map(|i| (i % 19 != 0).then_some((i % 300) as u16)),
            )),
            Arc::new(StringArray::from_iter(
                (0..rows).map(|i| (i % 23 != 0).then(|| format!("s{}", i % 41))),
            )),
        ],
    )
    .unwrap();
    let keys = 1_000i64;
    let dim = RecordBatch::try_new(
        Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, true),
            Field::new("g", DataType::Int64, false),
            Field::new("name", DataType::Utf8, true),
        ])),
        vec![
            Arc::new(Int64Array::from_iter(
                (0..keys).map(|k| (k != 500).then_some(k)),
            )) as ArrayRef,
            Arc::new(Int64Array::from_iter_values((0..keys).map(|k| k % 37))),
            Arc::new(StringArray::from_iter(
                (0..keys).map(|k| (k % 29 != 0).then(|| format!("n{}", k % 7))),
            )),
        ],
    )
    .unwrap();
    // No rows at all: every dimension row's count is 0.
    let none = RecordBatch::new_empty(Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int64, true),
        Field::new("x", DataType::Int64, true),
    ])));
    vec![("fact", fact), ("dim", dim), ("none", none)]
}

/// The tables on an embedded cluster (with a catalog under a fresh root
/// named `name`) and in plain DataFusion.
async fn loaded(
    name: &str,
) -> (
    std::path::PathBuf,
    sieve_cli::cluster::EmbeddedCluster,
    sieve_compute::SieveSession,
    SessionContext,
) {
    let root = common::empty_root(name, NODES);
    let (cluster, session) = common::cluster_with_catalog(&root, NODES).await;
    let reference = SessionContext::new();
    common::create_owned_tables(
        &session,
        &reference,
        tables(),
        "slice_rows = 5000, page_rows = 512",
    )
    .await;
    (root, cluster, session, reference)
}

/// Queries counted by sets: grouped, an integer argument, over a join.
const TAKEN: &[&str] = &[
    // Q16's shape: distinct values per group of the other side's columns.
    "SELECT d.name, d.g, count(DISTINCT f.x) AS c FROM fact f JOIN dim d ON f.k = d.k \
     GROUP BY d.name, d.g",
    // Beside other aggregates, grouped by an expression.
    "SELECT d.g % 5 AS b, count(DISTINCT f.y) AS c, sum(f.x) AS s, max(f.id) AS m \
     FROM fact f JOIN dim d ON f.k = d.k GROUP BY d.g % 5",
    // A left join: facts without a dimension row count in the NULL group,
    // dimension rows without facts count 0.
    "SELECT d.name, count(DISTINCT f.u) AS c FROM dim d LEFT JOIN fact f ON f.k = d.k \
     GROUP BY d.name",
    "SELECT f.s, count(DISTINCT d.g) AS c FROM fact f LEFT JOIN dim d ON f.k = d.k \
     GROUP BY f.s",
    // Two DISTINCT arguments (never regrouped), and one under HAVING.
    "SELECT d.g, count(DISTINCT f.x) AS cx, count(DISTINCT f.y) AS cy FROM fact f \
     JOIN dim d ON f.k = d.k GROUP BY d.g",
    "SELECT d.name, count(DISTINCT f.x) AS c FROM fact f JOIN dim d ON f.k = d.k \
     WHERE f.id % 3 = 0 GROUP BY d.name HAVING count(DISTINCT f.x) > 10",
    // An empty side.
    "SELECT d.g, count(DISTINCT n.x) AS c FROM dim d LEFT JOIN none n ON n.k = d.k \
     GROUP BY d.g",
];

/// Queries DataFusion regroups (its alias `alias1` in the plan).
const NOT_TAKEN: &[&str] = &[
    // No GROUP BY.
    "SELECT count(DISTINCT f.x) AS c, sum(f.y) AS s FROM fact f JOIN dim d ON f.k = d.k",
    // A string argument.
    "SELECT d.g, count(DISTINCT f.s) AS c FROM fact f JOIN dim d ON f.k = d.k GROUP BY d.g",
    // One table's scan: its inner grouping goes to the storage nodes.
    "SELECT s, count(DISTINCT x) AS c FROM fact WHERE id > 100 GROUP BY s",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grouped_distinct_counts_over_joins_are_counted_by_sets() {
    let (root, cluster, session, reference) = loaded("distinct-counts").await;

    for on in [true, false] {
        session
            .sql(&format!("SET sieve.count_distinct_by_sets = {on}"))
            .await
            .unwrap();
        for (queries, taken) in [(TAKEN, true), (NOT_TAKEN, false)] {
            for (index, sql) in queries.iter().enumerate() {
                check(&session, &reference, sql, "fact").await;
                let plan = common::explain(&session.context, sql).await;
                let regrouped = plan.contains("alias1");
                let by_sets = plan.contains("aggr=[count(DISTINCT");
                // Two DISTINCT arguments are never regrouped.
                let either = index == 4 && taken;
                assert_eq!(
                    (by_sets, regrouped),
                    (on && taken || either, !(on && taken || either)),
                    "query {index} (taken: {taken}), count_distinct_by_sets = {on}:\n{plan}"
                );
                // The aggregation that merges the sets runs with small
                // batches, its input with the session's.
                let lines: Vec<&str> = plan.lines().map(str::trim).collect();
                let small_batches = lines.windows(3).any(|window| {
                    window[0] == format!("BatchRowsExec: rows={SETS_BATCH_ROWS}")
                        && window[1].starts_with("AggregateExec: mode=")
                        && !window[1].starts_with("AggregateExec: mode=Partial")
                        && window[1].contains("count(DISTINCT")
                        && window[2] == "BatchRowsExec: rows=8192"
                });
                assert_eq!(
                    small_batches, by_sets,
                    "query {index}, count_distinct_by_sets = {on}:\n{plan}"
                );
            }
        }
    }
    drop(session);
    drop(cluster);
    let _ = std::fs::remove_dir_all(&root);
}

/// Under a statement pool too small for the sets, the partial aggregation
/// emits its groups early and the final one spills, again and again: each
/// time the sets' memory must come back (DataFusion's accumulator kept its
/// capacity, and the query failed with `Resources exhausted`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distinct_counts_under_a_small_statement_pool_keep_their_answers() {
    let (root, cluster, session, reference) = loaded("distinct-counts-pool").await;
    session
        .apply_settings(&[
            "sieve.query_memory_limit=1M".into(),
            "datafusion.execution.target_partitions=2".into(),
            "datafusion.execution.sort_spill_reservation_bytes=65536".into(),
        ])
        .unwrap();
    for sql in TAKEN {
        check(&session, &reference, sql, "fact").await;
    }
    drop(session);
    drop(cluster);
    let _ = std::fs::remove_dir_all(&root);
}
