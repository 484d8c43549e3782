//! Comparing query results with plain DataFusion's.

use std::path::Path;

use arrow::datatypes::{Schema, SchemaRef};
use arrow::record_batch::RecordBatch;
use arrow::util::display::{ArrayFormatter, FormatOptions};
use datafusion::common::plan_err;
use datafusion::common::Result;
use datafusion::datasource::MemTable;
use datafusion::execution::SessionStateBuilder;
use datafusion::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use datafusion::prelude::{SessionConfig, SessionContext};
use sieve_compute::physical_rules_corrected;
use sieve_compute::tables::TableStore;
use sieve_format::{node_directory, slice_file_name, TABLE_CATALOG_FILE, TPCH_TABLES};
use std::sync::Arc;

/// A plain DataFusion session over the same slice files, read locally,
/// without Sieve: the independent reference for every result. A replicated
/// slice is read once. A table of the data set's catalog is read from the
/// slice files its latest version names (only the file list comes from the
/// catalog); any other from its directories, `node-K/table/*.parquet`.
pub async fn reference_context(root: &Path, nodes: usize) -> Result<SessionContext> {
    let names: Vec<&str> = TPCH_TABLES.iter().map(|table| table.name).collect();
    reference_context_for(root, nodes, &names).await
}

/// Like [`reference_context`], for the tables named.
///
/// The reference is as plain as DataFusion gets: every slice file is read
/// whole with the Parquet crate into an in-memory table (one partition per
/// slice), so no statistics, page index or Bloom filter prunes anything,
/// and dynamic filters are off. DataFusion's own Parquet pruning is not
/// independent of what it checks (it drops rows whose float value is NaN,
/// which Parquet leaves out of min/max statistics), nor are its TopK
/// dynamic filters (wrong over floats with NaN in DataFusion 55).
pub async fn reference_context_for(
    root: &Path,
    nodes: usize,
    tables: &[&str],
) -> Result<SessionContext> {
    let config = SessionConfig::new()
        .set_bool("datafusion.optimizer.enable_dynamic_filter_pushdown", false)
        // Panics over floats with NaN in DataFusion 55 (see sieve_compute's session).
        .set_bool("datafusion.optimizer.enable_topk_aggregation", false)
        // As Sieve's session (`SELECT DISTINCT (b IS TRUE)` fails to plan
        // in DataFusion 55 otherwise; see sieve_compute's session).
        .set_bool(
            "datafusion.execution.skip_physical_aggregate_schema_check",
            true,
        );
    // DataFusion's physical rules with the corrections of two wrong answers
    // of DataFusion 55 (`sieve_compute::physical_rules_corrected`): without
    // its physical filter pushdown, which maps filters through projections
    // by column name, and with float equalities kept from dropping sort
    // keys (checked apart from this reference by `tests/it/signed_zeros.rs`,
    // which sorts in Rust).
    let state = SessionStateBuilder::new()
        .with_config(config)
        .with_default_features()
        // A float IN list matches both zeros, as `=` does (Sieve's
        // correction of DataFusion 55; `sieve_compute::signed_zero`).
        .with_optimizer_rule(Arc::new(sieve_compute::FloatInListsMatchBothZeros))
        .with_physical_optimizer_rules(
            physical_rules_corrected()
                .into_iter()
                .filter(|rule| rule.name() != "FilterPushdown(Post)")
                .collect(),
        )
        .build();
    let context = SessionContext::new_with_state(state);
    // DataFusion 55's grouped `min` and `max` over floats depend on the
    // order of the rows; these follow total order, as Sieve's do (checked
    // apart from this reference by their unit test and by
    // `tests/it/signed_zeros.rs`, which computes them in Rust).
    for function in sieve_fragment::corrected_aggregates() {
        context.register_udaf(function);
    }
    // Tables of the data set's catalog (loaded through the write path):
    // the slice files of their latest version.
    let catalog = root.join(TABLE_CATALOG_FILE);
    let owned = if catalog.is_file() {
        Some(TableStore::open(&catalog, nodes)?)
    } else {
        None
    };
    for &table in tables {
        // Each slice file once, from the first node holding a copy.
        let mut files = std::collections::BTreeMap::new();
        let snapshot = match &owned {
            Some(store) => store.snapshot(table, store.latest_version()?)?,
            None => None,
        };
        let mut catalog_schema = None;
        if let Some(snapshot) = snapshot {
            catalog_schema = Some(Arc::clone(&snapshot.table.schema));
            let storage_name = snapshot.table.storage_name();
            for slice in &snapshot.slices {
                if slice.deleted_rows > 0 {
                    return plan_err!(
                        "table {table} has deleted rows; the reference reads whole slice files"
                    );
                }
                let Some(&node) = slice.nodes.first() else {
                    return plan_err!("slice {} of {table} is on no node", slice.slice);
                };
                let name = slice_file_name(&storage_name, slice.slice);
                let path = node_directory(root, node).join(&storage_name).join(&name);
                files.insert(Some(name.into()), path);
            }
        }
        let from_catalog = catalog_schema.is_some();
        for node in (0..nodes).filter(|_| !from_catalog) {
            let directory = node_directory(root, node).join(table);
            if !directory.is_dir() {
                continue;
            }
            for entry in std::fs::read_dir(&directory)? {
                let path = entry?.path();
                if path
                    .extension()
                    .is_some_and(|extension| extension == "parquet")
                {
                    let name = path.file_name().map(|name| name.to_os_string());
                    files.entry(name).or_insert(path);
                }
            }
        }
        let mut schema: Option<SchemaRef> = None;
        let mut partitions = Vec::with_capacity(files.len());
        for path in files.into_values() {
            let reader = ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(&path)?)?;
            // Each slice carries its own key-value metadata; the table's
            // schema is the fields alone.
            let fields = Arc::new(Schema::new(reader.schema().fields().clone()));
            let table_schema = Arc::clone(schema.get_or_insert(fields));
            let batches = reader
                .build()?
                .map(|batch| Ok(batch?.with_schema(Arc::clone(&table_schema))?))
                .collect::<Result<Vec<RecordBatch>>>()?;
            partitions.push(batches);
        }
        // A table of the catalog with no slice (no rows) has its schema.
        let Some(schema) = schema.or(catalog_schema) else {
            return plan_err!("table {table} has no slice under {}", root.display());
        };
        // MemTable wants at least one partition, even an empty one.
        if partitions.is_empty() {
            partitions.push(Vec::new());
        }
        context.register_table(table, Arc::new(MemTable::try_new(schema, partitions)?))?;
    }
    Ok(context)
}

/// Render every row as one line of text (exact decimals, as DataFusion
/// displays them), optionally sorted.
pub fn rows_as_text(batches: &[RecordBatch], sort: bool) -> Result<Vec<String>> {
    let options = FormatOptions::default().with_null("NULL");
    let mut rows = Vec::new();
    for batch in batches {
        let formatters = batch
            .columns()
            .iter()
            .map(|column| ArrayFormatter::try_new(column.as_ref(), &options))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        for row in 0..batch.num_rows() {
            let cells: Vec<String> = formatters
                .iter()
                .map(|formatter| formatter.value(row).to_string())
                .collect();
            rows.push(cells.join(" | "));
        }
    }
    if sort {
        rows.sort();
    }
    Ok(rows)
}

/// Run `sql` and return its batches.
pub async fn run(context: &SessionContext, sql: &str) -> Result<Vec<RecordBatch>> {
    context.sql(sql).await?.collect().await
}
