//! Deep expressions on the compute node: a bound on how deep a query's
//! expressions may nest, the one rewrite that makes the common deep query
//! shallow, and the thread stacks planning needs.
//!
//! DataFusion plans and evaluates expressions by recursion, so a deep
//! expression needs stack in proportion (a 700-term `a + 1 + ... > 0` takes
//! more than the 2 MiB of a default thread in a debug build), and some of
//! its planning work grows with the cube of the depth (the filter's interval
//! analysis compares subtrees). [`ExpressionDepthLimit`] runs before every
//! other analyzer rule:
//!
//! - a chain of `e = literal` joined by OR (machine-written SQL's way of
//!   asking for a list of values) becomes `e IN (literals)`, which means the
//!   same for every input, NULLs included, and is one level deep;
//! - any expression still deeper than `sieve.expression_depth_max` is
//!   refused with an error naming the setting, before DataFusion recurses
//!   into it.
//!
//! Depth is measured with an explicit stack. [`compute_runtime`] gives
//! Sieve's threads stacks that hold what the limit lets through.

use std::sync::Arc;

use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{plan_err, Result};
use datafusion::logical_expr::{BinaryExpr, Expr, LogicalPlan, Operator};
use datafusion::optimizer::AnalyzerRule;

use crate::SieveConfig;

/// Stack of each thread of [`compute_runtime`], in bytes: virtual memory,
/// committed only as a deep plan touches it. Planning and running a filter
/// [`DEFAULT_EXPRESSION_DEPTH_MAX`] levels deep takes about a tenth of it
/// in a debug build.
pub const COMPUTE_THREAD_STACK_BYTES: usize = 256 * 1024 * 1024;

/// Default of `sieve.expression_depth_max`.
pub const DEFAULT_EXPRESSION_DEPTH_MAX: usize = 1000;

/// OR chains of equalities shorter than this stay as they are (DataFusion
/// plans short ones well, and may turn small IN lists back into ORs).
const OR_CHAIN_TO_IN_LIST_MIN: usize = 16;

/// A multi-threaded Tokio runtime whose threads have
/// [`COMPUTE_THREAD_STACK_BYTES`] of stack: run compute sessions (and an
/// embedded cluster) on it, inside a spawned task rather than `block_on`'s
/// own thread.
pub fn compute_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .thread_stack_size(COMPUTE_THREAD_STACK_BYTES)
        .enable_all()
        .build()
}

/// The analyzer rule of this module; see the module documentation.
#[derive(Debug, Default)]
pub struct ExpressionDepthLimit;

impl AnalyzerRule for ExpressionDepthLimit {
    fn analyze(&self, plan: LogicalPlan, config: &ConfigOptions) -> Result<LogicalPlan> {
        let limit = SieveConfig::of(config).expression_depth_max;
        let plan = plan
            .transform_up_with_subqueries(|node| {
                node.map_expressions(|expr| {
                    if expression_depth(&expr, OR_CHAIN_TO_IN_LIST_MIN) <= OR_CHAIN_TO_IN_LIST_MIN {
                        return Ok(Transformed::no(expr));
                    }
                    expr.transform_down(|expr| Ok(or_chain_to_in_list(expr)))
                })
            })?
            .data;
        plan.apply_with_subqueries(|node| {
            for expr in node.expressions() {
                let depth = expression_depth(&expr, limit);
                if depth > limit {
                    return plan_err!(
                        "an expression of this query nests more than {limit} levels deep \
                         (sieve.expression_depth_max): write long lists of values as IN (...), \
                         or raise the setting"
                    );
                }
            }
            Ok(TreeNodeRecursion::Continue)
        })?;
        Ok(plan)
    }

    fn name(&self) -> &str {
        "sieve_expression_depth_limit"
    }
}

/// Levels from `expr` to its deepest leaf, counted with an explicit stack;
/// stops once past `stop` (a hostile tree costs bounded work).
pub fn expression_depth(expr: &Expr, stop: usize) -> usize {
    let mut deepest = 0;
    let mut stack: Vec<(&Expr, usize)> = vec![(expr, 1)];
    while let Some((node, depth)) = stack.pop() {
        deepest = deepest.max(depth);
        if deepest > stop {
            break;
        }
        // `apply_children` visits the direct children only: no recursion.
        let _ = node.apply_children(|child| {
            stack.push((child, depth + 1));
            Ok(TreeNodeRecursion::Continue)
        });
    }
    deepest
}

/// `e = l1 OR e = l2 OR ...` (at least [`OR_CHAIN_TO_IN_LIST_MIN`] terms,
/// any nesting of the ORs, literals on either side) as `e IN (l1, l2, ...)`.
/// Three-valued logic agrees: both are NULL when `e` is NULL, true when `e`
/// equals a literal, and otherwise NULL if a literal is NULL, else false.
fn or_chain_to_in_list(expr: Expr) -> Transformed<Expr> {
    if !matches!(&expr, Expr::BinaryExpr(binary) if binary.op == Operator::Or) {
        return Transformed::no(expr);
    }
    let mut subject: Option<&Expr> = None;
    let mut values = Vec::new();
    let mut stack = vec![&expr];
    while let Some(node) = stack.pop() {
        let Expr::BinaryExpr(BinaryExpr { left, op, right }) = node else {
            return Transformed::no(expr);
        };
        match op {
            Operator::Or => {
                stack.push(right);
                stack.push(left);
            }
            Operator::Eq => {
                let (side, value) = match (left.as_ref(), right.as_ref()) {
                    (side, value @ Expr::Literal(..)) => (side, value),
                    (value @ Expr::Literal(..), side) => (side, value),
                    _ => return Transformed::no(expr),
                };
                match subject {
                    None => subject = Some(side),
                    Some(known) if known == side => {}
                    Some(_) => return Transformed::no(expr),
                }
                values.push(value.clone());
            }
            _ => return Transformed::no(expr),
        }
    }
    match subject {
        Some(subject) if values.len() >= OR_CHAIN_TO_IN_LIST_MIN => {
            let subject = subject.clone();
            let rewritten = subject.in_list(values, false);
            dismantle(expr);
            Transformed::new(rewritten, true, TreeNodeRecursion::Jump)
        }
        _ => Transformed::no(expr),
    }
}

/// Drop a deep left- or right-leaning binary tree without recursing.
fn dismantle(expr: Expr) {
    let mut stack = vec![expr];
    while let Some(node) = stack.pop() {
        if let Expr::BinaryExpr(BinaryExpr { left, right, .. }) = node {
            stack.push(*left);
            stack.push(*right);
        }
    }
}

/// The rules DataFusion's analyzer runs, with [`ExpressionDepthLimit`] first.
pub fn analyzer_rules_with_depth_limit() -> Vec<Arc<dyn AnalyzerRule + Send + Sync>> {
    let mut rules: Vec<Arc<dyn AnalyzerRule + Send + Sync>> = vec![Arc::new(ExpressionDepthLimit)];
    rules.extend(datafusion::optimizer::Analyzer::new().rules);
    rules
}

#[cfg(test)]
mod tests {
    use datafusion::logical_expr::{col, lit};

    use super::*;

    #[test]
    fn an_or_chain_of_equalities_becomes_an_in_list() {
        let mut expr = col("a").eq(lit(0i64));
        for value in 1..10_000i64 {
            expr = expr.or(col("a").eq(lit(value)));
        }
        assert_eq!(expression_depth(&expr, usize::MAX), 10_001);
        let rewritten = or_chain_to_in_list(expr);
        assert!(rewritten.transformed);
        let Expr::InList(list) = &rewritten.data else {
            panic!("not an IN list: {}", rewritten.data);
        };
        assert_eq!(list.list.len(), 10_000);
        assert_eq!(list.list[9_999], lit(9_999i64));
        assert!(!list.negated);
    }

    #[test]
    fn other_or_chains_stay() {
        let mut mixed = col("a").eq(lit(0i64));
        for value in 1..100i64 {
            mixed = mixed.or(col(if value == 50 { "b" } else { "a" }).eq(lit(value)));
        }
        assert!(!or_chain_to_in_list(mixed).transformed);
        let short = col("a").eq(lit(1i64)).or(col("a").eq(lit(2i64)));
        assert!(!or_chain_to_in_list(short).transformed);
    }
}
