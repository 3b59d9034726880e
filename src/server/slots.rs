//! Slots: a fixed number of things held at once (push bodies being read, scrape bodies
//! being sent), each by a connection's request, that a stalled holder loses.
//!
//! A slot wanted while all are held is taken from the holder stalled longest, if it has made
//! no progress for [`MIN_STALL`]: a body that never arrives, or a scrape nobody reads, cannot
//! keep a real push or scrape out. A slot given back goes to a waiter of the owner (the
//! socket peer's process; over TCP every client alike) holding fewest slots, the newest of them: one
//! process's crowd waits behind every other process, and a crowd of stalled clients that came
//! first cannot keep a new one out.
//!
//! # Invariants
//! - Every slot is either free, held by one [`Slot`], or on its way to a waiter; a [`Slot`]
//!   dropped anywhere (a waiter gone before it took it included) gives it back.
//! - A holder is measured from its last progress or from when it got its slot, whichever is
//!   later, so a request that waited is not taken for a stalled one.
//! - A request never preempts its own connection, and one that would not wait preempts
//!   nobody.
//! - Bookkeeping is a map of holders and a list of waiters, scanned on each give-back and
//!   preemption: at most the listeners' connections.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rustc_hash::FxHashMap;
use tokio::sync::oneshot;

use super::conns::{Connection, most_stalled};

/// How long a slot's holder must have made no progress before its slot goes to another: a
/// request from this node sends its body, and a scraper reads, well within it.
pub const MIN_STALL: Duration = Duration::from_millis(200);

/// A fixed number of slots (see the module documentation).
#[derive(Debug)]
pub struct Slots {
    inner: Mutex<SlotsInner>,
}

#[derive(Debug)]
struct SlotsInner {
    free: usize,
    /// Each held slot's holder, by the slot's own id.
    holders: FxHashMap<u64, Connection>,
    /// The requests waiting, oldest first.
    waiters: Vec<Waiter>,
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    conn: Connection,
    grant: oneshot::Sender<Slot>,
}

/// A held slot, given back when dropped.
#[derive(Debug)]
pub struct Slot {
    slots: Arc<Slots>,
    id: u64,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.slots.give_back(self.id);
    }
}

/// Ids of slots held and of waiters: unique for the process's life.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A request waiting for a slot, taken off the list when it stops waiting.
struct Waiting<'a> {
    slots: &'a Slots,
    id: u64,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.slots.lock().waiters.retain(|w| w.id != self.id);
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
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let mut granted = {
            let mut inner = self.lock();
            if inner.free > 0 {
                inner.free -= 1;
                return Some(self.held(&mut inner, id, conn));
            }
            if wait.is_zero() {
                return None;
            }
            let (grant, granted) = oneshot::channel();
            inner.waiters.push(Waiter {
                id,
                conn: conn.clone(),
                grant,
            });
            granted
        };
        let waiting = Waiting { slots: self, id };
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

    /// Slot `id`, held by `conn` from now: its stall is measured from here.
    fn held(self: &Arc<Self>, inner: &mut SlotsInner, id: u64, conn: &Connection) -> Slot {
        conn.progressed();
        inner.holders.insert(id, conn.clone());
        Slot {
            slots: Arc::clone(self),
            id,
        }
    }

    /// Slot `id` given back: to a waiter whose connection was not evicted (see the module
    /// documentation for which), or freed.
    fn give_back(self: &Arc<Self>, id: u64) {
        let (next, gone) = {
            let mut inner = self.lock();
            inner.holders.remove(&id);
            // Waiters on evicted connections are dropped unserved (their tasks end soon).
            let (gone, waiting): (Vec<Waiter>, Vec<Waiter>) = std::mem::take(&mut inner.waiters)
                .into_iter()
                .partition(|w| w.conn.is_evicted());
            inner.waiters = waiting;
            // The newest waiter of the owners holding fewest slots: one process's crowd of
            // requests waits behind everyone else's.
            let process = |c: &Connection| c.owner().and_then(|o| o.process);
            let held = |pid: Option<u32>| {
                pid.map_or(0, |pid| {
                    inner
                        .holders
                        .values()
                        .filter(|c| process(c) == Some(pid))
                        .count()
                })
            };
            let next = (0..inner.waiters.len())
                .rev()
                .min_by_key(|&i| held(process(&inner.waiters[i].conn)));
            match next.map(|i| inner.waiters.remove(i)) {
                Some(waiter) => {
                    let slot = self.held(&mut inner, waiter.id, &waiter.conn);
                    (Some((waiter.grant, slot)), gone)
                }
                None => {
                    inner.free += 1;
                    (None, gone)
                }
            }
        };
        drop(gone);
        if let Some((grant, slot)) = next {
            // A waiter gone since drops the slot, which comes back here for the next one.
            let _ = grant.send(slot);
        }
    }

    /// Evicts the holder stalled longest, if stalled for [`MIN_STALL`] and not `wanting`,
    /// unless an evicted holder's slot is already on its way back.
    fn preempt(&self, wanting: &Connection) {
        let inner = self.lock();
        if inner.holders.values().any(Connection::is_evicted) {
            return;
        }
        let others = inner.holders.iter().filter(|(_, c)| c.id() != wanting.id());
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
    use crate::server::conns::Owner;

    /// A task waiting up to 5 s for one of `slots` for `conn`.
    fn waiter(slots: &Arc<Slots>, conn: Connection) -> tokio::task::JoinHandle<Option<Slot>> {
        let slots = Arc::clone(slots);
        tokio::spawn(async move { slots.take(&conn, Duration::from_secs(5)).await })
    }

    #[tokio::test]
    async fn a_stalled_holder_loses_its_slot_and_a_progressing_one_keeps_it() {
        let slots = Slots::new(1);
        let holder = Connection::new(None);
        let wanting = Connection::new(None);
        let slot = slots.take(&holder, Duration::ZERO).await.expect("free");
        // Within MIN_STALL of its last progress the holder keeps its slot.
        holder.progressed();
        assert!(
            slots
                .take(&wanting, Duration::from_millis(50))
                .await
                .is_none()
        );
        assert!(!holder.is_evicted());
        // Stalled: it is evicted, and the slot comes once the holder's request is dropped.
        let waiting = waiter(&slots, wanting.clone());
        tokio::time::timeout(Duration::from_secs(5), holder.evicted())
            .await
            .expect("the stalled holder is evicted");
        drop(slot);
        assert!(waiting.await.expect("joins").is_some());
    }

    #[tokio::test]
    async fn a_slot_given_back_goes_to_the_newest_live_waiter() {
        let slots = Slots::new(1);
        let holder = Connection::new(None);
        let slot = slots.take(&holder, Duration::ZERO).await.expect("free");
        // A request that has waited long (its connection stalled since), a fresh one, and a
        // newer one whose connection was evicted meanwhile.
        let stale = waiter(&slots, Connection::new(None));
        tokio::time::sleep(Duration::from_millis(20)).await;
        let fresh = waiter(&slots, Connection::new(None));
        tokio::time::sleep(Duration::from_millis(20)).await;
        let evicted = Connection::new(None);
        let gone = waiter(&slots, evicted.clone());
        tokio::time::sleep(Duration::from_millis(20)).await;
        evicted.evict();
        holder.progressed();
        drop(slot);
        assert!(
            gone.await.expect("joins").is_none(),
            "an evicted waiter is not served"
        );
        let got = fresh
            .await
            .expect("joins")
            .expect("the fresh waiter gets it");
        assert!(!stale.is_finished(), "the stale one still waits");
        drop(got);
        assert!(stale.await.expect("joins").is_some(), "then the stale one");
        assert_eq!(slots.lock().free, 1, "every slot is back");
    }

    /// A request that waited long for its slot is not taken for a stalled holder the moment it
    /// gets it; and one that would not wait preempts nobody.
    #[tokio::test]
    async fn a_new_holder_is_measured_from_its_grant() {
        let slots = Slots::new(1);
        let holder = Connection::new(None);
        let slot = slots.take(&holder, Duration::ZERO).await.expect("free");
        let waiting_conn = Connection::new(None);
        let waiting = waiter(&slots, waiting_conn.clone());
        // The waiter stalls past MIN_STALL while the holder keeps progressing.
        for _ in 0..6 {
            holder.progressed();
            tokio::time::sleep(MIN_STALL / 4).await;
        }
        assert!(!holder.is_evicted());
        drop(slot);
        let got = waiting.await.expect("joins").expect("granted");
        // Another request that would not wait, and one that would briefly: neither evicts the
        // new holder, whose stall starts at its grant.
        let other = Connection::new(None);
        assert!(slots.take(&other, Duration::ZERO).await.is_none());
        assert!(slots.take(&other, MIN_STALL / 4).await.is_none());
        assert!(!waiting_conn.is_evicted());
        drop(got);
    }

    /// One process's crowd waits behind another process's request, however new the crowd.
    #[tokio::test]
    async fn a_slot_goes_to_the_owner_holding_fewest() {
        let slots = Slots::new(2);
        let crowd = Some(Owner::user(0, Some(7)));
        let first = Connection::new(crowd);
        let _held = slots.take(&first, Duration::ZERO).await.expect("free");
        let second = Connection::new(crowd);
        let slot = slots.take(&second, Duration::ZERO).await.expect("free");
        let other = waiter(&slots, Connection::new(Some(Owner::user(0, Some(8)))));
        tokio::time::sleep(Duration::from_millis(20)).await;
        let more = waiter(&slots, Connection::new(crowd));
        tokio::time::sleep(Duration::from_millis(20)).await;
        first.progressed();
        second.progressed();
        drop(slot);
        let got = other
            .await
            .expect("joins")
            .expect("the other process's request");
        assert!(!more.is_finished(), "the crowd's newest still waits");
        drop(got);
        assert!(more.await.expect("joins").is_some());
    }

    #[tokio::test]
    async fn a_connection_never_preempts_itself() {
        let slots = Slots::new(1);
        let conn = Connection::new(None);
        let _slot = slots.take(&conn, Duration::ZERO).await.expect("free");
        tokio::time::sleep(MIN_STALL * 2).await;
        assert!(slots.take(&conn, MIN_STALL * 2).await.is_none());
        assert!(!conn.is_evicted());
    }
}
