//! A decoded document (from a pickle or JSON) in compact form, and a cursor over it that
//! reports schema errors with the path where they occurred.
//!
//! Values are 16-byte [`Val`]s. Strings are interned; containers live in an arena of
//! [`Obj`]s. Stack frames are reduced as they are stored into their parent: a dict of
//! exactly `filename`, `line` and `name` (and any of the FX fields `fx_node_op`,
//! `fx_node_name`, `fx_original_trace`, `fx_node_info`, strings or None) becomes an interned
//! [`Frame`](super::frames::Frame), a list of only frames an interned stack, and a non-empty
//! list of only strings (a trace entry's `forward_frames`) an interned list; their containers
//! are freed for reuse. So memory grows with the events and the distinct frames a recording
//! has, not with the frame dicts its file repeats. The cursor reads a reduced frame, stack or
//! list as the dict or list it was.
//!
//! # Invariants
//! - Containers hold values, never nested containers: dropping or walking a document never
//!   recurses, whatever its nesting. A list stored into itself (a cycle) is reduced when it is
//!   stored, so extending it afterwards is refused; dicts and tuples may be cyclic.
//! - A container is reduced when it is first stored into a parent (Python's pickler writes
//!   every container whole before storing it). Its memo entry is rewritten to the reduced
//!   value; any other reference to it (a DUP, a memo read, a second memo entry) resolves to
//!   the reduced value through its emptied slot. A reduced value is immutable: extending one
//!   is an error.
//! - [`Doc::bytes`] accounts what the document holds (arena slots, containers' allocations,
//!   interned tables; a container past a million values grows by a quarter at a time), and [`Doc::work`] counts the reading work (values built, dict entries looked
//!   at), so that callers can bound both in proportion to the input.

use std::cell::{Cell, RefCell};

use rustc_hash::FxHashMap;

use super::TraceError;
use super::frames::{Frame, FrameId, Frames, FxNode, ListId, StackId, StringId};

/// Index of a container in a [`Doc`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ObjId(pub u32);

/// One decoded value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Val {
    None,
    Bool(bool),
    Int(i64),
    /// An integer outside `i64` (kept only to say so in errors).
    BigInt,
    Float(f64),
    Str(StringId),
    /// A reduced `{"filename", "line", "name"}` dict.
    Frame(FrameId),
    /// A reduced list of frames.
    Stack(StackId),
    /// A reduced non-empty list of strings.
    Strings(ListId),
    Obj(ObjId),
}

/// A container.
#[derive(Debug)]
pub(crate) enum Obj {
    List(Vec<Val>),
    Tuple(Vec<Val>),
    Dict(Vec<(Val, Val)>),
}

/// No memo entry.
pub(crate) const NO_MEMO: u32 = u32::MAX;

#[derive(Debug)]
struct Slot {
    obj: Obj,
    /// The memo index it was stored under, if once.
    memo: u32,
    /// Referred to from more than one place before it was stored: never reduced.
    shared: bool,
    /// Stored into a parent (or made the root): its one chance of reduction is past.
    stored: bool,
    /// What it was reduced to, for the other references a shared container has.
    reduced: Option<Val>,
}

/// Dicts at least this large get a key index on their first lookup, so that a dict read many
/// times (through the memo) costs its size once, not on every read.
const INDEXED_DICT: usize = 16;

/// Bytes accounted per arena slot, per list value and per dict entry.
const SLOT_BYTES: u64 = 72;
const VAL_BYTES: u64 = 16;
const ENTRY_BYTES: u64 = 32;

/// The document: its root, its containers and its interned strings, frames and stacks.
#[derive(Debug)]
pub(crate) struct Doc {
    slots: Vec<Slot>,
    free: Vec<u32>,
    pub frames: Frames,
    pub root: Val,
    keys: [StringId; 3],
    /// The ids of "fx_node_op", "fx_node_name", "fx_original_trace", "fx_node_info".
    fx_keys: [StringId; 4],
    /// Bytes held by the arena and containers (the interned tables count separately).
    held: u64,
    /// Values created (the schema's budget of events, blocks and segments).
    values: u64,
    work: Cell<u64>,
    /// The most bytes a decoder accounted while reading (its stack and memo included).
    peak: u64,
    index: RefCell<FxHashMap<u32, FxHashMap<StringId, Val>>>,
}

impl Default for Doc {
    fn default() -> Self {
        let mut frames = Frames::default();
        let keys = [
            frames.string("filename"),
            frames.string("line"),
            frames.string("name"),
        ];
        let fx_keys = FX_KEYS.map(|k| frames.string(k));
        Doc {
            slots: Vec::new(),
            free: Vec::new(),
            frames,
            root: Val::None,
            keys,
            fx_keys,
            held: 0,
            values: 0,
            work: Cell::new(0),
            peak: 0,
            index: RefCell::default(),
        }
    }
}

impl Doc {
    /// A new empty container.
    #[inline]
    pub fn new_obj(&mut self, obj: Obj) -> Val {
        self.values += 1;
        let slot = Slot {
            obj,
            memo: NO_MEMO,
            shared: false,
            stored: false,
            reduced: None,
        };
        match self.free.pop() {
            Some(i) => {
                // Reuse the freed container's allocation where it has the same kind.
                let old = &mut self.slots[i as usize];
                match (&mut old.obj, slot.obj) {
                    (Obj::List(v), Obj::List(_)) | (Obj::Tuple(v), Obj::Tuple(_)) => v.clear(),
                    (Obj::Dict(v), Obj::Dict(_)) => v.clear(),
                    (o, new) => {
                        self.held -= match o {
                            Obj::List(v) | Obj::Tuple(v) => VAL_BYTES * v.capacity() as u64,
                            Obj::Dict(v) => ENTRY_BYTES * v.capacity() as u64,
                        };
                        *o = new;
                    }
                }
                old.memo = NO_MEMO;
                old.shared = false;
                old.stored = false;
                old.reduced = None;
                Val::Obj(ObjId(i))
            }
            None => {
                self.held += SLOT_BYTES;
                self.slots.push(slot);
                Val::Obj(ObjId((self.slots.len() - 1) as u32))
            }
        }
    }

    /// A string value (interned).
    #[inline]
    pub fn str(&mut self, s: &str) -> Val {
        self.values += 1;
        Val::Str(self.frames.string(s))
    }

    /// Counts one scalar value built.
    #[inline]
    pub fn scalar(&mut self, v: Val) -> Val {
        self.values += 1;
        v
    }

    /// Counts `n` values built.
    #[inline]
    pub fn count_values(&mut self, n: u64) {
        self.values += n;
    }

    /// The ids of the frame dict's keys: "filename", "line" and "name".
    pub fn frame_keys(&self) -> [StringId; 3] {
        self.keys
    }

    /// The ids of the FX fields' keys, in [`FX_KEYS`]' order.
    pub fn fx_keys(&self) -> [StringId; 4] {
        self.fx_keys
    }

    /// The container `id`.
    pub fn obj(&self, id: ObjId) -> &Obj {
        &self.slots[id.0 as usize].obj
    }

    /// Appends `items` (already [`stored`](Self::store)) to a list.
    ///
    /// # Errors
    /// A message when `list` is not a list.
    #[inline]
    pub fn extend_list(&mut self, list: Val, items: &[Val]) -> Result<(), &'static str> {
        let list = self.resolve(list);
        let Val::Obj(id) = list else {
            return Err(match list {
                Val::Stack(_) => "a list of frames is extended after it was stored",
                Val::Strings(_) => "a list of strings is extended after it was stored",
                _ => "APPEND to something that is not a list",
            });
        };
        match &mut self.slots[id.0 as usize].obj {
            Obj::List(v) => {
                let before = v.capacity();
                grow(v, items.len());
                v.extend_from_slice(items);
                self.held += VAL_BYTES * (v.capacity() - before) as u64;
                Ok(())
            }
            _ => Err("APPEND to something that is not a list"),
        }
    }

    /// Sets key-value pairs (already [`stored`](Self::store)) in a dict.
    ///
    /// # Errors
    /// A message when `dict` is not a dict.
    #[inline]
    pub fn extend_dict(&mut self, dict: Val, pairs: &[Val]) -> Result<(), &'static str> {
        if !pairs.len().is_multiple_of(2) {
            return Err("SETITEMS with an odd number of values");
        }
        let dict = self.resolve(dict);
        let Val::Obj(id) = dict else {
            return Err(match dict {
                Val::Frame(_) => "a frame dict is extended after it was stored",
                _ => "SETITEM on something that is not a dict",
            });
        };
        match &mut self.slots[id.0 as usize].obj {
            Obj::Dict(v) => {
                let before = v.capacity();
                grow(v, pairs.len() / 2);
                v.extend(pairs.chunks_exact(2).map(|kv| (kv[0], kv[1])));
                self.held += ENTRY_BYTES * (v.capacity() - before) as u64;
                Ok(())
            }
            _ => Err("SETITEM on something that is not a dict"),
        }
    }

    /// Fills a new tuple with `items` (already [`stored`](Self::store)).
    pub fn fill_tuple(&mut self, tuple: Val, items: &[Val]) {
        if let Val::Obj(id) = tuple
            && let Obj::Tuple(v) = &mut self.slots[id.0 as usize].obj
        {
            let before = v.capacity();
            v.extend_from_slice(items);
            self.held += VAL_BYTES * (v.capacity() - before) as u64;
        }
    }

    /// Notes that `v` was put in the memo under `index`. A container memoized twice is
    /// shared.
    #[inline]
    pub fn memoized(&mut self, v: Val, index: u32) {
        if let Val::Obj(id) = v {
            let slot = &mut self.slots[id.0 as usize];
            if slot.memo == NO_MEMO && !slot.stored {
                slot.memo = index;
            } else {
                slot.shared = true;
            }
        }
    }

    /// Notes a second reference to `v` (a DUP, or a memo read): if it is reduced, its slot
    /// stays to forward the other references.
    #[inline]
    pub fn shared(&mut self, v: Val) {
        if let Val::Obj(id) = v {
            let slot = &mut self.slots[id.0 as usize];
            slot.shared = true;
            // Its memo entry now resolves through the slot; it is not rewritten.
            slot.memo = NO_MEMO;
        }
    }

    /// The value `v` stands for: what a reduced container became.
    #[inline]
    pub fn resolve(&self, v: Val) -> Val {
        match v {
            Val::Obj(id) => self.slots[id.0 as usize].reduced.unwrap_or(v),
            _ => v,
        }
    }

    /// Stores `v` into a parent (or as the root): a frame-shaped dict or a list of frames is
    /// reduced the first time it is stored, its container freed (or, when other references
    /// to it remain, emptied and left to forward them). Returns the value to store, and the
    /// memo index to rewrite with it where the container had one.
    pub fn store(&mut self, v: Val) -> (Val, u32) {
        let v = self.resolve(v);
        let Val::Obj(id) = v else {
            return (v, NO_MEMO);
        };
        let slot = &mut self.slots[id.0 as usize];
        if slot.stored {
            return (v, NO_MEMO);
        }
        slot.stored = true;
        let (keys, fx_keys) = (self.keys, self.fx_keys);
        let reduced = match &self.slots[id.0 as usize].obj {
            Obj::Dict(entries) => frame_of(keys, fx_keys, entries)
                .map(|(frame, fx)| Val::Frame(self.frames.frame_with_fx(frame, fx))),
            Obj::List(items) => {
                let frames = all_of(items, |v| match v {
                    Val::Frame(f) => Some(f),
                    _ => None,
                });
                match frames {
                    Some(f) => Some(Val::Stack(self.frames.stack(&f))),
                    None => all_of(items, |v| match v {
                        Val::Str(s) => Some(s),
                        _ => None,
                    })
                    .map(|s| Val::Strings(self.frames.list(&s))),
                }
            }
            Obj::Tuple(_) => None,
        };
        let Some(reduced) = reduced else {
            return (v, NO_MEMO);
        };
        let slot = &mut self.slots[id.0 as usize];
        let memo = slot.memo;
        // A freed container keeps its allocation for reuse (still held); a forwarding one
        // gives it back.
        if slot.shared {
            self.held -= match &mut slot.obj {
                Obj::List(v) | Obj::Tuple(v) => {
                    let n = v.capacity();
                    *v = Vec::new();
                    VAL_BYTES * n as u64
                }
                Obj::Dict(v) => {
                    let n = v.capacity();
                    *v = Vec::new();
                    ENTRY_BYTES * n as u64
                }
            };
        }
        if slot.shared {
            slot.reduced = Some(reduced);
        } else {
            self.free.push(id.0);
        }
        (reduced, memo)
    }

    /// Bytes the document holds: arena, containers and interned tables.
    pub fn bytes(&self) -> u64 {
        self.held + self.frames.bytes()
    }

    /// Notes `bytes` held by a decoder (with what it holds beside the document).
    pub fn note_peak(&mut self, bytes: u64) {
        self.peak = self.peak.max(bytes);
    }

    /// The most bytes held while reading, as far as noted.
    pub fn peak(&self) -> u64 {
        self.peak.max(self.bytes())
    }

    /// Values created while reading.
    pub fn values(&self) -> u64 {
        self.values
    }

    /// Reading work so far: values built plus dict entries looked at.
    pub fn work(&self) -> u64 {
        self.work.get()
    }

    /// Adds `n` to the work counter.
    pub fn count_work(&self, n: u64) {
        self.work.set(self.work.get().saturating_add(n));
    }

    /// A cursor at the root.
    pub fn root(&self) -> Node<'_> {
        Node {
            doc: self,
            val: self.resolve(self.root),
            path: String::from("$"),
        }
    }

    /// The value of `key` in the dict `id` (the last one set, as Python keeps).
    fn lookup(&self, id: ObjId, entries: &[(Val, Val)], key: StringId) -> Option<Val> {
        if entries.len() < INDEXED_DICT {
            self.count_work(entries.len() as u64);
            return entries
                .iter()
                .rev()
                .find(|(k, _)| *k == Val::Str(key))
                .map(|&(_, v)| v);
        }
        self.count_work(1);
        let mut index = self.index.borrow_mut();
        let keys = index.entry(id.0).or_insert_with(|| {
            self.count_work(entries.len() as u64);
            entries
                .iter()
                .filter_map(|&(k, v)| match k {
                    Val::Str(s) => Some((s, v)),
                    _ => None,
                })
                .collect()
        });
        keys.get(&key).copied()
    }
}

/// Containers past this many values grow by a quarter, not double, so that one growth never
/// takes much more than the budget checked before it.
const LARGE: usize = 1 << 20;

/// Makes room in `v` for `n` more values.
fn grow<T>(v: &mut Vec<T>, n: usize) {
    if v.capacity() - v.len() >= n {
        return;
    }
    if v.len() < LARGE {
        v.reserve(n);
    } else {
        v.reserve_exact(n.max(v.len() / 4));
    }
}

/// What `pick` takes of each item, if it takes every one.
fn all_of<T>(items: &[Val], pick: impl Fn(Val) -> Option<T>) -> Option<Vec<T>> {
    items.iter().map(|&v| pick(v)).collect()
}

/// The FX fields a frame dict may carry (`_snapshot(augment_with_fx_traces=True)`).
pub(crate) const FX_KEYS: [&str; 4] = [
    "fx_node_op",
    "fx_node_name",
    "fx_original_trace",
    "fx_node_info",
];

/// The frame a dict holds, if it is PyTorch's frame dict: `filename`, `line` and `name`
/// (`keys` are their ids), and any of the FX fields (`fx_keys`), each a string or None, and
/// nothing else. The FX node, if any field is a string.
fn frame_of(
    keys: [StringId; 3],
    fx_keys: [StringId; 4],
    entries: &[(Val, Val)],
) -> Option<(Frame, Option<FxNode>)> {
    let [filename, line, name] = keys;
    let (mut f, mut l, mut n) = (None, None, None);
    let mut fx = [None; 4];
    if !(3..=7).contains(&entries.len()) {
        return None;
    }
    for (k, v) in entries {
        match (*k, *v) {
            (Val::Str(k), Val::Str(s)) if k == filename => f = Some(s),
            (Val::Str(k), Val::Int(i)) if k == line => l = Some(i),
            (Val::Str(k), Val::Str(s)) if k == name => n = Some(s),
            (Val::Str(k), v) => {
                let i = fx_keys.iter().position(|&x| x == k)?;
                fx[i] = match v {
                    Val::Str(s) => Some(s),
                    Val::None => None,
                    _ => return None,
                };
            }
            _ => return None,
        }
    }
    Some((
        Frame {
            filename: f?,
            line: l?,
            name: n?,
            fx: None,
        },
        FxNode::of(fx),
    ))
}

impl Val {
    fn kind(&self, doc: &Doc) -> &'static str {
        match self {
            Val::None => "None",
            Val::Bool(_) => "a bool",
            Val::Int(_) => "an int",
            Val::BigInt => "an int outside the signed 64-bit range",
            Val::Float(_) => "a float",
            Val::Str(_) => "a string",
            Val::Frame(_) => "a dict",
            Val::Stack(_) | Val::Strings(_) => "a list",
            Val::Obj(id) => match doc.obj(*id) {
                Obj::List(_) => "a list",
                Obj::Tuple(_) => "a tuple",
                Obj::Dict(_) => "a dict",
            },
        }
    }
}

/// A position in a document, with the path that led to it.
#[derive(Clone)]
pub(crate) struct Node<'a> {
    doc: &'a Doc,
    val: Val,
    path: String,
}

impl<'a> Node<'a> {
    fn error(&self, expected: &str) -> TraceError {
        TraceError::Schema {
            path: self.path.clone(),
            expected: expected.to_string(),
            found: self.val.kind(self.doc).to_string(),
        }
    }

    fn child(&self, val: Val, segment: impl std::fmt::Display) -> Node<'a> {
        Node {
            doc: self.doc,
            val: self.doc.resolve(val),
            path: format!("{}{segment}", self.path),
        }
    }

    /// Whether this node is a dict.
    pub fn is_dict(&self) -> bool {
        match self.val {
            Val::Frame(_) => true,
            Val::Obj(id) => matches!(self.doc.obj(id), Obj::Dict(_)),
            _ => false,
        }
    }

    /// Whether this node is None.
    pub fn is_none(&self) -> bool {
        self.val == Val::None
    }

    /// The value under `key`, if this is a dict that has it.
    pub fn get(&self, key: &str) -> Result<Option<Node<'a>>, TraceError> {
        let doc = self.doc;
        let found = match self.val {
            Val::Frame(f) => {
                let frame = doc.frames.get(f);
                let fx = frame.fx.map(|id| doc.frames.fx(id)).unwrap_or_default();
                match key {
                    "filename" => Some(Val::Str(frame.filename)),
                    "line" => Some(Val::Int(frame.line)),
                    "name" => Some(Val::Str(frame.name)),
                    "fx_node_op" => fx.op.map(Val::Str),
                    "fx_node_name" => fx.name.map(Val::Str),
                    "fx_original_trace" => fx.original_trace.map(Val::Str),
                    "fx_node_info" => fx.info.map(Val::Str),
                    _ => None,
                }
            }
            Val::Obj(id) => match doc.obj(id) {
                Obj::Dict(entries) => match doc.frames.find_string(key) {
                    Some(k) => doc.lookup(id, entries, k),
                    // No string in the whole document is this key.
                    None => None,
                },
                _ => return Err(self.error("a dict")),
            },
            _ => return Err(self.error("a dict")),
        };
        Ok(found.map(|v| self.child(v, format_args!(".{key}"))))
    }

    /// The value under `key`, which must be there.
    pub fn field(&self, key: &str) -> Result<Node<'a>, TraceError> {
        self.get(key)?.ok_or_else(|| TraceError::Schema {
            path: self.path.clone(),
            expected: format!("a `{key}` key"),
            found: "none".to_string(),
        })
    }

    /// The elements of a list or tuple.
    pub fn items(&self) -> Result<impl Iterator<Item = Node<'a>> + 'a, TraceError> {
        let doc = self.doc;
        let items: Box<dyn Iterator<Item = Val> + 'a> = match self.val {
            Val::Stack(s) => Box::new(doc.frames.frames_of(s).iter().map(|&f| Val::Frame(f))),
            Val::Strings(l) => Box::new(doc.frames.list_of(l).iter().map(|&s| Val::Str(s))),
            Val::Obj(id) => match doc.obj(id) {
                Obj::List(v) | Obj::Tuple(v) => Box::new(v.iter().copied()),
                Obj::Dict(_) => return Err(self.error("a list")),
            },
            _ => return Err(self.error("a list")),
        };
        let this = self.clone();
        Ok(items
            .enumerate()
            .map(move |(i, v)| this.child(v, format_args!("[{i}]"))))
    }

    /// The interned stack this node is: a list of frames (an empty list is the empty stack).
    pub fn stack(&self) -> Option<StackId> {
        match self.val {
            Val::Stack(s) => Some(s),
            _ => None,
        }
    }

    /// The interned list this node is, if it is a non-empty list of strings.
    pub fn strings(&self) -> Option<ListId> {
        match self.val {
            Val::Strings(l) => Some(l),
            _ => None,
        }
    }

    /// The interned id of a string.
    pub fn str_id(&self) -> Result<StringId, TraceError> {
        match self.val {
            Val::Str(s) => Ok(s),
            _ => Err(self.error("a string")),
        }
    }

    /// An integer.
    pub fn int(&self) -> Result<i64, TraceError> {
        match self.val {
            Val::Int(i) => Ok(i),
            Val::Bool(b) => Ok(i64::from(b)),
            _ => Err(self.error("an int")),
        }
    }

    /// A non-negative integer.
    pub fn uint(&self) -> Result<u64, TraceError> {
        u64::try_from(self.int()?).map_err(|_| self.error("a non-negative int"))
    }

    /// A number.
    pub fn float(&self) -> Result<f64, TraceError> {
        match self.val {
            Val::Float(f) => Ok(f),
            Val::Int(i) => Ok(i as f64),
            _ => Err(self.error("a number")),
        }
    }

    /// A bool.
    pub fn bool(&self) -> Result<bool, TraceError> {
        match self.val {
            Val::Bool(b) => Ok(b),
            Val::Int(i) => Ok(i != 0),
            _ => Err(self.error("a bool")),
        }
    }

    /// A string.
    pub fn str(&self) -> Result<&'a str, TraceError> {
        match self.val {
            Val::Str(s) => Ok(self.doc.frames.str(s)),
            _ => Err(self.error("a string")),
        }
    }

    /// The path of this node, for messages.
    pub fn path(&self) -> &str {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame_dict(doc: &mut Doc, file: &str, line: i64) -> Val {
        let d = doc.new_obj(Obj::Dict(Vec::new()));
        let pairs = [
            doc.str("filename"),
            doc.str(file),
            doc.str("line"),
            Val::Int(line),
            doc.str("name"),
            doc.str("f"),
        ];
        doc.extend_dict(d, &pairs).expect("a dict");
        d
    }

    #[test]
    fn frames_and_stacks_are_reduced_when_stored_and_read_back_as_dicts_and_lists() {
        let mut doc = Doc::default();
        let list = doc.new_obj(Obj::List(Vec::new()));
        let first = frame_dict(&mut doc, "a.py", 1);
        let (a, _) = doc.store(first);
        let second = frame_dict(&mut doc, "a.py", 1);
        let (b, _) = doc.store(second);
        assert!(matches!(a, Val::Frame(_)));
        assert_eq!(a, b, "one frame, interned");
        // A freed container is reused: the same again holds nothing more.
        let held = doc.bytes();
        let again = frame_dict(&mut doc, "a.py", 1);
        assert_eq!(doc.store(again).0, a);
        assert_eq!(doc.bytes(), held, "container reused");
        doc.extend_list(list, &[a, b]).expect("a list");
        let (stack, _) = doc.store(list);
        assert!(matches!(stack, Val::Stack(_)));
        doc.root = stack;
        let items: Vec<_> = doc.root().items().expect("list").collect();
        assert_eq!(items.len(), 2);
        let file = items[1].field("filename").expect("filename");
        assert_eq!(file.str().expect("str"), "a.py");
        assert_eq!(file.path(), "$[1].filename");
        assert_eq!(items[0].field("line").expect("line").int().expect("int"), 1);
    }

    #[test]
    fn a_shared_container_forwards_its_other_references_and_irregular_ones_stay() {
        let mut doc = Doc::default();
        let d = frame_dict(&mut doc, "a.py", 1);
        doc.shared(d);
        let (frame, _) = doc.store(d);
        assert!(matches!(frame, Val::Frame(_)));
        assert_eq!(doc.resolve(d), frame, "the other reference sees the frame");
        assert_eq!(doc.store(d).0, frame);
        assert_eq!(
            doc.extend_dict(d, &[Val::None, Val::None]),
            Err("a frame dict is extended after it was stored")
        );
        let extra = doc.new_obj(Obj::Dict(Vec::new()));
        let pairs = [
            doc.str("filename"),
            doc.str("x"),
            doc.str("line"),
            Val::Int(2),
        ];
        doc.extend_dict(extra, &pairs).expect("dict");
        assert_eq!(doc.store(extra).0, extra, "not a frame: kept");
        let d = frame_dict(&mut doc, "b.py", 3);
        let frame = doc.store(d).0;
        assert_eq!(
            doc.extend_dict(frame, &[Val::None, Val::None]),
            Err("a frame dict is extended after it was stored")
        );
    }

    #[test]
    fn a_memoized_container_gives_its_memo_index_to_rewrite() {
        let mut doc = Doc::default();
        let d = frame_dict(&mut doc, "a.py", 1);
        doc.memoized(d, 7);
        let (v, memo) = doc.store(d);
        assert!(matches!(v, Val::Frame(_)));
        assert_eq!(memo, 7);
    }

    #[test]
    fn the_last_of_repeated_keys_wins_and_large_dicts_are_indexed_once() {
        let mut doc = Doc::default();
        let d = doc.new_obj(Obj::Dict(Vec::new()));
        let mut pairs = Vec::new();
        for i in 0..100 {
            pairs.push(doc.str(&format!("k{i}")));
            pairs.push(Val::Int(i));
        }
        pairs.push(doc.str("k5"));
        pairs.push(Val::Int(-5));
        doc.extend_dict(d, &pairs).expect("dict");
        doc.root = d;
        let before = doc.work();
        for _ in 0..1000 {
            assert_eq!(doc.root().field("k5").expect("k5").int().expect("int"), -5);
        }
        let spent = doc.work() - before;
        assert!(
            spent < 1000 + 2 * 101,
            "indexed once, then one step a read: {spent}"
        );
    }
}
