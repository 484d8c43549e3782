//! Bytes that crossed the storage-to-compute boundary, counted where they
//! arrive: Flight messages for NDP on, range responses for NDP off.

use std::sync::atomic::{AtomicU64, Ordering};

/// Process-wide counters of one compute session's traffic.
#[derive(Debug, Default)]
pub struct Traffic {
    flight_bytes: AtomicU64,
    range_bytes: AtomicU64,
    range_requests: AtomicU64,
    slices_requested: AtomicU64,
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
}

impl TrafficSnapshot {
    /// All bytes shipped from storage to compute.
    pub fn bytes_shipped(&self) -> u64 {
        self.flight_bytes + self.range_bytes
    }

    /// The traffic between `earlier` and `self`.
    pub fn since(&self, earlier: &TrafficSnapshot) -> TrafficSnapshot {
        TrafficSnapshot {
            flight_bytes: self.flight_bytes - earlier.flight_bytes,
            range_bytes: self.range_bytes - earlier.range_bytes,
            range_requests: self.range_requests - earlier.range_requests,
            slices_requested: self.slices_requested - earlier.slices_requested,
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

    pub(crate) fn add_slice_request(&self) {
        self.slices_requested.fetch_add(1, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> TrafficSnapshot {
        TrafficSnapshot {
            flight_bytes: self.flight_bytes.load(Ordering::Relaxed),
            range_bytes: self.range_bytes.load(Ordering::Relaxed),
            range_requests: self.range_requests.load(Ordering::Relaxed),
            slices_requested: self.slices_requested.load(Ordering::Relaxed),
        }
    }
}
