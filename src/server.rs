//! The HTTP shell: `/metrics` (text exposition), `/healthz`, and `/` (a page linking both).
//! [`app`] builds the router, so tests call it without a socket; [`serve`] binds it.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::{Html, IntoResponse};
use axum::routing::get;

use crate::metrics::Metrics;

/// The media type of the Prometheus text exposition format.
pub const EXPOSITION_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// What the handlers share.
#[derive(Clone)]
pub struct AppState {
    /// The metrics to serve.
    pub metrics: Arc<Metrics>,
}

/// The router.
pub fn app(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/", get(index))
        .with_state(state)
}

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    // Encoded inline: a scrape takes milliseconds, scrapes come one at a time, and staying on
    // the runtime's thread keeps the agent to one heap (a blocking-pool thread would grow a
    // second malloc arena as large as the exposition).
    let body = state.metrics.encode();
    ([(header::CONTENT_TYPE, EXPOSITION_CONTENT_TYPE)], body)
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
    axum::serve(listener, app)
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
