//! Who gives way: the connections a listener serves, and the slots (push bodies being read,
//! scrape bodies being sent) they hold.
//!
//! A connection *progresses* when it reads or writes a byte (`listen.rs` tells it). Anything
//! a client holds goes, when wanted, to whoever makes progress:
//! - a listener at its cap that accepts one more connection evicts the one that progressed
//!   least recently: idle, half-sent and unread connections go first, and a new client (a
//!   liveness probe) is always accepted, never left in the kernel's backlog;
//! - a slot wanted while all are held is taken from the holder stalled longest, if it has
//!   been stalled for at least [`MIN_STALL`]: a body that never arrives, or a scrape nobody
//!   reads, cannot keep a real push or scrape out.
//!
//! # Invariants
//! - A listener holds at most its cap of connections that were not evicted; accepting
//!   never waits for room.
//! - An evicted connection ends at its next poll: its request, if any, is dropped with what
//!   it held (slots, buffers). Its slots are free from the moment it is chosen.
//! - A holder that progressed within [`MIN_STALL`] keeps its slot; a slot never goes to a
//!   second request of the same connection.
//! - Bookkeeping is a map per listener and per slot pool, scanned when one is full: at most
//!   the cap's entries, each a pointer.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;
use tokio::sync::{Notify, oneshot};

/// How long a slot's holder must have made no progress before its slot goes to another: a
/// request from this node sends its body, and a scraper reads, well within it.
pub const MIN_STALL: Duration = Duration::from_millis(200);

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
    last: AtomicU64,
    evicted: AtomicBool,
    notify: Notify,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl Connection {
    fn new() -> Connection {
        Connection(Arc::new(ConnectionState {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            last: AtomicU64::new(now_ms()),
            evicted: AtomicBool::new(false),
            notify: Notify::new(),
        }))
    }

    /// A connection of its own, in no listener (a request served without a socket).
    pub fn detached() -> Connection {
        Connection::new()
    }

    /// A byte was read or written.
    pub fn progressed(&self) {
        self.0.last.store(now_ms(), Ordering::Relaxed);
    }

    fn stalled_since(&self) -> u64 {
        self.0.last.load(Ordering::Relaxed)
    }

    fn is_evicted(&self) -> bool {
        self.0.evicted.load(Ordering::Acquire)
    }

    /// Tells the connection to end.
    fn evict(&self) {
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
fn most_stalled<'a>(
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

    /// A new connection, counted until the returned guard drops; where that makes one too
    /// many, the least recently progressed other one is evicted.
    pub fn admit(self: &Arc<Self>) -> Admitted {
        let conn = Connection::new();
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

/// A fixed number of slots, each held by a connection's request; a stalled holder loses its
/// slot to a request that wants one, and a slot given back goes to the waiting request whose
/// connection progressed most recently (not the longest waiting: that is a stalled one).
#[derive(Debug)]
pub struct Slots {
    inner: Mutex<SlotsInner>,
}

#[derive(Debug)]
struct SlotsInner {
    free: usize,
    holders: FxHashMap<u64, Connection>,
    waiters: Vec<(Connection, oneshot::Sender<Slot>)>,
}

/// A held slot, given back when dropped.
#[derive(Debug)]
pub struct Slot {
    slots: Arc<Slots>,
    holder: u64,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.slots.give_back(self.holder);
    }
}

/// A request waiting for a slot, taken off the queue when it stops waiting.
struct Waiting<'a> {
    slots: &'a Slots,
    id: u64,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.slots.lock().waiters.retain(|(c, _)| c.0.id != self.id);
    }
}

impl Slots {
    /// `n` (at least one) slots.
    pub fn new(n: usize) -> Arc<Slots> {
        Arc::new(Slots {
            inner: Mutex::new(SlotsInner {
                free: n.max(1),
                holders: FxHashMap::default(),
                waiters: Vec::new(),
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SlotsInner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A slot for `conn`'s request, taken from a stalled holder where none is free, within
    /// `wait`; `None` when none came.
    pub async fn take(self: &Arc<Self>, conn: &Connection, wait: Duration) -> Option<Slot> {
        let mut granted = {
            let mut inner = self.lock();
            if inner.free > 0 {
                inner.free -= 1;
                // Keyed by the connection: HTTP/1 serves one request of a connection at a
                // time.
                inner.holders.insert(conn.0.id, conn.clone());
                return Some(Slot {
                    slots: Arc::clone(self),
                    holder: conn.0.id,
                });
            }
            let (tx, rx) = oneshot::channel();
            inner.waiters.push((conn.clone(), tx));
            rx
        };
        let waiting = Waiting {
            slots: self,
            id: conn.0.id,
        };
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            self.preempt(conn);
            // Holders that progress now may stall later: look again while waiting.
            let until = deadline.min(tokio::time::Instant::now() + MIN_STALL / 2);
            match tokio::time::timeout_at(until, &mut granted).await {
                Ok(slot) => return slot.ok(),
                Err(_) if tokio::time::Instant::now() >= deadline => break,
                Err(_) => {}
            }
        }
        drop(waiting);
        // Granted just as the wait ended: taken; else a grant still on its way finds the
        // receiver gone and gives the slot back.
        granted.try_recv().ok()
    }

    /// `holder`'s slot, given to the waiter that progressed most recently, or freed.
    fn give_back(self: &Arc<Self>, holder: u64) {
        let next = {
            let mut inner = self.lock();
            inner.holders.remove(&holder);
            let freshest =
                (0..inner.waiters.len()).max_by_key(|&i| inner.waiters[i].0.stalled_since());
            match freshest {
                Some(i) => {
                    let (conn, tx) = inner.waiters.swap_remove(i);
                    inner.holders.insert(conn.0.id, conn.clone());
                    Some((conn.0.id, tx))
                }
                None => {
                    inner.free += 1;
                    None
                }
            }
        };
        if let Some((holder, tx)) = next {
            // A waiter gone since drops the slot, which comes back here for the next one.
            let _ = tx.send(Slot {
                slots: Arc::clone(self),
                holder,
            });
        }
    }

    /// Evicts the holder stalled longest, if stalled for [`MIN_STALL`] and not `wanting`,
    /// unless an evicted holder's slot is already on its way back.
    fn preempt(&self, wanting: &Connection) {
        let inner = self.lock();
        if inner.holders.values().any(Connection::is_evicted) {
            return;
        }
        let others = inner.holders.iter().filter(|(id, _)| **id != wanting.0.id);
        if let Some(victim) = most_stalled(others, MIN_STALL)
            && let Some(victim) = inner.holders.get(&victim)
        {
            victim.evict();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_listener_evicts_the_least_recently_progressed() {
        let connections = Connections::new(3);
        let a = connections.admit();
        std::thread::sleep(Duration::from_millis(5));
        let b = connections.admit();
        std::thread::sleep(Duration::from_millis(5));
        let c = connections.admit();
        std::thread::sleep(Duration::from_millis(5));
        // `a` is the oldest but progresses: `b` is now the least recent.
        a.connection().progressed();
        let d = connections.admit();
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

    #[tokio::test]
    async fn a_stalled_holder_loses_its_slot_and_a_progressing_one_keeps_it() {
        let slots = Slots::new(1);
        let holder = Connection::new();
        let wanting = Connection::new();
        let slot = slots.take(&holder, Duration::ZERO).await.expect("free");
        // Within MIN_STALL of its last progress the holder keeps its slot.
        holder.progressed();
        assert!(
            slots
                .take(&wanting, Duration::from_millis(50))
                .await
                .is_none()
        );
        assert!(!holder.0.evicted.load(Ordering::Acquire));
        // Stalled: it is evicted, and the slot comes once the holder's request is dropped.
        let waiter = {
            let slots = Arc::clone(&slots);
            let wanting = wanting.clone();
            tokio::spawn(async move { slots.take(&wanting, Duration::from_secs(5)).await })
        };
        tokio::time::timeout(Duration::from_secs(5), holder.evicted())
            .await
            .expect("the stalled holder is evicted");
        drop(slot);
        assert!(waiter.await.expect("joins").is_some());
    }

    #[tokio::test]
    async fn a_slot_given_back_goes_to_the_freshest_waiter() {
        let slots = Slots::new(1);
        let holder = Connection::new();
        let slot = slots.take(&holder, Duration::ZERO).await.expect("free");
        let wait = |conn: Connection| {
            let slots = Arc::clone(&slots);
            tokio::spawn(async move { slots.take(&conn, Duration::from_secs(5)).await })
        };
        // A request that has waited long (its connection stalled since) and a fresh one.
        let stale = wait(Connection::new());
        tokio::time::sleep(Duration::from_millis(20)).await;
        let fresh = wait(Connection::new());
        tokio::time::sleep(Duration::from_millis(20)).await;
        holder.progressed();
        drop(slot);
        let got = fresh
            .await
            .expect("joins")
            .expect("the fresh waiter gets it");
        assert!(!stale.is_finished(), "the stale one still waits");
        drop(got);
        assert!(stale.await.expect("joins").is_some(), "then the stale one");
        assert_eq!(slots.lock().free, 1, "every slot is back");
    }

    #[tokio::test]
    async fn a_connection_never_preempts_itself() {
        let slots = Slots::new(1);
        let conn = Connection::new();
        let _slot = slots.take(&conn, Duration::ZERO).await.expect("free");
        tokio::time::sleep(MIN_STALL * 2).await;
        assert!(slots.take(&conn, MIN_STALL * 2).await.is_none());
        assert!(!conn.0.evicted.load(Ordering::Acquire));
    }
}
