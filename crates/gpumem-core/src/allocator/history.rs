//! Allocation history: the trace of allocator events in PyTorch's `device_traces` format,
//! kept in a bounded ring buffer, off by default (as `_record_memory_history` is).
//!
//! # Invariants
//! - The buffer never holds more than `capacity` entries; when full, the oldest is dropped.
//! - Disabling recording clears the buffer.

use std::collections::VecDeque;

use serde::ser::SerializeMap;
use serde::{Deserialize, Serialize};

use super::PoolId;
use crate::device::StreamId;

/// What happened (PyTorch's trace `action`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceAction {
    /// A block was handed out; `size` is the unrounded request.
    Alloc,
    /// The user freed a block; it may still wait on other streams.
    FreeRequested,
    /// The free completed: the block is reusable.
    FreeCompleted,
    /// A segment was obtained from the driver.
    SegmentAlloc,
    /// A segment was returned to the driver.
    SegmentFree,
    /// Pages were mapped into an expandable segment.
    SegmentMap,
    /// Pages were unmapped from an expandable segment.
    SegmentUnmap,
    /// A snapshot was taken; `size` is the active bytes it reported.
    Snapshot,
    /// An allocation failed; `addr` holds the driver's free bytes.
    Oom,
    /// A user annotation.
    UserDefined,
}

/// One trace entry (`device_traces[d][i]`): what the core records, and what a recording's
/// reader yields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceEntry {
    /// What happened.
    pub action: TraceAction,
    /// Block or segment address; for [`TraceAction::Oom`], the driver's free bytes.
    pub addr: u64,
    /// Bytes (see [`TraceAction`] for which size each action reports).
    pub size: u64,
    /// Stream handle.
    pub stream: StreamId,
    /// Microseconds since the Unix epoch, on the device's clock (always set by the core; a
    /// recording may lack it).
    pub time_us: Option<u64>,
    /// The pool of the block or segment (for an OOM, the pool the request went to; for a
    /// snapshot, the default). Recordings carry it from PyTorch 2.12 on (`pool_id`); in an
    /// older one's it is inferred (Note [Inferred pools]) or the default.
    pub pool: PoolId,
}

impl Serialize for TraceEntry {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(None)?;
        map.serialize_entry("action", &self.action)?;
        // PyTorch names the address field `device_free` on OOM entries.
        let addr_key = if self.action == TraceAction::Oom {
            "device_free"
        } else {
            "addr"
        };
        map.serialize_entry(addr_key, &self.addr)?;
        map.serialize_entry("size", &self.size)?;
        map.serialize_entry("stream", &self.stream)?;
        if let Some(time_us) = self.time_us {
            map.serialize_entry("time_us", &time_us)?;
        }
        map.serialize_entry("pool_id", &self.pool)?;
        map.serialize_entry("frames", &[] as &[()])?;
        map.end()
    }
}

/// The ring buffer of trace entries.
#[derive(Debug, Default, Clone)]
pub(crate) struct History {
    entries: VecDeque<TraceEntry>,
    /// 0 when recording is off.
    capacity: usize,
}

impl History {
    pub fn is_enabled(&self) -> bool {
        self.capacity > 0
    }

    /// Turns recording on with room for `max_entries` (at least one), or off (clearing).
    pub fn set(&mut self, max_entries: Option<usize>) {
        match max_entries {
            Some(n) => {
                self.capacity = n.max(1);
                while self.entries.len() > self.capacity {
                    self.entries.pop_front();
                }
            }
            None => {
                self.capacity = 0;
                self.entries = VecDeque::new();
            }
        }
    }

    pub fn record(&mut self, entry: TraceEntry) {
        if self.entries.len() == self.capacity {
            self.entries.pop_front();
        }
        self.entries.push_back(entry);
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Removes and returns the entries, oldest first.
    pub fn take(&mut self) -> Vec<TraceEntry> {
        // Moved out, not copied: a self-planning job takes up to 2^20 under the lock.
        Vec::from(std::mem::take(&mut self.entries))
    }

    /// Entries, oldest first.
    pub fn entries(&self) -> Vec<TraceEntry> {
        self.entries.iter().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(addr: u64) -> TraceEntry {
        TraceEntry {
            action: TraceAction::Alloc,
            addr,
            size: 1,
            stream: crate::device::StreamId::DEFAULT,
            time_us: Some(0),
            pool: PoolId(0, 3),
        }
    }

    #[test]
    fn ring_buffer_keeps_the_newest() {
        let mut h = History::default();
        h.set(Some(3));
        for a in 1..=5 {
            h.record(entry(a));
        }
        let addrs: Vec<_> = h.entries().iter().map(|e| e.addr).collect();
        assert_eq!(addrs, [3, 4, 5]);
        h.set(None);
        assert!(h.entries().is_empty());
        assert!(!h.is_enabled());
    }

    #[test]
    fn oom_entries_name_the_free_bytes() {
        let oom = TraceEntry {
            action: TraceAction::Oom,
            ..entry(42)
        };
        let json = serde_json::to_value(oom).expect("serializes");
        assert_eq!(json["action"], "oom");
        assert_eq!(json["device_free"], 42);
        assert!(json.get("addr").is_none());
        let json = serde_json::to_value(entry(7)).expect("serializes");
        assert_eq!(json["action"], "alloc");
        assert_eq!(json["addr"], 7);
        assert_eq!(json["pool_id"], serde_json::json!([0, 3]));
    }
}
