//! `sieve serve` for the test files that drive it as a client would
//! (`mod serving;`): a test certificate, the server process and its ports,
//! psql, and results compared with plain DataFusion's.
// Each test file uses its own part of these.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use sieve_cli::cluster::EmbeddedCluster;
use sieve_cli::compare::{reference_context, run};
use sieve_cli::queries::TPCH_QUERIES;

use crate::common::NODES;

pub(crate) const PASSWORD: &str = "correct horse battery staple";

/// A server certificate for localhost (and 127.0.0.1) and its key, made
/// by `openssl` in `directory`, signed by a test CA whose certificate is
/// `ca_certificate(directory)`.
pub(crate) fn certificate(directory: &Path) -> (PathBuf, PathBuf) {
    std::fs::create_dir_all(directory).unwrap();
    let path = |name: &str| directory.join(name).to_str().unwrap().to_string();
    let (ca, ca_key) = (path("ca.pem"), path("ca-key.pem"));
    let (cert, key, request) = (path("cert.pem"), path("key.pem"), path("cert.csr"));
    let extensions = path("extensions.cnf");
    std::fs::write(
        &extensions,
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n",
    )
    .unwrap();
    let rsa = ["-newkey", "rsa:2048", "-nodes"];
    let steps: [Vec<&str>; 3] = [
        [
            &["req", "-x509"][..],
            &rsa,
            &["-days", "2", "-subj", "/CN=Sieve test CA"],
        ]
        .concat()
        .into_iter()
        .chain(["-keyout", &ca_key, "-out", &ca])
        .collect(),
        [
            &["req"][..],
            &rsa,
            &["-subj", "/CN=localhost", "-keyout", &key, "-out", &request],
        ]
        .concat(),
        vec![
            "x509",
            "-req",
            "-in",
            &request,
            "-CA",
            &ca,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &extensions,
            "-out",
            &cert,
        ],
    ];
    for step in steps {
        let status = Command::new("openssl")
            .args(&step)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("openssl is needed to make a test certificate (apt-get install openssl)");
        assert!(status.success(), "openssl {step:?} failed");
    }
    (PathBuf::from(cert), PathBuf::from(key))
}

/// The CA certificate that signed `certificate(directory)`'s.
pub(crate) fn ca_certificate(directory: &Path) -> PathBuf {
    directory.join("ca.pem")
}

/// A running `sieve serve` and the address it listens on.
pub(crate) struct Server {
    child: Child,
    /// The PostgreSQL port.
    pub(crate) address: String,
    /// The Arrow Flight SQL port.
    pub(crate) flight_address: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn serve_command(cluster: &EmbeddedCluster, extra: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_sieve"));
    command
        .arg("serve")
        .arg("--cluster")
        .arg(cluster.urls().join(","))
        .arg("--catalog")
        .arg(cluster.catalog_path())
        .args(["--listen", "127.0.0.1:0", "--flight-listen", "127.0.0.1:0"])
        .args(extra)
        .env("SIEVE_SECRET", cluster.secret().expose())
        .env("SIEVE_PASSWORD", PASSWORD);
    command
}

/// Start `sieve serve` over `cluster` and wait for its "listening on" line.
pub(crate) fn start_server(cluster: &EmbeddedCluster, extra: &[&str]) -> Server {
    let mut child = serve_command(cluster, extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    // The PostgreSQL port's line comes first, then Flight SQL's.
    let mut addresses = Vec::new();
    while addresses.len() < 2 {
        let line = lines
            .next()
            .expect("sieve serve ended before it listened")
            .unwrap();
        if let Some(rest) = line.split("listening on ").nth(1) {
            addresses.push(rest.split_whitespace().next().unwrap().to_string());
        }
    }
    let flight_address = addresses.pop().unwrap();
    let address = addresses.pop().unwrap();
    // Keep draining its output so that it never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    Server {
        child,
        address,
        flight_address,
    }
}

/// `psql` against `server` with `sslmode` and `password`, running `args`.
pub(crate) fn psql(server: &Server, sslmode: &str, password: &str, args: &[&str]) -> Output {
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

pub(crate) fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Rows of a CSV result (header dropped), each a list of cells.
pub(crate) fn csv_rows(stdout: &str) -> Vec<Vec<String>> {
    stdout
        .lines()
        .skip(1)
        .map(|line| line.split(',').map(|cell| cell.to_string()).collect())
        .collect()
}

/// The reference rows, as plain DataFusion formats them.
pub(crate) async fn reference_rows(root: &Path, sql: &str) -> Vec<Vec<String>> {
    let context = reference_context(root, NODES).await.unwrap();
    let batches = run(&context, sql).await.unwrap();
    sieve_cli::compare::rows_as_text(&batches, false)
        .unwrap()
        .into_iter()
        .map(|row| row.split(" | ").map(str::to_string).collect())
        .collect()
}

/// Whether two cells agree: equal text, or equal numbers (to 1e-9 relative).
pub(crate) fn same_cell(left: &str, right: &str) -> bool {
    if left == right {
        return true;
    }
    match (left.parse::<f64>(), right.parse::<f64>()) {
        (Ok(a), Ok(b)) => (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0),
        _ => false,
    }
}

pub(crate) fn assert_same_rows(name: &str, actual: &[Vec<String>], expected: &[Vec<String>]) {
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

pub(crate) fn query(name: &str) -> &'static str {
    TPCH_QUERIES
        .iter()
        .find(|(found, _)| *found == name)
        .map(|(_, sql)| *sql)
        .unwrap()
}
