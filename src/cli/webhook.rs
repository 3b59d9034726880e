//! `gpumem webhook`: the mutating admission webhook that injects the push hook into opted-in
//! pods (the mutation: `gpumem::inject`), served over TLS, and `gpumem copy-hook`, which its
//! init container runs.
//!
//! # Invariants (budgets)
//! - A review is at most [`MAX_REVIEW_BYTES`] (the API server's own request limit); a larger
//!   body gets 413 (before a byte is read where its length is declared), a body that is not an AdmissionReview v1 gets 400 with the reason, and
//!   either leaves the webhook serving.
//! - The certificate and key are re-read when either file changes (`gpumem::server::tls`:
//!   cert-manager renews them in place).
//! - Connections are served within the agent's limits (`server::listen`): the TLS handshake
//!   within the header timeout, then the request's headers within another.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use gpumem::inject::{Injection, VolumeSource};
use gpumem::server::tls::TlsSettings;
use gpumem::server::{self as listen, HttpLimits};
use k8s_openapi::api::core::v1::Pod;
use kube_core::DynamicObject;
use kube_core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};

use super::CliResult;

/// The largest AdmissionReview read (the API server's request limit is 3 MiB).
pub const MAX_REVIEW_BYTES: usize = 3 << 20;

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
    let tls = TlsSettings::new(&args.tls_cert, &args.tls_key).server_config("webhook")?;
    let injection = Arc::new(Injection {
        image: args.image,
        pull_policy: args.pull_policy,
        push_url: args.push_url,
        source: args.volume,
    });
    let app = Router::new()
        .route(
            "/mutate",
            post(mutate).route_layer(axum::middleware::from_fn(declared_length)),
        )
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
            tls,
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

/// Refuses (413) a review whose declared length is past [`MAX_REVIEW_BYTES`] before a byte
/// of it is read (a client still sending it then sees the answer, not a closed connection).
async fn declared_length(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let declared = gpumem::server::declared_length(request.headers());
    if declared.is_some_and(|n| n > MAX_REVIEW_BYTES as u64) {
        return (
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("a review is at most {MAX_REVIEW_BYTES} bytes\n"),
        )
            .into_response();
    }
    next.run(request).await
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
