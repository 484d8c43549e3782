//! The cluster's catalog, discovered from the storage nodes.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arrow::datatypes::SchemaRef;
use datafusion::common::stats::Precision;
use datafusion::common::{
    exec_err, plan_err, ColumnStatistics, DataFusionError, Result, ScalarValue, Statistics,
};
use sieve_format::SliceSummary;
use sieve_fragment::Secret;

use crate::client::{NodeTable, StorageClient};

/// One slice and where it lives.
#[derive(Debug, Clone)]
pub struct ClusterSlice {
    /// What its storage nodes say about it (identical on every replica).
    pub summary: SliceSummary,
    /// Index of its first storage node in [`ClusterCatalog::clients`].
    pub node: usize,
    /// URL of the slice file on that node's byte-range endpoint.
    pub range_url: String,
    /// Every node holding a copy, `node` first.
    pub replicas: Vec<usize>,
    /// Its deleted rows at the version read (a table a user owns): a
    /// serialized roaring bitmap of row positions, with their count.
    pub deleted: Option<(Arc<Vec<u8>>, u64)>,
}

/// What the compute node knows of one storage node's state: its requests in
/// flight from here, and when it last failed.
#[derive(Debug, Default)]
pub struct NodeState {
    /// Slice requests to the node in flight now, from this compute node.
    pub in_flight: AtomicUsize,
    /// When a request to the node last failed (ms since the catalog was
    /// made; 0: never). A node that failed recently is tried last.
    pub failed_at_ms: AtomicU64,
}

/// A table spread over the cluster.
#[derive(Debug, Clone)]
pub struct ClusterTable {
    /// Table name.
    pub name: String,
    /// Arrow schema, identical on every node.
    pub schema: SchemaRef,
    /// All slices, ordered by slice number.
    pub slices: Vec<ClusterSlice>,
    /// Row count (exact) and per-column min/max (inexact) over all slices.
    pub statistics: Statistics,
    /// For a table a user owns: keeps the version these slices are of
    /// readable (their files on the nodes) while anything holds the table,
    /// a running scan included.
    pub pin: Option<crate::tables::VersionPin>,
}

impl ClusterTable {
    /// Column `column`'s distinct values estimated from each slice's exact
    /// count: the number of values `n` a slice of `r` rows would draw `d`
    /// distinct ones from, were its rows drawn uniformly from them (`d = n
    /// (1 - (1 - 1/n)^r)`, solved for `n`), the largest over the slices,
    /// at least the largest `d` and at most the table's rows. A column of
    /// few values (an order status: 3 in every slice) is estimated at
    /// those few, a key drawn from a wide domain (a part key in lineitem)
    /// at about its domain. `None` where a slice's count is missing.
    /// Computed on each call (a bisection per slice): callers keep it.
    pub fn distinct_estimate(&self, column: usize) -> Option<usize> {
        // Counts from the nodes' summaries: damaged ones must not overflow.
        let table_rows = self.slices.iter().fold(0u64, |total, slice| {
            total.saturating_add(slice.summary.rows)
        });
        distinct_estimate(&self.slices, column, table_rows)
    }

    /// Columns whose values are unique over the table and never NULL,
    /// proven from the slices' summaries: in every slice the column has no
    /// NULL and as many distinct values as rows (counted by 64-bit hashes
    /// as the slice was written: equal counts mean no two values are
    /// equal), and the slices' integer ranges do not overlap. Deleted rows
    /// only remove values. Integer columns only; a slice without these
    /// statistics proves nothing.
    pub fn unique_columns(&self) -> Vec<usize> {
        (0..self.schema.fields().len())
            .filter(|&column| {
                self.schema.field(column).data_type().is_integer() && self.is_unique(column)
            })
            .collect()
    }

    fn is_unique(&self, column: usize) -> bool {
        let mut ranges = Vec::with_capacity(self.slices.len());
        for slice in &self.slices {
            let summary = &slice.summary;
            if summary.rows == 0 {
                continue;
            }
            let Some(stats) = summary.columns.get(column) else {
                return false;
            };
            if stats.null_count != Some(0) || stats.distinct_count != Some(summary.rows) {
                return false;
            }
            let bound = |text: &Option<String>| text.as_deref()?.trim().parse::<i128>().ok();
            let (Some(min), Some(max)) = (bound(&stats.min), bound(&stats.max)) else {
                return false;
            };
            ranges.push((min, max));
        }
        ranges.sort_unstable();
        ranges.windows(2).all(|pair| pair[0].1 < pair[1].0)
    }
}

/// Every table of every storage node, and a client per node.
#[derive(Debug, Clone)]
pub struct ClusterCatalog {
    /// One client per storage node, in the order given.
    pub clients: Vec<StorageClient>,
    /// Tables by name.
    pub tables: BTreeMap<String, Arc<ClusterTable>>,
    /// One state per node, as `clients`.
    pub nodes: Arc<Vec<NodeState>>,
    /// When the catalog was made: the epoch of [`NodeState::failed_at_ms`].
    pub epoch: Instant,
    /// Every slice request that failed on a node and was then served by
    /// another replica, for measuring recovery.
    pub recoveries: Arc<Mutex<Vec<Recovery>>>,
    /// Nodes that failed or timed out during discovery, and why. Their
    /// slices are unknown to this catalog; every slice of every table had a
    /// live replica without them.
    pub discovery_failures: Vec<DiscoveryFailure>,
    /// Base URL (`http://host:port`) of each node's byte-range endpoint, as
    /// the node itself announced it; `None` for a node that failed discovery.
    pub range_urls: Vec<Option<String>>,
    /// The tables users own, when the compute node has a table catalog
    /// ([`Self::with_owned_tables`]).
    pub owned: Option<Arc<crate::tables::OwnedTables>>,
}

/// A storage node that could not be listed when the catalog was made.
#[derive(Debug, Clone)]
pub struct DiscoveryFailure {
    /// Index of the node in [`ClusterCatalog::clients`].
    pub node: usize,
    /// The node's address.
    pub url: String,
    /// What went wrong.
    pub reason: String,
}

/// Bounds on discovering the cluster, so that one dead or hung node costs a
/// bounded wait instead of every new session.
#[derive(Debug, Clone, Copy)]
pub struct DiscoverySettings {
    /// Longest wait for a TCP connection (and its HTTP/2 handshake) to one node.
    pub connect_timeout: Duration,
    /// Longest wait for one node's whole answer: connecting and listing.
    pub listing_timeout: Duration,
}

/// Default of `sieve.discovery_connect_timeout_ms`: a node on the same
/// network that does not accept a connection in 2 s is down or overloaded.
pub const DISCOVERY_CONNECT_TIMEOUT_MS: u64 = 2_000;
/// Default of `sieve.discovery_timeout_ms`: listing is a catalog read from
/// memory, milliseconds on a healthy node; 10 s leaves room for a busy one.
pub const DISCOVERY_TIMEOUT_MS: u64 = 10_000;

impl Default for DiscoverySettings {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_millis(DISCOVERY_CONNECT_TIMEOUT_MS),
            listing_timeout: Duration::from_millis(DISCOVERY_TIMEOUT_MS),
        }
    }
}

/// A slice request that failed on one node and was served by another.
#[derive(Debug, Clone)]
pub struct Recovery {
    /// The node that failed first.
    pub failed_node: usize,
    /// When the first failure was noticed.
    pub detected: Instant,
    /// When the slice was complete from another replica.
    pub recovered: Instant,
}

/// How long a node that failed a request is tried after its replicas.
pub const NODE_SUSPECT_MS: u64 = 10_000;

impl ClusterCatalog {
    /// The nodes to try for `slice`, best first: nodes that have not failed
    /// in the last [`NODE_SUSPECT_MS`] before those that have, then the
    /// fewest requests in flight from here, ties broken by the slice number
    /// so that equal replicas share the work.
    pub fn replica_order(&self, slice: &ClusterSlice) -> Vec<usize> {
        self.replica_order_of(slice.summary.slice, &slice.replicas)
    }

    /// [`Self::replica_order`] of slice number `slice` with copies on `replicas`.
    pub fn replica_order_of(&self, slice: u32, replicas: &[usize]) -> Vec<usize> {
        let now = self.epoch.elapsed().as_millis() as u64 + 1;
        let count = replicas.len().max(1);
        let mut order: Vec<(bool, usize, usize, usize)> = replicas
            .iter()
            .enumerate()
            .map(|(position, &node)| {
                let state = &self.nodes[node];
                let failed = state.failed_at_ms.load(Ordering::Relaxed);
                let suspect = failed != 0 && now.saturating_sub(failed) < NODE_SUSPECT_MS;
                let rotation = (position + count - slice as usize % count) % count;
                (
                    suspect,
                    state.in_flight.load(Ordering::Relaxed),
                    rotation,
                    node,
                )
            })
            .collect();
        order.sort_unstable();
        order.into_iter().map(|(.., node)| node).collect()
    }

    /// Remember that `node` just failed a request.
    pub fn mark_failed(&self, node: usize) {
        let now = self.epoch.elapsed().as_millis() as u64 + 1;
        self.nodes[node].failed_at_ms.store(now, Ordering::Relaxed);
    }
}

impl ClusterCatalog {
    /// [`Self::discover_with`] with the default bounds. Every call carries
    /// `secret` (`None`: nodes without one).
    pub async fn discover(urls: &[String], secret: Option<&Secret>) -> Result<Self> {
        Self::discover_with(urls, secret, DiscoverySettings::default()).await
    }

    /// Connect to every storage node, concurrently, and merge what they
    /// hold. A slice held by several nodes is one slice with replicas; a
    /// table whose schema differs between nodes, or replicas that differ,
    /// is an error.
    ///
    /// A node that refuses, fails or does not answer within `settings` is
    /// recorded in [`Self::discovery_failures`] and marked failed; the
    /// catalog is made without it as long as every slice of every table
    /// still has a live replica. Where slices record their table's slice
    /// count ([`SliceSummary::table_slices`]), a slice no live node lists is
    /// missing, and discovery fails naming the missing slices and the nodes
    /// that failed. (A table none of whose slices is on a live node is not
    /// known at all; its slice count is not either.) A node that refuses
    /// the secret fails discovery at once: every node has the same secret,
    /// so the session's is wrong.
    pub async fn discover_with(
        urls: &[String],
        secret: Option<&Secret>,
        settings: DiscoverySettings,
    ) -> Result<Self> {
        if urls.is_empty() {
            return plan_err!("no storage nodes given");
        }
        let answers =
            futures::future::join_all(urls.iter().map(|url| discover_node(url, secret, settings)))
                .await;
        let mut clients = Vec::with_capacity(urls.len());
        let mut listings = Vec::with_capacity(urls.len());
        let mut discovery_failures = Vec::new();
        for (node, (url, answer)) in urls.iter().zip(answers).enumerate() {
            match answer {
                Ok((client, listing)) => {
                    clients.push(client);
                    listings.push(Some(listing));
                }
                Err(DataFusionError::Plan(message)) => {
                    // A bad address or a refused secret: the user's to fix,
                    // not a node failure.
                    return plan_err!("{message}");
                }
                Err(error) => {
                    log::warn!("storage node {url} left out of the catalog: {error}");
                    discovery_failures.push(DiscoveryFailure {
                        node,
                        url: url.clone(),
                        reason: error.to_string(),
                    });
                    // Never connected: a client that connects on first use.
                    clients.push(StorageClient::lazy(url, secret)?);
                    listings.push(None);
                }
            }
        }
        if discovery_failures.len() == urls.len() {
            return exec_err!(
                "no storage node could be listed: {}",
                describe_failures(&discovery_failures)
            );
        }
        let mut range_urls: Vec<Option<String>> = vec![None; urls.len()];
        let mut tables: BTreeMap<String, ClusterTable> = BTreeMap::new();
        for (node, listing) in listings.into_iter().enumerate() {
            for node_table in listing.into_iter().flatten() {
                if sieve_format::writes::parse_storage_name(&node_table.name).is_some() {
                    // A table a user owns: its versions are in the table
                    // catalog, not in what the nodes hold. The node's range
                    // endpoint is still learnt from its slices.
                    if let Some((_, range_url)) = node_table.slices.first() {
                        if let Some((base, _)) = range_url.split_once("/slices/") {
                            range_urls[node].get_or_insert_with(|| base.to_string());
                        }
                    }
                    continue;
                }
                merge_node_table(&mut tables, &mut range_urls, urls, node, node_table)?;
            }
        }
        check_every_slice_live(&tables, &discovery_failures)?;
        let tables = tables
            .into_iter()
            .map(|(name, mut table)| {
                table.slices.sort_by_key(|slice| slice.summary.slice);
                table.statistics = table_statistics(&table.schema, &table.slices);
                (name, Arc::new(table))
            })
            .collect();
        let nodes = Arc::new((0..clients.len()).map(|_| NodeState::default()).collect());
        let catalog = Self {
            clients,
            tables,
            nodes,
            epoch: Instant::now(),
            recoveries: Arc::new(Mutex::new(Vec::new())),
            discovery_failures,
            range_urls,
            owned: None,
        };
        for failure in &catalog.discovery_failures {
            catalog.mark_failed(failure.node);
        }
        Ok(catalog)
    }
}

impl ClusterCatalog {
    /// This catalog with the tables users own, from the table catalog at
    /// `path` (created if missing): see [`crate::tables`].
    pub async fn with_owned_tables(mut self, path: &std::path::Path) -> Result<Self> {
        // A node that held no slice announced no byte-range endpoint; ask it.
        for (node, client) in self.clients.iter().enumerate() {
            // A node that failed discovery is not waited for again.
            let failed = self
                .discovery_failures
                .iter()
                .any(|failure| failure.node == node);
            if self.range_urls[node].is_some() || failed {
                continue;
            }
            if let Ok(stats) = client.stats().await {
                if let Some(base) = stats["range_base_url"].as_str() {
                    self.range_urls[node] = Some(base.to_string());
                }
            }
        }
        self.owned = Some(
            crate::tables::OwnedTables::open(
                path,
                self.clients.clone(),
                self.range_urls.clone(),
                crate::tables::NodeHealth {
                    nodes: Arc::clone(&self.nodes),
                    epoch: self.epoch,
                    unreachable: self
                        .discovery_failures
                        .iter()
                        .map(|failure| failure.node)
                        .collect(),
                },
            )
            .await?,
        );
        Ok(self)
    }
}

/// Connect to one node and list its tables, within `settings`.
async fn discover_node(
    url: &str,
    secret: Option<&Secret>,
    settings: DiscoverySettings,
) -> Result<(StorageClient, Vec<NodeTable>)> {
    let listed = async {
        let client = StorageClient::connect_within(url, secret, settings.connect_timeout).await?;
        let listing = client.list_tables().await?;
        Ok::<_, DataFusionError>((client, listing))
    };
    match tokio::time::timeout(settings.listing_timeout, listed).await {
        Ok(answer) => answer,
        Err(_) => exec_err!(
            "no catalog from storage node {url} within {} ms (sieve.discovery_timeout_ms)",
            settings.listing_timeout.as_millis()
        ),
    }
}

/// Add one node's table to `tables`: its slices, or replicas of slices
/// another node listed.
fn merge_node_table(
    tables: &mut BTreeMap<String, ClusterTable>,
    range_urls: &mut [Option<String>],
    urls: &[String],
    node: usize,
    node_table: NodeTable,
) -> Result<()> {
    let table = tables
        .entry(node_table.name.clone())
        .or_insert_with(|| ClusterTable {
            name: node_table.name.clone(),
            schema: Arc::clone(&node_table.schema),
            slices: Vec::new(),
            statistics: Statistics::new_unknown(&node_table.schema),
            pin: None,
        });
    if table.schema.fields() != node_table.schema.fields() {
        return plan_err!(
            "table '{}' has a different schema on storage node {} than on another node",
            node_table.name,
            urls[node]
        );
    }
    for (summary, range_url) in node_table.slices {
        if let Some((base, _)) = range_url.split_once("/slices/") {
            range_urls[node].get_or_insert_with(|| base.to_string());
        }
        if let Some(held) = table
            .slices
            .iter_mut()
            .find(|slice| slice.summary.slice == summary.slice)
        {
            // A replica: it must be the same slice, byte for byte.
            if (
                held.summary.rows,
                held.summary.bytes,
                held.summary.row_groups,
            ) != (summary.rows, summary.bytes, summary.row_groups)
            {
                return plan_err!(
                    "slice {} of table '{}' differs between storage nodes {} and {} ({} rows, {} bytes vs {} rows, {} bytes)",
                    summary.slice,
                    table.name,
                    urls[held.node],
                    urls[node],
                    held.summary.rows,
                    held.summary.bytes,
                    summary.rows,
                    summary.bytes
                );
            }
            held.replicas.push(node);
            continue;
        }
        table.slices.push(ClusterSlice {
            summary,
            node,
            range_url,
            replicas: vec![node],
            deleted: None,
        });
    }
    Ok(())
}

/// Fail if a table's slices record a slice count and fewer slices than that
/// were listed: those slices have no live replica. Slice numbers named as
/// missing are those of `1..=count` (the loader's numbering) not listed.
fn check_every_slice_live(
    tables: &BTreeMap<String, ClusterTable>,
    failures: &[DiscoveryFailure],
) -> Result<()> {
    let mut missing: Vec<String> = Vec::new();
    for table in tables.values() {
        let Some(count) = table
            .slices
            .iter()
            .filter_map(|slice| slice.summary.table_slices)
            .max()
        else {
            continue;
        };
        if table.slices.len() >= count as usize {
            continue;
        }
        let listed: std::collections::BTreeSet<u32> = table
            .slices
            .iter()
            .map(|slice| slice.summary.slice)
            .collect();
        let absent: Vec<String> = (1..=count)
            .filter(|number| !listed.contains(number))
            .map(|number| number.to_string())
            .collect();
        missing.push(format!(
            "table '{}' slice(s) {} ({} of {})",
            table.name,
            absent.join(", "),
            count as usize - table.slices.len(),
            count
        ));
    }
    if missing.is_empty() {
        return Ok(());
    }
    let nodes = if failures.is_empty() {
        "every storage node answered".to_string()
    } else {
        format!(
            "storage node(s) that failed: {}",
            describe_failures(failures)
        )
    };
    exec_err!(
        "slices with no live replica: {}; {nodes}",
        missing.join("; ")
    )
}

fn describe_failures(failures: &[DiscoveryFailure]) -> String {
    failures
        .iter()
        .map(|failure| format!("{} ({})", failure.url, failure.reason))
        .collect::<Vec<_>>()
        .join(", ")
}

/// See [`ClusterTable::distinct_estimate`].
fn distinct_estimate(slices: &[ClusterSlice], index: usize, table_rows: u64) -> Option<usize> {
    let mut estimate = 0u64;
    for slice in slices {
        let rows = slice.summary.rows;
        let distinct = slice.summary.columns.get(index)?.distinct_count?;
        if distinct == 0 || rows == 0 {
            continue;
        }
        let slice_estimate = if distinct >= rows {
            table_rows
        } else {
            domain_for(distinct, rows)
        };
        estimate = estimate.max(slice_estimate).max(distinct);
    }
    (!slices.is_empty()).then_some(estimate.min(table_rows).max(1) as usize)
}

/// The `n` for which `n (1 - (1 - 1/n)^rows)` is `distinct` (by bisection;
/// that expression grows with `n`, from 1 towards `rows`).
fn domain_for(distinct: u64, rows: u64) -> u64 {
    let expected = |n: f64| n * -f64::exp_m1(rows as f64 * f64::ln_1p(-1.0 / n));
    let target = distinct as f64;
    let (mut low, mut high) = (target, target.max(2.0));
    while expected(high) < target && high < 1e18 {
        high *= 2.0;
    }
    // Within 2^-60 of the bracket: far below a row.
    for _ in 0..60 {
        let middle = (low + high) / 2.0;
        if expected(middle) < target {
            low = middle;
        } else {
            high = middle;
        }
    }
    high.round() as u64
}

/// Merge slice summaries into table statistics.
pub(crate) fn table_statistics(schema: &SchemaRef, slices: &[ClusterSlice]) -> Statistics {
    // Deleted rows are not rows: COUNT(*) may be answered from this.
    let rows: u64 = slices
        .iter()
        .map(|slice| {
            let deleted = slice.deleted.as_ref().map_or(0, |(_, rows)| *rows);
            slice.summary.rows.saturating_sub(deleted)
        })
        .sum();
    let bytes: u64 = slices.iter().map(|slice| slice.summary.bytes).sum();
    let column_statistics = schema
        .fields()
        .iter()
        .enumerate()
        .map(|(index, field)| {
            let mut min: Option<ScalarValue> = None;
            let mut max: Option<ScalarValue> = None;
            let mut known = !slices.is_empty();
            for slice in slices {
                let column = slice.summary.columns.get(index);
                let parse = |text: Option<&String>| {
                    text.and_then(|text| {
                        ScalarValue::try_from_string(text.clone(), field.data_type()).ok()
                    })
                };
                let (Some(slice_min), Some(slice_max)) = (
                    parse(column.and_then(|c| c.min.as_ref())),
                    parse(column.and_then(|c| c.max.as_ref())),
                ) else {
                    known = false;
                    break;
                };
                min = Some(match min {
                    Some(current) if current.partial_cmp(&slice_min).is_some_and(|o| o.is_le()) => {
                        current
                    }
                    _ => slice_min,
                });
                max = Some(match max {
                    Some(current) if current.partial_cmp(&slice_max).is_some_and(|o| o.is_ge()) => {
                        current
                    }
                    _ => slice_max,
                });
            }
            let mut statistics = ColumnStatistics::new_unknown();
            if known {
                statistics.min_value = min.map(Precision::Inexact).unwrap_or(Precision::Absent);
                statistics.max_value = max.map(Precision::Inexact).unwrap_or(Precision::Absent);
            }
            // The column's Arrow size, as DataFusion's Parquet source
            // estimates it: exact for fixed widths, the pages' bytes before
            // compression otherwise. Join sides are chosen by it, not by
            // the whole file's compressed bytes.
            statistics.byte_size = match field.data_type().primitive_width() {
                Some(width) => Precision::Inexact(width.saturating_mul(rows as usize)),
                // For a dictionary-encoded string those bytes are the
                // dictionary and the indexes, far under the strings: the
                // estimate is at least the slice's rows times the mean
                // length of its smallest and largest value, plus an offset.
                None => slices
                    .iter()
                    .map(|slice| {
                        let column = slice.summary.columns.get(index)?;
                        let pages = column.uncompressed_bytes?;
                        let values = match (&column.min, &column.max) {
                            (Some(min), Some(max)) => slice
                                .summary
                                .rows
                                .saturating_mul((min.len() + max.len()) as u64 / 2 + 4),
                            _ => 0,
                        };
                        Some(pages.max(values))
                    })
                    // Sizes from the nodes' summaries: a damaged one must
                    // not overflow.
                    .try_fold(0u64, |total, bytes| Some(total.saturating_add(bytes?)))
                    .filter(|_| !slices.is_empty())
                    .map_or(Precision::Absent, |bytes| {
                        Precision::Inexact(bytes as usize)
                    }),
            };
            statistics
        })
        .collect();
    Statistics {
        num_rows: Precision::Exact(rows as usize),
        total_byte_size: Precision::Inexact(bytes as usize),
        column_statistics,
    }
}

#[cfg(test)]
mod unique_tests {
    use std::sync::Arc;

    use arrow::datatypes::{DataType, Field, Schema};
    use sieve_format::ColumnSummary;

    use super::*;

    /// A slice of `rows` rows whose column `k` has the given statistics.
    fn slice(
        number: u32,
        rows: u64,
        (min, max): (i64, i64),
        nulls: u64,
        distinct: Option<u64>,
    ) -> ClusterSlice {
        let column = |name: &str| ColumnSummary {
            name: name.to_string(),
            min: Some(min.to_string()),
            max: Some(max.to_string()),
            null_count: Some(nulls),
            distinct_count: distinct,
            uncompressed_bytes: None,
        };
        ClusterSlice {
            summary: SliceSummary {
                table: "t".to_string(),
                slice: number,
                rows,
                bytes: 0,
                row_groups: 1,
                pages: 1,
                columns: vec![column("k"), column("s")],
                file: String::new(),
                table_slices: None,
                row_group_rows: vec![],
            },
            node: 0,
            range_url: String::new(),
            replicas: vec![0],
            deleted: None,
        }
    }

    /// A table of columns `k` (integers) and `s` (strings) over `slices`.
    fn table(slices: Vec<ClusterSlice>) -> ClusterTable {
        ClusterTable {
            name: "t".to_string(),
            schema: Arc::new(Schema::new(vec![
                Field::new("k", DataType::Int64, true),
                Field::new("s", DataType::Utf8, true),
            ])),
            slices,
            statistics: Statistics::new_unknown(&Schema::empty()),
            pin: None,
        }
    }

    fn unique(slices: Vec<ClusterSlice>) -> Vec<usize> {
        table(slices).unique_columns()
    }

    fn distinct(slices: Vec<ClusterSlice>) -> Option<usize> {
        table(slices).distinct_estimate(0)
    }

    #[test]
    fn distinct_values_are_estimated_from_each_slices_count() {
        // Few values, the same few in every slice.
        let few = |n| slice(n, 1_000, (0, 2), 0, Some(3));
        assert_eq!(distinct([few(0), few(1), few(2)].into()), Some(3));
        // All distinct in every slice: as many as the table's rows.
        let keys = |n| slice(n, 1_000, (0, 10), 0, Some(1_000));
        assert_eq!(distinct([keys(0), keys(1)].into()), Some(2_000));
        // 632 of 1,000 rows distinct: drawn from about 1,000 values.
        let drawn = distinct(vec![slice(0, 1_000, (0, 10), 0, Some(632)), few(1)]).unwrap();
        assert!((990..=1_010).contains(&drawn), "{drawn}");
        // A slice without a count: unknown. No slices: unknown.
        assert_eq!(distinct(vec![few(0), slice(1, 10, (0, 1), 0, None)]), None);
        assert_eq!(distinct(vec![]), None);
        // One value.
        assert_eq!(distinct(vec![slice(0, 50, (1, 1), 0, Some(1))]), Some(1));
    }

    #[test]
    fn a_column_is_unique_only_when_every_slice_proves_it() {
        let ok = |n, range| slice(n, 100, range, 0, Some(100));
        // Disjoint ranges, in any order; an empty slice proves nothing
        // either way; strings are never keys.
        assert_eq!(unique(vec![ok(1, (100, 199)), ok(0, (0, 99))]), vec![0]);
        assert_eq!(
            unique(vec![ok(0, (0, 99)), slice(1, 0, (0, 0), 0, None)]),
            vec![0]
        );
        assert_eq!(unique(vec![]), vec![0]);
        // Ranges that touch or overlap: a value may be in both.
        assert!(unique(vec![ok(0, (0, 99)), ok(1, (99, 198))]).is_empty());
        assert!(unique(vec![ok(0, (0, 99)), ok(1, (50, 500))]).is_empty());
        // A repeated value, a NULL, or no distinct count.
        assert!(unique(vec![ok(0, (0, 99)), slice(1, 100, (100, 300), 0, Some(99))]).is_empty());
        assert!(unique(vec![
            ok(0, (0, 99)),
            slice(1, 100, (100, 300), 1, Some(100))
        ])
        .is_empty());
        assert!(unique(vec![ok(0, (0, 99)), slice(1, 100, (100, 300), 0, None)]).is_empty());
    }
}
