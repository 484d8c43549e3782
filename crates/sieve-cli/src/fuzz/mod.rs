//! A deterministic, differential SQL fuzzer: random tables and random
//! queries, each run through Sieve in several modes and compared with plain
//! DataFusion over the same Parquet files.
//!
//! In the spirit of SQLancer's differential oracles and DataFusion's own
//! `fuzz_cases`: the reference ([`crate::compare::reference_context_for`])
//! and Sieve share DataFusion's SQL semantics, so any difference in a result
//! is a bug in what Sieve adds: the pushed fragment, join filters, pushed
//! partial aggregation, raw slices, or the scan itself.
//!
//! # How a run goes
//!
//! For each schema `i` of a run with seed `S`, the schema seed is
//! `derive_seed(S, i)`, and it alone fixes the tables ([`FuzzSchema`]): two
//! to four tables of random types, NULL rates and join-key distributions,
//! written as slices with small row groups and pages over three node
//! directories, each slice on two nodes. Query `j` of that schema comes from
//! `derive_seed(schema seed, j)` ([`QueryGenerator`]). The same seed
//! therefore gives the same tables and queries on every machine, and one
//! schema or query can be rerun alone (`--schema I --query J`).
//!
//! Each query runs first in plain DataFusion. A query the reference cannot
//! plan is the generator's fault: it is counted and reported, not compared.
//! Otherwise it runs in every [`Mode`], and the results must agree:
//!
//! - rows are compared as text ([`crate::compare::rows_as_text`]), sorted
//!   unless the query's `ORDER BY` is a total order;
//! - float aggregates (sums, averages, variances over floats, averages of
//!   integers) are compared with a relative tolerance of
//!   [`FLOAT_RELATIVE_TOLERANCE`] (or an absolute one of
//!   [`FLOAT_ABSOLUTE_TOLERANCE`] near zero), because the order rows are
//!   summed in legitimately differs between plans; every other cell must be
//!   equal;
//! - an error in both engines is agreement (counted); an error in one only,
//!   or a query running longer than [`QUERY_TIMEOUT_MS`], is a mismatch.
//!
//! A mismatch carries everything needed to reproduce it: the seeds, the
//! tables' parameters, the query, the mode, and the first rows that differ.
//!
//! ```no_run
//! # async fn example() -> datafusion::common::Result<()> {
//! use sieve_cli::fuzz::{run_fuzz, FuzzOptions};
//! let report = run_fuzz(&FuzzOptions::new(1, 2, 20)).await?;
//! assert!(report.mismatches.is_empty(), "{}", report.summary());
//! # Ok(())
//! # }
//! ```

mod queries;
mod requests;
mod rng;
mod tables;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use arrow::record_batch::RecordBatch;
use datafusion::common::{plan_err, DataFusionError, Result};
use datafusion::prelude::SessionContext;
use sieve_compute::{connect_session_with_tables, SieveSession};

use crate::cluster::EmbeddedCluster;
use crate::compare::{reference_context_for, rows_as_text};

pub use queries::{FuzzQuery, QueryGenerator, QueryShape, JOIN_ROWS_MAX};
pub use requests::{
    request_failures_as_error, run_request_fuzz, Family, Finding, Outcome as RequestOutcome,
    RequestFuzzOptions, RequestFuzzReport, RequestTarget, BUILDER_STACK_BYTES, CHAIN_DEPTH_MAX,
    EMBEDDED_SCALE_FACTOR, FINDINGS_KEPT_MAX, HEALTH_EVERY_DEFAULT, RANDOM_BYTES_MAX,
    REPRODUCER_BYTES_MAX, REQUEST_TIMEOUT_MS_DEFAULT,
};
pub use rng::SeededRandom;
pub use tables::{
    ColumnSpec, FuzzSchema, FuzzTable, KeyDistribution, TableSpec, KEY_NAMES, NODES, TABLE_ROWS_MAX,
};

/// Relative tolerance for float aggregates: summing up to 3,000 values in
/// another order changes a double in about its last 12 bits at most, far
/// below one part in a billion.
pub const FLOAT_RELATIVE_TOLERANCE: f64 = 1e-9;

/// Absolute tolerance for float aggregates whose exact value is near zero,
/// where a sum of values up to 1,000 cancels and only the rounding error of
/// the partial sums (about 1e-8) is left.
pub const FLOAT_ABSOLUTE_TOLERANCE: f64 = 1e-6;

/// Longest a query may run in one engine, ms. Every generated query takes
/// milliseconds; one that takes a minute is stuck (a scan waiting for a join
/// filter that never comes, say), which is a mismatch, not a reason to hang.
pub const QUERY_TIMEOUT_MS: u64 = 60_000;

/// Characters of an error kept in the report's examples.
const ERROR_CHARACTERS_SHOWN: usize = 400;

/// Rows shown on each side of a mismatch, from the first difference on.
const DIFFERENCE_ROWS_SHOWN: usize = 5;

/// Planning failures (and execution errors) of the reference kept as
/// examples in the report.
const PLAN_FAILURE_EXAMPLES_MAX: usize = 10;

/// How Sieve runs a query; each mode is compared with plain DataFusion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mode {
    /// The default settings: pushdown, join filters, aggregation pushdown.
    Default,
    /// `SET sieve.join_filters = false`.
    NoJoinFilters,
    /// `SET sieve.aggregate_pushdown = false`.
    NoAggregatePushdown,
    /// Default settings against storage nodes without pushdown workers, so
    /// every slice is served raw and the compute node runs the fragment.
    Raw,
    /// `SET sieve.ndp = off`: stock DataFusion reading the slices by byte
    /// range.
    NdpOff,
    /// Default settings with every hash join partitioned and past a 2 KiB
    /// build budget, so its build and probe rows go to disk by key hash and
    /// are joined part by part (`SpillableHashJoinExec`).
    SpilledJoins,
    /// `SET sieve.join_filter_keys_max = 64`: build key columns past 16
    /// distinct keys go over to a key bitmap where their range allows
    /// (which each storage node cuts to its slices' key ranges), the others
    /// stop at 64 and keep only their range.
    FewJoinKeys,
    /// `SET sieve.star_join_build_rows_share = 100`: star joins pushed
    /// whatever their build sides' rows against the probe table's per
    /// slice (the default keeps most of the fuzzer's small tables out).
    StarJoins,
    /// Every hash join partitioned, and every partitioned join over 6
    /// partitions merged back into the plan's (`SET
    /// sieve.join_wide_build_rows = 0`, `sieve.join_wide_partitions = 6`:
    /// not a power of two, so a row's partition is a true remainder).
    WideJoins,
}

impl Mode {
    /// Every mode, in the order they run.
    pub const ALL: [Mode; 9] = [
        Mode::Default,
        Mode::NoJoinFilters,
        Mode::NoAggregatePushdown,
        Mode::Raw,
        Mode::NdpOff,
        Mode::SpilledJoins,
        Mode::FewJoinKeys,
        Mode::StarJoins,
        Mode::WideJoins,
    ];

    /// The mode's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Default => "default",
            Mode::NoJoinFilters => "no-join-filters",
            Mode::NoAggregatePushdown => "no-aggregate-pushdown",
            Mode::Raw => "raw",
            Mode::NdpOff => "ndp-off",
            Mode::SpilledJoins => "spilled-joins",
            Mode::FewJoinKeys => "few-join-keys",
            Mode::StarJoins => "star-joins",
            Mode::WideJoins => "wide-joins",
        }
    }

    /// The mode named `name` (as [`Mode::name`] spells it).
    pub fn parse(name: &str) -> Result<Self> {
        match Self::ALL.iter().find(|mode| mode.name() == name.trim()) {
            Some(mode) => Ok(*mode),
            None => plan_err!(
                "unknown fuzz mode '{name}' (known: {})",
                Self::ALL.map(Mode::name).join(", ")
            ),
        }
    }

    /// The SQL a user would type to get this mode, for reproductions.
    pub fn how(self) -> &'static str {
        match self {
            Mode::Default => "Sieve, default settings",
            Mode::NoJoinFilters => "Sieve, SET sieve.join_filters = false",
            Mode::NoAggregatePushdown => "Sieve, SET sieve.aggregate_pushdown = false",
            Mode::Raw => "Sieve, storage nodes with --pushdown-workers 0 (every slice raw)",
            Mode::NdpOff => "Sieve, SET sieve.ndp = off",
            Mode::SpilledJoins => "Sieve, SET sieve.join_build_bytes_max = 2048, datafusion.optimizer.hash_join_single_partition_threshold = 0, datafusion.optimizer.hash_join_single_partition_threshold_rows = 0",
            Mode::FewJoinKeys => "Sieve, SET sieve.join_filter_keys_max = 64",
            Mode::StarJoins => "Sieve, SET sieve.star_join_build_rows_share = 100",
            Mode::WideJoins => "Sieve, SET sieve.join_wide_build_rows = 0, sieve.join_wide_partitions = 6, datafusion.optimizer.hash_join_single_partition_threshold = 0, datafusion.optimizer.hash_join_single_partition_threshold_rows = 0",
        }
    }
}

/// What to fuzz.
#[derive(Debug, Clone)]
pub struct FuzzOptions {
    /// The run's seed: it fixes every schema and query.
    pub seed: u64,
    /// Schemas (sets of tables) to generate.
    pub schemas: usize,
    /// Queries per schema.
    pub queries_per_schema: usize,
    /// Where the slices go (a directory per schema, removed afterwards);
    /// None: the system's temporary directory.
    pub data_directory: Option<PathBuf>,
    /// The Sieve modes each query runs in.
    pub modes: Vec<Mode>,
    /// Only this schema index (to reproduce a mismatch).
    pub only_schema: Option<usize>,
    /// Only this query index within each schema (to reproduce a mismatch).
    pub only_query: Option<usize>,
    /// Print a line per schema and every mismatch as it is found.
    pub progress: bool,
    /// Session settings (`key=value`) for every Sieve mode, after the
    /// mode's own: to narrow down which rewrite a mismatch needs.
    pub settings: Vec<String>,
    /// Each mismatch carries the mode's EXPLAIN (a query that hangs has
    /// no EXPLAIN ANALYZE to show).
    pub explain: bool,
}

impl FuzzOptions {
    /// `schemas` schemas of `queries_per_schema` queries from `seed`, in
    /// every mode, in a temporary directory, with progress lines.
    pub fn new(seed: u64, schemas: usize, queries_per_schema: usize) -> Self {
        Self {
            seed,
            schemas,
            queries_per_schema,
            data_directory: None,
            modes: Mode::ALL.to_vec(),
            only_schema: None,
            only_query: None,
            progress: true,
            settings: Vec::new(),
            explain: false,
        }
    }
}

/// One query on which a Sieve mode and plain DataFusion disagree, with
/// everything needed to reproduce it.
#[derive(Debug, Clone)]
pub struct Mismatch {
    /// The run's seed.
    pub seed: u64,
    /// The schema's index in the run, and its seed.
    pub schema_index: usize,
    /// The seed the schema's tables came from.
    pub schema_seed: u64,
    /// The query's index in its schema.
    pub query_index: usize,
    /// The query.
    pub query: FuzzQuery,
    /// The mode that disagreed.
    pub mode: Mode,
    /// The tables' parameters ([`FuzzSchema::describe`]).
    pub tables: String,
    /// What differs: row counts and the first differing rows, or the error.
    pub difference: String,
    /// The settings given to every mode ([`FuzzOptions::settings`]).
    pub settings: Vec<String>,
    /// The mode's EXPLAIN, when asked for ([`FuzzOptions::explain`]).
    pub plan: Option<String>,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            formatter,
            "MISMATCH in mode {} ({}), {:?} query",
            self.mode.name(),
            self.mode.how(),
            self.query.shape
        )?;
        writeln!(
            formatter,
            "  seed {}, schema {} (schema seed {:#018x}), query {}",
            self.seed, self.schema_index, self.schema_seed, self.query_index
        )?;
        write!(
            formatter,
            "  reproduce: sieve fuzz --seed {} --schemas {} --queries-per-schema {} --schema {} --query {} --modes {}",
            self.seed,
            self.schema_index + 1,
            self.query_index + 1,
            self.schema_index,
            self.query_index,
            self.mode.name()
        )?;
        for setting in &self.settings {
            write!(formatter, " --set {setting}")?;
        }
        writeln!(formatter)?;
        writeln!(formatter, "  tables:")?;
        write!(formatter, "{}", self.tables)?;
        writeln!(formatter, "  query: {}", self.query.sql)?;
        if !self.query.approximate_columns.is_empty() {
            writeln!(
                formatter,
                "  (columns {:?} compared with a tolerance)",
                self.query.approximate_columns
            )?;
        }
        write!(formatter, "{}", self.difference)?;
        if let Some(plan) = &self.plan {
            writeln!(formatter, "  plan in this mode:")?;
            for line in plan.lines() {
                writeln!(formatter, "    {line}")?;
            }
        }
        Ok(())
    }
}

/// What a run found.
#[derive(Debug, Default)]
pub struct FuzzReport {
    /// Queries generated.
    pub queries: usize,
    /// Queries generated, by shape.
    pub queries_by_shape: BTreeMap<QueryShape, usize>,
    /// Queries plain DataFusion could not plan (not compared).
    pub reference_plan_failures: usize,
    /// Some of them, with the error.
    pub reference_plan_failure_examples: Vec<(String, String)>,
    /// Queries that failed while running in the reference; each mode must
    /// fail too.
    pub reference_execution_errors: usize,
    /// Some of them, with the error.
    pub reference_execution_error_examples: Vec<(String, String)>,
    /// Comparisons made (queries times modes).
    pub comparisons: usize,
    /// Comparisons where both engines raised an error (agreement).
    pub both_errored: usize,
    /// Comparisons per mode.
    pub comparisons_by_mode: BTreeMap<Mode, usize>,
    /// Every disagreement.
    pub mismatches: Vec<Mismatch>,
    /// Wall time of the whole run.
    pub elapsed: Duration,
    /// Schemas whose tables were loaded through the write path (a table
    /// catalog's), of all schemas run; the others were slice files placed
    /// in the node directories.
    pub schemas_through_catalog: (usize, usize),
    /// Schemas by the types of their join keys ("Int32/Int64", "Utf8").
    pub schemas_by_key_types: BTreeMap<String, usize>,
    /// Compared queries whose plan took each of Sieve's rewrites (by its
    /// EXPLAIN marker, [`PLAN_FEATURES`]), in the default, star-joins and
    /// wide-joins modes: what the comparisons exercised.
    pub plan_features: BTreeMap<&'static str, BTreeMap<Mode, usize>>,
}

/// Sieve's plan rewrites the fuzz report counts, each with the text its
/// EXPLAIN shows for it.
pub const PLAN_FEATURES: [(&str, &str); 12] = [
    ("pushed filter", "pushed filter:"),
    ("sorted copy", "reads copy "),
    ("pushed aggregate", "pushed aggregate:"),
    ("join filter", "join filter from"),
    ("star join", "pushed join: dimension(s)"),
    ("spillable join", "SpillableHashJoinExec"),
    ("late group columns", "__sieve_late"),
    ("aggregate before join", "__sieve_first"),
    ("evaluated on a build side", "__sieve_early"),
    ("wide join", "MergePartitionsExec"),
    ("aggregation by key value", "DenseAggregateExec"),
    ("grouped by a table's key first", "__sieve_keyed"),
];

impl FuzzReport {
    /// A few lines: counts by shape and mode, plan failures, mismatches.
    pub fn summary(&self) -> String {
        let mut text = String::new();
        let _ = writeln!(
            text,
            "{} queries in {:.1} s: {} plan failure(s) in plain DataFusion (not compared), \
             {} execution error(s) in plain DataFusion",
            self.queries,
            self.elapsed.as_secs_f64(),
            self.reference_plan_failures,
            self.reference_execution_errors
        );
        let shapes: Vec<String> = self
            .queries_by_shape
            .iter()
            .map(|(shape, count)| format!("{shape:?} {count}"))
            .collect();
        let _ = writeln!(text, "by shape: {}", shapes.join(", "));
        let _ = writeln!(
            text,
            "{} of {} schema(s) loaded through the write path",
            self.schemas_through_catalog.0, self.schemas_through_catalog.1
        );
        let key_types: Vec<String> = self
            .schemas_by_key_types
            .iter()
            .map(|(types, count)| format!("{types} {count}"))
            .collect();
        let _ = writeln!(text, "schemas by join key types: {}", key_types.join(", "));
        let modes: Vec<String> = self
            .comparisons_by_mode
            .iter()
            .map(|(mode, count)| {
                let mismatches = self
                    .mismatches
                    .iter()
                    .filter(|mismatch| mismatch.mode == *mode)
                    .count();
                format!("{} {count} ({mismatches} mismatched)", mode.name())
            })
            .collect();
        let _ = writeln!(text, "comparisons by mode: {}", modes.join(", "));
        let _ = writeln!(text, "queries whose plan took, by mode:");
        for (name, _) in PLAN_FEATURES {
            let modes: Vec<String> = self
                .plan_features
                .get(name)
                .into_iter()
                .flatten()
                .map(|(mode, count)| format!("{} {count}", mode.name()))
                .collect();
            let modes = if modes.is_empty() {
                "none".to_string()
            } else {
                modes.join(", ")
            };
            let _ = writeln!(text, "  {name}: {modes}");
        }
        let _ = writeln!(
            text,
            "{} comparison(s), {} where both engines failed (agreement), {} mismatch(es)",
            self.comparisons,
            self.both_errored,
            self.mismatches.len()
        );
        for (sql, error) in &self.reference_plan_failure_examples {
            let _ = writeln!(text, "plan failure: {error}\n  in: {sql}");
        }
        for (sql, error) in &self.reference_execution_error_examples {
            let _ = writeln!(text, "execution error: {error}\n  in: {sql}");
        }
        text
    }
}

/// Run the fuzzer: every schema, every query, every mode.
pub async fn run_fuzz(options: &FuzzOptions) -> Result<FuzzReport> {
    if options.modes.is_empty() {
        return plan_err!("at least one fuzz mode is needed");
    }
    let started = Instant::now();
    let base = match &options.data_directory {
        Some(directory) => directory.clone(),
        None => std::env::temp_dir(),
    };
    let mut report = FuzzReport::default();
    for schema_index in 0..options.schemas {
        if options.only_schema.is_some_and(|only| only != schema_index) {
            continue;
        }
        let schema_seed = SeededRandom::derive_seed(options.seed, schema_index as u64);
        let root = base.join(format!(
            "sieve-fuzz-{}-{}-{schema_index}",
            std::process::id(),
            options.seed
        ));
        let _ = std::fs::remove_dir_all(&root);
        let outcome = run_schema(options, schema_index, schema_seed, &root, &mut report).await;
        let _ = std::fs::remove_dir_all(&root);
        outcome?;
    }
    report.elapsed = started.elapsed();
    Ok(report)
}

/// The Sieve sessions of one schema, one per mode, with the clusters they
/// talk to (kept alive as long as the sessions).
struct Engines {
    sessions: Vec<(Mode, SieveSession)>,
    clusters: Vec<EmbeddedCluster>,
}

async fn start_engines(root: &Path, modes: &[Mode], settings: &[String]) -> Result<Engines> {
    let mut clusters = Vec::new();
    let default = EmbeddedCluster::start(root, NODES).await?;
    let default_urls = default.urls();
    let default_secret = default.secret().clone();
    clusters.push(default);
    let mut raw_urls = None;
    if modes.contains(&Mode::Raw) {
        let raw = EmbeddedCluster::start_raw(root, NODES).await?;
        raw_urls = Some((raw.urls(), raw.secret().clone()));
        clusters.push(raw);
    }
    let mut sessions = Vec::with_capacity(modes.len());
    for &mode in modes {
        let (urls, secret) = match (mode, &raw_urls) {
            (Mode::Raw, Some((urls, secret))) => (urls, secret),
            _ => (&default_urls, &default_secret),
        };
        let session = connect_session_with_tables(
            urls,
            Some(secret),
            datafusion::prelude::SessionConfig::new(),
            Some(&root.join(sieve_format::TABLE_CATALOG_FILE)),
        )
        .await?;
        match mode {
            Mode::NoJoinFilters => session.apply_settings(&["sieve.join_filters=false".into()])?,
            Mode::NoAggregatePushdown => {
                session.apply_settings(&["sieve.aggregate_pushdown=false".into()])?
            }
            Mode::NdpOff => session.set_ndp(false)?,
            Mode::SpilledJoins => session.apply_settings(&[
                "sieve.join_build_bytes_max=2048".into(),
                "datafusion.optimizer.hash_join_single_partition_threshold=0".into(),
                "datafusion.optimizer.hash_join_single_partition_threshold_rows=0".into(),
            ])?,
            Mode::FewJoinKeys => {
                session.apply_settings(&["sieve.join_filter_keys_max=64".into()])?
            }
            Mode::StarJoins => {
                session.apply_settings(&["sieve.star_join_build_rows_share=100".into()])?
            }
            Mode::WideJoins => session.apply_settings(&[
                "sieve.join_wide_build_rows=0".into(),
                "sieve.join_wide_partitions=6".into(),
                "datafusion.optimizer.hash_join_single_partition_threshold=0".into(),
                "datafusion.optimizer.hash_join_single_partition_threshold_rows=0".into(),
            ])?,
            Mode::Default | Mode::Raw => {}
        }
        session.apply_settings(settings)?;
        sessions.push((mode, session));
    }
    Ok(Engines { sessions, clusters })
}

async fn run_schema(
    options: &FuzzOptions,
    schema_index: usize,
    schema_seed: u64,
    root: &Path,
    report: &mut FuzzReport,
) -> Result<()> {
    let started = Instant::now();
    let schema = FuzzSchema::generate(schema_seed)?;
    // Every other schema through the write path (a table catalog's
    // tables), the others as slice files placed in the node directories.
    let through_catalog = schema_seed.is_multiple_of(2);
    let mut key_types: Vec<String> = schema
        .tables
        .iter()
        .flat_map(|table| &table.spec.columns)
        .filter(|column| column.key.is_some())
        .map(|column| column.data_type.to_string())
        .collect();
    key_types.sort();
    key_types.dedup();
    let key_types = key_types.join("/");
    *report
        .schemas_by_key_types
        .entry(key_types.clone())
        .or_default() += 1;
    report.schemas_through_catalog.1 += 1;
    if through_catalog {
        report.schemas_through_catalog.0 += 1;
    }
    if through_catalog {
        for node in 0..NODES {
            std::fs::create_dir_all(sieve_format::node_directory(root, node))?;
        }
        let loader = EmbeddedCluster::start(root, NODES).await?;
        schema.load(&loader.session().await?).await?;
        for node in loader.nodes {
            node.stop().await;
        }
    } else {
        schema.write(root)?;
    }
    let engines = start_engines(root, &options.modes, &options.settings).await?;
    let reference = reference_context_for(root, NODES, &schema.table_names()).await?;
    let mismatches_before = report.mismatches.len();
    let plan_failures_before = report.reference_plan_failures;
    let tables = format!(
        "{}  loaded {}\n",
        schema.describe(),
        if through_catalog {
            "through the write path (a table catalog)"
        } else {
            "as slice files in the node directories"
        }
    );
    for query_index in 0..options.queries_per_schema {
        if options.only_query.is_some_and(|only| only != query_index) {
            continue;
        }
        let query_seed = SeededRandom::derive_seed(schema_seed, query_index as u64);
        let query = QueryGenerator::new(&schema, query_seed).query();
        report.queries += 1;
        *report.queries_by_shape.entry(query.shape).or_insert(0) += 1;
        let expected = match run_query(&reference, &query.sql).await {
            Outcome::PlanError(error) => {
                report.reference_plan_failures += 1;
                if report.reference_plan_failure_examples.len() < PLAN_FAILURE_EXAMPLES_MAX {
                    report
                        .reference_plan_failure_examples
                        .push((query.sql.clone(), first_line(&error)));
                }
                continue;
            }
            Outcome::Rows(batches) => Ok(batches),
            Outcome::ExecutionError(error) => {
                report.reference_execution_errors += 1;
                if report.reference_execution_error_examples.len() < PLAN_FAILURE_EXAMPLES_MAX {
                    report
                        .reference_execution_error_examples
                        .push((query.sql.clone(), first_line(&error)));
                }
                Err(error)
            }
        };
        for (mode, session) in &engines.sessions {
            // The default plan, and the star-joins and wide-joins modes'
            // (the modes that turn a rewrite on); the others turn
            // rewrites off.
            if !matches!(mode, Mode::Default | Mode::StarJoins | Mode::WideJoins) {
                continue;
            }
            if let Outcome::Rows(batches) =
                run_query(&session.context, &format!("EXPLAIN {}", query.sql)).await
            {
                let plan = crate::compare::rows_as_text(&batches, false)?.join("\n");
                for (name, marker) in PLAN_FEATURES {
                    if plan.contains(marker) {
                        *report
                            .plan_features
                            .entry(name)
                            .or_default()
                            .entry(*mode)
                            .or_insert(0) += 1;
                    }
                }
            }
        }
        for (mode, session) in &engines.sessions {
            report.comparisons += 1;
            *report.comparisons_by_mode.entry(*mode).or_insert(0) += 1;
            let actual = match run_query(&session.context, &query.sql).await {
                Outcome::Rows(batches) => Ok(batches),
                Outcome::PlanError(error) | Outcome::ExecutionError(error) => Err(error),
            };
            let difference = match (&expected, &actual) {
                (Ok(expected), Ok(actual)) => difference(expected, actual, &query)?,
                (Err(_), Err(_)) => {
                    report.both_errored += 1;
                    None
                }
                (Ok(expected), Err(error)) => Some(format!(
                    "  plain DataFusion returned {} row(s); Sieve failed: {error}\n",
                    rows(expected)
                )),
                (Err(error), Ok(actual)) => Some(format!(
                    "  plain DataFusion failed: {error}\n  Sieve returned {} row(s)\n",
                    rows(actual)
                )),
            };
            if let Some(difference) = difference {
                let plan = match options.explain {
                    true => {
                        match run_query(&session.context, &format!("EXPLAIN {}", query.sql)).await {
                            Outcome::Rows(batches) => {
                                Some(crate::compare::rows_as_text(&batches, false)?.join("\n"))
                            }
                            Outcome::PlanError(error) | Outcome::ExecutionError(error) => {
                                Some(format!("EXPLAIN failed: {error}"))
                            }
                        }
                    }
                    false => None,
                };
                let mismatch = Mismatch {
                    seed: options.seed,
                    schema_index,
                    schema_seed,
                    query_index,
                    query: query.clone(),
                    mode: *mode,
                    tables: tables.clone(),
                    difference,
                    settings: options.settings.clone(),
                    plan,
                };
                if options.progress {
                    println!("{mismatch}");
                }
                report.mismatches.push(mismatch);
            }
        }
    }
    if options.progress {
        let rows: Vec<usize> = schema
            .tables
            .iter()
            .map(|table| table.spec.rows())
            .collect();
        println!(
            "schema {schema_index} (seed {schema_seed:#018x}, {} tables of {rows:?} rows, \
             keys {}): {} queries, {} plan failure(s) in plain DataFusion, {} mismatch(es), {:.1} s",
            schema.tables.len(),
            key_types,
            options.only_query.map_or(options.queries_per_schema, |_| 1),
            report.reference_plan_failures - plan_failures_before,
            report.mismatches.len() - mismatches_before,
            started.elapsed().as_secs_f64()
        );
    }
    drop(engines.sessions);
    for cluster in engines.clusters {
        for node in cluster.nodes {
            node.stop().await;
        }
    }
    Ok(())
}

/// What running a query gave.
enum Outcome {
    /// Its result.
    Rows(Vec<RecordBatch>),
    /// It could not be parsed or planned.
    PlanError(String),
    /// It failed (or timed out) while running.
    ExecutionError(String),
}

/// Runs `sql`; a panic while planning or running it is this query's
/// failure (the run goes on and shows its SQL), not the fuzzer's.
async fn run_query(context: &SessionContext, sql: &str) -> Outcome {
    use futures::FutureExt;
    let timeout = Duration::from_millis(QUERY_TIMEOUT_MS);
    let planned = std::panic::AssertUnwindSafe(tokio::time::timeout(timeout, context.sql(sql)))
        .catch_unwind()
        .await;
    let frame = match planned {
        Ok(Ok(Ok(frame))) => frame,
        Ok(Ok(Err(error))) => return Outcome::PlanError(error.to_string()),
        Ok(Err(_)) => {
            return Outcome::ExecutionError(format!("planning took over {QUERY_TIMEOUT_MS} ms"))
        }
        Err(panic) => return Outcome::ExecutionError(panicked("planning", panic.as_ref())),
    };
    let ran = std::panic::AssertUnwindSafe(tokio::time::timeout(timeout, frame.collect()))
        .catch_unwind()
        .await;
    match ran {
        Ok(Ok(Ok(batches))) => Outcome::Rows(batches),
        Ok(Ok(Err(error))) => Outcome::ExecutionError(error.to_string()),
        Ok(Err(_)) => Outcome::ExecutionError(format!("ran over {QUERY_TIMEOUT_MS} ms")),
        Err(panic) => Outcome::ExecutionError(panicked("running", panic.as_ref())),
    }
}

/// A panic's message, as an error.
fn panicked(stage: &str, panic: &(dyn std::any::Any + Send)) -> String {
    format!(
        "panicked while {stage}: {}",
        sieve_compute::panic_message(panic)
    )
}

fn rows(batches: &[RecordBatch]) -> usize {
    batches.iter().map(RecordBatch::num_rows).sum()
}

/// An error on one line (DataFusion puts the cause of a wrapped error on the
/// next lines), cut to [`ERROR_CHARACTERS_SHOWN`] characters.
fn first_line(text: &str) -> String {
    let line = text
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .collect::<Vec<_>>()
        .join(" / ");
    line.chars().take(ERROR_CHARACTERS_SHOWN).collect()
}

/// The cells of one rendered row (`rows_as_text` joins them with ` | `;
/// the fuzzer's strings never contain `|`).
fn cells(row: &str) -> Vec<&str> {
    row.split(" | ").collect()
}

/// Whether two renderings of a float aggregate are equal within the
/// tolerances (NaN equals NaN; infinities must match exactly).
fn approximately_equal(expected: &str, actual: &str) -> bool {
    if expected == actual {
        return true;
    }
    match (expected.parse::<f64>(), actual.parse::<f64>()) {
        (Ok(expected), Ok(actual)) => {
            if expected.is_nan() || actual.is_nan() {
                return expected.is_nan() && actual.is_nan();
            }
            if expected.is_infinite() || actual.is_infinite() {
                return expected == actual;
            }
            let gap = (expected - actual).abs();
            gap <= FLOAT_ABSOLUTE_TOLERANCE
                || gap <= FLOAT_RELATIVE_TOLERANCE * expected.abs().max(actual.abs())
        }
        _ => false,
    }
}

/// The rows of a result, in the order they are compared in: as returned
/// when the query orders them totally, otherwise sorted by their exact
/// cells first (so that a float aggregate's last bits cannot reorder rows).
fn comparable_rows(batches: &[RecordBatch], query: &FuzzQuery) -> Result<Vec<String>> {
    let mut rows = rows_as_text(batches, !query.ordered)?;
    if !query.ordered && !query.approximate_columns.is_empty() {
        let exact_key = |row: &String| -> String {
            cells(row)
                .iter()
                .enumerate()
                .filter(|(index, _)| !query.approximate_columns.contains(index))
                .map(|(_, cell)| *cell)
                .collect::<Vec<_>>()
                .join(" | ")
        };
        rows.sort_by_cached_key(exact_key);
    }
    Ok(rows)
}

fn rows_equal(expected: &str, actual: &str, query: &FuzzQuery) -> bool {
    if expected == actual {
        return true;
    }
    if query.approximate_columns.is_empty() {
        return false;
    }
    let expected = cells(expected);
    let actual = cells(actual);
    expected.len() == actual.len()
        && expected
            .iter()
            .zip(&actual)
            .enumerate()
            .all(|(index, (expected, actual))| {
                if query.approximate_columns.contains(&index) {
                    approximately_equal(expected, actual)
                } else {
                    expected == actual
                }
            })
}

/// None if the results agree, otherwise a description of the first
/// difference.
fn difference(
    expected: &[RecordBatch],
    actual: &[RecordBatch],
    query: &FuzzQuery,
) -> Result<Option<String>> {
    let expected_rows = comparable_rows(expected, query)?;
    let actual_rows = comparable_rows(actual, query)?;
    let first = expected_rows
        .iter()
        .zip(&actual_rows)
        .position(|(expected, actual)| !rows_equal(expected, actual, query));
    let first = match first {
        Some(index) => index,
        None if expected_rows.len() == actual_rows.len() => return Ok(None),
        None => expected_rows.len().min(actual_rows.len()),
    };
    let mut text = format!(
        "  plain DataFusion returned {} row(s), Sieve {} ({}); first difference at row {first}:\n",
        expected_rows.len(),
        actual_rows.len(),
        if query.ordered { "in order" } else { "sorted" }
    );
    let show = |rows: &[String]| -> String {
        let shown: Vec<&str> = rows
            .iter()
            .skip(first)
            .take(DIFFERENCE_ROWS_SHOWN)
            .map(String::as_str)
            .collect();
        if shown.is_empty() {
            "      (no more rows)".into()
        } else {
            shown
                .iter()
                .map(|row| format!("      {row}"))
                .collect::<Vec<_>>()
                .join("\n")
        }
    };
    let _ = writeln!(text, "    expected:\n{}", show(&expected_rows));
    let _ = writeln!(text, "    actual:\n{}", show(&actual_rows));
    // For a multiset comparison, the rows only one side has say more than
    // the first position that differs.
    if !query.ordered {
        let (missing, extra) = multiset_difference(&expected_rows, &actual_rows);
        let _ = writeln!(
            text,
            "    {} row(s) only in plain DataFusion, {} only in Sieve (exact text){}",
            missing.len(),
            extra.len(),
            if missing.is_empty() && extra.is_empty() {
                ""
            } else {
                ", e.g.:"
            }
        );
        for row in missing.iter().take(DIFFERENCE_ROWS_SHOWN) {
            let _ = writeln!(text, "      - {row}");
        }
        for row in extra.iter().take(DIFFERENCE_ROWS_SHOWN) {
            let _ = writeln!(text, "      + {row}");
        }
    }
    Ok(Some(text))
}

/// Rows of `expected` not matched in `actual`, and the other way round,
/// both sorted.
fn multiset_difference<'rows>(
    expected: &'rows [String],
    actual: &'rows [String],
) -> (Vec<&'rows str>, Vec<&'rows str>) {
    let mut counts: BTreeMap<&str, i64> = BTreeMap::new();
    for row in expected {
        *counts.entry(row.as_str()).or_insert(0) += 1;
    }
    for row in actual {
        *counts.entry(row.as_str()).or_insert(0) -= 1;
    }
    let mut missing = Vec::new();
    let mut extra = Vec::new();
    for (row, count) in counts {
        for _ in 0..count.max(0) {
            missing.push(row);
        }
        for _ in 0..(-count).max(0) {
            extra.push(row);
        }
    }
    (missing, extra)
}

/// Turn a run's mismatches into an error, for the command's exit status.
pub fn mismatches_as_error(report: &FuzzReport) -> Result<()> {
    if report.mismatches.is_empty() {
        Ok(())
    } else {
        Err(DataFusionError::Execution(format!(
            "{} mismatch(es) between Sieve and plain DataFusion",
            report.mismatches.len()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_tables_and_queries() {
        let generate = || {
            let schema = FuzzSchema::generate(11).expect("tables");
            let queries: Vec<String> = (0..30)
                .map(|index| QueryGenerator::new(&schema, index).query().sql)
                .collect();
            (schema.describe(), schema.tables[0].batch.clone(), queries)
        };
        let (first_tables, first_batch, first_queries) = generate();
        let (second_tables, second_batch, second_queries) = generate();
        assert_eq!(first_tables, second_tables);
        assert_eq!(first_batch, second_batch);
        assert_eq!(first_queries, second_queries);
    }

    #[test]
    fn float_aggregates_compare_within_the_tolerance() {
        assert!(approximately_equal("0.30000000000000004", "0.3"));
        assert!(approximately_equal("NaN", "NaN"));
        assert!(approximately_equal("1e-9", "-1e-9"));
        assert!(!approximately_equal("inf", "1e308"));
        assert!(!approximately_equal("1000000", "1000001"));
        assert!(!approximately_equal("NULL", "0"));
    }
}
