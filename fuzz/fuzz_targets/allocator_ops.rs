//! Arbitrary bytes as a sequence of allocator operations (`gpumem::ops`, the property tests'
//! operations): every one must keep the allocator's invariants (checked inside the core, the
//! feature `invariants` being on, and by the driver), and everything must return to the
//! device at the end. The first byte picks the pools' order (`FitOrder`).

#![no_main]

use gpumem::ops::{Run, from_bytes, order_from_byte};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte picks the pools' order, the rest are operations.
    let Some((&order, data)) = data.split_first() else {
        return;
    };
    let mut run = Run::with_order(order_from_byte(order));
    for (i, op) in from_bytes(data).enumerate() {
        if let Err(e) = run.apply(&op) {
            panic!("after op {i} {op:?}: {e}");
        }
    }
    if let Err(e) = run.finish() {
        panic!("at the end: {e}");
    }
});
