//! A job that plans itself (`GPUMEM_ALLOC_CONF=plan_record:N`, its own process: the
//! allocators are process-wide) reaches, once it follows its plan, the peak reserved of the
//! same job following from its start the plan made offline from its own trace, within a
//! page per stream; both far below the caching allocator's.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use gpumem::device::{SimConfig, SimDevice};
use gpumem::{AllocatorConfig, CachingAllocator, DevicePtr, StreamId};
use gpumem_torch::{gpumem_alloc, gpumem_free, plan_status, reset_peak_stats};

mod common;

const MIB: u64 = 1 << 20;
/// Trace events recorded before planning: a few iterations' worth.
const RECORD: usize = 400;

/// One request of the job: allocate `size` into slot `slot`, or free slot `slot`.
#[derive(Clone, Copy)]
enum Op {
    Alloc(usize, u64),
    Free(usize),
}

/// A training step on one stream, in slots: activations kept until the backward pass frees
/// them in reverse, temporaries freed at once, gradients of the backward pass, and a loss
/// kept into the next step (freed by it: a lifetime across the boundary).
fn step() -> Vec<Op> {
    use Op::{Alloc, Free};
    let activations = [3 * MIB, 5 * MIB, 2 * MIB, 7 * MIB, 3 * MIB / 2, 4 * MIB];
    let mut ops = vec![Free(99)];
    for (i, &size) in activations.iter().enumerate() {
        ops.push(Alloc(i, size));
        ops.push(Alloc(50, 6 * MIB + 512 * i as u64));
        ops.push(Free(50));
    }
    ops.push(Alloc(99, 512));
    for i in (0..activations.len()).rev() {
        ops.push(Alloc(60, 3 * MIB));
        ops.push(Free(i));
        ops.push(Free(60));
    }
    ops
}

/// Runs `steps` steps through `alloc` and `free`, after `setup` allocations kept throughout
/// (the weights), with `between` called after each step.
fn run(
    steps: usize,
    alloc: &mut dyn FnMut(u64) -> u64,
    free: &mut dyn FnMut(u64),
    between: &mut dyn FnMut(usize),
) {
    let mut slots = vec![0u64; 100];
    for _ in 0..3 {
        alloc(10 * MIB);
    }
    for k in 0..steps {
        for op in step() {
            match op {
                Op::Alloc(slot, size) => slots[slot] = alloc(size),
                Op::Free(slot) => {
                    if slots[slot] != 0 {
                        free(slots[slot]);
                        slots[slot] = 0;
                    }
                }
            }
        }
        between(k);
    }
}

/// Peak (allocated, reserved) over the last `measured` of `steps` steps of the job on an
/// in-process allocator, following `plan` from the start if given, and its first [`RECORD`]
/// trace events (taken as `plan_record` takes them).
fn in_process(
    plan: Option<gpumem::allocator::Plan>,
    steps: usize,
    measured: usize,
) -> ((i64, i64), Vec<gpumem::allocator::TraceEntry>) {
    let mut a = CachingAllocator::new(
        SimDevice::new(SimConfig::with_capacity(80 << 30)),
        AllocatorConfig::default(),
    );
    a.record_history(Some(RECORD));
    if let Some(plan) = plan {
        a.set_plan(std::sync::Arc::new(plan)).expect("valid");
    }
    let a = std::cell::RefCell::new(a);
    let mut trace = Vec::new();
    run(
        steps,
        &mut |size| {
            let mut a = a.borrow_mut();
            let ptr = a.malloc(size, StreamId::DEFAULT).expect("fits").0;
            if trace.is_empty() && a.trace_len() >= RECORD {
                trace = a.take_trace();
                a.record_history(None);
            }
            ptr
        },
        &mut |ptr| a.borrow_mut().free(DevicePtr(ptr)).expect("live"),
        &mut |k| {
            if k + 1 == steps - measured {
                a.borrow_mut().reset_peak_stats();
            }
        },
    );
    let a = a.into_inner();
    a.check_invariants().expect("consistent");
    let st = a.stats();
    let peaks = (st.allocated_bytes.all().peak, st.reserved_bytes.all().peak);
    assert_eq!(
        trace.len(),
        RECORD,
        "the job makes more than {RECORD} events"
    );
    (peaks, trace)
}

#[test]
fn a_job_that_plans_itself_reaches_its_offline_plan() {
    // Offline: the job's own first RECORD events, planned as `gpumem plan` would.
    let (caching, trace) = in_process(None, 30, 10);
    let plan =
        gpumem::plan::plan_trace(&trace, &AllocatorConfig::default()).expect("the step repeats");
    let (offline, _) = in_process(Some(plan), 30, 10);
    // Self-planning, through the C entry points.
    // SAFETY of the test: set before any allocator exists, while no other thread runs.
    #[allow(unsafe_code)] // the environment, set once at the start
    unsafe {
        std::env::set_var("GPUMEM_ALLOC_CONF", format!("plan_record:{RECORD}"));
    }
    let s = std::ptr::null_mut::<c_void>();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut settled_at = None;
    run(
        30,
        &mut |size| {
            let p = gpumem_alloc(size as usize, 0, s) as u64;
            assert_ne!(p, 0, "{size} bytes");
            p
        },
        &mut |ptr| gpumem_free(ptr as *mut c_void, 0, 0, s),
        &mut |k| {
            // The planner runs on its own thread, started once RECORD events were recorded
            // (within the first ten steps): wait for it (bounded) before the next step.
            if settled_at.is_none() && common::settle(deadline) {
                settled_at = Some(k);
            }
            assert!(settled_at.is_some() || k < 10, "no plan after step {k}");
            if k + 1 == 20 {
                let status = plan_status(0).expect("following");
                assert_eq!(status.paging.cache_releases, 1, "{status:?}");
                reset_peak_stats(0);
            }
        },
    );
    let settled = settled_at.expect("the job planned itself");
    assert!(settled < 20, "planned after step {settled}");
    let status = plan_status(0).expect("following");
    assert!(
        status.following && !status.paged,
        "whole regions: {status:?}"
    );
    let own = common::peaks();
    eprintln!(
        "peak (allocated, reserved) over the last 10 steps: caching allocator {caching:?}, offline plan {offline:?}, self-planned {own:?}; {status:?}"
    );
    common::assert_reaches(own, offline, caching);
}
