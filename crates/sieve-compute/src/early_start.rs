//! Small scans start when the query starts, not when first polled.
//!
//! DataFusion starts a scan when its consumer first polls it: the scans of a
//! hash join's build sides one after another, a probe side under a
//! `RepartitionExec` only once the build side is complete. Over local files
//! that costs nothing; over storage nodes every scan is a round trip, so a
//! chain of joins over small tables (TPC-H Q2, Q11, Q16, Q22) pays one round
//! trip per table, in series, while the storage nodes sit idle.
//!
//! ```text
//!  StartScansEarly (optimizer rule, last of Sieve's)
//!    wraps the root in EarlyStartExec, naming the scans that qualify:
//!    no join filter to wait for, estimated output rows <= early_start_rows_max
//!  EarlyStartExec::execute(0), i.e. when the query starts
//!    each named scan runs every partition now, into a buffer
//!    (bounded by early_start_buffer_bytes per scan; beyond, it waits)
//!  SieveScanExec::execute(p), whenever DataFusion gets there
//!    takes partition p's buffered stream instead of starting afresh
//! ```
//!
//! A scan that waits for a join filter never starts early: its requests
//! need the build side's keys. Results are unchanged: a partition's stream
//! is the same stream, only started sooner. When the query's stream is
//! dropped, buffers not taken are dropped and their requests cancelled.

use std::fmt;
use std::sync::{Arc, Mutex};

use arrow::datatypes::SchemaRef;
use datafusion::common::config::ConfigOptions;
use datafusion::common::runtime::SpawnedTask;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::common::{internal_err, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use futures::StreamExt;
use tokio::sync::{mpsc, Semaphore};

use crate::{SieveConfig, SieveScanExec};

/// The partition streams of one scan started ahead of its consumer, taken
/// by `SieveScanExec::execute`.
#[derive(Clone, Default)]
pub(crate) struct EarlySlots(Arc<Mutex<Vec<Option<SendableRecordBatchStream>>>>);

impl EarlySlots {
    /// Keep `streams`, one per partition, replacing any not taken.
    pub(crate) fn fill(&self, streams: Vec<Option<SendableRecordBatchStream>>) {
        *self.0.lock().expect("never poisoned") = streams;
    }

    /// Partition `partition`'s stream, if started early and not taken yet.
    pub(crate) fn take(&self, partition: usize) -> Option<SendableRecordBatchStream> {
        self.0
            .lock()
            .expect("never poisoned")
            .get_mut(partition)
            .and_then(Option::take)
    }

    /// Streams started early and not taken yet.
    pub(crate) fn waiting(&self) -> usize {
        self.0
            .lock()
            .map(|slots| slots.iter().filter(|slot| slot.is_some()).count())
            .unwrap_or(0)
    }

    /// Drop the streams not taken, cancelling their requests.
    pub(crate) fn clear(&self) {
        self.0.lock().expect("never poisoned").clear();
    }
}

impl fmt::Debug for EarlySlots {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "EarlySlots({} waiting)", self.waiting())
    }
}

/// Wraps the plan's root in an [`EarlyStartExec`] over the scans that may
/// start when the query starts (see the module documentation).
#[derive(Debug, Default)]
pub struct StartScansEarly;

impl PhysicalOptimizerRule for StartScansEarly {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let settings = SieveConfig::of(config);
        let plan = match plan.downcast_ref::<EarlyStartExec>() {
            Some(wrapper) => Arc::clone(&wrapper.input),
            None => plan,
        };
        if settings.early_start_rows_max == 0 {
            return Ok(plan);
        }
        let scans = early_scans(&plan, settings.early_start_rows_max);
        if scans.is_empty() {
            return Ok(plan);
        }
        Ok(Arc::new(EarlyStartExec::new(
            plan,
            scans,
            settings.early_start_buffer_bytes,
        )))
    }

    fn name(&self) -> &str {
        "sieve_start_scans_early"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// The scans under `plan` that may start at once: no join filter to wait
/// for, and at most `rows_max` rows estimated to come out.
fn early_scans(plan: &Arc<dyn ExecutionPlan>, rows_max: usize) -> Vec<Arc<dyn ExecutionPlan>> {
    let mut scans = Vec::new();
    let _ = plan.apply(|node| {
        if let Some(scan) = node.downcast_ref::<SieveScanExec>() {
            if !scan.waits_for_join_filters()
                && scan.estimated_rows().is_some_and(|rows| rows <= rows_max)
            {
                scans.push(Arc::clone(node));
            }
        }
        Ok(TreeNodeRecursion::Continue)
    });
    scans
}

/// The plan's root, unchanged, plus: when its first partition starts, the named
/// scans start every partition into a bounded buffer.
#[derive(Debug)]
pub struct EarlyStartExec {
    input: Arc<dyn ExecutionPlan>,
    /// `SieveScanExec`s inside `input`.
    scans: Vec<Arc<dyn ExecutionPlan>>,
    buffer_bytes: usize,
    /// The current execution's owner of the buffers, and how many of the
    /// root's partitions have yet to take it. Every partition's stream
    /// holds it: the buffers not taken are dropped when the last one is
    /// (a LIMIT met early, a join that never polled its probe). Before,
    /// partition 0 started the scans and its end dropped them: a partition
    /// executed before partition 0, or after its end, ran its scans twice.
    guard: Mutex<Option<(Arc<ClearOnDrop>, usize)>>,
}

impl EarlyStartExec {
    fn new(
        input: Arc<dyn ExecutionPlan>,
        scans: Vec<Arc<dyn ExecutionPlan>>,
        buffer_bytes: usize,
    ) -> Self {
        Self {
            input,
            scans,
            buffer_bytes,
            guard: Mutex::new(None),
        }
    }

    /// Names of the tables whose scans start early, in plan order.
    pub fn tables(&self) -> Vec<String> {
        self.scans
            .iter()
            .filter_map(|scan| scan.downcast_ref::<SieveScanExec>())
            .map(|scan| scan.table().name.clone())
            .collect()
    }
}

impl DisplayAs for EarlyStartExec {
    fn fmt_as(
        &self,
        _format: DisplayFormatType,
        formatter: &mut fmt::Formatter<'_>,
    ) -> fmt::Result {
        write!(
            formatter,
            "EarlyStartExec: scans started with the query: {}",
            self.tables().join(", ")
        )
    }
}

impl ExecutionPlan for EarlyStartExec {
    fn name(&self) -> &str {
        "EarlyStartExec"
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
            return internal_err!("EarlyStartExec has one child");
        };
        // The scans must be the ones in the new tree, or their buffers
        // would never be taken: if any was replaced, start none early.
        let mut scans = Vec::new();
        let _ = input.apply(|node| {
            if self.scans.iter().any(|scan| Arc::ptr_eq(scan, node)) {
                scans.push(Arc::clone(node));
            }
            Ok(TreeNodeRecursion::Continue)
        });
        if scans.len() != self.scans.len() {
            scans.clear();
        }
        Ok(Arc::new(Self::new(
            Arc::clone(input),
            scans,
            self.buffer_bytes,
        )))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        if self.scans.is_empty() {
            return self.input.execute(partition, context);
        }
        // The first partition of an execution to arrive, whichever it is,
        // starts the scans; each partition's stream shares the buffers'
        // owner, and the last partition to take it leaves it to the
        // streams alone.
        let guard = {
            let mut slot = self.guard.lock().expect("never poisoned");
            if slot.is_none() {
                for scan in &self.scans {
                    if let Some(scan) = scan.downcast_ref::<SieveScanExec>() {
                        scan.start_early(Arc::clone(&context), self.buffer_bytes)?;
                    }
                }
                let partitions = self.properties().partitioning.partition_count();
                *slot = Some((Arc::new(ClearOnDrop(self.scans.clone())), partitions.max(1)));
            }
            let (guard, left) = slot.as_mut().expect("set above");
            let guard = Arc::clone(guard);
            *left -= 1;
            if *left == 0 {
                *slot = None;
            }
            guard
        };
        let stream = self.input.execute(partition, context)?;
        Ok(crate::guarded::holding(stream, guard))
    }
}

#[derive(Debug)]
struct ClearOnDrop(Vec<Arc<dyn ExecutionPlan>>);

impl Drop for ClearOnDrop {
    fn drop(&mut self) {
        for scan in &self.0 {
            if let Some(scan) = scan.downcast_ref::<SieveScanExec>() {
                scan.clear_early();
            }
        }
    }
}

/// Run `stream` now on its own task, buffering up to `buffer_bytes` of
/// batches (at least one batch) until the returned stream is polled.
/// Dropping the returned stream cancels the task.
pub(crate) fn buffer_ahead(
    stream: SendableRecordBatchStream,
    buffer_bytes: usize,
) -> SendableRecordBatchStream {
    let schema: SchemaRef = stream.schema();
    let budget = u32::try_from(buffer_bytes.max(1)).unwrap_or(u32::MAX);
    let room = Arc::new(Semaphore::new(budget as usize));
    let (sender, mut receiver) = mpsc::unbounded_channel();
    let task = SpawnedTask::spawn(async move {
        let mut stream = stream;
        while let Some(item) = stream.next().await {
            let bytes = match &item {
                Ok(batch) => batch.get_array_memory_size(),
                Err(_) => 0,
            };
            let wanted = u32::try_from(bytes).unwrap_or(u32::MAX).clamp(1, budget);
            let Ok(permit) = Arc::clone(&room).acquire_many_owned(wanted).await else {
                return;
            };
            if sender.send((item, permit)).is_err() {
                return;
            }
        }
    });
    let batches = futures::stream::poll_fn(move |context| {
        let _ = &task;
        receiver
            .poll_recv(context)
            .map(|item| item.map(|(item, _permit)| item))
    });
    Box::pin(RecordBatchStreamAdapter::new(schema, batches))
}
