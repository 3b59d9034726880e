//! The layering ARCHITECTURE.md promises, checked on the source: among the file-level edges
//! of non-test code (every `crate::`, `super::` and `self::` path, in `use` items or inline),
//! no cycle joins two files or more, and no edge runs against the data's flow between the
//! homes ([`FORBIDDEN`]); and no production function is long ([`LONG`], [`VERY_LONG`]). Each
//! crate of the workspace is read from its root through its `mod` declarations;
//! `#[cfg(test)]` items are left out, comments and string literals blanked first.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The crate roots of the workspace with more than one file, from the repository root
/// (`gpumem-torch` is one file).
const ROOTS: [&str; 3] = ["crates/gpumem-core/src/lib.rs", "src/lib.rs", "src/main.rs"];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `text` with comments blanked and string and character literals emptied (their quotes
/// kept), lengths unchanged, so that braces and paths in them are not read as code.
fn scrub(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = b.to_vec();
    let blank = |out: &mut Vec<u8>, from: usize, to: usize| {
        for c in &mut out[from..to] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    };
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                let end = b[i..]
                    .iter()
                    .position(|&c| c == b'\n')
                    .map_or(b.len(), |n| i + n);
                blank(&mut out, i, end);
                i = end;
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let (mut depth, mut j) = (0usize, i);
                while j < b.len() {
                    if b[j..].starts_with(b"/*") {
                        depth += 1;
                        j += 2;
                    } else if b[j..].starts_with(b"*/") {
                        depth -= 1;
                        j += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        j += 1;
                    }
                }
                blank(&mut out, i, j);
                i = j;
            }
            b'r' if matches!(b.get(i + 1), Some(b'"' | b'#'))
                && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')) =>
            {
                let hashes = b[i + 1..].iter().take_while(|&&c| c == b'#').count();
                let open = i + 1 + hashes;
                if b.get(open) != Some(&b'"') {
                    i += 1;
                    continue;
                }
                let close: Vec<u8> = std::iter::once(b'"')
                    .chain(std::iter::repeat_n(b'#', hashes))
                    .collect();
                let end = b[open + 1..]
                    .windows(close.len())
                    .position(|w| w == close.as_slice())
                    .map_or(b.len(), |n| open + 1 + n);
                blank(&mut out, open + 1, end);
                i = end + close.len();
            }
            b'"' => {
                let mut j = i + 1;
                while j < b.len() && b[j] != b'"' {
                    j += if b[j] == b'\\' { 2 } else { 1 };
                }
                blank(&mut out, i + 1, j.min(b.len()));
                i = j + 1;
            }
            // A character literal ('x', '\n', '\u{..}'), not a lifetime ('a).
            b'\'' => {
                let end = if b.get(i + 1) == Some(&b'\\') {
                    b[i + 2..]
                        .iter()
                        .position(|&c| c == b'\'')
                        .map(|n| i + 2 + n)
                } else if b.get(i + 2) == Some(&b'\'') {
                    Some(i + 2)
                } else {
                    None
                };
                match end {
                    Some(end) => {
                        blank(&mut out, i + 1, end);
                        i = end + 1;
                    }
                    None => i += 1,
                }
            }
            _ => i += 1,
        }
    }
    String::from_utf8(out).expect("blanking keeps UTF-8")
}

/// `code` (scrubbed) without its `#[cfg(test)]` items.
fn without_tests(code: &str) -> String {
    let mut out = code.to_string();
    let mut from = 0;
    while let Some(at) = out[from..].find("#[cfg(test)]").map(|n| from + n) {
        let item = at + "#[cfg(test)]".len();
        let rest = &out[item..];
        // The item ends at its block's closing brace, or at its `;` if that comes first, both
        // outside brackets (`fn f() -> [u8; 4] {`).
        let (open, semi) = (outside_brackets(rest, '{'), outside_brackets(rest, ';'));
        let end = match (open, semi) {
            (Some(open), semi) if semi.is_none_or(|s| open < s) => {
                let mut depth = 0;
                let mut end = out.len();
                for (k, c) in out[item + open..].char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = item + open + k + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                end
            }
            (_, Some(semi)) => item + semi + 1,
            _ => out.len(),
        };
        // Blanked, its lines kept (the function lengths count lines).
        let blank: String = out[at..end]
            .chars()
            .map(|c| if c == '\n' { '\n' } else { ' ' })
            .collect();
        out.replace_range(at..end, &blank);
        from = at + blank.len();
    }
    out
}

/// Where `wanted` first occurs in `s` outside parentheses and square brackets.
fn outside_brackets(s: &str, wanted: char) -> Option<usize> {
    let mut depth = 0i32;
    s.char_indices().find_map(|(k, c)| {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            _ => {}
        }
        (depth == 0 && c == wanted).then_some(k)
    })
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The paths written from `start` on (after a `crate::`-like head): `a::b::C`, or a group
/// `{a::B, c::{D, E}}` expanded into each of its paths.
fn paths_at(code: &str, start: usize) -> Vec<Vec<String>> {
    let s = &code[start..];
    let trimmed = s.trim_start();
    if let Some(inner) = trimmed.strip_prefix('{') {
        let offset = start + (s.len() - trimmed.len()) + 1;
        let mut out = Vec::new();
        let (mut depth, mut item) = (0, offset);
        // Each item of the group, but the empty one a trailing comma leaves.
        let item_paths = |from: usize, to: usize, out: &mut Vec<Vec<String>>| {
            if !code[from..to].trim().is_empty() {
                out.extend(paths_at(code, from));
            }
        };
        for (k, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    item_paths(item, offset + k, &mut out);
                    break;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    item_paths(item, offset + k, &mut out);
                    item = offset + k + 1;
                }
                _ => {}
            }
        }
        return out;
    }
    let ident: String = trimmed.chars().take_while(|&c| is_ident(c)).collect();
    if ident.is_empty() {
        return vec![Vec::new()];
    }
    let after = start + (s.len() - trimmed.len()) + ident.len();
    if code[after..].starts_with("::") {
        paths_at(code, after + 2)
            .into_iter()
            .map(|mut p| {
                p.insert(0, ident.clone());
                p
            })
            .collect()
    } else {
        vec![vec![ident]]
    }
}

/// A crate's modules: module path → its file and non-test code (read once), found from its
/// root's `mod` declarations.
fn modules(root_file: &Path) -> BTreeMap<Vec<String>, (PathBuf, String)> {
    let mut out = BTreeMap::new();
    let mut todo = vec![(Vec::new(), root_file.to_path_buf())];
    while let Some((path, file)) = todo.pop() {
        let code = without_tests(&scrub(&std::fs::read_to_string(&file).expect("readable")));
        // A `foo.rs` or `mod.rs` file's children live in `foo/` or beside it.
        let dir = match file.file_name().and_then(|n| n.to_str()) {
            Some("mod.rs" | "lib.rs" | "main.rs") => file.parent().expect("a dir").to_path_buf(),
            _ => file.with_extension(""),
        };
        for line in code.lines() {
            let line = line.trim();
            let decl = line
                .strip_prefix("pub(crate) mod ")
                .or_else(|| line.strip_prefix("pub(super) mod "))
                .or_else(|| line.strip_prefix("pub mod "))
                .or_else(|| line.strip_prefix("mod "));
            let Some(name) = decl.and_then(|d| d.strip_suffix(';')) else {
                continue;
            };
            let child = [
                dir.join(format!("{name}.rs")),
                dir.join(name).join("mod.rs"),
            ]
            .into_iter()
            .find(|f| f.exists())
            .unwrap_or_else(|| panic!("{}: mod {name} has no file", file.display()));
            let mut child_path = path.clone();
            child_path.push(name.to_string());
            todo.push((child_path, child));
        }
        out.insert(path, (file, code));
    }
    out
}

/// The file-level edges of one crate: file → the files its non-test code names.
fn edges(root_file: &Path) -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
    let mods = modules(root_file);
    let mut out: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
    for (path, (file, code)) in &mods {
        let targets = out.entry(file.clone()).or_default();
        for head in ["crate::", "super::", "self::"] {
            let mut from = 0;
            while let Some(at) = code[from..].find(head).map(|n| from + n) {
                from = at + head.len();
                if code[..at]
                    .chars()
                    .next_back()
                    .is_some_and(|c| is_ident(c) || c == ':')
                {
                    continue;
                }
                let mut base: Vec<String> = match head {
                    "crate::" => Vec::new(),
                    // `super` of `a/b.rs` (module a::b) is a; of `a/mod.rs` (module a) the root.
                    "super::" => path[..path.len().saturating_sub(1)].to_vec(),
                    _ => path.clone(),
                };
                let mut rest = from;
                while code[rest..].starts_with("super::") {
                    base.pop();
                    rest += "super::".len();
                }
                for tail in paths_at(code, rest) {
                    let mut full = base.clone();
                    full.extend(tail);
                    // The longest prefix that is a module names the file.
                    let target = (0..=full.len())
                        .rev()
                        .find_map(|n| mods.get(&full[..n]).map(|(f, _)| f))
                        .expect("the crate root is a module");
                    if target != file {
                        targets.insert(target.clone());
                    }
                }
            }
        }
    }
    out
}

/// The strongly connected components of more than one file (Tarjan's algorithm).
fn cycles(graph: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Vec<Vec<PathBuf>> {
    struct State<'a> {
        graph: &'a BTreeMap<PathBuf, BTreeSet<PathBuf>>,
        index: BTreeMap<&'a PathBuf, usize>,
        low: BTreeMap<&'a PathBuf, usize>,
        stack: Vec<&'a PathBuf>,
        on_stack: BTreeSet<&'a PathBuf>,
        out: Vec<Vec<PathBuf>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a PathBuf) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.graph.get(v).into_iter().flatten() {
            if !s.index.contains_key(w) {
                visit(s, w);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.on_stack.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.push(w.clone());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.out.push(component);
            }
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out
}

#[test]
fn no_files_depend_on_each_other_in_a_cycle() {
    let mut found = Vec::new();
    for crate_root in ROOTS {
        let graph = edges(&root().join(crate_root));
        assert!(graph.len() > 1, "{crate_root}: its modules found");
        for cycle in cycles(&graph) {
            let rel = |p: &PathBuf| p.strip_prefix(root()).unwrap_or(p).display().to_string();
            let names: Vec<String> = cycle.iter().map(rel).collect();
            let inner: Vec<String> = cycle
                .iter()
                .flat_map(|a| {
                    graph[a]
                        .iter()
                        .filter(|b| cycle.contains(b))
                        .map(move |b| format!("{} -> {}", rel(a), rel(b)))
                })
                .collect();
            found.push(format!(
                "{}\n    {}",
                names.join(", "),
                inner.join("\n    ")
            ));
        }
    }
    assert!(found.is_empty(), "dependency cycles:\n{}", found.join("\n"));
}

#[test]
fn the_cycle_check_reads_paths_groups_and_tests_as_meant() {
    let code = scrub(
        "use crate::{a::B, c::{d::E, F,},};\n// crate::comment::X\nlet s = \"crate::string\";\n\
         #[cfg(test)]\nmod tests { use crate::only_in_tests; }\nfn f() { super::g::h(); }\n\
         #[cfg(test)]\nfn t() -> [u8; 4] { crate::only_in_a_test_fn::x() }",
    );
    let code = without_tests(&code);
    assert!(!code.contains("comment") && !code.contains("string") && !code.contains("only_in"));
    let at = code.find("crate::").expect("a path") + "crate::".len();
    assert_eq!(
        paths_at(&code, at),
        [vec!["a", "B"], vec!["c", "d", "E"], vec!["c", "F"]]
    );
    let graph = BTreeMap::from([
        (PathBuf::from("a"), BTreeSet::from([PathBuf::from("b")])),
        (PathBuf::from("b"), BTreeSet::from([PathBuf::from("a")])),
        (PathBuf::from("c"), BTreeSet::from([PathBuf::from("a")])),
    ]);
    assert_eq!(
        cycles(&graph),
        [vec![PathBuf::from("a"), PathBuf::from("b")]]
    );
}

/// The data flows one way: the reader knows no analysis, source or shell; the analyses no
/// shell or demo; the node's sources not the demo that imitates them (paths from the
/// repository root; a path ending in `/` is a folder). Each home, with the fewest files it
/// has, so that a renamed home cannot pass unread.
const FORBIDDEN: [(&str, usize, &[&str]); 8] = [
    (
        "src/recording/",
        10,
        &[
            "src/replay/",
            "src/explain/",
            "src/diff/",
            "src/plan/",
            "src/sources.rs",
            "src/telemetry/",
            "src/view/",
            "src/server/",
            "src/metrics/",
            "src/ingest/",
            "src/demo/",
        ],
    ),
    (
        "src/replay/",
        6,
        &[
            "src/explain/",
            "src/diff/",
            "src/plan/",
            "src/view/",
            "src/server/",
            "src/demo/",
        ],
    ),
    (
        "src/explain/",
        2,
        &[
            "src/diff/",
            "src/plan/",
            "src/view/",
            "src/server/",
            "src/demo/",
        ],
    ),
    (
        "src/diff/",
        3,
        &["src/plan/", "src/view/", "src/server/", "src/demo/"],
    ),
    (
        "src/plan/",
        4,
        &["src/explain/", "src/view/", "src/server/", "src/demo/"],
    ),
    // What a job that plans itself needs (gpumem-torch): placement and the plan file, which
    // read no recording and replay nothing.
    (
        "src/plan/placement.rs",
        1,
        &[
            "src/recording/",
            "src/replay/",
            "src/explain/",
            "src/view/",
            "src/server/",
        ],
    ),
    (
        "src/plan/file.rs",
        1,
        &[
            "src/recording/",
            "src/replay/",
            "src/explain/",
            "src/view/",
            "src/server/",
        ],
    ),
    ("src/telemetry/", 9, &["src/demo/"]),
];

#[test]
fn the_data_flows_one_way_between_the_homes() {
    let graph = edges(&root().join("src/lib.rs"));
    let rel = |p: &Path| p.strip_prefix(root()).unwrap_or(p).display().to_string();
    let within = |path: &str, home: &str| {
        if home.ends_with('/') {
            path.starts_with(home)
        } else {
            path == home
        }
    };
    let mut checked = [0; FORBIDDEN.len()];
    let mut found = Vec::new();
    for (from, tos) in &graph {
        let from = rel(from);
        for (k, (home, _, banned)) in FORBIDDEN.iter().enumerate() {
            if !within(&from, home) {
                continue;
            }
            checked[k] += 1;
            for to in tos.iter().map(|t| rel(t)) {
                if banned.iter().any(|b| within(&to, b)) {
                    found.push(format!("{from} -> {to}"));
                }
            }
        }
    }
    for ((home, fewest, _), files) in FORBIDDEN.iter().zip(checked) {
        assert!(
            files >= *fewest,
            "{home}: {files} files read, {fewest} expected"
        );
    }
    assert!(
        found.is_empty(),
        "edges against the flow:\n{}",
        found.join("\n")
    );
}

/// Every crate root of the workspace, one-file crates included: where production code is.
const ALL_ROOTS: [&str; 5] = [
    "crates/gpumem-core/src/lib.rs",
    "crates/gpumem-torch/src/lib.rs",
    "crates/gpumem-baseline/src/lib.rs",
    "src/lib.rs",
    "src/main.rs",
];

/// A production function this long (in lines, from `fn` to its closing brace) is too long.
const VERY_LONG: usize = 250;
/// At most [`MOST_LONG`] production functions are this long: an interpreter's one `match`
/// (the pickle reader's `run`) may be, orchestration should not.
const LONG: usize = 150;
const MOST_LONG: usize = 2;

/// The functions with a body in `code` (scrubbed, tests left out): each one's name, first
/// line (1-based) and length in lines, from its `fn` to its closing brace.
fn function_lengths(code: &str) -> Vec<(String, usize, usize)> {
    let line_of = |at: usize| code[..at].matches('\n').count() + 1;
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = code[from..].find("fn").map(|n| from + n) {
        from = at + 2;
        let before = code[..at].chars().next_back();
        let after = &code[at + 2..];
        if before.is_some_and(is_ident) || !after.starts_with(char::is_whitespace) {
            continue;
        }
        let name: String = after
            .trim_start()
            .chars()
            .take_while(|&c| is_ident(c))
            .collect();
        if name.is_empty() {
            continue;
        }
        // Its body opens at the first brace outside brackets, unless a `;` ends it first (a
        // declaration: a trait's method, a foreign function).
        let (open, semi) = (outside_brackets(after, '{'), outside_brackets(after, ';'));
        let Some(open) = open.filter(|&o| semi.is_none_or(|s| o < s)) else {
            continue;
        };
        let open = at + 2 + open;
        let mut depth = 0;
        let close = code[open..].char_indices().find_map(|(k, c)| {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
            (depth == 0).then_some(open + k)
        });
        let Some(close) = close else { continue };
        let first = line_of(at);
        out.push((name, first, line_of(close) - first + 1));
    }
    out
}

/// Every production function of the workspace: file (from the repository root), name, first
/// line and length.
fn production_functions() -> Vec<(String, String, usize, usize)> {
    let mut files = BTreeMap::new();
    for crate_root in ALL_ROOTS {
        for (file, code) in modules(&root().join(crate_root)).into_values() {
            files.insert(file, code);
        }
    }
    assert!(files.len() > 100, "the crates' files found");
    let mut out = Vec::new();
    for (file, code) in files {
        let rel = file
            .strip_prefix(root())
            .unwrap_or(&file)
            .display()
            .to_string();
        for (name, line, length) in function_lengths(&code) {
            out.push((rel.clone(), name, line, length));
        }
    }
    out
}

#[test]
fn no_production_function_is_long() {
    let mut long: Vec<_> = production_functions()
        .into_iter()
        .filter(|(.., length)| *length >= LONG)
        .collect();
    long.sort_by_key(|(.., length)| std::cmp::Reverse(*length));
    let listed: Vec<String> = long
        .iter()
        .map(|(file, name, line, length)| format!("{length:>5} lines  {file}:{line} {name}"))
        .collect();
    let very_long = long.iter().filter(|(.., l)| *l >= VERY_LONG).count();
    assert!(
        very_long == 0 && long.len() <= MOST_LONG,
        "{very_long} production functions of {VERY_LONG} lines or more (none may be), {} of {LONG} or more (at most {MOST_LONG} may be):\n{}",
        long.len(),
        listed.join("\n")
    );
}

#[test]
fn function_lengths_count_bodies_only_of_production_code() {
    let code = scrub(
        "fn short() -> [u8; 2] {\n    [b'{', 0]\n}\n\
         trait T {\n    fn declared(&self);\n    fn provided(&self) {\n        \"}}}\";\n    }\n}\n\
         // fn in_a_comment() {\n\
         #[cfg(test)]\nmod tests {\n    fn a_test() {\n    }\n}\n\
         pub(crate) fn last<F: Fn() -> u8>(f: F)\nwhere\n    F: Copy,\n{\n    let _ = f;\n}\n",
    );
    let found = function_lengths(&without_tests(&code));
    let found: Vec<(&str, usize, usize)> = found
        .iter()
        .map(|(name, line, length)| (name.as_str(), *line, *length))
        .collect();
    assert_eq!(
        found,
        [("short", 1, 3), ("provided", 6, 3), ("last", 16, 6)]
    );
}
