//! `min` and `max` whose grouped accumulators order floats as ORDER BY does.
//!
//! DataFusion 55 orders floats by IEEE total order (-0.0 below 0.0, NaN
//! above the infinities) in ORDER BY and in its ungrouped `min` and `max`,
//! but its grouped accumulator for floats compares with `partial_cmp` from
//! a finite starting value: after a NaN every value replaces the running
//! one (`max` of 5, NaN, 1 in that order is 1), a group of -inf alone has
//! the `max` `f64::MIN`, and which zero a group keeps depends on the order
//! of its rows. A grouped `min` or `max` over floats thus depended on the
//! slices' order and on which plan ran it.
//!
//! [`total_order_min_max`] gives `min` and `max` under their own names with
//! total-order grouped accumulators for `Float32` and `Float64` (`Float16`
//! goes through the ungrouped accumulator, one per group), and never
//! answers them over floats from statistics (Parquet's leave NaN out:
//! DataFusion answered `max` 3.0 from a file's statistics where the rows'
//! `max` is NaN); everything else is DataFusion's. The compute node's session and the storage nodes'
//! fragment decoding both use them, so a partial aggregate on a storage
//! node and the final one on the compute node agree.

use std::cmp::Ordering;

use arrow::datatypes::{DataType, FieldRef, Float32Type, Float64Type};
use datafusion::common::{Result, ScalarValue};
use datafusion::functions_aggregate::min_max::{Max, Min};
use datafusion::logical_expr::function::{AccumulatorArgs, StateFieldsArgs};
use datafusion::logical_expr::utils::AggregateOrderSensitivity;
use datafusion::logical_expr::{
    Accumulator, AggregateUDF, AggregateUDFImpl, Documentation, GroupsAccumulator, ReversedUDAF,
    SetMonotonicity, Signature, StatisticsArgs,
};
use datafusion_functions_aggregate_common::aggregate::groups_accumulator::prim_op::PrimitiveGroupsAccumulator;

/// `min` and `max`, with grouped accumulators for floats in total order.
pub fn total_order_min_max() -> [AggregateUDF; 2] {
    [
        AggregateUDF::new_from_impl(TotalOrder {
            inner: AggregateUDF::new_from_impl(Min::new()),
            greatest: false,
        }),
        AggregateUDF::new_from_impl(TotalOrder {
            inner: AggregateUDF::new_from_impl(Max::new()),
            greatest: true,
        }),
    ]
}

/// DataFusion's `min` (`greatest` false) or `max`, but for the grouped
/// accumulator over floats.
#[derive(Debug, PartialEq, Eq, Hash)]
struct TotalOrder {
    inner: AggregateUDF,
    greatest: bool,
}

impl TotalOrder {
    fn inner(&self) -> &dyn AggregateUDFImpl {
        self.inner.inner().as_ref()
    }
}

/// Keeps `new` where it is past `current` in total order (`wanted`).
macro_rules! total_order_accumulator {
    ($type:ty, $data_type:expr, $wanted:expr, $start:expr) => {{
        let wanted = $wanted;
        Box::new(
            PrimitiveGroupsAccumulator::<$type, _>::new($data_type, move |current, new| {
                if new.total_cmp(current) == wanted {
                    *current = new;
                }
            })
            .with_starting_value($start),
        ) as Box<dyn GroupsAccumulator>
    }};
}

impl AggregateUDFImpl for TotalOrder {
    fn name(&self) -> &str {
        self.inner().name()
    }

    fn aliases(&self) -> &[String] {
        self.inner().aliases()
    }

    fn signature(&self) -> &Signature {
        self.inner().signature()
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        self.inner().return_type(arg_types)
    }

    fn return_field(&self, arg_fields: &[FieldRef]) -> Result<FieldRef> {
        self.inner().return_field(arg_fields)
    }

    fn is_nullable(&self) -> bool {
        self.inner().is_nullable()
    }

    fn accumulator(&self, args: AccumulatorArgs) -> Result<Box<dyn Accumulator>> {
        self.inner().accumulator(args)
    }

    fn state_fields(&self, args: StateFieldsArgs) -> Result<Vec<FieldRef>> {
        self.inner().state_fields(args)
    }

    fn groups_accumulator_supported(&self, args: AccumulatorArgs) -> bool {
        args.return_field.data_type() != &DataType::Float16
            && self.inner().groups_accumulator_supported(args)
    }

    fn create_groups_accumulator(
        &self,
        args: AccumulatorArgs,
    ) -> Result<Box<dyn GroupsAccumulator>> {
        // The running value starts at the far end of total order from the
        // one wanted (a NaN of either sign with every payload bit set).
        let wanted = if self.greatest {
            Ordering::Greater
        } else {
            Ordering::Less
        };
        let data_type = args.return_field.data_type();
        Ok(match data_type {
            DataType::Float32 => {
                let start = if self.greatest {
                    u32::MAX
                } else {
                    u32::MAX >> 1
                };
                total_order_accumulator!(Float32Type, data_type, wanted, f32::from_bits(start))
            }
            DataType::Float64 => {
                let start = if self.greatest {
                    u64::MAX
                } else {
                    u64::MAX >> 1
                };
                total_order_accumulator!(Float64Type, data_type, wanted, f64::from_bits(start))
            }
            _ => return self.inner().create_groups_accumulator(args),
        })
    }

    fn create_sliding_accumulator(&self, args: AccumulatorArgs) -> Result<Box<dyn Accumulator>> {
        self.inner().create_sliding_accumulator(args)
    }

    fn order_sensitivity(&self) -> AggregateOrderSensitivity {
        self.inner().order_sensitivity()
    }

    fn reverse_expr(&self) -> ReversedUDAF {
        ReversedUDAF::Identical
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        self.inner().coerce_types(arg_types)
    }

    fn is_descending(&self) -> Option<bool> {
        self.inner().is_descending()
    }

    /// Never from statistics over floats: Parquet leaves NaN out of them,
    /// so they answered `max` 3.0 where the rows' `max` is NaN.
    fn value_from_stats(&self, statistics_args: &StatisticsArgs) -> Option<ScalarValue> {
        if statistics_args.return_type.is_floating() {
            return None;
        }
        self.inner().value_from_stats(statistics_args)
    }

    fn default_value(&self, data_type: &DataType) -> Result<ScalarValue> {
        self.inner().default_value(data_type)
    }

    fn documentation(&self) -> Option<&Documentation> {
        self.inner().documentation()
    }

    fn set_monotonicity(&self, data_type: &DataType) -> SetMonotonicity {
        self.inner().set_monotonicity(data_type)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Array, ArrayRef, Float32Array, Float64Array};
    use arrow::datatypes::{Field, Schema};
    use datafusion::physical_expr::expressions::col;
    use std::sync::Arc;

    /// The values a grouped accumulator ends with for one group fed
    /// `values` in batches of `chunk`, with its state merged into a second
    /// accumulator as a final aggregation does.
    fn grouped(function: &AggregateUDF, values: &[f64], chunk: usize, f32s: bool) -> Option<f64> {
        let data_type = if f32s {
            DataType::Float32
        } else {
            DataType::Float64
        };
        let schema = Schema::new(vec![Field::new("f", data_type.clone(), true)]);
        let expr = col("f", &schema).unwrap();
        let return_field: FieldRef = Arc::new(Field::new("m", data_type.clone(), true));
        let exprs = [expr];
        let args = || AccumulatorArgs {
            return_field: Arc::clone(&return_field),
            schema: &schema,
            ignore_nulls: false,
            order_bys: &[],
            is_reversed: false,
            name: "m",
            is_distinct: false,
            exprs: &exprs,
            expr_fields: &[],
        };
        assert!(function.groups_accumulator_supported(args()));
        let mut partial = function.create_groups_accumulator(args()).unwrap();
        for part in values.chunks(chunk) {
            let array: ArrayRef = if f32s {
                Arc::new(Float32Array::from_iter_values(
                    part.iter().map(|&v| v as f32),
                ))
            } else {
                Arc::new(Float64Array::from_iter_values(part.iter().copied()))
            };
            partial
                .update_batch(&[array], &vec![0; part.len()], None, 1)
                .unwrap();
        }
        let state = partial
            .state(datafusion::logical_expr::EmitTo::All)
            .unwrap();
        let mut last = function.create_groups_accumulator(args()).unwrap();
        last.merge_batch(&state, &[0], 1).unwrap();
        let result = last
            .evaluate(datafusion::logical_expr::EmitTo::All)
            .unwrap();
        let result = arrow::compute::cast(&result, &DataType::Float64).unwrap();
        let result = result.as_any().downcast_ref::<Float64Array>().unwrap();
        (!result.is_null(0)).then(|| result.value(0))
    }

    #[test]
    fn grouped_min_and_max_follow_total_order_in_any_row_order() {
        let [min, max] = total_order_min_max();
        let cases: &[&[f64]] = &[
            &[5.0, f64::NAN, 1.0],
            &[f64::NEG_INFINITY, f64::NEG_INFINITY],
            &[f64::INFINITY],
            &[0.0, -0.0],
            &[-0.0, 0.0, f64::NAN, -7.5],
            &[f64::MIN, f64::NEG_INFINITY, f64::MAX],
        ];
        for &case in cases {
            for f32s in [false, true] {
                let mut sorted: Vec<f64> = case.to_vec();
                sorted.sort_by(f64::total_cmp);
                let (least, greatest) = (sorted[0], sorted[sorted.len() - 1]);
                let (least, greatest) = if f32s {
                    (least as f32 as f64, greatest as f32 as f64)
                } else {
                    (least, greatest)
                };
                // Every rotation of the rows, in batches of one and of all.
                for turn in 0..case.len() {
                    let mut rows = case.to_vec();
                    rows.rotate_left(turn);
                    for chunk in [1, rows.len()] {
                        let got = grouped(&min, &rows, chunk, f32s).unwrap();
                        assert_eq!(got.to_bits(), least.to_bits(), "min {rows:?} f32 {f32s}");
                        let got = grouped(&max, &rows, chunk, f32s).unwrap();
                        assert_eq!(got.to_bits(), greatest.to_bits(), "max {rows:?} f32 {f32s}");
                    }
                }
            }
        }
    }

    /// Statistics answer `min` and `max` over integers, never over floats
    /// (Parquet's leave NaN out).
    #[test]
    fn statistics_answer_no_float_min_or_max() {
        use datafusion::common::stats::Precision;
        use datafusion::common::{ColumnStatistics, Statistics};
        use datafusion::logical_expr::StatisticsArgs;
        let [min, max] = total_order_min_max();
        for (data_type, low, high) in [
            (
                DataType::Float64,
                ScalarValue::Float64(Some(-1.0)),
                ScalarValue::Float64(Some(3.0)),
            ),
            (
                DataType::Int64,
                ScalarValue::Int64(Some(-1)),
                ScalarValue::Int64(Some(3)),
            ),
        ] {
            let schema = Schema::new(vec![Field::new("f", data_type.clone(), true)]);
            let statistics = Statistics {
                num_rows: Precision::Exact(5),
                total_byte_size: Precision::Absent,
                column_statistics: vec![ColumnStatistics {
                    min_value: Precision::Exact(low.clone()),
                    max_value: Precision::Exact(high.clone()),
                    ..ColumnStatistics::new_unknown()
                }],
            };
            let exprs = [col("f", &schema).unwrap()];
            let args = StatisticsArgs {
                statistics: &statistics,
                return_type: &data_type,
                is_distinct: false,
                exprs: &exprs,
            };
            let answers = (min.value_from_stats(&args), max.value_from_stats(&args));
            if data_type.is_floating() {
                assert_eq!(answers, (None, None));
            } else {
                assert_eq!(answers, (Some(low), Some(high)));
            }
        }
    }
}
