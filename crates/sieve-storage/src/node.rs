//! A running storage node: the Flight service and the byte-range endpoint,
//! each on its own TCP listener.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arrow_flight::flight_service_server::FlightServiceServer;
use datafusion::common::{DataFusionError, Result};
use sieve_fragment::{Secret, AUTHORIZATION_HEADER};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::service::interceptor::InterceptedService;

use crate::faults::{Faults, FaultyStream};
use crate::limits::{BoundedAcceptor, ConnectionLimits, GuardedStream};
use crate::pool::PushdownPool;
use crate::range::{router, RangeState};
use crate::{ExecuteOptions, NodeCatalog, SliceExecutor, StorageFlightService};

/// Upper bound on one Flight message a storage node sends or accepts; a
/// shipped batch of 8192 rows is a few megabytes at most.
const FLIGHT_MESSAGE_BYTES_MAX: usize = 64 * 1024 * 1024;

/// How to start a storage node.
#[derive(Debug, Clone)]
pub struct StorageNodeConfig {
    /// The data directory this node owns.
    pub data_directory: PathBuf,
    /// Address of the Flight service (port 0 picks a free port).
    pub flight_address: SocketAddr,
    /// Address of the byte-range HTTP endpoint (port 0 picks a free port).
    pub range_address: SocketAddr,
    /// Executor settings.
    pub execute: ExecuteOptions,
    /// The shared secret every request must carry (`authorization: Bearer
    /// <secret>`, on Flight and on the byte-range endpoint); `None` serves
    /// anyone who can connect, which only an explicit choice should give.
    pub auth: Option<Secret>,
    /// Bounds on connections, request times and streams.
    pub limits: ConnectionLimits,
}

/// A started storage node. Dropping it stops both servers.
#[derive(Debug)]
pub struct StorageNode {
    flight_address: SocketAddr,
    range_address: SocketAddr,
    executor: Arc<SliceExecutor>,
    pool: Arc<PushdownPool>,
    faults: Arc<Faults>,
    range_bytes_served: Arc<AtomicU64>,
    shutdown: Vec<oneshot::Sender<()>>,
    tasks: Vec<JoinHandle<()>>,
}

impl StorageNode {
    /// Open the catalog and start serving. Must be called inside a Tokio runtime.
    pub async fn start(config: StorageNodeConfig) -> Result<Self> {
        // What interrupted slice puts left is never served; remove it.
        let stale = crate::ingest::remove_temporaries(&config.data_directory)
            .map_err(|error| DataFusionError::External(Box::new(error)))?;
        if stale > 0 {
            log::info!("removed {stale} temporary file(s) of interrupted slice puts");
        }
        let catalog = Arc::new(NodeCatalog::open(
            &config.data_directory,
            config.execute.slice_details_cache_bytes,
        )?);
        release_freed_memory();
        let faults = Arc::new(Faults::new());
        let executor = Arc::new(
            SliceExecutor::new(catalog, config.execute.clone()).with_faults(Arc::clone(&faults)),
        );
        let io = |error: std::io::Error| DataFusionError::External(Box::new(error));
        let pool = Arc::new(
            PushdownPool::new(
                config.execute.pushdown_workers,
                config.execute.queue_max(),
                config.execute.pushdown_wait,
            )
            .map_err(io)?,
        );
        let flight_listener = TcpListener::bind(config.flight_address).await.map_err(io)?;
        let range_listener = TcpListener::bind(config.range_address).await.map_err(io)?;
        let flight_address = flight_listener.local_addr().map_err(io)?;
        let range_address = range_listener.local_addr().map_err(io)?;

        let range_bytes_served = Arc::clone(&executor.counters().range_bytes_served);
        let range_app = router(RangeState {
            catalog: Arc::clone(executor.catalog()),
            bytes_served: Arc::clone(&range_bytes_served),
            auth: config.auth.clone().map(Arc::new),
            in_flight: crate::range::range_bytes_budget(),
            faults: Arc::clone(&faults),
        });
        let (range_stop, range_stopped) = oneshot::channel::<()>();
        let range_acceptor =
            BoundedAcceptor::new(range_listener, config.limits.clone(), "byte-range");
        let range_task = tokio::spawn(serve_range(
            range_acceptor,
            range_app,
            config.limits.clone(),
            Arc::clone(&faults),
            range_stopped,
        ));

        let service = StorageFlightService::new(
            Arc::clone(&executor),
            Arc::clone(&pool),
            Arc::clone(&faults),
            format!("http://{range_address}"),
        );
        let server = FlightServiceServer::new(service)
            .max_decoding_message_size(FLIGHT_MESSAGE_BYTES_MAX)
            .max_encoding_message_size(FLIGHT_MESSAGE_BYTES_MAX);
        let auth = config.auth.clone();
        let server = InterceptedService::new(server, move |request: tonic::Request<()>| {
            authenticate(auth.as_ref(), request)
        });
        let (flight_stop, flight_stopped) = oneshot::channel::<()>();
        let limits = config.limits.clone();
        let incoming = tokio_stream_from(
            BoundedAcceptor::new(flight_listener, limits.clone(), "flight"),
            Arc::clone(&faults),
        );
        let flight_task = tokio::spawn(async move {
            let served = tonic::transport::Server::builder()
                .timeout(limits.flight_request_timeout)
                .http2_keepalive_interval(Some(limits.http2_keepalive_interval))
                .http2_keepalive_timeout(Some(limits.http2_keepalive_timeout))
                .max_concurrent_streams(limits.flight_streams_per_connection_max)
                .concurrency_limit_per_connection(limits.flight_concurrency_per_connection_max)
                .add_service(server)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = flight_stopped.await;
                });
            if let Err(error) = served.await {
                log::error!("flight service stopped: {error}");
            }
        });
        // A killed node stops listening: new connections are refused.
        let handles = [range_task.abort_handle(), flight_task.abort_handle()];
        faults.on_kill(Box::new(move || {
            for handle in handles {
                handle.abort();
            }
        }));
        Ok(Self {
            flight_address,
            range_address,
            executor,
            pool,
            faults,
            range_bytes_served,
            shutdown: vec![range_stop, flight_stop],
            tasks: vec![range_task, flight_task],
        })
    }

    /// Where the Flight service listens.
    pub fn flight_address(&self) -> SocketAddr {
        self.flight_address
    }

    /// The Flight URL a compute node connects to.
    pub fn flight_url(&self) -> String {
        format!("http://{}", self.flight_address)
    }

    /// Where the byte-range endpoint listens.
    pub fn range_address(&self) -> SocketAddr {
        self.range_address
    }

    /// The executor (for its counters).
    pub fn executor(&self) -> &Arc<SliceExecutor> {
        &self.executor
    }

    /// The pushdown pool.
    pub fn pool(&self) -> &Arc<PushdownPool> {
        &self.pool
    }

    /// The node's fault switch (kill, freeze), for failure tests.
    pub fn faults(&self) -> &Arc<Faults> {
        &self.faults
    }

    /// Bytes served by the byte-range endpoint so far.
    pub fn range_bytes_served(&self) -> u64 {
        self.range_bytes_served.load(Ordering::Relaxed)
    }

    /// Stop at once, dropping open connections mid-stream (a crash, as far
    /// as clients can tell).
    pub fn kill(mut self) {
        self.faults.kill();
        for task in self.tasks.drain(..) {
            task.abort();
        }
    }

    /// Stop accepting requests and wait for the servers to finish.
    pub async fn stop(mut self) {
        for stop in self.shutdown.drain(..) {
            let _ = stop.send(());
        }
        for task in self.tasks.drain(..) {
            let _ = task.await;
        }
    }
}

impl Drop for StorageNode {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Refuse a Flight call without `authorization: Bearer <secret>` (when the
/// node has a secret).
fn authenticate(
    secret: Option<&Secret>,
    request: tonic::Request<()>,
) -> std::result::Result<tonic::Request<()>, tonic::Status> {
    let Some(secret) = secret else {
        return Ok(request);
    };
    match request.metadata().get(AUTHORIZATION_HEADER) {
        Some(value) if secret.matches_header(value.as_bytes()) => Ok(request),
        Some(_) => Err(tonic::Status::unauthenticated(
            "this storage node refuses the credential sent: the authorization header does not hold its secret",
        )),
        None => Err(tonic::Status::unauthenticated(
            "this storage node requires a credential: send 'authorization: Bearer <secret>' (sieve: --secret-file or SIEVE_SECRET)",
        )),
    }
}

/// Accepted connections of `acceptor` as the stream tonic serves. Accept
/// errors are logged and skipped: tonic would stop serving on one.
fn tokio_stream_from(
    acceptor: BoundedAcceptor,
    faults: Arc<Faults>,
) -> impl futures::Stream<Item = std::io::Result<GuardedStream<FaultyStream>>> {
    futures::stream::unfold(acceptor, move |acceptor| {
        let faults = Arc::clone(&faults);
        async move {
            loop {
                match acceptor.accept().await {
                    Ok((stream, guard)) => {
                        return Some((Ok(guard.wrap(faults.wrap(stream))), acceptor))
                    }
                    Err(error) => {
                        log::warn!("flight endpoint: accept failed: {error}");
                        // Out of file descriptors fails at once, again and again.
                        tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
                    }
                }
            }
        }
    })
}

/// Pause after a failed accept (out of file descriptors fails again at
/// once): 50 ms, short enough not to matter once descriptors are free.
const ACCEPT_ERROR_BACKOFF: std::time::Duration = std::time::Duration::from_millis(50);

/// Serve the byte-range endpoint: HTTP/1.1 (and HTTP/2) with a header-read
/// timeout, each connection under `limits` (see [`crate::limits`]), until
/// `stop` fires.
async fn serve_range(
    acceptor: BoundedAcceptor,
    app: axum::Router,
    limits: ConnectionLimits,
    faults: Arc<Faults>,
    mut stop: oneshot::Receiver<()>,
) {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(limits.http2_keepalive_interval)
        .keep_alive_timeout(limits.http2_keepalive_timeout)
        .max_concurrent_streams(limits.flight_streams_per_connection_max);
    let builder = Arc::new(builder);
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            _ = &mut stop => break,
            accepted = acceptor.accept() => accepted,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let (stream, guard) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                log::warn!("byte-range endpoint: accept failed: {error}");
                tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
                continue;
            }
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let builder = Arc::clone(&builder);
        // Range connections obey the fault switch, as Flight's do.
        let stream = faults.wrap(stream);
        connections.spawn(async move {
            let io = TokioIo::new(guard.wrap(stream));
            if let Err(error) = builder.serve_connection(io, service).await {
                log::debug!("byte-range connection closed: {error}");
            }
        });
    }
    // Stopped: dropping the set closes the connections still open.
    drop(connections);
}

/// Give the memory freed so far back to the operating system. Opening the
/// catalog decodes every slice's metadata and keeps a bounded part of it;
/// the allocator keeps the rest (many small allocations) otherwise, and
/// the node's resident memory would grow with the data it holds (TPC-H
/// SF 100: about 100 MB a node after start).
fn release_freed_memory() {
    sieve_format::release_freed_memory();
}
