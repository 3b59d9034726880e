//! Private pools (PyTorch's `PrivatePool`, ids `MempoolId_t`): the pools of CUDA graphs
//! and of `torch.cuda.MemPool`, and the routing of requests into them.
//!
//! # Note [Private pools]
//! A private pool has a small and a large [`BlockPool`](super::pool::BlockPool) of its
//! own. Requests reach it only while it is routed to (`begin_allocate_to_pool` with a
//! stream filter, until `end_allocate_to_pool`): the newest route whose filter takes the
//! request's stream wins, and without a route every request goes to the default pools. A block is reused only
//! within its pool, so a default-pool request never takes a private pool's block.
//! - **Ids.** `(0, 0)` is the default pool; a MemPool or `graph_pool_handle()` is `(0, uid)`;
//!   a capture's implicit pool is `(capture id, 0)`.
//! - **Use count.** The references to a pool (a MemPool object, each capture or
//!   `use_mem_pool` routing to it), not its live blocks: creating a pool or routing to an
//!   unknown one starts it at 1, routing to a known one adds 1, `release_pool` takes 1. At
//!   zero the pool is *freeable*: each cache flush (`empty_cache`, the retry chain's last
//!   step) then releases its unsplit cached segments, and the pool is forgotten once it
//!   holds no segment. While the count is above zero a flush leaves the pool alone.
//! - **Routes of two kinds.** A graph capture ([`RouteKind::Capture`]) makes the allocator
//!   skip event polling, the retry chain's cache flush and the events of frees used by other
//!   streams (deferred until no capture is under way), as queries and frees are illegal
//!   while a stream is captured. A `use_mem_pool` route ([`RouteKind::MemPool`]) does the
//!   same up to PyTorch 2.12 (one counter of routes served both), and nothing of it from 2.13
//!   on (PR #181830 separated capture scopes from pool scopes; inferred from its date).
//! - **Options.** `use_on_oom`: when a default-pool request finds no new segment, the
//!   cached blocks of such pools are searched (no new segment for them) before cached
//!   memory is released. `no_split`: a block of the pool is never split.
//!
//! Pools with a custom allocator (`MemPool(allocator=...)`) are not modelled: their
//! segments come from another allocator's functions, which gpumem has no device for.
//!
//! # Invariants
//! - Every private pool has a non-default id, listed once in `by_id` under its slot.
//! - A route names a live pool; no two routes name the same pool.
//! - A pool's `segments` is the number of segments (expandable ones counted once each)
//!   whose blocks it owns.
//! - At most [`MAX_PRIVATE_POOLS`] pools exist at once.

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use crate::device::{Device, StreamId};

use super::pool::PoolPair;
use super::pool_id::{PoolId, PoolSlot};
use super::{AllocError, CachingAllocator};

/// The most private pools that exist at once.
pub const MAX_PRIVATE_POOLS: usize = u16::MAX as usize;

/// Options a MemPool is made with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolOptions {
    /// Its cached blocks may serve default-pool requests that found no new segment.
    pub use_on_oom: bool,
    /// Its blocks are never split.
    pub no_split: bool,
}

/// Which requests a route takes, by stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StreamFilter {
    /// Every stream (`use_mem_pool` routes the allocating thread, whatever its stream).
    Any,
    /// These streams (a capture: its stream and those that joined it).
    Streams(Vec<StreamId>),
}

impl StreamFilter {
    fn takes(&self, stream: StreamId) -> bool {
        match self {
            StreamFilter::Any => true,
            StreamFilter::Streams(streams) => streams.contains(&stream),
        }
    }
}

/// What a route is for: see Note [Private pools].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteKind {
    /// A CUDA graph capture.
    Capture,
    /// `use_mem_pool`.
    MemPool,
}

/// A private pool (PyTorch's `PrivatePool`).
#[derive(Debug, Clone)]
pub(crate) struct PrivatePool {
    pub id: PoolId,
    pub use_count: u32,
    /// Segments it owns (`cudaMalloc_count`).
    pub segments: u32,
    pub options: PoolOptions,
    pub pools: PoolPair,
}

#[derive(Debug, Clone)]
struct Route {
    slot: PoolSlot,
    filter: StreamFilter,
    kind: RouteKind,
}

/// Why a pool operation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// `(0, 0)` names the default pools, which are not a private pool.
    #[error("the default pool (0, 0) cannot be created, routed to or released")]
    DefaultPool,
    /// No private pool has this id.
    #[error("no private pool {0}")]
    Unknown(PoolId),
    /// Requests are already routed to this pool.
    #[error("requests are already being allocated to pool {0}")]
    AlreadyRouted(PoolId),
    /// The pool is not routed to.
    #[error("requests are not being allocated to pool {0}")]
    NotRouted(PoolId),
    /// The pool's use count is already zero.
    #[error("pool {0} has no use left to release")]
    NotInUse(PoolId),
    /// Too many pools at once.
    #[error("{MAX_PRIVATE_POOLS} private pools exist: no more can be made")]
    TooMany,
}

/// The private pools of one allocator and the routes into them.
#[derive(Debug, Clone, Default)]
pub(crate) struct PrivatePools {
    slots: Vec<Option<PrivatePool>>,
    by_id: FxHashMap<PoolId, PoolSlot>,
    /// Newest last; searched newest first.
    routes: Vec<Route>,
}

impl PrivatePools {
    /// Whether any private pool exists: the allocator's fast paths test this.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    pub fn get(&self, slot: PoolSlot) -> &PrivatePool {
        self.slots[slot.index()].as_ref().expect("a live pool slot")
    }

    pub fn get_mut(&mut self, slot: PoolSlot) -> &mut PrivatePool {
        self.slots[slot.index()].as_mut().expect("a live pool slot")
    }

    pub fn slot_of(&self, id: PoolId) -> Option<PoolSlot> {
        self.by_id.get(&id).copied()
    }

    /// The pool's id; the default id for the default slot.
    pub fn id_of(&self, slot: PoolSlot) -> PoolId {
        if slot.is_default() {
            PoolId::DEFAULT
        } else {
            self.get(slot).id
        }
    }

    /// Live pools, by slot.
    pub fn iter(&self) -> impl Iterator<Item = (PoolSlot, &PrivatePool)> {
        self.slots.iter().enumerate().filter_map(|(i, p)| {
            let slot = PoolSlot::private(i)?;
            Some((slot, p.as_ref()?))
        })
    }

    /// The pool a request on `stream` goes to (`get_pool`): the newest route that takes
    /// the stream, else the default.
    #[inline]
    pub fn route(&self, stream: StreamId) -> PoolSlot {
        if self.routes.is_empty() {
            return PoolSlot::DEFAULT;
        }
        self.routes
            .iter()
            .rev()
            .find(|r| r.filter.takes(stream))
            .map_or(PoolSlot::DEFAULT, |r| r.slot)
    }

    /// Whether a capture is under way, in PyTorch's sense for `minor` (2.x): see
    /// Note [Private pools].
    #[inline]
    pub fn capturing(&self, minor: u32) -> bool {
        if self.routes.is_empty() {
            return false;
        }
        minor <= LAST_SHARED_CAPTURE_GATE
            || self.routes.iter().any(|r| r.kind == RouteKind::Capture)
    }

    /// The pool `id` with one more use, made if new; `options` switched on either way
    /// (`createOrIncrefPool`, then the MemPool constructor's setters).
    pub fn create_or_incref(
        &mut self,
        id: PoolId,
        options: PoolOptions,
    ) -> Result<PoolSlot, PoolError> {
        if id.is_default() {
            return Err(PoolError::DefaultPool);
        }
        if let Some(slot) = self.slot_of(id) {
            let pool = self.get_mut(slot);
            pool.use_count = pool.use_count.saturating_add(1);
            pool.options.use_on_oom |= options.use_on_oom;
            pool.options.no_split |= options.no_split;
            return Ok(slot);
        }
        let pool = PrivatePool {
            id,
            use_count: 1,
            segments: 0,
            options,
            pools: PoolPair::default(),
        };
        let index = match self.slots.iter().position(Option::is_none) {
            Some(i) => i,
            None if self.slots.len() < MAX_PRIVATE_POOLS => {
                self.slots.push(None);
                self.slots.len() - 1
            }
            None => return Err(PoolError::TooMany),
        };
        // Below MAX_PRIVATE_POOLS = u16::MAX slots: the slot exists.
        let slot = PoolSlot::private(index).ok_or(PoolError::TooMany)?;
        self.slots[index] = Some(pool);
        self.by_id.insert(id, slot);
        Ok(slot)
    }

    /// Routes the requests `filter` takes to pool `id` (made, or one use more).
    pub fn begin(
        &mut self,
        id: PoolId,
        filter: StreamFilter,
        kind: RouteKind,
    ) -> Result<(), PoolError> {
        if let Some(slot) = self.slot_of(id)
            && self.routes.iter().any(|r| r.slot == slot)
        {
            return Err(PoolError::AlreadyRouted(id));
        }
        let slot = self.create_or_incref(id, PoolOptions::default())?;
        self.routes.push(Route { slot, filter, kind });
        Ok(())
    }

    /// Ends the route to pool `id`.
    pub fn end(&mut self, id: PoolId) -> Result<(), PoolError> {
        let slot = self.slot_of(id).ok_or(PoolError::NotRouted(id))?;
        let at = self
            .routes
            .iter()
            .position(|r| r.slot == slot)
            .ok_or(PoolError::NotRouted(id))?;
        self.routes.remove(at);
        Ok(())
    }

    /// One use of pool `id` less.
    pub fn release(&mut self, id: PoolId) -> Result<(), PoolError> {
        if id.is_default() {
            return Err(PoolError::DefaultPool);
        }
        let slot = self.slot_of(id).ok_or(PoolError::Unknown(id))?;
        let pool = self.get_mut(slot);
        if pool.use_count == 0 {
            return Err(PoolError::NotInUse(id));
        }
        pool.use_count -= 1;
        Ok(())
    }

    /// Pools whose use count is zero, in id order (so that a replay, which makes pools in
    /// another order, flushes them in the same one).
    pub fn freeable(&self) -> Vec<PoolSlot> {
        self.by_id_where(|p| p.use_count == 0)
    }

    /// Pools searched for a default-pool request that found no new segment, in id order.
    pub fn use_on_oom(&self) -> Vec<PoolSlot> {
        self.by_id_where(|p| p.options.use_on_oom)
    }

    /// The pools `keep` takes, in id order.
    fn by_id_where(&self, keep: impl Fn(&PrivatePool) -> bool) -> Vec<PoolSlot> {
        let mut pools: Vec<(PoolId, PoolSlot)> = self
            .iter()
            .filter(|(_, p)| keep(p))
            .map(|(slot, p)| (p.id, slot))
            .collect();
        pools.sort_unstable();
        pools.into_iter().map(|(_, slot)| slot).collect()
    }

    /// Forgets a freeable pool that owns no segment and is not routed to.
    pub fn forget_if_empty(&mut self, slot: PoolSlot) {
        let pool = self.get(slot);
        if pool.use_count == 0 && pool.segments == 0 && !self.routes.iter().any(|r| r.slot == slot)
        {
            let id = pool.id;
            self.by_id.remove(&id);
            self.slots[slot.index()] = None;
        }
    }

    /// The invariants of the module documentation that need no blocks.
    pub fn check(&self) -> Result<(), String> {
        for (slot, pool) in self.iter() {
            if pool.id.is_default() {
                return Err(format!("private pool slot {slot:?} has the default id"));
            }
            if self.by_id.get(&pool.id) != Some(&slot) {
                return Err(format!("pool {} is not listed under its slot", pool.id));
            }
        }
        if self.by_id.len() != self.iter().count() {
            return Err("the pool index lists pools that do not exist".into());
        }
        for (i, r) in self.routes.iter().enumerate() {
            if r.slot.is_default() || self.slots.get(r.slot.index()).is_none_or(Option::is_none) {
                return Err(format!("route {i} names no live pool"));
            }
            if self.routes[..i].iter().any(|o| o.slot == r.slot) {
                return Err(format!("two routes name pool {}", self.get(r.slot).id));
            }
        }
        Ok(())
    }
}

/// The last release (2.x) in which a `use_mem_pool` route counted as a capture.
const LAST_SHARED_CAPTURE_GATE: u32 = 12;

/// The routing API (PyTorch's `createOrIncrefPool`, `beginAllocateToPool`,
/// `endAllocateToPool`, `releasePool`).
impl<D: Device> CachingAllocator<D> {
    /// Makes the MemPool `id`, or adds a use to it; `options` switch on `use_on_oom` and
    /// `no_split` (the MemPool constructor).
    ///
    /// # Errors
    /// [`AllocError::Pool`] for the default id, or when [`MAX_PRIVATE_POOLS`] exist.
    pub fn create_pool(&mut self, id: PoolId, options: PoolOptions) -> Result<(), AllocError> {
        self.private.create_or_incref(id, options)?;
        self.checked("create_pool", Ok(()))
    }

    /// Routes the requests on the streams `filter` takes to pool `id`, made with one use if
    /// unknown, else with one use more (a capture's or `use_mem_pool`'s begin).
    ///
    /// # Errors
    /// [`AllocError::Pool`] for the default id, a pool already routed to, or too many pools.
    pub fn begin_allocate_to_pool(
        &mut self,
        id: PoolId,
        filter: StreamFilter,
        kind: RouteKind,
    ) -> Result<(), AllocError> {
        self.private.begin(id, filter, kind)?;
        self.checked("begin_allocate_to_pool", Ok(()))
    }

    /// Ends the route to pool `id`; its use stays until [`Self::release_pool`].
    ///
    /// # Errors
    /// [`AllocError::Pool`] when requests are not routed to `id`.
    pub fn end_allocate_to_pool(&mut self, id: PoolId) -> Result<(), AllocError> {
        self.private.end(id)?;
        self.checked("end_allocate_to_pool", Ok(()))
    }

    /// Takes one use from pool `id`: at zero, the next cache flush releases its unsplit
    /// cached segments (a graph's destruction, a MemPool's, the end of `use_mem_pool`).
    ///
    /// # Errors
    /// [`AllocError::Pool`] for an unknown pool or one without a use left.
    pub fn release_pool(&mut self, id: PoolId) -> Result<(), AllocError> {
        self.private.release(id)?;
        self.checked("release_pool", Ok(()))
    }

    /// The use count of pool `id`, if it exists.
    pub fn pool_use_count(&self, id: PoolId) -> Option<u32> {
        let slot = self.private.slot_of(id)?;
        Some(self.private.get(slot).use_count)
    }

    /// The private pools that exist, by id.
    pub fn private_pools(&self) -> Vec<PoolId> {
        let mut ids: Vec<PoolId> = self.private.iter().map(|(_, p)| p.id).collect();
        ids.sort_unstable();
        ids
    }

    /// A segment was obtained (`delta` 1) or given back (-1) for the pool at `owner`.
    pub(super) fn count_pool_segment(&mut self, owner: PoolSlot, delta: i32) {
        if !owner.is_default() {
            let pool = self.private.get_mut(owner);
            pool.segments = pool.segments.saturating_add_signed(delta);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_route_that_takes_a_stream_wins() {
        let mut pools = PrivatePools::default();
        let (a, b) = (PoolId(0, 1), PoolId(7, 0));
        pools
            .begin(a, StreamFilter::Any, RouteKind::MemPool)
            .expect("new");
        pools
            .begin(
                b,
                StreamFilter::Streams(vec![StreamId(3)]),
                RouteKind::Capture,
            )
            .expect("new");
        assert_eq!(pools.id_of(pools.route(StreamId(3))), b);
        assert_eq!(pools.id_of(pools.route(StreamId(0))), a);
        pools.end(b).expect("routed");
        assert_eq!(pools.id_of(pools.route(StreamId(3))), a);
        pools.end(a).expect("routed");
        assert_eq!(pools.route(StreamId(3)), PoolSlot::DEFAULT);
        assert!(pools.check().is_ok());
    }

    #[test]
    fn use_counts_count_references() {
        let mut pools = PrivatePools::default();
        let id = PoolId(0, 4);
        let slot = pools
            .create_or_incref(id, PoolOptions::default())
            .expect("new");
        pools
            .begin(id, StreamFilter::Any, RouteKind::MemPool)
            .expect("known");
        assert_eq!(pools.get(slot).use_count, 2);
        assert_eq!(
            pools.begin(id, StreamFilter::Any, RouteKind::MemPool),
            Err(PoolError::AlreadyRouted(id))
        );
        pools.end(id).expect("routed");
        pools.release(id).expect("in use");
        pools.release(id).expect("in use");
        assert_eq!(pools.release(id), Err(PoolError::NotInUse(id)));
        assert_eq!(pools.freeable(), vec![slot]);
        pools.forget_if_empty(slot);
        assert!(pools.is_empty());
        assert_eq!(pools.release(id), Err(PoolError::Unknown(id)));
        assert_eq!(
            pools.create_or_incref(PoolId::DEFAULT, PoolOptions::default()),
            Err(PoolError::DefaultPool)
        );
    }

    #[test]
    fn a_mem_pool_route_is_a_capture_only_up_to_2_12() {
        let mut pools = PrivatePools::default();
        pools
            .begin(PoolId(0, 1), StreamFilter::Any, RouteKind::MemPool)
            .expect("new");
        assert!(pools.capturing(12));
        assert!(!pools.capturing(13));
        pools
            .begin(PoolId(2, 0), StreamFilter::Any, RouteKind::Capture)
            .expect("new");
        assert!(pools.capturing(15));
    }
}
