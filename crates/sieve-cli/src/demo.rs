//! The embedded default: TPC-H on a local cluster, NDP on and off side by side.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use datafusion::common::{exec_err, plan_err, Result};
use datafusion::prelude::SessionConfig;
use sieve_compute::{connect_session_with_tables, SieveSession};

use crate::secret::load_secret;
use sieve_format::{is_generated, Benchmark, SliceLayout};

use crate::cluster::EmbeddedCluster;
use crate::compare::{rows_as_text, run};
use crate::queries::{is_ordered, TPCH_QUERIES};

/// What the demo runs.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// TPC-H scale factor.
    pub scale_factor: f64,
    /// Storage nodes in the embedded cluster.
    pub nodes: usize,
    /// Copies of each slice, on as many nodes (the demo uses 2).
    pub replicas: usize,
    /// Timed runs per query and mode (the median is reported).
    pub runs: usize,
    /// Where generated data lives (`DIR/tpch-sfX`).
    pub data_directory: PathBuf,
    /// Queries to run (`q1`..`q22`); empty means all.
    pub queries: Vec<String>,
    /// Flight URLs of running storage nodes; empty starts the embedded cluster.
    pub cluster: Vec<String>,
    /// Session settings (`key=value`) applied before the queries, in both modes.
    pub settings: Vec<String>,
    /// With `cluster`: the table catalog of the data set those nodes serve.
    pub catalog: Option<PathBuf>,
}

/// One query's measurements.
#[derive(Debug, Clone)]
pub struct QueryReport {
    /// Query name.
    pub name: String,
    /// Rows returned.
    pub rows: usize,
    /// Median wall time with NDP on.
    pub time_on: Duration,
    /// Median wall time with NDP off.
    pub time_off: Duration,
    /// Median CPU time of this process with NDP on: the compute node's alone
    /// when the storage nodes run elsewhere (`--cluster`).
    pub cpu_on: Duration,
    /// Median CPU time of this process with NDP off.
    pub cpu_off: Duration,
    /// Bytes shipped storage-to-compute with NDP on (one run).
    pub bytes_on: u64,
    /// Bytes shipped with NDP off (one run).
    pub bytes_off: u64,
}

/// Generate the data set if missing and return its directory.
pub fn ensure_data(options: &DemoOptions) -> Result<PathBuf> {
    let root = crate::cluster::data_set_directory(
        &options.data_directory,
        Benchmark::Tpch,
        options.scale_factor,
        options.replicas,
    );
    // A data set of the same scale factor without replicas (`sieve gen`'s,
    // the bench's) is used rather than generating the replicated one next
    // to it: at SF 100 that is 60 GB more, and filled a disk once.
    let single = crate::cluster::data_set_directory(
        &options.data_directory,
        Benchmark::Tpch,
        options.scale_factor,
        1,
    );
    if options.replicas > 1
        && !is_generated(&root, Benchmark::Tpch, options.nodes, options.replicas)
        && is_generated(&single, Benchmark::Tpch, options.nodes, 1)
    {
        eprintln!(
            "using TPC-H SF {} in {} (one copy of each slice: a node lost is not covered by a replica)",
            options.scale_factor,
            single.display()
        );
        return Ok(single);
    }
    if !is_generated(&root, Benchmark::Tpch, options.nodes, options.replicas) {
        eprintln!(
            "generating TPC-H SF {} into {} ...",
            options.scale_factor,
            root.display()
        );
        let started = Instant::now();
        crate::cluster::generated_tpch(
            &root,
            options.scale_factor,
            options.nodes,
            options.replicas,
            &SliceLayout::default(),
        )?;
        eprintln!("generated in {:.1}s", started.elapsed().as_secs_f64());
    }
    Ok(root)
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// CPU time (user + system) of this process so far.
fn process_cpu() -> Duration {
    Duration::from_secs_f64(crate::bench::nodes::own_cpu_seconds())
}

struct Timed {
    wall: Duration,
    cpu: Duration,
    shipped: u64,
    batches: Vec<arrow::record_batch::RecordBatch>,
}

async fn timed(session: &SieveSession, sql: &str) -> Result<Timed> {
    let before = session.traffic.snapshot();
    let cpu_before = process_cpu();
    let started = Instant::now();
    let batches = run(&session.context, sql).await?;
    let wall = started.elapsed();
    let cpu = process_cpu().saturating_sub(cpu_before);
    let shipped = session.traffic.snapshot().since(&before).bytes_shipped();
    Ok(Timed {
        wall,
        cpu,
        shipped,
        batches,
    })
}

/// Run the demo and return one report per query. Fails if NDP on and off
/// ever disagree on a result.
pub async fn run_demo(options: &DemoOptions) -> Result<Vec<QueryReport>> {
    let (_cluster, session) = if options.cluster.is_empty() {
        let root = ensure_data(options)?;
        let cluster = EmbeddedCluster::start(&root, options.nodes).await?;
        let session = cluster.session().await?;
        (Some(cluster), session)
    } else {
        let Some(catalog) = &options.catalog else {
            return plan_err!(
                "--cluster needs --catalog: the catalog.sqlite of the data set the nodes serve (sieve gen writes one)"
            );
        };
        if !catalog.is_file() {
            return plan_err!("there is no table catalog at {}", catalog.display());
        }
        let secret = load_secret(None)?;
        let session = connect_session_with_tables(
            &options.cluster,
            secret.as_ref(),
            SessionConfig::new(),
            Some(catalog),
        )
        .await?;
        (None, session)
    };
    session.apply_settings(&options.settings)?;
    let mut reports = Vec::new();
    for (name, sql) in TPCH_QUERIES {
        if !options.queries.is_empty() && !options.queries.iter().any(|wanted| wanted == name) {
            continue;
        }
        let (mut times_on, mut times_off) = (Vec::new(), Vec::new());
        let (mut cpus_on, mut cpus_off) = (Vec::new(), Vec::new());
        let (mut bytes_on, mut bytes_off, mut rows) = (0, 0, 0);
        // With several runs, one untimed warm-up per mode first (metadata
        // caches, connections), so the median describes a warm system.
        let warmups = usize::from(options.runs > 1);
        for run_index in 0..options.runs.max(1) + warmups {
            session.set_ndp(true)?;
            let on = timed(&session, sql).await?;
            session.set_ndp(false)?;
            let off = timed(&session, sql).await?;
            let ordered = is_ordered(sql);
            if rows_as_text(&on.batches, !ordered)? != rows_as_text(&off.batches, !ordered)? {
                return exec_err!("{name}: NDP on and NDP off returned different results");
            }
            rows = on.batches.iter().map(|batch| batch.num_rows()).sum();
            if run_index < warmups {
                continue;
            }
            times_on.push(on.wall);
            times_off.push(off.wall);
            cpus_on.push(on.cpu);
            cpus_off.push(off.cpu);
            bytes_on = on.shipped;
            bytes_off = off.shipped;
        }
        let report = QueryReport {
            name: name.to_string(),
            rows,
            time_on: median(times_on),
            time_off: median(times_off),
            cpu_on: median(cpus_on),
            cpu_off: median(cpus_off),
            bytes_on,
            bytes_off,
        };
        eprintln!("{}", format_row(&report));
        reports.push(report);
    }
    session.set_ndp(true)?;
    Ok(reports)
}

fn megabytes(bytes: u64) -> f64 {
    bytes as f64 / 1_000_000.0
}

/// Header of the per-query table.
pub fn format_header() -> String {
    format!(
        "| {:<5} | {:>6} | {:>9} | {:>9} | {:>7} | {:>11} | {:>11} | {:>8} | {:>9} | {:>9} | {:>7} |\n|{}|",
        "query",
        "rows",
        "on ms",
        "off ms",
        "off/on",
        "shipped on",
        "shipped off",
        "on/off",
        "cpu on ms",
        "cpu off ms",
        "on/off",
        "-------|--------|-----------|-----------|---------|-------------|-------------|----------|-----------|-----------|---------"
    )
}

/// One row of the per-query table.
pub fn format_row(report: &QueryReport) -> String {
    format!(
        "| {:<5} | {:>6} | {:>9.1} | {:>9.1} | {:>6.2}x | {:>8.2} MB | {:>8.2} MB | {:>7.1}% | {:>9.1} | {:>9.1} | {:>6.1}% |",
        report.name,
        report.rows,
        report.time_on.as_secs_f64() * 1e3,
        report.time_off.as_secs_f64() * 1e3,
        report.time_off.as_secs_f64() / report.time_on.as_secs_f64().max(1e-9),
        megabytes(report.bytes_on),
        megabytes(report.bytes_off),
        100.0 * report.bytes_on as f64 / (report.bytes_off.max(1)) as f64,
        report.cpu_on.as_secs_f64() * 1e3,
        report.cpu_off.as_secs_f64() * 1e3,
        100.0 * report.cpu_on.as_secs_f64() / report.cpu_off.as_secs_f64().max(1e-9),
    )
}

/// The whole table with a total row.
pub fn format_table(reports: &[QueryReport]) -> String {
    let mut out = format_header();
    for report in reports {
        out.push('\n');
        out.push_str(&format_row(report));
    }
    let total = QueryReport {
        name: "total".into(),
        rows: reports.iter().map(|report| report.rows).sum(),
        time_on: reports.iter().map(|report| report.time_on).sum(),
        time_off: reports.iter().map(|report| report.time_off).sum(),
        cpu_on: reports.iter().map(|report| report.cpu_on).sum(),
        cpu_off: reports.iter().map(|report| report.cpu_off).sum(),
        bytes_on: reports.iter().map(|report| report.bytes_on).sum(),
        bytes_off: reports.iter().map(|report| report.bytes_off).sum(),
    };
    out.push('\n');
    out.push_str(&format_row(&total));
    out
}
