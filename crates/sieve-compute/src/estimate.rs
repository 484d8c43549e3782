//! Row estimates for a scan whose filter runs on the storage nodes.
//!
//! DataFusion's join ordering and build-side choice read the scan's
//! statistics. With NDP off, a `FilterExec` above the Parquet scan estimates
//! the filter's selectivity from column min/max; a Sieve scan must give the
//! same estimate, or the two modes plan different joins. This asks
//! DataFusion's own `FilterExec` for it, over a leaf that only has statistics.

use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use datafusion::common::{Result, Statistics};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::statistics::{StatisticsArgs, StatisticsContext};
use sieve_fragment::SliceInputExec;

/// The statistics of the rows of a table with `statistics` that satisfy
/// `predicate` (over the table schema), as DataFusion's `FilterExec` estimates them.
pub(crate) fn filtered_statistics(
    schema: &SchemaRef,
    statistics: &Statistics,
    predicate: &Arc<dyn PhysicalExpr>,
) -> Result<Statistics> {
    let leaf =
        Arc::new(SliceInputExec::new(Arc::clone(schema)).with_statistics(statistics.clone()));
    let filter = FilterExec::try_new(Arc::clone(predicate), leaf)?;
    let statistics = StatisticsContext::new().compute(&filter, &StatisticsArgs::new())?;
    Ok(statistics.as_ref().clone())
}
