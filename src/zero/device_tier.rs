//! The device tier in a compute device's own memory: a model whose units compute on a GPU may hold
//! there what the engine would otherwise hold in host memory for the device tier (each unit's
//! parameters in the compute dtype, the gradients, and the fp32 master and Adam's moments of the
//! part of it this rank updates) and do the engine's arithmetic on it there: accumulate gradients,
//! their squared sums (the norm, clipping and the Inf/NaN verdict) and the Adam step. Then a step
//! on one rank moves no parameter or gradient between host and device; only the loss and one
//! squared sum per unit come back.
//!
//! The engine keeps its schedule (micro-steps, the loss scaler, clipping, skipped steps, the step
//! counters) and its host buffers, which become the tier's mirror: written from the device
//! ([`crate::zero::Engine::sync_host`]) before a checkpoint or an export reads them, and copied to
//! the device after a load or a restore wrote them. This module knows no tensor library: the
//! model implements [`DeviceTier`] (the candle models do, [`crate::model::Candle::with_device_tier`]).
//!
//! It applies where the parameters stay whole on every rank: one rank (where every stage holds
//! everything) or stages 0-2 on any number of ranks, without offload, with an fp32 master (fp32
//! training or mixed precision with one) — [`refusal`] says why not otherwise. On more than one
//! rank each rank needs a model of its own (the tier holds that rank's gradients): one per process
//! under MPI, one per thread in-process ([`crate::trainer::Trainer::with_rank_models`]).
//!
//! The ranks reduce their gradients through host memory, once a step, after the last
//! micro-step's backward: each unit's gradient comes down ([`DeviceTier::grad_to_host`]) into the
//! engine's host gradient buffers and goes through the host tier's buckets and collectives (an
//! all-reduce at stage 0, a reduce-scatter at stages 1-2); the rank's part of the result goes
//! back ([`DeviceTier::grad_from_host`]). At stage 0 every rank then takes the same Adam step on
//! all of each unit. At stages 1-2 each rank holds the master and moments of its own shard only
//! (ZeRO's 12 bytes a parameter over N) and updates that shard; the updated shards come down
//! ([`DeviceTier::params_to_host`]), the host tier's all-gather joins them, and every rank's
//! parameters go back up whole ([`DeviceTier::params_from_host`]). The tier accumulates the whole
//! gradient on the device at stage 2 as at stage 1 (the backward adds into it), so stage 2 saves
//! the device no gradient memory over stage 1.

use std::ops::Range;

use super::engine_config::{EngineConfig, OptimizerTier, ParamTier, Stage};
use super::layout::FlatLayout;
use super::unit::{ModelError, ModelSpec};
use crate::flat::{DType, Slice, SliceMut};
use crate::optim::adam::StepConsts;

/// One unit's fp32 state as the engine's host mirror holds it (unpadded, the whole unit).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct UnitValues {
    /// The fp32 master weights (the parameters themselves in fp32 training).
    pub master: Vec<f32>,
    /// Adam's first moment.
    pub exp_avg: Vec<f32>,
    /// Adam's second moment.
    pub exp_avg_sq: Vec<f32>,
}

/// What the engine uploads of one unit ([`DeviceTier::upload`]).
#[derive(Clone, Debug)]
pub struct UnitUpload<'a> {
    /// The unit's elements (unpadded).
    pub numel: usize,
    /// The elements whose master and moments the tier holds and Adam updates: the whole unit on
    /// one rank and at stage 0, the rank's own shard at stages 1-2 (clipped to `numel`; empty
    /// where the shard is all padding).
    pub part: Range<usize>,
    /// The master and moments over `part`.
    pub values: UnitValues,
    /// Where `part` is not the whole unit: all of its parameters as the engine stores them (the
    /// last all-gather of the ranks' parts). `None` where the tier rounds them from the master.
    pub params: Option<Slice<'a>>,
    /// The engine's dtypes.
    pub dtypes: TierDtypes,
}

impl UnitUpload<'_> {
    /// Whether the rank updates every element of the unit.
    pub(crate) fn is_whole(&self) -> bool {
        self.part == (0..self.numel)
    }
}

/// The element types the engine keeps, which the tier keeps too so that it computes what the host
/// tier would: parameters rounded to `params` after every update, gradients accumulated in
/// `grads` (an fp16 gradient overflows to Inf as the host tier's does, and the step is skipped),
/// Adam's moments kept in `moments` (f32, or bf16 updated in f32 and rounded once a step).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierDtypes {
    pub params: DType,
    pub grads: DType,
    pub moments: DType,
}

impl TierDtypes {
    pub fn of(cfg: &EngineConfig) -> Self {
        TierDtypes {
            params: cfg.param_dtype,
            grads: cfg.grad_accum_dtype,
            moments: cfg.optimizer_states_dtype,
        }
    }

    /// Bytes the tier holds for a unit of `numel` parameters computing in elements of
    /// `compute_bytes`, `part` of which the rank updates: the parameters and the gradient whole;
    /// over the part the fp32 master (unless the parameters are stored and computed in f32 and
    /// the part is the whole unit: then they are the master), the two moments, and where the
    /// part is not the whole unit the ranks' reduced gradient of it.
    pub fn bytes(&self, numel: u64, part: u64, compute_bytes: u64) -> u64 {
        let (grads, moments) = (self.grads.size() as u64, self.moments.size() as u64);
        let whole = part == numel;
        let params_are_master = whole && compute_bytes == 4 && self.params == DType::F32;
        let master = if params_are_master { 0 } else { 4 };
        let reduced = if whole { 0 } else { grads };
        numel * (compute_bytes + grads) + part * (master + 2 * moments + reduced)
    }

    /// [`TierDtypes::bytes`] of every unit of `spec` on the busiest rank of `cfg`'s run: it
    /// updates its shard of each unit (clipped to the unit's elements) at stages 1-2 on more
    /// than one rank, and every element otherwise. Rank 0 is the busiest: its shard comes first,
    /// so padding shortens it last.
    pub fn rank_bytes(cfg: &EngineConfig, spec: &ModelSpec, compute_bytes: u64) -> u64 {
        let shards = cfg.world_size > 1 && cfg.stage != Stage::Zero0;
        let layout = FlatLayout::new(spec, cfg.world_size.max(1), 0);
        let dtypes = TierDtypes::of(cfg);
        (layout.units.iter())
            .map(|u| {
                let part = if shards {
                    u.shard_len.min(u.numel)
                } else {
                    u.numel
                };
                dtypes.bytes(u.numel as u64, part as u64, compute_bytes)
            })
            .sum()
    }
}

/// A model's device memory holding the engine's device tier. Between [`DeviceTier::upload`] and
/// the next upload the model computes from the tier's parameters (the `params` slices the engine
/// passes are not read) and its backward adds into the tier's gradients (not into `grads`).
pub trait DeviceTier: Send + Sync {
    /// Set unit `unit`'s master and moments over its part, and its parameters: from the upload's
    /// parameters where the part is not the whole unit, else the master rounded to
    /// `dtypes.params` (to nearest even, as the engine stores them), in the compute dtype. Zero
    /// its gradient.
    fn upload(&self, unit: usize, upload: UnitUpload<'_>) -> Result<(), ModelError>;

    /// Unit `unit`'s master and moments over its part, read back into host memory.
    fn download(&self, unit: usize) -> Result<UnitValues, ModelError>;

    /// Zero every unit's gradient (the start of a step).
    fn zero_grads(&self) -> Result<(), ModelError>;

    /// Write unit `unit`'s accumulated gradient (the whole unit) into the first elements of
    /// `dst` (host memory of any float dtype), for the ranks to reduce it there.
    fn grad_to_host(&self, unit: usize, dst: SliceMut<'_>) -> Result<(), ModelError>;

    /// Set the gradient Adam reads over unit `unit`'s part to the first elements of `src` (host
    /// memory of the gradient's dtype): the ranks' reduction of it.
    fn grad_from_host(&self, unit: usize, src: Slice<'_>) -> Result<(), ModelError>;

    /// The sum of the squares of the gradient Adam reads, over each unit's part, in unit order
    /// (Inf/NaN if any element is).
    fn grad_squares(&self) -> Result<Vec<f64>, ModelError>;

    /// One Adam/AdamW update of every unit's part with the step's constants (the formula of
    /// [`crate::optim::adam`]), then, where the part is the whole unit, the compute-dtype
    /// parameters from the new master.
    fn adam(&self, consts: &StepConsts) -> Result<(), ModelError>;

    /// Write the parameters of unit `unit`'s part, rounded from the master to `dst`'s dtype (the
    /// one the engine stores them in), into the first elements of `dst`: the rank's
    /// contribution to the all-gather.
    fn params_to_host(&self, unit: usize, dst: SliceMut<'_>) -> Result<(), ModelError>;

    /// Set unit `unit`'s compute parameters from the first elements of `src` (the whole unit, as
    /// the engine stores it): the all-gather of the ranks' parts.
    fn params_from_host(&self, unit: usize, src: Slice<'_>) -> Result<(), ModelError>;

    /// Reserve the tier for one engine: `false` while another engine holds it (two in-process
    /// ranks given one model). The engine gives it back when dropped (`Claim`).
    fn claim(&self) -> bool;

    /// Give back what [`DeviceTier::claim`] reserved.
    fn unclaim(&self);

    /// Bytes the tier holds in device memory now.
    fn bytes(&self) -> u64;

    /// Wait until the device has done the work queued so far (a GPU runs it asynchronously), so
    /// that the engine's phase times say where the device's time went.
    fn synchronize(&self) -> Result<(), ModelError>;
}

/// One engine's hold on a model's device tier ([`DeviceTier::claim`]), given back on drop: the
/// tier holds one rank's gradients and state, so the ranks of one process cannot share it.
pub(crate) struct Claim<'a>(&'a dyn DeviceTier);

impl<'a> Claim<'a> {
    /// The hold on `tier`, or `None` while another engine has it.
    pub(crate) fn take(tier: &'a dyn DeviceTier) -> Option<Self> {
        tier.claim().then_some(Claim(tier))
    }

    /// The tier held.
    pub(crate) fn tier(&self) -> &'a dyn DeviceTier {
        self.0
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.0.unclaim();
    }
}

/// Why `cfg` cannot keep its device tier in a compute device's memory, or `None` when it can.
/// The one place of this rule: the engine refuses a model's tier with it, the CLI asks it before
/// offering one.
pub fn refusal(cfg: &EngineConfig) -> Option<&'static str> {
    if cfg.world_size != 1 && cfg.stage == Stage::Zero3 {
        return Some(
            "stage 3 on more than one rank gathers each unit's parameters from the ranks' \
             shards for every visit, where the device tier keeps them whole (stages 0-2 keep it \
             on the device on any number of ranks)",
        );
    }
    if cfg.offload_optimizer != OptimizerTier::Device {
        return Some("offload_optimizer puts the master and Adam's moments in host memory or NVMe");
    }
    if cfg.offload_param != ParamTier::Device {
        return Some("offload_param puts the parameter shards in host memory or NVMe");
    }
    if cfg.is_mixed() && !cfg.keeps_fp32_master() {
        return Some("bf16 parameters that are their own master are updated on the CPU");
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zero::Stage;

    #[test]
    fn one_rank_without_offload_keeps_its_tier_on_the_device() {
        for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
            assert_eq!(refusal(&EngineConfig::new(stage, 1)), None);
            let bf16 = EngineConfig::new(stage, 1).with_precision(DType::BF16);
            assert_eq!(refusal(&bf16), None);
        }
        // Stages 0-2 keep every rank's parameters whole on any number of ranks.
        for world in [2, 3, 8] {
            for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2] {
                assert_eq!(refusal(&EngineConfig::new(stage, world)), None);
            }
        }
    }

    #[test]
    fn what_needs_host_memory_is_refused_with_its_reason() {
        let two = EngineConfig::new(Stage::Zero3, 2);
        assert!(refusal(&two)
            .unwrap()
            .contains("stage 3 on more than one rank"));
        let mut host = EngineConfig::new(Stage::Zero2, 1);
        host.offload_optimizer = OptimizerTier::Host;
        assert!(refusal(&host).unwrap().contains("offload_optimizer"));
        let mut param_host = EngineConfig::new(Stage::Zero3, 1);
        param_host.offload_param = ParamTier::Host;
        assert!(refusal(&param_host).unwrap().contains("offload_param"));
        let mut own_master = EngineConfig::new(Stage::Zero0, 1).with_precision(DType::BF16);
        own_master.bf16_master_weights = true;
        assert!(refusal(&own_master).unwrap().contains("own master"));
    }

    #[test]
    fn the_tier_holds_sixteen_bytes_a_parameter_in_fp32_and_in_bf16() {
        let fp32 = TierDtypes::of(&EngineConfig::new(Stage::Zero0, 1));
        assert_eq!(fp32.bytes(1000, 1000, 4), 16_000);
        // bf16 parameters and gradients, the fp32 master and moments: ZeRO's 16 bytes.
        let mut cfg = EngineConfig::new(Stage::Zero0, 1).with_precision(DType::BF16);
        cfg.grad_accum_dtype = DType::BF16;
        assert_eq!(TierDtypes::of(&cfg).bytes(1000, 1000, 2), 16_000);
        cfg.grad_accum_dtype = DType::F32;
        assert_eq!(TierDtypes::of(&cfg).bytes(1000, 1000, 2), 18_000);
        // bf16 moments: 4 bytes fewer.
        cfg.optimizer_states_dtype = DType::BF16;
        assert_eq!(TierDtypes::of(&cfg).bytes(1000, 1000, 2), 14_000);
        // f32 compute of bf16-stored parameters: the master is a tensor of its own.
        let mut stored_bf16 = TierDtypes::of(&EngineConfig::new(Stage::Zero0, 1));
        stored_bf16.params = DType::BF16;
        assert_eq!(stored_bf16.bytes(1000, 1000, 4), 20_000);
    }

    /// A model of one unit per size, each of one parameter.
    fn spec(sizes: &[usize]) -> ModelSpec {
        let unit = |(i, &n): (usize, &usize)| super::super::unit::UnitSpec {
            name: format!("u{i}"),
            params: vec![super::super::unit::ParamSpec {
                name: format!("u{i}.w"),
                shape: vec![n],
            }],
            uses: Vec::new(),
        };
        ModelSpec {
            units: sizes.iter().enumerate().map(unit).collect(),
        }
    }

    /// Stages 1-2 on N ranks: the parameters and gradient whole, ZeRO's 12 bytes of master and
    /// moments over N, and the reduced gradient of the shard: 2Ψ + 2Ψ + (12 + 2)Ψ/N in bf16.
    #[test]
    fn a_shard_holds_the_master_and_moments_over_n() {
        for stage in [Stage::Zero1, Stage::Zero2] {
            let mut cfg = EngineConfig::new(stage, 4).with_precision(DType::BF16);
            cfg.grad_accum_dtype = DType::BF16;
            assert_eq!(TierDtypes::of(&cfg).bytes(1000, 250, 2), 4_000 + 14 * 250);
            // 1024 = 4 shards of 256 (a multiple of 4 x 8): rank 0's is a quarter.
            assert_eq!(
                TierDtypes::rank_bytes(&cfg, &spec(&[1024]), 2),
                4_096 + 14 * 256
            );
            // 1001 pads to 1024: rank 0's shard is 256 elements. A unit of 10 pads to 32: rank
            // 0 holds 8 of its elements. A unit of 3 fits in rank 0's shard: it holds all of it,
            // and the other ranks' parts are padding.
            let uneven = spec(&[1001, 10, 3]);
            let want = (4_004 + 14 * 256) + (40 + 14 * 8) + 3 * 16;
            assert_eq!(TierDtypes::rank_bytes(&cfg, &uneven, 2), want);
            // fp32: the parameters are no longer the master (but where rank 0 updates a whole
            // unit they are).
            let fp32 = EngineConfig::new(stage, 4);
            let want = (8_192 + 16 * 256) + 3 * 16;
            assert_eq!(TierDtypes::rank_bytes(&fp32, &spec(&[1024, 3]), 4), want);
        }
        // Stage 0 and one rank update everything.
        for (stage, world) in [(Stage::Zero0, 4), (Stage::Zero2, 1)] {
            let mut cfg = EngineConfig::new(stage, world).with_precision(DType::BF16);
            cfg.grad_accum_dtype = DType::F32;
            assert_eq!(TierDtypes::rank_bytes(&cfg, &spec(&[1000]), 2), 18_000);
        }
    }
}
