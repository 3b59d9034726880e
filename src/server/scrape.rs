//! Scrape bodies: `/metrics` in the format the scraper asks for first, and every large body
//! (the exposition, the live page's view and segment maps) held within the scrape slots and
//! gzip-compressed where the client accepts it.
//!
//! Negotiation: OpenMetrics 1.0 text where the `Accept` header ranks
//! `application/openmetrics-text` (version 1.0.0, or none given) above `text/plain` and the
//! wildcards (Prometheus asks for it first), else the 0.0.4 text format, which is also the
//! answer to a header that accepts neither; every answer names its Content-Type. Gzip where
//! `Accept-Encoding` takes `gzip` (or `*`) with a non-zero weight, at the fastest level: the
//! exposition is repetitive text, which that level shrinks 25- to 58-fold in a sixth to a
//! seventh of the default level's time (`docs/benchmarks.md`); every answer says
//! `Vary: Accept-Encoding`.
//!
//! # Invariants
//! - Parsing a header is linear in its length, which hyper bounds (`HttpLimits`).
//! - A body is compressed whole before it is sent, so a slot holds the smaller of the two.

use std::io::Write;

use axum::Extension;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use flate2::Compression;
use flate2::write::GzEncoder;

use super::{AppState, Connection, slots};
use crate::metrics::{Format, Metrics};

/// The Content-Type of the 0.0.4 text exposition.
pub const EXPOSITION_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

pub(super) async fn metrics(
    State(state): State<AppState>,
    conn: Option<Extension<Connection>>,
    headers: HeaderMap,
) -> Response {
    let format = format_for(header_str(&headers, header::ACCEPT));
    held(&state, conn, &headers, format.content_type(), |m| {
        m.encode(format)
    })
    .await
}

fn header_str(headers: &HeaderMap, name: header::HeaderName) -> Option<&str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// One element of a comma-separated header: its value, lower-cased; its weight (`q`: 1 where
/// absent, 0 where malformed or outside [0, 1]); and its `version` parameter, if any.
fn element(item: &str) -> (String, f64, Option<&str>) {
    let mut parts = item.split(';').map(str::trim);
    let value = parts.next().unwrap_or("").to_ascii_lowercase();
    let (mut q, mut version) = (1.0, None);
    for (key, v) in parts.filter_map(|p| p.split_once('=')) {
        let (key, v) = (key.trim(), v.trim());
        if key.eq_ignore_ascii_case("q") {
            q = v
                .parse()
                .ok()
                .filter(|q| (0.0..=1.0).contains(q))
                .unwrap_or(0.0);
        } else if key.eq_ignore_ascii_case("version") {
            version = Some(v);
        }
    }
    (value, q, version)
}

/// The exposition format an `Accept` header ranks first (module doc).
pub(super) fn format_for(accept: Option<&str>) -> Format {
    let mut best = (Format::Text, 0.0);
    for (media, q, version) in accept.unwrap_or("").split(',').map(element) {
        let format = match media.as_str() {
            "application/openmetrics-text" if version.is_none_or(|v| v == "1.0.0") => {
                Format::OpenMetrics
            }
            "text/plain" | "text/*" | "*/*" => Format::Text,
            _ => continue,
        };
        // The first of equal weights wins.
        if q > best.1 {
            best = (format, q);
        }
    }
    best.0
}

/// Whether an `Accept-Encoding` header takes gzip (module doc): named, or by `*` where it is
/// not named.
pub(super) fn accepts_gzip(accept_encoding: Option<&str>) -> bool {
    let (mut gzip, mut any) = (None, None);
    for (coding, q, _) in accept_encoding.unwrap_or("").split(',').map(element) {
        match coding.as_str() {
            "gzip" | "x-gzip" => gzip = Some(q > 0.0),
            "*" => any = Some(q > 0.0),
            _ => {}
        }
    }
    gzip.or(any).unwrap_or(false)
}

/// `body` gzip-compressed at the fastest level.
fn gzip(body: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut encoder = GzEncoder::new(Vec::with_capacity(body.len() / 8), Compression::fast());
    encoder.write_all(body)?;
    encoder.finish()
}

/// A body made from the metrics by `make`, held until the client has read it within one of
/// the scrape slots: a few at once bound the agent's memory whatever slow clients do (the
/// exposition and the live page's view alike); compressed where `headers` accept gzip.
pub(super) async fn held(
    state: &AppState,
    conn: Option<Extension<Connection>>,
    headers: &HeaderMap,
    content_type: &'static str,
    make: impl FnOnce(&Metrics) -> String,
) -> Response {
    let conn = conn.map_or_else(Connection::detached, |c| c.0);
    let Some(slot) = state.scrape_slots.take(&conn, SCRAPE_WAIT).await else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "too many scrapes in flight\n",
        )
            .into_response();
    };
    // Made inline: a scrape takes milliseconds, and staying on the runtime's thread keeps
    // the agent to one heap (a blocking-pool thread would grow a second malloc arena as large
    // as the exposition).
    let body = make(&state.metrics).into_bytes();
    let zipped = accepts_gzip(header_str(headers, header::ACCEPT_ENCODING))
        .then(|| gzip(&body))
        .and_then(|zipped| {
            zipped
                .inspect_err(|e| tracing::error!(error = %e, "compressing a scrape failed"))
                .ok()
        });
    let gzipped = zipped.is_some();
    let mut response = (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-store"),
            (header::VARY, "accept-encoding"),
        ],
        axum::body::Body::new(HeldBody {
            body: zipped.unwrap_or(body),
            sent: 0,
            _slot: slot,
        }),
    )
        .into_response();
    if gzipped {
        response.headers_mut().insert(
            header::CONTENT_ENCODING,
            header::HeaderValue::from_static("gzip"),
        );
    }
    response
}

/// How long a scrape waits for a slot before it is refused (503).
const SCRAPE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Scrapes whose bodies may be in flight at once, by default.
pub const DEFAULT_SCRAPE_SLOTS: usize = 4;

/// Bytes of a scrape body handed to hyper at a time.
const SCRAPE_CHUNK: usize = 64 * 1024;

/// A scrape body that holds its slot, and its bytes, until the last of them was taken: it is
/// handed out in copied chunks, so hyper's write backpressure keeps the slot held while a
/// slow client reads (one whole chunk would end the body at once and free the slot while the
/// bytes still waited in hyper's buffer).
struct HeldBody {
    body: Vec<u8>,
    sent: usize,
    _slot: slots::Slot,
}

impl axum::body::HttpBody for HeldBody {
    type Data = axum::body::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let start = self.sent;
        let end = self.body.len().min(start + SCRAPE_CHUNK);
        if start == end {
            return std::task::Poll::Ready(None);
        }
        self.sent = end;
        let chunk = axum::body::Bytes::copy_from_slice(&self.body[start..end]);
        std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        self.sent == self.body.len()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::SizeHint::with_exact((self.body.len() - self.sent) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_format_is_the_first_the_scraper_ranks_highest() {
        let cases = [
            // Prometheus 2.42 (Debian's), then Prometheus 3's default.
            (
                "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
                Format::OpenMetrics,
            ),
            (
                "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
                Format::OpenMetrics,
            ),
            ("application/openmetrics-text", Format::OpenMetrics),
            (
                "Application/OpenMetrics-Text; Version=1.0.0",
                Format::OpenMetrics,
            ),
            // A version this encoder does not write, or a lower weight, is not taken.
            ("application/openmetrics-text;version=0.0.1", Format::Text),
            (
                "text/plain;q=0.9,application/openmetrics-text;q=0.5",
                Format::Text,
            ),
            ("application/openmetrics-text;q=0", Format::Text),
            ("application/openmetrics-text;q=oops", Format::Text),
            (
                "text/plain;q=0.5,application/openmetrics-text;q=7",
                Format::Text,
            ),
            (
                "text/plain;q=0.5,application/openmetrics-text;q=NaN",
                Format::Text,
            ),
            // Equal weights: the first listed.
            ("*/*,application/openmetrics-text", Format::Text),
            ("application/openmetrics-text,*/*", Format::OpenMetrics),
            ("text/plain", Format::Text),
            ("application/json", Format::Text),
            ("", Format::Text),
            (";;,,=;q=", Format::Text),
        ];
        for (accept, expected) in cases {
            assert_eq!(format_for(Some(accept)), expected, "{accept}");
        }
        assert_eq!(format_for(None), Format::Text);
    }

    #[test]
    fn gzip_when_the_client_takes_it_with_a_weight() {
        for (header, expected) in [
            ("gzip", true),
            ("GZIP", true),
            ("x-gzip", true),
            ("deflate, gzip;q=0.5", true),
            ("gzip;q=0", false),
            ("gzip;q=0.0, *", false),
            ("*", true),
            ("*;q=0", false),
            ("br, zstd", false),
            ("identity", false),
            ("", false),
            ("gzip;q=nonsense", false),
            ("gzip;q=-1", false),
        ] {
            assert_eq!(accepts_gzip(Some(header)), expected, "{header}");
        }
        assert!(!accepts_gzip(None));
    }

    #[test]
    fn a_compressed_body_decompresses_to_itself() {
        let body = "gpumem_x{gpu=\"0\"} 1\n".repeat(10_000);
        let zipped = gzip(body.as_bytes()).expect("compresses");
        assert!(zipped.len() * 10 < body.len(), "{} bytes", zipped.len());
        let mut out = String::new();
        std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(&zipped[..]), &mut out)
            .expect("decompresses");
        assert_eq!(out, body);
    }
}
