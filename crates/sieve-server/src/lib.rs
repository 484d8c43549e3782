//! The client-facing front of a compute node (`sieve serve`).
//!
//! ```text
//!   psql, JDBC, psycopg ──PostgreSQL wire protocol──> pg::serve
//!     TLS (tls.rs, required when configured) ─ SCRAM-SHA-256 (auth.rs)
//!     each connection: its own Sieve session (sieve-compute), sharing the
//!     cluster's catalog and one memory pool; SET sieve.* is the connection's
//!     └─ a client that hangs up (hangup.rs) drops its query: the plan, and
//!        with it every slice request on the storage nodes, is cancelled
//! ```
//!
//! Errors go back as the protocol's error messages with a SQLSTATE
//! (`errors.rs`); a connection is never dropped for a query's error.

pub mod auth;
mod errors;
mod hangup;
pub mod pg;
pub mod tls;

pub use auth::Users;
pub use pg::{serve, PgServerOptions, SessionFactory, CONNECTIONS_MAX_DEFAULT};
pub use tls::tls_acceptor;
