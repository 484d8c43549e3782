//! `sieve gen`: TPC-H loaded through the write path, into tables of the
//! data set's catalog that take writes like any other.

use std::path::PathBuf;
use std::process::Command;

use sieve_cli::cluster::EmbeddedCluster;
use sieve_cli::compare::{reference_context, rows_as_text, run};

use crate::common;

fn gen(out: &std::path::Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_sieve"))
        .args([
            "gen",
            "tpch",
            "--sf",
            "0.001",
            "--nodes",
            "2",
            "--replicas",
            "2",
        ])
        .arg("--out")
        .arg(out)
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sieve_gen_loads_tables_of_a_catalog_that_take_writes() {
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("sieve-gen-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let output = gen(&out);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(sieve_format::is_generated(
        &out,
        sieve_format::Benchmark::Tpch,
        2,
        2
    ));
    let cluster = EmbeddedCluster::start(&out, 2).await.unwrap();
    let session = cluster.session().await.unwrap();
    let reference = reference_context(&out, 2).await.unwrap();
    // The spec's rows at SF 0.001 (lineitem's depends on the orders).
    for (table, rows) in [
        ("nation", Some(25)),
        ("region", Some(5)),
        ("supplier", Some(10)),
        ("customer", Some(150)),
        ("part", Some(200)),
        ("partsupp", Some(800)),
        ("orders", Some(1500)),
        ("lineitem", None),
    ] {
        let sql = format!("select count(*), sum(hash) from (select 1 as hash from {table})");
        let actual = rows_as_text(&run(&session.context, &sql).await.unwrap(), false).unwrap();
        let expected = rows_as_text(&run(&reference, &sql).await.unwrap(), false).unwrap();
        assert_eq!(actual, expected, "{table}");
        if let Some(rows) = rows {
            assert_eq!(actual, [format!("{rows} | {rows}")], "{table}");
        }
    }
    // Every slice on both nodes, each table sorted by its key.
    let tables = common::planned_tables(&session);
    assert_eq!(tables.len(), 8);
    for table in tables.values() {
        for slice in &table.slices {
            assert_eq!(
                slice.replicas.len(),
                2,
                "{} {}",
                table.name,
                slice.summary.slice
            );
        }
    }
    let store = session.catalog.owned.as_ref().unwrap().store();
    let entry = store
        .tables_at(store.latest_version().unwrap())
        .unwrap()
        .remove("orders")
        .unwrap();
    assert_eq!(entry.layout.sort_key, ["o_orderkey"]);
    // A table of `sieve gen` is a table like any other.
    let deleted = run(&session.context, "delete from nation where n_regionkey = 0")
        .await
        .unwrap();
    assert_eq!(rows_as_text(&deleted, false).unwrap(), ["5"]);
    let left = run(&session.context, "select count(*) from nation")
        .await
        .unwrap();
    assert_eq!(rows_as_text(&left, false).unwrap(), ["20"]);
    drop(session);
    drop(cluster);
    // Loading again into a data set's directory is refused, clearly.
    let again = gen(&out);
    assert!(!again.status.success());
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(stderr.contains("already holds a data set"), "{stderr}");
    let _ = std::fs::remove_dir_all(&out);
}

/// A load that fails partway (here the first `CREATE TABLE` refuses its
/// slice size, after the storage nodes started over the staging directory)
/// leaves no staging directory behind; staging directories of processes
/// that no longer run are removed, those of running ones kept. A failed SF
/// 100 load on a full disk once left 22 GB behind.
#[test]
fn a_failed_load_leaves_no_staging_directory() {
    use sieve_cli::cluster::generated_tpch;
    use sieve_format::SliceLayout;
    let parent = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("failed-load-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&parent);
    std::fs::create_dir_all(&parent).unwrap();
    let root = parent.join("tpch-sf0.001");
    // Above any Linux pid_max: no such process runs.
    let stale = parent.join("tpch-sf0.001.staging-4000000000");
    let running = parent.join("tpch-sf0.001.staging-1");
    let other_data_set = parent.join("tpch-sf0.01.staging-4000000000");
    for directory in [&stale, &running, &other_data_set] {
        std::fs::create_dir_all(directory.join("node-0")).unwrap();
    }
    let bad = SliceLayout {
        slice_rows_max: 0,
        ..SliceLayout::default()
    };
    let error = generated_tpch(&root, 0.001, 2, 1, &bad).expect_err("slice_rows = 0 is refused");
    assert!(error.to_string().contains("slice_rows"), "{error}");
    let mut left: Vec<String> = std::fs::read_dir(&parent)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(
        left,
        ["tpch-sf0.001.staging-1", "tpch-sf0.01.staging-4000000000"],
        "the failed load's staging directory and the stale one are gone"
    );
    // The same data set then loads.
    let loaded = generated_tpch(&root, 0.001, 2, 1, &SliceLayout::default()).unwrap();
    assert!(loaded.join("catalog.sqlite").exists());
    let _ = std::fs::remove_dir_all(&parent);
}

/// A load the disk clearly has no room for is refused before anything is
/// written or generated, naming what it needs and what is free.
#[test]
fn a_load_the_disk_has_no_room_for_is_refused_first() {
    use sieve_cli::cluster::{generated, load};
    use sieve_format::{Benchmark, SliceLayout};
    let parent =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("no-room-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&parent);
    std::fs::create_dir_all(&parent).unwrap();
    // SF 10^9: far beyond any disk.
    for benchmark in [Benchmark::Tpch, Benchmark::Ssb] {
        let root = parent.join(format!("{}-huge", benchmark.name()));
        let error = load(benchmark, &root, 1e9, 2, 2, &SliceLayout::default())
            .expect_err("no disk holds SF 10^9");
        let message = error.to_string();
        assert!(
            message.contains("GB free") && message.contains("replica"),
            "{message}"
        );
        assert!(!root.exists(), "nothing written: {}", root.display());
        let error = generated(benchmark, &root, 1e9, 2, 1, &SliceLayout::default())
            .expect_err("no disk holds SF 10^9");
        assert!(error.to_string().contains("GB free"), "{error}");
    }
    assert_eq!(std::fs::read_dir(&parent).unwrap().count(), 0);
    let _ = std::fs::remove_dir_all(&parent);
}
