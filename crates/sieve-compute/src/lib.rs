//! The Sieve compute node.
//!
//! A DataFusion [`SessionContext`](datafusion::prelude::SessionContext) whose
//! tables are discovered from storage nodes. A query's path:
//!
//! ```text
//!  SQL ─> DataFusion logical plan ─> SieveTable::scan (table.rs)
//!     sieve.ndp = on : SieveScanExec (scan.rs)
//!                       one NDP fragment per scan, one DoGet per slice,
//!                       all storage nodes at once, a bounded number in flight
//!                       per partition (client.rs), each to the least-loaded
//!                       replica and retried on another if its node fails
//!                       (failover.rs); slices a busy node served raw are
//!                       completed here with the same fragment (raw.rs)
//!                     [+ FilterExec for conjuncts outside the allow-list]
//!     sieve.ndp = off: DataSourceExec(ParquetSource) reading slice files by
//!                       byte range from the storage nodes (range_store.rs),
//!                       each range retried on another replica if its node
//!                       fails, with DataFusion's own pruning, + FilterExec
//!  ─> the rest of the plan runs here, unchanged
//! ```
//!
//! Architecture invariant: the compute node never opens a slice file itself;
//! with NDP on it sees only what fragments return, with NDP off only bytes
//! the range endpoint served.
#![deny(missing_docs)]

mod aggregate_first;
mod as_it_was;
mod build_keys;
mod catalog;
mod checked_reader;
mod client;
mod config;
pub mod copies;
mod deep;
mod dense_aggregate;
mod distinct_counts;
mod early_start;
mod estimate;
mod evaluate_early;
mod failover;
mod group_by_key;
mod guarded;
mod join_filter;
mod join_order;
mod join_sides;
mod late_columns;
pub mod memory;
mod merge_join_filter;
mod nan_safe;
mod optimizer;
mod range_store;
pub mod raw;
mod scan;
mod session;
mod signed_zero;
mod spill_join;
mod star_join;
mod table;
pub mod tables;
mod traffic;
mod wide_join;

pub use aggregate_first::AggregateBeforeJoin;
pub use as_it_was::panic_message;
pub use build_keys::{BuildKeys, BuildKeysExec, CollectedKeys};
pub use catalog::{
    ClusterCatalog, ClusterSlice, ClusterTable, DiscoveryFailure, DiscoverySettings, NodeState,
    Recovery, DISCOVERY_CONNECT_TIMEOUT_MS, DISCOVERY_TIMEOUT_MS, NODE_SUSPECT_MS,
};
pub use client::{
    as_corrupt_replica, as_node_failure, AuthenticatedFlightClient, BearerAuth, CorruptReplica,
    NodeFailure, SlicePart, StorageClient, CONNECTION_WINDOW_BYTES, SLICE_STREAM_WINDOW_BYTES,
};
pub use config::{NdpMode, SieveConfig};
pub use deep::{
    analyzer_rules_with_depth_limit, compute_runtime, expression_depth, ExpressionDepthLimit,
    COMPUTE_THREAD_STACK_BYTES, DEFAULT_EXPRESSION_DEPTH_MAX,
};
pub use dense_aggregate::{DenseAggregateExec, DenseAggregates};
pub use distinct_counts::{
    BatchRowsExec, CountDistinctBySets, SetsInSmallBatches, SETS_BATCH_ROWS,
};
pub use early_start::{EarlyStartExec, StartScansEarly};
pub use evaluate_early::EvaluateOnBuildSides;
pub use failover::FailoverSettings;
pub use group_by_key::GroupByTableKey;
pub use join_filter::{JoinFilterSettings, JoinFilterSlot, KeyFilterSlot};
pub use join_order::OrderInnerJoins;
pub use join_sides::BuildOnFilteredSide;
pub use late_columns::JoinGroupColumnsLate;
pub use merge_join_filter::{
    GuardMergeJoinFilters, NullableMergeJoinFilters, ProjectionBarrierExec, UnguardMergeJoinFilters,
};
pub use optimizer::{PushAggregateToStorage, WaitForJoinFilters};
pub use range_store::{ClusterRangeStore, RANGE_REQUEST_TIMEOUT_MS};
pub use scan::{PushedAggregate, ScanOptions, SieveScanExec, BODY_INLINE_BYTES_MAX};
pub use session::{
    connect_session, connect_session_with_config, connect_session_with_tables,
    physical_rules_corrected, session_over, SieveSession,
};
pub use signed_zero::{
    FloatEqualityExec, FloatInListsMatchBothZeros, KeepFloatEqualitiesApart, UnwrapFloatEqualities,
};
pub use spill_join::{
    JoinInputExec, SpillHashJoins, SpillableHashJoinExec, GRACE_DEPTH_MAX, GRACE_FAN_OUT,
    JOIN_BUILD_BYTES_MAX,
};
pub use star_join::{PushStarJoinToStorage, PushedStarJoin};
pub use table::SieveTable;
pub use traffic::{Traffic, TrafficSnapshot};
pub use wide_join::{MergePartitionsExec, WidenLargeJoins};
