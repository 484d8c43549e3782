//! Page checksums: a CRC-32 of every page of a slice, as stored, kept in the
//! slice's footer, so that every reader can tell a page that changed on disk
//! from a page that was written.
//!
//! ```text
//!   PAR1 | dict | page | page | ... | bloom | column index | offset index | footer | len | PAR1
//!          ^crc   ^crc   ^crc                                                ^ "sieve.page_crc32":
//!                                                                              one crc per page, in
//!                                                                              row group, column, page order
//! ```
//!
//! A page is the bytes the offset index locates (`offset ..
//! offset + compressed_page_size`, header included), and a column chunk's
//! dictionary page is the bytes from its dictionary page offset to its first
//! data page. The checksums are added after the file is written: the footer
//! comes after every page and every index, so rewriting it with one more
//! key-value entry moves nothing that any offset points at ([`add_page_checksums`]
//! checks that, by reading the result back).
//!
//! Parquet's own page CRC (`PageHeader.crc`) is not used: parquet 59 checks
//! it but does not write it, and adding it afterwards grows every page
//! header, which moves every page and every offset of the file.
//!
//! Invariant: a reader verifies only whole pages. A read that covers part of
//! a page is widened to whole pages first ([`PageChecksums::widen`]).
//!
//! ```
//! use sieve_format::PageChecksums;
//! // Two pages: bytes 4..10 and 10..20 of a file.
//! let data: Vec<u8> = (0..20).collect();
//! let checksums = PageChecksums::from_pages(vec![
//!     (4..10, crc32fast::hash(&data[4..10])),
//!     (10..20, crc32fast::hash(&data[10..20])),
//! ]);
//! assert_eq!(checksums.widen(6..12), 4..20);
//! assert!(checksums.verify("f.parquet", 4, &data[4..20]).is_ok());
//! let mut flipped = data.clone();
//! flipped[15] ^= 1;
//! let error = checksums.verify("f.parquet", 4, &flipped[4..20]).unwrap_err();
//! assert_eq!(error.page_offset, 10);
//! ```

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::Path;

use parquet::errors::{ParquetError, Result};
use parquet::file::metadata::{
    FileMetaData, KeyValue, PageIndexPolicy, ParquetMetaData, ParquetMetaDataReader,
    ParquetMetaDataWriter,
};

/// Key of the Parquet key-value metadata entry holding the CRC-32 of every
/// page of the slice: eight lowercase hex digits per page, in row group,
/// column, page order (a column's dictionary page before its data pages).
pub const PAGE_CHECKSUMS_KEY: &str = "sieve.page_crc32";

/// Digits of one checksum in [`PAGE_CHECKSUMS_KEY`].
const CHECKSUM_DIGITS: usize = 8;

/// A page whose bytes do not match the checksum written with it: the copy of
/// the slice on this node is damaged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageCorruption {
    /// The slice file, as the reader names it.
    pub file: String,
    /// Offset of the page in the file.
    pub page_offset: u64,
    /// Length of the page, header included.
    pub page_bytes: u64,
    /// What went wrong.
    pub reason: String,
}

impl std::fmt::Display for PageCorruption {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            formatter,
            "corrupt slice file {}: page at byte {} ({} bytes): {}",
            self.file, self.page_offset, self.page_bytes, self.reason
        )
    }
}

impl std::error::Error for PageCorruption {}

/// Find a [`PageCorruption`] in the chain of sources of `error`.
pub fn find_page_corruption<'a>(
    error: &'a (dyn std::error::Error + 'static),
) -> Option<&'a PageCorruption> {
    let mut current: Option<&'a (dyn std::error::Error + 'static)> = Some(error);
    // Source chains are short; the bound only guards against a cycle.
    for _ in 0..32 {
        let error = current?;
        if let Some(corruption) = error.downcast_ref::<PageCorruption>() {
            return Some(corruption);
        }
        if let Some(ParquetError::External(inner)) = error.downcast_ref::<ParquetError>() {
            if let Some(corruption) = inner.downcast_ref::<PageCorruption>() {
                return Some(corruption);
            }
        }
        current = error.source();
    }
    None
}

/// The checksummed pages of one slice, sorted by offset and disjoint.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PageChecksums {
    pages: Vec<(Range<u64>, u32)>,
}

impl PageChecksums {
    /// Checksums of the given pages (sorted here by offset).
    pub fn from_pages(mut pages: Vec<(Range<u64>, u32)>) -> Self {
        pages.sort_by_key(|(range, _)| range.start);
        Self { pages }
    }

    /// The checksums recorded in `metadata` (which must carry the offset
    /// index): `Ok(None)` for a slice written without them (before page
    /// checksums existed), an error when they are there but do not fit the
    /// file's pages.
    pub fn from_metadata(metadata: &ParquetMetaData) -> Result<Option<Self>> {
        let Some(value) = metadata
            .file_metadata()
            .key_value_metadata()
            .and_then(|entries| entries.iter().find(|entry| entry.key == PAGE_CHECKSUMS_KEY))
            .and_then(|entry| entry.value.as_deref())
        else {
            return Ok(None);
        };
        let ranges = page_ranges(metadata)?;
        if value.len() != ranges.len() * CHECKSUM_DIGITS {
            return Err(ParquetError::General(format!(
                "{PAGE_CHECKSUMS_KEY} holds {} characters for {} pages",
                value.len(),
                ranges.len()
            )));
        }
        let mut pages = Vec::with_capacity(ranges.len());
        for (index, range) in ranges.into_iter().enumerate() {
            let digits = value
                .get(index * CHECKSUM_DIGITS..(index + 1) * CHECKSUM_DIGITS)
                .ok_or_else(|| {
                    ParquetError::General(format!("{PAGE_CHECKSUMS_KEY} is not ASCII"))
                })?;
            let crc = u32::from_str_radix(digits, 16)
                .map_err(|error| ParquetError::General(format!("{PAGE_CHECKSUMS_KEY}: {error}")))?;
            pages.push((range, crc));
        }
        let checksums = Self::from_pages(pages);
        if checksums
            .pages
            .windows(2)
            .any(|pair| pair[0].0.end > pair[1].0.start)
        {
            return Err(ParquetError::General(
                "the slice's pages overlap".to_string(),
            ));
        }
        Ok(Some(checksums))
    }

    /// Number of checksummed pages.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// Whether no page is checksummed.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// `range` grown to the whole pages it overlaps, so that every page it
    /// touches can be verified.
    pub fn widen(&self, range: Range<u64>) -> Range<u64> {
        let mut widened = range.clone();
        // The first page that ends after the range starts.
        let first = self
            .pages
            .partition_point(|(page, _)| page.end <= range.start);
        for (page, _) in &self.pages[first..] {
            if page.start >= range.end {
                break;
            }
            widened.start = widened.start.min(page.start);
            widened.end = widened.end.max(page.end);
        }
        widened
    }

    /// Verify every whole page inside `bytes`, which were read from `file`
    /// at `offset`. Pages only partly inside are not checked (widen the
    /// read first).
    pub fn verify(
        &self,
        file: &str,
        offset: u64,
        bytes: &[u8],
    ) -> std::result::Result<(), PageCorruption> {
        let end = offset + bytes.len() as u64;
        let first = self.pages.partition_point(|(page, _)| page.start < offset);
        for (page, crc) in &self.pages[first..] {
            if page.end > end {
                break;
            }
            let start = (page.start - offset) as usize;
            let stop = (page.end - offset) as usize;
            let found = crc32fast::hash(&bytes[start..stop]);
            if found != *crc {
                return Err(PageCorruption {
                    file: file.to_string(),
                    page_offset: page.start,
                    page_bytes: page.end - page.start,
                    reason: format!(
                        "checksum mismatch (written crc32 {crc:08x}, read {found:08x})"
                    ),
                });
            }
        }
        Ok(())
    }
}

/// The byte ranges of every page of a slice (dictionary pages and data
/// pages), in row group, column, page order. `metadata` must carry the
/// offset index.
pub fn page_ranges(metadata: &ParquetMetaData) -> Result<Vec<Range<u64>>> {
    // A slice without rows has no row group, no page and no offset index.
    if metadata.row_groups().is_empty() {
        return Ok(Vec::new());
    }
    let offset_index = metadata
        .offset_index()
        .ok_or_else(|| ParquetError::General("the slice has no offset index".to_string()))?;
    let mut ranges = Vec::new();
    for (group, row_group) in metadata.row_groups().iter().enumerate() {
        let columns = offset_index.get(group).ok_or_else(|| {
            ParquetError::General(format!("row group {group} has no offset index"))
        })?;
        for (column, chunk) in row_group.columns().iter().enumerate() {
            let index = columns.get(column).ok_or_else(|| {
                ParquetError::General(format!(
                    "column {column} of row group {group} has no offset index"
                ))
            })?;
            let locations = index.page_locations();
            if let (Some(dictionary), Some(first)) =
                (chunk.dictionary_page_offset(), locations.first())
            {
                if dictionary < 0 || dictionary >= first.offset {
                    return Err(ParquetError::General(format!(
                        "column {column} of row group {group}: dictionary page at {dictionary} is not before its first data page at {}",
                        first.offset
                    )));
                }
                ranges.push(dictionary as u64..first.offset as u64);
            }
            for location in locations {
                if location.offset < 0 || location.compressed_page_size < 0 {
                    return Err(ParquetError::General(format!(
                        "column {column} of row group {group}: page location {location:?} is negative"
                    )));
                }
                let start = location.offset as u64;
                ranges.push(start..start + location.compressed_page_size as u64);
            }
        }
    }
    Ok(ranges)
}

/// Add [`PAGE_CHECKSUMS_KEY`] to the Parquet file at `path`: read its pages
/// back, checksum them, and rewrite the footer with the checksums. Nothing
/// before the footer moves; the result is read back and checked.
pub fn add_page_checksums(path: &Path) -> Result<()> {
    let file = OpenOptions::new().read(true).write(true).open(path)?;
    let metadata = ParquetMetaDataReader::new()
        .with_page_index_policy(PageIndexPolicy::Required)
        .parse_and_finish(&file)?;
    let ranges = page_ranges(&metadata)?;
    let checksums = checksum_pages(&file, &ranges)?;
    let footer_start = footer_start(&file)?;

    let old = metadata.file_metadata();
    let mut entries: Vec<KeyValue> = old
        .key_value_metadata()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|entry| entry.key != PAGE_CHECKSUMS_KEY)
        .collect();
    entries.push(KeyValue::new(PAGE_CHECKSUMS_KEY.to_string(), checksums));
    let file_metadata = FileMetaData::new(
        old.version(),
        old.num_rows(),
        old.created_by().map(str::to_string),
        Some(entries),
        old.schema_descr_ptr(),
        old.column_orders().cloned(),
    );
    // Without its page indexes, the metadata writer writes the footer only,
    // keeping every offset (pages, indexes, Bloom filters) as it was.
    let rewritten = ParquetMetaData::new(file_metadata, metadata.row_groups().to_vec());
    let mut file = file;
    file.set_len(footer_start)?;
    file.seek(SeekFrom::Start(footer_start))?;
    ParquetMetaDataWriter::new(&mut file, &rewritten).finish()?;
    file.flush()?;
    drop(file);

    // The other side of the rewrite: the same pages, now checksummed.
    let file = File::open(path)?;
    let reread = ParquetMetaDataReader::new()
        .with_page_index_policy(PageIndexPolicy::Required)
        .parse_and_finish(&file)?;
    if page_ranges(&reread)? != ranges {
        return Err(ParquetError::General(format!(
            "{}: rewriting the footer moved the pages",
            path.display()
        )));
    }
    let checked = PageChecksums::from_metadata(&reread)?.ok_or_else(|| {
        ParquetError::General(format!(
            "{}: the rewritten footer has no checksums",
            path.display()
        ))
    })?;
    if checked.len() != ranges.len() {
        return Err(ParquetError::General(format!(
            "{}: {} checksums for {} pages",
            path.display(),
            checked.len(),
            ranges.len()
        )));
    }
    Ok(())
}

/// The checksums of `ranges` of `file`, as [`PAGE_CHECKSUMS_KEY`] stores them.
fn checksum_pages(file: &File, ranges: &[Range<u64>]) -> Result<String> {
    let mut value = String::with_capacity(ranges.len() * CHECKSUM_DIGITS);
    let mut buffer = Vec::new();
    for range in ranges {
        buffer.resize((range.end - range.start) as usize, 0);
        file.read_exact_at(&mut buffer, range.start)?;
        value.push_str(&format!("{:08x}", crc32fast::hash(&buffer)));
    }
    Ok(value)
}

/// Where the footer (Thrift metadata, its length, `PAR1`) of `file` starts.
fn footer_start(file: &File) -> Result<u64> {
    let bytes = file.metadata()?.len();
    if bytes < 12 {
        return Err(ParquetError::General(format!(
            "a file of {bytes} bytes is too short to be Parquet"
        )));
    }
    let mut tail = [0u8; 8];
    file.read_exact_at(&mut tail, bytes - 8)?;
    let length = u64::from(u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]));
    if &tail[4..] != b"PAR1" || length + 12 > bytes {
        return Err(ParquetError::General(
            "the file has no valid Parquet footer".to_string(),
        ));
    }
    Ok(bytes - 8 - length)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use arrow::record_batch::RecordBatch;

    use super::*;
    use crate::{write_slice, SliceLayout};

    fn written_slice(directory: &Path) -> std::path::PathBuf {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k_key", DataType::Int64, false),
            Field::new("name", DataType::Utf8, false),
        ]));
        let rows = 20_000i64;
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from_iter_values(0..rows)),
                Arc::new(StringArray::from_iter_values(
                    (0..rows).map(|row| format!("name {}", row % 97)),
                )),
            ],
        )
        .unwrap();
        let layout = SliceLayout {
            row_group_rows_max: 8192,
            data_page_rows_max: 1024,
            ..SliceLayout::default()
        };
        let path = directory.join("t").join("t-00001.parquet");
        write_slice(&path, &schema, &layout, [Ok(batch)]).unwrap();
        path
    }

    fn read_metadata(path: &Path) -> ParquetMetaData {
        ParquetMetaDataReader::new()
            .with_page_index_policy(PageIndexPolicy::Required)
            .parse_and_finish(&File::open(path).unwrap())
            .unwrap()
    }

    #[test]
    fn a_written_slice_checksums_every_page_and_a_flipped_byte_is_found() {
        let directory = std::env::temp_dir().join(format!("sieve-checksum-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&directory);
        let path = written_slice(&directory);
        let metadata = read_metadata(&path);
        let checksums = PageChecksums::from_metadata(&metadata).unwrap().unwrap();
        let ranges = page_ranges(&metadata).unwrap();
        // 3 row groups x 2 columns, 8 pages each at most, plus the dictionaries.
        assert!(ranges.len() > 12, "{} pages", ranges.len());
        assert_eq!(checksums.len(), ranges.len());
        // The file as written reads back clean, page by page and in one piece.
        let mut bytes = std::fs::read(&path).unwrap();
        for range in &ranges {
            let page = &bytes[range.start as usize..range.end as usize];
            checksums
                .verify("t-00001.parquet", range.start, page)
                .unwrap();
        }
        checksums.verify("t-00001.parquet", 0, &bytes).unwrap();
        // And the data is unchanged by the footer rewrite.
        let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReader::try_new(
            File::open(&path).unwrap(),
            4096,
        )
        .unwrap();
        let rows: usize = reader.map(|batch| batch.unwrap().num_rows()).sum();
        assert_eq!(rows, 20_000);

        // One flipped byte inside the data page in the middle of the file.
        let victim = ranges[ranges.len() / 2].clone();
        let middle = ((victim.start + victim.end) / 2) as usize;
        bytes[middle] ^= 0x10;
        let error = checksums.verify("t-00001.parquet", 0, &bytes).unwrap_err();
        assert_eq!(error.page_offset, victim.start);
        assert!(error.to_string().contains("t-00001.parquet"), "{error}");
        // A read of part of that page is widened to the whole page, and fails.
        let widened = checksums.widen(middle as u64..middle as u64 + 1);
        assert_eq!(widened, victim);
        assert!(checksums
            .verify(
                "t-00001.parquet",
                widened.start,
                &bytes[widened.start as usize..widened.end as usize]
            )
            .is_err());
        std::fs::remove_dir_all(&directory).unwrap();
    }

    #[test]
    fn a_slice_without_checksums_is_unchecked_and_bad_checksums_are_an_error() {
        let directory =
            std::env::temp_dir().join(format!("sieve-checksum-old-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&directory);
        let path = written_slice(&directory);
        let metadata = read_metadata(&path);
        let file_metadata = metadata.file_metadata();
        let strip = |value: Option<&str>| {
            let entries: Vec<KeyValue> = file_metadata
                .key_value_metadata()
                .unwrap()
                .iter()
                .filter(|entry| entry.key != PAGE_CHECKSUMS_KEY)
                .cloned()
                .chain(
                    value.map(|value| KeyValue::new(PAGE_CHECKSUMS_KEY.into(), value.to_string())),
                )
                .collect();
            let file_metadata = FileMetaData::new(
                file_metadata.version(),
                file_metadata.num_rows(),
                None,
                Some(entries),
                file_metadata.schema_descr_ptr(),
                None,
            );
            ParquetMetaData::new(file_metadata, metadata.row_groups().to_vec())
                .into_builder()
                .set_offset_index(metadata.offset_index().cloned())
                .build()
        };
        assert_eq!(PageChecksums::from_metadata(&strip(None)).unwrap(), None);
        assert!(PageChecksums::from_metadata(&strip(Some("0badf00d"))).is_err());
        assert!(PageChecksums::from_metadata(&strip(Some("zz"))).is_err());
        std::fs::remove_dir_all(&directory).unwrap();
    }
}
