//! The build-side keys of a hash join, collected as they stream into it.
//!
//! DataFusion's hash join hands its keys to the probe side inside its dynamic
//! filter: as an IN list (one literal expression per key, which for a few
//! hundred thousand keys costs more compute-node CPU than the join saves) or
//! as a lookup into its hash table (which cannot leave the process). Sieve
//! keeps DataFusion's filter for what it does cheaply (the key range, small
//! lists, and the moment the build side is complete) and takes the key values
//! for its Bloom filters from a [`BuildKeysExec`] placed on the join's build
//! input: a pass-through that evaluates the join's build-side key expressions
//! on each batch on its way into the hash table.
//!
//! ```text
//!        HashJoinExec ──dynamic filter (range, "complete")──> SieveScanExec (probe)
//!        /          \                                            ^
//!  BuildKeysExec     probe side ...                              |
//!        |  └──── distinct keys per key column ──────────────────┘ (Bloom / list)
//!   build side ...
//! ```
//!
//! Every consumer of the keys ([`crate::join_filter`]) reads them one key
//! column at a time, as a set: its range and a membership test. So the
//! collector keeps each column's *distinct* values, not the build rows:
//! it compacts a column (sorting integers, hashing the row encoding of
//! anything else) whenever the values added since the last compaction
//! outnumber the distinct ones kept, which costs amortized about two sorts
//! of the distinct keys. TPC-H Q9's partsupp join (8 M rows at SF 10 on
//! `(ps_suppkey, ps_partkey)`) keeps 2.1 M values instead of 16 M.
//!
//! What it holds is counted in the query's memory pool (an unspillable
//! consumer, `BuildKeys`). It stops collecting, and the join filter goes
//! without a membership test, when a column holds more than
//! `sieve.join_filter_keys_max` distinct keys or the pool refuses the
//! memory: the keys only make a filter better, the join is exact without
//! them.

use std::fmt;
use std::sync::{Arc, Mutex};

use arrow::array::{Array, ArrayRef, ArrowPrimitiveType, AsArray, PrimitiveArray};
use arrow::compute::concat;
use arrow::datatypes::{
    DataType, Date32Type, Date64Type, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type,
    UInt32Type, UInt64Type, UInt8Type,
};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{internal_err, DataFusionError, Result, Statistics};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryPool, MemoryReservation};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::statistics::{ChildStats, StatisticsArgs};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use futures::StreamExt;

/// The keys one hash join's build side produced, per key column.
#[derive(Debug)]
pub struct BuildKeys {
    /// Partitions of the build input; the keys are complete once every one
    /// has been read to its end.
    partitions: usize,
    /// Distinct keys per column past which collecting stops (the keys are
    /// then not usable).
    keys_max: usize,
    state: Mutex<KeysState>,
    /// Woken when a partition finishes.
    finished: tokio::sync::Notify,
    /// Some partition of the join spilled its build side to disk and gave
    /// up its part of DataFusion's filter ([`crate::SpillableHashJoinExec`]).
    spilled: std::sync::atomic::AtomicBool,
}

/// Values added since a column's last compaction below which it is not
/// compacted again (sorting fewer costs more in calls than it saves).
const COMPACT_ROWS_MIN: usize = 1 << 16;

#[derive(Debug, Default)]
struct KeysState {
    columns: Vec<KeyColumn>,
    /// Build rows seen.
    rows: usize,
    finished: usize,
    /// Why collecting stopped, if it did.
    stopped: Option<Stopped>,
    /// What the kept values take, in the query's memory pool.
    reservation: Option<MemoryReservation>,
}

/// Why a collector stopped keeping keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stopped {
    /// A column has more distinct keys than `sieve.join_filter_keys_max`.
    TooManyKeys,
    /// The memory pool refused the bytes.
    MemoryRefused,
}

/// One key column's values: those distinct ones a compaction left, and
/// those added since.
#[derive(Debug, Default)]
struct KeyColumn {
    distinct: Option<ArrayRef>,
    pending: Vec<ArrayRef>,
    pending_rows: usize,
    /// A compaction of this column runs outside the lock.
    compacting: bool,
}

impl KeyColumn {
    fn distinct_rows(&self) -> usize {
        self.distinct.as_ref().map_or(0, |array| array.len())
    }

    fn wants_compaction(&self) -> bool {
        !self.compacting && self.pending_rows >= self.distinct_rows().max(COMPACT_ROWS_MIN)
    }

    fn bytes(&self) -> usize {
        self.distinct
            .iter()
            .chain(&self.pending)
            .map(|array| array.get_array_memory_size())
            .sum()
    }

    fn arrays(&self) -> Vec<ArrayRef> {
        self.distinct.iter().chain(&self.pending).cloned().collect()
    }
}

/// What the collector holds once the build side is complete.
#[derive(Debug, Clone)]
pub enum CollectedKeys {
    /// Each key column's values (distinct within each array, possibly
    /// repeated across them), in join key order.
    Keys(Vec<Vec<ArrayRef>>),
    /// More distinct keys than the collector keeps, after this many build
    /// rows.
    TooMany(usize),
    /// The memory pool refused the keys, after this many build rows.
    MemoryRefused(usize),
    /// Some build partition has not been read to its end.
    Incomplete,
}

impl BuildKeys {
    /// A collector for a build side of `partitions` partitions and
    /// `key_columns` keys, keeping at most `keys_max` distinct keys per
    /// column.
    pub fn new(partitions: usize, key_columns: usize, keys_max: usize) -> Self {
        Self {
            partitions,
            keys_max,
            state: Mutex::new(KeysState {
                columns: (0..key_columns).map(|_| KeyColumn::default()).collect(),
                ..KeysState::default()
            }),
            finished: tokio::sync::Notify::new(),
            spilled: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Record that a partition of the join spilled its build side (before
    /// it gives up its part of DataFusion's filter).
    pub fn mark_spilled(&self) {
        self.spilled
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether a partition of the join spilled its build side.
    pub fn spilled(&self) -> bool {
        self.spilled.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Returns once every build partition has been read to its end (never,
    /// if the build side fails: callers bound the wait).
    pub async fn wait_complete(&self) {
        loop {
            // Created before the check, so a partition finishing in between
            // still wakes it (`Notify::notify_waiters`).
            let finished = self.finished.notified();
            if self.state.lock().expect("never poisoned").finished >= self.partitions {
                return;
            }
            finished.await;
        }
    }

    /// Add one build batch's key arrays; `pool` is the query's memory pool.
    fn push(&self, keys: Vec<ArrayRef>, pool: &Arc<dyn MemoryPool>) -> Result<()> {
        let rows = keys.first().map_or(0, |array| array.len());
        let mut to_compact = Vec::new();
        {
            let mut state = self.state.lock().expect("never poisoned");
            state.rows += rows;
            if state.stopped.is_some() || rows == 0 {
                return Ok(());
            }
            if state.reservation.is_none() {
                state.reservation = Some(MemoryConsumer::new("BuildKeys").register(pool));
            }
            for (index, (column, array)) in state.columns.iter_mut().zip(keys).enumerate() {
                column.pending_rows += array.len();
                column.pending.push(array);
                if column.wants_compaction() {
                    column.compacting = true;
                    to_compact.push((
                        index,
                        column.distinct.take(),
                        std::mem::take(&mut column.pending),
                    ));
                    column.pending_rows = 0;
                }
            }
            if to_compact.is_empty() {
                self.account(&mut state);
                return Ok(());
            }
        }
        // Sorting millions of keys under the lock would stall the other
        // build partitions: compact outside it, values added meanwhile wait
        // in `pending`.
        let mut compacted = Vec::with_capacity(to_compact.len());
        for (index, distinct, pending) in to_compact {
            compacted.push((index, compact(distinct, &pending)));
        }
        let mut state = self.state.lock().expect("never poisoned");
        let mut failed = None;
        let stopped = state.stopped.is_some();
        for (index, result) in compacted {
            let column = &mut state.columns[index];
            column.compacting = false;
            match result {
                // Stopped meanwhile: the keys are no longer kept.
                Ok(_) if stopped => {}
                Ok(distinct) => column.distinct = Some(distinct),
                Err(error) => failed = Some(error),
            }
        }
        if let Some(error) = failed {
            return Err(error);
        }
        if !stopped {
            self.account(&mut state);
        }
        Ok(())
    }

    /// Stop if a column holds too many distinct keys, else reserve what the
    /// columns take (and stop if the pool refuses it).
    fn account(&self, state: &mut KeysState) {
        let too_many = state
            .columns
            .iter()
            .any(|column| column.distinct_rows() > self.keys_max);
        let bytes: usize = state.columns.iter().map(KeyColumn::bytes).sum();
        let stopped = if too_many {
            Some(Stopped::TooManyKeys)
        } else {
            match state
                .reservation
                .as_mut()
                .map(|reservation| reservation.try_resize(bytes))
            {
                Some(Err(_)) => Some(Stopped::MemoryRefused),
                _ => None,
            }
        };
        if stopped.is_some() {
            state.stopped = stopped;
            state.columns.iter_mut().for_each(|column| {
                column.distinct = None;
                column.pending.clear();
                column.pending_rows = 0;
            });
            if let Some(reservation) = state.reservation.as_mut() {
                reservation.free();
            }
        }
    }

    /// Count a partition read to its end. After the last one, each column
    /// is compacted once more, so consumers read one distinct array per
    /// column (and a column past `keys_max` is found).
    fn finish_partition(&self) -> Result<()> {
        let result = {
            let mut state = self.state.lock().expect("never poisoned");
            state.finished += 1;
            if state.finished == self.partitions && state.stopped.is_none() {
                // Every partition's pushes have returned: no compaction is
                // in flight.
                let result = state.columns.iter_mut().try_for_each(|column| {
                    if column.pending.is_empty() {
                        return Ok(());
                    }
                    column.distinct = Some(compact(column.distinct.take(), &column.pending)?);
                    column.pending.clear();
                    column.pending_rows = 0;
                    Ok::<_, DataFusionError>(())
                });
                self.account(&mut state);
                result
            } else {
                Ok(())
            }
        };
        self.finished.notify_waiters();
        result
    }

    /// The keys, if every build partition has been read to its end.
    pub fn collected(&self) -> CollectedKeys {
        let state = self.state.lock().expect("never poisoned");
        if state.finished < self.partitions {
            return CollectedKeys::Incomplete;
        }
        match state.stopped {
            Some(Stopped::TooManyKeys) => CollectedKeys::TooMany(state.rows),
            Some(Stopped::MemoryRefused) => CollectedKeys::MemoryRefused(state.rows),
            None => CollectedKeys::Keys(state.columns.iter().map(KeyColumn::arrays).collect()),
        }
    }

    /// Bytes the kept keys take (what the memory pool holds for them).
    pub fn bytes(&self) -> usize {
        let state = self.state.lock().expect("never poisoned");
        state
            .reservation
            .as_ref()
            .map_or(0, MemoryReservation::size)
    }
}

/// The distinct values of `distinct` (a previous compaction's result) and
/// `pending`. Integers and dates: `distinct` is sorted, so only `pending`
/// is sorted and the two are merged (each value is sorted about once, as
/// one sort of every key at the end would); anything else through
/// [`crate::join_filter::distinct`] over all of them.
fn compact(distinct: Option<ArrayRef>, pending: &[ArrayRef]) -> Result<ArrayRef> {
    let data_type = match (&distinct, pending.first()) {
        (Some(array), _) | (None, Some(array)) => array.data_type().clone(),
        (None, None) => return internal_err!("nothing to compact"),
    };
    macro_rules! merged {
        ($arrow:ty) => {
            return Ok(merge_sorted::<$arrow>(
                distinct.as_ref(),
                pending,
                &data_type,
            ))
        };
    }
    match data_type {
        DataType::Int8 => merged!(Int8Type),
        DataType::Int16 => merged!(Int16Type),
        DataType::Int32 => merged!(Int32Type),
        DataType::Int64 => merged!(Int64Type),
        DataType::UInt8 => merged!(UInt8Type),
        DataType::UInt16 => merged!(UInt16Type),
        DataType::UInt32 => merged!(UInt32Type),
        DataType::UInt64 => merged!(UInt64Type),
        DataType::Date32 => merged!(Date32Type),
        DataType::Date64 => merged!(Date64Type),
        _ => {}
    }
    let arrays: Vec<&dyn Array> = distinct
        .iter()
        .chain(pending)
        .map(|array| array.as_ref())
        .collect();
    crate::join_filter::distinct(&concat(&arrays)?)
}

/// `sorted` (distinct, ascending, no NULLs) merged with the distinct
/// non-NULL values of `pending`.
fn merge_sorted<T: ArrowPrimitiveType>(
    sorted: Option<&ArrayRef>,
    pending: &[ArrayRef],
    data_type: &DataType,
) -> ArrayRef
where
    T::Native: Ord,
{
    let mut added: Vec<T::Native> = pending
        .iter()
        .flat_map(|array| array.as_primitive::<T>().iter().flatten())
        .collect();
    added.sort_unstable();
    added.dedup();
    let old: &[T::Native] = sorted.map_or(&[], |array| array.as_primitive::<T>().values());
    let mut merged = Vec::with_capacity(old.len() + added.len());
    let (mut left, mut right) = (0, 0);
    while left < old.len() && right < added.len() {
        match old[left].cmp(&added[right]) {
            std::cmp::Ordering::Less => {
                merged.push(old[left]);
                left += 1;
            }
            std::cmp::Ordering::Greater => {
                merged.push(added[right]);
                right += 1;
            }
            std::cmp::Ordering::Equal => {
                merged.push(old[left]);
                left += 1;
                right += 1;
            }
        }
    }
    merged.extend_from_slice(&old[left..]);
    merged.extend_from_slice(&added[right..]);
    // The array takes the vector's buffer, capacity included.
    merged.shrink_to_fit();
    Arc::new(PrimitiveArray::<T>::from_iter_values(merged).with_data_type(data_type.clone()))
}

/// Passes its input through unchanged, handing the values of `keys` in every
/// batch to a [`BuildKeys`] collector.
#[derive(Debug)]
pub struct BuildKeysExec {
    input: Arc<dyn ExecutionPlan>,
    keys: Vec<Arc<dyn PhysicalExpr>>,
    collector: Arc<BuildKeys>,
}

impl BuildKeysExec {
    /// Collect `keys` (expressions over `input`'s schema) into `collector`.
    pub fn new(
        input: Arc<dyn ExecutionPlan>,
        keys: Vec<Arc<dyn PhysicalExpr>>,
        collector: Arc<BuildKeys>,
    ) -> Self {
        Self {
            input,
            keys,
            collector,
        }
    }
}

impl BuildKeysExec {
    /// Where the keys go.
    pub fn collector(&self) -> &Arc<BuildKeys> {
        &self.collector
    }
}

impl DisplayAs for BuildKeysExec {
    fn fmt_as(&self, _format: DisplayFormatType, formatter: &mut fmt::Formatter) -> fmt::Result {
        let keys: Vec<String> = self.keys.iter().map(|key| key.to_string()).collect();
        write!(
            formatter,
            "BuildKeysExec: join keys [{}] for the probe side's storage nodes",
            keys.join(", ")
        )
    }
}

impl ExecutionPlan for BuildKeysExec {
    fn name(&self) -> &str {
        "BuildKeysExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.input.properties()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        for key in &self.keys {
            if f(key)? == TreeNodeRecursion::Stop {
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        Ok(TreeNodeRecursion::Continue)
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let [input] = &children[..] else {
            return internal_err!("BuildKeysExec has one child");
        };
        Ok(Arc::new(Self {
            input: Arc::clone(input),
            keys: self.keys.clone(),
            collector: Arc::clone(&self.collector),
        }))
    }

    /// After a reset (a recursive CTE's term, run again) the join above has
    /// no dynamic filter and its probe scan no join filter (see
    /// `SieveScanExec::reset_state`): nothing would read the keys, so the
    /// tap removes itself.
    fn reset_state(self: Arc<Self>) -> Result<Arc<dyn ExecutionPlan>> {
        Ok(Arc::clone(&self.input))
    }

    fn child_stats_requests(&self, partition: Option<usize>) -> Vec<ChildStats> {
        vec![ChildStats::At(partition)]
    }

    fn statistics_from_inputs(
        &self,
        input_stats: &[Arc<Statistics>],
        _args: &StatisticsArgs,
    ) -> Result<Arc<Statistics>> {
        Ok(Arc::clone(&input_stats[0]))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let pool = Arc::clone(context.memory_pool());
        let input = self.input.execute(partition, context)?;
        let schema = input.schema();
        let keys = self.keys.clone();
        let collector = Arc::clone(&self.collector);
        let mut finisher = Some(Arc::clone(&self.collector));
        let tapped = input
            .map(move |batch| {
                let batch = batch?;
                let arrays = keys
                    .iter()
                    .map(|key| key.evaluate(&batch)?.into_array(batch.num_rows()))
                    .collect::<Result<Vec<_>>>()?;
                collector.push(arrays, &pool)?;
                Ok(batch)
            })
            .chain(futures::stream::poll_fn(move |_| {
                // Counted once, however often the ended stream is polled.
                match finisher.take().map(|finisher| finisher.finish_partition()) {
                    Some(Err(error)) => std::task::Poll::Ready(Some(Err(error))),
                    _ => std::task::Poll::Ready(None),
                }
            }));
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, tapped)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use arrow::record_batch::RecordBatch;
    use datafusion::datasource::memory::MemorySourceConfig;
    use datafusion::physical_expr::expressions::Column;
    use datafusion::physical_plan::common::collect;

    fn input(partitions: Vec<Vec<i64>>) -> Arc<dyn ExecutionPlan> {
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)]));
        let batches: Vec<Vec<RecordBatch>> = partitions
            .into_iter()
            .map(|values| {
                vec![RecordBatch::try_new(
                    Arc::clone(&schema),
                    vec![Arc::new(Int64Array::from(values))],
                )
                .unwrap()]
            })
            .collect();
        MemorySourceConfig::try_new_exec(&batches, schema, None).unwrap()
    }

    #[tokio::test]
    async fn keys_are_complete_only_after_every_partition_and_rows_pass_unchanged() {
        let collector = Arc::new(BuildKeys::new(2, 1, 100));
        let tap = BuildKeysExec::new(
            input(vec![vec![1, 2, 2], vec![7]]),
            vec![Arc::new(Column::new("k", 0))],
            Arc::clone(&collector),
        );
        let context = Arc::new(TaskContext::default());
        let first = collect(tap.execute(0, Arc::clone(&context)).unwrap())
            .await
            .unwrap();
        assert_eq!(first[0].num_rows(), 3);
        assert!(matches!(collector.collected(), CollectedKeys::Incomplete));
        collect(tap.execute(1, context).unwrap()).await.unwrap();
        let CollectedKeys::Keys(columns) = collector.collected() else {
            panic!("complete after both partitions");
        };
        // One array of the distinct keys.
        assert_eq!(columns[0].len(), 1);
        assert_eq!(sorted_i64(&columns[0][0]), vec![1, 2, 7]);
    }

    fn sorted_i64(array: &ArrayRef) -> Vec<i64> {
        let mut values: Vec<i64> = array
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap()
            .iter()
            .flatten()
            .collect();
        values.sort_unstable();
        values
    }

    /// Two key columns (an integer with NULLs, a string) over many batches
    /// with repeated keys, in two partitions.
    fn repeated_keys(
        batches: usize,
        rows: usize,
    ) -> (Arc<dyn ExecutionPlan>, Vec<Arc<dyn PhysicalExpr>>) {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, true),
            Field::new("s", DataType::Utf8, false),
        ]));
        let batch = |offset: usize| {
            let ints: Int64Array = (0..rows)
                .map(|row| {
                    let key = (offset + row) % 1000;
                    (!key.is_multiple_of(97)).then_some(key as i64)
                })
                .collect();
            let strings = StringArray::from_iter_values(
                (0..rows).map(|row| format!("name {}", (offset + row) % 300)),
            );
            RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(ints), Arc::new(strings)])
                .unwrap()
        };
        let partitions: Vec<Vec<RecordBatch>> = (0..2)
            .map(|partition| {
                (0..batches)
                    .map(|index| batch((partition * batches + index) * rows))
                    .collect()
            })
            .collect();
        let keys: Vec<Arc<dyn PhysicalExpr>> =
            vec![Arc::new(Column::new("k", 0)), Arc::new(Column::new("s", 1))];
        (
            MemorySourceConfig::try_new_exec(&partitions, schema, None).unwrap(),
            keys,
        )
    }

    fn context_with_pool(pool: Arc<dyn MemoryPool>) -> Arc<TaskContext> {
        let runtime = datafusion::execution::runtime_env::RuntimeEnvBuilder::new()
            .with_memory_pool(pool)
            .build_arc()
            .unwrap();
        Arc::new(TaskContext::default().with_runtime(runtime))
    }

    /// 300,000 build rows with 1,000 and 300 distinct keys: the collector
    /// keeps the distinct keys (NULLs left out), in the memory pool, and
    /// gives the memory back when the plan is dropped.
    #[tokio::test]
    async fn repeated_keys_are_kept_once_each_and_counted_in_the_pool() {
        let pool: Arc<dyn MemoryPool> = Arc::new(
            datafusion::execution::memory_pool::GreedyMemoryPool::new(64 << 20),
        );
        let context = context_with_pool(Arc::clone(&pool));
        let (input, keys) = repeated_keys(20, 7_500);
        let collector = Arc::new(BuildKeys::new(2, 2, 5_000));
        let tap = BuildKeysExec::new(input, keys, Arc::clone(&collector));
        let mut rows = 0;
        for partition in 0..2 {
            let batches = collect(tap.execute(partition, Arc::clone(&context)).unwrap())
                .await
                .unwrap();
            rows += batches.iter().map(RecordBatch::num_rows).sum::<usize>();
        }
        assert_eq!(rows, 300_000);
        let CollectedKeys::Keys(columns) = collector.collected() else {
            panic!("1,000 distinct keys are below the bound");
        };
        let expected: Vec<i64> = (0..1000).filter(|key| key % 97 != 0).collect();
        assert_eq!(columns[0].len(), 1);
        assert_eq!(sorted_i64(&columns[0][0]), expected);
        assert_eq!(columns[1].len(), 1);
        let mut names: Vec<String> = columns[1][0]
            .as_any()
            .downcast_ref::<StringArray>()
            .unwrap()
            .iter()
            .map(|name| name.unwrap().to_string())
            .collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), 300);
        assert_eq!(columns[1][0].len(), 300);
        let held = collector.bytes();
        assert!(held > 0 && held < 64 << 10, "{held} bytes for 1,300 keys");
        assert_eq!(pool.reserved(), held);
        drop(columns);
        drop(tap);
        drop(collector);
        assert_eq!(pool.reserved(), 0);
    }

    #[tokio::test]
    async fn a_pool_that_refuses_the_keys_leaves_the_rows_unchanged() {
        let pool: Arc<dyn MemoryPool> = Arc::new(
            datafusion::execution::memory_pool::GreedyMemoryPool::new(1024),
        );
        let context = context_with_pool(Arc::clone(&pool));
        let (input, keys) = repeated_keys(3, 5_000);
        let collector = Arc::new(BuildKeys::new(2, 2, 1_000_000));
        let tap = BuildKeysExec::new(input, keys, Arc::clone(&collector));
        let mut rows = 0;
        for partition in 0..2 {
            let batches = collect(tap.execute(partition, Arc::clone(&context)).unwrap())
                .await
                .unwrap();
            rows += batches.iter().map(RecordBatch::num_rows).sum::<usize>();
        }
        assert_eq!(rows, 30_000);
        assert!(
            matches!(collector.collected(), CollectedKeys::MemoryRefused(30_000)),
            "{:?}",
            collector.collected()
        );
        assert_eq!(pool.reserved(), 0);
    }

    #[tokio::test]
    async fn more_distinct_keys_than_the_bound_are_not_kept() {
        let collector = Arc::new(BuildKeys::new(1, 1, 2));
        let tap = BuildKeysExec::new(
            input(vec![vec![1, 2, 3]]),
            vec![Arc::new(Column::new("k", 0))],
            Arc::clone(&collector),
        );
        collect(tap.execute(0, Arc::new(TaskContext::default())).unwrap())
            .await
            .unwrap();
        assert!(matches!(collector.collected(), CollectedKeys::TooMany(3)));
    }
}
