//! `BloomFilterExpr`: "the key is probably in the build side of a join".
//!
//! A join's build side can hold far more keys than an IN list should carry.
//! This expression carries them as a split-block Bloom filter (the same
//! `Sbbf` Parquet uses) and evaluates to `true` for a key that may be in the
//! set and `false` for a key that certainly is not; NULL stays NULL. It only
//! ever removes rows a join would drop anyway, so a false positive costs a
//! shipped row, never a wrong answer.
//!
//! Keys are hashed through Arrow's row format, which encodes every type, and
//! the build keys are cast to the probe column's type first, so both sides
//! hash the same bytes for the same value. The expression has a codec of its
//! own ([`crate::SieveCodec`]), so it survives serialisation into a fragment.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, BooleanArray};
use arrow::buffer::BooleanBuffer;
use arrow::compute::cast;
use arrow::datatypes::{DataType, Date32Type, Date64Type, Int32Type, Int64Type, Schema};
use arrow::record_batch::RecordBatch;
use arrow::row::{RowConverter, SortField};
use datafusion::common::{internal_err, plan_err, DataFusionError, Result, ScalarValue};
use datafusion::logical_expr::ColumnarValue;
use datafusion::physical_expr::PhysicalExpr;
use parquet::bloom_filter::Sbbf;

/// Upper bound on the bytes of one Bloom filter in a fragment; the fragment
/// as a whole is also bounded by [`crate::FRAGMENT_BYTES_MAX`].
pub const BLOOM_FILTER_BYTES_MAX: usize = 2 * 1024 * 1024;

/// `input` may be one of the keys the filter was built from.
#[derive(Clone)]
pub struct BloomFilterExpr {
    input: Arc<dyn PhysicalExpr>,
    data_type: DataType,
    filter: Arc<Sbbf>,
    /// The filter's bitset, as sent on the wire (kept for encoding and equality).
    bitset: Arc<Vec<u8>>,
    keys: u64,
    fpp: f64,
}

impl BloomFilterExpr {
    /// A filter over `keys` (any Arrow type castable to `data_type`, the type
    /// of `input`), sized for a false-positive probability of `fpp`.
    pub fn try_new(
        input: Arc<dyn PhysicalExpr>,
        data_type: DataType,
        keys: &ArrayRef,
        fpp: f64,
    ) -> Result<Self> {
        if !(fpp > 0.0 && fpp < 1.0) {
            return plan_err!("Bloom filter false-positive rate must be in (0, 1), got {fpp}");
        }
        let keys = cast(keys, &data_type)?;
        let distinct = keys.len().max(1) as u64;
        let mut filter = Sbbf::new_with_ndv_fpp(distinct, fpp)
            .map_err(|error| DataFusionError::External(Box::new(error)))?;
        let converter = RowConverter::new(vec![SortField::new(data_type.clone())])?;
        let rows = converter.convert_columns(&[keys])?;
        for row in rows.iter() {
            filter.insert(row.as_ref());
        }
        let mut bitset = Vec::new();
        filter
            .write_bitset(&mut bitset)
            .map_err(|error| DataFusionError::External(Box::new(error)))?;
        if bitset.len() > BLOOM_FILTER_BYTES_MAX {
            return plan_err!(
                "Bloom filter of {distinct} keys at fpp {fpp} needs {} bytes, above {BLOOM_FILTER_BYTES_MAX}",
                bitset.len()
            );
        }
        Ok(Self {
            input,
            data_type,
            filter: Arc::new(filter),
            bitset: Arc::new(bitset),
            keys: distinct,
            fpp,
        })
    }

    /// Rebuild a filter received on the wire.
    pub fn from_bitset(
        input: Arc<dyn PhysicalExpr>,
        data_type: DataType,
        bitset: Vec<u8>,
        keys: u64,
        fpp: f64,
    ) -> Result<Self> {
        // Sbbf blocks are 32 bytes; Parquet bounds a filter at 128 MiB, we at far less.
        if bitset.is_empty()
            || !bitset.len().is_multiple_of(32)
            || bitset.len() > BLOOM_FILTER_BYTES_MAX
        {
            return plan_err!(
                "Bloom filter bitset of {} bytes is not a whole number of 32-byte blocks up to {BLOOM_FILTER_BYTES_MAX}",
                bitset.len()
            );
        }
        Ok(Self {
            input,
            data_type,
            filter: Arc::new(Sbbf::new(&bitset)),
            bitset: Arc::new(bitset),
            keys,
            fpp,
        })
    }

    /// The expression whose value is looked up (a column, in practice).
    pub fn input(&self) -> &Arc<dyn PhysicalExpr> {
        &self.input
    }

    /// The filter's bitset.
    pub fn bitset(&self) -> &[u8] {
        &self.bitset
    }

    /// Number of keys the filter was built from.
    pub fn keys(&self) -> u64 {
        self.keys
    }

    /// The false-positive rate the filter was sized for.
    pub fn fpp(&self) -> f64 {
        self.fpp
    }

    /// The type the keys were hashed as.
    pub fn key_type(&self) -> &DataType {
        &self.data_type
    }

    fn probe(&self, values: &ArrayRef) -> Result<BooleanArray> {
        let values = if values.data_type() == &self.data_type {
            Arc::clone(values)
        } else {
            cast(values, &self.data_type)?
        };
        // Integer keys: their row encoding (a valid byte, then big-endian
        // with the sign bit flipped) is written in place, without a row
        // converter's allocations.
        let matched = match values.data_type() {
            DataType::Int32 | DataType::Date32 => {
                let native: &[i32] = match values.data_type() {
                    DataType::Int32 => values.as_primitive::<Int32Type>().values(),
                    _ => values.as_primitive::<Date32Type>().values(),
                };
                BooleanBuffer::collect_bool(values.len(), |index| {
                    let mut encoded = [1u8; 5];
                    encoded[1..].copy_from_slice(&(native[index] as u32 ^ (1 << 31)).to_be_bytes());
                    self.filter.check(&encoded[..])
                })
            }
            DataType::Int64 | DataType::Date64 => {
                let native: &[i64] = match values.data_type() {
                    DataType::Int64 => values.as_primitive::<Int64Type>().values(),
                    _ => values.as_primitive::<Date64Type>().values(),
                };
                BooleanBuffer::collect_bool(values.len(), |index| {
                    let mut encoded = [1u8; 9];
                    encoded[1..].copy_from_slice(&(native[index] as u64 ^ (1 << 63)).to_be_bytes());
                    self.filter.check(&encoded[..])
                })
            }
            _ => {
                let converter = RowConverter::new(vec![SortField::new(self.data_type.clone())])?;
                let rows = converter.convert_columns(std::slice::from_ref(&values))?;
                BooleanBuffer::collect_bool(values.len(), |index| {
                    self.filter.check(rows.row(index).as_ref())
                })
            }
        };
        Ok(BooleanArray::new(matched, values.logical_nulls()))
    }
}

impl fmt::Debug for BloomFilterExpr {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("BloomFilterExpr")
            .field("input", &self.input)
            .field("keys", &self.keys)
            .field("fpp", &self.fpp)
            .field("bytes", &self.bitset.len())
            .finish()
    }
}

impl fmt::Display for BloomFilterExpr {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "{} IN bloom({} keys, fpp {}, {} bytes)",
            self.input,
            self.keys,
            self.fpp,
            self.bitset.len()
        )
    }
}

impl PartialEq for BloomFilterExpr {
    fn eq(&self, other: &Self) -> bool {
        self.input.as_ref() == other.input.as_ref()
            && self.data_type == other.data_type
            && self.bitset == other.bitset
            && self.keys == other.keys
            && self.fpp.to_bits() == other.fpp.to_bits()
    }
}

impl Eq for BloomFilterExpr {}

impl Hash for BloomFilterExpr {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.input.hash(state);
        self.bitset.hash(state);
        self.keys.hash(state);
    }
}

impl PhysicalExpr for BloomFilterExpr {
    fn data_type(&self, _input_schema: &Schema) -> Result<DataType> {
        Ok(DataType::Boolean)
    }

    fn nullable(&self, input_schema: &Schema) -> Result<bool> {
        self.input.nullable(input_schema)
    }

    fn evaluate(&self, batch: &RecordBatch) -> Result<ColumnarValue> {
        match self.input.evaluate(batch)? {
            ColumnarValue::Array(values) => {
                Ok(ColumnarValue::Array(Arc::new(self.probe(&values)?)))
            }
            ColumnarValue::Scalar(scalar) => {
                let matched = self.probe(&scalar.to_array()?)?;
                Ok(ColumnarValue::Scalar(ScalarValue::try_from_array(
                    &matched, 0,
                )?))
            }
        }
    }

    fn children(&self) -> Vec<&Arc<dyn PhysicalExpr>> {
        vec![&self.input]
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn PhysicalExpr>>,
    ) -> Result<Arc<dyn PhysicalExpr>> {
        let [input] = <[Arc<dyn PhysicalExpr>; 1]>::try_from(children).or_else(|children| {
            internal_err!("BloomFilterExpr has one child, got {}", children.len())
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
    use arrow::array::{Date32Array, Int32Array, Int64Array, StringArray};
    use datafusion::physical_expr::expressions::Column;

    /// The in-place integer encoding must hash exactly what the row format
    /// does (the build side inserts through the row format).
    #[test]
    fn integer_fast_path_agrees_with_the_row_format() {
        let cases: Vec<(DataType, ArrayRef, ArrayRef)> = vec![
            (
                DataType::Int64,
                Arc::new(Int64Array::from(vec![-5, 0, 7, i64::MAX, i64::MIN])),
                Arc::new(Int64Array::from(vec![
                    Some(-5),
                    None,
                    Some(7),
                    Some(8),
                    Some(i64::MIN),
                ])),
            ),
            (
                DataType::Int32,
                Arc::new(Int32Array::from(vec![-3, 11, 1 << 20])),
                Arc::new(Int32Array::from(vec![
                    Some(-3),
                    Some(12),
                    None,
                    Some(1 << 20),
                ])),
            ),
            (
                DataType::Date32,
                Arc::new(Date32Array::from(vec![9000, 9500])),
                Arc::new(Date32Array::from(vec![Some(9000), Some(9001), Some(9500)])),
            ),
            (
                DataType::Utf8,
                Arc::new(StringArray::from(vec!["a", "bc"])),
                Arc::new(StringArray::from(vec![
                    Some("a"),
                    Some("zz"),
                    None,
                    Some("bc"),
                ])),
            ),
        ];
        for (data_type, keys, probe) in cases {
            let bloom = BloomFilterExpr::try_new(
                Arc::new(Column::new("k", 0)),
                data_type.clone(),
                &keys,
                0.0001,
            )
            .unwrap();
            let matched = bloom.probe(&probe).unwrap();
            let converter = RowConverter::new(vec![SortField::new(data_type.clone())]).unwrap();
            let rows = converter
                .convert_columns(std::slice::from_ref(&probe))
                .unwrap();
            for index in 0..probe.len() {
                let expected = probe
                    .is_valid(index)
                    .then(|| bloom.filter.check(rows.row(index).as_ref()));
                let actual = matched.is_valid(index).then(|| matched.value(index));
                assert_eq!(actual, expected, "{data_type} row {index}");
            }
            // Every key is found (no false negatives).
            let all = bloom.probe(&keys).unwrap();
            assert!(all.iter().all(|found| found == Some(true)), "{data_type}");
        }
    }
}
