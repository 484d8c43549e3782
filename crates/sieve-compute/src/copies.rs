//! Which slices a scan reads, and from which sorted copy of its table.
//!
//! A table a user owns may keep sorted copies (`CREATE TABLE ... WITH
//! (copy_of = 'table', sort_key = '...')`): the same rows, sorted as a
//! whole by another key, so each copy slice holds one range of it. A
//! scan reads whichever of the table and its current copies keeps the
//! fewest rows once the slices that cannot match are set aside, judged
//! from each slice's min/max summary with DataFusion's
//! [`PruningPredicate`]. It judges twice: at planning, from the query's
//! own predicate, and at run time, once the join filters of the joins
//! above have resolved (their key ranges are what lets a copy sorted by a
//! join key skip).
//!
//! The same estimate leaves out of the scan the slices that cannot match:
//! their requests are never sent.

use std::collections::HashSet;
use std::sync::Arc;

use arrow::array::{new_null_array, ArrayRef, BooleanArray, UInt64Array};
use arrow::datatypes::{DataType, SchemaRef};
use datafusion::common::{Column, ScalarValue};
use datafusion::physical_expr::PhysicalExpr;
use datafusion_pruning::{PruningPredicate, PruningPredicateBuilder, PruningStatistics};

use crate::ClusterTable;

/// A sorted copy a scan may read instead of its table.
#[derive(Debug, Clone)]
pub struct TableCopy {
    /// The copy's SQL name.
    pub name: String,
    /// The columns it is sorted by.
    pub sort_key: Vec<String>,
    /// Its slices at the version read.
    pub table: Arc<ClusterTable>,
}

/// What a scan reads: its table (`copy` none) or one of its copies, and
/// the slices of it that may hold matching rows.
#[derive(Debug, Clone)]
pub struct Reading {
    /// The copy read, if not the table itself.
    pub copy: Option<TableCopy>,
    /// The table or copy, with only the slices that may match.
    pub table: Arc<ClusterTable>,
    /// Rows (deleted ones left out) of those slices.
    pub rows: u64,
    /// Rows of the table as a whole.
    pub rows_all: u64,
}

impl Reading {
    /// For EXPLAIN: what is read, and how much of it.
    pub fn describe(&self, slices_all: usize) -> String {
        let what = match &self.copy {
            Some(copy) => format!(
                "copy {} (sorted by {})",
                copy.name,
                copy.sort_key.join(", ")
            ),
            None => "the table".to_string(),
        };
        format!(
            "reads {what}: {} of {slices_all} slices, {} of {} rows",
            self.table.slices.len(),
            self.rows,
            self.rows_all
        )
    }
}

/// Of `table` and `copies`, the one whose slices that may satisfy
/// `predicate` (over the table schema) hold the fewest rows, with only
/// those slices if `prune` (else with all); the table itself on a tie.
pub fn choose(
    table: &Arc<ClusterTable>,
    copies: &[TableCopy],
    predicate: Option<&Arc<dyn PhysicalExpr>>,
    prune: bool,
) -> Reading {
    let mut best = kept(table, None, predicate);
    for copy in copies {
        let candidate = kept(&copy.table, Some(copy), predicate);
        if candidate.rows < best.rows {
            best = candidate;
        }
    }
    if !prune {
        best.table = match &best.copy {
            Some(copy) => Arc::clone(&copy.table),
            None => Arc::clone(table),
        };
        best.rows = best.rows_all;
    }
    best
}

/// `table` with only the slices that may hold rows satisfying `predicate`.
fn kept(
    table: &Arc<ClusterTable>,
    copy: Option<&TableCopy>,
    predicate: Option<&Arc<dyn PhysicalExpr>>,
) -> Reading {
    let live = |slice: &crate::ClusterSlice| {
        let deleted = slice.deleted.as_ref().map_or(0, |(_, rows)| *rows);
        slice.summary.rows.saturating_sub(deleted)
    };
    let rows_all = table.slices.iter().map(live).sum();
    let keep = predicate
        .and_then(|predicate| slices_kept(table, predicate))
        .filter(|keep| keep.len() == table.slices.len());
    let table = match keep {
        Some(keep) if keep.iter().any(|kept| !kept) => {
            let mut pruned = table.as_ref().clone();
            pruned.slices = table
                .slices
                .iter()
                .zip(keep)
                .filter(|(_, kept)| *kept)
                .map(|(slice, _)| slice.clone())
                .collect();
            Arc::new(pruned)
        }
        _ => Arc::clone(table),
    };
    Reading {
        copy: copy.cloned(),
        rows: table.slices.iter().map(live).sum(),
        rows_all,
        table,
    }
}

/// Per slice of `table`, whether it may hold a row satisfying `predicate`;
/// `None` if the predicate cannot be judged from statistics.
fn slices_kept(table: &ClusterTable, predicate: &Arc<dyn PhysicalExpr>) -> Option<Vec<bool>> {
    // NaN is in no float statistics: conjuncts over floats do not prune.
    let prunable = sieve_fragment::pruning_predicate(predicate, &table.schema)?;
    let pruning: PruningPredicate = PruningPredicateBuilder::new()
        .with_file_schema(Arc::clone(&table.schema))
        .try_build(prunable)
        .ok()?;
    if pruning.always_true() {
        return None;
    }
    pruning.prune(&SliceStatistics::new(table)).ok()
}

/// The slices' summaries as DataFusion's pruning reads them: one
/// container per slice.
struct SliceStatistics<'a> {
    table: &'a ClusterTable,
    schema: SchemaRef,
}

impl<'a> SliceStatistics<'a> {
    fn new(table: &'a ClusterTable) -> Self {
        Self {
            table,
            schema: Arc::clone(&table.schema),
        }
    }

    /// The slices' min (or max) of `column`, NULL where unknown. Only
    /// types whose summary text reads back exactly as the value.
    fn bounds(&self, column: &Column, max: bool) -> Option<ArrayRef> {
        let index = self.schema.index_of(&column.name).ok()?;
        let data_type = self.schema.field(index).data_type();
        if !bounds_read_back(data_type) {
            return None;
        }
        let values: Vec<ScalarValue> = self
            .table
            .slices
            .iter()
            .map(|slice| {
                let summary = slice.summary.columns.get(index);
                let text = summary.and_then(|summary| {
                    if max {
                        summary.max.clone()
                    } else {
                        summary.min.clone()
                    }
                });
                text.and_then(|text| ScalarValue::try_from_string(text, data_type).ok())
                    .unwrap_or(ScalarValue::try_from(data_type).unwrap_or(ScalarValue::Null))
            })
            .collect();
        if values.is_empty() {
            return Some(new_null_array(data_type, 0));
        }
        ScalarValue::iter_to_array(values).ok()
    }
}

/// Types whose slice summary's min and max (Arrow's display of the value)
/// parse back to the same value.
fn bounds_read_back(data_type: &DataType) -> bool {
    data_type.is_integer()
        || matches!(
            data_type,
            DataType::Decimal128(_, _)
                | DataType::Decimal256(_, _)
                | DataType::Date32
                | DataType::Utf8
                | DataType::LargeUtf8
                | DataType::Utf8View
        )
}

impl PruningStatistics for SliceStatistics<'_> {
    fn min_values(&self, column: &Column) -> Option<ArrayRef> {
        self.bounds(column, false)
    }

    fn max_values(&self, column: &Column) -> Option<ArrayRef> {
        self.bounds(column, true)
    }

    fn num_containers(&self) -> usize {
        self.table.slices.len()
    }

    fn null_counts(&self, column: &Column) -> Option<ArrayRef> {
        let index = self.schema.index_of(&column.name).ok()?;
        Some(Arc::new(UInt64Array::from_iter(
            self.table.slices.iter().map(|slice| {
                slice
                    .summary
                    .columns
                    .get(index)
                    .and_then(|summary| summary.null_count)
            }),
        )))
    }

    fn row_counts(&self) -> Option<ArrayRef> {
        Some(Arc::new(UInt64Array::from_iter_values(
            self.table.slices.iter().map(|slice| slice.summary.rows),
        )))
    }

    #[allow(clippy::mutable_key_type)] // DataFusion's signature
    fn contained(&self, _: &Column, _: &HashSet<ScalarValue>) -> Option<BooleanArray> {
        None
    }
}
