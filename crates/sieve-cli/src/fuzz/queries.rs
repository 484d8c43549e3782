//! Random SQL over a [`FuzzSchema`]'s tables, every query with one correct
//! answer.
//!
//! The generator knows the tables' types and data, and keeps three rules so
//! that two correct engines cannot disagree:
//!
//! - **Deterministic results.** `LIMIT` comes only after an `ORDER BY` that
//!   is a total order (unique ids, or every grouping key, or every output
//!   column of a `DISTINCT`); no `random()`, no `now()`, no order-dependent
//!   aggregate (`array_agg`, `first_value`); `row_number()` only over a
//!   total order.
//! - **No errors that depend on evaluation order.** Divisors go through
//!   `NULLIF(x, 0)`, casts that may fail are `TRY_CAST`, multiplications
//!   widen to `BIGINT` first, and the tables' values are small enough that
//!   no sum or product by a small constant overflows (see `tables.rs`).
//! - **Bounded work.** Joins whose output the key values say would exceed
//!   [`JOIN_ROWS_MAX`] rows restrict one side by `id`, and joins without an
//!   equality key only run on small inputs, so each query takes
//!   milliseconds even in a debug build.
//!
//! Float aggregates (`sum`, `avg`, `var_samp`, `stddev` over floats, and
//! `avg` over integers) depend on the order rows are summed in, which
//! legitimately differs between plans; the query lists those output columns
//! as approximate, they are never ordered by or filtered on, and the runner
//! compares them with a tolerance.

use std::collections::HashMap;
use std::fmt::Write as _;

use arrow::array::Array;
use arrow::datatypes::DataType;
use arrow::util::display::{ArrayFormatter, FormatOptions};

use super::rng::SeededRandom;
use super::tables::{ColumnSpec, FuzzSchema, FuzzTable, NAME_COLUMN};

/// Upper bound on the estimated rows of a join's output, before any
/// aggregation: past it one side is restricted by `id`. Ten thousand rows
/// join, sort and compare in a few milliseconds in a debug build.
pub const JOIN_ROWS_MAX: usize = 10_000;

/// Upper bound on the product of two inputs' rows for a join without an
/// equality key (a nested-loop join compares every pair).
const NESTED_LOOP_PAIRS_MAX: usize = 60_000;

/// Upper bound on a `LIMIT`.
const LIMIT_MAX: i64 = 40;

/// What a query is, for the statistics and the reproduction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum QueryShape {
    /// A filtered scan of one table.
    Filter,
    /// A filtered scan, ordered by a total order, with a `LIMIT`.
    TopN,
    /// `SELECT DISTINCT`.
    Distinct,
    /// An aggregation over one table, grouped or not.
    Aggregate,
    /// A join of two tables (inner, outer, null-safe, residual, multi-key).
    Join,
    /// An aggregation over a join.
    JoinAggregate,
    /// A chain of three tables.
    ThreeWayJoin,
    /// A star join: the largest table joined on equal keys to one or two
    /// filtered tables, aggregated by their columns (what Sieve may push
    /// to its storage nodes whole).
    StarAggregate,
    /// `EXISTS`, `NOT EXISTS`, `IN (subquery)`, `NOT IN (subquery)`.
    SemiAntiJoin,
    /// `UNION`, `INTERSECT`, `EXCEPT`, with or without `ALL`.
    SetOperation,
    /// A scalar subquery, correlated or not.
    ScalarSubquery,
    /// Window functions.
    Window,
    /// A recursive common table expression.
    RecursiveCte,
    /// An aggregation over a join on a table's `id`, grouped by the
    /// table's `name` and not by `id` (what Sieve's `GroupByTableKey`
    /// groups by the key first).
    KeyedGroup,
}

/// One generated query and how to compare its result.
#[derive(Debug, Clone)]
pub struct FuzzQuery {
    /// The SQL text.
    pub sql: String,
    /// What kind of query it is.
    pub shape: QueryShape,
    /// Whether the query's `ORDER BY` fixes the order of every row (compare
    /// in order); otherwise rows are compared as a sorted multiset.
    pub ordered: bool,
    /// Output columns (0-based) whose values are float aggregates, compared
    /// with a tolerance.
    pub approximate_columns: Vec<usize>,
}

/// The kinds of value an expression can have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Category {
    Integer,
    Decimal,
    Float,
    Text,
    Date,
    Timestamp,
    Boolean,
}

impl Category {
    fn of(data_type: &DataType) -> Self {
        match data_type {
            DataType::Decimal128(..) => Self::Decimal,
            DataType::Float32 | DataType::Float64 => Self::Float,
            DataType::Utf8 => Self::Text,
            DataType::Date32 => Self::Date,
            DataType::Timestamp(..) => Self::Timestamp,
            DataType::Boolean => Self::Boolean,
            _ => Self::Integer,
        }
    }

    /// The type both sides of a set operation are cast to.
    fn common_type(self) -> Option<&'static str> {
        match self {
            Self::Integer => Some("BIGINT"),
            Self::Decimal => Some("DECIMAL(38, 6)"),
            Self::Float => Some("DOUBLE"),
            _ => None,
        }
    }
}

/// A column in scope: `alias.name`, with its table for literals and sizes.
#[derive(Debug, Clone, Copy)]
struct Column<'schema> {
    alias: &'schema str,
    spec: &'schema ColumnSpec,
    table: &'schema FuzzTable,
    index: usize,
}

impl Column<'_> {
    fn sql(&self) -> String {
        format!("{}.{}", self.alias, self.spec.name)
    }

    fn category(&self) -> Category {
        Category::of(&self.spec.data_type)
    }

    fn is_unsigned(&self) -> bool {
        matches!(
            self.spec.data_type,
            DataType::UInt8 | DataType::UInt16 | DataType::UInt32 | DataType::UInt64
        )
    }
}

/// An output expression and whether its value is a float aggregate.
#[derive(Debug, Clone)]
struct Output {
    sql: String,
    approximate: bool,
}

impl Output {
    fn exact(sql: String) -> Self {
        Self {
            sql,
            approximate: false,
        }
    }
}

/// Table aliases, in the order a query's FROM clause uses them.
const ALIASES: [&str; 3] = ["a", "b", "c"];

/// LIKE patterns: prefixes, suffixes, inner wildcards, `_`, multibyte
/// characters, an escaped `%`, and patterns matching everything or only
/// the empty string.
const LIKE_PATTERNS: [&str; 18] = [
    "a%", "%b", "%ó%", "%日%", "a_b", "_", "%\\%%", "%x%y%", "A%", "%", "", "___", "%long%", "ż%",
    "%a%b%", "_b%", "%_", "Ż%W",
];

/// Regular expressions for `regexp_like` (not on the storage allow-list).
const REGEXES: [&str; 5] = ["^a", "b$", "[0-9]", "ó|日", "^.{3}$"];

/// Text literals, with the same edges as the tables' strings.
const TEXT_LITERALS: [&str; 10] = [
    "", "a", "abc", "ABC", "żółw", "日本", "x%y", "a_b", "b", "MiXeD",
];

/// Generates queries over one schema's tables.
#[derive(Debug)]
pub struct QueryGenerator<'schema> {
    schema: &'schema FuzzSchema,
    random: SeededRandom,
    seed: u64,
}

/// Queries in a hundred of shape [`QueryShape::KeyedGroup`], drawn from a
/// stream of their own so that a seed's other queries stay what they were.
const KEYED_GROUP_PERCENT: u32 = 6;

/// Mixed into a query's seed for that draw.
const KEYED_GROUP_SEED: u64 = 0x6b65_7965_645f_6772;

/// Mixed into a keyed-group query's seed for its third table, drawn
/// apart so that the rest of the query stays what it was for a seed.
const KEYED_THIRD_SEED: u64 = 0x7468_6972_645f_7462;

/// Mixed into a keyed-group query's seed for whether its joins go in a
/// subquery that renames the columns and leaves the grouped table's key
/// out (TPC-H Q9's `n_name AS nation`), drawn apart as the third table.
const KEYED_SUBQUERY_SEED: u64 = 0x7375_6271_7565_7279;

impl<'schema> QueryGenerator<'schema> {
    /// A generator for query `seed` over `schema`: the same seed and tables
    /// always give the same query.
    pub fn new(schema: &'schema FuzzSchema, seed: u64) -> Self {
        Self {
            schema,
            random: SeededRandom::new(seed),
            seed,
        }
    }

    /// One random query.
    pub fn query(&mut self) -> FuzzQuery {
        if SeededRandom::new(self.seed ^ KEYED_GROUP_SEED).percent(KEYED_GROUP_PERCENT) {
            return self.keyed_group();
        }
        let shapes = [
            (QueryShape::Filter, 10),
            (QueryShape::TopN, 6),
            (QueryShape::Distinct, 3),
            (QueryShape::Aggregate, 10),
            (QueryShape::Join, 14),
            (QueryShape::JoinAggregate, 8),
            (QueryShape::ThreeWayJoin, 3),
            (QueryShape::StarAggregate, 5),
            (QueryShape::SemiAntiJoin, 10),
            (QueryShape::SetOperation, 8),
            (QueryShape::ScalarSubquery, 5),
            (QueryShape::Window, 5),
            (QueryShape::RecursiveCte, 2),
        ];
        let weights: Vec<u32> = shapes.iter().map(|(_, weight)| *weight).collect();
        let shape = shapes[self.random.weighted(&weights)].0;
        match shape {
            QueryShape::Filter => self.filter(),
            QueryShape::TopN => self.top_n(),
            QueryShape::Distinct => self.distinct(),
            QueryShape::Aggregate => self.aggregate(),
            QueryShape::Join => self.join(),
            QueryShape::JoinAggregate => self.join_aggregate(),
            QueryShape::ThreeWayJoin => self.three_way_join(),
            QueryShape::StarAggregate => self.star_aggregate(),
            QueryShape::SemiAntiJoin => self.semi_anti_join(),
            QueryShape::SetOperation => self.set_operation(),
            QueryShape::ScalarSubquery => self.scalar_subquery(),
            QueryShape::Window => self.window(),
            QueryShape::RecursiveCte => self.recursive_cte(),
            QueryShape::KeyedGroup => self.keyed_group(),
        }
    }

    // ---------------------------------------------------------------- scopes

    fn table(&mut self) -> &'schema FuzzTable {
        let tables = &self.schema.tables;
        &tables[self.random.below(tables.len())]
    }

    /// Two tables, usually different ones (a self-join now and then).
    fn two_tables(&mut self) -> (&'schema FuzzTable, &'schema FuzzTable) {
        let tables = &self.schema.tables;
        let first = self.random.below(tables.len());
        let mut second = self.random.below(tables.len());
        if second == first && self.random.percent(80) {
            second = (first + 1) % tables.len();
        }
        (&tables[first], &tables[second])
    }

    fn columns(table: &'schema FuzzTable, alias: &'schema str) -> Vec<Column<'schema>> {
        table
            .spec
            .columns
            .iter()
            .enumerate()
            .filter(|(_, spec)| spec.name != NAME_COLUMN)
            .map(|(index, spec)| Column {
                alias,
                spec,
                table,
                index,
            })
            .collect()
    }

    fn pick_column(
        &mut self,
        scope: &[Column<'schema>],
        category: Category,
    ) -> Option<Column<'schema>> {
        let matching: Vec<&Column<'schema>> = scope
            .iter()
            .filter(|column| column.category() == category)
            .collect();
        if matching.is_empty() {
            None
        } else {
            Some(*matching[self.random.below(matching.len())])
        }
    }

    fn key_columns(scope: &[Column<'schema>]) -> Vec<Column<'schema>> {
        scope
            .iter()
            .filter(|column| column.spec.key.is_some())
            .copied()
            .collect()
    }

    fn categories(scope: &[Column<'schema>]) -> Vec<Category> {
        let mut categories: Vec<Category> = Vec::new();
        for column in scope {
            if !categories.contains(&column.category()) {
                categories.push(column.category());
            }
        }
        categories
    }

    // -------------------------------------------------------------- literals

    /// A literal of `column`'s type: a value of a random row (so that
    /// predicates select something) or a made-up one.
    fn literal_for(&mut self, column: &Column<'schema>) -> String {
        let rows = column.table.batch.num_rows();
        if rows > 0 && self.random.percent(70) {
            let array = column.table.batch.column(column.index);
            let row = self.random.below(rows);
            if array.is_valid(row) {
                let options = FormatOptions::default();
                if let Ok(formatter) = ArrayFormatter::try_new(array.as_ref(), &options) {
                    let text = formatter.value(row).to_string();
                    return match &column.spec.data_type {
                        DataType::Decimal128(precision, scale) => {
                            format!("CAST('{text}' AS DECIMAL({precision}, {scale}))")
                        }
                        DataType::Float32 => format!("CAST('{text}' AS REAL)"),
                        DataType::Float64 => format!("CAST('{text}' AS DOUBLE)"),
                        DataType::Utf8 => quote(&text),
                        DataType::Date32 => format!("DATE '{text}'"),
                        DataType::Timestamp(..) => format!("TIMESTAMP '{text}'"),
                        _ => text,
                    };
                }
            }
        }
        self.made_up_literal(column.category())
    }

    fn text_literal(&mut self) -> String {
        let text = *self.random.pick(&TEXT_LITERALS);
        quote(text)
    }

    fn made_up_literal(&mut self, category: Category) -> String {
        match category {
            Category::Integer => self.random.between(-3, 40).to_string(),
            // An integer: a literal with a fraction is a double, which
            // DataFusion coerces with a Decimal128(25, 0) column to
            // Decimal128(38, 15), overflowing on large values.
            Category::Decimal => self.random.between(-50, 500).to_string(),
            Category::Float => self
                .random
                .pick(&[
                    "1.5",
                    "-2.25",
                    "0.0",
                    "-0.0",
                    "100.0",
                    "CAST('NaN' AS DOUBLE)",
                    "CAST('inf' AS DOUBLE)",
                    "CAST('-inf' AS DOUBLE)",
                ])
                .to_string(),
            Category::Text => self.text_literal(),
            Category::Date => format!(
                "DATE '{}-{:02}-{:02}'",
                self.random.between(1968, 2026),
                self.random.between(1, 12),
                self.random.between(1, 28)
            ),
            Category::Timestamp => format!(
                "TIMESTAMP '{}-{:02}-{:02} {:02}:{:02}:00'",
                self.random.between(1970, 2030),
                self.random.between(1, 12),
                self.random.between(1, 28),
                self.random.between(0, 23),
                self.random.between(0, 59)
            ),
            Category::Boolean => self.random.pick(&["TRUE", "FALSE"]).to_string(),
        }
    }

    // ----------------------------------------------------------- expressions

    /// An expression of `category` over `scope` (a literal when no column
    /// has that category). Arithmetic never nests, so it cannot overflow.
    fn value(&mut self, scope: &[Column<'schema>], category: Category) -> String {
        let Some(column) = self.pick_column(scope, category) else {
            return self.made_up_literal(category);
        };
        let sql = column.sql();
        if self.random.percent(50) {
            return sql;
        }
        match category {
            Category::Integer => match self.random.below(10) {
                0 => format!("{sql} + {}", self.random.between(1, 100)),
                1 => format!("CAST({sql} AS BIGINT) * {}", self.random.between(2, 7)),
                2 => format!("{sql} % {}", self.random.between(2, 9)),
                3 => format!("abs({sql})"),
                4 => {
                    let divisor = self.pick_column(scope, Category::Integer).unwrap_or(column);
                    format!("CAST({sql} AS BIGINT) / NULLIF({}, 0)", divisor.sql())
                }
                5 => format!("coalesce({sql}, {})", self.random.between(-1, 9)),
                6 if !column.is_unsigned() => {
                    format!("CAST({sql} AS BIGINT) - {}", self.random.between(1, 50))
                }
                7 => match self.pick_column(scope, Category::Text) {
                    Some(text) => format!("length({})", text.sql()),
                    None => sql,
                },
                8 => match self.pick_column(scope, Category::Text) {
                    Some(text) => format!("TRY_CAST({} AS BIGINT)", text.sql()),
                    None => format!("TRY_CAST({sql} AS INT)"),
                },
                _ => match self.pick_column(scope, Category::Date) {
                    Some(date) => format!("CAST(date_part('day', {}) AS BIGINT)", date.sql()),
                    None => sql,
                },
            },
            Category::Decimal => match self.random.below(5) {
                0 => format!("{sql} * {}", self.random.between(2, 5)),
                1 => format!("abs({sql})"),
                2 => format!("-{sql}"),
                // Not round(): DataFusion 55 widens the precision of a
                // rounded Decimal128(25, 0) and then fails at run time to
                // compare it with a Decimal128(25, 0) literal, in plain
                // DataFusion but not in Sieve (an error on one side only).
                3 => format!("{sql} + 1"),
                _ => format!("coalesce({sql}, 0)"),
            },
            Category::Float => match self.random.below(7) {
                0 => format!("{sql} * 1.5"),
                1 => format!("{sql} + 2.25"),
                2 => format!("abs({sql})"),
                3 => format!("round({sql}, {})", self.random.below(3)),
                4 => format!("-{sql}"),
                5 => match self.pick_column(scope, Category::Integer) {
                    Some(integer) => format!("CAST({} AS DOUBLE)", integer.sql()),
                    None => sql,
                },
                _ => {
                    let divisor = self.pick_column(scope, Category::Float).unwrap_or(column);
                    format!("{sql} / NULLIF({}, 0)", divisor.sql())
                }
            },
            Category::Text => match self.random.below(12) {
                0 => format!("lower({sql})"),
                1 => format!("upper({sql})"),
                2 => format!(
                    "substr({sql}, {}, {})",
                    self.random.between(1, 3),
                    self.random.between(1, 4)
                ),
                3 => format!("concat({sql}, 'ó')"),
                4 => format!("{sql} || '_'"),
                5 => format!("md5({sql})"),
                6 => match self.pick_column(scope, Category::Integer) {
                    Some(integer) => format!("to_hex(CAST({} AS BIGINT))", integer.sql()),
                    None => sql,
                },
                7 => match self.pick_column(scope, Category::Integer) {
                    Some(integer) => format!("CAST({} AS VARCHAR)", integer.sql()),
                    None => sql,
                },
                8 => format!("coalesce({sql}, 'none')"),
                9 => format!("replace({sql}, 'a', 'ó')"),
                10 => format!("left({sql}, 2)"),
                _ => format!("trim({sql})"),
            },
            Category::Date => match self.random.below(4) {
                0 => format!("{sql} + INTERVAL '{} days'", self.random.between(1, 40)),
                1 => format!("{sql} - INTERVAL '1 month'"),
                2 => match self.pick_column(scope, Category::Timestamp) {
                    Some(timestamp) => format!("CAST({} AS DATE)", timestamp.sql()),
                    None => sql,
                },
                _ => format!("coalesce({sql}, DATE '2000-01-01')"),
            },
            Category::Timestamp => match self.random.below(4) {
                0 => format!("{sql} + INTERVAL '{} hours'", self.random.between(1, 30)),
                1 => format!("date_trunc('day', {sql})"),
                2 => match self.pick_column(scope, Category::Date) {
                    Some(date) => format!("CAST({} AS TIMESTAMP)", date.sql()),
                    None => sql,
                },
                _ => format!("{sql} - INTERVAL '3 days'"),
            },
            Category::Boolean => match self.random.below(3) {
                0 => format!("(NOT {sql})"),
                1 => format!("coalesce({sql}, FALSE)"),
                _ => format!("({sql} IS TRUE)"),
            },
        }
    }

    /// A boolean predicate over `scope`, nested at most `depth` levels.
    fn predicate(&mut self, scope: &[Column<'schema>], depth: u32) -> String {
        if depth > 0 && self.random.percent(35) {
            return match self.random.below(5) {
                0 | 1 => format!(
                    "({} AND {})",
                    self.predicate(scope, depth - 1),
                    self.predicate(scope, depth - 1)
                ),
                2 | 3 => format!(
                    "({} OR {})",
                    self.predicate(scope, depth - 1),
                    self.predicate(scope, depth - 1)
                ),
                _ => format!("NOT ({})", self.predicate(scope, depth - 1)),
            };
        }
        if scope.is_empty() {
            return "TRUE".into();
        }
        let column = scope[self.random.below(scope.len())];
        let category = column.category();
        let sql = column.sql();
        match self.random.weighted(&[10, 3, 3, 3, 2, 2, 1, 4]) {
            // A comparison with a literal or another expression.
            0 => {
                let operator = *self.random.pick(&["=", "<>", "<", "<=", ">", ">="]);
                let left = if self.random.percent(60) {
                    sql
                } else {
                    self.value(scope, category)
                };
                let right = if self.random.percent(70) {
                    self.literal_for(&column)
                } else {
                    self.value(scope, category)
                };
                format!("{left} {operator} {right}")
            }
            1 => {
                let not = if self.random.percent(30) { "NOT " } else { "" };
                let mut bounds = [self.literal_for(&column), self.literal_for(&column)];
                if self.random.percent(50) {
                    bounds.swap(0, 1);
                }
                format!("({sql} {not}BETWEEN {} AND {})", bounds[0], bounds[1])
            }
            2 => {
                let not = if self.random.percent(30) { "NOT " } else { "" };
                let count = 1 + self.random.below(4);
                let mut items: Vec<String> =
                    (0..count).map(|_| self.literal_for(&column)).collect();
                if self.random.percent(15) {
                    items.push("NULL".into());
                }
                format!("{sql} {not}IN ({})", items.join(", "))
            }
            3 => {
                let not = if self.random.percent(50) { "NOT " } else { "" };
                format!("{} IS {not}NULL", self.value(scope, category))
            }
            4 => {
                let not = if self.random.percent(50) { "NOT " } else { "" };
                let other = if self.random.percent(60) {
                    self.literal_for(&column)
                } else {
                    self.value(scope, category)
                };
                // Parenthesised: `x IS DISTINCT FROM y AND z` parses as
                // `x IS DISTINCT FROM (y AND z)`.
                format!("({sql} IS {not}DISTINCT FROM {other})")
            }
            5 => format!(
                "CASE WHEN {} THEN {} ELSE {} END",
                self.predicate(scope, 0),
                self.predicate(scope, 0),
                self.predicate(scope, 0)
            ),
            6 => {
                let value = self.value(scope, Category::Integer);
                format!("{value} = {}", self.random.between(0, 9))
            }
            // Category-specific predicates.
            _ => match category {
                Category::Text => match self.random.below(6) {
                    0 | 1 => {
                        let operator =
                            *self
                                .random
                                .pick(&["LIKE", "NOT LIKE", "ILIKE", "NOT ILIKE"]);
                        let pattern = self.random.pick(&LIKE_PATTERNS);
                        format!("{sql} {operator} '{pattern}'")
                    }
                    2 => format!("regexp_like({sql}, '{}')", self.random.pick(&REGEXES)),
                    3 => format!("starts_with({sql}, {})", self.text_literal()),
                    4 => format!("length({sql}) > {}", self.random.between(0, 5)),
                    _ => format!("lower({sql}) = {}", self.text_literal()),
                },
                Category::Boolean => match self.random.below(3) {
                    0 => sql,
                    1 => format!("NOT {sql}"),
                    _ => format!("{sql} IS NOT TRUE"),
                },
                Category::Date => format!(
                    "CAST(date_part('year', {sql}) AS BIGINT) {} {}",
                    self.random.pick(&["=", "<", ">="]),
                    self.random.between(1968, 2026)
                ),
                Category::Timestamp => format!(
                    "{sql} + INTERVAL '{} minutes' > {}",
                    self.random.between(1, 600),
                    self.literal_for(&column)
                ),
                Category::Float => match self.random.below(3) {
                    0 => format!("{sql} = CAST('NaN' AS DOUBLE)"),
                    1 => format!("{sql} = -0.0"),
                    _ => format!("abs({sql}) < {}", self.random.between(1, 500)),
                },
                Category::Integer | Category::Decimal => format!(
                    "{} {} {}",
                    self.value(scope, category),
                    self.random.pick(&["<", ">", "="]),
                    self.literal_for(&column)
                ),
            },
        }
    }

    /// A WHERE clause (or nothing).
    fn where_clause(&mut self, scope: &[Column<'schema>], percent: u32) -> String {
        if self.random.percent(percent) {
            format!(" WHERE {}", self.predicate(scope, 2))
        } else {
            String::new()
        }
    }

    /// One to four output expressions over `scope`, exact.
    fn projection(&mut self, scope: &[Column<'schema>]) -> Vec<String> {
        let categories = Self::categories(scope);
        let count = 1 + self.random.below(4);
        (0..count)
            .map(|_| {
                if self.random.percent(15) {
                    return format!(
                        "CASE WHEN {} THEN {} ELSE {} END",
                        self.predicate(scope, 0),
                        self.value(scope, Category::Integer),
                        self.made_up_literal(Category::Integer)
                    );
                }
                let category = *self.random.pick(&categories);
                self.value(scope, category)
            })
            .collect()
    }

    /// An aggregate over `scope`, and whether it is a float aggregate.
    fn aggregate_call(&mut self, scope: &[Column<'schema>]) -> Output {
        let filter = if self.random.percent(15) {
            format!(" FILTER (WHERE {})", self.predicate(scope, 1))
        } else {
            String::new()
        };
        let numeric = numeric_columns(scope);
        let any = scope[self.random.below(scope.len())];
        let output = match self.random.weighted(&[3, 2, 2, 4, 2, 3, 3, 2, 2]) {
            0 => Output::exact("count(*)".into()),
            1 => Output::exact(format!("count({})", any.sql())),
            2 => Output::exact(format!("count(DISTINCT {})", any.sql())),
            3 | 4 if !numeric.is_empty() => {
                let column = *self.random.pick(&numeric);
                let function = if self.random.percent(60) {
                    "sum"
                } else {
                    "avg"
                };
                // Integer and decimal sums are exact; a float sum, and an
                // average of integers (computed in floats), depend on order.
                let approximate = column.category() == Category::Float
                    || (function == "avg" && column.category() == Category::Integer);
                Output {
                    sql: format!("{function}({})", column.sql()),
                    approximate,
                }
            }
            5 | 6 => {
                let function = if self.random.percent(50) {
                    "min"
                } else {
                    "max"
                };
                let column = self.min_max_argument(scope);
                Output::exact(format!("{function}({})", column.sql()))
            }
            7 => {
                let function = if self.random.percent(50) {
                    "bool_and"
                } else {
                    "bool_or"
                };
                let argument = match self.pick_column(scope, Category::Boolean) {
                    Some(column) if self.random.percent(50) => column.sql(),
                    _ => self.predicate(scope, 0),
                };
                Output::exact(format!("{function}({argument})"))
            }
            _ if !numeric.is_empty() => {
                let column = *self.random.pick(&numeric);
                let function = *self.random.pick(&["var_samp", "stddev"]);
                // Over the values' remainder by 1000: the variance of values
                // of magnitude M carries a rounding error of about M² times
                // the double's epsilon, whatever the result, so two correct
                // plans merging their states in another order differ by more
                // than any tolerance relative to the result once M is large
                // (fuzzer seed 1, schema 23: stddev of two equal values near
                // 7.4e17 was 0.0 in one plan, 63.2 in another).
                Output {
                    sql: format!("{function}({} % 1000)", column.sql()),
                    approximate: true,
                }
            }
            _ => Output::exact("count(*)".into()),
        };
        Output {
            sql: format!("{}{filter}", output.sql),
            approximate: output.approximate,
        }
    }

    /// A column for `min` or `max`: any, floats with NaN, -0.0 and the
    /// infinities included. (DataFusion 55's own grouped `min` over such a
    /// column depends on the order of the rows; Sieve and the reference
    /// both run `sieve_fragment::total_order_min_max`.)
    fn min_max_argument(&mut self, scope: &[Column<'schema>]) -> Column<'schema> {
        scope[self.random.below(scope.len())]
    }

    /// Grouping expressions: keys, booleans, short texts, dates, small
    /// integer expressions; never a float aggregate.
    fn grouping(&mut self, scope: &[Column<'schema>]) -> Vec<String> {
        let count = 1 + self.random.below(2);
        (0..count)
            .map(|_| {
                let column = scope[self.random.below(scope.len())];
                match column.category() {
                    Category::Integer if column.spec.key.is_none() && column.spec.name != "id" => {
                        format!("{} % 5", column.sql())
                    }
                    Category::Text if self.random.percent(50) => {
                        format!("left({}, 1)", column.sql())
                    }
                    Category::Timestamp => format!("date_trunc('year', {})", column.sql()),
                    Category::Decimal => format!("round({}, -2)", column.sql()),
                    _ => column.sql(),
                }
            })
            .collect()
    }

    // ----------------------------------------------------------------- joins

    /// Estimated output rows of an equi-join of two key columns (an upper
    /// bound for outer joins' matched part), NULL matching NULL when
    /// `null_safe`.
    fn join_rows_estimate(left: &Column<'_>, right: &Column<'_>, null_safe: bool) -> usize {
        let counts = |column: &Column<'_>| -> HashMap<Option<i64>, usize> {
            let mut counts = HashMap::new();
            if let Some(values) = column.table.key_values.get(&column.spec.name) {
                for value in values {
                    *counts.entry(*value).or_insert(0) += 1;
                }
            }
            counts
        };
        let left_counts = counts(left);
        let right_counts = counts(right);
        left_counts
            .iter()
            .filter(|(value, _)| null_safe || value.is_some())
            .map(|(value, count)| count * right_counts.get(value).copied().unwrap_or(0))
            .sum()
    }

    /// The FROM item of `table` as `alias`, restricted to its first `rows`
    /// ids when that is below its size.
    fn from_item(table: &FuzzTable, alias: &str, rows: usize) -> String {
        if rows < table.spec.rows() {
            format!(
                "(SELECT * FROM {} WHERE id <= {rows}) AS {alias}",
                table.spec.name
            )
        } else {
            format!("{} AS {alias}", table.spec.name)
        }
    }

    /// `left JOIN right ON ...` with a random type and condition, its
    /// output bounded by [`JOIN_ROWS_MAX`]. Returns the FROM clause and the
    /// join type.
    fn join_clause(
        &mut self,
        left_table: &'schema FuzzTable,
        right_table: &'schema FuzzTable,
        rows_max: usize,
    ) -> (String, &'static str) {
        let left_scope = Self::columns(left_table, ALIASES[0]);
        let right_scope = Self::columns(right_table, ALIASES[1]);
        let left_keys = Self::key_columns(&left_scope);
        let right_keys = Self::key_columns(&right_scope);
        let join_type =
            *self
                .random
                .pick(&["JOIN", "JOIN", "LEFT JOIN", "RIGHT JOIN", "FULL JOIN"]);
        let left_key = *self.random.pick(&left_keys);
        let right_key = *self.random.pick(&right_keys);
        let pairs = left_table.spec.rows() * right_table.spec.rows();
        let kind = self.random.weighted(&[8, 3, 3, 3, 1]);
        let (condition, estimate) = match kind {
            // Equality on one key.
            0 => (
                format!("{} = {}", left_key.sql(), right_key.sql()),
                Self::join_rows_estimate(&left_key, &right_key, false),
            ),
            // NULL equals NULL, now and then with a residual.
            1 => {
                let residual = if self.random.percent(40) {
                    format!(" AND {}", self.residual(&left_scope, &right_scope))
                } else {
                    String::new()
                };
                (
                    format!(
                        "({} IS NOT DISTINCT FROM {}){residual}",
                        left_key.sql(),
                        right_key.sql()
                    ),
                    Self::join_rows_estimate(&left_key, &right_key, true),
                )
            }
            // Equality plus a non-equi residual.
            2 => {
                let residual = self.residual(&left_scope, &right_scope);
                (
                    format!("{} = {} AND {residual}", left_key.sql(), right_key.sql()),
                    Self::join_rows_estimate(&left_key, &right_key, false),
                )
            }
            // Two keys (the id on one side when a table has one key).
            3 => {
                let second_left = *self.random.pick(&left_keys);
                let second_right = *self.random.pick(&right_keys);
                let second = if second_left.spec.name == left_key.spec.name
                    && second_right.spec.name == right_key.spec.name
                {
                    format!("{} % 3 = {} % 3", left_scope[0].sql(), right_scope[0].sql())
                } else {
                    format!("{} = {}", second_left.sql(), second_right.sql())
                };
                (
                    format!("{} = {} AND {second}", left_key.sql(), right_key.sql()),
                    Self::join_rows_estimate(&left_key, &right_key, false),
                )
            }
            // No equality at all: a nested-loop join, small inputs only.
            _ if pairs <= NESTED_LOOP_PAIRS_MAX => (
                format!(
                    "({} < {} OR {} = {})",
                    left_key.sql(),
                    right_key.sql(),
                    left_scope[0].sql(),
                    right_scope[0].sql()
                ),
                pairs,
            ),
            _ => (
                format!("{} = {}", left_key.sql(), right_key.sql()),
                Self::join_rows_estimate(&left_key, &right_key, false),
            ),
        };
        let left_rows = left_table.spec.rows();
        let left_rows_kept = if estimate > rows_max {
            (left_rows * rows_max / estimate).max(1)
        } else {
            left_rows
        };
        let from = format!(
            "{} {join_type} {} ON {condition}",
            Self::from_item(left_table, ALIASES[0], left_rows_kept),
            Self::from_item(right_table, ALIASES[1], usize::MAX),
        );
        (from, join_type)
    }

    /// A non-equi condition between the two sides: ids, or two columns of
    /// one category.
    fn residual(&mut self, left: &[Column<'schema>], right: &[Column<'schema>]) -> String {
        let left_categories = Self::categories(left);
        let shared: Vec<Category> = Self::categories(right)
            .into_iter()
            .filter(|category| left_categories.contains(category) && *category != Category::Boolean)
            .collect();
        let operator = *self.random.pick(&["<", "<=", ">", "<>"]);
        if self.random.percent(40) || shared.is_empty() {
            return format!("{} {operator} {}", left[0].sql(), right[0].sql());
        }
        let category = *self.random.pick(&shared);
        let left_value = self.value(left, category);
        let right_value = self.value(right, category);
        format!("{left_value} {operator} {right_value}")
    }

    // ---------------------------------------------------------------- shapes

    fn filter(&mut self) -> FuzzQuery {
        let table = self.table();
        let scope = Self::columns(table, ALIASES[0]);
        let mut outputs = vec![format!("{}.id", ALIASES[0])];
        outputs.extend(self.projection(&scope));
        let sql = format!(
            "SELECT {} FROM {} AS a{}",
            select_list(&outputs),
            table.spec.name,
            self.where_clause(&scope, 90)
        );
        query(sql, QueryShape::Filter, false, vec![])
    }

    fn top_n(&mut self) -> FuzzQuery {
        let table = self.table();
        let scope = Self::columns(table, ALIASES[0]);
        let mut outputs = vec!["a.id".to_string()];
        outputs.extend(self.projection(&scope));
        let descending = if self.random.percent(50) { " DESC" } else { "" };
        let nulls = *self.random.pick(&["", " NULLS FIRST", " NULLS LAST"]);
        // Order by an output expression first, then by id: a total order.
        let order = if outputs.len() > 1 && self.random.percent(60) {
            format!("2{descending}{nulls}, 1")
        } else {
            format!("1{descending}")
        };
        let sql = format!(
            "SELECT {} FROM {} AS a{} ORDER BY {order} LIMIT {}",
            select_list(&outputs),
            table.spec.name,
            self.where_clause(&scope, 70),
            self.random.between(0, LIMIT_MAX)
        );
        query(sql, QueryShape::TopN, true, vec![])
    }

    fn distinct(&mut self) -> FuzzQuery {
        let table = self.table();
        let scope = Self::columns(table, ALIASES[0]);
        let outputs = self.projection(&scope);
        let positions: Vec<String> = (1..=outputs.len()).map(|index| index.to_string()).collect();
        let ordered = self.random.percent(40);
        let tail = if ordered {
            format!(
                " ORDER BY {} LIMIT {}",
                positions.join(", "),
                self.random.between(1, LIMIT_MAX)
            )
        } else {
            String::new()
        };
        let sql = format!(
            "SELECT DISTINCT {} FROM {} AS a{}{tail}",
            select_list(&outputs),
            table.spec.name,
            self.where_clause(&scope, 60),
        );
        query(sql, QueryShape::Distinct, ordered, vec![])
    }

    /// SELECT groups, aggregates FROM scope [WHERE] [GROUP BY] [HAVING]
    /// [ORDER BY groups LIMIT]: the grouping columns come first.
    fn aggregate_over(
        &mut self,
        from: &str,
        scope: &[Column<'schema>],
        shape: QueryShape,
    ) -> FuzzQuery {
        let groups = if self.random.percent(75) {
            self.grouping(scope)
        } else {
            vec![]
        };
        let count = 1 + self.random.below(4);
        let aggregates: Vec<Output> = (0..count).map(|_| self.aggregate_call(scope)).collect();
        let (outputs, approximate) = outputs_after(&groups, &aggregates);
        let mut sql = format!(
            "SELECT {} FROM {from}{}",
            select_list(&outputs),
            self.where_clause(scope, 60)
        );
        let mut ordered = false;
        if !groups.is_empty() {
            let _ = write!(sql, " GROUP BY {}", groups.join(", "));
            if self.random.percent(25) {
                let having = match self.random.below(3) {
                    0 => format!("count(*) > {}", self.random.between(0, 3)),
                    1 => {
                        let column = scope[self.random.below(scope.len())];
                        format!("min({}) IS NOT NULL", column.sql())
                    }
                    _ => format!("count(*) = {}", self.random.between(1, 2)),
                };
                let _ = write!(sql, " HAVING {having}");
            }
            if self.random.percent(30) {
                let positions: Vec<String> =
                    (1..=groups.len()).map(|index| index.to_string()).collect();
                let _ = write!(
                    sql,
                    " ORDER BY {} LIMIT {}",
                    positions.join(", "),
                    self.random.between(1, LIMIT_MAX)
                );
                ordered = true;
            }
        }
        query(sql, shape, ordered, approximate)
    }

    fn aggregate(&mut self) -> FuzzQuery {
        let table = self.table();
        let scope = Self::columns(table, ALIASES[0]);
        let from = format!("{} AS a", table.spec.name);
        self.aggregate_over(&from, &scope, QueryShape::Aggregate)
    }

    fn join(&mut self) -> FuzzQuery {
        let (left, right) = self.two_tables();
        let (from, _) = self.join_clause(left, right, JOIN_ROWS_MAX);
        let mut scope = Self::columns(left, ALIASES[0]);
        scope.extend(Self::columns(right, ALIASES[1]));
        let mut outputs = vec!["a.id".to_string(), "b.id".to_string()];
        outputs.extend(self.projection(&scope));
        let mut sql = format!(
            "SELECT {} FROM {from}{}",
            select_list(&outputs),
            self.where_clause(&scope, 40)
        );
        // The pair of ids is unique in any join's output.
        let ordered = self.random.percent(30);
        if ordered {
            let _ = write!(
                sql,
                " ORDER BY 1 NULLS FIRST, 2 NULLS FIRST LIMIT {}",
                self.random.between(1, LIMIT_MAX)
            );
        }
        query(sql, QueryShape::Join, ordered, vec![])
    }

    fn join_aggregate(&mut self) -> FuzzQuery {
        let (left, right) = self.two_tables();
        let (from, _) = self.join_clause(left, right, JOIN_ROWS_MAX * 5);
        let mut scope = Self::columns(left, ALIASES[0]);
        scope.extend(Self::columns(right, ALIASES[1]));
        self.aggregate_over(&from, &scope, QueryShape::JoinAggregate)
    }

    fn three_way_join(&mut self) -> FuzzQuery {
        let (first, second) = self.two_tables();
        let third = self.table();
        let (from, _) = self.join_clause(first, second, JOIN_ROWS_MAX / 4);
        let second_scope = Self::columns(second, ALIASES[1]);
        let third_scope = Self::columns(third, ALIASES[2]);
        let second_key = *self.random.pick(&Self::key_columns(&second_scope));
        let third_key = *self.random.pick(&Self::key_columns(&third_scope));
        // Bound the third table by its key's largest multiplicity.
        let third_rows = Self::rows_with_few_per_key(third, &third_key);
        let join_type = *self.random.pick(&["JOIN", "LEFT JOIN", "JOIN"]);
        let mut scope = Self::columns(first, ALIASES[0]);
        scope.extend(second_scope);
        scope.extend(third_scope);
        let aggregates: Vec<Output> = (0..2).map(|_| self.aggregate_call(&scope)).collect();
        let approximate = aggregates
            .iter()
            .enumerate()
            .filter(|(_, output)| output.approximate)
            .map(|(index, _)| index + 1)
            .collect();
        let sql = format!(
            "SELECT {} FROM {from} {join_type} {} ON {} = {}{}",
            select_list(
                &std::iter::once("count(*)".to_string())
                    .chain(aggregates.iter().map(|output| output.sql.clone()))
                    .collect::<Vec<_>>()
            ),
            Self::from_item(third, ALIASES[2], third_rows),
            second_key.sql(),
            third_key.sql(),
            self.where_clause(&scope, 50)
        );
        query(sql, QueryShape::ThreeWayJoin, false, approximate)
    }

    /// `SELECT b.name[, ...], aggregates FROM a JOIN b ON <a's key> = b.id
    /// ... GROUP BY b.name[, ...]`: `b.id` is unique and decides `b.name`,
    /// some names are shared by several ids and some are NULL; inner and
    /// outer joins (`b` NULL-padded or not), other grouping columns of
    /// either side, and now and then what the rewrite must leave alone
    /// (`b.id` grouped, `avg`, `count(DISTINCT)`).
    fn keyed_group(&mut self) -> FuzzQuery {
        let (fact, dimension) = self.two_tables();
        let fact_scope = Self::columns(fact, ALIASES[0]);
        let dimension_scope = Self::columns(dimension, ALIASES[1]);
        let integer_keys: Vec<Column<'schema>> = Self::key_columns(&fact_scope)
            .into_iter()
            .filter(|column| column.category() == Category::Integer)
            .collect();
        // Each fact row matches at most one dimension row: the join is no
        // larger than its sides.
        let fact_key = match self.random.below(4) {
            0 | 1 if !integer_keys.is_empty() => self.random.pick(&integer_keys).sql(),
            2 => "a.id % 37 + 1".to_string(),
            _ => "a.id".to_string(),
        };
        let join_type =
            *self
                .random
                .pick(&["JOIN", "JOIN", "LEFT JOIN", "RIGHT JOIN", "FULL JOIN"]);
        let mut from = format!(
            "{} AS a {join_type} {} AS b ON {fact_key} = b.id",
            fact.spec.name, dimension.spec.name
        );
        // Now and then a third table joined to the first on a key, as
        // TPC-H Q21 and Q5 carry the grouped table's names through
        // further joins; its multiplicity per key is bounded.
        let mut third = SeededRandom::new(self.seed ^ KEYED_THIRD_SEED);
        if third.percent(40) {
            let tables = &self.schema.tables;
            let table = &tables[third.below(tables.len())];
            let third_scope = Self::columns(table, ALIASES[2]);
            let first_keys = Self::key_columns(&fact_scope);
            let third_keys = Self::key_columns(&third_scope);
            if !first_keys.is_empty() && !third_keys.is_empty() {
                let first_key = *third.pick(&first_keys);
                let third_key = *third.pick(&third_keys);
                let rows = Self::rows_with_few_per_key(table, &third_key);
                let join = *third.pick(&["JOIN", "LEFT JOIN"]);
                let _ = write!(
                    from,
                    " {join} {} ON {} = {}",
                    Self::from_item(table, ALIASES[2], rows),
                    first_key.sql(),
                    third_key.sql()
                );
            }
        }
        let mut groups = vec![format!("b.{NAME_COLUMN}")];
        if self.random.percent(35) {
            groups.extend(self.grouping(&fact_scope).into_iter().take(1));
        }
        if self.random.percent(25) {
            let column = dimension_scope[self.random.below(dimension_scope.len())];
            groups.push(column.sql());
        }
        if self.random.percent(10) {
            groups.push("b.id".to_string());
        }
        let mut scope = fact_scope.clone();
        scope.extend(dimension_scope.iter().copied());
        let count = 1 + self.random.below(3);
        let aggregates: Vec<Output> = (0..count)
            .map(|_| {
                if self.random.percent(25) {
                    return self.aggregate_call(&scope);
                }
                self.mergeable_aggregate(&fact_scope)
            })
            .collect();
        let filter = self.where_clause(&scope, 40);
        let (groups, aggregates, from) =
            if SeededRandom::new(self.seed ^ KEYED_SUBQUERY_SEED).percent(30) {
                in_subquery(&scope, groups, aggregates, &from, &filter)
            } else {
                (groups, aggregates, format!("{from}{filter}"))
            };
        let (outputs, approximate) = outputs_after(&groups, &aggregates);
        let mut sql = format!("SELECT {} FROM {from}", select_list(&outputs));
        let _ = write!(sql, " GROUP BY {}", groups.join(", "));
        let mut ordered = false;
        if self.random.percent(20) {
            let positions: Vec<String> = (1..=groups.len())
                .map(|index| format!("{index} NULLS FIRST"))
                .collect();
            let _ = write!(
                sql,
                " ORDER BY {} LIMIT {}",
                positions.join(", "),
                self.random.between(1, LIMIT_MAX)
            );
            ordered = true;
        }
        query(sql, QueryShape::KeyedGroup, ordered, approximate)
    }

    /// `count`, `sum`, `min` or `max`: the aggregates a grouping by a key
    /// first can merge.
    fn mergeable_aggregate(&mut self, scope: &[Column<'schema>]) -> Output {
        let numeric = numeric_columns(scope);
        match self.random.below(5) {
            0 => Output::exact("count(*)".into()),
            1 => {
                let column = scope[self.random.below(scope.len())];
                Output::exact(format!("count({})", column.sql()))
            }
            2 if !numeric.is_empty() => {
                let column = *self.random.pick(&numeric);
                Output {
                    sql: format!("sum({})", column.sql()),
                    approximate: column.category() == Category::Float,
                }
            }
            _ => {
                let function = *self.random.pick(&["min", "max"]);
                let column = self.min_max_argument(scope);
                Output::exact(format!("{function}({})", column.sql()))
            }
        }
    }

    /// Rows of `table` (its first ones, by id) such that no value of `key`
    /// repeats more than 8 times, about.
    fn rows_with_few_per_key(table: &FuzzTable, key: &Column<'_>) -> usize {
        let key_rows_max = table
            .key_values
            .get(&key.spec.name)
            .map(|values| {
                let mut counts: HashMap<Option<i64>, usize> = HashMap::new();
                for value in values.iter().flatten() {
                    *counts.entry(Some(*value)).or_insert(0) += 1;
                }
                counts.values().copied().max().unwrap_or(0)
            })
            .unwrap_or(0);
        if key_rows_max > 8 {
            table.spec.rows() * 8 / key_rows_max
        } else {
            table.spec.rows()
        }
    }

    fn star_aggregate(&mut self) -> FuzzQuery {
        let fact = self
            .schema
            .tables
            .iter()
            .max_by_key(|table| table.spec.rows())
            .expect("a schema has tables");
        let fact_scope = Self::columns(fact, ALIASES[0]);
        let fact_keys = Self::key_columns(&fact_scope);
        let mut joins = String::new();
        let mut dimension_scope = Vec::new();
        let mut conditions = Vec::new();
        let mut fact_rows = fact.spec.rows();
        for alias in &ALIASES[1..=1 + self.random.below(2)] {
            let dimension = self.table();
            let scope = Self::columns(dimension, alias);
            let dimension_key = *self.random.pick(&Self::key_columns(&scope));
            let fact_key = *self.random.pick(&fact_keys);
            let rows = Self::rows_with_few_per_key(dimension, &dimension_key);
            // The fact's rows cut so that its join with the first
            // dimension stays within bounds (the second multiplies by 8 at
            // most).
            let estimate = Self::join_rows_estimate(&fact_key, &dimension_key, false);
            if joins.is_empty() && estimate > JOIN_ROWS_MAX {
                fact_rows = (fact_rows * JOIN_ROWS_MAX / estimate).max(1);
            }
            let _ = write!(
                joins,
                " JOIN {} ON {} = {}",
                Self::from_item(dimension, alias, rows),
                fact_key.sql(),
                dimension_key.sql()
            );
            if self.random.percent(75) {
                conditions.push(self.predicate(&scope, 1));
            }
            dimension_scope.extend(scope);
        }
        if self.random.percent(30) {
            conditions.push(self.predicate(&fact_scope, 1));
        }
        let groups = if self.random.percent(85) {
            self.grouping(&dimension_scope)
        } else {
            vec![]
        };
        let count = 1 + self.random.below(3);
        let aggregates: Vec<Output> = (0..count)
            .map(|_| self.aggregate_call(&fact_scope))
            .collect();
        let (outputs, approximate) = outputs_after(&groups, &aggregates);
        let mut sql = format!(
            "SELECT {} FROM {}{joins}",
            select_list(&outputs),
            Self::from_item(fact, ALIASES[0], fact_rows)
        );
        if !conditions.is_empty() {
            let _ = write!(sql, " WHERE {}", conditions.join(" AND "));
        }
        if !groups.is_empty() {
            let _ = write!(sql, " GROUP BY {}", groups.join(", "));
        }
        query(sql, QueryShape::StarAggregate, false, approximate)
    }

    fn semi_anti_join(&mut self) -> FuzzQuery {
        let (outer, inner) = self.two_tables();
        let outer_scope = Self::columns(outer, ALIASES[0]);
        let inner_scope = Self::columns(inner, ALIASES[1]);
        let outer_key = *self.random.pick(&Self::key_columns(&outer_scope));
        let inner_key = *self.random.pick(&Self::key_columns(&inner_scope));
        let inner_filter = if self.random.percent(50) {
            format!(" AND {}", self.predicate(&inner_scope, 1))
        } else {
            String::new()
        };
        let condition = match self.random.below(6) {
            0 => format!(
                "EXISTS (SELECT 1 FROM {} AS b WHERE {} = {}{inner_filter})",
                inner.spec.name,
                inner_key.sql(),
                outer_key.sql()
            ),
            1 => format!(
                "NOT EXISTS (SELECT 1 FROM {} AS b WHERE {} = {}{inner_filter})",
                inner.spec.name,
                inner_key.sql(),
                outer_key.sql()
            ),
            2 => format!(
                "{} IN (SELECT {} FROM {} AS b WHERE TRUE{inner_filter})",
                outer_key.sql(),
                inner_key.sql(),
                inner.spec.name
            ),
            3 => format!(
                "{} NOT IN (SELECT {} FROM {} AS b WHERE TRUE{inner_filter})",
                outer_key.sql(),
                inner_key.sql(),
                inner.spec.name
            ),
            // Correlated, with a residual comparison.
            4 => {
                let residual = self.residual(&outer_scope, &inner_scope);
                format!(
                    "{}EXISTS (SELECT 1 FROM {} AS b WHERE {} = {} AND {residual})",
                    if self.random.percent(50) { "NOT " } else { "" },
                    inner.spec.name,
                    inner_key.sql(),
                    outer_key.sql()
                )
            }
            _ => format!(
                "EXISTS (SELECT 1 FROM {} AS b WHERE ({} IS NOT DISTINCT FROM {}){inner_filter})",
                inner.spec.name,
                inner_key.sql(),
                outer_key.sql()
            ),
        };
        let mut outputs = vec!["a.id".to_string()];
        outputs.extend(self.projection(&outer_scope));
        let extra = if self.random.percent(40) {
            format!(" AND {}", self.predicate(&outer_scope, 1))
        } else {
            String::new()
        };
        let sql = format!(
            "SELECT {} FROM {} AS a WHERE {condition}{extra}",
            select_list(&outputs),
            outer.spec.name
        );
        query(sql, QueryShape::SemiAntiJoin, false, vec![])
    }

    fn set_operation(&mut self) -> FuzzQuery {
        let (left, right) = self.two_tables();
        let left_scope = Self::columns(left, ALIASES[0]);
        let right_scope = Self::columns(right, ALIASES[1]);
        let right_categories = Self::categories(&right_scope);
        let shared: Vec<Category> = Self::categories(&left_scope)
            .into_iter()
            .filter(|category| right_categories.contains(category))
            .collect();
        let width = 1 + self.random.below(3);
        let mut left_outputs = Vec::with_capacity(width);
        let mut right_outputs = Vec::with_capacity(width);
        for position in 0..width {
            // Keys first: they carry the NULLs that set operations trip on.
            let category = if position == 0 {
                Category::Integer
            } else {
                *self.random.pick(&shared)
            };
            let side = |generator: &mut Self, scope: &[Column<'schema>]| {
                let integer_keys: Vec<Column<'schema>> = Self::key_columns(scope)
                    .into_iter()
                    .filter(|key| key.category() == Category::Integer)
                    .collect();
                let expression = if category == Category::Integer
                    && !integer_keys.is_empty()
                    && generator.random.percent(60)
                {
                    generator.random.pick(&integer_keys).sql()
                } else {
                    generator.value(scope, category)
                };
                match category.common_type() {
                    Some(common) => format!("CAST({expression} AS {common})"),
                    None => expression,
                }
            };
            left_outputs.push(format!("{} AS v{position}", side(self, &left_scope)));
            right_outputs.push(format!("{} AS v{position}", side(self, &right_scope)));
        }
        let operator = *self.random.pick(&[
            "UNION",
            "UNION ALL",
            "INTERSECT",
            "INTERSECT ALL",
            "EXCEPT",
            "EXCEPT ALL",
        ]);
        let mut sql = format!(
            "SELECT {} FROM {} AS a{} {operator} SELECT {} FROM {} AS b{}",
            left_outputs.join(", "),
            left.spec.name,
            self.where_clause(&left_scope, 50),
            right_outputs.join(", "),
            right.spec.name,
            self.where_clause(&right_scope, 50),
        );
        let ordered = self.random.percent(30);
        if ordered {
            let positions: Vec<String> = (1..=width).map(|index| index.to_string()).collect();
            let _ = write!(
                sql,
                " ORDER BY {} LIMIT {}",
                positions.join(", "),
                self.random.between(1, LIMIT_MAX)
            );
        }
        query(sql, QueryShape::SetOperation, ordered, vec![])
    }

    fn scalar_subquery(&mut self) -> FuzzQuery {
        let (outer, inner) = self.two_tables();
        let outer_scope = Self::columns(outer, ALIASES[0]);
        let inner_scope = Self::columns(inner, ALIASES[1]);
        let outer_key = *self.random.pick(&Self::key_columns(&outer_scope));
        let inner_key = *self.random.pick(&Self::key_columns(&inner_scope));
        let inner_column = self.min_max_argument(&inner_scope);
        let aggregate = if self.random.percent(40) {
            "count(*)".to_string()
        } else {
            format!(
                "{}({})",
                self.random.pick(&["min", "max", "count"]),
                inner_column.sql()
            )
        };
        let sql = if self.random.percent(60) {
            // Correlated, in the SELECT list.
            format!(
                "SELECT a.id, {} AS v1, (SELECT {aggregate} FROM {} AS b WHERE {} = {}) AS v2 FROM {} AS a{}",
                outer_key.sql(),
                inner.spec.name,
                inner_key.sql(),
                outer_key.sql(),
                outer.spec.name,
                self.where_clause(&outer_scope, 40)
            )
        } else {
            // Uncorrelated, in the WHERE clause.
            let outer_column = self
                .pick_column(&outer_scope, inner_column.category())
                .unwrap_or(outer_key);
            let inner_value = if outer_column.category() == inner_column.category() {
                inner_column.sql()
            } else {
                inner_key.sql()
            };
            format!(
                "SELECT a.id, {} AS v1 FROM {} AS a WHERE {} {} (SELECT {}({inner_value}) FROM {} AS b{})",
                outer_column.sql(),
                outer.spec.name,
                outer_column.sql(),
                self.random.pick(&["<", ">=", "=", "<>"]),
                self.random.pick(&["min", "max"]),
                inner.spec.name,
                self.where_clause(&inner_scope, 60)
            )
        };
        query(sql, QueryShape::ScalarSubquery, false, vec![])
    }

    fn window(&mut self) -> FuzzQuery {
        let table = self.table();
        let scope = Self::columns(table, ALIASES[0]);
        let partition = self.grouping(&scope).remove(0);
        let order_column = scope[self.random.below(scope.len())];
        let numeric = numeric_columns(&scope);
        let summed = *self.random.pick(&numeric);
        let mut outputs = vec![Output::exact("a.id".into())];
        let count = 1 + self.random.below(3);
        for _ in 0..count {
            let output = match self.random.below(7) {
                0 => Output::exact(format!(
                    "rank() OVER (PARTITION BY {partition} ORDER BY {})",
                    order_column.sql()
                )),
                1 => Output::exact(format!(
                    "dense_rank() OVER (PARTITION BY {partition} ORDER BY {} DESC)",
                    order_column.sql()
                )),
                2 => Output::exact("row_number() OVER (ORDER BY a.id)".into()),
                3 => Output::exact(format!(
                    "row_number() OVER (PARTITION BY {partition} ORDER BY a.id DESC)"
                )),
                4 => Output::exact(format!("count(*) OVER (PARTITION BY {partition})")),
                5 => Output {
                    sql: format!("sum({}) OVER (PARTITION BY {partition})", summed.sql()),
                    approximate: summed.category() == Category::Float,
                },
                _ => Output {
                    sql: format!(
                        "sum({}) OVER (PARTITION BY {partition} ORDER BY a.id)",
                        summed.sql()
                    ),
                    approximate: summed.category() == Category::Float,
                },
            };
            outputs.push(output);
        }
        let approximate = outputs
            .iter()
            .enumerate()
            .filter(|(_, output)| output.approximate)
            .map(|(index, _)| index)
            .collect();
        let sql = format!(
            "SELECT {} FROM {} AS a{}",
            select_list(
                &outputs
                    .iter()
                    .map(|output| output.sql.clone())
                    .collect::<Vec<_>>()
            ),
            table.spec.name,
            self.where_clause(&scope, 50)
        );
        query(sql, QueryShape::Window, false, approximate)
    }

    fn recursive_cte(&mut self) -> FuzzQuery {
        let (start, step) = self.two_tables();
        let start_scope = Self::columns(start, ALIASES[0]);
        let step_scope = Self::columns(step, ALIASES[1]);
        let step_key = *self.random.pick(&Self::key_columns(&step_scope));
        // Every step follows a unique id, so each level has at most as many
        // rows as the first.
        let next = *self.random.pick(&["r.id + 1", "r.id * 2", "r.id + 7"]);
        let depth_max = self.random.between(1, 4);
        let sql = format!(
            "WITH RECURSIVE r(id, key_value, depth) AS (\
             SELECT a.id, CAST({} AS VARCHAR), CAST(0 AS BIGINT) FROM {} AS a WHERE {} \
             UNION ALL \
             SELECT b.id, CAST({} AS VARCHAR), r.depth + 1 FROM r JOIN {} AS b ON b.id = {next} \
             WHERE r.depth < {depth_max}) \
             SELECT depth, count(*), count(key_value), min(id), max(id) FROM r GROUP BY depth",
            Self::key_columns(&start_scope)[0].sql(),
            start.spec.name,
            self.predicate(&start_scope, 1),
            step_key.sql(),
            step.spec.name,
        );
        query(sql, QueryShape::RecursiveCte, false, vec![])
    }
}

/// The select list of grouping expressions followed by aggregates, and the
/// positions of the approximate (float) aggregates in it.
fn outputs_after(groups: &[String], aggregates: &[Output]) -> (Vec<String>, Vec<usize>) {
    let mut outputs = groups.to_vec();
    let mut approximate = Vec::new();
    for aggregate in aggregates {
        if aggregate.approximate {
            approximate.push(outputs.len());
        }
        outputs.push(aggregate.sql.clone());
    }
    (outputs, approximate)
}

fn query(
    sql: String,
    shape: QueryShape,
    ordered: bool,
    approximate_columns: Vec<usize>,
) -> FuzzQuery {
    FuzzQuery {
        sql,
        shape,
        ordered,
        approximate_columns,
    }
}

/// A SELECT list with every expression named (`v0`, `v1`, ...): DataFusion
/// rejects two unnamed expressions with the same text.
fn select_list(outputs: &[String]) -> String {
    outputs
        .iter()
        .enumerate()
        .map(|(index, output)| format!("{output} AS v{index}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `text` as a SQL string literal.
fn quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// A keyed-group query's joins and filter in a subquery `q` that names
/// each column `<alias>_<name>` and leaves `b.id` out unless the query
/// uses it: its groups, aggregates and `FROM` over `q`.
fn in_subquery(
    scope: &[Column<'_>],
    groups: Vec<String>,
    aggregates: Vec<Output>,
    from: &str,
    filter: &str,
) -> (Vec<String>, Vec<Output>, String) {
    let mut columns: Vec<String> = scope.iter().map(Column::sql).collect();
    columns.push(format!("b.{NAME_COLUMN}"));
    let used = |column: &str| {
        groups
            .iter()
            .chain(aggregates.iter().map(|output| &output.sql))
            .any(|sql| rename_column(sql, column, "") != *sql)
    };
    columns.retain(|column| column != "b.id" || used(column));
    // Longest first: no name is replaced inside a longer one.
    columns.sort_by_key(|column| std::cmp::Reverse(column.len()));
    let renamed = |sql: &str| {
        columns.iter().fold(sql.to_string(), |sql, column| {
            rename_column(&sql, column, &column.replace('.', "_"))
        })
    };
    let select: Vec<String> = columns
        .iter()
        .map(|column| format!("{column} AS {}", column.replace('.', "_")))
        .collect();
    let groups = groups.iter().map(|group| renamed(group)).collect();
    let aggregates = aggregates
        .into_iter()
        .map(|output| Output {
            sql: renamed(&output.sql),
            approximate: output.approximate,
        })
        .collect();
    let from = format!("(SELECT {} FROM {from}{filter}) AS q", select.join(", "));
    (groups, aggregates, from)
}

/// `sql` with every whole occurrence of the column `column` (`a.c0`, not
/// within `xa.c0` or `a.c0_x`) replaced by `name`.
fn rename_column(sql: &str, column: &str, name: &str) -> String {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '.';
    let mut out = String::with_capacity(sql.len());
    let mut rest = sql;
    while let Some(at) = rest.find(column) {
        // The character before the match, in `rest` or already written.
        let before = rest[..at].chars().last().or_else(|| out.chars().last());
        let after = rest[at + column.len()..].chars().next();
        out.push_str(&rest[..at]);
        if before.is_some_and(word) || after.is_some_and(word) {
            out.push_str(column);
        } else {
            out.push_str(name);
        }
        rest = &rest[at + column.len()..];
    }
    out.push_str(rest);
    out
}

/// The columns of `scope` that `sum` and `avg` take.
fn numeric_columns<'schema>(scope: &[Column<'schema>]) -> Vec<Column<'schema>> {
    scope
        .iter()
        .filter(|column| {
            matches!(
                column.category(),
                Category::Integer | Category::Decimal | Category::Float
            )
        })
        .copied()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::rename_column;

    #[test]
    fn a_column_is_renamed_where_it_stands_alone() {
        assert_eq!(
            rename_column(
                "sum(a.c1) FILTER (WHERE a.c10 > 2 AND xa.c1 = a.c1_x AND a.c1)",
                "a.c1",
                "a_c1"
            ),
            "sum(a_c1) FILTER (WHERE a.c10 > 2 AND xa.c1 = a.c1_x AND a_c1)"
        );
        assert_eq!(rename_column("a.c1", "a.c1", "q"), "q");
        assert_eq!(rename_column("b.id", "a.c1", "q"), "b.id");
    }
}
