//! Joins over keys that hold NULLs (issue 15): `IS NOT DISTINCT FROM` joins,
//! INTERSECT and EXCEPT, NOT IN and NOT EXISTS with NULLs on either side,
//! outer, semi and anti joins with residual filters, and a recursive CTE over
//! a join. Every query runs through Sieve with the defaults (join filters
//! on) and over raw slices, and is compared with plain DataFusion over the
//! same files. A join filter may drop only rows the join cannot use; before
//! issue 15 the NULL probe rows of a null-equal join were dropped on the
//! storage nodes.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{ArrayRef, Int32Array, Int64Array, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow::record_batch::RecordBatch;
use datafusion::prelude::SessionContext;
use sieve_cli::cluster::EmbeddedCluster;
use sieve_cli::compare::{reference_context_for, rows_as_text, run};
use sieve_compute::{SieveSession, GRACE_FAN_OUT};
use sieve_format::node_directory;

const NODES: usize = 3;

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("k", DataType::Int64, true),
        Field::new("k2", DataType::Int32, true),
        Field::new("s", DataType::Utf8, true),
        Field::new("v", DataType::Int64, true),
    ]))
}

/// Rows `start..start + rows` of a table whose `k` is NULL every `null_every`
/// rows and otherwise `i * stride % modulo`.
fn batch(
    start: usize,
    rows: usize,
    null_every: usize,
    stride: usize,
    modulo: usize,
) -> RecordBatch {
    let ids: Vec<i64> = (start..start + rows).map(|i| i as i64).collect();
    let k: Vec<Option<i64>> = (start..start + rows)
        .map(|i| (i % null_every != 0).then_some((i * stride % modulo) as i64))
        .collect();
    let k2: Vec<Option<i32>> = (start..start + rows)
        .map(|i| (i % 3 != 0).then_some((i % 4) as i32))
        .collect();
    let s: Vec<Option<String>> = (start..start + rows)
        .map(|i| (i % 9 != 0).then(|| format!("s{}", i * stride % modulo % 13)))
        .collect();
    let v: Vec<Option<i64>> = (start..start + rows)
        .map(|i| (i % 11 != 0).then_some((i % 100) as i64))
        .collect();
    RecordBatch::try_new(
        schema(),
        vec![
            Arc::new(Int64Array::from(ids)) as ArrayRef,
            Arc::new(Int64Array::from(k)),
            Arc::new(Int32Array::from(k2)),
            Arc::new(StringArray::from(s)),
            Arc::new(Int64Array::from(v)),
        ],
    )
    .unwrap()
}

/// `name` as `slices` slices of `rows` rows, each on two nodes.
fn write_table(root: &Path, name: &str, slices: usize, rows: usize, shape: (usize, usize, usize)) {
    let (null_every, stride, modulo) = shape;
    crate::common::write_replicated_table(root, name, slices, |part| {
        batch(part * rows, rows, null_every, stride, modulo)
    });
}

fn data() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("null-joins-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    for node in 0..NODES {
        std::fs::create_dir_all(node_directory(&root, node)).unwrap();
    }
    // `a`: many rows, a NULL key every 7th row, keys 0..97.
    write_table(&root, "a", 3, 2000, (7, 1, 97));
    // `b`: fewer rows, a NULL key every 5th, keys spread over 0..131.
    write_table(&root, "b", 2, 1000, (5, 3, 131));
    // `c`: no NULL keys at all (null_every larger than the table).
    write_table(&root, "c", 1, 500, (100_000, 7, 61));
    root
}

/// Queries whose result must not depend on where the work ran.
const QUERIES: &[&str] = &[
    // Null-equal joins (the issue's own query, and variants).
    "SELECT count(*) FROM (SELECT k FROM a WHERE k IS NULL OR k = 1) x JOIN b ON x.k IS NOT DISTINCT FROM b.k",
    "SELECT count(*) FROM b JOIN (SELECT k FROM a WHERE k IS NULL OR k = 1) x ON x.k IS NOT DISTINCT FROM b.k",
    "SELECT count(*) FROM (SELECT k, k2 FROM b WHERE v < 20) x JOIN a ON (a.k IS NOT DISTINCT FROM x.k) AND (a.k2 IS NOT DISTINCT FROM x.k2)",
    "SELECT count(*), count(a.k) FROM (SELECT k FROM b WHERE v < 5) x JOIN a ON a.k IS NOT DISTINCT FROM x.k",
    "SELECT count(*) FROM (SELECT s FROM b WHERE v < 10) x JOIN a ON a.s IS NOT DISTINCT FROM x.s",
    // Set operations: NULL equals NULL there too.
    "SELECT k FROM a WHERE k IS NULL OR k = 1 INTERSECT SELECT k FROM b",
    "SELECT k FROM a WHERE k IS NULL OR k < 10 EXCEPT SELECT k FROM b WHERE v < 50",
    "SELECT k FROM b EXCEPT SELECT k FROM a WHERE k IS NULL OR k = 3",
    "SELECT k, k2 FROM a INTERSECT SELECT k, k2 FROM b",
    "SELECT k FROM c INTERSECT SELECT k FROM b",
    "SELECT k FROM c EXCEPT SELECT k FROM b",
    "SELECT count(*) FROM (SELECT k FROM a INTERSECT ALL SELECT k FROM b) t",
    "SELECT count(*) FROM (SELECT k FROM a EXCEPT ALL SELECT k FROM b) t",
    // NOT IN: a NULL in the subquery empties it; a NULL probe key never passes.
    "SELECT count(*) FROM a WHERE k NOT IN (SELECT k FROM b WHERE v < 30)",
    "SELECT count(*) FROM a WHERE k NOT IN (SELECT k FROM b WHERE k IS NOT NULL AND v < 30)",
    "SELECT count(*) FROM a WHERE k NOT IN (SELECT k FROM c WHERE v < 30)",
    "SELECT count(*) FROM c WHERE k NOT IN (SELECT k FROM a WHERE v < 3)",
    "SELECT count(*) FROM c WHERE k NOT IN (SELECT k FROM a WHERE k IS NOT NULL AND v < 3)",
    // NOT EXISTS and EXISTS, NULLs on either side.
    "SELECT count(*) FROM a WHERE NOT EXISTS (SELECT 1 FROM b WHERE b.k = a.k AND b.v < 40)",
    "SELECT count(*) FROM b WHERE NOT EXISTS (SELECT 1 FROM a WHERE a.k = b.k AND a.v < 2)",
    "SELECT count(*) FROM a WHERE EXISTS (SELECT 1 FROM b WHERE b.k = a.k AND b.v < 40)",
    "SELECT count(*) FROM a WHERE k IN (SELECT k FROM b WHERE v < 7)",
    // Mark joins: a subquery under OR.
    "SELECT count(*) FROM a WHERE EXISTS (SELECT 1 FROM b WHERE b.k = a.k AND b.v < 10) OR a.v < 5",
    "SELECT count(*) FROM a WHERE a.k IN (SELECT k FROM b WHERE v < 10) OR a.v < 5",
    "SELECT count(*) FROM a WHERE a.k NOT IN (SELECT k FROM b WHERE v < 10) OR a.v < 5",
    "SELECT count(*) FROM b WHERE NOT EXISTS (SELECT 1 FROM a WHERE a.k = b.k AND a.v < 3) OR b.k IS NULL",
    // Outer joins with NULL keys on both sides, and a residual filter.
    "SELECT count(*), count(a.id), count(x.id) FROM a LEFT JOIN (SELECT * FROM b WHERE v < 10) x ON a.k = x.k",
    "SELECT count(*), count(a.id), count(x.id) FROM a RIGHT JOIN (SELECT * FROM b WHERE v < 10) x ON a.k = x.k",
    "SELECT count(*), count(a.id), count(x.id) FROM a FULL JOIN (SELECT * FROM b WHERE v < 10) x ON a.k = x.k",
    "SELECT count(*) FROM a JOIN (SELECT * FROM b WHERE v < 10) x ON a.k = x.k AND a.v < x.v",
    "SELECT count(*), count(x.id) FROM a LEFT JOIN (SELECT * FROM b WHERE v < 10) x ON a.k = x.k AND a.v > x.v",
    "SELECT count(*) FROM a JOIN b ON a.k = b.k AND a.k2 = b.k2 WHERE b.v < 20",
    // Outer joins whose filter reads never-NULL columns of the side padded
    // with NULLs (a sort-merge join evaluated its filter over those NULLs).
    "SELECT count(*), count(x.id), sum(x.v) FROM a LEFT JOIN (SELECT * FROM b WHERE v < 10) x ON a.k = x.k AND a.id <> x.id",
    "SELECT count(*), count(a.id), sum(a.v) FROM (SELECT * FROM a WHERE v < 10) a RIGHT JOIN b ON a.k = b.k AND a.id > b.id",
    "SELECT count(*), count(a.id), count(x.id) FROM a FULL JOIN (SELECT * FROM b WHERE v < 10) x ON a.k = x.k AND a.id < x.id",
    // A join whose probe key reaches a scan through the join below it (a key
    // filter through joins): NULL-equal, keys from both sides (TPC-H Q5's
    // shape), and an outer join in between, which the filter does not cross.
    "SELECT count(*), count(x.k) FROM a JOIN b ON a.id = b.id JOIN (SELECT * FROM c WHERE v < 10) x ON (a.k IS NOT DISTINCT FROM x.k) AND (b.k2 IS NOT DISTINCT FROM x.k2)",
    "SELECT count(*), sum(a.v) FROM a JOIN b ON a.id = b.id JOIN (SELECT * FROM c WHERE v < 10) x ON a.k = x.k AND b.k2 = x.k2",
    "SELECT count(*), count(b.k) FROM a LEFT JOIN b ON a.id = b.id JOIN (SELECT * FROM c WHERE v < 10) x ON b.k IS NOT DISTINCT FROM x.k",
    "SELECT count(*) FROM a JOIN b ON a.k = b.k JOIN (SELECT * FROM c WHERE v < 5) x ON b.k2 = x.k2 AND a.v = x.v",
    // ... and over an empty build side, and one of NULL keys only.
    "SELECT count(*) FROM a JOIN b ON a.id = b.id JOIN (SELECT * FROM c WHERE v < 0) x ON a.k = x.k AND b.k2 = x.k2",
    "SELECT count(*), count(a.k) FROM a JOIN b ON a.id = b.id JOIN (SELECT * FROM a WHERE k IS NULL AND v < 50) x ON (a.k IS NOT DISTINCT FROM x.k) AND (b.k2 IS NOT DISTINCT FROM x.k2)",
    // Joins on the same key one over the other (the upper one takes the
    // lower one's hash partitioning as it is), inner and outer.
    "SELECT count(*), count(b.id), sum(c.v) FROM a JOIN b ON a.k = b.k JOIN c ON a.k = c.k",
    "SELECT count(*), count(b.id), count(c.id) FROM a LEFT JOIN b ON a.k = b.k FULL JOIN c ON b.k = c.k",
    // A recursive CTE whose recursive term joins a Sieve scan: the term runs
    // again for every iteration, and its join filter with it.
    "WITH RECURSIVE r(k, depth) AS ( \
         SELECT k, 0 FROM c WHERE k < 5 \
         UNION ALL \
         SELECT (b.k + 1) % 131, r.depth + 1 FROM r JOIN b ON b.k = r.k WHERE r.depth < 3 AND b.v < 30 \
     ) SELECT depth, count(*), count(DISTINCT k) FROM r GROUP BY depth",
    "WITH RECURSIVE r(k, depth) AS ( \
         SELECT k, 0 FROM c WHERE k < 5 \
         UNION ALL \
         SELECT (x.k + 1) % 97, r.depth + 1 FROM r \
         JOIN (SELECT a.k FROM a JOIN c ON a.k = c.k WHERE c.v < 50 AND a.v < 20) x ON x.k = r.k WHERE r.depth < 3 \
     ) SELECT depth, count(*), count(DISTINCT k) FROM r GROUP BY depth",
];

async fn check(session: &SieveSession, reference: &SessionContext, mode: &str) {
    for sql in QUERIES {
        let expected = run(reference, sql)
            .await
            .unwrap_or_else(|error| panic!("plain DataFusion: {sql}: {error}"));
        let expected = rows_as_text(&expected, true).unwrap();
        let actual = run(&session.context, sql)
            .await
            .unwrap_or_else(|error| panic!("{mode}: {sql}: {error}"));
        let actual = rows_as_text(&actual, true).unwrap();
        assert_eq!(actual, expected, "{mode}: {sql}");
    }
}

/// Bytes written to spill files by the plan's `SpillableHashJoinExec`s, as
/// EXPLAIN ANALYZE prints them (`spilled_bytes=12.5 KB`).
fn join_spilled_bytes(plan: &str) -> f64 {
    plan.lines()
        .filter(|line| line.contains("SpillableHashJoinExec"))
        .flat_map(|line| line.split("spilled_bytes=").skip(1))
        .map(|rest| {
            let mut words = rest.split([' ', ',', ']']);
            let number: f64 = words.next().unwrap_or("0").parse().unwrap_or(0.0);
            let unit = match words.next().unwrap_or("B") {
                "KB" => 1024.0,
                "MB" => 1024.0 * 1024.0,
                "GB" => 1024.0 * 1024.0 * 1024.0,
                _ => 1.0,
            };
            number * unit
        })
        .sum()
}

async fn explain_analyze(session: &SieveSession, sql: &str) -> String {
    let batches = run(&session.context, &format!("EXPLAIN ANALYZE {sql}"))
        .await
        .unwrap();
    rows_as_text(&batches, false).unwrap().join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joins_over_null_keys_equal_plain_datafusion() {
    let root = data();
    let reference = reference_context_for(&root, NODES, &["a", "b", "c"])
        .await
        .unwrap();
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let session = cluster.session().await.unwrap();
    check(&session, &reference, "defaults").await;

    // The null-equal join's filter keeps the NULL probe rows, and says so.
    let plan = explain_analyze(&session, QUERIES[0]).await;
    assert!(
        plan.contains("join filter from") && plan.contains("NULL keys kept"),
        "{plan}"
    );

    // The NULL-equal join above another reaches `a` through it, NULLs kept.
    let through = QUERIES
        .iter()
        .find(|sql| sql.contains("x ON (a.k IS NOT DISTINCT FROM x.k) AND (b.k2"))
        .expect("listed");
    let plan = explain_analyze(&session, through).await;
    assert!(
        plan.lines().any(|line| line.contains("table=a")
            && line.contains("(through joins below it)")
            && line.contains("NULL keys kept")),
        "{plan}"
    );

    // The recursive term's join runs again in every iteration, reset, with
    // no dynamic filter: its probe scan must not wait for one.
    let plan = explain_analyze(&session, QUERIES[QUERIES.len() - 1]).await;
    assert!(!plan.contains("not complete after"), "{plan}");

    // Every partitioned join over its memory: each partition goes to disk
    // by key hash and is joined part by part (parts partitioned again where
    // still too large), with NDP on and off.
    let spill_settings: Vec<String> = vec![
        "sieve.join_build_bytes_max=2048".into(),
        "datafusion.execution.target_partitions=2".into(),
        // Partitioned joins even for these small build sides.
        "datafusion.optimizer.hash_join_single_partition_threshold=0".into(),
        "datafusion.optimizer.hash_join_single_partition_threshold_rows=0".into(),
    ];
    // Sort-merge joins in place of hash joins.
    let merging = cluster.session().await.unwrap();
    merging
        .apply_settings(&["datafusion.optimizer.prefer_hash_join=false".into()])
        .unwrap();
    let plan = explain_analyze(&merging, QUERIES[26]).await;
    assert!(plan.contains("SortMergeJoin"), "{plan}");
    check(&merging, &reference, "sort-merge joins").await;

    let spilling = cluster.session().await.unwrap();
    spilling.apply_settings(&spill_settings).unwrap();
    check(&spilling, &reference, "spilled to disk").await;
    let parts_joined = |plan: &str| -> usize {
        plan.split("spilled_join_parts=")
            .skip(1)
            .filter_map(|rest| {
                let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                digits.parse::<usize>().ok()
            })
            .sum()
    };
    // The full join: parts kept in memory, the others joined from disk.
    let plan = explain_analyze(&spilling, QUERIES[28]).await;
    assert!(
        QUERIES[28].contains("FULL JOIN") && parts_joined(&plan) > 0,
        "the full join did not join parts from disk: {plan}"
    );
    // A join of thousands of build rows: parts partitioned again.
    let larger = QUERIES
        .iter()
        .find(|sql| sql.contains("sum(a.v) FROM a JOIN b ON a.id = b.id"))
        .expect("listed");
    let plan = explain_analyze(&spilling, larger).await;
    assert!(
        parts_joined(&plan) > GRACE_FAN_OUT,
        "parts were not partitioned again: {plan}"
    );
    // Its partitions spilled, so DataFusion's filter knows none of their
    // build sides; the probe scan still gets the collected keys' range and
    // membership test.
    let probe = plan
        .lines()
        .find_map(|line| {
            let from_b = line.split("join filter from b: ").nth(1)?;
            Some(from_b.split(", registered").next().unwrap_or(from_b))
        })
        .unwrap_or_else(|| panic!("no join filter from b: {plan}"));
    assert!(probe.contains("range ["), "{probe}");
    assert!(
        ["IN list", "bitmap", "Bloom"]
            .iter()
            .any(|test| probe.contains(test)),
        "{probe}"
    );
    // Spill files compressed as the session says, as DataFusion's sorts
    // and aggregations write theirs: fewer bytes to disk, the same answers.
    let compressed = cluster.session().await.unwrap();
    let mut compressed_settings = spill_settings.clone();
    compressed_settings.push("datafusion.execution.spill_compression=lz4_frame".into());
    compressed.apply_settings(&compressed_settings).unwrap();
    check(&compressed, &reference, "spilled to disk, compressed").await;
    // Rows that carry a long, repetitive string: compressed, their spill
    // files take a fraction of the bytes.
    let padded = "SELECT count(*), sum(length(x.pad)), min(x.pad) \
        FROM (SELECT id, repeat('padding ', 25) || CAST(v AS VARCHAR) AS pad FROM a) x \
        JOIN b ON x.id = b.id";
    let expected = rows_as_text(&run(&reference, padded).await.unwrap(), true).unwrap();
    let mut spilled = vec![];
    for (session, mode) in [(&spilling, "uncompressed"), (&compressed, "lz4_frame")] {
        let actual = rows_as_text(&run(&session.context, padded).await.unwrap(), true).unwrap();
        assert_eq!(actual, expected, "{mode}: {padded}");
        let plan = explain_analyze(session, padded).await;
        spilled.push((join_spilled_bytes(&plan), plan));
    }
    let [(plain_bytes, _), (compressed_bytes, compressed_plan)] =
        <[_; 2]>::try_from(spilled).unwrap();
    assert!(
        compressed_bytes > 0.0 && compressed_bytes < plain_bytes * 0.5,
        "spilled {compressed_bytes} bytes compressed against {plain_bytes}: {compressed_plan}"
    );
    spilling.set_ndp(false).unwrap();
    check(&spilling, &reference, "spilled to disk, NDP off").await;

    // Every partitioned join over more partitions than the plan's, merged
    // back above it: 8 over 2 (a power of two, so DataFusion's repartition
    // masks the hash) and 9 over 3 (a true remainder), alone and spilled,
    // with NDP on and off.
    let wide_settings = |partitions: usize, wide: usize| -> Vec<String> {
        vec![
            format!("datafusion.execution.target_partitions={partitions}"),
            format!("sieve.join_wide_partitions={wide}"),
            "sieve.join_wide_build_rows=0".into(),
            "datafusion.optimizer.hash_join_single_partition_threshold=0".into(),
            "datafusion.optimizer.hash_join_single_partition_threshold_rows=0".into(),
        ]
    };
    let same_key = QUERIES
        .iter()
        .find(|sql| sql.contains("JOIN c ON a.k = c.k"))
        .expect("listed");
    for (partitions, wide, expected) in [(2, 8, 8), (3, 7, 9)] {
        let widened = cluster.session().await.unwrap();
        widened
            .apply_settings(&wide_settings(partitions, wide))
            .unwrap();
        let mode = format!("joins over {expected} partitions");
        check(&widened, &reference, &mode).await;
        // A join over another on the same key: the lower one widened and
        // merged back below the upper one.
        let plan = explain_analyze(&widened, same_key).await;
        let merge = format!("MergePartitionsExec: {expected} partitions into {partitions}");
        assert!(
            plan.contains(&merge)
                && plan.contains(&format!(
                    "RepartitionExec: partitioning=Hash([k@0], {expected})"
                )),
            "{mode}: {plan}"
        );
        let mut spilled = wide_settings(partitions, wide);
        spilled.push("sieve.join_build_bytes_max=2048".into());
        widened.apply_settings(&spilled).unwrap();
        check(&widened, &reference, &format!("{mode}, spilled to disk")).await;
        widened.set_ndp(false).unwrap();
        check(&widened, &reference, &format!("{mode}, spilled, NDP off")).await;
    }
    // Off, and below the build rows it takes: the plan keeps its partitions.
    for settings in [
        vec!["sieve.join_wide_partitions=0".to_string()],
        vec!["sieve.join_wide_build_rows=1000000".to_string()],
    ] {
        let plain = cluster.session().await.unwrap();
        plain.apply_settings(&wide_settings(2, 8)).unwrap();
        plain.apply_settings(&settings).unwrap();
        let plan = explain_analyze(&plain, same_key).await;
        assert!(
            plan.contains("HashJoinExec") && !plan.contains("MergePartitionsExec"),
            "{settings:?}: {plan}"
        );
    }

    // Every slice raw: the compute node runs the same fragments.
    let raw = EmbeddedCluster::start_raw(&root, NODES).await.unwrap();
    let raw_session = raw.session().await.unwrap();
    check(&raw_session, &reference, "raw").await;
    let (raw_slices, served) = raw.slices_raw_and_served();
    assert!(served > 0 && raw_slices == served);
    let _ = std::fs::remove_dir_all(&root);
}
