//! A grouping by a table's wide columns over joins, grouped first by the
//! table's unique integer key and again by those columns after joining
//! them back (`sieve.group_by_table_key`, TPC-H Q21's supplier names):
//! tables a user owns, a key proven unique from the slices' summaries,
//! names shared by several keys, NULL names, NULL-padded sides, every
//! aggregate the rule merges (sums of decimals and floats, counts, min and
//! max of strings and floats with both zeros), against plain DataFusion;
//! shapes it leaves alone are planned as they were.

use std::sync::Arc;

use arrow::array::{ArrayRef, Decimal128Array, Float64Array, Int64Array, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use datafusion::prelude::SessionContext;

use crate::common::{self, NODES};
use crate::join_sides::check;

const SUPPLIERS: i64 = 3_000;

/// A supplier table: key `k` (in order, so that each slice holds a key
/// range), a name several suppliers share (and some NULL), a nation.
fn suppliers(keys: impl Iterator<Item = Option<i64>>) -> RecordBatch {
    let keys: Vec<Option<i64>> = keys.collect();
    RecordBatch::try_new(
        Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, true),
            Field::new("name", DataType::Utf8, true),
            Field::new("nation", DataType::Int64, false),
            Field::new("rating", DataType::Float64, true),
            Field::new("region", DataType::Utf8, false),
        ])),
        vec![
            Arc::new(Int64Array::from(keys.clone())) as ArrayRef,
            Arc::new(StringArray::from_iter((0..keys.len()).map(|i| {
                // Every 50th name is shared with the supplier 7 on, NULL
                // every 97th.
                (i % 97 != 0).then(|| {
                    let i = if i % 50 == 0 { i + 7 } else { i };
                    format!("Supplier#{i:012}")
                })
            }))),
            Arc::new(Int64Array::from_iter_values(
                (0..keys.len() as i64).map(|i| i % 5),
            )),
            Arc::new(Float64Array::from_iter(
                (0..keys.len()).map(|i| [Some(-0.0), Some(0.0), Some(2.5), None][i % 4]),
            )),
            Arc::new(StringArray::from_iter_values(
                (0..keys.len()).map(|i| format!("region {}", i % 5)),
            )),
        ],
    )
    .unwrap()
}

fn tables() -> Vec<(&'static str, RecordBatch)> {
    let rows = 30_000i64;
    let items = RecordBatch::try_new(
        Arc::new(Schema::new(vec![
            Field::new("sk", DataType::Int64, true),
            Field::new("ok", DataType::Int64, false),
            Field::new("qty", DataType::Int64, true),
            Field::new("price", DataType::Decimal128(12, 2), true),
            Field::new("w", DataType::Float64, true),
            Field::new("tag", DataType::Utf8, false),
        ])),
        vec![
            // Keys of no supplier past SUPPLIERS, and NULLs.
            Arc::new(Int64Array::from_iter(
                (0..rows).map(|i| (i % 29 != 0).then_some(i * 7_919 % (SUPPLIERS + 300))),
            )) as ArrayRef,
            Arc::new(Int64Array::from_iter_values((0..rows).map(|i| i / 4))),
            Arc::new(Int64Array::from_iter(
                (0..rows).map(|i| (i % 13 != 0).then_some(i % 50)),
            )),
            Arc::new(
                Decimal128Array::from_iter(
                    (0..rows).map(|i| (i % 11 != 0).then_some(i128::from(i * 37 % 100_000))),
                )
                .with_precision_and_scale(12, 2)
                .unwrap(),
            ),
            Arc::new(Float64Array::from_iter(
                (0..rows).map(|i| (i % 17 != 0).then_some((i % 400) as f64 / 8.0 - 20.0)),
            )),
            Arc::new(StringArray::from_iter_values(
                (0..rows).map(|i| format!("t{}", i % 6)),
            )),
        ],
    )
    .unwrap();
    let orders = RecordBatch::try_new(
        Arc::new(Schema::new(vec![
            Field::new("ok", DataType::Int64, false),
            Field::new("status", DataType::Utf8, false),
        ])),
        vec![
            Arc::new(Int64Array::from_iter_values(0..rows / 4)) as ArrayRef,
            Arc::new(StringArray::from_iter_values(
                (0..rows / 4).map(|i| ["F", "O", "P"][(i % 3) as usize]),
            )),
        ],
    )
    .unwrap();
    vec![
        ("supp", suppliers((0..SUPPLIERS).map(Some))),
        // Key 10 again in the last slice: not unique.
        (
            "supp_dup",
            suppliers((0..SUPPLIERS).map(|k| Some(if k == SUPPLIERS - 1 { 10 } else { k }))),
        ),
        ("items", items),
        ("ords", orders),
    ]
}

/// Queries over `{s}` (a supplier table), `items` and `ords` the rule
/// takes where `{s}`'s key is unique.
const TAKEN: &[&str] = &[
    // Q21's shape.
    "SELECT s.name, count(*) AS n FROM {s} s, items i, ords o \
     WHERE s.k = i.sk AND o.ok = i.ok AND o.status = 'F' AND s.nation = 2 \
     GROUP BY s.name ORDER BY n DESC, s.name LIMIT 20",
    // Every aggregate it merges, with another group column.
    "SELECT i.tag, s.name, count(*), count(i.qty), sum(i.qty), sum(i.price), sum(i.w), \
     min(i.w), max(i.w), min(i.tag), max(i.price) FROM {s} s JOIN items i ON s.k = i.sk \
     GROUP BY i.tag, s.name",
    // A float of the table grouped with the name: both zeros in one group.
    "SELECT s.rating, s.name, sum(i.qty) FROM items i JOIN {s} s ON s.k = i.sk \
     JOIN ords o ON o.ok = i.ok GROUP BY s.rating, s.name",
    // Another table's column grouped that is not its key.
    "SELECT i.ok, o.status, s.name, count(*) FROM {s} s JOIN items i ON s.k = i.sk \
     JOIN ords o ON o.ok = i.ok GROUP BY i.ok, o.status, s.name",
    // The supplier side padded.
    "SELECT s.name, count(*), sum(i.qty) FROM items i LEFT JOIN {s} s ON s.k = i.sk \
     GROUP BY s.name",
    "SELECT s.name, count(i.sk), max(i.w) FROM {s} s LEFT JOIN items i ON s.k = i.sk \
     WHERE s.nation <> 1 GROUP BY s.name",
    // A subquery that names the table's columns without its key (TPC-H
    // Q9's `n_name AS nation`): the key carried up through it.
    "SELECT nm, t, sum(v), count(*) FROM (SELECT s.name AS nm, i.tag AS t, i.qty * 2 AS v \
     FROM {s} s, items i, ords o WHERE s.k = i.sk AND o.ok = i.ok) AS x GROUP BY nm, t",
    // Two levels, a filter between them, a column named as the key is.
    "SELECT nm, k, min(q) FROM (SELECT nm, q, k FROM (SELECT s.name AS nm, i.qty AS q, \
     i.ok AS k FROM {s} s JOIN items i ON s.k = i.sk) AS y WHERE q > 3) AS x GROUP BY nm, k",
    // The supplier side padded, below a sort and a limit.
    "SELECT nm, sum(q) FROM (SELECT s.name AS nm, i.qty AS q FROM items i \
     LEFT JOIN {s} s ON s.k = i.sk ORDER BY i.ok, i.sk LIMIT 20000) AS x GROUP BY nm",
];

/// Queries it leaves as they are whatever the key.
const NOT_TAKEN: &[&str] = &[
    // The key grouped: `late_group_columns`'s case.
    "SELECT s.k, s.name, count(*) FROM {s} s JOIN items i ON s.k = i.sk GROUP BY s.k, s.name",
    // Another table's key grouped, its names grouped too: grouped by that
    // key alone, the names joined after (TPC-H Q10 with the nation's name).
    "SELECT o.ok, o.status, s.name, count(*) FROM {s} s JOIN items i ON s.k = i.sk \
     JOIN ords o ON o.ok = i.ok GROUP BY o.ok, o.status, s.name",
    // An aggregate it cannot merge.
    "SELECT s.name, avg(i.qty) FROM {s} s JOIN items i ON s.k = i.sk GROUP BY s.name",
    "SELECT s.name, count(DISTINCT i.qty) FROM {s} s JOIN items i ON s.k = i.sk GROUP BY s.name",
    // No join to carry the names through.
    "SELECT name, count(*) FROM {s} GROUP BY name",
    // A few values many keys share: the first grouping would be far
    // larger than the query's.
    "SELECT s.region, count(*) FROM {s} s JOIN items i ON s.k = i.sk GROUP BY s.region",
    // Only fixed-width columns of the table grouped.
    "SELECT s.nation, count(*) FROM {s} s JOIN items i ON s.k = i.sk GROUP BY s.nation",
    // The names through a grouping of the subquery's: not one row of the
    // table each.
    "SELECT nm, count(*) FROM (SELECT DISTINCT s.name AS nm, i.ok FROM {s} s \
     JOIN items i ON s.k = i.sk) AS x GROUP BY nm",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grouping_by_a_tables_names_goes_by_its_key_first() {
    let root = common::empty_root("group-by-key", NODES);
    let (cluster, session) = common::cluster_with_catalog(&root, NODES).await;
    let reference = SessionContext::new();
    // One partition loads the rows in order: each slice holds a key range.
    session
        .sql("SET datafusion.execution.target_partitions = 1")
        .await
        .unwrap();
    common::create_owned_tables(
        &session,
        &reference,
        tables(),
        "slice_rows = 1000, page_rows = 256",
    )
    .await;
    session
        .sql("SET datafusion.execution.target_partitions = 2")
        .await
        .unwrap();

    for on in [true, false] {
        session
            .sql(&format!("SET sieve.group_by_table_key = {on}"))
            .await
            .unwrap();
        for table in ["supp", "supp_dup"] {
            for (queries, taken) in [(TAKEN, true), (NOT_TAKEN, false)] {
                for (index, template) in queries.iter().enumerate() {
                    let sql = template.replace("{s}", table);
                    check(&session, &reference, &sql, "items").await;
                    let plan = common::explain(&session.context, &sql).await;
                    assert_eq!(
                        plan.contains("__sieve_keyed"),
                        on && taken && table == "supp",
                        "query {index} (taken: {taken}) over {table}, group_by_table_key = {on}:\n{plan}"
                    );
                }
            }
        }
    }

    // The joins below carry the key, not the names.
    session
        .sql("SET sieve.group_by_table_key = true")
        .await
        .unwrap();
    let plan = common::explain(&session.context, &TAKEN[0].replace("{s}", "supp")).await;
    let joins: Vec<&str> = plan
        .lines()
        .filter(|line| line.contains("HashJoinExec") && line.contains("on=[(ok"))
        .collect();
    assert!(!joins.is_empty(), "{plan}");
    for join in joins {
        assert!(!join.contains("name"), "{join}");
    }
    // Too large a table for the rule: planned as it was.
    session
        .sql("SET sieve.group_by_table_key_rows_max = 100")
        .await
        .unwrap();
    let plan = common::explain(&session.context, &TAKEN[0].replace("{s}", "supp")).await;
    assert!(!plan.contains("__sieve_keyed"), "{plan}");
    drop(session);
    drop(cluster);
    let _ = std::fs::remove_dir_all(&root);
}
