//! `sieve bench tpch` and `sieve bench ssb`: Sieve with pushdown (`ndp`), Sieve without it
//! (`off`: stock DataFusion reading Parquet slices by byte range) and DuckDB
//! (httpfs over the same byte-range endpoint) side by side, over an emulated
//! network link between the compute side and each storage node.
//!
//! ```text
//!   this process (compute: Sieve session; DuckDB child)    root namespace
//!        |  sb<pid>h<k>   (tc tbf at the link rate; its counters = bytes moved)
//!        |  veth
//!        |  sb<pid>n<k>   (tc tbf)                          namespace sieve-b<pid>-<k>
//!   `sieve storage` node k (Flight + byte ranges on 10.x.k.2)
//! ```
//!
//! Per query, mode and run it measures wall time, bytes on the link's
//! interfaces, Sieve's own byte count, CPU seconds of the compute and storage
//! processes, bytes the storage nodes read, and the result; all modes must
//! agree on every result or the run fails. The report is a Markdown table,
//! a JSON file with every sample, and SVG/PNG charts.

pub mod chart;
pub mod clients;
pub mod duckdb;
pub mod link;
pub mod nodes;
pub mod report;
pub mod results;
pub mod streams;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use datafusion::common::{exec_err, plan_err, Result};
use datafusion::prelude::SessionConfig;
use indicatif::{ProgressBar, ProgressStyle};
use sieve_compute::{connect_session_with_tables, SieveSession, StorageClient};
use sieve_format::{node_directory, Benchmark, SliceLayout};

pub use link::LinkSpec;
pub use report::{BenchReport, EnergyModel, FailedQuery, ModeReport, QueryReport, Sample};

use crate::compare::{rows_as_text, run};
use crate::queries::{is_ordered, queries_of};
use link::{Cleanup, CleanupGuard, NodeLink, SharedCleanup};
use nodes::NodeProcess;
use report::LinkReport;
use results::Cell;

/// What is compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Sieve with pushdown.
    Ndp,
    /// Sieve with `sieve.ndp = off`.
    Off,
    /// DuckDB over httpfs.
    DuckDb,
}

impl Mode {
    /// Parse `ndp`, `off` or `duckdb`.
    pub fn parse(text: &str) -> Result<Self> {
        Ok(match text.trim().to_ascii_lowercase().as_str() {
            "ndp" | "on" => Self::Ndp,
            "off" => Self::Off,
            "duckdb" => Self::DuckDb,
            other => return plan_err!("unknown mode '{other}' (known: ndp, off, duckdb)"),
        })
    }

    /// The mode's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Ndp => "ndp",
            Self::Off => "off",
            Self::DuckDb => "duckdb",
        }
    }
}

/// What `sieve bench` runs.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// `tpch` or `ssb`.
    pub benchmark: String,
    /// Scale factor.
    pub scale_factor: f64,
    /// Storage nodes (one process, and one namespace, each).
    pub nodes: usize,
    /// The link between compute and each storage node.
    pub link: LinkSpec,
    /// Timed runs per query and mode.
    pub runs: usize,
    /// Untimed runs of each query and mode before its timed runs.
    pub warmups: usize,
    /// Queries (`q1`..`q22`, or SSB's `q1.1`..`q4.3`); empty means all.
    pub queries: Vec<String>,
    /// Modes, run in this order in every round.
    pub modes: Vec<Mode>,
    /// Where data (`tpch-sfX`, `ssb-sfX`) and DuckDB's environment are kept.
    pub data_directory: PathBuf,
    /// Where the report, charts and node logs go.
    pub out_directory: PathBuf,
    /// Session settings for the Sieve modes (`key=value`).
    pub settings: Vec<String>,
    /// Extra arguments for every storage node's `sieve storage`.
    pub storage_args: Vec<String>,
    /// The `sieve` binary to start storage nodes with.
    pub sieve_binary: PathBuf,
}

/// Run the benchmark; every namespace, qdisc and process it starts is gone
/// when this returns (or the process is interrupted).
pub async fn run_bench(options: &BenchOptions) -> Result<BenchReport> {
    let started = Instant::now();
    let Some(benchmark) = Benchmark::parse(&options.benchmark) else {
        return plan_err!(
            "unknown benchmark '{}' (known: tpch, ssb, clients)",
            options.benchmark
        );
    };
    let all_queries = queries_of(benchmark);
    if options.runs == 0 || options.nodes == 0 || options.modes.is_empty() {
        return plan_err!("--runs, --nodes and --modes must each be at least one");
    }
    for (index, mode) in options.modes.iter().enumerate() {
        if options.modes[..index].contains(mode) {
            return plan_err!("mode {} is listed twice", mode.name());
        }
    }
    for wanted in &options.queries {
        if !all_queries.iter().any(|(name, _)| name == wanted) {
            let names: Vec<&str> = all_queries.iter().map(|(name, _)| *name).collect();
            return plan_err!(
                "unknown {} query '{wanted}' (known: {})",
                benchmark.title(),
                names.join(", ")
            );
        }
    }
    let root = crate::cluster::data_set_directory(
        &options.data_directory,
        benchmark,
        options.scale_factor,
        1,
    );
    if !sieve_format::is_generated(&root, benchmark, options.nodes, 1) {
        eprintln!(
            "generating {} SF {} into {} ...",
            benchmark.title(),
            options.scale_factor,
            root.display()
        );
    }
    crate::cluster::generated(
        benchmark,
        &root,
        options.scale_factor,
        options.nodes,
        1,
        &SliceLayout::default(),
    )?;
    if !node_directory(&root, options.nodes - 1).is_dir()
        || node_directory(&root, options.nodes).is_dir()
    {
        return plan_err!(
            "{} was generated for another number of storage nodes than {}; use another --data",
            root.display(),
            options.nodes
        );
    }
    std::fs::create_dir_all(&options.out_directory)?;
    let python = if options.modes.contains(&Mode::DuckDb) {
        Some(duckdb::ensure_environment(
            &options
                .data_directory
                .join(format!("duckdb-{}-venv", duckdb::DUCKDB_VERSION)),
        )?)
    } else {
        None
    };

    let cleanup: SharedCleanup = Arc::new(Mutex::new(Cleanup::default()));
    let guard = CleanupGuard(Arc::clone(&cleanup));
    let signals = tokio::spawn(stop_on_signal(Arc::clone(&cleanup)));
    let (links, note) = match &options.link.rate {
        None => (None, Some("--link loopback".to_string())),
        Some(_) => match link::unavailable() {
            None => (
                Some(link::create(options.nodes, &options.link, &cleanup)?),
                None,
            ),
            Some(why) => {
                eprintln!("{why}: running on plain loopback, without a shaped link");
                (None, Some(why))
            }
        },
    };
    // A fresh secret per run, for the nodes, the session and DuckDB.
    let secret = crate::secret::random_secret()?;
    let processes = nodes::start(
        nodes::NodeCommand {
            sieve: &options.sieve_binary,
            extra_args: &options.storage_args,
        },
        &root,
        links.as_deref(),
        options.nodes,
        &options.out_directory.join("logs"),
        &cleanup,
        &secret,
    )?;
    let urls: Vec<String> = processes
        .iter()
        .map(|node| node.flight_url.clone())
        .collect();
    let session = connect_session_with_tables(
        &urls,
        Some(&secret),
        SessionConfig::new(),
        Some(&root.join(sieve_format::TABLE_CATALOG_FILE)),
    )
    .await?;
    session.apply_settings(&options.settings)?;
    let mut duck = match &python {
        Some(python) => {
            let tables: BTreeMap<String, Vec<String>> = session.slice_urls()?;
            Some(duckdb::DuckDb::start(
                python,
                &options.out_directory,
                &tables,
                &secret,
                &cleanup,
            )?)
        }
        None => None,
    };

    let queries: Vec<(&str, &str)> = all_queries
        .iter()
        .filter(|(name, _)| options.queries.is_empty() || options.queries.iter().any(|q| q == name))
        .copied()
        .collect();
    let warmups = options.warmups;
    let rounds = warmups + options.runs;
    let progress = ProgressBar::new((queries.len() * rounds * options.modes.len()) as u64);
    progress.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} [{elapsed_precise}] {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let model = EnergyModel::default();
    let mut context = Measure {
        session: &session,
        clients: &session.catalog.clients,
        links: links.as_deref(),
        processes: &processes,
        duck: duck.as_mut(),
    };
    let mut reports = Vec::with_capacity(queries.len());
    let mut failed = Vec::new();
    for (name, sql) in queries {
        let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); options.modes.len()];
        let mut answers: Vec<Option<Answer>> = vec![None; options.modes.len()];
        // A query a mode cannot run (the memory pool exhausted, say) is
        // recorded with the other modes' times and left out of the table
        // and the totals; the other modes and queries still run.
        let mut errors: Vec<Option<String>> = vec![None; options.modes.len()];
        for round in 0..rounds {
            for (index, &mode) in options.modes.iter().enumerate() {
                if errors[index].is_some() {
                    progress.inc(1);
                    continue;
                }
                progress.set_message(format!(
                    "{name} {} ({})",
                    mode.name(),
                    if round < warmups {
                        "warm-up".to_string()
                    } else {
                        format!("run {}", round - warmups + 1)
                    }
                ));
                let (sample, answer) = match context.measure(mode, sql, round < warmups).await {
                    Ok(measured) => measured,
                    Err(error) => {
                        let error = error.to_string();
                        say(
                            &progress,
                            format!("{name} {}: failed: {error}", mode.name()),
                        );
                        errors[index] = Some(error);
                        progress.inc(1);
                        continue;
                    }
                };
                samples[index].push(sample);
                if answers[index].is_none() {
                    check_agreement(name, options, &answers, index, &answer, mode)?;
                    answers[index] = Some(answer);
                }
                progress.inc(1);
            }
        }
        if errors.iter().any(Option::is_some) {
            let others: Vec<(String, f64)> = options
                .modes
                .iter()
                .zip(&samples)
                .zip(&errors)
                .filter(|(_, error)| error.is_none())
                .map(|((mode, samples), _)| {
                    let mut walls: Vec<f64> = samples
                        .iter()
                        .filter(|sample| !sample.warmup)
                        .map(|sample| sample.wall_ms)
                        .collect();
                    walls.sort_by(f64::total_cmp);
                    let median = walls.get(walls.len() / 2).copied().unwrap_or(f64::NAN);
                    (mode.name().to_string(), median)
                })
                .collect();
            for (mode, error) in options.modes.iter().zip(errors) {
                if let Some(error) = error {
                    failed.push(FailedQuery {
                        query: name.to_string(),
                        mode: mode.name().to_string(),
                        error,
                        others_wall_ms: others.clone(),
                    });
                }
            }
            continue;
        }
        let modes: Vec<ModeReport> = options
            .modes
            .iter()
            .zip(samples)
            .zip(&answers)
            .map(|((mode, samples), answer)| {
                let cells = answer
                    .as_ref()
                    .map(|a| a.cells.as_slice())
                    .unwrap_or_default();
                ModeReport::new(mode.name(), results::checksum(cells), samples, &model)
            })
            .collect();
        say(
            &progress,
            format!(
                "{name}: {}",
                modes
                    .iter()
                    .map(|m| format!("{} {:.1} ms", m.mode, m.wall_ms_median))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        );
        reports.push(QueryReport {
            name: name.to_string(),
            modes,
        });
    }
    progress.finish_and_clear();
    drop(duck);
    drop(session);
    drop(guard);
    signals.abort();

    let report = BenchReport {
        benchmark: options.benchmark.clone(),
        scale_factor: options.scale_factor,
        nodes: options.nodes,
        link: LinkReport {
            emulated: links.is_some(),
            rate: options.link.rate.clone(),
            delay_ms: options.link.delay_ms,
            note,
        },
        runs: options.runs,
        warmups,
        modes: options
            .modes
            .iter()
            .map(|mode| mode.name().to_string())
            .collect(),
        settings: options.settings.clone(),
        storage_args: options.storage_args.clone(),
        energy_model: model,
        queries: reports,
        failed,
        elapsed_seconds: started.elapsed().as_secs_f64(),
    };
    let json = serde_json::to_string_pretty(&report)
        .map_err(|error| datafusion::common::DataFusionError::External(Box::new(error)))?;
    std::fs::write(options.out_directory.join("results.json"), json)?;
    std::fs::write(options.out_directory.join("report.md"), report.markdown())?;
    chart::write_charts(&report, &options.out_directory)?;
    Ok(report)
}

/// One mode's answer to a query, kept from its first run for the agreement check.
#[derive(Debug, Clone)]
struct Answer {
    cells: Vec<Vec<Cell>>,
    /// Sieve's rows as exact text (NDP on and off must match exactly).
    text: Option<Vec<String>>,
}

fn check_agreement(
    name: &str,
    options: &BenchOptions,
    answers: &[Option<Answer>],
    index: usize,
    answer: &Answer,
    mode: Mode,
) -> Result<()> {
    for (other, earlier) in answers[..index].iter().enumerate() {
        let Some(earlier) = earlier else { continue };
        let other_mode = options.modes[other].name();
        if let (Some(a), Some(b)) = (&earlier.text, &answer.text) {
            if a != b {
                return exec_err!(
                    "{name}: {} and {other_mode} returned different results ({} rows against {})",
                    mode.name(),
                    b.len(),
                    a.len()
                );
            }
        }
        if let Some(difference) = results::disagreement(&earlier.cells, &answer.cells) {
            return exec_err!(
                "{name}: {other_mode} and {} returned different results: {difference}",
                mode.name()
            );
        }
    }
    Ok(())
}

struct Measure<'a> {
    session: &'a SieveSession,
    clients: &'a [StorageClient],
    links: Option<&'a [NodeLink]>,
    processes: &'a [NodeProcess],
    duck: Option<&'a mut duckdb::DuckDb>,
}

impl Measure<'_> {
    async fn storage_bytes_read(&self) -> Result<u64> {
        let mut total = 0;
        for client in self.clients {
            let stats = client.stats().await?;
            total += stats["fragment_bytes_read"].as_u64().unwrap_or(0)
                + stats["range_bytes_served"].as_u64().unwrap_or(0);
        }
        Ok(total)
    }

    fn link_counters(&self) -> Result<Option<link::Counters>> {
        let Some(links) = self.links else {
            return Ok(None);
        };
        let mut total = link::Counters::default();
        for node in links {
            let counters = node.counters()?;
            total.received += counters.received;
            total.sent += counters.sent;
        }
        Ok(Some(total))
    }

    fn storage_cpu(&self) -> Result<f64> {
        self.processes
            .iter()
            .map(|node| nodes::cpu_seconds(node.pid))
            .sum()
    }

    async fn measure(&mut self, mode: Mode, sql: &str, warmup: bool) -> Result<(Sample, Answer)> {
        let read_before = self.storage_bytes_read().await?;
        let compute_pid = match (&mode, &self.duck) {
            (Mode::DuckDb, Some(duck)) => duck.pid.to_string(),
            _ => "self".to_string(),
        };
        // The release the previous statement started when it ended
        // (`sieve.release_memory_idle_ms`, 0 by default) ends before this
        // one's peak is measured.
        sieve_compute::memory::release_settled(Duration::from_secs(10)).await;
        nodes::reset_peak_rss(&compute_pid);
        for node in self.processes {
            nodes::reset_peak_rss(&node.pid.to_string());
        }
        let link_before = self.link_counters()?;
        let storage_before = self.storage_cpu()?;
        let traffic_before = self.session.traffic.snapshot();
        let (wall_ms, compute_cpu_seconds, answer, reported) = match mode {
            Mode::Ndp | Mode::Off => {
                self.session.set_ndp(mode == Mode::Ndp)?;
                let cpu_before = nodes::own_cpu_seconds();
                let clock = Instant::now();
                let batches = run(&self.session.context, sql).await?;
                let wall = clock.elapsed();
                let cpu = nodes::own_cpu_seconds() - cpu_before;
                let traffic = self.session.traffic.snapshot().since(&traffic_before);
                let answer = Answer {
                    cells: results::from_batches(&batches)?,
                    text: Some(rows_as_text(&batches, !is_ordered(sql))?),
                };
                (wall.as_secs_f64() * 1e3, cpu, answer, Some(traffic))
            }
            Mode::DuckDb => {
                let Some(duck) = self.duck.as_mut() else {
                    return exec_err!("DuckDB is not running");
                };
                let cpu_before = nodes::cpu_seconds(duck.pid)?;
                let answer = tokio::task::block_in_place(|| duck.query(sql))?;
                let cpu = nodes::cpu_seconds(duck.pid)? - cpu_before;
                let answer_cells = Answer {
                    cells: results::from_json(&answer.rows),
                    text: None,
                };
                (answer.wall.as_secs_f64() * 1e3, cpu, answer_cells, None)
            }
        };
        let storage_cpu_seconds = self.storage_cpu()? - storage_before;
        let compute_peak_rss_bytes = nodes::peak_rss_bytes(&compute_pid);
        let storage_peak_rss_bytes = self
            .processes
            .iter()
            .filter_map(|node| nodes::peak_rss_bytes(&node.pid.to_string()))
            .max();
        let link_after = self.link_counters()?;
        let read_after = self.storage_bytes_read().await?;
        let (to_compute, to_storage) = match (link_before, link_after) {
            (Some(before), Some(after)) => (
                Some(after.received - before.received),
                Some(after.sent - before.sent),
            ),
            _ => (None, None),
        };
        Ok((
            Sample {
                warmup,
                wall_ms,
                compute_cpu_seconds,
                storage_cpu_seconds,
                link_bytes_to_compute: to_compute,
                link_bytes_to_storage: to_storage,
                reported_bytes: reported.map(|traffic| traffic.bytes_shipped()),
                reported_bytes_to_storage: reported.map(|traffic| traffic.bytes_sent),
                join_filter_bytes: reported.map(|traffic| traffic.join_filter_bytes),
                storage_bytes_read: read_after - read_before,
                compute_peak_rss_bytes,
                storage_peak_rss_bytes,
            },
            answer,
        ))
    }
}

/// On SIGINT, SIGTERM or SIGHUP: remove the namespaces, stop the storage
/// processes and DuckDB, and exit.
/// A line above the progress bar, or on stderr when the bar is hidden (not a
/// terminal), so that a log shows each query as it ends.
fn say(progress: &ProgressBar, line: String) {
    if progress.is_hidden() {
        eprintln!("{line}");
    } else {
        progress.println(line);
    }
}

async fn stop_on_signal(cleanup: SharedCleanup) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut interrupt), Ok(mut terminate), Ok(mut hangup)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
    ) else {
        return;
    };
    let code = tokio::select! {
        _ = interrupt.recv() => 130,
        _ = terminate.recv() => 143,
        _ = hangup.recv() => 129,
    };
    eprintln!(
        "\nstopping: removing the link's namespaces and stopping the storage nodes and DuckDB ..."
    );
    let problems = cleanup
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .run();
    for problem in problems {
        eprintln!("cleanup: {problem}");
    }
    std::process::exit(code);
}
