//! What the self-planning tests share: waiting for device 0's planner, and comparing the
//! job's peaks with the offline plan's and the caching allocator's.

use std::time::Instant;

use gpumem::allocator::PLAN_PAGE;
use gpumem_torch::{memory_stats, self_planning};

/// Waits (until `deadline`, then fails) while device 0's planner runs; whether the job has
/// settled (follows its plan, or reported running without one).
pub fn settle(deadline: Instant) -> bool {
    while self_planning(0) == Some("planning") {
        assert!(Instant::now() < deadline, "the planner took too long");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    self_planning(0) == Some("settled")
}

/// Device 0's peak (allocated, reserved) bytes since they were last reset.
pub fn peaks() -> (i64, i64) {
    let stats = memory_stats(0).expect("device 0 open");
    (
        stats["allocated_bytes.all.peak"],
        stats["reserved_bytes.all.peak"],
    )
}

/// The job that planned itself reserves at most a page (one stream) more than the offline
/// plan, which reserves less than the caching allocator.
pub fn assert_reaches(own: (i64, i64), offline: (i64, i64), caching: (i64, i64)) {
    assert!(
        own.1 <= offline.1 + PLAN_PAGE as i64,
        "self-planned {} bytes, offline {} (one stream: one page allowed)",
        own.1,
        offline.1
    );
    assert!(
        offline.1 < caching.1,
        "the plan holds less than the caching allocator"
    );
}
