//! TPC-H data generation (dbgen-identical, via `tpchgen-arrow`) into slices.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use parquet::errors::{ParquetError, Result};
use tpchgen::generators::{
    CustomerGenerator, LineItemGenerator, NationGenerator, OrderGenerator, PartGenerator,
    PartSuppGenerator, RegionGenerator, SupplierGenerator,
};
use tpchgen_arrow::{
    CustomerArrow, LineItemArrow, NationArrow, OrderArrow, PartArrow, PartSuppArrow, RegionArrow,
    SupplierArrow,
};

use crate::{
    copy_slice, node_directory, write_table_slice, SliceLayout, FORMAT_VERSION,
    LOAD_COMPLETE_MARKER,
};

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
    /// Number of slices this table is cut into at `scale_factor`.
    fn slice_count(&self, scale_factor: f64, layout: &SliceLayout) -> usize {
        if self.rows_at_scale_one <= 25 {
            return 1; // nation and region do not scale
        }
        let rows = (self.rows_at_scale_one as f64 * scale_factor).ceil() as usize;
        rows.div_ceil(layout.slice_rows_max).max(1)
    }

    /// Schema and batches of part `part` (1-based) of `parts`.
    fn generate(
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

/// Whether `root` holds a complete load of this [`FORMAT_VERSION`] over
/// `nodes` nodes with `replicas` copies of each slice (the marker is written
/// last and names them).
pub fn is_generated(root: &Path, nodes: usize, replicas: usize) -> bool {
    let Ok(marker) = std::fs::read(root.join(LOAD_COMPLETE_MARKER)) else {
        return false;
    };
    let Ok(marker) = serde_json::from_slice::<serde_json::Value>(&marker) else {
        return false;
    };
    let number = |key: &str| marker.get(key).and_then(serde_json::Value::as_u64);
    number("format_version") == Some(u64::from(FORMAT_VERSION))
        && number("nodes") == Some(nodes as u64)
        && number("replicas").unwrap_or(1) == replicas as u64
}

/// The nodes holding the copies of a slice whose first copy is on `first`:
/// `first` and the next `replicas - 1` nodes, wrapping around.
pub fn replica_nodes(first: usize, replicas: usize, nodes: usize) -> Vec<usize> {
    (0..replicas).map(|copy| (first + copy) % nodes).collect()
}

/// Generate TPC-H at `scale_factor` into `root`, spreading slices round-robin
/// over `nodes` storage-node directories, each slice on `replicas` nodes (the
/// copies are byte-identical). Slices are generated in parallel on all cores.
/// The completion marker is written after every slice is in place.
pub fn generate_tpch(
    root: &Path,
    scale_factor: f64,
    nodes: usize,
    replicas: usize,
    layout: &SliceLayout,
) -> Result<()> {
    if nodes == 0 {
        return Err(ParquetError::General(
            "at least one storage node is needed".into(),
        ));
    }
    if replicas == 0 || replicas > nodes {
        return Err(ParquetError::General(format!(
            "replicas must be between 1 and the number of nodes ({nodes}), got {replicas}"
        )));
    }
    if scale_factor.is_nan() || scale_factor <= 0.0 {
        return Err(ParquetError::General(format!(
            "scale factor must be positive, got {scale_factor}"
        )));
    }
    let _ = std::fs::remove_file(root.join(LOAD_COMPLETE_MARKER));
    let mut work = Vec::new();
    for (table_index, table) in TPCH_TABLES.iter().enumerate() {
        let parts = table.slice_count(scale_factor, layout);
        for part in 1..=parts {
            // Start each table on a different node so single-slice tables spread out.
            let node = (table_index + part - 1) % nodes;
            work.push((*table, part, parts, node));
        }
    }
    // Largest tables first, so the tail of the load is short.
    work.sort_by_key(|(table, ..)| std::cmp::Reverse(table.rows_at_scale_one));
    let next = AtomicUsize::new(0);
    let first_error: Mutex<Option<ParquetError>> = Mutex::new(None);
    let workers = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                let Some((table, part, parts, node)) = work.get(index) else {
                    return;
                };
                if first_error.lock().expect("no poisoning").is_some() {
                    return;
                }
                let (schema, batches) = table.generate(scale_factor, *part as i32, *parts as i32);
                let copies = replica_nodes(*node, replicas, nodes);
                let path = slice_path(&node_directory(root, copies[0]), table.name, *part);
                let table_slices = u32::try_from(*parts).ok();
                let mut written =
                    write_table_slice(&path, &schema, layout, table_slices, batches).map(|_| ());
                for &copy in &copies[1..] {
                    if written.is_ok() {
                        let to = slice_path(&node_directory(root, copy), table.name, *part);
                        written = copy_slice(&path, &to);
                    }
                }
                if let Err(error) = written {
                    first_error
                        .lock()
                        .expect("no poisoning")
                        .get_or_insert(error);
                    return;
                }
            });
        }
    });
    if let Some(error) = first_error.into_inner().expect("no poisoning") {
        return Err(error);
    }
    let meta = serde_json::json!({
        "benchmark": "tpch",
        "format_version": FORMAT_VERSION,
        "scale_factor": scale_factor,
        "nodes": nodes,
        "replicas": replicas,
        "slice_rows_max": layout.slice_rows_max,
        "data_page_rows_max": layout.data_page_rows_max,
    });
    std::fs::write(
        root.join(LOAD_COMPLETE_MARKER),
        serde_json::to_vec_pretty(&meta).expect("json"),
    )?;
    Ok(())
}
