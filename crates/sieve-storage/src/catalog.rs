//! The node's catalog: which slices of which tables live in its data directory.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::Array;
use arrow::datatypes::SchemaRef;
use datafusion::common::{plan_err, DataFusionError, Result, ScalarValue};
use datafusion::execution::cache::default_cache::DefaultCache;
use datafusion::execution::cache::{Cache, CacheKey, CacheValue};
use parquet::arrow::arrow_reader::statistics::StatisticsConverter;
use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions};
use parquet::file::metadata::{PageIndexPolicy, ParquetMetaData};
use sieve_format::{ColumnSummary, SliceSummary, TableSummary};

/// One slice the node holds. Its summary stays in memory for as long as
/// the node serves it; what a request needs beyond that (the Parquet
/// metadata with its page index, the footer as stored, the page checksums:
/// [`SliceDetails`]) is read from the file when first needed and kept in
/// the node's [`SliceDetailsCache`], bounded in bytes. A node's memory then
/// does not grow with the data it holds: at TPC-H SF 100 a node's 475
/// slices held about 120 MB of metadata in memory.
#[derive(Debug)]
pub struct CatalogSlice {
    /// What the node tells compute nodes about the slice.
    pub summary: SliceSummary,
    /// Absolute path of the slice file.
    pub path: PathBuf,
    /// The slice's absolute path, as the local object store names it.
    pub object_path: object_store::path::Path,
    /// When the slice file was last written, as the file system says; with
    /// the size it is the file's version for HTTP readers (`ETag`,
    /// `Last-Modified`), and what a reload of its details is checked against.
    pub modified: std::time::SystemTime,
    /// Whether the slice carries page checksums (one written before they
    /// existed is served, but reported as unchecked in `stats`).
    pub checked: bool,
    /// Set when a read found a page that fails its checksum: this copy is
    /// damaged, and every later request for it is refused at once.
    pub corruption: std::sync::OnceLock<sieve_format::PageCorruption>,
    /// This slice's key in `details`: unique per slice the node opened, so
    /// a slice file written again is a new entry.
    key: SliceKey,
    details: Arc<SliceDetailsCache>,
}

/// What a request reads of a slice beyond its summary, decoded from the
/// file's footer: see [`CatalogSlice::details`].
#[derive(Debug)]
pub struct SliceDetails {
    /// Parquet metadata including the column and offset indexes.
    pub metadata: Arc<ParquetMetaData>,
    /// The file's footer as stored (its Thrift metadata, without the page
    /// indexes), shipped with a raw slice so the compute node can decode it.
    pub footer: bytes::Bytes,
    /// The CRC-32 of every page, from the footer; `None` for a slice written
    /// before page checksums.
    pub checksums: Option<sieve_format::PageChecksums>,
}

impl SliceDetails {
    /// Bytes this takes in memory, as the cache charges it.
    fn memory_size(&self) -> usize {
        let checksums = self.checksums.as_ref().map_or(0, |checksums| {
            checksums.len() * std::mem::size_of::<(std::ops::Range<u64>, u32)>()
        });
        self.metadata.memory_size() + self.footer.len() + checksums
    }
}

/// Default bound of the node's [`SliceDetailsCache`]: 16 MiB, about TPC-H
/// SF 10's metadata on each of three nodes (a lineitem slice's is about
/// 280 KB decoded; SF 100's is 130 MB per node). Reading a slice's details
/// again is cheap next to scanning it: with every lineitem slice read
/// again at SF 100, Q6's storage CPU spent 1.5% in it (perf), and the
/// node's peak fell from 222 MB to SF 10's 104 MB.
pub const SLICE_DETAILS_CACHE_BYTES_DEFAULT: usize = 16 * 1024 * 1024;

/// Slice details by slice, least recently used evicted past a bound in
/// bytes: DataFusion's own LRU cache. A request holds the details it took
/// (an `Arc`) until it ends, whatever the cache evicts meanwhile.
pub struct SliceDetailsCache {
    cache: DefaultCache<SliceKey, CachedDetails>,
    next_key: std::sync::atomic::AtomicU64,
    loads: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for SliceDetailsCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SliceDetailsCache")
            .field("bytes_max", &self.cache.cache_limit())
            .field("bytes", &self.cache.memory_used())
            .finish()
    }
}

impl SliceDetailsCache {
    /// An empty cache of at most `bytes_max` bytes (zero keeps nothing:
    /// every request reads its slice's footer).
    pub fn new(bytes_max: usize) -> Self {
        Self {
            cache: DefaultCache::new(bytes_max).with_name("sieve slice details"),
            next_key: std::sync::atomic::AtomicU64::new(0),
            loads: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Bytes the cached details take now.
    pub fn bytes(&self) -> usize {
        self.cache.memory_used()
    }

    /// The cache's bound, in bytes.
    pub fn bytes_max(&self) -> usize {
        self.cache.cache_limit()
    }

    /// Slices whose details were read from their file (at startup, and
    /// again after an eviction).
    pub fn loads(&self) -> u64 {
        self.loads.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn new_key(&self) -> SliceKey {
        SliceKey(
            self.next_key
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        )
    }

    fn keep(&self, key: &SliceKey, details: &Arc<SliceDetails>) {
        self.loads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // An entry larger than the whole bound is not kept (DefaultCache
        // refuses it); the request that read it still has it.
        self.cache.put(key, CachedDetails(Arc::clone(details)));
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct SliceKey(u64);

impl CacheKey for SliceKey {
    fn size(&self) -> usize {
        std::mem::size_of::<Self>()
    }

    fn table_ref(&self) -> Option<&datafusion::common::TableReference> {
        None
    }
}

#[derive(Clone)]
struct CachedDetails(Arc<SliceDetails>);

impl CacheValue for CachedDetails {
    fn size(&self) -> usize {
        self.0.memory_size()
    }
}

impl CatalogSlice {
    /// The slice's metadata, footer and page checksums: from the node's
    /// cache, or read again from the file, which must still be the one the
    /// node opened (same size and modification time). Blocking on a miss
    /// (reads and decodes the footer and page index). A file that changed
    /// or cannot be read again marks this copy corrupt, as a page failing
    /// its checksum does: the compute node reads another replica.
    pub fn details(&self) -> Result<Arc<SliceDetails>> {
        if let Some(CachedDetails(details)) = self.details.cache.get(&self.key) {
            return Ok(details);
        }
        if let Some(corruption) = self.corruption.get() {
            return Err(DataFusionError::External(Box::new(corruption.clone())));
        }
        let reread = || -> Result<SliceDetails> {
            let file = open_slice_file(&self.path)?;
            let now = file.metadata()?;
            if now.len() != self.summary.bytes || now.modified()? != self.modified {
                return plan_err!(
                    "it changed on disk since this node opened it ({} bytes then, {} now)",
                    self.summary.bytes,
                    now.len()
                );
            }
            read_details(&file, now.len())
        };
        match reread() {
            Ok(details) => {
                let details = Arc::new(details);
                self.details.keep(&self.key, &details);
                Ok(details)
            }
            Err(error) => Err(DataFusionError::External(Box::new(self.mark_corrupt(
                sieve_format::PageCorruption {
                    file: self.path.display().to_string(),
                    page_offset: 0,
                    page_bytes: self.summary.bytes,
                    reason: format!("its metadata could not be read again: {error}"),
                },
            )))),
        }
    }

    /// [`Self::details`] off the async runtime: a cache hit at once, a miss
    /// read on a blocking thread.
    pub async fn details_async(self: &Arc<Self>) -> Result<Arc<SliceDetails>> {
        if let Some(CachedDetails(details)) = self.details.cache.get(&self.key) {
            return Ok(details);
        }
        let slice = Arc::clone(self);
        tokio::task::spawn_blocking(move || slice.details())
            .await
            .map_err(|error| {
                DataFusionError::Internal(format!("reading a slice's metadata failed: {error}"))
            })?
    }

    /// Verify the whole pages inside `bytes`, read from the slice file at
    /// `offset`, against `details`' checksums. A mismatch marks the copy
    /// corrupt (and logs it, once); a copy already marked corrupt fails at
    /// once.
    pub fn check_pages(
        &self,
        details: &SliceDetails,
        offset: u64,
        bytes: &[u8],
    ) -> std::result::Result<(), sieve_format::PageCorruption> {
        if let Some(corruption) = self.corruption.get() {
            return Err(corruption.clone());
        }
        let Some(checksums) = &details.checksums else {
            return Ok(());
        };
        checksums
            .verify(&self.path.display().to_string(), offset, bytes)
            .map_err(|corruption| self.mark_corrupt(corruption))
    }

    /// Record that this copy is damaged; returns the corruption that counts
    /// (the first one found).
    pub fn mark_corrupt(
        &self,
        corruption: sieve_format::PageCorruption,
    ) -> sieve_format::PageCorruption {
        let mut first = false;
        let kept = self.corruption.get_or_init(|| {
            first = true;
            corruption
        });
        if first {
            log::error!(
                "slice {} of table '{}' is corrupt on this node, refusing it from now on: {kept}",
                self.summary.slice,
                self.summary.table
            );
        }
        kept.clone()
    }
}

impl SliceDetails {
    /// `range` grown to whole pages, so that every page it touches can be
    /// verified.
    pub fn widen(&self, range: std::ops::Range<u64>) -> std::ops::Range<u64> {
        match &self.checksums {
            Some(checksums) => checksums.widen(range),
            None => range,
        }
    }
}

/// One table the node holds part of.
#[derive(Debug, Clone)]
pub struct CatalogTable {
    /// Arrow schema shared by all slices of the table.
    pub schema: SchemaRef,
    /// Slices on this node, by slice number.
    pub slices: BTreeMap<u32, Arc<CatalogSlice>>,
}

/// Tables by name, as one reader sees them: a snapshot that slices added or
/// removed later do not change.
pub type CatalogTables = BTreeMap<String, Arc<CatalogTable>>;

/// All tables in one data directory. The tables found at startup, and the
/// slices written to the node or removed from it since ([`crate::ingest`]):
/// each change replaces the map readers share, so a request works on the
/// snapshot it took.
#[derive(Debug)]
pub struct NodeCatalog {
    root: PathBuf,
    tables: std::sync::RwLock<Arc<CatalogTables>>,
    /// Slice files found but not readable at startup, each with its error.
    unreadable: Vec<String>,
    /// The slices' metadata, footers and checksums, bounded in bytes.
    details: Arc<SliceDetailsCache>,
}

impl NodeCatalog {
    /// Read the catalog of the data directory `root`: every
    /// `TABLE/TABLE-NNNNN.parquet`. Temporary files of an interrupted load
    /// are ignored; a slice file that cannot be read (truncated, no valid
    /// footer) is logged by name, listed in [`Self::unreadable`] and left
    /// out, and the node serves the rest. The slices' details are kept in a
    /// cache of at most `details_bytes_max` bytes.
    pub fn open(root: &Path, details_bytes_max: usize) -> Result<Self> {
        let details = Arc::new(SliceDetailsCache::new(details_bytes_max));
        let root = root.canonicalize().map_err(|error| {
            DataFusionError::Plan(format!(
                "data directory {} cannot be opened: {error}",
                root.display()
            ))
        })?;
        let mut tables: CatalogTables = BTreeMap::new();
        let mut unreadable = Vec::new();
        let mut table_dirs: Vec<_> = std::fs::read_dir(&root)?.collect::<std::io::Result<_>>()?;
        table_dirs.sort_by_key(|entry| entry.file_name());
        for table_dir in table_dirs {
            // `file_type` does not follow symlinks: a linked table directory is skipped.
            if !table_dir.file_type()?.is_dir() {
                if table_dir.file_type()?.is_symlink() {
                    log::warn!(
                        "not serving {}: a symlink; a table must be a directory inside the data directory {}",
                        table_dir.path().display(),
                        root.display()
                    );
                }
                continue;
            }
            let table_name = table_dir.file_name().to_string_lossy().into_owned();
            let mut table: Option<CatalogTable> = None;
            for entry in std::fs::read_dir(table_dir.path())? {
                let entry = entry?;
                let file_name = entry.file_name().to_string_lossy().into_owned();
                let Some(slice_number) = parse_slice_number(&table_name, &file_name) else {
                    continue;
                };
                if let Some(reason) = outside_reason(&root, &entry) {
                    log::warn!(
                        "not serving {}: {reason}; a slice must be a regular file inside the data directory {}",
                        entry.path().display(),
                        root.display()
                    );
                    continue;
                }
                // A slice file that cannot be read is named and left out;
                // the node serves the rest (other replicas hold its copies).
                let (schema, slice) =
                    match open_slice(&root, &table_name, slice_number, &entry.path(), &details) {
                        Ok(opened) => opened,
                        Err(error) => {
                            log::error!(
                                "slice file {} cannot be read, not serving it: {error}",
                                entry.path().display()
                            );
                            unreadable.push(format!("{}: {error}", entry.path().display()));
                            continue;
                        }
                    };
                let table = table.get_or_insert_with(|| CatalogTable {
                    schema: Arc::clone(&schema),
                    slices: BTreeMap::new(),
                });
                if table.schema.fields() != schema.fields() {
                    return plan_err!(
                        "slice {} has a different schema from the other slices of {table_name}",
                        entry.path().display()
                    );
                }
                table.slices.insert(slice_number, Arc::new(slice));
            }
            if let Some(table) = table {
                tables.insert(table_name, Arc::new(table));
            }
        }
        Ok(Self {
            root,
            tables: std::sync::RwLock::new(Arc::new(tables)),
            unreadable,
            details,
        })
    }

    /// The cache of the slices' details.
    pub fn details_cache(&self) -> &SliceDetailsCache {
        &self.details
    }

    /// Slice files that could not be read at startup (each named, with its
    /// error); the node serves the others.
    pub fn unreadable(&self) -> &[String] {
        &self.unreadable
    }

    /// The data directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Tables by name, as they are now.
    pub fn tables(&self) -> Arc<CatalogTables> {
        Arc::clone(
            &self
                .tables
                .read()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        )
    }

    /// The table `name`, or a clear error naming what the node holds.
    pub fn table(&self, name: &str) -> Result<Arc<CatalogTable>> {
        let tables = self.tables();
        match tables.get(name) {
            Some(table) => Ok(Arc::clone(table)),
            None => plan_err!(
                "table '{name}' is not held by this storage node (it holds: {})",
                tables.keys().cloned().collect::<Vec<_>>().join(", ")
            ),
        }
    }

    /// Slice `slice` of table `name`, or a clear error.
    pub fn slice(&self, name: &str, slice: u32) -> Result<(Arc<CatalogTable>, Arc<CatalogSlice>)> {
        let table = self.table(name)?;
        match table.slices.get(&slice) {
            Some(found) => {
                let found = Arc::clone(found);
                Ok((table, found))
            }
            None => plan_err!(
                "slice {slice} of table '{name}' is not held by this storage node (it holds slices {:?})",
                table.slices.keys().collect::<Vec<_>>()
            ),
        }
    }

    /// The summary of every table, as sent to compute nodes.
    pub fn summaries(&self) -> Vec<TableSummary> {
        self.tables()
            .iter()
            .map(|(name, table)| TableSummary {
                name: name.clone(),
                slices: table
                    .slices
                    .values()
                    .map(|slice| slice.summary.clone())
                    .collect(),
            })
            .collect()
    }

    /// Find a slice by its file name, for the byte-range endpoint.
    pub fn slice_by_file(&self, table: &str, file: &str) -> Option<Arc<CatalogSlice>> {
        let slice = parse_slice_number(table, file)?;
        self.tables().get(table)?.slices.get(&slice).cloned()
    }

    /// Where slice `slice` of `table` lives in the data directory.
    pub fn slice_path(&self, table: &str, slice: u32) -> PathBuf {
        self.root
            .join(table)
            .join(sieve_format::slice_file_name(table, slice))
    }

    /// Serve the slice file already in place at [`Self::slice_path`] (written,
    /// synced and renamed by the caller): read its metadata and add it to
    /// the catalog. Its schema must be the table's, if the node holds
    /// others of its slices. Returns its summary.
    pub fn add_slice(&self, table: &str, slice: u32) -> Result<SliceSummary> {
        let path = self.slice_path(table, slice);
        let (schema, opened) = open_slice(&self.root, table, slice, &path, &self.details)?;
        let summary = opened.summary.clone();
        let mut tables = self
            .tables
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut next = tables.as_ref().clone();
        let entry = next.entry(table.to_string()).or_insert_with(|| {
            Arc::new(CatalogTable {
                schema: Arc::clone(&schema),
                slices: BTreeMap::new(),
            })
        });
        if entry.schema.fields() != schema.fields() {
            return plan_err!(
                "slice {slice} of table '{table}' has a different schema from the slices of it this node holds"
            );
        }
        Arc::make_mut(entry).slices.insert(slice, Arc::new(opened));
        *tables = Arc::new(next);
        Ok(summary)
    }

    /// Stop serving the given slices of `table` and delete their files (a
    /// table left without slices is forgotten). Requests that already took
    /// a slice finish with the file they opened. Returns the slices removed.
    pub fn remove_slices(&self, table: &str, slices: &[u32]) -> Result<usize> {
        let removed: Vec<Arc<CatalogSlice>> = {
            let mut tables = self
                .tables
                .write()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            let Some(held) = tables.get(table) else {
                return Ok(0);
            };
            let mut held = held.as_ref().clone();
            let removed: Vec<_> = slices
                .iter()
                .filter_map(|slice| held.slices.remove(slice))
                .collect();
            let mut next = tables.as_ref().clone();
            if held.slices.is_empty() {
                next.remove(table);
            } else {
                next.insert(table.to_string(), Arc::new(held));
            }
            *tables = Arc::new(next);
            removed
        };
        for slice in &removed {
            match std::fs::remove_file(&slice.path) {
                Ok(()) => {}
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => return Err(error.into()),
            }
        }
        if !removed.is_empty() {
            sync_directory(&self.root.join(table))?;
        }
        Ok(removed.len())
    }
}

/// Make a directory's entries (a rename, a removal) durable.
pub(crate) fn sync_directory(directory: &Path) -> std::io::Result<()> {
    File::open(directory)?.sync_all()
}

/// Why `entry` must not be served, if it must not: it is a symlink, not a
/// regular file, or (through a linked directory or a bind mount) its
/// canonical path is not under the canonical data directory `root`.
fn outside_reason(root: &Path, entry: &std::fs::DirEntry) -> Option<String> {
    let file_type = match entry.file_type() {
        Ok(file_type) => file_type,
        Err(error) => return Some(format!("its type cannot be read: {error}")),
    };
    if file_type.is_symlink() {
        return Some("it is a symlink".to_string());
    }
    if !file_type.is_file() {
        return Some("it is not a regular file".to_string());
    }
    match entry.path().canonicalize() {
        Ok(canonical) if canonical.starts_with(root) => None,
        Ok(canonical) => Some(format!("it resolves to {}", canonical.display())),
        Err(error) => Some(format!("its path cannot be resolved: {error}")),
    }
}

/// Open the slice file at `path` for reading, refusing a symlink (even one
/// put in place after the catalog was read): `O_NOFOLLOW`.
pub(crate) fn open_slice_file(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

/// `lineitem-00003.parquet` in table `lineitem` is slice 3.
fn parse_slice_number(table: &str, file_name: &str) -> Option<u32> {
    file_name
        .strip_prefix(table)?
        .strip_prefix('-')?
        .strip_suffix(".parquet")?
        .parse()
        .ok()
}

/// Open the slice file at `path`: its schema and summary, and its details
/// put in `cache` (the most recently opened stay there).
fn open_slice(
    root: &Path,
    table: &str,
    slice: u32,
    path: &Path,
    cache: &Arc<SliceDetailsCache>,
) -> Result<(SchemaRef, CatalogSlice)> {
    let file = open_slice_file(path)?;
    let file_metadata = file.metadata()?;
    let bytes = file_metadata.len();
    let modified = file_metadata.modified()?;
    let reader_metadata = ArrowReaderMetadata::load(&file, reader_options())?;
    // The schema without the file's key-value metadata: that describes one
    // slice (its distinct counts), not the table.
    let schema = Arc::new(
        reader_metadata
            .schema()
            .as_ref()
            .clone()
            .with_metadata(Default::default()),
    );
    let metadata = Arc::clone(reader_metadata.metadata());
    if schema
        .fields()
        .iter()
        .any(|field| field.data_type().is_nested())
    {
        return plan_err!(
            "slice {} has nested columns, which Sieve does not store",
            path.display()
        );
    }
    let offset_index = metadata.offset_index();
    let pages = offset_index
        .map(|row_groups| {
            row_groups
                .iter()
                .flatten()
                .map(|column| column.page_locations().len() as u64)
                .sum()
        })
        .unwrap_or(0);
    let distinct_counts = distinct_counts(&metadata, schema.fields().len());
    let columns = schema
        .fields()
        .iter()
        .zip(distinct_counts)
        .map(|(field, distinct_count)| ColumnSummary {
            distinct_count,
            ..column_summary(field.name(), &schema, &metadata)
        })
        .collect();
    let relative = path
        .strip_prefix(root)
        .map_err(|error| DataFusionError::Internal(error.to_string()))?;
    let summary = SliceSummary {
        table: table.to_string(),
        slice,
        rows: metadata.file_metadata().num_rows() as u64,
        bytes,
        row_groups: metadata.num_row_groups() as u32,
        pages,
        columns,
        file: relative
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_default(),
        table_slices: table_slices(&metadata),
        row_group_rows: metadata
            .row_groups()
            .iter()
            .map(|group| group.num_rows() as u64)
            .collect(),
    };
    let checksums = sieve_format::PageChecksums::from_metadata(&metadata)?;
    if checksums.is_none() {
        log::warn!(
            "slice {} has no page checksums (written before they existed): served unchecked",
            path.display()
        );
    }
    let object_path = object_store::path::Path::from_absolute_path(path)
        .map_err(|error| DataFusionError::External(Box::new(error)))?;
    let details = Arc::new(SliceDetails {
        metadata,
        footer: read_footer(&file, bytes)?,
        checksums,
    });
    let key = cache.new_key();
    cache.keep(&key, &details);
    Ok((
        schema,
        CatalogSlice {
            summary,
            path: path.to_path_buf(),
            object_path,
            modified,
            checked: details.checksums.is_some(),
            corruption: std::sync::OnceLock::new(),
            key,
            details: Arc::clone(cache),
        },
    ))
}

/// How the node reads a slice's metadata: with its page index.
fn reader_options() -> ArrowReaderOptions {
    ArrowReaderOptions::new().with_page_index_policy(PageIndexPolicy::Required)
}

/// Read a slice's details again from its open `file` (`bytes` long).
fn read_details(file: &File, bytes: u64) -> Result<SliceDetails> {
    let metadata = Arc::clone(ArrowReaderMetadata::load(file, reader_options())?.metadata());
    let checksums = sieve_format::PageChecksums::from_metadata(&metadata)?;
    Ok(SliceDetails {
        metadata,
        footer: read_footer(file, bytes)?,
        checksums,
    })
}

/// The Parquet footer of `file` (`bytes` long): the metadata before the
/// last eight bytes (its length, then `PAR1`).
fn read_footer(file: &File, bytes: u64) -> Result<bytes::Bytes> {
    use std::os::unix::fs::FileExt;
    let mut tail = [0u8; 8];
    if bytes < 12 {
        return plan_err!("slice file of {bytes} bytes is too short to be Parquet");
    }
    file.read_exact_at(&mut tail, bytes - 8)?;
    let length = u64::from(u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]));
    if &tail[4..] != b"PAR1" || length + 8 > bytes {
        return plan_err!("slice file has no valid Parquet footer");
    }
    let mut footer = vec![0u8; length as usize];
    file.read_exact_at(&mut footer, bytes - 8 - length)?;
    Ok(footer.into())
}

/// The per-column distinct counts the loader recorded, if it did.
fn distinct_counts(metadata: &ParquetMetaData, columns: usize) -> Vec<Option<u64>> {
    let recorded: Option<Vec<u64>> = metadata
        .file_metadata()
        .key_value_metadata()
        .and_then(|entries| {
            entries
                .iter()
                .find(|entry| entry.key == sieve_format::DISTINCT_COUNTS_KEY)
        })
        .and_then(|entry| entry.value.as_deref())
        .and_then(|value| serde_json::from_str(value).ok())
        .filter(|counts: &Vec<u64>| counts.len() == columns);
    match recorded {
        Some(counts) => counts.into_iter().map(Some).collect(),
        None => vec![None; columns],
    }
}

/// The table's slice count the load recorded in the slice, if any.
fn table_slices(metadata: &ParquetMetaData) -> Option<u32> {
    metadata
        .file_metadata()
        .key_value_metadata()?
        .iter()
        .find(|entry| entry.key == sieve_format::TABLE_SLICES_KEY)?
        .value
        .as_deref()?
        .parse()
        .ok()
}

/// Bytes of the pages of top-level column `name` before compression, over
/// all row groups.
fn uncompressed_bytes(name: &str, metadata: &ParquetMetaData) -> Option<u64> {
    let descriptor = metadata.file_metadata().schema_descr();
    let index = (0..descriptor.num_columns())
        .find(|&index| descriptor.column(index).path().parts() == [name.to_string()])?;
    metadata
        .row_groups()
        .iter()
        .map(|group| u64::try_from(group.column(index).uncompressed_size()).ok())
        .try_fold(0u64, |total, bytes| Some(total.saturating_add(bytes?)))
}

/// Min, max and NULL count of one column over all row groups of a slice.
fn column_summary(name: &str, schema: &SchemaRef, metadata: &ParquetMetaData) -> ColumnSummary {
    let mut summary = ColumnSummary {
        name: name.to_string(),
        min: None,
        max: None,
        null_count: None,
        distinct_count: None,
        uncompressed_bytes: uncompressed_bytes(name, metadata),
    };
    let Ok(converter) =
        StatisticsConverter::try_new(name, schema, metadata.file_metadata().schema_descr())
    else {
        return summary;
    };
    let fold = |array: Option<arrow::array::ArrayRef>, keep_larger: bool| -> Option<String> {
        let array = array?;
        let mut best: Option<ScalarValue> = None;
        for index in 0..array.len() {
            if array.is_null(index) {
                return None; // a row group without statistics: the slice's bound is unknown
            }
            let value = ScalarValue::try_from_array(&array, index).ok()?;
            best = match best {
                None => Some(value),
                Some(current) => {
                    let ordering = value.partial_cmp(&current)?;
                    let replace = if keep_larger {
                        ordering.is_gt()
                    } else {
                        ordering.is_lt()
                    };
                    Some(if replace { value } else { current })
                }
            };
        }
        // Arrow's display (`5.00`, `1992-01-01`), which the compute node casts back;
        // ScalarValue's Display is not parseable for decimals.
        let value = best?.to_array().ok()?;
        arrow::util::display::array_value_to_string(&value, 0).ok()
    };
    summary.min = fold(
        converter.row_group_mins(metadata.row_groups().iter()).ok(),
        false,
    );
    summary.max = fold(
        converter.row_group_maxes(metadata.row_groups().iter()).ok(),
        true,
    );
    summary.null_count = converter
        .row_group_null_counts(metadata.row_groups().iter())
        .ok()
        .and_then(|counts| (counts.null_count() == 0).then(|| counts.values().iter().sum()));
    summary
}

#[cfg(test)]
mod details_tests {
    use std::path::{Path, PathBuf};
    use std::sync::Arc;

    use arrow::array::{ArrayRef, Int64Array, StringArray};
    use arrow::record_batch::RecordBatch;
    use parquet::arrow::ArrowWriter;
    use parquet::file::properties::WriterProperties;

    use super::NodeCatalog;

    /// A data directory of its own with table `t` of `slices` slices, each
    /// with page checksums and a page index.
    fn data_directory(name: &str, slices: u32) -> PathBuf {
        let root =
            std::env::temp_dir().join(format!("sieve-details-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("t")).unwrap();
        for slice in 0..slices {
            write_slice(&root, slice, 10_000);
        }
        root
    }

    fn write_slice(root: &Path, slice: u32, rows: i64) {
        let path = root
            .join("t")
            .join(sieve_format::slice_file_name("t", slice));
        let keys: ArrayRef = Arc::new(Int64Array::from_iter_values(0..rows));
        let names: ArrayRef = Arc::new(StringArray::from_iter_values(
            (0..rows).map(|row| format!("name {row}")),
        ));
        let batch = RecordBatch::try_from_iter([("k", keys), ("name", names)]).unwrap();
        let properties = WriterProperties::builder()
            .set_data_page_row_count_limit(1_000)
            .set_write_batch_size(1_000)
            .build();
        let mut writer = ArrowWriter::try_new(
            std::fs::File::create(&path).unwrap(),
            batch.schema(),
            Some(properties),
        )
        .unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
        sieve_format::add_page_checksums(&path).unwrap();
    }

    #[test]
    fn details_stay_within_their_bound_and_are_read_again_when_evicted() {
        let root = data_directory("bound", 4);

        // Room for everything: each slice's details read once, at startup.
        let roomy = NodeCatalog::open(&root, 64 << 20).unwrap();
        let cache = roomy.details_cache();
        assert_eq!(cache.loads(), 4);
        let all = cache.bytes();
        assert!(all > 0 && all <= cache.bytes_max(), "{all}");
        let (_, slice) = roomy.slice("t", 2).unwrap();
        let first = slice.details().unwrap();
        assert!(Arc::ptr_eq(&first, &slice.details().unwrap()));
        assert_eq!(cache.loads(), 4, "a cached slice is not read again");
        assert!(first.checksums.is_some() && slice.checked);
        assert_eq!(first.metadata.file_metadata().num_rows(), 10_000);
        assert!(first.metadata.offset_index().is_some());

        // Room for about one slice: the bound holds, and every slice still
        // has its details, read again from its file.
        let one = all / 4 + all / 8;
        let tight = NodeCatalog::open(&root, one).unwrap();
        for round in 0..2 {
            for number in 0..4 {
                let (_, slice) = tight.slice("t", number).unwrap();
                let details = slice.details().unwrap();
                assert_eq!(details.metadata.file_metadata().num_rows(), 10_000);
                assert_eq!(
                    details.footer, first.footer,
                    "slice {number}, round {round}"
                );
                let bytes = tight.details_cache().bytes();
                assert!(bytes > 0 && bytes <= one, "{bytes} > {one}");
            }
        }
        assert!(
            tight.details_cache().loads() >= 4 + 6,
            "{}",
            tight.details_cache().loads()
        );

        // No room at all: nothing kept, every request reads its footer.
        let none = NodeCatalog::open(&root, 0).unwrap();
        let (_, slice) = none.slice("t", 0).unwrap();
        let loads = none.details_cache().loads();
        slice.details().unwrap();
        slice.details().unwrap();
        assert_eq!(none.details_cache().loads(), loads + 2);
        assert_eq!(none.details_cache().bytes(), 0);
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn a_slice_file_changed_under_the_node_is_refused_as_corrupt() {
        let root = data_directory("changed", 2);
        let catalog = NodeCatalog::open(&root, 0).unwrap();
        // Written again behind the node's back, with other rows.
        write_slice(&root, 0, 5_000);
        let (_, changed) = catalog.slice("t", 0).unwrap();
        let error = changed.details().unwrap_err();
        let corruption = sieve_format::find_page_corruption(&error)
            .unwrap_or_else(|| panic!("not a corruption: {error}"));
        assert!(
            corruption.reason.contains("changed on disk"),
            "{corruption}"
        );
        assert!(changed.corruption.get().is_some());
        assert!(changed.details().is_err(), "refused from now on");
        // Its neighbour is served as before.
        let (_, other) = catalog.slice("t", 1).unwrap();
        assert_eq!(
            other.details().unwrap().metadata.file_metadata().num_rows(),
            10_000
        );
        // A removed file is refused the same way, never a panic.
        std::fs::remove_file(&other.path).unwrap();
        assert!(other.details().is_err());
        let _ = std::fs::remove_dir_all(&root);
    }
}
