//! The pieces behind the `sieve` command, shared with the end-to-end tests.
//!
//! - [`cluster`]: an embedded cluster, storage nodes inside this process on
//!   loopback ports (real Flight over TCP);
//! - [`queries`]: the 22 TPC-H queries (standard text, validation parameters);
//! - [`demo`]: the embedded default: TPC-H with NDP on and off, side by side;
//! - [`compare`]: result comparison against plain DataFusion;
//! - [`bench`]: `sieve bench`, NDP on, NDP off and DuckDB over an emulated link;
//! - [`fuzz`]: `sieve fuzz`, random tables and queries through Sieve in several
//!   modes, each result compared with plain DataFusion's;
//! - [`serve`]: `sieve serve`, the PostgreSQL and Flight SQL ports;
//! - [`shell`]: `sieve sql`, in this process or against a `sieve serve`.
#![deny(missing_docs)]

pub mod bench;
pub mod cluster;
pub mod compare;
pub mod demo;
pub mod fuzz;
pub mod queries;
pub mod secret;
pub mod serve;
pub mod shell;
