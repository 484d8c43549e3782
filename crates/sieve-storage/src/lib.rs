//! The Sieve storage node.
//!
//! A storage node owns one data directory of slices and serves it three ways:
//!
//! ```text
//!   Flight ListFlights / GetFlightInfo   catalog: one FlightInfo per table,
//!                                        one endpoint per slice (catalog.rs, flight.rs)
//!   Flight DoGet(FragmentEnvelope)       one slice through an NDP fragment:
//!       coarse stage   match hints from row-group stats, Bloom filters and
//!                      the page index -> pages that may match      (coarse.rs)
//!       exact stage    read only those pages, filter, project      (execute.rs)
//!       stream         Arrow IPC (zstd), then a SliceMetrics trailer (flight.rs)
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
mod flight;
mod node;
mod range;
mod reader;

pub use catalog::{CatalogSlice, CatalogTable, NodeCatalog};
pub use coarse::MatchHints;
pub use execute::{ExecuteOptions, NodeCounters, SliceExecutor};
pub use flight::{StorageFlightService, STATS_ACTION};
pub use node::{StorageNode, StorageNodeConfig};
