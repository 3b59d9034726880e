//! The allocator's errors. An out-of-memory error carries the figures PyTorch's message
//! reports and the breakdown `gpumem explain` gives (`ext/breakdown.rs`), computed from the
//! allocator's blocks only when the allocation has failed, so that a caller (or an operator
//! reading a log) can tell fragmentation from a full device.
//!
//! # Invariants
//! - An out-of-memory error is built only after the attempt was recorded: an `oom` trace entry
//!   whose `addr` holds the driver's free bytes, and `num_ooms`; or, for a request refused
//!   at the memory fraction (`throw_on_cudamalloc_oom`), `num_oom_rejections` alone.

use std::fmt;

use crate::config::ConfigError;
use crate::device::{Device, DeviceError, DevicePtr, StreamId};

use super::breakdown::{Accounting, Kind, Request};
use super::size::{PoolKind, format_size};
use super::{CachingAllocator, PoolSlot, TraceAction};

/// Why an allocation failed with out-of-memory, with the figures that explain it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutOfMemory {
    /// Device index.
    pub device: u32,
    /// What the allocator tried to obtain: the segment size for the request.
    pub tried_to_allocate: u64,
    /// Device memory in total.
    pub total: u64,
    /// Device memory the driver reported free.
    pub free: u64,
    /// The per-process limit, when a memory fraction is set.
    pub allowed: Option<u64>,
    /// Bytes in allocated blocks, plus the cached free bytes of private pools (as PyTorch
    /// counts them: no default-pool request can use those).
    pub allocated: u64,
    /// Of `allocated`, the cached free bytes of private pools (CUDA graphs, MemPools).
    pub private_pools: u64,
    /// Bytes reserved from the driver but not allocated, outside private pools' cache.
    pub reserved_unallocated: u64,
    /// Where the device's memory was when the allocation failed, and what the request could
    /// have used of it.
    pub accounting: Accounting,
    /// Which part kept the request from fitting, most to blame first.
    pub kinds: Vec<Kind>,
    /// The explanation in one sentence.
    pub why: String,
    /// Refused at the memory fraction before the driver was asked
    /// (`throw_on_cudamalloc_oom`), the rest of the retry chain skipped.
    pub rejected: bool,
}

impl fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.rejected {
            write!(
                f,
                "CUDA out of memory, refused before the driver was asked: the request would pass \
                 the per-process memory fraction (throw_on_cudamalloc_oom:True; set it False to \
                 retry through the cache instead). "
            )?;
        }
        write!(
            f,
            "CUDA out of memory. Tried to allocate {}. GPU {} has a total capacity of {} of which {} is free. ",
            format_size(self.tried_to_allocate),
            self.device,
            format_size(self.total),
            format_size(self.free),
        )?;
        if let Some(allowed) = self.allowed {
            write!(f, "{} allowed; ", format_size(allowed))?;
        }
        write!(
            f,
            "Of the allocated memory {} is allocated by PyTorch, ",
            format_size(self.allocated)
        )?;
        if self.private_pools > 0 {
            write!(
                f,
                "with {} allocated in private pools (e.g., CUDA Graphs), ",
                format_size(self.private_pools)
            )?;
        }
        write!(
            f,
            "and {} is reserved by PyTorch but unallocated. \
             When reserved but unallocated memory is large, fragmentation is the likely cause: \
             set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to let segments grow instead \
             (or max_split_size_mb to stop large cached blocks from being split). \
             See the Memory Management section of the CUDA semantics documentation \
             (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
            format_size(self.reserved_unallocated),
        )?;
        write!(f, ". Why: {}", self.why)
    }
}

/// An allocator operation that failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum AllocError {
    /// No memory for the request after every recovery step.
    #[error("{0}")]
    OutOfMemory(Box<OutOfMemory>),
    /// A request no device could hold (1 EiB or more).
    #[error("CUDA out of memory. Tried to allocate more than 1EB memory ({0} bytes requested)")]
    TooLarge(u64),
    /// A pointer this allocator did not hand out, or already freed.
    #[error("invalid device pointer: {0:?}")]
    InvalidPointer(DevicePtr),
    /// A memory fraction outside `[0, 1]`.
    #[error("invalid memory fraction {}: it must be between 0 and 1", short(*.0))]
    InvalidFraction(f64),
    /// A segment layout to restore that cannot exist.
    #[error("invalid segment layout: {0}")]
    InvalidLayout(String),
    /// The device placed a segment beyond the addresses the allocator orders (2^49).
    #[error(
        "the device placed a segment of {size} bytes at {ptr:#x}, beyond the 512 TiB of addresses the allocator orders; it was given back"
    )]
    BeyondAddressBound {
        /// Where the segment started.
        ptr: u64,
        /// Its size.
        size: u64,
    },
    /// So many blocks are live that the best-fit order's counters cannot number another
    /// segment (`fit_order.rs`).
    #[error("{0} live blocks fill the best-fit order's counters: no segment can be added")]
    TooManySegments(usize),
    /// A rejected configuration string.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A placement plan that cannot be followed.
    #[error(transparent)]
    Plan(#[from] super::PlanError),
    /// A private pool operation refused.
    #[error(transparent)]
    Pool(#[from] super::PoolError),
    /// The driver failed with something other than out-of-memory.
    #[error("device error: {0}")]
    Device(#[from] DeviceError),
    /// Mapping the pages a request needs would take their host-memory bookkeeping past the
    /// page budget (`CachingAllocator::set_page_budget`); nothing was mapped.
    #[error(
        "mapping {pages} pages would take their bookkeeping past its host-memory budget of {budget} bytes"
    )]
    HostMemory {
        /// Pages the map needed.
        pages: u64,
        /// The page budget.
        budget: u64,
    },
}

impl AllocError {
    /// Whether this is an out-of-memory failure (of either kind).
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, AllocError::OutOfMemory(_) | AllocError::TooLarge(_))
    }
}

/// A number short enough for a message: 1e300 as `1e300`, not its 301 digits.
fn short(x: f64) -> String {
    if x.is_finite() && (x == 0.0 || (1e-4..1e6).contains(&x.abs())) {
        format!("{x}")
    } else {
        format!("{x:e}")
    }
}

impl<D: Device> CachingAllocator<D> {
    /// The out-of-memory error, after recording it (trace entry, `num_ooms`).
    pub(super) fn out_of_memory(
        &mut self,
        rounded: u64,
        segment_size: u64,
        stream: StreamId,
        owner: PoolSlot,
    ) -> Result<AllocError, AllocError> {
        self.failure(rounded, segment_size, stream, owner, false)
    }

    /// The error of a request refused at the memory fraction (`throw_on_cudamalloc_oom`),
    /// counted in `num_oom_rejections` only.
    pub(super) fn rejection(
        &mut self,
        rounded: u64,
        segment_size: u64,
        stream: StreamId,
        owner: PoolSlot,
    ) -> Result<AllocError, AllocError> {
        self.failure(rounded, segment_size, stream, owner, true)
    }

    fn failure(
        &mut self,
        rounded: u64,
        segment_size: u64,
        stream: StreamId,
        owner: PoolSlot,
        rejected: bool,
    ) -> Result<AllocError, AllocError> {
        let info = self.device.mem_get_info()?;
        if rejected {
            self.stats.num_oom_rejections.bump();
        } else {
            self.record(TraceAction::Oom, info.free, rounded, stream, owner);
            self.stats.num_ooms.bump();
        }
        let private_pools: u64 = self
            .all_pools()
            .filter(|(pool, _)| !pool.owner.is_default())
            .flat_map(|(_, p)| p.free.iter())
            .map(|(_, e)| e.size)
            .sum();
        let allocated = self.stats.allocated_bytes.all_current().max(0) as u64 + private_pools;
        let reserved = self.stats.reserved_bytes.all_current().max(0) as u64;
        // Only now, on the failure path: the blocks as they are after the flush.
        let request = Request {
            rounded,
            pool: PoolKind::for_size(rounded),
            stream,
        };
        let mut accounting = Accounting::default();
        for run in self.mapped_runs() {
            let (stream, pool) = (run[0].stream, run[0].pool);
            let blocks = run
                .iter()
                .map(|b| (b.size, b.requested_size, b.snapshot_state()));
            // A default request searched the cached blocks of `use_on_oom` pools too.
            let usable = run[0].owner == owner
                || (owner.is_default()
                    && !run[0].owner.is_default()
                    && self.private.get(run[0].owner).options.use_on_oom);
            accounting.add_segment(request, stream, pool, usable, blocks);
        }
        // The limit of a memory fraction is the job's device.
        let total = self
            .allowed_memory_maximum
            .unwrap_or(info.total)
            .min(info.total);
        let (kinds, why) = accounting.blame(request, info.free, total);
        Ok(AllocError::OutOfMemory(Box::new(OutOfMemory {
            device: self.device.index(),
            tried_to_allocate: segment_size,
            total: info.total,
            free: info.free,
            allowed: self.allowed_memory_maximum,
            allocated,
            private_pools,
            reserved_unallocated: reserved.saturating_sub(allocated),
            accounting,
            kinds,
            why,
            rejected,
        })))
    }
}
