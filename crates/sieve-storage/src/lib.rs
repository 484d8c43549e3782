//! The Sieve storage node.
//!
//! A storage node owns one data directory of slices and serves it three ways:
//!
//! ```text
//!   Flight ListFlights / GetFlightInfo   catalog: one FlightInfo per table,
//!                                        one endpoint per slice (catalog.rs, flight.rs)
//!   Flight DoGet(FragmentEnvelope)       one slice through an NDP fragment:
//!       admission      a pushdown worker within the wait budget, or raw (pool.rs)
//!       coarse stage   match hints from row-group stats, Bloom filters and
//!                      the page index -> pages that may match      (coarse.rs)
//!       exact stage    read only those pages, filter, project      (execute.rs)
//!       stream         Arrow IPC, then a SliceMetrics trailer      (flight.rs)
//!       raw            busy: the needed column chunks as stored     (raw.rs)
//!   Flight DoPut(PutSlice + file)        a slice of a table a user owns, written,
//!                                        synced, renamed, served     (ingest.rs)
//!   HTTP GET /slices/{table}/{file}      the slice file by byte range, for the
//!                                        NDP-off baseline and peer engines (range.rs)
//! ```
//!
//! Architecture invariant: the storage node never plans SQL. It evaluates
//! allow-listed fragments against slices its own catalog names, and nothing a
//! request carries can make it open a file outside its data directory.
#![deny(missing_docs)]

mod catalog;
mod coarse;
mod cpu;
mod execute;
mod faults;
mod flight;
pub mod ingest;
mod join_filters;
mod limits;
mod node;
mod pool;
mod range;
mod raw;
mod reader;

pub use catalog::{
    CatalogSlice, CatalogTable, CatalogTables, NodeCatalog, SliceDetails, SliceDetailsCache,
    SLICE_DETAILS_CACHE_BYTES_DEFAULT,
};
pub use coarse::MatchHints;
pub use execute::{
    Admitted, ExecuteOptions, NodeCounters, SliceExecutor, DEFAULT_PUSHDOWN_WAIT_MS,
    PUSHDOWN_QUEUE_PER_WORKER,
};
pub use faults::{Faults, FaultyStream};
pub use flight::{StorageFlightService, STATS_ACTION};
pub use join_filters::{
    BodyRegistry, JoinFilterRegistry, Registry, BODY_REGISTRY_BYTES_MAX, JOIN_FILTER_IDLE_TIMEOUT,
    JOIN_FILTER_REGISTRY_BYTES_MAX,
};
pub use limits::{
    ConnectionLimits, GuardedStream, CONNECTIONS_MAX, FLIGHT_CONCURRENCY_PER_CONNECTION_MAX,
    FLIGHT_REQUEST_TIMEOUT_MS, FLIGHT_STREAMS_PER_CONNECTION_MAX, HANDSHAKE_BYTES,
    HANDSHAKE_TIMEOUT_MS, HEADER_READ_TIMEOUT_MS, HTTP2_KEEPALIVE_INTERVAL_MS,
    HTTP2_KEEPALIVE_TIMEOUT_MS, IDLE_TIMEOUT_MS, TCP_KEEPALIVE_MS,
};
pub use node::{StorageNode, StorageNodeConfig};
pub use pool::{Admission, PushdownPool, Slot};
pub use raw::RAW_CHUNK_BYTES;
