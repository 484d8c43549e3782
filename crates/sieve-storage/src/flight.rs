//! The Arrow Flight face of a storage node.
//!
//! `ListFlights` describes the catalog: one `FlightInfo` per table, carrying
//! the Arrow schema, and one endpoint per slice whose `app_metadata` is the
//! slice's JSON [`sieve_format::SliceSummary`] and whose location is the
//! slice's byte-range URL. `DoGet` takes an encoded
//! [`sieve_fragment::FragmentEnvelope`] as its ticket and streams the slice's
//! batches (Arrow IPC, in the codec asked for), followed by one body-less
//! message whose `app_metadata` is a [`sieve_fragment::SliceMessage`] with the
//! slice's metrics. The fragment runs on the pushdown pool when a worker is
//! free in time; otherwise the slice is served raw (`raw.rs`).
//!
//! Errors keep their kind across the wire: a bad request is
//! `InvalidArgument`, an unknown table or slice is `NotFound`, an error of
//! the query's data (a failing cast, a division by zero) is
//! `FailedPrecondition` with its kind in metadata
//! ([`sieve_fragment::ERROR_KIND_METADATA`]), any other failure while
//! executing is `Internal`, and a slice whose copy here fails its page
//! checksums is `DataLoss` naming the file. A panic while executing a fragment is caught
//! and sent as `Internal`; it never takes the node down.

use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use arrow::ipc::writer::IpcWriteOptions;
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_server::FlightService;
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightEndpoint, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaResult, Ticket,
};
use datafusion::common::DataFusionError;
use datafusion::physical_plan::ExecutionPlan;
use futures::stream;
use futures::{FutureExt, Stream, StreamExt};
use prost::Message;
use sieve_format::writes::{REMOVE_SLICES_ACTION, RETAIN_SLICES_ACTION};
use sieve_fragment::{
    classify_error, join_filter_id, ErrorKind, FragmentEnvelope, IpcCodec, SliceMessage,
    SliceMessageKind, SliceMetrics, CORRUPT_FILE_METADATA, CORRUPT_SLICE_KIND, ERROR_KIND_METADATA,
    REGISTER_FRAGMENT_BODY_ACTION, REGISTER_JOIN_FILTER_ACTION, RELEASE_FRAGMENT_BODY_ACTION,
    RELEASE_JOIN_FILTER_ACTION,
};
use tonic::{Request, Response, Status, Streaming};

use crate::execute::{work_done, Admitted};
use crate::faults::Faults;
use crate::pool::{Admission, PushdownPool};
use crate::raw::{plan_raw, raw_stream, RAW_ASKED};
use crate::SliceExecutor;

/// The Flight action that returns a node's counters ([`crate::NodeCounters`]) as JSON.
pub const STATS_ACTION: &str = "stats";

/// The Flight service of one storage node.
#[derive(Debug, Clone)]
pub struct StorageFlightService {
    executor: Arc<SliceExecutor>,
    pool: Arc<PushdownPool>,
    faults: Arc<Faults>,
    range_base_url: String,
    codec_choices: Arc<CodecChoices>,
    /// Turns for slice puts ([`crate::ingest::PUTS_IN_FLIGHT_MAX`]).
    puts: Arc<tokio::sync::Semaphore>,
}

impl StorageFlightService {
    /// A service over `executor`, running fragments on `pool`; slice files
    /// are announced at `range_base_url` (e.g. `http://127.0.0.1:8080`).
    pub fn new(
        executor: Arc<SliceExecutor>,
        pool: Arc<PushdownPool>,
        faults: Arc<Faults>,
        range_base_url: String,
    ) -> Self {
        Self {
            executor,
            pool,
            faults,
            range_base_url,
            codec_choices: Arc::default(),
            puts: Arc::new(tokio::sync::Semaphore::new(
                crate::ingest::PUTS_IN_FLIGHT_MAX,
            )),
        }
    }

    fn flight_infos(&self) -> Result<Vec<FlightInfo>, Status> {
        let catalog = self.executor.catalog();
        let mut infos = Vec::new();
        for (name, table) in catalog.tables().iter() {
            let mut info = FlightInfo::new()
                .try_with_schema(&table.schema)
                .map_err(|error| Status::internal(error.to_string()))?
                .with_descriptor(FlightDescriptor::new_path(vec![name.clone()]));
            let (mut rows, mut bytes) = (0u64, 0u64);
            for slice in table.slices.values() {
                rows += slice.summary.rows;
                bytes += slice.summary.bytes;
                let summary = serde_json::to_vec(&slice.summary)
                    .map_err(|error| Status::internal(error.to_string()))?;
                info = info.with_endpoint(
                    FlightEndpoint::new()
                        .with_location(format!(
                            "{}/slices/{name}/{}",
                            self.range_base_url, slice.summary.file
                        ))
                        .with_app_metadata(summary),
                );
            }
            infos.push(
                info.with_total_records(rows as i64)
                    .with_total_bytes(bytes as i64),
            );
        }
        Ok(infos)
    }
}

/// Map a DataFusion error to a gRPC status of the matching kind. An error of
/// the query's data is `FailedPrecondition` with its kind in
/// [`ERROR_KIND_METADATA`], so the compute node raises it as it is instead
/// of failing over to a replica that would fail the same way.
///
/// A page that failed its checksum is `DataLoss`, naming the slice file in
/// [`CORRUPT_FILE_METADATA`]: this copy is damaged, another may not be.
fn to_status(error: DataFusionError) -> Status {
    if sieve_fragment::BodyNotHeld::is(&error) {
        let mut status = Status::failed_precondition(clip(error.strip_backtrace()));
        status.metadata_mut().insert(
            ERROR_KIND_METADATA,
            tonic::metadata::MetadataValue::from_static(sieve_fragment::BODY_NOT_HELD_KIND),
        );
        return status;
    }
    if let Some(corruption) = sieve_format::find_page_corruption(&error) {
        return corrupt_status(corruption);
    }
    let (kind, message) = classify_error(&error);
    match kind {
        ErrorKind::Plan => Status::invalid_argument(clip(message)),
        ErrorKind::Resources => Status::resource_exhausted(clip(message)),
        ErrorKind::Data(data) => {
            let mut status = Status::failed_precondition(clip(message));
            status.metadata_mut().insert(
                ERROR_KIND_METADATA,
                tonic::metadata::MetadataValue::from_static(data.name()),
            );
            status
        }
        ErrorKind::Node => Status::internal(clip(message)),
    }
}

/// Longest status message a node sends, in bytes. A message travels in an
/// HTTP/2 header, and a client refuses headers over 16 KiB as a protocol
/// error; names from the request (a table, an action) are echoed in
/// messages, so a hostile name must not make an error unreadable.
const STATUS_MESSAGE_BYTES_MAX: usize = 2048;

/// `message` cut to [`STATUS_MESSAGE_BYTES_MAX`] at a character boundary.
fn clip(message: impl Into<String>) -> String {
    let mut message = message.into();
    if message.len() > STATUS_MESSAGE_BYTES_MAX {
        let mut end = STATUS_MESSAGE_BYTES_MAX - 3;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push_str("...");
    }
    message
}

/// The status of a request for a slice whose copy here is damaged.
pub(crate) fn corrupt_status(corruption: &sieve_format::PageCorruption) -> Status {
    let mut status = Status::data_loss(clip(corruption.to_string()));
    status.metadata_mut().insert(
        ERROR_KIND_METADATA,
        tonic::metadata::MetadataValue::from_static(CORRUPT_SLICE_KIND),
    );
    let file = std::path::Path::new(&corruption.file)
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default();
    if let Ok(value) = tonic::metadata::MetadataValue::try_from(file.as_str()) {
        status.metadata_mut().insert(CORRUPT_FILE_METADATA, value);
    }
    status
}

type BoxedFlightStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl FlightService for StorageFlightService {
    type HandshakeStream = BoxedFlightStream<HandshakeResponse>;
    type ListFlightsStream = BoxedFlightStream<FlightInfo>;
    type DoGetStream = BoxedFlightStream<FlightData>;
    type DoPutStream = BoxedFlightStream<PutResult>;
    type DoActionStream = BoxedFlightStream<arrow_flight::Result>;
    type ListActionsStream = BoxedFlightStream<ActionType>;
    type DoExchangeStream = BoxedFlightStream<FlightData>;

    async fn handshake(
        &self,
        _request: Request<Streaming<HandshakeRequest>>,
    ) -> Result<Response<Self::HandshakeStream>, Status> {
        Err(Status::unimplemented(
            "handshake: Sieve storage nodes need no authentication on a private network",
        ))
    }

    async fn list_flights(
        &self,
        _request: Request<Criteria>,
    ) -> Result<Response<Self::ListFlightsStream>, Status> {
        let infos = self.flight_infos()?;
        Ok(Response::new(Box::pin(stream::iter(
            infos.into_iter().map(Ok),
        ))))
    }

    async fn get_flight_info(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let descriptor = request.into_inner();
        let name = descriptor.path.first().cloned().unwrap_or_default();
        self.executor
            .catalog()
            .table(&name)
            .map_err(|error| Status::not_found(clip(error.to_string())))?;
        let info = self
            .flight_infos()?
            .into_iter()
            .find(|info| {
                info.flight_descriptor
                    .as_ref()
                    .is_some_and(|found| found.path == descriptor.path)
            })
            .ok_or_else(|| {
                Status::not_found(clip(format!(
                    "table '{name}' is not held by this storage node"
                )))
            })?;
        Ok(Response::new(info))
    }

    async fn poll_flight_info(
        &self,
        _request: Request<FlightDescriptor>,
    ) -> Result<Response<PollInfo>, Status> {
        Err(Status::unimplemented("poll_flight_info is not supported"))
    }

    async fn get_schema(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<SchemaResult>, Status> {
        let descriptor = request.into_inner();
        let name = descriptor.path.first().cloned().unwrap_or_default();
        let table = self
            .executor
            .catalog()
            .table(&name)
            .map_err(|error| Status::not_found(clip(error.to_string())))?;
        let options = IpcWriteOptions::default();
        let result = arrow_flight::SchemaAsIpc::new(&table.schema, &options)
            .try_into()
            .map_err(|error: arrow::error::ArrowError| Status::internal(error.to_string()))?;
        Ok(Response::new(result))
    }

    async fn do_get(
        &self,
        request: Request<Ticket>,
    ) -> Result<Response<Self::DoGetStream>, Status> {
        // A peer on this host reads at memory speed: compressing for it only
        // costs CPU on both ends (see `IpcCodec::Auto`).
        let loopback = request
            .remote_addr()
            .is_some_and(|address| address.ip().is_loopback());
        let ticket = request.into_inner().ticket;
        // Everything that reads the ticket runs inside a panic guard: a
        // decoder's panic on hostile bytes is an error for this request,
        // never a reset stream or a dead node.
        let (envelope, codec, adaptive, slice, body) = guarded("decoding the ticket", || {
            let envelope = FragmentEnvelope::decode_checked(&ticket).map_err(to_status)?;
            let (codec, chosen_here) =
                match IpcCodec::from_wire(envelope.ipc_codec).map_err(to_status)? {
                    IpcCodec::Auto => (self.executor.options().ipc_compression, true),
                    requested => (requested, false),
                };
            let adaptive = (chosen_here
                && codec.resolve(loopback) == Some(arrow::ipc::CompressionType::LZ4_FRAME))
            .then(|| Adaptive {
                choices: Arc::clone(&self.codec_choices),
                table: envelope.table.clone(),
            });
            let (_, slice) = self
                .executor
                .catalog()
                .slice(&envelope.table, envelope.slice)
                .map_err(|error| {
                    Status::not_found(clip(error.find_root().message().into_owned()))
                })?;
            // A copy found damaged is refused at once, on every path.
            if let Some(corruption) = slice.corruption.get() {
                return Err(corrupt_status(corruption));
            }
            // A bad fragment is refused whatever the node's load.
            let body = self.executor.body_for(&envelope).map_err(to_status)?;
            Ok((envelope, codec, adaptive, slice, body))
        })?;
        // The response goes back at once; the request then waits for a
        // pushdown worker (at most the node's `pushdown_wait`) and runs,
        // or is served raw. Its messages, and heartbeats while it waits or
        // works without output, flow through one channel.
        let (sender, receiver) = tokio::sync::mpsc::channel::<Result<FlightData, Status>>(2);
        let progress = Arc::new(Progress::default());
        let interval = envelope.heartbeat_interval();
        let (pool, executor, faults) = (
            Arc::clone(&self.pool),
            Arc::clone(&self.executor),
            Arc::clone(&self.faults),
        );
        let compression = codec.resolve(loopback);
        let serving = Arc::clone(&progress);
        tokio::spawn(async move {
            // A request with nothing for the node to do asks for the pages
            // as stored: it never waits for (or takes) a pushdown worker.
            let admission = if envelope.raw {
                Admission::Raw(RAW_ASKED.to_string())
            } else {
                tokio::select! {
                    // A client gone while queued frees its place in the queue.
                    _ = sender.closed() => return,
                    admission = pool.admit() => admission,
                }
            };
            serving.admitted();
            match admission {
                Admission::Raw(reason) => {
                    let details = match slice.details_async().await {
                        Ok(details) => details,
                        Err(error) => {
                            let _ = sender.send(Err(to_status(error))).await;
                            return;
                        }
                    };
                    let plan = match guarded("planning a raw slice", || {
                        plan_raw(&slice, details, &envelope, &body, reason).map_err(to_status)
                    }) {
                        Ok(plan) => plan,
                        Err(status) => {
                            let _ = sender.send(Err(status)).await;
                            return;
                        }
                    };
                    let stream = raw_stream(slice, plan, executor);
                    // A panic while reading pages ends the stream with an
                    // error (a stream that panicked is not polled again).
                    let mut stream = AssertUnwindSafe(stream).catch_unwind().map(|polled| {
                        polled.unwrap_or_else(|_| {
                            Err(Status::internal(
                                "storage node failed while serving a raw slice (panic caught)",
                            ))
                        })
                    });
                    while let Some(message) = stream.next().await {
                        let failed = message.is_err();
                        if sender.send(message).await.is_err() || failed {
                            return;
                        }
                        faults.message_sent();
                    }
                }
                Admission::Run(worker, admitted) => {
                    let work = process(
                        executor,
                        ticket,
                        compression,
                        adaptive,
                        admitted,
                        sender.clone(),
                        faults,
                        serving,
                    );
                    pool.spawn(async move {
                        let _worker = worker;
                        // The work stops when its client goes away: the
                        // response stream, and with it the receiver, is
                        // dropped.
                        let gone = sender.clone();
                        tokio::select! {
                            _ = gone.closed() => {}
                            finished = AssertUnwindSafe(work).catch_unwind() => {
                                if finished.is_err() {
                                    let _ = sender
                                        .send(Err(Status::internal(
                                            "storage node failed while executing the fragment (panic caught)",
                                        )))
                                        .await;
                                }
                            }
                        }
                    });
                }
            }
        });
        Ok(Response::new(Box::pin(with_heartbeats(
            receiver, interval, progress,
        ))))
    }

    /// A slice file of a table a user owns ([`crate::ingest`]); answers one
    /// `PutResult` whose `app_metadata` is the slice's JSON summary.
    async fn do_put(
        &self,
        request: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoPutStream>, Status> {
        let _turn = self
            .puts
            .acquire()
            .await
            .map_err(|_| Status::unavailable("the storage node is stopping"))?;
        let summary = crate::ingest::put_slice(self.executor.catalog(), request.into_inner())
            .await
            .map_err(|status| Status::new(status.code(), clip(status.message().to_string())))?;
        let metadata =
            serde_json::to_vec(&summary).map_err(|error| Status::internal(error.to_string()))?;
        let result = PutResult {
            app_metadata: metadata.into(),
        };
        Ok(Response::new(Box::pin(stream::once(async { Ok(result) }))))
    }

    async fn do_action(
        &self,
        request: Request<Action>,
    ) -> Result<Response<Self::DoActionStream>, Status> {
        let action = request.into_inner();
        match action.r#type.as_str() {
            STATS_ACTION => {
                let mut stats = self.executor.counters().to_json();
                stats["pushdown_workers"] = self.pool.workers().into();
                stats["range_base_url"] = self.range_base_url.clone().into();
                stats["pushdown_running"] = self.pool.running().into();
                stats["pushdown_waiting"] = self.pool.waiting().into();
                let (mut corrupt, mut unchecked) = (Vec::new(), 0u64);
                for table in self.executor.catalog().tables().values() {
                    for slice in table.slices.values() {
                        if slice.corruption.get().is_some() {
                            corrupt.push(slice.summary.file.clone());
                        }
                        if !slice.checked {
                            unchecked += 1;
                        }
                    }
                }
                stats["corrupt_slices"] = corrupt.into();
                stats["unchecked_slices"] = unchecked.into();
                stats["unreadable_slices"] = self.executor.catalog().unreadable().to_vec().into();
                let details = self.executor.catalog().details_cache();
                stats["slice_details_bytes"] = details.bytes().into();
                stats["slice_details_bytes_max"] = details.bytes_max().into();
                stats["slice_details_loads"] = details.loads().into();
                for registry in [
                    self.executor.join_filters().to_json(),
                    self.executor.bodies().to_json(),
                ] {
                    if let (Some(stats), serde_json::Value::Object(entries)) =
                        (stats.as_object_mut(), registry)
                    {
                        stats.extend(entries);
                    }
                }
                let body = stats.to_string();
                let result = arrow_flight::Result {
                    body: body.into_bytes().into(),
                };
                Ok(Response::new(Box::pin(stream::once(async { Ok(result) }))))
            }
            REGISTER_JOIN_FILTER_ACTION => {
                // Decoded on a blocking thread: a large one takes a while,
                // and waits for the one before it.
                let executor = Arc::clone(&self.executor);
                let id = tokio::task::spawn_blocking(move || {
                    guarded("decoding a join filter", || {
                        executor
                            .register_join_filter(&action.body)
                            .map_err(|error| {
                                Status::invalid_argument(clip(error.strip_backtrace()))
                            })
                    })
                })
                .await
                .map_err(|error| {
                    Status::internal(format!("decoding a join filter failed: {error}"))
                })??;
                let result = arrow_flight::Result {
                    body: id.to_vec().into(),
                };
                Ok(Response::new(Box::pin(stream::once(async { Ok(result) }))))
            }
            REGISTER_FRAGMENT_BODY_ACTION => {
                let id = guarded("decoding a fragment body", || {
                    self.executor
                        .register_fragment_body(&action.body)
                        .map_err(|error| Status::invalid_argument(clip(error.strip_backtrace())))
                })?;
                let result = arrow_flight::Result {
                    body: id.to_vec().into(),
                };
                Ok(Response::new(Box::pin(stream::once(async { Ok(result) }))))
            }
            RELEASE_FRAGMENT_BODY_ACTION => {
                let id = join_filter_id(&action.body)
                    .map_err(|error| Status::invalid_argument(clip(error.strip_backtrace())))?;
                let held = self.executor.bodies().release(&id);
                let result = arrow_flight::Result {
                    body: vec![u8::from(held)].into(),
                };
                Ok(Response::new(Box::pin(stream::once(async { Ok(result) }))))
            }
            RELEASE_JOIN_FILTER_ACTION => {
                let id = join_filter_id(&action.body)
                    .map_err(|error| Status::invalid_argument(clip(error.strip_backtrace())))?;
                let held = self.executor.join_filters().release(&id);
                let result = arrow_flight::Result {
                    body: vec![u8::from(held)].into(),
                };
                Ok(Response::new(Box::pin(stream::once(async { Ok(result) }))))
            }
            REMOVE_SLICES_ACTION | RETAIN_SLICES_ACTION => {
                let catalog = Arc::clone(self.executor.catalog());
                let body = action.body.clone();
                let retain = action.r#type == RETAIN_SLICES_ACTION;
                let removed = tokio::task::spawn_blocking(move || {
                    if retain {
                        crate::ingest::retain_slices(&catalog, &body)
                    } else {
                        crate::ingest::remove_slices(&catalog, &body)
                    }
                })
                .await
                .map_err(|error| Status::internal(error.to_string()))??;
                let result = arrow_flight::Result {
                    body: removed.to_string().into_bytes().into(),
                };
                Ok(Response::new(Box::pin(stream::once(async { Ok(result) }))))
            }
            other => Err(Status::unimplemented(clip(format!(
                "action '{other}' is not supported (known: {STATS_ACTION}, \
                 {REGISTER_JOIN_FILTER_ACTION}, {RELEASE_JOIN_FILTER_ACTION}, \
                 {REGISTER_FRAGMENT_BODY_ACTION}, {RELEASE_FRAGMENT_BODY_ACTION}, \
                 {REMOVE_SLICES_ACTION}, {RETAIN_SLICES_ACTION})"
            )))),
        }
    }

    async fn list_actions(
        &self,
        _request: Request<Empty>,
    ) -> Result<Response<Self::ListActionsStream>, Status> {
        let stats = ActionType {
            r#type: STATS_ACTION.to_string(),
            description: "the node's running totals as JSON: slices served, fragment bytes read, rows scanned and returned, byte-range bytes served".to_string(),
        };
        let register = ActionType {
            r#type: REGISTER_JOIN_FILTER_ACTION.to_string(),
            description: "keep a join filter (an encoded JoinFilterRegistration) for the slice requests that name its id; answers the id".to_string(),
        };
        let release = ActionType {
            r#type: RELEASE_JOIN_FILTER_ACTION.to_string(),
            description: "release one registration of a join filter (body: its id)".to_string(),
        };
        let register_body = ActionType {
            r#type: REGISTER_FRAGMENT_BODY_ACTION.to_string(),
            description: "keep a fragment body (a compressed FragmentBodyRegistration: a star join's, with its dimensions' rows) for the slice requests that name its id; answers the id".to_string(),
        };
        let release_body = ActionType {
            r#type: RELEASE_FRAGMENT_BODY_ACTION.to_string(),
            description: "release one registration of a fragment body (body: its id)".to_string(),
        };
        let remove = ActionType {
            r#type: REMOVE_SLICES_ACTION.to_string(),
            description: "stop serving slices of a table a user owns and delete their files (JSON: table, slices)".to_string(),
        };
        let retain = ActionType {
            r#type: RETAIN_SLICES_ACTION.to_string(),
            description: "keep only the listed slices of the tables users own (JSON: tables), deleting the rest".to_string(),
        };
        Ok(Response::new(Box::pin(stream::iter(
            [
                stats,
                register,
                release,
                register_body,
                release_body,
                remove,
                retain,
            ]
            .map(Ok),
        ))))
    }

    async fn do_exchange(
        &self,
        _request: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoExchangeStream>, Status> {
        Err(Status::unimplemented("do_exchange is not supported"))
    }
}

/// Where a slice request is, for its heartbeats: waiting for a pushdown
/// worker, or running through a plan (set by [`process`]).
#[derive(Default)]
struct Progress {
    admitted: std::sync::atomic::AtomicBool,
    plan: OnceLock<Arc<dyn ExecutionPlan>>,
}

impl Progress {
    fn admitted(&self) {
        self.admitted
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Whether the request is still waiting for a worker (a wait bounded
    /// by the node's `pushdown_wait`).
    fn queued(&self) -> bool {
        !self.admitted.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The work its plan has done so far, once it runs.
    fn work(&self) -> Option<u64> {
        self.plan.get().map(work_done)
    }
}

/// The messages of a slice request, with a [`SliceMessageKind::Heartbeat`]
/// after each `interval` without a message in which the request was still
/// queued or its fragment made progress (its plan's metrics moved). A
/// fragment that stands still, or a raw read that does, sends nothing, so
/// the client's silence timeout still finds a stuck node.
fn with_heartbeats(
    receiver: tokio::sync::mpsc::Receiver<Result<FlightData, Status>>,
    interval: Option<Duration>,
    progress: Arc<Progress>,
) -> impl Stream<Item = Result<FlightData, Status>> + Send + 'static {
    futures::stream::unfold((receiver, None::<u64>), move |(mut receiver, mut last)| {
        let progress = Arc::clone(&progress);
        async move {
            let Some(interval) = interval else {
                return receiver
                    .recv()
                    .await
                    .map(|message| (message, (receiver, last)));
            };
            loop {
                match tokio::time::timeout(interval, receiver.recv()).await {
                    Ok(message) => return message.map(|message| (message, (receiver, last))),
                    Err(_) => {
                        let work = progress.work();
                        let moved = work.is_some() && work != last;
                        if !(progress.queued() || moved) {
                            continue;
                        }
                        last = work;
                        let heartbeat = SliceMessage {
                            kind: Some(SliceMessageKind::Heartbeat(work.unwrap_or(0))),
                        };
                        let message =
                            FlightData::new().with_app_metadata(heartbeat.encode_to_vec());
                        return Some((Ok(message), (receiver, last)));
                    }
                }
            }
        }
    })
}

/// Run one fragment on a pushdown worker and send its Flight messages
/// (IPC schema and batches, then the metrics) to `sender`. Stops as soon as
/// the client is gone.
#[allow(clippy::too_many_arguments)]
async fn process(
    executor: Arc<SliceExecutor>,
    ticket: bytes::Bytes,
    compression: Option<arrow::ipc::CompressionType>,
    adaptive: Option<Adaptive>,
    admitted: Admitted,
    sender: tokio::sync::mpsc::Sender<Result<FlightData, Status>>,
    faults: Arc<Faults>,
    progress: Arc<Progress>,
) {
    let mut slice_stream = match executor.execute(&ticket).await {
        Ok(stream) => stream,
        Err(error) => {
            let _ = sender.send(Err(to_status(error))).await;
            return;
        }
    };
    let _ = progress.plan.set(slice_stream.plan());
    slice_stream.set_admission(admitted);
    let schema = slice_stream.schema();
    let metrics_slot: Arc<Mutex<Option<SliceMetrics>>> = Arc::new(Mutex::new(None));
    let batches = FinishingStream {
        inner: Some(slice_stream),
        slot: Arc::clone(&metrics_slot),
        executor: Arc::clone(&executor),
    };
    let batches = batches.map(|item| match item {
        // A view array read from Parquet points into whole decoded pages,
        // and Arrow IPC writes every buffer a column references: without
        // this a batch of a few rows ships the pages they came from (TPC-H
        // customer: 5x its stored size).
        Ok(batch) => sieve_fragment::compact_views(batch, 1.0)
            .map_err(|error| FlightError::Tonic(Box::new(Status::internal(error.to_string())))),
        Err(error) => Err(FlightError::Tonic(Box::new(to_status(error)))),
    });
    // When the node chose lz4 (`auto` on loopback), it keeps it only if the
    // first batch shrinks by a fifth (the first batch of the first slice of
    // this table and shipped schema: see `CodecChoices`): keys already
    // shipped narrow, or floats, are incompressible, and compressing them
    // costs both ends CPU for nothing.
    let mut batches = batches.boxed();
    let first = batches.next().await;
    let compression = match (&first, adaptive) {
        (Some(Ok(batch)), Some(adaptive)) if !adaptive.pays(batch, compression) => None,
        _ => compression,
    };
    let batches = futures::stream::iter(first).chain(batches);
    let options = match IpcWriteOptions::default().try_with_compression(compression) {
        Ok(options) => options,
        Err(error) => {
            let _ = sender.send(Err(Status::internal(error.to_string()))).await;
            return;
        }
    };
    let mut encoded = FlightDataEncoderBuilder::new()
        .with_schema(schema)
        .with_options(options)
        .build(batches);
    while let Some(message) = encoded.next().await {
        let message = message.map_err(|error: FlightError| match error {
            FlightError::Tonic(status) => *status,
            other => Status::internal(other.to_string()),
        });
        let failed = message.is_err();
        if sender.send(message).await.is_err() || failed {
            return;
        }
        faults.message_sent();
    }
    let metrics = metrics_slot
        .lock()
        .expect("metrics lock is never poisoned")
        .take()
        .unwrap_or_default();
    let trailer = SliceMessage {
        kind: Some(SliceMessageKind::Metrics(metrics)),
    };
    let _ = sender
        .send(Ok(
            FlightData::new().with_app_metadata(trailer.encode_to_vec())
        ))
        .await;
}

/// Run `work` (a request's synchronous decoding and checking) and turn a
/// panic into an `Internal` status naming `what`.
fn guarded<T>(what: &str, work: impl FnOnce() -> Result<T, Status>) -> Result<T, Status> {
    std::panic::catch_unwind(AssertUnwindSafe(work)).unwrap_or_else(|_| {
        Err(Status::internal(format!(
            "storage node failed while {what} (panic caught)"
        )))
    })
}

/// The node's own choice of lz4 for a peer on its host, to be confirmed by
/// the data.
struct Adaptive {
    choices: Arc<CodecChoices>,
    table: String,
}

impl Adaptive {
    /// Whether `compression` pays for batches like `batch`: decided once per
    /// table and shipped schema, on the first batch that asks.
    fn pays(
        &self,
        batch: &arrow::record_batch::RecordBatch,
        compression: Option<arrow::ipc::CompressionType>,
    ) -> bool {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        self.table.hash(&mut hasher);
        for field in batch.schema_ref().fields() {
            field.hash(&mut hasher);
        }
        let key = hasher.finish();
        let known = self
            .choices
            .0
            .lock()
            .expect("never poisoned")
            .get(&key)
            .copied();
        known.unwrap_or_else(|| {
            let pays = compression_pays(batch, compression);
            let mut choices = self.choices.0.lock().expect("never poisoned");
            if choices.len() >= CODEC_CHOICES_MAX {
                choices.clear();
            }
            choices.insert(key, pays);
            pays
        })
    }
}

/// Whether lz4 paid, by table and shipped schema. Compressibility is a
/// property of the columns, so the first slice decides for the rest: finding
/// out encodes a batch twice, which took 4% of a node's CPU in Q16 when done
/// for every slice.
#[derive(Debug, Default)]
struct CodecChoices(Mutex<std::collections::HashMap<u64, bool>>);

/// Schemas remembered before [`CodecChoices`] starts afresh.
const CODEC_CHOICES_MAX: usize = 4096;

/// Whether `compression` shrinks `batch`'s IPC body to at most 4/5 of its
/// plain size. Costs two encodings of the batch ([`Adaptive::pays`] asks
/// once per table and shipped schema). Two slices that ask at once may both
/// find out; the later answer stays.
fn compression_pays(
    batch: &arrow::record_batch::RecordBatch,
    compression: Option<arrow::ipc::CompressionType>,
) -> bool {
    use arrow::ipc::writer::{DictionaryTracker, IpcDataGenerator};
    let size = |compression| -> Option<usize> {
        let options = IpcWriteOptions::default()
            .try_with_compression(compression)
            .ok()?;
        let (_, encoded) = IpcDataGenerator::default()
            .encode(
                batch,
                &mut DictionaryTracker::new(false),
                &options,
                &mut Default::default(),
            )
            .ok()?;
        Some(encoded.arrow_data.len())
    };
    match (size(compression), size(None)) {
        (Some(compressed), Some(plain)) => compressed * 5 <= plain * 4,
        // If either cannot be encoded, the encoder will say so; keep the codec.
        _ => true,
    }
}

/// Passes a slice's batches through and, when they end, leaves the slice's
/// metrics in `slot` for the trailer message.
struct FinishingStream {
    inner: Option<crate::execute::SliceStream>,
    slot: Arc<Mutex<Option<SliceMetrics>>>,
    executor: Arc<SliceExecutor>,
}

impl Stream for FinishingStream {
    type Item = datafusion::common::Result<arrow::record_batch::RecordBatch>;

    fn poll_next(
        mut self: Pin<&mut Self>,
        context: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let Some(inner) = self.inner.as_mut() else {
            return std::task::Poll::Ready(None);
        };
        let polled = inner.poll_next_unpin(context);
        if let std::task::Poll::Ready(None) = polled {
            let finished = self.inner.take().expect("checked above");
            let metrics = finished.metrics();
            self.executor.counters().record(&metrics);
            *self.slot.lock().expect("metrics lock is never poisoned") = Some(metrics);
        }
        polled
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{ArrayRef, Int64Array};
    use arrow::ipc::CompressionType;
    use arrow::record_batch::RecordBatch;

    use super::{compression_pays, Adaptive};

    fn batch(values: impl Iterator<Item = i64>) -> RecordBatch {
        let column: ArrayRef = Arc::new(Int64Array::from_iter_values(values));
        RecordBatch::try_from_iter([("v", column)]).unwrap()
    }

    /// A 64-bit mixer's output: no byte repeats a pattern lz4 can use.
    fn noise() -> RecordBatch {
        batch((0..8192u64).map(|row| {
            let mut value = row.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            value ^= value >> 29;
            value.wrapping_mul(0xbf58_476d_1ce4_e5b9) as i64
        }))
    }

    /// lz4 is kept for a batch it shrinks and dropped for one it cannot.
    #[test]
    fn lz4_is_kept_only_where_it_shrinks_the_batch() {
        let lz4 = Some(CompressionType::LZ4_FRAME);
        let repetitive = batch((0..8192).map(|row| row % 4));
        assert!(compression_pays(&repetitive, lz4));
        let noise = noise();
        assert!(!compression_pays(&noise, lz4));
    }

    /// The first batch of a table and schema decides for the later ones;
    /// another table decides afresh.
    #[test]
    fn the_first_slice_decides_the_codec_for_its_table_and_schema() {
        let lz4 = Some(CompressionType::LZ4_FRAME);
        let repetitive = batch((0..8192).map(|row| row % 4));
        let noise = noise();
        let choices = Arc::default();
        let on = |table: &str| Adaptive {
            choices: Arc::clone(&choices),
            table: table.to_string(),
        };
        assert!(on("orders").pays(&repetitive, lz4));
        assert!(on("orders").pays(&noise, lz4), "decided by the first batch");
        assert!(!on("lineitem").pays(&noise, lz4));
        assert!(!on("lineitem").pays(&repetitive, lz4));
    }
}
