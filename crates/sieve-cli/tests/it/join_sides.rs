//! Which side of a hash join is built (issue 20): a join whose build side
//! is a scan no join filter cuts, and whose probe side join filters will
//! cut to fewer rows, is built the other way round, so that the scan takes
//! the join's filter (`sieve.swap_join_sides`). TPC-H Q9's and Q21's
//! orders joins, and tables a user owns with NULL keys; answers equal
//! plain DataFusion's with the rule on and off.

use std::sync::Arc;

use arrow::array::{ArrayRef, Int64Array, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use datafusion::physical_plan::collect;
use datafusion::prelude::SessionContext;
use sieve_cli::cluster::EmbeddedCluster;
use sieve_cli::compare::{reference_context, rows_as_text, run};
use sieve_compute::{SieveScanExec, SieveSession};

use crate::common::{self, explain, NODES};
use crate::plans::{find_scans, metric, physical_plan};

/// Partitioned hash joins at any size (SF 0.01 is below DataFusion's
/// thresholds for collecting a build side into one partition).
pub(crate) async fn partitioned_joins(session: &SieveSession) {
    for sql in [
        "SET datafusion.optimizer.hash_join_single_partition_threshold = 0",
        "SET datafusion.optimizer.hash_join_single_partition_threshold_rows = 0",
    ] {
        session.sql(sql).await.unwrap();
    }
}

async fn set_swap(session: &SieveSession, on: bool) {
    session
        .sql(&format!("SET sieve.swap_join_sides = {on}"))
        .await
        .unwrap();
}

/// The EXPLAIN line of the scan of `table`.
pub(crate) fn scan_line<'a>(plan: &'a str, table: &str) -> &'a str {
    plan.lines()
        .find(|line| line.contains(&format!("SieveScanExec: table={table}@")))
        .unwrap_or_else(|| panic!("no scan of {table} in\n{plan}"))
}

/// Run `sql` on Sieve and on `reference`; the rows must agree. Returns the
/// rows the scans of `table` yielded.
pub(crate) async fn check(
    session: &SieveSession,
    reference: &SessionContext,
    sql: &str,
    table: &str,
) -> usize {
    let expected = rows_as_text(&run(reference, sql).await.unwrap(), true).unwrap();
    assert!(!expected.is_empty(), "{sql}: nothing to compare");
    let plan = physical_plan(session, sql).await;
    let batches = collect(Arc::clone(&plan), session.context.task_ctx())
        .await
        .unwrap_or_else(|error| panic!("{sql}: {error}"));
    assert_eq!(
        rows_as_text(&batches, true).unwrap(),
        expected,
        "{sql} differs from plain DataFusion"
    );
    let mut scans = Vec::new();
    find_scans(&plan, &mut scans);
    let mut rows = 0;
    for scan in &scans {
        let exec = scan.downcast_ref::<SieveScanExec>().expect("a scan");
        if common::sql_name(&exec.table().name) == table {
            rows += metric(scan, "output_rows");
        }
    }
    rows
}

/// The small TPC-H data on an embedded cluster, its session with
/// partitioned joins, and plain DataFusion over the same files.
pub(crate) async fn tpch_partitioned() -> (EmbeddedCluster, SieveSession, SessionContext) {
    let root = common::small_slices(1);
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let session = cluster.session().await.unwrap();
    let reference = reference_context(&root, NODES).await.unwrap();
    partitioned_joins(&session).await;
    (cluster, session, reference)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q9_builds_on_the_lineitem_rows_and_filters_orders() {
    let (cluster, session, reference) = tpch_partitioned().await;
    // The SQL's join order, the one this rule fixes (Sieve's own order,
    // `sieve.order_joins`, joins part with partsupp first: tested in
    // `join_order.rs`).
    session.sql("SET sieve.order_joins = false").await.unwrap();
    let q9 = include_str!("../../../../queries/tpch/q9.sql");

    let plan = explain(&session.context, q9).await;
    let orders = scan_line(&plan, "orders");
    assert!(
        orders.contains("join filter from partsupp"),
        "orders should be the probe side of a join built on the lineitem rows:\n{plan}"
    );
    let swapped_rows = check(&session, &reference, q9, "orders").await;

    set_swap(&session, false).await;
    let plan = explain(&session.context, q9).await;
    assert!(
        !scan_line(&plan, "orders").contains("join filter from partsupp"),
        "{plan}"
    );
    let unswapped_rows = check(&session, &reference, q9, "orders").await;
    // Orders ships about a fifth of its rows instead of all of them.
    assert!(
        swapped_rows < unswapped_rows,
        "orders yielded {swapped_rows} rows swapped, {unswapped_rows} not"
    );
    drop(session);
    drop(cluster);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q21_builds_on_the_suppliers_lineitem_rows_and_filters_orders() {
    let (cluster, session, reference) = tpch_partitioned().await;
    // Orders' own filter (`o_orderstatus = 'F'`, one status in 3) keeps
    // more rows than the lineitem rows of one nation's suppliers (one
    // nation in 25): estimated by the columns' distinct values, the join
    // is built on the lineitem rows, and orders takes their join filter.
    let q21 = include_str!("../../../../queries/tpch/q21.sql");
    let mut rows = [0usize; 2];
    for (index, on) in [true, false].into_iter().enumerate() {
        set_swap(&session, on).await;
        let plan = explain(&session.context, q21).await;
        assert_eq!(
            scan_line(&plan, "orders").contains("join filter from"),
            on,
            "swap {on}: orders is the probe side only when swapped:\n{plan}"
        );
        rows[index] = check(&session, &reference, q21, "orders").await;
    }
    assert!(
        rows[0] < rows[1],
        "orders yielded {rows:?} rows, swapped and not"
    );
    drop(session);
    drop(cluster);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q13_builds_on_the_counts_of_orders_and_streams_customer() {
    let (cluster, session, reference) = tpch_partitioned().await;
    // Orders counted per customer (`sieve.aggregate_before_join`), about
    // two customers in three: the join is built on the counts, and
    // customer, a right join's preserved probe side, takes no join filter.
    let q13 = include_str!("../../../../queries/tpch/q13.sql");
    for on in [true, false] {
        set_swap(&session, on).await;
        let plan = explain(&session.context, q13).await;
        let join = plan
            .lines()
            .find(|line| line.trim_start().starts_with("HashJoinExec:"))
            .unwrap_or_else(|| panic!("no hash join in\n{plan}"));
        let expected = if on {
            "join_type=Right"
        } else {
            "join_type=Left"
        };
        assert!(join.contains(expected), "swap {on}: {join}\n{plan}");
        assert!(
            !scan_line(&plan, "customer").contains("join filter from"),
            "customer is preserved: {plan}"
        );
        check(&session, &reference, q13, "orders").await;
    }
    drop(session);
    drop(cluster);
}

/// `big` (no filter, more rows than the probe side keeps) joins `mid`,
/// which a filtered `small` cuts. NULL keys in all three.
fn tables() -> Vec<(&'static str, RecordBatch)> {
    let big_rows = 30_000i64;
    let big = RecordBatch::try_new(
        Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, true),
            Field::new("v", DataType::Int64, true),
            Field::new("s", DataType::Utf8, true),
        ])),
        vec![
            Arc::new(Int64Array::from_iter(
                (0..big_rows).map(|i| (i % 17 != 0).then_some(i)),
            )) as ArrayRef,
            Arc::new(Int64Array::from_iter(
                (0..big_rows).map(|i| (i % 5 != 0).then_some(i % 100)),
            )),
            Arc::new(StringArray::from_iter(
                (0..big_rows).map(|i| (i % 7 != 0).then(|| format!("s{}", i % 23))),
            )),
        ],
    )
    .unwrap();
    let mid_rows = 20_000i64;
    let mid = RecordBatch::try_new(
        Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, true),
            Field::new("g", DataType::Int64, true),
            Field::new("w", DataType::Int64, false),
        ])),
        vec![
            Arc::new(Int64Array::from_iter(
                (0..mid_rows).map(|i| (i % 13 != 0).then_some(i * 7 % (big_rows + 500))),
            )) as ArrayRef,
            Arc::new(Int64Array::from_iter(
                (0..mid_rows).map(|i| (i % 11 != 0).then_some(i % 200)),
            )),
            Arc::new(Int64Array::from_iter_values((0..mid_rows).map(|i| i % 9))),
        ],
    )
    .unwrap();
    let small = RecordBatch::try_new(
        Arc::new(Schema::new(vec![
            Field::new("g", DataType::Int64, true),
            Field::new("flag", DataType::Int64, false),
        ])),
        vec![
            Arc::new(Int64Array::from_iter(
                (0..200i64).map(|i| (i % 50 != 0).then_some(i)),
            )) as ArrayRef,
            Arc::new(Int64Array::from_iter_values((0..200i64).map(|i| i % 10))),
        ],
    )
    .unwrap();
    vec![("big", big), ("mid", mid), ("small", small)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swapped_joins_over_null_keys_equal_plain_datafusion() {
    let root = common::empty_root("join-sides", NODES);
    let (cluster, session) = common::cluster_with_catalog(&root, NODES).await;
    let reference = SessionContext::new();
    common::create_owned_tables(
        &session,
        &reference,
        tables(),
        "slice_rows = 4000, page_rows = 512",
    )
    .await;
    partitioned_joins(&session).await;
    // DataFusion would build on the join of `mid` and `small` by its own
    // estimate; without its reordering `big`, the left input, is the build
    // side, as orders is in TPC-H Q9.
    session
        .sql("SET datafusion.optimizer.join_reordering = false")
        .await
        .unwrap();

    let swapped = "SELECT big.s, count(*), sum(big.v), sum(mid.w) FROM big JOIN \
         (SELECT mid.* FROM mid JOIN small ON mid.g = small.g WHERE small.flag = 3) AS mid \
         ON big.k = mid.k GROUP BY big.s";
    let plan = explain(&session.context, swapped).await;
    assert!(
        scan_line(&plan, "big").contains("join filter from"),
        "big should be the probe side:\n{plan}"
    );
    let queries = [
        swapped,
        // NULL equals NULL: the swapped join keeps NULL keys on both sides.
        "SELECT count(*), sum(big.v), count(big.k) FROM big JOIN \
         (SELECT mid.* FROM mid JOIN small ON mid.g = small.g WHERE small.flag = 3) AS mid \
         ON big.k IS NOT DISTINCT FROM mid.k",
        // Outer and semi joins are not swapped; their answers stay right.
        "SELECT count(*), count(big.k), count(mid.k) FROM big LEFT JOIN \
         (SELECT mid.* FROM mid JOIN small ON mid.g = small.g WHERE small.flag = 3) AS mid ON big.k = mid.k",
        "SELECT count(*), count(big.k), sum(mid.w) FROM big RIGHT JOIN \
         (SELECT mid.* FROM mid JOIN small ON mid.g = small.g WHERE small.flag = 3) AS mid ON big.k = mid.k",
        "SELECT count(*), sum(big.v) FROM big FULL JOIN \
         (SELECT mid.* FROM mid JOIN small ON mid.g = small.g WHERE small.flag = 3) AS mid ON big.k = mid.k",
        "SELECT count(*), sum(v) FROM big WHERE k IN \
         (SELECT mid.k FROM mid JOIN small ON mid.g = small.g WHERE small.flag = 3)",
        "SELECT count(*) FROM big WHERE k NOT IN \
         (SELECT mid.k FROM mid JOIN small ON mid.g = small.g WHERE small.flag = 3)",
        // Nothing matches: an empty build side after the swap.
        "SELECT count(*), sum(big.v) FROM big JOIN \
         (SELECT mid.* FROM mid JOIN small ON mid.g = small.g WHERE small.flag = 42) AS mid \
         ON big.k = mid.k",
    ];
    let mut rows = [0usize; 2];
    for (index, on) in [true, false].into_iter().enumerate() {
        set_swap(&session, on).await;
        for sql in queries {
            let yielded = check(&session, &reference, sql, "big").await;
            if sql == swapped {
                rows[index] = yielded;
            }
        }
    }
    assert!(
        rows[0] < rows[1],
        "big yielded {rows:?} rows, swapped and not"
    );
    drop(session);
    drop(cluster);
    let _ = std::fs::remove_dir_all(&root);
}

/// A join chain over `big` built from and probed by a filtered `small`
/// (the SQL joins `small` last, as SSB's Q4.x joins `part`): built on
/// `small` instead, `big` takes its join filter. NULL keys on every side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_chain_probed_by_a_filtered_dimension_is_built_on_the_dimension() {
    let root = common::empty_root("join-sides-dimension", NODES);
    let (cluster, session) = common::cluster_with_catalog(&root, NODES).await;
    let reference = SessionContext::new();
    common::create_owned_tables(
        &session,
        &reference,
        tables(),
        "slice_rows = 4000, page_rows = 512",
    )
    .await;
    // The SQL's order: (big ⋈ mid) ⋈ small.
    session
        .sql("SET datafusion.optimizer.join_reordering = false")
        .await
        .unwrap();
    let last = "SELECT big.s, count(*), sum(big.v), sum(mid.w) FROM big \
         JOIN mid ON big.k = mid.k JOIN small ON big.v = small.g \
         WHERE small.flag = 3 GROUP BY big.s";
    let queries = [
        last,
        // Collected into one partition, as SSB's joins at SF 1 are.
        "SELECT count(*), sum(big.v), count(big.s) FROM big \
         JOIN mid ON big.k = mid.k JOIN small ON big.v = small.g WHERE small.flag < 2",
        // NULL equals NULL on the last join: not swapped wrongly either way.
        "SELECT count(*), sum(big.v) FROM big JOIN mid ON big.k = mid.k \
         JOIN small ON big.v IS NOT DISTINCT FROM small.g WHERE small.flag = 3",
        // Nothing in `small` passes: an empty build side.
        "SELECT count(*), sum(big.v) FROM big JOIN mid ON big.k = mid.k \
         JOIN small ON big.v = small.g WHERE small.flag = 42",
        // Outer joins last are not swapped by this rule; still right.
        "SELECT count(*), count(small.g) FROM big JOIN mid ON big.k = mid.k \
         LEFT JOIN small ON big.v = small.g AND small.flag = 3",
    ];
    let mut rows = [0usize; 2];
    for (index, on) in [true, false].into_iter().enumerate() {
        set_swap(&session, on).await;
        let plan = explain(&session.context, last).await;
        assert_eq!(
            scan_line(&plan, "big").contains("join filter from small"),
            on,
            "swap {on}: big is the probe side of the join with small only when swapped:\n{plan}"
        );
        for sql in queries {
            let yielded = check(&session, &reference, sql, "big").await;
            if sql == last {
                rows[index] = yielded;
            }
        }
    }
    assert!(
        rows[0] < rows[1],
        "big yielded {rows:?} rows, swapped and not"
    );
    drop(session);
    drop(cluster);
    let _ = std::fs::remove_dir_all(&root);
}
