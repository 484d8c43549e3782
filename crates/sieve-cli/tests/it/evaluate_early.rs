//! Expressions of a hash join's build side evaluated below the join
//! (`sieve.evaluate_before_joins`, TPC-H Q9's profit): decimals, integers,
//! booleans, NULLs and unmatched keys, inner, left, right, semi and full
//! joins, against plain DataFusion; the shapes the rule leaves alone (the
//! probe side, a padded build side, division, a string result, columns
//! still read above) are left as they are.

use std::sync::Arc;

use arrow::array::{
    ArrayRef, BooleanArray, Decimal128Array, Float64Array, Int32Array, Int64Array, StringArray,
};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use datafusion::prelude::SessionContext;

use crate::common::{self, NODES};
use crate::join_sides::check;

fn decimals(values: impl Iterator<Item = Option<i128>>) -> ArrayRef {
    Arc::new(
        Decimal128Array::from_iter(values)
            .with_precision_and_scale(12, 2)
            .unwrap(),
    )
}

fn tables() -> Vec<(&'static str, RecordBatch)> {
    let rows = 20_000i64;
    let fact = RecordBatch::try_new(
        Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("k", DataType::Int64, true),
            Field::new("d", DataType::Int64, true),
            Field::new("price", DataType::Decimal128(12, 2), true),
            Field::new("disc", DataType::Decimal128(12, 2), false),
            Field::new("qty", DataType::Int32, true),
            Field::new("f", DataType::Float64, true),
            Field::new("flag", DataType::Boolean, true),
            Field::new("tag", DataType::Utf8, false),
        ])),
        vec![
            Arc::new(Int64Array::from_iter_values(0..rows)) as ArrayRef,
            // Keys of no dimension row past 2,000, and NULLs.
            Arc::new(Int64Array::from_iter(
                (0..rows).map(|i| (i % 19 != 0).then_some((i * 7) % 2_300)),
            )),
            Arc::new(Int64Array::from_iter(
                (0..rows).map(|i| (i % 23 != 0).then_some(i % 60)),
            )),
            decimals((0..rows).map(|i| (i % 13 != 0).then_some(i128::from(i % 9_999) * 37))),
            decimals((0..rows).map(|i| Some(i128::from(i % 11)))),
            Arc::new(Int32Array::from_iter(
                (0..rows).map(|i| (i % 17 != 0).then_some((i % 50) as i32 - 5)),
            )),
            Arc::new(Float64Array::from_iter((0..rows).map(|i| match i % 29 {
                0 => None,
                1 => Some(f64::NAN),
                2 => Some(-0.0),
                _ => Some((i % 101) as f64 / 8.0 - 3.0),
            }))),
            Arc::new(BooleanArray::from_iter(
                (0..rows).map(|i| (i % 7 != 0).then_some(i % 3 == 0)),
            )),
            Arc::new(StringArray::from_iter_values(
                (0..rows).map(|i| format!("t{}", i % 5)),
            )),
        ],
    )
    .unwrap();
    let keys = 2_000i64;
    let dim = RecordBatch::try_new(
        Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, true),
            Field::new("g", DataType::Int64, false),
            Field::new("cost", DataType::Decimal128(12, 2), true),
            Field::new("name", DataType::Utf8, false),
        ])),
        vec![
            Arc::new(Int64Array::from_iter(
                (0..keys).map(|k| (k != 700).then_some(k)),
            )) as ArrayRef,
            Arc::new(Int64Array::from_iter_values((0..keys).map(|k| k % 40))),
            decimals((0..keys).map(|k| (k % 31 != 0).then_some(i128::from(k % 500) * 3))),
            Arc::new(StringArray::from_iter_values(
                (0..keys).map(|k| format!("n{}", k % 9)),
            )),
        ],
    )
    .unwrap();
    let regions = RecordBatch::try_new(
        Arc::new(Schema::new(vec![
            Field::new("d", DataType::Int64, false),
            Field::new("region", DataType::Utf8, false),
            Field::new("w", DataType::Int32, true),
        ])),
        vec![
            // Days 0 to 49: facts of days 50 to 59 find none.
            Arc::new(Int64Array::from_iter_values(0..50)) as ArrayRef,
            Arc::new(StringArray::from_iter_values(
                (0..50).map(|d| format!("R{}", d % 4)),
            )),
            Arc::new(Int32Array::from_iter(
                (0..50).map(|d| (d % 6 != 0).then_some(d * 3)),
            )),
        ],
    )
    .unwrap();
    vec![("fact", fact), ("dim", dim), ("regions", regions)]
}

/// Queries the rule takes: an expression of a join's build side (the
/// dimension joined with the regions, built, the facts probing it), in
/// the SQL's join order.
const TAKEN: &[&str] = &[
    // Q9's shape: the profit of the build rows, summed above the join.
    "SELECT x.region, sum(x.amount) AS s, count(x.amount) AS n FROM (SELECT r.region, \
     dim.cost * (1 + r.w) - dim.cost * dim.g AS amount FROM dim JOIN regions r ON dim.g = r.d \
     JOIN fact f ON f.k = dim.k) x GROUP BY x.region",
    // A left join keeps every build row; a CASE, a widening cast, NULLs.
    "SELECT dim.k, f.id, CASE WHEN r.w IS NULL THEN dim.g ELSE dim.g * r.w END AS v, \
     dim.cost * 2 AS c FROM dim JOIN regions r ON dim.g = r.d LEFT JOIN fact f ON f.k = dim.k",
    // A boolean, and an expression of the build side next to probe columns.
    "SELECT f.id, f.price, (dim.cost > r.w AND r.w IS NOT NULL) AS b FROM dim \
     JOIN regions r ON dim.g = r.d JOIN fact f ON f.k = dim.k WHERE f.id % 3 = 0",
    // A join filter over both sides: its build column stays, renumbered.
    "SELECT f.id, dim.cost * (1 + r.w) AS v FROM dim JOIN regions r ON dim.g = r.d \
     JOIN fact f ON f.k = dim.k AND f.qty < dim.g",
    // The kept side of a semi join.
    "SELECT dim.k, dim.cost * r.w AS v FROM dim JOIN regions r ON dim.g = r.d \
     WHERE dim.k IN (SELECT k FROM fact)",
];

/// Queries the rule leaves as they are.
const NOT_TAKEN: &[&str] = &[
    // The probe side's expression: it streams.
    "SELECT r.region, f.price * f.qty - f.disc AS v FROM dim JOIN regions r ON dim.g = r.d \
     JOIN fact f ON f.k = dim.k",
    // A build side the join pads with NULLs: the expression differs there.
    "SELECT f.id, CASE WHEN dim.cost IS NULL THEN 1 ELSE dim.cost * r.w END AS v FROM dim \
     JOIN regions r ON dim.g = r.d RIGHT JOIN fact f ON f.k = dim.k WHERE f.id < 3000",
    "SELECT f.id, CASE WHEN dim.cost IS NULL THEN 1 ELSE dim.cost * r.w END AS v FROM dim \
     JOIN regions r ON dim.g = r.d FULL JOIN fact f ON f.k = dim.k",
    // Division may fail on rows the join drops.
    "SELECT f.id, dim.cost / r.w AS v FROM dim JOIN regions r ON dim.g = r.d \
     JOIN fact f ON f.k = dim.k",
    // A string result.
    "SELECT f.id, dim.name || r.region AS v FROM dim JOIN regions r ON dim.g = r.d \
     JOIN fact f ON f.k = dim.k",
    // The columns read stay read above: nothing freed.
    "SELECT f.id, dim.cost, r.w, dim.cost * r.w AS v FROM dim JOIN regions r \
     ON dim.g = r.d JOIN fact f ON f.k = dim.k",
    // Of both sides.
    "SELECT f.id, dim.cost * f.qty AS v FROM dim JOIN regions r ON dim.g = r.d \
     JOIN fact f ON f.k = dim.k",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expressions_of_a_hash_joins_build_side_are_evaluated_below_it() {
    let root = common::empty_root("evaluate-early", NODES);
    let (cluster, session) = common::cluster_with_catalog(&root, NODES).await;
    let reference = SessionContext::new();
    common::create_owned_tables(
        &session,
        &reference,
        tables(),
        "slice_rows = 4000, page_rows = 512",
    )
    .await;

    // The SQL's join order: the dimension's join with the regions is
    // built, the facts probe it.
    session.sql("SET sieve.order_joins = false").await.unwrap();
    for on in [true, false] {
        session
            .sql(&format!("SET sieve.evaluate_before_joins = {on}"))
            .await
            .unwrap();
        for (queries, taken) in [(TAKEN, true), (NOT_TAKEN, false)] {
            for (index, sql) in queries.iter().enumerate() {
                check(&session, &reference, sql, "fact").await;
                let plan = common::explain(&session.context, sql).await;
                assert_eq!(
                    plan.contains("__sieve_early"),
                    on && taken,
                    "query {index} (taken: {taken}), evaluate_before_joins = {on}:\n{plan}"
                );
            }
        }
    }

    // Q9's shape: the build side holds the one value, not its columns.
    session
        .sql("SET sieve.evaluate_before_joins = true")
        .await
        .unwrap();
    let plan = common::explain(&session.context, TAKEN[0]).await;
    let join = plan
        .lines()
        .position(|line| line.contains("HashJoinExec") && line.contains("k@"))
        .unwrap_or_else(|| panic!("{plan}"));
    let moved = plan
        .lines()
        .position(|line| line.contains("as __sieve_early"))
        .unwrap_or_else(|| panic!("{plan}"));
    assert!(moved > join, "{plan}");
    drop(session);
    drop(cluster);
    let _ = std::fs::remove_dir_all(&root);
}
