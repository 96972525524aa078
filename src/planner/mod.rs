//! The planner: bytes per device and per node, traffic and predicted times per step, for every
//! ZeRO stage and offload choice, and a recommendation, before a run.
//!
//! [`plan`] is a pure function of a [`PlanInput`]: the CLI builds the input from flags and a
//! DeepSpeed config, and the engine can build it from its own model layout
//! ([`ModelSize::from_model_spec`]) and settings, then call [`plan_option`] for its own choice.
//!
//! Model states follow the ZeRO paper (16Ψ bytes in mixed precision: 2Ψ 16-bit params, 2Ψ grads,
//! 12Ψ fp32 master + Adam m and v; sharded by stage), buffers follow zerodp's engine rules
//! ([`engine_buffer_bytes`]), activations a GPT shape ([`activation_bytes`]), traffic the paper's
//! 2Ψ/3Ψ counts ([`collectives`]) timed by an alpha-beta model ([`Cluster`]), and compute the
//! 6·Ψ·tokens rule (8·Ψ·tokens with activation checkpointing, which recomputes the forward).
//!
//! For the model zerodp itself trains ([`ModelSize::from_model_spec`]) these estimates give way to
//! the engine's own rules ([`EngineRun`]): its padded layout for the model states, its buffer
//! sizing ([`crate::zero::buffers::plan`]) and its step schedule for the traffic, so that the plan
//! equals what the run reports; `zerodp train` checks such a plan before it starts.

mod chart;
mod cluster;
mod deepspeed;
mod engine;
mod hpz;
mod hsdp;
mod memory;
mod model;
pub mod preflight;
mod process;
mod recommend;
mod size;
mod traffic;

pub use chart::memory_chart_svg;
pub use cluster::{interconnect, Algorithm, Cluster, Collective, HostLinks, Link, INTERCONNECTS};
pub use deepspeed::{config_precision, ConfigKeys};
pub use engine::{comm_dtype, planned_engine_config, run_settings, EngineRun};
pub use hpz::HpzEffect;
pub use hsdp::HsdpEffect;
pub use memory::{
    activation_bytes, engine_buffer_bytes, model_state_bytes, persistent_elements, Activations,
    BufferSettings, DeviceBytes, EngineBuffers, OffBytes, Offload, Precision, ReductionDtypes,
    ZeroChoice,
};
pub use model::{GptShape, LlamaDims, ModelSize, GPT_PRESETS};
pub use process::{
    gpt_step_memory, unit_memory, GptStepMemory, TrainProcess, UnitMemory, CUDA_LIBRARIES_BYTES,
    PROCESS_BASE_BYTES,
};
pub use recommend::{recommend, Recommendation};
pub use size::{
    format_capacity, format_gb, format_seconds, parse_bandwidth, parse_bytes, parse_count,
    parse_latency,
};
pub use traffic::{collectives, offload_traffic, CollectiveTraffic, OffloadTraffic};

use crate::config::MAX_BATCH;
use crate::limits::{MAX_DEVICES, MAX_MEMORY_BYTES, MAX_PARAMS};

/// Errors from planner inputs.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("{0}")]
    Input(String),
}

/// Buffer knobs as a config states them; unset ones take DeepSpeed's default for each stage.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct BufferOverrides {
    pub reduce_bucket_size: Option<u64>,
    /// Stage 3's prefetch bucket: it changes when gathers run, not the bytes planned.
    pub prefetch_bucket_size: Option<u64>,
    pub overlap_comm: Option<bool>,
    pub max_live_parameters: Option<u64>,
    pub param_persistence_threshold: Option<u64>,
    pub max_reuse_distance: Option<u64>,
    /// `offload_param.max_in_cpu`: elements of a rank's parameter shards kept in host memory when
    /// stage 3 offloads parameters to NVMe (DeepSpeed's default 1e9 when unset).
    pub max_in_cpu: Option<u64>,
    /// `offload_optimizer.ratio`: DeepSpeed's partial offload at stage 3 (the share of units whose
    /// optimizer state is offloaded; the rest stays on the device); 1.0 when unset.
    pub offload_ratio: Option<f64>,
}

impl BufferOverrides {
    pub fn resolve(&self, stage: u8) -> BufferSettings {
        let d = BufferSettings::deepspeed_defaults(stage);
        BufferSettings {
            reduce_bucket_size: self.reduce_bucket_size.unwrap_or(d.reduce_bucket_size),
            overlap_comm: self.overlap_comm.unwrap_or(d.overlap_comm),
            max_live_parameters: self.max_live_parameters.unwrap_or(d.max_live_parameters),
            param_persistence_threshold: self
                .param_persistence_threshold
                .unwrap_or(d.param_persistence_threshold),
            max_reuse_distance: self.max_reuse_distance.unwrap_or(d.max_reuse_distance),
        }
    }
}

/// The element types a config states beside its precision; unset ones resolve as the config
/// reader resolves them ([`crate::config::defaults`]: the precision's dtype, bf16 stage 0
/// accumulating in fp32).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct DtypeOverrides {
    /// `communication_data_type`.
    pub communication: Option<Precision>,
    /// `data_types.grad_accum_dtype`.
    pub grad_accum: Option<Precision>,
    /// Adam's moments (`bf16.bf16_optimizer_states`, `zerodp.optimizer_states_dtype`); None: fp32.
    pub optimizer_states: Option<Precision>,
    /// `bf16.bf16_master_weights_and_grads`: no fp32 master beside bf16 parameters.
    pub bf16_master: bool,
}

/// What the optimizer keeps per element beyond DeepSpeed's default (an fp32 master, f32 m and v):
/// bf16 moments halve m and v on the device; no master (bf16 parameters as their own master)
/// drops it. Offloaded, the 12 bytes per element of fp32 copy, m and v become what is left (and
/// without a master the offloaded gradient partition is bf16).
fn optimizer_state_dtypes(
    d: &mut DeviceBytes,
    off: &mut OffBytes,
    bf16_moments: bool,
    no_master: bool,
) {
    if bf16_moments {
        d.adam_m /= 2;
        d.adam_v /= 2;
    }
    if no_master {
        d.master = 0;
    }
    d.model_states = d.params + d.grads + d.master + d.adam_m + d.adam_v;
    let per = if no_master { 0 } else { 4 } + if bf16_moments { 4 } else { 8 };
    off.host_optimizer_states = off.host_optimizer_states / 12 * per;
    off.nvme_optimizer_states = off.nvme_optimizer_states / 12 * per;
    if no_master {
        // "and grads": the host-side Adam reads bf16 gradients, not an fp32 partition.
        off.host_fp32_grads /= 2;
    }
    off.retotal();
}

/// Elements of each device's parameter shard that `offload_param.max_in_cpu` keeps in host memory
/// when stage 3 offloads parameters to NVMe (0 otherwise); the rest is on NVMe. On zerodp's engine
/// its own rule over the units' shards ([`crate::zero::shards::resident_units`], DeepSpeed's over
/// sub-groups); for an estimate, up to `max_in_cpu` of the shard.
fn resident_param_elems(
    input: &PlanInput,
    choice: ZeroChoice,
    engine: Option<&EngineRun>,
    shard: u64,
) -> u64 {
    if choice.stage != 3 || choice.offload_param != Offload::Nvme {
        return 0;
    }
    let default = crate::config::OffloadParamSettings::default().max_in_cpu;
    let max_in_cpu = input.buffers.max_in_cpu.unwrap_or(default);
    match engine {
        Some(e) => {
            let lens = e.layout.units.iter().map(|u| u.shard_len);
            let max = usize::try_from(max_in_cpu).unwrap_or(usize::MAX);
            let kept = crate::zero::shards::resident_units(lens, max);
            e.layout.units[..kept]
                .iter()
                .map(|u| u.shard_len as u64)
                .sum()
        }
        None => shard.min(max_in_cpu),
    }
}

/// The share of each device's optimizer state that `choice`'s optimizer offload moves under
/// `offload_optimizer.ratio` (1 for a full offload or none). On zerodp's engine the engine's rule
/// over the units' shards ([`crate::zero::offloaded_share`], DeepSpeed's over sub-groups); for an
/// estimate, the ratio itself.
fn optimizer_offload_share(
    input: &PlanInput,
    choice: ZeroChoice,
    engine: Option<&EngineRun>,
) -> f64 {
    let ratio = input.buffers.offload_ratio.unwrap_or(1.0);
    if choice.stage != 3 || choice.offload_optimizer == Offload::None || ratio >= 1.0 {
        return 1.0;
    }
    match engine {
        // The engine's own share: its run with this optimizer offload at this ratio.
        Some(e) => {
            let cfg = crate::zero::EngineConfig {
                offload_optimizer: crate::zero::OptimizerTier::Host,
                offload_ratio: ratio,
                ..e.config.clone()
            };
            crate::zero::offloaded_share(e.spec, &cfg, 0)
        }
        None => ratio.max(0.0),
    }
}

/// `share` of `off` and the rest of `kept` (the same choice without the optimizer offload), for
/// every byte count a partial optimizer offload splits between the device and the offload tier.
fn mix_partial_offload(
    (bytes, off): (&mut DeviceBytes, &mut OffBytes),
    (kept, kept_off): (&DeviceBytes, &OffBytes),
    share: f64,
) {
    let mix = |a, b| mix_bytes(a, b, share);
    bytes.grads = mix(bytes.grads, kept.grads);
    bytes.master = mix(bytes.master, kept.master);
    bytes.adam_m = mix(bytes.adam_m, kept.adam_m);
    bytes.adam_v = mix(bytes.adam_v, kept.adam_v);
    bytes.model_states = bytes.params + bytes.grads + bytes.master + bytes.adam_m + bytes.adam_v;
    off.host_optimizer_states = mix(off.host_optimizer_states, kept_off.host_optimizer_states);
    off.host_fp32_grads = mix(off.host_fp32_grads, kept_off.host_fp32_grads);
    off.nvme_optimizer_states = mix(off.nvme_optimizer_states, kept_off.nvme_optimizer_states);
    off.retotal();
}

/// `share` of `offloaded` bytes plus the rest of `kept`, rounded.
fn mix_bytes(offloaded: u64, kept: u64, share: f64) -> u64 {
    (offloaded as f64 * share + kept as f64 * (1.0 - share)).round() as u64
}

/// Moves the `resident` elements of the parameter shard from NVMe to host memory.
fn keep_params_in_host(off: &mut OffBytes, resident: u64, param_bytes: u64) {
    let bytes = (resident * param_bytes).min(off.nvme_params);
    off.nvme_params -= bytes;
    off.host_params += bytes;
    off.retotal();
}

/// Everything the planner needs.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PlanInput {
    pub model: ModelSize,
    pub cluster: Cluster,
    pub precision: Precision,
    /// Sequences per device per micro-step.
    pub micro_batch: u64,
    pub seq_len: u64,
    /// Micro-steps per optimizer step.
    pub grad_accum: u64,
    pub activation_checkpointing: bool,
    pub buffers: BufferOverrides,
    pub dtypes: DtypeOverrides,
    /// The choice a DeepSpeed config makes, if one was given: the recommendation comments on it.
    pub configured: Option<ZeroChoice>,
    /// The `zerodp train` process the plan is for, if it is one: its overhead is planned per rank
    /// ([`PlanOption::bytes_per_device`]`.overhead`).
    pub process: Option<TrainProcess>,
}

impl PlanInput {
    /// Bytes the head's backward packs beside its tensors in the train process (0 without one).
    fn head_packing(&self) -> u64 {
        self.process.map_or(0, |p| p.head_packing)
    }
}

/// One stage and offload choice, evaluated.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PlanOption {
    pub label: String,
    pub stage: u8,
    pub offload_optimizer: Offload,
    pub offload_param: Offload,
    pub bytes_per_device: DeviceBytes,
    /// Activation bytes with and without checkpointing (`None` without a GPT shape);
    /// `bytes_per_device.activations` is the one the input selects.
    pub activation_options: Option<Activations>,
    pub buffer_settings: BufferSettings,
    /// Host memory and NVMe per node for offloaded state, by kind.
    pub bytes_per_node: OffBytes,
    pub fits_device: bool,
    pub fits_host: bool,
    pub fits: bool,
    /// Device memory minus total bytes per device (negative: over by that much).
    pub device_margin_bytes: i64,
    pub host_margin_bytes: i64,
    pub collectives: Vec<CollectiveTraffic>,
    /// Sum of the collectives' bytes per device per step.
    pub comm_bytes_per_step: u64,
    pub offload: OffloadTraffic,
    pub predicted_comm_s: f64,
    pub predicted_compute_s: f64,
    /// compute + communication + offload, with no overlap: an upper bound on a step.
    pub predicted_step_s: f64,
    /// True for the option the recommendation picks (set by [`plan`]).
    pub recommended: bool,
    /// Stage 3 across nodes: the same option with ZeRO++'s hpZ (set by [`plan`]).
    pub hpz: Option<HpzEffect>,
    /// Stage 3 across nodes: the same option as HSDP, sharded within nodes and replicated
    /// across them (set by [`plan`]; a comparison: zerodp does not run it).
    pub hsdp: Option<HsdpEffect>,
}

impl PlanOption {
    pub fn choice(&self) -> ZeroChoice {
        ZeroChoice::new(self.stage, self.offload_optimizer, self.offload_param)
    }
    /// Engine buffers: reduce buckets, gather pool, persistent params.
    pub fn buffer_bytes(&self) -> u64 {
        let b = &self.bytes_per_device;
        b.reduce_buckets + b.scratch_buffers + b.gather_pool + b.persistent_params
    }
}

/// The evaluated options, the recommendation and the assumptions the numbers rest on.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Plan {
    pub params: u64,
    pub world_size: u64,
    pub precision: Precision,
    pub tokens_per_step_per_device: u64,
    pub options: Vec<PlanOption>,
    pub recommendation: Recommendation,
    pub notes: Vec<String>,
}

/// Evaluates one choice. Pure: `train` calls this with its own model and settings, and then the
/// numbers follow the engine exactly ([`EngineRun`]).
pub fn plan_option(input: &PlanInput, choice: ZeroChoice) -> PlanOption {
    let c = &input.cluster;
    let n = c.world_size();
    let settings = input.buffers.resolve(choice.stage);
    let engine = input
        .model
        .spec
        .as_ref()
        .map(|spec| EngineRun::new(spec, input, choice.stage));
    // The engine stores Ψ padded per unit; the estimates ignore padding.
    let psi = engine
        .as_ref()
        .map_or(input.model.params, EngineRun::padded_params);
    let (mut bytes, mut off_per_device) = model_state_bytes(choice, input.precision, psi, n);
    let share = optimizer_offload_share(input, choice, engine.as_ref());
    let kept = ZeroChoice::new(choice.stage, Offload::None, choice.offload_param);
    if share < 1.0 {
        let (kb, ko) = model_state_bytes(kept, input.precision, psi, n);
        mix_partial_offload((&mut bytes, &mut off_per_device), (&kb, &ko), share);
    }
    optimizer_state_dtypes(
        &mut bytes,
        &mut off_per_device,
        input.dtypes.optimizer_states == Some(Precision::Bf16),
        input.dtypes.bf16_master && input.precision == Precision::Bf16,
    );
    let shard = psi.div_ceil(n.max(1));
    let resident = resident_param_elems(input, choice, engine.as_ref(), shard);
    keep_params_in_host(&mut off_per_device, resident, input.precision.param_bytes());
    if let Some(e) = &engine {
        // The engine keeps its gradients in `grad_accum_dtype`, which need not be the
        // precision's (bf16 stage 0 accumulates in fp32 by default).
        let grads = e.grad_bytes();
        bytes.model_states = bytes.model_states - bytes.grads + grads;
        bytes.grads = grads;
    }
    let buffers = engine_buffers(input, choice.stage, engine.as_ref(), &settings);
    bytes.reduce_buckets = buffers.reduce_buckets;
    bytes.scratch_buffers = buffers.scratch_buffers;
    bytes.gather_pool = buffers.gather_pool;
    bytes.persistent_params = buffers.persistent_params;
    (bytes.activations, bytes.param_copies) = model_bytes(input, engine.as_ref());
    bytes.overhead = process_bytes(input, engine.as_ref(), n);
    bytes.total = bytes.model_states
        + bytes.reduce_buckets
        + bytes.scratch_buffers
        + bytes.gather_pool
        + bytes.persistent_params
        + bytes.activations
        + bytes.param_copies
        + bytes.overhead;
    let activation_options = activation_options(input, choice.stage);
    let per_node = off_per_device.times(c.devices_per_node);
    let device_margin = c.device_memory as i64 - bytes.total as i64;
    let host_margin = c.host_memory as i64 - per_node.host as i64;
    let colls = match &engine {
        Some(e) => e.collectives(c),
        None => collectives(
            choice,
            input.precision,
            &input.model,
            &settings,
            input.grad_accum,
            c,
        ),
    };
    let comm_bytes = colls
        .iter()
        .fold(0u64, |sum, t| sum.saturating_add(t.bytes_per_device));
    let comm_s: f64 = colls.iter().map(|t| t.predicted_s).sum();
    let swapped = shard.saturating_sub(resident);
    let offload = offload_per_step(input, (choice, kept, share), psi, swapped);
    let compute_s = compute_seconds(input);
    PlanOption {
        label: match share < 1.0 {
            true => format!(
                "{} ratio {}",
                choice.label(),
                input.buffers.offload_ratio.unwrap_or(1.0)
            ),
            false => choice.label(),
        },
        stage: choice.stage,
        offload_optimizer: choice.offload_optimizer,
        offload_param: choice.offload_param,
        bytes_per_device: bytes,
        activation_options,
        buffer_settings: settings,
        bytes_per_node: per_node,
        fits_device: device_margin >= 0,
        fits_host: host_margin >= 0,
        fits: device_margin >= 0 && host_margin >= 0,
        device_margin_bytes: device_margin,
        host_margin_bytes: host_margin,
        collectives: colls,
        comm_bytes_per_step: comm_bytes,
        offload,
        predicted_comm_s: comm_s,
        predicted_compute_s: compute_s,
        predicted_step_s: compute_s + comm_s + offload.predicted_s,
        recommended: false,
        hpz: None,
        hsdp: None,
    }
}

/// The engine's buffers: counted from its layout where the model's units are known, else
/// estimated from the model's size and the buffer settings.
fn engine_buffers(
    input: &PlanInput,
    stage: u8,
    engine: Option<&EngineRun>,
    settings: &BufferSettings,
) -> EngineBuffers {
    if let Some(e) = engine {
        return e.buffer_bytes();
    }
    let run = run_settings(input, stage);
    engine_buffer_bytes(
        stage,
        input.precision,
        &input.model,
        settings,
        ReductionDtypes {
            grad_accum: crate::setup::dtype_of(run.grad_accum_dtype),
            comm: crate::setup::dtype_of(run.communication_data_type),
        },
    )
}

/// What the model holds beyond the engine's ledger, `(activations, weight copies)`: for zerodp's
/// own GPT on the engine what its graphs and backward hold (in f32), else the generic estimate of
/// the activations; nothing in this process when the model computes on a GPU.
fn model_bytes(input: &PlanInput, engine: Option<&EngineRun>) -> (u64, u64) {
    if input.process.is_some_and(|p| p.compute_on_gpu) {
        return (0, 0);
    }
    match (engine, input.model.shape) {
        (Some(e), Some(shape)) => {
            let m = e.gpt_step_memory(&shape, input.seq_len, input.head_packing());
            (m.activations, m.param_copies)
        }
        (_, shape) => {
            let activations = shape
                .map(|s| activation_bytes(&s, input.micro_batch, input.seq_len, input.precision))
                .map_or(0, |a| match input.activation_checkpointing {
                    true => a.checkpointed,
                    false => a.full,
                });
            (activations, 0)
        }
    }
}

/// A `zerodp train` process's overhead per rank of `world` (its share of the process, its
/// threads, a checkpoint's staging buffer); 0 for a plan of no particular process.
fn process_bytes(input: &PlanInput, engine: Option<&EngineRun>, world: u64) -> u64 {
    let (Some(p), Some(e)) = (&input.process, engine) else {
        return 0;
    };
    let staging = match p.checkpoint_staging {
        true => process::checkpoint_staging_bytes(e.layout.shard_numel() as u64),
        false => 0,
    };
    p.overhead_per_rank(world, input.seq_len) + staging
}

/// Offload traffic per step; with `offload_ratio` < 1 (`share`) a mix of `choice`'s and the
/// traffic of `kept` (the same stage without optimizer offload).
fn offload_per_step(
    input: &PlanInput,
    (choice, kept, share): (ZeroChoice, ZeroChoice, f64),
    psi: u64,
    swapped: u64,
) -> OffloadTraffic {
    let c = &input.cluster;
    let (precision, accum) = (input.precision, input.grad_accum);
    let mut offload = offload_traffic(choice, precision, psi, swapped, accum, c);
    if share < 1.0 {
        let rest = offload_traffic(kept, precision, psi, swapped, accum, c);
        let mix = |a, b| mix_bytes(a, b, share);
        offload.host_link_bytes = mix(offload.host_link_bytes, rest.host_link_bytes);
        offload.nvme_bytes_per_node = mix(offload.nvme_bytes_per_node, rest.nvme_bytes_per_node);
        offload.predicted_s = offload.predicted_s * share + rest.predicted_s * (1.0 - share);
    }
    offload
}

/// The activation-dependent bytes per device with and without activation checkpointing (`None`
/// without a GPT shape): the generic estimate, or on zerodp's engine its GPT's activations plus
/// weight copies, each setting with the engine's own recomputation rule.
fn activation_options(input: &PlanInput, stage: u8) -> Option<Activations> {
    let shape = input.model.shape?;
    let Some(spec) = &input.model.spec else {
        return Some(activation_bytes(
            &shape,
            input.micro_batch,
            input.seq_len,
            input.precision,
        ));
    };
    let with = |checkpointing: bool| {
        let mut i = input.clone();
        i.activation_checkpointing = checkpointing;
        EngineRun::new(spec, &i, stage)
            .gpt_step_memory(&shape, input.seq_len, input.head_packing())
            .total()
    };
    Some(Activations {
        full: with(false),
        checkpointed: with(true),
    })
}

/// Tokens each device processes per optimizer step.
pub fn tokens_per_step(input: &PlanInput) -> u64 {
    input
        .micro_batch
        .saturating_mul(input.seq_len)
        .saturating_mul(input.grad_accum.max(1))
}

/// 6·Ψ·tokens FLOPs (forward 2, backward 4), 8·Ψ·tokens with activation checkpointing (the forward
/// again), at the cluster's sustained FLOP rate; attention's s² term is left out.
pub(crate) fn compute_seconds(input: &PlanInput) -> f64 {
    let per_token = if input.activation_checkpointing {
        8.0
    } else {
        6.0
    };
    per_token * input.model.params as f64 * tokens_per_step(input) as f64
        / input.cluster.device_flops
}

/// Evaluates every choice ([`ZeroChoice::all`]) and recommends one.
pub fn plan(input: &PlanInput) -> Result<Plan, PlanError> {
    validate(input)?;
    let mut options: Vec<PlanOption> = ZeroChoice::all()
        .into_iter()
        .map(|c| plan_option(input, c))
        .collect();
    // Traffic saturates rather than wraps (see `traffic`); a saturated amount is no number to show.
    let saturated = |o: &PlanOption| {
        o.collectives
            .iter()
            .any(|t| t.full_bytes == u64::MAX || t.calls == u64::MAX)
            || o.offload.host_link_bytes == u64::MAX
            || o.offload.nvme_bytes_per_node == u64::MAX
    };
    if options.iter().any(saturated) {
        return Err(PlanError::Input(format!(
            "a step of {} micro-steps on {:.2e} parameters would move more than 2^64 bytes; lower \
             the accumulation steps (--grad-accum, or the config's gradient_accumulation_steps)",
            input.grad_accum, input.model.params as f64
        )));
    }
    for o in &mut options {
        o.hpz = hpz::hpz_effect(input, o);
        o.hsdp = hsdp::hsdp_effect(input, o);
    }
    let recommendation = recommend(input, &options);
    for o in &mut options {
        o.recommended = recommendation.choice == Some(o.choice());
    }
    Ok(Plan {
        params: input.model.params,
        world_size: input.cluster.world_size(),
        precision: input.precision,
        tokens_per_step_per_device: tokens_per_step(input),
        notes: notes(input),
        options,
        recommendation,
    })
}

/// Refuses inputs a run would refuse (no device, no accumulation step, an empty bucket) and
/// sizes beyond [`crate::limits`], so that the sums and products of [`plan_option`] stay exact.
fn validate(input: &PlanInput) -> Result<(), PlanError> {
    validate_cluster(&input.cluster)?;
    validate_model(&input.model)?;
    validate_step(input)
}

/// The cluster's devices, memories, FLOP rate and links.
fn validate_cluster(c: &Cluster) -> Result<(), PlanError> {
    if c.nodes == 0 || c.devices_per_node == 0 {
        return Err(PlanError::Input(
            "the cluster needs at least one node with one device".into(),
        ));
    }
    if c.nodes
        .checked_mul(c.devices_per_node)
        .is_none_or(|n| n > MAX_DEVICES)
    {
        return Err(PlanError::Input(format!(
            "{} node(s) x {} devices per node is more than zerodp's limit of {MAX_DEVICES} devices",
            c.nodes, c.devices_per_node
        )));
    }
    if c.device_memory == 0 {
        return Err(PlanError::Input(
            "--device-memory must be more than 0 (for example 80GiB)".into(),
        ));
    }
    for (flag, bytes) in [
        ("--device-memory", c.device_memory),
        ("--host-memory", c.host_memory),
    ] {
        if bytes > MAX_MEMORY_BYTES {
            return Err(PlanError::Input(format!(
                "{flag} {} is more than zerodp's limit of 1 EiB (2^60 bytes)",
                format_capacity(bytes)
            )));
        }
    }
    if !positive(c.device_flops) {
        return Err(PlanError::Input(
            "--flops must be more than 0 (for example 4e14)".into(),
        ));
    }
    for (what, link) in [("intra-node", c.intra), ("inter-node", c.inter)] {
        let latency_ok = link.latency.is_finite() && link.latency >= 0.0;
        if !(positive(link.bandwidth) && latency_ok) {
            return Err(PlanError::Input(format!(
                "the {what} link needs a positive bandwidth and a non-negative latency"
            )));
        }
    }
    Ok(())
}

/// The model's parameter count and largest unit.
fn validate_model(m: &ModelSize) -> Result<(), PlanError> {
    if m.params == 0 || m.params > MAX_PARAMS {
        return Err(PlanError::Input(format!(
            "the model has {} parameters; zerodp plans 1 to {:.0e}",
            m.params, MAX_PARAMS as f64
        )));
    }
    if m.largest_unit == 0 || m.largest_unit > m.params {
        return Err(PlanError::Input(format!(
            "the largest unit has {} elements; it must be at least 1 and at most the model's {}",
            m.largest_unit, m.params
        )));
    }
    Ok(())
}

/// The step's micro-batch, sequence length and accumulation, and the activations they make.
fn validate_step(input: &PlanInput) -> Result<(), PlanError> {
    for (flag, v) in [
        ("--micro-batch", input.micro_batch),
        ("--seq-len", input.seq_len),
        ("--grad-accum", input.grad_accum),
    ] {
        if v == 0 || v > MAX_BATCH {
            return Err(PlanError::Input(format!(
                "{flag} {v} must be between 1 and 2^31{}",
                if flag == "--grad-accum" {
                    " (1: no accumulation)"
                } else {
                    ""
                }
            )));
        }
    }
    let tokens = input
        .micro_batch
        .checked_mul(input.seq_len)
        .and_then(|t| t.checked_mul(input.grad_accum));
    if tokens.is_none() {
        return Err(PlanError::Input(format!(
            "--micro-batch {} x --seq-len {} x --grad-accum {} is more than 2^64 tokens per device \
             per step",
            input.micro_batch, input.seq_len, input.grad_accum
        )));
    }
    if let Some(s) = input.model.shape {
        if input.seq_len > s.context {
            return Err(PlanError::Input(format!(
                "--seq-len {} is longer than the model's context {}; lower it, or plan a model with a \
                 longer context (--context with --layers, or the n_positions or \
                 max_position_embeddings of a --model-config)",
                input.seq_len, s.context
            )));
        }
        let a = activation_bytes(&s, input.micro_batch, input.seq_len, input.precision);
        let kept = if input.activation_checkpointing {
            a.checkpointed
        } else {
            a.full
        };
        if kept > MAX_MEMORY_BYTES {
            return Err(PlanError::Input(format!(
                "the activations of one micro-batch ({} sequences of {} tokens) would take more \
                 than zerodp's limit of 1 EiB (2^60 bytes) per device; lower the micro-batch \
                 (--micro-batch, or the config's train_micro_batch_size_per_gpu) or the sequence \
                 length (--seq-len, --context)",
                input.micro_batch, input.seq_len
            )));
        }
    }
    Ok(())
}

/// The product of `factors`, `u64::MAX` when it does not fit: for amounts the planner reports
/// (traffic, activations) rather than adds into what it compares with memory.
pub(crate) fn saturating_product(factors: &[u64]) -> u64 {
    factors.iter().fold(1u64, |a, &b| a.saturating_mul(b))
}

/// A finite number above zero (false for NaN).
fn positive(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

fn notes(input: &PlanInput) -> Vec<String> {
    let layout_note = if input.model.spec.is_some() {
        "zerodp's engine layout: each unit padded to a multiple of 8 x world size elements; buffers by the engine's own sizing rules and traffic by its step schedule (plus the loss/grad-norm all-reduce)"
    } else {
        "padding of each unit to a multiple of the world size is ignored (under world-size elements per unit)"
    };
    let mut notes = vec![
        "model states per the ZeRO paper (16 bytes/param in mixed precision, sharded by stage); GB = 1e9 bytes".to_string(),
        layout_note.to_string(),
        "step time = compute + communication + offload with no overlap: an upper bound".to_string(),
        format!(
            "compute = {}·Ψ·tokens FLOPs at {:.0} TFLOP/s per device",
            if input.activation_checkpointing { 8 } else { 6 },
            input.cluster.device_flops / 1e12
        ),
    ];
    let h = &input.cluster.host;
    notes.push(format!(
        "offload: device-host copies at {:.0} GB/s per device, NVMe at {:.1} GB/s per node, host Adam at {:.2e} params/s per node ({})",
        h.device_to_host / 1e9,
        h.nvme / 1e9,
        h.host_adam_params_per_s,
        if h.host_adam_measured {
            "zerodp's CPU Adam measured on this machine"
        } else {
            "assumed; --host-adam-rate measure times it here"
        }
    ));
    notes.push("offload as DeepSpeed does it (its estimators' bytes); zerodp train runs every option, and its optimizer offload to nvme keeps the fp32 master in host memory (4 bytes per element more there, 8 instead of 12 each way on NVMe)".into());
    notes.push("communication: the faster of a flat ring and a hierarchical (intra-node, then inter-node) algorithm per collective, alpha-beta model".into());
    if input.model.shape.is_none() {
        notes.push("activations not counted: give a model's shape (--layers/--width/..., --preset or --model-config) to include them".into());
    }
    if input.model.largest_unit_estimated {
        notes.push(format!(
            "largest unit estimated as one block of a GPT-3-shaped model ({} elements); give --largest-unit",
            input.model.largest_unit
        ));
    }
    if input.model.unit_numels.is_empty() {
        notes.push("unit sizes unknown: no stage-3 persistent units assumed".into());
    }
    notes
}
