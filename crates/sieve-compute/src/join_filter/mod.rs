//! Join filters for remote scans: a hash join's build-side keys, turned into
//! something a storage node can evaluate.
//!
//! DataFusion's `HashJoinExec` publishes a dynamic filter once its build side
//! is complete: `key >= min AND key <= max AND key IN (...)` (or a lookup into
//! its hash table, which cannot leave the process), wrapped in a `CASE` over
//! hash partitions when the join is partitioned, and in `key IS NULL OR (...)`
//! where NULL keys must reach the join (NULL equals NULL, null-aware anti
//! joins). The probe side's [`crate::SieveScanExec`] waits for that filter,
//! then derives from it ([`implied`](mod@implied), by structural induction
//! over DataFusion's expression, whatever its shape) what each probe column
//! must satisfy, and ships that in the fragment:
//!
//! - **range**: `key >= min AND key <= max` per key column; the storage
//!   node's page index prunes pages with it;
//! - **list**: `key IN (...)` for at most 20 distinct keys, or for at most
//!   `sieve.join_filter_list_max` when no bitmap fits; Bloom filters on the
//!   slice's key columns prune row groups with it;
//! - **bitmap**: a [`KeyBitmapExpr`] for more keys when they are integers in
//!   a range narrow enough that one bit per value takes at most
//!   `sieve.join_filter_bitmap_bytes`, or twice the Bloom filter's bytes:
//!   exact, and cheaper to probe than a hash set or a Bloom filter;
//! - **bloom**: a [`BloomFilterExpr`] otherwise (up to
//!   `sieve.join_filter_keys_max` keys), sized for `sieve.join_filter_bloom_fpp`,
//!   or lower where the keys are a small share of the probe column's values
//!   (the rows let through by mistake stay about a tenth of those matched);
//! - **NULL keys kept**: `key IS NULL OR (...)` where the join's filter lets
//!   NULL keys through.
//!
//! The key values of lists, bitmaps and Bloom filters come from the join's
//! collected build keys ([`crate::build_keys`]), which stand in only for the
//! join's own membership test (the IN list or hash-table lookup over exactly
//! its probe keys). Every part is implied by the join's own filter, so
//! applying it before the join removes only rows the join would drop: the
//! join still does the exact matching. A part of the filter whose shape is
//! not understood yields nothing, and EXPLAIN names it.

mod implied;
pub(crate) mod parts;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use arrow::array::{Array, ArrayRef, ArrowPrimitiveType, AsArray, PrimitiveArray};
use arrow::compute::{concat, take};
use arrow::datatypes::{
    DataType, Date32Type, Date64Type, Float16Type, Float32Type, Float64Type, Int16Type, Int32Type,
    Int64Type, Int8Type, Schema, UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};
use arrow::row::{RowConverter, SortField};
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::common::{Result, ScalarValue};
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::expressions::{
    lit, BinaryExpr, Column, DynamicFilterPhysicalExpr, InListExpr, IsNullExpr,
};
use datafusion::physical_expr::{conjunction as physical_conjunction, PhysicalExpr};
use datafusion::physical_expr_common::physical_expr::snapshot_physical_expr;
use sieve_fragment::{
    BloomFilterExpr, KeyBitmapExpr, BLOOM_FILTER_BYTES_MAX, KEY_BITMAP_BYTES_MAX,
};

use crate::build_keys::{BuildKeys, CollectedKeys, ColumnKeys, KeyBits};
use datafusion::functions_aggregate::min_max::{MaxAccumulator, MinAccumulator};
use datafusion::logical_expr::Accumulator;
use implied::{implied, ColumnFact, Implied, JoinKeys, Members, Values};

/// A dynamic filter a scan received from above.
#[derive(Debug, Clone)]
pub struct JoinFilterSlot {
    /// The filter, over the scan's output schema.
    pub filter: Arc<dyn PhysicalExpr>,
    /// The join that produces it ("orders", say); `Some` means the scan waits
    /// for the filter to be complete before it sends any request.
    pub source: Option<String>,
    /// The join's build-side keys, collected on their way into its hash
    /// table (see [`crate::build_keys`]): the values of the list or Bloom
    /// filter, in place of DataFusion's IN list.
    pub keys: Option<Arc<BuildKeys>>,
}

/// A key filter from a hash join further up, whose probe key reaches this
/// scan's column through other inner joins, projections, filters and
/// repartitions ([`crate::optimizer`]): DataFusion pushes a join's dynamic
/// filter only where all its key columns come from one input, so the
/// supplier join of TPC-H Q5 (on `l_suppkey` and `c_nationkey`, above the
/// orders-lineitem join) reaches no scan. Every output row of an inner
/// equi-join carries a probe key equal to a build key, and the operators in
/// between pass the column's value unchanged, so a lineitem row whose
/// `l_suppkey` is not among the build keys reaches no output row: the scan
/// may drop it.
#[derive(Debug, Clone)]
pub struct KeyFilterSlot {
    /// The join's build side, for EXPLAIN.
    pub source: String,
    /// The join's build-side keys.
    pub keys: Arc<BuildKeys>,
    /// Which of the join's keys reaches this scan.
    pub position: usize,
    /// The scan output column it reaches.
    pub column: usize,
    /// Whether NULL keys match (`IS NOT DISTINCT FROM` joins).
    pub nulls_pass: bool,
}

/// How build-side keys are shipped (the `sieve.join_filter_*` settings).
#[derive(Debug, Clone, PartialEq)]
pub struct JoinFilterSettings {
    /// Whether scans accept join filters at all (`sieve.join_filters`).
    pub enabled: bool,
    /// At most this many distinct keys go as an exact IN list.
    pub list_max: usize,
    /// At most this many distinct keys go as a Bloom filter; more, range only.
    pub keys_max: usize,
    /// False-positive rate the Bloom filter is sized for.
    pub bloom_fpp: f64,
    /// A key bitmap replaces the Bloom filter when it takes at most this
    /// many bytes or at most twice the Bloom filter's (0: never).
    pub bitmap_bytes: usize,
    /// Upper bound on waiting for a join's build side, after which the scan
    /// goes ahead with whatever the filter holds then.
    pub wait: Duration,
    /// Key bitmaps of at least this many bytes go in windows with each
    /// slice request where the slices' key ranges allow, instead of
    /// registered whole on every node (0: never; see [`parts`]).
    pub part_bytes_min: usize,
}

/// The probe scan's output columns, as join filters need them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProbeColumns<'a> {
    /// `shipped[i]` is the table column of scan output column `i`.
    pub(crate) shipped: &'a [usize],
    /// The table's schema.
    pub(crate) table_schema: &'a Schema,
    /// Upper bound on the distinct values of each scan output column.
    pub(crate) distinct_bounds: &'a [Option<u64>],
}

/// A key set holding at least this share of the values the probe column can
/// take filters too little to be worth a membership test.
const UNSELECTIVE_KEYS_RATIO: f64 = 0.9;

/// Rows a Bloom filter may let through by mistake, as a share of the rows
/// its keys match (see [`bloom_fpp`]).
const BLOOM_FALSE_SHARE: f64 = 0.1;

/// Lowest false-positive rate a Bloom filter is sized for: about 30 bits
/// a key, three times the bytes of 1%.
const BLOOM_FPP_MIN: f64 = 1e-5;

/// Up to this many keys an IN list is shipped even where a key bitmap would
/// fit: DataFusion's pruning rewrites lists this short into per-key
/// min/max tests, and probing a hash set of so few keys costs little. Beyond
/// it a bitmap that fits is preferred: one bit test per row against a hash
/// lookup (Q11's 396 supplier keys: 14% of the storage node's CPU went to
/// the IN list's hash set).
const LIST_PREFERRED_MAX: usize = 20;

/// Wait for every join filter with a known source, then turn all of them into
/// conjuncts over the table schema. Returns the conjuncts and a description
/// per filter.
pub(crate) async fn resolve(
    slots: &[JoinFilterSlot],
    key_slots: &[KeyFilterSlot],
    settings: &JoinFilterSettings,
    probe: ProbeColumns<'_>,
) -> Result<(Vec<Arc<dyn PhysicalExpr>>, Vec<String>)> {
    let mut conjuncts = Vec::new();
    let mut descriptions = Vec::new();
    for slot in key_slots {
        let (parts, description) = resolve_key_slot(slot, settings, probe).await?;
        descriptions.push(format!(
            "join filter from {} (through joins below it): {description}",
            slot.source
        ));
        conjuncts.extend(parts);
    }
    for slot in slots {
        let Some(source) = &slot.source else {
            continue;
        };
        let mut dynamic = Vec::new();
        slot.filter.apply(|expr| {
            if expr.downcast_ref::<DynamicFilterPhysicalExpr>().is_some() {
                dynamic.push(Arc::clone(expr));
            }
            Ok(TreeNodeRecursion::Continue)
        })?;
        let mut complete = true;
        for expr in &dynamic {
            let filter = expr
                .downcast_ref::<DynamicFilterPhysicalExpr>()
                .expect("collected as a dynamic filter");
            complete &= tokio::time::timeout(settings.wait, filter.wait_complete())
                .await
                .is_ok();
        }
        // The collected build keys stand in for the join's membership test
        // only where the slot is that one join's filter, complete: then every
        // probe-key membership test in it is over a subset of those keys.
        let mut build_keys: Option<Vec<ColumnKeys>> = None;
        let mut collected_note = None;
        let own_filter = dynamic.len() == 1
            && slot
                .filter
                .downcast_ref::<DynamicFilterPhysicalExpr>()
                .is_some();
        let mut spilled = false;
        if let (Some(keys), true, true) = (&slot.keys, complete, own_filter) {
            if keys.spilled() {
                // A partition that spilled gave up its part of the filter
                // before reading its build side to the end: the collected
                // keys stand in for it once complete.
                spilled = tokio::time::timeout(settings.wait, keys.wait_complete())
                    .await
                    .is_ok();
            }
            match keys.collected() {
                CollectedKeys::Keys(columns) => build_keys = Some(columns),
                CollectedKeys::TooMany(rows) => {
                    collected_note = Some(format!(
                        "{rows} build rows, above sieve.join_filter_keys_max distinct keys: no membership test"
                    ));
                }
                CollectedKeys::MemoryRefused(rows) => {
                    collected_note = Some(format!(
                        "{rows} build rows, keys refused by the memory pool: no membership test"
                    ));
                }
                CollectedKeys::TooWide(rows) => {
                    collected_note = Some(format!(
                        "{rows} build rows, keys too many for values and too wide for a bitmap: no membership test"
                    ));
                }
                CollectedKeys::PartitionDropped(rows) => {
                    collected_note = Some(format!(
                        "{rows} build rows, a build partition dropped before its end: no membership test"
                    ));
                }
                CollectedKeys::Incomplete => {}
            }
        }
        let probe_keys: Vec<Arc<dyn PhysicalExpr>> = dynamic
            .first()
            .map(|filter| filter.children().into_iter().cloned().collect())
            .unwrap_or_default();
        let snapshot = snapshot_physical_expr(Arc::clone(&slot.filter))?;
        let implied = implied(
            &snapshot,
            JoinKeys {
                probe: &probe_keys,
                collected: build_keys.is_some(),
                spilled,
            },
        );
        let (parts, description) = build(&implied, build_keys.as_deref(), settings, probe)?;
        let description = match collected_note {
            Some(note) => format!("{description} + {note}"),
            None => description,
        };
        let description = if complete {
            description
        } else {
            format!(
                "{description} (build side not complete after {:?})",
                settings.wait
            )
        };
        descriptions.push(format!("join filter from {source}: {description}"));
        conjuncts.extend(parts);
    }
    Ok((conjuncts, descriptions))
}

/// The range of collected key values, NULLs left out (DataFusion's own MIN
/// and MAX); `None` where there is no non-NULL value.
fn key_range(keys: &ColumnKeys) -> Result<(Option<ScalarValue>, Option<ScalarValue>)> {
    let arrays = match keys {
        ColumnKeys::Values(arrays) => arrays,
        ColumnKeys::Bits(bits) => {
            let Some((low, high)) = bits.low_high() else {
                return Ok((None, None));
            };
            let scalar = |value: i64| ScalarValue::Int64(Some(value)).cast_to(bits.data_type());
            return Ok((Some(scalar(low)?), Some(scalar(high)?)));
        }
    };
    let Some(first) = arrays.first() else {
        return Ok((None, None));
    };
    let mut min = MinAccumulator::try_new(first.data_type())?;
    let mut max = MaxAccumulator::try_new(first.data_type())?;
    for array in arrays {
        min.update_batch(std::slice::from_ref(array))?;
        max.update_batch(std::slice::from_ref(array))?;
    }
    let low = Some(min.evaluate()?).filter(|value| !value.is_null());
    let high = Some(max.evaluate()?).filter(|value| !value.is_null());
    Ok((low, high))
}

/// Wait for a [`KeyFilterSlot`]'s build side, then its conjuncts: the key
/// range and a membership test of the collected keys, with NULLs only where
/// they match.
async fn resolve_key_slot(
    slot: &KeyFilterSlot,
    settings: &JoinFilterSettings,
    probe: ProbeColumns<'_>,
) -> Result<(Vec<Arc<dyn PhysicalExpr>>, String)> {
    if tokio::time::timeout(settings.wait, slot.keys.wait_complete())
        .await
        .is_err()
    {
        return Ok((
            vec![],
            format!("none (build side not complete after {:?})", settings.wait),
        ));
    }
    let columns = match slot.keys.collected() {
        CollectedKeys::Keys(columns) => columns,
        CollectedKeys::TooMany(rows) => {
            return Ok((
                vec![],
                format!("none ({rows} build rows, above sieve.join_filter_keys_max distinct keys)"),
            ))
        }
        CollectedKeys::MemoryRefused(rows) => {
            return Ok((
                vec![],
                format!("none ({rows} build rows, keys refused by the memory pool)"),
            ))
        }
        CollectedKeys::TooWide(rows) => {
            return Ok((
                vec![],
                format!(
                    "none ({rows} build rows, keys too many for values and too wide for a bitmap)"
                ),
            ))
        }
        CollectedKeys::PartitionDropped(rows) => {
            return Ok((
                vec![],
                format!("none ({rows} build rows, a build partition dropped before its end)"),
            ))
        }
        CollectedKeys::Incomplete => return Ok((vec![], "none (build side incomplete)".into())),
    };
    let Some(arrays) = columns.get(slot.position) else {
        return Ok((vec![], "none (no such key)".into()));
    };
    let (low, high) = key_range(arrays)?;
    let values = match (low, high) {
        (Some(low), Some(high)) => Values::Within {
            low: Some(low),
            high: Some(high),
            members: Some(Members::BuildKeys(slot.position)),
        },
        // No non-NULL build key.
        _ => Values::Empty,
    };
    let implied = if matches!(values, Values::Empty) && !slot.nulls_pass {
        Implied {
            nothing: true,
            ..Implied::default()
        }
    } else {
        Implied {
            columns: [(
                slot.column,
                ColumnFact {
                    values,
                    nulls_pass: slot.nulls_pass,
                },
            )]
            .into(),
            ..Implied::default()
        }
    };
    build(&implied, Some(&columns), settings, probe)
}

/// The conjuncts over the table schema that `implied` allows (see
/// [`implied`](mod@implied)): per column a range, a membership test and, where
/// NULLs pass, `column IS NULL OR (...)`. `build_keys` are the join's
/// collected build keys, per key column.
fn build(
    implied: &Implied,
    build_keys: Option<&[ColumnKeys]>,
    settings: &JoinFilterSettings,
    probe: ProbeColumns<'_>,
) -> Result<(Vec<Arc<dyn PhysicalExpr>>, String)> {
    let ProbeColumns {
        shipped,
        table_schema,
        distinct_bounds,
    } = probe;
    let table_column = |index: usize| -> Option<Arc<dyn PhysicalExpr>> {
        let table_index = *shipped.get(index)?;
        Some(Arc::new(Column::new(
            table_schema.field(table_index).name(),
            table_index,
        )))
    };
    if implied.nothing {
        return Ok((vec![lit(false)], "empty build side: nothing matches".into()));
    }
    let mut conjuncts: Vec<Arc<dyn PhysicalExpr>> = Vec::new();
    let mut parts = Vec::new();
    for (&index, fact) in &implied.columns {
        let Some(key) = table_column(index) else {
            continue;
        };
        let (low, high, members) = match &fact.values {
            Values::Empty => {
                // Only NULL keys can match (`nothing` covers the case where
                // not even they can).
                conjuncts.push(Arc::new(IsNullExpr::new(key)));
                parts.push("NULL keys only".to_string());
                continue;
            }
            Values::Within { low, high, members } => (low, high, members),
        };
        let mut column_conjuncts: Vec<Arc<dyn PhysicalExpr>> = Vec::new();
        let mut column_parts = Vec::new();
        let (mut low, mut high) = (low.clone(), high.clone());
        if let (None, None, Some(Members::BuildKeys(position))) = (&low, &high, members) {
            // No bound from the join's filter (a partition it does not
            // know): the collected keys' own range.
            if let Some(arrays) = build_keys.and_then(|keys| keys.get(*position)) {
                (low, high) = key_range(arrays)?;
            }
        }
        if let Some(low) = &low {
            column_conjuncts.push(Arc::new(BinaryExpr::new(
                Arc::clone(&key),
                Operator::GtEq,
                lit(low.clone()),
            )));
        }
        if let Some(high) = &high {
            column_conjuncts.push(Arc::new(BinaryExpr::new(
                Arc::clone(&key),
                Operator::LtEq,
                lit(high.clone()),
            )));
        }
        match (&low, &high) {
            (Some(low), Some(high)) => column_parts.push(format!("range [{low}, {high}]")),
            (Some(low), None) => column_parts.push(format!("range [{low}, ...]")),
            (None, Some(high)) => column_parts.push(format!("range [..., {high}]")),
            (None, None) => {}
        }
        let bounds = low.as_ref().zip(high.as_ref());
        let bound = distinct_bounds.get(index).copied().flatten();
        let members = match members {
            Some(Members::Listed(values)) => Some(Arc::clone(values)),
            Some(Members::BuildKeys(position)) => {
                match build_keys.and_then(|keys| keys.get(*position)) {
                    Some(ColumnKeys::Values(arrays)) if arrays.len() == 1 => {
                        Some(Arc::clone(&arrays[0]))
                    }
                    Some(ColumnKeys::Values(arrays)) if !arrays.is_empty() => {
                        let arrays: Vec<&dyn Array> =
                            arrays.iter().map(|array| array.as_ref()).collect();
                        Some(concat(&arrays)?)
                    }
                    Some(ColumnKeys::Bits(bits)) => {
                        if let Some(test) = bits_membership(
                            &key,
                            bits,
                            bounds,
                            bound,
                            settings,
                            table_schema,
                            &mut column_parts,
                        )? {
                            column_conjuncts.push(test);
                        }
                        None
                    }
                    _ => None,
                }
            }
            None => None,
        };
        if let Some(members) = members {
            if let Some(test) = membership(
                &key,
                &members,
                bounds,
                bound,
                settings,
                table_schema,
                &mut column_parts,
            )? {
                column_conjuncts.push(test);
            }
        }
        if column_conjuncts.is_empty() {
            continue;
        }
        if fact.nulls_pass {
            // `key IS NULL OR (...)`: NULL keys can match (NULL equals NULL,
            // or a null-aware anti join must see them).
            let any = physical_conjunction(column_conjuncts);
            conjuncts.push(Arc::new(BinaryExpr::new(
                Arc::new(IsNullExpr::new(key)),
                Operator::Or,
                any,
            )));
            column_parts.push("NULL keys kept".to_string());
        } else {
            conjuncts.extend(column_conjuncts);
        }
        parts.extend(column_parts);
    }
    if parts.is_empty() {
        parts.push("nothing usable (hash-table lookup only)".into());
    }
    if !implied.not_understood.is_empty() {
        parts.push(format!(
            "not understood, not pushed: {}",
            implied.not_understood.join("; ")
        ));
    }
    Ok((conjuncts, parts.join(" + ")))
}

/// The membership test for `members` on `key`: an IN list, a key bitmap or
/// a Bloom filter, or none where it cannot filter (`parts` says which).
fn membership(
    key: &Arc<dyn PhysicalExpr>,
    members: &ArrayRef,
    bounds: Option<(&ScalarValue, &ScalarValue)>,
    distinct_bound: Option<u64>,
    settings: &JoinFilterSettings,
    table_schema: &Schema,
    parts: &mut Vec<String>,
) -> Result<Option<Arc<dyn PhysicalExpr>>> {
    let members = distinct(&with_both_zeros(members)?)?;
    let keys = members.len();
    let dense = bounds.is_some_and(|(low, high)| integer_span(low, high) == Some(keys as u64));
    if dense {
        // Every integer in the range is a key: the range says it all.
        parts.push(format!("dense ({keys} keys = the range)"));
        return Ok(None);
    }
    if let Some(bound) =
        distinct_bound.filter(|&bound| keys as f64 >= UNSELECTIVE_KEYS_RATIO * bound as f64)
    {
        // About every value the probe column takes is a key: a membership
        // test would cost the storage nodes and keep nearly every row.
        parts.push(format!(
            "unselective ({keys} keys of at most {bound} values): no membership test"
        ));
        return Ok(None);
    }
    if keys > settings.keys_max && keys > settings.list_max {
        parts.push(format!(
            "{keys} keys, above sieve.join_filter_keys_max: no membership test"
        ));
        return Ok(None);
    }
    let key = Arc::clone(key);
    let data_type = key.data_type(table_schema)?;
    let fpp = bloom_fpp(keys as u64, distinct_bound, settings.bloom_fpp);
    let bloom_bytes = BloomFilterExpr::bytes_for(keys as u64, fpp);
    // A bitmap travels zstd-compressed (a Bloom filter does not compress):
    // compare what it would weigh on the wire, estimated from the keys'
    // density, with the Bloom filter's bytes.
    let bitmap_fits = KeyBitmapExpr::bytes_for(&members, &data_type)?.is_some_and(|bytes| {
        settings.bitmap_bytes > 0
            && bytes <= KEY_BITMAP_BYTES_MAX
            && (bytes <= settings.bitmap_bytes
                || compressed_bitmap_bytes(bytes, keys) <= 2 * bloom_bytes)
    });
    if keys <= settings.list_max && (keys <= LIST_PREFERRED_MAX || !bitmap_fits) {
        let list = (0..keys)
            .map(|row| Ok(lit(ScalarValue::try_from_array(&members, row)?)))
            .collect::<Result<Vec<_>>>()?;
        parts.push(format!("list ({keys} keys)"));
        return Ok(Some(Arc::new(InListExpr::try_new(
            key,
            list,
            false,
            table_schema,
        )?)));
    }
    if bitmap_fits {
        let bitmap = KeyBitmapExpr::try_new(key, data_type, &members)?;
        parts.push(format!(
            "bitmap ({keys} keys over {} values, {} bytes)",
            bitmap.bits(),
            bitmap.byte_len()
        ));
        return Ok(Some(Arc::new(bitmap)));
    }
    let bloom = BloomFilterExpr::try_new(key, data_type, &members, fpp)?;
    parts.push(format!(
        "bloom ({keys} keys, fpp {fpp:.1e}, {} bytes)",
        bloom.bitset().len()
    ));
    Ok(Some(Arc::new(bloom)))
}

/// The false-positive rate a Bloom filter of `keys` keys is sized for: at
/// most `most` (`sieve.join_filter_bloom_fpp`), and lower where the keys
/// are a small share of the probe column's values (at most
/// `distinct_bound`), so that the rows it lets through by mistake stay
/// about [`BLOOM_FALSE_SHARE`] of those it keeps rightly. A fixed rate
/// lets through a share of the probe table whatever the keys: TPC-H Q18's
/// 6,398 order keys at 1% passed 1.7 M of SF 100's 150 M orders, 270 per
/// key; sized for its keys, the filter takes 32 KB instead of 8 KB and
/// passes about 1,500.
fn bloom_fpp(keys: u64, distinct_bound: Option<u64>, most: f64) -> f64 {
    if !(most > 0.0 && most < 1.0) {
        // Not a rate (a setting of 0, 1 or NaN): `BloomFilterExpr::try_new`
        // refuses it by name; `clamp` below would panic on NaN.
        return most;
    }
    let Some(others) = distinct_bound
        .filter(|&bound| bound > keys)
        .map(|bound| bound - keys)
    else {
        return most;
    };
    let mut fpp =
        (BLOOM_FALSE_SHARE * keys as f64 / others as f64).clamp(BLOOM_FPP_MIN.min(most), most);
    while fpp < most && BloomFilterExpr::bytes_for(keys, fpp) > BLOOM_FILTER_BYTES_MAX {
        fpp = (fpp * 10.0).min(most);
    }
    fpp
}

/// `members`, with 0.0 and -0.0 both where a float key is zero.
///
/// A hash join matches -0.0 with 0.0 (DataFusion hashes the two alike and
/// compares them equal), but an IN list compares floats bit for bit and a
/// Bloom filter hashes their row encoding, where the two differ: from the
/// keys of a build side holding one zero, either would drop the probe rows
/// holding the other. NaN needs nothing: the join matches a NaN only with
/// the same bits.
fn with_both_zeros(members: &ArrayRef) -> Result<ArrayRef> {
    use arrow::array::{Float32Array, Float64Array};
    let zeros: ArrayRef = match members.data_type() {
        DataType::Float16
            if members
                .as_primitive::<Float16Type>()
                .iter()
                .any(|value| value.is_some_and(|value| value.to_f32() == 0.0)) =>
        {
            let zeros = Float32Array::from(vec![0.0, -0.0]);
            arrow::compute::cast(&zeros, &DataType::Float16)?
        }
        DataType::Float32
            if members
                .as_primitive::<Float32Type>()
                .iter()
                .any(|value| value == Some(0.0)) =>
        {
            Arc::new(Float32Array::from(vec![0.0, -0.0]))
        }
        DataType::Float64
            if members
                .as_primitive::<Float64Type>()
                .iter()
                .any(|value| value == Some(0.0)) =>
        {
            Arc::new(Float64Array::from(vec![0.0, -0.0]))
        }
        _ => return Ok(Arc::clone(members)),
    };
    Ok(concat(&[members.as_ref(), zeros.as_ref()])?)
}

/// The membership test for keys collected as a bitmap
/// ([`crate::build_keys`]): the bitmap itself, where one fits as in
/// [`membership`]; else its keys as values, if few enough for a Bloom
/// filter; else none.
fn bits_membership(
    key: &Arc<dyn PhysicalExpr>,
    bits: &KeyBits,
    bounds: Option<(&ScalarValue, &ScalarValue)>,
    distinct_bound: Option<u64>,
    settings: &JoinFilterSettings,
    table_schema: &Schema,
    parts: &mut Vec<String>,
) -> Result<Option<Arc<dyn PhysicalExpr>>> {
    let keys = bits.keys();
    // The same choices as for keys kept as values.
    let as_values = |parts: &mut Vec<String>| {
        membership(
            key,
            &bits.values()?,
            bounds,
            distinct_bound,
            settings,
            table_schema,
            parts,
        )
    };
    if (1..=LIST_PREFERRED_MAX as u64).contains(&keys) {
        // A few keys (a small set the collector holds as a bitmap, being
        // dense): as for values, an IN list.
        return as_values(parts);
    }
    let data_type = key.data_type(table_schema)?;
    let Some((base, span, words)) = bits.trimmed() else {
        return Ok(None);
    };
    let bytes = words.len() * 8;
    let bloom_bytes =
        BloomFilterExpr::bytes_for(keys, bloom_fpp(keys, distinct_bound, settings.bloom_fpp));
    let bitmap_fits = KeyBitmapExpr::supports(&data_type)
        && settings.bitmap_bytes > 0
        && (bytes <= settings.bitmap_bytes
            || compressed_bitmap_bytes(bytes, keys as usize) <= 2 * bloom_bytes);
    if bounds.is_some_and(|(low, high)| integer_span(low, high) == Some(keys)) {
        parts.push(format!("dense ({keys} keys = the range)"));
        return Ok(None);
    }
    if let Some(bound) =
        distinct_bound.filter(|&bound| keys as f64 >= UNSELECTIVE_KEYS_RATIO * bound as f64)
    {
        parts.push(format!(
            "unselective ({keys} keys of at most {bound} values): no membership test"
        ));
        return Ok(None);
    }
    if !bitmap_fits {
        if keys as usize > settings.keys_max {
            parts.push(format!(
                "{keys} keys, above sieve.join_filter_keys_max and no bitmap fits: no membership test"
            ));
            return Ok(None);
        }
        return as_values(parts);
    }
    let bitmap = KeyBitmapExpr::from_words(Arc::clone(key), data_type, base, span, words, keys)?;
    let packed = if bitmap.is_packed() {
        format!(", held packed in {} bytes", bitmap.byte_len())
    } else {
        String::new()
    };
    parts.push(format!(
        "bitmap ({keys} keys over {} values, {} bytes, collected as a bitmap{packed})",
        bitmap.bits(),
        bitmap.word_bytes()
    ));
    Ok(Some(Arc::new(bitmap)))
}

/// Number of integers in `[low, high]`, for integer scalars.
/// zstd's output for a sparse bitmap, against the entropy of its bits
/// (measured: 1.16x for TPC-H SF 10's order keys of one year).
const BITMAP_COMPRESSION_SLACK: f64 = 1.25;

/// Estimated compressed bytes of a bitmap of `bytes` bytes holding `keys`
/// set bits: its entropy (bits times the binary entropy of the density),
/// with [`BITMAP_COMPRESSION_SLACK`].
fn compressed_bitmap_bytes(bytes: usize, keys: usize) -> usize {
    let bits = (bytes * 8) as f64;
    let density = (keys as f64 / bits).clamp(0.0, 1.0);
    if density <= 0.0 || density >= 1.0 {
        return 0;
    }
    let entropy = -density * density.log2() - (1.0 - density) * (1.0 - density).log2();
    (bits * entropy / 8.0 * BITMAP_COMPRESSION_SLACK).ceil() as usize
}

fn integer_span(low: &ScalarValue, high: &ScalarValue) -> Option<u64> {
    let as_i128 = |value: &ScalarValue| -> Option<i128> {
        match value {
            ScalarValue::Int8(Some(v)) => Some(i128::from(*v)),
            ScalarValue::Int16(Some(v)) => Some(i128::from(*v)),
            ScalarValue::Int32(Some(v)) => Some(i128::from(*v)),
            ScalarValue::Int64(Some(v)) => Some(i128::from(*v)),
            ScalarValue::UInt8(Some(v)) => Some(i128::from(*v)),
            ScalarValue::UInt16(Some(v)) => Some(i128::from(*v)),
            ScalarValue::UInt32(Some(v)) => Some(i128::from(*v)),
            ScalarValue::UInt64(Some(v)) => Some(i128::from(*v)),
            _ => None,
        }
    };
    let span = as_i128(high)? - as_i128(low)? + 1;
    u64::try_from(span).ok()
}

/// Distinct, non-null values of an integer-like array, sorted.
fn distinct_sorted<T: ArrowPrimitiveType>(array: &ArrayRef) -> ArrayRef
where
    T::Native: Ord,
{
    let primitive = array.as_primitive::<T>();
    if primitive.null_count() == 0 && primitive.values().windows(2).all(|pair| pair[0] < pair[1]) {
        // Already distinct and sorted (a collector's compacted keys): the
        // same array, not a copy.
        return Arc::clone(array);
    }
    let array = primitive;
    let mut values: Vec<T::Native> = array.iter().flatten().collect();
    values.sort_unstable();
    values.dedup();
    // The array takes the vector's buffer, capacity included: the keys
    // collected for a join are held until the query ends.
    values.shrink_to_fit();
    Arc::new(
        PrimitiveArray::<T>::from_iter_values(values).with_data_type(array.data_type().clone()),
    )
}

/// Distinct, non-null values of `array`.
pub(crate) fn distinct(array: &ArrayRef) -> Result<ArrayRef> {
    // Join keys are mostly integers: sorting them is several times cheaper
    // than hashing their row encoding.
    match array.data_type() {
        DataType::Int8 => return Ok(distinct_sorted::<Int8Type>(array)),
        DataType::Int16 => return Ok(distinct_sorted::<Int16Type>(array)),
        DataType::Int32 => return Ok(distinct_sorted::<Int32Type>(array)),
        DataType::Int64 => return Ok(distinct_sorted::<Int64Type>(array)),
        DataType::UInt8 => return Ok(distinct_sorted::<UInt8Type>(array)),
        DataType::UInt16 => return Ok(distinct_sorted::<UInt16Type>(array)),
        DataType::UInt32 => return Ok(distinct_sorted::<UInt32Type>(array)),
        DataType::UInt64 => return Ok(distinct_sorted::<UInt64Type>(array)),
        DataType::Date32 => return Ok(distinct_sorted::<Date32Type>(array)),
        DataType::Date64 => return Ok(distinct_sorted::<Date64Type>(array)),
        _ => {}
    }
    let converter = RowConverter::new(vec![SortField::new(array.data_type().clone())])?;
    let rows = converter.convert_columns(std::slice::from_ref(array))?;
    let mut seen = HashSet::with_capacity(array.len());
    let keep: Vec<u32> = (0..array.len())
        .filter(|&index| array.is_valid(index) && seen.insert(rows.row(index)))
        .map(|index| index as u32)
        .collect();
    Ok(take(array, &arrow::array::UInt32Array::from(keep), None)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use arrow::datatypes::{DataType, Field};
    use datafusion::physical_expr::expressions::CaseExpr;

    /// A Bloom filter's rate follows the keys' share of the probe column:
    /// a few keys among many values get a low rate, a large share or an
    /// unknown column the setting's, and no filter passes its byte bound.
    #[test]
    fn bloom_filters_are_sized_for_the_keys_share_of_the_probe_column() {
        // TPC-H Q18 at SF 100: 6,398 order keys of 150 M orders.
        let few = bloom_fpp(6_398, Some(150_000_000), 0.01);
        assert_eq!(few, BLOOM_FPP_MIN);
        // At 1%, 1.5 M of the other orders would pass; now 1,500.
        assert!(few * 150e6 <= 0.25 * 6_398.0, "{few}");
        // 1 M keys of 150 M: a tenth of the matches in false positives.
        let some = bloom_fpp(1_000_000, Some(150_000_000), 0.01);
        assert!(some > BLOOM_FPP_MIN && some < 0.01, "{some}");
        let passed = some * 149e6;
        assert!((passed - 100_000.0).abs() < 1.0, "{passed}");
        // Q9's 30 M order keys of 150 M, all keys, unknown values: the setting.
        assert_eq!(bloom_fpp(30_000_000, Some(150_000_000), 0.01), 0.01);
        assert_eq!(bloom_fpp(500, Some(500), 0.01), 0.01);
        assert_eq!(bloom_fpp(500, None, 0.01), 0.01);
        // Settings that are no rate pass through, to be refused by name.
        assert!(bloom_fpp(10, Some(1 << 20), f64::NAN).is_nan());
        assert_eq!(bloom_fpp(10, Some(1 << 20), 0.0), 0.0);
        assert_eq!(bloom_fpp(10, Some(1 << 20), 1.5), 1.5);
        // A setting below the floor stays the setting.
        assert_eq!(bloom_fpp(10, Some(1 << 40), 1e-7), 1e-7);
        // 12 M keys among 2^40 values: as low a rate as fits the bound
        // (1e-3: 32 MiB; 1e-4 would take 64 MiB).
        let many = bloom_fpp(12 << 20, Some(1 << 40), 0.01);
        assert!(BloomFilterExpr::bytes_for(12 << 20, many) <= BLOOM_FILTER_BYTES_MAX);
        assert!(many < 0.01 && many > BLOOM_FPP_MIN, "{many}");
    }

    const NO_JOIN: JoinKeys<'static> = JoinKeys {
        probe: &[],
        collected: false,
        spilled: false,
    };

    /// Facts saying column 0 is among `keys`.
    fn listed(keys: Vec<i64>) -> Implied {
        let mut implied = Implied::default();
        implied.columns.insert(
            0,
            ColumnFact {
                values: Values::Within {
                    low: None,
                    high: None,
                    members: Some(Members::Listed(Arc::new(Int64Array::from(keys)))),
                },
                nulls_pass: false,
            },
        );
        implied
    }

    fn settings() -> JoinFilterSettings {
        JoinFilterSettings {
            enabled: true,
            list_max: 3,
            keys_max: 1000,
            bloom_fpp: 0.01,
            bitmap_bytes: 0,
            wait: Duration::from_secs(1),
            part_bytes_min: 0,
        }
    }

    #[test]
    fn range_and_list_from_a_collect_left_filter() {
        let schema = Schema::new(vec![
            Field::new("a", DataType::Int64, false),
            Field::new("k", DataType::Int64, false),
        ]);
        let key: Arc<dyn PhysicalExpr> = Arc::new(Column::new("k", 0));
        let bounds = Arc::new(BinaryExpr::new(
            Arc::new(BinaryExpr::new(Arc::clone(&key), Operator::GtEq, lit(5i64))),
            Operator::And,
            Arc::new(BinaryExpr::new(Arc::clone(&key), Operator::LtEq, lit(9i64))),
        ));
        let members: ArrayRef = Arc::new(Int64Array::from(vec![5, 9, 9, 7]));
        let list = Arc::new(
            InListExpr::try_new_from_array(Arc::clone(&key), members, false, &schema).unwrap(),
        );
        let filter: Arc<dyn PhysicalExpr> = Arc::new(BinaryExpr::new(bounds, Operator::And, list));
        let summary = implied(&filter, NO_JOIN);
        // Scan output column 0 is table column 1.
        let (conjuncts, description) = build(
            &summary,
            None,
            &settings(),
            ProbeColumns {
                shipped: &[1],
                table_schema: &schema,
                distinct_bounds: &[None],
            },
        )
        .unwrap();
        assert_eq!(description, "range [5, 9] + list (3 keys)");
        assert_eq!(conjuncts.len(), 3);
        assert!(conjuncts.iter().all(|c| format!("{c}").contains("k@1")));
    }

    #[test]
    fn many_keys_become_a_bloom_filter_and_partitions_are_merged() {
        let schema = Schema::new(vec![Field::new("k", DataType::Int64, false)]);
        let key: Arc<dyn PhysicalExpr> = Arc::new(Column::new("k", 0));
        let branch = |values: Vec<i64>| -> Arc<dyn PhysicalExpr> {
            let low = *values.iter().min().unwrap();
            let high = *values.iter().max().unwrap();
            let bounds = Arc::new(BinaryExpr::new(
                Arc::new(BinaryExpr::new(Arc::clone(&key), Operator::GtEq, lit(low))),
                Operator::And,
                Arc::new(BinaryExpr::new(Arc::clone(&key), Operator::LtEq, lit(high))),
            ));
            let array: ArrayRef = Arc::new(Int64Array::from(values));
            Arc::new(BinaryExpr::new(
                bounds,
                Operator::And,
                Arc::new(
                    InListExpr::try_new_from_array(Arc::clone(&key), array, false, &schema)
                        .unwrap(),
                ),
            ))
        };
        let case: Arc<dyn PhysicalExpr> = Arc::new(
            CaseExpr::try_new(
                Some(Arc::clone(&key)),
                vec![
                    (lit(0i64), branch((0..10).collect())),
                    (lit(1i64), branch((100..110).collect())),
                    (lit(2i64), lit(false)),
                ],
                Some(lit(false)),
            )
            .unwrap(),
        );
        let summary = implied(&case, NO_JOIN);
        let (conjuncts, description) = build(
            &summary,
            None,
            &settings(),
            ProbeColumns {
                shipped: &[0],
                table_schema: &schema,
                distinct_bounds: &[None],
            },
        )
        .unwrap();
        assert!(
            description.starts_with("range [0, 109] + bloom (20 keys"),
            "{description}"
        );
        let bloom = conjuncts[2].downcast_ref::<BloomFilterExpr>().unwrap();
        let batch = arrow::record_batch::RecordBatch::try_new(
            Arc::new(schema.clone()),
            vec![Arc::new(Int64Array::from(vec![0, 105, 109]))],
        )
        .unwrap();
        let matched = bloom.evaluate(&batch).unwrap().into_array(3).unwrap();
        let matched = matched
            .as_any()
            .downcast_ref::<arrow::array::BooleanArray>()
            .unwrap();
        assert!(matched.value(0) && matched.value(1) && matched.value(2));
    }

    /// Narrow integer keys go as an exact bitmap, keys spread too wide for
    /// one as a Bloom filter, and a budget of 0 turns bitmaps off.
    #[test]
    fn narrow_integer_keys_become_a_bitmap_wide_ones_a_bloom_filter() {
        let schema = Schema::new(vec![Field::new("k", DataType::Int64, true)]);
        let probe = ProbeColumns {
            shipped: &[0],
            table_schema: &schema,
            distinct_bounds: &[None],
        };
        let blooms = JoinFilterSettings {
            keys_max: 10_000,
            ..settings()
        };
        let with_bitmaps = JoinFilterSettings {
            bitmap_bytes: 65536,
            ..blooms.clone()
        };
        let summary = |keys: Vec<i64>| listed(keys);
        let narrow = summary((0..4000).map(|k| k * 7 + 1000).collect());
        let (conjuncts, description) = build(&narrow, None, &with_bitmaps, probe).unwrap();
        assert_eq!(
            description, "bitmap (4000 keys over 27994 values, 3504 bytes)",
            "{description}"
        );
        let bitmap = conjuncts[0].downcast_ref::<KeyBitmapExpr>().unwrap();
        let batch = arrow::record_batch::RecordBatch::try_new(
            Arc::new(schema.clone()),
            vec![Arc::new(Int64Array::from(vec![
                Some(1000),
                Some(1001),
                None,
                Some(28_993),
                Some(28_994),
            ]))],
        )
        .unwrap();
        let matched = bitmap.evaluate(&batch).unwrap().into_array(5).unwrap();
        let matched = matched.as_boolean();
        assert!(matched.value(0) && !matched.value(1) && matched.is_null(2));
        assert!(matched.value(3) && !matched.value(4));

        let (conjuncts, description) = build(&narrow, None, &blooms, probe).unwrap();
        assert!(description.starts_with("bloom (4000 keys"), "{description}");
        assert!(conjuncts[0].downcast_ref::<BloomFilterExpr>().is_some());

        let wide = summary((0..4000).map(|k| k * 1_000_000).collect());
        let (_, description) = build(&wide, None, &with_bitmaps, probe).unwrap();
        assert!(description.starts_with("bloom (4000 keys"), "{description}");
    }

    /// Past 20 keys a bitmap that fits replaces the IN list; short lists and
    /// keys too spread for a bitmap stay lists up to `list_max`.
    #[test]
    fn lists_give_way_to_bitmaps_past_twenty_keys() {
        let schema = Schema::new(vec![Field::new("k", DataType::Int64, true)]);
        let probe = ProbeColumns {
            shipped: &[0],
            table_schema: &schema,
            distinct_bounds: &[None],
        };
        let defaults = JoinFilterSettings {
            list_max: 1024,
            keys_max: 262_144,
            bitmap_bytes: 65536,
            ..settings()
        };
        let summary = |keys: Vec<i64>| listed(keys);
        let kind = |keys: Vec<i64>, settings: &JoinFilterSettings| {
            let (conjuncts, description) = build(&summary(keys), None, settings, probe).unwrap();
            assert_eq!(conjuncts.len(), 1, "{description}");
            description
        };
        let list = kind((0..20).map(|k| k * 25 + 33).collect(), &defaults);
        assert_eq!(list, "list (20 keys)");
        let bitmap = kind((0..396).map(|k| k * 25 + 33).collect(), &defaults);
        assert!(bitmap.starts_with("bitmap (396 keys"), "{bitmap}");
        let wide = kind((0..396).map(|k| k * 1_000_000_007).collect(), &defaults);
        assert_eq!(wide, "list (396 keys)");
        let no_bitmaps = JoinFilterSettings {
            bitmap_bytes: 0,
            ..defaults
        };
        let list = kind((0..396).map(|k| k * 25 + 33).collect(), &no_bitmaps);
        assert_eq!(list, "list (396 keys)");
    }
    /// A hash join matches -0.0 with 0.0 (DataFusion hashes both alike and
    /// compares them equal), and NaN with NaN. The join filter built from
    /// the build keys, as a range with a list or a Bloom filter, passes
    /// every probe value the join matches, from keys holding either zero.
    #[test]
    fn float_keys_pass_both_zeros_and_nan() {
        use arrow::array::{BooleanArray, Float32Array, Float64Array};
        let probe_values: Vec<Option<f64>> = vec![
            Some(-0.0),
            Some(0.0),
            Some(f64::NAN),
            Some(1.5),
            Some(2.5),
            None,
            Some(f64::INFINITY),
        ];
        for data_type in [DataType::Float64, DataType::Float32] {
            let schema = Schema::new(vec![Field::new("k", data_type.clone(), true)]);
            let array_of = |values: &[Option<f64>]| -> ArrayRef {
                match data_type {
                    DataType::Float32 => Arc::new(Float32Array::from_iter(
                        values.iter().map(|value| value.map(|value| value as f32)),
                    )),
                    _ => Arc::new(Float64Array::from(values.to_vec())),
                }
            };
            let batch = arrow::record_batch::RecordBatch::try_new(
                Arc::new(schema.clone()),
                vec![array_of(&probe_values)],
            )
            .unwrap();
            let probe = ProbeColumns {
                shipped: &[0],
                table_schema: &schema,
                distinct_bounds: &[None],
            };
            for zero in [0.0, -0.0] {
                for keys in [
                    vec![Some(zero)],
                    vec![Some(zero), Some(1.5), Some(f64::NAN)],
                ] {
                    let keys = array_of(&keys);
                    for list_max in [1024, 0] {
                        let mut implied = Implied::default();
                        implied.columns.insert(
                            0,
                            ColumnFact {
                                values: Values::Within {
                                    low: None,
                                    high: None,
                                    members: Some(Members::BuildKeys(0)),
                                },
                                nulls_pass: false,
                            },
                        );
                        let collected = [ColumnKeys::Values(vec![Arc::clone(&keys)])];
                        let settings = JoinFilterSettings {
                            list_max,
                            ..settings()
                        };
                        let (conjuncts, description) =
                            build(&implied, Some(&collected), &settings, probe).unwrap();
                        let mut passed = BooleanArray::from(vec![true; batch.num_rows()]);
                        for conjunct in &conjuncts {
                            let result = conjunct.evaluate(&batch).unwrap();
                            let result = result.into_array(batch.num_rows()).unwrap();
                            passed =
                                arrow::compute::and_kleene(&passed, result.as_boolean()).unwrap();
                        }
                        let passes = |row: usize| passed.is_valid(row) && passed.value(row);
                        let context = format!("{data_type} keys {keys:?}: {description}");
                        assert!(passes(0) && passes(1), "both zeros, {context}");
                        assert!(!passes(4) && !passes(5) && !passes(6), "{context}");
                        if keys.len() > 1 {
                            assert!(passes(2) && passes(3), "NaN and 1.5, {context}");
                        }
                    }
                }
            }
        }
    }
}
