//! The wire messages: the fragment envelope and body, and the metrics a
//! storage node sends back after a slice's last batch.

use std::sync::Arc;

use arrow::datatypes::Schema;
use datafusion::common::{plan_datafusion_err, plan_err, Result};
use datafusion::execution::TaskContext;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::ExecutionPlan;
use datafusion_proto::physical_plan::from_proto::parse_physical_expr;
use datafusion_proto::physical_plan::to_proto::serialize_physical_expr;
use datafusion_proto::physical_plan::AsExecutionPlan;
use datafusion_proto::protobuf::{PhysicalExprNode, PhysicalPlanNode};
use prost::Message;

use crate::{check_allowed, check_plan_allowed, SieveCodec};

/// The only fragment version this build speaks. A storage node refuses any
/// other, so a compute node and a storage node of different versions fail
/// loudly instead of misreading each other.
/// Version 3: a slice stream's non-data messages are [`SliceMessage`]s
/// (metrics, or a slice's raw pages from a busy node). Version 4: join
/// filters' membership tests travel as Bloom filters or key bitmaps.
/// Version 5: join filters are registered on the node once per query
/// ([`crate::JoinFilterRegistration`]) and envelopes name them.
/// Version 6: an envelope may carry a join filter part, the window of a
/// large key bitmap its slice's key range needs.
pub const FRAGMENT_VERSION: u32 = 6;

/// Upper bound on an encoded fragment. A TPC-H predicate encodes to a few
/// kilobytes; an IN list of ten thousand keys to well under a megabyte. Larger
/// requests are refused before any decoding work is done.
pub const FRAGMENT_BYTES_MAX: usize = 4 * 1024 * 1024;

/// The envelope: version, slice address, and the scan-wide body as bytes.
#[derive(Clone, PartialEq, Message)]
pub struct FragmentEnvelope {
    /// Must equal [`FRAGMENT_VERSION`].
    #[prost(uint32, tag = "1")]
    pub version: u32,
    /// Table name.
    #[prost(string, tag = "2")]
    pub table: String,
    /// Slice number within the table.
    #[prost(uint32, tag = "3")]
    pub slice: u32,
    /// An encoded [`FragmentBody`]; identical for all slices of one scan.
    #[prost(bytes = "vec", tag = "4")]
    pub body: Vec<u8>,
    /// Row groups of the slice to process (all if empty): a large slice can
    /// be split over several requests, processed in parallel.
    #[prost(uint32, repeated, tag = "5")]
    pub row_groups: Vec<u32>,
    /// Codec the compute node asks for the shipped Arrow IPC buffers, as
    /// [`IpcCodec::wire`]: 0 leaves the choice to the storage node.
    #[prost(uint32, tag = "6")]
    pub ipc_codec: u32,
    /// Id of a join filter registered on the node
    /// ([`crate::JoinFilterRegistration`]) to apply with the body's
    /// predicate; empty for none.
    #[prost(bytes = "vec", tag = "7")]
    pub join_filter: Vec<u8>,
    /// While the fragment runs without output (a pushed aggregation emits
    /// only at the end of its slice), the node sends a
    /// [`SliceMessageKind::Heartbeat`] after every this many milliseconds
    /// without a message in which the fragment made progress, so that a
    /// long slice is not taken for a hung node. 0: no heartbeats; values
    /// under [`HEARTBEAT_MS_MIN`] count as that.
    #[prost(uint32, tag = "8")]
    pub heartbeat_ms: u32,
    /// The slice's deleted rows at the version the query reads (a table a
    /// user owns): a serialized roaring bitmap of row positions in the
    /// file ([`crate::decode_deletions`]); empty for none.
    #[prost(bytes = "vec", tag = "9")]
    pub deleted: Vec<u8>,
    /// Ship each row's position in the slice file (an Int64 column after
    /// the projected ones): what DELETE and UPDATE ask for. Not with a
    /// pushed aggregation.
    #[prost(bool, tag = "10")]
    pub row_positions: bool,
    /// Id of a fragment body registered on the node
    /// ([`crate::FragmentBodyRegistration`]) to run in place of `body`,
    /// which is then empty; empty for none.
    #[prost(bytes = "vec", tag = "11")]
    pub body_id: Vec<u8>,
    /// Serve the slice's pages as stored, without running the fragment:
    /// asked when the body has nothing for the node to do (no predicate,
    /// join filter or aggregation, only a projection), where decoding and
    /// re-encoding would cost the node CPU and ship more bytes than the
    /// compressed pages. The compute node decodes them, as it does for a
    /// busy node's raw slices. Not with `row_positions`.
    #[prost(bool, tag = "12")]
    pub raw: bool,
    /// A join filter part: a compressed, encoded
    /// [`crate::JoinFilterRegistration`] applied with the body's predicate
    /// and the registered join filter, sent with this request only. It
    /// holds the windows of large key bitmaps this slice's key range needs
    /// ([`crate::KeyBitmapExpr::window`]), so that a node holds a bitmap's
    /// chunks only while it works on the slices that need them. Empty for
    /// none.
    #[prost(bytes = "vec", tag = "13")]
    pub join_filter_part: Vec<u8>,
}

/// The shortest heartbeat interval a storage node honours, in milliseconds:
/// a request cannot make a node send messages faster than this.
pub const HEARTBEAT_MS_MIN: u32 = 50;

/// Codec of the Arrow IPC buffers a storage node ships. Compression trades
/// CPU on both ends for bytes on the link: zstd is worth its CPU on a
/// network; on a host's own loopback only LZ4 is cheap enough (TPC-H SF 1:
/// 2.6x fewer bytes than none for about 2% more wall time).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IpcCodec {
    /// LZ4 for a peer on the same host (loopback), zstd otherwise.
    #[default]
    Auto,
    /// Uncompressed buffers.
    None,
    /// LZ4 frames: cheaper than zstd, larger.
    Lz4,
    /// Zstandard: the fewest bytes.
    Zstd,
}

impl IpcCodec {
    /// The envelope's encoding (tag 6).
    pub fn wire(self) -> u32 {
        match self {
            Self::Auto => 0,
            Self::None => 1,
            Self::Lz4 => 2,
            Self::Zstd => 3,
        }
    }

    /// Decode the envelope's tag 6; unknown values are refused.
    pub fn from_wire(value: u32) -> Result<Self> {
        Ok(match value {
            0 => Self::Auto,
            1 => Self::None,
            2 => Self::Lz4,
            3 => Self::Zstd,
            other => return plan_err!("unknown IPC codec {other} in NDP fragment"),
        })
    }

    /// Parse a setting: `auto`, `none`, `lz4` or `zstd`.
    pub fn parse(text: &str) -> Result<Self> {
        Ok(match text.to_ascii_lowercase().as_str() {
            "auto" => Self::Auto,
            "none" => Self::None,
            "lz4" => Self::Lz4,
            "zstd" => Self::Zstd,
            other => return plan_err!("IPC codec must be auto, none, lz4 or zstd, not '{other}'"),
        })
    }

    /// The Arrow codec for a peer; `loopback` says whether the peer shares
    /// this host, which only matters for [`IpcCodec::Auto`].
    pub fn resolve(self, loopback: bool) -> Option<arrow::ipc::CompressionType> {
        match self {
            Self::Auto if loopback => Some(arrow::ipc::CompressionType::LZ4_FRAME),
            Self::Auto | Self::Zstd => Some(arrow::ipc::CompressionType::ZSTD),
            Self::None => None,
            Self::Lz4 => Some(arrow::ipc::CompressionType::LZ4_FRAME),
        }
    }
}

/// What to do with the slice. Join filters travel inside `predicate` (as
/// ranges, IN lists and Bloom filters); tags 5 and up are reserved for a
/// snapshot version.
#[derive(Clone, PartialEq, Message)]
pub struct FragmentBody {
    /// [`schema_fingerprint`] of the table schema the fragment was planned on.
    #[prost(uint64, tag = "1")]
    pub schema_fingerprint: u64,
    /// Columns to ship, as indices into the table schema, in output order.
    #[prost(uint32, repeated, tag = "2")]
    pub projection: Vec<u32>,
    /// Exact filter over the table schema; absent means keep every row.
    #[prost(message, optional, tag = "3")]
    pub predicate: Option<PhysicalExprNode>,
    /// Operators to run over the filtered, projected slice (a partial
    /// aggregation, possibly over projections and filters), as a
    /// datafusion-proto plan whose leaf is a `SliceInputExec`.
    #[prost(message, optional, tag = "4")]
    pub aggregate: Option<PhysicalPlanNode>,
}

/// What a storage node did for one slice; sent as the `app_metadata` of a
/// final body-less Flight message after the slice's last batch.
#[derive(Clone, PartialEq, Message)]
pub struct SliceMetrics {
    /// Bytes read from the slice file (data pages, dictionaries, Bloom filters).
    #[prost(uint64, tag = "1")]
    pub bytes_read: u64,
    /// Data pages of the columns the fragment needs, over all row groups.
    #[prost(uint64, tag = "2")]
    pub pages_considered: u64,
    /// Pages ruled out by row-group min/max statistics.
    #[prost(uint64, tag = "3")]
    pub pages_skipped_statistics: u64,
    /// Pages ruled out by the page index (per-page min/max).
    #[prost(uint64, tag = "4")]
    pub pages_skipped_page_index: u64,
    /// Pages ruled out by Bloom filters.
    #[prost(uint64, tag = "5")]
    pub pages_skipped_bloom_filter: u64,
    /// Rows decoded from the pages that were read.
    #[prost(uint64, tag = "6")]
    pub rows_scanned: u64,
    /// Rows that passed the exact filter and were shipped.
    #[prost(uint64, tag = "7")]
    pub rows_returned: u64,
    /// CPU time the storage node spent evaluating the fragment.
    #[prost(uint64, tag = "8")]
    pub cpu_nanos: u64,
    /// Whether the fragment's work was done on the node (false: the node
    /// was busy and shipped the slice's raw pages; the compute node ran it).
    #[prost(bool, tag = "9")]
    pub processed: bool,
    /// Rows that entered the pushed aggregation (after the exact filter).
    #[prost(uint64, tag = "10")]
    pub rows_aggregated: u64,
    /// Why the slice was served raw (empty when processed).
    #[prost(string, tag = "11")]
    pub raw_reason: String,
    /// Time the request waited for a pushdown worker.
    #[prost(uint64, tag = "12")]
    pub queue_wait_nanos: u64,
    /// Slices the node was processing when this one started, itself included:
    /// the node's parallelism as this request saw it.
    #[prost(uint32, tag = "13")]
    pub node_slices_running: u32,
    /// Bytes of raw pages shipped (footer and column chunks).
    #[prost(uint64, tag = "14")]
    pub raw_bytes: u64,
    /// The envelope named a join filter the node does not hold (it
    /// restarted, or dropped it to stay within its bound): the slice ran
    /// without it.
    #[prost(bool, tag = "15")]
    pub join_filter_missing: bool,
}

/// A message of a slice stream that is not Arrow IPC data: it travels in a
/// Flight message's `app_metadata`, with an empty data header.
///
/// ```text
///   processed:  [IPC schema] [IPC batch]* Metrics   (Heartbeats in between)
///   raw:        Raw (footer, ranges) RawChunk* Metrics
/// ```
#[derive(Clone, PartialEq, Message)]
pub struct SliceMessage {
    /// What the message is.
    #[prost(oneof = "SliceMessageKind", tags = "1, 2, 3, 4")]
    pub kind: Option<SliceMessageKind>,
}

/// The kinds of [`SliceMessage`].
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum SliceMessageKind {
    /// The slice is complete: what the node did. Always the last message.
    #[prost(message, tag = "1")]
    Metrics(SliceMetrics),
    /// The slice comes raw: the pages follow as [`SliceMessageKind::RawChunk`]s.
    #[prost(message, tag = "2")]
    Raw(RawSlice),
    /// Bytes of the slice file starting at this offset; the bytes are the
    /// Flight message's body.
    #[prost(uint64, tag = "3")]
    RawChunk(u64),
    /// The fragment is still running and has made progress since the last
    /// message (the value: the node's count of its work so far, opaque).
    /// Sent only when the request asked for heartbeats.
    #[prost(uint64, tag = "4")]
    Heartbeat(u64),
}

/// The head of a raw slice: enough for the compute node to decode the pages
/// that follow and run the fragment itself.
#[derive(Clone, PartialEq, Message)]
pub struct RawSlice {
    /// Size of the slice file.
    #[prost(uint64, tag = "1")]
    pub file_bytes: u64,
    /// The Parquet footer (the file's metadata, without page indexes).
    #[prost(bytes = "vec", tag = "2")]
    pub footer: Vec<u8>,
    /// The byte ranges that follow: every column chunk the fragment needs,
    /// in the requested row groups.
    #[prost(message, repeated, tag = "3")]
    pub ranges: Vec<ByteRange>,
    /// Row groups shipped, ascending.
    #[prost(uint32, repeated, tag = "4")]
    pub row_groups: Vec<u32>,
    /// Why the node did not process the slice.
    #[prost(string, tag = "5")]
    pub reason: String,
}

/// A byte range of a slice file.
#[derive(Clone, PartialEq, Message)]
pub struct ByteRange {
    /// First byte.
    #[prost(uint64, tag = "1")]
    pub offset: u64,
    /// Length in bytes.
    #[prost(uint64, tag = "2")]
    pub length: u64,
}

impl SliceMetrics {
    /// Pages actually read: considered minus every kind of skip.
    pub fn pages_read(&self) -> u64 {
        self.pages_considered.saturating_sub(
            self.pages_skipped_statistics
                + self.pages_skipped_page_index
                + self.pages_skipped_bloom_filter,
        )
    }
}

/// A stable 64-bit fingerprint (FNV-1a) of a schema's column names, types and
/// nullability. Both sides compute it, so a fragment planned against another
/// version of a table is refused rather than misread.
pub fn schema_fingerprint(schema: &Schema) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for field in schema.fields() {
        let text = format!(
            "{}:{}:{};",
            field.name(),
            field.data_type(),
            field.is_nullable()
        );
        for byte in text.bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    hash
}

/// A fragment as the compute node builds it, before encoding.
#[derive(Debug, Clone)]
pub struct Fragment {
    /// Columns to ship, as indices into the table schema.
    pub projection: Vec<usize>,
    /// Exact filter over the table schema.
    pub predicate: Option<Arc<dyn PhysicalExpr>>,
    /// Partial aggregation over the projected rows: a plan whose leaf is a
    /// [`crate::SliceInputExec`] with the projection's schema.
    pub aggregate: Option<Arc<dyn ExecutionPlan>>,
}

impl Fragment {
    /// Check the fragment against `schema` and the allow-list, then encode
    /// its body. The same checks run again on the storage node after decoding.
    pub fn encode_body(&self, schema: &Schema) -> Result<Vec<u8>> {
        self.encode_body_within(schema, FRAGMENT_BYTES_MAX)
    }

    /// [`Fragment::encode_body`] for a body of at most `bytes_max` bytes (a
    /// registered body may be larger than one sent in each request,
    /// [`crate::REGISTERED_BODY_BYTES_MAX`]).
    pub fn encode_body_within(&self, schema: &Schema, bytes_max: usize) -> Result<Vec<u8>> {
        check_projection(&self.projection, schema)?;
        let predicate = match &self.predicate {
            Some(predicate) => {
                check_allowed(predicate, schema)?;
                Some(serialize_physical_expr(predicate, &SieveCodec::new())?)
            }
            None => None,
        };
        let aggregate = match &self.aggregate {
            Some(plan) => {
                check_plan_allowed(plan)?;
                Some(PhysicalPlanNode::try_from_physical_plan(
                    Arc::clone(plan),
                    &SieveCodec::new(),
                )?)
            }
            None => None,
        };
        let body = FragmentBody {
            schema_fingerprint: schema_fingerprint(schema),
            projection: self.projection.iter().map(|&index| index as u32).collect(),
            predicate,
            aggregate,
        };
        let bytes = body.encode_to_vec();
        if bytes.len() > bytes_max {
            return plan_err!(
                "NDP fragment is {} bytes, above the limit of {bytes_max}",
                bytes.len()
            );
        }
        Ok(bytes)
    }
}

impl FragmentEnvelope {
    /// An envelope for `slice` of `table` carrying an encoded body.
    pub fn new(table: impl Into<String>, slice: u32, body: Vec<u8>) -> Self {
        Self {
            version: FRAGMENT_VERSION,
            table: table.into(),
            slice,
            body,
            row_groups: vec![],
            ipc_codec: IpcCodec::Auto.wire(),
            join_filter: vec![],
            heartbeat_ms: 0,
            deleted: vec![],
            row_positions: false,
            body_id: vec![],
            raw: false,
            join_filter_part: Vec::new(),
        }
    }

    /// This envelope asking for the slice's pages as stored (see
    /// [`FragmentEnvelope::raw`]).
    pub fn with_raw(mut self) -> Self {
        self.raw = true;
        self
    }

    /// This envelope naming the registered body `id` instead of carrying
    /// its body.
    pub fn with_registered_body(mut self, id: &[u8]) -> Self {
        self.body = vec![];
        self.body_id = id.to_vec();
        self
    }

    /// This envelope leaving out the slice's deleted rows (a serialized
    /// deletion vector; empty for none).
    pub fn with_deleted(mut self, deleted: &[u8]) -> Self {
        self.deleted = deleted.to_vec();
        self
    }

    /// This envelope asking for heartbeats every `interval` while the
    /// fragment runs without output (see [`FragmentEnvelope::heartbeat_ms`]).
    pub fn with_heartbeat(mut self, interval: std::time::Duration) -> Self {
        self.heartbeat_ms = (interval.as_millis().min(u128::from(u32::MAX)) as u32).max(1);
        self
    }

    /// The heartbeat interval this envelope asks for, bounded below by
    /// [`HEARTBEAT_MS_MIN`]; `None` for none.
    pub fn heartbeat_interval(&self) -> Option<std::time::Duration> {
        (self.heartbeat_ms > 0).then(|| {
            std::time::Duration::from_millis(u64::from(self.heartbeat_ms.max(HEARTBEAT_MS_MIN)))
        })
    }

    /// This envelope applying the join filter part `part` (see
    /// [`FragmentEnvelope::join_filter_part`]).
    pub fn with_join_filter_part(mut self, part: Vec<u8>) -> Self {
        self.join_filter_part = part;
        self
    }

    /// This envelope applying the registered join filter `id`.
    pub fn with_join_filter(mut self, id: &[u8]) -> Self {
        self.join_filter = id.to_vec();
        self
    }

    /// This envelope asking for `codec` on the shipped batches.
    pub fn with_ipc_codec(mut self, codec: IpcCodec) -> Self {
        self.ipc_codec = codec.wire();
        self
    }

    /// This envelope restricted to `row_groups` of the slice.
    pub fn with_row_groups(mut self, row_groups: Vec<u32>) -> Self {
        self.row_groups = row_groups;
        self
    }

    /// Decode an envelope received over the network, refusing oversized
    /// input, undecodable bytes and unknown versions.
    pub fn decode_checked(bytes: &[u8]) -> Result<Self> {
        if bytes.len() > FRAGMENT_BYTES_MAX {
            return plan_err!(
                "NDP fragment is {} bytes, above the limit of {FRAGMENT_BYTES_MAX}",
                bytes.len()
            );
        }
        let envelope = Self::decode(bytes)
            .map_err(|error| plan_datafusion_err!("malformed NDP fragment: {error}"))?;
        if envelope.version != FRAGMENT_VERSION {
            return plan_err!(
                "NDP fragment version {} is not supported (this node speaks version {FRAGMENT_VERSION})",
                envelope.version
            );
        }
        IpcCodec::from_wire(envelope.ipc_codec)?;
        if !envelope.join_filter.is_empty() {
            crate::join_filter_id(&envelope.join_filter)?;
        }
        if !envelope.body_id.is_empty() {
            crate::join_filter_id(&envelope.body_id)?;
            if !envelope.body.is_empty() {
                return plan_err!("NDP fragment carries a body and names a registered one");
            }
        }
        if envelope.raw && envelope.row_positions {
            return plan_err!("NDP fragment asks for raw pages and for row positions");
        }
        Ok(envelope)
    }
}

/// A fragment body decoded and checked on the storage node.
#[derive(Debug, Clone)]
pub struct DecodedBody {
    /// Columns to ship, as indices into the table schema.
    pub projection: Vec<usize>,
    /// Exact filter over the table schema.
    pub predicate: Option<Arc<dyn PhysicalExpr>>,
    /// Operators over the projected rows, leaf a [`crate::SliceInputExec`].
    pub aggregate: Option<Arc<dyn ExecutionPlan>>,
}

impl DecodedBody {
    /// This body with `filter` (a registered join filter) ANDed into its
    /// predicate: what a storage node runs, and the compute node for a raw
    /// slice.
    pub fn with_join_filter(&self, filter: Arc<dyn PhysicalExpr>) -> Self {
        let mut body = self.clone();
        body.predicate = Some(datafusion::physical_expr::conjunction(
            body.predicate.take().into_iter().chain([filter]),
        ));
        body
    }

    /// Decode `body` against the table `schema`, checking the fingerprint,
    /// the projection and the allow-list.
    pub fn decode(body: &[u8], schema: &Schema, task_context: &TaskContext) -> Result<Self> {
        let body = FragmentBody::decode(body)
            .map_err(|error| plan_datafusion_err!("malformed NDP fragment body: {error}"))?;
        if body.schema_fingerprint != schema_fingerprint(schema) {
            return plan_err!("NDP fragment was planned against another schema of this table");
        }
        let projection: Vec<usize> = body
            .projection
            .iter()
            .map(|&index| index as usize)
            .collect();
        check_projection(&projection, schema)?;
        let predicate = match &body.predicate {
            Some(node) => {
                // datafusion-proto sends a chain of one operator as a flat
                // list, so decoding rebuilds a tree of any depth: it is
                // measured without recursion, and a refused one is dropped
                // without recursion.
                let predicate = parse_physical_expr(node, task_context, schema, &SieveCodec::new())
                    .map_err(|error| {
                        plan_datafusion_err!("NDP fragment predicate cannot be decoded: {error}")
                    })?;
                if let Err(error) = check_allowed(&predicate, schema) {
                    crate::dismantle(predicate);
                    return Err(error);
                }
                Some(predicate)
            }
            None => None,
        };
        if body.aggregate.is_some() && projection.is_empty() {
            // Every aggregate fragment ships at least one column; over none,
            // decoding the operators would look up fields that do not exist.
            return plan_err!("NDP fragment aggregates over an empty projection");
        }
        let aggregate = match &body.aggregate {
            Some(node) => {
                let slice_schema = Arc::new(schema.project(&projection)?);
                let plan = node
                    .try_into_physical_plan(
                        task_context,
                        &SieveCodec::with_slice_schema(slice_schema),
                    )
                    .map_err(|error| {
                        plan_datafusion_err!("NDP fragment operators cannot be decoded: {error}")
                    })?;
                check_plan_allowed(&plan)?;
                Some(plan)
            }
            None => None,
        };
        Ok(Self {
            projection,
            predicate,
            aggregate,
        })
    }
}

/// A projection names each column of the table at most once: a column asked
/// for twice would be decoded and shipped twice (a 126-byte ticket naming
/// `o_comment` 100 times cost a node 114 s of CPU).
fn check_projection(projection: &[usize], schema: &Schema) -> Result<()> {
    let columns = schema.fields().len();
    if projection.len() > columns {
        return plan_err!(
            "NDP fragment projects {} columns, but the table has {columns}",
            projection.len()
        );
    }
    let mut seen = vec![false; columns];
    for &index in projection {
        match seen.get_mut(index) {
            None => {
                return plan_err!(
                    "NDP fragment projects column {index}, but the table has {columns} columns"
                )
            }
            Some(true) => return plan_err!("NDP fragment projects column {index} twice"),
            Some(seen) => *seen = true,
        }
    }
    Ok(())
}
