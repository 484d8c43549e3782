//! Where the command line gets the storage secret from.
//!
//! `sieve storage` and the compute commands (`sieve sql --cluster`, `sieve
//! demo --cluster`) read the shared secret from `--secret-file`, or else
//! from the environment variable [`SECRET_ENV`]; never from the command
//! line, where every user of the host could read it. The embedded cluster
//! and `sieve bench` make a fresh random secret per run ([`random_secret`]).

use std::io::Read;
use std::path::Path;

use datafusion::common::{plan_datafusion_err, DataFusionError, Result};
use sieve_fragment::Secret;

/// The environment variable that holds the storage secret.
pub const SECRET_ENV: &str = "SIEVE_SECRET";

/// Random bytes in a generated secret: 256 bits.
const RANDOM_SECRET_BYTES: usize = 32;

/// The secret in `file` if given, else in [`SECRET_ENV`], else none.
pub fn load_secret(file: Option<&Path>) -> Result<Option<Secret>> {
    if let Some(file) = file {
        let text = std::fs::read_to_string(file).map_err(|error| {
            plan_datafusion_err!("cannot read the secret file {}: {error}", file.display())
        })?;
        return Secret::new(text).map(Some);
    }
    match std::env::var(SECRET_ENV) {
        Ok(text) => Secret::new(text).map(Some),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(error) => Err(plan_datafusion_err!("{SECRET_ENV}: {error}")),
    }
}

/// A fresh secret of [`RANDOM_SECRET_BYTES`] bytes from `/dev/urandom`
/// (std and the kernel; no crate needed).
pub fn random_secret() -> Result<Secret> {
    let mut random = [0u8; RANDOM_SECRET_BYTES];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut source| source.read_exact(&mut random))
        .map_err(|error| {
            DataFusionError::Execution(format!("cannot read /dev/urandom for a secret: {error}"))
        })?;
    Secret::from_random_bytes(&random)
}
