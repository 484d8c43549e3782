//! The build-side keys of a hash join, collected as they stream into it.
//!
//! DataFusion's hash join hands its keys to the probe side inside its dynamic
//! filter: as an IN list (one literal expression per key, which for a few
//! hundred thousand keys costs more compute-node CPU than the join saves) or
//! as a lookup into its hash table (which cannot leave the process). Sieve
//! keeps DataFusion's filter for what it does cheaply (the key range, small
//! lists, and the moment the build side is complete) and takes the key values
//! for its Bloom filters from a [`BuildKeysExec`] placed on the join's build
//! input: a pass-through that evaluates the join's build-side key expressions
//! on each batch on its way into the hash table.
//!
//! ```text
//!        HashJoinExec ──dynamic filter (range, "complete")──> SieveScanExec (probe)
//!        /          \                                            ^
//!  BuildKeysExec     probe side ...                              |
//!        |  └──── distinct keys per key column ──────────────────┘ (Bloom / list)
//!   build side ...
//! ```
//!
//! Every consumer of the keys ([`crate::join_filter`]) reads them one key
//! column at a time, as a set: its range and a membership test. So the
//! collector keeps each column's *distinct* values, not the build rows:
//! it compacts a column (sorting integers, hashing the row encoding of
//! anything else) whenever the values added since the last compaction
//! outnumber the distinct ones kept, which costs amortized about two sorts
//! of the distinct keys. TPC-H Q9's partsupp join (8 M rows at SF 10 on
//! `(ps_suppkey, ps_partkey)`) keeps 2.1 M values instead of 16 M.
//!
//! An integer column past a quarter of `sieve.join_filter_keys_max`
//! distinct keys whose range takes fewer bytes as one bit per value goes
//! over to a [`KeyBits`] bitmap: it grows with the keys' range, not their
//! number, up to [`KEY_BITMAP_BYTES_MAX`]. TPC-H Q9's orders join at SF 100
//! has about 30 M distinct order keys over 600 M values: 75 MB as a bitmap,
//! about 240 MB as values (past the bound, which left the join filter
//! without a membership test). Once the build side is complete, integer
//! keys whose bitmap takes at most twice their bytes go over to one however
//! few they are, and a bitmap sheds the room it kept for growing: the join
//! filter's key bitmap then shares the collector's words instead of holding
//! a second copy (TPC-H Q21 at SF 100 held each of its 75 MB order-key
//! bitmaps twice, as the collector's words and the filter's copy of them,
//! or beside the 56 MB of values it was made from). Those words are then
//! packed chunk by chunk where that takes at most three quarters of their
//! bytes ([`KeyWords`]): TPC-H's order keys use 8 values in 32, and Q21's
//! three bitmaps of 75 MB at SF 100 are held in 13 to 22 MB each.
//!
//! What it holds is counted in the session's memory pool (an unspillable
//! consumer, `BuildKeys`), not in the statement's own bound
//! (`sieve.query_memory_limit`, [`crate::memory`]): it is bounded by its
//! own settings instead, and worth far more than the memory it takes. In
//! the statement's fair pool, spilling joins and aggregations take the
//! whole bound between them, and the keys were refused: TPC-H Q9 at SF 100
//! under a 1 GB pool shipped and probed all 150 M orders instead of 29 M
//! for want of a 75 MB bitmap (join time 13.5 -> 81 s); registered as a
//! consumer that can spill, for a fair share, Q3 lost its orders keys and
//! shipped 3.1 GB instead of 220 MB. It stops collecting, and the join
//! filter goes without a membership test, when a column of values holds
//! more than `sieve.join_filter_keys_max` distinct keys, a bitmap's range
//! would pass its bound, or the pool refuses the memory: the keys only
//! make a filter better, the join is exact without them.

use std::fmt;
use std::sync::{Arc, Mutex};

use arrow::array::{Array, ArrayRef, ArrowPrimitiveType, AsArray, PrimitiveArray};
use arrow::compute::concat;
use arrow::datatypes::{
    DataType, Date32Type, Date64Type, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type,
    UInt32Type, UInt64Type, UInt8Type,
};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{internal_err, DataFusionError, Result, Statistics};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryPool, MemoryReservation};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::statistics::{ChildStats, StatisticsArgs};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use futures::StreamExt;
use sieve_fragment::{KeyWords, KEY_BITMAP_BYTES_MAX};

/// The keys one hash join's build side produced, per key column.
#[derive(Debug)]
pub struct BuildKeys {
    /// Partitions of the build input; the keys are complete once every one
    /// has been read to its end.
    partitions: usize,
    /// Distinct keys per column past which collecting stops (the keys are
    /// then not usable).
    keys_max: usize,
    state: Mutex<KeysState>,
    /// Woken when a partition finishes.
    finished: tokio::sync::Notify,
    /// Some partition of the join spilled its build side to disk and gave
    /// up its part of DataFusion's filter ([`crate::SpillableHashJoinExec`]).
    spilled: std::sync::atomic::AtomicBool,
}

/// A complete column of integer keys goes over to a bitmap that takes at
/// most this many times their bytes as values (see
/// [`BuildKeys::finish_partition`]).
const FINISHED_BITS_PER_VALUES: usize = 2;

/// Values added since a column's last compaction below which it is not
/// compacted again (sorting fewer costs more in calls than it saves).
const COMPACT_ROWS_MIN: usize = 1 << 16;

#[derive(Debug, Default)]
struct KeysState {
    columns: Vec<KeyColumn>,
    /// Build rows seen.
    rows: usize,
    finished: usize,
    /// Why collecting stopped, if it did.
    stopped: Option<Stopped>,
    /// What the kept values take, in the query's memory pool.
    reservation: Option<MemoryReservation>,
}

/// Why a collector stopped keeping keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stopped {
    /// A column has more distinct keys than `sieve.join_filter_keys_max`.
    TooManyKeys,
    /// The memory pool refused the bytes.
    MemoryRefused,
    /// A column's keys went over to a bitmap, and a later key widened its
    /// range past [`KEY_BITMAP_BYTES_MAX`].
    RangeTooWide,
    /// A build partition's stream was dropped before its end: its keys are
    /// unknown.
    PartitionDropped,
}

/// One key column's values: those distinct ones a compaction left, and
/// those added since; or, once an integer column holds many keys in a
/// range narrow enough, a bitmap of them.
#[derive(Debug, Default)]
struct KeyColumn {
    distinct: Option<ArrayRef>,
    pending: Vec<ArrayRef>,
    pending_rows: usize,
    /// A compaction of this column runs outside the lock.
    compacting: bool,
    /// The keys as a bitmap (then `distinct` and `pending` are empty, and
    /// each batch's keys are set in it as they pass).
    bits: Option<Arc<KeyBits>>,
}

impl KeyColumn {
    fn distinct_rows(&self) -> usize {
        self.distinct.as_ref().map_or(0, |array| array.len())
    }

    fn wants_compaction(&self) -> bool {
        self.bits.is_none()
            && !self.compacting
            && self.pending_rows >= self.distinct_rows().max(COMPACT_ROWS_MIN)
    }

    fn bytes(&self) -> usize {
        self.distinct
            .iter()
            .chain(&self.pending)
            .map(|array| array.get_array_memory_size())
            .sum::<usize>()
            + self.bits.as_ref().map_or(0, |bits| bits.bytes())
    }

    fn keys(&self) -> ColumnKeys {
        match &self.bits {
            Some(bits) => ColumnKeys::Bits(Arc::clone(bits)),
            None => {
                ColumnKeys::Values(self.distinct.iter().chain(&self.pending).cloned().collect())
            }
        }
    }

    /// After a compaction: an integer column of more than `switch_keys`
    /// distinct keys whose range takes at most `values_ratio` times their
    /// bytes as a bitmap goes over to a bitmap, which no longer grows with
    /// the keys, only with their range (bounded by
    /// [`KEY_BITMAP_BYTES_MAX`]).
    fn maybe_to_bits(&mut self, switch_keys: usize, values_ratio: usize) {
        let Some(distinct) = &self.distinct else {
            return;
        };
        if self.bits.is_some() || distinct.len() <= switch_keys {
            return;
        }
        let Some((low, high)) = KeyBits::bounds(distinct) else {
            return;
        };
        let bitmap_bytes = KeyBits::span_words(low, high).saturating_mul(8);
        if bitmap_bytes > KEY_BITMAP_BYTES_MAX
            || bitmap_bytes
                > distinct
                    .get_array_memory_size()
                    .saturating_mul(values_ratio)
        {
            return;
        }
        let mut bits = KeyBits::new(distinct.data_type().clone(), low, high);
        bits.insert(distinct);
        for array in &self.pending {
            if !bits.insert(array) {
                // A pending key widens the range past the bound: stay
                // with values.
                return;
            }
        }
        self.bits = Some(Arc::new(bits));
        self.distinct = None;
        self.pending.clear();
        self.pending_rows = 0;
    }
}

/// A key column's distinct integer keys as a bitmap: bit `i` of word `w`
/// stands for the value `base + 64 * w + i`. It grows to take keys outside
/// its range, up to [`KEY_BITMAP_BYTES_MAX`].
#[derive(Debug, Clone)]
pub struct KeyBits {
    /// The build keys' type (the values are its integers, widened to i64).
    data_type: DataType,
    /// A multiple of 64.
    base: i64,
    /// Shared, once the keys are complete, with the key bitmap made of
    /// them ([`Self::trimmed`]): one copy of a 75 MB bitmap, not two.
    /// Whole while keys arrive; once complete, packed where that takes
    /// fewer bytes ([`KeyWords::packed_if_smaller`]).
    words: KeyWords,
}

/// A complete bitmap's words are packed if that takes at most this share
/// of their bytes: TPC-H Q21's three order-key bitmaps at SF 100 take
/// 75 MB each whole. Packed words cost more per look-up, but the compute
/// node only cuts windows from them and compresses them for the wire.
const PACKED_BYTES_RATIO_MAX: f64 = 0.75;

impl KeyBits {
    /// An empty bitmap covering `[low, high]`.
    fn new(data_type: DataType, low: i64, high: i64) -> Self {
        let base = low.div_euclid(64).saturating_mul(64);
        Self {
            data_type,
            base,
            words: vec![0; Self::span_words(base, high)].into(),
        }
    }

    /// Words covering `[low, high]` from a multiple of 64 at or below `low`.
    fn span_words(low: i64, high: i64) -> usize {
        let base = i128::from(low.div_euclid(64)) * 64;
        usize::try_from((i128::from(high) - base) / 64 + 1).unwrap_or(usize::MAX)
    }

    /// Smallest and largest non-NULL value of an integer array; `None` for
    /// other types (UInt64 included: not every value is an i64) or no value.
    fn bounds(array: &ArrayRef) -> Option<(i64, i64)> {
        let mut found: Option<(i64, i64)> = None;
        each_integer(array, |value| {
            found = Some(match found {
                None => (value, value),
                Some((low, high)) => (low.min(value), high.max(value)),
            });
        })?;
        found
    }

    /// Set the bits of `array`'s non-NULL values, growing the range to take
    /// them; `false` (nothing set) if the range would pass
    /// [`KEY_BITMAP_BYTES_MAX`] or the array is not of integers.
    fn insert(&mut self, array: &ArrayRef) -> bool {
        let Some((low, high)) = Self::bounds(array) else {
            return array.null_count() == array.len();
        };
        let top = self
            .base
            .saturating_add((self.words.len() as i64).saturating_mul(64) - 1);
        let (low, high) = (low.min(self.base), high.max(top));
        let words = Self::span_words(low, high);
        if words.saturating_mul(8) > KEY_BITMAP_BYTES_MAX {
            return false;
        }
        let base = low.div_euclid(64).saturating_mul(64);
        let self_words = Self::whole_words(&mut self.words);
        if base < self.base {
            // Keys below the range: shift the words up, with room for more
            // below (up to half the words again) so that keys arriving in
            // descending order do not copy the bitmap each time.
            let needed = usize::try_from((self.base - base) / 64).unwrap_or(usize::MAX);
            let room = (self_words.len() / 2)
                .min(KEY_BITMAP_BYTES_MAX / 8 - words)
                .min(usize::try_from((i128::from(base) - i128::from(i64::MIN)) / 64).unwrap_or(0));
            let prepend = needed + room;
            let mut grown = vec![0u64; prepend + self_words.len()];
            grown[prepend..].copy_from_slice(self_words);
            *self_words = grown;
            self.base -= (prepend as i64) * 64;
        }
        let needed = Self::span_words(self.base, high);
        if needed > self_words.capacity() {
            // Doubling, as a vector does, but never past the bound. (Only
            // past the capacity: keys arriving in ascending order, as a
            // table sorted by its key sends them, passed the length with
            // every batch, and the capacity doubled each time up to the
            // bound, 128 MiB held in the pool for a bitmap of 500 KB.)
            let target = (self_words.capacity() * 2).clamp(needed, KEY_BITMAP_BYTES_MAX / 8);
            self_words.reserve_exact(target - self_words.len());
        }
        if needed > self_words.len() {
            self_words.resize(needed, 0);
        }
        let (base, words) = (self.base, self_words.as_mut_slice());
        each_integer(array, |value| {
            let offset = (value - base) as u64;
            words[(offset >> 6) as usize] |= 1 << (offset & 63);
        });
        true
    }

    /// The words, whole, to change them (unpacked if they were packed).
    fn whole_words(words: &mut KeyWords) -> &mut Vec<u64> {
        if words.whole().is_none() {
            let mut whole = Vec::new();
            words.copy_to(0, words.len(), &mut whole);
            *words = whole.into();
        }
        match words {
            KeyWords::Whole(words) => Arc::make_mut(words),
            KeyWords::Packed(_) => unreachable!("unpacked above"),
        }
    }

    /// Bytes of the words.
    pub fn bytes(&self) -> usize {
        self.words.byte_len()
    }

    /// The build keys' type.
    pub fn data_type(&self) -> &DataType {
        &self.data_type
    }

    /// Number of keys set.
    pub fn keys(&self) -> u64 {
        self.words.count_ones()
    }

    /// The smallest and largest key, if any.
    pub fn low_high(&self) -> Option<(i64, i64)> {
        let (first, last) = self.words.first_last_set()?;
        Some((
            self.base + 64 * first as i64 + i64::from(self.words.word(first).trailing_zeros()),
            self.base + 64 * last as i64 + 63 - i64::from(self.words.word(last).leading_zeros()),
        ))
    }

    /// Drop the words before the one holding the smallest key and after
    /// the one holding the largest, and the capacity kept for growing, in
    /// place, and pack them where that takes fewer bytes: done once the
    /// keys are complete, so that [`Self::trimmed`] shares the words
    /// instead of copying them.
    fn trim(&mut self) {
        let words = Self::whole_words(&mut self.words);
        let Some(first) = words.iter().position(|word| *word != 0) else {
            *words = Vec::new();
            return;
        };
        let last = words
            .iter()
            .rposition(|word| *word != 0)
            .expect("a word is set");
        words.truncate(last + 1);
        words.drain(..first);
        words.shrink_to_fit();
        self.base += 64 * first as i64;
        self.words = self.words.clone().packed_if_smaller(PACKED_BYTES_RATIO_MAX);
    }

    /// The words from the one holding the smallest key to the one holding
    /// the largest, with the value of their first bit and the number of
    /// values from it to the largest key: what a key bitmap is made of.
    /// Shared with this bitmap once [trimmed](Self::trim), else copied.
    pub fn trimmed(&self) -> Option<(i64, u64, KeyWords)> {
        let (low, high) = self.low_high()?;
        let first = usize::try_from((low - self.base) / 64).ok()?;
        let last = usize::try_from((high - self.base) / 64).ok()?;
        let base = self.base + 64 * first as i64;
        let words = if first == 0 && last + 1 == self.words.len() {
            self.words.clone()
        } else {
            let mut words = Vec::with_capacity(last + 1 - first);
            self.words.copy_to(first, last + 1, &mut words);
            words.into()
        };
        Some((base, (high - base) as u64 + 1, words))
    }

    /// The keys as an array of the build keys' type, ascending.
    pub fn values(&self) -> Result<ArrayRef> {
        let mut values = Vec::new();
        self.words.for_each_set(|index, mut word| {
            while word != 0 {
                values.push(self.base + 64 * index as i64 + i64::from(word.trailing_zeros()));
                word &= word - 1;
            }
        });
        let values: ArrayRef = Arc::new(PrimitiveArray::<Int64Type>::from_iter_values(values));
        let values = match self.data_type {
            // Dates of days are 32-bit integers.
            DataType::Date32 => arrow::compute::cast(&values, &DataType::Int32)?,
            _ => values,
        };
        Ok(arrow::compute::cast(&values, &self.data_type)?)
    }
}

/// `f(value)` for each non-NULL value of an integer or date array, widened
/// to i64; `None` for any other type (UInt64 among them).
fn each_integer(array: &ArrayRef, mut f: impl FnMut(i64)) -> Option<()> {
    macro_rules! each {
        ($arrow:ty) => {{
            array
                .as_primitive::<$arrow>()
                .iter()
                .flatten()
                .for_each(|value| f(i64::from(value)));
            Some(())
        }};
    }
    match array.data_type() {
        DataType::Int8 => each!(Int8Type),
        DataType::Int16 => each!(Int16Type),
        DataType::Int32 => each!(Int32Type),
        DataType::Int64 => each!(Int64Type),
        DataType::UInt8 => each!(UInt8Type),
        DataType::UInt16 => each!(UInt16Type),
        DataType::UInt32 => each!(UInt32Type),
        DataType::Date32 => each!(Date32Type),
        DataType::Date64 => each!(Date64Type),
        _ => None,
    }
}

/// One key column's keys once the build side is complete.
#[derive(Debug, Clone)]
pub enum ColumnKeys {
    /// Values, distinct within each array, possibly repeated across them.
    Values(Vec<ArrayRef>),
    /// Integer keys as a bitmap.
    Bits(Arc<KeyBits>),
}

/// What the collector holds once the build side is complete.
#[derive(Debug, Clone)]
pub enum CollectedKeys {
    /// Each key column's keys, in join key order.
    Keys(Vec<ColumnKeys>),
    /// More distinct keys than the collector keeps, after this many build
    /// rows.
    TooMany(usize),
    /// The memory pool refused the keys, after this many build rows.
    MemoryRefused(usize),
    /// A column's keys, kept as a bitmap, spread over a range wider than a
    /// bitmap may be, after this many build rows.
    TooWide(usize),
    /// A build partition was dropped before its end (its join partition
    /// was never run, or the query was cancelled), after this many build
    /// rows.
    PartitionDropped(usize),
    /// Some build partition has not been read to its end.
    Incomplete,
}

impl BuildKeys {
    /// A collector for a build side of `partitions` partitions and
    /// `key_columns` keys, keeping at most `keys_max` distinct keys per
    /// column.
    pub fn new(partitions: usize, key_columns: usize, keys_max: usize) -> Self {
        Self {
            partitions,
            keys_max,
            state: Mutex::new(KeysState {
                columns: (0..key_columns).map(|_| KeyColumn::default()).collect(),
                ..KeysState::default()
            }),
            finished: tokio::sync::Notify::new(),
            spilled: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Record that a partition of the join spilled its build side (before
    /// it gives up its part of DataFusion's filter).
    pub fn mark_spilled(&self) {
        self.spilled
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether a partition of the join spilled its build side.
    pub fn spilled(&self) -> bool {
        self.spilled.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Count a build partition that will not be read to its end: its
    /// stream was dropped first, or never made (a join partition that
    /// nothing polled, see `SpillableHashJoinExec`). Its keys are unknown,
    /// so the keys make no membership test; waiters wake as for a partition
    /// that finished.
    pub fn abandon_partition(&self) {
        {
            let mut state = self.state.lock().expect("never poisoned");
            state.finished += 1;
            if state.stopped.is_none() {
                self.stop(&mut state, Stopped::PartitionDropped);
            }
        }
        self.finished.notify_waiters();
    }

    /// Returns once every build partition has been read to its end (never,
    /// if the build side fails: callers bound the wait).
    pub async fn wait_complete(&self) {
        loop {
            // Created before the check, so a partition finishing in between
            // still wakes it (`Notify::notify_waiters`).
            let finished = self.finished.notified();
            if self.state.lock().expect("never poisoned").finished >= self.partitions {
                return;
            }
            finished.await;
        }
    }

    /// Add one build batch's key arrays; `pool` is the query's memory pool.
    fn push(&self, keys: Vec<ArrayRef>, pool: &Arc<dyn MemoryPool>) -> Result<()> {
        let rows = keys.first().map_or(0, |array| array.len());
        let mut to_compact = Vec::new();
        {
            let mut state = self.state.lock().expect("never poisoned");
            state.rows += rows;
            if state.stopped.is_some() || rows == 0 {
                return Ok(());
            }
            if state.reservation.is_none() {
                state.reservation = Some(MemoryConsumer::new("BuildKeys").register(pool));
            }
            let mut too_wide = false;
            for (index, (column, array)) in state.columns.iter_mut().zip(keys).enumerate() {
                if let Some(bits) = column.bits.as_mut() {
                    too_wide |= !Arc::make_mut(bits).insert(&array);
                    continue;
                }
                column.pending_rows += array.len();
                column.pending.push(array);
                if column.wants_compaction() {
                    column.compacting = true;
                    to_compact.push((
                        index,
                        column.distinct.take(),
                        std::mem::take(&mut column.pending),
                    ));
                    column.pending_rows = 0;
                }
            }
            if too_wide {
                self.stop(&mut state, Stopped::RangeTooWide);
                return Ok(());
            }
            if to_compact.is_empty() {
                self.account(&mut state);
                return Ok(());
            }
        }
        // Sorting millions of keys under the lock would stall the other
        // build partitions: compact outside it, values added meanwhile wait
        // in `pending`.
        let mut compacted = Vec::with_capacity(to_compact.len());
        for (index, distinct, pending) in to_compact {
            compacted.push((index, compact(distinct, &pending)));
        }
        let mut state = self.state.lock().expect("never poisoned");
        let mut failed = None;
        let stopped = state.stopped.is_some();
        for (index, result) in compacted {
            let column = &mut state.columns[index];
            column.compacting = false;
            match result {
                // Stopped meanwhile: the keys are no longer kept.
                Ok(_) if stopped => {}
                Ok(distinct) => {
                    column.distinct = Some(distinct);
                    column.maybe_to_bits(self.bits_after_keys(), 1);
                }
                Err(error) => failed = Some(error),
            }
        }
        if let Some(error) = failed {
            return Err(error);
        }
        if !stopped {
            self.account(&mut state);
        }
        Ok(())
    }

    /// Distinct keys of an integer column past which it may go over to a
    /// bitmap: a quarter of `keys_max`, so that key sets a Bloom filter or
    /// a list would hold stay values, and those that would pass
    /// `keys_max` are a bitmap by then.
    fn bits_after_keys(&self) -> usize {
        self.keys_max / 4
    }

    /// Stop keeping keys, for `why`.
    fn stop(&self, state: &mut KeysState, why: Stopped) {
        state.stopped = Some(why);
        state.columns.iter_mut().for_each(|column| {
            column.distinct = None;
            column.pending.clear();
            column.pending_rows = 0;
            column.bits = None;
        });
        if let Some(reservation) = state.reservation.as_mut() {
            reservation.free();
        }
    }

    /// Stop if a column holds too many distinct keys, else reserve what the
    /// columns take (and stop if the pool refuses it).
    fn account(&self, state: &mut KeysState) {
        let too_many = state
            .columns
            .iter()
            .any(|column| column.distinct_rows() > self.keys_max);
        let bytes: usize = state.columns.iter().map(KeyColumn::bytes).sum();
        let stopped = if too_many {
            Some(Stopped::TooManyKeys)
        } else {
            match state
                .reservation
                .as_mut()
                .map(|reservation| reservation.try_resize(bytes))
            {
                Some(Err(_)) => Some(Stopped::MemoryRefused),
                _ => None,
            }
        };
        if let Some(why) = stopped {
            self.stop(state, why);
        }
    }

    /// Count a partition read to its end. After the last one, each column
    /// is compacted once more, so consumers read one distinct array per
    /// column (and a column past `keys_max` is found).
    fn finish_partition(&self) -> Result<()> {
        let result = {
            let mut state = self.state.lock().expect("never poisoned");
            state.finished += 1;
            if state.finished == self.partitions && state.stopped.is_none() {
                // Every partition's pushes have returned: no compaction is
                // in flight.
                let result = state.columns.iter_mut().try_for_each(|column| {
                    if !column.pending.is_empty() {
                        column.distinct = Some(compact(column.distinct.take(), &column.pending)?);
                        column.pending.clear();
                        column.pending_rows = 0;
                    }
                    // Complete: integer keys whose bitmap takes at most
                    // twice their bytes go over to one whatever their
                    // number, and a bitmap sheds the words it kept for
                    // growing, so that a join filter shares it. At that
                    // density (a key in 128 values or more) a filter of
                    // them is a bitmap (its compressed bytes are below a
                    // Bloom filter's), which it would otherwise build from
                    // the values: a second copy, held as long. TPC-H Q21 at
                    // SF 100 kept 7 M order keys twice so, 56 MB of values
                    // and a 75 MB bitmap.
                    column.maybe_to_bits(0, FINISHED_BITS_PER_VALUES);
                    if let Some(bits) = column.bits.as_mut() {
                        Arc::make_mut(bits).trim();
                    }
                    Ok::<_, DataFusionError>(())
                });
                self.account(&mut state);
                result
            } else {
                Ok(())
            }
        };
        self.finished.notify_waiters();
        result
    }

    /// The keys, if every build partition has been read to its end.
    pub fn collected(&self) -> CollectedKeys {
        let state = self.state.lock().expect("never poisoned");
        if state.finished < self.partitions {
            return CollectedKeys::Incomplete;
        }
        match state.stopped {
            Some(Stopped::TooManyKeys) => CollectedKeys::TooMany(state.rows),
            Some(Stopped::MemoryRefused) => CollectedKeys::MemoryRefused(state.rows),
            Some(Stopped::RangeTooWide) => CollectedKeys::TooWide(state.rows),
            Some(Stopped::PartitionDropped) => CollectedKeys::PartitionDropped(state.rows),
            None => CollectedKeys::Keys(state.columns.iter().map(KeyColumn::keys).collect()),
        }
    }

    /// Bytes the kept keys take (what the memory pool holds for them).
    pub fn bytes(&self) -> usize {
        let state = self.state.lock().expect("never poisoned");
        state
            .reservation
            .as_ref()
            .map_or(0, MemoryReservation::size)
    }
}

/// The distinct values of `distinct` (a previous compaction's result) and
/// `pending`. Integers and dates: `distinct` is sorted, so only `pending`
/// is sorted and the two are merged (each value is sorted about once, as
/// one sort of every key at the end would); anything else through
/// [`crate::join_filter::distinct`] over all of them.
fn compact(distinct: Option<ArrayRef>, pending: &[ArrayRef]) -> Result<ArrayRef> {
    let data_type = match (&distinct, pending.first()) {
        (Some(array), _) | (None, Some(array)) => array.data_type().clone(),
        (None, None) => return internal_err!("nothing to compact"),
    };
    macro_rules! merged {
        ($arrow:ty) => {
            return Ok(merge_sorted::<$arrow>(
                distinct.as_ref(),
                pending,
                &data_type,
            ))
        };
    }
    match data_type {
        DataType::Int8 => merged!(Int8Type),
        DataType::Int16 => merged!(Int16Type),
        DataType::Int32 => merged!(Int32Type),
        DataType::Int64 => merged!(Int64Type),
        DataType::UInt8 => merged!(UInt8Type),
        DataType::UInt16 => merged!(UInt16Type),
        DataType::UInt32 => merged!(UInt32Type),
        DataType::UInt64 => merged!(UInt64Type),
        DataType::Date32 => merged!(Date32Type),
        DataType::Date64 => merged!(Date64Type),
        _ => {}
    }
    let arrays: Vec<&dyn Array> = distinct
        .iter()
        .chain(pending)
        .map(|array| array.as_ref())
        .collect();
    crate::join_filter::distinct(&concat(&arrays)?)
}

/// `sorted` (distinct, ascending, no NULLs) merged with the distinct
/// non-NULL values of `pending`.
fn merge_sorted<T: ArrowPrimitiveType>(
    sorted: Option<&ArrayRef>,
    pending: &[ArrayRef],
    data_type: &DataType,
) -> ArrayRef
where
    T::Native: Ord,
{
    let mut added: Vec<T::Native> = pending
        .iter()
        .flat_map(|array| array.as_primitive::<T>().iter().flatten())
        .collect();
    added.sort_unstable();
    added.dedup();
    let old: &[T::Native] = sorted.map_or(&[], |array| array.as_primitive::<T>().values());
    let mut merged = Vec::with_capacity(old.len() + added.len());
    let (mut left, mut right) = (0, 0);
    while left < old.len() && right < added.len() {
        match old[left].cmp(&added[right]) {
            std::cmp::Ordering::Less => {
                merged.push(old[left]);
                left += 1;
            }
            std::cmp::Ordering::Greater => {
                merged.push(added[right]);
                right += 1;
            }
            std::cmp::Ordering::Equal => {
                merged.push(old[left]);
                left += 1;
                right += 1;
            }
        }
    }
    merged.extend_from_slice(&old[left..]);
    merged.extend_from_slice(&added[right..]);
    // The array takes the vector's buffer, capacity included.
    merged.shrink_to_fit();
    Arc::new(PrimitiveArray::<T>::from_iter_values(merged).with_data_type(data_type.clone()))
}

/// Passes its input through unchanged, handing the values of `keys` in every
/// batch to a [`BuildKeys`] collector.
#[derive(Debug)]
pub struct BuildKeysExec {
    input: Arc<dyn ExecutionPlan>,
    keys: Vec<Arc<dyn PhysicalExpr>>,
    collector: Arc<BuildKeys>,
}

impl BuildKeysExec {
    /// Collect `keys` (expressions over `input`'s schema) into `collector`.
    pub fn new(
        input: Arc<dyn ExecutionPlan>,
        keys: Vec<Arc<dyn PhysicalExpr>>,
        collector: Arc<BuildKeys>,
    ) -> Self {
        Self {
            input,
            keys,
            collector,
        }
    }
}

impl BuildKeysExec {
    /// Where the keys go.
    pub fn collector(&self) -> &Arc<BuildKeys> {
        &self.collector
    }
}

impl DisplayAs for BuildKeysExec {
    fn fmt_as(&self, _format: DisplayFormatType, formatter: &mut fmt::Formatter) -> fmt::Result {
        let keys: Vec<String> = self.keys.iter().map(|key| key.to_string()).collect();
        write!(
            formatter,
            "BuildKeysExec: join keys [{}] for the probe side's storage nodes",
            keys.join(", ")
        )
    }
}

impl ExecutionPlan for BuildKeysExec {
    fn name(&self) -> &str {
        "BuildKeysExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.input.properties()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        for key in &self.keys {
            if f(key)? == TreeNodeRecursion::Stop {
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        Ok(TreeNodeRecursion::Continue)
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let [input] = &children[..] else {
            return internal_err!("BuildKeysExec has one child");
        };
        Ok(Arc::new(Self {
            input: Arc::clone(input),
            keys: self.keys.clone(),
            collector: Arc::clone(&self.collector),
        }))
    }

    /// After a reset (a recursive CTE's term, run again) the join above has
    /// no dynamic filter and its probe scan no join filter (see
    /// `SieveScanExec::reset_state`): nothing would read the keys, so the
    /// tap removes itself.
    fn reset_state(self: Arc<Self>) -> Result<Arc<dyn ExecutionPlan>> {
        Ok(Arc::clone(&self.input))
    }

    fn child_stats_requests(&self, partition: Option<usize>) -> Vec<ChildStats> {
        vec![ChildStats::At(partition)]
    }

    fn statistics_from_inputs(
        &self,
        input_stats: &[Arc<Statistics>],
        _args: &StatisticsArgs,
    ) -> Result<Arc<Statistics>> {
        Ok(Arc::clone(&input_stats[0]))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let pool = crate::memory::session_pool(&context);
        let input = self.input.execute(partition, context)?;
        let schema = input.schema();
        let keys = self.keys.clone();
        let collector = Arc::clone(&self.collector);
        let mut finisher = PartitionEnd(Some(Arc::clone(&self.collector)));
        let tapped = input
            .map(move |batch| {
                let batch = batch?;
                let arrays = keys
                    .iter()
                    .map(|key| key.evaluate(&batch)?.into_array(batch.num_rows()))
                    .collect::<Result<Vec<_>>>()?;
                collector.push(arrays, &pool)?;
                Ok(batch)
            })
            .chain(futures::stream::poll_fn(move |_| {
                // Counted once, however often the ended stream is polled.
                match finisher
                    .0
                    .take()
                    .map(|finisher| finisher.finish_partition())
                {
                    Some(Err(error)) => std::task::Poll::Ready(Some(Err(error))),
                    _ => std::task::Poll::Ready(None),
                }
            }));
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, tapped)))
    }
}

/// Counts one build partition's end with its collector: read to the end
/// (taken by the stream), or dropped before it (on drop).
struct PartitionEnd(Option<Arc<BuildKeys>>);

impl Drop for PartitionEnd {
    fn drop(&mut self) {
        if let Some(collector) = self.0.take() {
            collector.abandon_partition();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use arrow::record_batch::RecordBatch;
    use datafusion::datasource::memory::MemorySourceConfig;
    use datafusion::physical_expr::expressions::Column;
    use datafusion::physical_plan::common::collect;

    fn input(partitions: Vec<Vec<i64>>) -> Arc<dyn ExecutionPlan> {
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)]));
        let batches: Vec<Vec<RecordBatch>> = partitions
            .into_iter()
            .map(|values| {
                vec![RecordBatch::try_new(
                    Arc::clone(&schema),
                    vec![Arc::new(Int64Array::from(values))],
                )
                .unwrap()]
            })
            .collect();
        MemorySourceConfig::try_new_exec(&batches, schema, None).unwrap()
    }

    #[tokio::test]
    async fn keys_are_complete_only_after_every_partition_and_rows_pass_unchanged() {
        let collector = Arc::new(BuildKeys::new(2, 1, 100));
        let tap = BuildKeysExec::new(
            input(vec![vec![1, 2, 2], vec![7]]),
            vec![Arc::new(Column::new("k", 0))],
            Arc::clone(&collector),
        );
        let context = Arc::new(TaskContext::default());
        let first = collect(tap.execute(0, Arc::clone(&context)).unwrap())
            .await
            .unwrap();
        assert_eq!(first[0].num_rows(), 3);
        assert!(matches!(collector.collected(), CollectedKeys::Incomplete));
        collect(tap.execute(1, context).unwrap()).await.unwrap();
        let CollectedKeys::Keys(columns) = collector.collected() else {
            panic!("complete after both partitions");
        };
        // One array of the distinct keys.
        let keys = values(&columns[0]);
        assert_eq!(keys.len(), 1);
        assert_eq!(sorted_i64(&keys[0]), vec![1, 2, 7]);
    }

    fn values(keys: &ColumnKeys) -> Vec<ArrayRef> {
        match keys {
            ColumnKeys::Values(arrays) => arrays.clone(),
            // Dense integer keys, complete.
            ColumnKeys::Bits(bits) => vec![bits.values().unwrap()],
        }
    }

    fn sorted_i64(array: &ArrayRef) -> Vec<i64> {
        let mut values: Vec<i64> = array
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap()
            .iter()
            .flatten()
            .collect();
        values.sort_unstable();
        values
    }

    /// Two key columns (an integer with NULLs, a string) over many batches
    /// with repeated keys, in two partitions.
    fn repeated_keys(
        batches: usize,
        rows: usize,
    ) -> (Arc<dyn ExecutionPlan>, Vec<Arc<dyn PhysicalExpr>>) {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, true),
            Field::new("s", DataType::Utf8, false),
        ]));
        let batch = |offset: usize| {
            let ints: Int64Array = (0..rows)
                .map(|row| {
                    let key = (offset + row) % 1000;
                    (!key.is_multiple_of(97)).then_some(key as i64)
                })
                .collect();
            let strings = StringArray::from_iter_values(
                (0..rows).map(|row| format!("name {}", (offset + row) % 300)),
            );
            RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(ints), Arc::new(strings)])
                .unwrap()
        };
        let partitions: Vec<Vec<RecordBatch>> = (0..2)
            .map(|partition| {
                (0..batches)
                    .map(|index| batch((partition * batches + index) * rows))
                    .collect()
            })
            .collect();
        let keys: Vec<Arc<dyn PhysicalExpr>> =
            vec![Arc::new(Column::new("k", 0)), Arc::new(Column::new("s", 1))];
        (
            MemorySourceConfig::try_new_exec(&partitions, schema, None).unwrap(),
            keys,
        )
    }

    fn context_with_pool(pool: Arc<dyn MemoryPool>) -> Arc<TaskContext> {
        let runtime = datafusion::execution::runtime_env::RuntimeEnvBuilder::new()
            .with_memory_pool(pool)
            .build_arc()
            .unwrap();
        Arc::new(TaskContext::default().with_runtime(runtime))
    }

    /// 300,000 build rows with 1,000 and 300 distinct keys: the collector
    /// keeps the distinct keys (NULLs left out), in the memory pool, and
    /// gives the memory back when the plan is dropped.
    #[tokio::test]
    async fn repeated_keys_are_kept_once_each_and_counted_in_the_pool() {
        let pool: Arc<dyn MemoryPool> = Arc::new(
            datafusion::execution::memory_pool::GreedyMemoryPool::new(64 << 20),
        );
        let context = context_with_pool(Arc::clone(&pool));
        let (input, keys) = repeated_keys(20, 7_500);
        let collector = Arc::new(BuildKeys::new(2, 2, 5_000));
        let tap = BuildKeysExec::new(input, keys, Arc::clone(&collector));
        let mut rows = 0;
        for partition in 0..2 {
            let batches = collect(tap.execute(partition, Arc::clone(&context)).unwrap())
                .await
                .unwrap();
            rows += batches.iter().map(RecordBatch::num_rows).sum::<usize>();
        }
        assert_eq!(rows, 300_000);
        let CollectedKeys::Keys(columns) = collector.collected() else {
            panic!("1,000 distinct keys are below the bound");
        };
        let expected: Vec<i64> = (0..1000).filter(|key| key % 97 != 0).collect();
        let (ints, strings) = (values(&columns[0]), values(&columns[1]));
        assert_eq!(ints.len(), 1);
        assert_eq!(sorted_i64(&ints[0]), expected);
        assert_eq!(strings.len(), 1);
        let mut names: Vec<String> = strings[0]
            .as_any()
            .downcast_ref::<StringArray>()
            .unwrap()
            .iter()
            .map(|name| name.unwrap().to_string())
            .collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), 300);
        assert_eq!(strings[0].len(), 300);
        let held = collector.bytes();
        assert!(held > 0 && held < 64 << 10, "{held} bytes for 1,300 keys");
        assert_eq!(pool.reserved(), held);
        drop(columns);
        drop(tap);
        drop(collector);
        assert_eq!(pool.reserved(), 0);
    }

    #[tokio::test]
    async fn a_pool_that_refuses_the_keys_leaves_the_rows_unchanged() {
        let pool: Arc<dyn MemoryPool> = Arc::new(
            datafusion::execution::memory_pool::GreedyMemoryPool::new(1024),
        );
        let context = context_with_pool(Arc::clone(&pool));
        let (input, keys) = repeated_keys(3, 5_000);
        let collector = Arc::new(BuildKeys::new(2, 2, 1_000_000));
        let tap = BuildKeysExec::new(input, keys, Arc::clone(&collector));
        let mut rows = 0;
        for partition in 0..2 {
            let batches = collect(tap.execute(partition, Arc::clone(&context)).unwrap())
                .await
                .unwrap();
            rows += batches.iter().map(RecordBatch::num_rows).sum::<usize>();
        }
        assert_eq!(rows, 30_000);
        assert!(
            matches!(collector.collected(), CollectedKeys::MemoryRefused(30_000)),
            "{:?}",
            collector.collected()
        );
        assert_eq!(pool.reserved(), 0);
    }

    #[tokio::test]
    async fn more_distinct_keys_than_the_bound_are_not_kept() {
        // Spread too wide for a bitmap (2^50 values).
        let collector = Arc::new(BuildKeys::new(1, 1, 2));
        let tap = BuildKeysExec::new(
            input(vec![vec![1, 1 << 40, 1 << 50]]),
            vec![Arc::new(Column::new("k", 0))],
            Arc::clone(&collector),
        );
        collect(tap.execute(0, Arc::new(TaskContext::default())).unwrap())
            .await
            .unwrap();
        assert!(
            matches!(collector.collected(), CollectedKeys::TooMany(3)),
            "{:?}",
            collector.collected()
        );
    }

    fn batches_of(schema: &Arc<Schema>, keys: Vec<Vec<Option<i64>>>) -> Vec<RecordBatch> {
        keys.into_iter()
            .map(|keys| {
                RecordBatch::try_new(Arc::clone(schema), vec![Arc::new(Int64Array::from(keys))])
                    .unwrap()
            })
            .collect()
    }

    /// 600,000 build rows with 100,000 distinct keys (every third integer
    /// of [-150,000, 150,000), NULLs among them), ten times the bound: an
    /// integer column past a quarter of the bound whose range takes fewer
    /// bytes as a bitmap goes over to one, and keeps every key exactly,
    /// whatever order they come in (the first partition descending, so
    /// the bitmap grows below its range, the second ascending), in the pool.
    #[tokio::test]
    async fn many_integer_keys_in_a_narrow_range_are_kept_as_a_bitmap_past_the_bound() {
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, true)]));
        let keys: Vec<i64> = (-50_000..50_000).map(|key| key * 3).collect();
        let rows = |keys: &[i64]| -> Vec<Vec<Option<i64>>> {
            // Each key three times, in batches of 10,000 rows with a NULL.
            let all: Vec<i64> = keys.iter().flat_map(|key| [*key; 3]).collect();
            all.chunks(10_000)
                .map(|chunk| {
                    let mut batch: Vec<Option<i64>> = chunk.iter().copied().map(Some).collect();
                    batch.push(None);
                    batch
                })
                .collect()
        };
        let descending: Vec<i64> = keys.iter().rev().copied().collect();
        let partitions = vec![
            batches_of(&schema, rows(&descending)),
            batches_of(&schema, rows(&keys)),
        ];
        let input =
            MemorySourceConfig::try_new_exec(&partitions, Arc::clone(&schema), None).unwrap();
        let pool: Arc<dyn MemoryPool> = Arc::new(
            datafusion::execution::memory_pool::GreedyMemoryPool::new(64 << 20),
        );
        let context = context_with_pool(Arc::clone(&pool));
        let collector = Arc::new(BuildKeys::new(2, 1, 10_000));
        let tap = BuildKeysExec::new(
            input,
            vec![Arc::new(Column::new("k", 0))],
            Arc::clone(&collector),
        );
        let mut rows = 0;
        for partition in 0..2 {
            let batches = collect(tap.execute(partition, Arc::clone(&context)).unwrap())
                .await
                .unwrap();
            rows += batches.iter().map(RecordBatch::num_rows).sum::<usize>();
        }
        assert_eq!(rows, 2 * (300_000 + 30));
        let CollectedKeys::Keys(columns) = collector.collected() else {
            panic!("kept as a bitmap: {:?}", collector.collected());
        };
        let ColumnKeys::Bits(bits) = &columns[0] else {
            panic!("100,000 keys over 300,000 values are a bitmap");
        };
        assert_eq!(bits.keys(), 100_000);
        assert_eq!(bits.low_high(), Some((-150_000, 149_997)));
        assert_eq!(sorted_i64(&bits.values().unwrap()), keys);
        let (base, span, words) = bits.trimmed().unwrap();
        assert!(base <= -150_000 && base > -150_000 - 64);
        assert_eq!(base + span as i64 - 1, 149_997);
        assert_eq!(words.len() as u64, span.div_ceil(64));
        // Trimmed once complete: the words a key bitmap is made of are the
        // collector's own, shared, with no room kept for growing.
        // (One value in three is a key: whole words are smaller than packed.)
        let (KeyWords::Whole(words), KeyWords::Whole(again)) = (&words, &bits.trimmed().unwrap().2)
        else {
            panic!("one key in three values: whole words");
        };
        assert!(Arc::ptr_eq(words, again));
        assert_eq!(words.capacity(), words.len());
        // A bitmap of the range, not 8 bytes per key.
        let held = collector.bytes();
        assert!(
            held < 200_000,
            "{held} bytes for a bitmap of 300,000 values"
        );
        assert_eq!(pool.reserved(), held);
        drop(columns);
        drop(tap);
        drop(collector);
        assert_eq!(pool.reserved(), 0);
    }

    /// Keys that use a fraction of their range (TPC-H's order keys: 8
    /// values of 32, a third of them kept) are packed once complete: the
    /// pool holds the packed bytes, the same keys come back, and the words
    /// a key bitmap is made of are the collector's own, shared. The keys
    /// arrive in ascending order, batch by batch, as from a table sorted
    /// by them: the bitmap's room grows as a vector's does (it doubled
    /// with every batch up to 128 MiB, and this 64 MiB pool refused it).
    #[tokio::test]
    async fn complete_keys_of_a_sparse_range_are_held_packed() {
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, true)]));
        let keys: Vec<i64> = (0..4_000_000i64)
            .filter(|value| value % 32 < 8 && value % 3 == 0)
            .collect();
        let batches: Vec<Vec<Option<i64>>> = keys
            .chunks(8192)
            .map(|chunk| chunk.iter().copied().map(Some).collect())
            .collect();
        let partitions = vec![batches_of(&schema, batches)];
        let input =
            MemorySourceConfig::try_new_exec(&partitions, Arc::clone(&schema), None).unwrap();
        let pool: Arc<dyn MemoryPool> = Arc::new(
            datafusion::execution::memory_pool::GreedyMemoryPool::new(64 << 20),
        );
        let collector = Arc::new(BuildKeys::new(1, 1, 10_000));
        let tap = BuildKeysExec::new(
            input,
            vec![Arc::new(Column::new("k", 0))],
            Arc::clone(&collector),
        );
        collect(
            tap.execute(0, context_with_pool(Arc::clone(&pool)))
                .unwrap(),
        )
        .await
        .unwrap();
        let CollectedKeys::Keys(columns) = collector.collected() else {
            panic!("{:?}", collector.collected());
        };
        let ColumnKeys::Bits(bits) = &columns[0] else {
            panic!("kept as a bitmap");
        };
        assert_eq!(bits.keys(), keys.len() as u64);
        assert_eq!(bits.low_high(), Some((0, *keys.last().unwrap())));
        assert_eq!(sorted_i64(&bits.values().unwrap()), keys);
        let (base, span, words) = bits.trimmed().unwrap();
        assert_eq!((base, span), (0, *keys.last().unwrap() as u64 + 1));
        let (KeyWords::Packed(words), KeyWords::Packed(again)) =
            (&words, &bits.trimmed().unwrap().2)
        else {
            panic!("packed");
        };
        assert!(Arc::ptr_eq(words, again));
        let whole_bytes = span.div_ceil(64) as usize * 8;
        let held = collector.bytes();
        assert!(
            held < whole_bytes / 2,
            "{held} bytes held, {whole_bytes} whole"
        );
        assert_eq!(pool.reserved(), held);
    }

    /// Once complete, integer keys whose bitmap takes at most twice their
    /// bytes go over to one however few they are (here 2,000, far below a
    /// quarter of the bound), and give the same keys back; sparser ones
    /// stay values.
    #[tokio::test]
    async fn complete_keys_go_over_to_a_bitmap_of_at_most_twice_their_bytes() {
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, true)]));
        for (step, as_bits) in [(100, true), (1_000, false)] {
            let keys: Vec<i64> = (0..2_000).map(|key| 7 + key * step).collect();
            let mut batch: Vec<Option<i64>> = keys.iter().rev().copied().map(Some).collect();
            batch.push(None);
            let partitions = vec![batches_of(&schema, vec![batch])];
            let input =
                MemorySourceConfig::try_new_exec(&partitions, Arc::clone(&schema), None).unwrap();
            let collector = Arc::new(BuildKeys::new(1, 1, 1_000_000));
            let tap = BuildKeysExec::new(
                input,
                vec![Arc::new(Column::new("k", 0))],
                Arc::clone(&collector),
            );
            collect(tap.execute(0, Arc::new(TaskContext::default())).unwrap())
                .await
                .unwrap();
            let CollectedKeys::Keys(columns) = collector.collected() else {
                panic!("{:?}", collector.collected());
            };
            match &columns[0] {
                ColumnKeys::Bits(bits) => {
                    assert!(as_bits, "one key in {step} values: kept as values");
                    assert_eq!(bits.keys(), 2_000);
                    assert_eq!(sorted_i64(&bits.values().unwrap()), keys);
                    let (base, span, words) = bits.trimmed().unwrap();
                    assert_eq!((base, base + span as i64 - 1), (0, keys[1_999]));
                    assert_eq!(words.len() as u64, span.div_ceil(64));
                }
                ColumnKeys::Values(arrays) => {
                    assert!(!as_bits, "one key in {step} values: a bitmap");
                    let all: Vec<i64> = arrays.iter().flat_map(sorted_i64).collect();
                    assert_eq!(all, keys);
                }
            }
        }
    }

    /// Keys kept as a bitmap, then one far outside its range: the bitmap
    /// would pass its bound, so collecting stops and says why.
    #[tokio::test]
    async fn a_key_far_outside_a_bitmaps_range_stops_collecting() {
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, true)]));
        let first: Vec<Option<i64>> = (0..70_000).map(Some).collect();
        let partitions = vec![batches_of(&schema, vec![first, vec![Some(1 << 45)]])];
        let input =
            MemorySourceConfig::try_new_exec(&partitions, Arc::clone(&schema), None).unwrap();
        let collector = Arc::new(BuildKeys::new(1, 1, 100));
        let tap = BuildKeysExec::new(
            input,
            vec![Arc::new(Column::new("k", 0))],
            Arc::clone(&collector),
        );
        collect(tap.execute(0, Arc::new(TaskContext::default())).unwrap())
            .await
            .unwrap();
        assert!(
            matches!(collector.collected(), CollectedKeys::TooWide(70_001)),
            "{:?}",
            collector.collected()
        );
        assert_eq!(collector.bytes(), 0);
    }

    /// Dates and negative integers: the bitmap grows below and above its
    /// range and gives its keys back in their own type.
    #[test]
    fn a_bitmap_of_dates_grows_both_ways_and_gives_dates_back() {
        use arrow::array::Date32Array;
        let dates = |days: &[i32]| -> ArrayRef { Arc::new(Date32Array::from(days.to_vec())) };
        let mut bits = KeyBits::new(DataType::Date32, 0, 10);
        assert!(bits.insert(&dates(&[5, 3, 5])));
        assert!(bits.insert(&dates(&[-700, 9])));
        assert!(bits.insert(&dates(&[20_000, -700])));
        let with_null: ArrayRef = Arc::new(Date32Array::from(vec![None, Some(1)]));
        assert!(bits.insert(&with_null));
        assert_eq!(bits.keys(), 6);
        assert_eq!(bits.low_high(), Some((-700, 20_000)));
        let values = bits.values().unwrap();
        assert_eq!(values.data_type(), &DataType::Date32);
        let values: Vec<i32> = values
            .as_primitive::<Date32Type>()
            .iter()
            .flatten()
            .collect();
        assert_eq!(values, vec![-700, 1, 3, 5, 9, 20_000]);
        // Strings are not integers: nothing is set.
        let strings: ArrayRef = Arc::new(StringArray::from(vec!["a"]));
        assert!(!bits.insert(&strings));
        // Past the bound of a bitmap.
        assert!(!bits.insert(&dates(&[i32::MIN, i32::MAX])));
        assert_eq!(bits.keys(), 6);
    }
}
