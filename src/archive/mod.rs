//! Recordings in object storage: the agent archives each recording it keeps (with a JSON
//! sidecar) so that it outlives the node, and the tools and any agent's view open it from
//! there (with the `archive` feature, part of `cli`; gpumem-torch links none of it).
//!
//! - [`address`]: the archive's address, the keys' layout (`{prefix}/{cluster}/{namespace}/
//!   {pod}/{stamp}-{pid}.pickle.gz` and `.json`), an object's address;
//! - [`sidecar`]: what the JSON beside a recording says;
//! - [`uploader`]: the agent's archiving of its spool (retries, backoff, the shutdown's
//!   grace);
//! - [`profile`]: the AWS CLI's profile files, for the command line.
//!
//! Stores: S3 and S3-compatible ones (`s3://bucket/prefix`; `AWS_ENDPOINT_URL` names another
//! endpoint, path-style unless `AWS_VIRTUAL_HOSTED_STYLE_REQUEST=true`; an `http://`
//! endpoint is allowed as named), Google Cloud Storage (`gs://`), Azure Blob Storage
//! (`az://container/prefix`, with `AZURE_STORAGE_ACCOUNT_NAME`) and local directories
//! (`file:///path`), through `object_store` over rustls with ring.
//!
//! Credentials come the cloud's usual way, from the environment: workload identity (EKS's
//! IRSA, `AWS_WEB_IDENTITY_TOKEN_FILE` and `AWS_ROLE_ARN`, or EKS Pod Identity; GKE's
//! metadata server; Azure's `AZURE_FEDERATED_TOKEN_FILE`), keys from a Secret
//! (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `GOOGLE_SERVICE_ACCOUNT`,
//! `AZURE_STORAGE_ACCOUNT_KEY`, …), or the instance's role. The command line also reads the
//! AWS CLI's profile files ([`profile`]) and gcloud's application-default credentials.
//!
//! TLS: the stores' certificates are checked against Mozilla's roots, compiled in
//! (`webpki-root-certs`: the agent's image has no CA bundle), and the system's where it has
//! any (`SSL_CERT_FILE`, `SSL_CERT_DIR`, `/etc/ssl/certs`): a store behind a private CA is
//! trusted by mounting its CA and naming it with `SSL_CERT_FILE`.
//!
//! # Invariants (budgets)
//! - Every request to a store ends within [`REQUEST_TIMEOUT`] (connecting within
//!   [`CONNECT_TIMEOUT`]) and is retried at most [`STORE_RETRIES`] times within
//!   [`STORE_RETRY_TIME`]; the uploader's own backoff comes on top (`uploader`).
//! - An object is read within a byte limit the caller gives ([`Archive::get`],
//!   [`fetch`]): a larger one is refused as it crosses it, never read whole.
//! - A listing stops at [`MAX_LISTED`] objects, and says it did; an object whose key is not
//!   a path gpumem can name (`a//b`, a `..` segment: not one an agent wrote) is counted and
//!   skipped. Finding a pod's newest recording holds one key at a time.

pub mod address;
pub mod profile;
pub mod sidecar;
pub mod uploader;

use std::path::Path as FilePath;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use object_store::path::Path;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt, ObjectStoreScheme};

pub use address::{ArchiveUrl, RecordingKey};
pub use sidecar::Sidecar;

/// The longest one request to a store may take.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest connecting to a store may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Retries of one request (a connection refused, a 5xx) by the store's client.
pub const STORE_RETRIES: usize = 2;
/// The time within which the client retries one request.
pub const STORE_RETRY_TIME: Duration = Duration::from_secs(15);
/// The most objects one listing reads.
pub const MAX_LISTED: usize = 100_000;

/// Why an archive could not be opened, written or read.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    /// Not an address gpumem reads.
    #[error("{0}")]
    Address(String),
    /// The store refused or could not be reached.
    #[error("{address}: {source}")]
    Store {
        /// The object or prefix.
        address: String,
        /// What the store's client said.
        source: object_store::Error,
    },
    /// No such object.
    #[error("{0}: no such object")]
    NotFound(String),
    /// An object larger than the reader allows.
    #[error("{address}: larger than {limit} bytes")]
    TooLarge {
        /// The object.
        address: String,
        /// The limit.
        limit: u64,
    },
    /// A local file could not be read or written.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Whose credentials a store is opened with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Credentials {
    /// The process's environment only (the agent: its pod's workload identity or Secret).
    Environment,
    /// The environment, then the AWS CLI's profile files (the command line).
    WithProfiles,
}

/// The store at `store` (a [`address::SCHEMES`] URL of a bucket, container or root).
///
/// # Errors
/// An unsupported scheme, a bad configuration in the environment, or an unreadable profile
/// file.
pub fn open_store(
    store: &url::Url,
    credentials: Credentials,
) -> Result<Arc<dyn ObjectStore>, ArchiveError> {
    use object_store::client::ClientConfigKey;
    // reqwest is built without a provider of its own: ring is the process's one.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let config_error = |e: object_store::Error| ArchiveError::Store {
        address: store.to_string(),
        source: e,
    };
    let retry = object_store::RetryConfig {
        max_retries: STORE_RETRIES,
        retry_timeout: STORE_RETRY_TIME,
        ..Default::default()
    };
    let seconds = |d: Duration| format!("{}s", d.as_secs());
    // A cloud store's builder at `store`, within the budgets (after the environment's
    // settings: they never lift them), built. The builders share no trait.
    macro_rules! within_budgets {
        ($builder:expr, $client:path) => {
            $builder
                .with_url(store.as_str())
                .with_retry(retry)
                .with_config($client(ClientConfigKey::Timeout), seconds(REQUEST_TIMEOUT))
                .with_config(
                    $client(ClientConfigKey::ConnectTimeout),
                    seconds(CONNECT_TIMEOUT),
                )
                .build()
                .map_err(config_error)?
        };
    }
    let roots = client_options()?;
    let (scheme, _) = ObjectStoreScheme::parse(store)
        .map_err(|e| ArchiveError::Address(format!("{store}: {e}")))?;
    let opened: Arc<dyn ObjectStore> = match scheme {
        ObjectStoreScheme::Local => Arc::new(object_store::local::LocalFileSystem::new()),
        ObjectStoreScheme::AmazonS3 => {
            use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
            let mut builder = from_env(
                "AWS_",
                AmazonS3Builder::from_env().with_client_options(roots),
                AmazonS3Builder::with_config,
            );
            if credentials == Credentials::WithProfiles {
                for (key, value) in profile::options().map_err(ArchiveError::Address)? {
                    let key: AmazonS3ConfigKey = key.parse().map_err(config_error)?;
                    builder = builder.with_config(key, value);
                }
            }
            let http = builder
                .get_config_value(&AmazonS3ConfigKey::Endpoint)
                .is_some_and(|e| e.starts_with("http://"));
            if builder
                .get_config_value(&AmazonS3ConfigKey::Region)
                .is_none()
            {
                builder = builder.with_region("us-east-1");
            }
            Arc::new(within_budgets!(
                builder.with_allow_http(http),
                AmazonS3ConfigKey::Client
            ))
        }
        ObjectStoreScheme::GoogleCloudStorage => {
            use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
            let builder = from_env(
                "GOOGLE_",
                GoogleCloudStorageBuilder::from_env().with_client_options(roots),
                GoogleCloudStorageBuilder::with_config,
            );
            Arc::new(within_budgets!(builder, GoogleConfigKey::Client))
        }
        ObjectStoreScheme::MicrosoftAzure => {
            use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
            let builder = from_env(
                "AZURE_",
                MicrosoftAzureBuilder::from_env().with_client_options(roots),
                MicrosoftAzureBuilder::with_config,
            );
            Arc::new(within_budgets!(builder, AzureConfigKey::Client))
        }
        _ => {
            return Err(ArchiveError::Address(format!(
                "{store}: not a store gpumem reads (s3://, gs://, az://, file://)"
            )));
        }
    };
    Ok(opened)
}

/// The client's options: Mozilla's roots beside the system's.
fn client_options() -> Result<object_store::ClientOptions, ArchiveError> {
    let mut options = object_store::ClientOptions::new();
    for root in webpki_root_certs::TLS_SERVER_ROOT_CERTS {
        let root = object_store::Certificate::from_der(root).map_err(|e| ArchiveError::Store {
            address: "Mozilla's root certificates".into(),
            source: e,
        })?;
        options = options.with_root_certificate(root);
    }
    Ok(options)
}

/// `builder` with the environment's variables of `prefix` applied again, as its `from_env`
/// did: setting the client's options (the roots) replaced those the environment had set.
fn from_env<B, K: std::str::FromStr>(
    prefix: &str,
    mut builder: B,
    with_config: fn(B, K, String) -> B,
) -> B {
    for (key, value) in std::env::vars_os() {
        if let (Some(key), Some(value)) = (key.to_str(), value.to_str())
            && key.starts_with(prefix)
            && let Ok(key) = key.to_ascii_lowercase().parse()
        {
            builder = with_config(builder, key, value.to_string());
        }
    }
    builder
}

/// An archive: its address and its store.
#[derive(Debug)]
pub struct Archive {
    url: ArchiveUrl,
    store: Arc<dyn ObjectStore>,
}

impl Archive {
    /// The archive at `url`.
    ///
    /// # Errors
    /// See [`open_store`].
    pub fn open(url: ArchiveUrl, credentials: Credentials) -> Result<Archive, ArchiveError> {
        let store = open_store(url.store(), credentials)?;
        Ok(Archive { url, store })
    }

    /// Its address.
    pub fn url(&self) -> &ArchiveUrl {
        &self.url
    }

    fn failed(&self, path: &Path) -> impl Fn(object_store::Error) -> ArchiveError {
        let address = self.url.object_url(path);
        move |source| match source {
            object_store::Error::NotFound { .. } => ArchiveError::NotFound(address.clone()),
            source => ArchiveError::Store {
                address: address.clone(),
                source,
            },
        }
    }

    /// Writes `bytes` at `path` (whole: a reader never sees part of it).
    ///
    /// # Errors
    /// The store refused or could not be reached.
    pub async fn put(&self, path: &Path, bytes: Vec<u8>) -> Result<(), ArchiveError> {
        self.store
            .put(path, bytes.into())
            .await
            .map(drop)
            .map_err(self.failed(path))
    }

    /// The object at `path`, at most `limit` bytes.
    ///
    /// # Errors
    /// No such object, a larger one, or the store failed.
    pub async fn get(&self, path: &Path, limit: u64) -> Result<Vec<u8>, ArchiveError> {
        let mut bytes = Vec::new();
        get_within(
            &*self.store,
            &self.url.object_url(path),
            path,
            limit,
            |chunk| {
                bytes.extend_from_slice(chunk);
                Ok(())
            },
        )
        .await?;
        Ok(bytes)
    }

    /// Calls `each` with the objects under `prefix` (at most [`MAX_LISTED`]): whether the
    /// listing stopped there, and how many keys were skipped (not paths gpumem names).
    ///
    /// # Errors
    /// The store failed.
    pub async fn for_each(
        &self,
        prefix: &Path,
        mut each: impl FnMut(ObjectMeta),
    ) -> Result<Listed, ArchiveError> {
        let mut listing = self.store.list(Some(prefix));
        let mut listed = Listed::default();
        let mut seen = 0usize;
        while let Some(meta) = listing.next().await {
            if seen == MAX_LISTED {
                listed.truncated = true;
                break;
            }
            seen += 1;
            match meta {
                Ok(meta) => each(meta),
                Err(object_store::Error::InvalidPath { .. }) => listed.skipped += 1,
                Err(e) => return Err(self.failed(prefix)(e)),
            }
        }
        Ok(listed)
    }

    /// The newest recording under `pod_dir` (a pod's directory), by its key, with its
    /// sidecar.
    ///
    /// # Errors
    /// The store failed, or the sidecar is unreadable.
    pub async fn newest(
        &self,
        prefix: &Path,
        pod_dir: &Path,
    ) -> Result<Option<(RecordingKey, Sidecar)>, ArchiveError> {
        let mut newest: Option<RecordingKey> = None;
        self.for_each(pod_dir, |object| {
            if let Some((key, true)) = RecordingKey::of(prefix, &object.location)
                && newest.as_ref().is_none_or(|n| key > *n)
            {
                newest = Some(key);
            }
        })
        .await?;
        let Some(key) = newest else {
            return Ok(None);
        };
        let sidecar = self.sidecar(prefix, &key).await?;
        Ok(Some((key, sidecar)))
    }

    /// The sidecar of `key` under `prefix`.
    ///
    /// # Errors
    /// No such object, not a sidecar, or the store failed.
    pub async fn sidecar(
        &self,
        prefix: &Path,
        key: &RecordingKey,
    ) -> Result<Sidecar, ArchiveError> {
        let path = key.sidecar(prefix);
        let bytes = self.get(&path, sidecar::MAX_BYTES).await?;
        Sidecar::parse(&bytes)
            .map_err(|e| ArchiveError::Address(format!("{}: {e}", self.url.object_url(&path))))
    }
}

/// What a listing met beside the objects it gave.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Listed {
    /// It stopped at [`MAX_LISTED`] objects.
    pub truncated: bool,
    /// Keys that are not paths gpumem names, skipped.
    pub skipped: usize,
}

/// Reads the object at `path` of `store` chunk by chunk into `sink`, refusing it past
/// `limit` bytes (by its stated size before a byte is read, or as it crosses it).
async fn get_within(
    store: &dyn ObjectStore,
    address: &str,
    path: &Path,
    limit: u64,
    mut sink: impl FnMut(&[u8]) -> std::io::Result<()>,
) -> Result<u64, ArchiveError> {
    let failed = |source| match source {
        object_store::Error::NotFound { .. } => ArchiveError::NotFound(address.to_string()),
        source => ArchiveError::Store {
            address: address.to_string(),
            source,
        },
    };
    let too_large = || ArchiveError::TooLarge {
        address: address.to_string(),
        limit,
    };
    let got = store.get(path).await.map_err(failed)?;
    if got.meta.size > limit {
        return Err(too_large());
    }
    let mut stream = got.into_stream();
    let mut read = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(failed)?;
        read += chunk.len() as u64;
        if read > limit {
            return Err(too_large());
        }
        sink(&chunk)?;
    }
    Ok(read)
}

/// A recording fetched from a store into a private temporary file for the tools, removed
/// when dropped.
#[derive(Debug)]
pub struct Fetched {
    dir: std::path::PathBuf,
    file: std::path::PathBuf,
}

impl Fetched {
    /// The local file.
    pub fn path(&self) -> &FilePath {
        &self.file
    }
}

impl Drop for Fetched {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Fetches the recording at `address` (an object's address, `address::object_address`)
/// into a temporary file of its name, at most `limit` bytes, with the environment's and the
/// profile files' credentials. Blocking: it runs a runtime of its own.
///
/// # Errors
/// Not an object's address, no such object, a larger one, or the store failed.
pub fn fetch(address: &str, limit: u64) -> Result<Fetched, ArchiveError> {
    use std::io::Write as _;
    let (store, path) = match address::object_address(address) {
        Some(parsed) => parsed.map_err(ArchiveError::Address)?,
        None => {
            return Err(ArchiveError::Address(format!(
                "{address:?} is not a store's address"
            )));
        }
    };
    let dir = private_temp_dir()?;
    let name = path.filename().unwrap_or("recording").to_string();
    let fetched = Fetched {
        file: dir.join(name),
        dir,
    };
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&fetched.file)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let object = format!("{}/{path}", store.as_str().trim_end_matches('/'));
        let store = open_store(&store, Credentials::WithProfiles)?;
        get_within(&*store, &object, &path, limit, |chunk| {
            file.write_all(chunk)
        })
        .await
    })?;
    file.flush()?;
    Ok(fetched)
}

/// A new directory of the process's own (`0700`) under the temporary directory.
fn private_temp_dir() -> std::io::Result<std::path::PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let base = std::env::temp_dir();
    for attempt in 0..16u32 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = base.join(format!(
            "gpumem-fetch-{}-{nanos:x}-{attempt}",
            std::process::id()
        ));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::other(
        "no temporary directory could be made for the fetched recording",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
    }

    #[test]
    fn objects_are_read_within_their_limit_and_listed() {
        let url: ArchiveUrl = "file:///archive".parse().expect("parses");
        let archive = Archive {
            url,
            store: Arc::new(object_store::memory::InMemory::new()),
        };
        let key = RecordingKey::new("c", "ns", "pod", "node", 1.5, 9).expect("valid");
        let prefix = archive.url().prefix("ns");
        runtime().block_on(async {
            archive
                .put(&key.recording(&prefix), vec![7; 100])
                .await
                .expect("written");
            assert_eq!(
                archive
                    .get(&key.recording(&prefix), 100)
                    .await
                    .expect("read"),
                vec![7; 100]
            );
            let refused = archive.get(&key.recording(&prefix), 99).await;
            assert!(
                matches!(refused, Err(ArchiveError::TooLarge { limit: 99, .. })),
                "{refused:?}"
            );
            let missing = archive.get(&key.sidecar(&prefix), 1 << 20).await;
            assert!(
                matches!(missing, Err(ArchiveError::NotFound(_))),
                "{missing:?}"
            );
            // A pod's newest is found by its sidecar: none yet.
            let dir = RecordingKey::pod_dir(&prefix, "c", "ns", "pod");
            assert_eq!(archive.newest(&prefix, &dir).await.expect("lists"), None);
            let kept = crate::ingest::recordings::StoredRecording {
                id: "1".into(),
                pid: 9,
                pod_uid: String::new(),
                container_id: String::new(),
                pod_namespace: "ns".into(),
                pod_name: "pod".into(),
                container_name: String::new(),
                device: Some(0),
                time: 1.5,
                bytes: 100,
                oom_event: Some(3),
                tenant: None,
                oom: None,
                pytorch_version: "2.11.0".into(),
                allocator_settings: String::new(),
                archived: None,
            };
            let address = archive.url().object_url(&key.recording(&prefix));
            let sidecar = Sidecar::of(&kept, &key, address, "node");
            let json = serde_json::to_vec(&sidecar).expect("JSON");
            archive
                .put(&key.sidecar(&prefix), json)
                .await
                .expect("written");
            let (newest, read) = archive
                .newest(&prefix, &dir)
                .await
                .expect("lists")
                .expect("one");
            assert_eq!((newest, read.clone()), (key, sidecar));
            assert_eq!(read.fragment(), "#device=0&event=3");
        });
    }
}
