//! Resource control: the pushdown pool.
//!
//! ```text
//!   DoGet ─> admit ─┬─ a worker is free .............. run the fragment on the pool
//!                   ├─ wait in the queue ≤ budget .... run the fragment on the pool
//!                   └─ no workers / queue full /
//!                      budget spent ................... serve the slice raw (pages as stored)
//! ```
//!
//! Fragments run on the pool's own threads (a Tokio runtime of
//! `pushdown_workers` threads), never on the threads that answer catalog
//! requests, byte-range reads and raw slices, so plain reads are never
//! queued behind pushdown work (Taurus IV-D: "NDP processing does not block
//! regular page reads"). At most `pushdown_workers` slices are processed at
//! once; a request waits for a worker at most `pushdown_wait`, and at most
//! `pushdown_queue_max` requests wait. Whatever is not admitted is served raw
//! and the compute node runs the fragment itself: pushdown is best effort.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::execute::Admitted;

/// The pushdown pool of one storage node.
#[derive(Debug)]
pub struct PushdownPool {
    runtime: Option<tokio::runtime::Runtime>,
    slots: Arc<Semaphore>,
    workers: usize,
    queue_max: usize,
    wait: Duration,
    waiting: AtomicUsize,
    running: Arc<AtomicUsize>,
}

/// The answer to a request for a pushdown worker.
#[derive(Debug)]
pub enum Admission {
    /// Run the fragment on the pool, holding this slot while it runs.
    Run(Slot, Admitted),
    /// Serve the slice raw, for this reason.
    Raw(String),
}

/// A pushdown worker held by one slice; released when dropped.
#[derive(Debug)]
pub struct Slot {
    _permit: OwnedSemaphorePermit,
    running: Arc<AtomicUsize>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.running.fetch_sub(1, Ordering::Relaxed);
    }
}

impl PushdownPool {
    /// A pool of `workers` threads (none when zero).
    pub fn new(workers: usize, queue_max: usize, wait: Duration) -> std::io::Result<Self> {
        let runtime = if workers == 0 {
            None
        } else {
            Some(
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(workers)
                    .thread_name("sieve-pushdown")
                    .enable_all()
                    .build()?,
            )
        };
        Ok(Self {
            runtime,
            slots: Arc::new(Semaphore::new(workers)),
            workers,
            queue_max,
            wait,
            waiting: AtomicUsize::new(0),
            running: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Ask for a worker: at once if one is free, after waiting in the queue
    /// at most the wait budget, or not at all (serve raw).
    pub async fn admit(&self) -> Admission {
        if self.workers == 0 {
            return Admission::Raw("the node has no pushdown workers".to_string());
        }
        if let Ok(permit) = Arc::clone(&self.slots).try_acquire_owned() {
            return Admission::Run(self.slot(permit), self.admitted(Duration::ZERO));
        }
        // Counted while queued, also when the request is dropped (its client
        // went away) before it gets a worker.
        struct Queued<'a>(&'a AtomicUsize);
        impl Drop for Queued<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        let queued = Queued(&self.waiting);
        if self.waiting.fetch_add(1, Ordering::Relaxed) >= self.queue_max {
            return Admission::Raw(format!(
                "the pushdown queue is full ({} waiting)",
                self.queue_max
            ));
        }
        let started = Instant::now();
        let acquired =
            tokio::time::timeout(self.wait, Arc::clone(&self.slots).acquire_owned()).await;
        drop(queued);
        match acquired {
            Ok(Ok(permit)) => Admission::Run(self.slot(permit), self.admitted(started.elapsed())),
            Ok(Err(_)) => Admission::Raw("the pushdown pool is shut down".to_string()),
            Err(_) => Admission::Raw(format!(
                "no pushdown worker free within {} ms",
                self.wait.as_millis()
            )),
        }
    }

    fn slot(&self, permit: OwnedSemaphorePermit) -> Slot {
        self.running.fetch_add(1, Ordering::Relaxed);
        Slot {
            _permit: permit,
            running: Arc::clone(&self.running),
        }
    }

    fn admitted(&self, waited: Duration) -> Admitted {
        Admitted {
            waited,
            running: self.running.load(Ordering::Relaxed) as u32,
        }
    }

    /// Run `work` on the pool's threads. Only called with a [`Slot`], so
    /// only when the pool has workers.
    pub fn spawn<F>(&self, work: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        match &self.runtime {
            Some(runtime) => {
                runtime.spawn(work);
            }
            None => {
                // Unreachable: a pool without workers admits nothing.
                tokio::spawn(work);
            }
        }
    }

    /// Requests waiting for a worker now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Slices being processed now.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Relaxed)
    }

    /// The pool's size.
    pub fn workers(&self) -> usize {
        self.workers
    }
}

impl Drop for PushdownPool {
    fn drop(&mut self) {
        // A runtime may not be dropped inside another's async context.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}
