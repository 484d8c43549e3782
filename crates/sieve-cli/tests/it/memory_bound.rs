//! The compute node's memory bound (`sieve_compute::memory`): a session has
//! a bounded pool by default; under a small one, sorts and aggregations
//! spill and keep plain DataFusion's answers (NDP on and off), so do hash
//! joins whose build side passes it (partitioned to disk by key hash), and
//! one whose build side cannot be split below the bound (one key's rows)
//! fails with a clear error and leaves the session usable.

use std::sync::Arc;
use std::time::Duration;

use datafusion::execution::memory_pool::MemoryLimit;
use datafusion::physical_plan::{collect, ExecutionPlan};
use futures::StreamExt;
use sieve_cli::cluster::EmbeddedCluster;
use sieve_cli::compare::{reference_context, rows_as_text, run};
use sieve_compute::memory::{release_settled, statement_releases};
use sieve_compute::SieveSession;

use crate::common;

use common::NODES;

/// Spill count summed over every operator of `plan`.
fn spills(plan: &Arc<dyn ExecutionPlan>) -> usize {
    let own = plan
        .metrics()
        .and_then(|metrics| metrics.spill_count())
        .unwrap_or(0);
    own + plan.children().into_iter().map(spills).sum::<usize>()
}

/// Rows the hash joins of `plan` counted as output: DataFusion's joins and
/// Sieve's wrappers, which count the rows of the joins they ran part by part.
fn join_output_rows(plan: &Arc<dyn ExecutionPlan>) -> usize {
    let own = if matches!(plan.name(), "HashJoinExec" | "SpillableHashJoinExec") {
        plan.metrics()
            .and_then(|metrics| metrics.output_rows())
            .unwrap_or(0)
    } else {
        0
    };
    own + plan
        .children()
        .into_iter()
        .map(join_output_rows)
        .sum::<usize>()
}

async fn run_counting_spills(session: &SieveSession, sql: &str) -> (Vec<String>, usize) {
    let (rows, spilled, _) = run_counting(session, sql).await;
    (rows, spilled)
}

/// The rows of `sql`, its spills and its joins' output rows.
async fn run_counting(session: &SieveSession, sql: &str) -> (Vec<String>, usize, usize) {
    let frame = session.context.sql(sql).await.unwrap();
    let plan = frame.create_physical_plan().await.unwrap();
    let batches = collect(Arc::clone(&plan), session.context.task_ctx())
        .await
        .unwrap_or_else(|error| panic!("{sql}: {error}"));
    (
        rows_as_text(&batches, false).unwrap(),
        spills(&plan),
        join_output_rows(&plan),
    )
}

/// A sort and an aggregation of 300,000 rows of 26 bytes each (and as
/// many groups).
const SPILLING: [&str; 2] = [
    "select l_orderkey, l_linenumber, r_regionkey, l_extendedprice \
     from lineitem cross join region \
     order by l_extendedprice, l_orderkey, l_linenumber, r_regionkey",
    "select l_orderkey, l_linenumber, r_regionkey, count(*) as n, \
     sum(l_quantity) as q from lineitem cross join region \
     group by l_orderkey, l_linenumber, r_regionkey \
     order by l_orderkey, l_linenumber, r_regionkey",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_takes_at_most_its_own_bound_of_the_sessions_pool() {
    let root = common::small_slices(1);
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let session = cluster.session().await.unwrap();
    let reference = reference_context(&root, NODES).await.unwrap();
    // The session's pool stays half the machine; each statement gets 30 MB
    // of it. At 36 MB, the pool of the test below, the sort query sometimes
    // did not spill (a statement's spilling operator may take what the
    // others' floors leave, and these rows fit in about 40 to 48 MB):
    // 1 run in 12 with three runs at once, and once in a full suite (CI,
    // 2026-11-29). At 30 MB: 20 runs of 20, sequential and three at once.
    session
        .apply_settings(&[
            "sieve.query_memory_limit=30M".into(),
            "datafusion.execution.target_partitions=2".into(),
            "datafusion.execution.sort_spill_reservation_bytes=4194304".into(),
        ])
        .unwrap();
    let session_pool = Arc::clone(&session.context.runtime_env().memory_pool);
    assert!(matches!(
        session_pool.memory_limit(),
        MemoryLimit::Finite(bytes) if bytes > 1 << 30
    ));
    for sql in SPILLING {
        let expected = rows_as_text(&run(&reference, sql).await.unwrap(), false).unwrap();
        for on in [true, false] {
            session.set_ndp(on).unwrap();
            let (actual, spilled) = run_counting_spills(&session, sql).await;
            assert_eq!(actual, expected, "NDP {on}: {sql}");
            assert!(
                spilled > 0,
                "NDP {on}: nothing spilled under a 30 MB statement bound: {sql}"
            );
            // What the statement held was taken from the session's pool,
            // and is back.
            assert_eq!(session_pool.reserved(), 0, "NDP {on}: {sql}");
        }
    }
    // Without a statement bound the session's pool alone holds them.
    session
        .apply_settings(&["sieve.query_memory_limit=unbounded".into()])
        .unwrap();
    let (actual, spilled) = run_counting_spills(&session, SPILLING[1]).await;
    assert_eq!(
        actual,
        rows_as_text(&run(&reference, SPILLING[1]).await.unwrap(), false).unwrap()
    );
    assert_eq!(spilled, 0, "spilled without a statement bound");
    session
        .apply_settings(&["sieve.query_memory_limit=lots".into()])
        .unwrap();
    let error = run(&session.context, SPILLING[1])
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("sieve.query_memory_limit"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_small_pool_sorts_and_aggregations_spill_and_keep_their_answers() {
    let root = common::small_slices(1);
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let session = cluster.session().await.unwrap();
    assert!(
        matches!(
            session.context.runtime_env().memory_pool.memory_limit(),
            MemoryLimit::Finite(_)
        ),
        "a session's pool is bounded by default"
    );
    let reference = reference_context(&root, NODES).await.unwrap();
    session
        .apply_settings(&[
            // 36 MB: DataFusion's fair pool lets each of the four
            // spillable consumers (an aggregation and a sort per partition)
            // hold a quarter of it, and a sort's merge reservation (4 MB,
            // below) is taken only when its first batch arrives. At 28 MB,
            // both aggregations' and one sort's shares with one merge
            // reservation left under 4 MB for the other's, and the query
            // failed now and then under a loaded machine; at 36 MB 2 MB
            // stay. Both queries still spill up to 40 MB, not at 48 MB.
            "datafusion.runtime.memory_limit=36M".into(),
            // Two partitions share the pool, whatever the machine's cores.
            "datafusion.execution.target_partitions=2".into(),
            // DataFusion sets 10 MB aside for a sort's merge by default; in
            // DataFusion 55 a sort or an aggregation that spills also needs
            // room to merge what it spilled, so much smaller pools fail.
            "datafusion.execution.sort_spill_reservation_bytes=4194304".into(),
        ])
        .unwrap();
    assert!(matches!(
        session.context.runtime_env().memory_pool.memory_limit(),
        MemoryLimit::Finite(bytes) if bytes == 36 << 20
    ));
    for sql in SPILLING {
        let expected = rows_as_text(&run(&reference, sql).await.unwrap(), false).unwrap();
        for on in [true, false] {
            session.set_ndp(on).unwrap();
            let (actual, spilled) = run_counting_spills(&session, sql).await;
            assert_eq!(actual, expected, "NDP {on}: {sql}");
            assert!(
                spilled > 0,
                "NDP {on}: nothing spilled under the 36 MB pool: {sql}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_side_past_the_pool_spills_and_one_that_cannot_be_split_is_a_clear_error() {
    let root = common::small_slices(1);
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let session = cluster.session().await.unwrap();
    let reference = reference_context(&root, NODES).await.unwrap();
    // Build sides of about 20 MB: partitioned by key hash to disk and
    // joined part by part.
    let join = "select count(*) from lineitem a join lineitem b \
                on a.l_comment = b.l_comment and a.l_orderkey <> b.l_orderkey";
    // Seven keys (ship modes), each with megabytes of build rows, and no
    // other equality: parts cannot be split below one key.
    let skewed = "select count(*) from lineitem a join lineitem b \
                  on a.l_shipmode = b.l_shipmode and a.l_orderkey > b.l_orderkey + 1000000000";
    session
        .apply_settings(&[
            "datafusion.runtime.memory_limit=512K".into(),
            "datafusion.execution.target_partitions=2".into(),
        ])
        .unwrap();
    let expected = rows_as_text(&run(&reference, join).await.unwrap(), false).unwrap();
    for on in [true, false] {
        session.set_ndp(on).unwrap();
        let (actual, spilled, joined) = run_counting(&session, join).await;
        assert_eq!(actual, expected, "NDP {on}: {join}");
        assert!(spilled > 0, "NDP {on}: the join did not spill under 512 KB");
        // The join's metrics count every row it produced, those of the
        // parts joined from disk too (EXPLAIN ANALYZE showed none of them).
        let count: usize = actual[0]
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{actual:?}"));
        assert!(count > 0, "the join produced no rows");
        assert_eq!(joined, count, "NDP {on}: the join's output rows");
        let error = run(&session.context, skewed).await.unwrap_err().to_string();
        assert!(
            error.contains("Resources exhausted"),
            "NDP {on}: not a memory error: {error}"
        );
    }
    let bad = session
        .apply_settings(&["datafusion.runtime.memory_limit=lots".into()])
        .unwrap_err()
        .to_string();
    assert!(bad.contains("datafusion.runtime.memory_limit"), "{bad}");
    // The session goes on, with its memory back.
    session
        .apply_settings(&["datafusion.runtime.memory_limit=auto".into()])
        .unwrap();
    let actual = rows_as_text(&run(&session.context, join).await.unwrap(), false).unwrap();
    assert_eq!(actual, expected);
}

/// Waits, at most 10 s, until `count` releases have run since the process
/// started, and returns how many have.
async fn releases_reaching(count: u64) -> u64 {
    let start = std::time::Instant::now();
    while statement_releases() < count && start.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    release_settled(Duration::from_secs(10)).await;
    statement_releases()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn freed_memory_goes_back_when_the_last_statement_ends() {
    let root = common::small_slices(1);
    let cluster = EmbeddedCluster::start(&root, NODES).await.unwrap();
    let session = cluster.session().await.unwrap();
    let reference = reference_context(&root, NODES).await.unwrap();
    // One output stream a statement: a statement open is a stream the test
    // holds (with more, DataFusion runs each partition's in a task of its
    // own, and one may end before the others).
    // Released at once at each statement's end (idle 0) here; the wait for
    // the process to go idle is the last part.
    session
        .apply_settings(&[
            "datafusion.execution.target_partitions=1".into(),
            "sieve.release_memory_idle_ms=0".into(),
        ])
        .unwrap();
    release_settled(Duration::from_secs(10)).await;
    let before = statement_releases();

    // A statement run to its end: its answer as plain DataFusion's, then
    // one release.
    let sql = "select l_returnflag, count(*), sum(l_quantity) from lineitem group by 1 order by 1";
    let expected = rows_as_text(&run(&reference, sql).await.unwrap(), false).unwrap();
    let actual = rows_as_text(&run(&session.context, sql).await.unwrap(), false).unwrap();
    assert_eq!(actual, expected);
    assert_eq!(releases_reaching(before + 1).await, before + 1);

    // Two statements open at once, each dropped after its first batch: no
    // release while either is open, one when the last is dropped.
    let open = |sql: &'static str| {
        let context = session.context.clone();
        async move {
            let mut stream = context
                .sql(sql)
                .await
                .unwrap()
                .execute_stream()
                .await
                .unwrap();
            stream.next().await.unwrap().unwrap();
            stream
        }
    };
    let first = open("select l_orderkey, l_comment from lineitem").await;
    let second = open("select o_orderkey, o_comment from orders").await;
    drop(first);
    tokio::time::sleep(Duration::from_millis(200)).await;
    release_settled(Duration::from_secs(10)).await;
    assert_eq!(
        statement_releases(),
        before + 1,
        "released while a statement was still open"
    );
    drop(second);
    assert_eq!(releases_reaching(before + 2).await, before + 2);

    // A failed statement ends too.
    let error = run(
        &session.context,
        "select cast(l_comment as int) from lineitem",
    )
    .await
    .unwrap_err();
    assert!(error.to_string().contains("Cast"), "{error}");
    assert_eq!(releases_reaching(before + 3).await, before + 3);

    // Plans shown do not show the statement's end.
    let explain = rows_as_text(
        &run(
            &session.context,
            "explain select count(*) from lineitem where l_quantity > 10",
        )
        .await
        .unwrap(),
        false,
    )
    .unwrap()
    .join("\n");
    assert!(!explain.contains("StatementEndExec"), "{explain}");
    assert!(explain.contains("SieveScanExec"), "{explain}");
    let after_explain = releases_reaching(before + 4).await;
    assert_eq!(after_explain, before + 4);

    // Waiting for the process to go idle (the default): statements that
    // follow one another within the wait are released once, after the
    // last; none while the wait runs.
    session
        .apply_settings(&["sieve.release_memory_idle_ms=1500".into()])
        .unwrap();
    for _ in 0..3 {
        let actual = rows_as_text(&run(&session.context, sql).await.unwrap(), false).unwrap();
        assert_eq!(actual, expected);
    }
    assert_eq!(
        statement_releases(),
        after_explain,
        "released before the process went idle"
    );
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let after_idle = releases_reaching(after_explain + 1).await;
    assert_eq!(after_idle, after_explain + 1, "one release after the burst");

    // Off: no release.
    session
        .apply_settings(&[
            "sieve.release_memory_after_statements=false".into(),
            "sieve.release_memory_idle_ms=0".into(),
        ])
        .unwrap();
    let actual = rows_as_text(&run(&session.context, sql).await.unwrap(), false).unwrap();
    assert_eq!(actual, expected);
    tokio::time::sleep(Duration::from_millis(200)).await;
    release_settled(Duration::from_secs(10)).await;
    assert_eq!(statement_releases(), after_idle);
}
