//! Attribution, a push's second phase: who sent it, as the agent (not the payload) knows it.
//!
//! The kernel names a Unix-socket peer ([`Peer`]), the node a pod on the pod network (its
//! address, then one of its processes by the pid the payload gives in the pod's namespace);
//! a loopback TCP push is only its payload's word. [`attribute`] replaces the payload's pid
//! by the host's where the kernel or the node named it, and finds its container and pod.
//!
//! # Invariants
//! - A socket peer speaks for its pid only while the process that connected lives (its start
//!   time unchanged since the accept); one whose start time was never read is refused.
//! - A pod's push names one of that pod's processes, and its labels name no other pod or
//!   container than the node found.
//! - The kernel's word outranks the node's, and both a payload's ([`Origin`]'s order, which
//!   the store's admission applies).

use crate::metrics::contract::label;
use crate::telemetry::cgroup::ContainerRef;
use crate::telemetry::pod_network::PodPeer;
use crate::telemetry::process;

use super::config::IngestConfig;
use super::payload::ValidPush;
use super::refusal::{Refusal, Rejected};

/// A pushing process as the kernel named it when it connected (`SO_PEERCRED`, in the agent's
/// pid namespace), with its start time as read when the agent accepted the connection. A
/// push must still come from that process: one whose pid has gone (or is another process's)
/// is refused. A child that inherited the connection pushes as its parent while the parent
/// lives: the parent handed it the socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    /// Its pid.
    pub pid: u32,
    /// Its start time when it connected (`/proc/<pid>/stat`); `None` where nothing proves
    /// whose the pid was then (the process gone by the accept, or its handle says it has
    /// exited since): its pushes and uploads are refused.
    pub start_time: Option<u64>,
    /// Its user, where the kernel said (`SO_PEERCRED`): a host process's tenant.
    pub uid: Option<u32>,
}

impl Peer {
    /// The process `pid` is now (its user not said).
    pub fn now(pid: u32) -> Peer {
        Peer {
            pid,
            start_time: process::start_time(pid),
            uid: None,
        }
    }
}

/// Who sent a push, as the agent (not the payload) knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Sender {
    /// A TCP peer on this host (loopback): the payload's pid and start time are its word.
    Unattributed,
    /// A process the kernel named (a Unix-socket peer).
    Process(Peer),
    /// A pod, by its address on the pod network: the payload's pid must be one of the pod's
    /// processes, in the pod's own pid namespace ([`pod_processes`](crate::telemetry::pod_processes)).
    Pod(PodPeer),
}

impl From<Option<Peer>> for Sender {
    fn from(peer: Option<Peer>) -> Sender {
        peer.map_or(Sender::Unattributed, Sender::Process)
    }
}

/// Who vouches for a tracked process's pid.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Origin {
    /// The kernel (a socket pusher): the pid is the sender's.
    Socket,
    /// The node, for a pod (by UID): the pid is a process of that pod.
    Pod(String),
    /// The payload (a loopback TCP pusher).
    Tcp,
}

impl Origin {
    /// The pid is a host pid, checked in `/proc`.
    pub(super) fn host_pid(&self) -> bool {
        *self != Origin::Tcp
    }

    pub(super) fn pod(&self) -> Option<&str> {
        match self {
            Origin::Pod(uid) => Some(uid),
            _ => None,
        }
    }
}

/// Who a push is from, as [`attribute`] found it.
pub(super) struct Identity {
    pub origin: Origin,
    /// Its start time: the kernel's or the node's where they said, else the payload's.
    pub start_time: Option<u64>,
    /// Its container, where the kernel or the node named it.
    pub container: Option<ContainerRef>,
    /// Its pod's namespace and name, where the pod network named it.
    pub pod_names: Option<(String, String)>,
}

impl Identity {
    /// A push's labels with its container's and pod's, where the kernel or the node named
    /// them.
    pub(super) fn labels(&self, mut labels: Vec<(String, String)>) -> Vec<(String, String)> {
        if let Some(c) = &self.container {
            labels.push((label::POD_UID.into(), c.pod_uid.clone()));
            labels.push((label::CONTAINER_ID.into(), c.container_id.clone()));
        }
        if let Some((namespace, name)) = &self.pod_names {
            labels.push((label::POD_NAMESPACE.into(), namespace.clone()));
            labels.push((label::POD_NAME.into(), name.clone()));
        }
        labels
    }
}

/// Who the pid is: a host pid with its start time from /proc and its container, or the
/// payload's own word (which tells apart, say, two containers' pid 1). Replaces the
/// payload's pid by the host's where the kernel or the node named it.
pub(super) fn attribute(
    config: &IngestConfig,
    push: &mut ValidPush,
    sender: Sender,
) -> Result<Identity, Rejected> {
    Ok(match sender {
        Sender::Unattributed => Identity {
            origin: Origin::Tcp,
            start_time: push.start_time,
            container: None,
            pod_names: None,
        },
        Sender::Process(peer) => {
            let now = (config.start_time)(peer.pid);
            // The connecting process exited (its connection inherited by a child, say):
            // its pid is no one's now, or another process's. Where its start time was not
            // read at the accept (it had gone by then), nothing proves whose the pid is.
            if peer.start_time.is_none() || now != peer.start_time {
                return Err(Rejected::new(
                    Refusal::Forbidden,
                    format!(
                        "pid {} is no longer the process that opened this connection; connect again",
                        peer.pid
                    ),
                ));
            }
            push.pid = peer.pid;
            Identity {
                origin: Origin::Socket,
                start_time: now,
                container: (config.resolve)(peer.pid),
                pod_names: None,
            }
        }
        Sender::Pod(pod) => {
            let found = (config.pod_process)(&pod.uid, push.pid, push.start_time)
                .map_err(|e| Rejected::new(Refusal::NotInPod, e.to_string()))?;
            check_identity(&push.labels, &pod, &found.container)?;
            push.pid = found.pid;
            Identity {
                origin: Origin::Pod(pod.uid),
                start_time: Some(found.start_time),
                container: Some(found.container),
                // The runtime named the pod: its series need no kubelet directory for that.
                pod_names: Some((pod.namespace, pod.name)),
            }
        }
    })
}

/// Refuses a pod's push whose labels name another pod or container than the node found
/// (`container`, the name, is not checked: the sandbox does not say it, and it names no
/// other pod).
fn check_identity(
    labels: &[(String, String)],
    pod: &PodPeer,
    container: &ContainerRef,
) -> Result<(), Rejected> {
    for (name, value) in labels {
        // A colliding name is exported as `exported_<name>`: still a claim.
        let base = name.strip_prefix("exported_").unwrap_or(name);
        let own = match base {
            label::POD_UID => &pod.uid,
            "namespace" | label::POD_NAMESPACE => &pod.namespace,
            "pod" | label::POD_NAME => &pod.name,
            label::CONTAINER_ID => &container.container_id,
            _ => continue,
        };
        if value != own {
            return Err(Rejected::new(
                Refusal::Forbidden,
                format!(
                    "label {name}={value:?} names another pod than the sender ({}/{}, uid {})",
                    pod.namespace, pod.name, pod.uid
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ingest::payload::validate;
    use crate::telemetry::cgroup::Runtime;
    use crate::telemetry::pod_processes::{NotInPod, PodProcess};

    const POD: &str = "0b5c9a11-2f3e-4d5a-8b7c-6e1f2a3b4c5d";

    fn container(pid: u32) -> Option<ContainerRef> {
        Some(ContainerRef {
            pod_uid: POD.into(),
            container_id: format!("{pid:064x}"),
            runtime: Runtime::Containerd,
        })
    }

    /// Pid 10 started at tick 5; no other pid exists.
    fn started(pid: u32) -> Option<u64> {
        (pid == 10).then_some(5)
    }

    /// The pod's pid 1, started at tick 9, is host pid 4242.
    fn in_pod(uid: &str, pid: u32, start: Option<u64>) -> Result<PodProcess, NotInPod> {
        if uid == POD && pid == 1 && start.is_none_or(|t| t == 9) {
            return Ok(PodProcess {
                pid: 4242,
                start_time: 9,
                container: container(4242).expect("a container"),
            });
        }
        Err(NotInPod::Missing {
            pod_uid: uid.into(),
            pid,
            start_time: start,
        })
    }

    fn config() -> IngestConfig {
        IngestConfig {
            resolve: container,
            start_time: started,
            pod_process: in_pod,
            ..IngestConfig::default()
        }
    }

    fn push(labels: serde_json::Value) -> ValidPush {
        let body = serde_json::json!({"pid": 1, "seq": 1, "start_time": 9, "labels": labels,
            "devices": [{"index": 0, "uuid": "GPU-a", "stats": {}}]});
        validate(body.to_string().as_bytes()).expect("valid")
    }

    fn pod() -> PodPeer {
        PodPeer {
            uid: POD.into(),
            namespace: "ml".into(),
            name: "train-0".into(),
        }
    }

    #[test]
    fn a_loopback_push_is_its_payloads_word() {
        let mut p = push(serde_json::json!({}));
        let who = attribute(&config(), &mut p, Sender::Unattributed).expect("attributed");
        assert_eq!(
            (p.pid, &who.origin, who.start_time),
            (1, &Origin::Tcp, Some(9))
        );
        assert!(who.container.is_none() && who.pod_names.is_none());
        assert!(!who.origin.host_pid());
    }

    #[test]
    fn a_socket_peer_speaks_for_its_pid_while_the_process_that_connected_lives() {
        let peer = |start_time| {
            Sender::Process(Peer {
                pid: 10,
                start_time,
                uid: Some(1000),
            })
        };
        let mut p = push(serde_json::json!({}));
        let who = attribute(&config(), &mut p, peer(Some(5))).expect("attributed");
        assert_eq!(
            (p.pid, &who.origin, who.start_time),
            (10, &Origin::Socket, Some(5))
        );
        assert_eq!(who.container, container(10));
        // Another process under its pid now, or one whose start was never read.
        for stale in [Some(4), None] {
            let mut p = push(serde_json::json!({}));
            let refused = attribute(&config(), &mut p, peer(stale)).err();
            assert_eq!(refused.map(|r| r.refusal), Some(Refusal::Forbidden));
            assert_eq!(p.pid, 1, "a refused push keeps its own pid");
        }
    }

    #[test]
    fn a_pods_push_is_its_process_and_names_no_other_pod() {
        let mut p = push(serde_json::json!({"pod_name": "train-0", "team": "a"}));
        let who = attribute(&config(), &mut p, Sender::Pod(pod())).expect("attributed");
        assert_eq!((p.pid, who.start_time), (4242, Some(9)));
        assert_eq!(who.origin, Origin::Pod(POD.into()));
        assert_eq!(who.origin.pod(), Some(POD));
        let labels = who.labels(vec![("team".into(), "a".into())]);
        let names: Vec<&str> = labels.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            names,
            [
                "team",
                "pod_uid",
                "container_id",
                "pod_namespace",
                "pod_name"
            ]
        );
        assert_eq!(labels[3].1, "ml");
        // A label naming another pod, and a pid the pod does not have.
        let mut other = push(serde_json::json!({"pod_name": "serve-1"}));
        let refused = attribute(&config(), &mut other, Sender::Pod(pod())).err();
        assert_eq!(refused.map(|r| r.refusal), Some(Refusal::Forbidden));
        let mut missing = push(serde_json::json!({}));
        missing.pid = 2;
        let refused = attribute(&config(), &mut missing, Sender::Pod(pod())).err();
        assert_eq!(refused.map(|r| r.refusal), Some(Refusal::NotInPod));
    }
}
