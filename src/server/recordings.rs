//! The agent's kept recordings over HTTP (with the `tools` feature): uploads
//! (`POST /api/v1/recordings`, streamed to disk and kept by `ingest::recordings`), their
//! listing, each one's view at `/recordings/<id>/` (`server::view` over `view::kept`), the
//! way from a pid to its newest, and the live page's link from each process to its last.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use super::{
    AppState, BodyError, FROM_ELSEWHERE, attribute, declared_length, internal, json, media_type_is,
    peers, refusal, view,
};
use crate::ingest::Sender;
use crate::ingest::recordings::{
    RecordingStore, StoredRecording, Tenant, UPLOAD_MIN_PROGRESS, UPLOAD_TIMEOUT, UPLOAD_WINDOW,
};
use crate::ingest::{Refusal, Rejected};
use crate::view::node::NodeView;

/// Where the agent keeps its processes' recordings, if it does.
fn kept_by(state: &AppState) -> Option<&Arc<RecordingStore>> {
    state.ingest.as_ref()?.recordings()
}

/// `page` with the listing and, where the agent keeps recordings, each one's view (one
/// request at a time: `view::kept`'s budget).
pub(super) fn page_routes(page: Router<AppState>, state: &AppState) -> Router<AppState> {
    let page = page.route("/api/v1/recordings", get(list_recordings));
    let Some(store) = kept_by(state) else {
        return page;
    };
    let kept = crate::view::kept::KeptViews::new(Arc::clone(store));
    // One view for kept and archived recordings: one open and one replay at a time.
    #[cfg(feature = "archive")]
    let (kept, prefixes) = match &state.uploads {
        Some(uploads) => (
            kept.with_archive(Arc::clone(uploads)),
            vec![KEPT_VIEW, ARCHIVED_VIEW],
        ),
        None => (kept, vec![KEPT_VIEW]),
    };
    #[cfg(not(feature = "archive"))]
    let prefixes = [KEPT_VIEW];
    let page = page
        .merge(view::view_routes(&prefixes, Arc::new(kept), 1))
        .route("/recordings/{id}", get(to_recording_page))
        .route("/recordings/pid/{pid}", get(newest_recording_of));
    #[cfg(feature = "archive")]
    if state.uploads.is_some() {
        return page
            .route(ARCHIVED_VIEW, get(to_archived_page))
            .route(
                "/recordings/archive/{namespace}/{pod}",
                get(newest_archived),
            )
            .route(
                "/recordings/archive/{namespace}/{pod}/",
                get(newest_archived),
            );
    }
    page
}

/// A kept recording's view, by its id.
const KEPT_VIEW: &str = "/recordings/{id}";

/// An archived recording's view, by namespace, pod and name (`archive::address`).
#[cfg(feature = "archive")]
const ARCHIVED_VIEW: &str = "/recordings/archive/{namespace}/{pod}/{name}";

/// `/recordings/archive/<namespace>/<pod>/<name>` to its page (the page's addresses are
/// relative).
#[cfg(feature = "archive")]
async fn to_archived_page(
    axum::extract::Path((_, _, name)): axum::extract::Path<(String, String, String)>,
) -> Response {
    see_other(&format!("{}/", percent_encoded(&name)))
}

/// The newest archived recording of a pod (the OOM alert's `recording_url` where it names
/// the archive), opened at its OOM: found in the archive by this agent's cluster, whichever
/// node kept it.
#[cfg(feature = "archive")]
async fn newest_archived(
    State(state): State<AppState>,
    axum::extract::Path((namespace, pod)): axum::extract::Path<(String, String)>,
    request: Request,
) -> Response {
    use crate::archive::address::{RecordingKey, valid_segment};
    let Some(uploads) = state.uploads.clone() else {
        return no_recordings();
    };
    if !(valid_segment(&namespace) && valid_segment(&pod)) {
        return json(
            StatusCode::NOT_FOUND,
            serde_json::json!({"error": "not a namespace and pod name"}),
        );
    }
    let archive = uploads.archive();
    let prefix = archive.url().prefix(&namespace);
    let dir = RecordingKey::pod_dir(&prefix, uploads.cluster(), &namespace, &pod);
    match archive.newest(&prefix, &dir).await {
        Ok(Some((key, sidecar))) => {
            // Relative to this address, with or without its trailing slash.
            let base = if request.uri().path().ends_with('/') {
                String::new()
            } else {
                format!("{}/", percent_encoded(&pod))
            };
            see_other(&format!(
                "{base}{}/{}",
                percent_encoded(&key.name),
                sidecar.fragment()
            ))
        }
        Ok(None) => json(
            StatusCode::NOT_FOUND,
            serde_json::json!({"error": format!("the archive holds no recording of {namespace}/{pod} in cluster {}", uploads.cluster())}),
        ),
        Err(e) => json(
            StatusCode::BAD_GATEWAY,
            serde_json::json!({"error": format!("the archive could not be read: {e}")}),
        ),
    }
}

/// The live `view` with each process linked to its newest recording, where the agent keeps
/// it.
pub(super) fn with_newest(state: &AppState, mut view: NodeView) -> NodeView {
    let Some(store) = kept_by(state) else {
        return view;
    };
    // Newest first: each process links its last recording.
    let kept = store.list();
    for row in &mut view.processes {
        // The same pid in the same pod (a pid the host reused names another pod).
        row.recording = row
            .pid
            .parse()
            .ok()
            .and_then(|pid| {
                newest_of(&kept, pid, |r| {
                    r.pod_name.is_empty() || row.pod_name.is_empty() || r.pod_name == row.pod_name
                })
            })
            .map(|r| format!("recordings/{}", recording_link(r)));
    }
    view
}

/// `POST /api/v1/recordings`: a job's memory snapshot at its OOM, gzipped, from a process
/// that pushes (attributed as its pushes are; `?pid=` names it where the kernel does not,
/// with `&start_time=` from a pod). Streamed to the store's directory, then read and kept
/// (`ingest/recordings.rs`).
pub(super) async fn upload(State(state): State<AppState>, request: Request) -> Response {
    let Some(store) = state.ingest.clone() else {
        return no_recordings();
    };
    let Some(recordings) = store.recordings() else {
        return no_recordings();
    };
    let answer = |rejected: Rejected| refusal(rejected.refusal, &rejected.message);
    let refuse = |rejected: Rejected| answer(recordings.refuse(rejected));
    let sender = match peers(&request) {
        (Some(unix), _) => Sender::from(unix.peer()),
        (None, Some(ip)) => match attribute(&state, ip).await {
            Ok(Some(pod)) => Sender::Pod(pod),
            Ok(None) => Sender::Unattributed,
            Err(rejected) => return refuse(rejected),
        },
        (None, None) => return refuse(Rejected::new(Refusal::Forbidden, FROM_ELSEWHERE)),
    };
    let headers = request.headers();
    if headers.contains_key(header::ORIGIN) {
        return refuse(Rejected::new(
            Refusal::Forbidden,
            "uploads from web pages (with an Origin header) are refused",
        ));
    }
    if !media_type_is(headers, &["application/gzip", "application/x-gzip"]) {
        return refuse(Rejected::new(
            Refusal::Forbidden,
            "a recording must be sent as Content-Type: application/gzip",
        ));
    }
    let limit = recordings.limits().max_bytes_each;
    let too_large = || {
        Rejected::new(
            Refusal::TooLarge,
            format!("a recording may be at most {limit} bytes as sent"),
        )
    };
    let declared = declared_length(headers);
    if declared.is_some_and(|n| n > limit) {
        return refuse(too_large());
    }
    let query = request.uri().query().unwrap_or_default();
    let param = |name: &str| {
        query
            .split('&')
            .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))
            .and_then(|v| v.parse::<u64>().ok())
    };
    let pid = param("pid")
        .and_then(|p| u32::try_from(p).ok())
        .unwrap_or(0);
    let start_time = param("start_time");
    let uploader = {
        let store = Arc::clone(&store);
        // A pod's process not seen yet means a scan of /proc: off the runtime's threads.
        match tokio::task::spawn_blocking(move || store.recording_owner(sender, pid, start_time))
            .await
        {
            Ok(Ok(uploader)) => uploader,
            Ok(Err(rejected)) => return refuse(rejected),
            Err(e) => return internal("upload", &e),
        }
    };
    let upload = match recordings.begin(&uploader) {
        Ok(upload) => upload,
        Err(rejected) => return refusal(rejected.refusal, &rejected.message),
    };
    let deadline = tokio::time::Instant::now() + UPLOAD_TIMEOUT;
    let file = match upload.create() {
        Ok(file) => tokio::fs::File::from_std(file),
        Err(e) => {
            return answer(upload.refuse(Rejected::new(
                Refusal::Capacity,
                format!("the recording could not be stored: {e}"),
            )));
        }
    };
    let written = match write_body(request.into_body(), file, limit, deadline).await {
        Ok(written) => written,
        Err(BodyError::TooLarge) => return answer(upload.refuse(too_large())),
        Err(BodyError::Late) => {
            return answer(upload.refuse(Rejected::new(
                Refusal::Truncated,
                format!("the recording did not arrive within {UPLOAD_TIMEOUT:?}"),
            )));
        }
        // (An upload takes no slot: never busy.)
        Err(BodyError::Stalled | BodyError::Busy) => {
            return answer(upload.refuse(Rejected::new(
                Refusal::Truncated,
                format!(
                    "the recording stalled: less than {UPLOAD_MIN_PROGRESS} bytes came in {UPLOAD_WINDOW:?}"
                ),
            )));
        }
        Err(BodyError::Broken(e)) => {
            return answer(upload.refuse(Rejected::new(
                Refusal::Truncated,
                format!("the recording could not be read whole: {e}"),
            )));
        }
    };
    if declared.is_some_and(|n| n != written) {
        return answer(upload.refuse(Rejected::new(
            Refusal::Truncated,
            format!(
                "the recording ended after {written} of its {} bytes",
                declared.unwrap_or(0)
            ),
        )));
    }
    let kept = {
        let recordings = Arc::clone(recordings);
        tokio::task::spawn_blocking(move || recordings.finish(upload, written, &uploader)).await
    };
    match kept {
        // Refusals are counted by the store.
        Ok(Ok(stored)) => {
            #[cfg(feature = "archive")]
            if let Some(uploads) = &state.uploads {
                uploads.poke();
            }
            json(StatusCode::CREATED, serde_json::json!(stored))
        }
        Ok(Err(rejected)) => refusal(rejected.refusal, &rejected.message),
        Err(e) => internal("upload", &e),
    }
}

/// `GET /api/v1/recordings`: the recordings kept, newest first, each pod named by the
/// kubelet's log directories where its upload did not name it.
async fn list_recordings(State(state): State<AppState>) -> Response {
    let Some(recordings) = kept_by(&state) else {
        return no_recordings();
    };
    let directory = state
        .pod_names
        .as_ref()
        .map(crate::telemetry::pod_names::PodNames::directory);
    let mut list = recordings.list();
    for r in list.iter_mut().filter(|r| r.pod_name.is_empty()) {
        if let Some(name) = directory
            .as_deref()
            .and_then(|d| d.name(&r.pod_uid, &r.container_id))
        {
            (r.pod_namespace, r.pod_name, r.container_name) =
                (name.namespace, name.pod, name.container);
        }
    }
    json(StatusCode::OK, serde_json::json!(list))
}

/// `/recordings/<id>` to its page, `/recordings/<id>/` (the page's addresses are relative).
async fn to_recording_page(axum::extract::Path(id): axum::extract::Path<String>) -> Response {
    see_other(&format!("{}/", percent_encoded(&id)))
}

/// The newest recording of process `pid` (the OOM alert's `recording_url`), opened at its OOM.
async fn newest_recording_of(
    State(state): State<AppState>,
    axum::extract::Path(pid): axum::extract::Path<u32>,
) -> Response {
    let Some(recordings) = kept_by(&state) else {
        return no_recordings();
    };
    match newest_of(&recordings.list(), pid, |_| true) {
        Some(newest) => see_other(&format!("../{}", recording_link(newest))),
        None => json(
            StatusCode::NOT_FOUND,
            serde_json::json!({"error": format!("this agent keeps no recording of pid {pid} (it may have been evicted, or the job recorded none: GPUMEM_PUSH_HISTORY)")}),
        ),
    }
}

/// The newest of `kept` (newest first) of process `pid` that `also` accepts, one a process
/// the kernel or the runtime named before one from loopback TCP: a loopback sender's pid is
/// its own word, so one naming a dead job's pid cannot take that job's link over.
fn newest_of(
    kept: &[StoredRecording],
    pid: u32,
    also: impl Fn(&StoredRecording) -> bool,
) -> Option<&StoredRecording> {
    let of_pid = || kept.iter().filter(|r| r.pid == pid && also(r));
    of_pid()
        .find(|r| r.tenant != Some(Tenant::Loopback))
        .or_else(|| of_pid().next())
}

/// Where a kept recording's page opens, relative to `/recordings/`: at its OOM, where it has
/// one.
pub fn recording_link(kept: &StoredRecording) -> String {
    let at = match (kept.device, kept.oom_event) {
        (Some(device), Some(event)) => format!("#device={device}&event={event}"),
        _ => String::new(),
    };
    format!("{}/{at}", percent_encoded(&kept.id))
}

/// The bytes a path segment percent-encodes: all but letters, digits, `-`, `_` and `.`.
const SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.');

/// `text` as a path segment.
fn percent_encoded(text: &str) -> String {
    percent_encoding::utf8_percent_encode(text, SEGMENT).to_string()
}

/// A redirect to `location` (relative: the agent may sit behind a proxy's path).
fn see_other(location: &str) -> Response {
    match axum::http::HeaderValue::from_str(location) {
        Ok(value) => (StatusCode::SEE_OTHER, [(header::LOCATION, value)]).into_response(),
        Err(_) => (StatusCode::BAD_REQUEST, "not a recording's address\n").into_response(),
    }
}

fn no_recordings() -> Response {
    json(
        StatusCode::NOT_FOUND,
        serde_json::json!({"error": "this agent keeps no recordings"}),
    )
}

/// Writes a body to `file` by `deadline`, at most `limit` bytes, and at least
/// [`UPLOAD_MIN_PROGRESS`] of them in each [`UPLOAD_WINDOW`]: how many were written.
async fn write_body(
    mut body: axum::body::Body,
    mut file: tokio::fs::File,
    limit: u64,
    deadline: tokio::time::Instant,
) -> Result<u64, BodyError> {
    use http_body_util::BodyExt;
    use tokio::io::AsyncWriteExt;
    let broken = |e: std::io::Error| BodyError::Broken(axum::Error::new(e));
    let mut written = 0u64;
    let mut window = (tokio::time::Instant::now() + UPLOAD_WINDOW, 0u64);
    loop {
        let frame = match tokio::time::timeout_at(deadline.min(window.0), body.frame()).await {
            Err(_) if tokio::time::Instant::now() >= deadline => return Err(BodyError::Late),
            Err(_) if window.1 < UPLOAD_MIN_PROGRESS => return Err(BodyError::Stalled),
            Err(_) => {
                window = (tokio::time::Instant::now() + UPLOAD_WINDOW, 0);
                continue;
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(BodyError::Broken(e)),
            Ok(Some(Ok(frame))) => frame,
        };
        if let Ok(data) = frame.into_data() {
            written += data.len() as u64;
            window.1 += data.len() as u64;
            if written > limit {
                return Err(BodyError::TooLarge);
            }
            file.write_all(&data).await.map_err(broken)?;
        }
    }
    file.flush().await.map_err(broken)?;
    Ok(written)
}
