//! Group columns a unique key decides, fetched after the aggregation.
//!
//! TPC-H Q10 groups by a customer's key and six columns the key decides
//! (name, address, phone, comment, balance, nation): every one of them is
//! carried through the joins with orders and lineitem and hashed into the
//! aggregation, 3.9 M groups of about 200 bytes at SF 100. Where a group
//! key is a table's unique key, the table's other grouping columns follow
//! from it: [`JoinGroupColumnsLate`] groups by the key alone (with the
//! other grouping expressions) and joins the table again on the key for
//! those columns, after the aggregation, reading only the keys that have a
//! group (the join's filter) — late materialization.
//!
//! Why the answer is the same: every row under the aggregation took the
//! table's columns from one row of the table, so rows with equal keys have
//! equal columns and the groups are the same with or without them; each
//! group's key is one row of the table, whatever filter the query put on it,
//! so joining the whole table on the key finds exactly that row. A key
//! that is NULL under an outer join (the table's side padded) finds none,
//! and its columns are NULL, as they were: the join is then a left join.
//!
//! Uniqueness is proven from the slices' summaries
//! ([`crate::ClusterTable::unique_columns`]), at the version the scan
//! reads; it is never declared as a DataFusion constraint, which would make
//! DataFusion's SQL planner add every column the key decides to such
//! groupings. The rule runs with NDP on (`sieve.late_group_columns`) and
//! only where a column it moves is of variable width (strings, binary):
//! there the groups and the joins below them shrink.

use std::sync::Arc;

use arrow::datatypes::DataType;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{Column, Result, TableReference};
use datafusion::datasource::source_as_provider;
use datafusion::logical_expr::expr::Alias;
use datafusion::logical_expr::{
    Aggregate, Expr, JoinType, LogicalPlan, LogicalPlanBuilder, Projection, Sort, TableScan,
};
use datafusion::optimizer::optimizer::ApplyOrder;
use datafusion::optimizer::{OptimizerConfig, OptimizerRule};

use crate::as_it_was::or_as_it_was;
use crate::{NdpMode, SieveConfig};

/// Groups by a table's unique key instead of the key and the columns it
/// decides, and joins those columns back after the aggregation (see the
/// module documentation).
#[derive(Debug, Default)]
pub struct JoinGroupColumnsLate;

impl OptimizerRule for JoinGroupColumnsLate {
    fn name(&self) -> &str {
        "sieve_join_group_columns_late"
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
        if !matches!(plan, LogicalPlan::Aggregate(_) | LogicalPlan::Sort(_)) {
            return Ok(Transformed::no(plan));
        }
        let options = config.options();
        let settings = SieveConfig::of(&options);
        if !settings.late_group_columns || settings.mode()? == NdpMode::Off {
            return Ok(Transformed::no(plan));
        }
        let rewritten = or_as_it_was(self.name(), || match &plan {
            LogicalPlan::Aggregate(aggregate) => {
                rewrite_aggregate(aggregate, || config.alias_generator().next(LATE_PREFIX))
            }
            LogicalPlan::Sort(sort) => push_top_rows(sort),
            _ => Ok(None),
        });
        match rewritten {
            Some(rewritten) => Ok(Transformed::yes(rewritten)),
            None => Ok(Transformed::no(plan)),
        }
    }
}

/// Prefix of the names of the tables joined again.
const LATE_PREFIX: &str = "__sieve_late";

/// A grouping column followed down to the table scan it comes from.
#[derive(Debug, Clone)]
pub(crate) struct Traced {
    /// Child indices from the aggregation's input to the scan: equal paths,
    /// the same scan.
    pub(crate) path: Vec<usize>,
    pub(crate) scan: TableScan,
    /// The column's index in the table's schema.
    pub(crate) table_column: usize,
    /// Whether an outer join may have padded the scan's side with NULLs.
    pub(crate) padded: bool,
}

/// The column at `index` of `plan`'s output, followed to the table scan
/// whose value it is unchanged; `None` through anything that computes,
/// aggregates or combines rows (only filters, sorts, limits, renames and
/// joins pass).
pub(crate) fn trace(
    plan: &LogicalPlan,
    index: usize,
    path: &mut Vec<usize>,
    padded: bool,
) -> Option<Traced> {
    match plan {
        LogicalPlan::TableScan(scan) => {
            let table_column = match &scan.projection {
                Some(projection) => *projection.get(index)?,
                None => index,
            };
            Some(Traced {
                path: path.clone(),
                scan: scan.clone(),
                table_column,
                padded,
            })
        }
        LogicalPlan::Filter(filter) => descend(&filter.input, 0, index, path, padded),
        LogicalPlan::Sort(sort) => descend(&sort.input, 0, index, path, padded),
        LogicalPlan::Limit(limit) => descend(&limit.input, 0, index, path, padded),
        LogicalPlan::SubqueryAlias(alias) => descend(&alias.input, 0, index, path, padded),
        LogicalPlan::Projection(projection) => {
            let column = match projection.expr.get(index)? {
                Expr::Column(column) => column,
                Expr::Alias(Alias { expr, .. }) => match expr.as_ref() {
                    Expr::Column(column) => column,
                    _ => return None,
                },
                _ => return None,
            };
            let index = projection.input.schema().index_of_column(column).ok()?;
            descend(&projection.input, 0, index, path, padded)
        }
        LogicalPlan::Join(join) => {
            let left_fields = join.left.schema().fields().len();
            match join.join_type {
                JoinType::Inner | JoinType::Left | JoinType::Right | JoinType::Full => {
                    if index < left_fields {
                        let padded =
                            padded || matches!(join.join_type, JoinType::Right | JoinType::Full);
                        descend(&join.left, 0, index, path, padded)
                    } else {
                        let padded =
                            padded || matches!(join.join_type, JoinType::Left | JoinType::Full);
                        descend(&join.right, 1, index - left_fields, path, padded)
                    }
                }
                JoinType::LeftSemi | JoinType::LeftAnti | JoinType::LeftMark
                    if index < left_fields =>
                {
                    descend(&join.left, 0, index, path, padded)
                }
                JoinType::RightSemi | JoinType::RightAnti => {
                    descend(&join.right, 1, index, path, padded)
                }
                _ => None,
            }
        }
        _ => None,
    }
}

fn descend(
    child: &LogicalPlan,
    child_index: usize,
    index: usize,
    path: &mut Vec<usize>,
    padded: bool,
) -> Option<Traced> {
    path.push(child_index);
    let traced = trace(child, index, path, padded);
    path.pop();
    traced
}

/// Unique, never-NULL columns of the table `scan` reads (by index in its
/// schema), if it is one of Sieve's.
pub(crate) fn unique_columns(scan: &TableScan) -> Vec<usize> {
    match source_as_provider(&scan.source) {
        Ok(provider) => crate::table::unique_columns_of(provider.as_ref()),
        Err(_) => vec![],
    }
}

pub(crate) fn variable_width(data_type: &DataType) -> bool {
    matches!(
        data_type,
        DataType::Utf8
            | DataType::LargeUtf8
            | DataType::Utf8View
            | DataType::Binary
            | DataType::LargeBinary
            | DataType::BinaryView
    )
}

/// The scan a rewrite joins again: its key's grouping expression and the
/// grouping expressions it moves after the aggregation.
struct Candidate {
    traced: Traced,
    key: usize,
    /// Grouping expressions moved, and each one's column in the table.
    moved: Vec<usize>,
    moved_columns: Vec<usize>,
}

fn rewrite_aggregate(
    aggregate: &Aggregate,
    alias: impl Fn() -> String,
) -> Result<Option<LogicalPlan>> {
    let groups = &aggregate.group_expr;
    if groups.is_empty()
        || groups
            .iter()
            .any(|expr| matches!(expr, Expr::GroupingSet(_)))
    {
        return Ok(None);
    }
    let input = aggregate.input.as_ref();
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
    let mut best: Option<Candidate> = None;
    for (key, key_traced) in traced.iter().enumerate() {
        let Some(key_traced) = key_traced else {
            continue;
        };
        if best
            .as_ref()
            .is_some_and(|best| best.traced.path == key_traced.path)
        {
            continue;
        }
        if !unique_columns(&key_traced.scan).contains(&key_traced.table_column) {
            continue;
        }
        let (moved, moved_columns): (Vec<usize>, Vec<usize>) = traced
            .iter()
            .enumerate()
            .filter_map(|(index, other)| {
                let other = other.as_ref()?;
                (index != key
                    && other.path == key_traced.path
                    && other.table_column != key_traced.table_column)
                    .then_some((index, other.table_column))
            })
            .unzip();
        let widths = moved
            .iter()
            .filter(|&&index| variable_width(aggregate.schema.field(index).data_type()))
            .count();
        // A list or struct of floats: its zeros are the aggregation's to
        // fold (`group_value`).
        if widths == 0
            || moved.iter().any(|&index| {
                crate::signed_zero::floats_inside(aggregate.schema.field(index).data_type())
            })
        {
            continue;
        }
        if best
            .as_ref()
            .is_none_or(|best| best.moved.len() < moved.len())
        {
            best = Some(Candidate {
                traced: key_traced.clone(),
                key,
                moved,
                moved_columns,
            });
        }
    }
    let Some(candidate) = best else {
        return Ok(None);
    };
    build(aggregate, &candidate, &alias()).map(Some)
}

/// Aggregation by the kept grouping expressions, joined on the key with
/// the table's moved columns, projected back to the aggregation's schema.
fn build(aggregate: &Aggregate, candidate: &Candidate, alias: &str) -> Result<LogicalPlan> {
    let groups = &aggregate.group_expr;
    let kept: Vec<usize> = (0..groups.len())
        .filter(|index| !candidate.moved.contains(index))
        .collect();
    let narrow = LogicalPlan::Aggregate(Aggregate::try_new(
        Arc::clone(&aggregate.input),
        kept.iter().map(|&index| groups[index].clone()).collect(),
        aggregate.aggr_expr.clone(),
    )?);
    let scan = &candidate.traced.scan;
    let table_schema = scan.source.schema();
    let mut projection = vec![candidate.traced.table_column];
    let moved_columns = &candidate.moved_columns;
    for &column in moved_columns {
        if !projection.contains(&column) {
            projection.push(column);
        }
    }
    let table = TableReference::bare(alias);
    let columns =
        LogicalPlanBuilder::scan(table.clone(), Arc::clone(&scan.source), Some(projection))?
            .build()?;
    let narrow_schema = Arc::clone(narrow.schema());
    let key_position = kept
        .iter()
        .position(|&index| index == candidate.key)
        .expect("the key is kept");
    let narrow_key = Column::from(narrow_schema.qualified_field(key_position));
    let table_key = Column::new(
        Some(table.clone()),
        table_schema.field(candidate.traced.table_column).name(),
    );
    let join_type = if candidate.traced.padded {
        JoinType::Left
    } else {
        JoinType::Inner
    };
    let joined = LogicalPlanBuilder::from(narrow)
        .join(
            columns,
            join_type,
            (vec![narrow_key], vec![table_key]),
            None,
        )?
        .build()?;
    let mut exprs = Vec::with_capacity(aggregate.schema.fields().len());
    for index in 0..aggregate.schema.fields().len() {
        let (qualifier, field) = aggregate.schema.qualified_field(index);
        let expr = if index < groups.len() {
            match candidate.moved.iter().position(|&moved| moved == index) {
                // A row's value, not the aggregation's: as DataFusion's
                // GROUP BY gives it (-0.0 as 0.0).
                Some(at) => crate::signed_zero::group_value(
                    Expr::Column(Column::new(
                        Some(table.clone()),
                        table_schema.field(moved_columns[at]).name(),
                    )),
                    field.data_type(),
                )
                .expect("moved columns hold no floats inside")
                .alias_qualified(qualifier.cloned(), field.name()),
                None => {
                    let position = kept.iter().position(|&kept| kept == index).expect("kept");
                    Expr::Column(Column::from(narrow_schema.qualified_field(position)))
                }
            }
        } else {
            let position = kept.len() + (index - groups.len());
            Expr::Column(Column::from(narrow_schema.qualified_field(position)))
        };
        exprs.push(expr);
    }
    Ok(LogicalPlan::Projection(Projection::try_new(
        exprs,
        Arc::new(joined),
    )?))
}

/// The first rows of a sort by the aggregation's columns above a join
/// made by [`build`], taken below that join too: it yields one row for
/// each row of the aggregation (one table row per key, or a NULL-padded
/// one), so the top rows of its output are the join of the aggregation's
/// top rows, and the table is read for those keys only (TPC-H Q10: 20
/// customers instead of 3.9 M at SF 100). The sort above stays, and puts
/// the joined rows in order again.
fn push_top_rows(sort: &Sort) -> Result<Option<LogicalPlan>> {
    let Some(fetch) = sort.fetch else {
        return Ok(None);
    };
    let mut exprs: Vec<Expr> = sort.expr.iter().map(|sort| sort.expr.clone()).collect();
    let mut projections = Vec::new();
    let mut node = sort.input.as_ref();
    while let LogicalPlan::Projection(projection) = node {
        for expr in &mut exprs {
            *expr = substitute(expr.clone(), projection)?;
        }
        projections.push(node);
        node = projection.input.as_ref();
    }
    let LogicalPlan::Join(join) = node else {
        return Ok(None);
    };
    let late = matches!(
        join.right.as_ref(),
        LogicalPlan::TableScan(scan) if scan.table_name.table().starts_with(LATE_PREFIX)
    );
    if !late
        || !matches!(join.join_type, JoinType::Inner | JoinType::Left)
        || join.filter.is_some()
        || matches!(join.left.as_ref(), LogicalPlan::Sort(below) if below.fetch.is_some())
    {
        return Ok(None);
    }
    let left_schema = join.left.schema();
    if !exprs.iter().all(|expr| {
        expr.column_refs()
            .iter()
            .all(|column| left_schema.has_column(column))
    }) {
        return Ok(None);
    }
    let below = LogicalPlan::Sort(Sort {
        expr: sort
            .expr
            .iter()
            .zip(exprs)
            .map(|(sort, expr)| sort.with_expr(expr))
            .collect(),
        input: Arc::clone(&join.left),
        fetch: Some(fetch),
    });
    let mut join = join.clone();
    join.left = Arc::new(below);
    let mut plan = LogicalPlan::Join(join);
    for projection in projections.into_iter().rev() {
        plan = projection.with_new_exprs(projection.expressions(), vec![plan])?;
    }
    Ok(Some(LogicalPlan::Sort(Sort {
        expr: sort.expr.clone(),
        input: Arc::new(plan),
        fetch: sort.fetch,
    })))
}

/// `expr` over `projection`'s output, as an expression over its input.
fn substitute(expr: Expr, projection: &Projection) -> Result<Expr> {
    expr.transform(|expr| match &expr {
        Expr::Column(column) => {
            let index = projection.schema.index_of_column(column)?;
            Ok(Transformed::yes(projection.expr[index].clone().unalias()))
        }
        _ => Ok(Transformed::no(expr)),
    })
    .map(|transformed| transformed.data)
}
