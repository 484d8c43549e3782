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

/// Rows of `table` that satisfy `predicate` (over the table schema), with
/// each conjunct `column = constant` (either way round) estimated to keep
/// 1 / the column's distinct values and `column IN (constants)` as many
/// of them as it lists ([`crate::ClusterTable::distinct_estimate`]), and
/// the other conjuncts as DataFusion's `FilterExec` estimates them.
/// DataFusion 55 keeps a fifth of the rows for an equality over a string
/// column, whatever it holds: TPC-H Q21's `n_name = 'SAUDI ARABIA'` (one
/// nation in 25) and `o_orderstatus = 'F'` (one status in 3) look alike.
pub(crate) fn rows_with_distinct_values(
    table: &crate::ClusterTable,
    predicate: &Arc<dyn PhysicalExpr>,
) -> Option<f64> {
    use datafusion::logical_expr::Operator;
    use datafusion::physical_expr::expressions::{BinaryExpr, Column, InListExpr, Literal};
    use datafusion::physical_expr::{conjunction, split_conjunction};

    let column_distinct = |expr: &Arc<dyn PhysicalExpr>| {
        let column = expr.downcast_ref::<Column>()?;
        table.distinct_estimate(column.index())
    };
    let constant = |expr: &Arc<dyn PhysicalExpr>| {
        expr.downcast_ref::<Literal>()
            .is_some_and(|literal| !literal.value().is_null())
    };
    let mut share = 1.0f64;
    let mut rest = Vec::new();
    for conjunct in split_conjunction(predicate) {
        let values = if let Some(binary) = conjunct.downcast_ref::<BinaryExpr>() {
            let (left, right) = (binary.left(), binary.right());
            match binary.op() {
                Operator::Eq if constant(right) => column_distinct(left),
                Operator::Eq if constant(left) => column_distinct(right),
                _ => None,
            }
            .map(|distinct| (1, distinct))
        } else if let Some(list) = conjunct.downcast_ref::<InListExpr>() {
            (!list.negated() && list.list().iter().all(constant))
                .then(|| column_distinct(list.expr()))
                .flatten()
                .map(|distinct| (list.list().len(), distinct))
        } else {
            None
        };
        match values {
            Some((kept, distinct)) => share *= (kept as f64 / distinct.max(1) as f64).min(1.0),
            None => rest.push(Arc::clone(conjunct)),
        }
    }
    let rows = match conjunction(rest) {
        rest if rest.downcast_ref::<Literal>().is_some() => {
            *table.statistics.num_rows.get_value()? as f64
        }
        rest => *filtered_statistics(&table.schema, &table.statistics, &rest)
            .ok()?
            .num_rows
            .get_value()? as f64,
    };
    Some(rows * share)
}
