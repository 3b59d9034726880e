//! Property tests: random sequences of malloc, free, record_stream, event completion,
//! empty_cache, configuration changes, memory fractions, injected driver failures, random
//! placement plans and requests that follow or diverge from them keep every invariant after
//! every operation, live allocations never overlap, and everything returns to the driver at
//! the end. A job diverging from a random plan fails no request that the caching allocator
//! alone serves unless a plan region holds live blocks.
//!
//! The normal run covers 10^5 operations; `GPUMEM_SOAK_OPS=10000000` runs a longer soak.

use gpumem::allocator::AllocError;
use gpumem::allocator::FitOrder;
use gpumem::device::{SimConfig, SimDevice};
use gpumem::ops::{ORDERS, Op, Run};
use gpumem::rng::XorShift;
use gpumem::{AllocatorConfig, CachingAllocator, DevicePtr, StreamId};
use proptest::prelude::*;

use crate::common::check;

fn run_ops(order: FitOrder, ops: impl IntoIterator<Item = Op>) -> Result<(), String> {
    let mut run = Run::with_order(order);
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
        order in 0..ORDERS.len(),
        raw in prop::collection::vec((any::<u64>(), any::<u64>(), any::<u64>()), 1000)
    ) {
        let ops = raw.into_iter().map(|(k, a, b)| Op::decode(k, a, b));
        if let Err(e) = run_ops(ORDERS[order], ops) {
            prop_assert!(false, "{}", e);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 50, ..ProptestConfig::default() })]

    /// Polling only the streams the device names as progressed completes exactly the frees
    /// that polling every stream does (Note [Stream-ordered reuse]): the same random
    /// operations on a device that names them and on one that answers as a real GPU (poll
    /// all) leave the same statistics after every operation, and a free left pending shows
    /// there (its block stays active).
    #[test]
    fn polling_the_streams_named_finds_what_polling_all_finds(
        raw in prop::collection::vec((any::<u64>(), any::<u64>(), any::<u64>()), 400)
    ) {
        let device = |names| SimConfig {
            names_completed_streams: names,
            ..SimConfig::with_capacity(2 << 30)
        };
        let mut named = Run::on(FitOrder::default(), device(true));
        let mut every = Run::on(FitOrder::default(), device(false));
        for (i, (k, a, b)) in raw.into_iter().enumerate() {
            let op = Op::decode(k, a, b);
            let (x, y) = (named.apply(&op), every.apply(&op));
            prop_assert_eq!(&x, &y, "op {} {:?}", i, op);
            prop_assert_eq!(
                named.alloc.memory_stats(),
                every.alloc.memory_stats(),
                "after op {} {:?}",
                i,
                op
            );
        }
        prop_assert!(named.alloc.device().stats().event_queries
            <= every.alloc.device().stats().event_queries);
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
        let order = ORDERS[(done / 100_000) as usize % ORDERS.len()];
        if let Err(e) = run_ops(order, ops) {
            panic!("soak failed after {done} operations under {order:?}: {e}");
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
    let mut private_segments = 0;
    for i in 0..20_000 {
        let op = Op::decode(rng.next_u64(), rng.next_u64(), rng.next_u64());
        run.apply(&op).expect("invariants hold");
        if i % 100 == 0 {
            private_segments += run
                .alloc
                .segment_infos()
                .iter()
                .filter(|s| !s.segment_pool_id.is_default())
                .count();
        }
    }
    let stats = run.alloc.memory_stats();
    eprintln!(
        "{} allocations, {private_segments} private-pool segments seen",
        stats["allocation.all.allocated"]
    );
    assert!(private_segments > 100, "private pools were hardly used");
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
    let st = run.alloc.stats();
    assert!(
        st.num_plan_hits.get() > 100 && st.num_plan_misses.get() > 100,
        "plans were hardly followed: {} hits, {} misses",
        st.num_plan_hits.get(),
        st.num_plan_misses.get()
    );
    run.finish().expect("everything returns to the driver");
}

#[test]
fn operations_decode_to_every_kind() {
    let mut rng = XorShift::new(1);
    let mut seen = [false; 15];
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
            Op::SetPlan { .. } => 8,
            Op::MallocPlanned { .. } => 9,
            Op::HintAddress { .. } => 10,
            Op::CreatePool { .. } => 11,
            Op::BeginPool { .. } => 12,
            Op::EndPool { .. } => 13,
            Op::ReleasePool { .. } => 14,
        };
        seen[i] = true;
    }
    assert_eq!(seen, [true; 15]);
    check(&Run::new().alloc);
}

/// A job's requests: entry `entry` of a plan (or, diverging, any size), freed `hold` requests
/// later.
#[derive(Clone, Debug)]
struct Request {
    size: u64,
    stream: StreamId,
    hold: usize,
}

/// Iterations over a random plan's entries, diverging at random: entries skipped, requests
/// the plan does not know, lifetimes up to two iterations long.
fn diverging_job(
    plan: &gpumem::allocator::Plan,
    rng: &mut XorShift,
    iterations: usize,
) -> Vec<Request> {
    let n = plan.entries.len();
    let mut job = Vec::new();
    for _ in 0..iterations {
        for e in &plan.entries {
            match rng.next_u64() % 10 {
                0 => continue,
                1 => job.push(Request {
                    size: 1 + rng.next_u64() % (64 << 20),
                    stream: StreamId(rng.next_u64() % gpumem::ops::STREAMS),
                    hold: (rng.next_u64() % (2 * n as u64 + 1)) as usize,
                }),
                _ => {}
            }
            job.push(Request {
                size: e.size,
                stream: e.stream,
                hold: (rng.next_u64() % (2 * n as u64 + 1)) as usize,
            });
        }
    }
    job
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// See [`plan_against_cache`].
    #[test]
    fn a_plans_memory_never_stands_in_a_requests_way(
        seed in any::<u64>(),
        capacity_mib in 256u64..2048,
    ) {
        plan_against_cache(seed, capacity_mib, seed.is_multiple_of(2))?;
    }
}

/// A case the property found: the planned cache, carved differently, is fragmented where
/// the plain one is not.
#[test]
fn a_plan_against_the_cache_where_their_layouts_differ() {
    for paged in [false, true] {
        if let Err(e) = plan_against_cache(1_877_766_696_007_313_677, 256, paged) {
            panic!("paged {paged}: {e}");
        }
    }
}

/// The same job on two allocators of one device size, with and without a random plan:
/// while both hold the same live allocations, wherever the caching allocator alone
/// serves a request and the planned one fails, either a plan region still holds live
/// blocks, or the plan holds nothing and the device could not give the segment the
/// request needed (regions without live blocks are given back before the last retry).
/// The two caches' layouts may differ (the plan served some requests the plain cache
/// carved its segments for), so the planned cache can be fragmented where the plain one
/// is not; the plan's own memory never stands in the way. Both keep every invariant. On a
/// device with virtual memory the plan's regions and chunks are paged.
fn plan_against_cache(
    seed: u64,
    capacity_mib: u64,
    virtual_memory: bool,
) -> Result<(), TestCaseError> {
    let plan = std::sync::Arc::new(gpumem::ops::random_plan(seed));
    let mut rng = XorShift::new(seed ^ 0x9e37);
    let job = diverging_job(&plan, &mut rng, 6);
    // Paged regions (a device with virtual memory) or whole segments.
    let device = || {
        SimDevice::new(SimConfig {
            virtual_memory,
            ..SimConfig::with_capacity(capacity_mib << 20)
        })
    };
    let mut plain = CachingAllocator::new(device(), AllocatorConfig::default());
    let mut planned = CachingAllocator::new(device(), AllocatorConfig::default());
    planned.set_plan(plan.clone()).expect("a valid plan");
    // Frees due at each request index, per allocator.
    let mut due: Vec<Vec<(Option<DevicePtr>, Option<DevicePtr>)>> = vec![Vec::new(); job.len() + 1];
    let mut same_live = true;
    for (i, r) in job.iter().enumerate() {
        for (a, b) in std::mem::take(&mut due[i]) {
            if let Some(p) = a {
                plain.free(p).expect("live");
            }
            if let Some(p) = b {
                planned.free(p).expect("live");
            }
        }
        let a = plain.malloc(r.size, r.stream);
        let b = planned.malloc(r.size, r.stream);
        if same_live && a.is_ok() && b.is_err() {
            let status = planned.plan_status().expect("a plan");
            if status.pinned_bytes == 0 {
                prop_assert_eq!(status.held_bytes, 0);
                let Err(AllocError::OutOfMemory(oom)) = &b else {
                    return Err(TestCaseError::fail(format!("request {i}: {b:?}")));
                };
                prop_assert!(
                    oom.free < oom.tried_to_allocate,
                    "request {} ({} bytes) failed under a plan holding nothing with {} bytes free on the device",
                    i,
                    r.size,
                    oom.free
                );
            }
        }
        if b.is_err() {
            // The retry chain gave back every region and chunk without live blocks.
            let status = planned.plan_status().expect("a plan");
            prop_assert_eq!(status.held_bytes, status.pinned_bytes);
        }
        // Once one served what the other refused, they hold different live blocks: the
        // comparison ends there (the invariants are still checked).
        same_live &= a.is_ok() == b.is_ok();
        prop_assert!(plain.check_invariants().is_ok());
        prop_assert!(
            planned.check_invariants().is_ok(),
            "{:?}",
            planned.check_invariants()
        );
        due[(i + 1 + r.hold).min(job.len())].push((a.ok(), b.ok()));
    }
    for (a, b) in due.into_iter().flatten() {
        if let Some(p) = a {
            plain.free(p).expect("live");
        }
        if let Some(p) = b {
            planned.free(p).expect("live");
        }
    }
    planned.clear_plan().expect("no live blocks left");
    planned.empty_cache().expect("empty");
    prop_assert_eq!(planned.total_allocated_memory(), 0);
    Ok(())
}

/// A job that repeats a plan's iteration exactly (each allocation freed before the next
/// begins, so any placement is valid) is served by the plan: every entry with an offset or
/// persistent hits, the caching allocator serves only the others, and nothing misses.
#[test]
fn a_job_that_follows_its_plan_hits_every_planned_entry() {
    for seed in 1..=50u64 {
        let plan = std::sync::Arc::new(gpumem::ops::random_plan(seed));
        let mut alloc = CachingAllocator::new(
            SimDevice::new(SimConfig::with_capacity(4 << 30)),
            AllocatorConfig::default(),
        );
        alloc.set_plan(plan.clone()).expect("valid");
        let iterations = 3;
        for _ in 0..iterations {
            for e in &plan.entries {
                let p = alloc.malloc(e.size, e.stream).expect("fits");
                alloc.free(p).expect("live");
            }
        }
        let planned = plan
            .entries
            .iter()
            .filter(|e| e.offset.is_some() || e.persistent)
            .count() as i64;
        let st = alloc.stats();
        assert_eq!(st.num_plan_hits.get(), planned * iterations, "seed {seed}");
        assert_eq!(st.num_plan_misses.get(), 0, "seed {seed}");
        check(&alloc);
    }
}
