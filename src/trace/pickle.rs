//! A restricted pickle decoder: protocols 2 to 5, builtin data types only.
//!
//! PyTorch snapshots are pickles of dicts, lists, tuples, strings, ints, floats and bools, in
//! which frame objects are shared through the memo (so `serde-pickle`, which cannot share,
//! fails on them). This decoder runs the pickle machine over a [`Doc`] arena, where sharing
//! is free and cycles are harmless. Any opcode that would name a class or call a function
//! (`GLOBAL`, `REDUCE`, `BUILD`, ...) is refused: nothing from the file is ever executed.
//!
//! # Invariants
//! - Every length read from the input is checked against the bytes that remain before
//!   anything is allocated for it; memo indices are looked up, never used to size a table.
//! - At most one node is created per opcode, so memory is linear in the input size.

use rustc_hash::FxHashMap;

use super::TraceError;
use super::doc::{Doc, NodeId, Value};

/// A stack slot: a value, or a MARK.
#[derive(Clone, Copy)]
enum Slot {
    Mark,
    Node(NodeId),
}

struct Machine<'a> {
    input: &'a [u8],
    pos: usize,
    doc: Doc,
    stack: Vec<Slot>,
    memo: FxHashMap<u32, NodeId>,
    next_memo: u32,
}

/// Decodes a pickle into a document.
///
/// # Errors
/// [`TraceError::Pickle`] with the byte offset and what was wrong: truncation, an opcode
/// outside the supported set (or one that names a class), a malformed stack.
pub(crate) fn decode(input: &[u8]) -> Result<Doc, TraceError> {
    let mut m = Machine {
        input,
        pos: 0,
        doc: Doc::default(),
        stack: Vec::new(),
        memo: FxHashMap::default(),
        next_memo: 0,
    };
    m.run()?;
    Ok(m.doc)
}

impl Machine<'_> {
    fn fail(&self, offset: usize, message: impl Into<String>) -> TraceError {
        TraceError::Pickle {
            offset,
            message: message.into(),
        }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&[u8], TraceError> {
        let at = self.pos;
        let remaining = self.input.len() - self.pos;
        if n > remaining {
            return Err(self.fail(
                at,
                format!("truncated: {what} needs {n} bytes, {remaining} remain"),
            ));
        }
        self.pos += n;
        Ok(&self.input[at..at + n])
    }

    fn byte(&mut self, what: &str) -> Result<u8, TraceError> {
        Ok(self.take(1, what)?[0])
    }

    fn u16(&mut self, what: &str) -> Result<u16, TraceError> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self, what: &str) -> Result<u32, TraceError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64, TraceError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    fn push(&mut self, value: Value) {
        let id = self.doc.push(value);
        self.stack.push(Slot::Node(id));
    }

    fn pop(&mut self, at: usize) -> Result<NodeId, TraceError> {
        match self.stack.pop() {
            Some(Slot::Node(id)) => Ok(id),
            Some(Slot::Mark) => Err(self.fail(at, "a value was expected, found a MARK")),
            None => Err(self.fail(at, "the stack is empty")),
        }
    }

    fn top(&self, at: usize) -> Result<NodeId, TraceError> {
        match self.stack.last() {
            Some(Slot::Node(id)) => Ok(*id),
            _ => Err(self.fail(at, "a value was expected on the stack")),
        }
    }

    /// Pops everything down to the last MARK.
    fn pop_mark(&mut self, at: usize) -> Result<Vec<NodeId>, TraceError> {
        let mark = self
            .stack
            .iter()
            .rposition(|s| matches!(s, Slot::Mark))
            .ok_or_else(|| self.fail(at, "no MARK on the stack"))?;
        let items = self.stack[mark + 1..]
            .iter()
            .map(|s| match s {
                Slot::Node(id) => *id,
                Slot::Mark => unreachable!("rposition found the last mark"),
            })
            .collect();
        self.stack.truncate(mark);
        Ok(items)
    }

    fn string(&mut self, len: usize, at: usize) -> Result<(), TraceError> {
        let bytes = self.take(len, "a string")?;
        let s = std::str::from_utf8(bytes)
            .map_err(|_| TraceError::Pickle {
                offset: at,
                message: "a string is not valid UTF-8".into(),
            })?
            .to_string();
        self.push(Value::Str(s));
        Ok(())
    }

    fn long(&mut self, len: usize) -> Result<(), TraceError> {
        let bytes = self.take(len, "a long integer")?;
        let value = if bytes.is_empty() {
            Value::Int(0)
        } else if bytes.len() <= 8 {
            // Little-endian two's complement, sign-extended to 64 bits.
            let fill = if bytes[bytes.len() - 1] & 0x80 != 0 {
                0xff
            } else {
                0
            };
            let mut a = [fill; 8];
            a[..bytes.len()].copy_from_slice(bytes);
            Value::Int(i64::from_le_bytes(a))
        } else {
            Value::BigInt
        };
        self.push(value);
        Ok(())
    }

    fn memo_get(&mut self, index: u32, at: usize) -> Result<(), TraceError> {
        let id = *self
            .memo
            .get(&index)
            .ok_or_else(|| self.fail(at, format!("memo entry {index} was never stored")))?;
        self.stack.push(Slot::Node(id));
        Ok(())
    }

    fn memo_put(&mut self, index: u32, at: usize) -> Result<(), TraceError> {
        let id = self.top(at)?;
        self.memo.insert(index, id);
        Ok(())
    }

    fn append(&mut self, list: NodeId, items: Vec<NodeId>, at: usize) -> Result<(), TraceError> {
        match self.doc.get_mut(list) {
            Value::List(v) => {
                v.extend(items);
                Ok(())
            }
            _ => Err(self.fail(at, "APPEND to something that is not a list")),
        }
    }

    fn set_items(&mut self, dict: NodeId, items: &[NodeId], at: usize) -> Result<(), TraceError> {
        if !items.len().is_multiple_of(2) {
            return Err(self.fail(at, "SETITEMS with an odd number of values"));
        }
        match self.doc.get_mut(dict) {
            Value::Dict(entries) => {
                entries.extend(items.chunks_exact(2).map(|kv| (kv[0], kv[1])));
                Ok(())
            }
            _ => Err(self.fail(at, "SETITEM on something that is not a dict")),
        }
    }

    fn run(&mut self) -> Result<(), TraceError> {
        loop {
            let at = self.pos;
            let op = self
                .byte("an opcode")
                .map_err(|_| self.fail(at, "truncated: the pickle ends before STOP"))?;
            match op {
                0x80 => {
                    let protocol = self.byte("the protocol number")?;
                    if !(2..=5).contains(&protocol) {
                        return Err(self.fail(
                            at,
                            format!("protocol {protocol} is not supported (2 to 5 are)"),
                        ));
                    }
                }
                0x95 => {
                    // FRAME: a length hint for buffered readers; the data follows inline.
                    self.u64("a frame length")?;
                }
                b'.' => {
                    self.doc.root = self.pop(at)?;
                    return Ok(());
                }
                b'(' => self.stack.push(Slot::Mark),
                b'0' => {
                    self.stack
                        .pop()
                        .ok_or_else(|| self.fail(at, "POP on an empty stack"))?;
                }
                b'1' => {
                    self.pop_mark(at)?;
                }
                b'2' => {
                    let id = self.top(at)?;
                    self.stack.push(Slot::Node(id));
                }
                b'}' => self.push(Value::Dict(Vec::new())),
                b']' => self.push(Value::List(Vec::new())),
                b')' => self.push(Value::Tuple(Vec::new())),
                b'l' => {
                    let items = self.pop_mark(at)?;
                    self.push(Value::List(items));
                }
                b't' => {
                    let items = self.pop_mark(at)?;
                    self.push(Value::Tuple(items));
                }
                b'd' => {
                    let items = self.pop_mark(at)?;
                    let dict = self.doc.push(Value::Dict(Vec::new()));
                    self.set_items(dict, &items, at)?;
                    self.stack.push(Slot::Node(dict));
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop(at)?);
                    }
                    items.reverse();
                    self.push(Value::Tuple(items));
                }
                b'a' => {
                    let item = self.pop(at)?;
                    let list = self.top(at)?;
                    self.append(list, vec![item], at)?;
                }
                b'e' => {
                    let items = self.pop_mark(at)?;
                    let list = self.top(at)?;
                    self.append(list, items, at)?;
                }
                b's' => {
                    let value = self.pop(at)?;
                    let key = self.pop(at)?;
                    let dict = self.top(at)?;
                    self.set_items(dict, &[key, value], at)?;
                }
                b'u' => {
                    let items = self.pop_mark(at)?;
                    let dict = self.top(at)?;
                    self.set_items(dict, &items, at)?;
                }
                0x94 => {
                    let index = self.next_memo;
                    self.next_memo += 1;
                    self.memo_put(index, at)?;
                }
                b'q' => {
                    let index = u32::from(self.byte("a memo index")?);
                    self.memo_put(index, at)?;
                }
                b'r' => {
                    let index = self.u32("a memo index")?;
                    self.memo_put(index, at)?;
                }
                b'h' => {
                    let index = u32::from(self.byte("a memo index")?);
                    self.memo_get(index, at)?;
                }
                b'j' => {
                    let index = self.u32("a memo index")?;
                    self.memo_get(index, at)?;
                }
                b'J' => {
                    let v = self.u32("an int")? as i32;
                    self.push(Value::Int(i64::from(v)));
                }
                b'K' => {
                    let v = self.byte("an int")?;
                    self.push(Value::Int(i64::from(v)));
                }
                b'M' => {
                    let v = self.u16("an int")?;
                    self.push(Value::Int(i64::from(v)));
                }
                0x8a => {
                    let n = usize::from(self.byte("a long length")?);
                    self.long(n)?;
                }
                0x8b => {
                    let n = self.u32("a long length")? as i32;
                    let n =
                        usize::try_from(n).map_err(|_| self.fail(at, "negative long length"))?;
                    self.long(n)?;
                }
                b'G' => {
                    let b = self.take(8, "a float")?;
                    let mut a = [0u8; 8];
                    a.copy_from_slice(b);
                    self.push(Value::Float(f64::from_be_bytes(a)));
                }
                0x8c => {
                    let n = usize::from(self.byte("a string length")?);
                    self.string(n, at)?;
                }
                b'X' => {
                    let n = self.u32("a string length")? as usize;
                    self.string(n, at)?;
                }
                0x8d => {
                    let n = self.u64("a string length")?;
                    let n = usize::try_from(n).unwrap_or(usize::MAX);
                    self.string(n, at)?;
                }
                b'N' => self.push(Value::None),
                0x88 => self.push(Value::Bool(true)),
                0x89 => self.push(Value::Bool(false)),
                b'c' | 0x93 | b'R' | b'b' | b'i' | b'o' | 0x81 | 0x92 | b'P' | b'Q' | 0x82
                | 0x83 | 0x84 => {
                    return Err(self.fail(
                        at,
                        format!(
                            "opcode {op:#04x} names a class or calls a function; only plain data (dict, list, tuple, str, int, float, bool) is accepted"
                        ),
                    ));
                }
                _ => {
                    return Err(self.fail(at, format!("unsupported opcode {op:#04x}")));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `pickle.dumps({"a": [1, -2, 3.5, "x", None, True], "b": (7, 2**40)}, protocol=4)`.
    const SAMPLE: &[u8] = b"\x80\x04\x953\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01a\x94]\x94(K\x01J\xfe\xff\xff\xffG@\x0c\x00\x00\x00\x00\x00\x00\x8c\x01x\x94N\x88e\x8c\x01b\x94K\x07\x8a\x06\x00\x00\x00\x00\x00\x01\x86\x94u.";

    #[test]
    fn decodes_builtin_types() {
        let doc = decode(SAMPLE).expect("valid pickle");
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
        let doc = decode(data).expect("valid pickle");
        let items: Vec<_> = doc.root().items().expect("list").collect();
        assert_eq!(items.len(), 2);
        for item in items {
            assert_eq!(item.field("k").expect("k").int().expect("int"), 1);
        }
    }

    #[test]
    fn every_truncation_is_an_error() {
        for end in 0..SAMPLE.len() {
            let err = decode(&SAMPLE[..end]).expect_err("truncated");
            assert!(matches!(err, TraceError::Pickle { .. }), "{err}");
        }
    }

    #[test]
    fn classes_are_refused() {
        // pickle.dumps(collections.OrderedDict(), protocol=2)
        let data = b"\x80\x02ccollections\nOrderedDict\nq\x00)Rq\x01.";
        let err = decode(data).expect_err("names a class");
        assert!(err.to_string().contains("names a class"), "{err}");
    }

    #[test]
    fn huge_length_fields_fail_before_allocating() {
        let data = b"\x80\x04X\x00\x00\x00\x80abc.";
        let err = decode(data).expect_err("2 GiB string in 4 bytes");
        assert!(err.to_string().contains("2147483648 bytes"), "{err}");
        let data = b"\x80\x04\x8d\xff\xff\xff\xff\xff\xff\xff\xffabc.";
        assert!(decode(data).is_err());
        let data = b"\x80\x04j\xff\xff\xff\xff.";
        assert!(
            decode(data)
                .expect_err("bad memo")
                .to_string()
                .contains("never stored")
        );
    }
}
