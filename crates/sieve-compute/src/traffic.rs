//! Bytes that crossed the boundary between compute and storage nodes, both
//! ways. Storage to compute, counted as they arrive, message by message (so
//! a failed or cancelled stream counts what it delivered): Flight messages
//! for NDP on, range responses for NDP off. Compute to storage, counted as
//! they leave: slice requests' envelopes, join filter registrations and
//! releases for NDP on; byte-range requests (request line and headers) for
//! NDP off.

use std::sync::atomic::{AtomicU64, Ordering};

/// Process-wide counters of one compute session's traffic.
#[derive(Debug, Default)]
pub struct Traffic {
    flight_bytes: AtomicU64,
    range_bytes: AtomicU64,
    range_requests: AtomicU64,
    slices_requested: AtomicU64,
    bytes_sent: AtomicU64,
    join_filter_bytes: AtomicU64,
}

/// A copy of the counters at one moment; subtract two to get one query's share.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TrafficSnapshot {
    /// Bytes of Flight messages received (IPC headers, bodies, metadata).
    pub flight_bytes: u64,
    /// Bytes of byte-range responses received.
    pub range_bytes: u64,
    /// Byte-range requests made.
    pub range_requests: u64,
    /// Slice requests (DoGet calls) made.
    pub slices_requested: u64,
    /// Bytes sent from compute to storage (requests, join filters).
    pub bytes_sent: u64,
    /// Of `bytes_sent`, the join filter registrations.
    pub join_filter_bytes: u64,
}

impl TrafficSnapshot {
    /// All bytes shipped from storage to compute.
    pub fn bytes_shipped(&self) -> u64 {
        self.flight_bytes + self.range_bytes
    }

    /// Bytes both ways: shipped to compute and sent to storage.
    pub fn bytes_both_ways(&self) -> u64 {
        self.bytes_shipped() + self.bytes_sent
    }

    /// The traffic between `earlier` and `self`.
    pub fn since(&self, earlier: &TrafficSnapshot) -> TrafficSnapshot {
        TrafficSnapshot {
            flight_bytes: self.flight_bytes - earlier.flight_bytes,
            range_bytes: self.range_bytes - earlier.range_bytes,
            range_requests: self.range_requests - earlier.range_requests,
            slices_requested: self.slices_requested - earlier.slices_requested,
            bytes_sent: self.bytes_sent - earlier.bytes_sent,
            join_filter_bytes: self.join_filter_bytes - earlier.join_filter_bytes,
        }
    }
}

impl Traffic {
    pub(crate) fn add_flight_bytes(&self, bytes: u64) {
        self.flight_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn add_range_response(&self, bytes: u64) {
        self.range_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.range_requests.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn add_slice_request(&self, envelope_bytes: u64) {
        self.slices_requested.fetch_add(1, Ordering::Relaxed);
        self.bytes_sent.fetch_add(envelope_bytes, Ordering::Relaxed);
    }

    pub(crate) fn add_sent(&self, bytes: u64) {
        self.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn add_join_filter(&self, bytes: u64) {
        self.join_filter_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
    }

    /// A join filter part, sent inside a slice request's envelope (whose
    /// bytes count as sent already).
    pub(crate) fn add_join_filter_part(&self, bytes: u64) {
        self.join_filter_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> TrafficSnapshot {
        TrafficSnapshot {
            flight_bytes: self.flight_bytes.load(Ordering::Relaxed),
            range_bytes: self.range_bytes.load(Ordering::Relaxed),
            range_requests: self.range_requests.load(Ordering::Relaxed),
            slices_requested: self.slices_requested.load(Ordering::Relaxed),
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
            join_filter_bytes: self.join_filter_bytes.load(Ordering::Relaxed),
        }
    }
}
