//! Grouped aggregation on one integer key by the key's value: no hash table.
//!
//! A data engineer's aggregations group by a foreign key more than by
//! anything else (orders per customer, sales per product), and such keys
//! are dense integers from 1 up. DataFusion 55 hashes every row into a
//! table of groups that holds each key and its hash beside the aggregates'
//! states: TPC-H Q13 counts the orders of 10 M customers at SF 100 that
//! way, its aggregation the largest consumer of the query's memory and,
//! under a statement bound, spilling 116 M rows sorted by key to disk in 66
//! runs (40 s of compute CPU of the query's 43 s).
//!
//! [`DenseAggregates`] replaces a grouped `AggregateExec` (modes `Final`,
//! `FinalPartitioned`, `Single` and `SinglePartitioned`) whose one group
//! key is an integer column with a [`DenseAggregateExec`]. It finds each
//! row's group by its key's value (slot `key + 1`, slot 0 for NULL), in an
//! array of group indexes by slot, and runs DataFusion's own groups
//! accumulators (the aggregate functions the plan has, with their filters)
//! over those indexes, so a group costs its states' bytes and four bytes a
//! slot, and a row costs no hashing. At the end it evaluates the
//! accumulators once and gives the groups in the order they first
//! appeared.
//!
//! Where every aggregate is a `count`, `sum`, `min`, `max` or `avg`, the
//! accumulators are indexed by slot instead, with a bit per slot for the
//! slots a row had: one random access per row into the states rather than
//! two, and the groups come out in key order (`Groups::by_slot`), a batch
//! at a time as they are read, their states reserved until the last one
//! ([`SlotBatches`]). The input is let go (a join's build side with it)
//! before any group is emitted.
//!
//! Otherwise, and from the first batch with a NULL argument or a filter,
//! group indexes are numbered as groups first appear, as DataFusion's own
//! aggregation numbers them, not by slot: its accumulators take every
//! index below the groups they are told of as one a row has had. Its
//! `NullState` marks all of them as holding a value after a batch without
//! NULLs; indexed by slot, a key first met later with only NULL values
//! was then given the accumulator's starting value (`min` gave
//! 9223372036854775807 where the answer is NULL).
//!
//! It falls back to DataFusion's aggregation, with nothing lost, when a
//! key is negative or past `sieve.dense_aggregate_bytes_max` worth of
//! groups, or when the memory pool refuses what the groups need (its
//! reservation cannot spill): the states gathered so far, as DataFusion's
//! partial aggregation would have produced them, and the rest of the input
//! (through a partial aggregation, for the single-stage modes) go into a
//! final `AggregateExec`, which spills as ever. Keys from 0 up to the
//! input's estimated rows (at least 2^20) are taken, their bounds from
//! DataFusion's statistics or, where it has none (a join's output), from
//! the table column the key comes from; past that the groups would be too
//! sparse for the memory they take (TPC-H Q11 at SF 10: 320 k groups of
//! 2 M part keys took 2.0x the time), and DataFusion's aggregation runs
//! from the start.

use std::fmt;
use std::sync::{Arc, Mutex};

use arrow::array::{ArrayRef, AsArray, Int64Array, RecordBatch, UInt32Array};
use arrow::compute::{cast_with_options, CastOptions};
use arrow::datatypes::{DataType, Int64Type, SchemaRef};
use datafusion::common::config::ConfigOptions;
use datafusion::common::stats::Precision;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{internal_err, Result, ScalarValue, Statistics};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::{EmitTo, GroupsAccumulator};
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::{aggregate_expressions, AggregateExec, AggregateMode};
use datafusion::physical_plan::metrics::{
    BaselineMetrics, Count, ExecutionPlanMetricsSet, Gauge, MetricBuilder, MetricsSet,
};
use datafusion::physical_plan::statistics::{StatisticsArgs, StatisticsContext};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, EmptyRecordBatchStream, ExecutionPlan,
    InputDistributionRequirements, InputOrderMode, PlanProperties,
};
use futures::{StreamExt, TryStreamExt};

use crate::spill_join::OnceStreamExec;
use crate::SieveConfig;

/// Group keys below this many are always taken, whatever the estimate of
/// the input's rows.
const DENSE_SLOTS_MIN: usize = 1 << 20;

/// Group indexes allowed per estimated input row: past it the groups are
/// too sparse for the memory they take.
const DENSE_SLOTS_PER_ROW: usize = 1;

/// Replaces grouped aggregations on one integer key with
/// [`DenseAggregateExec`] (see the module documentation);
/// `sieve.dense_aggregate_bytes_max = 0` turns it off.
#[derive(Debug, Default)]
pub struct DenseAggregates;

impl PhysicalOptimizerRule for DenseAggregates {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let bytes_max = SieveConfig::of(config).dense_aggregate_bytes_max;
        if bytes_max == 0 {
            return Ok(plan);
        }
        plan.transform_up(|node| {
            let Some(aggregate) = node.downcast_ref::<AggregateExec>() else {
                return Ok(Transformed::no(node));
            };
            let Some(slot_bytes) = dense_slot_bytes(aggregate)? else {
                return Ok(Transformed::no(node));
            };
            // Group indexes are u32, NO_GROUP the largest: slots below it.
            let mut slots_max = (bytes_max / slot_bytes).min(NO_GROUP as usize);
            let input = StatisticsContext::new()
                .compute(aggregate.input().as_ref(), &StatisticsArgs::new())?;
            // Where DataFusion's statistics know nothing (a join's output
            // has none in DataFusion 55), the table column the key comes
            // from, and Sieve's estimate of the rows grouped.
            let source = crate::join_sides::group_key_source(aggregate);
            let rows = match input.num_rows {
                Precision::Exact(rows) | Precision::Inexact(rows) => Some(rows),
                Precision::Absent => source.as_ref().and_then(|source| {
                    crate::join_sides::estimated_rows(&source.rows)
                        .map(|estimate| estimate.rows as usize)
                }),
            };
            // A join filter may cut the scan's rows to any share (TPC-H
            // Q17 at SF 10: 2 k of 2 M part keys): past 2^20 groups only
            // where the rows are known.
            if source
                .as_ref()
                .is_some_and(|source| source.scan().has_join_filters())
            {
                slots_max = slots_max.min(DENSE_SLOTS_MIN);
            }
            if let Some(rows) = rows {
                slots_max = slots_max.min(
                    rows.saturating_mul(DENSE_SLOTS_PER_ROW)
                        .max(DENSE_SLOTS_MIN),
                );
            }
            // Keys the statistics say are negative or past the groups
            // allowed would only make it fall back (TPC-H's order keys
            // past SF 1, its part keys past SF 10).
            let key = key_column(aggregate).and_then(|key| input.column_statistics.get(key));
            let table_key = source.as_ref().and_then(|source| {
                source
                    .scan()
                    .table()
                    .statistics
                    .column_statistics
                    .get(source.table_column)
            });
            let bound = |value: &Precision<ScalarValue>| {
                value
                    .get_value()
                    .and_then(|value| value.cast_to(&DataType::Int64).ok())
                    .and_then(|value| match value {
                        ScalarValue::Int64(value) => value,
                        _ => None,
                    })
            };
            let low = key
                .and_then(|key| bound(&key.min_value))
                .or_else(|| table_key.and_then(|key| bound(&key.min_value)));
            let high = key
                .and_then(|key| bound(&key.max_value))
                .or_else(|| table_key.and_then(|key| bound(&key.max_value)));
            let negative = low.is_some_and(|low| low < 0);
            let past = high.is_some_and(|high| {
                usize::try_from(high).map_or(true, |high| high.saturating_add(2) > slots_max)
            });
            if negative || past {
                return Ok(Transformed::no(node));
            }
            if slots_max < 2 {
                return Ok(Transformed::no(node));
            }
            let aggregate = Arc::new(aggregate.clone());
            Ok(Transformed::yes(
                Arc::new(DenseAggregateExec::new(aggregate, slots_max, slot_bytes))
                    as Arc<dyn ExecutionPlan>,
            ))
        })
        .map(|transformed| transformed.data)
    }

    fn name(&self) -> &str {
        "sieve_dense_aggregates"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// The input column `aggregate` groups by, if one.
fn key_column(aggregate: &AggregateExec) -> Option<usize> {
    let [(key, _)] = aggregate.group_expr().expr() else {
        return None;
    };
    key.downcast_ref::<Column>().map(Column::index)
}

/// The bytes one group index takes in `aggregate`'s accumulators (their
/// states' fixed widths, and a byte each for their validity), if the
/// aggregation can run by key value.
fn dense_slot_bytes(aggregate: &AggregateExec) -> Result<Option<usize>> {
    let raw_input = match aggregate.mode() {
        AggregateMode::Single | AggregateMode::SinglePartitioned => true,
        AggregateMode::Final | AggregateMode::FinalPartitioned => false,
        AggregateMode::Partial | AggregateMode::PartialReduce => return Ok(None),
    };
    let group_by = aggregate.group_expr();
    if group_by.has_grouping_set()
        || group_by.expr().len() != 1
        || aggregate.limit_options().is_some()
        || *aggregate.input_order_mode() != InputOrderMode::Linear
        || aggregate.aggr_expr().is_empty()
    {
        return Ok(None);
    }
    let key = &group_by.expr()[0].0;
    let input_schema = aggregate.input().schema();
    if !key.data_type(&input_schema)?.is_integer() {
        return Ok(None);
    }
    // The slot's group index, then each state.
    let mut slot_bytes = 4;
    let mut state_columns = 0;
    for aggregate in aggregate.aggr_expr() {
        if !aggregate.groups_accumulator_supported()
            || aggregate.is_distinct()
            || !aggregate.order_bys().is_empty()
        {
            return Ok(None);
        }
        for field in aggregate.state_fields()? {
            let width = match field.data_type() {
                DataType::Boolean => 1,
                data_type => match data_type.primitive_width() {
                    Some(width) => width,
                    None => return Ok(None),
                },
            };
            slot_bytes += width + 1;
            state_columns += 1;
        }
    }
    // States arrive as the group column followed by each aggregate's state
    // columns (DataFusion's partial aggregation); a fallback hands them on
    // in that layout.
    let first_column = key
        .downcast_ref::<Column>()
        .is_some_and(|key| key.index() == 0);
    if !raw_input && (!first_column || input_schema.fields().len() != 1 + state_columns) {
        return Ok(None);
    }
    Ok(Some(slot_bytes))
}

/// A grouped aggregation on one integer key, grouped by the key's value
/// (see the module documentation).
#[derive(Debug)]
pub struct DenseAggregateExec {
    /// The aggregation it runs: its mode, expressions and schema; its input
    /// is this node's child.
    aggregate: Arc<AggregateExec>,
    /// Group indexes past which it falls back.
    slots_max: usize,
    /// Bytes of accumulator state per group index.
    slot_bytes: usize,
    metrics: ExecutionPlanMetricsSet,
    /// The metrics of the aggregations a fallback ran (plans of their own,
    /// not in this plan), shown as this node's.
    fallback_metrics: Arc<Mutex<Vec<MetricsSet>>>,
}

impl DenseAggregateExec {
    fn new(aggregate: Arc<AggregateExec>, slots_max: usize, slot_bytes: usize) -> Self {
        Self {
            aggregate,
            slots_max,
            slot_bytes,
            metrics: ExecutionPlanMetricsSet::new(),
            fallback_metrics: Arc::default(),
        }
    }

    /// The aggregation it runs.
    pub fn aggregate(&self) -> &AggregateExec {
        &self.aggregate
    }
}

impl DisplayAs for DenseAggregateExec {
    fn fmt_as(&self, format: DisplayFormatType, formatter: &mut fmt::Formatter) -> fmt::Result {
        write!(
            formatter,
            "DenseAggregateExec: by key value up to {} groups ({} B each), past them ",
            self.slots_max - 1,
            self.slot_bytes
        )?;
        self.aggregate.fmt_as(format, formatter)
    }
}

impl ExecutionPlan for DenseAggregateExec {
    fn name(&self) -> &str {
        "DenseAggregateExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.aggregate.properties()
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        self.aggregate.apply_expressions(f)
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![self.aggregate.input()]
    }

    fn input_distribution_requirements(&self) -> InputDistributionRequirements {
        self.aggregate.input_distribution_requirements()
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![false]
    }

    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        self.aggregate.benefits_from_input_partitioning()
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let [input] = &children[..] else {
            return internal_err!("DenseAggregateExec has one child");
        };
        let aggregate = Arc::clone(&self.aggregate)
            .replace_children(vec![Arc::clone(input)], crate::optimizer::recompute())?;
        let Some(aggregate) = aggregate.downcast_ref::<AggregateExec>() else {
            return internal_err!("an AggregateExec with new children is an AggregateExec");
        };
        Ok(Arc::new(Self::new(
            Arc::new(aggregate.clone()),
            self.slots_max,
            self.slot_bytes,
        )))
    }

    fn reset_state(self: Arc<Self>) -> Result<Arc<dyn ExecutionPlan>> {
        Ok(Arc::new(Self::new(
            Arc::clone(&self.aggregate),
            self.slots_max,
            self.slot_bytes,
        )))
    }

    fn statistics_from_inputs(
        &self,
        input_stats: &[Arc<Statistics>],
        args: &StatisticsArgs,
    ) -> Result<Arc<Statistics>> {
        self.aggregate.statistics_from_inputs(input_stats, args)
    }

    fn metrics(&self) -> Option<MetricsSet> {
        let mut metrics = self.metrics.clone_inner();
        let fallbacks = self
            .fallback_metrics
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        for metric in fallbacks.iter().flat_map(MetricsSet::iter) {
            metrics.push(Arc::clone(metric));
        }
        Some(metrics)
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let aggregate = &self.aggregate;
        let raw_input = matches!(
            aggregate.mode(),
            AggregateMode::Single | AggregateMode::SinglePartitioned
        );
        let accumulators = aggregate
            .aggr_expr()
            .iter()
            .map(|expression| expression.create_groups_accumulator())
            .collect::<Result<Vec<_>>>()?;
        let arguments = aggregate_expressions(aggregate.aggr_expr(), aggregate.mode(), 1)?;
        let filters = if raw_input {
            aggregate.filter_expr().to_vec()
        } else {
            vec![None; accumulators.len()]
        };
        // See `Groups::by_slot`.
        let counts: Vec<bool> = aggregate
            .aggr_expr()
            .iter()
            .map(|expression| expression.fun().name() == "count")
            .collect();
        let by_slot = aggregate
            .aggr_expr()
            .iter()
            .all(|expression| BY_SLOT.contains(&expression.fun().name()));
        let reservation = MemoryConsumer::new(format!("DenseAggregateExec[{partition}]"))
            .register(context.memory_pool());
        let input = aggregate.input().execute(partition, Arc::clone(&context))?;
        let builder = MetricBuilder::new(&self.metrics);
        let groups = Groups {
            key: Arc::clone(&aggregate.group_expr().expr()[0].0),
            arguments,
            filters,
            accumulators,
            raw_input,
            slots: 0,
            slots_max: self.slots_max,
            slot_bytes: self.slot_bytes,
            group_of_slot: Vec::new(),
            functions: aggregate.aggr_expr().to_vec(),
            counts,
            by_slot,
            touched: Vec::new(),
            groups: 0,
            indexes: Vec::new(),
            reservation,
        };
        let run = Run {
            aggregate: Arc::clone(aggregate),
            groups,
            input,
            context,
            baseline: BaselineMetrics::new(&self.metrics, partition),
            slots: builder.clone().gauge("dense_groups", partition),
            fell_back: builder.counter("dense_fell_back", partition),
            fallback_metrics: Arc::clone(&self.fallback_metrics),
        };
        let stream = futures::stream::once(run.run()).try_flatten();
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            aggregate.schema(),
            stream,
        )))
    }
}

/// The groups of one partition, indexed by key value.
struct Groups {
    key: Arc<dyn PhysicalExpr>,
    arguments: Vec<Vec<Arc<dyn PhysicalExpr>>>,
    filters: Vec<Option<Arc<dyn PhysicalExpr>>>,
    accumulators: Vec<Box<dyn GroupsAccumulator>>,
    raw_input: bool,
    /// Slots in use: the largest key seen plus two.
    slots: usize,
    slots_max: usize,
    slot_bytes: usize,
    /// Per slot, the index of its group, [`NO_GROUP`] if no row had it.
    group_of_slot: Vec<u32>,
    /// The aggregate functions, for accumulators made afresh.
    functions: Vec<Arc<datafusion::physical_expr::aggregate::AggregateFunctionExpr>>,
    /// Per accumulator, whether it is a `count`.
    counts: Vec<bool>,
    /// The accumulators are indexed by slot, not by group. A row then costs
    /// one random access into the states instead of two (its group's
    /// index, then its state): TPC-H Q13 counts 150 M orders by 15 M
    /// customer keys at SF 100, Q15 sums 23 M lineitems by 1 M supplier
    /// keys, and those accesses miss the cache. `group_of_slot` stays
    /// empty; `touched` marks the slots a row had, and only those are
    /// emitted.
    ///
    /// Only for the functions in [`BY_SLOT`], and only while it is safe:
    /// a `count`'s state is a plain number per index, always; the others
    /// keep a `NullState`, which after a batch with no NULL argument and no
    /// filter marks every index below the groups as holding a value. That
    /// is right for every slot a row had as long as every batch is such a
    /// batch. The first batch that is not (a NULL argument, or a filter,
    /// for an accumulator other than a count) turns the states gathered so
    /// far into group-indexed accumulators first ([`Groups::leave_slots`]):
    /// indexed by slot, a key first met in it with only NULL values would
    /// have taken the accumulator's starting value (part 31's `min` =
    /// i64::MAX).
    by_slot: bool,
    /// With `by_slot`, a bit per slot: set once a row had the slot.
    touched: Vec<u64>,
    /// Groups so far: the accumulators' group indexes are `0..groups`.
    groups: usize,
    indexes: Vec<usize>,
    reservation: MemoryReservation,
}

/// A slot no row has had.
const NO_GROUP: u32 = u32::MAX;

/// An accumulator's argument values and filter, over one batch.
type AccumulatorInput = (Vec<ArrayRef>, Option<ArrayRef>);

/// `columns` taken at `indexes`.
fn taken(columns: Vec<ArrayRef>, indexes: &arrow::array::UInt64Array) -> Result<Vec<ArrayRef>> {
    columns
        .iter()
        .map(|column| Ok(arrow::compute::take(column.as_ref(), indexes, None)?))
        .collect()
}

/// A new accumulator of `function` holding `states`, one group per
/// `indexes` entry (`0..`).
fn by_group(
    function: &datafusion::physical_expr::aggregate::AggregateFunctionExpr,
    states: &[ArrayRef],
    indexes: &[usize],
) -> Result<Box<dyn GroupsAccumulator>> {
    let mut accumulator = function.create_groups_accumulator()?;
    accumulator.merge_batch(states, indexes, indexes.len())?;
    Ok(accumulator)
}

/// The aggregate functions whose accumulators may be indexed by slot
/// (`Groups::by_slot`): DataFusion's own, whose states are read back
/// through `state` and `merge_batch` alone.
const BY_SLOT: &[&str] = &["count", "sum", "min", "max", "avg"];

/// Why the groups must fall back: a key is negative or past the groups
/// allowed, or the memory pool refused the groups' memory.
enum Refusal {
    /// Before the batch was aggregated: it goes to the fallback.
    BatchLeftOut,
    /// After: its rows are in the groups' states.
    BatchIn,
}

impl Groups {
    /// Aggregates `batch`, or says why it cannot (the groups are then as
    /// before it).
    fn add(&mut self, batch: &RecordBatch) -> Result<std::result::Result<(), Refusal>> {
        if batch.num_rows() == 0 {
            return Ok(Ok(()));
        }
        let keys = self.key.evaluate(batch)?.into_array(batch.num_rows())?;
        // A key past i64 (a large UInt64) fails the cast: out of range.
        let Ok(keys) = cast_with_options(
            &keys,
            &DataType::Int64,
            &CastOptions {
                safe: false,
                ..Default::default()
            },
        ) else {
            return Ok(Err(Refusal::BatchLeftOut));
        };
        let keys = keys.as_primitive::<Int64Type>();
        let (Some(low), Some(high)) = (arrow::compute::min(keys), arrow::compute::max(keys)) else {
            // Every key NULL: group index 0.
            return self.aggregate(batch, keys, self.slots.max(1));
        };
        let slots = match usize::try_from(high) {
            Ok(high) if low >= 0 && high < self.slots_max.saturating_sub(1) => {
                self.slots.max(high + 2)
            }
            _ => return Ok(Err(Refusal::BatchLeftOut)),
        };
        if slots > self.slots {
            let needed = self.reservation.size().max(slots * self.slot_bytes);
            if self.reservation.try_resize(needed).is_err() {
                return Ok(Err(Refusal::BatchLeftOut));
            }
        }
        self.aggregate(batch, keys, slots)
    }

    fn aggregate(
        &mut self,
        batch: &RecordBatch,
        keys: &arrow::array::PrimitiveArray<Int64Type>,
        slots: usize,
    ) -> Result<std::result::Result<(), Refusal>> {
        let inputs = self.inputs(batch)?;
        if self.by_slot
            && inputs
                .iter()
                .zip(&self.counts)
                .any(|((values, filter), count)| {
                    !count
                        && (filter.is_some() || values.iter().any(|values| values.null_count() > 0))
                })
        {
            self.leave_slots()?;
        }
        self.slots = slots;
        self.indexes.clear();
        if self.by_slot {
            self.touched.resize(slots.div_ceil(64), 0);
            for key in keys.iter() {
                let slot = key.map_or(0, |key| key as usize + 1);
                let word = &mut self.touched[slot / 64];
                let bit = 1u64 << (slot % 64);
                if *word & bit == 0 {
                    *word |= bit;
                    self.groups += 1;
                }
                self.indexes.push(slot);
            }
            return self.accumulate(&inputs, slots);
        }
        self.group_of_slot.resize(slots, NO_GROUP);
        for key in keys.iter() {
            let slot = key.map_or(0, |key| key as usize + 1);
            let group = &mut self.group_of_slot[slot];
            if *group == NO_GROUP {
                // At most `slots_max` groups, below NO_GROUP (see optimize).
                *group = self.groups as u32;
                self.groups += 1;
            }
            self.indexes.push(*group as usize);
        }
        self.accumulate(&inputs, self.groups)
    }

    /// Each accumulator's arguments and, for raw input, filter, evaluated
    /// over `batch`.
    fn inputs(&self, batch: &RecordBatch) -> Result<Vec<AccumulatorInput>> {
        self.arguments
            .iter()
            .zip(&self.filters)
            .map(|(arguments, filter)| {
                let values = arguments
                    .iter()
                    .map(|argument| argument.evaluate(batch)?.into_array(batch.num_rows()))
                    .collect::<Result<Vec<_>>>()?;
                let filter = match filter {
                    Some(filter) if self.raw_input => {
                        Some(filter.evaluate(batch)?.into_array(batch.num_rows())?)
                    }
                    _ => None,
                };
                Ok((values, filter))
            })
            .collect()
    }

    /// The states gathered by slot, into accumulators indexed by group: the
    /// slots a row had become groups `0..` in slot order, each state taken
    /// at its slot and merged into a new accumulator (see `by_slot`).
    fn leave_slots(&mut self) -> Result<()> {
        let slots = self.touched_slots();
        let groups = slots.len();
        let mut group_of_slot = vec![NO_GROUP; self.slots];
        for (group, &slot) in slots.values().iter().enumerate() {
            group_of_slot[slot as usize] = group as u32;
        }
        let indexes: Vec<usize> = (0..groups).collect();
        for (accumulator, function) in self.accumulators.iter_mut().zip(&self.functions) {
            let states = taken(accumulator.state(EmitTo::All)?, &slots)?;
            *accumulator = by_group(function, &states, &indexes)?;
        }
        self.group_of_slot = group_of_slot;
        self.groups = groups;
        self.touched = Vec::new();
        self.by_slot = false;
        Ok(())
    }

    /// Runs the accumulators over `batch`, its rows' indexes in `indexes`,
    /// `groups` the indexes they hold.
    fn accumulate(
        &mut self,
        inputs: &[AccumulatorInput],
        groups: usize,
    ) -> Result<std::result::Result<(), Refusal>> {
        for (accumulator, (values, filter)) in self.accumulators.iter_mut().zip(inputs) {
            if self.raw_input {
                accumulator.update_batch(
                    values,
                    &self.indexes,
                    filter.as_ref().map(|filter| filter.as_boolean()),
                    groups,
                )?;
            } else {
                accumulator.merge_batch(values, &self.indexes, groups)?;
            }
        }
        let held = self.group_of_slot.len() * 4
            + self.touched.len() * 8
            + self
                .accumulators
                .iter()
                .map(|accumulator| accumulator.size())
                .sum::<usize>();
        // The rows are in; refused, the groups fall back with them.
        if self.reservation.try_resize(held).is_err() {
            return Ok(Err(Refusal::BatchIn));
        }
        Ok(Ok(()))
    }

    /// With `by_slot`, the slots a row had, in order.
    fn touched_slots(&self) -> arrow::array::UInt64Array {
        let mut slots = Vec::with_capacity(self.groups);
        for (index, &word) in self.touched.iter().enumerate() {
            let mut word = word;
            while word != 0 {
                slots.push((index * 64) as u64 + u64::from(word.trailing_zeros()));
                word &= word - 1;
            }
        }
        slots.into()
    }

    /// The groups' keys (as `key_type`), by group index.
    fn keys(&self, key_type: &DataType) -> Result<ArrayRef> {
        if self.by_slot {
            let keys: Int64Array = self
                .touched_slots()
                .iter()
                .map(|slot| {
                    slot.and_then(|slot| slot.checked_sub(1))
                        .map(|key| key as i64)
                })
                .collect();
            let keys: ArrayRef = Arc::new(keys);
            return Ok(cast_with_options(&keys, key_type, &CastOptions::default())?);
        }
        let mut keys = vec![None; self.groups];
        for (slot, &group) in self.group_of_slot.iter().enumerate() {
            if group != NO_GROUP {
                keys[group as usize] = slot.checked_sub(1).map(|key| key as i64);
            }
        }
        let keys: ArrayRef = Arc::new(Int64Array::from(keys));
        Ok(cast_with_options(&keys, key_type, &CastOptions::default())?)
    }

    /// The groups, in the order they first appeared (as DataFusion's own
    /// aggregation gives them): their keys and the accumulators' final
    /// values (`states` false) or states; the accumulators are emptied.
    /// With `by_slot`, states only (in key order; values go through
    /// [`SlotBatches`]).
    fn emit(&mut self, key_type: &DataType, states: bool) -> Result<Vec<ArrayRef>> {
        let mut columns = vec![self.keys(key_type)?];
        if self.by_slot {
            if !states {
                return internal_err!("slot-indexed groups emit their values in batches");
            }
            // Every slot up to the largest has a state: those a row had are
            // kept, in slot order (the keys' order).
            let slots = self.touched_slots();
            for accumulator in &mut self.accumulators {
                columns.extend(taken(accumulator.state(EmitTo::All)?, &slots)?);
            }
            return Ok(columns);
        }
        for accumulator in &mut self.accumulators {
            if states {
                columns.extend(accumulator.state(EmitTo::All)?);
            } else {
                columns.push(accumulator.evaluate(EmitTo::All)?);
            }
        }
        Ok(columns)
    }
}

/// The output of groups indexed by slot (`Groups::by_slot`), made a batch
/// at a time as it is read rather than all at once: at SF 100, TPC-H Q13
/// emits 7.5 M groups a partition, and their slots, keys and values taken
/// whole came to 180 MB a partition past the states themselves, outside
/// the memory pool. The states' reservation is held until the last batch.
struct SlotBatches {
    /// A bit per slot: set where a row had the slot.
    touched: Vec<u64>,
    /// The next word of `touched` to read, and the bits of the one before
    /// it not emitted yet.
    word: usize,
    bits: u64,
    outputs: Vec<SlotOutput>,
    key_type: DataType,
    schema: SchemaRef,
    batch_size: usize,
    reservation: MemoryReservation,
}

/// One accumulator's output, by slot.
enum SlotOutput {
    /// A count: its values are its states.
    Values(ArrayRef),
    /// Any other: its states, whose values are taken by merging the slots
    /// emitted into an accumulator of just those groups, so no index
    /// without rows is evaluated (a decimal average would divide by zero).
    States(
        Vec<ArrayRef>,
        Arc<datafusion::physical_expr::aggregate::AggregateFunctionExpr>,
    ),
}

impl SlotBatches {
    /// The next groups, in slot (the keys') order, up to a batch of them.
    fn next_batch(&mut self) -> Result<Option<RecordBatch>> {
        let mut slots: Vec<u32> = Vec::with_capacity(self.batch_size);
        while slots.len() < self.batch_size {
            if self.bits == 0 {
                let Some(&word) = self.touched.get(self.word) else {
                    break;
                };
                self.bits = word;
                self.word += 1;
                continue;
            }
            // Slots are below `slots_max`, itself at most u32::MAX.
            let slot = (self.word - 1) * 64 + self.bits.trailing_zeros() as usize;
            self.bits &= self.bits - 1;
            slots.push(slot as u32);
        }
        if slots.is_empty() {
            self.outputs.clear();
            self.touched = Vec::new();
            self.reservation.free();
            return Ok(None);
        }
        let keys: Int64Array = slots
            .iter()
            .map(|&slot| slot.checked_sub(1).map(i64::from))
            .collect();
        let keys: ArrayRef = Arc::new(keys);
        let mut columns = vec![cast_with_options(
            &keys,
            &self.key_type,
            &CastOptions::default(),
        )?];
        let slots = UInt32Array::from(slots);
        let indexes: Vec<usize> = (0..slots.len()).collect();
        for output in &self.outputs {
            match output {
                SlotOutput::Values(values) => {
                    columns.push(arrow::compute::take(values.as_ref(), &slots, None)?);
                }
                SlotOutput::States(states, function) => {
                    let kept = states
                        .iter()
                        .map(|state| Ok(arrow::compute::take(state.as_ref(), &slots, None)?))
                        .collect::<Result<Vec<_>>>()?;
                    columns.push(by_group(function, &kept, &indexes)?.evaluate(EmitTo::All)?);
                }
            }
        }
        Ok(Some(RecordBatch::try_new(
            Arc::clone(&self.schema),
            columns,
        )?))
    }
}

/// One partition's run: by key value, falling back when it must.
struct Run {
    aggregate: Arc<AggregateExec>,
    groups: Groups,
    input: SendableRecordBatchStream,
    context: Arc<TaskContext>,
    baseline: BaselineMetrics,
    slots: Gauge,
    fell_back: Count,
    fallback_metrics: Arc<Mutex<Vec<MetricsSet>>>,
}

impl Run {
    async fn run(mut self) -> Result<SendableRecordBatchStream> {
        while let Some(batch) = self.input.next().await {
            let batch = batch?;
            let timer = self.baseline.elapsed_compute().timer();
            let added = self.groups.add(&batch)?;
            timer.done();
            self.slots.set(self.groups.groups);
            match added {
                Ok(()) => {}
                Err(Refusal::BatchLeftOut) => return self.fall_back(Some(batch)),
                Err(Refusal::BatchIn) => return self.fall_back(None),
            }
        }
        // The input is spent: what it held (a join's build side, say) goes
        // before the groups are emitted.
        self.input = Box::pin(EmptyRecordBatchStream::new(self.input.schema()));
        let schema = self.aggregate.schema();
        if self.groups.by_slot && self.groups.groups > 0 {
            return Ok(self.slot_batches(schema));
        }
        let timer = self.baseline.elapsed_compute().timer();
        let batches = if self.groups.groups == 0 {
            vec![]
        } else {
            let columns = self.groups.emit(schema.field(0).data_type(), false)?;
            let all = RecordBatch::try_new(Arc::clone(&schema), columns)?;
            let size = self.context.session_config().batch_size().max(1);
            (0..all.num_rows())
                .step_by(size)
                .map(|offset| all.slice(offset, size.min(all.num_rows() - offset)))
                .collect()
        };
        timer.done();
        self.groups.reservation.free();
        let baseline = self.baseline;
        let stream = futures::stream::iter(batches).map(move |batch| {
            baseline.record_output(batch.num_rows());
            Ok(batch)
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, stream)))
    }

    /// The groups indexed by slot, a batch at a time (see [`SlotBatches`]).
    fn slot_batches(self, schema: SchemaRef) -> SendableRecordBatchStream {
        let Run {
            groups,
            context,
            baseline,
            ..
        } = self;
        let Groups {
            mut accumulators,
            functions,
            counts,
            touched,
            reservation,
            ..
        } = groups;
        let key_type = schema.field(0).data_type().clone();
        let outputs = accumulators
            .iter_mut()
            .zip(functions)
            .zip(counts)
            .map(|((accumulator, function), count)| {
                Ok(if count {
                    SlotOutput::Values(accumulator.evaluate(EmitTo::All)?)
                } else {
                    SlotOutput::States(accumulator.state(EmitTo::All)?, function)
                })
            })
            .collect::<Result<Vec<_>>>();
        drop(accumulators);
        let batches = outputs.map(|outputs| SlotBatches {
            touched,
            word: 0,
            bits: 0,
            outputs,
            key_type,
            schema: Arc::clone(&schema),
            batch_size: context.session_config().batch_size().max(1),
            reservation,
        });
        let stream = futures::stream::try_unfold(batches, move |batches| {
            let baseline = baseline.clone();
            async move {
                let mut batches = batches?;
                let timer = baseline.elapsed_compute().timer();
                let batch = batches.next_batch()?;
                timer.done();
                Ok(batch.map(|batch| {
                    baseline.record_output(batch.num_rows());
                    (batch, Ok(batches))
                }))
            }
        });
        Box::pin(RecordBatchStreamAdapter::new(schema, stream))
    }

    /// DataFusion's aggregation over the states gathered so far, then
    /// `batch` (one not aggregated yet) and the rest of the input.
    fn fall_back(mut self, batch: Option<RecordBatch>) -> Result<SendableRecordBatchStream> {
        self.fell_back.add(1);
        let aggregate = Arc::clone(&self.aggregate);
        let rest: SendableRecordBatchStream = Box::pin(RecordBatchStreamAdapter::new(
            self.input.schema(),
            futures::stream::iter(batch.map(Ok)).chain(self.input),
        ));
        // The rest as states: the input itself, or its partial aggregation.
        let rest = if self.groups.raw_input {
            let partial = Arc::new(AggregateExec::try_new(
                AggregateMode::Partial,
                aggregate.group_expr().clone(),
                aggregate.aggr_expr().to_vec(),
                aggregate.filter_expr().to_vec(),
                Arc::new(OnceStreamExec::new(rest)),
                aggregate.input_schema(),
            )?);
            // Its output is the final's input: only the final's metrics
            // are shown.
            partial.execute(0, Arc::clone(&self.context))?
        } else {
            rest
        };
        let states_schema = rest.schema();
        let held = if self.groups.groups == 0 {
            vec![]
        } else {
            let columns = self.groups.emit(states_schema.field(0).data_type(), true)?;
            vec![RecordBatch::try_new(Arc::clone(&states_schema), columns)?]
        };
        self.groups.reservation.free();
        let states: SendableRecordBatchStream = Box::pin(RecordBatchStreamAdapter::new(
            Arc::clone(&states_schema),
            futures::stream::iter(held.into_iter().map(Ok)).chain(rest),
        ));
        let group_by = if self.groups.raw_input {
            aggregate.group_expr().as_final()
        } else {
            aggregate.group_expr().clone()
        };
        let last = Arc::new(AggregateExec::try_new(
            AggregateMode::Final,
            group_by,
            aggregate.aggr_expr().to_vec(),
            vec![None; aggregate.aggr_expr().len()],
            Arc::new(OnceStreamExec::new(states)),
            aggregate.input_schema(),
        )?);
        let stream = last.execute(0, Arc::clone(&self.context))?;
        let fallback_metrics = Arc::clone(&self.fallback_metrics);
        let schema = aggregate.schema();
        let output_schema = Arc::clone(&schema);
        let stream = stream
            .map(move |batch| {
                // Its rows are counted in the fallback's own metrics.
                Some(batch.and_then(|batch| {
                    Ok(RecordBatch::try_new(
                        Arc::clone(&output_schema),
                        batch.columns().to_vec(),
                    )?)
                }))
            })
            .chain(futures::stream::once(async move {
                // The fallback's metrics once it has run.
                let mut metrics = fallback_metrics
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                metrics.extend(last.metrics());
                None
            }))
            .filter_map(futures::future::ready);
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, stream)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use arrow::datatypes::{Field, Schema};
    use datafusion::datasource::memory::MemorySourceConfig;
    use datafusion::functions_aggregate::min_max::{max_udaf, min_udaf};
    use datafusion::functions_aggregate::sum::sum_udaf;
    use datafusion::physical_expr::aggregate::AggregateExprBuilder;
    use datafusion::physical_expr::expressions::col;
    use datafusion::physical_plan::aggregates::PhysicalGroupBy;
    use datafusion::physical_plan::collect;
    use datafusion::prelude::SessionContext;

    /// Keys first met after a batch without NULLs, with only NULL values,
    /// aggregate to NULL, as in DataFusion's own aggregation. DataFusion's
    /// accumulators take every group index below the groups they are told
    /// of as one a row has had, and after a batch without NULLs mark them
    /// all as holding a value: indexed by key value, such a key's `min`
    /// was the accumulator's starting value, i64::MAX.
    #[tokio::test]
    async fn keys_first_met_with_only_null_values_aggregate_to_null() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("v", DataType::Int64, true),
        ]));
        // The multiples of 3 up to 2997, no NULL; then keys one past a
        // multiple of 3 (new) with NULL values only, and the old keys.
        let first = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from_iter_values((0..1_000).map(|i| i * 3))),
                Arc::new(Int64Array::from_iter_values((0..1_000).map(|i| i - 500))),
            ],
        )
        .unwrap();
        let second = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from_iter_values(
                    (0..1_000).map(|i| i * 3 + i % 2),
                )),
                Arc::new(Int64Array::from_iter(
                    (0..1_000).map(|i| (i % 2 == 0).then_some(i * 5)),
                )),
            ],
        )
        .unwrap();
        let input =
            MemorySourceConfig::try_new_exec(&[vec![first, second]], Arc::clone(&schema), None)
                .unwrap();
        let (aggregate, dense) = dense_over_k(
            &schema,
            input,
            [(min_udaf(), "v"), (max_udaf(), "v"), (sum_udaf(), "v")],
        );
        let context = SessionContext::new().task_ctx();
        let expected = sorted_rows(
            collect(aggregate as Arc<dyn ExecutionPlan>, Arc::clone(&context))
                .await
                .unwrap(),
        );
        let actual = sorted_rows(collect(Arc::clone(&dense), context).await.unwrap());
        assert_eq!(expected.len(), 1_500);
        assert!(expected.iter().any(|row| row.contains("|        |")));
        let differing: Vec<_> = actual
            .iter()
            .zip(&expected)
            .filter(|(actual, expected)| actual != expected)
            .take(5)
            .collect();
        assert!(
            differing.is_empty() && actual.len() == expected.len(),
            "(Sieve, DataFusion): {differing:?}"
        );
        assert_eq!(metric(&dense, "dense_fell_back"), 0);
    }

    /// Groups indexed by slot come out a batch at a time, across words of
    /// the slot bitmap, NULL key first, each batch's values merged from its
    /// own slots; the states stay reserved in the memory pool until the
    /// last batch is read, then are freed.
    #[tokio::test]
    async fn slot_groups_are_emitted_in_batches_within_their_reservation() {
        use datafusion::execution::memory_pool::{GreedyMemoryPool, MemoryPool};
        use datafusion::execution::runtime_env::RuntimeEnvBuilder;
        use datafusion::functions_aggregate::average::avg_udaf;
        use datafusion::functions_aggregate::count::count_udaf;
        use datafusion::prelude::SessionConfig;

        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int32, true),
            Field::new("v", DataType::Int64, false),
            Field::new("f", DataType::Float64, false),
        ]));
        // Keys spread over 70 k slots with gaps (multiples of 7, and of 13
        // past 30 k), NULL keys too; values without NULLs, so every
        // accumulator stays indexed by slot.
        let key = |i: i64| {
            (i % 11 != 0).then_some(if i < 3_000 { i * 7 } else { (i * 13) % 70_000 } as i32)
        };
        let batch = |range: std::ops::Range<i64>| {
            RecordBatch::try_new(
                Arc::clone(&schema),
                vec![
                    Arc::new(arrow::array::Int32Array::from_iter(range.clone().map(key))),
                    Arc::new(Int64Array::from_iter_values(
                        range.clone().map(|i| i % 1_000 - 400),
                    )),
                    Arc::new(arrow::array::Float64Array::from_iter_values(
                        range.map(|i| (i % 300) as f64 / 8.0),
                    )),
                ],
            )
            .unwrap()
        };
        let input = MemorySourceConfig::try_new_exec(
            &[vec![batch(0..4_000), batch(4_000..9_000)]],
            Arc::clone(&schema),
            None,
        )
        .unwrap();
        let (aggregate, dense) = dense_over_k(
            &schema,
            input,
            [
                (count_udaf(), "v"),
                (sum_udaf(), "v"),
                (min_udaf(), "v"),
                (avg_udaf(), "f"),
            ],
        );
        let pool = Arc::new(GreedyMemoryPool::new(64 << 20));
        let runtime = RuntimeEnvBuilder::new()
            .with_memory_pool(Arc::clone(&pool) as Arc<dyn MemoryPool>)
            .build_arc()
            .unwrap();
        let context = SessionContext::new_with_config_rt(
            SessionConfig::new().with_batch_size(1_000),
            runtime,
        )
        .task_ctx();
        let mut stream = dense.execute(0, Arc::clone(&context)).unwrap();
        let mut batches = vec![];
        while let Some(batch) = stream.next().await {
            let batch = batch.unwrap();
            assert!(batch.num_rows() <= 1_000);
            // Still reserved while batches are read.
            assert!(pool.reserved() > 70_000, "{} B reserved", pool.reserved());
            batches.push(batch);
        }
        assert_eq!(pool.reserved(), 0);
        drop(stream);
        assert!(batches.len() > 4, "{} batches", batches.len());
        let keys: Vec<Option<i64>> = batches
            .iter()
            .flat_map(|batch| {
                let keys = batch
                    .column(0)
                    .as_primitive::<arrow::datatypes::Int32Type>();
                keys.iter()
                    .map(|key| key.map(i64::from))
                    .collect::<Vec<_>>()
            })
            .collect();
        // NULL first, then the keys in order.
        assert_eq!(keys[0], None);
        assert!(keys[1..].windows(2).all(|pair| pair[0] < pair[1]));
        let expected = sorted_rows(
            collect(aggregate as Arc<dyn ExecutionPlan>, Arc::clone(&context))
                .await
                .unwrap(),
        );
        assert_eq!(expected.len(), keys.len());
        assert_eq!(sorted_rows(batches), expected);
        assert_eq!(metric(&dense, "dense_fell_back"), 0);
        assert_eq!(
            dense.metrics().and_then(|metrics| metrics.output_rows()),
            Some(keys.len())
        );
    }

    /// DataFusion's single-mode aggregation of `input` grouped by `k`, with
    /// one aggregate per (function, argument column), and Sieve's dense
    /// aggregation over it, taken with room for 2^20 slots.
    fn dense_over_k<const N: usize>(
        schema: &SchemaRef,
        input: Arc<dyn ExecutionPlan>,
        functions: [(Arc<datafusion::logical_expr::AggregateUDF>, &str); N],
    ) -> (Arc<AggregateExec>, Arc<dyn ExecutionPlan>) {
        let aggregates = functions
            .into_iter()
            .map(|(function, argument)| {
                let name = format!("{}({argument})", function.name());
                AggregateExprBuilder::new(function, vec![col(argument, schema).unwrap()])
                    .schema(Arc::clone(schema))
                    .alias(name)
                    .build()
                    .map(Arc::new)
            })
            .collect::<Result<Vec<_>>>()
            .unwrap();
        let aggregate = Arc::new(
            AggregateExec::try_new(
                AggregateMode::Single,
                PhysicalGroupBy::new_single(vec![(col("k", schema).unwrap(), "k".into())]),
                aggregates.clone(),
                vec![None; aggregates.len()],
                input,
                Arc::clone(schema),
            )
            .unwrap(),
        );
        let slot_bytes = dense_slot_bytes(&aggregate).unwrap().expect("taken");
        let dense: Arc<dyn ExecutionPlan> = Arc::new(DenseAggregateExec::new(
            Arc::clone(&aggregate),
            1 << 20,
            slot_bytes,
        ));
        (aggregate, dense)
    }

    /// The batches' rows as printed, header left out, sorted.
    fn sorted_rows(batches: Vec<RecordBatch>) -> Vec<String> {
        let mut rows: Vec<String> = arrow::util::pretty::pretty_format_batches(&batches)
            .unwrap()
            .to_string()
            .lines()
            .filter(|line| line.starts_with("| ") && !line.contains(" k "))
            .map(str::to_string)
            .collect();
        rows.sort();
        rows
    }

    fn metric(plan: &Arc<dyn ExecutionPlan>, name: &str) -> usize {
        plan.metrics()
            .and_then(|metrics| metrics.sum_by_name(name))
            .map_or(0, |value| value.as_usize())
    }
}
