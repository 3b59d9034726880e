//! gpumem's additions to PyTorch's design, kept apart from the port (as offset-allocator
//! keeps its extensions in `ext.rs`), so that the files beside this folder read against
//! `CUDACachingAllocator.cpp`:
//!
//! - [`plan`]: following a placement plan (Note [Planned placement]); the port meets it only
//!   where a block says it is held by the plan (`Block::held`) and at `malloc`'s first step;
//! - [`restore`]: recreating a segment as a recording left it (replay's mid-run start);
//! - [`breakdown`]: where a device's memory is at an out-of-memory error (`Accounting`).

pub mod breakdown;
pub(super) mod plan;
pub(super) mod restore;
