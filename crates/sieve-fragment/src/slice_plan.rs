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
use datafusion::common::{Result, ScalarValue};
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::parquet::ParquetAccessPlan;
use datafusion::datasource::physical_plan::{
    FileScanConfigBuilder, ParquetFileReaderFactory, ParquetSource,
};
use datafusion::datasource::source::DataSourceExec;
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::expressions::{BinaryExpr, Column, Literal};
use datafusion::physical_expr::utils::{collect_columns, reassign_expr_columns};
use datafusion::physical_expr::{conjunction, split_conjunction, PhysicalExpr};
use datafusion::physical_plan::filter::FilterExecBuilder;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::ExecutionPlan;

use crate::{fast_like, DecodedBody, KeyBitmapExpr, SliceInputExec};

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
    // What is tested row by row; the coarse stage (the caller's access
    // plan) prunes with the whole predicate.
    let row_predicate = body.predicate.as_ref().map(without_implied_bounds);
    if source.pushdown_filters {
        if let Some(predicate) = &row_predicate {
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
    let plan: Arc<dyn ExecutionPlan> = match &row_predicate {
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

/// `predicate` without the bounds a key bitmap in it already tests, for
/// testing row by row (the exact filter, and the Parquet decoder's with late
/// materialisation). A join filter is `key >= low AND key <= high AND key IN
/// bitmap`: the range for the coarse stage's pruning, which keeps the whole
/// predicate. A bitmap is false outside its own first and last key and NULL
/// for NULL, as the comparisons are, so where that span lies within the
/// bounds (the same keys' range, as the compute node builds them) they add
/// nothing but time: TPC-H Q17 at SF 100 spent 6% of all CPU comparing 600 M
/// part keys twice. Only `column op literal` of the bitmap's own key type is
/// left out, so the comparison and the bitmap read the same values.
pub(crate) fn without_implied_bounds(predicate: &Arc<dyn PhysicalExpr>) -> Arc<dyn PhysicalExpr> {
    let conjuncts = split_conjunction(predicate);
    // Per bitmap over a column: the column, its key type, its first and last value.
    let bitmaps: Vec<(&Column, &arrow::datatypes::DataType, i64, i64)> = conjuncts
        .iter()
        .filter_map(|conjunct| conjunct.downcast_ref::<KeyBitmapExpr>())
        .filter_map(|bitmap| {
            let column = bitmap.input().downcast_ref::<Column>()?;
            let last = i128::from(bitmap.base()) + i128::from(bitmap.bits()) - 1;
            let last = i64::try_from(last).ok()?;
            Some((column, bitmap.key_type(), bitmap.base(), last))
        })
        .collect();
    if bitmaps.is_empty() {
        return Arc::clone(predicate);
    }
    let implied = |conjunct: &Arc<dyn PhysicalExpr>| -> bool {
        let Some(comparison) = conjunct.downcast_ref::<BinaryExpr>() else {
            return false;
        };
        let (Some(column), Some(literal)) = (
            comparison.left().downcast_ref::<Column>(),
            comparison.right().downcast_ref::<Literal>(),
        ) else {
            return false;
        };
        let Some(value) = integer_value(literal.value()) else {
            return false;
        };
        bitmaps.iter().any(|(key, key_type, first, last)| {
            *key == column
                && **key_type == literal.value().data_type()
                && match comparison.op() {
                    Operator::GtEq => value <= *first,
                    Operator::Gt => value < *first,
                    Operator::LtEq => value >= *last,
                    Operator::Lt => value > *last,
                    _ => false,
                }
        })
    };
    let kept: Vec<Arc<dyn PhysicalExpr>> = conjuncts
        .into_iter()
        .filter(|conjunct| !implied(conjunct))
        .cloned()
        .collect();
    conjunction(kept)
}

/// An integer or date literal's value as an `i64`, as a key bitmap counts it.
fn integer_value(value: &ScalarValue) -> Option<i64> {
    match value {
        ScalarValue::Int8(Some(v)) => Some((*v).into()),
        ScalarValue::Int16(Some(v)) => Some((*v).into()),
        ScalarValue::Int32(Some(v)) => Some((*v).into()),
        ScalarValue::Int64(Some(v)) => Some(*v),
        ScalarValue::UInt8(Some(v)) => Some((*v).into()),
        ScalarValue::UInt16(Some(v)) => Some((*v).into()),
        ScalarValue::UInt32(Some(v)) => Some((*v).into()),
        ScalarValue::Date32(Some(v)) => Some((*v).into()),
        ScalarValue::Date64(Some(v)) => Some(*v),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{ArrayRef, Int32Array};
    use arrow::datatypes::DataType;
    use datafusion::physical_expr::expressions::{lit, IsNullExpr};

    fn compare(column: &Arc<dyn PhysicalExpr>, op: Operator, value: i32) -> Arc<dyn PhysicalExpr> {
        Arc::new(BinaryExpr::new(Arc::clone(column), op, lit(value)))
    }

    /// The bounds a bitmap implies leave the predicate tested row by row; bounds
    /// narrower than the bitmap, over another column, of another type, or
    /// under an OR stay, and a predicate without a bitmap is left as it is.
    #[test]
    fn only_the_bounds_a_bitmap_implies_are_left_out() {
        let key: Arc<dyn PhysicalExpr> = Arc::new(Column::new("k", 0));
        let other: Arc<dyn PhysicalExpr> = Arc::new(Column::new("o", 1));
        let keys: ArrayRef = Arc::new(Int32Array::from(vec![5, 7, 9]));
        let bitmap: Arc<dyn PhysicalExpr> =
            Arc::new(KeyBitmapExpr::try_new(Arc::clone(&key), DataType::Int32, &keys).unwrap());
        let shown =
            |predicate: &Arc<dyn PhysicalExpr>| without_implied_bounds(predicate).to_string();

        let bounded = |low: i32, high: i32| {
            conjunction(vec![
                compare(&key, Operator::GtEq, low),
                compare(&key, Operator::LtEq, high),
                Arc::clone(&bitmap),
            ])
        };
        let join_filter = bounded(5, 9);
        assert_eq!(shown(&join_filter), bitmap.to_string());
        // And the predicate left answers as the whole one, row for row,
        // NULL and both ends of the type included.
        let schema = Arc::new(arrow::datatypes::Schema::new(vec![
            arrow::datatypes::Field::new("k", DataType::Int32, true),
            arrow::datatypes::Field::new("o", DataType::Int32, true),
        ]));
        let values = vec![
            None,
            Some(i32::MIN),
            Some(4),
            Some(5),
            Some(6),
            Some(7),
            Some(9),
            Some(10),
            Some(i32::MAX),
        ];
        let batch = arrow::record_batch::RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int32Array::from(values.clone())),
                Arc::new(Int32Array::from(values)),
            ],
        )
        .unwrap();
        let answers = |predicate: &Arc<dyn PhysicalExpr>| {
            predicate
                .evaluate(&batch)
                .unwrap()
                .into_array(batch.num_rows())
                .unwrap()
        };
        assert_eq!(
            answers(&without_implied_bounds(&join_filter)).as_ref(),
            answers(&join_filter).as_ref()
        );
        let wider = conjunction(vec![
            compare(&key, Operator::Gt, 4),
            compare(&key, Operator::Lt, 10),
            Arc::clone(&bitmap),
            compare(&other, Operator::LtEq, 9),
        ]);
        assert_eq!(
            shown(&wider),
            conjunction(vec![
                Arc::clone(&bitmap),
                compare(&other, Operator::LtEq, 9)
            ])
            .to_string()
        );
        let narrower = bounded(6, 8);
        assert_eq!(shown(&narrower), narrower.to_string());
        let other_type = conjunction(vec![
            Arc::new(BinaryExpr::new(Arc::clone(&key), Operator::GtEq, lit(5i64)))
                as Arc<dyn PhysicalExpr>,
            Arc::clone(&bitmap),
        ]);
        assert_eq!(shown(&other_type), other_type.to_string());
        let nulls_pass: Arc<dyn PhysicalExpr> = Arc::new(BinaryExpr::new(
            Arc::new(IsNullExpr::new(Arc::clone(&key))),
            Operator::Or,
            conjunction(vec![compare(&key, Operator::GtEq, 5), Arc::clone(&bitmap)]),
        ));
        assert_eq!(shown(&nulls_pass), nulls_pass.to_string());
        let no_bitmap = conjunction(vec![
            compare(&key, Operator::GtEq, 5),
            compare(&key, Operator::LtEq, 9),
        ]);
        assert_eq!(shown(&no_bitmap), no_bitmap.to_string());
    }
}
