//! Scans with nothing to push (issue 20): no filter, join filter or
//! aggregation, only columns. The compute node asks for the slices' pages
//! as stored and decodes them itself, as NDP off does, instead of having
//! the storage nodes decode and re-encode them. Answers equal plain
//! DataFusion's, deleted rows of a table a user owns stay deleted, and a
//! scan with anything to push (a filter, an aggregation, a join filter)
//! still runs its fragment on the nodes.

use std::sync::Arc;

use arrow::array::{ArrayRef, Date32Array, Decimal128Array, Float64Array, Int64Array, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use datafusion::datasource::MemTable;
use datafusion::prelude::SessionContext;
use sieve_cli::cluster::EmbeddedCluster;
use sieve_cli::compare::{reference_context, rows_as_text, run};
use sieve_compute::SieveSession;

use crate::common::{self, explain, run_with_scan_metrics, NODES};

const METRICS: &[&str] = &["slices", "slices_as_stored", "slices_raw"];

/// Run `sql` on Sieve and on `reference`, check the rows agree, and return
/// (slices, slices as stored, slices raw for want of a worker).
async fn check(session: &SieveSession, reference: &SessionContext, sql: &str) -> [usize; 3] {
    let expected = rows_as_text(&run(reference, sql).await.unwrap(), true).unwrap();
    assert!(!expected.is_empty(), "{sql}: nothing to compare");
    let (batches, metrics) = run_with_scan_metrics(session, sql, METRICS)
        .await
        .unwrap_or_else(|error| panic!("{sql}: {error}"));
    assert_eq!(
        rows_as_text(&batches, true).unwrap(),
        expected,
        "{sql} differs from plain DataFusion"
    );
    [metrics[0], metrics[1], metrics[2]]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scans_with_nothing_to_push_ship_pages_as_stored() {
    let root = common::small_slices(1);
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let session = cluster.session().await.unwrap();
    let reference = reference_context(&root, NODES).await.unwrap();

    // Only columns, of every TPC-H type: every slice as stored.
    let plain = "SELECT l_orderkey, l_partkey, l_quantity, l_extendedprice, l_returnflag, l_shipdate, l_comment FROM lineitem";
    let before = cluster.slices_as_stored() as usize;
    let [slices, as_stored, raw] = check(&session, &reference, plain).await;
    assert!(slices > 1, "{slices} slices");
    assert_eq!((as_stored, raw), (slices, 0), "{plain}");
    // The nodes counted them apart from slices served raw for want of a
    // worker, each once (a scan started early and run again when its
    // partition came first, or after partition 0 ended, counted more).
    let on_nodes = cluster.slices_as_stored() as usize - before;
    assert_eq!(on_nodes, slices, "slices as stored on the nodes");
    let plan = explain(&session.context, plain).await;
    assert!(plan.contains("pages as stored (nothing to push)"), "{plan}");

    // A filter, an aggregation: the fragment runs on the nodes.
    for sql in [
        "SELECT o_orderkey, o_comment FROM orders WHERE o_totalprice > 200000",
        "SELECT l_returnflag, sum(l_quantity), count(*) FROM lineitem GROUP BY l_returnflag",
    ] {
        let [slices, as_stored, raw] = check(&session, &reference, sql).await;
        assert!(slices > 0, "{sql}");
        assert_eq!((as_stored, raw), (0, 0), "{sql}");
        assert!(!explain(&session.context, sql)
            .await
            .contains("pages as stored"));
    }

    // A join: the build side (region, nothing to push) comes as stored;
    // the probe side's join filter makes its fragment worth running.
    let join = "SELECT n_name, r_name FROM nation JOIN region ON n_regionkey = r_regionkey WHERE r_name <> 'ASIA'";
    let [slices, as_stored, _] = check(&session, &reference, join).await;
    assert!(as_stored < slices, "{as_stored} of {slices}");

    // The setting off: every slice processed on the nodes.
    session
        .sql("SET sieve.plain_scans_as_stored = false")
        .await
        .unwrap();
    let [slices, as_stored, raw] = check(&session, &reference, plain).await;
    assert!(slices > 1);
    assert_eq!((as_stored, raw), (0, 0));
    assert!(!explain(&session.context, plain)
        .await
        .contains("pages as stored"));
    let (busy_raw, _) = cluster.slices_raw_and_served();
    assert_eq!(busy_raw, 0);
}

/// A table a user owns with NULLs in every column and deleted rows: read
/// as stored, the compute node leaves out the deleted rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_as_stored_leave_out_deleted_rows() {
    let root = common::empty_root("as-stored", NODES);
    let (cluster, session) = common::cluster_with_catalog(&root, NODES).await;

    let rows = 5_000;
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("i", DataType::Int64, true),
        Field::new("f", DataType::Float64, true),
        Field::new("s", DataType::Utf8, true),
        Field::new("d", DataType::Date32, true),
        Field::new("m", DataType::Decimal128(12, 2), true),
    ]));
    let id: Vec<i64> = (0..rows).collect();
    let batch = RecordBatch::try_new(
        Arc::clone(&schema),
        vec![
            Arc::new(Int64Array::from(id.clone())) as ArrayRef,
            Arc::new(Int64Array::from_iter(
                id.iter().map(|&v| (v % 7 != 0).then_some(v * 31 % 1000)),
            )),
            Arc::new(Float64Array::from_iter(
                id.iter().map(|&v| (v % 5 != 0).then_some(v as f64 / 8.0)),
            )),
            Arc::new(StringArray::from_iter(
                id.iter()
                    .map(|&v| (v % 3 != 0).then(|| format!("s{}", v % 97))),
            )),
            Arc::new(Date32Array::from_iter(
                id.iter()
                    .map(|&v| (v % 11 != 0).then_some(19_000 + (v % 400) as i32)),
            )),
            Arc::new(
                Decimal128Array::from_iter(
                    id.iter().map(|&v| (v % 13 != 0).then_some(v as i128 * 7)),
                )
                .with_precision_and_scale(12, 2)
                .unwrap(),
            ),
        ],
    )
    .unwrap();
    let source = MemTable::try_new(Arc::clone(&schema), vec![vec![batch.clone()]]).unwrap();
    session
        .context
        .register_table("source", Arc::new(source))
        .unwrap();
    for sql in [
        "CREATE TABLE t WITH (slice_rows = 1000, page_rows = 256) AS SELECT * FROM source",
        "DELETE FROM t WHERE i < 100 OR s = 's5'",
    ] {
        session.sql(sql).await.unwrap().collect().await.unwrap();
    }
    let reference = SessionContext::new();
    let all = MemTable::try_new(Arc::clone(&schema), vec![vec![batch]]).unwrap();
    reference.register_table("source", Arc::new(all)).unwrap();
    reference
        .sql("CREATE VIEW t AS SELECT * FROM source WHERE (i < 100 OR s = 's5') IS NOT TRUE")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    for ndp in [true, false] {
        session.set_ndp(ndp).unwrap();
        let [slices, as_stored, raw] = check(&session, &reference, "SELECT * FROM t").await;
        assert_eq!(raw, 0);
        if ndp {
            assert!(slices >= 5, "{slices} slices");
            assert_eq!(as_stored, slices, "ndp {ndp}");
        }
    }
    drop(session);
    drop(cluster);
    let _ = std::fs::remove_dir_all(&root);
}
