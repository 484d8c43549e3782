//! `sieve bench` end to end, as a user runs it: the three modes agree on all
//! 22 TPC-H queries and all 13 SSB queries at SF 0.01, the report and charts are written, and
//! nothing is left behind (no namespace, no interface, no process), also
//! when the run is interrupted with Ctrl-C (SIGINT) halfway.
//!
//! As root with iproute2 (CI), the run goes over the emulated link; without
//! root it must say it runs on plain loopback, and the test checks that.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn data_directory() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bench-data")
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A `sieve bench` command marked with `mark` in its environment, which its
/// storage nodes and DuckDB inherit, so leftovers can be found by it.
fn bench(mark: &str, out: &Path, extra: &[&str]) -> Command {
    bench_of("tpch", mark, out, extra)
}

/// [`bench`] of `benchmark`.
fn bench_of(benchmark: &str, mark: &str, out: &Path, extra: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_sieve"));
    command
        .args([
            "bench", benchmark, "--sf", "0.01", "--nodes", "2", "--link", "1gbit",
        ])
        .arg("--data")
        .arg(data_directory())
        .arg("--out")
        .arg(out)
        .args(extra)
        .env("SIEVE_BENCH_TEST_MARK", mark);
    command
}

/// Processes whose environment carries `mark`.
fn marked_processes(mark: &str) -> Vec<u32> {
    let needle = format!("SIEVE_BENCH_TEST_MARK={mark}");
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if pid == std::process::id() {
            continue;
        }
        let Ok(environment) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        if environment
            .split(|byte| *byte == 0)
            .any(|variable| variable == needle.as_bytes())
        {
            found.push(pid);
        }
    }
    found
}

fn namespaces_of(pid: u32) -> Vec<String> {
    // Without root or iproute2 there are none to list.
    sieve_cli::bench::link::namespaces_of(pid).unwrap_or_default()
}

fn interfaces_of(pid: u32) -> Vec<String> {
    let prefix = format!("sb{pid}");
    std::fs::read_dir("/sys/class/net")
        .map(|entries| {
            entries
                .flatten()
                .map(|entry| entry.file_name().to_string_lossy().into_owned())
                .filter(|name| name.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
}

fn assert_nothing_left(pid: u32, mark: &str) {
    // Children are reaped before the harness exits; give the kernel a moment
    // to finish tearing down what it tears down asynchronously.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (processes, namespaces, interfaces) = (
            marked_processes(mark),
            namespaces_of(pid),
            interfaces_of(pid),
        );
        if processes.is_empty() && namespaces.is_empty() && interfaces.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "left behind: processes {processes:?}, namespaces {namespaces:?}, interfaces {interfaces:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn bench_runs_three_modes_that_agree_and_leaves_nothing_behind() {
    let mark = format!("complete-{}", std::process::id());
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(&mark);
    let _ = std::fs::remove_dir_all(&out);
    let child = bench(&mark, &out, &["--runs", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start sieve bench");
    let pid = child.id();
    let output = child.wait_with_output().expect("sieve bench runs");
    let (stdout, stderr) = text(&output);
    assert!(
        output.status.success(),
        "sieve bench failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("| total |"), "no Markdown table:\n{stdout}");
    assert_nothing_left(pid, &mark);

    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("results.json")).expect("results.json"))
            .expect("results.json is JSON");
    assert_eq!(report["modes"], serde_json::json!(["ndp", "off", "duckdb"]));
    let queries = report["queries"].as_array().expect("queries");
    assert_eq!(queries.len(), 22);
    for query in queries {
        let modes = query["modes"].as_array().expect("modes");
        assert_eq!(modes.len(), 3);
        let rows: Vec<&serde_json::Value> = modes.iter().map(|m| &m["checksum"]["rows"]).collect();
        assert!(
            rows.iter().all(|r| *r == rows[0]),
            "{}: row counts {rows:?}",
            query["name"]
        );
        for mode in modes {
            assert!(mode["wall_ms_median"].as_f64().unwrap() > 0.0);
        }
    }
    // The storage processes' CPU is measured: with pushdown they do the scans.
    let ndp_storage_cpu: f64 = queries
        .iter()
        .map(|q| {
            q["modes"][0]["storage_cpu_seconds"]
                .as_f64()
                .expect("storage cpu")
        })
        .sum();
    assert!(ndp_storage_cpu > 0.0, "no storage CPU measured for ndp");
    let emulated = report["link"]["emulated"].as_bool().expect("link.emulated");
    if is_root() {
        assert!(
            emulated,
            "root should get the emulated link: {}",
            report["link"]
        );
        // Bytes on the interfaces: pushdown moves far less than reading pages.
        let total = |mode: usize| -> f64 {
            queries
                .iter()
                .map(|q| {
                    q["modes"][mode]["bytes_moved"]
                        .as_f64()
                        .expect("bytes_moved")
                })
                .sum()
        };
        assert!(
            total(0) > 0.0 && total(0) * 5.0 < total(1),
            "ndp {} vs off {}",
            total(0),
            total(1)
        );
    } else {
        assert!(!emulated);
        assert!(stderr.contains("running on plain loopback"), "{stderr}");
    }
    for chart in ["speedup.svg", "speedup.png", "bytes.svg", "bytes.png"] {
        let bytes = std::fs::read(out.join(chart)).unwrap_or_else(|_| panic!("{chart} written"));
        assert!(bytes.len() > 1000, "{chart} is {} bytes", bytes.len());
        if chart.ends_with(".png") {
            assert_eq!(&bytes[..4], b"\x89PNG");
        }
    }
}

#[test]
fn ssb_bench_runs_its_13_queries_in_three_modes_that_agree() {
    let mark = format!("ssb-{}", std::process::id());
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(&mark);
    let _ = std::fs::remove_dir_all(&out);
    let child = bench_of("ssb", &mark, &out, &["--runs", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start sieve bench ssb");
    let pid = child.id();
    let output = child.wait_with_output().expect("sieve bench ssb runs");
    let (stdout, stderr) = text(&output);
    // The run fails if any two modes disagree on any query's rows.
    assert!(
        output.status.success(),
        "sieve bench ssb failed:\n{stdout}\n{stderr}"
    );
    assert_nothing_left(pid, &mark);
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("results.json")).expect("results.json"))
            .expect("results.json is JSON");
    assert_eq!(report["benchmark"], "ssb");
    let names: Vec<&str> = report["queries"]
        .as_array()
        .expect("queries")
        .iter()
        .map(|query| query["name"].as_str().expect("a name"))
        .collect();
    let expected: Vec<&str> = sieve_cli::queries::SSB_QUERIES
        .iter()
        .map(|(name, _)| *name)
        .collect();
    assert_eq!(names, expected);
    assert_eq!(report["failed"], serde_json::json!([]));
    assert!(stdout.contains("SSB"), "{stdout}");
}

#[test]
fn interrupted_bench_leaves_nothing_behind() {
    let mark = format!("interrupted-{}", std::process::id());
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(&mark);
    let mut child = bench(&mark, &out, &["--runs", "5"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start sieve bench");
    let pid = child.id();
    // Wait until the storage nodes run (and, as root, the namespaces exist);
    // data generation and DuckDB's environment may come first.
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let nodes = marked_processes(&mark).len() >= 2;
        if nodes && (!is_root() || namespaces_of(pid).len() == 2) {
            break;
        }
        assert!(
            child.try_wait().expect("wait").is_none(),
            "sieve bench ended before it started its nodes"
        );
        assert!(Instant::now() < deadline, "storage nodes did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(2));
    // SAFETY: signalling the child we spawned.
    unsafe { libc::kill(pid as i32, libc::SIGINT) };
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "sieve bench did not stop on SIGINT"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        status.code(),
        Some(130),
        "exit status after SIGINT: {status}"
    );
    assert_nothing_left(pid, &mark);
}

/// Runs `sieve bench` with `args`, which must succeed; its stdout and
/// its results.json.
fn bench_report(mark: &str, args: &[&str]) -> (String, serde_json::Value) {
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(mark);
    let _ = std::fs::remove_dir_all(&out);
    let output = bench(mark, &out, args).output().expect("sieve bench runs");
    let (stdout, stderr) = text(&output);
    assert!(
        output.status.success(),
        "sieve bench failed:\n{stdout}\n{stderr}"
    );
    let report =
        serde_json::from_slice(&std::fs::read(out.join("results.json")).expect("results.json"))
            .expect("results.json is JSON");
    (stdout, report)
}

#[test]
fn a_query_a_mode_cannot_run_is_recorded_and_the_others_still_run() {
    let mark = format!("failing-{}", std::process::id());
    // With hash joins kept in memory, Q18's cannot build in 256 KiB; Q6
    // (one sum) needs no pool.
    let (stdout, report) = bench_report(
        &mark,
        &[
            "--runs",
            "1",
            "--modes",
            "ndp,off",
            "--query",
            "q6",
            "--query",
            "q18",
            "--set",
            "datafusion.runtime.memory_limit=256K",
            "--set",
            "sieve.join_build_bytes_max=0",
        ],
    );
    assert!(stdout.contains("| q18 | failed with "), "{stdout}");
    let failed = report["failed"].as_array().expect("failed");
    assert!(!failed.is_empty(), "{failed:?}");
    for failure in failed {
        assert_eq!(failure["query"], "q18");
        assert!(
            failure["error"]
                .as_str()
                .unwrap()
                .contains("Resources exhausted"),
            "{failed:?}"
        );
    }
    let queries = report["queries"].as_array().expect("queries");
    assert_eq!(queries.len(), 1);
    assert_eq!(queries[0]["name"], "q6");
    assert_eq!(queries[0]["modes"].as_array().unwrap().len(), 2);
}

#[test]
fn when_one_mode_fails_a_query_the_other_modes_times_are_kept() {
    let mark = format!("one-mode-{}", std::process::id());
    // A storage node silent for 1 ms fails NDP's slice requests; NDP off
    // reads byte ranges under its own timeout.
    let (stdout, report) = bench_report(
        &mark,
        &[
            "--runs",
            "1",
            "--modes",
            "ndp,off",
            "--query",
            "q6",
            "--set",
            "sieve.storage_timeout_ms=1",
        ],
    );
    assert!(stdout.contains("| q6 | failed with ndp: "), "{stdout}");
    assert!(stdout.contains("; off "), "{stdout}");
    let failed = report["failed"].as_array().expect("failed");
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0]["mode"], "ndp");
    let others = failed[0]["others_wall_ms"].as_array().expect("others");
    assert_eq!(others.len(), 1, "{others:?}");
    assert_eq!(others[0][0], "off");
    assert!(others[0][1].as_f64().unwrap() > 0.0, "{others:?}");
    assert!(report["queries"].as_array().expect("queries").is_empty());
    // No query ran in every mode: no totals row of zeros.
    assert!(
        stdout.contains("No query completed in every mode") && !stdout.contains("| total |"),
        "{stdout}"
    );
}
