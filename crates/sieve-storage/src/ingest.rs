//! Slices written to a running node: the storage side of the write path.
//!
//! ```text
//!  DoPut  header (PutSlice: storage name, slice, length, CRC-32)
//!         file bytes, in the messages' bodies
//!    └─> TABLE/.TABLE-NNNNN.parquet.<n>.tmp   written, length and CRC checked,
//!        fsync, rename to TABLE/TABLE-NNNNN.parquet, fsync the directory,
//!        read its footer and page index: served from now on
//!  remove-slices / retain-slices: stop serving, delete the files
//! ```
//!
//! A node only writes and removes tables with a storage name (`name@id`,
//! [`sieve_format::writes`]); what `sieve gen` wrote is read-only over the
//! wire. The node does not know which slices a catalog has committed: the
//! compute node names the ones to remove, and when it opens its catalog it
//! names every one to keep (`retain-slices`). A temporary file is never
//! served, and those left by a crash are removed when the node starts.

use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arrow_flight::FlightData;
use futures::{Stream, StreamExt};
use sieve_format::writes::{
    parse_storage_name, PutSlice, RemoveSlices, RetainSlices, PUT_SLICE_BYTES_MAX,
};
use sieve_format::SliceSummary;
use tonic::Status;

use crate::catalog::sync_directory;
use crate::NodeCatalog;

/// Slice puts a node accepts at once; more wait their turn.
pub const PUTS_IN_FLIGHT_MAX: usize = 4;

/// The largest header (the descriptor's JSON) a node reads.
const PUT_HEADER_BYTES_MAX: usize = 4096;

/// Distinguishes the temporary files of puts running at once.
static TEMPORARY: AtomicU64 = AtomicU64::new(0);

/// Receive one slice file over `messages` (see the module documentation)
/// and serve it; returns its summary. Any failure leaves nothing behind:
/// the temporary file is removed and the catalog is unchanged.
pub async fn put_slice(
    catalog: &Arc<NodeCatalog>,
    mut messages: impl Stream<Item = Result<FlightData, Status>> + Unpin,
) -> Result<SliceSummary, Status> {
    let first = messages
        .next()
        .await
        .ok_or_else(|| Status::invalid_argument("put: no message"))??;
    let header = parse_header(&first)?;
    let directory = catalog.root().join(&header.table);
    let final_path = catalog.slice_path(&header.table, header.slice);
    if catalog.slice(&header.table, header.slice).is_ok() || final_path.exists() {
        return Err(Status::already_exists(format!(
            "slice {} of table '{}' is already on this node",
            header.slice, header.table
        )));
    }
    check_free_space(catalog.root(), header.bytes)?;
    std::fs::create_dir_all(&directory)
        .map_err(|error| io_status("create the table directory", &error))?;
    let temporary = directory.join(format!(
        ".{}.{}.tmp",
        sieve_format::slice_file_name(&header.table, header.slice),
        TEMPORARY.fetch_add(1, Ordering::Relaxed)
    ));
    // Removes the temporary file unless it was renamed into place, also
    // when the request is dropped mid-stream (a client gone).
    let mut guard = Temporary(Some(temporary.clone()));
    receive(&temporary, &header, first, &mut messages).await?;
    // Rename, sync and serve in one blocking task, which runs to its end
    // even if the request is dropped meanwhile.
    let catalog = Arc::clone(catalog);
    guard.0 = None;
    let added = tokio::task::spawn_blocking(move || {
        let placed = std::fs::rename(&temporary, &final_path)
            .map_err(|error| io_status("rename the slice into place", &error))
            .and_then(|()| {
                sync_directory(&directory)
                    .map_err(|error| io_status("sync the table directory", &error))
            });
        if let Err(status) = placed {
            let _ = std::fs::remove_file(&temporary);
            return Err(status);
        }
        // Reading the footer of a file a client sent: a decoder panic is a
        // refused put, never a node down.
        let added = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            catalog.add_slice(&header.table, header.slice)
        }));
        match added {
            Ok(Ok(summary)) => Ok(summary),
            failed => {
                // Not a slice this node can serve: it must not be found at
                // the next start either.
                let _ = std::fs::remove_file(&final_path);
                let reason = match failed {
                    Ok(Err(error)) => error.to_string(),
                    _ => "its metadata does not decode (the decoder panicked)".to_string(),
                };
                Err(Status::invalid_argument(format!(
                    "put: the file is not a slice: {reason}"
                )))
            }
        }
    })
    .await
    .map_err(|error| Status::internal(format!("put: {error}")))?;
    added
}

/// A temporary file, removed when dropped unless taken.
struct Temporary(Option<std::path::PathBuf>);

impl Drop for Temporary {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}

fn parse_header(first: &FlightData) -> Result<PutSlice, Status> {
    let command = first
        .flight_descriptor
        .as_ref()
        .map(|descriptor| descriptor.cmd.as_ref())
        .unwrap_or_default();
    if command.is_empty() || command.len() > PUT_HEADER_BYTES_MAX {
        return Err(Status::invalid_argument(format!(
            "put: the first message's descriptor must carry the slice header (JSON, at most {PUT_HEADER_BYTES_MAX} bytes)"
        )));
    }
    let header: PutSlice = serde_json::from_slice(command)
        .map_err(|error| Status::invalid_argument(format!("put: bad slice header: {error}")))?;
    if parse_storage_name(&header.table).is_none() {
        return Err(Status::invalid_argument(format!(
            "put: '{}' is not the storage name of a table a user owns (name@id); generated tables are not written over the wire",
            header.table.chars().take(80).collect::<String>()
        )));
    }
    if header.bytes > PUT_SLICE_BYTES_MAX {
        return Err(Status::invalid_argument(format!(
            "put: a slice of {} bytes is over the limit of {PUT_SLICE_BYTES_MAX} bytes",
            header.bytes
        )));
    }
    Ok(header)
}

/// Write the bodies of `first` and the rest of `messages` to `path`,
/// checking the length and CRC-32 the header announced, and sync it.
async fn receive(
    path: &Path,
    header: &PutSlice,
    first: FlightData,
    messages: &mut (impl Stream<Item = Result<FlightData, Status>> + Unpin),
) -> Result<(), Status> {
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|error| io_status("create the temporary file", &error))?;
    let mut hasher = crc32fast::Hasher::new();
    let mut received = 0u64;
    let mut body = first.data_body;
    loop {
        received += body.len() as u64;
        if received > header.bytes {
            return Err(Status::invalid_argument(format!(
                "put: more than the {} bytes announced",
                header.bytes
            )));
        }
        hasher.update(&body);
        // Small writes to the page cache; the sync below is the slow part.
        file.write_all(&body)
            .map_err(|error| io_status("write the slice", &error))?;
        match messages.next().await {
            Some(message) => body = message?.data_body,
            None => break,
        }
    }
    if received != header.bytes {
        return Err(Status::invalid_argument(format!(
            "put: {received} bytes received, {} announced",
            header.bytes
        )));
    }
    let crc32 = hasher.finalize();
    if crc32 != header.crc32 {
        return Err(Status::data_loss(format!(
            "put: the file's CRC-32 is {crc32:08x}, {:08x} announced",
            header.crc32
        )));
    }
    let synced = tokio::task::spawn_blocking(move || file.sync_all())
        .await
        .map_err(|error| Status::internal(format!("put: {error}")))?;
    synced.map_err(|error| io_status("sync the slice", &error))
}

/// Refuse a put of `bytes` before writing any of it when the file system
/// of `root` has less room than that for this user (`statvfs`'s available
/// blocks), as a full disk would refuse it halfway. The check is a fast
/// answer, not a reservation: a disk that fills meanwhile still fails the
/// write itself with `ENOSPC`, which [`io_status`] reports the same way.
fn check_free_space(root: &Path, bytes: u64) -> Result<(), Status> {
    let Some(available) = available_bytes(root) else {
        return Ok(()); // Unknown: the write itself will tell.
    };
    if available < bytes {
        return Err(Status::resource_exhausted(format!(
            "put: the storage node's disk is full: the slice needs {bytes} bytes, {available} are free"
        )));
    }
    Ok(())
}

/// Bytes an unprivileged writer may still use on the file system of `path`
/// (`None` where `statvfs` cannot tell).
pub fn available_bytes(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: `statvfs` writes only into `stats`, and `path` is a valid C
    // string for the duration of the call.
    let mut stats: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(path.as_ptr(), &mut stats) } != 0 {
        return None;
    }
    #[allow(clippy::unnecessary_cast)] // the field types differ by platform
    Some((stats.f_bavail as u64).saturating_mul(stats.f_frsize as u64))
}

/// An I/O failure as a status: a full disk is `ResourceExhausted`.
fn io_status(doing: &str, error: &std::io::Error) -> Status {
    if error.raw_os_error() == Some(libc::ENOSPC) {
        Status::resource_exhausted(format!(
            "put: the storage node's disk is full ({doing}): {error}"
        ))
    } else {
        Status::internal(format!("put: cannot {doing}: {error}"))
    }
}

/// Run [`REMOVE_SLICES_ACTION`](sieve_format::writes::REMOVE_SLICES_ACTION).
pub fn remove_slices(catalog: &NodeCatalog, body: &[u8]) -> Result<usize, Status> {
    let request: RemoveSlices = serde_json::from_slice(body).map_err(|error| {
        Status::invalid_argument(format!("remove-slices: bad request: {error}"))
    })?;
    if parse_storage_name(&request.table).is_none() {
        return Err(Status::invalid_argument(format!(
            "remove-slices: '{}' is not a table a user owns",
            request.table.chars().take(80).collect::<String>()
        )));
    }
    catalog
        .remove_slices(&request.table, &request.slices)
        .map_err(|error| Status::internal(format!("remove-slices: {error}")))
}

/// Run [`RETAIN_SLICES_ACTION`](sieve_format::writes::RETAIN_SLICES_ACTION):
/// every slice of an owned table not listed is removed. Returns the count.
pub fn retain_slices(catalog: &NodeCatalog, body: &[u8]) -> Result<usize, Status> {
    let request: RetainSlices = serde_json::from_slice(body).map_err(|error| {
        Status::invalid_argument(format!("retain-slices: bad request: {error}"))
    })?;
    let mut removed = 0;
    for (name, table) in catalog.tables().iter() {
        if parse_storage_name(name).is_none() {
            continue;
        }
        let keep = request.tables.get(name);
        let doomed: Vec<u32> = table
            .slices
            .keys()
            .copied()
            .filter(|slice| keep.is_none_or(|keep| !keep.contains(slice)))
            .collect();
        removed += catalog
            .remove_slices(name, &doomed)
            .map_err(|error| Status::internal(format!("retain-slices: {error}")))?;
    }
    Ok(removed)
}

/// Remove what interrupted puts left in the owned tables' directories of
/// `root` (their temporary files); called when the node starts.
pub fn remove_temporaries(root: &Path) -> std::io::Result<usize> {
    let mut removed = 0;
    for table in std::fs::read_dir(root)? {
        let table = table?;
        let name = table.file_name().to_string_lossy().into_owned();
        if parse_storage_name(&name).is_none() || !table.file_type()?.is_dir() {
            continue;
        }
        for entry in std::fs::read_dir(table.path())? {
            let entry = entry?;
            let file = entry.file_name().to_string_lossy().into_owned();
            if file.starts_with('.') && file.ends_with(".tmp") && entry.file_type()?.is_file() {
                std::fs::remove_file(entry.path())?;
                removed += 1;
            }
        }
    }
    Ok(removed)
}
