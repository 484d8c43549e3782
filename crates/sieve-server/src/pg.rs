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
use datafusion::sql::sqlparser::ast::{Set, Statement};
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
use datafusion_postgres::pgwire::api::portal::Format;
use datafusion_postgres::pgwire::api::query::{ExtendedQueryHandler, SimpleQueryHandler};
use datafusion_postgres::pgwire::api::results::{Response, Tag};
use datafusion_postgres::pgwire::api::{
    ClientInfo, ConnectionManager, ErrorHandler, PgWireServerHandlers,
};
use datafusion_postgres::pgwire::error::{ErrorInfo, PgWireError, PgWireResult};
use datafusion_postgres::pgwire::messages::{PgWireBackendMessage, PgWireFrontendMessage};
use datafusion_postgres::pgwire::tokio::process_socket;
use datafusion_postgres::{DfSessionService, QueryHook};
use futures::Sink;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;

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
}

impl Connection {
    fn open(
        factory: &SessionFactory,
        options: &PgServerOptions,
        manager: &Arc<ConnectionManager>,
        refused: Option<String>,
    ) -> Result<Self> {
        let context = Arc::new(factory()?);
        setup_pg_catalog(&context, CATALOG, EmptyContextProvider).map_err(|error| *error)?;
        let hooks: Vec<Arc<dyn QueryHook>> = vec![
            Arc::new(NamespacedSettings),
            Arc::new(CursorStatementHook),
            Arc::new(SetShowHook),
            Arc::new(TransactionStatementHook),
            Arc::new(SieveStatements),
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

    fn cancel_handler(&self) -> Arc<impl datafusion_postgres::pgwire::api::cancel::CancelHandler> {
        Arc::clone(&self.cancel)
    }
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
struct SieveStatements;

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
        let tag = sieve_statement_tag(statement)?;
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
        Some(Ok(LogicalPlan::EmptyRelation(
            datafusion::logical_expr::EmptyRelation {
                produce_one_row: false,
                schema: Arc::new(datafusion::common::DFSchema::empty()),
            },
        )))
    }

    async fn handle_extended_query(
        &self,
        statement: &Statement,
        _plan: &LogicalPlan,
        _params: &ParamValues,
        context: &SessionContext,
        _client: &mut dyn HookClient,
    ) -> Option<PgWireResult<Response>> {
        let tag = sieve_statement_tag(statement)?;
        Some(run_sieve_statement(context, statement, tag).await)
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
        Statement::ShowVariable { variable } => variable.len() > 1,
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
