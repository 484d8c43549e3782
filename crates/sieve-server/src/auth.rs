//! Who may log in: users and passwords, kept only as SCRAM-SHA-256 salted
//! passwords (RFC 5802, as PostgreSQL stores them), checked by pgwire's
//! SCRAM exchange; the cleartext never crosses the network.

use std::collections::HashMap;
use std::io::Read;

use async_trait::async_trait;
use datafusion::common::{plan_err, DataFusionError, Result};
use datafusion_postgres::pgwire::api::auth::sasl::scram::{gen_salted_password, SCRAM_ITERATIONS};
use datafusion_postgres::pgwire::api::auth::{AuthSource, LoginInfo, Password};
use datafusion_postgres::pgwire::error::PgWireResult;

/// Bytes of each user's random salt.
const SALT_BYTES: usize = 16;

/// The users of a server and their salted passwords.
pub struct Users {
    salted: HashMap<String, (Vec<u8>, Vec<u8>)>,
    /// What an unknown user is checked against: the login fails exactly as
    /// with a wrong password, so names cannot be probed.
    decoy: (Vec<u8>, Vec<u8>),
}

impl std::fmt::Debug for Users {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut names: Vec<&String> = self.salted.keys().collect();
        names.sort();
        formatter
            .debug_struct("Users")
            .field("names", &names)
            .finish_non_exhaustive()
    }
}

impl Users {
    /// Users from (name, password) pairs; at least one, no empty password.
    pub fn new(pairs: impl IntoIterator<Item = (String, String)>) -> Result<Self> {
        let mut salted = HashMap::new();
        for (name, password) in pairs {
            if name.is_empty() {
                return plan_err!("a user name may not be empty");
            }
            if password.is_empty() {
                return plan_err!("user '{name}' has an empty password");
            }
            let salt = random_bytes(SALT_BYTES)?;
            let hash = gen_salted_password(&password, &salt, SCRAM_ITERATIONS);
            salted.insert(name, (salt, hash));
        }
        if salted.is_empty() {
            return plan_err!("a server needs at least one user");
        }
        let decoy_salt = random_bytes(SALT_BYTES)?;
        let decoy_password = hex(&random_bytes(SALT_BYTES)?);
        let decoy_hash = gen_salted_password(&decoy_password, &decoy_salt, SCRAM_ITERATIONS);
        Ok(Self {
            salted,
            decoy: (decoy_salt, decoy_hash),
        })
    }

    /// Whether `password` is `user`'s (for logins that send the password
    /// itself, as Flight SQL's Basic handshake does). An unknown user is
    /// checked against the decoy, so both fail alike and take as long.
    pub fn check(&self, user: &str, password: &str) -> bool {
        let (known, (salt, hash)) = match self.salted.get(user) {
            Some(salted) => (true, salted),
            None => (false, &self.decoy),
        };
        let computed = gen_salted_password(password, salt, SCRAM_ITERATIONS);
        // Compared in time independent of where they differ.
        let differ = computed.len() != hash.len()
            || computed
                .iter()
                .zip(hash)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                != 0;
        known && !differ
    }

    /// A password of `bytes` random bytes, as hex.
    pub fn random_password(bytes: usize) -> Result<String> {
        Ok(hex(&random_bytes(bytes)?))
    }
}

#[async_trait]
impl AuthSource for Users {
    async fn get_password(&self, login: &LoginInfo) -> PgWireResult<Password> {
        let (salt, hash) = login
            .user()
            .and_then(|user| self.salted.get(user))
            .unwrap_or(&self.decoy);
        Ok(Password::new(Some(salt.clone()), hash.clone()))
    }
}

/// `count` bytes from the kernel's random source.
fn random_bytes(count: usize) -> Result<Vec<u8>> {
    let mut bytes = vec![0u8; count];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut source| source.read_exact(&mut bytes))
        .map_err(|error| {
            DataFusionError::Execution(format!("cannot read /dev/urandom: {error}"))
        })?;
    Ok(bytes)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_refuse_empty_names_and_passwords() {
        assert!(Users::new(vec![]).is_err());
        assert!(Users::new(vec![("a".into(), String::new())]).is_err());
        assert!(Users::new(vec![(String::new(), "p".into())]).is_err());
        let users = Users::new(vec![("a".into(), "p".into())]).unwrap();
        assert!(format!("{users:?}").contains("\"a\""));
        assert!(!format!("{users:?}").contains("\"p\""));
        assert!(users.check("a", "p"));
        assert!(!users.check("a", "q"));
        assert!(!users.check("b", "p"));
    }
}
