//! Deleted rows of a slice: a roaring bitmap of row positions in the file,
//! as the table catalog records it for one version. Every reader of a slice
//! (the storage node's fragment, the compute node completing a raw slice,
//! the NDP-off Parquet scan) folds it into its Parquet access plan: a row
//! group whose rows are all deleted is skipped without being read, and
//! within a row group only the rows left are selected, so pages holding no
//! live row are not decoded either (the page index says where they are).

use std::ops::Range;

use datafusion::common::{plan_err, Result};
use datafusion::datasource::physical_plan::parquet::ParquetAccessPlan;
use datafusion::parquet::arrow::arrow_reader::RowSelection;
use roaring::RoaringBitmap;

/// The largest serialized deletion vector a request may carry.
pub const DELETION_VECTOR_BYTES_MAX: usize = 64 * 1024 * 1024;

/// A deletion vector read from its serialized form (bounded).
pub fn decode_deletions(bytes: &[u8]) -> Result<RoaringBitmap> {
    if bytes.len() > DELETION_VECTOR_BYTES_MAX {
        return plan_err!(
            "a deletion vector of {} bytes is over the limit of {DELETION_VECTOR_BYTES_MAX}",
            bytes.len()
        );
    }
    RoaringBitmap::deserialize_from(bytes)
        .or_else(|_| plan_err!("a deletion vector that does not decode"))
}

/// `bitmap` serialized, as the catalog and the envelope carry it.
pub fn encode_deletions(bitmap: &RoaringBitmap) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(bitmap.serialized_size());
    bitmap
        .serialize_into(&mut bytes)
        .expect("writing to a Vec cannot fail");
    bytes
}

/// `plan` without the rows `deleted` names, for a file whose row groups
/// have `row_group_rows` rows each. A row group left with no row is
/// skipped.
pub fn apply_deletions(
    mut plan: ParquetAccessPlan,
    row_group_rows: &[u64],
    deleted: &RoaringBitmap,
) -> ParquetAccessPlan {
    let mut start = 0u64;
    for (group, &rows) in row_group_rows.iter().enumerate() {
        let end = start + rows;
        let range =
            start.min(u64::from(u32::MAX) + 1) as u32..end.min(u64::from(u32::MAX) + 1) as u32;
        let gone = deleted.range_cardinality(range.clone());
        if group < plan.len() && gone > 0 {
            if gone >= rows {
                plan.skip(group);
            } else {
                plan.scan_selection(group, kept_rows(deleted, range, rows as usize));
            }
        }
        start = end;
    }
    plan
}

/// The rows of a row group (file positions `range`, `rows` of them) that
/// `deleted` does not name, as a selection within the row group.
fn kept_rows(deleted: &RoaringBitmap, range: Range<u32>, rows: usize) -> RowSelection {
    let mut kept: Vec<Range<usize>> = Vec::new();
    let mut next = 0usize;
    for position in deleted.range(range.clone()) {
        let offset = (position - range.start) as usize;
        if offset > next {
            kept.push(next..offset);
        }
        next = offset + 1;
    }
    if next < rows {
        kept.push(next..rows);
    }
    RowSelection::from_consecutive_ranges(kept.into_iter(), rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::datasource::physical_plan::parquet::RowGroupAccess;

    #[test]
    fn deleted_rows_leave_the_plan_and_empty_row_groups_are_skipped() {
        let mut deleted = RoaringBitmap::new();
        deleted.insert_range(0..10); // all of row group 0
        deleted.insert(12); // one row of group 1
        deleted.insert(19);
        let deleted = decode_deletions(&encode_deletions(&deleted)).unwrap();
        let plan = apply_deletions(ParquetAccessPlan::new_all(3), &[10, 10, 10], &deleted);
        assert!(matches!(plan.inner()[0], RowGroupAccess::Skip));
        match &plan.inner()[1] {
            RowGroupAccess::Selection(selection) => {
                assert_eq!(selection.row_count(), 8);
                let kept: Vec<usize> = selection
                    .iter()
                    .scan(0, |at, selector| {
                        let from = *at;
                        *at += selector.row_count;
                        Some((!selector.skip).then_some(from..*at))
                    })
                    .flatten()
                    .flatten()
                    .collect();
                assert_eq!(kept, vec![0, 1, 3, 4, 5, 6, 7, 8]);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(plan.inner()[2], RowGroupAccess::Scan));
        assert!(decode_deletions(&[1, 2, 3]).is_err());
    }
}
