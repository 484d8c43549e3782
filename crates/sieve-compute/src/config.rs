//! Session settings under the `sieve.` prefix (`SET sieve.ndp = off`).

use datafusion::common::config::ConfigExtension;
use datafusion::common::{extensions_options, plan_err, Result};

extensions_options! {
    /// Sieve's session settings.
    pub struct SieveConfig {
        /// `on`: push filters and projections to the storage nodes as NDP
        /// fragments. `off`: the baseline, stock DataFusion reading the same
        /// slices by byte range.
        pub ndp: String, default = "on".to_string()
        /// Slice requests kept in flight per output partition: how far the
        /// scan reads ahead of its consumer.
        pub slices_in_flight: usize, default = 4
    }
}

impl ConfigExtension for SieveConfig {
    const PREFIX: &'static str = "sieve";
}

/// Whether pushdown is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NdpMode {
    /// Fragments evaluated on the storage nodes.
    On,
    /// Slices read by byte range, everything evaluated on the compute node.
    Off,
}

impl SieveConfig {
    /// The `sieve.ndp` setting, validated.
    pub fn mode(&self) -> Result<NdpMode> {
        match self.ndp.to_ascii_lowercase().as_str() {
            "on" | "true" => Ok(NdpMode::On),
            "off" | "false" => Ok(NdpMode::Off),
            other => plan_err!("sieve.ndp must be 'on' or 'off', not '{other}'"),
        }
    }
}
