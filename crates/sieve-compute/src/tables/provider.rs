//! A table a user owns, as DataFusion sees it: reads through
//! [`SieveTable`] at one version, writes through DataFusion's DML hooks.

use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use datafusion::catalog::{Session, TableProvider};
use datafusion::common::{not_impl_err, DFSchema, Result, Statistics};
use datafusion::datasource::TableType;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::dml::InsertOp;
use datafusion::logical_expr::{Expr, TableProviderFilterPushDown};
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan};
use datafusion_datasource::sink::{DataSink, DataSinkExec};

use super::delete::{ChangeRowsExec, RowChange};
use super::{Change, OwnedTables, Snapshot, TableWriter, VersionPin};
use crate::copies::TableCopy;
use crate::{ClusterCatalog, ClusterTable, SieveTable, Traffic};

/// A table a user owns, at the version it was looked up at.
#[derive(Debug)]
pub struct OwnedTable {
    tables: Arc<OwnedTables>,
    snapshot: Snapshot,
    read: SieveTable,
    catalog: Arc<ClusterCatalog>,
    traffic: Arc<Traffic>,
    cluster_table: Arc<ClusterTable>,
}

impl OwnedTable {
    /// Table `name` at the latest version, or `None` if there is none.
    pub fn latest(
        tables: &Arc<OwnedTables>,
        catalog: &Arc<ClusterCatalog>,
        traffic: &Arc<Traffic>,
        name: &str,
    ) -> Result<Option<Self>> {
        let pin: VersionPin = tables.pin_latest()?;
        Self::at_pin(tables, catalog, traffic, name, &pin)
    }

    /// This table at `pin`'s version (what [`super::ReadOneVersion`] binds
    /// a statement's tables to). Fails if the table was dropped by then,
    /// or dropped and created again with other columns. One created again
    /// with the same columns is bound as it is now: a prepared statement
    /// (a client's, kept across a `DROP TABLE` and `CREATE TABLE` of the
    /// same table, as psycopg keeps them) reads the table that is there,
    /// as PostgreSQL plans a prepared statement again.
    pub fn at(&self, pin: &VersionPin) -> Result<Self> {
        let name = &self.snapshot.table.name;
        match Self::at_pin(&self.tables, &self.catalog, &self.traffic, name, pin)? {
            Some(table) if table.snapshot.table.id == self.snapshot.table.id => Ok(table),
            Some(table)
                if table.snapshot.table.schema.fields() == self.snapshot.table.schema.fields() =>
            {
                Ok(table)
            }
            Some(_) => datafusion::common::plan_err!(
                "table '{name}' was dropped and created again with other columns since this statement was planned; plan it again (prepare it again)"
            ),
            None => datafusion::common::plan_err!(
                "table '{name}' was dropped (at version {}) before this statement ran",
                pin.version()
            ),
        }
    }

    /// The catalog this table is in.
    pub fn tables(&self) -> &Arc<OwnedTables> {
        &self.tables
    }

    fn at_pin(
        tables: &Arc<OwnedTables>,
        catalog: &Arc<ClusterCatalog>,
        traffic: &Arc<Traffic>,
        name: &str,
        pin: &VersionPin,
    ) -> Result<Option<Self>> {
        let Some(snapshot) = tables.store().snapshot(name, pin.version())? else {
            return Ok(None);
        };
        let cluster_table = Arc::new(tables.cluster_table(&snapshot, pin));
        let copies = current_copies(tables, &snapshot, pin)?;
        Ok(Some(Self {
            tables: Arc::clone(tables),
            read: SieveTable::new(
                Arc::clone(&cluster_table),
                Arc::clone(catalog),
                Arc::clone(traffic),
            )
            .with_copies(copies),
            snapshot,
            catalog: Arc::clone(catalog),
            traffic: Arc::clone(traffic),
            cluster_table,
        }))
    }

    /// The provider that reads the table's slices at this version.
    pub fn reader(&self) -> &SieveTable {
        &self.read
    }

    /// The table and its slices at the version this provider reads.
    pub fn snapshot(&self) -> &Snapshot {
        &self.snapshot
    }

    /// The version this provider reads.
    pub fn version(&self) -> u64 {
        self.snapshot.version
    }
}

#[async_trait]
impl TableProvider for OwnedTable {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.snapshot.table.schema)
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    fn statistics(&self) -> Option<Statistics> {
        self.read.statistics()
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> Result<Vec<TableProviderFilterPushDown>> {
        self.read.supports_filters_pushdown(filters)
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.read.scan(state, projection, filters, limit).await
    }

    async fn insert_into(
        &self,
        _state: &dyn Session,
        input: Arc<dyn ExecutionPlan>,
        insert_op: InsertOp,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        refuse_copy_change(&self.snapshot)?;
        let change = match insert_op {
            InsertOp::Append => Removal::None,
            InsertOp::Overwrite => Removal::All,
            InsertOp::Replace => {
                return not_impl_err!("INSERT OR REPLACE is not supported by Sieve tables")
            }
        };
        let sink = SliceSink {
            tables: Arc::clone(&self.tables),
            snapshot: self.snapshot.clone(),
            removal: change,
            statement: format!("{insert_op} INTO {}", self.snapshot.table.name),
            answer: None,
        };
        Ok(Arc::new(DataSinkExec::new(input, Arc::new(sink), None)))
    }

    /// The rows `filters` keep, found on the storage nodes and deleted in
    /// one commit when the plan runs ([`super::delete`]).
    async fn delete_from(
        &self,
        state: &dyn Session,
        filters: Vec<Expr>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        refuse_copy_change(&self.snapshot)?;
        let predicate = self.physical_predicate(state, filters)?;
        Ok(Arc::new(ChangeRowsExec::new(
            Arc::clone(&self.tables),
            Arc::clone(&self.catalog),
            Arc::clone(&self.traffic),
            self.snapshot.clone(),
            Arc::clone(&self.cluster_table),
            predicate,
            RowChange::Delete,
            format!("DELETE FROM {}", self.snapshot.table.name),
        )))
    }

    /// The rows `filters` keep get the assigned values: their old versions
    /// deleted and the new written as new slices, in one commit.
    async fn update(
        &self,
        state: &dyn Session,
        assignments: Vec<(String, Expr)>,
        filters: Vec<Expr>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        refuse_copy_change(&self.snapshot)?;
        let schema = Arc::clone(&self.snapshot.table.schema);
        let df_schema = DFSchema::try_from(Arc::clone(&schema))?;
        let mut values: Vec<Arc<dyn datafusion::physical_expr::PhysicalExpr>> = schema
            .fields()
            .iter()
            .enumerate()
            .map(|(index, field)| {
                Arc::new(datafusion::physical_expr::expressions::Column::new(
                    field.name(),
                    index,
                )) as Arc<dyn datafusion::physical_expr::PhysicalExpr>
            })
            .collect();
        for (column, value) in assignments {
            let Ok(index) = schema.index_of(&column) else {
                return datafusion::common::plan_err!(
                    "UPDATE: table '{}' has no column '{column}'",
                    self.snapshot.table.name
                );
            };
            let value = datafusion::logical_expr::ExprSchemable::cast_to(
                value,
                schema.field(index).data_type(),
                &df_schema,
            )?;
            values[index] = state.create_physical_expr(value, &df_schema)?;
        }
        let predicate = self.physical_predicate(state, filters)?;
        Ok(Arc::new(ChangeRowsExec::new(
            Arc::clone(&self.tables),
            Arc::clone(&self.catalog),
            Arc::clone(&self.traffic),
            self.snapshot.clone(),
            Arc::clone(&self.cluster_table),
            predicate,
            RowChange::Update(values),
            format!("UPDATE {}", self.snapshot.table.name),
        )))
    }

    /// Every slice removed in one commit, when the plan runs (so EXPLAIN
    /// changes nothing); answers the rows removed.
    async fn truncate(&self, _state: &dyn Session) -> Result<Arc<dyn ExecutionPlan>> {
        refuse_copy_change(&self.snapshot)?;
        let removed: u64 = self
            .snapshot
            .slices
            .iter()
            .map(|slice| slice.summary.rows.saturating_sub(slice.deleted_rows))
            .sum();
        let sink = SliceSink {
            tables: Arc::clone(&self.tables),
            snapshot: self.snapshot.clone(),
            removal: Removal::All,
            statement: format!("TRUNCATE {}", self.snapshot.table.name),
            answer: Some(removed),
        };
        let nothing = Arc::new(datafusion::physical_plan::empty::EmptyExec::new(
            Arc::clone(&self.snapshot.table.schema),
        ));
        Ok(Arc::new(DataSinkExec::new(nothing, Arc::new(sink), None)))
    }
}

impl OwnedTable {
    /// `filters` as one predicate over the table schema, checked against
    /// the fragment's allow-list: the storage nodes evaluate it.
    fn physical_predicate(
        &self,
        state: &dyn Session,
        filters: Vec<Expr>,
    ) -> Result<Option<Arc<dyn datafusion::physical_expr::PhysicalExpr>>> {
        let schema = Arc::clone(&self.snapshot.table.schema);
        let df_schema = DFSchema::try_from(Arc::clone(&schema))?;
        let Some(filter) = datafusion::logical_expr::utils::conjunction(filters) else {
            return Ok(None);
        };
        let predicate = state.create_physical_expr(filter, &df_schema)?;
        sieve_fragment::check_allowed(&predicate, &schema).map_err(|error| {
            datafusion::common::DataFusionError::Plan(format!(
                "this WHERE cannot run on the storage nodes, so DELETE and UPDATE refuse it: {error}"
            ))
        })?;
        Ok(Some(predicate))
    }
}

/// The sorted copies of `snapshot`'s table that hold its rows at `pin`'s
/// version, with their slices then.
fn current_copies(
    tables: &Arc<OwnedTables>,
    snapshot: &Snapshot,
    pin: &VersionPin,
) -> Result<Vec<TableCopy>> {
    let store = tables.store();
    let mut copies = Vec::new();
    for entry in store.copies_at(snapshot.table.id, pin.version())? {
        let Some(copy_of) = entry.layout.copy_of else {
            continue;
        };
        if entry.schema != snapshot.table.schema
            || !store.copy_is_current(copy_of, pin.version())?
        {
            continue;
        }
        let Some(copy) = store.snapshot(&entry.name, pin.version())? else {
            continue;
        };
        copies.push(TableCopy {
            name: entry.name.clone(),
            sort_key: entry.layout.sort_key.clone(),
            table: Arc::new(tables.cluster_table(&copy, pin)),
        });
    }
    Ok(copies)
}

/// A sorted copy changes only with its table: refuse a statement that
/// would change the copy alone.
pub(super) fn refuse_copy_change(snapshot: &Snapshot) -> Result<()> {
    if snapshot.table.layout.copy_of.is_some() {
        return datafusion::common::plan_err!(
            "table '{}' is a sorted copy (copy_of): change its table, then make the copy again (DROP TABLE, CREATE TABLE ... WITH (copy_of = ...)); until then scans of its table do not read it",
            snapshot.table.name
        );
    }
    Ok(())
}

/// Which slices an insert replaces.
#[derive(Debug, Clone, Copy)]
enum Removal {
    None,
    All,
}

/// Where `INSERT` rows go: a [`TableWriter`], committed when the input ends.
#[derive(Debug)]
struct SliceSink {
    tables: Arc<OwnedTables>,
    snapshot: Snapshot,
    removal: Removal,
    statement: String,
    /// The count to answer instead of the rows written (TRUNCATE's).
    answer: Option<u64>,
}

impl DisplayAs for SliceSink {
    fn fmt_as(
        &self,
        _: DisplayFormatType,
        formatter: &mut std::fmt::Formatter<'_>,
    ) -> std::fmt::Result {
        write!(
            formatter,
            "SieveSliceSink: table={}",
            self.snapshot.table.name
        )
    }
}

#[async_trait]
impl DataSink for SliceSink {
    fn schema(&self) -> &SchemaRef {
        &self.snapshot.table.schema
    }

    async fn write_all(
        &self,
        data: SendableRecordBatchStream,
        _context: &Arc<TaskContext>,
    ) -> Result<u64> {
        let writer = TableWriter::new(Arc::clone(&self.tables), self.snapshot.table.clone())
            .write_stream(data)
            .await?;
        let change = Change {
            removed: match self.removal {
                Removal::None => vec![],
                Removal::All => self
                    .snapshot
                    .slices
                    .iter()
                    .map(|slice| slice.slice)
                    .collect(),
            },
            ..Change::default()
        };
        let (_, rows) = writer.commit(change, &self.statement).await?;
        Ok(self.answer.unwrap_or(rows))
    }
}
