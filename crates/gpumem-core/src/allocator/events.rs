//! Stream-ordered reuse: the events that hold back a freed block's reuse, and their
//! completion (PyTorch's `recordStream`, `insert_events`, `process_events`,
//! `synchronize_and_free_events`).
//!
//! # Note [Stream-ordered reuse]
//! A block freed while other streams may still use it (`record_stream`) cannot be reused at
//! once. Its free records one event per such stream and the block stays *pending*; each
//! `malloc` first polls the oldest event of every stream (`process_events`; below, how a
//! simulated device spares most of those queries) and completes
//! the frees whose events have all completed. A full cache flush waits for all of them.
//! Streams are visited in the order they first queued an event; PyTorch visits them in its
//! hash map's order, so the frees completed in one pass may be listed in another order there
//! (the same set; a recording cannot reveal that order).
//!
//! A device that knows which streams' work completed since the last poll (the simulated GPU,
//! where work completes only when told) lets a pass query those streams alone (the frees it
//! completes are exactly those polling every stream would), so a replay
//! with many frees pending costs each `malloc` the streams that progressed, not every
//! stream; the device is told how many queries were left out (its clock charges them). A
//! pass cut short by a device error polls every stream next time.
//!
//! While a capture is under way (Note [Private pools]) no event is polled or recorded: a
//! free used by other streams is deferred, and its events are recorded once no capture is,
//! without the streams whose uses were captured.
//!
//! # Invariants
//! - `pending_events` holds no empty queue, each queue lists its stream's events in
//!   recording order, and a stream has at most one queue.
//! - A block's `event_count` equals the number of queued events naming it; its free
//!   completes exactly when that count reaches zero with no unrecorded stream use left.
//! - Completed events return to `event_pool` (creating one is a driver call).
//! - `deferred` lists pending blocks with stream uses and no event; `capture_uses` names only
//!   blocks that are live or deferred.

use std::collections::{BTreeMap, VecDeque};

use rustc_hash::FxHashMap;

use crate::device::{Device, DevicePtr, EventId, StreamId};

use super::block::BlockId;
use super::{AllocError, CachingAllocator};

/// Stream events that must complete before a pending block's free completes.
type EventQueue = VecDeque<(EventId, BlockId)>;

/// Per stream, the events of pending frees in recording order (PyTorch's `cuda_events`).
/// Queues are kept in the order their streams first queued an event (`arrival`), and found
/// by stream in constant time.
#[derive(Clone, Debug, Default)]
pub(super) struct PendingEvents {
    queues: BTreeMap<u64, (StreamId, EventQueue)>,
    arrival: FxHashMap<StreamId, u64>,
    next_arrival: u64,
    /// A pass was cut short: the next polls every stream.
    poll_all: bool,
}

impl PendingEvents {
    pub(super) fn is_empty(&self) -> bool {
        self.queues.is_empty()
    }

    /// Events queued, over all streams.
    pub(super) fn len(&self) -> usize {
        self.queues.values().map(|(_, q)| q.len()).sum()
    }

    fn push(&mut self, stream: StreamId, event: EventId, id: BlockId) {
        let next = &mut self.next_arrival;
        let arrival = *self.arrival.entry(stream).or_insert_with(|| {
            *next += 1;
            *next
        });
        let queue = &mut self
            .queues
            .entry(arrival)
            .or_insert((stream, VecDeque::new()))
            .1;
        queue.push_back((event, id));
    }

    /// The oldest event of the queue that arrived at `arrival`.
    fn front(&self, arrival: u64) -> Option<(EventId, BlockId)> {
        self.queues.get(&arrival)?.1.front().copied()
    }

    /// Drops the oldest event of that queue, and the queue once empty.
    fn pop(&mut self, arrival: u64) {
        let Some((stream, queue)) = self.queues.get_mut(&arrival) else {
            return;
        };
        queue.pop_front();
        if queue.is_empty() {
            self.arrival.remove(stream);
            self.queues.remove(&arrival);
        }
    }

    /// The first queue that arrived at or after `arrival`.
    fn next_from(&self, arrival: u64) -> Option<u64> {
        self.queues.range(arrival..).next().map(|(&a, _)| a)
    }

    /// The queues of `streams` that have one, in arrival order.
    fn arrivals_of(&self, streams: &[StreamId]) -> Vec<u64> {
        let mut arrivals: Vec<u64> = streams
            .iter()
            .filter_map(|s| self.arrival.get(s).copied())
            .collect();
        arrivals.sort_unstable();
        arrivals.dedup();
        arrivals
    }

    /// Takes every queued event, oldest stream first.
    pub(super) fn drain(&mut self) -> impl Iterator<Item = EventId> + use<> {
        self.arrival.clear();
        std::mem::take(&mut self.queues)
            .into_values()
            .flat_map(|(_, queue)| queue.into_iter().map(|(event, _)| event))
    }

    /// Heap bytes held (approximate: entries, not the maps' spare room).
    pub(super) fn heap_bytes(&self) -> usize {
        let per_stream = 2 * std::mem::size_of::<(u64, (StreamId, EventQueue))>();
        self.queues.len() * per_stream + self.len() * std::mem::size_of::<(EventId, BlockId)>()
    }
}

impl<D: Device> CachingAllocator<D> {
    /// Records one event per stream that used a freed block (`insert_events`). If the device
    /// cannot record them, waiting for the whole device is just as safe, so the free
    /// completes after a synchronisation.
    pub(super) fn insert_events(&mut self, id: BlockId) -> Result<(), AllocError> {
        let streams = self.stream_uses.remove(&id).unwrap_or_default();
        self.block_mut(id).set_stream_uses(false);
        if streams.len() > usize::from(u16::MAX) {
            // More streams than a block counts events for: wait for the device instead.
            return self.free_after_synchronize(id, &streams);
        }
        for (i, &stream) in streams.iter().enumerate() {
            let event = match self.event_pool.pop() {
                Some(e) => Ok(e),
                None => self.device.create_event(),
            };
            let recorded = event.and_then(|e| self.device.record_event(e, stream).map(|()| e));
            match recorded {
                Ok(event) => {
                    self.block_mut(id).event_count += 1;
                    self.pending_events.push(stream, event, id);
                }
                Err(_) => return self.free_after_synchronize(id, &streams[i..]),
            }
        }
        Ok(())
    }

    /// Event recording failed: wait for the whole device, then complete the free. If even
    /// that fails, the streams not yet covered stay on the block, which keeps it out of reuse.
    fn free_after_synchronize(
        &mut self,
        id: BlockId,
        uncovered: &[StreamId],
    ) -> Result<(), AllocError> {
        if let Err(e) = self.device.synchronize() {
            self.stream_uses.insert(id, uncovered.to_vec());
            self.block_mut(id).set_stream_uses(true);
            return Err(AllocError::Device(e));
        }
        if self.block(id).event_count == 0 {
            self.complete_free(id);
        }
        Ok(())
    }

    /// An event of block `id` completed: when it was the last, and no stream use is left
    /// unrecorded (see `free_after_synchronize`), the free completes.
    fn event_completed(&mut self, event: EventId, id: BlockId) {
        self.event_pool.push(event);
        let block = self.block_mut(id);
        block.event_count = block.event_count.saturating_sub(1);
        if block.event_count == 0 && !block.has_stream_uses() {
            self.complete_free(id);
        }
    }

    /// The free of pending block `id` completes: counted, then the block is made free.
    fn complete_free(&mut self, id: BlockId) {
        let block = self.block(id);
        let (kind, size, requested) = (block.pool, block.size, block.requested_size);
        self.stats.count_free_completed(kind, size, requested);
        self.free_block(id);
    }

    /// Records the events of the frees deferred while a capture was under way
    /// (`insert_events_deferred_until_no_capture`): the uses by streams recorded during the
    /// capture are dropped first (captured work has not run), and a free left with none
    /// completes at once.
    fn insert_deferred_events(&mut self) -> Result<(), AllocError> {
        let deferred = std::mem::take(&mut self.deferred);
        for (i, &id) in deferred.iter().enumerate() {
            if let Err(e) = self.insert_deferred(id) {
                self.deferred.extend_from_slice(&deferred[i + 1..]);
                return Err(e);
            }
        }
        Ok(())
    }

    fn insert_deferred(&mut self, id: BlockId) -> Result<(), AllocError> {
        let captured = self.capture_uses.remove(&id).unwrap_or_default();
        let uses = self.stream_uses.entry(id).or_default();
        uses.retain(|s| !captured.contains(s));
        if !uses.is_empty() {
            return self.insert_events(id);
        }
        self.stream_uses.remove(&id);
        self.block_mut(id).set_stream_uses(false);
        if self.block(id).event_count == 0 {
            self.complete_free(id);
        }
        Ok(())
    }

    /// Completes the frees whose events have completed, looking at each stream's oldest
    /// events only (`process_events`), after recording the events of deferred frees.
    // Every malloc asks; the usual answer (nothing waits) is given inline, without the call.
    #[inline(always)]
    pub(super) fn process_events(&mut self) -> Result<(), AllocError> {
        if self.deferred.is_empty() && self.pending_events.is_empty() {
            return Ok(());
        }
        self.process_waiting_events()
    }

    #[inline(never)]
    fn process_waiting_events(&mut self) -> Result<(), AllocError> {
        if !self.deferred.is_empty() {
            self.insert_deferred_events()?;
        }
        if self.pending_events.is_empty() {
            return Ok(());
        }
        let completed = self.device.take_completed_streams();
        let poll_all = std::mem::replace(&mut self.pending_events.poll_all, true);
        match completed {
            Some(streams) if !poll_all => {
                let arrivals = self.pending_events.arrivals_of(&streams);
                let streams = self.pending_events.queues.len();
                self.device
                    .skip_event_queries(streams.saturating_sub(arrivals.len()));
                for arrival in arrivals {
                    self.poll_stream(arrival)?;
                }
            }
            _ => {
                let mut next = self.pending_events.next_from(0);
                while let Some(arrival) = next {
                    self.poll_stream(arrival)?;
                    next = self.pending_events.next_from(arrival + 1);
                }
            }
        }
        self.pending_events.poll_all = false;
        Ok(())
    }

    /// Completes the frees whose events on the queue that arrived at `arrival` completed,
    /// oldest first, up to the first event still running.
    fn poll_stream(&mut self, arrival: u64) -> Result<(), AllocError> {
        while let Some((event, id)) = self.pending_events.front(arrival) {
            if !self.device.query_event(event)? {
                break;
            }
            self.pending_events.pop(arrival);
            self.event_completed(event, id);
        }
        Ok(())
    }

    /// Waits for every pending event and completes those frees
    /// (`synchronize_and_free_events`).
    pub(super) fn synchronize_and_free_events(&mut self) -> Result<(), AllocError> {
        self.stats.num_sync_all_streams.bump();
        if !self.deferred.is_empty() {
            self.insert_deferred_events()?;
        }
        while let Some(arrival) = self.pending_events.next_from(0) {
            while let Some((event, id)) = self.pending_events.front(arrival) {
                self.device.synchronize_event(event)?;
                self.pending_events.pop(arrival);
                self.event_completed(event, id);
            }
        }
        Ok(())
    }

    /// Marks a live block as used by `stream`, so that its reuse after free waits for the
    /// work queued on `stream` (`recordStream`). Ignored for null, for pointers this
    /// allocator does not hold, and for the block's own stream.
    pub fn record_stream(&mut self, ptr: DevicePtr, stream: StreamId) {
        self.record_stream_unchecked(ptr, stream);
        self.checked("record_stream", ());
    }

    fn record_stream_unchecked(&mut self, ptr: DevicePtr, stream: StreamId) {
        let Some(id) = self.live.get(ptr.0, &self.blocks) else {
            return;
        };
        if self.block(id).stream == stream {
            return;
        }
        let uses = self.stream_uses.entry(id).or_default();
        if !uses.contains(&stream) {
            uses.push(stream);
        }
        self.block_mut(id).set_stream_uses(true);
        if self.capturing() {
            let captured = self.capture_uses.entry(id).or_default();
            if !captured.contains(&stream) {
                captured.push(stream);
            }
        }
    }
}
