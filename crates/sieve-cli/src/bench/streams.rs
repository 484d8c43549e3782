//! `sieve streams`: throughput of concurrent TPC-H query streams
//! against storage nodes whose pushdown pools differ, and recovery from a
//! node killed in the middle of the run.
//!
//! ```text
//!   reference    the 22 queries once with NDP off (stock DataFusion over byte
//!                ranges): every stream's every answer must equal these
//!   pool P       for each pool size: fresh storage nodes (in this process,
//!                loopback), S streams at once, stream k running the 22
//!                queries from query 3k on; throughput, raw share of slices
//!   kill         the first pool size again, node 1 killed when half the
//!                phase's work is done; every answer must still be right
//!                (needs replicas); time from the kill to the first failure
//!                noticed, and per failed-over slice from its failure to the
//!                slice complete from a replica (a dead node is tried again
//!                every NODE_SUSPECT_MS, so failovers recur)
//! ```

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use datafusion::common::{exec_err, plan_err, Result};
use sieve_format::{Benchmark, SliceLayout};
use sieve_storage::ExecuteOptions;

use crate::cluster::{data_set_directory, generated_tpch, EmbeddedCluster};
use crate::compare::{rows_as_text, run};
use crate::queries::{is_ordered, TPCH_QUERIES};

/// What `sieve streams` runs.
#[derive(Debug, Clone)]
pub struct StreamsOptions {
    /// TPC-H scale factor.
    pub scale_factor: f64,
    /// Storage nodes.
    pub nodes: usize,
    /// Copies of each slice.
    pub replicas: usize,
    /// Concurrent query streams.
    pub streams: usize,
    /// Pushdown pool sizes to compare (workers per node).
    pub pools: Vec<usize>,
    /// Kill a node halfway through one more phase (needs replicas > 1).
    pub kill: bool,
    /// Data directory.
    pub data_directory: PathBuf,
    /// Session settings for every stream.
    pub settings: Vec<String>,
}

/// One phase's figures.
#[derive(Debug, Clone)]
pub struct PhaseReport {
    /// What ran.
    pub name: String,
    /// Pushdown workers per node.
    pub workers: usize,
    /// Queries completed.
    pub queries: usize,
    /// Wall time of the phase.
    pub elapsed: Duration,
    /// Slices the nodes were asked to process (not those asked for as
    /// stored).
    pub slices: u64,
    /// Of those, served raw for want of a worker.
    pub slices_raw: u64,
    /// Kill phase: time from the kill to the first failure noticed.
    pub detection: Option<Duration>,
    /// Kill phase: per failed-over slice request, the time from noticing the
    /// failure to the slice complete from another replica: median and max.
    pub failover_median: Option<Duration>,
    /// See `failover_median`.
    pub failover_max: Option<Duration>,
    /// Kill phase: slice requests that failed over.
    pub failovers: usize,
}

impl PhaseReport {
    /// Queries per hour.
    pub fn per_hour(&self) -> f64 {
        self.queries as f64 * 3600.0 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Share of slices served raw.
    pub fn raw_share(&self) -> f64 {
        self.slices_raw as f64 / (self.slices as f64).max(1.0)
    }
}

/// Run the phases and return their figures.
pub async fn run_streams(options: &StreamsOptions) -> Result<Vec<PhaseReport>> {
    if options.streams == 0 || options.pools.is_empty() {
        return plan_err!("need at least one stream and one pool size");
    }
    if options.kill && (options.replicas < 2 || options.nodes < 2) {
        return plan_err!("--kill needs at least 2 nodes and 2 replicas");
    }
    let root = data_set_directory(
        &options.data_directory,
        Benchmark::Tpch,
        options.scale_factor,
        options.replicas,
    );
    if !sieve_format::is_generated(&root, Benchmark::Tpch, options.nodes, options.replicas) {
        eprintln!(
            "generating TPC-H SF {} ({} copies of each slice) into {} ...",
            options.scale_factor,
            options.replicas,
            root.display()
        );
    }
    generated_tpch(
        &root,
        options.scale_factor,
        options.nodes,
        options.replicas,
        &SliceLayout::default(),
    )?;

    // The reference: every query once, NDP off.
    let cluster = EmbeddedCluster::start(&root, options.nodes).await?;
    let session = cluster.session().await?;
    session.apply_settings(&options.settings)?;
    session.set_ndp(false)?;
    let mut expected = Vec::new();
    for (_, sql) in TPCH_QUERIES {
        expected.push(rows_as_text(
            &run(&session.context, sql).await?,
            !is_ordered(sql),
        )?);
    }
    drop(session);
    drop(cluster);
    let expected = Arc::new(expected);

    let mut reports = Vec::new();
    for &workers in &options.pools {
        let name = format!("pool {workers}");
        eprintln!("{name}: {} streams ...", options.streams);
        reports.push(phase(options, &root, workers, &expected, name, false).await?);
    }
    if options.kill {
        let workers = options.pools[0];
        let name = format!("pool {workers}, node 1 killed halfway");
        eprintln!("{name}: {} streams ...", options.streams);
        reports.push(phase(options, &root, workers, &expected, name, true).await?);
    }
    Ok(reports)
}

async fn phase(
    options: &StreamsOptions,
    root: &std::path::Path,
    workers: usize,
    expected: &Arc<Vec<Vec<String>>>,
    name: String,
    kill: bool,
) -> Result<PhaseReport> {
    let cluster = EmbeddedCluster::start_with(
        root,
        options.nodes,
        ExecuteOptions {
            pushdown_workers: workers,
            ..ExecuteOptions::default()
        },
    )
    .await?;
    let session = cluster.session().await?;
    session.apply_settings(&options.settings)?;
    session.set_ndp(true)?;
    let total = options.streams * TPCH_QUERIES.len();
    let done = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut streams = Vec::new();
    for stream in 0..options.streams {
        // Each stream its own session (its own settings, its own plans),
        // over the same catalog and connections.
        let context =
            datafusion::prelude::SessionContext::new_with_state(session.context.state().clone());
        let (expected, done) = (Arc::clone(expected), Arc::clone(&done));
        streams.push(tokio::spawn(async move {
            for step in 0..TPCH_QUERIES.len() {
                let index = (step + stream * 3) % TPCH_QUERIES.len();
                let (query, sql) = TPCH_QUERIES[index];
                let batches = run(&context, sql).await.map_err(|error| {
                    datafusion::common::DataFusionError::Execution(format!(
                        "{query} in stream {stream}: {error}"
                    ))
                })?;
                if rows_as_text(&batches, !is_ordered(sql))? != expected[index] {
                    return exec_err!("{query} in stream {stream} differs from NDP off");
                }
                done.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<(), datafusion::common::DataFusionError>(())
        }));
    }
    let mut killed_at = None;
    if kill {
        while done.load(Ordering::Relaxed) * 2 < total {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        cluster.nodes[1].faults().kill();
        killed_at = Some(Instant::now());
    }
    for stream in streams {
        stream
            .await
            .map_err(|error| datafusion::common::DataFusionError::External(Box::new(error)))??;
    }
    let elapsed = started.elapsed();
    let (mut slices, mut slices_raw) = (0, 0);
    for node in &cluster.nodes {
        let counters = node.executor().counters().to_json();
        // Slices asked for as stored (nothing to push) never wait for a
        // worker: only the slices the nodes were asked to process count.
        slices += counters["slices_served"]
            .as_u64()
            .unwrap_or(0)
            .saturating_sub(counters["slices_as_stored"].as_u64().unwrap_or(0));
        slices_raw += counters["slices_raw"].as_u64().unwrap_or(0);
    }
    let recoveries = session
        .catalog
        .recoveries
        .lock()
        .expect("never poisoned")
        .clone();
    let detection = killed_at.and_then(|killed| {
        recoveries
            .iter()
            .map(|recovery| recovery.detected.saturating_duration_since(killed))
            .min()
    });
    let mut failover_times: Vec<Duration> = recoveries
        .iter()
        .map(|recovery| {
            recovery
                .recovered
                .saturating_duration_since(recovery.detected)
        })
        .collect();
    failover_times.sort();
    let failover_median = failover_times.get(failover_times.len() / 2).copied();
    let failover_max = failover_times.last().copied();
    drop(session);
    drop(cluster);
    Ok(PhaseReport {
        name,
        workers,
        queries: total,
        elapsed,
        slices,
        slices_raw,
        detection,
        failover_median,
        failover_max,
        failovers: recoveries.len(),
    })
}

/// The phases as a Markdown table.
pub fn format_streams(options: &StreamsOptions, reports: &[PhaseReport]) -> String {
    let mut text = format!(
        "TPC-H SF {}, {} streams x 22 queries, NDP on, {} storage nodes in this process (loopback), {} cop{} of each slice\n\n",
        options.scale_factor,
        options.streams,
        options.nodes,
        options.replicas,
        if options.replicas == 1 { "y" } else { "ies" }
    );
    text.push_str("| phase | workers/node | wall s | queries/h | vs first | slices | raw | raw share | kill -> first failure noticed ms | failovers | failure -> slice from replica ms, median / max |\n");
    text.push_str("|---|---|---|---|---|---|---|---|---|---|---|\n");
    let first = reports.first().map(PhaseReport::per_hour).unwrap_or(1.0);
    let ms = |duration: Option<Duration>| {
        duration
            .map(|duration| format!("{:.0}", duration.as_secs_f64() * 1000.0))
            .unwrap_or_else(|| "-".to_string())
    };
    for report in reports {
        text.push_str(&format!(
            "| {} | {} | {:.2} | {:.0} | {:.2}x | {} | {} | {:.1}% | {} | {} | {} / {} |\n",
            report.name,
            report.workers,
            report.elapsed.as_secs_f64(),
            report.per_hour(),
            report.per_hour() / first,
            report.slices,
            report.slices_raw,
            report.raw_share() * 100.0,
            ms(report.detection),
            report.failovers,
            ms(report.failover_median),
            ms(report.failover_max)
        ));
    }
    text
}
