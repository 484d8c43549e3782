//! `sieve`: the command line of the Sieve near-data-processing database.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use datafusion::common::{DataFusionError, Result};
use sieve_cli::bench::clients::{clients_markdown, run_clients_bench, ClientsBenchOptions};
use sieve_cli::bench::streams::{format_streams, run_streams, StreamsOptions};
use sieve_cli::bench::{run_bench, BenchOptions, LinkSpec, Mode};
use sieve_cli::cluster::EmbeddedCluster;
use sieve_cli::demo::{ensure_data, format_table, run_demo, DemoOptions};
use sieve_cli::fuzz::{
    mismatches_as_error, request_failures_as_error, run_fuzz, run_request_fuzz,
    Family as RequestFamily, FuzzOptions, Mode as FuzzMode, RequestFuzzOptions, RequestTarget,
};
use sieve_cli::secret::{load_secret, SECRET_ENV};
use sieve_cli::serve::{run_serve, ServeOptions};
use sieve_cli::shell::{run_statements, shell, Backend, Format, Printer};
use sieve_format::Benchmark;
use sieve_format::SliceLayout;
use sieve_storage::{ExecuteOptions, StorageNode, StorageNodeConfig};

#[derive(Parser, Debug)]
#[command(
    name = "sieve",
    version,
    about = "Sieve: a near-data-processing analytic SQL database"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The embedded default: TPC-H on a local 3-node cluster, NDP on vs off.
    Demo {
        /// TPC-H scale factor.
        #[arg(long, default_value_t = 0.1)]
        sf: f64,
        /// Storage nodes.
        #[arg(long, default_value_t = 3)]
        nodes: usize,
        /// Copies of each slice, on as many nodes: a node may fail.
        #[arg(long, default_value_t = 2)]
        replicas: usize,
        /// Timed runs per query and mode; the median is reported.
        #[arg(long, default_value_t = 1)]
        runs: usize,
        /// Data directory (generated data is kept in DIR/tpch-sfX).
        #[arg(long, default_value = "sieve-data")]
        data: PathBuf,
        /// Only these queries (e.g. --query q1 --query q6).
        #[arg(long = "query")]
        queries: Vec<String>,
        /// Flight URLs of running storage nodes (comma separated) instead of
        /// the embedded cluster; the CPU columns are then the compute node's alone.
        #[arg(long, value_delimiter = ',')]
        cluster: Vec<String>,
        /// A session setting for both modes, e.g. --set sieve.join_filters=false.
        #[arg(long = "set")]
        settings: Vec<String>,
        /// With --cluster: the data set's table catalog (`catalog.sqlite` of
        /// the directory `sieve gen` loaded), where its tables are.
        #[arg(long, requires = "cluster")]
        catalog: Option<PathBuf>,
    },
    /// Load a benchmark data set through the write path: storage nodes over
    /// --out's node directories (in this process), a table catalog in
    /// --out/catalog.sqlite, each table created from the `tpch(...)` or
    /// `ssb(...)` table function as any `CREATE TABLE ... AS SELECT` is.
    Gen {
        /// Benchmark: `tpch` or `ssb` (the Star Schema Benchmark).
        benchmark: String,
        /// Scale factor.
        #[arg(long, default_value_t = 1.0)]
        sf: f64,
        /// Output directory (node-0, node-1, ... are created inside).
        #[arg(long)]
        out: PathBuf,
        /// Number of storage nodes to spread slices over.
        #[arg(long, default_value_t = 3)]
        nodes: usize,
        /// Copies of each slice, each on another node (at most --nodes).
        #[arg(long, default_value_t = 1)]
        replicas: usize,
        /// Rows per slice (a slice takes up to an eighth more to keep the
        /// rows of its last sort-key value together).
        #[arg(long, default_value_t = SliceLayout::default().slice_rows_max)]
        slice_rows: usize,
        /// Rows per data page at most.
        #[arg(long, default_value_t = SliceLayout::default().data_page_rows_max)]
        page_rows: usize,
        /// Column layout: `planned` (each table's encodings and codecs
        /// chosen by measuring a sample of its rows) or `fixed` (dictionary
        /// and zstd(1) on every column).
        #[arg(long, default_value = "planned")]
        layout: String,
    },
    /// Benchmark NDP on, NDP off and DuckDB side by side over an emulated link
    /// (one network namespace per storage node, shaped with tc; root only,
    /// plain loopback otherwise). Prints a Markdown table and writes
    /// results.json, report.md and charts (SVG, PNG) to --out.
    Bench {
        /// Benchmark: `tpch`, `ssb` (the Star Schema Benchmark's 13 queries),
        /// or `clients` (latency of Q1 and Q6 and the rate
        /// of a large result through Flight SQL and PostgreSQL against
        /// in-process; --sf, --nodes, --runs and --data apply).
        benchmark: String,
        /// Scale factor.
        #[arg(long, default_value_t = 1.0)]
        sf: f64,
        /// Storage nodes, each a process in its own namespace.
        #[arg(long, default_value_t = 3)]
        nodes: usize,
        /// Link rate between compute and each storage node, as tc spells it
        /// (1gbit, 10gbit, 500mbit), or `loopback` for no emulation.
        #[arg(long, default_value = "1gbit")]
        link: String,
        /// One-way delay added in each direction, ms (needs the kernel's netem).
        #[arg(long, default_value_t = 0.0)]
        delay: f64,
        /// Timed runs per query and mode (after one warm-up when more than one).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Untimed runs of each query and mode before its timed runs (default:
        /// one when --runs is more than one, none otherwise). At a scale whose
        /// data does not fit the page cache, a warm-up reads the query's own
        /// columns in, so its timed run is as warm as a smaller scale's.
        #[arg(long)]
        warmups: Option<usize>,
        /// Only these queries (e.g. --query q1 --query q6, or --query q2.1 for SSB).
        #[arg(long = "query")]
        queries: Vec<String>,
        /// Modes to compare, in order: ndp, off, duckdb.
        #[arg(long, value_delimiter = ',', default_value = "ndp,off,duckdb")]
        modes: Vec<String>,
        /// Data directory (data in DIR/tpch-sfX or DIR/ssb-sfX, DuckDB's environment beside it).
        #[arg(long, default_value = "sieve-data")]
        data: PathBuf,
        /// Where results.json, report.md, the charts and node logs go.
        #[arg(long, default_value = "bench-results")]
        out: PathBuf,
        /// A session setting for the Sieve modes, e.g. --set sieve.join_filters=false.
        #[arg(long = "set")]
        settings: Vec<String>,
        /// An argument for every storage node's `sieve storage`, e.g.
        /// --storage-arg=--late-materialization (repeatable).
        #[arg(long = "storage-arg", allow_hyphen_values = true)]
        storage_args: Vec<String>,
    },
    /// Throughput of concurrent TPC-H streams (NDP on) against storage nodes
    /// with different pushdown pools, and recovery from a node killed halfway.
    Streams {
        /// TPC-H scale factor.
        #[arg(long, default_value_t = 1.0)]
        sf: f64,
        /// Storage nodes (in this process, loopback).
        #[arg(long, default_value_t = 3)]
        nodes: usize,
        /// Copies of each slice.
        #[arg(long, default_value_t = 2)]
        replicas: usize,
        /// Concurrent query streams, each running the 22 queries.
        #[arg(long, default_value_t = 8)]
        streams: usize,
        /// Pushdown workers per node to compare (default: the cores, then 1).
        #[arg(long, value_delimiter = ',')]
        pools: Vec<usize>,
        /// Also run the first pool size with node 1 killed halfway.
        #[arg(long)]
        kill: bool,
        /// Data directory (data in DIR/tpch-sfX-rR).
        #[arg(long, default_value = "sieve-data")]
        data: PathBuf,
        /// A session setting for every stream.
        #[arg(long = "set")]
        settings: Vec<String>,
    },
    /// Run a storage node over one data directory.
    Storage {
        /// The node's data directory (e.g. DIR/node-0).
        #[arg(long)]
        data: PathBuf,
        /// Flight address.
        #[arg(long, default_value = "127.0.0.1:50051")]
        listen: SocketAddr,
        /// Byte-range HTTP address.
        #[arg(long, default_value = "127.0.0.1:50061")]
        range_listen: SocketAddr,
        /// Codec of shipped Arrow IPC buffers unless a request asks for one:
        /// auto (lz4 for a compute node on this host, zstd across a
        /// network), zstd (fewest bytes), lz4, none (least CPU).
        #[arg(long, default_value = "auto")]
        ipc_compression: String,
        /// Evaluate the fragment's filter inside the Parquet decoder, decoding
        /// the other columns only for rows that pass (late materialisation).
        #[arg(long)]
        late_materialization: bool,
        /// Slices whose fragment the node processes at once (its pushdown
        /// threads); 0 serves every slice raw. Default: the cores.
        #[arg(long)]
        pushdown_workers: Option<usize>,
        /// Requests that may wait for a pushdown worker; beyond, served raw at
        /// once. Default: 4 per worker.
        #[arg(long)]
        pushdown_queue: Option<usize>,
        /// Longest wait for a pushdown worker before a slice is served raw, ms.
        #[arg(long, default_value_t = sieve_storage::DEFAULT_PUSHDOWN_WAIT_MS)]
        pushdown_wait_ms: u64,
        /// Most memory the node keeps its slices' metadata in (footers,
        /// page indexes, page checksums), MiB; a slice whose metadata was
        /// evicted reads it again from its file when asked for.
        #[arg(long, default_value_t = (sieve_storage::SLICE_DETAILS_CACHE_BYTES_DEFAULT >> 20) as u64)]
        metadata_cache_mb: u64,
        /// File holding the shared secret every request must carry
        /// (`Authorization: Bearer <secret>`). Without it, the secret is
        /// read from the environment variable SIEVE_SECRET.
        #[arg(long)]
        secret_file: Option<PathBuf>,
        /// Serve anyone who can connect, without a secret. Only for a
        /// trusted, isolated network.
        #[arg(long, conflicts_with = "secret_file")]
        insecure_no_auth: bool,
    },
    /// Differential fuzzing: random tables and queries through Sieve in
    /// several modes, each result compared with plain DataFusion over the
    /// same files. Exits non-zero on any mismatch.
    Fuzz {
        /// The run's seed: the same seed gives the same tables and queries.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Schemas (sets of two to four random tables) to generate.
        #[arg(long, default_value_t = 6)]
        schemas: usize,
        /// Queries per schema.
        #[arg(long, default_value_t = 50)]
        queries_per_schema: usize,
        /// Where the slices go while a schema runs (removed afterwards);
        /// default: the system's temporary directory.
        #[arg(long)]
        data: Option<PathBuf>,
        /// Sieve modes to compare with plain DataFusion: default,
        /// no-join-filters, no-aggregate-pushdown, raw, ndp-off,
        /// spilled-joins, few-join-keys, star-joins.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "default,no-join-filters,no-aggregate-pushdown,raw,ndp-off,spilled-joins,few-join-keys,star-joins"
        )]
        modes: Vec<String>,
        /// Only this schema index (to reproduce a mismatch).
        #[arg(long = "schema")]
        only_schema: Option<usize>,
        /// Only this query index in each schema (to reproduce a mismatch).
        #[arg(long = "query")]
        only_query: Option<usize>,
        /// A session setting for every Sieve mode, after the mode's own,
        /// e.g. --set sieve.early_start_rows_max=0 (repeatable).
        #[arg(long = "set")]
        settings: Vec<String>,
        /// Print each mismatching mode's EXPLAIN with the mismatch.
        #[arg(long)]
        explain: bool,
    },
    /// Malformed and hostile requests against one storage node (Flight and
    /// the byte-range endpoint), each answer classified, with health checks.
    /// Exits non-zero on any panic, crash, hang, 5xx or wrong answer.
    FuzzRequests {
        /// The run's seed: request I comes from the seed and I alone.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Requests to send.
        #[arg(long, default_value_t = 10_000)]
        requests: usize,
        /// Where the embedded node's TPC-H SF 0.01 is generated (reused);
        /// default: the system's temporary directory.
        #[arg(long)]
        data: Option<PathBuf>,
        /// Fuzz this running node (its Flight URL) instead of an embedded one.
        #[arg(long)]
        node: Option<String>,
        /// Only this request index (to replay a finding).
        #[arg(long)]
        only: Option<usize>,
        /// Request families taking turns: mutated, deep, random-bytes,
        /// other-calls, byte-range.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "mutated,deep,random-bytes,other-calls,byte-range"
        )]
        families: Vec<String>,
        /// Shared secret of the node: sent as `authorization: Bearer SECRET`.
        #[arg(long)]
        secret: Option<String>,
        /// Per-request timeout in milliseconds: no answer in time is a hang.
        #[arg(long, default_value_t = sieve_cli::fuzz::REQUEST_TIMEOUT_MS_DEFAULT)]
        timeout_ms: u64,
        /// Deepest expression chain of the deep family (at most 5,000).
        #[arg(long, default_value_t = sieve_cli::fuzz::CHAIN_DEPTH_MAX)]
        depth_max: usize,
        /// Write each request here before sending it (the last line names
        /// the request that killed the process, if one does).
        #[arg(long)]
        journal: Option<PathBuf>,
    },
    /// SQL against a cluster: an interactive shell, or -c / -f.
    Sql {
        /// Storage node Flight URLs, comma separated. Without it, the embedded
        /// cluster of the demo is started.
        #[arg(long, value_delimiter = ',')]
        cluster: Vec<String>,
        /// Run this SQL and exit.
        #[arg(short = 'c')]
        command: Option<String>,
        /// Run the SQL in this file and exit.
        #[arg(short = 'f')]
        file: Option<PathBuf>,
        /// Scale factor of the embedded cluster's data.
        #[arg(long, default_value_t = 0.1)]
        sf: f64,
        /// Data directory of the embedded cluster.
        #[arg(long, default_value = "sieve-data")]
        data: PathBuf,
        /// File holding the storage nodes' shared secret (for --cluster).
        /// Without it, the secret is read from the environment variable
        /// SIEVE_SECRET; with neither, requests carry no credential.
        #[arg(long)]
        secret_file: Option<PathBuf>,
        /// How results are printed.
        #[arg(long, value_enum, default_value = "table")]
        format: Format,
        /// Write results to this file instead of standard output.
        #[arg(short = 'o', long = "output")]
        output: Option<PathBuf>,
        /// A running `sieve serve` to send the statements to, by its Arrow
        /// Flight SQL address: grpc://HOST:PORT or grpc+tls://HOST:PORT.
        #[arg(long, conflicts_with = "cluster")]
        connect: Option<String>,
        /// The user to log in as (with --connect).
        #[arg(long, default_value = "sieve")]
        user: String,
        /// File holding the password (with --connect); else SIEVE_PASSWORD.
        #[arg(long)]
        password_file: Option<PathBuf>,
        /// CA certificate (PEM) to check the server's against (grpc+tls://);
        /// else the system's roots.
        #[arg(long)]
        tls_ca: Option<PathBuf>,
        /// The table catalog (tables users own: CREATE TABLE, COPY, INSERT),
        /// a SQLite file made if missing; the embedded cluster's is
        /// DATA/tpch-sfX-r2/catalog.sqlite. With --cluster and without it,
        /// CREATE TABLE makes session-local tables in memory.
        #[arg(long, conflicts_with = "connect")]
        catalog: Option<PathBuf>,
        /// A setting the session starts with, e.g. --set sieve.ndp=off or
        /// --set datafusion.runtime.memory_limit=1G (not with --connect:
        /// there, SET in SQL).
        #[arg(long = "set", conflicts_with = "connect")]
        settings: Vec<String>,
    },
    /// A long-lived compute node for clients: the PostgreSQL wire protocol
    /// (psql, JDBC, psycopg) and Arrow Flight SQL (ADBC, JDBC), each
    /// connection its own session. Without
    /// --cluster it starts the embedded cluster of the demo.
    Serve {
        /// Storage node Flight URLs, comma separated. Without it, the embedded
        /// cluster of the demo is started.
        #[arg(long, value_delimiter = ',')]
        cluster: Vec<String>,
        /// Scale factor of the embedded cluster's data.
        #[arg(long, default_value_t = 0.1)]
        sf: f64,
        /// Data directory of the embedded cluster.
        #[arg(long, default_value = "sieve-data")]
        data: PathBuf,
        /// File holding the storage nodes' shared secret (for --cluster);
        /// else SIEVE_SECRET.
        #[arg(long)]
        secret_file: Option<PathBuf>,
        /// Address of the PostgreSQL port.
        #[arg(long, default_value = "127.0.0.1:5433")]
        listen: SocketAddr,
        /// Address of the Arrow Flight SQL port.
        #[arg(long, default_value = "127.0.0.1:5434")]
        flight_listen: SocketAddr,
        /// The user who may log in.
        #[arg(long, default_value = "sieve")]
        user: String,
        /// File holding the user's password; else SIEVE_PASSWORD; with
        /// neither, one is made up and printed.
        #[arg(long)]
        password_file: Option<PathBuf>,
        /// TLS certificate chain (PEM). With --tls-key, every connection must
        /// use TLS; a certificate or key that cannot be used stops the server.
        #[arg(long)]
        tls_cert: Option<PathBuf>,
        /// TLS private key (PEM: PKCS#8, PKCS#1 or SEC1).
        #[arg(long)]
        tls_key: Option<PathBuf>,
        /// Serve plaintext on an address other than loopback.
        #[arg(long)]
        insecure_plaintext: bool,
        /// Client connections served at once (PostgreSQL; more are refused
        /// with SQLSTATE 53300), and Flight SQL sessions open at once.
        #[arg(long, default_value_t = sieve_server::CONNECTIONS_MAX_DEFAULT)]
        connections_max: usize,
        /// A setting every session starts with, e.g. --set sieve.ndp=off.
        #[arg(long = "set")]
        settings: Vec<String>,
        /// The table catalog (tables users own), a SQLite file made if
        /// missing; the embedded cluster's is in its data directory.
        #[arg(long)]
        catalog: Option<PathBuf>,
    },
}

/// The `sieve` binary's allocator (compute and storage nodes): jemalloc.
/// glibc's arenas keep the high-water mark of the blocks below their mmap
/// threshold, so the compute node's RSS stood 400 to 450 MB above its heap
/// at TPC-H Q21, SF 100. With jemalloc the SF 100 run peaked at 1,205 MB
/// against 1,487 MB, at the same time and compute CPU, and SF 10 at 556
/// against 565 MB (docs/results/2026-11-29-issue20-part29.md).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read before `main`: pages freed are returned to the
/// system by a background thread after a second, not kept for ten (what
/// was measured; `_RJEM_MALLOC_CONF` in the environment adds to it), and
/// at once when the last open statement ends (`release_both_allocators`,
/// `sieve.release_memory_idle_ms`).
///
/// jemalloc's `oversize_threshold` stays at its 8 MiB: larger blocks are
/// unmapped the moment they are freed. At 64 MiB a statement reuses them
/// (TPC-H SF 100 under `512M`: 243.8 and 249.9 s in two runs, against
/// 247.6 to 253.9 s in three at 8 MiB), but what is kept stays resident:
/// SF 100's compute peak was 741 and 876 MB against 661 to 670 MB, the
/// second 1.7 times SF 10's (docs/results/2026-11-30-issue20-part39.md).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[export_name = "_rjem_malloc_conf"]
#[allow(non_upper_case_globals)]
static malloc_conf: &[u8; 60] = b"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0\0";

/// Malloc arenas a `sieve` process may use: one per core, at least two.
/// Rust's allocations go to jemalloc ([`ALLOCATOR`]); these tune glibc's
/// malloc for what C libraries (SQLite's catalog among them) allocate.
/// glibc's default is eight per core, and each arena keeps the peak its
/// threads (tokio workers, the blocking pool, a storage node's executors)
/// reached: a COPY of TPC-H SF 1 lineitem peaked at 1.7 to 1.8 GB with
/// the default and at 1.2 GB with two arenas, and the compute node's peak
/// grew query after query at SF 100. Measured in
/// docs/results/2026-11-25-issue18-part2.md (mimalloc was tried there and
/// was slower and larger; again in 2026-11-27-issue20-part12.md, with a
/// larger storage node). `MALLOC_ARENA_MAX` in the environment wins.
///
/// And the size from which malloc maps a block of its own, returned to the
/// system when freed: fixed at 1 MiB. glibc's default starts at 128 KiB but
/// rises to the size of each mapped block freed, up to 32 MiB, so after the
/// first large buffers (a page's decoded column, a join filter's bitmap, an
/// IPC message) every later one of that size comes from an arena, where it
/// stays part of the peak. TPC-H Q21 at SF 100: largest storage node 212
/// against 259 to 281 MB, compute 1,522 against 1,663 to 1,834 MB
/// (docs/results/2026-11-27-issue20-part12.md). `MALLOC_MMAP_THRESHOLD_`
/// in the environment wins.
fn tune_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
            let cores = std::thread::available_parallelism().map_or(2, |cores| cores.get());
            let arenas = libc::c_int::try_from(cores.max(2)).unwrap_or(libc::c_int::MAX);
            // SAFETY: called first in `main`, before any other thread exists;
            // `mallopt` only sets one of malloc's tunables.
            unsafe {
                libc::mallopt(libc::M_ARENA_MAX, arenas);
            }
        }
        if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
            // SAFETY: as above. Setting the threshold also turns off its
            // dynamic rise.
            unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
            }
        }
    }
}

/// See [`tune_malloc`].
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: libc::c_int = 1 << 20;

/// Return the freed memory of both allocators in this binary to the
/// system at once: every jemalloc arena's freed pages
/// (`arena.<MALLCTL_ARENAS_ALL>.purge`; Rust's allocations), then glibc's
/// heap (`malloc_trim`; what C libraries such as SQLite allocate). What
/// `sieve_compute::memory::release_freed_memory` does in this binary.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn release_both_allocators() {
    // MALLCTL_ARENAS_ALL is 4096 in jemalloc 5.
    const PURGE_ALL: &[u8] = b"arena.4096.purge\0";
    // SAFETY: a NUL-terminated name; a purge reads and writes no value
    // (all pointers null, length 0). A failure only leaves pages cached.
    unsafe {
        tikv_jemalloc_sys::mallctl(
            PURGE_ALL.as_ptr().cast(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        );
    }
    // SAFETY: malloc_trim only returns free heap memory to the system; it
    // takes no pointers and is safe to call at any time, from any thread.
    unsafe {
        libc::malloc_trim(0);
    }
}

fn main() -> ExitCode {
    tune_malloc();
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    sieve_format::set_memory_releaser(release_both_allocators);
    let cli = Cli::parse();
    // Threads with deep stacks (`sieve_compute::compute_runtime`), and the
    // command's own thread likewise: DataFusion plans by recursion.
    let runtime = match sieve_compute::compute_runtime() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let finished = std::thread::Builder::new()
        .name("sieve-main".to_string())
        .stack_size(sieve_compute::COMPUTE_THREAD_STACK_BYTES)
        .spawn(move || runtime.block_on(run(cli)))
        .map_err(|error| DataFusionError::Execution(format!("cannot start: {error}")))
        .and_then(|thread| {
            thread
                .join()
                .unwrap_or_else(|_| Err(DataFusionError::Execution("panicked".to_string())))
        });
    match finished {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<()> {
    let command = cli.command.unwrap_or(Command::Demo {
        sf: 0.1,
        nodes: 3,
        replicas: 2,
        runs: 1,
        data: PathBuf::from("sieve-data"),
        queries: vec![],
        cluster: vec![],
        settings: vec![],
        catalog: None,
    });
    match command {
        Command::Demo {
            sf,
            nodes,
            replicas,
            runs,
            data,
            queries,
            cluster,
            settings,
            catalog,
        } => {
            let where_ = if cluster.is_empty() {
                format!("{nodes} embedded storage nodes (loopback Flight); cpu = whole process")
            } else {
                format!(
                    "{} storage nodes at {}; cpu = compute node",
                    cluster.len(),
                    cluster.join(",")
                )
            };
            let options = DemoOptions {
                scale_factor: sf,
                nodes,
                replicas,
                runs,
                data_directory: data,
                queries,
                cluster,
                settings,
                catalog,
            };
            let reports = run_demo(&options).await?;
            let warmup = if runs > 1 { " after a warm-up" } else { "" };
            println!("TPC-H SF {sf} on {where_}, median of {runs} run(s){warmup}");
            println!("{}", format_table(&reports));
            Ok(())
        }
        Command::Bench {
            benchmark,
            sf,
            nodes,
            link,
            delay,
            runs,
            warmups,
            queries,
            modes,
            data,
            out,
            settings,
            storage_args,
        } => {
            if benchmark == "clients" {
                let options = ClientsBenchOptions {
                    scale_factor: sf,
                    nodes,
                    runs,
                    data_directory: data,
                };
                let measurements = run_clients_bench(&options).await?;
                println!("{}", clients_markdown(&options, &measurements));
                return Ok(());
            }
            let options = BenchOptions {
                benchmark,
                scale_factor: sf,
                nodes,
                link: LinkSpec::parse(&link, delay)?,
                runs,
                warmups: warmups.unwrap_or(usize::from(runs > 1)),
                queries,
                modes: modes
                    .iter()
                    .map(|mode| Mode::parse(mode))
                    .collect::<Result<_>>()?,
                data_directory: data,
                out_directory: out.clone(),
                settings,
                storage_args,
                sieve_binary: std::env::current_exe()?,
            };
            let report = run_bench(&options).await?;
            println!("{}", report.markdown());
            println!(
                "raw measurements: {0}/results.json; charts: {0}/speedup.svg|png, {0}/bytes.svg|png",
                out.display()
            );
            Ok(())
        }
        Command::Gen {
            benchmark,
            sf,
            out,
            nodes,
            replicas,
            slice_rows,
            page_rows,
            layout,
        } => {
            let Some(benchmark) = Benchmark::parse(&benchmark) else {
                return datafusion::common::plan_err!(
                    "unknown benchmark '{benchmark}' (known: tpch, ssb)"
                );
            };
            let planned = match layout.as_str() {
                "planned" => true,
                "fixed" => false,
                other => {
                    return datafusion::common::plan_err!(
                        "unknown layout '{other}' (known: planned, fixed)"
                    )
                }
            };
            let layout = SliceLayout {
                slice_rows_max: slice_rows,
                data_page_rows_max: page_rows,
                planned,
                ..SliceLayout::default()
            };
            let started = std::time::Instant::now();
            sieve_cli::cluster::load(benchmark, &out, sf, nodes, replicas, &layout)?;
            println!(
                "loaded {} SF {sf} into {} in {:.1} s ({nodes} node directories and catalog.sqlite, {replicas} cop{} of each slice)",
                benchmark.title(),
                out.display(),
                started.elapsed().as_secs_f64(),
                if replicas == 1 { "y" } else { "ies" }
            );
            Ok(())
        }
        Command::Streams {
            sf,
            nodes,
            replicas,
            streams,
            pools,
            kill,
            data,
            settings,
        } => {
            let pools = if pools.is_empty() {
                vec![ExecuteOptions::default().pushdown_workers, 1]
            } else {
                pools
            };
            let options = StreamsOptions {
                scale_factor: sf,
                nodes,
                replicas,
                streams,
                pools,
                kill,
                data_directory: data,
                settings,
            };
            let reports = run_streams(&options).await?;
            println!("{}", format_streams(&options, &reports));
            Ok(())
        }
        Command::Fuzz {
            seed,
            schemas,
            queries_per_schema,
            data,
            modes,
            only_schema,
            only_query,
            settings,
            explain,
        } => {
            let options = FuzzOptions {
                data_directory: data,
                modes: modes
                    .iter()
                    .map(|mode| FuzzMode::parse(mode))
                    .collect::<Result<_>>()?,
                only_schema,
                only_query,
                settings,
                explain,
                ..FuzzOptions::new(seed, schemas, queries_per_schema)
            };
            let report = run_fuzz(&options).await?;
            println!("{}", report.summary());
            mismatches_as_error(&report)
        }
        Command::FuzzRequests {
            seed,
            requests,
            data,
            node,
            only,
            families,
            secret,
            timeout_ms,
            depth_max,
            journal,
        } => {
            let data = data.unwrap_or_else(|| std::env::temp_dir().join("sieve-request-fuzz"));
            let options = RequestFuzzOptions {
                only,
                families: families
                    .iter()
                    .map(|family| RequestFamily::parse(family))
                    .collect::<Result<_>>()?,
                target: match node {
                    Some(url) => RequestTarget::Node(url),
                    None => RequestTarget::Embedded(data.clone()),
                },
                authorization: secret.map(|secret| format!("Bearer {secret}")),
                request_timeout: std::time::Duration::from_millis(timeout_ms),
                expression_depth_max: depth_max,
                journal,
                ..RequestFuzzOptions::new(seed, requests, data)
            };
            let report = run_request_fuzz(&options).await?;
            println!("{}", report.summary());
            request_failures_as_error(&report)
        }
        Command::Storage {
            data,
            listen,
            range_listen,
            ipc_compression,
            late_materialization,
            pushdown_workers,
            pushdown_queue,
            pushdown_wait_ms,
            metadata_cache_mb,
            secret_file,
            insecure_no_auth,
        } => {
            let ipc_compression = sieve_fragment::IpcCodec::parse(&ipc_compression)?;
            let auth = match load_secret(secret_file.as_deref())? {
                Some(secret) if !insecure_no_auth => Some(secret),
                Some(_) => {
                    return datafusion::common::plan_err!(
                        "--insecure-no-auth with {SECRET_ENV} set: unset {SECRET_ENV}, or drop --insecure-no-auth"
                    )
                }
                None if insecure_no_auth => {
                    eprintln!("warning: --insecure-no-auth: this node serves anyone who can connect");
                    None
                }
                None => {
                    return datafusion::common::plan_err!(
                        "a storage node needs a shared secret: give --secret-file FILE or set {SECRET_ENV} (or, on a trusted isolated network only, --insecure-no-auth)"
                    )
                }
            };
            let node = StorageNode::start(StorageNodeConfig {
                data_directory: data.clone(),
                flight_address: listen,
                range_address: range_listen,
                execute: ExecuteOptions {
                    ipc_compression,
                    pushdown_filters: late_materialization,
                    pushdown_workers: pushdown_workers
                        .unwrap_or(ExecuteOptions::default().pushdown_workers),
                    pushdown_queue_max: pushdown_queue,
                    pushdown_wait: std::time::Duration::from_millis(pushdown_wait_ms),
                    slice_details_cache_bytes: usize::try_from(metadata_cache_mb)
                        .ok()
                        .and_then(|mb| mb.checked_mul(1 << 20))
                        .ok_or_else(|| {
                            datafusion::error::DataFusionError::Plan(format!(
                                "--metadata-cache-mb {metadata_cache_mb} is too large"
                            ))
                        })?,
                    ..ExecuteOptions::default()
                },
                auth,
                limits: sieve_storage::ConnectionLimits::default(),
            })
            .await?;
            println!(
                "storage node over {}: flight {} , byte ranges http://{}",
                data.display(),
                node.flight_url(),
                node.range_address()
            );
            let _ = tokio::signal::ctrl_c().await;
            node.stop().await;
            Ok(())
        }
        Command::Sql {
            cluster,
            command,
            file,
            sf,
            data,
            secret_file,
            format,
            output,
            connect,
            user,
            password_file,
            tls_ca,
            catalog,
            settings,
        } => {
            let printer = Printer { format, output };
            if let Some(url) = connect {
                let password = sieve_cli::serve::password_from(password_file.as_deref())?
                    .ok_or_else(|| {
                        DataFusionError::Plan(format!(
                            "--connect needs a password: --password-file or {}",
                            sieve_cli::serve::PASSWORD_ENV
                        ))
                    })?;
                let mut backend =
                    Backend::connect(&url, &user, &password, tls_ca.as_deref()).await?;
                return run_sql(&mut backend, command, file, &printer).await;
            }
            let mut embedded = None;
            let mut secret = load_secret(secret_file.as_deref())?;
            let mut tables = catalog;
            let urls = if cluster.is_empty() {
                let options = DemoOptions {
                    scale_factor: sf,
                    nodes: 3,
                    replicas: 2,
                    runs: 1,
                    data_directory: data,
                    queries: vec![],
                    cluster: vec![],
                    settings: vec![],
                    catalog: None,
                };
                let root = ensure_data(&options)?;
                tables.get_or_insert_with(|| root.join(sieve_cli::serve::TABLE_CATALOG_FILE));
                let started = EmbeddedCluster::start(&root, 3).await?;
                let urls = started.urls();
                secret = Some(started.secret().clone());
                embedded = Some(started);
                urls
            } else {
                cluster
            };
            let session = sieve_compute::connect_session_with_tables(
                &urls,
                secret.as_ref(),
                datafusion::prelude::SessionConfig::new(),
                tables.as_deref(),
            )
            .await?;
            session.apply_settings(&settings)?;
            let mut backend = Backend::Local(session.context);
            let result = run_sql(&mut backend, command, file, &printer).await;
            drop(embedded);
            result
        }
        Command::Serve {
            cluster,
            sf,
            data,
            secret_file,
            listen,
            flight_listen,
            user,
            password_file,
            tls_cert,
            tls_key,
            insecure_plaintext,
            connections_max,
            settings,
            catalog,
        } => {
            run_serve(ServeOptions {
                cluster,
                scale_factor: sf,
                data_directory: data,
                secret_file,
                listen,
                flight_listen,
                user,
                password_file,
                tls_cert,
                tls_key,
                insecure_plaintext,
                connections_max,
                settings,
                catalog,
            })
            .await
        }
    }
}

/// `sieve sql`'s statements: from -c, from -f, or the shell.
async fn run_sql(
    backend: &mut Backend,
    command: Option<String>,
    file: Option<PathBuf>,
    printer: &Printer,
) -> Result<()> {
    if let Some(sql) = command {
        run_statements(backend, &sql, printer).await
    } else if let Some(file) = file {
        let sql = std::fs::read_to_string(&file)
            .map_err(|error| DataFusionError::Execution(format!("{}: {error}", file.display())))?;
        run_statements(backend, &sql, printer).await
    } else {
        shell(backend, printer).await
    }
}
