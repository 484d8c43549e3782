//! Bounds on the work one fragment may ask of a storage node, checked before
//! any recursive walk of it.
//!
//! A fragment's expressions are trees. Decoding, the allow-list and
//! DataFusion's own evaluation all recurse over them, so a tree deep enough
//! overflows a thread's stack and aborts the process (a 700-term
//! `l_orderkey + 1 + ... > 0` did). The walks here are iterative: they
//! measure a tree of any depth without recursing, so every recursive walk
//! after them runs on a tree known to be shallow and small.
//!
//! The compute node runs the same checks before it ships a fragment, and
//! keeps what fails them on its own side (the query still gets its answer);
//! the storage node runs them again on what it receives. Decoding itself is
//! bounded by prost's limit of 100 nested messages, and every expression
//! level is two nested messages, so [`EXPRESSION_DEPTH_MAX`] stays below
//! half of it, with room for the body and a partial aggregation's operators.

use std::sync::Arc;

use datafusion::common::{plan_err, Result, ScalarValue};
use datafusion::physical_expr::expressions::Literal;
use datafusion::physical_expr::PhysicalExpr;

/// Deepest expression tree a fragment may carry: nesting levels from the
/// root to the deepest leaf (`a = 1` is two). TPC-H's deepest pushed
/// predicate (Q19, with its join filter) is 8.
pub const EXPRESSION_DEPTH_MAX: usize = 40;

/// Most expression nodes in one fragment, over its predicate and operators
/// (an IN list of n values is n + 2 nodes).
pub const EXPRESSION_NODES_MAX: usize = 100_000;

/// Largest literal in a fragment, in bytes (strings and binaries; a literal
/// is evaluated against every row, and a LIKE pattern is compiled).
pub const LITERAL_BYTES_MAX: usize = 64 * 1024;

/// The size of an expression tree, measured without recursion.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExpressionShape {
    /// Levels from the root to the deepest leaf.
    pub depth: usize,
    /// Nodes in the tree.
    pub nodes: usize,
    /// Bytes of the largest literal.
    pub literal_bytes_max: usize,
}

impl ExpressionShape {
    /// Measure `expr` with an explicit stack. Stops counting (returns a
    /// shape over the limits) once the tree has more than twice
    /// [`EXPRESSION_NODES_MAX`] nodes, so a hostile tree costs bounded work.
    pub fn of(expr: &Arc<dyn PhysicalExpr>) -> Self {
        let mut shape = Self::default();
        let mut stack: Vec<(&Arc<dyn PhysicalExpr>, usize)> = vec![(expr, 1)];
        while let Some((node, depth)) = stack.pop() {
            shape.nodes += 1;
            shape.depth = shape.depth.max(depth);
            if shape.nodes > 2 * EXPRESSION_NODES_MAX {
                break;
            }
            if let Some(literal) = node.downcast_ref::<Literal>() {
                shape.literal_bytes_max =
                    shape.literal_bytes_max.max(scalar_bytes(literal.value()));
            }
            for child in node.children() {
                stack.push((child, depth + 1));
            }
        }
        shape
    }

    /// The first limit this shape breaks, as a sentence, or None.
    pub fn exceeded(&self) -> Option<String> {
        if self.depth > EXPRESSION_DEPTH_MAX {
            Some(format!(
                "expression nested {} deep, above the limit of {EXPRESSION_DEPTH_MAX}",
                self.depth
            ))
        } else if self.nodes > EXPRESSION_NODES_MAX {
            Some(format!(
                "{} expression nodes, above the limit of {EXPRESSION_NODES_MAX}",
                self.nodes
            ))
        } else if self.literal_bytes_max > LITERAL_BYTES_MAX {
            Some(format!(
                "a literal of {} bytes, above the limit of {LITERAL_BYTES_MAX}",
                self.literal_bytes_max
            ))
        } else {
            None
        }
    }

    /// The shape of two trees side by side (both parts of one fragment).
    pub fn and(self, other: Self) -> Self {
        Self {
            depth: self.depth.max(other.depth),
            nodes: self.nodes + other.nodes,
            literal_bytes_max: self.literal_bytes_max.max(other.literal_bytes_max),
        }
    }
}

/// Refuse `expr` if it breaks a limit of this module, naming the limit.
pub fn check_expression_limits(expr: &Arc<dyn PhysicalExpr>) -> Result<()> {
    match ExpressionShape::of(expr).exceeded() {
        Some(reason) => plan_err!("NDP fragment refused: {reason}"),
        None => Ok(()),
    }
}

/// Drop `expr` without recursing: a deep tree dropped the ordinary way
/// recurses once per level and can overflow the stack. Each node is
/// released after its children are held on an explicit stack, so dropping
/// it only decrements theirs. Subtrees shared with other owners are left to
/// them.
pub fn dismantle(expr: Arc<dyn PhysicalExpr>) {
    let mut stack = vec![expr];
    while let Some(node) = stack.pop() {
        let children: Vec<Arc<dyn PhysicalExpr>> =
            node.children().into_iter().map(Arc::clone).collect();
        drop(node);
        stack.extend(children);
    }
}

fn scalar_bytes(value: &ScalarValue) -> usize {
    match value {
        ScalarValue::Utf8(Some(text))
        | ScalarValue::LargeUtf8(Some(text))
        | ScalarValue::Utf8View(Some(text)) => text.len(),
        ScalarValue::Binary(Some(bytes))
        | ScalarValue::LargeBinary(Some(bytes))
        | ScalarValue::BinaryView(Some(bytes))
        | ScalarValue::FixedSizeBinary(_, Some(bytes)) => bytes.len(),
        // Nested scalars are refused by the allow-list's types; their
        // in-memory size stands in for their bytes.
        other => other.size(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::logical_expr::Operator;
    use datafusion::physical_expr::expressions::{col, lit, BinaryExpr};
    use datafusion::physical_expr::PhysicalExpr;

    use super::*;

    /// A left-deep chain `a + 1 + 1 ... > 0` of `terms` additions, built and
    /// measured without recursion; dismantled iteratively so that dropping
    /// it does not recurse either.
    #[test]
    fn a_deep_chain_is_measured_without_recursion() {
        let schema = Schema::new(vec![Field::new("a", DataType::Int64, false)]);
        let mut expr: Arc<dyn PhysicalExpr> = col("a", &schema).unwrap();
        for _ in 0..100_000 {
            expr = Arc::new(BinaryExpr::new(expr, Operator::Plus, lit(1i64)));
        }
        let shape = ExpressionShape::of(&expr);
        assert_eq!(shape.depth, 100_001);
        assert!(shape.exceeded().unwrap().contains("nested 100001 deep"));
        assert!(check_expression_limits(&expr).is_err());
        dismantle(expr);
    }

    #[test]
    fn shallow_expressions_and_small_literals_pass() {
        let schema = Schema::new(vec![Field::new("s", DataType::Utf8, true)]);
        let small: Arc<dyn PhysicalExpr> = Arc::new(BinaryExpr::new(
            col("s", &schema).unwrap(),
            Operator::Eq,
            lit("x".repeat(LITERAL_BYTES_MAX)),
        ));
        assert_eq!(ExpressionShape::of(&small).depth, 2);
        assert!(check_expression_limits(&small).is_ok());
        let large: Arc<dyn PhysicalExpr> = Arc::new(BinaryExpr::new(
            col("s", &schema).unwrap(),
            Operator::Eq,
            lit("x".repeat(LITERAL_BYTES_MAX + 1)),
        ));
        let error = check_expression_limits(&large).unwrap_err().to_string();
        assert!(error.contains("literal of 65537 bytes"), "{error}");
    }
}
