//! Note [Drop]: an allocator that is dropped gives the device back everything it took.

use gpumem::device::{SimConfig, SimDevice};
use gpumem::{AllocatorConfig, CachingAllocator};

use crate::common::*;

/// What a simulated device still holds for this process: memory in use, segments, events,
/// reserved address ranges.
fn held(device: &SimDevice) -> (u64, usize, usize, usize) {
    (
        device.stats().used_bytes,
        device.segment_count(),
        device.event_count(),
        device.reservation_count(),
    )
}

#[test]
fn dropping_the_allocator_returns_segments_events_and_pages() {
    let mut device = SimDevice::new(SimConfig::with_capacity(8 * GIB));
    let before = held(&device);
    {
        let config = AllocatorConfig::parse("").expect("valid");
        let mut a = CachingAllocator::new(&mut device, config);
        // A live block, a cached segment of each pool, and a free still pending behind an
        // event on another stream; then an event completed back into the pool.
        let _live = a.malloc(30 * MIB, S0).expect("fits");
        let small = a.malloc(4096, S0).expect("fits");
        let large = a.malloc(3 * MIB, S0).expect("fits");
        a.free(small).expect("live");
        a.free(large).expect("live");
        let shared = a.malloc(5 * MIB, S0).expect("fits");
        a.record_stream(shared, S1);
        a.free(shared).expect("live");
        let used = a.malloc(MIB, S0).expect("fits");
        a.record_stream(used, S2);
        a.free(used).expect("live");
        a.device_mut().complete_stream(S2);
        a.malloc(512, S0).expect("fits");
        check(&a);
        let device = a.device();
        assert!(device.segment_count() >= 3, "segments were taken");
        assert_eq!(device.event_count(), 2, "one event pending, one pooled");
    }
    assert_eq!(held(&device), before);
}

#[test]
fn dropping_an_expandable_allocator_unmaps_and_unreserves() {
    let mut device = SimDevice::new(SimConfig {
        virtual_memory: true,
        ..SimConfig::with_capacity(8 * GIB)
    });
    let before = held(&device);
    {
        let config = AllocatorConfig::parse("expandable_segments:True").expect("valid");
        let mut a = CachingAllocator::new(&mut device, config);
        let live = a.malloc(45 * MIB, S0).expect("fits");
        let freed = a.malloc(100 * 1024, S0).expect("fits");
        a.free(freed).expect("live");
        check(&a);
        assert!(a.device().mapped_bytes() >= 45 * MIB);
        assert_eq!(a.block_size(live), Some(45 * MIB));
        assert!(a.device().reservation_count() >= 2, "one range per pool");
    }
    assert_eq!(held(&device), before);
    assert_eq!(device.mapped_bytes(), 0);
}
