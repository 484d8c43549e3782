//! NDP off's exact filter, kept from pruning where statistics lie.
//!
//! NDP off is stock DataFusion reading the slices by byte range. DataFusion's
//! filter pushdown hands the `FilterExec` above the scan to the Parquet
//! source, which prunes row groups and pages by min/max statistics; Parquet
//! leaves NaN out of those, so a conjunct over a float column (`x > 100`,
//! `x = 'NaN'`) would drop NaN rows that match (see
//! `sieve_fragment::pruning_predicate`, which the storage nodes' coarse
//! stage uses). Such conjuncts are wrapped in a [`PruningOpaqueExpr`]:
//! evaluated as they are, but an expression DataFusion's pruning does not
//! know, so it never prunes by it.
//!
//! Filters pushed into the scan from above (a hash join's dynamic filter
//! on its probe side) over a float column stop at a
//! [`FloatFilterGuardExec`] instead: DataFusion 55's Parquet scan, given
//! the dynamic filter of a join on a float key, loses the probe rows of
//! -0.0 when the build side holds 0.0 (a join matches the two; the fuzzer
//! found it). The join still matches exactly without the filter.

use std::fmt;
use std::hash::Hash;
use std::sync::Arc;

use arrow::datatypes::{DataType, Schema};
use arrow::record_batch::RecordBatch;
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{internal_err, Result, Statistics};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::ColumnarValue;
use datafusion::physical_expr::{conjunction, split_conjunction, PhysicalExpr};
use datafusion::physical_plan::filter_pushdown::{
    ChildFilterDescription, FilterDescription, FilterPushdownPhase,
};
use datafusion::physical_plan::statistics::{ChildStats, StatisticsArgs};
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use sieve_fragment::reads_float_column;

/// Evaluates `inner` unchanged; opaque to statistics pruning.
#[derive(Debug, Eq)]
pub(crate) struct PruningOpaqueExpr {
    inner: Arc<dyn PhysicalExpr>,
}

impl PruningOpaqueExpr {
    /// `inner`, opaque to DataFusion's analyses (pruning, equivalences,
    /// intervals); see also [`crate::signed_zero`].
    pub(crate) fn over(inner: Arc<dyn PhysicalExpr>) -> Arc<dyn PhysicalExpr> {
        Arc::new(Self { inner })
    }
}

impl Hash for PruningOpaqueExpr {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.inner.as_ref().hash(state);
    }
}

impl PartialEq for PruningOpaqueExpr {
    fn eq(&self, other: &Self) -> bool {
        self.inner.as_ref() == other.inner.as_ref()
    }
}

impl fmt::Display for PruningOpaqueExpr {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "{}", self.inner)
    }
}

impl PhysicalExpr for PruningOpaqueExpr {
    fn data_type(&self, input_schema: &Schema) -> Result<DataType> {
        self.inner.data_type(input_schema)
    }

    fn nullable(&self, input_schema: &Schema) -> Result<bool> {
        self.inner.nullable(input_schema)
    }

    fn evaluate(&self, batch: &RecordBatch) -> Result<ColumnarValue> {
        self.inner.evaluate(batch)
    }

    fn children(&self) -> Vec<&Arc<dyn PhysicalExpr>> {
        vec![&self.inner]
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn PhysicalExpr>>,
    ) -> Result<Arc<dyn PhysicalExpr>> {
        let [inner] = <[Arc<dyn PhysicalExpr>; 1]>::try_from(children).or_else(|children| {
            internal_err!("PruningOpaqueExpr has one child, got {}", children.len())
        })?;
        Ok(Arc::new(Self { inner }))
    }

    fn fmt_sql(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt_sql(formatter)
    }
}

/// `predicate` (over `schema`) with every conjunct that reads a float column
/// made opaque to pruning.
pub(crate) fn nan_safe(predicate: Arc<dyn PhysicalExpr>, schema: &Schema) -> Arc<dyn PhysicalExpr> {
    let reads_float = |expr: &Arc<dyn PhysicalExpr>| reads_float_column(expr, schema);
    let conjuncts = split_conjunction(&predicate);
    if !conjuncts.iter().any(|conjunct| reads_float(conjunct)) {
        return predicate;
    }
    conjunction(conjuncts.into_iter().map(|conjunct| {
        if reads_float(conjunct) {
            Arc::new(PruningOpaqueExpr {
                inner: Arc::clone(conjunct),
            }) as Arc<dyn PhysicalExpr>
        } else {
            Arc::clone(conjunct)
        }
    }))
}

/// NDP off's Parquet scan, taking filters pushed from above only where they
/// read no float column (see the module's documentation); it is the scan
/// in every other way.
#[derive(Debug)]
pub(crate) struct FloatFilterGuardExec {
    input: Arc<dyn ExecutionPlan>,
}

impl FloatFilterGuardExec {
    /// `scan`, guarded where its output has a float column.
    pub(crate) fn over(scan: Arc<dyn ExecutionPlan>) -> Arc<dyn ExecutionPlan> {
        if scan
            .schema()
            .fields()
            .iter()
            .any(|field| field.data_type().is_floating())
        {
            Arc::new(Self { input: scan })
        } else {
            scan
        }
    }
}

impl DisplayAs for FloatFilterGuardExec {
    fn fmt_as(&self, _format: DisplayFormatType, formatter: &mut fmt::Formatter) -> fmt::Result {
        write!(
            formatter,
            "FloatFilterGuardExec: no filter from above on a float column"
        )
    }
}

impl ExecutionPlan for FloatFilterGuardExec {
    fn name(&self) -> &str {
        "FloatFilterGuardExec"
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
            return internal_err!("FloatFilterGuardExec has one child");
        };
        Ok(Arc::new(Self {
            input: Arc::clone(input),
        }))
    }

    /// Filters that read no float column go through to the scan; the
    /// others stay above it.
    fn gather_filters_for_pushdown(
        &self,
        _phase: FilterPushdownPhase,
        parent_filters: Vec<Arc<dyn PhysicalExpr>>,
        _config: &ConfigOptions,
    ) -> Result<FilterDescription> {
        let schema = self.input.schema();
        let not_float = schema
            .fields()
            .iter()
            .enumerate()
            .filter(|(_, field)| !field.data_type().is_floating())
            .map(|(index, _)| index)
            .collect();
        Ok(FilterDescription::new().with_child(
            ChildFilterDescription::from_child_with_allowed_indices(
                &parent_filters,
                not_float,
                &self.input,
            )?,
        ))
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
