//! `sieve serve` driven from Python as its users drive it: the ADBC Flight
//! SQL driver and psycopg 3, each over TLS with a password, in a virtual
//! environment this test makes (`tests/it/python/requirements.txt`, pinned).
//! Each runs the 22 TPC-H queries at SF 0.01 and TPC-H Q6 as a prepared
//! statement with parameters; every answer must equal plain DataFusion's
//! over the same files. `tests/it/python/clients.py` also checks errors,
//! per-session settings, EXPLAIN ANALYZE and the metadata commands.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use sieve_cli::cluster::EmbeddedCluster;
use sieve_cli::queries::TPCH_QUERIES;

use crate::common;
use crate::serving;

use common::NODES;
use serving::*;

const REQUIREMENTS: &str = include_str!("python/requirements.txt");

/// The Python of a virtual environment with the clients installed, made
/// once per target directory (again when the requirements change). Needs
/// `python3` with `venv` and the package index; without them the test fails.
fn python_with_clients() -> PathBuf {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    REQUIREMENTS.hash(&mut hasher);
    let target = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let home = target.join(format!("python-clients-{:016x}", hasher.finish()));
    let python = home.join("bin").join("python");
    if home.join("ready").exists() {
        return python;
    }
    let building = target.join(format!("python-clients-building-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&building);
    let status = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&building)
        .status()
        .expect("python3 is needed for the Python client test");
    assert!(
        status.success(),
        "python3 -m venv failed (apt-get install python3-venv)"
    );
    let requirements =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it/python/requirements.txt");
    let status = Command::new(building.join("bin").join("python"))
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "-r",
        ])
        .arg(&requirements)
        .status()
        .unwrap();
    assert!(
        status.success(),
        "pip could not install {}",
        requirements.display()
    );
    std::fs::write(building.join("ready"), REQUIREMENTS).unwrap();
    // Another test process may have made it meanwhile: keep theirs.
    if std::fs::rename(&building, &home).is_err() {
        let _ = std::fs::remove_dir_all(&building);
    }
    python
}

/// The rows a client wrote for `name`: lists of cells.
fn client_rows(directory: &Path, name: &str) -> Vec<Vec<String>> {
    let path = directory.join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("{}: {error}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn sorted(mut rows: Vec<Vec<String>>) -> Vec<Vec<String>> {
    rows.sort();
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adbc_flight_sql_and_psycopg_get_right_answers_over_tls() {
    let python = python_with_clients();
    let root = common::small_slices(1);
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let directory = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("serve-python-{}", std::process::id()));
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
    let (pg_host, pg_port) = server.address.rsplit_once(':').unwrap();
    let queries: BTreeMap<&str, &str> = TPCH_QUERIES.iter().copied().collect();
    let input = serde_json::json!({
        "pg_host": pg_host,
        "pg_port": pg_port.parse::<u16>().unwrap(),
        "flight_uri": format!("grpc+tls://{}", server.flight_address),
        "user": "sieve",
        "password": PASSWORD,
        "ca_cert": ca_certificate(&directory),
        "queries": queries,
    });
    let input_path = directory.join("input.json");
    std::fs::write(&input_path, input.to_string()).unwrap();
    let output_directory = directory.join("results");
    let output = Command::new(&python)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it/python/clients.py"))
        .arg(&input_path)
        .arg(&output_directory)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the Python clients failed:\n{stderr}"
    );

    let mut compared = 0;
    for driver in ["adbc", "psycopg"] {
        let results = output_directory.join(driver);
        for (name, sql) in TPCH_QUERIES {
            let expected = sorted(reference_rows(&root, sql).await);
            assert!(!expected.is_empty(), "{name}: the reference has no rows");
            let actual = sorted(client_rows(&results, name));
            assert_same_rows(&format!("{driver} {name}"), &actual, &expected);
            compared += 1;
        }
        // Q6 with parameters, and with NDP off in one session.
        let q6 = reference_rows(&root, query("q6")).await;
        for name in ["q6_parameters", "q6_ndp_off"] {
            let actual = client_rows(&results, name);
            assert_same_rows(&format!("{driver} {name}"), &actual, &q6);
            compared += 1;
        }
    }
    assert_eq!(compared, 48);
    drop(server);
    let _ = std::fs::remove_dir_all(&directory);
}
