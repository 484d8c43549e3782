//! Fault injection: make a node in this process fail the way a real one does.
//!
//! Every Flight and byte-range connection is wrapped in a [`FaultyStream`].
//! Throwing the switch makes a node
//! - **killed**: every open connection fails at once (reads end, writes
//!   fail), so a client mid-stream sees its connection drop, as after a crash;
//!   new connections are refused because the node stops listening;
//! - **frozen**: every connection stops moving bytes without closing, as a
//!   hung host does; only a client's timeout notices.
//!
//! `pace_reads(d)` makes every page read of a fragment take `d` longer, as a
//! slow or overloaded disk does: the node works, slowly.
//!
//! `kill_after_messages(n)` throws the kill switch from inside the node after
//! it has sent `n` more data messages (Flight data messages and byte-range
//! responses), so a test can kill a node in the middle of a slice stream or
//! of an NDP-off scan deterministically.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};

use futures::task::AtomicWaker;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

const KILLED: u8 = 1;
const FROZEN: u8 = 2;

/// The fault switch of one node.
#[derive(Default)]
pub struct Faults {
    /// 0 healthy, [`KILLED`] or [`FROZEN`].
    state: AtomicU8,
    /// Data messages left before the node kills itself; negative: never.
    messages_left: AtomicI64,
    /// Extra time each page read of a fragment takes, in microseconds.
    read_pace_micros: AtomicU64,
    /// Registered fragment bodies are taken for missing (as after a restart).
    bodies_forgotten: std::sync::atomic::AtomicBool,
    connections: Mutex<Vec<Weak<Wakers>>>,
    on_kill: Mutex<Vec<Box<dyn FnOnce() + Send>>>,
}

impl std::fmt::Debug for Faults {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Faults")
            .field("state", &self.state)
            .field("messages_left", &self.messages_left)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Wakers {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("Wakers")
    }
}

#[derive(Default)]
struct Wakers {
    read: AtomicWaker,
    write: AtomicWaker,
}

impl Faults {
    /// A healthy node's switch.
    pub fn new() -> Self {
        Self {
            messages_left: AtomicI64::new(-1),
            ..Self::default()
        }
    }

    /// Drop every connection now, and run what `on_kill` registered (stop listening).
    pub fn kill(&self) {
        self.set(KILLED);
        let actions: Vec<_> = self
            .on_kill
            .lock()
            .expect("never poisoned")
            .drain(..)
            .collect();
        for action in actions {
            action();
        }
    }

    /// Stop every connection from moving bytes, without closing any.
    pub fn freeze(&self) {
        self.set(FROZEN);
    }

    /// Kill the node after it has sent `messages` more data messages.
    pub fn kill_after_messages(&self, messages: u64) {
        self.messages_left
            .store(messages.min(i64::MAX as u64) as i64, Ordering::SeqCst);
    }

    /// Make every page read of a fragment take `delay` longer (zero: none).
    pub fn pace_reads(&self, delay: std::time::Duration) {
        self.read_pace_micros.store(
            delay.as_micros().min(u128::from(u64::MAX)) as u64,
            Ordering::SeqCst,
        );
    }

    /// Take every registered fragment body for missing from now on (as a
    /// node that restarted or evicted them would), or again not.
    pub fn forget_fragment_bodies(&self, forget: bool) {
        self.bodies_forgotten.store(forget, Ordering::SeqCst);
    }

    /// Whether registered fragment bodies are taken for missing.
    pub(crate) fn fragment_bodies_forgotten(&self) -> bool {
        self.bodies_forgotten.load(Ordering::Relaxed)
    }

    /// Wait out the read pace, if any.
    pub(crate) async fn pace_read(&self) {
        let micros = self.read_pace_micros.load(Ordering::Relaxed);
        if micros > 0 {
            tokio::time::sleep(std::time::Duration::from_micros(micros)).await;
        }
    }

    /// Count one data message sent; kills the node when the count runs out.
    pub fn message_sent(&self) {
        if self.messages_left.load(Ordering::Relaxed) < 0 {
            return;
        }
        if self.messages_left.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.kill();
        }
    }

    /// Whether the node was killed.
    pub fn is_killed(&self) -> bool {
        self.state.load(Ordering::SeqCst) == KILLED
    }

    /// Run `action` when the node is killed.
    pub(crate) fn on_kill(&self, action: Box<dyn FnOnce() + Send>) {
        self.on_kill.lock().expect("never poisoned").push(action);
    }

    fn set(&self, state: u8) {
        self.state.store(state, Ordering::SeqCst);
        let connections = self.connections.lock().expect("never poisoned");
        for wakers in connections.iter().filter_map(Weak::upgrade) {
            wakers.read.wake();
            wakers.write.wake();
        }
    }

    /// Wrap an accepted connection.
    pub(crate) fn wrap(self: &Arc<Self>, inner: TcpStream) -> FaultyStream {
        let wakers = Arc::new(Wakers::default());
        let mut connections = self.connections.lock().expect("never poisoned");
        connections.retain(|weak| weak.strong_count() > 0);
        connections.push(Arc::downgrade(&wakers));
        FaultyStream {
            inner,
            faults: Arc::clone(self),
            wakers,
        }
    }
}

/// A connection that obeys its node's fault switch.
#[derive(Debug)]
pub struct FaultyStream {
    inner: TcpStream,
    faults: Arc<Faults>,
    wakers: Arc<Wakers>,
}

fn reset() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionReset, "storage node killed")
}

impl AsyncRead for FaultyStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buffer: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.wakers.read.register(context.waker());
        match self.faults.state.load(Ordering::SeqCst) {
            KILLED => Poll::Ready(Err(reset())),
            FROZEN => Poll::Pending,
            _ => Pin::new(&mut self.inner).poll_read(context, buffer),
        }
    }
}

impl AsyncWrite for FaultyStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buffer: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.wakers.write.register(context.waker());
        match self.faults.state.load(Ordering::SeqCst) {
            KILLED => Poll::Ready(Err(reset())),
            FROZEN => Poll::Pending,
            _ => Pin::new(&mut self.inner).poll_write(context, buffer),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.wakers.write.register(context.waker());
        match self.faults.state.load(Ordering::SeqCst) {
            KILLED => Poll::Ready(Err(reset())),
            FROZEN => Poll::Pending,
            _ => Pin::new(&mut self.inner).poll_flush(context),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(context)
    }
}

impl Connected for FaultyStream {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}
