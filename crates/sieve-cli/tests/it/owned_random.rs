//! A randomised run of writes to tables users own (issue 18): INSERT
//! (values and selects), UPDATE, DELETE, COPY from CSV files, TRUNCATE and
//! the compactions they set off, over three tables of different layouts,
//! each checked after every operation against a model kept independently:
//! the same statements run by DataFusion over its own memory tables.
//! `SIEVE_RANDOM_OPS` sets the number of operations (2,000 by default),
//! `SIEVE_RANDOM_SEED` the seed (printed).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Schema};
use datafusion::datasource::MemTable;
use datafusion::prelude::SessionContext;
use sieve_cli::compare::{rows_as_text, run};
use sieve_compute::SieveSession;
use sieve_format::node_directory;

use crate::common::Random;

const NODES: usize = 3;
const TABLES: [(&str, &str); 3] = [
    ("ta", "WITH (sort_key = 'id', slice_rows = 40)"),
    (
        "tb",
        "WITH (sort_key = 'k,id', slice_rows = 25, replicas = 1)",
    ),
    ("tc", "WITH (slice_rows = 60, replicas = 3)"),
];

fn value(random: &mut Random) -> String {
    let k = if random.chance(10) {
        "NULL".to_string()
    } else {
        random.below(20).to_string()
    };
    let s = if random.chance(15) {
        "NULL".to_string()
    } else {
        format!("'s{}'", random.below(9))
    };
    let d = if random.chance(10) {
        "NULL".to_string()
    } else {
        format!("{}.{:02}", random.below(1000), random.below(100))
    };
    format!("({}, {k}, {s}, {d})", random.below(100_000))
}

async fn rows(context: &SessionContext, sql: &str) -> Result<Vec<String>, String> {
    match run(context, sql).await {
        Ok(batches) => Ok(rows_as_text(&batches, true).unwrap()),
        Err(error) => Err(error.to_string()),
    }
}

async fn sieve_rows(session: &SieveSession, sql: &str) -> Result<Vec<String>, String> {
    let frame = session.sql(sql).await.map_err(|error| error.to_string())?;
    match frame.collect().await {
        Ok(batches) => Ok(rows_as_text(&batches, true).unwrap()),
        Err(error) => Err(error.to_string()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_writes_keep_every_table_equal_to_a_model() {
    let operations: usize = std::env::var("SIEVE_RANDOM_OPS")
        .ok()
        .and_then(|ops| ops.parse().ok())
        .unwrap_or(2_000);
    let mut random = Random::from_env("SIEVE_RANDOM_SEED");
    let seed = random.0;
    println!("seed {seed} (SIEVE_RANDOM_SEED), {operations} operations");
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("owned-random-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    for node in 0..NODES {
        std::fs::create_dir_all(node_directory(&root, node)).unwrap();
    }
    let files = root.join("files");
    std::fs::create_dir_all(&files).unwrap();
    let (cluster, session) = crate::common::cluster_with_catalog(&root, NODES).await;
    // Compactions often: a slice a fifth deleted is rewritten.
    sieve_rows(&session, "SET sieve.compact_deleted_share = 0.2")
        .await
        .unwrap();
    let model = SessionContext::new();
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, true),
        Field::new("k", DataType::Int64, true),
        Field::new("s", DataType::Utf8View, true),
        Field::new("d", DataType::Decimal128(10, 2), true),
    ]));
    for (name, layout) in TABLES {
        sieve_rows(
            &session,
            &format!(
                "CREATE TABLE {name} (id BIGINT, k BIGINT, s VARCHAR, d DECIMAL(10, 2)) {layout}"
            ),
        )
        .await
        .unwrap();
        let created = session.context.table(name).await.unwrap();
        assert_eq!(created.schema().inner().fields(), schema.fields());
        model
            .register_table(
                name,
                Arc::new(MemTable::try_new(Arc::clone(&schema), vec![vec![]]).unwrap()),
            )
            .unwrap();
    }
    let mut kinds = [0usize; 7];
    for operation in 0..operations {
        let table = TABLES[random.below(3) as usize].0;
        let other = TABLES[random.below(3) as usize].0;
        let kind = match random.below(100) {
            0..=29 => 0,  // INSERT VALUES
            30..=39 => 1, // INSERT SELECT
            40..=59 => 2, // UPDATE
            60..=84 => 3, // DELETE
            85..=96 => 4, // COPY
            97..=98 => 5, // TRUNCATE
            _ => 6,       // DELETE of nothing: compaction only
        };
        kinds[kind] += 1;
        let r = random.below(20);
        let (ours, theirs) = match kind {
            0 => {
                let values: Vec<String> = (0..1 + random.below(12))
                    .map(|_| value(&mut random))
                    .collect();
                let sql = format!("INSERT INTO {table} VALUES {}", values.join(", "));
                (sql.clone(), sql)
            }
            1 => {
                let sql = format!(
                    "INSERT INTO {table} SELECT id + 1, k, s, d FROM {other} WHERE k = {r} OR s = 's{}'",
                    r % 9
                );
                (sql.clone(), sql)
            }
            2 => {
                let set = match random.below(4) {
                    0 => "k = k + 1".to_string(),
                    1 => format!("s = 'u{r}'"),
                    2 => "d = d * 2, k = NULL".to_string(),
                    _ => "id = id + 7, s = NULL".to_string(),
                };
                let filter = match random.below(4) {
                    0 => format!("k = {r}"),
                    1 => format!("id % 7 = {}", r % 7),
                    2 => "s IS NULL".to_string(),
                    _ => format!("d > {}", r * 50),
                };
                let sql = format!("UPDATE {table} SET {set} WHERE {filter}");
                (sql.clone(), sql)
            }
            3 => {
                let filter = match random.below(5) {
                    0 => format!("k = {r}"),
                    1 => format!("id % 5 = {}", r % 5),
                    2 => format!("s IS NULL AND k > {r}"),
                    3 => format!("d BETWEEN {} AND {}", r * 30, r * 30 + 200),
                    _ => format!("k IS NULL OR id < {}", r * 1000),
                };
                let sql = format!("DELETE FROM {table} WHERE {filter}");
                (sql.clone(), sql)
            }
            4 => {
                // A CSV file for Sieve; the same rows as VALUES for the model.
                let rows: Vec<(String, String)> = (0..1 + random.below(60))
                    .map(|_| {
                        let k = (!random.chance(10)).then(|| random.below(20));
                        let s = (!random.chance(15)).then(|| format!("s{}", random.below(9)));
                        let d = (!random.chance(10))
                            .then(|| format!("{}.{:02}", random.below(1000), random.below(100)));
                        let id = random.below(100_000);
                        let csv = format!(
                            "{id},{},{},{}",
                            k.map(|k| k.to_string()).unwrap_or_default(),
                            s.clone().unwrap_or_default(),
                            d.clone().unwrap_or_default()
                        );
                        let values = format!(
                            "({id}, {}, {}, {})",
                            k.map(|k| k.to_string()).unwrap_or("NULL".into()),
                            s.map(|s| format!("'{s}'")).unwrap_or("NULL".into()),
                            d.unwrap_or("NULL".into())
                        );
                        (csv, values)
                    })
                    .collect();
                let path = files.join(format!("op-{operation}.csv"));
                let mut text = String::from("id,k,s,d\n");
                for (csv, _) in &rows {
                    writeln!(text, "{csv}").unwrap();
                }
                std::fs::write(&path, text).unwrap();
                let values: Vec<String> = rows.into_iter().map(|(_, values)| values).collect();
                (
                    format!(
                        "COPY {table} FROM '{}' WITH (FORMAT csv, HEADER true)",
                        path.display()
                    ),
                    format!("INSERT INTO {table} VALUES {}", values.join(", ")),
                )
            }
            5 => (format!("TRUNCATE {table}"), format!("DELETE FROM {table}")),
            _ => {
                let sql = format!("DELETE FROM {table} WHERE id < 0");
                (sql.clone(), sql)
            }
        };
        let answer = sieve_rows(&session, &ours).await;
        let expected = rows(&model, &theirs).await;
        assert_eq!(
            answer, expected,
            "operation {operation} (seed {seed}): {ours}"
        );
        // The table written equals the model's; every table, now and then.
        let checked: Vec<&str> = if operation % 100 == 99 {
            TABLES.iter().map(|(name, _)| *name).collect()
        } else {
            vec![table]
        };
        for name in checked {
            let sql = format!("SELECT * FROM {name}");
            assert_eq!(
                sieve_rows(&session, &sql).await,
                rows(&model, &sql).await,
                "after operation {operation} (seed {seed}): {ours}: table {name}"
            );
        }
    }
    println!(
        "{operations} operations: {} INSERT VALUES, {} INSERT SELECT, {} UPDATE, {} DELETE, {} COPY, {} TRUNCATE, {} compaction-only",
        kinds[0], kinds[1], kinds[2], kinds[3], kinds[4], kinds[5], kinds[6]
    );
    drop(session);
    drop(cluster);
    std::fs::remove_dir_all(&root).unwrap();
}
