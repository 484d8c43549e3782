//! Completing a slice a busy storage node served raw.
//!
//! The node shipped the Parquet footer and the column chunks the fragment
//! needs, as stored. Here they become a file held in memory, and the same
//! fragment runs over it with the same operators the node would have used
//! ([`sieve_fragment::slice_plan`]), so the scan's output does not depend on
//! who did the work.

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use datafusion::common::{exec_datafusion_err, Result};
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::parquet::ParquetAccessPlan;
use datafusion::datasource::physical_plan::{ParquetFileMetrics, ParquetFileReaderFactory};
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use futures::future::BoxFuture;
use futures::FutureExt;
use parquet::arrow::arrow_reader::ArrowReaderOptions;
use parquet::arrow::async_reader::AsyncFileReader;
use parquet::errors::ParquetError;
use parquet::file::metadata::{ParquetMetaData, ParquetMetaDataReader};
use sieve_fragment::{slice_plan, DecodedBody, RawSlice, SlicePlan, SliceSource};

/// A raw slice as received: its head and the bytes that followed it.
#[derive(Debug)]
pub struct RawPages {
    /// Footer, ranges, row groups and why the node did not process it.
    pub head: RawSlice,
    /// The shipped bytes, by file offset, in the order they came.
    pub chunks: Vec<(u64, Bytes)>,
}

impl RawPages {
    /// Bytes of pages received.
    pub fn bytes(&self) -> u64 {
        self.chunks
            .iter()
            .map(|(_, bytes)| bytes.len() as u64)
            .sum()
    }
}

/// Run the fragment `body` over `pages` on this node.
pub fn complete_raw(
    pages: RawPages,
    body: &DecodedBody,
    schema: &arrow::datatypes::SchemaRef,
    task_context: Arc<TaskContext>,
    batch_rows: usize,
    deleted: Option<&sieve_fragment::RoaringBitmap>,
    row_positions: bool,
) -> Result<SendableRecordBatchStream> {
    let metadata =
        std::panic::catch_unwind(|| ParquetMetaDataReader::decode_metadata(&pages.head.footer))
            .map_err(|_| exec_datafusion_err!("raw slice with a bad footer (decoder panicked)"))?
            .map_err(|error| exec_datafusion_err!("raw slice with a bad footer: {error}"))?;
    let groups = metadata.num_row_groups();
    let mut access_plan = ParquetAccessPlan::new_none(groups);
    for &group in &pages.head.row_groups {
        let group = group as usize;
        if group >= groups {
            return Err(exec_datafusion_err!(
                "raw slice names row group {group}, the file has {groups}"
            ));
        }
        access_plan.scan(group);
    }
    // Rows deleted at the version read stay out, as on the storage node.
    if let Some(deleted) = deleted {
        let rows: Vec<u64> = metadata
            .row_groups()
            .iter()
            .map(|group| group.num_rows() as u64)
            .collect();
        access_plan = sieve_fragment::apply_deletions(access_plan, &rows, deleted);
    }
    let file = Arc::new(SparseFile::assemble(pages.chunks)?);
    let SlicePlan { plan, .. } = slice_plan(
        schema,
        body,
        SliceSource {
            reader_factory: Arc::new(RawReaderFactory {
                file,
                metadata: Arc::new(metadata),
            }),
            // Never read: the reader factory serves every byte. Any
            // registered store will do, and every runtime has this one.
            store_url: ObjectStoreUrl::local_filesystem(),
            location: "sieve-raw-slice.parquet".to_string(),
            file_bytes: pages.head.file_bytes,
            access_plan,
            batch_rows,
            pushdown_filters: false,
            row_positions,
        },
    )?;
    plan.execute(0, task_context)
}

/// The parts of a file that were shipped, sorted by offset.
#[derive(Debug)]
struct SparseFile {
    pieces: Vec<(u64, Bytes)>,
}

impl SparseFile {
    /// Join the received chunks: adjacent chunks of one range become one piece.
    fn assemble(mut chunks: Vec<(u64, Bytes)>) -> Result<Self> {
        chunks.sort_by_key(|(offset, _)| *offset);
        let mut pieces: Vec<(u64, Vec<u8>)> = Vec::new();
        for (offset, bytes) in chunks {
            match pieces.last_mut() {
                Some((start, joined)) if *start + joined.len() as u64 == offset => {
                    joined.extend_from_slice(&bytes);
                }
                Some((start, joined)) if offset < *start + joined.len() as u64 => {
                    return Err(exec_datafusion_err!(
                        "raw slice chunks overlap at byte {offset}"
                    ));
                }
                _ => pieces.push((offset, bytes.to_vec())),
            }
        }
        Ok(Self {
            pieces: pieces
                .into_iter()
                .map(|(offset, bytes)| (offset, Bytes::from(bytes)))
                .collect(),
        })
    }

    fn get(&self, range: Range<u64>) -> parquet::errors::Result<Bytes> {
        let index = self
            .pieces
            .partition_point(|(offset, _)| *offset <= range.start);
        let found = index
            .checked_sub(1)
            .map(|index| &self.pieces[index])
            .filter(|(offset, bytes)| range.end <= offset + bytes.len() as u64);
        match found {
            Some((offset, bytes)) => {
                Ok(bytes.slice((range.start - offset) as usize..(range.end - offset) as usize))
            }
            None => Err(ParquetError::General(format!(
                "raw slice lacks bytes {}..{} the fragment reads",
                range.start, range.end
            ))),
        }
    }
}

#[derive(Debug)]
struct RawReaderFactory {
    file: Arc<SparseFile>,
    metadata: Arc<ParquetMetaData>,
}

impl ParquetFileReaderFactory for RawReaderFactory {
    fn create_reader(
        &self,
        partition_index: usize,
        partitioned_file: PartitionedFile,
        _metadata_size_hint: Option<usize>,
        metrics: &ExecutionPlanMetricsSet,
    ) -> Result<Box<dyn AsyncFileReader + Send>> {
        // Registers the file's metrics, which DataFusion's opener expects.
        let _ = ParquetFileMetrics::new(
            partition_index,
            partitioned_file.object_meta.location.as_ref(),
            metrics,
        );
        Ok(Box::new(RawReader {
            file: Arc::clone(&self.file),
            metadata: Arc::clone(&self.metadata),
        }))
    }
}

struct RawReader {
    file: Arc<SparseFile>,
    metadata: Arc<ParquetMetaData>,
}

impl AsyncFileReader for RawReader {
    fn get_bytes(&mut self, range: Range<u64>) -> BoxFuture<'_, parquet::errors::Result<Bytes>> {
        let bytes = self.file.get(range);
        async move { bytes }.boxed()
    }

    fn get_metadata<'a>(
        &'a mut self,
        _options: Option<&'a ArrowReaderOptions>,
    ) -> BoxFuture<'a, parquet::errors::Result<Arc<ParquetMetaData>>> {
        let metadata = Arc::clone(&self.metadata);
        async move { Ok(metadata) }.boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_file_serves_only_what_was_shipped() {
        let file = SparseFile::assemble(vec![
            (110, Bytes::from_static(b"klm")),
            (100, Bytes::from_static(b"abcde")),
            (105, Bytes::from_static(b"fghij")),
        ])
        .unwrap();
        assert_eq!(file.get(103..108).unwrap().as_ref(), b"defgh");
        assert_eq!(file.get(110..113).unwrap().as_ref(), b"klm");
        assert!(file.get(99..101).is_err());
        assert!(file.get(112..114).is_err());
        let overlapping = SparseFile::assemble(vec![
            (0, Bytes::from_static(b"abc")),
            (2, Bytes::from_static(b"cd")),
        ]);
        assert!(overlapping.is_err());
    }
}
