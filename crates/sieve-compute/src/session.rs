//! A compute session connected to a cluster of storage nodes.

use std::sync::Arc;
use std::time::Duration;

use datafusion::common::{DataFusionError, Result};
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::execution::SessionStateBuilder;
use datafusion::optimizer::{Optimizer, OptimizerRule};
use datafusion::physical_optimizer::optimizer::PhysicalOptimizer;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::prelude::{SessionConfig, SessionContext};
use sieve_fragment::Secret;

use crate::memory::{runtime_with_memory_limit, MEMORY_LIMIT_SETTING};
use crate::range_store::{ClusterRangeStore, CLUSTER_RANGE_URL};
use crate::{
    ClusterCatalog, PushAggregateToStorage, SieveConfig, SieveTable, StartScansEarly, Traffic,
    WaitForJoinFilters,
};

/// A DataFusion session whose tables are the cluster's.
#[derive(Clone)]
pub struct SieveSession {
    /// The DataFusion context: run SQL here.
    pub context: SessionContext,
    /// What the storage nodes hold.
    pub catalog: Arc<ClusterCatalog>,
    /// Bytes shipped from storage to compute.
    pub traffic: Arc<Traffic>,
}

impl std::fmt::Debug for SieveSession {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("SieveSession")
            .field("catalog", &self.catalog)
            .finish_non_exhaustive()
    }
}

/// Connect to the storage nodes at `urls` and register every table they
/// hold; every request carries `secret` (`None`: nodes without one).
pub async fn connect_session(urls: &[String], secret: Option<&Secret>) -> Result<SieveSession> {
    connect_session_with_config(urls, secret, SessionConfig::new()).await
}

impl SieveSession {
    /// Plan `sql` as a DataFrame, as `SessionContext::sql` does, with the
    /// statements of tables users own (`CREATE TABLE`, `COPY ... FROM`)
    /// run by Sieve ([`crate::tables::statements`]).
    pub async fn sql(&self, sql: &str) -> Result<datafusion::dataframe::DataFrame> {
        crate::tables::statements::run_sql(&self.context, sql).await
    }

    /// Every table's slice files as byte-range URLs, one copy of each:
    /// what another engine reading the same files is given (the bench's
    /// DuckDB). The tables users own are read at their latest version; one
    /// with deleted rows is refused, as its files hold them.
    pub fn slice_urls(&self) -> Result<std::collections::BTreeMap<String, Vec<String>>> {
        let mut tables: std::collections::BTreeMap<String, Vec<String>> = self
            .catalog
            .tables
            .iter()
            .map(|(name, table)| {
                let urls = table
                    .slices
                    .iter()
                    .map(|slice| slice.range_url.clone())
                    .collect();
                (name.clone(), urls)
            })
            .collect();
        if let Some(owned) = &self.catalog.owned {
            let pin = owned.pin_latest()?;
            for name in owned.store().tables_at(pin.version())?.into_keys() {
                let Some(snapshot) = owned.store().snapshot(&name, pin.version())? else {
                    continue;
                };
                if snapshot.slices.iter().any(|slice| slice.deleted_rows > 0) {
                    return datafusion::common::plan_err!(
                        "table {name} has deleted rows, which its slice files still hold"
                    );
                }
                let table = owned.cluster_table(&snapshot, &pin);
                tables.insert(
                    name,
                    table
                        .slices
                        .iter()
                        .map(|slice| slice.range_url.clone())
                        .collect(),
                );
            }
        }
        Ok(tables)
    }

    /// Run `SET sieve.ndp = on|off`.
    pub fn set_ndp(&self, on: bool) -> Result<()> {
        let state = self.context.state_ref();
        let mut state = state.write();
        state
            .config_mut()
            .options_mut()
            .set("sieve.ndp", if on { "on" } else { "off" })
    }

    /// Apply `key=value` session settings (the command line's `--set`).
    /// `datafusion.runtime.memory_limit` (`auto`, `unbounded` or a size
    /// such as `4G`) replaces the session's memory pool ([`crate::memory`]).
    pub fn apply_settings(&self, settings: &[String]) -> Result<()> {
        for setting in settings {
            let Some((key, value)) = setting.split_once('=') else {
                return datafusion::common::plan_err!("--set wants key=value, got '{setting}'");
            };
            if key.trim() == MEMORY_LIMIT_SETTING {
                let state = self.context.state_ref();
                let mut state = state.write();
                let runtime = runtime_with_memory_limit(state.runtime_env(), value)?;
                *state = SessionStateBuilder::from(state.clone())
                    .with_runtime_env(runtime)
                    .build();
                continue;
            }
            self.context
                .state_ref()
                .write()
                .config_mut()
                .options_mut()
                .set(key.trim(), value.trim())?;
        }
        Ok(())
    }
}

/// DataFusion's physical optimizer rules, corrected where DataFusion 55
/// gives wrong answers:
///
/// - without its first `FilterPushdown` pass, which pushes plan filters
///   (not dynamic ones) into operators below: in DataFusion 55 it maps a
///   filter through a projection by column name, so `b.s < concat(a.s,
///   'x')` above a join of two tables that both have `s` became `b.s <
///   concat(b.s, 'x')` below it (found by `sieve fuzz`, seed 1, schema 12).
///   Filters still reach the scans through the logical plan
///   (`TableProvider::scan`); the second pass, which links a hash join's
///   dynamic filter to the probe scan, stays.
/// - with [`crate::KeepFloatEqualitiesApart`] right before
///   `EnsureRequirements` and [`crate::UnwrapFloatEqualities`] right after,
///   so that a float equality (`x = 0.0`, a join on a float key) does not
///   drop a key from a sort (`crate::signed_zero`).
/// - with [`crate::GuardMergeJoinFilters`] and
///   [`crate::UnguardMergeJoinFilters`] around each `ProjectionPushdown`,
///   which projected a sort-merge join's filter columns away below it
///   (`crate::merge_join_filter`).
/// - with [`crate::NullableMergeJoinFilters`] last, without which an outer
///   sort-merge join with a filter failed on the NULLs it pads with
///   (`crate::merge_join_filter`).
pub fn physical_rules_corrected() -> Vec<Arc<dyn PhysicalOptimizerRule + Send + Sync>> {
    let mut rules = Vec::new();
    for rule in PhysicalOptimizer::new().rules {
        match rule.name() {
            "FilterPushdown" => {}
            "EnsureRequirements" => {
                rules.push(Arc::new(crate::KeepFloatEqualitiesApart) as _);
                rules.push(rule);
                rules.push(Arc::new(crate::UnwrapFloatEqualities) as _);
            }
            "ProjectionPushdown" => {
                rules.push(Arc::new(crate::GuardMergeJoinFilters) as _);
                rules.push(rule);
                rules.push(Arc::new(crate::UnguardMergeJoinFilters) as _);
            }
            _ => rules.push(rule),
        }
    }
    rules.push(Arc::new(crate::NullableMergeJoinFilters) as _);
    rules
}

/// The physical optimizer rules of a Sieve session before Sieve's own that
/// run last: [`physical_rules_corrected`], with
/// [`crate::BuildOnFilteredSide`] right after DataFusion's `JoinSelection`
/// (before DataFusion creates the joins' dynamic filters) and
/// [`crate::WidenLargeJoins`] right after its `EnsureRequirements` (which
/// places the repartitions it widens) and Sieve's unwrapping that follows.
fn physical_rules_with_join_sides() -> Vec<Arc<dyn PhysicalOptimizerRule + Send + Sync>> {
    let mut rules = Vec::new();
    for rule in physical_rules_corrected() {
        let name = rule.name().to_string();
        rules.push(rule);
        if name == "join_selection" {
            rules.push(Arc::new(crate::BuildOnFilteredSide) as _);
            rules.push(Arc::new(crate::EvaluateOnBuildSides) as _);
        }
        if name == "UnwrapFloatEqualities" {
            rules.push(Arc::new(crate::WidenLargeJoins) as _);
        }
    }
    rules
}

/// Like [`connect_session`], starting from `config`. Sieve settings already
/// in `config` (a [`SieveConfig`] extension) are kept; those read when the
/// session connects (discovery and byte-range timeouts) take effect only so.
///
/// The session starts without the storage nodes that fail or time out, as
/// long as every slice has a live replica
/// ([`ClusterCatalog::discover_with`]).
pub async fn connect_session_with_config(
    urls: &[String],
    secret: Option<&Secret>,
    config: SessionConfig,
) -> Result<SieveSession> {
    connect_session_with_tables(urls, secret, config, None).await
}

/// Like [`connect_session_with_config`], with the tables users own from
/// the table catalog at `tables` (created if missing; `None`: no owned
/// tables, CREATE TABLE makes DataFusion's in-memory tables).
pub async fn connect_session_with_tables(
    urls: &[String],
    secret: Option<&Secret>,
    config: SessionConfig,
    tables: Option<&std::path::Path>,
) -> Result<SieveSession> {
    let sieve = SieveConfig::of(config.options());
    let mut catalog =
        ClusterCatalog::discover_with(urls, secret, sieve.discovery_settings()).await?;
    if let Some(path) = tables {
        catalog = catalog.with_owned_tables(path).await?;
    }
    let catalog = Arc::new(catalog);
    let runtime = runtime_with_memory_limit(&RuntimeEnv::default(), "auto")?;
    session_over(catalog, secret, config, runtime)
}

/// DataFusion's logical optimizer rules, with `SingleDistinctToGroupBy`
/// replaced by [`crate::CountDistinctBySets`] (which delegates to it).
fn optimizer_rules_with_distinct_sets() -> Vec<Arc<dyn OptimizerRule + Send + Sync>> {
    // First: it needs the table's key in the aggregation's input, which
    // DataFusion's projection pruning takes out when the query does not
    // name it.
    let first: Arc<dyn OptimizerRule + Send + Sync> = Arc::new(crate::GroupByTableKey);
    std::iter::once(first)
        .chain(Optimizer::new().rules)
        .map(|rule| {
            if rule.name() == crate::CountDistinctBySets::REPLACES {
                Arc::new(crate::CountDistinctBySets::default()) as _
            } else {
                rule
            }
        })
        .collect()
}

/// A new session over a cluster already discovered, drawing memory from
/// `runtime`'s pool: what a server gives each of its connections, all
/// sharing one catalog and one memory pool.
pub fn session_over(
    catalog: Arc<ClusterCatalog>,
    secret: Option<&Secret>,
    config: SessionConfig,
    runtime: Arc<RuntimeEnv>,
) -> Result<SieveSession> {
    let sieve = SieveConfig::of(config.options());
    let traffic = Arc::new(Traffic::default());
    let range_timeout = Duration::from_millis(sieve.range_timeout_ms.max(1));
    let mut config = config
        .with_option_extension(sieve)
        .with_information_schema(true)
        // What `tables::statements::run_sql` finds the cluster by.
        .with_extension(Arc::clone(&catalog));
    // DataFusion 55 gets these wrong over floats with NaN (found by `sieve
    // fuzz`), so they are off unless a session turns them on. TopK and
    // aggregate dynamic filters prune Parquet row groups and pages by min/max
    // statistics, which leave NaN out: `ORDER BY x DESC LIMIT n` lost NaN rows
    // with NDP off (NDP on scans take only hash joins' filters, and prune no
    // float column). The grouped TopK aggregation panics in its priority map
    // (`SELECT DISTINCT x ... ORDER BY x LIMIT n`).
    // DataFusion 55's planner gives `b IS TRUE` (never NULL) a nullable
    // physical field, and then refuses its own plan of `SELECT DISTINCT (b
    // IS TRUE) FROM t` (or a UNION, EXCEPT or DISTINCT over such a column,
    // or over `CASE WHEN ... THEN x ELSE 4 END`) with "Internal error:
    // Physical input schema should be the same as the one converted from
    // logical input schema" (the fuzzer met it in both engines). The
    // setting is DataFusion's own workaround for such planner bugs; the
    // two schemas differ in nullability only.
    config
        .options_mut()
        .execution
        .skip_physical_aggregate_schema_check = true;
    let optimizer = &mut config.options_mut().optimizer;
    optimizer.enable_topk_dynamic_filter_pushdown = false;
    optimizer.enable_aggregate_dynamic_filter_pushdown = false;
    optimizer.enable_topk_aggregation = false;
    let state = SessionStateBuilder::new()
        .with_config(config)
        .with_runtime_env(runtime)
        .with_default_features()
        .with_optimizer_rules(optimizer_rules_with_distinct_sets())
        .with_analyzer_rules(crate::analyzer_rules_with_depth_limit())
        // Last: every owned table of a statement at one version.
        .with_analyzer_rule(Arc::new(crate::tables::ReadOneVersion))
        .with_optimizer_rule(Arc::new(crate::OrderInnerJoins))
        .with_optimizer_rule(Arc::new(crate::JoinGroupColumnsLate))
        .with_optimizer_rule(Arc::new(crate::AggregateBeforeJoin))
        .with_optimizer_rule(Arc::new(crate::FloatInListsMatchBothZeros))
        .with_physical_optimizer_rules(physical_rules_with_join_sides())
        .with_physical_optimizer_rule(Arc::new(PushAggregateToStorage))
        .with_physical_optimizer_rule(Arc::new(WaitForJoinFilters))
        .with_physical_optimizer_rule(Arc::new(crate::PushStarJoinToStorage))
        // Before SpillHashJoins: it traces group keys through the joins.
        .with_physical_optimizer_rule(Arc::new(crate::DenseAggregates))
        .with_physical_optimizer_rule(Arc::new(crate::SpillHashJoins))
        .with_physical_optimizer_rule(Arc::new(StartScansEarly))
        // Last: it puts aggregations between wrappers other rules do not see through.
        .with_physical_optimizer_rule(Arc::new(crate::SetsInSmallBatches))
        .with_query_planner(Arc::new(crate::memory::ReleaseMemoryPlanner))
        .build();
    let context = SessionContext::new_with_state(state);
    // Grouped `min` and `max` over floats in total order, as the storage
    // nodes run them (`sieve_fragment::total_order_min_max`).
    for function in sieve_fragment::corrected_aggregates() {
        context.register_udaf(function);
    }
    for benchmark in sieve_format::Benchmark::ALL {
        context.register_udtf(
            benchmark.name(),
            Arc::new(crate::tables::generated::GeneratorFunction(benchmark)),
        );
    }
    // A node that holds no slice (or failed discovery) is never routed to;
    // its place holds an address nothing listens on.
    let range_urls: Vec<String> = catalog
        .range_urls
        .iter()
        .map(|url| {
            url.clone()
                .unwrap_or_else(|| "http://0.0.0.0:1".to_string())
        })
        .collect();
    let store =
        ClusterRangeStore::try_new(&range_urls, secret, Arc::clone(&traffic), range_timeout)
            .map_err(|error| DataFusionError::External(Box::new(error)))?
            .with_catalog(Arc::clone(&catalog));
    let url = ObjectStoreUrl::parse(CLUSTER_RANGE_URL)?;
    context.register_object_store(url.as_ref(), Arc::new(store));
    // The `public` schema: discovered tables, the session's own
    // registrations, and the tables users own at their latest version.
    let schema = Arc::new(crate::tables::SieveSchema::new(
        Arc::clone(&catalog),
        Arc::clone(&traffic),
    ));
    context
        .catalog("datafusion")
        .ok_or_else(|| DataFusionError::Internal("no default catalog".to_string()))?
        .register_schema("public", schema)?;
    for (name, table) in &catalog.tables {
        context.register_table(
            name.as_str(),
            Arc::new(SieveTable::new(
                Arc::clone(table),
                Arc::clone(&catalog),
                Arc::clone(&traffic),
            )),
        )?;
    }
    Ok(SieveSession {
        context,
        catalog,
        traffic,
    })
}
