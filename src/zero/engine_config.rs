//! The engine's own configuration: a plain struct, so that the engine does not depend on the
//! DeepSpeed config parser (`zerodp train` maps resolved settings onto it).

use crate::config::defaults;
use crate::flat::DType;
use crate::optim::adam::AdamParams;
use crate::zero::step_policy::OverflowPolicy;

/// Which redundancy ZeRO removes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    /// Plain data parallelism: everything replicated, gradients all-reduced.
    Zero0,
    /// Optimizer states (and master weights) sharded.
    Zero1,
    /// Gradients sharded too.
    Zero2,
    /// Parameters sharded too.
    Zero3,
}

impl Stage {
    /// Stage from its number (0-3).
    pub fn from_index(i: u8) -> Option<Stage> {
        match i {
            0 => Some(Stage::Zero0),
            1 => Some(Stage::Zero1),
            2 => Some(Stage::Zero2),
            3 => Some(Stage::Zero3),
            _ => None,
        }
    }
    pub fn index(self) -> u8 {
        self as u8
    }
    /// Whether the optimizer states live on the own shard only.
    pub(crate) fn shards_optimizer(self) -> bool {
        self >= Stage::Zero1
    }
    /// Whether a rank keeps only its gradient shard.
    pub fn shards_grads(self) -> bool {
        self >= Stage::Zero2
    }
    /// Whether a rank keeps only its parameter shard between uses.
    pub fn shards_params(self) -> bool {
        self == Stage::Zero3
    }
}

/// Everything the engine needs to know. Sizes are in elements, as in DeepSpeed's config.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    pub stage: Stage,
    pub world_size: usize,
    /// Sequences per micro-batch on each rank (`train_micro_batch_size_per_gpu`).
    pub micro_batch: usize,
    /// Micro-batches per optimizer step (`gradient_accumulation_steps`).
    pub grad_accum: usize,
    /// Elements per gradient reduction bucket (`reduce_bucket_size`); 0: no bucket, each unit's
    /// gradient reduced on its own ([`super::buffers::reduction_plan`]).
    pub reduce_bucket_size: usize,
    /// Overlap reductions and gathers with compute (double-buffered buckets, stage-3 prefetch).
    pub overlap_comm: bool,
    /// Clip the global gradient norm to this value; 0 disables clipping.
    pub gradient_clipping: f32,
    /// Stage 3: elements that may be prefetched ahead of use (`stage3_prefetch_bucket_size`).
    pub prefetch_bucket_size: usize,
    /// Stage 3: ranks per host for ZeRO++'s hierarchical partitioning, hpZ
    /// (`zero_hpz_partition_size`; ranks numbered host by host): a unit's first gather of a step
    /// crosses hosts, its later ones come from a secondary shard within the host. 1 (or the
    /// world size): off.
    pub hpz_partition_size: usize,
    /// Stage 3: ZeRO++'s quantized weights, qwZ (`zero_quantized_weights`): the all-gathers that
    /// cross the world carry block-wise int8 shards ([`super::quantize`]).
    pub quantized_weights: bool,
    /// Stage 3: ZeRO++'s quantized gradients, qgZ (`zero_quantized_gradients`): each unit's
    /// gradient reduce-scatter becomes two all-to-alls of block-wise int8 payloads, within hosts
    /// and then across them (the communicator's ranks per host), reduced in f32 on arrival.
    pub quantized_gradients: bool,
    /// Stage 3: units with at most this many elements stay gathered for the whole step
    /// (`stage3_param_persistence_threshold`).
    pub param_persistence_threshold: usize,
    /// Stage 3: gathered elements alive at once, prefetches and demand fetches alike
    /// (`stage3_max_live_parameters`); raised to the smallest working set if below it.
    pub max_live_parameters: usize,
    /// Stage 3: a unit whose forward-to-backward distance (elements of the units that run in
    /// between) is at most this keeps its forward graph, weights included, instead of being
    /// gathered again and recomputed in backward, as far as `max_live_parameters` allows
    /// (`stage3_max_reuse_distance`; DeepSpeed's default 1e9 keeps small models gathered). 0 gives
    /// strict ZeRO-3: every unit but the last is released after forward and recomputed.
    pub max_reuse_distance: usize,
    /// Run units' forward without a graph and recompute it in backward.
    pub activation_checkpointing: bool,
    /// Adam/AdamW hyper-parameters; `lr` is replaced by each step's scheduled value.
    pub adam: AdamParams,
    /// Seed of the parameter initialisation.
    pub seed: u64,
    /// Element type of gradient reduction buffers (`communication_data_type`); 16-bit only with
    /// 16-bit parameters. Reductions accumulate in f32 whatever this is.
    pub comm_dtype: DType,
    /// Element type of the parameters the model computes with: `F32` trains in fp32; `BF16` or
    /// `F16` is mixed precision, with an fp32 master copy beside Adam's moments on the own shard.
    pub param_dtype: DType,
    /// Element type the gradients are kept and accumulated in across micro-steps
    /// (`data_types.grad_accum_dtype`).
    pub grad_accum_dtype: DType,
    /// fp16 loss scaling, or the Inf/NaN guard alone.
    pub overflow: OverflowPolicy,
    /// Steps in a row with Inf/NaN gradients that are skipped before the run stops with an error
    /// (everything but dynamic fp16 loss scaling, which has its own minimum-scale error).
    pub max_skipped_steps: u64,
    /// Where the fp32 master and Adam's moments of the rank's part live
    /// (`zero_optimization.offload_optimizer`).
    pub offload_optimizer: OptimizerTier,
    /// Fraction of the rank's units whose fp32 master and moments go to [`Self::offload_optimizer`]
    /// (`offload_optimizer.ratio`, DeepSpeed's partial offload, stage 3 only): the rest stay in
    /// the device tier. Units are zerodp's sub-groups, and DeepSpeed's rule picks which
    /// ([`first_offloaded_unit`]). 1.0 (the default) offloads every unit.
    pub offload_ratio: f64,
    /// Stage 3: where the rank's parameter shards live between gathers
    /// (`zero_optimization.offload_param`); ignored at stages 0-2, as DeepSpeed ignores it.
    pub offload_param: ParamTier,
    /// Bytes of the device tier a rank may hold (`--device-memory`, `zerodp.device_memory`): the
    /// engine refuses, before allocating, a configuration whose device-tier bytes at their fullest
    /// exceed it. None: no limit.
    pub device_budget: Option<u64>,
    /// Element type of Adam's moments: `F32`, or `BF16` (`bf16.bf16_optimizer_states`,
    /// `zerodp.optimizer_states_dtype`), updated in f32 and rounded once per step.
    pub optimizer_states_dtype: DType,
    /// bf16 parameters that are their own master (`bf16.bf16_master_weights_and_grads`): no fp32
    /// copy (2 bytes per parameter instead of 6); Adam updates each parameter in f32 and rounds it
    /// back stochastically, with random bits fixed by the seed, the step and the parameter's place
    /// in the model (so every world size and stage gives the same bits). Needs bf16 parameters.
    pub bf16_master_weights: bool,
    /// A step's loss is the mean over every loss term of the global batch (each micro-batch
    /// weighed by its [`crate::zero::UnitModel::loss_tokens`], their sum agreed by the ranks in
    /// one small exchange per step), as transformers' Trainer computes it for data whose
    /// micro-batches train on unequal numbers of tokens (chat data). Off: each micro-batch's mean
    /// counts equally (DeepSpeed's way; the same where every micro-batch has as many terms).
    pub loss_per_token: bool,
}

/// Where a rank's optimizer states live.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum OptimizerTier {
    /// In the device tier (no offload).
    #[default]
    Device,
    /// In host memory; the step runs on the CPU (`"device": "cpu"`).
    Host,
    /// Adam's moments in a swap file per rank under `dir`, streamed `chunk` elements at a time
    /// (`sub_group_size`) through `buffer_count` fixed buffers of `chunk` elements, half for `m`
    /// and half for `v` (`offload_optimizer.buffer_count`; fewer than 4 counts as 4, double
    /// buffering); the fp32 master stays in host memory (`"device": "nvme"`).
    Nvme {
        dir: std::path::PathBuf,
        chunk: usize,
        buffer_count: usize,
    },
}

/// Where a stage-3 rank's parameter shards live between gathers.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum ParamTier {
    /// In the device tier (no offload).
    #[default]
    Device,
    /// In host memory, fetched into the device tier to be gathered (`"device": "cpu"`).
    Host,
    /// In a swap file per rank under `dir` (`"device": "nvme"`): each gather reads its shard into
    /// one of `buffer_count` host staging buffers as long as the longest shard (raised to the
    /// most units one visit gathers), and the optimizer step writes the updated shards back.
    /// `buffer_size` (elements) is DeepSpeed's bound on one staging buffer: a shard longer than it
    /// is refused with the fix, as DeepSpeed refuses such a parameter. `max_in_cpu` (elements,
    /// DeepSpeed's key and rule): the rank's first units whose shards fit in it together stay in
    /// host memory, and only the rest go to the swap file (DeepSpeed's default 1e9 keeps every
    /// shard of a model below a billion parameters per rank in memory; 0 swaps them all).
    Nvme {
        dir: std::path::PathBuf,
        buffer_count: usize,
        buffer_size: usize,
        max_in_cpu: usize,
    },
}

impl EngineConfig {
    /// Whether ZeRO++'s qwZ acts: stage 3 on more than one rank, with `quantized_weights`.
    pub fn qwz_active(&self) -> bool {
        self.stage == Stage::Zero3 && self.quantized_weights && self.world_size > 1
    }
    /// Whether ZeRO++'s qgZ acts: stage 3 on more than one rank, with `quantized_gradients`.
    pub fn qgz_active(&self) -> bool {
        self.stage == Stage::Zero3 && self.quantized_gradients && self.world_size > 1
    }
    /// Whether ZeRO++'s hpZ acts: stage 3, with hosts of `hpz_partition_size` ranks that split
    /// the world into two or more.
    pub fn hpz_active(&self) -> bool {
        let h = self.hpz_partition_size;
        self.stage == Stage::Zero3 && h > 1 && h < self.world_size && self.world_size % h == 0
    }
    /// DeepSpeed's defaults for a stage and world size ([`crate::config::defaults`]): micro-batch
    /// 1, no accumulation, 5e8-element buckets, no clipping, stage-3 knobs 5e7 / 1e5 / 1e9 / 1e9 —
    /// except `overlap_comm`, which is on at every stage here (DeepSpeed turns it on at stage 3
    /// only; it changes no result, only when collectives run).
    pub fn new(stage: Stage, world_size: usize) -> Self {
        let size = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        EngineConfig {
            stage,
            world_size,
            micro_batch: 1,
            grad_accum: 1,
            reduce_bucket_size: size(defaults::REDUCE_BUCKET_SIZE),
            overlap_comm: true,
            gradient_clipping: 0.0,
            prefetch_bucket_size: size(defaults::PREFETCH_BUCKET_SIZE),
            hpz_partition_size: 1,
            quantized_weights: false,
            quantized_gradients: false,
            param_persistence_threshold: size(defaults::PARAM_PERSISTENCE_THRESHOLD),
            max_live_parameters: size(defaults::MAX_LIVE_PARAMETERS),
            max_reuse_distance: size(defaults::MAX_REUSE_DISTANCE),
            activation_checkpointing: false,
            adam: AdamParams::default(),
            seed: 0,
            comm_dtype: DType::F32,
            param_dtype: DType::F32,
            grad_accum_dtype: DType::F32,
            overflow: OverflowPolicy::Guard,
            max_skipped_steps: 10,
            offload_optimizer: OptimizerTier::Device,
            offload_ratio: 1.0,
            offload_param: ParamTier::Device,
            device_budget: None,
            optimizer_states_dtype: DType::F32,
            bf16_master_weights: false,
            loss_per_token: false,
        }
    }
}

/// The first of `num_units` units whose optimizer state a partial offload of `ratio` moves to the
/// offload tier: DeepSpeed's rule for its sub-groups (`i >= int((1 - ratio) * n)` goes to the
/// CPU), in the same f64 arithmetic, so that a config offloads the same share of a model here as
/// there. The device tier keeps the units before it (the first ones: embeddings and early blocks).
pub fn first_offloaded_unit(num_units: usize, ratio: f64) -> usize {
    // `as` saturates: a ratio outside [0, 1] (refused by validation) cannot index past the end.
    (((1.0 - ratio) * num_units as f64) as usize).min(num_units)
}

impl EngineConfig {
    /// Whether unit `unit` of `num_units` keeps its fp32 master and Adam moments in the offload
    /// tier ([`Self::offload_optimizer`] is not the device, and [`Self::offload_ratio`] covers
    /// it).
    pub(crate) fn optimizer_offloaded(&self, unit: usize, num_units: usize) -> bool {
        self.offload_optimizer != OptimizerTier::Device
            && unit >= first_offloaded_unit(num_units, self.offload_ratio)
    }

    /// Where unit `unit` of `num_units` keeps its optimizer state.
    pub(crate) fn unit_optimizer_tier(&self, unit: usize, num_units: usize) -> &OptimizerTier {
        match self.optimizer_offloaded(unit, num_units) {
            true => &self.offload_optimizer,
            false => &OptimizerTier::Device,
        }
    }
}

impl EngineConfig {
    /// Mixed precision in `dtype` (`BF16` or `F16`) with gradients reduced and accumulated in
    /// `dtype` too; for `F16` dynamic loss scaling with the documented defaults (2^16, hysteresis
    /// 2). `F32` restores fp32 training.
    pub fn with_precision(mut self, dtype: DType) -> Self {
        self.param_dtype = dtype;
        self.comm_dtype = dtype;
        self.grad_accum_dtype = dtype;
        self.overflow = match dtype {
            DType::F16 => OverflowPolicy::LossScale {
                loss_scale: 0.0,
                dynamic: crate::zero::loss_scaler::DynamicScaleParams::DOCUMENTED_DEFAULTS,
            },
            _ => OverflowPolicy::Guard,
        };
        self
    }

    /// The training precision's name (`fp32`, `bf16`, `fp16`), as configs and messages say it.
    pub(crate) fn precision_name(&self) -> &'static str {
        match self.param_dtype {
            DType::F32 => "fp32",
            DType::BF16 => "bf16",
            DType::F16 => "fp16",
        }
    }

    /// Whether the parameters are 16-bit (widened to f32 for the model).
    pub(crate) fn is_mixed(&self) -> bool {
        self.param_dtype != DType::F32
    }

    /// Whether Adam updates an fp32 master copy of the rank's part beside 16-bit parameters (mixed
    /// precision, unless the bf16 parameters are their own master).
    pub(crate) fn keeps_fp32_master(&self) -> bool {
        self.is_mixed() && !self.bf16_master_weights
    }

    /// Whether gradients reach the model through transient f32 buffers: always where a rank keeps
    /// only its gradient shard, and at stages 0-1 when the kept gradients are not f32.
    pub fn transient_grads(&self) -> bool {
        self.stage.shards_grads() || self.grad_accum_dtype != DType::F32
    }
}
