//! The statements DataFusion does not run the way a table a user owns
//! needs, handled before it plans them: `CREATE TABLE` (with its layout
//! options, and `CREATE TABLE ... AS` streamed into slices instead of
//! collected in memory) and `COPY table FROM 'path'`. Everything else goes
//! to DataFusion, whose own hooks reach [`super::OwnedTable`] (INSERT,
//! TRUNCATE) and [`super::SieveSchema`] (DROP TABLE).
//!
//! ```sql
//! CREATE TABLE t (id BIGINT NOT NULL, name VARCHAR, day DATE)
//!     WITH (sort_key = 'day,id', replicas = 2, slice_rows = 500000);
//! CREATE TABLE recent WITH (sort_key = 'day') AS SELECT * FROM t WHERE day > '2026-01-01';
//! COPY t FROM 'data/*.csv' WITH (FORMAT csv, HEADER true, DELIMITER ',', QUOTE '"', NULL '');
//! COPY t FROM 'data/part.parquet';       -- format from the extension
//! COPY t FROM 'events.json' WITH (FORMAT json);   -- newline-delimited
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{RecordBatch, UInt64Array};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::common::{plan_datafusion_err, plan_err, DataFusionError, Result};
use datafusion::dataframe::DataFrame;
use datafusion::execution::SessionStateBuilder;
use datafusion::logical_expr::{cast, col, DdlStatement, LogicalPlan};
use datafusion::prelude::{CsvReadOptions, JsonReadOptions, ParquetReadOptions, SessionContext};
use datafusion::sql::parser::{DFParser, Statement as DFStatement};
use datafusion::sql::sqlparser::ast::{
    CopyOption, CopySource, CopyTarget, CreateTableOptions, Expr as SqlExpr, SqlOption,
    Statement as SqlStatement, Value,
};
use datafusion::sql::sqlparser::dialect::PostgreSqlDialect;
use datafusion::sql::sqlparser::parser::Parser;
use futures::StreamExt;

use super::{Change, OwnedTables, TableLayout, TableWriter};
use crate::ClusterCatalog;

/// Replicas a table gets when `CREATE TABLE` does not say (at most the
/// cluster's nodes).
pub const REPLICAS_DEFAULT: usize = 2;

/// Largest `slice_rows` a table may ask for.
pub const SLICE_ROWS_MAX: u64 = 10_000_000;

/// Fewest rows per data page a table may ask for (smaller pages make the
/// page index larger than the data it indexes).
pub const PAGE_ROWS_MIN: u64 = 64;

/// Most rows per data page a table may ask for.
pub const PAGE_ROWS_MAX: u64 = 1_048_576;

/// Run `sql` in `context`: the statements this module handles here, the
/// rest through DataFusion (`context.sql`). A session made by
/// [`crate::session_over`] carries its cluster's catalog; any other
/// context runs everything through DataFusion.
pub async fn run_sql(context: &SessionContext, sql: &str) -> Result<DataFrame> {
    let Some(catalog) = context.state().config().get_extension::<ClusterCatalog>() else {
        return context.sql(sql).await;
    };
    match handled(context, &catalog, sql)? {
        Some(Handled::Create(statement)) => create_table(context, &catalog, statement, sql).await,
        Some(Handled::Copy(statement)) => copy_from(context, &catalog, statement, sql).await,
        None => context.sql(sql).await,
    }
}

/// A statement this module runs.
#[derive(Debug)]
pub enum Handled {
    /// `CREATE TABLE` of a table a user owns.
    Create(Box<SqlStatement>),
    /// `COPY table FROM`.
    Copy(Box<SqlStatement>),
}

/// Whether `sql` is one statement this module runs (and which). Parsing
/// errors are left for DataFusion to report, so they read as ever.
pub fn handled(
    context: &SessionContext,
    catalog: &ClusterCatalog,
    sql: &str,
) -> Result<Option<Handled>> {
    let head: String = sql
        .trim_start()
        .chars()
        .take(6)
        .collect::<String>()
        .to_ascii_lowercase();
    if head.starts_with("copy") {
        let Ok(mut statements) = Parser::parse_sql(&PostgreSqlDialect {}, sql) else {
            return Ok(None);
        };
        if statements.len() == 1 {
            if let SqlStatement::Copy { to: false, .. } = &statements[0] {
                return Ok(Some(Handled::Copy(Box::new(statements.remove(0)))));
            }
        }
        return Ok(None);
    }
    if head.starts_with("delete") || head.starts_with("update") {
        check_dml_where(context, sql)?;
        return Ok(None);
    }
    if !head.starts_with("create") {
        return Ok(None);
    }
    let dialect = context.state().config().options().sql_parser.dialect;
    let Some(dialect) = datafusion::sql::sqlparser::dialect::dialect_from_str(dialect.as_ref())
    else {
        return Ok(None);
    };
    let Ok(mut statements) = DFParser::parse_sql_with_dialect(sql, dialect.as_ref()) else {
        return Ok(None);
    };
    if statements.len() != 1 {
        return Ok(None);
    }
    match statements.pop_front() {
        Some(DFStatement::Statement(statement)) if matches!(statement.as_ref(), SqlStatement::CreateTable(create) if !create.external) =>
        {
            if catalog.owned.is_none() {
                // No table catalog: DataFusion's in-memory table, as before,
                // unless the statement asks for a layout only Sieve knows.
                if let SqlStatement::CreateTable(create) = statement.as_ref() {
                    if create.table_options != CreateTableOptions::None {
                        return plan_err!(
                            "CREATE TABLE ... WITH (...) needs the table catalog, and this compute node has none (start it with a data directory or --catalog)"
                        );
                    }
                }
                return Ok(None);
            }
            Ok(Some(Handled::Create(statement)))
        }
        _ => Ok(None),
    }
}

/// DataFusion 55 hands a table's `delete_from` and `update` only the
/// filters on the table itself: a subquery in WHERE (decorrelated into a
/// join) or UPDATE ... FROM would lose its join and change the wrong rows.
/// Such statements are refused here, before anything runs.
fn check_dml_where(context: &SessionContext, sql: &str) -> Result<()> {
    let dialect = context.state().config().options().sql_parser.dialect;
    let Some(dialect) = datafusion::sql::sqlparser::dialect::dialect_from_str(dialect.as_ref())
    else {
        return Ok(());
    };
    let Ok(statements) = DFParser::parse_sql_with_dialect(sql, dialect.as_ref()) else {
        return Ok(());
    };
    for statement in statements {
        if let DFStatement::Statement(statement) = statement {
            refuse_unsound_dml(&statement)?;
        }
    }
    Ok(())
}

/// Refuse a DELETE or UPDATE whose WHERE or SET holds a subquery, DELETE
/// ... USING and UPDATE ... FROM (see [`check_dml_where`]); other
/// statements pass.
pub fn refuse_unsound_dml(statement: &SqlStatement) -> Result<()> {
    use datafusion::sql::sqlparser::ast::{visit_expressions, Expr as E};
    use std::ops::ControlFlow;
    let what = match statement {
        SqlStatement::Delete(delete) => {
            if delete.using.is_some() {
                return plan_err!(
                    "DELETE ... USING is not supported: use WHERE on the table's own columns"
                );
            }
            "DELETE"
        }
        SqlStatement::Update(update) => {
            if update.from.is_some() {
                return plan_err!(
                    "UPDATE ... FROM is not supported: use WHERE on the table's own columns"
                );
            }
            "UPDATE"
        }
        _ => return Ok(()),
    };
    let subquery = visit_expressions(statement, |expr| match expr {
        E::Subquery(_) | E::Exists { .. } | E::InSubquery { .. } => ControlFlow::Break(()),
        _ => ControlFlow::Continue(()),
    });
    if subquery.is_break() {
        return plan_err!(
                "{what} with a subquery is not supported: its WHERE (and SET) may name only the table's own columns"
            );
    }
    Ok(())
}

pub(super) fn owned(catalog: &ClusterCatalog) -> Result<&Arc<OwnedTables>> {
    catalog.owned.as_ref().ok_or_else(|| {
        plan_datafusion_err!(
            "this compute node has no table catalog (start it with a data directory or --catalog): tables cannot be created or loaded"
        )
    })
}

/// The layout `WITH (...)` asks for.
fn layout_from(options: &CreateTableOptions, schema: &Schema, nodes: usize) -> Result<TableLayout> {
    let mut layout = TableLayout::with_replicas(REPLICAS_DEFAULT.min(nodes.max(1)));
    let options: &[SqlOption] = match options {
        CreateTableOptions::None => &[],
        CreateTableOptions::With(options) => options,
        other => return plan_err!("table options '{other}' are not supported; use WITH (sort_key = '...', replicas = N, slice_rows = N, row_group_rows = N, page_rows = N, layout = 'planned' | 'fixed', copy_of = 'table')"),
    };
    for option in options {
        let SqlOption::KeyValue { key, value } = option else {
            return plan_err!("table option '{option}' is not supported; use WITH (sort_key = '...', replicas = N, slice_rows = N, row_group_rows = N, page_rows = N, layout = 'planned' | 'fixed')");
        };
        let text = match value {
            SqlExpr::Value(value) => match &value.value {
                Value::SingleQuotedString(text) | Value::DoubleQuotedString(text) => text.clone(),
                Value::Number(number, _) => number.clone(),
                other => other.to_string(),
            },
            SqlExpr::Identifier(ident) => ident.value.clone(),
            other => other.to_string(),
        };
        match key.value.to_ascii_lowercase().as_str() {
            "sort_key" => {
                layout.sort_key = text
                    .split(',')
                    .map(|column| column.trim().to_string())
                    .filter(|column| !column.is_empty())
                    .collect();
                for column in &layout.sort_key {
                    if schema.field_with_name(column).is_err() {
                        return plan_err!(
                            "sort_key names '{column}', which is not a column of the table"
                        );
                    }
                }
            }
            "replicas" => {
                let replicas: usize = text.parse().map_err(|_| {
                    plan_datafusion_err!("replicas must be a whole number, not '{text}'")
                })?;
                if replicas == 0 || replicas > nodes {
                    return plan_err!("replicas must be from 1 to the cluster's {nodes} storage node(s), not {replicas}");
                }
                layout.replicas = replicas;
            }
            "slice_rows" => {
                let rows: u64 = text.parse().map_err(|_| {
                    plan_datafusion_err!("slice_rows must be a whole number, not '{text}'")
                })?;
                if rows == 0 || rows > SLICE_ROWS_MAX {
                    return plan_err!("slice_rows must be from 1 to {SLICE_ROWS_MAX}, not {rows}");
                }
                layout.slice_rows = rows;
            }
            "row_group_rows" => {
                let rows: u64 = text.parse().map_err(|_| {
                    plan_datafusion_err!("row_group_rows must be a whole number, not '{text}'")
                })?;
                if rows == 0 || rows > SLICE_ROWS_MAX {
                    return plan_err!(
                        "row_group_rows must be from 1 to {SLICE_ROWS_MAX}, not {rows}"
                    );
                }
                layout.row_group_rows = rows;
            }
            "page_rows" => {
                let rows: u64 = text.parse().map_err(|_| {
                    plan_datafusion_err!("page_rows must be a whole number, not '{text}'")
                })?;
                if !(PAGE_ROWS_MIN..=PAGE_ROWS_MAX).contains(&rows) {
                    return plan_err!(
                        "page_rows must be from {PAGE_ROWS_MIN} to {PAGE_ROWS_MAX}, not {rows}"
                    );
                }
                layout.page_rows = rows;
            }
            "layout" => {
                layout.planned = match text.to_ascii_lowercase().as_str() {
                    "planned" => true,
                    "fixed" => false,
                    _ => {
                        return plan_err!(
                            "layout must be 'planned' (each load measures its columns' encodings and codecs) or 'fixed' (dictionary and zstd everywhere), not '{text}'"
                        )
                    }
                };
            }
            other => {
                return plan_err!(
                    "unknown table option '{other}' (known: sort_key, replicas, slice_rows, row_group_rows, page_rows, layout, copy_of)"
                )
            }
        }
    }
    Ok(layout)
}

/// Types a slice stores: no nested types.
pub(super) fn check_types(schema: &Schema) -> Result<()> {
    for field in schema.fields() {
        if field.data_type().is_nested() {
            return plan_err!(
                "column '{}' is {}: Sieve tables hold no nested types",
                field.name(),
                field.data_type()
            );
        }
    }
    Ok(())
}

async fn create_table(
    context: &SessionContext,
    catalog: &ClusterCatalog,
    statement: Box<SqlStatement>,
    sql: &str,
) -> Result<DataFrame> {
    let owned = owned(catalog)?;
    let mut statement = *statement;
    let SqlStatement::CreateTable(create) = &mut statement else {
        return plan_err!("not a CREATE TABLE");
    };
    let options = std::mem::take(&mut create.table_options);
    if option_text(&options, "copy_of").is_some() {
        return create_copy(context, owned, create, &options, sql).await;
    }
    let state = context.state();
    let plan = state
        .statement_to_plan(DFStatement::Statement(Box::new(statement)))
        .await?;
    let LogicalPlan::Ddl(DdlStatement::CreateMemoryTable(create)) = plan else {
        return plan_err!("CREATE TABLE did not plan as a table");
    };
    let name = create.name.table().to_string();
    if let Some(schema_name) = create.name.schema() {
        if schema_name != "public" {
            return plan_err!("tables are created in schema 'public', not '{schema_name}'");
        }
    }
    sieve_format::writes::check_table_name(&name).map_err(DataFusionError::Plan)?;
    if create.temporary {
        return plan_err!("temporary tables are not supported");
    }
    if create.or_replace {
        return plan_err!("CREATE OR REPLACE TABLE is not supported by Sieve tables: DROP TABLE, then CREATE TABLE");
    }
    let exists = context.table_exist(name.as_str())?;
    if exists {
        if create.if_not_exists {
            return no_rows(context);
        }
        return plan_err!("table '{name}' already exists");
    }
    let schema: Schema = create.input.schema().as_arrow().clone();
    let schema = Schema::new(
        schema
            .fields()
            .iter()
            .map(|field| Field::new(field.name(), field.data_type().clone(), field.is_nullable()))
            .collect::<Vec<_>>(),
    );
    check_types(&schema)?;
    let layout = layout_from(&options, &schema, owned.nodes())?;
    let is_query = !matches!(create.input.as_ref(), LogicalPlan::EmptyRelation(_));
    if !is_query {
        owned
            .store()
            .create_table(&name, &schema, &layout, true, sql)?;
        return context.sql("SELECT 1 WHERE false").await;
    }
    // CREATE ... AS: invisible until its rows are in, in one commit.
    let (table, _) = owned
        .store()
        .create_table(&name, &schema, &layout, false, sql)?;
    let frame = DataFrame::new(state, create.input.as_ref().clone());
    let stream = frame.execute_stream().await?;
    let writer = TableWriter::new(Arc::clone(owned), table)
        .write_stream(stream)
        .await?;
    let change = Change {
        publish: true,
        ..Change::default()
    };
    let (_, rows) = writer.commit(change, sql).await?;
    count_frame(context, rows)
}

/// The text of table option `key` in `options`, if given.
fn option_text(options: &CreateTableOptions, key: &str) -> Option<String> {
    let CreateTableOptions::With(options) = options else {
        return None;
    };
    options.iter().find_map(|option| match option {
        SqlOption::KeyValue { key: given, value } if given.value.eq_ignore_ascii_case(key) => {
            Some(match value {
                SqlExpr::Value(value) => match &value.value {
                    Value::SingleQuotedString(text) | Value::DoubleQuotedString(text) => {
                        text.clone()
                    }
                    other => other.to_string(),
                },
                SqlExpr::Identifier(ident) => ident.value.clone(),
                other => other.to_string(),
            })
        }
        _ => None,
    })
}

/// `CREATE TABLE name WITH (copy_of = 'source', sort_key = '...')`: a
/// sorted copy of table `source` a user owns, holding its rows at the
/// version read, sorted as a whole by the sort key (so each slice holds
/// one range of it). Scans of `source` read the copy instead when its
/// order skips more ([`crate::table`]), for as long as `source` has not
/// changed since; the copy itself takes no INSERT, UPDATE or DELETE.
async fn create_copy(
    context: &SessionContext,
    owned: &Arc<OwnedTables>,
    create: &datafusion::sql::sqlparser::ast::CreateTable,
    options: &CreateTableOptions,
    sql: &str,
) -> Result<DataFrame> {
    use datafusion::physical_expr::expressions::Column;
    use datafusion::physical_expr::{LexOrdering, PhysicalSortExpr};
    use datafusion::physical_plan::sorts::sort::SortExec;
    use datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec;

    if !create.columns.is_empty() || create.query.is_some() {
        return plan_err!(
            "a sorted copy takes its columns and rows from its table: CREATE TABLE name WITH (copy_of = 'table', sort_key = 'column,...'), without columns or AS"
        );
    }
    if create.temporary || create.or_replace {
        return plan_err!("a sorted copy cannot be TEMPORARY or OR REPLACE");
    }
    let parts = &create.name.0;
    let name = match parts.as_slice() {
        [name] | [_, name] => name
            .as_ident()
            .map(|ident| ident.value.clone())
            .unwrap_or_else(|| name.to_string()),
        _ => {
            return plan_err!(
                "a table is named 'name' or 'public.name', not '{}'",
                create.name
            )
        }
    };
    if let [schema, _] = parts.as_slice() {
        if schema.to_string() != "public" {
            return plan_err!("tables are created in schema 'public', not '{schema}'");
        }
    }
    sieve_format::writes::check_table_name(&name).map_err(DataFusionError::Plan)?;
    if context.table_exist(name.as_str())? {
        if create.if_not_exists {
            return no_rows(context);
        }
        return plan_err!("table '{name}' already exists");
    }
    let source_name = option_text(options, "copy_of").unwrap_or_default();
    let provider = context.table_provider(source_name.as_str()).await.ok();
    let Some(source) = provider
        .as_ref()
        .and_then(|provider| provider.downcast_ref::<super::OwnedTable>())
    else {
        return plan_err!("copy_of names '{source_name}', which is not a table a user owns");
    };
    let snapshot = source.snapshot();
    if snapshot.table.layout.copy_of.is_some() {
        return plan_err!("'{source_name}' is itself a sorted copy: copy its table instead");
    }
    // The copy's layout: what WITH gives, else the source's.
    let CreateTableOptions::With(given) = options else {
        return plan_err!("a sorted copy takes WITH (copy_of = ..., sort_key = ...)");
    };
    let rest: Vec<SqlOption> = given
        .iter()
        .filter(|option| {
            !matches!(option, SqlOption::KeyValue { key, .. } if key.value.eq_ignore_ascii_case("copy_of"))
        })
        .cloned()
        .collect();
    let schema = Arc::clone(&snapshot.table.schema);
    let mut layout = layout_from(&CreateTableOptions::With(rest), &schema, owned.nodes())?;
    let given_key = |key: &str| option_text(options, key).is_some();
    let base = &snapshot.table.layout;
    if !given_key("replicas") {
        layout.replicas = base.replicas;
    }
    if !given_key("slice_rows") {
        layout.slice_rows = base.slice_rows;
    }
    if !given_key("row_group_rows") {
        layout.row_group_rows = base.row_group_rows;
    }
    if !given_key("page_rows") {
        layout.page_rows = base.page_rows;
    }
    if !given_key("layout") {
        layout.planned = base.planned;
    }
    if layout.sort_key.is_empty() {
        return plan_err!("a sorted copy needs sort_key = 'column,...'");
    }
    if layout.sort_key == base.sort_key {
        return plan_err!(
            "'{source_name}' is already sorted by '{}'",
            base.sort_key.join(",")
        );
    }
    layout.copy_of = Some(super::CopyOf {
        table: snapshot.table.id,
        version: snapshot.version,
    });
    // The source's rows at the version its provider pinned (held until
    // the copy commits), sorted as a whole: DataFusion's sort, which
    // spills through the memory pool, then a merge of its partitions.
    let state = context.state();
    let scan =
        datafusion::catalog::TableProvider::scan(source.reader(), &state, None, &[], None).await?;
    let ordering: Vec<PhysicalSortExpr> = layout
        .sort_key
        .iter()
        .map(|column| {
            let index = schema.index_of(column)?;
            Ok(PhysicalSortExpr::new(
                Arc::new(Column::new(column, index)),
                arrow::compute::SortOptions {
                    descending: false,
                    nulls_first: true,
                },
            ))
        })
        .collect::<Result<_>>()?;
    let ordering = LexOrdering::new(ordering)
        .ok_or_else(|| plan_datafusion_err!("a sorted copy needs sort_key = 'column,...'"))?;
    let sorted = Arc::new(SortExec::new(ordering.clone(), scan).with_preserve_partitioning(true));
    let merged = Arc::new(SortPreservingMergeExec::new(ordering, sorted));
    let (table, _) = owned
        .store()
        .create_table(&name, &schema, &layout, false, sql)?;
    let stream = datafusion::physical_plan::execute_stream(merged, state.task_ctx())?;
    let writer = TableWriter::new(Arc::clone(owned), table)
        .write_stream(stream)
        .await?;
    let change = Change {
        publish: true,
        ..Change::default()
    };
    let (_, rows) = writer.commit(change, sql).await?;
    count_frame(context, rows)
}

/// What a statement without rows answers: no columns, no rows.
fn no_rows(context: &SessionContext) -> Result<DataFrame> {
    let plan = datafusion::logical_expr::LogicalPlanBuilder::empty(false).build()?;
    Ok(DataFrame::new(context.state(), plan))
}

fn count_frame(context: &SessionContext, rows: u64) -> Result<DataFrame> {
    let schema = Arc::new(Schema::new(vec![Field::new(
        "count",
        DataType::UInt64,
        false,
    )]));
    let batch = RecordBatch::try_new(schema, vec![Arc::new(UInt64Array::from(vec![rows]))])?;
    context.read_batch(batch)
}

/// How `COPY ... FROM` reads its files.
#[derive(Debug, Clone)]
struct CopyOptions {
    format: Option<String>,
    header: bool,
    delimiter: u8,
    quote: u8,
    escape: Option<u8>,
    null: Option<String>,
}

fn one_byte(what: &str, character: char) -> Result<u8> {
    if character.is_ascii() {
        Ok(character as u8)
    } else {
        plan_err!("COPY's {what} must be one ASCII character, not '{character}'")
    }
}

fn copy_options(options: &[CopyOption]) -> Result<CopyOptions> {
    let mut parsed = CopyOptions {
        format: None,
        header: false,
        delimiter: b',',
        quote: b'"',
        escape: None,
        null: None,
    };
    for option in options {
        match option {
            CopyOption::Format(format) => parsed.format = Some(format.value.to_ascii_lowercase()),
            CopyOption::Header(header) => parsed.header = *header,
            CopyOption::Delimiter(character) => parsed.delimiter = one_byte("DELIMITER", *character)?,
            CopyOption::Quote(character) => parsed.quote = one_byte("QUOTE", *character)?,
            CopyOption::Escape(character) => parsed.escape = Some(one_byte("ESCAPE", *character)?),
            CopyOption::Null(null) => parsed.null = Some(null.clone()),
            CopyOption::Encoding(encoding)
                if encoding.eq_ignore_ascii_case("utf8") || encoding.eq_ignore_ascii_case("utf-8") => {}
            other => return plan_err!("COPY option '{other}' is not supported (supported: FORMAT, HEADER, DELIMITER, QUOTE, ESCAPE, NULL, ENCODING 'utf8')"),
        }
    }
    Ok(parsed)
}

/// PostgreSQL's options before 9.0, which psql's `\copy t from 'f' csv
/// header` still writes: `CSV [HEADER] [QUOTE 'q'] [ESCAPE 'e']`,
/// `DELIMITER 'd'`, `NULL 'n'`.
fn legacy_copy_options(
    parsed: &mut CopyOptions,
    options: &[datafusion::sql::sqlparser::ast::CopyLegacyOption],
) -> Result<()> {
    use datafusion::sql::sqlparser::ast::{CopyLegacyCsvOption, CopyLegacyOption};
    for option in options {
        match option {
            CopyLegacyOption::Csv(csv) => {
                parsed.format = Some("csv".to_string());
                for option in csv {
                    match option {
                        CopyLegacyCsvOption::Header => parsed.header = true,
                        CopyLegacyCsvOption::Quote(character) => {
                            parsed.quote = one_byte("QUOTE", *character)?
                        }
                        CopyLegacyCsvOption::Escape(character) => {
                            parsed.escape = Some(one_byte("ESCAPE", *character)?)
                        }
                        other => {
                            return plan_err!(
                                "COPY option '{other}' is not supported by COPY FROM"
                            )
                        }
                    }
                }
            }
            CopyLegacyOption::Header => parsed.header = true,
            CopyLegacyOption::Delimiter(character) => {
                parsed.delimiter = one_byte("DELIMITER", *character)?
            }
            CopyLegacyOption::Null(null) => parsed.null = Some(null.clone()),
            other => return plan_err!("COPY option '{other}' is not supported (supported: WITH (FORMAT, HEADER, DELIMITER, QUOTE, ESCAPE, NULL, ENCODING 'utf8'), or CSV [HEADER] [QUOTE 'q'] [ESCAPE 'e'], DELIMITER 'd', NULL 'n')"),
        }
    }
    Ok(())
}

/// The files `path` names: a file, every file in a directory (not those
/// starting with `.` or `_`), or the files a glob in the last part matches.
fn expand_path(path: &str) -> Result<Vec<PathBuf>> {
    let given = Path::new(path);
    let name = given
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default();
    if name.contains(['*', '?']) {
        let directory = given
            .parent()
            .filter(|parent| !parent.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        if directory.to_string_lossy().contains(['*', '?']) {
            return plan_err!("COPY FROM '{path}': a wildcard may only be in the file name");
        }
        let mut files = list_files(directory, path)?;
        files.retain(|file| {
            file.file_name().is_some_and(|file| {
                glob_matches(name.as_bytes(), file.to_string_lossy().as_bytes())
            })
        });
        if files.is_empty() {
            return plan_err!("COPY FROM '{path}': no file matches");
        }
        return Ok(files);
    }
    match std::fs::metadata(given) {
        Ok(metadata) if metadata.is_dir() => {
            let files = list_files(given, path)?;
            if files.is_empty() {
                return plan_err!("COPY FROM '{path}': the directory holds no file");
            }
            Ok(files)
        }
        Ok(_) => Ok(vec![given.to_path_buf()]),
        Err(error) => plan_err!("COPY FROM '{path}': {error}"),
    }
}

fn list_files(directory: &Path, path: &str) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(directory)
        .map_err(|error| plan_datafusion_err!("COPY FROM '{path}': {error}"))?;
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|error| plan_datafusion_err!("COPY FROM '{path}': {error}"))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || name.starts_with('_') {
            continue;
        }
        if entry.path().is_file() {
            files.push(entry.path());
        }
    }
    files.sort();
    Ok(files)
}

/// `*` any run of characters, `?` one character.
fn glob_matches(pattern: &[u8], name: &[u8]) -> bool {
    let (mut p, mut n) = (0, 0);
    let (mut star, mut resume) = (None, 0);
    while n < name.len() {
        if p < pattern.len() && (pattern[p] == b'?' || pattern[p] == name[n]) {
            p += 1;
            n += 1;
        } else if p < pattern.len() && pattern[p] == b'*' {
            star = Some(p);
            resume = n;
            p += 1;
        } else if let Some(position) = star {
            p = position + 1;
            resume += 1;
            n = resume;
        } else {
            return false;
        }
    }
    while p < pattern.len() && pattern[p] == b'*' {
        p += 1;
    }
    p == pattern.len()
}

fn format_of(options: &CopyOptions, file: &Path) -> Result<String> {
    if let Some(format) = &options.format {
        return match format.as_str() {
            "csv" | "parquet" | "json" => Ok(format.clone()),
            other => plan_err!("COPY FORMAT '{other}' is not supported (csv, parquet, json)"),
        };
    }
    let extension = file
        .extension()
        .map(|extension| extension.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default();
    match extension.as_str() {
        "csv" | "tsv" | "txt" => Ok("csv".into()),
        "parquet" => Ok("parquet".into()),
        "json" | "ndjson" | "jsonl" => Ok("json".into()),
        _ => plan_err!(
            "COPY FROM {}: the format cannot be told from the name; say WITH (FORMAT csv|parquet|json)",
            file.display()
        ),
    }
}

async fn copy_from(
    context: &SessionContext,
    catalog: &ClusterCatalog,
    statement: Box<SqlStatement>,
    sql: &str,
) -> Result<DataFrame> {
    let owned = owned(catalog)?;
    let SqlStatement::Copy {
        source,
        target,
        options,
        legacy_options,
        ..
    } = *statement
    else {
        return plan_err!("not a COPY");
    };

    let (table_name, columns) = match source {
        CopySource::Table {
            table_name,
            columns,
        } => (table_name, columns),
        CopySource::Query(_) => {
            return plan_err!(
                "COPY (query) FROM is not a statement; COPY (query) TO 'path' exports"
            )
        }
    };

    let CopyTarget::File { filename } = target else {
        return plan_err!("COPY FROM reads a file, a directory or a glob on the compute node ('path'), not STDIN or a program");
    };
    let mut options = copy_options(&options)?;
    legacy_copy_options(&mut options, &legacy_options)?;
    let name = table_name.to_string();
    let name = name.strip_prefix("public.").unwrap_or(&name).to_lowercase();
    let version = owned.store().latest_version()?;
    let Some(snapshot) = owned.store().snapshot(&name, version)? else {
        return plan_err!(
            "COPY into '{name}': there is no such table a user created (CREATE TABLE first)"
        );
    };
    super::provider::refuse_copy_change(&snapshot)?;
    let files = expand_path(&filename)?;
    let table_schema = Arc::clone(&snapshot.table.schema);
    // With a column list, the file's columns fill those, in its order;
    // the others are NULL.
    let mut listed = Vec::with_capacity(columns.len());
    for column in &columns {
        let name = column.value.to_lowercase();
        let Ok(field) = table_schema.field_with_name(&name) else {
            return plan_err!(
                "COPY names column '{name}', which '{}' does not have",
                snapshot.table.name
            );
        };
        if listed.iter().any(|field: &Field| field.name() == &name) {
            return plan_err!("COPY names column '{name}' twice");
        }
        listed.push(field.clone());
    }
    let schema = if listed.is_empty() {
        Arc::clone(&table_schema)
    } else {
        Arc::new(Schema::new(listed))
    };
    // One partition per file, read in order, so an error names its file
    // and its line counts from the file's start.
    let state = SessionStateBuilder::from(context.state()).build();
    let reader = SessionContext::new_with_state(state);
    reader
        .state_ref()
        .write()
        .config_mut()
        .options_mut()
        .optimizer
        .repartition_file_scans = false;
    let mut writer = TableWriter::new(Arc::clone(owned), snapshot.table.clone());
    for file in &files {
        let read = read_file(&reader, file, &options, &schema)
            .await
            .and_then(|frame| fill_unlisted(frame, &schema, &table_schema));
        let mut stream = match read {
            Ok(frame) => match frame.execute_stream().await {
                Ok(stream) => stream,
                Err(error) => {
                    writer.abandon().await;
                    return Err(in_file(file, &options, error));
                }
            },
            Err(error) => {
                writer.abandon().await;
                return Err(in_file(file, &options, error));
            }
        };
        while let Some(batch) = stream.next().await {
            let written = match batch {
                Ok(batch) => writer.write(batch).await,
                Err(error) => Err(in_file(file, &options, error)),
            };
            if let Err(error) = written {
                writer.abandon().await;
                return Err(error);
            }
        }
    }
    let (_, rows) = writer.commit(Change::default(), sql).await?;
    count_frame(context, rows)
}

/// A DataFrame of `file`'s rows as the table's columns.
async fn read_file(
    reader: &SessionContext,
    file: &Path,
    options: &CopyOptions,
    schema: &SchemaRef,
) -> Result<DataFrame> {
    let path = file.to_string_lossy().into_owned();
    match format_of(options, file)?.as_str() {
        "csv" => {
            let mut read = CsvReadOptions::new()
                .has_header(options.header)
                .delimiter(options.delimiter)
                .quote(options.quote)
                .newlines_in_values(true)
                .file_extension("")
                .schema(schema.as_ref());
            if let Some(escape) = options.escape {
                read = read.escape(escape);
            }
            match options.null.as_deref() {
                // DataFusion 55's CSV reader takes an empty field as NULL
                // and uses `null_regex` only to infer a schema, not to
                // read: a marker of its own would be read as a value.
                Some(null) if !null.is_empty() => {
                    let text = Schema::new(
                        schema
                            .fields()
                            .iter()
                            .map(|field| Field::new(field.name(), DataType::Utf8, true))
                            .collect::<Vec<_>>(),
                    );
                    let frame = reader.read_csv(path, read.schema(&text)).await?;
                    marked_nulls(frame, schema, null)
                }
                _ => reader.read_csv(path, read).await,
            }
        }
        "json" => {
            let read = JsonReadOptions::default()
                .file_extension("")
                .schema(schema.as_ref());
            reader.read_json(path, read).await
        }
        _ => {
            let frame = reader
                .read_parquet(path, ParquetReadOptions::default().file_extension(""))
                .await?;
            conform(frame, schema)
        }
    }
}

/// `frame` (the columns of a COPY's column list) as all of the table's
/// columns, the unlisted ones NULL.
fn fill_unlisted(frame: DataFrame, listed: &SchemaRef, table: &SchemaRef) -> Result<DataFrame> {
    use datafusion::common::ScalarValue;
    use datafusion::logical_expr::lit;
    if listed.fields().len() == table.fields().len() && listed.fields() == table.fields() {
        return Ok(frame);
    }
    let columns = table
        .fields()
        .iter()
        .map(|field| {
            Ok(if listed.field_with_name(field.name()).is_ok() {
                col(datafusion::common::Column::new_unqualified(field.name()))
            } else {
                lit(ScalarValue::try_from(field.data_type())?).alias(field.name())
            })
        })
        .collect::<Result<Vec<_>>>()?;
    frame.select(columns)
}

/// The text columns of `frame` as the table's: the `null` marker a NULL,
/// any other text cast to the column's type (a value that cannot be is an
/// error). An empty field is then an empty string, as in PostgreSQL (and
/// an error for a number or a date); the reader gives it as a NULL.
fn marked_nulls(frame: DataFrame, schema: &SchemaRef, null: &str) -> Result<DataFrame> {
    use datafusion::common::ScalarValue;
    use datafusion::logical_expr::{lit, when};
    let columns = schema
        .fields()
        .iter()
        .map(|field| {
            let text = col(datafusion::common::Column::new_unqualified(field.name()));
            Ok(when(
                text.clone().eq(lit(null)),
                lit(ScalarValue::try_from(field.data_type())?),
            )
            .otherwise(cast(
                datafusion::functions::expr_fn::coalesce(vec![text, lit("")]),
                field.data_type().clone(),
            ))?
            .alias(field.name()))
        })
        .collect::<Result<Vec<_>>>()?;
    frame.select(columns)
}

/// The columns of `frame` as the table's: by name when the file has every
/// column of the table, else by position; each cast to the table's type.
fn conform(frame: DataFrame, schema: &SchemaRef) -> Result<DataFrame> {
    let file_schema = frame.schema().clone();
    let by_name = schema.fields().iter().all(|field| {
        file_schema
            .field_with_unqualified_name(field.name())
            .is_ok()
    });
    if !by_name && file_schema.fields().len() != schema.fields().len() {
        return plan_err!(
            "the file has {} columns and not all of the table's names; the table has {}",
            file_schema.fields().len(),
            schema.fields().len()
        );
    }
    let columns = schema
        .fields()
        .iter()
        .enumerate()
        .map(|(index, field)| {
            let source = if by_name {
                col(datafusion::common::Column::new_unqualified(field.name()))
            } else {
                let (qualifier, source) = file_schema.qualified_field(index);
                col(datafusion::common::Column::new(
                    qualifier.cloned(),
                    source.name(),
                ))
            };
            cast(source, field.data_type().clone()).alias(field.name())
        })
        .collect::<Vec<_>>();
    frame.select(columns)
}

/// `error` with the file it came from; a CSV parse error's line counted
/// from the file's start.
fn in_file(file: &Path, options: &CopyOptions, error: DataFusionError) -> DataFusionError {
    let message = error.strip_backtrace();
    let message = csv_line_from_file_start(&message, options.header);
    DataFusionError::Execution(format!("COPY FROM {}: {message}", file.display()))
}

/// Arrow's CSV reader counts a bad value's line from 0 (the header, if
/// any, is line 0); a user counts lines of the file from 1. (A line here is
/// a record: a quoted value with a line break makes the file's lines more.)
fn csv_line_from_file_start(message: &str, _header: bool) -> String {
    const MARK: &str = " at line ";
    if !message.contains("Error while parsing value") {
        return message.to_string();
    }
    let Some(start) = message.find(MARK) else {
        return message.to_string();
    };
    let digits_start = start + MARK.len();
    let digits: String = message[digits_start..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    let Ok(line) = digits.parse::<usize>() else {
        return message.to_string();
    };
    format!(
        "{}{MARK}{}{}",
        &message[..start],
        line + 1,
        &message[digits_start + digits.len()..]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_file_names() {
        assert!(glob_matches(b"*.csv", b"a.csv"));
        assert!(glob_matches(b"part-?.csv", b"part-1.csv"));
        assert!(!glob_matches(b"part-?.csv", b"part-10.csv"));
        assert!(glob_matches(b"*", b"anything"));
        assert!(!glob_matches(b"*.csv", b"a.parquet"));
        assert!(glob_matches(b"a*b*c", b"aXbYc"));
    }

    #[test]
    fn csv_value_errors_count_lines_of_the_file() {
        let arrow = "Arrow error: Parser error: Error while parsing value 'x' as type 'Int64' for column 0 at line 3. Row data: '[x]'";
        assert!(csv_line_from_file_start(arrow, true).contains("at line 4."));
        assert_eq!(csv_line_from_file_start("other", true), "other");
    }
}
