//! Stack frames of a recording, interned: each distinct string, frame and stack is stored
//! once, and events and blocks refer to a stack by its [`StackId`].
//!
//! A snapshot with stacks repeats the same few thousand frames in every one of its entries
//! (a 1 GB pickle holds tens of millions of frame dicts); interned, they cost a few bytes per
//! distinct frame and four bytes per frame of each distinct stack.
//!
//! # Invariants
//! - Ids are dense indices, assigned in first-seen order: `StringId(i)` is the i-th distinct
//!   string, and likewise for frames and stacks. Interning the same content twice gives the
//!   same id.
//! - [`StackId::EMPTY`] is the stack of no frames (an event recorded without stacks).

use std::hash::BuildHasherDefault;

use indexmap::IndexSet;
use rustc_hash::FxHasher;

type Set<T> = IndexSet<T, BuildHasherDefault<FxHasher>>;

/// A distinct string of the recording.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StringId(pub(crate) u32);

/// A distinct frame of the recording.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FrameId(pub(crate) u32);

/// A distinct stack (innermost frame first, as PyTorch records them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StackId(pub(crate) u32);

impl StackId {
    /// The stack of no frames.
    pub const EMPTY: StackId = StackId(0);
}

/// One frame: PyTorch's `{"filename": ..., "line": ..., "name": ...}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Frame {
    /// The source file (or the C++ library) of the frame.
    pub filename: StringId,
    /// The line in it (0 where unknown).
    pub line: i64,
    /// The function.
    pub name: StringId,
}

/// The interned strings, frames and stacks of a recording.
#[derive(Clone, Debug)]
pub struct Frames {
    strings: Set<Box<str>>,
    frames: Set<Frame>,
    /// Every distinct stack's frames, end to end; `stack_ends[i]` ends stack `i`.
    stack_frames: Vec<FrameId>,
    stack_ends: Vec<u32>,
    /// Each distinct stack's content, for interning.
    stacks: rustc_hash::FxHashMap<Box<[FrameId]>, StackId>,
    /// What the tables hold, in bytes (content and hash-table slots, estimated).
    bytes: u64,
}

impl Default for Frames {
    fn default() -> Self {
        let mut frames = Frames {
            strings: Set::default(),
            frames: Set::default(),
            stack_frames: Vec::new(),
            stack_ends: Vec::new(),
            stacks: rustc_hash::FxHashMap::default(),
            bytes: 0,
        };
        let empty = frames.stack(&[]);
        debug_assert_eq!(empty, StackId::EMPTY);
        frames
    }
}

impl Frames {
    /// The id of `s`, interning it where new.
    pub(crate) fn string(&mut self, s: &str) -> StringId {
        if let Some(i) = self.strings.get_index_of(s) {
            return StringId(i as u32);
        }
        self.bytes += (s.len() + 48) as u64;
        StringId(self.strings.insert_full(s.into()).0 as u32)
    }

    /// The id of `s` if the recording has that string.
    pub fn find_string(&self, s: &str) -> Option<StringId> {
        self.strings.get_index_of(s).map(|i| StringId(i as u32))
    }

    /// The id of `frame`, interning it where new.
    pub(crate) fn frame(&mut self, frame: Frame) -> FrameId {
        let (i, new) = self.frames.insert_full(frame);
        if new {
            self.bytes += 40;
        }
        FrameId(i as u32)
    }

    /// The id of the stack of `frames`, interning it where new.
    pub(crate) fn stack(&mut self, frames: &[FrameId]) -> StackId {
        if let Some(&id) = self.stacks.get(frames) {
            return id;
        }
        let id = StackId(self.stack_ends.len() as u32);
        self.stack_frames.extend_from_slice(frames);
        self.stack_ends.push(self.stack_frames.len() as u32);
        self.stacks.insert(frames.into(), id);
        self.bytes += (frames.len() * 8 + 56) as u64;
        id
    }

    /// A string by id.
    pub fn str(&self, id: StringId) -> &str {
        self.strings.get_index(id.0 as usize).map_or("", |s| s)
    }

    /// A frame by id.
    pub fn get(&self, id: FrameId) -> Frame {
        self.frames[id.0 as usize]
    }

    /// A frame as people read it: `file:line in function`.
    pub fn describe(&self, id: FrameId) -> String {
        let frame = self.get(id);
        format!(
            "{}:{} in {}",
            self.str(frame.filename),
            frame.line,
            self.str(frame.name)
        )
    }

    /// A stack's frames, innermost first.
    pub fn frames_of(&self, id: StackId) -> &[FrameId] {
        let i = id.0 as usize;
        let end = self.stack_ends.get(i).copied().unwrap_or(0) as usize;
        let start = if i == 0 {
            0
        } else {
            self.stack_ends[i - 1] as usize
        };
        &self.stack_frames[start.min(end)..end]
    }

    /// Distinct strings.
    pub fn string_count(&self) -> usize {
        self.strings.len()
    }

    /// Distinct frames.
    pub fn frame_count(&self) -> usize {
        self.frames.len()
    }

    /// Distinct stacks (the empty one included).
    pub fn stack_count(&self) -> usize {
        self.stack_ends.len()
    }

    /// Bytes these tables hold (for the reader's memory budget): content plus the hash
    /// tables' slots.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interning_gives_one_id_per_distinct_content() {
        let mut f = Frames::default();
        let (a, b) = (f.string("train.py"), f.string("forward"));
        assert_eq!(f.string("train.py"), a);
        let one = f.frame(Frame {
            filename: a,
            line: 10,
            name: b,
        });
        let two = f.frame(Frame {
            filename: a,
            line: 11,
            name: b,
        });
        assert_ne!(one, two);
        assert_eq!(
            f.frame(Frame {
                filename: a,
                line: 10,
                name: b
            }),
            one
        );
        let s = f.stack(&[one, two]);
        assert_eq!(f.stack(&[one, two]), s);
        assert_ne!(f.stack(&[two, one]), s);
        assert_eq!(f.frames_of(s), &[one, two]);
        assert_eq!(f.frames_of(StackId::EMPTY), &[]);
        assert_eq!(f.stack(&[]), StackId::EMPTY);
        assert_eq!(f.str(f.get(one).filename), "train.py");
        assert_eq!((f.frame_count(), f.stack_count()), (2, 3));
    }
}
