//! The planner on zerodp's own engine. Given the model `train` builds
//! ([`ModelSize::from_model_spec`](super::ModelSize::from_model_spec)), the planner does not
//! estimate: it counts the model states over the engine's padded flat layout ([`FlatLayout`]),
//! sizes the buffers with the engine's own rules ([`crate::zero::buffers::plan`], the function the
//! engine allocates from) and counts the traffic by walking the engine's step schedule
//! ([`crate::zero::schedule`]) with the stage-3 coordinator's release rule
//! ([`stays_gathered`]). Its numbers then equal what a zerodp run reports in its `StepReport`.
//!
//! Layering: `memory::planner` calls into `zero`, as `zero` calls into `memory::accounting`; the
//! leaf modules stay acyclic (accounting <- zero <- planner). The sizing rules stay in
//! `zero::buffers`, next to the engine that allocates what they size, rather than moving to a
//! module both would share: the engine's rules keep one home and the planner is one more caller.

use super::cluster::{Cluster, Collective};
use super::memory::{EngineBuffers, Precision};
use super::traffic::{priced, CollectiveTraffic};
use super::PlanInput;
use crate::comm::DType;
use crate::zero::buffers::{self, BufferPlan};
use crate::zero::flat::FlatLayout;
use crate::zero::gather::stays_gathered;
use crate::zero::schedule::{self, Pass};
use crate::zero::unit::ModelSpec;
use crate::zero::{EngineConfig, Stage};

/// The engine's gradient-communication dtype for a training precision.
pub fn comm_dtype(precision: Precision) -> DType {
    match precision {
        Precision::Fp32 => DType::F32,
        Precision::Bf16 => DType::BF16,
        Precision::Fp16 => DType::F16,
    }
}

/// The engine configuration a zerodp run of `stage` would use for `input`: the buffer knobs as a
/// config resolves them for that stage (DeepSpeed's defaults for unset ones), the batch,
/// activation checkpointing and the cluster's world size. `zerodp train` maps a resolved config
/// onto the same fields.
pub fn engine_config(input: &PlanInput, stage: u8) -> EngineConfig {
    let s = input.buffers.resolve(stage);
    let size = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
    // ZeroChoice stages are 0-3; the config reader refuses any other.
    let stage = Stage::from_index(stage).unwrap_or(Stage::Zero3);
    // Mixed precision sets the parameter, reduction and accumulation dtypes together, as `train`
    // does for a bf16/fp16 config without `communication_data_type` / `grad_accum_dtype`.
    let mut cfg = EngineConfig::new(stage, size(input.cluster.world_size()))
        .with_precision(comm_dtype(input.precision));
    cfg.micro_batch = size(input.micro_batch);
    cfg.grad_accum = size(input.grad_accum.max(1));
    cfg.reduce_bucket_size = size(s.reduce_bucket_size);
    cfg.overlap_comm = s.overlap_comm;
    cfg.param_persistence_threshold = size(s.param_persistence_threshold);
    cfg.max_live_parameters = size(s.max_live_parameters);
    cfg.max_reuse_distance = size(s.max_reuse_distance);
    cfg.activation_checkpointing = input.activation_checkpointing;
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
        let config = engine_config(input, stage);
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
    pub fn padded_params(&self) -> u64 {
        self.layout.padded_numel() as u64
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

    /// The collectives of one optimizer step, call for call as the engine issues them:
    /// - stage 0: the gradient all-reduce, one call per bucket, on the last micro-step;
    /// - stages 1-3: the gradient reduce-scatter, one call per bucket region (stage 1 on the last
    ///   micro-step, stages 2-3 on every one);
    /// - stages 1-2: the all-gather of the updated shards after the step, bucketed the same way;
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
        let mut ops: Vec<(Collective, &'static str, u64, u64)> = Vec::new();
        let stage = self.config.stage;
        match stage {
            Stage::Zero0 => ops.push((
                Collective::AllReduce,
                "grads",
                padded * comm,
                padded.div_ceil(p.bucket_elems.max(1) as u64),
            )),
            _ => {
                let reductions = if stage.shards_grads() { ga } else { 1 };
                ops.push((
                    Collective::ReduceScatter,
                    "grads",
                    reductions * padded * comm,
                    reductions * shard.div_ceil(region),
                ));
            }
        }
        if matches!(stage, Stage::Zero1 | Stage::Zero2) {
            ops.push((
                Collective::AllGather,
                "params (after step)",
                padded * param,
                shard.div_ceil(region),
            ));
        }
        if stage == Stage::Zero3 {
            let [forward, backward, persistent] = self.stage3_gathers();
            for (what, (elems, calls)) in [
                ("params (forward)", forward),
                ("params (backward)", backward),
                ("persistent params", persistent),
            ] {
                ops.push((Collective::AllGather, what, elems * param, calls));
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
