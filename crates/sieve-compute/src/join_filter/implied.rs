//! What a join's dynamic filter implies about single probe columns, derived
//! from DataFusion's own filter expression, whatever its shape.
//!
//! A hash join's dynamic filter `F` is a predicate over the probe side: a
//! probe row where `F` is not true cannot take part in the join (DataFusion
//! publishes it only for join types and null semantics where that holds, and
//! widens it itself where it does not: `key IS NULL OR (...)` for joins where
//! NULL equals NULL and for null-aware anti joins). A conjunct `C` shipped to
//! a storage node may therefore drop a row only if `F` drops it: `F` must
//! imply `C`. This module computes, by structural induction over `F`, facts
//! of the form
//!
//! ```text
//!   (column IS NULL AND nulls_pass) OR (column IS NOT NULL AND column ∈ values)
//! ```
//!
//! where `values` is "none" or a range and / or a membership set, such that
//! every row `F` keeps satisfies every fact. Each rule is sound on its own:
//!
//! | `F` | facts |
//! |---|---|
//! | `true`, or a shape not understood | none (a fact about nothing is always true) |
//! | `false`, `NULL` | nothing passes |
//! | `A AND B` | the facts of both, met per column |
//! | `A OR B` | per column present in both, the union of the two facts |
//! | `CASE .. WHEN .. THEN t_i ELSE e END` | the union over every `t_i` and `e` (a row passes one branch) |
//! | `c >= v`, `c > v`, `c <= v`, `c < v`, `c = v` | a bound on `c` (strict bounds widened to inclusive) |
//! | `c IN (v, ...)` | `c` among the non-NULL `v` |
//! | `c IS NULL` | no non-NULL value, NULL passes |
//! | `c IS NOT NULL` | NULL does not pass |
//! | membership in the join's build keys (`IN` list over the probe keys, `struct(keys) IN (...)`, hash-table lookup) | each probe key column among the collected build keys (a superset of any partition's) |
//!
//! Anything else contributes no fact, and is named so EXPLAIN can say what
//! was not understood.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::ArrayRef;
use datafusion::common::ScalarValue;
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::expressions::{
    BinaryExpr, CaseExpr, Column, InListExpr, IsNotNullExpr, IsNullExpr, Literal,
};
use datafusion::physical_expr::{PhysicalExpr, ScalarFunctionExpr};
use datafusion::physical_plan::joins::HashTableLookupExpr;

/// Nesting past which an expression is not looked into (its facts are
/// dropped, which is always sound). DataFusion's join filters nest a few
/// levels per key column; this bounds the recursion whatever reaches it.
const IMPLIED_DEPTH_MAX: usize = 64;

/// Where the values of a membership test come from.
#[derive(Debug, Clone)]
pub(super) enum Members {
    /// These values (with duplicates; NULLs never match).
    Listed(ArrayRef),
    /// The join's collected build keys of key column `i` (in join key order).
    BuildKeys(usize),
}

/// The non-NULL values a fact lets through.
#[derive(Debug, Clone)]
pub(super) enum Values {
    /// No non-NULL value.
    Empty,
    /// Values within the inclusive bounds and among the members; `None` is
    /// no constraint.
    Within {
        low: Option<ScalarValue>,
        high: Option<ScalarValue>,
        members: Option<Members>,
    },
}

/// What every row a filter keeps satisfies on one column.
#[derive(Debug, Clone)]
pub(super) struct ColumnFact {
    /// The column's non-NULL values.
    pub(super) values: Values,
    /// Whether a NULL in the column may pass.
    pub(super) nulls_pass: bool,
}

/// Facts implied by a filter: a conjunction over scan output columns.
#[derive(Debug, Clone, Default)]
pub(super) struct Implied {
    /// No row passes.
    pub(super) nothing: bool,
    /// Per scan output column.
    pub(super) columns: BTreeMap<usize, ColumnFact>,
    /// Parts of the filter that gave no fact because their shape is not
    /// understood, for EXPLAIN.
    pub(super) not_understood: Vec<String>,
}

/// The join a filter comes from, as far as membership tests need it.
#[derive(Debug, Clone, Copy)]
pub(super) struct JoinKeys<'a> {
    /// The probe-side key expressions, in join key order, over the scan's
    /// output schema.
    pub(super) probe: &'a [Arc<dyn PhysicalExpr>],
    /// Whether the join's build keys were collected, complete.
    pub(super) collected: bool,
    /// Whether a partition of the join spilled its build side to disk and
    /// gave up its part of the filter: DataFusion then says `true` for the
    /// probe rows routed to it (or for all of them), which the collected
    /// keys bound as well as its own membership test would have.
    pub(super) spilled: bool,
}

impl Implied {
    fn nothing() -> Self {
        Self {
            nothing: true,
            ..Self::default()
        }
    }

    fn unknown(expr: &Arc<dyn PhysicalExpr>) -> Self {
        let mut text = expr.to_string();
        if text.len() > 80 {
            let cut = (0..=80)
                .rev()
                .find(|&i| text.is_char_boundary(i))
                .unwrap_or(0);
            text.truncate(cut);
            text.push_str("...");
        }
        Self {
            not_understood: vec![text],
            ..Self::default()
        }
    }

    fn fact(column: usize, fact: ColumnFact) -> Self {
        Self {
            columns: BTreeMap::from([(column, fact)]),
            ..Self::default()
        }
    }

    /// `self AND other`.
    fn and(mut self, other: Self) -> Self {
        self.not_understood.extend(other.not_understood);
        if self.nothing || other.nothing {
            return Self {
                nothing: true,
                columns: BTreeMap::new(),
                not_understood: self.not_understood,
            };
        }
        for (column, fact) in other.columns {
            let merged = match self.columns.remove(&column) {
                Some(existing) => existing.and(fact),
                None => fact,
            };
            if matches!(merged.values, Values::Empty) && !merged.nulls_pass {
                return Self {
                    nothing: true,
                    columns: BTreeMap::new(),
                    not_understood: self.not_understood,
                };
            }
            self.columns.insert(column, merged);
        }
        self
    }

    /// `self OR other`.
    fn or(mut self, other: Self) -> Self {
        self.not_understood.extend(other.not_understood);
        if self.nothing {
            return Self {
                not_understood: self.not_understood,
                ..other
            };
        }
        if other.nothing {
            return self;
        }
        let mut columns = BTreeMap::new();
        for (column, fact) in other.columns {
            if let Some(existing) = self.columns.remove(&column) {
                let union = existing.or(fact);
                if union.constrains() {
                    columns.insert(column, union);
                }
            }
        }
        Self {
            nothing: false,
            columns,
            not_understood: self.not_understood,
        }
    }
}

impl ColumnFact {
    fn and(self, other: Self) -> Self {
        let values = match (self.values, other.values) {
            (Values::Empty, _) | (_, Values::Empty) => Values::Empty,
            (
                Values::Within {
                    low: low_a,
                    high: high_a,
                    members: members_a,
                },
                Values::Within {
                    low: low_b,
                    high: high_b,
                    members: members_b,
                },
            ) => Values::Within {
                low: tighter(low_a, low_b, true),
                high: tighter(high_a, high_b, false),
                // Either set holds every passing value; an explicit list is
                // usually the smaller.
                members: match (members_a, members_b) {
                    (Some(Members::Listed(listed)), _) | (_, Some(Members::Listed(listed))) => {
                        Some(Members::Listed(listed))
                    }
                    (members_a, members_b) => members_a.or(members_b),
                },
            },
        };
        Self {
            values,
            nulls_pass: self.nulls_pass && other.nulls_pass,
        }
    }

    fn or(self, other: Self) -> Self {
        let values = match (self.values, other.values) {
            (Values::Empty, values) | (values, Values::Empty) => values,
            (
                Values::Within {
                    low: low_a,
                    high: high_a,
                    members: members_a,
                },
                Values::Within {
                    low: low_b,
                    high: high_b,
                    members: members_b,
                },
            ) => Values::Within {
                low: wider(low_a, low_b, true),
                high: wider(high_a, high_b, false),
                members: match (members_a, members_b) {
                    (Some(Members::Listed(a)), Some(Members::Listed(b))) => {
                        arrow::compute::concat(&[a.as_ref(), b.as_ref()])
                            .ok()
                            .map(Members::Listed)
                    }
                    (Some(Members::BuildKeys(a)), Some(Members::BuildKeys(b))) if a == b => {
                        Some(Members::BuildKeys(a))
                    }
                    _ => None,
                },
            },
        };
        Self {
            values,
            nulls_pass: self.nulls_pass || other.nulls_pass,
        }
    }

    /// Whether the fact rules anything out.
    fn constrains(&self) -> bool {
        match &self.values {
            Values::Empty => true,
            Values::Within {
                low: None,
                high: None,
                members: None,
            } => !self.nulls_pass,
            Values::Within { .. } => true,
        }
    }
}

/// The tighter of two optional bounds (`lower`: the larger).
fn tighter(a: Option<ScalarValue>, b: Option<ScalarValue>, lower: bool) -> Option<ScalarValue> {
    match (a, b) {
        (Some(a), Some(b)) => match a.partial_cmp(&b) {
            Some(order) if order.is_lt() == lower => Some(b),
            _ => Some(a),
        },
        (a, b) => a.or(b),
    }
}

/// The wider of two optional bounds (`lower`: the smaller); unbounded if
/// either is, or if they cannot be compared.
fn wider(a: Option<ScalarValue>, b: Option<ScalarValue>, lower: bool) -> Option<ScalarValue> {
    let (a, b) = (a?, b?);
    match a.partial_cmp(&b)? {
        order if order.is_lt() == lower => Some(a),
        _ => Some(b),
    }
}

fn column(expr: &Arc<dyn PhysicalExpr>) -> Option<usize> {
    expr.downcast_ref::<Column>().map(Column::index)
}

fn within(
    low: Option<ScalarValue>,
    high: Option<ScalarValue>,
    members: Option<Members>,
) -> ColumnFact {
    ColumnFact {
        values: Values::Within { low, high, members },
        nulls_pass: false,
    }
}

/// Facts `expr` implies (see the module docs).
pub(super) fn implied(expr: &Arc<dyn PhysicalExpr>, join: JoinKeys<'_>) -> Implied {
    implied_at(expr, join, 0)
}

fn implied_at(expr: &Arc<dyn PhysicalExpr>, join: JoinKeys<'_>, depth: usize) -> Implied {
    if depth > IMPLIED_DEPTH_MAX {
        return Implied::unknown(expr);
    }
    if let Some(literal) = expr.downcast_ref::<Literal>() {
        return match literal.value() {
            ScalarValue::Boolean(Some(true)) if join.spilled => {
                build_key_membership(join.probe, join).unwrap_or_default()
            }
            ScalarValue::Boolean(Some(true)) => Implied::default(),
            ScalarValue::Boolean(_) => Implied::nothing(),
            _ => Implied::unknown(expr),
        };
    }
    if let Some(binary) = expr.downcast_ref::<BinaryExpr>() {
        match binary.op() {
            Operator::And => {
                return implied_at(binary.left(), join, depth + 1).and(implied_at(
                    binary.right(),
                    join,
                    depth + 1,
                ))
            }
            Operator::Or => {
                return implied_at(binary.left(), join, depth + 1).or(implied_at(
                    binary.right(),
                    join,
                    depth + 1,
                ))
            }
            _ => return comparison(binary).unwrap_or_else(|| Implied::unknown(expr)),
        }
    }
    if let Some(case) = expr.downcast_ref::<CaseExpr>() {
        // A row passes through exactly one branch; without ELSE the rest get
        // NULL, which does not pass.
        let mut union = Implied::nothing();
        for (_, then) in case.when_then_expr() {
            union = union.or(implied_at(then, join, depth + 1));
        }
        if let Some(otherwise) = case.else_expr() {
            union = union.or(implied_at(otherwise, join, depth + 1));
        }
        return union;
    }
    if let Some(is_null) = expr.downcast_ref::<IsNullExpr>() {
        if let Some(index) = column(is_null.arg()) {
            return Implied::fact(
                index,
                ColumnFact {
                    values: Values::Empty,
                    nulls_pass: true,
                },
            );
        }
    }
    if let Some(is_not_null) = expr.downcast_ref::<IsNotNullExpr>() {
        if let Some(index) = column(is_not_null.arg()) {
            return Implied::fact(index, within(None, None, None));
        }
    }
    if let Some(in_list) = expr.downcast_ref::<InListExpr>() {
        if !in_list.negated() {
            if let Some(implied) = build_key_membership(&[Arc::clone(in_list.expr())], join)
                .or_else(|| struct_membership(in_list.expr(), join))
            {
                return implied;
            }
            if let Some(index) = column(in_list.expr()) {
                let values: Option<Vec<ScalarValue>> = in_list
                    .list()
                    .iter()
                    .map(|item| item.downcast_ref::<Literal>().map(|l| l.value().clone()))
                    .collect();
                if let Some(array) =
                    values.and_then(|values| ScalarValue::iter_to_array(values).ok())
                {
                    return Implied::fact(index, within(None, None, Some(Members::Listed(array))));
                }
            }
        }
        return Implied::unknown(expr);
    }
    if expr.downcast_ref::<HashTableLookupExpr>().is_some() {
        let keys: Vec<Arc<dyn PhysicalExpr>> = expr.children().into_iter().cloned().collect();
        if let Some(implied) = build_key_membership(&keys, join) {
            return implied;
        }
    }
    Implied::unknown(expr)
}

/// `column op literal` (or `literal op column`) as a bound.
fn comparison(binary: &BinaryExpr) -> Option<Implied> {
    let literal_of = |expr: &Arc<dyn PhysicalExpr>| {
        expr.downcast_ref::<Literal>()
            .map(|literal| literal.value().clone())
            .filter(|value| !value.is_null())
    };
    let (index, value, op) = match (column(binary.left()), literal_of(binary.right())) {
        (Some(index), Some(value)) => (index, value, *binary.op()),
        _ => {
            let index = column(binary.right())?;
            let value = literal_of(binary.left())?;
            (index, value, binary.op().swap()?)
        }
    };
    let fact = match op {
        Operator::Eq => within(Some(value.clone()), Some(value), None),
        Operator::GtEq | Operator::Gt => within(Some(value), None, None),
        Operator::LtEq | Operator::Lt => within(None, Some(value), None),
        _ => return None,
    };
    Some(Implied::fact(index, fact))
}

/// Membership of `keys` in the join's build keys, if `keys` are the join's
/// probe keys (all of them, in order) and the build keys were collected.
fn build_key_membership(keys: &[Arc<dyn PhysicalExpr>], join: JoinKeys<'_>) -> Option<Implied> {
    if !join.collected || keys.len() != join.probe.len() {
        return None;
    }
    let same = keys
        .iter()
        .zip(join.probe)
        .all(|(key, probe)| key.as_ref() == probe.as_ref());
    if !same {
        return None;
    }
    let mut implied = Implied::default();
    for (position, key) in keys.iter().enumerate() {
        if let Some(index) = column(key) {
            implied = implied.and(Implied::fact(
                index,
                within(None, None, Some(Members::BuildKeys(position))),
            ));
        }
    }
    Some(implied)
}

/// `struct(k1, k2, ...) IN (...)`, DataFusion's membership test for a
/// multi-column join.
fn struct_membership(expr: &Arc<dyn PhysicalExpr>, join: JoinKeys<'_>) -> Option<Implied> {
    let function = expr.downcast_ref::<ScalarFunctionExpr>()?;
    if function.name() != "struct" {
        return None;
    }
    build_key_membership(function.args(), join)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use datafusion::physical_expr::expressions::lit;

    fn key(index: usize) -> Arc<dyn PhysicalExpr> {
        Arc::new(Column::new(&format!("k{index}"), index))
    }

    fn binary(
        left: Arc<dyn PhysicalExpr>,
        op: Operator,
        right: Arc<dyn PhysicalExpr>,
    ) -> Arc<dyn PhysicalExpr> {
        Arc::new(BinaryExpr::new(left, op, right))
    }

    fn range(index: usize, low: i64, high: i64) -> Arc<dyn PhysicalExpr> {
        binary(
            binary(key(index), Operator::GtEq, lit(low)),
            Operator::And,
            binary(key(index), Operator::LtEq, lit(high)),
        )
    }

    const NO_JOIN: JoinKeys<'static> = JoinKeys {
        probe: &[],
        collected: false,
        spilled: false,
    };

    #[test]
    fn a_null_equal_joins_filter_lets_nulls_through() {
        // DataFusion's filter for `a.k IS NOT DISTINCT FROM b.k`.
        let filter = binary(
            Arc::new(IsNullExpr::new(key(0))),
            Operator::Or,
            range(0, 5, 9),
        );
        let implied = implied(&filter, NO_JOIN);
        let fact = &implied.columns[&0];
        assert!(fact.nulls_pass);
        assert!(matches!(
            &fact.values,
            Values::Within {
                low: Some(ScalarValue::Int64(Some(5))),
                high: Some(ScalarValue::Int64(Some(9))),
                members: None
            }
        ));
    }

    #[test]
    fn an_or_keeps_only_what_both_sides_say() {
        // k0 in [5, 9] OR k1 in [1, 2]: nothing about either column alone.
        let filter = binary(range(0, 5, 9), Operator::Or, range(1, 1, 2));
        assert!(implied(&filter, NO_JOIN).columns.is_empty());
        // k0 in [5, 9] OR k0 in [20, 30]: k0 in [5, 30].
        let filter = binary(range(0, 5, 9), Operator::Or, range(0, 20, 30));
        let implied = implied(&filter, NO_JOIN);
        assert!(matches!(
            &implied.columns[&0].values,
            Values::Within {
                low: Some(ScalarValue::Int64(Some(5))),
                high: Some(ScalarValue::Int64(Some(30))),
                ..
            }
        ));
    }

    #[test]
    fn shapes_not_understood_give_no_fact_and_are_named() {
        let filter = binary(
            binary(key(0), Operator::Plus, lit(1i64)),
            Operator::Gt,
            lit(3i64),
        );
        let implied = implied(&filter, NO_JOIN);
        assert!(implied.columns.is_empty() && !implied.nothing);
        assert_eq!(implied.not_understood.len(), 1);
        // A negated list says nothing about membership.
        let schema = arrow::datatypes::Schema::new(vec![arrow::datatypes::Field::new(
            "k0",
            arrow::datatypes::DataType::Int64,
            true,
        )]);
        let list: ArrayRef = Arc::new(Int64Array::from(vec![1, 2]));
        let not_in: Arc<dyn PhysicalExpr> =
            Arc::new(InListExpr::try_new_from_array(key(0), list, true, &schema).unwrap());
        assert!(super::implied(&not_in, NO_JOIN).columns.is_empty());
    }

    #[test]
    fn a_case_is_the_union_of_its_branches_else_included() {
        let case = |otherwise: Arc<dyn PhysicalExpr>| -> Arc<dyn PhysicalExpr> {
            Arc::new(
                CaseExpr::try_new(
                    Some(key(1)),
                    vec![(lit(0i64), range(0, 0, 9)), (lit(1i64), range(0, 100, 109))],
                    Some(otherwise),
                )
                .unwrap(),
            )
        };
        let implied_false = implied(&case(lit(false)), NO_JOIN);
        assert!(matches!(
            &implied_false.columns[&0].values,
            Values::Within {
                low: Some(ScalarValue::Int64(Some(0))),
                high: Some(ScalarValue::Int64(Some(109))),
                ..
            }
        ));
        // A partition that could not report keeps every row: no fact.
        assert!(implied(&case(lit(true)), NO_JOIN).columns.is_empty());
        // Every branch false: nothing passes.
        let none: Arc<dyn PhysicalExpr> = Arc::new(
            CaseExpr::try_new(
                Some(key(1)),
                vec![(lit(0i64), lit(false))],
                Some(lit(false)),
            )
            .unwrap(),
        );
        assert!(implied(&none, NO_JOIN).nothing);
    }

    #[test]
    fn build_keys_stand_in_only_for_the_joins_own_membership_test() {
        let probe = [key(0), key(1)];
        let join = JoinKeys {
            probe: &probe,
            collected: true,
            spilled: false,
        };
        let schema = arrow::datatypes::Schema::new(vec![
            arrow::datatypes::Field::new("k0", arrow::datatypes::DataType::Int64, true),
            arrow::datatypes::Field::new("k1", arrow::datatypes::DataType::Int64, true),
        ]);
        // A list over one column, where the join has two keys: its own values.
        let list: ArrayRef = Arc::new(Int64Array::from(vec![1, 2]));
        let in_list: Arc<dyn PhysicalExpr> =
            Arc::new(InListExpr::try_new_from_array(key(0), list, false, &schema).unwrap());
        let implied_list = implied(&in_list, join);
        assert!(matches!(
            &implied_list.columns[&0].values,
            Values::Within {
                members: Some(Members::Listed(_)),
                ..
            }
        ));
        // The same list, for a join of one key: the collected keys.
        let single = [key(0)];
        let implied_single = implied(
            &in_list,
            JoinKeys {
                probe: &single,
                collected: true,
                spilled: false,
            },
        );
        assert!(matches!(
            &implied_single.columns[&0].values,
            Values::Within {
                members: Some(Members::BuildKeys(0)),
                ..
            }
        ));
    }
}
