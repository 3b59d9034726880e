//! Which Kubernetes pod and container a process belongs to, read from `/proc/<pid>/cgroup`.
//!
//! The kubelet places every container in a cgroup under `kubepods`, named after the pod's UID
//! and the runtime's container ID. The layouts differ by cgroup driver and runtime:
//!
//! | driver   | runtime    | container cgroup path (last components)                              |
//! |----------|------------|----------------------------------------------------------------------|
//! | systemd  | containerd | `kubepods-burstable-pod<uid, _ for ->.slice/cri-containerd-<id>.scope` |
//! | systemd  | CRI-O      | `kubepods-besteffort-pod<uid, _ for ->.slice/crio-<id>.scope`          |
//! | systemd  | Docker     | `kubepods-pod<uid, _ for ->.slice/docker-<id>.scope`                   |
//! | cgroupfs | containerd | `kubepods/burstable/pod<uid>/<id>`                                    |
//! | cgroupfs | CRI-O      | `kubepods/besteffort/pod<uid>/crio-<id>`                              |
//!
//! cgroup v1 lists one line per hierarchy (`12:memory:/kubepods/...`), v2 one line
//! (`0::/kubepods.slice/...`); hybrid hosts list both. Under a cgroup namespace the path may
//! start with `/..`; only the components matter.
//!
//! # Invariants
//! - Parsing is total: any text yields `Some` only for a pod UID of the canonical 8-4-4-4-12 hex
//!   form (or a static pod's 32-hex config hash) and a 64-hex container ID directly below that
//!   pod's cgroup; everything else is `None`.
//! - The pod is read where the kubelet's layouts put it, never searched for: the path starts
//!   at the kubepods root (`kubepods`, `kubepods.slice`), or, under a cgroup namespace, where
//!   its climb (`..`) lands; only QoS levels may come before the pod, and the pod and its
//!   container are of one driver (a `.slice` pod holds a `.scope` container). A process whose
//!   cgroup path merely contains another pod's IDs (made below its own cgroup, or outside
//!   Kubernetes) is never attributed to that pod; components below the container (a
//!   container's own sub-cgroups) do not change whose it is.
//! - CRI-O's `crio-conmon-<id>` monitor is not a container and never matches.
//! - Reading is bounded ([`MAX_CGROUP_FILE`]); a vanished process is `None`, not an error.

/// The most of a `/proc/<pid>/cgroup` file that is read (real ones are under 2 KiB).
pub const MAX_CGROUP_FILE: u64 = 64 * 1024;

/// The container runtime, as the cgroup name shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Runtime {
    /// containerd (`cri-containerd-<id>.scope`, or a bare ID under cgroupfs).
    Containerd,
    /// CRI-O (`crio-<id>`).
    CriO,
    /// Docker through cri-dockerd (`docker-<id>.scope`).
    Docker,
}

impl Runtime {
    /// The prefix of container IDs in Kubernetes' `containerID` status field.
    pub fn scheme(self) -> &'static str {
        match self {
            Runtime::Containerd => "containerd",
            Runtime::CriO => "cri-o",
            Runtime::Docker => "docker",
        }
    }
}

/// A process's pod and container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerRef {
    /// The pod's UID with dashes (`metadata.uid`).
    pub pod_uid: String,
    /// The 64-hex container ID.
    pub container_id: String,
    /// The runtime that created the container.
    pub runtime: Runtime,
}

/// Reads `/proc/<pid>/cgroup`; `None` when the process is gone or outside Kubernetes.
pub fn container_of(pid: u32) -> Option<ContainerRef> {
    parse(&super::process::read_proc(pid, "cgroup", MAX_CGROUP_FILE)?)
}

/// The pod and container named by the contents of a `/proc/<pid>/cgroup` file.
pub fn parse(text: &str) -> Option<ContainerRef> {
    // Lines are `hierarchy-id:controllers:path`; the path may itself contain ':'.
    text.lines()
        .filter_map(|line| line.splitn(3, ':').nth(2))
        .find_map(parse_path)
}

fn parse_path(path: &str) -> Option<ContainerRef> {
    let mut components = path.split('/').filter(|c| !c.is_empty()).peekable();
    // Under a cgroup namespace the path first climbs out of the reader's own cgroup, then
    // goes on from the ancestor it landed on, inside the kubepods tree.
    let mut climbed = false;
    while components.next_if_eq(&"..").is_some() {
        climbed = true;
    }
    let components: Vec<&str> = components.collect();
    if !climbed && !matches!(components.first(), Some(&("kubepods" | "kubepods.slice"))) {
        return None;
    }
    let at = components.iter().position(|c| !is_qos_level(c))?;
    let (pod_uid, systemd) = pod_uid(components[at])?;
    let (container_id, runtime, scope) = container(components.get(at + 1)?)?;
    (systemd == scope).then_some(ContainerRef {
        pod_uid,
        container_id,
        runtime,
    })
}

/// The kubelet's levels above a pod: its root and QoS classes, under either driver.
fn is_qos_level(component: &str) -> bool {
    matches!(
        component,
        "kubepods"
            | "burstable"
            | "besteffort"
            | "kubepods.slice"
            | "kubepods-burstable.slice"
            | "kubepods-besteffort.slice"
    )
}

/// `pod<uid>` (cgroupfs) or `kubepods[-<qos>]-pod<uid with _>.slice` (systemd, `true`).
fn pod_uid(component: &str) -> Option<(String, bool)> {
    let systemd = component.ends_with(".slice");
    let raw = match component.strip_suffix(".slice") {
        Some(slice) => {
            let rest = slice.strip_prefix("kubepods")?;
            let at = rest.rfind("-pod")?;
            let qos = &rest[..at];
            if !matches!(qos, "" | "-burstable" | "-besteffort") {
                return None;
            }
            rest[at + 4..].replace('_', "-")
        }
        None => component.strip_prefix("pod")?.to_owned(),
    };
    is_pod_uid(&raw).then_some((raw, systemd))
}

/// A container's cgroup, its runtime, and whether it is a systemd `.scope`.
fn container(component: &str) -> Option<(String, Runtime, bool)> {
    let scope = component.ends_with(".scope");
    let (id, runtime) = if let Some(scope) = component.strip_suffix(".scope") {
        if let Some(id) = scope.strip_prefix("cri-containerd-") {
            (id, Runtime::Containerd)
        } else if let Some(id) = scope.strip_prefix("crio-") {
            (id, Runtime::CriO)
        } else {
            (scope.strip_prefix("docker-")?, Runtime::Docker)
        }
    } else if let Some(id) = component.strip_prefix("crio-") {
        (id, Runtime::CriO)
    } else {
        // A bare ID is containerd's cgroupfs layout (dockershim's too, gone since Kubernetes 1.24).
        (component, Runtime::Containerd)
    };
    // `crio-conmon-<id>` fails here: "conmon-..." is not 64 hex digits.
    is_container_id(id).then(|| (id.to_owned(), runtime, scope))
}

/// A pod UID: the canonical 8-4-4-4-12 hex form, or a static pod's 32-hex config hash.
pub(crate) fn is_pod_uid(s: &str) -> bool {
    if s.len() == 32 && s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return true;
    }
    let groups: Vec<&str> = s.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// A container ID: 64 hex digits.
pub(crate) fn is_container_id(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "5f0a3c2e-7b1d-4e8a-9c6f-2d4b8e1a7c30";
    const ID: &str = "9b2e4f6a8c0d1e3f5a7b9c1d3e5f7a9b1c3d5e7f9a1b3c5d7e9f1a3b5c7d9e1f";

    fn expect(text: &str, runtime: Runtime) {
        let found = parse(text).unwrap_or_else(|| panic!("no container in:\n{text}"));
        assert_eq!(
            found,
            ContainerRef {
                pod_uid: UID.into(),
                container_id: ID.into(),
                runtime
            },
            "{text}"
        );
    }

    #[test]
    fn cgroup_v2_systemd_containerd() {
        expect(
            &format!(
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{ID}.scope\n",
                UID.replace('-', "_")
            ),
            Runtime::Containerd,
        );
    }

    #[test]
    fn cgroup_v2_systemd_crio_and_its_monitor() {
        let pod = format!(
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice",
            UID.replace('-', "_")
        );
        expect(&format!("0::{pod}/crio-{ID}.scope\n"), Runtime::CriO);
        assert_eq!(parse(&format!("0::{pod}/crio-conmon-{ID}.scope\n")), None);
    }

    #[test]
    fn static_pods_are_named_by_their_config_hash() {
        // A static pod's UID is the hash of its manifest: 32 hex digits, no dashes.
        let hash = "3f1c9d0e8b7a65432f10e9d8c7b6a594";
        let found = parse(&format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{hash}.slice/cri-containerd-{ID}.scope\n"
        ));
        assert_eq!(found.map(|c| c.pod_uid), Some(hash.to_string()));
        assert_eq!(
            parse(&format!("0::/kubepods/pod{}/{ID}\n", &hash[1..])),
            None
        );
    }

    #[test]
    fn cgroup_v2_guaranteed_pod_and_namespaced_path() {
        // Guaranteed pods have no QoS slice; inside a cgroup namespace the path climbs first.
        let uid = UID.replace('-', "_");
        expect(
            &format!("0::/kubepods.slice/kubepods-pod{uid}.slice/cri-containerd-{ID}.scope\n"),
            Runtime::Containerd,
        );
        expect(
            &format!("0::/../../kubepods-pod{uid}.slice/cri-containerd-{ID}.scope\n"),
            Runtime::Containerd,
        );
    }

    #[test]
    fn cgroup_v1_cgroupfs_containerd() {
        let path = format!("/kubepods/burstable/pod{UID}/{ID}");
        let text = [
            "12:hugetlb:",
            "11:memory:",
            "10:devices:",
            "9:cpu,cpuacct:",
            "8:pids:",
            "1:name=systemd:",
        ]
        .iter()
        .map(|prefix| format!("{prefix}{path}\n"))
        .collect::<String>();
        expect(&text, Runtime::Containerd);
    }

    #[test]
    fn cgroup_v1_cgroupfs_crio_and_systemd_hybrid() {
        expect(
            &format!(
                "11:memory:/kubepods/besteffort/pod{UID}/crio-{ID}\n7:pids:/kubepods/besteffort/pod{UID}/crio-{ID}\n"
            ),
            Runtime::CriO,
        );
        // Hybrid host: v1 hierarchies and the unified one side by side.
        let uid = UID.replace('-', "_");
        expect(
            &format!(
                "5:memory:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice/docker-{ID}.scope\n0::/\n"
            ),
            Runtime::Docker,
        );
    }

    #[test]
    fn processes_outside_kubernetes_and_garbage_are_none() {
        for text in [
            "",
            "0::/\n",
            "0::/user.slice/user-1000.slice/session-2.scope\n",
            "0::/system.slice/containerd.service\n",
            // The pod's own cgroup (no container), a sandbox-less path, a short ID.
            &format!("0::/kubepods/burstable/pod{UID}\n"),
            &format!("0::/kubepods/burstable/{ID}\n"),
            &format!("0::/kubepods/burstable/pod{UID}/{}\n", &ID[..63]),
            // A pod UID that is not one, and a QoS class that does not exist.
            &format!("0::/kubepods/podnot-a-uid/{ID}\n"),
            &format!(
                "0::/kubepods-gold-pod{}.slice/cri-containerd-{ID}.scope\n",
                UID.replace('-', "_")
            ),
            "no colons at all\n::::\n\u{0}\u{ffff}",
        ] {
            assert_eq!(parse(text), None, "{text:?}");
        }
    }

    /// Issue 34, case 7: a path that merely contains another pod's IDs, below the process's
    /// own cgroup or outside Kubernetes, is never that pod's.
    #[test]
    fn another_pods_ids_anywhere_but_the_kubelets_place_are_not_that_pod() {
        const MINE: &str = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
        let my_id = "b".repeat(64);
        let uid = UID.replace('-', "_");
        for text in [
            // Outside the kubepods tree.
            format!("0::/system.slice/evil.service/kubepods/burstable/pod{UID}/{ID}\n"),
            format!("0::/user.slice/pod{UID}/{ID}\n"),
            format!("0::/evil.slice/kubepods-pod{uid}.slice/cri-containerd-{ID}.scope\n"),
            // Drivers mixed: a cgroupfs pod with a systemd container, and the reverse.
            format!("0::/kubepods/burstable/pod{UID}/cri-containerd-{ID}.scope\n"),
            format!("0::/kubepods.slice/kubepods-pod{uid}.slice/{ID}\n"),
            // Something other than a QoS level before the pod.
            format!("0::/kubepods/gold/pod{UID}/{ID}\n"),
            format!("0::/../../evil/pod{UID}/{ID}\n"),
        ] {
            assert_eq!(parse(&text), None, "{text:?}");
        }
        // Made below a container's own cgroup: still that container's.
        let text = format!("0::/kubepods/burstable/pod{MINE}/{my_id}/pod{UID}/{ID}\n");
        let found = parse(&text).expect("the outer container");
        assert_eq!(
            (found.pod_uid.as_str(), found.container_id.as_str()),
            (MINE, my_id.as_str())
        );
        let text = format!(
            "0::/kubepods.slice/kubepods-pod{}.slice/cri-containerd-{my_id}.scope/kubepods-pod{uid}.slice/cri-containerd-{ID}.scope\n",
            MINE.replace('-', "_")
        );
        assert_eq!(parse(&text).expect("the outer container").pod_uid, MINE);
    }

    #[test]
    fn a_vanished_process_is_none() {
        assert_eq!(container_of(u32::MAX), None);
    }
}
