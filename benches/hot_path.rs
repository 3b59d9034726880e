//! The allocator's hot path, for an instruction counter: the bundled recordings' events
//! (those of `allocator`'s `recorded` group) replayed through gpumem's allocator a number of
//! times, in one best-fit order, as the benchmark replays them.
//!
//! Timings on a shared machine vary by more than the changes the hot path sees; instruction
//! counts do not. Build it with `cargo bench --bench hot_path --no-run` and count the
//! replay alone (not the reading of the recording) with callgrind:
//!
//! ```text
//! valgrind --tool=callgrind --toggle-collect='*replay_pass*' \
//!     target/release/deps/hot_path-<hash> opt125m address 10
//! callgrind_annotate --inclusive=yes callgrind.out.<pid>
//! ```
//!
//! Arguments: the recording (`opt125m`, `lm_fwd_bwd`; default both), the order (`address`,
//! `counter`; default both), the number of passes (default 10) and the allocator: `gpumem`
//! (the default), or a peer of the `recorded` group, `pytorch_design` or
//! `offset_allocator_by_address` (count it with `--toggle-collect='*peer_pass*'`), so that
//! the instructions of both sides of a ratio come from one tool. It prints each run's
//! events, time per event (a rough figure: use criterion's `recorded` group to compare) and,
//! for gpumem, a digest of the addresses of one more pass, which any change to the hot path
//! must leave as it was.

use std::hint::black_box;
use std::time::Instant;

use gpumem::allocator::FitOrder;
use gpumem::device::{SimConfig, SimDevice};
use gpumem::{AllocatorConfig, CachingAllocator, DevicePtr, StreamId};
use gpumem_baseline::PytorchDesign;
use offset_allocator::{Allocation, Allocator};
use rustc_hash::FxHashMap;

mod common;
use common::{Event, RECORDINGS, recorded_events};

/// The benchmark's device: 1 TiB.
const CAPACITY: u64 = 1 << 40;

/// One pass over the events, as `recorded` times it; out of line, so that callgrind can
/// count it alone.
#[inline(never)]
fn replay_pass(a: &mut CachingAllocator<SimDevice>, events: &[Event], live: &mut [DevicePtr]) {
    for event in events {
        match *event {
            Event::Alloc { slot, size } => {
                live[slot] = a.malloc(black_box(size), StreamId::DEFAULT).expect("fits");
            }
            Event::Free { slot } => a.free(live[slot]).expect("live"),
        }
    }
}

/// PyTorch's design (the C++ peer) on the same events.
#[inline(never)]
fn pytorch_peer_pass(a: &mut PytorchDesign, events: &[Event], live: &mut [u64]) {
    for event in events {
        match *event {
            Event::Alloc { slot, size } => live[slot] = a.malloc(black_box(size), 0).expect("fits"),
            Event::Free { slot } => {
                a.free(live[slot]);
            }
        }
    }
}

/// offset-allocator behind a map from offset to handle (as `recorded`'s row), in 512 B units.
#[inline(never)]
fn offset_peer_pass(
    a: &mut Allocator<u32>,
    by_offset: &mut FxHashMap<u32, Allocation<u32>>,
    events: &[Event],
    live: &mut [u32],
) {
    for event in events {
        match *event {
            Event::Alloc { slot, size } => {
                let units = black_box(size).div_ceil(512) as u32;
                let allocation = a.allocate(units).expect("fits");
                by_offset.insert(allocation.offset, allocation);
                live[slot] = allocation.offset;
            }
            Event::Free { slot } => a.free(by_offset.remove(&live[slot]).expect("live")),
        }
    }
}

/// FNV-1a over the addresses of one more pass.
fn digest(a: &mut CachingAllocator<SimDevice>, events: &[Event], live: &mut [DevicePtr]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for event in events {
        match *event {
            Event::Alloc { slot, size } => {
                live[slot] = a.malloc(size, StreamId::DEFAULT).expect("fits");
                hash = (hash ^ live[slot].0).wrapping_mul(0x100_0000_01b3);
            }
            Event::Free { slot } => a.free(live[slot]).expect("live"),
        }
    }
    hash
}

fn main() {
    // `cargo bench` adds `--bench`: options are ignored.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let wanted = |i: usize, value: &str| args.get(i).is_none_or(|a| a == value);
    let passes: usize = args
        .get(2)
        .map_or(10, |p| p.parse().expect("a number of passes"));
    for (name, file) in RECORDINGS.into_iter().filter(|(n, _)| wanted(0, n)) {
        let (events, slots) = recorded_events(file);
        for (order_name, order) in [
            ("address", FitOrder::Address),
            ("counter", FitOrder::Counter),
        ]
        .into_iter()
        .filter(|(o, _)| wanted(1, o))
        {
            let start = Instant::now();
            let (elapsed, digest) = match args.get(3).map_or("gpumem", String::as_str) {
                "gpumem" => {
                    let mut a = CachingAllocator::with_fit_order(
                        SimDevice::new(SimConfig::with_capacity(CAPACITY)),
                        AllocatorConfig::default(),
                        order,
                    );
                    let mut live = vec![DevicePtr::NULL; slots];
                    for _ in 0..passes {
                        replay_pass(&mut a, &events, &mut live);
                    }
                    let elapsed = start.elapsed();
                    (
                        elapsed,
                        format!(", addresses {:016x}", digest(&mut a, &events, &mut live)),
                    )
                }
                "pytorch_design" => {
                    let counter = order == FitOrder::Counter;
                    let mut a = PytorchDesign::with_counter_order(CAPACITY, counter);
                    let mut live = vec![0; slots];
                    for _ in 0..passes {
                        pytorch_peer_pass(&mut a, &events, &mut live);
                    }
                    (start.elapsed(), String::new())
                }
                "offset_allocator_by_address" => {
                    let mut a = Allocator::with_max_allocs(1 << 31, 1 << 17);
                    let mut by_offset = FxHashMap::default();
                    let mut live = vec![0; slots];
                    for _ in 0..passes {
                        offset_peer_pass(&mut a, &mut by_offset, &events, &mut live);
                    }
                    (start.elapsed(), String::new())
                }
                other => panic!(
                    "no allocator {other}: gpumem, pytorch_design or offset_allocator_by_address"
                ),
            };
            let per_event = elapsed.as_nanos() as f64 / (passes * events.len()).max(1) as f64;
            println!(
                "{name} {order_name}: {} events x {passes} passes, {per_event:.1} ns/event{digest}",
                events.len()
            );
        }
    }
}
