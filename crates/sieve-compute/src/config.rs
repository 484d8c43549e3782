//! Session settings under the `sieve.` prefix (`SET sieve.ndp = off`).

use std::time::Duration;

use datafusion::common::config::{ConfigExtension, ConfigOptions};
use datafusion::common::{extensions_options, plan_err, Result};

use crate::catalog::DiscoverySettings;
use crate::failover::FailoverSettings;
use crate::join_filter::JoinFilterSettings;

extensions_options! {
    /// Sieve's session settings.
    pub struct SieveConfig {
        /// `on`: push filters and projections to the storage nodes as NDP
        /// fragments. `off`: the baseline, stock DataFusion reading the same
        /// slices by byte range.
        pub ndp: String, default = "on".to_string()
        /// Slice requests kept in flight per output partition: how far the
        /// scan reads ahead of its consumer.
        pub slices_in_flight: usize, default = 4
        /// Codec of the Arrow IPC batches the storage nodes ship: `auto`
        /// (the node's choice: lz4 for a peer on its host, zstd across a
        /// network), `none`, `lz4` or `zstd`.
        pub ipc_compression: String, default = "auto".to_string()
        /// Push partial aggregations into fragments where statistics say
        /// they shrink the data.
        pub aggregate_pushdown: bool, default = true
        /// Push an aggregation only if its estimated groups per slice are at
        /// most this fraction of the slice's rows.
        pub aggregate_group_ratio_max: f64, default = 0.5
        /// Push a partial aggregation over inner and semi hash joins whose
        /// build sides are small (a star join: filtered dimensions) into the
        /// probe scan's fragment, with the build sides' rows: the storage
        /// nodes probe every dimension and aggregate.
        pub star_join_pushdown: bool, default = true
        /// Push a star join only if its build sides are estimated to hold at
        /// most this many bytes in all. The compute node collects them
        /// either way (the joins it takes are collect-left); a body over
        /// 16 KiB is registered once per node, and build rows that turn out
        /// too large for a fragment run their joins here.
        pub star_join_build_bytes_max: usize, default = 16 * 1024 * 1024
        /// A scan with nothing for the storage nodes to do (no filter, join
        /// filter or aggregation: only columns) asks for its slices' pages
        /// as stored and decodes them on the compute node, as NDP off does:
        /// the nodes spend no CPU decoding and re-encoding, and the link
        /// carries the compressed pages.
        pub plain_scans_as_stored: bool, default = true
        /// Read a table's sorted copy (`CREATE TABLE ... WITH (copy_of =
        /// ...)`) instead of the table where, from the slices' min/max and
        /// the query's predicate and join filters, fewer of its rows may
        /// match.
        pub sorted_copies: bool, default = true
        /// Leave out of a scan the slices whose min/max show that no row
        /// can satisfy its predicate and join filters: no request is sent
        /// for them. Off, every slice is asked and its node skips its pages.
        pub slice_pruning: bool, default = true
        /// Return the memory freed to the operating system when the
        /// process's last open statement ends (the allocator's purge: the
        /// `sieve` binary's jemalloc arenas and glibc's heap; glibc's
        /// `malloc_trim` alone elsewhere), so that a server between queries holds only what it
        /// keeps, and a statement's peak does not carry what the one before
        /// it freed.
        pub release_memory_after_statements: bool, default = true
        /// How long the process must run no statement after the last one
        /// ended before the memory is returned, in milliseconds. 0, the
        /// default: at once when the last open statement ends. With
        /// jemalloc this cost nothing measurable on TPC-H SF 10's 22
        /// queries back to back (glibc's `malloc_trim` had cost 4% to
        /// 19%, docs/results/2026-11-27-issue20-part14.md).
        pub release_memory_idle_ms: u64, default = 0
        /// The memory one statement's operators share (a size such as
        /// `1G` or `512M`, `auto` or `unbounded`, the default: the
        /// session's pool alone): past it, sorts, aggregations and hash
        /// joins spill, and what cannot spill fails with `Resources
        /// exhausted`. Every byte is also taken from the session's pool
        /// (`datafusion.runtime.memory_limit`, half the machine by
        /// default), which bounds the statements running at once together.
        /// See `crate::memory` for what a bound costs.
        pub query_memory_limit: String, default = "unbounded".to_string()
        /// Push a star join only if its build sides' rows are at most this
        /// share of the probe table's mean rows per slice: every slice
        /// builds the hash tables again, and past it a join filter does
        /// better (TPC-H Q11 at SF 100: 1 M suppliers against slices of
        /// 755 k partsupp rows).
        pub star_join_build_rows_share: f64, default = 0.25
        /// Apply hash joins' build-side keys (range, IN list, Bloom filter)
        /// on the storage nodes of the probe side.
        pub join_filters: bool, default = true
        /// Build an inner hash join on its input that no join filter can
        /// cut (a scan with nothing pushed), when the other input will be
        /// cut by join filters to fewer rows: the scan then takes this
        /// join's filter (TPC-H Q9's orders).
        pub swap_join_sides: bool, default = true
        /// Join a tree of inner equi-joins in the order estimated cheapest
        /// (from the tables' statistics, their filters and unique keys)
        /// instead of the SQL's, where it is estimated to cost at most 0.8
        /// of it (TPC-H Q9: part joined with partsupp before lineitem).
        pub order_joins: bool, default = true
        /// Group by a table's unique key alone where a grouping also takes
        /// columns of that table of variable width, and join those columns
        /// back after the aggregation (TPC-H Q10's customer strings).
        pub late_group_columns: bool, default = true
        /// Group by a table's unique integer key first where a grouping
        /// over joins takes columns of that table of variable width but
        /// not the key, join those columns back, and group by them after
        /// (`count`, `sum`, `min` and `max` only; TPC-H Q21's supplier
        /// names carried through three joins of lineitem).
        pub group_by_table_key: bool, default = true
        /// Most rows the table of `group_by_table_key` may have: its key
        /// is the first aggregation's groups and the table is read again.
        pub group_by_table_key_rows_max: usize, default = 2_097_152
        /// Aggregate a join's many side before the join where each group
        /// is one row of its other side (a unique key of that table among
        /// the grouping columns; TPC-H Q13's orders counted per customer).
        pub aggregate_before_join: bool, default = true
        /// Evaluate an expression of a hash join's build-side columns below
        /// the join, where its value is narrower than the columns it frees
        /// (TPC-H Q9's profit before its join with orders is built).
        pub evaluate_before_joins: bool, default = true
        /// Count grouped `count(DISTINCT x)` of integers over a join with one
        /// set of (group, value) pairs instead of regrouping by every grouping
        /// column and `x` (TPC-H Q16's distinct suppliers per brand, type and
        /// size).
        pub count_distinct_by_sets: bool, default = true
        /// Also filter a scan by the keys of an inner join further up whose
        /// probe key reaches the scan only through other inner joins (TPC-H
        /// Q5's supplier join and its lineitem scan).
        pub join_filters_through_joins: bool, default = true
        /// Build-side keys up to this many go as an exact IN list when no key
        /// bitmap fits (up to 20, always).
        pub join_filter_list_max: usize, default = 1024
        /// Build-side keys up to this many go as a key bitmap or a Bloom
        /// filter (beyond, the key range only); the compute node keeps up to
        /// this many distinct keys per key column, in the memory pool, to
        /// find them, except integer keys past a quarter of it whose range
        /// is smaller as a bitmap: those are kept as a key bitmap of any
        /// number of keys (up to 128 MiB). A join filter is
        /// registered once on each storage node of the probe scan, not sent
        /// with every slice request.
        pub join_filter_keys_max: usize, default = 16 * 1024 * 1024
        /// False-positive rate the join Bloom filters are sized for, at
        /// most: where the keys are a small share of the probe column's
        /// values, a filter is sized for a lower rate (down to 1e-5), so
        /// that the rows it lets through by mistake stay about a tenth of
        /// those its keys match.
        pub join_filter_bloom_fpp: f64, default = 0.01
        /// A slice of a table a user owns whose deleted rows reach this
        /// share of its rows is rewritten (compacted) after the DELETE or
        /// UPDATE that got it there, in a commit of its own; above 1: never.
        pub compact_deleted_share: f64, default = 0.3
        /// Integer keys go as an exact bitmap over their range instead of a
        /// Bloom filter when the bitmap takes at most this many bytes, or at
        /// most twice the Bloom filter's; 0 turns key bitmaps off.
        pub join_filter_bitmap_bytes: usize, default = 65536
        /// Key bitmaps of at least this many bytes travel in windows, each
        /// slice request carrying the part its slice's key range needs,
        /// where the slices' key ranges are narrow and apart (a table
        /// sorted by the key); others are registered whole on every
        /// storage node. 0: always registered.
        pub join_filter_part_bytes_min: usize, default = 1024 * 1024
        /// Longest wait for a join's build side before a probe scan goes
        /// ahead without its filter, in milliseconds.
        pub join_filter_wait_ms: u64, default = 60000
        /// Scans estimated to return at most this many rows, and that wait
        /// for no join filter, start when the query starts instead of when
        /// first polled, so that the storage nodes work on them in
        /// parallel; 0 turns early starts off.
        pub early_start_rows_max: usize, default = 1_000_000
        /// Bytes of batches a scan started early may buffer before its
        /// consumer takes them; beyond, it waits.
        pub early_start_buffer_bytes: usize, default = 64 * 1024 * 1024
        /// Memory one partition of a partitioned hash join may hold for its
        /// build side (its batches plus an estimate of the hash table); past
        /// it, or past its share of the memory pool, both sides of that
        /// partition are partitioned by key hash to disk and joined one part
        /// at a time (a grace hash join). 0 keeps every build side in memory.
        pub join_build_bytes_max: usize, default = crate::spill_join::JOIN_BUILD_BYTES_MAX
        /// Memory one partition of a grouped aggregation on one integer key
        /// may take for its groups indexed by key value (no hash table, see
        /// `dense_aggregate`); past it, for a negative key, or when the
        /// memory pool refuses, DataFusion's aggregation takes over. 0 always
        /// hashes.
        pub dense_aggregate_bytes_max: usize, default = 256 * 1024 * 1024
        /// Partitions of a partitioned hash join whose build side is
        /// estimated at `join_wide_build_rows` rows per partition or more
        /// (rounded up to a multiple of the plan's): each partition's hash
        /// table is smaller and stays closer to the processor's cache. The
        /// scans keep their partitions; above the join, the partitions are
        /// merged back. 0 (the default) turns it off: at TPC-H SF 10 it
        /// cost 14% more compute CPU; at SF 100 it saved 6% on the
        /// largest joins (`docs/results/2026-11-28-issue20-part20.md`).
        pub join_wide_partitions: usize, default = 0
        /// Estimated build rows per join partition from which a join gets
        /// `join_wide_partitions` partitions.
        pub join_wide_build_rows: usize, default = 65_536
        /// Longest a storage node may stay silent during a slice request
        /// (connecting, before its first message, between messages) before
        /// the attempt counts as failed, in milliseconds.
        pub storage_timeout_ms: u64, default = 30000
        /// Attempts on other replicas after a slice request fails because
        /// of its node (down, refused, cut off, silent); each replica is
        /// tried at most once.
        pub slice_retries: usize, default = 2
        /// Deepest a query's expressions may nest (after OR chains of
        /// equalities become IN lists); deeper ones are refused before
        /// planning recurses into them. Fragments shipped to the storage
        /// nodes have their own, lower bound (`EXPRESSION_DEPTH_MAX`):
        /// deeper filters run on the compute node.
        pub expression_depth_max: usize, default = crate::deep::DEFAULT_EXPRESSION_DEPTH_MAX
        /// Longest wait for a connection to one storage node while the
        /// session discovers the cluster, in milliseconds; read when the
        /// session connects. A node that misses it is left out (and the
        /// session starts if every slice has another live replica).
        pub discovery_connect_timeout_ms: u64, default = crate::catalog::DISCOVERY_CONNECT_TIMEOUT_MS
        /// Longest wait for one storage node's whole catalog (connecting and
        /// listing) while the session discovers the cluster, in
        /// milliseconds; read when the session connects.
        pub discovery_timeout_ms: u64, default = crate::catalog::DISCOVERY_TIMEOUT_MS
        /// Longest one byte-range request of an NDP-off scan may take before
        /// it is tried on another replica, in milliseconds; read when the
        /// session connects.
        pub range_timeout_ms: u64, default = crate::range_store::RANGE_REQUEST_TIMEOUT_MS
    }
}

impl ConfigExtension for SieveConfig {
    const PREFIX: &'static str = "sieve";
}

/// Whether pushdown is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NdpMode {
    /// Fragments evaluated on the storage nodes.
    On,
    /// Slices read by byte range, everything evaluated on the compute node.
    Off,
}

impl SieveConfig {
    /// The session's settings, or the defaults where the session has none.
    pub fn of(options: &ConfigOptions) -> Self {
        options
            .extensions
            .get::<SieveConfig>()
            .cloned()
            .unwrap_or_default()
    }

    /// The join filter settings.
    pub fn join_filter_settings(&self) -> JoinFilterSettings {
        JoinFilterSettings {
            enabled: self.join_filters,
            list_max: self.join_filter_list_max,
            keys_max: self.join_filter_keys_max,
            bloom_fpp: self.join_filter_bloom_fpp,
            bitmap_bytes: self.join_filter_bitmap_bytes,
            wait: Duration::from_millis(self.join_filter_wait_ms),
            part_bytes_min: self.join_filter_part_bytes_min,
        }
    }

    /// How slice requests fail over between replicas.
    pub fn failover_settings(&self) -> FailoverSettings {
        FailoverSettings {
            timeout: Duration::from_millis(self.storage_timeout_ms.max(1)),
            retries: self.slice_retries,
        }
    }

    /// How the session discovers the cluster.
    pub fn discovery_settings(&self) -> DiscoverySettings {
        DiscoverySettings {
            connect_timeout: Duration::from_millis(self.discovery_connect_timeout_ms.max(1)),
            listing_timeout: Duration::from_millis(self.discovery_timeout_ms.max(1)),
        }
    }

    /// The `sieve.ndp` setting, validated.
    pub fn mode(&self) -> Result<NdpMode> {
        match self.ndp.to_ascii_lowercase().as_str() {
            "on" | "true" => Ok(NdpMode::On),
            "off" | "false" => Ok(NdpMode::Off),
            other => plan_err!("sieve.ndp must be 'on' or 'off', not '{other}'"),
        }
    }
}
