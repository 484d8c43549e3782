//! `SieveTable`: a table whose slices live on storage nodes.

use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use datafusion::catalog::{Session, TableProvider};
use datafusion::common::{DFSchema, Result, Statistics};
use datafusion::datasource::source::DataSourceExec;
use datafusion::datasource::TableType;
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::logical_expr::utils::conjunction;
use datafusion::logical_expr::{Expr, TableProviderFilterPushDown};
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::utils::{collect_columns, reassign_expr_columns};
use datafusion::physical_expr::{conjunction as physical_conjunction, PhysicalExpr};
use datafusion::physical_plan::filter::FilterExecBuilder;
use datafusion::physical_plan::ExecutionPlan;
use datafusion_datasource::file_groups::FileGroup;
use datafusion_datasource::file_scan_config::FileScanConfigBuilder;
use datafusion_datasource::PartitionedFile;
use datafusion_datasource_parquet::source::ParquetSource;
use datafusion_datasource_parquet::CachedParquetFileReaderFactory;
use sieve_fragment::{check_allowed, pruning_predicate, ExpressionShape};

use crate::checked_reader::CheckedReaderFactory;
use crate::copies::TableCopy;
use crate::nan_safe::{nan_safe, FloatFilterGuardExec};
use crate::scan::ScanChoice;

use crate::range_store::{ClusterRangeStore, CLUSTER_RANGE_URL};
use crate::{
    ClusterCatalog, ClusterTable, NdpMode, ScanOptions, SieveConfig, SieveScanExec, Traffic,
};

/// A table of the cluster, as DataFusion sees it.
///
/// Every filter DataFusion offers is accepted as `Exact`: with NDP on, the
/// allow-listed conjuncts run on the storage nodes and the rest in a
/// `FilterExec` right above the scan; with NDP off, all of them run in a
/// `FilterExec` over the Parquet scan. Either way the scan's output is
/// exactly filtered.
#[derive(Debug)]
pub struct SieveTable {
    table: Arc<ClusterTable>,
    catalog: Arc<ClusterCatalog>,
    traffic: Arc<Traffic>,
    /// The table's unique, never-NULL columns, proven once when first asked.
    unique: std::sync::OnceLock<Vec<usize>>,
    /// Its current sorted copies (a table a user owns), which a scan may
    /// read instead ([`crate::copies`]).
    copies: Vec<TableCopy>,
}

impl SieveTable {
    /// A provider for `table`.
    pub fn new(
        table: Arc<ClusterTable>,
        catalog: Arc<ClusterCatalog>,
        traffic: Arc<Traffic>,
    ) -> Self {
        Self {
            table,
            catalog,
            traffic,
            unique: std::sync::OnceLock::new(),
            copies: vec![],
        }
    }

    /// This provider, with `copies` to read instead where they skip more.
    pub fn with_copies(self, copies: Vec<TableCopy>) -> Self {
        Self { copies, ..self }
    }

    /// The sorted copies a scan may read instead.
    pub fn copies(&self) -> &[TableCopy] {
        &self.copies
    }

    /// Columns unique over the slices this provider reads and never NULL
    /// ([`ClusterTable::unique_columns`]).
    pub fn unique_columns(&self) -> &[usize] {
        self.unique.get_or_init(|| self.table.unique_columns())
    }

    fn scan_off(
        &self,
        state: &dyn Session,
        projection: &[usize],
        predicate: Option<Arc<dyn PhysicalExpr>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let schema = Arc::clone(&self.table.schema);
        let url = ObjectStoreUrl::parse(CLUSTER_RANGE_URL)?;
        let store = state.runtime_env().object_store(&url)?;
        let metadata_cache = state.runtime_env().cache_manager.get_file_metadata_cache();
        // Exactly what DataFusion's ListingTable does for Parquet: the session's
        // Parquet options (page index, pruning, Bloom filters) and metadata cache.
        let mut source = ParquetSource::new(Arc::clone(&schema))
            .with_table_parquet_options(state.table_options().parquet.clone())
            // Every page read is verified against the slice's page checksums.
            .with_parquet_file_reader_factory(Arc::new(CheckedReaderFactory::new(Arc::new(
                CachedParquetFileReaderFactory::new(store, metadata_cache),
            ))));
        // Only what may prune by statistics (NaN is in no float statistics,
        // `sieve_fragment::pruning_predicate`); the exact filter is above.
        if let Some(prunable) = predicate
            .as_ref()
            .and_then(|predicate| pruning_predicate(predicate, &schema))
        {
            source = source.with_predicate(prunable);
        }
        let partitions = state
            .config()
            .target_partitions()
            .clamp(1, self.table.slices.len().max(1));
        let mut groups: Vec<Vec<PartitionedFile>> = vec![Vec::new(); partitions];
        for (index, slice) in self.table.slices.iter().enumerate() {
            let file_path = slice
                .range_url
                .split_once("/slices/")
                .map(|(_, rest)| format!("slices/{rest}"))
                .unwrap_or_default();
            let mut file = PartitionedFile::new(
                ClusterRangeStore::path(slice.node, &file_path),
                slice.summary.bytes,
            );
            // Deleted rows stay out: an access plan without them, which
            // DataFusion's Parquet scan honours (and intersects with its
            // own pruning).
            if let Some((deleted, _)) = &slice.deleted {
                let rows = &slice.summary.row_group_rows;
                if rows.len() != slice.summary.row_groups as usize {
                    return datafusion::common::exec_err!(
                        "slice {} has deleted rows but its node did not say how many rows each row group has",
                        slice.summary.slice
                    );
                }
                let deleted = sieve_fragment::decode_deletions(deleted)?;
                let plan = sieve_fragment::apply_deletions(
                    datafusion::datasource::physical_plan::parquet::ParquetAccessPlan::new_all(
                        rows.len(),
                    ),
                    rows,
                    &deleted,
                );
                file = file.with_extension(plan);
            }
            groups[index % partitions].push(file);
        }
        let mut needed: Vec<usize> = projection.to_vec();
        if let Some(predicate) = &predicate {
            needed.extend(collect_columns(predicate).iter().map(Column::index));
        }
        needed.sort_unstable();
        needed.dedup();
        let config = FileScanConfigBuilder::new(url, Arc::new(source))
            .with_file_groups(groups.into_iter().map(FileGroup::new).collect())
            .with_projection_indices(Some(needed.clone()))?
            .with_statistics(self.table.statistics.clone())
            .build();
        let scan: Arc<dyn ExecutionPlan> =
            FloatFilterGuardExec::over(DataSourceExec::from_data_source(config));
        finish_scan(scan, &needed, projection, predicate)
    }
}

/// Put the exact `predicate` (over the table schema) and the final
/// `projection` on top of a scan that produced the `needed` columns.
fn finish_scan(
    scan: Arc<dyn ExecutionPlan>,
    needed: &[usize],
    projection: &[usize],
    predicate: Option<Arc<dyn PhysicalExpr>>,
) -> Result<Arc<dyn ExecutionPlan>> {
    let Some(predicate) = predicate else {
        if needed == projection {
            return Ok(scan);
        }
        let positions = projection
            .iter()
            .map(|column| needed.binary_search(column).expect("needed ⊇ projection"))
            .collect();
        return Ok(Arc::new(
            FilterExecBuilder::new(datafusion::physical_expr::expressions::lit(true), scan)
                .apply_projection(Some(positions))?
                .build()?,
        ));
    };
    let predicate = reassign_expr_columns(predicate, &scan.schema())?;
    let predicate = nan_safe(predicate, &scan.schema());
    let positions = projection
        .iter()
        .map(|column| needed.binary_search(column).expect("needed ⊇ projection"))
        .collect();
    Ok(Arc::new(
        FilterExecBuilder::new(predicate, scan)
            .apply_projection(Some(positions))?
            .build()?,
    ))
}

#[async_trait]
impl TableProvider for SieveTable {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.table.schema)
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    fn statistics(&self) -> Option<Statistics> {
        Some(self.table.statistics.clone())
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> Result<Vec<TableProviderFilterPushDown>> {
        Ok(vec![TableProviderFilterPushDown::Exact; filters.len()])
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        _limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let schema = Arc::clone(&self.table.schema);
        let projection: Vec<usize> = projection
            .cloned()
            .unwrap_or_else(|| (0..schema.fields().len()).collect());
        let settings = SieveConfig::of(state.config_options());
        let df_schema = DFSchema::try_from(Arc::clone(&schema))?;
        let filter = conjunction(filters.iter().cloned());
        let predicate = filter
            .map(|filter| state.create_physical_expr(filter, &df_schema))
            .transpose()?;
        if settings.mode()? == NdpMode::Off {
            return self.scan_off(state, &projection, predicate);
        }
        // Split the predicate: allow-listed conjuncts go to the storage nodes,
        // the rest stay here, and EXPLAIN says why.
        let (pushed, residual, notes) = split_pushable(predicate.as_ref(), &schema);
        let pushed = (!pushed.is_empty()).then(|| physical_conjunction(pushed));
        let residual = (!residual.is_empty()).then(|| physical_conjunction(residual));
        let mut needed = projection.clone();
        if let Some(residual) = &residual {
            needed.extend(collect_columns(residual).iter().map(Column::index));
            needed.sort_unstable();
            needed.dedup();
        }
        // The table's slices or a sorted copy's, only those that may hold
        // rows the whole predicate keeps; judged again at run time with
        // the join filters.
        let copies: &[TableCopy] = if settings.sorted_copies {
            &self.copies
        } else {
            &[]
        };
        let reading = crate::copies::choose(
            &self.table,
            copies,
            predicate.as_ref(),
            settings.slice_pruning,
        );
        let planned =
            if reading.copy.is_some() || reading.table.slices.len() < self.table.slices.len() {
                reading.describe(self.table.slices.len())
            } else {
                String::new()
            };
        let scan: Arc<dyn ExecutionPlan> = Arc::new(
            SieveScanExec::try_new(
                Arc::clone(&self.catalog),
                Arc::clone(&reading.table),
                Arc::clone(&self.traffic),
                needed.clone(),
                pushed,
                ScanOptions::from_settings(&settings, state.config().target_partitions())?,
            )?
            .with_choice(ScanChoice {
                table: Arc::clone(&self.table),
                copies: copies.to_vec(),
                prune: settings.slice_pruning,
                planned,
            }),
        );
        let scan: Arc<dyn ExecutionPlan> = if notes.is_empty() {
            scan
        } else {
            let scan = scan
                .downcast_ref::<SieveScanExec>()
                .expect("built above")
                .clone_with_notes(&notes);
            Arc::new(scan)
        };
        match residual {
            None => Ok(scan),
            Some(_) => finish_scan(scan, &needed, &projection, residual),
        }
    }
}

/// Unique, never-NULL columns of `provider` if it is one of Sieve's tables
/// (discovered or owned), at the version it reads; none otherwise.
/// Column `column`'s distinct values estimated from the slices' counts
/// ([`ClusterTable::distinct_estimate`]), if `provider` is one of Sieve's
/// tables and the counts are there.
pub(crate) fn distinct_estimate_of(provider: &dyn TableProvider, column: usize) -> Option<usize> {
    if let Some(table) = provider.downcast_ref::<SieveTable>() {
        return table.table.distinct_estimate(column);
    }
    if let Some(table) = provider.downcast_ref::<crate::tables::OwnedTable>() {
        return table.reader().table.distinct_estimate(column);
    }
    None
}

pub(crate) fn unique_columns_of(provider: &dyn TableProvider) -> Vec<usize> {
    if let Some(table) = provider.downcast_ref::<SieveTable>() {
        return table.unique_columns().to_vec();
    }
    if let Some(table) = provider.downcast_ref::<crate::tables::OwnedTable>() {
        return table.reader().unique_columns().to_vec();
    }
    vec![]
}

type Conjuncts = Vec<Arc<dyn PhysicalExpr>>;

/// The conjuncts of `predicate` the storage nodes may evaluate, those the
/// compute node keeps, and a note for EXPLAIN on each kept for its size
/// (a deep or huge expression is a legitimate query: it gets its answer
/// here). The pushed conjunction as a whole stays within the fragment
/// limits: the deepest conjuncts stay here until it does.
fn split_pushable(
    predicate: Option<&Arc<dyn PhysicalExpr>>,
    schema: &SchemaRef,
) -> (Conjuncts, Conjuncts, Vec<String>) {
    let (mut pushed, mut residual, mut notes) = (vec![], vec![], vec![]);
    let Some(predicate) = predicate else {
        return (vec![], residual, notes);
    };
    // `split_conjunction` recurses over ANDs only; the depth limit of the
    // session (`sieve.expression_depth_max`) bounds them.
    for conjunct in datafusion::physical_expr::split_conjunction(predicate) {
        let shape = ExpressionShape::of(conjunct);
        match shape.exceeded() {
            Some(reason) => {
                notes.push(format!("filter kept on the compute node: {reason}"));
                residual.push(Arc::clone(conjunct));
            }
            None if check_allowed(conjunct, schema).is_ok() => {
                pushed.push((shape, Arc::clone(conjunct)))
            }
            None => residual.push(Arc::clone(conjunct)),
        }
    }
    // AND nests its conjuncts, each one level more: the deepest stay here
    // until the conjunction fits.
    pushed.sort_by_key(|(shape, _)| shape.depth);
    let mut kept: Conjuncts = pushed.into_iter().map(|(_, conjunct)| conjunct).collect();
    while !kept.is_empty() {
        let Some(reason) = ExpressionShape::of(&physical_conjunction(kept.clone())).exceeded()
        else {
            break;
        };
        notes.push(format!(
            "filter kept on the compute node: pushed with the others, {reason}"
        ));
        residual.extend(kept.pop());
    }
    // The encoded fragment has its own bound (FRAGMENT_BYTES_MAX), with
    // half of it left for join filters: the largest conjuncts stay here
    // until it fits.
    while !kept.is_empty() {
        let fragment = sieve_fragment::Fragment {
            projection: vec![],
            predicate: Some(physical_conjunction(kept.clone())),
            aggregate: None,
        };
        let encoded = fragment.encode_body(schema).map(|body| body.len());
        let bytes = match encoded {
            Ok(bytes) if bytes <= sieve_fragment::FRAGMENT_BYTES_MAX / 2 => break,
            Ok(bytes) => bytes,
            Err(_) => sieve_fragment::FRAGMENT_BYTES_MAX + 1,
        };
        notes.push(format!(
            "filter kept on the compute node: a fragment of at least {bytes} bytes, \
             above half the limit of {}",
            sieve_fragment::FRAGMENT_BYTES_MAX
        ));
        kept.sort_by_key(|conjunct| ExpressionShape::of(conjunct).nodes);
        residual.extend(kept.pop());
    }
    (kept, residual, notes)
}
