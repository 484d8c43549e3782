//! Query results in a form two engines can be compared in: every cell a
//! number, a text or NULL. Sieve's decimals and DuckDB's doubles meet as
//! numbers compared with a relative tolerance; everything else must be equal.

use std::cmp::Ordering;
use std::hash::{Hash, Hasher};

use arrow::array::{Array, AsArray};
use arrow::compute::cast;
use arrow::datatypes::{DataType, Float64Type};
use arrow::record_batch::RecordBatch;
use arrow::util::display::array_value_to_string;
use datafusion::common::Result;
use serde::Serialize;
use serde_json::Value;

/// One cell.
#[derive(Debug, Clone, PartialEq)]
pub enum Cell {
    /// SQL NULL.
    Null,
    /// Any integer, float or decimal.
    Number(f64),
    /// Anything else, as text (dates as `YYYY-MM-DD`).
    Text(String),
}

/// Relative tolerance for numbers: DataFusion rounds AVG of a decimal to
/// six places, DuckDB returns a double.
const TOLERANCE: f64 = 1e-6;

fn numeric(data_type: &DataType) -> bool {
    data_type.is_numeric()
}

/// Rows of Arrow batches as cells.
pub fn from_batches(batches: &[RecordBatch]) -> Result<Vec<Vec<Cell>>> {
    let mut rows = Vec::new();
    for batch in batches {
        let mut columns: Vec<Vec<Cell>> = Vec::with_capacity(batch.num_columns());
        for column in batch.columns() {
            let cells = if numeric(column.data_type()) {
                let values = cast(column, &DataType::Float64)?;
                let values = values.as_primitive::<Float64Type>();
                (0..values.len())
                    .map(|row| {
                        if values.is_null(row) {
                            Cell::Null
                        } else {
                            Cell::Number(values.value(row))
                        }
                    })
                    .collect()
            } else {
                (0..column.len())
                    .map(|row| {
                        if column.is_null(row) {
                            Ok(Cell::Null)
                        } else {
                            Ok(Cell::Text(array_value_to_string(column, row)?))
                        }
                    })
                    .collect::<Result<Vec<_>>>()?
            };
            columns.push(cells);
        }
        for row in 0..batch.num_rows() {
            rows.push(columns.iter().map(|column| column[row].clone()).collect());
        }
    }
    Ok(rows)
}

/// Rows of a JSON answer (DuckDB's) as cells.
pub fn from_json(rows: &[Vec<Value>]) -> Vec<Vec<Cell>> {
    rows.iter()
        .map(|row| {
            row.iter()
                .map(|value| match value {
                    Value::Null => Cell::Null,
                    Value::Number(number) => Cell::Number(number.as_f64().unwrap_or(f64::NAN)),
                    Value::String(text) => Cell::Text(text.clone()),
                    other => Cell::Text(other.to_string()),
                })
                .collect()
        })
        .collect()
}

fn close(left: &Cell, right: &Cell) -> bool {
    match (left, right) {
        (Cell::Number(a), Cell::Number(b)) => {
            a == b || (a - b).abs() <= TOLERANCE * a.abs().max(b.abs()).max(1.0)
        }
        (Cell::Text(a), Cell::Text(b)) => a == b,
        (Cell::Null, Cell::Null) => true,
        _ => false,
    }
}

fn order(left: &[Cell], right: &[Cell]) -> Ordering {
    for (a, b) in left.iter().zip(right) {
        let ordering = match (a, b) {
            (Cell::Null, Cell::Null) => Ordering::Equal,
            (Cell::Null, _) => Ordering::Less,
            (_, Cell::Null) => Ordering::Greater,
            (Cell::Number(a), Cell::Number(b)) => a.total_cmp(b),
            (Cell::Number(_), Cell::Text(_)) => Ordering::Less,
            (Cell::Text(_), Cell::Number(_)) => Ordering::Greater,
            (Cell::Text(a), Cell::Text(b)) => a.cmp(b),
        };
        if ordering != Ordering::Equal {
            return ordering;
        }
    }
    left.len().cmp(&right.len())
}

fn first_difference(left: &[Vec<Cell>], right: &[Vec<Cell>]) -> Option<String> {
    if left.len() != right.len() {
        return Some(format!("{} rows against {}", left.len(), right.len()));
    }
    for (index, (a, b)) in left.iter().zip(right).enumerate() {
        if a.len() != b.len() || !a.iter().zip(b).all(|(a, b)| close(a, b)) {
            return Some(format!("row {index}: {a:?} against {b:?}"));
        }
    }
    None
}

/// `None` if the two results agree (in order, or else as sorted multisets,
/// since ties under ORDER BY may come in any order), or the first difference.
pub fn disagreement(left: &[Vec<Cell>], right: &[Vec<Cell>]) -> Option<String> {
    first_difference(left, right)?;
    let sorted = |rows: &[Vec<Cell>]| {
        let mut rows = rows.to_vec();
        rows.sort_by(|a, b| order(a, b));
        rows
    };
    first_difference(&sorted(left), &sorted(right))
}

/// An order-independent summary of a result, the same for two engines that
/// agree: row count, a hash of its texts and NULLs, and the sum of its numbers.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Checksum {
    /// Rows.
    pub rows: usize,
    /// Sum over cells of a hash of (column, text or NULL), wrapping.
    pub text_hash: String,
    /// Sum of every number in the result.
    pub number_sum: f64,
}

/// The checksum of `rows`.
pub fn checksum(rows: &[Vec<Cell>]) -> Checksum {
    let mut text_hash = 0u64;
    let mut number_sum = 0.0;
    for row in rows {
        for (column, cell) in row.iter().enumerate() {
            match cell {
                Cell::Number(value) => number_sum += value,
                other => {
                    let mut hasher = std::collections::hash_map::DefaultHasher::new();
                    column.hash(&mut hasher);
                    match other {
                        Cell::Text(text) => text.hash(&mut hasher),
                        _ => 0u8.hash(&mut hasher),
                    }
                    text_hash = text_hash.wrapping_add(hasher.finish());
                }
            }
        }
    }
    Checksum {
        rows: rows.len(),
        text_hash: format!("{text_hash:016x}"),
        number_sum,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{ArrayRef, Date32Array, Decimal128Array, Int64Array, StringArray};
    use std::sync::Arc;

    #[test]
    fn decimals_and_doubles_agree_and_real_differences_do_not() {
        let batch = RecordBatch::try_from_iter([
            (
                "avg",
                Arc::new(
                    Decimal128Array::from(vec![Some(25_522_006), None])
                        .with_precision_and_scale(19, 6)
                        .unwrap(),
                ) as ArrayRef,
            ),
            ("n", Arc::new(Int64Array::from(vec![7, 8])) as ArrayRef),
            (
                "name",
                Arc::new(StringArray::from(vec!["a", "b"])) as ArrayRef,
            ),
            (
                "day",
                Arc::new(Date32Array::from(vec![9204, 0])) as ArrayRef,
            ),
        ])
        .unwrap();
        let sieve = from_batches(&[batch]).unwrap();
        let duck: Vec<Vec<Value>> = serde_json::from_str(
            r#"[[25.522005853257337, 7, "a", "1995-03-15"], [null, 8, "b", "1970-01-01"]]"#,
        )
        .unwrap();
        let duck = from_json(&duck);
        assert_eq!(disagreement(&sieve, &duck), None);
        // Rows in another order (ties under ORDER BY) still agree.
        let reversed: Vec<_> = duck.iter().rev().cloned().collect();
        assert_eq!(disagreement(&sieve, &reversed), None);
        assert_eq!(checksum(&sieve).text_hash, checksum(&duck).text_hash);
        // A number off in its fourth digit, a different text, a lost row: all caught.
        let mut wrong = duck.clone();
        wrong[0][0] = Cell::Number(25.53);
        assert!(disagreement(&sieve, &wrong).is_some());
        let mut wrong = duck.clone();
        wrong[1][2] = Cell::Text("c".into());
        assert!(disagreement(&sieve, &wrong).is_some());
        assert!(disagreement(&sieve, &duck[..1]).is_some());
        let mut wrong = duck;
        wrong[1][0] = Cell::Number(0.0);
        assert!(disagreement(&sieve, &wrong).is_some());
    }
}
