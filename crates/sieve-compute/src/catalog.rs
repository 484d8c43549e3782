//! The cluster's catalog, discovered from the storage nodes.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use arrow::datatypes::SchemaRef;
use datafusion::common::stats::Precision;
use datafusion::common::{plan_err, ColumnStatistics, Result, ScalarValue, Statistics};
use sieve_format::SliceSummary;
use sieve_fragment::Secret;

use crate::client::StorageClient;

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
        let now = self.epoch.elapsed().as_millis() as u64 + 1;
        let count = slice.replicas.len().max(1);
        let mut order: Vec<(bool, usize, usize, usize)> = slice
            .replicas
            .iter()
            .enumerate()
            .map(|(position, &node)| {
                let state = &self.nodes[node];
                let failed = state.failed_at_ms.load(Ordering::Relaxed);
                let suspect = failed != 0 && now.saturating_sub(failed) < NODE_SUSPECT_MS;
                let rotation = (position + count - slice.summary.slice as usize % count) % count;
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
    /// Connect to every storage node and merge what they hold. A slice held
    /// by several nodes is one slice with replicas; a table whose schema
    /// differs between nodes, or replicas that differ, is an error.
    /// Every call carries `secret` (`None`: nodes without one).
    pub async fn discover(urls: &[String], secret: Option<&Secret>) -> Result<Self> {
        if urls.is_empty() {
            return plan_err!("no storage nodes given");
        }
        let clients = futures::future::try_join_all(
            urls.iter().map(|url| StorageClient::connect(url, secret)),
        )
        .await?;
        let listings =
            futures::future::try_join_all(clients.iter().map(|client| client.list_tables()))
                .await?;
        let mut tables: BTreeMap<String, ClusterTable> = BTreeMap::new();
        for (node, listing) in listings.into_iter().enumerate() {
            for node_table in listing {
                let table = tables
                    .entry(node_table.name.clone())
                    .or_insert_with(|| ClusterTable {
                        name: node_table.name.clone(),
                        schema: Arc::clone(&node_table.schema),
                        slices: Vec::new(),
                        statistics: Statistics::new_unknown(&node_table.schema),
                    });
                if table.schema.fields() != node_table.schema.fields() {
                    return plan_err!(
                        "table '{}' has a different schema on storage node {} than on another node",
                        node_table.name,
                        urls[node]
                    );
                }
                for (summary, range_url) in node_table.slices {
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
                    });
                }
            }
        }
        let tables = tables
            .into_iter()
            .map(|(name, mut table)| {
                table.slices.sort_by_key(|slice| slice.summary.slice);
                table.statistics = table_statistics(&table.schema, &table.slices);
                (name, Arc::new(table))
            })
            .collect();
        let nodes = Arc::new((0..clients.len()).map(|_| NodeState::default()).collect());
        Ok(Self {
            clients,
            tables,
            nodes,
            epoch: Instant::now(),
            recoveries: Arc::new(Mutex::new(Vec::new())),
        })
    }
}

/// Merge slice summaries into table statistics.
fn table_statistics(schema: &SchemaRef, slices: &[ClusterSlice]) -> Statistics {
    let rows: u64 = slices.iter().map(|slice| slice.summary.rows).sum();
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
            statistics
        })
        .collect();
    Statistics {
        num_rows: Precision::Exact(rows as usize),
        total_byte_size: Precision::Inexact(bytes as usize),
        column_statistics,
    }
}
