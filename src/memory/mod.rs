//! Memory: the byte accountant, what a rank holds now and at its peak, by kind. It sits below the
//! engine (`zero` charges every allocation to it); the planner, which predicts the same bytes before
//! a run, lives above the engine in [`crate::planner`].

pub mod accounting;
mod reuse;

pub use reuse::{BlockCache, ReuseAlloc, ReuseStats, REUSE_MIN_BYTES};
