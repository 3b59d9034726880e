//! The container runtime's CRI API (`runtime.v1.RuntimeService`, gRPC on the runtime's Unix
//! socket: containerd's `/run/containerd/containerd.sock`, CRI-O's `/var/run/crio/crio.sock`),
//! as far as the agent asks it: the ready pod sandboxes and each one's addresses and network
//! namespace. Only `runtime.v1` is spoken (containerd 1.7+, CRI-O 1.25+; `v1alpha2` is gone
//! from Kubernetes since 1.26).
//!
//! The socket gives whoever holds it the node (it starts containers): the agent mounts it only
//! where pushes from the pod network are turned on, and asks only these two read-only methods.

use std::path::Path;
use std::time::Duration;

use super::grpc::{self, GrpcError};

/// The messages of `k8s.io/cri-api/pkg/apis/runtime/v1`, as far as gpumem reads them (other
/// fields are skipped by the decoder).
pub mod api {
    use std::collections::HashMap;

    /// `ListPodSandboxRequest`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ListPodSandboxRequest {
        /// Which sandboxes.
        #[prost(message, optional, tag = "1")]
        pub filter: Option<PodSandboxFilter>,
    }

    /// `PodSandboxFilter`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PodSandboxFilter {
        /// One sandbox by ID.
        #[prost(string, tag = "1")]
        pub id: String,
        /// Sandboxes in this state.
        #[prost(message, optional, tag = "2")]
        pub state: Option<PodSandboxStateValue>,
        /// Sandboxes carrying these labels.
        #[prost(map = "string, string", tag = "3")]
        pub label_selector: HashMap<String, String>,
    }

    /// `PodSandboxStateValue`: a state wrapped, so that `SANDBOX_READY` (0) can be asked for.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PodSandboxStateValue {
        /// `PodSandboxState`.
        #[prost(enumeration = "PodSandboxState", tag = "1")]
        pub state: i32,
    }

    /// `PodSandboxState`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum PodSandboxState {
        /// Its network is set up and its containers may run.
        SandboxReady = 0,
        /// Stopped (its network torn down, its addresses released) or not yet ready.
        SandboxNotready = 1,
    }

    /// `ListPodSandboxResponse`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ListPodSandboxResponse {
        /// The sandboxes.
        #[prost(message, repeated, tag = "1")]
        pub items: Vec<PodSandbox>,
    }

    /// `PodSandbox`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PodSandbox {
        /// The runtime's ID of the sandbox.
        #[prost(string, tag = "1")]
        pub id: String,
        /// The pod it was made for.
        #[prost(message, optional, tag = "2")]
        pub metadata: Option<PodSandboxMetadata>,
        /// `PodSandboxState`.
        #[prost(enumeration = "PodSandboxState", tag = "3")]
        pub state: i32,
    }

    /// `PodSandboxMetadata`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PodSandboxMetadata {
        /// The pod's name.
        #[prost(string, tag = "1")]
        pub name: String,
        /// The pod's UID.
        #[prost(string, tag = "2")]
        pub uid: String,
        /// The pod's namespace.
        #[prost(string, tag = "3")]
        pub namespace: String,
        /// How many sandboxes the pod had before this one.
        #[prost(uint32, tag = "4")]
        pub attempt: u32,
    }

    /// `PodSandboxStatusRequest`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PodSandboxStatusRequest {
        /// The sandbox.
        #[prost(string, tag = "1")]
        pub pod_sandbox_id: String,
        /// Runtime-specific detail (never asked).
        #[prost(bool, tag = "2")]
        pub verbose: bool,
    }

    /// `PodSandboxStatusResponse`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PodSandboxStatusResponse {
        /// The status.
        #[prost(message, optional, tag = "1")]
        pub status: Option<PodSandboxStatus>,
    }

    /// `PodSandboxStatus`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PodSandboxStatus {
        /// The sandbox's ID.
        #[prost(string, tag = "1")]
        pub id: String,
        /// The pod it was made for.
        #[prost(message, optional, tag = "2")]
        pub metadata: Option<PodSandboxMetadata>,
        /// `PodSandboxState`.
        #[prost(enumeration = "PodSandboxState", tag = "3")]
        pub state: i32,
        /// Its addresses.
        #[prost(message, optional, tag = "5")]
        pub network: Option<PodSandboxNetworkStatus>,
        /// Its namespaces.
        #[prost(message, optional, tag = "6")]
        pub linux: Option<LinuxPodSandboxStatus>,
    }

    /// `PodSandboxNetworkStatus`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PodSandboxNetworkStatus {
        /// The primary address.
        #[prost(string, tag = "1")]
        pub ip: String,
        /// The others (dual stack).
        #[prost(message, repeated, tag = "2")]
        pub additional_ips: Vec<PodIp>,
    }

    /// `PodIP`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PodIp {
        /// An address.
        #[prost(string, tag = "1")]
        pub ip: String,
    }

    /// `LinuxPodSandboxStatus`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct LinuxPodSandboxStatus {
        /// Its namespaces.
        #[prost(message, optional, tag = "1")]
        pub namespaces: Option<Namespace>,
    }

    /// `Namespace`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Namespace {
        /// Which namespaces are the pod's own.
        #[prost(message, optional, tag = "2")]
        pub options: Option<NamespaceOption>,
    }

    /// `NamespaceOption`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct NamespaceOption {
        /// `NamespaceMode` of the network: `NODE` for a host-network pod.
        #[prost(enumeration = "NamespaceMode", tag = "1")]
        pub network: i32,
        /// `NamespaceMode` of the pids.
        #[prost(enumeration = "NamespaceMode", tag = "2")]
        pub pid: i32,
    }

    /// `NamespaceMode`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum NamespaceMode {
        /// The pod's own.
        Pod = 0,
        /// Each container's own.
        Container = 1,
        /// The node's.
        Node = 2,
        /// Another container's.
        Target = 3,
    }

    /// The full path of `ListPodSandbox`.
    pub const LIST_POD_SANDBOX: &str = "/runtime.v1.RuntimeService/ListPodSandbox";
    /// The full path of `PodSandboxStatus`.
    pub const POD_SANDBOX_STATUS: &str = "/runtime.v1.RuntimeService/PodSandboxStatus";
}

/// The first `max` ready sandboxes and the status of those `wanted` names (the IDs the caller
/// does not know yet), over one connection. A sandbox that went between the two calls (its
/// status answered `NotFound`) is left out.
///
/// # Errors
/// The runtime did not answer, or answered a status other than OK or `NotFound`.
pub async fn ready_sandboxes(
    socket: &Path,
    timeout: Duration,
    max: usize,
    wanted: impl Fn(&str) -> bool,
) -> Result<(Vec<api::PodSandbox>, Vec<api::PodSandboxStatus>), GrpcError> {
    let channel = grpc::connect(socket, timeout).await?;
    let request = api::ListPodSandboxRequest {
        filter: Some(api::PodSandboxFilter {
            state: Some(api::PodSandboxStateValue {
                state: api::PodSandboxState::SandboxReady as i32,
            }),
            ..Default::default()
        }),
    };
    let mut list: api::ListPodSandboxResponse =
        grpc::unary(channel.clone(), api::LIST_POD_SANDBOX, request).await?;
    list.items.truncate(max);
    let mut statuses = Vec::new();
    for sandbox in list.items.iter().filter(|s| wanted(&s.id)) {
        let request = api::PodSandboxStatusRequest {
            pod_sandbox_id: sandbox.id.clone(),
            verbose: false,
        };
        match grpc::unary::<_, api::PodSandboxStatusResponse>(
            channel.clone(),
            api::POD_SANDBOX_STATUS,
            request,
        )
        .await
        {
            Ok(answer) => statuses.extend(answer.status),
            Err(GrpcError::Status {
                code: tonic::Code::NotFound,
                ..
            }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok((list.items, statuses))
}
