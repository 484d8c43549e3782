//! Compaction: slices whose deleted share passed
//! `sieve.compact_deleted_share` are rewritten from their live rows, with
//! fresh statistics, page index and Bloom filters, in a commit of their own
//! (FLIXR keeps its indexes exact through deletes; a rewritten slice prunes
//! as tightly as one freshly loaded). The commit conflicts, changing
//! nothing, if another statement deleted rows of those slices meanwhile.

use std::sync::Arc;

use datafusion::common::Result;
use datafusion::execution::TaskContext;
use datafusion::physical_plan::ExecutionPlan;

use super::{Change, OwnedTables, Snapshot, TableWriter};
use crate::{ClusterCatalog, ClusterTable, ScanOptions, SieveScanExec, Traffic};

/// Default of `sieve.compact_deleted_share`.
pub const COMPACT_DELETED_SHARE: f64 = 0.3;

/// Rewrite the slices of `snapshot` (read as `cluster_table`) whose deleted
/// share is at least `share`. Returns the slices rewritten (0: none was).
pub async fn compact(
    tables: &Arc<OwnedTables>,
    catalog: &Arc<ClusterCatalog>,
    traffic: &Arc<Traffic>,
    snapshot: &Snapshot,
    cluster_table: &ClusterTable,
    share: f64,
    context: Arc<TaskContext>,
) -> Result<usize> {
    let chosen: Vec<usize> = snapshot
        .slices
        .iter()
        .enumerate()
        .filter(|(_, slice)| {
            slice.summary.rows > 0 && slice.deleted_rows as f64 >= share * slice.summary.rows as f64
        })
        .map(|(index, _)| index)
        .collect();
    if chosen.is_empty() {
        return Ok(0);
    }
    let schema = Arc::clone(&snapshot.table.schema);
    let settings = crate::SieveConfig::of(context.session_config().options());
    let mut writer = TableWriter::new(Arc::clone(tables), snapshot.table.clone());
    // Slice by slice, each old slice's live rows into new slices of their
    // own: the key ranges stay as narrow as they were.
    for &index in &chosen {
        let mut rewritten = cluster_table.clone();
        rewritten.slices = vec![cluster_table.slices[index].clone()];
        let scan = SieveScanExec::try_new(
            Arc::clone(catalog),
            Arc::new(rewritten),
            Arc::clone(traffic),
            (0..schema.fields().len()).collect(),
            None,
            ScanOptions::from_settings(&settings, 1)?,
        )?;
        let rows = scan.execute(0, Arc::clone(&context))?;
        writer = writer.write_stream(rows).await?;
        if let Err(error) = writer.end_slice().await {
            writer.abandon().await;
            return Err(error);
        }
    }
    let change = Change {
        removed: chosen
            .iter()
            .map(|&index| snapshot.slices[index].slice)
            .collect(),
        expect: chosen
            .iter()
            .map(|&index| {
                (
                    snapshot.slices[index].slice,
                    snapshot.slices[index].deleted_version,
                )
            })
            .collect(),
        ..Change::default()
    };
    writer
        .commit(change, &format!("COMPACT {}", snapshot.table.name))
        .await?;
    Ok(chosen.len())
}
