//! The explicit allow-list of what a storage node will evaluate.
//!
//! Only deterministic, side-effect-free expressions over flat columns are
//! allowed. The list is closed: an expression kind not named here is refused,
//! whatever it is.

use std::sync::Arc;

use arrow::datatypes::{DataType, Schema};
use datafusion::common::{plan_err, Result};
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::expressions::{
    BinaryExpr, CaseExpr, CastExpr, Column, InListExpr, IsNotNullExpr, IsNullExpr, LikeExpr,
    Literal, NegativeExpr, NotExpr, TryCastExpr,
};
use datafusion::physical_expr::{PhysicalExpr, ScalarFunctionExpr};
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::filter::FilterExec;
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

/// Check the operators of a fragment: a partial aggregation over projections
/// and filters over the slice input, every expression allow-listed against
/// its operator's input schema. The error names the first thing refused.
pub fn check_plan_allowed(plan: &Arc<dyn ExecutionPlan>) -> Result<()> {
    let input_schema = plan
        .children()
        .first()
        .map(|child| child.schema())
        .unwrap_or_else(|| plan.schema());
    if plan.downcast_ref::<SliceInputExec>().is_some() {
        return Ok(());
    } else if let Some(aggregate) = plan.downcast_ref::<AggregateExec>() {
        if *aggregate.mode() != AggregateMode::Partial {
            return plan_err!(
                "only a partial aggregation can run in an NDP fragment, not {:?}",
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
        check_plan_allowed(child)?;
    }
    if plan.children().len() != 1 {
        return plan_err!(
            "operator {} in an NDP fragment must have one input",
            plan.name()
        );
    }
    Ok(())
}
