//! Replicas and failover: a storage node that dies or hangs in the middle of
//! a query costs a retry on another replica, not an answer; without a
//! replica, the query fails with an error naming the slice, in bounded time.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use sieve_cli::cluster::EmbeddedCluster;
use sieve_cli::compare::{reference_context, rows_as_text, run};
use sieve_cli::queries::{is_ordered, TPCH_QUERIES};
use sieve_compute::SieveSession;
use sieve_storage::ExecuteOptions;

use crate::common;

use common::NODES;

fn test_data(replicas: usize) -> PathBuf {
    common::small_slices(replicas)
}

/// Nodes that ship small batches, so a slice is many messages and a node
/// can die in the middle of one.
async fn start(root: &std::path::Path) -> (EmbeddedCluster, SieveSession) {
    let cluster = EmbeddedCluster::start_with(
        root,
        NODES,
        ExecuteOptions {
            batch_rows: 256,
            ..ExecuteOptions::default()
        },
    )
    .await
    .unwrap();
    let session = cluster.session().await.unwrap();
    (cluster, session)
}

fn query(name: &str) -> &'static str {
    TPCH_QUERIES
        .iter()
        .find(|(found, _)| *found == name)
        .map(|(_, sql)| *sql)
        .unwrap()
}

async fn set(session: &SieveSession, setting: &str) {
    session
        .context
        .sql(&format!("set {setting}"))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_mid_query_costs_a_retry_on_a_replica_not_the_answer() {
    let root = test_data(2);
    let reference = reference_context(&root, NODES).await.unwrap();
    let (cluster, session) = start(&root).await;
    // Every slice of the cluster has a copy on two of the three nodes.
    for table in common::planned_tables(&session).values() {
        for slice in &table.slices {
            assert_eq!(
                slice.replicas.len(),
                2,
                "{} slice {}",
                table.name,
                slice.summary.slice
            );
        }
    }

    // Node 1 dies after 10 data messages, in the middle of Q3.
    cluster.nodes[1].faults().kill_after_messages(10);
    let sql = query("q3");
    let expected = rows_as_text(&run(&reference, sql).await.unwrap(), !is_ordered(sql)).unwrap();
    let actual = run(&session.context, sql)
        .await
        .expect("q3 survives a node dying mid-stream");
    assert!(
        cluster.nodes[1].faults().is_killed(),
        "node 1 died during q3"
    );
    assert_eq!(rows_as_text(&actual, !is_ordered(sql)).unwrap(), expected);

    // With node 1 gone, every query still answers from the replicas.
    for (name, sql) in TPCH_QUERIES {
        let expected =
            rows_as_text(&run(&reference, sql).await.unwrap(), !is_ordered(sql)).unwrap();
        let actual = run(&session.context, sql)
            .await
            .unwrap_or_else(|error| panic!("{name} with a node down: {error}"));
        assert_eq!(
            rows_as_text(&actual, !is_ordered(sql)).unwrap(),
            expected,
            "{name} with a node down"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_mid_slice_is_not_counted_twice() {
    let root = test_data(2);
    let reference = reference_context(&root, NODES).await.unwrap();
    let (cluster, session) = start(&root).await;
    // Most of lineitem, 256 rows a message: the node dies inside a slice.
    let sql = "select l_orderkey, l_linenumber, l_quantity from lineitem where l_quantity < 45";
    cluster.nodes[0].faults().kill_after_messages(7);
    let expected = rows_as_text(&run(&reference, sql).await.unwrap(), true).unwrap();
    let actual = run(&session.context, sql).await.unwrap();
    assert!(cluster.nodes[0].faults().is_killed());
    let actual = rows_as_text(&actual, true).unwrap();
    assert_eq!(actual.len(), expected.len(), "no row lost or doubled");
    assert_eq!(actual, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_replica_a_dead_node_fails_the_query_with_the_slice_named() {
    let root = test_data(1);
    let (cluster, session) = start(&root).await;
    set(&session, "sieve.storage_timeout_ms = 5000").await;
    cluster.nodes[1].faults().kill_after_messages(10);
    let started = Instant::now();
    let outcome = tokio::time::timeout(Duration::from_secs(60), run(&session.context, query("q3")))
        .await
        .expect("no hang");
    let elapsed = started.elapsed();
    let error = outcome
        .expect_err("no replica: the query fails")
        .to_string();
    let node = &cluster.urls()[1];
    assert!(
        error.contains("slice ") && error.contains("could not be read"),
        "{error}"
    );
    assert!(
        error.contains(node.trim_start_matches("http://")),
        "{error}"
    );
    assert!(error.contains("1 of its 1 replica(s) tried"), "{error}");
    assert!(
        elapsed < Duration::from_secs(5),
        "a dead node is noticed before the timeout ({elapsed:?})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_node_times_out_and_its_slices_move_to_a_replica() {
    // Without a replica: a clear error after the timeout, no hang.
    let root = test_data(1);
    let (cluster, session) = start(&root).await;
    set(&session, "sieve.storage_timeout_ms = 1000").await;
    cluster.nodes[2].faults().freeze();
    let started = Instant::now();
    let outcome = tokio::time::timeout(Duration::from_secs(60), run(&session.context, query("q6")))
        .await
        .expect("no hang");
    let elapsed = started.elapsed();
    let error = outcome
        .expect_err("a hung node without replica fails the query")
        .to_string();
    assert!(error.contains("within 1000 ms"), "{error}");
    assert!(error.contains("could not be read"), "{error}");
    assert!(elapsed >= Duration::from_secs(1), "{elapsed:?}");
    eprintln!("hung node, no replica: failed after {elapsed:?}: {error}");
    drop(cluster);

    // With a replica: the right answer, the hung node's slices served elsewhere.
    let root = test_data(2);
    let reference = reference_context(&root, NODES).await.unwrap();
    let (cluster, session) = start(&root).await;
    set(&session, "sieve.storage_timeout_ms = 1000").await;
    cluster.nodes[2].faults().freeze();
    for name in ["q6", "q14"] {
        let sql = query(name);
        let expected =
            rows_as_text(&run(&reference, sql).await.unwrap(), !is_ordered(sql)).unwrap();
        let started = Instant::now();
        let actual = tokio::time::timeout(Duration::from_secs(60), run(&session.context, sql))
            .await
            .expect("no hang")
            .unwrap_or_else(|error| panic!("{name} with a hung node: {error}"));
        eprintln!("{name} with a hung node: {:?}", started.elapsed());
        assert_eq!(rows_as_text(&actual, !is_ordered(sql)).unwrap(), expected);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_node_that_keeps_working_is_not_taken_for_a_hung_one() {
    let root = test_data(1);
    let reference = reference_context(&root, NODES).await.unwrap();
    let (cluster, session) = start(&root).await;
    set(&session, "sieve.storage_timeout_ms = 1000").await;
    // Q1's aggregation runs on the nodes and emits only at the end of a
    // slice. A slice is 5 row groups, each read taking 250 ms more: every
    // slice processed on a node is silent for longer than the timeout,
    // but its heartbeats say it is working.
    for node in &cluster.nodes {
        node.faults().pace_reads(Duration::from_millis(250));
    }
    let sql = query("q1");
    let expected = rows_as_text(&run(&reference, sql).await.unwrap(), !is_ordered(sql)).unwrap();
    let started = Instant::now();
    let actual = tokio::time::timeout(Duration::from_secs(120), run(&session.context, sql))
        .await
        .expect("no hang")
        .unwrap_or_else(|error| panic!("q1 on slow nodes: {error}"));
    eprintln!("q1 on slow nodes: {:?}", started.elapsed());
    assert_eq!(rows_as_text(&actual, !is_ordered(sql)).unwrap(), expected);
    let processed: u64 = cluster
        .nodes
        .iter()
        .map(|node| {
            node.executor()
                .counters()
                .slices_served
                .load(std::sync::atomic::Ordering::Relaxed)
        })
        .sum();
    assert!(processed > 0, "some slices were processed on the nodes");

    // A node whose reads stand still longer than the timeout sends no
    // heartbeat: it is taken for hung, and without a replica the query
    // fails with a clear error.
    for node in &cluster.nodes {
        node.faults().pace_reads(Duration::from_millis(3000));
    }
    let outcome = tokio::time::timeout(Duration::from_secs(120), run(&session.context, sql))
        .await
        .expect("no hang");
    let error = outcome
        .expect_err("nodes that stand still fail the query")
        .to_string();
    assert!(error.contains("within 1000 ms"), "{error}");
}
