//! Sharing a block with another process (PyTorch's `shareIpcHandle`): what a consumer is
//! handed to map the block's memory into its own address space.
//!
//! # Note [IPC handles]
//! The driver exports whole allocations, not blocks, so a handle names more memory than the
//! block it was asked for:
//! - a block of an ordinary segment (`cudaMalloc`, type `'c'`) exports its *segment*: one
//!   handle of the segment's base, plus the block's offset in it. Every block of a segment
//!   shares that handle, and a consumer that opens it maps the whole segment;
//! - a block of an expandable segment (type `'e'`) exports the *pages* that cover it: the
//!   page-aligned range from the page holding its first byte to the page holding its last,
//!   one shareable handle per page, plus the block's offset from the range's start.
//!
//! Sharing changes nothing in the allocator: the block stays allocated as long as its
//! producer's storage lives. What keeps it alive after the producer lets go (the consumers'
//! reference counts, PyTorch's limbo) lives outside the allocator, in `gpumem::ipc`, and
//! gives blocks back through a [`super::FreeMemoryCallback`]. Snapshots and traces record
//! nothing IPC-specific, as PyTorch's do not.

use crate::device::{Device, DevicePtr};

use super::{AllocError, CachingAllocator};

/// What a consumer maps to reach a shared block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShareableHandle {
    /// Type `'c'`: the block's whole segment.
    Segment {
        /// The segment's base address (what `cudaIpcGetMemHandle` is given).
        base: DevicePtr,
        /// The segment's size: what a consumer maps.
        size: u64,
        /// The block's offset from `base`.
        offset: u64,
    },
    /// Type `'e'`: the pages of an expandable segment that cover the block.
    Pages {
        /// The first page's address.
        start: DevicePtr,
        /// The size of each page.
        page_size: u64,
        /// How many pages (one shareable handle each).
        pages: u64,
        /// The block's offset from `start`.
        offset: u64,
    },
}

impl ShareableHandle {
    /// PyTorch's type byte: `b'c'` or `b'e'`.
    pub fn type_byte(&self) -> u8 {
        match self {
            ShareableHandle::Segment { .. } => b'c',
            ShareableHandle::Pages { .. } => b'e',
        }
    }

    /// The block's offset from the start of the exported memory.
    pub fn offset(&self) -> u64 {
        match *self {
            ShareableHandle::Segment { offset, .. } | ShareableHandle::Pages { offset, .. } => {
                offset
            }
        }
    }

    /// The bytes a consumer maps when it opens the handle.
    pub fn mapped_bytes(&self) -> u64 {
        match *self {
            ShareableHandle::Segment { size, .. } => size,
            ShareableHandle::Pages {
                page_size, pages, ..
            } => page_size * pages,
        }
    }

    /// The address the exported memory starts at.
    pub fn start(&self) -> DevicePtr {
        match *self {
            ShareableHandle::Segment { base, .. } => base,
            ShareableHandle::Pages { start, .. } => start,
        }
    }
}

impl<D: Device> CachingAllocator<D> {
    /// The handle another process opens to reach the allocated block at `ptr`
    /// (`shareIpcHandle`): Note [IPC handles].
    ///
    /// # Errors
    /// [`AllocError::InvalidPointer`] when `ptr` is not the start of an allocated block.
    pub fn share_handle(&self, ptr: DevicePtr) -> Result<ShareableHandle, AllocError> {
        let id = self
            .live
            .get(ptr.0, &self.blocks)
            .ok_or(AllocError::InvalidPointer(ptr))?;
        let block = self.block(id);
        if let Some(segment) = block.expandable {
            let seg = &self.expandable_segments[segment.index()];
            let first = (block.ptr - seg.ptr) / seg.page_size;
            let end = (block.ptr + block.size - seg.ptr).div_ceil(seg.page_size);
            let start = seg.ptr + first * seg.page_size;
            return Ok(ShareableHandle::Pages {
                start: DevicePtr(start),
                page_size: seg.page_size,
                pages: end - first,
                offset: block.ptr - start,
            });
        }
        let mut head = id;
        while let Some(prev) = self.block(head).prev {
            head = prev;
        }
        let size = self.segment_blocks(head).map(|(_, b)| b.size).sum();
        let base = self.block(head).ptr;
        Ok(ShareableHandle::Segment {
            base: DevicePtr(base),
            size,
            offset: block.ptr - base,
        })
    }
}
