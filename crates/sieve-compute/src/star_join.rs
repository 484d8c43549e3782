//! [`PushStarJoinToStorage`]: a partial aggregation over hash joins whose
//! build sides are small (a star join's filtered dimensions) and whose probe
//! side is a Sieve scan moves, joins and all, into the scan's fragment.
//!
//! ```text
//!   AggregateExec(Partial)                 SieveScanExec(lineorder)
//!     HashJoinExec(date ⋈ ...)       =>      pushed star join: the same operators
//!       HashJoinExec(part ⋈ ...)               over the slice, each join's build side
//!         SieveScanExec(lineorder)             the rows the compute node collected
//! ```
//!
//! At execution the scan first runs the build sides here (they are its
//! children), puts their rows into the fragment as each join's build side
//! (one partition of rows in memory, as `sieve_fragment`'s allow-list
//! requires), adds each probe key's range over the build keys to the pushed
//! predicate (so pages outside it are skipped, as the join filters they
//! replace did), and sends it: every storage node then filters, probes every
//! dimension and aggregates each slice in one pass, and ships partial
//! states. The final aggregation here merges them unchanged. A raw slice
//! runs the same fragment here.
//!
//! Taken: collect-left and partitioned hash joins (a partitioned one runs
//! collect-left over each slice), inner or right semi, without a residual
//! filter, NULL keys matching nothing (what the allow-list runs), their build
//! sides estimated under `sieve.star_join_build_bytes_max` bytes in all
//! with a quarter's headroom for Arrow's own (and under
//! `sieve.join_build_bytes_max`, what one join holds before it spills),
//! and at most `sieve.star_join_build_rows_share` (a quarter) of the probe
//! table's mean rows per slice (each slice builds the hash tables again).
//! Their results over a slice are the slice's share of the whole join, so
//! merging the slices' partial states gives the unpushed plan's answer.

use std::sync::Arc;

use arrow::array::RecordBatch;
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{JoinType, NullEquality, Result, ScalarValue};
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::functions_aggregate::min_max::{MaxAccumulator, MinAccumulator};
use datafusion::logical_expr::{Accumulator, Operator};
use datafusion::physical_expr::expressions::{lit, BinaryExpr, Column};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::statistics::{StatisticsArgs, StatisticsContext};
use datafusion::physical_plan::{ExecutionPlan, Partitioning};
use sieve_fragment::{check_plan_allowed, KeyBitmapExpr, SliceInputExec};

use crate::build_keys::{BuildKeys, BuildKeysExec};
use crate::optimizer::{build_side_name, recompute, trace_column};
use crate::{SieveConfig, SieveScanExec};

/// A star join pushed into a scan's fragment.
#[derive(Debug, Clone)]
pub struct PushedStarJoin {
    /// The operators over the slice: leaf a `SliceInputExec` with the scan's
    /// shipped columns, each hash join's build side an empty one-partition
    /// memory source that the collected rows replace (joins counted bottom
    /// up, as `builds`).
    pub plan: Arc<dyn ExecutionPlan>,
    /// The joins' build sides, run on the compute node first.
    pub builds: Vec<Arc<dyn ExecutionPlan>>,
    /// Per build side: each probe key that is a table column, with its
    /// build key (over the build side's schema) and the table column.
    pub ranges: Vec<Vec<(Arc<dyn PhysicalExpr>, usize)>>,
    /// For EXPLAIN.
    pub description: String,
}

/// Moves star joins into fragments (see the module docs).
#[derive(Debug, Default)]
pub struct PushStarJoinToStorage;

impl PhysicalOptimizerRule for PushStarJoinToStorage {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let settings = SieveConfig::of(config);
        if !settings.star_join_pushdown || !settings.aggregate_pushdown {
            return Ok(plan);
        }
        // The build sides are held whole, so within what one hash join may
        // hold before it spills (0: it never spills).
        let bytes_max = match settings.join_build_bytes_max {
            0 => settings.star_join_build_bytes_max,
            held => settings.star_join_build_bytes_max.min(held),
        };
        let rows_share = settings.star_join_build_rows_share;
        plan.transform_up(|node| push_star_join(node, bytes_max, rows_share))
            .map(|transformed| transformed.data)
    }

    fn name(&self) -> &str {
        "sieve_push_star_join_to_storage"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// Whether the storage node may run `join` over a slice (the allow-list's
/// rule, checked here first so the plan is left alone otherwise).
fn is_pushable(join: &HashJoinExec) -> bool {
    // A partitioned join runs collect-left in the fragment: each slice is
    // probed against the whole build side, as the partitions together are.
    matches!(
        join.partition_mode(),
        PartitionMode::CollectLeft | PartitionMode::Partitioned
    ) && matches!(join.join_type(), JoinType::Inner | JoinType::RightSemi)
        && join.filter().is_none()
        && join.null_equality() == NullEquality::NullEqualsNothing
        && !join.null_aware
        && !join.on().is_empty()
}

/// Estimated rows of a build side, if the statistics say.
fn estimated_rows(build: &Arc<dyn ExecutionPlan>) -> Option<usize> {
    let statistics = StatisticsContext::new()
        .compute(build.as_ref(), &StatisticsArgs::new())
        .ok()?;
    statistics.num_rows.get_value().copied()
}

/// Estimated bytes of a build side's rows, if the statistics say.
fn estimated_bytes(build: &Arc<dyn ExecutionPlan>) -> Option<usize> {
    let statistics = StatisticsContext::new()
        .compute(build.as_ref(), &StatisticsArgs::new())
        .ok()?;
    if let Some(bytes) = statistics.total_byte_size.get_value() {
        return Some(*bytes);
    }
    let rows = *statistics.num_rows.get_value()?;
    let width: usize = build
        .schema()
        .fields()
        .iter()
        .map(|field| field.data_type().primitive_width().unwrap_or(24))
        .sum();
    Some(rows.saturating_mul(width.max(1)))
}

/// An empty one-partition memory source standing for a build side's rows.
fn empty_build(build: &Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
    let rows: Arc<dyn ExecutionPlan> =
        MemorySourceConfig::try_new_exec(&[vec![]], build.schema(), None)?;
    Ok(rows)
}

fn push_star_join(
    node: Arc<dyn ExecutionPlan>,
    bytes_max: usize,
    rows_share: f64,
) -> Result<Transformed<Arc<dyn ExecutionPlan>>> {
    let Some(aggregate) = node.downcast_ref::<AggregateExec>() else {
        return Ok(Transformed::no(node));
    };
    if *aggregate.mode() != AggregateMode::Partial {
        return Ok(Transformed::no(node));
    }
    // The operators down to the scan, top first.
    let mut kept: Vec<Arc<dyn ExecutionPlan>> = Vec::new();
    let mut current = Arc::clone(aggregate.input());
    let scan_node = loop {
        if current.downcast_ref::<SieveScanExec>().is_some() {
            break current;
        }
        let next = if let Some(join) = current.downcast_ref::<HashJoinExec>() {
            if !is_pushable(join) {
                return Ok(Transformed::no(node));
            }
            Arc::clone(join.right())
        } else {
            let kept_here = current.downcast_ref::<ProjectionExec>().is_some()
                || current.downcast_ref::<FilterExec>().is_some();
            #[allow(deprecated)]
            let passes_through = current
                .downcast_ref::<RepartitionExec>()
                .is_some_and(|repartition| {
                    // Round robin, or by hash under a partitioned join's
                    // probe side (the fragment's join is collect-left).
                    matches!(
                        repartition.partitioning(),
                        Partitioning::RoundRobinBatch(_) | Partitioning::Hash(..)
                    ) && !repartition.preserve_order()
                })
                || current.downcast_ref::<CoalescePartitionsExec>().is_some()
                || current.downcast_ref::<crate::MergePartitionsExec>().is_some()
                || current
                    .downcast_ref::<datafusion::physical_plan::coalesce_batches::CoalesceBatchesExec>()
                    .is_some();
            if !kept_here && !passes_through {
                return Ok(Transformed::no(node));
            }
            let [child] = current.children()[..] else {
                return Ok(Transformed::no(node));
            };
            if passes_through {
                current = Arc::clone(child);
                continue;
            }
            Arc::clone(child)
        };
        kept.push(Arc::clone(&current));
        current = next;
    };
    let scan = scan_node
        .downcast_ref::<SieveScanExec>()
        .expect("the loop ends at a scan");
    if scan.aggregate().is_some() || scan.outputs_no_columns() {
        return Ok(Transformed::no(node));
    }
    let joins: Vec<&HashJoinExec> = kept
        .iter()
        .filter_map(|plan| plan.downcast_ref::<HashJoinExec>())
        .collect();
    if joins.is_empty() {
        return Ok(Transformed::no(node));
    }
    // Build sides are dimensions: filtered scans of tables smaller than the
    // probe side's, not joins of their own (DataFusion may put a join chain
    // over the fact table on the build side, and a dimension on the probe).
    let probe_rows = scan.table().statistics.num_rows.get_value().copied();
    for join in &joins {
        let mut dimension = true;
        join.left().apply(|inner| {
            if inner.downcast_ref::<HashJoinExec>().is_some() {
                dimension = false;
            } else if let Some(build_scan) = inner.downcast_ref::<SieveScanExec>() {
                let rows = build_scan.table().statistics.num_rows.get_value().copied();
                if !matches!((rows, probe_rows), (Some(rows), Some(probe)) if rows < probe) {
                    dimension = false;
                }
            } else if inner.children().len() > 1 {
                dimension = false;
            }
            Ok(if dimension {
                TreeNodeRecursion::Continue
            } else {
                TreeNodeRecursion::Stop
            })
        })?;
        if !dimension {
            return Ok(Transformed::no(node));
        }
    }
    let mut estimate = 0usize;
    let mut build_rows = 0usize;
    for join in &joins {
        match (estimated_bytes(join.left()), estimated_rows(join.left())) {
            (Some(bytes), Some(rows)) => {
                estimate = estimate.saturating_add(bytes);
                build_rows = build_rows.saturating_add(rows);
            }
            _ => return Ok(Transformed::no(node)),
        }
    }
    // The rows collected are held as Arrow arrays, a fifth or so over the
    // estimate (buffers rounded up, validity, decoded batches' capacity):
    // TPC-H Q11 at SF 100 estimated 16.0 MB of suppliers, held 19.3 MB,
    // past the fragment's bound, and ran its joins here unfiltered.
    if estimate.saturating_add(estimate / 4) > bytes_max {
        return Ok(Transformed::no(node));
    }
    // Every slice builds the hash tables again from the build rows: they
    // must be a small share of a slice's rows, or building costs more than
    // the probe saves, and a join filter does better (Q11 at SF 100: 1 M
    // suppliers against slices of 755 k partsupp rows).
    let slices = scan.table().slices.len().max(1);
    let slice_rows = probe_rows.unwrap_or(0) / slices;
    if build_rows as f64 > slice_rows as f64 * rows_share {
        return Ok(Transformed::no(node));
    }

    // The operators as the storage node runs them, bottom up.
    let mut input: Arc<dyn ExecutionPlan> = Arc::new(SliceInputExec::new(scan.schema()));
    let mut builds = Vec::new();
    let mut ranges = Vec::new();
    let mut dimensions = Vec::new();
    let mut payload = Vec::new();
    for plan in kept.iter().rev() {
        if let Some(join) = plan.downcast_ref::<HashJoinExec>() {
            let mut join_ranges = Vec::new();
            for (build_key, probe_key) in join.on() {
                let Some(column) = probe_key.downcast_ref::<Column>() else {
                    continue;
                };
                if let Some((traced, index)) = trace_column(join.right(), column.index()) {
                    if Arc::ptr_eq(&traced, &scan_node) {
                        if let Some(&table_column) = scan.shipped_columns().get(index) {
                            join_ranges.push((Arc::clone(build_key), table_column));
                        }
                    }
                }
            }
            ranges.push(join_ranges);
            dimensions.push(build_side_name(join.left()));
            payload.extend(
                join.left()
                    .schema()
                    .fields()
                    .iter()
                    .map(|field| field.name().clone()),
            );
            builds.push(Arc::clone(join.left()));
            input = Arc::new(
                join.builder()
                    .with_partition_mode(PartitionMode::CollectLeft)
                    .reset_state()
                    .with_new_children(vec![empty_build(join.left())?, input])?
                    .build()?,
            );
        } else {
            input = Arc::clone(plan).replace_children(vec![input], recompute())?;
        }
    }
    let partial = Arc::clone(&node).replace_children(vec![input], recompute())?;
    if check_plan_allowed(&partial).is_err() {
        return Ok(Transformed::no(node));
    }
    let groups: Vec<String> = aggregate
        .group_expr()
        .expr()
        .iter()
        .map(|(_, name)| name.clone())
        .collect();
    let aggregates: Vec<String> = aggregate
        .aggr_expr()
        .iter()
        .map(|function| function.name().to_string())
        .collect();
    let description = format!(
        "pushed join: dimension(s) {}, payload [{}], est. {estimate} bytes, then partial [{}] group by [{}]",
        dimensions.join(", "),
        payload.join(", "),
        aggregates.join(", "),
        groups.join(", ")
    );
    // The joins' own filters are the star join's now: the joins no longer
    // run here, so they would never complete. They may sit on this scan or
    // on a scan of a lower join's build side (a key that comes from a
    // dimension), which runs before this scan's requests.
    let ids: Vec<u64> = joins
        .iter()
        .flat_map(|join| join.dynamic_expressions_produced())
        .filter_map(|filter| filter.expression_id())
        .collect();
    let collectors: Vec<Arc<BuildKeys>> = joins
        .iter()
        .filter_map(|join| join.left().downcast_ref::<BuildKeysExec>())
        .map(|tap| Arc::clone(tap.collector()))
        .collect();
    let without_pushed_filters = |scan: &SieveScanExec| {
        let mut scan = ids.iter().fold(scan.clone_without_metrics(), |scan, &id| {
            scan.without_join_filter_silently(id)
        });
        for keys in &collectors {
            scan = scan.without_key_filters_from(keys);
        }
        scan
    };
    let builds = builds
        .into_iter()
        .map(|build| {
            build
                .transform_up(|inner| {
                    Ok(match inner.downcast_ref::<SieveScanExec>() {
                        Some(build_scan) => {
                            Transformed::yes(Arc::new(without_pushed_filters(build_scan))
                                as Arc<dyn ExecutionPlan>)
                        }
                        None => Transformed::no(inner),
                    })
                })
                .map(|transformed| transformed.data)
        })
        .collect::<Result<Vec<_>>>()?;
    let pushed = without_pushed_filters(scan).with_star_join(PushedStarJoin {
        plan: partial,
        builds,
        ranges,
        description,
    })?;
    Ok(Transformed::yes(Arc::new(pushed)))
}

/// Most bytes of the key bitmap a star join adds per probe key (it travels
/// in every slice request).
const STAR_JOIN_BITMAP_BYTES_MAX: usize = 256 * 1024;

/// An exact bitmap of the build keys over `column`, if they are integers
/// whose range fits [`STAR_JOIN_BITMAP_BYTES_MAX`].
fn key_bitmap(
    column: &Arc<dyn PhysicalExpr>,
    data_type: &arrow::datatypes::DataType,
    build_key: &Arc<dyn PhysicalExpr>,
    batches: &[RecordBatch],
) -> Result<Option<Arc<dyn PhysicalExpr>>> {
    if !KeyBitmapExpr::supports(data_type) || batches.is_empty() {
        return Ok(None);
    }
    let mut arrays = Vec::with_capacity(batches.len());
    for batch in batches {
        arrays.push(build_key.evaluate(batch)?.into_array(batch.num_rows())?);
    }
    let references: Vec<&dyn arrow::array::Array> = arrays.iter().map(|a| a.as_ref()).collect();
    let keys = arrow::compute::concat(&references)?;
    match KeyBitmapExpr::bytes_for(&keys, data_type)? {
        Some(bytes) if bytes <= STAR_JOIN_BITMAP_BYTES_MAX => Ok(Some(Arc::new(
            KeyBitmapExpr::try_new(Arc::clone(column), data_type.clone(), &keys)?,
        ))),
        _ => Ok(None),
    }
}

/// A star join's operators with their build rows in place, and the
/// predicate conjuncts that bound its probe keys.
pub(crate) type WithBuildRows = (Arc<dyn ExecutionPlan>, Vec<Arc<dyn PhysicalExpr>>);

/// The star join's operators with the collected rows of each build side
/// (`rows[i]` for `builds[i]`), and the predicate conjuncts (over the table
/// schema) that bound each probe key by its build keys' range.
pub(crate) fn with_build_rows(
    star: &PushedStarJoin,
    table_schema: &arrow::datatypes::Schema,
    rows: Vec<Vec<RecordBatch>>,
) -> Result<WithBuildRows> {
    let mut conjuncts = Vec::new();
    for ((batches, keys), build) in rows.iter().zip(&star.ranges).zip(&star.builds) {
        for (build_key, table_column) in keys {
            let mut min = MinAccumulator::try_new(&build_key.data_type(&build.schema())?)?;
            let mut max = MaxAccumulator::try_new(&build_key.data_type(&build.schema())?)?;
            for batch in batches {
                let values = build_key.evaluate(batch)?.into_array(batch.num_rows())?;
                min.update_batch(&[Arc::clone(&values)])?;
                max.update_batch(&[values])?;
            }
            let field = table_schema.field(*table_column);
            let column: Arc<dyn PhysicalExpr> = Arc::new(Column::new(field.name(), *table_column));
            let (min, max) = (min.evaluate()?, max.evaluate()?);
            if min.is_null() || max.is_null() {
                // No key (or only NULLs) on the build side: nothing joins.
                conjuncts.push(lit(ScalarValue::Boolean(Some(false))));
                continue;
            }
            if min.data_type() != *field.data_type() {
                continue;
            }
            conjuncts.push(Arc::new(BinaryExpr::new(
                Arc::new(BinaryExpr::new(
                    Arc::clone(&column),
                    Operator::GtEq,
                    lit(min),
                )),
                Operator::And,
                Arc::new(BinaryExpr::new(
                    Arc::clone(&column),
                    Operator::LtEq,
                    lit(max),
                )),
            )));
            // Integer keys: an exact bitmap of them too, so the node drops
            // rows without a match with one bit test each, before the
            // join hashes the rest (as the join filter it replaces did).
            if let Some(bitmap) = key_bitmap(&column, field.data_type(), build_key, batches)? {
                conjuncts.push(bitmap);
            }
        }
    }
    // Joins bottom up, as the builds were listed.
    let mut index = 0;
    let mut rows = rows.into_iter();
    let plan = Arc::clone(&star.plan)
        .transform_up(|node| {
            let Some(join) = node.downcast_ref::<HashJoinExec>() else {
                return Ok(Transformed::no(node));
            };
            let batches = rows.next().unwrap_or_default();
            let build = star
                .builds
                .get(index)
                .map(|build| build.schema())
                .unwrap_or_else(|| join.left().schema());
            index += 1;
            let memory: Arc<dyn ExecutionPlan> =
                MemorySourceConfig::try_new_exec(&[batches], build, None)?;
            let probe = Arc::clone(join.right());
            Ok(Transformed::yes(
                Arc::clone(&node).replace_children(vec![memory, probe], recompute())?,
            ))
        })?
        .data;
    Ok((plan, conjuncts))
}

/// A one-shot stream as a `PartitionStream`: the rows the storage nodes
/// shipped for a star join run here.
struct ShippedRows {
    schema: arrow::datatypes::SchemaRef,
    rows: std::sync::Mutex<Option<datafusion::execution::SendableRecordBatchStream>>,
}

impl std::fmt::Debug for ShippedRows {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("ShippedRows")
    }
}

impl datafusion::physical_plan::streaming::PartitionStream for ShippedRows {
    fn schema(&self) -> &arrow::datatypes::SchemaRef {
        &self.schema
    }

    fn execute(
        &self,
        _context: Arc<datafusion::execution::TaskContext>,
    ) -> datafusion::execution::SendableRecordBatchStream {
        let taken = self.rows.lock().expect("never poisoned").take();
        taken.unwrap_or_else(|| {
            let error = datafusion::common::DataFusionError::Internal(
                "a star join's shipped rows were read twice".to_string(),
            );
            Box::pin(
                datafusion::physical_plan::stream::RecordBatchStreamAdapter::new(
                    Arc::clone(&self.schema),
                    futures::stream::once(async move { Err(error) }),
                ),
            )
        })
    }
}

/// Runs a star join's operators (`plan`, with its build rows in place) on
/// this node over the rows the storage nodes shipped for a plain fragment:
/// the fallback when the fragment with the build rows cannot be sent (over
/// `sieve_fragment::FRAGMENT_BYTES_MAX`, say). `parts` are one partition's
/// slice parts; their batches (shipped rows) go through one execution of
/// the operators (one hash table per partition), the other parts pass on,
/// and the operators' output follows as batches.
pub(crate) fn run_locally(
    parts: futures::stream::BoxStream<'static, Result<crate::client::SlicePart>>,
    plan: Arc<dyn ExecutionPlan>,
    context: Arc<datafusion::execution::TaskContext>,
) -> Result<futures::stream::BoxStream<'static, Result<crate::client::SlicePart>>> {
    use crate::client::SlicePart;
    use futures::{SinkExt, StreamExt};

    let mut leaf_schema = None;
    plan.apply(|node| {
        if node.downcast_ref::<SliceInputExec>().is_some() {
            leaf_schema = Some(node.schema());
        }
        Ok(TreeNodeRecursion::Continue)
    })?;
    let Some(row_schema) = leaf_schema else {
        return datafusion::common::internal_err!("a star join's operators read no slice");
    };
    let (sender, receiver) = futures::channel::mpsc::channel::<Result<RecordBatch>>(2);
    let rows = ShippedRows {
        schema: Arc::clone(&row_schema),
        rows: std::sync::Mutex::new(Some(Box::pin(
            datafusion::physical_plan::stream::RecordBatchStreamAdapter::new(
                Arc::clone(&row_schema),
                receiver,
            ),
        ))),
    };
    let leaf: Arc<dyn ExecutionPlan> = Arc::new(
        datafusion::physical_plan::streaming::StreamingTableExec::try_new(
            Arc::clone(&row_schema),
            vec![Arc::new(rows)],
            None,
            vec![],
            false,
            None,
        )?,
    );
    let plan = plan
        .transform_up(|node| {
            Ok(if node.downcast_ref::<SliceInputExec>().is_some() {
                Transformed::yes(Arc::clone(&leaf))
            } else {
                Transformed::no(node)
            })
        })?
        .data;
    let output = plan
        .execute(0, context)?
        .map(|batch| batch.map(SlicePart::Batch));
    // Batches into the operators, the rest on; the sender is dropped when
    // the parts end, which ends the operators' input.
    let forwarded =
        futures::stream::unfold((parts, Some(sender)), move |(mut parts, mut sender)| {
            let row_schema = Arc::clone(&row_schema);
            async move {
                loop {
                    match parts.next().await {
                        None => {
                            drop(sender.take());
                            return None;
                        }
                        Some(Ok(SlicePart::Batch(batch))) => {
                            let widened = sieve_fragment::widen(batch, &row_schema);
                            if let Some(sending) = sender.as_mut() {
                                // The operators ended early (an error they
                                // report themselves): nothing more to feed.
                                if sending.send(widened).await.is_err() {
                                    sender = None;
                                }
                            }
                        }
                        Some(other) => return Some((other, (parts, sender))),
                    }
                }
            }
        });
    Ok(futures::stream::select(forwarded, output).boxed())
}
