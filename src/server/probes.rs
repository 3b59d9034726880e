//! The probes: `/healthz` (liveness: the runtime answers and every polling loop keeps
//! finishing rounds, whatever the sources say) and `/readyz` (readiness: every loop's first
//! round is done). They answer anyone, with any `Host` (the kubelet's).

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::telemetry::Unhealthy;

use super::AppState;

pub(super) async fn healthz(State(state): State<AppState>) -> Response {
    probe(state.health.live(), "ok\n")
}

pub(super) async fn readyz(State(state): State<AppState>) -> Response {
    probe(state.health.ready(), "ready\n")
}

fn probe(result: Result<(), Unhealthy>, ok: &'static str) -> Response {
    match result {
        Ok(()) => ok.into_response(),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")).into_response(),
    }
}
