//! NDP off's exact filter, kept from pruning where statistics lie.
//!
//! NDP off is stock DataFusion reading the slices by byte range. DataFusion's
//! filter pushdown hands the `FilterExec` above the scan to the Parquet
//! source, which prunes row groups and pages by min/max statistics; Parquet
//! leaves NaN out of those, so a conjunct over a float column (`x > 100`,
//! `x = 'NaN'`) would drop NaN rows that match (see
//! `sieve_fragment::pruning_predicate`, which the storage nodes' coarse
//! stage uses). Such conjuncts are wrapped in a [`PruningOpaqueExpr`]:
//! evaluated as they are, but an expression DataFusion's pruning does not
//! know, so it never prunes by it.

use std::fmt;
use std::hash::Hash;
use std::sync::Arc;

use arrow::datatypes::{DataType, Schema};
use arrow::record_batch::RecordBatch;
use datafusion::common::{internal_err, Result};
use datafusion::logical_expr::ColumnarValue;
use datafusion::physical_expr::{conjunction, split_conjunction, PhysicalExpr};
use sieve_fragment::reads_float_column;

/// Evaluates `inner` unchanged; opaque to statistics pruning.
#[derive(Debug, Eq)]
pub(crate) struct PruningOpaqueExpr {
    inner: Arc<dyn PhysicalExpr>,
}

impl Hash for PruningOpaqueExpr {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.inner.as_ref().hash(state);
    }
}

impl PartialEq for PruningOpaqueExpr {
    fn eq(&self, other: &Self) -> bool {
        self.inner.as_ref() == other.inner.as_ref()
    }
}

impl fmt::Display for PruningOpaqueExpr {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "{}", self.inner)
    }
}

impl PhysicalExpr for PruningOpaqueExpr {
    fn data_type(&self, input_schema: &Schema) -> Result<DataType> {
        self.inner.data_type(input_schema)
    }

    fn nullable(&self, input_schema: &Schema) -> Result<bool> {
        self.inner.nullable(input_schema)
    }

    fn evaluate(&self, batch: &RecordBatch) -> Result<ColumnarValue> {
        self.inner.evaluate(batch)
    }

    fn children(&self) -> Vec<&Arc<dyn PhysicalExpr>> {
        vec![&self.inner]
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn PhysicalExpr>>,
    ) -> Result<Arc<dyn PhysicalExpr>> {
        let [inner] = <[Arc<dyn PhysicalExpr>; 1]>::try_from(children).or_else(|children| {
            internal_err!("PruningOpaqueExpr has one child, got {}", children.len())
        })?;
        Ok(Arc::new(Self { inner }))
    }

    fn fmt_sql(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt_sql(formatter)
    }
}

/// `predicate` (over `schema`) with every conjunct that reads a float column
/// made opaque to pruning.
pub(crate) fn nan_safe(predicate: Arc<dyn PhysicalExpr>, schema: &Schema) -> Arc<dyn PhysicalExpr> {
    let reads_float = |expr: &Arc<dyn PhysicalExpr>| reads_float_column(expr, schema);
    let conjuncts = split_conjunction(&predicate);
    if !conjuncts.iter().any(|conjunct| reads_float(conjunct)) {
        return predicate;
    }
    conjunction(conjuncts.into_iter().map(|conjunct| {
        if reads_float(conjunct) {
            Arc::new(PruningOpaqueExpr {
                inner: Arc::clone(conjunct),
            }) as Arc<dyn PhysicalExpr>
        } else {
            Arc::clone(conjunct)
        }
    }))
}
