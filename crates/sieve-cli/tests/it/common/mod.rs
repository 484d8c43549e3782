//! Test data shared by the end-to-end test files.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use sieve_cli::cluster::generated_tpch;
use sieve_format::SliceLayout;

/// Storage nodes of the small-slice data set.
pub(crate) const NODES: usize = 3;

/// TPC-H SF 0.01 in small slices (5,000 rows) and row groups (1,024 rows),
/// so every table spans several slices and nodes and tables of few slices
/// are read in row-group ranges; each slice on `replicas` nodes. Loaded
/// once per build into the target directory; concurrent test processes each
/// load into their own directory and rename it into place.
pub(crate) fn small_slices(replicas: usize) -> PathBuf {
    let suffix = if replicas > 1 {
        format!("-r{replicas}")
    } else {
        String::new()
    };
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "tpch-sf0.01-slices5000-rg1024{suffix}-v{}",
        sieve_format::FORMAT_VERSION
    ));
    small_slices_in(&root, replicas)
}

/// The data set of [`small_slices`], loaded into `root` if it is not there.
pub(crate) fn small_slices_in(root: &Path, replicas: usize) -> PathBuf {
    let layout = SliceLayout {
        slice_rows_max: 5000,
        row_group_rows_max: 1024,
        ..SliceLayout::default()
    };
    generated_tpch(root, 0.01, NODES, replicas, &layout).expect("load TPC-H")
}

/// A small random source for randomised tests, with its seed from
/// `variable` (to replay a failure) or the clock; the caller prints it.
pub(crate) struct Random(pub(crate) u64);

impl Random {
    pub(crate) fn from_env(variable: &str) -> Self {
        Self(
            std::env::var(variable)
                .ok()
                .and_then(|seed| seed.parse().ok())
                .unwrap_or_else(|| {
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .unwrap()
                        .as_nanos() as u64
                }),
        )
    }

    /// A number below `bound`.
    pub(crate) fn below(&mut self, bound: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % bound.max(1)
    }

    /// True `percent` times in 100.
    pub(crate) fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// A loopback port free at the moment of asking.
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The first file in the owned tables' directories of `node_directories`
/// that `kept` (a catalog's `TableStore::retained`) does not name: a
/// temporary file, or a slice no version and no running load refers to.
pub(crate) fn stray_slice_file(
    node_directories: &[&Path],
    kept: &BTreeMap<String, Vec<u32>>,
) -> Option<String> {
    for directory in node_directories {
        for table in std::fs::read_dir(directory).unwrap() {
            let table = table.unwrap();
            let name = table.file_name().to_string_lossy().into_owned();
            if !name.contains('@') {
                continue;
            }
            for file in std::fs::read_dir(table.path()).unwrap() {
                let file = file.unwrap().file_name().to_string_lossy().into_owned();
                if file.ends_with(".tmp") {
                    return Some(format!("a temporary file is left: {name}/{file}"));
                }
                let slice: Option<u32> = file
                    .trim_start_matches(&format!("{name}-"))
                    .trim_end_matches(".parquet")
                    .parse()
                    .ok();
                let named = slice.is_some_and(|slice| {
                    kept.get(&name)
                        .is_some_and(|slices| slices.contains(&slice))
                });
                if !named {
                    return Some(format!(
                        "{name}/{file} is on {} but no version names it",
                        directory.display()
                    ));
                }
            }
        }
    }
    None
}

/// How table `table` of the data set at `root` is stored: its name on the
/// storage nodes (`name@id`, as the write path names it) and its slices,
/// by number, each with the nodes holding a copy (read from the node
/// directories).
pub(crate) struct Stored {
    pub(crate) name: String,
    pub(crate) slices: Vec<(u32, Vec<usize>)>,
}

impl Stored {
    /// The number of the `index`th slice, in slice order.
    pub(crate) fn slice(&self, index: usize) -> u32 {
        self.slices[index].0
    }

    /// The file of slice `slice` on node `node` of the data set at `root`.
    pub(crate) fn path(&self, root: &Path, node: usize, slice: u32) -> PathBuf {
        sieve_format::node_directory(root, node)
            .join(&self.name)
            .join(sieve_format::slice_file_name(&self.name, slice))
    }
}

pub(crate) fn stored(root: &Path, table: &str) -> Stored {
    let prefix = format!("{table}@");
    let mut name = None;
    let mut slices: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for node in 0.. {
        let directory = sieve_format::node_directory(root, node);
        if !directory.is_dir() {
            break;
        }
        for entry in std::fs::read_dir(&directory).unwrap() {
            let entry = entry.unwrap().file_name().to_string_lossy().into_owned();
            if !entry.starts_with(&prefix) {
                continue;
            }
            assert!(
                name.as_ref().is_none_or(|name| *name == entry),
                "{table} is stored under two names"
            );
            for file in std::fs::read_dir(directory.join(&entry)).unwrap() {
                let file = file.unwrap().file_name().to_string_lossy().into_owned();
                let number: Option<u32> = file
                    .strip_prefix(&format!("{entry}-"))
                    .and_then(|rest| rest.strip_suffix(".parquet"))
                    .and_then(|number| number.parse().ok());
                if let Some(number) = number {
                    slices.entry(number).or_default().push(node);
                }
            }
            name = Some(entry);
        }
    }
    Stored {
        name: name.unwrap_or_else(|| panic!("no table {table} under {}", root.display())),
        slices: slices.into_iter().collect(),
    }
}

/// The SQL name of a table named `name` on the storage nodes (`name@id`
/// for a table of a catalog, the name itself otherwise).
pub(crate) fn sql_name(name: &str) -> String {
    sieve_format::writes::parse_storage_name(name)
        .map_or(name, |(sql, _)| sql)
        .to_string()
}

/// Every table of `session` as a scan plans it now: the discovered ones and
/// those of its table catalog at the latest version (the slices' replicas
/// as the scan would try them).
pub(crate) fn planned_tables(
    session: &sieve_compute::SieveSession,
) -> BTreeMap<String, sieve_compute::ClusterTable> {
    let mut tables: BTreeMap<String, sieve_compute::ClusterTable> = session
        .catalog
        .tables
        .iter()
        .map(|(name, table)| (name.clone(), (**table).clone()))
        .collect();
    if let Some(owned) = &session.catalog.owned {
        let pin = owned.pin_latest().unwrap();
        for name in owned.store().tables_at(pin.version()).unwrap().into_keys() {
            let snapshot = owned
                .store()
                .snapshot(&name, pin.version())
                .unwrap()
                .unwrap();
            tables.insert(name, owned.cluster_table(&snapshot, &pin));
        }
    }
    assert!(!tables.is_empty(), "the session has no table");
    tables
}

/// An embedded cluster of `nodes` storage nodes over `root`'s node
/// directories, and a session over it with the table catalog
/// `root/catalog.sqlite` (tables a user owns).
pub(crate) async fn cluster_with_catalog(
    root: &Path,
    nodes: usize,
) -> (
    sieve_cli::cluster::EmbeddedCluster,
    sieve_compute::SieveSession,
) {
    let cluster = sieve_cli::cluster::EmbeddedCluster::start(root, nodes)
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
    (cluster, session)
}

/// Each `(name, batch)` loaded as a table the user owns through `CREATE
/// TABLE name WITH (with) AS SELECT` in `session`, and registered as it is
/// in `reference` (plain DataFusion) under the same name.
pub(crate) async fn create_owned_tables(
    session: &sieve_compute::SieveSession,
    reference: &datafusion::prelude::SessionContext,
    tables: Vec<(&str, arrow::record_batch::RecordBatch)>,
    with: &str,
) {
    use datafusion::datasource::MemTable;
    use std::sync::Arc;
    for (name, batch) in tables {
        let schema = batch.schema();
        let source = MemTable::try_new(Arc::clone(&schema), vec![vec![batch.clone()]]).unwrap();
        session
            .context
            .register_table(format!("{name}_source"), Arc::new(source))
            .unwrap();
        session
            .sql(&format!(
                "CREATE TABLE {name} WITH ({with}) AS SELECT * FROM {name}_source"
            ))
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        let copy = MemTable::try_new(schema, vec![vec![batch]]).unwrap();
        reference.register_table(name, Arc::new(copy)).unwrap();
    }
}

/// Run `sql` and sum the metric `names` over every Sieve scan of its plan.
pub(crate) async fn run_with_scan_metrics(
    session: &sieve_compute::SieveSession,
    sql: &str,
    names: &[&str],
) -> datafusion::common::Result<(Vec<arrow::record_batch::RecordBatch>, Vec<usize>)> {
    let plan = session
        .context
        .sql(sql)
        .await?
        .create_physical_plan()
        .await?;
    let batches = datafusion::physical_plan::collect(
        std::sync::Arc::clone(&plan),
        session.context.task_ctx(),
    )
    .await?;
    let mut sums = vec![0; names.len()];
    let mut pending = vec![plan];
    while let Some(node) = pending.pop() {
        if node
            .downcast_ref::<sieve_compute::SieveScanExec>()
            .is_some()
        {
            let metrics = node.metrics().expect("scans have metrics");
            for (sum, name) in sums.iter_mut().zip(names) {
                *sum += metrics
                    .sum_by_name(name)
                    .map(|value| value.as_usize())
                    .unwrap_or(0);
            }
        }
        pending.extend(node.children().into_iter().cloned());
    }
    Ok((batches, sums))
}

/// The text of `EXPLAIN sql` on `context`, one line per row.
pub(crate) async fn explain(context: &datafusion::prelude::SessionContext, sql: &str) -> String {
    let batches = sieve_cli::compare::run(context, &format!("EXPLAIN {sql}"))
        .await
        .unwrap();
    sieve_cli::compare::rows_as_text(&batches, false)
        .unwrap()
        .join("\n")
}

/// An empty data directory `name-<pid>` in the target directory, with
/// `nodes` empty node directories (tables are made by the test).
pub(crate) fn empty_root(name: &str, nodes: usize) -> PathBuf {
    let root =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    for node in 0..nodes {
        std::fs::create_dir_all(sieve_format::node_directory(&root, node)).unwrap();
    }
    root
}

/// The storage nodes' `stats` field `key`, summed over `cluster`'s nodes (a
/// list counts its entries).
pub(crate) async fn node_stats_sum(
    cluster: &sieve_cli::cluster::EmbeddedCluster,
    key: &str,
) -> u64 {
    let mut total = 0;
    for url in cluster.urls() {
        let stats = sieve_compute::StorageClient::connect(&url, Some(cluster.secret()))
            .await
            .unwrap()
            .stats()
            .await
            .unwrap();
        total += match &stats[key] {
            serde_json::Value::Array(entries) => entries.len() as u64,
            value => value
                .as_u64()
                .unwrap_or_else(|| panic!("{key} missing from {stats}")),
        };
    }
    total
}

/// Table `name` as `slices` slices, slice `part` holding `batch(part)`,
/// written on node `part % NODES` and copied to the next node, in small
/// row groups (512 rows) and pages (128 rows) so that pruning runs.
pub(crate) fn write_replicated_table(
    root: &Path,
    name: &str,
    slices: usize,
    batch: impl Fn(usize) -> arrow::record_batch::RecordBatch,
) {
    let layout = SliceLayout {
        row_group_rows_max: 512,
        data_page_rows_max: 128,
        ..SliceLayout::default()
    };
    for part in 0..slices {
        let node = part % NODES;
        let path = sieve_format::slice_path(&sieve_format::node_directory(root, node), name, part);
        let batch = batch(part);
        sieve_format::write_slice(&path, &batch.schema(), &layout, [Ok(batch)]).unwrap();
        let replica = sieve_format::slice_path(
            &sieve_format::node_directory(root, (node + 1) % NODES),
            name,
            part,
        );
        sieve_format::copy_slice(&path, &replica).unwrap();
    }
}
