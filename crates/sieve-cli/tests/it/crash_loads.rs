//! Crash safety of loads (issue 18): real processes, killed with SIGKILL.
//!
//! Three `sieve storage` processes and a compute process (`sieve sql
//! --cluster ... --catalog ...`) that runs a series of `COPY t FROM` (each
//! file four slices on two nodes each) and `DELETE`s (each also setting off
//! the compaction of the slices it left a fifth deleted). At a random moment the compute
//! process or a storage node is killed; the dead are started again and a
//! new compute session opens the catalog. Every time, the table must be
//! exactly what the statements that committed made of it (a prefix of the
//! series: its row count and id sum say which), and the nodes must hold no
//! file the catalog does not name (no slice of a statement that never
//! committed, no temporary file). `SIEVE_CRASH_KILLS` sets the number of
//! kills (8 by default, so the test suite stays short; the long
//! run is 50).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use datafusion::prelude::SessionConfig;
use sieve_compute::connect_session_with_tables;
use sieve_format::node_directory;

use crate::common::{free_port, stray_slice_file, Random};
use sieve_fragment::Secret;

const NODES: usize = 3;
const ROWS_PER_FILE: usize = 2_000;
const FILES: usize = 3_000;
/// Statements a compute process is given per round: more than it gets
/// through before the kill, so the kill lands inside a load.
const STATEMENTS_PER_ROUND: usize = 40;

struct Node {
    directory: PathBuf,
    flight: u16,
    range: u16,
    child: Option<Child>,
}

impl Node {
    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.flight)
    }

    fn start(&mut self, secret: &Secret) {
        let child = Command::new(env!("CARGO_BIN_EXE_sieve"))
            .arg("storage")
            .arg("--data")
            .arg(&self.directory)
            .args(["--listen", &format!("127.0.0.1:{}", self.flight)])
            .args(["--range-listen", &format!("127.0.0.1:{}", self.range)])
            .env("SIEVE_SECRET", secret.expose())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", self.flight)).is_err() {
            assert!(Instant::now() < deadline, "storage node did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

fn write_file(path: &Path, part: usize) {
    let mut text = String::new();
    for row in 0..ROWS_PER_FILE {
        let id = part * ROWS_PER_FILE + row;
        writeln!(text, "{id},\"name {id}, part {part}\",{}", (id * 7) % 1000).unwrap();
    }
    std::fs::write(path, text).unwrap();
}

/// Statement `j` of the series: every third a DELETE of the ids with one
/// residue mod 11 (which sets off compactions), else the next file.
enum Step {
    Copy(usize),
    Delete(u64),
}

fn step(j: usize) -> Step {
    if j % 3 == 2 {
        Step::Delete((j / 3 % 11) as u64)
    } else {
        Step::Copy(j - j / 3)
    }
}

/// Rows and id sum of the table after each prefix of the series (index:
/// statements committed), up to `statements`.
fn prefix_states(statements: usize) -> Vec<(u64, u128)> {
    let mut alive: std::collections::BTreeSet<u64> = std::collections::BTreeSet::new();
    let mut states = vec![(0, 0)];
    for j in 0..statements {
        match step(j) {
            Step::Copy(part) => {
                alive.extend((part * ROWS_PER_FILE..(part + 1) * ROWS_PER_FILE).map(|id| id as u64))
            }
            Step::Delete(residue) => alive.retain(|id| id % 11 != residue),
        }
        states.push((
            alive.len() as u64,
            alive.iter().map(|&id| u128::from(id)).sum(),
        ));
    }
    states
}

/// [`check_once`], again (up to 20 times, 100 ms apart) while a node
/// holds a file the catalog does not name: a put whose client was killed
/// ends on the node a moment later (its temporary file removed, or its
/// slice served after the next catalog open's `retain-slices`), and the
/// next open of the catalog removes it.
async fn check(nodes: &[Node], secret: &Secret, catalog: &Path, round: usize) -> (u64, u128) {
    let mut attempt = 0;
    loop {
        match check_once(nodes, secret, catalog, round).await {
            Ok(parts) => return parts,
            Err(stray) if attempt < 20 => {
                attempt += 1;
                println!("round {round}: {stray}; checking again");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(stray) => panic!("round {round}: {stray}"),
        }
    }
}

/// Open the catalog in this process (which removes what no committed
/// version names), check the table is a committed prefix and the nodes
/// hold only what the catalog names; the prefix's length, or the file a
/// node holds that it should not.
async fn check_once(
    nodes: &[Node],
    secret: &Secret,
    catalog: &Path,
    round: usize,
) -> Result<(u64, u128), String> {
    let urls: Vec<String> = nodes.iter().map(Node::url).collect();
    let session =
        connect_session_with_tables(&urls, Some(secret), SessionConfig::new(), Some(catalog))
            .await
            .unwrap_or_else(|error| panic!("round {round}: the catalog does not open: {error}"));
    let batches = session
        .sql("SELECT count(*), CAST(COALESCE(sum(id), 0) AS DECIMAL(38, 0)) FROM t")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap_or_else(|error| panic!("round {round}: the table cannot be read: {error}"));
    let text = sieve_cli::compare::rows_as_text(&batches, false)
        .unwrap()
        .join("");
    let (count, sum) = text.split_once(" | ").unwrap();
    let count: u64 = count.trim().parse().unwrap();
    let sum: u128 = sum.trim().parse().unwrap();
    // Every slice file on the nodes is one the catalog keeps.
    let kept = session
        .catalog
        .owned
        .as_ref()
        .unwrap()
        .store()
        .retained()
        .unwrap();
    let directories: Vec<&Path> = nodes.iter().map(|node| node.directory.as_path()).collect();
    if let Some(stray) = stray_slice_file(&directories, &kept) {
        return Err(stray);
    }
    Ok((count, sum))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_killed_at_any_moment_leaves_a_committed_version_and_no_orphan() {
    let kills: usize = std::env::var("SIEVE_CRASH_KILLS")
        .ok()
        .and_then(|kills| kills.parse().ok())
        .unwrap_or(8);
    let mut random = Random::from_env("SIEVE_CRASH_SEED");
    let seed = random.0;
    println!("seed {seed} (SIEVE_CRASH_SEED), {kills} kills");
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("crash-loads-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let files = root.join("files");
    std::fs::create_dir_all(&files).unwrap();
    let secret = Secret::from_random_bytes(&std::array::from_fn::<u8, 32, _>(|i| {
        (seed as u8).wrapping_mul(31).wrapping_add(i as u8 * 7 + 1)
    }))
    .unwrap();
    let mut nodes: Vec<Node> = (0..NODES)
        .map(|node| {
            let directory = node_directory(&root, node);
            std::fs::create_dir_all(&directory).unwrap();
            Node {
                directory,
                flight: free_port(),
                range: free_port(),
                child: None,
            }
        })
        .collect();
    for node in &mut nodes {
        node.start(&secret);
    }
    let catalog = root.join("catalog.sqlite");
    let urls = nodes.iter().map(Node::url).collect::<Vec<_>>().join(",");
    let sql = |statements: &str| {
        Command::new(env!("CARGO_BIN_EXE_sieve"))
            .arg("sql")
            .args(["--cluster", &urls])
            .arg("--catalog")
            .arg(&catalog)
            .args(["-c", statements])
            .env("SIEVE_SECRET", secret.expose())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let created = sql("CREATE TABLE t (id BIGINT NOT NULL, name VARCHAR, v INT) WITH (sort_key = 'id', slice_rows = 500, replicas = 2)")
        .wait_with_output()
        .unwrap();
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );

    let states = prefix_states(FILES);
    let mut committed = 0;
    let mut killed_compute = 0;
    let mut mid_load = 0;
    for round in 0..kills {
        assert!(
            committed + STATEMENTS_PER_ROUND < FILES,
            "the series ran out of files"
        );
        let mut script = String::from("SET sieve.compact_deleted_share = 0.2;\n");
        for j in committed..committed + STATEMENTS_PER_ROUND {
            match step(j) {
                Step::Copy(part) => {
                    let path = files.join(format!("part-{part}.csv"));
                    if !path.exists() {
                        write_file(&path, part);
                    }
                    writeln!(
                        script,
                        "COPY t FROM '{}' WITH (FORMAT csv);",
                        path.display()
                    )
                    .unwrap();
                }
                Step::Delete(residue) => {
                    writeln!(script, "DELETE FROM t WHERE id % 11 = {residue};").unwrap()
                }
            }
        }
        let mut compute = sql(&script);
        std::thread::sleep(Duration::from_millis(100 + random.below(1500)));
        if compute.try_wait().unwrap().is_none() {
            mid_load += 1;
        }
        let victim = random.below(NODES as u64 + 2) as usize;
        if victim >= NODES {
            let _ = compute.kill();
            killed_compute += 1;
        } else {
            nodes[victim].kill();
        }
        let _ = compute.kill();
        let _ = compute.wait();
        for node in &mut nodes {
            if node.child.is_none() {
                node.start(&secret);
            }
        }
        let state = check(&nodes, &secret, &catalog, round).await;
        // The table is the state after some prefix of the series, at least
        // as long as the one committed before (the largest that fits: a
        // DELETE may change nothing).
        let Some(prefix) = (committed..=committed + STATEMENTS_PER_ROUND)
            .rev()
            .find(|&k| states[k] == state)
        else {
            panic!("round {round}: the table ({} rows, id sum {}) is no committed version after statement {committed}", state.0, state.1)
        };
        committed = prefix;
    }
    println!(
        "{kills} kills ({killed_compute} of the compute node, {mid_load} while it was loading), {committed} statements committed"
    );
    assert!(
        mid_load * 2 >= kills,
        "only {mid_load} of {kills} kills landed during a load"
    );
    assert!(
        committed > 0,
        "no statement ever committed: the kills came too early to test anything"
    );
    drop(nodes);
    std::fs::remove_dir_all(&root).unwrap();
}
