//! Arrow Flight SQL: arrow-flight's `FlightSqlService` over Sieve sessions.
//!
//! ```text
//!   Handshake (Basic user:password) ─ check (auth.rs) ─ new session
//!     └─ bearer token in the `authorization` response header; every later
//!        call names its session by that token
//!   GetFlightInfo(statement)  ─ plan in the session (SET runs here) ─ ticket
//!   DoGet(ticket)             ─ execute, stream Arrow IPC; a client gone
//!                               drops the stream, and with it the query
//!   CreatePreparedStatement ─ DoPut(parameters) ─ GetFlightInfo ─ DoGet
//!   GetCatalogs, GetDbSchemas, GetTables, GetTableTypes, GetSqlInfo
//! ```
//!
//! A session lives until the client closes it (`CloseSession`) or it has
//! been idle for [`SESSION_IDLE_MAX`]; at most `sessions_max` at once.
//! Errors come back as gRPC statuses whose message carries the SQLSTATE of
//! the PostgreSQL port (`errors.rs`).

use std::collections::{BTreeMap, HashMap};
use std::fmt::Debug;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_server::{FlightService, FlightServiceServer};
use arrow_flight::sql::metadata::{SqlInfoData, SqlInfoDataBuilder};
use arrow_flight::sql::server::{FlightSqlService, PeekableFlightDataStream};
use arrow_flight::sql::{
    ActionClosePreparedStatementRequest, ActionCreatePreparedStatementRequest,
    ActionCreatePreparedStatementResult, CommandGetCatalogs, CommandGetDbSchemas,
    CommandGetSqlInfo, CommandGetTableTypes, CommandGetTables, CommandPreparedStatementQuery,
    CommandPreparedStatementUpdate, CommandStatementIngest, CommandStatementQuery,
    CommandStatementUpdate, DoPutPreparedStatementResult, ProstMessageExt, SqlInfo,
    SqlNullOrdering, SqlSupportedCaseSensitivity, SqlSupportedTransaction, TicketStatementQuery,
};
use arrow_flight::{
    Action, FlightDescriptor, FlightEndpoint, FlightInfo, HandshakeRequest, HandshakeResponse,
    IpcMessage, SchemaAsIpc, Ticket,
};
use base64::Engine;
use datafusion::arrow::array::{ArrayRef, RecordBatch};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::arrow::ipc::writer::IpcWriteOptions;
use datafusion::common::{DataFusionError, ScalarValue};
use datafusion::dataframe::DataFrame;
use datafusion::datasource::TableType;
use datafusion::logical_expr::LogicalPlan;
use datafusion::prelude::SessionContext;
use datafusion::sql::parser::Statement as DfStatement;
use futures::{Stream, StreamExt, TryStreamExt};
use prost::Message;
use tokio::net::TcpListener;
use tonic::metadata::MetadataValue;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};

use crate::changed_rows;
use crate::errors::sqlstate;
use crate::pg::SessionFactory;
use crate::settings::{show_sieve_setting, sieve_setting_shown};
use crate::Users;

/// A session unused this long is closed when room is needed for a new one.
pub const SESSION_IDLE_MAX: Duration = Duration::from_secs(3600);

/// Statements a session keeps at once: planned but not yet fetched, and
/// prepared; past the bound the oldest planned one is dropped, and a new
/// prepared statement is refused.
pub const STATEMENTS_MAX: usize = 256;

/// Bytes of a session token (random, hex in the header).
const TOKEN_BYTES: usize = 24;

/// The largest request message the server decodes (a DoPut of parameters,
/// a statement's text).
pub const REQUEST_BYTES_MAX: usize = 16 << 20;

/// Rows of parameters one DoPut may bind to a prepared statement other
/// than `INSERT ... VALUES` (each row runs the statement once, a commit
/// each); an INSERT takes any number, as one load.
pub const PARAMETER_ROWS_EACH_MAX: usize = 10_000;

/// Bytes of parameters one DoPut to a prepared update may bind in all (a
/// many-row `executemany`); past it, load with bulk ingest.
pub const PARAMETER_BYTES_MAX: usize = 256 << 20;

/// How the Flight SQL port is served.
#[derive(Clone)]
pub struct FlightSqlOptions {
    /// Who may log in (Basic authentication on the handshake).
    pub users: Arc<Users>,
    /// Certificate chain and key (PEM): with them, only TLS is served.
    pub tls: Option<(Vec<u8>, Vec<u8>)>,
    /// Sessions open at once; a handshake past the bound is refused.
    pub sessions_max: usize,
}

impl Debug for FlightSqlOptions {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("FlightSqlOptions")
            .field("users", &self.users)
            .field("tls", &self.tls.is_some())
            .field("sessions_max", &self.sessions_max)
            .finish()
    }
}

/// Serve Flight SQL on `listener` until `shutdown` resolves.
pub async fn serve_flight_sql(
    listener: TcpListener,
    factory: SessionFactory,
    options: FlightSqlOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let service = SieveFlightSql::new(factory, &options);
    let mut builder = Server::builder();
    if let Some((cert, key)) = &options.tls {
        builder =
            builder.tls_config(ServerTlsConfig::new().identity(Identity::from_pem(cert, key)))?;
    }
    builder
        .add_service(
            FlightServiceServer::new(service)
                .max_decoding_message_size(REQUEST_BYTES_MAX)
                .max_encoding_message_size(usize::MAX),
        )
        .serve_with_incoming_shutdown(
            TcpIncoming::from(listener).with_nodelay(Some(true)),
            shutdown,
        )
        .await
}

/// One client's session and the statements it has planned or prepared.
struct ClientSession {
    context: SessionContext,
    statements: Mutex<Statements>,
    last_used: Mutex<Instant>,
}

#[derive(Default)]
struct Statements {
    next: u64,
    /// Planned by GetFlightInfo, fetched (and dropped) by DoGet.
    planned: BTreeMap<u64, DataFrame>,
    prepared: BTreeMap<u64, Prepared>,
}

/// A prepared statement: its plan with placeholders, the types DataFusion
/// inferred for them, and the values bound last.
struct Prepared {
    sql: String,
    plan: LogicalPlan,
    parameters: Vec<(String, Option<DataType>)>,
    values: Option<Vec<ScalarValue>>,
}

/// The Flight SQL service: sessions by token, shared SQL info.
pub struct SieveFlightSql {
    factory: SessionFactory,
    users: Arc<Users>,
    sessions: Mutex<HashMap<String, Arc<ClientSession>>>,
    sessions_max: usize,
    sql_info: SqlInfoData,
}

impl Debug for SieveFlightSql {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("SieveFlightSql")
            .field("sessions_max", &self.sessions_max)
            .finish_non_exhaustive()
    }
}

type ResponseStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// A DataFusion error as a gRPC status: the kind chosen from its SQLSTATE,
/// which the message carries too.
fn status(error: DataFusionError) -> Status {
    let code = sqlstate(&error);
    let message = format!("{} (SQLSTATE {code})", error.strip_backtrace());
    match &code[..2] {
        "42" | "22" => Status::invalid_argument(message),
        "0A" => Status::unimplemented(message),
        "53" => Status::resource_exhausted(message),
        "57" => Status::cancelled(message),
        "58" => Status::unavailable(message),
        _ => Status::internal(message),
    }
}

fn arrow_status(error: datafusion::arrow::error::ArrowError) -> Status {
    status(error.into())
}

fn flight_status(error: FlightError) -> Status {
    match error {
        FlightError::Arrow(error) => arrow_status(error),
        FlightError::Tonic(status) => *status,
        other => Status::internal(other.to_string()),
    }
}

fn sql_info() -> SqlInfoData {
    let mut builder = SqlInfoDataBuilder::new();
    builder.append(SqlInfo::FlightSqlServerName, "Sieve");
    builder.append(SqlInfo::FlightSqlServerVersion, env!("CARGO_PKG_VERSION"));
    builder.append(SqlInfo::FlightSqlServerArrowVersion, "1.3");
    builder.append(SqlInfo::FlightSqlServerReadOnly, false);
    builder.append(SqlInfo::FlightSqlServerSql, true);
    builder.append(SqlInfo::FlightSqlServerSubstrait, false);
    builder.append(
        SqlInfo::FlightSqlServerTransaction,
        SqlSupportedTransaction::None as i32,
    );
    builder.append(SqlInfo::FlightSqlServerCancel, false);
    builder.append(SqlInfo::FlightSqlServerBulkIngestion, true);
    builder.append(SqlInfo::SqlDdlCatalog, false);
    builder.append(SqlInfo::SqlDdlSchema, false);
    builder.append(SqlInfo::SqlDdlTable, true);
    builder.append(
        SqlInfo::SqlIdentifierCase,
        SqlSupportedCaseSensitivity::SqlCaseSensitivityLowercase as i32,
    );
    builder.append(SqlInfo::SqlIdentifierQuoteChar, "\"");
    builder.append(
        SqlInfo::SqlQuotedIdentifierCase,
        SqlSupportedCaseSensitivity::SqlCaseSensitivityCaseInsensitive as i32,
    );
    builder.append(SqlInfo::SqlAllTablesAreSelectable, true);
    builder.append(
        SqlInfo::SqlNullOrdering,
        SqlNullOrdering::SqlNullsSortedHigh as i32,
    );
    builder.build().expect("Sieve's SQL info is well formed")
}

impl SieveFlightSql {
    /// The service over sessions made by `factory`.
    pub fn new(factory: SessionFactory, options: &FlightSqlOptions) -> Self {
        Self {
            factory,
            users: Arc::clone(&options.users),
            sessions: Mutex::new(HashMap::new()),
            sessions_max: options.sessions_max.max(1),
            sql_info: sql_info(),
        }
    }

    /// Sessions open now.
    pub fn sessions(&self) -> usize {
        self.sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// The session the request's bearer token names.
    #[allow(clippy::result_large_err)]
    fn session<T>(&self, request: &Request<T>) -> Result<Arc<ClientSession>, Status> {
        let header = request
            .metadata()
            .get("authorization")
            .ok_or_else(|| {
                Status::unauthenticated(
                    "no authorization header: log in with a handshake (Basic user:password) first",
                )
            })?
            .to_str()
            .map_err(|_| Status::unauthenticated("the authorization header is not text"))?;
        let token = header
            .strip_prefix("Bearer ")
            .ok_or_else(|| Status::unauthenticated("expected a Bearer token from the handshake"))?;
        let sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        let session = sessions
            .get(token)
            .cloned()
            .ok_or_else(|| Status::unauthenticated("unknown or expired session: log in again"))?;
        *session.last_used.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        Ok(session)
    }

    /// Check `user:password` from a Basic header; on success a new session
    /// and its token.
    #[allow(clippy::result_large_err)]
    fn log_in(&self, header: &str) -> Result<String, Status> {
        let encoded = header
            .strip_prefix("Basic ")
            .ok_or_else(|| Status::unauthenticated("expected Basic authentication"))?;
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(encoded.trim())
            .or_else(|_| base64::engine::general_purpose::STANDARD_NO_PAD.decode(encoded.trim()))
            .map_err(|_| Status::unauthenticated("the Basic credentials are not base64"))?;
        let text = String::from_utf8(decoded)
            .map_err(|_| Status::unauthenticated("the Basic credentials are not UTF-8"))?;
        let (user, password) = text
            .split_once(':')
            .ok_or_else(|| Status::unauthenticated("the Basic credentials lack a ':'"))?;
        if !self.users.check(user, password) {
            return Err(Status::unauthenticated(
                "password authentication failed for user (or no such user)",
            ));
        }
        let context = (self.factory)().map_err(status)?;
        let token = Users::random_password(TOKEN_BYTES).map_err(status)?;
        let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        if sessions.len() >= self.sessions_max {
            sessions.retain(|_, session| {
                session
                    .last_used
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .elapsed()
                    < SESSION_IDLE_MAX
            });
        }
        if sessions.len() >= self.sessions_max {
            return Err(Status::resource_exhausted(format!(
                "too many sessions: this server keeps at most {} at once \
                 (sieve serve --connections-max); close one (CloseSession) or wait",
                self.sessions_max
            )));
        }
        sessions.insert(
            token.clone(),
            Arc::new(ClientSession {
                context,
                statements: Mutex::new(Statements::default()),
                last_used: Mutex::new(Instant::now()),
            }),
        );
        Ok(token)
    }
}

impl ClientSession {
    fn statements(&self) -> std::sync::MutexGuard<'_, Statements> {
        self.statements.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The `sieve.*` setting `sql` shows, if it is such a SHOW.
    fn sieve_setting_shown(&self, sql: &str) -> Result<Option<String>, DataFusionError> {
        let state = self.context.state();
        let dialect = state.config().options().sql_parser.dialect;
        Ok(match state.sql_to_statement(sql, &dialect)? {
            DfStatement::Statement(statement) => sieve_setting_shown(&statement),
            _ => None,
        })
    }

    /// Plan `sql` (a SET runs now, as in `SessionContext::sql`).
    async fn plan(&self, sql: &str) -> Result<DataFrame, DataFusionError> {
        // A statement DataFusion cannot parse (`COPY t FROM`) may still be
        // Sieve's; a real syntax error is reported by `run_sql`.
        if let Ok(Some(name)) = self.sieve_setting_shown(sql) {
            return show_sieve_setting(&self.context, &name);
        }
        sieve_compute::tables::statements::run_sql(&self.context, sql).await
    }

    /// Plan `sql` without running anything (a prepared statement's plan).
    async fn logical_plan(&self, sql: &str) -> Result<LogicalPlan, DataFusionError> {
        if let Some(name) = self.sieve_setting_shown(sql)? {
            return Ok(show_sieve_setting(&self.context, &name)?.into_unoptimized_plan());
        }
        self.context.state().create_logical_plan(sql).await
    }

    /// Keep a planned statement until DoGet fetches it; its handle.
    fn keep(&self, frame: DataFrame) -> u64 {
        let mut statements = self.statements();
        statements.next += 1;
        let handle = statements.next;
        if statements.planned.len() >= STATEMENTS_MAX {
            statements.planned.pop_first();
        }
        statements.planned.insert(handle, frame);
        handle
    }
}

fn handle_bytes(handle: u64) -> Vec<u8> {
    handle.to_le_bytes().to_vec()
}

#[allow(clippy::result_large_err)]
fn handle_of(bytes: &[u8]) -> Result<u64, Status> {
    let bytes: [u8; 8] = bytes
        .try_into()
        .map_err(|_| Status::invalid_argument("not a statement handle of this server"))?;
    Ok(u64::from_le_bytes(bytes))
}

/// A FlightInfo of one endpoint, fetched with `ticket`.
#[allow(clippy::result_large_err)]
fn flight_info(
    schema: &Schema,
    ticket: Vec<u8>,
    descriptor: FlightDescriptor,
) -> Result<Response<FlightInfo>, Status> {
    let info = FlightInfo::new()
        .try_with_schema(schema)
        .map_err(arrow_status)?
        .with_endpoint(FlightEndpoint::new().with_ticket(Ticket::new(ticket)))
        .with_descriptor(descriptor);
    Ok(Response::new(info))
}

/// Batches as a DoGet stream.
fn batches(
    schema: SchemaRef,
    stream: impl Stream<Item = Result<RecordBatch, DataFusionError>> + Send + 'static,
) -> Response<ResponseStream<arrow_flight::FlightData>> {
    let stream = FlightDataEncoderBuilder::new()
        .with_schema(schema)
        .build(stream.map_err(|error| FlightError::Tonic(Box::new(status(error)))))
        .map_err(flight_status);
    Response::new(Box::pin(stream))
}

/// A metadata answer (one batch) as a DoGet stream.
#[allow(clippy::result_large_err)]
fn one_batch(
    batch: Result<RecordBatch, FlightError>,
) -> Result<Response<ResponseStream<arrow_flight::FlightData>>, Status> {
    let batch = batch.map_err(flight_status)?;
    let schema = batch.schema();
    Ok(batches(schema, futures::stream::once(async { Ok(batch) })))
}

/// A statement's result as a DoGet stream.
async fn execute(
    frame: DataFrame,
) -> Result<Response<ResponseStream<arrow_flight::FlightData>>, Status> {
    let schema: SchemaRef = Arc::new(frame.schema().as_arrow().clone());
    let stream = frame.execute_stream().await.map_err(status)?;
    Ok(batches(schema, stream))
}

/// The values of a one-row parameter batch, cast to the types DataFusion
/// inferred for the placeholders where it inferred one.
#[allow(clippy::result_large_err)]
fn parameter_values(
    batch: &RecordBatch,
    parameters: &[(String, Option<DataType>)],
) -> Result<Vec<ScalarValue>, Status> {
    if batch.num_rows() != 1 {
        return Err(Status::invalid_argument(format!(
            "bind one row of parameters at a time (got {} rows)",
            batch.num_rows()
        )));
    }
    if batch.num_columns() != parameters.len() {
        return Err(Status::invalid_argument(format!(
            "the statement has {} parameters, {} were bound",
            parameters.len(),
            batch.num_columns()
        )));
    }
    batch
        .columns()
        .iter()
        .zip(parameters)
        .map(|(column, (_, expected)): (&ArrayRef, _)| {
            let value = ScalarValue::try_from_array(column, 0).map_err(status)?;
            Ok(match expected {
                Some(expected) if value.data_type() != *expected && !value.is_null() => {
                    value.cast_to(expected).unwrap_or(value)
                }
                _ => value,
            })
        })
        .collect()
}

/// A prepared `INSERT ... VALUES (...)` of one row whose placeholders are
/// all in that row, run for many rows of parameters at once: the row's
/// expressions evaluated over the parameters as a table, so the rows
/// arrive in one load (one commit, slices of many rows) instead of one
/// statement a row. `None` for any other statement.
fn insert_of_rows(
    plan: &LogicalPlan,
    parameters: &[(String, Option<DataType>)],
    bound: &[RecordBatch],
) -> Result<Option<LogicalPlan>, DataFusionError> {
    use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
    use datafusion::common::Column;
    use datafusion::logical_expr::{cast, Expr, LogicalPlanBuilder};
    let LogicalPlan::Dml(dml) = plan else {
        return Ok(None);
    };
    if !matches!(dml.op, datafusion::logical_expr::WriteOp::Insert(_)) {
        return Ok(None);
    }
    // Exactly one VALUES of one row, holding every placeholder.
    let mut values_nodes = 0;
    let mut one_row = true;
    let mut placeholders_outside = false;
    dml.input.apply(|node| {
        if let LogicalPlan::Values(values) = node {
            values_nodes += 1;
            one_row &= values.values.len() == 1;
            return Ok(TreeNodeRecursion::Jump);
        }
        node.apply_expressions(|expr| {
            expr.apply(|expr| {
                if matches!(expr, Expr::Placeholder(_)) {
                    placeholders_outside = true;
                }
                Ok(TreeNodeRecursion::Continue)
            })
        })?;
        Ok(TreeNodeRecursion::Continue)
    })?;
    if values_nodes != 1 || !one_row || placeholders_outside {
        return Ok(None);
    }
    if bound
        .iter()
        .any(|batch| batch.num_columns() != parameters.len())
    {
        return Err(DataFusionError::Plan(format!(
            "the statement has {} parameters; a bound batch has other columns",
            parameters.len()
        )));
    }
    // The parameters as a table: a column `$n` each, of the type inferred.
    let fields: Vec<Field> = parameters
        .iter()
        .enumerate()
        .map(|(index, (name, kind))| {
            Field::new(
                name,
                kind.clone()
                    .unwrap_or_else(|| bound[0].column(index).data_type().clone()),
                true,
            )
        })
        .collect();
    let schema = Arc::new(Schema::new(fields));
    let mut batches = Vec::with_capacity(bound.len());
    for batch in bound {
        if batch.num_columns() != parameters.len() {
            return Err(DataFusionError::Plan(format!(
                "the statement has {} parameters, {} were bound",
                parameters.len(),
                batch.num_columns()
            )));
        }
        let columns = batch
            .columns()
            .iter()
            .zip(schema.fields())
            .map(|(column, field)| {
                if column.data_type() == field.data_type() {
                    Ok(Arc::clone(column))
                } else {
                    Ok(datafusion::arrow::compute::cast(column, field.data_type())?)
                }
            })
            .collect::<Result<Vec<ArrayRef>, DataFusionError>>()?;
        batches.push(RecordBatch::try_new(Arc::clone(&schema), columns)?);
    }
    let table = datafusion::datasource::MemTable::try_new(Arc::clone(&schema), vec![batches])?;
    let source = datafusion::datasource::provider_as_source(Arc::new(table));
    let rows = LogicalPlanBuilder::scan("sieve_parameters", source, None)?.build()?;
    let input = dml.input.as_ref().clone().transform_up(|node| {
        let LogicalPlan::Values(values) = &node else {
            return Ok(Transformed::no(node));
        };
        let row = values.values[0]
            .iter()
            .zip(values.schema.fields())
            .map(|(expr, field)| {
                let expr = expr
                    .clone()
                    .transform(|expr| {
                        Ok(match expr {
                            Expr::Placeholder(placeholder) => Transformed::yes(Expr::Column(
                                Column::new_unqualified(placeholder.id),
                            )),
                            other => Transformed::no(other),
                        })
                    })?
                    .data;
                Ok(cast(expr, field.data_type().clone()).alias(field.name()))
            })
            .collect::<Result<Vec<_>, DataFusionError>>()?;
        let projected = LogicalPlanBuilder::from(rows.clone())
            .project(row)?
            .build()?;
        Ok(Transformed::yes(projected))
    })?;
    let mut dml = dml.clone();
    dml.input = Arc::new(input.data);
    Ok(Some(LogicalPlan::Dml(dml)))
}

/// The placeholders of `plan` in order (`$1`, `$2`, ...) with their types.
fn placeholders(plan: &LogicalPlan) -> Result<Vec<(String, Option<DataType>)>, DataFusionError> {
    let mut parameters: Vec<(String, Option<DataType>)> =
        plan.get_parameter_types()?.into_iter().collect();
    parameters.sort_by_key(|(name, _)| {
        name.trim_start_matches('$')
            .parse::<usize>()
            .unwrap_or(usize::MAX)
    });
    Ok(parameters)
}

fn table_type(kind: TableType) -> &'static str {
    match kind {
        TableType::Base => "TABLE",
        TableType::View => "VIEW",
        TableType::Temporary => "LOCAL TEMPORARY",
    }
}

#[tonic::async_trait]
impl FlightSqlService for SieveFlightSql {
    type FlightService = SieveFlightSql;

    async fn do_handshake(
        &self,
        request: Request<Streaming<HandshakeRequest>>,
    ) -> Result<Response<ResponseStream<HandshakeResponse>>, Status> {
        let header = request
            .metadata()
            .get("authorization")
            .ok_or_else(|| {
                Status::unauthenticated("log in with Basic authentication (user and password)")
            })?
            .to_str()
            .map_err(|_| Status::unauthenticated("the authorization header is not text"))?
            .to_string();
        let token = self.log_in(&header)?;
        let reply = HandshakeResponse {
            protocol_version: 0,
            payload: token.clone().into(),
        };
        let mut response: Response<ResponseStream<HandshakeResponse>> =
            Response::new(Box::pin(futures::stream::once(async { Ok(reply) })));
        let bearer = MetadataValue::try_from(format!("Bearer {token}"))
            .map_err(|_| Status::internal("a session token is not a header value"))?;
        response.metadata_mut().insert("authorization", bearer);
        Ok(response)
    }

    async fn get_flight_info_statement(
        &self,
        query: CommandStatementQuery,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let session = self.session(&request)?;
        let frame = session.plan(&query.query).await.map_err(status)?;
        let schema = frame.schema().as_arrow().clone();
        let handle = session.keep(frame);
        let ticket = TicketStatementQuery {
            statement_handle: handle_bytes(handle).into(),
        };
        flight_info(
            &schema,
            ticket.as_any().encode_to_vec(),
            request.into_inner(),
        )
    }

    async fn do_get_statement(
        &self,
        ticket: TicketStatementQuery,
        request: Request<arrow_flight::Ticket>,
    ) -> Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        let session = self.session(&request)?;
        let handle = handle_of(&ticket.statement_handle)?;
        let frame = session
            .statements()
            .planned
            .remove(&handle)
            .ok_or_else(|| {
                Status::not_found("no such statement: a ticket is good for one DoGet")
            })?;
        execute(frame).await
    }

    async fn do_put_statement_update(
        &self,
        command: CommandStatementUpdate,
        request: Request<PeekableFlightDataStream>,
    ) -> Result<i64, Status> {
        let session = self.session(&request)?;
        let frame = session.plan(&command.query).await.map_err(status)?;
        let batches = frame.collect().await.map_err(status)?;
        Ok(changed_rows(&batches) as i64)
    }

    async fn do_put_statement_ingest(
        &self,
        command: CommandStatementIngest,
        request: Request<PeekableFlightDataStream>,
    ) -> Result<i64, Status> {
        use arrow_flight::sql::{TableExistsOption, TableNotExistOption};
        use sieve_compute::tables::ingest::{ingest, IfMissing, IfPresent};
        let session = self.session(&request)?;
        if command.temporary {
            return Err(Status::invalid_argument(
                "temporary tables are not supported: load into a table",
            ));
        }
        if command.transaction_id.is_some() {
            return Err(Status::invalid_argument(
                "Sieve has no transactions: load without one (each load is one commit)",
            ));
        }
        if let Some(schema) = command.schema.as_deref() {
            if schema != "public" {
                return Err(Status::invalid_argument(format!(
                    "tables are loaded in schema 'public', not '{schema}'"
                )));
            }
        }
        if let Some(option) = command.options.keys().next() {
            return Err(Status::invalid_argument(format!(
                "unknown load option '{option}'"
            )));
        }
        let options = command.table_definition_options.unwrap_or_default();
        let if_missing = match TableNotExistOption::try_from(options.if_not_exist) {
            Ok(TableNotExistOption::Create) => IfMissing::Create,
            Ok(TableNotExistOption::Fail) => IfMissing::Fail,
            _ => {
                return Err(Status::invalid_argument(
                    "say what to do when the table does not exist (create or fail)",
                ))
            }
        };
        let if_present = match TableExistsOption::try_from(options.if_exists) {
            Ok(TableExistsOption::Append) => IfPresent::Append,
            Ok(TableExistsOption::Replace) => IfPresent::Replace,
            Ok(TableExistsOption::Fail) => IfPresent::Fail,
            _ => {
                return Err(Status::invalid_argument(
                    "say what to do when the table exists (append, replace or fail)",
                ))
            }
        };
        let mut stream = arrow_flight::decode::FlightRecordBatchStream::new_from_flight_data(
            request.into_inner().map_err(FlightError::from),
        );
        let first = stream
            .try_next()
            .await
            .map_err(|error| Status::invalid_argument(format!("the batches: {error}")))?;
        let Some(schema) = stream
            .schema()
            .cloned()
            .or_else(|| first.as_ref().map(RecordBatch::schema))
        else {
            return Err(Status::invalid_argument("the load sent no schema"));
        };
        let rest = futures::stream::iter(first.map(Ok)).chain(stream.map_err(|error| {
            DataFusionError::Execution(format!("the batches the client sent: {error}"))
        }));
        let batches = Box::pin(
            datafusion::physical_plan::stream::RecordBatchStreamAdapter::new(schema, rest),
        );
        let rows = ingest(
            &session.context,
            &command.table,
            if_missing,
            if_present,
            batches,
        )
        .await
        .map_err(status)?;
        Ok(rows as i64)
    }

    async fn do_put_prepared_statement_update(
        &self,
        query: CommandPreparedStatementUpdate,
        request: Request<PeekableFlightDataStream>,
    ) -> Result<i64, Status> {
        let session = self.session(&request)?;
        let handle = handle_of(&query.prepared_statement_handle)?;
        let (plan, parameters) = session
            .statements()
            .prepared
            .get(&handle)
            .map(|prepared| (prepared.plan.clone(), prepared.parameters.clone()))
            .ok_or_else(|| Status::not_found("no such prepared statement"))?;
        if parameters.is_empty() {
            let frame = prepared_frame(&session, handle).await?;
            return Ok(changed_rows(&frame.collect().await.map_err(status)?) as i64);
        }
        let stream = arrow_flight::decode::FlightRecordBatchStream::new_from_flight_data(
            request.into_inner().map_err(FlightError::from),
        );
        let mut stream = stream;
        let mut bound: Vec<RecordBatch> = Vec::new();
        let mut bytes = 0;
        while let Some(batch) = stream
            .try_next()
            .await
            .map_err(|error| Status::invalid_argument(format!("parameters: {error}")))?
        {
            bytes += batch.get_array_memory_size();
            if bytes > PARAMETER_BYTES_MAX {
                return Err(Status::resource_exhausted(format!(
                    "parameters past {PARAMETER_BYTES_MAX} bytes (PARAMETER_BYTES_MAX) in one call: load many rows with bulk ingest (adbc_ingest)"
                )));
            }
            if batch.num_columns() != parameters.len() {
                return Err(Status::invalid_argument(format!(
                    "the statement has {} parameters, {} were bound",
                    parameters.len(),
                    batch.num_columns()
                )));
            }
            if batch.num_rows() > 0 {
                bound.push(batch);
            }
        }
        if bound.is_empty() {
            return Ok(0);
        }
        if let Some(plan) = insert_of_rows(&plan, &parameters, &bound).map_err(status)? {
            let frame = session
                .context
                .execute_logical_plan(plan)
                .await
                .map_err(status)?;
            return Ok(changed_rows(&frame.collect().await.map_err(status)?) as i64);
        }
        let rows: usize = bound.iter().map(RecordBatch::num_rows).sum();
        if rows > PARAMETER_ROWS_EACH_MAX {
            return Err(Status::invalid_argument(format!(
                "{rows} rows of parameters: a statement other than INSERT ... VALUES runs once a row, at most {PARAMETER_ROWS_EACH_MAX} times a call"
            )));
        }
        let mut changed = 0;
        for batch in &bound {
            for row in 0..batch.num_rows() {
                let values = parameter_values(&batch.slice(row, 1), &parameters)?;
                let plan = plan.clone().with_param_values(values).map_err(status)?;
                let frame = session
                    .context
                    .execute_logical_plan(plan)
                    .await
                    .map_err(status)?;
                changed += changed_rows(&frame.collect().await.map_err(status)?);
            }
        }
        Ok(changed as i64)
    }

    async fn do_action_create_prepared_statement(
        &self,
        query: ActionCreatePreparedStatementRequest,
        request: Request<Action>,
    ) -> Result<ActionCreatePreparedStatementResult, Status> {
        let session = self.session(&request)?;
        let plan = session.logical_plan(&query.query).await.map_err(status)?;
        let parameters = placeholders(&plan).map_err(status)?;
        let options = IpcWriteOptions::default();
        let dataset: IpcMessage = SchemaAsIpc::new(plan.schema().as_arrow(), &options)
            .try_into()
            .map_err(arrow_status)?;
        let parameter_schema = Schema::new(
            parameters
                .iter()
                .map(|(name, kind)| Field::new(name, kind.clone().unwrap_or(DataType::Null), true))
                .collect::<Vec<_>>(),
        );
        let parameter_message: IpcMessage = SchemaAsIpc::new(&parameter_schema, &options)
            .try_into()
            .map_err(arrow_status)?;
        let mut statements = session.statements();
        if statements.prepared.len() >= STATEMENTS_MAX {
            return Err(Status::resource_exhausted(format!(
                "a session keeps at most {STATEMENTS_MAX} prepared statements: close some"
            )));
        }
        statements.next += 1;
        let handle = statements.next;
        statements.prepared.insert(
            handle,
            Prepared {
                sql: query.query,
                plan,
                parameters,
                values: None,
            },
        );
        Ok(ActionCreatePreparedStatementResult {
            prepared_statement_handle: handle_bytes(handle).into(),
            dataset_schema: dataset.0,
            parameter_schema: parameter_message.0,
        })
    }

    async fn do_action_close_prepared_statement(
        &self,
        query: ActionClosePreparedStatementRequest,
        request: Request<Action>,
    ) -> Result<(), Status> {
        let session = self.session(&request)?;
        let handle = handle_of(&query.prepared_statement_handle)?;
        session.statements().prepared.remove(&handle);
        Ok(())
    }

    async fn do_put_prepared_statement_query(
        &self,
        query: CommandPreparedStatementQuery,
        request: Request<PeekableFlightDataStream>,
    ) -> Result<DoPutPreparedStatementResult, Status> {
        let session = self.session(&request)?;
        let handle = handle_of(&query.prepared_statement_handle)?;
        let parameters = session
            .statements()
            .prepared
            .get(&handle)
            .map(|prepared| prepared.parameters.clone())
            .ok_or_else(|| Status::not_found("no such prepared statement"))?;
        let stream = arrow_flight::decode::FlightRecordBatchStream::new_from_flight_data(
            request.into_inner().map_err(FlightError::from),
        );
        let bound: Vec<RecordBatch> = stream
            .try_collect()
            .await
            .map_err(|error| Status::invalid_argument(format!("parameters: {error}")))?;
        let values = match bound.iter().filter(|batch| batch.num_rows() > 0).count() {
            0 if parameters.is_empty() => vec![],
            1 => parameter_values(
                bound
                    .iter()
                    .find(|batch| batch.num_rows() > 0)
                    .expect("counted"),
                &parameters,
            )?,
            _ => {
                return Err(Status::invalid_argument(
                    "bind exactly one row of parameters",
                ))
            }
        };
        if let Some(prepared) = session.statements().prepared.get_mut(&handle) {
            prepared.values = Some(values);
        }
        Ok(DoPutPreparedStatementResult {
            prepared_statement_handle: Some(query.prepared_statement_handle),
        })
    }

    async fn get_flight_info_prepared_statement(
        &self,
        command: CommandPreparedStatementQuery,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let session = self.session(&request)?;
        let handle = handle_of(&command.prepared_statement_handle)?;
        // Planned now, as a statement is: a SET takes effect though the
        // client never fetches its (empty) result.
        let frame = prepared_frame(&session, handle).await?;
        let schema = frame.schema().as_arrow().clone();
        let ticket = TicketStatementQuery {
            statement_handle: handle_bytes(session.keep(frame)).into(),
        };
        flight_info(
            &schema,
            ticket.as_any().encode_to_vec(),
            request.into_inner(),
        )
    }

    async fn do_get_prepared_statement(
        &self,
        command: CommandPreparedStatementQuery,
        request: Request<arrow_flight::Ticket>,
    ) -> Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        let session = self.session(&request)?;
        let handle = handle_of(&command.prepared_statement_handle)?;
        execute(prepared_frame(&session, handle).await?).await
    }

    async fn get_flight_info_catalogs(
        &self,
        query: CommandGetCatalogs,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        self.session(&request)?;
        let schema = query.into_builder().schema();
        flight_info(
            &schema,
            query.as_any().encode_to_vec(),
            request.into_inner(),
        )
    }

    async fn do_get_catalogs(
        &self,
        query: CommandGetCatalogs,
        request: Request<arrow_flight::Ticket>,
    ) -> Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        let session = self.session(&request)?;
        let mut builder = query.into_builder();
        let mut names = session.context.catalog_names();
        names.sort();
        for name in names {
            builder.append(name);
        }
        one_batch(builder.build())
    }

    async fn get_flight_info_schemas(
        &self,
        query: CommandGetDbSchemas,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        self.session(&request)?;
        let schema = query.clone().into_builder().schema();
        flight_info(
            &schema,
            query.as_any().encode_to_vec(),
            request.into_inner(),
        )
    }

    async fn do_get_schemas(
        &self,
        query: CommandGetDbSchemas,
        request: Request<arrow_flight::Ticket>,
    ) -> Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        let session = self.session(&request)?;
        // The builder applies the catalog and schema-pattern filters.
        let mut builder = query.into_builder();
        for catalog_name in session.context.catalog_names() {
            let Some(catalog) = session.context.catalog(&catalog_name) else {
                continue;
            };
            for schema_name in catalog.schema_names() {
                builder.append(&catalog_name, schema_name);
            }
        }
        one_batch(builder.build())
    }

    async fn get_flight_info_tables(
        &self,
        query: CommandGetTables,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        self.session(&request)?;
        let schema = query.clone().into_builder().schema();
        flight_info(
            &schema,
            query.as_any().encode_to_vec(),
            request.into_inner(),
        )
    }

    async fn do_get_tables(
        &self,
        query: CommandGetTables,
        request: Request<arrow_flight::Ticket>,
    ) -> Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        let session = self.session(&request)?;
        // The builder applies the catalog, schema, table-name and
        // table-type filters, and adds each table's schema when asked.
        let mut builder = query.into_builder();
        for catalog_name in session.context.catalog_names() {
            let Some(catalog) = session.context.catalog(&catalog_name) else {
                continue;
            };
            for schema_name in catalog.schema_names() {
                let Some(schema) = catalog.schema(&schema_name) else {
                    continue;
                };
                let mut tables = schema.table_names();
                tables.sort();
                for table_name in tables {
                    let Some(table) = schema.table(&table_name).await.map_err(status)? else {
                        continue;
                    };
                    builder
                        .append(
                            &catalog_name,
                            &schema_name,
                            &table_name,
                            table_type(table.table_type()),
                            table.schema().as_ref(),
                        )
                        .map_err(flight_status)?;
                }
            }
        }
        one_batch(builder.build())
    }

    async fn get_flight_info_table_types(
        &self,
        query: CommandGetTableTypes,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        self.session(&request)?;
        let schema = query.into_builder().schema();
        flight_info(
            &schema,
            query.as_any().encode_to_vec(),
            request.into_inner(),
        )
    }

    async fn do_get_table_types(
        &self,
        query: CommandGetTableTypes,
        request: Request<arrow_flight::Ticket>,
    ) -> Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        self.session(&request)?;
        let mut builder = query.into_builder();
        for kind in [TableType::Base, TableType::Temporary, TableType::View] {
            builder.append(table_type(kind));
        }
        one_batch(builder.build())
    }

    async fn get_flight_info_sql_info(
        &self,
        query: CommandGetSqlInfo,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        self.session(&request)?;
        let schema = query.clone().into_builder(&self.sql_info).schema();
        flight_info(
            &schema,
            query.as_any().encode_to_vec(),
            request.into_inner(),
        )
    }

    async fn do_get_sql_info(
        &self,
        query: CommandGetSqlInfo,
        request: Request<arrow_flight::Ticket>,
    ) -> Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        self.session(&request)?;
        one_batch(query.into_builder(&self.sql_info).build())
    }

    async fn do_action_fallback(
        &self,
        request: Request<Action>,
    ) -> Result<Response<<Self as FlightService>::DoActionStream>, Status> {
        if request.get_ref().r#type == "CloseSession" {
            self.session(&request)?;
            let header = request
                .metadata()
                .get("authorization")
                .and_then(|value| value.to_str().ok())
                .and_then(|value| value.strip_prefix("Bearer "))
                .map(str::to_string);
            if let Some(token) = header {
                self.sessions
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&token);
            }
            // CloseSessionResult { status: CLOSED (1) }
            let result = arrow_flight::Result {
                body: vec![0x08, 0x01].into(),
            };
            return Ok(Response::new(Box::pin(futures::stream::once(async {
                Ok(result)
            }))));
        }
        Err(Status::unimplemented(format!(
            "action '{}' is not served by Sieve",
            request.get_ref().r#type
        )))
    }

    async fn register_sql_info(&self, _id: i32, _result: &SqlInfo) {}
}

/// A prepared statement, planned with its bound values. Without
/// parameters it is planned from its text now: a SET takes effect, and a
/// SHOW answers with the value now.
async fn prepared_frame(session: &ClientSession, handle: u64) -> Result<DataFrame, Status> {
    let sql = {
        let statements = session.statements();
        let prepared = statements
            .prepared
            .get(&handle)
            .ok_or_else(|| Status::not_found("no such prepared statement"))?;
        prepared.parameters.is_empty().then(|| prepared.sql.clone())
    };
    match sql {
        Some(sql) => session.plan(&sql).await.map_err(status),
        None => {
            let plan = bound_plan(session, handle)?;
            session
                .context
                .execute_logical_plan(plan)
                .await
                .map_err(status)
        }
    }
}

/// The prepared statement's plan with its bound values.
#[allow(clippy::result_large_err)]
fn bound_plan(session: &ClientSession, handle: u64) -> Result<LogicalPlan, Status> {
    let statements = session.statements();
    let prepared = statements
        .prepared
        .get(&handle)
        .ok_or_else(|| Status::not_found("no such prepared statement"))?;
    match (&prepared.values, prepared.parameters.is_empty()) {
        (_, true) => Ok(prepared.plan.clone()),
        (Some(values), false) => prepared
            .plan
            .clone()
            .with_param_values(values.clone())
            .map_err(status),
        (None, false) => Err(Status::invalid_argument(format!(
            "bind the statement's {} parameters first (DoPut)",
            prepared.parameters.len()
        ))),
    }
}
