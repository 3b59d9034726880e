//! Helpers the test modules share (more move here as they are touched: issue 54).

pub(crate) mod traces;
