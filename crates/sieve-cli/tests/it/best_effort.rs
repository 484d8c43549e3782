//! Best-effort pushdown: a storage node without a free pushdown worker serves
//! slices raw and the compute node completes them, with identical results;
//! a node busy with pushdown still answers plain reads and catalog requests.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::{Criteria, Ticket};
use futures::StreamExt;
use prost::Message;
use sieve_cli::cluster::{generated_tpch, EmbeddedCluster};
use sieve_cli::compare::{reference_context, rows_as_text, run};
use sieve_cli::queries::{is_ordered, TPCH_QUERIES};
use sieve_compute::{connect_session_with_tables, AuthenticatedFlightClient, BearerAuth};
use sieve_format::SliceLayout;
use sieve_fragment::Secret;
use sieve_fragment::{Fragment, FragmentEnvelope, IpcCodec};
use sieve_storage::ExecuteOptions;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::common;
use crate::common::run_with_scan_metrics;
use crate::slices;

use common::NODES;

fn test_data() -> PathBuf {
    common::small_slices(1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_pushdown_workers_every_slice_is_raw_and_results_are_identical() {
    let root = test_data();
    let cluster = EmbeddedCluster::start_raw(&root, NODES).await.unwrap();
    let session = cluster.session().await.unwrap();
    let reference = reference_context(&root, NODES).await.unwrap();
    let mut total_slices = 0;
    for (name, sql) in TPCH_QUERIES {
        let expected =
            rows_as_text(&run(&reference, sql).await.expect(name), !is_ordered(sql)).unwrap();
        let (batches, metrics) = run_with_scan_metrics(
            &session,
            sql,
            &["slices", "slices_raw", "slices_as_stored", "bytes_raw"],
        )
        .await
        .unwrap_or_else(|error| panic!("{name}: {error}"));
        let actual = rows_as_text(&batches, !is_ordered(sql)).unwrap();
        assert_eq!(
            actual, expected,
            "{name} over raw slices differs from plain DataFusion"
        );
        let [slices, raw, as_stored, raw_bytes] = metrics[..] else {
            unreachable!()
        };
        assert!(slices > 0, "{name} read no slice");
        // Scans with nothing to push ask for their pages as stored anyway.
        assert_eq!(raw + as_stored, slices, "{name}: every slice raw");
        assert!(raw_bytes > 0, "{name}: raw pages were shipped");
        total_slices += slices;
    }
    let mut served = 0;
    for node in &cluster.nodes {
        let counters = node.executor().counters().to_json();
        assert_eq!(
            counters["slices_raw"].as_u64().unwrap()
                + counters["slices_as_stored"].as_u64().unwrap(),
            counters["slices_served"].as_u64().unwrap(),
            "{counters}"
        );
        served += counters["slices_served"].as_u64().unwrap();
    }
    assert_eq!(served as usize, total_slices);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_pool_under_concurrent_queries_mixes_raw_and_processed_slices() {
    let root = test_data();
    let cluster = EmbeddedCluster::start_with(
        &root,
        NODES,
        ExecuteOptions {
            pushdown_workers: 1,
            pushdown_queue_max: Some(2),
            pushdown_wait: Duration::from_millis(1),
            ..ExecuteOptions::default()
        },
    )
    .await
    .unwrap();
    let reference = reference_context(&root, NODES).await.unwrap();
    let queries = [
        "q1", "q3", "q5", "q6", "q9", "q10", "q12", "q14", "q18", "q19",
    ];
    let mut expected = Vec::new();
    for wanted in queries {
        let (_, sql) = TPCH_QUERIES
            .iter()
            .find(|(name, _)| *name == wanted)
            .unwrap();
        expected
            .push(rows_as_text(&run(&reference, sql).await.unwrap(), !is_ordered(sql)).unwrap());
    }
    let expected = Arc::new(expected);
    // Four streams, each running every query in its own order, at once.
    let mut streams = Vec::new();
    for stream in 0..4 {
        let urls = cluster.urls();
        let secret = cluster.secret().clone();
        let catalog = cluster.catalog_path();
        let expected = Arc::clone(&expected);
        streams.push(tokio::spawn(async move {
            let session = connect_session_with_tables(
                &urls,
                Some(&secret),
                datafusion::prelude::SessionConfig::new(),
                Some(&catalog),
            )
            .await
            .unwrap();
            for step in 0..queries.len() {
                let index = (step + stream * 3) % queries.len();
                let (_, sql) = TPCH_QUERIES
                    .iter()
                    .find(|(name, _)| *name == queries[index])
                    .unwrap();
                let batches = run(&session.context, sql).await.unwrap();
                let actual = rows_as_text(&batches, !is_ordered(sql)).unwrap();
                assert_eq!(
                    actual, expected[index],
                    "{} in stream {stream} differs from plain DataFusion",
                    queries[index]
                );
            }
        }));
    }
    for stream in streams {
        stream.await.expect("stream succeeded");
    }
    let (raw, served) = cluster.slices_raw_and_served();
    eprintln!("{raw} of {served} slices served raw");
    assert!(
        raw > 0,
        "a pool of one under four streams served nothing raw"
    );
    assert!(raw < served, "nothing was processed on the storage nodes");
}

/// One node over TPC-H SF 0.01 in the default layout: lineitem is one slice
/// of 60,175 rows, several megabytes when shipped whole.
fn one_big_slice_data() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "tpch-sf0.01-one-node-default-layout-v{}",
        sieve_format::FORMAT_VERSION
    ));
    generated_tpch(&root, 0.01, 1, 1, &SliceLayout::default()).expect("generate TPC-H")
}

fn whole_slice_ticket(schema: &arrow::datatypes::Schema, table: &str) -> Vec<u8> {
    let table = common::stored(&one_big_slice_data(), table);
    let body = Fragment {
        projection: (0..schema.fields().len()).collect(),
        predicate: None,
        aggregate: None,
    }
    .encode_body(schema)
    .unwrap();
    FragmentEnvelope::new(&table.name, table.slice(0), body)
        .with_ipc_codec(IpcCodec::None)
        .encode_to_vec()
}

/// Read a whole DoGet answer and return its metrics trailer.
async fn trailer_of(
    client: &mut AuthenticatedFlightClient,
    ticket: Vec<u8>,
) -> sieve_fragment::SliceMetrics {
    slices::slice_messages(client, ticket).await.1
}

/// A Flight client on its own connection.
async fn connect(url: String, secret: &Secret) -> AuthenticatedFlightClient {
    let channel = tonic::transport::Endpoint::from_shared(url)
        .unwrap()
        .connect()
        .await
        .unwrap();
    FlightServiceClient::with_interceptor(channel, BearerAuth::new(Some(secret)).unwrap())
}

async fn stats(client: &mut AuthenticatedFlightClient) -> serde_json::Value {
    let mut results = client
        .do_action(arrow_flight::Action::new("stats", ""))
        .await
        .unwrap()
        .into_inner();
    let result = results.message().await.unwrap().unwrap();
    serde_json::from_slice(&result.body).unwrap()
}

/// Ask the byte-range endpoint for the last 4 bytes of `path`.
async fn range_read(
    address: std::net::SocketAddr,
    path: &str,
    size: u64,
    secret: &Secret,
) -> String {
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {address}\r\nAuthorization: {}\r\nRange: bytes={}-{}\r\nConnection: close\r\n\r\n",
        secret.bearer(),
        size - 4,
        size - 1
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_busy_with_pushdown_still_answers_plain_reads_and_catalog_requests() {
    let root = one_big_slice_data();
    let cluster = EmbeddedCluster::start_with(
        &root,
        1,
        ExecuteOptions {
            pushdown_workers: 1,
            pushdown_wait: Duration::from_millis(20),
            batch_rows: 1024,
            ..ExecuteOptions::default()
        },
    )
    .await
    .unwrap();
    let node = &cluster.nodes[0];
    let catalog = node.executor().catalog();
    let (lineitem_stored, region_stored) = (
        common::stored(&one_big_slice_data(), "lineitem"),
        common::stored(&one_big_slice_data(), "region"),
    );
    let lineitem = catalog
        .slice(&lineitem_stored.name, lineitem_stored.slice(0))
        .unwrap()
        .1;
    let region_schema = Arc::clone(&catalog.table(&region_stored.name).unwrap().schema);
    let lineitem_schema = Arc::clone(&catalog.table(&lineitem_stored.name).unwrap().schema);

    // Occupy the only pushdown worker: a whole lineitem slice, uncompressed,
    // asked for and never read, so the worker blocks on a full connection.
    let mut holder = connect(node.flight_url(), cluster.secret()).await;
    let held = holder
        .do_get(Ticket::new(whole_slice_ticket(
            &lineitem_schema,
            "lineitem",
        )))
        .await
        .unwrap();
    let mut client = connect(node.flight_url(), cluster.secret()).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while stats(&mut client).await["pushdown_running"] != 1 {
        assert!(Instant::now() < deadline, "the held request never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        stats(&mut client).await["pushdown_running"],
        1,
        "the worker is still held"
    );

    // Catalog, byte ranges and a fragment request are all answered, the
    // last one raw. Bounds are generous: this checks nothing waits for the
    // held worker, not how fast the answers are.
    let bound = Duration::from_secs(5);
    let started = Instant::now();
    let listed = tokio::time::timeout(bound, async {
        let mut infos = client
            .list_flights(Criteria::default())
            .await
            .unwrap()
            .into_inner();
        let mut count = 0;
        while let Some(info) = infos.next().await {
            info.unwrap();
            count += 1;
        }
        count
    })
    .await
    .expect("catalog answered while the pool is busy");
    assert_eq!(listed, 8);
    let catalog_latency = started.elapsed();

    let started = Instant::now();
    let answer = tokio::time::timeout(
        bound,
        range_read(
            node.range_address(),
            &format!("/slices/{}/{}", lineitem_stored.name, lineitem.summary.file),
            lineitem.summary.bytes,
            cluster.secret(),
        ),
    )
    .await
    .expect("byte range answered while the pool is busy");
    assert!(answer.starts_with("HTTP/1.1 206"), "{answer}");
    assert!(answer.ends_with("PAR1"), "{answer}");
    let range_latency = started.elapsed();

    let started = Instant::now();
    let metrics = tokio::time::timeout(
        bound,
        trailer_of(&mut client, whole_slice_ticket(&region_schema, "region")),
    )
    .await
    .expect("fragment request answered while the pool is busy");
    assert!(!metrics.processed, "served raw while the worker is held");
    assert!(
        metrics
            .raw_reason
            .contains("no pushdown worker free within 20 ms"),
        "{}",
        metrics.raw_reason
    );
    let raw_latency = started.elapsed();
    eprintln!(
        "while the pool was held: catalog {catalog_latency:?}, byte range {range_latency:?}, raw slice {raw_latency:?}"
    );

    // Released, the worker processes again.
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = trailer_of(&mut client, whole_slice_ticket(&region_schema, "region")).await;
        if metrics.processed {
            break;
        }
        assert!(Instant::now() < deadline, "the worker was never released");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallelism_on_three_levels_is_in_the_scan_metrics() {
    let root = test_data();
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let session = cluster.session().await.unwrap();
    session
        .context
        .sql("set datafusion.execution.target_partitions = 2")
        .await
        .unwrap();
    let (_, metrics) = run_with_scan_metrics(
        &session,
        "select l_returnflag, sum(l_quantity) from lineitem where l_quantity < 40 group by l_returnflag",
        &[
            "partitions",
            "requests_in_flight_max",
            "nodes_in_flight_max",
            "storage_slices_running_max",
        ],
    )
    .await
    .unwrap();
    let [partitions, requests, nodes, running] = metrics[..] else {
        unreachable!()
    };
    assert_eq!(partitions, 2, "{metrics:?}");
    assert!(requests > 1, "several slice requests at once: {metrics:?}");
    assert!(nodes > 1, "several storage nodes at once: {metrics:?}");
    assert!(
        running >= 1,
        "a storage node's own parallelism: {metrics:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_that_pause_do_not_starve_another_slice_stream_on_the_same_connection() {
    // Three whole-lineitem streams (megabytes each) that are started and
    // then not read, as a hash join's probe side waits for its build side;
    // a fourth stream over the same connection must still flow.
    let root = one_big_slice_data();
    // Workers enough for every stream: a paused stream holds its worker.
    let cluster = EmbeddedCluster::start_with(
        &root,
        1,
        ExecuteOptions {
            pushdown_workers: 8,
            ..ExecuteOptions::default()
        },
    )
    .await
    .unwrap();
    let url = cluster.urls()[0].clone();
    let client = sieve_compute::StorageClient::connect(&url, Some(cluster.secret()))
        .await
        .unwrap();
    let schema = Arc::clone(
        &cluster.nodes[0]
            .executor()
            .catalog()
            .table(&common::stored(&one_big_slice_data(), "lineitem").name)
            .unwrap()
            .schema,
    );
    let traffic = Arc::new(sieve_compute::Traffic::default());
    let timeout = Duration::from_secs(5);
    let mut paused = Vec::new();
    for _ in 0..3 {
        let mut stream = client.stream_slice(
            whole_slice_ticket(&schema, "lineitem"),
            Arc::clone(&traffic),
            timeout,
        );
        let first = stream.next().await;
        assert!(
            matches!(first, Some(Ok(sieve_compute::SlicePart::Batch(_)))),
            "the slice was not processed"
        );
        paused.push(stream);
    }
    // Let the paused streams fill their windows.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    let mut stream = client.stream_slice(
        whole_slice_ticket(&schema, "lineitem"),
        Arc::clone(&traffic),
        timeout,
    );
    let mut rows = 0;
    let mut done = false;
    while let Some(part) = stream.next().await {
        match part.unwrap_or_else(|error| {
            panic!(
                "the fourth stream failed after {:?}: {error}",
                started.elapsed()
            )
        }) {
            sieve_compute::SlicePart::Batch(batch) => rows += batch.num_rows(),
            sieve_compute::SlicePart::Done { .. } => done = true,
            _ => {}
        }
    }
    assert!(done, "the fourth stream ended without its trailer");
    assert_eq!(rows, 60_175);
    drop(paused);
}
