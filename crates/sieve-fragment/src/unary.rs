//! The evaluation shared by the fragment's own predicates over one input
//! (`KeyBitmapExpr`, `BloomFilterExpr`, `OrderedSubstringsExpr`).

use std::sync::Arc;

use arrow::array::{ArrayRef, BooleanArray};
use arrow::record_batch::RecordBatch;
use datafusion::common::{Result, ScalarValue};
use datafusion::logical_expr::ColumnarValue;
use datafusion::physical_expr::PhysicalExpr;

/// `test` applied to `input` evaluated over `batch`: an array stays an
/// array, a scalar stays a scalar.
pub(crate) fn evaluate_unary(
    input: &Arc<dyn PhysicalExpr>,
    batch: &RecordBatch,
    test: impl Fn(&ArrayRef) -> Result<BooleanArray>,
) -> Result<ColumnarValue> {
    match input.evaluate(batch)? {
        ColumnarValue::Array(values) => Ok(ColumnarValue::Array(Arc::new(test(&values)?))),
        ColumnarValue::Scalar(scalar) => {
            let matched = test(&scalar.to_array()?)?;
            Ok(ColumnarValue::Scalar(ScalarValue::try_from_array(
                &matched, 0,
            )?))
        }
    }
}
