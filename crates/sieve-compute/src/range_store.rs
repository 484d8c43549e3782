//! The NDP-off read path: one [`ObjectStore`] over every storage node's
//! byte-range endpoint, counting the bytes it receives.
//!
//! Paths are `{node}/slices/{table}/{file}`; the first segment names the
//! node the planner picked. Given the catalog ([`ClusterRangeStore::with_catalog`]),
//! every read goes to the slice's replicas in
//! [`ClusterCatalog::replica_order`] and fails over:
//!
//! ```text
//!   GET bytes=a-b ── node A ──x  refused / reset / no answer in range_timeout_ms / 5xx
//!                                 -> A marked failed (NDP-on requests skip it too)
//!                 ── node B ──>  the same bytes (replicas are byte for byte equal)
//! ```
//!
//! A client error (404, 416, a refused precondition) is the request's and is
//! not retried. A read is buffered whole before it is returned, so a node
//! that fails mid-body costs a retry, never half a range. Only reads are
//! supported: the compute node never writes slices.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::StreamExt;
use http::header::{HeaderMap, HeaderValue, AUTHORIZATION};
use object_store::http::HttpBuilder;
use object_store::path::Path;
use object_store::{
    BackoffConfig, ClientOptions, CopyOptions, GetOptions, GetResult, GetResultPayload, ListResult,
    MultipartUpload, ObjectMeta, ObjectStore, ObjectStoreExt, PutMultipartOptions, PutOptions,
    PutPayload, PutResult, RetryConfig,
};

use sieve_fragment::Secret;

use crate::catalog::Recovery;
use crate::{ClusterCatalog, ClusterSlice, Traffic};

/// Default of `sieve.range_timeout_ms`: the longest one byte-range request
/// may take, connecting included, before it counts as failed and goes to
/// another replica. Ranges are column chunks of at most a few megabytes; 30 s
/// is the NDP-on silence bound (`sieve.storage_timeout_ms`) too.
pub const RANGE_REQUEST_TIMEOUT_MS: u64 = 30_000;

/// Longest wait for a TCP connection to a byte-range endpoint.
const RANGE_CONNECT_TIMEOUT_MS: u64 = 2_000;

/// Retries of one request on the same node, for a connection that closed
/// while idle in the pool; anything more is the next replica's job.
const RANGE_SAME_NODE_RETRIES_MAX: usize = 1;

/// The URL DataFusion knows this store by.
pub(crate) const CLUSTER_RANGE_URL: &str = "sieve-range://cluster";

/// How long an idle byte-range connection stays in the client's pool, in
/// milliseconds: below the storage node's header-read timeout (10 s), which
/// closes a kept-alive connection that sends no next request, so the client
/// drops its idle connections before the node does and never sends a request
/// on one the node is closing.
const POOL_IDLE_TIMEOUT_MS: u64 = 5_000;

/// Byte-range reads from every storage node.
#[derive(Debug)]
pub struct ClusterRangeStore {
    nodes: Vec<Arc<dyn ObjectStore>>,
    base_urls: Vec<String>,
    traffic: Arc<Traffic>,
    replicas: Option<Replicas>,
}

/// Where each slice file has copies, and the node states to update.
#[derive(Debug)]
struct Replicas {
    catalog: Arc<ClusterCatalog>,
    /// Slices by file path (`slices/{table}/{file}`).
    slices: HashMap<String, ClusterSlice>,
}

impl ClusterRangeStore {
    /// A store over the range endpoints at `base_urls` (`http://host:port`),
    /// one per node, sending `secret` with every request (`None`: nodes
    /// without one); each request gives up after `request_timeout`.
    pub fn try_new(
        base_urls: &[String],
        secret: Option<&Secret>,
        traffic: Arc<Traffic>,
        request_timeout: Duration,
    ) -> object_store::Result<Self> {
        let mut headers = HeaderMap::new();
        if let Some(secret) = secret {
            let mut value = HeaderValue::from_str(&secret.bearer()).map_err(|_| {
                object_store::Error::Generic {
                    store: "ClusterRangeStore",
                    source: "the storage secret cannot be sent as a header".into(),
                }
            })?;
            value.set_sensitive(true);
            headers.insert(AUTHORIZATION, value);
        }
        let retry = RetryConfig {
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(20),
                max_backoff: Duration::from_millis(200),
                base: 2.0,
            },
            max_retries: RANGE_SAME_NODE_RETRIES_MAX,
            retry_timeout: request_timeout,
        };
        let nodes = base_urls
            .iter()
            .map(|url| {
                HttpBuilder::new()
                    .with_url(url)
                    .with_client_options(
                        ClientOptions::new()
                            .with_allow_http(true)
                            .with_pool_idle_timeout(std::time::Duration::from_millis(
                                POOL_IDLE_TIMEOUT_MS,
                            ))
                            .with_default_headers(headers.clone())
                            .with_timeout(request_timeout)
                            .with_connect_timeout(
                                Duration::from_millis(RANGE_CONNECT_TIMEOUT_MS)
                                    .min(request_timeout),
                            ),
                    )
                    .with_retry(retry.clone())
                    .build()
                    .map(|store| Arc::new(store) as Arc<dyn ObjectStore>)
            })
            .collect::<object_store::Result<_>>()?;
        Ok(Self {
            nodes,
            base_urls: base_urls.to_vec(),
            traffic,
            replicas: None,
        })
    }

    /// Fail over between the replicas `catalog` knows of each slice file,
    /// marking in it the nodes that fail.
    pub fn with_catalog(mut self, catalog: Arc<ClusterCatalog>) -> Self {
        let slices = catalog
            .tables
            .values()
            .flat_map(|table| table.slices.iter())
            .filter_map(|slice| {
                let (_, rest) = slice.range_url.split_once("/slices/")?;
                Some((format!("slices/{rest}"), slice.clone()))
            })
            .collect();
        self.replicas = Some(Replicas { catalog, slices });
        self
    }

    /// The path of `file_path` (`slices/...`) on node `node`.
    pub(crate) fn path(node: usize, file_path: &str) -> String {
        format!("{node}/{file_path}")
    }

    /// The nodes to try for `location`, best first, and the path on them.
    fn route(&self, location: &Path) -> object_store::Result<(Vec<usize>, Path)> {
        let mut parts = location.parts();
        let node: Option<usize> = parts
            .next()
            .and_then(|part| part.as_ref().parse().ok())
            .filter(|&node| node < self.nodes.len());
        let Some(node) = node else {
            return Err(object_store::Error::NotFound {
                path: location.to_string(),
                source: "path does not name a storage node".into(),
            });
        };
        let path = Path::from_iter(parts);
        let order = self
            .replicas
            .as_ref()
            .and_then(|replicas| match replicas.slices.get(path.as_ref()) {
                Some(slice) => Some(replicas.catalog.replica_order(slice)),
                // A slice of a table a user owns: its copies as planned.
                None => {
                    let (slice, nodes) = replicas.catalog.owned.as_ref()?.route(path.as_ref())?;
                    Some(replicas.catalog.replica_order_of(slice, &nodes))
                }
            })
            .filter(|order| !order.is_empty())
            .unwrap_or_else(|| vec![node]);
        Ok((order, path))
    }

    /// Run `read` on the replicas of `location` until one succeeds; a node
    /// that fails is marked failed in the catalog. Client errors are
    /// returned at once: every replica would answer the same.
    async fn with_failover<T, F, R>(&self, location: &Path, read: F) -> object_store::Result<T>
    where
        F: Fn(Arc<dyn ObjectStore>, Path) -> R,
        R: Future<Output = object_store::Result<T>>,
    {
        let (order, path) = self.route(location)?;
        let mut failures: Vec<String> = Vec::new();
        let mut first_failure: Option<(usize, Instant)> = None;
        for &node in &order {
            let store = Arc::clone(&self.nodes[node]);
            match read(store, path.clone()).await {
                Ok(value) => {
                    if let (Some((failed_node, detected)), Some(replicas)) =
                        (first_failure, &self.replicas)
                    {
                        replicas
                            .catalog
                            .recoveries
                            .lock()
                            .expect("never poisoned")
                            .push(Recovery {
                                failed_node,
                                detected,
                                recovered: Instant::now(),
                            });
                    }
                    return Ok(value);
                }
                Err(error) if is_request_error(&error) => return Err(error),
                Err(error) => {
                    let url = self.base_urls.get(node).map(String::as_str).unwrap_or("?");
                    log::warn!("byte range of {path} from storage node {url}: {error}");
                    if let Some(replicas) = &self.replicas {
                        replicas.catalog.mark_failed(node);
                    }
                    first_failure.get_or_insert((node, Instant::now()));
                    failures.push(format!("storage node {url}: {error}"));
                }
            }
        }
        Err(object_store::Error::Generic {
            store: "ClusterRangeStore",
            source: format!(
                "{path} could not be read: {} of its {} replica(s) tried, every one failed: {}",
                failures.len(),
                order.len(),
                failures.join("; ")
            )
            .into(),
        })
    }
}

/// Whether `error` is the request's fault (a 4xx answer), which every
/// replica would give, rather than its node's (refused, reset, timed out, a
/// server error, a bad body).
fn is_request_error(error: &object_store::Error) -> bool {
    use object_store::Error;
    match error {
        Error::NotFound { .. }
        | Error::InvalidPath { .. }
        | Error::NotSupported { .. }
        | Error::AlreadyExists { .. }
        | Error::Precondition { .. }
        | Error::NotModified { .. }
        | Error::NotImplemented { .. }
        | Error::PermissionDenied { .. }
        | Error::Unauthenticated { .. } => true,
        // object_store keeps the status of other answers in a private type;
        // its message is the only public trace of a 4xx (such as 416).
        _ => error.to_string().contains("non-2xx status code: 4"),
    }
}

impl fmt::Display for ClusterRangeStore {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "ClusterRangeStore({} nodes)", self.nodes.len())
    }
}

fn read_only() -> object_store::Error {
    object_store::Error::NotImplemented {
        operation: "write to a storage node's byte-range endpoint".into(),
        implementer: "ClusterRangeStore".into(),
    }
}

/// Bytes a byte-range request sends, estimated as its request line and
/// headers: the path, and a fixed allowance for the method, version, host,
/// range, and a bearer authorization header of a 64-character secret. The
/// request has no body.
fn range_request_bytes(path: &Path) -> u64 {
    const HEADERS_BYTES: u64 = 170;
    path.as_ref().len() as u64 + HEADERS_BYTES
}

#[async_trait]
impl ObjectStore for ClusterRangeStore {
    async fn put_opts(
        &self,
        _location: &Path,
        _payload: PutPayload,
        _opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        Err(read_only())
    }

    async fn put_multipart_opts(
        &self,
        _location: &Path,
        _opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        Err(read_only())
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        let result = self
            .with_failover(location, |store, path| {
                let options = options.clone();
                self.traffic.add_sent(range_request_bytes(&path));
                async move {
                    let result = store.get_opts(&path, options).await?;
                    let (meta, range, attributes) = (
                        result.meta.clone(),
                        result.range.clone(),
                        result.attributes.clone(),
                    );
                    // The whole body within the attempt: a node that fails
                    // mid-body is retried on a replica.
                    let bytes = result.bytes().await?;
                    Ok((meta, range, attributes, bytes))
                }
            })
            .await?;
        let (meta, range, attributes, bytes) = result;
        self.traffic.add_range_response(bytes.len() as u64);
        Ok(GetResult {
            payload: GetResultPayload::Stream(futures::stream::once(async { Ok(bytes) }).boxed()),
            meta,
            range,
            attributes,
        })
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[Range<u64>],
    ) -> object_store::Result<Vec<Bytes>> {
        // Coalesce nearby ranges as object_store's own get_ranges does, but
        // count the bytes of each request actually made: the gaps between
        // coalesced ranges cross the link too (at SF 0.01, 65% more than
        // the ranges asked for).
        let traffic = &self.traffic;
        object_store::coalesce_ranges(
            ranges,
            |range| async move {
                let bytes = self
                    .with_failover(location, |store, path| {
                        let range = range.clone();
                        traffic.add_sent(range_request_bytes(&path));
                        async move { store.get_range(&path, range).await }
                    })
                    .await?;
                traffic.add_range_response(bytes.len() as u64);
                Ok::<_, object_store::Error>(bytes)
            },
            object_store::OBJECT_STORE_COALESCE_DEFAULT,
        )
        .await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        locations.map(|_| Err(read_only())).boxed()
    }

    fn list(&self, _prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        futures::stream::once(async { Err(read_only()) }).boxed()
    }

    async fn list_with_delimiter(
        &self,
        _prefix: Option<&Path>,
    ) -> object_store::Result<ListResult> {
        Err(read_only())
    }

    async fn copy_opts(
        &self,
        _from: &Path,
        _to: &Path,
        _options: CopyOptions,
    ) -> object_store::Result<()> {
        Err(read_only())
    }
}
