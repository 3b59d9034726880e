//! Which pod a connection comes from, by its peer address: pushes from the pod network are
//! attributed by the node, never by what the payload says.
//!
//! The container runtime ([`super::cri`]) lists the ready pod sandboxes; each one's status
//! gives its addresses (`network.ip` and `additional_ips`) and whether it shares the node's
//! network namespace. A peer is then one pod ([`Attribution::Pod`]), the node itself
//! ([`Attribution::Node`]: one of the node's addresses the agent was given, or a host-network
//! pod's, which is the node's; masquerading kube-proxy and hairpin SNAT look the same), or
//! unknown ([`Attribution::Unknown`]: another node's, a pod gone, or an address two sandboxes
//! claim).
//!
//! # Invariants
//! - Pod addresses are reused: the list of ready sandboxes a peer is looked up in is at most
//!   [`MAX_LIST_AGE`] old (a stopped sandbox has released its address; a new pod cannot be
//!   given it, started and push within that time). Statuses are cached by sandbox ID, which
//!   the runtime never reuses, and dropped with their sandbox.
//! - At most [`MAX_SANDBOXES`] sandboxes are kept (a node runs 110 pods by default); beyond
//!   them a peer is unknown. Lookups share one list: concurrent pushes wait for the one
//!   refresh under way (at most [`REFRESH_LIMIT`]) rather than each asking the runtime.
//! - Where the runtime does not answer, nothing is attributed (a cached address may be
//!   another pod's by now): the push is refused, and the error says why.

use std::collections::HashMap;
use std::net::IpAddr;
#[cfg(feature = "kubelet")]
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[cfg(feature = "kubelet")]
use super::cri::{self, api};
#[cfg(feature = "kubelet")]
use super::grpc::GrpcError;

/// The oldest sandbox list a peer is looked up in.
pub const MAX_LIST_AGE: Duration = Duration::from_millis(250);
/// Sandboxes kept.
pub const MAX_SANDBOXES: usize = 4096;
/// The longest a refresh of the sandboxes takes (a list and a status per new sandbox).
pub const REFRESH_LIMIT: Duration = Duration::from_secs(5);
/// Addresses kept per sandbox (dual stack has two).
pub const MAX_ADDRESSES: usize = 8;

/// A pod as its sandbox names it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PodPeer {
    /// `metadata.uid`.
    pub uid: String,
    /// `metadata.namespace`.
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
}

/// Who a peer address is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Attribution {
    /// One ready pod's own address.
    Pod(PodPeer),
    /// The node's: its own address, or a host-network pod's.
    Node,
    /// No ready pod's, or more than one's.
    Unknown,
}

/// One ready sandbox, as its status described it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sandbox {
    /// Its pod.
    pub pod: PodPeer,
    /// Its addresses.
    pub addresses: Vec<IpAddr>,
    /// It shares the node's network namespace (its addresses are the node's).
    pub host_network: bool,
}

/// The ready sandboxes by ID, and when they were listed.
#[derive(Debug, Default)]
pub struct Sandboxes {
    by_id: HashMap<String, Sandbox>,
    listed: Option<Instant>,
}

impl Sandboxes {
    /// Whether a lookup at `now` needs a new list.
    pub fn stale(&self, now: Instant) -> bool {
        self.listed
            .is_none_or(|at| now.saturating_duration_since(at) >= MAX_LIST_AGE)
    }

    /// Whether `id` is known (its status need not be asked again).
    pub fn knows(&self, id: &str) -> bool {
        self.by_id.contains_key(id)
    }

    /// Replaces the list by `ready` (the IDs the runtime listed as ready at `now`), adding
    /// the sandboxes of `statuses` (those not known before); sandboxes no longer ready go.
    pub fn update<'a>(
        &mut self,
        ready: impl IntoIterator<Item = &'a str>,
        statuses: Vec<(String, Sandbox)>,
        now: Instant,
    ) {
        let ready: std::collections::HashSet<&str> = ready.into_iter().collect();
        self.by_id.retain(|id, _| ready.contains(id.as_str()));
        for (id, sandbox) in statuses {
            if self.by_id.len() >= MAX_SANDBOXES {
                break;
            }
            if ready.contains(id.as_str()) {
                self.by_id.insert(id, sandbox);
            }
        }
        self.listed = Some(now);
    }

    /// Who `peer` is among the sandboxes (the node's own addresses are the caller's).
    pub fn attribute(&self, peer: IpAddr) -> Attribution {
        let peer = peer.to_canonical();
        let mut found: Option<&Sandbox> = None;
        for sandbox in self.by_id.values() {
            if !sandbox.addresses.contains(&peer) {
                continue;
            }
            if sandbox.host_network {
                return Attribution::Node;
            }
            if found.is_some_and(|f| f.pod != sandbox.pod) {
                return Attribution::Unknown;
            }
            found = Some(sandbox);
        }
        found.map_or(Attribution::Unknown, |s| Attribution::Pod(s.pod.clone()))
    }
}

/// A sandbox from its status: `None` without a pod (no metadata) or when not ready.
#[cfg(feature = "kubelet")]
pub fn sandbox_of(status: &api::PodSandboxStatus) -> Option<(String, Sandbox)> {
    let metadata = status.metadata.as_ref()?;
    if status.state != api::PodSandboxState::SandboxReady as i32 || metadata.uid.is_empty() {
        return None;
    }
    let host_network = status
        .linux
        .as_ref()
        .and_then(|l| l.namespaces.as_ref())
        .and_then(|n| n.options.as_ref())
        .is_some_and(|o| o.network == api::NamespaceMode::Node as i32);
    let addresses = status
        .network
        .iter()
        .flat_map(|n| {
            std::iter::once(n.ip.as_str()).chain(n.additional_ips.iter().map(|a| a.ip.as_str()))
        })
        .filter_map(|ip| ip.parse::<IpAddr>().ok())
        .map(|ip| ip.to_canonical())
        .take(MAX_ADDRESSES)
        .collect();
    let pod = PodPeer {
        uid: metadata.uid.clone(),
        namespace: metadata.namespace.clone(),
        name: metadata.name.clone(),
    };
    Some((
        status.id.clone(),
        Sandbox {
            pod,
            addresses,
            host_network,
        },
    ))
}

/// Attributes peers through the container runtime on `socket` (see the module's invariants).
#[cfg(feature = "kubelet")]
pub struct PodNetwork {
    socket: PathBuf,
    timeout: Duration,
    node_addresses: Vec<IpAddr>,
    sandboxes: tokio::sync::Mutex<Sandboxes>,
}

#[cfg(feature = "kubelet")]
impl PodNetwork {
    /// Asks the runtime on `socket`, each call within `timeout`; `node_addresses` are the
    /// node's own (the chart passes `status.hostIP`).
    pub fn new(socket: PathBuf, node_addresses: Vec<IpAddr>, timeout: Duration) -> PodNetwork {
        PodNetwork {
            socket,
            timeout,
            node_addresses: node_addresses.iter().map(|a| a.to_canonical()).collect(),
            sandboxes: tokio::sync::Mutex::new(Sandboxes::default()),
        }
    }

    /// Who `peer` is.
    ///
    /// # Errors
    /// The runtime did not answer (nothing is attributed then).
    pub async fn attribute(&self, peer: IpAddr) -> Result<Attribution, GrpcError> {
        let peer = peer.to_canonical();
        if self.node_addresses.contains(&peer) {
            return Ok(Attribution::Node);
        }
        let mut sandboxes = self.sandboxes.lock().await;
        if sandboxes.stale(Instant::now()) {
            // One deadline for the whole refresh (a list and a status per new sandbox), so
            // pushes waiting on the lock wait for at most that.
            let refresh = cri::ready_sandboxes(&self.socket, self.timeout, MAX_SANDBOXES, |id| {
                !sandboxes.knows(id)
            });
            let (ready, statuses) = tokio::time::timeout(REFRESH_LIMIT, refresh)
                .await
                .map_err(|_| {
                    GrpcError::NotReady(format!("no answer within {REFRESH_LIMIT:?}"))
                })??;
            let statuses = statuses.iter().filter_map(sandbox_of).collect();
            // The list's time, not the statuses': a sandbox listed ready then may have
            // stopped while its status was asked.
            sandboxes.update(
                ready.iter().map(|s| s.id.as_str()),
                statuses,
                Instant::now(),
            );
        }
        Ok(sandboxes.attribute(peer))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str) -> PodPeer {
        PodPeer {
            uid: format!("uid-{name}"),
            namespace: "team".into(),
            name: name.into(),
        }
    }

    fn sandbox(name: &str, addresses: &[&str], host_network: bool) -> (String, Sandbox) {
        (
            format!("id-{name}"),
            Sandbox {
                pod: pod(name),
                addresses: addresses
                    .iter()
                    .map(|a| a.parse().expect("an address"))
                    .collect(),
                host_network,
            },
        )
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("an address")
    }

    #[test]
    fn peers_are_pods_the_node_or_unknown() {
        let mut table = Sandboxes::default();
        let now = Instant::now();
        assert!(table.stale(now));
        table.update(
            ["id-a", "id-b", "id-host", "id-twin"],
            vec![
                sandbox("a", &["10.0.0.2", "fd00::2"], false),
                sandbox("b", &["10.0.0.3"], false),
                sandbox("host", &["192.168.1.5"], true),
                sandbox("twin", &["10.0.0.9"], false),
                sandbox("gone", &["10.0.0.4"], false),
            ],
            now,
        );
        assert!(!table.stale(now));
        assert!(table.stale(now + MAX_LIST_AGE));
        assert_eq!(table.attribute(ip("10.0.0.2")), Attribution::Pod(pod("a")));
        assert_eq!(table.attribute(ip("fd00::2")), Attribution::Pod(pod("a")));
        // A dual-stack listener sees IPv4 peers mapped into IPv6.
        assert_eq!(
            table.attribute(ip("::ffff:10.0.0.3")),
            Attribution::Pod(pod("b"))
        );
        assert_eq!(table.attribute(ip("192.168.1.5")), Attribution::Node);
        // Listed as a status but not as ready: never kept.
        assert_eq!(table.attribute(ip("10.0.0.4")), Attribution::Unknown);
        assert_eq!(table.attribute(ip("10.0.0.99")), Attribution::Unknown);

        // A second sandbox claiming an address makes it no one's.
        table.update(
            ["id-a", "id-twin", "id-twin2"],
            vec![sandbox("twin2", &["10.0.0.9"], false)],
            now,
        );
        assert_eq!(table.attribute(ip("10.0.0.9")), Attribution::Unknown);
        // b stopped: its address is no one's until a ready sandbox has it.
        assert_eq!(table.attribute(ip("10.0.0.3")), Attribution::Unknown);
        assert_eq!(table.attribute(ip("10.0.0.2")), Attribution::Pod(pod("a")));
    }

    #[cfg(feature = "kubelet")]
    #[test]
    fn statuses_read_addresses_and_host_network() {
        let status = |network: i32, state: api::PodSandboxState| api::PodSandboxStatus {
            id: "sb".into(),
            metadata: Some(api::PodSandboxMetadata {
                name: "p".into(),
                uid: "u".into(),
                namespace: "n".into(),
                attempt: 0,
            }),
            state: state as i32,
            network: Some(api::PodSandboxNetworkStatus {
                ip: "10.1.0.7".into(),
                additional_ips: vec![
                    api::PodIp {
                        ip: "fd00::7".into(),
                    },
                    api::PodIp {
                        ip: "not an address".into(),
                    },
                ],
            }),
            linux: Some(api::LinuxPodSandboxStatus {
                namespaces: Some(api::Namespace {
                    options: Some(api::NamespaceOption { network, pid: 0 }),
                }),
            }),
        };
        let (id, sandbox) =
            sandbox_of(&status(0, api::PodSandboxState::SandboxReady)).expect("ready");
        assert_eq!(id, "sb");
        assert_eq!(sandbox.addresses, vec![ip("10.1.0.7"), ip("fd00::7")]);
        assert!(!sandbox.host_network);
        let (_, host) = sandbox_of(&status(
            api::NamespaceMode::Node as i32,
            api::PodSandboxState::SandboxReady,
        ))
        .expect("ready");
        assert!(host.host_network);
        assert_eq!(
            sandbox_of(&status(0, api::PodSandboxState::SandboxNotready)),
            None
        );
    }
}
