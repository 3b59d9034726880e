//! Checks on a real NVIDIA GPU (feature `cuda`). They are ignored by the normal test command,
//! which reports them as skipped with the reason; `scripts/gpu-check.sh` runs them.

#![allow(unsafe_code)]

use std::time::Instant;

use cudarc::driver::result;
use gpumem::device::{CudaDevice, Device};
use gpumem::{AllocatorConfig, CachingAllocator, StreamId};

const MIB: u64 = 1 << 20;

fn allocator(conf: &str) -> CachingAllocator<CudaDevice> {
    let device = CudaDevice::new(0).expect("a CUDA device");
    CachingAllocator::new(device, AllocatorConfig::parse(conf).expect("valid"))
}

fn check(a: &CachingAllocator<CudaDevice>) {
    a.check_invariants().expect("invariants hold");
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh"]
fn scenarios_on_a_real_gpu() {
    let mut a = allocator("");
    let s = StreamId::DEFAULT;
    // Scenario 2 and 3: one byte takes a 2 MiB segment; free and empty_cache return it.
    let p = a.malloc(1, s).expect("fits");
    check(&a);
    assert_eq!(a.block_size(p), Some(512));
    assert_eq!(
        a.memory_stats()["reserved_bytes.all.current"],
        2 * MIB as i64
    );
    a.free(p).expect("live");
    a.empty_cache().expect("empty_cache");
    check(&a);
    assert_eq!(a.memory_stats()["reserved_bytes.all.current"], 0);
    // Scenario 9: best fit over three exact segments.
    let blocks: Vec<_> = [12, 14, 16]
        .iter()
        .map(|m| a.malloc(m * MIB, s).expect("fits"))
        .collect();
    for p in &blocks {
        a.free(*p).expect("live");
    }
    let q = a.malloc(13 * MIB, s).expect("fits");
    assert_eq!((q, a.block_size(q)), (blocks[1], Some(14 * MIB)));
    a.free(q).expect("live");
    a.empty_cache().expect("empty_cache");
    check(&a);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh"]
fn a_free_waits_for_work_on_another_stream() {
    let mut a = allocator("");
    let s0 = StreamId::DEFAULT;
    // The caller's work runs in its own current context, as PyTorch's does (the allocator
    // leaves the caller's context as it found it): the device's primary context.
    let device = result::device::get(0).expect("device 0");
    // SAFETY: `device` is a valid device handle; the retained context outlives the test.
    let context = unsafe { result::primary_ctx::retain(device) }.expect("primary context");
    // SAFETY: `context` was just retained.
    unsafe { result::ctx::set_current(context) }.expect("current context");
    let side = result::stream::create(result::stream::StreamKind::NonBlocking).expect("stream");
    let s1 = StreamId(side as usize as u64);
    let x = a.malloc(256 * MIB, s0).expect("fits");
    // Keep the side stream busy on X, then free X while that work may still run.
    for _ in 0..20 {
        // SAFETY: X is a live 256 MiB device allocation; the side stream is live.
        unsafe { result::memset_d8_async(x.0, 1, (256 * MIB) as usize, side) }.expect("memset");
    }
    a.record_stream(x, s1);
    a.free(x).expect("live");
    check(&a);
    assert_eq!(
        a.memory_stats()["active.all.current"],
        1,
        "pending on the side stream"
    );
    // SAFETY: the side stream is live.
    unsafe { result::stream::synchronize(side) }.expect("sync");
    let y = a.malloc(256 * MIB, s0).expect("fits");
    assert_eq!(y, x, "reused once the side stream's work completed");
    a.free(y).expect("live");
    a.empty_cache().expect("empty_cache");
    check(&a);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh"]
fn expandable_segments_map_real_pages() {
    let mut a = allocator("expandable_segments:True");
    if !a.device().supports_virtual_memory() {
        eprintln!("the driver offers no virtual memory management: skipped");
        return;
    }
    let s = StreamId::DEFAULT;
    let x = a.malloc(3 * MIB, s).expect("fits");
    let y = a.malloc(30 * MIB, s).expect("fits");
    check(&a);
    assert_eq!(y.0, x.0 + 3 * MIB, "the segment grew in place");
    assert_eq!(
        a.memory_stats()["reserved_bytes.all.current"],
        40 * MIB as i64
    );
    assert_eq!(a.memory_stats()["segment.all.current"], 0);
    a.free(x).expect("live");
    a.free(y).expect("live");
    a.empty_cache().expect("empty_cache");
    check(&a);
    assert_eq!(a.memory_stats()["reserved_bytes.all.current"], 0);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh"]
fn timings() {
    let mut device = CudaDevice::new(0).expect("a CUDA device");
    let n = 50u32;
    let started = Instant::now();
    let ptrs: Vec<_> = (0..n)
        .map(|_| device.malloc(2 * MIB).expect("fits"))
        .collect();
    let malloc = started.elapsed() / n;
    let started = Instant::now();
    for p in ptrs {
        device.free(p).expect("live");
    }
    let free = started.elapsed() / n;
    let mut map = None;
    if device.supports_virtual_memory() {
        let page = 20 * MIB;
        let va = device.reserve_address_range(page * 20).expect("reserve");
        let started = Instant::now();
        let mut pages = Vec::new();
        for i in 0..20 {
            let h = device.create_physical_page(page).expect("page");
            device
                .map(gpumem::DevicePtr(va.0 + i * page), page, h)
                .expect("map");
            pages.push(h);
        }
        map = Some(started.elapsed() / 20);
        for (i, h) in pages.into_iter().enumerate() {
            device
                .unmap(gpumem::DevicePtr(va.0 + i as u64 * page), page)
                .expect("unmap");
            device.release_physical_page(h).expect("release");
        }
        device
            .free_address_range(va, page * 20)
            .expect("free range");
    }
    let mut a = CachingAllocator::new(device, AllocatorConfig::default());
    let warm = a.malloc(4 * MIB, StreamId::DEFAULT).expect("fits");
    a.free(warm).expect("live");
    let iterations = 100_000u32;
    let started = Instant::now();
    for _ in 0..iterations {
        let p = a.malloc(4 * MIB, StreamId::DEFAULT).expect("fits");
        a.free(p).expect("live");
    }
    let hit = started.elapsed() / iterations;
    println!(
        "GPU timings: cudaMalloc(2 MiB) {malloc:?}, cudaFree {free:?}, create+map+set access of a 20 MiB page {}, cache hit (malloc+free of 4 MiB) {hit:?}",
        map.map_or("n/a (no VMM)".to_string(), |d| format!("{d:?}"))
    );
}
