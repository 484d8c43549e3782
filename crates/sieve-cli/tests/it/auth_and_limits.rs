//! Issue 16: a storage node lets no one in without its secret, serves no
//! file outside its data directory, and half-open connections neither
//! stop it serving nor stay open past their deadline.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::{Action, Criteria, Ticket};
use sieve_cli::cluster::EmbeddedCluster;
use sieve_cli::compare::{reference_context_for, rows_as_text, run};
use sieve_compute::{connect_session, BearerAuth};
use sieve_fragment::{Fragment, FragmentEnvelope, Secret};
use sieve_storage::{ConnectionLimits, ExecuteOptions, StorageNode, StorageNodeConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tonic::Code;

use crate::common;

use common::NODES;

fn wrong_secret() -> Secret {
    Secret::new("not-the-secret-of-this-cluster").unwrap()
}

/// A Flight DoGet ticket for slice `slice` of `table`, all columns.
fn ticket(cluster: &EmbeddedCluster, table: &str) -> (Vec<u8>, u32) {
    for node in &cluster.nodes {
        let catalog = node.executor().catalog();
        let tables = catalog.tables();
        let held = tables
            .iter()
            .find(|(name, _)| common::sql_name(name) == table);
        if let Some((table, found)) = held {
            let slice = *found.slices.keys().next().unwrap();
            let body = Fragment {
                projection: (0..found.schema.fields().len()).collect(),
                predicate: None,
                aggregate: None,
            }
            .encode_body(&found.schema)
            .unwrap();
            return (
                prost::Message::encode_to_vec(&FragmentEnvelope::new(table, slice, body)),
                slice,
            );
        }
    }
    panic!("no node holds {table}");
}

/// Every kind of Flight call, refused with `Unauthenticated`.
async fn assert_flight_refused(url: &str, auth: BearerAuth, ticket: &[u8]) {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = FlightServiceClient::with_interceptor(channel, auth);
    let listed = client.list_flights(Criteria::default()).await;
    let status = listed.expect_err("ListFlights refused");
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    assert!(status.message().contains("credential"), "{status:?}");
    let got = client.do_get(Ticket::new(ticket.to_vec())).await;
    assert_eq!(
        got.expect_err("DoGet refused").code(),
        Code::Unauthenticated
    );
    let acted = client.do_action(Action::new("stats", "")).await;
    assert_eq!(
        acted.expect_err("DoAction refused").code(),
        Code::Unauthenticated
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flight_calls_without_the_secret_are_refused_with_unauthenticated() {
    let cluster = EmbeddedCluster::start(&common::small_slices(1), NODES)
        .await
        .unwrap();
    let (ticket, _) = ticket(&cluster, "region");
    for url in cluster.urls() {
        assert_flight_refused(&url, BearerAuth::new(None).unwrap(), &ticket).await;
        assert_flight_refused(
            &url,
            BearerAuth::new(Some(&wrong_secret())).unwrap(),
            &ticket,
        )
        .await;
    }
    // A session without the secret fails at once with a plan error that says why.
    let refused = connect_session(&cluster.urls(), None).await.unwrap_err();
    assert!(
        matches!(refused, datafusion::common::DataFusionError::Plan(_))
            && refused.to_string().contains("requires a credential"),
        "{refused}"
    );
    let refused = connect_session(&cluster.urls(), Some(&wrong_secret()))
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("refuses the credential"),
        "{refused}"
    );
    // With it, everything works.
    let session = cluster.session().await.unwrap();
    let batches = run(&session.context, "select count(*) from region")
        .await
        .unwrap();
    assert_eq!(
        rows_as_text(&batches, false).unwrap(),
        vec!["5".to_string()]
    );
}

/// The status line of a GET of `path` with `authorization` (if any).
async fn range_status(address: SocketAddr, path: &str, authorization: Option<String>) -> String {
    let mut stream = TcpStream::connect(address).await.unwrap();
    let header = authorization
        .map(|value| format!("Authorization: {value}\r\n"))
        .unwrap_or_default();
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {address}\r\n{header}Range: bytes=0-3\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.unwrap();
    let answer = String::from_utf8_lossy(&answer).into_owned();
    answer.lines().next().unwrap_or_default().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn byte_ranges_without_the_secret_get_401() {
    let cluster = EmbeddedCluster::start(&common::small_slices(1), NODES)
        .await
        .unwrap();
    let node = &cluster.nodes[0];
    let catalog = node.executor().catalog();
    let tables = catalog.tables();
    let (table, found) = tables.iter().next().unwrap();
    let slice = found.slices.values().next().unwrap();
    let path = format!("/slices/{table}/{}", slice.summary.file);
    let address = node.range_address();
    assert!(range_status(address, &path, None).await.contains(" 401 "));
    assert!(range_status(address, &path, Some(wrong_secret().bearer()))
        .await
        .contains(" 401 "));
    assert!(
        range_status(address, &path, Some("Basic c2lldmU6c2lldmU=".into()))
            .await
            .contains(" 401 ")
    );
    // A path that names nothing is refused before it is looked up.
    assert!(range_status(address, "/nothing", None)
        .await
        .contains(" 401 "));
    assert!(
        range_status(address, &path, Some(cluster.secret().bearer()))
            .await
            .contains(" 206 ")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_half_open_connections_do_not_stop_a_node_serving() {
    let root = common::small_slices(1);
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let sql = "select l_returnflag, count(*), sum(l_quantity) from lineitem \
               where l_shipdate < date '1995-01-01' group by l_returnflag order by l_returnflag";
    let reference = reference_context_for(&root, NODES, &["lineitem"])
        .await
        .unwrap();
    let expected = rows_as_text(&run(&reference, sql).await.unwrap(), false).unwrap();
    // 500 connections to each endpoint of every node: a third send nothing,
    // a third half a request line / half the HTTP/2 preface, a third whole
    // request line without the blank line that ends the head.
    let mut held = Vec::new();
    for node in &cluster.nodes {
        for index in 0..500 {
            let mut flight = TcpStream::connect(node.flight_address()).await.unwrap();
            let mut range = TcpStream::connect(node.range_address()).await.unwrap();
            match index % 3 {
                0 => {}
                1 => {
                    flight.write_all(b"PRI * HTTP/2").await.unwrap();
                    range.write_all(b"GET /slices/line").await.unwrap();
                }
                _ => {
                    flight
                        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                        .await
                        .unwrap();
                    range
                        .write_all(b"GET /slices/lineitem/x HTTP/1.1\r\nHost: a\r\n")
                        .await
                        .unwrap();
                }
            }
            held.push((flight, range));
        }
    }
    let started = Instant::now();
    let session = cluster.session().await.unwrap();
    for on in [true, false] {
        session.set_ndp(on).unwrap();
        let batches = run(&session.context, sql).await.unwrap();
        assert_eq!(
            rows_as_text(&batches, false).unwrap(),
            expected,
            "NDP {on} with 500 half-open connections per endpoint"
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "the queries waited for the half-open connections: {:?}",
        started.elapsed()
    );
    drop(held);
}

/// Whether the server closes `stream` within `bound` (EOF or reset).
async fn closed_within(stream: &mut TcpStream, bound: Duration) -> bool {
    let mut buffer = [0u8; 1024];
    let deadline = Instant::now() + bound;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, stream.read(&mut buffer)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            // An HTTP/2 server's SETTINGS, or an HTTP 408: read on to the close.
            Ok(Ok(_)) => continue,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_connections_are_closed_and_connections_over_the_bound_refused() {
    let limits = ConnectionLimits {
        connections_max: 8,
        // Long enough that a connection accepted within the bound cannot be
        // mistaken for one refused over it on a loaded machine (a refused
        // one is closed at once, an accepted one only after this).
        handshake_timeout: Duration::from_millis(2_500),
        header_read_timeout: Duration::from_millis(2_500),
        ..ConnectionLimits::default()
    };
    let cluster = EmbeddedCluster::start_with_limits(
        &common::small_slices(1),
        NODES,
        ExecuteOptions::default(),
        limits,
    )
    .await
    .unwrap();
    let node = &cluster.nodes[0];
    for address in [node.flight_address(), node.range_address()] {
        // Silent, half a request, half the preface: all closed after the deadline.
        let mut silent = TcpStream::connect(address).await.unwrap();
        let mut half = TcpStream::connect(address).await.unwrap();
        half.write_all(b"GET /slices/x HTTP/1.1\r\nHo")
            .await
            .unwrap();
        let mut preface = TcpStream::connect(address).await.unwrap();
        preface.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
        for (what, stream) in [
            ("silent", &mut silent),
            ("half request", &mut half),
            ("half preface", &mut preface),
        ] {
            assert!(
                closed_within(stream, Duration::from_secs(10)).await,
                "{what} connection to {address} still open"
            );
        }
        // Nine connections for a bound of eight: one of them is closed at
        // once (which one depends on the order the node accepts them in, on
        // a loaded machine not always the last); the others are kept until
        // the handshake timeout, after the 1.5 s looked at here.
        let mut streams = Vec::new();
        for _ in 0..9 {
            streams.push(TcpStream::connect(address).await.unwrap());
        }
        let closed = futures::future::join_all(
            streams
                .iter_mut()
                .map(|stream| closed_within(stream, Duration::from_millis(1_500))),
        )
        .await;
        assert!(
            closed.iter().any(|&closed| closed),
            "nine connections to {address}, bound 8: none was refused"
        );
        drop(streams);
    }
    // Once those are gone, the node serves again.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let session = cluster.session().await.unwrap();
    session.set_ndp(false).unwrap();
    let batches = run(&session.context, "select count(*) from nation")
        .await
        .unwrap();
    assert_eq!(
        rows_as_text(&batches, false).unwrap(),
        vec!["25".to_string()]
    );
}

/// A fresh data directory holding one slice of a table of the node
/// directory `from`, and next to it (outside) another copy linked in as a
/// second slice: the directory, the table and the link's file name.
fn data_with_outside_link(from: &Path) -> (PathBuf, String, String) {
    let mut tables: Vec<_> = std::fs::read_dir(from)
        .unwrap()
        .map(|entry| entry.unwrap())
        .filter(|entry| entry.file_type().unwrap().is_dir())
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .collect();
    tables.sort();
    let table = tables.first().expect("a table on node 0").as_str();
    let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("auth-symlink-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let data = base.join("data");
    std::fs::create_dir_all(data.join(table)).unwrap();
    let source = std::fs::read_dir(from.join(table))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .find(|path| path.extension().is_some_and(|ext| ext == "parquet"))
        .unwrap();
    std::fs::copy(
        &source,
        data.join(table).join(format!("{table}-00001.parquet")),
    )
    .unwrap();
    let outside = base.join("outside.parquet");
    std::fs::copy(&source, &outside).unwrap();
    let linked = format!("{table}-00002.parquet");
    std::os::unix::fs::symlink(&outside, data.join(table).join(&linked)).unwrap();
    (data, table.to_string(), linked)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_symlink_to_a_file_outside_the_data_directory_is_not_served() {
    let root = common::small_slices(1);
    let (data, table, linked) = data_with_outside_link(&sieve_format::node_directory(&root, 0));
    let secret = Secret::new("a-secret-for-the-symlink-test").unwrap();
    let loopback: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let node = StorageNode::start(StorageNodeConfig {
        data_directory: data.clone(),
        flight_address: loopback,
        range_address: loopback,
        execute: ExecuteOptions::default(),
        auth: Some(secret.clone()),
        limits: ConnectionLimits::default(),
    })
    .await
    .unwrap();
    let held = node.executor().catalog().table(&table).unwrap();
    assert_eq!(
        held.slices.keys().copied().collect::<Vec<_>>(),
        vec![1],
        "only the slice inside the data directory is in the catalog"
    );
    let status = range_status(
        node.range_address(),
        &format!("/slices/{table}/{linked}"),
        Some(secret.bearer()),
    )
    .await;
    assert!(status.contains(" 404 "), "{status}");
    let status = range_status(
        node.range_address(),
        &format!("/slices/{table}/{table}-00001.parquet"),
        Some(secret.bearer()),
    )
    .await;
    assert!(status.contains(" 206 "), "{status}");
    node.stop().await;
    let _ = std::fs::remove_dir_all(data.parent().unwrap());
}
