//! Expressions of one join input's columns, evaluated below the join.
//!
//! TPC-H Q9 computes `l_extendedprice * (1 - l_discount) - ps_supplycost *
//! l_quantity` above its join with orders, so the hash table built of the
//! lineitem side (32.6 M rows at SF 100) holds the four 16-byte decimals
//! the expression reads instead of its one result: 4.6 GB built, 2.7 GB of
//! it spilled. DataFusion 55 pushes projections of plain columns through
//! joins, never computed ones. [`EvaluateBeforeJoins`] takes a projection
//! over a join and moves each expression whose columns all come from one
//! input into a projection over that input, where that narrows the rows:
//!
//! ```text
//!   Projection(a, f(x, y) AS v)            Projection(a, e AS v)
//!     Join(L, R, on k)             =>        Join(Projection(k, a, f(x, y) AS e) over L, R, on k)
//! ```
//!
//! An expression moves only if it frees columns (read by nothing else
//! above the join, nor by the join's condition) wider than the values it
//! adds (fixed-width results only), into an input that is itself a join
//! (whose rows are a hash table's or a spill's), and the projection it lands in is
//! taken again by the rule, so an expression sinks to the lowest join
//! whose one input holds its columns. Q9 at SF 100 (`sieve sql`, EXPLAIN
//! ANALYZE): the build side 4.6 -> 2.2 GB, the join 23.4 -> 16.1 s.
//!
//! Why the answer is the same: the expression reads only that input's
//! columns, and a join passes each input row's columns unchanged into
//! every output row it makes, so its value on an output row is its value
//! on the input row. An input whose rows a join pads with NULLs (the
//! right of a left join, either side of a full join) would see the
//! expression over the padding differ (`coalesce(x, 0)`): no expression
//! moves into it. The expression is evaluated on input rows the join then
//! drops, as a filter DataFusion pushes below a join is; to keep that from
//! raising an error the query would not raise, only expressions that
//! cannot fail on any row move: columns, constants, `+ - *` and
//! comparisons, boolean logic, `CASE`, NULL tests and casts that widen a
//! number (no division, no function, no narrowing cast). Decimal `+ - *`
//! errors on an overflow past 38 digits, as a pushed filter would.

use std::collections::HashSet;
use std::sync::Arc;

use arrow::datatypes::DataType;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{Column, DFSchema, JoinType, Result};
use datafusion::logical_expr::expr::{Alias, Cast};
use datafusion::logical_expr::{
    Aggregate, Expr, ExprSchemable, Join, LogicalPlan, Operator, Projection,
};
use datafusion::optimizer::optimizer::ApplyOrder;
use datafusion::optimizer::{OptimizerConfig, OptimizerRule};

use crate::SieveConfig;

/// Moves expressions of one join input below the join (see the module
/// documentation).
#[derive(Debug, Default)]
pub struct EvaluateBeforeJoins;

/// Prefix of a moved expression's name below the join.
const PREFIX: &str = "__sieve_early";

/// Width counted for a column of variable width (a string view's).
const VARIABLE_WIDTH: usize = 16;

impl OptimizerRule for EvaluateBeforeJoins {
    fn name(&self) -> &str {
        "sieve_evaluate_before_joins"
    }

    fn apply_order(&self) -> Option<ApplyOrder> {
        Some(ApplyOrder::TopDown)
    }

    fn supports_rewrite(&self) -> bool {
        true
    }

    fn rewrite(
        &self,
        plan: LogicalPlan,
        config: &dyn OptimizerConfig,
    ) -> Result<Transformed<LogicalPlan>> {
        if !SieveConfig::of(&config.options()).evaluate_before_joins {
            return Ok(Transformed::no(plan));
        }
        let alias = || config.alias_generator().next(PREFIX);
        let rewritten = match &plan {
            LogicalPlan::Projection(projection) => rewrite(projection, alias),
            LogicalPlan::Aggregate(aggregate) => rewrite_aggregate(aggregate, alias),
            _ => return Ok(Transformed::no(plan)),
        };
        // A plan this rule cannot rebuild is planned as it was: the rule
        // is an optimization, never a reason for a query to fail.
        match rewritten {
            Ok(Some(rewritten)) => Ok(Transformed::yes(rewritten)),
            Ok(None) => Ok(Transformed::no(plan)),
            Err(error) => {
                log::debug!("{}: plan kept as it was: {error}", self.name());
                Ok(Transformed::no(plan))
            }
        }
    }
}

/// One of the join's two inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Left,
    Right,
}

/// The inputs of a join whose columns reach its output unpadded.
fn unpadded_sides(join_type: JoinType) -> &'static [Side] {
    match join_type {
        JoinType::Inner => &[Side::Left, Side::Right],
        JoinType::Left | JoinType::LeftSemi | JoinType::LeftAnti => &[Side::Left],
        JoinType::Right | JoinType::RightSemi | JoinType::RightAnti => &[Side::Right],
        JoinType::Full | JoinType::LeftMark | JoinType::RightMark => &[],
    }
}

fn rewrite(projection: &Projection, alias: impl Fn() -> String) -> Result<Option<LogicalPlan>> {
    let LogicalPlan::Join(join) = projection.input.as_ref() else {
        return Ok(None);
    };
    let join_schema = join.schema.as_ref();
    // Columns the join's own condition reads.
    let mut join_reads: HashSet<Column> = HashSet::new();
    for (left, right) in &join.on {
        join_reads.extend(left.column_refs().into_iter().cloned());
        join_reads.extend(right.column_refs().into_iter().cloned());
    }
    if let Some(filter) = &join.filter {
        join_reads.extend(filter.column_refs().into_iter().cloned());
    }

    // Which side each expression could move into.
    let sides = unpadded_sides(join.join_type);
    let side_schema = |side: Side| match side {
        Side::Left => join.left.schema(),
        Side::Right => join.right.schema(),
    };
    let mut candidate: Vec<Option<Side>> = projection
        .expr
        .iter()
        .map(|expr| {
            let inner = unalias(expr);
            if matches!(inner, Expr::Column(_)) || !cannot_fail(inner, join_schema) {
                return None;
            }
            let width = inner
                .get_type(join_schema)
                .ok()
                .and_then(|data_type| fixed_width(&data_type));
            let columns = inner.column_refs();
            if width.is_none() || columns.is_empty() {
                return None;
            }
            sides.iter().copied().find(|side| {
                columns
                    .iter()
                    .all(|column| side_schema(*side).has_column(column))
            })
        })
        .collect();

    // Columns still read above the join by what stays, or by the join.
    let kept_reads = |candidate: &[Option<Side>]| {
        let mut reads = join_reads.clone();
        for (expr, side) in projection.expr.iter().zip(candidate) {
            if side.is_none() {
                reads.extend(expr.column_refs().into_iter().cloned());
            }
        }
        reads
    };
    // An expression moves only if it frees a column; a side's expressions
    // move only if they free more width than they add.
    let reads = kept_reads(&candidate);
    for (expr, side) in projection.expr.iter().zip(candidate.iter_mut()) {
        if side.is_some()
            && expr
                .column_refs()
                .iter()
                .all(|column| reads.contains(*column))
        {
            *side = None;
        }
    }
    for side in sides {
        // Only into a join's result: a scan's rows are streamed, and its
        // own pushdown (join filters, fragments) is left as it is.
        let input = match side {
            Side::Left => &join.left,
            Side::Right => &join.right,
        };
        if !is_join_result(input) {
            candidate
                .iter_mut()
                .filter(|s| **s == Some(*side))
                .for_each(|s| *s = None);
            continue;
        }
        let moved: Vec<&Expr> = projection
            .expr
            .iter()
            .zip(&candidate)
            .filter(|(_, s)| *s == &Some(*side))
            .map(|(expr, _)| unalias(expr))
            .collect();
        let freed: HashSet<&Column> = moved
            .iter()
            .flat_map(|expr| expr.column_refs())
            .filter(|column| !reads.contains(*column))
            .collect();
        let freed_width: usize = freed
            .iter()
            .map(|column| {
                join_schema
                    .qualified_field_from_column(column)
                    .map(|(_, field)| field)
                    .map(|field| fixed_width(field.data_type()).unwrap_or(VARIABLE_WIDTH))
                    .unwrap_or(VARIABLE_WIDTH)
            })
            .sum();
        let added_width: usize = moved
            .iter()
            .map(|expr| {
                expr.get_type(join_schema)
                    .ok()
                    .and_then(|data_type| fixed_width(&data_type))
                    .unwrap_or(usize::MAX / 64)
            })
            .sum();
        if added_width >= freed_width {
            candidate
                .iter_mut()
                .filter(|s| **s == Some(*side))
                .for_each(|s| *s = None);
        }
    }
    if candidate.iter().all(Option::is_none) {
        return Ok(None);
    }

    // Each side: the columns still read, then the expressions moved.
    let reads = kept_reads(&candidate);
    let mut names: Vec<Option<String>> = vec![None; projection.expr.len()];
    let mut inputs = [Arc::clone(&join.left), Arc::clone(&join.right)];
    for (side, input) in [Side::Left, Side::Right].into_iter().zip(inputs.iter_mut()) {
        let moved: Vec<usize> = (0..projection.expr.len())
            .filter(|index| candidate[*index] == Some(side))
            .collect();
        if moved.is_empty() {
            continue;
        }
        let schema = input.schema();
        let mut exprs: Vec<Expr> = schema
            .columns()
            .into_iter()
            .filter(|column| reads.contains(column))
            .map(Expr::Column)
            .collect();
        for index in moved {
            let name = alias();
            exprs.push(unalias(&projection.expr[index]).clone().alias(name.clone()));
            names[index] = Some(name);
        }
        *input = Arc::new(LogicalPlan::Projection(Projection::try_new(
            exprs,
            below_plain_columns(input),
        )?));
    }
    let [left, right] = inputs;
    let join = Join::try_new(
        left,
        right,
        join.on.clone(),
        join.filter.clone(),
        join.join_type,
        join.join_constraint,
        join.null_equality,
        join.null_aware,
    )?;
    let exprs = projection
        .expr
        .iter()
        .zip(names)
        .enumerate()
        .map(|(index, (expr, name))| match name {
            None => expr.clone(),
            Some(name) => {
                let (qualifier, field) = projection.schema.qualified_field(index);
                Expr::Column(Column::new_unqualified(name))
                    .alias_qualified(qualifier.cloned(), field.name())
            }
        })
        .collect();
    Ok(Some(LogicalPlan::Projection(Projection::try_new(
        exprs,
        Arc::new(LogicalPlan::Join(join)),
    )?)))
}

/// An aggregation over a join (or over a projection of its columns) whose
/// arguments are expressions: they are given to [`rewrite`] as a
/// projection over the join, and read as columns of it if it moves any.
fn rewrite_aggregate(
    aggregate: &Aggregate,
    alias: impl Fn() -> String,
) -> Result<Option<LogicalPlan>> {
    let join = below_plain_columns(&aggregate.input);
    if !matches!(join.as_ref(), LogicalPlan::Join(_)) {
        return Ok(None);
    }
    // Each argument that is an expression, once, by the name it gets.
    let mut moved: Vec<(Expr, String)> = Vec::new();
    let mut aggr_expr = Vec::with_capacity(aggregate.aggr_expr.len());
    for (index, expr) in aggregate.aggr_expr.iter().enumerate() {
        let Expr::AggregateFunction(function) = unalias(expr) else {
            return Ok(None);
        };
        let mut function = function.clone();
        for arg in function.params.args.iter_mut() {
            if matches!(arg, Expr::Column(_) | Expr::Literal(..)) || arg.column_refs().is_empty() {
                continue;
            }
            let name = match moved.iter().find(|(expr, _)| expr == arg) {
                Some((_, name)) => name.clone(),
                None => {
                    let name = alias();
                    moved.push((arg.clone(), name.clone()));
                    name
                }
            };
            *arg = Expr::Column(Column::new_unqualified(name));
        }
        let (qualifier, field) = aggregate
            .schema
            .qualified_field(aggregate.group_expr.len() + index);
        aggr_expr.push(
            Expr::AggregateFunction(function).alias_qualified(qualifier.cloned(), field.name()),
        );
    }
    if moved.is_empty() {
        return Ok(None);
    }
    // The projection: the columns the aggregation still reads, then the
    // arguments.
    let mut reads: HashSet<Column> = HashSet::new();
    for expr in aggregate.group_expr.iter().chain(&aggr_expr) {
        reads.extend(expr.column_refs().into_iter().cloned());
    }
    let mut exprs: Vec<Expr> = join
        .schema()
        .columns()
        .into_iter()
        .filter(|column| reads.contains(column))
        .map(Expr::Column)
        .collect();
    exprs.extend(moved.into_iter().map(|(expr, name)| expr.alias(name)));
    let projection = Projection::try_new(exprs, join)?;
    let Some(input) = rewrite(&projection, alias)? else {
        return Ok(None);
    };
    Ok(Some(LogicalPlan::Aggregate(Aggregate::try_new(
        Arc::new(input),
        aggregate.group_expr.clone(),
        aggr_expr,
    )?)))
}

/// The input a projection over `input` reads: below a projection that
/// only picks columns (they keep their names), that projection's input.
fn below_plain_columns(input: &Arc<LogicalPlan>) -> Arc<LogicalPlan> {
    match input.as_ref() {
        LogicalPlan::Projection(projection)
            if projection
                .expr
                .iter()
                .all(|expr| matches!(expr, Expr::Column(_))) =>
        {
            Arc::clone(&projection.input)
        }
        _ => Arc::clone(input),
    }
}

/// Whether `plan` is a join's rows, renamed or with columns picked.
fn is_join_result(plan: &LogicalPlan) -> bool {
    match plan {
        LogicalPlan::Join(_) => true,
        LogicalPlan::SubqueryAlias(alias) => is_join_result(&alias.input),
        LogicalPlan::Projection(projection) => {
            projection
                .expr
                .iter()
                .all(|expr| matches!(expr, Expr::Column(_)))
                && is_join_result(&projection.input)
        }
        _ => false,
    }
}

fn unalias(expr: &Expr) -> &Expr {
    match expr {
        Expr::Alias(Alias { expr, .. }) => unalias(expr),
        other => other,
    }
}

/// Bytes a value of `data_type` takes in a row, if fixed.
fn fixed_width(data_type: &DataType) -> Option<usize> {
    match data_type {
        DataType::Boolean => Some(1),
        other => other.primitive_width(),
    }
}

/// Whether `expr` evaluates without error on every row of `schema`.
fn cannot_fail(expr: &Expr, schema: &DFSchema) -> bool {
    let mut safe = true;
    let _ = expr.apply(|node| {
        safe = match node {
            Expr::Column(_)
            | Expr::Literal(..)
            | Expr::Alias(_)
            | Expr::Not(_)
            | Expr::IsNull(_)
            | Expr::IsNotNull(_)
            | Expr::IsTrue(_)
            | Expr::IsFalse(_)
            | Expr::IsUnknown(_)
            | Expr::IsNotTrue(_)
            | Expr::IsNotFalse(_)
            | Expr::IsNotUnknown(_)
            | Expr::Case(_)
            | Expr::TryCast(_) => true,
            Expr::BinaryExpr(binary) => matches!(
                binary.op,
                Operator::Plus
                    | Operator::Minus
                    | Operator::Multiply
                    | Operator::Eq
                    | Operator::NotEq
                    | Operator::Lt
                    | Operator::LtEq
                    | Operator::Gt
                    | Operator::GtEq
                    | Operator::And
                    | Operator::Or
                    | Operator::IsDistinctFrom
                    | Operator::IsNotDistinctFrom
            ),
            Expr::Cast(Cast { expr, field }) => expr
                .get_type(schema)
                .is_ok_and(|from| widens(&from, field.data_type())),
            _ => false,
        };
        Ok(if safe {
            TreeNodeRecursion::Continue
        } else {
            TreeNodeRecursion::Stop
        })
    });
    safe
}

/// Whether every value of `from` has a value of `to`.
fn widens(from: &DataType, to: &DataType) -> bool {
    use DataType::*;
    let integer_digits = |data_type: &DataType| match data_type {
        Int8 | UInt8 => Some(3),
        Int16 | UInt16 => Some(5),
        Int32 | UInt32 => Some(10),
        Int64 => Some(19),
        UInt64 => Some(20),
        _ => None,
    };
    if from == to {
        return true;
    }
    match (from, to) {
        (Int8, Int16 | Int32 | Int64)
        | (Int16, Int32 | Int64)
        | (Int32, Int64)
        | (UInt8, Int16 | Int32 | Int64 | UInt16 | UInt32 | UInt64)
        | (UInt16, Int32 | Int64 | UInt32 | UInt64)
        | (UInt32, Int64 | UInt64)
        | (Float32, Float64) => true,
        (_, Float64) => integer_digits(from).is_some(),
        (_, Decimal128(precision, scale)) => {
            let whole = i64::from(*precision) - i64::from(*scale);
            match from {
                Decimal128(p, s) => *scale >= *s && whole >= i64::from(*p) - i64::from(*s),
                other => integer_digits(other).is_some_and(|digits| whole >= digits),
            }
        }
        _ => false,
    }
}
