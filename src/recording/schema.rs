//! The snapshot schema: from a decoded document to a typed [`Recording`].
//!
//! Four layouts exist in the wild (see the traces' SOURCES): the newest dict (with
//! `allocator_settings`), an older dict without settings, the oldest dict whose blocks carry
//! `history` and may lack `address`, and a legacy bare list of segments. Each event's and
//! block's `frames` are kept as an interned stack ([`StackId`]); the profiler's annotations
//! (`external_annotations`) are kept where they have a device, a time, a stage and a name
//! (others are skipped: they are for people to read); other metadata is skipped.

use crate::allocator::size::PoolKind;
use crate::allocator::{BlockState, PoolId, SimulatedDevice, TraceAction, TraceEntry};
use crate::config::{AllocatorConfig, ROUNDUP_INTERVALS, Syntax};
use crate::device::StreamId;

use super::TraceError;
use super::doc::{Doc, Node};
use super::event_pools::{self, InferredPools};
use super::frames::{ContextId, EventContext, Frames, StackId};

/// Which layout the file had.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// A dict with `allocator_settings` (PyTorch 2.1 and later).
    Newest,
    /// A dict with `segments` and `device_traces` only.
    Older,
    /// A dict whose blocks carry `history` (PyTorch 1.x / 2.0 era).
    Oldest,
    /// A bare list of segments (`torch.cuda.memory_snapshot()`).
    LegacyList,
}

/// One block of a recorded segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordedBlock {
    /// Address.
    pub address: u64,
    /// Size in bytes.
    pub size: u64,
    /// Requested size (stale for free blocks).
    pub requested_size: u64,
    /// State.
    pub state: BlockState,
    /// Where it was allocated ([`StackId::EMPTY`] when the file has no frames for it).
    pub stack: StackId,
}

/// One recorded segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordedSegment {
    /// Device index.
    pub device: u32,
    /// Base address.
    pub address: u64,
    /// Size in bytes.
    pub total_size: u64,
    /// Stream handle.
    pub stream: StreamId,
    /// Pool kind.
    pub pool: PoolKind,
    /// Its pool: [`PoolId::DEFAULT`] for the default pools.
    pub pool_id: PoolId,
    /// Whether this is (a mapped range of) an expandable segment.
    pub is_expandable: bool,
    /// Blocks in address order.
    pub blocks: Vec<RecordedBlock>,
}

/// A decoded snapshot.
#[derive(Clone, Debug)]
pub struct Recording {
    /// The layout of the file.
    pub format: Format,
    /// Final allocator state, all devices, in file order.
    pub segments: Vec<RecordedSegment>,
    /// Events per device (empty when history was not recorded).
    pub device_traces: Vec<Vec<TraceEntry>>,
    /// Each event's stack, beside `device_traces` ([`StackId::EMPTY`] where it has none).
    pub event_stacks: Vec<Vec<StackId>>,
    /// Each event's context (compile context, user metadata, forward frames), beside
    /// `device_traces`; empty for a device whose events carry none.
    pub event_contexts: Vec<Vec<ContextId>>,
    /// The stacks' frames and strings.
    pub frames: Frames,
    /// The allocator configuration in force, when recorded.
    pub config: Option<AllocatorConfig>,
    /// The options of the recorded settings string that could not be applied (a key gpumem
    /// does not know, a bad value), each with the reason: replay goes on without them.
    pub settings_problems: Vec<String>,
    /// The device the recording ran on, when recorded.
    pub simulated_device: Option<SimulatedDevice>,
    /// Whether trace entries carry `pool_id`, which PyTorch writes from 2.12 on.
    pub trace_pool_ids: bool,
    /// Per device, where its trace records no pools and its snapshot shows a private pool:
    /// how its events' pools were inferred (Note [Inferred pools]).
    pub inferred_pools: Vec<Option<InferredPools>>,
    /// The profiler's annotations (`external_annotations`), in file order.
    pub annotations: Vec<Annotation>,
}

/// One of the job's own iterations, as its profiler named it (`ProfilerStep#N`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProfilerStep {
    /// Its `N`.
    pub number: u64,
    /// Its `START`'s time (always set in [`Recording::profiler_steps`]).
    pub start_us: Option<u64>,
    /// Its `END`'s time, where recorded.
    pub end_us: Option<u64>,
}

/// A named range's start or end that the profiler recorded on a device
/// (`external_annotations`: `{stage: START|END, name, device, time_us}`, matched to events by
/// `time_us`). `ProfilerStep#N` names the job's own iterations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Annotation {
    /// The device.
    pub device: u32,
    /// Microseconds since the Unix epoch, on the events' clock.
    pub time_us: u64,
    /// Whether it starts the range (`START`), or ends it (`END`).
    pub start: bool,
    /// The range's name.
    pub name: String,
}

impl Recording {
    /// `device`'s trace: empty where the recording has none for it.
    pub fn trace(&self, device: u32) -> &[TraceEntry] {
        self.device_traces
            .get(device as usize)
            .map_or(&[][..], Vec::as_slice)
    }

    /// The devices with events in their trace, in order.
    pub fn traced_devices(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.device_traces.len() as u32).filter(|&d| !self.trace(d).is_empty())
    }

    /// The job's own iterations on `device`: its profiler's `ProfilerStep#N` ranges, by
    /// start, each with its end where an `END` was recorded (a step whose `START` is
    /// recorded twice keeps its first).
    pub fn profiler_steps(&self, device: u32) -> Vec<ProfilerStep> {
        let number = |name: &str| name.strip_prefix("ProfilerStep#")?.parse::<u64>().ok();
        let mut steps: std::collections::BTreeMap<u64, ProfilerStep> = Default::default();
        for a in self.annotations.iter().filter(|a| a.device == device) {
            let Some(n) = number(&a.name) else { continue };
            let step = steps.entry(n).or_insert(ProfilerStep {
                number: n,
                start_us: None,
                end_us: None,
            });
            let slot = if a.start {
                &mut step.start_us
            } else {
                &mut step.end_us
            };
            slot.get_or_insert(a.time_us);
        }
        let mut steps: Vec<ProfilerStep> = steps
            .into_values()
            .filter(|s| s.start_us.is_some())
            .collect();
        steps.sort_by_key(|s| (s.start_us, s.number));
        steps
    }

    /// The devices the recording says anything of, by trace or by segment, in order.
    pub fn devices(&self) -> Vec<u32> {
        let held = self.segments.iter().map(|s| s.device);
        let set: std::collections::BTreeSet<u32> = self.traced_devices().chain(held).collect();
        set.into_iter().collect()
    }
}

fn schema_error(node: &Node<'_>, expected: &str, found: String) -> TraceError {
    TraceError::Schema {
        path: node.path().to_string(),
        expected: expected.to_string(),
        found,
    }
}

/// How many segments, blocks and events a document may yield: one per value the input built.
/// A pickle can reference one container many times through its memo for a few bytes each;
/// without this bound a small file could ask for unbounded memory.
struct Budget(u64);

impl Budget {
    fn take(&mut self, node: &Node<'_>) -> Result<(), TraceError> {
        self.0 = self.0.checked_sub(1).ok_or_else(|| TraceError::Schema {
            path: node.path().to_string(),
            expected: "each segment, block and event to appear once".to_string(),
            found: "more references to shared lists than the file has values".to_string(),
        })?;
        Ok(())
    }
}

/// The recording a document holds (its interned frames move into it).
pub(super) fn recording(doc: &mut Doc) -> Result<Recording, TraceError> {
    let mut contexts = Contexts::from_iter([EventContext::default()]);
    let mut recording = read(doc, &mut contexts)?;
    if !recording.trace_pool_ids {
        let segments = &recording.segments;
        recording.inferred_pools = (0u32..)
            .zip(&mut recording.device_traces)
            .map(|(device, events)| event_pools::infer(segments, device, events))
            .collect();
    }
    doc.frames.adopt_contexts(contexts);
    recording.frames = std::mem::take(&mut doc.frames);
    Ok(recording)
}

/// The contexts met while reading, in first-seen order after the empty one (`NONE`).
type Contexts = super::frames::Set<EventContext>;

/// An event's context and its id in `contexts` (interned there).
fn context_of(node: &Node<'_>, contexts: &mut Contexts) -> Result<ContextId, TraceError> {
    // Context is for people to read: a value of another type is no context, not an error.
    let text = |key: &str, none: &str| -> Result<_, TraceError> {
        Ok(node
            .get(key)?
            .filter(|v| v.str().is_ok_and(|s| s != none))
            .and_then(|v| v.str_id().ok()))
    };
    let context = EventContext {
        compile_context: text("compile_context", "N/A")?,
        user_metadata: text("user_metadata", "")?,
        forward_frames: node.get("forward_frames")?.and_then(|f| f.strings()),
    };
    Ok(ContextId(contexts.insert_full(context).0 as u32))
}

fn read(doc: &Doc, contexts: &mut Contexts) -> Result<Recording, TraceError> {
    let root = doc.root();
    let budget = &mut Budget(doc.values());
    if !root.is_dict() {
        let segments = segments(&root, budget)?;
        return Ok(Recording {
            format: Format::LegacyList,
            segments,
            device_traces: Vec::new(),
            event_stacks: Vec::new(),
            event_contexts: Vec::new(),
            frames: Frames::default(),
            config: None,
            settings_problems: Vec::new(),
            simulated_device: None,
            trace_pool_ids: false,
            inferred_pools: Vec::new(),
            annotations: Vec::new(),
        });
    }
    let segments = segments(&root.field("segments")?, budget)?;
    let mut device_traces = Vec::new();
    let mut event_stacks = Vec::new();
    let mut event_contexts = Vec::new();
    let mut trace_pool_ids = false;
    if let Some(traces) = root.get("device_traces")? {
        for events in traces.items()? {
            let (mut entries, mut stacks, mut context_ids) = (Vec::new(), Vec::new(), Vec::new());
            for e in events.items()? {
                let (entry, has_pool_id) = event(&e, budget)?;
                trace_pool_ids |= has_pool_id;
                entries.push(entry);
                stacks.push(stack_of(&e)?);
                context_ids.push(context_of(&e, contexts)?);
            }
            if context_ids.iter().all(|&c| c == ContextId::NONE) {
                context_ids = Vec::new();
            }
            device_traces.push(entries);
            event_stacks.push(stacks);
            event_contexts.push(context_ids);
        }
    }
    let (config, settings_problems) = match root.get("allocator_settings")? {
        Some(s) => {
            let (config, problems) = settings(&s)?;
            (Some(config), problems)
        }
        None => (None, Vec::new()),
    };
    let oldest = root
        .field("segments")?
        .items()?
        .next()
        .map(|s| s.get("blocks"))
        .transpose()?
        .flatten()
        .and_then(|b| b.items().ok()?.next())
        .map(|b| b.get("history"))
        .transpose()?
        .flatten()
        .is_some();
    let format = if config.is_some() {
        Format::Newest
    } else if oldest {
        Format::Oldest
    } else {
        Format::Older
    };
    let simulated_device = root
        .get("simulated_device")?
        .map(|d| simulated_device(&d))
        .transpose()?;
    let annotations = match root.get("external_annotations")? {
        Some(list) => annotations(&list, budget)?,
        None => Vec::new(),
    };
    Ok(Recording {
        format,
        segments,
        device_traces,
        event_stacks,
        event_contexts,
        frames: Frames::default(),
        config,
        settings_problems,
        simulated_device,
        trace_pool_ids,
        inferred_pools: Vec::new(),
        annotations,
    })
}

/// The annotations of `list` that say a device, a time, a stage and a name; a list that is
/// not one gives none (annotations are for people to read: never an error).
fn annotations(list: &Node<'_>, budget: &mut Budget) -> Result<Vec<Annotation>, TraceError> {
    let Ok(items) = list.items() else {
        return Ok(Vec::new());
    };
    let mut kept = Vec::new();
    for item in items {
        budget.take(&item)?;
        let field = |key: &str| item.get(key).ok().flatten();
        let device = field("device").and_then(|d| d.uint().ok());
        let time_us = field("time_us").and_then(|t| t.uint().ok());
        let stage = field("stage").and_then(|s| s.str().ok().map(str::to_string));
        let name = field("name").and_then(|n| n.str().ok().map(str::to_string));
        let (Some(device), Some(time_us), Some(stage), Some(name)) = (device, time_us, stage, name)
        else {
            continue;
        };
        let (Ok(device), Some(start)) = (
            u32::try_from(device),
            match stage.as_str() {
                "START" => Some(true),
                "END" => Some(false),
                _ => None,
            },
        ) else {
            continue;
        };
        kept.push(Annotation {
            device,
            time_us,
            start,
            name,
        });
    }
    Ok(kept)
}

/// The stack of an event or block: its `frames` list, interned as it was read (a list that is
/// not all frames, or none, gives the empty stack).
fn stack_of(node: &Node<'_>) -> Result<StackId, TraceError> {
    Ok(node
        .get("frames")?
        .and_then(|f| f.stack())
        .unwrap_or(StackId::EMPTY))
}

fn segments(list: &Node<'_>, budget: &mut Budget) -> Result<Vec<RecordedSegment>, TraceError> {
    list.items()?.map(|s| segment(&s, budget)).collect()
}

fn segment(node: &Node<'_>, budget: &mut Budget) -> Result<RecordedSegment, TraceError> {
    budget.take(node)?;
    let address = node.field("address")?.uint()?;
    let total_size = node.field("total_size")?.uint()?;
    let pool = match node.field("segment_type")?.str()? {
        "small" => PoolKind::Small,
        "large" => PoolKind::Large,
        other => {
            return Err(schema_error(
                &node.field("segment_type")?,
                "\"small\" or \"large\"",
                format!("{other:?}"),
            ));
        }
    };
    let pool_id = pool_id(node, "segment_pool_id")?.unwrap_or_default();
    let mut blocks = Vec::new();
    let mut next_address = address;
    for b in node.field("blocks")?.items()? {
        budget.take(&b)?;
        // The oldest layout leaves out block addresses: blocks are contiguous.
        let block_address = match b.get("address")? {
            Some(a) => a.uint()?,
            None => next_address,
        };
        let size = b.field("size")?.uint()?;
        let state_node = b.field("state")?;
        let state = match state_node.str()? {
            "active_allocated" => BlockState::ActiveAllocated,
            "active_pending_free" | "active_awaiting_free" => BlockState::ActivePendingFree,
            "inactive" => BlockState::Inactive,
            other => {
                return Err(schema_error(
                    &state_node,
                    "\"active_allocated\", \"active_pending_free\" or \"inactive\"",
                    format!("{other:?}"),
                ));
            }
        };
        let requested_size = match b.get("requested_size")? {
            Some(r) => r.uint()?,
            None => size,
        };
        next_address = block_address.saturating_add(size);
        blocks.push(RecordedBlock {
            address: block_address,
            size,
            requested_size,
            state,
            stack: stack_of(&b)?,
        });
    }
    Ok(RecordedSegment {
        device: u32::try_from(node.field("device")?.uint()?)
            .map_err(|_| schema_error(node, "a device index", "a huge number".into()))?,
        address,
        total_size,
        stream: StreamId(stream(node)?),
        pool,
        pool_id,
        is_expandable: match node.get("is_expandable")? {
            Some(e) => e.bool()?,
            None => false,
        },
        blocks,
    })
}

/// The pool id under `key`, if there is one: a pair of unsigned ints (a tuple in a pickle,
/// a list in JSON).
fn pool_id(node: &Node<'_>, key: &str) -> Result<Option<PoolId>, TraceError> {
    let Some(id) = node.get(key)? else {
        return Ok(None);
    };
    let mut parts = id.items()?;
    match (parts.next(), parts.next(), parts.next()) {
        (Some(a), Some(b), None) => Ok(Some(PoolId(a.uint()?, b.uint()?))),
        _ => Err(schema_error(
            &id,
            "a pair of ints",
            format!("{} items", id.items()?.count()),
        )),
    }
}

/// A stream handle: PyTorch writes it as a (possibly huge) unsigned pointer value.
fn stream(node: &Node<'_>) -> Result<u64, TraceError> {
    match node.get("stream")? {
        Some(s) => Ok(s.int()? as u64),
        None => Ok(0),
    }
}

/// An event, and whether it carries a `pool_id` (PyTorch 2.12 on; without one, the default
/// pool stands in).
fn event(node: &Node<'_>, budget: &mut Budget) -> Result<(TraceEntry, bool), TraceError> {
    budget.take(node)?;
    let action_node = node.field("action")?;
    let action = match action_node.str()? {
        "alloc" => TraceAction::Alloc,
        "free_requested" => TraceAction::FreeRequested,
        "free_completed" => TraceAction::FreeCompleted,
        "segment_alloc" => TraceAction::SegmentAlloc,
        "segment_free" => TraceAction::SegmentFree,
        "segment_map" => TraceAction::SegmentMap,
        "segment_unmap" => TraceAction::SegmentUnmap,
        "snapshot" => TraceAction::Snapshot,
        "oom" => TraceAction::Oom,
        "user_defined" => TraceAction::UserDefined,
        other => {
            return Err(schema_error(
                &action_node,
                "a trace action (alloc, free_requested, free_completed, segment_alloc, segment_free, segment_map, segment_unmap, snapshot, oom, user_defined)",
                format!("{other:?}"),
            ));
        }
    };
    // As in the core's entries, an OOM's `addr` holds the driver's free bytes (which PyTorch
    // writes as `device_free`).
    let addr_key = if action == TraceAction::Oom {
        "device_free"
    } else {
        "addr"
    };
    let addr = match node.get(addr_key)? {
        Some(a) => a.uint()?,
        None => 0,
    };
    let pool = pool_id(node, "pool_id")?;
    let entry = TraceEntry {
        action,
        addr,
        size: node.field("size")?.uint()?,
        stream: StreamId(stream(node)?),
        time_us: node.get("time_us")?.map(|t| t.uint()).transpose()?,
        pool: pool.unwrap_or_default(),
    };
    Ok((entry, pool.is_some()))
}

/// The recorded configuration: the settings string applied as far as it goes (the one
/// place a recording keeps `large_segment_size_mb`, `throw_on_cudamalloc_oom`, a memory
/// fraction or a reserve; options it cannot apply are returned, not fatal), then the values
/// the snapshot reports beside it, which are those in force when it was taken.
fn settings(node: &Node<'_>) -> Result<(AllocatorConfig, Vec<String>), TraceError> {
    let mut config = AllocatorConfig::default();
    let mut problems = Vec::new();
    if let Some(s) = node.get("PYTORCH_CUDA_ALLOC_CONF")? {
        problems = config.apply_lenient(s.str()?, Syntax::Gpumem);
    }
    if let Some(m) = node.get("max_split_size")? {
        let v = m.int()?;
        // As `max_split_size_mb` requires: unlimited (negative), or at least
        // `large_segment_size_mb` (which releases before 2.11 fix at 20 MiB).
        let floor = config.large_segment_size.min(i64::MAX as u64) as i64;
        if (0..floor).contains(&v) {
            return Err(schema_error(
                &m,
                "a max_split_size of -1 (unlimited) or at least large_segment_size",
                v.to_string(),
            ));
        }
        config.max_split_size = if v < 0 { u64::MAX } else { v as u64 };
    }
    if let Some(t) = node.get("garbage_collection_threshold")? {
        let v = t.float()?;
        if !(0.0..1.0).contains(&v) {
            return Err(schema_error(&t, "a threshold in [0, 1)", v.to_string()));
        }
        config.garbage_collection_threshold = v;
    }
    if let Some(e) = node.get("expandable_segments")? {
        config.expandable_segments = e.bool()?;
    }
    if let Some(r) = node.get("release_lock_on_cudamalloc")? {
        config.release_lock_on_cudamalloc = r.bool()?;
    }
    if let Some(p) = node.get("pinned_use_cuda_host_register")? {
        config.pinned.use_cuda_host_register = p.bool()?;
    }
    if let Some(p) = node.get("pinned_num_register_threads")? {
        config.pinned.num_register_threads = p.uint()?;
    }
    if let Some(r) = node.get("graph_capture_record_stream_reuse")? {
        config.graph_capture_record_stream_reuse = r.bool()?;
    }
    if let Some(divisions) = node.get("roundup_power2_divisions")? {
        for i in 0..ROUNDUP_INTERVALS {
            let key = (1u64 << i).to_string();
            if let Some(d) = divisions.get(&key)? {
                let v = d.uint()?;
                if v != 0 && !v.is_power_of_two() {
                    return Err(schema_error(&d, "0 or a power of two", v.to_string()));
                }
                config.roundup_power2_divisions[i] = v;
            }
        }
    }
    Ok((config, problems))
}

fn simulated_device(node: &Node<'_>) -> Result<SimulatedDevice, TraceError> {
    Ok(SimulatedDevice {
        total_bytes: node.field("total_bytes")?.uint()?,
        memory_fraction: match node.get("memory_fraction")? {
            Some(f) if !f.is_none() => Some(f.float()?),
            _ => None,
        },
        allowed_memory_maximum: match node.get("allowed_memory_maximum")? {
            Some(m) if !m.is_none() => Some(m.uint()?),
            _ => None,
        },
    })
}
