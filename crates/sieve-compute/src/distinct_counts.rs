//! Grouped `count(DISTINCT x)` over a join counted with one set of
//! (group, value) pairs, not regrouped by every grouping column and `x`.
//!
//! DataFusion's `SingleDistinctToGroupBy` rewrites
//!
//! ```text
//!   Aggregate(group by a, b; count(DISTINCT x))
//! =>
//!   Aggregate(group by a, b; count(x))
//!     Aggregate(group by a, b, x)
//! ```
//!
//! The inner aggregation holds one group per distinct (a, b, x): every
//! grouping column again for each value. TPC-H Q16 groups the join of
//! partsupp and part by brand, type and size and counts distinct
//! suppliers: 11.9 M such groups at SF 100, about 105 bytes each with
//! their hash table, 1.25 GB, the compute node's largest allocation at
//! that scale. DataFusion 55 also counts distinct integers per group
//! with a groups accumulator (`PrimitiveDistinctCountGroupsAccumulator`):
//! one hash set of (group index, value), 16 bytes a pair, each grouping
//! column held once per group. [`CountDistinctBySets`] keeps the original
//! aggregation there (measured at SF 100: Q16's process peak 1.59 ->
//! 0.98 GB, its aggregations' compute time the same).
//!
//! Where the rewrite is kept (the rule delegates to DataFusion's):
//!
//! - an aggregation without GROUP BY: its one group would be counted on
//!   one thread, where the rewrite spreads the values over all of them;
//! - a DISTINCT argument other than an integer (DataFusion has no groups
//!   accumulator for it, and would feed one row accumulator per group);
//! - a DISTINCT aggregate other than `count`;
//! - an input that is one table's scan (through filters, projections and
//!   aliases): the rewrite's inner aggregation is then a scan's, which
//!   [`crate::PushAggregateToStorage`] runs on the storage nodes, so
//!   only distinct pairs are shipped;
//! - `sieve.count_distinct_by_sets` off.
//!
//! Both plans give the same counts: a set per group counts each non-NULL
//! value once, as grouping by the value and counting non-NULL groups does.
//!
//! The kept `count` is [`CountBySets`], DataFusion's own `count` with one
//! change: its groups accumulator starts afresh once it has emitted every
//! group. DataFusion's accumulator empties its set on emitting but keeps
//! the set's capacity, and reports its memory by capacity; an aggregation
//! under memory pressure emits (a partial one) or spills (a final one) to
//! give memory back, could not shrink its reservation, and failed (TPC-H
//! Q16 at SF 100 under a 1 GB statement pool: `Resources exhausted` in its
//! partial aggregation).

use std::any::Any;
use std::sync::Arc;

use arrow::array::{ArrayRef, BooleanArray};
use arrow::datatypes::{
    DataType, FieldRef, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type,
    UInt64Type, UInt8Type,
};
use datafusion::common::tree_node::Transformed;
use datafusion::common::{Result, ScalarValue};
use datafusion::logical_expr::expr::{AggregateFunction, AggregateFunctionParams};
use datafusion::logical_expr::function::{AccumulatorArgs, StateFieldsArgs};
use datafusion::logical_expr::utils::AggregateOrderSensitivity;
use datafusion::logical_expr::{
    Accumulator, Aggregate, AggregateUDF, AggregateUDFImpl, EmitTo, Expr, ExprSchemable,
    GroupsAccumulator, LogicalPlan, ReversedUDAF, SetMonotonicity, Signature,
};
use datafusion::optimizer::optimizer::ApplyOrder;
use datafusion::optimizer::single_distinct_to_groupby::SingleDistinctToGroupBy;
use datafusion::optimizer::{OptimizerConfig, OptimizerRule};
use datafusion::physical_plan::udaf::StatisticsArgs;
use datafusion_functions_aggregate_common::aggregate::count_distinct::PrimitiveDistinctCountGroupsAccumulator;

use crate::SieveConfig;

/// DataFusion's `SingleDistinctToGroupBy`, declined for grouped integer
/// `count(DISTINCT)` over anything but one table's scan (see the module
/// documentation). It takes that rule's place in the optimizer.
#[derive(Debug, Default)]
pub struct CountDistinctBySets {
    rewrite: SingleDistinctToGroupBy,
}

impl CountDistinctBySets {
    /// The name of the DataFusion rule this one replaces.
    pub const REPLACES: &'static str = "single_distinct_aggregation_to_group_by";
}

impl OptimizerRule for CountDistinctBySets {
    fn name(&self) -> &str {
        "sieve_count_distinct_by_sets"
    }

    fn apply_order(&self) -> Option<ApplyOrder> {
        self.rewrite.apply_order()
    }

    fn supports_rewrite(&self) -> bool {
        true
    }

    fn rewrite(
        &self,
        plan: LogicalPlan,
        config: &dyn OptimizerConfig,
    ) -> Result<Transformed<LogicalPlan>> {
        if let LogicalPlan::Aggregate(aggregate) = &plan {
            let options = config.options();
            if SieveConfig::of(&options).count_distinct_by_sets && counted_by_sets(aggregate) {
                return counted_by_fresh_sets(plan);
            }
        }
        self.rewrite.rewrite(plan, config)
    }
}

/// Whether `aggregate` is better left to DataFusion's distinct-count groups
/// accumulator than regrouped.
fn counted_by_sets(aggregate: &Aggregate) -> bool {
    if aggregate.group_expr.is_empty()
        || matches!(aggregate.group_expr.first(), Some(Expr::GroupingSet(_)))
        || one_scan(&aggregate.input)
    {
        return false;
    }
    let schema = aggregate.input.schema();
    let mut distinct = 0;
    for expr in &aggregate.aggr_expr {
        let Expr::AggregateFunction(AggregateFunction { func, params }) = expr else {
            return false;
        };
        if !params.distinct {
            continue;
        }
        distinct += 1;
        let [arg] = &params.args[..] else {
            return false;
        };
        let integer = arg
            .get_type(schema.as_ref())
            .is_ok_and(|data_type| data_type.is_integer());
        if func.name() != "count" || !integer {
            return false;
        }
    }
    distinct > 0
}

/// `plan`, an aggregation kept, with its distinct `count`s made
/// [`CountBySets`] (once: the optimizer runs its rules more than once).
fn counted_by_fresh_sets(plan: LogicalPlan) -> Result<Transformed<LogicalPlan>> {
    let LogicalPlan::Aggregate(aggregate) = plan else {
        return Ok(Transformed::no(plan));
    };
    let mut changed = false;
    let aggr_expr = aggregate
        .aggr_expr
        .iter()
        .map(|expr| match expr {
            Expr::AggregateFunction(AggregateFunction { func, params })
                if params.distinct
                    && func.name() == "count"
                    && (func.inner().as_ref() as &dyn Any)
                        .downcast_ref::<CountBySets>()
                        .is_none() =>
            {
                changed = true;
                Expr::AggregateFunction(AggregateFunction {
                    func: Arc::new(AggregateUDF::new_from_impl(CountBySets {
                        count: Arc::clone(func),
                    })),
                    params: params.clone(),
                })
            }
            other => other.clone(),
        })
        .collect();
    if !changed {
        return Ok(Transformed::no(LogicalPlan::Aggregate(aggregate)));
    }
    Aggregate::try_new_with_schema(
        aggregate.input,
        aggregate.group_expr,
        aggr_expr,
        aggregate.schema,
    )
    .map(|aggregate| Transformed::yes(LogicalPlan::Aggregate(aggregate)))
}

/// DataFusion's `count`, whose distinct groups accumulator over integers
/// starts afresh after emitting every group (see the module
/// documentation). Everything else is `count`'s own.
#[derive(Debug, PartialEq, Eq, Hash)]
pub(crate) struct CountBySets {
    count: Arc<AggregateUDF>,
}

impl CountBySets {
    fn count(&self) -> &Arc<dyn AggregateUDFImpl> {
        self.count.inner()
    }
}

impl AggregateUDFImpl for CountBySets {
    fn name(&self) -> &str {
        self.count().name()
    }

    fn aliases(&self) -> &[String] {
        self.count().aliases()
    }

    fn schema_name(&self, params: &AggregateFunctionParams) -> Result<String> {
        self.count().schema_name(params)
    }

    fn human_display(&self, params: &AggregateFunctionParams) -> Result<String> {
        self.count().human_display(params)
    }

    fn display_name(&self, params: &AggregateFunctionParams) -> Result<String> {
        self.count().display_name(params)
    }

    fn signature(&self) -> &Signature {
        self.count().signature()
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        self.count().return_type(arg_types)
    }

    fn return_field(&self, arg_fields: &[FieldRef]) -> Result<FieldRef> {
        self.count().return_field(arg_fields)
    }

    fn is_nullable(&self) -> bool {
        self.count().is_nullable()
    }

    fn accumulator(&self, args: AccumulatorArgs) -> Result<Box<dyn Accumulator>> {
        self.count().accumulator(args)
    }

    fn state_fields(&self, args: StateFieldsArgs) -> Result<Vec<FieldRef>> {
        self.count().state_fields(args)
    }

    fn groups_accumulator_supported(&self, args: AccumulatorArgs) -> bool {
        self.count().groups_accumulator_supported(args)
    }

    fn create_groups_accumulator(
        &self,
        args: AccumulatorArgs,
    ) -> Result<Box<dyn GroupsAccumulator>> {
        let fresh: Option<fn() -> Box<dyn GroupsAccumulator>> = match (
            args.is_distinct,
            args.expr_fields.first().map(|f| f.data_type()),
        ) {
            (true, Some(DataType::Int8)) => Some(fresh_set::<Int8Type>),
            (true, Some(DataType::Int16)) => Some(fresh_set::<Int16Type>),
            (true, Some(DataType::Int32)) => Some(fresh_set::<Int32Type>),
            (true, Some(DataType::Int64)) => Some(fresh_set::<Int64Type>),
            (true, Some(DataType::UInt8)) => Some(fresh_set::<UInt8Type>),
            (true, Some(DataType::UInt16)) => Some(fresh_set::<UInt16Type>),
            (true, Some(DataType::UInt32)) => Some(fresh_set::<UInt32Type>),
            (true, Some(DataType::UInt64)) => Some(fresh_set::<UInt64Type>),
            _ => None,
        };
        match fresh {
            Some(fresh) if args.exprs.len() == 1 => Ok(Box::new(FreshAfterEmitting {
                inner: fresh(),
                fresh,
            })),
            _ => self.count().create_groups_accumulator(args),
        }
    }

    fn create_sliding_accumulator(&self, args: AccumulatorArgs) -> Result<Box<dyn Accumulator>> {
        self.count().create_sliding_accumulator(args)
    }

    fn order_sensitivity(&self) -> AggregateOrderSensitivity {
        self.count().order_sensitivity()
    }

    fn simplify(
        &self,
    ) -> Option<datafusion::logical_expr::function::AggregateFunctionSimplification> {
        self.count().simplify()
    }

    fn reverse_expr(&self) -> ReversedUDAF {
        self.count().reverse_expr()
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        self.count().coerce_types(arg_types)
    }

    fn is_descending(&self) -> Option<bool> {
        self.count().is_descending()
    }

    fn value_from_stats(&self, statistics_args: &StatisticsArgs) -> Option<ScalarValue> {
        self.count().value_from_stats(statistics_args)
    }

    fn default_value(&self, data_type: &DataType) -> Result<ScalarValue> {
        self.count().default_value(data_type)
    }

    fn supports_null_handling_clause(&self) -> bool {
        self.count().supports_null_handling_clause()
    }

    fn supports_within_group_clause(&self) -> bool {
        self.count().supports_within_group_clause()
    }

    fn set_monotonicity(&self, data_type: &DataType) -> SetMonotonicity {
        self.count().set_monotonicity(data_type)
    }
}

fn fresh_set<T>() -> Box<dyn GroupsAccumulator>
where
    T: arrow::datatypes::ArrowPrimitiveType + Send + std::fmt::Debug,
    T::Native: Eq + std::hash::Hash,
{
    Box::new(PrimitiveDistinctCountGroupsAccumulator::<T>::new())
}

/// A groups accumulator replaced by a new one once it has emitted every
/// group, so that its memory (and the size it reports) goes back.
struct FreshAfterEmitting {
    inner: Box<dyn GroupsAccumulator>,
    fresh: fn() -> Box<dyn GroupsAccumulator>,
}

impl std::fmt::Debug for FreshAfterEmitting {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("FreshAfterEmitting")
    }
}

impl FreshAfterEmitting {
    fn emitted(&mut self, emit_to: EmitTo) {
        if matches!(emit_to, EmitTo::All) {
            self.inner = (self.fresh)();
        }
    }
}

impl GroupsAccumulator for FreshAfterEmitting {
    fn update_batch(
        &mut self,
        values: &[ArrayRef],
        group_indices: &[usize],
        opt_filter: Option<&BooleanArray>,
        total_num_groups: usize,
    ) -> Result<()> {
        self.inner
            .update_batch(values, group_indices, opt_filter, total_num_groups)
    }

    fn evaluate(&mut self, emit_to: EmitTo) -> Result<ArrayRef> {
        let result = self.inner.evaluate(emit_to)?;
        self.emitted(emit_to);
        Ok(result)
    }

    fn state(&mut self, emit_to: EmitTo) -> Result<Vec<ArrayRef>> {
        let result = self.inner.state(emit_to)?;
        self.emitted(emit_to);
        Ok(result)
    }

    fn merge_batch(
        &mut self,
        values: &[ArrayRef],
        group_indices: &[usize],
        total_num_groups: usize,
    ) -> Result<()> {
        self.inner
            .merge_batch(values, group_indices, total_num_groups)
    }

    fn convert_to_state(
        &self,
        values: &[ArrayRef],
        opt_filter: Option<&BooleanArray>,
    ) -> Result<Vec<ArrayRef>> {
        self.inner.convert_to_state(values, opt_filter)
    }

    fn size(&self) -> usize {
        self.inner.size()
    }
}

/// Whether `plan` is one table's scan under filters, projections and
/// aliases only.
fn one_scan(plan: &LogicalPlan) -> bool {
    match plan {
        LogicalPlan::TableScan(_) => true,
        LogicalPlan::Filter(_) | LogicalPlan::Projection(_) | LogicalPlan::SubqueryAlias(_) => {
            plan.inputs().into_iter().all(one_scan)
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::functions_aggregate::expr_fn::{count_distinct, sum};
    use datafusion::logical_expr::{col, table_scan, JoinType, LogicalPlanBuilder};
    use datafusion::optimizer::OptimizerContext;

    fn scan(name: &str) -> LogicalPlanBuilder {
        let schema = Schema::new(vec![
            Field::new("k", DataType::Int64, true),
            Field::new("g", DataType::Utf8, true),
            Field::new("x", DataType::Int64, true),
            Field::new("s", DataType::Utf8, true),
        ]);
        table_scan(Some(name), &schema, None).unwrap()
    }

    fn joined() -> LogicalPlanBuilder {
        scan("a")
            .join(
                scan("b").build().unwrap(),
                JoinType::Inner,
                (vec!["a.k"], vec!["b.k"]),
                None,
            )
            .unwrap()
    }

    fn optimized(plan: LogicalPlan) -> LogicalPlan {
        let rule = CountDistinctBySets::default();
        let context = OptimizerContext::new();
        rule.rewrite(plan, &context).unwrap().data
    }

    /// Whether DataFusion's rule regrouped `plan` (its inner grouping's
    /// alias).
    fn rewritten(plan: LogicalPlan) -> bool {
        optimized(plan)
            .display_indent()
            .to_string()
            .contains("alias1")
    }

    /// The distinct counts of `plan`'s top aggregation that are
    /// [`CountBySets`], and all its distinct aggregates.
    fn counted_by_sets(plan: &LogicalPlan) -> (usize, usize) {
        let LogicalPlan::Aggregate(aggregate) = plan else {
            panic!("not an aggregation:\n{plan}");
        };
        let mut sets = 0;
        let mut distinct = 0;
        for expr in &aggregate.aggr_expr {
            if let Expr::AggregateFunction(AggregateFunction { func, params }) = expr {
                if params.distinct {
                    distinct += 1;
                    sets += usize::from(
                        (func.inner().as_ref() as &dyn Any)
                            .downcast_ref::<CountBySets>()
                            .is_some(),
                    );
                }
            }
        }
        (sets, distinct)
    }

    #[test]
    fn grouped_integer_count_over_a_join_is_kept() {
        let plan = joined()
            .aggregate(
                vec![col("a.g")],
                vec![count_distinct(col("b.x")), sum(col("a.x"))],
            )
            .unwrap()
            .build()
            .unwrap();
        assert!(!rewritten(plan.clone()));
        let once = optimized(plan);
        assert_eq!(counted_by_sets(&once), (1, 1), "{once}");
        // Optimized again (the optimizer runs its rules more than once):
        // wrapped once only, and the same schema.
        let twice = optimized(once.clone());
        assert_eq!(counted_by_sets(&twice), (1, 1));
        assert_eq!(once.schema(), twice.schema());
        assert_eq!(once, twice);
    }

    #[test]
    fn other_shapes_are_rewritten() {
        // No GROUP BY.
        let ungrouped = joined()
            .aggregate(Vec::<Expr>::new(), vec![count_distinct(col("b.x"))])
            .unwrap()
            .build()
            .unwrap();
        // A string argument.
        let strings = joined()
            .aggregate(vec![col("a.g")], vec![count_distinct(col("b.s"))])
            .unwrap()
            .build()
            .unwrap();
        // One table's scan, filtered.
        let one_table = scan("a")
            .filter(col("x").gt(datafusion::logical_expr::lit(1i64)))
            .unwrap()
            .aggregate(vec![col("g")], vec![count_distinct(col("x"))])
            .unwrap()
            .build()
            .unwrap();
        for plan in [ungrouped, strings, one_table] {
            assert!(rewritten(plan.clone()), "not rewritten:\n{plan}");
        }
    }
}
