//! TLS for the PostgreSQL port. A certificate or key that cannot be used
//! is an error at start: the server never falls back to plaintext.

use std::fs::File;
use std::io::BufReader;
use std::path::Path;
use std::sync::Arc;

use datafusion::common::{plan_datafusion_err, Result};
use tokio_rustls::rustls::pki_types::CertificateDer;
use tokio_rustls::rustls::{crypto::ring, ServerConfig};
use tokio_rustls::TlsAcceptor;

/// An acceptor for the certificate chain in `cert` and the private key in
/// `key` (PEM; PKCS#8, PKCS#1 or SEC1), announcing ALPN `postgresql`.
pub fn tls_acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor> {
    let open = |path: &Path, what: &str| {
        File::open(path)
            .map(BufReader::new)
            .map_err(|error| plan_datafusion_err!("TLS {what} {}: {error}", path.display()))
    };
    let certs: Vec<CertificateDer<'static>> =
        rustls_pemfile::certs(&mut open(cert, "certificate")?)
            .collect::<std::result::Result<_, _>>()
            .map_err(|error| plan_datafusion_err!("TLS certificate {}: {error}", cert.display()))?;
    if certs.is_empty() {
        return Err(plan_datafusion_err!(
            "TLS certificate {}: no PEM certificate in the file",
            cert.display()
        ));
    }
    let private_key = rustls_pemfile::private_key(&mut open(key, "key")?)
        .map_err(|error| plan_datafusion_err!("TLS key {}: {error}", key.display()))?
        .ok_or_else(|| {
            plan_datafusion_err!("TLS key {}: no PEM private key in the file", key.display())
        })?;
    let mut config = ServerConfig::builder_with_provider(Arc::new(ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|error| plan_datafusion_err!("TLS: {error}"))?
        .with_no_client_auth()
        .with_single_cert(certs, private_key)
        .map_err(|error| {
            plan_datafusion_err!(
                "TLS certificate {} and key {} do not make a server identity: {error}",
                cert.display(),
                key.display()
            )
        })?;
    config.alpn_protocols = vec![b"postgresql".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}
