//! Hash joins whose build side does not fit in memory: grace partitioning.
//!
//! DataFusion 55's `HashJoinExec` holds its whole build side in memory and
//! cannot spill; past the memory pool the query fails, and below it the
//! compute node's memory grows with the scale factor (TPC-H Q9 at SF 100
//! built a 150 M-row orders table). [`SpillHashJoins`] wraps every
//! partitioned hash join that may spill in a [`SpillableHashJoinExec`],
//! which runs one join partition like this:
//!
//! ```text
//!  read the build side, holding it (a spillable reservation in the pool)
//!  ├─ it ends within sieve.join_build_bytes_max and the pool's share:
//!  │    DataFusion's own HashJoinExec runs the partition over the batches
//!  │    held (dynamic filter, join filters and metrics as ever)
//!  └─ it does not (a hybrid hash join):
//!       the partition's dynamic filter is given up (DataFusion lets it
//!       pass every probe row of this partition, as for a cancelled one;
//!       the probe scan's join filter takes the collected build keys for
//!       it instead, see `join_filter`);
//!       build rows go by a hash of the join keys into GRACE_FAN_OUT parts,
//!       all in memory at first; while they pass the budget (or the pool's
//!       share), the largest part in memory goes to its spill file
//!       (DataFusion's SpillManager, the session's disk manager and its
//!       limit) and its later rows follow it there. Probe rows of parts in
//!       memory stream into a HashJoinExec (same keys, type, filter,
//!       projection, NULL semantics) over those parts; probe rows of
//!       spilled parts go to spill files. Then each spilled build part is
//!       joined with its probe part the same way. A spilled part still too
//!       large is partitioned again with another hash seed, at most
//!       GRACE_DEPTH_MAX times (beyond, one key's rows: joined in memory).
//! ```
//!
//! Partitioning by the join keys keeps every join type right: rows that
//! can match share a part, and each build and probe row is in exactly one
//! part, so unmatched rows of outer, semi, anti and mark joins are found in
//! their part. Null-aware anti joins (`NOT IN`, where one NULL anywhere on
//! the probe side empties the result) are not decomposable and are left
//! alone, as are joins with a fetch (LIMIT) and joins whose output order
//! something above may rely on. `CollectLeft` joins are left alone: their
//! build side is one table shared by every probe partition, and DataFusion
//! chooses that mode only for build sides it estimates small.
//!
//! The wrapped join keeps its children behind two pass-through
//! [`JoinInputExec`]s, so the plan DataFusion and Sieve's rules see is the
//! join's own (the probe scan still finds the dynamic filter its join
//! publishes); at run time they hand the join the build batches already
//! read.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use arrow::array::{Array, ArrayRef, RecordBatch, RecordBatchOptions, UInt32Array};
use arrow::compute::{concat, take_record_batch};
use arrow::datatypes::SchemaRef;
use datafusion::common::config::ConfigOptions;
use datafusion::common::hash_utils::{create_hashes, RandomState};
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{internal_err, DataFusionError, Result};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::execution::SpillFile;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::{EquivalenceProperties, Partitioning, PhysicalExpr};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::execution_plan::{
    Boundedness, ChildrenPropertiesMode, EmissionType, ReplaceChildrenOptions,
};
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
use datafusion::physical_plan::metrics::{
    Count, ExecutionPlanMetricsSet, MetricBuilder, MetricsSet, SpillMetrics,
};
use datafusion::physical_plan::spill::get_record_batch_memory_size;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, EmptyRecordBatchStream, ExecutionPlan, PlanProperties,
    SpillManager,
};
use futures::{StreamExt, TryStreamExt};

use crate::{BuildKeysExec, SieveConfig};

/// Default of `sieve.join_build_bytes_max`: the build side one join
/// partition holds in memory before it is partitioned to disk.
pub const JOIN_BUILD_BYTES_MAX: usize = 256 * 1024 * 1024;

/// Spill files per side when a join partition is partitioned to disk.
pub const GRACE_FAN_OUT: usize = 16;

/// Times a part still too large is partitioned again (16^3 = 4,096 parts
/// of the build side's share of one join partition).
pub const GRACE_DEPTH_MAX: usize = 3;

/// Bytes per build row counted for DataFusion's hash table (its map of
/// hashes to rows and its chain of equal hashes) on top of the batches.
const HASH_TABLE_BYTES_PER_ROW: usize = 32;

/// Hash seeds of the partitioning levels, distinct from the seeds of the
/// repartitioning below the join (0) and of the join's hash table.
const LEVEL_SEEDS: [u64; GRACE_DEPTH_MAX + 1] = [
    0x5eed_9ace_0000_0001,
    0x5eed_9ace_0000_0002,
    0x5eed_9ace_0000_0003,
    0x5eed_9ace_0000_0004,
];

/// Wraps partitioned hash joins in [`SpillableHashJoinExec`] (see the
/// module documentation); `sieve.join_build_bytes_max = 0` turns it off.
#[derive(Debug, Default)]
pub struct SpillHashJoins;

impl PhysicalOptimizerRule for SpillHashJoins {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let budget = SieveConfig::of(config).join_build_bytes_max;
        if budget == 0 {
            return Ok(plan);
        }
        let target = config.execution.target_partitions.max(1);
        plan.transform_up(|node| {
            let Some(join) = node.downcast_ref::<HashJoinExec>() else {
                return Ok(Transformed::no(node));
            };
            if !may_spill(join) {
                return Ok(Transformed::no(node));
            }
            // The budget is one partition's of the plan's partitions: a
            // join over more (`sieve.join_wide_partitions`) shares it out,
            // or its memory grew with its partitions (TPC-H Q9 at SF 100
            // over 16: 5.8 GB against 1.6 GB).
            let partitions = join.properties().output_partitioning().partition_count();
            let budget = if partitions > target {
                (budget.saturating_mul(target) / partitions).max(1)
            } else {
                budget
            };
            let children = vec![
                Arc::new(JoinInputExec::new(Arc::clone(join.left()))) as Arc<dyn ExecutionPlan>,
                Arc::new(JoinInputExec::new(Arc::clone(join.right()))),
            ];
            // Replacing the children keeps the join's dynamic filter, which
            // the probe scan below already holds.
            let join = Arc::clone(&node).replace_children(
                children,
                ReplaceChildrenOptions::new(ChildrenPropertiesMode::Keep),
            )?;
            Ok(Transformed::yes(
                Arc::new(SpillableHashJoinExec::new(join, budget)) as Arc<dyn ExecutionPlan>,
            ))
        })
        .map(|transformed| transformed.data)
    }

    fn name(&self) -> &str {
        "sieve_spill_hash_joins"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// Whether `join` can run part by part (see the module documentation).
fn may_spill(join: &HashJoinExec) -> bool {
    *join.partition_mode() == PartitionMode::Partitioned
        && !join.null_aware
        && join.fetch().is_none()
        && join.properties().output_ordering().is_none()
        // Already wrapped.
        && join.left().downcast_ref::<JoinInputExec>().is_none()
}

/// A hash join partition that holds its build side in memory while it fits
/// and joins part by part from disk when it does not.
#[derive(Debug)]
pub struct SpillableHashJoinExec {
    /// A `HashJoinExec` whose children are [`JoinInputExec`]s.
    join: Arc<dyn ExecutionPlan>,
    budget: usize,
    metrics: ExecutionPlanMetricsSet,
    /// The metrics of the joins a partition ran part by part (each a join
    /// of its own, not the one in the plan), shown as this node's: without
    /// them EXPLAIN ANALYZE showed a join that was partitioned to disk, or
    /// only split in memory, with no rows and no time.
    part_metrics: PartMetrics,
}

/// The metrics of the part joins, as they ran; a join itself is not kept
/// (it holds its hash table).
type PartMetrics = Arc<Mutex<Vec<MetricsSet>>>;

impl SpillableHashJoinExec {
    fn new(join: Arc<dyn ExecutionPlan>, budget: usize) -> Self {
        Self {
            join,
            budget,
            metrics: ExecutionPlanMetricsSet::new(),
            part_metrics: PartMetrics::default(),
        }
    }
}

impl DisplayAs for SpillableHashJoinExec {
    fn fmt_as(&self, _format: DisplayFormatType, formatter: &mut fmt::Formatter) -> fmt::Result {
        write!(
            formatter,
            "SpillableHashJoinExec: build side held up to {} KiB per partition, beyond in {} parts, the largest on disk",
            self.budget >> 10,
            GRACE_FAN_OUT
        )
    }
}

impl ExecutionPlan for SpillableHashJoinExec {
    fn name(&self) -> &str {
        "SpillableHashJoinExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.join.properties()
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.join]
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![false]
    }

    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        vec![false]
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let [join] = &children[..] else {
            return internal_err!("SpillableHashJoinExec has one child");
        };
        Ok(Arc::new(Self::new(Arc::clone(join), self.budget)))
    }

    fn reset_state(self: Arc<Self>) -> Result<Arc<dyn ExecutionPlan>> {
        Ok(Arc::new(Self::new(Arc::clone(&self.join), self.budget)))
    }

    fn metrics(&self) -> Option<MetricsSet> {
        let mut metrics = self.metrics.clone_inner();
        let parts = self
            .part_metrics
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        for metric in parts.iter().flat_map(MetricsSet::iter) {
            metrics.push(Arc::clone(metric));
        }
        Some(metrics)
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let inputs = self.join.downcast_ref::<HashJoinExec>().and_then(|join| {
            let build = join.left().downcast_ref::<JoinInputExec>()?;
            let probe = join.right().downcast_ref::<JoinInputExec>()?;
            Some((build.clone(), probe.clone()))
        });
        let Some((build, probe)) = inputs else {
            // A rule after ours rebuilt the join's children: run it as is.
            return self.join.execute(partition, context);
        };
        let progress = Arc::new(AtomicU8::new(NOTHING_OPENED));
        let unstarted = ReportIfNeverStarted {
            join: Arc::clone(&self.join),
            build: build.clone(),
            probe: probe.clone(),
            partition,
            context: Arc::clone(&context),
            progress: Arc::clone(&progress),
        };
        let run = JoinPartition {
            join: Arc::clone(&self.join),
            build,
            probe,
            partition,
            context,
            budget: self.budget,
            spill: SpillMetrics::new(&self.metrics, partition),
            parts: MetricBuilder::new(&self.metrics).counter("spilled_join_parts", partition),
            part_metrics: Arc::clone(&self.part_metrics),
            progress,
        };
        let stream = futures::stream::once(run.run()).try_flatten();
        Ok(crate::guarded::holding(
            Box::pin(RecordBatchStreamAdapter::new(self.join.schema(), stream)),
            unstarted,
        ))
    }
}

/// Runs DataFusion's join partition, empty, when a [`SpillableHashJoinExec`]
/// partition is dropped before it ran it.
///
/// A partitioned `HashJoinExec` with a dynamic filter holds every partition
/// at a barrier until each has reported its build side, or been dropped
/// (reported cancelled). DataFusion starts a join partition's stream when
/// the partition is executed; this wrapper starts it only once it has read
/// the build side, when first polled. A consumer that never polls it (a
/// join above whose build side came out empty, which then skips its probe
/// side) would leave the other partitions of this join waiting forever:
/// the query hung (fuzzer seed 20261127, schemas 8 and 10). Executing the
/// join over empty inputs and dropping the stream reports the partition
/// cancelled, as DataFusion's own stream does when dropped; its probe rows
/// are nobody's, since nothing reads this partition.
struct ReportIfNeverStarted {
    join: Arc<dyn ExecutionPlan>,
    build: JoinInputExec,
    probe: JoinInputExec,
    partition: usize,
    context: Arc<TaskContext>,
    /// How far [`JoinPartition::run`] got.
    progress: Arc<AtomicU8>,
}

/// [`JoinPartition::run`] has opened nothing yet.
const NOTHING_OPENED: u8 = 0;
/// It opened the build input (whose stream counts its own end with the key
/// collector).
const BUILD_OPENED: u8 = 1;
/// It executed DataFusion's join partition.
const JOIN_EXECUTED: u8 = 2;

impl Drop for ReportIfNeverStarted {
    fn drop(&mut self) {
        let progress = self.progress.swap(JOIN_EXECUTED, Ordering::AcqRel);
        if progress == JOIN_EXECUTED {
            return;
        }
        // A build input never opened leaves its key collector a partition
        // short: counted as dropped, its keys make no membership test and
        // the probe scan stops waiting for them.
        if progress == NOTHING_OPENED {
            if let Some(keys) = self.build.input.downcast_ref::<BuildKeysExec>() {
                keys.collector().abandon_partition();
            }
        }
        self.build.hand_over(
            self.partition,
            Box::pin(EmptyRecordBatchStream::new(self.build.input.schema())),
        );
        self.probe.hand_over(
            self.partition,
            Box::pin(EmptyRecordBatchStream::new(self.probe.input.schema())),
        );
        drop(self.join.execute(self.partition, Arc::clone(&self.context)));
    }
}

/// One partition of a [`SpillableHashJoinExec`], as it runs.
struct JoinPartition {
    join: Arc<dyn ExecutionPlan>,
    build: JoinInputExec,
    probe: JoinInputExec,
    partition: usize,
    context: Arc<TaskContext>,
    budget: usize,
    spill: SpillMetrics,
    parts: Count,
    part_metrics: PartMetrics,
    /// How far it got (see [`ReportIfNeverStarted`]).
    progress: Arc<AtomicU8>,
}

/// `batches` as one batch, concatenated a column at a time, each column's
/// pieces freed once copied.
///
/// DataFusion 55's hash join concatenates its build side into one batch
/// after building its hash table, while it still holds the batches: for a
/// moment the build side is in memory twice, and the pool counts it once
/// (TPC-H Q14 at SF 100 under a 512 MB bound: 370 MB of build side, the
/// compute node's peak 726 MB). Given one batch, its concatenation is a
/// slice. Here the build side is in memory once and a column more.
fn one_batch(schema: &SchemaRef, batches: Vec<RecordBatch>) -> Result<RecordBatch> {
    if batches.len() <= 1 {
        return Ok(batches
            .into_iter()
            .next()
            .unwrap_or_else(|| RecordBatch::new_empty(Arc::clone(schema))));
    }
    let rows = batches.iter().map(RecordBatch::num_rows).sum();
    let mut pieces: Vec<Vec<ArrayRef>> = (0..schema.fields().len())
        .map(|_| Vec::with_capacity(batches.len()))
        .collect();
    for batch in batches {
        for (column, array) in batch.columns().iter().enumerate() {
            pieces[column].push(Arc::clone(array));
        }
    }
    let mut columns = Vec::with_capacity(pieces.len());
    for column in &mut pieces {
        let arrays: Vec<&dyn Array> = column.iter().map(AsRef::as_ref).collect();
        columns.push(concat(&arrays)?);
        drop(arrays);
        column.clear();
    }
    Ok(RecordBatch::try_new_with_options(
        Arc::clone(schema),
        columns,
        &RecordBatchOptions::new().with_row_count(Some(rows)),
    )?)
}

/// A build batch's view columns are compacted when their buffers hold more
/// than this many times the bytes their strings use.
const BUILD_VIEW_WASTE_MAX: f64 = 2.0;

/// Memory a build batch takes in the join: its arrays and its share of the
/// hash table.
fn build_bytes(batch: &RecordBatch) -> usize {
    get_record_batch_memory_size(batch) + batch.num_rows() * HASH_TABLE_BYTES_PER_ROW
}

impl JoinPartition {
    fn hash_join(&self) -> &HashJoinExec {
        self.join
            .downcast_ref::<HashJoinExec>()
            .expect("checked in execute")
    }

    async fn run(self) -> Result<SendableRecordBatchStream> {
        let partition = self.partition;
        let mut build = self
            .build
            .input
            .execute(partition, Arc::clone(&self.context))?;
        self.progress.store(BUILD_OPENED, Ordering::Release);
        let reservation = MemoryConsumer::new(format!("SpillableHashJoin[{partition}]"))
            .with_can_spill(true)
            .register(self.context.memory_pool());
        let mut held = Vec::new();
        let mut held_bytes = 0usize;
        let mut fits = true;
        while let Some(batch) = build.next().await {
            // A build row's strings may point into the whole batch it was
            // joined from (TPC-H Q10's customer strings: 776 bytes a row
            // held for about 240 used, and the spill files wrote all of it,
            // 3.4 GB at SF 100): hold and spill only what the rows use.
            let batch = sieve_fragment::compact_views(batch?, BUILD_VIEW_WASTE_MAX)?;
            let bytes = build_bytes(&batch);
            held.push(batch);
            if held_bytes + bytes > self.budget || reservation.try_grow(bytes).is_err() {
                fits = false;
                break;
            }
            held_bytes += bytes;
        }
        if fits {
            let schema = build.schema();
            let held = one_batch(&schema, held)?;
            // DataFusion's join takes the batch and reserves its memory
            // itself.
            drop(reservation);
            let held = futures::stream::iter([Ok(held)]);
            self.build.hand_over(
                partition,
                Box::pin(RecordBatchStreamAdapter::new(schema, held)),
            );
            self.progress.store(JOIN_EXECUTED, Ordering::Release);
            return self.join.execute(partition, Arc::clone(&self.context));
        }

        // The probe scan's join filter takes the collected build keys for
        // what this partition's part of DataFusion's filter no longer says.
        if let Some(keys) = self.build.input.downcast_ref::<BuildKeysExec>() {
            keys.collector().mark_spilled();
        }
        // Give up this partition's share of the join's dynamic filter:
        // a join stream dropped before its build side is reported counts as
        // cancelled, and DataFusion's filter then passes this partition's
        // probe rows (the probe scan waits for every partition's report).
        let build_schema = build.schema();
        let probe_schema = self.probe.input.schema();
        self.build.hand_over(
            partition,
            Box::pin(EmptyRecordBatchStream::new(Arc::clone(&build_schema))),
        );
        self.probe.hand_over(
            partition,
            Box::pin(EmptyRecordBatchStream::new(Arc::clone(&probe_schema))),
        );
        self.progress.store(JOIN_EXECUTED, Ordering::Release);
        drop(self.join.execute(partition, Arc::clone(&self.context))?);

        let (build_keys, probe_keys): (Vec<_>, Vec<_>) = self
            .hash_join()
            .on()
            .iter()
            .map(|(build, probe)| (Arc::clone(build), Arc::clone(probe)))
            .unzip();
        // Spill files are compressed as the session says
        // (`datafusion.execution.spill_compression`), as DataFusion's own
        // sorts and aggregations write theirs.
        let compression = self
            .context
            .session_config()
            .options()
            .execution
            .spill_compression;
        let build_spill = SpillManager::new(
            self.context.runtime_env(),
            self.spill.clone(),
            Arc::clone(&build_schema),
        )
        .with_compression_type(compression);
        let probe_spill = SpillManager::new(
            self.context.runtime_env(),
            self.spill.clone(),
            Arc::clone(&probe_schema),
        )
        .with_compression_type(compression);

        // Build rows by part: every part starts in memory; while they take
        // more than the budget (or the pool's share), the largest part
        // still in memory goes to its spill file, and its later rows follow.
        let mut build_parts = PartWriter::new(&build_spill, &build_keys, 0)?;
        let mut resident = ResidentParts::new(reservation, self.budget);
        for batch in held.drain(..) {
            for (part, rows) in build_parts.split(&batch)? {
                resident.add(part, rows, &mut build_parts)?;
            }
        }
        while let Some(batch) = build.next().await {
            let batch = sieve_fragment::compact_views(batch?, BUILD_VIEW_WASTE_MAX)?;
            for (part, rows) in build_parts.split(&batch)? {
                resident.add(part, rows, &mut build_parts)?;
            }
        }
        drop(build);
        let build_parts = build_parts.finish()?;
        let (in_memory, resident_build, reservation) = resident.into_parts();

        // Probe rows of parts in memory go to their join at once; the rest
        // to spill files, read once the parts in memory are done.
        let probe = self
            .probe
            .input
            .execute(partition, Arc::clone(&self.context))?;
        let probe_split = Arc::new(tokio::sync::Mutex::new(ProbeSplit {
            input: Some(probe),
            writer: Some(PartWriter::new(&probe_spill, &probe_keys, 0)?),
            in_memory: in_memory.clone(),
        }));
        let joiner = Arc::new(PartJoiner {
            join: Arc::clone(&self.join),
            context: Arc::clone(&self.context),
            budget: self.budget,
            build_spill,
            probe_spill,
            build_keys,
            probe_keys,
            parts: self.parts.clone(),
            part_metrics: Arc::clone(&self.part_metrics),
            room: MemoryConsumer::new(format!("SpillableHashJoin[{partition}] parts"))
                .with_can_spill(true)
                .register(self.context.memory_pool()),
        });
        let resident_join = if in_memory.iter().any(|part| *part) {
            let rows = futures::stream::unfold(Arc::clone(&probe_split), |split| async move {
                let next = split.lock().await.next_in_memory().await;
                next.map(|rows| (rows, split))
            });
            let probe = Box::pin(RecordBatchStreamAdapter::new(
                Arc::clone(&probe_schema),
                rows,
            ));
            let build = one_batch(&build_schema, resident_build)?;
            let build = futures::stream::iter([Ok(build)]);
            let build = Box::pin(RecordBatchStreamAdapter::new(
                Arc::clone(&build_schema),
                build,
            ));
            // The join reserves the memory of its build side itself.
            drop(reservation);
            Some(joiner.join_streams(build, probe)?)
        } else {
            None
        };

        let spilled = {
            let joiner = Arc::clone(&joiner);
            let probe_split = Arc::clone(&probe_split);
            futures::stream::once(async move {
                // Whatever the join in memory did not read (it may stop
                // early, e.g. over an empty build side) still holds the
                // spilled parts' probe rows.
                let probe_parts = probe_split.lock().await.finish().await?;
                let queue: VecDeque<Part> = build_parts
                    .into_iter()
                    .zip(probe_parts)
                    .map(|(build, probe)| Part {
                        build,
                        probe,
                        depth: 0,
                    })
                    .collect();
                Ok::<_, DataFusionError>(joiner.join_queue(queue))
            })
            .try_flatten()
        };
        let stream = match resident_join {
            Some(first) => first.chain(spilled).boxed(),
            None => spilled.boxed(),
        };
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.join.schema(),
            stream,
        )))
    }
}

/// The build parts a partition keeps in memory, within its budget and its
/// reservation in the pool.
struct ResidentParts {
    /// Per part: its batches while in memory, `None` once spilled.
    batches: Vec<Option<Vec<RecordBatch>>>,
    bytes: Vec<usize>,
    total: usize,
    budget: usize,
    reservation: MemoryReservation,
}

impl ResidentParts {
    fn new(reservation: MemoryReservation, budget: usize) -> Self {
        Self {
            batches: (0..GRACE_FAN_OUT).map(|_| Some(Vec::new())).collect(),
            bytes: vec![0; GRACE_FAN_OUT],
            total: 0,
            budget,
            reservation,
        }
    }

    /// `rows` of build part `part`: kept, or written where the part went.
    fn add(&mut self, part: usize, rows: RecordBatch, writer: &mut PartWriter) -> Result<()> {
        let Some(batches) = &mut self.batches[part] else {
            return writer.write(part, &rows);
        };
        let bytes = build_bytes(&rows);
        batches.push(rows);
        self.bytes[part] += bytes;
        self.total += bytes;
        while self.total > self.budget || self.reservation.try_resize(self.total).is_err() {
            let largest = (0..GRACE_FAN_OUT)
                .filter(|part| self.batches[*part].is_some())
                .max_by_key(|part| self.bytes[*part]);
            let Some(largest) = largest else { break };
            for rows in self.batches[largest].take().unwrap_or_default() {
                writer.write(largest, &rows)?;
            }
            self.total -= self.bytes[largest];
            self.bytes[largest] = 0;
        }
        self.reservation.resize(self.total);
        Ok(())
    }

    /// Which parts stayed in memory, their batches, and their reservation.
    fn into_parts(self) -> (Vec<bool>, Vec<RecordBatch>, MemoryReservation) {
        let in_memory = self.batches.iter().map(Option::is_some).collect();
        let batches = self.batches.into_iter().flatten().flatten().collect();
        (in_memory, batches, self.reservation)
    }
}

/// The probe side of a partition split between the parts kept in memory
/// (handed to their join as it reads) and the spilled ones (written).
struct ProbeSplit {
    input: Option<SendableRecordBatchStream>,
    writer: Option<PartWriter>,
    in_memory: Vec<bool>,
}

impl ProbeSplit {
    /// The next probe rows of parts in memory, writing the others.
    async fn next_in_memory(&mut self) -> Option<Result<RecordBatch>> {
        loop {
            let batch = match self.input.as_mut()?.next().await {
                Some(Ok(batch)) => batch,
                Some(Err(error)) => return Some(Err(error)),
                None => {
                    self.input = None;
                    return None;
                }
            };
            let writer = self.writer.as_mut()?;
            let (kept, spilled) = match writer.split_keeping(&batch, &self.in_memory) {
                Ok(split) => split,
                Err(error) => return Some(Err(error)),
            };
            for (part, rows) in spilled {
                if let Err(error) = writer.write(part, &rows) {
                    return Some(Err(error));
                }
            }
            if let Some(kept) = kept {
                return Some(Ok(kept));
            }
        }
    }

    /// The spilled parts' probe rows, once the input is read to its end
    /// (rows of parts in memory not read by their join are not needed).
    async fn finish(&mut self) -> Result<Vec<Option<SpilledPart>>> {
        while let Some(batch) = self.next_in_memory().await {
            batch?;
        }
        match self.writer.take() {
            Some(writer) => writer.finish(),
            None => internal_err!("SpillableHashJoinExec: probe parts finished twice"),
        }
    }
}

/// One spill file of rows whose keys hash to one part, and the memory its
/// rows take when read back.
struct SpilledPart {
    file: Arc<dyn SpillFile>,
    bytes: usize,
}

/// A build part and the probe part with the same key hashes.
struct Part {
    build: Option<SpilledPart>,
    probe: Option<SpilledPart>,
    /// Times these rows were partitioned already (minus one).
    depth: usize,
}

impl Part {
    fn build_bytes(&self) -> usize {
        self.build.as_ref().map_or(0, |part| part.bytes)
    }
}

/// Rows of one batch by part: `(part, rows)` for parts with rows.
type RowsByPart = Vec<(usize, RecordBatch)>;

/// Sends rows to [`GRACE_FAN_OUT`] spill files by a hash of their keys.
struct PartWriter {
    keys: Vec<Arc<dyn PhysicalExpr>>,
    seed: RandomState,
    /// Per part: append a batch (`Some`) or finish the file (`None`). The
    /// spill file's writer type is DataFusion's own and unnamed here.
    #[allow(clippy::type_complexity)]
    files: Vec<Box<dyn FnMut(Option<&RecordBatch>) -> Result<Option<Arc<dyn SpillFile>>> + Send>>,
    bytes: Vec<usize>,
    hashes: Vec<u64>,
}

impl PartWriter {
    fn new(spill: &SpillManager, keys: &[Arc<dyn PhysicalExpr>], depth: usize) -> Result<Self> {
        let mut files = Vec::with_capacity(GRACE_FAN_OUT);
        for _ in 0..GRACE_FAN_OUT {
            let mut file = spill.create_in_progress_file("SpillableHashJoin part")?;
            files.push(Box::new(move |batch: Option<&RecordBatch>| match batch {
                Some(batch) => file.append_batch(batch).map(|_| None),
                None => file.finish(),
            })
                as Box<
                    dyn FnMut(Option<&RecordBatch>) -> Result<Option<Arc<dyn SpillFile>>> + Send,
                >);
        }
        Ok(Self {
            keys: keys.to_vec(),
            seed: RandomState::with_seed(LEVEL_SEEDS[depth]),
            files,
            bytes: vec![0; GRACE_FAN_OUT],
            hashes: Vec::new(),
        })
    }

    /// `batch`'s rows by part (parts without rows left out).
    fn split(&mut self, batch: &RecordBatch) -> Result<RowsByPart> {
        let (_, parts) = self.split_keeping(batch, &[false; GRACE_FAN_OUT])?;
        Ok(parts)
    }

    /// `batch`'s rows of the parts marked in `keep`, together in one batch,
    /// and the other rows by part (parts without rows left out).
    fn split_keeping(
        &mut self,
        batch: &RecordBatch,
        keep: &[bool],
    ) -> Result<(Option<RecordBatch>, RowsByPart)> {
        let rows = batch.num_rows();
        if rows == 0 {
            return Ok((None, Vec::new()));
        }
        let keys = self
            .keys
            .iter()
            .map(|key| key.evaluate(batch)?.into_array(rows))
            .collect::<Result<Vec<_>>>()?;
        self.hashes.clear();
        self.hashes.resize(rows, 0);
        create_hashes(&keys, &self.seed, &mut self.hashes)?;
        let mut kept_rows = Vec::new();
        let mut rows_of: Vec<Vec<u32>> = vec![Vec::new(); GRACE_FAN_OUT];
        for (row, hash) in self.hashes.iter().enumerate() {
            let part = (*hash % GRACE_FAN_OUT as u64) as usize;
            if keep[part] {
                kept_rows.push(row as u32);
            } else {
                rows_of[part].push(row as u32);
            }
        }
        let take = |rows: Vec<u32>| -> Result<RecordBatch> {
            if rows.len() == batch.num_rows() {
                Ok(batch.clone())
            } else {
                // Each part's strings on their own: a part held or spilled
                // does not carry the other parts' (IPC writes every buffer
                // a view column references).
                let taken = take_record_batch(batch, &UInt32Array::from(rows))?;
                Ok(sieve_fragment::compact_views(taken, BUILD_VIEW_WASTE_MAX)?)
            }
        };
        let kept = if kept_rows.is_empty() {
            None
        } else {
            Some(take(kept_rows)?)
        };
        let mut parts = Vec::new();
        for (part, rows) in rows_of.into_iter().enumerate() {
            if !rows.is_empty() {
                parts.push((part, take(rows)?));
            }
        }
        Ok((kept, parts))
    }

    /// Append `rows` to part `part`'s file.
    fn write(&mut self, part: usize, rows: &RecordBatch) -> Result<()> {
        self.bytes[part] += build_bytes(rows);
        (self.files[part])(Some(rows))?;
        Ok(())
    }

    fn push(&mut self, batch: &RecordBatch) -> Result<()> {
        for (part, rows) in self.split(batch)? {
            self.write(part, &rows)?;
        }
        Ok(())
    }

    fn finish(mut self) -> Result<Vec<Option<SpilledPart>>> {
        let mut parts = Vec::with_capacity(GRACE_FAN_OUT);
        for (file, bytes) in self.files.iter_mut().zip(&self.bytes) {
            parts.push(file(None)?.map(|file| SpilledPart {
                file,
                bytes: *bytes,
            }));
        }
        Ok(parts)
    }
}

/// Joins spilled parts, each with DataFusion's hash join.
struct PartJoiner {
    join: Arc<dyn ExecutionPlan>,
    context: Arc<TaskContext>,
    budget: usize,
    build_spill: SpillManager,
    probe_spill: SpillManager,
    build_keys: Vec<Arc<dyn PhysicalExpr>>,
    probe_keys: Vec<Arc<dyn PhysicalExpr>>,
    parts: Count,
    part_metrics: PartMetrics,
    /// Asks the pool whether a part's build side would fit now.
    room: MemoryReservation,
}

impl PartJoiner {
    /// Whether `part`'s build side fits the budget and the pool's room for
    /// it (asked, then given back: the part's join reserves it itself).
    fn fits(&self, part: &Part) -> bool {
        let bytes = part.build_bytes();
        if bytes > self.budget {
            return false;
        }
        let fits = self.room.try_grow(bytes).is_ok();
        self.room.free();
        fits
    }

    fn read(spill: &SpillManager, part: Option<SpilledPart>) -> Result<SendableRecordBatchStream> {
        match part {
            Some(part) => spill.read_spill_as_stream(part.file, None),
            None => Ok(Box::pin(EmptyRecordBatchStream::new(Arc::clone(
                spill.schema(),
            )))),
        }
    }

    /// `part` partitioned again with the next level's hash.
    async fn split(&self, part: Part) -> Result<Vec<Part>> {
        let depth = part.depth + 1;
        let mut build_parts = PartWriter::new(&self.build_spill, &self.build_keys, depth)?;
        let mut rows = Self::read(&self.build_spill, part.build)?;
        while let Some(batch) = rows.next().await {
            build_parts.push(&batch?)?;
        }
        let mut probe_parts = PartWriter::new(&self.probe_spill, &self.probe_keys, depth)?;
        let mut rows = Self::read(&self.probe_spill, part.probe)?;
        while let Some(batch) = rows.next().await {
            probe_parts.push(&batch?)?;
        }
        Ok(build_parts
            .finish()?
            .into_iter()
            .zip(probe_parts.finish()?)
            .map(|(build, probe)| Part {
                build,
                probe,
                depth,
            })
            .collect())
    }

    /// The spilled parts joined one after another (split again where one
    /// does not fit).
    fn join_queue(
        self: Arc<Self>,
        queue: VecDeque<Part>,
    ) -> impl futures::Stream<Item = Result<RecordBatch>> + Send {
        futures::stream::try_unfold(queue, move |mut queue| {
            let joiner = Arc::clone(&self);
            async move {
                while let Some(part) = queue.pop_front() {
                    if part.build.is_none() && part.probe.is_none() {
                        continue;
                    }
                    if part.depth < GRACE_DEPTH_MAX && !joiner.fits(&part) {
                        for smaller in joiner.split(part).await? {
                            queue.push_front(smaller);
                        }
                        continue;
                    }
                    let stream = joiner.join_part(part)?;
                    return Ok(Some((stream, queue)));
                }
                Ok::<_, DataFusionError>(None)
            }
        })
        .try_flatten()
    }

    /// DataFusion's hash join of one build part with its probe part.
    fn join_part(&self, part: Part) -> Result<SendableRecordBatchStream> {
        self.parts.add(1);
        let build = Self::read(&self.build_spill, part.build)?;
        let probe = Self::read(&self.probe_spill, part.probe)?;
        self.join_streams(build, probe)
    }

    /// DataFusion's hash join (the wrapped join's keys, type, filter,
    /// projection and NULL semantics) of `build` with `probe`.
    fn join_streams(
        &self,
        build: SendableRecordBatchStream,
        probe: SendableRecordBatchStream,
    ) -> Result<SendableRecordBatchStream> {
        let join = self
            .join
            .downcast_ref::<HashJoinExec>()
            .expect("checked in execute");
        let build = OnceStreamExec::new(build);
        let probe = OnceStreamExec::new(probe);
        let part_join = join
            .builder()
            .reset_state()
            .recompute_properties()
            .with_partition_mode(PartitionMode::CollectLeft)
            .with_new_children(vec![Arc::new(build), Arc::new(probe)])?
            .build()?;
        let stream = part_join.execute(0, Arc::clone(&self.context))?;
        // Its metrics exist once it is executed, and count as it runs.
        if let Some(metrics) = part_join.metrics() {
            self.part_metrics
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .push(metrics);
        }
        Ok(stream)
    }
}

/// A join input that passes its child through, except for partitions whose
/// stream its [`SpillableHashJoinExec`] handed over for the join to take.
#[derive(Debug, Clone)]
pub struct JoinInputExec {
    input: Arc<dyn ExecutionPlan>,
    handed: Arc<Mutex<HashMap<usize, SendableRecordBatchStreamSlot>>>,
}

/// A stream waiting in a [`JoinInputExec`] (wrapped for `Debug`).
struct SendableRecordBatchStreamSlot(SendableRecordBatchStream);

impl fmt::Debug for SendableRecordBatchStreamSlot {
    fn fmt(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("stream")
    }
}

impl JoinInputExec {
    fn new(input: Arc<dyn ExecutionPlan>) -> Self {
        Self {
            input,
            handed: Arc::default(),
        }
    }

    /// The stream the next `execute(partition)` returns.
    fn hand_over(&self, partition: usize, stream: SendableRecordBatchStream) {
        self.handed
            .lock()
            .expect("never poisoned")
            .insert(partition, SendableRecordBatchStreamSlot(stream));
    }
}

impl DisplayAs for JoinInputExec {
    fn fmt_as(&self, _format: DisplayFormatType, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("JoinInputExec")
    }
}

impl ExecutionPlan for JoinInputExec {
    fn name(&self) -> &str {
        "JoinInputExec"
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
            return internal_err!("JoinInputExec has one child");
        };
        Ok(Arc::new(Self::new(Arc::clone(input))))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let handed = self
            .handed
            .lock()
            .expect("never poisoned")
            .remove(&partition);
        match handed {
            Some(SendableRecordBatchStreamSlot(stream)) => Ok(stream),
            None => self.input.execute(partition, context),
        }
    }
}

/// A leaf of one partition that returns a given stream once.
pub(crate) struct OnceStreamExec {
    stream: Mutex<Option<SendableRecordBatchStream>>,
    properties: Arc<PlanProperties>,
}

impl OnceStreamExec {
    pub(crate) fn new(stream: SendableRecordBatchStream) -> Self {
        let schema: SchemaRef = stream.schema();
        Self {
            stream: Mutex::new(Some(stream)),
            properties: Arc::new(PlanProperties::new(
                EquivalenceProperties::new(schema),
                Partitioning::UnknownPartitioning(1),
                EmissionType::Incremental,
                Boundedness::Bounded,
            )),
        }
    }
}

impl fmt::Debug for OnceStreamExec {
    fn fmt(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("OnceStreamExec")
    }
}

impl DisplayAs for OnceStreamExec {
    fn fmt_as(&self, _format: DisplayFormatType, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("OnceStreamExec: a stream handed over")
    }
}

impl ExecutionPlan for OnceStreamExec {
    fn name(&self) -> &str {
        "OnceStreamExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![]
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if children.is_empty() {
            Ok(self)
        } else {
            internal_err!("OnceStreamExec has no children")
        }
    }

    fn execute(
        &self,
        partition: usize,
        _context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        match self.stream.lock().expect("never poisoned").take() {
            Some(stream) if partition == 0 => Ok(stream),
            _ => internal_err!("OnceStreamExec runs once, as partition 0"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Array, AsArray, Int64Array, StringViewArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::execution::runtime_env::RuntimeEnvBuilder;
    use datafusion::physical_expr::expressions::Column;

    #[test]
    fn build_batches_become_one_batch_with_the_same_rows() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, true),
            Field::new("s", DataType::Utf8View, true),
        ]));
        let batch = |keys: Vec<Option<i64>>| {
            let names: Vec<Option<String>> = keys
                .iter()
                .map(|key| key.map(|key| format!("a longer name than twelve bytes {key}")))
                .collect();
            RecordBatch::try_new(
                Arc::clone(&schema),
                vec![
                    Arc::new(Int64Array::from(keys)) as ArrayRef,
                    Arc::new(StringViewArray::from_iter(names)),
                ],
            )
            .unwrap()
        };
        let batches = vec![
            batch(vec![Some(1), None, Some(3)]),
            batch(vec![]),
            batch(vec![Some(4), Some(5)]),
        ];
        let expected = arrow::compute::concat_batches(&schema, &batches).unwrap();
        let one = one_batch(&schema, batches).unwrap();
        assert_eq!(one, expected);
        assert_eq!(one.num_rows(), 5);
        let empty = one_batch(&schema, Vec::new()).unwrap();
        assert_eq!((empty.num_rows(), empty.schema()), (0, Arc::clone(&schema)));
    }

    /// Bytes a view column's buffers hold, and the bytes its strings use.
    fn held_and_used(batch: &RecordBatch, column: usize) -> (usize, usize) {
        let views = batch.column(column).as_string_view();
        let held = views.data_buffers().iter().map(|b| b.capacity()).sum();
        (held, views.total_buffer_bytes_used())
    }

    /// Rows split into parts (to hold or to spill) carry their own strings,
    /// not the whole batch's: a part holding a sixteenth of the rows held
    /// all of their strings, and Arrow IPC wrote them all to its file.
    #[test]
    fn the_parts_of_a_build_batch_carry_only_their_own_strings() {
        let rows = 20_000;
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("comment", DataType::Utf8View, false),
        ]));
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from_iter_values(0..rows)),
                Arc::new(StringViewArray::from_iter_values(
                    (0..rows).map(|row| format!("a comment of some forty bytes, row {row}")),
                )),
            ],
        )
        .unwrap();
        let runtime = Arc::new(RuntimeEnvBuilder::new().build().unwrap());
        let spill = SpillManager::new(
            runtime,
            SpillMetrics::new(&ExecutionPlanMetricsSet::new(), 0),
            Arc::clone(&schema),
        );
        let keys: Vec<Arc<dyn PhysicalExpr>> = vec![Arc::new(Column::new("k", 0))];
        let mut writer = PartWriter::new(&spill, &keys, 0).unwrap();
        let parts = writer.split(&batch).unwrap();
        assert!(parts.len() > GRACE_FAN_OUT / 2, "{} parts", parts.len());
        let (whole, _) = held_and_used(&batch, 1);
        let mut total_rows = 0;
        for (part, rows) in &parts {
            let (held, used) = held_and_used(rows, 1);
            assert!(
                held as f64 <= used as f64 * BUILD_VIEW_WASTE_MAX && held < whole / 4,
                "part {part}: {held} bytes held for {used} used ({whole} in the batch)"
            );
            total_rows += rows.num_rows();
            let original: Vec<_> = rows
                .column(0)
                .as_primitive::<arrow::datatypes::Int64Type>()
                .values()
                .iter()
                .map(|&k| format!("a comment of some forty bytes, row {k}"))
                .collect();
            let kept: Vec<_> = rows
                .column(1)
                .as_string_view()
                .iter()
                .map(|value| value.unwrap().to_string())
                .collect();
            assert_eq!(kept, original, "part {part}");
        }
        assert_eq!(total_rows, batch.num_rows());
        assert_eq!(batch.column(1).len(), rows as usize);
    }
}
