//! Grouped `count(DISTINCT x)` over a join counted with one set of
//! (group, value) pairs, not regrouped by every grouping column and `x`.
//!
//! DataFusion's `SingleDistinctToGroupBy` rewrites
//!
//! ```text
//!   Aggregate(group by a, b; count(DISTINCT x))
//! =>
//!   Aggregate(group by a, b; count(x))
//!     Aggregate(group by a, b, x)
//! ```
//!
//! The inner aggregation holds one group per distinct (a, b, x): every
//! grouping column again for each value. TPC-H Q16 groups the join of
//! partsupp and part by brand, type and size and counts distinct
//! suppliers: 11.9 M such groups at SF 100, about 105 bytes each with
//! their hash table, 1.25 GB, the compute node's largest allocation at
//! that scale. DataFusion 55 also counts distinct integers per group
//! with a groups accumulator (`PrimitiveDistinctCountGroupsAccumulator`):
//! one hash set of (group index, value), 16 bytes a pair, each grouping
//! column held once per group. [`CountDistinctBySets`] keeps the original
//! aggregation there (measured at SF 100: Q16's process peak 1.59 ->
//! 0.98 GB, its aggregations' compute time the same).
//!
//! Where the rewrite is kept (the rule delegates to DataFusion's):
//!
//! - an aggregation without GROUP BY: its one group would be counted on
//!   one thread, where the rewrite spreads the values over all of them;
//! - a DISTINCT argument other than an integer (DataFusion has no groups
//!   accumulator for it, and would feed one row accumulator per group);
//! - a DISTINCT aggregate other than `count`;
//! - an input that is one table's scan (through filters, projections and
//!   aliases): the rewrite's inner aggregation is then a scan's, which
//!   [`crate::PushAggregateToStorage`] runs on the storage nodes, so
//!   only distinct pairs are shipped;
//! - `sieve.count_distinct_by_sets` off.
//!
//! Both plans give the same counts: a set per group counts each non-NULL
//! value once, as grouping by the value and counting non-NULL groups does.

use datafusion::common::tree_node::Transformed;
use datafusion::common::Result;
use datafusion::logical_expr::expr::AggregateFunction;
use datafusion::logical_expr::{Aggregate, Expr, ExprSchemable, LogicalPlan};
use datafusion::optimizer::optimizer::ApplyOrder;
use datafusion::optimizer::single_distinct_to_groupby::SingleDistinctToGroupBy;
use datafusion::optimizer::{OptimizerConfig, OptimizerRule};

use crate::SieveConfig;

/// DataFusion's `SingleDistinctToGroupBy`, declined for grouped integer
/// `count(DISTINCT)` over anything but one table's scan (see the module
/// documentation). It takes that rule's place in the optimizer.
#[derive(Debug, Default)]
pub struct CountDistinctBySets {
    rewrite: SingleDistinctToGroupBy,
}

impl CountDistinctBySets {
    /// The name of the DataFusion rule this one replaces.
    pub const REPLACES: &'static str = "single_distinct_aggregation_to_group_by";
}

impl OptimizerRule for CountDistinctBySets {
    fn name(&self) -> &str {
        "sieve_count_distinct_by_sets"
    }

    fn apply_order(&self) -> Option<ApplyOrder> {
        self.rewrite.apply_order()
    }

    fn supports_rewrite(&self) -> bool {
        true
    }

    fn rewrite(
        &self,
        plan: LogicalPlan,
        config: &dyn OptimizerConfig,
    ) -> Result<Transformed<LogicalPlan>> {
        if let LogicalPlan::Aggregate(aggregate) = &plan {
            let options = config.options();
            if SieveConfig::of(&options).count_distinct_by_sets && counted_by_sets(aggregate) {
                return Ok(Transformed::no(plan));
            }
        }
        self.rewrite.rewrite(plan, config)
    }
}

/// Whether `aggregate` is better left to DataFusion's distinct-count groups
/// accumulator than regrouped.
fn counted_by_sets(aggregate: &Aggregate) -> bool {
    if aggregate.group_expr.is_empty()
        || matches!(aggregate.group_expr.first(), Some(Expr::GroupingSet(_)))
        || one_scan(&aggregate.input)
    {
        return false;
    }
    let schema = aggregate.input.schema();
    let mut distinct = 0;
    for expr in &aggregate.aggr_expr {
        let Expr::AggregateFunction(AggregateFunction { func, params }) = expr else {
            return false;
        };
        if !params.distinct {
            continue;
        }
        distinct += 1;
        let [arg] = &params.args[..] else {
            return false;
        };
        let integer = arg
            .get_type(schema.as_ref())
            .is_ok_and(|data_type| data_type.is_integer());
        if func.name() != "count" || !integer {
            return false;
        }
    }
    distinct > 0
}

/// Whether `plan` is one table's scan under filters, projections and
/// aliases only.
fn one_scan(plan: &LogicalPlan) -> bool {
    match plan {
        LogicalPlan::TableScan(_) => true,
        LogicalPlan::Filter(_) | LogicalPlan::Projection(_) | LogicalPlan::SubqueryAlias(_) => {
            plan.inputs().into_iter().all(one_scan)
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::functions_aggregate::expr_fn::{count_distinct, sum};
    use datafusion::logical_expr::{col, table_scan, JoinType, LogicalPlanBuilder};
    use datafusion::optimizer::OptimizerContext;

    fn scan(name: &str) -> LogicalPlanBuilder {
        let schema = Schema::new(vec![
            Field::new("k", DataType::Int64, true),
            Field::new("g", DataType::Utf8, true),
            Field::new("x", DataType::Int64, true),
            Field::new("s", DataType::Utf8, true),
        ]);
        table_scan(Some(name), &schema, None).unwrap()
    }

    fn joined() -> LogicalPlanBuilder {
        scan("a")
            .join(
                scan("b").build().unwrap(),
                JoinType::Inner,
                (vec!["a.k"], vec!["b.k"]),
                None,
            )
            .unwrap()
    }

    fn rewritten(plan: LogicalPlan) -> bool {
        let rule = CountDistinctBySets::default();
        let context = OptimizerContext::new();
        rule.rewrite(plan, &context).unwrap().transformed
    }

    #[test]
    fn grouped_integer_count_over_a_join_is_kept() {
        let plan = joined()
            .aggregate(
                vec![col("a.g")],
                vec![count_distinct(col("b.x")), sum(col("a.x"))],
            )
            .unwrap()
            .build()
            .unwrap();
        assert!(!rewritten(plan));
    }

    #[test]
    fn other_shapes_are_rewritten() {
        // No GROUP BY.
        let ungrouped = joined()
            .aggregate(Vec::<Expr>::new(), vec![count_distinct(col("b.x"))])
            .unwrap()
            .build()
            .unwrap();
        // A string argument.
        let strings = joined()
            .aggregate(vec![col("a.g")], vec![count_distinct(col("b.s"))])
            .unwrap()
            .build()
            .unwrap();
        // One table's scan, filtered.
        let one_table = scan("a")
            .filter(col("x").gt(datafusion::logical_expr::lit(1i64)))
            .unwrap()
            .aggregate(vec![col("g")], vec![count_distinct(col("x"))])
            .unwrap()
            .build()
            .unwrap();
        for plan in [ungrouped, strings, one_table] {
            assert!(rewritten(plan.clone()), "not rewritten:\n{plan}");
        }
    }
}
