//! How a slice is laid out on disk: row groups, pages, codecs, indexes.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::errors::{ParquetError, Result};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::schema::types::ColumnPath;

/// Key of the Parquet key-value metadata entry holding the number of distinct
/// values of every column in the slice (a JSON list in schema order). The
/// compute node uses it to estimate how many groups a GROUP BY makes per slice.
pub const DISTINCT_COUNTS_KEY: &str = "sieve.distinct_counts";

/// Key of the Parquet key-value metadata entry holding how many slices the
/// slice's table has over the whole cluster (a decimal number), where the
/// load knew it. A compute node that cannot reach every storage node checks
/// with it that every slice still has a live replica.
pub const TABLE_SLICES_KEY: &str = "sieve.table_slices";

/// The physical layout of the slices of one table.
///
/// Defaults were chosen by measurement (see README, "Page size"): pages of
/// 4096 rows give the page index enough resolution to skip most of a slice for
/// a selective predicate on a sorted column, while keeping page headers and
/// index entries well under 1% of the data.
#[derive(Debug, Clone, PartialEq)]
pub struct SliceLayout {
    /// Upper bound on rows in one slice (one Parquet file). A slice is the unit
    /// of distribution across storage nodes and of one storage request.
    pub slice_rows_max: usize,
    /// Upper bound on rows in one row group inside a slice.
    pub row_group_rows_max: usize,
    /// Upper bound on rows in one data page: the resolution of page skipping.
    pub data_page_rows_max: usize,
    /// Upper bound on the encoded bytes of one data page.
    pub data_page_bytes_max: usize,
    /// Target false-positive probability of the Bloom filters on key columns.
    pub bloom_filter_fpp: f64,
    /// Whether a load through the write path plans each column's encoding
    /// and codec from a sample ([`crate::planner`]); the properties
    /// [`Self::writer_properties`] gives are the fixed layout either way.
    pub planned: bool,
}

impl Default for SliceLayout {
    fn default() -> Self {
        Self {
            slice_rows_max: 1_000_000,
            row_group_rows_max: 131_072,
            data_page_rows_max: 4096,
            data_page_bytes_max: 256 * 1024,
            bloom_filter_fpp: 0.01,
            planned: true,
        }
    }
}

impl SliceLayout {
    /// Parquet writer settings for a table with `schema`.
    ///
    /// Every column gets page-level statistics (so the column index is
    /// written) and the offset index; columns whose name ends in `key` get a
    /// Bloom filter, since equality and join predicates target them.
    pub fn writer_properties(&self, schema: &SchemaRef) -> WriterProperties {
        let mut builder = WriterProperties::builder()
            .set_max_row_group_row_count(Some(self.row_group_rows_max))
            .set_data_page_row_count_limit(self.data_page_rows_max)
            .set_data_page_size_limit(self.data_page_bytes_max)
            // The row-count limit is checked once per write batch, so the batch
            // must be smaller than a page for the limit to hold.
            .set_write_batch_size(1024.min(self.data_page_rows_max))
            .set_statistics_enabled(EnabledStatistics::Page)
            .set_compression(Compression::ZSTD(
                ZstdLevel::try_new(1).expect("level 1 is valid"),
            ))
            .set_created_by(format!("sieve {}", env!("CARGO_PKG_VERSION")));
        for field in schema.fields() {
            if field.name().ends_with("key") {
                let path = ColumnPath::from(field.name().as_str());
                builder = builder
                    .set_column_bloom_filter_enabled(path.clone(), true)
                    .set_column_bloom_filter_fpp(path, self.bloom_filter_fpp);
            }
        }
        builder.build()
    }
}

/// The file name of slice `slice` of `table` in the table's directory:
/// `lineitem`, 3 is `lineitem-00003.parquet`.
pub fn slice_file_name(table: &str, slice: u32) -> String {
    format!("{table}-{slice:05}.parquet")
}

/// Write `batches` as one slice at `path`, atomically: the data goes to a
/// temporary file that is synced and renamed into place, so readers see either
/// no slice or the whole slice. Returns the number of rows written.
pub fn write_slice(
    path: &Path,
    schema: &SchemaRef,
    layout: &SliceLayout,
    batches: impl IntoIterator<Item = std::result::Result<RecordBatch, arrow::error::ArrowError>>,
) -> Result<usize> {
    write_table_slice(path, schema, layout, None, batches)
}

/// Like [`write_slice`], recording that the table has `table_slices` slices
/// in all ([`TABLE_SLICES_KEY`]), if known.
pub fn write_table_slice(
    path: &Path,
    schema: &SchemaRef,
    layout: &SliceLayout,
    table_slices: Option<u32>,
    batches: impl IntoIterator<Item = std::result::Result<RecordBatch, arrow::error::ArrowError>>,
) -> Result<usize> {
    write_slice_with_properties(
        path,
        schema,
        layout.writer_properties(schema),
        table_slices,
        batches,
    )
}

/// Like [`write_table_slice`], with the Parquet writer settings given
/// (a table a user owns adds Bloom filters on its sort key).
pub fn write_slice_with_properties(
    path: &Path,
    schema: &SchemaRef,
    properties: WriterProperties,
    table_slices: Option<u32>,
    batches: impl IntoIterator<Item = std::result::Result<RecordBatch, arrow::error::ArrowError>>,
) -> Result<usize> {
    let parent = path.parent().ok_or_else(|| {
        ParquetError::General(format!("slice path {} has no parent", path.display()))
    })?;
    std::fs::create_dir_all(parent)?;
    let temporary = path.with_extension("parquet.tmp");
    let file = File::create(&temporary)?;
    let mut writer = ArrowWriter::try_new(file, std::sync::Arc::clone(schema), Some(properties))?;
    let mut rows = 0;
    let mut distinct = DistinctCounter::new(schema)?;
    for batch in batches {
        let batch = batch?;
        rows += batch.num_rows();
        distinct.update(&batch)?;
        writer.write(&batch)?;
    }
    writer.append_key_value_metadata(KeyValue::new(
        DISTINCT_COUNTS_KEY.to_string(),
        serde_json::to_string(&distinct.finish()).expect("a list of integers is JSON"),
    ));
    if let Some(table_slices) = table_slices {
        writer.append_key_value_metadata(KeyValue::new(
            TABLE_SLICES_KEY.to_string(),
            table_slices.to_string(),
        ));
    }
    let mut file = writer.into_inner()?;
    file.flush()?;
    drop(file);
    crate::checksum::add_page_checksums(&temporary)?;
    File::open(&temporary)?.sync_all()?;
    std::fs::rename(&temporary, path)?;
    Ok(rows)
}

/// Copy the slice file `from` to `to` (a replica), atomically: the copy is
/// written under a temporary name, synced and renamed into place.
pub fn copy_slice(from: &Path, to: &Path) -> Result<()> {
    let parent = to.parent().ok_or_else(|| {
        ParquetError::General(format!("slice path {} has no parent", to.display()))
    })?;
    std::fs::create_dir_all(parent)?;
    let temporary = to.with_extension("parquet.tmp");
    std::fs::copy(from, &temporary)?;
    File::open(&temporary)?.sync_all()?;
    std::fs::rename(&temporary, to)?;
    Ok(())
}

/// Counts the distinct values of every column of a slice while it is written.
///
/// Values are compared through Arrow's row format (which covers every type)
/// and remembered as 64-bit hashes: two different values collide with
/// probability about n²/2⁶⁵, negligible for a slice of a million rows, and a
/// collision only lowers an estimate.
struct DistinctCounter {
    converters: Vec<arrow::row::RowConverter>,
    seen: Vec<std::collections::HashSet<u64>>,
}

impl DistinctCounter {
    fn new(schema: &SchemaRef) -> Result<Self> {
        let converters = schema
            .fields()
            .iter()
            .map(|field| {
                arrow::row::RowConverter::new(vec![arrow::row::SortField::new(
                    field.data_type().clone(),
                )])
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|error| ParquetError::General(error.to_string()))?;
        let seen = vec![std::collections::HashSet::new(); schema.fields().len()];
        Ok(Self { converters, seen })
    }

    fn update(&mut self, batch: &RecordBatch) -> Result<()> {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        let hasher = BuildHasherDefault::<DefaultHasher>::default();
        for ((converter, seen), column) in self
            .converters
            .iter()
            .zip(self.seen.iter_mut())
            .zip(batch.columns())
        {
            let rows = converter
                .convert_columns(std::slice::from_ref(column))
                .map_err(|error| ParquetError::General(error.to_string()))?;
            seen.extend(rows.iter().map(|row| hasher.hash_one(row.as_ref())));
        }
        Ok(())
    }

    fn finish(self) -> Vec<u64> {
        self.seen.iter().map(|seen| seen.len() as u64).collect()
    }
}
