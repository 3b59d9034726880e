//! Random operations on a caching allocator over a simulated GPU, and a driver that applies
//! them while modelling the live allocations: shared by the property tests and the fuzzer
//! (`fuzz/fuzz_targets/allocator_ops.rs`), so both explore the same operations.
//!
//! # Invariants
//! - Every operation is valid to apply in any state (a free or `record_stream` picks among
//!   the live allocations, or does nothing when there are none).
//! - [`Run::apply`] fails on the first overlapping or undersized hand-out or broken
//!   invariant; [`Run::finish`] on anything left with the driver.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::allocator::{
    AllocError, FitOrder, Plan, PlanEntry, PlanMode, PlanRegion, PoolId, PoolOptions, RouteKind,
    ShareableHandle, StreamFilter,
};
use crate::device::{DeviceError, SimConfig, SimDevice};
use crate::rng::XorShift;
use crate::{AllocatorConfig, CachingAllocator, DevicePtr, StreamId};

const MIB: u64 = 1 << 20;

/// Streams the operations use.
pub const STREAMS: u64 = 3;

/// Configurations switched between at run time. Each parse resets the three fragmentation
/// knobs and keeps `expandable_segments` unless it is named, so expandable segments come and
/// go while blocks of both kinds are live.
pub const CONFIGS: [&str; 9] = [
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

/// One operation on the allocator (or its simulated device).
#[derive(Clone, Debug)]
pub enum Op {
    /// `malloc(size, stream)`.
    Malloc {
        /// Bytes.
        size: u64,
        /// Stream.
        stream: StreamId,
    },
    /// Frees the live allocation `pick` selects.
    Free {
        /// Which (modulo the live count, in address order).
        pick: u64,
    },
    /// `record_stream` on the live allocation `pick` selects.
    RecordStream {
        /// Which.
        pick: u64,
        /// The using stream.
        stream: StreamId,
    },
    /// The device places its next segment (or reservation) at a slot out of creation order,
    /// so that the counter orders and the address order differ; a slot that is taken makes
    /// that placement fail as out of memory.
    HintAddress {
        /// Which 1 GiB slot of the simulated address space.
        slot: u64,
    },
    /// The device completes the work queued on `stream`.
    CompleteStream {
        /// The stream.
        stream: StreamId,
    },
    /// `empty_cache()`.
    EmptyCache,
    /// `set_allocator_settings(CONFIGS[index])`.
    SetConfig {
        /// Into [`CONFIGS`].
        index: usize,
    },
    /// `set_memory_fraction(fraction)`.
    SetFraction {
        /// The fraction.
        fraction: f64,
    },
    /// The device's next allocation fails (out of memory, or another driver error).
    FailNextMalloc {
        /// Out of memory rather than a driver error.
        oom: bool,
    },
    /// Follows a random placement plan ([`random_plan`] of `seed`); refused, and ignored,
    /// while the current plan's region holds live blocks.
    SetPlan {
        /// The plan's seed.
        seed: u64,
    },
    /// `malloc` of the plan's entry `skip % 3` past the one the model expects next (0: the
    /// plan followed; else a job that diverges from it); a plain malloc without a plan.
    MallocPlanned {
        /// Entries skipped.
        skip: u64,
        /// Bytes below the entry's size asked for (its rounding must still match).
        under: u64,
    },
    /// Makes MemPool [`pool_id`]`(pool)` or adds a use to it.
    CreatePool {
        /// Which of the few pools.
        pool: u64,
        /// Its options.
        options: PoolOptions,
    },
    /// Routes requests to pool [`pool_id`]`(pool)`: all streams, or one as a capture.
    BeginPool {
        /// Which pool.
        pool: u64,
        /// `Some(stream)`: a capture of that stream; `None`: `use_mem_pool`.
        capture: Option<StreamId>,
    },
    /// Ends the route to pool [`pool_id`]`(pool)`.
    EndPool {
        /// Which pool.
        pool: u64,
    },
    /// Takes a use from pool [`pool_id`]`(pool)`.
    ReleasePool {
        /// Which pool.
        pool: u64,
    },
}

/// The private pools the operations use: three MemPools `(0, n)` and two capture pools
/// `(n, 0)`.
pub fn pool_id(pool: u64) -> PoolId {
    match pool % 5 {
        n @ 0..=2 => PoolId(0, n + 1),
        n => PoolId(n - 2, 0),
    }
}

/// A random but valid plan: up to 24 entries over the [`STREAMS`], regions of up to 256 MiB,
/// offsets anywhere inside them (so entries may overlap: a bad plan); of the entries without
/// an offset (a tenth, and those of streams without a region), half are persistent, and a
/// fifth of those with one are persistent entries tried there first; whole or paged alike;
/// what it saved unknown, nothing, or up to 64 MiB (misses' segments held to it).
pub fn random_plan(seed: u64) -> Plan {
    let mut rng = XorShift::new(seed | 1);
    let mut regions: Vec<PlanRegion> = Vec::new();
    for stream in (0..STREAMS).map(StreamId) {
        if !rng.next_u64().is_multiple_of(4) {
            let bytes = (1 + rng.next_u64() % (256 * MIB / 512)) * 512;
            regions.push(PlanRegion { stream, bytes });
        }
    }
    let entries = (0..1 + rng.next_u64() % 24)
        .map(|_| {
            let stream = StreamId(rng.next_u64() % STREAMS);
            let size = match rng.next_u64() % 4 {
                0 | 1 => 512 * (1 + rng.next_u64() % 2048),
                2 => MIB + 512 * (rng.next_u64() % (18 * 2048)),
                _ => 10 * MIB + 512 * (rng.next_u64() % (180 * 2048)),
            };
            let region = regions.iter().find(|r| r.stream == stream);
            let offset = region
                .filter(|r| r.bytes >= size && !rng.next_u64().is_multiple_of(10))
                .map(|r| 512 * (rng.next_u64() % ((r.bytes - size) / 512 + 1)));
            PlanEntry {
                size,
                stream,
                offset,
                persistent: rng
                    .next_u64()
                    .is_multiple_of(if offset.is_none() { 2 } else { 5 }),
            }
        })
        .collect();
    let mode = if rng.next_u64().is_multiple_of(2) {
        PlanMode::Whole
    } else {
        PlanMode::Paged
    };
    let saved_bytes = match rng.next_u64() % 3 {
        0 => None,
        1 => Some(0),
        _ => Some(rng.next_u64() % (64 * MIB)),
    };
    Plan {
        regions,
        entries,
        mode,
        saved_bytes,
    }
}

impl Op {
    /// Decodes three random numbers into an operation; mallocs (a third of them a plan's
    /// entries) and frees dominate.
    pub fn decode(kind: u64, a: u64, b: u64) -> Op {
        let stream = StreamId(b % STREAMS);
        match kind % 100 {
            0..=29 => {
                // Sizes spread over the small pool, the 20 MiB class and the large class.
                let size = match a % 10 {
                    0..=4 => 1 + (a >> 8) % MIB,
                    5..=7 => MIB + (a >> 8) % (9 * MIB),
                    8 => 10 * MIB + (a >> 8) % (90 * MIB),
                    _ => 100 * MIB + (a >> 8) % (300 * MIB),
                };
                Op::Malloc { size, stream }
            }
            30..=39 => Op::MallocPlanned {
                skip: a,
                under: (a >> 8) % 512,
            },
            40..=67 => Op::Free { pick: a },
            68 => Op::CreatePool {
                pool: a,
                options: PoolOptions {
                    use_on_oom: (a >> 8).is_multiple_of(2),
                    no_split: (a >> 9).is_multiple_of(4),
                },
            },
            69 => Op::BeginPool {
                pool: a,
                capture: (b >> 8).is_multiple_of(2).then_some(stream),
            },
            // Routes end soon (most requests still meet the plan) and uses go about as
            // often as they come (pools do not keep all memory).
            70..=73 => Op::EndPool { pool: a },
            74..=76 => Op::ReleasePool { pool: a },
            77..=84 => Op::RecordStream { pick: a, stream },
            85 => Op::HintAddress { slot: a % 64 },
            86..=91 => Op::CompleteStream { stream },
            92 | 94 => Op::EmptyCache,
            93 => Op::SetPlan { seed: a },
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
pub struct Run {
    /// The allocator, on a 2 GiB simulated device (unless made by [`Run::on`]).
    pub alloc: CachingAllocator<SimDevice>,
    /// Live pointers → block size, to check that hand-outs never overlap.
    live: BTreeMap<u64, u64>,
    /// The plan set last and the entry the model expects next.
    plan: Option<(Arc<Plan>, usize)>,
}

impl Default for Run {
    fn default() -> Self {
        Run::new()
    }
}

impl Run {
    /// A fresh allocator with the default configuration (and so PyTorch 2.15's order).
    pub fn new() -> Self {
        Run::with_order(FitOrder::default())
    }

    /// A fresh allocator with the default configuration whose pools follow `order`.
    pub fn with_order(order: FitOrder) -> Self {
        Run::on(order, SimConfig::with_capacity(2 << 30))
    }

    /// A fresh allocator with the default configuration whose pools follow `order`, on a
    /// device configured as `device`.
    pub fn on(order: FitOrder, device: SimConfig) -> Self {
        let config = AllocatorConfig::default();
        let device = SimDevice::new(device);
        Run {
            alloc: CachingAllocator::with_fit_order(device, config, order),
            live: BTreeMap::new(),
            plan: None,
        }
    }

    /// The handle a live block exports covers it: its offset leads from the exported
    /// memory's start to the block, and the block ends within it (Note [IPC handles]).
    fn check_share_handle(&self, ptr: DevicePtr) -> Result<(), String> {
        let handle = self.alloc.share_handle(ptr).map_err(|e| e.to_string())?;
        let size = self
            .alloc
            .block_size(ptr)
            .ok_or("a live block has a size")?;
        let exact = match handle {
            // The pages from the one holding its first byte to the one holding its last.
            ShareableHandle::Pages {
                page_size, pages, ..
            } => handle.offset() < page_size && handle.offset() + size > (pages - 1) * page_size,
            // The whole segment, from its base: the block there exports the same start.
            ShareableHandle::Segment { base, .. } => self
                .alloc
                .share_handle(base)
                .ok()
                .is_none_or(|h| h.start() == base),
        };
        let covers = exact
            && handle.start().0.checked_add(handle.offset()) == Some(ptr.0)
            && handle.offset() + size <= handle.mapped_bytes();
        if covers {
            Ok(())
        } else {
            Err(format!(
                "{ptr:?} ({size} bytes) is not covered by {handle:?}"
            ))
        }
    }

    fn pick(&self, pick: u64) -> Option<u64> {
        if self.live.is_empty() {
            return None;
        }
        let i = (pick % self.live.len() as u64) as usize;
        self.live.keys().nth(i).copied()
    }

    /// Applies `op`, then checks that hand-outs fit and do not overlap and that every
    /// invariant holds.
    ///
    /// # Errors
    /// What went wrong.
    pub fn apply(&mut self, op: &Op) -> Result<(), String> {
        match *op {
            Op::Malloc { size, stream } => self.malloc(size, stream)?,
            Op::MallocPlanned { skip, under } => {
                let Some((plan, next)) = &mut self.plan else {
                    return self.apply(&Op::Malloc {
                        size: skip % (4 * MIB) + 1,
                        stream: StreamId(0),
                    });
                };
                let i = (*next + (skip % 3) as usize) % plan.entries.len();
                *next = (i + 1) % plan.entries.len();
                let e = plan.entries[i];
                self.malloc(e.size - under.min(511), e.stream)?;
            }
            Op::SetPlan { seed } => {
                let plan = Arc::new(random_plan(seed));
                match self.alloc.set_plan(plan.clone()) {
                    Ok(()) => self.plan = Some((plan, 0)),
                    Err(AllocError::Plan(_)) => {}
                    Err(e) => return Err(format!("set_plan: unexpected {e}")),
                }
            }
            Op::Free { pick } => {
                if let Some(p) = self.pick(pick) {
                    self.live.remove(&p);
                    self.alloc.free(DevicePtr(p)).map_err(|e| e.to_string())?;
                }
            }
            Op::RecordStream { pick, stream } => {
                if let Some(p) = self.pick(pick) {
                    self.alloc.record_stream(DevicePtr(p), stream);
                    self.check_share_handle(DevicePtr(p))?;
                }
            }
            Op::HintAddress { slot } => {
                let base = self.alloc.device().config().base_address;
                self.alloc
                    .device_mut()
                    .hint_addresses([base + (slot << 30)]);
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
            Op::CreatePool { pool, options } => {
                pool_op(self.alloc.create_pool(pool_id(pool), options))?;
            }
            Op::BeginPool { pool, capture } => {
                let (filter, kind) = match capture {
                    Some(stream) => (StreamFilter::Streams(vec![stream]), RouteKind::Capture),
                    None => (StreamFilter::Any, RouteKind::MemPool),
                };
                pool_op(
                    self.alloc
                        .begin_allocate_to_pool(pool_id(pool), filter, kind),
                )?;
            }
            Op::EndPool { pool } => pool_op(self.alloc.end_allocate_to_pool(pool_id(pool)))?,
            Op::ReleasePool { pool } => pool_op(self.alloc.release_pool(pool_id(pool)))?,
            Op::FailNextMalloc { oom } => {
                let error = if oom {
                    DeviceError::OutOfMemory
                } else {
                    DeviceError::Driver("injected".into())
                };
                self.alloc.device_mut().fail_allocation_in(1, error);
            }
        }
        self.alloc.check_invariants().map_err(|e| e.to_string())
    }

    fn malloc(&mut self, size: u64, stream: StreamId) -> Result<(), String> {
        match self.alloc.malloc(size, stream) {
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
                Ok(())
            }
            Err(AllocError::OutOfMemory(_) | AllocError::Device(DeviceError::Driver(_))) => Ok(()),
            Err(e) => Err(format!("malloc({size}): unexpected {e}")),
        }
    }

    /// Frees everything and returns all memory: nothing may stay reserved.
    ///
    /// # Errors
    /// What was left behind.
    pub fn finish(mut self) -> Result<(), String> {
        for p in std::mem::take(&mut self.live).into_keys() {
            self.alloc.free(DevicePtr(p)).map_err(|e| e.to_string())?;
        }
        // Every route ends and every pool loses its uses, so the flush frees them all.
        for id in self.alloc.private_pools() {
            pool_op(self.alloc.end_allocate_to_pool(id))?;
            while self.alloc.pool_use_count(id).is_some_and(|n| n > 0) {
                self.alloc.release_pool(id).map_err(|e| e.to_string())?;
            }
        }
        self.alloc.empty_cache().map_err(|e| e.to_string())?;
        self.alloc.clear_plan().map_err(|e| e.to_string())?;
        self.alloc.check_invariants().map_err(|e| e.to_string())?;
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

/// A pool operation's result: refusals (an unknown pool, a pool routed twice) are expected.
fn pool_op(result: Result<(), AllocError>) -> Result<(), String> {
    match result {
        Ok(()) | Err(AllocError::Pool(_)) => Ok(()),
        Err(e) => Err(format!("pool operation: unexpected {e}")),
    }
}

/// The order a fuzzer input's first byte picks.
pub fn order_from_byte(byte: u8) -> FitOrder {
    ORDERS[usize::from(byte) % ORDERS.len()]
}

/// Every order, for tests that run under each.
pub const ORDERS: [FitOrder; 3] = [FitOrder::Address, FitOrder::BlockCounter, FitOrder::Counter];

/// Operations from bytes (the fuzzer's input): ten bytes each (kind, eight bytes of
/// argument, stream); a shorter tail is ignored.
pub fn from_bytes(data: &[u8]) -> impl Iterator<Item = Op> + '_ {
    data.chunks_exact(10).map(|c| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&c[1..9]);
        Op::decode(u64::from(c[0]), u64::from_le_bytes(a), u64::from(c[9]))
    })
}
