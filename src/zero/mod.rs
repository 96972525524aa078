//! The ZeRO engine: flat buffers, partitions, stages 0-3.

pub mod buckets;
pub mod buffers;
pub mod config;
pub mod engine;
pub mod flat;
pub mod gather;
pub mod loss_scaler;
pub mod schedule;

pub use config::{EngineConfig, Stage};
pub use engine::{Engine, EngineError, PhaseTimes, StepReport};
