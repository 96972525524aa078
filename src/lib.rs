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
//! * [`zero::unit`]: the contract between the engine and a model ([`zero::UnitModel`]).
//! * [`model`]: the candle helper that makes any candle model a `UnitModel`
//!   ([`model::CandleUnits`], [`model::Candle`]), a GPT reference model on it, and data loading.
//! * [`trainer`]: the [`trainer::Trainer`] that runs a `UnitModel` on in-process ranks.
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
