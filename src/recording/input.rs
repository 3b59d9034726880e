//! The bytes of a recording, streamed once through a fixed buffer: from a file or memory,
//! gzip decompressed on the way where the data starts with gzip's magic, within a byte limit.
//!
//! # Invariants
//! - At most [`BUFFER`] bytes are buffered (fewer for a small input), plus, for one value longer than that (a huge
//!   string), a scratch buffer that grows only as the value's bytes actually arrive: a length
//!   field never sizes an allocation by itself.
//! - Reading past `limit` decoded bytes is an error ([`TraceError::TooLarge`]), as is input
//!   that ends inside a value.

use std::io::Read;

use super::TraceError;

/// The read buffer.
pub(crate) const BUFFER: usize = 1 << 20;

/// A source of decoded bytes.
pub(crate) struct Input<'r> {
    reader: Box<dyn Read + 'r>,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// Decoded bytes before `buf[0]`.
    base: u64,
    eof: bool,
    limit: u64,
    compressed: bool,
    scratch: Vec<u8>,
    /// The error behind a failed [`Read::read`], kept with its type for the caller.
    failed: Option<TraceError>,
    /// A bound on the bytes read between two values (see [`Input::guard_values`]).
    guard: Option<ValueGuard>,
}

/// Bounds the bytes a streaming parser may read without producing a value: serde_json holds
/// a string whole before handing it over, so one string could otherwise take any memory.
struct ValueGuard {
    values: std::rc::Rc<std::cell::Cell<u64>>,
    seen: u64,
    since: u64,
    limit: u64,
    budget: u64,
}

impl<'r> Input<'r> {
    /// Decoded bytes of `reader` (gunzipped where they start with gzip's magic), at most
    /// `limit` of them; `size` is the input's size where known (a small input gets a small
    /// buffer).
    ///
    /// # Errors
    /// The reader's error.
    pub fn new(
        mut reader: Box<dyn Read + 'r>,
        limit: u64,
        size: Option<u64>,
    ) -> Result<Input<'r>, TraceError> {
        let mut magic = [0u8; 2];
        let mut got = 0;
        while got < 2 {
            match reader.read(&mut magic[got..]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(TraceError::Gzip(e.to_string())),
            }
        }
        let head = std::io::Cursor::new(magic[..got].to_vec());
        let joined: Box<dyn Read + 'r> = Box::new(head.chain(reader));
        let compressed = magic[..got] == [0x1f, 0x8b];
        let buffer = match size {
            Some(n) if !compressed => (n as usize).clamp(64, BUFFER),
            _ => BUFFER,
        };
        let reader: Box<dyn Read + 'r> = if compressed {
            Box::new(flate2::read::MultiGzDecoder::new(joined))
        } else {
            joined
        };
        Ok(Input {
            reader,
            buf: vec![0; buffer].into_boxed_slice(),
            start: 0,
            end: 0,
            base: 0,
            eof: false,
            limit,
            compressed,
            scratch: Vec::new(),
            failed: None,
            guard: None,
        })
    }

    /// The error a [`Read::read`] of this input failed with, if one did.
    pub fn take_error(&mut self) -> Option<TraceError> {
        self.failed.take()
    }

    /// Fails [`Read::read`] with [`TraceError::MemoryBudget`] (of `budget`) once more than
    /// `limit` bytes are read while `values` (counted by the parser's consumer) stays the same.
    pub fn guard_values(
        &mut self,
        values: std::rc::Rc<std::cell::Cell<u64>>,
        limit: u64,
        budget: u64,
    ) {
        self.guard = Some(ValueGuard {
            seen: values.get(),
            values,
            since: 0,
            limit,
            budget,
        });
    }

    /// Bytes the scratch buffer of a long value holds.
    pub fn scratch_bytes(&self) -> u64 {
        self.scratch.capacity() as u64
    }

    /// Gives back a long value's scratch buffer once the value has been taken.
    pub fn shrink_scratch(&mut self) {
        if self.scratch.capacity() > BUFFER {
            self.scratch = Vec::new();
        }
    }

    /// The offset (in decoded bytes) of the next byte.
    pub fn offset(&self) -> u64 {
        self.base + self.start as u64
    }

    fn too_large(&self) -> TraceError {
        TraceError::TooLarge {
            limit: self.limit,
            decompressed: self.compressed,
        }
    }

    /// Reads more into the buffer (keeping what is unread); false at the end of the input.
    fn fill(&mut self) -> Result<bool, TraceError> {
        if self.eof {
            return Ok(false);
        }
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.base += self.start as u64;
            self.end -= self.start;
            self.start = 0;
        }
        loop {
            match self.reader.read(&mut self.buf[self.end..]) {
                Ok(0) => {
                    self.eof = true;
                    return Ok(false);
                }
                Ok(n) => {
                    self.end += n;
                    if self.base + self.end as u64 > self.limit {
                        return Err(self.too_large());
                    }
                    return Ok(true);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(if self.compressed {
                        TraceError::Gzip(e.to_string())
                    } else {
                        TraceError::Io {
                            path: "the input".into(),
                            source: e,
                        }
                    });
                }
            }
        }
    }

    /// The next byte, or `None` at the end of the input.
    ///
    /// # Errors
    /// A read error or the limit.
    #[inline]
    pub fn byte(&mut self) -> Result<Option<u8>, TraceError> {
        if self.start == self.end && !self.fill()? {
            return Ok(None);
        }
        let b = self.buf[self.start];
        self.start += 1;
        Ok(Some(b))
    }

    /// The bytes buffered and not consumed yet (possibly none; nothing is read).
    #[inline]
    pub fn buffered(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// Consumes `n` of the [`buffered`](Self::buffered) bytes.
    #[inline]
    pub fn consume(&mut self, n: usize) {
        debug_assert!(n <= self.end - self.start);
        self.start += n;
    }

    /// The next byte, if any, without consuming it.
    ///
    /// # Errors
    /// A read error or the limit.
    pub fn peek(&mut self) -> Result<Option<u8>, TraceError> {
        if self.start == self.end && !self.fill()? {
            return Ok(None);
        }
        Ok(Some(self.buf[self.start]))
    }

    /// The next `n` bytes, or `None` when the input ends first (with what remained consumed).
    ///
    /// # Errors
    /// A read error or the limit.
    #[inline]
    pub fn next_bytes(&mut self, n: usize) -> Result<Option<&[u8]>, TraceError> {
        if self.end - self.start >= n {
            let at = self.start;
            self.start += n;
            return Ok(Some(&self.buf[at..at + n]));
        }
        self.next_bytes_slow(n)
    }

    fn next_bytes_slow(&mut self, n: usize) -> Result<Option<&[u8]>, TraceError> {
        if n <= self.buf.len() {
            while self.end - self.start < n {
                if !self.fill()? {
                    self.start = self.end;
                    return Ok(None);
                }
            }
            let at = self.start;
            self.start += n;
            return Ok(Some(&self.buf[at..at + n]));
        }
        // Longer than the buffer: gathered as it arrives.
        self.scratch.clear();
        while self.scratch.len() < n {
            if self.start == self.end && !self.fill()? {
                return Ok(None);
            }
            let want = (n - self.scratch.len()).min(self.end - self.start);
            self.scratch
                .extend_from_slice(&self.buf[self.start..self.start + want]);
            self.start += want;
        }
        Ok(Some(&self.scratch))
    }
}

/// Reads an [`Input`] as [`std::io::Read`] (for serde_json's streaming parser).
impl Read for Input<'_> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if self.start == self.end {
            match self.fill() {
                Ok(true) => {}
                Ok(false) => return Ok(0),
                Err(e) => {
                    let message = e.to_string();
                    self.failed = Some(e);
                    return Err(std::io::Error::other(message));
                }
            }
        }
        let n = out.len().min(self.end - self.start);
        if let Some(g) = &mut self.guard {
            if g.values.get() != g.seen {
                g.seen = g.values.get();
                g.since = 0;
            }
            g.since += n as u64;
            if g.since > g.limit {
                let budget = g.budget;
                self.failed = Some(TraceError::MemoryBudget {
                    limit: budget,
                    offset: self.offset(),
                });
                return Err(std::io::Error::other(
                    "one value is larger than the memory budget allows",
                ));
            }
        }
        out[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(bytes: &[u8], limit: u64) -> Input<'_> {
        Input::new(Box::new(bytes), limit, None).expect("readable")
    }

    #[test]
    fn bytes_come_in_order_across_fills_and_past_the_buffer() {
        let data: Vec<u8> = (0..3 * BUFFER + 17).map(|i| (i % 251) as u8).collect();
        let mut i = input(&data, u64::MAX);
        assert_eq!(i.byte().expect("ok"), Some(0));
        assert_eq!(i.next_bytes(10).expect("ok"), Some(&data[1..11]));
        let long = i
            .next_bytes(2 * BUFFER)
            .expect("ok")
            .expect("there")
            .to_vec();
        assert_eq!(long, &data[11..11 + 2 * BUFFER]);
        assert_eq!(i.offset(), 11 + 2 * BUFFER as u64);
        let rest = i
            .next_bytes(BUFFER + 6)
            .expect("ok")
            .expect("there")
            .to_vec();
        assert_eq!(rest, &data[11 + 2 * BUFFER..]);
        assert_eq!(i.byte().expect("ok"), None);
        assert_eq!(i.next_bytes(1).expect("ok"), None);
    }

    #[test]
    fn gzip_is_decoded_on_the_way_and_the_limit_holds_for_decoded_bytes() {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &vec![b'N'; 5 << 20]).expect("write");
        let gz = gz.finish().expect("finish");
        let mut i = input(&gz, u64::MAX);
        assert_eq!(
            i.next_bytes(5 << 20).expect("ok").map(<[u8]>::len),
            Some(5 << 20)
        );
        let mut i = input(&gz, 1 << 20);
        let err = i.next_bytes(5 << 20).expect_err("limit");
        assert!(err.to_string().contains("once decompressed"), "{err}");
    }

    #[test]
    fn a_huge_length_reads_only_what_arrives() {
        let data = [7u8; 100];
        let mut i = input(&data, u64::MAX);
        assert_eq!(i.next_bytes(usize::MAX / 2).expect("ok"), None);
    }
}
