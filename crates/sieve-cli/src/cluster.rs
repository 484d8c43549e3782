//! An embedded cluster: storage nodes inside this process, on loopback.

use std::net::SocketAddr;
use std::path::Path;

use datafusion::common::Result;
use sieve_format::node_directory;
use sieve_storage::{ExecuteOptions, StorageNode, StorageNodeConfig};

/// Storage nodes started in this process, one per `node-K` directory.
#[derive(Debug)]
pub struct EmbeddedCluster {
    /// The running nodes.
    pub nodes: Vec<StorageNode>,
}

impl EmbeddedCluster {
    /// Start `nodes` storage nodes over `root/node-0` .. `root/node-{nodes-1}`,
    /// each on free loopback ports.
    pub async fn start(root: &Path, nodes: usize) -> Result<Self> {
        let loopback: SocketAddr = "127.0.0.1:0".parse().expect("valid address");
        let mut started = Vec::with_capacity(nodes);
        for node in 0..nodes {
            started.push(
                StorageNode::start(StorageNodeConfig {
                    data_directory: node_directory(root, node),
                    flight_address: loopback,
                    range_address: loopback,
                    execute: ExecuteOptions::default(),
                })
                .await?,
            );
        }
        Ok(Self { nodes: started })
    }

    /// Flight URLs of the nodes.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(StorageNode::flight_url).collect()
    }
}
