//! `BloomFilterExpr`: "the key is probably in the build side of a join".
//!
//! A join's build side can hold far more keys than an IN list should carry.
//! This expression carries them as a split-block Bloom filter (the layout
//! Parquet's `Sbbf` uses: 32-byte blocks of eight words, one bit set per
//! word, so a probe touches one cache line) and evaluates to `true` for a key
//! that may be in the
//! set and `false` for a key that certainly is not; NULL stays NULL. It only
//! ever removes rows a join would drop anyway, so a false positive costs a
//! shipped row, never a wrong answer.
//!
//! The build keys are cast to the probe column's type first, so both sides
//! hash the same value the same way: integers (and dates) by a 64-bit mixer
//! of their value, a few nanoseconds per row; every other type through its
//! Arrow row encoding. The expression has a codec of its
//! own ([`crate::SieveCodec`]), so it survives serialisation into a fragment.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use arrow::array::BooleanBufferBuilder;
use arrow::array::{Array, ArrayRef, AsArray, BooleanArray};
use arrow::buffer::BooleanBuffer;
use arrow::compute::cast;
use arrow::datatypes::{
    DataType, Date32Type, Date64Type, Int16Type, Int32Type, Int64Type, Int8Type, Schema,
    UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};
use arrow::record_batch::RecordBatch;
use arrow::row::{RowConverter, SortField};
use datafusion::common::{internal_err, plan_err, Result};
use datafusion::logical_expr::ColumnarValue;
use datafusion::physical_expr::PhysicalExpr;

use crate::unary::evaluate_unary;

/// Upper bound on the bytes of one Bloom filter (16 Mi keys at a 1%
/// false-positive rate take about 20 MB); a Bloom filter travels in a join
/// filter registration, bounded by [`crate::JOIN_FILTER_BYTES_MAX`].
pub const BLOOM_FILTER_BYTES_MAX: usize = 32 * 1024 * 1024;

/// `$body` with `$keys` bound to the values buffer of an integer or date
/// array (whatever its width), `$other` for any other type: the one place
/// that says which types hash by value.
macro_rules! with_integer_keys {
    ($values:expr, $keys:ident => $body:block, else $other:block) => {
        match $values.data_type() {
            DataType::Int8 => {
                let $keys = $values.as_primitive::<Int8Type>().values();
                $body
            }
            DataType::Int16 => {
                let $keys = $values.as_primitive::<Int16Type>().values();
                $body
            }
            DataType::Int32 => {
                let $keys = $values.as_primitive::<Int32Type>().values();
                $body
            }
            DataType::Int64 => {
                let $keys = $values.as_primitive::<Int64Type>().values();
                $body
            }
            DataType::UInt8 => {
                let $keys = $values.as_primitive::<UInt8Type>().values();
                $body
            }
            DataType::UInt16 => {
                let $keys = $values.as_primitive::<UInt16Type>().values();
                $body
            }
            DataType::UInt32 => {
                let $keys = $values.as_primitive::<UInt32Type>().values();
                $body
            }
            DataType::UInt64 => {
                let $keys = $values.as_primitive::<UInt64Type>().values();
                $body
            }
            DataType::Date32 => {
                let $keys = $values.as_primitive::<Date32Type>().values();
                $body
            }
            DataType::Date64 => {
                let $keys = $values.as_primitive::<Date64Type>().values();
                $body
            }
            _ => $other,
        }
    };
}

pub(crate) use with_integer_keys;

/// `input` may be one of the keys the filter was built from.
#[derive(Clone)]
pub struct BloomFilterExpr {
    input: Arc<dyn PhysicalExpr>,
    data_type: DataType,
    filter: Arc<SplitBlockBloom>,
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
        let bytes = bytes_for(distinct, fpp);
        if bytes > BLOOM_FILTER_BYTES_MAX {
            return plan_err!(
                "Bloom filter of {distinct} keys at fpp {fpp} needs {bytes} bytes, above {BLOOM_FILTER_BYTES_MAX}"
            );
        }
        let mut filter = SplitBlockBloom::with_bytes(bytes);
        for_each_hash(&keys, |index, hash| {
            if keys.is_valid(index) {
                filter.insert(hash);
            }
        })?;
        let bitset = filter.to_bytes();
        Ok(Self {
            input,
            data_type,
            filter: Arc::new(filter),
            bitset: Arc::new(bitset),
            keys: distinct,
            fpp,
        })
    }

    /// Bytes of a filter for `keys` distinct keys at false-positive rate
    /// `fpp` (a power of two, at least one 32-byte block).
    pub fn bytes_for(keys: u64, fpp: f64) -> usize {
        bytes_for(keys, fpp)
    }

    /// Rebuild a filter received on the wire.
    pub fn from_bitset(
        input: Arc<dyn PhysicalExpr>,
        data_type: DataType,
        bitset: Vec<u8>,
        keys: u64,
        fpp: f64,
    ) -> Result<Self> {
        // Blocks are 32 bytes; the bound keeps a fragment small.
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
            filter: Arc::new(SplitBlockBloom::from_bytes(&bitset)),
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

    // `as i64 as u64` widens every integer type the macro binds; for Int64 it is a no-op.
    #[allow(clippy::unnecessary_cast)]
    fn probe(&self, values: &ArrayRef) -> Result<BooleanArray> {
        let values = if values.data_type() == &self.data_type {
            Arc::clone(values)
        } else {
            cast(values, &self.data_type)?
        };
        let filter = &self.filter;
        // Integers are probed straight from their values buffer, 64 rows
        // per output word; other types through their row encoding.
        let matched = with_integer_keys!(values, keys => {
            BooleanBuffer::collect_bool(keys.len(), |index| {
                filter.check(mix(keys[index] as i64 as u64))
            })
        }, else {
            let mut matched = BooleanBufferBuilder::new(values.len());
            for_each_hash(&values, |_, hash| matched.append(filter.check(hash)))?;
            matched.finish()
        });
        Ok(BooleanArray::new(matched, values.logical_nulls()))
    }
}

/// Bytes of a filter for `keys` distinct keys at false-positive rate `fpp`:
/// the formula of Parquet's split-block filters, rounded up to a power of
/// two, at least one block.
fn bytes_for(keys: u64, fpp: f64) -> usize {
    let bits = -8.0 * keys as f64 / (1.0 - fpp.powf(1.0 / 8.0)).ln();
    let bytes = (bits / 8.0).ceil().max(32.0);
    if bytes >= (1u64 << 40) as f64 {
        return usize::MAX;
    }
    (bytes as usize).next_power_of_two()
}

/// Parquet's split-block salts: one odd multiplier per word of a block.
const SALT: [u32; 8] = [
    0x47b6_137b,
    0x4497_4d91,
    0x8824_ad5b,
    0xa2b7_289d,
    0x7054_95c7,
    0x2df1_424b,
    0x9efc_4947,
    0x5c6b_fb31,
];

/// A split-block Bloom filter over 64-bit hashes: the high half picks a
/// 32-byte block, the low half one bit in each of its eight words.
#[derive(Debug, Clone)]
struct SplitBlockBloom {
    blocks: Vec<[u32; 8]>,
}

impl SplitBlockBloom {
    fn with_bytes(bytes: usize) -> Self {
        Self {
            blocks: vec![[0; 8]; (bytes / 32).max(1)],
        }
    }

    /// From a bitset of whole 32-byte blocks (checked by the caller).
    fn from_bytes(bytes: &[u8]) -> Self {
        let blocks = bytes
            .chunks_exact(32)
            .map(|block| {
                let mut words = [0u32; 8];
                for (word, chunk) in words.iter_mut().zip(block.chunks_exact(4)) {
                    *word = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
                }
                words
            })
            .collect();
        Self { blocks }
    }

    fn to_bytes(&self) -> Vec<u8> {
        self.blocks
            .iter()
            .flat_map(|block| block.iter().flat_map(|word| word.to_le_bytes()))
            .collect()
    }

    #[inline]
    fn block(&self, hash: u64) -> usize {
        (((hash >> 32) * self.blocks.len() as u64) >> 32) as usize
    }

    #[inline]
    fn insert(&mut self, hash: u64) {
        let index = self.block(hash);
        let block = &mut self.blocks[index];
        for (word, salt) in block.iter_mut().zip(SALT) {
            *word |= 1 << ((hash as u32).wrapping_mul(salt) >> 27);
        }
    }

    /// Branch-free: all eight words are tested and the misses or-ed, so
    /// the loop unrolls and a probe costs one cache line and no mispredicts.
    #[inline]
    fn check(&self, hash: u64) -> bool {
        let block = &self.blocks[self.block(hash)];
        let mut missing = 0u32;
        for (word, salt) in block.iter().zip(SALT) {
            missing |= !word & (1 << ((hash as u32).wrapping_mul(salt) >> 27));
        }
        missing == 0
    }
}

/// A 64-bit finaliser (MurmurHash3's fmix64): every input bit affects every
/// output bit, so consecutive keys land in unrelated blocks.
#[inline]
fn mix(mut value: u64) -> u64 {
    value ^= value >> 33;
    value = value.wrapping_mul(0xff51_afd7_ed55_8ccd);
    value ^= value >> 33;
    value = value.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    value ^ (value >> 33)
}

/// A hash of arbitrary bytes (a row encoding), eight bytes at a time.
fn hash_bytes(bytes: &[u8]) -> u64 {
    let mut hash = mix(bytes.len() as u64 ^ 0x9e37_79b9_7f4a_7c15);
    let mut chunks = bytes.chunks_exact(8);
    for chunk in &mut chunks {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        hash = mix(hash ^ u64::from_le_bytes(word));
    }
    let mut tail = [0u8; 8];
    tail[..chunks.remainder().len()].copy_from_slice(chunks.remainder());
    mix(hash ^ u64::from_le_bytes(tail))
}

/// Call `f(row, hash)` for every row of `values` (null rows get some hash;
/// callers skip them).
// See `probe` for the cast.
#[allow(clippy::unnecessary_cast)]
fn for_each_hash(values: &ArrayRef, mut f: impl FnMut(usize, u64)) -> Result<()> {
    with_integer_keys!(values, keys => {
        for (index, value) in keys.iter().enumerate() {
            f(index, mix(*value as i64 as u64));
        }
    }, else {
        let converter = RowConverter::new(vec![SortField::new(values.data_type().clone())])?;
        let rows = converter.convert_columns(std::slice::from_ref(values))?;
        for (index, row) in rows.iter().enumerate() {
            f(index, hash_bytes(row.as_ref()));
        }
    });
    Ok(())
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
        evaluate_unary(&self.input, batch, |values| self.probe(values))
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
    use arrow::array::{Int64Array, StringArray};
    use datafusion::physical_expr::expressions::Column;

    /// Every key is found (no false negatives), NULL stays NULL, and the
    /// false-positive rate is near what the filter was sized for.
    #[test]
    fn keys_are_found_nulls_stay_null_and_false_positives_are_rare() {
        const N: i64 = 20_000;
        // Keys are every third value, `absent` the values in between.
        let integers = |offset: i64, data_type: &DataType| -> ArrayRef {
            let values: ArrayRef =
                Arc::new(Int64Array::from_iter_values((0..N).map(|v| v * 3 + offset)));
            cast(&values, data_type).unwrap()
        };
        // (type, keys, absent values, probe with a key, a NULL and anything)
        let mut cases: Vec<(DataType, ArrayRef, ArrayRef, ArrayRef)> = Vec::new();
        for data_type in [
            DataType::Int64,
            DataType::Int32,
            DataType::UInt64,
            DataType::Date32,
        ] {
            let probe = cast(
                &(Arc::new(Int64Array::from(vec![Some(0), None, Some(1 << 30)])) as ArrayRef),
                &data_type,
            )
            .unwrap();
            cases.push((
                data_type.clone(),
                integers(0, &data_type),
                integers(1, &data_type),
                probe,
            ));
        }
        cases.push((
            DataType::Int64,
            Arc::new(Int64Array::from_iter_values(
                (0..N).map(|v| v * 3 + i64::MAX / 2),
            )),
            Arc::new(Int64Array::from_iter_values(
                (0..N).map(|v| v * 3 + 1 - i64::MAX / 2),
            )),
            Arc::new(Int64Array::from(vec![
                Some(i64::MAX / 2),
                None,
                Some(i64::MIN),
            ])),
        ));
        cases.push((
            DataType::Utf8,
            Arc::new(StringArray::from_iter_values(
                (0..N).map(|v| format!("k{}", v * 3)),
            )),
            Arc::new(StringArray::from_iter_values(
                (0..N).map(|v| format!("k{}", v * 3 + 1)),
            )),
            Arc::new(StringArray::from(vec![Some("k0"), None, Some("zz")])),
        ));
        for (data_type, keys, absent, probe) in cases {
            let bloom = BloomFilterExpr::try_new(
                Arc::new(Column::new("k", 0)),
                data_type.clone(),
                &keys,
                0.01,
            )
            .unwrap();
            let all = bloom.probe(&keys).unwrap();
            assert!(all.iter().all(|found| found == Some(true)), "{data_type}");
            let matched = bloom.probe(&probe).unwrap();
            assert!(matched.value(0), "{data_type}");
            assert!(matched.is_null(1), "{data_type}");
            let false_positives = bloom.probe(&absent).unwrap().true_count();
            assert!(
                false_positives < N as usize / 25,
                "{data_type}: {false_positives} false positives of {N} at fpp 0.01"
            );
        }
    }

    #[test]
    fn a_filter_survives_its_bytes() {
        let keys: ArrayRef = Arc::new(Int64Array::from_iter_values(0..1000));
        let bloom =
            BloomFilterExpr::try_new(Arc::new(Column::new("k", 0)), DataType::Int64, &keys, 0.01)
                .unwrap();
        let again = BloomFilterExpr::from_bitset(
            Arc::new(Column::new("k", 0)),
            DataType::Int64,
            bloom.bitset().to_vec(),
            bloom.keys(),
            bloom.fpp(),
        )
        .unwrap();
        let probe: ArrayRef = Arc::new(Int64Array::from_iter_values(0..5000));
        assert_eq!(bloom.probe(&probe).unwrap(), again.probe(&probe).unwrap());
    }
}
