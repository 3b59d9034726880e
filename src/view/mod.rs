//! Pages and drawings for people: the explanation and the comparison of two runs as
//! self-contained HTML pages, the timeline SVG, what `gpumem view` serves (the segment map,
//! the recording's state behind its API, the page's embedded assets), the agent's kept
//! recordings in that view, and the agent's live page.
//!
//! # Invariants
//! - Every string that came from a recording or a user (file names, frames, configurations)
//!   passes through [`escape`] before it enters markup built here; the view's script puts
//!   such strings into the page only as text. Numbers are written by the formatter.
//! - A page declares a Content-Security-Policy: the explanation's allows nothing from the
//!   network ([`CONTENT_SECURITY_POLICY`]), the view's only its own origin's script, style and
//!   API (`server::view`), so both open the same on an air-gapped machine and a recording
//!   cannot make them fetch anything.

#[cfg(feature = "tools")]
mod cells;
#[cfg(feature = "tools")]
pub mod diff;
#[cfg(feature = "tools")]
pub mod explain;
#[cfg(feature = "tools")]
pub mod kept;
pub mod node;
#[cfg(feature = "tools")]
pub mod recording;
pub mod segments;
#[cfg(feature = "tools")]
pub mod timeline;

use std::fmt::Write;

/// Escapes `text` for HTML and SVG text and attribute values (quoted with `"` or `'`).
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// The policy of every page: inline styles and data images only; nothing loads from anywhere.
pub const CONTENT_SECURITY_POLICY: &str =
    "default-src 'none'; style-src 'unsafe-inline'; img-src data:";

const STYLE: &str = "\
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:72em;padding:0 1em;color:#222}\
h1{font-size:1.4em}h2{font-size:1.1em;margin-top:1.6em}\
table{border-collapse:collapse}td,th{padding:.2em .8em;text-align:left;vertical-align:top}\
td.num{text-align:right;white-space:nowrap;font-variant-numeric:tabular-nums}\
tr:nth-child(even){background:#f4f4f4}.note{color:#a40}\
code{background:#f0f0f0;padding:.1em .3em}.swatch{display:inline-block;width:.9em;height:.9em;margin-right:.4em;vertical-align:middle}";

/// A whole page: `title` (plain text, escaped here) and `body` (markup).
pub fn page(title: &str, body: &str) -> String {
    let mut out = String::with_capacity(body.len() + 1024);
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta http-equiv=\"Content-Security-Policy\" content=\"{CONTENT_SECURITY_POLICY}\">\
         <meta name=\"viewport\" content=\"width=device-width\">\
         <title>{}</title><style>{STYLE}</style></head>\n<body>\n{body}</body></html>\n",
        escape(title)
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_leaves_no_markup() {
        assert_eq!(
            escape(r#"<script>alert('x')</script> & "q""#),
            "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; &quot;q&quot;"
        );
        assert_eq!(escape("train.py:12 in step"), "train.py:12 in step");
    }

    #[test]
    fn page_escapes_its_title_and_forbids_the_network() {
        let p = page("<b>", "<p>x</p>");
        assert!(p.contains("<title>&lt;b&gt;</title>"));
        assert!(p.contains("default-src 'none'"));
        assert!(p.contains("<p>x</p>"));
    }
}
