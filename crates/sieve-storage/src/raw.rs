//! Serving a slice raw: the pages of the columns a fragment needs, as stored,
//! for the row groups it asks for, unfiltered. A busy node answers this way
//! instead of running the fragment (see `pool.rs`), and every node when the
//! compute node asks (`FragmentEnvelope::raw`: the fragment has nothing to
//! filter or aggregate); the compute node then runs the same fragment over
//! these pages.
//!
//! ```text
//!   SliceMessage::Raw { footer, ranges }     what follows, and how to decode it
//!   SliceMessage::RawChunk(offset) + bytes   up to RAW_CHUNK_BYTES each
//!   SliceMessage::Metrics { processed: false, raw_reason }
//! ```
//!
//! Every page shipped is verified against the slice's page checksums first:
//! a damaged copy is refused (`DataLoss`), never shipped.
//!
//! This is a plain read: it runs on the node's I/O threads, never waits for a
//! pushdown worker, and costs the node a read and a copy.

use std::os::unix::fs::FileExt;
use std::sync::Arc;

use arrow_flight::FlightData;
use datafusion::common::Result;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use prost::Message;
use sieve_fragment::{
    needed_columns, ByteRange, DecodedBody, FragmentEnvelope, RawSlice, SliceMessage,
    SliceMessageKind, SliceMetrics,
};
use tonic::Status;

use crate::execute::wanted_row_groups;
use crate::flight::corrupt_status;
use crate::{CatalogSlice, SliceDetails, SliceExecutor};

/// The reason a raw slice gives when the compute node asked for one.
pub(crate) const RAW_ASKED: &str = "asked for pages as stored (nothing to push)";

/// Largest piece of a raw slice in one Flight message.
pub const RAW_CHUNK_BYTES: u64 = 1024 * 1024;

/// What a raw slice will ship: the coalesced byte ranges of the needed
/// column chunks, and the row groups they cover.
#[derive(Debug)]
pub(crate) struct RawPlan {
    head: RawSlice,
    details: Arc<SliceDetails>,
    rows: u64,
    pages: u64,
}

/// Plan the raw answer to `envelope` for `slice`.
pub(crate) fn plan_raw(
    slice: &CatalogSlice,
    details: Arc<SliceDetails>,
    envelope: &FragmentEnvelope,
    body: &DecodedBody,
    reason: String,
) -> Result<RawPlan> {
    let metadata = &details.metadata;
    let mut row_groups = wanted_row_groups(envelope, metadata.num_row_groups())?;
    if row_groups.is_empty() {
        row_groups = (0..metadata.num_row_groups()).collect();
    }
    let needed = needed_columns(body);
    let mut chunks: Vec<(u64, u64)> = Vec::new();
    let (mut rows, mut pages) = (0u64, 0u64);
    for &group in &row_groups {
        let row_group = metadata.row_group(group);
        rows += row_group.num_rows() as u64;
        for &column in &needed {
            // Sieve stores flat schemas: table column i is Parquet leaf i.
            let (start, length) = row_group.column(column).byte_range();
            chunks.push((start, start + length));
            pages += metadata
                .offset_index()
                .and_then(|index| index.get(group)?.get(column))
                .map(|index| index.page_locations().len() as u64)
                .unwrap_or(0);
        }
    }
    chunks.sort_unstable();
    let mut ranges: Vec<ByteRange> = Vec::new();
    for (start, end) in chunks {
        match ranges.last_mut() {
            Some(last) if start <= last.offset + last.length => {
                last.length = last.length.max(end - last.offset);
            }
            _ => ranges.push(ByteRange {
                offset: start,
                length: end - start,
            }),
        }
    }
    Ok(RawPlan {
        head: RawSlice {
            file_bytes: slice.summary.bytes,
            footer: details.footer.to_vec(),
            ranges,
            row_groups: row_groups.iter().map(|&group| group as u32).collect(),
            reason,
        },
        details,
        rows,
        pages,
    })
}

/// The Flight messages of a raw slice: head, chunks, metrics.
pub(crate) fn raw_stream(
    slice: Arc<CatalogSlice>,
    plan: RawPlan,
    executor: Arc<SliceExecutor>,
) -> BoxStream<'static, Result<FlightData, Status>> {
    let message = |kind: SliceMessageKind| SliceMessage { kind: Some(kind) }.encode_to_vec();
    let data_bytes: u64 = plan.head.ranges.iter().map(|range| range.length).sum();
    let metrics = SliceMetrics {
        bytes_read: data_bytes,
        pages_considered: plan.pages,
        rows_scanned: plan.rows,
        processed: false,
        raw_reason: plan.head.reason.clone(),
        raw_bytes: data_bytes + plan.head.footer.len() as u64,
        ..SliceMetrics::default()
    };
    // Each range is whole column chunks, so whole pages: it is read and
    // verified in one piece, then shipped in pieces of RAW_CHUNK_BYTES.
    let ranges: Vec<(u64, u64)> = plan
        .head
        .ranges
        .iter()
        .map(|range| (range.offset, range.length))
        .collect();
    let head = FlightData::new().with_app_metadata(message(SliceMessageKind::Raw(plan.head)));
    let details = plan.details;
    let chunks = futures::stream::iter(ranges)
        .map(move |(offset, length)| {
            let slice = Arc::clone(&slice);
            let details = Arc::clone(&details);
            async move {
                let read = Arc::clone(&slice);
                let bytes = tokio::task::spawn_blocking(move || {
                    let file = crate::catalog::open_slice_file(&read.path)?;
                    let mut buffer = vec![0u8; length as usize];
                    file.read_exact_at(&mut buffer, offset)?;
                    Ok::<_, std::io::Error>(buffer)
                })
                .await
                .map_err(|error| Status::internal(format!("raw read task failed: {error}")))?
                .map_err(|error| Status::internal(format!("reading a raw slice: {error}")))?;
                slice
                    .check_pages(&details, offset, &bytes)
                    .map_err(|corruption| corrupt_status(&corruption))?;
                let bytes = bytes::Bytes::from(bytes);
                let mut pieces = Vec::new();
                let mut start = 0u64;
                while start < length {
                    let piece = (length - start).min(RAW_CHUNK_BYTES);
                    pieces.push(Ok(FlightData::new()
                        .with_app_metadata(message(SliceMessageKind::RawChunk(offset + start)))
                        .with_data_body(
                            bytes.slice(start as usize..(start + piece) as usize),
                        )));
                    start += piece;
                }
                Ok::<_, Status>(futures::stream::iter(pieces))
            }
        })
        .buffered(2)
        .try_flatten();
    let trailer = futures::stream::once(async move {
        executor.counters().record(&metrics);
        Ok(FlightData::new().with_app_metadata(message(SliceMessageKind::Metrics(metrics))))
    });
    futures::stream::once(async move { Ok(head) })
        .chain(chunks)
        .chain(trailer)
        .boxed()
}
