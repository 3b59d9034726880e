//! gpumem's integration tests: one binary, sharing helpers.

mod common;
mod properties;
mod scenarios;
mod stress;
