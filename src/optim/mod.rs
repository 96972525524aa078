//! Optimizers over flat shards and learning-rate schedulers.

pub mod adam;
pub mod kernels;
pub mod scheduler;
mod stream;
