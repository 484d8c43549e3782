//! What the compute node registers on this node once per query, kept
//! decoded by id within a byte bound until every registration of one is
//! released or it has been idle past a timeout: join filters (see
//! `sieve_fragment::JoinFilterRegistration`) and fragment bodies (see
//! `sieve_fragment::FragmentBodyRegistration`), one [`Registry`] each.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use datafusion::physical_expr::PhysicalExpr;
use sieve_fragment::{DecodedJoinFilter, JOIN_FILTER_ID_BYTES};

/// Default bound on the bytes of registered join filters a node keeps
/// (charged at twice their encoded bytes): room for the largest
/// registration with room to spare.
pub const JOIN_FILTER_REGISTRY_BYTES_MAX: usize = 512 * 1024 * 1024;

/// Default time a registered join filter is kept without being used or
/// registered again: a query that ends without releasing its filters (its
/// compute node died) leaves them no longer than this.
pub const JOIN_FILTER_IDLE_TIMEOUT: Duration = Duration::from_secs(600);

/// Decoded size charged per encoded byte of a registration (a Bloom filter
/// or bitmap decodes to its own bytes; the expression around it is small).
const DECODED_BYTES_PER_BYTE: usize = 2;

type Id = [u8; JOIN_FILTER_ID_BYTES];

#[derive(Debug)]
struct Entry<V> {
    table: String,
    value: V,
    charge: usize,
    registrations: u64,
    last_used: Instant,
}

/// The join filters of one node.
pub type JoinFilterRegistry = Registry<Arc<dyn PhysicalExpr>>;

/// The fragment bodies registered on one node.
pub type BodyRegistry = Registry<Arc<sieve_fragment::DecodedBody>>;

/// Default bound on the bytes of registered fragment bodies a node keeps
/// (charged at twice their encoded bytes: a body's rows decode to about
/// their own size).
pub const BODY_REGISTRY_BYTES_MAX: usize = 256 * 1024 * 1024;

/// One node's registrations of one kind.
#[derive(Debug)]
pub struct Registry<V> {
    /// What it holds, for messages and the `stats` keys (`join_filter`:
    /// `join_filters_held`, `join_filter_bytes_held`, ...).
    kind: &'static str,
    /// The plural of `kind`.
    kinds: &'static str,
    entries: Mutex<Entries<V>>,
    bytes_max: usize,
    idle_timeout: Duration,
    /// Registrations accepted, ever.
    registered: AtomicU64,
    /// Filters dropped to stay within the bound or idle too long.
    evicted: AtomicU64,
    /// Slice requests that named a filter the node did not hold.
    missing: AtomicU64,
}

#[derive(Debug)]
struct Entries<V> {
    by_id: HashMap<Id, Entry<V>>,
    bytes: usize,
}

impl<V> Default for Entries<V> {
    fn default() -> Self {
        Self {
            by_id: HashMap::new(),
            bytes: 0,
        }
    }
}

impl<V> Entries<V> {
    fn remove(&mut self, id: &Id) -> bool {
        match self.by_id.remove(id) {
            Some(entry) => {
                self.bytes -= entry.charge;
                true
            }
            None => false,
        }
    }
}

impl JoinFilterRegistry {
    /// A registry of join filters keeping at most `bytes_max` bytes,
    /// dropping filters idle for `idle_timeout`.
    pub fn new(bytes_max: usize, idle_timeout: Duration) -> Self {
        Self::of("join_filter", "join_filters", bytes_max, idle_timeout)
    }

    /// Keep `filter`, or count one more registration of it.
    pub fn register(&self, filter: DecodedJoinFilter) -> Result<(), String> {
        self.insert(filter.id, filter.table, filter.filter, filter.bytes)
    }
}

impl<V: Clone> Registry<V> {
    /// A registry of `kind` keeping at most `bytes_max` bytes, dropping
    /// entries idle for `idle_timeout`.
    pub fn of(
        kind: &'static str,
        kinds: &'static str,
        bytes_max: usize,
        idle_timeout: Duration,
    ) -> Self {
        Self {
            kind,
            kinds,
            entries: Mutex::new(Entries::default()),
            bytes_max,
            idle_timeout,
            registered: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            missing: AtomicU64::new(0),
        }
    }

    /// Keep `value` (`bytes` encoded) as `id` for `table`, or count one
    /// more registration of it. One larger than the whole bound is refused;
    /// otherwise the least recently used entries make room.
    pub fn insert(&self, id: Id, table: String, value: V, bytes: usize) -> Result<(), String> {
        let charge = bytes.saturating_mul(DECODED_BYTES_PER_BYTE);
        if charge > self.bytes_max {
            return Err(format!(
                "{} of {bytes} bytes does not fit the node's bound of {} bytes",
                self.kind.replace('_', " "),
                self.bytes_max
            ));
        }
        let now = Instant::now();
        let mut entries = self.entries.lock().expect("never poisoned");
        self.expire(&mut entries, now);
        self.registered.fetch_add(1, Ordering::Relaxed);
        if let Some(entry) = entries.by_id.get_mut(&id) {
            entry.registrations += 1;
            entry.last_used = now;
            return Ok(());
        }
        while entries.bytes + charge > self.bytes_max {
            let Some(oldest) = entries
                .by_id
                .iter()
                .min_by_key(|(_, entry)| entry.last_used)
                .map(|(id, _)| *id)
            else {
                break;
            };
            entries.remove(&oldest);
            self.evicted.fetch_add(1, Ordering::Relaxed);
        }
        entries.bytes += charge;
        entries.by_id.insert(
            id,
            Entry {
                table,
                value,
                charge,
                registrations: 1,
                last_used: now,
            },
        );
        Ok(())
    }

    /// The entry `id` over `table`, if the node holds it; `None` counts a
    /// miss. One registered for another table is an error.
    pub fn get(&self, id: &Id, table: &str) -> Result<Option<V>, String> {
        let mut entries = self.entries.lock().expect("never poisoned");
        match entries.by_id.get_mut(id) {
            Some(entry) if entry.table == table => {
                entry.last_used = Instant::now();
                Ok(Some(entry.value.clone()))
            }
            Some(entry) => Err(format!(
                "{} was registered for table '{}', not '{table}'",
                self.kind.replace('_', " "),
                entry.table
            )),
            None => {
                self.missing.fetch_add(1, Ordering::Relaxed);
                Ok(None)
            }
        }
    }

    /// Release one registration of `id`; the filter goes with its last.
    /// Returns whether the node held it.
    pub fn release(&self, id: &Id) -> bool {
        let mut entries = self.entries.lock().expect("never poisoned");
        let Some(entry) = entries.by_id.get_mut(id) else {
            return false;
        };
        entry.registrations -= 1;
        if entry.registrations == 0 {
            entries.remove(id);
        }
        true
    }

    fn expire(&self, entries: &mut Entries<V>, now: Instant) {
        let expired: Vec<Id> = entries
            .by_id
            .iter()
            .filter(|(_, entry)| now.duration_since(entry.last_used) > self.idle_timeout)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            entries.remove(&id);
            self.evicted.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The registry's state as JSON, for the `stats` action.
    pub fn to_json(&self) -> serde_json::Value {
        let mut entries = self.entries.lock().expect("never poisoned");
        self.expire(&mut entries, Instant::now());
        let (kind, kinds) = (self.kind, self.kinds);
        let mut stats = serde_json::Map::new();
        for (name, value) in [
            (format!("{kinds}_held"), entries.by_id.len() as u64),
            (format!("{kind}_bytes_held"), entries.bytes as u64),
            (
                format!("{kinds}_registered"),
                self.registered.load(Ordering::Relaxed),
            ),
            (
                format!("{kinds}_evicted"),
                self.evicted.load(Ordering::Relaxed),
            ),
            (
                format!("{kinds}_missing"),
                self.missing.load(Ordering::Relaxed),
            ),
        ] {
            stats.insert(name, value.into());
        }
        serde_json::Value::Object(stats)
    }
}

impl Default for JoinFilterRegistry {
    fn default() -> Self {
        Self::new(JOIN_FILTER_REGISTRY_BYTES_MAX, JOIN_FILTER_IDLE_TIMEOUT)
    }
}

impl Default for BodyRegistry {
    fn default() -> Self {
        Self::of(
            "fragment_body",
            "fragment_bodies",
            BODY_REGISTRY_BYTES_MAX,
            JOIN_FILTER_IDLE_TIMEOUT,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::physical_expr::expressions::lit;

    fn filter(id: u8, table: &str, bytes: usize) -> DecodedJoinFilter {
        DecodedJoinFilter {
            id: [id; JOIN_FILTER_ID_BYTES],
            table: table.to_string(),
            filter: lit(true),
            bytes,
        }
    }

    #[test]
    fn filters_are_counted_released_and_evicted_within_the_bound() {
        let registry = JoinFilterRegistry::new(1000, Duration::from_secs(60));
        registry.register(filter(1, "t", 200)).unwrap();
        registry.register(filter(1, "t", 200)).unwrap();
        assert!(registry.get(&[1; 16], "t").unwrap().is_some());
        assert!(registry.get(&[1; 16], "u").is_err());
        // Two registrations: the first release keeps it.
        assert!(registry.release(&[1; 16]));
        assert!(registry.get(&[1; 16], "t").unwrap().is_some());
        assert!(registry.release(&[1; 16]));
        assert!(registry.get(&[1; 16], "t").unwrap().is_none());
        assert!(!registry.release(&[1; 16]));
        // 400 + 400 charged fit; a third evicts the least recently used.
        registry.register(filter(2, "t", 200)).unwrap();
        registry.register(filter(3, "t", 200)).unwrap();
        assert!(registry.get(&[2; 16], "t").unwrap().is_some());
        registry.register(filter(4, "t", 200)).unwrap();
        assert!(registry.get(&[3; 16], "t").unwrap().is_none());
        assert!(registry.get(&[2; 16], "t").unwrap().is_some());
        assert!(registry.register(filter(5, "t", 600)).is_err());
        let stats = registry.to_json();
        assert_eq!(stats["join_filters_held"], 2);
        assert_eq!(stats["join_filter_bytes_held"], 800);
        assert_eq!(stats["join_filters_missing"], 2);
    }

    #[test]
    fn idle_filters_expire() {
        let registry = JoinFilterRegistry::new(1000, Duration::from_millis(1));
        registry.register(filter(1, "t", 10)).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(registry.to_json()["join_filters_held"], 0);
    }
}
