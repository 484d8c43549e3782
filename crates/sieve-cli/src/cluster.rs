//! An embedded cluster: storage nodes inside this process, on loopback.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use datafusion::common::{plan_err, DataFusionError, Result};
use datafusion::prelude::SessionConfig;
use sieve_compute::{connect_session_with_tables, SieveSession};
use sieve_format::{
    is_generated, node_directory, Benchmark, SliceLayout, FORMAT_VERSION, LOAD_COMPLETE_MARKER,
    TABLE_CATALOG_FILE,
};
use sieve_fragment::Secret;
use sieve_storage::{ConnectionLimits, ExecuteOptions, StorageNode, StorageNodeConfig};

use crate::secret::random_secret;

/// Storage nodes started in this process, one per `node-K` directory,
/// sharing a secret made for this start: connect with
/// [`EmbeddedCluster::session`] (the data set's table catalog too).
#[derive(Debug)]
pub struct EmbeddedCluster {
    /// The running nodes.
    pub nodes: Vec<StorageNode>,
    secret: Secret,
    root: PathBuf,
}

impl EmbeddedCluster {
    /// Start `nodes` storage nodes over `root/node-0` .. `root/node-{nodes-1}`,
    /// each on free loopback ports.
    pub async fn start(root: &Path, nodes: usize) -> Result<Self> {
        Self::start_with(root, nodes, ExecuteOptions::default()).await
    }

    /// Like [`Self::start`], with these executor settings on every node.
    pub async fn start_with(root: &Path, nodes: usize, execute: ExecuteOptions) -> Result<Self> {
        Self::start_with_limits(root, nodes, execute, ConnectionLimits::default()).await
    }

    /// Like [`Self::start_with`], with these connection bounds on every node.
    pub async fn start_with_limits(
        root: &Path,
        nodes: usize,
        execute: ExecuteOptions,
        limits: ConnectionLimits,
    ) -> Result<Self> {
        let loopback: SocketAddr = "127.0.0.1:0".parse().expect("valid address");
        let secret = random_secret()?;
        let mut started = Vec::with_capacity(nodes);
        for node in 0..nodes {
            started.push(
                StorageNode::start(StorageNodeConfig {
                    data_directory: node_directory(root, node),
                    flight_address: loopback,
                    range_address: loopback,
                    execute: execute.clone(),
                    auth: Some(secret.clone()),
                    limits: limits.clone(),
                })
                .await?,
            );
        }
        Ok(Self {
            nodes: started,
            secret,
            root: root.to_path_buf(),
        })
    }

    /// The table catalog of the data set the nodes serve.
    pub fn catalog_path(&self) -> PathBuf {
        self.root.join(TABLE_CATALOG_FILE)
    }

    /// A session over these nodes and the data set's table catalog.
    pub async fn session(&self) -> Result<SieveSession> {
        self.session_with(SessionConfig::new()).await
    }

    /// Like [`Self::session`], starting from `config`.
    pub async fn session_with(&self, config: SessionConfig) -> Result<SieveSession> {
        connect_session_with_tables(
            &self.urls(),
            Some(&self.secret),
            config,
            Some(&self.catalog_path()),
        )
        .await
    }

    /// The secret every node of this cluster requires.
    pub fn secret(&self) -> &Secret {
        &self.secret
    }

    /// Like [`Self::start`], with no pushdown workers: every slice is served
    /// raw and the compute node runs each fragment itself.
    pub async fn start_raw(root: &Path, nodes: usize) -> Result<Self> {
        let execute = ExecuteOptions {
            pushdown_workers: 0,
            ..ExecuteOptions::default()
        };
        Self::start_with(root, nodes, execute).await
    }

    /// Flight URLs of the nodes.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(StorageNode::flight_url).collect()
    }

    /// Slices the nodes served raw for want of a pushdown worker, and
    /// slices they were asked to process, since start. Slices the compute
    /// node asked for as stored (nothing to push) count in neither: see
    /// [`EmbeddedCluster::slices_as_stored`].
    pub fn slices_raw_and_served(&self) -> (u64, u64) {
        self.nodes.iter().fold((0, 0), |(raw, served), node| {
            let counters = node.executor().counters();
            (
                raw + counters.slices_raw.load(Ordering::Relaxed),
                served
                    + counters
                        .slices_served
                        .load(Ordering::Relaxed)
                        .saturating_sub(counters.slices_as_stored.load(Ordering::Relaxed)),
            )
        })
    }

    /// Slices the nodes served as stored because the compute node asked
    /// (a scan with nothing to push), since start.
    pub fn slices_as_stored(&self) -> u64 {
        self.nodes
            .iter()
            .map(|node| {
                node.executor()
                    .counters()
                    .slices_as_stored
                    .load(Ordering::Relaxed)
            })
            .sum()
    }
}

/// Where `benchmark` at `scale_factor` with `replicas` copies of each slice
/// lives under the data directory `data`: `tpch-sfX`, `ssb-sfX`, or
/// `tpch-sfX-rR` with replicas.
pub fn data_set_directory(
    data: &Path,
    benchmark: Benchmark,
    scale_factor: f64,
    replicas: usize,
) -> PathBuf {
    let name = benchmark.name();
    if replicas > 1 {
        data.join(format!("{name}-sf{scale_factor}-r{replicas}"))
    } else {
        data.join(format!("{name}-sf{scale_factor}"))
    }
}

/// [`generated`] for TPC-H.
pub fn generated_tpch(
    root: &Path,
    scale_factor: f64,
    nodes: usize,
    replicas: usize,
    layout: &SliceLayout,
) -> Result<PathBuf> {
    generated(Benchmark::Tpch, root, scale_factor, nodes, replicas, layout)
}

/// `benchmark` at `scale_factor` over `nodes` node directories under `root`,
/// each slice on `replicas` nodes, loaded if `root` does not hold a complete
/// load of it in this format version, node count and replica count.
/// The load goes to a directory of its own and is renamed into place, so
/// concurrent callers (test processes) never see a partial load: the loser of
/// the rename discards its copy.
pub fn generated(
    benchmark: Benchmark,
    root: &Path,
    scale_factor: f64,
    nodes: usize,
    replicas: usize,
    layout: &SliceLayout,
) -> Result<PathBuf> {
    if is_generated(root, benchmark, nodes, replicas) {
        return Ok(root.to_path_buf());
    }
    let staging = staging_directory(root, std::process::id());
    let _ = std::fs::remove_dir_all(&staging);
    remove_stale_stagings(root);
    if let Err(error) = load(benchmark, &staging, scale_factor, nodes, replicas, layout) {
        // A failed load (a full disk, a bad layout, an interrupted
        // generator) leaves nothing behind: SF 100's reached 22 GB.
        let _ = std::fs::remove_dir_all(&staging);
        return Err(error);
    }
    if std::fs::rename(&staging, root).is_err() {
        // Another process won, or an old load of another version is in the way.
        if !is_generated(root, benchmark, nodes, replicas) {
            std::fs::remove_dir_all(root)?;
            std::fs::rename(&staging, root)?;
        }
        let _ = std::fs::remove_dir_all(&staging);
    }
    Ok(root.to_path_buf())
}

/// Where process `pid` loads the data set for `root` before renaming it into
/// place: `root`'s name with `.staging-PID` appended (never replacing a part
/// of it: `tpch-sf0.01` and `tpch-sf0.1` get staging directories of their
/// own).
fn staging_directory(root: &Path, pid: u32) -> PathBuf {
    let mut name = root.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".staging-{pid}"));
    root.with_file_name(name)
}

/// Remove the staging directories for `root` left by processes that no
/// longer run (killed in the middle of a load). Where the process table is
/// not readable (`/proc`), nothing is removed.
fn remove_stale_stagings(root: &Path) {
    let (Some(parent), Some(name)) = (root.parent(), root.file_name()) else {
        return;
    };
    if !Path::new("/proc/self").exists() {
        return;
    }
    let prefix = format!("{}.staging-", name.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(or_current(parent)) else {
        return;
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(pid) = file_name
            .to_str()
            .and_then(|file_name| file_name.strip_prefix(&prefix))
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// `path`, or the current directory for the empty parent of a relative
/// path's first component.
fn or_current(path: &Path) -> &Path {
    if path.as_os_str().is_empty() {
        Path::new(".")
    } else {
        path
    }
}

/// Bytes of slice files one replica of `benchmark` takes per unit of scale
/// factor, rounded down from what loads took here (TPC-H: 30 GB at SF 100,
/// 2.9 GB at SF 10; SSB: 1.5 GB at SF 10), so that only a load that cannot
/// fit is refused.
fn bytes_per_scale_factor(benchmark: Benchmark) -> f64 {
    match benchmark {
        Benchmark::Tpch => 0.25e9,
        Benchmark::Ssb => 0.12e9,
    }
}

/// Refuse, before writing anything, a load the file system under `root`
/// has clearly no room for (a full disk halfway through an SF 100 load
/// comes after minutes of generation). Where the free space is unknown the
/// load goes ahead; the storage nodes still refuse a slice that does not fit.
fn check_room(benchmark: Benchmark, root: &Path, scale_factor: f64, replicas: usize) -> Result<()> {
    let needed = bytes_per_scale_factor(benchmark) * scale_factor * replicas as f64;
    let Some(existing) = root.ancestors().map(or_current).find(|path| path.exists()) else {
        return Ok(());
    };
    let Some(available) = sieve_storage::ingest::available_bytes(existing) else {
        return Ok(());
    };
    if (available as f64) < needed {
        return Err(DataFusionError::ResourcesExhausted(format!(
            "{} at scale factor {scale_factor} with {replicas} replica(s) takes about {:.1} GB; {} has {:.1} GB free",
            benchmark.title(),
            needed / 1e9,
            existing.display(),
            available as f64 / 1e9
        )));
    }
    Ok(())
}

/// Load `benchmark` at `scale_factor` into a new data set at `root`: `nodes`
/// storage-node directories and the table catalog ([`TABLE_CATALOG_FILE`]).
/// The data enters as any user's does: storage nodes start over the
/// directories (in this process), and each table is created with
/// `CREATE TABLE name WITH (sort_key = its sort key, replicas, slice_rows,
/// row_group_rows, page_rows, layout) AS SELECT * FROM tpch('name', sf)` (or
/// `ssb(...)`): rows cut into slices, sent to the nodes with `DoPut` and
/// committed in the catalog. The completion marker is written last. Runs on
/// a thread and runtime of its own, so it may be called from anywhere.
pub fn load(
    benchmark: Benchmark,
    root: &Path,
    scale_factor: f64,
    nodes: usize,
    replicas: usize,
    layout: &SliceLayout,
) -> Result<()> {
    if nodes == 0 {
        return plan_err!("at least one storage node is needed");
    }
    if replicas == 0 || replicas > nodes {
        return plan_err!(
            "replicas must be between 1 and the number of nodes ({nodes}), got {replicas}"
        );
    }
    if scale_factor.is_nan() || scale_factor <= 0.0 {
        return plan_err!("scale factor must be positive, got {scale_factor}");
    }
    if root.join(TABLE_CATALOG_FILE).exists() {
        return plan_err!(
            "{} already holds a data set ({TABLE_CATALOG_FILE}): load into a new directory",
            root.display()
        );
    }
    check_room(benchmark, root, scale_factor, replicas)?;
    let _ = std::fs::remove_file(root.join(LOAD_COMPLETE_MARKER));
    for node in 0..nodes {
        std::fs::create_dir_all(node_directory(root, node))?;
    }
    let load = async {
        let cluster = EmbeddedCluster::start(root, nodes).await?;
        let session = cluster.session().await?;
        for table in benchmark.tables() {
            let sql = format!(
                "CREATE TABLE {name} WITH (sort_key = '{key}', replicas = {replicas}, \
                 slice_rows = {slice_rows}, row_group_rows = {row_group_rows}, page_rows = {page_rows}, \
                 layout = '{column_layout}') \
                 AS SELECT * FROM {function}('{name}', {scale_factor})",
                name = table.name,
                key = table.sort_key,
                function = benchmark.name(),
                slice_rows = layout.slice_rows_max,
                row_group_rows = layout.row_group_rows_max,
                page_rows = layout.data_page_rows_max,
                column_layout = if layout.planned { "planned" } else { "fixed" },
            );
            session.sql(&sql).await?.collect().await?;
        }
        drop(session);
        for node in cluster.nodes {
            node.stop().await;
        }
        Ok::<(), DataFusionError>(())
    };
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                tokio::runtime::Builder::new_multi_thread()
                    .enable_all()
                    .build()?
                    .block_on(load)
            })
            .join()
            .map_err(|_| {
                DataFusionError::Internal(format!("the {} load panicked", benchmark.title()))
            })?
    })?;
    let meta = serde_json::json!({
        "benchmark": benchmark.name(),
        "format_version": FORMAT_VERSION,
        "scale_factor": scale_factor,
        "nodes": nodes,
        "replicas": replicas,
        "catalog": TABLE_CATALOG_FILE,
        "slice_rows_max": layout.slice_rows_max,
        "row_group_rows_max": layout.row_group_rows_max,
        "data_page_rows_max": layout.data_page_rows_max,
        "layout": if layout.planned { "planned" } else { "fixed" },
    });
    std::fs::write(
        root.join(LOAD_COMPLETE_MARKER),
        serde_json::to_vec_pretty(&meta).expect("json"),
    )?;
    Ok(())
}
