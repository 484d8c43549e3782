//! More partitions for a hash join whose build side is past the cache.
//!
//! A partitioned hash join probes one hash table per partition, and the
//! plan has as many partitions as cores (two here). Past the processor's
//! cache, every probe is a random read from memory, so the join's cost per
//! row grows with its build side: TPC-H Q9's join of lineitem with partsupp
//! took 9.75 s of compute at SF 100 for 32.6 M probes into 4.35 M rows.
//! The same join over 16 partitions, each table a sixteenth of the whole,
//! was 1.6x to 1.7x faster (`docs/results/2026-11-28-issue20-part19.md`),
//! but 16 partitions for the whole plan made the scans send 16 partitions'
//! slice requests at once and the storage nodes ship 6.4x the bytes.
//!
//! [`WidenLargeJoins`] gives the extra partitions only to such a join. It
//! runs right after DataFusion's `EnsureRequirements`, which put a hash
//! repartition of `n` partitions under each side of the join; for a join
//! whose build side is estimated past `sieve.join_wide_build_rows` rows
//! per partition, both repartitions go to `N` partitions (a multiple of
//! `n`, `sieve.join_wide_partitions`), and a [`MergePartitionsExec`] above
//! the join gives the operators above the `n` partitions they were planned
//! on:
//!
//! ```text
//!  before                          after
//!  HashJoinExec (n)                MergePartitionsExec (N -> n)
//!    Repartition hash(a), n          HashJoinExec (N)
//!    Repartition hash(b), n            Repartition hash(a), N
//!                                      Repartition hash(b), N
//! ```
//!
//! DataFusion's repartition sends a row to partition `hash % N`, so output
//! partition `j` of the merge, reading join partitions `j, j + n, j + 2n,
//! ...`, holds exactly the rows with `hash % n = j`: the hash partitioning
//! over `n` that the join had, which a join or aggregation above on the
//! same keys relies on. The scans below keep their partitions (and the
//! storage nodes their share of work); the join's dynamic filter and the
//! probe scan's join filters are made afterwards from the plan as it is.

use std::fmt;
use std::sync::Arc;

use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{internal_err, Result, Statistics};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::{Partitioning, PhysicalExpr};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::filter_pushdown::{FilterDescription, FilterPushdownPhase};
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
use datafusion::physical_plan::projection::{make_with_child, ProjectionExec};
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::statistics::{ChildStats, StatisticsArgs, StatisticsContext};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
};

use crate::SieveConfig;

/// Gives a partitioned hash join with a large build side more partitions
/// (see the module documentation); `sieve.join_wide_partitions = 0` turns
/// it off.
#[derive(Debug, Default)]
pub struct WidenLargeJoins;

impl PhysicalOptimizerRule for WidenLargeJoins {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let settings = SieveConfig::of(config);
        if settings.join_wide_partitions == 0 {
            return Ok(plan);
        }
        plan.transform_up(|node| {
            let Some(join) = node.downcast_ref::<HashJoinExec>() else {
                return Ok(Transformed::no(node));
            };
            match widened(
                join,
                settings.join_wide_partitions,
                settings.join_wide_build_rows,
            )? {
                Some(widened) => Ok(Transformed::yes(widened)),
                None => Ok(Transformed::no(node)),
            }
        })
        .map(|transformed| transformed.data)
    }

    fn name(&self) -> &str {
        "sieve_widen_large_joins"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// `join` over `wide` partitions (rounded up to a multiple of its own)
/// under a [`MergePartitionsExec`], if it is a partitioned join over two
/// hash repartitions whose build side is estimated at `rows_min` rows per
/// partition or more.
fn widened(
    join: &HashJoinExec,
    wide: usize,
    rows_min: usize,
) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    if *join.partition_mode() != PartitionMode::Partitioned
        || join.null_aware
        || join.fetch().is_some()
    {
        return Ok(None);
    }
    let n = join.properties().output_partitioning().partition_count();
    if n == 0 {
        return Ok(None);
    }
    let wide = wide.div_ceil(n) * n;
    if wide <= n {
        return Ok(None);
    }
    let (Some(build), Some(probe)) = (
        hash_partitioned(join.left(), n, wide),
        hash_partitioned(join.right(), n, wide),
    ) else {
        return Ok(None);
    };
    let Some(rows) = estimated_rows(join.left()) else {
        return Ok(None);
    };
    if rows / n < rows_min {
        return Ok(None);
    }
    let build = build.over(wide)?;
    let probe = probe.over(wide)?;
    let join = join
        .builder()
        .recompute_properties()
        .with_new_children(vec![build, probe])?
        .build()?;
    Ok(Some(Arc::new(MergePartitionsExec::try_new(
        Arc::new(join),
        n,
    )?)))
}

/// A join input hash partitioned into `n` partitions, as it can be had
/// over `wide`.
enum HashPartitioned {
    /// A repartition by hash that keeps no order: its input and
    /// expressions.
    Repartition(Arc<dyn ExecutionPlan>, Vec<Arc<dyn PhysicalExpr>>),
    /// A join already over `wide` partitions, merged into `n` (a join
    /// below on the same keys), perhaps under a projection: taken as it
    /// is, unmerged.
    Merged(Arc<dyn ExecutionPlan>),
}

impl HashPartitioned {
    fn over(self, wide: usize) -> Result<Arc<dyn ExecutionPlan>> {
        Ok(match self {
            HashPartitioned::Repartition(input, exprs) => Arc::new(RepartitionExec::try_new(
                input,
                Partitioning::Hash(exprs, wide),
            )?),
            HashPartitioned::Merged(input) => input,
        })
    }
}

/// How `plan`, hash partitioned into `n`, can be had over `wide`, if it can.
fn hash_partitioned(
    plan: &Arc<dyn ExecutionPlan>,
    n: usize,
    wide: usize,
) -> Option<HashPartitioned> {
    // The merge's hash partitioning over `n` (through a projection that
    // keeps its columns) met the join's requirement; its input's is the
    // same over `wide`.
    let unmerged: Option<Arc<dyn ExecutionPlan>> =
        if let Some(merge) = plan.downcast_ref::<MergePartitionsExec>() {
            Some(Arc::clone(merge.input()))
        } else if let Some(projection) = plan.downcast_ref::<ProjectionExec>() {
            match projection.input().downcast_ref::<MergePartitionsExec>() {
                Some(merge) => make_with_child(projection, merge.input()).ok(),
                None => None,
            }
        } else {
            None
        };
    if let Some(unmerged) = unmerged {
        return match (plan.output_partitioning(), unmerged.output_partitioning()) {
            (Partitioning::Hash(_, count), Partitioning::Hash(_, input_count))
                if *count == n && *input_count == wide =>
            {
                Some(HashPartitioned::Merged(unmerged))
            }
            _ => None,
        };
    }
    let repartition = plan.downcast_ref::<RepartitionExec>()?;
    if repartition.preserve_order() {
        return None;
    }
    match repartition.partitioning() {
        Partitioning::Hash(exprs, count) if *count == n => Some(HashPartitioned::Repartition(
            Arc::clone(repartition.input()),
            exprs.clone(),
        )),
        _ => None,
    }
}

/// The rows `plan` is estimated to return: from its statistics, or where
/// they do not say (a join's output), from Sieve's estimate through inner
/// joins (`join_sides`).
fn estimated_rows(plan: &Arc<dyn ExecutionPlan>) -> Option<usize> {
    let statistics = StatisticsContext::new()
        .compute(plan.as_ref(), &StatisticsArgs::new())
        .ok();
    if let Some(rows) = statistics.and_then(|statistics| statistics.num_rows.get_value().copied()) {
        return Some(rows);
    }
    crate::join_sides::estimated_rows(plan).map(|estimate| estimate.rows as usize)
}

/// Merges the `N` partitions of its input into `n` (`N` a multiple of `n`):
/// output partition `j` reads input partitions `j, j + n, j + 2n, ...` as
/// their rows come. A hash partitioning over `N` becomes the same hash
/// partitioning over `n` (DataFusion's repartition takes `hash % N`, and
/// `hash % N % n = hash % n`).
#[derive(Debug)]
pub struct MergePartitionsExec {
    input: Arc<dyn ExecutionPlan>,
    partitions: usize,
    properties: Arc<PlanProperties>,
}

impl MergePartitionsExec {
    /// `input`'s partitions merged into `partitions`, which must divide
    /// their number.
    pub fn try_new(input: Arc<dyn ExecutionPlan>, partitions: usize) -> Result<Self> {
        let input_partitions = input.output_partitioning().partition_count();
        if partitions == 0 || !input_partitions.is_multiple_of(partitions) {
            return internal_err!(
                "MergePartitionsExec: {input_partitions} partitions cannot merge into {partitions}"
            );
        }
        let partitioning = match input.output_partitioning() {
            Partitioning::Hash(exprs, _) => Partitioning::Hash(exprs.clone(), partitions),
            _ => Partitioning::UnknownPartitioning(partitions),
        };
        // Rows of several partitions interleave: no order survives.
        let mut equivalence = input.equivalence_properties().clone();
        equivalence.clear_orderings();
        equivalence.clear_per_partition_constants();
        let properties = PlanProperties::new(
            equivalence,
            partitioning,
            input.pipeline_behavior(),
            input.boundedness(),
        )
        .with_evaluation_type(input.properties().evaluation_type)
        .with_scheduling_type(input.properties().scheduling_type);
        Ok(Self {
            input,
            partitions,
            properties: Arc::new(properties),
        })
    }

    /// What it merges.
    pub fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.input
    }
}

impl DisplayAs for MergePartitionsExec {
    fn fmt_as(&self, _format: DisplayFormatType, formatter: &mut fmt::Formatter) -> fmt::Result {
        write!(
            formatter,
            "MergePartitionsExec: {} partitions into {}",
            self.input.output_partitioning().partition_count(),
            self.partitions
        )
    }
}

impl ExecutionPlan for MergePartitionsExec {
    fn name(&self) -> &str {
        "MergePartitionsExec"
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
        vec![&self.input]
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
        let [input] = &children[..] else {
            return internal_err!("MergePartitionsExec has one child");
        };
        Ok(Arc::new(Self::try_new(Arc::clone(input), self.partitions)?))
    }

    /// Filters from above (a join's dynamic filter on its probe side) go
    /// through to the join below, as through DataFusion's own repartitions
    /// and coalesces: without this, TPC-H Q18's semi join filtered neither
    /// orders nor lineitem and shipped 362 MB instead of 0.28 MB at SF 10.
    fn gather_filters_for_pushdown(
        &self,
        _phase: FilterPushdownPhase,
        parent_filters: Vec<Arc<dyn PhysicalExpr>>,
        _config: &ConfigOptions,
    ) -> Result<FilterDescription> {
        FilterDescription::from_children(parent_filters, &self.children())
    }

    /// A projection that narrows the rows goes below, as below DataFusion's
    /// coalesce, so that it can reach the join (which then builds only the
    /// columns it outputs).
    fn try_swapping_with_projection(
        &self,
        projection: &ProjectionExec,
    ) -> Result<Option<Arc<dyn ExecutionPlan>>> {
        if projection.expr().len() >= projection.input().schema().fields().len() {
            return Ok(None);
        }
        let input = make_with_child(projection, &self.input)?;
        Ok(Some(Arc::new(Self::try_new(input, self.partitions)?)))
    }

    fn child_stats_requests(&self, _partition: Option<usize>) -> Vec<ChildStats> {
        vec![ChildStats::At(None)]
    }

    fn statistics_from_inputs(
        &self,
        input_stats: &[Arc<Statistics>],
        args: &StatisticsArgs,
    ) -> Result<Arc<Statistics>> {
        match args.partition() {
            None => Ok(Arc::clone(&input_stats[0])),
            Some(_) => Ok(Arc::new(Statistics::new_unknown(&self.schema()))),
        }
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        if partition >= self.partitions {
            return internal_err!(
                "MergePartitionsExec: partition {partition} of {}",
                self.partitions
            );
        }
        let input_partitions = self.input.output_partitioning().partition_count();
        let streams = (partition..input_partitions)
            .step_by(self.partitions)
            .map(|input| self.input.execute(input, Arc::clone(&context)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.schema(),
            futures::stream::select_all(streams),
        )))
    }
}
