//! The documentation holds together: every link between the repository's Markdown files
//! resolves (the file, and the heading an anchor names), and the metric contract's page is the
//! one the contract writes (`GPUMEM_BLESS=1` writes it again).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The repository's Markdown files (build output, dependencies and fuzz corpora left out).
fn markdown_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if path.is_dir() {
                if !name.starts_with('.')
                    && !["target", "node_modules", "corpus", "artifacts"].contains(&name.as_str())
                {
                    walk(&path, out);
                }
            } else if name.ends_with(".md") {
                out.push(path);
            }
        }
    }
    let mut files = Vec::new();
    walk(&root(), &mut files);
    files.sort();
    files
}

/// A Markdown text's lines outside fenced code blocks.
fn prose(text: &str) -> impl Iterator<Item = &str> {
    let mut fenced = false;
    text.lines().filter(move |line| {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            return false;
        }
        !fenced
    })
}

/// The anchors GitHub gives a Markdown file's headings: lowercased, punctuation but `-` and
/// `_` dropped, spaces made `-`, repeats numbered.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    for line in prose(text).filter(|l| l.starts_with('#')) {
        let title = line.trim_start_matches('#').trim();
        let slug: String = title
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let mut anchor = slug.clone();
        let mut n = 1;
        while !seen.insert(anchor.clone()) {
            anchor = format!("{slug}-{n}");
            n += 1;
        }
    }
    seen
}

/// The targets of a Markdown text's inline links, outside code.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in prose(text) {
        // Inline code is not a link.
        let mut plain = String::new();
        for (i, part) in line.split('`').enumerate() {
            if i % 2 == 0 {
                plain.push_str(part);
            }
        }
        let mut rest = plain.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].to_string());
            rest = &after[end..];
        }
    }
    out
}

#[test]
fn every_link_between_the_markdown_files_resolves() {
    let files = markdown_files();
    assert!(files.len() >= 10, "{files:?}");
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).expect("reads");
        for link in links(&text) {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, anchor) = link.split_once('#').unwrap_or((&link, ""));
            let target = if path.is_empty() {
                file.clone()
            } else {
                file.parent().expect("a directory").join(path)
            };
            if !target.exists() {
                broken.push(format!("{}: {link}: no such file", file.display()));
                continue;
            }
            if !anchor.is_empty() {
                let text = std::fs::read_to_string(&target).unwrap_or_default();
                if !anchors(&text).contains(anchor) {
                    broken.push(format!("{}: {link}: no such heading", file.display()));
                }
            }
        }
    }
    assert!(checked >= 20, "only {checked} links checked");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_metric_page_is_the_contracts() {
    let path = root().join("docs/metrics.md");
    let page = gpumem::metrics::contract::reference_page();
    if std::env::var_os("GPUMEM_BLESS").is_some() {
        std::fs::write(&path, &page).expect("writes");
    }
    let current = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        current == page,
        "docs/metrics.md differs from the contract: run with GPUMEM_BLESS=1 to write it"
    );
    for def in gpumem::metrics::contract::CONTRACT {
        assert!(current.contains(&format!("`{}`", def.name)), "{}", def.name);
    }
}

#[test]
fn the_readme_and_architecture_stay_short() {
    let lines = |name: &str| {
        std::fs::read_to_string(root().join(name))
            .expect("reads")
            .lines()
            .count()
    };
    assert!(
        lines("README.md") <= 150,
        "README.md: {} lines",
        lines("README.md")
    );
    assert!(
        lines("ARCHITECTURE.md") <= 200,
        "ARCHITECTURE.md: {} lines",
        lines("ARCHITECTURE.md")
    );
}
