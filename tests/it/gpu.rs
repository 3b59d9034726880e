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

/// The sizes the cost table is measured at, with the calls made at each.
const MEASURED_SIZES: [(u64, u32); 3] = [(2 * MIB, 50), (20 * MIB, 20), (1 << 30, 4)];

/// Nanoseconds per call of `n` calls that took `elapsed`.
fn per_call(elapsed: std::time::Duration, n: u32) -> u64 {
    (elapsed.as_nanos() / u128::from(n.max(1))) as u64
}

/// Measures the driver-cost table of this GPU (`gpumem-costs`, what `--costs` reads): each
/// call at 2 MiB, 20 MiB and 1 GiB where it has a size, on an idle device (so cudaMalloc's
/// and cudaFree's figures include the synchronisation they imply), and writes it to
/// `$GPUMEM_COSTS_OUT` (default `target/gpu-costs.json`).
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh"]
fn timings() {
    use gpumem::device::{Call, CallCost, DriverCosts, Source};
    let mut device = CudaDevice::new(0).expect("a CUDA device");
    let gpu = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=name", "--format=csv,noheader", "-i", "0"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "an NVIDIA GPU".into());
    let source = Source::Measured(format!(
        "{gpu}, scripts/gpu-check.sh (tests/it/gpu.rs timings)"
    ));
    let mut points: std::collections::BTreeMap<Call, Vec<(u64, u64)>> = Default::default();
    let mut add = |call: Call, size: u64, ns: u64| points.entry(call).or_default().push((size, ns));
    for (size, n) in MEASURED_SIZES {
        device.synchronize().expect("idle");
        let started = Instant::now();
        let ptrs: Vec<_> = (0..n).map(|_| device.malloc(size).expect("fits")).collect();
        add(Call::Malloc, size, per_call(started.elapsed(), n));
        let started = Instant::now();
        for p in ptrs {
            device.free(p).expect("live");
        }
        add(Call::Free, size, per_call(started.elapsed(), n));
        if !device.supports_virtual_memory() {
            continue;
        }
        // Pages in at one address range, mapped again at a second, then out.
        let va = device
            .reserve_address_range(size * u64::from(n))
            .expect("reserve");
        let again = device
            .reserve_address_range(size * u64::from(n))
            .expect("reserve");
        let at = |base: gpumem::DevicePtr, i: u32| gpumem::DevicePtr(base.0 + u64::from(i) * size);
        let started = Instant::now();
        let pages: Vec<_> = (0..n)
            .map(|i| {
                let h = device.create_physical_page(size).expect("page");
                device.map(at(va, i), size, h).expect("map");
                h
            })
            .collect();
        add(Call::PageIn, size, per_call(started.elapsed(), n));
        let started = Instant::now();
        for (i, &h) in (0..n).zip(&pages) {
            device.map(at(again, i), size, h).expect("map again");
        }
        add(Call::Remap, size, per_call(started.elapsed(), n));
        let started = Instant::now();
        for i in 0..n {
            device.unmap(at(again, i), size).expect("unmap");
            device.unmap(at(va, i), size).expect("unmap");
        }
        add(Call::Unmap, size, per_call(started.elapsed(), 2 * n));
        let started = Instant::now();
        for h in pages {
            device.release_physical_page(h).expect("release");
        }
        add(Call::Release, size, per_call(started.elapsed(), n));
        device
            .free_address_range(va, size * u64::from(n))
            .expect("free range");
        device
            .free_address_range(again, size * u64::from(n))
            .expect("free range");
    }
    let n = 1000u32;
    let started = Instant::now();
    for _ in 0..n {
        device.synchronize().expect("sync");
    }
    add(Call::Synchronize, 0, per_call(started.elapsed(), n));
    let event = device.create_event().expect("event");
    let started = Instant::now();
    for _ in 0..n {
        device
            .record_event(event, StreamId::DEFAULT)
            .expect("record");
        device.query_event(event).expect("query");
    }
    add(Call::Event, 0, per_call(started.elapsed(), 2 * n));
    device.destroy_event(event).expect("destroy");
    let started = Instant::now();
    for _ in 0..n {
        device.mem_get_info().expect("info");
    }
    add(Call::MemGetInfo, 0, per_call(started.elapsed(), n));
    // Calls this device could not measure (no virtual memory) keep the public figures.
    let mut costs = DriverCosts::public();
    costs.gpu = gpu;
    for (call, points) in points {
        costs.calls.insert(
            call,
            CallCost {
                points,
                includes_synchronize: matches!(call, Call::Malloc | Call::Free),
                source: source.clone(),
            },
        );
    }
    costs.validate().expect("a valid table");
    let out = std::env::var("GPUMEM_COSTS_OUT").unwrap_or_else(|_| "target/gpu-costs.json".into());
    let text = gpumem::replay::costs::costs_json(&costs);
    std::fs::write(&out, format!("{text}\n")).expect("written");
    println!("GPU driver costs ({out}):\n{text}");
    let ns = |call, size| costs.ns(call, size) as f64 / 1e3;
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
        "GPU timings: cudaMalloc(2 MiB) {:.1} µs, cudaFree {:.1} µs, create+map+set access of a 20 MiB page {:.1} µs, cache hit (malloc+free of 4 MiB) {hit:?}",
        ns(Call::Malloc, 2 * MIB),
        ns(Call::Free, 2 * MIB),
        ns(Call::PageIn, 20 * MIB)
    );
}
