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
pub mod copy_text;
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

/// The rows a DML statement (INSERT, UPDATE, DELETE, COPY) answers it
/// changed, from its `count` column; anything else changed none. Both
/// ports report it: PostgreSQL's command tag, Flight SQL's update count.
pub(crate) fn changed_rows(batches: &[datafusion::arrow::array::RecordBatch]) -> u64 {
    batches
        .iter()
        .filter_map(|batch| {
            let column = batch.column_by_name("count")?;
            let values = column
                .as_any()
                .downcast_ref::<datafusion::arrow::array::UInt64Array>()?;
            Some(values.iter().flatten().sum::<u64>())
        })
        .sum::<u64>()
}
