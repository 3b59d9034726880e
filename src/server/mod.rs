//! The HTTP shell: `/metrics` (the exposition, in the format and encoding the scraper asks
//! for: `scrape.rs`), `/healthz` (liveness: the runtime answers and every polling loop keeps
//! finishing rounds, whatever the sources say) and `/readyz` (readiness: every loop's first
//! round is done: `probes.rs`), `/` (the live page, drawn from `GET /api/v1/node`:
//! `view::node` over the snapshot a scrape renders, and `GET /api/v1/segments` for the
//! allocators this process holds; with [`AppState::ui`] off, only links: `page.rs`) and, when
//! the agent ingests pushed statistics, `POST /api/v1/push` (`push.rs`) from this host or its
//! pods only: over a Unix socket ([`serve_unix`], where the kernel names the pushing
//! process), from a loopback TCP peer, or, where the agent attributes the pod network
//! (`AppState::pod_network`), from a ready pod's address on this node; and, where the ingest
//! keeps recordings, `POST /api/v1/recordings` from a pushing process, attributed alike (a
//! gzipped snapshot streamed to disk within `ingest::recordings`' caps, never buffered),
//! `GET /api/v1/recordings`, and each kept recording in the view at `/recordings/<id>/`
//! (`server::view` over `view::kept`; `/recordings/pid/<pid>` leads to a process's newest),
//! these three with the page (`recordings.rs`, built with the `tools` feature only: an agent
//! in a PyTorch process keeps none). Where credentials are configured
//! (`AppState::auth`, the web configuration file), `/metrics`, the page and its APIs answer
//! them only (401 otherwise, 503 while every check is taken); pushes, uploads and probes
//! answer anyone. [`app`] builds the router, so tests call it without a socket, and
//! [`push_app`] a pushes-only one: the push socket's (pods that mount it are tenants, never
//! shown the node) and a second, plain listener's beside a TLS one; [`serve`] and `serve_tls`
//! serve them within the [`HttpLimits`] (`listen.rs`).
//!
//! # Invariants
//! - A push is read only from this host or a pod on it, only as `Content-Type:
//!   application/json`, never from a page in a browser (an `Origin` header), and never beyond
//!   [`MAX_BODY_BYTES`](crate::ingest::MAX_BODY_BYTES) or [`AppState::body_timeout`]: a declared larger body is refused
//!   before a byte is read.
//! - Every refusal is answered with its reason and counted by the ingest.
//! - Every route but `/healthz` and `/readyz` answers only a `Host` the agent is named by
//!   (an IP address, a loopback name, an `--allow-host` name: `hosts.rs`); others get 421.
//! - A push body's first [`UNSLOTTED_BODY_BYTES`] are read without a slot (most pushes are
//!   smaller); past them, at most [`DEFAULT_PUSH_SLOTS`] bodies are read at once from TCP
//!   peers and as many from the socket (a later one waits up to the body timeout, then is
//!   refused as `rate_limited`).
//! - At most [`DEFAULT_SCRAPE_SLOTS`] scrape bodies are in flight at once (later scrapes wait
//!   up to 5 s, then get 503), and a client that keeps its response waiting and reads less
//!   than 1 MiB per send timeout is cut off, so memory stays bounded by a few scrapes.
//! - A slot (push or scrape) whose holder made no progress for [`MIN_STALL`] goes to the
//!   next request that wants it, the holder's connection closed (`slots.rs`): withheld
//!   bodies and unread scrapes cannot keep a real push or scrape out. A push so dropped is
//!   counted as `truncated`. An upload's body that brings too little in a window is cut off
//!   as `truncated` (`ingest::recordings`' pace).
//! - A socket peer speaks for its pid only while the process that connected lives (its
//!   handle, `SO_PEERPIDFD`, or its start time at the accept: `pidfd.rs`); what cannot be
//!   proved is refused.
//!
//! # Memory budget
//! A scrape is at most the pushed-series budget (`IngestConfig::max_series`, 10 000) times a
//! series' largest size: about 800 bytes with every pushed label and text at its bound (a
//! 7.8 MB scrape, measured), and up to 500 bytes more where the agent adds a pod's UID,
//! container ID and names (about 13 MB). The agent holds at most four such bodies in flight
//! and one being encoded (a gzipped body is held compressed once made: a 25th to a 58th of
//! it in `benches/scrape.rs`); at most sixteen push bodies of 512 KiB being read (eight per
//! kind of listener); and, per connection (384 per listener), the first [`UNSLOTTED_BODY_BYTES`]
//! of a body (and the rest of the read that crossed them: hyper reads 8 KiB at first): about
//! 20 MiB at worst. Measured at 66 MiB peak resident with the worst valid pushes over TCP and
//! twelve slow scrapers (`tests/it/hostile.rs`; about 100 MiB estimated with pod labels),
//! 8 MiB idle. Reading an uploaded recording adds at most its reading budget (one at a time,
//! 64 MiB by default: `ingest::recordings`), and the view of a kept recording twice that (the
//! open recording and one replay: `view::kept`); an upload's body goes to disk through a
//! buffer of one frame. The chart's limit is 320 MiB.

mod conns;
pub mod hosts;
mod listen;
mod page;
mod pidfd;
mod probes;
mod push;
#[cfg(feature = "tools")]
mod recordings;
mod scrape;
mod slots;
#[cfg(feature = "tls")]
pub mod tls;
#[cfg(feature = "tools")]
pub mod view;
#[cfg(feature = "tls")]
pub mod web_config;

pub use conns::Connection;
#[cfg(feature = "tls")]
pub use listen::serve_tls;
pub use listen::{HttpLimits, UnixPeer, bind, bind_unix, serve, serve_unix, shutdown_signal};
pub use page::VIEW_CSP;
#[cfg(feature = "tools")]
pub(crate) use page::{JAVASCRIPT, MAP_SCRIPT, STYLE, page_asset};
pub use push::{UNSLOTTED_BODY_BYTES, declared_length, status_of};
pub use scrape::{DEFAULT_SCRAPE_SLOTS, EXPOSITION_CONTENT_TYPE};
pub use slots::{MIN_STALL, Slots};

use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::ingest::PushStore;
use crate::metrics::Metrics;
use crate::sources::AllocatorSources;
use crate::telemetry::Health;
use hosts::AgentHosts;
use probes::{healthz, readyz};
#[cfg(feature = "tools")]
use push::{BodyError, FROM_ELSEWHERE, attribute, internal, json, media_type_is, peers, refusal};

/// What the handlers share.
#[derive(Clone)]
pub struct AppState {
    /// The metrics to serve.
    pub metrics: Arc<Metrics>,
    /// Where pushed statistics go, if the agent accepts them.
    pub ingest: Option<Arc<PushStore>>,
    /// How long a push's body may take to arrive.
    pub body_timeout: std::time::Duration,
    /// Scrapes whose bodies may be in flight at once ([`DEFAULT_SCRAPE_SLOTS`]).
    pub scrape_slots: Arc<Slots>,
    /// Push bodies that may be read at once from TCP peers ([`DEFAULT_PUSH_SLOTS`]).
    pub push_slots: Arc<Slots>,
    /// Push bodies that may be read at once from the Unix socket: its own, so TCP pushers
    /// cannot take them ([`DEFAULT_PUSH_SLOTS`]).
    pub socket_push_slots: Arc<Slots>,
    /// The polling loops `/healthz` and `/readyz` report on.
    pub health: Health,
    /// Whether `/` is the live page (with `/api/v1/node`), or only links.
    pub ui: bool,
    /// The allocators exported, for the live page's segment maps of those this process holds.
    pub sources: AllocatorSources,
    /// The `Host` values answered (DNS rebinding: `hosts.rs`).
    pub hosts: AgentHosts,
    /// Pod and container names from the kubelet's log directories, where read: the
    /// recordings' listing names their pods with them.
    pub pod_names: Option<crate::telemetry::pod_names::PodNames>,
    /// Who pushes from the pod network are from, where the agent accepts them (feature
    /// `kubelet`: the container runtime is asked over gRPC).
    #[cfg(feature = "kubelet")]
    pub pod_network: Option<Arc<crate::telemetry::pod_network::PodNetwork>>,
    /// Who `/metrics`, the page and its APIs answer, where the web configuration file
    /// configures users or bearer tokens; pushes and probes answer anyone.
    #[cfg(feature = "tls")]
    pub auth: Option<Arc<web_config::Authentication>>,
    /// Where the kept recordings are archived, where they are: told of each new one, and
    /// the view opens archived recordings from it (`/recordings/archive/…`).
    #[cfg(feature = "archive")]
    pub uploads: Option<Arc<crate::archive::uploader::Uploads>>,
}

/// Push bodies read at once per kind of listener, by default: 8 × 512 KiB at most each.
pub const DEFAULT_PUSH_SLOTS: usize = 8;

impl AppState {
    /// The state serving `metrics`, pushes into `ingest` where given, with the default
    /// limits.
    pub fn new(metrics: Arc<Metrics>, ingest: Option<Arc<PushStore>>) -> AppState {
        AppState {
            metrics,
            ingest,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            scrape_slots: Slots::new(DEFAULT_SCRAPE_SLOTS),
            push_slots: Slots::new(DEFAULT_PUSH_SLOTS),
            socket_push_slots: Slots::new(DEFAULT_PUSH_SLOTS),
            health: Health::default(),
            ui: true,
            sources: AllocatorSources::default(),
            hosts: AgentHosts::default(),
            pod_names: None,
            #[cfg(feature = "kubelet")]
            pod_network: None,
            #[cfg(feature = "tls")]
            auth: None,
            #[cfg(feature = "archive")]
            uploads: None,
        }
    }

    /// Whether requests must carry credentials (users or tokens are configured).
    pub fn authenticates(&self) -> bool {
        #[cfg(feature = "tls")]
        return self.auth.is_some();
        #[cfg(not(feature = "tls"))]
        false
    }
}

/// The time a push's body may take by default: a push is at most 512 KiB from this host.
pub const DEFAULT_BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The router.
pub fn app(state: AppState) -> Router {
    // What shows the node: only to users where authentication is configured.
    let mut shown = Router::new()
        .route("/metrics", get(scrape::metrics))
        .route("/", get(page::index))
        .merge(page::routes(&state));
    if state.authenticates() {
        shown = shown.route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            check_user,
        ));
    }
    with_pushes_and_probes(state, shown)
}

/// The router of a listener that takes pushes only (`gpumem serve --push-listen`: plain HTTP
/// for jobs on the pod network where the main listener serves TLS), with the probes.
pub fn push_app(state: AppState) -> Router {
    with_pushes_and_probes(state, Router::new())
}

/// `routes` with pushes beside them, everything but the probes (no data, and the kubelet's
/// own Host) answering only to the agent's names (`hosts.rs`). Pushes are attributed, not
/// authenticated.
fn with_pushes_and_probes(state: AppState, routes: Router<AppState>) -> Router {
    let pushes = Router::new().route("/api/v1/push", post(push::push));
    #[cfg(feature = "tools")]
    let pushes = pushes.route("/api/v1/recordings", post(recordings::upload));
    pushes
        .merge(routes)
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            check_host,
        ))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(state)
}

/// Refuses (401) a request that carries no configured credentials: a user with its password
/// or a bearer token; answers 503 where its password could not be checked in time (a flood).
async fn check_user(
    State(state): State<AppState>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    #[cfg(feature = "tls")]
    if let Some(auth) = &state.auth {
        match auth
            .check(request.headers().get(header::AUTHORIZATION))
            .await
        {
            web_config::Verdict::Allowed => {}
            // Nothing is known of the credentials: the scraper should try again, not take
            // them for wrong.
            web_config::Verdict::Busy => {
                return (
                    StatusCode::SERVICE_UNAVAILABLE,
                    [(header::RETRY_AFTER, "1")],
                    "too many credentials are being checked; try again\n",
                )
                    .into_response();
            }
            web_config::Verdict::Refused => return unauthorized(auth),
        }
    }
    #[cfg(not(feature = "tls"))]
    let _ = &state;
    next.run(request).await
}

/// A 401 with the challenges of the schemes configured.
#[cfg(feature = "tls")]
fn unauthorized(auth: &web_config::Authentication) -> Response {
    let mut refusal = (
        StatusCode::UNAUTHORIZED,
        "this agent answers configured credentials only (basic or bearer authentication)\n",
    )
        .into_response();
    for challenge in auth.challenges() {
        refusal.headers_mut().append(
            header::WWW_AUTHENTICATE,
            axum::http::HeaderValue::from_static(challenge),
        );
    }
    refusal
}

/// Refuses (421) a request whose `Host` the agent does not answer to; one without a `Host`
/// (HTTP/1.0: not a browser's) is answered.
async fn check_host(
    State(state): State<AppState>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    let allowed = match request.headers().get(header::HOST) {
        None => true,
        Some(host) => host.to_str().is_ok_and(|h| state.hosts.allows(h)),
    };
    if allowed {
        next.run(request).await
    } else {
        (
            StatusCode::MISDIRECTED_REQUEST,
            "this agent answers to its addresses, the loopback names and the names given with --allow-host (Host header)\n",
        )
            .into_response()
    }
}
