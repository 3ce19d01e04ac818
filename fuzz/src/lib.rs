//! The fuzz targets' bodies (`bodies`) and what they and the corpus generator share.

pub mod bodies;

pub use bodies::common::{chunks, small_limits};
