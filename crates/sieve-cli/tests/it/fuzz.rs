//! The differential fuzzer's CI budget: a fixed seed, six schemas of fifty
//! queries, each run through Sieve in every mode and compared with plain
//! DataFusion over the same files. Any mismatch fails the test and prints
//! its reproduction. Longer runs: `sieve fuzz` (see README, "Differential
//! fuzzing").

use std::path::PathBuf;

use sieve_cli::fuzz::{run_fuzz, FuzzOptions, Mode};

/// The seed of the CI run: fixed, so that a failure reproduces.
const SEED: u64 = 20_261_124;

/// Schemas of the CI run.
const SCHEMAS: usize = 6;

/// Queries per schema of the CI run: 300 queries, 2,700 comparisons (nine modes), in
/// well under three minutes in a debug build on two cores.
const QUERIES_PER_SCHEMA: usize = 50;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sieve_agrees_with_plain_datafusion_on_random_queries() {
    let data = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fuzz");
    std::fs::create_dir_all(&data).expect("data directory");
    let options = FuzzOptions {
        data_directory: Some(data),
        ..FuzzOptions::new(SEED, SCHEMAS, QUERIES_PER_SCHEMA)
    };
    let report = run_fuzz(&options).await.expect("the fuzzer runs");
    println!("{}", report.summary());
    // The generator is only useful if nearly every query it writes plans.
    assert!(
        report.reference_plan_failures * 20 <= report.queries,
        "more than 5% of the generated queries fail to plan in plain DataFusion:\n{}",
        report.summary()
    );
    // Both ways data enters a node are fuzzed: the write path and slice
    // files placed by hand.
    let (through_catalog, schemas) = report.schemas_through_catalog;
    assert!(
        through_catalog > 0 && through_catalog < schemas,
        "{through_catalog} of {schemas} schemas through the write path"
    );
    // The comparisons check star joins on the storage nodes (the star
    // aggregates the generator writes, in the default mode and in the
    // star-joins mode, which pushes more of them).
    let star_joins = |mode: Mode| {
        report
            .plan_features
            .get("star join")
            .and_then(|modes| modes.get(&mode))
            .copied()
            .unwrap_or(0)
    };
    assert!(
        star_joins(Mode::Default) > 0 && star_joins(Mode::StarJoins) >= star_joins(Mode::Default),
        "no star join was compared:\n{}",
        report.summary()
    );
    // Scans read the tables' sorted copies (the schemas loaded through
    // the write path keep one per table).
    let copies: usize = report
        .plan_features
        .get("sorted copy")
        .map_or(0, |modes| modes.values().sum());
    assert!(
        copies > 0,
        "no scan read a sorted copy:\n{}",
        report.summary()
    );
    // Joins over more partitions than the plan's, merged back, were
    // compared (the wide-joins mode widens every partitioned join).
    let wide = report
        .plan_features
        .get("wide join")
        .and_then(|modes| modes.get(&Mode::WideJoins))
        .copied()
        .unwrap_or(0);
    assert!(wide > 0, "no wide join was compared:\n{}", report.summary());
    // Joins on keys other than integers (floats with NaN and both zeros,
    // texts, dates, decimals) were compared.
    let integer = |types: &str| {
        types
            .split('/')
            .all(|key_type| key_type.starts_with("Int") || key_type.starts_with("UInt"))
    };
    assert!(
        report
            .schemas_by_key_types
            .keys()
            .any(|types| !integer(types)),
        "no schema joined on keys other than integers:\n{}",
        report.summary()
    );
    let reproductions: Vec<String> = report.mismatches.iter().map(ToString::to_string).collect();
    assert!(
        report.mismatches.is_empty(),
        "{} mismatch(es):\n{}\n{}",
        report.mismatches.len(),
        reproductions.join("\n"),
        report.summary()
    );
}
