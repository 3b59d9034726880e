//! gpumem's integration tests: one binary, sharing helpers.

mod common;
mod scenarios;
