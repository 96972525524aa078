//! The ZeRO engine: flat buffers, partitions, stages 0-3.
//!
//! * [`unit`](mod@unit): the contract a model implements to be trained: units, parameters, batches.
//! * [`engine_config`]: [`EngineConfig`], a plain struct (the CLI maps DeepSpeed settings onto it).
//! * [`layout`]: per-unit flat buffers padded into equal aligned shards (rank r owns shard r).
//! * [`schedule`]: the static visit order of a step and when tied gradients are complete.
//! * [`buffers`]: the sizing rules of every buffer, one pure function shared with the planner.
//! * [`state`]: what a rank keeps of the model (parameters, gradients), one variant per stage.
//! * [`buckets`]: bucketed all-reduce (stage 0), true reduce-scatter (stages 1-3) and the
//!   post-step all-gather (stages 1-2).
//! * [`quantize`] and `qgz`: ZeRO++'s int8 payloads, for the weights' gathers (qwZ) and the
//!   gradients' two all-to-alls within and across hosts (qgZ).
//! * [`gather`]: the stage-3 fetch/prefetch/release coordinator and its bounded pool.
//! * [`shards`]: where a stage-3 rank keeps its parameter shards: memory or an NVMe swap file.
//! * [`device_tier`]: the device tier held in a model's device memory (a GPU's), and when a run
//!   can use it.
//! * [`engine`]: one rank's [`Engine`] and its [`StepReport`].
//! * [`loss_scaler`]: fp16 loss scaling and the Inf/NaN guard.
//! * [`step_policy`]: the per-step overflow policy (loss scale or non-finite guard).

pub mod buckets;
pub mod buffers;
pub mod device_tier;
pub mod engine;
pub mod engine_config;
pub mod gather;
pub mod layout;
pub mod loss_scaler;
mod qgz;
pub mod quantize;
pub mod schedule;
pub mod shards;
pub mod state;
pub mod step_policy;
pub mod unit;

pub use device_tier::{DeviceTier, TierDtypes, UnitUpload, UnitValues};
pub use engine::{
    check_device_budget, device_peak, moment_stream_bytes, offloaded_share, param_staging_bytes,
    resident_param_bytes, stream_buffer_bytes, Engine, EngineCounters, EngineError, EvalLoss,
    PhaseTimes, StepReport, UnitOptimizerState,
};
pub use engine_config::{EngineConfig, OptimizerTier, ParamTier, Stage};
pub use unit::{
    BatchCounts, ForwardMode, ModelError, ModelSpec, ParamSpec, UnitForward, UnitModel, UnitSpec,
};
