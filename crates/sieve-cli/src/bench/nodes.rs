//! The storage nodes of a benchmark: `sieve storage` processes, each in its
//! namespace behind the emulated link, or on loopback without one.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use datafusion::common::{exec_datafusion_err, exec_err, Result};

use sieve_fragment::Secret;

use super::link::{NodeLink, SharedCleanup};
use crate::secret::SECRET_ENV;

/// How long a storage node may take to open its catalog and listen.
const NODE_START_TIMEOUT: Duration = Duration::from_secs(60);

/// A started storage process.
#[derive(Debug, Clone)]
pub struct NodeProcess {
    /// Name in the cleanup list and in messages (`storage-0`).
    pub name: String,
    /// Process id (the `sieve storage` process itself: `ip netns exec` execs it).
    pub pid: u32,
    /// Flight URL.
    pub flight_url: String,
    /// Where its log goes.
    pub log: PathBuf,
}

/// A free TCP port on loopback (the listener is closed again at once).
fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0")
        .map_err(|error| exec_datafusion_err!("no free loopback port: {error}"))?;
    Ok(listener
        .local_addr()
        .map_err(|error| exec_datafusion_err!("{error}"))?
        .port())
}

/// The `sieve` binary storage nodes run, and extra arguments for each.
#[derive(Debug, Clone, Copy)]
pub struct NodeCommand<'a> {
    /// The binary.
    pub sieve: &'a Path,
    /// Arguments after `sieve storage`'s own.
    pub extra_args: &'a [String],
}

/// Start one `sieve storage` per node directory under `root` (with the
/// command's extra arguments), inside its namespace when `links` is given,
/// and wait until each accepts connections.
pub fn start(
    command: NodeCommand<'_>,
    root: &Path,
    links: Option<&[NodeLink]>,
    nodes: usize,
    logs: &Path,
    cleanup: &SharedCleanup,
    secret: &Secret,
) -> Result<Vec<NodeProcess>> {
    let NodeCommand { sieve, extra_args } = command;
    std::fs::create_dir_all(logs)?;
    let mut started = Vec::with_capacity(nodes);
    for node in 0..nodes {
        let (address, flight_port, range_port, namespace) = match links {
            Some(links) => (
                IpAddr::V4(links[node].node_address),
                50051,
                50052,
                Some(&links[node].namespace),
            ),
            None => (
                IpAddr::V4(Ipv4Addr::LOCALHOST),
                free_port()?,
                free_port()?,
                None,
            ),
        };
        let flight = SocketAddr::new(address, flight_port);
        let range = SocketAddr::new(address, range_port);
        let name = format!("storage-{node}");
        let log = logs.join(format!("{name}.log"));
        let log_file = std::fs::File::create(&log)?;
        let mut command = match namespace {
            Some(namespace) => {
                let mut command = Command::new("ip");
                command.args(["netns", "exec", namespace]).arg(sieve);
                command
            }
            None => Command::new(sieve),
        };
        command
            .arg("storage")
            .arg("--data")
            .arg(sieve_format::node_directory(root, node))
            .arg("--listen")
            .arg(flight.to_string())
            .arg("--range-listen")
            .arg(range.to_string())
            .args(extra_args)
            // The secret goes by environment, never on the command line,
            // where `ps` shows it to every user of the host.
            .env(SECRET_ENV, secret.expose())
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file);
        // SAFETY: prctl is async-signal-safe; it makes the node die with
        // this process even when this process is killed with SIGKILL.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = command
            .spawn()
            .map_err(|error| exec_datafusion_err!("cannot start {name}: {error}"))?;
        let pid = child.id();
        cleanup
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .add_child(name.clone(), child);
        started.push((
            NodeProcess {
                name,
                pid,
                flight_url: format!("http://{flight}"),
                log,
            },
            flight,
        ));
    }
    for (node, address) in &started {
        let deadline = Instant::now() + NODE_START_TIMEOUT;
        loop {
            if TcpStream::connect_timeout(address, Duration::from_millis(200)).is_ok() {
                break;
            }
            let exited = cleanup
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .exited(&node.name);
            if exited.is_some() || Instant::now() > deadline {
                let log = std::fs::read_to_string(&node.log).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(5).collect();
                let why = match exited {
                    Some(status) => format!("exited ({status})"),
                    None => format!("did not listen on {address} within {NODE_START_TIMEOUT:?}"),
                };
                return exec_err!(
                    "{} {why}; last lines of {}:\n{}",
                    node.name,
                    node.log.display(),
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    Ok(started.into_iter().map(|(node, _)| node).collect())
}

/// CPU seconds (user + system) process `pid` has used so far, from /proc.
pub fn cpu_seconds(pid: u32) -> Result<f64> {
    let path = format!("/proc/{pid}/stat");
    let stat =
        std::fs::read_to_string(&path).map_err(|error| exec_datafusion_err!("{path}: {error}"))?;
    // Fields after the command name (which may hold spaces) in parentheses.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    // utime and stime are fields 14 and 15 of the line; 12 and 13 after ')'.
    let ticks = |index: usize| -> Result<f64> {
        fields
            .get(index)
            .and_then(|field| field.parse::<u64>().ok())
            .map(|ticks| ticks as f64)
            .ok_or_else(|| exec_datafusion_err!("{path}: unexpected format"))
    };
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Ok((ticks(11)? + ticks(12)?) / per_second)
}

/// CPU seconds (user + system) of this process so far.
pub fn own_cpu_seconds() -> f64 {
    // SAFETY: `usage` is a valid, writable rusage and RUSAGE_SELF a constant.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return 0.0;
    }
    let seconds = |value: libc::timeval| value.tv_sec as f64 + value.tv_usec as f64 / 1_000_000.0;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

/// Start counting peak resident memory of process `pid` (`self` for this
/// one) afresh: Linux resets `VmHWM` when `5` is written to `clear_refs`.
/// Without permission the peak keeps counting from the process's start.
pub fn reset_peak_rss(pid: &str) {
    let _ = std::fs::write(format!("/proc/{pid}/clear_refs"), "5");
}

/// Peak resident memory of process `pid` (`self` for this one) since its
/// start or the last [`reset_peak_rss`], in bytes (`VmHWM`).
pub fn peak_rss_bytes(pid: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|line| line.starts_with("VmHWM:"))?;
    let kilobytes: u64 = line
        .trim_start_matches("VmHWM:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kilobytes * 1024)
}
