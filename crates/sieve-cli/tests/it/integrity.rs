//! Integrity (issue 16): a page that changed on disk is found by its
//! checksum and costs a retry on another replica, never a wrong answer;
//! without a healthy copy the query fails naming the slice; a slice file
//! that cannot be read at startup is named and the node serves the rest.

use std::fs::File;
use std::path::{Path, PathBuf};

use parquet::file::metadata::{PageIndexPolicy, ParquetMetaDataReader};
use sieve_cli::cluster::EmbeddedCluster;
use sieve_cli::compare::{reference_context, rows_as_text, run};
use sieve_cli::queries::TPCH_QUERIES;

use crate::common;

use common::NODES;

/// Column of `l_extendedprice` in lineitem.
const EXTENDED_PRICE: usize = 5;

/// Q1, Q6 and a plain sum over every lineitem row.
fn queries() -> Vec<(&'static str, &'static str)> {
    let mut chosen: Vec<(&str, &str)> = TPCH_QUERIES
        .iter()
        .filter(|(name, _)| *name == "q1" || *name == "q6")
        .copied()
        .collect();
    assert_eq!(chosen.len(), 2);
    chosen.push(("sum", "select sum(l_extendedprice), count(*) from lineitem"));
    chosen
}

/// A data set of its own, the same as the shared one with `replicas`
/// copies (loading is deterministic), to damage. (The shared one's
/// catalog is in use by other test processes, so it is not copied.)
fn copy_of(replicas: usize, name: &str) -> PathBuf {
    let copy = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("integrity-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&copy);
    common::small_slices_in(&copy, replicas)
}

/// Flip one byte in the middle of the first `l_extendedprice` data page of
/// `path` (found through the offset index).
fn flip_a_page_byte(path: &Path) {
    let metadata = ParquetMetaDataReader::new()
        .with_page_index_policy(PageIndexPolicy::Required)
        .parse_and_finish(&File::open(path).unwrap())
        .unwrap();
    let location = &metadata.offset_index().unwrap()[0][EXTENDED_PRICE].page_locations()[0];
    let at = (location.offset + i64::from(location.compressed_page_size) / 2) as usize;
    let mut bytes = std::fs::read(path).unwrap();
    bytes[at] ^= 0x5a;
    std::fs::write(path, bytes).unwrap();
}

async fn stats(url: &str, secret: &sieve_fragment::Secret) -> serde_json::Value {
    sieve_compute::StorageClient::connect(url, Some(secret))
        .await
        .unwrap()
        .stats()
        .await
        .unwrap()
}

/// Files every node of `cluster` reports under `key` in its stats.
async fn reported(cluster: &EmbeddedCluster, key: &str) -> Vec<String> {
    let mut files = Vec::new();
    for url in cluster.urls() {
        let stats = stats(&url, cluster.secret()).await;
        for file in stats[key].as_array().unwrap() {
            files.push(file.as_str().unwrap().to_string());
        }
    }
    files
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_page_costs_a_retry_on_a_healthy_replica_not_the_answer() {
    let healthy = common::small_slices(2);
    let reference = reference_context(&healthy, NODES).await.unwrap();
    let root = copy_of(2, "failover");
    let lineitem = common::stored(&root, "lineitem");
    // Damage one copy of every lineitem slice, alternating which, so that
    // whichever replica the compute node tries first, some are damaged.
    let mut damaged = Vec::new();
    for (index, (slice, nodes)) in lineitem.slices.iter().enumerate() {
        assert_eq!(nodes.len(), 2, "slice {slice} on {nodes:?}");
        let path = lineitem.path(&root, nodes[index % 2], *slice);
        flip_a_page_byte(&path);
        damaged.push(path.file_name().unwrap().to_string_lossy().into_owned());
    }
    assert!(damaged.len() >= 4, "{damaged:?}");

    for raw in [false, true] {
        let cluster = if raw {
            EmbeddedCluster::start_raw(&root, NODES).await.unwrap()
        } else {
            EmbeddedCluster::start(&root, NODES).await.unwrap()
        };
        let session = cluster.session().await.unwrap();
        for (name, sql) in queries() {
            let expected = rows_as_text(&run(&reference, sql).await.unwrap(), true).unwrap();
            // Twice: the second time the damaged copies are refused at once.
            for round in 0..2 {
                let actual = run(&session.context, sql)
                    .await
                    .unwrap_or_else(|error| panic!("{name} (raw {raw}, round {round}): {error}"));
                assert_eq!(
                    rows_as_text(&actual, true).unwrap(),
                    expected,
                    "{name} (raw {raw}, round {round})"
                );
            }
        }
        let corrupt = reported(&cluster, "corrupt_slices").await;
        assert!(!corrupt.is_empty(), "raw {raw}: no damaged copy was met");
        for file in &corrupt {
            assert!(damaged.contains(file), "{file} reported but not damaged");
        }
        // The nodes holding damaged copies are not marked failed.
        for node in session.catalog.nodes.iter() {
            assert_eq!(
                node.failed_at_ms.load(std::sync::atomic::Ordering::Relaxed),
                0,
                "a node with a damaged copy was marked failed"
            );
        }

        // NDP off reads each slice from one node: the right answer, or an
        // error naming the damaged slice file, never a wrong answer.
        session.set_ndp(false).unwrap();
        for (name, sql) in queries() {
            let expected = rows_as_text(&run(&reference, sql).await.unwrap(), true).unwrap();
            match run(&session.context, sql).await {
                Ok(actual) => assert_eq!(
                    rows_as_text(&actual, true).unwrap(),
                    expected,
                    "{name}, NDP off"
                ),
                Err(error) => {
                    let error = error.to_string();
                    assert!(
                        error.contains("corrupt slice file")
                            && damaged.iter().any(|file| error.contains(file.as_str())),
                        "{name}, NDP off: {error}"
                    );
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_healthy_copy_the_query_fails_naming_the_slice() {
    let root = copy_of(1, "single");
    let lineitem = common::stored(&root, "lineitem");
    let (slice, nodes) = &lineitem.slices[1];
    let path = lineitem.path(&root, nodes[0], *slice);
    let file = path.file_name().unwrap().to_string_lossy().into_owned();
    flip_a_page_byte(&path);
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let session = cluster.session().await.unwrap();
    let sql = "select sum(l_extendedprice) from lineitem";
    for round in 0..2 {
        let error = run(&session.context, sql)
            .await
            .expect_err("no healthy copy: an error, not an answer")
            .to_string();
        assert!(
            error.contains(&format!("slice {slice} of table '{}'", lineitem.name))
                && error.contains(&file)
                && error.contains("corrupt slice file"),
            "round {round}: {error}"
        );
    }
    assert_eq!(
        reported(&cluster, "corrupt_slices").await,
        vec![file.clone()]
    );
    // A query that does not read the damaged page still answers.
    let other = run(&session.context, "select count(*) from orders").await;
    assert!(other.is_ok(), "{other:?}");

    // NDP off: the damaged page is found on the compute node too.
    session.set_ndp(false).unwrap();
    let error = run(&session.context, sql)
        .await
        .expect_err("NDP off: an error, not an answer")
        .to_string();
    assert!(
        error.contains("corrupt slice file")
            && error.contains(&format!("{}/{file}", lineitem.name)),
        "NDP off: {error}"
    );
    let _ = std::fs::remove_dir_all(&root);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_slice_file_at_startup_is_named_and_the_rest_served() {
    let healthy = common::small_slices(2);
    let reference = reference_context(&healthy, NODES).await.unwrap();
    let root = copy_of(2, "startup");
    let lineitem = common::stored(&root, "lineitem");
    let (slice, nodes) = &lineitem.slices[0];
    let node = nodes[0];
    let path = lineitem.path(&root, node, *slice);
    let file = path.file_name().unwrap().to_string_lossy().into_owned();
    let length = std::fs::metadata(&path).unwrap().len();
    File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(length / 2)
        .unwrap();
    let cluster = EmbeddedCluster::start(&root, NODES)
        .await
        .expect("a node starts without the file it cannot read");
    let unreadable = reported(&cluster, "unreadable_slices").await;
    assert_eq!(unreadable.len(), 1, "{unreadable:?}");
    assert!(
        unreadable[0].contains(&format!("node-{node}/{}/{file}", lineitem.name)),
        "{unreadable:?}"
    );
    // The other copy of that slice and every other slice are served.
    let session = cluster.session().await.unwrap();
    for (name, sql) in queries() {
        let expected = rows_as_text(&run(&reference, sql).await.unwrap(), true).unwrap();
        let actual = run(&session.context, sql)
            .await
            .unwrap_or_else(|error| panic!("{name}: {error}"));
        assert_eq!(rows_as_text(&actual, true).unwrap(), expected, "{name}");
    }
    let _ = std::fs::remove_dir_all(&root);
}
