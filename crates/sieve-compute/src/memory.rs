//! The compute node's memory bound: one DataFusion memory pool per session.
//!
//! DataFusion's default pool is unbounded: an aggregation with a group per
//! order key grows its hash table with the scale factor until the machine
//! runs out. Sieve gives every session a [`FairSpillPool`] (wrapped in a
//! [`TrackConsumersPool`], so that an exhausted pool names its five largest
//! consumers) of half the machine's memory ([`AUTO_MEMORY_FRACTION`]):
//!
//! - operators that can spill (sort, grouped aggregation, sort-merge join,
//!   repartition buffers) each get a fair share of what unspillable ones
//!   leave, and spill to the OS temporary directory past it;
//! - a hash join's build side cannot spill in DataFusion 55: it may take
//!   the whole pool, and past it the query fails with `Resources exhausted`
//!   rather than the process being killed.
//!
//! DataFusion's own setting changes it: `SET datafusion.runtime.memory_limit
//! = '4G'` in SQL (DataFusion then uses its greedy pool), or `--set
//! datafusion.runtime.memory_limit=4G|auto|unbounded` on the command line
//! ([`crate::SieveSession::apply_settings`], a fair pool again).
//!
//! `sieve.query_memory_limit` bounds one statement's share of it:
//! [`StatementEndExec`], the root of every plan, runs the statement with a
//! [`StatementPool`] of that size, shared by the statement's own consumers
//! as a [`FloorsPool`] shares it (each spilling consumer a floor, the rest
//! to those that need more), whose every byte is also taken from the
//! session's pool. A statement's working memory then stops growing with
//! the data it reads, and one statement of a server cannot take all of the
//! session's pool. It is off by default (`unbounded`) because of what it
//! costs at SF 100 and because it bounds the pool, not the process: TPC-H
//! at SF 100 (3 nodes, loopback) under `512M` took 35% more compute CPU
//! (Q13's aggregation spills sorted by key: 19.7 -> 40.2 s; Q9's joins
//! 28.5 -> 37.2 s) and peaked at 1,237 MB instead of 1,635 MB, Q21 holding
//! about 700 MB outside the pool; under `1G` it took 9% more and peaked as
//! without a bound. At SF 10 both bounds leave each query's time and
//! peak as without one (`docs/results/2026-11-29-issue20-part28.md`).
//!
//! Sieve's own buffers are bounded by their own settings and are not in the
//! pool: slices in flight (`sieve.slices_in_flight`) and batches of a scan
//! started early (`sieve.early_start_buffer_bytes`). Build keys kept for
//! join filters are in the session's pool but not in the statement's
//! (consumer `BuildKeys`), and bounded by `sieve.join_filter_keys_max`
//! distinct keys or a bitmap of 128 MiB per column.
//!
//! What statements freed goes back to the operating system once the
//! process is idle ([`ReleaseMemoryPlanner`]): glibc keeps freed heap
//! memory for later allocations, so without it a server between queries
//! holds the resident memory of the largest query it ran (TPC-H SF 100: a
//! floor of 784 MB after Q16).

use std::fmt;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::catalog::Session;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{
    human_readable_size, internal_err, plan_err, resources_datafusion_err, DataFusionError, Result,
};
use datafusion::execution::context::QueryPlanner;
use datafusion::execution::memory_pool::{
    FairSpillPool, MemoryConsumer, MemoryLimit, MemoryPool, MemoryReservation, TrackConsumersPool,
    UnboundedMemoryPool,
};
use datafusion::execution::runtime_env::{RuntimeEnv, RuntimeEnvBuilder};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::LogicalPlan;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use datafusion::physical_planner::{DefaultPhysicalPlanner, PhysicalPlanner};
use datafusion::prelude::SessionContext;

use crate::SieveConfig;

/// The setting that sizes the pool (DataFusion's own).
pub const MEMORY_LIMIT_SETTING: &str = "datafusion.runtime.memory_limit";

/// Share of the machine's memory `auto` (the default) gives a session's pool.
pub const AUTO_MEMORY_FRACTION: f64 = 0.5;

/// Consumers an exhausted pool names in its error.
const CONSUMERS_NAMED: usize = 5;

/// A pool size read from a memory limit setting (`auto`, `unbounded` or a
/// size with a unit K, M or G): `None` for `unbounded`.
pub fn memory_limit_bytes(value: &str) -> Result<Option<usize>> {
    let value = value.trim();
    match value.to_ascii_lowercase().as_str() {
        "unbounded" | "none" => Ok(None),
        "auto" => Ok(Some(match physical_memory_bytes() {
            Some(total) => (total as f64 * AUTO_MEMORY_FRACTION) as usize,
            // Not Linux, or /proc unreadable: a bound that fits any machine
            // that runs Sieve's benchmarks.
            None => 8 << 30,
        })),
        _ => match SessionContext::parse_capacity_limit(MEMORY_LIMIT_SETTING, &value.to_ascii_uppercase()) {
            Ok(bytes) if bytes > 0 => Ok(Some(bytes)),
            _ => plan_err!(
                "{MEMORY_LIMIT_SETTING} must be 'auto', 'unbounded' or a size such as '4G' or '512M', not '{value}'"
            ),
        },
    }
}

/// The machine's memory (`MemTotal` of `/proc/meminfo`), if known.
fn physical_memory_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|line| line.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The pool for `limit` bytes (`None`: unbounded).
pub fn memory_pool(limit: Option<usize>) -> Arc<dyn MemoryPool> {
    match limit {
        Some(bytes) => Arc::new(TrackConsumersPool::new(
            FairSpillPool::new(bytes),
            NonZeroUsize::new(CONSUMERS_NAMED).expect("non-zero"),
        )),
        None => Arc::new(UnboundedMemoryPool::default()),
    }
}

/// `runtime` with its memory pool replaced by one for `value` (see
/// [`memory_limit_bytes`]); its disk manager (where spills go) and
/// object stores are kept.
pub fn runtime_with_memory_limit(runtime: &RuntimeEnv, value: &str) -> Result<Arc<RuntimeEnv>> {
    let limit = memory_limit_bytes(value)?;
    RuntimeEnvBuilder::from_runtime_env(runtime)
        .with_memory_pool(memory_pool(limit))
        .build_arc()
}

/// One statement's memory pool: the statement's consumers share `limit`
/// bytes as a [`FloorsPool`] shares them (the largest consumers named when
/// it refuses), and every byte granted is also taken from the session's
/// pool, which refuses past its own bound.
#[derive(Debug)]
pub struct StatementPool {
    own: TrackConsumersPool<FloorsPool>,
    session: Arc<dyn MemoryPool>,
}

impl StatementPool {
    /// A pool of `limit` bytes for one statement of a session whose pool is
    /// `session`.
    pub fn new(limit: usize, session: Arc<dyn MemoryPool>) -> Self {
        Self {
            own: TrackConsumersPool::new(
                FloorsPool::new(limit),
                NonZeroUsize::new(CONSUMERS_NAMED).expect("non-zero"),
            ),
            session,
        }
    }
}

/// A bounded pool whose spilling consumers each have a floor and share
/// the rest by need.
///
/// DataFusion's [`FairSpillPool`] gives each consumer that can spill an
/// equal part of what unspillable ones leave, counted over every spilling
/// consumer the plan has registered, idle ones included: a join's build
/// that has not started, a sort that has not had a batch. Under a 1 GB
/// bound TPC-H Q13's aggregation at SF 100 had a few tenths of it and
/// spilled 2 GB in 126 runs, and SF 10's queries, which need less than
/// the bound in all, spilled too.
///
/// Here each registered spilling consumer is guaranteed a floor of half
/// that equal part, so an operator that starts late still finds room; the
/// other half goes to consumers that need more than their floor, first
/// come, each up to an equal part of it among those over their floor. A
/// consumer past that part is refused and spills, which gives its memory
/// to the others. Unspillable memory is granted while the bound has room,
/// as in the fair pool (and shrinks the floors).
///
/// A consumer can hold past its part when it grew while fewer shared the
/// memory, and a pool cannot make it spill before its next request. When
/// such a consumer is a sort whose input is an aggregation that spilled,
/// its next batch waits on the aggregation, whose merge of its spilled runs
/// cannot spill: refused, it failed its statement (under a 36 MB bound, one
/// run in ten). So what consumers hold past their parts is owed, and one
/// within its part is granted it before it is given back, past the bound
/// by at most half of it; the consumers past their parts are refused at
/// their next request and spill. A consumer that holds nothing has nothing
/// to spill and would fail its statement if refused: it is granted past
/// its part and past the bound by as much (a sort reserves its first batch
/// sliced from an aggregation's output as if it held the whole output,
/// DataFusion 55). The pool holds at most 1.5 times its bound.
/// TPC-H SF 10 under a 512 MB bound ran here as without
/// a bound (Q9 peaked at 588 MB, Q13 took 1.44 s); with the fair pool Q9
/// peaked at 351 MB and Q13 took 2.03 s, their operators spilling.
#[derive(Debug)]
pub struct FloorsPool {
    limit: usize,
    state: std::sync::Mutex<FloorsState>,
}

#[derive(Debug, Default)]
struct FloorsState {
    unspillable: usize,
    spillable: usize,
    /// Bytes each registered spilling consumer holds, by consumer id.
    spillers: std::collections::HashMap<usize, usize>,
}

/// How a [`FloorsPool`] shares its bound, seen from one spilling consumer.
#[derive(Debug)]
struct Shares {
    /// Each spilling consumer's floor.
    floor: usize,
    /// What a consumer past its floor may hold: its floor and an equal
    /// part of the shared half among those past their floors.
    part: usize,
    /// Floors the other consumers have not used.
    unused_floors: usize,
    /// What the other consumers hold past their parts.
    past_parts: usize,
}

impl FloorsState {
    /// The shares of a pool of `limit` bytes for consumer `id` once it
    /// holds `after` bytes.
    fn shares(&self, limit: usize, id: usize, after: usize) -> Shares {
        let spill_available = limit.saturating_sub(self.unspillable);
        let spillers = self.spillers.len().max(1);
        let floor = spill_available / (2 * spillers);
        let shared = spill_available.saturating_sub(floor * spillers);
        let others = || self.spillers.iter().filter(move |(&other, _)| other != id);
        let mut past_floors = usize::from(after > floor);
        let mut unused_floors = 0;
        for (_, &bytes) in others() {
            if bytes < floor {
                unused_floors += floor - bytes;
            } else if bytes > floor {
                past_floors += 1;
            }
        }
        let part = floor + shared / past_floors.max(1);
        let past_parts = others().map(|(_, &bytes)| bytes.saturating_sub(part)).sum();
        Shares {
            floor,
            part,
            unused_floors,
            past_parts,
        }
    }
}

impl FloorsPool {
    /// A pool of `limit` bytes.
    pub fn new(limit: usize) -> Self {
        Self {
            limit,
            state: Default::default(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, FloorsState> {
        // Every change to the state is whole before the lock is released.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn refuse(
        &self,
        reservation: &MemoryReservation,
        additional: usize,
        available: usize,
    ) -> DataFusionError {
        resources_datafusion_err!(
            "Failed to allocate additional {} for {} with {} already allocated for this reservation - {} remain available for the total memory pool: {self}",
            human_readable_size(additional),
            reservation.consumer().name(),
            human_readable_size(reservation.size()),
            human_readable_size(available)
        )
    }
}

impl fmt::Display for FloorsPool {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "floors(pool_size: {})",
            human_readable_size(self.limit)
        )
    }
}

impl MemoryPool for FloorsPool {
    fn name(&self) -> &str {
        "floors"
    }

    fn register(&self, consumer: &MemoryConsumer) {
        if consumer.can_spill() {
            self.state().spillers.entry(consumer.id()).or_default();
        }
    }

    fn unregister(&self, consumer: &MemoryConsumer) {
        if consumer.can_spill() {
            let mut state = self.state();
            // Reservations are freed before their consumer unregisters;
            // whatever is left is given back all the same.
            let held = state.spillers.remove(&consumer.id()).unwrap_or(0);
            state.spillable = state.spillable.saturating_sub(held);
        }
    }

    fn grow(&self, reservation: &MemoryReservation, additional: usize) {
        let mut state = self.state();
        let consumer = reservation.consumer();
        if consumer.can_spill() {
            *state.spillers.entry(consumer.id()).or_default() += additional;
            state.spillable += additional;
        } else {
            state.unspillable += additional;
        }
    }

    fn shrink(&self, reservation: &MemoryReservation, shrink: usize) {
        let mut state = self.state();
        let consumer = reservation.consumer();
        if consumer.can_spill() {
            if let Some(held) = state.spillers.get_mut(&consumer.id()) {
                *held = held.saturating_sub(shrink);
            }
            state.spillable = state.spillable.saturating_sub(shrink);
        } else {
            state.unspillable = state.unspillable.saturating_sub(shrink);
        }
    }

    fn try_grow(&self, reservation: &MemoryReservation, additional: usize) -> Result<()> {
        let mut state = self.state();
        let used = state.unspillable + state.spillable;
        let available = self.limit.saturating_sub(used);
        let consumer = reservation.consumer();
        if !consumer.can_spill() {
            if additional > available {
                return Err(self.refuse(reservation, additional, available));
            }
            state.unspillable += additional;
            return Ok(());
        }
        let held = state.spillers.get(&consumer.id()).copied().unwrap_or(0);
        let after = held + additional;
        let shares = state.shares(self.limit, consumer.id(), after);
        // Past its part, a consumer that holds something is refused and
        // spills.
        if after > shares.part && held > 0 {
            return Err(self.refuse(
                reservation,
                additional,
                available.min(shares.part.saturating_sub(held)),
            ));
        }
        // Within its part, what others hold past theirs is owed to it. One
        // holding nothing has nothing to spill (refused, it would fail its
        // statement): it may pass its part, and the bound, whatever others
        // hold. Either passes the bound by at most half of it.
        let past_bound = if held == 0 {
            self.limit / 2
        } else {
            shares.past_parts.min(self.limit / 2)
        };
        let mut room = (self.limit + past_bound).saturating_sub(used);
        if after > shares.floor {
            // The floors others have not used stay theirs.
            room = room.saturating_sub(shares.unused_floors);
        }
        if additional > room {
            return Err(self.refuse(reservation, additional, room));
        }
        *state.spillers.entry(consumer.id()).or_default() = after;
        state.spillable += additional;
        Ok(())
    }

    fn reserved(&self) -> usize {
        let state = self.state();
        state.unspillable + state.spillable
    }

    fn memory_limit(&self) -> MemoryLimit {
        MemoryLimit::Finite(self.limit)
    }
}

impl fmt::Display for StatementPool {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "statement({}) within {}", self.own, self.session)
    }
}

impl MemoryPool for StatementPool {
    fn name(&self) -> &str {
        "statement"
    }

    fn register(&self, consumer: &MemoryConsumer) {
        self.own.register(consumer);
        self.session.register(consumer);
    }

    fn unregister(&self, consumer: &MemoryConsumer) {
        self.own.unregister(consumer);
        self.session.unregister(consumer);
    }

    fn grow(&self, reservation: &MemoryReservation, additional: usize) {
        self.own.grow(reservation, additional);
        self.session.grow(reservation, additional);
    }

    fn shrink(&self, reservation: &MemoryReservation, shrink: usize) {
        self.own.shrink(reservation, shrink);
        self.session.shrink(reservation, shrink);
    }

    fn try_grow(&self, reservation: &MemoryReservation, additional: usize) -> Result<()> {
        self.own.try_grow(reservation, additional)?;
        if let Err(error) = self.session.try_grow(reservation, additional) {
            self.own.shrink(reservation, additional);
            return Err(error);
        }
        Ok(())
    }

    fn reserved(&self) -> usize {
        self.own.reserved()
    }

    fn memory_limit(&self) -> MemoryLimit {
        match (self.own.memory_limit(), self.session.memory_limit()) {
            (MemoryLimit::Finite(own), MemoryLimit::Finite(session)) => {
                MemoryLimit::Finite(own.min(session))
            }
            (MemoryLimit::Finite(own), _) => MemoryLimit::Finite(own),
            (_, session) => session,
        }
    }
}

/// The session's pool, as a statement run under its own
/// [`StatementPool`] keeps it in its session config.
#[derive(Debug)]
struct SessionPool(Arc<dyn MemoryPool>);

/// The pool of the session `context` runs in: the statement's own pool
/// takes from it, and what is bounded by its own settings rather than by
/// the statement's (join filters' build keys) is counted there.
pub fn session_pool(context: &TaskContext) -> Arc<dyn MemoryPool> {
    match context.session_config().get_extension::<SessionPool>() {
        Some(session) => Arc::clone(&session.0),
        None => Arc::clone(context.memory_pool()),
    }
}

/// The bound `sieve.query_memory_limit` sets (`None`: the session's pool
/// alone).
fn query_memory_bytes(sieve: &SieveConfig) -> Result<Option<usize>> {
    match memory_limit_bytes(&sieve.query_memory_limit) {
        Ok(limit) => Ok(limit),
        Err(_) => plan_err!(
            "{QUERY_MEMORY_SETTING} must be 'auto', 'unbounded' or a size such as '1G' or '512M', not '{}'",
            sieve.query_memory_limit
        ),
    }
}

/// The setting that bounds one statement's memory.
pub const QUERY_MEMORY_SETTING: &str = "sieve.query_memory_limit";

/// DataFusion's own query planner, with each plan's root wrapped in a
/// [`StatementEndExec`] (unless `sieve.release_memory_after_statements` is
/// off): when the process has run no statement for
/// `sieve.release_memory_idle_ms` (0: none) after the last one ended, the
/// memory freed goes back to the operating system. The wrapper sits above
/// `EXPLAIN`'s and `EXPLAIN ANALYZE`'s own roots, so plans shown do not
/// show it.
#[derive(Debug, Default)]
pub struct ReleaseMemoryPlanner;

#[async_trait]
impl QueryPlanner for ReleaseMemoryPlanner {
    async fn create_physical_plan(
        &self,
        logical_plan: &LogicalPlan,
        session: &dyn Session,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let plan = DefaultPhysicalPlanner::default()
            .create_physical_plan(logical_plan, session)
            .await?;
        let sieve = SieveConfig::of(session.config().options());
        let query_memory = query_memory_bytes(&sieve)?;
        Ok(
            if sieve.release_memory_after_statements || query_memory.is_some() {
                Arc::new(StatementEndExec {
                    input: plan,
                    idle: sieve
                        .release_memory_after_statements
                        .then(|| std::time::Duration::from_millis(sieve.release_memory_idle_ms)),
                    query_memory,
                    runtime: std::sync::OnceLock::new(),
                })
            } else {
                plan
            },
        )
    }
}

/// A statement's root: passes its input's batches on, and counts the
/// statement's output streams open in the process. When the last one ends
/// (drained, failed or dropped) and no statement starts within `idle`
/// after it (0 by default: at once), [`release_freed_memory`] runs on a
/// blocking thread.
///
/// Memory returned is memory the next statement touches again, page by
/// page. With glibc's `malloc_trim`, returned after every statement,
/// TPC-H SF 10's 22 queries run back to back took 4% to 19% longer
/// (compute CPU 13% to 38% more); with jemalloc's purge, what the `sieve`
/// binary does, it cost nothing measurable, and a statement's peak no
/// longer carries what the one before it freed
/// (docs/results/2026-11-30-issue20-part39.md). A server still gives its
/// memory back between bursts either way.
///
/// It also runs the statement under `sieve.query_memory_limit`: every
/// partition of it executes with one [`StatementPool`], made at its first
/// partition's start.
#[derive(Debug)]
pub struct StatementEndExec {
    input: Arc<dyn ExecutionPlan>,
    /// `None`: memory is not returned (`sieve.release_memory_after_statements`
    /// off).
    idle: Option<std::time::Duration>,
    /// The statement's memory bound; `None`: the session's pool alone.
    query_memory: Option<usize>,
    /// The runtime the statement's partitions share: the session's, with
    /// the statement's pool.
    runtime: std::sync::OnceLock<Arc<RuntimeEnv>>,
}

impl StatementEndExec {
    /// The statement's own plan.
    pub fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.input
    }

    /// `context`, with the statement's pool in its runtime if it has a
    /// bound.
    fn statement_context(&self, context: Arc<TaskContext>) -> Arc<TaskContext> {
        let Some(limit) = self.query_memory else {
            return context;
        };
        let session = Arc::clone(&context.runtime_env().memory_pool);
        let runtime = self.runtime.get_or_init(|| {
            let pool = Arc::new(StatementPool::new(limit, Arc::clone(&session)));
            Arc::new(RuntimeEnv {
                memory_pool: pool,
                ..context.runtime_env().as_ref().clone()
            })
        });
        Arc::new(TaskContext::new(
            context.task_id(),
            context.session_id(),
            context
                .session_config()
                .clone()
                .with_extension(Arc::new(SessionPool(session))),
            context.scalar_functions().clone(),
            context.higher_order_functions().clone(),
            context.aggregate_functions().clone(),
            context.window_functions().clone(),
            Arc::clone(runtime),
        ))
    }
}

impl DisplayAs for StatementEndExec {
    fn fmt_as(
        &self,
        _format: DisplayFormatType,
        formatter: &mut fmt::Formatter<'_>,
    ) -> fmt::Result {
        write!(formatter, "StatementEndExec:")?;
        if let Some(limit) = self.query_memory {
            write!(formatter, " statement memory at most {} MiB,", limit >> 20)?;
        }
        match self.idle {
            Some(idle) => write!(
                formatter,
                " freed memory returned once no statement runs for {} ms",
                idle.as_millis()
            ),
            None => write!(formatter, " freed memory kept"),
        }
    }
}

impl ExecutionPlan for StatementEndExec {
    fn name(&self) -> &str {
        "StatementEndExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.input.properties()
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        vec![false]
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let [input] = &children[..] else {
            return internal_err!("StatementEndExec has one child");
        };
        Ok(Arc::new(Self {
            input: Arc::clone(input),
            idle: self.idle,
            query_memory: self.query_memory,
            runtime: std::sync::OnceLock::new(),
        }))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let context = self.statement_context(context);
        let stream = self.input.execute(partition, context)?;
        Ok(match self.idle {
            Some(idle) => crate::guarded::holding(stream, OpenStatement::begin(idle)),
            None => stream,
        })
    }
}

/// Statement output streams open in this process.
static STATEMENTS_OPEN: AtomicUsize = AtomicUsize::new(0);
/// Statement output streams begun since the process started: a release
/// waiting for the process to go idle checks that none began meanwhile.
static STATEMENTS_BEGUN: AtomicU64 = AtomicU64::new(0);
/// A release running: at most one at a time.
static RELEASING: AtomicBool = AtomicBool::new(false);
/// Releases run since the process started.
static RELEASES: AtomicU64 = AtomicU64::new(0);

/// How many times the freed memory was returned since the process
/// started (a release already running is not started again).
pub fn statement_releases() -> u64 {
    RELEASES.load(Ordering::Acquire)
}

/// Wait, at most `bound`, for a release started by a statement's end to
/// finish: what a measurement of the next statement's peak memory does
/// first (the bench), so that it starts from the memory returned.
pub async fn release_settled(bound: std::time::Duration) {
    let start = std::time::Instant::now();
    while RELEASING.load(Ordering::Acquire) && start.elapsed() < bound {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// One open statement output stream; the last to drop releases memory
/// once the process has been idle for `idle`.
#[derive(Debug)]
struct OpenStatement {
    idle: std::time::Duration,
}

impl OpenStatement {
    fn begin(idle: std::time::Duration) -> Self {
        STATEMENTS_BEGUN.fetch_add(1, Ordering::AcqRel);
        STATEMENTS_OPEN.fetch_add(1, Ordering::AcqRel);
        Self { idle }
    }
}

impl Drop for OpenStatement {
    fn drop(&mut self) {
        if STATEMENTS_OPEN.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        if self.idle.is_zero() {
            release_in_background();
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            release_in_background();
            return;
        };
        let begun = STATEMENTS_BEGUN.load(Ordering::Acquire);
        let idle = self.idle;
        drop(runtime.spawn(async move {
            tokio::time::sleep(idle).await;
            if STATEMENTS_OPEN.load(Ordering::Acquire) == 0
                && STATEMENTS_BEGUN.load(Ordering::Acquire) == begun
            {
                release_in_background();
            }
        }));
    }
}

/// Return freed memory on a blocking thread (at once without a runtime),
/// unless a release is running already.
fn release_in_background() {
    if RELEASING.swap(true, Ordering::AcqRel) {
        return;
    }
    // The flag is cleared when the release ends or, if its runtime shuts
    // down before it runs, when the dropped task drops its token.
    let token = Releasing;
    let release = move || {
        let _token = token;
        release_freed_memory();
        RELEASES.fetch_add(1, Ordering::AcqRel);
    };
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => drop(runtime.spawn_blocking(release)),
        Err(_) => release(),
    }
}

/// A release in progress: [`RELEASING`] until dropped.
#[derive(Debug)]
struct Releasing;

impl Drop for Releasing {
    fn drop(&mut self) {
        RELEASING.store(false, Ordering::Release);
    }
}

/// Give the memory freed so far back to the operating system: the
/// allocator's own release ([`sieve_format::set_memory_releaser`]; the
/// `sieve` binary purges jemalloc's arenas and trims glibc's heap),
/// glibc's `malloc_trim` without one.
pub fn release_freed_memory() {
    sieve_format::release_freed_memory();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A spilling consumer of `pool`.
    fn spiller(pool: &Arc<dyn MemoryPool>, name: impl Into<String>) -> MemoryReservation {
        MemoryConsumer::new(name)
            .with_can_spill(true)
            .register(pool)
    }

    #[test]
    fn limits_parse_and_bad_ones_are_named() {
        assert_eq!(memory_limit_bytes("512M").unwrap(), Some(512 << 20));
        assert_eq!(memory_limit_bytes(" 2g ").unwrap(), Some(2 << 30));
        assert_eq!(memory_limit_bytes("Unbounded").unwrap(), None);
        let auto = memory_limit_bytes("auto").unwrap().unwrap();
        assert!(auto >= 64 << 20, "auto gave {auto} bytes");
        for bad in ["", "lots", "0M", "-1G", "12"] {
            let error = memory_limit_bytes(bad).unwrap_err().to_string();
            assert!(error.contains(MEMORY_LIMIT_SETTING), "{bad}: {error}");
        }
        assert!(matches!(
            memory_pool(Some(1 << 20)).memory_limit(),
            MemoryLimit::Finite(_)
        ));
    }

    #[test]
    fn a_consumer_alone_past_its_floor_takes_the_shared_half_and_others_keep_their_floors() {
        let pool = Arc::new(FloorsPool::new(100 << 20)) as Arc<dyn MemoryPool>;
        let (a, b, c, d) = (
            spiller(&pool, "a"),
            spiller(&pool, "b"),
            spiller(&pool, "c"),
            spiller(&pool, "d"),
        );
        // Four spilling consumers: floors of 12.5 MB each, 50 MB shared.
        // DataFusion's fair pool would stop `a` at 25 MB.
        a.try_grow(60 << 20).unwrap();
        a.try_grow(2 << 20).unwrap();
        let error = a.try_grow(1 << 20).unwrap_err().to_string();
        assert!(error.contains("Resources exhausted"), "{error}");
        b.try_grow(12 << 20).unwrap();
        // Two consumers past their floors: each part is its floor and half
        // the shared memory, 37.5 MB. `a` holds 24.5 MB past it, owed to
        // `b`, which takes what `c`'s and `d`'s floors leave of it.
        assert!(b.try_grow((51 << 19) + 1).is_err());
        b.try_grow(51 << 19).unwrap();
        assert!(b.try_grow(1).is_err(), "b past its part");
        // `c` and `d` still have their floors, past the bound.
        c.try_grow(25 << 19).unwrap();
        d.try_grow(25 << 19).unwrap();
        assert_eq!(pool.reserved(), 249 << 19);
        // `a` is refused at its next request, and spills.
        assert!(a.try_grow(1).is_err());
        a.free();
        assert_eq!(pool.reserved(), 125 << 19);
        // Unspillable memory takes what the bound has left, and nothing
        // owed: the consumers past their parts do not pay it back.
        let unspillable = MemoryConsumer::new("u").register(&pool);
        assert!(unspillable.try_grow((75 << 19) + 1).is_err());
        unspillable.try_grow(75 << 19).unwrap();
        assert_eq!(pool.reserved(), 100 << 20);
        drop((a, b, c, d, unspillable));
        assert_eq!(pool.reserved(), 0);
    }

    /// A sort that took the shared half while the aggregation feeding it
    /// was spilled cannot starve that aggregation: what the sort holds past
    /// its part is granted to the aggregation, and the sort spills at its
    /// next batch.
    #[test]
    fn a_consumer_within_its_part_is_granted_what_others_hold_past_theirs() {
        const MB: usize = 1 << 20;
        let pool = Arc::new(FloorsPool::new(40 * MB)) as Arc<dyn MemoryPool>;
        let (aggregate, sort) = (spiller(&pool, "aggregate"), spiller(&pool, "sort"));
        // Floors of 10 MB, 20 MB shared: the sort, alone past its floor,
        // takes all of it.
        aggregate.try_grow(8 * MB).unwrap();
        sort.try_grow(30 * MB).unwrap();
        // A merge's unspillable 2 MB shrinks the floors to 9.5 MB; the
        // sort's part, once the aggregation is past its floor too, to 19.
        let merge = MemoryConsumer::new("merge").register(&pool);
        merge.try_grow(2 * MB).unwrap();
        assert!(merge.try_grow(1).is_err(), "the bound is reached");
        // The aggregation is granted the sort's 11 MB past its part.
        aggregate.try_grow(2 * MB).unwrap();
        aggregate.try_grow(9 * MB).unwrap();
        assert!(aggregate.try_grow(1).is_err(), "past its own part");
        assert_eq!(pool.reserved(), 51 * MB);
        // The sort is refused and spills; the pool is within its bound.
        assert!(sort.try_grow(1).is_err());
        sort.free();
        assert_eq!(pool.reserved(), 21 * MB);
        assert!(sort.try_grow(10 * MB).is_ok());
    }

    #[test]
    fn a_floors_pool_holds_at_most_one_and_a_half_bounds_and_always_grants_within_a_floor() {
        const LIMIT: usize = 64 << 20;
        const SPILLERS: usize = 6;
        let pool = Arc::new(FloorsPool::new(LIMIT)) as Arc<dyn MemoryPool>;
        let reservations: Vec<_> = (0..SPILLERS)
            .map(|index| spiller(&pool, format!("s{index}")))
            .collect();
        let floor = LIMIT / (2 * SPILLERS);
        // A fixed pseudo-random walk (64-bit LCG): grow, shrink or free.
        let mut seed = 0x2026_1129_u64;
        let mut next = |bound: usize| {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            (seed >> 33) as usize % bound
        };
        let (mut granted, mut past_bound) = (0, 0);
        for _ in 0..20_000 {
            let reservation = &reservations[next(SPILLERS)];
            match next(10) {
                0 => {
                    reservation.free();
                }
                1..=3 => reservation.shrink(next(reservation.size() + 1)),
                _ => {
                    let additional = next(8 << 20) + 1;
                    let within_floor = reservation.size() + additional <= floor;
                    match reservation.try_grow(additional) {
                        Ok(()) => granted += 1,
                        Err(error) => assert!(
                            !within_floor,
                            "refused within its floor ({} + {additional} of {floor}): {error}",
                            reservation.size()
                        ),
                    }
                }
            }
            let held: usize = reservations.iter().map(MemoryReservation::size).sum();
            assert_eq!(pool.reserved(), held);
            assert!(
                held <= LIMIT + LIMIT / 2,
                "{held} bytes held in a pool of {LIMIT}"
            );
            past_bound += usize::from(held > LIMIT);
        }
        assert!(granted > 1_000, "only {granted} grants");
        // The walk reaches what is owed.
        assert!(past_bound > 0, "never past the bound");
    }

    /// A consumer that holds nothing (it spilled everything) is granted
    /// past its part, and past the bound by up to half of it, what the
    /// others' floors leave.
    #[test]
    fn a_consumer_holding_nothing_takes_past_its_part_what_the_floors_leave() {
        const MB: usize = 1 << 20;
        let pool = Arc::new(FloorsPool::new(40 * MB)) as Arc<dyn MemoryPool>;
        let (aggregate, sort, idle) = (
            spiller(&pool, "aggregate"),
            spiller(&pool, "sort"),
            spiller(&pool, "idle"),
        );
        // Floors of 40 / 6 MB; the aggregation takes its part.
        let floor = 40 * MB / 6;
        let part = floor + (40 * MB - 3 * floor) / 2;
        aggregate.try_grow(part - MB).unwrap();
        // Free: 40 - part + 1 MB; the idle consumer's floor stays its own.
        let room = 40 * MB - (part - MB) - floor;
        assert!(
            room > part - floor,
            "the test needs room past the sort's part"
        );
        // Holding something, the sort is held to its part.
        sort.try_grow(MB).unwrap();
        assert!(sort.try_grow(part).is_err());
        // Holding nothing, it takes what the idle floor leaves of one and
        // a half bounds, not more.
        sort.free();
        assert!(sort.try_grow(room + 20 * MB + 1).is_err());
        sort.try_grow(room + 20 * MB).unwrap();
        assert!(sort.size() > part);
        // And the idle consumer still has its floor.
        idle.try_grow(floor).unwrap();
        assert_eq!(pool.reserved(), 60 * MB);
        // Holding something past its part, the sort is refused (and spills).
        assert!(sort.try_grow(1).is_err());
    }

    #[test]
    fn a_statement_pool_grants_within_its_bound_and_the_sessions() {
        let session = memory_pool(Some(10 << 20));
        let first =
            Arc::new(StatementPool::new(4 << 20, Arc::clone(&session))) as Arc<dyn MemoryPool>;
        let second =
            Arc::new(StatementPool::new(8 << 20, Arc::clone(&session))) as Arc<dyn MemoryPool>;
        assert!(matches!(first.memory_limit(), MemoryLimit::Finite(bytes) if bytes == 4 << 20));
        let a = MemoryConsumer::new("a").register(&first);
        a.try_grow(3 << 20).unwrap();
        // Past the statement's bound, though the session has room.
        let error = a.try_grow(2 << 20).unwrap_err().to_string();
        assert!(error.contains("Resources exhausted"), "{error}");
        assert_eq!((first.reserved(), session.reserved()), (3 << 20, 3 << 20));
        // Within its own bound, past what the session has left: refused,
        // and nothing stays counted in the statement's pool.
        let b = MemoryConsumer::new("b").register(&second);
        b.try_grow(6 << 20).unwrap();
        assert!(b.try_grow(2 << 20).is_err());
        assert_eq!((second.reserved(), session.reserved()), (6 << 20, 9 << 20));
        a.free();
        b.try_grow(2 << 20).unwrap();
        drop(b);
        drop(a);
        assert_eq!(session.reserved(), 0);
    }
}
