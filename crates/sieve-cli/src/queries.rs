//! The 22 TPC-H queries (standard text with the validation parameters; Q15's
//! view is written as a common table expression) and SSB's 13.

use sieve_format::Benchmark;

/// `(name, SQL)` for Q1 to Q22.
pub const TPCH_QUERIES: [(&str, &str); 22] = [
    ("q1", include_str!("../../../queries/tpch/q1.sql")),
    ("q2", include_str!("../../../queries/tpch/q2.sql")),
    ("q3", include_str!("../../../queries/tpch/q3.sql")),
    ("q4", include_str!("../../../queries/tpch/q4.sql")),
    ("q5", include_str!("../../../queries/tpch/q5.sql")),
    ("q6", include_str!("../../../queries/tpch/q6.sql")),
    ("q7", include_str!("../../../queries/tpch/q7.sql")),
    ("q8", include_str!("../../../queries/tpch/q8.sql")),
    ("q9", include_str!("../../../queries/tpch/q9.sql")),
    ("q10", include_str!("../../../queries/tpch/q10.sql")),
    ("q11", include_str!("../../../queries/tpch/q11.sql")),
    ("q12", include_str!("../../../queries/tpch/q12.sql")),
    ("q13", include_str!("../../../queries/tpch/q13.sql")),
    ("q14", include_str!("../../../queries/tpch/q14.sql")),
    ("q15", include_str!("../../../queries/tpch/q15.sql")),
    ("q16", include_str!("../../../queries/tpch/q16.sql")),
    ("q17", include_str!("../../../queries/tpch/q17.sql")),
    ("q18", include_str!("../../../queries/tpch/q18.sql")),
    ("q19", include_str!("../../../queries/tpch/q19.sql")),
    ("q20", include_str!("../../../queries/tpch/q20.sql")),
    ("q21", include_str!("../../../queries/tpch/q21.sql")),
    ("q22", include_str!("../../../queries/tpch/q22.sql")),
];

/// `(name, SQL)` for SSB's Q1.1 to Q4.3.
pub const SSB_QUERIES: [(&str, &str); 13] = [
    ("q1.1", include_str!("../../../queries/ssb/q1.1.sql")),
    ("q1.2", include_str!("../../../queries/ssb/q1.2.sql")),
    ("q1.3", include_str!("../../../queries/ssb/q1.3.sql")),
    ("q2.1", include_str!("../../../queries/ssb/q2.1.sql")),
    ("q2.2", include_str!("../../../queries/ssb/q2.2.sql")),
    ("q2.3", include_str!("../../../queries/ssb/q2.3.sql")),
    ("q3.1", include_str!("../../../queries/ssb/q3.1.sql")),
    ("q3.2", include_str!("../../../queries/ssb/q3.2.sql")),
    ("q3.3", include_str!("../../../queries/ssb/q3.3.sql")),
    ("q3.4", include_str!("../../../queries/ssb/q3.4.sql")),
    ("q4.1", include_str!("../../../queries/ssb/q4.1.sql")),
    ("q4.2", include_str!("../../../queries/ssb/q4.2.sql")),
    ("q4.3", include_str!("../../../queries/ssb/q4.3.sql")),
];

/// The benchmark's queries.
pub fn queries_of(benchmark: Benchmark) -> &'static [(&'static str, &'static str)] {
    match benchmark {
        Benchmark::Tpch => &TPCH_QUERIES,
        Benchmark::Ssb => &SSB_QUERIES,
    }
}

/// Whether the query's outermost statement orders its rows.
pub fn is_ordered(sql: &str) -> bool {
    // Every TPC-H query but Q6, Q14, Q17 and Q19 (single-row results) ends with
    // ORDER BY (and maybe LIMIT); every SSB query but Q1.x (single rows).
    let lower = sql.to_ascii_lowercase();
    let tail = lower.rsplit(')').next().unwrap_or(&lower);
    tail.contains("order by")
}
