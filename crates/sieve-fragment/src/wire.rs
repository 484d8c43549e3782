//! Narrow types on the wire: a storage node ships a column in a narrower
//! Arrow type than the compute node plans with when no value can be lost,
//! and the compute node widens it back before anything else sees it.
//!
//! - `Decimal128(p, s)` with `p <= 18` travels as `Decimal64(p, s)`: every
//!   value of that precision fits in 64 bits (TPC-H prices: half the bytes);
//! - `Int64` travels as `Int32` when the slice's Parquet statistics say every
//!   value of the column fits (surrogate keys: half the bytes).
//!
//! This costs one vectorised cast on each side, far less than compressing
//! the same bytes away, so on a link where bytes are cheap (loopback) the
//! node can ship uncompressed and still move about half of what plain Arrow
//! would. A stream's types are fixed by its schema message, so the choice
//! is made once per slice, before the first batch.

use std::sync::Arc;

use arrow::array::{ArrayRef, AsArray, Decimal64Array};
use arrow::compute::{cast_with_options, CastOptions};
use arrow::datatypes::{DataType, Decimal128Type, Field, Schema, SchemaRef};
use arrow::error::ArrowError;
use arrow::record_batch::{RecordBatch, RecordBatchOptions};
use datafusion::common::{exec_err, Result};

/// Largest decimal precision whose every value fits in a `Decimal64`.
const DECIMAL64_PRECISION_MAX: u8 = 18;

/// The wire type of a column of type `data_type`, given whether its values
/// are known to fit in 32 bits (for `Int64`).
pub fn wire_type(data_type: &DataType, fits_in_32_bits: bool) -> DataType {
    match data_type {
        DataType::Decimal128(precision, scale) if *precision <= DECIMAL64_PRECISION_MAX => {
            DataType::Decimal64(*precision, *scale)
        }
        DataType::Int64 if fits_in_32_bits => DataType::Int32,
        other => other.clone(),
    }
}

/// Whether `wire` is a narrowing of `planned` that [`widen`] undoes.
fn is_narrowing(wire: &DataType, planned: &DataType) -> bool {
    match (wire, planned) {
        (DataType::Int32, DataType::Int64) => true,
        (
            DataType::Decimal64(wire_precision, wire_scale),
            DataType::Decimal128(precision, scale),
        ) => wire_precision == precision && wire_scale == scale,
        _ => false,
    }
}

/// `schema` with each field's type replaced by its wire type; `fits[i]`
/// says whether column `i`'s values fit in 32 bits.
pub fn wire_schema(schema: &SchemaRef, fits: &[bool]) -> SchemaRef {
    let fields: Vec<Field> = schema
        .fields()
        .iter()
        .enumerate()
        .map(|(index, field)| {
            let fits = fits.get(index).copied().unwrap_or(false);
            field
                .as_ref()
                .clone()
                .with_data_type(wire_type(field.data_type(), fits))
        })
        .collect();
    Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()))
}

fn exact() -> CastOptions<'static> {
    // An overflow is an error, never a NULL.
    CastOptions {
        safe: false,
        ..CastOptions::default()
    }
}

fn recast(batch: &RecordBatch, schema: &SchemaRef) -> Result<RecordBatch> {
    let columns: Vec<ArrayRef> = batch
        .columns()
        .iter()
        .zip(schema.fields())
        .map(|(column, field)| {
            match (column.data_type(), field.data_type()) {
                (from, to) if from == to => Ok(Arc::clone(column)),
                // Arrow's own cast takes every value to respect its declared
                // precision and unwraps (panics) where one does not, which
                // computed decimals need not: convert value by value.
                (DataType::Decimal128(..), DataType::Decimal64(precision, scale)) => {
                    let narrowed: Decimal64Array =
                        column.as_primitive::<Decimal128Type>().try_unary(|value| {
                            i64::try_from(value).map_err(|_| {
                                ArrowError::CastError(format!(
                                    "decimal value {value} of column {} does not fit its \
                                     declared precision {precision}",
                                    field.name()
                                ))
                            })
                        })?;
                    Ok(
                        Arc::new(narrowed.with_precision_and_scale(*precision, *scale)?)
                            as ArrayRef,
                    )
                }
                _ => Ok(cast_with_options(column, field.data_type(), &exact())?),
            }
        })
        .collect::<Result<_>>()?;
    let options = RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
    Ok(RecordBatch::try_new_with_options(
        Arc::clone(schema),
        columns,
        &options,
    )?)
}

/// `batch` in the wire types of `wire` (from [`wire_schema`]). A value that
/// does not fit is an error, so statistics that lied cannot lose data.
pub fn narrow(batch: &RecordBatch, wire: &SchemaRef) -> Result<RecordBatch> {
    if batch.schema_ref() == wire {
        return Ok(batch.clone());
    }
    recast(batch, wire)
}

/// `batch` as received, in the types the compute node planned with
/// (`planned`): narrowed columns are widened back; any other difference is
/// an error naming the column.
pub fn widen(batch: RecordBatch, planned: &SchemaRef) -> Result<RecordBatch> {
    let same_types = batch.num_columns() == planned.fields().len()
        && batch
            .columns()
            .iter()
            .zip(planned.fields())
            .all(|(column, field)| column.data_type() == field.data_type());
    if same_types {
        return Ok(batch);
    }
    if batch.num_columns() != planned.fields().len() {
        return exec_err!(
            "a storage node shipped {} columns where {} were planned",
            batch.num_columns(),
            planned.fields().len()
        );
    }
    for (column, field) in batch.columns().iter().zip(planned.fields()) {
        if column.data_type() != field.data_type()
            && !is_narrowing(column.data_type(), field.data_type())
        {
            return exec_err!(
                "a storage node shipped column {} as {}, planned as {}",
                field.name(),
                column.data_type(),
                field.data_type()
            );
        }
    }
    recast(&batch, planned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Array, Decimal128Array, Int64Array, StringArray};

    /// A computed decimal beyond its declared precision (DataFusion does not
    /// enforce it) is an error when narrowed, never a panic (fuzzer seed 1,
    /// schema 15, query 183: Arrow's cast unwrapped it on a storage node).
    #[test]
    fn a_decimal_beyond_its_precision_is_an_error_not_a_panic() {
        let schema = Arc::new(Schema::new(vec![Field::new(
            "d",
            DataType::Decimal128(9, 2),
            true,
        )]));
        let values = Decimal128Array::from(vec![Some(5), None, Some(10i128.pow(30))])
            .with_precision_and_scale(9, 2)
            .unwrap();
        let batch = RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(values)]).unwrap();
        let wire = wire_schema(&schema, &[false]);
        let error = narrow(&batch, &wire).unwrap_err().to_string();
        assert!(
            error.contains("does not fit its declared precision"),
            "{error}"
        );
        let fitting = batch.slice(0, 2);
        let narrowed = narrow(&fitting, &wire).unwrap();
        assert_eq!(narrowed.column(0).data_type(), &DataType::Decimal64(9, 2));
        assert_eq!(widen(narrowed, &schema).unwrap(), fitting);
    }

    fn batch() -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("key", DataType::Int64, true),
            Field::new("price", DataType::Decimal128(15, 2), true),
            Field::new("sum", DataType::Decimal128(25, 2), false),
            Field::new("name", DataType::Utf8, false),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from(vec![Some(1), None, Some(i32::MAX as i64)])),
                Arc::new(
                    Decimal128Array::from(vec![Some(999_999_999_999_999), None, Some(-5)])
                        .with_precision_and_scale(15, 2)
                        .unwrap(),
                ),
                Arc::new(
                    Decimal128Array::from(vec![i128::MAX / 2, 0, 1])
                        .with_precision_and_scale(25, 2)
                        .unwrap(),
                ),
                Arc::new(StringArray::from(vec!["a", "b", "c"])),
            ],
        )
        .unwrap()
    }

    /// Narrow, then widen: the same batch, with half-width keys and prices
    /// on the wire; wide decimals and strings untouched.
    #[test]
    fn narrowed_columns_come_back_unchanged() {
        let batch = batch();
        let wire = wire_schema(batch.schema_ref(), &[true, false, false, false]);
        let types: Vec<&DataType> = wire.fields().iter().map(|f| f.data_type()).collect();
        assert_eq!(
            types,
            [
                &DataType::Int32,
                &DataType::Decimal64(15, 2),
                &DataType::Decimal128(25, 2),
                &DataType::Utf8
            ]
        );
        let narrowed = narrow(&batch, &wire).unwrap();
        let value_bytes = |batch: &RecordBatch, column: usize| -> usize {
            batch.column(column).to_data().buffers()[0].len()
        };
        assert_eq!(value_bytes(&narrowed, 0) * 2, value_bytes(&batch, 0));
        assert_eq!(value_bytes(&narrowed, 1) * 2, value_bytes(&batch, 1));
        let widened = widen(narrowed, batch.schema_ref()).unwrap();
        assert_eq!(widened, batch);
        assert!(widened.column(0).is_null(1));
    }

    /// A value statistics said would fit but does not is an error, not a
    /// NULL; a shipped type that is not a narrowing is refused by name.
    #[test]
    fn a_value_that_does_not_fit_and_an_unknown_type_are_errors() {
        let schema = Arc::new(Schema::new(vec![Field::new("key", DataType::Int64, false)]));
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![Arc::new(Int64Array::from(vec![1, i64::from(i32::MAX) + 1]))],
        )
        .unwrap();
        let wire = wire_schema(&schema, &[true]);
        assert!(narrow(&batch, &wire).is_err());

        let strings = Arc::new(Schema::new(vec![Field::new("key", DataType::Utf8, false)]));
        let shipped =
            RecordBatch::try_new(strings, vec![Arc::new(StringArray::from(vec!["1"]))]).unwrap();
        let error = widen(shipped, &schema).unwrap_err().to_string();
        assert!(error.contains("shipped column key as Utf8"), "{error}");
    }
}
