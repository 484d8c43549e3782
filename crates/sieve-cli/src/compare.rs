//! Comparing query results with plain DataFusion's.

use std::path::Path;

use arrow::record_batch::RecordBatch;
use arrow::util::display::{ArrayFormatter, FormatOptions};
use datafusion::common::Result;
use datafusion::datasource::file_format::parquet::ParquetFormat;
use datafusion::datasource::listing::{
    ListingOptions, ListingTable, ListingTableConfig, ListingTableUrl,
};
use datafusion::prelude::SessionContext;
use sieve_format::{node_directory, TPCH_TABLES};
use std::sync::Arc;

/// A plain DataFusion session over the same slice files, read locally,
/// without Sieve: the independent reference for every result. A replicated
/// slice is read once.
pub async fn reference_context(root: &Path, nodes: usize) -> Result<SessionContext> {
    let names: Vec<&str> = TPCH_TABLES.iter().map(|table| table.name).collect();
    reference_context_for(root, nodes, &names).await
}

/// Like [`reference_context`], for the tables named.
pub async fn reference_context_for(
    root: &Path,
    nodes: usize,
    tables: &[&str],
) -> Result<SessionContext> {
    let context = SessionContext::new();
    for &table in tables {
        // Each slice file once, from the first node holding a copy.
        let mut files = std::collections::BTreeMap::new();
        for node in 0..nodes {
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
        let urls = files
            .into_values()
            .map(|path| ListingTableUrl::parse(path.canonicalize()?.display().to_string()))
            .collect::<Result<Vec<_>>>()?;
        let options =
            ListingOptions::new(Arc::new(ParquetFormat::default())).with_file_extension(".parquet");
        let config = ListingTableConfig::new_with_multi_paths(urls).with_listing_options(options);
        let config = config.infer_schema(&context.state()).await?;
        context.register_table(table, Arc::new(ListingTable::try_new(config)?))?;
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
