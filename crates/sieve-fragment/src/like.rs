//! `LIKE` with inner wildcards, as ordered substring searches.
//!
//! Arrow's `like` kernel matches `abc%`, `%abc`, `%abc%` and plain literals
//! directly, but turns every other pattern into a regular expression:
//! `%special%requests%` (TPC-H Q13) becomes `^.*special.*requests`, run per
//! row. A pattern made only of literal segments and `%` needs no regular
//! expression: its first segment is a prefix, its last a suffix, and the
//! segments between are found left to right, each after the previous one
//! (taking each segment's leftmost match leaves the most room for the rest,
//! so this finds a match whenever there is one). With memchr's `memmem`
//! searchers, `NOT LIKE '%special%requests%'` over 1.5 million o_comment-like
//! strings took 50 ms against the regular expression's 92 ms (release
//! build, this machine), and TPC-H Q13's storage CPU at SF 1 fell from
//! 0.22 s to 0.17-0.19 s.
//!
//! [`fast_like`] rewrites such `LikeExpr`s in a predicate that runs over one
//! slice (`slice_plan.rs`), on the storage node or over raw pages on the
//! compute node. It is never serialised: fragments carry DataFusion's own
//! `LikeExpr`, and the rewrite happens where the fragment runs. Patterns with
//! `_`, an escape character (`\`), or `ILIKE` are left to DataFusion.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, BooleanArray};
use arrow::datatypes::{DataType, Schema};
use arrow::record_batch::RecordBatch;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{internal_err, Result, ScalarValue};
use datafusion::logical_expr::ColumnarValue;
use datafusion::physical_expr::expressions::{LikeExpr, Literal};
use datafusion::physical_expr::PhysicalExpr;
use memchr::memmem::Finder;

use crate::unary::evaluate_unary;

/// `predicate` with every `LIKE` / `NOT LIKE` whose pattern has inner
/// wildcards (and nothing but literals and `%`) replaced by an
/// [`OrderedSubstringsExpr`]; other expressions unchanged.
pub fn fast_like(predicate: Arc<dyn PhysicalExpr>) -> Result<Arc<dyn PhysicalExpr>> {
    predicate
        .transform_up(|node| {
            let Some(like) = node.downcast_ref::<LikeExpr>() else {
                return Ok(Transformed::no(node));
            };
            let pattern =
                like.pattern()
                    .downcast_ref::<Literal>()
                    .and_then(|literal| match literal.value() {
                        ScalarValue::Utf8(Some(text))
                        | ScalarValue::LargeUtf8(Some(text))
                        | ScalarValue::Utf8View(Some(text)) => Some(text.clone()),
                        _ => None,
                    });
            match pattern {
                Some(pattern) if !like.case_insensitive() => {
                    match OrderedSubstringsExpr::try_new(
                        Arc::clone(like.expr()),
                        &pattern,
                        like.negated(),
                    ) {
                        Some(fast) => Ok(Transformed::yes(Arc::new(fast) as Arc<dyn PhysicalExpr>)),
                        None => Ok(Transformed::no(node)),
                    }
                }
                _ => Ok(Transformed::no(node)),
            }
        })
        .map(|transformed| transformed.data)
}

/// `input [NOT] LIKE pattern` for a pattern of literal segments joined by
/// `%`, at least one of them between two `%`s.
#[derive(Clone)]
pub struct OrderedSubstringsExpr {
    input: Arc<dyn PhysicalExpr>,
    pattern: String,
    negated: bool,
    prefix: String,
    middle: Vec<Finder<'static>>,
    suffix: String,
}

impl OrderedSubstringsExpr {
    /// The expression for `pattern`, or `None` if the pattern has `_` or
    /// `\`, or no inner wildcard (arrow's kernel is as fast then).
    pub fn try_new(input: Arc<dyn PhysicalExpr>, pattern: &str, negated: bool) -> Option<Self> {
        if pattern.contains(['_', '\\']) {
            return None;
        }
        let segments: Vec<&str> = pattern.split('%').collect();
        // `a%b`, `%a%b`, `a%b%`, `%a%b%`...: two literal segments at least,
        // or one between wildcards with a prefix or suffix.
        let literal = segments
            .iter()
            .filter(|segment| !segment.is_empty())
            .count();
        if segments.len() < 2 || literal < 2 {
            return None;
        }
        let (prefix, rest) = segments.split_first()?;
        let (suffix, middle) = rest.split_last()?;
        Some(Self {
            input,
            pattern: pattern.to_string(),
            negated,
            prefix: (*prefix).to_string(),
            middle: middle
                .iter()
                .filter(|segment| !segment.is_empty())
                .map(|segment| Finder::new(segment.as_bytes()).into_owned())
                .collect(),
            suffix: (*suffix).to_string(),
        })
    }

    /// Whether `text` matches the pattern.
    #[inline]
    pub fn matches(&self, text: &str) -> bool {
        let mut rest = text.as_bytes();
        if !self.prefix.is_empty() {
            match rest.strip_prefix(self.prefix.as_bytes()) {
                Some(after) => rest = after,
                None => return false,
            }
        }
        if !self.suffix.is_empty() {
            match rest.strip_suffix(self.suffix.as_bytes()) {
                Some(before) => rest = before,
                None => return false,
            }
        }
        for finder in &self.middle {
            match finder.find(rest) {
                Some(at) => rest = &rest[at + finder.needle().len()..],
                None => return false,
            }
        }
        true
    }

    fn evaluate_array(&self, values: &ArrayRef) -> Result<BooleanArray> {
        let decide = |text: Option<&str>| text.map(|text| self.matches(text) != self.negated);
        Ok(match values.data_type() {
            DataType::Utf8 => values.as_string::<i32>().iter().map(decide).collect(),
            DataType::LargeUtf8 => values.as_string::<i64>().iter().map(decide).collect(),
            DataType::Utf8View => values.as_string_view().iter().map(decide).collect(),
            other => return internal_err!("LIKE over {other}"),
        })
    }
}

impl fmt::Debug for OrderedSubstringsExpr {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "{self}")
    }
}

impl fmt::Display for OrderedSubstringsExpr {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let not = if self.negated { "NOT " } else { "" };
        write!(formatter, "{} {not}LIKE {}", self.input, self.pattern)
    }
}

impl PartialEq for OrderedSubstringsExpr {
    fn eq(&self, other: &Self) -> bool {
        self.input.eq(&other.input)
            && self.pattern == other.pattern
            && self.negated == other.negated
    }
}

impl Eq for OrderedSubstringsExpr {}

impl Hash for OrderedSubstringsExpr {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.input.hash(state);
        self.pattern.hash(state);
        self.negated.hash(state);
    }
}

impl PhysicalExpr for OrderedSubstringsExpr {
    fn data_type(&self, _input_schema: &Schema) -> Result<DataType> {
        Ok(DataType::Boolean)
    }

    fn nullable(&self, input_schema: &Schema) -> Result<bool> {
        self.input.nullable(input_schema)
    }

    fn evaluate(&self, batch: &RecordBatch) -> Result<ColumnarValue> {
        evaluate_unary(&self.input, batch, |values| self.evaluate_array(values))
    }

    fn children(&self) -> Vec<&Arc<dyn PhysicalExpr>> {
        vec![&self.input]
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn PhysicalExpr>>,
    ) -> Result<Arc<dyn PhysicalExpr>> {
        let [input] = <[Arc<dyn PhysicalExpr>; 1]>::try_from(children).or_else(|children| {
            internal_err!(
                "OrderedSubstringsExpr has one child, got {}",
                children.len()
            )
        })?;
        Ok(Arc::new(Self {
            input,
            ..(*self).clone()
        }))
    }

    fn fmt_sql(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "{self}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{LargeStringArray, StringArray, StringViewArray};
    use arrow::datatypes::Field;
    use datafusion::physical_expr::expressions::{col, like, lit};

    /// Strings over a small alphabet, so that patterns match often and in
    /// overlapping ways, plus the empty string and non-ASCII text.
    fn haystacks() -> Vec<Option<String>> {
        let alphabet = ['a', 'b', 'é', 'c'];
        let mut out = vec![None, Some(String::new())];
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..4000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let length = (state % 9) as usize;
            let text: String = (0..length)
                .map(|position| alphabet[((state >> (position * 3 + 8)) % 4) as usize])
                .collect();
            out.push(Some(text));
        }
        out
    }

    const PATTERNS: &[&str] = &[
        "%a%b%",
        "a%b",
        "%a%b",
        "a%b%",
        "ab%ba",
        "%aa%aa%",
        "a%%b",
        "%é%c%",
        "%ab%ab%ab%",
        "aba%aba",
        "c%",
        "%c",
        "%ab%",
        "ab",
        "%",
        "%%",
        "a%b_c",
        "a\\%b%c",
        "",
    ];

    /// Every pattern, over every string type, negated or not: the rewrite
    /// (where it applies) gives exactly what DataFusion's `LikeExpr` gives.
    #[test]
    fn equals_datafusions_like_on_every_pattern() {
        let texts = haystacks();
        let arrays: Vec<ArrayRef> = vec![
            Arc::new(StringArray::from(texts.clone())),
            Arc::new(LargeStringArray::from(texts.clone())),
            Arc::new(StringViewArray::from(texts.clone())),
        ];
        let mut rewritten = 0;
        for array in arrays {
            let schema = Arc::new(Schema::new(vec![Field::new(
                "s",
                array.data_type().clone(),
                true,
            )]));
            let batch = RecordBatch::try_new(Arc::clone(&schema), vec![array]).unwrap();
            for pattern in PATTERNS {
                for negated in [false, true] {
                    let text = Some(pattern.to_string());
                    let pattern_literal = match batch.schema().field(0).data_type() {
                        DataType::LargeUtf8 => ScalarValue::LargeUtf8(text),
                        DataType::Utf8View => ScalarValue::Utf8View(text),
                        _ => ScalarValue::Utf8(text),
                    };
                    let reference = like(
                        negated,
                        false,
                        col("s", &schema).unwrap(),
                        lit(pattern_literal),
                        &schema,
                    )
                    .unwrap();
                    let fast = fast_like(Arc::clone(&reference)).unwrap();
                    if fast.downcast_ref::<OrderedSubstringsExpr>().is_some() {
                        rewritten += 1;
                    }
                    let expected = reference
                        .evaluate(&batch)
                        .unwrap()
                        .into_array(4002)
                        .unwrap();
                    let actual = fast.evaluate(&batch).unwrap().into_array(4002).unwrap();
                    assert_eq!(
                        actual.as_boolean(),
                        expected.as_boolean(),
                        "{pattern} negated={negated} over {}",
                        batch.schema().field(0).data_type()
                    );
                }
            }
        }
        // a%b, %a%b, a%b%, %a%b%, ab%ba, %aa%aa%, a%%b, %é%c%, %ab%ab%ab%,
        // aba%aba: ten patterns, both ways, three types.
        assert_eq!(rewritten, 10 * 2 * 3);
    }

    #[test]
    fn leaves_patterns_arrow_matches_directly_alone() {
        for pattern in ["abc", "abc%", "%abc", "%abc%", "a_c%d", "%a\\%b%", "%", ""] {
            assert!(
                OrderedSubstringsExpr::try_new(lit("x"), pattern, false).is_none(),
                "{pattern}"
            );
        }
        let expr = OrderedSubstringsExpr::try_new(lit("x"), "%special%requests%", false).unwrap();
        assert!(expr.matches("carefully special deposits requests"));
        assert!(!expr.matches("requests special"));
        assert!(!expr.matches("specialrequest"));
    }
}
