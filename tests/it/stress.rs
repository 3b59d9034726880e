//! Several threads drive one `SharedAllocator` while another reads its statistics without the
//! lock; at the end the stats agree with the blocks and everything goes back to the driver.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;

use gpumem::device::{SimConfig, SimDevice};
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
