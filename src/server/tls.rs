//! TLS for the agent and the webhook (feature `tls`): a certificate and key re-read when their
//! files change, and the server configuration built from them (protocol versions, client
//! certificates).
//!
//! # Invariants
//! - The certificate and key are re-read when either file changes (modification time or
//!   length: cert-manager and kubelet-projected Secrets replace them in place), looked at at
//!   most once per [`RELOAD_CHECK`] (two small files read under the lock, by the handshake
//!   that finds them changed); a pair that does not load leaves the previous one serving,
//!   says so once, and is tried again at the next check (a pair caught half-written loads
//!   once it is whole).
//! - Only TLS 1.2 and 1.3 are spoken (rustls's); client certificates, where asked for, are
//!   verified against the configured CA (the client CA file is read once, at start).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;

/// How often the certificate files are looked at.
pub const RELOAD_CHECK: Duration = Duration::from_secs(1);

/// The TLS versions a server speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Version {
    /// TLS 1.2.
    Tls12,
    /// TLS 1.3.
    Tls13,
}

/// Whether and how clients present certificates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClientAuth {
    /// Never asked for.
    None,
    /// Verified against the CA in this file where given (`VerifyClientCertIfGiven`).
    Optional(PathBuf),
    /// Required and verified against the CA in this file (`RequireAndVerifyClientCert`).
    Required(PathBuf),
}

/// What a TLS server is configured with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsSettings {
    /// The certificate chain (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// Client certificates.
    pub client_auth: ClientAuth,
    /// The oldest version spoken.
    pub min_version: Version,
    /// The newest version spoken.
    pub max_version: Version,
}

impl TlsSettings {
    /// A server with this certificate and key, no client certificates, TLS 1.2 and 1.3.
    pub fn new(cert: &Path, key: &Path) -> TlsSettings {
        TlsSettings {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            client_auth: ClientAuth::None,
            min_version: Version::Tls12,
            max_version: Version::Tls13,
        }
    }

    /// The server configuration (the certificate re-read as it changes, `what` naming the
    /// server in the log).
    ///
    /// # Errors
    /// A certificate, key or client CA that does not load, or versions out of order.
    pub fn server_config(&self, what: &'static str) -> Result<Arc<rustls::ServerConfig>, String> {
        let versions: Vec<&'static rustls::SupportedProtocolVersion> = [
            (Version::Tls12, &rustls::version::TLS12),
            (Version::Tls13, &rustls::version::TLS13),
        ]
        .into_iter()
        .filter(|(v, _)| (self.min_version..=self.max_version).contains(v))
        .map(|(_, v)| v)
        .collect();
        if versions.is_empty() {
            return Err("min_version is above max_version".into());
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_protocol_versions(&versions)
            .map_err(|e| e.to_string())?;
        let builder = match &self.client_auth {
            ClientAuth::None => builder.with_no_client_auth(),
            ClientAuth::Optional(ca) | ClientAuth::Required(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in read_chain(ca)? {
                    roots
                        .add(cert)
                        .map_err(|e| format!("{}: {e}", ca.display()))?;
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
                let verifier = if matches!(self.client_auth, ClientAuth::Optional(_)) {
                    verifier.allow_unauthenticated()
                } else {
                    verifier
                };
                builder.with_client_cert_verifier(
                    verifier
                        .build()
                        .map_err(|e| format!("{}: {e}", ca.display()))?,
                )
            }
        };
        let certs = CertFiles::load(&self.cert, &self.key, what)?;
        let mut config = builder.with_cert_resolver(Arc::new(certs));
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

/// The certificate and key files, and the pair last loaded from them.
#[derive(Debug)]
struct CertFiles {
    cert: PathBuf,
    key: PathBuf,
    what: &'static str,
    state: Mutex<Loaded>,
}

#[derive(Debug)]
struct Loaded {
    key: Arc<CertifiedKey>,
    /// The files' stamps when loaded.
    stamps: Stamps,
    checked: Instant,
    /// The last failed reload's stamps, so a bad pair is reported once.
    failed: Option<Stamps>,
}

/// The certificate's and the key's modification time and length.
type Stamps = [Option<(SystemTime, u64)>; 2];

impl CertFiles {
    fn load(cert: &Path, key: &Path, what: &'static str) -> Result<CertFiles, String> {
        let stamps = stamps(cert, key);
        let certified = certified_key(cert, key)?;
        Ok(CertFiles {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            what,
            state: Mutex::new(Loaded {
                key: Arc::new(certified),
                stamps,
                checked: Instant::now(),
                failed: None,
            }),
        })
    }
}

fn stamps(cert: &Path, key: &Path) -> Stamps {
    let stamp = |p: &Path| {
        let meta = std::fs::metadata(p).ok()?;
        Some((meta.modified().ok()?, meta.len()))
    };
    [stamp(cert), stamp(key)]
}

fn read_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<_, _>>())
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if chain.is_empty() {
        return Err(format!("{}: no certificate", path.display()));
    }
    Ok(chain)
}

fn certified_key(cert: &Path, key: &Path) -> Result<CertifiedKey, String> {
    let chain = read_chain(cert)?;
    let private =
        PrivateKeyDer::from_pem_file(key).map_err(|e| format!("{}: {e}", key.display()))?;
    let signing = rustls::crypto::ring::sign::any_supported_type(&private)
        .map_err(|e| format!("{}: {e}", key.display()))?;
    let certified = CertifiedKey::new(chain, signing);
    certified
        .keys_match()
        .map_err(|e| format!("{} and {}: {e}", cert.display(), key.display()))?;
    Ok(certified)
}

impl ResolvesServerCert for CertFiles {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.checked.elapsed() >= RELOAD_CHECK {
            state.checked = Instant::now();
            let now = stamps(&self.cert, &self.key);
            if now != state.stamps {
                match certified_key(&self.cert, &self.key) {
                    Ok(key) => {
                        tracing::info!(server = self.what, "the certificate was reloaded");
                        *state = Loaded {
                            key: Arc::new(key),
                            stamps: now,
                            checked: Instant::now(),
                            failed: None,
                        };
                    }
                    Err(e) => {
                        if state.failed != Some(now) {
                            tracing::warn!(server = self.what, error = %e, "the new certificate does not load; the previous one serves");
                        }
                        state.failed = Some(now);
                    }
                }
            }
        }
        Some(Arc::clone(&state.key))
    }
}
