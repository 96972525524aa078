//! The ZeRO engine: one rank's training step at stages 0-3 over a [`UnitModel`].
//!
//! One step, in order (every rank runs the same sequence, so collectives always match):
//! 1. For each micro-batch: forward unit by unit, then backward unit by unit. Stage 3 gathers each
//!    visit's units through the [`Coordinator`]. Units under activation checkpointing, and at stage
//!    3 units beyond `max_reuse_distance` or the `max_live_parameters` budget, run their forward
//!    without a graph (keeping only their input) and are gathered again and recomputed in backward:
//!    a candle graph holds the weights it was built from, so keeping it would keep the gathered
//!    weights alive. As soon as a unit's gradient is complete (after its last user's backward) it
//!    goes into the reduction [`Buckets`]: on every micro-step at stages 2-3, on the last one at
//!    stages 0-1.
//! 2. One two-float all-reduce: the global-batch loss and the squared gradient norm of all shards.
//! 3. Adam/AdamW on the rank's part (everything at stage 0, the own shard otherwise), with the clip
//!    factor fused into the gradient scale.
//! 4. Stages 1-2 all-gather the updated shards into the full parameters; stage 3 leaves them sharded.
//!
//! Mixed precision (`param_dtype` bf16/f16, see [`super::precision`]): parameters, gradients and
//! buckets are 16-bit, the model reads parameters widened into f32 scratch and writes f32
//! gradients that are cast (or, at stages 0-1, accumulated) into the kept 16-bit ones; Adam updates
//! the fp32 master of the rank's part and writes its rounded copy in the same pass. The squared
//! norm of step 2 doubles as the overflow check: a non-finite total on every rank alike means
//! some rank's gradients held Inf/NaN, and the step is skipped everywhere (no Adam update, no
//! all-gather); fp16 multiplies the loss by the loss scale in the last unit's backward and divides
//! it out in the fused unscale-and-clip factor.

use super::buckets::{BucketMode, Buckets, FlatState};
use super::buffers::{kept_graph_elems, plan, BufferPlan};
use super::config::{EngineConfig, Stage};
use super::flat::FlatLayout;
use super::gather::Coordinator;
use super::loss_scaler::{unscale_and_clip_factor, LossScaleError};
use super::precision::{adam_update, buffer_from_f32, FlatBuffer, Slice, StepPolicy};
use super::schedule;
use super::unit::{BatchCounts, ForwardMode, ModelError, ModelSpec, UnitModel};
use crate::comm::{Buffer, CommError, Communicator, DType, ReduceOp, TrafficCounters};
use crate::memory::accounting::{MemoryKind, MemoryLedger, ModelStateBytes};
use crate::optim::adam::AdamState;
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
    #[error(
        "step {step}: got {got} micro-batches, expected gradient_accumulation_steps = {expected}"
    )]
    MicroBatches {
        step: u64,
        got: usize,
        expected: usize,
    },
    #[error("unit {unit} ({name}): given {got} parameter values, the unit has {expected}")]
    ParamLength {
        unit: usize,
        name: String,
        expected: usize,
        got: usize,
    },
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
    pub phases: PhaseTimes,
}

/// One rank's engine. Every rank of a world builds one with the same model, configuration and
/// seed, and calls [`Engine::train_step`] with its own micro-batches of the same global batch.
///
/// ```no_run
/// use zerodp::comm::{run_ranks, CommOptions};
/// use zerodp::model::{Corpus, DataLoader, GptConfig, GptModel};
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
    state: FlatState,
    /// Stage 3 only.
    coordinator: Option<Coordinator>,
    buckets: Buckets,
    /// Adam state per unit, over the part of the unit this rank updates.
    adam: Vec<AdamState>,
    /// Mixed precision: the fp32 master weights per unit, over the part this rank updates
    /// (empty in fp32, where the parameters are their own master).
    master: Vec<Vec<f32>>,
    /// Mixed precision: f32 scratch the 16-bit parameters of a visit are widened into.
    widened: Vec<Vec<f32>>,
    /// Loss scale and Inf/NaN skipping.
    policy: StepPolicy,
    /// Free transient full-unit gradient buffers (stages 2-3).
    grad_free: Vec<Vec<f32>>,
    complete_after: Vec<Vec<usize>>,
    /// The units each unit reads: itself, then its `uses`.
    reads: Vec<Vec<usize>>,
    /// Elements of weights a kept stage-3 forward graph holds until backward, per unit (0 for units
    /// that are recomputed, and for the last unit, whose gathered parameters simply stay).
    kept_graph: Vec<usize>,
    /// Units whose forward runs without a graph and is recomputed in backward.
    recompute: Vec<bool>,
    ledger: MemoryLedger,
    step: u64,
    scalars: Vec<f32>,
    phases: PhaseTimes,
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
        let world = cfg.world_size;
        let layout = FlatLayout::new(&spec, world, comm.rank());
        let plan = plan(&spec, &cfg);
        let stage = cfg.stage;
        let n = spec.units.len();
        let mut ledger = MemoryLedger::new();
        let (pdt, gdt) = (cfg.param_dtype, cfg.grad_accum_dtype);
        let policy = StepPolicy::new(&cfg.overflow, cfg.max_skipped_steps, precision_name(pdt))?;

        let mut params = Vec::with_capacity(n);
        let mut shards = Vec::new();
        let mut master = Vec::new();
        for (u, ul) in layout.units.iter().enumerate() {
            let mut full = vec![0.0f32; ul.padded];
            model.init_params(u, cfg.seed, &mut full[..ul.numel]);
            if cfg.is_mixed() {
                master.push(full[updated_part(&layout, stage, u)].to_vec());
            }
            if stage.shards_params() {
                shards.push(buffer_from_f32(pdt, &full[layout.own_shard(u)]));
            } else {
                params.push(buffer_from_f32(pdt, &full));
            }
        }
        let param_elems = if stage.shards_params() {
            layout.shard_numel()
        } else {
            layout.padded_numel()
        };
        ledger.alloc(MemoryKind::Params, (param_elems * pdt.size()) as u64);
        let master_elems: usize = master.iter().map(Vec::len).sum();
        ledger.alloc(MemoryKind::Master, (master_elems * 4) as u64);

        let no_grads = Buffer::zeros(gdt, 0);
        let (grads, kept_grads, grad_shards, grad_elems) = if stage.shards_grads() {
            let shards = Buffer::zeros(gdt, layout.shard_numel());
            (
                vec![Vec::new(); n],
                Vec::new(),
                shards,
                layout.shard_numel(),
            )
        } else if cfg.transient_grads() {
            let kept = layout
                .units
                .iter()
                .map(|u| Buffer::zeros(gdt, u.padded))
                .collect();
            (vec![Vec::new(); n], kept, no_grads, layout.padded_numel())
        } else {
            let g = layout.units.iter().map(|u| vec![0.0; u.padded]).collect();
            (g, Vec::new(), no_grads, layout.padded_numel())
        };
        ledger.alloc(MemoryKind::Grads, (grad_elems * gdt.size()) as u64);

        let adam: Vec<AdamState> = layout
            .units
            .iter()
            .map(|u| {
                AdamState::new(if stage.shards_optimizer() {
                    u.shard_len
                } else {
                    u.padded
                })
            })
            .collect();
        ledger.alloc(
            MemoryKind::OptimizerStates,
            adam.iter().map(|a| a.bytes() as u64).sum(),
        );

        let buckets = Buckets::new(&plan, world);
        let grad_free = (0..plan.grad_scratch_count)
            .map(|_| Vec::with_capacity(plan.grad_scratch_elems))
            .collect();
        let widened = (0..plan.param_scratch_count)
            .map(|_| vec![0.0f32; plan.param_scratch_elems])
            .collect();
        ledger.alloc(MemoryKind::Buffers, plan.buffer_bytes());

        let visits = schedule::visits(&spec, cfg.grad_accum);
        let reads: Vec<Vec<usize>> = (0..n).map(|u| schedule::needs_of(&spec, u)).collect();
        let kept_graph = kept_graph_elems(&spec, &layout, &plan);
        // A unit that keeps its forward graph needs nothing gathered for its backward.
        let gather_needs = schedule::gather_needs(&visits, &kept_graph);
        let coordinator = stage.shards_params().then(|| {
            let prefetch = if cfg.overlap_comm {
                cfg.prefetch_bucket_size
            } else {
                0
            };
            Coordinator::new(
                shards,
                &layout,
                plan.persistent.clone(),
                plan.gather_pool_elems,
                prefetch,
                gather_needs,
            )
        });
        let recompute = (0..n)
            .map(|u| {
                u + 1 != n
                    && (cfg.activation_checkpointing
                        || (stage.shards_params() && !plan.keep_graph[u]))
            })
            .collect();
        let complete_after = schedule::complete_after(&spec);
        Ok(Engine {
            model,
            comm,
            spec,
            layout,
            plan,
            state: FlatState {
                params,
                grads,
                kept_grads,
                grad_shards,
            },
            coordinator,
            buckets,
            adam,
            master,
            widened,
            policy,
            grad_free,
            complete_after,
            reads,
            kept_graph,
            recompute,
            ledger,
            step: 0,
            scalars: vec![0.0; 2],
            phases: PhaseTimes::default(),
            cfg,
        })
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
    /// Optimizer steps taken so far.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// Replace unit `unit`'s parameters (unpadded, `UnitSpec` order) on this rank. Every rank must
    /// pass the same values (for example read from the same `--init` file).
    pub fn load_unit_params(&mut self, unit: usize, values: &[f32]) -> Result<(), EngineError> {
        let ul = self.layout.units[unit];
        if values.len() != ul.numel {
            return Err(EngineError::ParamLength {
                unit,
                name: self.spec.units[unit].name.clone(),
                expected: ul.numel,
                got: values.len(),
            });
        }
        if self.cfg.is_mixed() {
            let part = updated_part(&self.layout, self.cfg.stage, unit);
            let m = &mut self.master[unit];
            m.fill(0.0);
            let end = part.end.min(ul.numel);
            if part.start < end {
                m[..end - part.start].copy_from_slice(&values[part.start..end]);
            }
        }
        match &mut self.coordinator {
            Some(c) => {
                c.invalidate()?;
                let own = self.layout.own_shard(unit);
                let shard = &mut c.shards_mut()[unit];
                shard.fill_zero();
                let end = own.end.min(ul.numel);
                if own.start < end {
                    shard
                        .slice_mut(0..end - own.start)
                        .copy_from(Slice::F32(&values[own.start..end]));
                }
            }
            None => self.state.params[unit]
                .slice_mut(0..ul.numel)
                .copy_from(Slice::F32(values)),
        }
        Ok(())
    }

    /// The full, unpadded parameters of every unit: under mixed precision the fp32 master weights.
    /// A collective at stage 3, and at stages 1-3 under mixed precision (every rank must call it);
    /// a copy otherwise.
    pub fn full_params(&mut self) -> Result<Vec<Vec<f32>>, EngineError> {
        let mut out = Vec::with_capacity(self.layout.num_units());
        let mixed = self.cfg.is_mixed();
        let gather = |shard: Buffer, padded: usize| -> Result<Vec<f32>, EngineError> {
            let full = self
                .comm
                .all_gather(shard, Buffer::zeros(DType::F32, padded));
            Ok(full.wait_pair()?.1.into_f32().expect("f32 gather"))
        };
        for (u, ul) in self.layout.units.iter().enumerate() {
            let mut full = match &self.coordinator {
                _ if mixed && self.cfg.stage.shards_optimizer() => {
                    gather(Buffer::F32(self.master[u].clone()), ul.padded)?
                }
                _ if mixed => self.master[u].clone(),
                Some(c) => gather(c.shards()[u].clone(), ul.padded)?,
                None => self.state.params[u]
                    .as_f32()
                    .expect("f32 parameters")
                    .to_vec(),
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
        let ga = self.cfg.grad_accum;
        if micro_batches.len() != ga {
            return Err(EngineError::MicroBatches {
                step: self.step + 1,
                got: micro_batches.len(),
                expected: ga,
            });
        }
        let start = Instant::now();
        self.phases = PhaseTimes::default();
        let traffic_before = self.comm.traffic();
        let stage = self.cfg.stage;
        self.buckets.set_mode(match stage {
            Stage::Zero0 => BucketMode::AllReduce,
            Stage::Zero1 => BucketMode::ReduceScatterStore,
            Stage::Zero2 | Stage::Zero3 => BucketMode::ReduceScatterAccumulate,
        });
        if stage.shards_grads() {
            self.state.grad_shards.fill_zero();
        } else if self.cfg.transient_grads() {
            self.state.kept_grads.iter_mut().for_each(|g| g.fill_zero());
        } else {
            self.state.grads.iter_mut().for_each(|g| g.fill(0.0));
        }
        let loss_scale = self.policy.loss_scale();

        let mut loss_sum = 0.0f64;
        let mut counts = BatchCounts::default();
        for (m, batch) in micro_batches.iter().enumerate() {
            loss_sum += f64::from(self.micro_step(m, batch)?);
            counts = counts + self.model.batch_counts(batch);
        }
        let t = Instant::now();
        if let Some(c) = &mut self.coordinator {
            c.invalidate()?;
        }

        // The global-batch loss and the squared norm of the reduced gradient, in one collective.
        // The squared norm also carries the overflow verdict: a sum with an Inf/NaN term is
        // Inf/NaN, so every rank sees a non-finite total exactly when some rank's shard held one.
        let world = self.cfg.world_size as f64;
        let unit_sq: Vec<f64> = (0..self.layout.num_units())
            .map(|u| self.reduced_grad(u).sum_of_squares())
            .collect();
        let local_sq = match stage {
            // Every rank holds the whole averaged gradient: its norm needs no communication.
            Stage::Zero0 => 0.0,
            _ => unit_sq.iter().sum(),
        };
        let mut scalars = std::mem::take(&mut self.scalars);
        scalars[0] = (loss_sum / ga as f64 / world) as f32;
        scalars[1] = local_sq as f32;
        let reduced = self
            .comm
            .all_reduce(Buffer::F32(scalars), ReduceOp::Sum)
            .wait_one()?;
        self.scalars = reduced.into_f32().expect("f32 scalars");
        let loss = self.scalars[0];
        let sq = if stage == Stage::Zero0 {
            unit_sq.iter().sum::<f64>()
        } else {
            f64::from(self.scalars[1])
        };
        let finite = sq.is_finite();
        let non_finite_units = match finite {
            true => Vec::new(),
            false => self.non_finite_units(&unit_sq)?,
        };
        let verdict = self.policy.record(finite, &non_finite_units)?;
        let grad_norm = (sq.sqrt() / loss_scale) as f32;
        let grad_scale = if loss_scale == 1.0 {
            self.clip_scale(grad_norm)
        } else {
            let clip = f64::from(self.cfg.gradient_clipping);
            unscale_and_clip_factor(sq.sqrt(), loss_scale, clip)
        };
        self.phases.comm += t.elapsed().as_secs_f64();

        let t = Instant::now();
        if !verdict.skipped {
            self.optimizer_step(lr, grad_scale);
        }
        self.phases.optimizer += t.elapsed().as_secs_f64();

        let t = Instant::now();
        if matches!(stage, Stage::Zero1 | Stage::Zero2) && !verdict.skipped {
            self.buckets.set_mode(BucketMode::AllGather);
            for u in 0..self.layout.num_units() {
                self.buckets
                    .push(self.comm, u, &mut self.state, &self.layout)?;
            }
            self.buckets
                .flush(self.comm, &mut self.state, &self.layout)?;
        }
        self.phases.comm += t.elapsed().as_secs_f64();
        self.step += 1;
        Ok(StepReport {
            step: self.step,
            loss,
            grad_norm,
            loss_scale: loss_scale as f32,
            skipped: verdict.skipped,
            non_finite_units,
            scale_message: verdict.message,
            lr,
            samples: counts.samples,
            tokens: counts.tokens,
            elapsed: start.elapsed(),
            traffic: self.comm.traffic().since(&traffic_before),
            memory: self.ledger.snapshot(),
            peak_bytes: self.ledger.peak(),
            peak_gather_bytes: self.ledger.peak_of(MemoryKind::Gather),
            phases: self.phases,
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

    fn optimizer_step(&mut self, lr: f32, grad_scale: f32) {
        let mut hp = self.cfg.adam;
        hp.lr = f64::from(lr);
        let stage = self.cfg.stage;
        let FlatState {
            params,
            grads,
            kept_grads,
            grad_shards,
        } = &mut self.state;
        for u in 0..self.layout.num_units() {
            let part = updated_part(&self.layout, stage, u);
            let slot = self.layout.shard_slot(u);
            let (p, g) = match stage {
                Stage::Zero0 | Stage::Zero1 => (
                    params[u].slice_mut(part.clone()),
                    full_grad_in(kept_grads, grads, u, part),
                ),
                Stage::Zero2 => (params[u].slice_mut(part), grad_shards.slice(slot)),
                Stage::Zero3 => {
                    let shards = self.coordinator.as_mut().expect("stage 3").shards_mut();
                    (shards[u].all_mut(), grad_shards.slice(slot))
                }
            };
            let master = self.master.get_mut(u).map(Vec::as_mut_slice);
            adam_update(&mut self.adam[u], master, p, g, &hp, grad_scale);
        }
    }

    /// Unit `unit`'s reduced gradient as this rank holds it after the reductions: all of it at
    /// stage 0, the own shard otherwise.
    fn reduced_grad(&self, unit: usize) -> Slice<'_> {
        let part = updated_part(&self.layout, self.cfg.stage, unit);
        match self.cfg.stage {
            Stage::Zero0 | Stage::Zero1 => self.state.full_grad(unit, part),
            Stage::Zero2 | Stage::Zero3 => {
                self.state.grad_shards.slice(self.layout.shard_slot(unit))
            }
        }
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
            flags = reduced.into_f32().expect("f32 flags");
        }
        Ok(flags
            .iter()
            .zip(&self.spec.units)
            .filter(|(f, _)| **f > 0.0)
            .map(|(_, u)| u.name.clone())
            .collect())
    }

    /// Forward and backward of one micro-batch; returns its loss.
    fn micro_step(&mut self, micro: usize, batch: &M::Batch) -> Result<f32, EngineError> {
        let n = self.layout.num_units();
        let ga = self.cfg.grad_accum;
        let stage = self.cfg.stage;
        let reduce_now = stage.shards_grads() || micro + 1 == ga;
        let base = micro * 2 * n;
        let model = self.model;

        let mut inputs: Vec<Option<M::Act>> = (0..n).map(|_| None).collect();
        let mut saved: Vec<Option<M::Saved>> = (0..n).map(|_| None).collect();
        let mut x: Option<M::Act> = None;
        let mut loss = None;
        for u in 0..n {
            let pos = base + u;
            self.acquire(pos)?;
            let mode = if self.recompute[u] {
                ForwardMode::NoGrad
            } else {
                ForwardMode::Train
            };
            let t = Instant::now();
            let out = {
                self.widen_params(u);
                let params = self.param_slices(u);
                model.forward(u, &params, x.as_ref(), batch, mode)?
            };
            self.phases.forward += t.elapsed().as_secs_f64();
            self.ledger
                .alloc(MemoryKind::Gather, (self.kept_graph[u] * 4) as u64);
            self.release(pos);
            if self.recompute[u] {
                inputs[u] = x;
            } else {
                saved[u] = out.saved;
            }
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

        // fp16 scales the loss (and so every gradient) by the loss scale; 1 otherwise.
        let weight = self.policy.loss_scale() as f32 / ga as f32;
        let mut grad: Option<M::Act> = None;
        for u in (0..n).rev() {
            let pos = base + 2 * n - 1 - u;
            self.acquire(pos)?;
            let s = if self.recompute[u] {
                let t = Instant::now();
                self.widen_params(u);
                let params = self.param_slices(u);
                let out =
                    model.forward(u, &params, inputs[u].as_ref(), batch, ForwardMode::Train)?;
                inputs[u] = None;
                self.phases.recompute += t.elapsed().as_secs_f64();
                out.saved
            } else {
                saved[u].take()
            };
            let s = s.ok_or_else(|| {
                ModelError::Invalid(format!(
                    "unit {} ({}) returned nothing to backward from a Train forward",
                    u, self.spec.units[u].name
                ))
            })?;
            if self.cfg.transient_grads() {
                for &k in &self.reads[u] {
                    if self.state.grads[k].is_empty() {
                        let mut g = self
                            .grad_free
                            .pop()
                            .expect("gradient scratch sized by the plan");
                        g.resize(self.layout.units[k].padded, 0.0);
                        self.state.grads[k] = g;
                    }
                }
            }
            {
                let t = Instant::now();
                let mut grads = grad_slices(&mut self.state.grads, &self.reads[u], &self.layout);
                grad = model.backward(u, s, grad.as_ref(), weight, &mut grads)?;
                self.phases.backward += t.elapsed().as_secs_f64();
                self.ledger
                    .free(MemoryKind::Gather, (self.kept_graph[u] * 4) as u64);
            }
            self.release(pos);
            let t = Instant::now();
            for i in 0..self.complete_after[u].len() {
                let k = self.complete_after[u][i];
                if !self.state.kept_grads.is_empty() {
                    // Stages 0-1 with non-f32 gradients: accumulate into the kept gradient.
                    let mut g = std::mem::take(&mut self.state.grads[k]);
                    self.state.kept_grads[k].all_mut().add(Slice::F32(&g));
                    g.clear();
                    self.grad_free.push(g);
                }
                if reduce_now {
                    self.buckets
                        .push(self.comm, k, &mut self.state, &self.layout)?;
                    if stage.shards_grads() {
                        let mut g = std::mem::take(&mut self.state.grads[k]);
                        g.clear();
                        self.grad_free.push(g);
                    }
                }
            }
            self.phases.comm += t.elapsed().as_secs_f64();
        }
        let t = Instant::now();
        if reduce_now {
            self.buckets
                .flush(self.comm, &mut self.state, &self.layout)?;
        }
        self.phases.comm += t.elapsed().as_secs_f64();
        Ok(loss)
    }

    fn acquire(&mut self, pos: usize) -> Result<(), CommError> {
        if let Some(c) = &mut self.coordinator {
            let t = Instant::now();
            c.acquire(pos, self.comm, &mut self.ledger)?;
            self.phases.comm += t.elapsed().as_secs_f64();
        }
        Ok(())
    }

    fn release(&mut self, pos: usize) {
        if let Some(c) = &mut self.coordinator {
            c.release(pos);
        }
    }

    /// Mixed precision: widen the 16-bit parameters unit `unit` reads into the f32 scratch the
    /// model reads them from (nothing to do in fp32).
    fn widen_params(&mut self, unit: usize) {
        if !self.cfg.is_mixed() {
            return;
        }
        for (i, &k) in self.reads[unit].iter().enumerate() {
            let numel = self.layout.units[k].numel;
            let src = match &self.coordinator {
                Some(c) => c.params(k),
                None => &self.state.params[k],
            };
            src.slice(0..numel)
                .widen_into(&mut self.widened[i][..numel]);
        }
    }

    /// The unpadded f32 parameters unit `unit` reads: its own, then those of the units it uses
    /// (under mixed precision, as [`Engine::widen_params`] left them).
    fn param_slices(&self, unit: usize) -> Vec<&[f32]> {
        let mixed = self.cfg.is_mixed();
        self.reads[unit]
            .iter()
            .enumerate()
            .map(|(i, &k)| {
                let numel = self.layout.units[k].numel;
                let full = match &self.coordinator {
                    _ if mixed => return &self.widened[i][..numel],
                    Some(c) => c.params(k),
                    None => &self.state.params[k],
                };
                &full.as_f32().expect("f32 parameters")[..numel]
            })
            .collect()
    }
}

/// The part of unit `unit`'s flat buffer this rank updates: all of it at stage 0, its own shard
/// otherwise.
fn updated_part(layout: &FlatLayout, stage: Stage, unit: usize) -> std::ops::Range<usize> {
    match stage.shards_optimizer() {
        true => layout.own_shard(unit),
        false => 0..layout.units[unit].padded,
    }
}

fn full_grad_in<'g>(
    kept_grads: &'g [Buffer],
    grads: &'g [Vec<f32>],
    unit: usize,
    r: std::ops::Range<usize>,
) -> Slice<'g> {
    match kept_grads.get(unit) {
        Some(b) => b.slice(r),
        None => Slice::F32(&grads[unit][r]),
    }
}

/// The training precision's name in messages.
fn precision_name(param_dtype: DType) -> &'static str {
    match param_dtype {
        DType::F32 => "fp32",
        DType::BF16 => "bf16",
        DType::F16 => "fp16",
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
            precision_name(cfg.param_dtype),
            precision_name(cfg.param_dtype),
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
