//! TLS for the admin API: the server's certificate and key
//! (`[admin] tls_cert`, `tls_key`), loaded once at bind and by `weir check`.
//!
//! rustls with the `ring` provider (it builds with a C compiler alone).
//! Every failure names the file and what to do: unreadable, no PEM
//! certificate or key in it, a key that does not belong to the certificate.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, bail};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::config::AdminConfig;

/// The rustls server config of `cfg`, `None` when it names no certificate.
///
/// Errors when only one of `tls_cert` / `tls_key` is set, when a file cannot
/// be read or holds no PEM certificate (key), or when the key does not
/// match the certificate.
pub fn server_config(cfg: &AdminConfig) -> anyhow::Result<Option<Arc<rustls::ServerConfig>>> {
    match (&cfg.tls_cert, &cfg.tls_key) {
        (None, None) => Ok(None),
        (Some(cert), Some(key)) => load_server_config(cert, key).map(Some),
        _ => bail!("[admin] tls_cert and tls_key go together: set both or neither"),
    }
}

/// A rustls server config from a PEM certificate chain and its private key.
pub fn load_server_config(cert: &Path, key: &Path) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    let chain = read_certs(cert, "[admin] tls_cert")?;
    let key_pem = std::fs::read(key)
        .with_context(|| format!("cannot read [admin] tls_key {}", key.display()))?;
    let key_der = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| {
        anyhow::anyhow!(
            "[admin] tls_key {} holds no usable PEM private key ({e}): give the key of tls_cert \
             (a '-----BEGIN PRIVATE KEY-----', 'EC PRIVATE KEY' or 'RSA PRIVATE KEY' block)",
            key.display()
        )
    })?;
    // `with_single_cert` also checks that the key belongs to the certificate.
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .map_err(|e| {
            anyhow::anyhow!(
                "[admin] tls_key {} and tls_cert {} do not make a usable pair: {e}; \
                 give the private key the certificate was made for",
                key.display(),
                cert.display()
            )
        })?;
    Ok(Arc::new(config))
}

/// Every certificate in a PEM file, at least one.
pub fn read_certs(path: &Path, what: &str) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let pem =
        std::fs::read(path).with_context(|| format!("cannot read {what} {}", path.display()))?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| {
            let why = match e {
                rustls::pki_types::pem::Error::MissingSectionEnd { .. } => {
                    "a PEM block is not closed by its '-----END ...-----' line".to_owned()
                }
                other => other.to_string(),
            };
            anyhow::anyhow!("{what} {} is not valid PEM: {why}", path.display())
        })?;
    if certs.is_empty() {
        bail!(
            "{what} {} holds no PEM certificate (a '-----BEGIN CERTIFICATE-----' block)",
            path.display()
        );
    }
    Ok(certs)
}

/// The crypto provider used on both ends.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}
