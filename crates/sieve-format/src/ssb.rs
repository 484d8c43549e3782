//! The Star Schema Benchmark (P. O'Neil, E. O'Neil, X. Chen, *Star Schema
//! Benchmark*, Revision 3, 2009): what the `ssb(...)` table function generates
//! and `sieve gen ssb` loads through the write path.
//!
//! SSB is TPC-H denormalised into one fact table, `lineorder` (TPC-H's
//! orders and lineitem joined), and four dimensions: `customer`, `supplier`,
//! `part` and `date`. Its generator (`ssb-dbgen`) is dbgen with other row
//! counts; there is none on crates.io. Sieve derives SSB from TPC-H's
//! generators (`tpchgen`, dbgen-identical), row by row:
//!
//! | SSB | rows | derived from |
//! |---|---|---|
//! | `lineorder` | ≈ 6,000,000 × SF | TPC-H `orders` ⋈ `lineitem` at SF, in order key order |
//! | `customer` | 30,000 × SF | the first 30,000 × SF rows of TPC-H `customer` |
//! | `supplier` | 2,000 × SF | the first 2,000 × SF rows of TPC-H `supplier` |
//! | `part` | 200,000 × ⌊1 + log₂ SF⌋ (SF < 1: 200,000 × SF) | the first rows of TPC-H `part` |
//! | `date` | 2,557 (1992-01-01 to 1998-12-31) | the calendar |
//!
//! - Keys are remapped into SSB's smaller domains: `lo_custkey` =
//!   (o_custkey − 1) mod customers + 1 (each customer has the same number of
//!   preimages, and keys divisible by 3 still have no orders, as in
//!   ssb-dbgen); `lo_suppkey` = (l_suppkey − 1) mod suppliers + 1;
//!   `lo_partkey` = (l_partkey − 1) × parts / TPC-H's parts + 1 (uniform to
//!   within one preimage). At SF 1 the part key is TPC-H's own.
//! - Money is integer cents, as in ssb-dbgen: `lo_extendedprice` = quantity ×
//!   the part's TPC-H retail price; `lo_supplycost` = 6/10 of that price
//!   (per unit); `lo_revenue` = extendedprice × (100 − discount) / 100;
//!   `lo_ordtotalprice` = Σ over the order's lines of revenue × (100 + tax)
//!   / 100. `lo_discount` (0 to 10) and `lo_tax` (0 to 8) are percent.
//! - Dates are `yyyymmdd` integers (`lo_orderdate`, `lo_commitdate`,
//!   `d_datekey`).
//! - `c_city` / `s_city`: the nation's name cut or padded to 9 characters
//!   and a digit 0 to 9 (ssb-dbgen's rule); the digit is a hash of the key,
//!   as TPC-H has no column to take it from. `p_mfgr` `MFGR#m`,
//!   `p_category` `MFGR#mn` and `p_brand1` `MFGR#mn` followed by 1 to 40
//!   come from TPC-H's `Manufacturer#m` and `Brand#mn`, with the brand
//!   number a hash of the key. `p_name` is TPC-H's first two words,
//!   `p_color` its first.
//! - The date table covers every day of the seven years (2,557; the spec's
//!   text says 2,556). `d_sellingseason` is Winter (January, February),
//!   Spring (March to May), Summer (June to August), Fall (September to
//!   November) or Christmas (December); `d_holidayfl` marks January 1,
//!   July 4, November 11 and December 25; weeks are numbered from January 1
//!   (`(day of year − 1) / 7 + 1`) and start on Sunday (`d_daynuminweek` 1).
//!   None of the 13 queries reads the last three.

use std::sync::Arc;

use arrow::array::{ArrayRef, Int32Builder, Int64Builder, StringViewBuilder};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow::error::ArrowError;
use arrow::record_batch::RecordBatch;
use tpchgen::generators::{
    CustomerGenerator, LineItemGenerator, NationGenerator, OrderGenerator, PartGenerator,
    RegionGenerator, SupplierGenerator,
};

/// Rows per generated Arrow batch.
const GENERATE_BATCH_ROWS: usize = 8192;

/// First and last year of SSB's calendar (TPC-H's order dates).
const FIRST_YEAR: i32 = 1992;
const LAST_YEAR: i32 = 1998;

/// One SSB table: its name and how a load sorts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SsbTable {
    /// Table name, as the queries spell it.
    pub name: &'static str,
    /// The columns a load sorts each slice by (a table's `sort_key`).
    pub sort_key: &'static str,
}

/// The five SSB tables, dimensions first.
pub const SSB_TABLES: [SsbTable; 5] = [
    SsbTable {
        name: "date",
        sort_key: "d_datekey",
    },
    SsbTable {
        name: "customer",
        sort_key: "c_custkey",
    },
    SsbTable {
        name: "supplier",
        sort_key: "s_suppkey",
    },
    SsbTable {
        name: "part",
        sort_key: "p_partkey",
    },
    // By order date first, as ClickHouse's SSB table is: every query
    // restricts the date (through `date`), and the join filter's date range
    // then skips pages. Rows are generated in order key order; each slice is
    // sorted. Measured at SF 1 over 1 Gbit, NDP: 1.53 s -> 0.97 s in all
    // (docs/results/2026-11-25-issue19-part1.md).
    SsbTable {
        name: "lineorder",
        sort_key: "lo_orderdate,lo_orderkey",
    },
];

/// Batches of generated rows.
pub type GeneratedBatches = Box<dyn Iterator<Item = Result<RecordBatch, ArrowError>> + Send>;

/// Customers at `scale_factor`: 30,000 × SF (at least one).
pub fn ssb_customers(scale_factor: f64) -> i64 {
    ((30_000.0 * scale_factor).round() as i64).max(1)
}

/// Suppliers at `scale_factor`: 2,000 × SF (at least one).
pub fn ssb_suppliers(scale_factor: f64) -> i64 {
    ((2_000.0 * scale_factor).round() as i64).max(1)
}

/// Parts at `scale_factor`: 200,000 × ⌊1 + log₂ SF⌋, and 200,000 × SF below
/// SF 1 (at least one).
pub fn ssb_parts(scale_factor: f64) -> i64 {
    let parts = if scale_factor >= 1.0 {
        200_000.0 * (1.0 + scale_factor.log2()).floor()
    } else {
        (200_000.0 * scale_factor).round()
    };
    (parts as i64).max(1)
}

/// TPC-H's part count at `scale_factor` (what `l_partkey` ranges over).
fn tpch_parts(scale_factor: f64) -> i64 {
    ((200_000.0 * scale_factor) as i64).max(1)
}

impl SsbTable {
    /// The table called `name`, if SSB has one.
    pub fn named(name: &str) -> Option<SsbTable> {
        SSB_TABLES
            .iter()
            .find(|table| table.name.eq_ignore_ascii_case(name))
            .copied()
    }

    /// The table's schema.
    pub fn schema(&self) -> SchemaRef {
        let int = |name: &str| Field::new(name, DataType::Int32, false);
        let text = |name: &str| Field::new(name, DataType::Utf8View, false);
        let fields = match self.name {
            "date" => vec![
                int("d_datekey"),
                text("d_date"),
                text("d_dayofweek"),
                text("d_month"),
                int("d_year"),
                int("d_yearmonthnum"),
                text("d_yearmonth"),
                int("d_daynuminweek"),
                int("d_daynuminmonth"),
                int("d_daynuminyear"),
                int("d_monthnuminyear"),
                int("d_weeknuminyear"),
                text("d_sellingseason"),
                int("d_lastdayinweekfl"),
                int("d_lastdayinmonthfl"),
                int("d_holidayfl"),
                int("d_weekdayfl"),
            ],
            "customer" => vec![
                int("c_custkey"),
                text("c_name"),
                text("c_address"),
                text("c_city"),
                text("c_nation"),
                text("c_region"),
                text("c_phone"),
                text("c_mktsegment"),
            ],
            "supplier" => vec![
                int("s_suppkey"),
                text("s_name"),
                text("s_address"),
                text("s_city"),
                text("s_nation"),
                text("s_region"),
                text("s_phone"),
            ],
            "part" => vec![
                int("p_partkey"),
                text("p_name"),
                text("p_mfgr"),
                text("p_category"),
                text("p_brand1"),
                text("p_color"),
                text("p_type"),
                int("p_size"),
                text("p_container"),
            ],
            "lineorder" => vec![
                Field::new("lo_orderkey", DataType::Int64, false),
                int("lo_linenumber"),
                int("lo_custkey"),
                int("lo_partkey"),
                int("lo_suppkey"),
                int("lo_orderdate"),
                text("lo_orderpriority"),
                int("lo_shippriority"),
                int("lo_quantity"),
                int("lo_extendedprice"),
                int("lo_ordtotalprice"),
                int("lo_discount"),
                int("lo_revenue"),
                int("lo_supplycost"),
                int("lo_tax"),
                int("lo_commitdate"),
                text("lo_shipmode"),
            ],
            other => unreachable!("SSB_TABLES names only known tables, got {other}"),
        };
        Arc::new(Schema::new(fields))
    }

    /// Schema and batches of the table at `scale_factor`, in the order of its
    /// key (`lineorder`: of the order key).
    pub fn generate(&self, scale_factor: f64) -> (SchemaRef, GeneratedBatches) {
        let schema = self.schema();
        let rows: Box<dyn Iterator<Item = Row> + Send> = match self.name {
            "date" => Box::new(dates()),
            "customer" => Box::new(customers(scale_factor)),
            "supplier" => Box::new(suppliers(scale_factor)),
            "part" => Box::new(parts(scale_factor)),
            "lineorder" => Box::new(LineOrders::new(scale_factor)),
            other => unreachable!("SSB_TABLES names only known tables, got {other}"),
        };
        let batches = Batches {
            schema: Arc::clone(&schema),
            rows,
        };
        (schema, Box::new(batches))
    }
}

/// One generated row, column by column in the schema's order.
type Row = Vec<Value>;

enum Value {
    Int(i32),
    Long(i64),
    Text(String),
    Static(&'static str),
}

/// Rows gathered into batches of [`GENERATE_BATCH_ROWS`].
struct Batches {
    schema: SchemaRef,
    rows: Box<dyn Iterator<Item = Row> + Send>,
}

enum Column {
    Int(Int32Builder),
    Long(Int64Builder),
    Text(StringViewBuilder),
}

impl Iterator for Batches {
    type Item = Result<RecordBatch, ArrowError>;

    fn next(&mut self) -> Option<Self::Item> {
        let mut columns: Vec<Column> = self
            .schema
            .fields()
            .iter()
            .map(|field| match field.data_type() {
                DataType::Int32 => Column::Int(Int32Builder::with_capacity(GENERATE_BATCH_ROWS)),
                DataType::Int64 => Column::Long(Int64Builder::with_capacity(GENERATE_BATCH_ROWS)),
                _ => Column::Text(StringViewBuilder::with_capacity(GENERATE_BATCH_ROWS)),
            })
            .collect();
        let mut count = 0;
        for row in self.rows.by_ref().take(GENERATE_BATCH_ROWS) {
            for (column, value) in columns.iter_mut().zip(row) {
                match (column, value) {
                    (Column::Int(builder), Value::Int(value)) => builder.append_value(value),
                    (Column::Long(builder), Value::Long(value)) => builder.append_value(value),
                    (Column::Text(builder), Value::Text(value)) => builder.append_value(value),
                    (Column::Text(builder), Value::Static(value)) => builder.append_value(value),
                    _ => {
                        return Some(Err(ArrowError::InvalidArgumentError(
                            "an SSB row does not match its schema".to_string(),
                        )))
                    }
                }
            }
            count += 1;
        }
        if count == 0 {
            return None;
        }
        let arrays: Vec<ArrayRef> = columns
            .into_iter()
            .map(|column| -> ArrayRef {
                match column {
                    Column::Int(mut builder) => Arc::new(builder.finish()),
                    Column::Long(mut builder) => Arc::new(builder.finish()),
                    Column::Text(mut builder) => Arc::new(builder.finish()),
                }
            })
            .collect();
        Some(RecordBatch::try_new(Arc::clone(&self.schema), arrays))
    }
}

/// A well-mixed hash of `key` and `salt` (SplitMix64's finaliser): where a
/// TPC-H column has no counterpart (a city's digit, a brand's number).
fn mix(key: i64, salt: u64) -> u64 {
    let mut z = (key as u64) ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// TPC-H's nations: (name, region name), by nation key.
fn nations() -> Vec<(&'static str, &'static str)> {
    let regions: Vec<&'static str> = RegionGenerator::new(1.0, 1, 1)
        .into_iter()
        .map(|region| region.r_name)
        .collect();
    NationGenerator::new(1.0, 1, 1)
        .into_iter()
        .map(|nation| {
            let region = regions
                .get(nation.n_regionkey as usize)
                .copied()
                .unwrap_or("UNKNOWN");
            (nation.n_name, region)
        })
        .collect()
}

/// ssb-dbgen's city: the nation's name cut or padded to 9 characters, and a digit.
fn city(nation: &str, key: i64, salt: u64) -> String {
    format!("{nation:<9.9}{}", mix(key, salt) % 10)
}

fn customers(scale_factor: f64) -> impl Iterator<Item = Row> + Send {
    let nations = nations();
    let count = ssb_customers(scale_factor) as usize;
    // TPC-H's customer rows do not depend on the scale factor; its table at
    // SF is 150,000 × SF rows, more than SSB's 30,000 × SF.
    CustomerGenerator::new(scale_factor.max(1.0), 1, 1)
        .into_iter()
        .take(count)
        .map(move |customer| {
            let (nation, region) = nations[customer.c_nationkey as usize % nations.len()];
            vec![
                Value::Int(customer.c_custkey as i32),
                Value::Text(customer.c_name.to_string()),
                Value::Text(customer.c_address.to_string()),
                Value::Text(city(nation, customer.c_custkey, 1)),
                Value::Static(nation),
                Value::Static(region),
                Value::Text(customer.c_phone.to_string()),
                Value::Static(customer.c_mktsegment),
            ]
        })
}

fn suppliers(scale_factor: f64) -> impl Iterator<Item = Row> + Send {
    let nations = nations();
    let count = ssb_suppliers(scale_factor) as usize;
    SupplierGenerator::new(scale_factor.max(1.0), 1, 1)
        .into_iter()
        .take(count)
        .map(move |supplier| {
            let (nation, region) = nations[supplier.s_nationkey as usize % nations.len()];
            vec![
                Value::Int(supplier.s_suppkey as i32),
                Value::Text(supplier.s_name.to_string()),
                Value::Text(supplier.s_address.to_string()),
                Value::Text(city(nation, supplier.s_suppkey, 2)),
                Value::Static(nation),
                Value::Static(region),
                Value::Text(supplier.s_phone.to_string()),
            ]
        })
}

fn parts(scale_factor: f64) -> impl Iterator<Item = Row> + Send {
    let count = ssb_parts(scale_factor) as usize;
    // TPC-H has 200,000 × SF parts, at least SSB's count at every SF.
    PartGenerator::new(scale_factor.max(1.0), 1, 1)
        .into_iter()
        .take(count)
        .map(|part| {
            let name = part.p_name.to_string();
            let mut words = name.split(' ');
            let first = words.next().unwrap_or_default().to_string();
            let second = words.next().unwrap_or_default();
            // `Manufacturer#m` and `Brand#mn`.
            let manufacturer = part.p_mfgr.to_string();
            let manufacturer = manufacturer.trim_start_matches("Manufacturer#");
            let brand = part.p_brand.to_string();
            let category = format!("MFGR#{}", brand.trim_start_matches("Brand#"));
            let brand = format!("{category}{}", mix(part.p_partkey, 3) % 40 + 1);
            vec![
                Value::Int(part.p_partkey as i32),
                Value::Text(format!("{first} {second}")),
                Value::Text(format!("MFGR#{manufacturer}")),
                Value::Text(category),
                Value::Text(brand),
                Value::Text(first),
                Value::Static(part.p_type),
                Value::Int(part.p_size),
                Value::Static(part.p_container),
            ]
        })
}

/// TPC-H's retail price of part `key`, in cents (clause 4.2.3).
fn retail_price_cents(key: i64) -> i64 {
    90_000 + ((key / 10) % 20_001) + 100 * (key % 1_000)
}

/// `yyyymmdd` of a TPC-H date.
fn date_key(date: tpchgen::dates::TPCHDate) -> i32 {
    let (year, month, day) = date.to_ymd();
    (1900 + year) * 10_000 + month * 100 + day
}

/// `lineorder`: TPC-H's orders joined with their lines, in order key order.
struct LineOrders {
    orders: tpchgen::generators::OrderGeneratorIterator<'static>,
    lines: std::iter::Peekable<tpchgen::generators::LineItemGeneratorIterator<'static>>,
    customers: i64,
    suppliers: i64,
    parts: i64,
    tpch_parts: i64,
    /// The current order's rows, ready to go.
    ready: std::collections::VecDeque<Row>,
}

impl LineOrders {
    fn new(scale_factor: f64) -> Self {
        Self {
            orders: OrderGenerator::new(scale_factor, 1, 1).into_iter(),
            lines: LineItemGenerator::new(scale_factor, 1, 1)
                .into_iter()
                .peekable(),
            customers: ssb_customers(scale_factor),
            suppliers: ssb_suppliers(scale_factor),
            parts: ssb_parts(scale_factor),
            tpch_parts: tpch_parts(scale_factor),
            ready: std::collections::VecDeque::new(),
        }
    }

    /// Generate the next order's rows into `ready`; false when no order is left.
    fn next_order(&mut self) -> bool {
        let Some(order) = self.orders.next() else {
            return false;
        };
        let custkey = (order.o_custkey - 1) % self.customers + 1;
        let orderdate = date_key(order.o_orderdate);
        struct Line {
            linenumber: i32,
            partkey: i64,
            suppkey: i64,
            quantity: i64,
            extendedprice: i64,
            discount: i64,
            revenue: i64,
            supplycost: i64,
            tax: i64,
            commitdate: i32,
            shipmode: &'static str,
        }
        let mut lines = Vec::with_capacity(7);
        let mut total = 0;
        while let Some(line) = self
            .lines
            .next_if(|line| line.l_orderkey == order.o_orderkey)
        {
            let partkey = ((line.l_partkey - 1) as i128 * self.parts as i128
                / self.tpch_parts as i128) as i64
                + 1;
            let price = retail_price_cents(partkey);
            let extendedprice = line.l_quantity * price;
            let discount = line.l_discount.0;
            let tax = line.l_tax.0;
            let revenue = extendedprice * (100 - discount) / 100;
            total += revenue * (100 + tax) / 100;
            lines.push(Line {
                linenumber: line.l_linenumber,
                partkey,
                suppkey: (line.l_suppkey - 1) % self.suppliers + 1,
                quantity: line.l_quantity,
                extendedprice,
                discount,
                revenue,
                supplycost: 6 * price / 10,
                tax,
                commitdate: date_key(line.l_commitdate),
                shipmode: line.l_shipmode,
            });
        }
        for line in lines {
            self.ready.push_back(vec![
                Value::Long(order.o_orderkey),
                Value::Int(line.linenumber),
                Value::Int(custkey as i32),
                Value::Int(line.partkey as i32),
                Value::Int(line.suppkey as i32),
                Value::Int(orderdate),
                Value::Static(order.o_orderpriority),
                Value::Int(order.o_shippriority),
                Value::Int(line.quantity as i32),
                Value::Int(line.extendedprice as i32),
                Value::Int(total as i32),
                Value::Int(line.discount as i32),
                Value::Int(line.revenue as i32),
                Value::Int(line.supplycost as i32),
                Value::Int(line.tax as i32),
                Value::Int(line.commitdate),
                Value::Static(line.shipmode),
            ]);
        }
        true
    }
}

impl Iterator for LineOrders {
    type Item = Row;

    fn next(&mut self) -> Option<Row> {
        while self.ready.is_empty() {
            if !self.next_order() {
                return None;
            }
        }
        self.ready.pop_front()
    }
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// Sunday first, as `d_daynuminweek` counts.
const WEEKDAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];

fn days_in_month(year: i32, month: usize) -> i32 {
    match month {
        2 if year % 4 == 0 && (year % 100 != 0 || year % 400 == 0) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Every day from 1992-01-01 to 1998-12-31.
fn dates() -> impl Iterator<Item = Row> + Send {
    let mut rows = Vec::new();
    // 1992-01-01 was a Wednesday (index 3 from Sunday).
    let mut weekday = 3;
    for year in FIRST_YEAR..=LAST_YEAR {
        let mut day_of_year = 0;
        for month in 1..=12usize {
            let last = days_in_month(year, month);
            for day in 1..=last {
                day_of_year += 1;
                let name = MONTHS[month - 1];
                let season = match month {
                    1 | 2 => "Winter",
                    3..=5 => "Spring",
                    6..=8 => "Summer",
                    9..=11 => "Fall",
                    _ => "Christmas",
                };
                let holiday = matches!((month, day), (1, 1) | (7, 4) | (11, 11) | (12, 25));
                rows.push(vec![
                    Value::Int(year * 10_000 + month as i32 * 100 + day),
                    Value::Text(format!("{name} {day}, {year}")),
                    Value::Static(WEEKDAYS[weekday]),
                    Value::Static(name),
                    Value::Int(year),
                    Value::Int(year * 100 + month as i32),
                    Value::Text(format!("{}{year}", &name[..3])),
                    Value::Int(weekday as i32 + 1),
                    Value::Int(day),
                    Value::Int(day_of_year),
                    Value::Int(month as i32),
                    Value::Int((day_of_year - 1) / 7 + 1),
                    Value::Static(season),
                    Value::Int(i32::from(weekday == 6)),
                    Value::Int(i32::from(day == last)),
                    Value::Int(i32::from(holiday)),
                    Value::Int(i32::from((1..=5).contains(&weekday))),
                ]);
                weekday = (weekday + 1) % 7;
            }
        }
    }
    rows.into_iter()
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Array, AsArray};
    use arrow::datatypes::{Int32Type, Int64Type};

    fn collect(table: &str, scale_factor: f64) -> Vec<RecordBatch> {
        let (schema, batches) = SsbTable::named(table)
            .expect("an SSB table")
            .generate(scale_factor);
        let batches: Vec<RecordBatch> = batches.map(|batch| batch.expect("a batch")).collect();
        assert!(batches.iter().all(|batch| batch.schema() == schema));
        batches
    }

    fn ints(batches: &[RecordBatch], column: &str) -> Vec<i64> {
        batches
            .iter()
            .flat_map(|batch| {
                let array = batch.column_by_name(column).expect("a column");
                match array.data_type() {
                    DataType::Int64 => array.as_primitive::<Int64Type>().values().to_vec(),
                    _ => array
                        .as_primitive::<Int32Type>()
                        .values()
                        .iter()
                        .map(|value| i64::from(*value))
                        .collect(),
                }
            })
            .collect()
    }

    fn texts(batches: &[RecordBatch], column: &str) -> Vec<String> {
        batches
            .iter()
            .flat_map(|batch| {
                let array = batch.column_by_name(column).expect("a column");
                let array = array.as_string_view();
                (0..array.len())
                    .map(|row| array.value(row).to_string())
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    #[test]
    fn row_counts_follow_the_spec() {
        assert_eq!(ssb_customers(1.0), 30_000);
        assert_eq!(ssb_suppliers(10.0), 20_000);
        assert_eq!(ssb_parts(1.0), 200_000);
        assert_eq!(ssb_parts(10.0), 800_000);
        assert_eq!(ssb_parts(100.0), 1_400_000);
        assert_eq!(ssb_parts(0.01), 2_000);
        let dates = collect("date", 0.01);
        assert_eq!(ints(&dates, "d_datekey").len(), 2_557);
        assert_eq!(ints(&collect("customer", 0.01), "c_custkey").len(), 300);
        assert_eq!(ints(&collect("supplier", 0.01), "s_suppkey").len(), 20);
        assert_eq!(ints(&collect("part", 0.01), "p_partkey").len(), 2_000);
    }

    #[test]
    fn the_calendar_is_right() {
        let dates = collect("date", 1.0);
        let keys = ints(&dates, "d_datekey");
        let weekdays = texts(&dates, "d_dayofweek");
        let at = |key: i64| keys.iter().position(|k| *k == key).expect("a day");
        // Known weekdays: 1992-01-01 Wednesday, 1996-02-29 Thursday, 1998-12-31 Thursday.
        assert_eq!(weekdays[at(19920101)], "Wednesday");
        assert_eq!(weekdays[at(19960229)], "Thursday");
        assert_eq!(weekdays[at(19981231)], "Thursday");
        assert!(keys.windows(2).all(|pair| pair[0] < pair[1]));
        assert_eq!(texts(&dates, "d_yearmonth")[at(19971215)], "Dec1997");
        assert_eq!(texts(&dates, "d_date")[at(19971215)], "December 15, 1997");
        assert_eq!(ints(&dates, "d_weeknuminyear")[at(19940205)], 6);
        assert_eq!(ints(&dates, "d_lastdayinmonthfl")[at(19920229)], 1);
    }

    #[test]
    fn lineorder_keys_fall_in_the_dimensions_and_money_adds_up() {
        let scale_factor = 0.01;
        let lines = collect("lineorder", scale_factor);
        let orderkeys = ints(&lines, "lo_orderkey");
        // dbgen's lineitem at SF 0.01 has 60,175 rows.
        assert_eq!(orderkeys.len(), 60_175);
        assert!(orderkeys.windows(2).all(|pair| pair[0] <= pair[1]));
        let customers = ints(&lines, "lo_custkey");
        assert!(customers
            .iter()
            .all(|key| (1..=ssb_customers(scale_factor)).contains(key) && key % 3 != 0));
        assert!(ints(&lines, "lo_suppkey")
            .iter()
            .all(|key| (1..=ssb_suppliers(scale_factor)).contains(key)));
        let parts = ints(&lines, "lo_partkey");
        assert!(parts
            .iter()
            .all(|key| (1..=ssb_parts(scale_factor)).contains(key)));
        let dates = ints(&collect("date", scale_factor), "d_datekey");
        assert!(ints(&lines, "lo_orderdate")
            .iter()
            .all(|key| dates.binary_search(key).is_ok()));
        let quantity = ints(&lines, "lo_quantity");
        let price = ints(&lines, "lo_extendedprice");
        let discount = ints(&lines, "lo_discount");
        let revenue = ints(&lines, "lo_revenue");
        for row in 0..orderkeys.len() {
            assert_eq!(price[row], quantity[row] * retail_price_cents(parts[row]));
            assert_eq!(revenue[row], price[row] * (100 - discount[row]) / 100);
            assert!((0..=10).contains(&discount[row]));
        }
    }

    #[test]
    fn dimension_columns_take_ssbs_domains() {
        let parts = collect("part", 0.01);
        let brands = texts(&parts, "p_brand1");
        let categories = texts(&parts, "p_category");
        for (brand, category) in brands.iter().zip(&categories) {
            assert!(brand.starts_with(category.as_str()), "{brand} {category}");
            let number: u32 = brand[category.len()..].parse().expect("a brand number");
            assert!((1..=40).contains(&number));
            assert_eq!(category.len(), "MFGR#12".len());
        }
        let customers = collect("customer", 0.01);
        let cities = texts(&customers, "c_city");
        let nations = texts(&customers, "c_nation");
        for (city, nation) in cities.iter().zip(&nations) {
            assert_eq!(city.len(), 10);
            assert!(
                format!("{nation:<9}").starts_with(&city[..9]),
                "{city} {nation}"
            );
        }
        assert!(texts(&customers, "c_region").contains(&"ASIA".to_string()));
    }
}
