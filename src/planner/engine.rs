//! The planner on zerodp's own engine. Given the model `train` builds
//! ([`ModelSize::from_model_spec`](super::ModelSize::from_model_spec)), the planner does not
//! estimate: it counts the model states over the engine's padded flat layout ([`FlatLayout`]),
//! sizes the buffers with the engine's own rules ([`crate::zero::buffers::plan`], the function the
//! engine allocates from) and counts the traffic by walking the engine's step schedule
//! ([`crate::zero::schedule`]) with the stage-3 coordinator's release rule
//! ([`stays_gathered`]). Its numbers then equal what a zerodp run reports in its `StepReport`.
//!
//! Layering: `planner` calls into `zero` and `setup`, as `zero` calls into `memory::accounting`;
//! the modules stay acyclic (accounting <- zero <- setup <- planner). The sizing rules stay in
//! `zero::buffers`, next to the engine that allocates what they size, rather than moving to a
//! module both would share: the engine's rules keep one home and the planner is one more caller.

use super::cluster::{Cluster, Collective};
use super::deepspeed::config_precision;
use super::memory::{EngineBuffers, Precision};
use super::model::GptShape;
use super::process::{gpt_step_memory, GptStepMemory};
use super::traffic::{priced, CollectiveTraffic};
use super::{saturating_product as mul, PlanInput};
use crate::config::{self, defaults, Settings};
use crate::flat::DType;
use crate::setup;
use crate::zero::buffers::{self, BufferPlan};
use crate::zero::gather::stays_gathered;
use crate::zero::layout::FlatLayout;
use crate::zero::schedule::{self, Pass};
use crate::zero::unit::ModelSpec;
use crate::zero::{EngineConfig, Stage};

/// The engine's gradient-communication dtype for a training precision.
pub fn comm_dtype(precision: Precision) -> DType {
    setup::dtype_of(config_precision(precision))
}

/// The resolved DeepSpeed settings of a zerodp run of `stage` for `input`: what the config reader
/// makes of a config stating the input's knobs (unset ones take DeepSpeed's default for that
/// stage, [`crate::config::defaults`]). Offload is left out: the engine path sizes the stages
/// alone.
pub fn run_settings(input: &PlanInput, stage: u8) -> Settings {
    let b = input.buffers.resolve(stage);
    let mut s = Settings::default();
    let precision = config_precision(input.precision);
    s.precision = precision;
    s.fp16.enabled = precision == config::Precision::Fp16;
    s.bf16.enabled = precision == config::Precision::Bf16;
    s.communication_data_type = input.dtypes.communication.map_or(
        defaults::communication_data_type(precision),
        config_precision,
    );
    s.grad_accum_dtype = input.dtypes.grad_accum.map_or(
        defaults::grad_accum_dtype(precision, stage),
        config_precision,
    );
    s.zerodp.optimizer_states_dtype = input.dtypes.optimizer_states.map(config_precision);
    s.bf16.bf16_master_weights_and_grads = input.dtypes.bf16_master;
    let world = usize::try_from(input.cluster.world_size()).unwrap_or(usize::MAX);
    let size = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
    s.batch.micro_batch_per_gpu = size(input.micro_batch);
    s.batch.gradient_accumulation_steps = size(input.grad_accum.max(1));
    s.batch.world_size = world;
    s.batch.train_batch_size = s
        .batch
        .micro_batch_per_gpu
        .saturating_mul(s.batch.gradient_accumulation_steps)
        .saturating_mul(world);
    let z = &mut s.zero_optimization;
    z.stage = stage;
    z.reduce_bucket_size = b.reduce_bucket_size;
    z.overlap_comm = b.overlap_comm;
    z.max_live_parameters = b.max_live_parameters;
    z.param_persistence_threshold = b.param_persistence_threshold;
    z.max_reuse_distance = b.max_reuse_distance;
    if let Some(p) = input.buffers.prefetch_bucket_size {
        z.prefetch_bucket_size = p;
    }
    s
}

/// The engine configuration a zerodp run of `stage` would use for `input`: [`run_settings`]
/// through the one settings-to-engine mapping ([`setup::engine_config`]) that `zerodp train` and
/// the [`crate::trainer::Trainer`] use, plus the input's activation checkpointing (a `train` flag
/// as much as a config key).
pub fn planned_engine_config(input: &PlanInput, stage: u8) -> EngineConfig {
    let settings = run_settings(input, stage);
    let world = settings.batch.world_size.max(1);
    // run_settings states a stage of 0-3 (ZeroChoice stages), no offload and no fp16 master
    // weights, so the mapping has nothing to refuse; fall back to the defaults if it ever does.
    let mut cfg = setup::engine_config(&settings, world, 0).unwrap_or_else(|_| {
        EngineConfig::new(Stage::from_index(stage).unwrap_or(Stage::Zero3), world)
    });
    cfg.activation_checkpointing |= input.activation_checkpointing;
    cfg
}

/// What a zerodp run of one stage holds and moves: its configuration, flat layout and buffers.
#[derive(Clone, Debug)]
pub struct EngineRun<'a> {
    pub spec: &'a ModelSpec,
    pub config: EngineConfig,
    pub layout: FlatLayout,
    pub buffers: BufferPlan,
}

impl<'a> EngineRun<'a> {
    pub fn new(spec: &'a ModelSpec, input: &PlanInput, stage: u8) -> Self {
        let config = planned_engine_config(input, stage);
        let layout = FlatLayout::new(spec, config.world_size.max(1), 0);
        let buffers = buffers::plan(spec, &config);
        EngineRun {
            spec,
            config,
            layout,
            buffers,
        }
    }

    /// Ψ as the engine stores it: every unit padded to a multiple of `world_size · 8` elements, so
    /// that a shard is exactly 1/N of it.
    pub(crate) fn padded_params(&self) -> u64 {
        self.layout.padded_numel() as u64
    }

    /// The gradients a rank keeps between micro-steps: the whole padded model at stages 0-1, the
    /// own shard at stages 2-3, in `grad_accum_dtype`.
    pub fn grad_bytes(&self) -> u64 {
        let elems = match self.config.stage.shards_grads() {
            true => self.layout.shard_numel(),
            false => self.layout.padded_numel(),
        };
        (elems * self.config.grad_accum_dtype.size()) as u64
    }

    /// The engine's buffers by the planner's kinds: the reduction buckets and the scratch
    /// buffers (together the engine's `buffers` kind), the stage-3 persistent units and the rest of
    /// the gathered-parameter budget (together its `gather` kind).
    pub fn buffer_bytes(&self) -> EngineBuffers {
        let p = &self.buffers;
        let persistent: usize = (self.layout.units.iter().zip(&p.persistent))
            .filter(|(_, &keep)| keep)
            .map(|(u, _)| u.padded)
            .sum();
        let persistent = (persistent * p.param_dtype.size()) as u64;
        EngineBuffers {
            reduce_buckets: p.bucket_bytes(),
            scratch_buffers: p.scratch_bytes(),
            gather_pool: p.gather_bytes() - persistent,
            persistent_params: persistent,
        }
    }

    /// Units whose forward runs without a graph and again in backward, by the engine's rule (its
    /// `recompute`): every unit but the last under activation checkpointing, and at stage 3 the
    /// units that do not keep their forward graph.
    pub(crate) fn recomputed_units(&self) -> Vec<bool> {
        let n = self.spec.units.len();
        let stage3 = self.config.stage.shards_params();
        (0..n)
            .map(|u| {
                u + 1 != n
                    && (self.config.activation_checkpointing
                        || (stage3 && !self.buffers.keep_graph.get(u).copied().unwrap_or(false)))
            })
            .collect()
    }

    /// What zerodp's GPT of `shape` holds beyond the engine's ledger in one micro-step of this run
    /// ([`gpt_step_memory`]): the units recomputed by the engine's rule, and not counting the weight
    /// copies of kept stage-3 graphs, which the ledger's `gather` kind holds.
    /// `head_packing`: bytes the head's backward packs beside its tensors.
    pub fn gpt_step_memory(
        &self,
        shape: &GptShape,
        seq_len: u64,
        head_packing: u64,
    ) -> GptStepMemory {
        let in_ledger: Vec<bool> =
            buffers::kept_graph_elems(self.spec, &self.layout, &self.buffers)
                .iter()
                .map(|&e| e > 0)
                .collect();
        gpt_step_memory(
            shape,
            self.config.micro_batch as u64,
            seq_len,
            &self.recomputed_units(),
            &in_ledger,
            head_packing,
        )
    }

    /// The collectives of one optimizer step, call for call as the engine issues them:
    /// - stage 0: the gradient all-reduce, one call per bucket, on the last micro-step;
    /// - stages 1-3: the gradient reduce-scatter, one call per bucket region (stage 1 on the last
    ///   micro-step, stages 2-3 on every one);
    /// - where the reduction runs in place (`zero::buffers::reduction_plan`: stages 0-1 with
    ///   gradients kept in the communication dtype, stages 2-3 with f32 reductions and a bucket
    ///   that holds the largest unit), and with `reduce_bucket_size` 0 (each unit on its own):
    ///   one call per (non-empty) unit instead;
    /// - stages 1-2: the all-gather of the updated shards after the step, in place, one call per
    ///   unit;
    /// - stage 3: one all-gather per unit each time a visit needs it while it is released, which
    ///   skips the last unit's backward (it stays gathered from its forward), the backward of units
    ///   that kept their forward graph (`stage3_max_reuse_distance`), and persistent units after
    ///   their first use in the step;
    /// - every stage: one all-reduce of two f32 scalars, the loss and the squared gradient norm.
    pub fn collectives(&self, cluster: &Cluster) -> Vec<CollectiveTraffic> {
        let p = &self.buffers;
        let world = self.layout.world_size;
        let padded = self.layout.padded_numel() as u64;
        let shard = self.layout.shard_numel() as u64;
        let region = (p.bucket_elems / world).max(1) as u64;
        let comm = p.comm_dtype.size() as u64;
        let param = p.param_dtype.size() as u64;
        let ga = self.config.grad_accum.max(1) as u64;
        let units = self.layout.units.iter().filter(|u| u.padded > 0).count() as u64;
        let mut ops: Vec<(Collective, &'static str, u64, u64)> = Vec::new();
        let stage = self.config.stage;
        match stage {
            Stage::Zero0 => ops.push((
                Collective::AllReduce,
                "grads",
                mul(&[padded, comm]),
                match p.reduce_in_place || p.per_unit {
                    true => units,
                    false => padded.div_ceil(p.bucket_elems.max(1) as u64),
                },
            )),
            _ => {
                let reductions = if stage.shards_grads() { ga } else { 1 };
                let per_reduction = match p.reduce_in_place || p.per_unit {
                    true => units,
                    false => shard.div_ceil(region),
                };
                ops.push((
                    Collective::ReduceScatter,
                    "grads",
                    mul(&[reductions, padded, comm]),
                    mul(&[reductions, per_reduction]),
                ));
            }
        }
        if matches!(stage, Stage::Zero1 | Stage::Zero2) {
            ops.push((
                Collective::AllGather,
                "params (after step)",
                mul(&[padded, param]),
                units,
            ));
        }
        if stage == Stage::Zero3 {
            let [forward, backward, persistent] = self.stage3_gathers();
            for (what, (elems, calls)) in [
                ("params (forward)", forward),
                ("params (backward)", backward),
                ("persistent params", persistent),
            ] {
                ops.push((Collective::AllGather, what, mul(&[elems, param]), calls));
            }
        }
        ops.push((
            Collective::AllReduce,
            "loss and gradient norm",
            2 * DType::F32.size() as u64,
            1,
        ));
        ops.into_iter()
            .filter(|(_, _, _, calls)| *calls > 0)
            .map(|(op, what, bytes, calls)| priced(op, what, bytes, calls, cluster))
            .collect()
    }

    /// Stage-3 all-gathers of one step as (padded elements, calls): of non-persistent units in
    /// forward and in backward visits, and of persistent units (once per step, at first use).
    fn stage3_gathers(&self) -> [(u64, u64); 3] {
        let visits = schedule::visits(self.spec, self.config.grad_accum.max(1));
        let kept = buffers::kept_graph_elems(self.spec, &self.layout, &self.buffers);
        let needs = schedule::gather_needs(&visits, &kept);
        let persistent = &self.buffers.persistent;
        let mut live = vec![false; self.layout.num_units()];
        let mut out = [(0, 0); 3];
        for (pos, visit) in visits.iter().enumerate() {
            for &u in &needs[pos] {
                if !live[u] {
                    live[u] = true;
                    let kind = match (persistent[u], visit.pass) {
                        (true, _) => 2,
                        (false, Pass::Forward) => 0,
                        (false, Pass::Backward) => 1,
                    };
                    out[kind].0 += self.layout.units[u].padded as u64;
                    out[kind].1 += 1;
                }
            }
            for &u in &needs[pos] {
                if !stays_gathered(&needs, persistent, pos, u) {
                    live[u] = false;
                }
            }
        }
        out
    }
}
