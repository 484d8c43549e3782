//! A Parquet reader that answers metadata requests from the catalog's
//! in-memory copy, so a request never re-reads a footer or page index.

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use datafusion::common::Result;
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion_datasource::PartitionedFile;
use datafusion_datasource_parquet::{ParquetFileMetrics, ParquetFileReaderFactory};
use futures::future::BoxFuture;
use futures::FutureExt;
use object_store::{ObjectStore, ObjectStoreExt};
use parquet::arrow::arrow_reader::ArrowReaderOptions;
use parquet::arrow::async_reader::AsyncFileReader;
use parquet::errors::ParquetError;
use parquet::file::metadata::ParquetMetaData;

use crate::CatalogSlice;

/// Creates readers for one slice, sharing its cached metadata.
#[derive(Debug)]
pub(crate) struct SliceReaderFactory {
    pub(crate) store: Arc<dyn ObjectStore>,
    pub(crate) slice: Arc<CatalogSlice>,
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
            metadata: Arc::clone(&self.slice.metadata),
        }))
    }
}

struct SliceReader {
    file_metrics: ParquetFileMetrics,
    store: Arc<dyn ObjectStore>,
    location: object_store::path::Path,
    metadata: Arc<ParquetMetaData>,
}

impl AsyncFileReader for SliceReader {
    fn get_bytes(&mut self, range: Range<u64>) -> BoxFuture<'_, parquet::errors::Result<Bytes>> {
        self.file_metrics
            .bytes_scanned
            .add((range.end - range.start) as usize);
        async move {
            self.store
                .get_range(&self.location, range)
                .await
                .map_err(|error| ParquetError::External(Box::new(error)))
        }
        .boxed()
    }

    fn get_byte_ranges(
        &mut self,
        ranges: Vec<Range<u64>>,
    ) -> BoxFuture<'_, parquet::errors::Result<Vec<Bytes>>> {
        let total: u64 = ranges.iter().map(|range| range.end - range.start).sum();
        self.file_metrics.bytes_scanned.add(total as usize);
        async move {
            self.store
                .get_ranges(&self.location, &ranges)
                .await
                .map_err(|error| ParquetError::External(Box::new(error)))
        }
        .boxed()
    }

    fn get_metadata<'a>(
        &'a mut self,
        _options: Option<&'a ArrowReaderOptions>,
    ) -> BoxFuture<'a, parquet::errors::Result<Arc<ParquetMetaData>>> {
        let metadata = Arc::clone(&self.metadata);
        async move { Ok(metadata) }.boxed()
    }
}
