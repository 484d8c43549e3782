//! Bounds on what a client can hold of a storage node: connections, time
//! to send a request, idle time, streams per connection.
//!
//! Both endpoints accept in a loop of their own that takes a permit of a
//! [`tokio::sync::Semaphore`] per connection; a connection over
//! [`ConnectionLimits::connections_max`] is closed at once. Each accepted
//! connection is wrapped in a [`GuardedStream`] that holds the permit for
//! the connection's life and enforces two deadlines:
//!
//! ```text
//!   accept ──► handshake deadline ──► served ──► idle deadline
//!              (first HANDSHAKE_BYTES         (no byte in either
//!               within handshake_timeout)      direction for idle_timeout)
//! ```
//!
//! so that a client that connects and sends nothing, or half a request
//! line, or half an HTTP/2 preface, is dropped after `handshake_timeout`.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

/// Open connections per endpoint (Flight and byte-range each), beyond which
/// a new connection is closed at once. A compute node holds one Flight
/// connection per storage node and a few byte-range connections; DuckDB a
/// few dozen. File descriptors, not memory, are what this protects.
pub const CONNECTIONS_MAX: usize = 1024;

/// Time a new connection has to send its first [`HANDSHAKE_BYTES`] (the
/// HTTP/2 preface, or the start of an HTTP/1 request), in milliseconds.
/// A loopback or LAN client needs well under a second.
pub const HANDSHAKE_TIMEOUT_MS: u64 = 10_000;

/// Bytes a client must send within [`HANDSHAKE_TIMEOUT_MS`]: the length of
/// the HTTP/2 connection preface, shorter than any HTTP/1 request head.
pub const HANDSHAKE_BYTES: usize = 24;

/// Time the byte-range endpoint waits for a request's complete head
/// (request line and headers), for the first request and for every later
/// one on a kept-alive connection, in milliseconds.
pub const HEADER_READ_TIMEOUT_MS: u64 = 10_000;

/// Time a byte-range connection may move no byte in either direction
/// before it is closed, in milliseconds: a client that stops reading a
/// response frees its connection after this.
pub const IDLE_TIMEOUT_MS: u64 = 60_000;

/// Time a Flight call has to produce its response head, in milliseconds.
/// tonic applies it to the response future only, not to the stream body,
/// so a long DoGet stream is not cut; DoGet answers before it waits for a
/// pushdown worker.
pub const FLIGHT_REQUEST_TIMEOUT_MS: u64 = 60_000;

/// Interval of HTTP/2 pings on an otherwise quiet Flight connection, in
/// milliseconds; a peer that does not answer within
/// [`HTTP2_KEEPALIVE_TIMEOUT_MS`] is dropped.
pub const HTTP2_KEEPALIVE_INTERVAL_MS: u64 = 20_000;

/// Time a Flight peer has to answer a keep-alive ping, in milliseconds.
pub const HTTP2_KEEPALIVE_TIMEOUT_MS: u64 = 20_000;

/// Idle time before TCP keep-alive probes on either endpoint, in
/// milliseconds: finds peers that vanished without closing.
pub const TCP_KEEPALIVE_MS: u64 = 60_000;

/// Concurrent HTTP/2 streams (Flight calls) on one connection. A compute
/// node keeps `slices_in_flight` requests per partition on its one
/// connection; beyond this its client queues them.
pub const FLIGHT_STREAMS_PER_CONNECTION_MAX: u32 = 1024;

/// Flight calls handled at once per connection (until their response head);
/// more wait.
pub const FLIGHT_CONCURRENCY_PER_CONNECTION_MAX: usize = 1024;

/// The bounds one storage node applies; [`Default`] is the named constants.
#[derive(Debug, Clone)]
pub struct ConnectionLimits {
    /// [`CONNECTIONS_MAX`].
    pub connections_max: usize,
    /// [`HANDSHAKE_TIMEOUT_MS`].
    pub handshake_timeout: Duration,
    /// [`HEADER_READ_TIMEOUT_MS`].
    pub header_read_timeout: Duration,
    /// [`IDLE_TIMEOUT_MS`].
    pub idle_timeout: Duration,
    /// [`FLIGHT_REQUEST_TIMEOUT_MS`].
    pub flight_request_timeout: Duration,
    /// [`HTTP2_KEEPALIVE_INTERVAL_MS`].
    pub http2_keepalive_interval: Duration,
    /// [`HTTP2_KEEPALIVE_TIMEOUT_MS`].
    pub http2_keepalive_timeout: Duration,
    /// [`TCP_KEEPALIVE_MS`].
    pub tcp_keepalive: Duration,
    /// [`FLIGHT_STREAMS_PER_CONNECTION_MAX`].
    pub flight_streams_per_connection_max: u32,
    /// [`FLIGHT_CONCURRENCY_PER_CONNECTION_MAX`].
    pub flight_concurrency_per_connection_max: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            connections_max: CONNECTIONS_MAX,
            handshake_timeout: Duration::from_millis(HANDSHAKE_TIMEOUT_MS),
            header_read_timeout: Duration::from_millis(HEADER_READ_TIMEOUT_MS),
            idle_timeout: Duration::from_millis(IDLE_TIMEOUT_MS),
            flight_request_timeout: Duration::from_millis(FLIGHT_REQUEST_TIMEOUT_MS),
            http2_keepalive_interval: Duration::from_millis(HTTP2_KEEPALIVE_INTERVAL_MS),
            http2_keepalive_timeout: Duration::from_millis(HTTP2_KEEPALIVE_TIMEOUT_MS),
            tcp_keepalive: Duration::from_millis(TCP_KEEPALIVE_MS),
            flight_streams_per_connection_max: FLIGHT_STREAMS_PER_CONNECTION_MAX,
            flight_concurrency_per_connection_max: FLIGHT_CONCURRENCY_PER_CONNECTION_MAX,
        }
    }
}

/// Accepts connections within [`ConnectionLimits::connections_max`].
#[derive(Debug)]
pub(crate) struct BoundedAcceptor {
    listener: TcpListener,
    permits: Arc<Semaphore>,
    limits: ConnectionLimits,
    endpoint: &'static str,
}

impl BoundedAcceptor {
    pub(crate) fn new(
        listener: TcpListener,
        limits: ConnectionLimits,
        endpoint: &'static str,
    ) -> Self {
        Self {
            listener,
            permits: Arc::new(Semaphore::new(limits.connections_max)),
            limits,
            endpoint,
        }
    }

    /// The next connection within the bound, with its permit and deadlines.
    /// Connections over the bound are closed here; accept errors (a peer
    /// that reset before accept, out of file descriptors) are returned.
    pub(crate) async fn accept(&self) -> io::Result<(TcpStream, Guard)> {
        loop {
            let (stream, peer) = self.listener.accept().await?;
            let Ok(permit) = Arc::clone(&self.permits).try_acquire_owned() else {
                log::warn!(
                    "{} endpoint: closing connection from {peer}: {} connections open, the limit (connections_max)",
                    self.endpoint,
                    self.limits.connections_max
                );
                drop(stream);
                continue;
            };
            let _ = stream.set_nodelay(true);
            set_tcp_keepalive(&stream, self.limits.tcp_keepalive);
            let guard = Guard {
                _permit: permit,
                handshake_left: HANDSHAKE_BYTES,
                handshake_timeout: self.limits.handshake_timeout,
                idle_timeout: self.limits.idle_timeout,
                deadline: Box::pin(tokio::time::sleep(self.limits.handshake_timeout)),
            };
            return Ok((stream, guard));
        }
    }
}

/// A connection's permit and deadlines, to wrap its stream with.
#[derive(Debug)]
pub(crate) struct Guard {
    _permit: OwnedSemaphorePermit,
    handshake_left: usize,
    handshake_timeout: Duration,
    idle_timeout: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl Guard {
    pub(crate) fn wrap<S>(self, inner: S) -> GuardedStream<S> {
        GuardedStream { inner, guard: self }
    }

    /// Some bytes moved: push the deadline back (while the handshake is
    /// incomplete, only reads count, and its deadline stays).
    fn progressed(&mut self, read: usize) {
        if self.handshake_left > 0 {
            self.handshake_left = self.handshake_left.saturating_sub(read);
            if self.handshake_left > 0 {
                return;
            }
        }
        let next = Instant::now() + self.idle_timeout;
        self.deadline.as_mut().reset(next);
    }

    /// The error if the deadline passed (registers the waker otherwise).
    fn expired(&mut self, context: &mut Context<'_>) -> Option<io::Error> {
        if self.deadline.as_mut().poll(context).is_pending() {
            return None;
        }
        Some(if self.handshake_left > 0 {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "no request within the handshake timeout of {} ms",
                    self.handshake_timeout.as_millis()
                ),
            )
        } else {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "connection idle for the idle timeout of {} ms",
                    self.idle_timeout.as_millis()
                ),
            )
        })
    }
}

/// A connection under its endpoint's bounds (see the module doc).
#[derive(Debug)]
pub struct GuardedStream<S> {
    inner: S,
    guard: Guard,
}

impl<S> GuardedStream<S> {
    /// The wrapped stream.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for GuardedStream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buffer: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buffer.filled().len();
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_read(context, buffer) {
            Poll::Ready(Ok(())) => {
                this.guard.progressed(buffer.filled().len() - before);
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(error)) => Poll::Ready(Err(error)),
            Poll::Pending => match this.guard.expired(context) {
                Some(error) => Poll::Ready(Err(error)),
                None => Poll::Pending,
            },
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for GuardedStream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buffer: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_write(context, buffer) {
            Poll::Ready(Ok(written)) => {
                this.guard.progressed(0);
                Poll::Ready(Ok(written))
            }
            Poll::Ready(Err(error)) => Poll::Ready(Err(error)),
            Poll::Pending => match this.guard.expired(context) {
                Some(error) => Poll::Ready(Err(error)),
                None => Poll::Pending,
            },
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(context)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(context)
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected
    for GuardedStream<S>
{
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

/// Turn on TCP keep-alive probes after `idle` (tonic ignores its own
/// `tcp_keepalive` setting for connections it does not accept itself).
fn set_tcp_keepalive(stream: &TcpStream, idle: Duration) {
    use std::os::fd::AsRawFd;
    let fd = stream.as_raw_fd();
    let on: libc::c_int = 1;
    let seconds: libc::c_int = idle.as_secs().clamp(1, i32::MAX as u64) as libc::c_int;
    let size = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `fd` is an open socket owned by `stream` for the duration of
    // the calls, and each option value is a c_int that outlives its call.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_KEEPALIVE,
            (&on as *const libc::c_int).cast(),
            size,
        );
        #[cfg(any(target_os = "linux", target_os = "android"))]
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_KEEPIDLE,
            (&seconds as *const libc::c_int).cast(),
            size,
        );
    }
    let _ = seconds;
}
