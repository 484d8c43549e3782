//! Joins on keys of every type Sieve stores, not only integers: small and
//! unsigned integers past `i64::MAX`, floats with NaN, -0.0 and the
//! infinities, dates, timestamps (with and without a time zone), decimals
//! of small and large precision, booleans, strings (empty, multibyte, past
//! the 12 bytes a string view holds inline) and binary; keys of two
//! different types (DataFusion casts one side), and expressions as keys.
//! Every join type over each, NULL keys on both sides, each run through
//! Sieve in several modes (join filters as lists, Bloom filters or key
//! bitmaps, joins spilled part by part, wide joins, NDP off) and compared
//! with plain DataFusion over the same files.
//!
//! A join filter is built from the build side's keys and tested on the
//! probe side's storage nodes: its range, list, Bloom filter or bitmap
//! must pass every probe key the join matches, under the join's own
//! equality (where NaN equals NaN and -0.0 is not 0.0) and after the
//! join's casts.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{
    ArrayRef, BinaryArray, BooleanArray, Date32Array, Decimal128Array, Float32Array, Float64Array,
    Int16Array, Int32Array, Int64Array, Int8Array, StringArray, TimestampMicrosecondArray,
    TimestampMillisecondArray, UInt32Array, UInt64Array,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use arrow::record_batch::RecordBatch;
use datafusion::prelude::SessionContext;
use sieve_cli::cluster::EmbeddedCluster;
use sieve_cli::compare::{reference_context_for, rows_as_text, run};
use sieve_compute::SieveSession;
use sieve_format::node_directory;

const NODES: usize = 3;

/// The key columns, each filled from the same key number of a row.
const KEYS: &[&str] = &[
    "i8", "i16", "i32", "i64", "u32", "u64", "f32", "f64", "d32", "ts", "tstz", "dec", "dec38",
    "b", "s", "bin",
];

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("v", DataType::Int64, true),
        Field::new("i8", DataType::Int8, true),
        Field::new("i16", DataType::Int16, true),
        Field::new("i32", DataType::Int32, true),
        Field::new("i64", DataType::Int64, true),
        Field::new("u32", DataType::UInt32, true),
        Field::new("u64", DataType::UInt64, true),
        Field::new("f32", DataType::Float32, true),
        Field::new("f64", DataType::Float64, true),
        Field::new("d32", DataType::Date32, true),
        Field::new("ts", DataType::Timestamp(TimeUnit::Microsecond, None), true),
        Field::new(
            "tstz",
            DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into())),
            true,
        ),
        Field::new("dec", DataType::Decimal128(12, 2), true),
        Field::new("dec38", DataType::Decimal128(38, 6), true),
        Field::new("b", DataType::Boolean, true),
        Field::new("s", DataType::Utf8, true),
        Field::new("bin", DataType::Binary, true),
    ]))
}

/// A float for key number `k`: the special values first.
fn float(k: u64) -> f64 {
    match k {
        0 => f64::NAN,
        1 => -0.0,
        2 => 0.0,
        3 => f64::INFINITY,
        4 => f64::NEG_INFINITY,
        _ => (k as f64 - 40.0) * 0.5,
    }
}

fn string(k: u64) -> String {
    match k {
        0 => String::new(),
        1 => "é✓ ключ".into(),
        k if k % 3 == 0 => format!("a key longer than a view's inline bytes {k}"),
        k => format!("k{k:03}"),
    }
}

/// Rows `start..start + rows`: key number `(i * stride) % modulo` (NULL
/// every `null_every` rows, each column at its own offset so that NULLs
/// fall on different rows).
fn batch(
    start: usize,
    rows: usize,
    null_every: usize,
    stride: usize,
    modulo: usize,
) -> RecordBatch {
    let range = start..start + rows;
    let key = |i: usize, column: usize| -> Option<u64> {
        (!(i + column).is_multiple_of(null_every)).then_some(((i * stride) % modulo) as u64)
    };
    let keys =
        |column: usize| -> Vec<Option<u64>> { range.clone().map(|i| key(i, column)).collect() };
    let ids: Vec<i64> = range.clone().map(|i| i as i64).collect();
    let v: Vec<Option<i64>> = range
        .clone()
        .map(|i| (i % 11 != 0).then_some((i % 100) as i64))
        .collect();
    let columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from(ids)),
        Arc::new(Int64Array::from(v)),
        Arc::new(Int8Array::from_iter(
            keys(1).into_iter().map(|k| k.map(|k| k as i8 - 64)),
        )),
        Arc::new(Int16Array::from_iter(
            keys(2)
                .into_iter()
                .map(|k| k.map(|k| (k as i16 - 30) * 300)),
        )),
        Arc::new(Int32Array::from_iter(
            keys(3).into_iter().map(|k| k.map(|k| k as i32 - 30)),
        )),
        Arc::new(Int64Array::from_iter(keys(4).into_iter().map(|k| {
            k.map(|k| match k {
                0 => i64::MIN,
                1 => i64::MAX,
                k => (k as i64 - 30) * 10_000_000_000_000_000,
            })
        }))),
        Arc::new(UInt32Array::from_iter(
            keys(5)
                .into_iter()
                .map(|k| k.map(|k| u32::MAX - k as u32 * 7)),
        )),
        Arc::new(UInt64Array::from_iter(keys(6).into_iter().map(|k| {
            // Both sides of i64::MAX: the keys past it are negative as i64.
            k.map(|k| if k % 2 == 0 { u64::MAX - k * 3 } else { k })
        }))),
        Arc::new(Float32Array::from_iter(
            keys(7).into_iter().map(|k| k.map(|k| float(k) as f32)),
        )),
        Arc::new(Float64Array::from_iter(
            keys(8).into_iter().map(|k| k.map(float)),
        )),
        Arc::new(Date32Array::from_iter(
            keys(9).into_iter().map(|k| k.map(|k| k as i32 * 37 - 900)),
        )),
        Arc::new(TimestampMicrosecondArray::from_iter(
            keys(10)
                .into_iter()
                .map(|k| k.map(|k| (k as i64 - 10) * 3_600_000_000_001)),
        )),
        Arc::new(
            TimestampMillisecondArray::from_iter(
                keys(11)
                    .into_iter()
                    .map(|k| k.map(|k| (k as i64 - 10) * 86_400_000 + 1)),
            )
            .with_timezone("UTC"),
        ),
        Arc::new(
            Decimal128Array::from_iter(
                keys(12)
                    .into_iter()
                    .map(|k| k.map(|k| k as i128 * 101 - 2000)),
            )
            .with_precision_and_scale(12, 2)
            .unwrap(),
        ),
        Arc::new(
            Decimal128Array::from_iter(
                keys(13)
                    .into_iter()
                    .map(|k| k.map(|k| (k as i128 - 30) * 10i128.pow(30) + 7)),
            )
            .with_precision_and_scale(38, 6)
            .unwrap(),
        ),
        Arc::new(BooleanArray::from_iter(
            keys(14).into_iter().map(|k| k.map(|k| k % 2 == 0)),
        )),
        Arc::new(StringArray::from_iter(
            keys(15).into_iter().map(|k| k.map(string)),
        )),
        Arc::new(BinaryArray::from_iter(
            keys(16)
                .into_iter()
                .map(|k| k.map(|k| string(k).into_bytes())),
        )),
    ];
    RecordBatch::try_new(schema(), columns).unwrap()
}

/// `name` as `slices` slices of `rows` rows, each on two nodes.
fn write_table(root: &Path, name: &str, slices: usize, rows: usize, shape: (usize, usize, usize)) {
    let (null_every, stride, modulo) = shape;
    crate::common::write_replicated_table(root, name, slices, |part| {
        batch(part * rows, rows, null_every, stride, modulo)
    });
}

fn data() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("typed-joins-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    for node in 0..NODES {
        std::fs::create_dir_all(node_directory(&root, node)).unwrap();
    }
    // `l`: the probe side, key numbers 0..60, a NULL every 13th row.
    write_table(&root, "l", 3, 1500, (13, 7, 60));
    // `r`: the build side, key numbers 0..90 (a third match nothing), a
    // NULL every 9th row.
    write_table(&root, "r", 2, 400, (9, 11, 90));
    root
}

/// The queries over key column `c` of `l` and `r`.
fn queries_on(c: &str) -> Vec<String> {
    let x = "(SELECT * FROM r WHERE v < 40)";
    vec![
        format!("SELECT count(*), count(x.id), sum(l.v) FROM l JOIN {x} x ON l.{c} = x.{c}"),
        format!("SELECT count(*), count(x.id) FROM l LEFT JOIN {x} x ON l.{c} = x.{c}"),
        format!("SELECT count(*), count(l.id) FROM l RIGHT JOIN {x} x ON l.{c} = x.{c}"),
        format!("SELECT count(*), count(l.id), count(x.id) FROM l FULL JOIN {x} x ON l.{c} = x.{c}"),
        format!("SELECT count(*) FROM l WHERE {c} IN (SELECT {c} FROM r WHERE v < 40)"),
        format!("SELECT count(*) FROM l WHERE NOT EXISTS (SELECT 1 FROM r WHERE r.{c} = l.{c} AND r.v < 40)"),
        format!("SELECT count(*) FROM l WHERE {c} NOT IN (SELECT {c} FROM r WHERE v < 40 AND {c} IS NOT NULL)"),
        format!("SELECT count(*) FROM l JOIN {x} x ON l.{c} IS NOT DISTINCT FROM x.{c}"),
        format!("SELECT l.{c}, count(*) FROM l JOIN (SELECT DISTINCT {c} FROM r WHERE v < 40) x ON l.{c} = x.{c} GROUP BY l.{c}"),
        // The build side's keys narrowed further, so that its range is not the probe's.
        format!("SELECT count(*) FROM l JOIN (SELECT * FROM r WHERE v < 3) x ON l.{c} = x.{c}"),
    ]
}

/// Keys of two types, and expressions as keys.
const MIXED: &[&str] = &[
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40) x ON l.i32 = x.i64",
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40) x ON l.i64 = x.i32",
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40) x ON l.i8 = x.u32",
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40) x ON l.i16 = x.i32",
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40) x ON l.f32 = x.f64",
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40) x ON l.f64 = x.i32",
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40) x ON l.dec = x.dec38",
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40) x ON l.dec = x.i32",
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40) x ON l.d32 = CAST(x.tstz AS DATE)",
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40) x ON CAST(l.d32 AS TIMESTAMP) = x.ts",
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40) x ON l.s = CAST(x.bin AS VARCHAR)",
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40) x ON l.i32 + 1 = x.i32 + 1",
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40) x ON l.i32 % 7 = x.i64 % 7",
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40) x ON upper(l.s) = upper(x.s)",
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40) x ON -l.f64 = x.f64",
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40) x ON l.u64 = x.u64 AND l.s = x.s",
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40) x ON l.f64 = x.f64 AND l.d32 = x.d32",
    // Signed against unsigned, and a timestamp against a date.
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40) x ON l.i64 = x.u64",
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40) x ON l.u64 = x.i32",
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40) x ON l.u32 = x.i64",
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40) x ON l.ts = x.d32",
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40) x ON l.tstz = x.ts",
    // Binary values as literals.
    "SELECT count(*), sum(v) FROM l WHERE bin = CAST('k007' AS BYTEA)",
    "SELECT count(*), sum(v) FROM l WHERE bin > CAST('k05' AS BYTEA) AND bin < CAST('k07' AS BYTEA)",
    "SELECT count(*), sum(v) FROM l WHERE bin IN (CAST('k007' AS BYTEA), CAST('' AS BYTEA))",
    "SELECT count(*), min(bin), max(bin) FROM l WHERE bin IS NOT NULL",
    // A build side holding one zero only: the join matches the other too.
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40 AND 1 / f64 > 0) x ON l.f64 = x.f64",
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40 AND 1 / f64 < 0) x ON l.f64 = x.f64",
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40 AND 1 / f32 > 0) x ON l.f32 = x.f32",
    "SELECT count(*), sum(l.v) FROM l JOIN (SELECT * FROM r WHERE v < 40 AND 1 / f32 < 0) x ON l.f32 = x.f32",
    "SELECT count(*) FROM l WHERE f64 IN (SELECT f64 FROM r WHERE 1 / f64 < 0 AND f64 > -1)",
    "SELECT count(*) FROM l WHERE l.u64 > 9223372036854775807 AND l.u64 IN (SELECT u64 FROM r WHERE v < 40)",
    "SELECT count(*) FROM l WHERE l.f64 > 0 AND l.f64 IN (SELECT f64 FROM r WHERE v < 40)",
];

fn queries() -> Vec<String> {
    let mut queries: Vec<String> = KEYS.iter().flat_map(|c| queries_on(c)).collect();
    queries.extend(MIXED.iter().map(|sql| sql.to_string()));
    queries
}

/// Every query's result through `session`, against plain DataFusion's; the
/// mismatches, listed.
async fn mismatches(session: &SieveSession, reference: &SessionContext, mode: &str) -> Vec<String> {
    let mut found = Vec::new();
    for sql in queries() {
        let expected = run(reference, &sql)
            .await
            .unwrap_or_else(|error| panic!("plain DataFusion: {sql}: {error}"));
        let expected = rows_as_text(&expected, true).unwrap();
        match run(&session.context, &sql).await {
            Ok(actual) => {
                let actual = rows_as_text(&actual, true).unwrap();
                if actual != expected {
                    found.push(format!(
                        "{mode}: {sql}\n  Sieve: {actual:?}\n  plain: {expected:?}"
                    ));
                }
            }
            Err(error) => found.push(format!("{mode}: {sql}\n  Sieve failed: {error}")),
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joins_on_keys_of_every_type_equal_plain_datafusion() {
    let root = data();
    let reference = reference_context_for(&root, NODES, &["l", "r"])
        .await
        .unwrap();
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let partitioned = [
        "datafusion.execution.target_partitions=2",
        "datafusion.optimizer.hash_join_single_partition_threshold=0",
        "datafusion.optimizer.hash_join_single_partition_threshold_rows=0",
    ];
    // The defaults join most of these on the storage nodes (star joins);
    // the other modes join on the compute node, with join filters.
    let no_star = "sieve.star_join_pushdown=false";
    let modes: Vec<(&str, Vec<&str>)> = vec![
        ("defaults", vec![]),
        ("join filters", vec![no_star]),
        // Join filters past a list: Bloom filters or key bitmaps.
        ("no lists", vec![no_star, "sieve.join_filter_list_max=1"]),
        // Past a list and never a bitmap: Bloom filters.
        (
            "Bloom filters",
            vec![
                no_star,
                "sieve.join_filter_list_max=1",
                "sieve.join_filter_bitmap_bytes=0",
            ],
        ),
        (
            "spilled",
            [
                &partitioned[..],
                &[no_star, "sieve.join_build_bytes_max=2048"],
            ]
            .concat(),
        ),
        (
            "wide",
            [
                &partitioned[..],
                &[
                    no_star,
                    "sieve.join_wide_partitions=6",
                    "sieve.join_wide_build_rows=1",
                ],
            ]
            .concat(),
        ),
    ];
    let mut found = Vec::new();
    let mut plans = Vec::new();
    for (mode, settings) in &modes {
        let session = cluster.session().await.unwrap();
        let settings: Vec<String> = settings.iter().map(|s| s.to_string()).collect();
        session.apply_settings(&settings).unwrap();
        found.extend(mismatches(&session, &reference, mode).await);
        // How this mode ran a join on each key type.
        for c in KEYS {
            let sql = format!(
                "EXPLAIN ANALYZE SELECT count(*) FROM l \
                 JOIN (SELECT * FROM r WHERE v < 40) x ON l.{c} = x.{c}"
            );
            let plan = rows_as_text(&run(&session.context, &sql).await.unwrap(), false).unwrap();
            if *mode == "join filters" {
                // Every key type's filter reaches the probe scan.
                let scan = plan.iter().find(|line| line.contains("table=l")).unwrap();
                assert!(scan.contains("join filter from r: range"), "{c}: {scan}");
            }
            if *c == "f64" {
                plans.push((*mode, plan.join("\n")));
            }
        }
    }
    // Each mode ran the path it names.
    let plan_of = |mode: &str| &plans.iter().find(|(name, _)| *name == mode).unwrap().1;
    for (mode, shown) in [
        ("defaults", "star join"),
        ("join filters", "+ list (80 keys)"),
        ("no lists", "+ bloom (80 keys"),
        ("Bloom filters", "+ bloom (80 keys"),
        ("spilled", "spilled_join_parts="),
        ("wide", "MergePartitionsExec"),
    ] {
        assert!(plan_of(mode).contains(shown), "{mode}: {}", plan_of(mode));
    }
    let off = cluster.session().await.unwrap();
    off.set_ndp(false).unwrap();
    found.extend(mismatches(&off, &reference, "NDP off").await);
    assert!(
        found.is_empty(),
        "{} mismatches:\n{}",
        found.len(),
        found.join("\n")
    );

    // The queries join: a join that matched nothing everywhere would pass
    // by accident.
    let sql = "SELECT count(*) FROM l JOIN (SELECT * FROM r WHERE v < 40) x ON l.f64 = x.f64";
    let count = rows_as_text(&run(&reference, sql).await.unwrap(), false).unwrap();
    assert_ne!(count, vec!["0".to_string()], "{sql}");
    let _ = std::fs::remove_dir_all(&root);
}
