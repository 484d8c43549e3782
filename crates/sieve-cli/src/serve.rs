//! `sieve serve`: a long-lived compute node that clients reach over the
//! PostgreSQL wire protocol and Arrow Flight SQL (`sieve-server`). Without `--cluster` it starts
//! the embedded cluster of the demo, data generated if missing.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use datafusion::common::{plan_err, DataFusionError, Result};
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::prelude::SessionConfig;
use sieve_compute::memory::runtime_with_memory_limit;
use sieve_compute::{session_over, ClusterCatalog, SieveConfig};
use sieve_fragment::Secret;
use sieve_server::{
    serve, serve_flight_sql, tls_acceptor, FlightSqlOptions, PgServerOptions, SessionFactory, Users,
};

use crate::cluster::EmbeddedCluster;
use crate::demo::{ensure_data, DemoOptions};
use crate::secret::load_secret;

/// Environment variable holding the password of `--user` (when no
/// `--password-file` is given).
pub const PASSWORD_ENV: &str = "SIEVE_PASSWORD";

/// Bytes of a password made up at start when none is given.
const RANDOM_PASSWORD_BYTES: usize = 12;

/// What `sieve serve` serves, and how.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Storage node Flight URLs; empty: start the embedded cluster.
    pub cluster: Vec<String>,
    /// Scale factor of the embedded cluster's data.
    pub scale_factor: f64,
    /// Data directory of the embedded cluster.
    pub data_directory: PathBuf,
    /// The storage nodes' shared secret (for `cluster`).
    pub secret_file: Option<PathBuf>,
    /// Address of the PostgreSQL port.
    pub listen: SocketAddr,
    /// Address of the Arrow Flight SQL port.
    pub flight_listen: SocketAddr,
    /// The user who may log in.
    pub user: String,
    /// File holding the user's password.
    pub password_file: Option<PathBuf>,
    /// TLS certificate chain and private key (PEM); with them, TLS is required.
    pub tls_cert: Option<PathBuf>,
    /// See `tls_cert`.
    pub tls_key: Option<PathBuf>,
    /// Allow plaintext on an address other than loopback.
    pub insecure_plaintext: bool,
    /// Client connections served at once.
    pub connections_max: usize,
    /// `key=value` settings every session starts with.
    pub settings: Vec<String>,
    /// The table catalog (tables users own); the embedded cluster's is in
    /// its data directory, `catalog.sqlite`.
    pub catalog: Option<PathBuf>,
}

/// The table catalog's file in an embedded cluster's data directory.
pub use sieve_format::TABLE_CATALOG_FILE;

/// Serve until interrupted (Ctrl-C).
pub async fn run_serve(options: ServeOptions) -> Result<()> {
    let tls = match (&options.tls_cert, &options.tls_key) {
        (Some(cert), Some(key)) => Some(tls_acceptor(cert, key)?),
        (None, None) => None,
        _ => return plan_err!("--tls-cert and --tls-key go together"),
    };
    for address in [options.listen, options.flight_listen] {
        if tls.is_none() && !address.ip().is_loopback() && !options.insecure_plaintext {
            return plan_err!(
                "{address} is not a loopback address: without TLS, query results and \
                 passwords cross the network in the clear; give --tls-cert and \
                 --tls-key (or --insecure-plaintext)"
            );
        }
    }
    // The same certificate and key for Flight SQL (checked above, by rustls).
    let flight_tls = match (&options.tls_cert, &options.tls_key) {
        (Some(cert), Some(key)) => Some((read(cert)?, read(key)?)),
        _ => None,
    };
    let (password, made_up) = password(&options)?;
    let users = Arc::new(Users::new([(options.user.clone(), password.clone())])?);

    let mut embedded = None;
    let mut secret = load_secret(options.secret_file.as_deref())?;
    let mut catalog = options.catalog.clone();
    let urls = if options.cluster.is_empty() {
        let demo = DemoOptions {
            scale_factor: options.scale_factor,
            nodes: 3,
            replicas: 2,
            runs: 1,
            data_directory: options.data_directory.clone(),
            queries: vec![],
            cluster: vec![],
            settings: vec![],
            catalog: None,
        };
        let root = ensure_data(&demo)?;
        catalog.get_or_insert_with(|| root.join(TABLE_CATALOG_FILE));
        let started = EmbeddedCluster::start(&root, 3).await?;
        let urls = started.urls();
        secret = Some(started.secret().clone());
        embedded = Some(started);
        urls
    } else {
        options.cluster.clone()
    };

    let factory = session_factory(
        &urls,
        secret.as_ref(),
        options.settings.clone(),
        catalog.as_deref(),
    )
    .await?;
    if let Some(catalog) = &catalog {
        println!("Tables users own: catalog {}", catalog.display());
    }
    // A bad --set is an error now, not at the first connection.
    factory()?;

    let (listener, address) = bind(options.listen).await?;
    let (flight_listener, flight_address) = bind(options.flight_listen).await?;
    let sslmode = if tls.is_some() { "require" } else { "disable" };
    println!(
        "PostgreSQL protocol: listening on {address} ({}), user '{}'",
        if tls.is_some() {
            "TLS required"
        } else {
            "plaintext"
        },
        options.user
    );
    println!(
        "  connect: psql \"postgresql://{}@{address}/sieve?sslmode={sslmode}\"",
        options.user
    );
    println!(
        "Arrow Flight SQL: listening on {flight_address} ({}), user '{}'",
        if flight_tls.is_some() {
            "TLS required"
        } else {
            "plaintext"
        },
        options.user
    );
    println!(
        "  connect: adbc_driver_flightsql.dbapi.connect(\"grpc{}://{flight_address}\", \
         db_kwargs={{\"username\": \"{}\", \"password\": ...}})",
        if flight_tls.is_some() { "+tls" } else { "" },
        options.user
    );
    if made_up {
        println!(
            "  password (made up for this run; set one with --password-file or {PASSWORD_ENV}): {password}"
        );
    }
    let flight = FlightSqlOptions {
        users: Arc::clone(&users),
        tls: flight_tls,
        sessions_max: options.connections_max.max(1),
    };
    let pg = PgServerOptions {
        users,
        tls,
        connections_max: options.connections_max.max(1),
    };
    // Until Ctrl-C, or until a port fails.
    let pg_server = serve(listener, Arc::clone(&factory), pg, std::future::pending());
    let flight_server = serve_flight_sql(flight_listener, factory, flight, std::future::pending());
    tokio::select! {
        result = pg_server => {
            result.map_err(|error| DataFusionError::External(Box::new(error)))?;
        }
        result = flight_server => {
            result.map_err(|error| {
                DataFusionError::Execution(format!("Flight SQL port: {error}"))
            })?;
        }
        _ = tokio::signal::ctrl_c() => {}
    }
    drop(embedded);
    Ok(())
}

/// New sessions over the cluster at `urls`, each starting with `settings`:
/// one discovery and one memory pool for every connection.
pub async fn session_factory(
    urls: &[String],
    secret: Option<&Secret>,
    settings: Vec<String>,
    tables: Option<&std::path::Path>,
) -> Result<SessionFactory> {
    let base = SessionConfig::new().with_option_extension(SieveConfig::default());
    let mut catalog = ClusterCatalog::discover_with(
        urls,
        secret,
        SieveConfig::of(base.options()).discovery_settings(),
    )
    .await?;
    if let Some(path) = tables {
        catalog = catalog.with_owned_tables(path).await?;
    }
    let catalog = Arc::new(catalog);
    let runtime = runtime_with_memory_limit(&RuntimeEnv::default(), "auto")?;
    let secret = secret.cloned();
    Ok(Arc::new(move || {
        let session = session_over(
            Arc::clone(&catalog),
            secret.as_ref(),
            SessionConfig::new(),
            Arc::clone(&runtime),
        )?;
        session.apply_settings(&settings)?;
        Ok(session.context)
    }))
}

/// Listen on `address`; the listener and the address it got (port 0: any).
pub async fn bind(address: SocketAddr) -> Result<(tokio::net::TcpListener, SocketAddr)> {
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .map_err(|error| {
            DataFusionError::Execution(format!("cannot listen on {address}: {error}"))
        })?;
    let bound = listener
        .local_addr()
        .map_err(|error| DataFusionError::External(Box::new(error)))?;
    Ok((listener, bound))
}

fn read(path: &std::path::Path) -> Result<Vec<u8>> {
    std::fs::read(path)
        .map_err(|error| DataFusionError::Execution(format!("{}: {error}", path.display())))
}

/// The user's password (from the file, the environment, or made up), and
/// whether it was made up.
fn password(options: &ServeOptions) -> Result<(String, bool)> {
    match password_from(options.password_file.as_deref())? {
        Some(password) => Ok((password, false)),
        None => Ok((Users::random_password(RANDOM_PASSWORD_BYTES)?, true)),
    }
}

/// A password from `file` (its first line), else from [`PASSWORD_ENV`].
pub fn password_from(file: Option<&std::path::Path>) -> Result<Option<String>> {
    if let Some(file) = file {
        let text = std::fs::read_to_string(file).map_err(|error| {
            DataFusionError::Execution(format!("password file {}: {error}", file.display()))
        })?;
        return Ok(Some(text.trim_end_matches(['\n', '\r']).to_string()));
    }
    match std::env::var(PASSWORD_ENV) {
        Ok(password) => Ok(Some(password)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(error) => plan_err!("{PASSWORD_ENV}: {error}"),
    }
}
