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

/// Check that `expr`, evaluated against `schema`, uses only allow-listed
/// expression kinds, operators, types and functions. The error names the
/// first thing refused.
pub fn check_allowed(expr: &Arc<dyn PhysicalExpr>, schema: &Schema) -> Result<()> {
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
    {
        // Structural expressions: their children and output type are checked.
    } else {
        return plan_err!("expression {expr} is not allowed in an NDP fragment");
    }
    for child in expr.children() {
        check_allowed(child, schema)?;
    }
    Ok(())
}
