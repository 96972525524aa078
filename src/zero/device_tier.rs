//! The device tier in a compute device's own memory: a model whose units compute on a GPU may hold
//! there what the engine would otherwise hold in host memory for the device tier (each unit's
//! parameters in the compute dtype, the fp32 master, the gradients and Adam's moments) and do the
//! engine's arithmetic on it there: accumulate gradients, their squared sums (the norm, clipping
//! and the Inf/NaN verdict) and the Adam step. Then a step moves no parameter or gradient between
//! host and device; only the loss and one squared sum per unit come back.
//!
//! The engine keeps its schedule (micro-steps, the loss scaler, clipping, skipped steps, the step
//! counters) and its host buffers, which become the tier's mirror: written from the device
//! ([`crate::zero::Engine::sync_host`]) before a checkpoint or an export reads them, and copied to
//! the device after a load or a restore wrote them. This module knows no tensor library: the
//! model implements [`DeviceTier`] (the candle models do, [`crate::model::Candle::with_device_tier`]).
//!
//! It applies where Adam updates every element in the device tier: one rank (where every stage
//! holds everything) or stage 0 on any number of ranks (where every rank holds everything and the
//! ranks average their gradients), no offload, and an fp32 master (fp32 training or mixed
//! precision with one) — [`refusal`] says why not otherwise. On more than one rank each rank needs
//! a model of its own (the tier holds that rank's gradients): one per process under MPI, one per
//! thread in-process ([`crate::trainer::Trainer::with_rank_models`]).
//!
//! The ranks average their gradients through host memory: each unit's gradient comes down
//! ([`DeviceTier::grad_to_host`]) into the engine's host gradient buffer, goes through the same
//! buckets and all-reduce as the host tier's, and goes back ([`DeviceTier::grad_from_host`]).
//! Then every rank holds the same averaged gradient and takes the same Adam step on the device.

use super::config::{EngineConfig, OptimizerTier, ParamTier, Stage};
use super::precision::{Slice, SliceMut};
use super::unit::ModelError;
use crate::comm::DType;
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

    /// Bytes the tier holds for `numel` parameters computing in elements of `compute_bytes`:
    /// the parameters, an fp32 master unless they are f32, the gradients and the two moments.
    pub fn bytes(&self, numel: u64, compute_bytes: u64) -> u64 {
        let master = if compute_bytes == 4 { 0 } else { 4 };
        let (grads, moments) = (self.grads.size() as u64, self.moments.size() as u64);
        numel * (compute_bytes + master + grads + 2 * moments)
    }
}

/// A model's device memory holding the engine's device tier. Between [`DeviceTier::upload`] and
/// the next upload the model computes from the tier's parameters (the `params` slices the engine
/// passes are not read) and its backward adds into the tier's gradients (not into `grads`).
pub trait DeviceTier: Send + Sync {
    /// Set unit `unit`'s master, moments and parameters from the host mirror; zero its gradient.
    /// The parameters are the master rounded to `dtypes.params` (to nearest even, as the engine
    /// stores them), in the compute dtype; every Adam step rounds them so again.
    fn upload(
        &self,
        unit: usize,
        values: &UnitValues,
        dtypes: TierDtypes,
    ) -> Result<(), ModelError>;

    /// Unit `unit`'s master and moments, read back into host memory.
    fn download(&self, unit: usize) -> Result<UnitValues, ModelError>;

    /// Zero every unit's gradient (the start of a step).
    fn zero_grads(&self) -> Result<(), ModelError>;

    /// Write unit `unit`'s gradient into the first elements of `dst` (host memory of the
    /// gradient's dtype), for the ranks to average it there.
    fn grad_to_host(&self, unit: usize, dst: SliceMut<'_>) -> Result<(), ModelError>;

    /// Set unit `unit`'s gradient to the first elements of `src` (host memory of the gradient's
    /// dtype): the ranks' average.
    fn grad_from_host(&self, unit: usize, src: Slice<'_>) -> Result<(), ModelError>;

    /// The sum of the squares of each unit's gradient, in unit order (Inf/NaN if any element is).
    fn grad_squares(&self) -> Result<Vec<f64>, ModelError>;

    /// One Adam/AdamW update of every unit with the step's constants (the formula of
    /// [`crate::optim::adam`]), then the compute-dtype parameters from the new master.
    fn adam(&self, consts: &StepConsts) -> Result<(), ModelError>;

    /// Reserve the tier for one engine: `false` while another engine holds it (two in-process
    /// ranks given one model). The engine gives it back when dropped ([`Claim`]).
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
    if cfg.world_size != 1 && cfg.stage != Stage::Zero0 {
        return Some(
            "stages 1-3 on more than one rank shard the gradients and Adam's state over the \
             ranks in host memory, where the device tier keeps them whole (stage 0 keeps it on \
             the device on any number of ranks)",
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
        // Stage 0 replicates everything on any number of ranks.
        for world in [2, 3, 8] {
            assert_eq!(refusal(&EngineConfig::new(Stage::Zero0, world)), None);
        }
    }

    #[test]
    fn what_needs_host_memory_is_refused_with_its_reason() {
        for stage in [Stage::Zero1, Stage::Zero2, Stage::Zero3] {
            let two = EngineConfig::new(stage, 2);
            assert!(refusal(&two).unwrap().contains("more than one rank"));
        }
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
        assert_eq!(fp32.bytes(1000, 4), 16_000);
        // bf16 parameters and gradients, the fp32 master and moments: ZeRO's 16 bytes.
        let mut cfg = EngineConfig::new(Stage::Zero0, 1).with_precision(DType::BF16);
        cfg.grad_accum_dtype = DType::BF16;
        assert_eq!(TierDtypes::of(&cfg).bytes(1000, 2), 16_000);
        cfg.grad_accum_dtype = DType::F32;
        assert_eq!(TierDtypes::of(&cfg).bytes(1000, 2), 18_000);
        // bf16 moments: 4 bytes fewer.
        cfg.optimizer_states_dtype = DType::BF16;
        assert_eq!(TierDtypes::of(&cfg).bytes(1000, 2), 14_000);
    }
}
