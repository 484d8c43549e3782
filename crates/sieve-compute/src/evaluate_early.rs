//! Expressions of a hash join's build side, evaluated below the join.
//!
//! TPC-H Q9 computes `l_extendedprice * (1 - l_discount) - ps_supplycost *
//! l_quantity` above its join with orders, so the hash table built of the
//! lineitem side (32.6 M rows at SF 100) holds the four 16-byte decimals
//! the expression reads instead of its one result: 4.6 GB built, 2.7 GB of
//! it spilled. DataFusion 55 pushes projections of plain columns through
//! joins, never computed ones. [`EvaluateOnBuildSides`] takes a projection
//! over a hash join (through projections of plain columns, as a swap of
//! the join's inputs leaves) and moves each expression of the build side's
//! columns into a projection over the build side, where that narrows the
//! rows the join holds:
//!
//! ```text
//!   Projection(a, f(x, y) AS v)            Projection(a, e AS v)
//!     HashJoin(build L, probe R)     =>      HashJoin(build Projection(k, a, f(x, y) AS e) over L, R)
//! ```
//!
//! An expression moves only if it frees columns (read by nothing else
//! above the join, nor by the join's keys or filter) wider than the values
//! it adds (fixed-width results only). The projection it lands in is taken
//! again, so an expression sinks through the build sides of joins built of
//! joins. It never moves into a probe side: that side streams, and below a
//! join that drops rows the expression would be evaluated on rows it never
//! needed (moving TPC-H Q5's, Q7's and Q8's revenue to the lowest join of
//! lineitem cost 8% to 17% more compute CPU at SF 100).
//!
//! Why the answer is the same: the expression reads only the build side's
//! columns, and a join passes each build row's columns unchanged into every
//! output row it makes, so its value on an output row is its value on the
//! build row. Only joins whose build rows are never padded with NULLs move
//! one (inner, left, left semi and anti). The expression is evaluated on
//! build rows no probe row matches, as a filter DataFusion pushes below a
//! join is; to keep that from raising an error the query would not raise,
//! only expressions that cannot fail on any row move: columns, constants,
//! `+ - *` and comparisons, boolean logic, `CASE`, NULL tests and casts
//! that widen a number (no division, no function, no narrowing cast).
//! Decimal `+ - *` errors on an overflow past 38 digits, as a pushed
//! filter would.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use arrow::datatypes::{DataType, Schema};
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{JoinSide, JoinType, Result};
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::expressions::{
    BinaryExpr, CaseExpr, CastExpr, Column, IsNotNullExpr, IsNullExpr, Literal, NegativeExpr,
    NotExpr, TryCastExpr,
};
use datafusion::physical_expr::projection::{update_expr, ProjectionExpr};
use datafusion::physical_expr::utils::collect_columns;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::joins::utils::{ColumnIndex, JoinFilter};
use datafusion::physical_plan::joins::HashJoinExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::ExecutionPlan;

use crate::as_it_was::or_as_it_was;
use crate::SieveConfig;

/// Moves expressions of a hash join's build side below the join (see the
/// module documentation).
#[derive(Debug, Default)]
pub struct EvaluateOnBuildSides;

/// Prefix of a moved expression's name below the join.
const PREFIX: &str = "__sieve_early";

/// Width counted for a column of variable width (a string view's).
const VARIABLE_WIDTH: usize = 16;

impl PhysicalOptimizerRule for EvaluateOnBuildSides {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if !SieveConfig::of(config).evaluate_before_joins {
            return Ok(plan);
        }
        plan.transform_down(|node| match or_as_it_was(self.name(), || push(&node)) {
            Some(rewritten) => Ok(Transformed::yes(rewritten)),
            None => Ok(Transformed::no(node)),
        })
        .map(|transformed| transformed.data)
    }

    fn name(&self) -> &str {
        "sieve_evaluate_on_build_sides"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

fn push(node: &Arc<dyn ExecutionPlan>) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let Some(projection) = node.downcast_ref::<ProjectionExec>() else {
        return Ok(None);
    };
    // Through projections of plain columns, its expressions read the join.
    let mut exprs: Vec<ProjectionExpr> = projection.expr().to_vec();
    let mut input = Arc::clone(projection.input());
    while let Some(columns) = input.downcast_ref::<ProjectionExec>() {
        if !columns
            .expr()
            .iter()
            .all(|expr| expr.expr.downcast_ref::<Column>().is_some())
        {
            return Ok(None);
        }
        for expr in exprs.iter_mut() {
            let Some(updated) = update_expr(&expr.expr, columns.expr(), true)? else {
                return Ok(None);
            };
            expr.expr = updated;
        }
        let below = Arc::clone(columns.input());
        input = below;
    }
    let Some(join) = input.downcast_ref::<HashJoinExec>() else {
        return Ok(None);
    };
    // A projection the join embeds (as a swap of its inputs leaves) picks
    // columns of its whole output: read those instead.
    if let Some(indices) = &join.projection {
        for expr in exprs.iter_mut() {
            expr.expr = renumber(&expr.expr, |index| indices.get(index).copied())?;
        }
    }
    if !join.dynamic_expressions_produced().is_empty()
        || !matches!(
            join.join_type(),
            JoinType::Inner | JoinType::Left | JoinType::LeftSemi | JoinType::LeftAnti
        )
    {
        return Ok(None);
    }
    let build = join.left();
    let build_schema = build.schema();
    let build_width = build_schema.fields().len();
    let join_schema = join.join_schema();

    // Build-side columns the join itself reads.
    let mut join_reads: BTreeSet<usize> = BTreeSet::new();
    for (left, _) in join.on() {
        join_reads.extend(collect_columns(left).iter().map(Column::index));
    }
    if let Some(filter) = join.filter() {
        join_reads.extend(
            filter
                .column_indices()
                .iter()
                .filter(|column| column.side == JoinSide::Left)
                .map(|column| column.index),
        );
    }

    // The expressions that could move: of build columns only.
    let mut moved: Vec<bool> = exprs
        .iter()
        .map(|expr| {
            let columns = collect_columns(&expr.expr);
            expr.expr.downcast_ref::<Column>().is_none()
                && !columns.is_empty()
                && columns.iter().all(|column| column.index() < build_width)
                && cannot_fail(&expr.expr, join_schema)
                && expr
                    .expr
                    .data_type(join_schema)
                    .ok()
                    .and_then(|data_type| fixed_width(&data_type))
                    .is_some()
        })
        .collect();
    let reads_above = |moved: &[bool]| {
        let mut reads = join_reads.clone();
        for (expr, moved) in exprs.iter().zip(moved) {
            if !moved {
                reads.extend(
                    collect_columns(&expr.expr)
                        .iter()
                        .map(Column::index)
                        .filter(|index| *index < build_width),
                );
            }
        }
        reads
    };
    // An expression moves only if it frees a column; they move only if
    // they free more width than they add.
    let reads = reads_above(&moved);
    for (expr, moved) in exprs.iter().zip(moved.iter_mut()) {
        if *moved
            && collect_columns(&expr.expr)
                .iter()
                .all(|column| reads.contains(&column.index()))
        {
            *moved = false;
        }
    }
    let freed: BTreeSet<usize> = exprs
        .iter()
        .zip(&moved)
        .filter(|(_, moved)| **moved)
        .flat_map(|(expr, _)| collect_columns(&expr.expr))
        .map(|column| column.index())
        .filter(|index| !reads.contains(index))
        .collect();
    let freed_width: usize = freed
        .iter()
        .map(|index| fixed_width(build_schema.field(*index).data_type()).unwrap_or(VARIABLE_WIDTH))
        .sum();
    let added_width: usize = exprs
        .iter()
        .zip(&moved)
        .filter(|(_, moved)| **moved)
        .filter_map(|(expr, _)| {
            expr.expr
                .data_type(join_schema)
                .ok()
                .and_then(|data_type| fixed_width(&data_type))
        })
        .sum();
    if !moved.iter().any(|moved| *moved) || added_width >= freed_width {
        return Ok(None);
    }

    // The build side: the columns still read, then the expressions moved.
    let reads = reads_above(&moved);
    let kept: Vec<usize> = reads.into_iter().collect();
    let new_index: HashMap<usize, usize> = kept
        .iter()
        .enumerate()
        .map(|(new, old)| (*old, new))
        .collect();
    let mut build_exprs: Vec<ProjectionExpr> = kept
        .iter()
        .map(|index| {
            let name = build_schema.field(*index).name().clone();
            ProjectionExpr {
                expr: Arc::new(Column::new(&name, *index)) as Arc<dyn PhysicalExpr>,
                alias: name,
            }
        })
        .collect();
    let mut names = (0..)
        .map(|n| format!("{PREFIX}_{n}"))
        .filter(|name| build_schema.column_with_name(name).is_none());
    let mut moved_names: HashMap<usize, (usize, String)> = HashMap::new();
    for (position, expr) in exprs.iter().enumerate() {
        if moved[position] {
            let name = names.next().expect("names never run out");
            moved_names.insert(position, (build_exprs.len(), name.clone()));
            build_exprs.push(ProjectionExpr {
                expr: Arc::clone(&expr.expr),
                alias: name,
            });
        }
    }
    let new_build_width = build_exprs.len();
    let new_build: Arc<dyn ExecutionPlan> =
        Arc::new(ProjectionExec::try_new(build_exprs, Arc::clone(build))?);

    // The join, its build-side column indexes renumbered.
    let renumber_build = |expr: &Arc<dyn PhysicalExpr>| -> Result<Arc<dyn PhysicalExpr>> {
        renumber(expr, |index| new_index.get(&index).copied())
    };
    let on = join
        .on()
        .iter()
        .map(|(left, right)| Ok((renumber_build(left)?, Arc::clone(right))))
        .collect::<Result<Vec<_>>>()?;
    let filter = match join.filter() {
        None => None,
        Some(filter) => {
            let column_indices = filter
                .column_indices()
                .iter()
                .map(|column| {
                    let index = match column.side {
                        JoinSide::Left => match new_index.get(&column.index) {
                            Some(index) => *index,
                            None => {
                                return datafusion::common::internal_err!(
                                    "the join filter's build column {} was not kept",
                                    column.index
                                )
                            }
                        },
                        _ => column.index,
                    };
                    Ok(ColumnIndex {
                        index,
                        side: column.side,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            Some(JoinFilter::new(
                Arc::clone(filter.expression()),
                column_indices,
                Arc::clone(filter.schema()),
            ))
        }
    };
    let new_join: Arc<dyn ExecutionPlan> = Arc::new(HashJoinExec::try_new(
        new_build,
        Arc::clone(join.right()),
        on,
        filter,
        join.join_type(),
        None,
        *join.partition_mode(),
        join.null_equality(),
        join.null_aware,
    )?);

    // The projection above, reading the new join.
    let top = exprs
        .iter()
        .enumerate()
        .map(|(position, expr)| {
            let new_expr: Arc<dyn PhysicalExpr> = match moved_names.get(&position) {
                Some((index, name)) => Arc::new(Column::new(name, *index)),
                None => renumber(&expr.expr, |index| {
                    if index < build_width {
                        new_index.get(&index).copied()
                    } else {
                        Some(index - build_width + new_build_width)
                    }
                })?,
            };
            Ok(ProjectionExpr {
                expr: new_expr,
                alias: expr.alias.clone(),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Some(Arc::new(ProjectionExec::try_new(top, new_join)?)))
}

/// `expr` with each column's index mapped by `index` (an error where it
/// maps to none).
fn renumber(
    expr: &Arc<dyn PhysicalExpr>,
    index: impl Fn(usize) -> Option<usize>,
) -> Result<Arc<dyn PhysicalExpr>> {
    Arc::clone(expr)
        .transform_up(|node| {
            let Some(column) = node.downcast_ref::<Column>() else {
                return Ok(Transformed::no(node));
            };
            match index(column.index()) {
                Some(new) => Ok(Transformed::yes(
                    Arc::new(Column::new(column.name(), new)) as Arc<dyn PhysicalExpr>
                )),
                None => datafusion::common::internal_err!(
                    "column {} is not on the join's build side",
                    column.name()
                ),
            }
        })
        .map(|transformed| transformed.data)
}

/// Bytes a value of `data_type` takes in a row, if fixed.
fn fixed_width(data_type: &DataType) -> Option<usize> {
    match data_type {
        DataType::Boolean => Some(1),
        other => other.primitive_width(),
    }
}

/// Whether `expr` evaluates without error on every row of `schema`.
fn cannot_fail(expr: &Arc<dyn PhysicalExpr>, schema: &Schema) -> bool {
    let mut safe = true;
    let _ = expr.apply(|node| {
        safe = if let Some(binary) = node.downcast_ref::<BinaryExpr>() {
            matches!(
                binary.op(),
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
            )
        } else if let Some(cast) = node.downcast_ref::<CastExpr>() {
            cast.expr()
                .data_type(schema)
                .is_ok_and(|from| widens(&from, cast.cast_type()))
        } else {
            node.downcast_ref::<Column>().is_some()
                || node.downcast_ref::<Literal>().is_some()
                || node.downcast_ref::<NotExpr>().is_some()
                || node.downcast_ref::<NegativeExpr>().is_some()
                || node.downcast_ref::<IsNullExpr>().is_some()
                || node.downcast_ref::<IsNotNullExpr>().is_some()
                || node.downcast_ref::<CaseExpr>().is_some()
                || node.downcast_ref::<TryCastExpr>().is_some()
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
