//! The plan that evaluates a fragment over one slice, built the same way
//! wherever it runs: on the storage node over its local file, or on the
//! compute node over the raw pages a busy storage node shipped instead.
//!
//! ```text
//!   DataSourceExec(ParquetSource, access plan, needed columns)
//!     -> FilterExec(exact predicate, projection to the shipped columns)
//!     -> [partial aggregation, the fragment's operators over that]
//! ```
//!
//! The caller supplies the bytes (a [`ParquetFileReaderFactory`]) and the
//! access plan; this module does no I/O itself.

use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::Result;
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::parquet::ParquetAccessPlan;
use datafusion::datasource::physical_plan::{
    FileScanConfigBuilder, ParquetFileReaderFactory, ParquetSource,
};
use datafusion::datasource::source::DataSourceExec;
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::utils::{collect_columns, reassign_expr_columns};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::filter::FilterExecBuilder;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::ExecutionPlan;

use crate::{fast_like, DecodedBody, SliceInputExec};

/// Table columns a fragment reads: its projection and its predicate's
/// columns, sorted and without duplicates.
pub fn needed_columns(body: &DecodedBody) -> Vec<usize> {
    let mut needed: Vec<usize> = body.projection.clone();
    if let Some(predicate) = &body.predicate {
        needed.extend(collect_columns(predicate).iter().map(Column::index));
    }
    needed.sort_unstable();
    needed.dedup();
    needed
}

/// Where the slice's bytes come from and how to read them.
#[derive(Debug, Clone)]
pub struct SliceSource {
    /// Serves the slice's bytes and its (cached) metadata.
    pub reader_factory: Arc<dyn ParquetFileReaderFactory>,
    /// The store URL `location` is resolved against.
    pub store_url: ObjectStoreUrl,
    /// The file's location within that store.
    pub location: String,
    /// The file's size in bytes.
    pub file_bytes: u64,
    /// Which row groups (and pages) to read.
    pub access_plan: ParquetAccessPlan,
    /// Target rows per batch.
    pub batch_rows: usize,
    /// Evaluate the predicate inside the Parquet decoder as well.
    pub pushdown_filters: bool,
    /// Ship each row's position in the file as a last column
    /// ([`ROW_POSITION_COLUMN`], Int64).
    pub row_positions: bool,
}

/// Name of the column of row positions a fragment ships when asked
/// (`FragmentEnvelope::row_positions`).
pub const ROW_POSITION_COLUMN: &str = "__sieve_row_position";

/// A fragment's plan over one slice.
#[derive(Debug)]
pub struct SlicePlan {
    /// The plan's root: shipped rows, or partial states with an aggregation.
    pub plan: Arc<dyn ExecutionPlan>,
    /// The filtered, projected rows under a pushed aggregation (for its
    /// input row count).
    pub aggregated_input: Option<Arc<dyn ExecutionPlan>>,
}

/// Build the plan of `body` over the slice `source` describes, whose table
/// schema is `schema`.
pub fn slice_plan(
    schema: &SchemaRef,
    body: &DecodedBody,
    source: SliceSource,
) -> Result<SlicePlan> {
    if source.row_positions && body.aggregate.is_some() {
        return datafusion::common::plan_err!(
            "row positions are not shipped with a pushed aggregation"
        );
    }
    let mut needed = needed_columns(body);
    let table_schema = if source.row_positions {
        // The Parquet reader's own row numbers: a virtual column after the
        // file's columns.
        let field = arrow::datatypes::Field::new(
            ROW_POSITION_COLUMN,
            arrow::datatypes::DataType::Int64,
            false,
        )
        .with_extension_type(datafusion::parquet::arrow::RowNumber);
        needed.push(schema.fields().len());
        datafusion_datasource::TableSchema::builder(Arc::clone(schema))
            .with_virtual_columns(vec![Arc::new(field)])
            .build()
    } else {
        datafusion_datasource::TableSchema::from(Arc::clone(schema))
    };
    let mut parquet = ParquetSource::new(table_schema)
        .with_parquet_file_reader_factory(source.reader_factory)
        .with_enable_page_index(false)
        .with_bloom_filter_on_read(false);
    if source.pushdown_filters {
        if let Some(predicate) = &body.predicate {
            parquet = parquet
                .with_predicate(Arc::clone(predicate))
                .with_pushdown_filters(true);
        }
    }
    let file =
        PartitionedFile::new(source.location, source.file_bytes).with_extension(source.access_plan);
    let config = FileScanConfigBuilder::new(source.store_url, Arc::new(parquet))
        .with_file(file)
        .with_projection_indices(Some(needed.clone()))?
        .with_batch_size(Some(source.batch_rows))
        .build();
    let scan: Arc<dyn ExecutionPlan> = DataSourceExec::from_data_source(config);
    let mut shipped: Vec<usize> = body
        .projection
        .iter()
        .map(|column| {
            needed
                .binary_search(column)
                .expect("needed holds every projected column")
        })
        .collect();
    if source.row_positions {
        shipped.push(needed.len() - 1);
    }
    let plan: Arc<dyn ExecutionPlan> = match &body.predicate {
        Some(predicate) => {
            // LIKE with inner wildcards as substring searches (like.rs).
            let predicate = fast_like(reassign_expr_columns(
                Arc::clone(predicate),
                &scan.schema(),
            )?)?;
            Arc::new(
                FilterExecBuilder::new(predicate, scan)
                    .apply_projection(Some(shipped))?
                    .with_batch_size(source.batch_rows)
                    .build()?,
            )
        }
        None if shipped.iter().copied().eq(0..needed.len()) => scan,
        None => {
            let input_schema = scan.schema();
            let expressions: Vec<(Arc<dyn PhysicalExpr>, String)> = shipped
                .iter()
                .map(|&index| {
                    let name = input_schema.field(index).name().clone();
                    (
                        Arc::new(Column::new(&name, index)) as Arc<dyn PhysicalExpr>,
                        name,
                    )
                })
                .collect();
            Arc::new(ProjectionExec::try_new(expressions, scan)?)
        }
    };
    // A pushed aggregation runs over the filtered, projected slice: the
    // decoded operators get this slice's plan in place of their leaf.
    Ok(match &body.aggregate {
        Some(operators) => {
            let input = Arc::clone(&plan);
            let replaced = Arc::clone(operators)
                .transform_up(|node| {
                    Ok(if node.downcast_ref::<SliceInputExec>().is_some() {
                        Transformed::yes(Arc::clone(&input))
                    } else {
                        Transformed::no(node)
                    })
                })?
                .data;
            SlicePlan {
                plan: replaced,
                aggregated_input: Some(input),
            }
        }
        None => SlicePlan {
            plan,
            aggregated_input: None,
        },
    })
}
