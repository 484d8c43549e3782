//! The layout planner: per column, the encoding and codec that a storage
//! node reads fastest (HippogriffDB's compression planner).
//!
//! A storage node spends its time decoding the pages a query reads, and
//! reading them from its disk. Today's fixed layout (dictionary encoding and
//! zstd(1) on every column) keeps the bytes few; it does not keep decoding
//! cheap. The planner measures instead of guessing: it takes a sample of the
//! slice's rows (runs of whole pages, spread over the slice, so sort order and
//! runs survive), writes each column of it under every encoding and codec
//! its Parquet type allows, reads each back, and keeps, per column, the one
//! whose read costs least:
//!
//! ```text
//!   cost(column, candidate) = bytes(candidate) / read rate + decode time(candidate)
//! ```
//!
//! with the read rate of a storage node's disk
//! ([`PlannerSettings::read_bytes_per_second`]). Among candidates within
//! [`COST_TIE`] of the cheapest, the one with the fewest bytes wins: bytes
//! count on disk and, with NDP off, on the network. Bloom filters go on the
//! columns equality and joins target (names ending in `key`, and the sort
//! key) unless the sample shows so few distinct values that every row group
//! holds them all ([`BLOOM_DISTINCT_MIN`]). The plan is recorded in the
//! slice's key-value metadata ([`LAYOUT_PLAN_KEY`]); Parquet records each
//! column chunk's encodings and codec itself, so a reader needs nothing else.

use std::sync::Arc;
use std::time::Instant;

use arrow::array::RecordBatch;
use arrow::datatypes::{Schema, SchemaRef};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::{ArrowSchemaConverter, ArrowWriter};
use parquet::basic::{Compression, Encoding, Type as PhysicalType, ZstdLevel};
use parquet::errors::{ParquetError, Result};
use parquet::file::properties::{EnabledStatistics, WriterProperties, WriterPropertiesBuilder};
use parquet::schema::types::ColumnPath;
use serde::{Deserialize, Serialize};

/// Key of the Parquet key-value metadata entry holding the slice's
/// [`LayoutPlan`] (JSON), for a planned slice.
pub const LAYOUT_PLAN_KEY: &str = "sieve.layout_plan";

/// Candidates whose cost is within this factor of the cheapest one's are
/// told apart by their bytes: measured decode times vary by a few percent
/// from run to run.
pub const COST_TIE: f64 = 1.10;

/// A key column whose sample holds at most this many distinct values gets no
/// Bloom filter: a row group of a slice holds every one of them, so the
/// filter never rules one out (the page statistics do what can be done).
pub const BLOOM_DISTINCT_MIN: usize = 1024;

/// Samples smaller than this are not planned: the fixed layout is used
/// (a few rows say nothing of how a column compresses).
pub const PLAN_SAMPLE_ROWS_MIN: usize = 4096;

/// How a column's values are encoded in its data pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ColumnEncoding {
    /// A dictionary page and RLE/bit-packed indexes (plain where the
    /// dictionary outgrows its page).
    Dictionary,
    /// Values as they are.
    Plain,
    /// Deltas, bit-packed (integers).
    DeltaBinaryPacked,
    /// The bytes of the values split into streams (floats).
    ByteStreamSplit,
    /// Lengths delta-encoded, then the bytes (strings).
    DeltaLengthByteArray,
    /// Prefixes shared with the value before, then suffixes (strings).
    DeltaByteArray,
}

/// The codec a column's pages are compressed with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ColumnCodec {
    /// No compression: decoding reads the page as it is.
    Uncompressed,
    /// LZ4 (raw blocks): a few bytes fewer for little decode time.
    Lz4Raw,
    /// zstd at level 1: the fixed layout's codec.
    Zstd1,
}

impl ColumnCodec {
    fn compression(self) -> Compression {
        match self {
            Self::Uncompressed => Compression::UNCOMPRESSED,
            Self::Lz4Raw => Compression::LZ4_RAW,
            Self::Zstd1 => Compression::ZSTD(ZstdLevel::try_new(1).expect("level 1 is valid")),
        }
    }
}

const CODECS: [ColumnCodec; 3] = [
    ColumnCodec::Uncompressed,
    ColumnCodec::Lz4Raw,
    ColumnCodec::Zstd1,
];

/// What the planner needs to know of the storage it plans for.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannerSettings {
    /// Bytes per second a storage node reads from its disk: a byte read
    /// costs `1 / read_bytes_per_second` seconds, against decoding time.
    pub read_bytes_per_second: f64,
    /// Rows of the slice the candidates are measured on, at most.
    pub sample_rows: usize,
    /// Rows per data page (the table's page size): the sample is taken in
    /// runs of this many rows.
    pub page_rows: usize,
    /// Each candidate is decoded this many times; the fastest counts.
    pub decode_runs: usize,
}

impl Default for PlannerSettings {
    fn default() -> Self {
        Self {
            // An NVMe drive reads 2 to 3 GB/s, a SATA SSD 0.5; a storage
            // node serving several queries gets a share of it.
            read_bytes_per_second: 1.0e9,
            sample_rows: 32_768,
            page_rows: 4096,
            decode_runs: 3,
        }
    }
}

/// The planner's choice for one column, with what it measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ColumnPlan {
    /// Column name.
    pub column: String,
    /// Encoding chosen.
    pub encoding: ColumnEncoding,
    /// Codec chosen.
    pub codec: ColumnCodec,
    /// Whether the column gets a Bloom filter.
    pub bloom_filter: bool,
    /// Encoded bytes per row of the sample, as chosen.
    pub bytes_per_row: f64,
    /// Decode time per row of the sample, as chosen, in nanoseconds.
    pub decode_ns_per_row: f64,
    /// The same two figures under the fixed layout (dictionary, zstd(1)).
    pub fixed_bytes_per_row: f64,
    /// See [`Self::fixed_bytes_per_row`].
    pub fixed_decode_ns_per_row: f64,
}

/// The planner's choices for the columns of one slice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayoutPlan {
    /// Rows the choices were measured on.
    pub sample_rows: usize,
    /// The read rate the costs assumed ([`PlannerSettings`]).
    pub read_bytes_per_second: f64,
    /// One entry per column the planner chose for (columns it leaves, such
    /// as booleans, keep the fixed layout).
    pub columns: Vec<ColumnPlan>,
}

impl LayoutPlan {
    /// `builder` with this plan's per-column settings: they take precedence
    /// over the table-wide ones it holds.
    pub fn apply(&self, mut builder: WriterPropertiesBuilder) -> WriterPropertiesBuilder {
        for plan in &self.columns {
            let path = ColumnPath::from(plan.column.as_str());
            builder = apply_candidate(builder, path.clone(), plan.encoding, plan.codec);
            builder = builder.set_column_bloom_filter_enabled(path, plan.bloom_filter);
        }
        builder
    }

    /// The plan as the JSON [`LAYOUT_PLAN_KEY`] holds.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a layout plan is JSON")
    }
}

fn apply_candidate(
    builder: WriterPropertiesBuilder,
    path: ColumnPath,
    encoding: ColumnEncoding,
    codec: ColumnCodec,
) -> WriterPropertiesBuilder {
    let builder = builder.set_column_compression(path.clone(), codec.compression());
    let encoding = match encoding {
        ColumnEncoding::Dictionary => {
            return builder.set_column_dictionary_enabled(path, true);
        }
        ColumnEncoding::Plain => Encoding::PLAIN,
        ColumnEncoding::DeltaBinaryPacked => Encoding::DELTA_BINARY_PACKED,
        ColumnEncoding::ByteStreamSplit => Encoding::BYTE_STREAM_SPLIT,
        ColumnEncoding::DeltaLengthByteArray => Encoding::DELTA_LENGTH_BYTE_ARRAY,
        ColumnEncoding::DeltaByteArray => Encoding::DELTA_BYTE_ARRAY,
    };
    builder
        .set_column_dictionary_enabled(path.clone(), false)
        .set_column_encoding(path, encoding)
}

/// The encodings Parquet allows for a column of `physical` type that are
/// worth measuring and that common readers decode; empty for types the
/// planner leaves to the fixed layout.
fn encodings_for(physical: PhysicalType) -> &'static [ColumnEncoding] {
    use ColumnEncoding::*;
    match physical {
        // Byte-stream-split only for floats: Parquet allows it for integers
        // and fixed-length values since format 2.11, but readers lag (DuckDB
        // 1.4 refuses such files), and slices must stay readable by them.
        PhysicalType::INT32 | PhysicalType::INT64 => &[Dictionary, Plain, DeltaBinaryPacked],
        PhysicalType::FLOAT | PhysicalType::DOUBLE => &[Dictionary, Plain, ByteStreamSplit],
        PhysicalType::BYTE_ARRAY => &[Dictionary, Plain, DeltaLengthByteArray, DeltaByteArray],
        PhysicalType::FIXED_LEN_BYTE_ARRAY => &[Dictionary, Plain],
        PhysicalType::BOOLEAN | PhysicalType::INT96 => &[],
    }
}

/// Rows of `batches` to measure on: all of them if they are at most
/// `settings.sample_rows`, else runs of `settings.page_rows` rows spread
/// evenly over them (whole pages, so the order within pages survives).
pub fn sample(
    schema: &SchemaRef,
    batches: &[RecordBatch],
    settings: &PlannerSettings,
) -> Result<RecordBatch> {
    let total: usize = batches.iter().map(RecordBatch::num_rows).sum();
    let arrow = |error: arrow::error::ArrowError| ParquetError::External(Box::new(error));
    if total <= settings.sample_rows {
        return arrow::compute::concat_batches(schema, batches).map_err(arrow);
    }
    let run = settings.page_rows.clamp(1, settings.sample_rows.max(1));
    let runs = (settings.sample_rows / run).max(1);
    let stride = total / runs;
    let mut pieces = Vec::with_capacity(runs * 2);
    for index in 0..runs {
        let mut start = index * stride;
        let mut wanted = run.min(total - start);
        for batch in batches {
            if wanted == 0 {
                break;
            }
            if start >= batch.num_rows() {
                start -= batch.num_rows();
                continue;
            }
            let take = wanted.min(batch.num_rows() - start);
            pieces.push(batch.slice(start, take));
            wanted -= take;
            start = 0;
        }
    }
    arrow::compute::concat_batches(schema, &pieces).map_err(arrow)
}

/// Plan the layout of a slice from `sample` (see [`sample`]). `bloom_columns`
/// are the columns that get a Bloom filter under the fixed layout (key
/// columns and the sort key). `None` if the sample is too small to plan on
/// ([`PLAN_SAMPLE_ROWS_MIN`]).
pub fn plan_layout(
    sample: &RecordBatch,
    bloom_columns: &[String],
    settings: &PlannerSettings,
) -> Result<Option<LayoutPlan>> {
    let rows = sample.num_rows();
    if rows < PLAN_SAMPLE_ROWS_MIN {
        return Ok(None);
    }
    let schema = sample.schema();
    // Tables hold no nested columns; a schema with one is left to the fixed
    // layout (its leaves do not line up with the top-level columns).
    if schema
        .fields()
        .iter()
        .any(|field| field.data_type().is_nested())
    {
        return Ok(None);
    }
    let descriptor = ArrowSchemaConverter::new().convert(&schema)?;
    let mut columns = Vec::new();
    for (index, field) in schema.fields().iter().enumerate() {
        let leaf = descriptor.column(index);
        let encodings = encodings_for(leaf.physical_type());
        if encodings.is_empty() {
            continue;
        }
        let one = Arc::new(Schema::new(vec![field.as_ref().clone()]));
        let batch = RecordBatch::try_new(Arc::clone(&one), vec![Arc::clone(sample.column(index))])
            .map_err(|error| ParquetError::External(Box::new(error)))?;
        let mut measured: Vec<(ColumnEncoding, ColumnCodec, Measure)> = Vec::new();
        for &encoding in encodings {
            for codec in CODECS {
                // A candidate the writer refuses for this type is not one.
                if let Ok(measure) = measure(&batch, encoding, codec, settings) {
                    measured.push((encoding, codec, measure));
                }
            }
        }
        let Some(fixed) = measured
            .iter()
            .find(|(encoding, codec, _)| {
                *encoding == ColumnEncoding::Dictionary && *codec == ColumnCodec::Zstd1
            })
            .map(|(_, _, measure)| *measure)
        else {
            continue;
        };
        let cost = |measure: &Measure| {
            measure.bytes as f64 / settings.read_bytes_per_second * 1e9 + measure.decode_ns
        };
        let cheapest = measured
            .iter()
            .map(|(_, _, measure)| cost(measure))
            .fold(f64::INFINITY, f64::min);
        let (encoding, codec, chosen) = measured
            .iter()
            .filter(|(_, _, measure)| cost(measure) <= cheapest * COST_TIE)
            .min_by_key(|(_, _, measure)| measure.bytes)
            .copied()
            .expect("the cheapest candidate is within the tie of itself");
        let bloom_filter = bloom_columns.iter().any(|name| name == field.name())
            && distinct_values(sample.column(index))? > BLOOM_DISTINCT_MIN;
        columns.push(ColumnPlan {
            column: field.name().clone(),
            encoding,
            codec,
            bloom_filter,
            bytes_per_row: chosen.bytes as f64 / rows as f64,
            decode_ns_per_row: chosen.decode_ns / rows as f64,
            fixed_bytes_per_row: fixed.bytes as f64 / rows as f64,
            fixed_decode_ns_per_row: fixed.decode_ns / rows as f64,
        });
    }
    Ok(Some(LayoutPlan {
        sample_rows: rows,
        read_bytes_per_second: settings.read_bytes_per_second,
        columns,
    }))
}

#[derive(Debug, Clone, Copy)]
struct Measure {
    /// Encoded bytes of the column chunk: pages, headers, dictionary.
    bytes: u64,
    /// Fastest decode of the whole sample, in nanoseconds.
    decode_ns: f64,
}

/// Write `batch` (one column) under `encoding` and `codec`, with the page
/// settings slices have, and time reading it back.
fn measure(
    batch: &RecordBatch,
    encoding: ColumnEncoding,
    codec: ColumnCodec,
    settings: &PlannerSettings,
) -> Result<Measure> {
    let path = ColumnPath::from(batch.schema().field(0).name().as_str());
    let page_rows = settings.page_rows.max(1);
    let builder = WriterProperties::builder()
        .set_max_row_group_row_count(Some(batch.num_rows().max(1)))
        .set_data_page_row_count_limit(page_rows)
        .set_write_batch_size(1024.min(page_rows))
        .set_statistics_enabled(EnabledStatistics::Page);
    let properties = apply_candidate(builder, path, encoding, codec).build();
    let mut buffer = Vec::new();
    let mut writer = ArrowWriter::try_new(&mut buffer, batch.schema(), Some(properties))?;
    writer.write(batch)?;
    let metadata = writer.close()?;
    let bytes: i64 = metadata
        .row_groups()
        .iter()
        .map(|group| group.column(0).compressed_size())
        .sum();
    let file = bytes::Bytes::from(buffer);
    let mut fastest = f64::INFINITY;
    for _ in 0..settings.decode_runs.max(1) {
        let reader = ParquetRecordBatchReaderBuilder::try_new(file.clone())?
            .with_batch_size(8192)
            .build()?;
        let start = Instant::now();
        let mut rows = 0;
        for decoded in reader {
            rows += decoded
                .map_err(|error| ParquetError::External(Box::new(error)))?
                .num_rows();
        }
        let elapsed = start.elapsed().as_nanos() as f64;
        if rows != batch.num_rows() {
            return Err(ParquetError::General(format!(
                "the planner read back {rows} rows of {}",
                batch.num_rows()
            )));
        }
        fastest = fastest.min(elapsed);
    }
    Ok(Measure {
        bytes: u64::try_from(bytes).unwrap_or(0),
        decode_ns: fastest,
    })
}

/// Distinct values of `column`, counted through Arrow's row format.
fn distinct_values(column: &arrow::array::ArrayRef) -> Result<usize> {
    let arrow = |error: arrow::error::ArrowError| ParquetError::External(Box::new(error));
    let converter =
        arrow::row::RowConverter::new(vec![arrow::row::SortField::new(column.data_type().clone())])
            .map_err(arrow)?;
    let rows = converter
        .convert_columns(&[Arc::clone(column)])
        .map_err(arrow)?;
    let distinct: std::collections::HashSet<_> = rows.iter().collect();
    Ok(distinct.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Array, Float64Array, Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field};

    fn table(rows: usize) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("o_orderkey", DataType::Int64, false),
            Field::new("o_status", DataType::Utf8, true),
            Field::new("o_price", DataType::Float64, true),
            Field::new("o_flag", DataType::Boolean, false),
        ]));
        let keys = Int64Array::from_iter_values((0..rows as i64).map(|row| row * 4));
        let status = StringArray::from_iter(
            (0..rows).map(|row| (row % 97 != 0).then(|| ["F", "O", "P"][row % 3])),
        );
        // Pseudo-random prices: no dictionary helps them.
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let prices = Float64Array::from_iter((0..rows).map(|row| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (row % 50 != 0).then(|| (state % 10_000_000) as f64 / 100.0)
        }));
        let flags = arrow::array::BooleanArray::from_iter((0..rows).map(|row| Some(row % 2 == 0)));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(keys),
                Arc::new(status),
                Arc::new(prices),
                Arc::new(flags),
            ],
        )
        .unwrap()
    }

    #[test]
    fn a_sample_takes_whole_runs_spread_over_the_batches() {
        let batch = table(100_000);
        let schema = batch.schema();
        let batches: Vec<_> = (0..10)
            .map(|part| batch.slice(part * 10_000, 10_000))
            .collect();
        let settings = PlannerSettings {
            sample_rows: 16_384,
            page_rows: 4096,
            ..PlannerSettings::default()
        };
        let sampled = sample(&schema, &batches, &settings).unwrap();
        assert_eq!(sampled.num_rows(), 16_384);
        let keys = sampled
            .column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap();
        // Four runs of 4096 rows, starting a quarter of the rows apart, each
        // crossing batch boundaries in order.
        for run in 0..4 {
            let first = (run * 25_000) as i64 * 4;
            assert_eq!(keys.value(run * 4096), first);
            assert_eq!(keys.value(run * 4096 + 4095), first + 4095 * 4);
        }
        let small = sample(&schema, &batches[..1], &settings).unwrap();
        assert_eq!(small.num_rows(), 10_000);
    }

    #[test]
    fn a_plan_chooses_for_every_plannable_column_and_records_the_fixed_layout() {
        let batch = table(20_000);
        let plan = plan_layout(
            &batch,
            &["o_orderkey".to_string()],
            &PlannerSettings::default(),
        )
        .unwrap()
        .expect("20,000 rows are planned");
        let names: Vec<_> = plan
            .columns
            .iter()
            .map(|plan| plan.column.as_str())
            .collect();
        // Booleans keep the fixed layout.
        assert_eq!(names, ["o_orderkey", "o_status", "o_price"]);
        let column = |name: &str| {
            plan.columns
                .iter()
                .find(|plan| plan.column == name)
                .unwrap()
        };
        assert!(column("o_orderkey").bloom_filter);
        // Where bytes dominate the cost (a disk of 1 MB/s), the choice is
        // the smallest. At the default rate it also weighs the decode time
        // measured in this run, which a loaded machine skews, so the byte
        // claims are checked here.
        let slow_disk = PlannerSettings {
            read_bytes_per_second: 1.0e6,
            ..PlannerSettings::default()
        };
        let by_bytes = plan_layout(&batch, &["o_orderkey".to_string()], &slow_disk)
            .unwrap()
            .expect("20,000 rows are planned");
        let smallest = |name: &str| {
            by_bytes
                .columns
                .iter()
                .find(|plan| plan.column == name)
                .unwrap()
        };
        // Distinct keys in steps of 4: no dictionary can hold them in fewer
        // bytes than their deltas.
        assert_ne!(smallest("o_orderkey").encoding, ColumnEncoding::Dictionary);
        // Three values: nothing beats a dictionary's indexes for bytes.
        assert!(
            smallest("o_status").bytes_per_row < 1.0,
            "{:?}",
            smallest("o_status")
        );
        // At any rate, the plan is never more than the tie away from the
        // cheapest.
        for plan in &plan.columns {
            assert!(plan.bytes_per_row > 0.0 && plan.fixed_bytes_per_row > 0.0);
            assert!(plan.decode_ns_per_row > 0.0 && plan.fixed_decode_ns_per_row > 0.0);
            let cost = |bytes: f64, ns: f64| {
                bytes / PlannerSettings::default().read_bytes_per_second * 1e9 + ns
            };
            // The choice costs at most the tie above the fixed layout's
            // (measured in the same run, as one of the candidates).
            assert!(
                cost(plan.bytes_per_row, plan.decode_ns_per_row)
                    <= cost(plan.fixed_bytes_per_row, plan.fixed_decode_ns_per_row)
                        * COST_TIE
                        * 1.0001,
                "{plan:?}"
            );
        }
        let json = plan.to_json();
        let back: LayoutPlan = serde_json::from_str(&json).unwrap();
        assert_eq!(back, plan);
    }

    #[test]
    fn a_planned_slice_reads_back_the_rows_written_whatever_was_chosen() {
        let batch = table(20_000);
        let schema = batch.schema();
        for encoding in [
            ColumnEncoding::Dictionary,
            ColumnEncoding::Plain,
            ColumnEncoding::ByteStreamSplit,
        ] {
            for codec in CODECS {
                let plan = LayoutPlan {
                    sample_rows: 20_000,
                    read_bytes_per_second: 1e9,
                    columns: ["o_orderkey", "o_price"]
                        .iter()
                        .map(|name| ColumnPlan {
                            column: name.to_string(),
                            encoding,
                            codec,
                            bloom_filter: true,
                            bytes_per_row: 0.0,
                            decode_ns_per_row: 0.0,
                            fixed_bytes_per_row: 0.0,
                            fixed_decode_ns_per_row: 0.0,
                        })
                        .collect(),
                };
                let properties = plan
                    .apply(WriterProperties::builder().set_data_page_row_count_limit(1024))
                    .build();
                let mut buffer = Vec::new();
                let mut writer =
                    ArrowWriter::try_new(&mut buffer, Arc::clone(&schema), Some(properties))
                        .unwrap();
                writer.write(&batch).unwrap();
                writer.close().unwrap();
                let reader = ParquetRecordBatchReaderBuilder::try_new(bytes::Bytes::from(buffer))
                    .unwrap()
                    .build()
                    .unwrap();
                let read: Vec<_> = reader.map(|batch| batch.unwrap()).collect();
                let read = arrow::compute::concat_batches(&schema, &read).unwrap();
                assert_eq!(read, batch, "{encoding:?} {codec:?}");
                assert_eq!(read.column(2).null_count(), batch.column(2).null_count());
            }
        }
    }

    #[test]
    fn a_small_sample_is_not_planned() {
        let plan = plan_layout(&table(100), &[], &PlannerSettings::default()).unwrap();
        assert!(plan.is_none());
    }
}
