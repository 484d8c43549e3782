//! A join's many side aggregated before the join where each group is one
//! row of the other side (`sieve.aggregate_before_join`, TPC-H Q13's
//! orders counted per customer): tables a user owns, a key proven unique
//! from the slices' summaries, left and inner joins, every aggregate the
//! rule takes, NULL and unmatched keys, against plain DataFusion; keys
//! that are not unique (a duplicate in another slice, a NULL) and shapes
//! the rule does not take are left as they are.

use std::sync::Arc;

use arrow::array::{ArrayRef, Float32Array, Float64Array, Int64Array, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use datafusion::prelude::SessionContext;

use crate::common::{self, NODES};
use crate::join_sides::check;

const PARENTS: i64 = 3_000;

/// A parent table: key `k` (in order, so that each slice holds a key
/// range), a grouping column `g` that is not unique, a name.
fn parents(keys: impl Iterator<Item = Option<i64>>) -> RecordBatch {
    let keys: Vec<Option<i64>> = keys.collect();
    RecordBatch::try_new(
        Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, true),
            Field::new("g", DataType::Int64, false),
            Field::new("name", DataType::Utf8, false),
            Field::new("pf", DataType::Float64, true),
            Field::new("ph", DataType::Float32, true),
        ])),
        vec![
            Arc::new(Int64Array::from(keys.clone())) as ArrayRef,
            Arc::new(Int64Array::from_iter_values(
                (0..keys.len() as i64).map(|i| i % 7),
            )),
            Arc::new(StringArray::from_iter_values(
                (0..keys.len()).map(|i| format!("P{i}")),
            )),
            // Both zeros, which DataFusion's GROUP BY gives as 0.0.
            Arc::new(Float64Array::from_iter(
                (0..keys.len()).map(|i| [Some(-0.0), Some(0.0), Some(1.5), None][i % 4]),
            )),
            Arc::new(Float32Array::from_iter(
                (0..keys.len()).map(|i| [Some(0.0), Some(-0.0), Some(f32::NAN)][i % 3]),
            )),
        ],
    )
    .unwrap()
}

fn tables() -> Vec<(&'static str, RecordBatch)> {
    let rows = 30_000i64;
    let children = RecordBatch::try_new(
        Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("pk", DataType::Int64, true),
            Field::new("v", DataType::Int64, true),
            Field::new("f", DataType::Float64, true),
            Field::new("tag", DataType::Utf8, false),
        ])),
        vec![
            Arc::new(Int64Array::from_iter_values(0..rows)) as ArrayRef,
            // Nine rows a key, in order (a slice holds few keys), keys of
            // no parent past PARENTS, parents with no child (every key
            // that is 3 mod 4), and NULLs.
            Arc::new(Int64Array::from_iter((0..rows).map(|i| {
                let key = i / 9;
                (i % 17 != 0 && key % 4 != 3).then_some(key)
            }))),
            Arc::new(Int64Array::from_iter(
                (0..rows).map(|i| (i % 11 != 0).then_some(i % 1_000 - 300)),
            )),
            Arc::new(Float64Array::from_iter(
                (0..rows).map(|i| (i % 13 != 0).then_some((i % 97) as f64 / 4.0)),
            )),
            Arc::new(StringArray::from_iter_values(
                (0..rows).map(|i| format!("t{}", i % 5)),
            )),
        ],
    )
    .unwrap();
    vec![
        ("par", parents((0..PARENTS).map(Some))),
        // Key 10 again in the last slice: not unique.
        (
            "par_dup",
            parents((0..PARENTS).map(|k| Some(if k == PARENTS - 1 { 10 } else { k }))),
        ),
        // One NULL key.
        (
            "par_null",
            parents((0..PARENTS).map(|k| (k != 1_500).then_some(k))),
        ),
        ("child", children),
        (
            "empty_child",
            RecordBatch::new_empty(Arc::new(Schema::new(vec![
                Field::new("pk", DataType::Int64, true),
                Field::new("v", DataType::Int64, true),
            ]))),
        ),
    ]
}

/// Queries over `{p}` (a parent table) and `child` the rule takes where
/// `{p}`'s key is unique.
const TAKEN: &[&str] = &[
    // Q13's shape.
    "SELECT cnt, count(*) AS n FROM (SELECT p.k, count(c.id) AS cnt FROM {p} p \
     LEFT JOIN child c ON p.k = c.pk AND c.tag NOT LIKE 't3%' GROUP BY p.k) x GROUP BY cnt",
    // Every aggregate the rule takes, left and inner.
    "SELECT p.k, count(*), count(c.v), count(DISTINCT c.v % 10), sum(c.v), min(c.v), \
     max(c.v), avg(c.v), sum(c.f), min(c.tag), max(c.f) FROM {p} p \
     LEFT JOIN child c ON p.k = c.pk GROUP BY p.k",
    "SELECT p.k, count(*), count(c.v), count(DISTINCT c.v % 10), sum(c.v), min(c.v), \
     max(c.v), avg(c.v), sum(c.f) FROM {p} p JOIN child c ON p.k = c.pk GROUP BY p.k",
    // The parent's other columns grouped too, a filter on each side.
    "SELECT p.name, p.k, p.g, count(c.id), sum(c.v) FROM {p} p LEFT JOIN child c \
     ON p.k = c.pk WHERE p.g < 5 GROUP BY p.g, p.k, p.name",
    "SELECT p.k, p.g, sum(c.v * 2 + 1) AS s, count(*) FROM child c JOIN {p} p \
     ON c.pk = p.k WHERE c.v > 100 AND p.k % 3 = 0 GROUP BY p.k, p.g HAVING count(*) > 1",
    // Float group columns of the parent, with both zeros.
    "SELECT p.pf, p.k, p.ph, count(c.id), sum(c.v) FROM {p} p LEFT JOIN child c \
     ON p.k = c.pk GROUP BY p.pf, p.k, p.ph",
    // The parent under a subquery alias, renamed.
    "SELECT x.id, count(c.v) FROM (SELECT k AS id, g FROM {p} WHERE g <> 2) x \
     LEFT JOIN child c ON x.id = c.pk GROUP BY x.id",
    // The join key as an expression of the child's column.
    "SELECT p.k, count(c.id), max(c.v) FROM {p} p LEFT JOIN child c ON p.k = c.pk + 1 \
     GROUP BY p.k",
    // An empty many side: every parent counts 0.
    "SELECT p.k, count(e.v), count(*), sum(e.v) FROM {p} p LEFT JOIN empty_child e \
     ON p.k = e.pk GROUP BY p.k",
    // The child's key joined twice: grouped by it once (the rule indexed
    // past its aggregation's columns and panicked, fuzzer seed 20261702).
    "SELECT p.k, max(c.v), avg(c.v) FROM child c JOIN {p} p ON c.pk = p.k AND c.pk = p.g \
     GROUP BY p.k",
    "SELECT p.k, count(c.id), count(*) FROM {p} p LEFT JOIN child c ON p.k = c.pk \
     AND p.g = c.pk GROUP BY p.k",
];

/// Queries the rule leaves as they are whatever the key.
const NOT_TAKEN: &[&str] = &[
    // A group of the many side.
    "SELECT p.k, c.tag, count(*) FROM {p} p JOIN child c ON p.k = c.pk GROUP BY p.k, c.tag",
    // No unique column among the groups.
    "SELECT p.g, count(c.id) FROM {p} p LEFT JOIN child c ON p.k = c.pk GROUP BY p.g",
    // A residual filter over both sides.
    "SELECT p.k, count(c.id) FROM {p} p LEFT JOIN child c ON p.k = c.pk AND c.v > p.g \
     GROUP BY p.k",
    // An aggregate of the parent's columns.
    "SELECT p.k, sum(p.g), count(c.id) FROM {p} p JOIN child c ON p.k = c.pk GROUP BY p.k",
    // Over a left join, an argument that is not NULL on a padded row.
    "SELECT p.k, sum(1), count(c.id) FROM {p} p LEFT JOIN child c ON p.k = c.pk GROUP BY p.k",
    "SELECT p.k, count(coalesce(c.v, 0)) FROM {p} p LEFT JOIN child c ON p.k = c.pk \
     GROUP BY p.k",
    "SELECT p.k, max(CASE WHEN c.v IS NULL THEN 7 ELSE c.v END) FROM {p} p \
     LEFT JOIN child c ON p.k = c.pk GROUP BY p.k",
    // The child side preserved.
    "SELECT p.k, count(c.id) FROM child c LEFT JOIN {p} p ON p.k = c.pk GROUP BY p.k",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_many_side_is_aggregated_before_a_join_whose_groups_are_rows() {
    let root = common::empty_root("aggregate-first", NODES);
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
            .sql(&format!("SET sieve.aggregate_before_join = {on}"))
            .await
            .unwrap();
        for table in ["par", "par_dup", "par_null"] {
            for (queries, taken) in [(TAKEN, true), (NOT_TAKEN, false)] {
                for (index, template) in queries.iter().enumerate() {
                    let sql = template.replace("{p}", table);
                    check(&session, &reference, &sql, "child").await;
                    let plan = common::explain(&session.context, &sql).await;
                    let rewritten = plan.contains("__sieve_first");
                    assert_eq!(
                        rewritten,
                        on && taken && table == "par",
                        "query {index} (taken: {taken}) over {table}, \
                         aggregate_before_join = {on}:\n{plan}"
                    );
                }
            }
        }
    }

    // Q13's shape ships the children's partial counts per key and slice,
    // not every child row.
    let sql = TAKEN[0].replace("{p}", "par");
    session
        .sql("SET sieve.aggregate_before_join = false")
        .await
        .unwrap();
    let before = check(&session, &reference, &sql, "child").await;
    session
        .sql("SET sieve.aggregate_before_join = true")
        .await
        .unwrap();
    let after = check(&session, &reference, &sql, "child").await;
    assert!(
        after * 2 < before,
        "child rows shipped: {after} with the rule, {before} without"
    );
    let plan = common::explain(&session.context, &sql).await;
    assert!(plan.contains("pushed aggregate"), "{plan}");
    drop(session);
    drop(cluster);
    let _ = std::fs::remove_dir_all(&root);
}
