//! View columns (`Utf8View`, `BinaryView`) that point into buffers larger
//! than the strings they use. A view array read from Parquet points into
//! whole decoded pages, and one a join or a filter produced with `take`
//! into every batch its rows came from; holding such a batch holds all of
//! those buffers, memory accounting counts them once per batch, and Arrow
//! IPC (the wire, spill files) writes all of them.

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray};
use arrow::datatypes::DataType;
use arrow::error::ArrowError;
use arrow::record_batch::{RecordBatch, RecordBatchOptions};

/// `batch` with each view column whose buffers hold more than `waste_max`
/// times the bytes its strings use copied into buffers of its own
/// (`gc`); other columns, and batches without views, as they are.
pub fn compact_views(batch: RecordBatch, waste_max: f64) -> Result<RecordBatch, ArrowError> {
    let sparse = |column: &ArrayRef| -> bool {
        let (held, used) = match column.data_type() {
            DataType::Utf8View => {
                let views = column.as_string_view();
                (
                    buffer_bytes(views.data_buffers()),
                    views.total_buffer_bytes_used(),
                )
            }
            DataType::BinaryView => {
                let views = column.as_binary_view();
                (
                    buffer_bytes(views.data_buffers()),
                    views.total_buffer_bytes_used(),
                )
            }
            _ => return false,
        };
        held > 0 && held as f64 > used as f64 * waste_max
    };
    if !batch.columns().iter().any(sparse) {
        return Ok(batch);
    }
    let columns: Vec<ArrayRef> = batch
        .columns()
        .iter()
        .map(|column| match column.data_type() {
            DataType::Utf8View if sparse(column) => {
                Arc::new(column.as_string_view().gc()) as ArrayRef
            }
            DataType::BinaryView if sparse(column) => {
                Arc::new(column.as_binary_view().gc()) as ArrayRef
            }
            _ => Arc::clone(column),
        })
        .collect();
    let options = RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
    RecordBatch::try_new_with_options(batch.schema(), columns, &options)
}

fn buffer_bytes(buffers: &[arrow::buffer::Buffer]) -> usize {
    buffers.iter().map(|buffer| buffer.capacity()).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringViewArray, UInt32Array};
    use arrow::compute::take_record_batch;
    use arrow::datatypes::{Field, Schema};

    fn batch(rows: usize) -> RecordBatch {
        let names = StringViewArray::from_iter_values(
            (0..rows).map(|row| format!("a name long enough not to be inlined {row}")),
        );
        RecordBatch::try_new(
            Arc::new(Schema::new(vec![
                Field::new("k", DataType::Int64, false),
                Field::new("name", DataType::Utf8View, false),
            ])),
            vec![
                Arc::new(Int64Array::from_iter_values(0..rows as i64)),
                Arc::new(names),
            ],
        )
        .unwrap()
    }

    fn held(batch: &RecordBatch) -> usize {
        buffer_bytes(batch.column(1).as_string_view().data_buffers())
    }

    #[test]
    fn a_few_rows_taken_from_a_large_batch_keep_only_their_strings() {
        let large = batch(10_000);
        let few = take_record_batch(&large, &UInt32Array::from(vec![3, 500, 9_999])).unwrap();
        assert_eq!(held(&few), held(&large), "take shares the buffers");
        let compacted = compact_views(few.clone(), 2.0).unwrap();
        assert!(held(&compacted) < 200, "{} bytes held", held(&compacted));
        assert_eq!(compacted, few, "the same values");
        // A batch that uses its buffers is left as it is.
        let whole = compact_views(large.clone(), 2.0).unwrap();
        assert!(Arc::ptr_eq(whole.column(1), large.column(1)));
        // No views: as it is.
        let ints = RecordBatch::try_new(
            Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)])),
            vec![Arc::new(Int64Array::from(vec![1, 2]))],
        )
        .unwrap();
        assert_eq!(compact_views(ints.clone(), 1.0).unwrap(), ints);
    }
}
