//! The shared recordings (`../shared/traces`, or `GPUMEM_TRACES`), which a bare clone may not
//! have: a test that needs them is skipped there, saying why, and fails in CI, where
//! `.ci/run` sets `GPUMEM_REQUIRE_TRACES=1`, so that a missing directory cannot pass silently.

use std::path::{Path, PathBuf};

/// Where the shared recordings are looked for: `GPUMEM_TRACES`, else `../shared/traces`
/// beside the project.
fn traces_dir() -> PathBuf {
    std::env::var_os("GPUMEM_TRACES")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/traces"))
}

/// Whether the shared recordings must be there (`GPUMEM_REQUIRE_TRACES=1`).
fn required() -> bool {
    std::env::var_os("GPUMEM_REQUIRE_TRACES").is_some_and(|v| v == "1")
}

/// The shared recordings' directory, where it exists. Where it does not, `what` (the test,
/// or the part of it that needs them) is skipped with a line saying so, or, with
/// `GPUMEM_REQUIRE_TRACES=1`, the test panics.
pub(crate) fn shared_traces(what: &str) -> Option<PathBuf> {
    let dir = traces_dir();
    if dir.is_dir() {
        return Some(dir);
    }
    assert!(
        !required(),
        "{what} needs the shared recordings, and GPUMEM_REQUIRE_TRACES=1 requires them: {} is not a directory (set GPUMEM_TRACES to where they are)",
        dir.display()
    );
    eprintln!(
        "{what}: skipped, the shared recordings are not here ({}; set GPUMEM_TRACES, or GPUMEM_REQUIRE_TRACES=1 to fail instead)",
        dir.display()
    );
    None
}
