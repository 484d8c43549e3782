//! `tpch(table, scale_factor)` and `ssb(table, scale_factor)`: the rows of
//! TPC-H and of the Star Schema Benchmark as table functions.
//!
//! ```sql
//! SELECT count(*) FROM tpch('nation', 1);
//! CREATE TABLE lineitem WITH (sort_key = 'l_orderkey') AS
//!     SELECT * FROM tpch('lineitem', 10);
//! CREATE TABLE lineorder WITH (sort_key = 'lo_orderkey') AS
//!     SELECT * FROM ssb('lineorder', 1);
//! ```
//!
//! TPC-H's rows are dbgen's (`tpchgen`); SSB's are derived from them
//! (`sieve_format::ssb`). They are generated on a thread of their own as
//! they are read, in the order of the table's key, so a load of any scale
//! factor streams with bounded memory. `sieve gen` loads both this way,
//! through the write path every load takes.

use std::sync::Arc;

use arrow::datatypes::{DataType, SchemaRef};
use async_trait::async_trait;
use datafusion::catalog::streaming::StreamingTable;
use datafusion::catalog::{Session, TableFunctionArgs, TableFunctionImpl, TableProvider};
use datafusion::common::{plan_err, DataFusionError, Result, ScalarValue};
use datafusion::datasource::TableType;
use datafusion::execution::TaskContext;
use datafusion::logical_expr::Expr;
use datafusion::physical_plan::stream::RecordBatchReceiverStream;
use datafusion::physical_plan::streaming::PartitionStream;
use datafusion::physical_plan::{ExecutionPlan, SendableRecordBatchStream};
use sieve_format::{Benchmark, GeneratedTable};

/// Largest scale factor `tpch(...)` and `ssb(...)` generate (TPC-H's own largest).
pub const SCALE_FACTOR_MAX: f64 = 100_000.0;

/// Batches generated ahead of the reader.
const GENERATED_AHEAD: usize = 4;

/// The `tpch` or `ssb` table function: the benchmark's tables, generated.
#[derive(Debug)]
pub struct GeneratorFunction(pub Benchmark);

impl TableFunctionImpl for GeneratorFunction {
    fn call_with_args(&self, args: TableFunctionArgs) -> Result<Arc<dyn TableProvider>> {
        let benchmark = self.0;
        let tables = benchmark.tables();
        let usage = format!(
            "{0}(table, scale_factor), e.g. {0}('{1}', 1)",
            benchmark.name(),
            tables.last().map(|table| table.name).unwrap_or_default()
        );
        let [table, scale_factor] = args.exprs() else {
            return plan_err!("{usage}: two arguments, not {}", args.exprs().len());
        };
        let Expr::Literal(ScalarValue::Utf8(Some(name)) | ScalarValue::Utf8View(Some(name)), _) =
            table
        else {
            return plan_err!("{usage}: the table is a quoted name, not {table}");
        };
        let Some(table) = benchmark.table(name) else {
            let known: Vec<&str> = tables.iter().map(|table| table.name).collect();
            return plan_err!(
                "{} has no table '{name}' (known: {})",
                benchmark.title(),
                known.join(", ")
            );
        };
        let Expr::Literal(value, _) = scale_factor else {
            return plan_err!("{usage}: the scale factor is a number, not {scale_factor}");
        };
        let scale_factor = match value.cast_to(&DataType::Float64) {
            Ok(ScalarValue::Float64(Some(scale_factor))) if value.data_type().is_numeric() => {
                scale_factor
            }
            _ => return plan_err!("{usage}: the scale factor is a number, not {value}"),
        };
        if !(scale_factor > 0.0 && scale_factor <= SCALE_FACTOR_MAX) {
            return plan_err!(
                "the scale factor must be above 0 and at most {SCALE_FACTOR_MAX}, not {scale_factor}"
            );
        }
        Ok(Arc::new(GeneratedProvider::new(table, scale_factor)?))
    }
}

/// One generated table at one scale factor, generated as it is scanned.
#[derive(Debug)]
struct GeneratedProvider {
    inner: StreamingTable,
}

impl GeneratedProvider {
    fn new(table: GeneratedTable, scale_factor: f64) -> Result<Self> {
        let (schema, _) = table.generate(scale_factor);
        let partition = Arc::new(GeneratedPartition {
            table,
            scale_factor,
            schema: Arc::clone(&schema),
        });
        Ok(Self {
            inner: StreamingTable::try_new(schema, vec![partition])?,
        })
    }
}

#[async_trait]
impl TableProvider for GeneratedProvider {
    fn schema(&self) -> SchemaRef {
        self.inner.schema()
    }

    fn table_type(&self) -> TableType {
        TableType::Temporary
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.inner.scan(state, projection, filters, limit).await
    }
}

#[derive(Debug)]
struct GeneratedPartition {
    table: GeneratedTable,
    scale_factor: f64,
    schema: SchemaRef,
}

impl PartitionStream for GeneratedPartition {
    fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    fn execute(&self, _context: Arc<TaskContext>) -> SendableRecordBatchStream {
        let mut builder =
            RecordBatchReceiverStream::builder(Arc::clone(&self.schema), GENERATED_AHEAD);
        let sender = builder.tx();
        let (table, scale_factor) = (self.table, self.scale_factor);
        builder.spawn_blocking(move || {
            let (_, batches) = table.generate(scale_factor);
            for batch in batches {
                let batch =
                    batch.map_err(|error| DataFusionError::ArrowError(Box::new(error), None));
                // The reader is gone (the statement failed or was cancelled).
                if sender.blocking_send(batch).is_err() {
                    break;
                }
            }
            Ok(())
        });
        builder.build()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::prelude::SessionContext;

    async fn count(context: &SessionContext, sql: &str) -> Result<i64> {
        let batches = context.sql(sql).await?.collect().await?;
        let column = batches[0]
            .column(0)
            .as_any()
            .downcast_ref::<arrow::array::Int64Array>()
            .expect("a count");
        Ok(column.value(0))
    }

    #[tokio::test]
    async fn tpch_generates_tables_with_the_specs_row_counts() {
        let context = SessionContext::new();
        context.register_udtf("tpch", Arc::new(GeneratorFunction(Benchmark::Tpch)));
        assert_eq!(
            count(&context, "SELECT count(*) FROM tpch('nation', 1)")
                .await
                .unwrap(),
            25
        );
        assert_eq!(
            count(&context, "SELECT count(*) FROM tpch('ORDERS', 0.01)")
                .await
                .unwrap(),
            15_000
        );
        // The rows come in the key's order.
        let batches = context
            .sql("SELECT o_orderkey FROM tpch('orders', 0.01)")
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        let keys: Vec<i64> = batches
            .iter()
            .flat_map(|batch| {
                batch
                    .column(0)
                    .as_any()
                    .downcast_ref::<arrow::array::Int64Array>()
                    .expect("order keys")
                    .values()
                    .to_vec()
            })
            .collect();
        assert_eq!(keys.len(), 15_000);
        assert!(keys.windows(2).all(|pair| pair[0] < pair[1]));
    }

    #[tokio::test]
    async fn ssb_generates_its_tables() {
        let context = SessionContext::new();
        context.register_udtf("ssb", Arc::new(GeneratorFunction(Benchmark::Ssb)));
        for (sql, expected) in [
            ("SELECT count(*) FROM ssb('date', 1)", 2_557),
            ("SELECT count(*) FROM ssb('Customer', 0.01)", 300),
            ("SELECT count(*) FROM ssb('lineorder', 0.01)", 60_175),
            (
                "SELECT count(*) FROM ssb('lineorder', 0.01) JOIN ssb('part', 0.01) \
                 ON lo_partkey = p_partkey JOIN ssb('supplier', 0.01) ON lo_suppkey = s_suppkey \
                 JOIN ssb('customer', 0.01) ON lo_custkey = c_custkey \
                 JOIN ssb('date', 0.01) ON lo_orderdate = d_datekey",
                60_175,
            ),
        ] {
            assert_eq!(count(&context, sql).await.unwrap(), expected, "{sql}");
        }
    }

    #[tokio::test]
    async fn tpch_refuses_what_it_cannot_generate() {
        let context = SessionContext::new();
        context.register_udtf("tpch", Arc::new(GeneratorFunction(Benchmark::Tpch)));
        context.register_udtf("ssb", Arc::new(GeneratorFunction(Benchmark::Ssb)));
        for (sql, expected) in [
            (
                "SELECT * FROM tpch('lineitems', 1)",
                "TPC-H has no table 'lineitems'",
            ),
            ("SELECT * FROM tpch('nation')", "two arguments"),
            ("SELECT * FROM tpch('nation', 0)", "above 0"),
            ("SELECT * FROM tpch('nation', 1000000)", "at most"),
            ("SELECT * FROM tpch('nation', 'x')", "is a number"),
            ("SELECT * FROM tpch(nation, 1)", "quoted name"),
            (
                "SELECT * FROM ssb('lineitem', 1)",
                "SSB has no table 'lineitem'",
            ),
        ] {
            let error = match context.sql(sql).await {
                Ok(frame) => frame.collect().await.unwrap_err(),
                Err(error) => error,
            };
            assert!(error.to_string().contains(expected), "{sql}: {error}");
        }
    }
}
