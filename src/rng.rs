//! A small deterministic generator for the synthetic workload, the planner's search and the
//! property tests: runs repeat exactly for a seed, with no dependency for it.

/// A small deterministic generator (xorshift64*), enough for sequence lengths.
#[derive(Clone, Debug)]
pub struct XorShift(u64);

impl XorShift {
    /// A generator from a seed (0 is replaced by a fixed odd constant).
    pub fn new(seed: u64) -> Self {
        XorShift(if seed == 0 {
            0x9E37_79B9_7F4A_7C15
        } else {
            seed
        })
    }

    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A value in `[low, high]`.
    pub fn between(&mut self, low: u64, high: u64) -> u64 {
        low + self.next_u64() % (high - low + 1)
    }
}
