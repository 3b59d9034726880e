//! `gpumem webhook`: the mutating admission webhook that injects the push hook into opted-in
//! pods (the mutation: `gpumem::inject`), served over TLS, and `gpumem copy-hook`, which its
//! init container runs.
//!
//! # Invariants (budgets)
//! - A review is at most [`MAX_REVIEW_BYTES`] (the API server's own request limit); a larger
//!   body gets 413, a body that is not an AdmissionReview v1 gets 400 with the reason, and
//!   either leaves the webhook serving.
//! - The certificate and key are re-read when either file changes (modification time or
//!   length: cert-manager renews them in place), looked at at most once a second (two small
//!   files read under the lock, by the handshake that finds them changed); a pair that does
//!   not load leaves the previous one serving, says so once, and is tried again each second
//!   (a pair caught half-written loads once it is whole).
//! - Connections are served within the agent's limits (`server::listen`): the TLS handshake
//!   within the header timeout, then the request's headers within another.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use gpumem::inject::{Injection, VolumeSource};
use gpumem::server::{self as listen, HttpLimits};
use k8s_openapi::api::core::v1::Pod;
use kube_core::DynamicObject;
use kube_core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use super::CliResult;

/// The largest AdmissionReview read (the API server's request limit is 3 MiB).
pub const MAX_REVIEW_BYTES: usize = 3 << 20;
/// How often the certificate files are looked at.
const RELOAD_CHECK: Duration = Duration::from_secs(1);

#[derive(clap::Args)]
pub(crate) struct Args {
    /// Address to serve HTTPS on (the webhook Service's target).
    #[arg(long, default_value = "0.0.0.0:9443")]
    listen: SocketAddr,
    /// The certificate chain the API server verifies (PEM); re-read when it changes.
    #[arg(long, value_name = "FILE")]
    tls_cert: PathBuf,
    /// Its private key (PEM); re-read when it changes.
    #[arg(long, value_name = "FILE")]
    tls_key: PathBuf,
    /// The agent's image: the init container's, or the image volume's.
    #[arg(long)]
    image: String,
    /// The pull policy of that image in the pods.
    #[arg(long, default_value = "IfNotPresent")]
    pull_policy: String,
    /// The push URL the jobs get (GPUMEM_PUSH_URL).
    #[arg(long)]
    push_url: String,
    /// How the hook reaches the pod: an emptyDir an init container fills, or the image
    /// mounted as an image volume.
    #[arg(long, value_enum, default_value = "init-container")]
    volume: VolumeSource,
}

#[derive(clap::Args)]
pub(crate) struct CopyArgs {
    /// The hook's directory (in the agent's image).
    from: PathBuf,
    /// The pod's volume.
    to: PathBuf,
}

pub(crate) fn run(args: Args) -> CliResult {
    let certs = Arc::new(CertFiles::load(&args.tls_cert, &args.tls_key)?);
    let tls = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_cert_resolver(certs);
    let injection = Arc::new(Injection {
        image: args.image,
        pull_policy: args.pull_policy,
        push_url: args.push_url,
        source: args.volume,
    });
    let app = Router::new()
        .route("/mutate", post(mutate))
        .route("/healthz", get(|| async { "ok\n" }))
        .layer(DefaultBodyLimit::max(MAX_REVIEW_BYTES))
        .with_state(injection);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = listen::bind(args.listen).await?;
        let address = listener.local_addr()?;
        tracing::info!(%address, "gpumem webhook serving");
        eprintln!("gpumem webhook: serving https://{address}/mutate");
        listen::serve_tls(
            listener,
            Arc::new(tls),
            app,
            HttpLimits::default(),
            listen::shutdown_signal(),
        )
        .await;
        Ok::<(), std::io::Error>(())
    })?;
    Ok(std::process::ExitCode::SUCCESS)
}

/// Answers one AdmissionReview.
async fn mutate(State(injection): State<Arc<Injection>>, body: Bytes) -> Response {
    let bad = |why: String| (StatusCode::BAD_REQUEST, why).into_response();
    let review: AdmissionReview<DynamicObject> = match serde_json::from_slice(&body) {
        Ok(review) => review,
        Err(e) => return bad(format!("not an AdmissionReview: {e}\n")),
    };
    let request: AdmissionRequest<DynamicObject> = match review.try_into() {
        Ok(request) => request,
        Err(e) => return bad(format!("not an AdmissionReview v1 request: {e}\n")),
    };
    let response = review_of(&injection, &request);
    let patch = response.patch.clone();
    let mut review = match serde_json::to_value(response.into_review()) {
        Ok(review) => review,
        Err(e) => return (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
    };
    // kube-core writes the patch's bytes as a JSON array of numbers; the API documents a
    // base64 string, which is what is sent.
    if let (Some(bytes), Some(field)) = (patch, review.pointer_mut("/response/patch")) {
        *field = serde_json::Value::String(base64_of(&bytes));
    }
    match serde_json::to_vec(&review) {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
    }
}

/// The response to `request`: a patch for an opted-in pod being created, else nothing.
fn review_of(
    injection: &Injection,
    request: &AdmissionRequest<DynamicObject>,
) -> AdmissionResponse {
    let response = AdmissionResponse::from(request);
    let is_pod = request.kind.group.is_empty() && request.kind.kind == "Pod";
    if !is_pod || request.operation != Operation::Create {
        return response;
    }
    let pod: Option<Pod> = request
        .object
        .as_ref()
        .and_then(|object| serde_json::to_value(object).ok())
        .and_then(|value| serde_json::from_value(value).ok());
    let Some(pod) = pod else {
        return with_warnings(
            response,
            vec!["gpumem: the pod could not be read; nothing injected".into()],
        );
    };
    let mutation = injection.mutate(&pod);
    if mutation.operations.is_empty() {
        return with_warnings(response, mutation.warnings);
    }
    let operations = serde_json::Value::Array(mutation.operations);
    let patched = serde_json::from_value::<json_patch::Patch>(operations)
        .map_err(|e| e.to_string())
        .and_then(|patch| response.with_patch(patch).map_err(|e| e.to_string()));
    match patched {
        Ok(patched) => with_warnings(patched, mutation.warnings),
        Err(e) => with_warnings(
            AdmissionResponse::from(request),
            vec![format!("gpumem: no patch: {e}")],
        ),
    }
}

/// `bytes` in base64, as Kubernetes writes byte fields (`k8s_openapi::ByteString`).
fn base64_of(bytes: &[u8]) -> String {
    serde_json::to_value(k8s_openapi::ByteString(bytes.to_vec()))
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

fn with_warnings(mut response: AdmissionResponse, warnings: Vec<String>) -> AdmissionResponse {
    if !warnings.is_empty() {
        response.warnings = Some(warnings);
    }
    response
}

/// The certificate and key files, and the pair last loaded from them.
#[derive(Debug)]
struct CertFiles {
    cert: PathBuf,
    key: PathBuf,
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
    fn load(cert: &Path, key: &Path) -> Result<CertFiles, String> {
        let stamps = stamps(cert, key);
        let certified = certified_key(cert, key)?;
        Ok(CertFiles {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
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

fn certified_key(cert: &Path, key: &Path) -> Result<CertifiedKey, String> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<_, _>>())
        .map_err(|e| format!("{}: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!("{}: no certificate", cert.display()));
    }
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
                        tracing::info!("the webhook's certificate was reloaded");
                        *state = Loaded {
                            key: Arc::new(key),
                            stamps: now,
                            checked: Instant::now(),
                            failed: None,
                        };
                    }
                    Err(e) => {
                        if state.failed != Some(now) {
                            tracing::warn!(error = %e, "the webhook's new certificate does not load; the previous one serves");
                        }
                        state.failed = Some(now);
                    }
                }
            }
        }
        Some(Arc::clone(&state.key))
    }
}

/// Copies the hook's directory into the pod's volume (the init container's work: the agent's
/// image has no shell): regular files, and directories two levels deep at most
/// (`scripts/python-inject` makes one); nothing else is followed.
pub(crate) fn copy_hook(args: CopyArgs) -> CliResult {
    copy_tree(&args.from, &args.to, 2).map_err(|e| {
        format!(
            "cannot copy {} to {}: {e}",
            args.from.display(),
            args.to.display()
        )
    })?;
    Ok(std::process::ExitCode::SUCCESS)
}

fn copy_tree(from: &Path, to: &Path, depth: u32) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        let target = to.join(entry.file_name());
        if kind.is_dir() && depth > 0 {
            copy_tree(&entry.path(), &target, depth - 1)?;
        } else if kind.is_file() {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}
