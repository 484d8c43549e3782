//! The emulated link: each storage node in a network namespace of its own,
//! joined to the compute side (this process's namespace) by a veth pair
//! shaped with `tc` in both directions: a token bucket (`tbf`) at the link
//! rate, behind a `netem` delay when one is asked for.
//!
//! Everything created here is registered with [`Cleanup`] before it exists,
//! so a failure halfway, an error, Ctrl-C or SIGTERM removes it again.
//! Names carry this process's id (`sieve-b<pid>-<node>`), so concurrent
//! harnesses never touch each other's namespaces, and a later run removes
//! what a killed one left behind.

use std::net::Ipv4Addr;
use std::path::Path;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use datafusion::common::{exec_datafusion_err, plan_err, Result};

/// The link asked for on the command line.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkSpec {
    /// Rate in `tc` syntax (`1gbit`, `100mbit`); `None` is plain loopback.
    pub rate: Option<String>,
    /// The rate in bits per second.
    pub rate_bits: Option<u64>,
    /// One-way delay added by `netem` in each direction, in milliseconds.
    pub delay_ms: f64,
}

impl LinkSpec {
    /// Parse `--link` (`loopback`, or a rate such as `1gbit`, `10gbit`,
    /// `500mbit`) and `--delay` (milliseconds, one way).
    pub fn parse(link: &str, delay_ms: f64) -> Result<Self> {
        if !(0.0..10_000.0).contains(&delay_ms) {
            return plan_err!("--delay must be between 0 and 10000 ms, got {delay_ms}");
        }
        let link = link.trim().to_ascii_lowercase();
        if link == "loopback" || link == "none" {
            if delay_ms > 0.0 {
                return plan_err!("--delay needs an emulated link, not --link {link}");
            }
            return Ok(Self {
                rate: None,
                rate_bits: None,
                delay_ms,
            });
        }
        let split = link
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(link.len());
        let (number, unit) = link.split_at(split);
        let number: f64 = number.parse().map_err(|_| {
            exec_datafusion_err!(
                "--link wants a rate such as 1gbit or 100mbit, or loopback; got '{link}'"
            )
        })?;
        let scale = match unit {
            "gbit" => 1e9,
            "mbit" => 1e6,
            "kbit" => 1e3,
            _ => {
                return plan_err!(
                    "--link rate unit must be gbit, mbit or kbit (as tc spells them); got '{link}'"
                )
            }
        };
        let bits = number * scale;
        if !(1e5..=1e12).contains(&bits) {
            return plan_err!("--link rate must be between 100kbit and 1000gbit, got '{link}'");
        }
        Ok(Self {
            rate: Some(link),
            rate_bits: Some(bits as u64),
            delay_ms,
        })
    }
}

/// What a run created and must remove: storage processes, namespaces and
/// interfaces. Shared with the signal handler.
#[derive(Debug, Default)]
pub struct Cleanup {
    children: Vec<(String, Child)>,
    namespaces: Vec<String>,
    interfaces: Vec<String>,
}

/// [`Cleanup`] shared between the run and its signal handler.
pub type SharedCleanup = Arc<Mutex<Cleanup>>;

impl Cleanup {
    /// Take ownership of a child process (stopped by [`Cleanup::run`]).
    pub fn add_child(&mut self, name: String, child: Child) {
        self.children.push((name, child));
    }

    /// Whether the child called `name` has exited, with its status.
    pub fn exited(&mut self, name: &str) -> Option<std::process::ExitStatus> {
        self.children
            .iter_mut()
            .find(|(child_name, _)| child_name == name)
            .and_then(|(_, child)| child.try_wait().ok().flatten())
    }

    /// Stop every child (SIGTERM, then SIGKILL after two seconds), then
    /// delete the interfaces and namespaces. Returns what could not be undone.
    pub fn run(&mut self) -> Vec<String> {
        let mut problems = Vec::new();
        for (_, child) in &mut self.children {
            if let Ok(pid) = i32::try_from(child.id()) {
                // SAFETY: signalling a child we spawned and have not reaped.
                unsafe { libc::kill(pid, libc::SIGTERM) };
            }
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        for (name, child) in &mut self.children {
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if child.try_wait().ok().flatten().is_none() {
                let _ = child.kill();
            }
            if let Err(error) = child.wait() {
                problems.push(format!("{name}: {error}"));
            }
        }
        self.children.clear();
        for interface in self.interfaces.drain(..) {
            if Path::new("/sys/class/net").join(&interface).exists() {
                if let Err(error) = run(&["ip", "link", "del", &interface]) {
                    problems.push(error.to_string());
                }
            }
        }
        for namespace in self.namespaces.drain(..) {
            if namespace_exists(&namespace) {
                if let Err(error) = run(&["ip", "netns", "del", &namespace]) {
                    problems.push(error.to_string());
                }
            }
        }
        problems
    }
}

/// Removes everything in the shared [`Cleanup`] when dropped.
#[derive(Debug)]
pub struct CleanupGuard(pub SharedCleanup);

impl Drop for CleanupGuard {
    fn drop(&mut self) {
        let mut cleanup = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        for problem in cleanup.run() {
            eprintln!("cleanup: {problem}");
        }
    }
}

/// One storage node's end of the link.
#[derive(Debug, Clone)]
pub struct NodeLink {
    /// The node's network namespace.
    pub namespace: String,
    /// The veth end in this (the compute) namespace: its counters measure the link.
    pub host_interface: String,
    /// The address the storage node listens on, inside its namespace.
    pub node_address: Ipv4Addr,
}

/// Bytes through one host-side interface so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Storage to compute.
    pub received: u64,
    /// Compute to storage.
    pub sent: u64,
}

impl NodeLink {
    /// The interface counters now.
    pub fn counters(&self) -> Result<Counters> {
        let read = |name: &str| -> Result<u64> {
            let path = Path::new("/sys/class/net")
                .join(&self.host_interface)
                .join("statistics")
                .join(name);
            let text = std::fs::read_to_string(&path)
                .map_err(|error| exec_datafusion_err!("{}: {error}", path.display()))?;
            text.trim()
                .parse()
                .map_err(|error| exec_datafusion_err!("{}: {error}", path.display()))
        };
        Ok(Counters {
            received: read("rx_bytes")?,
            sent: read("tx_bytes")?,
        })
    }
}

/// Why the link cannot be emulated on this machine, if it cannot. Installs
/// `iproute2` with apt-get when `ip` or `tc` is missing and we are root.
pub fn unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("link emulation needs root (network namespaces and tc)".into());
    }
    let have = |tool: &str| {
        Command::new(tool)
            .arg("-V")
            .output()
            .is_ok_and(|output| output.status.success())
    };
    if !(have("ip") && have("tc")) {
        if have("apt-get") {
            eprintln!("installing iproute2 (ip, tc) with apt-get ...");
            let _ = Command::new("apt-get").args(["update", "-qq"]).status();
            let _ = Command::new("apt-get")
                .args(["install", "-y", "-qq", "iproute2"])
                .env("DEBIAN_FRONTEND", "noninteractive")
                .status();
        }
        if !(have("ip") && have("tc")) {
            return Some(
                "link emulation needs `ip` and `tc` (iproute2), which could not be installed"
                    .into(),
            );
        }
    }
    if let Err(error) = run(&["ip", "netns", "list"]) {
        return Some(format!("network namespaces are not available: {error}"));
    }
    None
}

/// Run a command; an error carries its stderr.
pub fn run(arguments: &[&str]) -> Result<String> {
    let output = Command::new(arguments[0])
        .args(&arguments[1..])
        .output()
        .map_err(|error| exec_datafusion_err!("{}: {error}", arguments.join(" ")))?;
    if !output.status.success() {
        return Err(exec_datafusion_err!(
            "`{}` failed: {}",
            arguments.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

fn namespace_exists(name: &str) -> bool {
    Path::new("/var/run/netns").join(name).exists() || Path::new("/run/netns").join(name).exists()
}

/// The harness's namespaces: `sieve-b<pid>-<node>`.
fn namespace_name(pid: u32, node: usize) -> String {
    format!("sieve-b{pid}-{node}")
}

/// Namespaces of harness process `pid`, as `ip netns list` shows them.
pub fn namespaces_of(pid: u32) -> Result<Vec<String>> {
    let prefix = format!("sieve-b{pid}-");
    Ok(run(&["ip", "netns", "list"])?
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| name.starts_with(&prefix))
        .map(str::to_string)
        .collect())
}

/// Remove namespaces left by harnesses that no longer run (killed with
/// SIGKILL, or a machine that lost power); their veths go with them.
pub fn remove_stale() {
    let Ok(listing) = run(&["ip", "netns", "list"]) else {
        return;
    };
    for name in listing
        .lines()
        .filter_map(|line| line.split_whitespace().next())
    {
        let Some(pid) = name
            .strip_prefix("sieve-b")
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new("/proc").join(pid.to_string()).exists() {
            eprintln!("removing namespace {name} left by an earlier run (process {pid} is gone)");
            let _ = run(&["ip", "netns", "del", name]);
        }
    }
}

/// A second octet for this run's 10.x.y.0/30 subnets that no interface uses yet.
fn free_subnet(pid: u32) -> Result<u8> {
    let addresses = run(&["ip", "-o", "-4", "addr", "show"])?;
    for step in 0..100u32 {
        let octet = 100 + ((pid + step) % 100) as u8;
        if !addresses.contains(&format!(" 10.{octet}.")) {
            return Ok(octet);
        }
    }
    plan_err!("no free 10.x.0.0/16 subnet for the emulated link (10.100-199 are all in use)")
}

/// Create one namespace and shaped veth pair per storage node.
pub fn create(nodes: usize, spec: &LinkSpec, cleanup: &SharedCleanup) -> Result<Vec<NodeLink>> {
    let (Some(rate), Some(rate_bits)) = (&spec.rate, spec.rate_bits) else {
        return plan_err!("no link rate to emulate");
    };
    if nodes > 250 {
        return plan_err!("at most 250 storage nodes on an emulated link, got {nodes}");
    }
    remove_stale();
    let pid = std::process::id();
    let octet = free_subnet(pid)?;
    // The bucket holds a millisecond of traffic, at least a 64 KiB segment
    // (veth passes TSO segments whole), so shaping does not split them.
    let burst = (rate_bits / 8 / 1000).max(64 * 1024);
    let mut links = Vec::with_capacity(nodes);
    for node in 0..nodes {
        let namespace = namespace_name(pid, node);
        let host = format!("sb{pid}h{node}");
        let peer = format!("sb{pid}n{node}");
        if host.len() > 15 {
            return plan_err!("interface name {host} is longer than 15 bytes");
        }
        {
            let mut cleanup = cleanup
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            cleanup.namespaces.push(namespace.clone());
            cleanup.interfaces.push(host.clone());
        }
        let host_address = Ipv4Addr::new(10, octet, node as u8, 1);
        let node_address = Ipv4Addr::new(10, octet, node as u8, 2);
        run(&["ip", "netns", "add", &namespace])?;
        run(&[
            "ip", "link", "add", &host, "type", "veth", "peer", "name", &peer,
        ])?;
        run(&["ip", "link", "set", &peer, "netns", &namespace])?;
        run(&[
            "ip",
            "addr",
            "add",
            &format!("{host_address}/30"),
            "dev",
            &host,
        ])?;
        run(&["ip", "link", "set", &host, "up"])?;
        run(&[
            "ip",
            "-n",
            &namespace,
            "addr",
            "add",
            &format!("{node_address}/30"),
            "dev",
            &peer,
        ])?;
        run(&["ip", "-n", &namespace, "link", "set", &peer, "up"])?;
        run(&["ip", "-n", &namespace, "link", "set", "lo", "up"])?;
        shape(None, &host, rate, burst, spec.delay_ms)?;
        shape(Some(&namespace), &peer, rate, burst, spec.delay_ms)?;
        links.push(NodeLink {
            namespace,
            host_interface: host,
            node_address,
        });
    }
    Ok(links)
}

/// Token bucket at `rate` on `interface`'s egress, behind a netem delay if any.
fn shape(
    namespace: Option<&str>,
    interface: &str,
    rate: &str,
    burst: u64,
    delay_ms: f64,
) -> Result<()> {
    let mut tc: Vec<String> = vec!["tc".into()];
    if let Some(namespace) = namespace {
        tc.extend(["-n".into(), namespace.into()]);
    }
    let burst = format!("{burst}b");
    let tbf = ["tbf", "rate", rate, "burst", &burst, "latency", "50ms"];
    let command = |tail: &[&str]| -> Vec<String> {
        tc.iter()
            .cloned()
            .chain(tail.iter().map(|part| part.to_string()))
            .collect()
    };
    let run_owned = |arguments: Vec<String>| -> Result<String> {
        run(&arguments.iter().map(String::as_str).collect::<Vec<_>>())
    };
    if delay_ms > 0.0 {
        let delay = format!("{delay_ms}ms");
        run_owned(command(&[
            "qdisc", "add", "dev", interface, "root", "handle", "1:", "netem", "delay", &delay,
        ]))
        .map_err(|error| {
            exec_datafusion_err!(
                "cannot add a netem delay ({error}); this kernel may lack sch_netem: run without --delay"
            )
        })?;
        let mut tail = vec![
            "qdisc", "add", "dev", interface, "parent", "1:1", "handle", "10:",
        ];
        tail.extend(tbf);
        run_owned(command(&tail))?;
    } else {
        let mut tail = vec!["qdisc", "add", "dev", interface, "root"];
        tail.extend(tbf);
        run_owned(command(&tail))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_rates_parse_and_bad_ones_are_refused() {
        let spec = LinkSpec::parse("1gbit", 0.0).unwrap();
        assert_eq!(spec.rate_bits, Some(1_000_000_000));
        assert_eq!(
            LinkSpec::parse("10Gbit", 0.5).unwrap().rate_bits,
            Some(10_000_000_000)
        );
        assert_eq!(LinkSpec::parse("loopback", 0.0).unwrap().rate, None);
        for bad in ["1gb", "fast", "", "0mbit", "1gbit; rm -rf /"] {
            assert!(
                LinkSpec::parse(bad, 0.0).is_err(),
                "{bad} should be refused"
            );
        }
        assert!(LinkSpec::parse("loopback", 1.0).is_err());
        assert!(LinkSpec::parse("1gbit", -1.0).is_err());
    }
}
