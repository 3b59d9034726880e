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
//! # Invariants
//! - It asks the simulated device for at most its process limit (the node's share less the
//!   context), so the GPU's used memory stays within its capacity.
//! - Each cycle is [`START`], then [`HOLD`] failed, then [`PAUSE`] exited, in the recordings'
//!   time (scaled by the demo's speed); at speed 0 it fails once and stays failed (a still
//!   picture of the OOM).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime};

use crate::CachingAllocator;
use crate::allocator::AllocError;
use crate::device::{DevicePtr, SimDevice, StreamId};
use crate::sources::{AllocatorSource, LastOom};

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
    source: Arc<AllocatorSource>,
    phase: Phase,
    since: Instant,
}

impl OomJob {
    /// The job on `alloc` (whose device allows the process `limit` bytes), publishing to
    /// `source`.
    pub(super) fn new(
        alloc: CachingAllocator<SimDevice>,
        limit: u64,
        source: Arc<AllocatorSource>,
    ) -> OomJob {
        OomJob {
            alloc,
            limit,
            live: Vec::new(),
            source,
            phase: Phase::Starting,
            since: Instant::now(),
        }
    }

    /// Advances the job by the clock at `speed` and publishes what its owner publishes.
    pub(super) fn step(&mut self, speed: f64) {
        let elapsed = self.since.elapsed().as_secs_f64() * speed;
        let next = match self.phase {
            Phase::Starting if speed == 0.0 || elapsed >= START.as_secs_f64() => {
                self.fail();
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
        self.source
            .largest_free_block
            .store(self.alloc.largest_free_block(), Ordering::Relaxed);
        if self.source.segments.wanted() {
            self.source.segments.publish(self.alloc.segment_infos());
        }
        *self
            .source
            .segment_classes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = self.alloc.segments_by_size();
    }

    /// Cuts the job's memory into pieces until a request fails; its explanation published.
    fn fail(&mut self) {
        let s = StreamId::DEFAULT;
        // Pieces of 2 MiB multiples: the buffer's segment is exactly the pieces.
        let piece = (self.limit / (PIECES + PIECES / 4) / (2 << 20) * (2 << 20)).max(2 << 20);
        let mut run = || -> Result<(), AllocError> {
            let buffer = self.alloc.malloc(piece * PIECES, s)?;
            self.alloc.free(buffer)?;
            let pieces: Vec<DevicePtr> = (0..PIECES)
                .map(|_| self.alloc.malloc(piece, s))
                .collect::<Result<_, _>>()?;
            for (i, p) in pieces.into_iter().enumerate() {
                if i % 2 == 0 {
                    self.alloc.free(p)?;
                } else {
                    self.live.push(p);
                }
            }
            // Larger than the device's room left (a quarter of the pieces' worth) and than
            // any hole, smaller than the holes together.
            let request = piece * (PIECES * 3 / 8);
            let p = self.alloc.malloc(request, s)?;
            self.live.push(p);
            Ok(())
        };
        match run() {
            Err(AllocError::OutOfMemory(oom)) => {
                let now = SystemTime::now()
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64());
                *self
                    .source
                    .last_oom
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(LastOom {
                    at_unix_seconds: Some(now),
                    ..LastOom::from(&*oom)
                });
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
