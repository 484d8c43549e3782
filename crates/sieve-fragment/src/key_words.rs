//! A key bitmap's words as the compute node holds them while a query runs:
//! whole, or packed chunk by chunk.
//!
//! A join filter's key bitmap spans its keys' range, one bit per value.
//! Keys that use a fraction of their range leave most of its bytes zero:
//! TPC-H's order keys use 8 values in every 32, so a bitmap of them has at
//! least three zero bytes in four, and a build side keeping a tenth of the
//! orders leaves nine chunks of ten nearly empty. TPC-H Q21 at SF 100 held
//! three such bitmaps of 75 MB each for as long as its scans of lineitem
//! ran, outside the statement's memory bound.
//!
//! [`PackedWords`] holds each chunk of [`KEY_BITMAP_CHUNK_WORDS`] words
//! (65,536 values) in whichever of four forms is smallest:
//!
//! - nothing, if all its words are zero;
//! - its keys, as 16-bit offsets in the chunk, ascending (as a roaring
//!   bitmap's array container): 2 bytes a key;
//! - its non-zero bytes, with a mask of which bytes they are and the
//!   count of mask bits before each mask word: 1,280 bytes and one byte
//!   per non-zero byte;
//! - its words: 8,192 bytes.
//!
//! What leaves the compute node (a bitmap's zstd frame, the window of a
//! slice) is the same as from whole words: packing changes what is held,
//! not what is sent, nor what a storage node probes.

use std::sync::Arc;

use crate::KEY_BITMAP_CHUNK_WORDS;

/// Mask words of a chunk held as bytes: one bit per byte of its words.
const MASK_WORDS: usize = KEY_BITMAP_CHUNK_WORDS * 8 / 64;

/// Bytes of a chunk held as bytes, beyond the bytes themselves.
const BYTES_OVERHEAD: usize = MASK_WORDS * 8 + MASK_WORDS * 2;

/// A bitmap's words: whole, or packed.
#[derive(Debug, Clone)]
pub enum KeyWords {
    /// Every word, as one vector.
    Whole(Arc<Vec<u64>>),
    /// Chunk by chunk, each in its smallest form.
    Packed(Arc<PackedWords>),
}

impl From<Vec<u64>> for KeyWords {
    fn from(words: Vec<u64>) -> Self {
        Self::Whole(Arc::new(words))
    }
}

impl From<Arc<Vec<u64>>> for KeyWords {
    fn from(words: Arc<Vec<u64>>) -> Self {
        Self::Whole(words)
    }
}

impl From<Arc<PackedWords>> for KeyWords {
    fn from(words: Arc<PackedWords>) -> Self {
        Self::Packed(words)
    }
}

impl KeyWords {
    /// Number of words.
    pub fn len(&self) -> usize {
        match self {
            Self::Whole(words) => words.len(),
            Self::Packed(packed) => packed.len,
        }
    }

    /// No words.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Word `index` (below [`Self::len`]).
    #[inline]
    pub fn word(&self, index: usize) -> u64 {
        match self {
            Self::Whole(words) => words[index],
            Self::Packed(packed) => packed.word(index),
        }
    }

    /// The words, if held whole.
    pub fn whole(&self) -> Option<&Arc<Vec<u64>>> {
        match self {
            Self::Whole(words) => Some(words),
            Self::Packed(_) => None,
        }
    }

    /// Append words `from..to` to `out`.
    pub fn copy_to(&self, from: usize, to: usize, out: &mut Vec<u64>) {
        match self {
            Self::Whole(words) => out.extend_from_slice(&words[from..to]),
            Self::Packed(packed) => packed.copy_to(from, to, out),
        }
    }

    /// Bytes held (a whole bitmap's capacity).
    pub fn byte_len(&self) -> usize {
        match self {
            Self::Whole(words) => words.capacity() * 8,
            Self::Packed(packed) => packed.byte_len(),
        }
    }

    /// Number of bits set.
    pub fn count_ones(&self) -> u64 {
        match self {
            Self::Whole(words) => words.iter().map(|word| u64::from(word.count_ones())).sum(),
            Self::Packed(packed) => packed.count_ones(),
        }
    }

    /// Indices of the first and the last non-zero word.
    pub fn first_last_set(&self) -> Option<(usize, usize)> {
        match self {
            Self::Whole(words) => Some((
                words.iter().position(|word| *word != 0)?,
                words.iter().rposition(|word| *word != 0)?,
            )),
            Self::Packed(packed) => packed.first_last_set(),
        }
    }

    /// `f(index, word)` for every non-zero word, in order.
    pub fn for_each_set(&self, mut f: impl FnMut(usize, u64)) {
        match self {
            Self::Whole(words) => words
                .iter()
                .enumerate()
                .filter(|(_, word)| **word != 0)
                .for_each(|(index, word)| f(index, *word)),
            Self::Packed(packed) => packed.for_each_set(f),
        }
    }

    /// Whole words packed where that takes fewer bytes than
    /// `ratio_max` times theirs; packed words as they are.
    pub fn packed_if_smaller(self, ratio_max: f64) -> Self {
        let Self::Whole(words) = &self else {
            return self;
        };
        // Sized first: a dense bitmap is left whole without building its
        // packed copy (as words, up to the whole bitmap's bytes again).
        if PackedWords::packed_bytes(words) as f64 >= words.len() as f64 * 8.0 * ratio_max {
            return self;
        }
        Self::Packed(Arc::new(PackedWords::pack(words)))
    }
}

impl PartialEq for KeyWords {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Whole(a), Self::Whole(b)) => a == b,
            (Self::Packed(a), Self::Packed(b)) if Arc::ptr_eq(a, b) => true,
            _ => {
                self.len() == other.len() && (0..self.len()).all(|i| self.word(i) == other.word(i))
            }
        }
    }
}

impl Eq for KeyWords {}

impl std::hash::Hash for KeyWords {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // The same for both forms of the same words (they are equal).
        self.len().hash(state);
        self.count_ones().hash(state);
        if let Some((first, last)) = self.first_last_set() {
            (first, last, self.word(first), self.word(last)).hash(state);
        }
    }
}

/// Where one chunk's words are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// All zero.
    Zero,
    /// Its keys' offsets in the chunk, ascending: `offsets[start..end]`.
    Keys { start: u32, end: u32 },
    /// Its non-zero bytes from `bytes[start]`, which mask words
    /// `masks[mask * MASK_WORDS..]` (and ranks) place.
    Bytes { mask: u32, start: u32 },
    /// Its words from `words[start]`.
    Words { start: u32 },
}

/// A bitmap's words held chunk by chunk in the smallest of four forms (see
/// the [module](self)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedWords {
    /// Number of words.
    len: usize,
    chunks: Vec<Chunk>,
    offsets: Vec<u16>,
    masks: Vec<u64>,
    /// Per mask word, the mask bits set before it in its chunk.
    ranks: Vec<u16>,
    bytes: Vec<u8>,
    words: Vec<u64>,
}

impl PackedWords {
    /// What each chunk of `words` would take in its smallest form.
    fn chunk_sizes(words: &[u64]) -> impl Iterator<Item = (usize, usize, usize, usize)> + '_ {
        words.chunks(KEY_BITMAP_CHUNK_WORDS).map(|chunk| {
            let keys: usize = chunk.iter().map(|word| word.count_ones() as usize).sum();
            let non_zero_bytes: usize = chunk
                .iter()
                .map(|word| word.to_le_bytes().iter().filter(|byte| **byte != 0).count())
                .sum();
            (
                keys,
                2 * keys,
                BYTES_OVERHEAD + non_zero_bytes,
                chunk.len() * 8,
            )
        })
    }

    /// Bytes [`Self::pack`] would hold for `words` (without its vectors'
    /// spare capacity, which it sheds), counted without building it.
    pub fn packed_bytes(words: &[u64]) -> usize {
        Self::chunk_sizes(words)
            .map(|(keys, as_keys, as_bytes, as_words)| {
                let data = if keys == 0 {
                    0
                } else if as_keys <= as_bytes && as_keys <= as_words {
                    as_keys
                } else {
                    as_bytes.min(as_words)
                };
                data + std::mem::size_of::<Chunk>()
            })
            .sum()
    }

    /// `words` packed.
    pub fn pack(words: &[u64]) -> Self {
        let mut packed = Self {
            len: words.len(),
            chunks: Vec::with_capacity(words.len().div_ceil(KEY_BITMAP_CHUNK_WORDS)),
            offsets: Vec::new(),
            masks: Vec::new(),
            ranks: Vec::new(),
            bytes: Vec::new(),
            words: Vec::new(),
        };
        for (chunk, (keys, as_keys, as_bytes, as_words)) in words
            .chunks(KEY_BITMAP_CHUNK_WORDS)
            .zip(Self::chunk_sizes(words))
        {
            let form = if keys == 0 {
                Chunk::Zero
            } else if as_keys <= as_bytes && as_keys <= as_words {
                let start = packed.offsets.len() as u32;
                for (index, word) in chunk.iter().enumerate() {
                    let mut rest = *word;
                    while rest != 0 {
                        packed
                            .offsets
                            .push((index * 64) as u16 | rest.trailing_zeros() as u16);
                        rest &= rest - 1;
                    }
                }
                Chunk::Keys {
                    start,
                    end: packed.offsets.len() as u32,
                }
            } else if as_bytes < as_words {
                let mask = (packed.masks.len() / MASK_WORDS) as u32;
                let start = packed.bytes.len() as u32;
                let mut masks = [0u64; MASK_WORDS];
                for (index, word) in chunk.iter().enumerate() {
                    for (at, byte) in word.to_le_bytes().into_iter().enumerate() {
                        if byte != 0 {
                            let bit = index * 8 + at;
                            masks[bit / 64] |= 1 << (bit % 64);
                            packed.bytes.push(byte);
                        }
                    }
                }
                let mut rank = 0u16;
                for mask in masks {
                    packed.ranks.push(rank);
                    rank += mask.count_ones() as u16;
                }
                packed.masks.extend_from_slice(&masks);
                Chunk::Bytes { mask, start }
            } else {
                let start = packed.words.len() as u32;
                packed.words.extend_from_slice(chunk);
                Chunk::Words { start }
            };
            packed.chunks.push(form);
        }
        packed.offsets.shrink_to_fit();
        packed.masks.shrink_to_fit();
        packed.ranks.shrink_to_fit();
        packed.bytes.shrink_to_fit();
        packed.words.shrink_to_fit();
        packed
    }

    /// Bytes held.
    pub fn byte_len(&self) -> usize {
        self.chunks.capacity() * std::mem::size_of::<Chunk>()
            + self.offsets.capacity() * 2
            + self.masks.capacity() * 8
            + self.ranks.capacity() * 2
            + self.bytes.capacity()
            + self.words.capacity() * 8
    }

    /// Word `index` (below `len`).
    #[inline]
    pub fn word(&self, index: usize) -> u64 {
        let at = index % KEY_BITMAP_CHUNK_WORDS;
        match self.chunks[index / KEY_BITMAP_CHUNK_WORDS] {
            Chunk::Zero => 0,
            Chunk::Keys { start, end } => {
                let keys = &self.offsets[start as usize..end as usize];
                let low = (at * 64) as u16;
                let first = keys.partition_point(|key| *key < low);
                keys[first..]
                    .iter()
                    .take_while(|key| (**key as usize) / 64 == at)
                    .fold(0, |word, key| word | 1 << (key % 64))
            }
            Chunk::Bytes { mask, start } => {
                let mask_word = mask as usize * MASK_WORDS + at / 8;
                let shift = (at % 8) * 8;
                let bits = self.masks[mask_word];
                let mut present = (bits >> shift) & 0xFF;
                if present == 0 {
                    return 0;
                }
                let mut next = start as usize
                    + usize::from(self.ranks[mask_word])
                    + (bits & ((1u64 << shift) - 1)).count_ones() as usize;
                let mut word = 0u64;
                while present != 0 {
                    let byte = present.trailing_zeros();
                    word |= u64::from(self.bytes[next]) << (8 * byte);
                    next += 1;
                    present &= present - 1;
                }
                word
            }
            Chunk::Words { start } => self.words[start as usize + at],
        }
    }

    /// Append words `from..to` to `out`.
    pub fn copy_to(&self, from: usize, to: usize, out: &mut Vec<u64>) {
        out.reserve(to.saturating_sub(from));
        let mut index = from;
        while index < to {
            let chunk = index / KEY_BITMAP_CHUNK_WORDS;
            let chunk_end = ((chunk + 1) * KEY_BITMAP_CHUNK_WORDS).min(to);
            match self.chunks[chunk] {
                Chunk::Zero => out.resize(out.len() + (chunk_end - index), 0),
                Chunk::Words { start } => {
                    let first = start as usize + index % KEY_BITMAP_CHUNK_WORDS;
                    out.extend_from_slice(&self.words[first..first + (chunk_end - index)]);
                }
                Chunk::Keys { start, end } => {
                    let base = out.len();
                    let first_word = index % KEY_BITMAP_CHUNK_WORDS;
                    out.resize(base + (chunk_end - index), 0);
                    for key in &self.offsets[start as usize..end as usize] {
                        let word = *key as usize / 64;
                        if word >= first_word && word < first_word + (chunk_end - index) {
                            out[base + word - first_word] |= 1 << (key % 64);
                        }
                    }
                }
                Chunk::Bytes { .. } => out.extend((index..chunk_end).map(|at| self.word(at))),
            }
            index = chunk_end;
        }
    }

    fn count_ones(&self) -> u64 {
        self.chunks
            .iter()
            .map(|chunk| match *chunk {
                Chunk::Zero => 0,
                Chunk::Keys { start, end } => u64::from(end - start),
                Chunk::Bytes { .. } => 0,
                Chunk::Words { .. } => 0,
            })
            .sum::<u64>()
            + self
                .bytes
                .iter()
                .map(|byte| u64::from(byte.count_ones()))
                .sum::<u64>()
            + self
                .words
                .iter()
                .map(|word| u64::from(word.count_ones()))
                .sum::<u64>()
    }

    fn first_last_set(&self) -> Option<(usize, usize)> {
        let set_in = |chunk: usize, last: bool| -> Option<usize> {
            let first = chunk * KEY_BITMAP_CHUNK_WORDS;
            let end = (first + KEY_BITMAP_CHUNK_WORDS).min(self.len);
            if last {
                (first..end).rev().find(|&index| self.word(index) != 0)
            } else {
                (first..end).find(|&index| self.word(index) != 0)
            }
        };
        let first = self.chunks.iter().position(|chunk| *chunk != Chunk::Zero)?;
        let last = self
            .chunks
            .iter()
            .rposition(|chunk| *chunk != Chunk::Zero)?;
        Some((set_in(first, false)?, set_in(last, true)?))
    }

    fn for_each_set(&self, mut f: impl FnMut(usize, u64)) {
        let mut buffer = Vec::with_capacity(KEY_BITMAP_CHUNK_WORDS);
        for (chunk, form) in self.chunks.iter().enumerate() {
            if *form == Chunk::Zero {
                continue;
            }
            let first = chunk * KEY_BITMAP_CHUNK_WORDS;
            buffer.clear();
            self.copy_to(
                first,
                (first + KEY_BITMAP_CHUNK_WORDS).min(self.len),
                &mut buffer,
            );
            for (at, word) in buffer.iter().enumerate() {
                if *word != 0 {
                    f(first + at, *word);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Words of every form: zero chunks, a few keys, TPC-H-like order keys
    /// (8 values of 32, some of them), dense words, and a short last chunk.
    fn words() -> Vec<u64> {
        let chunk = KEY_BITMAP_CHUNK_WORDS;
        let mut words = vec![0u64; 6 * chunk + 100];
        // Chunk 1: a few keys, at both ends of words and of the chunk.
        for bit in [0usize, 63, 64, 1000, 65_535] {
            words[chunk + bit / 64] |= 1 << (bit % 64);
        }
        // Chunk 2: order keys, half of them.
        let mut state = 7u64;
        for value in 0..chunk * 64 {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            if value % 32 < 8 && state >> 63 == 1 {
                words[2 * chunk + value / 64] |= 1 << (value % 64);
            }
        }
        // Chunk 3: dense.
        for (index, word) in words[3 * chunk..4 * chunk].iter_mut().enumerate() {
            *word = (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        }
        // Chunk 6 (short): one key in its last word.
        let last = words.len() - 1;
        words[last] = 1 << 63;
        words
    }

    #[test]
    fn packed_words_read_back_as_they_were_each_chunk_in_its_smallest_form() {
        let words = words();
        let packed = PackedWords::pack(&words);
        let forms: Vec<&str> = packed
            .chunks
            .iter()
            .map(|chunk| match chunk {
                Chunk::Zero => "zero",
                Chunk::Keys { .. } => "keys",
                Chunk::Bytes { .. } => "bytes",
                Chunk::Words { .. } => "words",
            })
            .collect();
        assert_eq!(
            forms,
            ["zero", "keys", "bytes", "words", "zero", "zero", "keys"]
        );
        for (index, word) in words.iter().enumerate() {
            assert_eq!(packed.word(index), *word, "word {index}");
        }
        for (from, to) in [
            (0, words.len()),
            (1000, 3000),
            (2 * 1024 + 5, 2 * 1024 + 6),
            (7, 7),
        ] {
            let mut out = vec![42];
            packed.copy_to(from, to, &mut out);
            assert_eq!(out[0], 42);
            assert_eq!(&out[1..], &words[from..to], "words {from}..{to}");
        }
        assert_eq!(PackedWords::packed_bytes(&words), packed.byte_len());
        let whole = KeyWords::from(words.clone());
        let packed = KeyWords::from(Arc::new(packed));
        assert_eq!(packed.count_ones(), whole.count_ones());
        assert_eq!(packed.first_last_set(), whole.first_last_set());
        let (mut a, mut b) = (Vec::new(), Vec::new());
        whole.for_each_set(|index, word| a.push((index, word)));
        packed.for_each_set(|index, word| b.push((index, word)));
        assert_eq!(a, b);
        assert_eq!(packed, whole);
        assert!(
            packed.byte_len() < whole.byte_len() / 2,
            "{}",
            packed.byte_len()
        );
    }

    #[test]
    fn dense_words_stay_whole_and_empty_ones_pack_to_nothing() {
        let dense: Vec<u64> = (0..3000u64)
            .map(|i| i << 8 | 0x0101_0101_0101_0101)
            .collect();
        let kept = KeyWords::from(dense.clone()).packed_if_smaller(0.75);
        assert!(kept.whole().is_some());
        let empty = KeyWords::from(vec![0u64; 5000]).packed_if_smaller(0.75);
        assert!(empty.whole().is_none());
        assert_eq!(empty.count_ones(), 0);
        assert_eq!(empty.first_last_set(), None);
        assert_eq!(empty.word(4999), 0);
    }
}
