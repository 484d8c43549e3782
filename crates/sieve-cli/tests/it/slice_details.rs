//! Slice metadata within a bound (issue 20): a storage node keeps its
//! slices' footers, page indexes and checksums in a cache bounded in bytes
//! and reads an evicted slice's again from its file. With a cache that
//! keeps nothing every request reads its slice's footer, and the answers
//! are still plain DataFusion's, through pushdown and through pages served
//! as stored.

use sieve_cli::cluster::EmbeddedCluster;
use sieve_cli::compare::{reference_context, rows_as_text, run};
use sieve_cli::queries::{is_ordered, TPCH_QUERIES};
use sieve_storage::ExecuteOptions;

use crate::common;

use common::NODES;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_that_keep_no_slice_metadata_answer_as_plain_datafusion() {
    let root = common::small_slices(1);
    let reference = reference_context(&root, NODES).await.unwrap();
    // Pushdown (the fragment on the node) and every slice served raw.
    for workers in [ExecuteOptions::default().pushdown_workers, 0] {
        let execute = ExecuteOptions {
            slice_details_cache_bytes: 0,
            pushdown_workers: workers,
            ..ExecuteOptions::default()
        };
        let cluster = EmbeddedCluster::start_with(&root, NODES, execute)
            .await
            .unwrap();
        let session = cluster.session().await.unwrap();
        let loaded_at_start = common::node_stats_sum(&cluster, "slice_details_loads").await;
        assert!(loaded_at_start > 0);
        for (name, sql) in TPCH_QUERIES {
            if workers == 0 && !matches!(name, "q1" | "q3" | "q6" | "q9" | "q18") {
                continue;
            }
            let expected =
                rows_as_text(&run(&reference, sql).await.unwrap(), !is_ordered(sql)).unwrap();
            let actual = run(&session.context, sql)
                .await
                .unwrap_or_else(|error| panic!("{name} (workers {workers}): {error}"));
            assert_eq!(
                rows_as_text(&actual, !is_ordered(sql)).unwrap(),
                expected,
                "{name} (workers {workers})"
            );
        }
        // Nothing kept, so every slice request read its footer again.
        assert_eq!(
            common::node_stats_sum(&cluster, "slice_details_bytes").await,
            0
        );
        assert_eq!(common::node_stats_sum(&cluster, "corrupt_slices").await, 0);
        let (raw, served) = cluster.slices_raw_and_served();
        let reloaded =
            common::node_stats_sum(&cluster, "slice_details_loads").await - loaded_at_start;
        assert!(
            reloaded >= raw.max(served) && reloaded > 0,
            "workers {workers}: {reloaded} reloads for {raw} raw and {served} served slices"
        );
    }
}
