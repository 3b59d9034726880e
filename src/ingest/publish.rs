//! Publishing, a push's last phase: its devices as allocator sources, with what its
//! process's last push keeps standing.
//!
//! # Invariants
//! - A snapshot's figures (the largest free block, segments by size) stand until a later
//!   snapshot of the device replaces them.
//! - An OOM's explanation stands until the device's next OOM, explained or not (its OOM
//!   count grows).
//! - A pod's OOM count only grows: a process seen afresh brings its whole count again, and
//!   the OOMs it dates to at or before the pod's last counted one are not counted twice.
//! - What stands counts toward the push's series as much as what it brings
//!   ([`kept_series`]), so the budget sees every series the push leaves served.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use crate::sources::{AllocatorSource, Cache, Pusher};
use crate::telemetry::cgroup::ContainerRef;

use super::limits::OOM_BREAKDOWN_SERIES;
use super::payload::{ValidDevice, ValidPush};

/// The device's source in `before` (its process's last push), if it had one: the same
/// device, under the same allocator.
fn previous<'a>(
    before: &'a [Arc<AllocatorSource>],
    device: &ValidDevice,
) -> Option<&'a AllocatorSource> {
    before
        .iter()
        .find(|s| s.uuid == device.uuid && s.xla.is_some() == device.xla.is_some())
        .map(Arc::as_ref)
}

/// Whether `before`'s OOM explanation still stands for `device`: it brings none, and no OOM
/// since.
fn explanation_stands(before: &AllocatorSource, device: &ValidDevice) -> bool {
    device.last_oom.is_none() && before.stats.num_ooms.get() >= device.stats.num_ooms.get()
}

/// The series that what `before` (its process's last push: a snapshot, an OOM's
/// explanation) keeps exporting adds to `push`.
pub(super) fn kept_series(before: &[Arc<AllocatorSource>], push: &ValidPush) -> usize {
    push.devices
        .iter()
        .filter_map(|d| Some((d, previous(before, d)?)))
        .map(|(d, before)| {
            let classes = match (&d.snapshot, before.cache()) {
                (None, Some(kept)) => 2 * kept.segments_by_size.len(),
                _ => 0,
            };
            let explanation = explanation_stands(before, d) && before.last_oom().is_some();
            classes + if explanation { OOM_BREAKDOWN_SERIES } else { 0 }
        })
        .sum()
}

/// The sources of `process`'s pushed `devices`, received at `now`, with what `before`, its
/// last push's, keeps.
pub(super) fn pushed_sources(
    process: &Pusher,
    devices: Vec<ValidDevice>,
    before: &[Arc<AllocatorSource>],
    now: Instant,
) -> Vec<Arc<AllocatorSource>> {
    devices
        .into_iter()
        .map(|device| {
            let before = previous(before, &device);
            let last_oom = match before {
                Some(b) if explanation_stands(b, &device) => b.last_oom(),
                _ => device.last_oom,
            };
            let cache = match device.snapshot {
                Some((largest_free_block, segments_by_size)) => Some(Cache {
                    largest_free_block,
                    segments_by_size,
                    read_at: now,
                }),
                None => before.and_then(AllocatorSource::cache),
            };
            let mut source = AllocatorSource::pushed(
                process,
                (device.index, device.uuid),
                device.stats,
                device.xla,
                cache,
                last_oom,
            );
            source.unmapped = device.unmapped;
            source.memory_limit = device.memory_limit;
            Arc::new(source)
        })
        .collect()
}

/// A pod's container's OOMs, as counted.
pub(super) struct PodCount {
    pub ooms: u64,
    /// When it last changed.
    pub last: Instant,
    /// The last counted OOM's time, by the job's clock where it said.
    pub last_oom_unix: Option<f64>,
}

/// OOMs a push brings for its pod's count.
pub(super) struct PodOom {
    /// Counted now and not at its last push.
    pub new_ooms: u64,
    /// The process is seen afresh (its entry had gone).
    pub fresh: bool,
    /// When the job dates its last OOM, by its own clock.
    pub dated: Option<f64>,
    /// When its last OOM is taken to be.
    pub last_oom_at: Option<f64>,
}

/// Adds a push's new OOMs to its container's pod count. A process seen afresh brings its
/// whole count again: the OOMs it dates to at or before the pod's last counted one were
/// counted then.
pub(super) fn count_pod_ooms(
    pods: &mut BTreeMap<(String, String), PodCount>,
    c: &ContainerRef,
    oom: PodOom,
    now: Instant,
) {
    let key = (c.pod_uid.clone(), c.container_id.clone());
    let count = pods.entry(key).or_insert(PodCount {
        ooms: 0,
        last: now,
        last_oom_unix: None,
    });
    let recounted = oom.fresh
        && oom
            .dated
            .zip(count.last_oom_unix)
            .is_some_and(|(theirs, counted)| theirs <= counted);
    if !recounted {
        count.ooms += oom.new_ooms;
        count.last = now;
        count.last_oom_unix = oom.last_oom_at.or(count.last_oom_unix);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocator::breakdown::{Breakdown, Kind};
    use crate::ingest::payload::validate;
    use crate::sources::LastOom;

    fn push(device: serde_json::Value) -> ValidPush {
        let body = serde_json::json!({"pid": 7, "seq": 1, "devices": [device]});
        validate(body.to_string().as_bytes()).expect("valid")
    }

    fn process() -> Pusher {
        Pusher {
            pid: 7,
            version: "2.5.1".into(),
            config: "expandable_segments:True".into(),
            xla: ("0.10.2".into(), "XLA_PYTHON_CLIENT_MEM_FRACTION=.5".into()),
            labels: vec![("team".into(), "a".into())],
            last_oom_unix_seconds: Some(1.5),
        }
    }

    fn oom(why: &str) -> LastOom {
        LastOom {
            breakdown: Breakdown::default(),
            kind: Kind::Fragmentation,
            why: why.into(),
            at_unix_seconds: None,
        }
    }

    /// The source of `device` pushed after `before`.
    fn after(before: &[Arc<AllocatorSource>], device: serde_json::Value) -> Arc<AllocatorSource> {
        let devices = push(device).devices;
        let mut sources = pushed_sources(&process(), devices, before, Instant::now());
        assert_eq!(sources.len(), 1);
        sources.remove(0)
    }

    #[test]
    fn a_snapshots_figures_stand_until_the_next_snapshot() {
        let snapshot = serde_json::json!({"index": 0, "uuid": "GPU-a", "stats": {},
            "largest_free_block": 4096,
            "segments_by_size": [{"size": 2097152, "segments": 3, "free_bytes": 4096}]});
        let first = after(&[], snapshot);
        let cache = first.cache().expect("a snapshot's");
        assert_eq!(cache.largest_free_block, 4096);
        assert_eq!((first.pid, first.version.as_str()), (7, "2.5.1"));
        assert_eq!(first.labels, process().labels);
        assert_eq!(first.last_oom_unix_seconds, Some(1.5));
        let plain = serde_json::json!({"index": 0, "uuid": "GPU-a", "stats": {}});
        let before = [first];
        let p = push(plain.clone());
        assert_eq!(kept_series(&before, &p), 2, "its one class, two series");
        let second = after(&before, plain.clone());
        assert_eq!(second.cache(), before[0].cache());
        // Another device, or no push before: nothing known.
        let other = after(
            &before,
            serde_json::json!({"index": 1, "uuid": "GPU-b", "stats": {}}),
        );
        assert_eq!(other.cache(), None);
        assert_eq!(after(&[], plain).cache(), None);
    }

    #[test]
    fn an_xla_allocator_keeps_its_own_figures_beside_pytorchs_on_one_gpu() {
        let xla = serde_json::json!({"index": 0, "uuid": "GPU-a", "allocator": "xla",
            "stats": {"bytes_in_use": 3, "pool_bytes": 10, "largest_free_block_bytes": 6}});
        let first = after(&[], xla);
        assert_eq!(first.allocator, crate::sources::AllocatorKind::Xla);
        assert_eq!(
            (first.version.as_str(), first.config.as_str()),
            ("0.10.2", "XLA_PYTHON_CLIENT_MEM_FRACTION=.5")
        );
        // PyTorch's allocator on the same GPU, without a snapshot: nothing of XLA's stands.
        let torch = after(
            std::slice::from_ref(&first),
            serde_json::json!({"index": 0, "uuid": "GPU-a", "stats": {}}),
        );
        assert_eq!(torch.allocator, crate::sources::AllocatorKind::Pytorch);
        assert_eq!(torch.cache(), None);
        assert_eq!(torch.version, "2.5.1");
    }

    #[test]
    fn an_ooms_explanation_stands_until_the_devices_next_oom() {
        let device = |ooms: u64| serde_json::json!({"index": 0, "uuid": "GPU-a", "stats": {"num_ooms": ooms}});
        let mut p = push(device(1));
        p.devices[0].last_oom = Some(oom("fragmented"));
        let devices = std::mem::take(&mut p.devices);
        let explained = pushed_sources(&process(), devices, &[], Instant::now());
        assert_eq!(explained[0].last_oom(), Some(oom("fragmented")));
        // No OOM since: it stands, and counts.
        let p = push(device(1));
        assert_eq!(kept_series(&explained, &p), OOM_BREAKDOWN_SERIES);
        assert_eq!(
            after(&explained, device(1)).last_oom(),
            Some(oom("fragmented"))
        );
        // An OOM since, unexplained: it goes.
        let p = push(device(2));
        assert_eq!(kept_series(&explained, &p), 0);
        assert_eq!(after(&explained, device(2)).last_oom(), None);
    }

    #[test]
    fn a_pods_ooms_are_counted_once() {
        let now = Instant::now();
        let c = ContainerRef {
            pod_uid: "p".into(),
            container_id: "c".into(),
            runtime: crate::telemetry::cgroup::Runtime::Containerd,
        };
        let mut pods = BTreeMap::new();
        let oom = |new_ooms, fresh, dated| PodOom {
            new_ooms,
            fresh,
            dated,
            last_oom_at: dated,
        };
        count_pod_ooms(&mut pods, &c, oom(2, true, Some(100.0)), now);
        count_pod_ooms(&mut pods, &c, oom(1, false, Some(200.0)), now);
        let count = |pods: &BTreeMap<_, PodCount>| pods.values().map(|p| p.ooms).sum::<u64>();
        assert_eq!(count(&pods), 3);
        // The process seen afresh (its entry expired) brings its whole count again, dated
        // at the pod's last counted OOM: counted then.
        count_pod_ooms(&mut pods, &c, oom(3, true, Some(200.0)), now);
        assert_eq!(count(&pods), 3);
        // A new process with a later OOM is counted.
        count_pod_ooms(&mut pods, &c, oom(1, true, Some(300.0)), now);
        assert_eq!(count(&pods), 4);
    }
}
