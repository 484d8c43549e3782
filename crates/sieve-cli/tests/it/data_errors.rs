//! Errors of the query's data (issue 15): a failing cast or a division by
//! zero in a pushed filter reaches the user once, as that error, with no
//! failover to a replica that would fail the same way and no node marked
//! unhealthy. Each slice is on two of three nodes.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use arrow::array::{ArrayRef, Int64Array, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use sieve_cli::cluster::EmbeddedCluster;
use sieve_cli::compare::{reference_context_for, rows_as_text, run};
use sieve_compute::SieveSession;
use sieve_format::{copy_slice, node_directory, slice_path, write_slice, SliceLayout};

const NODES: usize = 3;

/// Table `t`: `s` holds numbers except one word in the last slice; `z` is
/// zero in two rows of each slice.
fn data() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("data-errors-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("s", DataType::Utf8, true),
        Field::new("z", DataType::Int64, true),
    ]));
    let slices = 3;
    let rows = 1000;
    for part in 0..slices {
        let ids: Vec<i64> = (0..rows).map(|i| (part * rows + i) as i64).collect();
        let s: Vec<Option<String>> = (0..rows)
            .map(|i| match (part, i) {
                (2, 700) => Some("seven hundred".to_string()),
                (_, i) if i % 10 == 0 => None,
                (_, i) => Some((i % 50).to_string()),
            })
            .collect();
        let z: Vec<i64> = (0..rows).map(|i| (i % 997) as i64).collect();
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from(ids)) as ArrayRef,
                Arc::new(StringArray::from(s)),
                Arc::new(Int64Array::from(z)),
            ],
        )
        .unwrap();
        let node = part % NODES;
        let path = slice_path(&node_directory(&root, node), "t", part);
        write_slice(&path, &schema, &SliceLayout::default(), [Ok(batch)]).unwrap();
        copy_slice(
            &path,
            &slice_path(&node_directory(&root, (node + 1) % NODES), "t", part),
        )
        .unwrap();
    }
    root
}

/// The failing queries, and what plain DataFusion's error says.
const FAILING: [(&str, &str); 2] = [
    (
        "SELECT count(*) FROM t WHERE CAST(s AS INT) > 3",
        "Cannot cast string 'seven hundred'",
    ),
    ("SELECT count(*) FROM t WHERE 100 / z > 1", "Divide by zero"),
];

async fn check(session: &SieveSession, mode: &str) {
    for (sql, expected) in FAILING {
        let plan = run(&session.context, &format!("EXPLAIN {sql}"))
            .await
            .unwrap();
        let plan = rows_as_text(&plan, false).unwrap().join("\n");
        assert!(plan.contains("pushed filter"), "{mode}: not pushed: {plan}");

        let error = run(&session.context, sql)
            .await
            .expect_err("the query fails on its data")
            .to_string();
        assert_eq!(
            error.matches(expected).count(),
            1,
            "{mode}: {sql}: the error, once: {error}"
        );
        for hint in ["replica", "storage node", "Internal"] {
            assert!(!error.contains(hint), "{mode}: {sql}: {error}");
        }
    }
    // No node was marked failed, no slice failed over.
    for (node, state) in session.catalog.nodes.iter().enumerate() {
        assert_eq!(
            state.failed_at_ms.load(Ordering::Relaxed),
            0,
            "{mode}: node {node} marked failed"
        );
    }
    assert!(session
        .catalog
        .recoveries
        .lock()
        .expect("not poisoned")
        .is_empty());
    // The session still answers.
    let rows = run(&session.context, "SELECT count(*) FROM t WHERE z = 0")
        .await
        .unwrap();
    assert_eq!(rows_as_text(&rows, false).unwrap(), ["6"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_error_in_a_pushed_filter_is_raised_once_without_failover() {
    let root = data();
    // Plain DataFusion fails with the same errors.
    let reference = reference_context_for(&root, NODES, &["t"]).await.unwrap();
    for (sql, expected) in FAILING {
        let error = run(&reference, sql).await.expect_err(sql).to_string();
        assert!(error.contains(expected), "plain DataFusion: {error}");
    }

    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let session = cluster.session().await.unwrap();
    check(&session, "processed").await;
    let (_, served) = cluster.slices_raw_and_served();
    assert!(served > 0);

    // Raw slices: the compute node runs the fragment and meets the same error.
    let raw = EmbeddedCluster::start_raw(&root, NODES).await.unwrap();
    let raw_session = raw.session().await.unwrap();
    check(&raw_session, "raw").await;
    let _ = std::fs::remove_dir_all(&root);
}
