//! Which pool: PyTorch's id of a pool ([`PoolId`], `MempoolId_t`), the slot a block carries
//! for its pool ([`PoolSlot`]: the default pools or a private pool's entry), and one block
//! pool ([`PoolRef`]: a slot and a size class). Plain values, a leaf of the core: blocks,
//! pools and private pools all name them.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::size::PoolKind;

/// A pool's id (PyTorch's `MempoolId_t`): `(0, 0)` is the default pool.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub struct PoolId(pub u64, pub u64);

impl PoolId {
    /// The default pools' id.
    pub const DEFAULT: PoolId = PoolId(0, 0);

    /// Whether this is the default pools' id.
    pub fn is_default(self) -> bool {
        self == Self::DEFAULT
    }
}

impl fmt::Display for PoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "({}, {})", self.0, self.1)
    }
}

/// Where a block's pool lives: the default pools (0) or private pool slot `n - 1`. Two
/// bytes, so that the block keeps to one cache line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct PoolSlot(u16);

impl PoolSlot {
    pub const DEFAULT: PoolSlot = PoolSlot(0);

    pub fn is_default(self) -> bool {
        self.0 == 0
    }

    /// The slot of private pool `index` (in `PrivatePools`' table); `None` past the last.
    pub fn private(index: usize) -> Option<PoolSlot> {
        u16::try_from(index.checked_add(1)?).ok().map(PoolSlot)
    }

    /// Its index in the private pools' table; only for a private pool's slot.
    pub fn index(self) -> usize {
        usize::from(self.0) - 1
    }
}

/// One of the four (or more) block pools: a size class of the default or a private pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct PoolRef {
    pub owner: PoolSlot,
    pub kind: PoolKind,
}

impl PoolRef {
    pub fn default_pool(kind: PoolKind) -> PoolRef {
        PoolRef {
            owner: PoolSlot::DEFAULT,
            kind,
        }
    }
}
