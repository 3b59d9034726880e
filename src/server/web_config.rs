//! The agent's web configuration file (`gpumem serve --web-config-file`), in the format of the
//! Prometheus exporter-toolkit (node_exporter's, dcgm-exporter's `--web-config-file`): TLS and
//! basic authentication for `/metrics`, the page and its APIs; and, gpumem's one addition to
//! the format, bearer tokens (`bearer_auth_tokens_file`), which a ServiceMonitor's
//! `authorization` sends from a Secret.
//!
//! ```yaml
//! tls_server_config:
//!   cert_file: /etc/gpumem/tls/tls.crt      # re-read when it changes
//!   key_file: /etc/gpumem/tls/tls.key
//!   client_auth_type: RequireAndVerifyClientCert   # or NoClientCert, VerifyClientCertIfGiven
//!   client_ca_file: /etc/gpumem/tls/ca.crt
//!   min_version: TLS12                      # TLS12 or TLS13
//! basic_auth_users:
//!   prometheus: $2y$10$...                  # bcrypt (htpasswd -nBC 10)
//! bearer_auth_tokens_file: /etc/gpumem/auth/tokens   # one token a line; re-read when it changes
//! ```
//!
//! A request is answered when it names a user with its password or presents one of the
//! tokens (either, where both are configured).
//!
//! Keys gpumem does not implement (`cipher_suites`, `curve_preferences`, `client_allowed_sans`,
//! inline `cert`/`key`, `http_server_config.headers`, HTTP/2) are refused by name rather than
//! ignored, as are unknown keys: a file that says more than the agent does is an error.
//!
//! # Invariants (budgets)
//! - The file is at most [`MAX_FILE_BYTES`] and lists at most [`MAX_USERS`] users.
//! - A request's credentials are checked with bcrypt (its cost is the hash's: 60 ms at cost
//!   10, 245 ms at 12, measured on a 2-vCPU machine) on a blocking thread, at most [`MAX_CHECKS`] at once, a dropped request's
//!   check included (the permit goes with the work); a request that waits [`MAX_WAIT`] for
//!   its turn is answered 503 (nothing is known of its credentials), not 401. An unknown user costs one check against a dummy hash of the
//!   users' highest cost, so timing does not tell users apart. A successful check is
//!   remembered (the password's SHA-256, per user, compared in constant time), so a scraper
//!   pays for bcrypt once, not per scrape. An `Authorization` header over
//!   [`MAX_HEADER_BYTES`] is refused unread.
//! - The tokens file is at most [`MAX_TOKENS_FILE_BYTES`], at most [`MAX_TOKENS`] tokens of
//!   [`MIN_TOKEN_BYTES`] to [`MAX_HEADER_BYTES`] visible ASCII characters each. Only their
//!   SHA-256 digests are kept, and a presented token is compared with every one in constant
//!   time. The file is looked at again at most every [`TOKENS_RECHECK`] and re-read when its
//!   modification time, length or inode changed (a Secret's rotation); a file that has become
//!   unreadable, missing or invalid (emptied, overfilled) revokes every token until it is
//!   valid again, with a warning: revocation fails closed.
//! - The file is read once, at start: new users or passwords take a restart (the
//!   certificate files and the tokens file it names are re-read as they change). Credentials
//!   over plain HTTP travel in the clear: configure `tls_server_config` with them.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use axum::http::HeaderValue;
use serde::Deserialize;

use super::tls::{ClientAuth, TlsSettings, Version};

/// The largest web configuration file read.
pub const MAX_FILE_BYTES: u64 = 64 * 1024;
/// Users a file may list.
pub const MAX_USERS: usize = 64;
/// bcrypt checks run at once.
pub const MAX_CHECKS: usize = 2;
/// The longest `Authorization` header read.
pub const MAX_HEADER_BYTES: usize = 1024;
/// The longest a request waits for its turn to be checked.
pub const MAX_WAIT: Duration = Duration::from_secs(5);
/// The largest tokens file read.
pub const MAX_TOKENS_FILE_BYTES: u64 = 16 * 1024;
/// Tokens a tokens file may hold.
pub const MAX_TOKENS: usize = 16;
/// The shortest token accepted in the file: shorter is no secret.
pub const MIN_TOKEN_BYTES: usize = 16;
/// How often the tokens file is looked at for a change, at most.
pub const TOKENS_RECHECK: Duration = Duration::from_secs(1);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    tls_server_config: Option<TlsFile>,
    #[serde(default)]
    http_server_config: Option<HttpFile>,
    #[serde(default)]
    basic_auth_users: Option<BTreeMap<String, String>>,
    #[serde(default)]
    bearer_auth_tokens_file: Option<PathBuf>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TlsFile {
    cert_file: Option<PathBuf>,
    key_file: Option<PathBuf>,
    client_auth_type: Option<String>,
    client_ca_file: Option<PathBuf>,
    min_version: Option<String>,
    max_version: Option<String>,
    // Known to the exporter-toolkit, not implemented: refused by name.
    cert: Option<serde_yaml_ng::Value>,
    key: Option<serde_yaml_ng::Value>,
    client_ca: Option<serde_yaml_ng::Value>,
    cipher_suites: Option<serde_yaml_ng::Value>,
    curve_preferences: Option<serde_yaml_ng::Value>,
    client_allowed_sans: Option<serde_yaml_ng::Value>,
    prefer_server_cipher_suites: Option<serde_yaml_ng::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HttpFile {
    http2: Option<bool>,
    headers: Option<serde_yaml_ng::Value>,
}

/// What a web configuration file configures.
#[derive(Debug, Default)]
pub struct WebConfig {
    /// TLS, where configured.
    pub tls: Option<TlsSettings>,
    /// Authentication, where users or tokens are configured.
    pub auth: Option<Arc<Authentication>>,
}

/// Who is answered: users with their passwords, bearer tokens, or either.
#[derive(Debug)]
pub struct Authentication {
    basic: Option<BasicAuth>,
    bearer: Option<BearerTokens>,
}

/// What a check of a request's credentials found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Configured credentials.
    Allowed,
    /// None, or not configured ones.
    Refused,
    /// Not checked: every check was taken for [`MAX_WAIT`] (a flood of wrong passwords).
    /// Nothing is known of them: answered 503, not 401.
    Busy,
}

impl Authentication {
    /// What `header` (a request's `Authorization`) carries.
    pub async fn check(&self, header: Option<&HeaderValue>) -> Verdict {
        if let Some(bearer) = &self.bearer
            && bearer.allows(header)
        {
            return Verdict::Allowed;
        }
        match &self.basic {
            Some(basic) => basic.check(header).await,
            None => Verdict::Refused,
        }
    }

    /// Whether `header` carries configured credentials (checked now).
    pub async fn allows(&self, header: Option<&HeaderValue>) -> bool {
        self.check(header).await == Verdict::Allowed
    }

    /// The `WWW-Authenticate` challenges of a refusal, one per scheme configured.
    pub fn challenges(&self) -> Vec<&'static str> {
        let basic = self.basic.as_ref().map(|_| "Basic realm=\"gpumem\"");
        let bearer = self.bearer.as_ref().map(|_| "Bearer realm=\"gpumem\"");
        basic.into_iter().chain(bearer).collect()
    }
}

/// Why a web configuration file was refused.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {reason}")]
pub struct WebConfigError {
    path: String,
    reason: String,
}

impl WebConfig {
    /// Reads and checks the file at `path`.
    ///
    /// # Errors
    /// A file that cannot be read, is too large, is not the format, or asks for what gpumem
    /// does not implement; the error names the key.
    pub fn load(path: &Path) -> Result<WebConfig, WebConfigError> {
        let error = |reason: String| WebConfigError {
            path: path.display().to_string(),
            reason,
        };
        let text = read_bounded(path).map_err(error)?;
        let base = path.parent().unwrap_or(Path::new("."));
        WebConfig::parse(&text, base).map_err(error)
    }

    /// The configuration `text` says, relative paths taken from `base` (the file's directory,
    /// as the exporter-toolkit does).
    ///
    /// # Errors
    /// As [`WebConfig::load`].
    pub fn parse(text: &str, base: &Path) -> Result<WebConfig, String> {
        let file: File = if text.trim().is_empty() {
            File {
                tls_server_config: None,
                http_server_config: None,
                basic_auth_users: None,
                bearer_auth_tokens_file: None,
            }
        } else {
            serde_yaml_ng::from_str(text).map_err(|e| e.to_string())?
        };
        if let Some(http) = &file.http_server_config {
            if http.headers.is_some() {
                return Err("http_server_config.headers is not supported by gpumem".into());
            }
            if http.http2 == Some(true) {
                return Err("http_server_config.http2: gpumem serves HTTP/1.1 only".into());
            }
        }
        let tls = file
            .tls_server_config
            .map(|t| tls_settings(t, base))
            .transpose()?;
        let basic = match file.basic_auth_users {
            Some(users) if !users.is_empty() => Some(BasicAuth::new(users)?),
            _ => None,
        };
        let bearer = file
            .bearer_auth_tokens_file
            .map(|p| BearerTokens::load(if p.is_absolute() { p } else { base.join(p) }))
            .transpose()?;
        let auth = (basic.is_some() || bearer.is_some())
            .then(|| Arc::new(Authentication { basic, bearer }));
        Ok(WebConfig { tls, auth })
    }
}

fn read_bounded(path: &Path) -> Result<String, String> {
    read_at_most(path, MAX_FILE_BYTES)
}

fn read_at_most(path: &Path, limit: u64) -> Result<String, String> {
    crate::bounded_file::read(path, limit).map_err(|e| e.to_string())
}

fn tls_settings(t: TlsFile, base: &Path) -> Result<TlsSettings, String> {
    let unsupported = [
        ("cert", t.cert.is_some()),
        ("key", t.key.is_some()),
        ("client_ca", t.client_ca.is_some()),
        ("cipher_suites", t.cipher_suites.is_some()),
        ("curve_preferences", t.curve_preferences.is_some()),
        ("client_allowed_sans", t.client_allowed_sans.is_some()),
        (
            "prefer_server_cipher_suites",
            t.prefer_server_cipher_suites.is_some(),
        ),
    ];
    if let Some((key, _)) = unsupported.iter().find(|(_, given)| *given) {
        return Err(format!(
            "tls_server_config.{key} is not supported by gpumem (give cert_file and key_file; rustls chooses suites and curves)"
        ));
    }
    let path = |p: PathBuf| if p.is_absolute() { p } else { base.join(p) };
    let (Some(cert), Some(key)) = (t.cert_file, t.key_file) else {
        return Err("tls_server_config needs both cert_file and key_file".into());
    };
    let version = |name: &str, value: Option<String>, default: Version| match value.as_deref() {
        None => Ok(default),
        Some("TLS12") => Ok(Version::Tls12),
        Some("TLS13") => Ok(Version::Tls13),
        Some("TLS10" | "TLS11") => Err(format!(
            "tls_server_config.{name}: gpumem speaks TLS 1.2 and 1.3 only"
        )),
        Some(other) => Err(format!(
            "tls_server_config.{name}: {other:?} is not TLS12 or TLS13"
        )),
    };
    let min_version = version("min_version", t.min_version, Version::Tls12)?;
    let max_version = version("max_version", t.max_version, Version::Tls13)?;
    if min_version > max_version {
        return Err("tls_server_config: min_version is above max_version".into());
    }
    let ca = t.client_ca_file.map(path);
    let client_auth = match (t.client_auth_type.as_deref(), ca) {
        (None | Some("NoClientCert"), None) => ClientAuth::None,
        (None | Some("NoClientCert"), Some(_)) => {
            return Err(
                "tls_server_config.client_ca_file is given but client_auth_type does not ask for certificates"
                    .into(),
            );
        }
        (Some("VerifyClientCertIfGiven"), Some(ca)) => ClientAuth::Optional(ca),
        (Some("RequireAndVerifyClientCert"), Some(ca)) => ClientAuth::Required(ca),
        (Some(kind @ ("VerifyClientCertIfGiven" | "RequireAndVerifyClientCert")), None) => {
            return Err(format!(
                "tls_server_config.client_auth_type {kind} needs client_ca_file"
            ));
        }
        (Some(kind @ ("RequestClientCert" | "RequireAnyClientCert")), _) => {
            return Err(format!(
                "tls_server_config.client_auth_type {kind} accepts unverified certificates: gpumem verifies them (VerifyClientCertIfGiven, RequireAndVerifyClientCert)"
            ));
        }
        (Some(other), _) => {
            return Err(format!(
                "tls_server_config.client_auth_type {other:?} is not one of NoClientCert, VerifyClientCertIfGiven, RequireAndVerifyClientCert"
            ));
        }
    };
    Ok(TlsSettings {
        cert: path(cert),
        key: path(key),
        client_auth,
        min_version,
        max_version,
    })
}

/// Bearer tokens, by their SHA-256 digests, from a file re-read when it changes.
#[derive(Debug)]
pub struct BearerTokens {
    path: PathBuf,
    loaded: Mutex<LoadedTokens>,
}

#[derive(Debug)]
struct LoadedTokens {
    digests: Vec<[u8; 32]>,
    /// The file's version when read.
    version: FileVersion,
    looked: Instant,
}

impl BearerTokens {
    /// The tokens in the file at `path`.
    ///
    /// # Errors
    /// A file that cannot be read, is too large, or holds no token, too many, or one that is
    /// too short, too long or not visible ASCII.
    pub fn load(path: PathBuf) -> Result<BearerTokens, String> {
        let (digests, version) = read_tokens(&path)?;
        Ok(BearerTokens {
            path,
            loaded: Mutex::new(LoadedTokens {
                digests,
                version,
                looked: Instant::now(),
            }),
        })
    }

    /// Whether `header` is `Bearer <token>` with a token of the file.
    pub fn allows(&self, header: Option<&HeaderValue>) -> bool {
        let Some(token) = header.and_then(bearer_token) else {
            return false;
        };
        let digest = sha256(token.as_bytes());
        let mut loaded = self.loaded.lock().unwrap_or_else(PoisonError::into_inner);
        if loaded.looked.elapsed() >= TOKENS_RECHECK {
            loaded.looked = Instant::now();
            // A file changed, gone or unreadable is read again; one that is not valid now
            // revokes every token (emptied, deleted, overfilled: a revocation must not
            // leave the old tokens standing).
            let version = file_version(&self.path).ok();
            if version != Some(loaded.version) {
                match read_tokens(&self.path) {
                    Ok((digests, version)) => {
                        tracing::info!(path = ?self.path, tokens = digests.len(), "bearer tokens re-read");
                        loaded.digests = digests;
                        loaded.version = version;
                    }
                    Err(e) => {
                        if !loaded.digests.is_empty() {
                            tracing::warn!(path = ?self.path, error = %e, "the bearer tokens file is not valid now: no token is accepted until it is");
                        }
                        loaded.digests.clear();
                        loaded.version = version.unwrap_or_default();
                    }
                }
            }
        }
        // Every digest compared, so the time does not say which one matched.
        loaded
            .digests
            .iter()
            .fold(false, |found, d| equal(d, &digest) | found)
    }
}

/// What tells a file's contents changed: its modification time, length and inode (a
/// Secret's rotation swaps a symbolic link to a new file).
type FileVersion = (Option<SystemTime>, u64, u64);

fn file_version(path: &Path) -> Result<FileVersion, String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).map_err(|e| e.to_string())?;
    Ok((meta.modified().ok(), meta.len(), meta.ino()))
}

/// The digests of a tokens file's tokens (one a line; blank lines skipped) and its version.
fn read_tokens(path: &Path) -> Result<(Vec<[u8; 32]>, FileVersion), String> {
    let error = |reason: String| format!("bearer_auth_tokens_file {}: {reason}", path.display());
    let version = file_version(path).map_err(error)?;
    let text = read_at_most(path, MAX_TOKENS_FILE_BYTES).map_err(error)?;
    let mut digests = Vec::new();
    for (n, token) in text.lines().map(str::trim).enumerate() {
        if token.is_empty() {
            continue;
        }
        let line = n + 1;
        if !(MIN_TOKEN_BYTES..=MAX_HEADER_BYTES).contains(&token.len()) {
            return Err(error(format!(
                "the token on line {line} is not {MIN_TOKEN_BYTES} to {MAX_HEADER_BYTES} bytes"
            )));
        }
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(error(format!(
                "the token on line {line} is not visible ASCII"
            )));
        }
        if digests.len() == MAX_TOKENS {
            return Err(error(format!("more than {MAX_TOKENS} tokens")));
        }
        digests.push(sha256(token.as_bytes()));
    }
    if digests.is_empty() {
        return Err(error("no token".into()));
    }
    Ok((digests, version))
}

/// The token of a `Bearer` `Authorization` header.
fn bearer_token(header: &HeaderValue) -> Option<&str> {
    if header.len() > MAX_HEADER_BYTES + "Bearer ".len() {
        return None;
    }
    let (scheme, token) = header.to_str().ok()?.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Users and their bcrypt hashes, and the passwords last verified.
#[derive(Debug)]
pub struct BasicAuth {
    users: BTreeMap<String, String>,
    /// What an unknown user is checked against: a hash of no one's password at the users'
    /// highest cost.
    dummy: String,
    /// Per user, the SHA-256 of the password bcrypt last accepted.
    verified: Mutex<HashMap<String, [u8; 32]>>,
    checks: Arc<tokio::sync::Semaphore>,
}

impl BasicAuth {
    /// Users and their hashes (each a bcrypt hash: `$2a$`, `$2b$` or `$2y$`).
    ///
    /// # Errors
    /// Too many users, or a hash that is not bcrypt.
    pub fn new(users: BTreeMap<String, String>) -> Result<BasicAuth, String> {
        if users.len() > MAX_USERS {
            return Err(format!(
                "basic_auth_users lists more than {MAX_USERS} users"
            ));
        }
        // bcrypt's lowest cost; the users' highest is taken below.
        let mut cost = 4;
        for (user, hash) in &users {
            if user.is_empty() || user.contains(':') {
                return Err(format!("basic_auth_users: {user:?} is not a user name"));
            }
            let parts = hash.parse::<bcrypt::HashParts>().map_err(|_| {
                format!("basic_auth_users.{user}: not a bcrypt hash (htpasswd -nBC 10 {user})")
            })?;
            cost = cost.max(parts.get_cost());
        }
        let dummy = if users.is_empty() {
            String::new()
        } else {
            bcrypt::hash("no one's password", cost).map_err(|e| e.to_string())?
        };
        Ok(BasicAuth {
            users,
            dummy,
            verified: Mutex::new(HashMap::new()),
            checks: Arc::new(tokio::sync::Semaphore::new(MAX_CHECKS)),
        })
    }

    /// Whether `header` (a request's `Authorization`) names a user with its password.
    pub async fn allows(&self, header: Option<&HeaderValue>) -> bool {
        self.check(header).await == Verdict::Allowed
    }

    /// What `header` (a request's `Authorization`) names: a user with its password, or not,
    /// or [`Verdict::Busy`] where no check came within [`MAX_WAIT`].
    pub async fn check(&self, header: Option<&HeaderValue>) -> Verdict {
        let Some((user, password)) = header.and_then(credentials) else {
            return Verdict::Refused;
        };
        let digest = sha256(password.as_bytes());
        let remembered = self
            .verified
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&user)
            .is_some_and(|d| equal(d, &digest));
        if remembered {
            return Verdict::Allowed;
        }
        let turn = Arc::clone(&self.checks).acquire_owned();
        let Ok(Ok(permit)) = tokio::time::timeout(MAX_WAIT, turn).await else {
            return Verdict::Busy;
        };
        let known = self.users.contains_key(&user);
        let hash = self.users.get(&user).unwrap_or(&self.dummy).clone();
        // The permit goes with the work: a dropped request's check still counts.
        let ok = tokio::task::spawn_blocking(move || {
            let ok = bcrypt::verify(password, &hash);
            drop(permit);
            ok
        })
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or(false)
            && known;
        if !ok {
            return Verdict::Refused;
        }
        self.verified
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(user, digest);
        Verdict::Allowed
    }
}

/// The user and password of a `Basic` `Authorization` header.
fn credentials(header: &HeaderValue) -> Option<(String, String)> {
    use base64::Engine;
    if header.len() > MAX_HEADER_BYTES {
        return None;
    }
    let text = header.to_str().ok()?;
    let (scheme, encoded) = text.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()?;
    let decoded = String::from_utf8(decoded).ok()?;
    let (user, password) = decoded.split_once(':')?;
    Some((user.to_string(), password.to_string()))
}

/// Whether two digests are equal, in time independent of where they differ.
fn equal(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = [0; 32];
    out.copy_from_slice(digest.as_ref());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<WebConfig, String> {
        WebConfig::parse(text, Path::new("/etc/gpumem"))
    }

    #[test]
    fn the_toolkits_keys_are_read_and_relative_paths_are_the_files() {
        let empty = parse("").expect("an empty file configures nothing");
        assert!(empty.tls.is_none() && empty.auth.is_none());
        let hash = bcrypt::hash("pw", 4).expect("hash");
        let config = parse(&format!(
            "tls_server_config:\n  cert_file: tls/tls.crt\n  key_file: /keys/tls.key\n  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.crt\n  min_version: TLS13\nhttp_server_config:\n  http2: false\nbasic_auth_users:\n  alice: {hash}\n"
        ))
        .expect("valid");
        let tls = config.tls.expect("tls");
        assert_eq!(tls.cert, Path::new("/etc/gpumem/tls/tls.crt"));
        assert_eq!(tls.key, Path::new("/keys/tls.key"));
        assert_eq!(
            tls.client_auth,
            ClientAuth::Required(PathBuf::from("/etc/gpumem/ca.crt"))
        );
        assert_eq!(
            (tls.min_version, tls.max_version),
            (Version::Tls13, Version::Tls13)
        );
        assert!(
            config
                .auth
                .is_some_and(|a| a.challenges() == ["Basic realm=\"gpumem\""])
        );
    }

    #[test]
    fn what_gpumem_does_not_implement_is_refused_by_name() {
        let tls = "tls_server_config:\n  cert_file: a\n  key_file: b\n";
        for (text, says) in [
            (
                "tls_server_config:\n  cert_file: a\n",
                "both cert_file and key_file",
            ),
            (
                &format!("{tls}  cipher_suites: [TLS_AES_128_GCM_SHA256]\n") as &str,
                "cipher_suites",
            ),
            (
                &format!("{tls}  curve_preferences: [X25519]\n"),
                "curve_preferences",
            ),
            (
                &format!("{tls}  min_version: TLS11\n"),
                "TLS 1.2 and 1.3 only",
            ),
            (
                &format!("{tls}  min_version: TLS13\n  max_version: TLS12\n"),
                "min_version is above",
            ),
            (
                &format!("{tls}  client_auth_type: RequireAndVerifyClientCert\n"),
                "needs client_ca_file",
            ),
            (
                &format!("{tls}  client_auth_type: RequireAnyClientCert\n"),
                "unverified",
            ),
            (
                &format!("{tls}  client_ca_file: ca.crt\n"),
                "does not ask for certificates",
            ),
            (
                "http_server_config:\n  headers: {X-Frame-Options: deny}\n",
                "headers",
            ),
            ("http_server_config:\n  http2: true\n", "HTTP/1.1 only"),
            (
                "basic_auth_users:\n  alice: plaintext\n",
                "not a bcrypt hash",
            ),
            ("tls_config:\n  cert_file: a\n", "unknown field"),
            ("basic_auth_users: [alice]\n", "invalid type"),
        ] {
            let error = parse(text).expect_err(text);
            assert!(error.contains(says), "{text:?}: {error}");
        }
        let many: String = (0..=MAX_USERS)
            .map(|i| {
                format!("  u{i}: $2y$04$abcdefghijklmnopqrstuu5bUAcxzJ3hLPj6jbxNGQp6h1dJe6i2W\n")
            })
            .collect();
        let error = parse(&format!("basic_auth_users:\n{many}")).expect_err("too many");
        assert!(error.contains("more than"), "{error}");
    }

    #[test]
    fn credentials_are_checked_once_and_remembered() {
        let users = BTreeMap::from([("alice".to_string(), bcrypt::hash("pw", 4).expect("hash"))]);
        let auth = Arc::new(BasicAuth::new(users).expect("users"));
        let basic = |user: &str, password: &str| {
            use base64::Engine;
            let token =
                base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
            HeaderValue::from_str(&format!("Basic {token}")).expect("header")
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            assert!(!auth.allows(None).await);
            assert!(!auth.allows(Some(&basic("alice", "wrong"))).await);
            assert!(!auth.allows(Some(&basic("bob", "pw"))).await);
            assert!(
                !auth
                    .allows(Some(&HeaderValue::from_static("Bearer abc")))
                    .await
            );
            let huge = HeaderValue::from_str(&format!("Basic {}", "A".repeat(MAX_HEADER_BYTES)))
                .expect("header");
            assert!(!auth.allows(Some(&huge)).await);
            assert!(auth.verified.lock().expect("lock").is_empty());
            assert!(auth.allows(Some(&basic("alice", "pw"))).await);
            assert_eq!(auth.verified.lock().expect("lock").len(), 1, "remembered");
            // An unknown user costs what the users cost.
            let dummy: bcrypt::HashParts = auth.dummy.parse().expect("a bcrypt hash");
            assert_eq!(dummy.get_cost(), 4);
            assert!(auth.allows(Some(&basic("alice", "pw"))).await);
            // Another password is checked again, never taken for the remembered one.
            assert!(!auth.allows(Some(&basic("alice", "pw2"))).await);
        });
        // Issue 53, item 10: with every check taken (a flood of wrong passwords), a scraper
        // never verified is told to try again (503), not that its password is wrong (401);
        // a remembered one is still answered.
        runtime.block_on(async {
            tokio::time::pause();
            let _taken = Arc::clone(&auth.checks)
                .acquire_many_owned(MAX_CHECKS as u32)
                .await
                .expect("permits");
            assert_eq!(auth.check(Some(&basic("carol", "pw"))).await, Verdict::Busy);
            assert_eq!(
                auth.check(Some(&basic("alice", "pw"))).await,
                Verdict::Allowed
            );
        });
    }

    #[test]
    fn bearer_tokens_are_checked_and_follow_their_file() {
        let dir = std::env::temp_dir().join(format!("gpumem-tokens-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("tokens");
        let (old, new) = ("0123456789abcdef-old", "0123456789abcdef-newer");
        std::fs::write(&file, format!("{old}\n\n")).expect("write");
        let config = WebConfig::parse("bearer_auth_tokens_file: tokens\n", &dir).expect("valid");
        let auth = config.auth.expect("auth");
        assert_eq!(auth.challenges(), ["Bearer realm=\"gpumem\""]);
        let bearer = |token: &str| HeaderValue::from_str(&format!("Bearer {token}")).expect("h");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            assert!(auth.allows(Some(&bearer(old))).await);
            assert!(
                auth.allows(Some(
                    &HeaderValue::from_str(&format!("bearer  {old} ")).expect("h")
                ))
                .await
            );
            assert!(!auth.allows(Some(&bearer("0123456789abcdef-odd"))).await);
            assert!(!auth.allows(None).await);
            // Not basic credentials either, whatever the token says.
            assert!(
                !auth
                    .allows(Some(&HeaderValue::from_static("Basic YWxpY2U6cHc=")))
                    .await
            );
            let huge = bearer(&"a".repeat(MAX_HEADER_BYTES + 1));
            assert!(!auth.allows(Some(&huge)).await);
        });
        // Rotated: the new token is taken once the file is looked at again, the old one not.
        std::fs::write(&file, format!("{new}\n")).expect("rotate");
        let bearer_tokens = auth.bearer.as_ref().expect("bearer");
        bearer_tokens.loaded.lock().expect("lock").looked -= TOKENS_RECHECK;
        assert!(bearer_tokens.allows(Some(&bearer(new))));
        assert!(!bearer_tokens.allows(Some(&bearer(old))));
        // Issue 53, item 10: emptied, overfilled, broken or deleted, the file revokes every
        // token (it failed open: the last tokens stood until a restart); valid again, its
        // tokens are taken.
        let overfilled = format!("{new}\n").repeat(MAX_TOKENS + 1);
        for broken in ["", "short\n", overfilled.as_str(), "(deleted)"] {
            if broken == "(deleted)" {
                std::fs::remove_file(&file).expect("delete");
            } else {
                std::fs::write(&file, broken).expect("break");
            }
            bearer_tokens.loaded.lock().expect("lock").looked -= TOKENS_RECHECK;
            assert!(!bearer_tokens.allows(Some(&bearer(new))), "{broken:?}");
            std::fs::write(&file, format!("{new}\n")).expect("mend");
            bearer_tokens.loaded.lock().expect("lock").looked -= TOKENS_RECHECK;
            assert!(
                bearer_tokens.allows(Some(&bearer(new))),
                "mended after {broken:?}"
            );
        }
        // At start, a bad file is an error naming why.
        for (text, says) in [
            ("", "no token"),
            ("short\n", "16 to"),
            ("0123456789abcdef ghij\n", "visible ASCII"),
            (
                &format!("{old}\n").repeat(MAX_TOKENS + 1) as &str,
                "more than",
            ),
            (
                &"a".repeat(MAX_TOKENS_FILE_BYTES as usize + 1),
                "larger than",
            ),
        ] {
            std::fs::write(&file, text).expect("write");
            let error =
                WebConfig::parse("bearer_auth_tokens_file: tokens\n", &dir).expect_err(says);
            assert!(
                error.contains(says) && error.contains("bearer_auth_tokens_file"),
                "{error}"
            );
        }
        let missing =
            WebConfig::parse("bearer_auth_tokens_file: nowhere\n", &dir).expect_err("missing");
        assert!(missing.contains("nowhere"), "{missing}");
        // With users too, either is answered and both are offered.
        std::fs::write(&file, format!("{old}\n")).expect("write");
        let hash = bcrypt::hash("pw", 4).expect("hash");
        let both = WebConfig::parse(
            &format!("basic_auth_users:\n  alice: {hash}\nbearer_auth_tokens_file: tokens\n"),
            &dir,
        )
        .expect("valid")
        .auth
        .expect("auth");
        assert_eq!(both.challenges().len(), 2);
        runtime.block_on(async {
            assert!(both.allows(Some(&bearer(old))).await);
            assert!(
                both.allows(Some(&HeaderValue::from_static("Basic YWxpY2U6cHc=")))
                    .await
            );
        });
        let _ = std::fs::remove_dir_all(&dir);
    }
}
