//! `zerodp train`: train the GPT reference model on a text file with a DeepSpeed config, on
//! `--world-size` in-process ranks, or one rank per process under `mpirun` (`--backend`, see
//! [`super::launch`]).
//!
//! In-process, each rank is a thread with its own rayon pool (`max(1, cores / world)` threads, the
//! pool candle's matmuls run in), its own engine and its own share of every batch. Under MPI each
//! process is one rank (world size and rank from MPI) running the same trainer, with the host's
//! cores shared among the ranks on it. Rank 0 draws the progress bar and prints the banner, the
//! summary and the log lines; every rank writes its metrics lines.
//!
//! `--metrics FILE` gets one JSON object per optimizer step and rank, a whole line at a time; the
//! keys are documented in `zerodp::trainer` (`observers.rs`). In-process every rank writes to
//! FILE; under MPI rank 0 writes FILE and rank k writes `<stem>.rank<k>.<ext>` next to it
//! (`metrics.jsonl`, `metrics.rank1.jsonl`, ...): processes may run on different hosts, so each
//! writes its own file. `--save` is written by rank 0 (every rank holds the same parameters).
//!
//! Mixed precision comes from the config's `bf16` or `fp16` block: 16-bit parameters and
//! gradients, fp32 master weights and Adam moments on the owning shard. A step whose gradients
//! hold Inf/NaN is skipped on every rank and logged with the units involved; fp16 lowers its loss
//! scale (DeepSpeed's dynamic scaling, at the documented 2^16 and hysteresis 2 even when the block
//! sets no dynamic key), bf16 and fp32 stop after `--max-skipped-steps` such steps in a row.
//!
//! Reliability: output paths are checked against the inputs and any checkpoint before any work
//! ([`zerodp::outputs`]); the run holds `--save-dir`'s lock from before the first step
//! until it returns, so a second run on the directory is refused at once
//! ([`zerodp::checkpoint::SaveDirLock`]); SIGINT/SIGTERM end the run after the current step (exit
//! 130 / 143, the lock released on the way out); a run whose loss ends non-finite or whose every
//! step was skipped exits 1.

use super::launch::Resolved;
use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use zerodp::checkpoint::{acquire_for_job, SaveDirLock};
use zerodp::comm::{CommOptions, Communicator, TraceLevel};
use zerodp::config::{self, ResolveContext};
use zerodp::model::train_model::{self, TrainModel};
use zerodp::model::{load_safetensors, save_safetensors, GptConfig};
use zerodp::outputs::{check_outputs, check_save_dir, NamedPath};
use zerodp::planner::TrainProcess;
use zerodp::trainer::{
    step_log_line, Backend, CheckpointOptions, Evaluation, LrSchedule, MetricsFile, Resume,
    StepEvent, StepObserver, TrainOutcome, Trainer, TrainerError,
};
use zerodp::zero::unit::UnitModel;

#[derive(clap::Args, Debug)]
pub struct TrainArgs {
    /// DeepSpeed JSON config (batch sizes, zero_optimization, optimizer, scheduler, clipping).
    #[arg(long, required = true)]
    pub config: Option<PathBuf>,
    /// Number of data-parallel ranks (threads of this process) [default: 1; under MPI the
    /// process count, which it must equal if given].
    #[arg(long)]
    pub world_size: Option<usize>,
    /// Where the ranks run: `inprocess` (threads), `mpi` (one rank per process, under mpirun) or
    /// `auto` (MPI when started by an MPI launcher).
    #[arg(long, value_enum, default_value_t = super::launch::BackendChoice::Auto)]
    pub backend: super::launch::BackendChoice,
    /// Run the collectives through NCCL between the ranks' GPUs (a `cuda` build and `--device
    /// cuda`; one rank per GPU): in-process ranks as NCCL's group, MPI ranks each on its local
    /// rank's GPU, MPI carrying NCCL's id. The buffers stay in host memory (each collective
    /// copies them to its GPU and back).
    #[arg(long)]
    pub nccl: bool,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub hf: super::hf_model::HfModelArgs,
    #[command(flatten)]
    pub data: super::data_args::DataArgs,
    #[command(flatten)]
    pub eval: super::eval_args::EvalArgs,
    /// Start from these weights instead of the seeded initialisation (names and layouts as
    /// `zerodp::model::weights` documents; linear weights [out, in] as torch.nn.Linear).
    #[arg(long, value_name = "FILE.safetensors")]
    pub init: Option<PathBuf>,
    /// Write the trained weights here at the end.
    #[arg(long, value_name = "FILE.safetensors")]
    pub save: Option<PathBuf>,
    /// Optimizer steps to run.
    #[arg(long, default_value_t = 200)]
    pub steps: u64,
    /// Seed of the initialisation and of the data order.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Write one JSON object per optimizer step and rank to this file.
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Draw the run's curves (loss, held-out loss, learning rate, tokens/s, memory) into this
    /// SVG as the run goes, rewritten at most once a second; `zerodp plot` draws several runs.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// Seconds a rank waits inside one collective before failing, or inf for no limit [default:
    /// ZERODP_TIMEOUT or the communicator's default].
    #[arg(long)]
    pub timeout: Option<f64>,
    /// Recompute every unit's forward in backward (also switched on by the config's
    /// activation_checkpointing block).
    #[arg(long)]
    pub checkpoint_activations: bool,
    #[command(flatten)]
    pub preflight: super::preflight::PreflightArgs,
    #[command(flatten)]
    pub device: super::device_args::DeviceArgs,
    /// No progress bar (log lines at steps_per_print only).
    #[arg(long)]
    pub no_progress: bool,
    /// Stop with an error after this many optimizer steps in a row had Inf/NaN gradients (each is
    /// skipped). Applies to bf16, fp32 and fp16 with a static loss scale; dynamic fp16 scaling
    /// stops at `min_loss_scale` instead.
    #[arg(long, default_value_t = 10)]
    pub max_skipped_steps: u64,
    /// Save sharded checkpoints into this directory (created if missing): at the end of the run,
    /// every --save-every steps, and on SIGTERM.
    #[arg(long, value_name = "DIR")]
    pub save_dir: Option<PathBuf>,
    /// Save a checkpoint after every N optimizer steps (needs --save-dir).
    #[arg(long, value_name = "N")]
    pub save_every: Option<u64>,
    /// Keep only the newest K checkpoints in --save-dir (default: keep all).
    #[arg(long, value_name = "K")]
    pub keep_last: Option<usize>,
    /// `zerodp eval`: no step, the held-out loss on standard output (see [`super::eval`]).
    #[arg(skip)]
    pub eval_only: bool,
    /// Resume from the newest checkpoint in DIR (its `latest`), or from a checkpoint directory
    /// itself [default DIR: --save-dir]. `--steps` still counts from the start of training.
    #[arg(long, value_name = "DIR", num_args = 0..=1)]
    pub resume: Option<Option<PathBuf>>,
}

/// Which GPT to build.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// GPT preset: tiny, demo or small [default: demo for train, small for bench train].
    #[arg(long = "model")]
    pub preset: Option<String>,
    #[arg(long)]
    pub layers: Option<usize>,
    #[arg(long)]
    pub width: Option<usize>,
    #[arg(long)]
    pub heads: Option<usize>,
    #[arg(long)]
    pub context: Option<usize>,
}

impl ModelArgs {
    /// The preset (`default` when none was given) with the overrides applied.
    pub fn build(&self, default: &str) -> anyhow::Result<GptConfig> {
        let mut c = GptConfig::preset(self.preset.as_deref().unwrap_or(default))?;
        if let Some(v) = self.layers {
            c.layers = v;
        }
        if let Some(v) = self.width {
            c.width = v;
        }
        if let Some(v) = self.heads {
            c.heads = v;
        }
        if let Some(v) = self.context {
            c.context = v;
        }
        c.validate()?;
        Ok(c)
    }
}

pub fn run(args: TrainArgs) -> anyhow::Result<i32> {
    let backend = super::launch::resolve(args.backend, args.world_size)?;
    check_nccl(&args, backend)?;
    let world = backend.world();
    let (hf, gpt, tokenizer) = what_to_train(&args)?;
    let settings = load_settings(&args, backend, &gpt)?;
    let device = args.device.open(settings.precision)?;
    // Outputs are checked before any work; under MPI with this rank's metrics file (the
    // launcher's rank, before MPI is up; checked again below if MPI says otherwise). Nothing is
    // created until every check has passed.
    let launch_rank = launch_rank(backend);
    check_paths(&args, metrics_path(&args, launch_rank).as_deref())?;
    let resume = resume_from(&args, launch_rank == 0)?;
    // A resumed run continues the saved run's data order.
    let seed = resume.as_ref().map_or(args.seed, |r| r.manifest.seed);
    let engine_cfg = zerodp::setup::engine_config(&settings, world, seed)
        .with_context(|| format!("config {}", config_name(&args)))?;
    let models = super::hf_model::rank_models(
        &gpt,
        hf.as_ref(),
        (&args.device, settings.precision, &device),
        (&engine_cfg, backend.ranks_in_process()),
    )?;
    // What Trainer::from_settings builds, from the configuration already resolved above.
    let mut trainer = Trainer::new(&models[0], engine_cfg)
        .with_rank_models(train_model::per_rank(&models))
        .with_schedule(LrSchedule::from_settings(&settings));
    configure_engine(&mut trainer, &args)?;
    let gpu_memory = preflight(&args, &settings, &trainer, (&gpt, &device, backend))?;
    if let Some(m) = &hf {
        m.check_weights(trainer.model().spec())?;
    }
    // The run owns --save-dir from here until it returns (the lock is released on drop); under
    // MPI rank 0 takes it for the job once the ranks can agree, below.
    create_save_dir(&args)?;
    let mut save_dir_lock = match backend {
        Resolved::InProcess { .. } => take_save_dir_lock(args.save_dir.as_deref(), None)?,
        Resolved::Mpi { .. } => None,
    };
    let flags = (launch_rank == 0, !args.no_progress);
    let shape = (&gpt, seed, device.gpu.is_none());
    let (data, held_out) = (args.eval).data(&args.data, tokenizer.as_ref(), shape, flags)?;
    trainer = with_initial_weights(trainer, &args, hf.as_ref())?;
    trainer = with_data(trainer, &args, &data, held_out.as_ref());
    let data_record = data_record(&args, &data, resume.as_ref(), launch_rank == 0);
    let comm_options = comm_options(&args, &settings)?;
    let rank;
    (rank, trainer, save_dir_lock) = join_ranks(
        trainer,
        (&args, backend),
        comm_options.clone(),
        save_dir_lock,
    )?;
    let metrics_path = metrics_path(&args, rank);
    if rank != launch_rank {
        check_paths(&args, metrics_path.as_deref())?;
    }
    let signals = Signals::register()?;
    let trainer = trainer
        .with_comm_options(comm_options)
        .with_stop_flag(signals.flag.clone());
    let trainer = with_outputs(
        trainer,
        &args,
        (&settings, hf.as_ref(), data_record),
        resume,
    );
    let resumed_at = trainer.resume_step();
    let metrics = metrics_path
        .as_deref()
        .map(|p| open_metrics(p, resumed_at))
        .transpose()?;
    if rank == 0 {
        print_banner(&trainer, (backend, &args, &settings, &gpt), &data);
        print_compute(&device, gpu_memory.as_deref(), trainer.engine_config());
    }
    let progress = ProgressLog::new(
        args.steps,
        args.no_progress || rank != 0,
        settings.steps_per_print,
    )
    .with_breakdown(settings.wall_clock_breakdown);
    let started = Instant::now();
    let plot = (rank == 0)
        .then(|| args.plot.as_deref().map(LivePlotter::new))
        .flatten();
    let mut observers: Vec<&dyn StepObserver> = vec![&progress];
    observers.extend(metrics.as_ref().map(|m| m as &dyn StepObserver));
    observers.extend(plot.as_ref().map(|p| p as &dyn StepObserver));
    let outcome = trainer.run(&data, args.steps, &observers);
    // The last checkpoint is committed (or the run failed): free the directory now, not after
    // the communicator's teardown, which under mpirun may be cut short by the launcher's SIGKILL
    // once a signal has ended the job.
    drop(save_dir_lock);
    plot.as_ref().map(LivePlotter::finish);
    let outcome = outcome?;
    progress.bar.finish_and_clear();
    if rank == 0 {
        report_saves(&outcome, args.save_dir.as_deref());
        super::eval::report(&outcome, args.eval_only)?;
        let tokens_per_step = settings.batch.train_batch_size * gpt.context;
        report_end(&outcome, started, tokens_per_step, backend);
    }
    finish(&args, (&models[0], &outcome), rank, &signals)
}

/// The Hugging Face model (`--model-dir`, `--model-config`), the GPT's shape and the tokenizer,
/// which is read first because it sizes the model's vocabulary (the data is read after the
/// checks).
fn what_to_train(
    args: &TrainArgs,
) -> anyhow::Result<(
    Option<train_model::HfModel>,
    GptConfig,
    Option<zerodp::data::TextTokenizer>,
)> {
    let hf = args.hf.read()?;
    let gpt = match &hf {
        Some(m) => with_seq_len(m.config.gpt.clone(), args.model.context)?,
        None => args.model.build("demo")?,
    };
    let (gpt, tokenizer) = args
        .data
        .fit_model(gpt, args.hf.model_dir.as_deref(), hf.is_some())?;
    Ok((hf, gpt, tokenizer))
}

/// A Hugging Face model's windows: `--context N` tokens where given (at most the positions its
/// config has: `max_position_embeddings` or `n_positions`), else as many as it has positions.
/// The model keeps all its positions; only the windows it trains on are shorter.
fn with_seq_len(mut gpt: GptConfig, context: Option<usize>) -> anyhow::Result<GptConfig> {
    match context {
        Some(n) if n == 0 || n > gpt.context => bail!(
            "--context {n}: the model's config has {} positions (max_position_embeddings or \
             n_positions); train on windows of 1 to {} tokens",
            gpt.context,
            gpt.context
        ),
        Some(n) => gpt.context = n,
        None => {}
    }
    Ok(gpt)
}

/// `--metrics FILE`, created before the first step; a resumed run keeps the lines of the steps
/// its checkpoint holds ([`MetricsFile::resume`]).
fn open_metrics(path: &Path, resumed_at: Option<u64>) -> anyhow::Result<MetricsFile> {
    let file = match resumed_at {
        Some(step) => MetricsFile::resume(path, step),
        None => MetricsFile::create(path),
    };
    file.with_context(|| format!("creating metrics file {}", path.display()))
}

/// `--nccl` before any work: a `cuda` build, the ranks on GPUs, in-process one per GPU.
fn check_nccl(args: &TrainArgs, backend: Resolved) -> anyhow::Result<()> {
    if args.nccl {
        super::nccl::available()?;
        if !args.device.device.is_cuda() {
            bail!("--nccl runs the collectives between the ranks' GPUs: add --device cuda");
        }
        if let Resolved::InProcess { world } = backend {
            super::nccl::check_one_rank_per_gpu(&nccl_ordinals(args, world)?)?;
        }
    }
    Ok(())
}

/// The GPU of each of `world` in-process ranks: the one its model computes on.
fn nccl_ordinals(args: &TrainArgs, world: usize) -> anyhow::Result<Vec<usize>> {
    let gpus = super::nccl::gpus()?;
    (0..world)
        .map(|r| match args.device.device.rank_ordinal(gpus, r)? {
            Some(ordinal) => Ok(ordinal),
            None => bail!("--nccl runs the collectives between the ranks' GPUs: add --device cuda"),
        })
        .collect()
}

/// Under MPI: start the communication thread, this process's rank, and rank 0's lock on
/// --save-dir for the job (taken once the ranks can agree); in-process runs keep `lock` and are
/// rank 0. With `--nccl` the ranks' collectives run through NCCL instead: under MPI over the MPI
/// communicator, which carries NCCL's id and stays with the NCCL rank (told of its failure), or
/// as an in-process group.
fn join_ranks<'m>(
    trainer: Trainer<'m, TrainModel>,
    (args, backend): (&TrainArgs, Resolved),
    comm_options: CommOptions,
    lock: Option<SaveDirLock>,
) -> anyhow::Result<(usize, Trainer<'m, TrainModel>, Option<SaveDirLock>)> {
    let world = match backend {
        Resolved::InProcess { world } if args.nccl => {
            let comms = super::nccl::group(&nccl_ordinals(args, world)?, comm_options)?;
            return Ok((0, trainer.with_backend(Backend::Group(comms)), lock));
        }
        Resolved::InProcess { .. } => return Ok((0, trainer, lock)),
        Resolved::Mpi { world } => world,
    };
    let (comm, topo) = super::launch::start_mpi(comm_options.clone(), world)?;
    let rank = comm.rank();
    let lock = take_save_dir_lock(args.save_dir.as_deref(), Some(&*comm))?;
    let trainer =
        trainer.with_threads_per_rank(super::launch::threads_for_local_ranks(topo.local_size));
    if !args.nccl {
        return Ok((rank, trainer.with_backend(Backend::Process(comm)), lock));
    }
    // The GPU this process's model computes on (its local rank's, or --device cuda:N's).
    let device = args.device.device;
    let ordinal = device.ordinal(super::nccl::gpus()?)?.unwrap_or(0);
    let pinned = matches!(device, zerodp::device::ComputeDevice::Cuda(Some(_)));
    if !pinned && zerodp::device::local_rank() != topo.local_rank {
        bail!(
            "--nccl: the launcher's environment gives this process local rank {} but MPI says {}, \
             so its model's GPU would not be its NCCL rank's; start it with mpirun (which sets \
             OMPI_COMM_WORLD_LOCAL_RANK) or pin each process with --device cuda:N",
            zerodp::device::local_rank(),
            topo.local_rank
        );
    }
    let at = (ordinal, topo.local_size, pinned);
    let nccl: Arc<dyn Communicator> = Arc::from(super::nccl::over_mpi(comm, at, comm_options)?);
    Ok((rank, trainer.with_backend(Backend::Process(nccl)), lock))
}

/// The end of a run that returned: a signal's exit code (after saying what was saved), else the
/// final checks and `--save`'s weights.
fn finish(
    args: &TrainArgs,
    (model, outcome): (&TrainModel, &TrainOutcome),
    rank: usize,
    signals: &Signals,
) -> anyhow::Result<i32> {
    if let Some(code) = signals.exit_code() {
        if rank == 0 {
            report_interrupted(signals, outcome, args);
        }
        return Ok(code);
    }
    check_final(outcome)?;
    if rank == 0 {
        save_final_weights(args, model, outcome)?;
    }
    Ok(0)
}

/// Rank 0's lines on where the products run: bf16 products on a CPU with AVX512-BF16, the GPU and
/// its planned memory on a GPU.
fn print_compute(
    device: &super::device_args::OpenDevice,
    gpu_memory: Option<&str>,
    engine_cfg: &zerodp::zero::EngineConfig,
) {
    if device.gpu.is_none() && zerodp::model::gemm_path() == "avx512-bf16" {
        errln!(
            "products: bf16 operands, f32 sums (AVX512-BF16, as bf16 autocast; {}=0 keeps f32)",
            super::device_args::BF16_PRODUCTS_ENV
        );
    }
    if let Some(memory) = gpu_memory {
        errln!("device: {}", device.describe());
        errln!("GPU memory: {memory}");
        match zerodp::zero::device_tier::refusal(engine_cfg) {
            None if engine_cfg.world_size > 1 && engine_cfg.stage != zerodp::zero::Stage::Zero0 => {
                errln!(
                    "optimizer: Adam on the GPU (parameters, gradients and each rank's shard of \
                     Adam's state stay there; the ranks reduce and gather through host memory)"
                )
            }
            None => errln!(
                "optimizer: Adam on the GPU (parameters, gradients and Adam's state stay there)"
            ),
            Some(why) => errln!("optimizer: Adam on the CPU, in host memory ({why})"),
        }
    }
}

/// `--save`: the final weights as safetensors. Every rank holds the same parameters (gathering
/// them is collective); rank 0 writes them.
fn save_final_weights(
    args: &TrainArgs,
    model: &TrainModel,
    outcome: &TrainOutcome,
) -> anyhow::Result<()> {
    if let (Some(path), Some(params)) = (&args.save, &outcome.params) {
        let slices: Vec<&[f32]> = params.iter().map(Vec::as_slice).collect();
        save_safetensors(path, model.spec(), &slices)?;
        errln!("saved weights to {}", path.display());
    }
    Ok(())
}

/// The DeepSpeed config, resolved for this run's world size and model (its warnings printed).
fn load_settings(
    args: &TrainArgs,
    backend: Resolved,
    gpt: &GptConfig,
) -> anyhow::Result<config::Settings> {
    let ctx = ResolveContext {
        world_size: backend.world(),
        world_size_source: match backend {
            Resolved::Mpi { .. } => "the MPI process count".into(),
            Resolved::InProcess { .. } => "--world-size".into(),
        },
        hidden_size: Some(gpt.width),
        total_steps: Some(args.steps as usize),
        // The launcher's ranks per host fill `zero_hpz_partition_size: "auto"`.
        ranks_per_host: zerodp::comm::detect_mpi_launch()
            .filter(|_| matches!(backend, Resolved::Mpi { .. }))
            .and_then(|l| l.local_size),
        ..Default::default()
    };
    let loaded = match &args.config {
        Some(path) => config::load_file(path, &ctx)?,
        None => config::load_str(super::eval::DEFAULT_CONFIG, "zerodp eval's default", &ctx)?,
    };
    for w in &loaded.warnings {
        errln!("warning: {w}");
    }
    Ok(loaded.settings)
}

/// The config's name in messages.
fn config_name(args: &TrainArgs) -> String {
    match &args.config {
        Some(path) => path.display().to_string(),
        None => "(zerodp eval's default)".into(),
    }
}

/// This process's rank as its launcher set it (0 in-process; under MPI read before MPI is up).
fn launch_rank(backend: Resolved) -> usize {
    match backend {
        Resolved::Mpi { .. } => zerodp::comm::detect_mpi_launch()
            .and_then(|l| l.rank)
            .unwrap_or(0),
        Resolved::InProcess { .. } => 0,
    }
}

/// Rank `rank`'s metrics file: `--metrics` itself for rank 0, a file beside it for the others.
fn metrics_path(args: &TrainArgs, rank: usize) -> Option<PathBuf> {
    args.metrics
        .as_deref()
        .map(|p| super::launch::per_rank_path(p, rank))
}

/// The command line's additions to the config's engine: activation checkpointing, the skipped
/// step limit and the memory budget.
fn configure_engine(trainer: &mut Trainer<'_, TrainModel>, args: &TrainArgs) -> anyhow::Result<()> {
    if args.max_skipped_steps == 0 {
        bail!("--max-skipped-steps must be at least 1 (1 stops at the first step with Inf/NaN gradients)");
    }
    let engine_cfg = trainer.engine_config_mut();
    engine_cfg.activation_checkpointing |= args.checkpoint_activations;
    engine_cfg.max_skipped_steps = args.max_skipped_steps;
    if let Some(text) = &args.preflight.device_memory {
        engine_cfg.device_budget = Some(zerodp::planner::parse_bytes(text, "--device-memory")?);
    }
    Ok(())
}

/// The pre-flight checks, before any data is read: host memory for every run, GPU memory on a
/// GPU (its estimate returned for the banner).
fn preflight(
    args: &TrainArgs,
    settings: &config::Settings,
    trainer: &Trainer<'_, TrainModel>,
    (gpt, device, backend): (&GptConfig, &super::device_args::OpenDevice, Resolved),
) -> anyhow::Result<Option<String>> {
    let engine_cfg = trainer.engine_config();
    if args.nccl && engine_cfg.hpz_active() {
        bail!(
            "zero_hpz_partition_size {} asks for gathers within hosts, which the NCCL backend does \
             not run: remove --nccl (the MPI backend runs them) or set zero_hpz_partition_size to 1",
            engine_cfg.hpz_partition_size
        );
    }
    if args.nccl && engine_cfg.qgz_active() {
        bail!(
            "zero_quantized_gradients asks for all-to-alls, which the NCCL backend does not run: \
             remove --nccl (the MPI backend runs them) or set zero_quantized_gradients to false"
        );
    }
    let spec = trainer.model().spec();
    // In-process ranks share this process (and spread over its GPUs, or share cuda:N); MPI ranks
    // each have their own process (and their local rank's GPU).
    let ranks_in_process = backend.ranks_in_process() as u64;
    // The corpus is read after the check; its size is planned from the file's (a missing file is
    // reported when it is read).
    // The products' packing memory on the path they run on this CPU (the gemm crate's, sized by
    // its own rules for this CPU's caches, or zerodp's bf16 panels).
    let tokens = engine_cfg.micro_batch * gpt.context;
    let (shape, products) = match trainer.model() {
        TrainModel::Llama(m) => {
            let c = m.units().config();
            (
                c.shape(gpt.context),
                zerodp::model::llama_products(c, tokens),
            )
        }
        TrainModel::Gpt(_) => (gpt.shape(), zerodp::model::gpt_products(gpt, tokens)),
    };
    let gemm = zerodp::model::products_footprint(&products, trainer.threads_per_rank());
    let process = TrainProcess {
        corpus_bytes: args.data.input_bytes(),
        threads_per_rank: trainer.threads_per_rank() as u64,
        checkpoint_staging: args.save_dir.is_some(),
        compute_on_gpu: device.gpu.is_some(),
        gemm_per_thread: gemm.per_thread,
        gemm_per_rank: gemm.per_rank,
        head_packing: gemm.head_backward,
        cuda_build: cfg!(feature = "cuda"),
        ranks_in_process,
    };
    let mpi = zerodp::comm::detect_mpi_launch();
    let launch = zerodp::planner::preflight::Launch {
        ranks_on_host: mpi.map(|l| l.local_size.unwrap_or(l.size)),
        // Under mpirun the launcher's rank, MPI not being up yet.
        reports: mpi.and_then(|l| l.rank).unwrap_or(0) == 0,
    };
    let device_memory = args.preflight.device_memory.as_deref();
    let models = (engine_cfg, spec, &shape);
    if let Some(line) =
        zerodp::planner::preflight::check(device_memory, settings, models, process, launch)?
    {
        errln!("{line}");
    }
    let Some(gpu) = &device.gpu else {
        return Ok(None);
    };
    let bytes = device.dtype.size_in_bytes() as u64;
    // Each in-process rank has a model of its own on its GPU; the busiest GPU is checked.
    let on_gpu = super::device_args::ranks_per_gpu(&args.device, ranks_in_process as usize)?;
    let memory = zerodp::planner::preflight::check_gpu(
        gpu,
        (bytes, on_gpu.max(1) as u64),
        engine_cfg,
        spec,
        &shape,
    )?;
    Ok(Some(memory))
}

/// The run's starting weights: `--init`'s file, or a model directory's.
fn with_initial_weights<'m>(
    mut trainer: Trainer<'m, TrainModel>,
    args: &TrainArgs,
    hf: Option<&train_model::HfModel>,
) -> anyhow::Result<Trainer<'m, TrainModel>> {
    let spec = trainer.model().spec().clone();
    if let Some(p) = &args.init {
        trainer = trainer.with_init(load_safetensors(p, &spec)?);
    }
    if let Some(m) = hf {
        if let (Some(weights), Some(dir)) = (m.initial_weights(&spec)?, &m.dir) {
            errln!("loaded the weights of {}", dir.display());
            trainer = trainer.with_init(weights);
        }
    }
    Ok(trainer)
}

/// What the run writes and where it starts: the final weights kept for `--save`, checkpoints into
/// `--save-dir` (with the config and the model's Hugging Face description), the resumed state.
fn with_outputs<'m>(
    trainer: Trainer<'m, TrainModel>,
    args: &TrainArgs,
    (settings, hf, data): (
        &config::Settings,
        Option<&train_model::HfModel>,
        Option<serde_json::Value>,
    ),
    resume: Option<Resume>,
) -> Trainer<'m, TrainModel> {
    let mut trainer = trainer.keep_params(args.save.is_some());
    if let Some(dir) = &args.save_dir {
        let tokenizer = args.data.tokenizer.as_deref();
        let mut config = train_model::checkpoint_config(settings.to_json(), hf, tokenizer);
        if let (Some(map), Some(data)) = (config.as_object_mut(), data) {
            map.insert(DATA_KEY.into(), data);
        }
        trainer = trainer.with_checkpoints(CheckpointOptions {
            dir: dir.clone(),
            every: args.save_every,
            keep_last: args.keep_last,
            config,
        });
    }
    match resume {
        Some(r) => trainer.with_resume(r),
        None => trainer,
    }
}

/// The key of the resolved config recorded in checkpoints that holds the data the run trained on
/// ([`data_record`]).
pub const DATA_KEY: &str = "zerodp_data";

/// How the run treats its data: chat data trains on unequal numbers of tokens per row, so the
/// step's loss is per token; held-out data is scored after the last step and every
/// `--eval-every`.
fn with_data<'m>(
    mut trainer: Trainer<'m, TrainModel>,
    args: &TrainArgs,
    data: &zerodp::data::TrainData,
    held_out: Option<&'m zerodp::data::HeldOutData>,
) -> Trainer<'m, TrainModel> {
    trainer.engine_config_mut().loss_per_token = data.loss_per_token();
    match held_out {
        Some(held_out) => trainer.with_eval(Evaluation {
            data: held_out,
            every: args.eval.eval_every,
        }),
        None => trainer,
    }
}

/// What the checkpoints record of the data ([`zerodp::data::TrainData::record`]), and what a
/// resumed run checks it against. Rank 0 (`lead`) alone writes the manifest and reports a
/// resume, so it alone reads the whole stream.
fn data_record(
    args: &TrainArgs,
    data: &zerodp::data::TrainData,
    resume: Option<&Resume>,
    lead: bool,
) -> Option<serde_json::Value> {
    let wanted = lead && (args.save_dir.is_some() || resume.is_some());
    let record = wanted.then(|| data.record());
    if let (Some(r), Some(record)) = (resume, &record) {
        check_resumed_data(r, record);
    }
    record
}

/// A resumed run on other tokens than its checkpoint recorded is allowed (fine-tuning on new
/// data is a resume too) but said: the data order, a function of the seed and the step, then
/// continues over other windows. Checkpoints from before the record say nothing.
fn check_resumed_data(resume: &Resume, now: &serde_json::Value) {
    let Some(saved) = resume.manifest.config.get(DATA_KEY) else {
        return;
    };
    if saved.get("sha256") == now.get("sha256") && saved.get("context") == now.get("context") {
        return;
    }
    let describe = |v: &serde_json::Value| {
        format!(
            "{} ({} tokens, windows of {}, sha256 {:.12})",
            v["source"].as_str().unwrap_or("?"),
            v["tokens"],
            v["context"],
            v["sha256"].as_str().unwrap_or("?")
        )
    };
    errln!(
        "warning: the checkpoint in {} was trained on {}; this run reads {}: training continues \
         on these tokens from step {}, over other windows than the saved run would have seen",
        resume.dir.display(),
        describe(saved),
        describe(now),
        resume.manifest.step
    );
}

/// The communicator's options: the environment's, `--timeout`, and the config's comms_logger.
fn comm_options(args: &TrainArgs, settings: &config::Settings) -> anyhow::Result<CommOptions> {
    let mut comm_options = CommOptions::from_env()?;
    if let Some(t) = args.timeout {
        comm_options.timeout = super::timeout_flag(t)?;
    }
    // The config's comms_logger turns the per-collective trace on, but only when it says
    // `enabled: true` (DeepSpeed turns it on whenever the block exists). ZERODP_DEBUG, read by
    // from_env above, can only raise the level, never lower it.
    if settings.comms_logger.enabled && comm_options.trace < TraceLevel::Info {
        comm_options.trace = TraceLevel::Info;
    }
    // In one process, hpZ's host groups stand for hosts: the counters tell the bytes that would
    // cross between them apart (MPI counts its real hosts).
    let hpz = settings.zero_optimization.zero_hpz_partition_size as usize;
    if hpz > 1 && comm_options.ranks_per_host.is_none() {
        comm_options.ranks_per_host = Some(hpz);
    }
    Ok(comm_options)
}

/// The run's first line: the model, the stage, the world and the batch, the corpus.
fn print_banner(
    trainer: &Trainer<'_, TrainModel>,
    (backend, args, settings, gpt): (Resolved, &TrainArgs, &config::Settings, &GptConfig),
    data: &zerodp::data::TrainData,
) {
    let command = if args.eval_only { "eval" } else { "train" };
    let nccl = args.nccl;
    let world = backend.world();
    let batch = &settings.batch;
    let backend_note = match (backend, nccl) {
        (Resolved::Mpi { .. }, false) => " (MPI: one rank per process)",
        (Resolved::Mpi { .. }, true) => " (MPI: one rank per process; collectives over NCCL)",
        (Resolved::InProcess { .. }, true) => " (collectives over NCCL, one rank per GPU)",
        (Resolved::InProcess { .. }, false) => "",
    };
    errln!(
        "zerodp {command}: {} {} layers, width {}, {} heads, context {} ({} parameters); ZeRO stage {}, \
         world size {world}{backend_note}, train_batch_size {} = {} per rank x {} accumulation \
         steps x {world}; corpus {} ({})",
        trainer.model().arch(),
        gpt.layers,
        gpt.width,
        gpt.heads,
        gpt.context,
        trainer.model().spec().num_params(),
        trainer.engine_config().stage.index(),
        batch.train_batch_size,
        batch.micro_batch_per_gpu,
        batch.gradient_accumulation_steps,
        data.name(),
        data.samples(),
    );
    let cfg = trainer.engine_config();
    if cfg.hpz_active() {
        errln!(
            "ZeRO++ hpZ: a unit's first gather of a step crosses hosts; its later ones gather a \
             secondary partition within hosts of {} ranks (zero_hpz_partition_size)",
            cfg.hpz_partition_size
        );
    }
    if cfg.qwz_active() || cfg.qgz_active() {
        let what = match (cfg.qwz_active(), cfg.qgz_active()) {
            (true, true) => {
                "the all-gathers carry int8 weights (qwZ) and the gradients cross \
                             hosts as int8 all-to-alls (qgZ)"
            }
            (true, false) => "the all-gathers carry int8 weights (qwZ)",
            _ => "the gradients cross hosts as int8 all-to-alls (qgZ)",
        };
        errln!("ZeRO++: {what}; blocks of 2048 with one f32 scale, reduced in f32");
    }
}

/// Rank 0's closing lines: steps, final loss, tokens/s and memory; the process's peak resident set.
fn report_end(outcome: &TrainOutcome, started: Instant, tokens_per_step: usize, backend: Resolved) {
    let elapsed = started.elapsed().as_secs_f64();
    let steps_run = outcome.steps - outcome.start_step;
    if let Some(Some(last)) = outcome.last.first() {
        errln!(
            "done: {} steps in {elapsed:.1} s, final loss {:.4}, {:.0} tokens/s overall, rank 0 holds {} \
             (peak {})",
            last.step,
            last.loss,
            (steps_run as usize * tokens_per_step) as f64 / elapsed,
            human_bytes(last.memory.total),
            human_bytes(last.peak_bytes)
        );
        if last.device_tier_bytes > 0 {
            errln!(
                "GPU: the device tier holds {} (parameters, gradients, fp32 master, Adam's \
                 moments; the host holds its mirror)",
                human_bytes(last.device_tier_bytes)
            );
        }
    }
    if let Some(peak) = peak_resident_bytes() {
        let in_process = match backend {
            Resolved::Mpi { .. } => 1,
            Resolved::InProcess { world } => world,
        };
        // Only the binary's allocator counts them: a library user's process shows nothing.
        let reuse = zerodp::memory::ReuseAlloc::stats();
        let reused = match reuse.hits + reuse.misses {
            0 => String::new(),
            n => format!(
                "; blocks of 32 MiB or more served again: {} of {n}",
                reuse.hits
            ),
        };
        errln!(
            "process peak resident set: {} ({} per rank){reused}",
            human_bytes(peak),
            human_bytes(peak / in_process as u64)
        );
    }
}

/// Rank 0's line when a signal ended the run: where it stopped and what was saved.
fn report_interrupted(signals: &Signals, outcome: &TrainOutcome, args: &TrainArgs) {
    let saved = match (&args.save_dir, &args.save) {
        (Some(_), _) => "; the checkpoint of the last step is saved (resume with --resume)",
        (None, Some(_)) => "; nothing was saved (--save writes only at the end of a run)",
        (None, None) => "",
    };
    errln!(
        "interrupted by {} after {} of {} steps: every metrics line written is whole{saved}",
        signals.name(),
        outcome.steps,
        args.steps,
    );
}

/// Rank 0's progress bar and log lines: the step's loss, rate and memory on the bar, fp16 scale
/// changes and skipped steps always, and a step line every `steps_per_print` steps; with
/// `wall_clock_breakdown`, a line of where the step's time went, as DeepSpeed's timers print it,
/// at the same steps (every step when `steps_per_print` is unset).
struct ProgressLog {
    bar: ProgressBar,
    steps_per_print: Option<u64>,
    breakdown: bool,
}

impl ProgressLog {
    fn new(steps: u64, hidden: bool, steps_per_print: Option<u64>) -> Self {
        ProgressLog {
            bar: progress_bar(steps, hidden),
            steps_per_print,
            breakdown: false,
        }
    }

    /// `wall_clock_breakdown`: print the phases of rank 0's step.
    fn with_breakdown(mut self, on: bool) -> Self {
        self.breakdown = on;
        self
    }

    fn println(&self, line: String) {
        if self.bar.is_hidden() {
            errln!("{line}");
        } else {
            self.bar.println(line);
        }
    }
}

impl StepObserver for ProgressLog {
    fn on_step(&self, e: &StepEvent<'_>) -> Result<(), TrainerError> {
        if e.rank != 0 {
            return Ok(());
        }
        let report = e.report;
        if let Some(line) = step_log_line(report) {
            self.println(line);
        }
        let msg = format!(
            "loss {:.4} lr {:.2e} {:.0} tok/s mem {}",
            report.loss,
            report.lr,
            e.tokens_per_s,
            human_bytes(report.memory.total)
        );
        self.bar.set_message(msg.clone());
        self.bar.inc(1);
        let due = |every: Option<u64>| every.is_some_and(|p| p > 0 && report.step % p == 0);
        if due(self.steps_per_print) {
            self.println(format!("step {} {msg}", report.step));
        }
        let unset = matches!(self.steps_per_print, None | Some(0));
        if self.breakdown && (unset || due(self.steps_per_print)) {
            self.println(breakdown_line(report));
        }
        if let Some(eval) = e.eval {
            self.println(eval_line(report.step, eval));
        }
        Ok(())
    }
}

/// `--plot`: rank 0's metrics lines drawn into an SVG as they come. A plot that cannot be
/// written is said once and the run goes on: a picture is no reason to lose a run.
struct LivePlotter {
    live: zerodp::plot::LivePlot,
    failed: AtomicBool,
}

impl LivePlotter {
    fn new(path: &Path) -> Self {
        let name = path
            .file_stem()
            .map_or("train".into(), |s| s.to_string_lossy());
        LivePlotter {
            live: zerodp::plot::LivePlot::new(path, &name),
            failed: AtomicBool::new(false),
        }
    }

    fn warn(&self, e: zerodp::plot::PlotError) {
        if !self.failed.swap(true, Ordering::SeqCst) {
            errln!("warning: --plot: {e}; training goes on without the plot");
        }
    }

    fn finish(&self) {
        if let Err(e) = self.live.finish() {
            self.warn(e);
        }
    }
}

impl StepObserver for LivePlotter {
    fn on_step(&self, e: &StepEvent<'_>) -> Result<(), TrainerError> {
        if e.rank == 0 && !self.failed.load(Ordering::SeqCst) {
            if let Err(err) = self.live.push(&zerodp::trainer::metrics_line(e)) {
                self.warn(err);
            }
        }
        Ok(())
    }
}

/// The held-out loss after step `step`, on the log: 7 significant digits, as `zerodp eval`.
fn eval_line(step: u64, e: &zerodp::zero::EvalLoss) -> String {
    format!(
        "step {step} eval_loss {:.7} eval_ppl {:.7} ({} held-out tokens, {:.1} s)",
        e.loss,
        e.perplexity(),
        e.tokens,
        e.seconds
    )
}

/// `wall_clock_breakdown`'s line: rank 0's step in milliseconds by phase (forward, its recompute
/// in backward, backward, time in collectives that did not overlap compute, the optimizer step)
/// and in all, as DeepSpeed's `time (ms) | ...` timer line.
fn breakdown_line(report: &zerodp::zero::StepReport) -> String {
    let p = &report.phases;
    let ms = |s: f64| s * 1e3;
    format!(
        "step {} time (ms) | fwd: {:.2} | recompute: {:.2} | bwd: {:.2} | comm: {:.2} | \
         optimizer: {:.2} | step total: {:.2}",
        report.step,
        ms(p.forward),
        ms(p.recompute),
        ms(p.backward),
        ms(p.comm),
        ms(p.optimizer),
        ms(report.elapsed.as_secs_f64()),
    )
}

/// Every output must be a new or replaceable file in a writable directory, and none may be an
/// input or lie in a checkpoint ([`zerodp::outputs`]): checked before the first step, so
/// no input or checkpoint is ever overwritten and no run fails to save at its end.
fn check_paths(args: &TrainArgs, metrics: Option<&Path>) -> anyhow::Result<()> {
    fn named<'a>(name: &'a str, p: Option<&'a Path>) -> Option<NamedPath<'a>> {
        p.map(|path| NamedPath { name, path })
    }
    let read: Vec<(&str, PathBuf)> = args
        .hf
        .inputs()
        .into_iter()
        .chain(args.data.inputs(args.hf.model_dir.as_deref()))
        .chain(
            args.eval
                .eval_data
                .iter()
                .map(|p| ("--eval-data", p.clone())),
        )
        .collect();
    let inputs: Vec<NamedPath<'_>> = [
        named("--config", args.config.as_deref()),
        named("--init", args.init.as_deref()),
        named("--resume", resume_dir(args)),
    ]
    .into_iter()
    .flatten()
    .chain(read.iter().map(|(name, path)| NamedPath { name, path }))
    .collect();
    let outputs: Vec<NamedPath<'_>> = [
        named("--save", args.save.as_deref()),
        named("--metrics", metrics),
        named("--plot", args.plot.as_deref()),
    ]
    .into_iter()
    .flatten()
    .collect();
    check_outputs(&inputs, &outputs)?;
    if let Some(dir) = &args.save_dir {
        let dir = NamedPath {
            name: "--save-dir",
            path: dir,
        };
        check_save_dir(dir, &inputs, &outputs)?;
    }
    if args.save_every.is_some() && args.save_dir.is_none() {
        bail!("--save-every needs --save-dir DIR (where to put the checkpoints)");
    }
    if args.save_every == Some(0) || args.keep_last == Some(0) {
        bail!("--save-every and --keep-last must be at least 1");
    }
    Ok(())
}

/// Creates `--save-dir` (checked by [`check_paths`]) once nothing can refuse the run any more.
fn create_save_dir(args: &TrainArgs) -> anyhow::Result<()> {
    if let Some(path) = &args.save_dir {
        let dir = NamedPath {
            name: "--save-dir",
            path,
        };
        zerodp::outputs::create_save_dir(dir)?;
    }
    Ok(())
}

/// Takes `--save-dir`'s lock ([`SaveDirLock`]): in this process, or for the MPI job through
/// `comm` (rank 0 holds it). A second run on the directory is refused here, before any step; a
/// lock left by a run that died is taken over, with a note.
fn take_save_dir_lock(
    dir: Option<&Path>,
    comm: Option<&dyn Communicator>,
) -> anyhow::Result<Option<SaveDirLock>> {
    let Some(dir) = dir else {
        return Ok(None);
    };
    let acquired = match comm {
        Some(comm) => acquire_for_job(dir, comm)?,
        None => Some(SaveDirLock::acquire(dir)?),
    };
    let Some(acquired) = acquired else {
        return Ok(None);
    };
    if let Some(old) = &acquired.took_over {
        let who = match old.pid {
            0 => "an unreadable lock".to_string(),
            pid => format!("zerodp run pid {pid} (started at {})", old.started_text()),
        };
        errln!(
            "note: taking over {}: it was left by {who}, which no longer runs (killed or \
             crashed); its last committed checkpoint is what `latest` names",
            acquired.lock.path().display()
        );
    }
    Ok(Some(acquired.lock))
}

/// The checkpoint directory `--resume` reads: its own argument, or `--save-dir`.
fn resume_dir(args: &TrainArgs) -> Option<&Path> {
    match &args.resume {
        Some(Some(d)) => Some(d),
        Some(None) => args.save_dir.as_deref(),
        None => None,
    }
}

/// The checkpoint to resume from: `--resume DIR`, or `--resume` alone with `--save-dir`; said
/// once per job (by the `lead` process: rank 0 under MPI). `--resume` alone on a `--save-dir`
/// that holds no checkpoint yet starts from the beginning, so that one command line serves a
/// job's first start and every restart (a scheduler's requeue); `--resume DIR` must name a
/// checkpoint (a mistyped path must not restart a run from scratch).
fn resume_from(args: &TrainArgs, lead: bool) -> anyhow::Result<Option<Resume>> {
    if args.resume.is_none() {
        return Ok(None);
    }
    let Some(dir) = resume_dir(args) else {
        bail!("--resume without a directory needs --save-dir (or give --resume DIR)")
    };
    if args.resume == Some(None) && !holds_checkpoint(dir) {
        if lead {
            errln!(
                "--resume: {} holds no checkpoint yet, so training starts from the beginning; \
                 the same command resumes from the checkpoints this run saves",
                dir.display()
            );
        }
        return Ok(None);
    }
    let r = Resume::from_dir(dir)?;
    let m = &r.manifest;
    if lead {
        errln!(
            "resuming from {} at step {} (saved at world size {}, stage {}, {}; seed {})",
            r.dir.display(),
            m.step,
            m.world_size,
            m.stage,
            m.precision,
            m.seed
        );
    }
    if m.step >= args.steps && !args.eval_only {
        bail!(
            "the checkpoint is at step {} and --steps is {}: nothing to train (--steps counts \
             from the start of training; raise it to continue)",
            m.step,
            args.steps
        );
    }
    Ok(Some(r))
}

/// Whether a save directory has committed a checkpoint (its `latest`) or `dir` is one: a step
/// directory renamed into place whose `latest` was never written is not committed.
fn holds_checkpoint(dir: &Path) -> bool {
    use zerodp::checkpoint::{LATEST_FILE, MANIFEST_FILE};
    dir.join(LATEST_FILE).exists() || dir.join(MANIFEST_FILE).exists()
}

/// What the checkpoints cost: how long saves blocked the step loop (the final save, made after
/// the last step, waits for its own write; the others write in the background) and how fast the
/// files were written.
fn report_saves(outcome: &TrainOutcome, dir: Option<&Path>) {
    let (Some(dir), Some(last)) = (dir, outcome.saves.last()) else {
        return;
    };
    let step_s = outcome.last[0]
        .as_ref()
        .map_or(0.0, |r| r.elapsed.as_secs_f64());
    let overlapped = &outcome.saves[..outcome.saves.len() - 1];
    if !overlapped.is_empty() {
        let n = overlapped.len() as f64;
        let mean = overlapped.iter().map(|s| s.blocked_s).sum::<f64>() / n;
        let max = overlapped.iter().map(|s| s.blocked_s).fold(0.0, f64::max);
        errln!(
            "checkpoints: {} background saves blocked rank 0's step loop {:.1} ms on average \
             (max {:.1} ms; a step took {:.1} ms)",
            overlapped.len(),
            mean * 1e3,
            max * 1e3,
            step_s * 1e3
        );
    }
    errln!(
        "checkpoints: step {} saved in {}; rank 0 wrote {} in {:.1} ms ({:.0} MB/s), blocked {:.1} ms",
        last.step,
        dir.display(),
        human_bytes(last.bytes),
        last.write_s * 1e3,
        last.bytes as f64 / last.write_s.max(1e-9) / 1e6,
        last.blocked_s * 1e3
    );
}

/// A run must end with a finite loss and at least one applied update; otherwise it exits non-zero
/// (and saves nothing).
fn check_final(outcome: &TrainOutcome) -> anyhow::Result<()> {
    let Some(Some(last)) = outcome.last.first() else {
        return Ok(());
    };
    if outcome.applied_steps == 0 && outcome.start_step == 0 {
        bail!(
            "every one of the {} steps was skipped because its gradients held Inf/NaN (last in: \
             {}); nothing was trained. Check the --init weights and the data, lower the learning \
             rate, or use fp32",
            outcome.steps,
            last.non_finite_units.join(", ")
        );
    }
    if !last.loss.is_finite() {
        bail!(
            "the run ended with a non-finite loss ({}) at step {}; nothing was saved. Lower the \
             learning rate, enable gradient_clipping, or check the --init weights",
            last.loss,
            last.step
        );
    }
    Ok(())
}

/// SIGINT and SIGTERM set one flag the trainer polls between steps (the ranks agree on it), so
/// the run ends after the current step with whole metrics lines; the exit status says which signal
/// (130, 143). A second SIGINT ends the process at once.
struct Signals {
    flag: Arc<AtomicBool>,
    term: Arc<AtomicBool>,
    int: Arc<AtomicBool>,
}

impl Signals {
    fn register() -> anyhow::Result<Self> {
        use signal_hook::consts::{SIGINT, SIGTERM};
        use signal_hook::flag;
        let s = Signals {
            flag: Arc::new(AtomicBool::new(false)),
            term: Arc::new(AtomicBool::new(false)),
            int: Arc::new(AtomicBool::new(false)),
        };
        // Registered first, so a second SIGINT finds the flag already set and exits.
        flag::register_conditional_shutdown(SIGINT, 130, s.int.clone())
            .context("installing the SIGINT handler")?;
        for (sig, which) in [(SIGINT, &s.int), (SIGTERM, &s.term)] {
            flag::register(sig, which.clone()).context("installing a signal handler")?;
            flag::register(sig, s.flag.clone()).context("installing a signal handler")?;
        }
        Ok(s)
    }

    fn exit_code(&self) -> Option<i32> {
        if self.int.load(Ordering::SeqCst) {
            Some(130)
        } else if self.term.load(Ordering::SeqCst) {
            Some(143)
        } else {
            None
        }
    }

    fn name(&self) -> &'static str {
        match self.exit_code() {
            Some(130) => "SIGINT",
            _ => "SIGTERM",
        }
    }
}

fn progress_bar(steps: u64, hidden: bool) -> ProgressBar {
    if hidden {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(steps);
    pb.set_style(
        ProgressStyle::with_template(
            "{bar:30} step {pos}/{len} {msg} [{elapsed_precise}<{eta_precise}]",
        )
        .expect("valid progress template"),
    );
    pb
}

/// The process's peak resident set (`VmHWM` in /proc/self/status), where the system reports it.
fn peak_resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb = status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?;
    let kb = kb.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()?;
    Some(kb * 1024)
}

fn human_bytes(b: u64) -> String {
    let b = b as f64;
    if b >= 1024.0 * 1024.0 * 1024.0 {
        format!("{:.2} GiB", b / (1024.0 * 1024.0 * 1024.0))
    } else if b >= 1024.0 * 1024.0 {
        format!("{:.1} MiB", b / (1024.0 * 1024.0))
    } else {
        format!("{:.1} KiB", b / 1024.0)
    }
}
