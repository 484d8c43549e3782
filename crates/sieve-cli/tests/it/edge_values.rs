//! Filters and aggregates over the edges of each type, on sorted columns
//! whose pages the storage nodes can skip: unsigned integers on both sides
//! of `i64::MAX` (Parquet stores them as signed 64-bit values, ordered
//! unsigned), `i64::MIN` and `MAX`, floats with -0.0, 0.0, NaN and the
//! infinities, dates and timestamps before 1970, 38-digit decimals,
//! multibyte strings, booleans, NULLs. Every query runs through Sieve with
//! the defaults (pruning by statistics and page index, aggregates pushed or
//! answered from statistics) and with pushed aggregates off, and is
//! compared with plain DataFusion over the same files.

use std::path::PathBuf;
use std::sync::Arc;

use arrow::array::{
    ArrayRef, BooleanArray, Date32Array, Decimal128Array, Float32Array, Float64Array, Int64Array,
    StringArray, TimestampMicrosecondArray, UInt64Array,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use arrow::record_batch::RecordBatch;
use sieve_cli::cluster::EmbeddedCluster;
use sieve_cli::compare::{reference_context_for, rows_as_text, run};
use sieve_format::{copy_slice, node_directory, slice_path, write_slice, SliceLayout};

const NODES: usize = 3;
const SLICES: usize = 3;
const ROWS: usize = 1000;
const MIDDLE: i64 = (SLICES * ROWS / 2) as i64;

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("u64", DataType::UInt64, true),
        Field::new("i64", DataType::Int64, true),
        Field::new("f64", DataType::Float64, true),
        Field::new("f32", DataType::Float32, true),
        Field::new("d32", DataType::Date32, true),
        Field::new("ts", DataType::Timestamp(TimeUnit::Microsecond, None), true),
        Field::new("dec38", DataType::Decimal128(38, 4), true),
        Field::new("s", DataType::Utf8, true),
        Field::new("b", DataType::Boolean, true),
    ]))
}

/// Row `i`'s float: ascending in the total order, -0.0 just before 0.0,
/// the infinities and NaN at the ends.
fn float(i: i64) -> f64 {
    match i {
        i if i < 10 => f64::NEG_INFINITY,
        i if i == MIDDLE - 1 => -0.0,
        i if i >= 2 * MIDDLE - 10 => f64::NAN,
        i if i >= 2 * MIDDLE - 20 => f64::INFINITY,
        i => (i - MIDDLE) as f64 * 0.25,
    }
}

/// Rows `start..start + rows`, every column ascending with the row (NULL
/// every 97th row).
fn batch(start: usize) -> RecordBatch {
    let range = (start..start + ROWS).map(|i| i as i64);
    let value = |i: i64| (i % 97 != 13).then_some(i);
    let rows: Vec<Option<i64>> = range.clone().map(value).collect();
    let all = 2 * MIDDLE;
    let columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from_iter_values(range.clone())),
        Arc::new(UInt64Array::from_iter(rows.iter().map(|i| {
            i.map(|i| (i64::MAX as u64).wrapping_add((i - MIDDLE) as u64))
        }))),
        Arc::new(Int64Array::from_iter(rows.iter().map(|i| {
            i.map(|i| match i {
                i if i < all / 3 => i64::MIN + i,
                i if i >= 2 * all / 3 => i64::MAX - (all - 1 - i),
                i => i - MIDDLE,
            })
        }))),
        Arc::new(Float64Array::from_iter(rows.iter().map(|i| i.map(float)))),
        Arc::new(Float32Array::from_iter(
            rows.iter().map(|i| i.map(|i| float(i) as f32)),
        )),
        Arc::new(Date32Array::from_iter(
            rows.iter().map(|i| i.map(|i| (i - MIDDLE) as i32 * 10)),
        )),
        Arc::new(TimestampMicrosecondArray::from_iter(
            rows.iter().map(|i| i.map(|i| (i - MIDDLE) * 1_000_000_007)),
        )),
        Arc::new(
            Decimal128Array::from_iter(
                rows.iter()
                    .map(|i| i.map(|i| i128::from(i - MIDDLE) * 10i128.pow(30) + 1)),
            )
            .with_precision_and_scale(38, 4)
            .unwrap(),
        ),
        Arc::new(StringArray::from_iter(rows.iter().map(|i| {
            i.map(|i| {
                if i >= 2 * all / 3 {
                    format!("é{i}")
                } else {
                    format!("{i:04}")
                }
            })
        }))),
        Arc::new(BooleanArray::from_iter(
            rows.iter().map(|i| i.map(|i| i % 7 == 0)),
        )),
    ];
    RecordBatch::try_new(schema(), columns).unwrap()
}

fn data() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("edge-values-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    for node in 0..NODES {
        std::fs::create_dir_all(node_directory(&root, node)).unwrap();
    }
    let layout = SliceLayout {
        row_group_rows_max: 400,
        data_page_rows_max: 50,
        ..SliceLayout::default()
    };
    for part in 0..SLICES {
        let node = part % NODES;
        let path = slice_path(&node_directory(&root, node), "e", part);
        write_slice(&path, &schema(), &layout, [Ok(batch(part * ROWS))]).unwrap();
        let replica = slice_path(&node_directory(&root, (node + 1) % NODES), "e", part);
        copy_slice(&path, &replica).unwrap();
    }
    root
}

const PREDICATES: &[&str] = &[
    "u64 > 9223372036854775807",
    "u64 >= 9223372036854775807",
    "u64 < 9223372036854775808",
    "u64 <= 9223372036854775000",
    "u64 BETWEEN 9223372036854775000 AND 9223372036854776800",
    "u64 = 9223372036854775808",
    "u64 IN (9223372036854775807, 9223372036854775808, 18446744073709551615)",
    "u64 > 18446744073709551000",
    "i64 < -9223372036854775000",
    "i64 > 9223372036854775000",
    "i64 = -9223372036854775808",
    "i64 = 9223372036854775807",
    "i64 BETWEEN -5 AND 5",
    "f64 = 0",
    "f64 = CAST('-0.0' AS DOUBLE)",
    "f64 < 0",
    "f64 <= 0",
    "f64 > 0",
    "f64 >= CAST('-0.0' AS DOUBLE)",
    "f64 > -0.1 AND f64 < 0.1",
    "f64 = CAST('NaN' AS DOUBLE)",
    "f64 > 300",
    "f64 = CAST('inf' AS DOUBLE)",
    "f64 < CAST('-inf' AS DOUBLE)",
    "f64 = CAST('-inf' AS DOUBLE)",
    "f64 <> 0",
    "f64 IN (0.0, 1.5, 2.5, 3.5)",
    "f64 NOT IN (0.0, 1.5)",
    "f64 IS NULL",
    "f32 = 0",
    "f32 < 0",
    "f32 > 100",
    "f32 = CAST('NaN' AS REAL)",
    "d32 < DATE '1969-12-31'",
    "d32 BETWEEN DATE '1960-01-01' AND DATE '1970-01-01'",
    "d32 >= DATE '1970-01-01'",
    "ts < TIMESTAMP '1969-12-31 23:59:59'",
    "ts >= TIMESTAMP '1970-01-01 00:00:00'",
    "dec38 > 0",
    "dec38 = CAST(0.0001 AS DECIMAL(38, 4))",
    "dec38 < CAST(-100000000000000000000000000000000 AS DECIMAL(38, 4))",
    "dec38 >= CAST(1000000000000000000000000000000000 AS DECIMAL(38, 4))",
    "s >= 'é'",
    "s LIKE 'é%'",
    "s < '0100'",
    "s = '1500'",
    "upper(s) = 'É2500'",
    "character_length(s) = 5",
    "b",
    "NOT b",
    "b IS NULL",
];

const AGGREGATES: &[&str] = &[
    "SELECT count(*), min(u64), max(u64), count(u64) FROM e",
    "SELECT min(i64), max(i64) FROM e",
    "SELECT min(f64), max(f64), count(f64) FROM e WHERE f64 < 1000",
    "SELECT min(f32), max(f32) FROM e WHERE f32 < 1000",
    "SELECT min(d32), max(d32), min(ts), max(ts) FROM e",
    "SELECT min(dec38), max(dec38), sum(dec38) FROM e",
    "SELECT min(s), max(s), count(DISTINCT s) FROM e",
    "SELECT min(b), max(b), count(b) FROM e",
    "SELECT b, min(u64), max(u64), min(s), max(dec38) FROM e GROUP BY b",
    "SELECT u64 > 9223372036854775807 AS high, count(*), min(u64), max(u64) FROM e GROUP BY 1",
    "SELECT min(u64), max(u64) FROM e WHERE u64 > 9223372036854775807",
    "SELECT min(u64), max(u64) FROM e WHERE id < 1500",
    "SELECT u64 FROM e WHERE u64 IS NOT NULL ORDER BY u64 DESC LIMIT 3",
    "SELECT u64 FROM e WHERE u64 IS NOT NULL ORDER BY u64 LIMIT 3",
    "SELECT i64 FROM e WHERE i64 IS NOT NULL ORDER BY i64 LIMIT 3",
    "SELECT f64 FROM e WHERE f64 IS NOT NULL ORDER BY f64 DESC LIMIT 12",
    "SELECT s FROM e WHERE s IS NOT NULL ORDER BY s DESC LIMIT 3",
];

fn queries() -> Vec<String> {
    let mut queries: Vec<String> = PREDICATES
        .iter()
        .map(|predicate| {
            format!("SELECT count(*), min(id), max(id), sum(id) FROM e WHERE {predicate}")
        })
        .collect();
    queries.extend(AGGREGATES.iter().map(|sql| sql.to_string()));
    queries
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filters_and_aggregates_over_edge_values_equal_plain_datafusion() {
    let root = data();
    let reference = reference_context_for(&root, NODES, &["e"]).await.unwrap();
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let mut found = Vec::new();
    let mut pages_skipped = false;
    for (mode, settings) in [
        ("defaults", vec![]),
        (
            "no pushed aggregates",
            vec!["sieve.aggregate_pushdown=false".to_string()],
        ),
    ] {
        let session = cluster.session().await.unwrap();
        session.apply_settings(&settings).unwrap();
        for sql in queries() {
            let ordered = sql.contains("ORDER BY");
            let expected = run(&reference, &sql)
                .await
                .unwrap_or_else(|error| panic!("plain DataFusion: {sql}: {error}"));
            let expected = rows_as_text(&expected, !ordered).unwrap();
            match run(&session.context, &sql).await {
                Ok(actual) => {
                    let actual = rows_as_text(&actual, !ordered).unwrap();
                    if actual != expected {
                        found.push(format!(
                            "{mode}: {sql}\n  Sieve: {actual:?}\n  plain: {expected:?}"
                        ));
                    }
                }
                Err(error) => found.push(format!("{mode}: {sql}\n  Sieve failed: {error}")),
            }
        }
        let plan = run(
            &session.context,
            "EXPLAIN ANALYZE SELECT count(*) FROM e WHERE u64 > 9223372036854776000",
        )
        .await
        .unwrap();
        let plan = rows_as_text(&plan, false).unwrap().join("\n");
        pages_skipped |= plan.contains("pages_skipped_page_index=")
            && !plan.contains("pages_skipped_page_index=0,");
    }
    assert!(
        found.is_empty(),
        "{} mismatches:\n{}",
        found.len(),
        found.join("\n")
    );
    // The filters ran where pages can be skipped: a test of pruning, not
    // only of filtering.
    assert!(pages_skipped, "no page skipped by the page index");
    let _ = std::fs::remove_dir_all(&root);
}
