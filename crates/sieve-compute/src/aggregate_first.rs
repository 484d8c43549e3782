//! Aggregate a join's many side before the join, where the groups are the
//! rows of its other side.
//!
//! TPC-H Q13 counts each customer's orders: `customer LEFT JOIN orders ON
//! c_custkey = o_custkey GROUP BY c_custkey`. DataFusion probes every
//! order (150 M at SF 100) into a hash table of every customer and then
//! hashes the joined rows again into 15 M groups. A group here is one
//! customer row (`c_custkey` is unique and never NULL in its table), and
//! the rows it aggregates are exactly the orders with that key, so the
//! aggregation can run over orders alone, grouped by `o_custkey`, and
//! the join then pairs each customer with at most one aggregated row
//! (eager aggregation, Yan and Larson, VLDB 1995, with the aggregation
//! above the join left out because its groups are single rows).
//! [`AggregateBeforeJoin`] rewrites
//!
//! ```text
//!   Aggregate(group by L.u, L.x; f(R.a), count(R.b))
//!     [Projection of columns]
//!       Join(L, R, on L.k = R.k, Inner or Left with L preserved)
//! =>
//!   Projection(L.u, L.x, g.f, coalesce(g.count, 0))
//!     Join(L, g, on L.k = g.k, same type)
//!       g: Aggregate(group by R.k; f(R.a), count(R.b))
//! ```
//!
//! Why the answer is the same: `L.u` is a unique, never-NULL column of the
//! table `L` reads, and `L` is that table filtered or projected (no join
//! or aggregation), so each group is one row of `L`; the rows joined to it
//! are the rows of `R` whose key equals its key, which is one group of `g`
//! (an `R` row with a NULL key matches nothing either way). Every
//! aggregate reads `R`'s columns only, so it gets the same rows. Only an
//! unmatched row of a left join differs: the original aggregates one row
//! padded with NULLs, the rewrite finds no group. `sum`, `min`, `max` and
//! `avg` of NULLs are NULL, as the padded side gives; `count` of a column
//! is then 0 and `count(*)` (`count(1)`) 1, which the projection puts back.
//!
//! Taken only for the aggregate functions named above (DISTINCT or not,
//! without FILTER or ORDER BY; over a left join, arguments NULL wherever
//! the columns they read are: columns under arithmetic, comparisons and
//! casts, so that a padded row's are NULL), equality joins without a residual filter
//! whose NULLs match nothing, and with NDP on
//! (`sieve.aggregate_before_join`). The aggregation over `R` alone is a
//! scan's aggregation, which [`crate::PushAggregateToStorage`] then pushes
//! to the storage nodes as partial aggregates.

use std::sync::Arc;

use datafusion::common::tree_node::Transformed;
use datafusion::common::{Column, NullEquality, Result, ScalarValue, TableReference};
use datafusion::logical_expr::expr::{AggregateFunction, Alias};
use datafusion::logical_expr::{
    Aggregate, Expr, Join, JoinType, LogicalPlan, Projection, SubqueryAlias,
};
use datafusion::optimizer::optimizer::ApplyOrder;
use datafusion::optimizer::{OptimizerConfig, OptimizerRule};

use crate::as_it_was::or_as_it_was;
use crate::{NdpMode, SieveConfig};

/// Aggregates a join's many side first (see the module documentation).
#[derive(Debug, Default)]
pub struct AggregateBeforeJoin;

/// Prefix of the aggregated side's alias.
const PREFIX: &str = "__sieve_first";

impl OptimizerRule for AggregateBeforeJoin {
    fn name(&self) -> &str {
        "sieve_aggregate_before_join"
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
        let LogicalPlan::Aggregate(aggregate) = &plan else {
            return Ok(Transformed::no(plan));
        };
        let options = config.options();
        let settings = SieveConfig::of(&options);
        if !settings.aggregate_before_join || settings.mode()? == NdpMode::Off {
            return Ok(Transformed::no(plan));
        }
        match or_as_it_was(self.name(), || {
            rewrite(aggregate, || config.alias_generator().next(PREFIX))
        }) {
            Some(rewritten) => Ok(Transformed::yes(rewritten)),
            None => Ok(Transformed::no(plan)),
        }
    }
}

/// What the projection above the new join does with one aggregate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unmatched {
    /// NULL over a padded row, as the aggregate gives.
    Null,
    /// `count` of a column: 0.
    Zero,
    /// `count` of a non-NULL constant (`count(*)`): 1.
    One,
}

fn rewrite(aggregate: &Aggregate, alias: impl Fn() -> String) -> Result<Option<LogicalPlan>> {
    let groups = &aggregate.group_expr;
    if groups.is_empty() {
        return Ok(None);
    }
    // The join, under a projection of plain columns at most (those keep
    // their names, so the aggregate's expressions read the join's output).
    let join = match aggregate.input.as_ref() {
        LogicalPlan::Join(join) => join,
        LogicalPlan::Projection(projection)
            if projection
                .expr
                .iter()
                .all(|expr| matches!(expr, Expr::Column(_))) =>
        {
            match projection.input.as_ref() {
                LogicalPlan::Join(join) => join,
                _ => return Ok(None),
            }
        }
        _ => return Ok(None),
    };
    if join.filter.is_some()
        || join.null_equality != NullEquality::NullEqualsNothing
        || join.null_aware
        || join.on.is_empty()
    {
        return Ok(None);
    }
    // Which side is aggregated: a left join's right side; either side of
    // an inner join, the one the aggregates read.
    let left_schema = join.left.schema();
    let right_schema = join.right.schema();
    let reads_only = |expr: &Expr, schema: &datafusion::common::DFSchema| {
        expr.column_refs()
            .iter()
            .all(|column| schema.has_column(column))
    };
    let mut unmatched = Vec::with_capacity(aggregate.aggr_expr.len());
    let mut functions = Vec::with_capacity(aggregate.aggr_expr.len());
    for expr in &aggregate.aggr_expr {
        let inner = match expr {
            Expr::Alias(Alias { expr, .. }) => expr.as_ref(),
            other => other,
        };
        let Expr::AggregateFunction(AggregateFunction { func, params }) = inner else {
            return Ok(None);
        };
        if params.filter.is_some() || !params.order_by.is_empty() {
            return Ok(None);
        }
        let what = match func.name() {
            "sum" | "min" | "max" | "avg" => Unmatched::Null,
            "count" => {
                let constant = params
                    .args
                    .iter()
                    .all(|arg| matches!(arg, Expr::Literal(value, _) if !value.is_null()));
                if constant && !params.distinct {
                    Unmatched::One
                } else if params.args.iter().any(|arg| arg.column_refs().is_empty()) {
                    // count(NULL), count(DISTINCT 1): not worth the cases.
                    return Ok(None);
                } else {
                    Unmatched::Zero
                }
            }
            _ => return Ok(None),
        };
        // Over a left join's padded row an argument must be NULL, as the
        // rule for unmatched rows assumes (`sum(1)` or
        // `count(coalesce(c.v, 0))` would count it).
        if join.join_type == JoinType::Left
            && what != Unmatched::One
            && !params.args.iter().all(null_over_null_columns)
        {
            return Ok(None);
        }
        unmatched.push(what);
        functions.push(expr.clone());
    }
    let aggregated_right = match join.join_type {
        JoinType::Left => true,
        JoinType::Inner => {
            let reads = |schema| {
                aggregate
                    .aggr_expr
                    .iter()
                    .all(|expr| reads_only(expr, schema))
            };
            if reads(right_schema) {
                true
            } else if reads(left_schema) {
                false
            } else {
                return Ok(None);
            }
        }
        _ => return Ok(None),
    };
    let (kept, many) = if aggregated_right {
        (&join.left, &join.right)
    } else {
        (&join.right, &join.left)
    };
    if !aggregate
        .aggr_expr
        .iter()
        .all(|expr| reads_only(expr, many.schema()))
    {
        return Ok(None);
    }
    // Every group is a column of the kept side, one of them unique there.
    let mut unique = false;
    for group in groups {
        let Expr::Column(column) = group else {
            return Ok(None);
        };
        let Ok(index) = kept.schema().index_of_column(column) else {
            return Ok(None);
        };
        unique = unique || unique_row_column(kept, index);
    }
    if !unique {
        return Ok(None);
    }
    // A count(*) over an inner join counts matched rows: no padded row.
    if join.join_type == JoinType::Inner {
        unmatched
            .iter_mut()
            .for_each(|what| *what = Unmatched::Null);
    }

    let (kept_keys, many_keys): (Vec<Expr>, Vec<Expr>) = join
        .on
        .iter()
        .map(|(left, right)| {
            if aggregated_right {
                (left.clone(), right.clone())
            } else {
                (right.clone(), left.clone())
            }
        })
        .unzip();
    // The aggregated side's keys, each once: a join on one key twice
    // (`a.k = b.x AND a.k = b.y`) groups by it once, and both pairs of the
    // new join read that group's key (fuzzer seed 20261702, schema 15,
    // query 62 indexed past the aggregation's columns).
    let mut group_keys: Vec<Expr> = Vec::with_capacity(many_keys.len());
    let key_groups: Vec<usize> = many_keys
        .iter()
        .map(
            |key| match group_keys.iter().position(|group| group == key) {
                Some(position) => position,
                None => {
                    group_keys.push(key.clone());
                    group_keys.len() - 1
                }
            },
        )
        .collect();
    let first = LogicalPlan::Aggregate(Aggregate::try_new(
        Arc::clone(many),
        group_keys.clone(),
        functions,
    )?);
    let name = TableReference::bare(alias());
    let first = LogicalPlan::SubqueryAlias(SubqueryAlias::try_new(Arc::new(first), name.clone())?);
    let first_schema = Arc::clone(first.schema());
    if first_schema.fields().len() != group_keys.len() + unmatched.len() {
        return Ok(None);
    }
    let column_at = |index: usize| Expr::Column(Column::from(first_schema.qualified_field(index)));
    let first_keys: Vec<Expr> = key_groups.iter().map(|&group| column_at(group)).collect();
    let on: Vec<(Expr, Expr)> = kept_keys
        .into_iter()
        .zip(first_keys)
        .map(|(kept, first)| {
            if aggregated_right {
                (kept, first)
            } else {
                (first, kept)
            }
        })
        .collect();
    let (left, right) = if aggregated_right {
        (Arc::clone(kept), Arc::new(first))
    } else {
        (Arc::new(first), Arc::clone(kept))
    };
    let joined = LogicalPlan::Join(Join::try_new(
        left,
        right,
        on,
        None,
        join.join_type,
        join.join_constraint,
        NullEquality::NullEqualsNothing,
        false,
    )?);

    let mut exprs = Vec::with_capacity(aggregate.schema.fields().len());
    for index in 0..aggregate.schema.fields().len() {
        let (qualifier, field) = aggregate.schema.qualified_field(index);
        let value = if index < groups.len() {
            // A row's value, not the aggregation's: as DataFusion's
            // GROUP BY gives it (-0.0 as 0.0).
            let Some(value) =
                crate::signed_zero::group_value(groups[index].clone(), field.data_type())
            else {
                return Ok(None);
            };
            value
        } else {
            let position = index - groups.len();
            let value = column_at(group_keys.len() + position);
            match unmatched[position] {
                Unmatched::Null => value,
                Unmatched::Zero => coalesce(value, 0),
                Unmatched::One => coalesce(value, 1),
            }
        };
        exprs.push(value.alias_qualified(qualifier.cloned(), field.name()));
    }
    Ok(Some(LogicalPlan::Projection(Projection::try_new(
        exprs,
        Arc::new(joined),
    )?)))
}

/// Whether `expr` reads a column and is NULL whenever the columns it
/// reads are: columns and constants under arithmetic, comparisons, casts
/// and negation, each NULL where an operand is.
fn null_over_null_columns(expr: &Expr) -> bool {
    fn strict(expr: &Expr) -> bool {
        match expr {
            Expr::Column(_) | Expr::Literal(..) => true,
            Expr::Cast(cast) => strict(&cast.expr),
            Expr::TryCast(cast) => strict(&cast.expr),
            Expr::Negative(inner) => strict(inner),
            Expr::BinaryExpr(binary) => {
                use datafusion::logical_expr::Operator::*;
                matches!(
                    binary.op,
                    Plus | Minus | Multiply | Divide | Modulo | Eq | NotEq | Lt | LtEq | Gt | GtEq
                ) && strict(&binary.left)
                    && strict(&binary.right)
            }
            _ => false,
        }
    }
    !expr.column_refs().is_empty() && strict(expr)
}

fn coalesce(value: Expr, default: i64) -> Expr {
    datafusion::functions::core::expr_fn::coalesce(vec![
        value,
        Expr::Literal(ScalarValue::Int64(Some(default)), None),
    ])
}

/// Whether output column `index` of `plan` is a unique, never-NULL column
/// of the one table `plan` reads, each output row one row of that table
/// (filters, projections, sorts, limits and aliases over a scan).
fn unique_row_column(plan: &LogicalPlan, index: usize) -> bool {
    match plan {
        LogicalPlan::TableScan(scan) => {
            let column = match &scan.projection {
                Some(projection) => match projection.get(index) {
                    Some(column) => *column,
                    None => return false,
                },
                None => index,
            };
            crate::late_columns::unique_columns(scan).contains(&column)
        }
        LogicalPlan::Filter(filter) => unique_row_column(&filter.input, index),
        LogicalPlan::Sort(sort) => unique_row_column(&sort.input, index),
        LogicalPlan::Limit(limit) => unique_row_column(&limit.input, index),
        LogicalPlan::SubqueryAlias(alias) => unique_row_column(&alias.input, index),
        LogicalPlan::Projection(projection) => {
            let column = match projection.expr.get(index) {
                Some(Expr::Column(column)) => column,
                Some(Expr::Alias(Alias { expr, .. })) => match expr.as_ref() {
                    Expr::Column(column) => column,
                    _ => return false,
                },
                _ => return false,
            };
            match projection.input.schema().index_of_column(column) {
                Ok(index) => unique_row_column(&projection.input, index),
                Err(_) => false,
            }
        }
        _ => false,
    }
}
