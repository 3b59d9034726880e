//! Pushes: `POST /api/v1/push` from this host or its pods (`crate::ingest` takes the body),
//! and what uploads share with them: who the sender is (a socket peer, loopback, a pod on
//! the pod network: [`attribute`]), the body read within its deadline and slots
//! ([`read_body`]), and refusals answered with their reason and counted.
//!
//! The invariants are the server's (module doc of `server`): a push is read only from this
//! host or a pod on it, only as JSON, never from a browser, never beyond its size or time.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Extension;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::{AppState, Connection, Slots, UnixPeer};
use crate::ingest::{MAX_BODY_BYTES, PushStore, Refusal, Rejected};

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
        Refusal::Forbidden | Refusal::UnknownPeer | Refusal::PeerIsNode | Refusal::NotInPod => {
            StatusCode::FORBIDDEN
        }
    }
}

/// A refusal's answer: its status, reason and message.
pub(super) fn refusal(refusal: Refusal, message: &str) -> Response {
    json(
        status_of(refusal),
        serde_json::json!({"error": message, "reason": refusal.label()}),
    )
}

/// A refusal before the store saw the body: counted, then answered.
pub(super) fn refused(store: &PushStore, kind: Refusal, message: &str) -> Response {
    store.count_refusal(kind);
    refusal(kind, message)
}

pub(super) fn json(status: StatusCode, body: serde_json::Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// Accepts a push from a process on this host (see [`crate::ingest`]).
pub(super) async fn push(
    State(state): State<AppState>,
    conn: Option<Extension<Connection>>,
    request: Request,
) -> Response {
    let Some(store) = state.ingest.clone() else {
        return json(
            StatusCode::NOT_FOUND,
            serde_json::json!({"error": "this agent does not accept pushes"}),
        );
    };
    // Only processes on this node may push: over the Unix socket (the kernel names the
    // process), from loopback, or from a pod on this node where the agent attributes them.
    let (unix, peer) = peers(&request);
    let pod = match (&unix, peer) {
        (Some(_), _) => None,
        (None, Some(ip)) => match attribute(&state, ip).await {
            Ok(pod) => pod,
            Err(rejected) => return refused(&store, rejected.refusal, &rejected.message),
        },
        (None, None) => return refused(&store, Refusal::Forbidden, FROM_ELSEWHERE),
    };
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
    if !media_type_is(headers, &["application/json"]) {
        return refused(
            &store,
            Refusal::Forbidden,
            "a push must be sent as Content-Type: application/json",
        );
    }
    let too_large = format!("the body exceeds {MAX_BODY_BYTES} bytes");
    let declared = declared_length(headers);
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        // Refused before a byte of the body is read.
        return refused(&store, Refusal::TooLarge, &too_large);
    }
    let conn = conn.map_or_else(Connection::detached, |c| c.0);
    let slots = if unix.is_some() {
        &state.socket_push_slots
    } else {
        &state.push_slots
    };
    // Dropped with its connection when its slot goes to another (a stalled body): counted.
    let reading = Reading::new(&store);
    let deadline = tokio::time::Instant::now() + state.body_timeout;
    let read = read_body(request.into_body(), &conn, slots, deadline).await;
    reading.done();
    let body = match read {
        Ok(body) => body,
        Err(BodyError::TooLarge) => return refused(&store, Refusal::TooLarge, &too_large),
        Err(BodyError::Busy) => {
            return refused(
                &store,
                Refusal::RateLimited,
                "too many large pushes are being read at once",
            );
        }
        Err(BodyError::Late | BodyError::Stalled) => {
            return refused(
                &store,
                Refusal::Truncated,
                &format!("the body did not arrive within {:?}", state.body_timeout),
            );
        }
        Err(BodyError::Broken(e)) => {
            return refused(
                &store,
                Refusal::Truncated,
                &format!("the body could not be read whole: {e}"),
            );
        }
    };
    let pushed = match pod {
        // A process not seen yet means a scan of /proc: off the runtime's threads.
        Some(pod) => {
            let store = Arc::clone(&store);
            match tokio::task::spawn_blocking(move || store.push_from_pod(&body, pod)).await {
                Ok(pushed) => pushed,
                Err(e) => return internal("push", &e),
            }
        }
        None => store.push_from(&body, unix.as_ref().and_then(UnixPeer::peer)),
    };
    match pushed {
        Ok(()) => json(StatusCode::ACCEPTED, serde_json::json!({"accepted": true})),
        Err(rejected) => refusal(rejected.refusal, &rejected.message),
    }
}

/// A push's or upload's work that failed off the event loop (`what`: `push`, `upload`).
pub(super) fn internal(what: &str, e: &tokio::task::JoinError) -> Response {
    tracing::error!(error = %e, "a {what} could not be processed");
    json(
        StatusCode::INTERNAL_SERVER_ERROR,
        serde_json::json!({"error": format!("the {what} could not be processed: {e}")}),
    )
}

/// Who sent a request: a Unix-socket peer (the kernel's word), or a TCP peer's address (a
/// dual-stack listener sees IPv4 peers as ::ffff:a.b.c.d, made IPv4 again).
pub(super) fn peers(request: &Request) -> (Option<UnixPeer>, Option<std::net::IpAddr>) {
    let extensions = request.extensions();
    let unix = extensions
        .get::<ConnectInfo<UnixPeer>>()
        .map(|c| c.0.clone());
    let peer = extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip().to_canonical());
    (unix, peer)
}

/// Whether the request's media type (its `Content-Type` before any parameter) is one of
/// `types`, in any case.
pub(super) fn media_type_is(headers: &axum::http::HeaderMap, types: &[&str]) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| types.iter().any(|t| v.trim().eq_ignore_ascii_case(t)))
}

/// The body's declared length, where the request gives one.
pub fn declared_length(headers: &axum::http::HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// The pod a TCP push or upload from `peer` is from (`None`: this host's own loopback,
/// unattributed), or why it is refused (the caller counts it where it belongs). Where the
/// agent attributes the pod network, a peer a ready pod has is that pod (pods are given loopback addresses only by tests); the node's addresses
/// are refused, as are unknown peers other than loopback's own (`127.0.0.1`, `::1`).
pub(super) async fn attribute(
    state: &AppState,
    peer: std::net::IpAddr,
) -> Result<Option<crate::telemetry::pod_network::PodPeer>, Rejected> {
    use crate::telemetry::pod_network::Attribution;
    let own_loopback = match peer {
        std::net::IpAddr::V4(v4) => v4 == std::net::Ipv4Addr::LOCALHOST,
        std::net::IpAddr::V6(v6) => v6 == std::net::Ipv6Addr::LOCALHOST,
    };
    // This host's own processes never wait for the runtime.
    if own_loopback {
        return Ok(None);
    }
    let attribution = match ask_pod_network(state, peer).await {
        Some(Ok(attribution)) => attribution,
        Some(Err(e)) => {
            return Err(Rejected::new(
                Refusal::UnknownPeer,
                format!("the container runtime did not answer, so {peer} is no known pod: {e}"),
            ));
        }
        None if peer.is_loopback() => return Ok(None),
        None => return Err(Rejected::new(Refusal::Forbidden, FROM_ELSEWHERE)),
    };
    match attribution {
        Attribution::Pod(pod) => Ok(Some(pod)),
        Attribution::Node => Err(Rejected::new(
            Refusal::PeerIsNode,
            format!(
                "{peer} is this node's address (a host-network sender, or a connection masqueraded on its way): push over the agent's socket, or from the pod's own address"
            ),
        )),
        Attribution::Unknown => Err(Rejected::new(
            Refusal::UnknownPeer,
            format!("{peer} is no ready pod's address on this node"),
        )),
    }
}

/// Why a push or upload from no known peer is refused.
pub(super) const FROM_ELSEWHERE: &str = "pushes are accepted from this host only";

/// Who `peer` is on the pod network; `None` where the agent does not attribute it.
#[cfg(feature = "kubelet")]
pub(super) async fn ask_pod_network(
    state: &AppState,
    peer: std::net::IpAddr,
) -> Option<Result<crate::telemetry::pod_network::Attribution, String>> {
    let network = state.pod_network.as_ref()?;
    Some(network.attribute(peer).await.map_err(|e| e.to_string()))
}

/// Who `peer` is on the pod network: never known without the runtime's client.
#[cfg(not(feature = "kubelet"))]
pub(super) async fn ask_pod_network(
    _: &AppState,
    _: std::net::IpAddr,
) -> Option<Result<crate::telemetry::pod_network::Attribution, String>> {
    None
}

/// Bytes of a push body read without a slot (and the rest of the read that crosses them): a
/// push of one or two devices' statistics (a few KiB) never waits for one, and a body
/// withheld or trickled holds no slot.
pub const UNSLOTTED_BODY_BYTES: usize = 16 * 1024;

/// Why a push body was not read.
pub(super) enum BodyError {
    TooLarge,
    /// No slot came for the part past [`UNSLOTTED_BODY_BYTES`] (a push).
    Busy,
    /// Too little of the body came in a window (an upload).
    #[cfg_attr(not(feature = "tools"), allow(dead_code))]
    Stalled,
    Late,
    Broken(axum::Error),
}

/// Reads a push body by its deadline: its first [`UNSLOTTED_BODY_BYTES`] without a slot,
/// the rest (up to [`MAX_BODY_BYTES`]) within one of `slots`.
pub(super) async fn read_body(
    mut body: axum::body::Body,
    conn: &Connection,
    slots: &Arc<Slots>,
    deadline: tokio::time::Instant,
) -> Result<Vec<u8>, BodyError> {
    use http_body_util::BodyExt;
    let mut bytes = Vec::new();
    let mut slot = None;
    loop {
        if slot.is_none() && bytes.len() >= UNSLOTTED_BODY_BYTES {
            let wait = deadline.saturating_duration_since(tokio::time::Instant::now());
            slot = Some(slots.take(conn, wait).await.ok_or(BodyError::Busy)?);
        }
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => return Err(BodyError::Late),
            Ok(None) => return Ok(bytes),
            Ok(Some(Err(e))) => return Err(BodyError::Broken(e)),
            Ok(Some(Ok(frame))) => frame,
        };
        if let Ok(data) = frame.into_data() {
            if bytes.len() + data.len() > MAX_BODY_BYTES {
                return Err(BodyError::TooLarge);
            }
            bytes.extend_from_slice(&data);
        }
    }
}

/// A push body being read: counted as truncated if dropped before it is done (its
/// connection was evicted).
pub(super) struct Reading<'a> {
    store: &'a PushStore,
    done: bool,
}

impl<'a> Reading<'a> {
    fn new(store: &'a PushStore) -> Reading<'a> {
        Reading { store, done: false }
    }

    fn done(mut self) {
        self.done = true;
    }
}

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.store.count_refusal(Refusal::Truncated);
        }
    }
}
