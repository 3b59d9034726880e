//! Stream-ordered reuse: the events that hold back a freed block's reuse, and their
//! completion (PyTorch's `recordStream`, `insert_events`, `process_events`,
//! `synchronize_and_free_events`).
//!
//! # Note [Stream-ordered reuse]
//! A block freed while other streams may still use it (`record_stream`) cannot be reused at
//! once. Its free records one event per such stream and the block stays *pending*; each
//! `malloc` first polls the oldest events of every stream (`process_events`) and completes
//! the frees whose events have all completed. A full cache flush waits for all of them.
//! Streams are visited in the order they first queued an event; PyTorch visits them in its
//! hash map's order, so the frees completed in one pass may be listed in another order there
//! (the same set; a recording cannot reveal that order).
//!
//! While a capture is under way (Note [Private pools]) no event is polled or recorded: a
//! free used by other streams is deferred, and its events are recorded once no capture is,
//! without the streams whose uses were captured.
//!
//! # Invariants
//! - `pending_events` holds no empty queue after a pass, and each queue lists its stream's
//!   events in recording order.
//! - A block's `event_count` equals the number of queued events naming it; its free
//!   completes exactly when that count reaches zero with no unrecorded stream use left.
//! - Completed events return to `event_pool` (creating one is a driver call).
//! - `deferred` lists pending blocks with stream uses and no event; `capture_uses` names only
//!   blocks that are live or deferred.

use std::collections::VecDeque;

use crate::device::{Device, DevicePtr, EventId, StreamId};

use super::block::BlockId;
use super::{AllocError, CachingAllocator};

/// Stream events that must complete before a pending block's free completes.
pub(super) type EventQueue = VecDeque<(EventId, BlockId)>;

impl<D: Device> CachingAllocator<D> {
    /// Records one event per stream that used a freed block (`insert_events`). If the device
    /// cannot record them, waiting for the whole device is just as safe, so the free
    /// completes after a synchronisation.
    pub(super) fn insert_events(&mut self, id: BlockId) -> Result<(), AllocError> {
        let streams = self.stream_uses.remove(&id).unwrap_or_default();
        self.block_mut(id).has_stream_uses = false;
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
                    self.queue_of(stream).push_back((event, id));
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
            self.block_mut(id).has_stream_uses = true;
            return Err(AllocError::Device(e));
        }
        if self.block(id).event_count == 0 {
            self.complete_free(id);
        }
        Ok(())
    }

    fn queue_of(&mut self, stream: StreamId) -> &mut EventQueue {
        let i = match self.pending_events.iter().position(|(s, _)| *s == stream) {
            Some(i) => i,
            None => {
                self.pending_events.push((stream, VecDeque::new()));
                self.pending_events.len() - 1
            }
        };
        &mut self.pending_events[i].1
    }

    /// An event of block `id` completed: when it was the last, and no stream use is left
    /// unrecorded (see `free_after_synchronize`), the free completes.
    fn event_completed(&mut self, event: EventId, id: BlockId) {
        self.event_pool.push(event);
        let block = self.block_mut(id);
        block.event_count = block.event_count.saturating_sub(1);
        if block.event_count == 0 && !block.has_stream_uses {
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
        self.block_mut(id).has_stream_uses = false;
        if self.block(id).event_count == 0 {
            self.complete_free(id);
        }
        Ok(())
    }

    /// Completes the frees whose events have completed, looking at each stream's oldest
    /// events only (`process_events`), after recording the events of deferred frees.
    pub(super) fn process_events(&mut self) -> Result<(), AllocError> {
        if !self.deferred.is_empty() {
            self.insert_deferred_events()?;
        }
        let mut i = 0;
        while i < self.pending_events.len() {
            while let Some(&(event, id)) = self.pending_events[i].1.front() {
                if !self.device.query_event(event)? {
                    break;
                }
                self.pending_events[i].1.pop_front();
                self.event_completed(event, id);
            }
            if self.pending_events[i].1.is_empty() {
                self.pending_events.remove(i);
            } else {
                i += 1;
            }
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
        while let Some((_, queue)) = self.pending_events.first_mut() {
            let Some(&(event, id)) = queue.front() else {
                self.pending_events.remove(0);
                continue;
            };
            self.device.synchronize_event(event)?;
            self.pending_events[0].1.pop_front();
            self.event_completed(event, id);
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
        self.block_mut(id).has_stream_uses = true;
        if self.capturing() {
            let captured = self.capture_uses.entry(id).or_default();
            if !captured.contains(&stream) {
                captured.push(stream);
            }
        }
    }
}
