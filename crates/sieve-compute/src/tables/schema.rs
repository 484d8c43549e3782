//! The session's `public` schema: the tables the storage nodes were found
//! holding (`sieve gen`'s), what the session registers itself (views), and
//! the tables users own, each looked up at the latest version.

use std::sync::Arc;

use async_trait::async_trait;
use datafusion::catalog::{MemorySchemaProvider, SchemaProvider, TableProvider};
use datafusion::common::{plan_err, DataFusionError, Result};

use super::{OwnedTable, OwnedTables};
use crate::{ClusterCatalog, Traffic};

/// See the module documentation.
#[derive(Debug)]
pub struct SieveSchema {
    registered: MemorySchemaProvider,
    owned: Option<Arc<OwnedTables>>,
    catalog: Arc<ClusterCatalog>,
    traffic: Arc<Traffic>,
}

impl SieveSchema {
    /// A schema over `catalog`'s owned tables (if it has a table catalog).
    pub fn new(catalog: Arc<ClusterCatalog>, traffic: Arc<Traffic>) -> Self {
        Self {
            registered: MemorySchemaProvider::new(),
            owned: catalog.owned.clone(),
            catalog,
            traffic,
        }
    }

    fn owned_names(&self) -> Vec<String> {
        let Some(owned) = &self.owned else {
            return vec![];
        };
        owned
            .store()
            .latest_version()
            .and_then(|version| owned.store().tables_at(version))
            .map(|tables| tables.into_keys().collect())
            .unwrap_or_else(|error| {
                log::warn!("cannot list the tables users own: {error}");
                vec![]
            })
    }
}

#[async_trait]
impl SchemaProvider for SieveSchema {
    fn table_names(&self) -> Vec<String> {
        let mut names = self.registered.table_names();
        names.extend(self.owned_names());
        names.sort();
        names.dedup();
        names
    }

    async fn table(&self, name: &str) -> Result<Option<Arc<dyn TableProvider>>> {
        if let Some(table) = self.registered.table(name).await? {
            return Ok(Some(table));
        }
        let Some(owned) = &self.owned else {
            return Ok(None);
        };
        Ok(
            OwnedTable::latest(owned, &self.catalog, &self.traffic, name)?
                .map(|table| Arc::new(table) as Arc<dyn TableProvider>),
        )
    }

    fn register_table(
        &self,
        name: String,
        table: Arc<dyn TableProvider>,
    ) -> Result<Option<Arc<dyn TableProvider>>> {
        if self.owned_names().contains(&name) {
            return plan_err!("table '{name}' already exists");
        }
        self.registered.register_table(name, table)
    }

    /// `DROP TABLE` of an owned table commits its removal.
    fn deregister_table(&self, name: &str) -> Result<Option<Arc<dyn TableProvider>>> {
        if self.registered.table_exist(name) {
            return self.registered.deregister_table(name);
        }
        let Some(owned) = &self.owned else {
            return Ok(None);
        };
        let Some(table) = OwnedTable::latest(owned, &self.catalog, &self.traffic, name)? else {
            return Ok(None);
        };
        match owned
            .store()
            .drop_table(name, &format!("DROP TABLE {name}"))?
        {
            Some(_) => {
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    let owned = Arc::clone(owned);
                    runtime.spawn(async move {
                        if let Err(error) = owned.purge().await {
                            log::warn!("removing a dropped table's slices failed: {error}");
                        }
                    });
                }
                Ok(Some(Arc::new(table)))
            }
            None => Err(DataFusionError::Plan(format!(
                "table '{name}' was dropped by another statement"
            ))),
        }
    }

    fn table_exist(&self, name: &str) -> bool {
        self.registered.table_exist(name) || self.owned_names().iter().any(|owned| owned == name)
    }
}
