//! A running storage node: the Flight service and the byte-range endpoint,
//! each on its own TCP listener.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arrow_flight::flight_service_server::FlightServiceServer;
use datafusion::common::{DataFusionError, Result};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::faults::{Faults, FaultyListener, FaultyStream};
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
        let catalog = Arc::new(NodeCatalog::open(&config.data_directory)?);
        let executor = Arc::new(SliceExecutor::new(catalog, config.execute.clone()));
        let io = |error: std::io::Error| DataFusionError::External(Box::new(error));
        let pool = Arc::new(
            PushdownPool::new(
                config.execute.pushdown_workers,
                config.execute.queue_max(),
                config.execute.pushdown_wait,
            )
            .map_err(io)?,
        );
        let faults = Arc::new(Faults::new());
        let flight_listener = TcpListener::bind(config.flight_address).await.map_err(io)?;
        let range_listener = TcpListener::bind(config.range_address).await.map_err(io)?;
        let flight_address = flight_listener.local_addr().map_err(io)?;
        let range_address = range_listener.local_addr().map_err(io)?;

        let range_bytes_served = Arc::clone(&executor.counters().range_bytes_served);
        let range_app = router(RangeState {
            catalog: Arc::clone(executor.catalog()),
            bytes_served: Arc::clone(&range_bytes_served),
            faults: Arc::clone(&faults),
        });
        let range_listener = FaultyListener {
            inner: range_listener,
            faults: Arc::clone(&faults),
        };
        let (range_stop, range_stopped) = oneshot::channel::<()>();
        let range_task = tokio::spawn(async move {
            let served = axum::serve(range_listener, range_app).with_graceful_shutdown(async {
                let _ = range_stopped.await;
            });
            if let Err(error) = served.await {
                log::error!("byte-range endpoint stopped: {error}");
            }
        });

        let service = StorageFlightService::new(
            Arc::clone(&executor),
            Arc::clone(&pool),
            Arc::clone(&faults),
            format!("http://{range_address}"),
        );
        let server = FlightServiceServer::new(service)
            .max_decoding_message_size(FLIGHT_MESSAGE_BYTES_MAX)
            .max_encoding_message_size(FLIGHT_MESSAGE_BYTES_MAX);
        let (flight_stop, flight_stopped) = oneshot::channel::<()>();
        let incoming = tokio_stream_from(flight_listener, Arc::clone(&faults));
        let flight_task = tokio::spawn(async move {
            let served = tonic::transport::Server::builder()
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

/// Accepted connections of `listener` as the stream tonic serves.
fn tokio_stream_from(
    listener: TcpListener,
    faults: Arc<Faults>,
) -> impl futures::Stream<Item = std::io::Result<FaultyStream>> {
    futures::stream::unfold(listener, move |listener| {
        let faults = Arc::clone(&faults);
        async move {
            let accepted = listener.accept().await.map(|(stream, _)| {
                let _ = stream.set_nodelay(true);
                faults.wrap(stream)
            });
            Some((accepted, listener))
        }
    })
}
