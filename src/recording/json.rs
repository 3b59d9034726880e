//! The JSON form of a snapshot, streamed into the same compact [`Doc`] as a pickle: serde's
//! visitor builds each value straight into the document (no intermediate JSON tree), and
//! frames and frame lists are reduced as they are stored, as the pickle decoder does.
//!
//! # Invariants
//! - Nesting is bounded by serde_json's limit (128 levels), which bounds the recursion.
//! - Memory is checked against the budget as containers grow, and no more than a quarter of
//!   it may be read between two values (serde_json holds a string whole before handing it
//!   over); past either, reading stops with [`TraceError::MemoryBudget`]. JSON's lone
//!   surrogate escapes (`\udcXX`, which Python's `json` writes for undecodable path bytes)
//!   are refused by serde_json as invalid.

use std::cell::Cell;
use std::fmt;
use std::rc::Rc;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};

use super::TraceError;
use super::doc::{Doc, Obj, Val};
use super::input::Input;

/// How often (in values) memory is checked against the budget.
const CHECK_EVERY: u64 = 4096;

struct Builder<'d> {
    doc: &'d mut Doc,
    max_memory: u64,
    /// Values seen, shared with the input's guard on the bytes between two values.
    seen: Rc<Cell<u64>>,
}

impl Builder<'_> {
    fn value<E: de::Error>(&mut self, v: Val) -> Result<Val, E> {
        let v = self.doc.scalar(v);
        self.check()?;
        Ok(v)
    }

    fn check<E: de::Error>(&mut self) -> Result<(), E> {
        let seen = self.seen.get() + 1;
        self.seen.set(seen);
        if seen.is_multiple_of(CHECK_EVERY) {
            let held = self.doc.bytes();
            self.doc.note_peak(held);
            if held > self.max_memory {
                return Err(E::custom(BUDGET));
            }
        }
        Ok(())
    }
}

/// The marker of a budget error through serde's error type.
const BUDGET: &str = "gpumem: memory budget exceeded";

impl<'de> DeserializeSeed<'de> for &mut Builder<'_> {
    type Value = Val;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Val, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for &mut Builder<'_> {
    type Value = Val;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Val, E> {
        self.value(Val::None)
    }

    fn visit_bool<E: de::Error>(self, b: bool) -> Result<Val, E> {
        self.value(Val::Bool(b))
    }

    fn visit_i64<E: de::Error>(self, i: i64) -> Result<Val, E> {
        self.value(Val::Int(i))
    }

    fn visit_u64<E: de::Error>(self, u: u64) -> Result<Val, E> {
        self.value(i64::try_from(u).map_or(Val::BigInt, Val::Int))
    }

    fn visit_f64<E: de::Error>(self, f: f64) -> Result<Val, E> {
        self.value(Val::Float(f))
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Val, E> {
        let v = self.doc.str(s);
        self.check()?;
        Ok(v)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Val, A::Error> {
        let list = self.doc.new_obj(Obj::List(Vec::new()));
        while let Some(item) = seq.next_element_seed(&mut *self)? {
            let (item, _) = self.doc.store(item);
            self.doc
                .extend_list(list, &[item])
                .map_err(de::Error::custom)?;
            self.check()?;
        }
        Ok(list)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Val, A::Error> {
        let dict = self.doc.new_obj(Obj::Dict(Vec::new()));
        while let Some(key) = map.next_key_seed(&mut *self)? {
            let value = map.next_value_seed(&mut *self)?;
            let (value, _) = self.doc.store(value);
            self.doc
                .extend_dict(dict, &[key, value])
                .map_err(de::Error::custom)?;
            self.check()?;
        }
        Ok(dict)
    }
}

/// Reads JSON from `input` into `doc`, holding at most `max_memory` bytes.
///
/// # Errors
/// [`TraceError::Json`] with serde_json's line and column, or [`TraceError::MemoryBudget`].
pub(crate) fn decode(
    input: &mut Input<'_>,
    doc: &mut Doc,
    max_memory: u64,
) -> Result<(), TraceError> {
    let seen = Rc::new(Cell::new(0));
    // serde_json holds a string whole: no more than a quarter of the budget between values.
    input.guard_values(Rc::clone(&seen), max_memory / 4, max_memory);
    let mut builder = Builder {
        doc,
        max_memory,
        seen,
    };
    let mut de = serde_json::Deserializer::from_reader(&mut *input);
    let result = (&mut builder)
        .deserialize(&mut de)
        .and_then(|root| de.end().map(|()| root));
    let offset = input.offset();
    if let (Err(_), Some(cause)) = (&result, input.take_error()) {
        return Err(cause);
    }
    match result {
        Ok(root) => {
            let (root, _) = builder.doc.store(root);
            builder.doc.root = root;
            builder.doc.count_work(builder.doc.values());
            Ok(())
        }
        Err(e) if e.to_string().starts_with(BUDGET) => Err(TraceError::MemoryBudget {
            limit: max_memory,
            offset,
        }),
        Err(e) => Err(TraceError::Json(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str, budget: u64) -> Result<Doc, TraceError> {
        let mut input = Input::new(Box::new(text.as_bytes()), u64::MAX, None)?;
        let mut doc = Doc::default();
        decode(&mut input, &mut doc, budget)?;
        Ok(doc)
    }

    #[test]
    fn json_reads_into_the_same_document_frames_included() {
        let doc = read(
            r#"{"a": [1, -2, 3.5, "x", null, true, 18446744073709551615],
                "frames": [{"filename": "a.py", "line": 3, "name": "g"},
                           {"name": "g", "line": 3, "filename": "a.py"}]}"#,
            u64::MAX,
        )
        .expect("valid");
        let root = doc.root();
        let a: Vec<_> = root.field("a").expect("a").items().expect("list").collect();
        assert_eq!(a[1].int().expect("int"), -2);
        assert_eq!(a[3].str().expect("str"), "x");
        assert!(a[4].is_none());
        assert!(a[6].int().is_err(), "wider than i64");
        let stack = root
            .field("frames")
            .expect("frames")
            .stack()
            .expect("stack");
        assert_eq!(doc.frames.frames_of(stack).len(), 2);
        assert_eq!(doc.frames.frame_count(), 1);
    }

    #[test]
    fn one_huge_string_is_refused_within_the_budget() {
        let text = format!("[\"{}\"]", "x".repeat(1 << 20));
        let err = read(&text, 1 << 20).expect_err("a string of the whole budget");
        assert!(matches!(err, TraceError::MemoryBudget { .. }), "{err}");
        assert!(read(&text, 16 << 20).is_ok());
    }

    #[test]
    fn errors_say_where_and_the_budget_holds() {
        let err = read("{\"a\": [1,\n 2,, 3]}", u64::MAX).expect_err("malformed");
        assert!(err.to_string().contains("line 2"), "{err}");
        let zeros = format!("[{}0]", "0,".repeat(100_000));
        let err = read(&zeros, 1 << 20).expect_err("over budget");
        assert!(matches!(err, TraceError::MemoryBudget { .. }), "{err}");
        assert!(read(&zeros, 1 << 30).is_ok());
    }
}
