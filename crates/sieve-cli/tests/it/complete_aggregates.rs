//! Aggregations the storage nodes finish (issue 20): a load in key order
//! leaves each value of the sort key's first column in one slice, so a
//! grouping on that column is complete within each slice; the storage node
//! runs the whole aggregation and the HAVING filter above it, and only the
//! groups that pass are shipped. Answers equal plain DataFusion's over the
//! same rows in memory, NDP on and off, NULL keys included; a grouping on
//! another column or an expression of the key, or slices whose key ranges
//! overlap (a second INSERT), stays partial.

use std::path::PathBuf;
use std::sync::Arc;

use arrow::array::{ArrayRef, Decimal128Array, Int64Array, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use datafusion::datasource::MemTable;
use datafusion::prelude::SessionContext;
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::file::statistics::Statistics;
use sieve_cli::compare::{rows_as_text, run};
use sieve_format::node_directory;

use crate::common::Random;

const NODES: usize = 3;
const SLICE_ROWS: usize = 1000;

fn root(name: &str) -> PathBuf {
    crate::common::empty_root(&format!("complete-{name}"), NODES)
}

/// Rows in order of `k`: runs of 1 to 9 rows per key, NULL keys first (a
/// run of 40), a group column with NULLs, decimals with NULLs.
fn rows(random: &mut Random, first_key: i64, keys: usize, null_keys: usize) -> RecordBatch {
    let schema = Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int64, true),
        Field::new("g", DataType::Utf8, true),
        Field::new("v", DataType::Int64, true),
        Field::new("d", DataType::Decimal128(12, 2), true),
    ]));
    let mut k = vec![None; null_keys];
    for key in 0..keys as i64 {
        for _ in 0..1 + random.below(9) {
            k.push(Some(first_key + key * 3));
        }
    }
    let rows = k.len();
    let groups = ["a", "b", "c"];
    let g: Vec<Option<&str>> = (0..rows)
        .map(|_| groups.get(random.below(4) as usize).copied())
        .collect();
    let v: Vec<Option<i64>> = (0..rows)
        .map(|_| (!random.chance(5)).then(|| random.below(100) as i64 - 20))
        .collect();
    let d: Vec<Option<i128>> = (0..rows)
        .map(|_| (!random.chance(7)).then(|| random.below(100_000) as i128))
        .collect();
    RecordBatch::try_new(
        schema,
        vec![
            Arc::new(Int64Array::from(k)) as ArrayRef,
            Arc::new(StringArray::from(g)),
            Arc::new(Int64Array::from(v)),
            Arc::new(
                Decimal128Array::from(d)
                    .with_precision_and_scale(12, 2)
                    .unwrap(),
            ),
        ],
    )
    .unwrap()
}

/// (query, whether its aggregation on `{t}` is completed on the storage
/// nodes while the slices hold disjoint key ranges)
const CASES: &[(&str, bool)] = &[
    // HAVING on the key's groups, NULL key included.
    (
        "SELECT k, sum(v), count(*), count(v), avg(d), min(g), max(d) FROM {t} GROUP BY k HAVING sum(v) > 150",
        true,
    ),
    ("SELECT k, count(*) FROM {t} GROUP BY k HAVING count(*) >= 8 OR k IS NULL", true),
    // The key and another column.
    ("SELECT k, g, sum(d) FROM {t} GROUP BY k, g", true),
    // TPC-H Q18's shape: a partitioned semi join on the completed groups.
    (
        "SELECT g, count(*), sum(v) FROM {t} WHERE k IN (SELECT k FROM {t} GROUP BY k HAVING sum(v) > 200) GROUP BY g",
        true,
    ),
    // Not the key: partial.
    ("SELECT g, sum(v), count(*) FROM {t} GROUP BY g HAVING count(*) > 10", false),
    // An expression of the key spans slices: partial.
    ("SELECT k % 5 AS m, sum(v) FROM {t} GROUP BY k % 5 HAVING sum(v) > 0", false),
];

/// The `k` range of every slice file of table `name`.
fn key_ranges(root: &std::path::Path, name: &str) -> Vec<(Option<i64>, Option<i64>, u64, i64)> {
    let mut ranges = Vec::new();
    for node in 0..NODES {
        for entry in std::fs::read_dir(node_directory(root, node))
            .unwrap()
            .flatten()
        {
            let table = entry.file_name().to_string_lossy().to_string();
            if !table.starts_with(&format!("{name}@")) {
                continue;
            }
            for file in std::fs::read_dir(entry.path()).unwrap().flatten() {
                if file.path().extension().is_none_or(|ext| ext != "parquet") {
                    continue;
                }
                let reader =
                    SerializedFileReader::new(std::fs::File::open(file.path()).unwrap()).unwrap();
                let (mut min, mut max, mut nulls) = (None::<i64>, None::<i64>, 0);
                for group in reader.metadata().row_groups() {
                    match group.column(0).statistics() {
                        Some(Statistics::Int64(stats)) => {
                            if let Some(&value) = stats.min_opt() {
                                min = Some(min.map_or(value, |m| m.min(value)));
                            }
                            if let Some(&value) = stats.max_opt() {
                                max = Some(max.map_or(value, |m| m.max(value)));
                            }
                            nulls += stats.null_count_opt().unwrap_or(0);
                        }
                        other => panic!("no statistics of k: {other:?}"),
                    }
                }
                ranges.push((
                    min,
                    max,
                    nulls,
                    reader.metadata().file_metadata().num_rows(),
                ));
            }
        }
    }
    ranges.sort();
    ranges
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_complete_in_their_slice_are_finished_and_filtered_on_the_storage_nodes() {
    let root = root("answers");
    let (_cluster, session) = crate::common::cluster_with_catalog(&root, NODES).await;
    let mut random = Random::from_env("SIEVE_TEST_SEED");
    println!("seed {} (SIEVE_TEST_SEED replays)", random.0);
    let first = rows(&mut random, 0, 4000, 40);
    let more = rows(&mut random, 1, 300, 5);
    let schema = first.schema();
    let source =
        Arc::new(MemTable::try_new(Arc::clone(&schema), vec![vec![first.clone()]]).unwrap());
    let later = Arc::new(MemTable::try_new(Arc::clone(&schema), vec![vec![more.clone()]]).unwrap());
    session.context.register_table("source", source).unwrap();
    session
        .sql(&format!(
            "CREATE TABLE t WITH (sort_key = 'k', slice_rows = {SLICE_ROWS}, page_rows = 256, replicas = 1) AS SELECT * FROM source ORDER BY k NULLS FIRST"
        ))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();

    // Each key's rows in one slice: the slices' ranges are disjoint, NULLs
    // in one slice, and no slice holds more than an eighth over its rows.
    let ranges = key_ranges(&root, "t");
    assert!(ranges.len() >= 10, "{ranges:?}");
    assert_eq!(
        ranges.iter().filter(|range| range.2 > 0).count(),
        1,
        "{ranges:?}"
    );
    let with_values: Vec<_> = ranges.iter().filter(|range| range.0.is_some()).collect();
    for pair in with_values.windows(2) {
        assert!(pair[0].1 < pair[1].0, "{ranges:?}");
    }
    for range in &ranges {
        assert!(
            range.3 as usize <= SLICE_ROWS + SLICE_ROWS / 8,
            "{ranges:?}"
        );
    }

    let reference = SessionContext::new();
    let all = MemTable::try_new(Arc::clone(&schema), vec![vec![first.clone()]]).unwrap();
    reference.register_table("t", Arc::new(all)).unwrap();
    check(&session, &reference, true).await;

    // Storage nodes that serve every slice raw: the compute node runs the
    // same fragment, the whole aggregation and its filter, over each
    // slice's pages.
    drop(session);
    drop(_cluster);
    let cluster = sieve_cli::cluster::EmbeddedCluster::start_raw(&root, NODES)
        .await
        .unwrap();
    let session = sieve_compute::connect_session_with_tables(
        &cluster.urls(),
        Some(cluster.secret()),
        datafusion::prelude::SessionConfig::new(),
        Some(&root.join("catalog.sqlite")),
    )
    .await
    .unwrap();
    check(&session, &reference, true).await;
    let (raw, served) = cluster.slices_raw_and_served();
    assert!(served > 0 && raw == served, "{raw} of {served} slices raw");

    // A second load's keys fall inside the first's ranges: the groups are
    // no longer complete in one slice, and the aggregation stays partial.
    session.context.register_table("later", later).unwrap();
    session
        .sql("INSERT INTO t SELECT * FROM later ORDER BY k NULLS FIRST")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let both = MemTable::try_new(Arc::clone(&schema), vec![vec![first, more]]).unwrap();
    reference.deregister_table("t").unwrap();
    reference.register_table("t", Arc::new(both)).unwrap();
    check(&session, &reference, false).await;
    let _ = std::fs::remove_dir_all(&root);
}

/// Every case equals plain DataFusion, NDP on and off, and EXPLAIN says
/// whether the storage nodes complete its aggregation.
async fn check(
    session: &sieve_compute::SieveSession,
    reference: &SessionContext,
    complete_now: bool,
) {
    for ndp in [true, false] {
        session.set_ndp(ndp).unwrap();
        for (query, complete) in CASES {
            let sql = query.replace("{t}", "t");
            let expected = rows_as_text(&run(reference, &sql).await.unwrap(), true).unwrap();
            let actual = session.sql(&sql).await.unwrap().collect().await.unwrap();
            assert_eq!(
                rows_as_text(&actual, true).unwrap(),
                expected,
                "ndp {ndp}: {sql}"
            );
            let plan = crate::common::explain(&session.context, &sql).await;
            let completed = plan.contains("pushed aggregate: complete");
            assert_eq!(
                completed,
                ndp && *complete && complete_now,
                "ndp {ndp}: {sql}\n{plan}"
            );
            if completed && sql.contains("HAVING") {
                assert!(plan.contains(", then filter "), "{sql}\n{plan}");
            }
        }
    }
    session.set_ndp(true).unwrap();
}
