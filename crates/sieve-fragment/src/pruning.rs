//! What of a predicate may prune by Parquet statistics.
//!
//! Parquet writers leave NaN out of a float column's min/max statistics (the
//! format says so), while Arrow's comparisons, and so DataFusion's, order NaN
//! above every other value and equal to itself: a row group whose max is 10
//! may still hold rows where `x > 100` or `x = 'NaN'` is true. Pruning on
//! those statistics drops such rows (DataFusion 55 does, for plain Parquet
//! scans too). So conjuncts over float columns never reach the coarse stage;
//! the exact filter still applies them to every row read.
//!
//! ```
//! use std::sync::Arc;
//! use datafusion::arrow::datatypes::{DataType, Field, Schema};
//! use datafusion::logical_expr::Operator;
//! use datafusion::physical_expr::expressions::{binary, col, lit};
//! use sieve_fragment::pruning_predicate;
//!
//! let schema = Schema::new(vec![
//!     Field::new("k", DataType::Int64, true),
//!     Field::new("x", DataType::Float64, true),
//! ]);
//! let k = binary(col("k", &schema).unwrap(), Operator::Gt, lit(5i64), &schema).unwrap();
//! let x = binary(col("x", &schema).unwrap(), Operator::Gt, lit(100.0), &schema).unwrap();
//! let both = binary(Arc::clone(&k), Operator::And, x, &schema).unwrap();
//! let prunable = pruning_predicate(&both, &schema).unwrap();
//! assert_eq!(prunable.to_string(), k.to_string());
//! ```

use std::sync::Arc;

use arrow::datatypes::Schema;
use datafusion::physical_expr::utils::collect_columns;
use datafusion::physical_expr::{conjunction_opt, split_conjunction, PhysicalExpr};

/// The conjuncts of `predicate` (over `schema`) that may prune by min/max
/// statistics, page indexes and Bloom filters: those reading no float
/// column. `None` if no conjunct may.
pub fn pruning_predicate(
    predicate: &Arc<dyn PhysicalExpr>,
    schema: &Schema,
) -> Option<Arc<dyn PhysicalExpr>> {
    conjunction_opt(
        split_conjunction(predicate)
            .into_iter()
            .filter(|conjunct| !reads_float_column(conjunct, schema))
            .cloned(),
    )
}

/// Whether `expr` (over `schema`) reads a float column, or a column
/// `schema` does not have: what must not prune by statistics.
pub fn reads_float_column(expr: &Arc<dyn PhysicalExpr>, schema: &Schema) -> bool {
    collect_columns(expr).iter().any(|column| {
        schema
            .fields()
            .get(column.index())
            .is_none_or(|field| field.data_type().is_floating())
    })
}
