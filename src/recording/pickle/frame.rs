//! The pickle decoder's fast path for frame dicts: the bytes CPython writes for one
//! (`MEMOIZE ( key value ... SETITEMS`: `filename`, `line`, `name` and any FX fields) read in
//! one step into an interned frame, the value the generic path reduces such a dict to.
//!
//! # Invariants
//! - Anything else (a key twice, a key no frame has, a value of another type) gives `None`
//!   with nothing consumed, and the generic path reads the bytes.
//! - At most [`MAX_FRAME_STRINGS`] strings are memoized by one frame dict.

use crate::recording::doc::Val;
use crate::recording::frames::{Frame, Frames, FxNode, StringId};
use crate::recording::memo::Memo;

use super::opcode::{MEMOIZE, SHORT_BINUNICODE};

/// A frame dict read by `Machine::frame_dict`.
pub(super) struct ParsedFrame {
    pub(super) frame: Frame,
    /// Its FX fields, where it has any.
    pub(super) fx: Option<FxNode>,
    /// Its keys.
    pub(super) entries: usize,
    /// Bytes after the `}`.
    pub(super) len: usize,
    /// Strings first seen in it, with the memo indices they were stored under.
    pub(super) strings: [(u32, StringId); MAX_FRAME_STRINGS],
    pub(super) new_strings: usize,
}

/// The most strings a frame dict can memoize: seven keys and six string values.
const MAX_FRAME_STRINGS: usize = 13;

/// Parses a frame dict's bytes after its `}` (see `Machine::frame_dict`): `filename`,
/// `line`, `name` and any FX fields (strings or None), in any order. Strings new to the
/// document are interned even when the parse then fails (the generic path interns them
/// again, to the same ids).
#[inline]
pub(super) fn parse_frame(
    buf: &[u8],
    memo: &Memo,
    frames: &mut Frames,
    [filename_key, line_key, name_key]: [StringId; 3],
    fx_keys: [StringId; 4],
    next_memo: u32,
) -> Option<ParsedFrame> {
    let mut p = 0;
    let mut strings = [(0, StringId(0)); MAX_FRAME_STRINGS];
    let mut new_strings = 0;
    let next = |p: &mut usize| -> Option<u8> {
        let b = *buf.get(*p)?;
        *p += 1;
        Some(b)
    };
    // The next four bytes, as pickle's little-endian argument.
    let le4 = |p: &mut usize| -> Option<[u8; 4]> {
        let b = buf.get(*p..p.checked_add(4)?)?;
        *p += 4;
        Some([b[0], b[1], b[2], b[3]])
    };
    if next(&mut p)? != MEMOIZE || next(&mut p)? != b'(' {
        return None;
    }
    let (mut filename, mut line, mut name) = (None, None, None);
    let mut fx: [Option<StringId>; 4] = [None; 4];
    let mut seen_fx = [false; 4];
    // A string (Some(id)) or None (Some(None) only where `none_ok`).
    let mut value = |p: &mut usize, none_ok: bool| -> Option<Option<StringId>> {
        let op = next(p)?;
        let v = match op {
            b'N' if none_ok => return Some(None),
            b'h' | b'j' => {
                let index = if op == b'h' {
                    u32::from(next(p)?)
                } else {
                    u32::from_le_bytes(le4(p)?)
                };
                // A string memoized earlier in this same dict (a name equal to its file,
                // say) is not in the memo yet: the dict's pending entries first.
                let pending = strings[..new_strings].iter().find(|&&(i, _)| i == index);
                match pending {
                    Some(&(_, s)) => Val::Str(s),
                    None if index == next_memo => return None,
                    None => memo.get(index)?,
                }
            }
            SHORT_BINUNICODE | b'X' => {
                let n = if op == SHORT_BINUNICODE {
                    usize::from(next(p)?)
                } else {
                    u32::from_le_bytes(le4(p)?) as usize
                };
                let bytes = buf.get(*p..p.checked_add(n)?)?;
                *p += n;
                let id = frames.string(std::str::from_utf8(bytes).ok()?);
                if buf.get(*p) == Some(&MEMOIZE) {
                    *p += 1;
                    let index = next_memo.checked_add(1 + new_strings as u32)?;
                    *strings.get_mut(new_strings)? = (index, id);
                    new_strings += 1;
                }
                Val::Str(id)
            }
            _ => return None,
        };
        match v {
            Val::Str(s) => Some(Some(s)),
            _ => None,
        }
    };
    let mut entries = 0;
    for _ in 0..7 {
        if buf.get(p) == Some(&b'u') {
            break;
        }
        entries += 1;
        let key = value(&mut p, false)??;
        if key == line_key && line.is_none() {
            let v = match next(&mut p)? {
                b'K' => i64::from(next(&mut p)?),
                b'M' => {
                    let b = buf.get(p..p + 2)?;
                    p += 2;
                    i64::from(u16::from_le_bytes([b[0], b[1]]))
                }
                b'J' => i64::from(i32::from_le_bytes(le4(&mut p)?)),
                _ => return None,
            };
            line = Some(v);
        } else if key == filename_key && filename.is_none() {
            filename = Some(value(&mut p, false)??);
        } else if key == name_key && name.is_none() {
            name = Some(value(&mut p, false)??);
        } else {
            let i = fx_keys.iter().position(|&k| k == key)?;
            if std::mem::replace(&mut seen_fx[i], true) {
                return None;
            }
            fx[i] = value(&mut p, true)?;
        }
    }
    if next(&mut p)? != b'u' {
        return None;
    }
    Some(ParsedFrame {
        frame: Frame {
            filename: filename?,
            line: line?,
            name: name?,
            fx: None,
        },
        fx: FxNode::of(fx),
        entries,
        len: p,
        strings,
        new_strings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recording::doc::Doc;

    /// A frame dict's bytes after its `}`, as CPython writes it: `filename`, `line`, `name`
    /// and the FX fields, `fx_node_info` None.
    fn fx_frame_bytes() -> Vec<u8> {
        let mut b = vec![0x94, b'('];
        let s = |b: &mut Vec<u8>, text: &str| {
            b.extend([0x8c, text.len() as u8]);
            b.extend(text.as_bytes());
            b.push(0x94);
        };
        s(&mut b, "filename");
        s(&mut b, "model.py");
        s(&mut b, "line");
        b.extend([b'K', 7]);
        s(&mut b, "name");
        s(&mut b, "forward");
        s(&mut b, "fx_node_op");
        s(&mut b, "call_function");
        s(&mut b, "fx_node_name");
        s(&mut b, "mm_3");
        s(&mut b, "fx_original_trace");
        let trace = "x".repeat(300);
        b.push(b'X');
        b.extend((trace.len() as u32).to_le_bytes());
        b.extend(trace.as_bytes());
        b.push(0x94);
        s(&mut b, "fx_node_info");
        b.push(b'N');
        b.push(b'u');
        b
    }

    #[test]
    fn the_fast_path_reads_fx_frames() {
        let doc = Doc::default();
        let mut frames = Frames::default();
        // The doc's key ids, interned in the same order.
        for k in ["filename", "line", "name"]
            .into_iter()
            .chain(crate::recording::doc::FX_KEYS)
        {
            frames.string(k);
        }
        let bytes = fx_frame_bytes();
        let parsed = parse_frame(
            &bytes,
            &Memo::default(),
            &mut frames,
            doc.frame_keys(),
            doc.fx_keys(),
            10,
        )
        .expect("the fast path takes it");
        assert_eq!((parsed.entries, parsed.len), (7, bytes.len()));
        let fx = parsed.fx.expect("its node");
        assert_eq!(fx.op.map(|s| frames.str(s)), Some("call_function"));
        assert_eq!(fx.name.map(|s| frames.str(s)), Some("mm_3"));
        assert_eq!(fx.original_trace.map(|s| frames.str(s).len()), Some(300));
        assert_eq!(fx.info, None);
        assert_eq!(frames.str(parsed.frame.name), "forward");
        // Every string memoized: seven keys and five string values (the sixth is None).
        assert_eq!(parsed.new_strings, 12);
        // A key twice, or one that is no frame's, leaves it to the generic path.
        let mut twice = bytes.clone();
        let at = twice.len() - 1;
        twice.splice(at..at, [0x8c, 4, b'l', b'i', b'n', b'e', b'K', 1]);
        assert!(
            parse_frame(
                &twice,
                &Memo::default(),
                &mut frames,
                doc.frame_keys(),
                doc.fx_keys(),
                10
            )
            .is_none()
        );
    }
}
