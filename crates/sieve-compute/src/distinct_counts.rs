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
//! The kept `count` is [`CountBySets`], DataFusion's own `count` whose
//! groups accumulator for distinct integers is [`DistinctPairs`]:
//! DataFusion's set of (group, value) pairs, with its memory told to the
//! pool before it is taken. It starts afresh once it has emitted every
//! group (DataFusion's kept its set's capacity, and so its reservation:
//! TPC-H Q16 at SF 100 under a 1 GB statement pool failed with `Resources
//! exhausted` in its partial aggregation). Its size counts the larger
//! table its next batch may grow the set into, so that a pool that cannot
//! grant it makes the aggregation emit or spill before the set doubles
//! (DataFusion's reported the doubled table once held, and never the
//! moment it held both tables). [`SetsInSmallBatches`] runs the
//! aggregations that merge the sets with small batches, so that the runs
//! they spill, a list of values per group, are read back in batches a
//! merge can reserve.

use std::any::Any;
use std::fmt;
use std::hash::Hash;
use std::mem::size_of;
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, BooleanArray, Int64Array, ListArray, ListBuilder, PrimitiveArray,
    PrimitiveBuilder,
};
use arrow::buffer::{OffsetBuffer, ScalarBuffer};
use arrow::datatypes::{
    ArrowPrimitiveType, DataType, Field, FieldRef, Int16Type, Int32Type, Int64Type, Int8Type,
    UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};
use datafusion::common::config::ConfigOptions;
use datafusion::common::hash_utils::RandomState;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{internal_err, DataFusionError, HashSet, Result, ScalarValue};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
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
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::udaf::StatisticsArgs;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use datafusion_functions_aggregate_common::aggregate::groups_accumulator::accumulate::accumulate;

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
        if !args.is_distinct || args.exprs.len() != 1 {
            return self.count().create_groups_accumulator(args);
        }
        let pairs: Box<dyn GroupsAccumulator> =
            match args.expr_fields.first().map(|f| f.data_type()) {
                Some(DataType::Int8) => Box::new(DistinctPairs::<Int8Type>::default()),
                Some(DataType::Int16) => Box::new(DistinctPairs::<Int16Type>::default()),
                Some(DataType::Int32) => Box::new(DistinctPairs::<Int32Type>::default()),
                Some(DataType::Int64) => Box::new(DistinctPairs::<Int64Type>::default()),
                Some(DataType::UInt8) => Box::new(DistinctPairs::<UInt8Type>::default()),
                Some(DataType::UInt16) => Box::new(DistinctPairs::<UInt16Type>::default()),
                Some(DataType::UInt32) => Box::new(DistinctPairs::<UInt32Type>::default()),
                Some(DataType::UInt64) => Box::new(DistinctPairs::<UInt64Type>::default()),
                _ => return self.count().create_groups_accumulator(args),
            };
        Ok(pairs)
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

/// The distinct (group, value) pairs of a grouped `count(DISTINCT x)` of
/// integers. It is DataFusion's `PrimitiveDistinctCountGroupsAccumulator`
/// (the same pairs in one hash set, the same state, a list of values per
/// group), with three changes for the memory pool.
///
/// - **Its size counts the growth the next batch may need.** A hash set
///   grows by allocating a table of twice the buckets and moving its
///   entries, so for that moment it holds both. DataFusion's accumulator
///   reports its size after a batch, when the new table is in place: an
///   aggregation's reservation was asked for the larger table only once
///   it was held, and never for both. Here, once the set has less room
///   than the most values one batch has brought, its size counts the
///   table it would grow into beside its own. A pool that refuses them
///   makes the aggregation emit (partial) or spill (final) before the set
///   doubles. Only the next doubling is counted: an empty set counts none
///   (counting the table a whole batch of lists would need refused the
///   final aggregation of Q16 at SF 100 right after it had spilled, and
///   failed the query), and a batch that doubles a set more than once is
///   counted after it, as DataFusion's are.
/// - **Once it has emitted every group, it starts afresh.** DataFusion's
///   empties its set but keeps the set's capacity, and reports its size by
///   capacity: an aggregation that emitted or spilled to give memory back
///   could not shrink its reservation (Q16 at SF 100 under a 1 GB pool
///   failed with `Resources exhausted`).
/// - **The pairs left after a partial emit go to a set sized for them**,
///   not one grown from empty.
struct DistinctPairs<T: ArrowPrimitiveType>
where
    T::Native: Eq + Hash,
{
    seen: HashSet<(usize, T::Native), RandomState>,
    counts: Vec<i64>,
    /// The most values one update or merge has brought.
    batch_values: usize,
}

impl<T: ArrowPrimitiveType> Default for DistinctPairs<T>
where
    T::Native: Eq + Hash,
{
    fn default() -> Self {
        Self {
            seen: HashSet::default(),
            counts: Vec::new(),
            batch_values: 0,
        }
    }
}

impl<T: ArrowPrimitiveType> std::fmt::Debug for DistinctPairs<T>
where
    T::Native: Eq + Hash,
{
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("DistinctPairs")
            .field("pairs", &self.seen.len())
            .field("groups", &self.counts.len())
            .finish()
    }
}

/// The buckets of a hash set (hashbrown's) that holds `capacity` entries.
fn buckets_of_capacity(capacity: usize) -> usize {
    match capacity {
        0 => 0,
        // A table of fewer than 8 buckets holds one less than its buckets.
        1..=7 => (capacity + 1).next_power_of_two(),
        // A larger one holds 7 in every 8.
        _ => (capacity.saturating_mul(8) / 7).next_power_of_two(),
    }
}

impl<T: ArrowPrimitiveType> DistinctPairs<T>
where
    T::Native: Eq + Hash,
{
    /// The bytes of a table of `buckets`: an entry and a control byte each.
    fn table_bytes(buckets: usize) -> usize {
        buckets.saturating_mul(size_of::<(usize, T::Native)>() + 1)
    }

    /// The bytes the set holds, and, if the next batch may double it, the
    /// bytes of the table it would grow into, held with this one while
    /// the entries move.
    fn set_bytes(&self) -> usize {
        let capacity = self.seen.capacity();
        let held = Self::table_bytes(buckets_of_capacity(capacity));
        if capacity > 0 && capacity - self.seen.len() < self.batch_values {
            held.saturating_mul(3)
        } else {
            held
        }
    }

    fn insert(&mut self, group: usize, value: T::Native) {
        if self.seen.insert((group, value)) {
            self.counts[group] += 1;
        }
    }

    /// Keeps the pairs of the groups after the first `emitted` (whose
    /// counts are already taken), renumbered from 0, in a set sized for
    /// them; a fresh set if none are left.
    fn keep_after(&mut self, emitted: usize, mut emit: impl FnMut(usize, T::Native)) {
        let left = self.counts.iter().sum::<i64>() as usize;
        let mut remaining = if left == 0 {
            HashSet::default()
        } else {
            HashSet::with_capacity_and_hasher(left, RandomState::default())
        };
        for (group, value) in self.seen.drain() {
            if group < emitted {
                emit(group, value);
            } else {
                remaining.insert((group - emitted, value));
            }
        }
        self.seen = remaining;
        if self.counts.is_empty() {
            self.counts = Vec::new();
        }
    }
}

impl<T> GroupsAccumulator for DistinctPairs<T>
where
    T: ArrowPrimitiveType + Send + std::fmt::Debug,
    T::Native: Eq + Hash,
{
    fn update_batch(
        &mut self,
        values: &[ArrayRef],
        group_indices: &[usize],
        opt_filter: Option<&BooleanArray>,
        total_num_groups: usize,
    ) -> Result<()> {
        let [values] = values else {
            return internal_err!("count(DISTINCT) takes one argument, got {}", values.len());
        };
        self.counts.resize(total_num_groups, 0);
        self.batch_values = self.batch_values.max(values.len());
        accumulate(
            group_indices,
            values.as_primitive::<T>(),
            opt_filter,
            |group, value| self.insert(group, value),
        );
        Ok(())
    }

    fn evaluate(&mut self, emit_to: EmitTo) -> Result<ArrayRef> {
        let counts = emit_to.take_needed(&mut self.counts);
        self.keep_after(counts.len(), |_, _| {});
        Ok(Arc::new(Int64Array::from(counts)))
    }

    fn state(&mut self, emit_to: EmitTo) -> Result<Vec<ArrayRef>> {
        let counts = emit_to.take_needed(&mut self.counts);
        let mut offsets = Vec::with_capacity(counts.len() + 1);
        offsets.push(0i32);
        let mut total = 0i32;
        for &count in &counts {
            total = i32::try_from(count)
                .ok()
                .and_then(|count| total.checked_add(count))
                .ok_or_else(|| {
                    DataFusionError::ResourcesExhausted(format!(
                        "count(DISTINCT): more than {} distinct values in one state batch",
                        i32::MAX
                    ))
                })?;
            offsets.push(total);
        }
        let mut values = vec![T::Native::default(); total as usize];
        let mut cursors = offsets[..counts.len()].to_vec();
        self.keep_after(counts.len(), |group, value| {
            values[cursors[group] as usize] = value;
            cursors[group] += 1;
        });
        let list = ListArray::new(
            Arc::new(Field::new_list_field(T::DATA_TYPE, true)),
            OffsetBuffer::new(offsets.into()),
            Arc::new(PrimitiveArray::<T>::new(ScalarBuffer::from(values), None)),
            None,
        );
        Ok(vec![Arc::new(list)])
    }

    fn merge_batch(
        &mut self,
        values: &[ArrayRef],
        group_indices: &[usize],
        total_num_groups: usize,
    ) -> Result<()> {
        let [values] = values else {
            return internal_err!("count(DISTINCT) merges one state, got {}", values.len());
        };
        self.counts.resize(total_num_groups, 0);
        let lists = values.as_list::<i32>();
        let offsets = lists.offsets();
        let inner = lists.values().as_primitive::<T>().values();
        let brought = (offsets[offsets.len() - 1] - offsets[0]) as usize;
        self.batch_values = self.batch_values.max(brought);
        for (row, &group) in group_indices.iter().enumerate() {
            let (start, end) = (offsets[row] as usize, offsets[row + 1] as usize);
            for &value in &inner[start..end] {
                self.insert(group, value);
            }
        }
        Ok(())
    }

    fn convert_to_state(
        &self,
        values: &[ArrayRef],
        opt_filter: Option<&BooleanArray>,
    ) -> Result<Vec<ArrayRef>> {
        let [values] = values else {
            return internal_err!("count(DISTINCT) takes one argument, got {}", values.len());
        };
        let values = values.as_primitive::<T>();
        let mut builder = ListBuilder::new(PrimitiveBuilder::<T>::with_capacity(values.len()))
            .with_field(Arc::new(Field::new_list_field(T::DATA_TYPE, true)));
        for row in 0..values.len() {
            let included = values.is_valid(row)
                && opt_filter.is_none_or(|filter| filter.is_valid(row) && filter.value(row));
            if included {
                builder.values().append_value(values.value(row));
            }
            builder.append(true);
        }
        Ok(vec![Arc::new(builder.finish())])
    }

    fn size(&self) -> usize {
        size_of::<Self>() + self.set_bytes() + self.counts.capacity() * size_of::<i64>()
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

/// Rows per batch of an aggregation that merges sets of distinct values
/// past its partial stage ([`SetsInSmallBatches`]).
pub const SETS_BATCH_ROWS: usize = 512;

/// Runs every aggregation that merges sets of distinct values (final, or
/// single, with a DISTINCT aggregate such as [`CountBySets`]) with batches
/// of [`SETS_BATCH_ROWS`] rows, its input with the session's batch size.
///
/// A state row of such an aggregation is a group's list of distinct values:
/// about 6 KB for TPC-H Q16 at SF 100, so a batch of DataFusion's 8,192 rows
/// is 51 MB. An aggregation that spills writes its runs in batches of its
/// batch size, and DataFusion's merge of the runs, which cannot spill,
/// reserves twice the largest batch of each run it reads, and then merges
/// a whole batch of lists into its sets. Under a 512 MB statement bound
/// Q16 failed there in some runs and not others (`Resources exhausted`
/// asking 51, 102 or 204 MB). With 512 rows a batch is about 3 MB.
///
/// DataFusion's aggregation reads its batch size from the task context it
/// is executed with, and executes its input with the same: the rule puts
/// the aggregation between two [`BatchRowsExec`], one that gives it the
/// smaller batch size and one under it that gives its input the session's
/// back.
#[derive(Debug, Default)]
pub struct SetsInSmallBatches;

impl PhysicalOptimizerRule for SetsInSmallBatches {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let session_rows = config.execution.batch_size.get();
        if session_rows <= SETS_BATCH_ROWS {
            return Ok(plan);
        }
        plan.transform_up(|node| {
            let Some(aggregate) = node.downcast_ref::<AggregateExec>() else {
                return Ok(Transformed::no(node));
            };
            if *aggregate.mode() == AggregateMode::Partial || !holds_sets(aggregate) {
                return Ok(Transformed::no(node));
            }
            let input = Arc::new(BatchRowsExec::new(
                Arc::clone(aggregate.input()),
                session_rows,
            ));
            let aggregate =
                Arc::clone(&node).replace_children(vec![input], crate::optimizer::recompute())?;
            Ok(Transformed::yes(Arc::new(BatchRowsExec::new(
                aggregate,
                SETS_BATCH_ROWS,
            ))))
        })
        .map(|transformed| transformed.data)
    }

    fn name(&self) -> &str {
        "SetsInSmallBatches"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// Whether an aggregation has a DISTINCT aggregate: its state is a list
/// of the distinct values of each group ([`CountBySets`]' and DataFusion's
/// own alike).
fn holds_sets(aggregate: &AggregateExec) -> bool {
    aggregate.aggr_expr().iter().any(|expr| expr.is_distinct())
}

/// Executes its input with a batch size of its own (the task context's
/// otherwise): see [`SetsInSmallBatches`].
#[derive(Debug)]
pub struct BatchRowsExec {
    input: Arc<dyn ExecutionPlan>,
    rows: usize,
}

impl BatchRowsExec {
    /// `input`, executed with batches of `rows` rows.
    pub fn new(input: Arc<dyn ExecutionPlan>, rows: usize) -> Self {
        Self { input, rows }
    }
}

impl DisplayAs for BatchRowsExec {
    fn fmt_as(&self, _format: DisplayFormatType, formatter: &mut fmt::Formatter) -> fmt::Result {
        write!(formatter, "BatchRowsExec: rows={}", self.rows)
    }
}

impl ExecutionPlan for BatchRowsExec {
    fn name(&self) -> &str {
        "BatchRowsExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.input.properties()
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        vec![false]
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let [input] = &children[..] else {
            return internal_err!("BatchRowsExec has one child");
        };
        Ok(Arc::new(Self::new(Arc::clone(input), self.rows)))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        if context.session_config().batch_size() == self.rows {
            return self.input.execute(partition, context);
        }
        let context = Arc::new(TaskContext::new(
            context.task_id(),
            context.session_id(),
            context.session_config().clone().with_batch_size(self.rows),
            context.scalar_functions().clone(),
            context.higher_order_functions().clone(),
            context.aggregate_functions().clone(),
            context.window_functions().clone(),
            context.runtime_env(),
        ));
        self.input.execute(partition, context)
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

    /// A small deterministic generator (xorshift).
    fn next(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    #[test]
    fn distinct_pairs_count_as_a_set_does_through_partial_emits_and_merges() {
        use arrow::array::Int64Array;
        use std::collections::{BTreeMap, BTreeSet};

        let mut rng = 0x5eed_u64;
        // Reference: the distinct non-NULL values of each key, not filtered.
        let mut expected: BTreeMap<u64, BTreeSet<i64>> = BTreeMap::new();
        let mut partial = DistinctPairs::<Int64Type>::default();
        // The key of each of the partial's groups, in group order.
        let mut partial_keys: Vec<u64> = Vec::new();
        let mut final_ = DistinctPairs::<Int64Type>::default();
        let mut final_keys: Vec<u64> = Vec::new();
        let mut merge = |state: &ArrayRef, keys: &[u64], final_: &mut DistinctPairs<Int64Type>| {
            let groups: Vec<usize> = keys
                .iter()
                .map(|key| match final_keys.iter().position(|k| k == key) {
                    Some(group) => group,
                    None => {
                        final_keys.push(*key);
                        final_keys.len() - 1
                    }
                })
                .collect();
            final_
                .merge_batch(std::slice::from_ref(state), &groups, final_keys.len())
                .unwrap();
        };
        for batch in 0..40 {
            let rows = 1 + (next(&mut rng) % 700) as usize;
            let mut groups = Vec::with_capacity(rows);
            let mut values = Vec::with_capacity(rows);
            let mut filter = Vec::with_capacity(rows);
            for _ in 0..rows {
                let key = next(&mut rng) % 37;
                let group = match partial_keys.iter().position(|k| *k == key) {
                    Some(group) => group,
                    None => {
                        partial_keys.push(key);
                        partial_keys.len() - 1
                    }
                };
                let value = (next(&mut rng) % 97) as i64 - 40;
                let value = (!next(&mut rng).is_multiple_of(11)).then_some(value);
                let kept = !next(&mut rng).is_multiple_of(9);
                if let (Some(value), true) = (value, kept) {
                    expected.entry(key).or_default().insert(value);
                }
                groups.push(group);
                values.push(value);
                filter.push(kept);
            }
            let values = Arc::new(Int64Array::from(values)) as ArrayRef;
            partial
                .update_batch(
                    &[values],
                    &groups,
                    Some(&BooleanArray::from(filter)),
                    partial_keys.len(),
                )
                .unwrap();
            // Now and then, emit the first groups (or all) as a partial
            // aggregation under memory pressure does.
            if batch % 3 == 2 {
                let n = 1 + (next(&mut rng) as usize) % partial_keys.len();
                let emit_to = if n == partial_keys.len() && batch % 2 == 0 {
                    EmitTo::All
                } else {
                    EmitTo::First(n)
                };
                let state = partial.state(emit_to).unwrap().remove(0);
                let keys: Vec<u64> = partial_keys.drain(..n).collect();
                assert_eq!(state.len(), keys.len());
                merge(&state, &keys, &mut final_);
            }
        }
        let state = partial.state(EmitTo::All).unwrap().remove(0);
        merge(&state, &partial_keys, &mut final_);
        // Emptied, it holds nothing, and counts nothing for its next batch
        // (which can always start).
        assert_eq!((partial.seen.capacity(), partial.counts.capacity()), (0, 0));
        assert_eq!(partial.size(), size_of::<DistinctPairs<Int64Type>>());

        let counts = final_.evaluate(EmitTo::All).unwrap();
        let counts = counts.as_primitive::<Int64Type>();
        assert_eq!(counts.len(), final_keys.len());
        for (group, key) in final_keys.iter().enumerate() {
            let want = expected.get(key).map_or(0, |values| values.len()) as i64;
            assert_eq!(counts.value(group), want, "key {key}");
        }
        assert_eq!((final_.seen.capacity(), final_.counts.capacity()), (0, 0));
        assert_eq!(final_.size(), size_of::<DistinctPairs<Int64Type>>());
    }

    #[test]
    fn a_distinct_pairs_set_reports_both_tables_before_it_grows() {
        use arrow::array::Int64Array;

        let mut pairs = DistinctPairs::<Int64Type>::default();
        let table = |capacity: usize| {
            DistinctPairs::<Int64Type>::table_bytes(buckets_of_capacity(capacity))
        };
        let mut value = 0i64;
        let mut grew = 0;
        for batch in 0..200 {
            let declared = pairs.size();
            let before = pairs.seen.capacity();
            let values: Vec<i64> = (0..1000)
                .map(|_| {
                    value += 1;
                    value
                })
                .collect();
            let groups: Vec<usize> = values.iter().map(|v| (v % 5) as usize).collect();
            pairs
                .update_batch(
                    &[Arc::new(Int64Array::from(values)) as ArrayRef],
                    &groups,
                    None,
                    5,
                )
                .unwrap();
            let after = pairs.seen.capacity();
            assert_eq!(pairs.seen.len(), 1000 * (batch + 1));
            // The first batch is the one whose size is not yet known.
            if after != before && batch > 0 {
                grew += 1;
                // While growing, the set held its old and its new table.
                assert!(
                    declared >= table(before) + table(after),
                    "batch {batch}: declared {declared} before growing {before} -> {after}",
                );
            }
            // Once grown, what is held is what is reported (without the
            // growth ahead, unless the next batch may need it).
            if pairs.seen.capacity() - pairs.seen.len() >= 1000 {
                assert_eq!(pairs.set_bytes(), table(after));
            }
        }
        assert!(grew >= 6, "grew {grew} times");
    }
}
