//! Errors as PostgreSQL error messages: each DataFusion or Sieve error gets
//! the SQLSTATE a PostgreSQL client expects for its kind (a syntax error
//! 42601, an unknown table 42P01, a division by zero 22012, ...), so drivers
//! raise the right exception class. The connection stays open.

use datafusion::arrow::error::ArrowError;
use datafusion::common::{DataFusionError, SchemaError};
use datafusion_postgres::pgwire::api::{ClientInfo, ErrorHandler};
use datafusion_postgres::pgwire::error::{ErrorInfo, PgWireError};

/// Maps each error of a query to its SQLSTATE before pgwire sends it.
#[derive(Debug)]
pub(crate) struct SqlStates;

impl ErrorHandler for SqlStates {
    fn on_error<C>(&self, _client: &C, error: &mut PgWireError)
    where
        C: ClientInfo,
    {
        let PgWireError::ApiError(inner) = error else {
            return;
        };
        let Some(found) = inner.downcast_ref::<DataFusionError>() else {
            return;
        };
        let code = sqlstate(found);
        let message = found.strip_backtrace();
        log::debug!("query error {code}: {message}");
        *error = PgWireError::UserError(Box::new(ErrorInfo::new(
            "ERROR".to_string(),
            code.to_string(),
            message,
        )));
    }
}

/// The SQLSTATE of `error` (PostgreSQL's Appendix A codes).
pub(crate) fn sqlstate(error: &DataFusionError) -> &'static str {
    match error {
        DataFusionError::Context(_, inner) | DataFusionError::Diagnostic(_, inner) => {
            sqlstate(inner)
        }
        DataFusionError::Shared(inner) => sqlstate(inner),
        DataFusionError::Collection(errors) => errors.first().map(sqlstate).unwrap_or("XX000"),
        // syntax_error
        DataFusionError::SQL(..) => "42601",
        DataFusionError::SchemaError(schema, _) => match schema.as_ref() {
            // undefined_column
            SchemaError::FieldNotFound { .. } => "42703",
            // ambiguous_column
            SchemaError::AmbiguousReference { .. } => "42702",
            // duplicate_column
            _ => "42701",
        },
        DataFusionError::Plan(message) => {
            let lower = message.to_ascii_lowercase();
            if lower.contains("table")
                && (lower.contains("not found")
                    || lower.contains("does not exist")
                    || lower.contains("no table named"))
            {
                // undefined_table
                "42P01"
            } else if lower.contains("table") && lower.contains("already exists") {
                // duplicate_table
                "42P07"
            } else if lower.contains("invalid function") || lower.contains("no function matches") {
                // undefined_function
                "42883"
            } else {
                // syntax_error_or_access_rule_violation
                "42000"
            }
        }
        // feature_not_supported
        DataFusionError::NotImplemented(_) => "0A000",
        // invalid_parameter_value (SET of an unknown or malformed setting)
        DataFusionError::Configuration(_) => "22023",
        // out_of_memory
        DataFusionError::ResourcesExhausted(_) => "53200",
        DataFusionError::ArrowError(arrow, _) => arrow_sqlstate(arrow),
        DataFusionError::External(inner) => {
            if let Some(arrow) = inner.downcast_ref::<ArrowError>() {
                arrow_sqlstate(arrow)
            } else if let Some(inner) = inner.downcast_ref::<DataFusionError>() {
                sqlstate(inner)
            } else {
                // system_error: a storage node failed or could not be reached
                "58000"
            }
        }
        // io_error
        DataFusionError::IoError(_) | DataFusionError::ObjectStore(_) => "58030",
        DataFusionError::Execution(message) if message.contains("could not be read") => "58000",
        // undefined_table (DROP TABLE of a table that is not there)
        DataFusionError::Execution(message)
            if (message.starts_with("Table '") || message.starts_with("View '"))
                && message.contains("doesn't exist") =>
        {
            "42P01"
        }
        // duplicate_table
        DataFusionError::Execution(message)
            if (message.starts_with("Table '") || message.starts_with("View '"))
                && message.contains("already exists") =>
        {
            "42P07"
        }
        // data_exception
        DataFusionError::Execution(_) => "22000",
        // internal_error
        _ => "XX000",
    }
}

fn arrow_sqlstate(error: &ArrowError) -> &'static str {
    match error {
        // division_by_zero
        ArrowError::DivideByZero => "22012",
        // numeric_value_out_of_range
        ArrowError::ArithmeticOverflow(_) => "22003",
        // invalid_text_representation
        ArrowError::CastError(_) | ArrowError::ParseError(_) => "22P02",
        // invalid_parameter_value
        ArrowError::InvalidArgumentError(_) => "22023",
        // out_of_memory
        ArrowError::MemoryError(_) => "53200",
        // data_exception
        ArrowError::ComputeError(_) => "22000",
        _ => "XX000",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::prelude::SessionContext;

    async fn state_of(sql: &str) -> &'static str {
        let context = SessionContext::new();
        let error = match context.sql(sql).await {
            Ok(frame) => frame.collect().await.expect_err(sql),
            Err(error) => error,
        };
        sqlstate(&error)
    }

    #[tokio::test]
    async fn errors_get_the_sqlstate_of_their_kind() {
        assert_eq!(state_of("selec 1").await, "42601");
        assert_eq!(state_of("select * from nowhere").await, "42P01");
        assert_eq!(state_of("select nope from (select 1 as a)").await, "42703");
        assert_eq!(state_of("select 1 / 0").await, "22012");
        assert_eq!(state_of("drop table nowhere").await, "42P01");
        let context = SessionContext::new();
        context.sql("create view twice as select 1").await.unwrap();
        let error = context
            .sql("create view twice as select 2")
            .await
            .expect_err("a second view of the same name");
        assert_eq!(sqlstate(&error), "42P07", "{error}");
        assert_eq!(state_of("select cast('x' as int)").await, "22P02");
        assert_eq!(
            state_of("set datafusion.no_such_setting = 1").await,
            "22023"
        );
    }
}
