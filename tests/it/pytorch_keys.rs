//! The configuration keys of PyTorch 2.11 to 2.15 that change the allocator's decisions, and
//! the retry chain's free-memory callbacks: each key's effect on a simulated GPU.

use std::sync::{Arc, Mutex};

use gpumem::DevicePtr;
use gpumem::allocator::{AllocError, FreeMemoryCallback, TraceAction};

use crate::common::*;

fn segment_sizes(a: &gpumem::CachingAllocator<gpumem::SimDevice>) -> Vec<u64> {
    a.trace()
        .iter()
        .filter(|e| {
            matches!(
                e.action,
                TraceAction::SegmentAlloc | TraceAction::SegmentMap
            )
        })
        .map(|e| e.size)
        .collect()
}

#[test]
fn large_segment_size_sizes_the_segments_of_mid_sized_requests() {
    let mut a = allocator(GIB, "large_segment_size_mb:12");
    malloc(&mut a, 3 * MIB, S0);
    // 1–10 MiB requests get the configured segment, smaller ones 2 MiB, larger their own.
    malloc(&mut a, 512, S0);
    malloc(&mut a, 11 * MIB, S0);
    assert_eq!(segment_sizes(&a), [12 * MIB, 2 * MIB, 12 * MIB]);
    // The default is 20 MiB.
    let mut a = allocator(GIB, "");
    malloc(&mut a, 3 * MIB, S0);
    assert_eq!(segment_sizes(&a), [20 * MIB]);
}

#[test]
fn large_segment_size_is_the_large_pools_expandable_page() {
    let mut a = allocator(GIB, "expandable_segments:True,large_segment_size_mb:12");
    malloc(&mut a, 3 * MIB, S0);
    // One page of 12 MiB is mapped for the 3 MiB request.
    assert_eq!(segment_sizes(&a), [12 * MIB]);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 12 * MIB as i64);
}

#[test]
fn max_non_split_rounding_moves_the_oversize_slack() {
    // A cached 150 MiB oversize block; a 120 MiB oversize request wastes 30 MiB on it.
    for (conf, reused) in [
        ("max_split_size_mb:100", false),
        ("max_split_size_mb:100,max_non_split_rounding_mb:40", true),
    ] {
        let mut a = allocator(GIB, conf);
        let p = malloc(&mut a, 150 * MIB, S0);
        free(&mut a, p);
        let q = malloc(&mut a, 120 * MIB, S0);
        assert_eq!(q == p, reused, "{conf}");
        let segments = if reused { 1 } else { 2 };
        assert_eq!(segment_sizes(&a).len(), segments, "{conf}");
    }
}

#[test]
fn throw_on_cudamalloc_oom_fails_at_the_fraction_without_the_retry_chain() {
    // A 100 MiB segment is cached; the fraction allows 200 MiB; a 150 MiB request needs
    // that segment released first.
    let run = |conf: &str| {
        let mut a = allocator(GIB, conf);
        let p = malloc(&mut a, 100 * MIB, S0);
        free(&mut a, p);
        let result = a.malloc(150 * MIB, S0);
        check(&a);
        (a, result)
    };
    let fraction = "per_process_memory_fraction:0.1953125";
    let (a, result) = run(fraction);
    assert!(
        result.is_ok(),
        "the retry chain releases the cache: {result:?}"
    );
    assert_eq!(stat(&a, "num_alloc_retries"), 1);
    assert_eq!(stat(&a, "num_oom_rejections"), 0);

    let (a, result) = run(&format!("{fraction},throw_on_cudamalloc_oom:True"));
    let Err(AllocError::OutOfMemory(oom)) = result else {
        panic!("refused at the fraction: {result:?}");
    };
    assert!(oom.rejected, "{oom}");
    assert!(oom.to_string().contains("throw_on_cudamalloc_oom"), "{oom}");
    assert_eq!(stat(&a, "num_oom_rejections"), 1);
    assert_eq!(stat(&a, "num_ooms"), 0, "not counted as an OOM");
    assert_eq!(stat(&a, "num_alloc_retries"), 0, "no flush was tried");
    assert_eq!(
        stat(&a, "reserved_bytes.all.current"),
        100 * MIB as i64,
        "cache kept"
    );
    assert!(!a.trace().iter().any(|e| e.action == TraceAction::Oom));

    // Without a fraction there is no limit to refuse at.
    let (a, result) = run("throw_on_cudamalloc_oom:True");
    assert!(result.is_ok());
    assert_eq!(stat(&a, "num_oom_rejections"), 0);
}

#[test]
fn per_process_memory_fraction_installs_the_limit() {
    let a = allocator(GIB, "per_process_memory_fraction:0.25");
    assert_eq!(a.allowed_memory_maximum(), Some(GIB / 4));
    let a = allocator(GIB, "per_process_memory_fraction:1.0");
    assert_eq!(a.allowed_memory_maximum(), None, "1.0 sets no limit");
    let mut a = allocator(GIB, "");
    a.set_allocator_settings("per_process_memory_fraction:0.5")
        .expect("valid");
    assert_eq!(
        a.allowed_memory_maximum(),
        Some(GIB / 2),
        "applied at run time"
    );
    let err = a.malloc(600 * MIB, S0).expect_err("past the limit");
    assert!(err.is_out_of_memory(), "{err}");
}

#[test]
fn a_small_expandable_reserve_fails_larger_requests_as_out_of_memory() {
    let mut a = allocator(
        GIB,
        "expandable_segments:True,expandable_segments_reserve:0.25",
    );
    malloc(&mut a, 200 * MIB, S0);
    let err = a
        .malloc(300 * MIB, S1)
        .expect_err("a 256 MiB reserve cannot hold it");
    assert!(err.is_out_of_memory(), "{err}");
    check(&a);
    // The default reserve (9/8 of the device) holds it.
    let mut a = allocator(GIB, "expandable_segments:True");
    malloc(&mut a, 300 * MIB, S1);
}

/// Holds pointers for someone else (as IPC's limbo does) and lets go of them when asked.
#[derive(Default)]
struct Limbo {
    held: Mutex<Vec<DevicePtr>>,
    asked: Mutex<usize>,
}

impl FreeMemoryCallback for Limbo {
    fn release(&self) -> Vec<DevicePtr> {
        *self.asked.lock().expect("lock") += 1;
        std::mem::take(&mut *self.held.lock().expect("lock"))
    }
}

#[test]
fn free_memory_callbacks_avoid_an_oom() {
    // The device holds 64 MiB: a 40 MiB block held in limbo leaves no room for another.
    let setup = |register: bool| {
        let mut a = allocator(64 * MIB, "");
        let limbo = Arc::new(Limbo::default());
        if register {
            a.register_free_memory_callback(limbo.clone());
        }
        let p = malloc(&mut a, 40 * MIB, S0);
        limbo.held.lock().expect("lock").push(p);
        (a, limbo, p)
    };
    let (mut a, _, _) = setup(false);
    let err = a.malloc(40 * MIB, S0).expect_err("no callback, no room");
    assert!(err.is_out_of_memory());

    let (mut a, limbo, p) = setup(true);
    // The first segment was obtained after asking the callback, which had nothing then.
    assert_eq!(*limbo.asked.lock().expect("lock"), 1);
    let q = a
        .malloc(40 * MIB, S0)
        .expect("the callback gave the block back");
    check(&a);
    assert_eq!(q, p, "the freed block served the request from the cache");
    assert_eq!(*limbo.asked.lock().expect("lock"), 2);
    assert_eq!(stat(&a, "num_device_alloc"), 1, "no new segment");
    assert_eq!(stat(&a, "num_alloc_retries"), 0);
    // A cached fit never asks the callbacks.
    free(&mut a, q);
    malloc(&mut a, 40 * MIB, S0);
    assert_eq!(*limbo.asked.lock().expect("lock"), 2);
}

#[test]
fn a_callback_returning_a_foreign_pointer_is_an_error_not_a_crash() {
    let mut a = allocator(64 * MIB, "");
    let limbo = Arc::new(Limbo::default());
    a.register_free_memory_callback(limbo.clone());
    let p = malloc(&mut a, 40 * MIB, S0);
    limbo
        .held
        .lock()
        .expect("lock")
        .extend([DevicePtr(0xdead_0000), p]);
    let err = a
        .malloc(40 * MIB, S0)
        .expect_err("a pointer the allocator never gave");
    assert!(matches!(err, AllocError::InvalidPointer(_)), "{err}");
    check(&a);
    // The valid pointer was freed all the same.
    assert_eq!(stat(&a, "allocated_bytes.all.current"), 0);
}
