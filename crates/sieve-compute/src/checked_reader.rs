//! NDP off: every page read from a storage node's byte-range endpoint is
//! verified against the slice's page checksums before DataFusion's Parquet
//! reader decodes it.
//!
//! ```text
//!   DataFusion's Parquet reader ── get_byte_ranges(r) ──> CheckedReader
//!        widen r to whole pages ── inner reader (ClusterRangeStore, HTTP)
//!        verify each page's CRC-32 (sieve_format::PageChecksums)
//!        cut back to r ──────────────────────────────────> the reader
//! ```
//!
//! A page that fails is raised as a [`sieve_format::PageCorruption`] naming
//! the slice file (recognise it with [`sieve_format::find_page_corruption`]):
//! the copy on that node is damaged, another replica may not be. A slice
//! written before page checksums is read unchecked.

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use datafusion::common::Result;
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion_datasource::PartitionedFile;
use datafusion_datasource_parquet::ParquetFileReaderFactory;
use futures::future::BoxFuture;
use futures::FutureExt;
use parquet::arrow::arrow_reader::ArrowReaderOptions;
use parquet::arrow::async_reader::{AsyncFileReader, MetadataFetch};
use parquet::errors::ParquetError;
use parquet::file::metadata::{PageIndexPolicy, ParquetMetaData, ParquetMetaDataReader};
use sieve_format::PageChecksums;

/// Wraps another factory's readers in [`CheckedReader`]s.
#[derive(Debug)]
pub(crate) struct CheckedReaderFactory {
    inner: Arc<dyn ParquetFileReaderFactory>,
}

impl CheckedReaderFactory {
    pub(crate) fn new(inner: Arc<dyn ParquetFileReaderFactory>) -> Self {
        Self { inner }
    }
}

impl ParquetFileReaderFactory for CheckedReaderFactory {
    fn create_reader(
        &self,
        partition_index: usize,
        partitioned_file: PartitionedFile,
        metadata_size_hint: Option<usize>,
        metrics: &ExecutionPlanMetricsSet,
    ) -> Result<Box<dyn AsyncFileReader + Send>> {
        let file = partitioned_file.object_meta.location.to_string();
        let inner = self.inner.create_reader(
            partition_index,
            partitioned_file,
            metadata_size_hint,
            metrics,
        )?;
        Ok(Box::new(CheckedReader {
            inner,
            file,
            checksums: None,
        }))
    }
}

/// A reader that verifies every whole page it reads.
struct CheckedReader {
    inner: Box<dyn AsyncFileReader + Send>,
    /// The file, as the range store names it (`{node}/slices/{table}/{file}`).
    file: String,
    /// Loaded with the metadata: `Some(None)` for a slice without checksums.
    checksums: Option<Option<Arc<PageChecksums>>>,
}

impl CheckedReader {
    /// The slice's checksums, loading the metadata (and its offset index, if
    /// the reader's options left it out) on first use.
    async fn checksums(&mut self) -> parquet::errors::Result<Option<Arc<PageChecksums>>> {
        if let Some(checksums) = &self.checksums {
            return Ok(checksums.clone());
        }
        let metadata = self.inner.get_metadata(None).await?;
        let checksums = self.checksums_of(metadata).await?;
        self.checksums = Some(checksums.clone());
        Ok(checksums)
    }

    async fn checksums_of(
        &mut self,
        metadata: Arc<ParquetMetaData>,
    ) -> parquet::errors::Result<Option<Arc<PageChecksums>>> {
        let recorded = metadata
            .file_metadata()
            .key_value_metadata()
            .is_some_and(|entries| {
                entries
                    .iter()
                    .any(|entry| entry.key == sieve_format::PAGE_CHECKSUMS_KEY)
            });
        if !recorded {
            return Ok(None);
        }
        let with_index = if metadata.offset_index().is_some() {
            metadata
        } else {
            let mut reader = ParquetMetaDataReader::new_with_metadata(metadata.as_ref().clone())
                .with_page_index_policy(PageIndexPolicy::Required);
            reader
                .load_page_index(InnerFetch(self.inner.as_mut()))
                .await?;
            Arc::new(reader.finish()?)
        };
        PageChecksums::from_metadata(&with_index)
            .map(|checksums| checksums.map(Arc::new))
            .map_err(|error| {
                ParquetError::General(format!(
                    "slice file {}: its page checksums are unreadable: {error}",
                    self.file
                ))
            })
    }

    async fn read_checked(
        &mut self,
        ranges: Vec<Range<u64>>,
    ) -> parquet::errors::Result<Vec<Bytes>> {
        let Some(checksums) = self.checksums().await? else {
            return self.inner.get_byte_ranges(ranges).await;
        };
        let widened: Vec<Range<u64>> = ranges
            .iter()
            .map(|range| checksums.widen(range.clone()))
            .collect();
        let read = self.inner.get_byte_ranges(widened.clone()).await?;
        let mut answers = Vec::with_capacity(ranges.len());
        for ((range, wide), bytes) in ranges.iter().zip(&widened).zip(read) {
            if bytes.len() as u64 != wide.end - wide.start {
                return Err(ParquetError::General(format!(
                    "slice file {}: read {} bytes at {}, asked for {}",
                    self.file,
                    bytes.len(),
                    wide.start,
                    wide.end - wide.start
                )));
            }
            checksums
                .verify(&self.file, wide.start, &bytes)
                .map_err(|corruption| {
                    log::warn!("{corruption}");
                    ParquetError::External(Box::new(corruption))
                })?;
            let start = (range.start - wide.start) as usize;
            let end = (range.end - wide.start) as usize;
            answers.push(bytes.slice(start..end));
        }
        Ok(answers)
    }
}

impl AsyncFileReader for CheckedReader {
    fn get_bytes(&mut self, range: Range<u64>) -> BoxFuture<'_, parquet::errors::Result<Bytes>> {
        async move {
            self.read_checked(vec![range])
                .await?
                .pop()
                .ok_or_else(|| ParquetError::General("a read returned nothing".to_string()))
        }
        .boxed()
    }

    fn get_byte_ranges(
        &mut self,
        ranges: Vec<Range<u64>>,
    ) -> BoxFuture<'_, parquet::errors::Result<Vec<Bytes>>> {
        async move { self.read_checked(ranges).await }.boxed()
    }

    fn get_metadata<'a>(
        &'a mut self,
        options: Option<&'a ArrowReaderOptions>,
    ) -> BoxFuture<'a, parquet::errors::Result<Arc<ParquetMetaData>>> {
        async move {
            let metadata = self.inner.get_metadata(options).await?;
            if self.checksums.is_none() {
                let checksums = self.checksums_of(Arc::clone(&metadata)).await?;
                self.checksums = Some(checksums);
            }
            Ok(metadata)
        }
        .boxed()
    }
}

/// The wrapped reader, as the page index loader reads it.
struct InnerFetch<'a>(&'a mut (dyn AsyncFileReader + Send));

impl MetadataFetch for InnerFetch<'_> {
    fn fetch(&mut self, range: Range<u64>) -> BoxFuture<'_, parquet::errors::Result<Bytes>> {
        self.0.get_bytes(range)
    }
}
