//! DELETE and UPDATE of a table a user owns, found next to the data.
//!
//! ```text
//!  for each slice of the version read:
//!    fragment (predicate; for UPDATE every column) + the slice's deleted
//!    rows + "ship row positions" ── DoGet ──> storage node: coarse stage
//!    (page index, Bloom filters), then the rows that match, with their
//!    positions in the file (the Parquet reader's row numbers)
//!  DELETE: the slice's deletion vector grows by those positions
//!  UPDATE: the same, and the rows with the new values go to new slices
//!  one commit: every slice's new deletion vector (a slice with no row left
//!  is removed instead) and the new slices; it conflicts if another
//!  statement changed one of those slices since the version read
//! ```

use std::fmt;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, Int64Array, RecordBatch, UInt64Array};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{exec_err, DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::{EquivalenceProperties, Partitioning, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use futures::StreamExt;
use sieve_fragment::{
    decode_deletions, encode_deletions, DecodedBody, Fragment, FragmentEnvelope, RoaringBitmap,
};

use super::{Change, Deletion, OwnedTables, Snapshot, TableWriter};
use crate::client::SlicePart;
use crate::{ClusterCatalog, ClusterSlice, ClusterTable, Traffic};

/// Slices a DELETE or UPDATE searches at once. For UPDATE each holds the
/// rows it found until their turn (at most a slice's rows each).
pub const CHANGE_SLICES_IN_FLIGHT: usize = 4;

/// Longest silence of a node while it finds one slice's rows.
const SLICE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// What a [`ChangeRowsExec`] does to the rows its predicate finds.
#[derive(Debug, Clone)]
pub enum RowChange {
    /// DELETE.
    Delete,
    /// UPDATE: each column's new value (the table's columns in order; an
    /// expression over the table schema, cast to the column's type).
    Update(Vec<Arc<dyn PhysicalExpr>>),
}

/// Runs one DELETE or UPDATE when executed; answers the rows changed.
pub struct ChangeRowsExec {
    tables: Arc<OwnedTables>,
    catalog: Arc<ClusterCatalog>,
    traffic: Arc<Traffic>,
    snapshot: Snapshot,
    cluster_table: Arc<ClusterTable>,
    predicate: Option<Arc<dyn PhysicalExpr>>,
    change: RowChange,
    statement: String,
    properties: Arc<PlanProperties>,
}

impl fmt::Debug for ChangeRowsExec {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("ChangeRowsExec")
            .field("table", &self.snapshot.table.name)
            .field("statement", &self.statement)
            .finish_non_exhaustive()
    }
}

fn count_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new(
        "count",
        DataType::UInt64,
        false,
    )]))
}

impl ChangeRowsExec {
    /// A DELETE or UPDATE of the rows of `snapshot` that `predicate` keeps
    /// (all rows: `None`).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        tables: Arc<OwnedTables>,
        catalog: Arc<ClusterCatalog>,
        traffic: Arc<Traffic>,
        snapshot: Snapshot,
        cluster_table: Arc<ClusterTable>,
        predicate: Option<Arc<dyn PhysicalExpr>>,
        change: RowChange,
        statement: String,
    ) -> Self {
        let properties = Arc::new(PlanProperties::new(
            EquivalenceProperties::new(count_schema()),
            Partitioning::UnknownPartitioning(1),
            EmissionType::Final,
            Boundedness::Bounded,
        ));
        Self {
            tables,
            catalog,
            traffic,
            snapshot,
            cluster_table,
            predicate,
            change,
            statement,
            properties,
        }
    }

    async fn run(self: Arc<Self>, context: Arc<TaskContext>) -> Result<u64> {
        let schema = Arc::clone(&self.snapshot.table.schema);
        let projection: Vec<usize> = match &self.change {
            RowChange::Delete => vec![],
            RowChange::Update(_) => (0..schema.fields().len()).collect(),
        };
        let fragment = Fragment {
            projection: projection.clone(),
            predicate: self.predicate.clone(),
            aggregate: None,
        };
        let body = fragment.encode_body(&schema)?;
        let decoded = DecodedBody::decode(&body, &schema, &context)?;
        let shipped = Arc::new(Schema::new(
            projection
                .iter()
                .map(|&column| schema.field(column).clone())
                .chain([Field::new(
                    sieve_fragment::ROW_POSITION_COLUMN,
                    DataType::Int64,
                    false,
                )])
                .collect::<Vec<_>>(),
        ));
        let mut writer = match &self.change {
            RowChange::Update(_) => Some(TableWriter::new(
                Arc::clone(&self.tables),
                self.snapshot.table.clone(),
            )),
            RowChange::Delete => None,
        };
        let mut change = Change::default();
        let mut changed = 0u64;
        let outcome: Result<()> = async {
            // Several slices are searched at once (on their nodes, in
            // parallel); their rows are taken in slice order.
            let mut searches = Vec::with_capacity(self.cluster_table.slices.len());
            for slice in &self.cluster_table.slices {
                searches.push(self.slice_rows(slice, &body, &decoded, &shipped, &context));
            }
            let mut found_rows = futures::stream::iter(searches).buffered(CHANGE_SLICES_IN_FLIGHT);
            for entry in &self.snapshot.slices {
                let batches = found_rows.next().await.ok_or_else(|| {
                    DataFusionError::Internal("a slice without its rows".to_string())
                })??;
                let mut found = RoaringBitmap::new();
                for batch in &batches {
                    let positions = batch
                        .column(batch.num_columns() - 1)
                        .as_any()
                        .downcast_ref::<Int64Array>()
                        .ok_or_else(|| {
                            DataFusionError::Internal("row positions are not Int64".into())
                        })?;
                    for position in positions.values() {
                        found.insert(u32::try_from(*position).map_err(|_| {
                            DataFusionError::Internal(format!(
                                "row position {position} out of range"
                            ))
                        })?);
                    }
                    if let (RowChange::Update(values), Some(writer)) =
                        (&self.change, writer.as_mut())
                    {
                        let old = RecordBatch::try_new(
                            Arc::clone(&schema),
                            batch.columns()[..batch.num_columns() - 1].to_vec(),
                        )?;
                        writer.write(updated(&old, values, &schema)?).await?;
                    }
                }
                let mut deleted = match &entry.deleted {
                    Some(bytes) => decode_deletions(bytes)?,
                    None => RoaringBitmap::new(),
                };
                // Rows already deleted were not shipped; count only new ones.
                let before = deleted.len();
                deleted |= &found;
                let new = deleted.len() - before;
                if new == 0 {
                    continue;
                }
                changed += new;
                if deleted.len() >= entry.summary.rows {
                    // No row left: the slice goes (its files with it).
                    change.removed.push(entry.slice);
                    change.expect.push((entry.slice, entry.deleted_version));
                } else {
                    change.deletions.push(Deletion {
                        slice: entry.slice,
                        vector: encode_deletions(&deleted),
                        rows: deleted.len(),
                        base: entry.deleted_version,
                    });
                }
            }
            Ok(())
        }
        .await;
        if let Err(error) = outcome {
            if let Some(writer) = writer {
                writer.abandon().await;
            }
            return Err(error);
        }
        let writer = match writer {
            Some(writer) => writer,
            None => TableWriter::new(Arc::clone(&self.tables), self.snapshot.table.clone()),
        };
        if changed == 0 && writer.rows() == 0 {
            writer.abandon().await;
        } else {
            writer.commit(change, &self.statement).await?;
        }
        // Slices past the deleted share are rewritten, in a commit of their
        // own: the statement has committed whatever happens to it.
        let share =
            crate::SieveConfig::of(context.session_config().options()).compact_deleted_share;
        if share <= 1.0 {
            if let Err(error) = self.compact_latest(share, Arc::clone(&context)).await {
                log::warn!(
                    "compacting '{}' failed (it stays as it is): {error}",
                    self.snapshot.table.name
                );
            }
        }
        Ok(changed)
    }

    async fn compact_latest(&self, share: f64, context: Arc<TaskContext>) -> Result<usize> {
        let pin = self.tables.pin_latest()?;
        let Some(snapshot) = self
            .tables
            .store()
            .snapshot(&self.snapshot.table.name, pin.version())?
        else {
            return Ok(0);
        };
        if snapshot.table.id != self.snapshot.table.id {
            return Ok(0);
        }
        let cluster_table = self.tables.cluster_table(&snapshot, &pin);
        super::compact::compact(
            &self.tables,
            &self.catalog,
            &self.traffic,
            &snapshot,
            &cluster_table,
            share,
            context,
        )
        .await
    }

    /// The rows of `slice` the fragment keeps, with their positions, from
    /// its replicas in turn (a raw answer completed here).
    async fn slice_rows(
        &self,
        slice: &ClusterSlice,
        body: &[u8],
        decoded: &DecodedBody,
        shipped: &SchemaRef,
        context: &Arc<TaskContext>,
    ) -> Result<Vec<RecordBatch>> {
        let mut envelope = FragmentEnvelope::new(
            self.cluster_table.name.clone(),
            slice.summary.slice,
            body.to_vec(),
        );
        envelope.row_positions = true;
        if let Some((deleted, _)) = &slice.deleted {
            envelope = envelope.with_deleted(deleted);
        }
        let encoded = prost::Message::encode_to_vec(&envelope);
        let mut last_error = None;
        for node in self.catalog.replica_order(slice) {
            let client = &self.catalog.clients[node];
            let mut parts =
                client.stream_slice(encoded.clone(), Arc::clone(&self.traffic), SLICE_TIMEOUT);
            let mut batches = Vec::new();
            let mut complete = false;
            let mut failed = None;
            while let Some(part) = parts.next().await {
                match part {
                    Ok(SlicePart::Batch(batch)) => {
                        batches.push(sieve_fragment::widen(batch, shipped)?)
                    }
                    Ok(SlicePart::Raw(pages)) => {
                        let deleted = slice
                            .deleted
                            .as_ref()
                            .map(|(bytes, _)| decode_deletions(bytes))
                            .transpose()?;
                        let mut stream = crate::raw::complete_raw(
                            pages,
                            decoded,
                            &self.snapshot.table.schema,
                            Arc::clone(context),
                            context.session_config().batch_size(),
                            deleted.as_ref(),
                            true,
                        )?;
                        while let Some(batch) = stream.next().await {
                            batches.push(batch?);
                        }
                    }
                    Ok(SlicePart::Done { .. }) => {
                        complete = true;
                        break;
                    }
                    Ok(SlicePart::Failed { reason, .. }) => {
                        failed = Some(DataFusionError::Execution(reason));
                        break;
                    }
                    Err(error) => {
                        if crate::as_node_failure(&error).is_none() {
                            return Err(error);
                        }
                        failed = Some(error);
                        break;
                    }
                }
            }
            if complete {
                return Ok(batches);
            }
            self.catalog.mark_failed(node);
            last_error = failed;
        }
        match last_error {
            Some(error) => Err(error),
            None => exec_err!("slice {} has no replica to read", slice.summary.slice),
        }
    }
}

/// `old` with each column replaced by its new value.
fn updated(
    old: &RecordBatch,
    values: &[Arc<dyn PhysicalExpr>],
    schema: &SchemaRef,
) -> Result<RecordBatch> {
    let columns: Vec<ArrayRef> = values
        .iter()
        .zip(schema.fields())
        .map(|(value, field)| {
            let array = value.evaluate(old)?.into_array(old.num_rows())?;
            if array.data_type() == field.data_type() {
                Ok(array)
            } else {
                Ok(arrow::compute::cast(&array, field.data_type())?)
            }
        })
        .collect::<Result<_>>()?;
    Ok(RecordBatch::try_new(Arc::clone(schema), columns)?)
}

impl DisplayAs for ChangeRowsExec {
    fn fmt_as(&self, _: DisplayFormatType, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.change {
            RowChange::Delete => "DELETE",
            RowChange::Update(_) => "UPDATE",
        };
        write!(
            formatter,
            "ChangeRowsExec: {what} {} at version {}, slices={}",
            self.snapshot.table.name,
            self.snapshot.version,
            self.snapshot.slices.len()
        )?;
        if let Some(predicate) = &self.predicate {
            write!(formatter, ", rows where {predicate}")?;
        }
        Ok(())
    }
}

impl ExecutionPlan for ChangeRowsExec {
    fn name(&self) -> &str {
        "ChangeRowsExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        match &self.predicate {
            Some(predicate) => f(predicate),
            None => Ok(TreeNodeRecursion::Continue),
        }
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![]
    }

    fn with_new_children(
        self: Arc<Self>,
        _children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        Ok(self)
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        if partition != 0 {
            return exec_err!("ChangeRowsExec has one partition");
        }
        let this = Arc::new(Self {
            tables: Arc::clone(&self.tables),
            catalog: Arc::clone(&self.catalog),
            traffic: Arc::clone(&self.traffic),
            snapshot: self.snapshot.clone(),
            cluster_table: Arc::clone(&self.cluster_table),
            predicate: self.predicate.clone(),
            change: self.change.clone(),
            statement: self.statement.clone(),
            properties: Arc::clone(&self.properties),
        });
        let stream = futures::stream::once(async move {
            let rows = this.run(context).await?;
            Ok(RecordBatch::try_new(
                count_schema(),
                vec![Arc::new(UInt64Array::from(vec![rows]))],
            )?)
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            count_schema(),
            stream,
        )))
    }
}
