//! A restricted, streaming pickle decoder: protocols 2 to 5, builtin data types only.
//!
//! PyTorch snapshots are pickles of dicts, lists, tuples, strings, ints, floats and bools, in
//! which frame objects may be shared through the memo (so `serde-pickle`, which cannot share,
//! fails on them). This decoder runs the pickle machine once over the streamed input into a
//! compact [`Doc`], where strings are interned and frame dicts and frame lists are reduced as
//! they are stored. Any opcode that would name a class or call a function (`GLOBAL`,
//! `REDUCE`, `BUILD`, ...) is refused: nothing from the file is ever executed.
//!
//! # Memory bound
//! The memo may refer to any earlier object, so what the decoder holds is bounded by its
//! memo entries plus the document: 4 bytes a memo entry (16 more for an entry holding a plain
//! number, which Python never memoizes), 16 bytes a stack value, and the document's own
//! accounting ([`Doc::bytes`]). The total is checked against the memory budget every 4 096
//! opcodes and before any string is read, so a file that needs more fails with
//! [`TraceError::MemoryBudget`] at the offset where it crossed.
//!
//! # Invariants
//! - Lengths read from the input never size an allocation: string bytes are gathered as they
//!   arrive and checked against the budget first; memo indices are looked up (a dense table
//!   grows only by one at a time, other indices go to a map).
//! - Each opcode does work bounded by what it consumes (a MARK-ending opcode moves the values
//!   it pops once), so time is linear in the decoded input; [`Doc::work`] counts opcodes.

use rustc_hash::FxHashMap;

use super::TraceError;
use super::doc::{Doc, NO_MEMO, Obj, Val};
use super::input::Input;

/// Memo slots: tagged 32-bit references (a plain number goes to a side table).
#[derive(Default)]
struct Memo {
    dense: Vec<u32>,
    sparse: FxHashMap<u32, Val>,
    others: Vec<Val>,
}

const TAG_SHIFT: u32 = 29;
const PAYLOAD: u32 = (1 << TAG_SHIFT) - 1;

impl Memo {
    fn pack(&mut self, v: Val) -> u32 {
        let (tag, id) = match v {
            Val::Str(s) => (1, s.0),
            Val::Frame(f) => (2, f.0),
            Val::Stack(s) => (3, s.0),
            Val::Obj(o) => (4, o.0),
            _ => (5, u32::MAX),
        };
        if id <= PAYLOAD {
            return (tag << TAG_SHIFT) | id;
        }
        self.others.push(v);
        (5 << TAG_SHIFT) | ((self.others.len() - 1) as u32 & PAYLOAD)
    }

    fn unpack(&self, packed: u32) -> Option<Val> {
        use super::frames::{FrameId, StackId, StringId};
        let id = packed & PAYLOAD;
        Some(match packed >> TAG_SHIFT {
            1 => Val::Str(StringId(id)),
            2 => Val::Frame(FrameId(id)),
            3 => Val::Stack(StackId(id)),
            4 => Val::Obj(super::doc::ObjId(id)),
            5 => *self.others.get(id as usize)?,
            _ => return None,
        })
    }

    fn put(&mut self, index: u32, v: Val) {
        let i = index as usize;
        if i < self.dense.len() {
            self.dense[i] = self.pack(v);
        } else if i == self.dense.len() {
            let packed = self.pack(v);
            self.dense.push(packed);
        } else {
            self.sparse.insert(index, v);
        }
    }

    fn get(&self, index: u32) -> Option<Val> {
        match self.dense.get(index as usize) {
            Some(&packed) => self.unpack(packed),
            None => self.sparse.get(&index).copied(),
        }
    }

    fn bytes(&self) -> u64 {
        (self.dense.capacity() * 4 + self.sparse.len() * 32 + self.others.len() * 16) as u64
    }
}

struct Machine<'i, 'r> {
    input: &'i mut Input<'r>,
    doc: &'i mut Doc,
    stack: Vec<Val>,
    /// Stack heights at each MARK.
    marks: Vec<usize>,
    memo: Memo,
    next_memo: u32,
    /// Values popped to a MARK (reused).
    items: Vec<Val>,
    max_memory: u64,
    ops: u64,
    /// Offset of the opcode being run.
    at: u64,
}

/// Decodes a pickle from `input` into `doc`, holding at most `max_memory` bytes.
///
/// # Errors
/// [`TraceError::Pickle`] with the byte offset and what was wrong: truncation, an opcode
/// outside the supported set (or one that names a class), a malformed stack;
/// [`TraceError::MemoryBudget`] past the budget.
pub(crate) fn decode(
    input: &mut Input<'_>,
    doc: &mut Doc,
    max_memory: u64,
) -> Result<(), TraceError> {
    let mut m = Machine {
        input,
        doc,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: Memo::default(),
        next_memo: 0,
        items: Vec::new(),
        max_memory,
        ops: 0,
        at: 0,
    };
    let result = m.run();
    m.doc.count_work(m.ops);
    result
}

impl Machine<'_, '_> {
    fn fail(&self, message: impl Into<String>) -> TraceError {
        TraceError::Pickle {
            offset: self.at,
            message: message.into(),
        }
    }

    fn truncated(&self, what: &str) -> TraceError {
        self.fail(format!("truncated: the input ends inside {what}"))
    }

    fn bytes(&self) -> u64 {
        self.doc.bytes()
            + self.memo.bytes()
            + (self.stack.capacity() + self.items.capacity()) as u64 * 16
            + self.marks.capacity() as u64 * 8
    }

    fn check_memory(&self, more: u64) -> Result<(), TraceError> {
        let held = self.bytes();
        if held.saturating_add(more) > self.max_memory {
            return Err(TraceError::MemoryBudget {
                limit: self.max_memory,
                offset: self.at,
            });
        }
        Ok(())
    }

    fn take<const N: usize>(&mut self, what: &str) -> Result<[u8; N], TraceError> {
        match self.input.next_bytes(N)? {
            Some(b) => {
                let mut a = [0u8; N];
                a.copy_from_slice(b);
                Ok(a)
            }
            None => Err(self.truncated(what)),
        }
    }

    fn byte(&mut self, what: &str) -> Result<u8, TraceError> {
        Ok(self.take::<1>(what)?[0])
    }

    fn u16(&mut self, what: &str) -> Result<u16, TraceError> {
        Ok(u16::from_le_bytes(self.take(what)?))
    }

    fn u32(&mut self, what: &str) -> Result<u32, TraceError> {
        Ok(u32::from_le_bytes(self.take(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, TraceError> {
        Ok(u64::from_le_bytes(self.take(what)?))
    }

    fn push(&mut self, v: Val) {
        self.stack.push(v);
    }

    fn pop(&mut self) -> Result<Val, TraceError> {
        if self.marks.last() == Some(&self.stack.len()) {
            return Err(self.fail("a value was expected, found a MARK"));
        }
        self.stack
            .pop()
            .ok_or_else(|| self.fail("the stack is empty"))
    }

    fn top(&self) -> Result<Val, TraceError> {
        match self.stack.last() {
            Some(v) if self.marks.last() != Some(&self.stack.len()) => Ok(*v),
            _ => Err(self.fail("a value was expected on the stack")),
        }
    }

    /// Stores `v` into a parent: reduced where it can be, the memo rewritten to match.
    fn store(&mut self, v: Val) -> Val {
        let (stored, memo) = self.doc.store(v);
        if memo != NO_MEMO {
            self.memo.put(memo, stored);
        }
        stored
    }

    /// Pops everything down to the last MARK into `self.items`, each stored.
    fn pop_mark(&mut self) -> Result<(), TraceError> {
        let mark = self
            .marks
            .pop()
            .ok_or_else(|| self.fail("no MARK on the stack"))?;
        self.items.clear();
        self.items.extend(self.stack.drain(mark..));
        for i in 0..self.items.len() {
            let stored = self.store(self.items[i]);
            self.items[i] = stored;
        }
        Ok(())
    }

    fn string(&mut self, len: u64) -> Result<(), TraceError> {
        self.check_memory(len)?;
        let len = usize::try_from(len).map_err(|_| self.truncated("a string"))?;
        let Some(bytes) = self.input.next_bytes(len)? else {
            return Err(self.truncated("a string"));
        };
        let Ok(s) = std::str::from_utf8(bytes) else {
            return Err(self.fail("a string is not valid UTF-8"));
        };
        let v = self.doc.str(s);
        self.push(v);
        Ok(())
    }

    fn long(&mut self, len: usize) -> Result<(), TraceError> {
        self.check_memory(len as u64)?;
        let Some(bytes) = self.input.next_bytes(len)? else {
            return Err(self.truncated("a long integer"));
        };
        let value = if bytes.is_empty() {
            Val::Int(0)
        } else if bytes.len() <= 8 {
            // Little-endian two's complement, sign-extended to 64 bits.
            let fill = if bytes[bytes.len() - 1] & 0x80 != 0 {
                0xff
            } else {
                0
            };
            let mut a = [fill; 8];
            a[..bytes.len()].copy_from_slice(bytes);
            Val::Int(i64::from_le_bytes(a))
        } else {
            Val::BigInt
        };
        let v = self.doc.scalar(value);
        self.push(v);
        Ok(())
    }

    fn memo_get(&mut self, index: u32) -> Result<(), TraceError> {
        let v = self
            .memo
            .get(index)
            .ok_or_else(|| self.fail(format!("memo entry {index} was never stored")))?;
        self.doc.shared(v);
        self.push(v);
        Ok(())
    }

    fn memo_put(&mut self, index: u32) -> Result<(), TraceError> {
        let v = self.top()?;
        self.doc.memoized(v, index);
        self.memo.put(index, v);
        Ok(())
    }

    fn new_container(&mut self, obj: Obj) {
        let v = self.doc.new_obj(obj);
        self.push(v);
    }

    fn run(&mut self) -> Result<(), TraceError> {
        loop {
            self.at = self.input.offset();
            self.ops += 1;
            if self.ops.is_multiple_of(4096) {
                self.check_memory(0)?;
            }
            let Some(op) = self.input.byte()? else {
                return Err(self.fail("truncated: the pickle ends before STOP"));
            };
            match op {
                0x80 => {
                    let protocol = self.byte("the protocol number")?;
                    if !(2..=5).contains(&protocol) {
                        return Err(
                            self.fail(format!("protocol {protocol} is not supported (2 to 5 are)"))
                        );
                    }
                }
                0x95 => {
                    // FRAME: a length hint for buffered readers; the data follows inline.
                    self.u64("a frame length")?;
                }
                b'.' => {
                    let root = self.pop()?;
                    self.doc.root = self.store(root);
                    return Ok(());
                }
                b'(' => self.marks.push(self.stack.len()),
                b'0' => {
                    if self.marks.last() == Some(&self.stack.len()) {
                        self.marks.pop();
                    } else {
                        self.stack
                            .pop()
                            .ok_or_else(|| self.fail("POP on an empty stack"))?;
                    }
                }
                b'1' => {
                    let mark = self
                        .marks
                        .pop()
                        .ok_or_else(|| self.fail("no MARK on the stack"))?;
                    self.stack.truncate(mark);
                }
                b'2' => {
                    let v = self.top()?;
                    self.doc.shared(v);
                    self.push(v);
                }
                b'}' => self.new_container(Obj::Dict(Vec::new())),
                b']' => self.new_container(Obj::List(Vec::new())),
                b')' => self.new_container(Obj::Tuple(Vec::new())),
                b'l' | b't' => {
                    self.pop_mark()?;
                    let v = self.doc.new_obj(if op == b'l' {
                        Obj::List(Vec::new())
                    } else {
                        Obj::Tuple(Vec::new())
                    });
                    let items = std::mem::take(&mut self.items);
                    if op == b'l' {
                        self.doc.extend_list(v, &items).map_err(|e| self.fail(e))?;
                    } else {
                        self.doc.fill_tuple(v, &items);
                    }
                    self.items = items;
                    self.push(v);
                }
                b'd' => {
                    self.pop_mark()?;
                    let v = self.doc.new_obj(Obj::Dict(Vec::new()));
                    let items = std::mem::take(&mut self.items);
                    let result = self.doc.extend_dict(v, &items);
                    self.items = items;
                    result.map_err(|e| self.fail(e))?;
                    self.push(v);
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    if self.stack.len() < n + self.marks.last().copied().unwrap_or(0) {
                        return Err(self.fail("TUPLE1/2/3 with too few values on the stack"));
                    }
                    let mut items = [Val::None; 3];
                    for i in (0..n).rev() {
                        let v = self.pop()?;
                        items[i] = self.store(v);
                    }
                    let v = self.doc.new_obj(Obj::Tuple(Vec::new()));
                    self.doc.fill_tuple(v, &items[..n]);
                    self.push(v);
                }
                b'a' => {
                    let item = self.pop()?;
                    let item = self.store(item);
                    let list = self.top()?;
                    self.doc
                        .extend_list(list, &[item])
                        .map_err(|e| self.fail(e))?;
                }
                b'e' => {
                    self.pop_mark()?;
                    let list = self.top()?;
                    let items = std::mem::take(&mut self.items);
                    let result = self.doc.extend_list(list, &items);
                    self.items = items;
                    result.map_err(|e| self.fail(e))?;
                }
                b's' => {
                    let value = self.pop()?;
                    let key = self.pop()?;
                    let (key, value) = (self.store(key), self.store(value));
                    let dict = self.top()?;
                    self.doc
                        .extend_dict(dict, &[key, value])
                        .map_err(|e| self.fail(e))?;
                }
                b'u' => {
                    self.pop_mark()?;
                    let dict = self.top()?;
                    let items = std::mem::take(&mut self.items);
                    let result = self.doc.extend_dict(dict, &items);
                    self.items = items;
                    result.map_err(|e| self.fail(e))?;
                }
                0x94 => {
                    let index = self.next_memo;
                    self.next_memo = self
                        .next_memo
                        .checked_add(1)
                        .ok_or_else(|| self.fail("more than 2^32 memo entries"))?;
                    self.memo_put(index)?;
                }
                b'q' => {
                    let index = u32::from(self.byte("a memo index")?);
                    self.memo_put(index)?;
                }
                b'r' => {
                    let index = self.u32("a memo index")?;
                    self.memo_put(index)?;
                }
                b'h' => {
                    let index = u32::from(self.byte("a memo index")?);
                    self.memo_get(index)?;
                }
                b'j' => {
                    let index = self.u32("a memo index")?;
                    self.memo_get(index)?;
                }
                b'J' => {
                    let v = self.u32("an int")? as i32;
                    let v = self.doc.scalar(Val::Int(i64::from(v)));
                    self.push(v);
                }
                b'K' => {
                    let v = self.byte("an int")?;
                    let v = self.doc.scalar(Val::Int(i64::from(v)));
                    self.push(v);
                }
                b'M' => {
                    let v = self.u16("an int")?;
                    let v = self.doc.scalar(Val::Int(i64::from(v)));
                    self.push(v);
                }
                0x8a => {
                    let n = usize::from(self.byte("a long length")?);
                    self.long(n)?;
                }
                0x8b => {
                    let n = self.u32("a long length")? as i32;
                    let n = usize::try_from(n).map_err(|_| self.fail("negative long length"))?;
                    self.long(n)?;
                }
                b'G' => {
                    let b = self.take::<8>("a float")?;
                    let v = self.doc.scalar(Val::Float(f64::from_be_bytes(b)));
                    self.push(v);
                }
                0x8c => {
                    let n = self.byte("a string length")?;
                    self.string(u64::from(n))?;
                }
                b'X' => {
                    let n = self.u32("a string length")?;
                    self.string(u64::from(n))?;
                }
                0x8d => {
                    let n = self.u64("a string length")?;
                    self.string(n)?;
                }
                b'N' => {
                    let v = self.doc.scalar(Val::None);
                    self.push(v);
                }
                0x88 | 0x89 => {
                    let v = self.doc.scalar(Val::Bool(op == 0x88));
                    self.push(v);
                }
                b'c' | 0x93 | b'R' | b'b' | b'i' | b'o' | 0x81 | 0x92 | b'P' | b'Q' | 0x82
                | 0x83 | 0x84 => {
                    return Err(self.fail(format!(
                        "opcode {op:#04x} names a class or calls a function; only plain data (dict, list, tuple, str, int, float, bool) is accepted"
                    )));
                }
                _ => {
                    return Err(self.fail(format!("unsupported opcode {op:#04x}")));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_bytes(data: &[u8]) -> Result<Doc, TraceError> {
        let mut input = Input::new(Box::new(data), u64::MAX)?;
        let mut doc = Doc::default();
        decode(&mut input, &mut doc, u64::MAX)?;
        Ok(doc)
    }

    /// `pickle.dumps({"a": [1, -2, 3.5, "x", None, True], "b": (7, 2**40)}, protocol=4)`.
    const SAMPLE: &[u8] = b"\x80\x04\x953\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01a\x94]\x94(K\x01J\xfe\xff\xff\xffG@\x0c\x00\x00\x00\x00\x00\x00\x8c\x01x\x94N\x88e\x8c\x01b\x94K\x07\x8a\x06\x00\x00\x00\x00\x00\x01\x86\x94u.";

    #[test]
    fn decodes_builtin_types() {
        let doc = decode_bytes(SAMPLE).expect("valid pickle");
        let root = doc.root();
        let a: Vec<_> = root.field("a").expect("a").items().expect("list").collect();
        assert_eq!(a[0].int().expect("int"), 1);
        assert_eq!(a[1].int().expect("int"), -2);
        assert_eq!(a[2].float().expect("float"), 3.5);
        assert_eq!(a[3].str().expect("str"), "x");
        assert!(a[4].is_none());
        assert!(a[5].bool().expect("bool"));
        let b: Vec<_> = root
            .field("b")
            .expect("b")
            .items()
            .expect("tuple")
            .collect();
        assert_eq!(b[1].int().expect("int"), 1 << 40);
    }

    #[test]
    fn shared_objects_through_the_memo() {
        // f = {"k": 1}; pickle.dumps([f, f], protocol=4)
        let data =
            b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00]\x94(}\x94\x8c\x01k\x94K\x01sh\x01e.";
        let doc = decode_bytes(data).expect("valid pickle");
        let items: Vec<_> = doc.root().items().expect("list").collect();
        assert_eq!(items.len(), 2);
        for item in items {
            assert_eq!(item.field("k").expect("k").int().expect("int"), 1);
        }
    }

    /// `f = {"filename": "a.py", "line": 3, "name": "g"}`;
    /// `pickle.dumps({"frames": [f, f, {"filename": "a.py", "line": 3, "name": "g"}]}, 4)`.
    const FRAMES: &[u8] = b"\x80\x04\x95M\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x06frames\x94]\x94(}\x94(\x8c\x08filename\x94\x8c\x04a.py\x94\x8c\x04line\x94K\x03\x8c\x04name\x94\x8c\x01g\x94uh\x03}\x94(h\x04h\x05h\x06K\x03h\x07h\x08ues.";

    #[test]
    fn frame_dicts_shared_or_repeated_become_one_interned_frame() {
        let doc = decode_bytes(FRAMES).expect("valid pickle");
        let frames = doc.root().field("frames").expect("frames");
        let stack = frames.stack().expect("a list of frames is a stack");
        assert_eq!(doc.frames.frames_of(stack).len(), 3);
        assert_eq!(doc.frames.frame_count(), 1, "one distinct frame");
        let names: Vec<_> = frames
            .items()
            .expect("list")
            .map(|f| {
                f.field("name")
                    .expect("name")
                    .str()
                    .expect("str")
                    .to_string()
            })
            .collect();
        assert_eq!(names, ["g", "g", "g"]);
    }

    #[test]
    fn every_truncation_is_an_error() {
        for sample in [SAMPLE, FRAMES] {
            for end in 0..sample.len() {
                let err = decode_bytes(&sample[..end]).expect_err("truncated");
                assert!(matches!(err, TraceError::Pickle { .. }), "{err}");
            }
        }
    }

    #[test]
    fn classes_are_refused() {
        // pickle.dumps(collections.OrderedDict(), protocol=2)
        let data = b"\x80\x02ccollections\nOrderedDict\nq\x00)Rq\x01.";
        let err = decode_bytes(data).expect_err("names a class");
        assert!(err.to_string().contains("names a class"), "{err}");
    }

    #[test]
    fn huge_length_fields_fail_before_allocating() {
        let data = b"\x80\x04X\x00\x00\x00\x80abc.";
        let err = decode_bytes(data).expect_err("2 GiB string in 4 bytes");
        assert!(err.to_string().contains("inside a string"), "{err}");
        let data = b"\x80\x04\x8d\xff\xff\xff\xff\xff\xff\xff\xffabc.";
        let mut input = Input::new(Box::new(&data[..]), u64::MAX).expect("input");
        let err = decode(&mut input, &mut Doc::default(), 1 << 30).expect_err("budget");
        assert!(matches!(err, TraceError::MemoryBudget { .. }), "{err}");
        let data = b"\x80\x04j\xff\xff\xff\xff.";
        assert!(
            decode_bytes(data)
                .expect_err("bad memo")
                .to_string()
                .contains("never stored")
        );
    }

    #[test]
    fn marks_behave_as_stack_entries() {
        // MARK then POP pops the mark; POP_MARK drops values above it.
        let data = b"\x80\x04K\x01(0(K\x02K\x031.";
        let doc = decode_bytes(data).expect("valid");
        assert_eq!(doc.root().int().expect("int"), 1);
        let err = decode_bytes(b"\x80\x04(.").expect_err("mark at stop");
        assert!(err.to_string().contains("MARK"), "{err}");
    }
}
