//! The agent's live view, read off the metric families of one scrape (so it always agrees
//! with `/metrics`): per GPU the line-up as the dashboards draw it, and a row per process with
//! an allocator.
//!
//! The line-up of a GPU, as the overview dashboard stacks it: what the caching allocators
//! have allocated, what they reserve beyond that, what their processes use outside them (CUDA
//! context, NCCL, libraries: NVML's per-process figure minus the allocator's reserved), what
//! processes without allocator figures use, what nvidia-smi counts used but charges to no
//! process, the driver's reservation and free memory.
//!
//! # Invariants
//! - Every figure is a series of the scrape, or a sum or difference of them; nothing else is
//!   read but the last OOM's sentence (from its allocator source). A process is joined to its
//!   allocator by (GPU UUID, pid), and to a GPU instance's line-up by (GPU UUID, `GPU_I_ID`).
//! - Differences that NVML's and the allocators' timing can make negative are clamped at 0.

use std::collections::BTreeMap;

use prometheus::proto::MetricFamily;
use serde::Serialize;

use crate::metrics::contract as c;
use crate::sources::AllocatorSource;
use crate::telemetry::uuid_body;

/// The node at one scrape.
#[derive(Clone, Debug, Default, Serialize)]
pub struct NodeView {
    /// Its GPUs, by index.
    pub gpus: Vec<GpuView>,
    /// Processes with an allocator's figures, by GPU and pid.
    pub processes: Vec<ProcessRow>,
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
    /// Its allocator's allocated bytes.
    pub allocated: f64,
    /// Reserved beyond allocated.
    pub reserved_unallocated: f64,
    /// Used outside the allocator (NVML's figure minus reserved), where NVML charges it.
    pub outside: f64,
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
    /// `gpumem` or `pytorch`.
    pub allocator: String,
    /// Its configuration.
    pub config: String,
    /// Reserved bytes.
    pub reserved: f64,
    /// Allocated bytes.
    pub allocated: f64,
    /// (reserved − allocated) / reserved.
    pub fragmentation: f64,
    /// The largest cached free block, where reported.
    pub largest_free_block: Option<f64>,
    /// Allocations that flushed the cache and retried.
    pub retries: f64,
    /// Allocations that failed.
    pub ooms: f64,
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

/// Each series of `name` in `families`: its labels and value.
fn series<'a>(
    families: &'a [MetricFamily],
    name: &str,
) -> impl Iterator<Item = (BTreeMap<&'a str, &'a str>, f64)> + 'a {
    let name = name.to_string();
    families
        .iter()
        .filter(move |f| f.name() == name)
        .flat_map(|f| f.get_metric())
        .map(|m| {
            let labels = m
                .get_label()
                .iter()
                .map(|l| (l.name(), l.value()))
                .collect();
            let value = m.get_gauge().get_value() + m.get_counter().get_value();
            (labels, value)
        })
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
            allocated: self.allocated,
            reserved_unallocated: (self.reserved - self.allocated).max(0.0),
            outside,
        }
    }
}

type ProcKey = (String, String);
/// A series' labels.
type Labels<'a> = BTreeMap<&'a str, &'a str>;
/// Sets one of a GPU's figures.
type SetFigure = fn(&mut GpuView, f64);
/// Sets one of a MIG instance's figures.
type SetMigFigure = fn(&mut MigView, f64);

/// A series' label `k`, empty where it has none.
fn label(labels: &Labels<'_>, k: &str) -> String {
    labels.get(k).copied().unwrap_or_default().to_string()
}

fn key(labels: &Labels<'_>) -> ProcKey {
    (label(labels, "UUID"), label(labels, "pid"))
}

/// The view of one scrape's `families`, with the sentences of the last OOMs that `sources`
/// explain (a sentence is not a metric).
pub fn view(families: &[MetricFamily], sources: &[std::sync::Arc<AllocatorSource>]) -> NodeView {
    let mut view = from_families(families);
    for row in &mut view.processes {
        // A source on a MIG device is known by the MIG device's UUID, pushed ones by any
        // spelling of it.
        let device = if row.mig_uuid.is_empty() {
            &row.uuid
        } else {
            &row.mig_uuid
        };
        row.oom_why = sources
            .iter()
            .find(|s| s.pid.to_string() == row.pid && uuid_body(&s.uuid) == uuid_body(device))
            .and_then(|s| s.last_oom())
            .map(|o| o.why);
    }
    view
}

fn from_families(families: &[MetricFamily]) -> NodeView {
    // Allocators by (UUID, pid).
    let mut rows: BTreeMap<ProcKey, ProcessRow> = BTreeMap::new();
    let row = |labels: &Labels<'_>| -> ProcessRow {
        ProcessRow {
            gpu: label(labels, "gpu"),
            uuid: label(labels, "UUID"),
            mig_uuid: label(labels, "mig_uuid"),
            pid: label(labels, "pid"),
            pod_namespace: label(labels, "pod_namespace"),
            pod_name: label(labels, "pod_name"),
            container_name: label(labels, "container_name"),
            allocator: label(labels, "allocator"),
            ..ProcessRow::default()
        }
    };
    for (labels, v) in series(families, c::RESERVED_BYTES.name) {
        rows.entry(key(&labels))
            .or_insert_with(|| row(&labels))
            .reserved += v;
    }
    for (labels, v) in series(families, c::ALLOCATED_BYTES.name) {
        rows.entry(key(&labels))
            .or_insert_with(|| row(&labels))
            .allocated += v;
    }
    let mut each = |name: &str, set: &mut dyn FnMut(&mut ProcessRow, &Labels<'_>, f64)| {
        for (labels, v) in series(families, name) {
            if let Some(r) = rows.get_mut(&key(&labels)) {
                set(r, &labels, v);
            }
        }
    };
    each(c::ALLOCATOR_INFO.name, &mut |r, l, _| {
        r.config = l.get("config").copied().unwrap_or_default().to_string();
    });
    each(c::LARGEST_FREE_BLOCK.name, &mut |r, _, v| {
        r.largest_free_block = Some(v);
    });
    each(c::ALLOC_RETRIES.name, &mut |r, _, v| r.retries = v);
    each(c::OOMS.name, &mut |r, _, v| r.ooms = v);
    each(c::LAST_OOM_TIMESTAMP.name, &mut |r, _, v| {
        r.last_oom = Some(v);
    });
    each(c::OOM_BREAKDOWN.name, &mut |r, l, v| {
        let kind = l.get("kind").copied().unwrap_or_default().to_string();
        r.oom_breakdown.insert(kind, v);
    });
    for r in rows.values_mut() {
        r.fragmentation = if r.reserved > 0.0 {
            (r.reserved - r.allocated).max(0.0) / r.reserved
        } else {
            0.0
        };
    }

    let mut gpus = gpus_of(families);
    let mut charged: BTreeMap<String, f64> = BTreeMap::new();
    let mut mig_charged: BTreeMap<(String, String), f64> = BTreeMap::new();
    for (labels, used) in series(families, c::PROCESS_USED.name) {
        let k = key(&labels);
        *charged.entry(k.0.clone()).or_default() += used;
        let Some(g) = gpus.get_mut(&k.0) else {
            continue;
        };
        let part = rows
            .get(&k)
            .map(|r| r.part(label(&labels, "process"), (used - r.reserved).max(0.0)));
        // On a MIG device, the process counts in its GPU instance's line-up too.
        let instance = label(&labels, "GPU_I_ID");
        if let Some(m) = g.migs.iter_mut().find(|m| m.instance == instance) {
            *mig_charged.entry((k.0.clone(), instance)).or_default() += used;
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
    // Allocators NVML charges no memory to (a pushed process it does not list) still hold
    // their reserved memory, which nvidia-smi counts used: it comes out of the unattributed.
    let mut uncharged: BTreeMap<String, f64> = BTreeMap::new();
    for (k, r) in &rows {
        if let Some(g) = gpus.get_mut(&k.0)
            && !g.processes.iter().any(|p| p.pid == k.1)
        {
            *uncharged.entry(k.0.clone()).or_default() += r.reserved;
            g.processes.push(r.part(format!("pid {}", k.1), 0.0));
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
        g.migs.sort_by(|a, b| {
            (a.instance.parse::<u32>().ok(), &a.instance)
                .cmp(&(b.instance.parse::<u32>().ok(), &b.instance))
        });
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
    NodeView { gpus, processes }
}

/// The GPUs of one scrape by UUID, with their figures, models and MIG instances (no
/// processes yet).
fn gpus_of(families: &[MetricFamily]) -> BTreeMap<String, GpuView> {
    let mut gpus: BTreeMap<String, GpuView> = BTreeMap::new();
    let gpu = |labels: &Labels<'_>| -> GpuView {
        GpuView {
            gpu: label(labels, "gpu"),
            uuid: label(labels, "UUID"),
            ..GpuView::default()
        }
    };
    let figures: [(&str, SetFigure); 4] = [
        (c::DEVICE_TOTAL.name, |g, v| g.total = v),
        (c::DEVICE_USED.name, |g, v| g.used = v),
        (c::DEVICE_FREE.name, |g, v| g.free = v),
        (c::DEVICE_RESERVED.name, |g, v| g.driver_reserved = v),
    ];
    for (name, set) in figures {
        for (labels, v) in series(families, name) {
            let g = gpus
                .entry(label(&labels, "UUID"))
                .or_insert_with(|| gpu(&labels));
            set(g, v);
        }
    }
    let mig_figures: [(&str, SetMigFigure); 3] = [
        (c::MIG_TOTAL.name, |m, v| m.total = v),
        (c::MIG_USED.name, |m, v| m.used = v),
        (c::MIG_FREE.name, |m, v| m.free = v),
    ];
    for (name, set) in mig_figures {
        for (labels, v) in series(families, name) {
            let Some(g) = gpus.get_mut(&label(&labels, "UUID")) else {
                continue;
            };
            let instance = label(&labels, "GPU_I_ID");
            let at = match g.migs.iter().position(|m| m.instance == instance) {
                Some(at) => at,
                None => {
                    g.migs.push(MigView {
                        instance,
                        profile: label(&labels, "GPU_I_PROFILE"),
                        mig_uuid: label(&labels, "mig_uuid"),
                        ..MigView::default()
                    });
                    g.migs.len() - 1
                }
            };
            set(&mut g.migs[at], v);
        }
    }
    for (labels, _) in series(families, c::DEVICE_INFO.name) {
        if let Some(g) = gpus.get_mut(&label(&labels, "UUID")) {
            g.model = label(&labels, "model");
        }
    }
    gpus
}

#[cfg(test)]
mod tests {
    use prometheus::core::Collector;
    use prometheus::{GaugeVec, Opts};

    use super::*;

    /// A gauge family of `name` with one series per `(labels, value)`.
    fn family(name: &str, series: &[(&[(&str, &str)], f64)]) -> MetricFamily {
        let names: Vec<&str> = series[0].0.iter().map(|(k, _)| *k).collect();
        let gauge = GaugeVec::new(Opts::new(name, "help"), &names).expect("valid");
        for (labels, value) in series {
            let values: Vec<&str> = labels.iter().map(|(_, v)| *v).collect();
            gauge.with_label_values(&values).set(*value);
        }
        gauge.collect().remove(0)
    }

    #[test]
    fn a_gpu_instance_is_drawn_once_with_the_processes_on_its_mig_devices() {
        const GIB: f64 = (1u64 << 30) as f64;
        let gpu = [("gpu", "0"), ("UUID", "GPU-a")];
        // Two compute instances of GPU instance 1 (MIG devices m1 and m2) report its
        // figures; GPU instance 2 has one MIG device.
        let mig = |id: &'static str, mig_uuid: &'static str| -> [(&str, &str); 5] {
            [
                gpu[0],
                gpu[1],
                ("GPU_I_ID", id),
                ("GPU_I_PROFILE", "3g.40gb"),
                ("mig_uuid", mig_uuid),
            ]
        };
        let (m1, m2, m3) = (mig("1", "MIG-1"), mig("1", "MIG-2"), mig("2", "MIG-3"));
        let process = |pid: &'static str, mig_uuid: &'static str, id: &'static str| {
            [
                gpu[0],
                gpu[1],
                ("pid", pid),
                ("process", "python"),
                ("GPU_I_ID", id),
                ("mig_uuid", mig_uuid),
            ]
        };
        let (p1, p2) = (process("10", "MIG-1", "1"), process("11", "MIG-2", "1"));
        let allocator = [gpu[0], gpu[1], ("pid", "10"), ("pool", "large")];
        let families = [
            family(c::DEVICE_TOTAL.name, &[(&gpu, 80.0 * GIB)]),
            family(c::DEVICE_USED.name, &[(&gpu, 10.0 * GIB)]),
            family(
                c::MIG_TOTAL.name,
                &[(&m1, 40.0 * GIB), (&m2, 40.0 * GIB), (&m3, 40.0 * GIB)],
            ),
            family(
                c::MIG_USED.name,
                &[(&m1, 7.0 * GIB), (&m2, 7.0 * GIB), (&m3, 1.0 * GIB)],
            ),
            family(c::PROCESS_USED.name, &[(&p1, 4.0 * GIB), (&p2, 2.0 * GIB)]),
            family(c::RESERVED_BYTES.name, &[(&allocator, 3.0 * GIB)]),
            family(c::ALLOCATED_BYTES.name, &[(&allocator, 1.0 * GIB)]),
        ];
        let view = from_families(&families);
        let migs = &view.gpus[0].migs;
        assert_eq!(migs.len(), 2, "{migs:#?}");
        let (one, two) = (&migs[0], &migs[1]);
        assert_eq!(
            (one.instance.as_str(), one.total, one.used),
            ("1", 40.0 * GIB, 7.0 * GIB)
        );
        assert_eq!(two.instance, "2");
        // Pid 10 has an allocator (its parts), pid 11 none (another process); the rest of
        // the instance's use is charged to no process.
        assert_eq!(one.processes.len(), 1);
        assert_eq!(one.processes[0].pid, "10");
        assert_eq!(one.processes[0].allocated, GIB);
        assert_eq!(one.processes[0].outside, GIB);
        assert_eq!(one.other_processes, 2.0 * GIB);
        assert_eq!(one.unattributed, GIB);
        assert!(two.processes.is_empty());
        assert_eq!(two.unattributed, GIB);
        // The GPU's own line-up still holds both processes.
        assert_eq!(view.gpus[0].processes.len(), 1);
        assert_eq!(view.gpus[0].other_processes, 2.0 * GIB);
    }
}
