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
//!        |  └──── keys of every build batch ─────────────────────┘ (Bloom / list)
//!   build side ...
//! ```

use std::fmt;
use std::sync::{Arc, Mutex};

use arrow::array::ArrayRef;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{internal_err, Result, Statistics};
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
    /// Rows past which collecting stops (the keys are then not usable).
    rows_max: usize,
    state: Mutex<KeysState>,
    /// Woken when a partition finishes.
    finished: tokio::sync::Notify,
    /// Some partition of the join spilled its build side to disk and gave
    /// up its part of DataFusion's filter ([`crate::SpillableHashJoinExec`]).
    spilled: std::sync::atomic::AtomicBool,
}

#[derive(Debug, Default)]
struct KeysState {
    /// Arrays of each key column, one per build batch.
    columns: Vec<Vec<ArrayRef>>,
    rows: usize,
    finished: usize,
    overflow: bool,
}

/// What the collector holds once the build side is complete.
#[derive(Debug, Clone)]
pub enum CollectedKeys {
    /// Each key column's values (with duplicates), in join key order.
    Keys(Vec<Vec<ArrayRef>>),
    /// More build rows than the collector keeps.
    TooMany(usize),
    /// Some build partition has not been read to its end.
    Incomplete,
}

impl BuildKeys {
    /// A collector for a build side of `partitions` partitions and
    /// `key_columns` keys, keeping at most `rows_max` rows.
    pub fn new(partitions: usize, key_columns: usize, rows_max: usize) -> Self {
        Self {
            partitions,
            rows_max,
            state: Mutex::new(KeysState {
                columns: vec![Vec::new(); key_columns],
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

    fn push(&self, keys: Vec<ArrayRef>) {
        let mut state = self.state.lock().expect("never poisoned");
        let rows = keys.first().map_or(0, |array| array.len());
        state.rows += rows;
        if state.overflow || rows == 0 {
            return;
        }
        if state.rows > self.rows_max {
            state.overflow = true;
            state.columns.iter_mut().for_each(Vec::clear);
            return;
        }
        for (column, array) in state.columns.iter_mut().zip(keys) {
            column.push(array);
        }
    }

    fn finish_partition(&self) {
        self.state.lock().expect("never poisoned").finished += 1;
        self.finished.notify_waiters();
    }

    /// The keys, if every build partition has been read to its end.
    pub fn collected(&self) -> CollectedKeys {
        let state = self.state.lock().expect("never poisoned");
        if state.finished < self.partitions {
            CollectedKeys::Incomplete
        } else if state.overflow {
            CollectedKeys::TooMany(state.rows)
        } else {
            CollectedKeys::Keys(state.columns.clone())
        }
    }
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
                collector.push(arrays);
                Ok(batch)
            })
            .chain(futures::stream::poll_fn(move |_| {
                // Counted once, however often the ended stream is polled.
                if let Some(finisher) = finisher.take() {
                    finisher.finish_partition();
                }
                std::task::Poll::Ready(None)
            }));
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, tapped)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Array, Int64Array};
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
        let values: usize = columns[0].iter().map(|array| array.len()).sum();
        assert_eq!(values, 4);
    }

    #[tokio::test]
    async fn too_many_build_rows_are_not_kept() {
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
