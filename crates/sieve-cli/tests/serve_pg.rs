//! `sieve serve` driven by the real `psql` binary: a password over TLS,
//! `\dt` and `\d`, TPC-H answers equal to plain DataFusion's, settings that
//! belong to one connection, errors with their SQLSTATE; a wrong password,
//! a plaintext connection where TLS is required and an unusable certificate
//! refused; a client that hangs up mid-query stops its work on the storage
//! nodes.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use sieve_cli::cluster::EmbeddedCluster;
use sieve_cli::compare::{reference_context, run};
use sieve_cli::queries::TPCH_QUERIES;

mod common;

use common::NODES;

const PASSWORD: &str = "correct horse battery staple";

/// A self-signed certificate and its key, made by `openssl` in `directory`.
fn certificate(directory: &Path) -> (PathBuf, PathBuf) {
    std::fs::create_dir_all(directory).unwrap();
    let (cert, key) = (directory.join("cert.pem"), directory.join("key.pem"));
    let status = Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        ])
        .args(["-subj", "/CN=localhost", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("openssl is needed to make a test certificate (apt-get install openssl)");
    assert!(status.success(), "openssl failed to make a certificate");
    (cert, key)
}

/// A running `sieve serve` and the address it listens on.
struct Server {
    child: Child,
    address: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve_command(cluster: &EmbeddedCluster, extra: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_sieve"));
    command
        .arg("serve")
        .arg("--cluster")
        .arg(cluster.urls().join(","))
        .args(["--listen", "127.0.0.1:0"])
        .args(extra)
        .env("SIEVE_SECRET", cluster.secret().expose())
        .env("SIEVE_PASSWORD", PASSWORD);
    command
}

/// Start `sieve serve` over `cluster` and wait for its "listening on" line.
fn start_server(cluster: &EmbeddedCluster, extra: &[&str]) -> Server {
    let mut child = serve_command(cluster, extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let address = loop {
        let line = lines
            .next()
            .expect("sieve serve ended before it listened")
            .unwrap();
        if let Some(rest) = line.split("listening on ").nth(1) {
            break rest.split_whitespace().next().unwrap().to_string();
        }
    };
    // Keep draining its output so that it never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    Server { child, address }
}

/// `psql` against `server` with `sslmode` and `password`, running `args`.
fn psql(server: &Server, sslmode: &str, password: &str, args: &[&str]) -> Output {
    let (host, port) = server.address.rsplit_once(':').unwrap();
    Command::new("psql")
        .arg(format!(
            "host={host} port={port} user=sieve dbname=sieve sslmode={sslmode} connect_timeout=10"
        ))
        .args(["-X", "-v", "ON_ERROR_STOP=1", "-v", "VERBOSITY=verbose"])
        .args(args)
        .env("PGPASSWORD", password)
        .output()
        .expect("psql is needed (apt-get install postgresql-client)")
}

fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Rows of a CSV result (header dropped), each a list of cells.
fn csv_rows(stdout: &str) -> Vec<Vec<String>> {
    stdout
        .lines()
        .skip(1)
        .map(|line| line.split(',').map(|cell| cell.to_string()).collect())
        .collect()
}

/// The reference rows, as plain DataFusion formats them.
async fn reference_rows(root: &Path, sql: &str) -> Vec<Vec<String>> {
    let context = reference_context(root, NODES).await.unwrap();
    let batches = run(&context, sql).await.unwrap();
    sieve_cli::compare::rows_as_text(&batches, false)
        .unwrap()
        .into_iter()
        .map(|row| row.split(" | ").map(str::to_string).collect())
        .collect()
}

/// Whether two cells agree: equal text, or equal numbers (to 1e-9 relative).
fn same_cell(left: &str, right: &str) -> bool {
    if left == right {
        return true;
    }
    match (left.parse::<f64>(), right.parse::<f64>()) {
        (Ok(a), Ok(b)) => (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0),
        _ => false,
    }
}

fn assert_same_rows(name: &str, actual: &[Vec<String>], expected: &[Vec<String>]) {
    assert_eq!(actual.len(), expected.len(), "{name}: row count");
    for (row, (left, right)) in actual.iter().zip(expected).enumerate() {
        assert_eq!(
            left.len(),
            right.len(),
            "{name} row {row}: {left:?} vs {right:?}"
        );
        for (a, b) in left.iter().zip(right) {
            assert!(same_cell(a, b), "{name} row {row}: {left:?} vs {right:?}");
        }
    }
}

fn query(name: &str) -> &'static str {
    TPCH_QUERIES
        .iter()
        .find(|(found, _)| *found == name)
        .map(|(_, sql)| *sql)
        .unwrap()
}

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
