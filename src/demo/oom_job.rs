//! The demo's job that runs out of memory while its GPU still shows memory free. Its
//! allocator cuts its own share into pieces: a large buffer is freed, then filled with tensors
//! of one size of which every other one is freed, so half the segment is free in holes of one
//! tensor each; a request larger than any hole but smaller than the holes together then fails
//! after every recovery step (the device has less than it left under the process's limit).
//! That is fragmentation: with `expandable_segments:True` the holes' pages go back to the
//! device and the request fits (`tests/it/explain.rs`' `fragment` is the same program). The job
//! holds its memory a while, as a dying job's last moments do, frees it as an exiting process
//! does, and starts again after a pause, as a job under a restart policy does.
//!
//! It is an unmodified PyTorch job as the agent sees one: it pushes what the push hook sends
//! (`memory_stats()`, the largest free block, segments by size, its share of the GPU as a
//! sharing layer's limit, pinned host memory, and at the OOM the observer's figures with each
//! pool's per stream) into the agent's ingest, once a
//! second and at once on the OOM, so the pushed path's series, the OOM's breakdown and the
//! per-pod OOM count are on show. Its pinned host memory is simulated: a pool of
//! [`PINNED_BYTES`] its data loader pins at each start and frees at exit.
//!
//! # Invariants
//! - It asks the simulated device for at most its process limit (the node's share less the
//!   context), so the GPU's used memory stays within its capacity; its OOM's figures add up
//!   to that limit, as PyTorch's observer's do under a memory fraction.
//! - It pushes at most once per [`PUSH_EVERY`] besides the OOM's push, each a payload of one
//!   device within the push schema's bounds (`ingest::payload`).
//! - Each cycle is [`START`], then [`HOLD`] failed, then [`PAUSE`] exited, in the recordings'
//!   time (scaled by the demo's speed); at speed 0 it fails once and stays failed (a still
//!   picture of the OOM).

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use serde_json::{Value, json};

use crate::CachingAllocator;
use crate::allocator::breakdown::PoolFigures;
use crate::allocator::size::PoolKind;
use crate::allocator::{AllocError, SegmentInfo};
use crate::device::{DevicePtr, SimDevice, StreamId};
use crate::sources::AllocatorSource;

/// Where the job's pushes go once the agent's ingest exists (`SimNode::push_to`).
/// It is given the job's pid and the payload.
pub type PushSink = Arc<OnceLock<Box<dyn Fn(u32, &[u8]) + Send + Sync>>>;
/// The least time between two periodic pushes.
pub const PUSH_EVERY: Duration = Duration::from_secs(1);
/// The pinned host memory its data loader holds while it runs.
pub const PINNED_BYTES: u64 = 2 << 30;

/// From a (re)start to the OOM.
pub const START: Duration = Duration::from_secs(2);
/// How long the failed job holds its memory.
pub const HOLD: Duration = Duration::from_secs(20);
/// From the job's exit to its restart.
pub const PAUSE: Duration = Duration::from_secs(10);
/// The pieces the large buffer is cut into (half of them freed).
const PIECES: u64 = 40;

/// Where the job is in its cycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Starting,
    Failed,
    Exited,
}

/// The job, on the replay thread.
pub(super) struct OomJob {
    alloc: CachingAllocator<SimDevice>,
    limit: u64,
    live: Vec<DevicePtr>,
    /// Its pid, GPU and UUID (the NVML view reads its memory off the source's statistics).
    source: Arc<AllocatorSource>,
    phase: Phase,
    since: Instant,
    sink: PushSink,
    seq: u64,
    last_push: Option<Instant>,
    /// The OOM's figures (the observer's), pushed until the next start.
    oom: Option<Value>,
    /// The OOM's own push (`reason: oom`) is still to be sent.
    oom_unsent: bool,
    last_oom_unix_seconds: Option<f64>,
    /// Pinned host memory: in use now, and the driver's allocations and the time they took.
    pinned: u64,
    host_allocs: u64,
    host_frees: u64,
}

impl OomJob {
    /// The job on `alloc` (whose device allows the process `limit` bytes), publishing to
    /// `source`.
    pub(super) fn new(
        alloc: CachingAllocator<SimDevice>,
        limit: u64,
        source: Arc<AllocatorSource>,
        sink: PushSink,
    ) -> OomJob {
        OomJob {
            alloc,
            limit,
            live: Vec::new(),
            source,
            phase: Phase::Starting,
            since: Instant::now(),
            sink,
            seq: 0,
            last_push: None,
            oom: None,
            oom_unsent: false,
            last_oom_unix_seconds: None,
            pinned: 0,
            host_allocs: 0,
            host_frees: 0,
        }
    }

    /// Advances the job by the clock at `speed` and pushes what the hook would.
    pub(super) fn step(&mut self, speed: f64) {
        let elapsed = self.since.elapsed().as_secs_f64() * speed;
        if self.pinned == 0 && self.phase == Phase::Starting {
            // The data loader pins its buffers as the job starts.
            self.pinned = PINNED_BYTES;
            self.host_allocs += 8;
        }
        let next = match self.phase {
            Phase::Starting if speed == 0.0 || elapsed >= START.as_secs_f64() => {
                self.fail();
                // Sent at once, or as soon as the agent takes pushes.
                self.oom_unsent = self.oom.is_some();
                Some(Phase::Failed)
            }
            Phase::Failed if speed > 0.0 && elapsed >= HOLD.as_secs_f64() => {
                self.exit();
                Some(Phase::Exited)
            }
            Phase::Exited if elapsed >= PAUSE.as_secs_f64() => Some(Phase::Starting),
            _ => None,
        };
        if let Some(phase) = next {
            self.phase = phase;
            self.since = Instant::now();
        }
        let due = self.last_push.is_none_or(|t| t.elapsed() >= PUSH_EVERY);
        if let Some(sink) = self.sink.get().filter(|_| self.oom_unsent || due) {
            self.seq += 1;
            let payload = self.payload(self.oom_unsent);
            sink(self.source.pid, payload.to_string().as_bytes());
            self.last_push = Some(Instant::now());
            self.oom_unsent = false;
        }
    }

    /// What the push hook would send now (`urgent`: the OOM's push).
    fn payload(&self, urgent: bool) -> Value {
        let stats: BTreeMap<String, i64> = self.alloc.memory_stats();
        let classes: Vec<Value> = self
            .alloc
            .segments_by_size()
            .iter()
            .map(|c| json!({"size": c.size, "segments": c.segments, "free_bytes": c.free_bytes}))
            .collect();
        let mut device = json!({
            "index": self.source.gpu,
            "uuid": self.source.uuid,
            "stats": stats,
            "largest_free_block": self.alloc.largest_free_block(),
            "segments_by_size": classes,
            // Its share of the GPU, as a sharing layer (HAMi) would set it in its environment.
            "memory_limit": {"bytes": self.limit, "variable": "CUDA_DEVICE_MEMORY_LIMIT_0"},
        });
        if let Some(oom) = &self.oom {
            device["oom"] = oom.clone();
        }
        let mut payload = json!({
            "pid": self.source.pid,
            "seq": self.seq,
            "torch_version": "2.11.0",
            "alloc_conf": "",
            "devices": [device],
            "host": {
                "allocated_bytes.current": self.pinned,
                "allocations.current": if self.pinned > 0 { 8 } else { 0 },
                "active_bytes.current": self.pinned / 2,
                "active_requests.current": if self.pinned > 0 { 4 } else { 0 },
                "num_host_alloc": self.host_allocs,
                "num_host_free": self.host_frees,
                // About 2 ms to pin each buffer.
                "host_alloc_time.total": self.host_allocs * 2_000,
            },
        });
        if let Some(t) = self.last_oom_unix_seconds {
            payload["last_oom_unix_seconds"] = json!(t);
        }
        if urgent {
            payload["reason"] = json!("oom");
        }
        payload
    }

    /// Cuts the job's memory into pieces until a request fails; its explanation published.
    fn fail(&mut self) {
        let s = StreamId::DEFAULT;
        // Pieces of 2 MiB multiples: the buffer's segment is exactly the pieces.
        let piece = (self.limit / (PIECES + PIECES / 4) / (2 << 20) * (2 << 20)).max(2 << 20);
        let mut run = || -> Result<(), AllocError> {
            let buffer = self.alloc.malloc(piece * PIECES, s)?;
            self.alloc.free(buffer)?;
            // Each piece kept as it comes, so that an exit frees whatever was made.
            let first = self.live.len();
            for _ in 0..PIECES {
                let p = self.alloc.malloc(piece, s)?;
                self.live.push(p);
            }
            let pieces: Vec<DevicePtr> = self.live.drain(first..).collect();
            for (i, p) in pieces.into_iter().enumerate() {
                if i % 2 == 0 {
                    self.alloc.free(p)?;
                } else {
                    self.live.push(p);
                }
            }
            // One piece more than the room the limit leaves (so larger than any hole), less
            // than the holes together.
            let room = self.limit.saturating_sub(piece * PIECES);
            let request = room + piece;
            if request >= piece * (PIECES / 2) {
                tracing::warn!(
                    pid = self.source.pid,
                    limit = self.limit,
                    "the demo's OOM job has too little memory to fragment"
                );
                return Ok(());
            }
            let p = self.alloc.malloc(request, s)?;
            self.live.push(p);
            Ok(())
        };
        match run() {
            Err(AllocError::OutOfMemory(oom)) => {
                self.last_oom_unix_seconds = SystemTime::now()
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .ok()
                    .map(|d| d.as_secs_f64());
                // What PyTorch's observer is given (the segment it tried to obtain, the
                // process's limit as under a memory fraction, what the limit left free) and
                // what the hook reads off the snapshot.
                let reserved = self.alloc.total_allocated_memory();
                self.oom = Some(json!({
                    "size": oom.tried_to_allocate.div_ceil(2 << 20) * (2 << 20),
                    "stream": 0,
                    "device_total": self.limit,
                    "device_free": self.limit.saturating_sub(reserved),
                    "pools": pools(&self.alloc.segment_infos()),
                }));
            }
            Ok(()) => tracing::warn!(
                pid = self.source.pid,
                "the demo's OOM job did not run out of memory"
            ),
            Err(e) => {
                tracing::warn!(pid = self.source.pid, error = %e, "the demo's OOM job failed")
            }
        }
    }

    /// Frees everything and gives the memory back, as an exiting process's does.
    fn exit(&mut self) {
        self.oom = None;
        self.pinned = 0;
        self.host_frees += 8;
        for p in self.live.drain(..) {
            if let Err(e) = self.alloc.free(p) {
                tracing::warn!(pid = self.source.pid, error = %e, "the demo's OOM job could not free");
            }
        }
        if let Err(e) = self.alloc.empty_cache() {
            tracing::warn!(pid = self.source.pid, error = %e, "the demo's OOM job kept its cache");
        }
    }
}

/// Each (pool, stream, private) entry of the OOM push: what the hook reads off the snapshot.
fn pools(segments: &[SegmentInfo]) -> Vec<Value> {
    let mut by: BTreeMap<(bool, u64, bool), PoolFigures> = BTreeMap::new();
    for s in segments {
        let large = s.segment_type == PoolKind::Large;
        let blocks = s.blocks.iter().map(|b| (b.size, b.requested_size, b.state));
        by.entry((large, s.stream.0, !s.segment_pool_id.is_default()))
            .or_default()
            .add(&PoolFigures::of_blocks(blocks));
    }
    by.into_iter()
        .map(|((large, stream, private), f)| {
            json!({
                "pool": if large { "large" } else { "small" },
                "stream": stream,
                "private": private,
                "allocated": f.allocated,
                "requested": f.requested,
                "pending_free": f.pending_free,
                "free": f.free,
                "largest_free": f.largest_free,
                "segments_with_free": f.segments_with_free,
            })
        })
        .collect()
}
