//! Wrong answers the differential fuzzer (`sieve fuzz`) found, each kept as
//! a test against plain DataFusion over the same files, in every mode.

use std::path::PathBuf;
use std::sync::Arc;

use arrow::array::{ArrayRef, Float32Array, Float64Array, Int64Array};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use sieve_cli::cluster::EmbeddedCluster;
use sieve_cli::compare::{reference_context_for, rows_as_text, run};
use sieve_format::{node_directory, slice_path, write_slice, SliceLayout};

const NODES: usize = 2;

/// Floats whose NaNs sit in some pages and row groups only: Parquet leaves
/// NaN out of min/max statistics, so pruning on them dropped NaN rows that
/// `x = 'NaN'` and `x > 100` keep (fuzzer seed 2, schema 0:
/// `WHERE c4_f64 = CAST('NaN' AS DOUBLE)` counted 0 of 21 NaN rows with NDP
/// on and off).
fn nan_data() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("fuzz-regressions-nan-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("x", DataType::Float64, true),
        Field::new("y", DataType::Float32, true),
    ]));
    let layout = SliceLayout {
        row_group_rows_max: 256,
        data_page_rows_max: 64,
        ..SliceLayout::default()
    };
    for part in 0..2 {
        let rows = 1000;
        let ids: Vec<i64> = (0..rows).map(|i| (part * rows + i) as i64).collect();
        let x: Vec<Option<f64>> = (0..rows)
            .map(|i| match i {
                i if i % 97 == 5 => Some(f64::NAN),
                i if i % 13 == 0 => None,
                500 => Some(-0.0),
                i => Some((i % 50) as f64),
            })
            .collect();
        let y: Vec<Option<f32>> = (0..rows)
            .map(|i| (i % 211 != 3).then_some((i % 7) as f32).or(Some(f32::NAN)))
            .collect();
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from(ids)) as ArrayRef,
                Arc::new(Float64Array::from(x)),
                Arc::new(Float32Array::from(y)),
            ],
        )
        .unwrap();
        let path = slice_path(&node_directory(&root, part % NODES), "f", part);
        write_slice(&path, &schema, &layout, [Ok(batch)]).unwrap();
    }
    root
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn float_predicates_keep_nan_rows_that_statistics_leave_out() {
    let root = nan_data();
    let reference = reference_context_for(&root, NODES, &["f"]).await.unwrap();
    let processed = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let raw = EmbeddedCluster::start_raw(&root, NODES).await.unwrap();
    let queries = [
        "SELECT count(*) FROM f WHERE x = CAST('NaN' AS DOUBLE)",
        "SELECT count(*) FROM f WHERE x > 100",
        "SELECT count(*) FROM f WHERE x >= 49 AND id > 10",
        "SELECT id FROM f WHERE y > 6.5 OR x = CAST('NaN' AS DOUBLE)",
        "SELECT count(*) FROM f WHERE x <> 3",
        "SELECT count(*), min(id) FROM f WHERE x = 0",
        "SELECT id, x FROM f ORDER BY x DESC NULLS LAST, id LIMIT 3",
    ];
    let nan_rows = run(&reference, "SELECT count(*) FROM f WHERE isnan(x)")
        .await
        .unwrap();
    let first = rows_as_text(&run(&reference, queries[0]).await.unwrap(), false).unwrap();
    assert_eq!(
        first,
        rows_as_text(&nan_rows, false).unwrap(),
        "the reference counts every NaN"
    );
    for (cluster, mode) in [(&processed, "processed"), (&raw, "raw")] {
        let session = cluster.session().await.unwrap();
        for ndp in [true, false] {
            session.set_ndp(ndp).unwrap();
            for sql in queries {
                let expected = rows_as_text(&run(&reference, sql).await.unwrap(), true).unwrap();
                let actual =
                    rows_as_text(&run(&session.context, sql).await.unwrap(), true).unwrap();
                assert_eq!(actual, expected, "{mode}, ndp {ndp}: {sql}");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// A filter over both sides of an outer join whose tables share a column
/// name: DataFusion 55's physical filter pushdown mapped `a.s` to `b.s`
/// through a projection and pushed `b.s < concat(b.s, 'ó')` below the join
/// (fuzzer seed 1, schema 12, query 58: plain DataFusion and NDP off
/// returned 53 rows where 41 are right). Sessions and the reference run
/// without that pass; the answer is checked against the same count without
/// the join.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filter_over_both_sides_of_a_self_join_stays_above_it() {
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("fuzz-regressions-self-join-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("k", DataType::Int64, true),
        Field::new("s", DataType::Utf8, true),
    ]));
    let words = ["a", "óx", "日本語", "ó", "żółw", "zz", ""];
    let rows = 300;
    let batch = RecordBatch::try_new(
        Arc::clone(&schema),
        vec![
            Arc::new(Int64Array::from_iter_values(0..rows)) as ArrayRef,
            Arc::new(Int64Array::from(vec![None::<i64>; rows as usize])),
            Arc::new(arrow::array::StringArray::from_iter(
                (0..rows).map(|i| (i % 5 != 0).then(|| words[i as usize % words.len()])),
            )),
        ],
    )
    .unwrap();
    let path = slice_path(&node_directory(&root, 0), "t", 0);
    write_slice(&path, &schema, &SliceLayout::default(), [Ok(batch)]).unwrap();
    let reference = reference_context_for(&root, 1, &["t"]).await.unwrap();
    let cluster = EmbeddedCluster::start(&root, 1).await.unwrap();
    let session = cluster.session().await.unwrap();
    // `a` never matches (NULL keys), so `concat(a.s, 'ó')` is 'ó'.
    let joined = "SELECT count(*) FROM t AS a RIGHT JOIN t AS b ON a.k = b.k \
                  WHERE b.s < concat(a.s, 'ó') AND b.id >= 0";
    let alone = "SELECT count(*) FROM t WHERE s < 'ó'";
    let expected = rows_as_text(&run(&reference, alone).await.unwrap(), false).unwrap();
    assert_ne!(expected, ["0"]);
    let plain = rows_as_text(&run(&reference, joined).await.unwrap(), false).unwrap();
    assert_eq!(plain, expected, "the reference");
    for ndp in [true, false] {
        session.set_ndp(ndp).unwrap();
        let actual = rows_as_text(&run(&session.context, joined).await.unwrap(), false).unwrap();
        assert_eq!(actual, expected, "ndp {ndp}");
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// A table loaded through the write path with no rows has no slice; the
/// reference must still see it, empty, rather than fail the whole run
/// (fuzzer seed 20261127, schema 2: tables of 1,682, 0, 64 and 655 rows;
/// the run stopped with "No partitions provided").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_without_rows_is_compared_empty() {
    use sieve_cli::fuzz::{run_fuzz, FuzzOptions, Mode};
    let data = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fuzz-empty-table");
    std::fs::create_dir_all(&data).expect("data directory");
    let options = FuzzOptions {
        data_directory: Some(data),
        modes: vec![Mode::Default, Mode::NdpOff],
        only_schema: Some(2),
        progress: false,
        ..FuzzOptions::new(20_261_127, 3, 25)
    };
    let report = run_fuzz(&options).await.expect("the fuzzer runs");
    assert!(report.queries > 0, "{}", report.summary());
    assert_no_mismatch(&report);
}

/// Fails with every mismatch's reproduction if the run had any.
fn assert_no_mismatch(report: &sieve_cli::fuzz::FuzzReport) {
    let reproductions: Vec<String> = report.mismatches.iter().map(ToString::to_string).collect();
    assert!(reproductions.is_empty(), "{}", reproductions.join("\n"));
}

/// A partitioned join whose partition nothing polls (the join above it got
/// an empty build side in that partition, so it never read its probe side)
/// left the join's other partitions waiting forever for that partition's
/// report to DataFusion's dynamic filter: `SpillableHashJoinExec` started
/// DataFusion's join only when first polled. Every partitioned join is
/// wrapped, so any query with such a chain hung once joins were
/// partitioned (fuzzer seed 20261127, schema 8 query 74 and schema 10
/// query 99, in the spilled-joins mode: a self-join chain whose build keys
/// all hash to one partition, or are all NULL). Each took the fuzzer's
/// 60-second bound before the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_partition_nothing_polls_does_not_hold_the_others() {
    use sieve_cli::fuzz::{run_fuzz, FuzzOptions, Mode};
    for (schema, query) in [(8, 74), (10, 99)] {
        let data = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("fuzz-unpolled-join-partition-{schema}"));
        std::fs::create_dir_all(&data).expect("data directory");
        let options = FuzzOptions {
            data_directory: Some(data),
            modes: vec![Mode::SpilledJoins, Mode::Default],
            only_schema: Some(schema),
            only_query: Some(query),
            progress: false,
            // The default mode with partitioned joins hung as well.
            settings: vec![
                "datafusion.optimizer.hash_join_single_partition_threshold=0".into(),
                "datafusion.optimizer.hash_join_single_partition_threshold_rows=0".into(),
            ],
            ..FuzzOptions::new(20_261_127, schema + 1, query + 1)
        };
        let started = std::time::Instant::now();
        let report = run_fuzz(&options).await.expect("the fuzzer runs");
        assert_eq!(report.comparisons, 2, "{}", report.summary());
        assert_no_mismatch(&report);
        // Not a timing test: a hang shows as the fuzzer's 60 s bound (a
        // mismatch above); this names what else would have been waited for.
        println!("schema {schema} query {query}: {:?}", started.elapsed());
    }
}

/// NDP off (stock DataFusion's Parquet scan) given the dynamic filter of a
/// semi join on a float key lost the probe row of -0.0 against the build
/// key 0.0, which the join matches (fuzzer seed 20261128, schema 2 query
/// 80, the first seed with float join keys: plain DataFusion 1 row, NDP
/// off 0). Filters from above over float columns now stop above that scan
/// (`FloatFilterGuardExec`). The run also compares the default mode. The
/// loss depends on the join's build side completing before the scan
/// opens its file, as it did in a release build; a debug build was seen
/// to open it first, and then passes without the guard too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_float_key_join_filter_keeps_the_other_zero_with_ndp_off() {
    use sieve_cli::fuzz::{run_fuzz, FuzzOptions, Mode};
    let data = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fuzz-float-zero-ndp-off");
    std::fs::create_dir_all(&data).expect("data directory");
    let options = FuzzOptions {
        data_directory: Some(data),
        modes: vec![Mode::NdpOff, Mode::Default],
        only_schema: Some(2),
        only_query: Some(80),
        progress: false,
        ..FuzzOptions::new(20_261_128, 3, 81)
    };
    let report = run_fuzz(&options).await.expect("the fuzzer runs");
    assert_eq!(report.comparisons, 2, "{}", report.summary());
    assert_no_mismatch(&report);
}

/// A join's dynamic filter on the second of two columns of one name (a
/// self-join's `pkey`, through the projection of the join below) was pushed
/// by DataFusion onto the first one's table, and applied there by the
/// storage nodes: every row dropped (fuzzer seed 20261128, schema 12 query
/// 24: `a JOIN t0 b ON a.k2 IS NOT DISTINCT FROM b.fkey JOIN t0 c ON b.pkey
/// = c.pkey`, count 0 against 1,046 with partitioned joins). Sieve now
/// drops a join filter that landed on a column its probe key does not come
/// from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_filter_pushed_onto_a_namesake_column_is_dropped() {
    use sieve_cli::fuzz::{run_fuzz, FuzzOptions, Mode};
    let data = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fuzz-namesake-join-filter");
    std::fs::create_dir_all(&data).expect("data directory");
    let options = FuzzOptions {
        data_directory: Some(data),
        modes: vec![Mode::SpilledJoins, Mode::Default],
        only_schema: Some(12),
        only_query: Some(24),
        progress: false,
        settings: vec![
            "datafusion.optimizer.hash_join_single_partition_threshold=0".into(),
            "datafusion.optimizer.hash_join_single_partition_threshold_rows=0".into(),
        ],
        ..FuzzOptions::new(20_261_128, 13, 25)
    };
    let report = run_fuzz(&options).await.expect("the fuzzer runs");
    assert_eq!(report.comparisons, 2, "{}", report.summary());
    assert_no_mismatch(&report);
}

/// DataFusion 55 gives `b IS TRUE` (never NULL) a nullable physical field
/// and then refused its own plan of a DISTINCT, UNION or EXCEPT over such a
/// column ("Internal error: Physical input schema should be the same as
/// the one converted from logical input schema"): 56 of 32,000 fuzz
/// comparisons (seed 20261130) failed so in both engines. Sieve's sessions
/// and the reference skip that check (DataFusion's own setting for such
/// planner bugs); the answers here are computed in Rust.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distinct_over_a_never_null_boolean_expression_plans() {
    use arrow::array::BooleanArray;
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("fuzz-regressions-is-true-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    for node in 0..crate::common::NODES {
        std::fs::create_dir_all(node_directory(&root, node)).unwrap();
    }
    let b = |id: i64| match id % 3 {
        0 => Some(true),
        1 => None,
        _ => Some(false),
    };
    crate::common::write_replicated_table(&root, "t", 2, |part| {
        let ids: Vec<i64> = (part as i64 * 50..part as i64 * 50 + 50).collect();
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("b", DataType::Boolean, true),
        ]));
        let columns: Vec<ArrayRef> = vec![
            Arc::new(Int64Array::from(ids.clone())),
            Arc::new(BooleanArray::from(
                ids.iter().map(|&id| b(id)).collect::<Vec<_>>(),
            )),
        ];
        RecordBatch::try_new(schema, columns).unwrap()
    });
    let cluster = EmbeddedCluster::start(&root, crate::common::NODES)
        .await
        .unwrap();
    // (b IS TRUE) over ids 0..100: true for a third of them.
    let cases = [
        (
            "SELECT DISTINCT (b IS TRUE) AS v FROM t ORDER BY 1",
            vec!["false", "true"],
        ),
        (
            "SELECT (b IS TRUE) AS v FROM t UNION SELECT (b IS TRUE) FROM t WHERE id < 3 ORDER BY 1",
            vec!["false", "true"],
        ),
        (
            "SELECT (b IS TRUE) AS v, id % 2 AS p FROM t EXCEPT \
             SELECT (b IS TRUE), id % 2 FROM t WHERE id % 3 = 0 ORDER BY 1, 2",
            vec!["false | 0", "false | 1"],
        ),
        (
            "SELECT DISTINCT CASE WHEN id = 7 THEN id ELSE 4 END AS v FROM t ORDER BY 1",
            vec!["4", "7"],
        ),
    ];
    for ndp in [true, false] {
        let session = cluster.session().await.unwrap();
        session.set_ndp(ndp).unwrap();
        for (sql, expected) in &cases {
            let rows = run(&session.context, sql)
                .await
                .unwrap_or_else(|error| panic!("NDP {ndp}: {sql}: {error}"));
            assert_eq!(
                &rows_as_text(&rows, false).unwrap(),
                expected,
                "NDP {ndp}: {sql}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// With sort-merge joins (`datafusion.optimizer.prefer_hash_join = false`)
/// DataFusion 55 pushed a projection into a join's inputs without the
/// columns its filter reads (`ON a.k1 = b.k1 AND a.id <> b.id`): the count
/// was 0 where plain DataFusion's hash join counts 2,324 (fuzzer seed
/// 20261132, schema 10 query 90, NDP on and off; the same with DataFusion
/// alone). Sieve keeps projections above such a join
/// (`GuardMergeJoinFilters`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sort_merge_join_keeps_the_columns_its_filter_reads() {
    use sieve_cli::fuzz::{run_fuzz, FuzzOptions, Mode};
    let data = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fuzz-merge-join-filter");
    std::fs::create_dir_all(&data).expect("data directory");
    let options = FuzzOptions {
        data_directory: Some(data),
        modes: vec![Mode::Default, Mode::NdpOff],
        only_schema: Some(10),
        only_query: Some(90),
        progress: false,
        settings: vec![
            "datafusion.optimizer.prefer_hash_join=false".into(),
            "sieve.star_join_pushdown=false".into(),
        ],
        ..FuzzOptions::new(20_261_132, 11, 91)
    };
    let report = run_fuzz(&options).await.expect("the fuzzer runs");
    assert_eq!(report.comparisons, 2, "{}", report.summary());
    assert_no_mismatch(&report);
}

/// `sieve fuzz --seed 20261132 --schemas 1 --queries-per-schema 95
/// --schema 0 --query 94 --set datafusion.optimizer.prefer_hash_join=false
/// --set sieve.star_join_pushdown=false`: `a LEFT JOIN b ON a.pkey = b.fkey
/// AND a.id <> b.id` as a sort-merge join failed with "Column 'id' is
/// declared as non-nullable but contains null values" (DataFusion 55
/// evaluates the filter over the NULL-padded rows in a batch of the
/// filter's schema, which keeps `b.id` non-nullable).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outer_sort_merge_join_filters_rows_padded_with_nulls() {
    use sieve_cli::fuzz::{run_fuzz, FuzzOptions, Mode};
    let data = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fuzz-merge-join-nulls");
    std::fs::create_dir_all(&data).expect("data directory");
    let options = FuzzOptions {
        data_directory: Some(data),
        modes: vec![Mode::Default, Mode::NdpOff],
        only_schema: Some(0),
        only_query: Some(94),
        progress: false,
        settings: vec![
            "datafusion.optimizer.prefer_hash_join=false".into(),
            "sieve.star_join_pushdown=false".into(),
        ],
        ..FuzzOptions::new(20_261_132, 1, 95)
    };
    let report = run_fuzz(&options).await.expect("the fuzzer runs");
    assert_eq!(report.comparisons, 2, "{}", report.summary());
    assert_no_mismatch(&report);
}

/// `sieve fuzz --seed 20261501 --schemas 6 --queries-per-schema 76
/// --schema 5 --query 75 --modes spilled-joins`: `SELECT b.name, b.k2,
/// count(a.c4_u64), min(a.c0_i64) FROM t1 a RIGHT JOIN t0 b ON a.id = b.id
/// GROUP BY b.name, b.k2`, grouped by `b.id` first (`GroupByTableKey`) and
/// that aggregation run by key value (`DenseAggregateExec`), gave
/// 9223372036854775807 as the `min` of ten groups whose values are all
/// NULL: DataFusion's accumulators, given group indexes by key value, took
/// keys no row had yet as holding a value. The first query of the fuzzer's
/// keyed-group shape to find a bug.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_first_met_with_only_null_values_aggregates_to_null_by_key_value() {
    use sieve_cli::fuzz::{run_fuzz, FuzzOptions, Mode};
    let data = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fuzz-dense-null-values");
    std::fs::create_dir_all(&data).expect("data directory");
    let options = FuzzOptions {
        data_directory: Some(data),
        modes: vec![Mode::SpilledJoins, Mode::Default],
        only_schema: Some(5),
        only_query: Some(75),
        progress: false,
        ..FuzzOptions::new(20_261_501, 6, 76)
    };
    let report = run_fuzz(&options).await.expect("the fuzzer runs");
    assert_eq!(report.comparisons, 2, "{}", report.summary());
    assert_no_mismatch(&report);
}
