//! Group by a table's key first and by its wide columns after the join
//! back (eager aggregation over a key that decides the grouped columns).
//!
//! TPC-H Q21 counts, per supplier name, the late lineitems of Saudi
//! suppliers: `GROUP BY s_name` over supplier, lineitem (three times) and
//! orders. The 25-byte name rides with every lineitem row through three
//! joins on `l_orderkey`: at SF 100 about half of each of their build
//! sides (1.2 GB, 547 MB and 494 MB, all three spilled). The supplier's key
//! decides its name, so [`GroupByTableKey`] rewrites
//!
//! ```text
//!   Aggregate(group by G..., T.name..; f(x)...)      T.key unique in T
//!     input (joins; T.key, T.name.. columns of one scan of T)
//! =>
//!   Projection(G..., T.name.., cast(f'(a) as f's type)...)
//!     Aggregate(group by G..., late.name..; f'(a)...)
//!       Join(first, late, on first.key = late.key; left if T's side is padded)
//!         first: Aggregate(group by G..., T.key; f(x) as a...)   over input
//!         late: Scan(T: key, name..)
//! ```
//!
//! where `f'` is `sum` for `count` and `sum`, and `min`/`max` for
//! themselves.
//!
//! Why the answer is the same: every input row took `T.key` and
//! `T.name..` from one row of `T`, and `T.key` is unique and never NULL in
//! `T`, so rows with the same key have the same names: the first
//! aggregation's groups split the original ones and never mix two. Joining
//! `T` again on the key finds that one row (NULL-padded rows have a NULL
//! key and names, and the left join keeps them so). The second aggregation
//! merges the split groups: a sum of counts or of sums is the count or sum
//! (cast back to the type the query had, which the sum widened), the
//! minimum of minimums the minimum. Two rows of `T` with equal names stay
//! one group, as they were.
//!
//! Taken with NDP on (`sieve.group_by_table_key`) where the grouped
//! columns of `T` include one of variable width and not the key, where
//! the key is in the aggregation's input (the rule runs first among the
//! optimizer's rules, before columns are pruned), where the input has a
//! join to carry the names through, where `T` has at most
//! `sieve.group_by_table_key_rows_max` rows, and where the moved columns
//! take about as many values as there are keys (at least one in two rows,
//! from the slices' distinct counts): names, not a part's brand, whose
//! 1,000 values over 800 k parts would make the first aggregation's groups
//! hundreds of times the query's.

use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{Column, Result, TableReference};
use datafusion::datasource::source_as_provider;
use datafusion::logical_expr::expr::{AggregateFunction, Alias};
use datafusion::logical_expr::{
    cast, Aggregate, AggregateUDF, Expr, ExprSchemable, JoinType, LogicalPlan, LogicalPlanBuilder,
    Projection,
};
use datafusion::optimizer::optimizer::ApplyOrder;
use datafusion::optimizer::{OptimizerConfig, OptimizerRule};

use crate::as_it_was::or_as_it_was;
use crate::late_columns::{trace, unique_columns, variable_width, Traced};
use crate::{NdpMode, SieveConfig};

/// Groups by a table's key first and by its wide columns after (see the
/// module documentation).
#[derive(Debug, Default)]
pub struct GroupByTableKey;

/// Prefix of the names of the tables joined again.
const PREFIX: &str = "__sieve_keyed";

/// The moved columns must take at least one value in this many of the
/// table's rows (estimated from the slices' distinct counts).
const DISTINCT_SHARE_MIN: usize = 2;

impl OptimizerRule for GroupByTableKey {
    fn name(&self) -> &str {
        "sieve_group_by_table_key"
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
        if !settings.group_by_table_key || settings.mode()? == NdpMode::Off {
            return Ok(Transformed::no(plan));
        }
        let rows_max = settings.group_by_table_key_rows_max;
        // The session's `sum` (Sieve's, checked for overflow), which adds
        // the counts up.
        let sum = config
            .function_registry()
            .and_then(|registry| registry.udaf("sum").ok());
        match or_as_it_was(self.name(), || {
            rewrite(aggregate, rows_max, sum, || {
                config.alias_generator().next(PREFIX)
            })
        }) {
            Some(rewritten) => Ok(Transformed::yes(rewritten)),
            None => Ok(Transformed::no(plan)),
        }
    }
}

/// The second aggregation's function over the first one's result: the
/// session's `sum` for a count, the aggregate's own function (the
/// session's `sum`, `min` or `max`, which Sieve corrects) otherwise.
fn merged_by(
    func: &Arc<AggregateUDF>,
    distinct: bool,
    sum: Option<&Arc<AggregateUDF>>,
) -> Option<Arc<AggregateUDF>> {
    match (func.name(), distinct) {
        ("count", false) => sum.cloned(),
        ("sum", false) | ("min", _) | ("max", _) => Some(Arc::clone(func)),
        _ => None,
    }
}

fn rewrite(
    aggregate: &Aggregate,
    rows_max: usize,
    sum: Option<Arc<AggregateUDF>>,
    alias: impl Fn() -> String,
) -> Result<Option<LogicalPlan>> {
    let groups = &aggregate.group_expr;
    let input = aggregate.input.as_ref();
    if groups.is_empty() || aggregate.aggr_expr.is_empty() {
        return Ok(None);
    }
    // Names carried through at least one join.
    let mut joins = false;
    input.apply(|node| {
        joins = matches!(node, LogicalPlan::Join(_));
        Ok(if joins {
            TreeNodeRecursion::Stop
        } else {
            TreeNodeRecursion::Continue
        })
    })?;
    if !joins {
        return Ok(None);
    }
    // Every aggregate one the second aggregation can merge.
    let mut merges = Vec::with_capacity(aggregate.aggr_expr.len());
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
        let Some(merge) = merged_by(func, params.distinct, sum.as_ref()) else {
            return Ok(None);
        };
        merges.push(merge);
    }
    let traced: Vec<Option<Traced>> = groups
        .iter()
        .map(|expr| match expr {
            Expr::Column(column) => {
                let index = input.schema().index_of_column(column).ok()?;
                trace(input, index, &mut vec![], false)
            }
            _ => None,
        })
        .collect();
    // A unique key grouped (any table's): `JoinGroupColumnsLate`'s case,
    // which groups by that key alone. Regrouped after, its other columns
    // would be hashed again (TPC-H Q10's customer strings, 3.9 M groups
    // at SF 100, grouped with the nation's name).
    if traced
        .iter()
        .flatten()
        .any(|traced| unique_columns(&traced.scan).contains(&traced.table_column))
    {
        return Ok(None);
    }
    // A scan some grouped column of variable width comes from, with a
    // unique integer key in the input that is not grouped, a table small
    // enough, and moved columns that take about as many values as the
    // keys; the first such scan.
    let mut chosen = None;
    for (index, wide) in traced.iter().enumerate() {
        let Some(wide) = wide else {
            continue;
        };
        if !variable_width(aggregate.schema.field(index).data_type())
            || wide.scan.table_name.table().starts_with(PREFIX)
        {
            continue;
        }
        let unique = unique_columns(&wide.scan);
        let is_key = |plan: &LogicalPlan, index: usize, path: &[usize]| -> Option<Traced> {
            if !plan.schema().field(index).data_type().is_integer() {
                return None;
            }
            let key = trace(plan, index, &mut path.to_vec(), false)?;
            (key.path == wide.path && unique.contains(&key.table_column)).then_some(key)
        };
        let found = (0..input.schema().fields().len())
            .find_map(|index| Some((index, is_key(input, index, &[])?)));
        // A subquery or view may name the table's columns without its key
        // (TPC-H Q9's `n_name AS nation`): the key is carried up through
        // its projections as one more column.
        let (keyed_input, key_index, key_traced) = match found {
            Some((index, key)) => (None, index, key),
            None => match with_key(input, &mut vec![], &is_key, &alias)? {
                Some((plan, index)) => {
                    let Some(key) = is_key(&plan, index, &[]) else {
                        continue;
                    };
                    (Some(Arc::new(plan)), index, key)
                }
                None => continue,
            },
        };
        let provider = source_as_provider(&key_traced.scan.source)?;
        let Some(table_rows) = provider
            .statistics()
            .and_then(|statistics| statistics.num_rows.get_value().copied())
        else {
            continue;
        };
        if table_rows > rows_max {
            continue;
        }
        // The grouped columns of that scan move after the join back.
        let moved: Vec<Option<usize>> = traced
            .iter()
            .map(|traced| {
                traced
                    .as_ref()
                    .filter(|traced| traced.path == key_traced.path)
                    .map(|traced| traced.table_column)
            })
            .collect();
        // Names nearly as many as the keys (a supplier's name), not a few
        // values many keys share (a part's brand: 1,000 values over 800 k
        // keys), whose first aggregation would hold far more groups than
        // the query's.
        let distinct = moved
            .iter()
            .flatten()
            .filter_map(|&column| crate::table::distinct_estimate_of(provider.as_ref(), column))
            .max()
            .unwrap_or(0);
        if distinct.saturating_mul(DISTINCT_SHARE_MIN) < table_rows {
            continue;
        }
        chosen = Some((keyed_input, key_index, key_traced, moved));
        break;
    }
    let Some((keyed_input, key_index, key_traced, moved)) = chosen else {
        return Ok(None);
    };
    let input = keyed_input.unwrap_or_else(|| Arc::clone(&aggregate.input));

    // The first aggregation: the kept groups and the key.
    let kept: Vec<Expr> = groups
        .iter()
        .zip(&moved)
        .filter(|(_, moved)| moved.is_none())
        .map(|(group, _)| group.clone())
        .collect();
    let key_expr = Expr::Column(Column::from(input.schema().qualified_field(key_index)));
    let first = LogicalPlan::Aggregate(Aggregate::try_new(
        Arc::clone(&input),
        kept.iter().cloned().chain([key_expr]).collect(),
        aggregate.aggr_expr.clone(),
    )?);
    let first_schema = Arc::clone(first.schema());
    if first_schema.fields().len() != kept.len() + 1 + aggregate.aggr_expr.len() {
        return Ok(None);
    }
    let first_column =
        |index: usize| Expr::Column(Column::from(first_schema.qualified_field(index)));

    // The table again: its key and the moved columns.
    let table_schema = key_traced.scan.source.schema();
    let mut projection = vec![key_traced.table_column];
    for &column in moved.iter().flatten() {
        if !projection.contains(&column) {
            projection.push(column);
        }
    }
    let table = TableReference::bare(alias());
    let late = LogicalPlanBuilder::scan(
        table.clone(),
        Arc::clone(&key_traced.scan.source),
        Some(projection),
    )?
    .build()?;
    let late_column = |column: usize| {
        Expr::Column(Column::new(
            Some(table.clone()),
            table_schema.field(column).name(),
        ))
    };
    let join_type = if key_traced.padded {
        JoinType::Left
    } else {
        JoinType::Inner
    };
    let joined = LogicalPlanBuilder::from(first)
        .join_on(
            late,
            join_type,
            [first_column(kept.len()).eq(late_column(key_traced.table_column))],
        )?
        .build()?;

    // The second aggregation, grouped as the query was.
    let mut kept_at = 0;
    let second_groups: Vec<Expr> = moved
        .iter()
        .map(|moved| match moved {
            Some(column) => late_column(*column),
            None => {
                kept_at += 1;
                first_column(kept_at - 1)
            }
        })
        .collect();
    let second_aggregates: Vec<Expr> = merges
        .iter()
        .enumerate()
        .map(|(position, merge)| {
            let value = first_column(kept.len() + 1 + position);
            Expr::AggregateFunction(AggregateFunction::new_udf(
                Arc::clone(merge),
                vec![value],
                false,
                None,
                vec![],
                None,
            ))
            .alias(format!("__sieve_merged_{position}"))
        })
        .collect();
    let second = LogicalPlan::Aggregate(Aggregate::try_new(
        Arc::new(joined),
        second_groups,
        second_aggregates,
    )?);
    let second_schema = Arc::clone(second.schema());
    if second_schema.fields().len() != aggregate.schema.fields().len() {
        return Ok(None);
    }

    // The query's names and types.
    let mut exprs = Vec::with_capacity(aggregate.schema.fields().len());
    for index in 0..aggregate.schema.fields().len() {
        let (qualifier, field) = aggregate.schema.qualified_field(index);
        let value = Expr::Column(Column::from(second_schema.qualified_field(index)));
        let value = if value.get_type(&second_schema)? == *field.data_type() {
            value
        } else {
            cast(value, field.data_type().clone())
        };
        exprs.push(value.alias_qualified(qualifier.cloned(), field.name()));
    }
    Ok(Some(LogicalPlan::Projection(Projection::try_new(
        exprs,
        Arc::new(second),
    )?)))
}

/// Whether a column of a plan (at a path of child indices from the
/// aggregation's input) is the key sought, traced to its scan.
type IsKey<'a> = dyn Fn(&LogicalPlan, usize, &[usize]) -> Option<Traced> + 'a;

/// `plan` with one more output column, last: the integer column of a
/// projection's input (below renames, filters, sorts and limits, and
/// projections that then carry it too) that `is_key` takes, named
/// `alias()`; `path` is the child indices from the aggregation's input to
/// `plan`. `None` where no such column is found.
fn with_key(
    plan: &LogicalPlan,
    path: &mut Vec<usize>,
    is_key: &IsKey,
    alias: &dyn Fn() -> String,
) -> Result<Option<(LogicalPlan, usize)>> {
    let input = match plan {
        LogicalPlan::Projection(_)
        | LogicalPlan::SubqueryAlias(_)
        | LogicalPlan::Filter(_)
        | LogicalPlan::Sort(_)
        | LogicalPlan::Limit(_) => plan.inputs()[0],
        _ => return Ok(None),
    };
    path.push(0);
    let below = match plan {
        LogicalPlan::Projection(_) => (0..input.schema().fields().len())
            .find(|&index| is_key(input, index, path).is_some())
            .map(|index| (None, index)),
        _ => None,
    };
    let below = match below {
        Some(found) => Some(found),
        None => with_key(input, path, is_key, alias)?.map(|(input, index)| (Some(input), index)),
    };
    path.pop();
    let Some((new_input, index)) = below else {
        return Ok(None);
    };
    let input_schema = new_input.as_ref().map_or_else(
        || Arc::clone(input.schema()),
        |input| Arc::clone(input.schema()),
    );
    let new_input = Arc::new(new_input.unwrap_or_else(|| input.clone()));
    match plan {
        LogicalPlan::Projection(projection) => {
            let key = Expr::Column(Column::from(input_schema.qualified_field(index)));
            let mut exprs = projection.expr.clone();
            exprs.push(key.alias(alias()));
            let at = exprs.len() - 1;
            Ok(Some((
                LogicalPlan::Projection(Projection::try_new(exprs, new_input)?),
                at,
            )))
        }
        // Their columns are their input's.
        _ => Ok(Some((
            plan.with_new_exprs(plan.expressions(), vec![Arc::unwrap_or_clone(new_input)])?,
            index,
        ))),
    }
}
