//! The catalog of tables users own, with their versions, in SQLite.
//!
//! DuckLake keeps its catalog in a SQL database; so does Sieve: one SQLite
//! file on the compute node (WAL mode, `synchronous=FULL`), each commit one
//! SQLite transaction, so a commit is atomic and durable or absent.
//!
//! ```text
//!  versions  version (one per commit, increasing), when, what
//!  tables    id, name, schema (Arrow IPC), sort key, replicas, slice rows,
//!            created (version; NULL while a CREATE ... AS is loading),
//!            dropped (version; NULL while it exists)
//!  slices    number (unique, never reused), table id, nodes, summary (JSON),
//!            added (version; NULL until committed), removed (version),
//!            purged (its files deleted from the nodes)
//!  deletions slice, version, vector (a roaring bitmap of the slice's
//!            deleted row positions, all of them as of that version), count
//!  meta      next slice number, node count
//! ```
//!
//! The state of a table at version `v` is its slices with `added <= v` and
//! not `removed <= v`. A query takes the latest version when it is planned
//! and reads that for its whole run ([`Snapshot`]); files of slices
//! removed at a version no running query reads are deleted from the nodes
//! ([`super::OwnedTables::purge`]). Slice numbers are reserved in a
//! transaction of their own before their files are written, so a number is
//! never used twice, even across a crash; a slice row without `added` is a
//! load that never committed, removed when the catalog opens.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use arrow::datatypes::{Schema, SchemaRef};
use datafusion::common::{exec_err, plan_err, DataFusionError, Result};
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};
use sieve_format::SliceSummary;

/// Version of the catalog's own layout, in `meta`.
const LAYOUT_VERSION: &str = "1";

/// Default of a table's `slice_rows`: rows per slice.
pub const SLICE_ROWS_DEFAULT: u64 = 1_000_000;

/// Default of a table's `row_group_rows`: rows per Parquet row group.
pub const ROW_GROUP_ROWS_DEFAULT: u64 = 131_072;

/// Default of a table's `page_rows`: rows per data page, the resolution of
/// page skipping.
pub const PAGE_ROWS_DEFAULT: u64 = 4096;

/// Default of a table's `layout`: planned (see [`TableLayout::planned`]).
pub(super) const LAYOUT_PLANNED_DEFAULT: bool = true;

/// How a table is laid out on the nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableLayout {
    /// Columns each slice is sorted by (empty: the order rows arrive in).
    pub sort_key: Vec<String>,
    /// Copies of each slice, on as many nodes.
    pub replicas: usize,
    /// Rows per slice, at most.
    pub slice_rows: u64,
    /// Rows per row group in a slice, at most.
    pub row_group_rows: u64,
    /// Rows per data page, at most.
    pub page_rows: u64,
    /// Whether each load plans its columns' encodings and codecs from a
    /// sample of its rows (`layout = 'planned'`, [`sieve_format::planner`])
    /// instead of the fixed layout (`layout = 'fixed'`: dictionary and
    /// zstd(1) everywhere).
    pub planned: bool,
    /// A sorted copy: the table whose rows it holds, and the version read
    /// ([`TableStore::copy_is_current`]).
    pub copy_of: Option<CopyOf>,
}

/// What a sorted copy copies: the same rows as table `table` at `version`,
/// sorted by the copy's own sort key. A scan of `table` may read the copy
/// instead while `table` has not changed since `version`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOf {
    /// The source table's id.
    pub table: u64,
    /// The version of the source table the copy holds.
    pub version: u64,
}

impl TableLayout {
    /// The default layout with `replicas` copies: no sort key.
    pub fn with_replicas(replicas: usize) -> Self {
        Self {
            sort_key: vec![],
            replicas,
            slice_rows: SLICE_ROWS_DEFAULT,
            row_group_rows: ROW_GROUP_ROWS_DEFAULT,
            page_rows: PAGE_ROWS_DEFAULT,
            planned: LAYOUT_PLANNED_DEFAULT,
            copy_of: None,
        }
    }

    /// The Parquet layout of this table's slices.
    pub fn slice_layout(&self) -> sieve_format::SliceLayout {
        let default = sieve_format::SliceLayout::default();
        sieve_format::SliceLayout {
            slice_rows_max: usize::try_from(self.slice_rows).unwrap_or(usize::MAX),
            row_group_rows_max: usize::try_from(self.row_group_rows).unwrap_or(usize::MAX),
            data_page_rows_max: usize::try_from(self.page_rows).unwrap_or(usize::MAX),
            planned: self.planned,
            ..default
        }
    }
}

/// A table as the catalog records it.
#[derive(Debug, Clone)]
pub struct TableEntry {
    /// Catalog id (part of the storage name).
    pub id: u64,
    /// SQL name.
    pub name: String,
    /// Columns.
    pub schema: SchemaRef,
    /// Layout.
    pub layout: TableLayout,
}

impl TableEntry {
    /// The table's name on the storage nodes.
    pub fn storage_name(&self) -> String {
        sieve_format::writes::storage_name(&self.name, self.id)
    }
}

/// One committed slice.
#[derive(Debug, Clone)]
pub struct SliceEntry {
    /// Slice number.
    pub slice: u32,
    /// Indexes of the nodes holding a copy, first one first.
    pub nodes: Vec<usize>,
    /// What its node answered when it was written.
    pub summary: SliceSummary,
    /// Its deleted rows at the version read: a serialized roaring bitmap
    /// of row positions in the file, `None` if none were deleted.
    pub deleted: Option<Arc<Vec<u8>>>,
    /// How many rows `deleted` holds.
    pub deleted_rows: u64,
    /// The version that wrote `deleted` (0: none).
    pub deleted_version: u64,
}

/// New deleted rows of one slice, for a commit.
#[derive(Debug, Clone)]
pub struct Deletion {
    /// Slice number.
    pub slice: u32,
    /// Every deleted row of the slice after the commit (a serialized
    /// roaring bitmap).
    pub vector: Vec<u8>,
    /// How many rows `vector` holds.
    pub rows: u64,
    /// The deletion version the statement read (`SliceEntry::deleted_version`):
    /// if another commit changed the slice's deletions since, this one
    /// conflicts.
    pub base: u64,
}

/// A table at one version.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// The version read.
    pub version: u64,
    /// The table.
    pub table: TableEntry,
    /// Its slices at that version.
    pub slices: Vec<SliceEntry>,
}

/// A slice written but not yet committed.
#[derive(Debug, Clone)]
pub struct WrittenSlice {
    /// Slice number (reserved).
    pub slice: u32,
    /// Nodes holding it.
    pub nodes: Vec<usize>,
    /// Its summary, as its first node answered.
    pub summary: SliceSummary,
}

/// What one commit does to one table.
#[derive(Debug, Default)]
pub struct Change {
    /// Slices to add.
    pub added: Vec<WrittenSlice>,
    /// Slices to remove (numbers).
    pub removed: Vec<u32>,
    /// Make the table (created by `CREATE ... AS` with `created` NULL)
    /// visible in this commit.
    pub publish: bool,
    /// Rows deleted from slices that stay.
    pub deletions: Vec<Deletion>,
    /// Slices that must still have the deletion version given when the
    /// commit lands (a compaction rewrote their rows as of it).
    pub expect: Vec<(u32, u64)>,
}

/// The SQLite catalog. One connection, behind a mutex: commits are short.
#[derive(Debug)]
pub struct TableStore {
    connection: Mutex<Connection>,
    /// This process's row in `processes` (see [`PROCESS_LEASE_MS`]).
    process: String,
}

/// How long a compute process that shares the catalog counts as alive
/// after its last heartbeat (`processes.heartbeat_ms`), in milliseconds.
/// While alive, the versions its queries read are kept (no other process
/// removes their files) and the slices it reserved are not taken for a
/// crashed statement's. It beats every [`HEARTBEAT_MS`].
pub const PROCESS_LEASE_MS: u64 = 30_000;

/// How often an open catalog refreshes its process's row.
pub const HEARTBEAT_MS: u64 = 1_000;

/// Whether a process with id `pid` runs on this host.
fn pid_alive(pid: i64) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 checks the process exists; nothing is sent.
    let answer = unsafe { libc::kill(pid, 0) };
    answer == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as i64)
}

fn sql_error(error: rusqlite::Error) -> DataFusionError {
    DataFusionError::External(Box::new(error))
}

impl TableStore {
    /// Open (or create) the catalog at `path` for a cluster of `nodes`
    /// storage nodes. A catalog made for another number of nodes is refused:
    /// its slices name nodes by position.
    pub fn open(path: &Path, nodes: usize) -> Result<Self> {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let connection = Connection::open(path).map_err(|error| {
            DataFusionError::Plan(format!(
                "the table catalog {} cannot be opened: {error}",
                path.display()
            ))
        })?;
        connection
            .execute_batch(
                "PRAGMA journal_mode=WAL;
                 PRAGMA synchronous=FULL;
                 PRAGMA foreign_keys=ON;
                 CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
                 CREATE TABLE IF NOT EXISTS versions(
                     version INTEGER PRIMARY KEY,
                     committed_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
                     statement TEXT NOT NULL);
                 CREATE TABLE IF NOT EXISTS tables(
                     id INTEGER PRIMARY KEY AUTOINCREMENT,
                     name TEXT NOT NULL,
                     schema BLOB NOT NULL,
                     sort_key TEXT NOT NULL,
                     replicas INTEGER NOT NULL,
                     slice_rows INTEGER NOT NULL,
                     created INTEGER,
                     dropped INTEGER,
                     row_group_rows INTEGER NOT NULL DEFAULT 131072,
                     page_rows INTEGER NOT NULL DEFAULT 4096,
                     planned INTEGER NOT NULL DEFAULT 0);
                 CREATE UNIQUE INDEX IF NOT EXISTS live_table_names ON tables(name) WHERE dropped IS NULL;
                 CREATE TABLE IF NOT EXISTS slices(
                     slice INTEGER PRIMARY KEY,
                     table_id INTEGER NOT NULL REFERENCES tables(id),
                     nodes TEXT NOT NULL,
                     summary TEXT NOT NULL,
                     added INTEGER,
                     removed INTEGER,
                     purged INTEGER NOT NULL DEFAULT 0);
                 CREATE INDEX IF NOT EXISTS slices_of_table ON slices(table_id);
                 CREATE TABLE IF NOT EXISTS deletions(
                     slice INTEGER NOT NULL REFERENCES slices(slice),
                     version INTEGER NOT NULL,
                     vector BLOB NOT NULL,
                     deleted INTEGER NOT NULL,
                     PRIMARY KEY(slice, version));
                 -- Compute processes sharing this catalog: the oldest version
                 -- each reads, and when it last said so.
                 CREATE TABLE IF NOT EXISTS processes(
                     id TEXT PRIMARY KEY,
                     pid INTEGER NOT NULL,
                     oldest_read INTEGER NOT NULL,
                     heartbeat_ms INTEGER NOT NULL);
                 -- Slices reserved and not yet committed, by process.
                 CREATE TABLE IF NOT EXISTS reserved_by(
                     slice INTEGER PRIMARY KEY,
                     process TEXT NOT NULL);
                 -- Tables a CREATE ... AS is loading, by process.
                 CREATE TABLE IF NOT EXISTS creating_by(
                     table_id INTEGER PRIMARY KEY,
                     process TEXT NOT NULL);",
            )
            .map_err(sql_error)?;
        add_layout_columns(&connection)?;
        // Unique among the opens of this process and across processes.
        static OPENS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let process = format!(
            "{}-{:x}-{}",
            std::process::id(),
            now_ms(),
            OPENS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let store = Self {
            connection: Mutex::new(connection),
            process,
        };
        store.check_meta(nodes)?;
        let latest = store.latest_version()?;
        store.heartbeat(latest)?;
        Ok(store)
    }

    /// Say that this process is alive and reads no version older than
    /// `oldest_read` (until it says otherwise).
    pub fn heartbeat(&self, oldest_read: u64) -> Result<()> {
        let connection = self.lock();
        connection
            .execute(
                "INSERT INTO processes(id, pid, oldest_read, heartbeat_ms) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT(id) DO UPDATE SET oldest_read = ?3, heartbeat_ms = ?4",
                params![
                    self.process,
                    std::process::id() as i64,
                    oldest_read as i64,
                    now_ms()
                ],
            )
            .map_err(sql_error)?;
        Ok(())
    }

    /// The oldest version another live process sharing this catalog reads.
    pub fn oldest_read_elsewhere(&self) -> Result<Option<u64>> {
        let connection = self.lock();
        self.forget_dead_processes(&connection)?;
        connection
            .query_row(
                "SELECT MIN(oldest_read) FROM processes WHERE id != ?1",
                [&self.process],
                |row| row.get::<_, Option<i64>>(0),
            )
            .map(|oldest| oldest.map(|oldest| oldest as u64))
            .map_err(sql_error)
    }

    /// Remove the rows of processes that are gone, with their slice and
    /// table reservations: no heartbeat for [`PROCESS_LEASE_MS`], or no
    /// process of their pid on this host (a SQLite catalog is shared only
    /// by processes of one host), as after a crash.
    fn forget_dead_processes(&self, connection: &Connection) -> Result<()> {
        let alive_since = now_ms() - PROCESS_LEASE_MS as i64;
        let mut statement = connection
            .prepare("SELECT id, pid, heartbeat_ms FROM processes WHERE id != ?1")
            .map_err(sql_error)?;
        let rows = statement
            .query_map([&self.process], |row| {
                Ok((
                    row.get::<_, String>(0)?,
                    row.get::<_, i64>(1)?,
                    row.get::<_, i64>(2)?,
                ))
            })
            .map_err(sql_error)?;
        let mut dead = Vec::new();
        for row in rows {
            let (id, pid, heartbeat) = row.map_err(sql_error)?;
            if heartbeat <= alive_since || !pid_alive(pid) {
                dead.push(id);
            }
        }
        drop(statement);
        for id in dead {
            connection
                .execute("DELETE FROM processes WHERE id = ?1", [&id])
                .map_err(sql_error)?;
        }
        connection
            .execute(
                "DELETE FROM reserved_by WHERE process NOT IN (SELECT id FROM processes)",
                [],
            )
            .map_err(sql_error)?;
        connection
            .execute(
                "DELETE FROM creating_by WHERE process NOT IN (SELECT id FROM processes)",
                [],
            )
            .map_err(sql_error)?;
        Ok(())
    }

    /// This process is done with the catalog.
    fn leave(&self) {
        let connection = self.lock();
        let _ = connection.execute("DELETE FROM processes WHERE id = ?1", [&self.process]);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.connection
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn check_meta(&self, nodes: usize) -> Result<()> {
        let mut connection = self.lock();
        let transaction = connection
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(sql_error)?;
        let meta = |key: &str| -> Result<Option<String>> {
            transaction
                .query_row("SELECT value FROM meta WHERE key = ?1", [key], |row| {
                    row.get(0)
                })
                .optional()
                .map_err(sql_error)
        };
        match meta("layout")? {
            None => {
                transaction
                    .execute(
                        "INSERT INTO meta(key, value) VALUES ('layout', ?1), ('nodes', ?2), ('next_slice', '1')",
                        params![LAYOUT_VERSION, nodes.to_string()],
                    )
                    .map_err(sql_error)?;
            }
            Some(layout) if layout != LAYOUT_VERSION => {
                return plan_err!(
                    "the table catalog has layout {layout}; this Sieve reads layout {LAYOUT_VERSION}"
                );
            }
            Some(_) => {
                let recorded: usize = meta("nodes")?
                    .and_then(|value| value.parse().ok())
                    .unwrap_or(0);
                if recorded != nodes {
                    return plan_err!(
                        "the table catalog was made for {recorded} storage node(s), and this cluster has {nodes}: its slices name nodes by position"
                    );
                }
            }
        }
        transaction.commit().map_err(sql_error)
    }

    /// The latest committed version (0: nothing committed yet).
    pub fn latest_version(&self) -> Result<u64> {
        let connection = self.lock();
        connection
            .query_row(
                "SELECT COALESCE(MAX(version), 0) FROM versions",
                [],
                |row| row.get::<_, i64>(0),
            )
            .map(|version| version as u64)
            .map_err(sql_error)
    }

    /// Tables that exist at `version`, by name.
    pub fn tables_at(&self, version: u64) -> Result<BTreeMap<String, TableEntry>> {
        let connection = self.lock();
        let mut statement = connection
            .prepare(
                "SELECT id, name, schema, sort_key, replicas, slice_rows, row_group_rows, page_rows, planned, copy_of, copy_version FROM tables
                 WHERE created IS NOT NULL AND created <= ?1 AND (dropped IS NULL OR dropped > ?1)",
            )
            .map_err(sql_error)?;
        let rows = statement
            .query_map([version as i64], table_row)
            .map_err(sql_error)?;
        let mut tables = BTreeMap::new();
        for row in rows {
            let entry = decode_table(row.map_err(sql_error)?)?;
            tables.insert(entry.name.clone(), entry);
        }
        Ok(tables)
    }

    /// Table `name` at `version`, with its slices then.
    pub fn snapshot(&self, name: &str, version: u64) -> Result<Option<Snapshot>> {
        let Some(table) = self.tables_at(version)?.remove(name) else {
            return Ok(None);
        };
        let slices = self.slices_at(table.id, version)?;
        Ok(Some(Snapshot {
            version,
            table,
            slices,
        }))
    }

    /// The sorted copies of table `table` that exist at `version`, current
    /// or not ([`Self::copy_is_current`]), by name.
    pub fn copies_at(&self, table: u64, version: u64) -> Result<Vec<TableEntry>> {
        Ok(self
            .tables_at(version)?
            .into_values()
            .filter(|entry| entry.layout.copy_of.is_some_and(|copy| copy.table == table))
            .collect())
    }

    /// Whether a copy of `copy.table` at `copy.version` holds the same rows
    /// as that table at `version`: the table exists then, under the same
    /// id, and no commit in between added, removed or deleted from any of
    /// its slices.
    pub fn copy_is_current(&self, copy: CopyOf, version: u64) -> Result<bool> {
        if version < copy.version {
            return Ok(false);
        }
        let connection = self.lock();
        connection
            .query_row(
                "SELECT EXISTS(SELECT 1 FROM tables WHERE id = ?1 AND created IS NOT NULL
                         AND created <= ?2 AND (dropped IS NULL OR dropped > ?3))
                   AND NOT EXISTS(SELECT 1 FROM slices WHERE table_id = ?1
                         AND ((added > ?2 AND added <= ?3) OR (removed > ?2 AND removed <= ?3)))
                   AND NOT EXISTS(SELECT 1 FROM deletions d JOIN slices s ON s.slice = d.slice
                         WHERE s.table_id = ?1 AND d.version > ?2 AND d.version <= ?3)",
                params![copy.table as i64, copy.version as i64, version as i64],
                |row| row.get::<_, bool>(0),
            )
            .map_err(sql_error)
    }

    fn slices_at(&self, table: u64, version: u64) -> Result<Vec<SliceEntry>> {
        let connection = self.lock();
        let mut statement = connection
            .prepare(
                "SELECT s.slice, s.nodes, s.summary, d.vector, d.deleted, d.version
                 FROM slices s LEFT JOIN deletions d ON d.slice = s.slice AND d.version = (
                     SELECT MAX(version) FROM deletions WHERE slice = s.slice AND version <= ?2)
                 WHERE s.table_id = ?1 AND s.added IS NOT NULL AND s.added <= ?2
                   AND (s.removed IS NULL OR s.removed > ?2)
                 ORDER BY s.slice",
            )
            .map_err(sql_error)?;
        let rows = statement
            .query_map(params![table as i64, version as i64], |row| {
                Ok((
                    row.get::<_, i64>(0)?,
                    row.get::<_, String>(1)?,
                    row.get::<_, String>(2)?,
                    row.get::<_, Option<Vec<u8>>>(3)?,
                    row.get::<_, Option<i64>>(4)?,
                    row.get::<_, Option<i64>>(5)?,
                ))
            })
            .map_err(sql_error)?;
        let mut slices = Vec::new();
        for row in rows {
            let (slice, nodes, summary, vector, deleted_rows, deleted_version) =
                row.map_err(sql_error)?;
            slices.push(SliceEntry {
                deleted: vector.map(Arc::new),
                deleted_rows: deleted_rows.unwrap_or(0) as u64,
                deleted_version: deleted_version.unwrap_or(0) as u64,
                slice: slice as u32,
                nodes: serde_json::from_str(&nodes)
                    .map_err(|error| DataFusionError::External(Box::new(error)))?,
                summary: serde_json::from_str(&summary)
                    .map_err(|error| DataFusionError::External(Box::new(error)))?,
            });
        }
        Ok(slices)
    }

    /// Create table `name`. With `publish`, in a commit of its own (the
    /// table exists from the version returned); without, it is invisible
    /// until a [`Change`] with `publish` commits it (`CREATE ... AS`).
    /// Returns the table and the version (`None` unpublished).
    pub fn create_table(
        &self,
        name: &str,
        schema: &Schema,
        layout: &TableLayout,
        publish: bool,
        statement: &str,
    ) -> Result<(TableEntry, Option<u64>)> {
        let mut connection = self.lock();
        let transaction = connection
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(sql_error)?;
        let exists: bool = transaction
            .query_row(
                "SELECT COUNT(*) > 0 FROM tables WHERE name = ?1 AND dropped IS NULL AND created IS NOT NULL",
                [name],
                |row| row.get(0),
            )
            .map_err(sql_error)?;
        if exists {
            return plan_err!("table '{name}' already exists");
        }
        // An unpublished table of the same name (a CREATE ... AS that
        // failed or is still loading) gives way.
        transaction
            .execute(
                "UPDATE tables SET dropped = -1 WHERE name = ?1 AND dropped IS NULL AND created IS NULL",
                [name],
            )
            .map_err(sql_error)?;
        let version = if publish {
            Some(next_version(&transaction, statement)?)
        } else {
            None
        };
        let schema_bytes = encode_schema(schema)?;
        transaction
            .execute(
                "INSERT INTO tables(name, schema, sort_key, replicas, slice_rows, created, row_group_rows, page_rows, planned, copy_of, copy_version) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
                params![
                    name,
                    schema_bytes,
                    serde_json::to_string(&layout.sort_key).expect("strings are JSON"),
                    layout.replicas as i64,
                    layout.slice_rows as i64,
                    version.map(|version| version as i64),
                    layout.row_group_rows as i64,
                    layout.page_rows as i64,
                    i64::from(layout.planned),
                    layout.copy_of.map(|copy| copy.table as i64),
                    layout.copy_of.map(|copy| copy.version as i64),
                ],
            )
            .map_err(sql_error)?;
        let id = transaction.last_insert_rowid() as u64;
        if !publish {
            transaction
                .execute(
                    "INSERT INTO creating_by(table_id, process) VALUES (?1, ?2)",
                    params![id as i64, self.process],
                )
                .map_err(sql_error)?;
        }
        transaction.commit().map_err(sql_error)?;
        Ok((
            TableEntry {
                id,
                name: name.to_string(),
                schema: Arc::new(schema.clone()),
                layout: layout.clone(),
            },
            version,
        ))
    }

    /// Drop table `name` in a commit of its own; its slices are removed at
    /// that version. Returns the version, or `None` if there is no such table.
    pub fn drop_table(&self, name: &str, statement: &str) -> Result<Option<u64>> {
        let mut connection = self.lock();
        let transaction = connection
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(sql_error)?;
        let id: Option<i64> = transaction
            .query_row(
                "SELECT id FROM tables WHERE name = ?1 AND dropped IS NULL AND created IS NOT NULL",
                [name],
                |row| row.get(0),
            )
            .optional()
            .map_err(sql_error)?;
        let Some(id) = id else {
            return Ok(None);
        };
        let version = next_version(&transaction, statement)? as i64;
        transaction
            .execute(
                "UPDATE tables SET dropped = ?1 WHERE id = ?2",
                params![version, id],
            )
            .map_err(sql_error)?;
        transaction
            .execute(
                "UPDATE slices SET removed = ?1 WHERE table_id = ?2 AND added IS NOT NULL AND removed IS NULL",
                params![version, id],
            )
            .map_err(sql_error)?;
        transaction.commit().map_err(sql_error)?;
        Ok(Some(version as u64))
    }

    /// Reserve `count` slice numbers for table `table` on `nodes` each
    /// (one list per slice), durably, before their files are written.
    pub fn reserve_slice(&self, table: u64, nodes: &[usize]) -> Result<u32> {
        let mut connection = self.lock();
        let transaction = connection
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(sql_error)?;
        let next: i64 = transaction
            .query_row(
                "SELECT CAST(value AS INTEGER) FROM meta WHERE key = 'next_slice'",
                [],
                |row| row.get(0),
            )
            .map_err(sql_error)?;
        if next > i64::from(u32::MAX) {
            return exec_err!("the table catalog has used every slice number");
        }
        transaction
            .execute(
                "UPDATE meta SET value = ?1 WHERE key = 'next_slice'",
                [(next + 1).to_string()],
            )
            .map_err(sql_error)?;
        transaction
            .execute(
                "INSERT INTO slices(slice, table_id, nodes, summary) VALUES (?1, ?2, ?3, '{}')",
                params![
                    next,
                    table as i64,
                    serde_json::to_string(nodes).expect("integers are JSON")
                ],
            )
            .map_err(sql_error)?;
        transaction
            .execute(
                "INSERT INTO reserved_by(slice, process) VALUES (?1, ?2)",
                params![next, self.process],
            )
            .map_err(sql_error)?;
        transaction.commit().map_err(sql_error)?;
        Ok(next as u32)
    }

    /// Commit `change` to table `table` as one new version. Fails, changing
    /// nothing, if the table was dropped meanwhile or a slice to remove is
    /// no longer there (another statement removed it first).
    pub fn commit(&self, table: u64, change: &Change, statement: &str) -> Result<u64> {
        let mut connection = self.lock();
        let transaction = connection
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(sql_error)?;
        let (created, dropped): (Option<i64>, Option<i64>) = transaction
            .query_row(
                "SELECT created, dropped FROM tables WHERE id = ?1",
                [table as i64],
                |row| Ok((row.get(0)?, row.get(1)?)),
            )
            .optional()
            .map_err(sql_error)?
            .unwrap_or((None, Some(-1)));
        if dropped.is_some() || (created.is_none() && !change.publish) {
            return exec_err!(
                "the table was dropped while the statement ran; nothing was committed"
            );
        }
        // A sorted copy holds its table's rows as of one version: it takes
        // its rows once, when it is published, and no change after.
        let copy: Option<i64> = transaction
            .query_row(
                "SELECT copy_of FROM tables WHERE id = ?1",
                [table as i64],
                |row| row.get(0),
            )
            .map_err(sql_error)?;
        if copy.is_some() && !change.publish {
            return exec_err!(
                "a sorted copy does not change after it is made; nothing was committed"
            );
        }
        let version = next_version(&transaction, statement)? as i64;
        if change.publish {
            transaction
                .execute(
                    "UPDATE tables SET created = ?1 WHERE id = ?2",
                    params![version, table as i64],
                )
                .map_err(sql_error)?;
            transaction
                .execute(
                    "DELETE FROM creating_by WHERE table_id = ?1",
                    [table as i64],
                )
                .map_err(sql_error)?;
        }
        for slice in &change.added {
            let updated = transaction
                .execute(
                    "UPDATE slices SET added = ?1, nodes = ?2, summary = ?3
                     WHERE slice = ?4 AND table_id = ?5 AND added IS NULL",
                    params![
                        version,
                        serde_json::to_string(&slice.nodes).expect("integers are JSON"),
                        serde_json::to_string(&slice.summary).expect("a summary is JSON"),
                        slice.slice as i64,
                        table as i64
                    ],
                )
                .map_err(sql_error)?;
            if updated != 1 {
                return exec_err!("slice {} was not reserved for this table", slice.slice);
            }
            transaction
                .execute(
                    "DELETE FROM reserved_by WHERE slice = ?1",
                    [slice.slice as i64],
                )
                .map_err(sql_error)?;
        }
        for slice in &change.removed {
            let updated = transaction
                .execute(
                    "UPDATE slices SET removed = ?1
                     WHERE slice = ?2 AND table_id = ?3 AND added IS NOT NULL AND removed IS NULL",
                    params![version, *slice as i64, table as i64],
                )
                .map_err(sql_error)?;
            if updated != 1 {
                return exec_err!(
                    "conflict: slice {slice} was changed by another statement that committed first; nothing was committed"
                );
            }
        }
        let deletion_version = |slice: u32| -> Result<u64> {
            transaction
                .query_row(
                    "SELECT COALESCE(MAX(version), 0) FROM deletions WHERE slice = ?1",
                    [slice as i64],
                    |row| row.get::<_, i64>(0),
                )
                .map(|version| version as u64)
                .map_err(sql_error)
        };
        for (slice, base) in &change.expect {
            if deletion_version(*slice)? != *base {
                return exec_err!(
                    "conflict: rows of slice {slice} were deleted by another statement that committed first; nothing was committed"
                );
            }
        }
        for deletion in &change.deletions {
            let live: bool = transaction
                .query_row(
                    "SELECT COUNT(*) > 0 FROM slices WHERE slice = ?1 AND table_id = ?2
                     AND added IS NOT NULL AND removed IS NULL",
                    params![deletion.slice as i64, table as i64],
                    |row| row.get(0),
                )
                .map_err(sql_error)?;
            if !live || deletion_version(deletion.slice)? != deletion.base {
                return exec_err!(
                    "conflict: slice {} was changed by another statement that committed first; nothing was committed",
                    deletion.slice
                );
            }
            transaction
                .execute(
                    "INSERT INTO deletions(slice, version, vector, deleted) VALUES (?1, ?2, ?3, ?4)",
                    params![deletion.slice as i64, version, deletion.vector, deletion.rows as i64],
                )
                .map_err(sql_error)?;
        }
        transaction.commit().map_err(sql_error)?;
        Ok(version as u64)
    }

    /// Forget reserved slices that were never committed (a failed
    /// statement), returning them with their nodes so their files can be
    /// removed.
    pub fn abandon(&self, slices: &[u32]) -> Result<()> {
        let connection = self.lock();
        for slice in slices {
            connection
                .execute(
                    "DELETE FROM slices WHERE slice = ?1 AND added IS NULL",
                    [*slice as i64],
                )
                .map_err(sql_error)?;
            connection
                .execute("DELETE FROM reserved_by WHERE slice = ?1", [*slice as i64])
                .map_err(sql_error)?;
        }
        Ok(())
    }

    /// Slices whose files may go: never committed, or removed at a version
    /// at most `oldest_read` (the oldest version a running query reads, or
    /// the latest), not yet purged. By storage name, with their nodes.
    pub fn purgeable(&self, oldest_read: u64) -> Result<Vec<(String, u32, Vec<usize>)>> {
        let connection = self.lock();
        let mut statement = connection
            .prepare(
                "SELECT t.name, t.id, s.slice, s.nodes FROM slices s JOIN tables t ON t.id = s.table_id
                 WHERE s.purged = 0 AND s.removed IS NOT NULL AND s.removed <= ?1",
            )
            .map_err(sql_error)?;
        let rows = statement
            .query_map([oldest_read as i64], |row| {
                Ok((
                    row.get::<_, String>(0)?,
                    row.get::<_, i64>(1)?,
                    row.get::<_, i64>(2)?,
                    row.get::<_, String>(3)?,
                ))
            })
            .map_err(sql_error)?;
        let mut found = Vec::new();
        for row in rows {
            let (name, id, slice, nodes) = row.map_err(sql_error)?;
            let nodes: Vec<usize> = serde_json::from_str(&nodes)
                .map_err(|error| DataFusionError::External(Box::new(error)))?;
            found.push((
                sieve_format::writes::storage_name(&name, id as u64),
                slice as u32,
                nodes,
            ));
        }
        Ok(found)
    }

    /// Record that the files of `slices` are gone from their nodes.
    pub fn mark_purged(&self, slices: &[u32]) -> Result<()> {
        let connection = self.lock();
        for slice in slices {
            connection
                .execute(
                    "UPDATE slices SET purged = 1 WHERE slice = ?1",
                    [*slice as i64],
                )
                .map_err(sql_error)?;
        }
        Ok(())
    }

    /// Every slice each node should keep: committed and not purged, or
    /// reserved by a live process (a statement still running elsewhere),
    /// by storage name (what `retain-slices` sends). Slices reserved by a
    /// process that is gone (crashed: no heartbeat for
    /// [`PROCESS_LEASE_MS`]) are forgotten first: their statements are over.
    pub fn retained(&self) -> Result<BTreeMap<String, Vec<u32>>> {
        let connection = self.lock();
        self.forget_dead_processes(&connection)?;
        connection
            .execute(
                "DELETE FROM slices WHERE added IS NULL AND slice NOT IN (SELECT slice FROM reserved_by)",
                [],
            )
            .map_err(sql_error)?;
        connection
            .execute(
                "UPDATE tables SET dropped = -1 WHERE created IS NULL AND dropped IS NULL
                 AND id NOT IN (SELECT table_id FROM creating_by)",
                [],
            )
            .map_err(sql_error)?;
        let mut statement = connection
            .prepare(
                "SELECT t.name, t.id, s.slice FROM slices s JOIN tables t ON t.id = s.table_id
                 WHERE s.purged = 0",
            )
            .map_err(sql_error)?;
        let rows = statement
            .query_map([], |row| {
                Ok((
                    row.get::<_, String>(0)?,
                    row.get::<_, i64>(1)?,
                    row.get::<_, i64>(2)?,
                ))
            })
            .map_err(sql_error)?;
        let mut kept: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        for row in rows {
            let (name, id, slice) = row.map_err(sql_error)?;
            kept.entry(sieve_format::writes::storage_name(&name, id as u64))
                .or_default()
                .push(slice as u32);
        }
        Ok(kept)
    }
}

impl Drop for TableStore {
    fn drop(&mut self) {
        self.leave();
    }
}

type TableRow = (
    i64,
    String,
    Vec<u8>,
    String,
    i64,
    i64,
    i64,
    i64,
    i64,
    Option<i64>,
    Option<i64>,
);

fn table_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<TableRow> {
    Ok((
        row.get(0)?,
        row.get(1)?,
        row.get(2)?,
        row.get(3)?,
        row.get(4)?,
        row.get(5)?,
        row.get(6)?,
        row.get(7)?,
        row.get(8)?,
        row.get(9)?,
        row.get(10)?,
    ))
}

/// Catalogs made before tables had `row_group_rows`, `page_rows` and
/// `planned` get the columns, with the layout every table had then.
fn add_layout_columns(connection: &Connection) -> Result<()> {
    let mut statement = connection
        .prepare("SELECT name FROM pragma_table_info('tables')")
        .map_err(sql_error)?;
    let columns = statement
        .query_map([], |row| row.get::<_, String>(0))
        .map_err(sql_error)?
        .collect::<rusqlite::Result<Vec<String>>>()
        .map_err(sql_error)?;
    for (column, default) in [
        ("row_group_rows", ROW_GROUP_ROWS_DEFAULT),
        ("page_rows", PAGE_ROWS_DEFAULT),
        ("planned", 0),
    ] {
        if !columns.iter().any(|name| name == column) {
            connection
                .execute_batch(&format!(
                    "ALTER TABLE tables ADD COLUMN {column} INTEGER NOT NULL DEFAULT {default}"
                ))
                .map_err(sql_error)?;
        }
    }
    // Sorted copies (NULL: not a copy).
    for column in ["copy_of", "copy_version"] {
        if !columns.iter().any(|name| name == column) {
            connection
                .execute_batch(&format!("ALTER TABLE tables ADD COLUMN {column} INTEGER"))
                .map_err(sql_error)?;
        }
    }
    Ok(())
}

fn decode_table(
    (
        id,
        name,
        schema,
        sort_key,
        replicas,
        slice_rows,
        row_group_rows,
        page_rows,
        planned,
        copy_of,
        copy_version,
    ): TableRow,
) -> Result<TableEntry> {
    Ok(TableEntry {
        id: id as u64,
        name,
        schema: Arc::new(decode_schema(&schema)?),
        layout: TableLayout {
            sort_key: serde_json::from_str(&sort_key)
                .map_err(|error| DataFusionError::External(Box::new(error)))?,
            replicas: replicas as usize,
            slice_rows: slice_rows as u64,
            row_group_rows: row_group_rows.max(1) as u64,
            page_rows: page_rows.max(1) as u64,
            planned: planned != 0,
            copy_of: copy_of.zip(copy_version).map(|(table, version)| CopyOf {
                table: table as u64,
                version: version as u64,
            }),
        },
    })
}

fn next_version(transaction: &rusqlite::Transaction<'_>, statement: &str) -> Result<u64> {
    let statement: String = statement.chars().take(1000).collect();
    transaction
        .execute("INSERT INTO versions(statement) VALUES (?1)", [statement])
        .map_err(sql_error)?;
    Ok(transaction.last_insert_rowid() as u64)
}

fn encode_schema(schema: &Schema) -> Result<Vec<u8>> {
    let options = arrow::ipc::writer::IpcWriteOptions::default();
    let data = arrow::ipc::writer::IpcDataGenerator::default();
    let mut tracker = arrow::ipc::writer::DictionaryTracker::new(false);
    let encoded = data.schema_to_bytes_with_dictionary_tracker(schema, &mut tracker, &options);
    Ok(encoded.ipc_message)
}

fn decode_schema(bytes: &[u8]) -> Result<Schema> {
    let message = arrow::ipc::root_as_message(bytes).map_err(|error| {
        DataFusionError::Internal(format!("a stored schema is damaged: {error}"))
    })?;
    let ipc_schema = message
        .header_as_schema()
        .ok_or_else(|| DataFusionError::Internal("a stored schema is damaged".to_string()))?;
    Ok(arrow::ipc::convert::fb_to_schema(ipc_schema))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::datatypes::{DataType, Field};

    fn layout() -> TableLayout {
        TableLayout {
            sort_key: vec!["a".into()],
            replicas: 1,
            slice_rows: 10,
            row_group_rows: ROW_GROUP_ROWS_DEFAULT,
            page_rows: PAGE_ROWS_DEFAULT,
            planned: false,
            copy_of: None,
        }
    }

    fn summary(slice: u32) -> SliceSummary {
        SliceSummary {
            table: "t@1".into(),
            slice,
            rows: 3,
            bytes: 100,
            row_groups: 1,
            pages: 1,
            columns: vec![],
            file: sieve_format::slice_file_name("t@1", slice),
            table_slices: None,
            row_group_rows: vec![],
        }
    }

    #[test]
    fn versions_isolate_what_each_commit_did() {
        let directory = tempfile_dir();
        let store = TableStore::open(&directory.join("catalog.sqlite"), 3).unwrap();
        let schema = Schema::new(vec![Field::new("a", DataType::Int64, true)]);
        let (table, created) = store
            .create_table("t", &schema, &layout(), true, "CREATE")
            .unwrap();
        let created = created.unwrap();
        assert!(store
            .create_table("t", &schema, &layout(), true, "again")
            .is_err());
        let first = store.reserve_slice(table.id, &[0]).unwrap();
        let second = store.reserve_slice(table.id, &[1]).unwrap();
        assert_ne!(first, second);
        let written = |slice| WrittenSlice {
            slice,
            nodes: vec![0],
            summary: summary(slice),
        };
        let v1 = store
            .commit(
                table.id,
                &Change {
                    added: vec![written(first)],
                    ..Default::default()
                },
                "INSERT",
            )
            .unwrap();
        let v2 = store
            .commit(
                table.id,
                &Change {
                    added: vec![written(second)],
                    removed: vec![first],
                    ..Default::default()
                },
                "UPDATE",
            )
            .unwrap();
        let slices = |version| {
            store
                .snapshot("t", version)
                .unwrap()
                .unwrap()
                .slices
                .iter()
                .map(|s| s.slice)
                .collect::<Vec<_>>()
        };
        assert_eq!(slices(created), Vec::<u32>::new());
        assert_eq!(slices(v1), vec![first]);
        assert_eq!(slices(v2), vec![second]);
        // Removing a slice twice is a conflict, and changes nothing.
        assert!(store
            .commit(
                table.id,
                &Change {
                    removed: vec![first],
                    ..Default::default()
                },
                "again"
            )
            .is_err());
        assert_eq!(store.latest_version().unwrap(), v2);
        // Deletions: each commit names the deletion version it read.
        let deletion = |base| Deletion {
            slice: second,
            vector: vec![1, 2, 3],
            rows: 2,
            base,
        };
        let change = |base| Change {
            deletions: vec![deletion(base)],
            ..Default::default()
        };
        let v3 = store.commit(table.id, &change(0), "DELETE").unwrap();
        assert!(
            store.commit(table.id, &change(0), "DELETE").is_err(),
            "a lost update"
        );
        let at_v3 = store.snapshot("t", v3).unwrap().unwrap();
        assert_eq!(at_v3.slices[0].deleted_version, v3);
        assert_eq!(at_v3.slices[0].deleted_rows, 2);
        assert_eq!(
            store.snapshot("t", v2).unwrap().unwrap().slices[0].deleted,
            None
        );
        let v2 = store.commit(table.id, &change(v3), "DELETE").unwrap();
        assert_eq!(store.purgeable(v1).unwrap().len(), 0);
        assert_eq!(store.purgeable(v2).unwrap().len(), 1);
        let dropped = store.drop_table("t", "DROP").unwrap().unwrap();
        assert!(store.snapshot("t", dropped).unwrap().is_none());
        assert_eq!(slices(v2), vec![second], "an old version stays readable");
        // Reopened with another node count: refused.
        drop(store);
        assert!(TableStore::open(&directory.join("catalog.sqlite"), 2).is_err());
        let store = TableStore::open(&directory.join("catalog.sqlite"), 3).unwrap();
        assert_eq!(store.latest_version().unwrap(), dropped);
        std::fs::remove_dir_all(directory).unwrap();
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let directory = std::env::temp_dir().join(format!(
            "sieve-store-test-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::create_dir_all(&directory).unwrap();
        directory
    }
}
