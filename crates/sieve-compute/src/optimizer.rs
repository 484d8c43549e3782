//! Physical optimizer rules that move work into fragments. Both run after
//! DataFusion's own rules (so after its filter pushdown has linked hash joins
//! to the scans below them).
//!
//! - [`PushAggregateToStorage`]: a partial `AggregateExec` over
//!   (projection | filter | repartition | coalesce)* over a `SieveScanExec`
//!   moves into the scan's fragment, if statistics say it shrinks the data.
//!   The final aggregation on the compute node merges the shipped partial
//!   states unchanged. Where the slices hold disjoint ranges of a grouping
//!   column (a load in key order leaves each key value in one slice:
//!   `tables/writer.rs`), every group is complete within its slice: the
//!   storage node finishes the aggregation, and the HAVING filter above it
//!   runs there too, so only the groups that pass leave the node
//!   ([`complete_aggregate`], [`push_having`]).
//! - [`WaitForJoinFilters`]: a scan holding a hash join's dynamic filter is
//!   told which join it comes from; it then waits for the join's build side
//!   before sending requests, instead of racing it. A filter whose build side
//!   is estimated to hold about every value the probe key can take is dropped
//!   instead, so the join does not spend time building it. The join's build
//!   input gets a [`BuildKeysExec`], which collects the key values the
//!   scan's list or Bloom filter is made of. An inner join whose probe key
//!   reaches a scan only through other inner joins (DataFusion pushes its
//!   filter nowhere when its keys come from both sides of the join below)
//!   gives that scan a key filter of its collected keys
//!   ([`crate::join_filter::KeyFilterSlot`]).

use std::collections::HashMap;
use std::sync::Arc;

use datafusion::arrow::datatypes::DataType;
use datafusion::common::config::ConfigOptions;
use datafusion::common::stats::Precision;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{JoinSide, JoinType, NullEquality, Result, ScalarValue};
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::utils::collect_columns;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::statistics::{StatisticsArgs, StatisticsContext};
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties, Partitioning};
use sieve_fragment::{check_plan_allowed, SliceInputExec};

use crate::build_keys::{BuildKeys, BuildKeysExec};
use crate::join_filter::KeyFilterSlot;
use crate::{PushedAggregate, SieveConfig, SieveScanExec};

pub(crate) fn recompute() -> ReplaceChildrenOptions {
    ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute)
}

fn keep() -> ReplaceChildrenOptions {
    ReplaceChildrenOptions::new(ChildrenPropertiesMode::Keep)
}

/// Moves partial aggregations into fragments (see the module docs).
#[derive(Debug, Default)]
pub struct PushAggregateToStorage;

impl PhysicalOptimizerRule for PushAggregateToStorage {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let settings = SieveConfig::of(config);
        if !settings.aggregate_pushdown {
            return Ok(plan);
        }
        plan.transform_up(|node| {
            let node = push_aggregate(node, settings.aggregate_group_ratio_max)?;
            if node.transformed {
                return Ok(node);
            }
            let node = complete_aggregate(node.data)?;
            if node.transformed {
                return Ok(node);
            }
            push_having(node.data)
        })
        .map(|transformed| transformed.data)
    }

    fn name(&self) -> &str {
        "sieve_push_aggregate_to_storage"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// The operators between a partial aggregation and the scan below it.
struct Chain {
    /// Projections and filters kept, top first.
    kept: Vec<Arc<dyn ExecutionPlan>>,
    scan: Arc<dyn ExecutionPlan>,
}

fn find_chain(input: &Arc<dyn ExecutionPlan>) -> Option<Chain> {
    let mut kept = Vec::new();
    let mut current = Arc::clone(input);
    loop {
        if current.downcast_ref::<SieveScanExec>().is_some() {
            return Some(Chain {
                kept,
                scan: current,
            });
        }
        let passes_through = current
            .downcast_ref::<RepartitionExec>()
            .is_some_and(|repartition| {
                matches!(repartition.partitioning(), Partitioning::RoundRobinBatch(_))
                    && !repartition.preserve_order()
            })
            || current.downcast_ref::<CoalescePartitionsExec>().is_some();
        let kept_here = current.downcast_ref::<ProjectionExec>().is_some()
            || current.downcast_ref::<FilterExec>().is_some();
        if !passes_through && !kept_here {
            return None;
        }
        if kept_here {
            kept.push(Arc::clone(&current));
        }
        let [child] = current.children()[..] else {
            return None;
        };
        current = Arc::clone(child);
    }
}

/// Table columns that output column `index` of `node` (one of the chain, or
/// the scan) depends on.
fn table_columns_of(node: &Arc<dyn ExecutionPlan>, index: usize, out: &mut Vec<usize>) -> bool {
    if let Some(scan) = node.downcast_ref::<SieveScanExec>() {
        return match scan.shipped_columns().get(index) {
            Some(&column) if !scan.outputs_no_columns() => {
                out.push(column);
                true
            }
            _ => false,
        };
    }
    let [child] = node.children()[..] else {
        return false;
    };
    if let Some(projection) = node.downcast_ref::<ProjectionExec>() {
        let Some(expr) = projection.expr().get(index) else {
            return false;
        };
        return collect_columns(&expr.expr)
            .iter()
            .all(|column| table_columns_of(child, column.index(), out));
    }
    if let Some(filter) = node.downcast_ref::<FilterExec>() {
        let input_index = match filter.projection().as_ref() {
            Some(projection) => match projection.get(index) {
                Some(&input_index) => input_index,
                None => return false,
            },
            None => index,
        };
        return table_columns_of(child, input_index, out);
    }
    // Repartition and coalesce keep columns as they are.
    table_columns_of(child, index, out)
}

/// Estimated groups per slice over rows per slice, summed over the slices,
/// from the per-slice distinct counts of the grouping columns.
fn group_ratio(
    aggregate: &AggregateExec,
    scan: &SieveScanExec,
) -> std::result::Result<(f64, u64, u64), String> {
    let mut columns = Vec::new();
    for (expr, _) in aggregate.group_expr().expr() {
        let found = collect_columns(expr).iter().all(|column: &Column| {
            table_columns_of(aggregate.input(), column.index(), &mut columns)
        });
        if !found {
            return Err(format!(
                "cannot trace grouping expression {expr} to table columns"
            ));
        }
    }
    columns.sort_unstable();
    columns.dedup();
    let (mut groups, mut rows) = (0u64, 0u64);
    for slice in &scan.table().slices {
        let slice_rows = slice.summary.rows;
        let mut estimate: u64 = 1;
        for &column in &columns {
            let distinct = slice
                .summary
                .columns
                .get(column)
                .and_then(|summary| summary.distinct_count)
                .unwrap_or(slice_rows);
            estimate = estimate.saturating_mul(distinct.max(1));
        }
        groups += estimate.min(slice_rows.max(1));
        rows += slice_rows;
    }
    let ratio = if rows == 0 {
        0.0
    } else {
        groups as f64 / rows as f64
    };
    Ok((ratio, groups, rows))
}

fn push_aggregate(
    node: Arc<dyn ExecutionPlan>,
    ratio_max: f64,
) -> Result<Transformed<Arc<dyn ExecutionPlan>>> {
    let Some(aggregate) = node.downcast_ref::<AggregateExec>() else {
        return Ok(Transformed::no(node));
    };
    if *aggregate.mode() != AggregateMode::Partial {
        return Ok(Transformed::no(node));
    }
    let Some(chain) = find_chain(aggregate.input()) else {
        return Ok(Transformed::no(node));
    };
    let scan = chain
        .scan
        .downcast_ref::<SieveScanExec>()
        .expect("the chain ends in a scan");
    if scan.aggregate().is_some() {
        return Ok(Transformed::no(node));
    }
    let annotate = |note: String| -> Result<Transformed<Arc<dyn ExecutionPlan>>> {
        let annotated: Arc<dyn ExecutionPlan> = Arc::new(scan.with_aggregate_note(note));
        let replaced = Arc::clone(&node).transform_up(|inner| {
            Ok(if inner.downcast_ref::<SieveScanExec>().is_some() {
                Transformed::yes(Arc::clone(&annotated))
            } else {
                Transformed::no(inner)
            })
        })?;
        Ok(Transformed::yes(replaced.data))
    };
    let (ratio, groups, rows) = match group_ratio(aggregate, scan) {
        Ok(estimate) => estimate,
        Err(note) => return annotate(note),
    };
    let slices = scan.table().slices.len().max(1) as u64;
    let estimate = format!(
        "est. {} groups per slice of {} rows, ratio {ratio:.3}",
        groups / slices,
        rows / slices
    );
    // Groups complete in their slices are finished there (see
    // `complete_aggregate`): the final values replace the rows, however
    // many groups there are.
    let complete = aggregate.group_expr().is_single()
        && aggregate.group_expr().expr().iter().any(|(expr, _)| {
            expr.downcast_ref::<Column>()
                .and_then(|column| chain_column(aggregate.input(), column.index()))
                .is_some_and(|column| slices_disjoint_on(scan, column))
        });
    if ratio > ratio_max && !complete {
        return annotate(format!(
            "{estimate} > sieve.aggregate_group_ratio_max {ratio_max}: it would not shrink the data"
        ));
    }

    // The operators as the storage node runs them: the kept projections and
    // filters over a placeholder for the slice's filtered, projected rows.
    let shipped_schema = Arc::new(scan.table().schema.project(scan.shipped_columns())?);
    let mut input: Arc<dyn ExecutionPlan> = Arc::new(SliceInputExec::new(shipped_schema));
    if scan.outputs_no_columns() {
        input = Arc::new(ProjectionExec::try_new(
            Vec::<(Arc<dyn PhysicalExpr>, String)>::new(),
            input,
        )?);
    }
    for kept in chain.kept.iter().rev() {
        input = Arc::clone(kept).replace_children(vec![input], recompute())?;
    }
    let partial = Arc::clone(&node).replace_children(vec![input], recompute())?;
    if let Err(error) = check_plan_allowed(&partial) {
        return annotate(error.strip_backtrace());
    }
    let groups_text: Vec<String> = aggregate
        .group_expr()
        .expr()
        .iter()
        .map(|(_, name)| name.clone())
        .collect();
    let aggregates_text: Vec<String> = aggregate
        .aggr_expr()
        .iter()
        .map(|function| function.name().to_string())
        .collect();
    let description = format!(
        "partial [{}] group by [{}] ({estimate})",
        aggregates_text.join(", "),
        groups_text.join(", ")
    );
    match scan.with_aggregate(PushedAggregate {
        plan: partial,
        description,
    }) {
        Ok(pushed) => Ok(Transformed::yes(Arc::new(pushed))),
        Err(error) => annotate(error.strip_backtrace()),
    }
}

/// The table column that output column `index` of `node`, one of the
/// operators between an aggregation and its scan, is exactly: through
/// projections of plain columns, filters, repartitions and coalesces.
fn chain_column(node: &Arc<dyn ExecutionPlan>, index: usize) -> Option<usize> {
    if let Some(scan) = node.downcast_ref::<SieveScanExec>() {
        if scan.outputs_no_columns() {
            return None;
        }
        return scan.shipped_columns().get(index).copied();
    }
    let [child] = node.children()[..] else {
        return None;
    };
    if let Some(projection) = node.downcast_ref::<ProjectionExec>() {
        let column = projection
            .expr()
            .get(index)?
            .expr
            .downcast_ref::<Column>()?;
        return chain_column(child, column.index());
    }
    if let Some(filter) = node.downcast_ref::<FilterExec>() {
        let input_index = match filter.projection().as_ref() {
            Some(projection) => *projection.get(index)?,
            None => index,
        };
        return chain_column(child, input_index);
    }
    if node.downcast_ref::<RepartitionExec>().is_some()
        || node.downcast_ref::<CoalescePartitionsExec>().is_some()
    {
        return chain_column(child, index);
    }
    None
}

/// The table column that output column `index` of `node`, an operator of
/// a pushed fragment, is exactly (not an expression of it): through
/// projections of plain columns and filters, down to the slice's rows.
fn fragment_column(
    node: &Arc<dyn ExecutionPlan>,
    index: usize,
    shipped: &[usize],
) -> Option<usize> {
    if node.downcast_ref::<SliceInputExec>().is_some() {
        return shipped.get(index).copied();
    }
    let [child] = node.children()[..] else {
        return None;
    };
    if let Some(projection) = node.downcast_ref::<ProjectionExec>() {
        let column = projection
            .expr()
            .get(index)?
            .expr
            .downcast_ref::<Column>()?;
        return fragment_column(child, column.index(), shipped);
    }
    if let Some(filter) = node.downcast_ref::<FilterExec>() {
        let input_index = match filter.projection().as_ref() {
            Some(projection) => *projection.get(index)?,
            None => index,
        };
        return fragment_column(child, input_index, shipped);
    }
    None
}

/// Whether the scan's slices hold disjoint ranges of table column `column`,
/// NULLs in at most one slice: then rows that share its value (NULL
/// included) are in one slice. Only types whose slice minimum and maximum
/// are exact bounds in a total order (integers, decimals, dates, times) count.
fn slices_disjoint_on(scan: &SieveScanExec, column: usize) -> bool {
    let table = scan.table();
    let data_type = table.schema.field(column).data_type();
    let exact_order = data_type.is_integer()
        || matches!(
            data_type,
            DataType::Decimal128(_, _)
                | DataType::Decimal256(_, _)
                | DataType::Date32
                | DataType::Date64
                | DataType::Timestamp(_, _)
        );
    if !exact_order {
        return false;
    }
    let mut ranges = Vec::with_capacity(table.slices.len());
    let mut slices_with_nulls = 0;
    for slice in &table.slices {
        let Some(summary) = slice.summary.columns.get(column) else {
            return false;
        };
        if slice.summary.rows == 0 {
            continue;
        }
        match summary.null_count {
            Some(0) => {}
            Some(_) => slices_with_nulls += 1,
            None => return false,
        }
        let parse = |text: &Option<String>| {
            text.as_ref()
                .and_then(|text| ScalarValue::try_from_string(text.clone(), data_type).ok())
        };
        match (parse(&summary.min), parse(&summary.max)) {
            (Some(min), Some(max)) => ranges.push((min, max)),
            // A slice of NULLs only has no range.
            (None, None) if summary.null_count == Some(slice.summary.rows) => {}
            _ => return false,
        }
    }
    if slices_with_nulls > 1 {
        return false;
    }
    let mut sorted = Vec::with_capacity(ranges.len());
    for (min, max) in ranges {
        if min.partial_cmp(&max).is_none_or(|order| order.is_gt()) {
            return false;
        }
        sorted.push((min, max));
    }
    sorted.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap_or(std::cmp::Ordering::Equal));
    sorted.windows(2).all(|pair| {
        pair[0]
            .1
            .partial_cmp(&pair[1].0)
            .is_some_and(|order| order.is_lt())
    })
}

/// The scan under `node` through operators that only move rows between
/// partitions (repartitions, coalesces), if there is one.
fn scan_under_exchanges(node: &Arc<dyn ExecutionPlan>) -> Option<&SieveScanExec> {
    let mut current = node;
    loop {
        if let Some(scan) = current.downcast_ref::<SieveScanExec>() {
            return Some(scan);
        }
        let exchange = current
            .downcast_ref::<RepartitionExec>()
            .is_some_and(|repartition| !repartition.preserve_order())
            || current.downcast_ref::<CoalescePartitionsExec>().is_some();
        if !exchange {
            return None;
        }
        let [child] = current.children()[..] else {
            return None;
        };
        current = child;
    }
}

/// `scan` partitioned as `node`'s output is, so that the operators above
/// `node` (a partitioned hash join, say) find what they were planned on.
fn partitioned_as(
    node: &Arc<dyn ExecutionPlan>,
    scan: Arc<dyn ExecutionPlan>,
) -> Result<Arc<dyn ExecutionPlan>> {
    let target = node.output_partitioning();
    let count = target.partition_count();
    if count == 1 {
        if scan.output_partitioning().partition_count() == 1 {
            return Ok(scan);
        }
        return Ok(Arc::new(CoalescePartitionsExec::new(scan)));
    }
    let partitioning = match target {
        Partitioning::Hash(exprs, _) => Partitioning::Hash(exprs.clone(), count),
        _ => Partitioning::RoundRobinBatch(count),
    };
    Ok(Arc::new(RepartitionExec::try_new(scan, partitioning)?))
}

/// A final aggregation over (repartition | coalesce)* over a scan whose
/// fragment holds the partial aggregation: if the scan's slices hold
/// disjoint ranges of a grouping column, each slice's groups are complete,
/// and the storage node runs the whole aggregation (mode single) instead.
/// Its output is then the final values, partitioned as before.
fn complete_aggregate(node: Arc<dyn ExecutionPlan>) -> Result<Transformed<Arc<dyn ExecutionPlan>>> {
    let Some(aggregate) = node.downcast_ref::<AggregateExec>() else {
        return Ok(Transformed::no(node));
    };
    if !matches!(
        aggregate.mode(),
        AggregateMode::Final | AggregateMode::FinalPartitioned
    ) || aggregate.limit_options().is_some()
        || node.output_ordering().is_some()
        || !aggregate.group_expr().is_single()
        || aggregate.group_expr().is_empty()
    {
        return Ok(Transformed::no(node));
    }
    let Some(scan) = scan_under_exchanges(aggregate.input()) else {
        return Ok(Transformed::no(node));
    };
    if scan.star_join().is_some() || scan.aggregate_complete() {
        return Ok(Transformed::no(node));
    }
    let Some(pushed) = scan.aggregate() else {
        return Ok(Transformed::no(node));
    };
    let Some(partial) = pushed.plan.downcast_ref::<AggregateExec>() else {
        return Ok(Transformed::no(node));
    };
    if *partial.mode() != AggregateMode::Partial
        || partial.group_expr().expr().len() != aggregate.group_expr().expr().len()
    {
        return Ok(Transformed::no(node));
    }
    let shipped = scan.shipped_columns();
    let complete_on = partial.group_expr().expr().iter().find_map(|(expr, _)| {
        let column = expr.downcast_ref::<Column>()?;
        let table_column = fragment_column(partial.input(), column.index(), shipped)?;
        slices_disjoint_on(scan, table_column).then_some(table_column)
    });
    let Some(table_column) = complete_on else {
        return Ok(Transformed::no(node));
    };
    let single: Arc<dyn ExecutionPlan> = Arc::new(AggregateExec::try_new(
        AggregateMode::Single,
        partial.group_expr().clone(),
        partial.aggr_expr().to_vec(),
        partial.filter_expr().to_vec(),
        Arc::clone(partial.input()),
        partial.input_schema(),
    )?);
    let same_types = single.schema().fields().len() == node.schema().fields().len()
        && single
            .schema()
            .fields()
            .iter()
            .zip(node.schema().fields())
            .all(|(a, b)| a.data_type() == b.data_type());
    if !same_types || check_plan_allowed(&single).is_err() {
        return Ok(Transformed::no(node));
    }
    let description = pushed.description.replacen(
        "partial [",
        &format!(
            "complete (slices hold disjoint ranges of {}) [",
            scan.table().schema.field(table_column).name()
        ),
        1,
    );
    let completed = scan.with_complete_aggregate(PushedAggregate {
        plan: single,
        description,
    })?;
    Ok(Transformed::yes(partitioned_as(
        &node,
        Arc::new(completed),
    )?))
}

/// A filter over (repartition | coalesce)* over a scan whose fragment
/// completes its aggregation ([`complete_aggregate`]): the filter (a HAVING,
/// say) runs on the storage node too, after the aggregation.
fn push_having(node: Arc<dyn ExecutionPlan>) -> Result<Transformed<Arc<dyn ExecutionPlan>>> {
    let Some(filter) = node.downcast_ref::<FilterExec>() else {
        return Ok(Transformed::no(node));
    };
    if node.fetch().is_some() || node.output_ordering().is_some() {
        return Ok(Transformed::no(node));
    }
    let Some(scan) = scan_under_exchanges(filter.input()) else {
        return Ok(Transformed::no(node));
    };
    let Some(pushed) = scan.aggregate().filter(|_| scan.aggregate_complete()) else {
        return Ok(Transformed::no(node));
    };
    let plan = Arc::clone(&node).replace_children(vec![Arc::clone(&pushed.plan)], recompute())?;
    if check_plan_allowed(&plan).is_err() {
        return Ok(Transformed::no(node));
    }
    let description = format!("{}, then filter {}", pushed.description, filter.predicate());
    let filtered = scan.with_complete_aggregate(PushedAggregate { plan, description })?;
    Ok(Transformed::yes(partitioned_as(&node, Arc::new(filtered))?))
}

/// A join filter whose build side has at least this share of the probe key's
/// possible distinct values is dropped at planning.
const UNSELECTIVE_BUILD_RATIO: f64 = 0.9;

/// A hash join whose dynamic filter some scan may hold.
struct JoinSource {
    /// The dynamic filter's expression id.
    id: u64,
    /// The join's place in post order (see [`post_order`]).
    join: usize,
}

/// A hash join of the plan, with what its filters need.
struct JoinInfo {
    /// The build side's tables, for EXPLAIN.
    name: String,
    /// Exact build-side rows, if known.
    build_rows: Option<usize>,
    /// Where the build side's keys are collected.
    keys: Arc<BuildKeys>,
    /// Whether a scan applies one of its filters (only then are keys
    /// collected).
    used: bool,
}

/// Tells scans which hash join each of their dynamic filters comes from, so
/// they wait for it, and drops those that cannot filter (see the module docs).
/// Also gives scans the key filters of inner joins further up whose
/// DataFusion filter cannot reach them ([`KeyFilterSlot`]).
#[derive(Debug, Default)]
pub struct WaitForJoinFilters;

/// Tables scanned under `plan`, for "join filter from ...".
pub(crate) fn build_side_name(plan: &Arc<dyn ExecutionPlan>) -> String {
    let mut tables = Vec::new();
    let _ = plan.apply(|node| {
        if let Some(scan) = node.downcast_ref::<SieveScanExec>() {
            tables.push(scan.table().name.clone());
        }
        Ok(TreeNodeRecursion::Continue)
    });
    if tables.is_empty() {
        "the build side".to_string()
    } else {
        tables.join(" ⋈ ")
    }
}

/// Every node of `plan` in post order: the order in which `transform_up`
/// visits them, so a node's place identifies it across passes that keep the
/// plan's shape.
fn post_order(plan: &Arc<dyn ExecutionPlan>, out: &mut Vec<Arc<dyn ExecutionPlan>>) {
    for child in plan.children() {
        post_order(child, out);
    }
    out.push(Arc::clone(plan));
}

/// The Sieve scan (without a pushed aggregation) and its output column that
/// output column `index` of `plan` carries unchanged, row for row, through
/// column projections, filters, repartitions, coalescing, sorts and inner
/// hash joins; `None` past any other operator.
pub(crate) fn trace_column(
    plan: &Arc<dyn ExecutionPlan>,
    index: usize,
) -> Option<(Arc<dyn ExecutionPlan>, usize)> {
    if let Some(scan) = plan.downcast_ref::<SieveScanExec>() {
        return (scan.aggregate().is_none() && index < scan.schema().fields().len())
            .then(|| (Arc::clone(plan), index));
    }
    if let Some(projection) = plan.downcast_ref::<ProjectionExec>() {
        let column = projection
            .expr()
            .get(index)?
            .expr
            .downcast_ref::<Column>()?;
        return trace_column(projection.input(), column.index());
    }
    if let Some(filter) = plan.downcast_ref::<FilterExec>() {
        let index = match filter.projection() {
            Some(projection) => *projection.get(index)?,
            None => index,
        };
        return trace_column(filter.input(), index);
    }
    if let Some(join) = plan.downcast_ref::<HashJoinExec>() {
        if *join.join_type() != JoinType::Inner {
            return None;
        }
        let index = match &join.projection {
            Some(projection) => *projection.get(index)?,
            None => index,
        };
        // An inner join's columns: the left input's, then the right's.
        let left_columns = join.left().schema().fields().len();
        return if index < left_columns {
            trace_column(join.left(), index)
        } else {
            trace_column(join.right(), index - left_columns)
        };
    }
    let passes_through = plan.downcast_ref::<RepartitionExec>().is_some()
        || plan.downcast_ref::<CoalescePartitionsExec>().is_some()
        || plan.downcast_ref::<SortExec>().is_some()
        || plan.downcast_ref::<BuildKeysExec>().is_some()
        || plan.downcast_ref::<crate::MergePartitionsExec>().is_some();
    #[allow(deprecated)]
    let passes_through = passes_through
        || plan
            .downcast_ref::<datafusion::physical_plan::coalesce_batches::CoalesceBatchesExec>()
            .is_some();
    if passes_through {
        let [input] = &plan.children()[..] else {
            return None;
        };
        return trace_column(input, index);
    }
    None
}

/// The scan output columns that output column `index` of `plan` is computed
/// from, followed by position (never by name) through projections, filters,
/// hash joins of every type, the grouping columns of aggregations and
/// operators that pass rows through, added to `sources`; `None` past an
/// operator it does not follow.
///
/// DataFusion 55 pushes a filter through a projection by column *name*: in
/// a projection with two columns of one name (a self-join's `pkey` and
/// `pkey`) a join's dynamic filter on the second reaches the table of the
/// first. [`WaitForJoinFilters`] checks each pushed join filter against
/// this and drops it where it landed on a column its key does not come
/// from.
pub(crate) fn column_sources(
    plan: &Arc<dyn ExecutionPlan>,
    index: usize,
    sources: &mut Vec<(Arc<dyn ExecutionPlan>, usize)>,
) -> Option<()> {
    if plan.downcast_ref::<SieveScanExec>().is_some() {
        sources.push((Arc::clone(plan), index));
        return Some(());
    }
    let of_expression =
        |expr: &Arc<dyn PhysicalExpr>,
         input: &Arc<dyn ExecutionPlan>,
         sources: &mut Vec<(Arc<dyn ExecutionPlan>, usize)>| {
            collect_columns(expr)
                .iter()
                .try_for_each(|column| column_sources(input, column.index(), sources))
        };
    if let Some(projection) = plan.downcast_ref::<ProjectionExec>() {
        let expr = &projection.expr().get(index)?.expr;
        return of_expression(expr, projection.input(), sources);
    }
    if let Some(filter) = plan.downcast_ref::<FilterExec>() {
        let index = match filter.projection() {
            Some(projection) => *projection.get(index)?,
            None => index,
        };
        return column_sources(filter.input(), index, sources);
    }
    if let Some(join) = plan.downcast_ref::<HashJoinExec>() {
        let index = match &join.projection {
            Some(projection) => *projection.get(index)?,
            None => index,
        };
        let (_, columns) = datafusion::physical_plan::joins::utils::build_join_schema(
            &join.left().schema(),
            &join.right().schema(),
            join.join_type(),
        );
        let column = columns.get(index)?;
        let (input, other, keys) = match column.side {
            JoinSide::Left => (join.left(), join.right(), true),
            JoinSide::Right => (join.right(), join.left(), false),
            // A mark column comes from no table.
            JoinSide::None => return Some(()),
        };
        column_sources(input, column.index, sources)?;
        // A semi join's output key equals a key of the other side, where
        // DataFusion pushes filters on it too.
        if matches!(join.join_type(), JoinType::LeftSemi | JoinType::RightSemi) {
            for (left, right) in join.on() {
                let (mine, theirs) = if keys { (left, right) } else { (right, left) };
                if mine
                    .downcast_ref::<Column>()
                    .is_some_and(|key| key.index() == column.index)
                {
                    of_expression(theirs, other, sources)?;
                }
            }
        }
        return Some(());
    }
    if let Some(aggregate) = plan.downcast_ref::<AggregateExec>() {
        return match aggregate.group_expr().expr().get(index) {
            Some((expr, _)) if !aggregate.group_expr().has_grouping_set() => {
                of_expression(expr, aggregate.input(), sources)
            }
            // An aggregate's value comes from no table column as it is.
            None => Some(()),
            Some(_) => None,
        };
    }
    let passes_through = plan.downcast_ref::<RepartitionExec>().is_some()
        || plan.downcast_ref::<CoalescePartitionsExec>().is_some()
        || plan.downcast_ref::<SortExec>().is_some()
        || plan
            .downcast_ref::<datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec>()
            .is_some()
        || plan.downcast_ref::<BuildKeysExec>().is_some()
        || plan.downcast_ref::<crate::MergePartitionsExec>().is_some()
        || plan.downcast_ref::<crate::JoinInputExec>().is_some()
        || plan.downcast_ref::<crate::SpillableHashJoinExec>().is_some();
    #[allow(deprecated)]
    let passes_through = passes_through
        || plan
            .downcast_ref::<datafusion::physical_plan::coalesce_batches::CoalesceBatchesExec>()
            .is_some();
    if passes_through {
        let [input] = &plan.children()[..] else {
            return None;
        };
        return column_sources(input, index, sources);
    }
    None
}

/// Whether a dynamic filter of `join` that reached `scan` over its output
/// columns `columns` sits where the join's probe keys come from; `true`
/// where that cannot be followed.
fn filter_where_keys_come_from(
    join: &HashJoinExec,
    scan: &Arc<dyn ExecutionPlan>,
    columns: &[usize],
) -> bool {
    let mut sources = Vec::new();
    for (_, probe_key) in join.on() {
        for column in collect_columns(probe_key) {
            if column_sources(join.right(), column.index(), &mut sources).is_none() {
                return true;
            }
        }
    }
    columns.iter().all(|column| {
        sources
            .iter()
            .any(|(source, index)| Arc::ptr_eq(source, scan) && index == column)
    })
}

impl PhysicalOptimizerRule for WaitForJoinFilters {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let settings = SieveConfig::of(config);
        let mut nodes = Vec::new();
        post_order(&plan, &mut nodes);
        let place_of = |target: &Arc<dyn ExecutionPlan>| {
            nodes.iter().position(|node| Arc::ptr_eq(node, target))
        };
        // Every hash join, with its key collector.
        let mut joins: HashMap<usize, JoinInfo> = HashMap::new();
        let mut sources: Vec<JoinSource> = Vec::new();
        for (place, node) in nodes.iter().enumerate() {
            let Some(join) = node.downcast_ref::<HashJoinExec>() else {
                continue;
            };
            // Only an exact count (estimates through filters and joins are
            // too rough to give a useful filter up on), and only if no scan
            // of the build side is itself cut by a join filter at run time.
            let mut build_filtered = false;
            join.left().apply(|inner| {
                if inner
                    .downcast_ref::<SieveScanExec>()
                    .is_some_and(SieveScanExec::has_join_filters)
                {
                    build_filtered = true;
                    return Ok(TreeNodeRecursion::Stop);
                }
                Ok(TreeNodeRecursion::Continue)
            })?;
            let build_rows = StatisticsContext::new()
                .compute(join.left().as_ref(), &StatisticsArgs::new())
                .ok()
                .and_then(|statistics| match statistics.num_rows {
                    Precision::Exact(rows) if !build_filtered => Some(rows),
                    _ => None,
                });
            let partitions = match join.partition_mode() {
                PartitionMode::CollectLeft => 1,
                _ => join.left().properties().partitioning.partition_count(),
            };
            // A plan optimized twice keeps the collector its join already feeds.
            let keys = match join.left().downcast_ref::<BuildKeysExec>() {
                Some(tap) => Arc::clone(tap.collector()),
                None => Arc::new(BuildKeys::new(
                    partitions,
                    join.on().len(),
                    settings.join_filter_keys_max,
                )),
            };
            joins.insert(
                place,
                JoinInfo {
                    name: build_side_name(join.left()),
                    build_rows,
                    keys,
                    used: false,
                },
            );
            for filter in join.dynamic_expressions_produced() {
                if let Some(id) = filter.expression_id() {
                    sources.push(JoinSource { id, join: place });
                }
            }
        }
        if joins.is_empty() {
            return Ok(plan);
        }
        // Key filters of inner joins whose probe keys reach a scan through
        // other joins (by the scan's place).
        let mut key_filters: HashMap<usize, Vec<(usize, KeyFilterSlot)>> = HashMap::new();
        if settings.join_filters && settings.join_filters_through_joins {
            for (place, node) in nodes.iter().enumerate() {
                let Some(join) = node.downcast_ref::<HashJoinExec>() else {
                    continue;
                };
                // A join collects its build side before it polls its probe
                // side, so the scan below never waits for a build side that
                // waits for it; a partitioned join's partitions run at once,
                // as they must for its own dynamic filter to complete.
                if *join.join_type() != JoinType::Inner {
                    continue;
                }
                let ids: Vec<u64> = join
                    .dynamic_expressions_produced()
                    .iter()
                    .filter_map(|filter| filter.expression_id())
                    .collect();
                let info = &joins[&place];
                for (position, (build_key, probe_key)) in join.on().iter().enumerate() {
                    let Some(column) = probe_key.downcast_ref::<Column>() else {
                        continue;
                    };
                    let Some((scan_node, scan_column)) = trace_column(join.right(), column.index())
                    else {
                        continue;
                    };
                    let scan = scan_node
                        .downcast_ref::<SieveScanExec>()
                        .expect("traced to a scan");
                    // Its own filter reaches the scan the usual way.
                    if ids.iter().any(|&id| scan.holds_expression_id(id)) {
                        continue;
                    }
                    let Some(scan_place) = place_of(&scan_node) else {
                        continue;
                    };
                    let build_type = build_key.data_type(&join.left().schema())?;
                    if &build_type != scan.schema().field(scan_column).data_type() {
                        continue;
                    }
                    if let (Some(rows), Some(bound)) =
                        (info.build_rows, scan.column_distinct_bound(scan_column))
                    {
                        if (rows as f64) >= UNSELECTIVE_BUILD_RATIO * bound as f64 {
                            continue;
                        }
                    }
                    key_filters.entry(scan_place).or_default().push((
                        place,
                        KeyFilterSlot {
                            source: info.name.clone(),
                            keys: Arc::clone(&info.keys),
                            position,
                            column: scan_column,
                            nulls_pass: join.null_equality() == NullEquality::NullEqualsNull,
                        },
                    ));
                }
            }
        }
        if sources.is_empty() && key_filters.is_empty() {
            return Ok(plan);
        }
        let mut place = 0;
        let plan = plan
            .transform_up(|node| {
                let here = place;
                place += 1;
                let Some(scan) = node.downcast_ref::<SieveScanExec>() else {
                    return Ok(Transformed::no(node));
                };
                let mut updated: Option<SieveScanExec> = None;
                for source in &sources {
                    let current = updated.as_ref().unwrap_or(scan);
                    if !current.holds_expression_id(source.id) {
                        continue;
                    }
                    let info = joins.get_mut(&source.join).expect("every join is listed");
                    let join = nodes[source.join]
                        .downcast_ref::<HashJoinExec>()
                        .expect("a join's place");
                    let columns = current.join_filter_columns(source.id);
                    if !filter_where_keys_come_from(join, &node, &columns) {
                        updated = Some(current.without_join_filter(
                            source.id,
                            format!(
                                "join filter from {} dropped: pushed onto a column its \
                                 probe key does not come from",
                                info.name
                            ),
                        ));
                        continue;
                    }
                    // A build side with about as many keys as the probe key can
                    // take filters nothing, yet building its key list costs the
                    // join: drop the filter, so the join does not compute it.
                    let bound = current.join_key_distinct_bound(source.id);
                    if let (Some(rows), Some(bound)) = (info.build_rows, bound) {
                        if (rows as f64) >= UNSELECTIVE_BUILD_RATIO * bound as f64 {
                            updated = Some(current.without_join_filter(
                                source.id,
                                format!(
                                    "join filter from {} dropped: {rows} build rows \
                                     for at most {bound} distinct probe keys",
                                    info.name
                                ),
                            ));
                            continue;
                        }
                    }
                    info.used = true;
                    updated = Some(current.with_join_filter_source(
                        source.id,
                        &info.name,
                        Arc::clone(&info.keys),
                    ));
                }
                for (join, slot) in key_filters.remove(&here).unwrap_or_default() {
                    let current = updated.as_ref().unwrap_or(scan);
                    joins.get_mut(&join).expect("every join is listed").used = true;
                    updated = Some(current.with_key_filter(slot));
                }
                Ok(match updated {
                    Some(updated) => Transformed::yes(Arc::new(updated) as Arc<dyn ExecutionPlan>),
                    None => Transformed::no(node),
                })
            })?
            .data;
        // Collect the build-side keys of every join whose filter a scan uses.
        let mut place = 0;
        plan.transform_up(|node| {
            let here = place;
            place += 1;
            let Some(join) = node.downcast_ref::<HashJoinExec>() else {
                return Ok(Transformed::no(node));
            };
            let Some(info) = joins.get(&here).filter(|info| info.used) else {
                return Ok(Transformed::no(node));
            };
            if join.left().downcast_ref::<BuildKeysExec>().is_some() {
                return Ok(Transformed::no(node));
            }
            let keys = join.on().iter().map(|(left, _)| Arc::clone(left)).collect();
            let tap: Arc<dyn ExecutionPlan> = Arc::new(BuildKeysExec::new(
                Arc::clone(join.left()),
                keys,
                Arc::clone(&info.keys),
            ));
            let right = Arc::clone(join.right());
            Ok(Transformed::yes(
                Arc::clone(&node).replace_children(vec![tap, right], keep())?,
            ))
        })
        .map(|transformed| transformed.data)
    }

    fn name(&self) -> &str {
        "sieve_wait_for_join_filters"
    }

    fn schema_check(&self) -> bool {
        true
    }
}
