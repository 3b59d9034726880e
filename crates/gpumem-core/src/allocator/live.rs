//! The live map (PyTorch's top-level pointer map): allocated blocks by address, as 4-byte
//! ids in a swiss table hashed by address and compared through the arena, a quarter of the
//! memory of a map from address to id.
//!
//! # Invariants
//! - It holds exactly the ids of the allocated blocks, each once, under the hash of the
//!   block's address; an allocated block's address never changes (only free blocks split
//!   and merge), so every stored hash stays true.

use std::hash::BuildHasher;

use hashbrown::HashTable;
use rustc_hash::FxBuildHasher;
use slab::Slab;

use super::block::{Block, BlockId};

/// Allocated blocks by address. See the module documentation.
#[derive(Debug, Clone, Default)]
pub(super) struct LiveMap {
    table: HashTable<BlockId>,
}

fn hash(ptr: u64) -> u64 {
    FxBuildHasher.hash_one(ptr)
}

impl LiveMap {
    /// Adds allocated block `id`, whose address is `ptr` (not in the map yet).
    #[inline]
    pub fn insert(&mut self, ptr: u64, id: BlockId, blocks: &Slab<Block>) {
        self.table
            .insert_unique(hash(ptr), id, |&i| hash(blocks[i.index()].ptr));
    }

    /// The allocated block at `ptr`.
    #[inline]
    pub fn get(&self, ptr: u64, blocks: &Slab<Block>) -> Option<BlockId> {
        self.table
            .find(hash(ptr), |&i| blocks[i.index()].ptr == ptr)
            .copied()
    }

    /// Takes the allocated block at `ptr` out.
    #[inline]
    pub fn remove(&mut self, ptr: u64, blocks: &Slab<Block>) -> Option<BlockId> {
        let entry = self
            .table
            .find_entry(hash(ptr), |&i| blocks[i.index()].ptr == ptr)
            .ok()?;
        Some(entry.remove().0)
    }

    /// Blocks in the map.
    pub fn len(&self) -> usize {
        self.table.len()
    }
}
