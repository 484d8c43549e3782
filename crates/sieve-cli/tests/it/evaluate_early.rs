//! Expressions of one join input's columns evaluated below the join
//! (`sieve.evaluate_before_joins`, TPC-H Q9's profit, Q5's and Q10's
//! revenue in an aggregation): decimals, integers,
//! floats with NaN, booleans, NULLs and unmatched keys, inner, left,
//! right, semi and full joins, against plain DataFusion; the shapes the
//! rule leaves alone (a padded input, division, a string result, columns
//! still read above, a scan's own rows) are left as they are.

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

/// Queries the rule takes: an expression of one input of a join that is
/// itself a join's result.
const TAKEN: &[&str] = &[
    // Q9's shape: profit of the fact and dimension rows, above a join
    // with the regions.
    "SELECT x.region, sum(x.amount) AS s, count(x.amount) AS n FROM (SELECT r.region, \
     f.price * (1 - f.disc) - dim.cost * f.qty AS amount FROM fact f JOIN dim ON f.k = dim.k \
     LEFT JOIN regions r ON f.d = r.d) x GROUP BY x.region",
    // Inner joins throughout, the expression of the fact alone.
    "SELECT r.region, dim.g, f.price * f.qty + f.disc AS v FROM fact f JOIN dim ON f.k = dim.k \
     JOIN regions r ON f.d = r.d WHERE dim.g < 5",
    // Floats with NaN and -0.0, an integer widened to a float.
    "SELECT r.region, f.f * 2.0 + f.qty AS v, f.id FROM fact f JOIN dim ON f.k = dim.k \
     LEFT JOIN regions r ON f.d = r.d WHERE f.id % 3 = 0",
    // A CASE and a boolean (Q8's shape), NULL flags.
    "SELECT q.region, sum(CASE WHEN q.g > 20 THEN q.price * q.disc ELSE 0 END) AS a, \
     count(*) FILTER (WHERE q.x) AS b FROM (SELECT r.region, dim.g, f.price, f.disc, \
     (f.qty > dim.g AND f.flag) AS x FROM fact f JOIN dim ON f.k = dim.k \
     LEFT JOIN regions r ON f.d = r.d) q GROUP BY q.region",
    // Aggregate arguments (Q5's and Q10's revenue), a FILTER of the other
    // input's column, DISTINCT.
    "SELECT r.region, sum(f.price * (1 - f.disc)) AS rev, count(*) AS n, \
     min(f.qty) FILTER (WHERE dim.g > 3) AS g \
     FROM fact f JOIN dim ON f.k = dim.k JOIN regions r ON f.d = r.d GROUP BY r.region",
    "SELECT dim.name, avg(f.f * 2.0 + f.qty) AS a, count(DISTINCT f.price * f.qty) AS m FROM fact f \
     JOIN dim ON f.k = dim.k LEFT JOIN regions r ON f.d = r.d WHERE f.id % 2 = 0 \
     GROUP BY dim.name",
    // The kept side of a semi join.
    "SELECT f.id, f.price * f.qty - dim.cost AS v FROM fact f JOIN dim ON f.k = dim.k \
     WHERE f.d IN (SELECT d FROM regions WHERE w > 10)",
    // The preserved side of a right join.
    "SELECT r.region, q.price * q.qty - q.cost AS v FROM regions r RIGHT JOIN (SELECT f.d, \
     f.price, f.qty, dim.cost FROM fact f JOIN dim ON f.k = dim.k) q ON q.d = r.d",
];

/// Queries the rule leaves as they are.
const NOT_TAKEN: &[&str] = &[
    // The padded side of a left join: the expression differs there.
    "SELECT f.id, CASE WHEN q.cost IS NULL THEN 1 ELSE q.cost * q.w END AS v FROM fact f \
     LEFT JOIN (SELECT dim.k, dim.cost, r.w FROM dim JOIN regions r ON dim.g = r.d) q \
     ON f.k = q.k WHERE f.id < 3000",
    // A full join pads both sides.
    "SELECT q.v * 2 AS v2, r.region FROM (SELECT f.d, f.price * f.qty - dim.cost AS v \
     FROM fact f JOIN dim ON f.k = dim.k) q FULL JOIN regions r ON q.d = r.d",
    // Division may fail on rows the join drops.
    "SELECT r.region, f.price / f.qty + dim.cost AS v FROM fact f JOIN dim ON f.k = dim.k \
     LEFT JOIN regions r ON f.d = r.d WHERE f.qty <> 0",
    "SELECT dim.name, sum(f.price / f.qty) AS s FROM fact f JOIN dim ON f.k = dim.k \
     LEFT JOIN regions r ON f.d = r.d WHERE f.qty <> 0 GROUP BY dim.name",
    // A string result.
    "SELECT r.region, f.tag || dim.name AS v FROM fact f JOIN dim ON f.k = dim.k \
     LEFT JOIN regions r ON f.d = r.d",
    // The columns read stay read above: nothing freed.
    "SELECT r.region, f.price, f.qty, f.price * f.qty AS v FROM fact f JOIN dim ON f.k = dim.k \
     LEFT JOIN regions r ON f.d = r.d",
    // Of both inputs.
    "SELECT f.price * r.w AS v FROM fact f JOIN dim ON f.k = dim.k LEFT JOIN regions r \
     ON f.d = r.d",
    // One input a scan: its rows stream.
    "SELECT dim.name, f.price * f.qty AS v FROM fact f JOIN dim ON f.k = dim.k",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expressions_of_one_join_input_are_evaluated_below_the_join() {
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

    // Q9's shape: the expression sinks below the join whose input it reads
    // and no further, and the join above it holds its one value in place
    // of the four columns.
    session
        .sql("SET sieve.evaluate_before_joins = true")
        .await
        .unwrap();
    let plan = common::explain(&session.context, TAKEN[0]).await;
    let moved = plan
        .lines()
        .position(|line| line.contains("AS __sieve_early"))
        .unwrap_or_else(|| panic!("{plan}"));
    let joins_above = plan
        .lines()
        .take(moved)
        .filter(|l| l.contains("Join:"))
        .count();
    assert_eq!(joins_above, 1, "{plan}");
    drop(session);
    drop(cluster);
    let _ = std::fs::remove_dir_all(&root);
}
