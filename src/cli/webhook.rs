//! `gpumem webhook`: the mutating admission webhook that injects the push hook into opted-in
//! pods (the mutation: `gpumem::inject`), served over TLS, and `gpumem copy-hook`, which its
//! init container runs.
//!
//! # Invariants (budgets)
//! - A review is at most [`MAX_REVIEW_BYTES`] (the API server's own request limit); a larger
//!   body gets 413 (before a byte is read where its length is declared), a body that is not
//!   an AdmissionReview v1 gets 400 with the reason, and either leaves the webhook serving.
//! - A pod whose review is past [`MAX_PATCHED_BYTES`] (etcd's default request limit: the API
//!   server could not store it) is admitted unchanged, with a warning, its containers never
//!   read; a smaller one's patch may take what the review leaves of [`MAX_PATCHED_BYTES`].
//! - The review is read straight into the few fields the answer needs (`inject::PodView`; no
//!   JSON tree of the pod), and the answer written as JSON text with the patch in base64: the
//!   work and its memory are linear in the review and a small multiple of it (a few MiB at
//!   most; `scripts/measure-webhook.py` measures them).
//! - Reviews are worked on off the runtime's workers (`spawn_blocking`), at most
//!   [`CONCURRENT_REVIEWS`] at once, and a review's body is read only once it has its permit:
//!   so concurrent reviews neither stall the health check and the TLS handshakes nor
//!   multiply the memory past that (the others wait with their headers alone, at most 10 s,
//!   then 503).
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
use base64::Engine;
use gpumem::inject::{Injection, PodLabel, PodView, VolumeSource};
use gpumem::server::tls::TlsSettings;
use gpumem::server::{self as listen, HttpLimits};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use super::CliResult;

/// The largest AdmissionReview read (the API server's request limit is 3 MiB).
pub const MAX_REVIEW_BYTES: usize = 3 << 20;
/// The largest review patched, and its patch with it: etcd's default request limit
/// (1.5 MiB), past which the API server could not store the pod.
pub const MAX_PATCHED_BYTES: usize = 3 << 19;
/// Reviews worked on at once.
pub const CONCURRENT_REVIEWS: usize = 2;

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
    let hook = Arc::new(Webhook {
        injection: Injection {
            image: args.image,
            pull_policy: args.pull_policy,
            push_url: args.push_url,
            source: args.volume,
        },
        permits: Arc::new(Semaphore::new(CONCURRENT_REVIEWS)),
    });
    let app = Router::new()
        .route(
            "/mutate",
            post(mutate).route_layer(axum::middleware::from_fn(declared_length)),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .layer(DefaultBodyLimit::max(MAX_REVIEW_BYTES))
        .with_state(hook);
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

struct Webhook {
    injection: Injection,
    permits: Arc<Semaphore>,
}

/// How long a review waits for a permit before it is refused (503): the API server's own
/// timeout for a webhook is 10 s by default.
const PERMIT_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Answers one AdmissionReview, on a blocking thread once a permit is free. Its body is read
/// only then: reviews waiting for a permit hold their headers, not their bodies.
async fn mutate(State(hook): State<Arc<Webhook>>, request: axum::extract::Request) -> Response {
    let permit = tokio::time::timeout(PERMIT_WAIT, hook.permits.clone().acquire_owned()).await;
    let Ok(Ok(permit)) = permit else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "too many reviews are being answered; try again\n",
        )
            .into_response();
    };
    let body: Bytes = match axum::body::to_bytes(request.into_body(), MAX_REVIEW_BYTES).await {
        Ok(body) => body,
        Err(e) => {
            return (
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("a review is at most {MAX_REVIEW_BYTES} bytes, read whole: {e}\n"),
            )
                .into_response();
        }
    };
    let answered = tokio::task::spawn_blocking(move || {
        let answer = answer(&hook.injection, &body);
        drop(permit);
        answer
    })
    .await;
    match answered {
        Ok(Ok(review)) => ([(header::CONTENT_TYPE, "application/json")], review).into_response(),
        Ok(Err(why)) => (StatusCode::BAD_REQUEST, why).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
    }
}

/// An AdmissionReview as read first: what says whether and how to answer, the object skipped.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Review {
    api_version: String,
    kind: String,
    request: Option<Request>,
}

#[derive(Deserialize)]
struct Request {
    uid: String,
    kind: Kind,
    operation: String,
}

#[derive(Deserialize)]
struct Kind {
    #[serde(default)]
    group: String,
    kind: String,
}

/// The review read again for its object, everything else skipped.
#[derive(Deserialize)]
struct ObjectOf<T> {
    request: ObjectRequest<T>,
}

#[derive(Deserialize)]
struct ObjectRequest<T> {
    object: Option<T>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Answer<'a> {
    api_version: &'static str,
    kind: &'static str,
    response: AnswerResponse<'a>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct AnswerResponse<'a> {
    uid: &'a str,
    allowed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    patch_type: Option<&'static str>,
    /// The JSON Patch in base64, as the API documents the field.
    #[serde(skip_serializing_if = "Option::is_none")]
    patch: Option<String>,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    warnings: &'a [String],
}

const REVIEW_VERSION: &str = "admission.k8s.io/v1";

/// The answer to the review `body` (JSON), or why it is not an AdmissionReview v1 request:
/// allowed, with a patch for an opted-in pod being created.
fn answer(injection: &Injection, body: &[u8]) -> Result<Vec<u8>, String> {
    let review: Review =
        serde_json::from_slice(body).map_err(|e| format!("not an AdmissionReview: {e}\n"))?;
    if review.api_version != REVIEW_VERSION || review.kind != "AdmissionReview" {
        return Err(format!(
            "not an AdmissionReview v1 request: {}/{}\n",
            review.api_version, review.kind
        ));
    }
    let Some(request) = review.request else {
        return Err("not an AdmissionReview v1 request: no request\n".into());
    };
    let is_pod = request.kind.group.is_empty() && request.kind.kind == "Pod";
    let mut patch = Vec::new();
    let mut warnings = Vec::new();
    if is_pod && request.operation == "CREATE" {
        if body.len() > MAX_PATCHED_BYTES {
            // Its containers are not read: the API server could not store the pod anyway.
            let opted_in = serde_json::from_slice::<ObjectOf<PodLabel>>(body)
                .is_ok_and(|r| r.request.object.is_some_and(|pod| pod.opted_in()));
            if opted_in {
                warnings.push(format!(
                    "gpumem: the pod's review is {} bytes, past etcd's default request limit of {MAX_PATCHED_BYTES}; the hook is not injected",
                    body.len()
                ));
            }
        } else {
            match serde_json::from_slice::<ObjectOf<PodView>>(body) {
                Ok(ObjectOf {
                    request: ObjectRequest { object: Some(pod) },
                }) => {
                    let mutation = injection.mutate(&pod, MAX_PATCHED_BYTES - body.len());
                    drop(pod);
                    patch = mutation.patch;
                    warnings = mutation.warnings;
                }
                Ok(_) => warnings.push("gpumem: the review has no pod; nothing injected".into()),
                Err(e) => warnings.push(format!(
                    "gpumem: the pod could not be read ({e}); nothing injected"
                )),
            }
        }
    }
    let encoded =
        (!patch.is_empty()).then(|| base64::engine::general_purpose::STANDARD.encode(&patch));
    drop(patch);
    let answer = Answer {
        api_version: REVIEW_VERSION,
        kind: "AdmissionReview",
        response: AnswerResponse {
            uid: &request.uid,
            allowed: true,
            patch_type: encoded.as_ref().map(|_| "JSONPatch"),
            patch: encoded,
            warnings: &warnings,
        },
    };
    serde_json::to_vec(&answer).map_err(|e| format!("{e}\n"))
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn injection() -> Injection {
        Injection {
            image: "example.com/gpumem:1".into(),
            pull_policy: "IfNotPresent".into(),
            push_url: "http://gpumem:9417/api/v1/push".into(),
            source: VolumeSource::InitContainer,
        }
    }

    fn review(spec: Value) -> Vec<u8> {
        let pod = json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "labels": {"gpumem.io/inject": "true"}}, "spec": spec});
        serde_json::to_vec(
            &json!({"apiVersion": REVIEW_VERSION, "kind": "AdmissionReview",
            "request": {"uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                        "operation": "CREATE", "object": pod}}),
        )
        .expect("JSON")
    }

    /// The answer's response, and its patch's operations decoded.
    fn answered(body: &[u8]) -> (Value, Vec<Value>) {
        let answer: Value =
            serde_json::from_slice(&answer(&injection(), body).expect("answered")).expect("JSON");
        assert_eq!(answer["apiVersion"], REVIEW_VERSION);
        let response = answer["response"].clone();
        assert_eq!(response["uid"], "u-1");
        assert_eq!(response["allowed"], true);
        let ops = match response["patch"].as_str() {
            Some(patch) => {
                assert_eq!(response["patchType"], "JSONPatch");
                let bytes = base64::engine::general_purpose::STANDARD
                    .decode(patch)
                    .expect("base64");
                serde_json::from_slice(&bytes).expect("a JSON array")
            }
            None => Vec::new(),
        };
        (response, ops)
    }

    /// A container already named as the init container would be: the patch names its init
    /// container otherwise, and the pod's names stay unique.
    #[test]
    fn a_container_named_gpumem_inject_gets_a_patch_with_unique_names() {
        let (_, ops) = answered(&review(json!({
            "containers": [{"name": "gpumem-inject"}],
            "initContainers": [{"name": "gpumem-inject-2"}],
        })));
        let init = ops
            .iter()
            .find(|o| o["path"] == "/spec/initContainers/-")
            .expect("an init container added");
        assert_eq!(init["value"]["name"], "gpumem-inject-3");
    }

    /// A Windows pod is admitted unchanged, with a warning.
    #[test]
    fn a_windows_pod_gets_no_patch() {
        let (response, ops) = answered(&review(
            json!({"os": {"name": "windows"}, "containers": [{"name": "a"}]}),
        ));
        assert!(ops.is_empty());
        assert!(
            response["warnings"][0]
                .as_str()
                .is_some_and(|w| w.contains("windows")),
            "{response}"
        );
    }

    /// A review past 1.5 MiB (but within 3 MiB) is admitted unchanged, with a warning; one
    /// just under it whose patch would not fit in what is left is too.
    #[test]
    fn a_pod_past_etcds_limit_is_admitted_unchanged_with_a_warning() {
        let big = |bytes: usize| {
            review(json!({"containers": [{"name": "a", "command": ["x".repeat(bytes)]}]}))
        };
        let over = big(MAX_PATCHED_BYTES);
        assert!(over.len() > MAX_PATCHED_BYTES && over.len() < MAX_REVIEW_BYTES);
        let (response, ops) = answered(&over);
        assert!(ops.is_empty());
        assert!(
            response["warnings"][0]
                .as_str()
                .is_some_and(|w| w.contains("etcd")),
            "{response}"
        );
        let under = big(MAX_PATCHED_BYTES - 4000);
        assert!(under.len() <= MAX_PATCHED_BYTES);
        let (_, ops) = answered(&under);
        assert_eq!(ops.len(), 6, "a patch for one container: {ops:?}");
        let (response, ops) = answered(&big(MAX_PATCHED_BYTES - 200));
        assert!(ops.is_empty(), "no room for the patch");
        assert!(
            response["warnings"][0]
                .as_str()
                .is_some_and(|w| w.contains("etcd"))
        );
    }

    /// Bodies that are not AdmissionReview v1 requests are refused with the reason; another
    /// object or operation is allowed with nothing.
    #[test]
    fn only_a_review_is_answered_and_only_a_pod_create_is_patched() {
        for body in [
            &b"{not json"[..],
            br#"{"kind": "Pod"}"#,
            br#"{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}"#,
            br#"{"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {"uid": "u", "kind": {"kind": "Pod"}, "operation": "CREATE"}}"#,
        ] {
            assert!(answer(&injection(), body).is_err());
        }
        let mut update: Value =
            serde_json::from_slice(&review(json!({"containers": [{"name": "a"}]}))).expect("JSON");
        update["request"]["operation"] = json!("UPDATE");
        let (response, ops) = answered(&serde_json::to_vec(&update).expect("JSON"));
        assert!(ops.is_empty() && response.get("warnings").is_none());
        let (_, ops) = answered(&review(json!({"containers": [{"name": "a"}]})));
        assert_eq!(ops.len(), 6);
    }
}
