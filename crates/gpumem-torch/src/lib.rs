//! gpumem's caching allocator as PyTorch's pluggable CUDA allocator.
//!
//! `torch.cuda.memory.CUDAPluggableAllocator("libgpumem_torch.so", "gpumem_alloc",
//! "gpumem_free")` loads these entry points (the Python helper in `python/gpumem_torch` does
//! it). Each device gets one thread-safe allocator, created on first use and configured from
//! `GPUMEM_ALLOC_CONF` (the `PYTORCH_CUDA_ALLOC_CONF` syntax, plus gpumem's `plan:PATH`: each
//! device's allocator follows the placement plan `gpumem plan` wrote there, or
//! `plan_record:N`: each device's allocator records its first N trace events, plans them on
//! a thread of its own, as `gpumem plan` would, and then follows the plan, switched to under
//! the allocator's lock; misses fall back to the caching allocator, as with a plan file). With
//! `GPUMEM_METRICS_LISTEN` set (for example `127.0.0.1:9418`), a background thread serves the
//! allocators' counters on `/metrics`, with the agent's metric contract, and the agent's live
//! page at `/` with the segment maps of this job's allocators (`GPUMEM_METRICS_UI=off` turns
//! the page off). Like the agent it answers only requests addressed to an IP address or a
//! loopback name, or to a name listed in `GPUMEM_METRICS_ALLOW_HOST` (comma-separated: a
//! Service's DNS name a scrape goes through). It never waits for an allocator's lock: figures are read with `try_lock`
//! once a second (a segment list, O(blocks) under the lock, only while the page asks for it).
//!
//! # CUDA graphs and MemPools
//! PyTorch's pluggable allocator interface takes `alloc` and `free` from a library; a graph
//! capture's private pool (`beginAllocateToPool`, `endAllocateToPool`, `releasePool`) reaches
//! only hooks set from C++. Without it, memory handed out during a capture would go to other
//! tensors afterwards while the graph's replays still write it. So every allocation on a
//! stream being captured (asked of the driver, `cuStreamIsCapturing`, for any stream but the
//! legacy default one, which cannot be captured) is refused with a report that says why:
//! the capture fails instead of corrupting memory. `torch.cuda.MemPool` and `use_mem_pool`
//! need the same hooks and are not served either. Nor are what the interface leaves out:
//! `memory_snapshot()`, `_record_memory_history`, IPC handles (`share_memory_`, CUDA tensors
//! sent through `torch.multiprocessing`) and PyTorch's out-of-memory observers (gpumem
//! reports its OOMs itself, and on `/metrics`).
//!
//! # Invariants
//! - No panic crosses the C boundary: every entry point catches unwinding and reports it.
//! - A failed allocation returns null (PyTorch then raises its out-of-memory error); a free of
//!   a pointer gpumem does not hold is reported and ignored.

use std::ffi::{c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use gpumem::agent::{Agent, Listen};
use gpumem::allocator::{AllocError, Plan};
use gpumem::config::Syntax;
use gpumem::sources::{AllocatorSource, AllocatorSources};
use gpumem::{AllocatorConfig, CachingAllocator, DevicePtr, SharedAllocator, StreamId};

#[cfg(not(any(feature = "cuda", feature = "sim")))]
compile_error!("gpumem-torch needs a backend: the `cuda` feature (real GPUs) or `sim` (tests)");

#[cfg(all(feature = "cuda", not(feature = "sim")))]
mod backend {
    use gpumem::device::{CudaDevice, DeviceError};

    /// The device behind the entry points.
    pub type Device = CudaDevice;

    pub fn open(ordinal: i32) -> Result<Device, DeviceError> {
        CudaDevice::new(ordinal)
    }

    pub fn uuid(device: &Device, ordinal: i32) -> String {
        device
            .uuid()
            .unwrap_or_else(|_| format!("GPU-unknown-{ordinal}"))
    }
}

#[cfg(feature = "sim")]
mod backend {
    use gpumem::device::{DeviceError, SimConfig, SimDevice};

    /// The device behind the entry points: simulated, sized by `GPUMEM_SIM_CAPACITY` bytes
    /// (default 80 GiB).
    pub type Device = SimDevice;

    pub fn open(ordinal: i32) -> Result<Device, DeviceError> {
        let capacity = std::env::var("GPUMEM_SIM_CAPACITY")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(80 << 30);
        Ok(SimDevice::new(SimConfig {
            index: u32::try_from(ordinal)
                .map_err(|_| DeviceError::InvalidArgument(format!("device {ordinal}")))?,
            ..SimConfig::with_capacity(capacity)
        }))
    }

    pub fn uuid(_device: &Device, ordinal: i32) -> String {
        gpumem::device::simulated_uuid(ordinal.max(0) as u32)
    }
}

/// Devices a process can use.
const MAX_DEVICES: usize = 64;

struct DeviceSlot {
    allocator: SharedAllocator<backend::Device>,
    /// What the metrics server exports for it (the figures the lock-free stats lack).
    source: Arc<AllocatorSource>,
    /// `plan_record:N`: the allocator plans itself.
    self_plan: Option<SelfPlan>,
}

/// A device's allocator planning itself (`plan_record:N`).
struct SelfPlan {
    /// Trace events to record before planning.
    events: usize,
    /// [`RECORDING`], [`PLANNING`] or [`SETTLED`].
    state: AtomicU8,
    /// The configuration (its rounding shapes the plan).
    config: AllocatorConfig,
}

/// Recording the trace.
const RECORDING: u8 = 0;
/// The trace is being planned on the planner's thread.
const PLANNING: u8 = 1;
/// Following the plan, or running without one (reported).
const SETTLED: u8 = 2;

static SLOTS: [OnceLock<Option<DeviceSlot>>; MAX_DEVICES] =
    [const { OnceLock::new() }; MAX_DEVICES];
static SOURCES: OnceLock<AllocatorSources> = OnceLock::new();

fn report(message: &str) {
    eprintln!("gpumem: {message}");
}

fn config() -> AllocatorConfig {
    let text = std::env::var("GPUMEM_ALLOC_CONF").unwrap_or_default();
    AllocatorConfig::parse_as(&text, Syntax::Gpumem).unwrap_or_else(|e| {
        report(&format!("{e}; using the default configuration"));
        AllocatorConfig::default()
    })
}

/// The plan `plan:PATH` names, read once for every device; `None` (reported) if it cannot
/// be read: the allocators then run without it.
fn plan(path: &str) -> Option<Arc<Plan>> {
    static PLAN: OnceLock<Option<Arc<Plan>>> = OnceLock::new();
    PLAN.get_or_init(
        || match gpumem::plan::read_plan_file(std::path::Path::new(path)) {
            Ok(file) => Some(Arc::new(file.plan())),
            Err(e) => {
                report(&format!("{e}; running without a plan"));
                None
            }
        },
    )
    .clone()
}

/// The allocator of `device`, created on first use; `None` if the device cannot be opened or
/// its allocator was left half updated by an internal error (then every later call is
/// refused rather than served from an inconsistent state).
fn slot(device: c_int) -> Option<&'static DeviceSlot> {
    let index = usize::try_from(device).ok().filter(|&i| i < MAX_DEVICES)?;
    let slot = SLOTS[index]
        .get_or_init(|| match backend::open(device) {
            Ok(dev) => {
                let uuid = backend::uuid(&dev, device);
                let config = config();
                let settings = config.last_settings.clone();
                let planned = config.plan.as_deref().and_then(plan);
                let self_plan = config.plan_record.map(|events| SelfPlan {
                    events,
                    state: AtomicU8::new(RECORDING),
                    config: config.clone(),
                });
                let mut core = CachingAllocator::new(dev, config);
                if let Some(sp) = &self_plan {
                    core.record_history(Some(sp.events));
                }
                if let Some(plan) = planned
                    && let Err(e) = core.set_plan(plan)
                {
                    report(&format!("device {device}: {e}; running without a plan"));
                }
                let allocator = SharedAllocator::new(core);
                let source = Arc::new(AllocatorSource::of_gpumem(
                    device as u32,
                    uuid,
                    std::process::id(),
                    settings,
                    Arc::clone(allocator.stats()),
                ));
                register_metrics(Arc::clone(&source));
                Some(DeviceSlot {
                    allocator,
                    source,
                    self_plan,
                })
            }
            Err(e) => {
                report(&format!("cannot open CUDA device {device}: {e}"));
                None
            }
        })
        .as_ref()?;
    if slot.allocator.is_poisoned() {
        report(&format!(
            "device {device}: refusing calls after an internal error"
        ));
        return None;
    }
    Some(slot)
}

/// Runs `f`, turning a panic into `fallback` and a report.
fn guarded<T>(what: &str, fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        report(&format!("internal error in {what}; the call was refused"));
        fallback
    })
}

/// Allocates `size` bytes on `device` for use on `stream` (PyTorch's pluggable `alloc`).
/// Returns null when the memory cannot be provided.
// SAFETY: `gpumem_` names no other symbol in a PyTorch process, and the signature is the
// pluggable allocator's `alloc` (size_t, int, cudaStream_t) -> void*, as PyTorch calls it.
#[allow(unsafe_code)] // the exported symbol (`no_mangle`)
#[unsafe(no_mangle)]
pub extern "C" fn gpumem_alloc(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void {
    let stream = StreamId(stream as usize as u64);
    guarded("gpumem_alloc", std::ptr::null_mut(), || {
        let Some(slot) = slot(device) else {
            return std::ptr::null_mut();
        };
        let served = slot.allocator.with(|a| {
            let served = malloc_outside_capture(a, size as u64, stream);
            if let Some(sp) = &slot.self_plan
                && sp.state.load(Ordering::Relaxed) == RECORDING
                && a.trace_len() >= sp.events
            {
                sp.state.store(PLANNING, Ordering::Relaxed);
                let events = a.take_trace();
                a.record_history(None);
                plan_in_background(slot, sp, device, events);
            }
            served
        });
        match served {
            Ok(ptr) => ptr.0 as usize as *mut c_void,
            Err(Refused::Capturing) => {
                report(&format!(
                    "allocation of {size} bytes refused: stream {:#x} of device {device} is being captured into a CUDA graph. PyTorch's pluggable allocator interface forwards a capture's private pool (beginAllocateToPool) only to hooks set from C++, so gpumem cannot keep the graph's memory apart; without that, memory handed out during capture is given to other tensors afterwards while the graph's replays still write it. Capture graphs (CUDA graphs, torch.compile mode=\"reduce-overhead\") with PyTorch's own allocator.",
                    stream.0
                ));
                std::ptr::null_mut()
            }
            Err(Refused::Device(e)) => {
                report(&format!(
                    "allocation of {size} bytes refused: whether stream {:#x} is being captured into a CUDA graph could not be asked: {e}",
                    stream.0
                ));
                std::ptr::null_mut()
            }
            Err(Refused::Alloc(e)) => alloc_failed(slot, size, e),
        }
    })
}

/// Plans `events` on a thread of its own and has `slot`'s allocator follow the plan (or,
/// reported, run without one). A process forked while the planner runs (CUDA forbids using
/// the device in the child anyway) never gets a plan in the child.
fn plan_in_background(
    slot: &'static DeviceSlot,
    sp: &'static SelfPlan,
    device: c_int,
    events: Vec<gpumem::allocator::TraceEntry>,
) {
    let run = move || {
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            match gpumem::plan::plan_trace(&events, &sp.config) {
                Ok(plan) => {
                    let (entries, regions) = (plan.entries.len(), plan.region_bytes());
                    if slot.allocator.is_poisoned() {
                        return format!("device {device}: the allocator is refusing calls; running without a plan");
                    }
                    match slot.allocator.with(|a| a.set_plan(Arc::new(plan))) {
                        Ok(()) => format!(
                            "device {device}: planned from {} events: {entries} allocations an iteration in {} MiB of regions; following the plan",
                            events.len(),
                            regions >> 20
                        ),
                        Err(e) => format!("device {device}: {e}; running without a plan"),
                    }
                }
                Err(e) => format!("device {device}: {e}; running without a plan"),
            }
        }))
        .unwrap_or_else(|_| {
            format!("device {device}: internal error in the planner; running without a plan")
        });
        report(&outcome);
        sp.state.store(SETTLED, Ordering::Relaxed);
    };
    if let Err(e) = std::thread::Builder::new()
        .name("gpumem-plan".into())
        .spawn(run)
    {
        report(&format!(
            "device {device}: the planner cannot start: {e}; running without a plan"
        ));
        sp.state.store(SETTLED, Ordering::Relaxed);
    }
}

/// Why an allocation was not served.
enum Refused {
    /// The stream is being captured into a CUDA graph (see the module doc).
    Capturing,
    /// The driver could not say whether it is.
    Device(gpumem::device::DeviceError),
    /// The allocator's own error.
    Alloc(AllocError),
}

/// `malloc` of `size` bytes on `stream`, refused while the stream is captured. The legacy
/// default stream (0) cannot be captured, so its requests skip the driver query.
fn malloc_outside_capture(
    a: &mut CachingAllocator<backend::Device>,
    size: u64,
    stream: StreamId,
) -> Result<DevicePtr, Refused> {
    use gpumem::device::Device;
    if stream != StreamId::DEFAULT {
        match a.device_mut().is_capturing(stream) {
            Ok(false) => {}
            Ok(true) => return Err(Refused::Capturing),
            Err(e) => return Err(Refused::Device(e)),
        }
    }
    a.malloc(size, stream).map_err(Refused::Alloc)
}

/// Reports the allocator's refusal of `size` bytes (an OOM's explanation kept for the metrics
/// and the live page); null for PyTorch.
fn alloc_failed(slot: &DeviceSlot, size: usize, error: AllocError) -> *mut c_void {
    match error {
        AllocError::OutOfMemory(oom) => {
            report(&oom.to_string());
            // Its explanation, for the metrics and the live page.
            *slot
                .source
                .last_oom
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) =
                Some(gpumem::sources::LastOom {
                    at_unix_seconds: std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .ok()
                        .map(|d| d.as_secs_f64()),
                    ..gpumem::sources::LastOom::from(&*oom)
                });
        }
        e @ AllocError::TooLarge(_) => report(&e.to_string()),
        e => report(&format!("allocation of {size} bytes failed: {e}")),
    }
    std::ptr::null_mut()
}

/// Frees a pointer from [`gpumem_alloc`] (PyTorch's pluggable `free`). A pointer gpumem does
/// not hold is reported and ignored.
// SAFETY: `gpumem_` names no other symbol in a PyTorch process, and the signature is the
// pluggable allocator's `free` (void*, size_t, int, cudaStream_t); the pointer is only
// looked up, never dereferenced.
#[allow(unsafe_code)] // the exported symbol (`no_mangle`)
#[unsafe(no_mangle)]
pub extern "C" fn gpumem_free(ptr: *mut c_void, size: usize, device: c_int, stream: *mut c_void) {
    let _ = (size, stream);
    guarded("gpumem_free", (), || {
        let Some(slot) = slot(device) else {
            return;
        };
        if let Err(e) = slot.allocator.free(DevicePtr(ptr as usize as u64)) {
            report(&format!("free of {ptr:?} on device {device} ignored: {e}"));
        }
    });
}

/// Returns every whole cached segment of every device to the driver (`empty_cache`).
// SAFETY: `gpumem_` names no other symbol in a PyTorch process; no arguments.
#[allow(unsafe_code)] // the exported symbol (`no_mangle`)
#[unsafe(no_mangle)]
pub extern "C" fn gpumem_empty_cache() {
    guarded("gpumem_empty_cache", (), || {
        for slot in SLOTS.iter().filter_map(|s| s.get()).flatten() {
            if let Err(e) = slot.allocator.empty_cache() {
                report(&format!("empty_cache failed: {e}"));
            }
        }
    });
}

/// Limits this process to `fraction` of `device`'s memory
/// (`set_per_process_memory_fraction`).
// SAFETY: `gpumem_` names no other symbol in a PyTorch process, and the signature is the
// pluggable allocator's `set_memory_fraction` (double, int).
#[allow(unsafe_code)] // the exported symbol (`no_mangle`)
#[unsafe(no_mangle)]
pub extern "C" fn gpumem_set_memory_fraction(fraction: f64, device: c_int) {
    guarded("gpumem_set_memory_fraction", (), || {
        if let Some(slot) = slot(device)
            && let Err(e) = slot.allocator.with(|a| a.set_memory_fraction(fraction))
        {
            report(&e.to_string());
        }
    });
}

/// Marks a live block as used by `stream` (`record_stream`).
// SAFETY: `gpumem_` names no other symbol in a PyTorch process, and the signature is the
// pluggable allocator's `record_stream` (void*, cudaStream_t); the pointer is only looked
// up, never dereferenced.
#[allow(unsafe_code)] // the exported symbol (`no_mangle`)
#[unsafe(no_mangle)]
pub extern "C" fn gpumem_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    let stream = StreamId(stream as usize as u64);
    guarded("gpumem_record_stream", (), || {
        for slot in SLOTS.iter().filter_map(|s| s.get()).flatten() {
            slot.allocator
                .record_stream(DevicePtr(ptr as usize as u64), stream);
        }
    });
}

/// Adds a device's allocator to `/metrics`, starting the server on first use when
/// `GPUMEM_METRICS_LISTEN` is set.
fn register_metrics(source: Arc<AllocatorSource>) {
    let Ok(listen) = std::env::var("GPUMEM_METRICS_LISTEN") else {
        return;
    };
    let sources = SOURCES.get_or_init(|| {
        let sources = AllocatorSources::default();
        start_server(&listen, sources.clone());
        sources
    });
    sources.add(source);
}

fn start_server(listen: &str, sources: AllocatorSources) {
    let address = match listen.parse() {
        Ok(address) => address,
        Err(e) => {
            report(&format!(
                "GPUMEM_METRICS_LISTEN={listen:?} is not an address: {e}"
            ));
            return;
        }
    };
    let mut agent = match Agent::in_process(sources) {
        Ok(agent) => agent,
        Err(e) => {
            report(&format!("metrics unavailable: {e}"));
            return;
        }
    };
    agent.state.ui = std::env::var("GPUMEM_METRICS_UI").map_or(true, |v| v != "off");
    let names: Vec<String> = std::env::var("GPUMEM_METRICS_ALLOW_HOST")
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(str::to_string)
        .collect();
    agent.state.hosts = gpumem::server::hosts::AgentHosts::new(&names);
    let spawned = std::thread::Builder::new()
        .name("gpumem-metrics".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(r) => r,
                Err(e) => return report(&format!("metrics server cannot start: {e}")),
            };
            runtime.block_on(async move {
                tokio::spawn(refresh_cache_figures());
                if let Err(e) = agent.run(Listen::on(address), std::future::pending()).await {
                    report(&e.to_string());
                }
            });
        });
    if let Err(e) = spawned {
        report(&format!("metrics server cannot start: {e}"));
    }
}

/// Publishes each allocator's largest free block and segments by size every second, and its
/// segments where the live page asked for them, skipping an allocator whose lock is busy
/// rather than making an allocation wait.
async fn refresh_cache_figures() {
    loop {
        for slot in SLOTS.iter().filter_map(|s| s.get()).flatten() {
            let wanted = slot.source.segments.wanted();
            let figures = slot.allocator.try_with(|a| {
                let segments = wanted.then(|| a.segment_infos());
                (a.largest_free_block(), a.segments_by_size(), segments)
            });
            if figures.is_none() && wanted {
                slot.source.segments.ask_again();
            }
            if let Some((largest, classes, segments)) = figures {
                if let Some(segments) = segments {
                    slot.source.segments.publish(segments);
                }
                slot.source.publish_cache(largest, classes);
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The allocator statistics of `device` in PyTorch's `memory_stats()` form, for tests and
/// diagnostics (`None` if the device is not open).
pub fn memory_stats(device: c_int) -> Option<std::collections::BTreeMap<String, i64>> {
    slot(device).map(|s| s.allocator.stats().memory_stats())
}

/// How `device`'s plan stands (`None` without one), for tests and diagnostics.
pub fn plan_status(device: c_int) -> Option<gpumem::allocator::PlanStatus> {
    slot(device)?.allocator.with(|a| a.plan_status())
}

/// Where `device`'s self-planning stands (`plan_record:N`): `"recording"`, `"planning"` or
/// `"settled"` (following the plan, or reported running without one); `None` without it.
pub fn self_planning(device: c_int) -> Option<&'static str> {
    let sp = slot(device)?.self_plan.as_ref()?;
    Some(match sp.state.load(Ordering::Relaxed) {
        RECORDING => "recording",
        PLANNING => "planning",
        _ => "settled",
    })
}

/// Resets `device`'s peak statistics (`reset_peak_memory_stats`), for tests and diagnostics.
pub fn reset_peak_stats(device: c_int) {
    if let Some(slot) = slot(device) {
        slot.allocator.with(|a| a.reset_peak_stats());
    }
}

/// Starts or ends a simulated graph capture of `stream` on `device`, for tests.
#[cfg(feature = "sim")]
#[doc(hidden)]
pub fn sim_set_capturing(device: c_int, stream: *mut c_void, capturing: bool) {
    if let Some(slot) = slot(device) {
        let stream = StreamId(stream as usize as u64);
        slot.allocator
            .with(|a| a.device_mut().set_capturing(stream, capturing));
    }
}

/// Serialises tests that share the process-wide allocators.
#[doc(hidden)]
pub static TEST_LOCK: Mutex<()> = Mutex::new(());
