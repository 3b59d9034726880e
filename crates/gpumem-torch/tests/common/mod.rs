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

/// The job that planned itself reserves no more than the caching allocator, and at most 3 %
/// (and a page, for one stream) more than the offline plan (issue 57's limits).
pub fn assert_reaches(own: (i64, i64), offline: (i64, i64), caching: (i64, i64)) {
    assert!(
        own.1 <= caching.1,
        "self-planned {} bytes, the caching allocator {}",
        own.1,
        caching.1
    );
    assert!(
        own.1 as f64 <= offline.1 as f64 * 1.03 + PLAN_PAGE as f64,
        "self-planned {} bytes, offline {}",
        own.1,
        offline.1
    );
}
