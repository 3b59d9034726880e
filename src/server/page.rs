//! The live page: `/` (the page, or only links with the page turned off), its assets,
//! `GET /api/v1/node` (`view::node` drawn from one scrape's
//! [`NodeSnapshot`](crate::metrics::snapshot::NodeSnapshot), as `/metrics` renders it) and
//! `GET /api/v1/segments` (the segment map of an allocator this process holds). Its pieces
//! that `gpumem view`'s page shares (the map's script, the style, the policy) live here.

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Router};

use super::scrape::held;
use super::{AppState, Connection};

/// The live page's assets and API, answered only with the page turned on (`state.ui`).
pub(super) fn routes(state: &AppState) -> Router<AppState> {
    let mut page = Router::new()
        .route(
            "/assets/agent.js",
            get(|| async { page_asset(AGENT_SCRIPT, JAVASCRIPT) }),
        )
        .route(
            "/assets/map.js",
            get(|| async { page_asset(MAP_SCRIPT, JAVASCRIPT) }),
        )
        .route(
            "/assets/view.css",
            get(|| async { page_asset(STYLE, "text/css; charset=utf-8") }),
        )
        .route("/api/v1/node", get(node))
        .route("/api/v1/segments", get(live_segments));
    #[cfg(feature = "tools")]
    {
        page = super::recordings::page_routes(page, state);
    }
    if !state.ui {
        page = page.route_layer(axum::middleware::from_fn(ui_off));
    }
    page
}

pub(super) async fn index(State(state): State<AppState>) -> Response {
    if state.ui {
        return page_asset(AGENT_PAGE, "text/html; charset=utf-8");
    }
    Html(concat!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>gpumem</title></head><body>",
        "<h1>gpumem</h1><p>GPU memory as nvidia-smi sees it and as the caching allocator holds it.</p>",
        "<ul><li><a href=\"/metrics\">/metrics</a> (Prometheus)</li>",
        "<li><a href=\"/healthz\">/healthz</a> (live)</li>",
        "<li><a href=\"/readyz\">/readyz</a> (ready)</li></ul></body></html>\n"
    ))
    .into_response()
}

const AGENT_PAGE: &str = include_str!("../view/assets/agent.html");
const AGENT_SCRIPT: &str = include_str!("../view/assets/agent.js");
/// The segment map's drawing, shared with `gpumem view`'s page.
pub(crate) const MAP_SCRIPT: &str = include_str!("../view/assets/map.js");
/// The pages' style, shared with `gpumem view`.
pub(crate) const STYLE: &str = include_str!("../view/assets/view.css");

/// An embedded asset of a page (the live page's, `gpumem view`'s), under the pages' policy
/// (their own script and style only), never cached.
pub(crate) fn page_asset(body: &'static str, content_type: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, VIEW_CSP),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
        .into_response()
}

/// The policy of the pages with a script (the live page, `gpumem view`'s): their own
/// origin's script, style and API only.
pub const VIEW_CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The media type of the pages' scripts.
pub(crate) const JAVASCRIPT: &str = "text/javascript; charset=utf-8";

/// The answer of the live page's routes with the page turned off.
async fn ui_off(_: Request, _: axum::middleware::Next) -> Response {
    (StatusCode::NOT_FOUND, "the page is turned off (--ui off)\n").into_response()
}

#[derive(serde::Deserialize)]
struct Allocator {
    uuid: String,
    pid: u32,
}

/// The segment map of an allocator this process holds (`?uuid=GPU-…&pid=N`), as its owner
/// last published it; asking makes the owner publish a fresh one at its next round (so the
/// first answer may be 202 "not yet": ask again).
async fn live_segments(
    State(state): State<AppState>,
    conn: Option<Extension<Connection>>,
    headers: axum::http::HeaderMap,
    axum::extract::Query(at): axum::extract::Query<Allocator>,
) -> Response {
    let found = state.sources.snapshot().into_iter().find(|s| {
        s.uuid == at.uuid && s.pid == at.pid && s.allocator == crate::sources::AllocatorKind::Gpumem
    });
    let Some(source) = found else {
        return (
            StatusCode::NOT_FOUND,
            "no allocator of this process has that GPU and pid (pushed processes' segments are not known)\n",
        )
            .into_response();
    };
    let Some(segments) = source.segments.request() else {
        // Accepted: the owner publishes them at its next round.
        return (
            StatusCode::ACCEPTED,
            "not yet: the allocator publishes its segments at its next round; ask again\n",
        )
            .into_response();
    };
    let map = crate::view::segments::map(&segments, source.gpu, None, None);
    // Within the scrape slots: a map of many blocks is a body of megabytes.
    let body = serde_json::to_string(&map).unwrap_or_default();
    held(&state, conn, &headers, "application/json", move |_| body).await
}

/// The live view (`view::node`), from one scrape of the same metrics `/metrics` serves.
async fn node(
    State(state): State<AppState>,
    conn: Option<Extension<Connection>>,
    headers: axum::http::HeaderMap,
) -> Response {
    held(&state, conn, &headers, "application/json", |m| {
        let view = crate::view::node::view(&m.snapshot());
        #[cfg(feature = "tools")]
        let view = super::recordings::with_newest(&state, view);
        serde_json::to_string(&view).unwrap_or_default()
    })
    .await
}
