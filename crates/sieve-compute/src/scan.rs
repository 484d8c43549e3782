//! `SieveScanExec`: a table scan evaluated on the storage nodes.
//!
//! ```text
//!            SieveScanExec (partition p of P)
//!                 │  slices p, p+P, p+2P, ...   (round robin over all slices)
//!      ┌──────────┼──────────┐  at most `slices_in_flight` DoGet requests at once,
//!   node 0     node 1     node 2   all nodes in parallel; each returns one
//!   slice 1    slice 2    slice 3  slice through the fragment, then its metrics
//! ```
//!
//! Contract: the output is exactly the rows of the table that satisfy the
//! pushed predicate, projected to the pushed columns (or, with a pushed
//! aggregation, its partial states). No ordering and no particular
//! partitioning are promised (`UnknownPartitioning(P)`). Batches are passed
//! on as they arrive; a slice that fails fails the query.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use arrow::datatypes::{Schema, SchemaRef};
use arrow::record_batch::{RecordBatch, RecordBatchOptions};
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::common::{internal_err, DataFusionError, Result, ScalarValue, Statistics};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::expressions::DynamicFilterPhysicalExpr;
use datafusion::physical_expr::{
    conjunction as physical_conjunction, EquivalenceProperties, PhysicalExpr,
};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::filter_pushdown::{
    ChildPushdownResult, FilterPushdownPhase, FilterPushdownPropagation, PushedDown,
};
use datafusion::physical_plan::metrics::{
    ExecutionPlanMetricsSet, Gauge, MetricBuilder, MetricsSet,
};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties,
};
use futures::{stream, StreamExt, TryStreamExt};
use sieve_fragment::{
    DecodedBody, FragmentEnvelope, IpcCodec, JoinFilterRegistration, JOIN_FILTER_ID_BYTES,
};

use crate::build_keys::BuildKeys;
use crate::client::{SlicePart, StorageClient};
use crate::copies::{Reading, TableCopy};
use crate::early_start::{buffer_ahead, EarlySlots};
use crate::estimate::filtered_statistics;
use crate::failover::{request_slice, FailoverSettings, SliceRequests};
use crate::join_filter::parts::JoinFilterParts;
use crate::join_filter::{
    resolve, JoinFilterSettings, JoinFilterSlot, KeyFilterSlot, ProbeColumns,
};
use crate::raw::{complete_raw, RawPages};
use crate::star_join::PushedStarJoin;
use crate::{ClusterCatalog, ClusterSlice, ClusterTable, Traffic};

/// A scan whose filter and projection run on the storage nodes.
#[derive(Debug)]
pub struct SieveScanExec {
    table: Arc<ClusterTable>,
    catalog: Arc<ClusterCatalog>,
    traffic: Arc<Traffic>,
    /// Columns shipped, as indices into the table schema (never empty).
    shipped: Vec<usize>,
    /// Whether the plan wants zero columns (e.g. `COUNT(*)`): the storage node
    /// still ships one column so row counts survive, and it is dropped here.
    output_no_columns: bool,
    predicate: Option<Arc<dyn PhysicalExpr>>,
    /// Table statistics with the pushed predicate's selectivity applied,
    /// computed once (the optimizer asks for statistics many times).
    filtered_statistics: Arc<Statistics>,
    /// Rows the predicate keeps with equalities estimated by distinct
    /// values ([`crate::estimate::rows_with_distinct_values`]), computed
    /// when first asked and shared by this scan's copies.
    rows_by_distinct: Arc<std::sync::OnceLock<Option<f64>>>,
    /// A partial aggregation run on the storage nodes, over the shipped
    /// columns (leaf `SliceInputExec`); the scan then outputs partial states.
    aggregate: Option<PushedAggregate>,
    /// Whether `aggregate` is the whole aggregation (each slice's groups are
    /// complete): it then outputs final values, and each request is a whole
    /// slice.
    aggregate_complete: bool,
    /// Why an aggregation above this scan was not pushed, for EXPLAIN.
    aggregate_note: Option<String>,
    /// A star join pushed with the aggregation (`aggregate` holds its
    /// operators): its build sides are this scan's children, run first.
    star_join: Option<PushedStarJoin>,
    /// Join filters dropped at planning because they could not filter, for EXPLAIN.
    join_notes: Vec<String>,
    /// Dynamic filters from joins above, applied on the storage nodes.
    join_filters: Vec<JoinFilterSlot>,
    /// Key filters from joins further above, through other joins.
    key_filters: Vec<KeyFilterSlot>,
    join_settings: JoinFilterSettings,
    /// What the join filters resolved to in the last execution, for EXPLAIN ANALYZE.
    join_filters_resolved: Arc<Mutex<Vec<String>>>,
    /// The requests of a scan (slices, or row-group ranges of large slices),
    /// dealt round robin to the partitions.
    units: Arc<Vec<WorkUnit>>,
    /// The fragment body with join filters, resolved once for all partitions.
    resolved_body: Arc<tokio::sync::OnceCell<std::result::Result<Arc<ResolvedBody>, String>>>,
    /// The encoded fragment body without join filters, shared by every slice request.
    body: Arc<Vec<u8>>,
    slices_in_flight: usize,
    ipc_codec: IpcCodec,
    /// Ask for pages as stored when there is nothing to push (see
    /// [`ScanOptions::as_stored`]).
    as_stored: bool,
    failover: FailoverSettings,
    /// Scan-wide parallelism gauges, made by the first partition to run.
    parallelism: Arc<OnceLock<Arc<Parallelism>>>,
    /// Partition streams started with the query (`early_start.rs`), taken
    /// by `execute`.
    early: EarlySlots,
    /// The table as a whole and its sorted copies, judged again when join
    /// filters resolve ([`crate::copies`]); with what planning chose.
    choice: Option<Arc<ScanChoice>>,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

/// What a scan may read: its table's slices or a sorted copy's.
#[derive(Debug)]
pub struct ScanChoice {
    /// The table, every slice.
    pub table: Arc<ClusterTable>,
    /// Its current sorted copies.
    pub copies: Vec<TableCopy>,
    /// Whether slices that cannot match are left out (`sieve.slice_pruning`).
    pub prune: bool,
    /// What planning chose from the query's own predicate, for EXPLAIN.
    pub planned: String,
}

/// The scan's parallelism on three levels (Taurus VI), as metrics:
/// partitions here, requests to the storage nodes at once, and slices a
/// storage node processed at once.
#[derive(Debug)]
struct Parallelism {
    partitions: Gauge,
    requests_in_flight_max: Gauge,
    nodes_in_flight_max: Gauge,
    storage_slices_running_max: Gauge,
    requests: AtomicUsize,
    per_node: Vec<AtomicUsize>,
    nodes: AtomicUsize,
}

impl Parallelism {
    fn request(&self, node: usize, started: bool) {
        if started {
            let now = self.requests.fetch_add(1, Ordering::Relaxed) + 1;
            self.requests_in_flight_max.set_max(now);
            if self.per_node[node].fetch_add(1, Ordering::Relaxed) == 0 {
                let nodes = self.nodes.fetch_add(1, Ordering::Relaxed) + 1;
                self.nodes_in_flight_max.set_max(nodes);
            }
        } else {
            self.requests.fetch_sub(1, Ordering::Relaxed);
            if self.per_node[node].fetch_sub(1, Ordering::Relaxed) == 1 {
                self.nodes.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

/// How a scan runs: its partitions, read-ahead and join filter settings.
#[derive(Debug, Clone)]
pub struct ScanOptions {
    /// Output partitions (at most one per slice).
    pub partitions: usize,
    /// Slice requests in flight per partition.
    pub slices_in_flight: usize,
    /// How join filters are applied.
    pub join_settings: JoinFilterSettings,
    /// Codec asked of the storage nodes for the shipped batches.
    pub ipc_codec: IpcCodec,
    /// Whether a scan with nothing for the nodes to do (no filter, join
    /// filter or aggregation: columns only) asks for the slices' pages as
    /// stored and decodes them here.
    pub as_stored: bool,
    /// How slice requests fail over between replicas.
    pub failover: FailoverSettings,
}

impl ScanOptions {
    /// A scan's options from the session's settings, over `partitions`
    /// output partitions.
    pub fn from_settings(settings: &crate::SieveConfig, partitions: usize) -> Result<Self> {
        Ok(Self {
            partitions,
            slices_in_flight: settings.slices_in_flight,
            join_settings: settings.join_filter_settings(),
            ipc_codec: IpcCodec::parse(&settings.ipc_compression)?,
            as_stored: settings.plain_scans_as_stored,
            failover: settings.failover_settings(),
        })
    }
}

/// A partial aggregation pushed into the fragment.
#[derive(Debug, Clone)]
pub struct PushedAggregate {
    /// The operators, leaf a `SliceInputExec` with the scan's shipped schema.
    pub plan: Arc<dyn ExecutionPlan>,
    /// For EXPLAIN: what is computed and the estimate that justified it.
    pub description: String,
}

impl SieveScanExec {
    /// Plan a scan of `table` shipping `projection` (indices into the table
    /// schema) of the rows satisfying `predicate` (over the table schema,
    /// already checked against the allow-list by the caller).
    pub fn try_new(
        catalog: Arc<ClusterCatalog>,
        table: Arc<ClusterTable>,
        traffic: Arc<Traffic>,
        projection: Vec<usize>,
        predicate: Option<Arc<dyn PhysicalExpr>>,
        options: ScanOptions,
    ) -> Result<Self> {
        let ScanOptions {
            partitions,
            slices_in_flight,
            join_settings,
            ipc_codec,
            as_stored,
            failover,
        } = options;
        let output_no_columns = projection.is_empty();
        let shipped = if output_no_columns {
            vec![smallest_column(&table.schema)]
        } else {
            projection
        };
        let fragment = sieve_fragment::Fragment {
            projection: shipped.clone(),
            predicate: predicate.clone(),
            aggregate: None,
        };
        let body = Arc::new(fragment.encode_body(&table.schema)?);
        let schema = if output_no_columns {
            Arc::new(Schema::empty())
        } else {
            Arc::new(table.schema.project(&shipped)?)
        };
        let filtered = match &predicate {
            Some(predicate) => filtered_statistics(&table.schema, &table.statistics, predicate)
                .unwrap_or_else(|_| table.statistics.clone().to_inexact()),
            None => table.statistics.clone(),
        };
        let units = Arc::new(work_units(&table, partitions));
        let partitions = partitions.clamp(1, units.len().max(1));
        Ok(Self {
            table,
            catalog,
            traffic,
            shipped,
            output_no_columns,
            predicate,
            filtered_statistics: Arc::new(filtered),
            rows_by_distinct: Arc::default(),
            aggregate: None,
            aggregate_complete: false,
            aggregate_note: None,
            star_join: None,
            join_notes: vec![],
            join_filters: vec![],
            key_filters: vec![],
            join_settings,
            join_filters_resolved: Arc::new(Mutex::new(vec![])),
            resolved_body: Arc::new(tokio::sync::OnceCell::new()),
            units,
            body,
            slices_in_flight: slices_in_flight.max(1),
            ipc_codec,
            as_stored,
            failover,
            parallelism: Arc::new(OnceLock::new()),
            early: EarlySlots::default(),
            choice: None,
            properties: properties(schema, partitions),
            metrics: ExecutionPlanMetricsSet::new(),
        })
    }

    /// This scan, reading the slices of `choice`'s planned pick (already
    /// its table), judging `choice` again when its join filters resolve.
    pub fn with_choice(self, choice: ScanChoice) -> Self {
        Self {
            choice: Some(Arc::new(choice)),
            ..self
        }
    }

    /// Whether the fragment only reads columns (no filter, aggregation or
    /// star join) and the session asks for such slices as stored. A join
    /// filter resolved at run time still makes it a fragment.
    fn nothing_to_push(&self) -> bool {
        self.as_stored
            && self.predicate.is_none()
            && self.aggregate.is_none()
            && self.star_join.is_none()
    }

    fn copy(&self) -> Self {
        Self {
            table: Arc::clone(&self.table),
            catalog: Arc::clone(&self.catalog),
            traffic: Arc::clone(&self.traffic),
            shipped: self.shipped.clone(),
            output_no_columns: self.output_no_columns,
            predicate: self.predicate.clone(),
            filtered_statistics: Arc::clone(&self.filtered_statistics),
            rows_by_distinct: Arc::clone(&self.rows_by_distinct),
            aggregate: self.aggregate.clone(),
            aggregate_complete: self.aggregate_complete,
            aggregate_note: self.aggregate_note.clone(),
            star_join: self.star_join.clone(),
            join_notes: self.join_notes.clone(),
            join_filters: self.join_filters.clone(),
            key_filters: self.key_filters.clone(),
            join_settings: self.join_settings.clone(),
            join_filters_resolved: Arc::new(Mutex::new(vec![])),
            resolved_body: Arc::new(tokio::sync::OnceCell::new()),
            units: Arc::clone(&self.units),
            body: Arc::clone(&self.body),
            slices_in_flight: self.slices_in_flight,
            ipc_codec: self.ipc_codec,
            as_stored: self.as_stored,
            failover: self.failover,
            parallelism: Arc::new(OnceLock::new()),
            early: EarlySlots::default(),
            choice: self.choice.clone(),
            properties: Arc::clone(&self.properties),
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }

    /// This scan with `aggregate` (a partial aggregation over this scan's
    /// output, leaf a `SliceInputExec`) pushed into its fragment. The new
    /// scan's output is the aggregation's partial states.
    pub fn with_aggregate(&self, aggregate: PushedAggregate) -> Result<Self> {
        let fragment = sieve_fragment::Fragment {
            projection: self.shipped.clone(),
            predicate: self.predicate.clone(),
            aggregate: Some(Arc::clone(&aggregate.plan)),
        };
        let body = Arc::new(fragment.encode_body(&self.table.schema)?);
        let partitions = self.properties.partitioning.partition_count();
        let schema = aggregate.plan.schema();
        Ok(Self {
            aggregate: Some(aggregate),
            aggregate_note: None,
            body,
            properties: properties(schema, partitions),
            ..self.copy()
        })
    }

    /// This scan with `aggregate`, the whole aggregation (mode single, and
    /// what runs above it) over this scan's output, leaf a `SliceInputExec`:
    /// the caller knows each slice's groups are complete. Each request is
    /// then a whole slice, never some of its row groups.
    pub fn with_complete_aggregate(&self, aggregate: PushedAggregate) -> Result<Self> {
        let units = Arc::new(whole_slices(&self.table));
        let partitions = self
            .properties
            .partitioning
            .partition_count()
            .clamp(1, units.len().max(1));
        let pushed = self.with_aggregate(aggregate)?;
        Ok(Self {
            aggregate_complete: true,
            units,
            properties: properties(pushed.schema(), partitions),
            ..pushed
        })
    }

    /// Whether the pushed aggregation is complete (see
    /// [`Self::with_complete_aggregate`]).
    pub fn aggregate_complete(&self) -> bool {
        self.aggregate_complete
    }

    /// This scan with `star` (a partial aggregation over hash joins over this
    /// scan's output) pushed into its fragment; the body is encoded at
    /// execution, once the build sides' rows are collected. The new scan's
    /// output is the aggregation's partial states.
    pub fn with_star_join(&self, star: PushedStarJoin) -> Result<Self> {
        let partitions = self.properties.partitioning.partition_count();
        let schema = star.plan.schema();
        Ok(Self {
            aggregate: Some(PushedAggregate {
                plan: Arc::clone(&star.plan),
                description: star.description.clone(),
            }),
            aggregate_note: None,
            star_join: Some(star),
            properties: properties(schema, partitions),
            ..self.copy()
        })
    }

    /// A copy of this scan (fresh metrics and per-execution state).
    pub(crate) fn clone_without_metrics(&self) -> Self {
        self.copy()
    }

    /// The pushed star join, if any.
    pub fn star_join(&self) -> Option<&PushedStarJoin> {
        self.star_join.as_ref()
    }

    /// This scan without the dynamic filter `expression_id` (its join runs
    /// inside this scan's star join).
    pub(crate) fn without_join_filter_silently(&self, expression_id: u64) -> Self {
        Self {
            join_filters: self
                .join_filters
                .iter()
                .filter(|slot| !contains_expression_id(&slot.filter, expression_id))
                .cloned()
                .collect(),
            ..self.copy()
        }
    }

    /// This scan without the key filters of the join whose build keys
    /// `keys` collects (it runs inside this scan's star join).
    pub(crate) fn without_key_filters_from(&self, keys: &Arc<BuildKeys>) -> Self {
        Self {
            key_filters: self
                .key_filters
                .iter()
                .filter(|slot| !Arc::ptr_eq(&slot.keys, keys))
                .cloned()
                .collect(),
            ..self.copy()
        }
    }

    /// This scan with a note on why an aggregation was not pushed.
    pub fn with_aggregate_note(&self, note: String) -> Self {
        Self {
            aggregate_note: Some(note),
            ..self.copy()
        }
    }

    /// This scan, told that the dynamic filter with `expression_id` comes
    /// from the hash join whose build side is `source`: it will wait for it,
    /// and take the key values from `keys`.
    pub fn with_join_filter_source(
        &self,
        expression_id: u64,
        source: &str,
        keys: Arc<BuildKeys>,
    ) -> Self {
        let mut join_filters = self.join_filters.clone();
        for slot in &mut join_filters {
            if contains_expression_id(&slot.filter, expression_id) {
                slot.source = Some(source.to_string());
                slot.keys = Some(Arc::clone(&keys));
            }
        }
        Self {
            join_filters,
            ..self.copy()
        }
    }

    /// This scan, also filtered by `slot`'s build keys (a join further up;
    /// see [`KeyFilterSlot`]). Not for a scan with a pushed aggregation.
    pub fn with_key_filter(&self, slot: KeyFilterSlot) -> Self {
        let mut key_filters = self.key_filters.clone();
        // A plan optimized twice offers the same join's filter again.
        if !key_filters.iter().any(|held| {
            Arc::ptr_eq(&held.keys, &slot.keys)
                && held.position == slot.position
                && held.column == slot.column
        }) {
            key_filters.push(slot);
        }
        Self {
            key_filters,
            ..self.copy()
        }
    }

    /// This scan with `notes` for EXPLAIN (why part of its filter stays
    /// on the compute node).
    pub fn clone_with_notes(&self, notes: &[String]) -> Self {
        let mut join_notes = self.join_notes.clone();
        join_notes.extend(notes.iter().cloned());
        Self {
            join_notes,
            ..self.copy()
        }
    }

    /// This scan without the dynamic filter `expression_id`, and a note for
    /// EXPLAIN saying why. The join then has no consumer for its filter and
    /// does not compute it.
    pub fn without_join_filter(&self, expression_id: u64, note: String) -> Self {
        let join_filters = self
            .join_filters
            .iter()
            .filter(|slot| !contains_expression_id(&slot.filter, expression_id))
            .cloned()
            .collect();
        let mut join_notes = self.join_notes.clone();
        join_notes.push(note);
        Self {
            join_filters,
            join_notes,
            ..self.copy()
        }
    }

    /// An upper bound on the distinct values the probe key of the dynamic
    /// filter `expression_id` takes in this table, from the slices' distinct
    /// counts and, for integers, the key's range. `None` if unknown or if the
    /// join has several keys.
    pub fn join_key_distinct_bound(&self, expression_id: u64) -> Option<u64> {
        let slot = self
            .join_filters
            .iter()
            .find(|slot| contains_expression_id(&slot.filter, expression_id))?;
        let mut keys = Vec::new();
        let _ = slot.filter.apply(|node| {
            if node.downcast_ref::<DynamicFilterPhysicalExpr>().is_some() {
                keys.extend(node.children().into_iter().cloned());
                return Ok(TreeNodeRecursion::Stop);
            }
            Ok(TreeNodeRecursion::Continue)
        });
        let [key] = &keys[..] else {
            return None;
        };
        let index = key
            .downcast_ref::<datafusion::physical_expr::expressions::Column>()?
            .index();
        self.column_distinct_bound(index)
    }

    /// An upper bound on the distinct values scan output column `index`
    /// takes in this table (before any filter), from the slices' distinct
    /// counts and, for integers, the column's range.
    pub fn column_distinct_bound(&self, index: usize) -> Option<u64> {
        let column = *self.shipped.get(index)?;
        let summed: Option<u64> = self
            .table
            .slices
            .iter()
            .map(|slice| slice.summary.columns.get(column)?.distinct_count)
            .sum();
        let statistics = self.table.statistics.column_statistics.get(column)?;
        let span = match (
            statistics.min_value.get_value(),
            statistics.max_value.get_value(),
        ) {
            (Some(ScalarValue::Int64(Some(low))), Some(ScalarValue::Int64(Some(high)))) => {
                u64::try_from(i128::from(*high) - i128::from(*low) + 1).ok()
            }
            (Some(ScalarValue::Int32(Some(low))), Some(ScalarValue::Int32(Some(high)))) => {
                u64::try_from(i64::from(*high) - i64::from(*low) + 1).ok()
            }
            _ => None,
        };
        match (summed, span) {
            (Some(summed), Some(span)) => Some(summed.min(span)),
            (bound, None) | (None, bound) => bound,
        }
    }

    /// Whether the scan holds any dynamic filter from above.
    pub fn has_join_filters(&self) -> bool {
        !self.join_filters.is_empty() || !self.key_filters.is_empty()
    }

    /// Nodes holding a copy of a slice this scan asks for: where its join
    /// filters are registered.
    fn registration_nodes(&self) -> Vec<usize> {
        nodes_of(&self.units)
    }

    /// Whether the scan's requests wait for a join's build side.
    pub fn waits_for_join_filters(&self) -> bool {
        self.join_filters.iter().any(|slot| slot.source.is_some())
            || !self.key_filters.is_empty()
            || self.star_join.is_some()
    }

    /// Rows estimated to match the pushed predicate (before any pushed
    /// aggregation), if the statistics say.
    pub fn estimated_rows(&self) -> Option<usize> {
        self.filtered_statistics.num_rows.get_value().copied()
    }

    /// Rows estimated to match the pushed predicate, each equality to a
    /// constant keeping 1 / its column's distinct values
    /// ([`crate::estimate::rows_with_distinct_values`]); the table's rows
    /// without a predicate.
    pub(crate) fn estimated_rows_by_distinct(&self) -> Option<f64> {
        match &self.predicate {
            None => self.estimated_rows().map(|rows| rows as f64),
            Some(predicate) => *self
                .rows_by_distinct
                .get_or_init(|| crate::estimate::rows_with_distinct_values(&self.table, predicate)),
        }
    }

    /// Start every partition now, each buffering up to `buffer_bytes` of
    /// batches until `execute` takes it (see `early_start.rs`).
    pub(crate) fn start_early(&self, context: Arc<TaskContext>, buffer_bytes: usize) -> Result<()> {
        let partitions = self.properties.partitioning.partition_count();
        let mut streams = Vec::with_capacity(partitions);
        for partition in 0..partitions {
            let stream = self.execute_now(partition, Arc::clone(&context))?;
            MetricBuilder::new(&self.metrics)
                .counter("partitions_started_early", partition)
                .add(1);
            streams.push(Some(buffer_ahead(stream, buffer_bytes)));
        }
        self.early.fill(streams);
        Ok(())
    }

    /// Partitions started early whose streams nothing has taken yet.
    pub fn partitions_waiting_early(&self) -> usize {
        self.early.waiting()
    }

    /// Drop the partitions started early and not taken, cancelling them.
    pub(crate) fn clear_early(&self) {
        self.early.clear();
    }

    /// The output columns the join filter holding dynamic filter
    /// `expression_id` reads.
    pub fn join_filter_columns(&self, expression_id: u64) -> Vec<usize> {
        let mut columns: Vec<usize> = self
            .join_filters
            .iter()
            .filter(|slot| contains_expression_id(&slot.filter, expression_id))
            .flat_map(|slot| datafusion::physical_expr::utils::collect_columns(&slot.filter))
            .map(|column| column.index())
            .collect();
        columns.sort_unstable();
        columns.dedup();
        columns
    }

    /// Whether any held dynamic filter has `expression_id`.
    pub fn holds_expression_id(&self, expression_id: u64) -> bool {
        self.join_filters
            .iter()
            .any(|slot| contains_expression_id(&slot.filter, expression_id))
    }

    /// The pushed aggregation, if any.
    pub fn aggregate(&self) -> Option<&PushedAggregate> {
        self.aggregate.as_ref()
    }

    /// The table scanned.
    pub fn table(&self) -> &Arc<ClusterTable> {
        &self.table
    }

    /// Table columns shipped, in output order (before any aggregation).
    pub fn shipped_columns(&self) -> &[usize] {
        &self.shipped
    }

    /// Whether the plan above wants no columns (only row counts).
    pub fn outputs_no_columns(&self) -> bool {
        self.output_no_columns
    }

    /// Schema of the filtered, projected rows (the input of a pushed aggregation).
    pub fn row_schema(&self) -> SchemaRef {
        if self.output_no_columns {
            Arc::new(Schema::empty())
        } else {
            Arc::new(
                self.table
                    .schema
                    .project(&self.shipped)
                    .expect("shipped columns exist"),
            )
        }
    }

    /// The pushed predicate.
    pub fn predicate(&self) -> Option<&Arc<dyn PhysicalExpr>> {
        self.predicate.as_ref()
    }

    /// Names of the pushed (shipped) columns.
    pub fn pushed_columns(&self) -> Vec<String> {
        self.shipped
            .iter()
            .map(|&index| self.table.schema.field(index).name().clone())
            .collect()
    }
}

/// Runs raw slices' fragment on this node.
#[derive(Debug, Clone)]
struct RawCompletion {
    schema: SchemaRef,
    context: Arc<TaskContext>,
    body: Arc<OnceLock<std::result::Result<Arc<DecodedBody>, String>>>,
}

impl RawCompletion {
    fn run(
        &self,
        pages: RawPages,
        body: &[u8],
        join_filter: Option<Arc<dyn PhysicalExpr>>,
        deleted: Option<&Vec<u8>>,
    ) -> Result<SendableRecordBatchStream> {
        let mut decoded = self
            .body
            .get_or_init(|| {
                DecodedBody::decode(body, &self.schema, &self.context)
                    .map(Arc::new)
                    .map_err(|error| error.to_string())
            })
            .clone()
            .map_err(DataFusionError::Execution)?;
        // The registered join filter, applied as the storage node would.
        if let Some(filter) = join_filter {
            decoded = Arc::new(decoded.with_join_filter(filter));
        }
        let batch_rows = self.context.session_config().batch_size();
        let deleted = deleted
            .map(|bytes| sieve_fragment::decode_deletions(bytes))
            .transpose()?;
        complete_raw(
            pages,
            &decoded,
            &self.schema,
            Arc::clone(&self.context),
            batch_rows,
            deleted.as_ref(),
            false,
        )
    }
}

/// The fragment body of a scan's slice requests, and the join filter they
/// name, once the join filters are resolved.
#[derive(Debug)]
struct ResolvedBody {
    /// The encoded body (without join filters).
    body: Arc<Vec<u8>>,
    join_filter: Option<RegisteredJoinFilter>,
    /// Key bitmaps sent in windows, one with each request.
    join_filter_parts: Option<Arc<JoinFilterParts>>,
    /// Every join filter, whole: what a raw slice is completed with.
    join_filter_whole: Option<Arc<dyn PhysicalExpr>>,
    /// A star join whose build rows did not fit the fragment: its
    /// operators, run here over the rows the nodes ship.
    local: Option<Arc<dyn ExecutionPlan>>,
    /// The body, registered on the nodes that took it: requests name it
    /// instead of carrying it.
    registered_body: Option<Arc<RegisteredBody>>,
    /// What the scan reads, judged with its join filters: requests go to
    /// these units instead of the planned ones.
    reading: Option<Arc<(Reading, Vec<WorkUnit>)>>,
}

/// Largest fragment body sent inside every slice request; a larger one (a
/// star join's, with its dimensions' rows) is registered on each node once
/// and named by id.
pub const BODY_INLINE_BYTES_MAX: usize = 16 * 1024;

/// A fragment body registered on storage nodes for one execution of a
/// scan; released on every node when the scan's plan is dropped (nodes
/// also drop it once idle).
struct RegisteredBody {
    id: [u8; JOIN_FILTER_ID_BYTES],
    nodes: Vec<StorageClient>,
    traffic: Arc<Traffic>,
    timeout: Duration,
}

impl fmt::Debug for RegisteredBody {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("RegisteredBody")
            .field("nodes", &self.nodes.len())
            .finish_non_exhaustive()
    }
}

impl Drop for RegisteredBody {
    fn drop(&mut self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        for client in self.nodes.drain(..) {
            let (id, timeout) = (self.id, self.timeout);
            self.traffic.add_sent(id.len() as u64);
            runtime.spawn(async move {
                if let Err(error) = client.release_fragment_body(&id, timeout).await {
                    log::debug!("{}", error.strip_backtrace());
                }
            });
        }
    }
}

/// Register `body` of `table` on `nodes` at once; the registration (None
/// if no node took it) and a line for EXPLAIN ANALYZE. A node that missed
/// it gets the body inline with each request.
async fn register_body(
    catalog: &ClusterCatalog,
    traffic: &Arc<Traffic>,
    table: &str,
    body: &[u8],
    nodes: &[usize],
    timeout: Duration,
) -> (Option<RegisteredBody>, String) {
    let (registration, id) = match sieve_fragment::FragmentBodyRegistration::encode(table, body) {
        Ok(encoded) => encoded,
        Err(error) => {
            return (
                None,
                format!("body sent with each request: {}", error.strip_backtrace()),
            )
        }
    };
    let sent = registration.len() as u64;
    let registered = futures::future::join_all(nodes.iter().map(|&node| {
        let client = catalog.clients[node].clone();
        let registration = registration.clone();
        traffic.add_sent(sent);
        async move {
            let result = client
                .register_fragment_body(registration, &id, timeout)
                .await;
            (client, result)
        }
    }))
    .await;
    let mut held = Vec::new();
    for (client, result) in registered {
        match result {
            Ok(()) => held.push(client),
            Err(error) => log::warn!("{}", error.strip_backtrace()),
        }
    }
    let note = format!(
        "body registered on {} of {} nodes, {sent} bytes each, compressed",
        held.len(),
        nodes.len()
    );
    let registered = (!held.is_empty()).then(|| RegisteredBody {
        id,
        nodes: held,
        traffic: Arc::clone(traffic),
        timeout,
    });
    (registered, note)
}

/// A join filter registered on the storage nodes for one execution of a
/// scan; released on every node when the scan's plan is dropped (nodes
/// also drop it once idle, `sieve_storage::JOIN_FILTER_IDLE_TIMEOUT`).
struct RegisteredJoinFilter {
    id: [u8; JOIN_FILTER_ID_BYTES],
    /// Nodes that accepted it.
    nodes: Vec<StorageClient>,
    traffic: Arc<Traffic>,
    timeout: Duration,
}

impl fmt::Debug for RegisteredJoinFilter {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("RegisteredJoinFilter")
            .field("nodes", &self.nodes.len())
            .finish_non_exhaustive()
    }
}

impl Drop for RegisteredJoinFilter {
    fn drop(&mut self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        for client in self.nodes.drain(..) {
            let (id, timeout) = (self.id, self.timeout);
            self.traffic.add_sent(id.len() as u64);
            runtime.spawn(async move {
                if let Err(error) = client.release_join_filter(&id, timeout).await {
                    log::debug!("{}", error.strip_backtrace());
                }
            });
        }
    }
}

/// Nodes holding a copy of a slice of `units`.
fn nodes_of(units: &[WorkUnit]) -> Vec<usize> {
    let mut nodes: Vec<usize> = units
        .iter()
        .flat_map(|unit| unit.slice.replicas.iter().copied())
        .collect();
    nodes.sort_unstable();
    nodes.dedup();
    nodes
}

/// One slice request: a slice, or some of its row groups.
#[derive(Debug, Clone)]
struct WorkUnit {
    slice: ClusterSlice,
    /// Row groups to process; empty means all.
    row_groups: Vec<u32>,
}

/// Requests for a scan over `partitions` partitions: one per slice, and
/// slices split by row groups when there are fewer than two per partition,
/// so that a table of one large slice still keeps every core busy.
fn work_units(table: &ClusterTable, partitions: usize) -> Vec<WorkUnit> {
    let target = partitions.max(1) * 2;
    let per_slice = target.div_ceil(table.slices.len().max(1));
    let mut units = Vec::new();
    for slice in &table.slices {
        let groups = slice.summary.row_groups as usize;
        let pieces = per_slice.min(groups).max(1);
        if pieces == 1 {
            units.push(WorkUnit {
                slice: slice.clone(),
                row_groups: vec![],
            });
            continue;
        }
        for piece in 0..pieces {
            let (start, end) = (piece * groups / pieces, (piece + 1) * groups / pieces);
            units.push(WorkUnit {
                slice: slice.clone(),
                row_groups: (start as u32..end as u32).collect(),
            });
        }
    }
    units
}

/// One request per slice, whatever its row groups.
fn whole_slices(table: &ClusterTable) -> Vec<WorkUnit> {
    table
        .slices
        .iter()
        .map(|slice| WorkUnit {
            slice: slice.clone(),
            row_groups: vec![],
        })
        .collect()
}

fn properties(schema: SchemaRef, partitions: usize) -> Arc<PlanProperties> {
    Arc::new(PlanProperties::new(
        EquivalenceProperties::new(schema),
        Partitioning::UnknownPartitioning(partitions),
        EmissionType::Incremental,
        Boundedness::Bounded,
    ))
}

fn contains_expression_id(expr: &Arc<dyn PhysicalExpr>, expression_id: u64) -> bool {
    let mut found = false;
    let _ = expr.apply(|node| {
        if node.expression_id() == Some(expression_id) {
            found = true;
            return Ok(TreeNodeRecursion::Stop);
        }
        Ok(TreeNodeRecursion::Continue)
    });
    found
}

fn contains_dynamic_filter(expr: &Arc<dyn PhysicalExpr>) -> bool {
    let mut found = false;
    let _ = expr.apply(|node| {
        if node.downcast_ref::<DynamicFilterPhysicalExpr>().is_some() {
            found = true;
            return Ok(TreeNodeRecursion::Stop);
        }
        Ok(TreeNodeRecursion::Continue)
    });
    found
}

/// The narrowest column by fixed width, used when no column is needed.
fn smallest_column(schema: &SchemaRef) -> usize {
    (0..schema.fields().len())
        .min_by_key(|&index| {
            schema
                .field(index)
                .data_type()
                .primitive_width()
                .unwrap_or(usize::MAX)
        })
        .unwrap_or(0)
}

impl DisplayAs for SieveScanExec {
    fn fmt_as(&self, format: DisplayFormatType, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "SieveScanExec: table={}, slices={}",
            self.table.name,
            self.table.slices.len()
        )?;
        if let Some(predicate) = &self.predicate {
            write!(formatter, ", pushed filter: {predicate}")?;
        }
        write!(
            formatter,
            ", pushed columns: [{}]",
            self.pushed_columns().join(", ")
        )?;
        match (&self.star_join, &self.aggregate) {
            (Some(star), _) => write!(formatter, ", {}", star.description)?,
            (None, Some(aggregate)) => {
                write!(formatter, ", pushed aggregate: {}", aggregate.description)?
            }
            (None, None) => {}
        }
        if let Some(note) = &self.aggregate_note {
            write!(formatter, ", aggregate not pushed: {note}")?;
        }
        if let Some(choice) = &self.choice {
            if !choice.planned.is_empty() {
                write!(formatter, ", {}", choice.planned)?;
            }
        }
        if self.nothing_to_push() && self.join_filters.is_empty() && self.key_filters.is_empty() {
            write!(formatter, ", pages as stored (nothing to push)")?;
        }
        for note in &self.join_notes {
            write!(formatter, ", {note}")?;
        }
        let resolved = self
            .join_filters_resolved
            .lock()
            .expect("never poisoned")
            .clone();
        if resolved.is_empty() {
            for slot in &self.join_filters {
                if let Some(source) = &slot.source {
                    write!(formatter, ", join filter from {source}: pending")?;
                }
            }
            for slot in &self.key_filters {
                write!(
                    formatter,
                    ", join filter from {} (through joins below it): pending",
                    slot.source
                )?;
            }
        } else {
            for description in resolved {
                write!(formatter, ", {description}")?;
            }
        }
        if matches!(format, DisplayFormatType::Verbose) {
            write!(formatter, ", fragment bytes={}", self.body.len())?;
        }
        Ok(())
    }
}

impl ExecutionPlan for SieveScanExec {
    fn name(&self) -> &str {
        "SieveScanExec"
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        if let Some(predicate) = &self.predicate {
            if f(predicate)? == TreeNodeRecursion::Stop {
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        for slot in &self.join_filters {
            if f(&slot.filter)? == TreeNodeRecursion::Stop {
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        Ok(TreeNodeRecursion::Continue)
    }

    fn handle_child_pushdown_result(
        &self,
        phase: FilterPushdownPhase,
        child_pushdown_result: ChildPushdownResult,
        _config: &ConfigOptions,
    ) -> Result<FilterPushdownPropagation<Arc<dyn ExecutionPlan>>> {
        // Every filter stays the parent's to enforce (`No`); dynamic ones are
        // also kept here, to be resolved and applied on the storage nodes.
        let filters = child_pushdown_result.parent_filters;
        let verdicts = vec![PushedDown::No; filters.len()];
        let accept = phase == FilterPushdownPhase::Post
            && self.join_settings.enabled
            && self.aggregate.is_none();
        let mut join_filters = self.join_filters.clone();
        if accept {
            for result in filters {
                if contains_dynamic_filter(&result.filter) {
                    join_filters.push(JoinFilterSlot {
                        filter: result.filter,
                        source: None,
                        keys: None,
                    });
                }
            }
        }
        let mut propagation = FilterPushdownPropagation::with_parent_pushdown_result(verdicts);
        if join_filters.len() != self.join_filters.len() {
            propagation = propagation.with_updated_node(Arc::new(Self {
                join_filters,
                ..self.copy()
            }) as Arc<dyn ExecutionPlan>);
        }
        Ok(propagation)
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        // A star join's build sides, run before any slice request.
        self.star_join
            .as_ref()
            .map(|star| star.builds.iter().collect())
            .unwrap_or_default()
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let builds = self.star_join.as_ref().map_or(0, |star| star.builds.len());
        if children.len() != builds {
            return internal_err!(
                "SieveScanExec has {builds} children (a star join's build sides), not {}",
                children.len()
            );
        }
        let Some(star) = &self.star_join else {
            return Ok(self);
        };
        let mut star = star.clone();
        star.builds = children;
        Ok(Arc::new(Self {
            star_join: Some(star),
            metrics: self.metrics.clone(),
            ..self.copy()
        }))
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    /// A fresh scan for another execution of the same plan (DataFusion runs
    /// a recursive CTE's term again for every iteration, resetting it
    /// first): join filters, early starts and parallelism gauges are
    /// resolved afresh; metrics keep adding up on the same set. A reset
    /// `HashJoinExec` has no dynamic filter any more
    /// (`HashJoinExecBuilder::reset_state`), so the filters this scan would
    /// wait for would never complete: they are dropped, and the scan runs
    /// without them instead of waiting `sieve.join_filter_wait_ms` for each.
    fn reset_state(self: Arc<Self>) -> Result<Arc<dyn ExecutionPlan>> {
        let join_filters = self
            .join_filters
            .iter()
            .filter(|slot| slot.source.is_none())
            .cloned()
            .collect();
        let mut join_notes = self.join_notes.clone();
        let sources = self
            .join_filters
            .iter()
            .filter_map(|slot| slot.source.as_ref())
            .chain(self.key_filters.iter().map(|slot| &slot.source));
        for source in sources {
            join_notes.push(format!(
                "join filter from {source}: none (the plan was reset to run again, \
                 and its join with it)"
            ));
        }
        Ok(Arc::new(Self {
            join_filters,
            key_filters: vec![],
            join_notes,
            metrics: self.metrics.clone(),
            ..self.copy()
        }))
    }

    fn partition_statistics(&self, partition: Option<usize>) -> Result<Arc<Statistics>> {
        if self.aggregate.is_some() {
            return Ok(Arc::new(Statistics::new_unknown(&self.schema())));
        }
        let mut statistics = self.filtered_statistics.as_ref().clone();
        if let Some(partition) = partition {
            // Slices are dealt round robin: this partition's share of the rows.
            let partitions = self.properties.partitioning.partition_count();
            let share = self
                .units
                .iter()
                .skip(partition)
                .step_by(partitions)
                .count();
            let fraction = share as f64 / self.units.len().max(1) as f64;
            statistics = statistics.to_inexact();
            statistics.num_rows = statistics.num_rows.with_estimated_selectivity(fraction);
            statistics.total_byte_size = statistics
                .total_byte_size
                .with_estimated_selectivity(fraction);
            for column in &mut statistics.column_statistics {
                column.byte_size = column.byte_size.with_estimated_selectivity(fraction);
            }
        }
        if self.output_no_columns {
            statistics.column_statistics.clear();
        } else {
            statistics = statistics.project(Some(&self.shipped));
            // What the scan yields is the shipped columns: their Arrow
            // size where every one is known (a hash join builds on the
            // smaller side by it), not the table's file bytes. The
            // per-column sizes stay here: DataFusion 55 gives a semi or anti
            // join's output a byte size from them (where it has none
            // otherwise), assuming every outer row passes when it cannot
            // estimate, and that output then looked larger than a fact
            // table (TPC-H Q21 at SF 10 built its anti join on lineitem).
            if let Some(bytes) = statistics
                .column_statistics
                .iter()
                .map(|column| column.byte_size.get_value().copied())
                .sum::<Option<usize>>()
            {
                statistics.total_byte_size = datafusion::common::stats::Precision::Inexact(bytes);
            }
            for column in &mut statistics.column_statistics {
                column.byte_size = datafusion::common::stats::Precision::Absent;
            }
        }
        Ok(Arc::new(statistics))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        if let Some(stream) = self.early.take(partition) {
            return Ok(stream);
        }
        self.execute_now(partition, context)
    }
}

impl SieveScanExec {
    /// Partition `partition`'s stream, its requests sent when first polled.
    fn execute_now(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let partitions = self.properties.partitioning.partition_count();
        if partition >= partitions {
            return internal_err!(
                "SieveScanExec has {partitions} partitions, asked for {partition}"
            );
        }
        let builder = || MetricBuilder::new(&self.metrics);
        let output_rows = builder().output_rows(partition);
        let bytes_shipped = builder().counter("bytes_shipped", partition);
        let bytes_sent = builder().counter("bytes_sent", partition);
        let bytes_read = builder().counter("storage_bytes_read", partition);
        let slices_done = builder().counter("slices", partition);
        let pages_considered = builder().counter("pages_considered", partition);
        let pages_skipped_statistics = builder().counter("pages_skipped_statistics", partition);
        let pages_skipped_bloom = builder().counter("pages_skipped_bloom_filter", partition);
        let pages_skipped_page_index = builder().counter("pages_skipped_page_index", partition);
        let pages_read = builder().counter("pages_read", partition);
        let rows_scanned = builder().counter("storage_rows_scanned", partition);
        let storage_cpu = builder().subset_time("storage_cpu_time", partition);
        let slices_raw = builder().counter("slices_raw", partition);
        let slices_as_stored = builder().counter("slices_as_stored", partition);
        let bytes_raw = builder().counter("bytes_raw", partition);
        let slice_retries = builder().counter("slice_retries", partition);
        let raw_completion = builder().subset_time("raw_completion_time", partition);
        let parallelism = Arc::clone(self.parallelism.get_or_init(|| {
            let gauge = |name: &'static str| builder().global_gauge(name);
            let parallelism = Parallelism {
                partitions: gauge("partitions"),
                requests_in_flight_max: gauge("requests_in_flight_max"),
                nodes_in_flight_max: gauge("nodes_in_flight_max"),
                storage_slices_running_max: gauge("storage_slices_running_max"),
                requests: AtomicUsize::new(0),
                per_node: (0..self.catalog.clients.len())
                    .map(|_| AtomicUsize::new(0))
                    .collect(),
                nodes: AtomicUsize::new(0),
            };
            parallelism.partitions.set(partitions);
            Arc::new(parallelism)
        }));

        let rows_aggregated = builder().counter("storage_rows_aggregated", partition);
        let units: Vec<WorkUnit> = self
            .units
            .iter()
            .skip(partition)
            .step_by(partitions)
            .cloned()
            .collect();
        let catalog = Arc::clone(&self.catalog);
        let traffic = Arc::clone(&self.traffic);
        let table_name = self.table.name.clone();
        let schema = self.schema();
        let output_no_columns = self.output_no_columns && self.aggregate.is_none();
        let rewrap = self.aggregate.is_some();
        let slices_in_flight = self.slices_in_flight;
        let ipc_codec = self.ipc_codec;
        // Nothing for the nodes to do but read columns: decoding and
        // re-encoding them there costs their CPU and ships more bytes than
        // the compressed pages, so the pages come as stored (unless a join
        // filter turns up).
        let nothing_to_push = self.nothing_to_push();

        // The fragment body: the planned one, plus whatever the join filters
        // resolve to once their build sides are complete.
        let base_body = Arc::clone(&self.body);
        let join_filters = self.join_filters.clone();
        let key_filters = self.key_filters.clone();
        let join_settings = self.join_settings.clone();
        let resolved_out = Arc::clone(&self.join_filters_resolved);
        let table = Arc::clone(&self.table);
        let shipped = self.shipped.clone();
        let predicate = self.predicate.clone();
        let resolved_body = Arc::clone(&self.resolved_body);
        let distinct_bounds: Vec<Option<u64>> = (0..self.shipped.len())
            .map(|index| self.column_distinct_bound(index))
            .collect();
        let waits = self.waits_for_join_filters();
        let star_join = self.star_join.clone();
        // A complete aggregation's slices were proven to hold whole groups
        // of the slices planned: the scan keeps to them.
        let choice = self.choice.clone().filter(|_| !self.aggregate_complete);
        let build_context = Arc::clone(&context);
        let local_context = Arc::clone(&context);
        let registration_nodes = self.registration_nodes();
        let registration_timeout = self.failover.timeout;
        let filter_bytes = builder().counter("join_filter_bytes_sent", partition);
        let (part_bytes, traffic_parts) = (filter_bytes.clone(), Arc::clone(&traffic));
        let all_units = Arc::clone(&self.units);
        let body = {
            let (catalog, traffic) = (Arc::clone(&catalog), Arc::clone(&traffic));
            async move {
                let plain = |body: &Arc<Vec<u8>>| {
                    Arc::new(ResolvedBody {
                        body: Arc::clone(body),
                        join_filter: None,
                        join_filter_parts: None,
                        join_filter_whole: None,
                        local: None,
                        registered_body: None,
                        reading: None,
                    })
                };
                if !waits {
                    return Ok(plain(&base_body));
                }
                // The first partition to get here resolves; the others wait for it.
                let resolved = resolved_body
                    .get_or_init(|| async move {
                        let resolve = async {
                            // A star join: its build sides' rows go into the
                            // fragment, with their key ranges.
                            let mut descriptions_first = Vec::new();
                            let mut local = None;
                            let mut to_register = None;
                            let (base_body, predicate) = match &star_join {
                                None => (base_body, predicate),
                                Some(star) => {
                                    let mut rows = Vec::with_capacity(star.builds.len());
                                    let (mut build_rows, mut build_bytes) = (0, 0);
                                    for build in &star.builds {
                                        let batches = datafusion::physical_plan::collect(
                                            Arc::clone(build),
                                            Arc::clone(&build_context),
                                        )
                                        .await?;
                                        build_rows += batches
                                            .iter()
                                            .map(RecordBatch::num_rows)
                                            .sum::<usize>();
                                        build_bytes += batches
                                            .iter()
                                            .map(RecordBatch::get_array_memory_size)
                                            .sum::<usize>();
                                        rows.push(batches);
                                    }
                                    let (plan, ranges) = crate::star_join::with_build_rows(
                                        star,
                                        &table.schema,
                                        rows,
                                    )?;
                                    let predicate = (predicate.is_some() || !ranges.is_empty())
                                        .then(|| {
                                            physical_conjunction(
                                                predicate.iter().cloned().chain(ranges),
                                            )
                                        });
                                    let pushed = sieve_fragment::Fragment {
                                        projection: shipped.clone(),
                                        predicate: predicate.clone(),
                                        aggregate: Some(Arc::clone(&plan)),
                                    }
                                    .encode_body(&table.schema);
                                    let body = match pushed {
                                        Ok(body) => {
                                            descriptions_first.push(format!(
                                                "star join: {build_rows} build rows ({build_bytes} bytes) in a {}-byte fragment",
                                                body.len()
                                            ));
                                            body
                                        }
                                        // The build rows do not fit a
                                        // fragment (the estimate was low):
                                        // the nodes filter, the joins and
                                        // the partial aggregation run here.
                                        Err(error) => {
                                            let body = sieve_fragment::Fragment {
                                                projection: shipped.clone(),
                                                predicate: predicate.clone(),
                                                aggregate: None,
                                            }
                                            .encode_body(&table.schema)?;
                                            descriptions_first.push(format!(
                                                "star join run here: {build_rows} build rows ({build_bytes} bytes), {}",
                                                error.strip_backtrace()
                                            ));
                                            local = Some(plan);
                                            body
                                        }
                                    };
                                    // Sent once per node, named in each
                                    // request: the star join's fragment,
                                    // or the fallback's (its key ranges and
                                    // bitmaps alone may be large).
                                    if body.len() > BODY_INLINE_BYTES_MAX {
                                        to_register = Some(body.clone());
                                    }
                                    (Arc::new(body), predicate)
                                }
                            };
                            let probe = ProbeColumns {
                                shipped: &shipped,
                                table_schema: &table.schema,
                                distinct_bounds: &distinct_bounds,
                            };
                            let (conjuncts, descriptions) =
                                resolve(&join_filters, &key_filters, &join_settings, probe).await?;
                            // With the join filters' key ranges known: the
                            // table's slices or a sorted copy's, and only
                            // those that may match.
                            let reading = choice.as_ref().map(|choice| {
                                let judged = (predicate.is_some() || !conjuncts.is_empty())
                                    .then(|| {
                                        physical_conjunction(
                                            predicate.iter().cloned().chain(conjuncts.iter().cloned()),
                                        )
                                    });
                                let reading = crate::copies::choose(
                                    &choice.table,
                                    &choice.copies,
                                    judged.as_ref(),
                                    choice.prune,
                                );
                                if reading.copy.is_some()
                                    || reading.table.slices.len() < choice.table.slices.len()
                                {
                                    descriptions_first
                                        .push(reading.describe(choice.table.slices.len()));
                                }
                                let units = work_units(&reading.table, partitions);
                                Arc::new((reading, units))
                            });
                            let (table, registration_nodes) = match &reading {
                                Some(reading) => (Arc::clone(&reading.0.table), nodes_of(&reading.1)),
                                None => (table, registration_nodes),
                            };
                            let mut registered_body = None;
                            if let Some(body) = to_register {
                                let (registered, note) = register_body(
                                    &catalog,
                                    &traffic,
                                    &table.name,
                                    &body,
                                    &registration_nodes,
                                    registration_timeout,
                                )
                                .await;
                                registered_body = registered;
                                descriptions_first.push(note);
                            }
                            let mut descriptions: Vec<String> =
                                descriptions_first.into_iter().chain(descriptions).collect();
                            let note = |descriptions: Vec<String>| {
                                *resolved_out.lock().expect("never poisoned") = descriptions;
                            };
                            let registered_body = registered_body.map(Arc::new);
                            let plain = |body: &Arc<Vec<u8>>| {
                                Arc::new(ResolvedBody {
                                    body: Arc::clone(body),
                                    join_filter: None,
                                    join_filter_parts: None,
                                    join_filter_whole: None,
                                    local: local.clone(),
                                    registered_body: registered_body.clone(),
                                    reading: reading.clone(),
                                })
                            };
                            if conjuncts.is_empty() {
                                note(descriptions);
                                return Ok(plain(&base_body));
                            }
                            let filter = physical_conjunction(conjuncts);
                            // Join filters are an optimisation: one that would
                            // take the node's predicate past the fragment
                            // limits, or a registration past its bound, is
                            // not pushed.
                            let combined = physical_conjunction(
                                predicate.iter().cloned().chain([Arc::clone(&filter)]),
                            );
                            if let Some(reason) =
                                sieve_fragment::ExpressionShape::of(&combined).exceeded()
                            {
                                note(vec![format!("join filters not pushed: {reason}")]);
                                return Ok(plain(&base_body));
                            }
                            // Large key bitmaps over a key the slices
                            // hold in narrow ranges go in windows, one
                            // with each request; the rest is registered.
                            let (registered, parts) = {
                                let slices: Vec<&ClusterSlice> = match &reading {
                                    Some(reading) => {
                                        reading.1.iter().map(|unit| &unit.slice).collect()
                                    }
                                    None => all_units.iter().map(|unit| &unit.slice).collect(),
                                };
                                JoinFilterParts::split(
                                    &table.name,
                                    &table.schema,
                                    vec![Arc::clone(&filter)],
                                    slices.into_iter(),
                                    join_settings.part_bytes_min,
                                )
                            };
                            let parts = parts.map(Arc::new);
                            if let Some(parts) = &parts {
                                descriptions.push(parts.describe());
                            }
                            let with_parts = |join_filter: Option<RegisteredJoinFilter>| {
                                Arc::new(ResolvedBody {
                                    body: Arc::clone(&base_body),
                                    local: local.clone(),
                                    registered_body: registered_body.clone(),
                                    reading: reading.clone(),
                                    join_filter,
                                    join_filter_parts: parts.clone(),
                                    join_filter_whole: Some(Arc::clone(&filter)),
                                })
                            };
                            if registered.is_empty() {
                                note(descriptions);
                                return Ok(with_parts(None));
                            }
                            let registered_filter = physical_conjunction(registered);
                            let encoded = JoinFilterRegistration::encode(
                                &table.name,
                                &table.schema,
                                &registered_filter,
                            )
                            .and_then(|(bytes, id)| {
                                Ok((JoinFilterRegistration::compress(&bytes)?, id))
                            });
                            let (registration, id) = match encoded {
                                Ok(encoded) => encoded,
                                Err(error) => {
                                    note(vec![format!(
                                        "join filters not pushed: {}",
                                        error.strip_backtrace()
                                    )]);
                                    return Ok(plain(&base_body));
                                }
                            };
                            // Once per node that holds a slice of the scan,
                            // all at once; a node that misses it runs its
                            // slices without it (the answer is the same).
                            let sent = registration.len() as u64;
                            let registered =
                                futures::future::join_all(registration_nodes.iter().map(|&node| {
                                    let client = catalog.clients[node].clone();
                                    let (registration, traffic) =
                                        (registration.clone(), Arc::clone(&traffic));
                                    async move {
                                        traffic.add_join_filter(sent);
                                        let result = client
                                            .register_join_filter(
                                                registration,
                                                &id,
                                                registration_timeout,
                                            )
                                            .await;
                                        (node, result)
                                    }
                                }))
                                .await;
                            filter_bytes.add((sent as usize) * registration_nodes.len());
                            let mut nodes = Vec::new();
                            for (node, result) in registered {
                                match result {
                                    Ok(()) => nodes.push(catalog.clients[node].clone()),
                                    Err(error) => {
                                        log::warn!("{}", error.strip_backtrace());
                                    }
                                }
                            }
                            descriptions.push(format!(
                                "registered on {} of {} nodes, {sent} bytes each, compressed",
                                nodes.len(),
                                registration_nodes.len()
                            ));
                            note(descriptions);
                            Ok::<_, DataFusionError>(with_parts(Some(RegisteredJoinFilter {
                                id,
                                nodes,
                                traffic,
                                timeout: registration_timeout,
                            })))
                        };
                        resolve.await.map_err(|error| error.strip_backtrace())
                    })
                    .await;
                resolved
                    .clone()
                    .map_err(|error| DataFusionError::Execution(format!("join filter: {error}")))
            }
        };

        let requests = SliceRequests {
            catalog: Arc::clone(&catalog),
            traffic: Arc::clone(&traffic),
            settings: self.failover,
            table: table_name.clone(),
            on_request: {
                let parallelism = Arc::clone(&parallelism);
                Arc::new(move |node, started| parallelism.request(node, started))
            },
        };
        // A node working on a slice without output (a pushed aggregation)
        // says so four times per silence timeout.
        let heartbeat = self.failover.timeout / 4;
        // A raw slice is completed here with the fragment the nodes got,
        // decoded once per partition.
        let completion = RawCompletion {
            schema: Arc::clone(&self.table.schema),
            context: Arc::clone(&context),
            body: Arc::new(OnceLock::new()),
        };
        let schema_for_batches = Arc::clone(&schema);
        // Batches flow on as they arrive from up to `slices_in_flight` slices
        // at once, so the compute node works while the storage nodes still do.
        let parts = stream::once(body)
            .map_ok(move |body| {
                let mut requests = requests.clone();
                let mut table_name = table_name.clone();
                let units: Vec<WorkUnit> = match &body.reading {
                    Some(reading) => {
                        table_name = reading.0.table.name.clone();
                        requests.table = table_name.clone();
                        reading.1.iter().skip(partition).step_by(partitions).cloned().collect()
                    }
                    None => units.clone(),
                };
                let completion = completion.clone();
                let bytes_sent = bytes_sent.clone();
                let (part_bytes, traffic_parts) = (part_bytes.clone(), Arc::clone(&traffic_parts));
                let as_stored = nothing_to_push
                    && body.join_filter.is_none()
                    && body.join_filter_parts.is_none()
                    && body.local.is_none();
                let raw_counters = (
                    if as_stored {
                        slices_as_stored.clone()
                    } else {
                        slices_raw.clone()
                    },
                    bytes_raw.clone(),
                    raw_completion.clone(),
                );
                let local = body.local.clone();
                let inner = stream::iter(units)
                    .map(move |unit| {
                        let mut envelope = FragmentEnvelope::new(
                            table_name.clone(),
                            unit.slice.summary.slice,
                            body.body.as_ref().clone(),
                        )
                        .with_row_groups(unit.row_groups)
                        .with_ipc_codec(ipc_codec)
                        .with_heartbeat(heartbeat);
                        if as_stored {
                            envelope = envelope.with_raw();
                        }
                        if let Some(filter) = &body.join_filter {
                            envelope = envelope.with_join_filter(&filter.id);
                        }
                        if let Some(parts) = &body.join_filter_parts {
                            // Without its part a request is answered the
                            // same, with more rows.
                            match parts.part_for(&unit.slice) {
                                Ok(part) => {
                                    let bytes = part.len();
                                    envelope = envelope.with_join_filter_part(part);
                                    if prost::Message::encoded_len(&envelope)
                                        > sieve_fragment::FRAGMENT_BYTES_MAX
                                    {
                                        envelope.join_filter_part.clear();
                                    } else {
                                        part_bytes.add(bytes);
                                        traffic_parts.add_join_filter_part(bytes as u64);
                                    }
                                }
                                Err(error) => log::warn!(
                                    "join filter part not sent: {}",
                                    error.strip_backtrace()
                                ),
                            }
                        }
                        let deleted = unit
                            .slice
                            .deleted
                            .as_ref()
                            .map(|(vector, _)| Arc::clone(vector));
                        if let Some(deleted) = &deleted {
                            envelope = envelope.with_deleted(deleted);
                        }
                        let inline = body
                            .registered_body
                            .as_ref()
                            .map(|registered| {
                                let light = envelope.clone().with_registered_body(&registered.id);
                                (prost::Message::encode_to_vec(&envelope), light)
                            });
                        if let Some((_, light)) = &inline {
                            envelope = light.clone();
                        }
                        let encoded = prost::Message::encode_to_vec(&envelope);
                        bytes_sent.add(encoded.len());
                        let (completion, body) = (completion.clone(), Arc::clone(&body));
                        let (slices_raw, bytes_raw, raw_completion) = raw_counters.clone();
                        // Raw pages become batches here, through the same fragment.
                        let parts = match inline {
                            None => request_slice(requests.clone(), unit.slice, encoded),
                            // A node that does not hold the registered
                            // body refuses before any row: the request
                            // goes again with the body inline.
                            Some((inline, _)) => {
                                let (requests, slice, bytes_sent) =
                                    (requests.clone(), unit.slice.clone(), bytes_sent.clone());
                                let first = request_slice(requests.clone(), unit.slice, encoded);
                                stream::once(async move {
                                    let mut first = first.peekable();
                                    let missing = matches!(
                                        std::pin::Pin::new(&mut first).peek().await,
                                        Some(Err(error)) if sieve_fragment::BodyNotHeld::is(error)
                                    );
                                    if missing {
                                        log::info!(
                                            "a node did not hold the registered fragment body; sent inline"
                                        );
                                        bytes_sent.add(inline.len());
                                        request_slice(requests, slice, inline)
                                    } else {
                                        first.boxed()
                                    }
                                })
                                .flatten()
                                .boxed()
                            }
                        };
                        parts
                            .map_ok(move |part| match part {
                                SlicePart::Raw(pages) => {
                                    slices_raw.add(1);
                                    bytes_raw.add(pages.bytes() as usize);
                                    let _timer = raw_completion.timer();
                                    let filter = body.join_filter_whole.clone();
                                    match completion.run(
                                        pages,
                                        &body.body,
                                        filter,
                                        deleted.as_deref(),
                                    ) {
                                        Ok(batches) => batches.map_ok(SlicePart::Batch).boxed(),
                                        Err(error) => stream::once(async { Err(error) }).boxed(),
                                    }
                                }
                                other => stream::once(async { Ok(other) }).boxed(),
                            })
                            .try_flatten()
                    })
                    .flatten_unordered(slices_in_flight)
                    .boxed();
                match local {
                    None => inner,
                    Some(plan) => {
                        crate::star_join::run_locally(inner, plan, Arc::clone(&local_context))
                            .unwrap_or_else(|error| stream::once(async { Err(error) }).boxed())
                    }
                }
            })
            .try_flatten();
        let batches = parts.try_filter_map(move |part| {
            let batch = match part {
                SlicePart::Raw(_) => Err(DataFusionError::Internal(
                    "raw pages reached the scan's output uncompleted".to_string(),
                )),
                SlicePart::Failed { node, reason } => {
                    log::info!("{node} failed a slice request, retried elsewhere: {reason}");
                    slice_retries.add(1);
                    Ok(None)
                }
                SlicePart::Done {
                    metrics,
                    bytes_shipped: shipped,
                } => {
                    bytes_shipped.add(shipped as usize);
                    bytes_read.add(metrics.bytes_read as usize);
                    slices_done.add(1);
                    pages_considered.add(metrics.pages_considered as usize);
                    pages_skipped_statistics.add(metrics.pages_skipped_statistics as usize);
                    pages_skipped_bloom.add(metrics.pages_skipped_bloom_filter as usize);
                    pages_skipped_page_index.add(metrics.pages_skipped_page_index as usize);
                    pages_read.add(metrics.pages_read() as usize);
                    rows_scanned.add(metrics.rows_scanned as usize);
                    rows_aggregated.add(metrics.rows_aggregated as usize);
                    storage_cpu.add_duration(Duration::from_nanos(metrics.cpu_nanos));
                    parallelism
                        .storage_slices_running_max
                        .set_max(metrics.node_slices_running as usize);
                    Ok(None)
                }
                SlicePart::Batch(batch) => {
                    output_rows.add(batch.num_rows());
                    let schema = Arc::clone(&schema_for_batches);
                    if output_no_columns {
                        let options =
                            RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
                        RecordBatch::try_new_with_options(schema, vec![], &options)
                            .map(Some)
                            .map_err(DataFusionError::from)
                    } else {
                        // Columns shipped narrower (sieve_fragment::wire_type)
                        // come back to their planned types.
                        match sieve_fragment::widen(batch, &schema) {
                            // Partial states: names as planned here.
                            Ok(batch) if rewrap => {
                                RecordBatch::try_new(schema, batch.columns().to_vec())
                                    .map(Some)
                                    .map_err(DataFusionError::from)
                            }
                            other => other.map(Some),
                        }
                    }
                }
            };
            futures::future::ready(batch)
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, batches)))
    }
}
