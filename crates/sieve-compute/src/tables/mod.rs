//! Tables a user owns: created, loaded and changed through SQL.
//!
//! ```text
//!  CREATE TABLE / CREATE ... AS / COPY ... FROM   statements.rs (before DataFusion)
//!  INSERT, TRUNCATE, DROP TABLE                   DataFusion's own hooks:
//!                                                 OwnedTable (provider.rs), SieveSchema
//!     └─> TableWriter (writer.rs): rows cut into slices of the table's
//!         slice_rows, each sorted by the sort key, written as Parquet with
//!         the page index, statistics, Bloom filters and page checksums,
//!         sent to R storage nodes (Flight DoPut)
//!     └─> TableStore (store.rs): one SQLite transaction commits the
//!         statement's slices as a new version, or nothing does
//!  SELECT                                         a table at the latest version,
//!                                                 pinned for the whole query
//! ```
//!
//! A query reads each table at the version it found when it was planned
//! ([`VersionPin`] in its scans); slices a later commit removed keep their
//! files until no running query reads a version that has them
//! ([`OwnedTables::purge`]). When the catalog opens, every node is told
//! which slices of owned tables to keep, so files of statements that
//! never committed (a crash in the middle of a load) are removed.

mod compact;
mod delete;
pub mod generated;
pub mod ingest;
mod one_version;
mod provider;
mod schema;
pub mod statements;
mod store;
mod writer;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use datafusion::common::Result;

pub use compact::{compact, COMPACT_DELETED_SHARE};
pub use delete::{ChangeRowsExec, RowChange, CHANGE_SLICES_IN_FLIGHT};
pub use one_version::ReadOneVersion;
pub use provider::OwnedTable;
pub use schema::SieveSchema;
pub use store::{
    Change, CopyOf, Deletion, SliceEntry, Snapshot, TableEntry, TableLayout, TableStore,
    WrittenSlice, HEARTBEAT_MS, PAGE_ROWS_DEFAULT, PROCESS_LEASE_MS, ROW_GROUP_ROWS_DEFAULT,
    SLICE_ROWS_DEFAULT,
};
pub use writer::{TableWriter, SLICES_ENCODING_MAX, SLICE_BUFFER_BYTES_MAX};

use crate::catalog::{table_statistics, ClusterSlice};
use crate::{ClusterTable, StorageClient};

/// The tables users own on one cluster: their catalog and the nodes.
pub struct OwnedTables {
    store: TableStore,
    path: PathBuf,
    /// One client per storage node, as the cluster catalog's.
    clients: Vec<StorageClient>,
    /// Each node's byte-range base URL, if known.
    range_urls: Vec<Option<String>>,
    /// Versions running queries read, with how many read each.
    readers: Mutex<BTreeMap<u64, usize>>,
    /// Where slice files are written before they are sent.
    staging: PathBuf,
    /// What every writer of this process has loaded, for progress reports.
    progress: LoadProgress,
    /// The copies of every slice a scan was planned over, by its byte-range
    /// path (`slices/{storage name}/{file}`): where an NDP-off read fails
    /// over to ([`crate::ClusterRangeStore`]). Entries of purged slices go.
    routes: std::sync::RwLock<std::collections::HashMap<String, (u32, Vec<usize>)>>,
    /// The cluster catalog's node states: a node that failed a read or a
    /// write lately gets no new slices for [`crate::NODE_SUSPECT_MS`].
    health: NodeHealth,
    this: Weak<OwnedTables>,
}

/// Counters of the write path, kept since the catalog was opened, summed
/// over every writer: a statement's progress is the difference between two
/// readings ([`OwnedTables::load_progress`]).
#[derive(Debug, Default)]
pub struct LoadProgress {
    rows_taken: AtomicU64,
    slices_stored: AtomicU64,
    bytes_stored: AtomicU64,
}

/// One reading of [`LoadProgress`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadReading {
    /// Rows writers have taken (buffered, being encoded or stored).
    pub rows_taken: u64,
    /// Slices stored on all their nodes (not yet committed, maybe).
    pub slices_stored: u64,
    /// Bytes of those slices (one copy each).
    pub bytes_stored: u64,
}

impl LoadReading {
    /// What happened between `earlier` and this reading.
    pub fn since(&self, earlier: &LoadReading) -> LoadReading {
        LoadReading {
            rows_taken: self.rows_taken.saturating_sub(earlier.rows_taken),
            slices_stored: self.slices_stored.saturating_sub(earlier.slices_stored),
            bytes_stored: self.bytes_stored.saturating_sub(earlier.bytes_stored),
        }
    }
}

impl LoadProgress {
    pub(crate) fn took(&self, rows: u64) {
        self.rows_taken.fetch_add(rows, Ordering::Relaxed);
    }

    pub(crate) fn stored(&self, bytes: u64) {
        self.slices_stored.fetch_add(1, Ordering::Relaxed);
        self.bytes_stored.fetch_add(bytes, Ordering::Relaxed);
    }

    fn read(&self) -> LoadReading {
        LoadReading {
            rows_taken: self.rows_taken.load(Ordering::Relaxed),
            slices_stored: self.slices_stored.load(Ordering::Relaxed),
            bytes_stored: self.bytes_stored.load(Ordering::Relaxed),
        }
    }
}

impl fmt::Debug for OwnedTables {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("OwnedTables")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// The cluster catalog's view of its nodes' health, shared with writers.
#[derive(Debug, Clone)]
pub struct NodeHealth {
    /// [`crate::ClusterCatalog::nodes`].
    pub nodes: Arc<Vec<crate::catalog::NodeState>>,
    /// [`crate::ClusterCatalog::epoch`].
    pub epoch: std::time::Instant,
    /// Nodes that failed discovery ([`crate::ClusterCatalog::discovery_failures`]):
    /// scans read no copy there while another copy is on a node that
    /// answered, as a session over generated tables never knew of them.
    pub unreachable: Vec<usize>,
}

/// Keeps one version of the owned tables readable while it lives.
#[derive(Clone)]
pub struct VersionPin(Arc<PinInner>);

struct PinInner {
    tables: Weak<OwnedTables>,
    version: u64,
}

impl fmt::Debug for VersionPin {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "VersionPin({})", self.0.version)
    }
}

impl VersionPin {
    /// The version pinned.
    pub fn version(&self) -> u64 {
        self.0.version
    }
}

impl Drop for PinInner {
    fn drop(&mut self) {
        let Some(tables) = self.tables.upgrade() else {
            return;
        };
        let last = {
            let mut readers = tables.readers.lock().unwrap_or_else(|p| p.into_inner());
            let count = readers.entry(self.version).or_insert(1);
            *count -= 1;
            let last = *count == 0;
            if last {
                readers.remove(&self.version);
            }
            last
        };
        // Files the last reader of a version kept may go now.
        if last {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(async move {
                    if let Err(error) = tables.purge().await {
                        log::warn!("removing slices no version reads failed: {error}");
                    }
                });
            }
        }
    }
}

impl OwnedTables {
    /// Open the catalog at `path` for the cluster whose nodes `clients`
    /// reach, tell every node which slices of owned tables to keep, and
    /// remove what no version reads any more.
    pub async fn open(
        path: &Path,
        clients: Vec<StorageClient>,
        range_urls: Vec<Option<String>>,
        health: NodeHealth,
    ) -> Result<Arc<Self>> {
        let store = TableStore::open(path, clients.len())?;
        let staging = std::env::temp_dir().join(format!("sieve-writes-{}", std::process::id()));
        let tables = Arc::new_cyclic(|this| Self {
            store,
            path: path.to_path_buf(),
            clients,
            range_urls,
            readers: Mutex::new(BTreeMap::new()),
            staging,
            progress: LoadProgress::default(),
            routes: Default::default(),
            health,
            this: Weak::clone(this),
        });
        tables.retain_on_nodes().await;
        tables.purge().await?;
        // Tell the other processes sharing the catalog which versions this
        // one reads, while it lives; now and then remove what nobody reads.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let this = Arc::downgrade(&tables);
            runtime.spawn(async move {
                let mut beats = 0u64;
                loop {
                    tokio::time::sleep(std::time::Duration::from_millis(store::HEARTBEAT_MS)).await;
                    let Some(tables) = this.upgrade() else {
                        return;
                    };
                    let beating = Arc::clone(&tables);
                    match tokio::task::spawn_blocking(move || beating.beat()).await {
                        Ok(Ok(())) => {}
                        Ok(Err(error)) => log::warn!("table catalog heartbeat failed: {error}"),
                        Err(error) => log::warn!("table catalog heartbeat failed: {error}"),
                    }
                    beats += 1;
                    if beats.is_multiple_of(10) {
                        if let Err(error) = tables.purge().await {
                            log::warn!("removing slices no version reads failed: {error}");
                        }
                    }
                }
            });
        }
        Ok(tables)
    }

    /// The oldest version this process's queries read, or the latest.
    fn oldest_read_here(&self) -> Result<u64> {
        let readers = self.readers.lock().unwrap_or_else(|p| p.into_inner());
        match readers.keys().next() {
            Some(oldest) => Ok(*oldest),
            None => self.store.latest_version(),
        }
    }

    /// Refresh this process's row in the catalog's `processes`.
    fn beat(&self) -> Result<()> {
        // Read under the readers' lock: a pin taken after this reading has
        // a version at least the latest read here.
        let oldest = self.oldest_read_here()?;
        self.store.heartbeat(oldest)
    }

    /// The catalog.
    pub fn store(&self) -> &TableStore {
        &self.store
    }

    /// Where the catalog lives.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of storage nodes.
    pub fn nodes(&self) -> usize {
        self.clients.len()
    }

    /// The client of node `node`.
    pub(crate) fn client(&self, node: usize) -> &StorageClient {
        &self.clients[node]
    }

    /// What the writers of this process have loaded so far (a statement's
    /// progress: a reading before it and one during it).
    pub fn load_progress(&self) -> LoadReading {
        self.progress.read()
    }

    pub(crate) fn progress(&self) -> &LoadProgress {
        &self.progress
    }

    /// The slice number and the nodes holding copies of the slice file at
    /// byte-range path `path`, if a scan of this process was planned over it.
    pub fn route(&self, path: &str) -> Option<(u32, Vec<usize>)> {
        self.routes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(path)
            .cloned()
    }

    /// Remember that `node` failed a write (down or unreachable), as the
    /// cluster catalog remembers failed reads.
    pub(crate) fn mark_write_failed(&self, node: usize) {
        let now = self.health.epoch.elapsed().as_millis() as u64 + 1;
        if let Some(state) = self.health.nodes.get(node) {
            state.failed_at_ms.store(now, Ordering::Relaxed);
        }
    }

    /// Whether `node` failed a request in the last [`crate::NODE_SUSPECT_MS`].
    pub(crate) fn write_suspect(&self, node: usize) -> bool {
        let now = self.health.epoch.elapsed().as_millis() as u64 + 1;
        self.health.nodes.get(node).is_some_and(|state| {
            let failed = state.failed_at_ms.load(Ordering::Relaxed);
            failed != 0 && now.saturating_sub(failed) < crate::NODE_SUSPECT_MS
        })
    }

    /// Directory for slice files on their way to the nodes.
    pub(crate) fn staging(&self) -> &Path {
        &self.staging
    }

    /// Pin the latest version: what a query reads.
    pub fn pin_latest(&self) -> Result<VersionPin> {
        // The version is read and registered under the readers' lock, so a
        // purge that looks at the readers after a commit sees this one.
        let mut readers = self.readers.lock().unwrap_or_else(|p| p.into_inner());
        let version = self.store.latest_version()?;
        *readers.entry(version).or_insert(0) += 1;
        Ok(VersionPin(Arc::new(PinInner {
            tables: Weak::clone(&self.this),
            version,
        })))
    }

    /// Table `name` as of `pin`, as the scan reads it.
    pub fn cluster_table(&self, snapshot: &Snapshot, pin: &VersionPin) -> ClusterTable {
        let storage_name = snapshot.table.storage_name();
        let slices: Vec<ClusterSlice> = snapshot
            .slices
            .iter()
            .map(|slice| {
                let reachable: Vec<usize> = slice
                    .nodes
                    .iter()
                    .copied()
                    .filter(|node| !self.health.unreachable.contains(node))
                    .collect();
                // With no copy on a node that answered, the scan tries the
                // others and fails naming the slice.
                let replicas = if reachable.is_empty() {
                    slice.nodes.clone()
                } else {
                    reachable
                };
                let node = replicas.first().copied().unwrap_or(0);
                let base = self
                    .range_urls
                    .get(node)
                    .cloned()
                    .flatten()
                    .unwrap_or_else(|| "http://0.0.0.0:1".to_string());
                ClusterSlice {
                    summary: slice.summary.clone(),
                    node,
                    range_url: format!("{base}/slices/{storage_name}/{}", slice.summary.file),
                    replicas,
                    deleted: slice
                        .deleted
                        .as_ref()
                        .map(|vector| (Arc::clone(vector), slice.deleted_rows)),
                }
            })
            .collect();
        {
            let mut routes = self.routes.write().unwrap_or_else(|p| p.into_inner());
            for slice in &slices {
                if let Some((_, path)) = slice.range_url.split_once("/slices/") {
                    routes
                        .entry(format!("slices/{path}"))
                        .or_insert_with(|| (slice.summary.slice, slice.replicas.clone()));
                }
            }
        }
        let statistics = table_statistics(&snapshot.table.schema, &slices);
        ClusterTable {
            name: storage_name,
            schema: std::sync::Arc::clone(&snapshot.table.schema),
            slices,
            statistics,
            pin: Some(pin.clone()),
        }
    }

    /// Tell every node which slices of owned tables to keep (the rest are
    /// files no committed version refers to). A node that does not answer
    /// is told next time.
    async fn retain_on_nodes(&self) {
        let retained = match self.store.retained() {
            Ok(retained) => retained,
            Err(error) => {
                log::warn!("cannot list the slices to keep: {error}");
                return;
            }
        };
        let body = serde_json::to_vec(&sieve_format::writes::RetainSlices { tables: retained })
            .expect("lists of numbers are JSON");
        // A node that failed lately (discovery) is told at the next open.
        let answers =
            futures::future::join_all(self.clients.iter().enumerate().map(|(node, client)| {
                let body = body.clone();
                async move {
                    if self.write_suspect(node) {
                        return Err(datafusion::common::exec_datafusion_err!("it failed lately"));
                    }
                    client
                        .slice_action(sieve_format::writes::RETAIN_SLICES_ACTION, body)
                        .await
                }
            }))
            .await;
        for (client, answer) in self.clients.iter().zip(answers) {
            match answer {
                Ok(0) => {}
                Ok(removed) => log::info!(
                    "storage node {} removed {removed} slice(s) no committed version refers to",
                    client.url()
                ),
                Err(error) => log::warn!(
                    "storage node {} was not told which slices to keep: {error}",
                    client.url()
                ),
            }
        }
    }

    /// Delete from the nodes the files of slices no version a running query
    /// reads still has; marks them purged. A node that fails keeps its
    /// copy until the next purge or the next `retain-slices`.
    pub async fn purge(&self) -> Result<()> {
        // Versions read here and by the other live processes on this catalog.
        let here = self.oldest_read_here()?;
        let oldest_read = match self.store.oldest_read_elsewhere()? {
            Some(elsewhere) => here.min(elsewhere),
            None => here,
        };
        let doomed = self.store.purgeable(oldest_read)?;
        if doomed.is_empty() {
            return Ok(());
        }
        let mut by_node: BTreeMap<(usize, String), Vec<u32>> = BTreeMap::new();
        for (table, slice, nodes) in &doomed {
            for node in nodes {
                by_node
                    .entry((*node, table.clone()))
                    .or_default()
                    .push(*slice);
            }
        }
        let mut failed = std::collections::BTreeSet::new();
        for ((node, table), slices) in by_node {
            let Some(client) = self.clients.get(node) else {
                continue;
            };
            // A node that failed lately keeps its copies until a later purge.
            if self.write_suspect(node) {
                failed.extend(slices);
                continue;
            }
            let body = serde_json::to_vec(&sieve_format::writes::RemoveSlices {
                table,
                slices: slices.clone(),
            })
            .expect("JSON");
            if let Err(error) = client
                .slice_action(sieve_format::writes::REMOVE_SLICES_ACTION, body)
                .await
            {
                log::warn!(
                    "storage node {} kept slices to remove: {error}",
                    client.url()
                );
                failed.extend(slices);
            }
        }
        let purged: Vec<u32> = doomed
            .iter()
            .map(|(_, slice, _)| *slice)
            .filter(|slice| !failed.contains(slice))
            .collect();
        {
            let mut routes = self.routes.write().unwrap_or_else(|p| p.into_inner());
            for (table, slice, _) in doomed
                .iter()
                .filter(|(_, slice, _)| !failed.contains(slice))
            {
                routes.remove(&format!(
                    "slices/{table}/{}",
                    sieve_format::slice_file_name(table, *slice)
                ));
            }
        }
        self.store.mark_purged(&purged)
    }

    /// Remove the files of slices a failed statement wrote (best effort:
    /// the next `retain-slices` removes what this misses) and forget them.
    /// Every node is asked, not only those reserved: a slice whose node
    /// failed went to another.
    pub(crate) async fn abandon(&self, storage_name: &str, written: &[(u32, Vec<usize>)]) {
        for (slice, _) in written {
            // A node that failed lately is not waited for: the next
            // catalog open tells it which slices to keep.
            for node in (0..self.clients.len()).filter(|&node| !self.write_suspect(node)) {
                let body = serde_json::to_vec(&sieve_format::writes::RemoveSlices {
                    table: storage_name.to_string(),
                    slices: vec![*slice],
                })
                .expect("JSON");
                let _ = self.clients[node]
                    .slice_action(sieve_format::writes::REMOVE_SLICES_ACTION, body)
                    .await;
            }
        }
        let numbers: Vec<u32> = written.iter().map(|(slice, _)| *slice).collect();
        if let Err(error) = self.store.abandon(&numbers) {
            log::warn!("cannot forget abandoned slices: {error}");
        }
    }
}
