//! `zerodp eval`: the held-out loss of a model alone, without training: a Hugging Face directory
//! (`--model-dir`), a preset or config with `--init` weights, or a checkpoint (`--checkpoint`,
//! with the model flags it was trained with). It is `train` with no step to take and the
//! data as held-out data (see [`super::eval_args`]), so it scores exactly what `train
//! --eval-data` would: the same windows, the same engine, at any `--world-size` and stage.
//!
//! Standard output holds two lines, `eval_loss <value>` and `eval_ppl <value>` (7 decimals);
//! what the run says about itself goes to standard error.

use super::data_args::DataArgs;
use super::eval_args::EvalArgs;
use super::hf_model::HfModelArgs;
use super::train::{ModelArgs, TrainArgs};
use std::path::PathBuf;
use zerodp::trainer::{Resume, TrainOutcome};

/// The config `zerodp eval` resolves when none is given: fp32, stage 0, 8 windows a micro-batch.
pub const DEFAULT_CONFIG: &str = r#"{"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0}}"#;

#[derive(clap::Args, Debug)]
pub struct EvalCmdArgs {
    /// DeepSpeed JSON config: its micro-batch size is the evaluation's, its stage and precision
    /// the engine's [default: fp32, stage 0, 8 windows per micro-batch and rank].
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Score this checkpoint (a directory saved by `train --save-dir`, or the directory itself,
    /// whose `latest` is read); give the model flags it was trained with.
    #[arg(long, value_name = "DIR")]
    pub checkpoint: Option<PathBuf>,
    /// Start from these weights (a preset or --model-config model).
    #[arg(long, value_name = "FILE.safetensors", conflicts_with = "checkpoint")]
    pub init: Option<PathBuf>,
    /// Number of data-parallel ranks sharing the windows [default: 1].
    #[arg(long)]
    pub world_size: Option<usize>,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub hf: HfModelArgs,
    /// The held-out data and its encoding: the flags and formats of `train --data`.
    #[command(flatten)]
    pub data: DataArgs,
    /// Score only the first K windows [default: all of them].
    #[arg(long, value_name = "K")]
    pub eval_windows: Option<usize>,
}

pub fn run(a: EvalCmdArgs) -> anyhow::Result<i32> {
    let steps = match &a.checkpoint {
        Some(dir) => Resume::from_dir(dir)?.manifest.step,
        None => 0,
    };
    let held_out = match a.data.paths.is_empty() {
        true => vec![PathBuf::from(zerodp::data::DEFAULT_CORPUS_PATH)],
        false => a.data.paths.clone(),
    };
    let args = TrainArgs {
        config: a.config,
        world_size: a.world_size,
        backend: super::launch::BackendChoice::Auto,
        nccl: false,
        model: a.model,
        hf: a.hf,
        data: a.data,
        eval: EvalArgs {
            eval_data: held_out,
            eval_windows: a.eval_windows,
            ..Default::default()
        },
        init: a.init,
        save: None,
        steps,
        seed: 42,
        metrics: None,
        plot: None,
        timeout: None,
        checkpoint_activations: false,
        preflight: Default::default(),
        device: Default::default(),
        no_progress: true,
        max_skipped_steps: 10,
        save_dir: None,
        save_every: None,
        keep_last: None,
        eval_only: true,
        resume: a.checkpoint.map(Some),
    };
    super::train::run(args)
}

/// Rank 0, at the end of a run: the last held-out loss, on standard output for `zerodp eval`
/// (`eval_only`), else on standard error.
pub fn report(outcome: &TrainOutcome, eval_only: bool) -> anyhow::Result<()> {
    let Some((step, e)) = outcome.evals.last() else {
        return Ok(());
    };
    if eval_only {
        outln!("eval_loss {:.7}", e.loss);
        outln!("eval_ppl {:.7}", e.perplexity());
        errln!(
            "scored {} held-out tokens after step {step} in {:.1} s",
            e.tokens,
            e.seconds
        );
    } else {
        errln!(
            "held-out after step {step}: eval_loss {:.7} eval_ppl {:.7} over {} tokens",
            e.loss,
            e.perplexity(),
            e.tokens
        );
    }
    Ok(())
}
