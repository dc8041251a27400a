//! TLS (rustls with ring) for both listeners. The PEM files are read and checked at start and
//! re-read while the server runs ([`ServerIdentity::reload`]: on SIGHUP and every few seconds,
//! see `reload.rs`), so a rotated certificate is served without a restart. Both listeners take
//! the certificate from one [`ServerIdentity`] at each handshake: the gRPC side through its own
//! rustls acceptor (ALPN h2) in front of tonic, the HTTP side through another (ALPN h2 and
//! http/1.1). A connection keeps the certificate it was opened with.

use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;
use tokio_rustls::rustls::{self, pki_types};

use crate::config::TlsFiles;
use crate::reload::{Reread, reload_file};

/// The certificate chain and key as read from the files (PEM), to tell a changed file from the
/// same one.
#[derive(Clone, PartialEq, Eq)]
struct Pem {
    cert: Vec<u8>,
    key: Vec<u8>,
}

impl Pem {
    /// A digest of both files (a copy of the key is not kept beside rustls's).
    fn digest(&self) -> [u8; 32] {
        let mut context = ring::digest::Context::new(&ring::digest::SHA256);
        for part in [&self.cert, &self.key] {
            context.update(&(part.len() as u64).to_le_bytes());
            context.update(part);
        }
        let mut out = [0u8; 32];
        out.copy_from_slice(context.finish().as_ref());
        out
    }
}

/// The server's certificate and key: the files they come from, and what handshakes present.
pub(crate) struct ServerIdentity {
    files: TlsFiles,
    /// The digest of what the files held when they were last loaded (files that read the same
    /// are not parsed again). Held by a reload from its read to its swap, so that two reloads
    /// cannot put an older pair back in force.
    loaded: Mutex<[u8; 32]>,
    current: Arc<CurrentCertificate>,
}

impl std::fmt::Debug for ServerIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.debug_struct("ServerIdentity")
            .field("cert", &self.files.cert)
            .field("key", &self.files.key)
            .finish_non_exhaustive()
    }
}

/// The certificate every new handshake presents (replaced whole by a reload).
struct CurrentCertificate(RwLock<Arc<CertifiedKey>>);

impl std::fmt::Debug for CurrentCertificate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CurrentCertificate").finish_non_exhaustive()
    }
}

impl ResolvesServerCert for CurrentCertificate {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.0.read()))
    }
}

/// The crypto provider of every TLS configuration here, the server's and the peers' client's
/// (ring).
pub(crate) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl ServerIdentity {
    /// Reads the files and checks that they form a usable server identity.
    ///
    /// # Errors
    /// A message naming the files and the problem.
    pub(crate) fn load(files: &TlsFiles) -> Result<Self, String> {
        let pem = read(files)?;
        let key = certified_key(&pem).map_err(|e| in_files(files, &e))?;
        Ok(Self {
            files: files.clone(),
            loaded: Mutex::new(pem.digest()),
            current: Arc::new(CurrentCertificate(RwLock::new(Arc::new(key)))),
        })
    }

    /// Reads the files again ([`crate::reload::reread`]: blocking, changed files are read
    /// until two reads agree); a certificate and key that changed and form a usable identity
    /// are presented by every handshake from now on.
    ///
    /// # Errors
    /// A message naming the files and the problem; the certificate served does not change.
    pub(crate) fn reload(&self) -> Result<Reread<()>, String> {
        reload_file(
            &self.loaded,
            Pem::digest,
            || read(&self.files),
            |pem| {
                let key = certified_key(pem).map_err(|e| in_files(&self.files, &e))?;
                *self.current.0.write() = Arc::new(key);
                Ok(())
            },
        )
    }

    /// The files, for messages.
    pub(crate) fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// A rustls acceptor offering the ALPN `protocols`, presenting the current certificate at
    /// each handshake.
    ///
    /// # Errors
    /// When rustls has no safe protocol version (not with ring).
    pub(crate) fn acceptor(&self, protocols: &[&[u8]]) -> Result<TlsAcceptor, String> {
        let current: Arc<dyn ResolvesServerCert> = self.current.clone();
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_cert_resolver(current);
        config.alpn_protocols = protocols.iter().map(|p| p.to_vec()).collect();
        Ok(TlsAcceptor::from(Arc::new(config)))
    }
}

/// A TLS client configuration (the peers' client, the NATS connection): it trusts the
/// certificates of `ca_pem` if given, else the system's roots, and presents `client`'s
/// certificate to a server that asks for one (mutual TLS) if given. `ca_flag` names the
/// setting of the CA file in messages.
///
/// # Errors
/// A message naming the problem: a CA file without a usable certificate, a client certificate
/// and key that cannot be read or do not belong together.
pub(crate) fn client_config(
    ca_pem: Option<&[u8]>,
    ca_flag: &str,
    client: Option<&TlsFiles>,
) -> Result<rustls::ClientConfig, String> {
    use pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    match ca_pem {
        Some(pem) => {
            for cert in pki_types::CertificateDer::pem_slice_iter(pem) {
                let cert = cert.map_err(|e| format!("{ca_flag}: bad CA certificate PEM: {e}"))?;
                roots
                    .add(cert)
                    .map_err(|e| format!("{ca_flag}: unusable CA certificate: {e}"))?;
            }
            if roots.is_empty() {
                return Err(format!("the CA file of {ca_flag} holds no certificate"));
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                // Every TLS connection will then fail its handshake, each saying so.
                tracing::warn!(
                    errors = found.errors.len(),
                    "no system root certificates to check TLS servers with: give {ca_flag}"
                );
            }
        }
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots);
    match client {
        None => Ok(builder.with_no_client_auth()),
        Some(files) => {
            let (certs, key) = chain_and_key(&read(files)?).map_err(|e| in_files(files, &e))?;
            builder.with_client_auth_cert(certs, key).map_err(|e| {
                in_files(
                    files,
                    &format!("the certificate and key cannot be presented: {e}"),
                )
            })
        }
    }
}

fn in_files(files: &TlsFiles, problem: &str) -> String {
    format!(
        "TLS certificate {} and key {}: {problem}",
        files.cert.display(),
        files.key.display()
    )
}

fn read(files: &TlsFiles) -> Result<Pem, String> {
    let read = |path: &std::path::Path, what: &str| {
        std::fs::read(path)
            .map_err(|e| format!("cannot read the TLS {what} {}: {e}", path.display()))
    };
    Ok(Pem {
        cert: read(&files.cert, "certificate")?,
        key: read(&files.key, "private key")?,
    })
}

/// A certificate chain and its private key, as DER.
type ChainAndKey = (
    Vec<pki_types::CertificateDer<'static>>,
    pki_types::PrivateKeyDer<'static>,
);

/// The certificate chain and key of `pem`, parsed (not checked to belong together).
fn chain_and_key(pem: &Pem) -> Result<ChainAndKey, String> {
    use pki_types::pem::PemObject;
    let certs: Vec<pki_types::CertificateDer<'static>> =
        pki_types::CertificateDer::pem_slice_iter(&pem.cert)
            .collect::<Result<_, _>>()
            .map_err(|e| format!("bad certificate PEM: {e}"))?;
    if certs.is_empty() {
        return Err("the certificate file holds no certificate".into());
    }
    let key = pki_types::PrivateKeyDer::from_pem_slice(&pem.key)
        .map_err(|e| format!("bad private key PEM: {e}"))?;
    Ok((certs, key))
}

/// The certificate chain and key of `pem`, checked to belong together.
fn certified_key(pem: &Pem) -> Result<CertifiedKey, String> {
    let (certs, key) = chain_and_key(pem)?;
    CertifiedKey::from_der(certs, key, &provider()).map_err(|e| {
        format!(
            "the certificate and key cannot serve TLS (a key of another certificate, or a key \
             type rustls does not support): {e}"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_pair(dir: &std::path::Path, name: &str) -> (Vec<u8>, Vec<u8>) {
        let certified = rcgen::generate_simple_self_signed(vec![name.to_owned()]).expect("cert");
        let pair = (
            certified.cert.pem().into_bytes(),
            certified.signing_key.serialize_pem().into_bytes(),
        );
        std::fs::write(dir.join("cert.pem"), &pair.0).expect("write");
        std::fs::write(dir.join("key.pem"), &pair.1).expect("write");
        pair
    }

    fn served(identity: &ServerIdentity) -> Vec<u8> {
        identity.current.0.read().cert[0].to_vec()
    }

    #[test]
    fn a_reload_serves_a_changed_pair_and_keeps_the_last_good_one() {
        let dir = std::env::temp_dir().join(format!("kvatlas-tls-reload-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        write_pair(&dir, "first.example");
        let files = TlsFiles {
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
        };
        let identity = ServerIdentity::load(&files).expect("loads");
        let first = served(&identity);
        assert_eq!(identity.reload(), Ok(Reread::Same), "unchanged files");
        assert_eq!(served(&identity), first);

        let first_key = std::fs::read(dir.join("key.pem")).expect("read");
        write_pair(&dir, "second.example");
        assert_eq!(identity.reload(), Ok(Reread::Changed(())), "a new pair");
        let second = served(&identity);
        assert_ne!(second, first);

        // A certificate with another certificate's key: refused, the second pair still served.
        std::fs::write(dir.join("key.pem"), &first_key).expect("write");
        let refused = identity.reload().expect_err("mismatched key");
        assert!(refused.contains("cannot serve TLS"), "{refused}");
        assert!(refused.contains("cert.pem"), "names the files: {refused}");
        assert_eq!(served(&identity), second);
        // A missing file: refused, still served.
        std::fs::remove_file(dir.join("key.pem")).expect("remove");
        let refused = identity.reload().expect_err("missing key");
        assert!(
            refused.contains("cannot read the TLS private key"),
            "{refused}"
        );
        assert_eq!(served(&identity), second);
        let _ = std::fs::remove_dir_all(dir);
    }
}
