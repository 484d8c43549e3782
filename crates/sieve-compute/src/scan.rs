//! `SieveScanExec`: a table scan evaluated on the storage nodes.
//!
//! ```text
//!            SieveScanExec (partition p of P)
//!                 │  slices p, p+P, p+2P, ...   (round robin over all slices)
//!      ┌──────────┼──────────┐  at most `slices_in_flight` DoGet requests at once,
//!   node 0     node 1     node 2   all nodes in parallel; each returns one
//!   slice 1    slice 2    slice 3  slice through the fragment, then its metrics
//! ```
//!
//! Contract: the output is exactly the rows of the table that satisfy the
//! pushed predicate, projected to the pushed columns. No ordering and no
//! particular partitioning are promised (`UnknownPartitioning(P)`). A slice's
//! batches are released only once the whole slice has arrived, so a failed
//! request never contributes a partial slice.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use arrow::datatypes::{Schema, SchemaRef};
use arrow::record_batch::{RecordBatch, RecordBatchOptions};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{internal_err, Result, Statistics};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricBuilder, MetricsSet};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties,
};
use futures::{stream, StreamExt, TryStreamExt};
use sieve_fragment::FragmentEnvelope;

use crate::{ClusterCatalog, ClusterTable, Traffic};

/// A scan whose filter and projection run on the storage nodes.
#[derive(Debug)]
pub struct SieveScanExec {
    table: Arc<ClusterTable>,
    catalog: Arc<ClusterCatalog>,
    traffic: Arc<Traffic>,
    /// Columns shipped, as indices into the table schema (never empty).
    shipped: Vec<usize>,
    /// Whether the plan wants zero columns (e.g. `COUNT(*)`): the storage node
    /// still ships one column so row counts survive, and it is dropped here.
    output_no_columns: bool,
    predicate: Option<Arc<dyn PhysicalExpr>>,
    /// The encoded fragment body, shared by every slice request.
    body: Arc<Vec<u8>>,
    slices_in_flight: usize,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl SieveScanExec {
    /// Plan a scan of `table` shipping `projection` (indices into the table
    /// schema) of the rows satisfying `predicate` (over the table schema,
    /// already checked against the allow-list by the caller).
    pub fn try_new(
        catalog: Arc<ClusterCatalog>,
        table: Arc<ClusterTable>,
        traffic: Arc<Traffic>,
        projection: Vec<usize>,
        predicate: Option<Arc<dyn PhysicalExpr>>,
        partitions: usize,
        slices_in_flight: usize,
    ) -> Result<Self> {
        let output_no_columns = projection.is_empty();
        let shipped = if output_no_columns {
            vec![smallest_column(&table.schema)]
        } else {
            projection
        };
        let fragment = sieve_fragment::Fragment {
            projection: shipped.clone(),
            predicate: predicate.clone(),
        };
        let body = Arc::new(fragment.encode_body(&table.schema)?);
        let schema = if output_no_columns {
            Arc::new(Schema::empty())
        } else {
            Arc::new(table.schema.project(&shipped)?)
        };
        let partitions = partitions.clamp(1, table.slices.len().max(1));
        let properties = Arc::new(PlanProperties::new(
            EquivalenceProperties::new(schema),
            Partitioning::UnknownPartitioning(partitions),
            EmissionType::Incremental,
            Boundedness::Bounded,
        ));
        Ok(Self {
            table,
            catalog,
            traffic,
            shipped,
            output_no_columns,
            predicate,
            body,
            slices_in_flight: slices_in_flight.max(1),
            properties,
            metrics: ExecutionPlanMetricsSet::new(),
        })
    }

    /// The pushed predicate.
    pub fn predicate(&self) -> Option<&Arc<dyn PhysicalExpr>> {
        self.predicate.as_ref()
    }

    /// Names of the pushed (shipped) columns.
    pub fn pushed_columns(&self) -> Vec<String> {
        self.shipped
            .iter()
            .map(|&index| self.table.schema.field(index).name().clone())
            .collect()
    }
}

/// The narrowest column by fixed width, used when no column is needed.
fn smallest_column(schema: &SchemaRef) -> usize {
    (0..schema.fields().len())
        .min_by_key(|&index| {
            schema
                .field(index)
                .data_type()
                .primitive_width()
                .unwrap_or(usize::MAX)
        })
        .unwrap_or(0)
}

impl DisplayAs for SieveScanExec {
    fn fmt_as(&self, format: DisplayFormatType, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "SieveScanExec: table={}, slices={}",
            self.table.name,
            self.table.slices.len()
        )?;
        if let Some(predicate) = &self.predicate {
            write!(formatter, ", pushed filter: {predicate}")?;
        }
        write!(
            formatter,
            ", pushed columns: [{}]",
            self.pushed_columns().join(", ")
        )?;
        if matches!(format, DisplayFormatType::Verbose) {
            write!(formatter, ", fragment bytes={}", self.body.len())?;
        }
        Ok(())
    }
}

impl ExecutionPlan for SieveScanExec {
    fn name(&self) -> &str {
        "SieveScanExec"
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        match &self.predicate {
            Some(predicate) => f(predicate),
            None => Ok(TreeNodeRecursion::Continue),
        }
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![]
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if !children.is_empty() {
            return internal_err!("SieveScanExec has no children");
        }
        Ok(self)
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    fn partition_statistics(&self, partition: Option<usize>) -> Result<Arc<Statistics>> {
        let mut statistics = self.table.statistics.clone();
        if partition.is_some() || self.predicate.is_some() {
            statistics = statistics.to_inexact();
        }
        if self.output_no_columns {
            statistics.column_statistics.clear();
        } else {
            statistics = statistics.project(Some(&self.shipped));
        }
        Ok(Arc::new(statistics))
    }

    fn execute(
        &self,
        partition: usize,
        _context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let partitions = self.properties.partitioning.partition_count();
        if partition >= partitions {
            return internal_err!(
                "SieveScanExec has {partitions} partitions, asked for {partition}"
            );
        }
        let builder = || MetricBuilder::new(&self.metrics);
        let output_rows = builder().output_rows(partition);
        let bytes_shipped = builder().counter("bytes_shipped", partition);
        let bytes_read = builder().counter("storage_bytes_read", partition);
        let slices_done = builder().counter("slices", partition);
        let pages_considered = builder().counter("pages_considered", partition);
        let pages_skipped_statistics = builder().counter("pages_skipped_statistics", partition);
        let pages_skipped_bloom = builder().counter("pages_skipped_bloom_filter", partition);
        let pages_skipped_page_index = builder().counter("pages_skipped_page_index", partition);
        let pages_read = builder().counter("pages_read", partition);
        let rows_scanned = builder().counter("storage_rows_scanned", partition);
        let storage_cpu = builder().subset_time("storage_cpu_time", partition);

        let slices: Vec<_> = self
            .table
            .slices
            .iter()
            .skip(partition)
            .step_by(partitions)
            .cloned()
            .collect();
        let catalog = Arc::clone(&self.catalog);
        let traffic = Arc::clone(&self.traffic);
        let body = Arc::clone(&self.body);
        let table_name = self.table.name.clone();
        let schema = self.schema();
        let output_no_columns = self.output_no_columns;
        let requests = stream::iter(slices).map(move |slice| {
            let catalog = Arc::clone(&catalog);
            let traffic = Arc::clone(&traffic);
            let envelope = FragmentEnvelope::new(
                table_name.clone(),
                slice.summary.slice,
                body.as_ref().clone(),
            );
            async move {
                let client = &catalog.clients[slice.node];
                let encoded = prost::Message::encode_to_vec(&envelope);
                client.fetch_slice(encoded, &traffic).await
            }
        });
        let schema_for_batches = Arc::clone(&schema);
        let batches = requests
            .buffer_unordered(self.slices_in_flight)
            .map_ok(move |result| {
                let metrics = &result.metrics;
                bytes_shipped.add(result.bytes_shipped as usize);
                bytes_read.add(metrics.bytes_read as usize);
                slices_done.add(1);
                pages_considered.add(metrics.pages_considered as usize);
                pages_skipped_statistics.add(metrics.pages_skipped_statistics as usize);
                pages_skipped_bloom.add(metrics.pages_skipped_bloom_filter as usize);
                pages_skipped_page_index.add(metrics.pages_skipped_page_index as usize);
                pages_read.add(metrics.pages_read() as usize);
                rows_scanned.add(metrics.rows_scanned as usize);
                storage_cpu.add_duration(Duration::from_nanos(metrics.cpu_nanos));
                let schema = Arc::clone(&schema_for_batches);
                let output_rows = output_rows.clone();
                stream::iter(result.batches.into_iter().map(move |batch| {
                    output_rows.add(batch.num_rows());
                    if output_no_columns {
                        let options =
                            RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
                        Ok(RecordBatch::try_new_with_options(
                            Arc::clone(&schema),
                            vec![],
                            &options,
                        )?)
                    } else {
                        Ok(batch)
                    }
                }))
            })
            .try_flatten();
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, batches)))
    }
}
