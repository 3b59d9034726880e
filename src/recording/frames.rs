//! Stack frames of a recording, interned: each distinct string, frame, stack, FX node, list
//! of strings and event context is stored once, and events and blocks refer to a stack by its
//! [`StackId`] and to their context by its [`ContextId`].
//!
//! A snapshot with stacks repeats the same few thousand frames in every one of its entries
//! (a 1 GB pickle holds tens of millions of frame dicts); interned, they cost a few bytes per
//! distinct frame and four bytes per frame of each distinct stack. Frames of a torch.compile
//! graph (`_snapshot(augment_with_fx_traces=True)`) carry the FX node that ran them; 2.6+
//! trace entries carry a compile context, user metadata and (2.13+) the frames of the
//! forward pass a backward allocation belongs to: interned the same way.
//!
//! # Invariants
//! - Ids are dense indices, assigned in first-seen order: `StringId(i)` is the i-th distinct
//!   string, and likewise for frames, stacks, FX nodes, lists and contexts. Interning the same
//!   content twice gives the same id.
//! - [`StackId::EMPTY`] is the stack of no frames (an event recorded without stacks);
//!   [`ContextId::NONE`] the context of an event that carries none.

use std::hash::BuildHasherDefault;

use indexmap::IndexSet;
use rustc_hash::FxHasher;

pub(crate) type Set<T> = IndexSet<T, BuildHasherDefault<FxHasher>>;

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

/// A distinct FX node of the recording (`FxId(i)` is the node of index `i - 1`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FxId(pub(crate) std::num::NonZeroU32);

/// A distinct list of strings (a trace entry's `forward_frames`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ListId(pub(crate) u32);

/// A distinct event context.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContextId(pub(crate) u32);

impl ContextId {
    /// The context of an event that carries none.
    pub const NONE: ContextId = ContextId(0);
}

/// One frame: PyTorch's `{"filename": ..., "line": ..., "name": ...}`, and the FX node of a
/// compiled graph that ran it where the snapshot was augmented with FX traces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Frame {
    /// The source file (or the C++ library) of the frame.
    pub filename: StringId,
    /// The line in it (0 where unknown).
    pub line: i64,
    /// The function.
    pub name: StringId,
    /// Its FX node, if the frame carries `fx_*` fields.
    pub fx: Option<FxId>,
}

/// The `fx_*` fields of a frame: which node of a torch.compile graph it belongs to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FxNode {
    /// `fx_node_op`: the node's kind (`call_function`, `placeholder`, ...).
    pub op: Option<StringId>,
    /// `fx_node_name`: the node's name in the graph.
    pub name: Option<StringId>,
    /// `fx_original_trace`: the user code the node was traced from.
    pub original_trace: Option<StringId>,
    /// `fx_node_info`: the node's description.
    pub info: Option<StringId>,
}

impl FxNode {
    /// The node of a frame's `fx_*` fields in [`crate::recording::doc`]'s `FX_KEYS` order (op,
    /// name, original trace, info), if any of them is set.
    pub(crate) fn of(fields: [Option<StringId>; 4]) -> Option<FxNode> {
        let [op, name, original_trace, info] = fields;
        let node = FxNode {
            op,
            name,
            original_trace,
            info,
        };
        (node != FxNode::default()).then_some(node)
    }
}

/// What a trace entry carries besides its stack.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct EventContext {
    /// `compile_context`: the torch.compile frame and graph it ran in ("N/A" is none).
    pub compile_context: Option<StringId>,
    /// `user_metadata`: what the program set with `_set_memory_metadata` (empty is none).
    pub user_metadata: Option<StringId>,
    /// `forward_frames`: the forward pass's frames, for an allocation of its backward.
    pub forward_frames: Option<ListId>,
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
    fx: Set<FxNode>,
    lists: Set<Box<[StringId]>>,
    contexts: Set<EventContext>,
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
            fx: Set::default(),
            lists: Set::default(),
            contexts: Set::default(),
            bytes: 0,
        };
        let empty = frames.stack(&[]);
        debug_assert_eq!(empty, StackId::EMPTY);
        let none = frames.context(EventContext::default());
        debug_assert_eq!(none, ContextId::NONE);
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

    /// The id of `frame` as FX node `fx` (if any) ran it, interning both where new.
    pub(crate) fn frame_with_fx(&mut self, frame: Frame, fx: Option<FxNode>) -> FrameId {
        let fx = fx.map(|node| self.fx_node(node));
        self.frame(Frame { fx, ..frame })
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

    /// The id of an FX node, interning it where new.
    pub(crate) fn fx_node(&mut self, node: FxNode) -> FxId {
        let (i, new) = self.fx.insert_full(node);
        if new {
            self.bytes += 40;
        }
        // At most 2^32 - 2 nodes: a node takes at least a value of the input.
        FxId(std::num::NonZeroU32::new(i as u32 + 1).unwrap_or(std::num::NonZeroU32::MAX))
    }

    /// An FX node by id.
    pub fn fx(&self, id: FxId) -> FxNode {
        self.fx
            .get_index(id.0.get() as usize - 1)
            .copied()
            .unwrap_or_default()
    }

    /// The id of a list of strings, interning it where new.
    pub(crate) fn list(&mut self, strings: &[StringId]) -> ListId {
        if let Some(i) = self.lists.get_index_of(strings) {
            return ListId(i as u32);
        }
        self.bytes += (strings.len() * 4 + 48) as u64;
        ListId(self.lists.insert_full(strings.into()).0 as u32)
    }

    /// A list of strings by id.
    pub fn list_of(&self, id: ListId) -> &[StringId] {
        self.lists.get_index(id.0 as usize).map_or(&[], |l| l)
    }

    /// The id of an event context, interning it where new.
    pub(crate) fn context(&mut self, context: EventContext) -> ContextId {
        let (i, new) = self.contexts.insert_full(context);
        if new {
            self.bytes += 40;
        }
        ContextId(i as u32)
    }

    /// Takes the contexts a reader interned on its own, numbered in first-seen order from
    /// [`ContextId::NONE`] as [`Self::context`] numbers them, in place of the table here
    /// (which holds only `NONE`).
    pub(crate) fn adopt_contexts(&mut self, contexts: Set<EventContext>) {
        debug_assert_eq!(contexts.get_index(0), Some(&EventContext::default()));
        debug_assert_eq!(self.contexts.len(), 1);
        self.bytes += 40 * contexts.len().saturating_sub(self.contexts.len()) as u64;
        self.contexts = contexts;
    }

    /// An event context by id.
    pub fn context_of(&self, id: ContextId) -> EventContext {
        self.contexts
            .get_index(id.0 as usize)
            .copied()
            .unwrap_or_default()
    }

    /// A context as people read it, one line each: `compile context: ...`, `user metadata:
    /// ...`, then `forward: ...` for each of the first `max_forward` forward frames.
    pub fn describe_context(&self, id: ContextId, max_forward: usize) -> Vec<String> {
        let c = self.context_of(id);
        let mut lines = Vec::new();
        if let Some(s) = c.compile_context {
            lines.push(format!("compile context: {}", self.str(s)));
        }
        if let Some(s) = c.user_metadata {
            lines.push(format!("user metadata: {}", self.str(s)));
        }
        if let Some(l) = c.forward_frames {
            let frames = self.list_of(l);
            lines.extend(
                frames
                    .iter()
                    .take(max_forward)
                    .map(|&s| format!("forward: {}", self.str(s))),
            );
        }
        lines
    }

    /// A string by id.
    pub fn str(&self, id: StringId) -> &str {
        self.strings.get_index(id.0 as usize).map_or("", |s| s)
    }

    /// A frame by id.
    pub fn get(&self, id: FrameId) -> Frame {
        self.frames[id.0 as usize]
    }

    /// A frame as people read it: `file:line in function`, and, for a frame of a compiled
    /// graph, ` [fx OP NAME]`.
    pub fn describe(&self, id: FrameId) -> String {
        let frame = self.get(id);
        let mut text = format!(
            "{}:{} in {}",
            self.str(frame.filename),
            frame.line,
            self.str(frame.name)
        );
        if let Some(fx) = frame.fx.map(|f| self.fx(f)) {
            let parts: Vec<&str> = [fx.op, fx.name]
                .iter()
                .flatten()
                .map(|&s| self.str(s))
                .collect();
            if !parts.is_empty() {
                text.push_str(&format!(" [fx {}]", parts.join(" ")));
            }
        }
        text
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
            fx: None,
        });
        let two = f.frame(Frame {
            filename: a,
            line: 11,
            name: b,
            fx: None,
        });
        assert_ne!(one, two);
        assert_eq!(
            f.frame(Frame {
                filename: a,
                line: 10,
                name: b,
                fx: None,
            }),
            one
        );
        // The same line run by an FX node is another frame, described with its node.
        let (op, node) = (f.string("call_function"), f.string("mm_3"));
        let fx = f.fx_node(FxNode {
            op: Some(op),
            name: Some(node),
            ..FxNode::default()
        });
        let compiled = f.frame(Frame {
            filename: a,
            line: 10,
            name: b,
            fx: Some(fx),
        });
        assert_ne!(compiled, one);
        assert_eq!(
            f.describe(compiled),
            "train.py:10 in forward [fx call_function mm_3]"
        );
        assert_eq!(f.describe(one), "train.py:10 in forward");
        let s = f.stack(&[one, two]);
        assert_eq!(f.stack(&[one, two]), s);
        assert_ne!(f.stack(&[two, one]), s);
        assert_eq!(f.frames_of(s), &[one, two]);
        assert_eq!(f.frames_of(StackId::EMPTY), &[]);
        assert_eq!(f.stack(&[]), StackId::EMPTY);
        assert_eq!(f.str(f.get(one).filename), "train.py");
        assert_eq!((f.frame_count(), f.stack_count()), (3, 3));
        // Contexts: the empty one is NONE; lists and contexts are interned.
        assert_eq!(f.context(EventContext::default()), ContextId::NONE);
        let fwd = f.list(&[a, b]);
        assert_eq!(f.list(&[a, b]), fwd);
        let c = f.context(EventContext {
            compile_context: Some(node),
            forward_frames: Some(fwd),
            ..EventContext::default()
        });
        assert_ne!(c, ContextId::NONE);
        assert_eq!(
            f.describe_context(c, 1),
            ["compile context: mm_3", "forward: train.py"]
        );
    }
}
