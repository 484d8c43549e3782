//! Join filters registered on a storage node once per query.
//!
//! A join's filter (key range, key bitmap or Bloom filter of its build keys)
//! is the same for every slice the probe scan asks for; at SF 10 a Bloom
//! filter of a million keys is megabytes. The compute node therefore sends
//! it to each storage node once, in a [`JoinFilterRegistration`] (the Flight
//! action [`REGISTER_JOIN_FILTER_ACTION`]), and each slice's
//! [`crate::FragmentEnvelope`] names it by [`JoinFilterRegistration::id`]:
//!
//! ```text
//!   compute ── register-join-filter (table, filter) ──> node: decode, check, keep
//!   compute ── DoGet(envelope: body + join filter id) ─> node: predicate AND filter
//!   compute ── release-join-filter (id) ──────────────> node: drop it (or idle timeout)
//! ```
//!
//! The id is a BLAKE3 digest of the registration's content, so two
//! registrations share an id only if they say the same thing, whoever sends
//! them; the node counts registrations per id and drops the filter when every
//! one is released or it has been idle past its timeout. A join filter only
//! removes rows the join would drop, so a node that no longer holds one (it
//! restarted, or evicted it to stay within its bound) runs the slice without
//! it and says so in the slice's metrics: the answer is the same.

use std::sync::Arc;

use arrow::datatypes::Schema;
use datafusion::common::{plan_datafusion_err, plan_err, Result};
use datafusion::execution::TaskContext;
use datafusion::physical_expr::PhysicalExpr;
use datafusion_proto::physical_plan::from_proto::parse_physical_expr;
use datafusion_proto::physical_plan::to_proto::serialize_physical_expr;
use datafusion_proto::protobuf::PhysicalExprNode;
use prost::Message;

use crate::{check_allowed, schema_fingerprint, SieveCodec, FRAGMENT_VERSION};

/// Flight action registering a join filter; its body is an encoded
/// [`JoinFilterRegistration`], compressed with zstd
/// ([`JoinFilterRegistration::compress`]), its answer the id.
pub const REGISTER_JOIN_FILTER_ACTION: &str = "register-join-filter";

/// Flight action releasing one registration of a join filter; its body is
/// the id.
pub const RELEASE_JOIN_FILTER_ACTION: &str = "release-join-filter";

/// Upper bound on an encoded registration, before and after zstd: the
/// largest key bitmap ([`crate::KEY_BITMAP_BYTES_MAX`]) and the expression
/// around it (a Bloom filter of 16 million keys at a 1% false-positive rate
/// is about 20 MB).
pub const JOIN_FILTER_BYTES_MAX: usize = crate::KEY_BITMAP_BYTES_MAX + 8 * 1024 * 1024;

/// Upper bound on a join filter part once decompressed (it travels in an
/// envelope, itself within [`crate::FRAGMENT_BYTES_MAX`]).
pub const JOIN_FILTER_PART_BYTES_MAX: usize = 4 * crate::FRAGMENT_BYTES_MAX;

/// Bytes of a join filter id.
pub const JOIN_FILTER_ID_BYTES: usize = 16;

/// A join filter for one table, as registered on a storage node.
#[derive(Clone, PartialEq, Message)]
pub struct JoinFilterRegistration {
    /// Must equal [`FRAGMENT_VERSION`].
    #[prost(uint32, tag = "1")]
    pub version: u32,
    /// Table whose rows the filter is over.
    #[prost(string, tag = "2")]
    pub table: String,
    /// [`schema_fingerprint`] of that table's schema.
    #[prost(uint64, tag = "3")]
    pub schema_fingerprint: u64,
    /// The filter, over the table schema.
    #[prost(message, optional, tag = "4")]
    pub filter: Option<PhysicalExprNode>,
}

impl JoinFilterRegistration {
    /// Check `filter` against `schema` and the allow-list and encode a
    /// registration of it for `table`; returns the bytes and their id.
    pub fn encode(
        table: &str,
        schema: &Schema,
        filter: &Arc<dyn PhysicalExpr>,
    ) -> Result<(Vec<u8>, [u8; JOIN_FILTER_ID_BYTES])> {
        check_allowed(filter, schema)?;
        let registration = Self {
            version: FRAGMENT_VERSION,
            table: table.to_string(),
            schema_fingerprint: schema_fingerprint(schema),
            filter: Some(serialize_physical_expr(filter, &SieveCodec::new())?),
        };
        let bytes = registration.encode_to_vec();
        if bytes.len() > JOIN_FILTER_BYTES_MAX {
            return plan_err!(
                "join filter is {} bytes, above the limit of {JOIN_FILTER_BYTES_MAX}",
                bytes.len()
            );
        }
        let id = Self::id_of(&bytes);
        Ok((bytes, id))
    }

    /// An encoded registration as it travels: a zstd frame (level 1: a
    /// Bloom filter does not compress, a key bitmap of sparse keys does,
    /// several times).
    pub fn compress(bytes: &[u8]) -> Result<Vec<u8>> {
        zstd::bulk::compress(bytes, 1)
            .map_err(|error| plan_datafusion_err!("cannot compress a join filter: {error}"))
    }

    /// The encoded registration in a compressed action body, refusing one
    /// that would decompress past [`JOIN_FILTER_BYTES_MAX`].
    pub fn decompress(body: &[u8]) -> Result<Vec<u8>> {
        zstd::bulk::decompress(body, JOIN_FILTER_BYTES_MAX).map_err(|error| {
            plan_datafusion_err!(
                "join filter registration is not a zstd frame of at most \
                 {JOIN_FILTER_BYTES_MAX} bytes: {error}"
            )
        })
    }

    /// The encoded join filter part in an envelope
    /// ([`crate::FragmentEnvelope::join_filter_part`]), refusing one that
    /// would decompress past [`JOIN_FILTER_PART_BYTES_MAX`].
    pub fn decompress_part(part: &[u8]) -> Result<Vec<u8>> {
        zstd::bulk::decompress(part, JOIN_FILTER_PART_BYTES_MAX).map_err(|error| {
            plan_datafusion_err!(
                "join filter part is not a zstd frame of at most \
                 {JOIN_FILTER_PART_BYTES_MAX} bytes: {error}"
            )
        })
    }

    /// The id of an encoded registration: the first bytes of its BLAKE3 digest.
    pub fn id_of(bytes: &[u8]) -> [u8; JOIN_FILTER_ID_BYTES] {
        let digest = blake3::hash(bytes);
        let mut id = [0; JOIN_FILTER_ID_BYTES];
        id.copy_from_slice(&digest.as_bytes()[..JOIN_FILTER_ID_BYTES]);
        id
    }

    /// Decode a registration received over the network: size, version,
    /// table, schema and allow-list are checked. `schema_of` gives the
    /// schema of a table the node holds. `bytes` are dropped once decoded: a
    /// key bitmap of SF 100's order keys is 75 MB, and each copy of it a
    /// storage node holds at once counts in its peak memory. `key_ranges`
    /// gives, for the registration's table, the key ranges the node's
    /// slices hold in a column: a key bitmap over it is cut to them.
    pub fn decode_checked(
        bytes: Vec<u8>,
        schema_of: impl FnOnce(&str) -> Result<Arc<Schema>>,
        key_ranges: impl FnOnce(&str) -> Option<crate::KeyRanges>,
        task_context: &TaskContext,
    ) -> Result<DecodedJoinFilter> {
        if bytes.len() > JOIN_FILTER_BYTES_MAX {
            return plan_err!(
                "join filter is {} bytes, above the limit of {JOIN_FILTER_BYTES_MAX}",
                bytes.len()
            );
        }
        let (id, encoded_bytes) = (Self::id_of(&bytes), bytes.len());
        let registration = Self::decode(bytes.as_slice())
            .map_err(|error| plan_datafusion_err!("malformed join filter: {error}"))?;
        drop(bytes);
        if registration.version != FRAGMENT_VERSION {
            return plan_err!(
                "join filter version {} is not supported (this node speaks version {FRAGMENT_VERSION})",
                registration.version
            );
        }
        let schema = schema_of(&registration.table)?;
        if registration.schema_fingerprint != schema_fingerprint(&schema) {
            return plan_err!("join filter was planned against another schema of this table");
        }
        let Some(node) = &registration.filter else {
            return plan_err!("join filter without a filter");
        };
        let codec = match key_ranges(&registration.table) {
            Some(key_ranges) => SieveCodec::new().with_key_ranges(key_ranges),
            None => SieveCodec::new(),
        };
        let filter = parse_physical_expr(node, task_context, &schema, &codec)
            .map_err(|error| plan_datafusion_err!("join filter cannot be decoded: {error}"))?;
        if let Err(error) = check_allowed(&filter, &schema) {
            crate::dismantle(filter);
            return Err(error);
        }
        Ok(DecodedJoinFilter {
            id,
            table: registration.table,
            filter,
            bytes: encoded_bytes,
        })
    }
}

/// A registration decoded and checked on the storage node.
#[derive(Debug, Clone)]
pub struct DecodedJoinFilter {
    /// Its id ([`JoinFilterRegistration::id_of`] its bytes).
    pub id: [u8; JOIN_FILTER_ID_BYTES],
    /// The table it filters.
    pub table: String,
    /// The filter, over the table schema.
    pub filter: Arc<dyn PhysicalExpr>,
    /// Encoded size, what the node charges it against its bound.
    pub bytes: usize,
}

/// A join filter id from bytes received over the network.
pub fn join_filter_id(bytes: &[u8]) -> Result<[u8; JOIN_FILTER_ID_BYTES]> {
    bytes.try_into().map_err(|_| {
        plan_datafusion_err!(
            "join filter id must be {JOIN_FILTER_ID_BYTES} bytes, not {}",
            bytes.len()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::datatypes::{DataType, Field};
    use datafusion::logical_expr::Operator;
    use datafusion::physical_expr::expressions::{lit, BinaryExpr, Column};
    use datafusion::prelude::SessionContext;

    fn schema() -> Arc<Schema> {
        Arc::new(Schema::new(vec![
            Field::new("a", DataType::Int64, false),
            Field::new("k", DataType::Int64, true),
        ]))
    }

    #[test]
    fn a_registration_round_trips_and_its_id_follows_its_content() {
        let schema = schema();
        let filter: Arc<dyn PhysicalExpr> = Arc::new(BinaryExpr::new(
            Arc::new(Column::new("k", 1)),
            Operator::GtEq,
            lit(5i64),
        ));
        let (bytes, id) = JoinFilterRegistration::encode("t", &schema, &filter).unwrap();
        let context = SessionContext::new().task_ctx();
        let decoded = JoinFilterRegistration::decode_checked(
            bytes,
            |_| Ok(Arc::clone(&schema)),
            |_| None,
            &context,
        )
        .unwrap();
        assert_eq!(decoded.id, id);
        assert_eq!(decoded.table, "t");
        assert_eq!(format!("{}", decoded.filter), format!("{filter}"));
        let other: Arc<dyn PhysicalExpr> = Arc::new(BinaryExpr::new(
            Arc::new(Column::new("k", 1)),
            Operator::GtEq,
            lit(6i64),
        ));
        let (_, other_id) = JoinFilterRegistration::encode("t", &schema, &other).unwrap();
        assert_ne!(id, other_id);
        let (_, other_table) = JoinFilterRegistration::encode("u", &schema, &filter).unwrap();
        assert_ne!(id, other_table);
    }

    #[test]
    fn a_key_bitmap_over_sf100_order_keys_registers_compressed_and_decodes() {
        // TPC-H SF 100: order keys up to 600 million, a quarter's orders
        // (one key in 26 here): a 75 MB bitmap, past the former 32 MiB cap.
        let schema = schema();
        let keys: arrow::array::ArrayRef = Arc::new(arrow::array::Int64Array::from_iter_values(
            (1..600_000_000i64).step_by(26),
        ));
        let bitmap: Arc<dyn PhysicalExpr> = Arc::new(
            crate::KeyBitmapExpr::try_new(Arc::new(Column::new("k", 1)), DataType::Int64, &keys)
                .unwrap(),
        );
        let (bytes, id) = JoinFilterRegistration::encode("t", &schema, &bitmap).unwrap();
        // The bitmap's words travel as their own zstd frame: the encoded
        // registration is a fraction of the bitmap, and compressing it
        // again gains nothing.
        let whole = bitmap
            .downcast_ref::<crate::KeyBitmapExpr>()
            .unwrap()
            .byte_len();
        assert!(whole > 32 * 1024 * 1024);
        assert!(bytes.len() < whole / 4, "{} of {whole}", bytes.len());
        let body = JoinFilterRegistration::compress(&bytes).unwrap();
        assert!(
            body.len() <= bytes.len() + 1024,
            "{} of {}",
            body.len(),
            bytes.len()
        );
        let context = SessionContext::new().task_ctx();
        let decoded = JoinFilterRegistration::decode_checked(
            JoinFilterRegistration::decompress(&body).unwrap(),
            |_| Ok(Arc::clone(&schema)),
            |_| None,
            &context,
        )
        .unwrap();
        assert_eq!(decoded.id, id);
        assert_eq!(
            decoded.filter.downcast_ref::<crate::KeyBitmapExpr>(),
            bitmap.downcast_ref::<crate::KeyBitmapExpr>()
        );
        assert!(decoded
            .filter
            .downcast_ref::<crate::KeyBitmapExpr>()
            .is_some());
        // The decoded filter answers membership across the whole range,
        // checked against the keys' own rule (every 26th value from 1).
        let probes: Vec<Option<i64>> = [0, 1, 2, 27, 28, 299_999_999, 300_000_001]
            .into_iter()
            .chain([
                599_999_975,
                599_999_976,
                599_999_999,
                600_000_001,
                1 << 40,
                -5,
            ])
            .map(Some)
            .chain([None])
            .collect();
        let batch = arrow::record_batch::RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(arrow::array::Int64Array::from(vec![0; probes.len()])),
                Arc::new(arrow::array::Int64Array::from(probes.clone())),
            ],
        )
        .unwrap();
        let answer = decoded
            .filter
            .evaluate(&batch)
            .unwrap()
            .into_array(probes.len())
            .unwrap();
        let answer = arrow::array::AsArray::as_boolean(&answer);
        for (row, probe) in probes.iter().enumerate() {
            let expected = probe.map(|v| (1..600_000_000).contains(&v) && (v - 1) % 26 == 0);
            let got = arrow::array::Array::is_valid(answer, row).then(|| answer.value(row));
            assert_eq!(got, expected, "key {probe:?}");
        }

        // A node whose slices hold keys in two ranges keeps the chunks of
        // the bitmap over them: exact inside, every key passing outside
        // (a filter only removes rows the join drops), in a fraction of
        // the bytes.
        let ranges = vec![(1, 100_000_000), (299_999_990, 300_000_010)];
        let kept = ranges.clone();
        let cut = JoinFilterRegistration::decode_checked(
            JoinFilterRegistration::decompress(&body).unwrap(),
            |_| Ok(Arc::clone(&schema)),
            |table| {
                assert_eq!(table, "t");
                let ranges: crate::KeyRanges = Arc::new(move |column, data_type| {
                    assert_eq!((column, data_type), ("k", &DataType::Int64));
                    Some(kept.clone())
                });
                Some(ranges)
            },
            &context,
        )
        .unwrap();
        let cut_bitmap = cut.filter.downcast_ref::<crate::KeyBitmapExpr>().unwrap();
        let whole = bitmap.downcast_ref::<crate::KeyBitmapExpr>().unwrap();
        assert!(cut_bitmap.is_cut());
        assert!(
            cut_bitmap.byte_len() < whole.byte_len() / 5,
            "{} of {}",
            cut_bitmap.byte_len(),
            whole.byte_len()
        );
        let answer = cut
            .filter
            .evaluate(&batch)
            .unwrap()
            .into_array(probes.len())
            .unwrap();
        let answer = arrow::array::AsArray::as_boolean(&answer);
        let chunk_values = (crate::KEY_BITMAP_CHUNK_WORDS * 64) as i64;
        for (row, probe) in probes.iter().enumerate() {
            let exact = probe.map(|v| (1..600_000_000).contains(&v) && (v - 1) % 26 == 0);
            let got = arrow::array::Array::is_valid(answer, row).then(|| answer.value(row));
            let kept_chunk = probe.is_some_and(|v| {
                ranges.iter().any(|&(low, high)| {
                    let chunk = |value: i64| (value - 1).div_euclid(chunk_values);
                    (chunk(low)..=chunk(high)).contains(&chunk(v))
                })
            });
            let in_bitmap = probe.is_some_and(|v| (1..600_000_000).contains(&v));
            if kept_chunk || !in_bitmap {
                assert_eq!(got, exact, "key {probe:?}, in a kept chunk or outside");
            } else {
                assert_eq!(got, Some(true), "key {probe:?}, in a chunk left out");
            }
        }
        // On the wire again, a chunk left out is all ones.
        let again = crate::KeyBitmapExpr::from_parts(
            Arc::new(Column::new("k", 1)),
            DataType::Int64,
            cut_bitmap.base(),
            cut_bitmap.bits(),
            &cut_bitmap.to_bytes(),
            cut_bitmap.keys(),
        )
        .unwrap();
        assert_eq!(again.to_bytes(), cut_bitmap.to_bytes());
    }

    #[test]
    fn bad_registrations_are_refused() {
        let schema = schema();
        let context = SessionContext::new().task_ctx();
        let schema_of = |_: &str| Ok(Arc::clone(&schema));
        assert!(JoinFilterRegistration::decode_checked(
            vec![0xff, 0xff],
            schema_of,
            |_| None,
            &context
        )
        .is_err());
        let filter: Arc<dyn PhysicalExpr> = Arc::new(Column::new("k", 1));
        let mut registration = JoinFilterRegistration {
            version: FRAGMENT_VERSION,
            table: "t".into(),
            schema_fingerprint: schema_fingerprint(&schema) ^ 1,
            filter: Some(serialize_physical_expr(&filter, &SieveCodec::new()).unwrap()),
        };
        let error = JoinFilterRegistration::decode_checked(
            registration.encode_to_vec(),
            |_| Ok(Arc::clone(&schema)),
            |_| None,
            &context,
        )
        .unwrap_err();
        assert!(error.to_string().contains("another schema"), "{error}");
        registration.schema_fingerprint ^= 1;
        registration.version = FRAGMENT_VERSION + 1;
        let error = JoinFilterRegistration::decode_checked(
            registration.encode_to_vec(),
            |_| Ok(Arc::clone(&schema)),
            |_| None,
            &context,
        )
        .unwrap_err();
        assert!(error.to_string().contains("version"), "{error}");
        assert!(join_filter_id(&[1, 2, 3]).is_err());
        // A compressed body round-trips; a bomb past the bound is refused.
        let bytes = registration.encode_to_vec();
        let body = JoinFilterRegistration::compress(&bytes).unwrap();
        assert_eq!(JoinFilterRegistration::decompress(&body).unwrap(), bytes);
        let bomb = JoinFilterRegistration::compress(&vec![0; JOIN_FILTER_BYTES_MAX + 1]).unwrap();
        assert!(bomb.len() < 10_000);
        assert!(JoinFilterRegistration::decompress(&bomb).is_err());
        assert!(JoinFilterRegistration::decompress(&[1, 2, 3]).is_err());
    }
}
