//! What a job's push says of its out-of-memory error, and the explanation the agent makes of
//! it with the same accounting as `gpumem explain` and gpumem's own OOM error.
//!
//! The hook's out-of-memory observer gets, from PyTorch, the device, the size it tried to
//! obtain (the segment size of the request), the device's total (the limit of a memory
//! fraction, where one is set) and its free bytes; the hook adds the failing thread's current
//! stream and, from the memory snapshot it takes at the error, each pool's figures per
//! stream:
//!
//! ```json
//! "oom": {"size": 2147483648, "stream": 0, "device_total": 85899345920,
//!         "device_free": 268435456,
//!         "pools": [{"pool": "large", "stream": 0, "allocated": 1024, "requested": 1000,
//!                    "pending_free": 0, "free": 512, "largest_free": 512,
//!                    "segments_with_free": 1}]}
//! ```
//!
//! An entry with `"private": true` holds the segments of private pools (CUDA graphs,
//! MemPools) of its pool kind and stream: the request, a default pool's as far as the hook
//! knows, could not use their free bytes.
//!
//! The request's pool follows from the segment size (2 MiB segments serve the small pool), and
//! the request counts as that size: up to 2 MiB more than the rounded request of a large
//! allocation (19 MiB for one of 1 to 10 MiB), so the verdict errs only at that margin.
//!
//! # Invariants (budgets)
//! - At most [`MAX_POOLS`] (pool, stream, private) entries, each listed once; every byte figure below
//!   2^60 and the reserved memory they add up to too, so the sums cannot overflow; requested
//!   at most allocated, the largest free block at most the free bytes, segments with free
//!   bytes only where there are free bytes and at most 2^53; the pools reserve at most the
//!   device's total.
//! - Figures in which the request's own pool has a free block it would have taken (at least
//!   its size, and below `max_split_size` where the device's statistics set one) are not
//!   explained: the push is kept, its OOM counted, without a breakdown that would name a
//!   free block larger than the request as the cause.
//! - The breakdown adds up to the device's total as the observer gave it (free is capped at
//!   what the reserved memory leaves of it, as in the core's own OOM error).

use serde::Deserialize;

use super::limits::{MAX_BYTES, MAX_COUNT, MAX_POOLS};
use super::refusal::{Rejected, invalid};
use crate::allocator::breakdown::{Accounting, PoolFigures, Request};
use crate::allocator::size::{MIN_BLOCK_SIZE, PoolKind, SMALL_BUFFER};
use crate::device::StreamId;
use crate::sources::LastOom;

/// The `oom` object of a pushed device.
#[derive(Deserialize)]
pub(crate) struct PushedOom {
    size: u64,
    #[serde(default)]
    stream: StreamId,
    device_total: u64,
    device_free: u64,
    pools: Vec<PushedPool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PushedPool {
    /// `"small"` or `"large"`, read here rather than by serde so that a refusal quotes at
    /// most 64 characters of what was sent.
    pool: String,
    stream: StreamId,
    allocated: u64,
    requested: u64,
    pending_free: u64,
    free: u64,
    largest_free: u64,
    segments_with_free: u64,
    /// Segments of private pools (CUDA graphs, MemPools), which the request (a default
    /// pool's, as far as the hook knows) could not use.
    #[serde(default)]
    private: bool,
}

/// The explanation of device `index`'s OOM, or why its figures are refused; `None` where they
/// do not explain it (a free block the request would have taken: the hook's guess of the
/// request's stream was wrong, say, as for a collective's allocation on its own stream).
/// `max_split_size` is the device's statistic of that name, where it gave one (-1: no limit).
pub(crate) fn explain(
    index: u32,
    oom: &PushedOom,
    max_split_size: Option<i64>,
) -> Result<Option<LastOom>, Rejected> {
    let at = |message: String| invalid(format!("device {index}: oom: {message}"));
    let bytes = |name: &str, v: u64| {
        if v < MAX_BYTES as u64 {
            Ok(v)
        } else {
            Err(at(format!("{name} {v} is not below 2^60")))
        }
    };
    bytes("size", oom.size)?;
    bytes("device_total", oom.device_total)?;
    bytes("device_free", oom.device_free)?;
    if oom.pools.len() > MAX_POOLS {
        return Err(at(format!("pools lists at most {MAX_POOLS} entries")));
    }
    let request = Request {
        rounded: oom.size,
        pool: if oom.size <= SMALL_BUFFER {
            PoolKind::Small
        } else {
            PoolKind::Large
        },
        stream: oom.stream,
    };
    let mut accounting = Accounting::default();
    let mut seen: Vec<(PoolKind, StreamId, bool)> = Vec::with_capacity(oom.pools.len());
    let mut explained = true;
    for p in &oom.pools {
        let pool = match p.pool.as_str() {
            "small" => PoolKind::Small,
            "large" => PoolKind::Large,
            other => {
                return Err(at(format!(
                    "pool must be \"small\" or \"large\", not {:?}",
                    other.chars().take(64).collect::<String>()
                )));
            }
        };
        if seen.contains(&(pool, p.stream, p.private)) {
            return Err(at(format!(
                "the {}{pool} pool of stream {} is listed twice",
                if p.private { "private " } else { "" },
                p.stream
            )));
        }
        seen.push((pool, p.stream, p.private));
        for (name, v) in [
            ("allocated", p.allocated),
            ("requested", p.requested),
            ("pending_free", p.pending_free),
            ("free", p.free),
            ("largest_free", p.largest_free),
        ] {
            bytes(name, v)?;
        }
        if p.requested > p.allocated || p.largest_free > p.free {
            return Err(at(format!(
                "the {pool} pool of stream {}: requested exceeds allocated or largest_free exceeds free",
                p.stream
            )));
        }
        // Each segment with free memory holds a free block of at least 512 bytes.
        if p.segments_with_free >= MAX_COUNT as u64
            || (p.segments_with_free == 0) != (p.free == 0)
            || p.segments_with_free > p.free / MIN_BLOCK_SIZE
        {
            return Err(at(format!(
                "the {pool} pool of stream {}: {} segments with free bytes for {} free bytes",
                p.stream, p.segments_with_free, p.free
            )));
        }
        // A free block at least the request's segment size in the request's own pool would
        // have served it, unless max_split_size keeps blocks of its size whole (leniently:
        // a request at or above max_split_size also refuses blocks 20 MiB larger than it,
        // and the request's exact size is not pushed).
        let own = pool == request.pool && p.stream == request.stream && !p.private;
        let kept_whole = max_split_size
            .and_then(|m| u64::try_from(m).ok())
            .is_some_and(|m| p.largest_free >= m);
        if own && p.largest_free >= oom.size && !kept_whole {
            explained = false;
        }
        let reserved = accounting.reserved + p.allocated + p.pending_free + p.free;
        bytes("the reserved memory", reserved)?;
        accounting.add(
            request,
            p.stream,
            pool,
            !p.private,
            &PoolFigures {
                allocated: p.allocated,
                requested: p.requested,
                pending_free: p.pending_free,
                free: p.free,
                largest_free: p.largest_free,
                segments_with_free: usize::try_from(p.segments_with_free).unwrap_or(usize::MAX),
            },
        );
    }
    let total = oom.device_total;
    if accounting.reserved > total {
        return Err(at(format!(
            "the pools reserve {} bytes, more than the device's {total}",
            accounting.reserved
        )));
    }
    if !explained {
        return Ok(None);
    }
    let (kinds, why) = accounting.blame(request, oom.device_free, total);
    Ok(Some(LastOom {
        breakdown: accounting.breakdown,
        kind: kinds[0],
        why,
        // The push says when: `AllocatorSource::last_oom_unix_seconds`.
        at_unix_seconds: None,
    }))
}
