//! The node's catalog: which slices of which tables live in its data directory.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::Array;
use arrow::datatypes::SchemaRef;
use datafusion::common::{plan_err, DataFusionError, Result, ScalarValue};
use parquet::arrow::arrow_reader::statistics::StatisticsConverter;
use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions};
use parquet::file::metadata::{PageIndexPolicy, ParquetMetaData};
use sieve_format::{ColumnSummary, SliceSummary, TableSummary};

/// One slice the node holds, with its Parquet metadata (footer and page
/// index) loaded once at startup and kept in memory: every request for the
/// slice plans its coarse stage from it without touching the disk.
#[derive(Debug)]
pub struct CatalogSlice {
    /// What the node tells compute nodes about the slice.
    pub summary: SliceSummary,
    /// Absolute path of the slice file.
    pub path: PathBuf,
    /// The slice's absolute path, as the local object store names it.
    pub object_path: object_store::path::Path,
    /// Parquet metadata including the column and offset indexes.
    pub metadata: Arc<ParquetMetaData>,
    /// The file's footer as stored (its Thrift metadata, without the page
    /// indexes), shipped with a raw slice so the compute node can decode it.
    pub footer: bytes::Bytes,
    /// When the slice file was last written, as the file system says; with
    /// the size it is the file's version for HTTP readers (`ETag`,
    /// `Last-Modified`).
    pub modified: std::time::SystemTime,
    /// The CRC-32 of every page, from the footer; `None` for a slice written
    /// before page checksums (served, but reported as unchecked in `stats`).
    pub checksums: Option<sieve_format::PageChecksums>,
    /// Set when a read found a page that fails its checksum: this copy is
    /// damaged, and every later request for it is refused at once.
    pub corruption: std::sync::OnceLock<sieve_format::PageCorruption>,
}

impl CatalogSlice {
    /// Verify the whole pages inside `bytes`, read from the slice file at
    /// `offset`. A mismatch marks the copy corrupt (and logs it, once);
    /// a copy already marked corrupt fails at once.
    pub fn check_pages(
        &self,
        offset: u64,
        bytes: &[u8],
    ) -> std::result::Result<(), sieve_format::PageCorruption> {
        if let Some(corruption) = self.corruption.get() {
            return Err(corruption.clone());
        }
        let Some(checksums) = &self.checksums else {
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
}

impl NodeCatalog {
    /// Read the catalog of the data directory `root`: every
    /// `TABLE/TABLE-NNNNN.parquet`. Temporary files of an interrupted load
    /// are ignored; a slice file that cannot be read (truncated, no valid
    /// footer) is logged by name, listed in [`Self::unreadable`] and left
    /// out, and the node serves the rest.
    pub fn open(root: &Path) -> Result<Self> {
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
                    match open_slice(&root, &table_name, slice_number, &entry.path()) {
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
        })
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
        let (schema, opened) = open_slice(&self.root, table, slice, &path)?;
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

fn open_slice(
    root: &Path,
    table: &str,
    slice: u32,
    path: &Path,
) -> Result<(SchemaRef, CatalogSlice)> {
    let file = open_slice_file(path)?;
    let file_metadata = file.metadata()?;
    let bytes = file_metadata.len();
    let modified = file_metadata.modified()?;
    let options = ArrowReaderOptions::new().with_page_index_policy(PageIndexPolicy::Required);
    let reader_metadata = ArrowReaderMetadata::load(&file, options)?;
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
    Ok((
        schema,
        CatalogSlice {
            summary,
            path: path.to_path_buf(),
            object_path,
            metadata,
            footer: read_footer(&file, bytes)?,
            modified,
            checksums,
            corruption: std::sync::OnceLock::new(),
        },
    ))
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
