//! A Parquet reader that answers metadata requests from the slice details
//! the request took (see `CatalogSlice::details`), so a request reads a
//! footer and page index at most once, and
//! verifies every page it reads against the slice's page checksums: a read
//! is widened to whole pages, and a page that fails marks the slice's copy
//! on this node corrupt (see `CatalogSlice::check_pages`).

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use datafusion::common::Result;
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion_datasource::PartitionedFile;
use datafusion_datasource_parquet::{ParquetFileMetrics, ParquetFileReaderFactory};
use futures::future::BoxFuture;
use futures::FutureExt;
use object_store::ObjectStore;
use parquet::arrow::arrow_reader::ArrowReaderOptions;
use parquet::arrow::async_reader::AsyncFileReader;
use parquet::errors::ParquetError;
use parquet::file::metadata::ParquetMetaData;

use crate::faults::Faults;
use crate::{CatalogSlice, SliceDetails};

/// Creates readers for one slice, sharing its cached metadata.
#[derive(Debug)]
pub(crate) struct SliceReaderFactory {
    pub(crate) store: Arc<dyn ObjectStore>,
    pub(crate) slice: Arc<CatalogSlice>,
    pub(crate) details: Arc<SliceDetails>,
    pub(crate) faults: Arc<Faults>,
}

impl ParquetFileReaderFactory for SliceReaderFactory {
    fn create_reader(
        &self,
        partition_index: usize,
        partitioned_file: PartitionedFile,
        _metadata_size_hint: Option<usize>,
        metrics: &ExecutionPlanMetricsSet,
    ) -> Result<Box<dyn AsyncFileReader + Send>> {
        let file_metrics = ParquetFileMetrics::new(
            partition_index,
            partitioned_file.object_meta.location.as_ref(),
            metrics,
        );
        Ok(Box::new(SliceReader {
            file_metrics,
            store: Arc::clone(&self.store),
            location: partitioned_file.object_meta.location,
            slice: Arc::clone(&self.slice),
            details: Arc::clone(&self.details),
            faults: Arc::clone(&self.faults),
        }))
    }
}

struct SliceReader {
    file_metrics: ParquetFileMetrics,
    store: Arc<dyn ObjectStore>,
    location: object_store::path::Path,
    slice: Arc<CatalogSlice>,
    details: Arc<SliceDetails>,
    faults: Arc<Faults>,
}

impl SliceReader {
    /// Read `ranges`, each widened to the whole pages it touches, verify
    /// every page read, and cut the answers back to the ranges asked for.
    async fn read_checked(&self, ranges: Vec<Range<u64>>) -> parquet::errors::Result<Vec<Bytes>> {
        self.faults.pace_read().await;
        let widened: Vec<Range<u64>> = ranges
            .iter()
            .map(|range| self.details.widen(range.clone()))
            .collect();
        let read = self
            .store
            .get_ranges(&self.location, &widened)
            .await
            .map_err(|error| ParquetError::External(Box::new(error)))?;
        let mut answers = Vec::with_capacity(ranges.len());
        for ((range, wide), bytes) in ranges.iter().zip(&widened).zip(read) {
            if bytes.len() as u64 != wide.end - wide.start {
                return Err(ParquetError::General(format!(
                    "{}: read {} bytes at {}, asked for {}",
                    self.location,
                    bytes.len(),
                    wide.start,
                    wide.end - wide.start
                )));
            }
            self.slice
                .check_pages(&self.details, wide.start, &bytes)
                .map_err(|corruption| ParquetError::External(Box::new(corruption)))?;
            let start = (range.start - wide.start) as usize;
            let end = (range.end - wide.start) as usize;
            answers.push(bytes.slice(start..end));
        }
        Ok(answers)
    }
}

impl AsyncFileReader for SliceReader {
    fn get_bytes(&mut self, range: Range<u64>) -> BoxFuture<'_, parquet::errors::Result<Bytes>> {
        self.file_metrics
            .bytes_scanned
            .add((range.end - range.start) as usize);
        async move {
            let mut answers = self.read_checked(vec![range]).await?;
            answers
                .pop()
                .ok_or_else(|| ParquetError::General("a read returned nothing".to_string()))
        }
        .boxed()
    }

    fn get_byte_ranges(
        &mut self,
        ranges: Vec<Range<u64>>,
    ) -> BoxFuture<'_, parquet::errors::Result<Vec<Bytes>>> {
        let total: u64 = ranges.iter().map(|range| range.end - range.start).sum();
        self.file_metrics.bytes_scanned.add(total as usize);
        async move { self.read_checked(ranges).await }.boxed()
    }

    fn get_metadata<'a>(
        &'a mut self,
        _options: Option<&'a ArrowReaderOptions>,
    ) -> BoxFuture<'a, parquet::errors::Result<Arc<ParquetMetaData>>> {
        let metadata = Arc::clone(&self.details.metadata);
        async move { Ok(metadata) }.boxed()
    }
}
