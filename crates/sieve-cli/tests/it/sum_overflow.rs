//! Integer sums past their type's range fail with a clear error, on the
//! storage nodes (pushed aggregates) and on the compute node, instead of
//! wrapping around as DataFusion 55's do (`sum` of `i64::MAX` and 1 was
//! `i64::MIN`). Sums within range are exact (checked against Rust's
//! `i128`) whatever their partial sums, which in group 1 pass the range
//! in whichever order the rows meet, and a sum cast to DECIMAL(38, 0)
//! holds what Int64 does not.

use std::path::PathBuf;
use std::sync::Arc;

use arrow::array::{ArrayRef, Int64Array};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use sieve_cli::cluster::EmbeddedCluster;
use sieve_cli::compare::{rows_as_text, run};
use sieve_compute::SieveSession;
use sieve_format::node_directory;

const NODES: usize = 3;
const ROWS_PER_SLICE: usize = 200;
const SLICES: usize = 3;

/// Group `k` of row `id`, and its `x`: group 0 holds values whose sum
/// passes `i64::MAX` (each slice's alone does not), group 1 large values
/// that cancel out, group 2 small ones.
fn row(id: usize) -> (i64, i64) {
    let k = (id % 3) as i64;
    let x = match k {
        0 => i64::MAX / 150,
        1 if id.is_multiple_of(2) => i64::MAX - 7,
        1 => -(i64::MAX - 7),
        _ => id as i64 * 1_000_003,
    };
    (k, x)
}

fn slice(part: usize) -> RecordBatch {
    let ids = part * ROWS_PER_SLICE..(part + 1) * ROWS_PER_SLICE;
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("k", DataType::Int64, false),
        Field::new("x", DataType::Int64, false),
    ]));
    let columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from_iter_values(ids.clone().map(|i| i as i64))),
        Arc::new(Int64Array::from_iter_values(ids.clone().map(|i| row(i).0))),
        Arc::new(Int64Array::from_iter_values(ids.map(|i| row(i).1))),
    ];
    RecordBatch::try_new(schema, columns).unwrap()
}

/// The exact sum of `x` over the rows of group `k`.
fn exact(k: i64) -> i128 {
    (0..SLICES * ROWS_PER_SLICE)
        .map(row)
        .filter(|&(group, _)| group == k)
        .map(|(_, x)| i128::from(x))
        .sum()
}

fn data() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("sum-overflow-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    for node in 0..NODES {
        std::fs::create_dir_all(node_directory(&root, node)).unwrap();
    }
    crate::common::write_replicated_table(&root, "o", SLICES, slice);
    root
}

async fn text(session: &SieveSession, sql: &str) -> Result<Vec<String>, String> {
    match run(&session.context, sql).await {
        Ok(batches) => Ok(rows_as_text(&batches, false).unwrap()),
        Err(error) => Err(error.to_string()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn integer_sums_fail_on_overflow_and_are_exact_below_it() {
    // Group 0 passes i64::MAX; each slice's part of it does not.
    assert!(exact(0) > i128::from(i64::MAX));
    assert!(exact(0) / (SLICES as i128) < i128::from(i64::MAX));
    assert!(i64::try_from(exact(1)).is_ok() && i64::try_from(exact(2)).is_ok());
    let root = data();
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let mut found = Vec::new();
    for mode in ["defaults", "no aggregate pushdown", "NDP off"] {
        let session = cluster.session().await.unwrap();
        match mode {
            "no aggregate pushdown" => session
                .apply_settings(&["sieve.aggregate_pushdown=false".into()])
                .unwrap(),
            "NDP off" => session.set_ndp(false).unwrap(),
            _ => {}
        }
        for sql in [
            "SELECT sum(x) FROM o",
            "SELECT k, sum(x) FROM o GROUP BY k",
            "SELECT sum(x) FROM o WHERE k = 0",
        ] {
            match text(&session, sql).await {
                Err(error) if error.contains("Arithmetic overflow") => {}
                other => found.push(format!("{mode}: {sql}: {other:?}, not an overflow")),
            }
        }
        let exact_sums = [
            (
                "SELECT k, sum(x) FROM o WHERE k > 0 GROUP BY k ORDER BY k",
                vec![format!("1 | {}", exact(1)), format!("2 | {}", exact(2))],
            ),
            (
                "SELECT sum(x) FROM o WHERE k = 1",
                vec![exact(1).to_string()],
            ),
            // Wide enough for group 0.
            (
                "SELECT k, sum(CAST(x AS DECIMAL(38, 0))) FROM o GROUP BY k ORDER BY k",
                (0..3).map(|k| format!("{k} | {}", exact(k))).collect(),
            ),
        ];
        for (sql, expected) in exact_sums {
            let actual = text(&session, sql).await;
            if actual.as_ref() != Ok(&expected) {
                found.push(format!("{mode}: {sql}: {actual:?}, expected {expected:?}"));
            }
        }
    }
    assert!(found.is_empty(), "{}", found.join("\n"));
    let _ = std::fs::remove_dir_all(&root);
}
