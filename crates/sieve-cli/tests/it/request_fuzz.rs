//! The malformed-request fuzzer's CI budget: a fixed seed, 600 hostile
//! requests against one embedded storage node, every answer a clean one and
//! the health fragment's rows unchanged. Any failure fails the test and
//! prints its reproduction. Longer runs: `sieve fuzz-requests` (README,
//! "Differential fuzzing").

use std::path::PathBuf;

use sieve_cli::fuzz::{run_request_fuzz, RequestFuzzOptions};

/// The seed of the CI run: fixed, so that a failure reproduces.
const SEED: u64 = 20_261_124;

/// Requests of the CI run, 120 per family: under a minute in a debug build
/// on two cores once the node refuses the slow requests quickly (a deep
/// request costs about 0.45 s in debug, the others under 0.2 s).
const REQUESTS: usize = 600;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_request_breaks_a_storage_node() {
    let data = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("request-fuzz");
    let options = RequestFuzzOptions {
        // If a request overflows a stack the process aborts: the last line
        // of this file names it.
        journal: Some(data.join("journal.txt")),
        ..RequestFuzzOptions::new(SEED, REQUESTS, data.clone())
    };
    std::fs::create_dir_all(&data).expect("data directory");
    let report = run_request_fuzz(&options).await.expect("the fuzzer runs");
    println!("{}", report.summary());
    assert_eq!(report.requests, REQUESTS);
    assert_eq!(report.failures, 0, "{}", report.summary());
}
