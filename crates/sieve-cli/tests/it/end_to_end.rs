//! End-to-end tests: real storage nodes on loopback, real Flight over TCP,
//! results checked against plain DataFusion over the same Parquet files.

use std::path::PathBuf;
use std::sync::Arc;

use datafusion::physical_plan::collect;
use sieve_cli::cluster::EmbeddedCluster;
use sieve_cli::compare::{reference_context, rows_as_text, run};
use sieve_cli::queries::{is_ordered, TPCH_QUERIES};
use sieve_compute::{SieveScanExec, SieveSession};

use crate::common;
use crate::plans;

use common::NODES;
use plans::{find_scans, metric, physical_plan};

fn test_data() -> PathBuf {
    common::small_slices(1)
}

async fn start() -> (PathBuf, EmbeddedCluster, SieveSession) {
    let root = test_data();
    let cluster = EmbeddedCluster::start(&root, NODES)
        .await
        .expect("start storage nodes");
    let session = cluster.session().await.expect("connect");
    (root, cluster, session)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tpch_queries_match_plain_datafusion_with_ndp_on_and_off() {
    let (root, _cluster, session) = start().await;
    let reference = reference_context(&root, NODES)
        .await
        .expect("reference context");
    for (name, sql) in TPCH_QUERIES {
        let expected =
            rows_as_text(&run(&reference, sql).await.expect(name), !is_ordered(sql)).unwrap();
        for on in [true, false] {
            session.set_ndp(on).unwrap();
            let batches = run(&session.context, sql)
                .await
                .unwrap_or_else(|error| panic!("{name} (ndp {on}): {error}"));
            let actual = rows_as_text(&batches, !is_ordered(sql)).unwrap();
            assert_eq!(
                actual,
                expected,
                "{name} with NDP {} differs from plain DataFusion",
                if on { "on" } else { "off" }
            );
        }
        assert!(
            !expected.is_empty() || name == "q20" || name == "q21",
            "{name} returned no rows at SF 0.01"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storage_node_skips_pages_for_a_selective_range_on_a_sorted_column() {
    let (_root, cluster, session) = start().await;
    let sql = "select l_orderkey, l_partkey, l_quantity from lineitem where l_orderkey < 100";
    session.set_ndp(true).unwrap();
    let names = ["pages_considered", "pages_read", "bytes_shipped", "slices"];
    // Every slice asked: the nodes skip the pages.
    session
        .sql("SET sieve.slice_pruning = false")
        .await
        .unwrap();
    let (metrics, rows) = scan_metrics(&session, sql, "lineitem", &names).await;
    let [considered, read, shipped, slices] = metrics[..] else {
        unreachable!("four metrics asked")
    };
    assert!(considered > 20, "lineitem spans many pages ({considered})");
    assert!(
        read * 10 < considered,
        "read {read} of {considered} pages: not under 10%"
    );
    assert!(shipped > 0);

    session.set_ndp(false).unwrap();
    let off = run(&session.context, sql).await.unwrap();
    assert_eq!(rows, rows_as_text(&off, true).unwrap());
    assert!(!off.is_empty());

    // The fragment is decoded once per node, not once per slice.
    let decoded: u64 = cluster
        .nodes
        .iter()
        .map(|node| node.executor().fragments_decoded())
        .sum();
    assert!(
        slices > NODES,
        "lineitem has more slices ({slices}) than nodes"
    );
    assert!(
        decoded <= NODES as u64,
        "{decoded} decodes for {slices} slices"
    );

    // With slice pruning (the default), the slices whose l_orderkey range
    // starts past 100 are not asked at all; the rows are the same.
    session.set_ndp(true).unwrap();
    session.sql("SET sieve.slice_pruning = true").await.unwrap();
    let (pruned, pruned_rows) = scan_metrics(&session, sql, "lineitem", &names).await;
    assert_eq!(pruned_rows, rows);
    assert!(
        pruned[3] >= 1 && pruned[3] < slices,
        "asked {} of {slices} slices",
        pruned[3]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_names_what_was_pushed() {
    let (_root, _cluster, session) = start().await;
    session.set_ndp(true).unwrap();
    let sql = "explain select l_orderkey from lineitem where l_shipdate > date '1998-01-01' and l_quantity < 5";
    let text = rows_as_text(&run(&session.context, sql).await.unwrap(), false)
        .unwrap()
        .join("\n");
    assert!(text.contains("SieveScanExec: table=lineitem"), "{text}");
    let pushed = text
        .split("pushed filter: ")
        .nth(1)
        .expect("a pushed filter");
    assert!(
        pushed.contains("l_shipdate") && pushed.contains("l_quantity"),
        "{text}"
    );
    assert!(text.contains("pushed columns: [l_orderkey]"), "{text}");

    session.set_ndp(false).unwrap();
    let text = rows_as_text(&run(&session.context, sql).await.unwrap(), false)
        .unwrap()
        .join("\n");
    assert!(!text.contains("SieveScanExec"), "{text}");
    assert!(text.contains("DataSourceExec"), "{text}");

    session
        .context
        .sql("set sieve.ndp = maybe")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let error = run(&session.context, "select count(*) from region")
        .await
        .expect_err("bad setting refused");
    assert!(
        error
            .to_string()
            .contains("sieve.ndp must be 'on' or 'off'"),
        "{error}"
    );
}

/// Metrics of the scan of `table` after running `sql`, and the rows.
async fn scan_metrics(
    session: &SieveSession,
    sql: &str,
    table: &str,
    names: &[&str],
) -> (Vec<usize>, Vec<String>) {
    let plan = physical_plan(session, sql).await;
    let batches = collect(Arc::clone(&plan), session.context.task_ctx())
        .await
        .unwrap();
    let mut scans = Vec::new();
    find_scans(&plan, &mut scans);
    let scan = scans
        .into_iter()
        .find(|scan| {
            common::sql_name(&scan.downcast_ref::<SieveScanExec>().unwrap().table().name) == table
        })
        .expect("a scan of the table");
    (
        names.iter().map(|name| metric(&scan, name)).collect(),
        rows_as_text(&batches, true).unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn join_filter_skips_probe_pages_and_ships_far_fewer_rows() {
    let (_root, _cluster, session) = start().await;
    // The join filter alone: a star join would take the join and the sum
    // into the lineitem scan, join filters on or off.
    session
        .context
        .sql("set sieve.star_join_pushdown = false")
        .await
        .unwrap();
    // A few orders (one day's) are the build side; lineitem is probed.
    let sql = "select o_orderkey, sum(l_extendedprice) from orders, lineitem \
               where o_orderkey = l_orderkey and o_orderdate = date '1995-03-15' \
               group by o_orderkey";
    let names = [
        "output_rows",
        "bytes_shipped",
        "pages_read",
        "pages_considered",
    ];
    let (with, rows_with) = scan_metrics(&session, sql, "lineitem", &names).await;
    session
        .context
        .sql("set sieve.join_filters = false")
        .await
        .unwrap();
    let (without, rows_without) = scan_metrics(&session, sql, "lineitem", &names).await;
    session
        .context
        .sql("set sieve.join_filters = true")
        .await
        .unwrap();
    eprintln!("lineitem scan {names:?}: with join filters {with:?}, without {without:?}");
    assert_eq!(
        rows_with, rows_without,
        "same result with and without join filters"
    );
    assert!(!rows_with.is_empty(), "the day has orders");
    assert!(
        with[0] > 0 && with[0] * 10 <= without[0] && with[1] * 10 <= without[1],
        "rows and bytes shipped: {with:?} with join filters, {without:?} without"
    );
    assert!(
        with[2] < without[2] && without[2] == without[3],
        "pages read: {with:?} with join filters, {without:?} without"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_above_another_filters_the_scan_its_key_reaches() {
    let (root, _cluster, session) = start().await;
    let reference = reference_context(&root, NODES)
        .await
        .expect("reference context");
    // TPC-H Q5: the supplier join (on l_suppkey and c_nationkey) sits above
    // the orders-lineitem join, so DataFusion pushes its filter nowhere.
    // That is the SQL's order; Sieve's own (`sieve.order_joins`) may join
    // supplier elsewhere.
    session.sql("set sieve.order_joins = false").await.unwrap();
    let (_, sql) = TPCH_QUERIES
        .iter()
        .find(|(name, _)| *name == "q5")
        .expect("q5");
    let expected = rows_as_text(&run(&reference, sql).await.unwrap(), true).unwrap();
    let names = ["output_rows", "bytes_shipped"];
    let plan = physical_plan(&session, sql).await;
    let batches = collect(Arc::clone(&plan), session.context.task_ctx())
        .await
        .unwrap();
    assert_eq!(rows_as_text(&batches, true).unwrap(), expected);
    let mut scans = Vec::new();
    find_scans(&plan, &mut scans);
    let lineitem = scans
        .into_iter()
        .find(|scan| {
            common::sql_name(&scan.downcast_ref::<SieveScanExec>().unwrap().table().name)
                == "lineitem"
        })
        .expect("a lineitem scan");
    let shown = datafusion::physical_plan::displayable(lineitem.as_ref())
        .one_line()
        .to_string();
    let supplier = common::stored(&root, "supplier").name;
    assert!(
        shown.contains(&format!(
            "join filter from {supplier} (through joins below it): range"
        )),
        "{shown}"
    );
    let with: Vec<usize> = names.iter().map(|name| metric(&lineitem, name)).collect();
    session
        .apply_settings(&["sieve.join_filters_through_joins=false".into()])
        .unwrap();
    let (without, rows) = scan_metrics(&session, sql, "lineitem", &names).await;
    assert_eq!(rows, expected);
    eprintln!("lineitem scan {names:?}: through joins {with:?}, without {without:?}");
    assert!(
        with[0] > 0 && with[0] * 3 <= without[0] && with[1] * 2 <= without[1],
        "rows and bytes shipped: {with:?} through joins, {without:?} without"
    );
}
