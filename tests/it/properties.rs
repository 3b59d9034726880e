//! Property tests: random sequences of malloc, free, record_stream, event completion,
//! empty_cache, configuration changes, memory fractions and injected driver failures keep
//! every invariant after every operation, live allocations never overlap, and everything
//! returns to the driver at the end.
//!
//! The normal run covers 10^5 operations; `GPUMEM_SOAK_OPS=10000000` runs a longer soak.

use gpumem::ops::{Op, Run};
use gpumem::workload::XorShift;
use proptest::prelude::*;

use crate::common::check;

fn run_ops(ops: impl IntoIterator<Item = Op>) -> Result<(), String> {
    let mut run = Run::new();
    for (i, op) in ops.into_iter().enumerate() {
        run.apply(&op)
            .map_err(|e| format!("after op {i} {op:?}: {e}"))?;
    }
    run.finish()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 100, ..ProptestConfig::default() })]

    /// 100 cases × 1000 operations = 10^5 operations per test run.
    #[test]
    fn random_operations_keep_every_invariant(
        raw in prop::collection::vec((any::<u64>(), any::<u64>(), any::<u64>()), 1000)
    ) {
        let ops = raw.into_iter().map(|(k, a, b)| Op::decode(k, a, b));
        if let Err(e) = run_ops(ops) {
            prop_assert!(false, "{}", e);
        }
    }
}

#[test]
fn soak() {
    let Some(total) = std::env::var("GPUMEM_SOAK_OPS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    else {
        eprintln!("soak skipped: set GPUMEM_SOAK_OPS (e.g. 10000000) to run it");
        return;
    };
    let mut rng = XorShift::new(0x5eed);
    let mut done = 0;
    while done < total {
        // Fresh allocators every 10^5 operations keep the failure, if any, reproducible.
        let n = (total - done).min(100_000);
        let ops: Vec<Op> = (0..n)
            .map(|_| Op::decode(rng.next_u64(), rng.next_u64(), rng.next_u64()))
            .collect();
        if let Err(e) = run_ops(ops) {
            panic!("soak failed after {done} operations: {e}");
        }
        done += n;
    }
    eprintln!("soak: {done} operations, every invariant held");
}

/// The random operations must reach the paths the invariants guard: OOMs, retries, deferred
/// frees, releases and injected driver errors, otherwise the property above proves little.
#[test]
fn random_runs_reach_the_recovery_paths() {
    let mut rng = XorShift::new(7);
    let mut run = Run::new();
    for _ in 0..20_000 {
        let op = Op::decode(rng.next_u64(), rng.next_u64(), rng.next_u64());
        run.apply(&op).expect("invariants hold");
    }
    let stats = run.alloc.memory_stats();
    for key in [
        "num_ooms",
        "num_alloc_retries",
        "num_device_free",
        "num_sync_all_streams",
        "oversize_allocations.allocated",
        "inactive_split.all.allocated",
    ] {
        assert!(stats[key] > 0, "{key} never moved: {stats:?}");
    }
    let sim = run.alloc.device().stats();
    assert!(
        sim.maps > 0 && sim.unmaps > 0,
        "expandable segments never grew and shrank"
    );
    assert!(sim.events_created > 0);
    assert!(stats["allocation.all.allocated"] > 5_000);
    run.finish().expect("everything returns to the driver");
}

#[test]
fn operations_decode_to_every_kind() {
    let mut rng = XorShift::new(1);
    let mut seen = [false; 8];
    for _ in 0..10_000 {
        let op = Op::decode(rng.next_u64(), rng.next_u64(), rng.next_u64());
        let i = match op {
            Op::Malloc { .. } => 0,
            Op::Free { .. } => 1,
            Op::RecordStream { .. } => 2,
            Op::CompleteStream { .. } => 3,
            Op::EmptyCache => 4,
            Op::SetConfig { .. } => 5,
            Op::SetFraction { .. } => 6,
            Op::FailNextMalloc { .. } => 7,
        };
        seen[i] = true;
    }
    assert_eq!(seen, [true; 8]);
    check(&Run::new().alloc);
}
