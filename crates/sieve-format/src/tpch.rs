//! TPC-H rows (dbgen-identical, via `tpchgen-arrow`): what the `tpch(...)`
//! table function generates and `sieve gen` loads through the write path.

use std::path::{Path, PathBuf};

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use tpchgen::generators::{
    CustomerGenerator, LineItemGenerator, NationGenerator, OrderGenerator, PartGenerator,
    PartSuppGenerator, RegionGenerator, SupplierGenerator,
};
use tpchgen_arrow::{
    CustomerArrow, LineItemArrow, NationArrow, OrderArrow, PartArrow, PartSuppArrow, RegionArrow,
    SupplierArrow,
};

use crate::{FORMAT_VERSION, LOAD_COMPLETE_MARKER};

/// Rows per generated Arrow batch.
const GENERATE_BATCH_ROWS: usize = 8192;

/// One TPC-H table: its name and how many rows it has at scale factor 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpchTable {
    /// Table name, as the queries spell it.
    pub name: &'static str,
    /// Rows at scale factor 1 (lineitem is approximate: about 4 per order).
    pub rows_at_scale_one: u64,
}

/// The eight TPC-H tables.
pub const TPCH_TABLES: [TpchTable; 8] = [
    TpchTable {
        name: "nation",
        rows_at_scale_one: 25,
    },
    TpchTable {
        name: "region",
        rows_at_scale_one: 5,
    },
    TpchTable {
        name: "part",
        rows_at_scale_one: 200_000,
    },
    TpchTable {
        name: "supplier",
        rows_at_scale_one: 10_000,
    },
    TpchTable {
        name: "partsupp",
        rows_at_scale_one: 800_000,
    },
    TpchTable {
        name: "customer",
        rows_at_scale_one: 150_000,
    },
    TpchTable {
        name: "orders",
        rows_at_scale_one: 1_500_000,
    },
    TpchTable {
        name: "lineitem",
        rows_at_scale_one: 6_001_215,
    },
];

impl TpchTable {
    /// The table called `name`, if TPC-H has one.
    pub fn named(name: &str) -> Option<TpchTable> {
        TPCH_TABLES
            .iter()
            .find(|table| table.name.eq_ignore_ascii_case(name))
            .copied()
    }

    /// The column its rows are generated in the order of (its key's first
    /// column): what a load sorts each slice by.
    pub fn key_column(&self) -> &'static str {
        match self.name {
            "nation" => "n_nationkey",
            "region" => "r_regionkey",
            "part" => "p_partkey",
            "supplier" => "s_suppkey",
            "partsupp" => "ps_partkey",
            "customer" => "c_custkey",
            "orders" => "o_orderkey",
            "lineitem" => "l_orderkey",
            other => unreachable!("TPCH_TABLES names only known tables, got {other}"),
        }
    }

    /// Schema and batches of part `part` (1-based) of `parts`.
    pub fn generate(
        &self,
        scale_factor: f64,
        part: i32,
        parts: i32,
    ) -> (
        SchemaRef,
        Box<dyn Iterator<Item = std::result::Result<RecordBatch, arrow::error::ArrowError>> + Send>,
    ) {
        macro_rules! arrow_of {
            ($generator:ident, $arrow:ident) => {
                (
                    $arrow::schema_ref(),
                    Box::new(
                        $arrow::new($generator::new(scale_factor, part, parts))
                            .with_batch_size(GENERATE_BATCH_ROWS),
                    ),
                )
            };
        }
        match self.name {
            "nation" => arrow_of!(NationGenerator, NationArrow),
            "region" => arrow_of!(RegionGenerator, RegionArrow),
            "part" => arrow_of!(PartGenerator, PartArrow),
            "supplier" => arrow_of!(SupplierGenerator, SupplierArrow),
            "partsupp" => arrow_of!(PartSuppGenerator, PartSuppArrow),
            "customer" => arrow_of!(CustomerGenerator, CustomerArrow),
            "orders" => arrow_of!(OrderGenerator, OrderArrow),
            "lineitem" => arrow_of!(LineItemGenerator, LineItemArrow),
            other => unreachable!("TPCH_TABLES names only known tables, got {other}"),
        }
    }
}

/// Path of slice `part` of `table` inside a storage node's directory.
pub fn slice_path(node_dir: &Path, table: &str, part: usize) -> PathBuf {
    node_dir
        .join(table)
        .join(crate::slice_file_name(table, part as u32))
}

/// Whether `root` holds a complete load of `benchmark` in this
/// [`FORMAT_VERSION`] over `nodes` nodes with `replicas` copies of each
/// slice, and its table catalog (the marker is written last and names them;
/// a marker without a benchmark is TPC-H's).
pub fn is_generated(
    root: &Path,
    benchmark: crate::Benchmark,
    nodes: usize,
    replicas: usize,
) -> bool {
    let Ok(marker) = std::fs::read(root.join(LOAD_COMPLETE_MARKER)) else {
        return false;
    };
    let Ok(marker) = serde_json::from_slice::<serde_json::Value>(&marker) else {
        return false;
    };
    let number = |key: &str| marker.get(key).and_then(serde_json::Value::as_u64);
    let named = marker
        .get("benchmark")
        .and_then(serde_json::Value::as_str)
        .unwrap_or("tpch");
    named == benchmark.name()
        && number("format_version") == Some(u64::from(FORMAT_VERSION))
        && number("nodes") == Some(nodes as u64)
        && number("replicas").unwrap_or(1) == replicas as u64
        && root.join(crate::TABLE_CATALOG_FILE).is_file()
}
