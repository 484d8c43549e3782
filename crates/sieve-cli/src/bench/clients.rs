//! `sieve bench clients`: what a client pays for reaching Sieve over a
//! protocol. One embedded cluster, one `sieve serve` (both ports) in this
//! process, and, side by side in one run:
//!
//! - in-process: a session's `collect`, the floor;
//! - Arrow Flight SQL: arrow-flight's client (GetFlightInfo + DoGet, every
//!   batch decoded);
//! - PostgreSQL: the real `psql`, whose `\timing` measures from sending a
//!   statement to having its whole result (rows printed to /dev/null after).
//!
//! For TPC-H Q1 and Q6 (latency, median of `runs` after one warm-up) and a
//! large result (four lineitem columns, every row: rows per second).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_flight::sql::client::FlightSqlServiceClient;
use datafusion::common::{DataFusionError, Result};
use futures::StreamExt;
use sieve_format::SliceLayout;
use sieve_server::{
    serve, serve_flight_sql, FlightSqlOptions, PgServerOptions, SessionFactory, Users,
};
use tonic::transport::{Channel, Endpoint};

use crate::cluster::{generated_tpch, EmbeddedCluster};
use crate::queries::TPCH_QUERIES;
use crate::serve::{bind, session_factory};

/// The large result: four lineitem columns, every row.
pub const LARGE_RESULT: &str = "select l_orderkey, l_partkey, l_quantity, l_shipdate from lineitem";

/// What `sieve bench clients` measures.
#[derive(Debug, Clone)]
pub struct ClientsBenchOptions {
    /// TPC-H scale factor.
    pub scale_factor: f64,
    /// Storage nodes of the embedded cluster.
    pub nodes: usize,
    /// Timed runs per query and path (after one warm-up); medians reported.
    pub runs: usize,
    /// Data directory (TPC-H in DIR/tpch-sfX).
    pub data_directory: PathBuf,
}

/// One statement's medians through each path.
#[derive(Debug, Clone)]
pub struct ClientsMeasurement {
    /// `q1`, `q6`, `large`.
    pub name: String,
    /// Rows of the result.
    pub rows: usize,
    /// In-process median.
    pub in_process: Duration,
    /// Flight SQL median.
    pub flight_sql: Duration,
    /// PostgreSQL (psql) median.
    pub postgres: Duration,
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn external(error: impl std::fmt::Display) -> DataFusionError {
    DataFusionError::Execution(error.to_string())
}

async fn in_process(factory: &SessionFactory, sql: &str) -> Result<(usize, Duration)> {
    let context = factory()?;
    let started = Instant::now();
    let batches = context.sql(sql).await?.collect().await?;
    let elapsed = started.elapsed();
    Ok((batches.iter().map(|batch| batch.num_rows()).sum(), elapsed))
}

async fn flight_sql(
    client: &mut FlightSqlServiceClient<Channel>,
    sql: &str,
) -> Result<(usize, Duration)> {
    let started = Instant::now();
    let info = client
        .execute(sql.to_string(), None)
        .await
        .map_err(external)?;
    let mut rows = 0;
    for endpoint in info.endpoint {
        let Some(ticket) = endpoint.ticket else {
            continue;
        };
        let mut stream = client.do_get(ticket).await.map_err(external)?;
        while let Some(batch) = stream.next().await {
            rows += batch.map_err(external)?.num_rows();
        }
    }
    Ok((rows, started.elapsed()))
}

/// psql's `\timing` for each statement of `statements`, run in order on
/// one connection.
fn psql_timings(address: &str, password: &str, statements: &[&str]) -> Result<Vec<Duration>> {
    let (host, port) = address
        .rsplit_once(':')
        .ok_or_else(|| external("no port"))?;
    let mut script = String::from("\\pset format unaligned\n\\o /dev/null\n\\timing on\n");
    for statement in statements {
        let statement = statement.trim().trim_end_matches(';');
        writeln!(script, "{statement};").map_err(external)?;
    }
    let output = Command::new("psql")
        .arg(format!(
            "host={host} port={port} user=sieve dbname=sieve sslmode=disable"
        ))
        .args(["-X", "-q", "-v", "ON_ERROR_STOP=1"])
        .env("PGPASSWORD", password)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child
                .stdin
                .take()
                .expect("piped")
                .write_all(script.as_bytes())?;
            child.wait_with_output()
        })
        .map_err(|error| external(format!("psql (apt-get install postgresql-client): {error}")))?;
    if !output.status.success() {
        return Err(external(format!(
            "psql failed: {}",
            String::from_utf8_lossy(&output.stderr)
        )));
    }
    let times: Vec<Duration> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| {
            let milliseconds = line.strip_prefix("Time: ")?.split_whitespace().next()?;
            milliseconds.parse::<f64>().ok()
        })
        .map(|milliseconds| Duration::from_secs_f64(milliseconds / 1e3))
        .collect();
    if times.len() != statements.len() {
        return Err(external(format!(
            "psql reported {} timings for {} statements",
            times.len(),
            statements.len()
        )));
    }
    Ok(times)
}

/// Run the benchmark; its measurements.
pub async fn run_clients_bench(options: &ClientsBenchOptions) -> Result<Vec<ClientsMeasurement>> {
    let runs = options.runs.max(1);
    let root = generated_tpch(
        &options
            .data_directory
            .join(format!("tpch-sf{}", options.scale_factor)),
        options.scale_factor,
        options.nodes,
        1,
        &SliceLayout::default(),
    )?;
    let cluster = EmbeddedCluster::start(&root, options.nodes).await?;
    let factory = session_factory(
        &cluster.urls(),
        Some(cluster.secret()),
        vec![],
        Some(&cluster.catalog_path()),
    )
    .await?;
    let password = Users::random_password(12)?;
    let users = Arc::new(Users::new([("sieve".to_string(), password.clone())])?);
    let (pg_listener, pg_address) = bind("127.0.0.1:0".parse().map_err(external)?).await?;
    let (flight_listener, flight_address) = bind("127.0.0.1:0".parse().map_err(external)?).await?;
    let pg = tokio::spawn(serve(
        pg_listener,
        Arc::clone(&factory),
        PgServerOptions {
            users: Arc::clone(&users),
            tls: None,
            connections_max: 4,
        },
        std::future::pending(),
    ));
    let flight = tokio::spawn(serve_flight_sql(
        flight_listener,
        Arc::clone(&factory),
        FlightSqlOptions {
            users,
            tls: None,
            sessions_max: 4,
        },
        std::future::pending(),
    ));
    let channel = Endpoint::from_shared(format!("http://{flight_address}"))
        .map_err(external)?
        .connect()
        .await
        .map_err(external)?;
    let mut client = FlightSqlServiceClient::new(channel);
    client
        .handshake("sieve", &password)
        .await
        .map_err(external)?;

    let query = |name: &str| {
        TPCH_QUERIES
            .iter()
            .find(|(found, _)| *found == name)
            .map(|(_, sql)| *sql)
            .expect("a TPC-H query")
    };
    let statements = [
        ("q1", query("q1")),
        ("q6", query("q6")),
        ("large", LARGE_RESULT),
    ];
    let mut measurements = Vec::new();
    for (name, sql) in statements {
        eprintln!("{name}: in-process, Flight SQL, PostgreSQL ({runs} runs each after a warm-up)");
        let mut rows = None;
        let mut check = |found: usize, path: &str| -> Result<()> {
            match rows {
                None => rows = Some(found),
                Some(expected) if expected != found => {
                    return Err(external(format!(
                        "{name}: {path} returned {found} rows, in-process {expected}"
                    )))
                }
                _ => {}
            }
            Ok(())
        };
        let mut local = Vec::new();
        for run in 0..=runs {
            let (found, elapsed) = in_process(&factory, sql).await?;
            check(found, "in-process")?;
            if run > 0 {
                local.push(elapsed);
            }
        }
        let mut remote = Vec::new();
        for run in 0..=runs {
            let (found, elapsed) = flight_sql(&mut client, sql).await?;
            check(found, "Flight SQL")?;
            if run > 0 {
                remote.push(elapsed);
            }
        }
        let repeated: Vec<&str> = std::iter::repeat_n(sql, runs + 1).collect();
        let pg_address = pg_address.to_string();
        let password = password.clone();
        let postgres =
            tokio::task::spawn_blocking(move || psql_timings(&pg_address, &password, &repeated))
                .await
                .map_err(external)??;
        measurements.push(ClientsMeasurement {
            name: name.to_string(),
            rows: rows.unwrap_or(0),
            in_process: median(local),
            flight_sql: median(remote),
            postgres: median(postgres[1..].to_vec()),
        });
    }
    pg.abort();
    flight.abort();
    Ok(measurements)
}

/// The measurements as a Markdown table.
pub fn clients_markdown(
    options: &ClientsBenchOptions,
    measurements: &[ClientsMeasurement],
) -> String {
    let mut text = format!(
        "TPC-H SF {}, {} storage nodes (embedded, loopback), median of {} runs after a warm-up\n\n\
         | statement | rows | in-process | Flight SQL | / in-process | PostgreSQL (psql) | / in-process |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
        options.scale_factor, options.nodes, options.runs
    );
    let ms = |duration: Duration| format!("{:.1} ms", duration.as_secs_f64() * 1e3);
    for measurement in measurements {
        let ratio = |duration: Duration| {
            format!(
                "{:.2}x",
                duration.as_secs_f64() / measurement.in_process.as_secs_f64()
            )
        };
        let _ = writeln!(
            text,
            "| {} | {} | {} | {} | {} | {} | {} |",
            measurement.name,
            measurement.rows,
            ms(measurement.in_process),
            ms(measurement.flight_sql),
            ratio(measurement.flight_sql),
            ms(measurement.postgres),
            ratio(measurement.postgres),
        );
    }
    if let Some(large) = measurements
        .iter()
        .find(|measurement| measurement.name == "large")
    {
        let rate = |duration: Duration| large.rows as f64 / duration.as_secs_f64() / 1e6;
        let _ = writeln!(
            text,
            "\nlarge result ({LARGE_RESULT}): in-process {:.2} M rows/s, Flight SQL {:.2} M rows/s, PostgreSQL {:.2} M rows/s",
            rate(large.in_process),
            rate(large.flight_sql),
            rate(large.postgres)
        );
    }
    text
}
