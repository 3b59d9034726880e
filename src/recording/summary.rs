//! A recording's final state in a few lines: what the allocator held when it was dumped.

use std::fmt::Write;

use crate::allocator::BlockState;
use crate::allocator::size::{PoolKind, format_size};

use super::Recording;

/// Per device: segments by pool, blocks by state, reserved and allocated bytes, the largest
/// free block, and the segments in private pools or expandable segments.
pub fn state_summary(recording: &Recording) -> String {
    let mut devices: Vec<u32> = recording.segments.iter().map(|s| s.device).collect();
    devices.sort_unstable();
    devices.dedup();
    let mut out = String::new();
    if devices.is_empty() {
        out.push_str("no segments: the allocator held no memory\n");
    }
    for device in devices {
        let segments: Vec<_> = recording
            .segments
            .iter()
            .filter(|s| s.device == device)
            .collect();
        let small = segments
            .iter()
            .filter(|s| s.pool == PoolKind::Small)
            .count();
        let blocks = segments.iter().flat_map(|s| s.blocks.iter());
        let (mut allocated, mut pending, mut inactive) = (0u64, 0u64, 0u64);
        let (mut allocated_bytes, mut pending_bytes, mut largest_free) = (0u64, 0u64, 0u64);
        for b in blocks {
            match b.state {
                BlockState::ActiveAllocated => {
                    allocated += 1;
                    allocated_bytes += b.size;
                }
                BlockState::ActivePendingFree => {
                    pending += 1;
                    pending_bytes += b.size;
                }
                BlockState::Inactive => {
                    inactive += 1;
                    largest_free = largest_free.max(b.size);
                }
            }
        }
        let reserved: u64 = segments.iter().map(|s| s.total_size).sum();
        let private = segments.iter().filter(|s| !s.pool_id.is_default()).count();
        let expandable = segments.iter().filter(|s| s.is_expandable).count();
        let _ = writeln!(
            out,
            "device {device}: {} segments ({} large, {small} small{}{}), reserved {}, allocated {}",
            segments.len(),
            segments.len() - small,
            if private > 0 {
                format!(", {private} in private pools")
            } else {
                String::new()
            },
            if expandable > 0 {
                format!(", {expandable} expandable")
            } else {
                String::new()
            },
            format_size(reserved),
            format_size(allocated_bytes),
        );
        let _ = writeln!(
            out,
            "  blocks: {allocated} allocated, {pending} pending free ({}), {inactive} inactive; \
             reserved but unallocated {}; largest free block {}",
            format_size(pending_bytes),
            format_size(reserved.saturating_sub(allocated_bytes + pending_bytes)),
            format_size(largest_free),
        );
    }
    let traced: Vec<String> = recording
        .device_traces
        .iter()
        .enumerate()
        .filter(|(_, t)| !t.is_empty())
        .map(|(d, t)| format!("device {d}: {} events", t.len()))
        .collect();
    if traced.is_empty() {
        out.push_str("no trace recorded\n");
    } else {
        let _ = writeln!(out, "trace: {}", traced.join(", "));
    }
    out
}
