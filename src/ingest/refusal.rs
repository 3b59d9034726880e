//! Why a push is refused: the refusal's kind (the ingest counter's `result` label) and its
//! message. A leaf of the ingest.

/// Why a payload was refused; the `result` label of the ingest counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// Not JSON, or not the payload's shape.
    Malformed,
    /// The body ended early or its chunked encoding was broken.
    Truncated,
    /// The right shape with impossible values (negative sizes, a zero pid, ...).
    Invalid,
    /// Not after the last accepted push of the same process.
    Stale,
    /// The process pushes faster than the rate limit.
    RateLimited,
    /// Too many processes are tracked already.
    Capacity,
    /// The pushed series would exceed the agent's series budget.
    SeriesBudget,
    /// A TCP push for a pid the kernel attributed to a socket pusher.
    Conflict,
    /// The body exceeds [`super::limits::MAX_BODY_BYTES`].
    TooLarge,
    /// Not `Content-Type: application/json`, or sent by a browser (an `Origin` header), or
    /// from a pod whose labels name another pod.
    Forbidden,
    /// From the pod network, from an address that is no ready pod's on this node.
    UnknownPeer,
    /// From the pod network, from the node's own address (a host-network sender, or a
    /// connection masqueraded on its way): no pod can be named.
    PeerIsNode,
    /// From a pod, naming a pid none of its processes has.
    NotInPod,
}

impl Refusal {
    /// All reasons, in the order the counter lists them.
    pub const ALL: [Refusal; 13] = [
        Refusal::Malformed,
        Refusal::Truncated,
        Refusal::Invalid,
        Refusal::Stale,
        Refusal::RateLimited,
        Refusal::Capacity,
        Refusal::SeriesBudget,
        Refusal::Conflict,
        Refusal::TooLarge,
        Refusal::Forbidden,
        Refusal::UnknownPeer,
        Refusal::PeerIsNode,
        Refusal::NotInPod,
    ];

    /// The metric label and the error's kind.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Malformed => "malformed",
            Refusal::Truncated => "truncated",
            Refusal::Invalid => "invalid",
            Refusal::Stale => "stale",
            Refusal::RateLimited => "rate_limited",
            Refusal::Capacity => "capacity",
            Refusal::SeriesBudget => "series_budget",
            Refusal::Conflict => "conflict",
            Refusal::TooLarge => "too_large",
            Refusal::Forbidden => "forbidden",
            Refusal::UnknownPeer => "unknown_peer",
            Refusal::PeerIsNode => "peer_is_node",
            Refusal::NotInPod => "not_in_pod",
        }
    }
}

/// A refused payload: why, in words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejected {
    /// The kind of refusal.
    pub refusal: Refusal,
    /// What was wrong.
    pub message: String,
}

impl Rejected {
    /// A refusal of `kind` saying `message`.
    pub fn new(refusal: Refusal, message: impl Into<String>) -> Rejected {
        Rejected {
            refusal,
            message: message.into(),
        }
    }
}

pub(crate) fn invalid(message: impl Into<String>) -> Rejected {
    Rejected::new(Refusal::Invalid, message)
}
