//! Rows into slices: the compute side of the write path.
//!
//! A [`TableWriter`] takes batches of the table's schema, holds them until
//! a slice is full (`slice_rows`, or [`SLICE_BUFFER_BYTES_MAX`] of Arrow
//! memory, whichever comes first), sorts the slice by the table's sort key,
//! writes it as a Parquet slice file in a staging directory (the layout
//! `sieve gen` writes: page index, page statistics, Bloom filters, distinct
//! counts, page checksums) and sends it to R storage nodes. Up to
//! [`SLICES_ENCODING_MAX`] slices are encoded and sent on other threads
//! while the next slice's rows are read, so a load uses every core; at
//! most that many slices and the one filling are in memory.
//! Nothing is visible until [`TableWriter::commit`]; a writer dropped or
//! [`TableWriter::abandon`]ed leaves no slice behind that a version names.

use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::compute::{cast, concat_batches, lexsort_to_indices, take_record_batch, SortColumn};
use arrow::datatypes::SchemaRef;
use arrow::row::{OwnedRow, RowConverter, SortField};
use datafusion::common::{exec_err, DFSchema, DataFusionError, Result, ScalarValue};
use parquet::schema::types::ColumnPath;
use tokio::task::JoinHandle;

use sieve_format::{LayoutPlan, PlannerSettings};

use super::{Change, OwnedTables, TableEntry, WrittenSlice};

/// Arrow memory one slice may hold before it is written, whatever its rows.
pub const SLICE_BUFFER_BYTES_MAX: usize = 128 * 1024 * 1024;

/// Slices of one writer encoded and sent at once, while the next is read:
/// a load's memory is bounded by this many slices plus the one filling.
pub const SLICES_ENCODING_MAX: usize = 2;

/// Writes one statement's rows into new slices of one table.
pub struct TableWriter {
    tables: Arc<OwnedTables>,
    table: TableEntry,
    schema: SchemaRef,
    buffer: Vec<RecordBatch>,
    buffered_rows: usize,
    buffered_bytes: usize,
    /// The slices being encoded and sent, oldest first (at most
    /// [`SLICES_ENCODING_MAX`]).
    pending: std::collections::VecDeque<JoinHandle<Result<WrittenSlice>>>,
    written: Vec<WrittenSlice>,
    /// Reserved slices, with their nodes, whether or not they were sent.
    reserved: Vec<(u32, Vec<usize>)>,
    rows: u64,
    /// Where the next slice's first copy goes.
    next_node: usize,
    /// The layout plan of this statement's slices, made from the first
    /// slice written (`layout = 'planned'` tables).
    plan: SharedPlan,
    /// The full slice's last value of the sort key's first column, while
    /// the slice takes the rest of that value's rows (rows that arrive in
    /// key order then leave each key value in one slice; see
    /// [`KEY_RUN_ROWS_MAX`]).
    closing_key: Option<ScalarValue>,
    /// The sort key's first column, if the table has a sort key.
    key_column: Option<usize>,
    finished: bool,
}

/// A full slice takes up to `slice_rows / KEY_RUN_ROWS_MAX` more rows (and
/// [`SLICE_BUFFER_BYTES_MAX`]` / KEY_RUN_ROWS_MAX` more bytes), so
/// that the rows of its last key value arriving after it stay with it: a
/// load in key order then has slices with disjoint key ranges, and a
/// grouping on the key is complete within each slice (the storage nodes
/// finish it: `optimizer.rs`). A longer run of one value is cut.
pub(crate) const KEY_RUN_ROWS_MAX: usize = 8;

/// A statement's layout plan: `None` until its first slice plans it, then
/// the plan (`None` inside: too few rows to plan on, the fixed layout).
type SharedPlan = Arc<std::sync::Mutex<Option<Option<Arc<LayoutPlan>>>>>;

impl std::fmt::Debug for TableWriter {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("TableWriter")
            .field("table", &self.table.name)
            .field("rows", &self.rows)
            .finish_non_exhaustive()
    }
}

/// Most bytes a view column's buffers may hold per byte its strings use
/// before the writer compacts it ([`sieve_fragment::compact_views`]).
const VIEW_WASTE_MAX: f64 = 2.0;

impl TableWriter {
    /// A writer of new slices of `table`.
    pub fn new(tables: Arc<OwnedTables>, table: TableEntry) -> Self {
        let schema = Arc::clone(&table.schema);
        // Spread tables over the nodes: each starts at a node of its own.
        let next_node = (table.id as usize) % tables.nodes().max(1);
        let key_column = table
            .layout
            .sort_key
            .first()
            .and_then(|name| schema.index_of(name).ok());
        Self {
            tables,
            table,
            schema,
            buffer: Vec::new(),
            buffered_rows: 0,
            buffered_bytes: 0,
            pending: std::collections::VecDeque::new(),
            written: Vec::new(),
            reserved: Vec::new(),
            rows: 0,
            next_node,
            plan: SharedPlan::default(),
            closing_key: None,
            key_column,
            finished: false,
        }
    }

    /// Rows taken so far.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Take `batch`, which must have the table's column types in order
    /// (names may differ); writes a slice when one is full.
    pub async fn write(&mut self, batch: RecordBatch) -> Result<()> {
        if batch.num_columns() != self.schema.fields().len() {
            return exec_err!(
                "table '{}' has {} columns; {} were given",
                self.table.name,
                self.schema.fields().len(),
                batch.num_columns()
            );
        }
        let mut columns = Vec::with_capacity(batch.num_columns());
        for (field, column) in self.schema.fields().iter().zip(batch.columns()) {
            // Another encoding of the same values (a string parameter of a
            // prepared INSERT arrives as Utf8View for a Utf8 column; a
            // dictionary for its values) is stored as the table's type, as
            // DataFusion's insert planning takes it.
            let column = if field.data_type() == column.data_type() {
                Arc::clone(column)
            } else if DFSchema::datatype_is_logically_equal(field.data_type(), column.data_type()) {
                cast(column, field.data_type())?
            } else {
                return exec_err!(
                    "column '{}' of table '{}' is {}, not {}",
                    field.name(),
                    self.table.name,
                    field.data_type(),
                    column.data_type()
                );
            };
            if !field.is_nullable() && column.null_count() > 0 {
                return exec_err!(
                    "column '{}' of table '{}' is NOT NULL; a NULL was given",
                    field.name(),
                    self.table.name
                );
            }
            columns.push(column);
        }
        let batch = RecordBatch::try_new(Arc::clone(&self.schema), columns)?;
        // Rows that come sorted or joined hold view columns pointing into
        // every batch their rows came from: counted as they are, each batch
        // would weigh all of those buffers and cut a slice per batch (a
        // sorted copy of TPC-H lineitem came out as 733 slices of 8,192
        // rows). Compacted, a batch weighs its own strings.
        let batch = sieve_fragment::compact_views(batch, VIEW_WASTE_MAX)?;
        let slice_rows = self.table.layout.slice_rows.max(1) as usize;
        let extra_rows_max = slice_rows / KEY_RUN_ROWS_MAX;
        let mut offset = 0;
        while offset < batch.num_rows() {
            let take = match (&self.closing_key, self.key_column) {
                // The full slice takes the rest of its last key value's rows.
                (Some(last), Some(column)) => {
                    let run = key_run(batch.column(column), offset, last)?;
                    if run == 0 {
                        self.flush().await?;
                        continue;
                    }
                    run.min(slice_rows + extra_rows_max - self.buffered_rows)
                }
                _ => (slice_rows - self.buffered_rows).min(batch.num_rows() - offset),
            };
            let part = batch.slice(offset, take);
            offset += take;
            self.rows += take as u64;
            self.tables.progress().took(take as u64);
            self.buffered_rows += take;
            self.buffered_bytes += part.get_array_memory_size();
            let last_key = match self.key_column {
                Some(column) if take > 0 => {
                    Some(ScalarValue::try_from_array(part.column(column), take - 1)?)
                }
                _ => None,
            };
            self.buffer.push(part);
            if self.buffered_bytes
                >= SLICE_BUFFER_BYTES_MAX + SLICE_BUFFER_BYTES_MAX / KEY_RUN_ROWS_MAX
                || self.buffered_rows >= slice_rows + extra_rows_max
            {
                self.flush().await?;
            } else if self.buffered_rows >= slice_rows
                || self.buffered_bytes >= SLICE_BUFFER_BYTES_MAX
            {
                match last_key {
                    // Rows after this batch may still hold the last value.
                    Some(last) if extra_rows_max > 0 => self.closing_key = Some(last),
                    _ => self.flush().await?,
                }
            }
        }
        Ok(())
    }

    /// Write every batch of `batches`; on the first error (of the stream
    /// or of a write), abandon the slices written so far and return it.
    pub async fn write_stream<S>(mut self, mut batches: S) -> Result<Self>
    where
        S: futures::Stream<Item = Result<RecordBatch>> + Unpin,
    {
        use futures::StreamExt;
        while let Some(batch) = batches.next().await {
            let written = match batch {
                Ok(batch) => self.write(batch).await,
                Err(error) => Err(error),
            };
            if let Err(error) = written {
                self.abandon().await;
                return Err(error);
            }
        }
        Ok(self)
    }

    /// Write the rows taken so far as a slice, even if it is not full: the
    /// rows that follow go to another slice.
    pub async fn end_slice(&mut self) -> Result<()> {
        self.flush().await
    }

    /// Start writing the buffered rows as a slice (after the one before
    /// it is done).
    async fn flush(&mut self) -> Result<()> {
        if self.buffered_rows == 0 {
            return Ok(());
        }
        while self.pending.len() >= SLICES_ENCODING_MAX {
            self.wait_oldest().await?;
        }
        let batches = std::mem::take(&mut self.buffer);
        self.closing_key = None;
        self.buffered_rows = 0;
        self.buffered_bytes = 0;
        let nodes = self.choose_nodes();
        let slice = self.tables.store().reserve_slice(self.table.id, &nodes)?;
        self.reserved.push((slice, nodes.clone()));
        let tables = Arc::clone(&self.tables);
        let table = self.table.clone();
        let schema = Arc::clone(&self.schema);
        let plan = Arc::clone(&self.plan);
        self.pending.push_back(tokio::spawn(async move {
            write_slice(tables, table, schema, batches, slice, nodes, plan).await
        }));
        Ok(())
    }

    async fn wait_oldest(&mut self) -> Result<()> {
        if let Some(pending) = self.pending.pop_front() {
            let written = pending
                .await
                .map_err(|error| DataFusionError::External(Box::new(error)))??;
            self.written.push(written);
        }
        Ok(())
    }

    async fn wait_pending(&mut self) -> Result<()> {
        while !self.pending.is_empty() {
            self.wait_oldest().await?;
        }
        Ok(())
    }

    /// The nodes of the next slice: `replicas` of them, round the ring,
    /// passing over nodes that failed a write lately while enough others
    /// are left.
    fn choose_nodes(&mut self) -> Vec<usize> {
        let count = self.tables.nodes().max(1);
        let replicas = self.table.layout.replicas.clamp(1, count);
        let first = self.next_node % count;
        self.next_node = (first + 1) % count;
        let ring = (0..count).map(|step| (first + step) % count);
        let healthy: Vec<usize> = ring
            .clone()
            .filter(|&node| !self.tables.write_suspect(node))
            .collect();
        if healthy.len() >= replicas {
            healthy[..replicas].to_vec()
        } else {
            ring.take(replicas).collect()
        }
    }

    /// Write what is left and commit every slice of this writer, with
    /// `change` (slices removed, the table published), as one version.
    /// Returns the version and the rows written. On failure nothing is
    /// committed and the slices written are removed.
    pub async fn commit(mut self, mut change: Change, statement: &str) -> Result<(u64, u64)> {
        let result = async {
            self.flush().await?;
            self.wait_pending().await?;
            change.added = std::mem::take(&mut self.written);
            self.tables
                .store()
                .commit(self.table.id, &change, statement)
        }
        .await;
        match result {
            Ok(version) => {
                self.finished = true;
                if !change.removed.is_empty() {
                    if let Err(error) = self.tables.purge().await {
                        log::warn!("removing slices no version reads failed: {error}");
                    }
                }
                Ok((version, self.rows))
            }
            Err(error) => {
                self.abandon().await;
                Err(error)
            }
        }
    }

    /// Give up: remove the slices written so far from their nodes.
    pub async fn abandon(mut self) {
        for pending in std::mem::take(&mut self.pending) {
            let _ = pending.await;
        }
        self.finished = true;
        let reserved = std::mem::take(&mut self.reserved);
        self.tables
            .abandon(&self.table.storage_name(), &reserved)
            .await;
    }
}

impl Drop for TableWriter {
    fn drop(&mut self) {
        if self.finished || self.reserved.is_empty() {
            return;
        }
        // Dropped mid-statement (cancelled): clean up in the background;
        // what this misses, the next catalog open removes.
        let tables = Arc::clone(&self.tables);
        let storage_name = self.table.storage_name();
        let reserved = std::mem::take(&mut self.reserved);
        let pending = std::mem::take(&mut self.pending);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                for pending in pending {
                    let _ = pending.await;
                }
                tables.abandon(&storage_name, &reserved).await;
            });
        }
    }
}

/// The statement's layout plan: the one made already, or one made now from
/// `batches` (sorted as the slice is). Slices encoded at once wait for the
/// first to plan, so every slice of a statement has the same layout.
fn statement_plan(
    shared: &SharedPlan,
    table: &TableEntry,
    schema: &SchemaRef,
    batches: &[RecordBatch],
) -> Result<Option<Arc<LayoutPlan>>> {
    let mut shared = shared
        .lock()
        .map_err(|_| DataFusionError::Internal("a slice writer panicked while planning".into()))?;
    if let Some(plan) = shared.as_ref() {
        return Ok(plan.clone());
    }
    let settings = PlannerSettings {
        page_rows: usize::try_from(table.layout.page_rows).unwrap_or(usize::MAX),
        ..PlannerSettings::default()
    };
    let mut bloom_columns: Vec<String> = schema
        .fields()
        .iter()
        .map(|field| field.name().clone())
        .filter(|name| name.ends_with("key"))
        .collect();
    bloom_columns.extend(table.layout.sort_key.iter().cloned());
    let planned = sieve_format::planner::sample(schema, batches, &settings)
        .and_then(|sample| sieve_format::planner::plan_layout(&sample, &bloom_columns, &settings));
    // A plan is an optimisation: where the planner cannot plan, the load
    // goes on in the fixed layout.
    let plan = match planned {
        Ok(plan) => plan.map(Arc::new),
        Err(error) => {
            log::warn!(
                "the layout of '{}' could not be planned ({error}); its slices take the fixed layout",
                table.name
            );
            None
        }
    };
    *shared = Some(plan.clone());
    Ok(plan)
}

/// Sort, encode and send one slice; returns what the commit records.
async fn write_slice(
    tables: Arc<OwnedTables>,
    table: TableEntry,
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
    slice: u32,
    nodes: Vec<usize>,
    plan: SharedPlan,
) -> Result<WrittenSlice> {
    let storage_name = table.storage_name();
    let staging = tables.staging().to_path_buf();
    let path = staging.join(sieve_format::slice_file_name(&storage_name, slice));
    let encoded = {
        let path = path.clone();
        let table = table.clone();
        tokio::task::spawn_blocking(move || -> Result<()> {
            // Rows that arrive in the key's order (a load of sorted data,
            // `sieve gen`'s) are written as they are: no copy, no sort.
            let batches = if in_key_order(&batches, &table.layout.sort_key)? {
                batches
            } else {
                let batch = concat_batches(&schema, &batches)?;
                drop(batches);
                vec![sort_by_key(&batch, &table.layout.sort_key)?]
            };
            let layout = table.layout.slice_layout();
            let mut properties = layout.writer_properties(&schema).into_builder();
            for column in &table.layout.sort_key {
                let column = ColumnPath::from(column.as_str());
                properties = properties
                    .set_column_bloom_filter_enabled(column.clone(), true)
                    .set_column_bloom_filter_fpp(column, layout.bloom_filter_fpp);
            }
            if table.layout.planned {
                if let Some(plan) = statement_plan(&plan, &table, &schema, &batches)? {
                    properties = plan.apply(properties).set_key_value_metadata(Some(vec![
                        parquet::file::metadata::KeyValue::new(
                            sieve_format::LAYOUT_PLAN_KEY.to_string(),
                            plan.to_json(),
                        ),
                    ]));
                }
            }
            sieve_format::write_slice_with_properties(
                &path,
                &schema,
                properties.build(),
                None,
                batches.into_iter().map(Ok),
            )
            .map_err(|error| DataFusionError::Execution(format!("writing a slice: {error}")))?;
            Ok(())
        })
        .await
        .map_err(|error| DataFusionError::External(Box::new(error)))?
    };
    let sent = match encoded {
        Ok(()) => send(&tables, &storage_name, slice, &nodes, &path).await,
        Err(error) => Err(error),
    };
    let bytes = tokio::fs::metadata(&path)
        .await
        .map_or(0, |meta| meta.len());
    let _ = tokio::fs::remove_file(&path).await;
    let (summary, nodes) = sent?;
    tables.progress().stored(bytes);
    Ok(WrittenSlice {
        slice,
        nodes,
        summary,
    })
}

/// Send the slice file to every node of `nodes`, all at once. A node that
/// fails as a node (down, unreachable: [`crate::as_node_failure`]) is
/// replaced by another that holds no copy yet, while there is one; any
/// other failure (a full disk, a refused put) fails the slice. Returns the
/// summary and the nodes that hold the slice.
async fn send(
    tables: &OwnedTables,
    storage_name: &str,
    slice: u32,
    nodes: &[usize],
    path: &std::path::Path,
) -> Result<(sieve_format::SliceSummary, Vec<usize>)> {
    let mut holding = Vec::with_capacity(nodes.len());
    let mut tried: Vec<usize> = nodes.to_vec();
    let mut summary = None;
    let mut to_send: Vec<usize> = nodes.to_vec();
    while !to_send.is_empty() {
        let answers = futures::future::join_all(
            to_send
                .iter()
                .map(|node| tables.client(*node).put_slice(storage_name, slice, path)),
        )
        .await;
        let mut again = Vec::new();
        for (node, answer) in std::mem::take(&mut to_send).into_iter().zip(answers) {
            match answer {
                Ok(answer) => {
                    holding.push(node);
                    summary.get_or_insert(answer);
                }
                Err(error) if crate::as_node_failure(&error).is_some() => {
                    tables.mark_write_failed(node);
                    let replacement = (0..tables.nodes())
                        .find(|candidate| {
                            !tried.contains(candidate) && !tables.write_suspect(*candidate)
                        })
                        .ok_or(error)?;
                    log::warn!(
                        "slice {slice} of {storage_name}: node {node} failed, sending it to node {replacement}"
                    );
                    tried.push(replacement);
                    again.push(replacement);
                }
                Err(error) => return Err(error),
            }
        }
        to_send = again;
    }
    let summary =
        summary.ok_or_else(|| DataFusionError::Internal("a slice with no node".to_string()))?;
    Ok((summary, holding))
}

/// Whether the rows of `batches`, in order, are sorted by the columns `key`
/// as [`sort_by_key`] sorts (ascending, NULLs first); with no key, yes.
/// Rows of `column` from `offset` on that equal `value` (NULL equals NULL).
fn key_run(column: &arrow::array::ArrayRef, offset: usize, value: &ScalarValue) -> Result<usize> {
    let mut end = offset;
    while end < column.len() && ScalarValue::try_from_array(column, end)? == *value {
        end += 1;
    }
    Ok(end - offset)
}

fn in_key_order(batches: &[RecordBatch], key: &[String]) -> Result<bool> {
    let Some(first) = batches.first() else {
        return Ok(true);
    };
    if key.is_empty() {
        return Ok(true);
    }
    let schema = first.schema();
    let indices = key
        .iter()
        .map(|name| schema.index_of(name))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let converter = RowConverter::new(
        indices
            .iter()
            .map(|&index| SortField::new(schema.field(index).data_type().clone()))
            .collect(),
    )?;
    let mut last: Option<OwnedRow> = None;
    for batch in batches.iter().filter(|batch| batch.num_rows() > 0) {
        let columns: Vec<_> = indices
            .iter()
            .map(|&index| Arc::clone(batch.column(index)))
            .collect();
        let rows = converter.convert_columns(&columns)?;
        if last.as_ref().is_some_and(|last| last.row() > rows.row(0)) {
            return Ok(false);
        }
        if (1..rows.num_rows()).any(|at| rows.row(at - 1) > rows.row(at)) {
            return Ok(false);
        }
        last = Some(rows.row(rows.num_rows() - 1).owned());
    }
    Ok(true)
}

/// `batch` sorted by the columns `key` (ascending, NULLs first), or as it is.
fn sort_by_key(batch: &RecordBatch, key: &[String]) -> Result<RecordBatch> {
    if key.is_empty() || batch.num_rows() < 2 {
        return Ok(batch.clone());
    }
    let columns = key
        .iter()
        .map(|name| {
            let index = batch.schema().index_of(name)?;
            Ok(SortColumn {
                values: Arc::clone(batch.column(index)),
                options: None,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let indices = lexsort_to_indices(&columns, None)?;
    Ok(take_record_batch(batch, &indices)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};

    fn batch(keys: &[Option<i64>], names: &[&str]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, true),
            Field::new("s", DataType::Utf8, false),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from(keys.to_vec())),
                Arc::new(StringArray::from(names.to_vec())),
            ],
        )
        .unwrap()
    }

    #[test]
    fn rows_in_key_order_are_told_from_rows_that_need_a_sort() {
        let key = vec!["k".to_string()];
        let sorted = [
            batch(&[None, Some(1), Some(1)], &["a", "b", "c"]),
            batch(&[], &[]),
            batch(&[Some(1), Some(5)], &["a", "b"]),
        ];
        assert!(in_key_order(&sorted, &key).unwrap());
        // NULLs sort first, as sort_by_key puts them.
        let null_late = [batch(&[Some(1), None], &["a", "b"])];
        assert!(!in_key_order(&null_late, &key).unwrap());
        // Out of order across a batch boundary, and within a batch.
        let across = [
            batch(&[Some(1), Some(7)], &["a", "b"]),
            batch(&[Some(6)], &["c"]),
        ];
        assert!(!in_key_order(&across, &key).unwrap());
        let within = [batch(&[Some(2), Some(1)], &["a", "b"])];
        assert!(!in_key_order(&within, &key).unwrap());
        // Two columns: the second breaks ties.
        let both = vec!["k".to_string(), "s".to_string()];
        assert!(in_key_order(&[batch(&[Some(1), Some(1)], &["a", "b"])], &both).unwrap());
        assert!(!in_key_order(&[batch(&[Some(1), Some(1)], &["b", "a"])], &both).unwrap());
        // No key: rows stay in arrival order.
        assert!(in_key_order(&within, &[]).unwrap());
    }
}
