//! The ZeRO engine: one rank's training step at stages 0-3 over a [`UnitModel`].
//!
//! A rank keeps its parameters and gradients in a [`FlatState`], whose [`StageState`] has one
//! variant per stage layout (replicated at stages 0-1, sharded gradients at stage 2, sharded
//! parameters with their [`Coordinator`] at stage 3), and what it knows about each unit (Adam
//! state, fp32 master, schedule facts) in one `UnitState` per unit.
//!
//! One step, in order (every rank runs the same sequence, so collectives always match), each phase
//! one method of [`Engine`] that [`Engine::train_step`] calls in turn:
//! 1. `zero_grads`, then for each micro-batch `forward` unit by unit and `backward` unit by unit.
//!    Stage 3 gathers each visit's units through the coordinator. Units under activation
//!    checkpointing, and at stage 3 units beyond `max_reuse_distance` or the `max_live_parameters`
//!    budget, run their forward without a graph (keeping only their input) and are gathered again
//!    and recomputed in backward: a candle graph holds the weights it was built from, so keeping it
//!    would keep the gathered weights alive. As soon as a unit's gradient is complete (after its
//!    last user's backward, `grad_complete`) it goes into the reduction [`Buckets`]: on every
//!    micro-step at stages 2-3, on the last one at stages 0-1 (`finish_reduction` waits for them).
//! 2. `global_norm_and_loss`: one two-float all-reduce, the global-batch loss and the squared
//!    gradient norm of all shards; `judge` turns it into the skip verdict and the gradient factor.
//! 3. `update`: Adam/AdamW on the rank's part (everything at stage 0, the own shard otherwise),
//!    with the clip factor fused into the gradient scale.
//! 4. `gather_updated`: stages 1-2 all-gather the updated shards into the full parameters; stage 3
//!    leaves them sharded.
//!
//! Mixed precision (`param_dtype` bf16/f16, see [`crate::flat`]): parameters, gradients and
//! buckets are 16-bit, the model reads parameters widened into f32 scratch and writes f32
//! gradients that are cast (or, at stages 0-1, accumulated) into the kept 16-bit ones; Adam updates
//! the fp32 master of the rank's part and writes its rounded copy in the same pass. The squared
//! norm of step 2 doubles as the overflow check: a non-finite total on every rank alike means
//! some rank's gradients held Inf/NaN, and the step is skipped everywhere (no Adam update, no
//! all-gather); fp16 multiplies the loss by the loss scale in the last unit's backward and divides
//! it out in the fused unscale-and-clip factor.

mod budget;
mod eval;
pub use budget::{check as check_device_budget, device_peak, offloaded_share, OverDeviceBudget};
pub use eval::EvalLoss;
mod nvme;
pub use nvme::stream_buffer_bytes;
mod parts;
mod snapshot;

pub use snapshot::{EngineCounters, UnitOptimizerState};

use super::buckets::{BucketMode, Buckets};
use super::buffers::{kept_graph_elems, plan, BufferPlan};
use super::device_tier::{self, DeviceTier, UnitUpload, UnitValues};
use super::engine_config::{EngineConfig, OptimizerTier, ParamTier, Stage};
use super::gather::{Coordinator, GatherError, Secondary};
use super::layout::FlatLayout;
use super::loss_scaler::{unscale_and_clip_factor, LossScaleError};
use super::schedule;
use super::shards::{ShardStore, SwappedShards};
use super::state::{FlatState, GradPool, StageState};
use super::step_policy::{StepPolicy, StepVerdict};
use super::unit::{BatchCounts, ForwardMode, ModelError, ModelSpec, UnitForward, UnitModel};
use crate::comm::{CommError, Communicator, ReduceOp, TrafficCounters};
use crate::flat::{Buffer, DType};
use crate::flat::{Slice, SliceMut};
use crate::memory::accounting::{MemoryKind, MemoryLedger, ModelStateBytes, Tier};
use crate::offload::OffloadError;
use crate::optim::adam::StepConsts;
use crate::optim::{adam_apply, adam_update, Moments, ShardPlace};
use std::ops::Range;
use std::time::{Duration, Instant};

/// Why the engine could not be built or could not take a step.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Model(#[from] ModelError),
    /// fp16 at its minimum loss scale, or too many skipped steps in a row.
    #[error(transparent)]
    LossScale(#[from] LossScaleError),
    #[error("invalid engine configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Offload(#[from] OffloadError),
    #[error(transparent)]
    Update(#[from] crate::optim::UpdateError),
    /// A device-tier allocation beyond `EngineConfig::device_budget`, refused before it is made.
    #[error(transparent)]
    DeviceBudget(Box<budget::OverDeviceBudget>),
    /// The held-out data of an evaluation could not be read.
    #[error("evaluation data: {0}")]
    EvalData(String),
    #[error(
        "step {step}: got {got} micro-batches, expected gradient_accumulation_steps = {expected}"
    )]
    MicroBatches {
        step: u64,
        got: usize,
        expected: usize,
    },
    /// The optimizer state was read while the newest values were in the device tier's memory.
    #[error(
        "the engine's host copy of the optimizer state is behind the device's: call \
         Engine::sync_host before reading it"
    )]
    HostBehind,
    #[error("unit {unit} ({name}): given {got} parameter values, the unit has {expected}")]
    ParamLength {
        unit: usize,
        name: String,
        expected: usize,
        got: usize,
    },
}

impl From<GatherError> for EngineError {
    fn from(e: GatherError) -> Self {
        match e {
            GatherError::Comm(e) => EngineError::Comm(e),
            GatherError::Offload(e) => EngineError::Offload(e),
        }
    }
}

/// Where a step's time went on this rank (wall-clock seconds; `comm` is time spent issuing,
/// copying into and waiting for collectives, not time they overlapped with compute).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct PhaseTimes {
    pub forward: f64,
    /// Forward runs again in backward (stage 3 and activation checkpointing).
    pub recompute: f64,
    pub backward: f64,
    pub comm: f64,
    pub optimizer: f64,
}

/// What one optimizer step did, on this rank.
#[derive(Clone, Debug)]
pub struct StepReport {
    /// Optimizer steps taken so far, this one included.
    pub step: u64,
    /// The global-batch mean loss (the same on every rank).
    pub loss: f32,
    /// The global gradient norm before clipping (unscaled; Inf/NaN on a skipped step).
    pub grad_norm: f32,
    /// The loss scale this step's loss was multiplied by (1 without fp16 loss scaling).
    pub loss_scale: f32,
    /// Whether the step was skipped (its gradients held Inf/NaN on some rank): no parameter or
    /// Adam update.
    pub skipped: bool,
    /// On a skipped step, the units whose gradients held Inf/NaN on some rank.
    pub non_finite_units: Vec<String>,
    /// fp16: DeepSpeed's log line when the loss scale changed or a step overflowed.
    pub scale_message: Option<String>,
    pub lr: f32,
    /// Samples this rank trained on in this step (as the model counts them).
    pub samples: usize,
    /// Tokens this rank trained on in this step (as the model counts them).
    pub tokens: usize,
    pub elapsed: Duration,
    /// This rank's traffic during the step.
    pub traffic: TrafficCounters,
    /// What the rank holds at the end of the step.
    pub memory: ModelStateBytes,
    /// The largest total the rank has held so far.
    pub peak_bytes: u64,
    /// The largest the stage-3 gather pool has been so far (0 at other stages).
    pub peak_gather_bytes: u64,
    /// Bytes the device tier holds in the model's device memory (a GPU's) when the model holds it
    /// there ([`super::device_tier`]), 0 otherwise. `memory` is then the host buffers, its mirror.
    pub device_tier_bytes: u64,
    /// Bytes read from and written to this rank's NVMe swap files (optimizer states and parameter
    /// shards) so far (`(0, 0)` without NVMe offload).
    pub swap_io: (u64, u64),
    pub phases: PhaseTimes,
}

/// One rank's engine. Every rank of a world builds one with the same model, configuration and
/// seed, and calls [`Engine::train_step`] with its own micro-batches of the same global batch.
///
/// ```no_run
/// use zerodp::comm::{run_ranks, CommOptions};
/// use zerodp::model::{GptConfig, GptModel};
/// use zerodp::data::{Corpus, DataLoader};
/// use zerodp::zero::{Engine, EngineConfig, EngineError, Stage};
///
/// let model = GptModel::new(GptConfig::tiny()).unwrap();
/// let data = DataLoader::new(Corpus::from_text("t", &"some text ".repeat(100)), 16, 0).unwrap();
/// let mut cfg = EngineConfig::new(Stage::Zero3, 2);
/// cfg.micro_batch = 4;
/// run_ranks(2, CommOptions::default(), |comm, rank| {
///     let mut engine = Engine::new(&model, &*comm, cfg.clone())?;
///     for step in 0..10 {
///         let batch = data.micro_batch(step, 8, 2, rank, 4, 0).unwrap();
///         let report = engine.train_step(&[batch], 1e-3)?;
///         println!("rank {rank} step {} loss {}", report.step, report.loss);
///     }
///     Ok::<_, EngineError>(())
/// })
/// .unwrap();
/// ```
pub struct Engine<'a, M: UnitModel> {
    model: &'a M,
    comm: &'a dyn Communicator,
    cfg: EngineConfig,
    spec: ModelSpec,
    layout: FlatLayout,
    plan: BufferPlan,
    /// The parameters and gradients, as the stage keeps them.
    state: FlatState,
    /// What the engine keeps per unit besides its flat buffers, in unit order.
    units: Vec<UnitState>,
    buckets: Buckets,
    /// Mixed precision: the f32 scratch the 16-bit parameters of a visit are widened into, the
    /// units it reads side by side (`plan.param_scratch` elements).
    widened: Vec<f32>,
    /// Loss scale and Inf/NaN skipping.
    policy: StepPolicy,
    ledger: MemoryLedger,
    /// `offload_optimizer` to NVMe: Adam's moments in the rank's swap file.
    nvme: Option<nvme::NvmeMoments>,
    step: u64,
    /// The two floats of the step's all-reduce (loss, squared norm), reused every step.
    scalars: Vec<f32>,
    phases: PhaseTimes,
    /// This engine's hold on the model's device tier ([`device_tier`]), when the model offers
    /// one ([`Engine::device`]); given back when the engine is dropped.
    claim: Option<device_tier::Claim<'a>>,
    /// The host buffers hold values the device tier does not have yet (at start, after a load
    /// or a restore): uploaded before the next step.
    device_behind: bool,
    /// The device tier holds values the host buffers do not have yet (after a step there).
    host_behind: bool,
}

/// What the engine keeps about one unit besides its flat buffers.
struct UnitState {
    /// The units the unit's forward and backward read: itself, then its `uses`.
    reads: Vec<usize>,
    /// The units whose gradients are complete once this unit's backward is done.
    complete_after: Vec<usize>,
    /// Whether its forward runs without a graph and is recomputed in backward.
    recompute: bool,
    /// Elements of weights its kept stage-3 forward graph holds until backward (0 for units that
    /// are recomputed, and for the last unit, whose gathered parameters simply stay).
    kept_graph: usize,
    /// The part of its flat buffer this rank updates: all of it at stage 0, its own shard
    /// otherwise.
    updated: Range<usize>,
    /// Adam state over `updated` (empty when the moments are in the NVMe swap file).
    adam: Moments,
    /// Whether Adam's moments are in the NVMe swap file rather than in `adam`: NVMe offload,
    /// for the units a partial offload covers ([`EngineConfig::optimizer_offloaded`]).
    swapped: bool,
    /// Mixed precision: the fp32 master weights over `updated` (`None` in fp32, where the
    /// parameters are their own master).
    master: Option<Vec<f32>>,
}

/// What a unit's forward leaves for its backward.
enum Stash<M: UnitModel> {
    /// A recomputed unit: its input, to run the forward again from in backward.
    Input(Option<M::Act>),
    /// What the forward kept for backward.
    Saved(Option<M::Saved>),
}

/// The step's agreed scalars.
struct GlobalNorm {
    /// The global-batch mean loss.
    loss: f32,
    /// The squared norm of the reduced gradient (loss-scaled under fp16).
    sq: f64,
    /// This rank's squared sum per unit of the reduced gradient it holds.
    unit_sq: Vec<f64>,
}

/// What the step does with its gradients, and what it reports about them.
struct Outcome {
    loss: f32,
    verdict: StepVerdict,
    non_finite_units: Vec<String>,
    /// The unscaled global norm before clipping.
    grad_norm: f32,
    /// The factor Adam applies to the gradients: unscale and clip in one.
    grad_scale: f32,
}

impl<'a, M: UnitModel> Engine<'a, M> {
    /// Lay out and initialise this rank's share of the model (from `cfg.seed`, the same on every
    /// rank) and allocate every buffer up front.
    pub fn new(
        model: &'a M,
        comm: &'a dyn Communicator,
        cfg: EngineConfig,
    ) -> Result<Self, EngineError> {
        let spec = model.spec().clone();
        validate(&spec, &cfg, comm)?;
        budget::check(&spec, &cfg, comm.rank())?;
        let layout = FlatLayout::new(&spec, cfg.world_size, comm.rank());
        let plan = plan(&spec, &cfg);
        let precision = cfg.precision_name();
        let device = model.device_tier();
        if let Some(why) = device.and_then(|_| device_tier::refusal(&cfg)) {
            return Err(EngineError::Config(format!(
                "the model keeps the device tier in its device's memory, which this run cannot: \
                 {why}. Build the model without it (Candle::with_device_tier(false))"
            )));
        }
        let claim = match device {
            None => None,
            Some(tier) => Some(device_tier::Claim::take(tier).ok_or_else(|| {
                EngineError::Config(
                    "the model's device tier is held by another rank's engine: it holds one \
                     rank's gradients and state, so give each in-process rank a model of its \
                     own, or build the model without it (Candle::with_device_tier(false))"
                        .into(),
                )
            })?),
        };
        let policy = StepPolicy::new(&cfg.overflow, cfg.max_skipped_steps, precision)?;

        let (params, masters) = init_params(model, &cfg, &layout);
        let units = unit_states(&spec, &cfg, &layout, &plan, masters);
        let nvme = match &cfg.offload_optimizer {
            OptimizerTier::Nvme {
                dir,
                chunk,
                buffer_count,
            } => {
                let lens = swapped_moment_lens(&layout, &cfg);
                let (rank, chunk, count) = (comm.rank(), *chunk, *buffer_count);
                let dtype = cfg.optimizer_states_dtype;
                Some(nvme::NvmeMoments::new(
                    dir, rank, dtype, &lens, chunk, count,
                )?)
            }
            _ => None,
        };
        let state = flat_state(&spec, &cfg, &layout, &plan, &units, params, comm.rank())?;
        let ledger = initial_ledger(&spec, &cfg, comm.rank(), nvme.as_ref(), &state);
        let buckets = Buckets::new(&plan, cfg.world_size, cfg.overlap_comm);
        let buckets = match cfg.qgz_active() {
            true => buckets.with_quantized_gradients(&plan, qgz_hosts(&cfg, comm)),
            false => buckets,
        };
        let widened = crate::flat::zeroed_vec(plan.param_scratch);
        // A model reused from an earlier run may keep that run's parameters.
        model.parameters_changed();
        Ok(Engine {
            model,
            comm,
            spec,
            layout,
            plan,
            state,
            units,
            buckets,
            widened,
            policy,
            ledger,
            nvme,
            step: 0,
            scalars: vec![0.0; 2],
            phases: PhaseTimes::default(),
            cfg,
            claim,
            device_behind: true,
            host_behind: false,
        })
    }

    /// The model's device memory holding the device tier, when the model offers one.
    fn device(&self) -> Option<&'a dyn DeviceTier> {
        self.claim.as_ref().map(device_tier::Claim::tier)
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }
    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }
    pub fn buffer_plan(&self) -> &BufferPlan {
        &self.plan
    }
    pub fn memory(&self) -> &MemoryLedger {
        &self.ledger
    }
    /// Adam's betas from the next step on: a momentum-cycling scheduler (OneCycle's
    /// `cycle_momentum`) sets them before each step, as DeepSpeed writes them into the optimizer.
    pub fn set_betas(&mut self, beta1: f64, beta2: f64) {
        self.cfg.adam.beta1 = beta1;
        self.cfg.adam.beta2 = beta2;
    }

    /// Optimizer steps taken so far.
    pub(crate) fn steps_done(&self) -> u64 {
        self.step
    }

    /// Bring the host buffers up to the device tier's values (the master, the moments and the
    /// parameters rounded from the master, over the part of each unit this rank updates), when
    /// the model holds the tier and a step changed it. A checkpoint calls it before reading the
    /// optimizer state; a no-op otherwise.
    pub fn sync_host(&mut self) -> Result<(), EngineError> {
        let Some(device) = self.device().filter(|_| self.host_behind) else {
            return Ok(());
        };
        for u in 0..self.layout.num_units() {
            let v = device.download(u)?;
            let values = (&v.master[..], &v.exp_avg[..], &v.exp_avg_sq[..]);
            self.write_host(u, self.restored_range(u), values)?;
        }
        self.host_behind = false;
        Ok(())
    }

    /// Copy the host buffers into the model's device tier, when they changed since it last had
    /// them (the start, a load, a restore): the master and moments over the part of each unit
    /// this rank updates ([`Engine::restored_range`]), and the whole unit's parameters where that
    /// is not all of it.
    fn upload_if_behind(&mut self) -> Result<(), EngineError> {
        let Some(device) = self.device().filter(|_| self.device_behind) else {
            return Ok(());
        };
        for u in 0..self.layout.num_units() {
            let (numel, part) = (self.layout.units[u].numel, self.restored_range(u));
            let us = &self.units[u];
            let local = part.start - us.updated.start..part.end - us.updated.start;
            let master = match &us.master {
                Some(m) => m[local.clone()].to_vec(),
                None => self.fp32_updated_params(u)?[local.clone()].to_vec(),
            };
            let (m, v) = us.adam.f32_range(local);
            let whole = part == (0..numel);
            let upload = UnitUpload {
                numel,
                part,
                values: UnitValues {
                    master,
                    exp_avg: m.into_owned(),
                    exp_avg_sq: v.into_owned(),
                },
                params: (!whole).then(|| self.state.params(u).slice(0..numel)),
                dtypes: device_tier::TierDtypes::of(&self.cfg),
            };
            device.upload(u, upload)?;
        }
        self.device_behind = false;
        Ok(())
    }

    /// Replace unit `unit`'s parameters (unpadded, `UnitSpec` order) on this rank. Every rank must
    /// pass the same values (for example read from the same `--init` file).
    pub(crate) fn load_unit_params(
        &mut self,
        unit: usize,
        values: &[f32],
    ) -> Result<(), EngineError> {
        let ul = self.layout.units[unit];
        if values.len() != ul.numel {
            return Err(EngineError::ParamLength {
                unit,
                name: self.spec.units[unit].name.clone(),
                expected: ul.numel,
                got: values.len(),
            });
        }
        self.sync_host()?;
        self.device_behind = true;
        let us = &mut self.units[unit];
        if let Some(m) = &mut us.master {
            let part = &us.updated;
            m.fill(0.0);
            let end = part.end.min(ul.numel);
            if part.start < end {
                m[..end - part.start].copy_from_slice(&values[part.start..end]);
            }
        }
        match &mut self.state.stage {
            StageState::ShardedParams { coordinator, .. } => {
                coordinator.invalidate()?;
                let own = self.layout.own_shard(unit);
                coordinator.shards_mut().modify(unit, |shard| {
                    shard.fill_zero();
                    let end = own.end.min(ul.numel);
                    if own.start < end {
                        shard
                            .slice_mut(0..end - own.start)
                            .copy_from(Slice::F32(&values[own.start..end]));
                    }
                })?;
            }
            StageState::Replicated { params, .. } | StageState::ShardedGrads { params, .. } => {
                params[unit]
                    .slice_mut(0..ul.numel)
                    .copy_from(Slice::F32(values))
            }
        }
        self.model.parameters_changed();
        Ok(())
    }

    /// The full, unpadded parameters of every unit: under mixed precision the fp32 master weights.
    /// A collective at stage 3, and at stages 1-3 under mixed precision (every rank must call it);
    /// a copy otherwise.
    pub fn full_params(&mut self) -> Result<Vec<Vec<f32>>, EngineError> {
        self.sync_host()?;
        let mut out = Vec::with_capacity(self.layout.num_units());
        let sharded_master = self.cfg.stage.shards_optimizer();
        let gather = |shard: Buffer, padded: usize| -> Result<Vec<f32>, EngineError> {
            let full = self
                .comm
                .all_gather(shard, Buffer::zeros(DType::F32, padded));
            Ok(full.wait_pair()?.1.into_f32().expect("f32 gather"))
        };
        for (u, ul) in self.layout.units.iter().enumerate() {
            let mut full = match (&self.units[u].master, &self.state.stage) {
                (Some(m), _) if sharded_master => gather(Buffer::F32(m.clone()), ul.padded)?,
                (Some(m), _) => m.clone(),
                // Without an fp32 master the parameters are the master (bf16 ones widened).
                (None, StageState::ShardedParams { coordinator, .. }) => {
                    let shard = coordinator.shards().read(u)?;
                    let shard = shard.range_f32(0..shard.len()).into_owned();
                    gather(Buffer::F32(shard), ul.padded)?
                }
                (None, _) => {
                    let params = self.state.params(u);
                    params.range_f32(0..params.len()).into_owned()
                }
            };
            full.truncate(ul.numel);
            out.push(full);
        }
        Ok(out)
    }

    /// One optimizer step on this rank's micro-batches (`grad_accum` of them) at learning rate `lr`.
    pub fn train_step(
        &mut self,
        micro_batches: &[M::Batch],
        lr: f32,
    ) -> Result<StepReport, EngineError> {
        if micro_batches.len() != self.cfg.grad_accum {
            return Err(EngineError::MicroBatches {
                step: self.step + 1,
                got: micro_batches.len(),
                expected: self.cfg.grad_accum,
            });
        }
        let start = Instant::now();
        let traffic_before = self.comm.traffic();
        self.phases = PhaseTimes::default();
        let loss_scale = self.policy.loss_scale();
        self.upload_if_behind()?;
        self.zero_grads()?;
        let mut loss_sum = 0.0f64;
        let mut counts = BatchCounts::default();
        let weights = self.micro_weights(micro_batches)?;
        for (micro, batch) in micro_batches.iter().enumerate() {
            let (loss, stash) = self.forward(micro, batch)?;
            self.backward((micro, weights[micro]), batch, stash)?;
            self.finish_reduction(micro)?;
            loss_sum += f64::from(loss) * weights[micro];
            counts = counts + self.model.batch_counts(batch);
        }
        let t = Instant::now();
        self.release_all()?;
        let norm = self.global_norm_and_loss(loss_sum)?;
        let outcome = self.judge(norm, loss_scale)?;
        self.phases.comm += t.elapsed().as_secs_f64();
        if !outcome.verdict.skipped {
            self.update(lr, outcome.grad_scale)?;
            match self.device() {
                None => {
                    self.gather_updated()?;
                    self.model.parameters_changed();
                }
                Some(device) => self.gather_device_params(device)?,
            }
        }
        self.step += 1;
        Ok(self.report(outcome, lr, counts, start, &traffic_before))
    }

    /// Start a step: zero the kept gradients (in the device tier, when the model holds it) and set
    /// the buckets to the stage's reduction.
    fn zero_grads(&mut self) -> Result<(), EngineError> {
        self.buckets.set_mode(match self.cfg.stage {
            Stage::Zero0 => BucketMode::AllReduce,
            Stage::Zero1 => BucketMode::ReduceScatterStore,
            Stage::Zero2 | Stage::Zero3 => BucketMode::ReduceScatterAccumulate,
        });
        let device = self.device();
        if let Some(device) = device {
            device.zero_grads()?;
        }
        // One rank's device tier reduces nothing through the host buffers.
        let one_rank_device = device.is_some() && self.cfg.world_size == 1;
        match &mut self.state.stage {
            // The device tier accumulates the full gradients.
            StageState::Replicated { .. } if device.is_some() => {}
            _ if one_rank_device => {}
            StageState::Replicated {
                kept_grads: Some(kept),
                ..
            } => kept.iter_mut().for_each(|g| g.fill_zero()),
            StageState::Replicated {
                kept_grads: None, ..
            } => self.state.grads.iter_mut().for_each(|g| g.fill(0.0)),
            StageState::ShardedGrads { grad_shards, .. }
            | StageState::ShardedParams { grad_shards, .. } => grad_shards.fill_zero(),
        }
        Ok(())
    }

    /// Forward of micro-batch `micro`, unit by unit: returns its loss and what each unit left
    /// for its backward.
    fn forward(
        &mut self,
        micro: usize,
        batch: &M::Batch,
    ) -> Result<(f32, Vec<Stash<M>>), EngineError> {
        let n = self.layout.num_units();
        let mut stash = Vec::with_capacity(n);
        let mut x: Option<M::Act> = None;
        let mut loss = None;
        for u in 0..n {
            let pos = micro * 2 * n + u;
            self.acquire(pos)?;
            let recompute = self.units[u].recompute;
            let mode = match recompute {
                true => ForwardMode::NoGrad,
                false => ForwardMode::Train,
            };
            let t = Instant::now();
            let out = self.run_forward(u, x.as_ref(), batch, mode)?;
            self.phases.forward += t.elapsed().as_secs_f64();
            let kept = (self.units[u].kept_graph * 4) as u64;
            self.ledger.alloc(MemoryKind::Gather, kept);
            self.release(pos);
            stash.push(match recompute {
                true => Stash::Input(x),
                false => Stash::Saved(out.saved),
            });
            x = out.output;
            if out.loss.is_some() {
                loss = out.loss;
            }
        }
        let loss = loss.ok_or_else(|| {
            ModelError::Invalid(format!(
                "the last unit ({}) returned no loss",
                self.spec.units[n - 1].name
            ))
        })?;
        Ok((loss, stash))
    }

    /// Each micro-batch's weight in the step's loss, against an equal share: 1 each, or under
    /// [`EngineConfig::loss_per_token`] its loss terms' share of the global batch's
    /// (`n_m x grad_accum x world / total`; 0 everywhere when the batch has none).
    fn micro_weights(&mut self, micro_batches: &[M::Batch]) -> Result<Vec<f64>, EngineError> {
        if !self.cfg.loss_per_token {
            return Ok(vec![1.0; micro_batches.len()]);
        }
        let local: Vec<usize> = micro_batches
            .iter()
            .map(|b| self.model.loss_tokens(b))
            .collect();
        let (_, total) = eval::sum_over_ranks(self.comm, 0.0, local.iter().sum::<usize>() as u64)?;
        let share = (self.cfg.grad_accum * self.cfg.world_size) as f64;
        Ok(local
            .iter()
            .map(|&n| match total {
                0 => 0.0,
                _ => n as f64 * share / total as f64,
            })
            .collect())
    }

    /// Backward of micro-batch `micro` (of weight `factor`, [`Engine::micro_weights`]), from the
    /// last unit to the first. Each unit's gradient goes on (see [`Engine::grad_complete`]) as
    /// soon as its last user's backward is done.
    fn backward(
        &mut self,
        (micro, factor): (usize, f64),
        batch: &M::Batch,
        stash: Vec<Stash<M>>,
    ) -> Result<(), EngineError> {
        let n = self.layout.num_units();
        let reduce = self.reduces_at(micro);
        // fp16 scales the loss (and so every gradient) by the loss scale; 1 otherwise.
        let weight = (self.policy.loss_scale() * factor / self.cfg.grad_accum as f64) as f32;
        let model = self.model;
        let mut grad: Option<M::Act> = None;
        for (u, stashed) in stash.into_iter().enumerate().rev() {
            let pos = micro * 2 * n + 2 * n - 1 - u;
            self.acquire(pos)?;
            let saved = self.saved_for_backward(u, stashed, batch)?;
            self.provide_grads(u);
            let t = Instant::now();
            // With the device tier on the model's device, backward adds into its gradients.
            let mut grads = match self.device() {
                Some(_) => Vec::new(),
                None => grad_slices(&mut self.state.grads, &self.units[u].reads, &self.layout),
            };
            grad = model.backward(u, saved, grad.as_ref(), weight, &mut grads)?;
            self.phases.backward += t.elapsed().as_secs_f64();
            let kept = (self.units[u].kept_graph * 4) as u64;
            self.ledger.free(MemoryKind::Gather, kept);
            self.release(pos);
            if self.device().is_some() {
                continue;
            }
            let t = Instant::now();
            for i in 0..self.units[u].complete_after.len() {
                self.grad_complete(self.units[u].complete_after[i], reduce)?;
            }
            self.phases.comm += t.elapsed().as_secs_f64();
        }
        // A device runs backward asynchronously: its time is backward's, not the next phase's.
        if let Some(device) = self.device() {
            let t = Instant::now();
            device.synchronize()?;
            self.phases.backward += t.elapsed().as_secs_f64();
            // The tier accumulates whole gradients over the micro-steps (at every stage), so the
            // ranks reduce them once, after the last.
            if micro + 1 == self.cfg.grad_accum && self.cfg.world_size > 1 {
                self.reduce_device_grads(device)?;
            }
        }
        Ok(())
    }

    /// The device tier on more than one rank: reduce every unit's gradient over the ranks
    /// through host memory with the host tier's buckets and collectives (each unit's starts as
    /// soon as its gradient is down): into the full gradient buffers at stages 0-1 (all-reduced,
    /// or reduce-scattered into the own shard), through a transient buffer into the gradient
    /// shards at stage 2. Then give each unit's part of the result back to the device.
    fn reduce_device_grads(&mut self, device: &dyn DeviceTier) -> Result<(), EngineError> {
        let t = Instant::now();
        let n = self.layout.num_units();
        for u in 0..n {
            let ul = self.layout.units[u];
            let dst = match self.state.stage {
                StageState::Replicated { .. } => self.state.full_grad_mut(u, 0..ul.numel),
                StageState::ShardedGrads { .. } | StageState::ShardedParams { .. } => {
                    self.state.grads[u] = self.state.grad_pool.take(u, ul.padded);
                    SliceMut::F32(&mut self.state.grads[u][..ul.numel])
                }
            };
            device.grad_to_host(u, dst)?;
            self.buckets
                .push(self.comm, u, &mut self.state, &self.layout)?;
        }
        self.buckets
            .flush(self.comm, &mut self.state, &self.layout)?;
        for u in 0..n {
            let part = self.restored_range(u);
            device.grad_from_host(u, self.reduced_grad(u).range(0..part.len()))?;
        }
        self.phases.comm += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// What unit `unit`'s backward starts from: what its forward kept or, for a recomputed unit,
    /// what a forward run again from its input keeps.
    fn saved_for_backward(
        &mut self,
        unit: usize,
        stashed: Stash<M>,
        batch: &M::Batch,
    ) -> Result<M::Saved, EngineError> {
        let saved = match stashed {
            Stash::Saved(saved) => saved,
            Stash::Input(x) => {
                let t = Instant::now();
                let out = self.run_forward(unit, x.as_ref(), batch, ForwardMode::Train)?;
                self.phases.recompute += t.elapsed().as_secs_f64();
                out.saved
            }
        };
        let missing = || {
            ModelError::Invalid(format!(
                "unit {} ({}) returned nothing to backward from a Train forward",
                unit, self.spec.units[unit].name
            ))
        };
        Ok(saved.ok_or_else(missing)?)
    }

    /// Run unit `unit`'s forward on the parameters it reads.
    fn run_forward(
        &mut self,
        unit: usize,
        input: Option<&M::Act>,
        batch: &M::Batch,
        mode: ForwardMode,
    ) -> Result<UnitForward<M::Act, M::Saved>, ModelError> {
        self.widen_params(unit);
        let params = self.param_slices(unit);
        self.model.forward(unit, &params, input, batch, mode)
    }

    /// Transient gradients: give every unit that unit `unit`'s backward writes into a zeroed f32
    /// buffer, unless it holds one already (a tied unit, from an earlier user's backward).
    fn provide_grads(&mut self, unit: usize) {
        if !self.state.stage.transient_grads() || self.device().is_some() {
            return;
        }
        for &k in &self.units[unit].reads {
            if self.state.grads[k].is_empty() {
                self.state.grads[k] = self.state.grad_pool.take(k, self.layout.units[k].padded);
            }
        }
    }

    /// Whether micro-step `micro` reduces its gradients: every one at stages 2-3, which keep only
    /// their shard of them, the last one at stages 0-1, which accumulate full gradients until then.
    fn reduces_at(&self, micro: usize) -> bool {
        match self.state.stage {
            StageState::Replicated { .. } => micro + 1 == self.cfg.grad_accum,
            StageState::ShardedGrads { .. } | StageState::ShardedParams { .. } => true,
        }
    }

    /// Unit `unit`'s gradient of this micro-step is complete: accumulate it where the stage keeps
    /// it and, if the micro-step reduces, push it into the buckets.
    fn grad_complete(&mut self, unit: usize, reduce: bool) -> Result<(), CommError> {
        match &mut self.state.stage {
            StageState::Replicated { kept_grads, .. } => {
                if let Some(kept) = kept_grads {
                    // 16-bit accumulation: the model's f32 gradient is added into the kept one.
                    kept[unit]
                        .all_mut()
                        .add(Slice::F32(&self.state.grads[unit]));
                    self.state.grad_pool.give(&mut self.state.grads[unit]);
                }
                if reduce {
                    self.buckets
                        .push(self.comm, unit, &mut self.state, &self.layout)?;
                }
            }
            StageState::ShardedGrads { .. } | StageState::ShardedParams { .. } => {
                // The push consumes the transient gradient: a bucket copies it and frees it at
                // once, or its reduce-scatter in place frees it when done.
                self.buckets
                    .push(self.comm, unit, &mut self.state, &self.layout)?;
            }
        }
        Ok(())
    }

    /// After micro-step `micro`'s backward: launch the last reduction bucket, if the micro-step
    /// reduces, and wait for all of them.
    fn finish_reduction(&mut self, micro: usize) -> Result<(), CommError> {
        if self.reduces_at(micro) && self.device().is_none() {
            let t = Instant::now();
            self.buckets
                .flush(self.comm, &mut self.state, &self.layout)?;
            self.phases.comm += t.elapsed().as_secs_f64();
        }
        Ok(())
    }

    /// Stage 3: release every gathered unit (the parameters are about to change) and start the
    /// next step's visits.
    fn release_all(&mut self) -> Result<(), CommError> {
        if let StageState::ShardedParams { coordinator, .. } = &mut self.state.stage {
            coordinator.invalidate()?;
        }
        Ok(())
    }

    /// The global-batch loss and the squared norm of the reduced gradient, in one two-float
    /// all-reduce. The squared norm also carries the overflow verdict: a sum with an Inf/NaN term
    /// is Inf/NaN, so every rank sees a non-finite total exactly when some rank's shard held one.
    fn global_norm_and_loss(&mut self, loss_sum: f64) -> Result<GlobalNorm, EngineError> {
        let unit_sq: Vec<f64> = match self.device() {
            Some(device) => device.grad_squares()?,
            None => (0..self.layout.num_units())
                .map(|u| self.reduced_grad(u).sum_of_squares())
                .collect(),
        };
        // Stage 0: every rank holds the whole averaged gradient, its norm needs no communication.
        let local = self.cfg.stage == Stage::Zero0;
        let local_sq = if local { 0.0 } else { unit_sq.iter().sum() };
        let (ga, world) = (self.cfg.grad_accum as f64, self.cfg.world_size as f64);
        let mut scalars = std::mem::take(&mut self.scalars);
        scalars[0] = (loss_sum / ga / world) as f32;
        scalars[1] = local_sq as f32;
        let reduced = self
            .comm
            .all_reduce(Buffer::F32(scalars), ReduceOp::Sum)
            .wait_one()?;
        self.scalars = crate::comm::returned_f32(reduced, self.layout.rank)?;
        let sq = match local {
            true => unit_sq.iter().sum::<f64>(),
            false => f64::from(self.scalars[1]),
        };
        Ok(GlobalNorm {
            loss: self.scalars[0],
            sq,
            unit_sq,
        })
    }

    /// Unit `unit`'s reduced gradient as this rank holds it after the reductions: all of it at
    /// stage 0, the own shard otherwise.
    fn reduced_grad(&self, unit: usize) -> Slice<'_> {
        match &self.state.stage {
            StageState::Replicated { .. } => {
                self.state.full_grad(unit, self.units[unit].updated.clone())
            }
            StageState::ShardedGrads { grad_shards, .. }
            | StageState::ShardedParams { grad_shards, .. } => {
                grad_shards.slice(self.layout.shard_slot(unit))
            }
        }
    }

    /// Decide the step from its agreed norm (loss-scaled by `loss_scale`): skipped, naming the
    /// units that overflowed, when the norm is not finite; the fused unscale-and-clip factor.
    fn judge(&mut self, norm: GlobalNorm, loss_scale: f64) -> Result<Outcome, EngineError> {
        let finite = norm.sq.is_finite();
        let non_finite_units = match finite {
            true => Vec::new(),
            false => self.non_finite_units(&norm.unit_sq)?,
        };
        let verdict = self.policy.record(finite, &non_finite_units)?;
        let grad_norm = (norm.sq.sqrt() / loss_scale) as f32;
        let grad_scale = if loss_scale == 1.0 {
            self.clip_scale(grad_norm)
        } else {
            let clip = f64::from(self.cfg.gradient_clipping);
            unscale_and_clip_factor(norm.sq.sqrt(), loss_scale, clip)
        };
        Ok(Outcome {
            loss: norm.loss,
            verdict,
            non_finite_units,
            grad_norm,
            grad_scale,
        })
    }

    /// DeepSpeed's clip factor as a gradient multiplier: `1 / max(1, (norm + 1e-6) / clip)`.
    fn clip_scale(&self, grad_norm: f32) -> f32 {
        let clip = self.cfg.gradient_clipping;
        if clip > 0.0 {
            let factor = (grad_norm + 1e-6) / clip;
            if factor > 1.0 {
                return 1.0 / factor;
            }
        }
        1.0
    }

    /// The names of the units whose reduced gradient held Inf/NaN on some rank, from each unit's
    /// local squared sum. Every rank calls it on the same steps (the verdict is agreed), so the
    /// small all-reduce of per-unit flags matches; stage 0 needs none (every rank holds the same
    /// averaged gradient).
    fn non_finite_units(&self, unit_sq: &[f64]) -> Result<Vec<String>, EngineError> {
        let mut flags: Vec<f32> = unit_sq
            .iter()
            .map(|s| if s.is_finite() { 0.0 } else { 1.0 })
            .collect();
        if self.cfg.stage != Stage::Zero0 && self.cfg.world_size > 1 {
            let reduced = self
                .comm
                .all_reduce(Buffer::F32(flags), ReduceOp::Max)
                .wait_one()?;
            flags = crate::comm::returned_f32(reduced, self.layout.rank)?;
        }
        Ok(flags
            .iter()
            .zip(&self.spec.units)
            .filter(|(f, _)| **f > 0.0)
            .map(|(_, u)| u.name.clone())
            .collect())
    }

    /// Adam/AdamW on the part of every unit this rank updates, gradients multiplied by
    /// `grad_scale`; under NVMe offload the moments stream through the swap file.
    fn update(&mut self, lr: f32, grad_scale: f32) -> Result<(), EngineError> {
        let t = Instant::now();
        let mut hp = self.cfg.adam;
        hp.lr = f64::from(lr);
        if let Some(device) = self.device() {
            let step = self.units.first().map_or(0, |u| u.adam.step) + 1;
            device.adam(&StepConsts::new(&hp, step, grad_scale))?;
            device.synchronize()?;
            self.units.iter_mut().for_each(|u| u.adam.step = step);
            self.host_behind = true;
            self.phases.optimizer += t.elapsed().as_secs_f64();
            return Ok(());
        }
        // Adam overwrites 16-bit parameters whole from the fp32 master (it reads them otherwise).
        let overwritten = self.cfg.keeps_fp32_master();
        let mut parts =
            parts::UpdateParts::new(&mut self.state, &self.layout, &self.units, overwritten);
        let updated = update_parts(
            &mut self.units,
            self.nvme.as_mut(),
            &mut parts,
            self.cfg.seed,
            (&hp, grad_scale),
        );
        // The last shard goes back, and its write lands, also after an error: nothing may read
        // the shards while a write is in flight.
        let finished = parts.finish();
        updated?;
        finished?;
        self.phases.optimizer += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Bytes read from and written to this rank's NVMe swap files (optimizer states and parameter
    /// shards) so far (`(0, 0)` without NVMe offload).
    pub(crate) fn swap_traffic(&self) -> (u64, u64) {
        let (r, w) = self.nvme.as_ref().map_or((0, 0), |n| n.traffic());
        let (pr, pw) = match &self.state.stage {
            StageState::ShardedParams { coordinator, .. } => coordinator.shards().traffic(),
            _ => (0, 0),
        };
        (r + pr, w + pw)
    }

    /// Stages 1-2: all-gather the updated parameter shards into every rank's full parameters
    /// (stage 0 updated them whole, stage 3 keeps only its shards), in place in each unit's
    /// parameters, whose own shard the optimizer has just written: one collective per unit, all
    /// issued before the first is waited for, nothing copied.
    fn gather_updated(&mut self) -> Result<(), CommError> {
        if !matches!(self.cfg.stage, Stage::Zero1 | Stage::Zero2) {
            return Ok(());
        }
        let t = Instant::now();
        let mut in_flight = Vec::with_capacity(self.layout.num_units());
        for u in (0..self.layout.num_units()).filter(|&u| self.layout.units[u].padded > 0) {
            let params = self.state.full_params_mut(u);
            let empty = Buffer::zeros(params.dtype(), 0);
            let handle = self
                .comm
                .all_gather_in_place(std::mem::replace(params, empty));
            in_flight.push((u, handle));
        }
        for (u, handle) in in_flight {
            *self.state.full_params_mut(u) = handle.wait_one()?;
        }
        self.phases.comm += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// The device tier at stages 1-2 on more than one rank: each rank's updated part of every
    /// unit comes down into its place in the host parameters, the host tier's all-gather joins
    /// the parts, and the whole parameters go back to the device. (The host parameters are then
    /// current; the master and moments stay on the device until [`Engine::sync_host`].)
    fn gather_device_params(&mut self, device: &dyn DeviceTier) -> Result<(), EngineError> {
        let sharded = matches!(self.cfg.stage, Stage::Zero1 | Stage::Zero2);
        if !sharded || self.cfg.world_size == 1 {
            return Ok(());
        }
        let t = Instant::now();
        for u in 0..self.layout.num_units() {
            let part = self.restored_range(u);
            device.params_to_host(u, self.state.full_params_mut(u).slice_mut(part))?;
        }
        self.phases.comm += t.elapsed().as_secs_f64();
        self.gather_updated()?;
        let t = Instant::now();
        for u in 0..self.layout.num_units() {
            let numel = self.layout.units[u].numel;
            // A unit the rank updates whole (one smaller than its shard) has on the device the
            // parameters its Adam step wrote, which are what the gather brought.
            if self.restored_range(u) != (0..numel) {
                device.params_from_host(u, self.state.params(u).slice(0..numel))?;
            }
        }
        self.phases.comm += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// The report of the step just taken.
    fn report(
        &self,
        outcome: Outcome,
        lr: f32,
        counts: BatchCounts,
        start: Instant,
        traffic_before: &TrafficCounters,
    ) -> StepReport {
        StepReport {
            step: self.step,
            loss: outcome.loss,
            grad_norm: outcome.grad_norm,
            loss_scale: outcome.verdict.loss_scale as f32,
            skipped: outcome.verdict.skipped,
            non_finite_units: outcome.non_finite_units,
            scale_message: outcome.verdict.message,
            lr,
            samples: counts.samples,
            tokens: counts.tokens,
            elapsed: start.elapsed(),
            traffic: self.comm.traffic().since(traffic_before),
            memory: self.ledger.snapshot(),
            peak_bytes: self.ledger.peak(),
            peak_gather_bytes: self.ledger.peak_of(MemoryKind::Gather),
            device_tier_bytes: self.device().map_or(0, |d| d.bytes()),
            swap_io: self.swap_traffic(),
            phases: self.phases,
        }
    }

    /// Stage 3: gather visit `pos`'s units (and prefetch what fits).
    fn acquire(&mut self, pos: usize) -> Result<(), GatherError> {
        if self.device().is_some() {
            // The model reads the device tier's parameters.
            return Ok(());
        }
        if let StageState::ShardedParams { coordinator, .. } = &mut self.state.stage {
            let t = Instant::now();
            coordinator.acquire(pos, self.comm, &mut self.ledger)?;
            self.phases.comm += t.elapsed().as_secs_f64();
        }
        Ok(())
    }

    /// Stage 3: release visit `pos`'s units that the next visit does not need.
    fn release(&mut self, pos: usize) {
        if self.device().is_some() {
            return;
        }
        if let StageState::ShardedParams { coordinator, .. } = &mut self.state.stage {
            coordinator.release(pos);
        }
    }

    /// Mixed precision: widen the 16-bit parameters unit `unit` reads into the f32 scratch the
    /// model reads them from (nothing to do in fp32).
    fn widen_params(&mut self, unit: usize) {
        // The device tier's model reads its parameters from the tier.
        if !self.cfg.is_mixed() || self.device().is_some() {
            return;
        }
        let mut rest = self.widened.as_mut_slice();
        for &k in &self.units[unit].reads {
            let numel = self.layout.units[k].numel;
            let (wide, tail) = rest.split_at_mut(numel);
            self.state.params(k).slice(0..numel).widen_into(wide);
            rest = tail;
        }
    }

    /// The unpadded f32 parameters unit `unit` reads: its own, then those of the units it uses
    /// (under mixed precision, as [`Engine::widen_params`] left them).
    fn param_slices(&self, unit: usize) -> Vec<&[f32]> {
        if self.device().is_some() {
            // The model reads the device tier's parameters.
            return vec![&[]; self.units[unit].reads.len()];
        }
        let mixed = self.cfg.is_mixed();
        let mut rest = self.widened.as_slice();
        self.units[unit]
            .reads
            .iter()
            .map(|&k| {
                let numel = self.layout.units[k].numel;
                match mixed {
                    true => {
                        let (wide, tail) = rest.split_at(numel);
                        rest = tail;
                        wide
                    }
                    false => &self.state.params(k).as_f32().expect("f32 parameters")[..numel],
                }
            })
            .collect()
    }
}

/// Adam on every unit's part through `parts`: the units whose moments are in memory, then those
/// streamed chunk by chunk from the NVMe swap file. Each part's stochastic rounding (bf16
/// parameters without a master) is keyed by its place in its unit ([`ShardPlace`]).
fn update_parts(
    units: &mut [UnitState],
    nvme: Option<&mut nvme::NvmeMoments>,
    parts: &mut parts::UpdateParts<'_>,
    seed: u64,
    (hp, grad_scale): (&crate::optim::adam::AdamParams, f32),
) -> Result<(), EngineError> {
    let place = |unit: usize, offset: usize| ShardPlace { seed, unit, offset };
    for (u, unit) in units.iter_mut().enumerate() {
        if !unit.swapped {
            let master = unit.master.as_deref_mut();
            let (p, g) = parts.get(u)?;
            let at = place(u, unit.updated.start);
            adam_update(&mut unit.adam, master, (p, at), g, hp, grad_scale)?;
        }
    }
    let Some(nvme) = nvme else {
        return Ok(());
    };
    let starts: Vec<usize> = units.iter().map(|u| u.updated.start).collect();
    let mut masters = Vec::with_capacity(units.len());
    let mut step = 0;
    for unit in units.iter_mut() {
        if unit.swapped {
            unit.adam.step += 1;
            step = unit.adam.step;
        }
        masters.push(unit.master.as_deref_mut());
    }
    nvme.step(|u, r, m, v| -> Result<(), EngineError> {
        let w = masters[u].as_deref_mut().map(|w| &mut w[r.clone()]);
        let (mut p, g) = parts.get(u)?;
        let at = place(u, starts[u] + r.start);
        let (p, g) = (p.sub_mut(r.clone()), g.range(r));
        Ok(adam_apply(m, v, step, w, (p, at), g, hp, grad_scale)?)
    })
}

/// Every unit's initial parameters from `cfg.seed`, as this rank keeps them (in the parameter
/// dtype, full or at stage 3 its shard), and under mixed precision the fp32 master of the part
/// it updates.
fn init_params<M: UnitModel>(
    model: &M,
    cfg: &EngineConfig,
    layout: &FlatLayout,
) -> (Vec<Buffer>, Vec<Option<Vec<f32>>>) {
    let (stage, pdt) = (cfg.stage, cfg.param_dtype);
    let n = layout.num_units();
    let (mut params, mut masters) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for (u, ul) in layout.units.iter().enumerate() {
        let mut full = vec![0.0f32; ul.padded];
        model.init_params(u, cfg.seed, &mut full[..ul.numel]);
        let updated = updated_part(layout, stage, u);
        masters.push(cfg.keeps_fp32_master().then(|| {
            let mut master = crate::flat::zeroed_vec(updated.len());
            master.copy_from_slice(&full[updated]);
            master
        }));
        params.push(match stage.shards_params() {
            true => Buffer::from_f32(pdt, &full[layout.own_shard(u)]),
            false => Buffer::from_f32(pdt, &full),
        });
    }
    (params, masters)
}

/// Every unit's [`UnitState`], with its `master` from [`init_params`].
fn unit_states(
    spec: &ModelSpec,
    cfg: &EngineConfig,
    layout: &FlatLayout,
    plan: &BufferPlan,
    masters: Vec<Option<Vec<f32>>>,
) -> Vec<UnitState> {
    let n = layout.num_units();
    let stage = cfg.stage;
    let kept_graph = kept_graph_elems(spec, layout, plan);
    let per_unit = schedule::complete_after(spec).into_iter().zip(kept_graph);
    per_unit
        .zip(masters)
        .enumerate()
        .map(|(u, ((complete_after, kept_graph), master))| {
            let updated = updated_part(layout, stage, u);
            let swapped = matches!(cfg.unit_optimizer_tier(u, n), OptimizerTier::Nvme { .. });
            UnitState {
                reads: schedule::needs_of(spec, u),
                complete_after,
                recompute: u + 1 != n
                    && (cfg.activation_checkpointing
                        || (stage.shards_params() && !plan.keep_graph[u])),
                kept_graph,
                // With NVMe offload the moments live in the swap file.
                adam: Moments::new(
                    cfg.optimizer_states_dtype,
                    if swapped { 0 } else { updated.len() },
                ),
                swapped,
                updated,
                master,
            }
        })
        .collect()
}

/// The stage's flat state around `params` (full, or the shards at stage 3), with zeroed
/// gradients.
fn flat_state(
    spec: &ModelSpec,
    cfg: &EngineConfig,
    layout: &FlatLayout,
    plan: &BufferPlan,
    units: &[UnitState],
    params: Vec<Buffer>,
    rank: usize,
) -> Result<FlatState, EngineError> {
    let gdt = cfg.grad_accum_dtype;
    let transient = || vec![Vec::new(); layout.num_units()];
    let grad_shards = || Buffer::zeros(gdt, layout.shard_numel());
    let (stage, grads) = match cfg.stage {
        Stage::Zero0 | Stage::Zero1 if cfg.transient_grads() => {
            let kept = layout.units.iter().map(|u| Buffer::zeros(gdt, u.padded));
            let kept_grads = Some(kept.collect());
            (StageState::Replicated { params, kept_grads }, transient())
        }
        Stage::Zero0 | Stage::Zero1 => {
            let kept_grads = None;
            let grads = layout
                .units
                .iter()
                .map(|u| crate::flat::zeroed_vec(u.padded));
            (
                StageState::Replicated { params, kept_grads },
                grads.collect(),
            )
        }
        Stage::Zero2 => {
            let grad_shards = grad_shards();
            (
                StageState::ShardedGrads {
                    params,
                    grad_shards,
                },
                transient(),
            )
        }
        Stage::Zero3 => {
            let coordinator = coordinator(spec, cfg, layout, plan, units, params, rank)?;
            let grad_shards = grad_shards();
            let stage = StageState::ShardedParams {
                coordinator,
                grad_shards,
            };
            (stage, transient())
        }
    };
    Ok(FlatState {
        grads,
        grad_pool: GradPool::new(plan),
        stage,
    })
}

/// Stage 3: the coordinator of the parameter `shards`, with every visit's gathers planned. A unit
/// that keeps its forward graph needs nothing gathered for its backward. Under `offload_param` to
/// NVMe the shards move into the rank's parameter swap file.
fn coordinator(
    spec: &ModelSpec,
    cfg: &EngineConfig,
    layout: &FlatLayout,
    plan: &BufferPlan,
    units: &[UnitState],
    shards: Vec<Buffer>,
    rank: usize,
) -> Result<Coordinator, EngineError> {
    let visits = schedule::visits(spec, cfg.grad_accum);
    let kept_graph: Vec<usize> = units.iter().map(|u| u.kept_graph).collect();
    let prefetch = match cfg.overlap_comm {
        true => cfg.prefetch_bucket_size,
        false => 0,
    };
    let store = match &cfg.offload_param {
        ParamTier::Nvme {
            dir,
            buffer_count,
            buffer_size,
            max_in_cpu,
        } => {
            let resident = param_residency(layout, *max_in_cpu);
            let longest = longest_swapped_shard(layout, resident);
            if resident == layout.num_units() {
                // max_in_cpu holds every shard: no swap file, as in DeepSpeed.
                ShardStore::Memory(shards)
            } else if longest > *buffer_size {
                return Err(EngineError::Config(format!(
                    "offload_param.buffer_size is {buffer_size} elements but the longest \
                     parameter shard has {longest}; raise zero_optimization.offload_param.\
                     buffer_size to at least {longest}, or use more ranks"
                )));
            } else {
                let staging = param_staging_count(spec, *buffer_count);
                let store = SwappedShards::new(dir, rank, shards, staging, resident)?;
                ShardStore::Nvme(Box::new(store))
            }
        }
        ParamTier::Device | ParamTier::Host => ShardStore::Memory(shards),
    };
    let padded: Vec<usize> = layout.units.iter().map(|u| u.padded).collect();
    let (hpz, dtype) = (cfg.hpz_partition_size, store.dtype());
    let secondary = cfg
        .hpz_active()
        .then(|| Secondary::new(rank, hpz, &padded, &plan.persistent, dtype));
    let coordinator = Coordinator::new(
        store,
        layout,
        plan.persistent.clone(),
        plan.gather_pool_elems,
        prefetch,
        schedule::gather_needs(&visits, &kept_graph),
    );
    let coordinator = coordinator.with_secondary(secondary);
    Ok(match cfg.qwz_active() {
        true => coordinator.with_quantized_weights(cfg.world_size),
        false => coordinator,
    })
}

/// qgZ's hosts: the communicator's ranks per host (MPI's hosts; in one process, what its
/// options say), else hpZ's partition, else one host.
fn qgz_hosts(cfg: &EngineConfig, comm: &dyn Communicator) -> super::qgz::Hosts {
    let hpz = cfg.hpz_active().then_some(cfg.hpz_partition_size);
    super::qgz::Hosts::new(cfg.world_size, comm.ranks_per_host().or(hpz))
}

/// Staging buffers for shards read from the parameter swap file: `offload_param.buffer_count`,
/// raised to the most units one visit can gather (a unit and the units it uses), so that a demand
/// fetch always finds one.
fn param_staging_count(spec: &ModelSpec, buffer_count: usize) -> usize {
    let most = spec
        .units
        .iter()
        .map(|u| 1 + u.uses.len())
        .max()
        .unwrap_or(1);
    buffer_count.max(most)
}

/// Host bytes of the parameter swap file's staging under `offload_param` to NVMe at stage 3 (0
/// otherwise): the engine allocates exactly this; the pre-flight check counts it before a run.
pub fn param_staging_bytes(spec: &ModelSpec, cfg: &EngineConfig) -> u64 {
    match (&cfg.offload_param, cfg.stage.shards_params()) {
        (
            ParamTier::Nvme {
                buffer_count,
                max_in_cpu,
                ..
            },
            true,
        ) => {
            let layout = FlatLayout::new(spec, cfg.world_size, 0);
            let resident = param_residency(&layout, *max_in_cpu);
            if resident == layout.num_units() {
                return 0;
            }
            let longest = longest_swapped_shard(&layout, resident);
            let staging = param_staging_count(spec, *buffer_count);
            super::shards::staging_bytes(cfg.param_dtype, longest, staging)
        }
        _ => 0,
    }
}

/// Per unit, the moments rank `layout.rank` keeps in the NVMe swap file: its updated part's
/// length when the unit's optimizer state is on NVMe, else 0 (no record: a partial offload leaves
/// it in the device tier, or the optimizer is not on NVMe).
fn swapped_moment_lens(layout: &FlatLayout, cfg: &EngineConfig) -> Vec<usize> {
    let n = layout.num_units();
    (0..n)
        .map(|u| match cfg.unit_optimizer_tier(u, n) {
            OptimizerTier::Nvme { .. } => updated_part(layout, cfg.stage, u).len(),
            _ => 0,
        })
        .collect()
}

/// Host bytes of the buffers Adam's moments stream through under `offload_optimizer` to NVMe
/// (0 otherwise), on rank 0: what [`Engine::new`] allocates, for the pre-flight check.
pub fn moment_stream_bytes(spec: &ModelSpec, cfg: &EngineConfig) -> u64 {
    match &cfg.offload_optimizer {
        OptimizerTier::Nvme {
            chunk,
            buffer_count,
            ..
        } => {
            let layout = FlatLayout::new(spec, cfg.world_size, 0);
            let longest = swapped_moment_lens(&layout, cfg)
                .into_iter()
                .max()
                .unwrap_or(0);
            stream_buffer_bytes(cfg.optimizer_states_dtype, *chunk, *buffer_count, longest)
        }
        _ => 0,
    }
}

/// Host bytes of the parameter shards `offload_param.max_in_cpu` keeps in memory under
/// `offload_param` to NVMe at stage 3 (0 otherwise), on rank 0: for the pre-flight check.
pub fn resident_param_bytes(spec: &ModelSpec, cfg: &EngineConfig) -> u64 {
    match (&cfg.offload_param, cfg.stage.shards_params()) {
        (ParamTier::Nvme { max_in_cpu, .. }, true) => {
            let layout = FlatLayout::new(spec, cfg.world_size, 0);
            let resident = param_residency(&layout, *max_in_cpu);
            let elems: usize = layout.units[..resident].iter().map(|u| u.shard_len).sum();
            (elems * cfg.param_dtype.size()) as u64
        }
        _ => 0,
    }
}

/// Units of `layout`'s rank whose shards `max_in_cpu` keeps in host memory
/// ([`super::shards::resident_units`]).
pub(crate) fn param_residency(layout: &FlatLayout, max_in_cpu: usize) -> usize {
    super::shards::resident_units(layout.units.iter().map(|u| u.shard_len), max_in_cpu)
}

/// The longest shard of the units past the first `resident` (0 if none): what a staging buffer
/// must hold.
fn longest_swapped_shard(layout: &FlatLayout, resident: usize) -> usize {
    let swapped = layout.units.get(resident..).unwrap_or_default();
    swapped.iter().map(|u| u.shard_len).max().unwrap_or(0)
}

/// The ledger of what [`Engine::new`] allocates: each unit's model states by kind and tier and
/// the buffers of the plan, as [`budget`] lays them out (the gather pool is charged as it fills),
/// and the NVMe swap file with its stream buffers.
fn initial_ledger(
    spec: &ModelSpec,
    cfg: &EngineConfig,
    rank: usize,
    nvme: Option<&nvme::NvmeMoments>,
    state: &FlatState,
) -> MemoryLedger {
    let mut ledger = MemoryLedger::with_budget(cfg.device_budget);
    for a in budget::allocations(spec, cfg, rank) {
        if a.kind != MemoryKind::Gather {
            ledger.alloc_in(a.tier, a.kind, a.bytes);
        }
    }
    if let Some(n) = nvme {
        ledger.alloc_in(Tier::Nvme, MemoryKind::OptimizerStates, n.file_bytes());
        ledger.alloc_in(Tier::Host, MemoryKind::Buffers, n.buffer_bytes());
    }
    if let StageState::ShardedParams { coordinator, .. } = &state.stage {
        ledger.alloc(MemoryKind::Gather, coordinator.secondary_bytes());
        if let ShardStore::Nvme(s) = coordinator.shards() {
            ledger.alloc_in(Tier::Nvme, MemoryKind::Params, s.file_bytes());
            ledger.alloc_in(Tier::Host, MemoryKind::Buffers, s.host_bytes());
        }
    }
    ledger
}

/// The part of unit `unit`'s flat buffer this rank updates: all of it at stage 0, its own shard
/// otherwise.
fn updated_part(layout: &FlatLayout, stage: Stage, unit: usize) -> Range<usize> {
    match stage.shards_optimizer() {
        true => layout.own_shard(unit),
        false => 0..layout.units[unit].padded,
    }
}

/// Mutable unpadded gradient slices of the distinct units `units`, in that order.
fn grad_slices<'g>(
    grads: &'g mut [Vec<f32>],
    units: &[usize],
    layout: &FlatLayout,
) -> Vec<&'g mut [f32]> {
    let mut picked: Vec<Option<&'g mut [f32]>> = units.iter().map(|_| None).collect();
    for (k, g) in grads.iter_mut().enumerate() {
        if let Some(i) = units.iter().position(|&u| u == k) {
            picked[i] = Some(&mut g[..layout.units[k].numel]);
        }
    }
    picked
        .into_iter()
        .map(|s| s.expect("distinct units"))
        .collect()
}

fn validate(
    spec: &ModelSpec,
    cfg: &EngineConfig,
    comm: &dyn Communicator,
) -> Result<(), EngineError> {
    let bad = |m: String| Err(EngineError::Config(m));
    if cfg.world_size != comm.world_size() {
        return bad(format!(
            "world_size is {} but the communicator has {} ranks",
            cfg.world_size,
            comm.world_size()
        ));
    }
    if cfg.grad_accum == 0 || cfg.micro_batch == 0 {
        return bad("micro_batch and grad_accum must be at least 1".into());
    }
    if cfg.comm_dtype != DType::F32 && cfg.comm_dtype != cfg.param_dtype {
        return bad(format!(
            "communication_data_type {} does not match the {} parameters; use {} or fp32 \
             (16-bit communication needs the same 16-bit parameters: enable the bf16 or fp16 block)",
            cfg.comm_dtype,
            cfg.precision_name(),
            cfg.precision_name(),
        ));
    }
    if cfg.optimizer_states_dtype == DType::F16 {
        return bad("optimizer states may be fp32 or bf16, not fp16".into());
    }
    if cfg.bf16_master_weights && cfg.param_dtype != DType::BF16 {
        return bad(format!(
            "bf16_master_weights_and_grads needs bf16 parameters, the run's are {}; enable the \
             bf16 block or drop the key",
            cfg.precision_name()
        ));
    }
    if !(0.0..=1.0).contains(&cfg.offload_ratio) {
        return bad(format!(
            "offload_optimizer.ratio {} must be between 0 and 1",
            cfg.offload_ratio
        ));
    }
    if cfg.offload_ratio < 1.0 && cfg.stage != Stage::Zero3 {
        return bad(format!(
            "partial optimizer offload (offload_optimizer.ratio {}) needs stage 3, as in \
             DeepSpeed; set the ratio to 1.0 or use stage 3",
            cfg.offload_ratio
        ));
    }
    if spec.units.is_empty() {
        return bad("the model has no units".into());
    }
    for (i, u) in spec.units.iter().enumerate() {
        for &k in &u.uses {
            if k >= spec.units.len() || k == i {
                return bad(format!(
                    "unit {i} ({}) uses unit {k}, which is not another unit of the model",
                    u.name
                ));
            }
        }
    }
    Ok(())
}
