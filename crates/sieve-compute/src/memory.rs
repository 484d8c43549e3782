//! The compute node's memory bound: one DataFusion memory pool per session.
//!
//! DataFusion's default pool is unbounded: an aggregation with a group per
//! order key grows its hash table with the scale factor until the machine
//! runs out. Sieve gives every session a [`FairSpillPool`] (wrapped in a
//! [`TrackConsumersPool`], so that an exhausted pool names its five largest
//! consumers) of half the machine's memory ([`AUTO_MEMORY_FRACTION`]):
//!
//! - operators that can spill (sort, grouped aggregation, sort-merge join,
//!   repartition buffers) each get a fair share of what unspillable ones
//!   leave, and spill to the OS temporary directory past it;
//! - a hash join's build side cannot spill in DataFusion 55: it may take
//!   the whole pool, and past it the query fails with `Resources exhausted`
//!   rather than the process being killed.
//!
//! DataFusion's own setting changes it: `SET datafusion.runtime.memory_limit
//! = '4G'` in SQL (DataFusion then uses its greedy pool), or `--set
//! datafusion.runtime.memory_limit=4G|auto|unbounded` on the command line
//! ([`crate::SieveSession::apply_settings`], a fair pool again).
//!
//! Sieve's own buffers are bounded by their own settings and are not in the
//! pool: slices in flight (`sieve.slices_in_flight`) and batches of a scan
//! started early (`sieve.early_start_buffer_bytes`). Build keys kept for
//! join filters are in the pool (consumer `BuildKeys`), and bounded by
//! `sieve.join_filter_keys_max` distinct keys per column.

use std::num::NonZeroUsize;
use std::sync::Arc;

use datafusion::common::{plan_err, Result};
use datafusion::execution::memory_pool::{
    FairSpillPool, MemoryPool, TrackConsumersPool, UnboundedMemoryPool,
};
use datafusion::execution::runtime_env::{RuntimeEnv, RuntimeEnvBuilder};
use datafusion::prelude::SessionContext;

/// The setting that sizes the pool (DataFusion's own).
pub const MEMORY_LIMIT_SETTING: &str = "datafusion.runtime.memory_limit";

/// Share of the machine's memory `auto` (the default) gives a session's pool.
pub const AUTO_MEMORY_FRACTION: f64 = 0.5;

/// Consumers an exhausted pool names in its error.
const CONSUMERS_NAMED: usize = 5;

/// A pool size read from a memory limit setting (`auto`, `unbounded` or a
/// size with a unit K, M or G): `None` for `unbounded`.
pub fn memory_limit_bytes(value: &str) -> Result<Option<usize>> {
    let value = value.trim();
    match value.to_ascii_lowercase().as_str() {
        "unbounded" | "none" => Ok(None),
        "auto" => Ok(Some(match physical_memory_bytes() {
            Some(total) => (total as f64 * AUTO_MEMORY_FRACTION) as usize,
            // Not Linux, or /proc unreadable: a bound that fits any machine
            // that runs Sieve's benchmarks.
            None => 8 << 30,
        })),
        _ => match SessionContext::parse_capacity_limit(MEMORY_LIMIT_SETTING, &value.to_ascii_uppercase()) {
            Ok(bytes) if bytes > 0 => Ok(Some(bytes)),
            _ => plan_err!(
                "{MEMORY_LIMIT_SETTING} must be 'auto', 'unbounded' or a size such as '4G' or '512M', not '{value}'"
            ),
        },
    }
}

/// The machine's memory (`MemTotal` of `/proc/meminfo`), if known.
fn physical_memory_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|line| line.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The pool for `limit` bytes (`None`: unbounded).
pub fn memory_pool(limit: Option<usize>) -> Arc<dyn MemoryPool> {
    match limit {
        Some(bytes) => Arc::new(TrackConsumersPool::new(
            FairSpillPool::new(bytes),
            NonZeroUsize::new(CONSUMERS_NAMED).expect("non-zero"),
        )),
        None => Arc::new(UnboundedMemoryPool::default()),
    }
}

/// `runtime` with its memory pool replaced by one for `value` (see
/// [`memory_limit_bytes`]); its disk manager (where spills go) and
/// object stores are kept.
pub fn runtime_with_memory_limit(runtime: &RuntimeEnv, value: &str) -> Result<Arc<RuntimeEnv>> {
    let limit = memory_limit_bytes(value)?;
    RuntimeEnvBuilder::from_runtime_env(runtime)
        .with_memory_pool(memory_pool(limit))
        .build_arc()
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::execution::memory_pool::MemoryLimit;

    #[test]
    fn limits_parse_and_bad_ones_are_named() {
        assert_eq!(memory_limit_bytes("512M").unwrap(), Some(512 << 20));
        assert_eq!(memory_limit_bytes(" 2g ").unwrap(), Some(2 << 30));
        assert_eq!(memory_limit_bytes("Unbounded").unwrap(), None);
        let auto = memory_limit_bytes("auto").unwrap().unwrap();
        assert!(auto >= 64 << 20, "auto gave {auto} bytes");
        for bad in ["", "lots", "0M", "-1G", "12"] {
            let error = memory_limit_bytes(bad).unwrap_err().to_string();
            assert!(error.contains(MEMORY_LIMIT_SETTING), "{bad}: {error}");
        }
        assert!(matches!(
            memory_pool(Some(1 << 20)).memory_limit(),
            MemoryLimit::Finite(_)
        ));
    }
}
