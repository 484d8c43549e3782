//! Sieve's end-to-end tests, one module per subject, linked into one test
//! binary: each file used to be a binary of its own, ~270 MB of DataFusion
//! each in a debug build, which made a cold CI build 8 GB on disk and spent
//! most of its link time relinking the same code. nextest still runs each
//! test in a process of its own (`cargo nextest run -E 'test(/^fuzz::/)'`
//! runs one module).

// Shared helpers; each module uses its own part of them.
mod common;
mod plans;
mod serving;
mod slices;

mod aggregate_first;
mod aggregate_pushdown;
mod as_stored;
mod auth_and_limits;
mod availability;
mod bench;
mod best_effort;
mod complete_aggregates;
mod crash_loads;
mod data_errors;
mod deep_expressions;
mod dense_aggregates;
mod distinct_counts;
mod early_start;
mod edge_values;
mod end_to_end;
mod evaluate_early;
mod failover;
mod full_disk;
mod fuzz;
mod fuzz_regressions;
mod gen;
mod group_by_key;
mod hostile_requests;
mod integrity;
mod join_filter_registry;
mod join_order;
mod join_sides;
mod key_bitmaps;
mod late_columns;
mod memory_bound;
mod null_joins;
mod owned_random;
mod owned_tables;
mod planned_layout;
mod request_fuzz;
mod serve_concurrency;
mod serve_flight_sql;
mod serve_pg;
mod serve_python;
mod signed_zeros;
mod slice_details;
mod sorted_copies;
mod ssb;
mod streams;
mod sum_overflow;
mod typed_joins;
