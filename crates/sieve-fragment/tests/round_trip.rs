//! The fragment survives encoding, and the allow-list holds on both sides.

use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Schema};
use datafusion::common::DFSchema;
use datafusion::logical_expr::{col, lit};
use datafusion::prelude::SessionContext;
use prost::Message;
use sieve_fragment::{DecodedBody, Fragment, FragmentEnvelope, FRAGMENT_VERSION};

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
