//! The benchmarks Sieve generates: TPC-H and the Star Schema Benchmark.

use arrow::datatypes::SchemaRef;

use crate::ssb::{GeneratedBatches, SsbTable, SSB_TABLES};
use crate::tpch::{TpchTable, TPCH_TABLES};

/// A benchmark whose tables Sieve generates (`tpch(...)`, `ssb(...)`, `sieve gen`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Benchmark {
    /// TPC-H (dbgen's rows, via tpchgen).
    Tpch,
    /// The Star Schema Benchmark, derived from TPC-H's generators (see [`crate::ssb`]).
    Ssb,
}

/// One generated table: its name and the columns a load sorts it by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GeneratedTable {
    /// Where its rows come from.
    source: Source,
    /// Table name, as the queries spell it.
    pub name: &'static str,
    /// The columns a load sorts each slice by (comma separated, as the
    /// `sort_key` table option takes them).
    pub sort_key: &'static str,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Tpch(TpchTable),
    Ssb(SsbTable),
}

impl Benchmark {
    /// Every benchmark, in the order `--help` lists them.
    pub const ALL: [Benchmark; 2] = [Benchmark::Tpch, Benchmark::Ssb];

    /// `tpch` or `ssb` (any case).
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|benchmark| benchmark.name().eq_ignore_ascii_case(name.trim()))
    }

    /// Its name: the table function's, the data directory's prefix.
    pub fn name(self) -> &'static str {
        match self {
            Self::Tpch => "tpch",
            Self::Ssb => "ssb",
        }
    }

    /// Its name as people write it.
    pub fn title(self) -> &'static str {
        match self {
            Self::Tpch => "TPC-H",
            Self::Ssb => "SSB",
        }
    }

    /// Its tables, in the order a load creates them.
    pub fn tables(self) -> Vec<GeneratedTable> {
        match self {
            Self::Tpch => TPCH_TABLES
                .iter()
                .map(|table| GeneratedTable {
                    source: Source::Tpch(*table),
                    name: table.name,
                    sort_key: table.key_column(),
                })
                .collect(),
            Self::Ssb => SSB_TABLES
                .iter()
                .map(|table| GeneratedTable {
                    source: Source::Ssb(*table),
                    name: table.name,
                    sort_key: table.sort_key,
                })
                .collect(),
        }
    }

    /// Its table called `name` (any case).
    pub fn table(self, name: &str) -> Option<GeneratedTable> {
        self.tables()
            .into_iter()
            .find(|table| table.name.eq_ignore_ascii_case(name))
    }
}

impl GeneratedTable {
    /// The benchmark it belongs to.
    pub fn benchmark(&self) -> Benchmark {
        match self.source {
            Source::Tpch(_) => Benchmark::Tpch,
            Source::Ssb(_) => Benchmark::Ssb,
        }
    }

    /// Schema and batches of the whole table at `scale_factor`, in the order
    /// of its key.
    pub fn generate(&self, scale_factor: f64) -> (SchemaRef, GeneratedBatches) {
        match self.source {
            Source::Tpch(table) => table.generate(scale_factor, 1, 1),
            Source::Ssb(table) => table.generate(scale_factor),
        }
    }
}
