//! The coarse stage: match hints.
//!
//! From the slice's in-memory metadata and the fragment's predicate, decide
//! which row groups and pages may hold matching rows (the first, coarse stage
//! of YourSQL's two-stage filter). It may let false positives through, never
//! false negatives; the exact stage filters what remains.
//!
//! ```text
//!   all row groups ──min/max──> ──Bloom filter──> ──page index──> match hints
//!                   (stats)      (key = literal)   (per-page min/max)   (ParquetAccessPlan)
//! ```
//!
//! Each step counts the pages it rules out, over the columns the fragment
//! needs, so the filtering ratio (pages read / pages considered) is exact.

use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use datafusion::common::Result;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use datafusion_datasource_parquet::{
    BloomFilterStatistics, PagePruningAccessPlanFilter, ParquetAccessPlan, ParquetFileMetrics,
    RowGroupAccess, RowGroupAccessPlanFilter,
};
use datafusion_pruning::{PruningPredicate, PruningPredicateBuilder};
use parquet::bloom_filter::Sbbf;
use parquet::file::metadata::ParquetMetaData;
use sieve_fragment::pruning_predicate;

use crate::{CatalogSlice, SliceDetails};

/// The outcome of the coarse stage for one slice.
#[derive(Debug, Clone)]
pub struct MatchHints {
    /// Row groups and row ranges to read.
    pub access_plan: ParquetAccessPlan,
    /// Pages of the needed columns over all row groups.
    pub pages_considered: u64,
    /// Pages in row groups ruled out by min/max statistics.
    pub pages_skipped_statistics: u64,
    /// Pages in row groups ruled out by Bloom filters.
    pub pages_skipped_bloom_filter: u64,
    /// Pages ruled out by the page index.
    pub pages_skipped_page_index: u64,
    /// Bytes of Bloom filters read from disk.
    pub bloom_filter_bytes_read: u64,
    /// Rows the access plan selects.
    pub rows_selected: u64,
}

impl MatchHints {
    /// Pages the exact stage will read.
    pub fn pages_read(&self) -> u64 {
        self.pages_considered
            - self.pages_skipped_statistics
            - self.pages_skipped_bloom_filter
            - self.pages_skipped_page_index
    }

    /// Compute match hints for `slice`, reading `columns` (indices into the
    /// table schema, which for flat tables are also Parquet leaf indices),
    /// within the row groups `wanted` (all if `None`; indices already
    /// checked). Blocking: reads Bloom filters from disk.
    pub fn compute(
        slice: &CatalogSlice,
        details: &SliceDetails,
        schema: &SchemaRef,
        columns: &[usize],
        predicate: Option<&Arc<dyn PhysicalExpr>>,
        wanted: Option<&[usize]>,
    ) -> Result<Self> {
        let metadata = &details.metadata;
        let row_groups = metadata.row_groups();
        let is_wanted = |group: usize| wanted.is_none_or(|wanted| wanted.contains(&group));
        let pages_per_group: Vec<u64> = (0..row_groups.len())
            .map(|group| {
                if !is_wanted(group) {
                    return 0;
                }
                columns
                    .iter()
                    .map(|&column| column_pages(metadata, group, column))
                    .sum()
            })
            .collect();
        let mut initial = ParquetAccessPlan::new_all(row_groups.len());
        for group in (0..row_groups.len()).filter(|&group| !is_wanted(group)) {
            initial.skip(group);
        }
        let mut hints = Self {
            access_plan: initial.clone(),
            pages_considered: pages_per_group.iter().sum(),
            pages_skipped_statistics: 0,
            pages_skipped_bloom_filter: 0,
            pages_skipped_page_index: 0,
            bloom_filter_bytes_read: 0,
            rows_selected: 0,
        };
        // NaN is in no float statistics: conjuncts over floats do not prune.
        let predicate = predicate.and_then(|predicate| pruning_predicate(predicate, schema));
        if let Some(predicate) = &predicate {
            let metrics = ParquetFileMetrics::new(
                0,
                slice.object_path.as_ref(),
                &ExecutionPlanMetricsSet::new(),
            );
            let parquet_schema = metadata.file_metadata().schema_descr();
            // A predicate that cannot be turned into a pruning predicate simply
            // prunes nothing; the exact stage still applies it.
            if let Ok(pruning) = PruningPredicateBuilder::new()
                .with_file_schema(Arc::clone(schema))
                .try_build(Arc::clone(predicate))
            {
                let mut filter = RowGroupAccessPlanFilter::new(initial);
                filter.prune_by_statistics(schema, parquet_schema, row_groups, &pruning, &metrics);
                let after_statistics = filter.build();
                hints.pages_skipped_statistics = skipped_pages(&after_statistics, &pages_per_group);

                let (after_bloom, bloom_bytes) = prune_by_bloom_filters(
                    slice,
                    metadata,
                    schema,
                    &pruning,
                    after_statistics,
                    &metrics,
                )?;
                hints.bloom_filter_bytes_read = bloom_bytes;
                hints.pages_skipped_bloom_filter =
                    skipped_pages(&after_bloom, &pages_per_group) - hints.pages_skipped_statistics;
                hints.access_plan = after_bloom;
            }
            let page_filter = PagePruningAccessPlanFilter::new(predicate, Arc::clone(schema));
            let before = hints.access_plan.clone();
            hints.access_plan = page_filter.prune_plan_with_page_index(
                before.clone(),
                schema,
                parquet_schema,
                metadata,
                &metrics,
            );
            let read_before: u64 = pages_read(&before, metadata, columns);
            let read_after: u64 = pages_read(&hints.access_plan, metadata, columns);
            hints.pages_skipped_page_index = read_before - read_after;
        }
        hints.rows_selected = hints
            .access_plan
            .inner()
            .iter()
            .enumerate()
            .map(|(group, access)| match access {
                RowGroupAccess::Skip => 0,
                RowGroupAccess::Scan => row_groups[group].num_rows() as u64,
                RowGroupAccess::Selection(selection) => selection.row_count() as u64,
            })
            .sum();
        Ok(hints)
    }
}

fn column_pages(metadata: &ParquetMetaData, group: usize, column: usize) -> u64 {
    metadata
        .offset_index()
        .and_then(|index| index.get(group))
        .and_then(|columns| columns.get(column))
        .map(|column| column.page_locations().len() as u64)
        .unwrap_or(1)
}

fn skipped_pages(plan: &ParquetAccessPlan, pages_per_group: &[u64]) -> u64 {
    plan.inner()
        .iter()
        .zip(pages_per_group)
        .filter(|(access, _)| matches!(access, RowGroupAccess::Skip))
        .map(|(_, pages)| pages)
        .sum()
}

/// Pages of `columns` that overlap the rows `plan` selects.
fn pages_read(plan: &ParquetAccessPlan, metadata: &ParquetMetaData, columns: &[usize]) -> u64 {
    let mut pages = 0;
    for (group, access) in plan.inner().iter().enumerate() {
        match access {
            RowGroupAccess::Skip => {}
            RowGroupAccess::Scan => {
                pages += columns
                    .iter()
                    .map(|&column| column_pages(metadata, group, column))
                    .sum::<u64>()
            }
            RowGroupAccess::Selection(selection) => {
                // Selected row ranges of this row group.
                let mut ranges = Vec::new();
                let mut row = 0usize;
                for selector in selection.iter() {
                    if !selector.skip {
                        ranges.push(row..row + selector.row_count);
                    }
                    row += selector.row_count;
                }
                let group_rows = metadata.row_group(group).num_rows() as usize;
                for &column in columns {
                    let Some(locations) = metadata
                        .offset_index()
                        .and_then(|index| index.get(group))
                        .and_then(|columns| columns.get(column))
                        .map(|column| column.page_locations())
                    else {
                        pages += 1;
                        continue;
                    };
                    for (page, location) in locations.iter().enumerate() {
                        let start = location.first_row_index as usize;
                        let end = locations
                            .get(page + 1)
                            .map_or(group_rows, |next| next.first_row_index as usize);
                        if ranges
                            .iter()
                            .any(|range| range.start < end && start < range.end)
                        {
                            pages += 1;
                        }
                    }
                }
            }
        }
    }
    pages
}

/// Rule out row groups whose Bloom filters prove that an equality or IN-list
/// literal of the predicate is absent. Returns the new plan and the bytes of
/// Bloom filters read.
fn prune_by_bloom_filters(
    slice: &CatalogSlice,
    metadata: &ParquetMetaData,
    schema: &SchemaRef,
    pruning: &PruningPredicate,
    plan: ParquetAccessPlan,
    metrics: &ParquetFileMetrics,
) -> Result<(ParquetAccessPlan, u64)> {
    let literal_columns: Vec<_> = pruning
        .literal_columns()
        .into_iter()
        .filter_map(|name| schema.index_of(&name).ok().map(|index| (name, index)))
        .collect();
    let has_filters = literal_columns.iter().any(|(_, index)| {
        metadata
            .row_groups()
            .iter()
            .any(|group| group.column(*index).bloom_filter_offset().is_some())
    });
    if !has_filters {
        return Ok((plan, 0));
    }
    let file = crate::catalog::open_slice_file(&slice.path)?;
    let mut bytes_read = 0u64;
    let mut statistics = Vec::with_capacity(metadata.num_row_groups());
    for (group, access) in plan.inner().iter().enumerate() {
        let mut group_statistics = BloomFilterStatistics::new();
        if !matches!(access, RowGroupAccess::Skip) {
            for (name, index) in &literal_columns {
                let column = metadata.row_group(group).column(*index);
                if let Some(filter) = Sbbf::read_from_column_chunk(column, &file)? {
                    bytes_read += column.bloom_filter_length().unwrap_or(0) as u64;
                    let descriptor = column.column_descr();
                    group_statistics.insert(
                        name.clone(),
                        filter,
                        descriptor.physical_type(),
                        descriptor.type_length(),
                    );
                }
            }
        }
        statistics.push(group_statistics);
    }
    let mut filter = RowGroupAccessPlanFilter::new(plan);
    filter.prune_by_bloom_filters(pruning, metrics, &statistics);
    Ok((filter.build(), bytes_read))
}
