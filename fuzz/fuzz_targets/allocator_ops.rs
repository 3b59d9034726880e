//! Arbitrary bytes as a sequence of allocator operations (`gpumem::ops`, the property tests'
//! operations): every one must keep the allocator's invariants (checked inside the core, the
//! feature `invariants` being on, and by the driver), and everything must return to the
//! device at the end.

#![no_main]

use gpumem::ops::{Run, from_bytes};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut run = Run::new();
    for (i, op) in from_bytes(data).enumerate() {
        if let Err(e) = run.apply(&op) {
            panic!("after op {i} {op:?}: {e}");
        }
    }
    if let Err(e) = run.finish() {
        panic!("at the end: {e}");
    }
});
