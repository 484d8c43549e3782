//! One slice request over the slice's replicas.
//!
//! ```text
//!   replicas, best first (ClusterCatalog::replica_order: healthy, least loaded)
//!   attempt 1 ── node A ──x  down / refused / cut mid-stream / silent > timeout
//!                             -> A marked failed, its partial output dropped
//!   attempt 2 ── node B ──>  batches (or raw pages), metrics
//! ```
//!
//! While another replica is left to try, an attempt's output is held until
//! the slice completes, so a failure mid-stream never lets a row through
//! twice. The last attempt streams straight through. Only failures of the
//! node ([`NodeFailure`]) and damaged copies of the slice
//! ([`crate::CorruptReplica`], which leave the node marked healthy) are
//! retried; a refused request would be refused by every replica. When every attempt failed, the error names the slice and
//! every node tried.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use datafusion::common::{DataFusionError, Result};
use futures::stream::BoxStream;
use futures::{stream, StreamExt, TryStreamExt};

use crate::catalog::Recovery;
use crate::client::{as_corrupt_replica, as_node_failure, SlicePart};
use crate::{ClusterCatalog, ClusterSlice, Traffic};

/// How a slice request fails over.
#[derive(Debug, Clone, Copy)]
pub struct FailoverSettings {
    /// Longest silence of a node during one attempt (connect, first
    /// message, between messages).
    pub timeout: Duration,
    /// Attempts after the first, each on another replica.
    pub retries: usize,
}

/// What a scan shares with its slice requests.
#[derive(Clone)]
pub(crate) struct SliceRequests {
    pub(crate) catalog: Arc<ClusterCatalog>,
    pub(crate) traffic: Arc<Traffic>,
    pub(crate) settings: FailoverSettings,
    pub(crate) table: String,
    /// Told when a request to a node starts (true) and ends (false).
    pub(crate) on_request: Arc<dyn Fn(usize, bool) + Send + Sync>,
}

impl std::fmt::Debug for SliceRequests {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("SliceRequests")
            .field("table", &self.table)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

/// A request in flight to one node; counted off when dropped.
struct InFlight {
    catalog: Arc<ClusterCatalog>,
    node: usize,
    on_request: Arc<dyn Fn(usize, bool) + Send + Sync>,
}

impl InFlight {
    fn start(requests: &SliceRequests, node: usize) -> Self {
        requests.catalog.nodes[node]
            .in_flight
            .fetch_add(1, Ordering::Relaxed);
        (requests.on_request)(node, true);
        Self {
            catalog: Arc::clone(&requests.catalog),
            node,
            on_request: Arc::clone(&requests.on_request),
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.catalog.nodes[self.node]
            .in_flight
            .fetch_sub(1, Ordering::Relaxed);
        (self.on_request)(self.node, false);
    }
}

/// Run `envelope` against `slice` on its replicas until one answers in
/// full. Yields the answer's parts, preceded by one [`SlicePart::Failed`] per
/// failed attempt.
pub(crate) fn request_slice(
    requests: SliceRequests,
    slice: ClusterSlice,
    envelope: Vec<u8>,
) -> BoxStream<'static, Result<SlicePart>> {
    stream::once(async move {
        let order = requests.catalog.replica_order(&slice);
        let attempts = order.len().min(requests.settings.retries + 1).max(1);
        let mut failures: Vec<String> = Vec::new();
        let mut failed: Vec<Result<SlicePart>> = Vec::new();
        // The first failure, for the recovery record.
        let mut first_failure: Option<(usize, Instant)> = None;
        for (attempt, &node) in order.iter().take(attempts).enumerate() {
            let client = &requests.catalog.clients[node];
            let in_flight = InFlight::start(&requests, node);
            let parts = client.stream_slice(
                envelope.clone(),
                Arc::clone(&requests.traffic),
                requests.settings.timeout,
            );
            if attempt + 1 == attempts {
                let (catalog, table, slice_number, replicas) = (
                    Arc::clone(&requests.catalog),
                    requests.table.clone(),
                    slice.summary.slice,
                    slice.replicas.len(),
                );
                let recoveries = Arc::clone(&requests.catalog.recoveries);
                let live = parts.map(move |part| {
                    let _counted = &in_flight;
                    if let (Ok(SlicePart::Done { .. }), Some((failed_node, detected))) =
                        (&part, first_failure)
                    {
                        record(&recoveries, failed_node, detected);
                    }
                    part.map_err(|error| {
                        if as_corrupt_replica(&error).is_some() {
                            failures.push(error.to_string());
                            return every_replica_failed(&table, slice_number, replicas, &failures);
                        }
                        if as_node_failure(&error).is_none() {
                            return error;
                        }
                        catalog.mark_failed(node);
                        failures.push(error.to_string());
                        every_replica_failed(&table, slice_number, replicas, &failures)
                    })
                });
                return Ok(stream::iter(failed).chain(live).boxed());
            }
            match parts.try_collect::<Vec<SlicePart>>().await {
                Ok(parts) => {
                    drop(in_flight);
                    if let Some((failed_node, detected)) = first_failure {
                        record(&requests.catalog.recoveries, failed_node, detected);
                    }
                    failed.extend(parts.into_iter().map(Ok));
                    return Ok(stream::iter(failed).boxed());
                }
                Err(error) if as_corrupt_replica(&error).is_some() => {
                    // The node is healthy (not marked failed, no recovery
                    // recorded); only its copy of this slice is not.
                    drop(in_flight);
                    log::warn!(
                        "slice {} of {}: {error}; trying another replica",
                        slice.summary.slice,
                        requests.table
                    );
                    failures.push(error.to_string());
                    failed.push(Ok(SlicePart::Failed {
                        node: client.url().to_string(),
                        reason: error.to_string(),
                    }));
                }
                Err(error) if as_node_failure(&error).is_some() => {
                    drop(in_flight);
                    first_failure.get_or_insert((node, Instant::now()));
                    requests.catalog.mark_failed(node);
                    log::warn!(
                        "slice {} of {}: {error}; trying another replica",
                        slice.summary.slice,
                        requests.table
                    );
                    failures.push(error.to_string());
                    failed.push(Ok(SlicePart::Failed {
                        node: client.url().to_string(),
                        reason: error.to_string(),
                    }));
                }
                Err(error) => return Err(error),
            }
        }
        unreachable!("the last attempt always returns")
    })
    .try_flatten()
    .boxed()
}

fn record(recoveries: &Mutex<Vec<Recovery>>, failed_node: usize, detected: Instant) {
    recoveries.lock().expect("never poisoned").push(Recovery {
        failed_node,
        detected,
        recovered: Instant::now(),
    });
}

fn every_replica_failed(
    table: &str,
    slice: u32,
    replicas: usize,
    failures: &[String],
) -> DataFusionError {
    DataFusionError::Execution(format!(
        "slice {slice} of table '{table}' could not be read: {} of its {replicas} replica(s) tried, every one failed: {}",
        failures.len(),
        failures.join("; ")
    ))
}
