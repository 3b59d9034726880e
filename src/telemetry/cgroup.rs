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
    let components: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
    // The container's cgroup sits directly below its pod's.
    components.windows(2).find_map(|pair| {
        let pod_uid = pod_uid(pair[0])?;
        let (container_id, runtime) = container(pair[1])?;
        Some(ContainerRef {
            pod_uid,
            container_id,
            runtime,
        })
    })
}

/// `pod<uid>` (cgroupfs) or `kubepods[-<qos>]-pod<uid with _>.slice` (systemd).
fn pod_uid(component: &str) -> Option<String> {
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
    is_pod_uid(&raw).then_some(raw)
}

fn container(component: &str) -> Option<(String, Runtime)> {
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
    is_container_id(id).then(|| (id.to_owned(), runtime))
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

    #[test]
    fn a_vanished_process_is_none() {
        assert_eq!(container_of(u32::MAX), None);
    }
}
