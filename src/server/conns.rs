//! The connections a listener serves, and which one gives way when they are too many.
//!
//! A connection *progresses* when it reads or writes a byte (`listen.rs` tells it). A
//! listener at its cap that accepts one more connection evicts the one that progressed least
//! recently: idle, half-sent and unread connections go first, and a new client (a liveness
//! probe) is always accepted, never left in the kernel's backlog. What a connection's request
//! holds (`slots.rs`) is taken from it the same way.
//!
//! # Invariants
//! - A listener holds at most its cap of connections that were not evicted; accepting
//!   never waits for room: the evicted one's place is free from the moment it is chosen.
//! - An evicted connection ends at its next poll: its request, if any, is dropped with what
//!   it held (slots, buffers), which come back then.
//! - Bookkeeping is a map per listener, scanned when it is full: at most the cap's entries,
//!   each a pointer.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;
use tokio::sync::Notify;

/// Milliseconds since the first use: the coarse clock of progress.
fn now_ms() -> u64 {
    static EPOCH: LazyLock<Instant> = LazyLock::new(Instant::now);
    EPOCH.elapsed().as_millis() as u64
}

/// One served connection: when it last progressed, and whether it was told to end.
#[derive(Clone, Debug)]
pub struct Connection(Arc<ConnectionState>);

#[derive(Debug)]
struct ConnectionState {
    id: u64,
    /// Who is at the other end where the kernel says (a socket peer's pid): slots are shared
    /// out among owners.
    owner: Option<u32>,
    last: AtomicU64,
    evicted: AtomicBool,
    notify: Notify,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl Connection {
    pub(super) fn new(owner: Option<u32>) -> Connection {
        Connection(Arc::new(ConnectionState {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            owner,
            last: AtomicU64::new(now_ms()),
            evicted: AtomicBool::new(false),
            notify: Notify::new(),
        }))
    }

    /// A connection of its own, in no listener (a request served without a socket).
    pub fn detached() -> Connection {
        Connection::new(None)
    }

    /// Who is at the other end, where the kernel says.
    pub(super) fn owner(&self) -> Option<u32> {
        self.0.owner
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

    /// A new connection from `owner` (where the kernel names it), counted until the returned
    /// guard drops; where that makes one too many, the least recently progressed other one is
    /// evicted.
    pub fn admit(self: &Arc<Self>, owner: Option<u32>) -> Admitted {
        let conn = Connection::new(owner);
        let mut live = self.live.lock().unwrap_or_else(PoisonError::into_inner);
        if live.len() >= self.cap
            && let Some(victim) = most_stalled(live.iter(), Duration::ZERO)
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
}
