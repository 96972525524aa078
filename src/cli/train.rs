//! `zerodp train`: train the GPT reference model on a text file with a DeepSpeed config, on
//! `--world-size` in-process ranks.
//!
//! Each rank is a thread with its own rayon pool (`max(1, cores / world)` threads, the pool
//! candle's matmuls run in), its own engine and its own share of every batch. Rank 0 draws the
//! progress bar; every rank writes its metrics lines.
//!
//! `--metrics FILE` gets one JSON object per optimizer step and rank:
//!
//! | key | meaning |
//! | --- | --- |
//! | `rank`, `world_size`, `stage`, `step` | who and when (`step` counts from 1) |
//! | `loss` | the global-batch mean loss, the same on every rank |
//! | `lr` | the learning rate this step used (scheduler, else the optimizer's `lr`) |
//! | `grad_norm` | the global gradient norm before clipping (unscaled; `null` on a skipped step, whose norm is Inf/NaN) |
//! | `loss_scale` | the fp16 loss scale this step's loss was multiplied by (1 in bf16 and fp32) |
//! | `skipped` | whether the step was skipped because its gradients held Inf/NaN (no update; the scheduler does not advance) |
//! | `tokens_per_s` | the global batch's tokens over this rank's step time |
//! | `step_time_s` | this rank's step time |
//! | `num_params` | Ψ, the model's parameter count (tied weights once) |
//! | `model_state_bytes` | what the rank holds after the step: `params`, `grads`, `master` (the fp32 master shard under bf16/fp16, 0 in fp32), `optimizer_states`, `buffers` (buckets, gradient and parameter scratch), `gather` (stage-3 pool), `total` |
//!
//! Mixed precision comes from the config's `bf16` or `fp16` block: 16-bit parameters and
//! gradients, fp32 master weights and Adam moments on the owning shard. A step whose gradients
//! hold Inf/NaN is skipped on every rank and logged with the units involved; fp16 lowers its loss
//! scale (DeepSpeed's dynamic scaling, at the documented 2^16 and hysteresis 2 even when the block
//! sets no dynamic key), bf16 and fp32 stop after `--max-skipped-steps` such steps in a row.
//! | `peak_bytes` | the largest `total` so far, gathered parameters in flight included |
//! | `sent_bytes`, `recv_bytes`, `calls` | this rank's traffic in this step per collective (`all_reduce`, `reduce_scatter`, `all_gather`, `broadcast`), ring-algorithm byte counts |

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use zerodp::comm::{run_ranks, CollectiveKind, CommOptions, DType, TraceLevel};
use zerodp::config::{self, OffloadDevice, Precision, ResolveContext, Settings};
use zerodp::memory::accounting::TrafficByKind;
use zerodp::model::{
    load_safetensors, save_safetensors, Corpus, DataLoader, GptConfig, GptModel, UnitModel,
    DEFAULT_CORPUS_PATH,
};
use zerodp::optim::adam::AdamParams;
use zerodp::optim::scheduler::lr_at;
use zerodp::zero::loss_scaler::DynamicScaleParams;
use zerodp::zero::precision::OverflowPolicy;
use zerodp::zero::{Engine, EngineConfig, Stage, StepReport};

#[derive(clap::Args, Debug)]
pub struct TrainArgs {
    /// DeepSpeed JSON config (batch sizes, zero_optimization, optimizer, scheduler, clipping).
    #[arg(long)]
    pub config: PathBuf,
    /// Number of data-parallel ranks (threads of this process).
    #[arg(long, default_value_t = 1)]
    pub world_size: usize,
    #[command(flatten)]
    pub model: ModelArgs,
    /// UTF-8 text to train on (bytes are tokens) [default: the demo corpus, data/corpus.txt].
    #[arg(long)]
    pub data: Option<PathBuf>,
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
    /// Seconds a rank waits inside one collective before failing [default: ZERODP_TIMEOUT or the
    /// communicator's default].
    #[arg(long)]
    pub timeout: Option<f64>,
    /// Recompute every unit's forward in backward (also switched on by the config's
    /// activation_checkpointing block).
    #[arg(long)]
    pub checkpoint_activations: bool,
    #[command(flatten)]
    pub preflight: super::preflight::PreflightArgs,
    /// No progress bar (log lines at steps_per_print only).
    #[arg(long)]
    pub no_progress: bool,
    /// Stop with an error after this many optimizer steps in a row had Inf/NaN gradients (each is
    /// skipped). Applies to bf16, fp32 and fp16 with a static loss scale; dynamic fp16 scaling
    /// stops at `min_loss_scale` instead.
    #[arg(long, default_value_t = 10)]
    pub max_skipped_steps: u64,
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
    if args.world_size == 0 {
        bail!("--world-size must be at least 1");
    }
    let gpt = args.model.build("demo")?;
    let ctx = ResolveContext {
        world_size: args.world_size,
        world_size_source: "--world-size".into(),
        hidden_size: Some(gpt.width),
        total_steps: Some(args.steps as usize),
        ..Default::default()
    };
    let loaded = config::load_file(&args.config, &ctx)?;
    for w in &loaded.warnings {
        eprintln!("warning: {w}");
    }
    let settings = loaded.settings;
    let mut engine_cfg = engine_config(&settings, args.world_size, args.seed)
        .with_context(|| format!("config {}", args.config.display()))?;
    engine_cfg.activation_checkpointing |= args.checkpoint_activations;
    if args.max_skipped_steps == 0 {
        bail!("--max-skipped-steps must be at least 1 (1 stops at the first step with Inf/NaN gradients)");
    }
    engine_cfg.max_skipped_steps = args.max_skipped_steps;

    let model = GptModel::new(gpt.clone())?;
    super::preflight::check(&args.preflight, &settings, &engine_cfg, model.spec(), &gpt)?;
    let data_path = args
        .data
        .clone()
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CORPUS_PATH));
    let data = DataLoader::new(
        read_corpus(&data_path, args.data.is_none())?,
        gpt.context,
        args.seed,
    )?;
    let init = match &args.init {
        Some(p) => Some(load_safetensors(p, model.spec())?),
        None => None,
    };

    let mut comm_options = CommOptions::from_env()?;
    if let Some(t) = args.timeout {
        if t.is_nan() || t <= 0.0 {
            bail!("--timeout must be a positive number of seconds, got {t}");
        }
        comm_options.timeout = Duration::from_secs_f64(t);
    }
    // The config's comms_logger turns the per-collective trace on, but only when it says
    // `enabled: true` (DeepSpeed turns it on whenever the block exists). ZERODP_DEBUG, read by
    // from_env above, can only raise the level, never lower it.
    if settings.comms_logger.enabled && comm_options.trace < TraceLevel::Info {
        comm_options.trace = TraceLevel::Info;
    }
    let metrics = match &args.metrics {
        Some(p) => Some(Mutex::new(BufWriter::new(
            File::create(p).with_context(|| format!("creating metrics file {}", p.display()))?,
        ))),
        None => None,
    };
    let base_lr = settings.optimizer.as_ref().map_or(1e-3, |o| o.lr);
    let num_params = model.spec().num_params();
    let world = args.world_size;
    let batch = settings.batch.clone();
    let tokens_per_step = batch.train_batch_size * gpt.context;
    eprintln!(
        "zerodp train: GPT {} layers, width {}, {} heads, context {} ({} parameters); ZeRO stage {}, \
         world size {world}, train_batch_size {} = {} per rank x {} accumulation steps x {world}; \
         corpus {} ({} windows)",
        gpt.layers,
        gpt.width,
        gpt.heads,
        gpt.context,
        num_params,
        engine_cfg.stage.index(),
        batch.train_batch_size,
        batch.micro_batch_per_gpu,
        batch.gradient_accumulation_steps,
        data.corpus().name(),
        data.num_windows(),
    );
    let progress = progress_bar(args.steps, args.no_progress);
    let threads = rank_threads(world);
    let started = Instant::now();

    let finals = run_ranks(world, comm_options, |comm, rank| -> anyhow::Result<_> {
        in_rank_pool(threads, || {
            let mut engine = Engine::new(&model, &*comm, engine_cfg.clone())?;
            if let Some(init) = &init {
                for (u, values) in init.iter().enumerate() {
                    engine.load_unit_params(u, values)?;
                }
            }
            let mut last = None;
            // Optimizer steps actually applied: skipped steps do not advance the scheduler
            // (DeepSpeed's rule).
            let mut applied = 0;
            for step in 0..args.steps {
                let lr = lr_at_step(&settings, base_lr, applied);
                let batches = (0..batch.gradient_accumulation_steps)
                    .map(|m| {
                        data.micro_batch(
                            step,
                            batch.train_batch_size,
                            world,
                            rank,
                            batch.micro_batch_per_gpu,
                            m,
                        )
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let report = engine.train_step(&batches, lr)?;
                if !report.skipped {
                    applied += 1;
                }
                let tokens_per_s = tokens_per_step as f64 / report.elapsed.as_secs_f64();
                if let Some(m) = &metrics {
                    let line = metrics_line(
                        rank,
                        world,
                        engine_cfg.stage,
                        num_params,
                        tokens_per_s,
                        &report,
                    );
                    let mut w = m.lock().unwrap_or_else(|e| e.into_inner());
                    writeln!(w, "{line}")?;
                }
                if rank == 0 {
                    if let Some(line) = step_log_line(&report) {
                        if progress.is_hidden() {
                            eprintln!("{line}");
                        } else {
                            progress.println(line);
                        }
                    }
                    let msg = format!(
                        "loss {:.4} lr {:.2e} {:.0} tok/s mem {}",
                        report.loss,
                        report.lr,
                        tokens_per_s,
                        human_bytes(report.memory.total)
                    );
                    progress.set_message(msg.clone());
                    progress.inc(1);
                    if settings
                        .steps_per_print
                        .is_some_and(|p| p > 0 && report.step % p == 0)
                    {
                        let line = format!("step {} {msg}", report.step);
                        if progress.is_hidden() {
                            eprintln!("{line}");
                        } else {
                            progress.println(line);
                        }
                    }
                }
                last = Some(report);
            }
            let params = if args.save.is_some() {
                Some(engine.full_params()?)
            } else {
                None
            };
            Ok((last, params))
        })
    })
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    progress.finish_and_clear();
    if let Some(m) = metrics {
        m.into_inner().unwrap_or_else(|e| e.into_inner()).flush()?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    if let Some((Some(last), _)) = finals.first() {
        eprintln!(
            "done: {} steps in {elapsed:.1} s, final loss {:.4}, {:.0} tokens/s overall, rank 0 holds {} \
             (peak {})",
            last.step,
            last.loss,
            (args.steps as usize * tokens_per_step) as f64 / elapsed,
            human_bytes(last.memory.total),
            human_bytes(last.peak_bytes)
        );
    }
    if let (Some(path), Some((_, Some(params)))) = (&args.save, finals.first()) {
        let slices: Vec<&[f32]> = params.iter().map(Vec::as_slice).collect();
        save_safetensors(path, model.spec(), &slices)?;
        eprintln!("saved weights to {}", path.display());
    }
    Ok(0)
}

/// The engine's settings from a resolved DeepSpeed config. Features the engine does not have yet
/// are refused with a way out rather than silently ignored.
pub fn engine_config(s: &Settings, world: usize, seed: u64) -> anyhow::Result<EngineConfig> {
    let z = &s.zero_optimization;
    let stage = Stage::from_index(z.stage).ok_or_else(|| {
        anyhow::anyhow!("zero_optimization.stage is {}; use 0, 1, 2 or 3", z.stage)
    })?;
    if s.fp16.fp16_master_weights_and_grads {
        bail!(
            "fp16.fp16_master_weights_and_grads is not supported: zerodp keeps fp32 master weights; \
             remove the key or set it to false"
        );
    }
    if z.offload_optimizer.device != OffloadDevice::None
        || z.offload_param.device != OffloadDevice::None
    {
        bail!(
            "offloading (zero_optimization.offload_optimizer / offload_param) is not supported by the \
             in-process engine; remove the offload blocks or set their device to \"none\""
        );
    }
    let mut cfg = EngineConfig::new(stage, world);
    cfg.micro_batch = s.batch.micro_batch_per_gpu;
    cfg.grad_accum = s.batch.gradient_accumulation_steps;
    cfg.reduce_bucket_size = usize_of(z.reduce_bucket_size);
    cfg.overlap_comm = z.overlap_comm;
    cfg.gradient_clipping = s.gradient_clipping as f32;
    cfg.prefetch_bucket_size = usize_of(z.prefetch_bucket_size);
    cfg.param_persistence_threshold = usize_of(z.param_persistence_threshold);
    cfg.max_live_parameters = usize_of(z.max_live_parameters);
    cfg.max_reuse_distance = usize_of(z.max_reuse_distance);
    let ac = &s.activation_checkpointing;
    cfg.activation_checkpointing = ac.number_checkpoints.is_some()
        || ac.partition_activations
        || ac.cpu_checkpointing
        || ac.contiguous_memory_optimization;
    if let Some(o) = &s.optimizer {
        cfg.adam = AdamParams {
            lr: o.lr,
            beta1: o.betas[0],
            beta2: o.betas[1],
            eps: o.eps,
            weight_decay: o.weight_decay,
            adam_w_mode: o.adam_w_mode,
            bias_correction: o.bias_correction,
        };
    }
    cfg.seed = seed;
    cfg.param_dtype = dtype_of(s.precision);
    cfg.comm_dtype = dtype_of(s.communication_data_type);
    cfg.grad_accum_dtype = dtype_of(s.grad_accum_dtype);
    if s.precision == Precision::Fp16 {
        let f = &s.fp16;
        cfg.overflow = OverflowPolicy::LossScale {
            loss_scale: f.loss_scale,
            dynamic: DynamicScaleParams {
                initial_scale_power: f.initial_scale_power,
                scale_window: f.loss_scale_window,
                hysteresis: u32::try_from(f.hysteresis).unwrap_or(u32::MAX),
                consecutive_hysteresis: f.consecutive_hysteresis,
                min_scale: f.min_loss_scale,
            },
        };
    }
    Ok(cfg)
}

fn dtype_of(p: Precision) -> DType {
    match p {
        Precision::Fp32 => DType::F32,
        Precision::Bf16 => DType::BF16,
        Precision::Fp16 => DType::F16,
    }
}

/// What rank 0 logs about a step besides the progress bar: fp16 scale changes and skipped steps
/// with the units whose gradients held Inf/NaN.
pub fn step_log_line(r: &StepReport) -> Option<String> {
    match (&r.scale_message, r.skipped) {
        (Some(m), true) => Some(format!(
            "step {}: {m} (Inf/NaN gradients in: {})",
            r.step,
            r.non_finite_units.join(", ")
        )),
        (Some(m), false) => Some(format!("step {}: {m}", r.step)),
        (None, true) => Some(format!(
            "step {}: skipped, gradients held Inf/NaN in: {}",
            r.step,
            r.non_finite_units.join(", ")
        )),
        (None, false) => None,
    }
}

fn usize_of(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}

/// The learning rate of optimizer step `step` (0-based): the scheduler's, else the optimizer's.
pub fn lr_at_step(s: &Settings, base_lr: f64, step: u64) -> f32 {
    match &s.scheduler {
        Some(sched) => lr_at(sched, base_lr, step) as f32,
        None => base_lr as f32,
    }
}

fn read_corpus(path: &Path, is_default: bool) -> anyhow::Result<Corpus> {
    if !path.exists() {
        if is_default {
            bail!(
                "the demo corpus {} is missing: run scripts/fetch_corpus.sh to download it (about 5 MB), \
                 or pass --data FILE with any UTF-8 text",
                path.display()
            );
        }
        bail!("--data {}: no such file", path.display());
    }
    Ok(Corpus::from_file(path)?)
}

/// Rayon threads per rank: the cores shared out among the ranks.
pub fn rank_threads(world: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / world.max(1)).max(1)
}

/// Run `f` inside a fresh rayon pool of `threads` threads: candle's matmuls then use this rank's
/// share of the cores instead of competing for the global pool.
pub fn in_rank_pool<T: Send>(
    threads: usize,
    f: impl FnOnce() -> anyhow::Result<T> + Send,
) -> anyhow::Result<T> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("building the rank's thread pool")?;
    pool.install(f)
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

/// One metrics line: what rank `rank` did in one optimizer step.
pub fn metrics_line(
    rank: usize,
    world: usize,
    stage: Stage,
    num_params: usize,
    tokens_per_s: f64,
    r: &StepReport,
) -> serde_json::Value {
    let traffic = TrafficByKind::from_counters(&r.traffic);
    let m = r.memory;
    serde_json::json!({
        "rank": rank,
        "world_size": world,
        "stage": stage.index(),
        "step": r.step,
        "loss": r.loss,
        "lr": r.lr,
        "grad_norm": r.grad_norm,
        "loss_scale": r.loss_scale,
        "skipped": r.skipped,
        "tokens_per_s": tokens_per_s,
        "step_time_s": r.elapsed.as_secs_f64(),
        "num_params": num_params,
        "model_state_bytes": {
            "params": m.params,
            "grads": m.grads,
            "master": m.master,
            "optimizer_states": m.optimizer_states,
            "buffers": m.buffers,
            "gather": m.gather,
            "total": m.total,
        },
        "peak_bytes": r.peak_bytes,
        "sent_bytes": traffic.sent_bytes,
        "recv_bytes": traffic.recv_bytes,
        "calls": CollectiveKind::ALL
            .iter()
            .filter(|k| **k != CollectiveKind::Barrier)
            .map(|k| (k.name().to_string(), r.traffic.calls(*k)))
            .collect::<std::collections::BTreeMap<_, _>>(),
    })
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
