//! Bulk loads of Arrow batches a client sends: Flight SQL's
//! `CommandStatementIngest`, what ADBC's `adbc_ingest` and the ADBC
//! writers of pandas and polars use. The batches stream into slices as
//! they arrive (a slice's rows at a time in memory, as `CREATE TABLE ...
//! AS` and `COPY` write), and the load is one commit: a client that stops
//! halfway, or a batch that cannot be stored, leaves the table as it was.
//!
//! | the table | `Create` when missing | `Append` | `Replace` | `Fail` when present |
//! |---|---|---|---|---|
//! | missing | created with the batches' columns, then loaded | error | error | n/a |
//! | present | n/a | rows added | its rows replaced in the same commit | error |
//!
//! Columns go to the table's by name when the batches have every one of
//! the table's names, else by position; each is cast to the table's type,
//! and a value that does not fit is an error, never a NULL. `Replace`
//! keeps the table's columns (it replaces rows, not the table): batches
//! whose columns cannot be the table's are refused before anything is
//! written.

use std::sync::Arc;

use arrow::array::{ArrayRef, AsArray, RecordBatch};
use arrow::compute::{can_cast_types, cast_with_options, CastOptions};
use arrow::datatypes::{Field, Schema, SchemaRef, UInt64Type};
use datafusion::common::{exec_err, plan_err, DataFusionError, Result};
use datafusion::logical_expr::dml::InsertOp;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{collect, SendableRecordBatchStream};
use datafusion::prelude::SessionContext;
use futures::StreamExt;

use super::statements::{check_types, owned, REPLICAS_DEFAULT};
use super::{Change, TableLayout, TableWriter};
use crate::spill_join::OnceStreamExec;
use crate::ClusterCatalog;

/// What a load does when its table is missing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IfMissing {
    /// Create the table with the batches' columns.
    Create,
    /// Refuse the load.
    Fail,
}

/// What a load does when its table is there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IfPresent {
    /// Add the rows.
    Append,
    /// Replace the table's rows with the batches', in one commit.
    Replace,
    /// Refuse the load.
    Fail,
}

/// Load `batches` into table `name` of the tables users own; the rows
/// loaded.
pub async fn ingest(
    context: &SessionContext,
    name: &str,
    if_missing: IfMissing,
    if_present: IfPresent,
    batches: SendableRecordBatchStream,
) -> Result<u64> {
    let Some(catalog) = context.state().config().get_extension::<ClusterCatalog>() else {
        return plan_err!("this session has no cluster catalog: tables cannot be loaded");
    };
    let owned = owned(&catalog)?;
    let name = name.strip_prefix("public.").unwrap_or(name);
    sieve_format::writes::check_table_name(name).map_err(DataFusionError::Plan)?;
    let statement = format!("INGEST INTO {name}");
    if !context.table_exist(name)? {
        if if_missing == IfMissing::Fail {
            return plan_err!("table '{name}' does not exist (load with create to make it)");
        }
        let given = batches.schema();
        let schema = Schema::new(
            given
                .fields()
                .iter()
                .map(|field| {
                    Field::new(field.name(), field.data_type().clone(), field.is_nullable())
                })
                .collect::<Vec<_>>(),
        );
        check_types(&schema)?;
        for (index, field) in schema.fields().iter().enumerate() {
            if schema.fields()[..index]
                .iter()
                .any(|earlier| earlier.name() == field.name())
            {
                return plan_err!("column '{}' is given twice", field.name());
            }
        }
        let layout = TableLayout::with_replicas(REPLICAS_DEFAULT.min(owned.nodes().max(1)));
        // Invisible until its rows are in, in one commit.
        let (table, _) = owned
            .store()
            .create_table(name, &schema, &layout, false, &statement)?;
        let writer = TableWriter::new(Arc::clone(owned), table)
            .write_stream(batches)
            .await?;
        let change = Change {
            publish: true,
            ..Change::default()
        };
        let (_, rows) = writer.commit(change, &statement).await?;
        return Ok(rows);
    }
    let op = match if_present {
        IfPresent::Fail => {
            return plan_err!("table '{name}' already exists (load with append or replace)")
        }
        IfPresent::Append => InsertOp::Append,
        IfPresent::Replace => InsertOp::Overwrite,
    };
    let provider = context.table_provider(name).await?;
    let target = provider.schema();
    let positions = positions(&batches.schema(), &target)?;
    let conformed = {
        let target = Arc::clone(&target);
        batches.map(move |batch| conform(&batch?, &positions, &target))
    };
    let input = Arc::new(OnceStreamExec::new(Box::pin(
        RecordBatchStreamAdapter::new(Arc::clone(&target), conformed),
    )));
    let state = context.state();
    let plan = provider.insert_into(&state, input, op).await?;
    let answers = collect(plan, context.task_ctx()).await?;
    Ok(answers
        .iter()
        .filter_map(|batch| batch.column_by_name("count"))
        .filter_map(|counts| counts.as_primitive_opt::<UInt64Type>())
        .flat_map(|counts| counts.iter().flatten())
        .sum())
}

/// For each of the table's columns, the given column that fills it: by
/// name when every name is there, else by position; refused when a type
/// cannot be cast.
fn positions(given: &SchemaRef, target: &SchemaRef) -> Result<Vec<usize>> {
    let by_name: Option<Vec<usize>> = target
        .fields()
        .iter()
        .map(|field| given.index_of(field.name()).ok())
        .collect();
    let positions = match by_name {
        Some(positions) => positions,
        None if given.fields().len() == target.fields().len() => {
            (0..target.fields().len()).collect()
        }
        None => {
            return plan_err!(
            "the batches have {} columns and not all of the table's names; the table has {} ({})",
            given.fields().len(),
            target.fields().len(),
            target
                .fields()
                .iter()
                .map(|field| field.name().as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )
        }
    };
    for (field, &position) in target.fields().iter().zip(&positions) {
        let from = given.field(position).data_type();
        if from != field.data_type() && !can_cast_types(from, field.data_type()) {
            return plan_err!(
                "column '{}' is {}; the batches' column '{}' is {}, which cannot be cast to it",
                field.name(),
                field.data_type(),
                given.field(position).name(),
                from
            );
        }
    }
    Ok(positions)
}

/// `batch`'s columns as the table's: chosen by `positions`, cast to the
/// table's types, a value that does not fit an error.
fn conform(batch: &RecordBatch, positions: &[usize], target: &SchemaRef) -> Result<RecordBatch> {
    let options = CastOptions {
        safe: false,
        ..CastOptions::default()
    };
    let columns = target
        .fields()
        .iter()
        .zip(positions)
        .map(|(field, &position)| {
            // A stream may change its schema midway; the rows then do not fit.
            let Some(column) = batch.columns().get(position) else {
                return exec_err!(
                    "a batch has {} columns, fewer than the load's first",
                    batch.num_columns()
                );
            };
            if column.data_type() == field.data_type() {
                return Ok(Arc::clone(column));
            }
            cast_with_options(column, field.data_type(), &options).map_err(|error| {
                DataFusionError::Execution(format!(
                    "column '{}': a value cannot be {}: {error}",
                    field.name(),
                    field.data_type()
                ))
            })
        })
        .collect::<Result<Vec<ArrayRef>>>()?;
    if columns.len() != target.fields().len() {
        return exec_err!("the batch does not fill the table's columns");
    }
    Ok(RecordBatch::try_new(Arc::clone(target), columns)?)
}
