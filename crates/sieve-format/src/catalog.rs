//! What a storage node says about the data it holds.
//!
//! These summaries travel from storage node to compute node as JSON inside
//! Flight's `FlightInfo` (one per table; one endpoint per slice), next to the
//! Arrow schema that Flight carries natively.

use serde::{Deserialize, Serialize};

/// Minimum and maximum of one column over a slice, rendered as text so any
/// Arrow type travels the same way; the reader casts them back with the
/// column's type. `None` where the slice has no statistics for the column.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ColumnSummary {
    /// Column name.
    pub name: String,
    /// Smallest value, if known.
    pub min: Option<String>,
    /// Largest value, if known.
    pub max: Option<String>,
    /// Number of NULLs, if known.
    pub null_count: Option<u64>,
    /// Number of distinct values (NULL counts as one), if known.
    #[serde(default)]
    pub distinct_count: Option<u64>,
    /// Bytes of the column's pages before compression, over the slice (an
    /// estimate of its Arrow size where the type has no fixed width), if
    /// known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uncompressed_bytes: Option<u64>,
}

/// One slice of a table as a storage node describes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SliceSummary {
    /// Table the slice belongs to.
    pub table: String,
    /// Slice number within the table, unique across all storage nodes.
    pub slice: u32,
    /// Rows in the slice.
    pub rows: u64,
    /// Bytes of the slice file on disk.
    pub bytes: u64,
    /// Row groups in the slice.
    pub row_groups: u32,
    /// Data pages in the slice, over all columns.
    pub pages: u64,
    /// Per-column min/max, in schema order.
    pub columns: Vec<ColumnSummary>,
    /// Relative path of the slice file, for the byte-range endpoint.
    pub file: String,
    /// Slices of the table over the whole cluster, if the load recorded it
    /// ([`crate::TABLE_SLICES_KEY`]); absent from older nodes' summaries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table_slices: Option<u32>,
    /// Rows of each row group, in order (for readers that must place row
    /// positions in row groups without the footer: deleted rows); absent
    /// from older nodes' summaries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub row_group_rows: Vec<u64>,
}

/// A table as one storage node holds it: the slices on that node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TableSummary {
    /// Table name.
    pub name: String,
    /// Slices of the table held by this node.
    pub slices: Vec<SliceSummary>,
}
