//! Sort-merge joins keep the columns their filter reads.
//!
//! DataFusion 55's `SortMergeJoinExec::try_swapping_with_projection`
//! pushes a projection above the join into its inputs by the join keys and
//! the projected columns only: a join filter's columns (`ON a.k = b.k AND
//! a.id <> b.id`) are projected away below it, and the filter then reads
//! other columns. With `datafusion.optimizer.prefer_hash_join = false` a
//! query counted 0 rows where there are 717 (reproduced with DataFusion
//! alone). [`GuardMergeJoinFilters`], right before each of DataFusion's
//! `ProjectionPushdown` passes, puts a [`ProjectionBarrierExec`] over each
//! sort-merge join with a filter; [`UnguardMergeJoinFilters`], right after,
//! takes it away. A projection stays above the join, which reads its
//! inputs whole.
//!
//! The same joins also failed on outer joins: `a LEFT JOIN b ON a.k = b.k
//! AND a.id <> b.id` stopped with "Column 'id' is declared as non-nullable
//! but contains null values" (reproduced with DataFusion alone). The
//! join evaluates its filter over the left rows padded with NULL for `b`,
//! in a batch of the filter's schema, which keeps the inputs' nullability.
//! [`NullableMergeJoinFilters`], after DataFusion's rules, gives each
//! sort-merge join's filter a schema whose columns are all nullable.

use std::fmt;
use std::sync::Arc;

use datafusion::arrow::datatypes::Schema;
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{internal_err, Result, Statistics};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::joins::utils::JoinFilter;
use datafusion::physical_plan::joins::SortMergeJoinExec;
use datafusion::physical_plan::statistics::{ChildStats, StatisticsArgs};
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};

/// Puts a barrier over each sort-merge join with a filter (see the module
/// documentation).
#[derive(Debug, Default)]
pub struct GuardMergeJoinFilters;

impl PhysicalOptimizerRule for GuardMergeJoinFilters {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| {
            let filtered = node
                .downcast_ref::<SortMergeJoinExec>()
                .is_some_and(|join| join.filter().is_some());
            Ok(if filtered {
                Transformed::yes(Arc::new(ProjectionBarrierExec { input: node }) as _)
            } else {
                Transformed::no(node)
            })
        })
        .map(|transformed| transformed.data)
    }

    fn name(&self) -> &str {
        "GuardMergeJoinFilters"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// Takes the barriers away.
#[derive(Debug, Default)]
pub struct UnguardMergeJoinFilters;

impl PhysicalOptimizerRule for UnguardMergeJoinFilters {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| match node.downcast_ref::<ProjectionBarrierExec>() {
            Some(barrier) => Ok(Transformed::yes(Arc::clone(&barrier.input))),
            None => Ok(Transformed::no(node)),
        })
        .map(|transformed| transformed.data)
    }

    fn name(&self) -> &str {
        "UnguardMergeJoinFilters"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// Makes each sort-merge join filter's columns nullable (see the module
/// documentation).
#[derive(Debug, Default)]
pub struct NullableMergeJoinFilters;

impl PhysicalOptimizerRule for NullableMergeJoinFilters {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| {
            let Some(join) = node.downcast_ref::<SortMergeJoinExec>() else {
                return Ok(Transformed::no(node));
            };
            let Some(filter) = join.filter() else {
                return Ok(Transformed::no(node));
            };
            let schema = filter.schema();
            if schema.fields().iter().all(|field| field.is_nullable()) {
                return Ok(Transformed::no(node));
            }
            let nullable = Schema::new_with_metadata(
                schema
                    .fields()
                    .iter()
                    .map(|field| field.as_ref().clone().with_nullable(true))
                    .collect::<Vec<_>>(),
                schema.metadata().clone(),
            );
            let mut join = join.clone();
            join.filter = Some(JoinFilter::new(
                Arc::clone(filter.expression()),
                filter.column_indices().to_vec(),
                Arc::new(nullable),
            ));
            Ok(Transformed::yes(Arc::new(join) as _))
        })
        .map(|transformed| transformed.data)
    }

    fn name(&self) -> &str {
        "NullableMergeJoinFilters"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// Its input, through which no projection is pushed.
#[derive(Debug)]
pub struct ProjectionBarrierExec {
    input: Arc<dyn ExecutionPlan>,
}

impl DisplayAs for ProjectionBarrierExec {
    fn fmt_as(&self, _format: DisplayFormatType, formatter: &mut fmt::Formatter) -> fmt::Result {
        write!(formatter, "ProjectionBarrierExec")
    }
}

impl ExecutionPlan for ProjectionBarrierExec {
    fn name(&self) -> &str {
        "ProjectionBarrierExec"
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
            return internal_err!("ProjectionBarrierExec has one child");
        };
        Ok(Arc::new(Self {
            input: Arc::clone(input),
        }))
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
        self.input.execute(partition, context)
    }
}
