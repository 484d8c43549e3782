//! `sieve sql`: run statements in a session of the compute node in this
//! process, or of a running `sieve serve` over Arrow Flight SQL
//! (`--connect`), and print their results as a table, CSV or JSON.
//!
//! ```text
//!   -c / -f / stdin / interactive (line editing, history in ~/.sieve_history)
//!     └─ statements split at `;` (not inside quotes or comments)
//!          └─ Backend::Local (SessionContext) | Backend::Remote (Flight SQL)
//!               └─ batches streamed to the output (table: gathered first)
//!                  a spinner after a second on a terminal; Ctrl-C cancels
//!                  the statement; "N rows in T" on stderr
//! ```

use std::fs::File;
use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use arrow_flight::sql::client::FlightSqlServiceClient;
use datafusion::common::{plan_err, DataFusionError, Result};
use datafusion::prelude::SessionContext;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sieve_compute::tables::{LoadReading, OwnedTables};
use sieve_compute::ClusterCatalog;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

/// How results are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// An aligned table.
    Table,
    /// CSV with a header line.
    Csv,
    /// A JSON array of objects, one per row.
    Json,
}

/// Where statements run.
#[allow(clippy::large_enum_variant)]
pub enum Backend {
    /// A session of the compute node in this process.
    Local(SessionContext),
    /// A session of a running `sieve serve`, over Flight SQL.
    Remote(FlightSqlServiceClient<Channel>),
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(match self {
            Backend::Local(_) => "Backend::Local",
            Backend::Remote(_) => "Backend::Remote",
        })
    }
}

/// A Flight SQL error as the server worded it: a gRPC status's message
/// alone (it carries the SQLSTATE), without the layers of wrapping.
fn flight_error(error: impl std::fmt::Display) -> DataFusionError {
    DataFusionError::Execution(server_message(error))
}

/// See [`flight_error`].
fn server_message(error: impl std::fmt::Display) -> String {
    let text = error.to_string();
    let Some((_, quoted)) = text.split_once("message: \"") else {
        return text;
    };
    let mut message = String::new();
    let mut chars = quoted.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => break,
            '\\' => match chars.next() {
                Some('n') => message.push('\n'),
                Some(escaped) => message.push(escaped),
                None => break,
            },
            _ => message.push(c),
        }
    }
    message
}

impl Backend {
    /// Log in to the Flight SQL port at `url` (`grpc://host:port`, or
    /// `grpc+tls://` with the system's roots or `ca`'s certificate).
    pub async fn connect(url: &str, user: &str, password: &str, ca: Option<&Path>) -> Result<Self> {
        let (scheme, address) = url.split_once("://").ok_or_else(|| {
            DataFusionError::Plan(format!(
                "{url}: expected grpc://HOST:PORT or grpc+tls://HOST:PORT"
            ))
        })?;
        let tls = match scheme {
            "grpc" | "grpc+tcp" | "http" => false,
            "grpc+tls" | "https" => true,
            _ => return plan_err!("{url}: the scheme is grpc:// or grpc+tls://"),
        };
        let mut endpoint = Endpoint::from_shared(format!(
            "{}://{address}",
            if tls { "https" } else { "http" }
        ))
        .map_err(flight_error)?
        .connect_timeout(Duration::from_secs(10));
        if tls {
            let mut config = ClientTlsConfig::new();
            if let Some(ca) = ca {
                let pem = std::fs::read(ca).map_err(|error| {
                    DataFusionError::Execution(format!("{}: {error}", ca.display()))
                })?;
                config = config.ca_certificate(Certificate::from_pem(pem));
            }
            let host = address.rsplit_once(':').map_or(address, |(host, _)| host);
            config = config.domain_name(host.trim_matches(['[', ']']));
            endpoint = endpoint.tls_config(config).map_err(flight_error)?;
        }
        let channel = endpoint.connect().await.map_err(|error| {
            DataFusionError::Execution(format!("cannot reach {url}: {error:?}"))
        })?;
        let mut client = FlightSqlServiceClient::new(channel);
        client.handshake(user, password).await.map_err(|error| {
            let DataFusionError::Execution(message) = flight_error(error) else {
                unreachable!("flight_error makes an execution error")
            };
            DataFusionError::Execution(format!("login to {url}: {message}"))
        })?;
        Ok(Backend::Remote(client))
    }

    /// Start `sql`; its schema and its batches as they come.
    async fn start(
        &mut self,
        sql: &str,
    ) -> Result<(SchemaRef, BoxStream<'static, Result<RecordBatch>>)> {
        match self {
            Backend::Local(context) => {
                let frame = sieve_compute::tables::statements::run_sql(context, sql).await?;
                let stream = frame.execute_stream().await?;
                Ok((stream.schema(), stream.boxed()))
            }
            Backend::Remote(client) => {
                let info = client
                    .execute(sql.to_string(), None)
                    .await
                    .map_err(flight_error)?;
                let schema =
                    std::sync::Arc::new(info.clone().try_decode_schema().map_err(flight_error)?);
                let client = client.clone();
                let tickets: Vec<_> = info
                    .endpoint
                    .into_iter()
                    .filter_map(|endpoint| endpoint.ticket)
                    .collect();
                let stream = futures::stream::iter(tickets)
                    .then(move |ticket| {
                        let mut client = client.clone();
                        async move { client.do_get(ticket).await.map_err(flight_error) }
                    })
                    .map_ok(|batches| batches.map_err(flight_error))
                    .try_flatten();
                Ok((schema, stream.boxed()))
            }
        }
    }
}

/// Where and how results go.
#[derive(Debug)]
pub struct Printer {
    /// The result format.
    pub format: Format,
    /// A file for the results instead of standard output.
    pub output: Option<PathBuf>,
}

impl Printer {
    fn writer(&self) -> Result<Box<dyn Write>> {
        Ok(match &self.output {
            Some(path) => Box::new(std::io::BufWriter::new(File::create(path).map_err(
                |error| DataFusionError::Execution(format!("{}: {error}", path.display())),
            )?)),
            None => Box::new(std::io::BufWriter::new(std::io::stdout())),
        })
    }
}

/// A spinner on stderr once a statement has run for a second (on a
/// terminal only); for a statement that loads rows into a table (COPY,
/// INSERT, CREATE TABLE AS, UPDATE) in this process, what it has loaded.
struct Progress {
    bar: ProgressBar,
    started: Instant,
    shown: bool,
    /// The catalog's write counters and their reading at the start.
    load: Option<(Arc<OwnedTables>, LoadReading)>,
}

/// What a load has done so far, as the spinner says it.
pub fn load_message(done: &LoadReading, elapsed: Duration) -> String {
    let seconds = elapsed.as_secs_f64().max(1e-3);
    format!(
        "loading: {} rows taken ({:.0} rows/s), {} slice{} stored ({:.1} MB)",
        done.rows_taken,
        done.rows_taken as f64 / seconds,
        done.slices_stored,
        if done.slices_stored == 1 { "" } else { "s" },
        done.bytes_stored as f64 / 1e6
    )
}

impl Progress {
    fn new(backend: &Backend) -> Self {
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::hidden());
        bar.set_style(
            ProgressStyle::with_template("{spinner} {elapsed} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        let load = match backend {
            Backend::Local(context) => context
                .state()
                .config()
                .get_extension::<ClusterCatalog>()
                .and_then(|catalog| catalog.owned.clone())
                .map(|owned| {
                    let start = owned.load_progress();
                    (owned, start)
                }),
            Backend::Remote(_) => None,
        };
        Self {
            bar,
            started: Instant::now(),
            shown: false,
            load,
        }
    }

    fn tick(&mut self, rows: usize) {
        if !self.shown
            && self.started.elapsed() > Duration::from_secs(1)
            && std::io::stderr().is_terminal()
        {
            self.bar.set_draw_target(ProgressDrawTarget::stderr());
            self.bar.enable_steady_tick(Duration::from_millis(120));
            self.shown = true;
        }
        if self.shown {
            let loaded = self
                .load
                .as_ref()
                .map(|(owned, start)| owned.load_progress().since(start))
                .filter(|done| done.rows_taken > 0);
            self.bar.set_message(match loaded {
                Some(done) => format!(
                    "{} (Ctrl-C cancels; nothing is committed until the end)",
                    load_message(&done, self.started.elapsed())
                ),
                None => format!("running, {rows} rows so far (Ctrl-C cancels)"),
            });
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}

/// Where a statement's batches go as they come.
enum Sink {
    Table(Box<dyn Write>, Vec<RecordBatch>),
    Csv(Box<arrow::csv::Writer<Box<dyn Write>>>),
    Json(arrow::json::ArrayWriter<Box<dyn Write>>),
}

/// Run one statement and print its result; "N rows in T" on stderr.
async fn run_one(backend: &mut Backend, sql: &str, printer: &Printer) -> Result<()> {
    let started = Instant::now();
    let mut progress = Progress::new(backend);
    let mut ticker = tokio::time::interval(Duration::from_millis(250));
    let (schema, mut stream) = tokio::select! {
        started = backend.start(sql) => started?,
        _ = tokio::signal::ctrl_c() => return plan_err!("cancelled"),
    };
    let out = printer.writer()?;
    let mut sink = match printer.format {
        Format::Table => Sink::Table(out, Vec::new()),
        Format::Csv => Sink::Csv(Box::new(
            arrow::csv::WriterBuilder::new()
                .with_header(true)
                .build(out),
        )),
        Format::Json => Sink::Json(arrow::json::ArrayWriter::new(out)),
    };
    let mut rows = 0usize;
    loop {
        let batch = tokio::select! {
            batch = stream.next() => batch,
            _ = ticker.tick() => {
                progress.tick(rows);
                continue;
            }
            _ = tokio::signal::ctrl_c() => return plan_err!("cancelled after {rows} rows"),
        };
        let Some(batch) = batch else { break };
        let batch = batch?;
        rows += batch.num_rows();
        progress.tick(rows);
        match &mut sink {
            Sink::Table(_, batches) => batches.push(batch),
            Sink::Csv(writer) => writer.write(&batch)?,
            Sink::Json(writer) => writer.write(&batch)?,
        }
    }
    drop(progress);
    let mut out = match sink {
        // A statement without columns (SET, CREATE VIEW): nothing to print.
        Sink::Table(out, _) if schema.fields().is_empty() => out,
        Sink::Table(mut out, mut batches) => {
            if batches.is_empty() {
                batches.push(RecordBatch::new_empty(schema));
            }
            writeln!(
                out,
                "{}",
                arrow::util::pretty::pretty_format_batches(&batches)?
            )?;
            out
        }
        Sink::Csv(mut writer) => {
            if rows == 0 {
                // The header alone.
                writer.write(&RecordBatch::new_empty(schema))?;
            }
            writer.into_inner()
        }
        Sink::Json(mut writer) => {
            writer.finish()?;
            let mut out = writer.into_inner();
            out.write_all(b"\n")?;
            out
        }
    };
    out.flush()?;
    eprintln!(
        "{rows} row{} in {}",
        if rows == 1 { "" } else { "s" },
        elapsed(started.elapsed())
    );
    Ok(())
}

fn elapsed(duration: Duration) -> String {
    let seconds = duration.as_secs_f64();
    if seconds < 1.0 {
        format!("{:.1} ms", seconds * 1e3)
    } else {
        format!("{seconds:.2} s")
    }
}

/// The statements of `sql`, split at each `;` outside quotes and comments.
pub fn split_statements(sql: &str) -> Vec<String> {
    let mut statements = Vec::new();
    let mut current = String::new();
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\'' | '"' => {
                current.push(c);
                for inner in chars.by_ref() {
                    current.push(inner);
                    if inner == c {
                        break;
                    }
                }
            }
            '-' if chars.peek() == Some(&'-') => {
                for inner in chars.by_ref() {
                    if inner == '\n' {
                        current.push('\n');
                        break;
                    }
                }
            }
            '/' if chars.peek() == Some(&'*') => {
                chars.next();
                let mut last = ' ';
                for inner in chars.by_ref() {
                    if last == '*' && inner == '/' {
                        break;
                    }
                    last = inner;
                }
                current.push(' ');
            }
            ';' => {
                if !current.trim().is_empty() {
                    statements.push(current.trim().to_string());
                }
                current.clear();
            }
            _ => current.push(c),
        }
    }
    if !current.trim().is_empty() {
        statements.push(current.trim().to_string());
    }
    statements
}

/// Psql-like shortcuts: `\dt` lists the tables, `\d NAME` describes one.
fn shortcut(line: &str) -> Option<String> {
    let line = line.trim().trim_end_matches(';');
    if line == "\\dt" {
        return Some("SHOW TABLES".to_string());
    }
    line.strip_prefix("\\d ")
        .map(|name| format!("DESCRIBE {}", name.trim()))
}

/// Run every statement of `sql` in order; the first error stops the run.
pub async fn run_statements(backend: &mut Backend, sql: &str, printer: &Printer) -> Result<()> {
    for statement in split_statements(sql) {
        run_one(backend, &statement, printer).await?;
    }
    Ok(())
}

/// The shell: statements end with `;`; `\q` quits, `\dt` and `\d NAME`
/// list and describe tables. On a terminal with line editing and a
/// history (`~/.sieve_history`), else reading lines from standard input.
/// An error is printed and the shell goes on.
pub async fn shell(backend: &mut Backend, printer: &Printer) -> Result<()> {
    if std::io::stdin().is_terminal() {
        return interactive(backend, printer).await;
    }
    let mut buffer = String::new();
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        if let Some(sql) = shortcut(&line) {
            report(run_one(backend, &sql, printer).await);
            continue;
        }
        buffer.push_str(&line);
        buffer.push('\n');
        if line.trim_end().ends_with(';') {
            report(run_statements(backend, &buffer, printer).await);
            buffer.clear();
        }
    }
    if !buffer.trim().is_empty() {
        report(run_statements(backend, &buffer, printer).await);
    }
    Ok(())
}

fn report(result: Result<()>) {
    if let Err(error) = result {
        eprintln!("error: {error}");
    }
}

fn history_path() -> Option<PathBuf> {
    std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".sieve_history"))
}

async fn interactive(backend: &mut Backend, printer: &Printer) -> Result<()> {
    use rustyline::error::ReadlineError;
    let mut editor = rustyline::DefaultEditor::new()
        .map_err(|error| DataFusionError::Execution(format!("terminal: {error}")))?;
    let history = history_path();
    if let Some(path) = &history {
        let _ = editor.load_history(path);
    }
    eprintln!("Statements end with ';'. \\dt lists tables, \\d NAME describes one, \\q quits.");
    let mut buffer = String::new();
    loop {
        let prompt = if buffer.is_empty() {
            "sieve> "
        } else {
            "   ... "
        };
        match editor.readline(prompt) {
            Ok(line) => {
                let trimmed = line.trim();
                if buffer.is_empty() && (trimmed == "\\q" || trimmed == "quit" || trimmed == "exit")
                {
                    break;
                }
                if buffer.is_empty() {
                    if let Some(sql) = shortcut(trimmed) {
                        let _ = editor.add_history_entry(trimmed);
                        report(run_one(backend, &sql, printer).await);
                        continue;
                    }
                }
                buffer.push_str(&line);
                buffer.push('\n');
                if trimmed.ends_with(';') {
                    let _ = editor.add_history_entry(buffer.trim_end());
                    if let Some(path) = &history {
                        let _ = editor.save_history(path);
                    }
                    report(run_statements(backend, &buffer, printer).await);
                    buffer.clear();
                }
            }
            // Ctrl-C drops the statement being typed.
            Err(ReadlineError::Interrupted) => buffer.clear(),
            Err(ReadlineError::Eof) => break,
            Err(error) => return Err(DataFusionError::Execution(format!("terminal: {error}"))),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_split_at_semicolons_outside_quotes_and_comments() {
        assert_eq!(
            split_statements("select 'a;b'; select \"x;\" from t -- c;\n; /* ; */ select 2"),
            vec!["select 'a;b'", "select \"x;\" from t", "select 2"]
        );
        assert!(split_statements(" ; ;\n").is_empty());
    }

    #[test]
    fn a_status_message_is_unwrapped() {
        let error = flight_error(
            "Tonic error: code: 'Client specified an invalid argument', message: \"No field named \\\"x\\\". (SQLSTATE 42703)\", details: []",
        );
        assert_eq!(
            error.to_string(),
            "Execution error: No field named \"x\". (SQLSTATE 42703)"
        );
        assert_eq!(flight_error("plain").to_string(), "Execution error: plain");
    }

    #[test]
    fn a_load_says_rows_rate_and_slices() {
        let done = LoadReading {
            rows_taken: 3_000_000,
            slices_stored: 2,
            bytes_stored: 45_600_000,
        };
        assert_eq!(
            load_message(&done, Duration::from_secs(4)),
            "loading: 3000000 rows taken (750000 rows/s), 2 slices stored (45.6 MB)"
        );
        let later = LoadReading {
            rows_taken: 3_000_500,
            slices_stored: 3,
            bytes_stored: 50_000_000,
        };
        assert_eq!(
            later.since(&done),
            LoadReading {
                rows_taken: 500,
                slices_stored: 1,
                bytes_stored: 4_400_000
            }
        );
    }

    #[test]
    fn shortcuts_become_sql() {
        assert_eq!(shortcut("\\dt").as_deref(), Some("SHOW TABLES"));
        assert_eq!(
            shortcut("\\d lineitem;").as_deref(),
            Some("DESCRIBE lineitem")
        );
        assert_eq!(shortcut("select 1"), None);
    }
}
