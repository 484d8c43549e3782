//! The client-facing front of a compute node (`sieve serve`).
//!
//! ```text
//!   psql, JDBC, psycopg ──PostgreSQL wire protocol──> pg::serve
//!     TLS (tls.rs, required when configured) ─ SCRAM-SHA-256 (auth.rs)
//!     each connection: its own Sieve session (sieve-compute), sharing the
//!     cluster's catalog and one memory pool; SET sieve.* is the connection's
//!     └─ a client that hangs up (hangup.rs) drops its query: the plan, and
//!        with it every slice request on the storage nodes, is cancelled
//!   ADBC, JDBC, Dremio/InfluxDB tools ──Arrow Flight SQL──> flight_sql
//!     TLS (tonic) ─ Basic handshake → bearer token → that client's session
//!     statements, prepared statements with parameters, metadata commands
//! ```
//!
//! Errors go back as the protocol's error messages with a SQLSTATE
//! (`errors.rs`; for Flight SQL in the status message); a connection is
//! never dropped for a query's error.

pub mod auth;
mod errors;
pub mod flight_sql;
mod hangup;
pub mod pg;
mod settings;
pub mod tls;

pub use auth::Users;
pub use flight_sql::{serve_flight_sql, FlightSqlOptions};
pub use pg::{serve, PgServerOptions, SessionFactory, CONNECTIONS_MAX_DEFAULT};
pub use tls::tls_acceptor;
