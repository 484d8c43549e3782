//! Which input of a hash join is built: the one a join filter cannot cut,
//! when the other will be cut.
//!
//! DataFusion's `JoinSelection` builds a hash join on its smaller input, by
//! statistics. A join's output has none in DataFusion 55 (its rows are
//! `Absent`), so above a chain of joins the choice falls to the order of
//! the SQL. TPC-H Q9 at SF 10 builds its orders join on 15 M orders (a scan
//! with nothing to push) and probes it with 3.3 M lineitem rows that part's
//! join filter left: the hash table holds every order, and orders ships
//! whole. Built the other way, the lineitem rows fill the hash table and the
//! orders scan is the probe side: it takes the join filter of their 3.3 M
//! order keys, and the storage nodes ship a fifth of orders.
//!
//! [`BuildOnFilteredSide`] swaps an inner, partitioned hash join where
//!
//! - the build input is a scan that no join filter cuts (nothing pushed
//!   but its own filter, no aggregation), through projections only: its
//!   rows are the table's, exact, or those its filter keeps, estimated;
//! - the probe input is cut by join filters: along its chain of inner joins
//!   a build side is filtered ([`estimated_rows`]), and the probe rows so
//!   estimated are fewer than the build's.
//!
//! A filter's rows are estimated with each equality to a constant keeping
//! 1 / the column's distinct values (estimated from the slices' exact
//! counts, [`crate::estimate::rows_with_distinct_values`]): DataFusion
//! keeps a fifth for any equality over a string. TPC-H Q21 built its
//! orders join on orders' `o_orderstatus = 'F'` (73 M rows at SF 100, a
//! 2.2 GB hash table) and probed it with the 7.3 M lineitem rows of one
//! nation's suppliers; built on those, orders takes their join filter.
//!
//! It also swaps an inner hash join (collect-left or partitioned) whose
//! build input is a chain of joins over a larger table and whose probe
//! input is one filtered scan estimated to fewer rows: SSB's Q4.x join
//! `part` last, and DataFusion, without statistics for a join's output,
//! builds from the joins over `lineorder` and probes with `part`. Built on
//! `part`, every join of the chain has `lineorder` on its probe side: the
//! fact scan takes `part`'s join filter too, and the star join
//! ([`crate::PushStarJoinToStorage`]) takes the whole chain.
//!
//! It also builds an inner or left join on its probe input where that is
//! an aggregation grouped by the probe key, estimated (by the distinct
//! values of the column it groups) to no more groups than the build
//! side's scan has rows, and the build side is such a plain scan: TPC-H
//! Q13 counts orders per customer ([`crate::AggregateBeforeJoin`]) and
//! left-joins customer to the counts. Built on customer, the join held 15 M
//! customers (439 MB at SF 100) while the aggregation below its probe side
//! ran, so under a 512 MB statement bound the aggregation spilled 1.9 GB.
//! Built on the counts, the aggregation runs first with the memory to
//! itself, and its output, which it holds at its end anyway, becomes the
//! hash table; customer streams through as the probe side (a right join).
//!
//! It runs right after `JoinSelection`, before DataFusion creates the
//! join's dynamic filter and links it to the new probe scan
//! (`FilterPushdown::new_post_optimization`). `sieve.swap_join_sides`
//! (default on) turns it off; EXPLAIN shows the swapped join (and its probe
//! scan's `join filter from ...`).

use std::sync::Arc;

use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{JoinType, Result};
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::{
    AggregateExec, AggregateInputMode, AggregateMode, AggregateOutputMode,
};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::ExecutionPlan;

use crate::{SieveConfig, SieveScanExec};

/// Builds a hash join on the input no join filter can cut, where the other
/// input will be cut to fewer rows (see the module documentation).
#[derive(Debug, Default)]
pub struct BuildOnFilteredSide;

impl PhysicalOptimizerRule for BuildOnFilteredSide {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let settings = SieveConfig::of(config);
        if !settings.swap_join_sides || !settings.join_filters {
            return Ok(plan);
        }
        plan.transform_up(|node| {
            let Some(join) = node.downcast_ref::<HashJoinExec>() else {
                return Ok(Transformed::no(node));
            };
            let mode = if should_swap(join) || should_build_on_aggregate(join) {
                PartitionMode::Partitioned
            } else if should_build_on_dimension(join) {
                *join.partition_mode()
            } else {
                return Ok(Transformed::no(node));
            };
            // Refused only where a dynamic filter already exists (the rule
            // placed after DataFusion links them): the join stays as it is.
            match join.swap_inputs(mode) {
                Ok(swapped) => Ok(Transformed::yes(swapped)),
                Err(_) => Ok(Transformed::no(node)),
            }
        })
        .map(|transformed| transformed.data)
    }

    fn name(&self) -> &str {
        "sieve_build_on_filtered_side"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

fn should_swap(join: &HashJoinExec) -> bool {
    if *join.join_type() != JoinType::Inner
        || *join.partition_mode() != PartitionMode::Partitioned
        || !join.dynamic_expressions_produced().is_empty()
    {
        return false;
    }
    let Some(build_rows) = plain_scan_rows(join.left()) else {
        return false;
    };
    match estimated_rows(join.right()) {
        Some(Estimate { rows, cut: true }) => rows < build_rows as f64,
        _ => false,
    }
}

/// An inner join built from a chain of joins and probed by one filtered
/// scan estimated to fewer rows than the chain yields (see the module
/// documentation).
fn should_build_on_dimension(join: &HashJoinExec) -> bool {
    if *join.join_type() != JoinType::Inner
        || !matches!(
            join.partition_mode(),
            PartitionMode::CollectLeft | PartitionMode::Partitioned
        )
        || join.filter().is_some()
        || !join.dynamic_expressions_produced().is_empty()
        || !has_join(join.left())
        || has_join(join.right())
    {
        return false;
    }
    match (estimated_rows(join.left()), estimated_rows(join.right())) {
        (Some(build), Some(Estimate { rows, cut: true })) => rows < build.rows,
        _ => false,
    }
}

/// An inner or left partitioned join built on a plain scan and probed by
/// an aggregation grouped by the probe key, whose groups are estimated to
/// be no more than the scan's rows (see the module documentation).
fn should_build_on_aggregate(join: &HashJoinExec) -> bool {
    if !matches!(join.join_type(), JoinType::Inner | JoinType::Left)
        || *join.partition_mode() != PartitionMode::Partitioned
        || !join.dynamic_expressions_produced().is_empty()
    {
        return false;
    }
    let Some(build_rows) = plain_scan_rows(join.left()) else {
        return false;
    };
    let [(_, probe_key)] = join.on() else {
        return false;
    };
    let Some(key) = probe_key.downcast_ref::<Column>() else {
        return false;
    };
    aggregated_groups(join.right(), key.index()).is_some_and(|groups| groups <= build_rows)
}

/// The groups `plan` yields, estimated from the distinct values of the
/// table column they group, where it is an aggregation (through
/// projections and repartitions) whose one group key is its output column
/// `index`.
fn aggregated_groups(plan: &Arc<dyn ExecutionPlan>, index: usize) -> Option<usize> {
    if let Some(aggregate) = plan.downcast_ref::<AggregateExec>() {
        if index != 0 || aggregate.mode().output_mode() != AggregateOutputMode::Final {
            return None;
        }
        let source = group_key_source(aggregate)?;
        return source.scan().table().distinct_estimate(source.table_column);
    }
    if let Some(projection) = plan.downcast_ref::<ProjectionExec>() {
        let column = projection
            .expr()
            .get(index)?
            .expr
            .downcast_ref::<Column>()?;
        return aggregated_groups(projection.input(), column.index());
    }
    if plan.downcast_ref::<RepartitionExec>().is_some() {
        let [input] = &plan.children()[..] else {
            return None;
        };
        return aggregated_groups(input, index);
    }
    None
}

/// Where an aggregation's one group key comes from: a table's column,
/// carried unchanged from its scan, and the plan the aggregation's rows
/// come from (below its partial aggregation, if it has one).
pub(crate) struct GroupKeySource {
    scan: Arc<dyn ExecutionPlan>,
    /// The key's column in the scan's table.
    pub(crate) table_column: usize,
    /// The input whose rows the aggregation groups.
    pub(crate) rows: Arc<dyn ExecutionPlan>,
}

impl GroupKeySource {
    pub(crate) fn scan(&self) -> &SieveScanExec {
        self.scan
            .downcast_ref::<SieveScanExec>()
            .expect("a source is a scan")
    }
}

/// The source of `aggregate`'s one group key, a column (see
/// [`GroupKeySource`]).
pub(crate) fn group_key_source(aggregate: &AggregateExec) -> Option<GroupKeySource> {
    let group_by = aggregate.group_expr();
    let [(group, _)] = group_by.expr() else {
        return None;
    };
    if group_by.has_grouping_set() {
        return None;
    }
    let column = group.downcast_ref::<Column>()?.index();
    // A final aggregation's group column is its partial one's.
    let (rows, column) = match aggregate.mode().input_mode() {
        AggregateInputMode::Partial => {
            let partial = below_partial(aggregate.input())?;
            let [(group, _)] = partial.group_expr().expr() else {
                return None;
            };
            (partial.input(), group.downcast_ref::<Column>()?.index())
        }
        AggregateInputMode::Raw => (aggregate.input(), column),
    };
    let (scan, column) = crate::optimizer::trace_column(rows, column)?;
    let table_column = *scan
        .downcast_ref::<SieveScanExec>()?
        .shipped_columns()
        .get(column)?;
    Some(GroupKeySource {
        scan,
        table_column,
        rows: Arc::clone(rows),
    })
}

/// The partial aggregation below a final one, through repartitions.
fn below_partial(plan: &Arc<dyn ExecutionPlan>) -> Option<&AggregateExec> {
    if let Some(aggregate) = plan.downcast_ref::<AggregateExec>() {
        return (*aggregate.mode() == AggregateMode::Partial).then_some(aggregate);
    }
    if plan.downcast_ref::<RepartitionExec>().is_some() {
        return below_partial(plan.children().into_iter().next()?);
    }
    None
}

/// Whether a hash join is in `plan`.
fn has_join(plan: &Arc<dyn ExecutionPlan>) -> bool {
    plan.downcast_ref::<HashJoinExec>().is_some() || plan.children().into_iter().any(has_join)
}

/// The rows of a scan that no join filter cuts (nothing pushed but its own
/// filter), under projections only: exact without a filter, estimated
/// from the table's statistics with one.
fn plain_scan_rows(plan: &Arc<dyn ExecutionPlan>) -> Option<usize> {
    if let Some(scan) = plan.downcast_ref::<SieveScanExec>() {
        if scan.aggregate().is_some() || scan.star_join().is_some() || scan.has_join_filters() {
            return None;
        }
        return scan.estimated_rows_by_distinct().map(|rows| rows as usize);
    }
    if plan.downcast_ref::<ProjectionExec>().is_some() {
        let [input] = &plan.children()[..] else {
            return None;
        };
        return plain_scan_rows(input);
    }
    None
}

/// Rows a plan is estimated to yield, with the join filters its inner joins
/// will apply to their probe scans.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Estimate {
    pub(crate) rows: f64,
    /// Some filter or join filter cuts these rows below the table's.
    pub(crate) cut: bool,
}

/// Estimated rows of `plan` where each inner hash join keeps the share of
/// its probe rows that its build side keeps of its table (a key of the
/// probe side that references the build side's table, as foreign keys do):
/// Q9's part join keeps lineitem's rows in the share of part that matches
/// `p_name LIKE '%green%'`. `None` where the plan holds anything else.
pub(crate) fn estimated_rows(plan: &Arc<dyn ExecutionPlan>) -> Option<Estimate> {
    if let Some(scan) = plan.downcast_ref::<SieveScanExec>() {
        if scan.aggregate().is_some() || scan.star_join().is_some() {
            return None;
        }
        let table = scan.table().statistics.num_rows.get_value().copied()? as f64;
        let rows = scan.estimated_rows_by_distinct()?;
        return Some(Estimate {
            rows,
            cut: rows < table,
        });
    }
    if let Some(join) = plan.downcast_ref::<HashJoinExec>() {
        if *join.join_type() != JoinType::Inner {
            return None;
        }
        let build = estimated_rows(join.left())?;
        let probe = estimated_rows(join.right())?;
        let share = match table_rows(join.left()) {
            Some(table) if table > 0.0 => (build.rows / table).min(1.0),
            _ => 1.0,
        };
        return Some(Estimate {
            rows: probe.rows * share,
            cut: probe.cut || share < 1.0,
        });
    }
    let passes_through = plan.downcast_ref::<ProjectionExec>().is_some()
        || plan.downcast_ref::<RepartitionExec>().is_some()
        || plan.downcast_ref::<CoalescePartitionsExec>().is_some()
        || plan.downcast_ref::<crate::MergePartitionsExec>().is_some()
        || plan.downcast_ref::<crate::BuildKeysExec>().is_some()
        || plan.downcast_ref::<FilterExec>().is_some();
    if passes_through {
        let [input] = &plan.children()[..] else {
            return None;
        };
        return estimated_rows(input);
    }
    None
}

/// The rows of the table at the bottom of a join's build side: its scan's
/// table, through projections, repartitions, filters and the probe sides
/// of inner joins.
fn table_rows(plan: &Arc<dyn ExecutionPlan>) -> Option<f64> {
    if let Some(scan) = plan.downcast_ref::<SieveScanExec>() {
        return scan
            .table()
            .statistics
            .num_rows
            .get_value()
            .map(|&rows| rows as f64);
    }
    if let Some(join) = plan.downcast_ref::<HashJoinExec>() {
        return table_rows(join.right());
    }
    let [input] = &plan.children()[..] else {
        return None;
    };
    table_rows(input)
}
