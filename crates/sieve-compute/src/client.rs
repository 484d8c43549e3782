//! A compute node's connection to one storage node.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use arrow::datatypes::{Schema, SchemaRef};
use arrow::record_batch::RecordBatch;
use arrow_flight::decode::FlightRecordBatchStream;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::{Criteria, FlightData, Ticket};
use datafusion::common::{exec_datafusion_err, DataFusionError, Result};
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use prost::Message;
use sieve_format::SliceSummary;
use sieve_fragment::SliceMetrics;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use crate::Traffic;

/// Upper bound on one Flight message accepted from a storage node.
const FLIGHT_MESSAGE_BYTES_MAX: usize = 64 * 1024 * 1024;
/// How long to wait for a TCP connection to a storage node.
const CONNECT_TIMEOUT_MS: u64 = 5_000;

/// A table as one storage node describes it.
#[derive(Debug, Clone)]
pub(crate) struct NodeTable {
    pub(crate) name: String,
    pub(crate) schema: SchemaRef,
    /// Each slice with the URL of its byte-range endpoint.
    pub(crate) slices: Vec<(SliceSummary, String)>,
}

/// One piece of a streamed slice.
#[derive(Debug)]
pub enum SlicePart {
    /// Rows, as the storage node produced them.
    Batch(RecordBatch),
    /// The slice is complete: what the node did, and the bytes it shipped.
    Done {
        /// The node's metrics for the slice.
        metrics: SliceMetrics,
        /// Bytes of Flight messages received for the slice.
        bytes_shipped: u64,
    },
}

/// What one slice request returned, collected.
#[derive(Debug)]
pub struct SliceResult {
    /// The slice's batches, after the fragment.
    pub batches: Vec<RecordBatch>,
    /// What the storage node reported doing.
    pub metrics: SliceMetrics,
    /// Bytes of Flight messages received for this slice.
    pub bytes_shipped: u64,
}

/// A Flight client for one storage node.
#[derive(Debug, Clone)]
pub struct StorageClient {
    url: String,
    client: FlightServiceClient<Channel>,
}

impl StorageClient {
    /// Connect to the storage node at `url` (e.g. `http://127.0.0.1:50051`).
    pub async fn connect(url: &str) -> Result<Self> {
        let endpoint = Endpoint::from_shared(url.to_string())
            .map_err(|error| {
                DataFusionError::Plan(format!("invalid storage node address '{url}': {error}"))
            })?
            .connect_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS))
            .tcp_nodelay(true);
        let channel = endpoint.connect().await.map_err(|error| {
            exec_datafusion_err!("cannot connect to storage node {url}: {error}")
        })?;
        let client = FlightServiceClient::new(channel)
            .max_decoding_message_size(FLIGHT_MESSAGE_BYTES_MAX)
            .max_encoding_message_size(FLIGHT_MESSAGE_BYTES_MAX);
        Ok(Self {
            url: url.to_string(),
            client,
        })
    }

    /// The node's address.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The node's running totals (the `stats` Flight action): slices
    /// served, fragment bytes read, rows scanned and returned, byte-range
    /// bytes served.
    pub async fn stats(&self) -> Result<serde_json::Value> {
        let mut client = self.client.clone();
        let action = arrow_flight::Action::new("stats", "");
        let mut results = client
            .do_action(action)
            .await
            .map_err(|status| exec_datafusion_err!("stats from {}: {status}", self.url))?
            .into_inner();
        let Some(result) = results
            .message()
            .await
            .map_err(|status| exec_datafusion_err!("stats from {}: {status}", self.url))?
        else {
            return Err(exec_datafusion_err!(
                "stats from {}: empty answer",
                self.url
            ));
        };
        serde_json::from_slice(&result.body)
            .map_err(|error| exec_datafusion_err!("stats from {}: {error}", self.url))
    }

    /// The tables this node holds (Flight `ListFlights`).
    pub(crate) async fn list_tables(&self) -> Result<Vec<NodeTable>> {
        let mut client = self.client.clone();
        let mut infos = client
            .list_flights(Criteria::default())
            .await
            .map_err(|status| self.status_error(status))?
            .into_inner();
        let mut tables = Vec::new();
        while let Some(info) = infos
            .message()
            .await
            .map_err(|status| self.status_error(status))?
        {
            let schema: Schema = info.clone().try_decode_schema().map_err(|error| {
                exec_datafusion_err!("storage node {} sent a bad schema: {error}", self.url)
            })?;
            let name = info
                .flight_descriptor
                .as_ref()
                .and_then(|descriptor| descriptor.path.first().cloned())
                .ok_or_else(|| {
                    exec_datafusion_err!("storage node {} sent a table without a name", self.url)
                })?;
            let mut slices = Vec::new();
            for endpoint in &info.endpoint {
                let summary: SliceSummary = serde_json::from_slice(&endpoint.app_metadata)
                    .map_err(|error| {
                        exec_datafusion_err!(
                            "storage node {} sent a bad slice summary: {error}",
                            self.url
                        )
                    })?;
                let location = endpoint
                    .location
                    .first()
                    .map(|location| location.uri.clone())
                    .unwrap_or_default();
                slices.push((summary, location));
            }
            tables.push(NodeTable {
                name,
                schema: Arc::new(schema),
                slices,
            });
        }
        Ok(tables)
    }

    /// Run one fragment envelope against its slice and collect the result.
    /// The whole slice is collected before any of it is returned, so a
    /// failure mid-stream never leaves part of a slice counted.
    pub async fn fetch_slice(
        &self,
        envelope: Vec<u8>,
        traffic: &Arc<Traffic>,
    ) -> Result<SliceResult> {
        let mut parts = self.stream_slice(envelope, Arc::clone(traffic));
        let mut batches = Vec::new();
        while let Some(part) = parts.next().await {
            match part? {
                SlicePart::Batch(batch) => batches.push(batch),
                SlicePart::Done {
                    metrics,
                    bytes_shipped,
                } => {
                    return Ok(SliceResult {
                        batches,
                        metrics,
                        bytes_shipped,
                    })
                }
            }
        }
        Err(exec_datafusion_err!(
            "storage node {} ended a slice stream without its metrics",
            self.url
        ))
    }

    /// Run one fragment envelope against its slice and stream the result as
    /// it arrives: batches, then one [`SlicePart::Done`] with the node's
    /// metrics. A stream that ends without `Done`, or with an error, means the
    /// slice failed; what it yielded before is part of a failed query.
    pub fn stream_slice(
        &self,
        envelope: Vec<u8>,
        traffic: Arc<Traffic>,
    ) -> BoxStream<'static, Result<SlicePart>> {
        let this = self.clone();
        futures::stream::once(async move {
            traffic.add_slice_request();
            let mut client = this.client.clone();
            let response = client
                .do_get(Ticket::new(envelope))
                .await
                .map_err(|status| this.status_error(status))?
                .into_inner();
            let trailer: Arc<Mutex<Option<SliceMetrics>>> = Arc::new(Mutex::new(None));
            let shipped = Arc::new(std::sync::atomic::AtomicU64::new(0));
            let (trailer_in, shipped_in) = (Arc::clone(&trailer), Arc::clone(&shipped));
            let messages = response
                .map_err(|status| FlightError::Tonic(Box::new(status)))
                .try_filter_map(move |message: FlightData| {
                    let size = (message.data_header.len()
                        + message.data_body.len()
                        + message.app_metadata.len()) as u64;
                    shipped_in.fetch_add(size, std::sync::atomic::Ordering::Relaxed);
                    let result =
                        if message.data_header.is_empty() && !message.app_metadata.is_empty() {
                            match SliceMetrics::decode(message.app_metadata.as_ref()) {
                                Ok(metrics) => {
                                    *trailer_in.lock().expect("trailer lock is never poisoned") =
                                        Some(metrics);
                                    Ok(None)
                                }
                                Err(error) => Err(FlightError::DecodeError(format!(
                                    "bad slice metrics: {error}"
                                ))),
                            }
                        } else {
                            Ok(Some(message))
                        };
                    futures::future::ready(result)
                });
            let decoded = FlightRecordBatchStream::new_from_flight_data(messages);
            let for_errors = this.clone();
            let batches = decoded.map(move |batch| {
                batch
                    .map(SlicePart::Batch)
                    .map_err(|error| for_errors.flight_error(error))
            });
            let done = futures::stream::once(async move {
                let bytes_shipped = shipped.load(std::sync::atomic::Ordering::Relaxed);
                traffic.add_flight_bytes(bytes_shipped);
                let metrics = trailer
                    .lock()
                    .expect("trailer lock is never poisoned")
                    .take()
                    .ok_or_else(|| {
                        exec_datafusion_err!(
                            "storage node {} ended a slice stream without its metrics",
                            this.url
                        )
                    })?;
                Ok(SlicePart::Done {
                    metrics,
                    bytes_shipped,
                })
            });
            Ok::<_, DataFusionError>(batches.chain(done))
        })
        .try_flatten()
        .boxed()
    }

    fn flight_error(&self, error: FlightError) -> DataFusionError {
        match error {
            FlightError::Tonic(status) => self.status_error(*status),
            other => exec_datafusion_err!("storage node {}: {other}", self.url),
        }
    }

    /// Map a gRPC status back to the DataFusion error kind it came from.
    fn status_error(&self, status: Status) -> DataFusionError {
        let message = format!("storage node {}: {}", self.url, status.message());
        match status.code() {
            Code::InvalidArgument | Code::NotFound => DataFusionError::Plan(message),
            Code::ResourceExhausted => DataFusionError::ResourcesExhausted(message),
            _ => DataFusionError::Execution(message),
        }
    }
}
