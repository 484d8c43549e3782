//! Join filter parts: a large key bitmap sent in windows, one with each
//! slice request, instead of registered whole on every storage node.
//!
//! A join filter is registered once per node and query
//! ([`sieve_fragment::JoinFilterRegistration`]); each node keeps the chunks
//! of a key bitmap that overlap its slices' key ranges. On a table sorted by
//! the key (TPC-H's lineitem by order key) a node's slices are interleaved
//! with the others', so it keeps about a third of the bitmap for the whole
//! query: at SF 100, 25 MB of each 75 MB order-key bitmap, three of them in
//! Q21, the part of a storage node's peak that grew with the data. When
//! the slices' key ranges are narrow and do not overlap, each slice request
//! carries instead the window of the bitmap its slice's key range needs
//! ([`KeyBitmapExpr::window`]): a node holds only the windows of the slices
//! it is working on, and the bitmap crosses the network once in all rather
//! than once per node.
//!
//! ```text
//!   compute ── DoGet(envelope: body + part = bitmap window of slice 7) ─> node
//! ```
//!
//! A window's values outside it pass, so a slice whose statistics are off is
//! filtered less, never wrongly.

use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use datafusion::common::Result;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::PhysicalExpr;
use sieve_fragment::{key_bound, JoinFilterRegistration, KeyBitmapExpr};

use crate::catalog::ClusterSlice;

/// Bytes of the largest window one request carries; a bitmap one slice
/// would need more of is registered instead.
pub(crate) const PART_BYTES_MAX: usize = 1024 * 1024;

/// The windows sent, over all requests, may come to at most this many
/// times the bitmap's bytes (slices' key ranges overlap a little, and a
/// window is whole chunks); past it the bitmap is registered.
const PARTS_TO_WHOLE_MAX: f64 = 1.5;

/// The key bitmaps a scan sends in parts.
#[derive(Debug)]
pub(crate) struct JoinFilterParts {
    table: String,
    schema: SchemaRef,
    /// Each bitmap, whole, with its column's index in `schema`.
    bitmaps: Vec<(KeyBitmapExpr, usize)>,
}

impl JoinFilterParts {
    /// Of `conjuncts` (join filters over `schema`, the table's), the key
    /// bitmaps of at least `bytes_min` bytes (0: none) that the slices of
    /// `units` (one entry per request) cut into windows of at most
    /// [`PART_BYTES_MAX`] bytes each, [`PARTS_TO_WHOLE_MAX`] times the
    /// bitmap in all, go into parts; the others are returned, to be
    /// registered.
    pub(crate) fn split<'a>(
        table: &str,
        schema: &SchemaRef,
        conjuncts: Vec<Arc<dyn PhysicalExpr>>,
        units: impl Iterator<Item = &'a ClusterSlice> + Clone,
        bytes_min: usize,
    ) -> (Vec<Arc<dyn PhysicalExpr>>, Option<Self>) {
        let mut rest = Vec::new();
        let mut bitmaps = Vec::new();
        let conjuncts = conjuncts.iter().flat_map(|conjunct| {
            datafusion::physical_expr::split_conjunction(conjunct)
                .into_iter()
                .cloned()
                .collect::<Vec<_>>()
        });
        for conjunct in conjuncts {
            let parted = (bytes_min > 0)
                .then(|| conjunct.downcast_ref::<KeyBitmapExpr>())
                .flatten()
                .filter(|bitmap| !bitmap.is_cut() && bitmap.word_bytes() >= bytes_min)
                .and_then(|bitmap| {
                    let column = bitmap.input().downcast_ref::<Column>()?;
                    let index = schema.index_of(column.name()).ok()?;
                    let (mut total, whole) = (0usize, bitmap.word_bytes());
                    for slice in units.clone() {
                        let (low, high) = slice_bounds(slice, schema, index)?;
                        let bytes = bitmap.window_bytes(low, high);
                        total += bytes;
                        if bytes > PART_BYTES_MAX
                            || total as f64 > whole as f64 * PARTS_TO_WHOLE_MAX
                        {
                            return None;
                        }
                    }
                    Some((bitmap.clone(), index))
                });
            match parted {
                Some(bitmap) => bitmaps.push(bitmap),
                None => rest.push(conjunct),
            }
        }
        let parts = (!bitmaps.is_empty()).then(|| Self {
            table: table.to_string(),
            schema: Arc::clone(schema),
            bitmaps,
        });
        (rest, parts)
    }

    /// The part for a request over `slice`: the windows its key range
    /// needs, as a compressed registration
    /// ([`sieve_fragment::FragmentEnvelope::join_filter_part`]).
    pub(crate) fn part_for(&self, slice: &ClusterSlice) -> Result<Vec<u8>> {
        let windows = self.bitmaps.iter().filter_map(|(bitmap, index)| {
            // Checked when split; a slice without bounds is left unfiltered.
            let (low, high) = slice_bounds(slice, &self.schema, *index)?;
            Some(Arc::new(bitmap.window(low, high)) as Arc<dyn PhysicalExpr>)
        });
        let filter = datafusion::physical_expr::conjunction(windows);
        let (bytes, _) = JoinFilterRegistration::encode(&self.table, &self.schema, &filter)?;
        JoinFilterRegistration::compress(&bytes)
    }

    /// For EXPLAIN.
    pub(crate) fn describe(&self) -> String {
        let bytes: usize = self
            .bitmaps
            .iter()
            .map(|(bitmap, _)| bitmap.word_bytes())
            .sum();
        format!(
            "{} key bitmap(s) of {bytes} bytes sent in windows, one with each slice request",
            self.bitmaps.len()
        )
    }
}

/// The smallest and largest value of column `index` in `slice`, by its
/// summary, as a key bitmap sees them.
fn slice_bounds(slice: &ClusterSlice, schema: &SchemaRef, index: usize) -> Option<(i64, i64)> {
    let field = schema.field(index);
    let summary = slice
        .summary
        .columns
        .iter()
        .find(|summary| summary.name == *field.name())?;
    let low = key_bound(summary.min.as_deref()?, field.data_type())?;
    let high = key_bound(summary.max.as_deref()?, field.data_type())?;
    (low <= high).then_some((low, high))
}
