//! zerodp: ZeRO (Zero Redundancy Optimizer) sharded data-parallel training.
//!
//! Modules follow the data flow of a training step:
//!
//! * [`config`]: a DeepSpeed JSON config in, validated settings out.
//! * [`comm`]: the [`comm::Communicator`] trait, its asynchronous handles, backends and traces.
//! * [`zero`]: flat buffers and partitions, the stage 0-3 logic, the stage-3 fetch/release
//!   coordinator, clipping.
//! * [`optim`]: Adam/AdamW kernels over flat shards and the learning-rate schedulers.
//! * [`memory`]: byte accounting per tier and kind, and the planner.
//! * [`model`]: the [`model::UnitModel`] trait the engine trains, a GPT reference model on candle,
//!   and data loading.
//!
//! The engine core (`zero`, `optim`, `comm`) works on flat `f32`/16-bit buffers and knows no tensor
//! library; only `model` uses candle.

pub mod comm;
pub mod config;
pub mod memory;
pub mod model;
pub mod optim;
pub mod setup;
pub mod trainer;
pub mod zero;
