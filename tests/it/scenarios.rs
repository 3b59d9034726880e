//! The allocator's behaviour in numbered scenarios, each with its exact figures (rounding,
//! pools, splitting, merging, stream-ordered reuse, the OOM retry chain, the settings); the
//! numbers are the ones the core's unit tests cite; scenario 18 (expandable segments) is in
//! `expandable.rs`.

use gpumem::allocator::{AllocError, BlockState, TraceAction};
use gpumem::config::Syntax;
use gpumem::device::{DeviceError, SimConfig, SimDevice};
use gpumem::{AllocatorConfig, CachingAllocator, DevicePtr};

use crate::common::*;

use BlockState::{ActiveAllocated as Allocated, ActivePendingFree as Pending, Inactive as Free};

#[test]
fn s01_zero_size_returns_null_and_changes_nothing() {
    let mut a = allocator(80 * GIB, "");
    let before = a.memory_stats();
    assert_eq!(malloc(&mut a, 0, S0), DevicePtr::NULL);
    assert_eq!(a.memory_stats(), before);
    assert!(a.trace().is_empty());
    free(&mut a, DevicePtr::NULL);
}

#[test]
fn s02_one_byte_takes_512_bytes_of_a_new_small_segment() {
    let mut a = allocator(80 * GIB, "");
    let b = malloc(&mut a, 1, S0);
    assert_eq!(a.block_size(b), Some(512));
    assert_eq!(
        layout(&a.snapshot()),
        [vec![(b.0, 512, Allocated), (b.0 + 512, 2_096_640, Free)]]
    );
    for (key, want) in [
        ("allocated_bytes.small_pool.current", 512),
        ("allocated_bytes.large_pool.current", 0),
        ("requested_bytes.all.current", 1),
        ("active.all.current", 1),
        ("active_bytes.all.current", 512),
        ("reserved_bytes.all.current", 2_097_152),
        ("segment.small_pool.current", 1),
        ("inactive_split.all.current", 1),
        ("inactive_split_bytes.all.current", 2_096_640),
        ("num_device_alloc", 1),
    ] {
        assert_eq!(stat(&a, key), want, "{key}");
    }
}

#[test]
fn s03_free_merges_then_empty_cache_returns_the_segment() {
    let mut a = allocator(80 * GIB, "");
    let b = malloc(&mut a, 1, S0);
    free(&mut a, b);
    for (key, want) in [
        ("allocated_bytes.all.current", 0),
        ("allocated_bytes.all.peak", 512),
        ("allocated_bytes.all.freed", 512),
        ("active.all.current", 0),
        ("requested_bytes.all.current", 0),
        ("inactive_split.all.current", 0),
        ("inactive_split.all.allocated", 1),
        ("inactive_split.all.freed", 1),
        ("inactive_split_bytes.all.current", 0),
        ("reserved_bytes.all.current", 2_097_152),
    ] {
        assert_eq!(stat(&a, key), want, "{key}");
    }
    assert_eq!(layout(&a.snapshot()), [vec![(b.0, 2 * MIB, Free)]]);
    empty_cache(&mut a);
    for (key, want) in [
        ("reserved_bytes.all.current", 0),
        ("segment.all.current", 0),
        ("num_device_free", 1),
        ("num_sync_all_streams", 1),
    ] {
        assert_eq!(stat(&a, key), want, "{key}");
    }
    assert_eq!(a.device().stats().used_bytes, 0);
}

#[test]
fn s04_size_classification_on_the_allocator() {
    for (req, block, small, segment) in [
        (1, 512, true, 2 * MIB),
        (511, 512, true, 2 * MIB),
        (513, 1024, true, 2 * MIB),
        (MIB, MIB, true, 2 * MIB),
        (MIB + 1, 1_049_088, false, 20 * MIB),
        (9 * MIB, 9 * MIB, false, 20 * MIB),
        (10 * MIB - 1, 10 * MIB, false, 10 * MIB),
        (10 * MIB, 10 * MIB, false, 10 * MIB),
        (10 * MIB + 1, 10_486_272, false, 12 * MIB),
        (11 * MIB, 12 * MIB, false, 12 * MIB),
    ] {
        let mut a = allocator(80 * GIB, "");
        let p = malloc(&mut a, req, S0);
        // 11 MiB takes its whole 12 MiB segment (scenario 5); the others are the rounded size.
        assert_eq!(a.block_size(p), Some(block), "block for {req}");
        assert_eq!(
            stat(&a, "reserved_bytes.all.current"),
            segment as i64,
            "segment for {req}"
        );
        let pool = if small { "small_pool" } else { "large_pool" };
        assert_eq!(
            stat(&a, &format!("segment.{pool}.current")),
            1,
            "pool of {req}"
        );
    }
}

#[test]
fn s05_split_rule_on_fresh_large_segments() {
    let mut a = allocator(80 * GIB, "");
    let p = malloc(&mut a, 10 * MIB, S0);
    assert_eq!(a.block_size(p), Some(10 * MIB));
    assert_eq!(stat(&a, "inactive_split.all.current"), 0);

    let mut a = allocator(80 * GIB, "");
    let p = malloc(&mut a, 10 * MIB + 1, S0);
    assert_eq!(
        layout(&a.snapshot()),
        [vec![
            (p.0, 10_486_272, Allocated),
            (p.0 + 10_486_272, 2_096_640, Free)
        ]]
    );

    let mut a = allocator(80 * GIB, "");
    let p = malloc(&mut a, 11 * MIB, S0);
    assert_eq!(layout(&a.snapshot()), [vec![(p.0, 12 * MIB, Allocated)]]);
    assert_eq!(stat(&a, "allocated_bytes.all.current"), 12_582_912);
    assert_eq!(stat(&a, "requested_bytes.all.current"), 11_534_336);

    let mut a = allocator(80 * GIB, "");
    let p = malloc(&mut a, 19_922_945, S0);
    assert_eq!(layout(&a.snapshot()), [vec![(p.0, 20 * MIB, Allocated)]]);
}

#[test]
fn s06_reuse_of_a_split_tail() {
    let mut a = allocator(80 * GIB, "");
    let b = malloc(&mut a, 3 * MIB, S0);
    assert_eq!(stat(&a, "inactive_split.all.current"), 1);
    assert_eq!(stat(&a, "inactive_split_bytes.all.current"), 17_825_792);
    let c = malloc(&mut a, 5 * MIB, S0);
    assert_eq!(c.0, b.0 + 3 * MIB);
    assert_eq!(stat(&a, "num_device_alloc"), 1);
    assert_eq!(stat(&a, "inactive_split.all.current"), 1);
    assert_eq!(stat(&a, "inactive_split_bytes.all.current"), 12_582_912);
    assert_eq!(stat(&a, "inactive_split_bytes.all.freed"), 5_242_880);
    assert_eq!(stat(&a, "allocated_bytes.all.current"), 8 * MIB as i64);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 20 * MIB as i64);
}

#[test]
fn s07_coalescing_and_inactive_split_accounting() {
    let mut a = allocator(80 * GIB, "");
    let x = malloc(&mut a, 512, S0);
    let y = malloc(&mut a, 512, S0);
    let z = malloc(&mut a, 512, S0);
    assert_eq!((y.0, z.0), (x.0 + 512, x.0 + 1024));
    assert_eq!(
        layout(&a.snapshot())[0].last(),
        Some(&(x.0 + 1536, 2_095_616, Free))
    );
    assert_eq!(stat(&a, "inactive_split.all.current"), 1);
    free(&mut a, y);
    assert_eq!(stat(&a, "inactive_split.all.current"), 2);
    assert_eq!(stat(&a, "inactive_split_bytes.all.current"), 2_096_128);
    free(&mut a, x);
    assert_eq!(stat(&a, "inactive_split.all.current"), 2);
    assert_eq!(stat(&a, "inactive_split_bytes.all.current"), 2_096_640);
    free(&mut a, z);
    assert_eq!(layout(&a.snapshot()), [vec![(x.0, 2 * MIB, Free)]]);
    assert_eq!(stat(&a, "inactive_split.all.current"), 0);
    assert_eq!(stat(&a, "inactive_split_bytes.all.current"), 0);
}

#[test]
fn s08_streams_do_not_share_cached_blocks() {
    let mut a = allocator(80 * GIB, "");
    malloc(&mut a, MIB, S1);
    malloc(&mut a, 512, S2);
    assert_eq!(stat(&a, "segment.small_pool.current"), 2);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 4 * MIB as i64);
}

#[test]
fn s09_best_fit_and_no_split_of_small_large_tails() {
    let mut a = allocator(80 * GIB, "");
    let p12 = malloc(&mut a, 12 * MIB, S0);
    let p14 = malloc(&mut a, 14 * MIB, S0);
    let p16 = malloc(&mut a, 16 * MIB, S0);
    for p in [p12, p14, p16] {
        free(&mut a, p);
    }
    let q13 = malloc(&mut a, 13 * MIB, S0);
    assert_eq!((q13, a.block_size(q13)), (p14, Some(14 * MIB)));
    let q11 = malloc(&mut a, 11 * MIB, S0);
    assert_eq!((q11, a.block_size(q11)), (p12, Some(12 * MIB)));
    assert_eq!(stat(&a, "allocated_bytes.all.current"), 27_262_976);
    assert_eq!(stat(&a, "requested_bytes.all.current"), 24 * MIB as i64);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 42 * MIB as i64);
    assert_eq!(stat(&a, "num_device_alloc"), 3);
}

#[test]
fn s10_max_split_size_oversize_rules() {
    let mut a = allocator(80 * GIB, "max_split_size_mb:100");
    let p150 = malloc(&mut a, 150 * MIB, S0);
    assert_eq!(
        layout(&a.snapshot()),
        [vec![(p150.0, 150 * MIB, Allocated)]]
    );
    assert_eq!(stat(&a, "oversize_segments.current"), 1);
    assert_eq!(stat(&a, "oversize_allocations.current"), 1);
    free(&mut a, p150);
    let p50 = malloc(&mut a, 50 * MIB, S0);
    assert_ne!(p50, p150, "a normal request never takes an oversize block");
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 200 * MIB as i64);
    let p140 = malloc(&mut a, 140 * MIB, S0);
    assert_eq!((p140, a.block_size(p140)), (p150, Some(150 * MIB)));
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 200 * MIB as i64);
    free(&mut a, p140);
    let p120 = malloc(&mut a, 120 * MIB, S0);
    assert_ne!(
        p120, p150,
        "150 MiB wastes 20 MiB or more on a 120 MiB request"
    );
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 320 * MIB as i64);
    assert_eq!(stat(&a, "oversize_segments.current"), 2);
    assert_eq!(stat(&a, "oversize_allocations.current"), 1);
    assert_eq!(stat(&a, "oversize_allocations.allocated"), 3);
    assert_eq!(stat(&a, "oversize_allocations.freed"), 2);
}

#[test]
fn s11_memory_fraction_oom_reports_pytorchs_figures() {
    let mut a = allocator(GIB, "");
    a.set_memory_fraction(0.25).expect("valid fraction");
    assert_eq!(a.allowed_memory_maximum(), Some(256 * MIB));
    malloc(&mut a, 200 * MIB, S0);
    let err = a.malloc(100 * MIB, S0).expect_err("over the limit");
    check(&a);
    let AllocError::OutOfMemory(oom) = &err else {
        panic!("expected OutOfMemory, got {err:?}");
    };
    assert_eq!(oom.tried_to_allocate, 100 * MIB);
    assert_eq!(oom.allocated, 200 * MIB);
    assert_eq!(oom.reserved_unallocated, 0);
    assert_eq!((oom.total, oom.free), (GIB, GIB - 200 * MIB));
    let text = err.to_string();
    for needle in [
        "CUDA out of memory. Tried to allocate 100.00 MiB.",
        "256.00 MiB allowed;",
        "200.00 MiB is allocated by PyTorch",
        "0 bytes is reserved by PyTorch but unallocated",
        "expandable_segments:True",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from: {text}");
    }
    assert_eq!(stat(&a, "num_alloc_retries"), 1);
    assert_eq!(stat(&a, "num_ooms"), 1);
    assert_eq!(stat(&a, "num_sync_all_streams"), 1);
    let oom_entry = a.trace().into_iter().last().expect("trace entry");
    assert_eq!(oom_entry.action, TraceAction::Oom);
    assert_eq!(oom_entry.size, 104_857_600);
    assert_eq!(
        oom_entry.addr,
        GIB - 200 * MIB,
        "device_free is the driver's free memory"
    );
}

#[test]
fn s12_full_flush_then_retry_succeeds() {
    let mut a = allocator(GIB, "");
    a.set_memory_fraction(0.25).expect("valid fraction");
    let p = malloc(&mut a, 200 * MIB, S1);
    free(&mut a, p);
    malloc(&mut a, 100 * MIB, S2);
    for (key, want) in [
        ("reserved_bytes.all.current", 100 * MIB as i64),
        ("segment.all.current", 1),
        ("num_device_alloc", 2),
        ("num_device_free", 1),
        ("num_sync_all_streams", 1),
        ("num_alloc_retries", 1),
        ("num_ooms", 0),
    ] {
        assert_eq!(stat(&a, key), want, "{key}");
    }
}

#[test]
fn s13_targeted_release_of_oversize_blocks() {
    let mut a = allocator(GIB, "max_split_size_mb:100");
    a.set_memory_fraction(0.25).expect("valid fraction");
    let p = malloc(&mut a, 150 * MIB, S0);
    free(&mut a, p);
    malloc(&mut a, 120 * MIB, S0);
    for (key, want) in [
        ("reserved_bytes.all.current", 120 * MIB as i64),
        ("num_device_free", 1),
        ("num_sync_all_streams", 0),
        ("num_alloc_retries", 0),
        ("oversize_segments.current", 1),
        ("oversize_segments.allocated", 2),
        ("oversize_segments.freed", 1),
    ] {
        assert_eq!(stat(&a, key), want, "{key}");
    }
}

#[test]
fn s14_garbage_collection_releases_the_oldest_blocks() {
    let mut a = allocator(GIB, "garbage_collection_threshold:0.5");
    a.set_memory_fraction(0.5).expect("valid fraction");
    let mut segments = Vec::new();
    for size in [100, 120, 140] {
        let p = malloc(&mut a, size * MIB, S0);
        free(&mut a, p);
        segments.push(p);
    }
    malloc(&mut a, 160 * MIB, S0);
    for (key, want) in [
        ("reserved_bytes.all.current", 300 * MIB as i64),
        ("segment.all.current", 2),
        ("num_device_free", 2),
        ("num_device_alloc", 4),
    ] {
        assert_eq!(stat(&a, key), want, "{key}");
    }
    let released: Vec<(u64, u64)> = a
        .trace()
        .iter()
        .filter(|e| e.action == TraceAction::SegmentFree)
        .map(|e| (e.addr, e.size))
        .collect();
    assert_eq!(
        released,
        [(segments[0].0, 100 * MIB), (segments[1].0, 120 * MIB)],
        "A and B go, in size order; C stays"
    );
    assert_eq!(
        stat(&a, "num_sync_all_streams"),
        0,
        "GC does not synchronise"
    );
}

#[test]
fn s15_roundup_power2_divisions_on_the_allocator() {
    let mut a = allocator(80 * GIB, "roundup_power2_divisions:4");
    for (req, want) in [
        (1200, 1536),
        (2048, 2048),
        (2049, 2560),
        (5000, 5120),
        (4096, 4096),
        (3_145_729, 3_670_016),
        (1_048_577, 1_310_720),
    ] {
        let p = malloc(&mut a, req, S0);
        assert_eq!(a.block_size(p), Some(want), "block for {req}");
    }
    assert_eq!(
        stat(&a, "segment.large_pool.current"),
        1,
        "1 MiB + 1 went to the large pool"
    );
}

#[test]
fn s16_roundup_list_quirk_on_the_allocator() {
    // Up to 2.9 `>` overwrote the previous key's interval; 2.10 fixed it.
    for (release, want_1100) in [("2.9", 1152 * MIB), ("2.15", 1280 * MIB)] {
        let config = AllocatorConfig::parse_as(
            &format!("pytorch:{release},roundup_power2_divisions:[256:1,512:2,1024:4,>:8]"),
            Syntax::Gpumem,
        )
        .expect("valid");
        let mut a =
            CachingAllocator::new(SimDevice::new(SimConfig::with_capacity(80 * GIB)), config);
        for (req, want) in [
            (300 * MIB, 300 * MIB),
            (600 * MIB, 768 * MIB),
            (1100 * MIB, want_1100),
            (1536 * MIB, 1536 * MIB),
        ] {
            let p = malloc(&mut a, req, S0);
            assert_eq!(
                a.block_size(p),
                Some(want),
                "{release}: block for {} MiB",
                req / MIB
            );
        }
    }
}

/// X = 1 MiB on S0, used on S1, freed: reuse waits for S1.
fn pending_free_setup() -> (gpumem::CachingAllocator<gpumem::SimDevice>, DevicePtr) {
    let mut a = allocator(80 * GIB, "");
    let x = malloc(&mut a, MIB, S0);
    a.record_stream(x, S1);
    check(&a);
    free(&mut a, x);
    assert_eq!(stat(&a, "allocation.all.current"), 0);
    assert_eq!(stat(&a, "allocated_bytes.all.current"), 0);
    assert_eq!(stat(&a, "active.all.current"), 1);
    assert_eq!(stat(&a, "active_bytes.all.current"), MIB as i64);
    assert_eq!(
        layout(&a.snapshot()),
        [vec![(x.0, MIB, Pending), (x.0 + MIB, MIB, Free)]]
    );
    let actions: Vec<_> = a.trace().iter().map(|e| e.action).collect();
    assert!(actions.contains(&TraceAction::FreeRequested));
    assert!(!actions.contains(&TraceAction::FreeCompleted));
    (a, x)
}

#[test]
fn s17a_pending_free_is_not_reused() {
    let (mut a, x) = pending_free_setup();
    let y = malloc(&mut a, MIB, S0);
    assert_eq!(y.0, x.0 + MIB, "the tail, not X");
    assert_eq!(stat(&a, "active.all.current"), 2);
}

#[test]
fn s17b_completed_free_merges_and_is_reused() {
    let (mut a, x) = pending_free_setup();
    a.device_mut().complete_stream(S1);
    let y = malloc(&mut a, MIB, S0);
    assert_eq!(
        y, x,
        "X's free completed, merged with the tail, and was reused from B"
    );
    let actions: Vec<_> = a.trace().iter().map(|e| e.action).collect();
    let completed = actions
        .iter()
        .position(|&t| t == TraceAction::FreeCompleted)
        .expect("free_completed recorded");
    assert_eq!(actions[completed + 1], TraceAction::Alloc);
    assert_eq!(
        layout(&a.snapshot()),
        [vec![(x.0, MIB, Allocated), (x.0 + MIB, MIB, Free)]]
    );
}

#[test]
fn s19_config_validation_on_the_allocator() {
    let mut a = allocator(80 * GIB, "max_split_size_mb:100");
    assert_eq!(a.config().max_split_size, 100 * MIB);
    for bad in [
        "max_split_size_mb:19",
        "garbage_collection_threshold:1.0",
        "garbage_collection_threshold:0",
        "roundup_power2_divisions:3",
        "roundup_power2_divisions:[256:3]",
        "expandable_segments:true",
        "foo:1",
        "pinned_num_register_threads:256",
        "backend:cudaMallocAsync",
    ] {
        let err = a.set_allocator_settings(bad).expect_err(bad);
        assert!(matches!(err, AllocError::Config(_)), "{bad}: {err}");
        assert_eq!(
            a.config().max_split_size,
            100 * MIB,
            "{bad} changed nothing"
        );
    }
    a.set_allocator_settings(" max_split_size_mb : 256 , expandable_segments : True ")
        .expect("spaces are ignored");
    assert_eq!(a.config().max_split_size, 256 * MIB);
    a.set_allocator_settings("expandable_segments:True")
        .expect("valid");
    assert_eq!(a.config().max_split_size, u64::MAX, "back to unlimited");
}

#[test]
fn s20_snapshot_shape_after_one_byte() {
    let mut a = allocator(80 * GIB, "");
    let b = malloc(&mut a, 1, S0);
    let snap = serde_json::to_value(a.snapshot()).expect("serializes");
    let seg = &snap["segments"][0];
    assert_eq!(snap["segments"].as_array().map(Vec::len), Some(1));
    for (key, want) in [
        ("device", serde_json::json!(0)),
        ("address", serde_json::json!(b.0)),
        ("total_size", serde_json::json!(2_097_152)),
        ("allocated_size", serde_json::json!(512)),
        ("active_size", serde_json::json!(512)),
        ("requested_size", serde_json::json!(1)),
        ("segment_type", serde_json::json!("small")),
        ("segment_pool_id", serde_json::json!([0, 0])),
        ("is_expandable", serde_json::json!(false)),
    ] {
        assert_eq!(seg[key], want, "{key}");
    }
    assert_eq!(
        seg["blocks"],
        serde_json::json!([
            {"address": b.0, "size": 512, "requested_size": 1, "state": "active_allocated", "frames": []},
            {"address": b.0 + 512, "size": 2_096_640, "requested_size": 0, "state": "inactive", "frames": []},
        ])
    );
    let trace = snap["device_traces"][0]
        .as_array()
        .expect("one device trace");
    let summary: Vec<_> = trace
        .iter()
        .map(|e| (e["action"].clone(), e["addr"].clone(), e["size"].clone()))
        .collect();
    assert_eq!(
        summary,
        [
            ("segment_alloc".into(), b.0.into(), 2_097_152.into()),
            ("alloc".into(), b.0.into(), 1.into()),
        ]
    );
    assert!(snap["allocator_settings"]["roundup_power2_divisions"].is_object());
    let next = a.snapshot();
    let last = next.device_traces[0].last().expect("snapshot entry");
    assert_eq!(
        (last.action, last.addr, last.size),
        (TraceAction::Snapshot, 0, 512)
    );
}

#[test]
fn s21_max_split_size_stat_is_fixed_at_creation() {
    let a = allocator(80 * GIB, "");
    assert_eq!(stat(&a, "max_split_size"), -1);
    let mut a = allocator(80 * GIB, "max_split_size_mb:100");
    assert_eq!(stat(&a, "max_split_size"), 104_857_600);
    a.set_allocator_settings("max_split_size_mb:200")
        .expect("valid");
    assert_eq!(stat(&a, "max_split_size"), 104_857_600);
}

// ------------------------------------------------------------------------------------------
// Beyond the numbered scenarios: error paths and the remaining API.

#[test]
fn bad_pointers_are_errors_that_change_nothing() {
    let mut a = allocator(80 * GIB, "");
    let p = malloc(&mut a, 4096, S0);
    let before = a.memory_stats();
    for bad in [DevicePtr(p.0 + 512), DevicePtr(12345)] {
        assert_eq!(a.free(bad), Err(AllocError::InvalidPointer(bad)));
    }
    assert_eq!(a.memory_stats(), before);
    free(&mut a, p);
    assert_eq!(a.free(p), Err(AllocError::InvalidPointer(p)), "double free");
    check(&a);
    a.record_stream(p, S1);
    check(&a);
}

#[test]
fn exabyte_requests_fail_at_once() {
    let mut a = allocator(80 * GIB, "");
    let err = a.malloc(1 << 60, S0).expect_err("too large");
    assert_eq!(err, AllocError::TooLarge(1 << 60));
    assert!(err.to_string().contains("more than 1EB"));
    assert_eq!(stat(&a, "num_ooms"), 0);
    assert_eq!(a.device().stats().malloc_calls, 0);
}

#[test]
fn device_errors_other_than_oom_surface_and_leave_state_intact() {
    let mut a = allocator(80 * GIB, "");
    let p = malloc(&mut a, MIB, S0);
    a.device_mut()
        .fail_allocation_in(1, DeviceError::Driver("ECC error".into()));
    let err = a.malloc(30 * MIB, S0).expect_err("driver failure");
    assert!(
        matches!(err, AllocError::Device(DeviceError::Driver(_))),
        "{err:?}"
    );
    check(&a);
    assert_eq!(stat(&a, "num_ooms"), 0);
    free(&mut a, p);
    malloc(&mut a, 30 * MIB, S0);
}

#[test]
fn driver_oom_is_retried_after_flushing_the_cache() {
    let mut a = allocator(64 * MIB, "");
    let p = malloc(&mut a, 40 * MIB, S0);
    free(&mut a, p);
    // 40 MiB cached + 50 MiB new > 64 MiB: only a full flush makes room.
    malloc(&mut a, 50 * MIB, S0);
    assert_eq!(stat(&a, "num_alloc_retries"), 1);
    assert_eq!(stat(&a, "num_device_free"), 1);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 50 * MIB as i64);
}

#[test]
fn oom_on_a_full_device_counts_and_reports_fragmentation() {
    let mut a = allocator(64 * MIB, "");
    // Two 20 MiB segments, each pinned by a small allocation at its front.
    let x = malloc(&mut a, 2 * MIB, S0);
    let y = malloc(&mut a, 2 * MIB, S0);
    assert_eq!(stat(&a, "segment.large_pool.current"), 1);
    let big = malloc(&mut a, 17 * MIB, S0);
    free(&mut a, big);
    let err = a.malloc(50 * MIB, S0).expect_err("no room");
    check(&a);
    let AllocError::OutOfMemory(oom) = err else {
        panic!("expected OutOfMemory");
    };
    assert_eq!(oom.allocated, 4 * MIB);
    assert_eq!(oom.reserved_unallocated, 16 * MIB);
    assert_eq!(stat(&a, "num_ooms"), 1);
    free(&mut a, x);
    free(&mut a, y);
    empty_cache(&mut a);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 0);
}

#[test]
fn empty_cache_waits_for_pending_frees() {
    let mut a = allocator(80 * GIB, "");
    let x = malloc(&mut a, 30 * MIB, S0);
    a.record_stream(x, S1);
    a.record_stream(x, S2);
    free(&mut a, x);
    assert_eq!(a.device().stats().events_created, 2);
    empty_cache(&mut a);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 0);
    assert_eq!(stat(&a, "active.all.current"), 0);
    // Events are pooled: a second deferred free creates none.
    let y = malloc(&mut a, 30 * MIB, S0);
    a.record_stream(y, S1);
    free(&mut a, y);
    assert_eq!(a.device().stats().events_created, 2);
}

#[test]
fn events_of_each_stream_complete_independently() {
    let mut a = allocator(80 * GIB, "");
    let x = malloc(&mut a, 512, S0);
    let y = malloc(&mut a, 512, S0);
    a.record_stream(x, S1);
    a.record_stream(y, S2);
    free(&mut a, x);
    free(&mut a, y);
    a.device_mut().complete_stream(S2);
    let z = malloc(&mut a, 4096, S0);
    assert_eq!(
        z, y,
        "y's free completed and merged with the tail; x still waits on S1"
    );
    let snap = a.snapshot();
    let states: Vec<_> = snap.segments[0].blocks.iter().map(|b| b.state).collect();
    assert_eq!(states, [Pending, Allocated, Free]);
}

#[test]
fn reset_stats() {
    let mut a = allocator(80 * GIB, "");
    let p = malloc(&mut a, 3 * MIB, S0);
    free(&mut a, p);
    a.reset_peak_stats();
    assert_eq!(stat(&a, "allocated_bytes.all.peak"), 0);
    assert_eq!(stat(&a, "reserved_bytes.all.peak"), 20 * MIB as i64);
    a.reset_accumulated_stats();
    assert_eq!(stat(&a, "allocated_bytes.all.allocated"), 0);
    assert_eq!(stat(&a, "num_device_alloc"), 0);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 20 * MIB as i64);
}

#[test]
fn memory_fraction_is_validated() {
    let mut a = allocator(GIB, "");
    for bad in [-0.1, 1.5, f64::NAN] {
        assert!(matches!(
            a.set_memory_fraction(bad),
            Err(AllocError::InvalidFraction(_))
        ));
    }
    assert_eq!(a.allowed_memory_maximum(), None);
}

#[test]
fn expandable_segments_is_ignored_without_virtual_memory() {
    // Like PyTorch on a device without the virtual-memory API, the option is accepted and
    // has no effect.
    let device = SimDevice::new(SimConfig {
        virtual_memory: false,
        ..SimConfig::default()
    });
    let config = AllocatorConfig::parse("expandable_segments:True").expect("valid");
    let mut a = gpumem::CachingAllocator::new(device, config);
    let p = malloc(&mut a, 3 * MIB, S0);
    assert_eq!(stat(&a, "segment.large_pool.current"), 1);
    assert_eq!(a.block_size(p), Some(3 * MIB));
    assert_eq!(
        layout(&a.snapshot())[0].last(),
        Some(&(p.0 + 3 * MIB, 17 * MIB, Free))
    );
}

#[test]
fn summary_reflects_the_stats() {
    let mut a = allocator(80 * GIB, "");
    malloc(&mut a, 3 * MIB, S0);
    let text = a.memory_summary(false);
    assert!(
        text.contains("| Allocated memory      |   3072 KiB |"),
        "{text}"
    );
    assert!(
        text.contains("| GPU reserved memory   |  20480 KiB |"),
        "{text}"
    );
}

/// Segments by size class, as the agent exports them: each segment counted in the power of two
/// at or above its size, with the free bytes it caches; the same as counting the snapshot.
#[test]
fn segments_by_size_counts_segments_and_their_free_bytes() {
    use gpumem::allocator::{SegmentClass, segment_classes};

    let mut a = allocator(GIB, "");
    let _small = malloc(&mut a, MIB, S0); // a 2 MiB small segment, 1 MiB free
    let _three = malloc(&mut a, 3 * MIB, S0); // a 20 MiB segment, 17 MiB free
    let _big = malloc(&mut a, 18 * MIB, S0); // fits no free block: an 18 MiB segment
    let class = |size, segments, free_bytes| SegmentClass {
        size,
        segments,
        free_bytes,
    };
    assert_eq!(
        a.segments_by_size(),
        vec![class(2 * MIB, 1, MIB), class(32 * MIB, 2, 17 * MIB)]
    );

    // With expandable segments, each mapped run is a segment, as in the snapshot: six 15 MiB
    // blocks grow one segment to five 20 MiB pages; two freed blocks and the 10 MiB tail are
    // its free bytes.
    let mut e = allocator(GIB, "expandable_segments:True");
    let ptrs: Vec<_> = (0..6).map(|_| malloc(&mut e, 15 * MIB, S0)).collect();
    free(&mut e, ptrs[1]);
    free(&mut e, ptrs[4]);
    let from_snapshot = segment_classes(e.snapshot().segments.iter().map(|s| {
        let free = s
            .blocks
            .iter()
            .filter(|b| b.state == BlockState::Inactive)
            .map(|b| b.size)
            .sum();
        (s.total_size, free)
    }));
    assert_eq!(from_snapshot, vec![class(128 * MIB, 1, 40 * MIB)]);
    assert_eq!(e.segments_by_size(), from_snapshot);
}
