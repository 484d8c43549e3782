//! Scans started with the query (`sieve_compute::StartScansEarly`): which
//! scans start early, that answers stay those of plain DataFusion when a
//! query runs, and that a scan started early but never consumed is
//! cancelled when the query ends.

use std::sync::Arc;

use datafusion::physical_plan::{collect, ExecutionPlan};
use sieve_cli::cluster::EmbeddedCluster;
use sieve_cli::compare::{reference_context, rows_as_text, run};
use sieve_cli::queries::TPCH_QUERIES;
use sieve_compute::{EarlyStartExec, SieveScanExec};

use crate::common;
use crate::plans;

use common::NODES;
use plans::{below_statement_end, find_scans, metric, physical_plan};

/// The SQL name of the table `scan` reads.
fn table(scan: &Arc<dyn ExecutionPlan>) -> String {
    common::sql_name(
        &scan
            .downcast_ref::<SieveScanExec>()
            .expect("a SieveScanExec")
            .table()
            .name,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_scans_start_with_the_query_and_answers_stay_plain_datafusions() {
    let root = common::small_slices(1);
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let session = cluster.session().await.unwrap();
    let reference = reference_context(&root, NODES).await.unwrap();
    let (_, q16) = TPCH_QUERIES
        .iter()
        .find(|(name, _)| *name == "q16")
        .expect("q16");
    let expected = rows_as_text(&run(&reference, q16).await.unwrap(), false).unwrap();
    assert!(!expected.is_empty());

    // Q16: supplier and part start with the query; partsupp waits for
    // part's join keys, so it cannot.
    let physical = physical_plan(&session, q16).await;
    let root = below_statement_end(&physical);
    let root = root
        .downcast_ref::<EarlyStartExec>()
        .expect("the root starts scans early");
    let mut early: Vec<String> = root
        .tables()
        .iter()
        .map(|name| common::sql_name(name))
        .collect();
    early.sort();
    assert_eq!(early, ["part", "supplier"]);

    // Run, the answer is plain DataFusion's, and the early scans really
    // ran early (every partition); no stream is left behind.
    let batches = collect(Arc::clone(&physical), session.context.task_ctx())
        .await
        .unwrap();
    assert_eq!(rows_as_text(&batches, false).unwrap(), expected);
    let mut found = Vec::new();
    find_scans(&physical, &mut found);
    assert_eq!(found.len(), 3);
    for scan in &found {
        let partitions = scan.properties().partitioning.partition_count();
        let expected_early = match table(scan).as_str() {
            "partsupp" => 0,
            _ => partitions,
        };
        assert_eq!(
            metric(scan, "partitions_started_early"),
            expected_early,
            "{}",
            table(scan)
        );
        let scan = scan.downcast_ref::<SieveScanExec>().unwrap();
        assert_eq!(scan.partitions_waiting_early(), 0);
    }

    // Turned off, the plan is DataFusion's own and the answer the same.
    session
        .context
        .sql("set sieve.early_start_rows_max = 0")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let physical = physical_plan(&session, q16).await;
    assert!(below_statement_end(&physical)
        .downcast_ref::<EarlyStartExec>()
        .is_none());
    let batches = collect(physical, session.context.task_ctx()).await.unwrap();
    assert_eq!(rows_as_text(&batches, false).unwrap(), expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scan_started_early_but_never_read_is_dropped_with_the_query() {
    let root = common::small_slices(1);
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let session = cluster.session().await.unwrap();
    // Without join filters orders starts early too; the build side
    // (customer, no row matches) is empty, so the join never reads orders.
    // (A star join would take the join and the count into the orders scan,
    // which then runs customer itself: nothing would start early.)
    for setting in [
        "set sieve.join_filters = false",
        "set sieve.star_join_pushdown = false",
    ] {
        session
            .context
            .sql(setting)
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
    }
    let sql = "select count(*) from orders, customer \
               where o_custkey = c_custkey and c_name = 'nobody'";
    let plan = physical_plan(&session, sql).await;
    let root = below_statement_end(&plan);
    let root = root
        .downcast_ref::<EarlyStartExec>()
        .expect("the root starts scans early");
    assert!(
        root.tables()
            .iter()
            .any(|name| common::sql_name(name) == "orders"),
        "{:?}",
        root.tables()
    );
    let batches = collect(Arc::clone(&plan), session.context.task_ctx())
        .await
        .unwrap();
    assert_eq!(rows_as_text(&batches, false).unwrap(), ["0"]);
    let mut found = Vec::new();
    find_scans(&plan, &mut found);
    for scan in &found {
        let scan = scan.downcast_ref::<SieveScanExec>().unwrap();
        assert_eq!(
            scan.partitions_waiting_early(),
            0,
            "{} still holds a stream started early",
            scan.table().name
        );
    }

    // A LIMIT met early: the query ends with scans still running.
    let batches = run(
        &session.context,
        "select o_orderkey from orders, customer where o_custkey = c_custkey limit 3",
    )
    .await
    .unwrap();
    assert_eq!(
        batches.iter().map(|batch| batch.num_rows()).sum::<usize>(),
        3
    );
}
