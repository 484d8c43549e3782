//! `sieve serve` driven by the real `psql` binary: a password over TLS,
//! `\dt` and `\d`, TPC-H answers equal to plain DataFusion's, settings that
//! belong to one connection, command tags of statements that change data
//! and a ROLLBACK that cannot undo them, errors with their SQLSTATE; a wrong password,
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

/// Statements that change data, on a data set of the test's own (the
/// tables it creates would show in other tests' listings).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psql_gets_command_tags_and_a_rollback_that_says_what_stays() {
    let directory = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("serve-pg-dml-{}", std::process::id()));
    let root = common::small_slices_in(&directory.join("data"), 1);
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let server = start_server(&cluster, &[]);

    // Statements that change rows or tables answer with PostgreSQL's
    // command tags, UPDATE and DELETE with the rows they changed.
    let output = psql(
        &server,
        "disable",
        PASSWORD,
        &[
            "-v",
            "ON_ERROR_STOP=1",
            "-c",
            "create table tagged (k bigint, v varchar)",
            "-c",
            "insert into tagged values (1, 'a'), (2, 'b'), (3, NULL), (4, 'd')",
            "-c",
            "update tagged set v = 'c' where k = 2 or k = 4",
            "-c",
            "delete from tagged where v is null",
            "-c",
            "delete from tagged where k > 100",
            "-c",
            "select k, v from tagged order by k",
            "-c",
            "truncate tagged",
            "-c",
            "drop table tagged",
        ],
    );
    let (stdout, stderr) = text(&output);
    assert!(output.status.success(), "DML failed: {stderr}");
    let tags: Vec<&str> = stdout
        .lines()
        .filter(|line| line.chars().next().is_some_and(|c| c.is_ascii_uppercase()))
        .collect();
    assert_eq!(
        tags,
        [
            "CREATE TABLE",
            "INSERT 0 4",
            "UPDATE 2",
            "DELETE 1",
            "DELETE 0",
            "TRUNCATE TABLE",
            "DROP TABLE"
        ],
        "{stdout}"
    );
    for row in ["1 | a", "2 | c", "4 | c"] {
        assert!(stdout.contains(row), "{row} missing:\n{stdout}");
    }

    // Sieve commits each statement as it runs: a block's ROLLBACK after a
    // change is an error that says the change stays (and it does); one
    // after reads only, or a COMMIT, is what PostgreSQL answers.
    let output = psql(
        &server,
        "disable",
        PASSWORD,
        &[
            "-v",
            "ON_ERROR_STOP=0",
            "-A",
            "-t",
            "-c",
            "create table blocks (k bigint)",
            "-c",
            "begin",
            "-c",
            "insert into blocks values (1)",
            "-c",
            "rollback",
            "-c",
            "rollback",
            "-c",
            "begin",
            "-c",
            "select count(*) as seen from blocks",
            "-c",
            "rollback",
            "-c",
            "begin",
            "-c",
            "insert into blocks values (2)",
            "-c",
            "commit",
            "-c",
            "select 'rows:' || cast(count(*) as varchar) from blocks",
            "-c",
            "drop table blocks",
        ],
    );
    let (stdout, stderr) = text(&output);
    assert!(stderr.contains("ROLLBACK cannot undo"), "{stderr}");
    // Savepoints: kept by name; rolling back to one is true while nothing
    // changed data since, an error saying what stays otherwise.
    let savepoints = psql(
        &server,
        "disable",
        PASSWORD,
        &[
            "-v",
            "ON_ERROR_STOP=0",
            "-c",
            "create table sp (k bigint)",
            "-c",
            "savepoint outside",
            "-c",
            "begin",
            "-c",
            "savepoint a",
            "-c",
            "select 1",
            "-c",
            "rollback to savepoint a",
            "-c",
            "insert into sp values (3)",
            "-c",
            "release savepoint a",
            "-c",
            "savepoint b",
            "-c",
            "insert into sp values (4)",
            "-c",
            "rollback to savepoint b",
            "-c",
            "select 2",
            "-c",
            "rollback",
            "-c",
            "rollback",
            "-c",
            "select 'kept:' || cast(count(*) as varchar) from sp",
            "-c",
            "drop table sp",
        ],
    );
    let (saved, unsaved) = text(&savepoints);
    assert!(saved.contains("kept:2"), "{saved}");
    // After the failed ROLLBACK TO, the block takes only its end.
    assert!(unsaved.contains("25P02"), "{unsaved}");
    assert!(unsaved.contains("25P01"), "{unsaved}");
    assert!(
        unsaved.contains("ROLLBACK TO SAVEPOINT cannot undo the 1 statement"),
        "{unsaved}"
    );
    for tag in ["SAVEPOINT", "ROLLBACK", "RELEASE"] {
        assert!(saved.lines().any(|line| line == tag), "{tag}: {saved}");
    }
    assert_eq!(
        stderr.matches("ERROR").count(),
        1,
        "only the ROLLBACK after a change fails: {stderr}"
    );
    assert!(stdout.contains("rows:2"), "both inserts stay: {stdout}");

    // A statement prepared before its table was dropped and created
    // again reads the new table when the columns are the same (as
    // PostgreSQL plans it again), and fails clearly when they are not.
    let output = psql(
        &server,
        "disable",
        PASSWORD,
        &[
            "-v",
            "ON_ERROR_STOP=0",
            "-A",
            "-t",
            "-c",
            "create table again (k bigint)",
            "-c",
            "insert into again values (1)",
            "-c",
            "prepare q as select 'k:' || cast(k as varchar) from again",
            "-c",
            "execute q",
            "-c",
            "drop table again",
            "-c",
            "create table again (k bigint)",
            "-c",
            "insert into again values (2)",
            "-c",
            "execute q",
            "-c",
            "drop table again",
            "-c",
            "create table again (k int, v varchar)",
            "-c",
            "execute q",
            "-c",
            "deallocate q",
            "-c",
            "drop table again",
        ],
    );
    let (stdout, stderr) = text(&output);
    let lines: Vec<&str> = stdout
        .lines()
        .filter(|line| line.starts_with("k:") || *line == "PREPARE" || *line == "DEALLOCATE")
        .collect();
    assert_eq!(
        lines,
        ["PREPARE", "k:1", "k:2", "DEALLOCATE"],
        "{stdout}\n{stderr}"
    );
    assert!(stderr.contains("other columns"), "{stderr}");

    // psql's \copy: COPY FROM STDIN in CSV and in PostgreSQL's text
    // format, with a column list; the rows loaded in one commit, and a bad
    // value loads nothing and says where it is.
    let good = directory.join("good.csv");
    std::fs::write(&good, "k,v\n1,a\n2,\"b,c\"\n3,\n").unwrap();
    let bad = directory.join("bad.csv");
    std::fs::write(&bad, "10,x\neleven,y\n").unwrap();
    let text_rows = directory.join("rows.txt");
    std::fs::write(&text_rows, "4\tx\\ty\n5\t\\N\n6\t\n").unwrap();
    let listed = directory.join("listed.csv");
    std::fs::write(&listed, "z,7\n").unwrap();
    let output = psql(
        &server,
        "disable",
        PASSWORD,
        &[
            "-v",
            "ON_ERROR_STOP=0",
            "-A",
            "-t",
            "-c",
            "create table copied (k bigint, v varchar)",
            "-c",
            &format!(
                "\\copy copied from '{}' with (format csv, header true)",
                good.display()
            ),
            "-c",
            &format!("\\copy copied from '{}' csv", bad.display()),
            "-c",
            &format!("\\copy copied from '{}'", text_rows.display()),
            "-c",
            &format!("\\copy copied (v, k) from '{}' csv", listed.display()),
            "-c",
            "select k || ':' || coalesce('[' || v || ']', 'NULL') from copied order by k",
            "-c",
            "drop table copied",
        ],
    );
    let (stdout, stderr) = text(&output);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines,
        [
            "CREATE TABLE",
            "COPY 3",
            "COPY 3",
            "COPY 1",
            "1:[a]",
            "2:[b,c]",
            "3:NULL",
            "4:[x\ty]",
            "5:NULL",
            "6:[]",
            "7:[z]",
            "DROP TABLE"
        ],
        "{stdout}\n{stderr}"
    );
    assert!(
        stderr.contains("eleven") && stderr.contains("line 2"),
        "{stderr}"
    );

    drop(server);
    let _ = std::fs::remove_dir_all(&directory);
}
