//! `sieve streams` at a small scale: concurrent streams against two pool
//! sizes and a node killed halfway, every answer checked against NDP off.

use std::path::PathBuf;

use sieve_cli::bench::streams::{format_streams, run_streams, StreamsOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_with_a_pool_of_none_are_all_raw_and_a_killed_node_is_failed_over() {
    let options = StreamsOptions {
        scale_factor: 0.01,
        nodes: 3,
        replicas: 2,
        streams: 2,
        pools: vec![2, 0],
        kill: true,
        data_directory: PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("streams"),
        settings: vec![],
    };
    let reports = run_streams(&options).await.expect("every answer right");
    eprintln!("{}", format_streams(&options, &reports));
    assert_eq!(reports.len(), 3);
    for report in &reports {
        assert_eq!(report.queries, 2 * 22);
        assert!(report.slices > 0);
    }
    assert_eq!(
        reports[1].slices_raw, reports[1].slices,
        "no workers: all raw"
    );
    let killed = &reports[2];
    assert!(
        killed.failovers > 0,
        "the killed node's requests failed over"
    );
    assert!(killed.detection.is_some() && killed.failover_max.is_some());
}
