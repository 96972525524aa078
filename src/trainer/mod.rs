//! The [`Trainer`]: one rank loop for every way zerodp trains.
//!
//! A trainer holds a model that implements the unit contract ([`crate::zero::unit`]), the
//! engine's configuration (from a DeepSpeed config file, resolved [`Settings`], or built by
//! hand) and a learning-rate schedule. [`Trainer::run`] starts the ranks on a [`Backend`]: the
//! in-process one (ranks as threads, [`crate::comm::run_ranks`]), ranks as threads on
//! communicators the caller made ([`Backend::Group`]: NCCL's, one rank per GPU), or one rank per
//! process over a communicator that spans processes (MPI: `mpirun` starts the processes, each
//! runs [`Trainer::run`] with [`Backend::Process`] and the same rank loop). It gives each rank its own
//! compute pool, builds one [`Engine`] per rank, and runs the optimizer steps: each rank draws its
//! micro-batches from a [`DataSource`], takes the step, and hands one [`StepEvent`] per step to
//! the [`StepObserver`]s (metrics lines, progress bars, logs, a test's record). What it hands back
//! is each rank's last report and, on request, the trained parameters.
//!
//! ```no_run
//! use zerodp::model::{GptConfig, GptModel};
//! use zerodp::data::{Corpus, DataLoader};
//! use zerodp::trainer::Trainer;
//!
//! let model = GptModel::new(GptConfig::tiny()).unwrap();
//! // A `DataLoader` is a data source; so is any `Fn(BatchIndex) -> Result<Batch, E>`.
//! let data = DataLoader::new(Corpus::from_text("t", &"some text ".repeat(100)), 16, 0).unwrap();
//! let trainer = Trainer::from_config_file(&model, "ds_config.json", 2, 42).unwrap();
//! let outcome = trainer.run(&data, 10, &[]).unwrap();
//! println!("final loss {}", outcome.last[0].as_ref().unwrap().loss);
//! ```

mod checkpoints;
mod evaluation;
mod observers;

pub use checkpoints::{CheckpointOptions, Resume};
pub use evaluation::{EvalData, Evaluation};
pub use observers::{eprintln_quiet, metrics_line, step_log_line, MetricsFile, ReportLog};

use crate::comm::{run_ranks, run_ranks_on, CommError, CommOptions, Communicator, ReduceOp};
use crate::config::{self, ConfigError, ResolveContext, SchedulerSettings, Settings};
use crate::flat::Buffer;
use crate::optim::scheduler::{betas_at, lr_at};
use crate::setup::{self, SetupError};
use crate::zero::{Engine, EngineConfig, EngineError, EvalLoss, Stage, StepReport, UnitModel};
use checkpoints::RankCheckpoints;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Why training could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    #[error(transparent)]
    Config(Box<ConfigError>),
    #[error("{0}")]
    Setup(#[from] SetupError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The data source could not produce a micro-batch.
    #[error("data for step {step}, rank {rank}, micro-batch {micro}: {message}")]
    Data {
        step: u64,
        rank: usize,
        micro: usize,
        message: String,
    },
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    /// An observer (metrics file, log) failed.
    #[error("{0}")]
    Observer(String),
    #[error("building rank {rank}'s thread pool: {message}")]
    Pool { rank: usize, message: String },
    /// One or more ranks failed; the message names the first and lists the others.
    #[error("{0}")]
    Ranks(String),
    #[error("{0}")]
    Invalid(String),
}

impl From<ConfigError> for TrainerError {
    fn from(e: ConfigError) -> Self {
        TrainerError::Config(Box::new(e))
    }
}

/// Which micro-batch a rank needs: everything a data source needs to cut the same global batch
/// the same way at every world size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchIndex {
    /// Optimizer step, from 0.
    pub step: u64,
    pub rank: usize,
    pub world_size: usize,
    /// Micro-batch within the step, `0..grad_accum`.
    pub micro: usize,
    /// Samples in this micro-batch (`train_micro_batch_size_per_gpu`).
    pub micro_batch_size: usize,
    pub grad_accum: usize,
    /// Samples in the global batch: `micro_batch_size * grad_accum * world_size`.
    pub train_batch_size: usize,
}

/// Where a rank's micro-batches come from. Every rank calls it from its own thread, so it must be
/// `Sync`; a closure `Fn(BatchIndex) -> Result<B, E>` is one.
pub trait DataSource<B>: Sync {
    fn micro_batch(&self, at: BatchIndex) -> Result<B, String>;
}

impl<B, E, F> DataSource<B> for F
where
    F: Fn(BatchIndex) -> Result<B, E> + Sync,
    E: std::fmt::Display,
{
    fn micro_batch(&self, at: BatchIndex) -> Result<B, String> {
        self(at).map_err(|e| e.to_string())
    }
}

/// One rank's optimizer step, as observers see it.
#[derive(Clone, Copy, Debug)]
pub struct StepEvent<'a> {
    pub rank: usize,
    pub world_size: usize,
    pub stage: Stage,
    /// Ψ: the model's parameter count (tied parameters once).
    pub num_params: usize,
    /// Steps the run will take.
    pub total_steps: u64,
    /// The global batch's tokens over this rank's step time.
    pub tokens_per_s: f64,
    pub report: &'a StepReport,
    /// The held-out loss after this step, when the run evaluated then ([`Trainer::with_eval`]).
    pub eval: Option<&'a EvalLoss>,
}

/// Receives every rank's step reports, on the rank's thread (so it must be `Sync`). An error
/// stops the run.
pub trait StepObserver: Sync {
    fn on_step(&self, event: &StepEvent<'_>) -> Result<(), TrainerError>;
}

/// The learning rate of each optimizer step.
#[derive(Clone, Debug, PartialEq)]
pub enum LrSchedule {
    Constant(f32),
    /// A DeepSpeed scheduler from the optimizer's base learning rate.
    Scheduler {
        scheduler: SchedulerSettings,
        base_lr: f64,
    },
}

impl LrSchedule {
    /// The learning rate of the `applied`-th applied optimizer step (0-based). Skipped steps do
    /// not count (DeepSpeed does not advance its scheduler on them).
    pub fn lr(&self, applied: u64) -> f32 {
        match self {
            LrSchedule::Constant(lr) => *lr,
            LrSchedule::Scheduler { scheduler, base_lr } => {
                lr_at(scheduler, *base_lr, applied) as f32
            }
        }
    }

    /// Adam's betas for the `applied`-th applied step when the scheduler cycles momentum
    /// (OneCycle with `cycle_momentum`, on by default); `None` leaves the optimizer's betas.
    pub fn betas(&self, applied: u64) -> Option<[f64; 2]> {
        match self {
            LrSchedule::Constant(_) => None,
            LrSchedule::Scheduler { scheduler, .. } => betas_at(scheduler, applied),
        }
    }

    /// The config's scheduler if it has one, else the optimizer's constant rate.
    pub fn from_settings(s: &Settings) -> LrSchedule {
        let base_lr = s
            .optimizer
            .as_ref()
            .map_or(config::OptimizerSettings::default().lr, |o| o.lr);
        match &s.scheduler {
            Some(sched) => LrSchedule::Scheduler {
                scheduler: sched.clone(),
                base_lr,
            },
            None => LrSchedule::Constant(base_lr as f32),
        }
    }
}

/// Where the ranks of a run live.
#[derive(Clone, Default)]
pub enum Backend {
    /// `world_size` ranks as threads of this process (the default).
    #[default]
    InProcess,
    /// This process is one rank of a world that `comm` spans (one rank per process, as under
    /// `mpirun` with `comm::MpiComm`): [`Trainer::run`] runs the rank loop once, as rank
    /// `comm.rank()`. The communicator's world size must equal the engine's.
    Process(Arc<dyn Communicator>),
    /// `world_size` ranks as threads of this process, rank r on the caller's `comms[r]` (one
    /// per rank of one world, in rank order): NCCL's group of one rank per GPU
    /// (`crate::comm::NcclComm::group`, feature `cuda`), or any other backend's ranks.
    Group(Vec<Arc<dyn Communicator>>),
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Backend::InProcess => f.write_str("InProcess"),
            Backend::Process(c) => write!(f, "Process(rank {} of {})", c.rank(), c.world_size()),
            Backend::Group(c) => write!(f, "Group({} ranks)", c.len()),
        }
    }
}

/// What a finished run hands back.
#[derive(Debug)]
pub struct TrainOutcome {
    /// The last step report (`None` for a run of 0 steps) of each rank this process ran, in rank
    /// order from [`TrainOutcome::first_rank`]: every rank in-process, one under
    /// [`Backend::Process`].
    pub last: Vec<Option<StepReport>>,
    /// The rank of `last[0]` (0 in-process).
    pub first_rank: usize,
    /// Optimizer steps taken (the same on every rank): fewer than asked when stopped.
    pub steps: u64,
    /// Of those, the steps whose update was applied (not skipped for Inf/NaN gradients).
    pub applied_steps: u64,
    /// Whether the stop flag ([`Trainer::with_stop_flag`]) ended the run early.
    pub stopped: bool,
    /// The step the run started from: 0, or the resumed checkpoint's.
    pub start_step: u64,
    /// Rank 0's checkpoint saves, in order.
    pub saves: Vec<crate::checkpoint::SaveTiming>,
    /// The trained full parameters per unit (unpadded, under mixed precision the fp32 master
    /// weights), when [`Trainer::keep_params`] asked for them. Every rank's copy is checked equal.
    pub params: Option<Vec<Vec<f32>>>,
    /// Each evaluation of the run ([`Trainer::with_eval`]): the optimizer steps done before it
    /// and the held-out loss.
    pub evals: Vec<(u64, EvalLoss)>,
}

/// One training run's setup; see the [module docs](self).
pub struct Trainer<'m, M: UnitModel> {
    model: &'m M,
    /// In-process rank r's own model, when each has one ([`Trainer::with_rank_models`]).
    rank_models: Vec<&'m M>,
    engine: EngineConfig,
    schedule: LrSchedule,
    comm: CommOptions,
    init: Option<Vec<Vec<f32>>>,
    threads_per_rank: usize,
    keep_params: bool,
    stop: Option<Arc<AtomicBool>>,
    checkpoints: Option<CheckpointOptions>,
    resume: Option<Resume>,
    backend: Backend,
    eval: Option<Evaluation<'m, M::Batch>>,
}

impl<'m, M: UnitModel> Trainer<'m, M> {
    /// A trainer with a hand-built engine configuration and the optimizer's learning rate
    /// (`engine.adam.lr`) at every step.
    pub fn new(model: &'m M, engine: EngineConfig) -> Self {
        let lr = engine.adam.lr as f32;
        Trainer {
            model,
            rank_models: Vec::new(),
            threads_per_rank: rank_threads(engine.world_size),
            engine,
            schedule: LrSchedule::Constant(lr),
            comm: CommOptions::default(),
            init: None,
            keep_params: false,
            stop: None,
            checkpoints: None,
            resume: None,
            backend: Backend::InProcess,
            eval: None,
        }
    }

    /// A trainer for resolved DeepSpeed settings on `world_size` ranks, with the config's scheduler.
    pub fn from_settings(
        model: &'m M,
        settings: &Settings,
        world_size: usize,
        seed: u64,
    ) -> Result<Self, TrainerError> {
        let engine = setup::engine_config(settings, world_size, seed)?;
        Ok(Trainer::new(model, engine).with_schedule(LrSchedule::from_settings(settings)))
    }

    /// A trainer from a DeepSpeed JSON config file on `world_size` ranks. The config's warnings
    /// go to stderr; use [`config::load_file`] and [`Trainer::from_settings`] to handle them.
    pub fn from_config_file(
        model: &'m M,
        path: impl AsRef<Path>,
        world_size: usize,
        seed: u64,
    ) -> Result<Self, TrainerError> {
        let ctx = ResolveContext {
            world_size,
            world_size_source: "the trainer's world size".into(),
            ..Default::default()
        };
        let loaded = config::load_file(path, &ctx)?;
        for w in &loaded.warnings {
            // Not eprintln!, which panics when standard error is closed.
            let _ = writeln!(std::io::stderr().lock(), "warning: {w}");
        }
        Trainer::from_settings(model, &loaded.settings, world_size, seed)
    }

    /// Give each in-process rank a model of its own, `models[r]` to rank r (the model of
    /// [`Trainer::new`] stays the description: its spec must equal theirs). For ranks whose
    /// models hold per-rank state: each on a GPU of its own, or each keeping its device tier
    /// ([`crate::zero::device_tier`]). Without it every rank computes with the one model.
    pub fn with_rank_models(mut self, models: Vec<&'m M>) -> Self {
        self.rank_models = models;
        self
    }

    /// The model rank `rank` computes with.
    fn model_of(&self, rank: usize) -> &'m M {
        self.rank_models.get(rank).copied().unwrap_or(self.model)
    }

    /// Refuses rank models that are not one per in-process rank of the trainer's model.
    fn check_rank_models(&self) -> Result<(), TrainerError> {
        if self.rank_models.is_empty() {
            return Ok(());
        }
        let world = self.engine.world_size;
        if matches!(self.backend, Backend::Process(_)) || self.rank_models.len() != world {
            return Err(TrainerError::Invalid(format!(
                "{} rank models for {world} in-process ranks: give one per rank (under MPI each \
                 process has its one model)",
                self.rank_models.len()
            )));
        }
        let want = self.model.spec();
        if let Some(r) = (0..world).find(|&r| self.rank_models[r].spec() != want) {
            return Err(TrainerError::Invalid(format!(
                "rank {r}'s model has other units than the trainer's model: every rank trains \
                 the same model"
            )));
        }
        Ok(())
    }

    pub fn with_schedule(mut self, schedule: LrSchedule) -> Self {
        self.schedule = schedule;
        self
    }
    /// The options of the in-process backend's communicators ([`Backend::InProcess`]); the
    /// communicators of [`Backend::Group`] and [`Backend::Process`] come with their own.
    pub fn with_comm_options(mut self, options: CommOptions) -> Self {
        self.comm = options;
        self
    }
    /// Start from these per-unit parameters (unpadded, `UnitSpec` order) instead of the model's
    /// seeded initialisation.
    pub fn with_init(mut self, params: Vec<Vec<f32>>) -> Self {
        self.init = Some(params);
        self
    }
    /// Rayon threads each rank computes on [default: the cores shared out among the ranks].
    pub fn with_threads_per_rank(mut self, threads: usize) -> Self {
        self.threads_per_rank = threads.max(1);
        self
    }
    /// Stop after the step during which `flag` became true (a signal handler sets it). The ranks
    /// agree on it with a one-float all-reduce after every step, so every rank stops after the
    /// same step and no collective is left waiting for a rank that already stopped.
    pub fn with_stop_flag(mut self, flag: Arc<AtomicBool>) -> Self {
        self.stop = Some(flag);
        self
    }
    /// Save sharded checkpoints ([`crate::checkpoint`]) as `options` say, at the end of the run,
    /// and when the stop flag ends it. The directory should be this run's alone while it runs:
    /// hold its [`crate::checkpoint::SaveDirLock`] around [`Trainer::run`], as `zerodp train`
    /// does (taken once per process, or per job with `acquire_for_job`, not per rank).
    pub fn with_checkpoints(mut self, options: CheckpointOptions) -> Self {
        self.checkpoints = Some(options);
        self
    }
    /// Start from a checkpoint: every rank reads the slices it holds (any saved world size or
    /// stage), and the run continues with the step after the saved one (`steps` in
    /// [`Trainer::run`] still counts from the start of training).
    pub fn with_resume(mut self, resume: Resume) -> Self {
        self.resume = Some(resume);
        self
    }
    /// The optimizer step of the checkpoint the run resumes from, if it resumes.
    pub fn resume_step(&self) -> Option<u64> {
        self.resume.as_ref().map(|r| r.manifest.step)
    }
    /// Where the ranks run [default: in-process threads].
    /// Score held-out data after every `eval.every` steps and after the last (a run of no steps
    /// left, such as a resumed finished run, scores it once); the losses reach the observers
    /// ([`StepEvent::eval`]), the checkpoints' manifests and [`TrainOutcome::evals`].
    pub fn with_eval(mut self, eval: Evaluation<'m, M::Batch>) -> Self {
        self.eval = Some(eval);
        self
    }

    pub fn with_backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }
    pub fn backend(&self) -> &Backend {
        &self.backend
    }
    /// Hand back the trained parameters in [`TrainOutcome::params`].
    pub fn keep_params(mut self, keep: bool) -> Self {
        self.keep_params = keep;
        self
    }
    pub fn engine_config(&self) -> &EngineConfig {
        &self.engine
    }
    pub fn engine_config_mut(&mut self) -> &mut EngineConfig {
        &mut self.engine
    }
    pub fn threads_per_rank(&self) -> usize {
        self.threads_per_rank
    }
    pub fn model(&self) -> &'m M {
        self.model
    }

    /// Train for `steps` optimizer steps on every rank; see the [module docs](self).
    pub fn run(
        &self,
        data: &dyn DataSource<M::Batch>,
        steps: u64,
        observers: &[&dyn StepObserver],
    ) -> Result<TrainOutcome, TrainerError> {
        let world = self.engine.world_size;
        if world == 0 {
            return Err(SetupError::WorldSize.into());
        }
        self.check_rank_models()?;
        let rank = |comm: &dyn Communicator, rank| {
            let cores = crate::affinity::rank_cores(rank, world, self.threads_per_rank);
            self.rank_in_pool(comm, (rank, cores), data, steps, observers)
        };
        let finals = match &self.backend {
            Backend::Process(comm) => {
                return self.run_this_rank(comm.clone(), data, steps, observers)
            }
            Backend::InProcess => run_ranks(world, self.comm.clone(), |c, r| rank(&*c, r)),
            Backend::Group(comms) if comms.len() != world => {
                return Err(TrainerError::Invalid(format!(
                    "{} communicators for {world} ranks: give one per rank",
                    comms.len()
                )))
            }
            Backend::Group(comms) => run_ranks_on(comms.clone(), |c, r| rank(&*c, r)),
        }
        .map_err(|e| TrainerError::Ranks(e.to_string()))?;
        let mut last = Vec::with_capacity(world);
        let mut params: Option<Vec<Vec<f32>>> = None;
        let mut first: Option<RankFinal> = None;
        for (rank, f) in finals.into_iter().enumerate() {
            last.push(f.last.clone());
            match (&params, &f.params) {
                (Some(p0), Some(p)) if p0 != p => {
                    return Err(TrainerError::Invalid(format!(
                        "rank {rank}'s trained parameters differ from rank 0's"
                    )))
                }
                (None, Some(p)) => params = Some(p.clone()),
                _ => {}
            }
            if rank == 0 {
                first = Some(f);
            }
        }
        let f = first.expect("at least one rank");
        Ok(TrainOutcome {
            last,
            first_rank: 0,
            steps: f.steps,
            applied_steps: f.applied,
            stopped: f.stopped,
            start_step: f.start_step,
            saves: f.saves,
            params,
            evals: f.evals,
        })
    }

    /// [`Backend::Process`]: this process's rank only. A failure is reported to the other ranks
    /// (their collectives fail naming this rank) before it is returned.
    fn run_this_rank(
        &self,
        comm: Arc<dyn Communicator>,
        data: &dyn DataSource<M::Batch>,
        steps: u64,
        observers: &[&dyn StepObserver],
    ) -> Result<TrainOutcome, TrainerError> {
        let (rank, world) = (comm.rank(), comm.world_size());
        if world != self.engine.world_size {
            return Err(TrainerError::Invalid(format!(
                "the communicator spans {world} ranks but the engine is configured for {}; use \
                 the launcher's process count as the world size",
                self.engine.world_size
            )));
        }
        // One rank per process: the launcher's binding (the process's mask) is kept as it is.
        let run = || self.rank_in_pool(&*comm, (rank, None), data, steps, observers);
        let f = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
            Ok(Ok(f)) => f,
            Ok(Err(e)) => {
                comm.report_failure(format!("it returned an error: {e}"));
                return Err(TrainerError::Ranks(format!("rank {rank} failed: {e}")));
            }
            Err(p) => {
                let m = crate::comm::inproc::panic_message(&*p);
                comm.report_failure(format!("it panicked: {m}"));
                return Err(TrainerError::Ranks(format!("rank {rank} panicked: {m}")));
            }
        };
        Ok(TrainOutcome {
            last: vec![f.last],
            first_rank: rank,
            steps: f.steps,
            applied_steps: f.applied,
            stopped: f.stopped,
            start_step: f.start_step,
            saves: f.saves,
            params: f.params,
            evals: f.evals,
        })
    }

    /// [`Trainer::rank_loop`] inside a fresh rayon pool of `threads_per_rank` threads, so that the
    /// rank's matmuls use its share of the cores instead of competing for the global pool; with
    /// `cores` ([`crate::affinity::rank_cores`]) each pool thread pinned to its own core, where
    /// the rank's buffers are then first touched.
    fn rank_in_pool(
        &self,
        comm: &dyn Communicator,
        (rank, cores): (usize, Option<Vec<usize>>),
        data: &dyn DataSource<M::Batch>,
        steps: u64,
        observers: &[&dyn StepObserver],
    ) -> Result<RankFinal, TrainerError> {
        let mut builder = rayon::ThreadPoolBuilder::new().num_threads(self.threads_per_rank);
        if let Some(cores) = cores {
            builder = builder.start_handler(move |i| {
                if let Some(&core) = cores.get(i) {
                    crate::affinity::pin_current_thread(core);
                }
            });
        }
        let pool = builder.build().map_err(|e| TrainerError::Pool {
            rank,
            message: e.to_string(),
        })?;
        pool.install(|| self.rank_loop(comm, rank, data, steps, observers))
    }

    /// One rank: build its engine (or resume it), then step, report, save, repeat.
    fn rank_loop(
        &self,
        comm: &dyn Communicator,
        rank: usize,
        data: &dyn DataSource<M::Batch>,
        steps: u64,
        observers: &[&dyn StepObserver],
    ) -> Result<RankFinal, TrainerError> {
        let mut engine = self.start_engine(comm)?;
        let mut saves = RankCheckpoints::new(
            self.checkpoints.as_ref(),
            &engine,
            self.model,
            &self.engine,
            rank,
        );
        let start = engine.steps_done();
        // Optimizer steps actually applied: skipped steps do not advance the scheduler.
        let mut applied = engine.counters().adam_step;
        let (mut last, mut stopped, mut evals) = (None, false, Vec::new());
        for step in start..steps {
            let report = self.step(&mut engine, data, step, rank, applied)?;
            applied += u64::from(!report.skipped);
            let eval = self.evaluate_after(&mut engine, rank, step + 1, steps)?;
            if let Some(e) = eval {
                saves.set_eval(step + 1, e);
                evals.push((step + 1, e));
            }
            self.observe(&report, eval.as_ref(), rank, steps, observers)?;
            last = Some(report);
            stopped = step + 1 < steps && self.stop_agreed(comm)?;
            let end = stopped || step + 1 == steps;
            saves.after_step(&mut engine, comm, step + 1, end)?;
            if stopped {
                break;
            }
        }
        if start >= steps {
            evals.extend(
                self.evaluate_after(&mut engine, rank, start, start)?
                    .map(|e| (start, e)),
            );
        }
        let params = match self.keep_params && !stopped {
            true => Some(engine.full_params()?),
            false => None,
        };
        Ok(RankFinal {
            last,
            params,
            steps: engine.steps_done(),
            applied,
            stopped,
            start_step: start,
            saves: saves.timings,
            evals,
        })
    }

    /// A fresh engine: seeded, or from `--init` weights, or resumed from a checkpoint.
    fn start_engine<'c>(
        &'c self,
        comm: &'c dyn Communicator,
    ) -> Result<Engine<'c, M>, TrainerError> {
        let mut engine = Engine::new(self.model_of(comm.rank()), comm, self.engine.clone())?;
        if let Some(init) = &self.init {
            for (u, values) in init.iter().enumerate() {
                engine.load_unit_params(u, values)?;
            }
        }
        if let Some(r) = &self.resume {
            let model = crate::checkpoint::ModelDescription::of(self.model.spec());
            crate::checkpoint::restore_engine(&mut engine, &r.manifest, &r.dir, &model)?;
        }
        Ok(engine)
    }

    /// Optimizer step `step` (0-based), the `applied`-th applied one.
    fn step(
        &self,
        engine: &mut Engine<'_, M>,
        data: &dyn DataSource<M::Batch>,
        step: u64,
        rank: usize,
        applied: u64,
    ) -> Result<StepReport, TrainerError> {
        let batches = (0..self.engine.grad_accum)
            .map(|micro| self.micro_batch(data, step, rank, micro))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some([beta1, beta2]) = self.schedule.betas(applied) {
            engine.set_betas(beta1, beta2);
        }
        Ok(engine.train_step(&batches, self.schedule.lr(applied))?)
    }

    /// The held-out loss after optimizer step `done` of `steps`, when one is due then.
    fn evaluate_after(
        &self,
        engine: &mut Engine<'_, M>,
        rank: usize,
        done: u64,
        steps: u64,
    ) -> Result<Option<EvalLoss>, TrainerError> {
        let Some(eval) = self.eval.as_ref().filter(|e| e.due(done, steps)) else {
            return Ok(None);
        };
        let ranks = (rank, self.engine.world_size);
        eval.run(engine, ranks, self.engine.micro_batch, done)
            .map(Some)
    }

    fn observe(
        &self,
        report: &StepReport,
        eval: Option<&EvalLoss>,
        rank: usize,
        steps: u64,
        observers: &[&dyn StepObserver],
    ) -> Result<(), TrainerError> {
        let world = self.engine.world_size;
        let event = StepEvent {
            rank,
            world_size: world,
            stage: self.engine.stage,
            num_params: self.model.spec().num_params(),
            total_steps: steps,
            tokens_per_s: (report.tokens * world) as f64 / report.elapsed.as_secs_f64(),
            report,
            eval,
        };
        for o in observers {
            o.on_step(&event)?;
        }
        Ok(())
    }

    /// Whether any rank's stop flag is set, agreed by every rank (false without a flag).
    fn stop_agreed(&self, comm: &dyn Communicator) -> Result<bool, TrainerError> {
        let Some(flag) = &self.stop else {
            return Ok(false);
        };
        let mine = if flag.load(Ordering::SeqCst) {
            1.0
        } else {
            0.0
        };
        let all = comm
            .all_reduce(Buffer::F32(vec![mine]), ReduceOp::Max)
            .wait_one()?;
        Ok(all.get_f32(0) > 0.0)
    }

    fn micro_batch(
        &self,
        data: &dyn DataSource<M::Batch>,
        step: u64,
        rank: usize,
        micro: usize,
    ) -> Result<M::Batch, TrainerError> {
        let e = &self.engine;
        let at = BatchIndex {
            step,
            rank,
            world_size: e.world_size,
            micro,
            micro_batch_size: e.micro_batch,
            grad_accum: e.grad_accum,
            train_batch_size: e.micro_batch * e.grad_accum * e.world_size,
        };
        data.micro_batch(at).map_err(|message| TrainerError::Data {
            step,
            rank,
            micro,
            message,
        })
    }
}

/// How a rank's loop ended.
struct RankFinal {
    last: Option<StepReport>,
    /// Its trained parameters, when kept (not after a stop).
    params: Option<Vec<Vec<f32>>>,
    /// Optimizer steps taken since the start of training (a resumed run's included).
    steps: u64,
    applied: u64,
    stopped: bool,
    start_step: u64,
    saves: Vec<crate::checkpoint::SaveTiming>,
    evals: Vec<(u64, EvalLoss)>,
}

/// Rayon threads per rank: the cores shared out among the ranks.
pub(crate) fn rank_threads(world: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / world.max(1)).max(1)
}
