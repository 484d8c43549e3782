//! The byte-range endpoint: slice files over HTTP, for readers that do their
//! own filtering (Sieve with NDP off, DuckDB's httpfs).
//!
//! `GET /slices/{table}/{file}` with an optional `Range: bytes=a-b` header;
//! only files the catalog names are served, so no path can escape the data
//! directory.

use std::io::SeekFrom;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use futures::StreamExt;
use tokio::io::{AsyncReadExt, AsyncSeekExt};

use sieve_fragment::Secret;

use crate::catalog::open_slice_file;
use crate::faults::Faults;
use crate::NodeCatalog;

/// Upper bound on one range response. DataFusion asks for column chunks and
/// coalesced page runs, well below this; a larger request is refused rather
/// than buffered.
const RANGE_BYTES_MAX: u64 = 256 * 1024 * 1024;

/// Upper bound on the bytes of range responses a node holds in memory at
/// once, over all connections: a response is read whole before it is sent,
/// so without it a few hundred large requests would exhaust memory. A
/// request waits for its share (its bytes in KiB, as semaphore permits).
pub(crate) const RANGE_BYTES_IN_FLIGHT_MAX: u64 = 512 * 1024 * 1024;

/// The semaphore behind [`RANGE_BYTES_IN_FLIGHT_MAX`], in KiB.
pub(crate) fn range_bytes_budget() -> Arc<tokio::sync::Semaphore> {
    Arc::new(tokio::sync::Semaphore::new(
        (RANGE_BYTES_IN_FLIGHT_MAX / 1024) as usize,
    ))
}

#[derive(Debug, Clone)]
pub(crate) struct RangeState {
    pub(crate) catalog: Arc<NodeCatalog>,
    pub(crate) bytes_served: Arc<AtomicU64>,
    /// The secret every request must carry, if the node has one.
    pub(crate) auth: Option<Arc<Secret>>,
    /// Bytes of responses held at once ([`RANGE_BYTES_IN_FLIGHT_MAX`]).
    pub(crate) in_flight: Arc<tokio::sync::Semaphore>,
    /// The node's fault switch: a range response counts as a data message.
    pub(crate) faults: Arc<Faults>,
}

pub(crate) fn router(state: RangeState) -> Router {
    Router::new()
        .route("/slices/{table}/{file}", get(serve).head(serve))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            authenticate,
        ))
        .with_state(state)
}

/// Answer 401 to a request without `Authorization: Bearer <secret>` (when
/// the node has a secret), before anything else about it is looked at.
async fn authenticate(
    State(state): State<RangeState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(secret) = &state.auth else {
        return next.run(request).await;
    };
    match request.headers().get(header::AUTHORIZATION) {
        Some(value) if secret.matches_header(value.as_bytes()) => next.run(request).await,
        given => {
            let message = if given.is_some() {
                "this storage node refuses the credential sent: the Authorization header does not hold its secret"
            } else {
                "this storage node requires a credential: send 'Authorization: Bearer <secret>'"
            };
            (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer")],
                message,
            )
                .into_response()
        }
    }
}

async fn serve(
    State(state): State<RangeState>,
    Path((table, file)): Path<(String, String)>,
    method: axum::http::Method,
    headers: HeaderMap,
) -> Response {
    match serve_inner(
        &state,
        &table,
        &file,
        method == axum::http::Method::HEAD,
        &headers,
    )
    .await
    {
        Ok(response) => response,
        Err((status, message)) => (status, message).into_response(),
    }
}

async fn serve_inner(
    state: &RangeState,
    table: &str,
    file: &str,
    head_only: bool,
    headers: &HeaderMap,
) -> Result<Response, (StatusCode, String)> {
    let slice = state.catalog.slice_by_file(table, file).ok_or_else(|| {
        (
            StatusCode::NOT_FOUND,
            format!("no slice {table}/{file} on this storage node"),
        )
    })?;
    let size = slice.summary.bytes;
    let range = match headers.get(header::RANGE) {
        None => None,
        Some(value) => Some(parse_range(value, size).ok_or_else(|| {
            (
                StatusCode::RANGE_NOT_SATISFIABLE,
                format!("unsupported or unsatisfiable range {value:?} for {size} bytes"),
            )
        })?),
    };
    let (start, end) = range.unwrap_or((0, size)); // end exclusive
    let length = end - start;
    if length > RANGE_BYTES_MAX {
        return Err((
            StatusCode::RANGE_NOT_SATISFIABLE,
            format!("range of {length} bytes is above the limit of {RANGE_BYTES_MAX}"),
        ));
    }
    // Slices are written once (temp file, fsync, rename) and never changed
    // in place, so size and modification time identify a version. HTTP
    // readers that cache (DuckDB's external file cache) validate with these;
    // without them DuckDB 1.4 falls back to arithmetic on an unset timestamp
    // and fails the query now and then ("Overflow in timestamp subtraction").
    let modified_nanos = slice
        .modified
        .duration_since(std::time::UNIX_EPOCH)
        .map(|since| since.as_nanos())
        .unwrap_or(0);
    let mut builder = Response::builder()
        .header(header::ETAG, format!("\"{size:x}-{modified_nanos:x}\""))
        .header(
            header::LAST_MODIFIED,
            httpdate::fmt_http_date(slice.modified),
        )
        .header(header::ACCEPT_RANGES, "bytes")
        .header(header::CONTENT_LENGTH, length)
        .header(header::CONTENT_TYPE, "application/vnd.apache.parquet");
    if range.is_some() {
        builder = builder.status(StatusCode::PARTIAL_CONTENT).header(
            header::CONTENT_RANGE,
            format!("bytes {start}-{}/{size}", end.saturating_sub(1)),
        );
    } else {
        builder = builder.status(StatusCode::OK);
    }
    if head_only {
        return builder.body(Body::empty()).map_err(internal);
    }
    let permits = length.div_ceil(1024).max(1) as u32;
    let permit = Arc::clone(&state.in_flight)
        .acquire_many_owned(permits)
        .await
        .map_err(internal)?;
    let mut handle = tokio::fs::File::from_std(open_slice_file(&slice.path).map_err(internal)?);
    handle
        .seek(SeekFrom::Start(start))
        .await
        .map_err(internal)?;
    let mut buffer = vec![0u8; length as usize];
    handle.read_exact(&mut buffer).await.map_err(internal)?;
    state.bytes_served.fetch_add(length, Ordering::Relaxed);
    state.faults.message_sent();
    // The bytes count against the budget until the body has been sent.
    let body = futures::stream::iter([Ok::<_, std::io::Error>(bytes::Bytes::from(buffer))]).chain(
        futures::stream::once(async move {
            drop(permit);
            None
        })
        .filter_map(std::future::ready),
    );
    builder.body(Body::from_stream(body)).map_err(internal)
}

fn internal(error: impl std::fmt::Display) -> (StatusCode, String) {
    (StatusCode::INTERNAL_SERVER_ERROR, error.to_string())
}

/// Parse `bytes=a-b`, `bytes=a-` or `bytes=-n` into `[start, end)`.
fn parse_range(value: &HeaderValue, size: u64) -> Option<(u64, u64)> {
    let spec = value.to_str().ok()?.strip_prefix("bytes=")?;
    if spec.contains(',') {
        return None; // multi-range responses are not supported
    }
    let (first, last) = spec.split_once('-')?;
    let (start, end) = if first.is_empty() {
        let suffix: u64 = last.parse().ok()?;
        (size.saturating_sub(suffix), size)
    } else {
        let start: u64 = first.parse().ok()?;
        let end = if last.is_empty() {
            size
        } else {
            last.parse::<u64>().ok()?.saturating_add(1).min(size)
        };
        (start, end)
    };
    (start < end && end <= size).then_some((start, end))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_three_range_forms() {
        let parse = |text: &str| parse_range(&HeaderValue::from_str(text).unwrap(), 100);
        assert_eq!(parse("bytes=0-9"), Some((0, 10)));
        assert_eq!(parse("bytes=90-"), Some((90, 100)));
        assert_eq!(parse("bytes=-10"), Some((90, 100)));
        assert_eq!(parse("bytes=95-200"), Some((95, 100)));
        assert_eq!(parse("bytes=100-120"), None);
        assert_eq!(parse("bytes=0-1,5-6"), None);
        assert_eq!(parse("items=0-1"), None);
    }
}
