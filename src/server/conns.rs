//! The connections a listener serves, and which one gives way when they are too many.
//!
//! A connection *progresses* when it reads or writes a byte (`listen.rs` tells it), and has
//! an [`Owner`] where the agent can tell who is at the other end: its *group* (a socket
//! peer's pod, or its user on the host; a TCP peer's address) and, for a socket peer, its
//! process. A listener at its cap that accepts one more connection evicts one: a connection
//! not serving a request where there is one (a request being handled makes no progress, yet
//! its client waits for the answer), of the group holding the most connections, the one of
//! those that progressed least recently. So a new client (a liveness probe) is always
//! accepted, never left in the kernel's backlog, and a group churning connections (however
//! many processes it forks) evicts its own, not another's request. What a connection's
//! request holds (`slots.rs`) is taken from it by progress alone.
//!
//! # Invariants
//! - A listener holds at most its cap of connections that were not evicted; accepting
//!   never waits for room: the evicted one's place is free from the moment it is chosen.
//! - Eviction never takes a connection serving a request while one that is not exists, nor
//!   one of a group holding fewer connections than another group among those.
//! - An evicted connection ends at its next poll: its request, if any, is dropped with what
//!   it held (slots, buffers), which come back then.
//! - Bookkeeping is a map per listener, scanned when it is full: at most the cap's entries,
//!   each a pointer.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;
use tokio::sync::Notify;

/// Milliseconds since the first use: the coarse clock of progress.
fn now_ms() -> u64 {
    static EPOCH: LazyLock<Instant> = LazyLock::new(Instant::now);
    EPOCH.elapsed().as_millis() as u64
}

/// Who is at the other end of a connection, as far as the agent can tell: its group, which
/// connections are shared out by (a socket peer's pod or, on the host, its user, so that a
/// process forking a crowd gains nothing), and its process where the kernel named one, which
/// slots are shared out by (a request of one process waits behind no crowd of another's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Owner {
    /// Whose connections it counts among.
    pub group: Group,
    /// The socket peer's pid.
    pub process: Option<u32>,
}

/// What connections are shared out by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Group {
    /// A socket peer's pod, by a hash of its UID.
    Pod(u64),
    /// A socket peer on the host, by its user.
    User(u32),
    /// A TCP peer's address (every loopback client is one).
    Address(std::net::IpAddr),
}

impl Owner {
    /// A process of the pod with UID `uid`.
    pub fn pod(uid: &str, process: Option<u32>) -> Owner {
        use std::hash::{BuildHasher, BuildHasherDefault};
        let pod = BuildHasherDefault::<rustc_hash::FxHasher>::default().hash_one(uid);
        Owner {
            group: Group::Pod(pod),
            process,
        }
    }

    /// A process of user `uid` on the host.
    pub fn user(uid: u32, process: Option<u32>) -> Owner {
        Owner {
            group: Group::User(uid),
            process,
        }
    }

    /// A TCP peer.
    pub fn address(ip: std::net::IpAddr) -> Owner {
        Owner {
            group: Group::Address(ip),
            process: None,
        }
    }
}

/// One served connection: when it last progressed, and whether it was told to end.
#[derive(Clone, Debug)]
pub struct Connection(Arc<ConnectionState>);

#[derive(Debug)]
struct ConnectionState {
    id: u64,
    /// Who is at the other end where the agent can tell: connections and slots are shared
    /// out among owners.
    owner: Option<Owner>,
    last: AtomicU64,
    /// Requests being served (hyper serves one at a time per connection).
    serving: AtomicUsize,
    evicted: AtomicBool,
    notify: Notify,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl Connection {
    pub(super) fn new(owner: Option<Owner>) -> Connection {
        Connection(Arc::new(ConnectionState {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            owner,
            last: AtomicU64::new(now_ms()),
            serving: AtomicUsize::new(0),
            evicted: AtomicBool::new(false),
            notify: Notify::new(),
        }))
    }

    /// A connection of its own, in no listener (a request served without a socket).
    pub fn detached() -> Connection {
        Connection::new(None)
    }

    /// Who is at the other end, where the agent can tell.
    pub(super) fn owner(&self) -> Option<Owner> {
        self.0.owner
    }

    /// A request is being served on it until the returned guard drops.
    pub(super) fn serving(&self) -> Serving {
        self.0.serving.fetch_add(1, Ordering::AcqRel);
        Serving(self.clone())
    }

    fn is_serving(&self) -> bool {
        self.0.serving.load(Ordering::Acquire) > 0
    }

    /// Its identity among the connections served.
    pub(super) fn id(&self) -> u64 {
        self.0.id
    }

    /// A byte was read or written (or a slot came: a request that waited for one starts
    /// afresh).
    pub fn progressed(&self) {
        self.0.last.store(now_ms(), Ordering::Relaxed);
    }

    pub(super) fn stalled_since(&self) -> u64 {
        self.0.last.load(Ordering::Relaxed)
    }

    pub(super) fn is_evicted(&self) -> bool {
        self.0.evicted.load(Ordering::Acquire)
    }

    /// Tells the connection to end.
    pub(super) fn evict(&self) {
        if !self.0.evicted.swap(true, Ordering::AcqRel) {
            // A stored permit: the connection's task sees it even if it is not waiting yet.
            self.0.notify.notify_one();
        }
    }

    /// Completes once the connection was evicted.
    pub async fn evicted(&self) {
        while !self.0.evicted.load(Ordering::Acquire) {
            self.0.notify.notified().await;
        }
    }
}

/// A request being served on a connection, until dropped.
#[derive(Debug)]
pub(super) struct Serving(Connection);

impl Drop for Serving {
    fn drop(&mut self) {
        self.0.0.serving.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The least recently progressed of `candidates` (their keys and connections), if it has
/// been stalled for at least `min_stall`.
pub(super) fn most_stalled<'a>(
    candidates: impl Iterator<Item = (&'a u64, &'a Connection)>,
    min_stall: Duration,
) -> Option<u64> {
    let (key, conn) = candidates.min_by_key(|(_, c)| c.stalled_since())?;
    let stalled = now_ms().saturating_sub(conn.stalled_since());
    (stalled >= min_stall.as_millis() as u64).then_some(*key)
}

/// A listener's connections, at most `cap` of them.
#[derive(Debug)]
pub struct Connections {
    cap: usize,
    live: Mutex<FxHashMap<u64, Connection>>,
}

impl Connections {
    /// At most `cap` (at least one) connections at once.
    pub fn new(cap: usize) -> Arc<Connections> {
        Arc::new(Connections {
            cap: cap.max(1),
            live: Mutex::default(),
        })
    }

    /// A new connection from `owner` (where the agent can tell), counted until the returned
    /// guard drops; where that makes one too many, another is evicted (see the module
    /// documentation for which).
    pub fn admit(self: &Arc<Self>, owner: Option<Owner>) -> Admitted {
        let conn = Connection::new(owner);
        let mut live = self.live.lock().unwrap_or_else(PoisonError::into_inner);
        if live.len() >= self.cap
            && let Some(victim) = victim(&live)
            && let Some(victim) = live.remove(&victim)
        {
            victim.evict();
        }
        live.insert(conn.0.id, conn.clone());
        drop(live);
        Admitted {
            connections: Arc::clone(self),
            conn,
        }
    }

    /// Connections counted now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.live
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// The connection to evict from a full listener: among those not serving a request (all,
/// where every one is), those of the group holding the most connections, the least recently
/// progressed of them. Connections without an owner count as one group.
fn victim(live: &FxHashMap<u64, Connection>) -> Option<u64> {
    let group = |c: &Connection| c.owner().map(|o| o.group);
    let mut held: FxHashMap<Option<Group>, usize> = FxHashMap::default();
    for conn in live.values() {
        *held.entry(group(conn)).or_default() += 1;
    }
    let idle = live.values().any(|c| !c.is_serving());
    live.iter()
        .filter(|(_, c)| !(idle && c.is_serving()))
        .min_by_key(|(_, c)| {
            let holds = held.get(&group(c)).copied().unwrap_or(0);
            (std::cmp::Reverse(holds), c.stalled_since())
        })
        .map(|(key, _)| *key)
}

/// A connection counted by its listener until dropped.
#[derive(Debug)]
pub struct Admitted {
    connections: Arc<Connections>,
    conn: Connection,
}

impl Admitted {
    /// The connection.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.connections
            .live
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.conn.0.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_listener_evicts_the_least_recently_progressed() {
        let connections = Connections::new(3);
        let a = connections.admit(None);
        std::thread::sleep(Duration::from_millis(5));
        let b = connections.admit(None);
        std::thread::sleep(Duration::from_millis(5));
        let c = connections.admit(None);
        std::thread::sleep(Duration::from_millis(5));
        // `a` is the oldest but progresses: `b` is now the least recent.
        a.connection().progressed();
        let d = connections.admit(None);
        assert_eq!(connections.len(), 3);
        assert!(b.connection().0.evicted.load(Ordering::Acquire));
        for kept in [&a, &c, &d] {
            assert!(!kept.connection().0.evicted.load(Ordering::Acquire));
        }
        drop(b);
        assert_eq!(connections.len(), 3, "an evicted one is no longer counted");
        drop(d);
        assert_eq!(connections.len(), 2);
    }

    /// Issue 53, item 8: an owner churning connections evicts its own, never another's
    /// request in flight, however long that request has made no progress.
    #[test]
    fn a_crowd_evicts_its_own_and_a_request_in_flight_stays() {
        let connections = Connections::new(4);
        let job = connections.admit(Some(Owner::user(1, None)));
        let _request = job.connection().serving();
        std::thread::sleep(Duration::from_millis(5));
        let crowd: Vec<Admitted> = (0..40)
            .map(|_| connections.admit(Some(Owner::user(2, None))))
            .collect();
        assert!(!job.connection().is_evicted(), "the job's request stays");
        assert_eq!(
            crowd
                .iter()
                .filter(|c| !c.connection().is_evicted())
                .count(),
            3
        );
        // Another owner's new connection takes the crowd's place too.
        let other = connections.admit(Some(Owner::user(3, None)));
        assert!(!other.connection().is_evicted());
        assert!(!job.connection().is_evicted());
        // All serving: the owner holding most gives way still.
        let _serving: Vec<Serving> = crowd.iter().map(|c| c.connection().serving()).collect();
        let _other_request = other.connection().serving();
        let late = connections.admit(Some(Owner::user(4, None)));
        assert!(!job.connection().is_evicted());
        assert!(!other.connection().is_evicted());
        assert!(!late.connection().is_evicted());
    }
}
