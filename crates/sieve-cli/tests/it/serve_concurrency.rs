//! Many clients at once through the PostgreSQL port: 32 `psql` processes,
//! each one connection running the 22 TPC-H queries; every answer must
//! equal plain DataFusion's and every connection must finish.
//!
//! The default is SF 0.01, so that the suite stays short; the acceptance
//! run of issue 17 sets `SIEVE_CLIENTS_SF=0.1` (and a release build):
//! `SIEVE_CLIENTS_SF=0.1 cargo nextest run --release -p sieve-cli --test
//! serve_concurrency --no-capture`. The queries per second it prints are
//! for the record only; speed is asserted nowhere.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use sieve_cli::cluster::{generated_tpch, EmbeddedCluster};
use sieve_cli::compare::{reference_context, rows_as_text, run};
use sieve_cli::queries::TPCH_QUERIES;
use sieve_format::SliceLayout;

use crate::common;
use crate::serving;

use common::NODES;
use serving::*;

/// Client connections at once (`SIEVE_CLIENTS_CONNECTIONS` for a
/// comparison run, e.g. 1).
const CONNECTIONS: usize = 32;

fn connections() -> usize {
    std::env::var("SIEVE_CLIENTS_CONNECTIONS")
        .map(|text| text.parse().expect("SIEVE_CLIENTS_CONNECTIONS is a number"))
        .unwrap_or(CONNECTIONS)
}

/// The unit separator: no TPC-H value contains it (commas do).
const SEPARATOR: &str = "\x1f";

fn data(scale_factor: f64) -> PathBuf {
    if scale_factor == 0.01 {
        return common::small_slices(1);
    }
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "tpch-sf{scale_factor}-v{}",
        sieve_format::FORMAT_VERSION
    ));
    generated_tpch(&root, scale_factor, NODES, 1, &SliceLayout::default()).unwrap()
}

/// The rows of one query's unaligned psql output (header dropped).
fn unaligned_rows(path: &Path) -> Vec<Vec<String>> {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|error| panic!("{}: {error}", path.display()));
    text.lines()
        .skip(1)
        .map(|line| line.split(SEPARATOR).map(str::to_string).collect())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_connections_each_running_the_22_queries_get_right_answers() {
    let connections = connections();
    let scale_factor: f64 = std::env::var("SIEVE_CLIENTS_SF")
        .map(|text| text.parse().expect("SIEVE_CLIENTS_SF is a number"))
        .unwrap_or(0.01);
    let root = data(scale_factor);
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let server = start_server(&cluster, &["--connections-max", "40"]);
    let directory = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("serve-concurrency-{}", std::process::id()));

    // One script per connection: each query's rows to a file of its own.
    let (host, port) = server.address.rsplit_once(':').unwrap();
    let started = Instant::now();
    let clients: Vec<_> = (0..connections)
        .map(|client| {
            let out = directory.join(format!("c{client}"));
            std::fs::create_dir_all(&out).unwrap();
            let mut script = String::new();
            // Each connection starts at a different query.
            for index in 0..TPCH_QUERIES.len() {
                let (name, sql) = TPCH_QUERIES[(index + client) % TPCH_QUERIES.len()];
                writeln!(script, "\\o {}", out.join(format!("{name}.txt")).display()).unwrap();
                writeln!(script, "{sql}").unwrap();
            }
            let script_path = out.join("script.sql");
            std::fs::write(&script_path, script).unwrap();
            Command::new("psql")
                .arg(format!(
                    "host={host} port={port} user=sieve dbname=sieve sslmode=disable"
                ))
                .args(["-X", "-q", "-A", "-v", "ON_ERROR_STOP=1"])
                .args(["-F", SEPARATOR, "-P", "footer=off", "-P", "null=NULL", "-f"])
                .arg(&script_path)
                .env("PGPASSWORD", PASSWORD)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("psql is needed (apt-get install postgresql-client)")
        })
        .collect();
    let mut failures = Vec::new();
    for (client, child) in clients.into_iter().enumerate() {
        let output = child.wait_with_output().unwrap();
        if !output.status.success() {
            failures.push(format!(
                "connection {client}: {}",
                String::from_utf8_lossy(&output.stderr)
            ));
        }
    }
    let elapsed = started.elapsed();
    assert!(failures.is_empty(), "{failures:#?}");
    let queries = connections * TPCH_QUERIES.len();
    eprintln!(
        "SF {scale_factor}: {connections} connections ran {queries} queries in {:.1} s: {:.2} queries/s",
        elapsed.as_secs_f64(),
        queries as f64 / elapsed.as_secs_f64()
    );

    let reference = reference_context(&root, NODES).await.unwrap();
    for (name, sql) in TPCH_QUERIES {
        let mut expected: Vec<Vec<String>> =
            rows_as_text(&run(&reference, sql).await.unwrap(), false)
                .unwrap()
                .into_iter()
                .map(|row| row.split(" | ").map(str::to_string).collect())
                .collect();
        expected.sort();
        for client in 0..connections {
            let mut actual = unaligned_rows(&directory.join(format!("c{client}/{name}.txt")));
            actual.sort();
            assert_same_rows(&format!("connection {client} {name}"), &actual, &expected);
        }
    }
    drop(server);
    let _ = std::fs::remove_dir_all(&directory);
}
