//! What a replay reports: the peaks and counters over the trace, the decisions compared and
//! the first divergence (check mode), and memory over time.
//!
//! # Invariants
//! - Counters and peaks cover the trace only (reset after the start state is loaded); a
//!   report's `capacity` is the device memory actually replayed on.

use serde::Serialize;

use crate::allocator::{TraceAction, TraceEntry};

/// Decisions compared with the recording, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Compared {
    /// `alloc` addresses.
    pub allocs: u64,
    /// `free_requested` and `free_completed` events.
    pub frees: u64,
    /// `segment_alloc` sizes and addresses.
    pub segment_allocs: u64,
    /// `segment_free` events, in burst order.
    pub segment_frees: u64,
    /// `segment_map` and `segment_unmap` ranges.
    pub segment_maps: u64,
    /// `oom` events.
    pub ooms: u64,
    /// `snapshot` markers (active bytes).
    pub snapshots: u64,
}

impl Compared {
    /// All decisions compared.
    pub fn total(&self) -> u64 {
        self.allocs
            + self.frees
            + self.segment_allocs
            + self.segment_frees
            + self.segment_maps
            + self.ooms
            + self.snapshots
    }
}

/// The first point where the core decided differently from the recording.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Divergence {
    /// Index of the recorded event in the device's trace.
    pub index: usize,
    /// The recorded event.
    pub expected: String,
    /// What the core did instead.
    pub actual: String,
    /// Recorded events around the divergence and the allocator's state.
    pub context: Vec<String>,
}

/// One sample of memory over the trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SeriesPoint {
    /// Index of the recorded event.
    pub event: usize,
    /// The most allocated bytes since the previous point.
    pub allocated: u64,
    /// The most reserved bytes since the previous point.
    pub reserved: u64,
    /// The event's time (microseconds), where the recording has it.
    pub time_us: Option<u64>,
}

/// What a replay did.
#[derive(Clone, Debug, Serialize)]
pub struct ReplayReport {
    /// The configuration string replayed under.
    pub config: String,
    /// Recorded events processed.
    pub events: usize,
    /// Segments in the rebuilt start state.
    pub start_segments: usize,
    /// Peak allocated bytes (start state included).
    pub peak_allocated: u64,
    /// Peak reserved bytes (start state included).
    pub peak_reserved: u64,
    /// Driver allocations (`cudaMalloc` or page maps) during the trace.
    pub device_allocs: u64,
    /// Driver frees during the trace.
    pub device_frees: u64,
    /// Allocations that flushed the cache and retried.
    pub alloc_retries: u64,
    /// Allocations that failed.
    pub ooms: u64,
    /// Requests a placement plan served from its regions and chunks, while followed.
    pub plan_hits: u64,
    /// Requests a placement plan, while followed, left to the caching allocator: no free
    /// block of its memory held them.
    pub plan_misses: u64,
    /// What the followed plan did: iterations, the cache given back, and where its regions
    /// and chunks are paged (a device with virtual memory), their maps and unmaps.
    pub plan_paging: Option<crate::allocator::PlanPaging>,
    /// Simulated time spent in driver calls during the trace, in nanoseconds, priced by the
    /// session's table ([`crate::device::DriverCosts`]).
    pub driver_time_ns: u64,
    /// Driver calls made during the trace to obtain, map or give back memory, one per CUDA
    /// call ([`crate::device::SimStats::driver_calls`]).
    pub driver_calls: u64,
    /// Decisions compared (check mode).
    pub compared: Compared,
    /// The first divergence (check mode).
    pub divergence: Option<Divergence>,
    /// Memory over the trace, if asked for.
    pub series: Vec<SeriesPoint>,
    /// The device memory replayed on (`--capacity`, the recording's own, inferred, or the
    /// default).
    pub capacity: u64,
    /// Whether `capacity` was inferred from the spacing of the recording's expandable
    /// reservations (neither the user nor the recording said).
    pub capacity_inferred: bool,
    /// Where a what-if replayed within the memory the job had at its first OOM (it was given
    /// no `available` of its own): that memory and how it was read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job_memory: Option<super::JobMemory>,
    /// The best-fit order replayed under and how it was chosen (Note [Finding the order]).
    pub ordering: super::OrderingReport,
    /// What the replay could not follow of the configuration, in sentences: options of the
    /// recorded settings string it skipped, values PyTorch ignores, a per-class reserve
    /// replayed as the default, a device size not inferred.
    pub notes: Vec<String>,
    /// Where the trace records no pools and the snapshot shows private ones: how the
    /// events' pools were inferred (Note [Inferred pools]).
    pub inferred_pools: Option<crate::recording::event_pools::InferredPools>,
}

impl ReplayReport {
    /// Peak reserved over peak allocated: what fragmentation and caching cost.
    pub fn reserved_ratio(&self) -> f64 {
        self.peak_reserved as f64 / self.peak_allocated.max(1) as f64
    }
}

/// An event in words, for divergence reports.
pub(super) fn describe(e: &TraceEntry) -> String {
    let (action, addr, size, stream) = (e.action, e.addr, e.size, e.stream);
    let name = serde_json::to_value(action)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    let pool = if e.pool.is_default() || action == TraceAction::Snapshot {
        String::new()
    } else {
        format!(" in pool {}", e.pool)
    };
    match action {
        TraceAction::Oom => format!("oom of {size} bytes on stream {stream:#x}{pool}"),
        TraceAction::Snapshot => format!("snapshot with {size} active bytes"),
        _ => format!("{name} at {addr:#x} of {size} bytes on stream {stream:#x}{pool}"),
    }
}
