//! Table cells of the pages built here: each figure in an element that names its JSON field
//! (`data-field`, a dotted path) and holds its exact value (`data-value`, the JSON scalar as
//! text), so that a reader, and the browser tests, can check a page against its JSON.

use std::fmt::Write;

use crate::allocator::size::format_size;

use super::escape;

/// A table row: a heading (markup the page writes, never recorded text) and a cell.
pub(crate) fn row(b: &mut String, heading: &str, cell: String) {
    let _ = writeln!(b, "<tr><th>{heading}</th>{cell}</tr>");
}

/// A figure in bytes: readable text, exact value.
pub(crate) fn bytes_cell(field: &str, bytes: Option<u64>) -> String {
    match bytes {
        Some(b) => format!(
            "<td class=\"num\" data-field=\"{field}\" data-value=\"{b}\" title=\"{b} bytes\">{}</td>",
            format_size(b)
        ),
        None => {
            format!("<td class=\"num\" data-field=\"{field}\" data-value=\"null\">unknown</td>")
        }
    }
}

/// A plain number or boolean.
pub(crate) fn value_cell(field: &str, value: impl std::fmt::Display) -> String {
    format!("<td class=\"num\" data-field=\"{field}\" data-value=\"{value}\">{value}</td>")
}

/// A string: its text is its value.
pub(crate) fn text_cell(field: &str, text: &str) -> String {
    let t = escape(text);
    format!("<td data-field=\"{field}\" data-value=\"{t}\">{t}</td>")
}

/// A string or null.
pub(crate) fn optional_text_cell(field: &str, text: Option<&str>) -> String {
    match text {
        Some(t) => text_cell(field, t),
        None => format!("<td data-field=\"{field}\" data-value=\"null\">none</td>"),
    }
}
