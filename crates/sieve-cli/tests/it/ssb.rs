//! The Star Schema Benchmark: `sieve gen ssb`'s tables through the write
//! path, and its 13 queries in every mode (NDP on, NDP off, every slice
//! served raw) against plain DataFusion over the same slice files.

use std::path::PathBuf;

use sieve_cli::cluster::{generated, EmbeddedCluster};
use sieve_cli::compare::{reference_context_for, rows_as_text, run};
use sieve_cli::queries::{is_ordered, SSB_QUERIES};
use sieve_format::{Benchmark, SliceLayout};

use crate::common::NODES;

/// SF 0.1: 600,000 line orders, 3,000 customers, 200 suppliers (fewer
/// leave Q3.3's two British cities without a supplier).
const SCALE_FACTOR: f64 = 0.1;

fn test_data() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "ssb-sf{SCALE_FACTOR}-slices50000-v{}",
        sieve_format::FORMAT_VERSION
    ));
    let layout = SliceLayout {
        slice_rows_max: 50_000,
        row_group_rows_max: 8_192,
        ..SliceLayout::default()
    };
    generated(Benchmark::Ssb, &root, SCALE_FACTOR, NODES, 1, &layout).expect("load SSB")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ssb_queries_match_plain_datafusion_in_every_mode() {
    let root = test_data();
    let names: Vec<&str> = Benchmark::Ssb
        .tables()
        .iter()
        .map(|table| table.name)
        .collect();
    let reference = reference_context_for(&root, NODES, &names)
        .await
        .expect("reference context");
    let cluster = EmbeddedCluster::start(&root, NODES).await.expect("nodes");
    let session = cluster.session().await.expect("session");
    let raw_cluster = EmbeddedCluster::start_raw(&root, NODES)
        .await
        .expect("raw nodes");
    let raw_session = raw_cluster.session().await.expect("raw session");
    let mut empty = Vec::new();
    for (name, sql) in SSB_QUERIES {
        let sort = !is_ordered(sql);
        let expected = rows_as_text(&run(&reference, sql).await.expect(name), sort).unwrap();
        if expected.is_empty() {
            empty.push(name);
        }
        for (mode, session, ndp) in [
            ("ndp", &session, true),
            ("off", &session, false),
            ("raw", &raw_session, true),
        ] {
            session.set_ndp(ndp).unwrap();
            let batches = run(&session.context, sql)
                .await
                .unwrap_or_else(|error| panic!("{name} ({mode}): {error}"));
            assert_eq!(
                rows_as_text(&batches, sort).unwrap(),
                expected,
                "{name} ({mode}) differs from plain DataFusion"
            );
        }
    }
    // Every query but Q3.4 selects rows at this scale, so each comparison
    // checks something. Q3.4 keeps 1 line order in about 1.3 million
    // (two cities of 250 on each side, one month of 84): none of 600,000.
    assert_eq!(empty, ["q3.4"], "queries with no rows");
    let (raw, served) = raw_cluster.slices_raw_and_served();
    assert!(served > 0 && raw == served, "{raw} of {served} slices raw");
}
