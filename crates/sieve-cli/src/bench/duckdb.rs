//! DuckDB, the engine a user would otherwise pick: reading the same Parquet
//! slice files over HTTP from the storage nodes' byte-range endpoint
//! (httpfs). It runs as a Python process in a virtual environment this
//! module creates (PyPI `duckdb` and `duckdb-ext-httpfs`, pinned), speaking
//! JSON lines (`duckdb_driver.py`).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use datafusion::common::{exec_datafusion_err, exec_err, Result};
use serde_json::Value;

use sieve_fragment::Secret;

use super::link::SharedCleanup;
use crate::secret::SECRET_ENV;

/// The pinned DuckDB release.
pub const DUCKDB_VERSION: &str = "1.4.4";
/// The httpfs extension package built for it.
pub const HTTPFS_VERSION: &str = "1.4.4.20260205";

const DRIVER: &str = include_str!("duckdb_driver.py");

/// Create (once) a virtual environment with DuckDB and httpfs in `directory`
/// and return its Python interpreter.
pub fn ensure_environment(directory: &Path) -> Result<PathBuf> {
    // One creator at a time (concurrent harnesses, parallel tests): the
    // lock is released when the file closes.
    if let Some(parent) = directory.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let lock = std::fs::File::create(directory.with_extension("lock"))?;
    // SAFETY: flock on a file descriptor we own.
    if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) } != 0 {
        return exec_err!("cannot lock {}", directory.display());
    }
    let python = directory.join("bin").join("python");
    let marker = directory.join("sieve-bench-ready");
    let wanted = format!("duckdb=={DUCKDB_VERSION} duckdb-ext-httpfs=={HTTPFS_VERSION}");
    if python.exists() && std::fs::read_to_string(&marker).is_ok_and(|text| text == wanted) {
        return Ok(python);
    }
    eprintln!(
        "creating a Python environment with {wanted} in {} ...",
        directory.display()
    );
    let _ = std::fs::remove_dir_all(directory);
    let status = |command: &mut Command, what: &str| -> Result<()> {
        let output = command
            .output()
            .map_err(|error| exec_datafusion_err!("{what}: {error}"))?;
        if !output.status.success() {
            return exec_err!(
                "{what} failed: {}{}",
                String::from_utf8_lossy(&output.stdout).trim(),
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        Ok(())
    };
    status(
        Command::new("python3").arg("-m").arg("venv").arg(directory),
        "python3 -m venv (DuckDB mode needs Python 3 with venv; or leave duckdb out of --modes)",
    )?;
    status(
        Command::new(&python).args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            &format!("duckdb=={DUCKDB_VERSION}"),
            &format!("duckdb-ext-httpfs=={HTTPFS_VERSION}"),
        ]),
        "pip install duckdb",
    )?;
    std::fs::write(&marker, wanted)?;
    Ok(python)
}

/// A running DuckDB driver process.
#[derive(Debug)]
pub struct DuckDb {
    /// Its process id (for its CPU time).
    pub pid: u32,
    input: ChildStdin,
    output: BufReader<ChildStdout>,
}

/// One query's answer.
#[derive(Debug)]
pub struct DuckAnswer {
    /// DuckDB's own timing of execute + fetch.
    pub wall: Duration,
    /// The rows, as JSON values (numbers, strings, null).
    pub rows: Vec<Vec<Value>>,
}

impl DuckDb {
    /// Start the driver with `python` and create one view per table over
    /// its slice files' URLs.
    pub fn start(
        python: &Path,
        work: &Path,
        tables: &BTreeMap<String, Vec<String>>,
        secret: &Secret,
        cleanup: &SharedCleanup,
    ) -> Result<Self> {
        let script = work.join("duckdb_driver.py");
        std::fs::write(&script, DRIVER)?;
        let mut command = Command::new(python);
        command
            .arg(&script)
            // The driver sends it as an HTTP header; by environment, never
            // on the command line.
            .env(SECRET_ENV, secret.expose())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // SAFETY: prctl is async-signal-safe: the driver dies with us.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = command
            .spawn()
            .map_err(|error| exec_datafusion_err!("cannot start DuckDB: {error}"))?;
        let pid = child.id();
        let input = child.stdin.take().expect("stdin is piped");
        let output = BufReader::new(child.stdout.take().expect("stdout is piped"));
        cleanup
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .add_child("duckdb".into(), child);
        let mut duckdb = Self { pid, input, output };
        duckdb.answer()?;
        duckdb.request(&serde_json::json!({"op": "views", "tables": tables}))?;
        Ok(duckdb)
    }

    fn answer(&mut self) -> Result<Value> {
        let mut line = String::new();
        self.output
            .read_line(&mut line)
            .map_err(|error| exec_datafusion_err!("DuckDB: {error}"))?;
        if line.is_empty() {
            return exec_err!("DuckDB exited (see its messages above)");
        }
        let value: Value = serde_json::from_str(&line)
            .map_err(|error| exec_datafusion_err!("DuckDB answered '{line}': {error}"))?;
        if value["ok"] != Value::Bool(true) {
            return exec_err!("DuckDB: {}", value["error"].as_str().unwrap_or("failed"));
        }
        Ok(value)
    }

    fn request(&mut self, request: &Value) -> Result<Value> {
        writeln!(self.input, "{request}")
            .and_then(|()| self.input.flush())
            .map_err(|error| exec_datafusion_err!("DuckDB: {error}"))?;
        self.answer()
    }

    /// Run `sql` and return its rows.
    pub fn query(&mut self, sql: &str) -> Result<DuckAnswer> {
        let answer = self.request(&serde_json::json!({"op": "query", "sql": sql}))?;
        let wall = Duration::from_secs_f64(answer["wall_seconds"].as_f64().unwrap_or(0.0));
        let rows = match answer["rows"].as_array() {
            Some(rows) => rows
                .iter()
                .map(|row| row.as_array().cloned().unwrap_or_default())
                .collect(),
            None => return exec_err!("DuckDB answered without rows"),
        };
        Ok(DuckAnswer { wall, rows })
    }
}
