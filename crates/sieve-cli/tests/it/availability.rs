//! Availability: a storage node that is dead or hung when a session connects
//! costs that node, not the session, as long as every slice has a live
//! replica; NDP off fails over between replicas as NDP on does; without a
//! replica, the session refuses to start, naming the missing slices.

use std::time::{Duration, Instant};

use datafusion::prelude::SessionConfig;
use sieve_cli::cluster::EmbeddedCluster;
use sieve_cli::compare::{reference_context, rows_as_text, run};
use sieve_cli::queries::{is_ordered, TPCH_QUERIES};
use sieve_compute::{SieveConfig, SieveSession};

use crate::common;

use common::NODES;

/// Discovery bounds of these tests: short, so a hung node costs one second.
const CONNECT_TIMEOUT_MS: u64 = 500;
const DISCOVERY_TIMEOUT_MS: u64 = 1_000;

async fn connect(cluster: &EmbeddedCluster) -> datafusion::common::Result<SieveSession> {
    let mut settings = SieveConfig::default();
    settings.discovery_connect_timeout_ms = CONNECT_TIMEOUT_MS;
    settings.discovery_timeout_ms = DISCOVERY_TIMEOUT_MS;
    settings.range_timeout_ms = 2_000;
    cluster
        .session_with(SessionConfig::new().with_option_extension(settings))
        .await
}

fn query(name: &str) -> &'static str {
    TPCH_QUERIES
        .iter()
        .find(|(found, _)| *found == name)
        .map(|(_, sql)| *sql)
        .unwrap()
}

/// Run `names` on `session` and on the reference; the answers must match.
async fn assert_answers(
    session: &SieveSession,
    reference: &datafusion::prelude::SessionContext,
    names: &[&str],
    what: &str,
) {
    for name in names {
        let sql = query(name);
        let expected = rows_as_text(&run(reference, sql).await.unwrap(), !is_ordered(sql)).unwrap();
        let actual = tokio::time::timeout(Duration::from_secs(30), run(&session.context, sql))
            .await
            .unwrap_or_else(|_| panic!("{name} {what}: no answer in 30 s"))
            .unwrap_or_else(|error| panic!("{name} {what}: {error}"));
        assert_eq!(
            rows_as_text(&actual, !is_ordered(sql)).unwrap(),
            expected,
            "{name} {what}"
        );
    }
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
async fn a_session_starts_and_answers_with_a_node_dead_before_it_connects() {
    let root = common::small_slices(2);
    let reference = reference_context(&root, NODES).await.unwrap();
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    cluster.nodes[1].faults().kill();
    let started = Instant::now();
    let session = connect(&cluster)
        .await
        .expect("every slice has a live replica: the session starts");
    let elapsed = started.elapsed();
    assert!(
        elapsed < Duration::from_secs(5),
        "a dead node is noticed at once ({elapsed:?})"
    );
    let failures = &session.catalog.discovery_failures;
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0].node, 1);
    assert_ne!(
        session.catalog.nodes[1]
            .failed_at_ms
            .load(std::sync::atomic::Ordering::Relaxed),
        0,
        "the dead node is marked failed"
    );
    for table in common::planned_tables(&session).values() {
        for slice in &table.slices {
            assert!(!slice.replicas.contains(&1), "{} {:?}", table.name, slice);
        }
    }
    assert_answers(
        &session,
        &reference,
        &["q1", "q3", "q6"],
        "NDP on, node dead",
    )
    .await;
    set(&session, "sieve.ndp = off").await;
    assert_answers(&session, &reference, &["q3", "q14"], "NDP off, node dead").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_starts_in_bounded_time_with_a_node_hung_before_it_connects() {
    let root = common::small_slices(2);
    let reference = reference_context(&root, NODES).await.unwrap();
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    cluster.nodes[2].faults().freeze();
    let started = Instant::now();
    let session = tokio::time::timeout(Duration::from_secs(30), connect(&cluster))
        .await
        .expect("discovery does not hang on a hung node")
        .expect("every slice has a live replica: the session starts");
    let elapsed = started.elapsed();
    eprintln!("discovery with a hung node: {elapsed:?}");
    // The bound plus a generous margin for a loaded machine.
    assert!(
        elapsed < Duration::from_millis(DISCOVERY_TIMEOUT_MS) + Duration::from_secs(5),
        "discovery waits for a hung node no longer than its timeout ({elapsed:?})"
    );
    let failures = &session.catalog.discovery_failures;
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0].node, 2);
    assert!(
        failures[0].reason.contains("within"),
        "a timeout, named: {}",
        failures[0].reason
    );
    assert_answers(
        &session,
        &reference,
        &["q3", "q6", "q14"],
        "NDP on, node hung",
    )
    .await;
    set(&session, "sieve.ndp = off").await;
    assert_answers(&session, &reference, &["q6"], "NDP off, node hung").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ndp_off_fails_over_to_a_replica_when_a_node_dies_mid_query() {
    let root = common::small_slices(2);
    let reference = reference_context(&root, NODES).await.unwrap();
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let session = connect(&cluster).await.unwrap();
    assert!(session.catalog.discovery_failures.is_empty());
    set(&session, "sieve.ndp = off").await;
    // Node 1 dies after serving 5 byte ranges, in the middle of Q3's scans.
    cluster.nodes[1].faults().kill_after_messages(5);
    assert_answers(
        &session,
        &reference,
        &["q3"],
        "NDP off, node killed mid-query",
    )
    .await;
    assert!(
        cluster.nodes[1].faults().is_killed(),
        "node 1 died during q3"
    );
    assert_ne!(
        session.catalog.nodes[1]
            .failed_at_ms
            .load(std::sync::atomic::Ordering::Relaxed),
        0,
        "the dead node is marked failed, so NDP-on requests skip it too"
    );
    assert!(
        session
            .catalog
            .recoveries
            .lock()
            .unwrap()
            .iter()
            .any(|recovery| recovery.failed_node == 1),
        "a range of node 1 was read from a replica"
    );
    // With node 1 gone, both modes still answer.
    assert_answers(&session, &reference, &["q1", "q14"], "NDP off, node dead").await;
    set(&session, "sieve.ndp = on").await;
    assert_answers(&session, &reference, &["q6"], "NDP on, node dead").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_replica_a_query_of_a_dead_nodes_slices_fails_naming_them() {
    let root = common::small_slices(1);
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    cluster.nodes[1].faults().kill();
    let started = Instant::now();
    // The catalog lists every slice: the session starts, and what is on
    // the live nodes answers.
    let session = tokio::time::timeout(Duration::from_secs(30), connect(&cluster))
        .await
        .expect("no hang")
        .expect("the session starts");
    let region = common::stored(&root, "region");
    assert_ne!(region.slices[0].1, [1], "region is on a live node");
    let batches = run(&session.context, "select count(*) from region")
        .await
        .unwrap();
    assert_eq!(rows_as_text(&batches, false).unwrap(), ["5"]);
    // A table with slices only on the dead node fails, naming one of them
    // and the node, in both modes.
    let lineitem = common::stored(&root, "lineitem");
    let lost: Vec<String> = lineitem
        .slices
        .iter()
        .filter(|(_, nodes)| *nodes == [1])
        .flat_map(|(slice, _)| {
            [
                format!("slice {slice} of table '{}'", lineitem.name),
                sieve_format::slice_file_name(&lineitem.name, *slice),
            ]
        })
        .collect();
    assert!(!lost.is_empty());
    for ndp in [true, false] {
        session.set_ndp(ndp).unwrap();
        let error = run(&session.context, "select sum(l_quantity) from lineitem")
            .await
            .expect_err("slices without a live replica: no answer")
            .to_string();
        eprintln!("{error}");
        assert!(
            lost.iter().any(|slice| error.contains(slice.as_str())),
            "NDP {ndp}: {error}"
        );
    }
    let elapsed = started.elapsed();
    assert!(
        elapsed < Duration::from_secs(10),
        "a dead node is noticed at once ({elapsed:?})"
    );
}
