//! What a compute node asks of a storage node when it writes a table a user
//! owns: put a slice file, remove slices, keep only the slices a catalog
//! still refers to. The messages are JSON, like the summaries.
//!
//! Tables a user creates are stored on the nodes under a *storage name*,
//! `name@id` (the table's name and its catalog id), so that a table dropped
//! and created again under the same name never shares a directory with its
//! predecessor. Only tables with a storage name can be written or removed
//! over the wire; a generated table (`lineitem`) cannot.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Flight action: stop serving some slices of an owned table and delete
/// their files (body: [`RemoveSlices`]; answers the count removed).
pub const REMOVE_SLICES_ACTION: &str = "remove-slices";

/// Flight action: keep only the listed slices of owned tables, deleting
/// every other slice of every owned table on the node (body:
/// [`RetainSlices`]); what a compute node sends when it opens its catalog,
/// so files no committed version refers to do not outlive a crash.
pub const RETAIN_SLICES_ACTION: &str = "retain-slices";

/// The largest slice file a node accepts in one put.
pub const PUT_SLICE_BYTES_MAX: u64 = 1 << 30;

/// The longest table name a user may give.
pub const TABLE_NAME_BYTES_MAX: usize = 63;

/// The header of a slice put (Flight `DoPut`): the first message's
/// descriptor command; the file's bytes follow as the messages' bodies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutSlice {
    /// Storage name of the table (`name@id`).
    pub table: String,
    /// Slice number, unique in the catalog.
    pub slice: u32,
    /// Length of the file.
    pub bytes: u64,
    /// CRC-32 of the whole file, checked before the file is renamed into
    /// place.
    pub crc32: u32,
}

/// Body of [`REMOVE_SLICES_ACTION`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoveSlices {
    /// Storage name of the table.
    pub table: String,
    /// Slices to remove.
    pub slices: Vec<u32>,
}

/// Body of [`RETAIN_SLICES_ACTION`]: by storage name, the slices to keep;
/// an owned table not named loses all its slices.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetainSlices {
    /// Slices to keep, by storage name.
    pub tables: BTreeMap<String, Vec<u32>>,
}

/// The storage name of table `name` with catalog id `id`.
pub fn storage_name(name: &str, id: u64) -> String {
    format!("{name}@{id}")
}

/// Whether `name` is a storage name (a table a user owns), and its parts.
pub fn parse_storage_name(name: &str) -> Option<(&str, u64)> {
    let (table, id) = name.split_once('@')?;
    check_table_name(table).ok()?;
    if id.is_empty() || !id.bytes().all(|byte| byte.is_ascii_digit()) || id.len() > 19 {
        return None;
    }
    Some((table, id.parse().ok()?))
}

/// A user's table name must be an identifier Sieve can use as a directory
/// name on every node: lower-case ASCII letters, digits and `_`, starting
/// with a letter or `_`, at most [`TABLE_NAME_BYTES_MAX`] bytes.
pub fn check_table_name(name: &str) -> Result<(), String> {
    let valid = !name.is_empty()
        && name.len() <= TABLE_NAME_BYTES_MAX
        && name
            .bytes()
            .all(|byte| byte.is_ascii_lowercase() || byte.is_ascii_digit() || byte == b'_')
        && !name.as_bytes()[0].is_ascii_digit();
    if valid {
        Ok(())
    } else {
        Err(format!(
            "table name '{}' is not allowed: a table a user creates is named with lower-case letters, digits and '_', starting with a letter or '_', at most {TABLE_NAME_BYTES_MAX} bytes",
            name.chars().take(80).collect::<String>()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_names_round_trip_and_refuse_what_is_not_one() {
        assert_eq!(
            parse_storage_name(&storage_name("sales_2026", 17)),
            Some(("sales_2026", 17))
        );
        for bad in [
            "lineitem", "a@", "@3", "A@3", "a@3x", "../a@1", "a@1@2", "1a@2", "a b@1",
        ] {
            assert_eq!(parse_storage_name(bad), None, "{bad}");
        }
        assert!(check_table_name(&"x".repeat(TABLE_NAME_BYTES_MAX)).is_ok());
        assert!(check_table_name(&"x".repeat(TABLE_NAME_BYTES_MAX + 1)).is_err());
    }
}
