//! Optimizers over flat shards and learning-rate schedulers.

pub mod adam;
pub mod scheduler;
mod shard_update;
mod stream;

pub use shard_update::{adam_apply, adam_update, Moments, ShardPlace, UpdateError};
