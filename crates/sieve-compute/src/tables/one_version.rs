//! One version of every table a user owns for a whole statement.
//!
//! DataFusion looks up each table a statement names one after the other
//! (each lookup pins the latest version then), and a view keeps the tables
//! as they were when it was created inside its plan. A commit between two
//! lookups, or any commit since a view was made, would have the statement
//! read tables at different versions: a read skew, or a view that never
//! sees new rows. [`ReadOneVersion`], the last analyzer rule, pins the
//! latest version once per statement and binds every owned table the plan
//! reads or writes (subqueries and inlined views included) to it.

use std::sync::Arc;

use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNodeRecursion};
use datafusion::common::Result;
use datafusion::datasource::{provider_as_source, source_as_provider};
use datafusion::logical_expr::{LogicalPlan, TableSource};
use datafusion::optimizer::AnalyzerRule;

use super::{OwnedTable, OwnedTables, VersionPin};

/// See the module documentation.
#[derive(Debug, Default)]
pub struct ReadOneVersion;

/// `then` of the owned table behind `source`, if it is one.
fn with_owned<T>(source: &Arc<dyn TableSource>, then: impl FnOnce(&OwnedTable) -> T) -> Option<T> {
    let provider = source_as_provider(source).ok()?;
    provider.downcast_ref::<OwnedTable>().map(then)
}

/// `source` bound to `pin`'s version, if it is an owned table at another.
fn rebind(source: &Arc<dyn TableSource>, pin: &VersionPin) -> Result<Option<Arc<dyn TableSource>>> {
    with_owned(source, |table| -> Result<Option<Arc<dyn TableSource>>> {
        if table.version() == pin.version() {
            return Ok(None);
        }
        Ok(Some(provider_as_source(Arc::new(table.at(pin)?))))
    })
    .transpose()
    .map(Option::flatten)
}

impl AnalyzerRule for ReadOneVersion {
    fn analyze(&self, plan: LogicalPlan, _config: &ConfigOptions) -> Result<LogicalPlan> {
        let mut tables: Option<Arc<OwnedTables>> = None;
        plan.apply_with_subqueries(|node| {
            let source = match node {
                LogicalPlan::TableScan(scan) => &scan.source,
                LogicalPlan::Dml(dml) => &dml.target,
                _ => return Ok(TreeNodeRecursion::Continue),
            };
            if let Some(owned) = with_owned(source, |table| Arc::clone(table.tables())) {
                tables = Some(owned);
                return Ok(TreeNodeRecursion::Stop);
            }
            Ok(TreeNodeRecursion::Continue)
        })?;
        let Some(tables) = tables else {
            return Ok(plan);
        };
        let pin = tables.pin_latest()?;
        plan.transform_up_with_subqueries(|node| match node {
            LogicalPlan::TableScan(scan) => match rebind(&scan.source, &pin)? {
                Some(source) => Ok(Transformed::yes(LogicalPlan::TableScan(
                    datafusion::logical_expr::TableScan { source, ..scan },
                ))),
                None => Ok(Transformed::no(LogicalPlan::TableScan(scan))),
            },
            LogicalPlan::Dml(dml) => match rebind(&dml.target, &pin)? {
                Some(target) => Ok(Transformed::yes(LogicalPlan::Dml(
                    datafusion::logical_expr::DmlStatement { target, ..dml },
                ))),
                None => Ok(Transformed::no(LogicalPlan::Dml(dml))),
            },
            other => Ok(Transformed::no(other)),
        })
        .map(|transformed| transformed.data)
    }

    fn name(&self) -> &str {
        "sieve_read_one_version"
    }
}
