//! Allocator hot paths, side by side with `offset-allocator` (an O(1) TLSF-style allocator)
//! on the same operation sequences:
//!
//! - `same_size_hit`: malloc + free that the cache serves (the steady state of a training
//!   loop, where every step asks for the same shapes), once for a block reused whole and once
//!   for a block split from a larger segment and merged back;
//! - `mixed_2000_live`: about 2 000 live blocks of log-uniform sizes (55 % up to 1 MiB, 40 %
//!   1–32 MiB, 5 % 32–256 MiB); each iteration frees a random live block and allocates a new
//!   random size in its place.
//!
//! - `recorded`: the allocations and frees of real training recordings (bundled in
//!   `data/traces`), replayed in their order; blocks still live at the end are freed so that
//!   every pass starts from the same state. Reported per event.
//!
//! `recorded` also runs PyTorch's own allocator design (`pytorch_design`: the C++17 peer in
//! `crates/gpumem-baseline/`, with its sets, heap blocks, flat hash maps, locks and stat arrays), after
//! checking that it returns gpumem's addresses and statistics on the same events. Both run
//! under each best-fit order, side by side: `address` (PyTorch 2.11 and before) and
//! `counter` (2.13 and later: the segment counter breaks ties among equal sizes). On these
//! recordings segments are never released, so addresses follow creation and the two orders
//! make the same decisions (checked): the rows price the order's comparisons.
//!
//! Each group also runs offset-allocator behind a pointer map (`offset_allocator_by_address`):
//! it frees by handle, while gpumem, like PyTorch's allocator, is handed back only the
//! address and must look the block up. That row prices the interface, not the algorithm; the
//! plain `offset_allocator` row is the baseline.
//!
//! Time per iteration of the first two is one malloc plus one free for both allocators;
//! divide to compare.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gpumem::allocator::FitOrder;
use gpumem::device::{SimConfig, SimDevice};
use gpumem::rng::XorShift;
use gpumem::{AllocatorConfig, CachingAllocator, DevicePtr, StreamId};
use gpumem_baseline::{PytorchDesign, stat_names};
use offset_allocator::{Allocation, Allocator};
use rustc_hash::FxHashMap;

mod common;
use common::{Event, RECORDINGS, recorded_events};

const MIB: u64 = 1 << 20;
const UNIT: u64 = 512;
const LIVE: usize = 2_000;
/// Precomputed operations, replayed cyclically.
const SEQUENCE: usize = 1 << 16;

/// Both allocators' device: 1 TiB.
const CAPACITY: u64 = 1 << 40;

fn gpumem_allocator() -> CachingAllocator<SimDevice> {
    CachingAllocator::new(
        SimDevice::new(SimConfig::with_capacity(CAPACITY)),
        AllocatorConfig::default(),
    )
}

/// The orders `recorded` runs under: (row suffix, gpumem's order, the C++ peer's).
const ORDERS: [(&str, FitOrder, bool); 2] = [
    ("address", FitOrder::Address, false),
    ("counter", FitOrder::Counter, true),
];

fn gpumem_in(order: FitOrder) -> CachingAllocator<SimDevice> {
    CachingAllocator::with_fit_order(
        SimDevice::new(SimConfig::with_capacity(CAPACITY)),
        AllocatorConfig::default(),
        order,
    )
}

fn offset_allocator() -> Allocator<u32> {
    // 2^31 units of 512 B = 1 TiB, the same capacity as the simulated GPU.
    Allocator::with_max_allocs(1 << 31, 1 << 17)
}

fn units(size: u64) -> u32 {
    size.div_ceil(UNIT) as u32
}

/// offset-allocator freed by address, as a pointer-based API has to: allocations are kept in
/// a hash map from offset to handle.
struct ByAddress {
    allocator: Allocator<u32>,
    live: FxHashMap<u32, Allocation<u32>>,
}

impl ByAddress {
    fn new() -> Self {
        ByAddress {
            allocator: offset_allocator(),
            live: FxHashMap::default(),
        }
    }

    fn allocate(&mut self, units: u32) -> u32 {
        let allocation = self.allocator.allocate(units).expect("fits");
        self.live.insert(allocation.offset, allocation);
        allocation.offset
    }

    fn free(&mut self, offset: u32) {
        let allocation = self.live.remove(&offset).expect("live");
        self.allocator.free(allocation);
    }
}

fn same_size_hit(c: &mut Criterion) {
    let mut group = c.benchmark_group("same_size_hit");
    // 12 MiB fills its own 12 MiB segment: the cached block is reused whole. 4 MiB is carved
    // from a 20 MiB segment: every malloc splits it and every free merges it back.
    for (name, size) in [("exact_12MiB", 12 * MIB), ("split_4MiB", 4 * MIB)] {
        group.bench_function(format!("gpumem/{name}"), |b| {
            let mut a = gpumem_allocator();
            let warm = a.malloc(size, StreamId::DEFAULT).expect("fits");
            a.free(warm).expect("live");
            b.iter(|| {
                let p = a.malloc(black_box(size), StreamId::DEFAULT).expect("fits");
                a.free(p).expect("live");
            });
        });
        group.bench_function(format!("offset_allocator/{name}"), |b| {
            let mut a = offset_allocator();
            b.iter(|| {
                let p = a.allocate(black_box(units(size))).expect("fits");
                a.free(p);
            });
        });
    }
    group.finish();
}

/// A log-uniform size: 55 % up to 1 MiB, 40 % from 1 to 32 MiB, 5 % from 32 to 256 MiB.
fn random_size(rng: &mut XorShift) -> u64 {
    let (low, high) = match rng.next_u64() % 100 {
        0..=54 => (512.0f64, MIB as f64),
        55..=94 => (MIB as f64, 32.0 * MIB as f64),
        _ => (32.0 * MIB as f64, 256.0 * MIB as f64),
    };
    let t = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    (low * (high / low).powf(t)) as u64
}

/// The shared sequence: initial sizes of the live set, then (slot to replace, new size).
fn mixed_sequence() -> (Vec<u64>, Vec<(usize, u64)>) {
    let mut rng = XorShift::new(42);
    let initial = (0..LIVE).map(|_| random_size(&mut rng)).collect();
    let steps = (0..SEQUENCE)
        .map(|_| {
            (
                (rng.next_u64() % LIVE as u64) as usize,
                random_size(&mut rng),
            )
        })
        .collect();
    (initial, steps)
}

fn mixed_2000_live(c: &mut Criterion) {
    let (initial, steps) = mixed_sequence();
    let mut group = c.benchmark_group("mixed_2000_live");
    group.bench_function("gpumem", |b| {
        let mut a = gpumem_allocator();
        let mut slots: Vec<DevicePtr> = initial
            .iter()
            .map(|&s| a.malloc(s, StreamId::DEFAULT).expect("fits"))
            .collect();
        let mut i = 0;
        b.iter(|| {
            let (slot, size) = steps[i % SEQUENCE];
            i += 1;
            a.free(slots[slot]).expect("live");
            slots[slot] = a.malloc(black_box(size), StreamId::DEFAULT).expect("fits");
        });
    });
    group.bench_function("offset_allocator", |b| {
        let mut a = offset_allocator();
        let mut slots: Vec<Allocation<u32>> = initial
            .iter()
            .map(|&s| a.allocate(units(s)).expect("fits"))
            .collect();
        let mut i = 0;
        b.iter(|| {
            let (slot, size) = steps[i % SEQUENCE];
            i += 1;
            a.free(slots[slot]);
            slots[slot] = a.allocate(black_box(units(size))).expect("fits");
        });
    });
    group.bench_function("offset_allocator_by_address", |b| {
        let mut a = ByAddress::new();
        let mut slots: Vec<u32> = initial.iter().map(|&s| a.allocate(units(s))).collect();
        let mut i = 0;
        b.iter(|| {
            let (slot, size) = steps[i % SEQUENCE];
            i += 1;
            a.free(slots[slot]);
            slots[slot] = a.allocate(black_box(units(size)));
        });
    });
    group.finish();
}

/// Checks, before anything is timed, that PyTorch's design (the C++ peer) makes gpumem's
/// decisions on `events` in the same order: the same address for every allocation, and the
/// same statistics after every event. Returns the addresses.
fn same_decisions(
    name: &str,
    events: &[Event],
    slots: usize,
    (_, order, counter): (&str, FitOrder, bool),
) -> Vec<u64> {
    let mut ours = gpumem_in(order);
    let mut theirs = PytorchDesign::with_counter_order(CAPACITY, counter);
    let mut placed = Vec::new();
    let mut live = vec![DevicePtr::NULL; slots];
    let names = stat_names();
    for (i, event) in events.iter().enumerate() {
        match *event {
            Event::Alloc { slot, size } => {
                let a = ours.malloc(size, StreamId::DEFAULT).expect("fits");
                let b = theirs.malloc(size, 0).expect("fits");
                assert_eq!(
                    a.0, b,
                    "{name}: event {i}: gpumem and PyTorch's design place {size} bytes apart"
                );
                live[slot] = a;
                placed.push(a.0);
            }
            Event::Free { slot } => {
                ours.free(live[slot]).expect("live");
                assert!(theirs.free(live[slot].0), "{name}: event {i}: freed");
            }
        }
        let stats = ours.memory_stats();
        for (key, value) in names.iter().zip(theirs.stats()) {
            assert_eq!(
                stats.get(key.as_str()).copied(),
                Some(value),
                "{name}: event {i}: {key}"
            );
        }
    }
    placed
}

fn recorded(c: &mut Criterion) {
    let mut group = c.benchmark_group("recorded");
    for (name, file) in RECORDINGS {
        let (events, slots) = recorded_events(file);
        let placed: Vec<Vec<u64>> = ORDERS
            .iter()
            .map(|&order| same_decisions(name, &events, slots, order))
            .collect();
        assert_eq!(placed[0], placed[1], "{name}: the orders decide alike here");
        group.throughput(Throughput::Elements(events.len() as u64));
        for (suffix, order, counter) in ORDERS {
            group.bench_function(format!("gpumem_{suffix}/{name}"), |b| {
                let mut a = gpumem_in(order);
                let mut live = vec![DevicePtr::NULL; slots];
                b.iter(|| {
                    for event in &events {
                        match *event {
                            Event::Alloc { slot, size } => {
                                live[slot] =
                                    a.malloc(black_box(size), StreamId::DEFAULT).expect("fits");
                            }
                            Event::Free { slot } => a.free(live[slot]).expect("live"),
                        }
                    }
                });
            });
            group.bench_function(format!("pytorch_design_{suffix}/{name}"), |b| {
                let mut a = PytorchDesign::with_counter_order(CAPACITY, counter);
                let mut live = vec![0u64; slots];
                b.iter(|| {
                    for event in &events {
                        match *event {
                            Event::Alloc { slot, size } => {
                                live[slot] = a.malloc(black_box(size), 0).expect("fits");
                            }
                            Event::Free { slot } => {
                                let freed = a.free(live[slot]);
                                debug_assert!(freed);
                            }
                        }
                    }
                });
            });
        }
        group.bench_function(format!("offset_allocator/{name}"), |b| {
            let mut a = offset_allocator();
            let mut live: Vec<Option<Allocation<u32>>> = vec![None; slots];
            b.iter(|| {
                for event in &events {
                    match *event {
                        Event::Alloc { slot, size } => {
                            live[slot] = Some(a.allocate(black_box(units(size))).expect("fits"));
                        }
                        Event::Free { slot } => a.free(live[slot].take().expect("live")),
                    }
                }
            });
        });
        group.bench_function(format!("offset_allocator_by_address/{name}"), |b| {
            let mut a = ByAddress::new();
            let mut live = vec![0; slots];
            b.iter(|| {
                for event in &events {
                    match *event {
                        Event::Alloc { slot, size } => {
                            live[slot] = a.allocate(black_box(units(size)))
                        }
                        Event::Free { slot } => a.free(live[slot]),
                    }
                }
            });
        });
    }
    group.finish();
}

criterion_group!(benches, same_size_hit, mixed_2000_live, recorded);
criterion_main!(benches);
