//! The HTTP shell of a recording's view: the page and its assets (embedded in the binary), and
//! the JSON and SVG it draws from, under `/api/v1/`. `gpumem view` serves its one recording at
//! `/` ([`view_app`]); the agent serves each recording it keeps at `/recordings/<id>/`
//! ([`view_routes`] with a [`ViewSource`] that opens them):
//!
//! - `GET /api/v1/recording`: the file's name, its recorded configuration, and per device the
//!   number of events, the `oom` entries and the event of peak reserved memory;
//! - `GET /api/v1/timeline.svg?device=N[&config=C]`: allocated and reserved over the trace,
//!   as recorded and, with `config`, under that configuration too;
//! - `GET /api/v1/segments?device=N&event=E[&config=C]`: the segment map just after event E
//!   (`view::segments`);
//! - `GET /api/v1/explain?device=N&event=E`: `gpumem explain --at E --json`.
//! - `GET /api/v1/diff?device=N&config=C`: `gpumem diff --config C --json` (the recording
//!   against its what-if under `C`).
//!
//! # Invariants
//! - Only requests whose `Host` is the address the view listens on (or `localhost`,
//!   `127.0.0.1` or `[::1]`, with its port or none) are answered: a page of another site that a DNS
//!   rebinding points at this port is refused with 421, so it cannot read the recording (the
//!   agent checks its own names: `hosts.rs`). A request another page sends here
//!   (`Sec-Fetch-Site` other than `same-origin` or `none`, or an `Origin` whose host and port
//!   are not the request's `Host`) is refused with 403 before any work, so it cannot make the
//!   view replay.
//! - At most [`REPLAYS_AT_ONCE`] replays run at once (the agent: one, opening included); a
//!   request waits up to 30 s for its turn, then is refused with 503.
//! - Every page and asset is sent with a Content-Security-Policy that allows only this
//!   origin's script and style and no network beyond it; replies are never cached.
//! - Work that replays runs off the event loop, one request at a time per cursor
//!   (`view::recording`); a bad parameter is a 400 with its reason, a failed replay a 422.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Query, RawPathParams, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Deserialize;

use crate::view::recording::{RecordingView, ViewError, ViewSource};

const INDEX: &str = include_str!("../view/assets/index.html");
const SCRIPT: &str = include_str!("../view/assets/view.js");

#[derive(Clone)]
struct ViewState {
    source: Arc<dyn ViewSource>,
    /// Replays running at once.
    work: Arc<tokio::sync::Semaphore>,
}

/// Replays (maps, timelines, explanations) running at once; more wait their turn.
pub const REPLAYS_AT_ONCE: usize = 2;
/// How long a request waits for its turn before it is refused (503).
const TURN_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// `gpumem view`'s router: `view` at `/`, served to clients whose `Host` is one of `hosts`.
pub fn view_app(view: Arc<RecordingView>, hosts: Vec<String>) -> Router {
    let hosts = Arc::new(hosts);
    view_routes::<()>(&[""], Arc::new(view), REPLAYS_AT_ONCE).layer(middleware::from_fn(
        move |request: Request, next: Next| {
            let hosts = Arc::clone(&hosts);
            async move {
                let host = request
                    .headers()
                    .get(header::HOST)
                    .and_then(|h| h.to_str().ok())
                    .map(str::to_ascii_lowercase);
                if host.is_some_and(|h| hosts.contains(&h)) {
                    next.run(request).await
                } else {
                    (
                        StatusCode::MISDIRECTED_REQUEST,
                        "this view answers only to the address it listens on (Host header)\n",
                    )
                        .into_response()
                }
            }
        },
    ))
}

/// The view's page and API under each of `prefixes` (`""`, or a path whose parameters name
/// the recording the source is asked for), `replays` of them running at once over all; the
/// caller checks the `Host`.
pub fn view_routes<S: Clone + Send + Sync + 'static>(
    prefixes: &[&str],
    source: Arc<dyn ViewSource>,
    replays: usize,
) -> Router<S> {
    let state = ViewState {
        source,
        work: Arc::new(tokio::sync::Semaphore::new(replays)),
    };
    let mut router = Router::new();
    for prefix in prefixes {
        router = router.merge(routes_under(prefix));
    }
    router
        .route_layer(middleware::from_fn(same_site))
        .with_state(state)
}

/// The view's page and API under `prefix`.
fn routes_under(prefix: &str) -> Router<ViewState> {
    Router::new()
        .route(
            &format!("{prefix}/"),
            get(|| async { super::page_asset(INDEX, "text/html; charset=utf-8") }),
        )
        .route(
            &format!("{prefix}/assets/view.js"),
            get(|| async { super::page_asset(SCRIPT, super::JAVASCRIPT) }),
        )
        .route(
            &format!("{prefix}/assets/map.js"),
            get(|| async { super::page_asset(super::MAP_SCRIPT, super::JAVASCRIPT) }),
        )
        .route(
            &format!("{prefix}/assets/view.css"),
            get(|| async { super::page_asset(super::STYLE, "text/css; charset=utf-8") }),
        )
        .route(&format!("{prefix}/api/v1/recording"), get(recording))
        .route(&format!("{prefix}/api/v1/timeline.svg"), get(timeline))
        .route(&format!("{prefix}/api/v1/segments"), get(segments))
        .route(&format!("{prefix}/api/v1/explain"), get(explain))
        .route(&format!("{prefix}/api/v1/diff"), get(diff))
}

/// Refuses (403) a request another site's page sent, before any work is done (a page may send
/// requests here blindly, no rebinding needed), and sends every answer under the page's
/// policy.
async fn same_site(request: Request, next: Next) -> Response {
    if is_cross_site(request.headers()) {
        return (
            StatusCode::FORBIDDEN,
            "this view answers only its own page (a request from another site)\n",
        )
            .into_response();
    }
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(super::VIEW_CSP),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    response
}

/// Whether a request came from another page than the view's own: the browser says it is not
/// same-origin (nor typed by the user), or its `Origin`'s host and port are not the `Host` it
/// was sent to.
fn is_cross_site(headers: &axum::http::HeaderMap) -> bool {
    let get = |name: axum::http::HeaderName| {
        headers
            .get(name)
            .and_then(|h| h.to_str().ok())
            .map(str::to_ascii_lowercase)
    };
    // Only the page itself (same origin) or the user (typing the address) may ask.
    let site = get(axum::http::HeaderName::from_static("sec-fetch-site"));
    if site.is_some_and(|site| site != "same-origin" && site != "none") {
        return true;
    }
    let Some(origin) = get(header::ORIGIN) else {
        return false;
    };
    let authority = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"));
    // An origin names its port where the page's address did; a page's own requests carry
    // the same `Host`.
    authority != get(header::HOST).as_deref()
}

/// `device` and, where the route needs one, `event`; `config` for a what-if.
#[derive(Deserialize)]
struct Of {
    device: u32,
    config: Option<String>,
}

#[derive(Deserialize)]
struct At {
    device: u32,
    event: usize,
    config: Option<String>,
}

fn error(e: &ViewError) -> Response {
    let status = match e {
        ViewError::BadRequest(_) => StatusCode::BAD_REQUEST,
        ViewError::NotFound(_) => StatusCode::NOT_FOUND,
        ViewError::Replay(_)
        | ViewError::Explain(_)
        | ViewError::Diverged(_)
        | ViewError::Unreadable(_) => StatusCode::UNPROCESSABLE_ENTITY,
    };
    (status, format!("{e}\n")).into_response()
}

fn json(value: &impl serde::Serialize) -> Response {
    match serde_json::to_string(value) {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "the reply could not be written\n",
        )
            .into_response(),
    }
}

/// The recording the path names (its parameters, in order, joined by `/`), where it names
/// one.
fn id_of(params: &RawPathParams) -> Option<String> {
    let parts: Vec<&str> = params.iter().map(|(_, v)| v).collect();
    (!parts.is_empty()).then(|| parts.join("/"))
}

/// Runs `work` on the view of the recording `params` names, on the blocking pool (opening a
/// recording and replaying take milliseconds to seconds), in its turn (at most
/// [`REPLAYS_AT_ONCE`]), and answers with `ok` of its value, or its error.
async fn reply<T: Send + 'static>(
    state: &ViewState,
    params: &RawPathParams,
    work: impl FnOnce(&RecordingView) -> Result<T, ViewError> + Send + 'static,
    ok: impl FnOnce(T) -> Response,
) -> Response {
    let turn = tokio::time::timeout(TURN_WAIT, Arc::clone(&state.work).acquire_owned()).await;
    let Ok(Ok(turn)) = turn else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "busy replaying; ask again\n",
        )
            .into_response();
    };
    // The turn ends with the work, not with the request: a client that goes away does not
    // free a turn its replay still uses.
    let source = Arc::clone(&state.source);
    let id = id_of(params);
    let work = move || {
        let _turn = turn;
        work(&*source.view(id.as_deref())?)
    };
    match tokio::task::spawn_blocking(work).await {
        Ok(Ok(value)) => ok(value),
        Ok(Err(e)) => error(&e),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "the request failed\n").into_response(),
    }
}

async fn recording(State(state): State<ViewState>, params: RawPathParams) -> Response {
    reply(&state, &params, |view| Ok(view.overview()), |o| json(&o)).await
}

async fn timeline(
    State(state): State<ViewState>,
    params: RawPathParams,
    Query(of): Query<Of>,
) -> Response {
    reply(
        &state,
        &params,
        move |view| view.timeline(of.device, of.config.as_deref()),
        |svg| ([(header::CONTENT_TYPE, "image/svg+xml")], svg).into_response(),
    )
    .await
}

async fn segments(
    State(state): State<ViewState>,
    params: RawPathParams,
    Query(at): Query<At>,
) -> Response {
    reply(
        &state,
        &params,
        move |view| view.segments(at.device, at.event, at.config.as_deref()),
        |map| json(&map),
    )
    .await
}

async fn diff(
    State(state): State<ViewState>,
    params: RawPathParams,
    Query(of): Query<Of>,
) -> Response {
    reply(
        &state,
        &params,
        move |view| view.diff(of.device, of.config.as_deref()),
        |d| json(&*d),
    )
    .await
}

async fn explain(
    State(state): State<ViewState>,
    params: RawPathParams,
    Query(at): Query<At>,
) -> Response {
    reply(
        &state,
        &params,
        move |view| view.explain(at.device, at.event),
        |e| json(&*e),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::is_cross_site;
    use axum::http::{HeaderMap, HeaderValue};

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for &(name, value) in pairs {
            map.insert(name, HeaderValue::from_static(value));
        }
        map
    }

    #[test]
    fn only_the_pages_own_requests_and_the_users_are_answered() {
        for (pairs, cross) in [
            // Typed by the user, or a client without the headers (curl, Prometheus).
            (vec![("host", "127.0.0.1:9419")], false),
            (
                vec![("host", "127.0.0.1:9419"), ("sec-fetch-site", "none")],
                false,
            ),
            // The page's own fetches.
            (
                vec![
                    ("host", "127.0.0.1:9419"),
                    ("sec-fetch-site", "same-origin"),
                    ("origin", "http://127.0.0.1:9419"),
                ],
                false,
            ),
            (
                vec![("host", "[::1]:9419"), ("origin", "http://[::1]:9419")],
                false,
            ),
            (
                vec![
                    ("host", "node-7.example:9417"),
                    ("origin", "https://node-7.example:9417"),
                ],
                false,
            ),
            // Another site's.
            (
                vec![("host", "127.0.0.1:9419"), ("sec-fetch-site", "cross-site")],
                true,
            ),
            (
                vec![("host", "127.0.0.1:9419"), ("sec-fetch-site", "same-site")],
                true,
            ),
            (
                vec![
                    ("host", "127.0.0.1:9419"),
                    ("origin", "http://evil.example"),
                ],
                true,
            ),
            (
                vec![
                    ("host", "127.0.0.1:9419"),
                    ("origin", "http://127.0.0.1:9420"),
                ],
                true,
            ),
            (vec![("host", "127.0.0.1:9419"), ("origin", "null")], true),
            (vec![("origin", "http://127.0.0.1:9419")], true),
        ] {
            assert_eq!(is_cross_site(&headers(&pairs)), cross, "{pairs:?}");
        }
    }
}
