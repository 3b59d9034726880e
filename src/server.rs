//! The HTTP shell: `/metrics` (text exposition), `/healthz`, `/` (a page linking both) and,
//! when the agent ingests pushed statistics, `POST /api/v1/push` from this host only: over a
//! Unix socket ([`serve_unix`], where the kernel names the pushing process) or from a loopback
//! TCP peer. [`app`] builds the router, so tests call it without a socket; [`serve`] binds it.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::connect_info::Connected;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::IncomingStream;
use tokio::net::UnixListener;

use crate::ingest::{IngestConfig, MAX_BODY_BYTES, PushStore, Refusal};
use crate::metrics::{Metrics, ReportReader};
use crate::sources::{AllocatorSources, IngestReader};
use crate::telemetry::Kubelet;

/// The media type of the Prometheus text exposition format.
pub const EXPOSITION_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// What the handlers share.
#[derive(Clone)]
pub struct AppState {
    /// The metrics to serve.
    pub metrics: Arc<Metrics>,
    /// Where pushed statistics go, if the agent accepts them.
    pub ingest: Option<Arc<PushStore>>,
}

/// The agent's state: metrics over `sources` and `reports` (with what the `kubelet` says,
/// where it says), with pushes from this host accepted into `sources`.
///
/// # Errors
/// A registration error, which only a collector defect can cause.
pub fn agent_state(
    sources: AllocatorSources,
    reports: Vec<ReportReader>,
    ingest: IngestConfig,
    kubelet: Kubelet,
) -> Result<AppState, prometheus::Error> {
    let store = Arc::new(PushStore::new(ingest, sources.clone()));
    let reader: IngestReader = {
        let store = Arc::clone(&store);
        Arc::new(move || store.report())
    };
    let metrics = Metrics::new(sources, reports, Some(reader), kubelet)?;
    Ok(AppState {
        metrics: Arc::new(metrics),
        ingest: Some(store),
    })
}

/// The router.
pub fn app(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/", get(index))
        .route("/api/v1/push", post(push))
        .with_state(state)
}

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    // Encoded inline: a scrape takes milliseconds, scrapes come one at a time, and staying on
    // the runtime's thread keeps the agent to one heap (a blocking-pool thread would grow a
    // second malloc arena as large as the exposition).
    let body = state.metrics.encode();
    ([(header::CONTENT_TYPE, EXPOSITION_CONTENT_TYPE)], body)
}

/// The HTTP status of a refusal.
pub fn status_of(refusal: Refusal) -> StatusCode {
    match refusal {
        Refusal::Malformed | Refusal::Truncated => StatusCode::BAD_REQUEST,
        Refusal::Invalid => StatusCode::UNPROCESSABLE_ENTITY,
        Refusal::Stale | Refusal::Conflict => StatusCode::CONFLICT,
        Refusal::RateLimited | Refusal::Capacity | Refusal::SeriesBudget => {
            StatusCode::TOO_MANY_REQUESTS
        }
        Refusal::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        Refusal::Forbidden => StatusCode::FORBIDDEN,
    }
}

fn refused(store: &PushStore, refusal: Refusal, message: &str) -> Response {
    store.count_refusal(refusal);
    json(
        status_of(refusal),
        serde_json::json!({"error": message, "reason": refusal.label()}),
    )
}

fn json(status: StatusCode, body: serde_json::Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// Accepts a push from a process on this host (see [`crate::ingest`]).
async fn push(State(state): State<AppState>, request: Request) -> Response {
    let Some(store) = state.ingest else {
        return json(
            StatusCode::NOT_FOUND,
            serde_json::json!({"error": "this agent does not accept pushes"}),
        );
    };
    // Only processes on this node may push: over the Unix socket (the kernel names the
    // process) or from loopback.
    let extensions = request.extensions();
    let unix = extensions.get::<ConnectInfo<UnixPeer>>().map(|c| c.0);
    // A dual-stack listener sees IPv4 loopback as ::ffff:127.0.0.1.
    let loopback = extensions
        .get::<ConnectInfo<SocketAddr>>()
        .is_some_and(|c| c.0.ip().to_canonical().is_loopback());
    if unix.is_none() && !loopback {
        return json(
            StatusCode::FORBIDDEN,
            serde_json::json!({"error": "pushes are accepted from this host only"}),
        );
    }
    // A web page open in a browser on the node can send a "simple" cross-site POST to
    // loopback (text/plain, with an Origin header); a push hook never sends either.
    let headers = request.headers();
    if headers.contains_key(header::ORIGIN) {
        return refused(
            &store,
            Refusal::Forbidden,
            "pushes from web pages (with an Origin header) are refused",
        );
    }
    let json_body = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if !json_body {
        return refused(
            &store,
            Refusal::Forbidden,
            "a push must be sent as Content-Type: application/json",
        );
    }
    let too_large = format!("the body exceeds {MAX_BODY_BYTES} bytes");
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        // Refused before a byte of the body is read.
        return refused(&store, Refusal::TooLarge, &too_large);
    }
    let body = match axum::body::to_bytes(request.into_body(), MAX_BODY_BYTES).await {
        Ok(body) => body,
        Err(e) => {
            let over = std::error::Error::source(&e)
                .is_some_and(|cause| cause.is::<http_body_util::LengthLimitError>());
            return if over {
                refused(&store, Refusal::TooLarge, &too_large)
            } else {
                refused(
                    &store,
                    Refusal::Truncated,
                    &format!("the body could not be read whole: {e}"),
                )
            };
        }
    };
    match store.push_from(&body, unix.and_then(|peer| peer.pid)) {
        Ok(()) => json(StatusCode::ACCEPTED, serde_json::json!({"accepted": true})),
        Err(rejected) => json(
            status_of(rejected.refusal),
            serde_json::json!({"error": rejected.message, "reason": rejected.refusal.label()}),
        ),
    }
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn index() -> Html<&'static str> {
    Html(concat!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>gpumem</title></head><body>",
        "<h1>gpumem</h1><p>GPU memory as nvidia-smi sees it and as the caching allocator holds it.</p>",
        "<ul><li><a href=\"/metrics\">/metrics</a> (Prometheus)</li>",
        "<li><a href=\"/healthz\">/healthz</a></li></ul></body></html>\n"
    ))
}

/// Serves `app` on `listener` until `shutdown` completes, then finishes the requests in
/// flight.
///
/// # Errors
/// An I/O error from the listener.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await
}

/// Completes on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let interrupt = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
    tracing::info!("shutting down");
}

/// Binds `address`, logging where the agent listens.
///
/// # Errors
/// The bind error, with the address.
pub async fn bind(address: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {address}: {e}")))?;
    if let Ok(local) = listener.local_addr() {
        tracing::info!(address = %local, "serving /metrics");
        eprintln!("gpumem: serving http://{local}/metrics");
    }
    Ok(listener)
}

/// Binds a Unix socket at `path` for pushes from any local user: creates its directory,
/// replaces a stale socket left by an earlier run (never another kind of file), and makes it
/// connectable by all (access is already limited to whoever can reach the path).
///
/// # Errors
/// The error, with the path.
pub fn bind_unix(path: &std::path::Path) -> std::io::Result<UnixListener> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let context = |e: std::io::Error| {
        std::io::Error::new(
            e.kind(),
            format!("cannot listen on {}: {e}", path.display()),
        )
    };
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(context)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(path).map_err(context)?,
        Ok(_) => {
            return Err(context(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "a file that is not a socket is in the way",
            )));
        }
        Err(_) => {}
    }
    let listener = UnixListener::bind(path).map_err(context)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).map_err(context)?;
    tracing::info!(path = %path.display(), "accepting pushes");
    eprintln!("gpumem: accepting pushes on unix:{}", path.display());
    Ok(listener)
}

/// The process at the other end of a Unix-socket connection, as the kernel reports it
/// (`SO_PEERCRED`, in the agent's pid namespace).
#[derive(Clone, Copy, Debug)]
pub struct UnixPeer {
    /// The peer's pid; `None` where the kernel does not say.
    pub pid: Option<u32>,
}

impl Connected<IncomingStream<'_, UnixListener>> for UnixPeer {
    fn connect_info(stream: IncomingStream<'_, UnixListener>) -> Self {
        let pid = stream
            .io()
            .peer_cred()
            .ok()
            .and_then(|cred| cred.pid())
            .and_then(|pid| u32::try_from(pid).ok())
            .filter(|&pid| pid != 0);
        UnixPeer { pid }
    }
}

/// Serves `app` on a Unix socket until `shutdown` completes; pushes over it are attributed to
/// the connecting process's pid.
///
/// # Errors
/// An I/O error from the listener.
pub async fn serve_unix(
    listener: UnixListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<UnixPeer>(),
    )
    .with_graceful_shutdown(shutdown)
    .await
}
