//! The PostgreSQL wire protocol: pgwire's connection loop over
//! datafusion-postgres's query handlers (simple and extended protocol,
//! pg_catalog), with an accept loop of Sieve's own so that each connection
//! gets its own session, its login is checked, and TLS is required when
//! configured.
//!
//! ```text
//!   accept ─ bound (connections_max) ─ new session (SessionFactory)
//!     └─ pgwire: [TLS] ─ startup: TLS required? ─ SCRAM-SHA-256 ─ queries
//!          hooks: SET/SHOW of namespaced settings (sieve.*, datafusion.*)
//!                 run in the session, errors returned; then cursor,
//!                 PostgreSQL SET/SHOW, transactions (datafusion-postgres)
//!     └─ hang-up watcher: a client gone drops the connection and its query
//! ```

use std::fmt::Debug;
use std::future::Future;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use datafusion::common::{ParamValues, Result};
use datafusion::logical_expr::LogicalPlan;
use datafusion::prelude::SessionContext;
use datafusion::sql::sqlparser::ast::{CopySource, CopyTarget, Set, Statement};
use datafusion_postgres::arrow_pg::datatypes::df::encode_dataframe;
use datafusion_postgres::datafusion_pg_catalog::pg_catalog::context::EmptyContextProvider;
use datafusion_postgres::datafusion_pg_catalog::setup_pg_catalog;
use datafusion_postgres::hooks::cursor::CursorStatementHook;
use datafusion_postgres::hooks::set_show::SetShowHook;
use datafusion_postgres::hooks::transactions::TransactionStatementHook;
use datafusion_postgres::hooks::HookClient;
use datafusion_postgres::pgwire::api::auth::sasl::scram::{ScramAuth, SCRAM_ITERATIONS};
use datafusion_postgres::pgwire::api::auth::sasl::SASLAuthStartupHandler;
use datafusion_postgres::pgwire::api::auth::{
    AuthSource, DefaultServerParameterProvider, StartupHandler,
};
use datafusion_postgres::pgwire::api::cancel::DefaultCancelHandler;
use datafusion_postgres::pgwire::api::copy::CopyHandler;
use datafusion_postgres::pgwire::api::portal::Format;
use datafusion_postgres::pgwire::api::query::{ExtendedQueryHandler, SimpleQueryHandler};
use datafusion_postgres::pgwire::api::results::{CopyResponse, Response, Tag};
use datafusion_postgres::pgwire::api::{
    ClientInfo, ConnectionManager, ErrorHandler, PgWireServerHandlers,
};
use datafusion_postgres::pgwire::error::{ErrorInfo, PgWireError, PgWireResult};
use datafusion_postgres::pgwire::messages::copy::{CopyData, CopyDone, CopyFail};
use datafusion_postgres::pgwire::messages::response::TransactionStatus;
use datafusion_postgres::pgwire::messages::{PgWireBackendMessage, PgWireFrontendMessage};
use datafusion_postgres::pgwire::tokio::process_socket;
use datafusion_postgres::{DfSessionService, QueryHook};
use futures::{Sink, SinkExt};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;

use crate::copy_text::TextToCsv;
use crate::errors::SqlStates;
use crate::hangup::client_gone;
use crate::settings::{show_sieve_setting, sieve_setting_shown};
use crate::Users;

/// Makes the session of a new connection (over the cluster the server
/// serves; each call a new, independent session).
pub type SessionFactory = Arc<dyn Fn() -> Result<SessionContext> + Send + Sync>;

/// Default bound on open client connections (`--connections-max`).
pub const CONNECTIONS_MAX_DEFAULT: usize = 64;

/// The catalog datafusion's sessions name their tables under, and where
/// `pg_catalog` is added.
const CATALOG: &str = "datafusion";

/// How the PostgreSQL port is served.
#[derive(Clone)]
pub struct PgServerOptions {
    /// Who may log in (SCRAM-SHA-256).
    pub users: Arc<Users>,
    /// With an acceptor, every connection must use TLS; a plaintext one is
    /// refused after its startup message.
    pub tls: Option<TlsAcceptor>,
    /// Connections served at once; more are refused with SQLSTATE 53300.
    pub connections_max: usize,
}

impl Debug for PgServerOptions {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("PgServerOptions")
            .field("users", &self.users)
            .field("tls", &self.tls.is_some())
            .field("connections_max", &self.connections_max)
            .finish()
    }
}

/// Serve the PostgreSQL protocol on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    factory: SessionFactory,
    options: PgServerOptions,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let connections = Arc::new(Semaphore::new(options.connections_max));
    // Shared by every connection: a cancel request names its connection by
    // the process id and secret key that connection was given.
    let manager = Arc::new(ConnectionManager::new());
    let options = Arc::new(options);
    tokio::pin!(shutdown);
    loop {
        let (socket, peer) = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of descriptors, or a connection reset before it
                    // was accepted: wait a little, go on.
                    log::warn!("PostgreSQL port: accept failed: {error}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = socket.set_nodelay(true);
        let permit = Arc::clone(&connections).try_acquire_owned().ok();
        let (factory, options, manager) = (
            Arc::clone(&factory),
            Arc::clone(&options),
            Arc::clone(&manager),
        );
        tokio::spawn(async move {
            let refused = permit.is_none().then(|| {
                format!(
                    "too many connections: this server takes at most {} at once \
                     (sieve serve --connections-max)",
                    options.connections_max
                )
            });
            let handlers = match Connection::open(&factory, &options, &manager, refused) {
                Ok(handlers) => handlers,
                Err(error) => {
                    log::warn!("{peer}: cannot open a session: {error}");
                    return;
                }
            };
            let watch = socket.as_fd().try_clone_to_owned();
            let served = process_socket(socket, options.tls.clone(), handlers);
            match watch {
                Ok(watch) => {
                    tokio::select! {
                        result = served => {
                            if let Err(error) = result {
                                log::debug!("{peer}: connection ended: {error}");
                            }
                        }
                        _ = client_gone(watch) => {
                            log::info!("{peer} hung up: its query, if any, is cancelled");
                        }
                    }
                }
                Err(error) => {
                    log::warn!("{peer}: cannot watch the connection for a hang-up: {error}");
                    let _ = served.await;
                }
            }
            drop(permit);
        });
    }
}

/// The handlers of one connection, around its own session.
struct Connection {
    service: Arc<DfSessionService>,
    startup: Arc<Startup>,
    cancel: Arc<DefaultCancelHandler>,
    copy_in: Arc<CopyIn>,
}

impl Connection {
    fn open(
        factory: &SessionFactory,
        options: &PgServerOptions,
        manager: &Arc<ConnectionManager>,
        refused: Option<String>,
    ) -> Result<Self> {
        let context = Arc::new(factory()?);
        let copy_in = Arc::new(CopyIn::default());
        setup_pg_catalog(&context, CATALOG, EmptyContextProvider).map_err(|error| *error)?;
        context.register_udf(postgres_version());
        context.register_udf(no_such_type());
        context.register_udf(no_serial_sequence());
        let hooks: Vec<Arc<dyn QueryHook>> = vec![
            Arc::new(NamespacedSettings),
            Arc::new(CursorStatementHook),
            Arc::new(SetShowHook),
            Arc::new(ChangesInBlocks),
            Arc::new(TransactionStatementHook),
            Arc::new(SieveStatements {
                copy_in: Arc::clone(&copy_in),
            }),
        ];
        let service = Arc::new(DfSessionService::new_with_hooks(context, hooks));
        let users: Arc<dyn AuthSource> = Arc::clone(&options.users) as Arc<dyn AuthSource>;
        let mut scram = ScramAuth::new(users);
        scram.set_iterations(SCRAM_ITERATIONS);
        let login =
            SASLAuthStartupHandler::new(Arc::new(DefaultServerParameterProvider::default()))
                .with_scram(scram)
                .with_connection_manager(Arc::clone(manager));
        Ok(Self {
            service,
            startup: Arc::new(Startup {
                login,
                tls_required: options.tls.is_some(),
                refused,
            }),
            cancel: Arc::new(DefaultCancelHandler::new(Arc::clone(manager))),
            copy_in,
        })
    }
}

impl PgWireServerHandlers for Connection {
    fn simple_query_handler(&self) -> Arc<impl SimpleQueryHandler> {
        Arc::clone(&self.service)
    }

    fn extended_query_handler(&self) -> Arc<impl ExtendedQueryHandler> {
        Arc::clone(&self.service)
    }

    fn startup_handler(&self) -> Arc<impl StartupHandler> {
        Arc::clone(&self.startup)
    }

    fn error_handler(&self) -> Arc<impl ErrorHandler> {
        Arc::new(SqlStates)
    }

    fn copy_handler(&self) -> Arc<impl CopyHandler> {
        Arc::clone(&self.copy_in)
    }

    fn cancel_handler(&self) -> Arc<impl datafusion_postgres::pgwire::api::cancel::CancelHandler> {
        Arc::clone(&self.cancel)
    }
}

/// `version()` as PostgreSQL words it, the number pgwire reports as
/// `server_version`: drivers parse it (SQLAlchemy's PostgreSQL dialect
/// refuses to connect past DataFusion's own `Apache DataFusion 55.2.0`).
fn postgres_version() -> datafusion::logical_expr::ScalarUDF {
    use datafusion::arrow::datatypes::DataType;
    use datafusion::common::ScalarValue;
    use datafusion::logical_expr::{create_udf, ColumnarValue, Volatility};
    let text = format!(
        "PostgreSQL 16.6 (Sieve {}, Apache DataFusion {}) on {}-linux",
        env!("CARGO_PKG_VERSION"),
        datafusion::DATAFUSION_VERSION,
        std::env::consts::ARCH
    );
    create_udf(
        "version",
        vec![],
        DataType::Utf8,
        Volatility::Stable,
        Arc::new(move |_| Ok(ColumnarValue::Scalar(ScalarValue::Utf8(Some(text.clone()))))),
    )
}

/// `to_regtype(name)`: NULL, as PostgreSQL answers for a type it does
/// not have. psycopg's `TypeInfo.fetch` (which SQLAlchemy's dialect calls
/// for `hstore` when it connects) looks a type up with it; the types
/// Sieve has are the built-in ones drivers know by OID already.
fn no_such_type() -> datafusion::logical_expr::ScalarUDF {
    use datafusion::arrow::datatypes::DataType;
    use datafusion::common::ScalarValue;
    use datafusion::logical_expr::{create_udf, ColumnarValue, Volatility};
    create_udf(
        "to_regtype",
        vec![DataType::Utf8],
        DataType::Int64,
        Volatility::Stable,
        Arc::new(|_| Ok(ColumnarValue::Scalar(ScalarValue::Int64(None)))),
    )
}

/// `pg_get_serial_sequence(table, column)`: NULL, as PostgreSQL answers
/// for a column without a sequence (Sieve has none). SQLAlchemy's
/// `inspect(engine).get_columns(table)` asks it for every column.
fn no_serial_sequence() -> datafusion::logical_expr::ScalarUDF {
    use datafusion::arrow::datatypes::DataType;
    use datafusion::common::ScalarValue;
    use datafusion::logical_expr::{create_udf, ColumnarValue, Volatility};
    create_udf(
        "pg_get_serial_sequence",
        vec![DataType::Utf8, DataType::Utf8],
        DataType::Utf8,
        Volatility::Stable,
        Arc::new(|_| Ok(ColumnarValue::Scalar(ScalarValue::Utf8(None)))),
    )
}

/// The startup of a connection: refused when over the bound or when it is
/// plaintext and TLS is required, else the SCRAM login.
struct Startup {
    login: SASLAuthStartupHandler<DefaultServerParameterProvider>,
    tls_required: bool,
    refused: Option<String>,
}

fn fatal(code: &str, message: String) -> PgWireError {
    PgWireError::UserError(Box::new(ErrorInfo::new(
        "FATAL".to_string(),
        code.to_string(),
        message,
    )))
}

#[async_trait]
impl StartupHandler for Startup {
    async fn on_startup<C>(
        &self,
        client: &mut C,
        message: PgWireFrontendMessage,
    ) -> PgWireResult<()>
    where
        C: ClientInfo + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        if matches!(message, PgWireFrontendMessage::Startup(_)) {
            if let Some(reason) = &self.refused {
                // too_many_connections
                return Err(fatal("53300", reason.clone()));
            }
            if self.tls_required && !client.is_secure() {
                // invalid_authorization_specification, as PostgreSQL's
                // hostssl-only pg_hba answers a plaintext connection
                return Err(fatal(
                    "28000",
                    "this server accepts only TLS connections (use sslmode=require)".to_string(),
                ));
            }
        }
        self.login.on_startup(client, message).await
    }
}

/// `CREATE TABLE` and `COPY table FROM 'path'` of the tables users own,
/// which Sieve runs itself ([`sieve_compute::tables::statements`]); the
/// rest of their statements (INSERT, TRUNCATE, DROP TABLE) reach Sieve
/// through DataFusion.
#[derive(Debug)]
struct SieveStatements {
    /// The connection's `COPY ... FROM STDIN`, if one is under way.
    copy_in: Arc<CopyIn>,
}

/// The command tag `statement` answers with, if Sieve runs it.
fn sieve_statement_tag(statement: &Statement) -> Option<&'static str> {
    match statement {
        Statement::CreateTable(create) if !create.external => Some("CREATE TABLE"),
        Statement::Copy { to: false, .. } => Some("COPY"),
        _ => None,
    }
}

async fn run_sieve_statement(
    context: &SessionContext,
    statement: &Statement,
    tag: &'static str,
) -> PgWireResult<Response> {
    let frame = sieve_compute::tables::statements::run_sql(context, &statement.to_string())
        .await
        .map_err(api_error)?;
    let batches = frame.collect().await.map_err(api_error)?;
    let rows = batches
        .first()
        .filter(|batch| batch.num_columns() == 1 && batch.num_rows() == 1)
        .and_then(|batch| {
            batch
                .column(0)
                .as_any()
                .downcast_ref::<datafusion::arrow::array::UInt64Array>()
                .map(|counts| counts.value(0) as usize)
        });
    Ok(Response::Execution(match (tag, rows) {
        ("COPY", rows) => Tag::new("COPY").with_rows(rows.unwrap_or(0)),
        // CREATE TABLE ... AS answers as PostgreSQL does.
        (_, Some(rows)) => Tag::new("SELECT").with_rows(rows),
        (tag, None) => Tag::new(tag),
    }))
}

/// The command tag PostgreSQL answers `statement` with, for the statements
/// DataFusion runs that answer with no rows: a count of rows changed
/// (`UPDATE 2`, `DELETE 0`) or the command's name (`DROP TABLE`).
/// datafusion-postgres tags only `INSERT` so; the others would come back
/// as a one-row result (`SELECT 1` with a `count` column, which drivers
/// take as one row changed) or, in the extended protocol, as rows after a
/// description of none, which clients refuse.
fn command_tag(statement: &Statement) -> Option<(String, bool)> {
    match statement {
        Statement::Update(_) => Some(("UPDATE".to_string(), true)),
        Statement::Delete(_) => Some(("DELETE".to_string(), true)),
        Statement::Truncate(_) => Some(("TRUNCATE TABLE".to_string(), false)),
        Statement::Drop { object_type, .. } => Some((format!("DROP {object_type}"), false)),
        Statement::CreateView(_) => Some(("CREATE VIEW".to_string(), false)),
        Statement::CreateSchema { .. } => Some(("CREATE SCHEMA".to_string(), false)),
        Statement::Prepare { .. } => Some(("PREPARE".to_string(), false)),
        Statement::Deallocate { .. } => Some(("DEALLOCATE".to_string(), false)),
        _ => None,
    }
}

/// The plan of a statement a hook answers itself at execution: no rows,
/// no columns.
fn nothing_planned() -> LogicalPlan {
    LogicalPlan::EmptyRelation(datafusion::logical_expr::EmptyRelation {
        produce_one_row: false,
        schema: Arc::new(datafusion::common::DFSchema::empty()),
    })
}

/// `DEALLOCATE ALL`, which psycopg sends after a statement tagged `DROP`
/// or `ALTER` to drop the statements it prepared. They are left in place:
/// pgwire's store of a connection's statements cannot list them, and a
/// client that deallocates all never names them again (psycopg numbers
/// new ones on). DataFusion would take `ALL` for a statement's name and
/// fail.
fn deallocate_all(statement: &Statement) -> bool {
    matches!(statement, Statement::Deallocate { name, .. }
        if name.quote_style.is_none() && name.value.eq_ignore_ascii_case("all"))
}

/// Runs `plan` and answers with `tag`, with the rows it counted when
/// `counted`.
async fn run_tagged(
    context: &SessionContext,
    plan: LogicalPlan,
    (tag, counted): (String, bool),
) -> PgWireResult<Response> {
    let batches = context
        .execute_logical_plan(plan)
        .await
        .map_err(api_error)?
        .collect()
        .await
        .map_err(api_error)?;
    if !counted {
        return Ok(Response::Execution(Tag::new(&tag)));
    }
    let rows = crate::changed_rows(&batches);
    Ok(Response::Execution(Tag::new(&tag).with_rows(rows as usize)))
}

#[async_trait]
impl QueryHook for SieveStatements {
    async fn handle_simple_query(
        &self,
        statement: &Statement,
        context: &SessionContext,
        _client: &mut dyn HookClient,
    ) -> Option<PgWireResult<Response>> {
        if let Err(error) = sieve_compute::tables::statements::refuse_unsound_dml(statement) {
            return Some(Err(api_error(error)));
        }
        if deallocate_all(statement) {
            return Some(Ok(Response::Execution(Tag::new("DEALLOCATE ALL"))));
        }
        if let Some(tag) = command_tag(statement) {
            let planned = context
                .state()
                .create_logical_plan(&statement.to_string())
                .await
                .map_err(api_error);
            return Some(match planned {
                Ok(plan) => run_tagged(context, plan, tag).await,
                Err(error) => Err(error),
            });
        }
        let tag = sieve_statement_tag(statement)?;
        if from_stdin(statement) {
            return Some(self.copy_in.start(context, statement).await);
        }
        Some(run_sieve_statement(context, statement, tag).await)
    }

    async fn handle_extended_parse_query(
        &self,
        statement: &Statement,
        _context: &SessionContext,
        _client: &(dyn ClientInfo + Send + Sync),
    ) -> Option<PgWireResult<LogicalPlan>> {
        if let Err(error) = sieve_compute::tables::statements::refuse_unsound_dml(statement) {
            return Some(Err(api_error(error)));
        }
        sieve_statement_tag(statement)?;
        // No result columns; the statement runs at execution.
        Some(Ok(nothing_planned()))
    }

    async fn handle_extended_query(
        &self,
        statement: &Statement,
        plan: &LogicalPlan,
        params: &ParamValues,
        context: &SessionContext,
        _client: &mut dyn HookClient,
    ) -> Option<PgWireResult<Response>> {
        if deallocate_all(statement) {
            return Some(Ok(Response::Execution(Tag::new("DEALLOCATE ALL"))));
        }
        if let Some(tag) = command_tag(statement) {
            return Some(match plan.clone().replace_params_with_values(params) {
                Ok(plan) => run_tagged(context, plan, tag).await,
                Err(error) => Err(api_error(error)),
            });
        }
        let tag = sieve_statement_tag(statement)?;
        if from_stdin(statement) {
            return Some(self.copy_in.start(context, statement).await);
        }
        Some(run_sieve_statement(context, statement, tag).await)
    }
}

/// `COPY table FROM STDIN`.
fn from_stdin(statement: &Statement) -> bool {
    matches!(
        statement,
        Statement::Copy {
            to: false,
            target: CopyTarget::Stdin,
            ..
        }
    )
}

/// Bytes one `COPY ... FROM STDIN` may send.
pub const COPY_STDIN_BYTES_MAX: u64 = 64 << 30;

/// `COPY table FROM STDIN` (psql's `\copy`, psycopg's `cursor.copy`,
/// JDBC's `CopyManager`): the client's data is spooled to a file of the
/// compute node's temporary directory as it arrives, and when the client
/// says it is done, the file is loaded as `COPY table FROM 'file'` would
/// load it (same formats, options, checks and errors; one commit). A
/// client that fails the copy, a connection that drops, or data past
/// [`COPY_STDIN_BYTES_MAX`] loads nothing, and the file is removed.
#[derive(Debug, Default)]
struct CopyIn {
    state: tokio::sync::Mutex<Option<Spool>>,
}

/// A copy under way: where its bytes go and what loads them.
struct Spool {
    context: SessionContext,
    /// `COPY table FROM '<file>' ...` for the spooled file.
    load: String,
    file: Option<tokio::fs::File>,
    path: SpoolPath,
    bytes: u64,
    /// The first thing that went wrong; reported at CopyDone.
    failed: Option<PgWireError>,
    /// PostgreSQL's text format, rewritten as CSV on the way in.
    text: Option<TextToCsv>,
}

/// The text-format rewriter `COPY ... FROM STDIN` with these options
/// needs: `None` for CSV, JSON and Parquet, which are spooled as sent.
fn text_format(
    options: &[datafusion::sql::sqlparser::ast::CopyOption],
    legacy_options: &[datafusion::sql::sqlparser::ast::CopyLegacyOption],
) -> PgWireResult<Option<TextToCsv>> {
    use datafusion::sql::sqlparser::ast::{CopyLegacyOption, CopyOption};
    let mut text = !legacy_options
        .iter()
        .any(|option| matches!(option, CopyLegacyOption::Csv(_) | CopyLegacyOption::Binary));
    let (mut delimiter, mut null, mut header) = (b'\t', "\\N".to_string(), false);
    let one_byte = |character: char| {
        u8::try_from(character)
            .ok()
            .filter(u8::is_ascii)
            .ok_or_else(|| {
                copy_error(
                    "22023",
                    format!("COPY's delimiter must be one ASCII character, not '{character}'"),
                )
            })
    };
    for option in options {
        match option {
            CopyOption::Format(format) => text = format.value.eq_ignore_ascii_case("text"),
            CopyOption::Delimiter(character) => delimiter = one_byte(*character)?,
            CopyOption::Null(marker) => null = marker.clone(),
            CopyOption::Header(given) => header = *given,
            _ => {}
        }
    }
    for option in legacy_options {
        match option {
            CopyLegacyOption::Delimiter(character) => delimiter = one_byte(*character)?,
            CopyLegacyOption::Null(marker) => null = marker.clone(),
            CopyLegacyOption::Header => header = true,
            _ => {}
        }
    }
    if !text {
        return Ok(None);
    }
    // Options text has no use for are refused, as PostgreSQL does.
    if let Some(option) = options.iter().find(|option| {
        !matches!(
            option,
            CopyOption::Format(_)
                | CopyOption::Delimiter(_)
                | CopyOption::Null(_)
                | CopyOption::Header(_)
                | CopyOption::Encoding(_)
        )
    }) {
        return Err(copy_error(
            "42601",
            format!(
                "COPY option '{option}' is not one of the text format's (DELIMITER, NULL, HEADER)"
            ),
        ));
    }
    Ok(Some(TextToCsv::new(delimiter, &null, header)))
}

impl Debug for Spool {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Spool")
            .field("load", &self.load)
            .field("bytes", &self.bytes)
            .finish()
    }
}

/// The spool file, removed when the copy ends however it ends.
#[derive(Debug)]
struct SpoolPath(std::path::PathBuf);

impl Drop for SpoolPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn copy_error(code: &str, message: String) -> PgWireError {
    PgWireError::UserError(Box::new(ErrorInfo::new(
        "ERROR".to_string(),
        code.to_string(),
        message,
    )))
}

impl CopyIn {
    async fn start(
        &self,
        context: &SessionContext,
        statement: &Statement,
    ) -> PgWireResult<Response> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static SPOOLS: AtomicU64 = AtomicU64::new(0);
        let Statement::Copy {
            source: CopySource::Table { table_name, .. },
            options,
            legacy_options,
            ..
        } = statement
        else {
            return Err(copy_error(
                "0A000",
                "COPY (query) FROM STDIN is not a statement".to_string(),
            ));
        };
        let text = text_format(options, legacy_options)?;
        let name = table_name.to_string();
        let name = name.strip_prefix("public.").unwrap_or(&name).to_lowercase();
        let columns = context
            .table_provider(name.as_str())
            .await
            .map_err(api_error)?
            .schema()
            .fields()
            .len();
        let path = SpoolPath(std::env::temp_dir().join(format!(
            "sieve-copy-{}-{}",
            std::process::id(),
            SPOOLS.fetch_add(1, Ordering::Relaxed)
        )));
        let file = tokio::fs::File::create(&path.0)
            .await
            .map_err(|error| copy_error("58030", format!("COPY FROM STDIN: {error}")))?;
        let mut load = statement.clone();
        if let Statement::Copy {
            target,
            options,
            legacy_options,
            ..
        } = &mut load
        {
            *target = CopyTarget::File {
                filename: path.0.to_string_lossy().into_owned(),
            };
            if text.is_some() {
                use datafusion::sql::sqlparser::ast::{CopyOption, Ident};
                *legacy_options = vec![];
                *options = vec![
                    CopyOption::Format(Ident::new("csv")),
                    CopyOption::Null(crate::copy_text::CSV_NULL.to_string()),
                ];
            }
        }
        let mut state = self.state.lock().await;
        *state = Some(Spool {
            context: context.clone(),
            load: load.to_string(),
            file: Some(file),
            path,
            bytes: 0,
            failed: None,
            text,
        });
        Ok(Response::CopyIn(CopyResponse::new(
            0,
            columns,
            futures::stream::empty(),
        )))
    }
}

#[async_trait]
impl CopyHandler for CopyIn {
    async fn on_copy_data<C>(&self, _client: &mut C, copy_data: CopyData) -> PgWireResult<()>
    where
        C: ClientInfo + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        use tokio::io::AsyncWriteExt;
        let mut state = self.state.lock().await;
        let Some(spool) = state.as_mut() else {
            return Ok(());
        };
        if spool.failed.is_some() {
            return Ok(());
        }
        spool.bytes += copy_data.data.len() as u64;
        if spool.bytes > COPY_STDIN_BYTES_MAX {
            spool.failed = Some(copy_error(
                "54000",
                format!("COPY FROM STDIN sent more than {COPY_STDIN_BYTES_MAX} bytes (COPY_STDIN_BYTES_MAX); nothing was loaded"),
            ));
            spool.file = None;
            return Ok(());
        }
        let rewritten;
        let data: &[u8] = match spool.text.as_mut() {
            None => &copy_data.data,
            Some(text) => {
                let mut out = Vec::with_capacity(copy_data.data.len() + copy_data.data.len() / 4);
                if let Err(error) = text.push(&copy_data.data, &mut out) {
                    spool.failed = Some(copy_error(
                        "22P02",
                        format!("COPY FROM STDIN: {error}; nothing was loaded"),
                    ));
                    spool.file = None;
                    return Ok(());
                }
                rewritten = out;
                &rewritten
            }
        };
        if let Some(file) = spool.file.as_mut() {
            if let Err(error) = file.write_all(data).await {
                spool.failed = Some(copy_error(
                    "58030",
                    format!(
                        "COPY FROM STDIN could not keep the data ({error}); nothing was loaded"
                    ),
                ));
                spool.file = None;
            }
        }
        Ok(())
    }

    async fn on_copy_done<C>(&self, client: &mut C, _done: CopyDone) -> PgWireResult<()>
    where
        C: ClientInfo + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        use tokio::io::AsyncWriteExt;
        let Some(mut spool) = self.state.lock().await.take() else {
            return Err(copy_error("08P01", "CopyDone without a COPY".to_string()));
        };
        if let Some(failed) = spool.failed.take() {
            return Err(failed);
        }
        if let Some(mut file) = spool.file.take() {
            if let Some(text) = spool.text.as_mut() {
                let mut out = Vec::new();
                text.finish(&mut out).map_err(|error| {
                    copy_error(
                        "22P02",
                        format!("COPY FROM STDIN: {error}; nothing was loaded"),
                    )
                })?;
                file.write_all(&out)
                    .await
                    .map_err(|error| copy_error("58030", format!("COPY FROM STDIN: {error}")))?;
            }
            file.flush()
                .await
                .map_err(|error| copy_error("58030", format!("COPY FROM STDIN: {error}")))?;
        }
        let spooled = spool.path.0.to_string_lossy().into_owned();
        let loaded = async {
            let frame =
                sieve_compute::tables::statements::run_sql(&spool.context, &spool.load).await?;
            frame.collect().await
        }
        .await;
        let batches = match loaded {
            Ok(batches) => batches,
            Err(error) => {
                let code = crate::errors::sqlstate(&error);
                let message = error.strip_backtrace().replace(&spooled, "STDIN");
                return Err(copy_error(code, message));
            }
        };
        let rows = crate::changed_rows(&batches) as usize;
        client
            .send(PgWireBackendMessage::CommandComplete(
                Tag::new("COPY").with_rows(rows).into(),
            ))
            .await?;
        Ok(())
    }

    async fn on_copy_fail<C>(&self, _client: &mut C, fail: CopyFail) -> PgWireError
    where
        C: ClientInfo + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        self.state.lock().await.take();
        copy_error(
            "57014",
            format!(
                "COPY FROM STDIN failed in the client: {}; nothing was loaded",
                fail.message
            ),
        )
    }
}

/// Statements that change data inside `BEGIN ... ROLLBACK`. Sieve has no
/// transaction blocks: each statement commits when it runs, as in
/// autocommit (datafusion-postgres answers `BEGIN`, `COMMIT` and
/// `ROLLBACK` and keeps the connection's transaction status, nothing
/// more). A block's `COMMIT` is therefore true, and its `ROLLBACK` would
/// be a lie once something in the block changed data: that `ROLLBACK` is
/// an error which says what stays. The block then ends at the next
/// `ROLLBACK` or `COMMIT`, as any block whose statement failed.
#[derive(Debug)]
struct ChangesInBlocks;

/// Where a connection counts the statements that changed data in its
/// current block (pgwire's metadata of the connection).
const CHANGES_IN_BLOCK: &str = "sieve.changes_in_block";

/// Whether `statement` may change data or tables.
fn changes_data(statement: &Statement) -> bool {
    matches!(
        statement,
        Statement::Insert(_)
            | Statement::Update(_)
            | Statement::Delete(_)
            | Statement::Merge(_)
            | Statement::Truncate(_)
            | Statement::CreateTable(_)
            | Statement::CreateView(_)
            | Statement::CreateSchema { .. }
            | Statement::AlterTable(_)
            | Statement::Drop { .. }
            | Statement::Copy { to: false, .. }
    )
}

fn note_changes(
    statement: &Statement,
    client: &mut dyn HookClient,
) -> Option<PgWireResult<Response>> {
    // In a block that failed, only its end is taken, as in PostgreSQL,
    // with PostgreSQL's in_failed_sql_transaction (datafusion-postgres
    // answers 25P01, no_active_sql_transaction, which drivers map to
    // another error).
    if client.transaction_status() == TransactionStatus::Error
        && !matches!(
            statement,
            Statement::Commit { .. }
                | Statement::Rollback { .. }
                | Statement::Savepoint { .. }
                | Statement::ReleaseSavepoint { .. }
        )
    {
        return Some(Err(copy_error(
            "25P02",
            "current transaction is aborted, commands ignored until end of transaction block"
                .to_string(),
        )));
    }
    match statement {
        Statement::StartTransaction { .. } => {
            if client.transaction_status() == TransactionStatus::Idle {
                client.metadata_mut().remove(CHANGES_IN_BLOCK);
                client.metadata_mut().remove(SAVEPOINTS);
            }
            None
        }
        Statement::Commit { .. } => {
            client.metadata_mut().remove(CHANGES_IN_BLOCK);
            client.metadata_mut().remove(SAVEPOINTS);
            None
        }
        Statement::Savepoint { name } => Some(savepoint(client, &name.value)),
        Statement::ReleaseSavepoint { name } => Some(release_savepoint(client, &name.value)),
        Statement::Rollback {
            savepoint: Some(name),
            ..
        } => Some(rollback_to_savepoint(client, &name.value)),
        Statement::Rollback {
            savepoint: None, ..
        } => {
            client.metadata_mut().remove(SAVEPOINTS);
            let changes = client.metadata_mut().remove(CHANGES_IN_BLOCK)?;
            Some(Err(PgWireError::UserError(Box::new(ErrorInfo::new(
                "ERROR".to_string(),
                // feature_not_supported
                "0A000".to_string(),
                format!(
                    "ROLLBACK cannot undo this block: {changes} statement(s) in it that change \
                     data were committed when they ran (Sieve commits each statement, as in \
                     autocommit); their changes stay. The block ends at the next ROLLBACK or \
                     COMMIT"
                ),
            )))))
        }
        statement
            if changes_data(statement)
                && client.transaction_status() == TransactionStatus::Transaction =>
        {
            let metadata = client.metadata_mut();
            let changes = metadata
                .get(CHANGES_IN_BLOCK)
                .and_then(|changes| changes.parse::<u64>().ok())
                .unwrap_or(0);
            metadata.insert(CHANGES_IN_BLOCK.to_string(), (changes + 1).to_string());
            None
        }
        _ => None,
    }
}

/// Where a connection keeps its block's savepoints: a line each, the
/// count of changes when it was set and its name, oldest first.
const SAVEPOINTS: &str = "sieve.savepoints";

fn changes_now(client: &dyn HookClient) -> u64 {
    client
        .metadata()
        .get(CHANGES_IN_BLOCK)
        .and_then(|changes| changes.parse().ok())
        .unwrap_or(0)
}

fn savepoints(client: &dyn HookClient) -> Vec<(u64, String)> {
    client
        .metadata()
        .get(SAVEPOINTS)
        .map(|lines| {
            lines
                .lines()
                .filter_map(|line| {
                    let (changes, name) = line.split_once(' ')?;
                    Some((changes.parse().ok()?, name.to_string()))
                })
                .collect()
        })
        .unwrap_or_default()
}

fn keep_savepoints(client: &mut dyn HookClient, kept: &[(u64, String)]) {
    let lines: Vec<String> = kept
        .iter()
        .map(|(changes, name)| format!("{changes} {}", name.replace('\n', " ")))
        .collect();
    client
        .metadata_mut()
        .insert(SAVEPOINTS.to_string(), lines.join("\n"));
}

fn in_block(client: &dyn HookClient, what: &str) -> PgWireResult<()> {
    match client.transaction_status() {
        TransactionStatus::Transaction => Ok(()),
        // no_active_sql_transaction
        TransactionStatus::Idle => Err(copy_error(
            "25P01",
            format!("{what} can only be used in transaction blocks"),
        )),
        // in_failed_sql_transaction
        TransactionStatus::Error => Err(copy_error(
            "25P02",
            format!("current transaction is aborted ({what} cannot bring it back here): end the block with ROLLBACK"),
        )),
    }
}

/// `SAVEPOINT name`: remembered with the changes made so far.
fn savepoint(client: &mut dyn HookClient, name: &str) -> PgWireResult<Response> {
    in_block(client, "SAVEPOINT")?;
    let mut kept = savepoints(client);
    kept.push((changes_now(client), name.replace('\n', " ")));
    keep_savepoints(client, &kept);
    Ok(Response::Execution(Tag::new("SAVEPOINT")))
}

fn savepoint_position(kept: &[(u64, String)], name: &str) -> PgWireResult<usize> {
    let name = name.replace('\n', " ");
    kept.iter()
        .rposition(|(_, kept)| *kept == name)
        .ok_or_else(|| copy_error("3B001", format!("savepoint \"{name}\" does not exist")))
}

/// `RELEASE SAVEPOINT name`: it and the later ones forgotten.
fn release_savepoint(client: &mut dyn HookClient, name: &str) -> PgWireResult<Response> {
    in_block(client, "RELEASE SAVEPOINT")?;
    let mut kept = savepoints(client);
    let position = savepoint_position(&kept, name)?;
    kept.truncate(position);
    keep_savepoints(client, &kept);
    Ok(Response::Execution(Tag::new("RELEASE")))
}

/// `ROLLBACK TO SAVEPOINT name`: true when nothing changed data since;
/// else an error saying the changes stay, as a block's ROLLBACK.
fn rollback_to_savepoint(client: &mut dyn HookClient, name: &str) -> PgWireResult<Response> {
    in_block(client, "ROLLBACK TO SAVEPOINT")?;
    let mut kept = savepoints(client);
    let position = savepoint_position(&kept, name)?;
    let since = changes_now(client).saturating_sub(kept[position].0);
    if since > 0 {
        return Err(copy_error(
            "0A000",
            format!("ROLLBACK TO SAVEPOINT cannot undo the {since} statement(s) since it that change data: they were committed when they ran (Sieve commits each statement); their changes stay"),
        ));
    }
    kept.truncate(position + 1);
    keep_savepoints(client, &kept);
    Ok(Response::Execution(Tag::new("ROLLBACK")))
}

#[async_trait]
impl QueryHook for ChangesInBlocks {
    async fn handle_simple_query(
        &self,
        statement: &Statement,
        _context: &SessionContext,
        client: &mut dyn HookClient,
    ) -> Option<PgWireResult<Response>> {
        note_changes(statement, client)
    }

    async fn handle_extended_parse_query(
        &self,
        statement: &Statement,
        _context: &SessionContext,
        _client: &(dyn ClientInfo + Send + Sync),
    ) -> Option<PgWireResult<LogicalPlan>> {
        // Savepoints plan as nothing; they are answered at execution.
        matches!(
            statement,
            Statement::Savepoint { .. }
                | Statement::ReleaseSavepoint { .. }
                | Statement::Rollback {
                    savepoint: Some(_),
                    ..
                }
        )
        .then(|| Ok(nothing_planned()))
    }

    async fn handle_extended_query(
        &self,
        statement: &Statement,
        _plan: &LogicalPlan,
        _params: &ParamValues,
        _context: &SessionContext,
        client: &mut dyn HookClient,
    ) -> Option<PgWireResult<Response>> {
        note_changes(statement, client)
    }
}

/// `SET` and `SHOW` of a namespaced setting (`sieve.ndp`,
/// `datafusion.execution.batch_size`): run in the connection's own session,
/// so they affect this connection only, and an unknown name or a bad value
/// is an error (datafusion-postgres's own hook would drop it with a warning).
#[derive(Debug)]
struct NamespacedSettings;

/// Whether `statement` sets or shows a namespaced setting.
fn namespaced(statement: &Statement) -> bool {
    match statement {
        Statement::Set(Set::SingleAssignment {
            scope: None,
            hivevar: false,
            variable,
            ..
        }) => variable.0.len() > 1,
        // Not PostgreSQL's `SHOW TRANSACTION ISOLATION LEVEL` (three words),
        // which datafusion-postgres answers.
        Statement::ShowVariable { variable } => {
            variable.len() > 1
                && ["sieve", "datafusion"]
                    .iter()
                    .any(|namespace| variable[0].value.eq_ignore_ascii_case(namespace))
        }
        _ => false,
    }
}

fn api_error(error: datafusion::error::DataFusionError) -> PgWireError {
    PgWireError::ApiError(Box::new(error))
}

async fn run_setting(context: &SessionContext, plan: LogicalPlan) -> PgWireResult<Response> {
    let is_set = matches!(plan, LogicalPlan::Statement(_));
    let frame = context
        .execute_logical_plan(plan)
        .await
        .map_err(api_error)?;
    if is_set {
        frame.collect().await.map_err(api_error)?;
        return Ok(Response::Execution(Tag::new("SET")));
    }
    Ok(Response::Query(
        encode_dataframe(frame, &Format::UnifiedText, None).await?,
    ))
}

async fn plan_setting(
    context: &SessionContext,
    statement: &Statement,
) -> PgWireResult<LogicalPlan> {
    if let Some(name) = sieve_setting_shown(statement) {
        return Ok(show_sieve_setting(context, &name)
            .map_err(api_error)?
            .into_unoptimized_plan());
    }
    context
        .state()
        .create_logical_plan(&statement.to_string())
        .await
        .map_err(api_error)
}

/// The answer to `SHOW sieve.x`: its value now.
async fn answer_show(context: &SessionContext, name: &str) -> PgWireResult<Response> {
    let frame = show_sieve_setting(context, name).map_err(api_error)?;
    Ok(Response::Query(
        encode_dataframe(frame, &Format::UnifiedText, None).await?,
    ))
}

#[async_trait]
impl QueryHook for NamespacedSettings {
    async fn handle_simple_query(
        &self,
        statement: &Statement,
        context: &SessionContext,
        _client: &mut dyn HookClient,
    ) -> Option<PgWireResult<Response>> {
        if !namespaced(statement) {
            return None;
        }
        if let Some(name) = sieve_setting_shown(statement) {
            return Some(answer_show(context, &name).await);
        }
        Some(match plan_setting(context, statement).await {
            Ok(plan) => run_setting(context, plan).await,
            Err(error) => Err(error),
        })
    }

    async fn handle_extended_parse_query(
        &self,
        statement: &Statement,
        context: &SessionContext,
        _client: &(dyn ClientInfo + Send + Sync),
    ) -> Option<PgWireResult<LogicalPlan>> {
        if !namespaced(statement) {
            return None;
        }
        Some(plan_setting(context, statement).await)
    }

    async fn handle_extended_query(
        &self,
        statement: &Statement,
        plan: &LogicalPlan,
        _params: &ParamValues,
        context: &SessionContext,
        _client: &mut dyn HookClient,
    ) -> Option<PgWireResult<Response>> {
        if !namespaced(statement) {
            return None;
        }
        // A SHOW answers with the value now, not the one at parse time.
        if let Some(name) = sieve_setting_shown(statement) {
            return Some(answer_show(context, &name).await);
        }
        Some(run_setting(context, plan.clone()).await)
    }
}
