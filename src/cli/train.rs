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
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use zerodp::comm::{CommOptions, TraceLevel};
use zerodp::config::{self, ResolveContext};
use zerodp::model::{
    load_safetensors, save_safetensors, Corpus, DataLoader, GptConfig, GptModel,
    DEFAULT_CORPUS_PATH,
};
use zerodp::planner::TrainProcess;
use zerodp::trainer::{
    step_log_line, BatchIndex, MetricsWriter, StepEvent, StepObserver, Trainer, TrainerError,
};
use zerodp::zero::unit::UnitModel;

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
    let model = GptModel::new(gpt.clone())?;
    let mut trainer = Trainer::from_settings(&model, &settings, args.world_size, args.seed)
        .with_context(|| format!("config {}", args.config.display()))?;
    let engine_cfg = trainer.engine_config_mut();
    engine_cfg.activation_checkpointing |= args.checkpoint_activations;
    if args.max_skipped_steps == 0 {
        bail!("--max-skipped-steps must be at least 1 (1 stops at the first step with Inf/NaN gradients)");
    }
    engine_cfg.max_skipped_steps = args.max_skipped_steps;
    let engine_cfg = engine_cfg.clone();

    let data_path = args
        .data
        .clone()
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CORPUS_PATH));
    // The corpus is read after the check; its size is planned from the file's (a missing file is
    // reported when it is read).
    let process = TrainProcess {
        corpus_bytes: std::fs::metadata(&data_path).map_or(0, |m| m.len()),
        threads_per_rank: trainer.threads_per_rank() as u64,
    };
    super::preflight::check(
        &args.preflight,
        &settings,
        &engine_cfg,
        model.spec(),
        &gpt,
        process,
    )?;
    let data = DataLoader::new(
        read_corpus(&data_path, args.data.is_none())?,
        gpt.context,
        args.seed,
    )?;
    if let Some(p) = &args.init {
        trainer = trainer.with_init(load_safetensors(p, model.spec())?);
    }

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
    let trainer = trainer
        .with_comm_options(comm_options)
        .keep_params(args.save.is_some());
    let metrics = match &args.metrics {
        Some(p) => Some(MetricsWriter::new(BufWriter::new(
            File::create(p).with_context(|| format!("creating metrics file {}", p.display()))?,
        ))),
        None => None,
    };
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
    let progress = ProgressLog::new(args.steps, args.no_progress, settings.steps_per_print);
    let started = Instant::now();
    let source = |at: BatchIndex| {
        data.micro_batch(
            at.step,
            at.train_batch_size,
            at.world_size,
            at.rank,
            at.micro_batch_size,
            at.micro,
        )
    };
    let mut observers: Vec<&dyn StepObserver> = vec![&progress];
    if let Some(m) = &metrics {
        observers.push(m);
    }
    let outcome = trainer.run(&source, args.steps, &observers)?;
    progress.bar.finish_and_clear();
    if let Some(m) = metrics {
        m.into_inner()?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    if let Some(Some(last)) = outcome.last.first() {
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
    if let Some(peak) = peak_resident_bytes() {
        eprintln!(
            "process peak resident set: {} ({} per rank)",
            human_bytes(peak),
            human_bytes(peak / world as u64)
        );
    }
    if let (Some(path), Some(params)) = (&args.save, &outcome.params) {
        let slices: Vec<&[f32]> = params.iter().map(Vec::as_slice).collect();
        save_safetensors(path, model.spec(), &slices)?;
        eprintln!("saved weights to {}", path.display());
    }
    Ok(0)
}

/// Rank 0's progress bar and log lines: the step's loss, rate and memory on the bar, fp16 scale
/// changes and skipped steps always, and a step line every `steps_per_print` steps.
struct ProgressLog {
    bar: ProgressBar,
    steps_per_print: Option<u64>,
}

impl ProgressLog {
    fn new(steps: u64, hidden: bool, steps_per_print: Option<u64>) -> Self {
        ProgressLog {
            bar: progress_bar(steps, hidden),
            steps_per_print,
        }
    }

    fn println(&self, line: String) {
        if self.bar.is_hidden() {
            eprintln!("{line}");
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
        if self
            .steps_per_print
            .is_some_and(|p| p > 0 && report.step % p == 0)
        {
            self.println(format!("step {} {msg}", report.step));
        }
        Ok(())
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
