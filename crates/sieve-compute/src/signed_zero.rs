//! Sorts over floats that compare equal and sort apart (-0.0 and 0.0).
//!
//! SQL's `=` holds between -0.0 and 0.0 (DataFusion 55's filters and hash
//! joins match the two), but ORDER BY puts -0.0 first (IEEE total order).
//! DataFusion 55's equivalence properties read a filter's `x = 0.0` as "x
//! is one constant value" and an inner join's `a.x = b.y` as "a.x and b.y
//! are the same value", and `EnsureRequirements` then drops the "constant"
//! or "duplicate" key from a sort: `WHERE x = 0.0 ORDER BY x, id` sorts by
//! `id` alone, `... ON a.x = b.y ORDER BY a.x, b.y, id` by `a.x, id`. Over
//! both zeros that is a wrong order, and a wrong row under LIMIT, in plain
//! DataFusion too (`docs/results/2026-11-28-issue20-part22.md`).
//!
//! [`KeepFloatEqualitiesApart`] runs right before `EnsureRequirements` and
//! wraps each such operator (a filter, an inner hash or sort-merge join) in a [`FloatEqualityExec`], whose equivalence
//! properties are the operator's without those equalities (a filter's
//! float equality made opaque to DataFusion's analysis, a join's float key
//! pairs left out); [`UnwrapFloatEqualities`] right after takes the
//! wrappers out again, so no other rule meets them. Equalities with a
//! literal that is neither zero nor NaN stay: every row that passes them
//! holds that one value.
//!
//! DataFusion 55's IN list compares floats bit for bit past the few items
//! it rewrites to `=`s: `x IN (0.0, 1.0)` matched -0.0 and `x IN (0.0,
//! 1.0, 5.0, 6.0, 7.0)` did not. [`FloatInListsMatchBothZeros`] (a logical
//! rule, after DataFusion's) gives a float IN list holding one zero the
//! other one too, so that `x IN (...)` is `x = ... OR ...` for every list.
//!
//! DataFusion 55's GROUP BY puts -0.0 and 0.0 in one group and gives its
//! key as 0.0. Sieve's rewrites that take a group column's value from a
//! table row instead of from the aggregation (an aggregation before a join,
//! group columns joined late) pass it through [`group_value`], which does
//! the same.

use std::fmt;
use std::sync::Arc;

use arrow::datatypes::{DataType, Schema};
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{internal_err, JoinSide, JoinType, Result, ScalarValue, Statistics};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::expr::InList;
use datafusion::logical_expr::{lit, when, Expr, LogicalPlan, Operator};
use datafusion::optimizer::{OptimizerConfig, OptimizerRule};
use datafusion::physical_expr::equivalence::{join_equivalence_properties, ProjectionMapping};
use datafusion::physical_expr::expressions::{BinaryExpr, Literal};
use datafusion::physical_expr::{conjunction, split_conjunction, PhysicalExpr};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::filter::{FilterExec, FilterExecBuilder};
use datafusion::physical_plan::joins::utils::{build_join_schema, JoinOnRef};
use datafusion::physical_plan::joins::{HashJoinExec, SortMergeJoinExec};
use datafusion::physical_plan::statistics::{ChildStats, StatisticsArgs};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
};

use crate::nan_safe::PruningOpaqueExpr;

/// Float IN lists with one zero get the other (see the module
/// documentation).
#[derive(Debug, Default)]
pub struct FloatInListsMatchBothZeros;

impl OptimizerRule for FloatInListsMatchBothZeros {
    fn name(&self) -> &str {
        "sieve_float_in_lists_match_both_zeros"
    }

    fn supports_rewrite(&self) -> bool {
        true
    }

    fn rewrite(
        &self,
        plan: LogicalPlan,
        _config: &dyn OptimizerConfig,
    ) -> Result<Transformed<LogicalPlan>> {
        plan.transform_up_with_subqueries(|node| {
            node.map_expressions(|expr| expr.transform_up(with_both_zeros))
        })
    }
}

/// `expr`, if a float IN list with one zero, with the other one too.
fn with_both_zeros(expr: Expr) -> Result<Transformed<Expr>> {
    let Expr::InList(InList {
        expr: tested,
        mut list,
        negated,
    }) = expr
    else {
        return Ok(Transformed::no(expr));
    };
    let bits = |item: &Expr| match item {
        Expr::Literal(ScalarValue::Float64(Some(value)), _) => Some(value.to_bits()),
        Expr::Literal(ScalarValue::Float32(Some(value)), _) => Some(u64::from(value.to_bits())),
        _ => None,
    };
    let present: Vec<u64> = list.iter().filter_map(bits).collect();
    let mut missing = Vec::new();
    for item in &list {
        let other = match item {
            Expr::Literal(ScalarValue::Float64(Some(value)), _) if *value == 0.0 => {
                ScalarValue::Float64(Some(-value))
            }
            Expr::Literal(ScalarValue::Float32(Some(value)), _) if *value == 0.0 => {
                ScalarValue::Float32(Some(-value))
            }
            _ => continue,
        };
        let other = lit(other);
        if bits(&other).is_some_and(|other| !present.contains(&other)) && !missing.contains(&other)
        {
            missing.push(other);
        }
    }
    let changed = !missing.is_empty();
    list.extend(missing);
    let expr = Expr::InList(InList {
        expr: tested,
        list,
        negated,
    });
    Ok(if changed {
        Transformed::yes(expr)
    } else {
        Transformed::no(expr)
    })
}

/// A group column's value `expr` of type `data_type` as DataFusion's
/// GROUP BY gives it: a float's -0.0 as 0.0 (`CASE WHEN x = 0 THEN 0 ELSE
/// x END`: `=` holds for both zeros; NULL and NaN stay as they are). `None`
/// for a type holding floats inside (a list, struct, map or dictionary of
/// floats), which DataFusion canonicalizes too and an expression here
/// cannot: the caller leaves its plan as it is.
pub(crate) fn group_value(expr: Expr, data_type: &DataType) -> Option<Expr> {
    if !data_type.is_floating() {
        return (!floats_inside(data_type)).then_some(expr);
    }
    let zero = ScalarValue::new_zero(data_type).ok()?;
    when(expr.clone().eq(lit(zero.clone())), lit(zero))
        .otherwise(expr)
        .ok()
}

/// Whether `data_type` holds floats inside (not a float itself): a group
/// column [`group_value`] cannot give as DataFusion's GROUP BY does.
pub(crate) fn floats_inside(data_type: &DataType) -> bool {
    !data_type.is_floating() && holds_floats(data_type)
}

/// Whether values of `data_type` hold floats anywhere.
fn holds_floats(data_type: &DataType) -> bool {
    match data_type {
        DataType::Float16 | DataType::Float32 | DataType::Float64 => true,
        DataType::List(field)
        | DataType::LargeList(field)
        | DataType::ListView(field)
        | DataType::LargeListView(field)
        | DataType::FixedSizeList(field, _)
        | DataType::Map(field, _) => holds_floats(field.data_type()),
        DataType::Struct(fields) => fields.iter().any(|field| holds_floats(field.data_type())),
        DataType::Union(fields, _) => fields
            .iter()
            .any(|(_, field)| holds_floats(field.data_type())),
        DataType::Dictionary(_, value) => holds_floats(value),
        DataType::RunEndEncoded(_, values) => holds_floats(values.data_type()),
        _ => false,
    }
}

/// Wraps the filters and inner hash and sort-merge joins whose float equalities DataFusion
/// would take for value identities (see the module documentation).
#[derive(Debug, Default)]
pub struct KeepFloatEqualitiesApart;

impl PhysicalOptimizerRule for KeepFloatEqualitiesApart {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| match FloatEqualityExec::over(&node)? {
            Some(wrapped) => Ok(Transformed::yes(wrapped)),
            None => Ok(Transformed::no(node)),
        })
        .map(|transformed| transformed.data)
    }

    fn name(&self) -> &str {
        "KeepFloatEqualitiesApart"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// Takes out the [`FloatEqualityExec`]s once `EnsureRequirements` has
/// placed the sorts.
#[derive(Debug, Default)]
pub struct UnwrapFloatEqualities;

impl PhysicalOptimizerRule for UnwrapFloatEqualities {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| match node.downcast_ref::<FloatEqualityExec>() {
            Some(wrapper) => Ok(Transformed::yes(Arc::clone(&wrapper.input))),
            None => Ok(Transformed::no(node)),
        })
        .map(|transformed| transformed.data)
    }

    fn name(&self) -> &str {
        "UnwrapFloatEqualities"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// Whether `expr = other` (over `schema`) may hold for rows whose `expr`
/// values differ: `expr` is a float and `other` anything but a literal
/// that is neither zero nor NaN.
fn equality_spans_values(
    expr: &Arc<dyn PhysicalExpr>,
    other: &Arc<dyn PhysicalExpr>,
    schema: &Schema,
) -> bool {
    let float = expr
        .data_type(schema)
        .map(|data_type| data_type.is_floating())
        .unwrap_or(true);
    if !float {
        return false;
    }
    let one_value = other.downcast_ref::<Literal>().is_some_and(|literal| {
        match literal.value() {
            ScalarValue::Float16(Some(value)) => {
                let value = f32::from(*value);
                value != 0.0 && !value.is_nan()
            }
            ScalarValue::Float32(Some(value)) => *value != 0.0 && !value.is_nan(),
            ScalarValue::Float64(Some(value)) => *value != 0.0 && !value.is_nan(),
            // A NULL literal passes no row.
            value => value.is_null(),
        }
    });
    !one_value
}

/// Whether `conjunct` is an equality DataFusion would take for a value
/// identity that does not hold.
fn is_float_equality(conjunct: &Arc<dyn PhysicalExpr>, schema: &Schema) -> bool {
    let Some(binary) = conjunct.downcast_ref::<BinaryExpr>() else {
        return false;
    };
    binary.op() == &Operator::Eq
        && (equality_spans_values(binary.left(), binary.right(), schema)
            || equality_spans_values(binary.right(), binary.left(), schema))
}

/// A filter or an inner hash or sort-merge join, reporting the equivalence properties it
/// has without its float equalities; present only while
/// `EnsureRequirements` runs.
#[derive(Debug)]
pub struct FloatEqualityExec {
    input: Arc<dyn ExecutionPlan>,
    properties: Arc<PlanProperties>,
}

impl FloatEqualityExec {
    /// `plan` wrapped, if it is a filter or an inner hash or sort-merge
    /// join with a float equality.
    fn over(plan: &Arc<dyn ExecutionPlan>) -> Result<Option<Arc<dyn ExecutionPlan>>> {
        let properties = if let Some(filter) = plan.downcast_ref::<FilterExec>() {
            filter_properties(filter)?
        } else if let Some(join) = plan.downcast_ref::<HashJoinExec>() {
            join_properties(
                JoinParts {
                    left: &join.left,
                    right: &join.right,
                    on: &join.on,
                    join_type: join.join_type,
                    probe_side: HashJoinExec::probe_side(),
                    projection: join.projection.as_deref(),
                },
                plan,
            )?
        } else if let Some(join) = plan.downcast_ref::<SortMergeJoinExec>() {
            join_properties(
                JoinParts {
                    left: join.left(),
                    right: join.right(),
                    on: join.on(),
                    join_type: join.join_type(),
                    probe_side: SortMergeJoinExec::probe_side(&join.join_type()),
                    projection: None,
                },
                plan,
            )?
        } else {
            None
        };
        Ok(properties.map(|properties| {
            Arc::new(Self {
                input: Arc::clone(plan),
                properties: Arc::new(properties),
            }) as _
        }))
    }
}

/// The properties of `filter` with its float equalities opaque, if it has
/// one.
fn filter_properties(filter: &FilterExec) -> Result<Option<PlanProperties>> {
    let schema = filter.input().schema();
    let conjuncts = split_conjunction(filter.predicate());
    if !conjuncts
        .iter()
        .any(|conjunct| is_float_equality(conjunct, &schema))
    {
        return Ok(None);
    }
    let predicate = conjunction(conjuncts.into_iter().map(|conjunct| {
        if is_float_equality(conjunct, &schema) {
            PruningOpaqueExpr::over(Arc::clone(conjunct))
        } else {
            Arc::clone(conjunct)
        }
    }));
    let shadow = FilterExecBuilder::new(predicate, Arc::clone(filter.input()))
        .with_default_selectivity(filter.default_selectivity())
        .apply_projection_by_ref(filter.projection().as_ref())?
        .build()?;
    Ok(Some(shadow.properties().as_ref().clone()))
}

/// What the equivalence properties of a hash or sort-merge join are made
/// of.
struct JoinParts<'a> {
    left: &'a Arc<dyn ExecutionPlan>,
    right: &'a Arc<dyn ExecutionPlan>,
    on: JoinOnRef<'a>,
    join_type: JoinType,
    probe_side: JoinSide,
    projection: Option<&'a [usize]>,
}

/// The properties of an inner `join` (the operator `plan`) without its
/// float key pairs, if it has one.
fn join_properties(
    join: JoinParts,
    plan: &Arc<dyn ExecutionPlan>,
) -> Result<Option<PlanProperties>> {
    if join.join_type != JoinType::Inner {
        return Ok(None);
    }
    let left = join.left.schema();
    let right = join.right.schema();
    let exact = |(l, r): &&(Arc<dyn PhysicalExpr>, Arc<dyn PhysicalExpr>)| {
        !equality_spans_values(l, r, &left) && !equality_spans_values(r, l, &right)
    };
    let on: Vec<_> = join.on.iter().filter(exact).cloned().collect();
    if on.len() == join.on.len() {
        return Ok(None);
    }
    let (schema, _) = build_join_schema(&left, &right, &join.join_type);
    let schema = Arc::new(schema);
    let mut equivalences = join_equivalence_properties(
        join.left.equivalence_properties().clone(),
        join.right.equivalence_properties().clone(),
        &join.join_type,
        Arc::clone(&schema),
        &plan.maintains_input_order(),
        Some(join.probe_side),
        &on,
    )?;
    if let Some(projection) = join.projection {
        let mapping = ProjectionMapping::from_indices(projection, &schema)?;
        equivalences = equivalences.project(&mapping, plan.schema());
    }
    let own = plan.properties();
    Ok(Some(PlanProperties::new(
        equivalences,
        own.partitioning.clone(),
        own.emission_type,
        own.boundedness,
    )))
}

impl DisplayAs for FloatEqualityExec {
    fn fmt_as(&self, _format: DisplayFormatType, formatter: &mut fmt::Formatter) -> fmt::Result {
        write!(
            formatter,
            "FloatEqualityExec: float equalities are not value identities"
        )
    }
}

impl ExecutionPlan for FloatEqualityExec {
    fn name(&self) -> &str {
        "FloatEqualityExec"
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

    /// Not claimed, so that `EnsureRequirements` puts a sort above the
    /// wrapper (by its properties) rather than between it and the operator.
    fn maintains_input_order(&self) -> Vec<bool> {
        vec![false]
    }

    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        vec![false]
    }

    /// Rewrapped (with properties recomputed) where the new child still
    /// has a float equality; the child alone otherwise.
    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let [input] = &children[..] else {
            return internal_err!("FloatEqualityExec has one child");
        };
        Ok(Self::over(input)?.unwrap_or_else(|| Arc::clone(input)))
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{ArrayRef, Float64Array};
    use arrow::datatypes::{DataType, Field, Fields};
    use arrow::record_batch::RecordBatch;
    use datafusion::logical_expr::col;
    use datafusion::prelude::SessionContext;

    use super::{floats_inside, group_value};

    #[test]
    fn floats_inside_lists_structs_and_dictionaries_are_told() {
        let float = Arc::new(Field::new("item", DataType::Float64, true));
        assert!(floats_inside(&DataType::List(Arc::clone(&float))));
        assert!(floats_inside(&DataType::Struct(Fields::from(vec![
            Field::new("a", DataType::Int64, true),
            Field::new("b", DataType::Float32, true),
        ]))));
        assert!(floats_inside(&DataType::Dictionary(
            Box::new(DataType::Int32),
            Box::new(DataType::Float16)
        )));
        assert!(!floats_inside(&DataType::Float64));
        assert!(!floats_inside(&DataType::List(Arc::new(Field::new(
            "item",
            DataType::Int64,
            true
        )))));
        assert!(group_value(col("x"), &DataType::List(float)).is_none());
        assert_eq!(group_value(col("x"), &DataType::Utf8), Some(col("x")));
    }

    #[tokio::test]
    async fn a_group_value_folds_negative_zero_and_keeps_nulls_and_nans() {
        let context = SessionContext::new();
        let values = [Some(-0.0), Some(0.0), None, Some(f64::NAN), Some(-1.5)];
        for data_type in [DataType::Float64, DataType::Float32] {
            let doubles: ArrayRef = Arc::new(Float64Array::from(values.to_vec()));
            let x = arrow::compute::cast(&doubles, &data_type).unwrap();
            let frame = context
                .read_batch(RecordBatch::try_from_iter(vec![("x", x)]).unwrap())
                .unwrap();
            let folded = group_value(col("x"), &data_type).unwrap();
            let batches = frame.select(vec![folded]).unwrap().collect().await.unwrap();
            let column = arrow::compute::cast(batches[0].column(0), &DataType::Float64).unwrap();
            let column = column.as_any().downcast_ref::<Float64Array>().unwrap();
            let bits: Vec<Option<u64>> = column.iter().map(|v| v.map(f64::to_bits)).collect();
            let expected: Vec<Option<u64>> =
                [Some(0.0), Some(0.0), None, Some(f64::NAN), Some(-1.5)]
                    .iter()
                    .map(|v| v.map(f64::to_bits))
                    .collect();
            assert_eq!(bits, expected, "{data_type}");
        }
    }
}
