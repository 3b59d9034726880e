//! Several threads drive one `SharedAllocator` while another reads its statistics without the
//! lock; at the end the stats agree with the blocks and everything goes back to the driver.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;

use gpumem::device::{Call, SimConfig, SimDevice};
use gpumem::rng::XorShift;
use gpumem::{AllocatorConfig, CachingAllocator, DevicePtr, SharedAllocator, StreamId};

use crate::common::{GIB, MIB};

const THREADS: u64 = 4;
const OPS_PER_THREAD: u64 = 20_000;

#[test]
fn threads_share_one_allocator_and_end_consistent() {
    let device = SimDevice::new(SimConfig::with_capacity(16 * GIB));
    let shared = Arc::new(SharedAllocator::new(CachingAllocator::new(
        device,
        AllocatorConfig::default(),
    )));
    let done = Arc::new(AtomicBool::new(false));

    let reader = {
        let stats = Arc::clone(shared.stats());
        let shared = Arc::clone(&shared);
        let done = Arc::clone(&done);
        thread::spawn(move || {
            let mut reads = 0u64;
            let (mut reserved_peak, mut allocated_peak) = (0, 0);
            while !done.load(Ordering::Relaxed) {
                // Without the lock: peaks only grow, reads never see them go back.
                let reserved = stats.reserved_bytes.all().peak;
                let allocated = stats.allocated_bytes.all().peak;
                assert!(reserved >= reserved_peak, "{reserved} < {reserved_peak}");
                assert!(
                    allocated >= allocated_peak,
                    "{allocated} < {allocated_peak}"
                );
                (reserved_peak, allocated_peak) = (reserved, allocated);
                // Under the lock, now and then: a consistent view of the figures.
                if reads.is_multiple_of(64) {
                    shared.with(|a| {
                        let s = a.stats();
                        let allocated = s.allocated_bytes.all_current();
                        let reserved = s.reserved_bytes.all_current();
                        assert!(
                            0 <= allocated && allocated <= reserved,
                            "{allocated} > {reserved}"
                        );
                        assert!(s.active_bytes().all_current() <= reserved);
                        assert!(reserved <= s.reserved_bytes.all().peak);
                        assert_eq!(reserved as u64, a.total_allocated_memory());
                    });
                }
                reads += 1;
                std::hint::spin_loop();
            }
            reads
        })
    };

    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let shared = Arc::clone(&shared);
            thread::spawn(move || {
                let mut rng = XorShift::new(t + 1);
                let mut live: Vec<DevicePtr> = Vec::new();
                let own = StreamId(t + 1);
                for _ in 0..OPS_PER_THREAD {
                    let r = rng.next_u64();
                    if live.len() < 50 && (!r.is_multiple_of(3) || live.is_empty()) {
                        let size = match r % 4 {
                            0 => 1 + rng.next_u64() % MIB,
                            1 | 2 => MIB + rng.next_u64() % (16 * MIB),
                            _ => 16 * MIB + rng.next_u64() % (64 * MIB),
                        };
                        // Half the allocations share the default stream across threads.
                        let stream = if r.is_multiple_of(2) {
                            own
                        } else {
                            StreamId::DEFAULT
                        };
                        let ptr = shared.malloc(size, stream).expect("16 GiB is enough");
                        if r.is_multiple_of(7) {
                            shared.record_stream(ptr, StreamId(100 + t));
                        }
                        live.push(ptr);
                    } else {
                        let i = (rng.next_u64() % live.len() as u64) as usize;
                        shared.free(live.swap_remove(i)).expect("live pointer");
                    }
                    if r.is_multiple_of(97) {
                        shared.with(|a| a.device_mut().complete_stream(StreamId(100 + t)));
                    }
                }
                for ptr in live {
                    shared.free(ptr).expect("live pointer");
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("worker finished");
    }
    done.store(true, Ordering::Relaxed);
    assert!(reader.join().expect("reader finished") > 0);

    let shared = Arc::try_unwrap(shared).expect("no other owner");
    shared.empty_cache().expect("empty_cache");
    let stats = shared.stats().memory_stats();
    let mut alloc = shared.into_inner();
    alloc
        .check_invariants()
        .expect("consistent after the threads");
    assert_eq!(stats["reserved_bytes.all.current"], 0);
    assert_eq!(stats["allocated_bytes.all.current"], 0);
    assert_eq!(stats["active.all.current"], 0);
    assert_eq!(
        stats["allocation.all.allocated"], stats["allocation.all.freed"],
        "every allocation was freed"
    );
    assert!(stats["allocation.all.allocated"] as u64 > THREADS * OPS_PER_THREAD / 3);
    assert_eq!(alloc.device().stats().used_bytes, 0);
    assert!(alloc.snapshot().segments.is_empty());
}

/// Issue 34, case 11: the free set found a stream's bins by scanning every stream, and gave
/// each stream a vector per size class: 80 000 streams took `replay --check` 15.6 s and
/// 865 MB, about four times the time per doubling. The work finding streams (counted by the
/// core) and the free sets' memory now grow linearly with the streams.
#[test]
fn many_streams_cost_linear_work_and_memory() {
    let run = |streams: u64| {
        let mut a = CachingAllocator::new(
            SimDevice::new(SimConfig::with_capacity(1 << 46)),
            AllocatorConfig::default(),
        );
        // Handles in a scrambled order, as a recording's stream pointers come.
        let stream = |i: u64| StreamId(i.wrapping_mul(2_654_435_761) % (1 << 40) + 1);
        for round in 0..2 {
            for i in 0..streams {
                let p = a.malloc(512 + round * 512, stream(i)).expect("fits");
                a.free(p).expect("frees");
            }
        }
        (a.stream_lookups(), a.heap_bytes())
    };
    // Small enough for the test command, which checks every invariant after each operation
    // (a whole-state check: quadratic by itself); well past the scan of eight streams.
    let sizes = [256u64, 512, 1_024];
    let costs: Vec<(u64, usize)> = sizes.iter().map(|&n| run(n)).collect();
    let work: Vec<f64> = costs.iter().map(|c| c.0 as f64).collect();
    let memory: Vec<f64> = costs.iter().map(|c| c.1 as f64).collect();
    grows_linearly("streams", "lookups' work", &sizes, &work);
    grows_linearly("streams", "bytes", &sizes, &memory);
    // About 2 KiB a stream (its class table, its bins' room), not a vector per class (over
    // 10 KiB before).
    let (_, bytes) = costs[2];
    assert!(
        bytes < 20_000 * 3 * 1024,
        "{bytes} bytes for 20 000 streams"
    );
}

/// A replay's own state is held to its memory budget: a recording of 2 000 streams read
/// within the default limits is refused by a replay given 1 MiB, saying so, and so are the
/// replays `explain` and the view run on it under that budget.
#[test]
fn a_replay_is_held_to_its_memory_budget() {
    let mut events = Vec::new();
    for i in 0..2_000u64 {
        let (stream, addr) = (i * 7919 % 1_000_003 + 1, 0x7f00_0000_0000 + i * (2 << 20));
        events.push(serde_json::json!({"action": "segment_alloc", "addr": addr, "size": 2 << 20, "stream": stream}));
        events.push(
            serde_json::json!({"action": "alloc", "addr": addr, "size": 512, "stream": stream}),
        );
        events.push(serde_json::json!({"action": "free_requested", "addr": addr, "size": 512, "stream": stream}));
        events.push(serde_json::json!({"action": "free_completed", "addr": addr, "size": 512, "stream": stream}));
    }
    let json = serde_json::json!({"segments": [], "device_traces": [events]});
    let recording = gpumem::recording::parse_recording(json.to_string().as_bytes()).expect("reads");
    let setup = |budget| gpumem::replay::Setup {
        capacity: Some(1 << 46),
        max_memory_bytes: budget,
        ..gpumem::replay::Setup::default()
    };
    let report = crate::common::replay_check(&recording, setup(None)).expect("replays");
    assert!(report.divergence.is_none());
    let err = crate::common::replay_check(&recording, setup(Some(1 << 20))).expect_err("bounded");
    assert!(
        matches!(err, gpumem::replay::ReplayError::MemoryBudget { budget, .. } if budget == 1 << 20),
        "{err}"
    );
    assert!(err.to_string().contains("--max-memory-bytes"), "{err}");
    let explained = crate::common::explain(
        &recording,
        gpumem::explain::At::PeakReserved,
        setup(Some(1 << 20)),
    );
    let err = explained.expect_err("explain is bounded");
    assert!(
        matches!(
            err,
            gpumem::explain::ExplainError::Replay(gpumem::replay::ReplayError::MemoryBudget { .. })
        ),
        "{err}"
    );
    assert!(
        crate::common::explain(&recording, gpumem::explain::At::PeakReserved, setup(None)).is_ok()
    );
    let recording = std::sync::Arc::new(recording);
    let view = |budget| {
        gpumem::view::recording::RecordingView::new(
            std::sync::Arc::clone(&recording),
            "streams".into(),
            setup(budget),
        )
    };
    let err = view(Some(1 << 20))
        .timeline(0, None)
        .expect_err("the view is bounded");
    assert!(err.to_string().contains("--max-memory-bytes"), "{err}");
    let err = view(Some(1 << 20))
        .explain(0, 10)
        .expect_err("its explanations too");
    assert!(err.to_string().contains("--max-memory-bytes"), "{err}");
    assert!(view(None).timeline(0, None).is_ok());
}

/// Issue 34, case 11, deferred frees: a replay gives each free the recording completes later
/// a stream of its own, and each `malloc` polled every stream with a pending event, so N
/// frees left pending across N allocations cost N² queries (`replay --check` of 10 000 took
/// 13.7 s). A pass now queries only the streams whose work completed since the last
/// (`Device::take_completed_streams`): the queries grow linearly, and the simulated clock
/// still charges what PyTorch's polling of every stream costs.
#[test]
fn pending_frees_cost_linear_polling() {
    let run = |n: u64| {
        let mut a = CachingAllocator::new(
            SimDevice::new(SimConfig::with_capacity(1 << 46)),
            AllocatorConfig::default(),
        );
        let (size, main) = (12 * MIB, StreamId(0));
        let blocks: Vec<DevicePtr> = (0..n)
            .map(|_| a.malloc(size, main).expect("fits"))
            .collect();
        for (i, &p) in blocks.iter().enumerate() {
            a.record_stream(p, StreamId(1_000 + i as u64));
            a.free(p).expect("frees");
        }
        let fresh: Vec<DevicePtr> = (0..n)
            .map(|_| a.malloc(size, main).expect("fits"))
            .collect();
        let mut reused = 0;
        for (i, p) in blocks.iter().enumerate() {
            a.device_mut().complete_stream(StreamId(1_000 + i as u64));
            reused += usize::from(a.malloc(size, main).expect("fits") == *p);
        }
        // Each completed free is reused by the next malloc, as when every stream is polled.
        assert_eq!(reused as u64, n);
        assert!(fresh.iter().all(|p| !blocks.contains(p)));
        let queries = a.device().stats().event_queries;
        let charged = a.device().stats().driver_time_ns;
        (queries, charged)
    };
    let sizes = [128u64, 256, 512];
    let costs: Vec<(u64, u64)> = sizes.iter().map(|&n| run(n)).collect();
    let queries: Vec<f64> = costs.iter().map(|c| c.0 as f64).collect();
    grows_linearly("pending frees", "event queries", &sizes, &queries);
    // The clock charges the queries left out: every pending stream at each of the n mallocs
    // made while all n frees wait, n(n+1)/2 more as they complete one by one.
    let (n, (_, charged)) = (sizes[2], costs[2]);
    let event_ns = SimConfig::default().costs.ns(Call::Event, 0);
    assert!(
        charged >= (n * n + n * (n + 1) / 2) * event_ns,
        "{charged} ns charged"
    );
}

/// Asserts that `counts` (of `what`, measured at `sizes` of `unit`, each double the last) grow
/// at most 2.5× per doubling: linear work or memory, with room for noise in the counts' small
/// constant terms (quadratic growth is 4×).
fn grows_linearly(unit: &str, what: &str, sizes: &[u64], counts: &[f64]) {
    for (pair, n) in counts.windows(2).zip(&sizes[1..]) {
        let ratio = pair[1] / pair[0];
        eprintln!("{n} {unit}: {} {what} ({ratio:.2}x)", pair[1]);
        assert!(ratio <= 2.5, "{n} {unit}: {what} {ratio:.2}x per doubling");
    }
}
