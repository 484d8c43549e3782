//! `sieve serve`'s Arrow Flight SQL port driven by arrow-flight's own
//! client: a call without a session is refused, a ticket is good once, a
//! plaintext client cannot talk to a TLS port, and a client that goes away
//! mid-query stops its work on the storage nodes.

use std::time::{Duration, Instant};

use arrow_flight::sql::client::FlightSqlServiceClient;
use futures::StreamExt;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

use sieve_cli::cluster::EmbeddedCluster;

use crate::common;
use crate::serving;

use common::NODES;
use serving::*;

async fn channel(address: &str) -> Channel {
    Endpoint::from_shared(format!("http://{address}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// A client logged in to `server`'s Flight SQL port (plaintext).
async fn logged_in(server: &Server) -> FlightSqlServiceClient<Channel> {
    let mut client = FlightSqlServiceClient::new(channel(&server.flight_address).await);
    client.handshake("sieve", PASSWORD).await.unwrap();
    client
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_tickets_and_a_client_gone_mid_query() {
    let root = common::small_slices(1);
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let server = start_server(&cluster, &[]);

    // No session, a forged token, a wrong password: refused.
    let mut anonymous = FlightSqlServiceClient::new(channel(&server.flight_address).await);
    let error = anonymous
        .execute("select 1".into(), None)
        .await
        .unwrap_err();
    assert!(error.to_string().contains("handshake"), "{error}");
    anonymous.set_token("not-a-session".into());
    let error = anonymous
        .execute("select 1".into(), None)
        .await
        .unwrap_err();
    assert!(error.to_string().contains("unknown"), "{error}");
    anonymous.clear_token();
    let error = anonymous.handshake("sieve", "wrong").await.unwrap_err();
    assert!(
        error.to_string().contains("authentication failed"),
        "{error}"
    );

    // A ticket is good for one DoGet.
    let mut client = logged_in(&server).await;
    let info = client
        .execute("select count(*) from lineitem".into(), None)
        .await
        .unwrap();
    let ticket = info.endpoint[0].ticket.clone().unwrap();
    let batches: Vec<_> = client
        .do_get(ticket.clone())
        .await
        .unwrap()
        .collect::<Vec<_>>()
        .await;
    let rows: usize = batches
        .iter()
        .map(|batch| batch.as_ref().unwrap().num_rows())
        .sum();
    assert_eq!(rows, 1);
    let again = match client.do_get(ticket).await {
        Ok(stream) => stream
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .find_map(Result::err),
        Err(error) => Some(error),
    };
    assert!(again.is_some(), "a ticket was served twice");

    // A client gone mid-query: its work on the storage nodes stops.
    for node in &cluster.nodes {
        node.faults().pace_reads(Duration::from_millis(2000));
    }
    let mut client = logged_in(&server).await;
    let info = client.execute(query("q1").into(), None).await.unwrap();
    let ticket = info.endpoint[0].ticket.clone().unwrap();
    let fetch = tokio::spawn(async move {
        let stream = client.do_get(ticket).await;
        if let Ok(stream) = stream {
            let _ = stream.collect::<Vec<_>>().await;
        }
    });
    let running = || -> usize { cluster.nodes.iter().map(|node| node.pool().running()).sum() };
    let started = Instant::now();
    while running() == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the query never reached the storage nodes"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Dropping the task drops the client and its connection.
    fetch.abort();
    let _ = fetch.await;
    let gone = Instant::now();
    while running() > 0 {
        assert!(
            gone.elapsed() < Duration::from_secs(5),
            "the storage nodes still work for a client gone {:?} ago",
            gone.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for node in &cluster.nodes {
        node.faults().pace_reads(Duration::ZERO);
    }
    // The server goes on serving.
    let mut client = logged_in(&server).await;
    let info = client.execute("select 41 + 1".into(), None).await.unwrap();
    let batches: Vec<_> = client
        .do_get(info.endpoint[0].ticket.clone().unwrap())
        .await
        .unwrap()
        .collect::<Vec<_>>()
        .await;
    assert_eq!(batches.len(), 1);
    assert!(batches[0].is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_port_refuses_plaintext_and_serves_tls() {
    let root = common::small_slices(1);
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let directory = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("serve-flight-tls-{}", std::process::id()));
    let (cert, key) = certificate(&directory);
    let server = start_server(
        &cluster,
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
    );
    // Plaintext: the connection or the handshake fails; nothing is served.
    let plaintext = Endpoint::from_shared(format!("http://{}", server.flight_address))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(5));
    if let Ok(channel) = plaintext.connect().await {
        let mut client = FlightSqlServiceClient::new(channel);
        assert!(
            client.handshake("sieve", PASSWORD).await.is_err(),
            "a plaintext client logged in to a TLS port"
        );
    }
    // TLS with the test CA as the root: served.
    let pem = std::fs::read_to_string(ca_certificate(&directory)).unwrap();
    let port = server.flight_address.rsplit_once(':').unwrap().1;
    let channel = Endpoint::from_shared(format!("https://localhost:{port}"))
        .unwrap()
        .tls_config(
            ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(pem))
                .domain_name("localhost"),
        )
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = FlightSqlServiceClient::new(channel);
    client.handshake("sieve", PASSWORD).await.unwrap();
    let info = client.execute("select 41 + 1".into(), None).await.unwrap();
    let batches: Vec<_> = client
        .do_get(info.endpoint[0].ticket.clone().unwrap())
        .await
        .unwrap()
        .collect::<Vec<_>>()
        .await;
    assert_eq!(batches.len(), 1);
    drop(server);
    let _ = std::fs::remove_dir_all(&directory);
}

/// `sieve sql` with `args`, its password from the environment.
fn sieve_sql(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_sieve"))
        .arg("sql")
        .args(args)
        .env("SIEVE_PASSWORD", PASSWORD)
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sieve_sql_connects_to_a_server_and_prints_csv_json_and_tables() {
    let root = common::small_slices(1);
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let server = start_server(&cluster, &[]);
    let url = format!("grpc://{}", server.flight_address);
    let directory = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("sieve-sql-{}", std::process::id()));
    std::fs::create_dir_all(&directory).unwrap();

    // CSV to standard output: Q1's rows, equal to plain DataFusion's.
    let output = sieve_sql(&["--connect", &url, "--format", "csv", "-c", query("q1")]);
    let (stdout, stderr) = text(&output);
    assert!(output.status.success(), "{stderr}");
    assert!(stderr.contains("4 rows in"), "the elapsed line: {stderr}");
    assert_same_rows(
        "q1 csv",
        &csv_rows(&stdout),
        &reference_rows(&root, query("q1")).await,
    );

    // JSON to a file: an array of objects, one per row.
    let file = directory.join("q6.json");
    let output = sieve_sql(&[
        "--connect",
        &url,
        "--format",
        "json",
        "-o",
        file.to_str().unwrap(),
        "-c",
        query("q6"),
    ]);
    assert!(output.status.success(), "{}", text(&output).1);
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let expected = reference_rows(&root, query("q6")).await;
    let revenue = rows[0]["revenue"].to_string();
    assert!(
        same_cell(revenue.trim_matches('"'), &expected[0][0]),
        "{rows} vs {expected:?}"
    );

    // Statements share the session; the table format; an error stops the
    // run with its SQLSTATE and a non-zero exit.
    let output = sieve_sql(&[
        "--connect",
        &url,
        "-c",
        "SET sieve.ndp = off; SHOW sieve.ndp; select 'a;b' as x; select nope; select 2",
    ]);
    let (stdout, stderr) = text(&output);
    assert!(!output.status.success());
    assert!(stdout.contains("| sieve.ndp | off   |"), "{stdout}");
    assert!(stdout.contains("| a;b |"), "{stdout}");
    assert!(stderr.contains("42703"), "{stderr}");

    // A wrong password is refused.
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_sieve"))
        .args(["sql", "--connect", &url, "-c", "select 1"])
        .env("SIEVE_PASSWORD", "wrong")
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(text(&output).1.contains("authentication failed"));
    let _ = std::fs::remove_dir_all(&directory);
}
