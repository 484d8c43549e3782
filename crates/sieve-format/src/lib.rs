//! Sieve's on-disk format.
//!
//! A table is stored as *slices*: Parquet files of a bounded number of rows,
//! each written with page-level statistics, the page index (column index and
//! offset index), small data pages and Bloom filters on key columns, so that a
//! storage node can decide page by page what a predicate may match (the
//! *coarse stage*) before it decodes anything.
//!
//! ```text
//!   DIR/node-0/lineitem/lineitem-00001.parquet   slice 1 of lineitem
//!   DIR/node-1/lineitem/lineitem-00002.parquet   slice 2, on the next node
//!   DIR/node-2/orders/orders-00001.parquet       ...
//!   DIR/_SUCCESS                                 written last: the load is complete
//! ```
//!
//! With replicas (R > 1), a slice is also copied, byte for byte, to the next
//! R - 1 nodes. Each storage node owns one `node-K` directory. Slices are written to a
//! temporary name and renamed into place, so a crash in the middle of a load
//! never leaves a partial slice visible.
//!
//! Every page of a slice carries a CRC-32 in the footer (see
//! [`PageChecksums`]), so a reader can tell a damaged copy from a good one.
//!
//! This crate does no networking and knows nothing of queries.
#![deny(missing_docs)]

mod benchmark;
mod catalog;
mod checksum;
mod layout;
pub mod planner;
mod release;
pub mod ssb;
mod tpch;
pub mod writes;

pub use benchmark::{Benchmark, GeneratedTable};
pub use catalog::{ColumnSummary, SliceSummary, TableSummary};
pub use checksum::{
    add_page_checksums, find_page_corruption, page_ranges, PageChecksums, PageCorruption,
    PAGE_CHECKSUMS_KEY,
};
pub use layout::{
    copy_slice, slice_file_name, write_slice, write_slice_with_properties, write_table_slice,
    SliceLayout, DISTINCT_COUNTS_KEY, TABLE_SLICES_KEY,
};
pub use planner::{LayoutPlan, PlannerSettings, LAYOUT_PLAN_KEY};
pub use release::{release_freed_memory, set_memory_releaser};
pub use ssb::{SsbTable, SSB_TABLES};
pub use tpch::{is_generated, slice_path, TpchTable, TPCH_TABLES};

/// Version of the on-disk layout. A load written by another version is not
/// considered complete and is generated again (version 2 added the per-column
/// distinct counts, version 3 the page checksums or each slice's table slice count,
/// version 4 both; version 5 loads TPC-H through the write path, into
/// tables of the data set's catalog; version 6 plans each table's column
/// layout, [`planner`]).
pub const FORMAT_VERSION: u32 = 6;

/// The table catalog's file in a data set's directory (beside the node
/// directories): the SQLite database of the tables' versions.
pub const TABLE_CATALOG_FILE: &str = "catalog.sqlite";

/// Name of the marker file written after every slice of a load is in place.
pub const LOAD_COMPLETE_MARKER: &str = "_SUCCESS";

/// The directory owned by storage node `node` inside a generated data set.
pub fn node_directory(root: &std::path::Path, node: usize) -> std::path::PathBuf {
    root.join(format!("node-{node}"))
}
