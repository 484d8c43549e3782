//! Physical plans and their scans' metrics, for the test files that look
//! inside a plan (`mod plans;`).

use std::sync::Arc;

use datafusion::physical_plan::ExecutionPlan;
use sieve_compute::{SieveScanExec, SieveSession};

/// The physical plan of `sql` in `session`.
pub(crate) async fn physical_plan(session: &SieveSession, sql: &str) -> Arc<dyn ExecutionPlan> {
    session
        .context
        .sql(sql)
        .await
        .unwrap()
        .create_physical_plan()
        .await
        .unwrap()
}

/// The statement's own plan below the root every Sieve plan has
/// (`StatementEndExec`, which returns freed memory when it ends).
pub(crate) fn below_statement_end(plan: &Arc<dyn ExecutionPlan>) -> Arc<dyn ExecutionPlan> {
    Arc::clone(
        plan.downcast_ref::<sieve_compute::memory::StatementEndExec>()
            .expect("a Sieve plan's root is its StatementEndExec")
            .input(),
    )
}

/// Every `SieveScanExec` in `plan`, in plan order.
pub(crate) fn find_scans(plan: &Arc<dyn ExecutionPlan>, found: &mut Vec<Arc<dyn ExecutionPlan>>) {
    if plan.downcast_ref::<SieveScanExec>().is_some() {
        found.push(Arc::clone(plan));
    }
    for child in plan.children() {
        find_scans(child, found);
    }
}

/// The metric `name` of `plan`, summed over partitions (0 if absent).
pub(crate) fn metric(plan: &Arc<dyn ExecutionPlan>, name: &str) -> usize {
    if name == "output_rows" {
        // DataFusion keeps output rows apart from named counters.
        return plan
            .metrics()
            .and_then(|metrics| metrics.output_rows())
            .unwrap_or(0);
    }
    plan.metrics()
        .and_then(|metrics| metrics.sum_by_name(name))
        .map(|value| value.as_usize())
        .unwrap_or(0)
}
