//! Private pools in the core (Note [Private pools]): each rule, shown to hold and shown to
//! matter (the same steps without the pool would end elsewhere).

use gpumem::allocator::{
    AllocError, BlockState, PoolError, PoolId, PoolOptions, RouteKind, StreamFilter,
};
use gpumem::device::{SimConfig, SimDevice};
use gpumem::{AllocatorConfig, CachingAllocator, DevicePtr};

use crate::common::{GIB, MIB, S0, S1, S2, allocator, check, empty_cache, free, malloc, stat};

const GRAPH: PoolId = PoolId(0, 1);
const OTHER: PoolId = PoolId(0, 2);

fn route(a: &mut CachingAllocator<SimDevice>, id: PoolId) {
    a.begin_allocate_to_pool(id, StreamFilter::Any, RouteKind::MemPool)
        .expect("routed");
    check(a);
}

fn unroute(a: &mut CachingAllocator<SimDevice>, id: PoolId) {
    a.end_allocate_to_pool(id).expect("was routed");
    check(a);
}

/// The pool id of the segment holding `ptr`.
fn pool_of(a: &mut CachingAllocator<SimDevice>, ptr: DevicePtr) -> PoolId {
    a.snapshot()
        .segments
        .iter()
        .find(|s| (s.address..s.address + s.total_size).contains(&ptr.0))
        .map(|s| s.segment_pool_id)
        .expect("a segment holds the pointer")
}

#[test]
fn blocks_are_reused_only_within_their_pool() {
    let mut a = allocator(GIB, "");
    route(&mut a, GRAPH);
    let p = malloc(&mut a, 4 * MIB, S0);
    free(&mut a, p);
    unroute(&mut a, GRAPH);
    assert_eq!(pool_of(&mut a, p), GRAPH);
    // The default pool does not take the graph pool's cached block: a segment of its own.
    let d = malloc(&mut a, 4 * MIB, S0);
    assert_ne!(d, p);
    assert_eq!(pool_of(&mut a, d), PoolId::DEFAULT);
    assert_eq!(stat(&a, "segment.all.current"), 2);
    // Routed again, the request takes the pool's block back.
    route(&mut a, GRAPH);
    assert_eq!(malloc(&mut a, 4 * MIB, S0), p);
    unroute(&mut a, GRAPH);
    // Without the pool, the same steps reuse one block.
    let mut plain = allocator(GIB, "");
    let q = malloc(&mut plain, 4 * MIB, S0);
    free(&mut plain, q);
    assert_eq!(malloc(&mut plain, 4 * MIB, S0), q);
}

#[test]
fn the_newest_route_taking_a_stream_wins_and_filters_leave_other_streams_alone() {
    let mut a = allocator(GIB, "");
    a.begin_allocate_to_pool(GRAPH, StreamFilter::Streams(vec![S1]), RouteKind::Capture)
        .expect("routed");
    let captured = malloc(&mut a, MIB, S1);
    let outside = malloc(&mut a, MIB, S0);
    assert_eq!(pool_of(&mut a, captured), GRAPH);
    assert_eq!(pool_of(&mut a, outside), PoolId::DEFAULT);
    a.begin_allocate_to_pool(OTHER, StreamFilter::Any, RouteKind::MemPool)
        .expect("routed");
    let newest = malloc(&mut a, MIB, S1);
    assert_eq!(pool_of(&mut a, newest), OTHER);
    assert_eq!(
        a.begin_allocate_to_pool(OTHER, StreamFilter::Any, RouteKind::MemPool),
        Err(AllocError::Pool(PoolError::AlreadyRouted(OTHER)))
    );
    check(&a);
}

#[test]
fn a_referenced_pool_survives_empty_cache_and_a_released_one_gives_its_whole_segments_back() {
    let mut a = allocator(GIB, "");
    a.create_pool(GRAPH, PoolOptions::default()).expect("new");
    route(&mut a, GRAPH);
    assert_eq!(a.pool_use_count(GRAPH), Some(2));
    // One whole cached segment, one split segment with a live block.
    let whole = malloc(&mut a, 30 * MIB, S0);
    let kept = malloc(&mut a, 4 * MIB, S0);
    let freed = malloc(&mut a, 4 * MIB, S0);
    free(&mut a, whole);
    free(&mut a, freed);
    unroute(&mut a, GRAPH);
    a.release_pool(GRAPH).expect("in use");
    assert_eq!(a.pool_use_count(GRAPH), Some(1));
    let reserved = stat(&a, "reserved_bytes.all.current");
    empty_cache(&mut a);
    assert_eq!(
        stat(&a, "reserved_bytes.all.current"),
        reserved,
        "a referenced pool keeps its cache"
    );
    // The last reference goes: the next flush frees the whole segment, not the split one.
    a.release_pool(GRAPH).expect("in use");
    assert_eq!(a.pool_use_count(GRAPH), Some(0));
    empty_cache(&mut a);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), (20 * MIB) as i64);
    assert_eq!(
        a.private_pools(),
        vec![GRAPH],
        "a pool holding a segment is kept"
    );
    free(&mut a, kept);
    empty_cache(&mut a);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 0);
    assert!(
        a.private_pools().is_empty(),
        "an empty freeable pool is forgotten"
    );
    assert_eq!(
        a.release_pool(GRAPH),
        Err(AllocError::Pool(PoolError::Unknown(GRAPH)))
    );
}

#[test]
fn use_on_oom_pools_serve_a_default_request_the_device_refuses_and_only_then() {
    for use_on_oom in [true, false] {
        let mut a = allocator(64 * MIB, "");
        let options = PoolOptions {
            use_on_oom,
            no_split: false,
        };
        a.create_pool(GRAPH, options).expect("new");
        route(&mut a, GRAPH);
        let p = malloc(&mut a, 40 * MIB, S0);
        free(&mut a, p);
        unroute(&mut a, GRAPH);
        // 40 MiB of 64 sit cached in the pool; the default pool cannot get 40 more.
        let got = a.malloc(40 * MIB, S0);
        check(&a);
        if use_on_oom {
            assert_eq!(got.expect("served from the pool"), p);
            assert_eq!(
                stat(&a, "num_alloc_retries"),
                0,
                "served before any release"
            );
        } else {
            assert!(matches!(got, Err(AllocError::OutOfMemory(_))));
            let AllocError::OutOfMemory(oom) = got.expect_err("out of memory") else {
                unreachable!()
            };
            assert_eq!(oom.private_pools, 40 * MIB);
            assert!(
                oom.to_string()
                    .contains("40.00 MiB allocated in private pools"),
                "{oom}"
            );
        }
    }
}

#[test]
fn a_routed_request_does_not_search_use_on_oom_pools() {
    let mut a = allocator(64 * MIB, "");
    a.create_pool(
        GRAPH,
        PoolOptions {
            use_on_oom: true,
            no_split: false,
        },
    )
    .expect("new");
    route(&mut a, GRAPH);
    let p = malloc(&mut a, 40 * MIB, S0);
    free(&mut a, p);
    unroute(&mut a, GRAPH);
    route(&mut a, OTHER);
    assert!(matches!(
        a.malloc(40 * MIB, S0),
        Err(AllocError::OutOfMemory(_))
    ));
    check(&a);
}

#[test]
fn a_no_split_pool_hands_out_whole_blocks() {
    for no_split in [true, false] {
        let mut a = allocator(GIB, "");
        let options = PoolOptions {
            use_on_oom: false,
            no_split,
        };
        a.create_pool(GRAPH, options).expect("new");
        route(&mut a, GRAPH);
        let p = malloc(&mut a, 4 * MIB, S0);
        let size = a.block_size(p).expect("live");
        assert_eq!(size, if no_split { 20 * MIB } else { 4 * MIB });
    }
}

#[test]
fn expandable_segments_are_per_pool_and_stream() {
    let mut a = allocator(GIB, "expandable_segments:True");
    let d = malloc(&mut a, 4 * MIB, S0);
    route(&mut a, GRAPH);
    let g = malloc(&mut a, 4 * MIB, S0);
    unroute(&mut a, GRAPH);
    let snapshot = a.snapshot();
    let pools: Vec<(PoolId, bool)> = snapshot
        .segments
        .iter()
        .map(|s| (s.segment_pool_id, s.is_expandable))
        .collect();
    assert_eq!(pools.len(), 2, "{pools:?}");
    assert!(pools.contains(&(PoolId::DEFAULT, true)) && pools.contains(&(GRAPH, true)));
    assert_ne!(pool_of(&mut a, d), pool_of(&mut a, g));
}

#[test]
fn a_capture_defers_frees_used_by_other_streams_and_drops_captured_uses() {
    let mut a = allocator(GIB, "");
    let before = malloc(&mut a, 4 * MIB, S0);
    let during = malloc(&mut a, 4 * MIB, S0);
    a.record_stream(before, S2);
    a.begin_allocate_to_pool(GRAPH, StreamFilter::Streams(vec![S1]), RouteKind::Capture)
        .expect("routed");
    // A use recorded during the capture was captured, not run.
    a.record_stream(during, S2);
    free(&mut a, before);
    free(&mut a, during);
    // No event is recorded during the capture: both frees wait.
    let states = |a: &mut CachingAllocator<SimDevice>| -> Vec<BlockState> {
        a.snapshot().segments[0]
            .blocks
            .iter()
            .map(|b| b.state)
            .collect()
    };
    assert_eq!(stat(&a, "active.all.current"), 2);
    unroute(&mut a, GRAPH);
    // The next malloc outside a capture records events: `during`'s only use was captured, so
    // its free completes at once; `before` waits on stream 2.
    let _ = malloc(&mut a, 64 * MIB, S0);
    assert_eq!(stat(&a, "active.all.current"), 2, "{:?}", states(&mut a));
    a.device_mut().complete_stream(S2);
    let _ = malloc(&mut a, 64 * MIB, S0);
    assert_eq!(
        stat(&a, "active.all.current"),
        2,
        "the two 64 MiB blocks only"
    );
}

#[test]
fn an_oom_during_a_capture_skips_the_cache_flush() {
    for capture in [true, false] {
        let mut a = allocator(64 * MIB, "");
        let cached = malloc(&mut a, 40 * MIB, S0);
        free(&mut a, cached);
        if capture {
            a.begin_allocate_to_pool(GRAPH, StreamFilter::Streams(vec![S1]), RouteKind::Capture)
                .expect("routed");
        }
        // Stream 1 cannot use stream 0's cached block; only a flush would make room.
        let got = a.malloc(40 * MIB, S1);
        check(&a);
        assert_eq!(got.is_ok(), !capture);
        assert_eq!(stat(&a, "num_alloc_retries"), i64::from(!capture));
    }
}

#[test]
fn a_mem_pool_route_acts_as_a_capture_up_to_2_12() {
    for (release, flushes) in [("2.12", false), ("2.13", true)] {
        let config = AllocatorConfig {
            pytorch: release.parse().expect("a release"),
            ..AllocatorConfig::default()
        };
        let mut a =
            CachingAllocator::new(SimDevice::new(SimConfig::with_capacity(64 * MIB)), config);
        let cached = malloc(&mut a, 40 * MIB, S1);
        free(&mut a, cached);
        route(&mut a, GRAPH);
        let got = a.malloc(40 * MIB, S0);
        check(&a);
        assert_eq!(got.is_ok(), flushes, "{release}");
    }
}

#[test]
fn the_default_pool_cannot_be_made_routed_or_released() {
    let mut a = allocator(GIB, "");
    let refused = Err(AllocError::Pool(PoolError::DefaultPool));
    assert_eq!(
        a.create_pool(PoolId::DEFAULT, PoolOptions::default()),
        refused
    );
    assert_eq!(
        a.begin_allocate_to_pool(PoolId::DEFAULT, StreamFilter::Any, RouteKind::MemPool),
        refused
    );
    assert_eq!(a.release_pool(PoolId::DEFAULT), refused);
    assert_eq!(
        a.end_allocate_to_pool(GRAPH),
        Err(AllocError::Pool(PoolError::NotRouted(GRAPH)))
    );
}
