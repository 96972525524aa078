//! The validated, typed settings a DeepSpeed config resolves to. Field names follow the
//! DeepSpeed keys so that `config check --format json` reads like the input. Defaults are
//! DeepSpeed's *code* defaults; where its documentation says otherwise the field says so.

use std::path::PathBuf;

use serde::Serialize;

use super::defaults;

/// The dtype of model weights and activations during compute (also used for the communication
/// and gradient-accumulation dtypes, which take the same three values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    Fp32,
    Fp16,
    Bf16,
}

impl Precision {
    pub fn as_str(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
        }
    }
}

/// Where an offloaded tensor class lives. DeepSpeed's default is `none` (its docs say `cpu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OffloadDevice {
    None,
    Cpu,
    Nvme,
}

impl OffloadDevice {
    pub fn as_str(self) -> &'static str {
        match self {
            OffloadDevice::None => "none",
            OffloadDevice::Cpu => "cpu",
            OffloadDevice::Nvme => "nvme",
        }
    }
}

/// `zero_optimization.offload_param` (DeepSpeedZeroOffloadParamConfig). Acts at stage 3 only.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OffloadParamSettings {
    pub device: OffloadDevice,
    pub nvme_path: Option<PathBuf>,
    /// Number of NVMe swap buffers. Default 5.
    pub buffer_count: u64,
    /// Size of each NVMe swap buffer in elements. Default 1e8.
    pub buffer_size: u64,
    /// Elements kept in CPU memory when offloading to NVMe. Default 1e9.
    pub max_in_cpu: u64,
    pub pin_memory: bool,
}

impl Default for OffloadParamSettings {
    fn default() -> Self {
        OffloadParamSettings {
            device: OffloadDevice::None,
            nvme_path: None,
            buffer_count: 5,
            buffer_size: 100_000_000,
            max_in_cpu: 1_000_000_000,
            pin_memory: false,
        }
    }
}

/// `zero_optimization.offload_optimizer` (DeepSpeedZeroOffloadOptimizerConfig). With `cpu` or
/// `nvme` the optimizer step runs on the CPU.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OffloadOptimizerSettings {
    pub device: OffloadDevice,
    pub nvme_path: Option<PathBuf>,
    /// NVMe swap buffers; at least the number of optimizer tensors per parameter. Default 4.
    pub buffer_count: u64,
    pub pin_memory: bool,
    pub pipeline_read: bool,
    pub pipeline_write: bool,
    pub fast_init: bool,
    /// Fraction of the optimizer offloaded, in [0, 1]; below 1 only at stage 3. Default 1.0.
    pub ratio: f64,
}

impl Default for OffloadOptimizerSettings {
    fn default() -> Self {
        OffloadOptimizerSettings {
            device: OffloadDevice::None,
            nvme_path: None,
            buffer_count: 4,
            pin_memory: false,
            pipeline_read: false,
            pipeline_write: false,
            fast_init: false,
            ratio: 1.0,
        }
    }
}

/// LoCo-ZeRO++ parameters (accepted, not supported yet).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LocoSettings {
    pub err_beta: f64,
    #[serde(rename = "reset_T")]
    pub reset_t: u64,
}

/// `zero_optimization` (DeepSpeedZeroConfig). Stage-3 keys are stored under their unprefixed
/// names; the config may use either form.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ZeroSettings {
    /// 0 = plain data parallel, 1 = optimizer states sharded, 2 = + gradients, 3 = + parameters.
    pub stage: u8,
    pub contiguous_gradients: bool,
    pub reduce_scatter: bool,
    /// Gradient bucket size in elements. Default 5e8.
    pub reduce_bucket_size: u64,
    pub use_multi_rank_bucket_allreduce: bool,
    /// Accepted and stored; DeepSpeed never reads it either.
    pub allgather_partitions: bool,
    /// Default 5e8 elements.
    pub allgather_bucket_size: u64,
    /// Code default: true at stage 3, false otherwise (DeepSpeed's docs say false).
    pub overlap_comm: bool,
    pub load_from_fp32_weights: bool,
    pub elastic_checkpoint: bool,
    pub offload_param: OffloadParamSettings,
    pub offload_optimizer: OffloadOptimizerSettings,
    /// Stage-3 optimizer tile in elements. Default 1e9.
    pub sub_group_size: u64,
    /// Code default 5e7 (DeepSpeed's docs say 5e8). Alias `stage3_prefetch_bucket_size`.
    pub prefetch_bucket_size: u64,
    /// Default 1e5. Alias `stage3_param_persistence_threshold`.
    pub param_persistence_threshold: u64,
    /// Default sys.maxsize (2^63 - 1). Alias `stage3_model_persistence_threshold`.
    pub model_persistence_threshold: u64,
    /// Default 1e9. Alias `stage3_max_live_parameters`.
    pub max_live_parameters: u64,
    /// Default 1e9. Alias `stage3_max_reuse_distance`.
    pub max_reuse_distance: u64,
    /// Alias `stage3_gather_16bit_weights_on_model_save`; legacy
    /// `stage3_gather_fp16_weights_on_model_save`.
    pub gather_16bit_weights_on_model_save: bool,
    /// Alias `stage3_module_granularity_threshold`. Default 0.
    pub module_granularity_threshold: u64,
    /// Alias `stage3_use_all_reduce_for_fetch_params`.
    pub use_all_reduce_for_fetch_params: bool,
    pub ignore_unused_parameters: bool,
    pub round_robin_gradients: bool,
    /// ZeRO++ hpZ at stage 3: ranks per host holding a secondary partition of the parameters
    /// (`"auto"`: the launcher's ranks per host). Default 1, off.
    pub zero_hpz_partition_size: u64,
    /// ZeRO++ qwZ at stage 3: the parameters' all-gathers carry block-wise int8.
    pub zero_quantized_weights: bool,
    pub zero_quantized_nontrainable_weights: bool,
    /// ZeRO++ qgZ at stage 3: the gradients' reduce-scatter as int8 all-to-alls within and
    /// across hosts.
    pub zero_quantized_gradients: bool,
    pub zeropp_loco_param: Option<LocoSettings>,
    /// MiCS (not supported yet); enabled when > 0. Default -1.
    pub mics_shard_size: i64,
    pub mics_hierarchical_params_gather: bool,
    pub memory_efficient_linear: bool,
    pub pipeline_loading_checkpoint: bool,
    pub override_module_apply: bool,
    pub log_trace_cache_warnings: bool,
}

impl Default for ZeroSettings {
    fn default() -> Self {
        ZeroSettings {
            stage: 0,
            contiguous_gradients: true,
            reduce_scatter: true,
            reduce_bucket_size: defaults::REDUCE_BUCKET_SIZE,
            use_multi_rank_bucket_allreduce: true,
            allgather_partitions: true,
            allgather_bucket_size: defaults::REDUCE_BUCKET_SIZE,
            overlap_comm: defaults::overlap_comm(0),
            load_from_fp32_weights: true,
            elastic_checkpoint: false,
            offload_param: OffloadParamSettings::default(),
            offload_optimizer: OffloadOptimizerSettings::default(),
            sub_group_size: defaults::SUB_GROUP_SIZE,
            prefetch_bucket_size: defaults::PREFETCH_BUCKET_SIZE,
            param_persistence_threshold: defaults::PARAM_PERSISTENCE_THRESHOLD,
            model_persistence_threshold: i64::MAX as u64,
            max_live_parameters: defaults::MAX_LIVE_PARAMETERS,
            max_reuse_distance: defaults::MAX_REUSE_DISTANCE,
            gather_16bit_weights_on_model_save: false,
            module_granularity_threshold: 0,
            use_all_reduce_for_fetch_params: false,
            ignore_unused_parameters: true,
            round_robin_gradients: false,
            zero_hpz_partition_size: 1,
            zero_quantized_weights: false,
            zero_quantized_nontrainable_weights: false,
            zero_quantized_gradients: false,
            zeropp_loco_param: None,
            mics_shard_size: -1,
            mics_hierarchical_params_gather: false,
            memory_efficient_linear: true,
            pipeline_loading_checkpoint: false,
            override_module_apply: true,
            log_trace_cache_warnings: false,
        }
    }
}

/// The three batch numbers after DeepSpeed's arithmetic:
/// `train_batch_size = micro_batch_per_gpu * gradient_accumulation_steps * world_size`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BatchSettings {
    pub train_batch_size: usize,
    #[serde(rename = "train_micro_batch_size_per_gpu")]
    pub micro_batch_per_gpu: usize,
    pub gradient_accumulation_steps: usize,
    /// The data-parallel world size the numbers were resolved for.
    pub world_size: usize,
}

/// `fp16`. Dynamic loss scaling when `loss_scale` is 0.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Fp16Settings {
    pub enabled: bool,
    pub auto_cast: bool,
    /// 0 = dynamic scaling; otherwise a static scale.
    pub loss_scale: f64,
    /// The dynamic scaler starts at 2^initial_scale_power. Default 16.
    pub initial_scale_power: u32,
    /// Overflow-free steps before the scale doubles. Default 1000.
    pub loss_scale_window: u64,
    /// Overflows tolerated before the scale halves. Default 2.
    pub hysteresis: u64,
    pub consecutive_hysteresis: bool,
    /// Default 1.
    pub min_loss_scale: f64,
    pub fp16_master_weights_and_grads: bool,
    /// Whether any of the five dynamic-scaler keys was given. DeepSpeed's ZeRO optimizers fall
    /// back to 2^32 and hysteresis 1 when none is (a warning says so); zerodp uses the values
    /// above either way.
    pub dynamic_args_given: bool,
}

impl Default for Fp16Settings {
    fn default() -> Self {
        Fp16Settings {
            enabled: false,
            auto_cast: false,
            loss_scale: 0.0,
            initial_scale_power: 16,
            loss_scale_window: 1000,
            hysteresis: 2,
            consecutive_hysteresis: false,
            min_loss_scale: 1.0,
            fp16_master_weights_and_grads: false,
            dynamic_args_given: false,
        }
    }
}

impl Fp16Settings {
    pub fn is_dynamic(&self) -> bool {
        self.loss_scale == 0.0
    }

    /// The first loss scale: 2^initial_scale_power when dynamic, else the static scale.
    pub fn initial_scale(&self) -> f64 {
        if self.is_dynamic() {
            2f64.powi(self.initial_scale_power as i32)
        } else {
            self.loss_scale
        }
    }
}

/// `bf16` (legacy name `bfloat16`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Bf16Settings {
    pub enabled: bool,
    pub immediate_grad_update: bool,
    /// Adam's m and v in bf16 (DeepSpeed's `bf16.bf16_optimizer_states`).
    pub bf16_optimizer_states: bool,
    /// No fp32 master: the bf16 parameters are updated in place, rounded stochastically
    /// (DeepSpeed's `bf16.bf16_master_weights_and_grads`; the gradients are bf16 as in any bf16
    /// run past stage 0).
    pub bf16_master_weights_and_grads: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum OptimizerKind {
    Adam,
    AdamW,
}

/// `optimizer` with type Adam or AdamW (DeepSpeed's FusedAdam / DeepSpeedCPUAdam parameters).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OptimizerSettings {
    #[serde(rename = "type")]
    pub kind: OptimizerKind,
    pub lr: f64,
    pub betas: [f64; 2],
    pub eps: f64,
    pub weight_decay: f64,
    /// Decoupled weight decay. Effective value: always true for AdamW; for Adam DeepSpeed's
    /// default is true, so `"type": "Adam"` is AdamW unless `adam_w_mode` is false.
    pub adam_w_mode: bool,
    pub bias_correction: bool,
}

impl Default for OptimizerSettings {
    /// DeepSpeed's FusedAdam defaults, as AdamW.
    fn default() -> Self {
        OptimizerSettings {
            kind: OptimizerKind::AdamW,
            lr: 1e-3,
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.0,
            adam_w_mode: true,
            bias_correction: true,
        }
    }
}

/// How warmup rises from its minimum to its maximum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WarmupType {
    /// `min + (max - min) * ln(i + 1) / ln(warmup_num_steps)`: DeepSpeed's default.
    Log,
    /// `min + (max - min) * i / warmup_num_steps`.
    Linear,
}

/// `scheduler`, with DeepSpeed's parameter names and code defaults
/// (deepspeed/runtime/lr_schedules.py). See [`crate::optim::scheduler`] for the values per step.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", content = "params")]
pub enum SchedulerSettings {
    WarmupLR {
        warmup_min_lr: f64,
        /// None = the optimizer's lr (current DeepSpeed; releases before 2025 used 0.001).
        warmup_max_lr: Option<f64>,
        warmup_num_steps: u64,
        warmup_type: WarmupType,
    },
    WarmupDecayLR {
        total_num_steps: u64,
        warmup_min_lr: f64,
        /// Default 0.001 (not the optimizer's lr: WarmupDecayLR passes its own default).
        warmup_max_lr: f64,
        warmup_num_steps: u64,
        warmup_type: WarmupType,
    },
    WarmupCosineLR {
        total_num_steps: u64,
        warmup_min_ratio: f64,
        warmup_num_steps: u64,
        cos_min_ratio: f64,
        warmup_type: WarmupType,
    },
    OneCycle {
        cycle_min_lr: f64,
        cycle_max_lr: f64,
        decay_lr_rate: f64,
        cycle_first_step_size: u64,
        /// None = cycle_first_step_size.
        cycle_second_step_size: Option<u64>,
        cycle_first_stair_count: u64,
        /// None = cycle_first_stair_count.
        cycle_second_stair_count: Option<u64>,
        decay_step_size: u64,
        cycle_momentum: bool,
        cycle_min_mom: f64,
        cycle_max_mom: f64,
        decay_mom_rate: f64,
    },
    LRRangeTest {
        lr_range_test_min_lr: f64,
        lr_range_test_step_size: u64,
        lr_range_test_step_rate: f64,
        lr_range_test_staircase: bool,
    },
}

/// zerodp's own keys (the top-level `zerodp` block; DeepSpeed has no such block).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ZerodpSettings {
    /// Bytes of the device tier each rank may hold (`zerodp.device_memory`); None: no limit.
    pub device_memory: Option<u64>,
    /// Adam's moments' element type (`zerodp.optimizer_states_dtype`); None: as the training
    /// precision's `bf16.bf16_optimizer_states` says, else fp32.
    pub optimizer_states_dtype: Option<Precision>,
}

/// `comms_logger` (zerodp honours `enabled`; DeepSpeed enables logging whenever the block exists).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CommsLoggerSettings {
    pub enabled: bool,
    pub verbose: bool,
    pub prof_all: bool,
    pub debug: bool,
    pub prof_ops: Vec<String>,
}

impl Default for CommsLoggerSettings {
    fn default() -> Self {
        CommsLoggerSettings {
            enabled: false,
            verbose: false,
            prof_all: true,
            debug: false,
            prof_ops: Vec::new(),
        }
    }
}

/// `checkpoint.tag_validation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum TagValidation {
    Warn,
    Ignore,
    Fail,
}

/// `checkpoint`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CheckpointSettings {
    pub tag_validation: TagValidation,
    pub load_universal: bool,
    pub use_node_local_storage: bool,
    /// `parallel_write.pipeline_stage`.
    pub parallel_write_pipeline_stage: bool,
}

impl Default for CheckpointSettings {
    fn default() -> Self {
        CheckpointSettings {
            tag_validation: TagValidation::Warn,
            load_universal: false,
            use_node_local_storage: false,
            parallel_write_pipeline_stage: false,
        }
    }
}

/// `activation_checkpointing`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ActivationCheckpointingSettings {
    pub partition_activations: bool,
    pub contiguous_memory_optimization: bool,
    pub cpu_checkpointing: bool,
    pub number_checkpoints: Option<u64>,
    pub synchronize_checkpoint_boundary: bool,
    pub profile: bool,
}

/// Everything a DeepSpeed config resolves to.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Settings {
    pub zero_optimization: ZeroSettings,
    #[serde(flatten)]
    pub batch: BatchSettings,
    pub precision: Precision,
    pub fp16: Fp16Settings,
    pub bf16: Bf16Settings,
    /// None when the config has no `optimizer` block (the trainer then picks its own).
    pub optimizer: Option<OptimizerSettings>,
    pub scheduler: Option<SchedulerSettings>,
    /// Global gradient-norm clip; 0 = off. Default 0.
    pub gradient_clipping: f64,
    /// Code default None = never print (DeepSpeed's docs say 10).
    pub steps_per_print: Option<u64>,
    pub wall_clock_breakdown: bool,
    /// Resolved: the config's value, else the precision's dtype.
    pub communication_data_type: Precision,
    /// `data_types.grad_accum_dtype`, resolved: fp16 model -> fp16; bf16 model -> fp32 at stage 0
    /// and bf16 at stages 1-3 (DeepSpeed's rule); fp32 -> fp32.
    pub grad_accum_dtype: Precision,
    pub comms_logger: CommsLoggerSettings,
    pub zerodp: ZerodpSettings,
    pub checkpoint: CheckpointSettings,
    pub activation_checkpointing: ActivationCheckpointingSettings,
    /// JSON paths whose `"auto"` stayed unresolved (check mode only; always empty otherwise).
    /// The field values at these paths are stand-ins (DeepSpeed's default, or 0 for batch sizes)
    /// and must not be trained with.
    #[serde(skip)]
    pub unresolved: Vec<String>,
}

impl Default for Settings {
    /// What an empty config resolves to on one rank: fp32, stage 0, one sample per step, no
    /// optimizer or scheduler block, every other key DeepSpeed's default.
    fn default() -> Self {
        let precision = Precision::Fp32;
        Settings {
            zero_optimization: ZeroSettings::default(),
            batch: BatchSettings {
                train_batch_size: 1,
                micro_batch_per_gpu: 1,
                gradient_accumulation_steps: 1,
                world_size: 1,
            },
            precision,
            fp16: Fp16Settings::default(),
            bf16: Bf16Settings::default(),
            optimizer: None,
            scheduler: None,
            gradient_clipping: 0.0,
            steps_per_print: None,
            wall_clock_breakdown: false,
            communication_data_type: defaults::communication_data_type(precision),
            grad_accum_dtype: defaults::grad_accum_dtype(precision, 0),
            comms_logger: CommsLoggerSettings::default(),
            zerodp: ZerodpSettings::default(),
            checkpoint: CheckpointSettings::default(),
            activation_checkpointing: ActivationCheckpointingSettings::default(),
            unresolved: Vec::new(),
        }
    }
}

impl Settings {
    /// The settings as one JSON object (DeepSpeed key names), with unresolved `"auto"` values as
    /// null, plus the flat summary keys `stage`, `offload_optimizer`, `offload_param` (device
    /// strings), `reduce_bucket_size` and `overlap_comm` that `config check --format json` promises.
    pub fn to_json(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).unwrap_or(serde_json::Value::Null);
        for path in &self.unresolved {
            let pointer = format!("/{}", path.replace('.', "/"));
            // Stored names differ from config names in two places: optimizer params sit directly
            // under /optimizer, and stage-3 keys drop their `stage3_` prefix.
            let candidates = [
                pointer.clone(),
                pointer.replace("/optimizer/params/", "/optimizer/"),
                pointer.replace("/stage3_", "/"),
            ];
            for c in candidates {
                if let Some(slot) = v.pointer_mut(&c) {
                    *slot = serde_json::Value::Null;
                    break;
                }
            }
        }
        let z = v["zero_optimization"].clone();
        let obj = v.as_object_mut();
        if let Some(obj) = obj {
            obj.insert("stage".into(), z["stage"].clone());
            obj.insert(
                "offload_optimizer".into(),
                z["offload_optimizer"]["device"].clone(),
            );
            obj.insert("offload_param".into(), z["offload_param"]["device"].clone());
            obj.insert("reduce_bucket_size".into(), z["reduce_bucket_size"].clone());
            obj.insert("overlap_comm".into(), z["overlap_comm"].clone());
            obj.insert(
                "unresolved".into(),
                serde_json::Value::from(self.unresolved.clone()),
            );
        }
        v
    }
}
