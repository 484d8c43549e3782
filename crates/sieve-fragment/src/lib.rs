//! The NDP fragment (Taurus's "NDP descriptor", SoftFlash's serialised
//! predicate): what a compute node asks a storage node to do with one slice.
//!
//! ```text
//!  FragmentEnvelope (protobuf, versioned)
//!  ├── version              FRAGMENT_VERSION; anything else is rejected
//!  ├── table, slice         which slice; resolved by the storage node's own catalog
//!  └── body (bytes)         FragmentBody, identical for every slice of one scan
//!      ├── schema_fingerprint   the table schema both sides planned against
//!      ├── projection           columns to ship, as indices into the table schema
//!      ├── predicate            datafusion-proto PhysicalExprNode (optional); join
//!      │                        filters arrive here as ranges, IN lists, Bloom filters
//!      └── aggregate            datafusion-proto PhysicalPlanNode (optional): a partial
//!                               aggregation over the projected rows, leaf SliceInputExec
//! ```
//!
//! The body is kept as opaque bytes inside the envelope so a storage node can
//! cache the decoded body by content hash: a scan of a thousand slices decodes
//! its fragment once.
//!
//! Both sides check the fragment against the same allow-list
//! ([`check_allowed`]): the compute node before it encodes, so that what it
//! cannot push stays on the compute node, and the storage node after it
//! decodes, so that a hostile request is refused. Nothing in a fragment names
//! a file: the storage node maps `(table, slice)` to a path through its own
//! catalog, so a fragment cannot read outside the node's data directory.
//!
//! The slice plan ([`slice_plan`]) is built here so that a storage node and
//! a compute node completing a raw slice run the same operators.
//!
//! This crate does no I/O.
#![deny(missing_docs)]

mod allow_list;
mod auth;
mod bitmap;
mod bloom;
mod codec;
mod deletions;
mod envelope;
mod errors;
mod join_filter;
mod key_words;
mod like;
mod limits;
mod min_max;
mod pruning;
mod registered_body;
mod slice_plan;
mod sum;
mod unary;
mod views;
mod wire;

pub use allow_list::{
    check_allowed, check_plan_allowed, is_allowed_type, ALLOWED_AGGREGATES, ALLOWED_FUNCTIONS,
    BUILD_TABLE_BYTES_MAX, FRAGMENT_JOINS_MAX,
};
pub use auth::{Secret, AUTHORIZATION_HEADER, SECRET_BYTES_MAX, SECRET_BYTES_MIN};
pub use bitmap::{key_bound, KeyBitmapExpr, KEY_BITMAP_BYTES_MAX, KEY_BITMAP_CHUNK_WORDS};
pub use bloom::{BloomFilterExpr, BLOOM_FILTER_BYTES_MAX};
pub use codec::{KeyRanges, SieveCodec, SliceInputExec, KEY_BITMAP_ZSTD_BYTES_MIN};
pub use deletions::{
    apply_deletions, decode_deletions, encode_deletions, DELETION_VECTOR_BYTES_MAX,
};
pub use envelope::{
    schema_fingerprint, ByteRange, DecodedBody, Fragment, FragmentBody, FragmentEnvelope, IpcCodec,
    RawSlice, SliceMessage, SliceMessageKind, SliceMetrics, FRAGMENT_BYTES_MAX, FRAGMENT_VERSION,
    HEARTBEAT_MS_MIN,
};
pub use errors::{
    classify_error, DataError, ErrorKind, CORRUPT_FILE_METADATA, CORRUPT_SLICE_KIND,
    ERROR_KIND_METADATA,
};
pub use join_filter::{
    join_filter_id, DecodedJoinFilter, JoinFilterRegistration, JOIN_FILTER_BYTES_MAX,
    JOIN_FILTER_ID_BYTES, JOIN_FILTER_PART_BYTES_MAX, REGISTER_JOIN_FILTER_ACTION,
    RELEASE_JOIN_FILTER_ACTION,
};
pub use key_words::{KeyWords, PackedWords};
pub use like::{fast_like, OrderedSubstringsExpr};
pub use limits::{
    check_expression_limits, dismantle, ExpressionShape, EXPRESSION_DEPTH_MAX,
    EXPRESSION_NODES_MAX, LITERAL_BYTES_MAX,
};
pub use min_max::total_order_min_max;
pub use sum::checked_sum;

/// DataFusion's aggregate functions that Sieve replaces, under their own
/// names: `min` and `max` whose grouped accumulators order floats in
/// total order, and `sum` that fails on integer overflow. The compute
/// node's session and the storage nodes' fragment decoding register them.
pub fn corrected_aggregates() -> Vec<datafusion::logical_expr::AggregateUDF> {
    let mut functions = total_order_min_max().to_vec();
    functions.push(checked_sum());
    functions
}
pub use pruning::{pruning_predicate, reads_float_column};
pub use registered_body::{
    BodyNotHeld, FragmentBodyRegistration, BODY_NOT_HELD_KIND, REGISTERED_BODY_BYTES_MAX,
    REGISTER_FRAGMENT_BODY_ACTION, RELEASE_FRAGMENT_BODY_ACTION,
};
pub use roaring::RoaringBitmap;
pub use slice_plan::{needed_columns, slice_plan, SlicePlan, SliceSource, ROW_POSITION_COLUMN};
pub use views::compact_views;
pub use wire::{narrow, widen, wire_schema, wire_type};
