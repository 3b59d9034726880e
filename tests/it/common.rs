//! Helpers shared by the integration tests: every operation is followed by a full invariant
//! scan, so a test that passes has also proven the allocator consistent at each step.

use gpumem::allocator::{BlockState, Snapshot};
use gpumem::device::{Device, SimConfig, SimDevice};
use gpumem::{AllocatorConfig, CachingAllocator, DevicePtr, StreamId};

/// Runs `command` to its end; its output. Fails the test, showing its stderr, unless it
/// succeeded.
pub fn succeeded(command: &mut std::process::Command) -> std::process::Output {
    let out = command.output().expect("the command runs");
    assert!(
        out.status.success(),
        "{command:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;
pub const S0: StreamId = StreamId(0);
pub const S1: StreamId = StreamId(1);
pub const S2: StreamId = StreamId(2);

/// An allocator on a simulated GPU of `capacity` bytes with the given settings, recording
/// its trace.
pub fn allocator(capacity: u64, conf: &str) -> CachingAllocator<SimDevice> {
    let config = AllocatorConfig::parse(conf).expect("valid test configuration");
    let mut a = CachingAllocator::new(SimDevice::new(SimConfig::with_capacity(capacity)), config);
    a.record_history(Some(10_000));
    a
}

/// A followed plan's hits and misses so far.
pub fn hits_and_misses<D: Device>(a: &CachingAllocator<D>) -> (i64, i64) {
    let st = a.stats();
    (st.num_plan_hits.get(), st.num_plan_misses.get())
}

pub fn check<D: Device>(a: &CachingAllocator<D>) {
    if let Err(e) = a.check_invariants() {
        panic!("invariant broken: {e}");
    }
}

pub fn malloc(a: &mut CachingAllocator<SimDevice>, size: u64, stream: StreamId) -> DevicePtr {
    let p = a
        .malloc(size, stream)
        .unwrap_or_else(|e| panic!("malloc({size}) failed: {e}"));
    check(a);
    p
}

pub fn free(a: &mut CachingAllocator<SimDevice>, p: DevicePtr) {
    a.free(p)
        .unwrap_or_else(|e| panic!("free({p:?}) failed: {e}"));
    check(a);
}

pub fn empty_cache(a: &mut CachingAllocator<SimDevice>) {
    a.empty_cache().expect("empty_cache");
    check(a);
}

/// One `memory_stats()` value.
pub fn stat(a: &CachingAllocator<SimDevice>, key: &str) -> i64 {
    *a.memory_stats()
        .get(key)
        .unwrap_or_else(|| panic!("no stat {key}"))
}

/// Blocks of the snapshot's segments as (address, size, state), in address order.
pub fn layout(snapshot: &Snapshot) -> Vec<Vec<(u64, u64, BlockState)>> {
    snapshot
        .segments
        .iter()
        .map(|s| {
            s.blocks
                .iter()
                .map(|b| (b.address, b.size, b.state))
                .collect()
        })
        .collect()
}

/// A fresh, empty directory for one test: `gpumem-NAME-PID` under the system's temp dir.
/// What `gpumem explain FILE` prints (it must succeed).
pub fn explain_text(file: &std::path::Path) -> String {
    let out = succeeded(
        std::process::Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .arg("explain")
            .arg(file),
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("gpumem-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// A replay session of `setup` on (a copy of) `recording`.
///
/// # Errors
/// As [`gpumem::replay::Session::new`].
pub fn session(
    recording: &gpumem::recording::Recording,
    setup: gpumem::replay::Setup,
) -> Result<gpumem::replay::Session, gpumem::replay::ReplayError> {
    gpumem::replay::Session::new(std::sync::Arc::new(recording.clone()), setup)
}

/// The check replay of `setup`'s device of `recording`.
pub fn replay_check(
    recording: &gpumem::recording::Recording,
    setup: gpumem::replay::Setup,
) -> Result<gpumem::replay::ReplayReport, gpumem::replay::ReplayError> {
    session(recording, setup)?.check()
}

/// A what-if replay of `setup`'s device of `recording`.
pub fn what_if(
    recording: &gpumem::recording::Recording,
    setup: gpumem::replay::Setup,
    what_if: gpumem::replay::WhatIf,
) -> Result<gpumem::replay::ReplayReport, gpumem::replay::ReplayError> {
    session(recording, setup)?.replay(&gpumem::replay::Mode::WhatIf(what_if), 0, &mut |_, _| {})
}

/// The explanation of `at` on `setup`'s device of `recording`.
pub fn explain(
    recording: &gpumem::recording::Recording,
    at: gpumem::explain::At,
    setup: gpumem::replay::Setup,
) -> Result<gpumem::explain::Explanation, gpumem::explain::ExplainError> {
    gpumem::explain::explain(&session(recording, setup)?, at)
}

/// The check replay of a recording given as JSON.
pub fn check_replay(v: &serde_json::Value) -> gpumem::replay::ReplayReport {
    let bytes = serde_json::to_vec(v).expect("serialises");
    let recording = gpumem::recording::parse_recording(&bytes).expect("reads back");
    replay_check(&recording, gpumem::replay::Setup::default()).expect("replay runs")
}

/// `v` replays exactly, every event of its trace compared.
pub fn replays_exactly(v: &serde_json::Value) -> gpumem::replay::ReplayReport {
    let r = check_replay(v);
    if let Some(d) = &r.divergence {
        panic!(
            "diverges at #{}: expected {}, got {}\n{}",
            d.index,
            d.expected,
            d.actual,
            d.context.join("\n")
        );
    }
    let events = v["device_traces"][0].as_array().expect("a trace").len();
    assert_eq!(r.compared.total(), events as u64);
    r
}
