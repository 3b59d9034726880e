//! The agent's live view, drawn from one scrape's [`NodeSnapshot`] as the exposition is (so
//! it agrees with `/metrics`, checked value for value by `tests/it/node_view.rs`): per GPU the
//! line-up as the dashboards draw it, and a row per process with an allocator.
//!
//! The line-up of a GPU, as the overview dashboard stacks it: what the caching allocators
//! have allocated, what they reserve beyond that, what their processes use outside them (CUDA
//! context, NCCL, libraries: NVML's per-process figure minus what the allocator holds
//! resident, its reserved bytes but for those a sleeping pool unmapped), what
//! processes without allocator figures use, what nvidia-smi counts used but charges to no
//! process, the driver's reservation and free memory.
//!
//! # Invariants
//! - Every figure is one the exposition exports from the same snapshot (through the
//!   snapshot's functions where one is computed: fragmentation, the OOM's time and parts), or
//!   a sum or difference of them; the last OOM's sentence is its source's. A process is
//!   joined to its allocator by (GPU UUID, pid), and to a GPU instance's line-up by (GPU
//!   UUID, GPU instance ID).
//! - Differences that NVML's and the allocators' timing can make negative are clamped at 0.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::metrics::snapshot::{NodeSnapshot, oom_parts, ratio};
use crate::sources::AllocatorKind;

/// The node at one scrape.
#[derive(Clone, Debug, Default, Serialize)]
pub struct NodeView {
    /// Its GPUs, by index.
    pub gpus: Vec<GpuView>,
    /// Processes with an allocator's figures, by GPU and pid.
    pub processes: Vec<ProcessRow>,
    /// The containers the kubelet assigned each device to, by GPU (DRA devices that name no
    /// GPU of the node last).
    pub assigned: Vec<AssignedRow>,
}

/// A container a device is assigned to (`gpumem_gpu_assigned_info`).
#[derive(Clone, Debug, Default, Serialize)]
pub struct AssignedRow {
    /// Its GPU's index (empty for a DRA device that names no GPU of the node).
    pub gpu: String,
    /// Its GPU's UUID (likewise).
    pub uuid: String,
    /// The MIG device's UUID, for a MIG device.
    pub mig_uuid: String,
    /// The container's pod's namespace.
    pub pod_namespace: String,
    /// The pod's name.
    pub pod_name: String,
    /// The container's name.
    pub container_name: String,
    /// `namespace/name` of its ResourceClaim, for a device assigned through DRA.
    pub claim: String,
    /// `driver/pool/device`, for a device assigned through DRA.
    pub dra_device: String,
}

/// One GPU's line-up.
#[derive(Clone, Debug, Default, Serialize)]
pub struct GpuView {
    /// Its index.
    pub gpu: String,
    /// Its UUID.
    pub uuid: String,
    /// Its model.
    pub model: String,
    /// nvidia-smi's total, used and free bytes, and the driver's reservation.
    pub total: f64,
    /// Used, as nvidia-smi shows it.
    pub used: f64,
    /// Free.
    pub free: f64,
    /// Reserved by the driver.
    pub driver_reserved: f64,
    /// Per process using it: its parts of the line-up.
    pub processes: Vec<ProcessPart>,
    /// Used by processes without allocator figures.
    pub other_processes: f64,
    /// Counted used by nvidia-smi but charged to no process.
    pub unattributed: f64,
    /// Its GPU instances, where it is in MIG mode, by instance id.
    pub migs: Vec<MigView>,
}

/// The line-up of a GPU instance (MIG): its memory as NVML reports it for its MIG devices
/// (compute instances of one GPU instance share its memory and report the same figures, so
/// it is drawn once), and the processes on it.
#[derive(Clone, Debug, Default, Serialize)]
pub struct MigView {
    /// The GPU instance's id (`GPU_I_ID`).
    pub instance: String,
    /// Its profile (`GPU_I_PROFILE`, such as `2g.26gb`).
    pub profile: String,
    /// The UUID of its first MIG device in the scrape.
    pub mig_uuid: String,
    /// Its memory.
    pub total: f64,
    /// Used.
    pub used: f64,
    /// Free.
    pub free: f64,
    /// Per process on it: its parts of the line-up.
    pub processes: Vec<ProcessPart>,
    /// Used by processes on it without allocator figures.
    pub other_processes: f64,
    /// Counted used but charged to no process on it.
    pub unattributed: f64,
}

/// A process's part of a GPU's line-up.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ProcessPart {
    /// Its pid.
    pub pid: String,
    /// `namespace/pod` where known, else the process name.
    pub name: String,
    /// Its allocator's allocated bytes, as far as they are resident (a sleeping pool's are
    /// not: PyTorch cannot say which of its blocks lie in unmapped segments, so allocated
    /// bytes are drawn within what is resident).
    pub allocated: f64,
    /// Resident beyond allocated.
    pub reserved_unallocated: f64,
    /// Used outside the allocator (NVML's figure minus what the allocator holds resident),
    /// where NVML charges it.
    pub outside: f64,
    /// Reserved but not resident (unmapped by a sleeping pool): drawn beside the device's
    /// line-up, not in it (the device does not hold it).
    pub not_resident: f64,
}

/// A process with an allocator's figures.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ProcessRow {
    /// Its GPU's index.
    pub gpu: String,
    /// Its GPU's UUID.
    pub uuid: String,
    /// Its MIG device's UUID, where it runs on one (else empty).
    pub mig_uuid: String,
    /// Its pid.
    pub pid: String,
    /// Its pod's namespace, name and container, where known.
    pub pod_namespace: String,
    /// The pod's name.
    pub pod_name: String,
    /// The container's name.
    pub container_name: String,
    /// `gpumem`, `pytorch` or `xla` (two joined by `+` where one process has both on
    /// one GPU).
    pub allocator: String,
    /// Its configuration.
    pub config: String,
    /// Reserved bytes.
    pub reserved: f64,
    /// Of them, unmapped by a sleeping pool (not resident).
    pub unmapped: f64,
    /// Allocated bytes.
    pub allocated: f64,
    /// (reserved − allocated) / reserved, for caching allocators (XLA's pool is
    /// preallocated: what no tensor uses in it is headroom, not fragmentation).
    pub fragmentation: Option<f64>,
    /// The largest cached free block, where reported.
    pub largest_free_block: Option<f64>,
    /// Allocations that flushed the cache and retried, for caching allocators.
    pub retries: Option<f64>,
    /// Allocations that failed, where its allocators count them.
    pub ooms: Option<f64>,
    /// When it last ran out of memory (Unix seconds), where it did.
    pub last_oom: Option<f64>,
    /// Where its device's memory was at that OOM, by part, where it said.
    pub oom_breakdown: BTreeMap<String, f64>,
    /// That OOM's explanation in one sentence, where its figures were sent.
    pub oom_why: Option<String>,
    /// Where the last recording it uploaded opens (relative to the page), where the agent
    /// keeps one.
    pub recording: Option<String>,
}

impl ProcessRow {
    /// Its part of its GPU's line-up, named by its pod where known (else `unnamed`), with
    /// `outside` bytes used beyond its allocator.
    fn part(&self, unnamed: String, outside: f64) -> ProcessPart {
        ProcessPart {
            pid: self.pid.clone(),
            name: if self.pod_name.is_empty() {
                unnamed
            } else {
                format!("{}/{}", self.pod_namespace, self.pod_name)
            },
            allocated: self.allocated.min(self.resident()),
            reserved_unallocated: (self.resident() - self.allocated).max(0.0),
            outside,
            not_resident: self.unmapped,
        }
    }

    /// What its allocator holds on the device: reserved but for what a pool unmapped.
    fn resident(&self) -> f64 {
        (self.reserved - self.unmapped).max(0.0)
    }
}

/// A process by (GPU UUID, pid).
type ProcKey = (String, u32);

/// `x` as the page's JSON carries figures.
fn bytes(x: impl Into<i128>) -> f64 {
    x.into() as f64
}

/// The view of one scrape's snapshot.
pub fn view(snapshot: &NodeSnapshot) -> NodeView {
    let rows = allocator_rows(snapshot);
    let mut gpus = gpus_of(snapshot);
    let mut charged: BTreeMap<String, f64> = BTreeMap::new();
    let mut mig_charged: BTreeMap<(String, String), f64> = BTreeMap::new();
    for gpu in snapshot.gpus() {
        for (mig, _, processes) in gpu.devices() {
            for p in processes {
                let Some(used) = p.used.map(bytes) else {
                    continue;
                };
                *charged.entry(gpu.uuid.clone()).or_default() += used;
                let Some(g) = gpus.get_mut(&gpu.uuid) else {
                    continue;
                };
                let part = rows
                    .get(&(gpu.uuid.clone(), p.pid))
                    .map(|r| r.part(p.name.clone(), (used - r.resident()).max(0.0)));
                // On a MIG device, the process counts in its GPU instance's line-up too.
                let instance = mig.map(|m| m.gpu_instance.to_string());
                if let Some(m) = g
                    .migs
                    .iter_mut()
                    .find(|m| Some(&m.instance) == instance.as_ref())
                {
                    *mig_charged
                        .entry((gpu.uuid.clone(), m.instance.clone()))
                        .or_default() += used;
                    match &part {
                        Some(part) => m.processes.push(part.clone()),
                        None => m.other_processes += used,
                    }
                }
                match part {
                    Some(part) => g.processes.push(part),
                    None => g.other_processes += used,
                }
            }
        }
    }
    // Allocators NVML charges no memory to (a pushed process it does not list) still hold
    // their reserved memory, which nvidia-smi counts used: it comes out of the unattributed.
    let mut uncharged: BTreeMap<String, f64> = BTreeMap::new();
    for ((uuid, pid), r) in &rows {
        if let Some(g) = gpus.get_mut(uuid)
            && !g.processes.iter().any(|p| p.pid == r.pid)
        {
            *uncharged.entry(uuid.clone()).or_default() += r.resident();
            g.processes.push(r.part(format!("pid {pid}"), 0.0));
        }
    }
    for g in gpus.values_mut() {
        // What NVML charges to no process holds the uncharged allocators' memory; where it
        // cannot (a pid NVML names differently, counted among other processes), they fit in
        // what is left and nothing is counted twice.
        let left = (g.used - charged.get(&g.uuid).copied().unwrap_or(0.0)).max(0.0);
        let uncharged = uncharged.get(&g.uuid).copied().unwrap_or(0.0);
        g.unattributed = (left - uncharged).max(0.0);
        g.processes.sort_by(|a, b| a.pid.cmp(&b.pid));
        for m in &mut g.migs {
            let key = (g.uuid.clone(), m.instance.clone());
            let charged = mig_charged.get(&key).copied().unwrap_or(0.0);
            m.unattributed = (m.used - charged).max(0.0);
            m.processes.sort_by(|a, b| a.pid.cmp(&b.pid));
        }
    }
    let mut gpus: Vec<GpuView> = gpus.into_values().collect();
    gpus.sort_by(|a, b| {
        (a.gpu.parse::<u32>().ok(), &a.gpu).cmp(&(b.gpu.parse::<u32>().ok(), &b.gpu))
    });
    let mut processes: Vec<ProcessRow> = rows.into_values().collect();
    processes.sort_by(|a, b| {
        (a.gpu.parse::<u32>().ok(), a.pid.parse::<u32>().ok())
            .cmp(&(b.gpu.parse::<u32>().ok(), b.pid.parse::<u32>().ok()))
    });
    NodeView {
        gpus,
        processes,
        assigned: assigned_rows(snapshot),
    }
}

/// The assignments, as the exposition places them.
fn assigned_rows(snapshot: &NodeSnapshot) -> Vec<AssignedRow> {
    let Some(directory) = &snapshot.assigned else {
        return Vec::new();
    };
    let mut rows: Vec<AssignedRow> = directory
        .place(snapshot.gpus())
        .into_iter()
        .map(|placed| {
            let a = placed.assignment;
            let (gpu, uuid, mig_uuid) = placed.on.map_or_else(Default::default, |(g, mig)| {
                let mig_uuid = mig.map(|m| m.uuid.clone()).unwrap_or_default();
                (g.index.to_string(), g.uuid.clone(), mig_uuid)
            });
            let dra = a.dra.as_ref();
            AssignedRow {
                gpu,
                uuid,
                mig_uuid,
                pod_namespace: a.holder.namespace.clone(),
                pod_name: a.holder.pod.clone(),
                container_name: a.holder.container.clone(),
                claim: dra.map_or_else(String::new, |c| format!("{}/{}", c.namespace, c.name)),
                dra_device: dra.map_or_else(String::new, |c| {
                    let d = &c.device;
                    format!("{}/{}/{}", d.driver, d.pool, d.device)
                }),
            }
        })
        .collect();
    rows.sort_by(|a, b| {
        let key = |r: &AssignedRow| (r.gpu.is_empty(), r.gpu.parse::<u32>().ok(), r.gpu.clone());
        key(a).cmp(&key(b))
    });
    rows
}

/// A row per allocator, by (GPU UUID, pid); two allocators of one process on one GPU add up.
fn allocator_rows(snapshot: &NodeSnapshot) -> BTreeMap<ProcKey, ProcessRow> {
    let mut rows: BTreeMap<ProcKey, ProcessRow> = BTreeMap::new();
    for a in &snapshot.allocators {
        let s = &a.source;
        let st = &s.stats;
        let row = rows.entry((a.uuid.clone(), s.pid)).or_insert_with(|| {
            let pod = a.pod.clone();
            ProcessRow {
                gpu: a.gpu.to_string(),
                uuid: a.uuid.clone(),
                mig_uuid: a.mig.as_ref().map(|m| m.uuid.clone()).unwrap_or_default(),
                pid: s.pid.to_string(),
                pod_namespace: pod.namespace,
                pod_name: pod.pod,
                container_name: pod.container,
                allocator: s.allocator.label().to_string(),
                ..ProcessRow::default()
            }
        });
        // One allocator is the rule; where two share the key (PyTorch's and XLA's in one
        // process), their bytes and OOMs add up, the configuration is the first one's, and
        // the rest is the last one's that says it.
        let label = s.allocator.label();
        if !row.allocator.split('+').any(|a| a == label) {
            row.allocator = format!("{}+{label}", row.allocator);
        }
        row.reserved += bytes(a.reserved);
        row.unmapped += bytes(s.unmapped);
        row.allocated += bytes(a.allocated);
        if row.config.is_empty() {
            row.config.clone_from(&s.config);
        }
        row.largest_free_block = a.largest_free_block().map(bytes).or(row.largest_free_block);
        if s.xla.is_none() {
            row.retries = Some(bytes(st.num_alloc_retries.get()));
        }
        if s.xla.is_none_or(|x| x.has_ooms) {
            row.ooms = Some(row.ooms.unwrap_or_default() + bytes(st.num_ooms.get()));
        }
        let last_oom = a.last_oom();
        row.last_oom = a.last_oom_at(last_oom.as_ref()).or(row.last_oom);
        if let Some(oom) = last_oom {
            row.oom_breakdown = oom_parts(&oom)
                .map(|(kind, b)| (kind.to_string(), bytes(b)))
                .collect();
            row.oom_why = Some(oom.why);
        }
    }
    for row in rows.values_mut() {
        let caching = !row
            .allocator
            .split('+')
            .any(|a| a == AllocatorKind::Xla.label());
        row.fragmentation = caching.then(|| fragmentation(row.reserved, row.allocated));
    }
    rows
}

/// The fragmentation of summed figures, as the snapshot computes one allocator's.
fn fragmentation(reserved: f64, allocated: f64) -> f64 {
    ratio((reserved - allocated) as i64, reserved as i64)
}

/// The GPUs of one snapshot by UUID, with their figures, models and MIG instances (no
/// processes yet). Compute instances of one GPU instance report its figures: it is drawn
/// once, as its first MIG device says.
fn gpus_of(snapshot: &NodeSnapshot) -> BTreeMap<String, GpuView> {
    let mut gpus: BTreeMap<String, GpuView> = BTreeMap::new();
    for gpu in snapshot.gpus() {
        let mut view = GpuView {
            gpu: gpu.index.to_string(),
            uuid: gpu.uuid.clone(),
            model: gpu.model.clone(),
            total: bytes(gpu.total),
            used: bytes(gpu.used),
            free: bytes(gpu.free),
            driver_reserved: gpu.reserved.map_or(0.0, bytes),
            ..GpuView::default()
        };
        for mig in &gpu.mig {
            let instance = mig.gpu_instance.to_string();
            if view.migs.iter().any(|m| m.instance == instance) {
                continue;
            }
            view.migs.push(MigView {
                instance,
                profile: mig.profile.clone(),
                mig_uuid: mig.uuid.clone(),
                total: bytes(mig.total),
                used: bytes(mig.used),
                free: bytes(mig.free),
                ..MigView::default()
            });
        }
        view.migs.sort_by_key(|m| m.instance.parse::<u32>().ok());
        gpus.insert(gpu.uuid.clone(), view);
    }
    gpus
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use std::time::Instant;

    use crate::allocator::DeviceStats;
    use crate::sources::{AllocatorSource, Pusher};
    use crate::telemetry::{GpuSample, MigSample, NodeSample, ProcessSample, SourceReport};

    use super::*;

    const GIB: u64 = 1 << 30;

    fn process(pid: u32, used: u64) -> ProcessSample {
        ProcessSample {
            pid,
            name: "python".into(),
            used: Some(used),
            container: None,
        }
    }

    /// A MIG device of GPU instance `instance` (3g.40gb), with `used` of it in use.
    fn mig(index: u32, instance: u32, used: u64, processes: Vec<ProcessSample>) -> MigSample {
        MigSample {
            index,
            uuid: format!("MIG-{index}"),
            gpu_instance: instance,
            compute_instance: 0,
            profile: "3g.40gb".into(),
            total: 40 * GIB,
            used,
            free: 40 * GIB - used,
            processes,
        }
    }

    #[test]
    fn a_gpu_instance_is_drawn_once_with_the_processes_on_its_mig_devices() {
        // Two compute instances of GPU instance 1 (MIG devices 0 and 1) report its figures;
        // GPU instance 2 has one MIG device.
        let gpu = GpuSample {
            index: 0,
            uuid: "GPU-a".into(),
            minor: Some(0),
            model: "A100".into(),
            total: 80 * GIB,
            used: 10 * GIB,
            free: 70 * GIB,
            reserved: None,
            processes: Vec::new(),
            mig: vec![
                mig(0, 1, 7 * GIB, vec![process(10, 4 * GIB)]),
                mig(1, 1, 7 * GIB, vec![process(11, 2 * GIB)]),
                mig(2, 2, GIB, Vec::new()),
            ],
        };
        let report = SourceReport {
            source: "simulated",
            up: true,
            sample: Some(NodeSample {
                driver_version: "1".into(),
                simulated: true,
                gpus: vec![gpu],
            }),
            error: None,
            duration_seconds: 0.0,
        };
        // Pid 10 has an allocator, pushed with its MIG device's UUID.
        let stats: BTreeMap<String, i64> = [
            ("reserved_bytes.large_pool.current", 3 * GIB as i64),
            ("allocated_bytes.large_pool.current", GIB as i64),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let pusher = Pusher {
            pid: 10,
            ..Pusher::default()
        };
        let stats = DeviceStats::from_memory_stats(&stats);
        let place = (0, "MIG-0".into());
        let source = AllocatorSource::pushed(&pusher, place, stats, None, None, None);
        let snapshot = NodeSnapshot::new(
            Instant::now(),
            &[Arc::new(source)],
            vec![Arc::new(report)],
            (None, None),
        );
        let view = view(&snapshot);
        let migs = &view.gpus[0].migs;
        assert_eq!(migs.len(), 2, "{migs:#?}");
        let (one, two) = (&migs[0], &migs[1]);
        let gib = GIB as f64;
        assert_eq!(
            (one.instance.as_str(), one.total, one.used),
            ("1", 40.0 * gib, 7.0 * gib)
        );
        assert_eq!(one.mig_uuid, "MIG-0");
        assert_eq!(two.instance, "2");
        // Pid 10 has an allocator (its parts), pid 11 none (another process); the rest of
        // the instance's use is charged to no process.
        assert_eq!(one.processes.len(), 1);
        assert_eq!(one.processes[0].pid, "10");
        assert_eq!(one.processes[0].allocated, gib);
        assert_eq!(one.processes[0].outside, gib);
        assert_eq!(one.other_processes, 2.0 * gib);
        assert_eq!(one.unattributed, gib);
        assert!(two.processes.is_empty());
        assert_eq!(two.unattributed, gib);
        // The GPU's own line-up still holds both processes; the allocator's row is placed
        // on NVML's GPU and MIG device.
        assert_eq!(view.gpus[0].processes.len(), 1);
        assert_eq!(view.gpus[0].other_processes, 2.0 * gib);
        let row = &view.processes[0];
        assert_eq!(
            (row.uuid.as_str(), row.mig_uuid.as_str()),
            ("GPU-a", "MIG-0")
        );
        assert_eq!(
            (row.reserved, row.fragmentation),
            (3.0 * gib, Some(2.0 / 3.0))
        );
    }
}
