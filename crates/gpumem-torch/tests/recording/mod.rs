//! A job that plans itself (`GPUMEM_ALLOC_CONF=…,plan_record:N`, its own process: the
//! allocators are process-wide, so each configuration is a test binary of its own) replays a
//! real looping recording (the bundled `cs336_lm_compiled_train`: twelve iterations of 126
//! allocations) through the C entry points; over its last iterations it reserves no more than
//! the caching allocator, and within 3 % of what the same job reserves following, from its
//! start, the plan `gpumem plan` makes of the recording.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use gpumem::allocator::{Plan, TraceAction};
use gpumem::device::{SimConfig, SimDevice};
use gpumem::plan::PlanOptions;
use gpumem::recording::{Recording, read_recording};
use gpumem::{AllocatorConfig, CachingAllocator, DevicePtr};
use gpumem_torch::{gpumem_alloc, gpumem_free, plan_status, reset_peak_stats};

/// Trace events the job records before planning: past the recording's warm-up (its first
/// iteration starts at event 1 856) and three of its iterations (378 events each).
const RECORD: usize = 3_400;
/// Iterations measured at the end.
pub const MEASURED: usize = 4;
fn recording() -> Recording {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../data/traces/cs336_lm_compiled_train.noframes.json.gz");
    read_recording(&path).expect("the bundled recording reads")
}

/// Drives device 0's trace of `recording`: each `alloc` through `alloc` (its size and
/// stream), each `free_requested` through `free`, calling `at` before each event.
fn drive(
    recording: &Recording,
    alloc: &mut dyn FnMut(u64, u64) -> u64,
    free: &mut dyn FnMut(u64),
    at: &mut dyn FnMut(usize),
) {
    let mut ptrs = std::collections::HashMap::new();
    for (i, e) in recording.device_traces[0].iter().enumerate() {
        at(i);
        match e.action {
            TraceAction::Alloc => {
                ptrs.insert(e.addr, alloc(e.size, e.stream.0));
            }
            TraceAction::FreeRequested => {
                if let Some(p) = ptrs.remove(&e.addr) {
                    free(p);
                }
            }
            _ => {}
        }
    }
}

/// Peak (allocated, reserved) from event `from` on, of the recording on an in-process
/// allocator, following `plan` from the start if given.
fn in_process(
    recording: &Recording,
    config: &AllocatorConfig,
    plan: Option<Plan>,
    from: usize,
) -> (i64, i64) {
    let mut a = CachingAllocator::new(
        SimDevice::new(SimConfig::with_capacity(80 << 30)),
        config.clone(),
    );
    if let Some(plan) = plan {
        a.set_plan(std::sync::Arc::new(plan)).expect("valid");
    }
    let a = std::cell::RefCell::new(a);
    drive(
        recording,
        &mut |size, stream| {
            let stream = gpumem::StreamId(stream);
            a.borrow_mut().malloc(size, stream).expect("fits").0
        },
        &mut |ptr| a.borrow_mut().free(DevicePtr(ptr)).expect("live"),
        &mut |i| {
            if i == from {
                a.borrow_mut().reset_peak_stats();
            }
        },
    );
    let a = a.into_inner();
    a.check_invariants().expect("consistent");
    let st = a.stats();
    (st.allocated_bytes.all().peak, st.reserved_bytes.all().peak)
}

/// The job under `config` (PyTorch's syntax) planning itself, against the caching allocator
/// and the offline plan of the recording (whole regions, the default), both under `config`:
/// never above the first, within 3 % of the second.
pub fn plans_itself_under(config: &str) {
    let parsed = AllocatorConfig::parse(config).expect("valid");
    let recording = recording();
    let planned = gpumem::plan::plan(
        &recording,
        "cs336_lm_compiled_train",
        &PlanOptions::default(),
    )
    .expect("the recording repeats");
    let per_iteration = planned.events.len();
    let from = planned.evaluated.end - MEASURED * per_iteration;
    let caching = in_process(&recording, &parsed, None, from);
    let offline = in_process(&recording, &parsed, Some(planned.plan.clone()), from);
    // SAFETY of the test: set before any allocator exists, while no other thread runs.
    #[allow(unsafe_code)] // the environment, set once at the start
    unsafe {
        std::env::set_var(
            "GPUMEM_ALLOC_CONF",
            [config, &format!("plan_record:{RECORD}")]
                .iter()
                .filter(|s| !s.is_empty())
                .copied()
                .collect::<Vec<_>>()
                .join(","),
        );
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut planned_at = None;
    drive(
        &recording,
        &mut |size, stream| {
            let p = gpumem_alloc(size as usize, 0, stream as usize as *mut c_void) as u64;
            assert_ne!(p, 0, "{size} bytes");
            p
        },
        &mut |ptr| gpumem_free(ptr as *mut c_void, 0, 0, std::ptr::null_mut()),
        &mut |i| {
            // The planner runs on its own thread: once it is under way, wait for it (bounded)
            // before the next event, where a job would run on (the plan would then start at
            // a later iteration).
            if planned_at.is_none() && super::common::settle(deadline) {
                planned_at = Some(i);
            }
            if i == from {
                reset_peak_stats(0);
            }
        },
    );
    let planned_at = planned_at.expect("the job planned itself");
    assert!(
        planned_at < from,
        "planned at event {planned_at}, measured from {from}"
    );
    let status = plan_status(0).expect("following");
    let own = super::common::peaks();
    eprintln!(
        "peak (allocated, reserved) over the last {MEASURED} iterations: caching allocator {caching:?}, offline plan {offline:?}, self-planned {own:?} (planned at event {planned_at}); {status:?}"
    );
    eprintln!(
        "{config:?}: {:?}",
        (own.1 >> 20, offline.1 >> 20, caching.1 >> 20)
    );
    super::common::assert_reaches(own, offline, caching);
}
