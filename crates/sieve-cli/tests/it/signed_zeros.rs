//! ORDER BY over floats that compare equal and sort apart: -0.0 and 0.0.
//!
//! `x = 0.0` holds for both zeros, and a join on a float key matches them,
//! but ORDER BY puts -0.0 first. DataFusion 55 takes such an equality for
//! a value identity and drops the "constant" or "duplicate" key from the
//! sort (plain DataFusion answers these queries in the wrong order), so
//! the expected rows here are not plain DataFusion's ordered answer: they
//! are its unordered rows (what passes a filter or a join does not depend
//! on the order), sorted in Rust by IEEE total order and cut at the LIMIT.
//! Each query runs through Sieve in several modes.
//!
//! Grouped `min` and `max` over floats are checked against the same
//! values computed in Rust: DataFusion 55's grouped accumulator for floats
//! depends on the order of the rows (after a NaN any value replaces the
//! running one; a group of -inf alone had the `max` `f64::MIN`).

use std::cmp::Ordering;
use std::path::PathBuf;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, Float32Array, Float64Array, Int64Array};
use arrow::compute::cast;
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use datafusion::prelude::SessionContext;
use sieve_cli::cluster::EmbeddedCluster;
use sieve_cli::compare::{reference_context_for, run};
use sieve_compute::SieveSession;
use sieve_format::node_directory;

const NODES: usize = 3;

/// `a.f` for row `id`: each group `k = id % 20` holds its own mix of the
/// two zeros, so that a group's minimum is -0.0 in some groups and 0.0 in
/// others.
fn f(id: usize) -> Option<f64> {
    let k = id % 20;
    let turn = (id / 20) % 3;
    match (k / 5, turn) {
        (0, 0) | (0, 2) => Some(-0.0),
        (0, _) => Some(1.5),
        (1, 0) | (1, 2) => Some(0.0),
        (1, _) => Some(2.5),
        (2, 0) => Some(-0.0),
        (2, 1) => Some(0.0),
        (2, _) => Some(f64::NAN),
        (_, 0) => Some(-2.0),
        (_, 1) => None,
        _ => Some(if id.is_multiple_of(2) { 0.0 } else { -0.0 }),
    }
}

/// `a.h` for row `id`: `f`'s values negated, as Float32.
fn h(id: usize) -> Option<f64> {
    f(id).map(|v| -(v as f32) as f64)
}

/// `a.e` for row `id`: -inf alone, 5, NaN and 1 in turn, +inf alone, and
/// ordinary values, by group.
fn e(id: usize) -> Option<f64> {
    let k = id % 20;
    match k / 5 {
        0 => Some(f64::NEG_INFINITY),
        1 => Some([5.0, f64::NAN, 1.0][(id / 20) % 3]),
        2 => Some(f64::INFINITY),
        _ => Some(id as f64 * 0.25 - 50.0),
    }
}

/// Rows of `a`.
const A_ROWS: usize = 600;

fn a(part: usize) -> RecordBatch {
    let ids: Vec<usize> = (part * 200..part * 200 + 200).collect();
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("k", DataType::Int64, false),
        Field::new("f", DataType::Float64, true),
        Field::new("h", DataType::Float32, true),
        Field::new("e", DataType::Float64, true),
    ]));
    let columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from_iter_values(ids.iter().map(|&i| i as i64))),
        Arc::new(Int64Array::from_iter_values(
            ids.iter().map(|&i| (i % 20) as i64),
        )),
        Arc::new(Float64Array::from_iter(ids.iter().map(|&i| f(i)))),
        // The zeros of `f` the other way round.
        Arc::new(Float32Array::from_iter(
            ids.iter().map(|&i| h(i).map(|v| v as f32)),
        )),
        Arc::new(Float64Array::from_iter(ids.iter().map(|&i| e(i)))),
    ];
    RecordBatch::try_new(schema, columns).unwrap()
}

fn b(part: usize) -> RecordBatch {
    let ids: Vec<usize> = (part * 50..part * 50 + 50).collect();
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("g", DataType::Float64, true),
    ]));
    let g = |i: usize| match i % 5 {
        0 => Some(-0.0),
        1 => Some(0.0),
        2 => Some(1.5),
        3 => None,
        _ => Some(f64::NAN),
    };
    let columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from_iter_values(ids.iter().map(|&i| i as i64))),
        Arc::new(Float64Array::from_iter(ids.iter().map(|&i| g(i)))),
    ];
    RecordBatch::try_new(schema, columns).unwrap()
}

fn data() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("signed-zeros-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    for node in 0..NODES {
        std::fs::create_dir_all(node_directory(&root, node)).unwrap();
    }
    crate::common::write_replicated_table(&root, "a", A_ROWS / 200, a);
    crate::common::write_replicated_table(&root, "b", 2, b);
    root
}

/// A query: its rows (`base`), their order (column positions, descending
/// or not) and a LIMIT.
struct Query {
    base: &'static str,
    order: &'static [(usize, bool)],
    limit: Option<usize>,
}

impl Query {
    fn sql(&self) -> String {
        let keys: Vec<String> = self
            .order
            .iter()
            .map(|(column, descending)| {
                format!("{}{}", column + 1, if *descending { " DESC" } else { "" })
            })
            .collect();
        let limit = self
            .limit
            .map(|limit| format!(" LIMIT {limit}"))
            .unwrap_or_default();
        format!("{} ORDER BY {}{limit}", self.base, keys.join(", "))
    }
}

const QUERIES: &[Query] = &[
    // A filter's equality with a zero (pushed to the storage nodes with NDP
    // on; a filter on the compute node with NDP off).
    Query {
        base: "SELECT id, f FROM a WHERE f = -0.0",
        order: &[(1, false), (0, false)],
        limit: None,
    },
    Query {
        base: "SELECT id, f FROM a WHERE f = 0.0",
        order: &[(1, true), (0, false)],
        limit: Some(3),
    },
    Query {
        base: "SELECT id, h, f FROM a WHERE h = 0.0 AND f = -0.0",
        order: &[(1, false), (2, true), (0, true)],
        limit: Some(5),
    },
    // A filter on the compute node, over an aggregate's output.
    Query {
        base: "SELECT k, m FROM (SELECT k, min(f) AS m FROM a GROUP BY k) WHERE m = 0.0",
        order: &[(1, false), (0, true)],
        limit: None,
    },
    Query {
        base: "SELECT k, max(h) AS m FROM a GROUP BY k HAVING max(h) = -0.0",
        order: &[(1, false), (0, false)],
        limit: Some(2),
    },
    // Joins on a float key, ordered by both sides' keys.
    Query {
        base: "SELECT a.id, b.id, a.f, b.g FROM a JOIN b ON a.f = b.g",
        order: &[(2, false), (3, false), (0, false), (1, false)],
        limit: None,
    },
    Query {
        base: "SELECT a.id, b.id, a.f, b.g FROM a JOIN b ON a.f = b.g",
        order: &[(3, true), (2, false), (1, false), (0, false)],
        limit: Some(7),
    },
    Query {
        base: "SELECT b.g, a.f, a.id, b.id FROM b JOIN a ON b.g = a.f WHERE a.k < 12",
        order: &[(1, false), (0, true), (3, false), (2, false)],
        limit: Some(40),
    },
    // A join on a float key and a filter on it.
    Query {
        base: "SELECT a.id, b.id, a.f, b.g FROM a JOIN b ON a.f = b.g WHERE b.g = 0.0",
        order: &[(3, false), (2, true), (0, false), (1, false)],
        limit: Some(9),
    },
];

/// Each row's values as floats (ids and group keys are small integers).
fn rows(batches: &[RecordBatch]) -> Vec<Vec<Option<f64>>> {
    let mut rows = Vec::new();
    for batch in batches {
        let columns: Vec<Float64Array> = batch
            .columns()
            .iter()
            .map(|column| {
                let column = cast(column, &DataType::Float64).unwrap();
                column
                    .as_any()
                    .downcast_ref::<Float64Array>()
                    .unwrap()
                    .clone()
            })
            .collect();
        for row in 0..batch.num_rows() {
            rows.push(
                columns
                    .iter()
                    .map(|column| (!column.is_null(row)).then(|| column.value(row)))
                    .collect(),
            );
        }
    }
    rows
}

/// DataFusion's ORDER BY: IEEE total order, NULLs last ascending and
/// first descending.
fn compare(left: &[Option<f64>], right: &[Option<f64>], order: &[(usize, bool)]) -> Ordering {
    for &(column, descending) in order {
        let ordering = match (left[column], right[column]) {
            (None, None) => Ordering::Equal,
            (None, Some(_)) => Ordering::Greater,
            (Some(_), None) => Ordering::Less,
            (Some(l), Some(r)) => l.total_cmp(&r),
        };
        let ordering = if descending {
            ordering.reverse()
        } else {
            ordering
        };
        if ordering != Ordering::Equal {
            return ordering;
        }
    }
    Ordering::Equal
}

/// Rows as text that tells the zeros apart.
fn text(rows: &[Vec<Option<f64>>]) -> Vec<String> {
    rows.iter().map(|row| format!("{row:?}")).collect()
}

async fn mismatches(session: &SieveSession, reference: &SessionContext, mode: &str) -> Vec<String> {
    let mut found = Vec::new();
    for query in QUERIES {
        let unordered = run(reference, query.base)
            .await
            .unwrap_or_else(|error| panic!("plain DataFusion: {}: {error}", query.base));
        let mut expected = rows(&unordered);
        expected.sort_by(|l, r| compare(l, r, query.order));
        // The order must decide every row: ties would make the expected
        // order one of several.
        assert!(
            expected
                .windows(2)
                .all(|pair| compare(&pair[0], &pair[1], query.order) == Ordering::Less),
            "{}: the ORDER BY leaves ties",
            query.sql()
        );
        expected.truncate(query.limit.unwrap_or(usize::MAX));
        let sql = query.sql();
        match run(&session.context, &sql).await {
            Ok(actual) => {
                let (actual, expected) = (text(&rows(&actual)), text(&expected));
                if actual != expected {
                    found.push(format!(
                        "{mode}: {sql}\n  Sieve:    {actual:?}\n  expected: {expected:?}"
                    ));
                }
            }
            Err(error) => found.push(format!("{mode}: {sql}\n  Sieve failed: {error}")),
        }
    }
    found.extend(grouped_min_max_mismatch(session, mode).await);
    found.extend(in_list_mismatches(session, mode).await);
    found
}

/// Each group's `min` and `max` of `f`, `h` and `e`, in total order,
/// computed in Rust from the rows written.
fn expected_min_max() -> Vec<Vec<Option<f64>>> {
    let columns: [&dyn Fn(usize) -> Option<f64>; 3] = [&f, &h, &e];
    (0..20)
        .map(|k| {
            let mut row = vec![Some(k as f64)];
            for column in columns {
                let mut values: Vec<f64> = (k..A_ROWS).step_by(20).filter_map(column).collect();
                values.sort_by(f64::total_cmp);
                row.push(values.first().copied());
                row.push(values.last().copied());
            }
            row
        })
        .collect()
}

/// The `min` and `max` of `f`, `h` and `e` over all rows, from the groups'.
fn expected_overall(groups: &[Vec<Option<f64>>]) -> Vec<Vec<Option<f64>>> {
    let mut row = Vec::new();
    for column in 1..groups[0].len() {
        let mut values: Vec<f64> = groups.iter().filter_map(|group| group[column]).collect();
        values.sort_by(f64::total_cmp);
        row.push(if column % 2 == 1 {
            values.first().copied()
        } else {
            values.last().copied()
        });
    }
    vec![row]
}

async fn grouped_min_max_mismatch(session: &SieveSession, mode: &str) -> Vec<String> {
    let groups = expected_min_max();
    let mut found = Vec::new();
    for (sql, expected) in [
        (
            "SELECT k, min(f), max(f), min(h), max(h), min(e), max(e) FROM a GROUP BY k ORDER BY k",
            text(&groups),
        ),
        // Ungrouped, which DataFusion would answer from statistics.
        (
            "SELECT min(f), max(f), min(h), max(h), min(e), max(e) FROM a",
            text(&expected_overall(&groups)),
        ),
    ] {
        let mismatch = match run(&session.context, sql).await {
            Ok(actual) => {
                let actual = text(&rows(&actual));
                (actual != expected).then(|| {
                    format!("{mode}: {sql}\n  Sieve:    {actual:?}\n  expected: {expected:?}")
                })
            }
            Err(error) => Some(format!("{mode}: {sql}\n  Sieve failed: {error}")),
        };
        found.extend(mismatch);
    }
    found
}

/// IN lists over floats, as `=`s (`-0.0 = 0.0`), computed in Rust. Past
/// three items DataFusion 55 keeps an IN list, which compared floats bit
/// for bit.
async fn in_list_mismatches(session: &SieveSession, mode: &str) -> Vec<String> {
    let plus_zero = |id: usize| f(id).map(|v| v + 0.0);
    type Value<'a> = &'a dyn Fn(usize) -> Option<f64>;
    let cases: [(&str, Value, &[f64], bool); 5] = [
        ("f", &f, &[0.0, 1.5, 7.0, 8.0, 9.0], false),
        ("f", &f, &[-0.0, 7.0, 8.0, 9.0, 10.0], false),
        ("f", &f, &[0.0, 2.5, 7.0, 8.0, 9.0], true),
        ("h", &h, &[-0.0, -1.5, 7.0, 8.0, 9.0], false),
        // An expression: -0.0 + 0.0 is 0.0, so only 0.0 reaches the list.
        ("f + 0.0", &plus_zero, &[-0.0, 1.5, 7.0, 8.0], false),
    ];
    let mut found = Vec::new();
    for (column, value, list, negated) in cases {
        let items: Vec<String> = list.iter().map(|v| format!("{v:?}")).collect();
        let not = if negated { "NOT " } else { "" };
        let sql = format!(
            "SELECT id FROM a WHERE {column} {not}IN ({})",
            items.join(", ")
        );
        // Each case has rows of the zero the list does not hold, which a
        // comparison bit for bit would decide the other way.
        assert!(
            (0..A_ROWS).any(|id| value(id).is_some_and(
                |v| v == 0.0 && !list.iter().any(|item| item.to_bits() == v.to_bits())
            )),
            "{sql}: no row tells = from bits"
        );
        let expected: Vec<i64> = (0..A_ROWS)
            .filter(|&id| value(id).map(|v| list.contains(&v)) == Some(!negated))
            .map(|id| id as i64)
            .collect();
        match run(&session.context, &sql).await {
            Ok(batches) => {
                let mut actual: Vec<i64> = rows(&batches)
                    .iter()
                    .map(|row| row[0].unwrap() as i64)
                    .collect();
                actual.sort_unstable();
                if actual != expected {
                    found.push(format!(
                        "{mode}: {sql}\n  Sieve: {} rows, expected {}",
                        actual.len(),
                        expected.len()
                    ));
                }
            }
            Err(error) => found.push(format!("{mode}: {sql}\n  Sieve failed: {error}")),
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn order_by_tells_the_zeros_apart_after_equalities_on_them() {
    let root = data();
    let reference = reference_context_for(&root, NODES, &["a", "b"])
        .await
        .unwrap();
    // Each query has rows of both zeros in its sorted key: one zero alone
    // would pass whatever the sort did with it.
    for query in QUERIES {
        let all = rows(&run(&reference, query.base).await.unwrap());
        let zeros = |negative: bool| {
            all.iter().any(|row| {
                query.order.iter().any(|&(column, _)| {
                    row[column].is_some_and(|v| v == 0.0 && v.is_sign_negative() == negative)
                })
            })
        };
        assert!(zeros(true) && zeros(false), "{}", query.base);
    }
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let partitioned = [
        "datafusion.execution.target_partitions=2",
        "datafusion.optimizer.hash_join_single_partition_threshold=0",
        "datafusion.optimizer.hash_join_single_partition_threshold_rows=0",
    ];
    let no_star = "sieve.star_join_pushdown=false";
    let modes: Vec<(&str, Vec<&str>)> = vec![
        ("defaults", vec![]),
        ("join filters", vec![no_star]),
        ("partitioned", [&partitioned[..], &[no_star]].concat()),
        (
            "sort-merge joins",
            [
                &partitioned[..],
                &[no_star, "datafusion.optimizer.prefer_hash_join=false"],
            ]
            .concat(),
        ),
        (
            "spilled",
            [
                &partitioned[..],
                &[no_star, "sieve.join_build_bytes_max=2048"],
            ]
            .concat(),
        ),
    ];
    let mut found = Vec::new();
    for (mode, settings) in &modes {
        let session = cluster.session().await.unwrap();
        let settings: Vec<String> = settings.iter().map(|s| s.to_string()).collect();
        session.apply_settings(&settings).unwrap();
        found.extend(mismatches(&session, &reference, mode).await);
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
    let _ = std::fs::remove_dir_all(&root);
}
