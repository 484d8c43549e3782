//! The order of a query's inner equi-joins, chosen from row estimates.
//!
//! DataFusion 55 keeps the join order of the SQL (it only avoids cross
//! joins and, in the physical plan, swaps a join's two inputs by size).
//! TPC-H Q9 lists `part, supplier, lineitem, partsupp, ...`: lineitem is
//! joined with part first, and partsupp, whole (80 M rows at SF 100),
//! becomes the build side of a later join that no join filter cuts.
//! Joined with part first (`p_partkey = ps_partkey` follows from the
//! query's `p_partkey = l_partkey` and `ps_partkey = l_partkey`), part's
//! keys cut partsupp on the storage nodes to the parts that match, and the
//! hash tables after it hold a fifth of the rows (1.63x at SF 100, measured
//! with the query rewritten by hand).
//!
//! [`OrderInnerJoins`] takes each tree of inner joins whose conditions are
//! column equalities (through projections that only pick columns), its
//! inputs ("leaves") scans of tables with statistics, and
//!
//! 1. groups the joined columns into classes of equal values (`a = b` and
//!    `b = c` put `a`, `b`, `c` in one class): two leaves can be joined on
//!    any class they share;
//! 2. estimates each leaf's rows from its table's statistics and its pushed
//!    filters (DataFusion's own `FilterExec` estimate, as the scans give it);
//! 3. costs every left-deep order that joins connected leaves only (up to
//!    [`LEAVES_MAX`] leaves), each join costed by the rows it builds (twice:
//!    a hash table) and the rows it probes, the probe side's scan cut by the
//!    join filter to the rows that match. The side built is the one the
//!    physical planner will build: of two scans the smaller; else the joins
//!    below, unless the scan is small enough to collect or filtered to
//!    fewer rows;
//! 4. keeps the SQL's order unless the cheapest is estimated to cost at most
//!    [`COST_SHARE_MAX`] of it: the estimates are coarse, and a query
//!    written in a good order keeps it;
//! 5. writes the tree left-deep, the leaves left to right in the order
//!    chosen, with the joins' other conditions in a filter above it (the
//!    next optimizer pass pushes each down): DataFusion's
//!    `EliminateCrossJoin` flattens a tree of inner joins and joins its
//!    inputs again from left to right, so this order is the one it keeps.
//!
//! A join's rows are estimated from its keys: each row of one side finds
//! at most one row on a side whose key column is unique
//! ([`crate::ClusterTable::unique_columns`]), or whose table is the smaller
//! of two joined on several columns (a composite key: partsupp's
//! `(ps_partkey, ps_suppkey)` under lineitem); otherwise from the key
//! columns' distinct values (their integer range). Each leaf carries the
//! share of its table's rows still present, so a filtered dimension cuts
//! every table that references it.
//!
//! Why the answer is the same: inner joins on equalities commute and
//! associate, and every equality of the query holds in the new tree: each
//! leaf is joined on every class it shares with those before it, so each
//! class's columns are joined along a tree that spans them (columns of one
//! class in one leaf are not reordered). A projection above restores the
//! columns and their order. The rule runs in both modes (`sieve.ndp` on and
//! off plan the same joins); `sieve.order_joins` turns it off, and so does
//! `datafusion.optimizer.join_reordering`.

use std::collections::HashMap;

use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{Column, DFSchema, ExprSchema, Result, ScalarValue};
use datafusion::datasource::source_as_provider;
use datafusion::logical_expr::execution_props::ExecutionProps;
use datafusion::logical_expr::physical_planning_context::PhysicalPlanningContext;
use datafusion::logical_expr::utils::conjunction;
use datafusion::logical_expr::{
    Expr, JoinConstraint, JoinType, LogicalPlan, LogicalPlanBuilder, TableScan,
};
use datafusion::optimizer::{OptimizerConfig, OptimizerRule};
use datafusion::physical_expr::create_physical_expr;

use crate::estimate::filtered_statistics;
use crate::SieveConfig;

/// Most leaves in one tree of joins whose orders are all costed; a larger
/// tree keeps its order.
pub(crate) const LEAVES_MAX: usize = 8;

/// The cheapest order replaces the query's only where it is estimated to
/// cost at most this share of it.
pub(crate) const COST_SHARE_MAX: f64 = 0.8;

/// Hash table rows cost this many times a probed row.
const BUILD_WEIGHT: f64 = 2.0;

/// Orders trees of inner equi-joins by estimated cost (see the module
/// documentation).
#[derive(Debug, Default)]
pub struct OrderInnerJoins;

impl OptimizerRule for OrderInnerJoins {
    fn name(&self) -> &str {
        "sieve_order_inner_joins"
    }

    fn supports_rewrite(&self) -> bool {
        true
    }

    fn rewrite(
        &self,
        plan: LogicalPlan,
        config: &dyn OptimizerConfig,
    ) -> Result<Transformed<LogicalPlan>> {
        let options = config.options();
        // `datafusion.optimizer.join_reordering = false` keeps the SQL's
        // order too, as it keeps DataFusion's own swaps out.
        if !SieveConfig::of(&options).order_joins || !options.optimizer.join_reordering {
            return Ok(Transformed::no(plan));
        }
        let collect_rows_max = options.optimizer.hash_join_single_partition_threshold_rows;
        order(plan, collect_rows_max)
    }
}

/// `plan` with each tree of inner equi-joins in it ordered, from the top.
fn order(plan: LogicalPlan, collect_rows_max: usize) -> Result<Transformed<LogicalPlan>> {
    if !is_region_join(&plan) {
        return plan.map_children(|child| order(child, collect_rows_max));
    }
    let mut region = Region::default();
    // A tree is reordered only where every leaf is a table scan (under
    // aliases and projections), so a reordered tree has no joins below its
    // leaves; a tree kept has its leaves ordered inside.
    if region.collect(&plan) {
        // A plan this rule cannot rebuild is planned as it was: the rule is
        // an optimization, never a reason for a query to fail.
        match region.reorder(&plan, collect_rows_max) {
            Ok(Some(reordered)) => return Ok(Transformed::yes(reordered)),
            Ok(None) => {}
            Err(error) => log::debug!("join order kept: {error}"),
        }
    }
    within_region(plan, collect_rows_max)
}

/// `plan`, a join of a tree kept in its order, with the leaves under it
/// ordered.
fn within_region(plan: LogicalPlan, collect_rows_max: usize) -> Result<Transformed<LogicalPlan>> {
    plan.map_children(|child| {
        if region_child(&child).is_some() {
            within_region(child, collect_rows_max)
        } else {
            order(child, collect_rows_max)
        }
    })
}

/// An inner join on column equalities (and any other condition): a node of
/// a tree this rule orders.
fn is_region_join(plan: &LogicalPlan) -> bool {
    let LogicalPlan::Join(join) = plan else {
        return false;
    };
    join.join_type == JoinType::Inner
        && join.join_constraint == JoinConstraint::On
        && !join.null_aware
        && join.null_equality == datafusion::common::NullEquality::NullEqualsNothing
        && !join.on.is_empty()
        && join
            .on
            .iter()
            .all(|(left, right)| matches!((left, right), (Expr::Column(_), Expr::Column(_))))
}

/// A projection that only picks columns, over a join of the tree.
fn region_child(plan: &LogicalPlan) -> Option<&LogicalPlan> {
    match plan {
        LogicalPlan::Projection(projection)
            if projection
                .expr
                .iter()
                .all(|expr| matches!(expr, Expr::Column(_))) =>
        {
            let input = projection.input.as_ref();
            region_child(input)
        }
        plan if is_region_join(plan) => Some(plan),
        _ => None,
    }
}

/// A tree of inner equi-joins: its leaves, its equalities and the order
/// the query joins its leaves in.
#[derive(Default)]
struct Region {
    leaves: Vec<LogicalPlan>,
    equalities: Vec<(Column, Column)>,
    /// The joins' other conditions, applied above the tree (DataFusion's
    /// filter pushdown moves each to the lowest join that has its columns).
    conditions: Vec<Expr>,
    /// The query's order of the leaves (indices into `leaves`); left-deep.
    sequence: Vec<usize>,
}

impl Region {
    /// Gathers the tree under `plan`; false if it is not left-deep (a join
    /// of two joins keeps its shape).
    fn collect(&mut self, plan: &LogicalPlan) -> bool {
        let LogicalPlan::Join(join) = plan else {
            return false;
        };
        self.conditions.extend(join.filter.clone());
        for (left, right) in &join.on {
            if let (Expr::Column(left), Expr::Column(right)) = (left, right) {
                self.equalities.push((left.clone(), right.clone()));
            }
        }
        let (left, right) = (region_child(&join.left), region_child(&join.right));
        match (left, right) {
            (Some(_), Some(_)) => false,
            (Some(inner), None) => {
                let ok = self.collect(inner);
                self.push_leaf(join.right.as_ref());
                ok
            }
            (None, Some(inner)) => {
                let ok = self.collect(inner);
                self.push_leaf(join.left.as_ref());
                ok
            }
            (None, None) => {
                self.push_leaf(join.left.as_ref());
                self.push_leaf(join.right.as_ref());
                true
            }
        }
    }

    fn push_leaf(&mut self, leaf: &LogicalPlan) {
        self.sequence.push(self.leaves.len());
        self.leaves.push(leaf.clone());
    }

    /// The tree joined in its cheapest order, or `None` to keep the
    /// query's.
    fn reorder(&self, root: &LogicalPlan, collect_rows_max: usize) -> Result<Option<LogicalPlan>> {
        // Two leaves have one order; DataFusion picks the side it builds.
        if self.leaves.len() < 3 || self.leaves.len() > LEAVES_MAX {
            return Ok(None);
        }
        let Some(graph) = Graph::new(&self.leaves, &self.equalities, collect_rows_max) else {
            return Ok(None);
        };
        let Some(current) = graph.cost(&self.sequence) else {
            return Ok(None);
        };
        let Some((best, cost)) = graph.cheapest() else {
            return Ok(None);
        };
        if cost > COST_SHARE_MAX * current || same_order(&best, &self.sequence) {
            return Ok(None);
        }
        log::debug!(
            "join order {:?} (estimated cost {cost:.0}) for {:?} ({current:.0})",
            best,
            self.sequence
        );
        self.build(&graph, &best, root).map(Some)
    }

    /// The leaves joined in `sequence`, each on every class it shares
    /// with those before it, and projected to `root`'s columns.
    fn build(&self, graph: &Graph, sequence: &[usize], root: &LogicalPlan) -> Result<LogicalPlan> {
        let first = sequence[0];
        let mut plan = self.leaves[first].clone();
        let mut state = graph.start(first);
        for &next in &sequence[1..] {
            let mut joined_keys = vec![];
            let mut next_keys = vec![];
            for class in graph.connecting(&state, next) {
                let (Some(joined), Some(own)) = (
                    graph.member_in(class, |leaf| state.has(leaf)),
                    graph.member_in(class, |leaf| leaf == next),
                ) else {
                    return datafusion::common::plan_err!("join class without both sides");
                };
                joined_keys.push(graph.columns[joined].clone());
                next_keys.push(graph.columns[own].clone());
            }
            // Left-deep, the leaves from left to right in their order:
            // DataFusion's `EliminateCrossJoin` flattens a tree of inner
            // joins and joins its inputs again from left to right, and the
            // physical planner picks each join's build side.
            plan = LogicalPlanBuilder::from(plan)
                .join(
                    self.leaves[next].clone(),
                    JoinType::Inner,
                    (joined_keys, next_keys),
                    None,
                )?
                .build()?;
            state = graph.step(&state, next).0;
        }
        let mut plan = LogicalPlanBuilder::from(plan);
        if let Some(condition) = conjunction(self.conditions.iter().cloned()) {
            plan = plan.filter(condition)?;
        }
        let columns = root.schema().columns().into_iter().map(Expr::Column);
        plan.project(columns)?.build()
    }
}

/// What is estimated of a leaf.
#[derive(Debug, Clone)]
struct LeafEstimate {
    /// Rows after its filters.
    rows: f64,
    /// Rows of its table.
    table_rows: f64,
}

/// Each column of a leaf: whether it is unique in its table, and its
/// distinct values at most.
type LeafColumns = HashMap<Column, (bool, f64)>;

/// One joined column: its leaf, whether it is unique in its table, and an
/// upper bound of its distinct values.
#[derive(Debug, Clone)]
struct ColumnEstimate {
    leaf: usize,
    unique: bool,
    distinct: f64,
}

/// Leaves, their joined columns and the classes of equal columns.
struct Graph {
    leaves: Vec<LeafEstimate>,
    columns: Vec<Column>,
    column_estimates: Vec<ColumnEstimate>,
    /// Each class: indices into `columns`, one per leaf at most.
    classes: Vec<Vec<usize>>,
    /// DataFusion collects a join's build side whole (and swaps a join's
    /// inputs for it) up to this many rows
    /// (`datafusion.optimizer.hash_join_single_partition_threshold_rows`).
    collect_rows_max: f64,
}

/// A set of leaves joined: which, their estimated rows, and the share of
/// each leaf's table rows still present.
#[derive(Debug, Clone)]
struct Joined {
    members: u64,
    rows: f64,
    shares: Vec<f64>,
}

impl Joined {
    fn has(&self, leaf: usize) -> bool {
        self.members & (1 << leaf) != 0
    }
}

impl Graph {
    /// `None` where a leaf has no estimate, a class holds two columns of
    /// one leaf or columns of different types, or a column is not found.
    fn new(
        leaves: &[LogicalPlan],
        equalities: &[(Column, Column)],
        collect_rows_max: usize,
    ) -> Option<Self> {
        let estimates: Vec<(LeafEstimate, LeafColumns)> =
            leaves.iter().map(leaf_estimate).collect::<Option<_>>()?;
        let mut columns: Vec<Column> = vec![];
        let mut column_estimates = vec![];
        let index_of = |column: &Column,
                        columns: &mut Vec<Column>,
                        column_estimates: &mut Vec<ColumnEstimate>|
         -> Option<usize> {
            if let Some(index) = columns.iter().position(|known| known == column) {
                return Some(index);
            }
            let found: Vec<usize> = leaves
                .iter()
                .enumerate()
                .filter(|(_, leaf)| leaf.schema().has_column(column))
                .map(|(index, _)| index)
                .collect();
            let [leaf] = found[..] else {
                return None;
            };
            let (unique, distinct) = *estimates[leaf].1.get(column)?;
            columns.push(column.clone());
            column_estimates.push(ColumnEstimate {
                leaf,
                unique,
                distinct,
            });
            Some(columns.len() - 1)
        };
        // Union-find over the joined columns.
        let mut parent: Vec<usize> = vec![];
        fn root(parent: &mut [usize], mut at: usize) -> usize {
            while parent[at] != at {
                parent[at] = parent[parent[at]];
                at = parent[at];
            }
            at
        }
        for (left, right) in equalities {
            let left = index_of(left, &mut columns, &mut column_estimates)?;
            let right = index_of(right, &mut columns, &mut column_estimates)?;
            while parent.len() < columns.len() {
                parent.push(parent.len());
            }
            let (a, b) = (root(&mut parent, left), root(&mut parent, right));
            parent[a] = b;
        }
        let mut classes: HashMap<usize, Vec<usize>> = HashMap::new();
        for column in 0..columns.len() {
            classes
                .entry(root(&mut parent, column))
                .or_default()
                .push(column);
        }
        let mut classes: Vec<Vec<usize>> = classes.into_values().collect();
        classes.sort();
        for class in &classes {
            let mut seen = 0u64;
            let data_type = |column: usize| {
                let leaf = column_estimates[column].leaf;
                leaves[leaf]
                    .schema()
                    .field_from_column(&columns[column])
                    .ok()
                    .map(|field| field.data_type().clone())
            };
            let first_type = data_type(class[0])?;
            for &column in class {
                let bit = 1u64 << column_estimates[column].leaf;
                if seen & bit != 0 || data_type(column)? != first_type {
                    return None;
                }
                seen |= bit;
            }
        }
        Some(Self {
            leaves: estimates.into_iter().map(|(leaf, _)| leaf).collect(),
            columns,
            column_estimates,
            classes,
            collect_rows_max: collect_rows_max as f64,
        })
    }

    fn start(&self, leaf: usize) -> Joined {
        let mut shares = vec![0.0; self.leaves.len()];
        shares[leaf] = share(self.leaves[leaf].rows, self.leaves[leaf].table_rows);
        Joined {
            members: 1 << leaf,
            rows: self.leaves[leaf].rows,
            shares,
        }
    }

    /// Classes with a column in `leaf` and one in the joined set.
    fn connecting<'a>(
        &'a self,
        joined: &'a Joined,
        leaf: usize,
    ) -> impl Iterator<Item = usize> + 'a {
        (0..self.classes.len()).filter(move |&class| {
            self.member_in(class, |at| at == leaf).is_some()
                && self.member_in(class, |at| joined.has(at)).is_some()
        })
    }

    /// The first column of `class` whose leaf satisfies `pick`.
    fn member_in(&self, class: usize, pick: impl Fn(usize) -> bool) -> Option<usize> {
        self.classes[class]
            .iter()
            .copied()
            .find(|&column| pick(self.column_estimates[column].leaf))
    }

    /// The joined set with `leaf` joined, and the join's cost.
    fn step(&self, joined: &Joined, leaf: usize) -> (Joined, f64) {
        let own = &self.leaves[leaf];
        let classes: Vec<usize> = self.connecting(joined, leaf).collect();
        let own_share = share(own.rows, own.table_rows);
        let mut rows = joined.rows * own.rows;
        for &class in &classes {
            let own_column = self.member_in(class, |at| at == leaf).expect("connecting");
            let own_column = &self.column_estimates[own_column];
            let mut estimate = if own_column.unique {
                // Each joined row finds at most one row of the leaf.
                joined.rows * own_share
            } else {
                f64::INFINITY
            };
            let mut distinct = own_column.distinct;
            for &column in &self.classes[class] {
                let other = &self.column_estimates[column];
                if !joined.has(other.leaf) {
                    continue;
                }
                distinct = distinct.max(other.distinct);
                if other.unique {
                    // Each row of the leaf finds one row of `other`'s table,
                    // present as often as the joined set holds it.
                    let table = self.leaves[other.leaf].table_rows.max(1.0);
                    estimate = estimate.min(own.rows * joined.rows / table);
                }
            }
            if !estimate.is_finite() {
                estimate = joined.rows * own.rows / distinct.max(1.0);
            }
            rows = rows.min(estimate);
        }
        if classes.len() > 1 {
            // Several columns: a composite key of the smaller table.
            for other in 0..self.leaves.len() {
                if !joined.has(other)
                    || !classes
                        .iter()
                        .all(|&class| self.member_in(class, |at| at == other).is_some())
                {
                    continue;
                }
                let other_table = self.leaves[other].table_rows.max(1.0);
                if other_table < own.table_rows {
                    rows = rows.min(own.rows * joined.rows / other_table);
                } else if own.table_rows < other_table {
                    rows = rows.min(joined.rows * own_share);
                }
            }
        }
        let rows = rows.max(1.0);
        // The input built, as the physical planner chooses it: of two
        // scans the smaller (DataFusion's `JoinSelection`, by
        // statistics); a join's output has none, so it is built unless
        // the scan is small enough to collect or filtered to fewer rows
        // ([`crate::BuildOnFilteredSide`]). The other input is probed; a
        // probed scan is cut by the join filter to the rows that can match.
        let build_leaf = if joined.members.count_ones() == 1 {
            own.rows < joined.rows
        } else {
            own.rows <= self.collect_rows_max
                || (own.rows < own.table_rows && own.rows < joined.rows)
        };
        let cost = if build_leaf {
            BUILD_WEIGHT * own.rows + joined.rows
        } else {
            BUILD_WEIGHT * joined.rows + own.rows.min(rows)
        };
        let cut = (rows / joined.rows.max(1.0)).min(1.0);
        let mut shares = joined.shares.clone();
        for (member, value) in shares.iter_mut().enumerate() {
            if joined.has(member) {
                let table = self.leaves[member].table_rows.max(1.0);
                *value = (*value * cut).min(rows / table);
            }
        }
        shares[leaf] = own_share.min(rows / own.table_rows.max(1.0));
        let next = Joined {
            members: joined.members | 1 << leaf,
            rows,
            shares,
        };
        (next, cost)
    }

    /// The cost of joining the leaves in `sequence`; `None` if a leaf has
    /// no class in common with those before it.
    fn cost(&self, sequence: &[usize]) -> Option<f64> {
        let mut joined = self.start(*sequence.first()?);
        let mut total = 0.0;
        for &leaf in &sequence[1..] {
            self.connecting(&joined, leaf).next()?;
            let (next, cost) = self.step(&joined, leaf);
            joined = next;
            total += cost;
        }
        Some(total)
    }

    /// The cheapest left-deep order that joins connected leaves only.
    fn cheapest(&self) -> Option<(Vec<usize>, f64)> {
        let mut best: Option<(Vec<usize>, f64)> = None;
        let mut sequence = vec![];
        for first in 0..self.leaves.len() {
            sequence.push(first);
            self.search(&self.start(first), 0.0, &mut sequence, &mut best);
            sequence.pop();
        }
        best
    }

    fn search(
        &self,
        joined: &Joined,
        cost: f64,
        sequence: &mut Vec<usize>,
        best: &mut Option<(Vec<usize>, f64)>,
    ) {
        if matches!(best, Some((_, best_cost)) if cost >= *best_cost) {
            return;
        }
        if sequence.len() == self.leaves.len() {
            *best = Some((sequence.clone(), cost));
            return;
        }
        for leaf in 0..self.leaves.len() {
            if joined.has(leaf) || self.connecting(joined, leaf).next().is_none() {
                continue;
            }
            let (next, step) = self.step(joined, leaf);
            sequence.push(leaf);
            self.search(&next, cost + step, sequence, best);
            sequence.pop();
        }
    }
}

/// Whether two left-deep orders join the same trees (the first two
/// leaves of either are one join).
fn same_order(one: &[usize], other: &[usize]) -> bool {
    one.len() == other.len()
        && one.len() >= 2
        && one[2..] == other[2..]
        && (one[..2] == other[..2] || (one[0] == other[1] && one[1] == other[0]))
}

fn share(rows: f64, table_rows: f64) -> f64 {
    if table_rows <= 0.0 {
        1.0
    } else {
        (rows / table_rows).min(1.0)
    }
}

/// A leaf's estimated rows and, for each of its columns, whether it is
/// unique in its table and its distinct values at most; `None` unless the
/// leaf is a table scan with statistics (under aliases and projections
/// that pick columns).
fn leaf_estimate(plan: &LogicalPlan) -> Option<(LeafEstimate, LeafColumns)> {
    let (scan, table_columns) = scan_under(plan)?;
    let provider = source_as_provider(&scan.source).ok()?;
    let statistics = provider.statistics()?;
    let table_rows = *statistics.num_rows.get_value()? as f64;
    let rows = match conjunction(scan.filters.iter().cloned()) {
        None => table_rows,
        Some(filter) => {
            let schema = provider.schema();
            let df_schema =
                DFSchema::try_from_qualified_schema(scan.table_name.clone(), &schema).ok()?;
            let predicate = create_physical_expr(
                &filter,
                &df_schema,
                &ExecutionProps::new(),
                &PhysicalPlanningContext::default(),
            )
            .ok()?;
            let filtered = filtered_statistics(&schema, &statistics, &predicate).ok()?;
            *filtered.num_rows.get_value()? as f64
        }
    };
    let unique = crate::table::unique_columns_of(provider.as_ref());
    let mut columns = HashMap::new();
    for (column, table_column) in plan.schema().columns().into_iter().zip(table_columns) {
        let column_statistics = statistics.column_statistics.get(table_column);
        let mut distinct = table_rows;
        if let Some(column_statistics) = column_statistics {
            if let Some(&count) = column_statistics.distinct_count.get_value() {
                distinct = distinct.min(count as f64);
            }
            let (min, max) = (
                column_statistics.min_value.get_value(),
                column_statistics.max_value.get_value(),
            );
            if let (Some(min), Some(max)) = (min.and_then(as_i128), max.and_then(as_i128)) {
                distinct = distinct.min((max - min + 1).max(1) as f64);
            }
        }
        let is_unique = unique.contains(&table_column);
        columns.insert(column, (is_unique, distinct.min(rows).max(1.0)));
    }
    let estimate = LeafEstimate {
        rows: rows.max(1.0),
        table_rows,
    };
    Some((estimate, columns))
}

fn as_i128(value: &ScalarValue) -> Option<i128> {
    match value {
        ScalarValue::Int8(Some(v)) => Some(*v as i128),
        ScalarValue::Int16(Some(v)) => Some(*v as i128),
        ScalarValue::Int32(Some(v)) => Some(*v as i128),
        ScalarValue::Int64(Some(v)) => Some(*v as i128),
        ScalarValue::UInt8(Some(v)) => Some(*v as i128),
        ScalarValue::UInt16(Some(v)) => Some(*v as i128),
        ScalarValue::UInt32(Some(v)) => Some(*v as i128),
        ScalarValue::UInt64(Some(v)) => Some(*v as i128),
        _ => None,
    }
}

/// The table scan under `plan` and, for each column of `plan`, its column
/// in the table's schema.
fn scan_under(plan: &LogicalPlan) -> Option<(&TableScan, Vec<usize>)> {
    match plan {
        LogicalPlan::TableScan(scan) => {
            if scan.fetch.is_some() {
                return None;
            }
            let columns = match &scan.projection {
                Some(projection) => projection.clone(),
                None => (0..scan.source.schema().fields().len()).collect(),
            };
            Some((scan, columns))
        }
        LogicalPlan::SubqueryAlias(alias) => scan_under(&alias.input),
        LogicalPlan::Projection(projection) => {
            let (scan, below) = scan_under(&projection.input)?;
            let input_schema = projection.input.schema();
            let columns = projection
                .expr
                .iter()
                .map(|expr| match expr {
                    Expr::Column(column) => input_schema
                        .index_of_column(column)
                        .ok()
                        .and_then(|index| below.get(index).copied()),
                    _ => None,
                })
                .collect::<Option<Vec<usize>>>()?;
            Some((scan, columns))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(leaves: &[(f64, f64)], columns: &[(usize, bool, f64)], classes: &[&[usize]]) -> Graph {
        Graph {
            leaves: leaves
                .iter()
                .map(|&(rows, table_rows)| LeafEstimate { rows, table_rows })
                .collect(),
            columns: (0..columns.len())
                .map(|index| Column::from_name(format!("c{index}")))
                .collect(),
            column_estimates: columns
                .iter()
                .map(|&(leaf, unique, distinct)| ColumnEstimate {
                    leaf,
                    unique,
                    distinct,
                })
                .collect(),
            classes: classes.iter().map(|class| class.to_vec()).collect(),
            collect_rows_max: 128.0 * 1024.0,
        }
    }

    /// TPC-H Q9 at SF 100 with DataFusion's 20% for `LIKE`: leaves part,
    /// supplier, lineitem, partsupp, orders, nation (the SQL's order).
    fn q9() -> Graph {
        let m = 1e6;
        graph(
            &[
                (4.0 * m, 20.0 * m),
                (1.0 * m, 1.0 * m),
                (600.0 * m, 600.0 * m),
                (80.0 * m, 80.0 * m),
                (150.0 * m, 150.0 * m),
                (25.0, 25.0),
            ],
            &[
                (0, true, 4.0 * m),    // 0 p_partkey
                (2, false, 20.0 * m),  // 1 l_partkey
                (3, false, 20.0 * m),  // 2 ps_partkey
                (1, true, 1.0 * m),    // 3 s_suppkey
                (2, false, 1.0 * m),   // 4 l_suppkey
                (3, false, 1.0 * m),   // 5 ps_suppkey
                (4, true, 150.0 * m),  // 6 o_orderkey
                (2, false, 150.0 * m), // 7 l_orderkey
                (1, false, 25.0),      // 8 s_nationkey
                (5, true, 25.0),       // 9 n_nationkey
            ],
            &[&[0, 1, 2], &[3, 4, 5], &[6, 7], &[8, 9]],
        )
    }

    #[test]
    fn q9_joins_part_with_partsupp_before_lineitem() {
        let graph = q9();
        let written = graph.cost(&[0, 2, 1, 3, 4, 5]).unwrap();
        let (best, cost) = graph.cheapest().unwrap();
        assert!(cost <= COST_SHARE_MAX * written, "{cost} against {written}");
        let position = |leaf| best.iter().position(|&at| at == leaf).unwrap();
        assert!(
            position(3) < position(2),
            "partsupp before lineitem: {best:?}"
        );
        assert!(position(0) < position(2), "part before lineitem: {best:?}");
    }

    #[test]
    fn a_fact_joined_to_filtered_dimensions_first_keeps_its_order() {
        // lineitem ⋈ part (filtered) ⋈ supplier: already cheapest-ish.
        let m = 1e6;
        let graph = graph(
            &[
                (4.0 * m, 20.0 * m),
                (600.0 * m, 600.0 * m),
                (1.0 * m, 1.0 * m),
            ],
            &[
                (0, true, 4.0 * m),
                (1, false, 20.0 * m),
                (1, false, 1.0 * m),
                (2, true, 1.0 * m),
            ],
            &[&[0, 1], &[2, 3]],
        );
        let written = graph.cost(&[0, 1, 2]).unwrap();
        let (_, cost) = graph.cheapest().unwrap();
        assert!(cost > COST_SHARE_MAX * written, "{cost} against {written}");
    }

    #[test]
    fn only_connected_orders_are_costed() {
        let graph = q9();
        // supplier and orders share no class.
        assert!(graph.cost(&[1, 4, 0, 2, 3, 5]).is_none());
        let (best, _) = graph.cheapest().unwrap();
        for at in 1..best.len() {
            let mut joined = graph.start(best[0]);
            for &leaf in &best[1..at] {
                joined = graph.step(&joined, leaf).0;
            }
            assert!(graph.connecting(&joined, best[at]).next().is_some());
        }
    }
}
