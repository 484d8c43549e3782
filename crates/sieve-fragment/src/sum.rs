//! `sum` over integers that fails on overflow instead of wrapping.
//!
//! DataFusion 55 adds integer sums with wrapping arithmetic: `sum` of
//! `i64::MAX` and 1 is `i64::MIN`, a wrong answer with no sign of it.
//! [`checked_sum`] is DataFusion's `sum` under its own name but for sums
//! (grouped or not, not DISTINCT) of `Int64` and `UInt64`, the types every
//! integer sum returns: those add in `i128` (partial sums are
//! `Decimal128(38, 0)` states) and stop the query with an arithmetic
//! overflow error where the total is out of the type's range; a total in
//! range is exact whatever its partial sums, in any order. The compute node's session and the storage nodes' fragment
//! decoding both use it. DISTINCT sums and window sums still wrap, as do
//! `+`, `-` and `*` on integers (DataFusion's `BinaryExpr` has checked
//! arithmetic, but neither its SQL planner nor datafusion-proto sets it).

use std::sync::Arc;

use arrow::array::{ArrayRef, AsArray, BooleanArray, Decimal128Array, Int64Array, UInt64Array};
use arrow::datatypes::{DataType, Decimal128Type, Field, FieldRef};
use datafusion::common::{exec_err, Result, ScalarValue};
use datafusion::functions_aggregate::sum::Sum;
use datafusion::logical_expr::expr::AggregateFunction;
use datafusion::logical_expr::function::{AccumulatorArgs, StateFieldsArgs};
use datafusion::logical_expr::utils::{format_state_name, AggregateOrderSensitivity};
use datafusion::logical_expr::{
    Accumulator, AggregateUDF, AggregateUDFImpl, Documentation, EmitTo, Expr, GroupsAccumulator,
    Operator, ReversedUDAF, SetMonotonicity, Signature, StatisticsArgs,
};
use datafusion_functions_aggregate_common::aggregate::groups_accumulator::prim_op::PrimitiveGroupsAccumulator;

/// DataFusion's `sum`, failing on integer overflow (see the module
/// documentation).
pub fn checked_sum() -> AggregateUDF {
    AggregateUDF::new_from_impl(CheckedSum {
        inner: AggregateUDF::new_from_impl(Sum::new()),
    })
}

#[derive(Debug, PartialEq, Eq, Hash)]
struct CheckedSum {
    inner: AggregateUDF,
}

impl CheckedSum {
    fn inner(&self) -> &dyn AggregateUDFImpl {
        self.inner.inner().as_ref()
    }
}

fn overflow<T>(data_type: &DataType) -> Result<T> {
    exec_err!(
        "Arithmetic overflow: sum() of {data_type} values is out of its range \
         (a sum of CAST(x AS DECIMAL(38, 0)) holds it)"
    )
}

/// The type integer sums of `data_type` add in: a total of up to 2^63
/// values of 64 bits, exact.
const WIDE: DataType = DataType::Decimal128(38, 0);

/// Whether sums returning `data_type` are checked here.
fn checked(data_type: &DataType) -> bool {
    matches!(data_type, DataType::Int64 | DataType::UInt64)
}

impl AggregateUDFImpl for CheckedSum {
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
        let data_type = args.return_field.data_type().clone();
        if args.is_distinct || !checked(&data_type) {
            return self.inner().accumulator(args);
        }
        Ok(Box::new(WideSum {
            sum: None,
            data_type,
        }))
    }

    /// A `Decimal128(38, 0)` partial sum where the sum is checked.
    fn state_fields(&self, args: StateFieldsArgs) -> Result<Vec<FieldRef>> {
        if args.is_distinct || !checked(args.return_type()) {
            return self.inner().state_fields(args);
        }
        Ok(vec![Arc::new(Field::new(
            format_state_name(args.name, "sum"),
            WIDE,
            true,
        ))])
    }

    fn groups_accumulator_supported(&self, args: AccumulatorArgs) -> bool {
        self.inner().groups_accumulator_supported(args)
    }

    fn create_groups_accumulator(
        &self,
        args: AccumulatorArgs,
    ) -> Result<Box<dyn GroupsAccumulator>> {
        let data_type = args.return_field.data_type().clone();
        if !checked(&data_type) {
            return self.inner().create_groups_accumulator(args);
        }
        let inner = PrimitiveGroupsAccumulator::<Decimal128Type, _>::new(&WIDE, |sum, value| {
            *sum = sum.wrapping_add(value)
        });
        Ok(Box::new(WideGroupsSum {
            inner: Box::new(inner),
            data_type,
        }))
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

    fn simplify_expr_op_literal(
        &self,
        agg_function: &AggregateFunction,
        arg: &Expr,
        op: Operator,
        lit: &Expr,
        arg_is_left: bool,
    ) -> Result<Option<Expr>> {
        self.inner()
            .simplify_expr_op_literal(agg_function, arg, op, lit, arg_is_left)
    }

    fn value_from_stats(&self, statistics_args: &StatisticsArgs) -> Option<ScalarValue> {
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

/// `values` (Int64, UInt64 or already wide) as `Decimal128(38, 0)`.
fn widened(values: &ArrayRef) -> Result<ArrayRef> {
    Ok(arrow::compute::cast(values, &WIDE)?)
}

/// Wide sums as `data_type`, failing on the first out of its range.
fn narrowed(sums: &ArrayRef, data_type: &DataType) -> Result<ArrayRef> {
    let sums = sums.as_primitive::<Decimal128Type>();
    Ok(match data_type {
        DataType::Int64 => {
            let mut narrow = Vec::with_capacity(sums.len());
            for sum in sums.iter() {
                narrow.push(match sum {
                    Some(sum) => Some(i64::try_from(sum).or_else(|_| overflow(data_type))?),
                    None => None,
                });
            }
            Arc::new(Int64Array::from(narrow))
        }
        _ => {
            let mut narrow = Vec::with_capacity(sums.len());
            for sum in sums.iter() {
                narrow.push(match sum {
                    Some(sum) => Some(u64::try_from(sum).or_else(|_| overflow(data_type))?),
                    None => None,
                });
            }
            Arc::new(UInt64Array::from(narrow))
        }
    })
}

/// An ungrouped sum in `i128`.
#[derive(Debug)]
struct WideSum {
    sum: Option<i128>,
    data_type: DataType,
}

impl WideSum {
    fn add(&mut self, values: &ArrayRef) -> Result<()> {
        let values = widened(values)?;
        let values = values.as_primitive::<Decimal128Type>();
        if let Some(part) = arrow::compute::sum(values) {
            self.sum = Some(self.sum.unwrap_or(0).wrapping_add(part));
        }
        Ok(())
    }
}

impl Accumulator for WideSum {
    fn update_batch(&mut self, values: &[ArrayRef]) -> Result<()> {
        self.add(&values[0])
    }

    fn merge_batch(&mut self, states: &[ArrayRef]) -> Result<()> {
        self.add(&states[0])
    }

    fn state(&mut self) -> Result<Vec<ScalarValue>> {
        Ok(vec![ScalarValue::Decimal128(self.sum, 38, 0)])
    }

    fn evaluate(&mut self) -> Result<ScalarValue> {
        let sums: ArrayRef =
            Arc::new(Decimal128Array::from(vec![self.sum]).with_precision_and_scale(38, 0)?);
        ScalarValue::try_from_array(&narrowed(&sums, &self.data_type)?, 0)
    }

    fn size(&self) -> usize {
        size_of_val(self)
    }
}

/// DataFusion's grouped sum over `i128`, narrowed (and checked) when it
/// gives its totals.
struct WideGroupsSum {
    inner: Box<dyn GroupsAccumulator>,
    data_type: DataType,
}

impl GroupsAccumulator for WideGroupsSum {
    fn update_batch(
        &mut self,
        values: &[ArrayRef],
        group_indices: &[usize],
        opt_filter: Option<&BooleanArray>,
        total_num_groups: usize,
    ) -> Result<()> {
        self.inner.update_batch(
            &[widened(&values[0])?],
            group_indices,
            opt_filter,
            total_num_groups,
        )
    }

    fn evaluate(&mut self, emit_to: EmitTo) -> Result<ArrayRef> {
        narrowed(&self.inner.evaluate(emit_to)?, &self.data_type)
    }

    fn state(&mut self, emit_to: EmitTo) -> Result<Vec<ArrayRef>> {
        self.inner.state(emit_to)
    }

    fn merge_batch(
        &mut self,
        values: &[ArrayRef],
        group_indices: &[usize],
        total_num_groups: usize,
    ) -> Result<()> {
        self.inner
            .merge_batch(values, group_indices, total_num_groups)
    }

    fn convert_to_state(
        &self,
        values: &[ArrayRef],
        opt_filter: Option<&BooleanArray>,
    ) -> Result<Vec<ArrayRef>> {
        self.inner
            .convert_to_state(&[widened(&values[0])?], opt_filter)
    }

    fn size(&self) -> usize {
        self.inner.size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Array, Int64Array, UInt64Array};
    use arrow::datatypes::{Field, Schema};
    use datafusion::physical_expr::expressions::col;

    fn args<'a>(
        schema: &'a Schema,
        return_field: &FieldRef,
        exprs: &'a [Arc<dyn datafusion::physical_expr::PhysicalExpr>],
    ) -> AccumulatorArgs<'a> {
        AccumulatorArgs {
            return_field: Arc::clone(return_field),
            schema,
            ignore_nulls: false,
            order_bys: &[],
            is_reversed: false,
            name: "s",
            is_distinct: false,
            exprs,
            expr_fields: &[],
        }
    }

    /// The sum of `parts` (one batch each) grouped and not, through a
    /// partial and a final accumulator.
    fn sums(parts: &[ArrayRef]) -> [Result<ScalarValue>; 2] {
        let data_type = parts[0].data_type().clone();
        let schema = Schema::new(vec![Field::new("x", data_type.clone(), true)]);
        let exprs = [col("x", &schema).unwrap()];
        let return_field: FieldRef = Arc::new(Field::new("s", data_type.clone(), true));
        let sum = checked_sum();
        let grouped = || -> Result<ScalarValue> {
            let mut partial =
                sum.create_groups_accumulator(args(&schema, &return_field, &exprs))?;
            for part in parts {
                partial.update_batch(std::slice::from_ref(part), &vec![0; part.len()], None, 1)?;
            }
            let state = partial.state(EmitTo::All)?;
            let mut last = sum.create_groups_accumulator(args(&schema, &return_field, &exprs))?;
            last.merge_batch(&state, &[0], 1)?;
            ScalarValue::try_from_array(&last.evaluate(EmitTo::All)?, 0)
        };
        let ungrouped = || -> Result<ScalarValue> {
            let mut partials = Vec::new();
            for part in parts {
                let mut partial = sum.accumulator(args(&schema, &return_field, &exprs))?;
                partial.update_batch(std::slice::from_ref(part))?;
                partials.push(partial.state()?.remove(0).to_array()?);
            }
            let mut last = sum.accumulator(args(&schema, &return_field, &exprs))?;
            for state in partials {
                last.merge_batch(&[state])?;
            }
            last.evaluate()
        };
        [grouped(), ungrouped()]
    }

    #[test]
    fn integer_sums_fail_past_their_range_and_are_exact_within_it() {
        let i64s = |values: &[i64]| Arc::new(Int64Array::from(values.to_vec())) as ArrayRef;
        let u64s = |values: &[u64]| Arc::new(UInt64Array::from(values.to_vec())) as ArrayRef;
        // Within range, also where a partial sum is not (a batch, or the
        // first rows of one).
        for result in sums(&[i64s(&[i64::MAX, 5]), i64s(&[-10, -1])]) {
            assert_eq!(result.unwrap(), ScalarValue::Int64(Some(i64::MAX - 6)));
        }
        for result in sums(&[i64s(&[i64::MAX, i64::MAX, i64::MIN, i64::MIN, 1])]) {
            assert_eq!(result.unwrap(), ScalarValue::Int64(Some(-1)));
        }
        // Past the range by the rows of one batch.
        for result in sums(&[i64s(&[i64::MAX, 1, 3])]) {
            assert!(result
                .unwrap_err()
                .to_string()
                .contains("Arithmetic overflow"));
        }
        for result in sums(&[i64s(&[i64::MAX, -5]), i64s(&[3, 2])]) {
            assert_eq!(result.unwrap(), ScalarValue::Int64(Some(i64::MAX)));
        }
        // Across batches (the merge of partial sums).
        for result in sums(&[i64s(&[i64::MAX]), i64s(&[1])]) {
            assert!(result
                .unwrap_err()
                .to_string()
                .contains("Arithmetic overflow"));
        }
        for result in sums(&[i64s(&[i64::MIN]), i64s(&[-1])]) {
            assert!(result
                .unwrap_err()
                .to_string()
                .contains("Arithmetic overflow"));
        }
        for result in sums(&[u64s(&[u64::MAX - 1]), u64s(&[1])]) {
            assert_eq!(result.unwrap(), ScalarValue::UInt64(Some(u64::MAX)));
        }
        for result in sums(&[u64s(&[u64::MAX]), u64s(&[1])]) {
            assert!(result
                .unwrap_err()
                .to_string()
                .contains("Arithmetic overflow"));
        }
    }
}
