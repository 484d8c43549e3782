//! The cluster's catalog, discovered from the storage nodes.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use datafusion::common::stats::Precision;
use datafusion::common::{plan_err, ColumnStatistics, Result, ScalarValue, Statistics};
use sieve_format::SliceSummary;

use crate::client::StorageClient;

/// One slice and where it lives.
#[derive(Debug, Clone)]
pub struct ClusterSlice {
    /// What its storage node says about it.
    pub summary: SliceSummary,
    /// Index of its storage node in [`ClusterCatalog::clients`].
    pub node: usize,
    /// URL of the slice file on the node's byte-range endpoint.
    pub range_url: String,
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
}

impl ClusterCatalog {
    /// Connect to every storage node and merge what they hold. A table whose
    /// schema differs between nodes, or a slice held twice, is an error.
    pub async fn discover(urls: &[String]) -> Result<Self> {
        if urls.is_empty() {
            return plan_err!("no storage nodes given");
        }
        let clients =
            futures::future::try_join_all(urls.iter().map(|url| StorageClient::connect(url)))
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
                    if table
                        .slices
                        .iter()
                        .any(|slice| slice.summary.slice == summary.slice)
                    {
                        return plan_err!(
                            "slice {} of table '{}' is held by two storage nodes",
                            summary.slice,
                            table.name
                        );
                    }
                    table.slices.push(ClusterSlice {
                        summary,
                        node,
                        range_url,
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
        Ok(Self { clients, tables })
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
