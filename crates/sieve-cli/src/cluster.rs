//! An embedded cluster: storage nodes inside this process, on loopback.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use datafusion::common::Result;
use sieve_format::{generate_tpch, is_generated, node_directory, SliceLayout};
use sieve_fragment::Secret;
use sieve_storage::{ConnectionLimits, ExecuteOptions, StorageNode, StorageNodeConfig};

use crate::secret::random_secret;

/// Storage nodes started in this process, one per `node-K` directory,
/// sharing a secret made for this start: connect with
/// `connect_session(&cluster.urls(), Some(cluster.secret()))`.
#[derive(Debug)]
pub struct EmbeddedCluster {
    /// The running nodes.
    pub nodes: Vec<StorageNode>,
    secret: Secret,
}

impl EmbeddedCluster {
    /// Start `nodes` storage nodes over `root/node-0` .. `root/node-{nodes-1}`,
    /// each on free loopback ports.
    pub async fn start(root: &Path, nodes: usize) -> Result<Self> {
        Self::start_with(root, nodes, ExecuteOptions::default()).await
    }

    /// Like [`Self::start`], with these executor settings on every node.
    pub async fn start_with(root: &Path, nodes: usize, execute: ExecuteOptions) -> Result<Self> {
        Self::start_with_limits(root, nodes, execute, ConnectionLimits::default()).await
    }

    /// Like [`Self::start_with`], with these connection bounds on every node.
    pub async fn start_with_limits(
        root: &Path,
        nodes: usize,
        execute: ExecuteOptions,
        limits: ConnectionLimits,
    ) -> Result<Self> {
        let loopback: SocketAddr = "127.0.0.1:0".parse().expect("valid address");
        let secret = random_secret()?;
        let mut started = Vec::with_capacity(nodes);
        for node in 0..nodes {
            started.push(
                StorageNode::start(StorageNodeConfig {
                    data_directory: node_directory(root, node),
                    flight_address: loopback,
                    range_address: loopback,
                    execute: execute.clone(),
                    auth: Some(secret.clone()),
                    limits: limits.clone(),
                })
                .await?,
            );
        }
        Ok(Self {
            nodes: started,
            secret,
        })
    }

    /// The secret every node of this cluster requires.
    pub fn secret(&self) -> &Secret {
        &self.secret
    }

    /// Like [`Self::start`], with no pushdown workers: every slice is served
    /// raw and the compute node runs each fragment itself.
    pub async fn start_raw(root: &Path, nodes: usize) -> Result<Self> {
        let execute = ExecuteOptions {
            pushdown_workers: 0,
            ..ExecuteOptions::default()
        };
        Self::start_with(root, nodes, execute).await
    }

    /// Flight URLs of the nodes.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(StorageNode::flight_url).collect()
    }

    /// Slices the nodes served raw, and slices they served in all, since start.
    pub fn slices_raw_and_served(&self) -> (u64, u64) {
        self.nodes.iter().fold((0, 0), |(raw, served), node| {
            let counters = node.executor().counters();
            (
                raw + counters.slices_raw.load(Ordering::Relaxed),
                served + counters.slices_served.load(Ordering::Relaxed),
            )
        })
    }
}

/// Where TPC-H at `scale_factor` with `replicas` copies of each slice lives
/// under the data directory `data`: `tpch-sfX`, or `tpch-sfX-rR` with replicas.
pub fn tpch_directory(data: &Path, scale_factor: f64, replicas: usize) -> PathBuf {
    if replicas > 1 {
        data.join(format!("tpch-sf{scale_factor}-r{replicas}"))
    } else {
        data.join(format!("tpch-sf{scale_factor}"))
    }
}

/// TPC-H at `scale_factor` over `nodes` node directories under `root`, each
/// slice on `replicas` nodes, generated if `root` does not hold a complete
/// load of this format version, node count and replica count.
/// Generation goes to a directory of its own and is renamed into place, so
/// concurrent callers (test processes) never see a partial load: the loser of
/// the rename discards its copy.
pub fn generated_tpch(
    root: &Path,
    scale_factor: f64,
    nodes: usize,
    replicas: usize,
    layout: &SliceLayout,
) -> Result<PathBuf> {
    if is_generated(root, nodes, replicas) {
        return Ok(root.to_path_buf());
    }
    let staging = root.with_extension(format!("staging-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    generate_tpch(&staging, scale_factor, nodes, replicas, layout)?;
    if std::fs::rename(&staging, root).is_err() {
        // Another process won, or an old load of another version is in the way.
        if !is_generated(root, nodes, replicas) {
            std::fs::remove_dir_all(root)?;
            std::fs::rename(&staging, root)?;
        }
        let _ = std::fs::remove_dir_all(&staging);
    }
    Ok(root.to_path_buf())
}
