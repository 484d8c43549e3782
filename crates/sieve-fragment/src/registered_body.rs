//! Fragment bodies registered on a storage node once per query.
//!
//! A star join's fragment carries its dimensions' rows (keys and payload):
//! hundreds of kilobytes at SF 10, the same for every slice the scan asks
//! for. Sent inside each slice request, they would cost as much as the
//! rows the join saves from shipping. So, like a join filter
//! ([`crate::JoinFilterRegistration`]), such a body is sent to each storage
//! node once ([`REGISTER_FRAGMENT_BODY_ACTION`]), and each slice's
//! [`crate::FragmentEnvelope`] names it by id (`body_id`, its `body` left
//! empty):
//!
//! ```text
//!   compute ── register-fragment-body (table, body) ──> node: decode, check, keep
//!   compute ── DoGet(envelope: body id) ───────────────> node: run the kept body
//!   compute ── release-fragment-body (id) ─────────────> node: drop it (or idle timeout)
//! ```
//!
//! Unlike a join filter, a body cannot be left out: a node that does not
//! hold the one named (it restarted, evicted it, or missed the
//! registration) refuses the request with [`BODY_NOT_HELD_KIND`], and the
//! compute node sends that slice's request again with the body inline.

use datafusion::common::{plan_datafusion_err, plan_err, DataFusionError, Result};
use prost::Message;

use crate::{JoinFilterRegistration, FRAGMENT_VERSION, JOIN_FILTER_ID_BYTES};

/// Flight action registering a fragment body; its body is an encoded
/// [`FragmentBodyRegistration`], compressed with zstd, its answer the id.
pub const REGISTER_FRAGMENT_BODY_ACTION: &str = "register-fragment-body";

/// Flight action releasing one registration of a fragment body; its body is
/// the id.
pub const RELEASE_FRAGMENT_BODY_ACTION: &str = "release-fragment-body";

/// Largest body a registration may carry, before and after zstd: a star
/// join's build sides at their bound ([`crate::BUILD_TABLE_BYTES_MAX`] each,
/// at most [`crate::FRAGMENT_JOINS_MAX`]) are more than a node should
/// decode for one scan; this keeps a registration to the size of the
/// largest join filter.
pub const REGISTERED_BODY_BYTES_MAX: usize = 32 * 1024 * 1024;

/// The `sieve-error-kind` of a slice request naming a body the node does not
/// hold: send it again with the body inline.
pub const BODY_NOT_HELD_KIND: &str = "fragment-body-not-held";

/// A fragment body for one table, as registered on a storage node.
#[derive(Clone, PartialEq, Message)]
pub struct FragmentBodyRegistration {
    /// Must equal [`FRAGMENT_VERSION`].
    #[prost(uint32, tag = "1")]
    pub version: u32,
    /// Table the body reads.
    #[prost(string, tag = "2")]
    pub table: String,
    /// An encoded [`crate::FragmentBody`] (its own schema fingerprint and
    /// checks go with it).
    #[prost(bytes = "vec", tag = "3")]
    pub body: Vec<u8>,
}

impl FragmentBodyRegistration {
    /// A registration of `body` (already encoded and checked by
    /// [`crate::Fragment::encode_body_within`]) for `table`, compressed as
    /// it travels, and its id.
    pub fn encode(table: &str, body: &[u8]) -> Result<(Vec<u8>, [u8; JOIN_FILTER_ID_BYTES])> {
        if body.len() > REGISTERED_BODY_BYTES_MAX {
            return plan_err!(
                "fragment body is {} bytes, above the limit of {REGISTERED_BODY_BYTES_MAX}",
                body.len()
            );
        }
        let bytes = Self {
            version: FRAGMENT_VERSION,
            table: table.to_string(),
            body: body.to_vec(),
        }
        .encode_to_vec();
        let id = JoinFilterRegistration::id_of(&bytes);
        let compressed = zstd::bulk::compress(&bytes, 1)
            .map_err(|error| plan_datafusion_err!("cannot compress a fragment body: {error}"))?;
        Ok((compressed, id))
    }

    /// Decode a compressed registration received over the network, refusing
    /// one past [`REGISTERED_BODY_BYTES_MAX`] (with room for its table name)
    /// or of another version; returns it and its id.
    pub fn decode_checked(compressed: &[u8]) -> Result<(Self, [u8; JOIN_FILTER_ID_BYTES])> {
        let bytes = zstd::bulk::decompress(compressed, REGISTERED_BODY_BYTES_MAX + 64 * 1024)
            .map_err(|error| {
                plan_datafusion_err!(
                    "fragment body registration is not a zstd frame of at most \
                     {REGISTERED_BODY_BYTES_MAX} bytes: {error}"
                )
            })?;
        let id = JoinFilterRegistration::id_of(&bytes);
        let registration = Self::decode(bytes.as_slice()).map_err(|error| {
            plan_datafusion_err!("malformed fragment body registration: {error}")
        })?;
        if registration.version != FRAGMENT_VERSION {
            return plan_err!(
                "fragment body version {} is not supported (this node speaks version {FRAGMENT_VERSION})",
                registration.version
            );
        }
        if registration.body.len() > REGISTERED_BODY_BYTES_MAX {
            return plan_err!(
                "fragment body is {} bytes, above the limit of {REGISTERED_BODY_BYTES_MAX}",
                registration.body.len()
            );
        }
        Ok((registration, id))
    }
}

/// A slice request named a fragment body its node does not hold.
#[derive(Debug, Clone)]
pub struct BodyNotHeld {
    /// Who said so, and what.
    pub message: String,
}

impl std::fmt::Display for BodyNotHeld {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(&self.message)
    }
}

impl std::error::Error for BodyNotHeld {}

impl BodyNotHeld {
    /// The error, as a DataFusion error.
    pub fn into_error(self) -> DataFusionError {
        DataFusionError::External(Box::new(self))
    }

    /// Whether `error` is (or wraps) a [`BodyNotHeld`].
    pub fn is(error: &DataFusionError) -> bool {
        matches!(error.find_root(), DataFusionError::External(inner) if inner.downcast_ref::<Self>().is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registration_round_trips_and_hostile_ones_are_refused() {
        let (compressed, id) = FragmentBodyRegistration::encode("lineorder", b"body").unwrap();
        let (decoded, decoded_id) = FragmentBodyRegistration::decode_checked(&compressed).unwrap();
        assert_eq!(decoded.table, "lineorder");
        assert_eq!(decoded.body, b"body");
        assert_eq!(id, decoded_id);
        // Another table or body, another id.
        let (_, other) = FragmentBodyRegistration::encode("part", b"body").unwrap();
        assert_ne!(id, other);
        assert!(FragmentBodyRegistration::decode_checked(b"not zstd").is_err());
        let wrong_version = FragmentBodyRegistration {
            version: FRAGMENT_VERSION + 1,
            table: "t".into(),
            body: vec![],
        }
        .encode_to_vec();
        let compressed = zstd::bulk::compress(&wrong_version, 1).unwrap();
        assert!(FragmentBodyRegistration::decode_checked(&compressed).is_err());
        // A frame that decompresses past the bound.
        let huge =
            zstd::bulk::compress(&vec![0u8; REGISTERED_BODY_BYTES_MAX + 128 * 1024], 1).unwrap();
        assert!(FragmentBodyRegistration::decode_checked(&huge).is_err());
        assert!(
            FragmentBodyRegistration::encode("t", &vec![0; REGISTERED_BODY_BYTES_MAX + 1]).is_err()
        );
        let error = BodyNotHeld {
            message: "gone".into(),
        }
        .into_error()
        .context("while reading");
        assert!(BodyNotHeld::is(&error));
        assert!(!BodyNotHeld::is(&DataFusionError::Plan("x".into())));
    }
}
