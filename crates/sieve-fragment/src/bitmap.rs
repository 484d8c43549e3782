//! `KeyBitmapExpr`: "the key is in the build side of a join", exactly, for
//! integer keys in a narrow range.
//!
//! Join keys are mostly dense integers (surrogate keys, dates), so the keys a
//! build side keeps often lie in a range not much wider than their number.
//! Then one bit per value of the range, `[base, base + bits)`, is smaller
//! than a Bloom filter at 1% false positives and exact, and a probe is a
//! subtraction, a comparison and a bit test: no hashing, no false positives,
//! and a bitmap of up to a few hundred kilobytes stays in cache. NULL stays
//! NULL. Like the Bloom filter it only removes rows the join would drop.
//!
//! The expression has its own wire form in [`crate::SieveCodec`].

use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, OnceLock};

use arrow::array::{Array, ArrayRef, AsArray, BooleanArray};
use arrow::buffer::BooleanBuffer;
use arrow::compute::cast;
use arrow::datatypes::{
    DataType, Date32Type, Date64Type, Int16Type, Int32Type, Int64Type, Int8Type, Schema,
    UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};
use arrow::record_batch::RecordBatch;
use datafusion::common::{internal_err, plan_datafusion_err, plan_err, Result};
use datafusion::logical_expr::ColumnarValue;
use datafusion::physical_expr::PhysicalExpr;

use crate::bloom::with_integer_keys;
use crate::unary::evaluate_unary;
use crate::KeyWords;

/// Upper bound on the bytes of one key bitmap (1 Gi values, so TPC-H SF 100's
/// 600 million order keys fit: a Bloom filter over them costs the storage
/// nodes twice the CPU per row, its probes random where a bitmap's follow
/// the slices' key order); a bitmap travels zstd-compressed in a join
/// filter registration, bounded by [`crate::JOIN_FILTER_BYTES_MAX`].
pub const KEY_BITMAP_BYTES_MAX: usize = 128 * 1024 * 1024;

/// Words per chunk of a bitmap cut to the key ranges a storage node holds
/// ([`KeyBitmapExpr::from_parts_cut`]): 1,024 words, 65,536 values, 8 KiB.
pub const KEY_BITMAP_CHUNK_WORDS: usize = 1024;

/// A chunk left out of a cut bitmap.
const CHUNK_LEFT_OUT: u32 = u32::MAX;

/// Bytes from which a whole bitmap gets a [`Prefilter`]: past a core's
/// second-level cache (1 MiB here, 512 KiB to 2 MiB on most server cores), a
/// probe that misses in the bitmap waits on memory. Below, the prefilter
/// only adds work: TPC-H Q17 at SF 10 (a 250 KB bitmap) took 1.12x as long
/// with one.
const PREFILTER_FROM_BYTES: usize = 1024 * 1024;

/// Bits of a [`Prefilter`] per key: about 0.1% false positives with its
/// three bits per key in one word.
const PREFILTER_BITS_PER_KEY: usize = 32;

/// A prefilter is kept only if the bitmap is at least this many times its
/// size (the keys are at most one value in 128 of the bitmap's range).
/// Denser, most probes pass it and go on to the bitmap anyway.
const PREFILTER_BITMAP_RATIO_MIN: usize = 4;

/// `input` is one of the keys the bitmap was built from.
#[derive(Clone)]
pub struct KeyBitmapExpr {
    input: Arc<dyn PhysicalExpr>,
    data_type: DataType,
    /// The value of bit 0.
    base: i64,
    /// Values covered: `[base, base + bits)`.
    bits: u64,
    /// Whole or, on the compute node, packed ([`KeyWords`]); a cut
    /// bitmap's are whole.
    words: KeyWords,
    /// `None`: `words` are all the bitmap's words. `Some`: the bitmap was
    /// cut to the key ranges of a storage node's slices, and `words` hold
    /// only the chunks of [`KEY_BITMAP_CHUNK_WORDS`] that overlap them:
    /// entry `c` is where chunk `c` starts in `words`, in chunks, or
    /// [`CHUNK_LEFT_OUT`]. The values of a chunk left out all pass, as if
    /// its words were all ones: a slice holding such values (one written
    /// after the cut) is filtered less, never wrongly.
    chunks: Option<Arc<Vec<u32>>>,
    keys: u64,
    /// A Bloom filter over the keys of a whole bitmap, probed before it,
    /// built on the first probe (where the bitmap is probed, on a storage
    /// node) and only for a large, sparse bitmap: TPC-H Q17's 20,000 part
    /// keys at SF 100 spread over 20 M values, 2.5 MB of words, which a
    /// storage node scanning lineitem does not keep in cache, so nearly
    /// every probe waited on memory; the prefilter is 128 KB and answers
    /// 99.8% of them. A cut bitmap has none: it is cut because its table is
    /// sorted by the key, whose probes walk its words in order.
    prefilter: Arc<OnceLock<Option<Prefilter>>>,
}

impl KeyBitmapExpr {
    /// Whether keys of `data_type` can be held in a bitmap: integers and
    /// dates whose every value is an `i64`.
    pub fn supports(data_type: &DataType) -> bool {
        matches!(
            data_type,
            DataType::Int8
                | DataType::Int16
                | DataType::Int32
                | DataType::Int64
                | DataType::UInt8
                | DataType::UInt16
                | DataType::UInt32
                | DataType::Date32
                | DataType::Date64
        )
    }

    /// Bytes of a bitmap over the non-null values of `keys` (cast to
    /// `data_type`), or `None` if the type is not supported or there are no
    /// keys.
    pub fn bytes_for(keys: &ArrayRef, data_type: &DataType) -> Result<Option<usize>> {
        if !Self::supports(data_type) {
            return Ok(None);
        }
        let keys = cast(keys, data_type)?;
        Ok(bounds(&keys).map(|(low, high)| words_for(span(low, high)) * 8))
    }

    /// A bitmap of `keys` (any Arrow type castable to `data_type`, the type
    /// of `input`).
    pub fn try_new(
        input: Arc<dyn PhysicalExpr>,
        data_type: DataType,
        keys: &ArrayRef,
    ) -> Result<Self> {
        if !Self::supports(&data_type) {
            return plan_err!("a key bitmap cannot hold keys of type {data_type}");
        }
        let keys = cast(keys, &data_type)?;
        let Some((base, high)) = bounds(&keys) else {
            return plan_err!("a key bitmap needs at least one non-null key");
        };
        let bits = span(base, high);
        let words = words_for(bits);
        if words * 8 > KEY_BITMAP_BYTES_MAX {
            return plan_err!(
                "key bitmap over [{base}, {high}] needs {} bytes, above {KEY_BITMAP_BYTES_MAX}",
                words * 8
            );
        }
        let mut bitmap = vec![0u64; words];
        let mut count = 0u64;
        each_value(&keys, |index, value| {
            if keys.is_valid(index) {
                let offset = value.wrapping_sub(base) as u64;
                let (word, bit) = ((offset >> 6) as usize, offset & 63);
                count += u64::from(bitmap[word] >> bit & 1 == 0);
                bitmap[word] |= 1 << bit;
            }
        });
        Ok(Self {
            input,
            data_type,
            base,
            bits,
            words: bitmap.into(),
            chunks: None,
            keys: count,
            prefilter: Arc::default(),
        })
    }

    /// Rebuild a bitmap received on the wire: `bytes` are its words, little
    /// endian.
    pub fn from_parts(
        input: Arc<dyn PhysicalExpr>,
        data_type: DataType,
        base: i64,
        bits: u64,
        bytes: &[u8],
        keys: u64,
    ) -> Result<Self> {
        Self::check_length(bits, bytes.len())?;
        Self::from_reader(input, data_type, base, bits, bytes, keys, None)
    }

    /// A bitmap from its words: bit `i` of word `w` stands for the value
    /// `base + 64 * w + i`, `bits` values in all (a build side's keys
    /// collected as a bitmap, or one received on the wire). Words already
    /// shared (a collector's, whole or packed) are held, not copied.
    pub fn from_words(
        input: Arc<dyn PhysicalExpr>,
        data_type: DataType,
        base: i64,
        bits: u64,
        words: impl Into<KeyWords>,
        keys: u64,
    ) -> Result<Self> {
        let words = words.into();
        if !Self::supports(&data_type) {
            return plan_err!("a key bitmap cannot hold keys of type {data_type}");
        }
        if bits == 0
            || words.len().saturating_mul(8) > KEY_BITMAP_BYTES_MAX
            || words.len() as u64 != bits.div_ceil(64)
        {
            return plan_err!(
                "key bitmap of {bits} bits does not match its {} words (at most {KEY_BITMAP_BYTES_MAX} bytes)",
                words.len()
            );
        }
        Ok(Self {
            input,
            data_type,
            base,
            bits,
            words,
            chunks: None,
            keys,
            prefilter: Arc::default(),
        })
    }

    /// Rebuild a bitmap received on the wire, as [`Self::from_parts`] does,
    /// keeping only its chunks of [`KEY_BITMAP_CHUNK_WORDS`] words that
    /// overlap `ranges` (inclusive `(low, high)` value ranges: the keys a
    /// storage node's slices hold, by their statistics). Values in the
    /// chunks left out all pass. A node holding a third of a table's
    /// slices, interleaved, keeps about a third of the bitmap. Without
    /// `ranges`, the whole bitmap.
    pub fn from_parts_cut(
        input: Arc<dyn PhysicalExpr>,
        data_type: DataType,
        base: i64,
        bits: u64,
        bytes: &[u8],
        keys: u64,
        ranges: Option<&[(i64, i64)]>,
    ) -> Result<Self> {
        Self::check_length(bits, bytes.len())?;
        Self::from_reader(input, data_type, base, bits, bytes, keys, ranges)
    }

    /// A bitmap's words as they travel when large: one zstd frame of its
    /// little-endian words, encoded chunk by chunk (no copy of the whole).
    pub fn to_zstd(&self) -> Result<Vec<u8>> {
        use std::io::Write;
        let io =
            |error: std::io::Error| plan_datafusion_err!("cannot compress a key bitmap: {error}");
        let mut encoder = zstd::stream::write::Encoder::new(Vec::new(), 1).map_err(io)?;
        let mut buffer = Vec::with_capacity(KEY_BITMAP_CHUNK_WORDS * 8);
        let mut words = Vec::with_capacity(KEY_BITMAP_CHUNK_WORDS);
        for chunk in 0..words_for(self.bits).div_ceil(KEY_BITMAP_CHUNK_WORDS) {
            words.clear();
            self.chunk_words(chunk, &mut words);
            buffer.clear();
            buffer.extend(words.iter().flat_map(|word| word.to_le_bytes()));
            encoder.write_all(&buffer).map_err(io)?;
        }
        encoder.finish().map_err(io)
    }

    /// Rebuild a bitmap from [`Self::to_zstd`]'s frame, decompressed chunk
    /// by chunk (at most the bitmap's own bytes are read from it: a frame
    /// decompressing to more or less is refused), cut to `ranges` if given.
    pub fn from_zstd(
        input: Arc<dyn PhysicalExpr>,
        data_type: DataType,
        base: i64,
        bits: u64,
        compressed: &[u8],
        keys: u64,
        ranges: Option<&[(i64, i64)]>,
    ) -> Result<Self> {
        let decoder = zstd::stream::read::Decoder::new(compressed)
            .map_err(|error| plan_datafusion_err!("key bitmap is not a zstd frame: {error}"))?;
        Self::from_reader(input, data_type, base, bits, decoder, keys, ranges)
    }

    fn check_length(bits: u64, bytes: usize) -> Result<()> {
        if bits == 0 || bytes > KEY_BITMAP_BYTES_MAX || bytes as u64 != bits.div_ceil(64) * 8 {
            return plan_err!(
                "key bitmap of {bits} bits does not match its {bytes} bytes (at most {KEY_BITMAP_BYTES_MAX})"
            );
        }
        Ok(())
    }

    /// Read a bitmap's `bits.div_ceil(64)` little-endian words from
    /// `reader`, which must hold exactly those, keeping the chunks that
    /// overlap `ranges` (all without).
    fn from_reader(
        input: Arc<dyn PhysicalExpr>,
        data_type: DataType,
        base: i64,
        bits: u64,
        mut reader: impl std::io::Read,
        keys: u64,
        ranges: Option<&[(i64, i64)]>,
    ) -> Result<Self> {
        if !Self::supports(&data_type) {
            return plan_err!("a key bitmap cannot hold keys of type {data_type}");
        }
        let word_count = usize::try_from(bits.div_ceil(64)).unwrap_or(usize::MAX);
        if bits == 0 || word_count.saturating_mul(8) > KEY_BITMAP_BYTES_MAX {
            return plan_err!(
                "key bitmap of {bits} bits is empty or above {KEY_BITMAP_BYTES_MAX} bytes"
            );
        }
        let mut ranges: Option<Vec<(i128, i128)>> = ranges.map(|ranges| {
            ranges
                .iter()
                .filter(|(low, high)| low <= high)
                .map(|&(low, high)| (i128::from(low), i128::from(high)))
                .collect()
        });
        if let Some(ranges) = &mut ranges {
            ranges.sort_unstable();
        }
        let chunk_count = word_count.div_ceil(KEY_BITMAP_CHUNK_WORDS);
        let chunk_values = (KEY_BITMAP_CHUNK_WORDS * 64) as i128;
        let mut chunks = Vec::with_capacity(if ranges.is_some() { chunk_count } else { 0 });
        let mut words: Vec<u64> = Vec::with_capacity(if ranges.is_some() { 0 } else { word_count });
        let mut buffer = vec![0u8; KEY_BITMAP_CHUNK_WORDS * 8];
        let mut next_range = 0;
        let short = |error: std::io::Error| {
            plan_datafusion_err!("key bitmap of {bits} bits: its words cannot be read: {error}")
        };
        for chunk in 0..chunk_count {
            let first = chunk * KEY_BITMAP_CHUNK_WORDS;
            let count = (word_count - first).min(KEY_BITMAP_CHUNK_WORDS);
            let buffer = &mut buffer[..count * 8];
            reader.read_exact(buffer).map_err(short)?;
            let kept = match &ranges {
                None => true,
                Some(ranges) => {
                    let low = i128::from(base) + chunk as i128 * chunk_values;
                    let high = low + chunk_values - 1;
                    // Ranges ending before this chunk end before every later one.
                    while next_range < ranges.len() && ranges[next_range].1 < low {
                        next_range += 1;
                    }
                    ranges[next_range..]
                        .iter()
                        .take_while(|(range_low, _)| *range_low <= high)
                        .any(|(_, range_high)| *range_high >= low)
                }
            };
            if ranges.is_some() {
                if !kept {
                    chunks.push(CHUNK_LEFT_OUT);
                    continue;
                }
                chunks.push((words.len() / KEY_BITMAP_CHUNK_WORDS) as u32);
            }
            words.extend(le_words(buffer));
            if ranges.is_some() {
                // Every chunk kept is whole: the last one is padded (its
                // values past `bits` are never looked up).
                words.resize(words.len().next_multiple_of(KEY_BITMAP_CHUNK_WORDS), 0);
            }
        }
        let mut beyond = [0u8; 1];
        if reader.read(&mut beyond).map_err(short)? != 0 {
            return plan_err!("key bitmap of {bits} bits has more words than its bits");
        }
        let cut = chunks.contains(&CHUNK_LEFT_OUT);
        if ranges.is_some() && !cut {
            words.truncate(word_count);
        }
        Ok(Self {
            input,
            data_type,
            base,
            bits,
            words: words.into(),
            chunks: cut.then(|| Arc::new(chunks)),
            keys,
            prefilter: Arc::default(),
        })
    }

    /// This bitmap cut to the chunks of [`KEY_BITMAP_CHUNK_WORDS`] words
    /// that overlap `[low, high]`: a window, what one slice of a table
    /// sorted by the key needs (its key range, by its statistics). Values
    /// in the chunks left out pass, as in a bitmap cut on a node, so a
    /// slice holding values outside `[low, high]` is filtered less, never
    /// wrongly. A bitmap already cut is returned as it is.
    pub fn window(&self, low: i64, high: i64) -> Self {
        if self.chunks.is_some() {
            return self.clone();
        }
        let word_count = words_for(self.bits);
        let chunk_count = word_count.div_ceil(KEY_BITMAP_CHUNK_WORDS);
        let chunk_values = (KEY_BITMAP_CHUNK_WORDS * 64) as i128;
        let (base, last) = (
            i128::from(self.base),
            i128::from(self.base) + self.bits as i128 - 1,
        );
        let (low, high) = (i128::from(low).max(base), i128::from(high).min(last));
        let mut chunks = vec![CHUNK_LEFT_OUT; chunk_count];
        let mut words = Vec::new();
        if low <= high {
            let first = ((low - base) / chunk_values) as usize;
            let end = ((high - base) / chunk_values) as usize + 1;
            for (at, chunk) in (first..end).enumerate() {
                chunks[chunk] = at as u32;
            }
            let from = first * KEY_BITMAP_CHUNK_WORDS;
            let to = (end * KEY_BITMAP_CHUNK_WORDS).min(word_count);
            self.words.copy_to(from, to, &mut words);
            words.resize((end - first) * KEY_BITMAP_CHUNK_WORDS, 0);
        }
        Self {
            input: Arc::clone(&self.input),
            data_type: self.data_type.clone(),
            base: self.base,
            bits: self.bits,
            words: words.into(),
            chunks: Some(Arc::new(chunks)),
            keys: self.keys,
            prefilter: Arc::default(),
        }
    }

    /// Bytes of the words [`Self::window`] would keep for `[low, high]`.
    pub fn window_bytes(&self, low: i64, high: i64) -> usize {
        let chunk_values = (KEY_BITMAP_CHUNK_WORDS * 64) as i128;
        let (base, last) = (
            i128::from(self.base),
            i128::from(self.base) + self.bits as i128 - 1,
        );
        let (low, high) = (i128::from(low).max(base), i128::from(high).min(last));
        if low > high {
            return 0;
        }
        let chunks = (high - base) / chunk_values - (low - base) / chunk_values + 1;
        chunks as usize * KEY_BITMAP_CHUNK_WORDS * 8
    }

    /// A window's ([`Self::window`]) first chunk and its words: `None`
    /// unless the bitmap is cut and the chunks it keeps are one run, in
    /// order.
    pub fn window_words(&self) -> Option<(usize, &[u64])> {
        let chunks = self.chunks.as_ref()?;
        let first = chunks
            .iter()
            .position(|&at| at != CHUNK_LEFT_OUT)
            .unwrap_or(0);
        let kept = self.words.len() / KEY_BITMAP_CHUNK_WORDS;
        let run = chunks
            .iter()
            .enumerate()
            .all(|(chunk, &at)| match chunk.checked_sub(first) {
                Some(index) if index < kept => at as usize == index,
                _ => at == CHUNK_LEFT_OUT,
            });
        // A cut bitmap's words are whole.
        run.then_some(first)
            .zip(self.words.whole().map(|words| words.as_slice()))
    }

    /// Rebuild a window ([`Self::window`]) received on the wire: `bytes`
    /// are the little-endian words of whole chunks from `first_chunk` on,
    /// of a bitmap of `bits` values from `base`.
    pub fn from_window(
        input: Arc<dyn PhysicalExpr>,
        data_type: DataType,
        base: i64,
        bits: u64,
        first_chunk: u64,
        bytes: &[u8],
        keys: u64,
    ) -> Result<Self> {
        if !Self::supports(&data_type) {
            return plan_err!("a key bitmap cannot hold keys of type {data_type}");
        }
        let word_count = words_for(bits);
        let chunk_bytes = KEY_BITMAP_CHUNK_WORDS * 8;
        let chunk_count = word_count.div_ceil(KEY_BITMAP_CHUNK_WORDS);
        let kept = bytes.len() / chunk_bytes;
        if bits == 0
            || word_count.saturating_mul(8) > KEY_BITMAP_BYTES_MAX
            || !bytes.len().is_multiple_of(chunk_bytes)
            || first_chunk.saturating_add(kept as u64) > chunk_count as u64
        {
            return plan_err!(
                "key bitmap window of {} bytes from chunk {first_chunk} does not fit a bitmap of {bits} bits (at most {KEY_BITMAP_BYTES_MAX} bytes)",
                bytes.len()
            );
        }
        let first = first_chunk as usize;
        let mut chunks = vec![CHUNK_LEFT_OUT; chunk_count];
        for (at, chunk) in (first..first + kept).enumerate() {
            chunks[chunk] = at as u32;
        }
        let words: Vec<u64> = le_words(bytes).collect();
        Ok(Self {
            input,
            data_type,
            base,
            bits,
            words: words.into(),
            chunks: Some(Arc::new(chunks)),
            keys,
            prefilter: Arc::default(),
        })
    }

    /// Append the words of chunk `chunk` (of [`KEY_BITMAP_CHUNK_WORDS`],
    /// the last one short) to `out`: a cut bitmap's chunks left out as all
    /// ones (their values pass).
    fn chunk_words(&self, chunk: usize, out: &mut Vec<u64>) {
        let word_count = words_for(self.bits);
        let first = chunk * KEY_BITMAP_CHUNK_WORDS;
        let count = KEY_BITMAP_CHUNK_WORDS.min(word_count - first);
        match self.chunks.as_ref().map(|chunks| chunks[chunk]) {
            None => self.words.copy_to(first, first + count, out),
            Some(CHUNK_LEFT_OUT) => out.resize(out.len() + count, u64::MAX),
            Some(at) => {
                let at = at as usize * KEY_BITMAP_CHUNK_WORDS;
                self.words.copy_to(at, at + count, out);
            }
        }
    }

    /// Whether this bitmap was cut to a node's key ranges (some chunks left out).
    pub fn is_cut(&self) -> bool {
        self.chunks.is_some()
    }

    /// The expression whose value is looked up (a column, in practice).
    pub fn input(&self) -> &Arc<dyn PhysicalExpr> {
        &self.input
    }

    /// The type the looked-up values are cast to, in which `base` counts.
    pub fn key_type(&self) -> &DataType {
        &self.data_type
    }

    /// The value of the first bit.
    pub fn base(&self) -> i64 {
        self.base
    }

    /// The number of values covered, from [`Self::base`].
    pub fn bits(&self) -> u64 {
        self.bits
    }

    /// The bitmap's words as little-endian bytes, for the wire (a cut
    /// bitmap's chunks left out as all ones: their values pass).
    pub fn to_bytes(&self) -> Vec<u8> {
        let word_count = words_for(self.bits);
        let mut bytes = Vec::with_capacity(word_count * 8);
        let mut words = Vec::with_capacity(KEY_BITMAP_CHUNK_WORDS);
        for chunk in 0..word_count.div_ceil(KEY_BITMAP_CHUNK_WORDS) {
            words.clear();
            self.chunk_words(chunk, &mut words);
            bytes.extend(words.iter().flat_map(|word| word.to_le_bytes()));
        }
        bytes
    }

    /// Bytes of the bitmap's words as they travel, before compression: a
    /// whole bitmap's all (packed or not), a cut one's chunks kept. What
    /// decides how a bitmap is sent (compressed, in windows).
    pub fn word_bytes(&self) -> usize {
        self.words.len() * 8
    }

    /// Whether the words are held packed ([`KeyWords::Packed`]).
    pub fn is_packed(&self) -> bool {
        self.words.whole().is_none()
    }

    /// Bytes of the bitmap, as held (packed words take fewer than
    /// [`Self::word_bytes`]).
    pub fn byte_len(&self) -> usize {
        let words = match &self.words {
            KeyWords::Whole(words) => words.len() * 8,
            packed => packed.byte_len(),
        };
        words + self.chunks.as_ref().map_or(0, |chunks| chunks.len() * 4)
    }

    /// Number of distinct keys set.
    pub fn keys(&self) -> u64 {
        self.keys
    }

    /// The prefilter of a whole bitmap, built on first use, if it is large
    /// and sparse enough to have one (and its words are not packed: one
    /// packed is the compute node's, and probed there seldom if ever).
    fn prefilter(&self) -> Option<&Prefilter> {
        if self.chunks.is_some() {
            return None;
        }
        let words = self.words.whole()?;
        self.prefilter
            .get_or_init(|| Prefilter::build(words))
            .as_ref()
    }

    fn probe(&self, values: &ArrayRef) -> Result<BooleanArray> {
        let values = if values.data_type() == &self.data_type {
            Arc::clone(values)
        } else {
            cast(values, &self.data_type)?
        };
        let (base, bits) = (self.base, self.bits);
        if let KeyWords::Packed(packed) = &self.words {
            let contains = |value: i64| {
                let offset = value.wrapping_sub(base) as u64;
                offset < bits && packed.word((offset >> 6) as usize) >> (offset & 63) & 1 == 1
            };
            let matched = collect_matches(&values, contains)?;
            return Ok(BooleanArray::new(matched, values.logical_nulls()));
        }
        let words = self
            .words
            .whole()
            .expect("packed words answered above")
            .as_slice();
        let matched = match &self.chunks {
            None => match self.prefilter() {
                None => {
                    let contains = |value: i64| {
                        let offset = value.wrapping_sub(base) as u64;
                        offset < bits && words[(offset >> 6) as usize] >> (offset & 63) & 1 == 1
                    };
                    collect_matches(&values, contains)?
                }
                Some(prefilter) => {
                    let contains = |value: i64| {
                        let offset = value.wrapping_sub(base) as u64;
                        offset < bits
                            && prefilter.may_contain(offset)
                            && words[(offset >> 6) as usize] >> (offset & 63) & 1 == 1
                    };
                    collect_matches(&values, contains)?
                }
            },
            Some(chunks) => {
                let contains = |value: i64| {
                    let offset = value.wrapping_sub(base) as u64;
                    if offset >= bits {
                        return false;
                    }
                    let word = (offset >> 6) as usize;
                    match chunks[word / KEY_BITMAP_CHUNK_WORDS] {
                        CHUNK_LEFT_OUT => true,
                        at => {
                            let word = at as usize * KEY_BITMAP_CHUNK_WORDS
                                + word % KEY_BITMAP_CHUNK_WORDS;
                            words[word] >> (offset & 63) & 1 == 1
                        }
                    }
                };
                collect_matches(&values, contains)?
            }
        };
        Ok(BooleanArray::new(matched, values.logical_nulls()))
    }
}

/// A slice summary's bound (Arrow's display of a value) of a column of
/// `data_type` as a key bitmap sees it, if the type is one a bitmap holds
/// and the text parses as one.
pub fn key_bound(text: &str, data_type: &DataType) -> Option<i64> {
    use datafusion::common::ScalarValue;
    match ScalarValue::try_from_string(text.to_string(), data_type).ok()? {
        ScalarValue::Int8(Some(v)) => Some(v.into()),
        ScalarValue::Int16(Some(v)) => Some(v.into()),
        ScalarValue::Int32(Some(v)) => Some(v.into()),
        ScalarValue::Int64(Some(v)) => Some(v),
        ScalarValue::UInt8(Some(v)) => Some(v.into()),
        ScalarValue::UInt16(Some(v)) => Some(v.into()),
        ScalarValue::UInt32(Some(v)) => Some(v.into()),
        ScalarValue::Date32(Some(v)) => Some(v.into()),
        _ => None,
    }
}

/// `contains` of every value of `values` (of a supported type).
fn collect_matches(values: &ArrayRef, contains: impl Fn(i64) -> bool) -> Result<BooleanBuffer> {
    // Every supported type widens to i64 exactly (`supports`).
    #[allow(clippy::unnecessary_cast)]
    let matched = with_integer_keys!(values, keys => {
        BooleanBuffer::collect_bool(keys.len(), |index| contains(keys[index] as i64))
    }, else {
        return internal_err!("key bitmap probed with values of type {}", values.data_type());
    });
    Ok(matched)
}

/// A Bloom filter over a bitmap's keys (their offsets from its base) that
/// fits in a core's cache where the bitmap does not: each key sets three
/// bits of one 64-bit word, so a probe reads one word. Probed first, it
/// leaves the bitmap to the keys and about 0.1% of the other values; the
/// answer stays the bitmap's, exact.
#[derive(Debug)]
struct Prefilter {
    /// A power of two of them.
    words: Vec<u64>,
    /// `64 - log2(words.len())`: the hash's top bits pick the word.
    shift: u32,
}

impl Prefilter {
    /// The prefilter of the bitmap `words`, if they take at least
    /// [`PREFILTER_FROM_BYTES`] and at least [`PREFILTER_BITMAP_RATIO_MIN`]
    /// times the prefilter.
    fn build(words: &[u64]) -> Option<Self> {
        if words.len() * 8 < PREFILTER_FROM_BYTES {
            return None;
        }
        // Counted, not taken from the bitmap's `keys`, which a request states.
        let keys: usize = words.iter().map(|word| word.count_ones() as usize).sum();
        let size = (keys * PREFILTER_BITS_PER_KEY)
            .div_ceil(64)
            .next_power_of_two()
            .max(2);
        if size * PREFILTER_BITMAP_RATIO_MIN > words.len() {
            return None;
        }
        let mut prefilter = Self {
            words: vec![0; size],
            shift: 64 - size.trailing_zeros(),
        };
        for (index, word) in words.iter().enumerate() {
            let mut rest = *word;
            while rest != 0 {
                let offset = (index as u64) << 6 | u64::from(rest.trailing_zeros());
                let (at, mask) = prefilter.place(offset);
                prefilter.words[at] |= mask;
                rest &= rest - 1;
            }
        }
        Some(prefilter)
    }

    /// The word and the bits of `offset`: two multiplicative hashes, whose
    /// top bits are the well mixed ones.
    #[inline]
    fn place(&self, offset: u64) -> (usize, u64) {
        let at = offset.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift;
        let bits = offset.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
        let mask = 1 << (bits >> 58) | 1 << (bits >> 52 & 63) | 1 << (bits >> 46 & 63);
        (at as usize, mask)
    }

    #[inline]
    fn may_contain(&self, offset: u64) -> bool {
        let (at, mask) = self.place(offset);
        self.words[at] & mask == mask
    }
}

/// Values in `[low, high]`.
fn span(low: i64, high: i64) -> u64 {
    (high.wrapping_sub(low) as u64).saturating_add(1)
}

fn words_for(bits: u64) -> usize {
    usize::try_from(bits.div_ceil(64)).unwrap_or(usize::MAX)
}

/// Smallest and largest non-null value of `keys` (of a supported type).
fn bounds(keys: &ArrayRef) -> Option<(i64, i64)> {
    let mut found: Option<(i64, i64)> = None;
    each_value(keys, |index, value| {
        if keys.is_valid(index) {
            found = Some(match found {
                None => (value, value),
                Some((low, high)) => (low.min(value), high.max(value)),
            });
        }
    });
    found
}

/// `f(row, value)` for every row of `keys` (null rows included: callers check).
#[allow(clippy::unnecessary_cast)]
fn each_value(keys: &ArrayRef, mut f: impl FnMut(usize, i64)) {
    with_integer_keys!(keys, values => {
        for (index, value) in values.iter().enumerate() {
            f(index, *value as i64);
        }
    }, else {});
}

impl fmt::Debug for KeyBitmapExpr {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("KeyBitmapExpr")
            .field("input", &self.input)
            .field("base", &self.base)
            .field("bits", &self.bits)
            .field("keys", &self.keys)
            .field("cut", &self.is_cut())
            .finish()
    }
}

impl fmt::Display for KeyBitmapExpr {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "{} IN bitmap({} keys over [{}, {}], {} bytes)",
            self.input,
            self.keys,
            self.base,
            self.base.wrapping_add(self.bits as i64 - 1),
            self.byte_len()
        )
    }
}

impl PartialEq for KeyBitmapExpr {
    fn eq(&self, other: &Self) -> bool {
        self.input.as_ref() == other.input.as_ref()
            && self.data_type == other.data_type
            && self.base == other.base
            && self.bits == other.bits
            && self.words == other.words
            && self.chunks == other.chunks
    }
}

impl Eq for KeyBitmapExpr {}

impl Hash for KeyBitmapExpr {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.input.hash(state);
        self.base.hash(state);
        self.bits.hash(state);
        self.words.hash(state);
        self.chunks.hash(state);
    }
}

impl PhysicalExpr for KeyBitmapExpr {
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
            internal_err!("KeyBitmapExpr has one child, got {}", children.len())
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

/// The little-endian 64-bit words of `bytes` (a trailing part shorter than a
/// word is left out).
fn le_words(bytes: &[u8]) -> impl Iterator<Item = u64> + '_ {
    bytes
        .chunks_exact(8)
        .map(|word| u64::from_le_bytes(word.try_into().expect("chunks of 8")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int32Array, Int64Array, UInt64Array};
    use datafusion::physical_expr::expressions::Column;

    fn column() -> Arc<dyn PhysicalExpr> {
        Arc::new(Column::new("k", 0))
    }

    /// Exactly the keys match, NULL stays NULL, values far outside the range
    /// (both ends of i64) do not wrap into it, and the bitmap survives its
    /// bytes.
    #[test]
    fn exactly_the_keys_match_and_the_bitmap_survives_its_bytes() {
        for data_type in [DataType::Int64, DataType::Int32, DataType::Date32] {
            let keys: ArrayRef = cast(
                &(Arc::new(Int64Array::from_iter_values((0..5000).map(|v| v * 3 - 700)))
                    as ArrayRef),
                &data_type,
            )
            .unwrap();
            let bitmap = KeyBitmapExpr::try_new(column(), data_type.clone(), &keys).unwrap();
            assert_eq!(bitmap.keys(), 5000, "{data_type}");
            assert_eq!(bitmap.base(), -700);
            assert_eq!(bitmap.bits(), 3 * 4999 + 1);
            let probe: ArrayRef =
                Arc::new(Int64Array::from_iter((-1000..16000).map(Some).chain([
                    None,
                    Some(i64::MIN),
                    Some(i64::MAX),
                ])));
            let matched = bitmap.probe(&probe).unwrap();
            for (index, value) in probe.as_primitive::<Int64Type>().iter().enumerate() {
                match value {
                    None => assert!(matched.is_null(index)),
                    Some(value) => {
                        let key =
                            (-700..=-700 + 3 * 4999).contains(&value) && (value + 700) % 3 == 0;
                        // Values outside the type's range do not cast: only
                        // Int64 probes them.
                        if data_type == DataType::Int64 || i32::try_from(value).is_ok() {
                            assert_eq!(matched.value(index), key, "{data_type} {value}");
                        }
                    }
                }
            }
            let again = KeyBitmapExpr::from_parts(
                column(),
                data_type.clone(),
                bitmap.base(),
                bitmap.bits(),
                &bitmap.to_bytes(),
                bitmap.keys(),
            )
            .unwrap();
            assert_eq!(again, bitmap);
        }
    }

    /// A large bitmap over sparse keys gets a prefilter, and with it still
    /// matches exactly the keys (from the first value of its range to the
    /// last, and beyond both ends); the prefilter lets few other values
    /// through. A dense bitmap, a small one and a cut one get none.
    #[test]
    fn a_sparse_bitmap_prefiltered_still_matches_exactly_the_keys() {
        // 20,000 keys over 20 M values, as TPC-H Q17's part keys at SF 100,
        // with a run of neighbours and both ends of the range.
        let mut keys: Vec<i64> = (0..20_000i64)
            .map(|i| 5 + i * 997 + (i * i) % 613)
            .collect();
        keys.extend(7_000_000..7_000_100);
        let keys: ArrayRef = Arc::new(Int64Array::from(keys.clone()));
        let bitmap = KeyBitmapExpr::try_new(column(), DataType::Int64, &keys).unwrap();
        let prefilter = bitmap
            .prefilter()
            .expect("a large sparse bitmap has a prefilter");
        let set: std::collections::HashSet<i64> = keys
            .as_primitive::<Int64Type>()
            .values()
            .iter()
            .copied()
            .collect();
        let (low, high) = (bitmap.base(), bitmap.base() + bitmap.bits() as i64 - 1);
        let probe: ArrayRef = Arc::new(Int64Array::from_iter(
            (low - 100..high + 100)
                .map(Some)
                .chain([None, Some(i64::MIN), Some(i64::MAX)]),
        ));
        let matched = bitmap.probe(&probe).unwrap();
        let mut passed_others = 0usize;
        for (index, value) in probe.as_primitive::<Int64Type>().iter().enumerate() {
            let Some(value) = value else {
                assert!(matched.is_null(index));
                continue;
            };
            assert_eq!(matched.value(index), set.contains(&value), "{value}");
            if (low..=high).contains(&value) && !set.contains(&value) {
                let offset = (value - low) as u64;
                passed_others += usize::from(prefilter.may_contain(offset));
            }
        }
        let others = (high - low + 1) as usize - set.len();
        assert!(
            passed_others * 200 < others,
            "the prefilter let {passed_others} of {others} other values through"
        );

        // Dense: one value in 16 is a key.
        let dense: ArrayRef = Arc::new(Int64Array::from_iter_values((0..200_000).map(|v| v * 16)));
        let dense = KeyBitmapExpr::try_new(column(), DataType::Int64, &dense).unwrap();
        assert!(dense.prefilter().is_none());
        // Small: it stays in cache by itself.
        let small: ArrayRef = Arc::new(Int64Array::from_iter_values([1, 100_000]));
        let small = KeyBitmapExpr::try_new(column(), DataType::Int64, &small).unwrap();
        assert!(small.prefilter().is_none());
        // Cut: its probes follow the key order.
        let window = bitmap.window(low, low + 1000);
        assert!(window.is_cut() && window.prefilter().is_none());
    }

    /// A bitmap travels as one zstd frame and comes back whole or cut,
    /// read chunk by chunk; a frame of fewer or more words than its bits,
    /// or no frame at all, is refused.
    #[test]
    fn a_compressed_bitmap_comes_back_whole_or_cut_and_a_bad_frame_is_refused() {
        let keys: ArrayRef = Arc::new(Int64Array::from_iter_values((0..2_000_000).map(|v| v * 3)));
        let bitmap = KeyBitmapExpr::try_new(column(), DataType::Int64, &keys).unwrap();
        let frame = bitmap.to_zstd().unwrap();
        assert!(frame.len() < bitmap.byte_len() / 4, "{} bytes", frame.len());
        let whole = KeyBitmapExpr::from_zstd(
            column(),
            DataType::Int64,
            bitmap.base(),
            bitmap.bits(),
            &frame,
            bitmap.keys(),
            None,
        )
        .unwrap();
        assert_eq!(whole, bitmap);
        let ranges = [(100_000, 200_000), (5_000_000, 5_000_001)];
        let cut = KeyBitmapExpr::from_zstd(
            column(),
            DataType::Int64,
            bitmap.base(),
            bitmap.bits(),
            &frame,
            bitmap.keys(),
            Some(&ranges),
        )
        .unwrap();
        let from_bytes = KeyBitmapExpr::from_parts_cut(
            column(),
            DataType::Int64,
            bitmap.base(),
            bitmap.bits(),
            &bitmap.to_bytes(),
            bitmap.keys(),
            Some(&ranges),
        )
        .unwrap();
        assert_eq!(cut, from_bytes);
        assert!(cut.is_cut() && cut.byte_len() < bitmap.byte_len() / 10);
        let probe: ArrayRef = Arc::new(Int64Array::from_iter_values(
            (99_000..201_000)
                .chain(4_990_000..5_010_000)
                .chain([3_000_001]),
        ));
        let matched = cut.probe(&probe).unwrap();
        let chunk_values = (KEY_BITMAP_CHUNK_WORDS * 64) as i64;
        for (index, value) in probe
            .as_primitive::<Int64Type>()
            .values()
            .iter()
            .enumerate()
        {
            let in_range = ranges.iter().any(|&(low, high)| {
                (low / chunk_values..=high / chunk_values).contains(&(value / chunk_values))
            });
            let expected = if in_range { value % 3 == 0 } else { true };
            assert_eq!(matched.value(index), expected, "{value}");
        }

        let words = |count: usize| zstd::bulk::compress(&vec![0xffu8; count * 8], 1).unwrap();
        let word_count = bitmap.bits().div_ceil(64) as usize;
        for (name, frame) in [
            ("fewer words", words(word_count - 1)),
            ("more words", words(word_count + 1)),
            ("no frame", vec![1, 2, 3, 4, 5]),
        ] {
            let refused = KeyBitmapExpr::from_zstd(
                column(),
                DataType::Int64,
                bitmap.base(),
                bitmap.bits(),
                &frame,
                1,
                None,
            );
            assert!(refused.is_err(), "{name}");
        }
    }

    /// A bitmap made of packed words (as the compute node holds a build
    /// side's) answers, travels and cuts into windows exactly as the same
    /// bitmap made of whole words, in fewer bytes.
    #[test]
    fn a_bitmap_of_packed_words_answers_and_travels_as_one_of_whole_words() {
        // TPC-H-like order keys (8 values of 32), a third of them, over
        // 40 chunks, and a stretch with none.
        let keys: Vec<i64> = (0..40 * 65_536i64)
            .filter(|value| value % 32 < 8 && (value / 32 + value) % 3 == 0)
            .filter(|value| !(600_000..900_000).contains(value))
            .map(|value| value + 1_000)
            .collect();
        let keys: ArrayRef = Arc::new(Int64Array::from(keys));
        let whole = KeyBitmapExpr::try_new(column(), DataType::Int64, &keys).unwrap();
        let words =
            KeyWords::from(le_words(&whole.to_bytes()).collect::<Vec<_>>()).packed_if_smaller(0.75);
        assert!(words.whole().is_none(), "packed");
        let packed = KeyBitmapExpr::from_words(
            column(),
            DataType::Int64,
            whole.base(),
            whole.bits(),
            words,
            whole.keys(),
        )
        .unwrap();
        assert!(
            packed.byte_len() < whole.byte_len() / 2,
            "{}",
            packed.byte_len()
        );
        assert_eq!(packed, whole);
        let probe: ArrayRef = Arc::new(Int64Array::from_iter_values(-5..45 * 65_536));
        assert_eq!(packed.probe(&probe).unwrap(), whole.probe(&probe).unwrap());
        assert_eq!(packed.to_bytes(), whole.to_bytes());
        assert_eq!(packed.to_zstd().unwrap(), whole.to_zstd().unwrap());
        for (low, high) in [(0, 10), (500_000, 1_000_000), (2_000_000, 9_000_000)] {
            let (a, b) = (packed.window(low, high), whole.window(low, high));
            assert_eq!(a, b, "[{low}, {high}]");
            assert_eq!(a.window_words(), b.window_words());
        }
    }

    /// A window keeps the chunks over its range, answers exactly inside
    /// them and lets every other value of the bitmap's range pass; it
    /// travels as its chunks alone and comes back the same; a window that
    /// does not fit its bitmap is refused.
    #[test]
    fn a_window_answers_inside_passes_outside_and_survives_the_wire() {
        let keys: ArrayRef = Arc::new(Int64Array::from_iter_values(
            (0..2_000_000).map(|v| v * 3 + 10),
        ));
        let bitmap = KeyBitmapExpr::try_new(column(), DataType::Int64, &keys).unwrap();
        let chunk_values = (KEY_BITMAP_CHUNK_WORDS * 64) as i64;
        let last = bitmap.base() + bitmap.bits() as i64 - 1;
        for (low, high) in [
            (1_000_000, 1_300_000),
            (0, 5),
            (last - 3, last + 1000),
            (-500, 70_000),
            (last + 10, last + 20),
        ] {
            let window = bitmap.window(low, high);
            assert_eq!(
                window.byte_len() - 4 * window.chunks.as_ref().unwrap().len(),
                { bitmap.window_bytes(low, high) }
            );
            let (first, words) = window.window_words().expect("one run of chunks");
            let bytes: Vec<u8> = words.iter().flat_map(|word| word.to_le_bytes()).collect();
            let again = KeyBitmapExpr::from_window(
                column(),
                DataType::Int64,
                bitmap.base(),
                bitmap.bits(),
                first as u64,
                &bytes,
                bitmap.keys(),
            )
            .unwrap();
            assert_eq!(again, window, "[{low}, {high}]");
            let probe: ArrayRef = Arc::new(Int64Array::from_iter_values(
                (low - 70_000..low + 1000)
                    .chain(high - 1000..high + 70_000)
                    .chain([i64::MIN, i64::MAX, 9, last + 1]),
            ));
            let whole = bitmap.probe(&probe).unwrap();
            let windowed = again.probe(&probe).unwrap();
            let base = bitmap.base();
            let in_window = |value: i64| {
                let overlap = (low.max(base), high.min(last));
                overlap.0 <= overlap.1
                    && ((overlap.0 - base) / chunk_values..=(overlap.1 - base) / chunk_values)
                        .contains(&((value - base) / chunk_values))
            };
            for (index, &value) in probe
                .as_primitive::<Int64Type>()
                .values()
                .iter()
                .enumerate()
            {
                let expected = if !(base..=last).contains(&value) {
                    false
                } else if in_window(value) {
                    whole.value(index)
                } else {
                    true
                };
                assert_eq!(windowed.value(index), expected, "[{low}, {high}] {value}");
                if (low..=high).contains(&value) {
                    assert_eq!(windowed.value(index), whole.value(index), "{value}");
                }
            }
        }
        let bytes = vec![0u8; KEY_BITMAP_CHUNK_WORDS * 8];
        let chunks = bitmap
            .bits()
            .div_ceil(64)
            .div_ceil(KEY_BITMAP_CHUNK_WORDS as u64);
        for (first, length) in [
            (chunks, bytes.len()),
            (0, bytes.len() - 8),
            (chunks - 1, 2 * bytes.len()),
        ] {
            let refused = KeyBitmapExpr::from_window(
                column(),
                DataType::Int64,
                bitmap.base(),
                bitmap.bits(),
                first,
                &vec![0u8; length],
                1,
            );
            assert!(refused.is_err(), "chunk {first}, {length} bytes");
        }
    }

    #[test]
    fn bad_bitmaps_are_refused() {
        let keys: ArrayRef = Arc::new(Int64Array::from(vec![0, i64::MAX]));
        let error = KeyBitmapExpr::try_new(column(), DataType::Int64, &keys).unwrap_err();
        assert!(error.to_string().contains("above"), "{error}");
        let keys: ArrayRef = Arc::new(UInt64Array::from(vec![1, 2]));
        assert!(KeyBitmapExpr::try_new(column(), DataType::UInt64, &keys).is_err());
        let none: ArrayRef = Arc::new(Int32Array::from(vec![None, None]));
        assert!(KeyBitmapExpr::try_new(column(), DataType::Int32, &none).is_err());
        for (bits, bytes) in [(0, 0), (65, 8), (64, 16), (1 << 40, 8)] {
            assert!(
                KeyBitmapExpr::from_parts(column(), DataType::Int64, 0, bits, &vec![0; bytes], 1)
                    .is_err(),
                "{bits} bits in {bytes} bytes"
            );
        }
    }
}
