//! Sharing blocks with other processes: the handles the core exports (Note [IPC handles]),
//! the producer's limbo ([`gpumem::ipc`]) and the retry chain's `cuda_ipc_collect`, in the
//! core and in a recorded workload that replays.

use std::sync::Arc;

use gpumem::DevicePtr;
use gpumem::allocator::{AllocError, BlockState, ShareableHandle, TraceAction};
use gpumem::demo::workload::{TrainingWorkload, finish_communication};
use gpumem::ipc::IpcSender;

use crate::common::*;

/// An allocator of `capacity` bytes and a sender, registered as its `cuda_ipc_collect` if
/// `registered`.
fn producer(
    capacity: u64,
    registered: bool,
) -> (gpumem::CachingAllocator<gpumem::SimDevice>, Arc<IpcSender>) {
    let mut a = allocator(capacity, "");
    let sender = Arc::new(IpcSender::new());
    if registered {
        a.register_free_memory_callback(sender.clone());
    }
    (a, sender)
}

/// A consumer's handle on `p`, sent by `sender`, and the producer's storage released.
fn shared_and_released(
    a: &mut gpumem::CachingAllocator<gpumem::SimDevice>,
    sender: &IpcSender,
    p: DevicePtr,
) -> gpumem::ipc::Received {
    let handle = a.share_handle(p).expect("allocated");
    let received = sender.send(p, handle);
    for q in sender.release_storage(p) {
        free(a, q);
    }
    received
}

#[test]
fn a_shared_block_exports_its_whole_segment_with_its_offset() {
    let mut a = allocator(GIB, "");
    let first = malloc(&mut a, 512, S0);
    let second = malloc(&mut a, 4096, S0);
    let (h1, h2) = (
        a.share_handle(first).expect("live"),
        a.share_handle(second).expect("live"),
    );
    assert_eq!(h1.type_byte(), b'c');
    assert_eq!(h1.start(), h2.start(), "one handle per segment");
    assert_eq!(h1.start(), first);
    assert_eq!(h1.offset(), 0);
    assert_eq!(h2.offset(), second.0 - first.0);
    // The consumer maps the whole 2 MiB small segment, not the 4 KiB block.
    assert_eq!(h2.mapped_bytes(), 2 * MIB);
    check(&a);
}

#[test]
fn a_block_of_an_expandable_segment_exports_the_pages_covering_it() {
    let mut a = allocator(GIB, "expandable_segments:True");
    let first = malloc(&mut a, 30 * MIB, S0);
    let second = malloc(&mut a, 15 * MIB, S0);
    assert_eq!(second.0, first.0 + 30 * MIB, "the segment grew in place");
    let h = a.share_handle(second).expect("live");
    // Large-pool pages are 20 MiB: [30, 45) MiB lies on pages 1 and 2.
    let ShareableHandle::Pages {
        start,
        page_size,
        pages,
        offset,
    } = h
    else {
        panic!("an expandable block exports pages: {h:?}");
    };
    assert_eq!(h.type_byte(), b'e');
    assert_eq!((page_size, pages), (20 * MIB, 2));
    assert_eq!(start.0, first.0 + 20 * MIB);
    assert_eq!(offset, 10 * MIB);
    assert_eq!(h.mapped_bytes(), 40 * MIB);
}

#[test]
fn only_allocated_block_starts_can_be_shared() {
    let mut a = allocator(GIB, "");
    let p = malloc(&mut a, 4096, S0);
    for bad in [
        DevicePtr(p.0 + 512),
        DevicePtr(0xdead_0000),
        DevicePtr::NULL,
    ] {
        let err = a.share_handle(bad).expect_err("not a block start");
        assert!(
            matches!(err, AllocError::InvalidPointer(q) if q == bad),
            "{err}"
        );
    }
    free(&mut a, p);
    assert!(a.share_handle(p).is_err(), "a freed block is not shared");
}

#[test]
fn a_block_in_the_limbo_stays_allocated_until_every_consumer_lets_go() {
    let (mut a, sender) = producer(64 * MIB, true);
    let p = malloc(&mut a, 40 * MIB, S0);
    let received = shared_and_released(&mut a, &sender, p);
    assert_eq!(sender.limbo_len(), 1);
    // The snapshot shows nothing IPC-specific: the block is simply allocated.
    let states: Vec<_> = layout(&a.snapshot()).concat();
    assert_eq!(states, [(p.0, 40 * MIB, BlockState::ActiveAllocated)]);
    assert_eq!(stat(&a, "allocated_bytes.all.current"), 40 * MIB as i64);
    // While the consumer holds it, the collect step has nothing to give: out of memory.
    let err = a.malloc(40 * MIB, S0).expect_err("the consumer holds it");
    assert!(err.is_out_of_memory(), "{err}");
    assert_eq!(sender.limbo_len(), 1);
    drop(received);
    let q = a.malloc(40 * MIB, S0).expect("collected");
    assert_eq!(q, p);
    assert_eq!(sender.limbo_len(), 0);
    check(&a);
}

#[test]
fn the_collect_step_avoids_an_oom() {
    // 64 MiB: a 40 MiB block let go by its consumer but not yet collected leaves no room.
    let setup = |register: bool| {
        let (mut a, sender) = producer(64 * MIB, register);
        let p = malloc(&mut a, 40 * MIB, S0);
        drop(shared_and_released(&mut a, &sender, p));
        assert_eq!(sender.limbo_len(), 1, "nothing collected it yet");
        (a, sender, p)
    };
    let (mut a, sender, _) = setup(false);
    let err = a.malloc(40 * MIB, S0).expect_err("never collected");
    assert!(err.is_out_of_memory(), "{err}");
    assert_eq!(sender.limbo_len(), 1);

    let (mut a, sender, p) = setup(true);
    let q = a
        .malloc(40 * MIB, S0)
        .expect("collected in the retry chain");
    check(&a);
    assert_eq!(
        q, p,
        "the collected block served the request from the cache"
    );
    assert_eq!(sender.limbo_len(), 0);
    assert_eq!(stat(&a, "num_device_alloc"), 1, "no new segment");
    assert_eq!(stat(&a, "num_alloc_retries"), 0);
    // The collect's frees precede the request in the trace, as PyTorch records them.
    let actions: Vec<_> = a.trace().iter().map(|e| e.action).collect();
    assert_eq!(
        actions,
        [
            TraceAction::SegmentAlloc,
            TraceAction::Alloc,
            TraceAction::FreeRequested,
            TraceAction::FreeCompleted,
            TraceAction::Alloc,
        ]
    );
}

#[test]
fn a_cached_fit_never_runs_the_collect_step() {
    let (mut a, sender) = producer(GIB, true);
    let p = malloc(&mut a, 40 * MIB, S0);
    let cached = malloc(&mut a, 40 * MIB, S0);
    free(&mut a, cached);
    drop(shared_and_released(&mut a, &sender, p));
    malloc(&mut a, 40 * MIB, S0);
    assert_eq!(sender.limbo_len(), 1, "the cache served it: no collection");
}

#[test]
fn a_collected_pointer_the_allocator_never_gave_is_an_error_not_a_crash() {
    let (mut a, sender) = producer(64 * MIB, true);
    let p = malloc(&mut a, 40 * MIB, S0);
    let handle = a.share_handle(p).expect("live");
    let foreign = DevicePtr(0xdead_0000);
    let received: Vec<_> = [foreign, p]
        .map(|ptr| {
            let received = sender.send(ptr, handle);
            assert!(sender.release_storage(ptr).is_empty(), "held");
            received
        })
        .into();
    drop(received);
    let err = a
        .malloc(40 * MIB, S0)
        .expect_err("a pointer the allocator never gave");
    assert!(
        matches!(err, AllocError::InvalidPointer(q) if q == foreign),
        "{err}"
    );
    check(&a);
    // The valid pointer was freed all the same.
    assert_eq!(stat(&a, "allocated_bytes.all.current"), 0);
}

#[test]
fn a_workload_sharing_its_weights_is_collected_in_the_retry_chain_and_replays_exactly() {
    let mut a = allocator(80 * GIB, "");
    a.record_history(Some(1 << 20));
    let report = TrainingWorkload {
        layers: 4,
        steps: 8,
        max_seq: 1024,
        ipc: true,
        ..TrainingWorkload::default()
    }
    .run(&mut a, finish_communication)
    .expect("runs");
    assert_eq!(report.oom, None);
    assert_eq!(report.shared, 8 * 2, "two buckets a step");
    assert!(
        report.collected_in_retry > 0,
        "the engine's buckets waited in the limbo until a request missed: {report:?}"
    );
    assert_eq!(stat(&a, "allocated_bytes.all.current"), 0, "all collected");
    let v = serde_json::to_value(a.snapshot()).expect("serialises");
    replays_exactly(&v);
}
