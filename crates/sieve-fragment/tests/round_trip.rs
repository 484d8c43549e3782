//! The fragment survives encoding, and the allow-list holds on both sides.

use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Schema};
use datafusion::common::DFSchema;
use datafusion::logical_expr::{col, lit};
use datafusion::prelude::SessionContext;
use prost::Message;
use sieve_fragment::{
    BloomFilterExpr, DecodedBody, Fragment, FragmentEnvelope, KeyBitmapExpr, SliceInputExec,
    FRAGMENT_VERSION,
};

fn schema() -> Arc<Schema> {
    Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int64, false),
        Field::new("price", DataType::Decimal128(15, 2), true),
        Field::new("name", DataType::Utf8View, true),
    ]))
}

#[test]
fn fragment_round_trips_and_keeps_its_meaning() {
    let schema = schema();
    let context = SessionContext::new();
    let df_schema = DFSchema::try_from(Arc::clone(&schema)).unwrap();
    let predicate = context
        .state()
        .create_physical_expr(
            col("k").gt(lit(10i64)).and(col("name").like(lit("%x%"))),
            &df_schema,
        )
        .unwrap();
    let fragment = Fragment {
        projection: vec![2, 0],
        predicate: Some(Arc::clone(&predicate)),
        aggregate: None,
    };
    let body = fragment.encode_body(&schema).unwrap();
    let envelope = FragmentEnvelope::new("t", 7, body);
    let decoded_envelope = FragmentEnvelope::decode_checked(&envelope.encode_to_vec()).unwrap();
    assert_eq!(decoded_envelope.version, FRAGMENT_VERSION);
    assert_eq!(
        (decoded_envelope.table.as_str(), decoded_envelope.slice),
        ("t", 7)
    );
    let decoded =
        DecodedBody::decode(&decoded_envelope.body, &schema, &context.task_ctx()).unwrap();
    assert_eq!(decoded.projection, vec![2, 0]);
    assert_eq!(
        decoded.predicate.unwrap().to_string(),
        predicate.to_string()
    );
}

#[test]
fn out_of_range_projection_is_refused_on_both_sides() {
    let schema = schema();
    let error = Fragment {
        projection: vec![3],
        predicate: None,
        aggregate: None,
    }
    .encode_body(&schema)
    .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("projects column 3, but the table has 3 columns"),
        "{error}"
    );
}

#[test]
fn oversized_envelope_is_refused_before_decoding() {
    let bytes = vec![0u8; sieve_fragment::FRAGMENT_BYTES_MAX + 1];
    let error = FragmentEnvelope::decode_checked(&bytes).unwrap_err();
    assert!(error.to_string().contains("above the limit"), "{error}");
}

#[test]
fn a_request_for_pages_as_stored_survives_and_refuses_row_positions() {
    let envelope = FragmentEnvelope::new("t", 3, vec![]).with_raw();
    let decoded = FragmentEnvelope::decode_checked(&envelope.encode_to_vec()).unwrap();
    assert!(decoded.raw);
    let mut both = envelope;
    both.row_positions = true;
    let error = FragmentEnvelope::decode_checked(&both.encode_to_vec()).unwrap_err();
    assert!(
        error
            .to_string()
            .contains("raw pages and for row positions"),
        "{error}"
    );
}

/// A fragment's predicate over `probe`, after the fragment went through its
/// wire form.
fn decoded_answers(
    predicate: Arc<dyn datafusion::physical_expr::PhysicalExpr>,
    probe: &[i64],
) -> arrow::array::BooleanArray {
    let schema = schema();
    let fragment = Fragment {
        projection: vec![0],
        predicate: Some(predicate),
        aggregate: None,
    };
    let body = fragment.encode_body(&schema).unwrap();
    let context = SessionContext::new();
    let decoded = DecodedBody::decode(&body, &schema, &context.task_ctx()).unwrap();
    let predicate = decoded.predicate.unwrap();
    let batch = arrow::record_batch::RecordBatch::try_new(
        Arc::clone(&schema),
        vec![
            Arc::new(arrow::array::Int64Array::from(probe.to_vec())),
            Arc::new(
                arrow::array::Decimal128Array::from(vec![0i128; probe.len()])
                    .with_precision_and_scale(15, 2)
                    .unwrap(),
            ),
            Arc::new(arrow::array::StringViewArray::from(vec!["x"; probe.len()])),
        ],
    )
    .unwrap();
    let matched = predicate
        .evaluate(&batch)
        .unwrap()
        .into_array(probe.len())
        .unwrap();
    matched
        .as_any()
        .downcast_ref::<arrow::array::BooleanArray>()
        .unwrap()
        .clone()
}

#[test]
fn bloom_filter_and_key_bitmap_survive_the_wire_and_keep_their_answers() {
    let keys: arrow::array::ArrayRef = Arc::new(arrow::array::Int64Array::from(
        (0..5000).map(|k| k * 3).collect::<Vec<_>>(),
    ));
    let column: Arc<dyn datafusion::physical_expr::PhysicalExpr> =
        Arc::new(datafusion::physical_expr::expressions::Column::new("k", 0));
    let probe: Vec<i64> = (-100..15_000).collect();
    let is_key = |value: i64| (0..15_000).contains(&value) && value % 3 == 0;

    // Bloom: every key matches; other values mostly do not.
    let bloom =
        BloomFilterExpr::try_new(Arc::clone(&column), DataType::Int64, &keys, 0.01).unwrap();
    let matched = decoded_answers(Arc::new(bloom), &probe);
    let false_positives = probe
        .iter()
        .enumerate()
        .filter(|&(row, &value)| !is_key(value) && matched.value(row))
        .count();
    assert!(probe
        .iter()
        .enumerate()
        .all(|(row, &value)| !is_key(value) || matched.value(row)));
    assert!(
        false_positives < 300,
        "{false_positives} false positives of 10100"
    );

    // Bitmap: exactly the keys match.
    let bitmap = KeyBitmapExpr::try_new(column, DataType::Int64, &keys).unwrap();
    let matched = decoded_answers(Arc::new(bitmap), &probe);
    for (row, &value) in probe.iter().enumerate() {
        assert_eq!(matched.value(row), is_key(value), "{value}");
    }
}

#[test]
fn partial_aggregate_round_trips_and_a_final_one_is_refused() {
    use datafusion::physical_expr::aggregate::AggregateExprBuilder;
    use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode, PhysicalGroupBy};
    use datafusion::physical_plan::ExecutionPlan;
    let schema = schema();
    let input: Arc<dyn ExecutionPlan> = Arc::new(SliceInputExec::new(Arc::clone(&schema)));
    let group = PhysicalGroupBy::new_single(vec![(
        Arc::new(datafusion::physical_expr::expressions::Column::new(
            "name", 2,
        )) as _,
        "name".to_string(),
    )]);
    let sum = AggregateExprBuilder::new(
        datafusion::functions_aggregate::sum::sum_udaf(),
        vec![
            Arc::new(datafusion::physical_expr::expressions::Column::new(
                "price", 1,
            )) as _,
        ],
    )
    .schema(Arc::clone(&schema))
    .alias("sum(price)")
    .build()
    .unwrap();
    let build = |mode| -> Arc<dyn ExecutionPlan> {
        Arc::new(
            AggregateExec::try_new(
                mode,
                group.clone(),
                vec![Arc::new(sum.clone())],
                vec![None],
                Arc::clone(&input),
                Arc::clone(&schema),
            )
            .unwrap(),
        )
    };
    let partial = build(AggregateMode::Partial);
    let body = Fragment {
        projection: vec![0, 1, 2],
        predicate: None,
        aggregate: Some(Arc::clone(&partial)),
    }
    .encode_body(&schema)
    .unwrap();
    let context = SessionContext::new();
    let decoded = DecodedBody::decode(&body, &schema, &context.task_ctx()).unwrap();
    assert_eq!(decoded.aggregate.unwrap().schema(), partial.schema());

    let error = Fragment {
        projection: vec![0, 1, 2],
        predicate: None,
        aggregate: Some(build(AggregateMode::Final)),
    }
    .encode_body(&schema)
    .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("only a partial or single aggregation"),
        "{error}"
    );
}

/// Found by `sieve fuzz-requests` (seed 1, 100,000 requests): a mutated
/// ticket whose partial aggregation runs over an empty projection, and a
/// predicate naming a column past the schema's end, made Arrow panic
/// looking the field up (the panic was caught, the node lived). Both are
/// refused with an error now, before any type is computed.
#[test]
fn columns_past_the_schema_are_refused_without_a_panic() {
    use datafusion::physical_expr::expressions::{Column, Literal};
    use datafusion::physical_expr::PhysicalExpr;
    let schema = schema();
    let context = SessionContext::new();
    let beyond: Arc<dyn PhysicalExpr> =
        Arc::new(datafusion::physical_expr::expressions::BinaryExpr::new(
            Arc::new(Column::new("k", 99)),
            datafusion::logical_expr::Operator::Gt,
            Arc::new(Literal::new(datafusion::common::ScalarValue::Int64(Some(
                1,
            )))),
        ));
    let error = sieve_fragment::check_allowed(&beyond, &schema).unwrap_err();
    assert!(error.to_string().contains("does not exist"), "{error}");

    // A body with an aggregation, its projection emptied on the way.
    use datafusion::physical_plan::ExecutionPlan;
    let input = Arc::new(SliceInputExec::new(Arc::new(schema.project(&[0]).unwrap())));
    let state = context.state();
    let df_input = DFSchema::try_from(input.schema()).unwrap();
    let count = datafusion::physical_expr::aggregate::AggregateExprBuilder::new(
        datafusion::functions_aggregate::count::count_udaf(),
        vec![state.create_physical_expr(col("k"), &df_input).unwrap()],
    )
    .schema(input.schema())
    .alias("n")
    .build()
    .unwrap();
    let aggregate = Arc::new(
        datafusion::physical_plan::aggregates::AggregateExec::try_new(
            datafusion::physical_plan::aggregates::AggregateMode::Partial,
            datafusion::physical_plan::aggregates::PhysicalGroupBy::new_single(vec![]),
            vec![Arc::new(count)],
            vec![None],
            input,
            Arc::clone(&schema).project(&[0]).map(Arc::new).unwrap(),
        )
        .unwrap(),
    );
    let body = Fragment {
        projection: vec![0],
        predicate: None,
        aggregate: Some(aggregate),
    }
    .encode_body(&schema)
    .unwrap();
    let mut mutated = sieve_fragment::FragmentBody::decode(body.as_slice()).unwrap();
    mutated.projection.clear();
    let error =
        DecodedBody::decode(&mutated.encode_to_vec(), &schema, &context.task_ctx()).unwrap_err();
    assert!(error.to_string().contains("empty projection"), "{error}");
}

/// A star join's fragment: hash joins whose build sides are shipped rows,
/// probed by the slice's rows. The ones whose result over a slice is the
/// slice's share of the whole join round-trip; the others are refused.
#[test]
fn star_join_operators_round_trip_and_unsafe_joins_are_refused() {
    use arrow::array::{Int64Array, RecordBatch};
    use datafusion::common::{JoinType, NullEquality};
    use datafusion::datasource::memory::MemorySourceConfig;
    use datafusion::physical_expr::expressions::Column;
    use datafusion::physical_expr::PhysicalExpr;
    use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
    use datafusion::physical_plan::ExecutionPlan;
    use sieve_fragment::FRAGMENT_JOINS_MAX;

    let schema = schema();
    let build_schema = Arc::new(Schema::new(vec![Field::new("b", DataType::Int64, true)]));
    let batch = RecordBatch::try_new(
        Arc::clone(&build_schema),
        vec![Arc::new(Int64Array::from(vec![Some(1), None, Some(3)]))],
    )
    .unwrap();
    let rows = |partitions: usize| -> Arc<dyn ExecutionPlan> {
        MemorySourceConfig::try_new_exec(
            &vec![vec![batch.clone()]; partitions],
            Arc::clone(&build_schema),
            None,
        )
        .unwrap()
    };
    let join = |build: Arc<dyn ExecutionPlan>,
                probe: Arc<dyn ExecutionPlan>,
                join_type: JoinType,
                mode: PartitionMode,
                nulls: NullEquality|
     -> Arc<dyn ExecutionPlan> {
        let on = vec![(
            Arc::new(Column::new("b", 0)) as Arc<dyn PhysicalExpr>,
            Arc::new(Column::new("k", 0)) as Arc<dyn PhysicalExpr>,
        )];
        // Keep the probe side's columns, so joins stack.
        let projection = match join_type {
            JoinType::Inner => Some(vec![1, 2, 3]),
            _ => None,
        };
        Arc::new(
            HashJoinExec::try_new(
                build, probe, on, None, &join_type, projection, mode, nulls, false,
            )
            .unwrap(),
        )
    };
    let input = || -> Arc<dyn ExecutionPlan> { Arc::new(SliceInputExec::new(Arc::clone(&schema))) };
    let encode = |plan: Arc<dyn ExecutionPlan>| {
        Fragment {
            projection: vec![0, 1, 2],
            predicate: None,
            aggregate: Some(plan),
        }
        .encode_body(&schema)
    };
    let allowed = (NullEquality::NullEqualsNothing, PartitionMode::CollectLeft);

    // Two inner joins and a right semi join over the slice: encoded, decoded,
    // the same operators.
    let mut plan = input();
    for join_type in [JoinType::Inner, JoinType::Inner, JoinType::RightSemi] {
        plan = join(rows(1), plan, join_type, allowed.1, allowed.0);
    }
    let body = encode(Arc::clone(&plan)).unwrap();
    let context = SessionContext::new();
    let decoded = DecodedBody::decode(&body, &schema, &context.task_ctx()).unwrap();
    let decoded = decoded.aggregate.unwrap();
    assert_eq!(decoded.schema(), plan.schema());
    assert_eq!(decoded.name(), "HashJoinExec");

    let refused = |plan: Arc<dyn ExecutionPlan>, expected: &str| {
        let error = encode(plan).unwrap_err().to_string();
        assert!(error.contains(expected), "{expected}: {error}");
    };
    // A left join emits build rows no probe row of this slice matched.
    refused(
        join(rows(1), input(), JoinType::Left, allowed.1, allowed.0),
        "only inner and right semi",
    );
    refused(
        join(
            rows(1),
            input(),
            JoinType::Inner,
            allowed.1,
            NullEquality::NullEqualsNull,
        ),
        "NULL keys match",
    );
    refused(
        join(
            rows(1),
            input(),
            JoinType::Inner,
            PartitionMode::Partitioned,
            allowed.0,
        ),
        "collect-left",
    );
    // A collect-left join builds from the first partition alone.
    refused(
        join(rows(2), input(), JoinType::Inner, allowed.1, allowed.0),
        "one partition",
    );
    // The build side is shipped rows, never a plan over anything else.
    refused(
        join(
            Arc::new(SliceInputExec::new(Arc::clone(&build_schema))),
            input(),
            JoinType::Inner,
            allowed.1,
            allowed.0,
        ),
        "must be shipped rows",
    );
    let mut deep = input();
    for _ in 0..=FRAGMENT_JOINS_MAX {
        deep = join(rows(1), deep, JoinType::RightSemi, allowed.1, allowed.0);
    }
    refused(deep, "at most");
}
