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
//! memo entries plus the document: about 2 bytes a memo entry in runs of frame dicts, at most
//! about 4.5 otherwise (16 more for an entry holding a plain number, which Python never
//! memoizes; `memo.rs`), 16 bytes a stack value, and the document's own accounting
//! ([`Doc::bytes`]). The total is checked against the memory budget every 4 096
//! opcodes (the stack reserving room for the next 4 096 values within it) and before any
//! string longer than 64 KiB is read, so a file that needs more fails with [`TraceError::MemoryBudget`] at the
//! offset where it crossed, having held at most the budget plus what 4 096 opcodes add to
//! the document.
//!
//! # Invariants
//! - Lengths read from the input never size an allocation: string bytes are gathered as they
//!   arrive and checked against the budget first; memo indices are looked up (a dense table
//!   grows only by one at a time, other indices go to a map).
//! - Each opcode does work bounded by what it consumes (a MARK-ending opcode moves the values
//!   it pops once, after checking that their container fits the budget), so time is linear
//!   in the decoded input; [`Doc::work`] counts opcodes.
//! - A frame dict is read in one step when its bytes are the ones Python writes for one; the
//!   frame it gives is immutable, so a pickle that extends that dict later (Python never
//!   does) is refused, and a string that is not UTF-8 (a lone surrogate, which CPython writes
//!   for a path's undecodable bytes) is kept with U+FFFD in its place.

mod frame;

use super::TraceError;
use super::doc::{Doc, NO_MEMO, Obj, Val};
use super::input::Input;
use super::memo::Memo;
use frame::parse_frame;

/// The opcodes above ASCII (protocol 2 and later), by `pickletools`' names; the ASCII ones
/// are written as their characters (`b'}'` is EMPTY_DICT), as the pickle source spells them.
mod opcode {
    /// PROTO: the protocol number follows.
    pub(super) const PROTO: u8 = 0x80;
    /// NEWOBJ: `cls.__new__(cls, *args)` (refused).
    pub(super) const NEWOBJ: u8 = 0x81;
    /// EXT1, EXT2, EXT4: an object from the extension registry (refused).
    pub(super) const EXT1: u8 = 0x82;
    pub(super) const EXT2: u8 = 0x83;
    pub(super) const EXT4: u8 = 0x84;
    /// TUPLE1, TUPLE2, TUPLE3: a tuple of the top one, two or three values.
    pub(super) const TUPLE1: u8 = 0x85;
    pub(super) const TUPLE3: u8 = 0x87;
    /// NEWTRUE, NEWFALSE.
    pub(super) const NEWTRUE: u8 = 0x88;
    pub(super) const NEWFALSE: u8 = 0x89;
    /// LONG1, LONG4: a little-endian two's-complement integer of a 1- or 4-byte length.
    pub(super) const LONG1: u8 = 0x8a;
    pub(super) const LONG4: u8 = 0x8b;
    /// SHORT_BINUNICODE, BINUNICODE8: a UTF-8 string of a 1- or 8-byte length.
    pub(super) const SHORT_BINUNICODE: u8 = 0x8c;
    pub(super) const BINUNICODE8: u8 = 0x8d;
    /// NEWOBJ_EX: `cls.__new__(cls, *args, **kwargs)` (refused).
    pub(super) const NEWOBJ_EX: u8 = 0x92;
    /// STACK_GLOBAL: a class or function by module and name (refused).
    pub(super) const STACK_GLOBAL: u8 = 0x93;
    /// MEMOIZE: the top value into the memo, at the next index.
    pub(super) const MEMOIZE: u8 = 0x94;
    /// FRAME: an 8-byte length hint for buffered readers.
    pub(super) const FRAME: u8 = 0x95;

    /// The opcodes that name a class or call a function (GLOBAL, STACK_GLOBAL, REDUCE, BUILD,
    /// INST, OBJ, NEWOBJ, NEWOBJ_EX, PERSID, BINPERSID, EXT1, EXT2, EXT4): refused.
    pub(super) const REFUSED: [u8; 13] = [
        b'c',
        STACK_GLOBAL,
        b'R',
        b'b',
        b'i',
        b'o',
        NEWOBJ,
        NEWOBJ_EX,
        b'P',
        b'Q',
        EXT1,
        EXT2,
        EXT4,
    ];
}

/// How often (in opcodes) memory is checked against the budget.
const CHECK_EVERY: u64 = 4096;

/// Strings and long integers longer than this are checked against the budget before they are
/// read.
const LONG_VALUE: u64 = 64 << 10;

struct Machine<'i, 'r> {
    input: &'i mut Input<'r>,
    doc: &'i mut Doc,
    stack: Vec<Val>,
    /// Stack heights at each MARK.
    marks: Vec<usize>,
    memo: Memo,
    next_memo: u32,
    max_memory: u64,
    ops: u64,
    /// When (in `ops`) memory is checked next.
    next_check: u64,
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
        max_memory,
        ops: 0,
        next_check: CHECK_EVERY,
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
            + self.input.scratch_bytes()
            + self.stack.capacity() as u64 * 16
            + self.marks.capacity() as u64 * 8
    }

    /// Makes room for the next [`CHECK_EVERY`] values on the stack (an opcode pushes at most
    /// one), within the budget: the stack never grows unchecked in between.
    fn reserve_stack(&mut self) -> Result<(), TraceError> {
        let room = self.stack.capacity() - self.stack.len();
        if room >= CHECK_EVERY as usize {
            return Ok(());
        }
        let grown = (self.stack.capacity() * 2).max(self.stack.len() + CHECK_EVERY as usize);
        self.check_memory(((grown - self.stack.capacity()) * 16) as u64)?;
        self.stack.reserve_exact(grown - self.stack.len());
        Ok(())
    }

    fn check_memory(&mut self, more: u64) -> Result<(), TraceError> {
        let held = self.bytes();
        self.doc.note_peak(held);
        if held.saturating_add(more) > self.max_memory {
            return Err(TraceError::MemoryBudget {
                limit: self.max_memory,
                offset: self.at,
            });
        }
        Ok(())
    }

    #[inline]
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

    #[inline]
    fn byte(&mut self, what: &str) -> Result<u8, TraceError> {
        match self.input.byte()? {
            Some(b) => Ok(b),
            None => Err(self.truncated(what)),
        }
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

    #[inline]
    fn push(&mut self, v: Val) {
        self.stack.push(v);
    }

    #[inline]
    fn pop(&mut self) -> Result<Val, TraceError> {
        if self.marks.last() == Some(&self.stack.len()) {
            return Err(self.fail("a value was expected, found a MARK"));
        }
        self.stack
            .pop()
            .ok_or_else(|| self.fail("the stack is empty"))
    }

    #[inline]
    fn top(&self) -> Result<Val, TraceError> {
        match self.stack.last() {
            Some(v) if self.marks.last() != Some(&self.stack.len()) => Ok(*v),
            _ => Err(self.fail("a value was expected on the stack")),
        }
    }

    /// Stores `v` into a parent: reduced where it can be, the memo rewritten to match.
    #[inline]
    fn store(&mut self, v: Val) -> Val {
        let (stored, memo) = self.doc.store(v);
        if memo != NO_MEMO {
            self.memo.put(memo, stored);
        }
        stored
    }

    /// Pops the last MARK and stores the values above it, in place: they are
    /// `self.stack[mark..]` (the caller moves them into their container, then truncates).
    fn mark_items(&mut self) -> Result<usize, TraceError> {
        let mark = self
            .marks
            .pop()
            .ok_or_else(|| self.fail("no MARK on the stack"))?;
        // The values move into a container: room for them must fit the budget first.
        self.check_memory(((self.stack.len() - mark) * 32) as u64)?;
        for i in mark..self.stack.len() {
            // Only containers change when stored (most values are strings and numbers).
            if let Val::Obj(_) = self.stack[i] {
                let stored = self.store(self.stack[i]);
                self.stack[i] = stored;
            }
        }
        Ok(mark)
    }

    /// The value just below `mark` (the container an APPENDS or SETITEMS extends).
    fn below(&self, mark: usize) -> Result<Val, TraceError> {
        match mark.checked_sub(1).and_then(|i| self.stack.get(i)) {
            Some(v) if self.marks.last() != Some(&mark) => Ok(*v),
            _ => Err(self.fail("a value was expected below the MARK")),
        }
    }

    fn string(&mut self, len: u64) -> Result<(), TraceError> {
        // Short strings are covered by the periodic check; a long one is checked before its
        // bytes are gathered.
        if len > LONG_VALUE {
            self.check_memory(len)?;
        }
        let len = usize::try_from(len).map_err(|_| self.truncated("a string"))?;
        let Some(bytes) = self.input.next_bytes(len)? else {
            return Err(self.truncated("a string"));
        };
        // CPython writes lone surrogates (a path's undecodable bytes) as they are: such a
        // string is kept with U+FFFD in their place, as the rest of the file is still data.
        let v = match std::str::from_utf8(bytes) {
            Ok(s) => self.doc.str(s),
            Err(_) => {
                let s = String::from_utf8_lossy(bytes).into_owned();
                self.doc.str(&s)
            }
        };
        self.input.shrink_scratch();
        self.push(v);
        Ok(())
    }

    fn long(&mut self, len: usize) -> Result<(), TraceError> {
        if len as u64 > LONG_VALUE {
            self.check_memory(len as u64)?;
        }
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
        self.input.shrink_scratch();
        let v = self.doc.scalar(value);
        self.push(v);
        Ok(())
    }

    #[inline]
    fn memo_get(&mut self, index: u32) -> Result<(), TraceError> {
        let v = self
            .memo
            .get(index)
            .ok_or_else(|| self.fail(format!("memo entry {index} was never stored")))?;
        self.doc.shared(v);
        self.push(v);
        Ok(())
    }

    #[inline]
    fn memo_put(&mut self, index: u32) -> Result<(), TraceError> {
        let v = self.top()?;
        // A container losing its memo entry must not rewrite it when reduced later.
        if let Some(old @ Val::Obj(_)) = self.memo.get(index)
            && old != v
        {
            self.doc.shared(old);
        }
        self.doc.memoized(v, index);
        self.memo.put(index, v);
        Ok(())
    }

    #[inline]
    fn new_container(&mut self, obj: Obj) {
        let v = self.doc.new_obj(obj);
        self.push(v);
    }

    /// After `}`: a frame dict as Python writes one, `MEMOIZE ( key value key value key value
    /// SETITEMS`, its keys and strings memo references or short strings, its line a small int,
    /// read in one step into an interned frame (the same value the generic path reduces it
    /// to when it is stored). False, with nothing consumed, when the buffered bytes are
    /// anything else.
    fn frame_dict(&mut self) -> Result<bool, TraceError> {
        let (keys, fx_keys) = (self.doc.frame_keys(), self.doc.fx_keys());
        let next_memo = self.next_memo;
        let parsed = {
            let buf = self.input.buffered();
            let memo = &self.memo;
            let frames = &mut self.doc.frames;
            parse_frame(buf, memo, frames, keys, fx_keys, next_memo)
        };
        let Some(parsed) = parsed else {
            return Ok(false);
        };
        let v = Val::Frame(self.doc.frames.frame_with_fx(parsed.frame, parsed.fx));
        self.memo.put(next_memo, v);
        for &(index, s) in &parsed.strings[..parsed.new_strings] {
            self.memo.put(index, Val::Str(s));
        }
        self.next_memo = self
            .next_memo
            .checked_add(1 + parsed.new_strings as u32)
            .ok_or_else(|| self.fail("more than 2^32 memo entries"))?;
        self.input.consume(parsed.len);
        self.push(v);
        // As the generic path counts: the dict, its MEMOIZE, MARK, its keys and values,
        // SETITEMS.
        let values = 2 * parsed.entries as u64;
        self.ops += 3 + values + parsed.new_strings as u64;
        self.doc.count_values(1 + values);
        Ok(true)
    }

    fn run(&mut self) -> Result<(), TraceError> {
        loop {
            self.at = self.input.offset();
            self.ops += 1;
            // Compared, not divided: the frame-dict step adds several opcodes at once.
            if self.ops >= self.next_check {
                self.next_check = self.ops + CHECK_EVERY;
                self.check_memory(0)?;
                self.reserve_stack()?;
            }
            let Some(op) = self.input.byte()? else {
                return Err(self.fail("truncated: the pickle ends before STOP"));
            };
            match op {
                opcode::PROTO => {
                    let protocol = self.byte("the protocol number")?;
                    if !(2..=5).contains(&protocol) {
                        return Err(
                            self.fail(format!("protocol {protocol} is not supported (2 to 5 are)"))
                        );
                    }
                }
                opcode::FRAME => {
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
                b'}' => {
                    if !self.frame_dict()? {
                        self.new_container(Obj::Dict(Vec::new()));
                    }
                }
                b']' => self.new_container(Obj::List(Vec::new())),
                b')' => self.new_container(Obj::Tuple(Vec::new())),
                b'l' | b't' => {
                    let mark = self.mark_items()?;
                    let v = self.doc.new_obj(if op == b'l' {
                        Obj::List(Vec::new())
                    } else {
                        Obj::Tuple(Vec::new())
                    });
                    if op == b'l' {
                        let result = self.doc.extend_list(v, &self.stack[mark..]);
                        result.map_err(|e| self.fail(e))?;
                    } else {
                        self.doc.fill_tuple(v, &self.stack[mark..]);
                    }
                    self.stack.truncate(mark);
                    self.push(v);
                }
                b'd' => {
                    let mark = self.mark_items()?;
                    let v = self.doc.new_obj(Obj::Dict(Vec::new()));
                    let result = self.doc.extend_dict(v, &self.stack[mark..]);
                    result.map_err(|e| self.fail(e))?;
                    self.stack.truncate(mark);
                    self.push(v);
                }
                opcode::TUPLE1..=opcode::TUPLE3 => {
                    let n = usize::from(op - opcode::TUPLE1) + 1;
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
                    let mark = self.mark_items()?;
                    let list = self.below(mark)?;
                    let result = self.doc.extend_list(list, &self.stack[mark..]);
                    result.map_err(|e| self.fail(e))?;
                    self.stack.truncate(mark);
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
                    let mark = self.mark_items()?;
                    let dict = self.below(mark)?;
                    let result = self.doc.extend_dict(dict, &self.stack[mark..]);
                    result.map_err(|e| self.fail(e))?;
                    self.stack.truncate(mark);
                }
                opcode::MEMOIZE => {
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
                opcode::LONG1 => {
                    let n = usize::from(self.byte("a long length")?);
                    self.long(n)?;
                }
                opcode::LONG4 => {
                    let n = self.u32("a long length")? as i32;
                    let n = usize::try_from(n).map_err(|_| self.fail("negative long length"))?;
                    self.long(n)?;
                }
                b'G' => {
                    let b = self.take::<8>("a float")?;
                    let v = self.doc.scalar(Val::Float(f64::from_be_bytes(b)));
                    self.push(v);
                }
                opcode::SHORT_BINUNICODE => {
                    let n = self.byte("a string length")?;
                    self.string(u64::from(n))?;
                }
                b'X' => {
                    let n = self.u32("a string length")?;
                    self.string(u64::from(n))?;
                }
                opcode::BINUNICODE8 => {
                    let n = self.u64("a string length")?;
                    self.string(n)?;
                }
                b'N' => {
                    let v = self.doc.scalar(Val::None);
                    self.push(v);
                }
                opcode::NEWTRUE | opcode::NEWFALSE => {
                    let v = self.doc.scalar(Val::Bool(op == opcode::NEWTRUE));
                    self.push(v);
                }
                op if opcode::REFUSED.contains(&op) => {
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
        let mut input = Input::new(Box::new(data), u64::MAX, None)?;
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
        let mut input = Input::new(Box::new(&data[..]), u64::MAX, None).expect("input");
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

    /// `s = "??"; pickle.dumps([{"filename": s, "line": 1, "name": s}], 4)`: the name is a
    /// memo reference to the string the same dict stored a moment before.
    const SAME_STRING: &[u8] = b"\x80\x04\x95*\x00\x00\x00\x00\x00\x00\x00]\x94}\x94(\x8c\x08filename\x94\x8c\x02??\x94\x8c\x04line\x94K\x01\x8c\x04name\x94h\x03ua.";

    #[test]
    fn a_frame_naming_a_string_it_just_stored_reads_as_python_reads_it() {
        let doc = decode_bytes(SAME_STRING).expect("valid");
        let frames: Vec<_> = doc.root().items().expect("list").collect();
        assert_eq!(
            frames[0].field("name").expect("name").str().expect("str"),
            "??"
        );
        assert_eq!(
            frames[0].field("filename").expect("f").str().expect("str"),
            "??"
        );
        assert!(doc.root().stack().is_some(), "a stack of one frame");
    }

    /// Frame dicts read in one step still count towards the periodic memory check (each adds
    /// several opcodes at once, so a check "every 4096th opcode" could be stepped over).
    #[test]
    fn frames_read_in_one_step_stay_within_the_budget() {
        let mut p = b"\x80\x04(".to_vec();
        p.extend_from_slice(b"}\x94(\x8c\x08filename\x94\x8c\x01a\x94\x8c\x04line\x94K\x01\x8c\x04name\x94\x8c\x01f\x94u");
        for line in 0..200_000i32 {
            p.extend_from_slice(b"}\x94(h\x01h\x02h\x03J");
            p.extend_from_slice(&line.to_le_bytes());
            p.extend_from_slice(b"h\x04h\x05u");
        }
        p.extend_from_slice(b"l.");
        let mut input = Input::new(Box::new(&p[..]), u64::MAX, None).expect("input");
        let mut doc = Doc::default();
        let err = decode(&mut input, &mut doc, 1 << 20).expect_err("over budget");
        assert!(matches!(err, TraceError::MemoryBudget { .. }), "{err}");
        assert!(doc.peak() < 2 << 20, "held {}", doc.peak());
        let doc = decode_bytes(&p).expect("within a large budget");
        assert_eq!(doc.frames.frame_count(), 200_000, "line 1 twice");
    }

    #[test]
    fn a_list_stored_into_itself_is_refused_clearly() {
        // l = []; l.append(l)
        let err = decode_bytes(b"\x80\x04\x95\x06\x00\x00\x00\x00\x00\x00\x00]\x94h\x00a.")
            .expect_err("a cycle through a list");
        assert!(
            err.to_string().contains("extended after it was stored"),
            "{err}"
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
