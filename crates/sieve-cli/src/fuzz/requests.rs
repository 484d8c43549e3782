//! A malformed-request fuzzer for one storage node: seeded, hostile Flight
//! and HTTP requests, each classified by how the node answered, with a
//! health check every few requests.
//!
//! The node must refuse what it cannot serve with a clean error and keep
//! serving correct answers. The fuzzer only talks to the node over the
//! network (its catalog comes from `ListFlights`), so it can aim at an
//! embedded node it starts itself over a small generated TPC-H, or at any
//! running node ([`RequestTarget::Node`]).
//!
//! # Families
//!
//! Request `i` of a run with seed `S` comes from `derive_seed(S, i)` alone, so
//! one request can be replayed (`--only I`). The families take turns:
//!
//! - [`Family::Mutated`]: a valid fragment from a pool (projections,
//!   predicates with comparisons, arithmetic, IN lists, LIKE, CASE, casts,
//!   functions; partial aggregations), mutated at the byte level (bit flips,
//!   interesting bytes, insertions, deletions, truncation, duplication,
//!   huge varints) at one of three depths (the envelope, the body, the
//!   predicate), or at the structured level (unknown version or codec, huge
//!   slice, unknown table, huge or out-of-range row groups, a projection
//!   repeated 10,000 times or out of range, a predicate or aggregation moved
//!   to another table with that table's fingerprint);
//! - [`Family::Deep`]: `BinaryExpr` chains 50 to 5,000 deep (serialised with
//!   `serialize_physical_expr` on a thread with a 256 MiB stack, since
//!   serialisation recurses), IN lists up to 400,000 items and string
//!   literals up to the 4 MiB fragment bound and a little beyond;
//! - [`Family::RandomBytes`]: tickets of random bytes, 0 to 64 KiB;
//! - [`Family::OtherCalls`]: `DoAction` with random types and bodies,
//!   `GetFlightInfo` and `GetSchema` with random descriptors, `ListFlights`
//!   with random criteria;
//! - [`Family::ByteRange`]: the byte-range endpoint with hostile paths (`..`,
//!   percent-encoded slashes and NULs, 100 KiB paths) and `Range` headers
//!   (huge, negative, reversed, multi-range, past `u64`), HEAD and GET.
//!
//! # Outcomes
//!
//! An answer is [`Outcome::Ok`], or [`Outcome::Refused`] (a gRPC status
//! other than the ones below, an HTTP status other than 5xx). Failures:
//! [`Outcome::Panic`] (the node panicked while serving the request, whether
//! or not it caught it: in-process a panic hook sees it; remotely, an
//! `Internal` status that names a panic), [`Outcome::BrokenStream`] (a
//! status `Unknown`, an h2 protocol error, an HTTP connection closed without
//! a status line), [`Outcome::ServerError`]
//! (HTTP 5xx), [`Outcome::Hang`] (no answer within
//! [`RequestFuzzOptions::request_timeout`]), [`Outcome::Crash`] (the node
//! stops answering `ListFlights`), [`Outcome::WrongAnswer`] (the health
//! fragment, run every [`RequestFuzzOptions::health_every`] requests and at
//! the end, returns other rows than at the start).
//!
//! A stack overflow aborts the whole process, the embedded node with the
//! fuzzer: [`RequestFuzzOptions::journal`] names a file where each request
//! is written before it is sent, so the last line is the culprit.
//!
//! # Cost
//!
//! Measured on a debug build, two cores shared with other builds, before
//! the node's limits. One family at a time (seed 1, 400 requests each,
//! `--families F`): random bytes 261 requests/s, the byte-range endpoint
//! 354/s, other calls 143/s, mutated fragments 2/s and deep ones (at
//! `--depth-max 40`, one in three near the 4 MiB bound then) 0.8/s, the
//! last two dominated by requests that time out (a projection of 10,000
//! columns; IN lists of 400,000 items, 13 s alone; a LIKE pattern of 4 MiB of
//! `%`, 42 s alone) and by the node staying busy with them after the client
//! gave up. All families (one deep request in ten near the bound): 4.9
//! requests/s over 1,000 requests, 5.1/s over 500 (deep 0.5 s a request,
//! mutated 0.2 s, the others under 0.02 s). The deep family alone at
//! `--depth-max 300`, one request in twenty near the bound: 0.45 s a
//! request. So a debug run goes at about 10 requests/s once the slow
//! requests are refused, and the long run of 100,000 requests takes about
//! three hours in debug (deep 20,000 x 0.45 s, the rest little) and, at
//! the usual tenfold, a quarter of an hour in release:
//! `cargo run --release -p sieve-cli -- fuzz-requests --seed 1 --requests 100000`.
//! Today the deep family's chains of a few hundred levels overflow a node
//! thread's stack and abort the process at the first such request
//! (`--depth-max 40` keeps below that).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arrow::datatypes::{DataType, Schema, SchemaRef};
use arrow::record_batch::RecordBatch;
use arrow_flight::decode::FlightRecordBatchStream;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::{Action, Criteria, FlightDescriptor, Ticket};
use datafusion::common::{exec_err, DFSchema, DataFusionError, Result, ScalarValue};
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::aggregate::AggregateExprBuilder;
use datafusion::physical_expr::expressions::{BinaryExpr, Column, Literal};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode, PhysicalGroupBy};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::SessionContext;
use datafusion_proto::physical_plan::to_proto::serialize_physical_expr;
use datafusion_proto::protobuf::{
    physical_expr_node::ExprType, PhysicalExprNode, PhysicalInListNode,
};
use futures::{StreamExt, TryStreamExt};
use prost::Message;
use sieve_fragment::{
    schema_fingerprint, Fragment, FragmentBody, FragmentEnvelope, JoinFilterRegistration,
    SieveCodec, SliceInputExec, SliceMessage, SliceMessageKind, FRAGMENT_BYTES_MAX,
    REGISTER_JOIN_FILTER_ACTION, RELEASE_JOIN_FILTER_ACTION,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::Channel;
use tonic::Code;

use super::rng::SeededRandom;
use crate::cluster::{generated_tpch, EmbeddedCluster};
use crate::compare::rows_as_text;

/// Per-request timeout by default: a TPC-H SF 0.01 slice is served in well
/// under a second even in a debug build, so ten seconds is a hang.
pub const REQUEST_TIMEOUT_MS_DEFAULT: u64 = 10_000;

/// Requests between two health checks by default.
pub const HEALTH_EVERY_DEFAULT: usize = 100;

/// Deepest expression chain the deep family sends: far beyond any real
/// predicate, and beyond what a 2 MiB stack survives if decoding recurses
/// without a bound.
pub const CHAIN_DEPTH_MAX: usize = 5_000;

/// Stack of the thread that builds, serialises and drops deep expressions:
/// each level of `serialize_physical_expr` and of prost's encoding takes a
/// few hundred bytes, and a 5,000-deep chain must not overflow it.
pub const BUILDER_STACK_BYTES: usize = 256 * 1024 * 1024;

/// Longest random ticket.
pub const RANDOM_BYTES_MAX: usize = 64 * 1024;

/// Bytes of a request kept in a reproducer, as hex.
pub const REPRODUCER_BYTES_MAX: usize = 96;

/// Findings kept per family and outcome in the report (all are counted).
pub const FINDINGS_KEPT_MAX: usize = 20;

/// TPC-H scale factor of the embedded node's data.
pub const EMBEDDED_SCALE_FACTOR: f64 = 0.01;

/// Where the requests go.
#[derive(Debug, Clone)]
pub enum RequestTarget {
    /// Start one storage node in this process over TPC-H SF 0.01 generated
    /// under this directory (reused if already there).
    Embedded(PathBuf),
    /// A running node: its Flight URL (`http://host:port`). The byte-range
    /// endpoint is found from the locations in its `ListFlights` answer.
    Node(String),
}

/// What to run.
#[derive(Debug, Clone)]
pub struct RequestFuzzOptions {
    /// The run's seed: request `i` comes from `derive_seed(seed, i)` alone.
    pub seed: u64,
    /// Requests to send.
    pub requests: usize,
    /// Only this request index (to replay a finding); health checks still run.
    pub only: Option<usize>,
    /// The families that take turns (request `i` is of family
    /// `families[i % families.len()]`): all of [`Family::ALL`] by default.
    /// A family that kills the node hides the others' findings; fuzzing one
    /// family at a time shows them.
    pub families: Vec<Family>,
    /// The node.
    pub target: RequestTarget,
    /// Value of the `authorization` header sent with every Flight and HTTP
    /// request (`Bearer <secret>`), if the node wants one. Hook: once
    /// [`EmbeddedCluster`] makes its own shared secret, an embedded run
    /// without this set should take the cluster's (see
    /// `embedded_authorization` below).
    pub authorization: Option<String>,
    /// Per-request timeout; no answer in time is a hang.
    pub request_timeout: Duration,
    /// Requests between two health checks.
    pub health_every: usize,
    /// Deepest expression chain of the deep family (at most
    /// [`CHAIN_DEPTH_MAX`]): lower it to fuzz the family's other
    /// requests past a depth that kills the node.
    pub expression_depth_max: usize,
    /// A file where each request is written before it is sent (the last line
    /// names the request that killed the process, if one does), and its
    /// outcome after.
    pub journal: Option<PathBuf>,
}

impl RequestFuzzOptions {
    /// `requests` requests from `seed` against an embedded node over data
    /// generated under `data`.
    pub fn new(seed: u64, requests: usize, data: PathBuf) -> Self {
        Self {
            seed,
            requests,
            only: None,
            families: Family::ALL.to_vec(),
            target: RequestTarget::Embedded(data),
            authorization: None,
            request_timeout: Duration::from_millis(REQUEST_TIMEOUT_MS_DEFAULT),
            health_every: HEALTH_EVERY_DEFAULT,
            expression_depth_max: CHAIN_DEPTH_MAX,
            journal: None,
        }
    }
}

/// A family of requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Family {
    /// Valid tickets, mutated.
    Mutated,
    /// Deep expressions, huge IN lists, huge literals.
    Deep,
    /// Random bytes as a ticket.
    RandomBytes,
    /// DoAction, GetFlightInfo, GetSchema, ListFlights with random input.
    OtherCalls,
    /// The HTTP byte-range endpoint.
    ByteRange,
}

impl Family {
    /// Every family, in turn order.
    pub const ALL: [Family; 5] = [
        Family::Mutated,
        Family::Deep,
        Family::RandomBytes,
        Family::OtherCalls,
        Family::ByteRange,
    ];

    /// The family named `name` (as in the report).
    pub fn parse(name: &str) -> Result<Self> {
        match Family::ALL.into_iter().find(|family| family.name() == name) {
            Some(family) => Ok(family),
            None => datafusion::common::plan_err!(
                "unknown request family '{name}' (mutated, deep, random-bytes, other-calls, byte-range)"
            ),
        }
    }

    /// The family's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Family::Mutated => "mutated",
            Family::Deep => "deep",
            Family::RandomBytes => "random-bytes",
            Family::OtherCalls => "other-calls",
            Family::ByteRange => "byte-range",
        }
    }
}

/// How the node answered one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Outcome {
    /// A successful answer.
    Ok,
    /// A clean refusal: a gRPC status of a proper kind, an HTTP 4xx.
    Refused,
    /// The client saw a broken answer (an h2 protocol error, status
    /// `Unknown`, an HTTP connection closed without a status line) and no
    /// panic was seen in this process.
    BrokenStream,
    /// The node panicked, whether it caught the panic or not.
    Panic,
    /// HTTP 5xx.
    ServerError,
    /// No answer within the per-request timeout.
    Hang,
    /// The node stopped answering.
    Crash,
    /// The health fragment's rows changed.
    WrongAnswer,
}

impl Outcome {
    /// Whether this outcome fails the run.
    pub fn is_failure(self) -> bool {
        !matches!(self, Outcome::Ok | Outcome::Refused)
    }

    fn name(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Refused => "refused",
            Outcome::BrokenStream => "broken-stream",
            Outcome::Panic => "panic",
            Outcome::ServerError => "server-error",
            Outcome::Hang => "hang",
            Outcome::Crash => "crash",
            Outcome::WrongAnswer => "wrong-answer",
        }
    }
}

/// One failure, with what reproduces it.
#[derive(Debug, Clone)]
pub struct Finding {
    /// Index of the request (for a health check: of the last request before it).
    pub index: usize,
    /// Its family.
    pub family: Family,
    /// What the node did.
    pub outcome: Outcome,
    /// What the request was, in words.
    pub request: String,
    /// The request's bytes, hex, truncated to [`REPRODUCER_BYTES_MAX`].
    pub bytes_hex: String,
    /// Length of the request's bytes.
    pub bytes_len: usize,
    /// The status, message or panic location seen.
    pub detail: String,
}

/// What a run found.
#[derive(Debug, Clone)]
pub struct RequestFuzzReport {
    /// The run's seed.
    pub seed: u64,
    /// Requests sent.
    pub requests: usize,
    /// Requests per family and outcome.
    pub counts: BTreeMap<(Family, Outcome), usize>,
    /// Failures (at most [`FINDINGS_KEPT_MAX`] per family and outcome).
    pub findings: Vec<Finding>,
    /// Failures in all, kept or not.
    pub failures: usize,
    /// Health checks run, and how many failed.
    pub health_checks: (usize, usize),
    /// Peak resident memory of this process (with an embedded node, the node's too).
    pub peak_rss_mib: f64,
    /// Wall time of the run.
    pub elapsed: Duration,
    /// Wall time spent building and sending each family's requests.
    pub family_elapsed: BTreeMap<Family, Duration>,
}

impl RequestFuzzReport {
    /// Requests per second.
    pub fn rate(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// The report as text: counts, then every kept failure with its reproducer.
    pub fn summary(&self) -> String {
        let mut text = String::new();
        let _ = writeln!(
            text,
            "request fuzz, seed {}: {} requests in {:.1} s ({:.1}/s), peak RSS {:.0} MiB, \
             health checks {} ({} failed), {} failures",
            self.seed,
            self.requests,
            self.elapsed.as_secs_f64(),
            self.rate(),
            self.peak_rss_mib,
            self.health_checks.0,
            self.health_checks.1,
            self.failures
        );
        for family in Family::ALL {
            let seconds = self
                .family_elapsed
                .get(&family)
                .map_or(0.0, Duration::as_secs_f64);
            let mut line = format!("  {:<13} {seconds:>7.1} s", family.name());
            for ((counted, outcome), count) in &self.counts {
                if *counted == family {
                    let _ = write!(line, " {}={count}", outcome.name());
                }
            }
            let _ = writeln!(text, "{line}");
        }
        for finding in &self.findings {
            let _ = writeln!(
                text,
                "  {} {} at request {} ({}): {}\n    reproduce: --seed {} --only {}\n    bytes ({}): {}",
                finding.family.name(),
                finding.outcome.name(),
                finding.index,
                finding.request,
                finding.detail,
                self.seed,
                finding.index,
                finding.bytes_len,
                finding.bytes_hex,
            );
        }
        text
    }
}

/// Panics seen in this process since the hook was installed, as
/// "message at file:line".
static PANICS: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn panics_take() -> Vec<String> {
    std::mem::take(
        &mut *PANICS
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()),
    )
}

/// A panic hook, as `std::panic::take_hook` returns it.
type PanicHook = Box<dyn Fn(&std::panic::PanicHookInfo<'_>) + Sync + Send + 'static>;

/// Record every panic of the process instead of printing it: an embedded
/// node panicking inside a task it guards would otherwise go unseen.
struct PanicRecorder {
    previous: Option<PanicHook>,
}

impl PanicRecorder {
    fn install() -> Self {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(|info| {
            let message = sieve_compute::panic_message(info.payload());
            let location = info
                .location()
                .map(|location| format!("{}:{}", location.file(), location.line()))
                .unwrap_or_default();
            let first_line: String = message
                .lines()
                .next()
                .unwrap_or_default()
                .chars()
                .take(300)
                .collect();
            PANICS
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .push(format!("{first_line} at {location}"));
        }));
        panics_take();
        Self {
            previous: Some(previous),
        }
    }
}

impl Drop for PanicRecorder {
    fn drop(&mut self) {
        if let Some(previous) = self.previous.take() {
            std::panic::set_hook(previous);
        }
    }
}

/// A table as the node lists it.
#[derive(Debug, Clone)]
struct NodeTable {
    name: String,
    schema: SchemaRef,
    /// Slice numbers and their files.
    slices: Vec<(u32, String, u32)>,
}

/// The node's catalog and addresses.
#[derive(Debug, Clone)]
struct NodeView {
    tables: Vec<NodeTable>,
    range_address: SocketAddr,
}

/// One request.
#[derive(Debug, Clone)]
enum Request {
    DoGet(Vec<u8>),
    DoAction {
        kind: String,
        body: Vec<u8>,
    },
    GetFlightInfo(FlightDescriptor),
    GetSchema(FlightDescriptor),
    ListFlights(Vec<u8>),
    /// Raw bytes of one HTTP/1.1 request.
    Http(Vec<u8>),
}

impl Request {
    fn bytes(&self) -> Vec<u8> {
        match self {
            Request::DoGet(bytes) | Request::ListFlights(bytes) | Request::Http(bytes) => {
                bytes.clone()
            }
            Request::DoAction { kind, body } => {
                let mut bytes = kind.as_bytes().to_vec();
                bytes.push(b'|');
                bytes.extend_from_slice(body);
                bytes
            }
            Request::GetFlightInfo(descriptor) | Request::GetSchema(descriptor) => {
                descriptor.encode_to_vec()
            }
        }
    }

    fn call(&self) -> &'static str {
        match self {
            Request::DoGet(_) => "DoGet",
            Request::DoAction { .. } => "DoAction",
            Request::GetFlightInfo(_) => "GetFlightInfo",
            Request::GetSchema(_) => "GetSchema",
            Request::ListFlights(_) => "ListFlights",
            Request::Http(_) => "HTTP",
        }
    }
}

/// A generated request and what it is, in words.
struct Generated {
    request: Request,
    what: String,
}

/// Valid fragments to mutate, and the pieces to move between tables.
struct Pool {
    /// (table index, slice, encoded body, predicate bytes if any, what).
    bodies: Vec<PoolBody>,
}

struct PoolBody {
    table: usize,
    body: FragmentBody,
    what: String,
}

/// Run the fuzzer.
pub async fn run_request_fuzz(options: &RequestFuzzOptions) -> Result<RequestFuzzReport> {
    let started = Instant::now();
    let (_cluster, url) = match &options.target {
        RequestTarget::Embedded(data) => {
            std::fs::create_dir_all(data)?;
            let root = data.join(format!(
                "tpch-sf{EMBEDDED_SCALE_FACTOR}-request-fuzz-v{}",
                sieve_format::FORMAT_VERSION
            ));
            let layout = sieve_format::SliceLayout {
                slice_rows_max: 20_000,
                ..sieve_format::SliceLayout::default()
            };
            let root = generated_tpch(&root, EMBEDDED_SCALE_FACTOR, 1, 1, &layout)?;
            let cluster = EmbeddedCluster::start(&root, 1).await?;
            let url = cluster.urls()[0].clone();
            (Some(cluster), url)
        }
        RequestTarget::Node(url) => (None, url.clone()),
    };
    let authorization = options
        .authorization
        .clone()
        .or_else(|| _cluster.as_ref().and_then(embedded_authorization));
    let mut client = connect(&url).await?;
    let view = node_view(&mut client, authorization.as_deref()).await?;
    let pool = build_pool(&view)?;
    let health = health_ticket(&view)?;
    let expected = run_health_fragment(&mut client, authorization.as_deref(), &health)
        .await
        .map_err(|error| {
            DataFusionError::Execution(format!("health fragment before the run: {error}"))
        })?;
    if expected.is_empty() {
        return exec_err!("the health fragment returns no rows before the run");
    }

    if options.families.is_empty() {
        return datafusion::common::plan_err!("no request family to fuzz");
    }
    let recorder = PanicRecorder::install();
    let mut journal = match &options.journal {
        Some(path) => Some(std::fs::File::create(path)?),
        None => None,
    };
    let mut report = RequestFuzzReport {
        seed: options.seed,
        requests: 0,
        counts: BTreeMap::new(),
        findings: vec![],
        failures: 0,
        health_checks: (0, 0),
        peak_rss_mib: 0.0,
        elapsed: Duration::ZERO,
        family_elapsed: BTreeMap::new(),
    };
    let indices: Vec<usize> = match options.only {
        Some(index) => vec![index],
        None => (0..options.requests).collect(),
    };
    let mut crashed = false;
    for (position, &index) in indices.iter().enumerate() {
        let family = options.families[index % options.families.len()];
        let request_started = Instant::now();
        let mut random = SeededRandom::new(SeededRandom::derive_seed(options.seed, index as u64));
        let generated = generate(
            family,
            &mut random,
            &view,
            &pool,
            authorization.as_deref(),
            options.expression_depth_max.min(CHAIN_DEPTH_MAX),
        )
        .await?;
        let bytes = generated.request.bytes();
        if let Some(journal) = journal.as_mut() {
            use std::io::Write as _;
            writeln!(
                journal,
                "{index} {} {} {}",
                family.name(),
                generated.what,
                hex_truncated(&bytes)
            )?;
            journal.flush()?;
        }
        panics_take();
        let (mut outcome, mut detail) = send(
            &mut client,
            &view,
            authorization.as_deref(),
            &generated.request,
            options.request_timeout,
        )
        .await;
        let panics = panics_take();
        if !panics.is_empty() {
            outcome = outcome.max(Outcome::Panic);
            detail = format!("{detail}; panicked: {}", panics.join(" | "));
        }
        if matches!(
            outcome,
            Outcome::BrokenStream | Outcome::Panic | Outcome::Hang
        ) || detail.contains("transport")
        {
            if let Err(error) = list_flights(&mut client, authorization.as_deref()).await {
                outcome = Outcome::Crash;
                detail = format!("{detail}; then ListFlights failed: {error}");
            }
        }
        *report.family_elapsed.entry(family).or_default() += request_started.elapsed();
        if let Some(journal) = journal.as_mut() {
            use std::io::Write as _;
            let detail: String = detail.chars().take(300).collect();
            writeln!(journal, "  -> {} {detail}", outcome.name())?;
        }
        report.requests += 1;
        *report.counts.entry((family, outcome)).or_default() += 1;
        if outcome.is_failure() {
            record(
                &mut report,
                Finding {
                    index,
                    family,
                    outcome,
                    request: format!("{} {}", generated.request.call(), generated.what),
                    bytes_hex: hex_truncated(&bytes),
                    bytes_len: bytes.len(),
                    detail,
                },
            );
        }
        if outcome == Outcome::Crash {
            break;
        }
        let last = position + 1 == indices.len();
        if (position + 1) % options.health_every.max(1) == 0 || last {
            if let Some(finding) = health_check(
                &mut client,
                authorization.as_deref(),
                &health,
                &expected,
                index,
                family,
            )
            .await
            {
                report.health_checks.1 += 1;
                crashed |= finding.outcome == Outcome::Crash;
                record(&mut report, finding);
            }
            report.health_checks.0 += 1;
            if crashed {
                break;
            }
        }
    }
    drop(recorder);
    report.peak_rss_mib = peak_rss_mib();
    report.elapsed = started.elapsed();
    Ok(report)
}

/// The embedded cluster's own `authorization` value (`Bearer <secret>`).
fn embedded_authorization(cluster: &EmbeddedCluster) -> Option<String> {
    Some(cluster.secret().bearer())
}

fn record(report: &mut RequestFuzzReport, finding: Finding) {
    report.failures += 1;
    let kept = report
        .findings
        .iter()
        .filter(|kept| kept.family == finding.family && kept.outcome == finding.outcome)
        .count();
    if kept < FINDINGS_KEPT_MAX {
        report.findings.push(finding);
    }
}

/// The report as a result: an error naming the failures, if any.
pub fn request_failures_as_error(report: &RequestFuzzReport) -> Result<()> {
    if report.failures == 0 {
        Ok(())
    } else {
        exec_err!(
            "{} requests broke the storage node (panics, crashes, hangs, 5xx or wrong answers)",
            report.failures
        )
    }
}

fn hex_truncated(bytes: &[u8]) -> String {
    let mut text = String::new();
    for byte in bytes.iter().take(REPRODUCER_BYTES_MAX) {
        let _ = write!(text, "{byte:02x}");
    }
    if bytes.len() > REPRODUCER_BYTES_MAX {
        text.push_str("...");
    }
    text
}

fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|line| line.starts_with("VmHWM:"))
                .and_then(|line| line.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<f64>().ok())
        })
        .map(|kib| kib / 1024.0)
        .unwrap_or(0.0)
}

async fn connect(url: &str) -> Result<FlightServiceClient<Channel>> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())
        .map_err(|error| DataFusionError::Execution(format!("bad node URL {url}: {error}")))?
        .connect()
        .await
        .map_err(|error| DataFusionError::Execution(format!("cannot connect to {url}: {error}")))?;
    // A 4 MiB ticket and its answers must pass the client's own limits.
    Ok(FlightServiceClient::new(channel)
        .max_decoding_message_size(64 * 1024 * 1024)
        .max_encoding_message_size(64 * 1024 * 1024))
}

fn with_auth<T>(message: T, authorization: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(value) = authorization {
        if let Ok(value) = value.parse() {
            request.metadata_mut().insert("authorization", value);
        }
    }
    request
}

async fn list_flights(
    client: &mut FlightServiceClient<Channel>,
    authorization: Option<&str>,
) -> std::result::Result<Vec<arrow_flight::FlightInfo>, String> {
    let call = async {
        let mut stream = client
            .list_flights(with_auth(Criteria::default(), authorization))
            .await?
            .into_inner();
        let mut infos = vec![];
        while let Some(info) = stream.next().await {
            infos.push(info?);
        }
        Ok::<_, tonic::Status>(infos)
    };
    match tokio::time::timeout(Duration::from_millis(REQUEST_TIMEOUT_MS_DEFAULT), call).await {
        Ok(Ok(infos)) if !infos.is_empty() => Ok(infos),
        Ok(Ok(_)) => Err("no tables listed".into()),
        Ok(Err(status)) => Err(format!("{status}")),
        Err(_) => Err("ListFlights timed out".into()),
    }
}

async fn node_view(
    client: &mut FlightServiceClient<Channel>,
    authorization: Option<&str>,
) -> Result<NodeView> {
    let infos = list_flights(client, authorization)
        .await
        .map_err(DataFusionError::Execution)?;
    let mut tables = vec![];
    let mut range_address = None;
    for info in infos {
        let name = info
            .flight_descriptor
            .as_ref()
            .and_then(|descriptor| descriptor.path.first().cloned())
            .unwrap_or_default();
        let mut slices = vec![];
        for endpoint in &info.endpoint {
            let summary: sieve_format::SliceSummary =
                serde_json::from_slice(&endpoint.app_metadata)
                    .map_err(|error| DataFusionError::Execution(error.to_string()))?;
            if let Some(location) = endpoint.location.first() {
                // http://host:port/slices/table/file
                let rest = location.uri.trim_start_matches("http://");
                if let Some((address, _)) = rest.split_once('/') {
                    range_address = address.parse().ok().or(range_address);
                }
            }
            slices.push((summary.slice, summary.file, summary.row_groups));
        }
        let schema = Arc::new(
            info.try_decode_schema()
                .map_err(|error| DataFusionError::Execution(error.to_string()))?,
        );
        tables.push(NodeTable {
            name,
            schema,
            slices,
        });
    }
    let range_address = range_address.ok_or_else(|| {
        DataFusionError::Execution("the node lists no byte-range location".into())
    })?;
    Ok(NodeView {
        tables,
        range_address,
    })
}

fn is_string(data_type: &DataType) -> bool {
    matches!(
        data_type,
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
    )
}

/// Predicates over one column of `data_type`, as SQL.
fn predicates_for(name: &str, data_type: &DataType) -> Vec<String> {
    if data_type.is_numeric() {
        vec![
            format!("{name} > 10 AND {name} < 1000"),
            format!("{name} + 1 <= 50 OR {name} * 2 = 8"),
            format!("{name} IN (1, 2, 3, 5, 8, 13)"),
            format!("{name} NOT IN (0, 7)"),
            format!("CASE WHEN {name} > 20 THEN {name} ELSE 0 END > 5"),
            format!("CAST({name} AS DOUBLE) / 3.0 >= 1.5"),
            format!("abs({name} - 25) < 10"),
            format!("{name} IS NOT NULL AND {name} % 7 = 3"),
        ]
    } else if is_string(data_type) {
        vec![
            format!("{name} LIKE '%a%'"),
            format!("{name} NOT LIKE 'S%'"),
            format!("{name} IN ('MAIL', 'SHIP', 'AIR', 'ASIA')"),
            format!("upper({name}) = 'AIR'"),
            format!("length({name}) > 5"),
            format!("CASE WHEN {name} LIKE 'A%' THEN 1 ELSE 0 END = 1"),
            format!("{name} >= 'M' AND {name} < 'T'"),
        ]
    } else if matches!(data_type, DataType::Date32) {
        vec![
            format!("{name} < DATE '1995-01-01'"),
            format!("{name} BETWEEN DATE '1994-01-01' AND DATE '1994-12-31'"),
        ]
    } else {
        vec![format!("{name} IS NOT NULL")]
    }
}

fn physical_predicate(
    context: &SessionContext,
    schema: &SchemaRef,
    sql: &str,
) -> Result<Arc<dyn PhysicalExpr>> {
    let df_schema = DFSchema::try_from(Arc::clone(schema))?;
    let expr = context.parse_sql_expr(sql, &df_schema)?;
    context.create_physical_expr(expr, &df_schema)
}

/// A partial aggregation over `projection` of `schema`: group by the first
/// projected column, aggregate the second.
fn partial_aggregate(schema: &Schema, projection: &[usize]) -> Result<Arc<dyn ExecutionPlan>> {
    let slice_schema = Arc::new(schema.project(projection)?);
    let input: Arc<dyn ExecutionPlan> = Arc::new(SliceInputExec::new(Arc::clone(&slice_schema)));
    let group_name = slice_schema.field(0).name().clone();
    let value = slice_schema.field(1).clone();
    let group = PhysicalGroupBy::new_single(vec![(
        Arc::new(Column::new(&group_name, 0)) as _,
        group_name,
    )]);
    let value_column: Arc<dyn PhysicalExpr> = Arc::new(Column::new(value.name(), 1));
    // The functions as the compute node plans them (Sieve's `min`, `max`
    // and `sum`, which the storage nodes decode these names to).
    let [min, max] = sieve_fragment::total_order_min_max();
    let mut functions = vec![
        datafusion::functions_aggregate::count::count_udaf(),
        Arc::new(min),
        Arc::new(max),
    ];
    if value.data_type().is_numeric() {
        functions.push(Arc::new(sieve_fragment::checked_sum()));
        functions.push(datafusion::functions_aggregate::average::avg_udaf());
    }
    let mut aggregates = vec![];
    for function in functions {
        let alias = format!("{}({})", function.name(), value.name());
        aggregates.push(Arc::new(
            AggregateExprBuilder::new(function, vec![Arc::clone(&value_column)])
                .schema(Arc::clone(&slice_schema))
                .alias(alias)
                .build()?,
        ));
    }
    let filters = vec![None; aggregates.len()];
    Ok(Arc::new(AggregateExec::try_new(
        AggregateMode::Partial,
        group,
        aggregates,
        filters,
        input,
        slice_schema,
    )?))
}

fn build_pool(view: &NodeView) -> Result<Pool> {
    let context = SessionContext::new();
    let mut bodies = vec![];
    for (table_index, table) in view.tables.iter().enumerate() {
        let schema = &table.schema;
        let columns = schema.fields().len();
        let mut fragments: Vec<(Fragment, String)> = vec![(
            Fragment {
                projection: (0..columns).collect(),
                predicate: None,
                aggregate: None,
            },
            "all columns".into(),
        )];
        for (index, field) in schema.fields().iter().enumerate() {
            for sql in predicates_for(field.name(), field.data_type()) {
                let Ok(predicate) = physical_predicate(&context, schema, &sql) else {
                    continue;
                };
                fragments.push((
                    Fragment {
                        projection: vec![index, (index + 1) % columns],
                        predicate: Some(predicate),
                        aggregate: None,
                    },
                    format!("where {sql}"),
                ));
            }
        }
        // Partial aggregations: group by a string or key column, aggregate a number.
        for group in 0..columns.min(4) {
            for value in 0..columns {
                if value == group || !schema.field(value).data_type().is_numeric() {
                    continue;
                }
                let projection = vec![group, value];
                let Ok(aggregate) = partial_aggregate(schema, &projection) else {
                    continue;
                };
                fragments.push((
                    Fragment {
                        projection,
                        predicate: None,
                        aggregate: Some(aggregate),
                    },
                    format!("partial aggregate by {group} of {value}"),
                ));
                break;
            }
        }
        for (fragment, what) in fragments {
            // What the compute side would refuse to send is not a valid fragment.
            let Ok(bytes) = fragment.encode_body(schema) else {
                continue;
            };
            let body = FragmentBody::decode(bytes.as_slice())
                .map_err(|error| DataFusionError::Execution(error.to_string()))?;
            bodies.push(PoolBody {
                table: table_index,
                body,
                what: format!("{}: {what}", table.name),
            });
        }
    }
    if bodies.is_empty() {
        return exec_err!("no valid fragment could be built for the node's tables");
    }
    Ok(Pool { bodies })
}

/// The health fragment: nation where n_regionkey = 1 if the node has TPC-H,
/// else the first table's first column.
fn health_ticket(view: &NodeView) -> Result<Vec<u8>> {
    let context = SessionContext::new();
    let (table, fragment) = match view.tables.iter().find(|table| table.name == "nation") {
        Some(table) => {
            let predicate = physical_predicate(&context, &table.schema, "n_regionkey = 1")?;
            (
                table,
                Fragment {
                    projection: (0..table.schema.fields().len()).collect(),
                    predicate: Some(predicate),
                    aggregate: None,
                },
            )
        }
        None => (
            &view.tables[0],
            Fragment {
                projection: vec![0],
                predicate: None,
                aggregate: None,
            },
        ),
    };
    let body = fragment.encode_body(&table.schema)?;
    let slice = table.slices.first().map(|slice| slice.0).unwrap_or(1);
    Ok(FragmentEnvelope::new(table.name.clone(), slice, body).encode_to_vec())
}

/// The health fragment's answer when the node shipped the slice raw.
const SERVED_RAW: &str = "the node served the health fragment raw";

/// Tries of the health fragment while the node serves it raw (it does when
/// its pushdown workers are busy, say with a request that timed out on the
/// client but still runs), half a second apart.
const HEALTH_RAW_TRIES_MAX: usize = 60;

/// The health fragment's rows, sorted, trying again while the node serves
/// it raw (raw pages are not decoded here).
async fn run_health_fragment(
    client: &mut FlightServiceClient<Channel>,
    authorization: Option<&str>,
    ticket: &[u8],
) -> std::result::Result<Vec<String>, String> {
    let mut tries = 0;
    loop {
        match run_health_fragment_once(client, authorization, ticket).await {
            Err(error) if error == SERVED_RAW && tries + 1 < HEALTH_RAW_TRIES_MAX => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            answer => return answer,
        }
    }
}

async fn run_health_fragment_once(
    client: &mut FlightServiceClient<Channel>,
    authorization: Option<&str>,
    ticket: &[u8],
) -> std::result::Result<Vec<String>, String> {
    let served_raw = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = Arc::clone(&served_raw);
    let call = async {
        let stream = client
            .do_get(with_auth(Ticket::new(ticket.to_vec()), authorization))
            .await
            .map_err(|status| status.to_string())?
            .into_inner();
        let batches: Vec<RecordBatch> = FlightRecordBatchStream::new_from_flight_data(
            // Slice messages (metrics, raw pages) travel as app_metadata
            // alone; the health fragment is small enough to be processed.
            stream
                .map(|message| message.map_err(FlightError::from))
                .try_filter(move |message| {
                    let metadata_only =
                        message.data_header.is_empty() && !message.app_metadata.is_empty();
                    if metadata_only {
                        let raw = matches!(
                            SliceMessage::decode(message.app_metadata.as_ref()),
                            Ok(SliceMessage {
                                kind: Some(SliceMessageKind::Raw(_))
                            })
                        );
                        flag.fetch_or(raw, std::sync::atomic::Ordering::Relaxed);
                    }
                    futures::future::ready(!metadata_only)
                }),
        )
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<std::result::Result<_, _>>()
        .map_err(|error| error.to_string())?;
        if served_raw.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(SERVED_RAW.to_string());
        }
        rows_as_text(&batches, true).map_err(|error| error.to_string())
    };
    match tokio::time::timeout(Duration::from_millis(REQUEST_TIMEOUT_MS_DEFAULT), call).await {
        Ok(result) => result,
        Err(_) => Err("the health fragment timed out".into()),
    }
}

async fn health_check(
    client: &mut FlightServiceClient<Channel>,
    authorization: Option<&str>,
    ticket: &[u8],
    expected: &[String],
    index: usize,
    family: Family,
) -> Option<Finding> {
    let finding = |outcome, detail| Finding {
        index,
        family,
        outcome,
        request: "health check after this request".into(),
        bytes_hex: hex_truncated(ticket),
        bytes_len: ticket.len(),
        detail,
    };
    if let Err(error) = list_flights(client, authorization).await {
        return Some(finding(Outcome::Crash, format!("ListFlights: {error}")));
    }
    match run_health_fragment(client, authorization, ticket).await {
        Ok(rows) if rows == expected => None,
        Ok(rows) => Some(finding(
            Outcome::WrongAnswer,
            format!(
                "{} rows, expected {}; first: {:?}",
                rows.len(),
                expected.len(),
                rows.first()
            ),
        )),
        // Every pushdown worker still busy after half a minute: a request
        // the client gave up on holds the node.
        Err(error) if error == SERVED_RAW => Some(finding(
            Outcome::Hang,
            format!("{error} for {HEALTH_RAW_TRIES_MAX} tries, half a second apart"),
        )),
        Err(error) => Some(finding(Outcome::WrongAnswer, format!("failed: {error}"))),
    }
}

/// Send one request and classify the answer.
async fn send(
    client: &mut FlightServiceClient<Channel>,
    view: &NodeView,
    authorization: Option<&str>,
    request: &Request,
    timeout: Duration,
) -> (Outcome, String) {
    let call = async {
        match request {
            Request::Http(bytes) => http_exchange(view.range_address, bytes).await,
            _ => match flight_call(client, authorization, request).await {
                Ok(()) => (Outcome::Ok, String::new()),
                Err(status) => classify_status(&status),
            },
        }
    };
    match tokio::time::timeout(timeout, call).await {
        Ok(answer) => answer,
        Err(_) => (
            Outcome::Hang,
            format!("no answer within {} ms", timeout.as_millis()),
        ),
    }
}

fn classify_status(status: &tonic::Status) -> (Outcome, String) {
    let message = status.message().to_ascii_lowercase();
    let detail = format!("{:?}: {}", status.code(), status.message());
    let broken = message.contains("h2 protocol error")
        || message.contains("stream no longer needed")
        || message.contains("error reading a body")
        || message.contains("connection reset");
    let outcome = match status.code() {
        Code::Internal if message.contains("panic") => Outcome::Panic,
        Code::Unknown => Outcome::BrokenStream,
        Code::Internal | Code::Unavailable | Code::Cancelled if broken => Outcome::BrokenStream,
        _ => Outcome::Refused,
    };
    (outcome, detail)
}

/// Make the call and drain its answer; the first error is returned.
async fn flight_call(
    client: &mut FlightServiceClient<Channel>,
    authorization: Option<&str>,
    request: &Request,
) -> std::result::Result<(), tonic::Status> {
    match request {
        Request::DoGet(ticket) => {
            let mut stream = client
                .do_get(with_auth(Ticket::new(ticket.clone()), authorization))
                .await?
                .into_inner();
            while let Some(message) = stream.next().await {
                message?;
            }
        }
        Request::DoAction { kind, body } => {
            let action = Action::new(kind.clone(), body.clone());
            let mut stream = client
                .do_action(with_auth(action, authorization))
                .await?
                .into_inner();
            while let Some(message) = stream.next().await {
                message?;
            }
        }
        Request::GetFlightInfo(descriptor) => {
            client
                .get_flight_info(with_auth(descriptor.clone(), authorization))
                .await?;
        }
        Request::GetSchema(descriptor) => {
            client
                .get_schema(with_auth(descriptor.clone(), authorization))
                .await?;
        }
        Request::ListFlights(expression) => {
            let criteria = Criteria {
                expression: expression.clone().into(),
            };
            let mut stream = client
                .list_flights(with_auth(criteria, authorization))
                .await?
                .into_inner();
            while let Some(message) = stream.next().await {
                message?;
            }
        }
        Request::Http(_) => unreachable!("HTTP requests do not go through Flight"),
    }
    Ok(())
}

/// Longest HTTP answer head read; the body is not read.
const HTTP_HEAD_BYTES_MAX: usize = 64 * 1024;

async fn http_exchange(address: SocketAddr, request: &[u8]) -> (Outcome, String) {
    let mut stream = match tokio::net::TcpStream::connect(address).await {
        Ok(stream) => stream,
        Err(error) => return (Outcome::Crash, format!("connect: {error}")),
    };
    // The server may answer (and close) before reading a long request.
    let written = stream.write_all(request).await;
    let mut answer = Vec::new();
    let mut buffer = [0u8; 8192];
    loop {
        match stream.read(&mut buffer).await {
            Ok(0) => break,
            Ok(read) => {
                answer.extend_from_slice(&buffer[..read]);
                if answer.windows(4).any(|window| window == b"\r\n\r\n")
                    || answer.len() >= HTTP_HEAD_BYTES_MAX
                {
                    break;
                }
            }
            Err(_) => break,
        }
    }
    let text = String::from_utf8_lossy(&answer);
    let status_line = text.lines().next().unwrap_or_default().to_string();
    let code: Option<u16> = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok());
    match code {
        Some(code) if (200..300).contains(&code) => (Outcome::Ok, status_line),
        Some(code) if code >= 500 => (Outcome::ServerError, status_line),
        Some(_) => (Outcome::Refused, status_line),
        None => (
            Outcome::BrokenStream,
            format!(
                "connection closed without a status line (write: {:?})",
                written.err()
            ),
        ),
    }
}

/// Generate request of `family`.
async fn generate(
    family: Family,
    random: &mut SeededRandom,
    view: &NodeView,
    pool: &Pool,
    authorization: Option<&str>,
    depth_max: usize,
) -> Result<Generated> {
    Ok(match family {
        Family::Mutated => mutated(random, view, pool),
        Family::Deep => deep(random, view, depth_max).await?,
        Family::RandomBytes => {
            let length = match random.below(4) {
                0 => random.below(16),
                1 => random.below(256),
                _ => random.below(RANDOM_BYTES_MAX + 1),
            };
            Generated {
                request: Request::DoGet(random_bytes(random, length)),
                what: format!("{length} random bytes"),
            }
        }
        Family::OtherCalls => other_call(random, view),
        Family::ByteRange => byte_range(random, view, authorization),
    })
}

fn random_bytes(random: &mut SeededRandom, length: usize) -> Vec<u8> {
    (0..length).map(|_| random.next_u64() as u8).collect()
}

fn random_bytes_upto(random: &mut SeededRandom, length_max: usize) -> Vec<u8> {
    let length = random.below(length_max);
    random_bytes(random, length)
}

/// Values that break parsers more often than random ones.
const INTERESTING_BYTES: [u8; 6] = [0x00, 0xff, 0x7f, 0x80, 0x01, 0xfe];

/// A protobuf varint of `value`.
fn varint(mut value: u64) -> Vec<u8> {
    let mut bytes = vec![];
    loop {
        let byte = (value & 0x7f) as u8;
        value >>= 7;
        if value == 0 {
            bytes.push(byte);
            return bytes;
        }
        bytes.push(byte | 0x80);
    }
}

/// Mutate `bytes` in place at the byte level; returns what was done.
fn mutate_bytes(random: &mut SeededRandom, bytes: &mut Vec<u8>) -> String {
    let many = random.percent(20);
    let mutations = 1 + random.below(if many { 16 } else { 3 });
    let mut done = vec![];
    for _ in 0..mutations {
        let at = random.below(bytes.len().max(1));
        let kind = random.below(8);
        if bytes.is_empty() && kind != 3 && kind != 6 {
            bytes.push(random.next_u64() as u8);
            done.push("grow".to_string());
            continue;
        }
        match kind {
            0 => {
                bytes[at] ^= 1 << random.below(8);
                done.push(format!("flip@{at}"));
            }
            1 | 2 => {
                bytes[at] = *random.pick(&INTERESTING_BYTES);
                done.push(format!("set@{at}"));
            }
            3 => {
                let count = 1 + random.below(8);
                let inserted = random_bytes(random, count);
                let at = at.min(bytes.len());
                bytes.splice(at..at, inserted);
                done.push(format!("insert{count}@{at}"));
            }
            4 => {
                let count = (1 + random.below(8)).min(bytes.len() - at);
                bytes.drain(at..at + count);
                done.push(format!("delete{count}@{at}"));
            }
            5 => {
                bytes.truncate(at);
                done.push(format!("truncate@{at}"));
            }
            6 => {
                // Duplicate a stretch: a repeated protobuf field, often.
                let length = (1 + random.below(64)).min(bytes.len().saturating_sub(at));
                let copy: Vec<u8> = bytes[at..at + length].to_vec();
                let to = random.below(bytes.len() + 1);
                bytes.splice(to..to, copy);
                done.push(format!("duplicate{length}@{at}->{to}"));
            }
            _ => {
                // A huge varint where a length probably was.
                let huge = *random.pick(&[
                    u64::MAX,
                    u64::from(u32::MAX),
                    1 << 31,
                    1 << 35,
                    FRAGMENT_BYTES_MAX as u64 * 2,
                ]);
                let length = varint(huge);
                let end = (at + 1).min(bytes.len());
                bytes.splice(at..end, length);
                done.push(format!("varint{huge}@{at}"));
            }
        }
    }
    done.join(",")
}

/// Encode `body` with `predicate` replaced by raw bytes (field 3, length-delimited).
fn body_with_raw_predicate(body: &FragmentBody, predicate: &[u8]) -> Vec<u8> {
    let mut without = body.clone();
    without.predicate = None;
    let mut bytes = without.encode_to_vec();
    bytes.push(3 << 3 | 2);
    bytes.extend(varint(predicate.len() as u64));
    bytes.extend_from_slice(predicate);
    bytes
}

/// Encode `body` with `aggregate` replaced by raw bytes (field 4).
fn body_with_raw_aggregate(body: &FragmentBody, aggregate: &[u8]) -> Vec<u8> {
    let mut without = body.clone();
    without.aggregate = None;
    let mut bytes = without.encode_to_vec();
    bytes.push(4 << 3 | 2);
    bytes.extend(varint(aggregate.len() as u64));
    bytes.extend_from_slice(aggregate);
    bytes
}

fn envelope_for(
    view: &NodeView,
    table: usize,
    random: &mut SeededRandom,
    body: Vec<u8>,
) -> FragmentEnvelope {
    let table = &view.tables[table];
    let slice = table.slices[random.below(table.slices.len())].0;
    let mut envelope = FragmentEnvelope::new(table.name.clone(), slice, body);
    // Sometimes heartbeats, at any interval (the node bounds it below).
    if random.below(4) == 0 {
        envelope.heartbeat_ms = random.below(100) as u32;
    }
    envelope
}

fn mutated(random: &mut SeededRandom, view: &NodeView, pool: &Pool) -> Generated {
    let original = &pool.bodies[random.below(pool.bodies.len())];
    let mut body = original.body.clone();
    let mut envelope = envelope_for(view, original.table, random, body.encode_to_vec());
    let what = match random.below(15) {
        0..=2 => {
            let mut bytes = envelope.encode_to_vec();
            let done = mutate_bytes(random, &mut bytes);
            return Generated {
                request: Request::DoGet(bytes),
                what: format!("{} envelope bytes {done}", original.what),
            };
        }
        3..=5 => {
            let mut bytes = body.encode_to_vec();
            let done = mutate_bytes(random, &mut bytes);
            envelope.body = bytes;
            format!("body bytes {done}")
        }
        6..=8 => match (&body.predicate, &body.aggregate) {
            (Some(predicate), _) => {
                let mut bytes = predicate.encode_to_vec();
                let done = mutate_bytes(random, &mut bytes);
                envelope.body = body_with_raw_predicate(&body, &bytes);
                format!("predicate bytes {done}")
            }
            (None, Some(aggregate)) => {
                let mut bytes = aggregate.encode_to_vec();
                let done = mutate_bytes(random, &mut bytes);
                envelope.body = body_with_raw_aggregate(&body, &bytes);
                format!("aggregate bytes {done}")
            }
            (None, None) => {
                let mut bytes = body.encode_to_vec();
                let done = mutate_bytes(random, &mut bytes);
                envelope.body = bytes;
                format!("body bytes {done}")
            }
        },
        9 => {
            // Another table's predicate or aggregation, with this table's
            // fingerprint: column indices and types that do not fit.
            let other = &pool.bodies[random.below(pool.bodies.len())];
            let target = random.below(view.tables.len());
            let mut moved = other.body.clone();
            moved.schema_fingerprint = schema_fingerprint(&view.tables[target].schema);
            if random.percent(50) {
                moved.projection = body.projection.clone();
            }
            envelope = envelope_for(view, target, random, moved.encode_to_vec());
            format!(
                "body of {} sent to {}",
                other.what, view.tables[target].name
            )
        }
        10 => {
            let columns = view.tables[original.table].schema.fields().len() as u32;
            let what = match random.below(4) {
                0 => {
                    body.projection = vec![random.below(columns as usize) as u32; 10_000];
                    "projection of one column 10,000 times"
                }
                1 => {
                    body.projection = vec![columns + random.below(3) as u32];
                    "projection just out of range"
                }
                2 => {
                    body.projection = vec![u32::MAX, 0];
                    "projection u32::MAX"
                }
                _ => {
                    body.projection = vec![];
                    "empty projection"
                }
            };
            envelope.body = body.encode_to_vec();
            what.to_string()
        }
        11 => {
            let groups = view.tables[original.table].slices[0].2;
            let what = match random.below(4) {
                0 => {
                    envelope.row_groups = (0..100_000).map(|group| group % groups.max(1)).collect();
                    "100,000 row groups"
                }
                1 => {
                    envelope.row_groups = vec![u32::MAX];
                    "row group u32::MAX"
                }
                2 => {
                    envelope.row_groups = vec![groups, groups + 1];
                    "row groups just out of range"
                }
                _ => {
                    envelope.row_groups = vec![0; 50_000];
                    "row group 0 50,000 times"
                }
            };
            what.to_string()
        }
        12 => match random.below(4) {
            0 => {
                envelope.version = *random.pick(&[0, 3, 5, u32::MAX]);
                format!("version {}", envelope.version)
            }
            1 => {
                envelope.ipc_codec = *random.pick(&[4, 5, 255, u32::MAX]);
                format!("codec {}", envelope.ipc_codec)
            }
            2 => {
                envelope.slice = *random.pick(&[0, u32::MAX, u32::MAX - 1, 1 << 31]);
                format!("slice {}", envelope.slice)
            }
            _ => {
                envelope.table = random
                    .pick(&["", "nosuch", "../../etc/passwd", "lineitem\0", "NATION"])
                    .to_string();
                format!("table {:?}", envelope.table)
            }
        },
        13 => {
            let (part, what) = join_filter_part(random, &view.tables[original.table]);
            envelope.join_filter_part = part;
            what
        }
        _ => {
            body.schema_fingerprint = random.next_u64();
            envelope.body = body.encode_to_vec();
            "random fingerprint".into()
        }
    };
    Generated {
        request: Request::DoGet(envelope.encode_to_vec()),
        what: format!("{} {what}", original.what),
    }
}

/// A join filter part (envelope field 13) for `table`: a window of a key
/// bitmap over one of its integer columns, its bytes often damaged before
/// or after compression, or a window whose decompressed size passes the
/// bound, or random bytes.
fn join_filter_part(random: &mut SeededRandom, table: &NodeTable) -> (Vec<u8>, String) {
    let column = table
        .schema
        .fields()
        .iter()
        .position(|field| sieve_fragment::KeyBitmapExpr::supports(field.data_type()));
    let window = column.and_then(|column| {
        let field = table.schema.field(column);
        let keys: arrow::array::ArrayRef = Arc::new(arrow::array::Int64Array::from_iter_values(
            (0..1000).map(|_| random.below(100) as i64 * random.below(5_000) as i64),
        ));
        let bitmap = sieve_fragment::KeyBitmapExpr::try_new(
            Arc::new(Column::new(field.name(), column)),
            field.data_type().clone(),
            &keys,
        )
        .ok()?;
        let low = random.below(500_000) as i64;
        let filter: Arc<dyn PhysicalExpr> =
            Arc::new(bitmap.window(low, low + random.below(200_000) as i64));
        JoinFilterRegistration::encode(&table.name, &table.schema, &filter)
            .ok()
            .map(|(bytes, _)| bytes)
    });
    match (window, random.below(5)) {
        (Some(mut bytes), 0 | 1) => {
            let done = mutate_bytes(random, &mut bytes);
            let part = JoinFilterRegistration::compress(&bytes).unwrap_or_default();
            (part, format!("join filter part bytes {done}"))
        }
        (Some(bytes), 2) => {
            let mut part = JoinFilterRegistration::compress(&bytes).unwrap_or_default();
            let done = mutate_bytes(random, &mut part);
            (part, format!("compressed join filter part {done}"))
        }
        (Some(_), 3) => {
            let zeros = vec![0u8; sieve_fragment::JOIN_FILTER_PART_BYTES_MAX + 1];
            let part = JoinFilterRegistration::compress(&zeros).unwrap_or_default();
            (part, "join filter part past its bound".into())
        }
        _ => {
            let length = random.below(4096);
            (
                random_bytes(random, length),
                "random join filter part".into(),
            )
        }
    }
}

/// Run `work` on a thread with a [`BUILDER_STACK_BYTES`] stack: building,
/// serialising, encoding and dropping deep expressions all recurse.
async fn on_big_stack<T: Send + 'static>(
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(move || {
        std::thread::Builder::new()
            .name("request-fuzz-builder".into())
            .stack_size(BUILDER_STACK_BYTES)
            .spawn(work)
            .map_err(|error| DataFusionError::Execution(error.to_string()))?
            .join()
            .map_err(|_| DataFusionError::Execution("building a deep fragment panicked".into()))?
    })
    .await
    .map_err(|error| DataFusionError::Execution(error.to_string()))?
}

/// A body over `schema` with `predicate` encoded as given, all columns shipped.
fn body_bytes(schema: &Schema, predicate: PhysicalExprNode) -> Vec<u8> {
    FragmentBody {
        schema_fingerprint: schema_fingerprint(schema),
        projection: vec![0],
        predicate: Some(predicate),
        aggregate: None,
    }
    .encode_to_vec()
}

async fn deep(random: &mut SeededRandom, view: &NodeView, depth_max: usize) -> Result<Generated> {
    let table_index = random.below(view.tables.len());
    let table = &view.tables[table_index];
    let schema = Arc::clone(&table.schema);
    let numeric = schema
        .fields()
        .iter()
        .position(|field| field.data_type().is_numeric());
    let text = schema
        .fields()
        .iter()
        .position(|field| is_string(field.data_type()));
    let kind = random.below(5);
    let (bytes, what) = match (kind, numeric, text) {
        (0..=2, Some(column), _) => {
            // Log-uniform in 50..=5,000, with the round numbers a limit would use.
            let depth = if random.percent(30) {
                *random.pick(&[
                    63,
                    64,
                    65,
                    99,
                    100,
                    101,
                    127,
                    128,
                    129,
                    255,
                    256,
                    1000,
                    1024,
                    CHAIN_DEPTH_MAX,
                ])
            } else {
                (50.0 * (100f64).powf(random.unit())) as usize
            }
            .min(depth_max);
            let shape = random.below(3);
            let name = schema.field(column).name().clone();
            let data_type = schema.field(column).data_type().clone();
            let schema_for_thread = Arc::clone(&schema);
            let bytes = on_big_stack(move || {
                let column: Arc<dyn PhysicalExpr> = Arc::new(Column::new(&name, column));
                let one = ScalarValue::try_from(&data_type)
                    .and_then(|zero| ScalarValue::new_one(&zero.data_type()))
                    .unwrap_or(ScalarValue::Int64(Some(1)));
                let literal = || Arc::new(Literal::new(one.clone())) as Arc<dyn PhysicalExpr>;
                let comparison = || {
                    Arc::new(BinaryExpr::new(
                        Arc::clone(&column),
                        Operator::Gt,
                        literal(),
                    )) as Arc<dyn PhysicalExpr>
                };
                let mut expr: Arc<dyn PhysicalExpr> = match shape {
                    0 => comparison(),
                    1 => Arc::clone(&column),
                    _ => comparison(),
                };
                for _ in 0..depth {
                    expr = match shape {
                        // ((c > 1 AND c > 1) AND c > 1) ...: left-deep
                        0 => Arc::new(BinaryExpr::new(expr, Operator::And, comparison())),
                        // ((c + 1) + 1) ...
                        1 => Arc::new(BinaryExpr::new(expr, Operator::Plus, literal())),
                        // c > 1 OR (c > 1 OR (...)): right-deep
                        _ => Arc::new(BinaryExpr::new(comparison(), Operator::Or, expr)),
                    };
                }
                if shape == 1 {
                    expr = Arc::new(BinaryExpr::new(expr, Operator::Gt, literal()));
                }
                let node = serialize_physical_expr(&expr, &SieveCodec::new())?;
                let bytes = body_bytes(&schema_for_thread, node);
                Ok(bytes)
            })
            .await?;
            (bytes, format!("chain of depth {depth}, shape {shape}"))
        }
        (3, Some(column), _) => {
            // Mostly sizes a real join filter sends; one in twenty near the bound.
            let items = if random.percent(5) {
                *random.pick(&[100_000, 400_000])
            } else {
                *random.pick(&[100, 1_000, 10_000])
            };
            let name = schema.field(column).name().clone();
            let data_type = schema.field(column).data_type().clone();
            let schema_for_thread = Arc::clone(&schema);
            let bytes = on_big_stack(move || {
                let column: Arc<dyn PhysicalExpr> = Arc::new(Column::new(&name, column));
                let expr = serialize_physical_expr(&column, &SieveCodec::new())?;
                // Items of the column's own type, as the compute side sends them.
                let typed = |value: i64| {
                    ScalarValue::Int64(Some(value))
                        .cast_to(&data_type)
                        .unwrap_or(ScalarValue::Int64(Some(value)))
                };
                let item = serialize_physical_expr(
                    &(Arc::new(Literal::new(typed(7))) as Arc<dyn PhysicalExpr>),
                    &SieveCodec::new(),
                )?;
                let node = PhysicalExprNode {
                    expr_type: Some(ExprType::InList(Box::new(PhysicalInListNode {
                        expr: Some(Box::new(expr)),
                        list: (0..items)
                            .map(|value| {
                                let mut item = item.clone();
                                if let Some(ExprType::Literal(scalar)) = item.expr_type.as_mut() {
                                    *scalar = (&typed(value))
                                        .try_into()
                                        .unwrap_or_else(|_| scalar.clone());
                                }
                                item
                            })
                            .collect(),
                        negated: false,
                    }))),
                    expr_id: None,
                };
                Ok(body_bytes(&schema_for_thread, node))
            })
            .await?;
            (bytes, format!("IN list of {items} items"))
        }
        (_, _, Some(column)) => {
            let length = if random.percent(5) {
                *random.pick(&[
                    1024 * 1024,
                    FRAGMENT_BYTES_MAX - 1024,
                    FRAGMENT_BYTES_MAX + 1024,
                ])
            } else {
                *random.pick(&[16, 1024, 64 * 1024])
            };
            let operator = *random.pick(&[Operator::Eq, Operator::LikeMatch, Operator::Lt]);
            let fill = *random.pick(b"a%_\\");
            let name = schema.field(column).name().clone();
            let data_type = schema.field(column).data_type().clone();
            let schema_for_thread = Arc::clone(&schema);
            let bytes = on_big_stack(move || {
                let column: Arc<dyn PhysicalExpr> = Arc::new(Column::new(&name, column));
                let pattern = String::from_utf8(vec![fill; length]).unwrap_or_default();
                let value = match data_type {
                    DataType::Utf8View => ScalarValue::Utf8View(Some(pattern)),
                    DataType::LargeUtf8 => ScalarValue::LargeUtf8(Some(pattern)),
                    _ => ScalarValue::Utf8(Some(pattern)),
                };
                let expr: Arc<dyn PhysicalExpr> = Arc::new(BinaryExpr::new(
                    column,
                    operator,
                    Arc::new(Literal::new(value)),
                ));
                let node = serialize_physical_expr(&expr, &SieveCodec::new())?;
                Ok(body_bytes(&schema_for_thread, node))
            })
            .await?;
            (
                bytes,
                format!(
                    "{operator} with a {length}-byte literal of {:?}",
                    fill as char
                ),
            )
        }
        _ => {
            let length = FRAGMENT_BYTES_MAX - 64;
            (vec![0u8; length], format!("{length} zero bytes as a body"))
        }
    };
    let body_length = bytes.len();
    let envelope = envelope_for(view, table_index, random, bytes);
    Ok(Generated {
        request: Request::DoGet(envelope.encode_to_vec()),
        what: format!("{}: {what} (body {body_length} bytes)", table.name),
    })
}

fn random_text(random: &mut SeededRandom, view: &NodeView) -> String {
    match random.below(6) {
        0 => view.tables[random.below(view.tables.len())].name.clone(),
        1 => String::new(),
        2 => "../../etc/passwd".into(),
        3 => "x".repeat(random.below(200_000)),
        4 => String::from_utf8_lossy(&random_bytes_upto(random, 64)).into_owned(),
        _ => format!("{}\0{}", "stats", random.next_u64()),
    }
}

fn other_call(random: &mut SeededRandom, view: &NodeView) -> Generated {
    match random.below(4) {
        0 => {
            let kind = match random.below(10) {
                0..=3 => "stats".to_string(),
                4 | 5 => REGISTER_JOIN_FILTER_ACTION.to_string(),
                6 => RELEASE_JOIN_FILTER_ACTION.to_string(),
                _ => random_text(random, view),
            };
            let long = random.percent(10);
            let length = random.below(if long { 1 << 20 } else { 256 });
            let body = if kind == REGISTER_JOIN_FILTER_ACTION && random.percent(60) {
                // A real registration of `column IS NOT NULL`, often damaged.
                let table = &view.tables[random.below(view.tables.len())];
                let column = random.below(table.schema.fields().len().max(1));
                let filter: Arc<dyn PhysicalExpr> =
                    Arc::new(datafusion::physical_expr::expressions::IsNotNullExpr::new(
                        Arc::new(Column::new(
                            table
                                .schema
                                .fields()
                                .get(column)
                                .map_or("x", |field| field.name()),
                            column,
                        )),
                    ));
                match JoinFilterRegistration::encode(&table.name, &table.schema, &filter) {
                    Ok((mut bytes, _)) => {
                        if random.percent(60) {
                            mutate_bytes(random, &mut bytes);
                        }
                        bytes
                    }
                    Err(_) => random_bytes(random, length),
                }
            } else if random.percent(30) {
                br#"{"table":"lineitem","reset":true}"#.to_vec()
            } else {
                random_bytes(random, length)
            };
            Generated {
                what: format!("type of {} bytes, body of {}", kind.len(), body.len()),
                request: Request::DoAction { kind, body },
            }
        }
        call @ (1 | 2) => {
            let descriptor = match random.below(3) {
                0 => FlightDescriptor::new_path(
                    (0..1 + random.below(3))
                        .map(|_| random_text(random, view))
                        .collect(),
                ),
                1 => FlightDescriptor::new_cmd(random_bytes_upto(random, 1024)),
                _ => FlightDescriptor {
                    r#type: random.next_u64() as i32,
                    cmd: random_bytes_upto(random, 64).into(),
                    path: vec![random_text(random, view)],
                },
            };
            let what = format!(
                "descriptor {:?}",
                descriptor
                    .path
                    .iter()
                    .map(|path| path.len())
                    .collect::<Vec<_>>()
            );
            Generated {
                request: if call == 1 {
                    Request::GetFlightInfo(descriptor)
                } else {
                    Request::GetSchema(descriptor)
                },
                what,
            }
        }
        _ => {
            let length = random.below(4096);
            Generated {
                request: Request::ListFlights(random_bytes(random, length)),
                what: format!("criteria of {length} bytes"),
            }
        }
    }
}

fn byte_range(
    random: &mut SeededRandom,
    view: &NodeView,
    authorization: Option<&str>,
) -> Generated {
    let table = &view.tables[random.below(view.tables.len())];
    let file = &table.slices[random.below(table.slices.len())].1;
    let valid = format!("/slices/{}/{file}", table.name);
    let path = match random.below(12) {
        0..=3 => valid.clone(),
        4 => format!("/slices/{}/..%2F..%2F{file}", table.name),
        5 => format!("/slices/{}/../../../etc/passwd", table.name),
        6 => format!("/slices/{}/{file}%00.txt", table.name),
        7 => format!(
            "/slices/{}/{}",
            table.name,
            "a".repeat(random.below(100_000))
        ),
        8 => format!("/slices/%2e%2e/{file}"),
        9 => format!("{valid}/extra"),
        10 => format!(
            "/slices/{}/{}",
            table.name,
            random_bytes_upto(random, 64)
                .iter()
                .map(|byte| format!("%{byte:02X}"))
                .collect::<String>()
        ),
        _ => "/slices//".to_string(),
    };
    let huge = u64::MAX.to_string();
    let range = match random.below(16) {
        0 => None,
        1 => Some("bytes=0-0".to_string()),
        2 => Some("bytes=-0".to_string()),
        3 => Some(format!("bytes={huge}-")),
        4 => Some(format!("bytes=0-{huge}")),
        5 => Some("bytes=0-18446744073709551616".to_string()),
        6 => Some(format!("bytes=-{huge}")),
        7 => Some("bytes=10-5".to_string()),
        8 => Some("bytes=0-1,2-3,5-8".to_string()),
        9 => Some("bytes=--1".to_string()),
        10 => Some("bytes=-".to_string()),
        11 => Some("items=0-10".to_string()),
        12 => Some(format!("bytes={}", "0-1,".repeat(random.below(10_000)))),
        13 => Some(format!("bytes={}-{}", random.next_u64(), random.next_u64())),
        14 => Some(format!("bytes=-{}", random.below(1 << 20))),
        _ => {
            Some(String::from_utf8_lossy(&random_bytes_upto(random, 64)).replace(['\r', '\n'], ""))
        }
    };
    let method = *random.pick(&["GET", "GET", "HEAD", "HEAD", "POST", "OPTIONS", "DELETE"]);
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {}\r\n",
        view.range_address
    );
    if let Some(value) = authorization {
        let _ = write!(request, "Authorization: {value}\r\n");
    }
    if let Some(range) = &range {
        let _ = write!(request, "Range: {range}\r\n");
        if random.percent(10) {
            let _ = write!(request, "Range: bytes=0-1\r\n");
        }
    }
    request.push_str("Connection: close\r\n\r\n");
    Generated {
        what: format!(
            "{method} path of {} bytes, Range {:?}",
            path.len(),
            range
                .as_deref()
                .map(|range| range.chars().take(60).collect::<String>())
        ),
        request: Request::Http(request.into_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_encode_like_protobuf() {
        assert_eq!(varint(1), vec![1]);
        assert_eq!(varint(300), vec![0xac, 0x02]);
        assert_eq!(varint(u64::MAX).len(), 10);
    }

    #[test]
    fn the_panic_recorder_sees_a_caught_panic_with_its_location() {
        let recorder = PanicRecorder::install();
        let caught = std::panic::catch_unwind(|| panic!("boom in a guarded task"));
        let panics = panics_take();
        drop(recorder);
        assert!(caught.is_err());
        assert!(
            panics
                .iter()
                .any(|panic| panic.starts_with("boom in a guarded task at ")
                    && panic.contains("requests.rs")),
            "{panics:?}"
        );
    }

    #[test]
    fn broken_streams_and_panics_are_failures_and_refusals_are_not() {
        let (outcome, _) = classify_status(&tonic::Status::internal(
            "storage node failed while executing the fragment (panic caught)",
        ));
        assert_eq!(outcome, Outcome::Panic);
        let (outcome, _) =
            classify_status(&tonic::Status::internal("h2 protocol error: http2 error"));
        assert_eq!(outcome, Outcome::BrokenStream);
        let (outcome, _) = classify_status(&tonic::Status::unknown("stream ended"));
        assert_eq!(outcome, Outcome::BrokenStream);
        let (outcome, _) = classify_status(&tonic::Status::invalid_argument("malformed"));
        assert_eq!(outcome, Outcome::Refused);
        assert!(!Outcome::Refused.is_failure() && Outcome::BrokenStream.is_failure());
    }

    #[test]
    fn mutations_depend_on_the_seed_alone() {
        let mutate = |seed| {
            let mut bytes = (0..100u8).collect::<Vec<_>>();
            let mut random = SeededRandom::new(seed);
            let done = mutate_bytes(&mut random, &mut bytes);
            (bytes, done)
        };
        assert_eq!(mutate(7), mutate(7));
        assert_ne!(mutate(7), mutate(8));
    }
}
