//! The one mapping from a resolved DeepSpeed config ([`Settings`]) to the engine's configuration
//! ([`EngineConfig`]).
//!
//! `zerodp train`, `zerodp bench train`, the pre-flight check, the planner and library users all
//! come through [`engine_config`], so a key means the same thing everywhere. DeepSpeed's defaults
//! are not written here: the config reader resolves every key (a config's value or DeepSpeed's
//! default, [`crate::config::defaults`]) before this mapping sees it.
//!
//! Layering: this module sits above `config` and `zero` and below the trainer and the planner; it
//! is the only place that knows both the config's and the engine's vocabulary.

use crate::config::{OffloadDevice, Precision, Settings};
use crate::flat::DType;
use crate::optim::adam::AdamParams;
use crate::zero::loss_scaler::DynamicScaleParams;
use crate::zero::step_policy::OverflowPolicy;
use crate::zero::{EngineConfig, OptimizerTier, ParamTier, Stage};

/// A resolved config asks for something the engine does not do.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SetupError {
    #[error("zero_optimization.stage is {0}; use 0, 1, 2 or 3")]
    Stage(u8),
    #[error(
        "fp16.fp16_master_weights_and_grads is not supported: zerodp keeps fp32 master weights; \
         remove the key or set it to false"
    )]
    Fp16MasterWeights,
    #[error("world size must be at least 1")]
    WorldSize,
}

/// `offload_optimizer` as the engine's tier: none at stage 0 (DeepSpeed ignores it there, and the
/// config reader warns); NVMe streams `sub_group_size` elements at a time, at most
/// [`crate::offload::MAX_STREAM_CHUNK`], through `offload_optimizer.buffer_count` buffers.
fn optimizer_tier(s: &Settings, stage: Stage) -> OptimizerTier {
    let z = &s.zero_optimization;
    match (z.offload_optimizer.device, &z.offload_optimizer.nvme_path) {
        _ if stage == Stage::Zero0 => OptimizerTier::Device,
        (OffloadDevice::None, _) => OptimizerTier::Device,
        (OffloadDevice::Cpu, _) | (OffloadDevice::Nvme, None) => OptimizerTier::Host,
        (OffloadDevice::Nvme, Some(dir)) => OptimizerTier::Nvme {
            dir: dir.clone(),
            chunk: usize_of(z.sub_group_size).clamp(1, crate::offload::MAX_STREAM_CHUNK),
            buffer_count: usize_of(z.offload_optimizer.buffer_count),
        },
    }
}

/// `offload_param` as the engine's tier (stage 3 only; DeepSpeed ignores it below, and the config
/// reader warns): NVMe reads shards through `offload_param.buffer_count` staging buffers of at
/// most `buffer_size` elements.
fn param_tier(s: &Settings) -> ParamTier {
    let p = &s.zero_optimization.offload_param;
    match (p.device, &p.nvme_path) {
        (OffloadDevice::None, _) => ParamTier::Device,
        (OffloadDevice::Cpu, _) | (OffloadDevice::Nvme, None) => ParamTier::Host,
        (OffloadDevice::Nvme, Some(dir)) => ParamTier::Nvme {
            dir: dir.clone(),
            buffer_count: usize_of(p.buffer_count),
            buffer_size: usize_of(p.buffer_size),
            max_in_cpu: usize_of(p.max_in_cpu),
        },
    }
}

/// The engine's configuration for `world_size` ranks from resolved settings; `seed` seeds the
/// parameter initialisation. Features the engine does not have yet are refused with a way out
/// rather than silently ignored.
pub fn engine_config(
    s: &Settings,
    world_size: usize,
    seed: u64,
) -> Result<EngineConfig, SetupError> {
    let z = &s.zero_optimization;
    let stage = Stage::from_index(z.stage).ok_or(SetupError::Stage(z.stage))?;
    if world_size == 0 {
        return Err(SetupError::WorldSize);
    }
    if s.fp16.fp16_master_weights_and_grads {
        return Err(SetupError::Fp16MasterWeights);
    }
    let mut cfg = EngineConfig::new(stage, world_size);
    cfg.offload_optimizer = optimizer_tier(s, stage);
    if stage.shards_params() {
        cfg.offload_param = param_tier(s);
        // Partial offload is a stage-3 feature (the config reader refuses a ratio below 1 at
        // other stages); the planner, sizing a stage-3 config at other stages, offloads all.
        cfg.offload_ratio = z.offload_optimizer.ratio;
    }
    cfg.micro_batch = s.batch.micro_batch_per_gpu;
    cfg.grad_accum = s.batch.gradient_accumulation_steps;
    cfg.reduce_bucket_size = usize_of(z.reduce_bucket_size);
    cfg.overlap_comm = z.overlap_comm;
    cfg.gradient_clipping = s.gradient_clipping as f32;
    cfg.prefetch_bucket_size = usize_of(z.prefetch_bucket_size);
    cfg.param_persistence_threshold = usize_of(z.param_persistence_threshold);
    cfg.max_live_parameters = usize_of(z.max_live_parameters);
    cfg.max_reuse_distance = usize_of(z.max_reuse_distance);
    cfg.hpz_partition_size = usize_of(z.zero_hpz_partition_size).max(1);
    cfg.quantized_weights = stage.shards_params() && z.zero_quantized_weights;
    cfg.quantized_gradients = stage.shards_params() && z.zero_quantized_gradients;
    let ac = &s.activation_checkpointing;
    cfg.activation_checkpointing = ac.number_checkpoints.is_some()
        || ac.partition_activations
        || ac.cpu_checkpointing
        || ac.contiguous_memory_optimization;
    if let Some(o) = &s.optimizer {
        cfg.adam = AdamParams {
            lr: o.lr,
            beta1: o.betas[0],
            beta2: o.betas[1],
            eps: o.eps,
            weight_decay: o.weight_decay,
            adam_w_mode: o.adam_w_mode,
            bias_correction: o.bias_correction,
        };
    }
    cfg.seed = seed;
    cfg.param_dtype = dtype_of(s.precision);
    cfg.comm_dtype = dtype_of(s.communication_data_type);
    cfg.grad_accum_dtype = dtype_of(s.grad_accum_dtype);
    cfg.overflow = overflow_policy(s);
    cfg.device_budget = s.zerodp.device_memory;
    cfg.optimizer_states_dtype = match s.zerodp.optimizer_states_dtype {
        Some(p) => dtype_of(p),
        None if s.precision == Precision::Bf16 && s.bf16.bf16_optimizer_states => DType::BF16,
        None => DType::F32,
    };
    // Only in bf16 runs (DeepSpeed reads the key inside the bf16 block; the config reader warns
    // when the block is off).
    cfg.bf16_master_weights =
        s.precision == Precision::Bf16 && s.bf16.bf16_master_weights_and_grads;
    Ok(cfg)
}

/// fp16 loss scaling as the config's `fp16` block states it; the Inf/NaN guard alone otherwise.
fn overflow_policy(s: &Settings) -> OverflowPolicy {
    if s.precision != Precision::Fp16 {
        return OverflowPolicy::Guard;
    }
    let f = &s.fp16;
    OverflowPolicy::LossScale {
        loss_scale: f.loss_scale,
        dynamic: DynamicScaleParams {
            initial_scale_power: f.initial_scale_power,
            scale_window: f.loss_scale_window,
            hysteresis: u32::try_from(f.hysteresis).unwrap_or(u32::MAX),
            consecutive_hysteresis: f.consecutive_hysteresis,
            min_scale: f.min_loss_scale,
        },
    }
}

/// The engine's element type for a config precision.
pub fn dtype_of(p: Precision) -> DType {
    match p {
        Precision::Fp32 => DType::F32,
        Precision::Bf16 => DType::BF16,
        Precision::Fp16 => DType::F16,
    }
}

/// Sizes in the config are u64 (DeepSpeed's integers); the engine counts in usize.
fn usize_of(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}
