//! The Star Schema Benchmark: `sieve gen ssb`'s tables through the write
//! path, and its 13 queries in every mode (NDP on, NDP off, every slice
//! served raw) against plain DataFusion over the same slice files.

use std::path::PathBuf;

use sieve_cli::cluster::{generated, EmbeddedCluster};
use sieve_cli::compare::{reference_context_for, rows_as_text, run};
use sieve_cli::queries::{is_ordered, SSB_QUERIES};
use sieve_compute::SieveSession;
use sieve_format::{Benchmark, SliceLayout};

use crate::common::{explain, NODES};

/// SF 0.1: 600,000 line orders, 3,000 customers, 200 suppliers (fewer
/// leave Q3.3's two British cities without a supplier).
const SCALE_FACTOR: f64 = 0.1;

fn test_data() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "ssb-sf{SCALE_FACTOR}-slices50000-v{}",
        sieve_format::FORMAT_VERSION
    ));
    let layout = SliceLayout {
        slice_rows_max: 50_000,
        row_group_rows_max: 8_192,
        ..SliceLayout::default()
    };
    generated(Benchmark::Ssb, &root, SCALE_FACTOR, NODES, 1, &layout).expect("load SSB")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ssb_queries_match_plain_datafusion_in_every_mode() {
    let root = test_data();
    let names: Vec<&str> = Benchmark::Ssb
        .tables()
        .iter()
        .map(|table| table.name)
        .collect();
    let reference = reference_context_for(&root, NODES, &names)
        .await
        .expect("reference context");
    let cluster = EmbeddedCluster::start(&root, NODES).await.expect("nodes");
    let session = cluster.session().await.expect("session");
    let raw_cluster = EmbeddedCluster::start_raw(&root, NODES)
        .await
        .expect("raw nodes");
    let raw_session = raw_cluster.session().await.expect("raw session");
    let mut empty = Vec::new();
    for (name, sql) in SSB_QUERIES {
        let sort = !is_ordered(sql);
        let expected = rows_as_text(&run(&reference, sql).await.expect(name), sort).unwrap();
        if expected.is_empty() {
            empty.push(name);
        }
        for (mode, session, ndp) in [
            ("ndp", &session, true),
            ("off", &session, false),
            ("raw", &raw_session, true),
        ] {
            session.set_ndp(ndp).unwrap();
            let batches = run(&session.context, sql)
                .await
                .unwrap_or_else(|error| panic!("{name} ({mode}): {error}"));
            assert_eq!(
                rows_as_text(&batches, sort).unwrap(),
                expected,
                "{name} ({mode}) differs from plain DataFusion"
            );
        }
    }
    // Every query but Q3.4 selects rows at this scale, so each comparison
    // checks something. Q3.4 keeps 1 line order in about 1.3 million
    // (two cities of 250 on each side, one month of 84): none of 600,000.
    assert_eq!(empty, ["q3.4"], "queries with no rows");
    let (raw, served) = raw_cluster.slices_raw_and_served();
    assert!(served > 0 && raw == served, "{raw} of {served} slices raw");
}

/// The storage side of a star join: a fragment whose operators probe hash
/// joins with shipped build sides (rows of `date`, made here) over the
/// slice's rows, with and without a partial aggregation above, inner and
/// right semi, a NULL build key among them. Run by the storage nodes and,
/// with every slice raw, by the compute node, against plain DataFusion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn star_join_fragments_run_on_the_storage_nodes_and_raw() {
    use std::sync::Arc;

    use arrow::array::{Int32Array, RecordBatch};
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::common::{JoinType, NullEquality};
    use datafusion::datasource::memory::MemorySourceConfig;
    use datafusion::physical_expr::aggregate::AggregateExprBuilder;
    use datafusion::physical_expr::expressions::{CastExpr, Column};
    use datafusion::physical_expr::PhysicalExpr;
    use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode, PhysicalGroupBy};
    use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
    use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
    use datafusion::physical_plan::{collect, ExecutionPlan};
    use sieve_compute::{PushedAggregate, SieveScanExec};
    use sieve_fragment::SliceInputExec;

    let root = test_data();
    let names: Vec<&str> = Benchmark::Ssb
        .tables()
        .iter()
        .map(|table| table.name)
        .collect();
    let reference = reference_context_for(&root, NODES, &names)
        .await
        .expect("reference context");
    // The build side: 1993's and 1994's date keys and years, and a NULL key
    // (it must match nothing).
    let dates = reference
        .sql("SELECT d_datekey, d_year FROM date WHERE d_year IN (1993, 1994) ORDER BY d_datekey")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let mut keys: Vec<Option<i32>> = Vec::new();
    let mut years: Vec<Option<i32>> = Vec::new();
    for batch in &dates {
        let key = batch
            .column(0)
            .as_any()
            .downcast_ref::<Int32Array>()
            .unwrap();
        let year = batch
            .column(1)
            .as_any()
            .downcast_ref::<Int32Array>()
            .unwrap();
        keys.extend(key.iter());
        years.extend(year.iter());
    }
    keys.push(None);
    years.push(Some(1993));
    let build_schema = Arc::new(Schema::new(vec![
        Field::new("d_datekey", DataType::Int32, true),
        Field::new("d_year", DataType::Int32, true),
    ]));
    let build_batch = RecordBatch::try_new(
        Arc::clone(&build_schema),
        vec![
            Arc::new(Int32Array::from(keys)),
            Arc::new(Int32Array::from(years)),
        ],
    )
    .unwrap();
    let build = || -> Arc<dyn ExecutionPlan> {
        MemorySourceConfig::try_new_exec(
            &[vec![build_batch.clone()]],
            Arc::clone(&build_schema),
            None,
        )
        .unwrap()
    };

    // Each case: the operators over the slice's rows (`SliceInputExec`
    // with the lineorder scan's shipped columns: lo_orderdate, lo_revenue),
    // an optional final aggregation above the scan, and the same query in
    // SQL for plain DataFusion.
    let slice_input = |session_scan: &SieveScanExec| -> Arc<dyn ExecutionPlan> {
        Arc::new(SliceInputExec::new(session_scan.schema()))
    };
    let join = |probe: Arc<dyn ExecutionPlan>,
                join_type: JoinType,
                projection: Option<Vec<usize>>|
     -> Arc<dyn ExecutionPlan> {
        let on = vec![(
            Arc::new(Column::new("d_datekey", 0)) as Arc<dyn PhysicalExpr>,
            Arc::new(Column::new("lo_orderdate", 0)) as Arc<dyn PhysicalExpr>,
        )];
        Arc::new(
            HashJoinExec::try_new(
                build(),
                probe,
                on,
                None,
                &join_type,
                projection,
                PartitionMode::CollectLeft,
                NullEquality::NullEqualsNothing,
                false,
            )
            .unwrap(),
        )
    };
    let probe_sql = "SELECT lo_orderdate, lo_revenue FROM lineorder";

    let cluster = EmbeddedCluster::start(&root, NODES).await.expect("nodes");
    let raw_cluster = EmbeddedCluster::start_raw(&root, NODES)
        .await
        .expect("raw nodes");
    for (mode, cluster) in [("ndp", &cluster), ("raw", &raw_cluster)] {
        let session = cluster.session().await.expect("session");
        let plan = session
            .context
            .sql(probe_sql)
            .await
            .unwrap()
            .create_physical_plan()
            .await
            .unwrap();
        let mut pending = vec![plan];
        let mut scan_node = None;
        while let Some(node) = pending.pop() {
            if node.downcast_ref::<SieveScanExec>().is_some() {
                scan_node = Some(node);
                break;
            }
            pending.extend(node.children().into_iter().cloned());
        }
        let scan_node = scan_node.expect("a lineorder scan");
        let scan = scan_node.downcast_ref::<SieveScanExec>().unwrap();

        // 1. Inner join, joined rows shipped: (d_year, lo_revenue).
        let inner = join(slice_input(scan), JoinType::Inner, Some(vec![1, 3]));
        // 2. Right semi join: lineorder rows with a date of those years.
        let semi = join(slice_input(scan), JoinType::RightSemi, None);
        // 3. A partial aggregation over the inner join: revenue by year.
        let group = PhysicalGroupBy::new_single(vec![(
            Arc::new(Column::new("d_year", 0)) as Arc<dyn PhysicalExpr>,
            "d_year".to_string(),
        )]);
        let sum = Arc::new(
            AggregateExprBuilder::new(
                // Sieve's `sum`, as the SQL planner and the storage nodes
                // take it.
                Arc::new(sieve_fragment::checked_sum()),
                // SUM takes Int64 (the SQL planner casts likewise).
                vec![Arc::new(CastExpr::new(
                    Arc::new(Column::new("lo_revenue", 1)),
                    DataType::Int64,
                    None,
                )) as Arc<dyn PhysicalExpr>],
            )
            .schema(inner.schema())
            .alias("revenue")
            .build()
            .unwrap(),
        );
        let partial: Arc<dyn ExecutionPlan> = Arc::new(
            AggregateExec::try_new(
                AggregateMode::Partial,
                group.clone(),
                vec![Arc::clone(&sum)],
                vec![None],
                Arc::clone(&inner),
                inner.schema(),
            )
            .unwrap(),
        );
        let cases: [(&str, Arc<dyn ExecutionPlan>, bool, &str); 3] = [
            (
                "inner",
                Arc::clone(&inner),
                false,
                "SELECT d_year, lo_revenue FROM lineorder JOIN date ON lo_orderdate = d_datekey \
                 WHERE d_year IN (1993, 1994)",
            ),
            (
                "semi",
                semi,
                false,
                "SELECT lo_orderdate, lo_revenue FROM lineorder WHERE lo_orderdate IN \
                 (SELECT d_datekey FROM date WHERE d_year IN (1993, 1994))",
            ),
            (
                "aggregate",
                partial,
                true,
                "SELECT d_year, sum(lo_revenue) AS revenue FROM lineorder \
                 JOIN date ON lo_orderdate = d_datekey WHERE d_year IN (1993, 1994) GROUP BY d_year",
            ),
        ];
        for (case, operators, aggregated, sql) in cases {
            let pushed: Arc<dyn ExecutionPlan> = Arc::new(
                scan.with_aggregate(PushedAggregate {
                    plan: Arc::clone(&operators),
                    description: format!("star join test: {case}"),
                })
                .unwrap_or_else(|error| panic!("{case}: {error}")),
            );
            let plan: Arc<dyn ExecutionPlan> = if aggregated {
                let input_schema = inner.schema();
                Arc::new(
                    AggregateExec::try_new(
                        AggregateMode::Final,
                        group.as_final(),
                        vec![Arc::clone(&sum)],
                        vec![None],
                        Arc::new(CoalescePartitionsExec::new(pushed)),
                        input_schema,
                    )
                    .unwrap(),
                )
            } else {
                pushed
            };
            let batches = collect(plan, session.context.task_ctx())
                .await
                .unwrap_or_else(|error| panic!("{case} ({mode}): {error}"));
            let expected = run(&reference, sql).await.unwrap();
            let expected = rows_as_text(&expected, true).unwrap();
            assert!(!expected.is_empty(), "{case}: no rows to compare");
            assert_eq!(
                rows_as_text(&batches, true).unwrap(),
                expected,
                "{case} ({mode}) differs from plain DataFusion"
            );
        }
    }
    let (raw, served) = raw_cluster.slices_raw_and_served();
    assert!(served > 0 && raw == served, "{raw} of {served} slices raw");
    let (raw, served) = cluster.slices_raw_and_served();
    assert!(
        served > 0 && raw == 0,
        "{raw} of {served} slices raw on the NDP nodes"
    );
}

/// Which SSB queries the star join takes, as EXPLAIN shows them, and that
/// turning it off gives the same rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_shows_the_pushed_star_joins_and_turning_them_off_changes_no_row() {
    let root = test_data();
    let cluster = EmbeddedCluster::start(&root, NODES).await.expect("nodes");
    let session = cluster.session().await.expect("session");
    let mut pushed = Vec::new();
    for (name, sql) in SSB_QUERIES {
        session.set_ndp(true).unwrap();
        let explained = run(&session.context, &format!("EXPLAIN {sql}"))
            .await
            .unwrap();
        let text = rows_as_text(&explained, false).unwrap().join("\n");
        // The fact table's scan takes the joins, never a dimension's.
        let lineorder_pushed = text.lines().any(|line| {
            line.contains("SieveScanExec: table=lineorder")
                && line.contains("pushed join: dimension(s)")
        });
        assert!(
            !text
                .lines()
                .any(|line| line.contains("pushed join: dimension(s)")
                    && !line.contains("SieveScanExec: table=lineorder")),
            "{name}: a star join pushed into a dimension's scan:\n{text}"
        );
        if lineorder_pushed {
            pushed.push(name);
        }
        let on =
            rows_as_text(&run(&session.context, sql).await.unwrap(), !is_ordered(sql)).unwrap();
        session
            .context
            .sql("SET sieve.star_join_pushdown = false")
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        let off =
            rows_as_text(&run(&session.context, sql).await.unwrap(), !is_ordered(sql)).unwrap();
        session
            .context
            .sql("SET sieve.star_join_pushdown = true")
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        assert_eq!(on, off, "{name}: star join on and off differ");
    }
    // Q4.x too: DataFusion builds its last join from the joins over
    // lineorder and probes it with `part`; `sieve.swap_join_sides` builds
    // it on `part`, so every join has lineorder on its probe side.
    assert_eq!(
        pushed,
        [
            "q1.1", "q1.2", "q1.3", "q2.1", "q2.2", "q2.3", "q3.1", "q3.2", "q3.3", "q3.4", "q4.1",
            "q4.2", "q4.3"
        ]
    );
}

/// Push star joins whose build sides hold more rows than a quarter of a
/// slice's (20,000 parts against ~46,000 line orders per slice here).
async fn relax_star_join_rows(session: &SieveSession) {
    session
        .sql("SET sieve.star_join_build_rows_share = 100")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
}

/// A star join whose build rows turn out too large for a fragment (the
/// estimate said small: a computed wide payload) still answers: the nodes
/// filter and ship rows, and the joins and the partial aggregation run on
/// the compute node. Two sizes: past the fragment's byte limit, and past
/// the allow-list's build-side limit. Against plain DataFusion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_star_join_too_large_for_a_fragment_runs_its_joins_on_the_compute_node() {
    let root = test_data();
    let names: Vec<&str> = Benchmark::Ssb
        .tables()
        .iter()
        .map(|table| table.name)
        .collect();
    let reference = reference_context_for(&root, NODES, &names)
        .await
        .expect("reference context");
    let cluster = EmbeddedCluster::start(&root, NODES).await.expect("nodes");
    let session = cluster.session().await.expect("session");
    // 20,000 parts against ~46,000 line orders per slice: past the default
    // share of a slice's rows, the join goes as a join filter.
    let sql = "SELECT count(*) AS n, sum(lo_revenue) AS revenue \
               FROM lineorder JOIN part ON lo_partkey = p_partkey WHERE lo_discount < 5";
    let explained = explain(&session.context, sql).await;
    assert!(
        !explained.contains("pushed join:") && explained.contains("join filter from"),
        "{explained}"
    );
    let expected = rows_as_text(&run(&reference, sql).await.unwrap(), false).unwrap();
    let got = rows_as_text(&run(&session.context, sql).await.unwrap(), false).unwrap();
    assert_eq!(got, expected, "differs from plain DataFusion");
    // A looser share pushes it.
    relax_star_join_rows(&session).await;
    // 20,000 parts with names repeated: about 8 MB and 20 MB of payload,
    // estimated at 24 bytes a string.
    for copies in [40, 100] {
        let sql = format!(
            "SELECT count(*) AS n, max(big) AS longest, sum(lo_revenue) AS revenue \
             FROM lineorder JOIN (SELECT p_partkey, repeat(p_name, {copies}) AS big FROM part) p \
             ON lo_partkey = p_partkey WHERE lo_discount < 5"
        );
        let explained = explain(&session.context, &sql).await;
        assert!(
            explained.contains("pushed join: dimension(s) part"),
            "{copies}: the star join is not pushed, nothing to test:\n{explained}"
        );
        let analyzed = rows_as_text(
            &run(&session.context, &format!("EXPLAIN ANALYZE {sql}"))
                .await
                .unwrap(),
            false,
        )
        .unwrap()
        .join("\n");
        assert!(
            analyzed.contains("star join run here: 20000 build rows"),
            "{copies}: the joins did not fall back to the compute node:\n{analyzed}"
        );
        let expected = rows_as_text(&run(&reference, &sql).await.unwrap(), false).unwrap();
        let got = rows_as_text(&run(&session.context, &sql).await.unwrap(), false).unwrap();
        assert_eq!(got, expected, "{copies}: differs from plain DataFusion");
    }
    // The fallback's own fragment past the inline bound (here a long NOT
    // IN list; at SSB SF 10, Q4.2's key bitmaps) is registered once per
    // node, not sent with each slice request.
    let ship_modes: Vec<String> = (0..600)
        .map(|index| format!("'not a ship mode, number {index:05}'"))
        .collect();
    let sql = format!(
        "SELECT count(*) AS n, max(big) AS longest, sum(lo_revenue) AS revenue \
         FROM lineorder JOIN (SELECT p_partkey, repeat(p_name, 40) AS big FROM part) p \
         ON lo_partkey = p_partkey WHERE lo_discount < 5 AND lo_shipmode NOT IN ({})",
        ship_modes.join(", ")
    );
    let analyzed = rows_as_text(
        &run(&session.context, &format!("EXPLAIN ANALYZE {sql}"))
            .await
            .unwrap(),
        false,
    )
    .unwrap()
    .join("\n");
    let line = analyzed
        .lines()
        .find(|line| line.contains("star join run here: 20000 build rows"))
        .unwrap_or_else(|| panic!("the joins did not fall back:\n{analyzed}"));
    assert!(
        line.contains("body registered on 3 of 3 nodes"),
        "the fallback's fragment was not registered:\n{line}"
    );
    let expected = rows_as_text(&run(&reference, &sql).await.unwrap(), false).unwrap();
    let got = rows_as_text(&run(&session.context, &sql).await.unwrap(), false).unwrap();
    assert_eq!(got, expected, "long NOT IN: differs from plain DataFusion");
}

/// A star join's fragment, with its dimension's rows, is registered once
/// on each node and named by id in each slice request, so the bytes sent
/// to the nodes do not grow with the slices; a node that lost it (as after
/// a restart) gets the body inline, with the same answer. Against plain
/// DataFusion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_star_joins_body_is_sent_once_per_node_and_inline_to_a_node_that_lost_it() {
    let root = test_data();
    let names: Vec<&str> = Benchmark::Ssb
        .tables()
        .iter()
        .map(|table| table.name)
        .collect();
    let reference = reference_context_for(&root, NODES, &names)
        .await
        .expect("reference context");
    let cluster = EmbeddedCluster::start(&root, NODES).await.expect("nodes");
    let session = cluster.session().await.expect("session");
    relax_star_join_rows(&session).await;
    // 20,000 parts with a name: a body of hundreds of kilobytes.
    let sql = "SELECT count(*) AS n, max(name) AS longest, sum(lo_revenue) AS revenue \
               FROM lineorder JOIN (SELECT p_partkey, p_name || '!' AS name FROM part) p \
               ON lo_partkey = p_partkey WHERE lo_discount < 5";
    let expected = rows_as_text(&run(&reference, sql).await.unwrap(), false).unwrap();
    for forgotten in [false, true] {
        for node in &cluster.nodes {
            node.faults().forget_fragment_bodies(forgotten);
        }
        let before = session.traffic.snapshot();
        let analyzed = rows_as_text(
            &run(&session.context, &format!("EXPLAIN ANALYZE {sql}"))
                .await
                .unwrap(),
            false,
        )
        .unwrap()
        .join("\n");
        let spent = session.traffic.snapshot().since(&before);
        let body_bytes: u64 = analyzed
            .split("-byte fragment")
            .next()
            .and_then(|head| head.rsplit(' ').next())
            .and_then(|number| number.parse().ok())
            .unwrap_or_else(|| panic!("no star join fragment in:\n{analyzed}"));
        assert!(
            body_bytes > sieve_compute::BODY_INLINE_BYTES_MAX as u64,
            "a body of {body_bytes} bytes is sent inline anyway"
        );
        assert!(
            analyzed.contains(&format!("body registered on {NODES} of {NODES} nodes")),
            "{analyzed}"
        );
        let requests = spent.slices_requested;
        assert!(requests >= 6, "{requests} slice requests");
        if forgotten {
            // Each request went twice: named, then inline.
            assert!(
                spent.bytes_sent > requests / 2 * body_bytes,
                "{} bytes sent for {requests} requests of a {body_bytes}-byte body",
                spent.bytes_sent
            );
        } else {
            // The body once per node (compressed), not once per request.
            assert!(
                spent.bytes_sent < NODES as u64 * body_bytes + requests * 4096,
                "{} bytes sent for {requests} requests of a {body_bytes}-byte body",
                spent.bytes_sent
            );
        }
        let got = rows_as_text(&run(&session.context, sql).await.unwrap(), false).unwrap();
        assert_eq!(got, expected, "bodies forgotten: {forgotten}");
    }
}
