//! How a slice is laid out on disk: row groups, pages, codecs, indexes.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::errors::{ParquetError, Result};
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::schema::types::ColumnPath;

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
}

impl Default for SliceLayout {
    fn default() -> Self {
        Self {
            slice_rows_max: 1_000_000,
            row_group_rows_max: 131_072,
            data_page_rows_max: 4096,
            data_page_bytes_max: 256 * 1024,
            bloom_filter_fpp: 0.01,
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

/// Write `batches` as one slice at `path`, atomically: the data goes to a
/// temporary file that is synced and renamed into place, so readers see either
/// no slice or the whole slice. Returns the number of rows written.
pub fn write_slice(
    path: &Path,
    schema: &SchemaRef,
    layout: &SliceLayout,
    batches: impl IntoIterator<Item = std::result::Result<RecordBatch, arrow::error::ArrowError>>,
) -> Result<usize> {
    let parent = path.parent().ok_or_else(|| {
        ParquetError::General(format!("slice path {} has no parent", path.display()))
    })?;
    std::fs::create_dir_all(parent)?;
    let temporary = path.with_extension("parquet.tmp");
    let file = File::create(&temporary)?;
    let mut writer = ArrowWriter::try_new(
        file,
        std::sync::Arc::clone(schema),
        Some(layout.writer_properties(schema)),
    )?;
    let mut rows = 0;
    for batch in batches {
        let batch = batch?;
        rows += batch.num_rows();
        writer.write(&batch)?;
    }
    let mut file = writer.into_inner()?;
    file.flush()?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&temporary, path)?;
    Ok(rows)
}
