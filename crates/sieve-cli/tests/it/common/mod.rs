//! Test data shared by the end-to-end test files.

use std::path::PathBuf;

use sieve_cli::cluster::generated_tpch;
use sieve_format::SliceLayout;

/// Storage nodes of the small-slice data set.
pub(crate) const NODES: usize = 3;

/// TPC-H SF 0.01 in small slices (5,000 rows) and row groups (1,024 rows),
/// so every table spans several slices and nodes and tables of few slices
/// are read in row-group ranges; each slice on `replicas` nodes. Generated
/// once per build into the target directory; concurrent test processes each
/// generate into their own directory and rename it into place.
pub(crate) fn small_slices(replicas: usize) -> PathBuf {
    let suffix = if replicas > 1 {
        format!("-r{replicas}")
    } else {
        String::new()
    };
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "tpch-sf0.01-slices5000-rg1024{suffix}-v{}",
        sieve_format::FORMAT_VERSION
    ));
    let layout = SliceLayout {
        slice_rows_max: 5000,
        row_group_rows_max: 1024,
        ..SliceLayout::default()
    };
    generated_tpch(&root, 0.01, NODES, replicas, &layout).expect("generate TPC-H")
}
