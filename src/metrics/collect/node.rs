//! A polled source's series: whether it answered and how long it took, the GPUs, MIG
//! devices and processes of its node sample, and the pods the kubelet assigned each device
//! (DRA devices that name none of the sample's, by their names).

use crate::telemetry::SourceReport;
use crate::telemetry::pod_resources::{Placed, PodDirectory};

use super::super::contract as c;
use super::super::names::{Names, mig_labels};
use super::Families;

/// A polled source's series.
pub(super) fn collect(
    f: &mut Families,
    report: &SourceReport,
    names: Names<'_>,
    assigned: Option<&PodDirectory>,
) {
    f.of(&c::SOURCE_UP)
        .push([report.source], if report.up { 1.0 } else { 0.0 });
    f.of(&c::COLLECT_DURATION)
        .push([report.source], report.duration_seconds);
    let Some(node) = &report.sample else {
        return;
    };
    let simulated = if node.simulated { "true" } else { "false" };
    for gpu in &node.gpus {
        let index = gpu.index.to_string();
        let labels = [index.as_str(), gpu.uuid.as_str()];
        f.of(&c::DEVICE_TOTAL).push(labels, gpu.total as f64);
        f.of(&c::DEVICE_USED).push(labels, gpu.used as f64);
        f.of(&c::DEVICE_FREE).push(labels, gpu.free as f64);
        if let Some(reserved) = gpu.reserved {
            f.of(&c::DEVICE_RESERVED).push(labels, reserved as f64);
        }
        f.of(&c::DEVICE_INFO).push(
            [
                &index,
                &gpu.uuid,
                &gpu.model,
                &node.driver_version,
                simulated,
            ],
            1.0,
        );
        for (mig, _, processes) in gpu.devices() {
            let named = mig.map(mig_labels);
            let extra: &[(String, String)] = named.as_ref().map_or(&[], |l| l.as_slice());
            // The contract's MIG labels are these three, in this order.
            if let (Some(mig), Some([(_, gpu_instance), (_, profile), (_, mig_uuid)])) =
                (mig, &named)
            {
                let labels = [
                    index.as_str(),
                    gpu.uuid.as_str(),
                    gpu_instance,
                    profile,
                    mig_uuid,
                ];
                f.of(&c::MIG_TOTAL).push(labels, mig.total as f64);
                f.of(&c::MIG_USED).push(labels, mig.used as f64);
                f.of(&c::MIG_FREE).push(labels, mig.free as f64);
            }
            for p in processes {
                let Some(used) = p.used else { continue };
                let pid = p.pid.to_string();
                let (pod_uid, container_id) = p
                    .container
                    .as_ref()
                    .map_or(("", ""), |c| (c.pod_uid.as_str(), c.container_id.as_str()));
                let [namespace, pod, container] = names.of(pod_uid, container_id);
                f.of(&c::PROCESS_USED).push_with(
                    [
                        &index,
                        &gpu.uuid,
                        &pid,
                        &p.name,
                        pod_uid,
                        container_id,
                        &namespace,
                        &pod,
                        &container,
                    ],
                    extra,
                    used as f64,
                );
            }
        }
    }
    for placed in assigned.map(|d| d.place(&node.gpus)).unwrap_or_default() {
        assignment_series(f, &placed);
    }
}

/// The series of one assignment: its GPU's `gpu` and `UUID` (empty where it names none of
/// the node's) and a MIG device's labels.
fn assignment_series(f: &mut Families, placed: &Placed<'_>) {
    let a = placed.assignment;
    let h = &a.holder;
    let (index, uuid) = placed.on.map_or((String::new(), ""), |(gpu, _)| {
        (gpu.index.to_string(), gpu.uuid.as_str())
    });
    let named = placed.on.and_then(|(_, mig)| mig).map(mig_labels);
    let extra: &[(String, String)] = named.as_ref().map_or(&[], |l| l.as_slice());
    let (claim_namespace, claim_name) = a
        .dra
        .as_ref()
        .map_or(("", ""), |c| (c.namespace.as_str(), c.name.as_str()));
    let (driver, pool, name) = a.dra.as_ref().map_or(("", "", ""), |c| {
        let d = &c.device;
        (d.driver.as_str(), d.pool.as_str(), d.device.as_str())
    });
    f.of(&c::GPU_ASSIGNED).push_with(
        [
            &index,
            uuid,
            &h.namespace,
            &h.pod,
            &h.container,
            claim_namespace,
            claim_name,
            driver,
            pool,
            name,
        ],
        extra,
        1.0,
    );
}
