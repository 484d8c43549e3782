//! Row estimates for a scan whose filter runs on the storage nodes.
//!
//! DataFusion's join ordering and build-side choice read the scan's
//! statistics. With NDP off, a `FilterExec` above the Parquet scan estimates
//! the filter's selectivity from column min/max; a Sieve scan must give the
//! same estimate, or the two modes plan different joins. This asks
//! DataFusion's own `FilterExec` for it, over a leaf that only has statistics.

use std::fmt;
use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{internal_err, Result, Statistics};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::statistics::{StatisticsArgs, StatisticsContext};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties,
};

/// The statistics of the rows of a table with `statistics` that satisfy
/// `predicate` (over the table schema), as DataFusion's `FilterExec` estimates them.
pub(crate) fn filtered_statistics(
    schema: &SchemaRef,
    statistics: &Statistics,
    predicate: &Arc<dyn PhysicalExpr>,
) -> Result<Statistics> {
    let leaf = Arc::new(StatisticsOnlyExec {
        statistics: statistics.clone(),
        properties: Arc::new(PlanProperties::new(
            EquivalenceProperties::new(Arc::clone(schema)),
            Partitioning::UnknownPartitioning(1),
            EmissionType::Incremental,
            Boundedness::Bounded,
        )),
    });
    let filter = FilterExec::try_new(Arc::clone(predicate), leaf)?;
    let statistics = StatisticsContext::new().compute(&filter, &StatisticsArgs::new())?;
    Ok(statistics.as_ref().clone())
}

/// A leaf that has statistics and nothing else; never executed.
#[derive(Debug)]
struct StatisticsOnlyExec {
    statistics: Statistics,
    properties: Arc<PlanProperties>,
}

impl DisplayAs for StatisticsOnlyExec {
    fn fmt_as(
        &self,
        _format: DisplayFormatType,
        formatter: &mut fmt::Formatter<'_>,
    ) -> fmt::Result {
        write!(formatter, "StatisticsOnlyExec")
    }
}

impl ExecutionPlan for StatisticsOnlyExec {
    fn name(&self) -> &str {
        "StatisticsOnlyExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn with_new_children(
        self: Arc<Self>,
        _children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        Ok(self)
    }

    fn partition_statistics(&self, _partition: Option<usize>) -> Result<Arc<Statistics>> {
        Ok(Arc::new(self.statistics.clone()))
    }

    fn execute(
        &self,
        _partition: usize,
        _context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        internal_err!("StatisticsOnlyExec only carries statistics")
    }
}
