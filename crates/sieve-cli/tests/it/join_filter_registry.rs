//! Join filters registered once per storage node per query: their bytes do
//! not grow with the number of slices, they are released when the query
//! ends, and a node that does not hold one runs the slice without it.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arrow_flight::{Action, Ticket};
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::expressions::{lit, BinaryExpr, Column};
use datafusion::physical_expr::PhysicalExpr;
use futures::StreamExt;
use prost::Message;
use sieve_cli::cluster::{generated_tpch, EmbeddedCluster};
use sieve_cli::compare::{reference_context, rows_as_text, run};
use sieve_compute::{BearerAuth, SieveSession, StorageClient};
use sieve_format::SliceLayout;
use sieve_fragment::{
    Fragment, FragmentEnvelope, JoinFilterRegistration, SliceMetrics, REGISTER_JOIN_FILTER_ACTION,
};

use crate::common;
use crate::slices;

const NODES: usize = 3;

/// TPC-H SF 0.01 with lineitem (60,175 rows) in slices of `slice_rows`.
fn data(slice_rows: usize) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "tpch-sf0.01-slices{slice_rows}-v{}",
        sieve_format::FORMAT_VERSION
    ));
    let layout = SliceLayout {
        slice_rows_max: slice_rows,
        row_group_rows_max: 1024,
        ..SliceLayout::default()
    };
    generated_tpch(&root, 0.01, NODES, 1, &layout).expect("generate TPC-H")
}

/// A join whose build side (a year of orders, about 2,300 keys) becomes a
/// key bitmap or Bloom filter on the lineitem scan.
const JOIN: &str = "select count(*), sum(l_quantity) from orders, lineitem \
                    where o_orderkey = l_orderkey \
                    and o_orderdate >= date '1995-01-01' and o_orderdate < date '1996-01-01'";

struct Measured {
    join_filter_bytes: u64,
    bytes_sent: u64,
    slices_requested: u64,
    rows: Vec<String>,
}

async fn measure(session: &SieveSession, sql: &str) -> Measured {
    // The join filter alone: a star join would take the orders join (a
    // small build side) into the lineitem scan, with no filter to register.
    session
        .context
        .sql("set sieve.star_join_pushdown = false")
        .await
        .expect("a setting");
    let before = session.traffic.snapshot();
    let batches = run(&session.context, sql).await.expect("query runs");
    let spent = session.traffic.snapshot().since(&before);
    Measured {
        join_filter_bytes: spent.join_filter_bytes,
        bytes_sent: spent.bytes_sent,
        slices_requested: spent.slices_requested,
        rows: rows_as_text(&batches, false).unwrap(),
    }
}

/// Join filters held by every node, once releases have arrived.
async fn filters_held(clients: &[StorageClient]) -> u64 {
    let mut held = 0;
    for _ in 0..50 {
        held = 0;
        for client in clients {
            let stats = client.stats().await.unwrap();
            held += stats["join_filters_held"].as_u64().unwrap();
        }
        if held == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn join_filter_bytes_do_not_grow_with_slices_and_are_released() {
    let mut measured = Vec::new();
    for slice_rows in [15_100, 1_510] {
        let root = data(slice_rows);
        let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
        let session = cluster.session().await.unwrap();
        let slices = common::planned_tables(&session)["lineitem"].slices.len();
        let reference = reference_context(&root, NODES).await.unwrap();
        let expected = rows_as_text(&run(&reference, JOIN).await.unwrap(), false).unwrap();
        let found = measure(&session, JOIN).await;
        assert_eq!(found.rows, expected, "{slice_rows}-row slices");
        let mut clients = Vec::new();
        for url in cluster.urls() {
            clients.push(
                StorageClient::connect(&url, Some(cluster.secret()))
                    .await
                    .unwrap(),
            );
        }
        assert_eq!(
            filters_held(&clients).await,
            0,
            "every registration is released when its query ends"
        );
        eprintln!(
            "{slices} lineitem slices: join filter bytes {}, bytes sent {}, slice requests {}",
            found.join_filter_bytes, found.bytes_sent, found.slices_requested
        );
        measured.push((slices, found));
    }
    let (few, many) = (&measured[0], &measured[1]);
    assert!(
        few.0 <= 4 && many.0 >= 40,
        "slices: {} and {}",
        few.0,
        many.0
    );
    assert!(
        few.1.join_filter_bytes > 1000,
        "a membership test was registered"
    );
    assert_eq!(
        few.1.join_filter_bytes, many.1.join_filter_bytes,
        "join filter bytes per query do not depend on the number of slices"
    );
    // What does grow is one small envelope per request.
    let per_request =
        (many.1.bytes_sent - few.1.bytes_sent) / (many.1.slices_requested - few.1.slices_requested);
    assert!(
        per_request < 1000,
        "{per_request} bytes sent per extra slice request"
    );
}

/// Read a DoGet answer to its end: rows shipped and the metrics trailer.
async fn rows_and_trailer(
    client: &mut sieve_compute::AuthenticatedFlightClient,
    envelope: &FragmentEnvelope,
) -> (usize, SliceMetrics) {
    let (messages, metrics) = slices::slice_messages(client, envelope.encode_to_vec()).await;
    let batches: Vec<_> = arrow_flight::decode::FlightRecordBatchStream::new_from_flight_data(
        futures::stream::iter(messages.into_iter().map(Ok)),
    )
    .map(|batch| batch.unwrap())
    .collect()
    .await;
    (batches.iter().map(|batch| batch.num_rows()).sum(), metrics)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_applies_a_registered_filter_and_runs_without_a_missing_one() {
    let root = data(1_510);
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let session = cluster.session().await.unwrap();
    let tables = common::planned_tables(&session);
    let table = &tables["lineitem"];
    let slice = &table.slices[0];
    let url = cluster.urls()[slice.node].clone();
    let channel = tonic::transport::Endpoint::from_shared(url)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = arrow_flight::flight_service_client::FlightServiceClient::with_interceptor(
        channel,
        BearerAuth::new(Some(cluster.secret())).unwrap(),
    )
    .max_decoding_message_size(64 * 1024 * 1024)
    .max_encoding_message_size(64 * 1024 * 1024);

    let body = Fragment {
        projection: vec![0],
        predicate: None,
        aggregate: None,
    }
    .encode_body(&table.schema)
    .unwrap();
    let plain = FragmentEnvelope::new(&table.name, slice.summary.slice, body);
    let (all_rows, metrics) = rows_and_trailer(&mut client, &plain).await;
    assert!(!metrics.join_filter_missing && all_rows > 1000);

    // l_orderkey < 1000, registered.
    let filter: Arc<dyn PhysicalExpr> = Arc::new(BinaryExpr::new(
        Arc::new(Column::new("l_orderkey", 0)),
        Operator::Lt,
        lit(1000i64),
    ));
    let (registration, id) =
        JoinFilterRegistration::encode(&table.name, &table.schema, &filter).unwrap();
    let answer = client
        .do_action(Action::new(
            REGISTER_JOIN_FILTER_ACTION,
            JoinFilterRegistration::compress(&registration).unwrap(),
        ))
        .await
        .unwrap()
        .into_inner()
        .next()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(answer.body.as_ref(), id);
    let filtered = plain.clone().with_join_filter(&id);
    let (rows, metrics) = rows_and_trailer(&mut client, &filtered).await;
    assert!(!metrics.join_filter_missing);
    assert!(rows > 0 && rows < all_rows, "{rows} of {all_rows} rows");

    // An id the node never saw: the slice runs without it, and says so.
    let unknown = plain.clone().with_join_filter(&[7; 16]);
    let (rows, metrics) = rows_and_trailer(&mut client, &unknown).await;
    assert!(metrics.join_filter_missing);
    assert_eq!(rows, all_rows);

    // A filter registered for another table is refused when named.
    let orders = &tables["orders"];
    let orders_body = Fragment {
        projection: vec![0],
        predicate: None,
        aggregate: None,
    }
    .encode_body(&orders.schema)
    .unwrap();
    let orders_slice = orders
        .slices
        .iter()
        .find(|candidate| candidate.node == slice.node)
        .expect("an orders slice on the same node");
    let wrong_table = FragmentEnvelope::new(&orders.name, orders_slice.summary.slice, orders_body)
        .with_join_filter(&id);
    let mut other = client.clone();
    let status = match other.do_get(Ticket::new(wrong_table.encode_to_vec())).await {
        Err(status) => status,
        Ok(response) => response
            .into_inner()
            .next()
            .await
            .expect("an answer")
            .expect_err("refused"),
    };
    assert!(
        status.message().contains("registered for table"),
        "{status}"
    );

    // A malformed registration is refused with a clear error.
    let status = client
        .do_action(Action::new(REGISTER_JOIN_FILTER_ACTION, vec![0xff; 9]))
        .await
        .expect_err("refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status}");
}
