//! What a benchmark run measured: raw samples, per-mode summaries, the
//! energy model, the Markdown table and the JSON file.

use serde::Serialize;

use super::results::Checksum;

/// The energy model of MISSION.md: CPU-seconds, bytes read, bytes moved.
/// Figures are per unit, so the model is a sum of three products.
#[derive(Debug, Clone, Serialize)]
pub struct EnergyModel {
    /// Joules per CPU-second on any node: one busy server core with its
    /// share of memory and uncore power (assumed: 10 W).
    pub joules_per_cpu_second: f64,
    /// Joules per byte read from storage: 3.3 uJ per KB, the sequential
    /// 32 KB read of the thesis' storage energy table (chapter 4, Table 4.4).
    pub joules_per_byte_read: f64,
    /// Joules per byte across the storage-compute link: NIC and switch port
    /// at about 1.25 nJ per bit (assumed: 10 nJ per byte).
    pub joules_per_byte_moved: f64,
}

impl Default for EnergyModel {
    fn default() -> Self {
        Self {
            joules_per_cpu_second: 10.0,
            joules_per_byte_read: 3.3e-6 / 1024.0,
            joules_per_byte_moved: 10e-9,
        }
    }
}

impl EnergyModel {
    /// Joules of one query run.
    pub fn joules(&self, cpu_seconds: f64, bytes_read: f64, bytes_moved: f64) -> f64 {
        self.joules_per_cpu_second * cpu_seconds
            + self.joules_per_byte_read * bytes_read
            + self.joules_per_byte_moved * bytes_moved
    }
}

/// One timed (or warm-up) run of one query in one mode.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// Untimed warm-up run (not in the medians).
    pub warmup: bool,
    /// Wall time of the query, milliseconds.
    pub wall_ms: f64,
    /// CPU seconds of the compute process (this one, or DuckDB's).
    pub compute_cpu_seconds: f64,
    /// CPU seconds of all storage processes.
    pub storage_cpu_seconds: f64,
    /// Bytes storage-to-compute on the link's interfaces (`None` on loopback).
    pub link_bytes_to_compute: Option<u64>,
    /// Bytes compute-to-storage on the link's interfaces.
    pub link_bytes_to_storage: Option<u64>,
    /// Sieve's own count of bytes shipped (Flight messages or byte ranges).
    pub reported_bytes: Option<u64>,
    /// Sieve's own count of bytes sent to the storage nodes (slice requests,
    /// join filters; byte-range requests).
    pub reported_bytes_to_storage: Option<u64>,
    /// Of those, the join filters registered on the storage nodes.
    pub join_filter_bytes: Option<u64>,
    /// Bytes the storage nodes read from slice files (their `stats`).
    pub storage_bytes_read: u64,
    /// Peak resident memory of the compute process during the query.
    pub compute_peak_rss_bytes: Option<u64>,
    /// Peak resident memory of the largest storage process during the query.
    pub storage_peak_rss_bytes: Option<u64>,
}

impl Sample {
    /// Bytes that crossed the link both ways, or Sieve's own count of both
    /// ways on loopback.
    pub fn bytes_moved(&self) -> Option<u64> {
        match (self.link_bytes_to_compute, self.link_bytes_to_storage) {
            (Some(to_compute), Some(to_storage)) => Some(to_compute + to_storage),
            _ => self
                .reported_bytes
                .map(|shipped| shipped + self.reported_bytes_to_storage.unwrap_or(0)),
        }
    }
}

/// One mode's results for one query.
#[derive(Debug, Clone, Serialize)]
pub struct ModeReport {
    /// `ndp`, `off` or `duckdb`.
    pub mode: String,
    /// The result's summary (all modes agree, or the run failed).
    pub checksum: Checksum,
    /// Median wall time of the timed runs, ms.
    pub wall_ms_median: f64,
    /// Fastest timed run, ms.
    pub wall_ms_min: f64,
    /// Slowest timed run, ms.
    pub wall_ms_max: f64,
    /// Median bytes moved (link counters both ways; Sieve's count on loopback;
    /// `None` for DuckDB on loopback).
    pub bytes_moved: Option<f64>,
    /// Median of Sieve's own count of bytes shipped.
    pub reported_bytes: Option<f64>,
    /// Median of Sieve's own count of bytes sent to the storage nodes.
    pub reported_bytes_to_storage: Option<f64>,
    /// Median bytes of join filters registered on the storage nodes.
    pub join_filter_bytes: Option<f64>,
    /// Median link bytes storage-to-compute.
    pub link_bytes_to_compute: Option<f64>,
    /// Median compute CPU seconds.
    pub compute_cpu_seconds: f64,
    /// Median storage CPU seconds.
    pub storage_cpu_seconds: f64,
    /// Median bytes read by the storage nodes.
    pub storage_bytes_read: f64,
    /// Highest peak resident memory of the compute process over the runs.
    pub compute_peak_rss_bytes: Option<u64>,
    /// Highest peak resident memory of a storage process over the runs.
    pub storage_peak_rss_bytes: Option<u64>,
    /// Energy of the median figures under the model, joules.
    pub energy_joules: f64,
    /// Every run.
    pub samples: Vec<Sample>,
}

fn median(mut values: Vec<f64>) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

impl ModeReport {
    /// Summarise the samples of one mode.
    pub fn new(mode: &str, checksum: Checksum, samples: Vec<Sample>, model: &EnergyModel) -> Self {
        let timed: Vec<&Sample> = samples.iter().filter(|sample| !sample.warmup).collect();
        let of = |field: &dyn Fn(&Sample) -> f64| median(timed.iter().map(|s| field(s)).collect());
        let optional = |field: &dyn Fn(&Sample) -> Option<u64>| {
            let values: Option<Vec<f64>> =
                timed.iter().map(|s| field(s).map(|v| v as f64)).collect();
            values.filter(|values| !values.is_empty()).map(median)
        };
        let walls: Vec<f64> = timed.iter().map(|sample| sample.wall_ms).collect();
        let compute_cpu_seconds = of(&|s| s.compute_cpu_seconds);
        let storage_cpu_seconds = of(&|s| s.storage_cpu_seconds);
        let storage_bytes_read = of(&|s| s.storage_bytes_read as f64);
        let bytes_moved = optional(&|s| s.bytes_moved());
        Self {
            mode: mode.to_string(),
            checksum,
            wall_ms_median: median(walls.clone()),
            wall_ms_min: walls.iter().copied().fold(f64::INFINITY, f64::min),
            wall_ms_max: walls.iter().copied().fold(0.0, f64::max),
            bytes_moved,
            reported_bytes: optional(&|s| s.reported_bytes),
            reported_bytes_to_storage: optional(&|s| s.reported_bytes_to_storage),
            join_filter_bytes: optional(&|s| s.join_filter_bytes),
            link_bytes_to_compute: optional(&|s| s.link_bytes_to_compute),
            compute_cpu_seconds,
            storage_cpu_seconds,
            storage_bytes_read,
            compute_peak_rss_bytes: samples
                .iter()
                .filter_map(|s| s.compute_peak_rss_bytes)
                .max(),
            storage_peak_rss_bytes: samples
                .iter()
                .filter_map(|s| s.storage_peak_rss_bytes)
                .max(),
            energy_joules: model.joules(
                compute_cpu_seconds + storage_cpu_seconds,
                storage_bytes_read,
                bytes_moved.unwrap_or(0.0),
            ),
            samples,
        }
    }
}

/// One query across the modes.
#[derive(Debug, Clone, Serialize)]
pub struct QueryReport {
    /// `q1` .. `q22`.
    pub name: String,
    /// One entry per mode, in the order of `--modes`.
    pub modes: Vec<ModeReport>,
}

/// The link the run used.
#[derive(Debug, Clone, Serialize)]
pub struct LinkReport {
    /// Whether namespaces, veths and tc shaped the traffic.
    pub emulated: bool,
    /// Rate in tc syntax, if emulated.
    pub rate: Option<String>,
    /// One-way delay per direction, ms.
    pub delay_ms: f64,
    /// Why the link is not emulated, if it is not.
    pub note: Option<String>,
}

/// Everything one `sieve bench` run measured.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// `tpch`.
    pub benchmark: String,
    /// Scale factor.
    pub scale_factor: f64,
    /// Storage nodes (processes).
    pub nodes: usize,
    /// The link.
    pub link: LinkReport,
    /// Timed runs per query and mode.
    pub runs: usize,
    /// Untimed warm-up runs before them.
    pub warmups: usize,
    /// Modes in the order they ran in each round.
    pub modes: Vec<String>,
    /// Session settings given with --set.
    pub settings: Vec<String>,
    /// Storage node arguments given with --storage-arg.
    pub storage_args: Vec<String>,
    /// The energy model's constants.
    pub energy_model: EnergyModel,
    /// Per query.
    pub queries: Vec<QueryReport>,
    /// Queries left out of `queries` and the totals because a mode failed
    /// on them (the query, the mode and the error's first line).
    pub failed: Vec<FailedQuery>,
    /// Total wall time of the benchmark, seconds (setup included).
    pub elapsed_seconds: f64,
}

/// A query a mode could not run: left out of the table and the totals.
#[derive(Debug, Clone, Serialize)]
pub struct FailedQuery {
    /// `q18`.
    pub query: String,
    /// The mode that failed.
    pub mode: String,
    /// The error.
    pub error: String,
    /// The other modes' median times on the query, ms (those that ran it).
    pub others_wall_ms: Vec<(String, f64)>,
}

/// Totals of one mode over all queries (sums of medians).
#[derive(Debug, Clone, Copy, Default)]
pub struct Totals {
    /// ms.
    pub wall_ms: f64,
    /// Bytes moved (`None` if any query has no figure).
    pub bytes_moved: Option<f64>,
    /// Sieve's own count.
    pub reported_bytes: Option<f64>,
    /// Sieve's own count, compute to storage.
    pub reported_bytes_to_storage: Option<f64>,
    /// Join filters registered on the storage nodes.
    pub join_filter_bytes: Option<f64>,
    /// Link bytes storage-to-compute.
    pub link_bytes_to_compute: Option<f64>,
    /// CPU seconds, compute.
    pub compute_cpu_seconds: f64,
    /// CPU seconds, storage.
    pub storage_cpu_seconds: f64,
    /// Joules.
    pub energy_joules: f64,
    /// Highest peak resident memory of the compute process, any query.
    pub compute_peak_rss_bytes: Option<u64>,
    /// Highest peak resident memory of a storage process, any query.
    pub storage_peak_rss_bytes: Option<u64>,
}

impl BenchReport {
    /// Totals per mode, in mode order.
    pub fn totals(&self) -> Vec<Totals> {
        (0..self.modes.len())
            .map(|mode| {
                let reports = self.queries.iter().map(|query| &query.modes[mode]);
                let sum_optional = |field: &dyn Fn(&ModeReport) -> Option<f64>| {
                    reports.clone().map(field).sum::<Option<f64>>()
                };
                Totals {
                    wall_ms: reports.clone().map(|r| r.wall_ms_median).sum(),
                    bytes_moved: sum_optional(&|r| r.bytes_moved),
                    reported_bytes: sum_optional(&|r| r.reported_bytes),
                    reported_bytes_to_storage: sum_optional(&|r| r.reported_bytes_to_storage),
                    join_filter_bytes: sum_optional(&|r| r.join_filter_bytes),
                    link_bytes_to_compute: sum_optional(&|r| r.link_bytes_to_compute),
                    compute_cpu_seconds: reports.clone().map(|r| r.compute_cpu_seconds).sum(),
                    storage_cpu_seconds: reports.clone().map(|r| r.storage_cpu_seconds).sum(),
                    energy_joules: reports.clone().map(|r| r.energy_joules).sum(),
                    compute_peak_rss_bytes: reports
                        .clone()
                        .filter_map(|r| r.compute_peak_rss_bytes)
                        .max(),
                    storage_peak_rss_bytes: reports
                        .clone()
                        .filter_map(|r| r.storage_peak_rss_bytes)
                        .max(),
                }
            })
            .collect()
    }

    /// The Markdown report: a header, the per-query table and the totals.
    pub fn markdown(&self) -> String {
        let modes = &self.modes;
        let mut out = String::new();
        let link = match (&self.link.rate, self.link.emulated) {
            (Some(rate), true) if self.link.delay_ms > 0.0 => {
                format!(
                    "an emulated {rate} link with {} ms one-way delay",
                    self.link.delay_ms
                )
            }
            (Some(rate), true) => {
                format!("an emulated {rate} link (tc tbf, veth, one namespace per node)")
            }
            _ => format!(
                "plain loopback ({})",
                self.link
                    .note
                    .as_deref()
                    .unwrap_or("no link emulation asked for")
            ),
        };
        out.push_str(&format!(
            "{} SF {}, {} storage nodes on {link}; median of {} run(s) after {} warm-up; bytes = {}\n\n",
            if self.benchmark == "tpch" { "TPC-H".to_string() } else { self.benchmark.to_uppercase() },
            self.scale_factor,
            self.nodes,
            self.runs,
            self.warmups,
            if self.link.emulated {
                "both directions on the link's interfaces"
            } else {
                "Sieve's own count (none for DuckDB on loopback)"
            },
        ));
        if !self.settings.is_empty() || !self.storage_args.is_empty() {
            out.push_str(&format!(
                "Settings: {}; storage node arguments: {}\n\n",
                if self.settings.is_empty() {
                    "defaults".to_string()
                } else {
                    self.settings.join(", ")
                },
                if self.storage_args.is_empty() {
                    "defaults".to_string()
                } else {
                    self.storage_args.join(" ")
                },
            ));
        }
        let mut header = vec!["query".to_string()];
        header.extend(modes.iter().map(|mode| format!("{mode} ms")));
        header.extend(
            modes
                .iter()
                .skip(1)
                .map(|mode| format!("{mode}/{}", modes[0])),
        );
        header.extend(modes.iter().map(|mode| format!("{mode} MB")));
        header.extend(modes.iter().map(|mode| format!("{mode} J")));
        header.extend(modes.iter().map(|mode| format!("{mode} peak MB")));
        header.extend(modes.iter().map(|mode| format!("{mode} node peak MB")));
        out.push_str(&format!("| {} |\n", header.join(" | ")));
        out.push_str(&format!(
            "|{}|\n",
            header.iter().map(|_| "---").collect::<Vec<_>>().join("|")
        ));
        let megabytes = |bytes: Option<f64>| match bytes {
            Some(bytes) => format!("{:.2}", bytes / 1e6),
            None => "-".into(),
        };
        // The compute process's and the largest storage node's peak resident
        // memory while the query ran (`VmHWM`, reset before each run): which
        // query sets the peak.
        let peaks = |peaks: Vec<Option<u64>>| -> Vec<Option<f64>> {
            peaks
                .into_iter()
                .map(|peak| peak.map(|b| b as f64))
                .collect()
        };
        let row = |name: &str,
                   walls: Vec<f64>,
                   bytes: Vec<Option<f64>>,
                   joules: Vec<f64>,
                   peak: Vec<Option<f64>>,
                   node_peak: Vec<Option<f64>>| {
            let mut cells = vec![name.to_string()];
            cells.extend(walls.iter().map(|wall| format!("{wall:.1}")));
            cells.extend(
                walls
                    .iter()
                    .skip(1)
                    .map(|wall| format!("{:.2}x", wall / walls[0].max(1e-9))),
            );
            cells.extend(bytes.iter().map(|bytes| megabytes(*bytes)));
            cells.extend(joules.iter().map(|joules| format!("{joules:.2}")));
            cells.extend(peak.iter().chain(&node_peak).map(|peak| match peak {
                Some(peak) => format!("{:.0}", peak / 1e6),
                None => "-".into(),
            }));
            format!("| {} |\n", cells.join(" | "))
        };
        for query in &self.queries {
            out.push_str(&row(
                &query.name,
                query.modes.iter().map(|m| m.wall_ms_median).collect(),
                query.modes.iter().map(|m| m.bytes_moved).collect(),
                query.modes.iter().map(|m| m.energy_joules).collect(),
                peaks(
                    query
                        .modes
                        .iter()
                        .map(|m| m.compute_peak_rss_bytes)
                        .collect(),
                ),
                peaks(
                    query
                        .modes
                        .iter()
                        .map(|m| m.storage_peak_rss_bytes)
                        .collect(),
                ),
            ));
        }
        for failed in &self.failed {
            let error = failed.error.lines().next().unwrap_or_default();
            let others: Vec<String> = failed
                .others_wall_ms
                .iter()
                .map(|(mode, ms)| format!("; {mode} {ms:.1} ms"))
                .collect();
            out.push_str(&format!(
                "| {} | failed with {}: {}{} |\n",
                failed.query,
                failed.mode,
                error.replace('|', "/"),
                others.concat()
            ));
        }
        if self.queries.is_empty() {
            // Totals over no query would read as zeros.
            out.push_str("\nNo query completed in every mode: no totals.\n");
            return out;
        }
        let totals = self.totals();
        out.push_str(&row(
            "total",
            totals.iter().map(|t| t.wall_ms).collect(),
            totals.iter().map(|t| t.bytes_moved).collect(),
            totals.iter().map(|t| t.energy_joules).collect(),
            peaks(totals.iter().map(|t| t.compute_peak_rss_bytes).collect()),
            peaks(totals.iter().map(|t| t.storage_peak_rss_bytes).collect()),
        ));
        out.push('\n');
        for (mode, total) in modes.iter().zip(&totals) {
            let mut line = format!(
                "- {mode}: {:.2} s, {} MB, compute CPU {:.2} s, storage CPU {:.2} s, {:.1} J",
                total.wall_ms / 1e3,
                megabytes(total.bytes_moved),
                total.compute_cpu_seconds,
                total.storage_cpu_seconds,
                total.energy_joules
            );
            if let Some(compute) = total.compute_peak_rss_bytes {
                line.push_str(&format!(
                    "; peak RSS: compute {:.0} MB, largest storage node {}",
                    compute as f64 / 1e6,
                    total
                        .storage_peak_rss_bytes
                        .map_or("-".to_string(), |bytes| format!(
                            "{:.0} MB",
                            bytes as f64 / 1e6
                        ))
                ));
            }
            if let (Some(shipped), Some(sent)) =
                (total.reported_bytes, total.reported_bytes_to_storage)
            {
                line.push_str(&format!(
                    "; Sieve's count: {:.2} MB to compute, {:.3} MB to storage (join filters {:.3} MB)",
                    shipped / 1e6,
                    sent / 1e6,
                    total.join_filter_bytes.unwrap_or(0.0) / 1e6
                ));
            }
            if let (Some(link), Some(reported)) =
                (total.link_bytes_to_compute, total.reported_bytes)
            {
                line.push_str(&format!(
                    "; storage-to-compute bytes on the interfaces {:.2} MB vs Sieve's own count {:.2} MB ({:+.1}%)",
                    link / 1e6,
                    reported / 1e6,
                    100.0 * (link - reported) / reported.max(1.0)
                ));
            }
            out.push_str(&line);
            out.push('\n');
        }
        if let Some(first) = totals.first() {
            for (mode, total) in modes.iter().zip(&totals).skip(1) {
                let bytes = match (total.bytes_moved, first.bytes_moved) {
                    (Some(this), Some(first)) => format!("{:.2}x", this / first.max(1.0)),
                    _ => "-".into(),
                };
                out.push_str(&format!(
                    "- {mode} / {}: time {:.2}x, bytes {bytes}, energy {:.2}x\n",
                    modes[0],
                    total.wall_ms / first.wall_ms.max(1e-9),
                    total.energy_joules / first.energy_joules.max(1e-9),
                ));
            }
        }
        out
    }
}
