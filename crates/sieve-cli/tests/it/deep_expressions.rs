//! Deep and large expressions (issue 16): a legitimate query whose filter is
//! too deep to ship is run on the compute node, with EXPLAIN saying why, and
//! gets its answer; a 10,000-term OR of values gets its answer as an IN
//! list; a 10,000-term expression that is no list gets a clear error; and a
//! hostile fragment nested past every limit is refused by the storage node,
//! which keeps serving. No process dies.
//!
//! Deep plans need deep stacks (DataFusion recurses over expressions), so
//! these tests run on `sieve_compute::compute_runtime`, as the CLI does.
//! The references are plain DataFusion over equivalent shallow SQL: plain
//! DataFusion plans a 700-level filter in about a minute in a debug build.

use crate::common;

use std::sync::Arc;

use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::Ticket;
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::expressions::{col, lit, BinaryExpr};
use datafusion::physical_expr::PhysicalExpr;
use datafusion_proto::physical_plan::to_proto::serialize_physical_expr;
use futures::StreamExt;
use prost::Message;
use sieve_cli::cluster::EmbeddedCluster;
use sieve_cli::compare::{reference_context_for, rows_as_text, run};
use sieve_compute::compute_runtime;
use sieve_fragment::{schema_fingerprint, FragmentBody, FragmentEnvelope, SieveCodec};

const TABLES: [&str; 1] = ["lineitem"];

/// `l_orderkey + 1 + 1 ... > 0` with `terms` additions.
fn chain(terms: usize) -> String {
    let mut sql = String::from("select count(*), sum(l_quantity) from lineitem where l_orderkey");
    for _ in 0..terms {
        sql.push_str(" + 1");
    }
    sql.push_str(&format!(" > {}", 3 * terms));
    sql
}

/// `l_orderkey = 0 or l_orderkey = 7 or ...`, `terms` equalities, and the
/// same as an IN list.
fn ors(terms: usize) -> (String, String) {
    let values: Vec<String> = (0..terms).map(|term| (term * 7).to_string()).collect();
    let select = "select count(*), sum(l_quantity) from lineitem where";
    let ors: Vec<String> = values
        .iter()
        .map(|value| format!("l_orderkey = {value}"))
        .collect();
    (
        format!("{select} {}", ors.join(" or ")),
        format!("{select} l_orderkey in ({})", values.join(", ")),
    )
}

fn on_deep_stacks<F: std::future::Future<Output = ()> + Send + 'static>(test: F) {
    let runtime = compute_runtime().expect("runtime");
    runtime.block_on(async move { tokio::spawn(test).await.expect("test task") });
}

#[test]
fn deep_filters_get_their_answer_on_the_compute_node() {
    on_deep_stacks(async {
        let root = common::small_slices(2);
        let reference = reference_context_for(&root, common::NODES, &TABLES)
            .await
            .unwrap();
        let cluster = EmbeddedCluster::start(&root, common::NODES).await.unwrap();
        let session = cluster.session().await.unwrap();

        // EXPLAIN says why the filter stays here.
        let plan = run(&session.context, &format!("explain {}", chain(60)))
            .await
            .unwrap();
        let plan = rows_as_text(&plan, false).unwrap().join("\n");
        assert!(
            plan.contains(
                "filter kept on the compute node: expression nested 62 deep, above the limit of 40"
            ),
            "{plan}"
        );

        // The 700-term query, against the same filter written shallow.
        let expected = rows_as_text(
            &run(
                &reference,
                "select count(*), sum(l_quantity) from lineitem where l_orderkey + 700 > 2100",
            )
            .await
            .unwrap(),
            false,
        )
        .unwrap();
        let got = rows_as_text(&run(&session.context, &chain(700)).await.unwrap(), false).unwrap();
        assert_eq!(got, expected);
        assert_ne!(expected, ["0 | "], "the filter keeps some rows");

        // 10,000 ORs of values: the answer, as the IN list gives it.
        let (or_sql, in_sql) = ors(10_000);
        let expected = rows_as_text(&run(&reference, &in_sql).await.unwrap(), false).unwrap();
        let got = rows_as_text(&run(&session.context, &or_sql).await.unwrap(), false).unwrap();
        assert_eq!(got, expected);

        // An IN list of 50,000 long strings encodes past half the fragment
        // bound: it stays here, and the answer is right.
        let mut values: Vec<String> = (0..50_000)
            .map(|value| format!("'{value:0>100}'"))
            .collect();
        values.extend(["'AIR'".to_string(), "'MAIL'".to_string()]);
        let sql = format!(
            "select count(*) from lineitem where l_shipmode in ({})",
            values.join(", ")
        );
        let expected = rows_as_text(&run(&reference, &sql).await.unwrap(), false).unwrap();
        let got = rows_as_text(&run(&session.context, &sql).await.unwrap(), false).unwrap();
        assert_eq!(got, expected);
        let plan = run(&session.context, &format!("explain {sql}"))
            .await
            .unwrap();
        let plan = rows_as_text(&plan, false).unwrap().join("\n");
        assert!(
            plan.contains("above half the limit of 4194304"),
            "{}",
            &plan[..2000.min(plan.len())]
        );

        // 10,000 terms that are no list: a clear error, and the session goes on.
        let error = run(&session.context, &chain(10_000))
            .await
            .expect_err("too deep")
            .to_string();
        assert!(error.contains("sieve.expression_depth_max"), "{error}");
        let rows = run(&session.context, "select count(*) from lineitem")
            .await
            .unwrap();
        assert_eq!(rows_as_text(&rows, false).unwrap(), ["60175"]);
    });
}

/// A fragment nested far past the limits, built by hand (no compute node
/// would ship it), is refused with a clear error by the storage node, which
/// then still answers.
#[test]
fn a_storage_node_refuses_a_deep_fragment_and_keeps_serving() {
    on_deep_stacks(async {
        let root = common::small_slices(1);
        let lineitem = common::stored(&root, "lineitem");
        let cluster = EmbeddedCluster::start(&root, common::NODES).await.unwrap();
        let schema = Arc::clone(
            &cluster.nodes[0]
                .executor()
                .catalog()
                .table(&lineitem.name)
                .unwrap()
                .schema,
        );
        let channel = tonic::transport::Endpoint::from_shared(cluster.urls()[0].clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut client = FlightServiceClient::with_interceptor(
            channel,
            sieve_compute::BearerAuth::new(Some(cluster.secret())).unwrap(),
        );
        let slice = *cluster.nodes[0]
            .executor()
            .catalog()
            .table(&lineitem.name)
            .unwrap()
            .slices
            .keys()
            .next()
            .unwrap();
        for depth in [45, 700, 5_000] {
            let mut predicate: Arc<dyn PhysicalExpr> = col("l_orderkey", &schema).unwrap();
            for _ in 0..depth {
                predicate = Arc::new(BinaryExpr::new(predicate, Operator::Plus, lit(1i64)));
            }
            let predicate: Arc<dyn PhysicalExpr> =
                Arc::new(BinaryExpr::new(predicate, Operator::Gt, lit(0i64)));
            let node = serialize_physical_expr(&predicate, &SieveCodec::new()).unwrap();
            std::mem::forget(predicate); // dropping it would recurse as deep
            let body = FragmentBody {
                schema_fingerprint: schema_fingerprint(&schema),
                projection: vec![0],
                predicate: Some(node),
                aggregate: None,
            }
            .encode_to_vec();
            let ticket = FragmentEnvelope::new(&lineitem.name, slice, body).encode_to_vec();
            let status = match client.do_get(Ticket::new(ticket)).await {
                Err(status) => status,
                Ok(response) => {
                    let mut stream = response.into_inner();
                    loop {
                        match stream.next().await {
                            Some(Ok(_)) => continue,
                            Some(Err(status)) => break status,
                            None => panic!("depth {depth}: the node ran the fragment"),
                        }
                    }
                }
            };
            assert_eq!(
                status.code(),
                tonic::Code::InvalidArgument,
                "depth {depth}: {status}"
            );
            assert!(
                status.message().contains("deep") || status.message().contains("recursion limit"),
                "depth {depth}: {status}"
            );
        }
        // Still serving.
        let session = cluster.session().await.unwrap();
        let rows = run(&session.context, "select count(*) from lineitem")
            .await
            .unwrap();
        assert_eq!(rows_as_text(&rows, false).unwrap(), ["60175"]);
    });
}
