//! Property tests: random sequences of malloc, free, record_stream, event completion,
//! empty_cache, configuration changes, memory fractions and injected driver failures keep
//! every invariant after every operation, live allocations never overlap, and everything
//! returns to the driver at the end.
//!
//! The normal run covers 10^5 operations; `GPUMEM_SOAK_OPS=10000000` runs a longer soak.

use std::collections::BTreeMap;

use gpumem::allocator::AllocError;
use gpumem::device::{DeviceError, SimConfig, SimDevice};
use gpumem::workload::XorShift;
use gpumem::{AllocatorConfig, CachingAllocator, DevicePtr, StreamId};
use proptest::prelude::*;

use crate::common::{GIB, MIB, check};

const STREAMS: u64 = 3;

/// Configurations switched between at run time. Each parse resets the three fragmentation
/// knobs and keeps `expandable_segments` unless it is named, so expandable segments come and
/// go while blocks of both kinds are live.
const CONFIGS: [&str; 9] = [
    "",
    "max_split_size_mb:64",
    "roundup_power2_divisions:4",
    "garbage_collection_threshold:0.7",
    "roundup_power2_divisions:[1:2,8:4,>:8],max_split_size_mb:200",
    "max_split_size_mb:32,garbage_collection_threshold:0.5",
    "expandable_segments:True",
    "expandable_segments:True,max_split_size_mb:64",
    "expandable_segments:False",
];

#[derive(Clone, Debug)]
enum Op {
    Malloc { size: u64, stream: StreamId },
    Free { pick: u64 },
    RecordStream { pick: u64, stream: StreamId },
    CompleteStream { stream: StreamId },
    EmptyCache,
    SetConfig { index: usize },
    SetFraction { fraction: f64 },
    FailNextMalloc { oom: bool },
}

impl Op {
    /// Decodes three random numbers into an operation; mallocs and frees dominate.
    fn decode(kind: u64, a: u64, b: u64) -> Op {
        let stream = StreamId(b % STREAMS);
        match kind % 100 {
            0..=39 => {
                // Sizes spread over the small pool, the 20 MiB class and the large class.
                let size = match a % 10 {
                    0..=4 => 1 + (a >> 8) % MIB,
                    5..=7 => MIB + (a >> 8) % (9 * MIB),
                    8 => 10 * MIB + (a >> 8) % (90 * MIB),
                    _ => 100 * MIB + (a >> 8) % (300 * MIB),
                };
                Op::Malloc { size, stream }
            }
            40..=76 => Op::Free { pick: a },
            77..=84 => Op::RecordStream { pick: a, stream },
            85..=92 => Op::CompleteStream { stream },
            93..=94 => Op::EmptyCache,
            95..=96 => Op::SetConfig {
                index: (a % CONFIGS.len() as u64) as usize,
            },
            97 => Op::SetFraction {
                fraction: [0.5, 0.8, 1.0][(a % 3) as usize],
            },
            _ => Op::FailNextMalloc {
                oom: a.is_multiple_of(2),
            },
        }
    }
}

/// Drives an allocator and a model of the live allocations.
struct Run {
    alloc: CachingAllocator<SimDevice>,
    /// Live pointers → block size, to check that hand-outs never overlap.
    live: BTreeMap<u64, u64>,
}

impl Run {
    fn new() -> Self {
        let config = AllocatorConfig::default();
        Run {
            alloc: CachingAllocator::new(SimDevice::new(SimConfig::with_capacity(2 * GIB)), config),
            live: BTreeMap::new(),
        }
    }

    fn pick(&self, pick: u64) -> Option<u64> {
        if self.live.is_empty() {
            return None;
        }
        let i = (pick % self.live.len() as u64) as usize;
        self.live.keys().nth(i).copied()
    }

    fn apply(&mut self, op: &Op) -> Result<(), String> {
        match *op {
            Op::Malloc { size, stream } => match self.alloc.malloc(size, stream) {
                Ok(ptr) => {
                    let block = self.alloc.block_size(ptr).ok_or("live block has no size")?;
                    if block < size {
                        return Err(format!("{size} bytes served by a {block}-byte block"));
                    }
                    if let Some((&p, &s)) = self.live.range(..ptr.0 + block).next_back()
                        && p + s > ptr.0
                    {
                        return Err(format!("{ptr:?}+{block} overlaps live {p:#x}+{s}"));
                    }
                    self.live.insert(ptr.0, block);
                }
                Err(AllocError::OutOfMemory(_) | AllocError::Device(DeviceError::Driver(_))) => {}
                Err(e) => return Err(format!("malloc({size}): unexpected {e}")),
            },
            Op::Free { pick } => {
                if let Some(p) = self.pick(pick) {
                    self.live.remove(&p);
                    self.alloc.free(DevicePtr(p)).map_err(|e| e.to_string())?;
                }
            }
            Op::RecordStream { pick, stream } => {
                if let Some(p) = self.pick(pick) {
                    self.alloc.record_stream(DevicePtr(p), stream);
                }
            }
            Op::CompleteStream { stream } => self.alloc.device_mut().complete_stream(stream),
            Op::EmptyCache => self.alloc.empty_cache().map_err(|e| e.to_string())?,
            Op::SetConfig { index } => self
                .alloc
                .set_allocator_settings(CONFIGS[index])
                .map_err(|e| e.to_string())?,
            Op::SetFraction { fraction } => self
                .alloc
                .set_memory_fraction(fraction)
                .map_err(|e| e.to_string())?,
            Op::FailNextMalloc { oom } => {
                let error = if oom {
                    DeviceError::OutOfMemory
                } else {
                    DeviceError::Driver("injected".into())
                };
                self.alloc.device_mut().fail_allocation_in(1, error);
            }
        }
        self.alloc.check_invariants()
    }

    /// Frees everything and returns all memory: nothing may stay reserved.
    fn finish(mut self) -> Result<(), String> {
        for p in std::mem::take(&mut self.live).into_keys() {
            self.alloc.free(DevicePtr(p)).map_err(|e| e.to_string())?;
        }
        self.alloc.empty_cache().map_err(|e| e.to_string())?;
        self.alloc.check_invariants()?;
        let stats = self.alloc.memory_stats();
        for key in [
            "reserved_bytes.all.current",
            "allocated_bytes.all.current",
            "active_bytes.all.current",
            "requested_bytes.all.current",
            "segment.all.current",
            "inactive_split.all.current",
        ] {
            if stats[key] != 0 {
                return Err(format!("{key} = {} after freeing everything", stats[key]));
            }
        }
        let device = self.alloc.device();
        if device.stats().used_bytes != 0 || device.reservation_count() != 0 {
            return Err(format!(
                "the device still holds {} bytes and {} reservations ({} bytes mapped)",
                device.stats().used_bytes,
                device.reservation_count(),
                device.mapped_bytes()
            ));
        }
        Ok(())
    }
}

fn run_ops(ops: impl IntoIterator<Item = Op>) -> Result<(), String> {
    let mut run = Run::new();
    for (i, op) in ops.into_iter().enumerate() {
        run.apply(&op)
            .map_err(|e| format!("after op {i} {op:?}: {e}"))?;
    }
    run.finish()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 100, ..ProptestConfig::default() })]

    /// 100 cases × 1000 operations = 10^5 operations per test run.
    #[test]
    fn random_operations_keep_every_invariant(
        raw in prop::collection::vec((any::<u64>(), any::<u64>(), any::<u64>()), 1000)
    ) {
        let ops = raw.into_iter().map(|(k, a, b)| Op::decode(k, a, b));
        if let Err(e) = run_ops(ops) {
            prop_assert!(false, "{}", e);
        }
    }
}

#[test]
fn soak() {
    let Some(total) = std::env::var("GPUMEM_SOAK_OPS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    else {
        return;
    };
    let mut rng = XorShift::new(0x5eed);
    let mut done = 0;
    while done < total {
        // Fresh allocators every 10^5 operations keep the failure, if any, reproducible.
        let n = (total - done).min(100_000);
        let ops: Vec<Op> = (0..n)
            .map(|_| Op::decode(rng.next_u64(), rng.next_u64(), rng.next_u64()))
            .collect();
        if let Err(e) = run_ops(ops) {
            panic!("soak failed after {done} operations: {e}");
        }
        done += n;
    }
    eprintln!("soak: {done} operations, every invariant held");
}

/// The random operations must reach the paths the invariants guard: OOMs, retries, deferred
/// frees, releases and injected driver errors, otherwise the property above proves little.
#[test]
fn random_runs_reach_the_recovery_paths() {
    let mut rng = XorShift::new(7);
    let mut run = Run::new();
    for _ in 0..20_000 {
        let op = Op::decode(rng.next_u64(), rng.next_u64(), rng.next_u64());
        run.apply(&op).expect("invariants hold");
    }
    let stats = run.alloc.memory_stats();
    for key in [
        "num_ooms",
        "num_alloc_retries",
        "num_device_free",
        "num_sync_all_streams",
        "oversize_allocations.allocated",
        "inactive_split.all.allocated",
    ] {
        assert!(stats[key] > 0, "{key} never moved: {stats:?}");
    }
    let sim = run.alloc.device().stats();
    assert!(
        sim.maps > 0 && sim.unmaps > 0,
        "expandable segments never grew and shrank"
    );
    assert!(sim.events_created > 0);
    assert!(stats["allocation.all.allocated"] > 5_000);
    run.finish().expect("everything returns to the driver");
}

#[test]
fn operations_decode_to_every_kind() {
    let mut rng = XorShift::new(1);
    let mut seen = [false; 8];
    for _ in 0..10_000 {
        let op = Op::decode(rng.next_u64(), rng.next_u64(), rng.next_u64());
        let i = match op {
            Op::Malloc { .. } => 0,
            Op::Free { .. } => 1,
            Op::RecordStream { .. } => 2,
            Op::CompleteStream { .. } => 3,
            Op::EmptyCache => 4,
            Op::SetConfig { .. } => 5,
            Op::SetFraction { .. } => 6,
            Op::FailNextMalloc { .. } => 7,
        };
        seen[i] = true;
    }
    assert_eq!(seen, [true; 8]);
    check(&Run::new().alloc);
}
