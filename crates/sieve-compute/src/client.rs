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
use sieve_fragment::{
    DataError, SliceMessage, SliceMessageKind, SliceMetrics, CORRUPT_FILE_METADATA,
    CORRUPT_SLICE_KIND, ERROR_KIND_METADATA,
};
use sieve_fragment::{
    Secret, AUTHORIZATION_HEADER, REGISTER_JOIN_FILTER_ACTION, RELEASE_JOIN_FILTER_ACTION,
};
use tonic::metadata::AsciiMetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use crate::raw::RawPages;
use crate::Traffic;

/// Upper bound on one Flight message accepted from a storage node.
const FLIGHT_MESSAGE_BYTES_MAX: usize = 64 * 1024 * 1024;

/// Bytes of a slice file per `DoPut` message.
const PUT_CHUNK_BYTES: usize = 1024 * 1024;

/// The messages of a `DoPut`, as the channel's receiver yields them.
fn tokio_stream_of(
    mut receiver: tokio::sync::mpsc::Receiver<FlightData>,
) -> impl futures::Stream<Item = FlightData> + Send + 'static {
    futures::stream::poll_fn(move |context| receiver.poll_recv(context))
}
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

/// A slice attempt failed because of its storage node (down, hung, cut off
/// mid-stream, lost the slice, failed while executing), not because of the
/// request: another replica may serve it.
#[derive(Debug)]
pub struct NodeFailure {
    /// The node's address.
    pub node: String,
    /// What went wrong.
    pub reason: String,
}

impl std::fmt::Display for NodeFailure {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "storage node {}: {}", self.node, self.reason)
    }
}

impl std::error::Error for NodeFailure {}

fn node_failure(node: &str, reason: impl Into<String>) -> DataFusionError {
    DataFusionError::External(Box::new(NodeFailure {
        node: node.to_string(),
        reason: reason.into(),
    }))
}

/// The node failure behind `error`, if that is what it is.
pub fn as_node_failure(error: &DataFusionError) -> Option<&NodeFailure> {
    match error {
        DataFusionError::External(inner) => inner.downcast_ref::<NodeFailure>(),
        DataFusionError::Context(_, inner) => as_node_failure(inner),
        DataFusionError::Shared(inner) => as_node_failure(inner),
        _ => None,
    }
}

/// A slice attempt failed because the storage node's copy of the slice is
/// damaged (a page failed its checksum): another replica may hold a good
/// copy, and the node itself is healthy, so it is not marked failed.
#[derive(Debug)]
pub struct CorruptReplica {
    /// The node's address.
    pub node: String,
    /// The damaged slice file, as the node names it.
    pub file: String,
    /// The node's message.
    pub reason: String,
}

impl std::fmt::Display for CorruptReplica {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "storage node {}: {}", self.node, self.reason)
    }
}

impl std::error::Error for CorruptReplica {}

/// The damaged replica behind `error`, if that is what it is.
pub fn as_corrupt_replica(error: &DataFusionError) -> Option<&CorruptReplica> {
    match error {
        DataFusionError::External(inner) => inner.downcast_ref::<CorruptReplica>(),
        DataFusionError::Context(_, inner) => as_corrupt_replica(inner),
        DataFusionError::Shared(inner) => as_corrupt_replica(inner),
        _ => None,
    }
}

/// HTTP/2 flow-control window of one slice stream: what a node may send
/// ahead of a reader that is not reading (the bound on a slice's buffered
/// bytes on this side).
pub const SLICE_STREAM_WINDOW_BYTES: u32 = 2 * 1024 * 1024;

/// HTTP/2 flow-control window of a whole connection to a node, shared by all
/// its slice streams. hyper's default (5 MB) let three streams whose readers
/// paused (a hash join's probe side while its build side runs) hold the
/// whole window, so a fourth stream on the same connection, read eagerly,
/// got nothing and was taken for a silent node (TPC-H Q15 at SF 100). The
/// connection window is therefore no bound: each stream's window is
/// ([`SLICE_STREAM_WINDOW_BYTES`] times the streams open).
pub const CONNECTION_WINDOW_BYTES: u32 = (1 << 31) - 1;

/// `stream`, failing with `error()` when no item comes within `timeout`.
fn with_idle_timeout<T: Send + 'static, E: Send + 'static>(
    stream: impl futures::Stream<Item = std::result::Result<T, E>> + Send + 'static,
    timeout: Duration,
    error: impl Fn() -> E + Send + 'static,
) -> BoxStream<'static, std::result::Result<T, E>> {
    futures::stream::unfold(
        (Some(stream.boxed()), error),
        move |(stream, error)| async move {
            let mut stream = stream?;
            match tokio::time::timeout(timeout, stream.next()).await {
                Ok(Some(item)) => Some((item, (Some(stream), error))),
                Ok(None) => None,
                Err(_) => Some((Err(error()), (None, error))),
            }
        },
    )
    .boxed()
}

/// One piece of a streamed slice.
#[derive(Debug)]
pub enum SlicePart {
    /// Rows, as the storage node produced them.
    Batch(RecordBatch),
    /// The slice's pages as stored: the node was busy, the fragment is
    /// still to be run (see [`crate::raw::complete_raw`]).
    Raw(RawPages),
    /// An attempt on one replica failed; what it yielded was dropped and
    /// the parts that follow come from another replica.
    Failed {
        /// The node that failed.
        node: String,
        /// How it failed.
        reason: String,
    },
    /// The slice is complete: what the node did, and the bytes it shipped.
    Done {
        /// The node's metrics for the slice.
        metrics: SliceMetrics,
        /// Bytes of Flight messages received for the slice.
        bytes_shipped: u64,
    },
}

/// Adds `authorization: Bearer <secret>` to every Flight call, when there
/// is a secret.
#[derive(Clone, Default)]
pub struct BearerAuth {
    header: Option<AsciiMetadataValue>,
}

impl BearerAuth {
    /// Calls carrying `secret`, or no credential for `None`.
    pub fn new(secret: Option<&Secret>) -> Result<Self> {
        let header = secret
            .map(|secret| {
                secret.bearer().parse::<AsciiMetadataValue>().map_err(|_| {
                    DataFusionError::Plan("the storage secret cannot be sent as a header".into())
                })
            })
            .transpose()?;
        Ok(Self { header })
    }
}

impl std::fmt::Debug for BearerAuth {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = if self.header.is_some() {
            "Bearer (redacted)"
        } else {
            "none"
        };
        write!(formatter, "BearerAuth({state})")
    }
}

impl tonic::service::Interceptor for BearerAuth {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> std::result::Result<tonic::Request<()>, Status> {
        if let Some(header) = &self.header {
            request
                .metadata_mut()
                .insert(AUTHORIZATION_HEADER, header.clone());
        }
        Ok(request)
    }
}

/// A raw Flight client that authenticates every call.
pub type AuthenticatedFlightClient = FlightServiceClient<InterceptedService<Channel, BearerAuth>>;

/// A Flight client for one storage node.
#[derive(Debug, Clone)]
pub struct StorageClient {
    url: String,
    client: AuthenticatedFlightClient,
}

impl StorageClient {
    /// Connect to the storage node at `url` (e.g. `http://127.0.0.1:50051`),
    /// sending `secret` with every call (`None`: a node without one).
    pub async fn connect(url: &str, secret: Option<&Secret>) -> Result<Self> {
        Self::connect_within(url, secret, Duration::from_millis(CONNECT_TIMEOUT_MS)).await
    }

    /// Like [`Self::connect`], giving up after `timeout`: on the TCP
    /// connection, and on the whole connection (a hung node accepts TCP
    /// connections in its kernel but never completes the HTTP/2 handshake).
    pub async fn connect_within(
        url: &str,
        secret: Option<&Secret>,
        timeout: Duration,
    ) -> Result<Self> {
        let endpoint = Self::endpoint(url)?.connect_timeout(timeout);
        let channel = tokio::time::timeout(timeout, endpoint.connect())
            .await
            .map_err(|_| {
                exec_datafusion_err!(
                    "cannot connect to storage node {url}: no connection within {} ms",
                    timeout.as_millis()
                )
            })?
            .map_err(|error| {
                exec_datafusion_err!("cannot connect to storage node {url}: {error}")
            })?;
        Self::over(url, secret, channel)
    }

    /// A client for `url` that connects on first use: for a node that was
    /// down when the catalog was made.
    pub fn lazy(url: &str, secret: Option<&Secret>) -> Result<Self> {
        let endpoint =
            Self::endpoint(url)?.connect_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS));
        Self::over(url, secret, endpoint.connect_lazy())
    }

    fn endpoint(url: &str) -> Result<Endpoint> {
        Ok(Endpoint::from_shared(url.to_string())
            .map_err(|error| {
                DataFusionError::Plan(format!("invalid storage node address '{url}': {error}"))
            })?
            .tcp_nodelay(true)
            .initial_stream_window_size(SLICE_STREAM_WINDOW_BYTES)
            .initial_connection_window_size(CONNECTION_WINDOW_BYTES))
    }

    fn over(url: &str, secret: Option<&Secret>, channel: Channel) -> Result<Self> {
        let client = FlightServiceClient::with_interceptor(channel, BearerAuth::new(secret)?)
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

    /// Register a join filter (an encoded
    /// [`sieve_fragment::JoinFilterRegistration`] with id `id`) on this node,
    /// within `timeout`.
    pub async fn register_join_filter(
        &self,
        registration: Vec<u8>,
        id: &[u8],
        timeout: Duration,
    ) -> Result<()> {
        self.register(
            REGISTER_JOIN_FILTER_ACTION,
            "join filter",
            registration,
            id,
            timeout,
        )
        .await
    }

    /// Release one registration of the join filter `id` on this node.
    pub async fn release_join_filter(&self, id: &[u8], timeout: Duration) -> Result<()> {
        self.release(RELEASE_JOIN_FILTER_ACTION, "join filter", id, timeout)
            .await
    }

    /// Register a fragment body (a compressed
    /// [`sieve_fragment::FragmentBodyRegistration`] with id `id`) on this
    /// node, within `timeout`.
    pub async fn register_fragment_body(
        &self,
        registration: Vec<u8>,
        id: &[u8],
        timeout: Duration,
    ) -> Result<()> {
        self.register(
            sieve_fragment::REGISTER_FRAGMENT_BODY_ACTION,
            "fragment body",
            registration,
            id,
            timeout,
        )
        .await
    }

    /// Release one registration of the fragment body `id` on this node.
    pub async fn release_fragment_body(&self, id: &[u8], timeout: Duration) -> Result<()> {
        self.release(
            sieve_fragment::RELEASE_FRAGMENT_BODY_ACTION,
            "fragment body",
            id,
            timeout,
        )
        .await
    }

    async fn register(
        &self,
        action: &str,
        what: &str,
        registration: Vec<u8>,
        id: &[u8],
        timeout: Duration,
    ) -> Result<()> {
        let mut client = self.client.clone();
        let action = arrow_flight::Action::new(action, registration);
        let answer = tokio::time::timeout(timeout, async {
            let mut results = client.do_action(action).await?.into_inner();
            results.message().await
        })
        .await
        .map_err(|_| {
            exec_datafusion_err!(
                "{what} registration on {}: no answer within {} ms",
                self.url,
                timeout.as_millis()
            )
        })?
        .map_err(|status| exec_datafusion_err!("{what} registration on {}: {status}", self.url))?;
        match answer {
            Some(result) if result.body.as_ref() == id => Ok(()),
            _ => Err(exec_datafusion_err!(
                "{what} registration on {}: the node answered another id",
                self.url
            )),
        }
    }

    async fn release(&self, action: &str, what: &str, id: &[u8], timeout: Duration) -> Result<()> {
        let mut client = self.client.clone();
        let action = arrow_flight::Action::new(action, id.to_vec());
        tokio::time::timeout(timeout, async {
            let mut results = client.do_action(action).await?.into_inner();
            results.message().await
        })
        .await
        .map_err(|_| exec_datafusion_err!("{what} release on {}: no answer", self.url))?
        .map_err(|status| exec_datafusion_err!("{what} release on {}: {status}", self.url))?;
        Ok(())
    }

    /// Send the slice file at `path` (a table a user owns, storage name
    /// `table`) to this node (Flight `DoPut`, [`sieve_format::writes::PutSlice`]);
    /// the node writes, syncs and serves it, and answers its summary.
    pub async fn put_slice(
        &self,
        table: &str,
        slice: u32,
        path: &std::path::Path,
    ) -> Result<SliceSummary> {
        use tokio::io::AsyncReadExt;
        let bytes = tokio::fs::metadata(path).await?.len();
        let crc32 = {
            let path = path.to_path_buf();
            tokio::task::spawn_blocking(move || -> std::io::Result<u32> {
                use std::io::Read;
                let mut file = std::fs::File::open(path)?;
                let mut hasher = crc32fast::Hasher::new();
                let mut buffer = vec![0u8; PUT_CHUNK_BYTES];
                loop {
                    let read = file.read(&mut buffer)?;
                    if read == 0 {
                        return Ok(hasher.finalize());
                    }
                    hasher.update(&buffer[..read]);
                }
            })
            .await
            .map_err(|error| DataFusionError::External(Box::new(error)))??
        };
        let header = sieve_format::writes::PutSlice {
            table: table.to_string(),
            slice,
            bytes,
            crc32,
        };
        let header = serde_json::to_vec(&header).expect("a header is JSON");
        let mut file = tokio::fs::File::open(path).await?;
        let (sender, receiver) = tokio::sync::mpsc::channel::<FlightData>(2);
        let reader = async move {
            let mut first = true;
            loop {
                let mut chunk = vec![0u8; PUT_CHUNK_BYTES];
                let mut filled = 0;
                while filled < chunk.len() {
                    let read = file.read(&mut chunk[filled..]).await?;
                    if read == 0 {
                        break;
                    }
                    filled += read;
                }
                chunk.truncate(filled);
                if filled == 0 && !first {
                    return Ok::<(), std::io::Error>(());
                }
                let mut message = FlightData::new().with_data_body(chunk);
                if first {
                    message = message
                        .with_descriptor(arrow_flight::FlightDescriptor::new_cmd(header.clone()));
                    first = false;
                }
                if sender.send(message).await.is_err() || filled == 0 {
                    return Ok(());
                }
            }
        };
        let mut client = self.client.clone();
        let request = client.do_put(tokio_stream_of(receiver));
        let (read, answer) = futures::join!(reader, request);
        read?;
        let mut results = answer
            .map_err(|status| self.write_error("put", status))?
            .into_inner();
        let result = results
            .message()
            .await
            .map_err(|status| self.write_error("put", status))?
            .ok_or_else(|| exec_datafusion_err!("put on {}: no answer", self.url))?;
        serde_json::from_slice(&result.app_metadata)
            .map_err(|error| exec_datafusion_err!("put on {}: a bad summary: {error}", self.url))
    }

    /// Run a slice action ([`sieve_format::writes::REMOVE_SLICES_ACTION`] or
    /// [`sieve_format::writes::RETAIN_SLICES_ACTION`]) with a JSON body;
    /// answers the number of slices the node removed.
    pub async fn slice_action(&self, action: &str, body: Vec<u8>) -> Result<usize> {
        let mut client = self.client.clone();
        let mut results = client
            .do_action(arrow_flight::Action::new(action.to_string(), body))
            .await
            .map_err(|status| self.write_error(action, status))?
            .into_inner();
        let result = results
            .message()
            .await
            .map_err(|status| self.write_error(action, status))?
            .ok_or_else(|| exec_datafusion_err!("{action} on {}: no answer", self.url))?;
        Ok(std::str::from_utf8(&result.body)
            .ok()
            .and_then(|text| text.parse().ok())
            .unwrap_or(0))
    }

    fn write_error(&self, doing: &str, status: tonic::Status) -> DataFusionError {
        let message = format!("{doing} on storage node {}: {}", self.url, status.message());
        match status.code() {
            tonic::Code::ResourceExhausted => DataFusionError::ResourcesExhausted(message),
            tonic::Code::InvalidArgument | tonic::Code::AlreadyExists => {
                DataFusionError::Plan(message)
            }
            // The node is down, unreachable or gone mid-request: another
            // node may take the write.
            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Cancelled => {
                node_failure(&self.url, format!("{doing}: {}", status.message()))
            }
            _ => DataFusionError::Execution(message),
        }
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

    /// Run one fragment envelope against its slice and stream the result as
    /// it arrives: batches (or the slice's raw pages, if the node was busy),
    /// then one [`SlicePart::Done`] with the node's metrics. A stream that
    /// ends without `Done`, with an error, or that stays silent longer than
    /// `timeout`, means the slice failed on this node; what it yielded before
    /// is not to be used.
    pub fn stream_slice(
        &self,
        envelope: Vec<u8>,
        traffic: Arc<Traffic>,
        timeout: Duration,
    ) -> BoxStream<'static, Result<SlicePart>> {
        let this = self.clone();
        let silent = move |what: &str| {
            node_failure(
                &this.url,
                format!("no {what} within {} ms", timeout.as_millis()),
            )
        };
        let this = self.clone();
        let started = futures::stream::once(async move {
            traffic.add_slice_request(envelope.len() as u64);
            let mut client = this.client.clone();
            let response = tokio::time::timeout(timeout, client.do_get(Ticket::new(envelope)))
                .await
                .map_err(|_| silent("answer"))?
                .map_err(|status| this.status_error(status))?
                .into_inner();
            let messages = with_idle_timeout(
                response.map_err(|status| FlightError::Tonic(Box::new(status))),
                timeout,
                move || {
                    FlightError::Tonic(Box::new(Status::deadline_exceeded(format!(
                        "no message within {} ms",
                        timeout.as_millis()
                    ))))
                },
            );
            Ok::<_, DataFusionError>(this.parts(messages, traffic))
        })
        .try_flatten();
        started.boxed()
    }

    /// Turn a slice's Flight messages into its parts.
    fn parts(
        &self,
        messages: BoxStream<'static, std::result::Result<FlightData, FlightError>>,
        traffic: Arc<Traffic>,
    ) -> BoxStream<'static, Result<SlicePart>> {
        let trailer: Arc<Mutex<Option<SliceMetrics>>> = Arc::new(Mutex::new(None));
        let raw: Arc<Mutex<Option<RawPages>>> = Arc::new(Mutex::new(None));
        let shipped = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (trailer_in, shipped_in, raw_in) =
            (Arc::clone(&trailer), Arc::clone(&shipped), Arc::clone(&raw));
        // Counted as each message arrives, so a stream that fails or is
        // dropped midway still counts what crossed the link.
        let traffic_in = Arc::clone(&traffic);
        let messages = messages.try_filter_map(move |message: FlightData| {
            let size = (message.data_header.len()
                + message.data_body.len()
                + message.app_metadata.len()) as u64;
            shipped_in.fetch_add(size, std::sync::atomic::Ordering::Relaxed);
            traffic_in.add_flight_bytes(size);
            if !message.data_header.is_empty() || message.app_metadata.is_empty() {
                return futures::future::ready(Ok(Some(message)));
            }
            let result = match SliceMessage::decode(message.app_metadata.as_ref()) {
                Ok(SliceMessage {
                    kind: Some(SliceMessageKind::Metrics(metrics)),
                }) => {
                    *trailer_in.lock().expect("never poisoned") = Some(metrics);
                    Ok(None)
                }
                Ok(SliceMessage {
                    kind: Some(SliceMessageKind::Raw(head)),
                }) => {
                    *raw_in.lock().expect("never poisoned") = Some(RawPages {
                        head,
                        chunks: Vec::new(),
                    });
                    Ok(None)
                }
                Ok(SliceMessage {
                    kind: Some(SliceMessageKind::RawChunk(offset)),
                }) => match raw_in.lock().expect("never poisoned").as_mut() {
                    Some(pages) => {
                        pages.chunks.push((offset, message.data_body));
                        Ok(None)
                    }
                    None => Err(FlightError::DecodeError(
                        "raw pages before the raw slice head".to_string(),
                    )),
                },
                // The node is still working on the slice: its arrival
                // reset the silence timeout, nothing more to do.
                Ok(SliceMessage {
                    kind: Some(SliceMessageKind::Heartbeat(_)),
                }) => Ok(None),
                Ok(SliceMessage { kind: None }) => Err(FlightError::DecodeError(
                    "slice message of an unknown kind".to_string(),
                )),
                Err(error) => Err(FlightError::DecodeError(format!(
                    "bad slice message: {error}"
                ))),
            };
            futures::future::ready(result)
        });
        // A malformed IPC stream from a node is that node's failure, even
        // if the decoder panics on it.
        let decoded =
            std::panic::AssertUnwindSafe(FlightRecordBatchStream::new_from_flight_data(messages))
                .catch_unwind()
                .map(|polled| {
                    polled.unwrap_or_else(|_| {
                        Err(FlightError::DecodeError(
                            "the slice stream could not be decoded (decoder panicked)".to_string(),
                        ))
                    })
                });
        let for_errors = self.clone();
        let batches = decoded.map(move |batch| {
            batch
                .map(SlicePart::Batch)
                .map_err(|error| for_errors.flight_error(error))
        });
        let url = self.url.clone();
        let done = futures::stream::once(async move {
            let bytes_shipped = shipped.load(std::sync::atomic::Ordering::Relaxed);
            let metrics = trailer
                .lock()
                .expect("never poisoned")
                .take()
                .ok_or_else(|| node_failure(&url, "ended a slice stream without its metrics"))?;
            let raw = raw.lock().expect("never poisoned").take();
            let mut parts = Vec::with_capacity(2);
            if let Some(pages) = raw {
                parts.push(Ok(SlicePart::Raw(pages)));
            }
            parts.push(Ok(SlicePart::Done {
                metrics,
                bytes_shipped,
            }));
            Ok::<_, DataFusionError>(futures::stream::iter(parts))
        })
        .try_flatten();
        batches.chain(done).boxed()
    }

    fn flight_error(&self, error: FlightError) -> DataFusionError {
        match error {
            FlightError::Tonic(status) => self.status_error(*status),
            other => node_failure(&self.url, other.to_string()),
        }
    }

    /// Map a gRPC status back to the DataFusion error kind it came from. A
    /// refused request (`InvalidArgument`) is the request's fault and would
    /// be refused by any replica; an error of the query's data
    /// (`FailedPrecondition` naming a [`DataError`]) would fail on every
    /// replica too, and comes back as the error it was on the node;
    /// a damaged copy of the slice (`DataLoss`, [`CORRUPT_SLICE_KIND`]) is
    /// that copy's ([`CorruptReplica`]); anything else is the node's
    /// ([`NodeFailure`]), and another replica may do better.
    fn status_error(&self, status: Status) -> DataFusionError {
        let data_error = status
            .metadata()
            .get(ERROR_KIND_METADATA)
            .and_then(|value| value.to_str().ok())
            .and_then(DataError::from_name);
        let kind = status
            .metadata()
            .get(ERROR_KIND_METADATA)
            .and_then(|value| value.to_str().ok());
        if status.code() == Code::FailedPrecondition
            && kind == Some(sieve_fragment::BODY_NOT_HELD_KIND)
        {
            return sieve_fragment::BodyNotHeld {
                message: format!("storage node {}: {}", self.url, status.message()),
            }
            .into_error();
        }
        if status.code() == Code::DataLoss && kind == Some(CORRUPT_SLICE_KIND) {
            let file = status
                .metadata()
                .get(CORRUPT_FILE_METADATA)
                .and_then(|value| value.to_str().ok())
                .unwrap_or_default()
                .to_string();
            log::warn!(
                "storage node {}: corrupt copy of {file}: {}",
                self.url,
                status.message()
            );
            return DataFusionError::External(Box::new(CorruptReplica {
                node: self.url.clone(),
                file,
                reason: status.message().to_string(),
            }));
        }
        match (status.code(), data_error) {
            // A refused credential is the user's to fix, not the node's
            // failure: every replica holds the same secret, so no retry.
            (Code::InvalidArgument | Code::Unauthenticated, _) => {
                DataFusionError::Plan(format!("storage node {}: {}", self.url, status.message()))
            }
            (Code::FailedPrecondition, Some(data_error)) => {
                log::debug!(
                    "storage node {}: data error: {}",
                    self.url,
                    status.message()
                );
                data_error.rebuild(status.message().to_string())
            }
            (code, _) => node_failure(&self.url, format!("{code:?}: {}", status.message())),
        }
    }
}
