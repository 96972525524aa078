//! Optimizers over flat shards and learning-rate schedulers.

pub mod adam;
pub mod scheduler;
pub mod slices;
mod stream;
