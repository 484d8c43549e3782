//! Noticing a client that went away. pgwire reads a connection only
//! between queries, so a client that hangs up while its query runs (an
//! aggregation that has sent nothing yet) would go unnoticed until the first
//! row is written. A watcher asks the kernel whether the peer closed its end
//! (`POLLRDHUP`), without reading what pgwire has still to read.

use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;

/// How often a connection is checked for a hang-up, in milliseconds: the
/// longest a query outlives its client.
pub(crate) const HANGUP_POLL_MS: u64 = 100;

/// Resolves when the peer of `socket` (a duplicate of the connection's
/// descriptor) has closed its end or the connection failed.
pub(crate) async fn client_gone(socket: OwnedFd) {
    let mut tick = tokio::time::interval(Duration::from_millis(HANGUP_POLL_MS));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if hung_up(&socket) {
            return;
        }
    }
}

fn hung_up(socket: &OwnedFd) -> bool {
    let mut poll = libc::pollfd {
        fd: socket.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd, a descriptor this function borrows, no wait.
    let ready = unsafe { libc::poll(&mut poll, 1, 0) };
    ready > 0 && poll.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}
