//! Grouped aggregations on one integer key run by the key's value
//! (`DenseAggregateExec`, `sieve.dense_aggregate_bytes_max`): every
//! integer type, NULL keys, keys it must refuse (negative, past the
//! groups allowed, past i64), aggregate filters, empty input, the
//! single-stage and two-stage plans, and the fallback to DataFusion's
//! aggregation with the states gathered so far; answers against plain
//! DataFusion over the same rows.

use std::sync::Arc;

use arrow::array::{
    ArrayRef, BooleanArray, Decimal128Array, Float64Array, Int16Array, Int32Array, Int64Array,
    Int8Array, StringArray, UInt16Array, UInt32Array, UInt64Array, UInt8Array,
};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use datafusion::physical_plan::{collect, ExecutionPlan};
use datafusion::prelude::SessionContext;
use sieve_cli::compare::{rows_as_text, run};
use sieve_compute::{DenseAggregateExec, SieveSession};

use crate::common::{self, NODES};
use crate::plans::{metric, physical_plan};

const ROWS: usize = 20_000;

fn table() -> RecordBatch {
    let rows = 0..ROWS;
    let nulls_every = |every: usize| move |i: &usize| !i.is_multiple_of(every);
    let fields = vec![
        Field::new("k64", DataType::Int64, true),
        Field::new("k32", DataType::Int32, true),
        Field::new("k16", DataType::Int16, false),
        Field::new("k8", DataType::Int8, true),
        Field::new("ku8", DataType::UInt8, false),
        Field::new("ku16", DataType::UInt16, false),
        Field::new("ku32", DataType::UInt32, true),
        Field::new("ku64", DataType::UInt64, false),
        Field::new("kneg", DataType::Int64, false),
        Field::new("kwide", DataType::Int64, false),
        Field::new("v", DataType::Int64, true),
        Field::new("f", DataType::Float64, true),
        Field::new("b", DataType::Boolean, true),
        Field::new("s", DataType::Utf8, false),
        Field::new("d", DataType::Decimal128(12, 2), true),
        Field::new("kspread", DataType::Int64, false),
    ];
    let columns: Vec<ArrayRef> = vec![
        // Dense keys from 0, skewed (half the rows on key 7), NULLs.
        Arc::new(Int64Array::from_iter(rows.clone().map(|i| {
            nulls_every(29)(&i).then_some(if i % 2 == 0 {
                7
            } else {
                (i * 7919 % 3001) as i64
            })
        }))),
        Arc::new(Int32Array::from_iter(
            rows.clone()
                .map(|i| nulls_every(13)(&i).then_some((i % 500) as i32 + 1)),
        )),
        Arc::new(Int16Array::from_iter_values(
            rows.clone().map(|i| (i % 97) as i16),
        )),
        // Negative keys: DataFusion's aggregation throughout.
        Arc::new(Int8Array::from_iter(
            rows.clone()
                .map(|i| nulls_every(7)(&i).then_some((i % 200) as i8)),
        )),
        Arc::new(UInt8Array::from_iter_values(
            rows.clone().map(|i| (i % 256) as u8),
        )),
        Arc::new(UInt16Array::from_iter_values(
            rows.clone().map(|i| (i * 31 % 65_536) as u16),
        )),
        Arc::new(UInt32Array::from_iter(
            rows.clone()
                .map(|i| nulls_every(5)(&i).then_some((i % 1_000) as u32 * 3)),
        )),
        // Past i64 late in the input: a fallback with states gathered.
        Arc::new(UInt64Array::from_iter_values(rows.clone().map(|i| {
            if i > ROWS - 100 {
                u64::MAX - (i % 3) as u64
            } else {
                (i % 777) as u64
            }
        }))),
        // A negative key late in the input.
        Arc::new(Int64Array::from_iter_values(rows.clone().map(|i| {
            if i == ROWS - 10 {
                -5
            } else {
                (i % 1_234) as i64
            }
        }))),
        // Keys past any group bound late in the input.
        Arc::new(Int64Array::from_iter_values(rows.clone().map(|i| {
            if i > ROWS / 2 && i % 101 == 0 {
                1_000_000_000_000 + i as i64
            } else {
                (i % 50) as i64
            }
        }))),
        Arc::new(Int64Array::from_iter(
            rows.clone()
                .map(|i| nulls_every(11)(&i).then_some(i as i64 % 1_000 - 300)),
        )),
        Arc::new(Float64Array::from_iter(
            rows.clone()
                .map(|i| nulls_every(17)(&i).then_some((i % 97) as f64 / 4.0)),
        )),
        Arc::new(BooleanArray::from_iter(
            rows.clone()
                .map(|i| nulls_every(3)(&i).then_some(i % 5 != 0)),
        )),
        Arc::new(StringArray::from_iter_values(
            rows.clone().map(|i| format!("s{}", i % 37)),
        )),
        Arc::new(
            Decimal128Array::from_iter(
                rows.map(|i| nulls_every(19)(&i).then_some((i % 5_000) as i128 * 7 - 9_000)),
            )
            .with_precision_and_scale(12, 2)
            .unwrap(),
        ),
        // Keys up to a million: a hundred megabytes of groups.
        Arc::new(Int64Array::from_iter_values(
            (0..ROWS).map(|i| (i * 50) as i64),
        )),
    ];
    RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).unwrap()
}

const KEYS: &[&str] = &[
    "k64",
    "k32",
    "k16",
    "k8",
    "ku8",
    "ku16",
    "ku32",
    "ku64",
    "kneg",
    "kwide",
    "k64 + length(s) - 2",
    "kneg + length(s) - 2",
    "kwide + length(s) - 2",
];

/// Aggregates the dense path takes (fixed-width states).
const TAKEN: &[&str] = &[
    "SELECT {k}, count(*), count(v), sum(v), min(v), max(v), avg(f), sum(f), min(f), \
     bool_and(b), bool_or(b) FROM t GROUP BY {k}",
    // Counts alone are indexed by key value: groups whose values are all
    // NULL, or all filtered out, still count 0.
    "SELECT {k}, count(*), count(v) FROM t GROUP BY {k}",
    "SELECT {k}, count(v) FILTER (WHERE b), count(*) FILTER (WHERE v > 0), count(s) \
     FROM t GROUP BY {k}",
    // Sums, extremes and averages of columns without NULLs stay indexed
    // by key value to the end; a decimal average is evaluated only for
    // keys a row had.
    "SELECT {k}, sum(k16), min(ku16), max(ku8), avg(ku16), \
     avg(CAST(k16 AS DECIMAL(12, 2))), count(*) FROM t GROUP BY {k}",
    // A decimal average divides by its count: a group index no row had
    // must never be evaluated (DataFusion's accumulator panics at zero).
    "SELECT {k}, avg(d), sum(d), min(d), max(d), avg(v) FROM t GROUP BY {k}",
    "SELECT {k}, count(*) FILTER (WHERE v > 0), sum(v) FILTER (WHERE b), avg(v) \
     FROM t WHERE v IS NOT NULL OR f > 3 GROUP BY {k} HAVING count(*) > 1",
    "SELECT {k} AS g, count(v) FROM t WHERE s = 's1' GROUP BY {k} ORDER BY g LIMIT 30",
    // DataFusion counts distinct values by grouping by the key and the
    // value first: the outer aggregation is by the key alone.
    "SELECT {k}, count(DISTINCT v) FROM t GROUP BY {k}",
    // No row passes: no groups.
    "SELECT {k}, count(*), sum(v) FROM t WHERE v > 100000 GROUP BY {k}",
];

/// The first `TAKEN` queries meet every key the column has.
const FIRST_EVERY_KEY: usize = 6;

/// Aggregations it leaves to DataFusion whatever the key.
const NOT_TAKEN: &[&str] = &[
    "SELECT {k}, min(s), count(*) FROM t GROUP BY {k}",
    "SELECT {k}, s, count(*) FROM t GROUP BY {k}, s",
    "SELECT {k} FROM t GROUP BY {k}",
];

async fn check(
    session: &SieveSession,
    reference: &SessionContext,
    sql: &str,
) -> Arc<dyn ExecutionPlan> {
    let expected = rows_as_text(&run(reference, sql).await.unwrap(), true).unwrap();
    let plan = physical_plan(session, sql).await;
    let batches = collect(Arc::clone(&plan), session.context.task_ctx())
        .await
        .unwrap_or_else(|error| panic!("{sql}: {error}"));
    assert_eq!(
        rows_as_text(&batches, true).unwrap(),
        expected,
        "{sql} differs from plain DataFusion"
    );
    plan
}

fn dense_nodes(plan: &Arc<dyn ExecutionPlan>, found: &mut Vec<Arc<dyn ExecutionPlan>>) {
    if plan.downcast_ref::<DenseAggregateExec>().is_some() {
        found.push(Arc::clone(plan));
    }
    for child in plan.children() {
        dense_nodes(child, found);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregations_by_key_value_agree_with_datafusion_and_fall_back_when_they_must() {
    let root = common::empty_root("dense-aggregates", NODES);
    let (_cluster, session) = common::cluster_with_catalog(&root, NODES).await;
    let reference = SessionContext::new();
    common::create_owned_tables(
        &session,
        &reference,
        vec![("t", table())],
        "slice_rows = 4000, page_rows = 512",
    )
    .await;

    // (partitions, bytes per partition's groups): two-stage and
    // single-stage plans; a bound so small that dense keys fall back too.
    for (partitions, bytes_max) in [(2, 256 << 20), (1, 256 << 20), (2, 300), (1, 0)] {
        for sql in [
            format!("SET datafusion.execution.target_partitions = {partitions}"),
            format!("SET sieve.dense_aggregate_bytes_max = {bytes_max}"),
        ] {
            session.sql(&sql).await.unwrap();
        }
        for key in KEYS {
            for (index, template) in TAKEN.iter().enumerate() {
                let sql = template.replace("{k}", key);
                let plan = check(&session, &reference, &sql).await;
                let mut dense = vec![];
                dense_nodes(&plan, &mut dense);
                let context = format!("{sql} ({partitions} partitions, {bytes_max} B)");
                let fell_back: usize = dense
                    .iter()
                    .map(|node| metric(node, "dense_fell_back"))
                    .sum();
                let rows: usize = dense.iter().map(|node| metric(node, "output_rows")).sum();
                // Keys the dense path cannot hold: negative, past i64, past
                // any bound, or past the 300 B bound's two groups.
                let out_of_range = ["k8", "ku64", "kneg", "kwide"]
                    .iter()
                    .any(|bad| key.contains(bad))
                    || bytes_max == 300;
                // Through an expression, the statistics know nothing of the
                // keys: it is taken, and falls back at run time.
                let opaque = key.contains("length");
                if bytes_max == 0 {
                    assert!(dense.is_empty(), "{context}: taken while off");
                } else if out_of_range && !opaque {
                    // Left to DataFusion from the statistics, or fell back
                    // (the first `FIRST_EVERY_KEY` queries meet every key the column
                    // has).
                    assert!(
                        dense.is_empty() || fell_back > 0 || index >= FIRST_EVERY_KEY,
                        "{context}"
                    );
                } else if index < FIRST_EVERY_KEY {
                    assert_eq!(dense.len(), 1, "{context}: not taken");
                }
                // The first `FIRST_EVERY_KEY` queries meet every key the column has.
                if !dense.is_empty() && index < FIRST_EVERY_KEY {
                    assert_eq!(
                        fell_back > 0,
                        out_of_range,
                        "{context}: fell back {fell_back}"
                    );
                    assert!(rows > 0, "{context}: the dense node yielded no rows");
                }
            }
            for template in NOT_TAKEN {
                let sql = template.replace("{k}", key);
                let plan = check(&session, &reference, &sql).await;
                let mut dense = vec![];
                dense_nodes(&plan, &mut dense);
                assert!(dense.is_empty(), "{sql}: taken");
            }
        }
    }

    // The groups' memory refused by a statement bound: DataFusion's
    // aggregation takes over with the states gathered so far.
    for partitions in [2, 1] {
        for sql in [
            format!("SET datafusion.execution.target_partitions = {partitions}"),
            "SET sieve.dense_aggregate_bytes_max = 268435456".to_string(),
            "SET sieve.query_memory_limit = '16M'".to_string(),
            // The loaded slices hold key ranges: the storage nodes would
            // aggregate whole groups.
            "SET sieve.aggregate_pushdown = false".to_string(),
        ] {
            session.sql(&sql).await.unwrap();
        }
        for template in &TAKEN[..4] {
            let sql = template.replace("{k}", "kspread");
            let plan = check(&session, &reference, &sql).await;
            let mut dense = vec![];
            dense_nodes(&plan, &mut dense);
            assert_eq!(
                dense.len(),
                1,
                "{sql}: not taken in {}",
                datafusion::physical_plan::displayable(plan.as_ref()).indent(false)
            );
            assert!(
                metric(&dense[0], "dense_fell_back") > 0,
                "{sql}: its groups fit in 16 MB"
            );
            session
                .sql("SET sieve.query_memory_limit = 'unbounded'")
                .await
                .unwrap();
            let plan = check(&session, &reference, &sql).await;
            let mut dense = vec![];
            dense_nodes(&plan, &mut dense);
            assert_eq!(metric(&dense[0], "dense_fell_back"), 0, "{sql} unbounded");
            session
                .sql("SET sieve.query_memory_limit = '16M'")
                .await
                .unwrap();
        }
    }
}
