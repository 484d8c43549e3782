//! Random tables for the differential fuzzer: schemas, data and slices.
//!
//! A schema seed gives two to four tables (`t0` .. `t3`). Each has a unique,
//! non-null `Int64` column `id` (1 to the row count, sorted or shuffled), one
//! or two integer join keys drawn from a pool shared by the schema's tables
//! (`k1`, `k2`, `fkey`, `pkey`: the same name has the same type in every
//! table, and the names ending in `key` get Bloom filters from the slice
//! layout), and four to ten columns of random types. Values are kept small
//! enough that no sum, product by a small constant, or `abs` can overflow, so
//! that no query can fail on some rows in one engine and not in the other.
//!
//! Each table is written as one to four slices (some empty) with a small
//! layout, so that row-group, page-index and Bloom-filter pruning all run,
//! spread round robin over [`NODES`] node directories and copied, byte for
//! byte, to the next node (a replica).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;

use arrow::array::{
    ArrayRef, BooleanArray, Date32Array, Decimal128Array, Float32Array, Float64Array, Int16Array,
    Int32Array, Int64Array, Int8Array, StringArray, TimestampMicrosecondArray, UInt16Array,
    UInt32Array, UInt64Array, UInt8Array,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use arrow::record_batch::RecordBatch;
use datafusion::common::{DataFusionError, Result};
use sieve_format::{copy_slice, node_directory, slice_path, write_slice, SliceLayout};

use super::rng::SeededRandom;

/// Storage-node directories the slices are spread over.
pub const NODES: usize = 3;

/// Upper bound on the rows of one table: large enough for several row groups
/// and dozens of pages with the small layouts below, small enough that a
/// join of two such tables on a skewed key still runs in milliseconds once
/// the query generator has bounded it (see `queries.rs`).
pub const TABLE_ROWS_MAX: usize = 3000;

/// Upper bound on the slices of one table.
const SLICES_PER_TABLE_MAX: usize = 4;

/// The names of the schema's join keys. Names ending in `key` get a Bloom
/// filter in every slice; the others do not, so both pruning paths run.
pub const KEY_NAMES: [&str; 4] = ["k1", "k2", "fkey", "pkey"];

/// A text column every table ends with: a name per row, most unique, some
/// shared by several rows, some NULL (names as TPC-H's `s_name` or
/// `c_name` are, one per key). Generated from its own random stream after
/// the other columns, and left out of the scopes other query shapes draw
/// from, so that the tables' other columns and the queries of those
/// shapes stay what they were for a seed; `queries.rs` groups by it over
/// joins on `id` (what `GroupByTableKey` rewrites).
pub(super) const NAME_COLUMN: &str = "name";

/// Largest value of a sparse key: wide enough that sparse keys rarely
/// match, small enough for an `Int16` key column.
const SPARSE_KEY_MAX: i64 = 30_000;

/// The value most rows of a skewed key take.
const SKEWED_HOT_VALUE: i64 = 7;

/// How a join key's values are spread over a table's rows (before NULLs,
/// which every distribution may get on top).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyDistribution {
    /// Every value of `0..rows` once, shuffled: a unique key.
    Dense,
    /// Uniform over `0..=30000`: mostly unique, rarely matching other tables.
    Sparse,
    /// Seven rows in ten take one value (7), the rest spread over `0..100`.
    Skewed,
    /// Uniform over `0..20`: many duplicates.
    Narrow,
    /// NULL in every row.
    AllNull,
}

/// One column of a random table.
#[derive(Debug, Clone)]
pub struct ColumnSpec {
    /// The column's name, unique in its table.
    pub name: String,
    /// Its Arrow type.
    pub data_type: DataType,
    /// Percentage of NULL rows (0, 1, 10 or 50; `id` never has NULLs).
    pub null_percent: u32,
    /// For a join key, how its values are spread.
    pub key: Option<KeyDistribution>,
    /// For a float column, whether NaN, -0.0 and the infinities occur.
    pub special_floats: bool,
}

/// One random table: its columns, rows and how it is cut into slices.
#[derive(Debug, Clone)]
pub struct TableSpec {
    /// `t0` .. `t3`.
    pub name: String,
    /// Columns, `id` first, then the join keys, then the others.
    pub columns: Vec<ColumnSpec>,
    /// Rows of each slice, in slice order; they sum to the table's rows.
    pub slice_rows: Vec<usize>,
    /// The layout every slice of the table is written with.
    pub layout: SliceLayout,
    /// Whether `id` ascends with the row order (otherwise it is shuffled).
    pub ids_sorted: bool,
}

impl TableSpec {
    /// Rows of the table.
    pub fn rows(&self) -> usize {
        self.slice_rows.iter().sum()
    }

    /// The Arrow schema of the table.
    pub fn schema(&self) -> SchemaRef {
        Arc::new(Schema::new(
            self.columns
                .iter()
                .map(|column| {
                    Field::new(&column.name, column.data_type.clone(), column.name != "id")
                })
                .collect::<Vec<_>>(),
        ))
    }
}

/// A table with its data, and its join keys' values for the query
/// generator's estimate of join sizes.
#[derive(Debug)]
pub struct FuzzTable {
    /// What the table is.
    pub spec: TableSpec,
    /// All of its rows, in slice order.
    pub batch: RecordBatch,
    /// The values of each join key column (by name), NULL as `None`.
    pub key_values: BTreeMap<String, Vec<Option<i64>>>,
}

/// The tables of one schema seed.
#[derive(Debug)]
pub struct FuzzSchema {
    /// The seed the tables were generated from.
    pub seed: u64,
    /// The tables, `t0` first.
    pub tables: Vec<FuzzTable>,
}

impl FuzzSchema {
    /// Generate the tables of `seed`: the same seed always gives the same
    /// tables, row for row.
    pub fn generate(seed: u64) -> Result<Self> {
        let mut random = SeededRandom::new(seed);
        // Integer keys of mixed widths, or (one schema in four) keys all of
        // one other type, so that every two keys can be joined.
        let key_types: Vec<DataType> = if random.percent(25) {
            let types = [
                DataType::Float64,
                DataType::Utf8,
                DataType::Date32,
                DataType::Decimal128(12, 2),
            ];
            vec![types[random.below(types.len())].clone(); KEY_NAMES.len()]
        } else {
            KEY_NAMES
                .iter()
                .map(|_| {
                    let types = [
                        DataType::Int64,
                        DataType::Int32,
                        DataType::Int16,
                        DataType::UInt32,
                        DataType::UInt64,
                    ];
                    types[random.weighted(&[5, 4, 1, 1, 1])].clone()
                })
                .collect()
        };
        let table_count = 2 + random.below(3);
        let mut tables = Vec::with_capacity(table_count);
        for index in 0..table_count {
            let mut spec = random_table_spec(&mut random, index, &key_types);
            spec.columns.push(ColumnSpec {
                name: NAME_COLUMN.into(),
                data_type: DataType::Utf8,
                null_percent: NAME_NULL_PERCENT,
                key: None,
                special_floats: false,
            });
            let names_seed = SeededRandom::derive_seed(seed ^ NAMES_SEED, index as u64);
            tables.push(fill_table(&mut random, spec, names_seed)?);
        }
        Ok(Self { seed, tables })
    }

    /// The table names, `t0` first.
    pub fn table_names(&self) -> Vec<&str> {
        self.tables
            .iter()
            .map(|table| table.spec.name.as_str())
            .collect()
    }

    /// Write every table's slices under `root` (`root/node-K/TABLE/...`),
    /// each slice on two of the [`NODES`] nodes.
    pub fn write(&self, root: &Path) -> Result<()> {
        for node in 0..NODES {
            std::fs::create_dir_all(node_directory(root, node))?;
        }
        for (table_index, table) in self.tables.iter().enumerate() {
            let schema = table.batch.schema();
            let mut offset = 0;
            for (slice_index, &rows) in table.spec.slice_rows.iter().enumerate() {
                let part = slice_index + 1;
                let first_node = (table_index + part) % NODES;
                let path = slice_path(&node_directory(root, first_node), &table.spec.name, part);
                let slice = table.batch.slice(offset, rows);
                offset += rows;
                write_slice(&path, &schema, &table.spec.layout, [Ok(slice)])?;
                let replica = slice_path(
                    &node_directory(root, (first_node + 1) % NODES),
                    &table.spec.name,
                    part,
                );
                copy_slice(&path, &replica)?;
            }
        }
        Ok(())
    }

    /// Load every table through the write path of `session`'s table
    /// catalog, as a user's `CREATE TABLE` and `INSERT` do: the same
    /// slices (an empty one is none), each sent to two nodes and committed
    /// with the table, in one version per table.
    pub async fn load(&self, session: &sieve_compute::SieveSession) -> Result<()> {
        use sieve_compute::tables::{Change, TableLayout, TableWriter};
        let Some(owned) = &session.catalog.owned else {
            return Err(DataFusionError::Plan(
                "loading fuzz tables needs a session with a table catalog".to_string(),
            ));
        };
        for table in &self.tables {
            let spec = &table.spec;
            let layout = TableLayout {
                sort_key: vec![],
                replicas: 2.min(NODES),
                slice_rows: spec.slice_rows.iter().copied().max().unwrap_or(1).max(1) as u64,
                row_group_rows: spec.layout.row_group_rows_max as u64,
                page_rows: spec.layout.data_page_rows_max as u64,
                planned: true,
                copy_of: None,
            };
            let statement = format!("fuzz: load {}", spec.name);
            let (entry, _) = owned.store().create_table(
                &spec.name,
                &table.batch.schema(),
                &layout,
                false,
                &statement,
            )?;
            let mut writer = TableWriter::new(Arc::clone(owned), entry);
            let mut offset = 0;
            for &rows in &spec.slice_rows {
                let written = async {
                    writer.write(table.batch.slice(offset, rows)).await?;
                    writer.end_slice().await
                }
                .await;
                offset += rows;
                if let Err(error) = written {
                    writer.abandon().await;
                    return Err(error);
                }
            }
            let change = Change {
                publish: true,
                ..Change::default()
            };
            writer.commit(change, &statement).await?;
        }
        // A sorted copy of each table, by the last of its columns whose
        // order a copy can use: scans read it where it skips more slices
        // (`sieve_compute::copies`), in every mode but NDP off.
        for table in &self.tables {
            let spec = &table.spec;
            let Some(column) = spec.columns.iter().rev().find(|column| {
                column.name != "id"
                    && column.name != NAME_COLUMN
                    && (column.data_type.is_integer()
                        || matches!(
                            column.data_type,
                            DataType::Date32 | DataType::Utf8 | DataType::Decimal128(_, _)
                        ))
            }) else {
                continue;
            };
            session
                .sql(&format!(
                    "CREATE TABLE {0}_sorted WITH (copy_of = '{0}', sort_key = '{1}')",
                    spec.name, column.name
                ))
                .await?
                .collect()
                .await?;
        }
        Ok(())
    }

    /// The tables' parameters, one line per column: what a reproduction
    /// needs besides the seed.
    pub fn describe(&self) -> String {
        let mut text = String::new();
        for table in &self.tables {
            let spec = &table.spec;
            let _ = writeln!(
                text,
                "  {}: {} rows, slices {:?}, row groups <= {} rows, pages <= {} rows, ids {}",
                spec.name,
                spec.rows(),
                spec.slice_rows,
                spec.layout.row_group_rows_max,
                spec.layout.data_page_rows_max,
                if spec.ids_sorted {
                    "sorted"
                } else {
                    "shuffled"
                },
            );
            for column in &spec.columns {
                let mut notes = Vec::new();
                if column.null_percent > 0 {
                    notes.push(format!("{}% NULL", column.null_percent));
                }
                if let Some(distribution) = column.key {
                    notes.push(format!("{distribution:?} key"));
                }
                if column.special_floats {
                    notes.push("NaN, -0.0, +/-inf".to_string());
                }
                let _ = writeln!(
                    text,
                    "    {} {}{}",
                    column.name,
                    column.data_type,
                    if notes.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", notes.join(", "))
                    }
                );
            }
        }
        text
    }
}

/// The types a non-key column is drawn from, with their weights.
fn random_column_type(random: &mut SeededRandom) -> DataType {
    let types = [
        (DataType::Int8, 1),
        (DataType::Int16, 1),
        (DataType::Int32, 2),
        (DataType::Int64, 3),
        (DataType::UInt8, 1),
        (DataType::UInt16, 1),
        (DataType::UInt32, 1),
        (DataType::UInt64, 1),
        (DataType::Decimal128(9, 2), 2),
        (DataType::Decimal128(18, 4), 1),
        (DataType::Decimal128(38, 6), 1),
        (DataType::Decimal128(25, 0), 1),
        (DataType::Float32, 1),
        (DataType::Float64, 3),
        (DataType::Utf8, 4),
        (DataType::Date32, 2),
        (DataType::Timestamp(TimeUnit::Microsecond, None), 1),
        (DataType::Boolean, 2),
    ];
    let weights: Vec<u32> = types.iter().map(|(_, weight)| *weight).collect();
    types[random.weighted(&weights)].0.clone()
}

/// A short tag of a type for column names (`c3_dec38`).
fn type_tag(data_type: &DataType) -> String {
    match data_type {
        DataType::Int8 => "i8".into(),
        DataType::Int16 => "i16".into(),
        DataType::Int32 => "i32".into(),
        DataType::Int64 => "i64".into(),
        DataType::UInt8 => "u8".into(),
        DataType::UInt16 => "u16".into(),
        DataType::UInt32 => "u32".into(),
        DataType::UInt64 => "u64".into(),
        DataType::Decimal128(precision, _) => format!("dec{precision}"),
        DataType::Float32 => "f32".into(),
        DataType::Float64 => "f64".into(),
        DataType::Utf8 => "str".into(),
        DataType::Date32 => "date".into(),
        DataType::Timestamp(..) => "ts".into(),
        DataType::Boolean => "bool".into(),
        other => other.to_string().to_lowercase(),
    }
}

fn random_null_percent(random: &mut SeededRandom) -> u32 {
    [0, 1, 10, 50][random.weighted(&[4, 2, 3, 2])]
}

fn random_table_spec(random: &mut SeededRandom, index: usize, key_types: &[DataType]) -> TableSpec {
    let mut columns = vec![ColumnSpec {
        name: "id".into(),
        data_type: DataType::Int64,
        null_percent: 0,
        key: None,
        special_floats: false,
    }];
    let mut key_indexes: Vec<usize> = (0..KEY_NAMES.len()).collect();
    random.shuffle(&mut key_indexes);
    let key_count = 1 + random.below(2);
    key_indexes.truncate(key_count);
    key_indexes.sort_unstable();
    for key_index in key_indexes {
        let distributions = [
            KeyDistribution::Dense,
            KeyDistribution::Sparse,
            KeyDistribution::Skewed,
            KeyDistribution::Narrow,
            KeyDistribution::AllNull,
        ];
        let distribution = distributions[random.weighted(&[4, 2, 2, 3, 1])];
        columns.push(ColumnSpec {
            name: KEY_NAMES[key_index].into(),
            data_type: key_types[key_index].clone(),
            null_percent: if distribution == KeyDistribution::AllNull {
                100
            } else {
                random_null_percent(random)
            },
            key: Some(distribution),
            special_floats: false,
        });
    }
    let other_count = 4 + random.below(7);
    for number in 0..other_count {
        let data_type = random_column_type(random);
        let special_floats =
            matches!(data_type, DataType::Float32 | DataType::Float64) && random.percent(60);
        columns.push(ColumnSpec {
            name: format!("c{number}_{}", type_tag(&data_type)),
            data_type,
            null_percent: random_null_percent(random),
            key: None,
            special_floats,
        });
    }
    let rows = match random.weighted(&[2, 3, 8, 7, 4]) {
        0 => 0,
        1 => random.between(1, 20) as usize,
        2 => random.between(20, 300) as usize,
        3 => random.between(300, 1200) as usize,
        _ => random.between(1200, TABLE_ROWS_MAX as i64) as usize,
    };
    let slice_count = 1 + random.below(SLICES_PER_TABLE_MAX);
    let mut cuts: Vec<usize> = (1..slice_count).map(|_| random.below(rows + 1)).collect();
    cuts.sort_unstable();
    let mut slice_rows = Vec::with_capacity(slice_count + 1);
    let mut previous = 0;
    for cut in cuts {
        slice_rows.push(cut - previous);
        previous = cut;
    }
    slice_rows.push(rows - previous);
    if slice_rows.len() < SLICES_PER_TABLE_MAX && random.percent(20) {
        let at = random.below(slice_rows.len() + 1);
        slice_rows.insert(at, 0);
    }
    let layout = SliceLayout {
        row_group_rows_max: random.between(256, 1024) as usize,
        data_page_rows_max: random.between(64, 256) as usize,
        ..SliceLayout::default()
    };
    TableSpec {
        name: format!("t{index}"),
        columns,
        slice_rows,
        layout,
        ids_sorted: random.percent(50),
    }
}

/// Strings with the edges a string function or LIKE can trip on: empty,
/// multibyte UTF-8, case variants, and `%` and `_` inside the value. None
/// contains `|`, which separates cells in the compared text.
const STRINGS: [&str; 24] = [
    "",
    "a",
    "A",
    "ab",
    "abc",
    "Abc",
    "ABC",
    "b",
    "ba",
    "x%y",
    "a_b",
    "100%",
    "_x",
    "%",
    "_",
    "żółw",
    "Żółw",
    "ŻÓŁW",
    "日本",
    "日本語",
    "naïve",
    "straße",
    " pad ",
    "MiXeD",
];

/// Characters random short strings are made of.
const STRING_CHARACTERS: [char; 12] = ['a', 'b', 'c', 'x', 'A', 'B', '%', '_', 'ó', '日', ' ', '1'];

fn random_string(random: &mut SeededRandom) -> String {
    match random.weighted(&[6, 4, 1]) {
        0 => random.pick(&STRINGS).to_string(),
        1 => (0..random.below(7))
            .map(|_| *random.pick(&STRING_CHARACTERS))
            .collect(),
        _ => {
            // A long value (200+ characters) with a multibyte character inside.
            let word = random.pick(&STRINGS);
            format!("{word}-{}-żółw-{}", "long".repeat(50), random.below(1000))
        }
    }
}

fn random_float(random: &mut SeededRandom, special_floats: bool) -> f64 {
    if special_floats && random.percent(12) {
        return *random.pick(&[f64::NAN, -0.0, 0.0, f64::INFINITY, f64::NEG_INFINITY]);
    }
    // Multiples of 0.01: sums differ between orders only in the last bits.
    random.between(-100_000, 100_000) as f64 / 100.0
}

/// The key values of a column of `rows` rows, before NULLs.
fn key_values(random: &mut SeededRandom, distribution: KeyDistribution, rows: usize) -> Vec<i64> {
    match distribution {
        KeyDistribution::Dense => {
            let mut values: Vec<i64> = (0..rows as i64).collect();
            random.shuffle(&mut values);
            values
        }
        KeyDistribution::Sparse => (0..rows)
            .map(|_| random.between(0, SPARSE_KEY_MAX))
            .collect(),
        KeyDistribution::Skewed => (0..rows)
            .map(|_| {
                if random.percent(70) {
                    SKEWED_HOT_VALUE
                } else {
                    random.between(0, 99)
                }
            })
            .collect(),
        KeyDistribution::Narrow => (0..rows).map(|_| random.between(0, 19)).collect(),
        KeyDistribution::AllNull => vec![0; rows],
    }
}

fn nulls(random: &mut SeededRandom, percent: u32, rows: usize) -> Vec<bool> {
    (0..rows)
        .map(|_| percent >= 100 || (percent > 0 && random.below(100) < percent as usize))
        .collect()
}

fn with_nulls<T>(values: Vec<T>, nulls: &[bool]) -> Vec<Option<T>> {
    values
        .into_iter()
        .zip(nulls)
        .map(|(value, &null)| (!null).then_some(value))
        .collect()
}

/// A join key column of `data_type` from its key values, one to one, so
/// that two rows join exactly when their values are equal: integers as
/// they are; floats halved, with the hot skewed value as NaN and 0 as 0.0
/// (`zeros` 0), -0.0 (1) or both in turn (2) (a join matches -0.0 with 0.0,
/// and NaN with NaN); texts as `key00042`; dates as days; decimals as
/// `42.25`.
fn key_column(data_type: &DataType, values: &[Option<i64>], zeros: usize) -> Result<ArrayRef> {
    Ok(match data_type {
        DataType::Float64 => Arc::new(Float64Array::from_iter(values.iter().enumerate().map(
            |(row, value)| {
                value.map(|value| match value {
                    SKEWED_HOT_VALUE => f64::NAN,
                    0 if zeros == 1 || (zeros == 2 && row % 2 == 1) => -0.0,
                    value => value as f64 * 0.5,
                })
            },
        ))),
        DataType::Utf8 => Arc::new(StringArray::from_iter(
            values
                .iter()
                .map(|value| value.map(|value| format!("key{value:05}"))),
        )),
        DataType::Date32 => Arc::new(Date32Array::from_iter(
            values.iter().map(|value| value.map(|value| value as i32)),
        )),
        DataType::Decimal128(precision, scale) => Arc::new(
            Decimal128Array::from_iter(
                values
                    .iter()
                    .map(|value| value.map(|value| value as i128 * 100 + 25)),
            )
            .with_precision_and_scale(*precision, *scale)?,
        ),
        integer => integer_column(integer, values.to_vec())?,
    })
}

fn integer_column(data_type: &DataType, values: Vec<Option<i64>>) -> Result<ArrayRef> {
    fn narrow<T: TryFrom<i64>>(values: Vec<Option<i64>>) -> Result<Vec<Option<T>>> {
        values
            .into_iter()
            .map(|value| {
                value
                    .map(|value| {
                        T::try_from(value).map_err(|_| {
                            DataFusionError::Internal(format!(
                                "fuzz value {value} does not fit its column"
                            ))
                        })
                    })
                    .transpose()
            })
            .collect()
    }
    Ok(match data_type {
        DataType::Int8 => Arc::new(Int8Array::from(narrow::<i8>(values)?)),
        DataType::Int16 => Arc::new(Int16Array::from(narrow::<i16>(values)?)),
        DataType::Int32 => Arc::new(Int32Array::from(narrow::<i32>(values)?)),
        DataType::Int64 => Arc::new(Int64Array::from(values)),
        DataType::UInt8 => Arc::new(UInt8Array::from(narrow::<u8>(values)?)),
        DataType::UInt16 => Arc::new(UInt16Array::from(narrow::<u16>(values)?)),
        DataType::UInt32 => Arc::new(UInt32Array::from(narrow::<u32>(values)?)),
        DataType::UInt64 => Arc::new(UInt64Array::from(narrow::<u64>(values)?)),
        other => {
            return Err(DataFusionError::Internal(format!(
                "{other} is not an integer type"
            )))
        }
    })
}

/// The range of a non-key integer column: small enough that `x * 7`,
/// `x + 100` and a sum over every row stay inside the type (unsigned
/// columns are never subtracted from).
fn integer_range(random: &mut SeededRandom, data_type: &DataType) -> (i64, i64) {
    match data_type {
        DataType::Int8 => (-15, 15),
        DataType::Int16 => (-1000, 1000),
        DataType::Int32 => (-100_000, 100_000),
        DataType::Int64 if random.percent(50) => (-1_000_000_000_000, 1_000_000_000_000),
        DataType::Int64 => (-1000, 1000),
        DataType::UInt8 => (0, 30),
        DataType::UInt16 => (0, 1000),
        DataType::UInt32 => (0, 100_000),
        _ => (0, 1_000_000_000_000),
    }
}

fn random_column(
    random: &mut SeededRandom,
    column: &ColumnSpec,
    rows: usize,
    ids: &[i64],
) -> Result<(ArrayRef, Option<Vec<Option<i64>>>)> {
    if column.name == "id" {
        return Ok((Arc::new(Int64Array::from(ids.to_vec())), None));
    }
    let nulls = nulls(random, column.null_percent, rows);
    if let Some(distribution) = column.key {
        let values = with_nulls(key_values(random, distribution, rows), &nulls);
        let zeros = random.below(3);
        let array = key_column(&column.data_type, &values, zeros)?;
        return Ok((array, Some(values)));
    }
    let array: ArrayRef = match &column.data_type {
        data_type @ (DataType::Int8
        | DataType::Int16
        | DataType::Int32
        | DataType::Int64
        | DataType::UInt8
        | DataType::UInt16
        | DataType::UInt32
        | DataType::UInt64) => {
            let (low, high) = integer_range(random, data_type);
            let values = (0..rows).map(|_| random.between(low, high)).collect();
            integer_column(data_type, with_nulls(values, &nulls))?
        }
        DataType::Decimal128(precision, scale) => {
            // Unscaled values with at most precision - 3 digits, so that a
            // sum over every row and a product by a small constant still fit.
            let digits = u32::from(*precision).saturating_sub(3).min(18);
            let bound = 10i64.pow(digits) - 1;
            let values = (0..rows)
                .map(|_| {
                    let value = random.between(-bound, bound) as i128;
                    if *precision > 18 && random.percent(30) {
                        value * 1_000_000
                    } else {
                        value
                    }
                })
                .collect();
            Arc::new(
                Decimal128Array::from(with_nulls(values, &nulls))
                    .with_precision_and_scale(*precision, *scale)?,
            )
        }
        DataType::Float32 => {
            let values = (0..rows)
                .map(|_| random_float(random, column.special_floats) as f32)
                .collect();
            Arc::new(Float32Array::from(with_nulls(values, &nulls)))
        }
        DataType::Float64 => {
            let values = (0..rows)
                .map(|_| random_float(random, column.special_floats))
                .collect();
            Arc::new(Float64Array::from(with_nulls(values, &nulls)))
        }
        DataType::Utf8 => {
            let values: Vec<String> = (0..rows).map(|_| random_string(random)).collect();
            Arc::new(StringArray::from(with_nulls(values, &nulls)))
        }
        DataType::Date32 => {
            // 1967-10 to 2026-02: a few dates before the epoch.
            let values = (0..rows)
                .map(|_| random.between(-800, 20_500) as i32)
                .collect();
            Arc::new(Date32Array::from(with_nulls(values, &nulls)))
        }
        DataType::Timestamp(TimeUnit::Microsecond, None) => {
            // 1969-12 to 2030-03, with microseconds.
            let values = (0..rows)
                .map(|_| {
                    random.between(-3_000_000, 1_900_000_000) * 1_000_000
                        + random.between(0, 999_999)
                })
                .collect();
            Arc::new(TimestampMicrosecondArray::from(with_nulls(values, &nulls)))
        }
        DataType::Boolean => {
            let bias = random.between(10, 90) as u32;
            let values = (0..rows).map(|_| random.percent(bias)).collect();
            Arc::new(BooleanArray::from(with_nulls(values, &nulls)))
        }
        other => {
            return Err(DataFusionError::Internal(format!(
                "the fuzzer does not generate {other} columns"
            )))
        }
    };
    Ok((array, None))
}

/// Rows in a hundred whose name is NULL.
const NAME_NULL_PERCENT: u32 = 10;

/// Rows in a hundred whose name is one of a few shared by many rows.
const NAME_SHARED_PERCENT: u32 = 15;

/// Mixed into the schema seed for the names' own random stream.
const NAMES_SEED: u64 = 0x6e61_6d65_735f_7365;

/// The [`NAME_COLUMN`] of a table whose ids are `ids`: `name-<id>` for most
/// rows, one of `name-1` .. `name-5` (also some other row's own name) for
/// [`NAME_SHARED_PERCENT`], NULL for [`NAME_NULL_PERCENT`].
fn name_column(seed: u64, ids: &[i64]) -> ArrayRef {
    let mut random = SeededRandom::new(seed);
    let names: Vec<Option<String>> = ids
        .iter()
        .map(|id| {
            let draw = random.below(100) as u32;
            if draw < NAME_NULL_PERCENT {
                None
            } else if draw < NAME_NULL_PERCENT + NAME_SHARED_PERCENT {
                Some(format!("name-{}", 1 + random.below(5)))
            } else {
                Some(format!("name-{id}"))
            }
        })
        .collect();
    Arc::new(StringArray::from(names))
}

fn fill_table(random: &mut SeededRandom, spec: TableSpec, names_seed: u64) -> Result<FuzzTable> {
    let rows = spec.rows();
    let mut ids: Vec<i64> = (1..=rows as i64).collect();
    if !spec.ids_sorted {
        random.shuffle(&mut ids);
    }
    let mut arrays = Vec::with_capacity(spec.columns.len());
    let mut key_values = BTreeMap::new();
    for column in &spec.columns {
        if column.name == NAME_COLUMN {
            arrays.push(name_column(names_seed, &ids));
            continue;
        }
        let (array, keys) = random_column(random, column, rows, &ids)?;
        arrays.push(array);
        if let Some(keys) = keys {
            key_values.insert(column.name.clone(), keys);
        }
    }
    let batch = RecordBatch::try_new(spec.schema(), arrays)?;
    Ok(FuzzTable {
        spec,
        batch,
        key_values,
    })
}
