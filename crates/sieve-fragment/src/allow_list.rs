//! The explicit allow-list of what a storage node will evaluate.
//!
//! Only deterministic, side-effect-free expressions over flat columns are
//! allowed. The list is closed: an expression kind not named here is refused,
//! whatever it is.

use std::sync::Arc;

use arrow::datatypes::{DataType, Schema};
use datafusion::common::{plan_err, JoinType, NullEquality, Result};
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::datasource::source::DataSourceExec;
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::expressions::{
    BinaryExpr, CaseExpr, CastExpr, Column, InListExpr, IsNotNullExpr, IsNullExpr, LikeExpr,
    Literal, NegativeExpr, NotExpr, TryCastExpr,
};
use datafusion::physical_expr::{PhysicalExpr, ScalarFunctionExpr};
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::ExecutionPlan;

use crate::limits::check_expression_limits;
use crate::{BloomFilterExpr, KeyBitmapExpr, SliceInputExec};

/// Aggregate functions a storage node runs as a partial aggregation. Each is
/// deterministic, and its partial state merges exactly on the compute node,
/// whichever slices and in whichever order the states come from.
pub const ALLOWED_AGGREGATES: &[&str] = &[
    "avg",
    "bit_and",
    "bit_or",
    "bit_xor",
    "bool_and",
    "bool_or",
    "count",
    "max",
    "mean",
    "min",
    "stddev",
    "stddev_pop",
    "sum",
    "var",
    "var_pop",
    "var_samp",
];

/// Built-in scalar functions a storage node evaluates. All are deterministic
/// and pure; `random()`, `now()` and user-defined functions are not here.
pub const ALLOWED_FUNCTIONS: &[&str] = &[
    "abs",
    "btrim",
    "ceil",
    "char_length",
    "character_length",
    "coalesce",
    "date_part",
    "date_trunc",
    "ends_with",
    "floor",
    "left",
    "length",
    "lower",
    "ltrim",
    "nullif",
    "right",
    "round",
    "rtrim",
    "starts_with",
    "strpos",
    "substr",
    "substring",
    "trim",
    "upper",
];

/// Whether values of `data_type` may appear in a fragment.
pub fn is_allowed_type(data_type: &DataType) -> bool {
    use DataType::*;
    matches!(
        data_type,
        Null | Boolean
            | Int8
            | Int16
            | Int32
            | Int64
            | UInt8
            | UInt16
            | UInt32
            | UInt64
            | Float32
            | Float64
            | Decimal128(_, _)
            | Decimal256(_, _)
            | Utf8
            | LargeUtf8
            | Utf8View
            | Binary
            | LargeBinary
            | BinaryView
            | FixedSizeBinary(_)
            | Date32
            | Date64
            | Timestamp(_, _)
            | Interval(_)
    )
}

fn is_allowed_operator(operator: &Operator) -> bool {
    use Operator::*;
    matches!(
        operator,
        Eq | NotEq
            | Lt
            | LtEq
            | Gt
            | GtEq
            | And
            | Or
            | Plus
            | Minus
            | Multiply
            | Divide
            | Modulo
            | IsDistinctFrom
            | IsNotDistinctFrom
            | LikeMatch
            | ILikeMatch
            | NotLikeMatch
            | NotILikeMatch
    )
}

/// Check that `expr`, evaluated against `schema`, is within the limits of
/// [`crate::limits`] (measured without recursion) and uses only
/// allow-listed expression kinds, operators, types and functions. The error
/// names the first thing refused.
pub fn check_allowed(expr: &Arc<dyn PhysicalExpr>, schema: &Schema) -> Result<()> {
    check_expression_limits(expr)?;
    check_columns(expr, schema)?;
    check_allowed_within_limits(expr, schema)
}

/// Every column of `expr` names a field of `schema` by index and name.
/// Checked first, without recursion: computing a type looks fields up by
/// index, and an index past the schema's end panics in Arrow.
fn check_columns(expr: &Arc<dyn PhysicalExpr>, schema: &Schema) -> Result<()> {
    let mut stack = vec![expr];
    while let Some(node) = stack.pop() {
        if let Some(column) = node.downcast_ref::<Column>() {
            if column.index() >= schema.fields().len()
                || schema.field(column.index()).name() != column.name()
            {
                return plan_err!("column {column} does not exist in the table schema");
            }
        }
        stack.extend(node.children());
    }
    Ok(())
}

/// [`check_allowed`] on a tree already known to be within the limits: its
/// recursion is at most [`crate::EXPRESSION_DEPTH_MAX`] deep.
fn check_allowed_within_limits(expr: &Arc<dyn PhysicalExpr>, schema: &Schema) -> Result<()> {
    let output_type = expr.data_type(schema)?;
    if !is_allowed_type(&output_type) {
        return plan_err!("type {output_type} is not allowed in an NDP fragment (in {expr})");
    }
    if let Some(column) = expr.downcast_ref::<Column>() {
        if column.index() >= schema.fields().len()
            || schema.field(column.index()).name() != column.name()
        {
            return plan_err!("column {column} does not exist in the table schema");
        }
    } else if expr.downcast_ref::<Literal>().is_some() {
        // The literal's type was checked above.
    } else if let Some(binary) = expr.downcast_ref::<BinaryExpr>() {
        if !is_allowed_operator(binary.op()) {
            return plan_err!("operator {} is not allowed in an NDP fragment", binary.op());
        }
    } else if let Some(function) = expr.downcast_ref::<ScalarFunctionExpr>() {
        if !ALLOWED_FUNCTIONS.contains(&function.name()) {
            return plan_err!(
                "function {}() is not allowed in an NDP fragment",
                function.name()
            );
        }
    } else if expr.downcast_ref::<CastExpr>().is_some()
        || expr.downcast_ref::<TryCastExpr>().is_some()
        || expr.downcast_ref::<IsNullExpr>().is_some()
        || expr.downcast_ref::<IsNotNullExpr>().is_some()
        || expr.downcast_ref::<NotExpr>().is_some()
        || expr.downcast_ref::<NegativeExpr>().is_some()
        || expr.downcast_ref::<InListExpr>().is_some()
        || expr.downcast_ref::<LikeExpr>().is_some()
        || expr.downcast_ref::<CaseExpr>().is_some()
        || expr.downcast_ref::<BloomFilterExpr>().is_some()
        || expr.downcast_ref::<KeyBitmapExpr>().is_some()
    {
        // Structural expressions: their children and output type are checked.
    } else {
        return plan_err!("expression {expr} is not allowed in an NDP fragment");
    }
    for child in expr.children() {
        check_allowed_within_limits(child, schema)?;
    }
    Ok(())
}

/// Check the operators of a fragment: a partial aggregation over projections,
/// filters and hash joins (each probing the rows below with a build side
/// of shipped rows: a star join, see `check_join_allowed`) over the slice
/// input, every expression allow-listed against its operator's input
/// schema. The error names the first thing refused.
pub fn check_plan_allowed(plan: &Arc<dyn ExecutionPlan>) -> Result<()> {
    check_plan_allowed_with(plan, &mut 0)
}

/// Most hash joins (dimensions of a star join) one fragment may probe.
pub const FRAGMENT_JOINS_MAX: usize = 8;

/// Most bytes (Arrow memory) of the rows of one shipped build side.
pub const BUILD_TABLE_BYTES_MAX: usize = 16 * 1024 * 1024;

/// A hash join as a storage node runs it over a slice: the build side is
/// rows the compute node shipped (a `DataSourceExec` over memory), the probe
/// side the slice's rows. Only joins whose result over a slice is the
/// slice's share of the whole join's result are allowed: collect-left, inner
/// or right semi (each probe row is matched against the whole build side,
/// and no build row is emitted for lack of a match), equi-keys of allowed
/// expressions, no residual filter, NULL keys matching nothing.
fn check_join_allowed(join: &HashJoinExec, joins: &mut usize) -> Result<()> {
    *joins += 1;
    if *joins > FRAGMENT_JOINS_MAX {
        return plan_err!("an NDP fragment probes at most {FRAGMENT_JOINS_MAX} hash joins");
    }
    if *join.partition_mode() != PartitionMode::CollectLeft {
        return plan_err!(
            "only a collect-left hash join can run in an NDP fragment, not {:?}",
            join.partition_mode()
        );
    }
    if !matches!(join.join_type(), JoinType::Inner | JoinType::RightSemi) {
        return plan_err!(
            "only inner and right semi hash joins can run in an NDP fragment, not {}",
            join.join_type()
        );
    }
    if join.filter().is_some() {
        return plan_err!("a hash join with a residual filter cannot run in an NDP fragment");
    }
    if join.null_equality() != NullEquality::NullEqualsNothing || join.null_aware {
        return plan_err!("a hash join whose NULL keys match cannot run in an NDP fragment");
    }
    if join.on().is_empty() {
        return plan_err!("a hash join in an NDP fragment needs equi-join keys");
    }
    let (build_schema, probe_schema) = (join.left().schema(), join.right().schema());
    for (build_key, probe_key) in join.on() {
        check_allowed(build_key, &build_schema)?;
        check_allowed(probe_key, &probe_schema)?;
    }
    check_build_table(join.left())
}

/// A join's build side in a fragment: shipped rows in memory, of allowed
/// types, at most [`BUILD_TABLE_BYTES_MAX`].
fn check_build_table(plan: &Arc<dyn ExecutionPlan>) -> Result<()> {
    let memory = plan.downcast_ref::<DataSourceExec>().and_then(|source| {
        let source: &dyn std::any::Any = source.data_source().as_ref();
        source.downcast_ref::<MemorySourceConfig>()
    });
    let Some(memory) = memory else {
        return plan_err!(
            "a hash join's build side in an NDP fragment must be shipped rows, not {}",
            plan.name()
        );
    };
    // A collect-left join builds from its left input's first partition
    // alone: rows in another would be lost.
    if memory.partitions().len() != 1 {
        return plan_err!(
            "a hash join's build side in an NDP fragment is one partition of rows, not {}",
            memory.partitions().len()
        );
    }
    for field in plan.schema().fields() {
        if !is_allowed_type(field.data_type()) {
            return plan_err!(
                "type {} is not allowed in an NDP fragment (build column {})",
                field.data_type(),
                field.name()
            );
        }
    }
    let bytes: usize = memory
        .partitions()
        .iter()
        .flatten()
        .map(|batch| batch.get_array_memory_size())
        .sum();
    if bytes > BUILD_TABLE_BYTES_MAX {
        return plan_err!(
            "a hash join's build side in an NDP fragment holds {bytes} bytes, above the limit of {BUILD_TABLE_BYTES_MAX}"
        );
    }
    Ok(())
}

fn check_plan_allowed_with(plan: &Arc<dyn ExecutionPlan>, joins: &mut usize) -> Result<()> {
    if let Some(join) = plan.downcast_ref::<HashJoinExec>() {
        check_join_allowed(join, joins)?;
        // The probe side continues down to the slice's rows.
        return check_plan_allowed_with(join.right(), joins);
    }
    let input_schema = plan
        .children()
        .first()
        .map(|child| child.schema())
        .unwrap_or_else(|| plan.schema());
    if plan.downcast_ref::<SliceInputExec>().is_some() {
        return Ok(());
    } else if let Some(aggregate) = plan.downcast_ref::<AggregateExec>() {
        // Single: the whole aggregation, where the compute node found each
        // slice's groups complete (slices with disjoint key ranges).
        if !matches!(
            aggregate.mode(),
            AggregateMode::Partial | AggregateMode::Single
        ) {
            return plan_err!(
                "only a partial or single aggregation can run in an NDP fragment, not {:?}",
                aggregate.mode()
            );
        }
        if !aggregate.group_expr().is_single() {
            return plan_err!("grouping sets are not allowed in an NDP fragment");
        }
        for (expr, _) in aggregate.group_expr().expr() {
            check_allowed(expr, &input_schema)?;
        }
        for function in aggregate.aggr_expr() {
            let name = function.fun().name();
            if !ALLOWED_AGGREGATES.contains(&name) {
                return plan_err!("aggregate function {name}() is not allowed in an NDP fragment");
            }
            if !function.order_bys().is_empty() {
                return plan_err!("ordered aggregate {name}() is not allowed in an NDP fragment");
            }
            for argument in function.expressions() {
                check_allowed(&argument, &input_schema)?;
            }
        }
        for filter in aggregate.filter_expr().iter().flatten() {
            check_allowed(filter, &input_schema)?;
        }
    } else if let Some(filter) = plan.downcast_ref::<FilterExec>() {
        check_allowed(filter.predicate(), &input_schema)?;
    } else if let Some(projection) = plan.downcast_ref::<ProjectionExec>() {
        for expr in projection.expr() {
            check_allowed(&expr.expr, &input_schema)?;
        }
    } else {
        return plan_err!("operator {} is not allowed in an NDP fragment", plan.name());
    }
    for child in plan.children() {
        check_plan_allowed_with(child, joins)?;
    }
    if plan.children().len() != 1 {
        return plan_err!(
            "operator {} in an NDP fragment must have one input",
            plan.name()
        );
    }
    Ok(())
}
