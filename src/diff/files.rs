//! Files of two runs that are one file: the same program checked out or installed under
//! another directory (`/workspace/run1/train.py` and `/workspace/run2/train.py`), which path
//! normalisation (`explain::site`) cannot know to remove.
//!
//! A file that only one run names is matched with the other run's file that shares the most
//! trailing path components with it (the name at least), where that file is the one best
//! match of each for the other; a tie matches nothing.
//!
//! # Budget
//! Files are compared only with files of the same name, and a name that more than
//! [`MAX_SAME_NAME`] files of either run carry is not matched: the work is at most
//! `MAX_SAME_NAME` comparisons per file.

use std::collections::{BTreeMap, BTreeSet};

use super::FileMatch;

/// The most files of one run with one name that are matched.
pub const MAX_SAME_NAME: usize = 64;

/// The files of `a` and `b` (the empty name is no file) that are one file, each pair once.
pub(super) fn match_files<'x>(
    a: impl IntoIterator<Item = &'x str>,
    b: impl IntoIterator<Item = &'x str>,
) -> Vec<FileMatch> {
    let a: BTreeSet<&str> = a.into_iter().filter(|f| !f.is_empty()).collect();
    let b: BTreeSet<&str> = b.into_iter().filter(|f| !f.is_empty()).collect();
    let by_name = |own: &BTreeSet<&'x str>, other: &BTreeSet<&'x str>| {
        let mut names: BTreeMap<&'x str, Vec<&'x str>> = BTreeMap::new();
        for &file in own.difference(other) {
            names.entry(name(file)).or_default().push(file);
        }
        names
    };
    let (only_a, only_b) = (by_name(&a, &b), by_name(&b, &a));
    let mut matched = Vec::new();
    for (file_name, files_a) in &only_a {
        let Some(files_b) = only_b.get(file_name) else {
            continue;
        };
        if files_a.len() > MAX_SAME_NAME || files_b.len() > MAX_SAME_NAME {
            continue;
        }
        for &fa in files_a {
            let Some(fb) = best(fa, files_b) else {
                continue;
            };
            if best(fb, files_a) == Some(fa) {
                matched.push(FileMatch {
                    a: fa.to_string(),
                    b: fb.to_string(),
                });
            }
        }
    }
    matched
}

/// A path's last component.
fn name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// The one file of `among` sharing the most trailing components with `file`; none on a tie.
fn best<'x>(file: &str, among: &[&'x str]) -> Option<&'x str> {
    let mut best: Option<(usize, &'x str)> = None;
    let mut tied = false;
    for &other in among {
        let shared = file
            .rsplit('/')
            .zip(other.rsplit('/'))
            .take_while(|(x, y)| x == y)
            .count();
        match best {
            Some((most, _)) if shared < most => {}
            Some((most, _)) if shared == most => tied = true,
            _ => {
                best = Some((shared, other));
                tied = false;
            }
        }
    }
    best.filter(|&(shared, _)| shared > 0 && !tied)
        .map(|(_, f)| f)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(a: &[&str], b: &[&str]) -> Vec<(String, String)> {
        match_files(a.iter().copied(), b.iter().copied())
            .into_iter()
            .map(|m| (m.a, m.b))
            .collect()
    }

    #[test]
    fn a_program_under_another_directory_is_matched_file_by_file() {
        let a = [
            "/workspace/run1/train.py",
            "/workspace/run1/model/layers.py",
            "torch/nn/modules/linear.py",
        ];
        let b = [
            "/workspace/run2/train.py",
            "/workspace/run2/model/layers.py",
            "torch/nn/modules/linear.py",
            "/workspace/run2/extra.py",
        ];
        assert_eq!(
            pairs(&a, &b),
            [
                (
                    "/workspace/run1/model/layers.py".into(),
                    "/workspace/run2/model/layers.py".into()
                ),
                (
                    "/workspace/run1/train.py".into(),
                    "/workspace/run2/train.py".into()
                ),
            ]
        );
    }

    #[test]
    fn the_longest_shared_suffix_wins_and_a_tie_matches_nothing() {
        // Two `model.py` in A; B's shares its package directory with one of them.
        assert_eq!(
            pairs(&["/x/a/model.py", "/x/b/model.py"], &["/y/b/model.py"]),
            [("/x/b/model.py".into(), "/y/b/model.py".into())]
        );
        // Both of A's share just the name with B's: no telling which.
        assert!(pairs(&["/x/a/model.py", "/x/b/model.py"], &["/y/c/model.py"]).is_empty());
        // Different names never match; files both runs name need no match.
        assert!(pairs(&["/x/train.py"], &["/y/eval.py"]).is_empty());
        assert!(pairs(&["/x/train.py", ""], &["/x/train.py", ""]).is_empty());
    }

    #[test]
    fn a_name_carried_by_too_many_files_is_not_matched() {
        let a: Vec<String> = (0..=MAX_SAME_NAME)
            .map(|i| format!("/a/{i}/mod.py"))
            .collect();
        let b: Vec<String> = (0..=MAX_SAME_NAME)
            .map(|i| format!("/b/{i}/mod.py"))
            .collect();
        let matched = match_files(a.iter().map(String::as_str), b.iter().map(String::as_str));
        assert!(matched.is_empty());
        let matched = match_files(
            a[1..].iter().map(String::as_str),
            b[1..].iter().map(String::as_str),
        );
        assert_eq!(
            matched.len(),
            MAX_SAME_NAME,
            "within the budget, each by its directory"
        );
    }
}
