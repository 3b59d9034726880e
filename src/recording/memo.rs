//! The pickle memo, compact: a dump with stacks memoizes every frame dict it writes (tens of
//! millions of entries in a large one), so an entry must cost about two bytes, not sixteen.
//!
//! Entries are [`Val`]s packed into 32 bits (a 3-bit tag and a 29-bit id; a plain number,
//! which Python never memoizes, goes to a side table). Dense indices (those MEMOIZE assigns,
//! one after another) fill chunks of [`CHUNK`] entries; a full chunk whose entries mostly lie
//! within 65 535 of one another (runs of frame dicts, whose frames are interned) is narrowed to
//! 16-bit offsets from a base, the rest kept as exceptions. Other indices go to a map.
//!
//! # Invariants
//! - `get(i)` returns the last value `put(i, _)` stored, whatever the representation.
//! - A narrow chunk holds at most 512 exceptions (an eighth of its entries, each found in
//!   one step); past that it is widened back to 32 bits, so an entry costs at most about 4
//!   bytes plus its share of the exceptions.

use rustc_hash::FxHashMap;

use super::doc::{ObjId, Val};
use super::frames::{FrameId, ListId, StackId, StringId};

/// Entries per chunk.
pub(crate) const CHUNK: usize = 4096;
const TAG_SHIFT: u32 = 29;
const PAYLOAD: u32 = (1 << TAG_SHIFT) - 1;
/// Narrow entries from here up name an exception (its index in the chunk's exceptions).
const EXCEPTIONS_FROM: u16 = 0xFE00;
/// Exceptions a narrow chunk may hold: an eighth of its entries.
const MAX_EXCEPTIONS: usize = (u16::MAX - EXCEPTIONS_FROM) as usize + 1;

enum Chunk {
    Wide(Box<[u32]>),
    Narrow {
        base: u32,
        /// An offset from `base`, or `EXCEPTIONS_FROM + k` for `exceptions[k]`.
        low: Box<[u16]>,
        exceptions: Vec<u32>,
    },
}

impl Chunk {
    /// A full chunk, narrowed where its entries allow.
    fn new(entries: &[u32]) -> Chunk {
        // The base: the smallest entry of the most common tag.
        let mut counts = [0usize; 8];
        for &e in entries {
            counts[(e >> TAG_SHIFT) as usize] += 1;
        }
        let tag = (0..8).max_by_key(|&t| counts[t]).unwrap_or(0) as u32;
        let base = entries
            .iter()
            .copied()
            .filter(|e| e >> TAG_SHIFT == tag)
            .min()
            .unwrap_or(0);
        let mut low = Vec::with_capacity(entries.len());
        let mut exceptions = Vec::new();
        for &e in entries {
            match e
                .checked_sub(base)
                .filter(|&d| d < u32::from(EXCEPTIONS_FROM))
            {
                Some(d) => low.push(d as u16),
                None if exceptions.len() < MAX_EXCEPTIONS => {
                    low.push(EXCEPTIONS_FROM + exceptions.len() as u16);
                    exceptions.push(e);
                }
                None => return Chunk::Wide(entries.into()),
            }
        }
        Chunk::Narrow {
            base,
            low: low.into(),
            exceptions,
        }
    }

    #[inline]
    fn get(&self, i: usize) -> u32 {
        match self {
            Chunk::Wide(v) => v[i],
            Chunk::Narrow {
                base,
                low,
                exceptions,
            } => match low[i] {
                l if l >= EXCEPTIONS_FROM => exceptions[usize::from(l - EXCEPTIONS_FROM)],
                d => base + u32::from(d),
            },
        }
    }

    fn set(&mut self, i: usize, packed: u32) {
        if let Chunk::Narrow {
            base,
            low,
            exceptions,
        } = self
        {
            match packed
                .checked_sub(*base)
                .filter(|&d| d < u32::from(EXCEPTIONS_FROM))
            {
                Some(d) => {
                    low[i] = d as u16;
                    return;
                }
                None if low[i] >= EXCEPTIONS_FROM => {
                    exceptions[usize::from(low[i] - EXCEPTIONS_FROM)] = packed;
                    return;
                }
                None if exceptions.len() < MAX_EXCEPTIONS => {
                    low[i] = EXCEPTIONS_FROM + exceptions.len() as u16;
                    exceptions.push(packed);
                    return;
                }
                // Out of exception slots: widened below.
                None => {}
            }
            let wide: Vec<u32> = (0..low.len()).map(|j| self.get(j)).collect();
            *self = Chunk::Wide(wide.into());
        }
        if let Chunk::Wide(v) = self {
            v[i] = packed;
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Chunk::Wide(v) => v.len() * 4,
            Chunk::Narrow {
                low, exceptions, ..
            } => low.len() * 2 + exceptions.capacity() * 4,
        }
    }
}

/// The memo.
#[derive(Default)]
pub(crate) struct Memo {
    chunks: Vec<Chunk>,
    /// The chunk being filled.
    open: Vec<u32>,
    sparse: FxHashMap<u32, Val>,
    others: Vec<Val>,
    /// What the full chunks hold, in bytes (kept as they change).
    chunk_bytes: usize,
}

impl Memo {
    #[inline]
    fn pack(&mut self, v: Val) -> u32 {
        let (tag, id) = match v {
            Val::Str(s) => (1, s.0),
            Val::Frame(f) => (2, f.0),
            Val::Stack(s) => (3, s.0),
            Val::Obj(o) => (4, o.0),
            Val::Strings(l) => (6, l.0),
            _ => (5, u32::MAX),
        };
        if id <= PAYLOAD {
            return (tag << TAG_SHIFT) | id;
        }
        self.others.push(v);
        (5 << TAG_SHIFT) | ((self.others.len() - 1) as u32 & PAYLOAD)
    }

    #[inline]
    fn unpack(&self, packed: u32) -> Option<Val> {
        let id = packed & PAYLOAD;
        Some(match packed >> TAG_SHIFT {
            1 => Val::Str(StringId(id)),
            2 => Val::Frame(FrameId(id)),
            3 => Val::Stack(StackId(id)),
            4 => Val::Obj(ObjId(id)),
            5 => *self.others.get(id as usize)?,
            6 => Val::Strings(ListId(id)),
            _ => return None,
        })
    }

    /// Dense entries so far.
    fn len(&self) -> usize {
        self.chunks.len() * CHUNK + self.open.len()
    }

    /// Stores `v` under `index`.
    #[inline]
    pub fn put(&mut self, index: u32, v: Val) {
        let i = index as usize;
        let len = self.len();
        if i == len {
            let packed = self.pack(v);
            self.open.push(packed);
            if self.open.len() == CHUNK {
                let chunk = Chunk::new(&self.open);
                self.chunk_bytes += chunk.bytes();
                self.chunks.push(chunk);
                self.open.clear();
            }
        } else if i < len {
            let packed = self.pack(v);
            let (chunk, at) = (i / CHUNK, i % CHUNK);
            match self.chunks.get_mut(chunk) {
                Some(c) => {
                    let before = c.bytes();
                    c.set(at, packed);
                    self.chunk_bytes = self.chunk_bytes - before + c.bytes();
                }
                None => self.open[at] = packed,
            }
        } else {
            self.sparse.insert(index, v);
        }
    }

    /// The value stored under `index`, if one was.
    #[inline]
    pub fn get(&self, index: u32) -> Option<Val> {
        let i = index as usize;
        if i >= self.len() {
            return self.sparse.get(&index).copied();
        }
        let (chunk, at) = (i / CHUNK, i % CHUNK);
        let packed = match self.chunks.get(chunk) {
            Some(c) => c.get(at),
            None => self.open[at],
        };
        self.unpack(packed)
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        (self.chunk_bytes
            + self.chunks.capacity() * 48
            + self.open.capacity() * 4
            + self.sparse.capacity() * 32
            + self.others.capacity() * 16) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_reads_back_as_last_stored_in_any_representation() {
        let mut memo = Memo::default();
        let n = 5 * CHUNK as u32 + 17;
        let value = |i: u32| match i % 97 {
            0 => Val::Str(StringId(i)),
            1 => Val::Int(-i64::from(i)),
            2 => Val::Obj(ObjId(i)),
            _ => Val::Frame(FrameId(i % 1000)),
        };
        for i in 0..n {
            memo.put(i, value(i));
        }
        for i in 0..n {
            assert_eq!(memo.get(i), Some(value(i)), "entry {i}");
        }
        // Rewritten entries, in narrow and wide chunks, then far away.
        memo.put(5, Val::Stack(StackId(3)));
        memo.put(6, Val::Frame(FrameId(400_000)));
        memo.put(CHUNK as u32 + 1, Val::Float(1.5));
        assert_eq!(memo.get(5), Some(Val::Stack(StackId(3))));
        assert_eq!(memo.get(6), Some(Val::Frame(FrameId(400_000))));
        assert_eq!(memo.get(CHUNK as u32 + 1), Some(Val::Float(1.5)));
        assert_eq!(memo.get(7), Some(value(7)));
        memo.put(1 << 30, Val::None);
        assert_eq!(memo.get(1 << 30), Some(Val::None));
        assert_eq!(memo.get(n + 1), None);
    }

    #[test]
    fn runs_of_frames_cost_two_bytes_an_entry_and_scattered_ones_four() {
        let mut memo = Memo::default();
        let n = 64 * CHUNK as u32;
        for i in 0..n {
            memo.put(i, Val::Frame(FrameId(i % 9_000)));
        }
        let per_entry = memo.bytes() as f64 / f64::from(n);
        assert!(per_entry < 2.2, "{per_entry:.2} bytes an entry");
        let mut scattered = Memo::default();
        for i in 0..n {
            scattered.put(
                i,
                Val::Frame(FrameId(i.wrapping_mul(2_654_435_761) % 5_000_000)),
            );
        }
        let per_entry = scattered.bytes() as f64 / f64::from(n);
        assert!(
            (4.0..4.5).contains(&per_entry),
            "{per_entry:.2} bytes an entry"
        );
        let recount: usize = scattered.chunks.iter().map(Chunk::bytes).sum();
        assert_eq!(recount, scattered.chunk_bytes, "kept as they change");
        for i in (0..n).step_by(977) {
            let expected = Val::Frame(FrameId(i.wrapping_mul(2_654_435_761) % 5_000_000));
            assert_eq!(scattered.get(i), Some(expected));
        }
    }
}
