//! The exact stage: run one fragment over one slice.
//!
//! ```text
//!   DataSourceExec(ParquetSource, match hints as ParquetAccessPlan, needed columns)
//!     -> FilterExec(exact predicate, projection to the shipped columns)
//! ```
//!
//! The plan is DataFusion's own, so the storage node evaluates a predicate
//! with exactly the semantics the compute node would (overflow, NULLs,
//! decimals, floats): pushing it down cannot change an answer.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use std::time::Duration;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::common::{internal_datafusion_err, plan_datafusion_err, plan_err, Result};
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::SessionContext;
use futures::Stream;
use object_store::local::LocalFileSystem;
use object_store::ObjectStore;
use parquet::file::metadata::ParquetMetaData;
use parquet::file::statistics::Statistics;
use sieve_fragment::{
    join_filter_id, narrow, needed_columns, slice_plan, wire_schema, DecodedBody,
    FragmentBodyRegistration, FragmentEnvelope, IpcCodec, JoinFilterRegistration, SliceMetrics,
    SlicePlan, SliceSource, JOIN_FILTER_ID_BYTES,
};

use crate::cpu::thread_cpu_nanos;
use crate::faults::Faults;
use crate::join_filters::{BodyRegistry, JoinFilterRegistry};
use crate::reader::SliceReaderFactory;
use crate::{MatchHints, NodeCatalog};

/// Settings of the storage node's executor.
#[derive(Debug, Clone)]
pub struct ExecuteOptions {
    /// Evaluate the predicate inside the Parquet decoder (late
    /// materialisation) in addition to the exact filter.
    pub pushdown_filters: bool,
    /// Target rows per shipped batch.
    pub batch_rows: usize,
    /// Upper bound on the decoded-fragment cache, in bytes (each entry is
    /// charged its key and an estimate of its decoded size); the cache is
    /// emptied when full. A TPC-H fragment is a few kilobytes.
    pub fragment_cache_bytes_max: usize,
    /// Upper bound on the slices' metadata the node keeps in memory (the
    /// footers and page indexes its requests read; see
    /// [`crate::catalog::SliceDetailsCache`]), in bytes.
    pub slice_details_cache_bytes: usize,
    /// Codec of the shipped Arrow IPC buffers when the request leaves it to
    /// the node: zstd ships least (below the stored Parquet), LZ4 costs less
    /// CPU, none least CPU of all; auto is LZ4 for a peer on this host and
    /// zstd for one across a network.
    pub ipc_compression: IpcCodec,
    /// Slices whose fragment the node processes at once: the threads of its
    /// pushdown pool. Zero serves every slice raw.
    pub pushdown_workers: usize,
    /// Requests that may wait for a pushdown worker; beyond, a request is
    /// served raw at once. The default, [`PUSHDOWN_QUEUE_PER_WORKER`] per
    /// worker, lets one query's requests queue (a compute node asks for a
    /// few slices per partition at once) and sends the surplus of an
    /// overloaded node raw without making it wait first. None: that default.
    pub pushdown_queue_max: Option<usize>,
    /// Longest a request waits for a pushdown worker before it is served
    /// raw: the safety valve for a node whose slices run unusually long.
    pub pushdown_wait: Duration,
}

impl Default for ExecuteOptions {
    fn default() -> Self {
        let cores = std::thread::available_parallelism()
            .map(|cores| cores.get())
            .unwrap_or(1);
        Self {
            pushdown_filters: false,
            batch_rows: 8192,
            fragment_cache_bytes_max: 32 * 1024 * 1024,
            slice_details_cache_bytes: crate::catalog::SLICE_DETAILS_CACHE_BYTES_DEFAULT,
            ipc_compression: IpcCodec::Auto,
            pushdown_workers: cores,
            pushdown_queue_max: None,
            pushdown_wait: Duration::from_millis(DEFAULT_PUSHDOWN_WAIT_MS),
        }
    }
}

/// Default of [`ExecuteOptions::pushdown_wait`], in milliseconds. At 50 ms
/// (the first default) a lone TPC-H query at SF 1 already had slices served
/// raw: its 7 lineitem requests over 3 nodes of 2 workers queue one slice
/// deep, and a slice takes 100-300 ms, so Q1 shipped 7.2 MB instead of a
/// few kilobytes. Queue depth, not a short timer, is what says a node is
/// overloaded.
pub const DEFAULT_PUSHDOWN_WAIT_MS: u64 = 1000;

/// Default requests waiting per pushdown worker: four rounds of slices.
pub const PUSHDOWN_QUEUE_PER_WORKER: usize = 4;

impl ExecuteOptions {
    /// Requests that may wait for a pushdown worker, the default resolved.
    pub fn queue_max(&self) -> usize {
        self.pushdown_queue_max
            .unwrap_or(PUSHDOWN_QUEUE_PER_WORKER * self.pushdown_workers)
    }
}

/// Runs fragments over the slices of one node's catalog.
#[derive(Debug)]
pub struct SliceExecutor {
    catalog: Arc<NodeCatalog>,
    task_context: Arc<TaskContext>,
    store: Arc<dyn ObjectStore>,
    options: ExecuteOptions,
    cache: Mutex<FragmentCache>,
    fragments_decoded: AtomicU64,
    counters: NodeCounters,
    join_filters: JoinFilterRegistry,
    /// Held while a join filter registration is decoded: one at a time, so
    /// the copies a large one passes through (a key bitmap over SF 100's
    /// order keys is 75 MB) are not multiplied by concurrent queries.
    decoding_join_filter: Mutex<()>,
    bodies: BodyRegistry,
    faults: Arc<Faults>,
}

/// A storage node's running totals, for the `stats` Flight action: what a
/// benchmark reads before and after a query to see the node's share.
#[derive(Debug, Default)]
pub struct NodeCounters {
    /// Slices whose fragment ran to the end.
    pub slices_served: AtomicU64,
    /// Bytes of slice files those fragments read (pages, indexes, filters).
    pub fragment_bytes_read: AtomicU64,
    /// Rows those fragments scanned.
    pub rows_scanned: AtomicU64,
    /// Rows they shipped.
    pub rows_returned: AtomicU64,
    /// Bytes served by the byte-range endpoint.
    pub range_bytes_served: Arc<AtomicU64>,
    /// Slices served raw (pages as stored) because the node was busy.
    pub slices_raw: AtomicU64,
    /// Slices served as stored because the compute node asked (nothing to
    /// push).
    pub slices_as_stored: AtomicU64,
    /// Bytes of raw pages shipped, either way.
    pub raw_bytes_served: AtomicU64,
    /// Most slices processed at once so far.
    pub slices_running_max: AtomicU64,
    /// Bytes of the key bitmaps in registered join filters, whole.
    pub join_filter_bitmap_bytes: AtomicU64,
    /// Bytes of those bitmaps the node kept: each cut to the key ranges of
    /// its slices.
    pub join_filter_bitmap_bytes_kept: AtomicU64,
}

impl NodeCounters {
    /// Count a slice whose fragment finished, or that was served raw.
    pub fn record(&self, metrics: &SliceMetrics) {
        self.slices_served.fetch_add(1, Ordering::Relaxed);
        if !metrics.processed {
            if metrics.raw_reason == crate::raw::RAW_ASKED {
                self.slices_as_stored.fetch_add(1, Ordering::Relaxed);
            } else {
                self.slices_raw.fetch_add(1, Ordering::Relaxed);
            }
            self.raw_bytes_served
                .fetch_add(metrics.raw_bytes, Ordering::Relaxed);
            return;
        }
        self.slices_running_max
            .fetch_max(u64::from(metrics.node_slices_running), Ordering::Relaxed);
        self.fragment_bytes_read
            .fetch_add(metrics.bytes_read, Ordering::Relaxed);
        self.rows_scanned
            .fetch_add(metrics.rows_scanned, Ordering::Relaxed);
        self.rows_returned
            .fetch_add(metrics.rows_returned, Ordering::Relaxed);
    }

    /// The counters as a JSON object.
    pub fn to_json(&self) -> serde_json::Value {
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        serde_json::json!({
            "slices_served": load(&self.slices_served),
            "fragment_bytes_read": load(&self.fragment_bytes_read),
            "rows_scanned": load(&self.rows_scanned),
            "rows_returned": load(&self.rows_returned),
            "range_bytes_served": load(&self.range_bytes_served),
            "slices_raw": load(&self.slices_raw),
            "slices_as_stored": load(&self.slices_as_stored),
            "raw_bytes_served": load(&self.raw_bytes_served),
            "slices_running_max": load(&self.slices_running_max),
            "join_filter_bitmap_bytes": load(&self.join_filter_bitmap_bytes),
            "join_filter_bitmap_bytes_kept": load(&self.join_filter_bitmap_bytes_kept),
        })
    }
}

impl SliceExecutor {
    /// An executor over `catalog`.
    pub fn new(catalog: Arc<NodeCatalog>, options: ExecuteOptions) -> Self {
        let context = SessionContext::new();
        // Fragments name `min` and `max`: grouped ones over floats in total
        // order, as the compute node runs them.
        for function in sieve_fragment::corrected_aggregates() {
            context.register_udaf(function);
        }
        Self {
            catalog,
            task_context: context.task_ctx(),
            store: Arc::new(LocalFileSystem::new()),
            cache: Mutex::new(FragmentCache::new(options.fragment_cache_bytes_max)),
            options,
            fragments_decoded: AtomicU64::new(0),
            counters: NodeCounters::default(),
            join_filters: JoinFilterRegistry::default(),
            decoding_join_filter: Mutex::new(()),
            bodies: BodyRegistry::default(),
            faults: Arc::new(Faults::new()),
        }
    }

    /// This executor with the fault switch of its node (see
    /// [`Faults::pace_reads`]).
    pub fn with_faults(mut self, faults: Arc<Faults>) -> Self {
        self.faults = faults;
        self
    }

    /// The join filters registered on this node.
    pub fn join_filters(&self) -> &JoinFilterRegistry {
        &self.join_filters
    }

    /// Decompress, decode, check and keep a join filter registration (a
    /// compressed, encoded `sieve_fragment::JoinFilterRegistration`);
    /// returns its id. A key bitmap in it is cut to the key ranges this
    /// node's slices of the table hold ([`key_ranges`]). Blocking: one
    /// registration is decoded at a time.
    pub fn register_join_filter(&self, body: &[u8]) -> Result<[u8; JOIN_FILTER_ID_BYTES]> {
        let _one_at_a_time = self
            .decoding_join_filter
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let bytes = JoinFilterRegistration::decompress(body)?;
        let decoded = JoinFilterRegistration::decode_checked(
            bytes,
            |table| Ok(Arc::clone(&self.catalog.table(table)?.schema)),
            |table| {
                let table = self.catalog.table(table).ok()?;
                let ranges: sieve_fragment::KeyRanges =
                    Arc::new(move |column, data_type| key_ranges(&table, column, data_type));
                Some(ranges)
            },
            &self.task_context,
        )?;
        decoded.filter.apply(|node| {
            if let Some(bitmap) = node.downcast_ref::<sieve_fragment::KeyBitmapExpr>() {
                self.counters
                    .join_filter_bitmap_bytes
                    .fetch_add(bitmap.bits().div_ceil(64) * 8, Ordering::Relaxed);
                self.counters
                    .join_filter_bitmap_bytes_kept
                    .fetch_add(bitmap.byte_len() as u64, Ordering::Relaxed);
            }
            Ok(TreeNodeRecursion::Continue)
        })?;
        let id = decoded.id;
        self.join_filters
            .register(decoded)
            .map_err(|reason| plan_datafusion_err!("{reason}"))?;
        Ok(id)
    }

    /// The fragment bodies registered on this node.
    pub fn bodies(&self) -> &BodyRegistry {
        &self.bodies
    }

    /// Decompress, decode, check (against its table's schema and the
    /// allow-list, as a body in a request is) and keep a fragment body
    /// registration (a compressed, encoded
    /// `sieve_fragment::FragmentBodyRegistration`); returns its id.
    pub fn register_fragment_body(&self, body: &[u8]) -> Result<[u8; JOIN_FILTER_ID_BYTES]> {
        let (registration, id) = FragmentBodyRegistration::decode_checked(body)?;
        let schema = Arc::clone(&self.catalog.table(&registration.table)?.schema);
        let decoded = DecodedBody::decode(&registration.body, &schema, &self.task_context)?;
        self.bodies
            .insert(
                id,
                registration.table,
                Arc::new(decoded),
                registration.body.len(),
            )
            .map_err(|reason| plan_datafusion_err!("{reason}"))?;
        Ok(id)
    }

    /// The node's running totals.
    pub fn counters(&self) -> &NodeCounters {
        &self.counters
    }

    /// The executor's settings.
    pub fn options(&self) -> &ExecuteOptions {
        &self.options
    }

    /// The catalog this executor serves.
    pub fn catalog(&self) -> &Arc<NodeCatalog> {
        &self.catalog
    }

    /// How many fragment bodies have been decoded (cache misses).
    pub fn fragments_decoded(&self) -> u64 {
        self.fragments_decoded.load(Ordering::Relaxed)
    }

    /// Decode a ticket's fragment body for `table` (cached by content hash),
    /// checked against the table's schema and the allow-list.
    pub fn body_for(&self, envelope: &FragmentEnvelope) -> Result<Arc<DecodedBody>> {
        let (table, _) = self.catalog.slice(&envelope.table, envelope.slice)?;
        let schema = Arc::clone(&table.schema);
        self.decoded_body(envelope, &schema)
    }

    /// Decode a ticket (an encoded [`FragmentEnvelope`]) and start running it.
    /// Every failure here is a clear error about the request; nothing panics.
    pub async fn execute(&self, ticket: &[u8]) -> Result<SliceStream> {
        let envelope = FragmentEnvelope::decode_checked(ticket)?;
        let (table, slice) = self.catalog.slice(&envelope.table, envelope.slice)?;
        let schema = Arc::clone(&table.schema);
        let mut body = self.decoded_body(&envelope, &schema)?;
        let deleted = (!envelope.deleted.is_empty())
            .then(|| sieve_fragment::decode_deletions(&envelope.deleted))
            .transpose()?;
        let mut join_filter_missing = false;
        if !envelope.join_filter.is_empty() {
            let id = join_filter_id(&envelope.join_filter)?;
            match self
                .join_filters
                .get(&id, &envelope.table)
                .map_err(|reason| plan_datafusion_err!("{reason}"))?
            {
                Some(filter) => body = Arc::new(body.with_join_filter(filter)),
                // A join filter only drops rows the join drops: without
                // it the answer is the same, with more rows shipped.
                None => join_filter_missing = true,
            }
        }
        if !envelope.join_filter_part.is_empty() {
            let bytes = JoinFilterRegistration::decompress_part(&envelope.join_filter_part)?;
            let part = JoinFilterRegistration::decode_checked(
                bytes,
                |_| Ok(Arc::clone(&schema)),
                |_| None,
                &self.task_context,
            )?;
            if part.table != envelope.table {
                return plan_err!(
                    "join filter part is over table {}, the request over {}",
                    part.table,
                    envelope.table
                );
            }
            body = Arc::new(body.with_join_filter(part.filter));
        }

        let needed = needed_columns(&body);

        let row_group_count = slice.summary.row_groups as usize;
        let wanted = wanted_row_groups(&envelope, row_group_count)?;
        let details = slice.details_async().await?;
        let hints = {
            let (slice, details, schema, needed, predicate) = (
                Arc::clone(&slice),
                Arc::clone(&details),
                Arc::clone(&schema),
                needed.clone(),
                body.predicate.clone(),
            );
            let wanted = (!wanted.is_empty()).then_some(wanted);
            tokio::task::spawn_blocking(move || {
                MatchHints::compute(
                    &slice,
                    &details,
                    &schema,
                    &needed,
                    predicate.as_ref(),
                    wanted.as_deref(),
                )
            })
            .await
            .map_err(|error| internal_datafusion_err!("coarse stage task failed: {error}"))??
        };

        let SlicePlan {
            plan,
            aggregated_input,
        } = slice_plan(
            &schema,
            &body,
            SliceSource {
                reader_factory: Arc::new(SliceReaderFactory {
                    store: Arc::clone(&self.store),
                    slice: Arc::clone(&slice),
                    details: Arc::clone(&details),
                    faults: Arc::clone(&self.faults),
                }),
                store_url: ObjectStoreUrl::local_filesystem(),
                location: slice.object_path.to_string(),
                file_bytes: slice.summary.bytes,
                access_plan: match &deleted {
                    // Rows deleted at the version the query reads stay out.
                    Some(deleted) => sieve_fragment::apply_deletions(
                        hints.access_plan.clone(),
                        &slice.summary.row_group_rows,
                        deleted,
                    ),
                    None => hints.access_plan.clone(),
                },
                batch_rows: self.options.batch_rows,
                pushdown_filters: self.options.pushdown_filters,
                row_positions: envelope.row_positions,
            },
        )?;
        let inner = plan.execute(0, Arc::clone(&self.task_context))?;
        // Shipped table columns whose every value fits in 32 bits (by the
        // slice's statistics) travel as Int32; see `sieve_fragment::wire_type`.
        let fits: Vec<bool> = match &body.aggregate {
            Some(_) => vec![],
            None => body
                .projection
                .iter()
                .map(|&column| int64_fits_in_32_bits(&details.metadata, column))
                // Row positions travel as they are.
                .chain(envelope.row_positions.then_some(false))
                .collect(),
        };
        // Partial aggregation states travel as they are: they are few, and a
        // computed decimal need not respect its declared precision (DataFusion
        // does not enforce it), so it may not fit a narrower type.
        let schema = match &body.aggregate {
            Some(_) => plan.schema(),
            None => wire_schema(&plan.schema(), &fits),
        };
        Ok(SliceStream {
            schema,
            inner,
            plan,
            aggregated_input,
            hints,
            cpu_nanos: 0,
            rows_returned: 0,
            admission: Admitted::default(),
            join_filter_missing,
        })
    }

    fn decoded_body(
        &self,
        envelope: &FragmentEnvelope,
        schema: &SchemaRef,
    ) -> Result<Arc<DecodedBody>> {
        // Decoded under the lock: the slice requests of one query arrive
        // together, and each body is decoded once, not once per request
        // that missed the cache before the first had filled it (bodies are
        // bounded by the request limits; a decode usually takes well under
        // a millisecond).
        if !envelope.body_id.is_empty() {
            let id = join_filter_id(&envelope.body_id)?;
            let held = if self.faults.fragment_bodies_forgotten() {
                None
            } else {
                self.bodies
                    .get(&id, &envelope.table)
                    .map_err(|reason| plan_datafusion_err!("{reason}"))?
            };
            return match held {
                Some(body) => Ok(body),
                None => Err(sieve_fragment::BodyNotHeld {
                    message: "the fragment body this request names is not registered on this node"
                        .to_string(),
                }
                .into_error()),
            };
        }
        let mut cache = self.cache.lock().expect("cache lock is never poisoned");
        if let Some(found) = cache.get(&envelope.table, &envelope.body) {
            return Ok(found);
        }
        let body = Arc::new(DecodedBody::decode(
            &envelope.body,
            schema,
            &self.task_context,
        )?);
        self.fragments_decoded.fetch_add(1, Ordering::Relaxed);
        cache.insert(&envelope.table, &envelope.body, Arc::clone(&body));
        Ok(body)
    }
}

/// Decoded fragment bodies by table and the body's bytes. The key is the
/// whole content, compared byte for byte: two fragments never share an
/// entry. The cache is bounded in bytes ([`FragmentCache::charge`]) and
/// emptied when full; only bodies that decoded and passed every check enter.
#[derive(Debug)]
struct FragmentCache {
    entries: HashMap<String, HashMap<Vec<u8>, Arc<DecodedBody>>>,
    bytes: usize,
    bytes_max: usize,
}

/// Decoded size charged per encoded byte of a body: a decoded expression
/// tree (boxed nodes, Arcs, schemas) is several times its protobuf.
const DECODED_BYTES_PER_BODY_BYTE: usize = 8;

/// Fixed charge per entry (the key, the map's slot, the body's vectors).
const ENTRY_BYTES: usize = 1024;

impl FragmentCache {
    fn new(bytes_max: usize) -> Self {
        Self {
            entries: HashMap::new(),
            bytes: 0,
            bytes_max,
        }
    }

    /// What an entry counts against the bound: its key and decoded body.
    fn charge(table: &str, body: &[u8]) -> usize {
        ENTRY_BYTES + table.len() + body.len() * (1 + DECODED_BYTES_PER_BODY_BYTE)
    }

    fn get(&self, table: &str, body: &[u8]) -> Option<Arc<DecodedBody>> {
        self.entries.get(table)?.get(body).map(Arc::clone)
    }

    fn insert(&mut self, table: &str, body: &[u8], decoded: Arc<DecodedBody>) {
        let charge = Self::charge(table, body);
        if charge > self.bytes_max {
            return;
        }
        if self
            .entries
            .get(table)
            .is_some_and(|bodies| bodies.contains_key(body))
        {
            return;
        }
        if self.bytes + charge > self.bytes_max {
            self.entries.clear();
            self.bytes = 0;
        }
        if self
            .entries
            .entry(table.to_string())
            .or_default()
            .insert(body.to_vec(), decoded)
            .is_none()
        {
            self.bytes += charge;
        }
    }
}

/// The batches of one slice through its fragment, with what it cost.
pub struct SliceStream {
    schema: SchemaRef,
    inner: SendableRecordBatchStream,
    plan: Arc<dyn ExecutionPlan>,
    /// The slice plan under a pushed aggregation, for its output row count.
    aggregated_input: Option<Arc<dyn ExecutionPlan>>,
    hints: MatchHints,
    cpu_nanos: u64,
    rows_returned: u64,
    admission: Admitted,
    join_filter_missing: bool,
}

/// How a request got its pushdown worker.
#[derive(Debug, Clone, Copy, Default)]
pub struct Admitted {
    /// Time spent waiting for the worker.
    pub waited: Duration,
    /// Slices processing on the node when it started, itself included.
    pub running: u32,
}

impl std::fmt::Debug for SliceStream {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("SliceStream")
            .field("schema", &self.schema)
            .finish_non_exhaustive()
    }
}

impl SliceStream {
    /// Schema of the shipped batches.
    pub fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }

    /// The plan the slice runs through, whose metrics move as it works.
    pub fn plan(&self) -> Arc<dyn ExecutionPlan> {
        Arc::clone(&self.plan)
    }

    /// Record how the request was admitted to the pushdown pool.
    pub fn set_admission(&mut self, admission: Admitted) {
        self.admission = admission;
    }

    /// What the node did so far (complete once the stream has ended).
    pub fn metrics(&self) -> SliceMetrics {
        let bytes_scanned: usize = collect_metric(&self.plan, "bytes_scanned");
        SliceMetrics {
            bytes_read: bytes_scanned as u64 + self.hints.bloom_filter_bytes_read,
            pages_considered: self.hints.pages_considered,
            pages_skipped_statistics: self.hints.pages_skipped_statistics,
            pages_skipped_page_index: self.hints.pages_skipped_page_index,
            pages_skipped_bloom_filter: self.hints.pages_skipped_bloom_filter,
            rows_scanned: self.hints.rows_selected,
            rows_returned: self.rows_returned,
            cpu_nanos: self.cpu_nanos,
            processed: true,
            rows_aggregated: self
                .aggregated_input
                .as_ref()
                .and_then(|input| input.metrics())
                .and_then(|metrics| metrics.output_rows())
                .unwrap_or(0) as u64,
            raw_reason: String::new(),
            queue_wait_nanos: self.admission.waited.as_nanos() as u64,
            node_slices_running: self.admission.running,
            raw_bytes: 0,
            join_filter_missing: self.join_filter_missing,
        }
    }
}

/// The value ranges (inclusive) this node's slices of `table` hold in
/// `column`, by their statistics, merged where they touch: `None` unless
/// every slice has both bounds as an integer or a date (a key bitmap is
/// then kept whole). The ranges only decide which chunks of a bitmap are
/// kept; values outside them pass, so a slice whose statistics are off is
/// filtered less, never wrongly.
pub(crate) fn key_ranges(
    table: &crate::CatalogTable,
    column: &str,
    data_type: &arrow::datatypes::DataType,
) -> Option<Vec<(i64, i64)>> {
    let as_i64 = |text: &Option<String>| sieve_fragment::key_bound(text.as_deref()?, data_type);
    let mut ranges = table
        .slices
        .values()
        .map(|slice| {
            let summary = slice
                .summary
                .columns
                .iter()
                .find(|summary| summary.name == column)?;
            Some((as_i64(&summary.min)?, as_i64(&summary.max)?))
        })
        .collect::<Option<Vec<_>>>()?;
    ranges.sort_unstable();
    let mut merged: Vec<(i64, i64)> = Vec::with_capacity(ranges.len());
    for (low, high) in ranges {
        match merged.last_mut() {
            Some(last) if low <= last.1.saturating_add(1) => last.1 = last.1.max(high),
            _ => merged.push((low, high)),
        }
    }
    Some(merged)
}

/// Whether every value of leaf column `column` of the slice lies in the
/// `i32` range, by the row groups' statistics (false when any is missing or
/// the column is not INT64).
fn int64_fits_in_32_bits(metadata: &ParquetMetaData, column: usize) -> bool {
    let range = i64::from(i32::MIN)..=i64::from(i32::MAX);
    metadata.row_groups().iter().all(|row_group| {
        let Some(chunk) = row_group.columns().get(column) else {
            return false;
        };
        match chunk.statistics() {
            Some(Statistics::Int64(values)) => {
                let null_only = values.min_opt().is_none()
                    && values.max_opt().is_none()
                    && values.null_count_opt() == Some(row_group.num_rows() as u64);
                null_only
                    || matches!(
                        (values.min_opt(), values.max_opt()),
                        (Some(min), Some(max)) if range.contains(min) && range.contains(max)
                    )
            }
            _ => false,
        }
    })
}

/// The row groups an envelope asks for (empty: all), checked against the slice.
pub(crate) fn wanted_row_groups(
    envelope: &FragmentEnvelope,
    row_group_count: usize,
) -> Result<Vec<usize>> {
    let mut wanted: Vec<usize> = envelope
        .row_groups
        .iter()
        .map(|&group| group as usize)
        .collect();
    wanted.sort_unstable();
    wanted.dedup();
    if let Some(bad) = wanted.iter().find(|&&group| group >= row_group_count) {
        return plan_err!(
            "row group {bad} of slice {} of {} does not exist (the slice has {row_group_count})",
            envelope.slice,
            envelope.table
        );
    }
    Ok(wanted)
}

/// A count of the work `plan` has done so far: the sum of every metric of
/// every operator (rows, bytes, batches, time). It moves while the plan
/// works and stands still while it is stuck.
pub(crate) fn work_done(plan: &Arc<dyn ExecutionPlan>) -> u64 {
    let own = plan
        .metrics()
        .map(|metrics| {
            metrics.iter().fold(0u64, |sum, metric| {
                sum.wrapping_add(metric.value().as_usize() as u64)
            })
        })
        .unwrap_or(0);
    plan.children()
        .iter()
        .fold(own, |sum, child| sum.wrapping_add(work_done(child)))
}

fn collect_metric(plan: &Arc<dyn ExecutionPlan>, name: &str) -> usize {
    let own = plan
        .metrics()
        .and_then(|metrics| metrics.sum_by_name(name))
        .map(|value| value.as_usize())
        .unwrap_or(0);
    own + plan
        .children()
        .iter()
        .map(|child| collect_metric(child, name))
        .sum::<usize>()
}

impl Stream for SliceStream {
    type Item = Result<RecordBatch>;

    fn poll_next(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let started = thread_cpu_nanos();
        let polled = match self.inner.as_mut().poll_next(context) {
            Poll::Ready(Some(Ok(batch))) => Poll::Ready(Some(narrow(&batch, &self.schema))),
            other => other,
        };
        let spent = thread_cpu_nanos().saturating_sub(started);
        self.cpu_nanos += spent;
        if let Poll::Ready(Some(Ok(batch))) = &polled {
            self.rows_returned += batch.num_rows() as u64;
        }
        polled
    }
}

#[cfg(test)]
mod cache_tests {
    use std::sync::Arc;

    use sieve_fragment::DecodedBody;

    use super::FragmentCache;

    fn body(column: usize) -> Arc<DecodedBody> {
        Arc::new(DecodedBody {
            projection: vec![column],
            predicate: None,
            aggregate: None,
        })
    }

    /// Two bodies are two entries however alike (no hash stands in for the
    /// bytes), and the cache never holds more than its bound.
    #[test]
    fn the_cache_compares_whole_bodies_and_stays_within_its_bytes() {
        let bound = 4 * FragmentCache::charge("t", &[0; 1000]);
        let mut cache = FragmentCache::new(bound);
        cache.insert("t", &[1, 2, 3], body(1));
        cache.insert("t", &[1, 2, 4], body(2));
        assert_eq!(cache.get("t", &[1, 2, 3]).unwrap().projection, [1]);
        assert_eq!(cache.get("t", &[1, 2, 4]).unwrap().projection, [2]);
        assert!(cache.get("u", &[1, 2, 3]).is_none());
        for round in 0..100u8 {
            cache.insert("t", &[round; 1000], body(3));
            assert!(cache.bytes <= bound, "{} > {bound}", cache.bytes);
        }
        // A body larger than the whole bound is never cached.
        let mut small = FragmentCache::new(100);
        small.insert("t", &[0; 1000], body(0));
        assert!(small.get("t", &[0; 1000]).is_none());
    }
}
