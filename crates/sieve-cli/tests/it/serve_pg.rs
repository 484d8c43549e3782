//! `sieve serve` driven by the real `psql` binary: a password over TLS,
//! `\dt` and `\d`, TPC-H answers equal to plain DataFusion's, settings that
//! belong to one connection, errors with their SQLSTATE; a wrong password,
//! a plaintext connection where TLS is required and an unusable certificate
//! refused; a client that hangs up mid-query stops its work on the storage
//! nodes.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sieve_cli::cluster::EmbeddedCluster;

use crate::common;
use crate::serving;

use common::NODES;
use serving::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psql_over_tls_with_a_password_sees_the_tables_and_gets_right_answers() {
    let root = common::small_slices(1);
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let directory = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("serve-pg-tls-{}", std::process::id()));
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

    // The tables, and one table's columns, as psql's own catalog queries see them.
    let listing = psql(&server, "require", PASSWORD, &["-c", "\\dt"]);
    let (stdout, stderr) = text(&listing);
    assert!(listing.status.success(), "\\dt failed: {stderr}");
    for table in ["lineitem", "orders", "customer", "nation"] {
        assert!(stdout.contains(table), "\\dt lacks {table}:\n{stdout}");
    }
    let described = psql(&server, "require", PASSWORD, &["-c", "\\d lineitem"]);
    let (stdout, stderr) = text(&described);
    assert!(described.status.success(), "\\d lineitem failed: {stderr}");
    for column in ["l_orderkey", "l_shipdate", "l_extendedprice", "l_comment"] {
        assert!(
            stdout.contains(column),
            "\\d lineitem lacks {column}:\n{stdout}"
        );
    }

    // Q1 and Q6, equal to plain DataFusion over the same files.
    for name in ["q1", "q6"] {
        let sql = query(name);
        let output = psql(&server, "require", PASSWORD, &["--csv", "-c", sql]);
        let (stdout, stderr) = text(&output);
        assert!(output.status.success(), "{name} failed: {stderr}");
        assert_same_rows(name, &csv_rows(&stdout), &reference_rows(&root, sql).await);
    }

    // A setting belongs to its connection.
    let output = psql(
        &server,
        "require",
        PASSWORD,
        &[
            "-A",
            "-t",
            "-c",
            "SET sieve.ndp = off",
            "-c",
            "SHOW sieve.ndp",
        ],
    );
    let (stdout, stderr) = text(&output);
    assert!(output.status.success(), "SET failed: {stderr}");
    assert!(stdout.contains("sieve.ndp|off"), "{stdout}");
    let output = psql(
        &server,
        "require",
        PASSWORD,
        &["-A", "-t", "-c", "SHOW sieve.ndp"],
    );
    let (stdout, _) = text(&output);
    assert!(
        stdout.contains("sieve.ndp|on"),
        "another connection: {stdout}"
    );

    // Errors come back with their SQLSTATE, and the connection goes on.
    let output = psql(
        &server,
        "require",
        PASSWORD,
        &[
            "-v",
            "ON_ERROR_STOP=0",
            "-c",
            "select * from nowhere",
            "-c",
            "SET sieve.no_such_setting = 1",
            "-c",
            "select 41 + 1 as answer",
        ],
    );
    let (stdout, stderr) = text(&output);
    assert!(stderr.contains("42P01"), "{stderr}");
    assert!(stderr.contains("22023"), "{stderr}");
    assert!(stdout.contains("42"), "the connection went on: {stdout}");

    // A wrong password and a plaintext connection are refused.
    let output = psql(&server, "require", "wrong password", &["-c", "select 1"]);
    let (_, stderr) = text(&output);
    assert!(!output.status.success(), "a wrong password was let in");
    assert!(stderr.contains("authentication failed"), "{stderr}");
    let output = psql(&server, "disable", PASSWORD, &["-c", "select 1"]);
    let (_, stderr) = text(&output);
    assert!(
        !output.status.success(),
        "a plaintext connection was let in"
    );
    assert!(stderr.contains("only TLS"), "{stderr}");
    let _ = std::fs::remove_dir_all(&directory);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_that_cannot_be_used_stops_the_server() {
    let root = common::small_slices(1);
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let directory = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("serve-pg-badtls-{}", std::process::id()));
    let (cert, key) = certificate(&directory);
    let garbage = directory.join("garbage.pem");
    std::fs::write(&garbage, "not a certificate\n").unwrap();
    for (cert, key) in [
        (directory.join("missing.pem"), key.clone()),
        (garbage.clone(), key.clone()),
        (cert.clone(), garbage.clone()),
        // A certificate with a key that is not its own.
        (cert.clone(), {
            let other = certificate(&directory.join("other"));
            other.1
        }),
    ] {
        let output = serve_command(
            &cluster,
            &[
                "--tls-cert",
                cert.to_str().unwrap(),
                "--tls-key",
                key.to_str().unwrap(),
            ],
        )
        .output()
        .unwrap();
        let (stdout, stderr) = text(&output);
        assert!(!output.status.success(), "started: {stdout}");
        assert!(!stdout.contains("listening"), "{stdout}");
        assert!(stderr.contains("TLS"), "{stderr}");
    }
    let _ = std::fs::remove_dir_all(&directory);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_mid_query_stops_its_work_on_the_storage_nodes() {
    let root = common::small_slices(1);
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let server = start_server(&cluster, &[]);
    // Slow reads: Q1 would run for half a minute, its aggregation on the
    // nodes (a slice is 5 reads of 2 s each).
    for node in &cluster.nodes {
        node.faults().pace_reads(Duration::from_millis(2000));
    }
    let (host, port) = server.address.rsplit_once(':').unwrap();
    let mut client = Command::new("psql")
        .arg(format!(
            "host={host} port={port} user=sieve dbname=sieve sslmode=disable"
        ))
        .args(["-X", "-c", query("q1")])
        .env("PGPASSWORD", PASSWORD)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let running = || -> usize { cluster.nodes.iter().map(|node| node.pool().running()).sum() };
    let started = Instant::now();
    while running() == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the query never reached the storage nodes"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    client.kill().unwrap();
    let _ = client.wait();
    let hung_up = Instant::now();
    while running() > 0 {
        assert!(
            hung_up.elapsed() < Duration::from_secs(5),
            "the storage nodes still work for a client gone {:?} ago ({} slices)",
            hung_up.elapsed(),
            running()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "work on the storage nodes stopped {:?} after the client hung up",
        hung_up.elapsed()
    );
    // The server goes on serving.
    for node in &cluster.nodes {
        node.faults().pace_reads(Duration::ZERO);
    }
    let output = psql(
        &server,
        "disable",
        PASSWORD,
        &["-A", "-t", "-c", "select 1 + 1"],
    );
    let (stdout, stderr) = text(&output);
    assert!(output.status.success(), "{stderr}");
    assert_eq!(stdout.trim(), "2");
}
