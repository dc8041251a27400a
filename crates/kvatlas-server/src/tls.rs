//! TLS (rustls with ring) for both listeners: the PEM files are read and checked at start, the
//! gRPC side gets them as tonic's identity, the HTTP side as a rustls acceptor (ALPN h2 and
//! http/1.1).

use std::sync::Arc;

use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::{self, pki_types};

use crate::config::TlsFiles;

/// The certificate chain and key, as PEM.
#[derive(Clone)]
pub(crate) struct TlsMaterial {
    pub(crate) cert_pem: Vec<u8>,
    pub(crate) key_pem: Vec<u8>,
}

impl std::fmt::Debug for TlsMaterial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.debug_struct("TlsMaterial").finish_non_exhaustive()
    }
}

impl TlsMaterial {
    /// Reads the files and checks that they form a usable server identity.
    ///
    /// # Errors
    /// A message naming the file and the problem.
    pub(crate) fn load(files: &TlsFiles) -> Result<Self, String> {
        let read = |path: &std::path::Path, what: &str| {
            std::fs::read(path)
                .map_err(|e| format!("cannot read the TLS {what} {}: {e}", path.display()))
        };
        let material = Self {
            cert_pem: read(&files.cert, "certificate")?,
            key_pem: read(&files.key, "private key")?,
        };
        material.acceptor().map_err(|e| {
            format!(
                "TLS certificate {} and key {}: {e}",
                files.cert.display(),
                files.key.display()
            )
        })?;
        Ok(material)
    }

    /// A rustls acceptor for the HTTP listener.
    pub(crate) fn acceptor(&self) -> Result<TlsAcceptor, String> {
        use pki_types::pem::PemObject;
        let certs: Vec<pki_types::CertificateDer<'static>> =
            pki_types::CertificateDer::pem_slice_iter(&self.cert_pem)
                .collect::<Result<_, _>>()
                .map_err(|e| format!("bad certificate PEM: {e}"))?;
        if certs.is_empty() {
            return Err("the certificate file holds no certificate".into());
        }
        let key = pki_types::PrivateKeyDer::from_pem_slice(&self.key_pem)
            .map_err(|e| format!("bad private key PEM: {e}"))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .map_err(|e| {
                format!(
                    "the certificate and key cannot serve TLS (a key of another certificate, or a \
                     key type rustls does not support): {e}"
                )
            })?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(TlsAcceptor::from(Arc::new(config)))
    }

    /// The identity for tonic's TLS.
    pub(crate) fn identity(&self) -> tonic::transport::Identity {
        tonic::transport::Identity::from_pem(&self.cert_pem, &self.key_pem)
    }
}
