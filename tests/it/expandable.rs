//! Expandable segments (`expandable_segments:True`): scenario 18 (the numbering of
//! `scenarios.rs`) and the behaviours around it, with exact figures.

use gpumem::DevicePtr;
use gpumem::allocator::{AllocError, BlockState, TraceAction};
use gpumem::device::DeviceError;

use crate::common::*;

use BlockState::{ActiveAllocated as Allocated, Inactive as Free};

/// (action, addr, size) of the trace entries about segments.
fn segment_events(a: &gpumem::CachingAllocator<gpumem::SimDevice>) -> Vec<(TraceAction, u64, u64)> {
    a.trace()
        .iter()
        .filter(|e| {
            matches!(
                e.action,
                TraceAction::SegmentMap
                    | TraceAction::SegmentUnmap
                    | TraceAction::SegmentAlloc
                    | TraceAction::SegmentFree
            )
        })
        .map(|e| (e.action, e.addr, e.size))
        .collect()
}

#[test]
fn s18_expandable_segments_grow_by_pages_and_shrink_on_empty_cache() {
    let mut a = allocator(GIB, "expandable_segments:True");
    let x = malloc(&mut a, 3 * MIB, S0);
    assert_eq!(
        a.device().reserved_address_space(),
        1_216_348_160,
        "58 pages of 20 MiB"
    );
    assert_eq!(a.device().mapped_bytes(), 20 * MIB);
    assert_eq!(
        layout(&a.snapshot()),
        [vec![
            (x.0, 3 * MIB, Allocated),
            (x.0 + 3 * MIB, 17 * MIB, Free)
        ]]
    );
    for (key, want) in [
        ("reserved_bytes.all.current", 20 * MIB as i64),
        ("segment.all.current", 0),
        ("num_device_alloc", 1),
        ("inactive_split.all.current", 0),
        ("inactive_split_bytes.all.current", 0),
    ] {
        assert_eq!(stat(&a, key), want, "{key}");
    }
    assert_eq!(
        segment_events(&a),
        [(TraceAction::SegmentMap, x.0, 20 * MIB)]
    );

    let y = malloc(&mut a, 30 * MIB, S0);
    assert_eq!(y.0, x.0 + 3 * MIB, "the free 17 MiB grew by one page");
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 40 * MIB as i64);
    assert_eq!(stat(&a, "num_device_alloc"), 2);
    let snap = a.snapshot();
    assert_eq!(snap.segments.len(), 1);
    let seg = &snap.segments[0];
    assert_eq!(
        (seg.address, seg.total_size, seg.is_expandable),
        (x.0, 40 * MIB, true)
    );
    assert_eq!(
        layout(&snap),
        [vec![
            (x.0, 3 * MIB, Allocated),
            (x.0 + 3 * MIB, 30 * MIB, Allocated),
            (x.0 + 33 * MIB, 7 * MIB, Free),
        ]]
    );

    free(&mut a, x);
    free(&mut a, y);
    empty_cache(&mut a);
    assert_eq!(stat(&a, "num_device_free"), 1);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 0);
    assert_eq!(
        segment_events(&a).last(),
        Some(&(TraceAction::SegmentUnmap, x.0, 40 * MIB))
    );
    assert_eq!(
        a.device().reservation_count(),
        0,
        "the address range went back"
    );
    assert_eq!(a.device().stats().used_bytes, 0);
    assert!(a.snapshot().segments.is_empty());
}

#[test]
fn small_pool_pages_are_2_mib() {
    let mut a = allocator(GIB, "expandable_segments:True");
    let p = malloc(&mut a, 4096, S0);
    assert_eq!(
        stat(&a, "reserved_bytes.small_pool.current"),
        2 * MIB as i64
    );
    assert_eq!(
        a.device().reserved_address_space(),
        1152 * MIB,
        "576 pages of 2 MiB"
    );
    // The relaxed split rule: any remainder of 512 bytes or more is split off.
    let q = malloc(&mut a, MIB, S0);
    assert_eq!(q.0, p.0 + 4096);
    assert_eq!(
        stat(&a, "reserved_bytes.small_pool.current"),
        2 * MIB as i64
    );
}

#[test]
fn relaxed_split_rule_applies_to_ordinary_blocks_too() {
    // Quirk kept from PyTorch: with the option on, the large pool splits any remainder of
    // 512 bytes or more, even in ordinary segments.
    let mut a = allocator(GIB, "");
    let p = malloc(&mut a, 11 * MIB, S0);
    free(&mut a, p);
    a.set_allocator_settings("expandable_segments:True")
        .expect("valid");
    let q = malloc(&mut a, 11 * MIB, S0);
    assert_eq!(
        (q, a.block_size(q)),
        (p, Some(11 * MIB)),
        "the 12 MiB block is split"
    );
}

#[test]
fn empty_cache_unmaps_holes_and_growth_refills_the_lowest_first() {
    let mut a = allocator(GIB, "expandable_segments:True");
    let p0 = malloc(&mut a, 20 * MIB, S0);
    let p1 = malloc(&mut a, 20 * MIB, S0);
    let p2 = malloc(&mut a, 20 * MIB, S0);
    assert_eq!((p1.0, p2.0), (p0.0 + 20 * MIB, p0.0 + 40 * MIB));
    free(&mut a, p1);
    empty_cache(&mut a);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 40 * MIB as i64);
    assert_eq!(
        a.snapshot().segments.len(),
        2,
        "two mapped runs around the hole"
    );
    let q = malloc(&mut a, 10 * MIB, S0);
    assert_eq!(q, p1, "the hole is mapped again before the end grows");
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 60 * MIB as i64);
    assert_eq!(a.snapshot().segments.len(), 1);
}

#[test]
fn best_fit_prefers_blocks_that_cannot_grow() {
    let mut a = allocator(GIB, "expandable_segments:True");
    let a1 = malloc(&mut a, 14 * MIB, S0);
    let _a2 = malloc(&mut a, 4 * MIB, S0);
    let a3 = malloc(&mut a, 10 * MIB, S0);
    assert_eq!(a3.0, a1.0 + 18 * MIB);
    free(&mut a, a1);
    // Free: 14 MiB at the start (boxed in) and 12 MiB at the end (can grow). By size alone
    // the 12 MiB block fits best; counting what it could grow into, the 14 MiB block does.
    let b = malloc(&mut a, 11 * MIB, S0);
    assert_eq!(b, a1);
}

#[test]
fn switching_the_option_off_skips_expandable_blocks() {
    let mut a = allocator(GIB, "expandable_segments:True");
    let p = malloc(&mut a, 11 * MIB, S0);
    free(&mut a, p);
    a.set_allocator_settings("expandable_segments:False")
        .expect("valid");
    let q = malloc(&mut a, 11 * MIB, S0);
    assert_ne!(q, p, "the cached expandable block is not used");
    assert_eq!(
        stat(&a, "segment.large_pool.current"),
        1,
        "an ordinary segment instead"
    );
    assert_eq!(a.block_size(q), Some(12 * MIB));
    free(&mut a, q);
    empty_cache(&mut a);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 0);
    assert_eq!(a.device().reservation_count(), 0);
}

#[test]
fn out_of_memory_when_no_page_can_be_created() {
    let mut a = allocator(64 * MIB, "expandable_segments:True");
    malloc(&mut a, 50 * MIB, S0);
    malloc(&mut a, 10 * MIB, S0);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 60 * MIB as i64);
    let err = a.malloc(10 * MIB, S0).expect_err("no 20 MiB page left");
    check(&a);
    assert!(matches!(err, AllocError::OutOfMemory(_)), "{err}");
    assert_eq!(stat(&a, "num_ooms"), 1);
    assert_eq!(stat(&a, "num_alloc_retries"), 1);
    assert_eq!(a.device().mapped_bytes(), 60 * MIB);
}

#[test]
fn a_failed_page_leaves_nothing_behind() {
    let mut a = allocator(GIB, "expandable_segments:True");
    malloc(&mut a, 3 * MIB, S0);
    // 50 MiB needs three pages: the second creation fails with a driver error.
    a.device_mut()
        .fail_allocation_in(2, DeviceError::Driver("Xid 79".into()));
    let err = a.malloc(57 * MIB, S0).expect_err("driver failure");
    check(&a);
    assert!(matches!(err, AllocError::Device(_)), "{err}");
    assert_eq!(a.device().mapped_bytes(), 20 * MIB);
    assert_eq!(
        a.device().stats().used_bytes,
        20 * MIB,
        "created pages were released"
    );
    let p = malloc(&mut a, 57 * MIB, S0);
    assert_eq!(p.0 % MIB, 0);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 60 * MIB as i64);
}

#[test]
fn pending_frees_are_waited_for_before_unmapping() {
    let mut a = allocator(GIB, "expandable_segments:True");
    let p = malloc(&mut a, 30 * MIB, S0);
    a.record_stream(p, S1);
    free(&mut a, p);
    empty_cache(&mut a);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 0);
    assert_eq!(a.device().reservation_count(), 0);
    assert_eq!(a.free(p), Err(AllocError::InvalidPointer(p)));
    assert_eq!(a.free(DevicePtr::NULL), Ok(()));
}
