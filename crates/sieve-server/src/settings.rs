//! `SHOW sieve.x` for both protocols. DataFusion's own SHOW knows only
//! `datafusion.*`: it looks extension settings up without their prefix.

use std::sync::Arc;

use datafusion::arrow::array::{RecordBatch, StringArray};
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::common::config::{ConfigExtension, ExtensionOptions};
use datafusion::common::{DataFusionError, Result};
use datafusion::dataframe::DataFrame;
use datafusion::prelude::SessionContext;
use datafusion::sql::sqlparser::ast::Statement;

use sieve_compute::SieveConfig;

/// The name of the `sieve.*` setting `statement` shows, if it shows one.
pub(crate) fn sieve_setting_shown(statement: &Statement) -> Option<String> {
    let Statement::ShowVariable { variable } = statement else {
        return None;
    };
    let name = variable
        .iter()
        .map(|part| part.value.to_ascii_lowercase())
        .collect::<Vec<_>>()
        .join(".");
    name.starts_with(&format!("{}.", SieveConfig::PREFIX))
        .then_some(name)
}

/// `SHOW sieve.x` as DataFusion answers `SHOW datafusion.x`: one row of
/// `name` and `value`; an unknown name is an error.
pub(crate) fn show_sieve_setting(context: &SessionContext, name: &str) -> Result<DataFrame> {
    let key = &name[SieveConfig::PREFIX.len() + 1..];
    let state = context.state();
    let sieve = SieveConfig::of(state.config().options());
    let Some(entry) = sieve.entries().into_iter().find(|entry| entry.key == key) else {
        return Err(DataFusionError::Configuration(format!(
            "'{name}' is not a setting (SHOW ALL lists the datafusion.* ones; sieve.* are in the README)"
        )));
    };
    let schema = Arc::new(Schema::new(vec![
        Field::new("name", DataType::Utf8, false),
        Field::new("value", DataType::Utf8, true),
    ]));
    let batch = RecordBatch::try_new(
        schema,
        vec![
            Arc::new(StringArray::from(vec![name.to_string()])),
            Arc::new(StringArray::from(vec![entry.value])),
        ],
    )?;
    context.read_batch(batch)
}
