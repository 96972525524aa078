//! Bring your own model: an MLP classifier (not a language model) on zerodp's candle helper,
//! trained with ZeRO at the stage a DeepSpeed config file names, on in-process ranks.
//!
//! ```text
//! cargo run --release --example mlp_classifier -- --config examples/mlp_ds_config.json --world-size 2
//! ```
//!
//! Flags: `--config FILE` (DeepSpeed JSON: batch sizes, `zero_optimization.stage`, optimizer,
//! scheduler, clipping), `--world-size N` [1], `--steps N` [300], `--seed N` [42]. The data are
//! three spiral arms in the plane, generated from the seed; the loss of every step is printed, and
//! the accuracy on 3000 held-out points at the end. The model lives in `model.rs`, which
//! `tests/it/zero/example_mlp.rs` shares.

mod model;

use model::{accuracy, mlp_units, predict, MlpConfig, Spirals};
use zerodp::model::{
    keep_freed_buffers, run_candle_elementwise_on_caller_thread, Candle, CandleUnits,
};
use zerodp::trainer::{BatchIndex, StepEvent, StepObserver, Trainer, TrainerError};

/// Prints rank 0's loss after every optimizer step (every rank reports the same global loss).
struct PrintLoss;

impl StepObserver for PrintLoss {
    fn on_step(&self, e: &StepEvent<'_>) -> Result<(), TrainerError> {
        if e.rank == 0 {
            let r = e.report;
            println!(
                "step {:>4}/{}  loss {:.4}  grad_norm {:.3}  lr {:.2e}{}",
                r.step,
                e.total_steps,
                r.loss,
                r.grad_norm,
                r.lr,
                if r.skipped { "  (skipped)" } else { "" }
            );
        }
        Ok(())
    }
}

struct Args {
    config: String,
    world_size: usize,
    steps: u64,
    seed: u64,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        config: String::new(),
        world_size: 1,
        steps: 300,
        seed: 42,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        let number = |v: String| {
            v.parse::<u64>()
                .map_err(|e| format!("{flag} {v}: not a whole number ({e})"))
        };
        match flag.as_str() {
            "--config" => args.config = value()?,
            "--world-size" => args.world_size = number(value()?)? as usize,
            "--steps" => args.steps = number(value()?)?,
            "--seed" => args.seed = number(value()?)?,
            "-h" | "--help" => {
                return Err(
                    "usage: mlp_classifier --config DS_CONFIG.json [--world-size N] \
                     [--steps N] [--seed N]"
                        .into(),
                )
            }
            other => return Err(format!("unknown argument `{other}`; try --help")),
        }
    }
    if args.config.is_empty() {
        return Err(
            "--config DS_CONFIG.json is required (e.g. examples/mlp_ds_config.json)".into(),
        );
    }
    Ok(args)
}

/// Freed blocks of 32 MiB or more come back for the next step instead of being mapped and zeroed
/// afresh (this MLP has none; a model with a large vocabulary has several every step).
#[global_allocator]
static ALLOC: zerodp::memory::ReuseAlloc = zerodp::memory::ReuseAlloc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Before any candle op or thread: keep candle's element-wise ops on the ranks' own threads.
    run_candle_elementwise_on_caller_thread();
    // Freed activation buffers stay in the process for the next step (one malloc arena).
    keep_freed_buffers();
    let args = parse_args()?;

    let cfg = MlpConfig {
        features: Spirals::FEATURES,
        hidden: 64,
        layers: 2,
        classes: 3,
    };
    let model = Candle::new(mlp_units(cfg)?);
    let train = Spirals {
        seed: args.seed,
        classes: cfg.classes,
        noise: 0.2,
    };
    // Held out: another seed, so none of these points is trained on.
    let test = Spirals {
        seed: args.seed ^ 0x7e57,
        ..train
    };

    let trainer = Trainer::from_config_file(&model, &args.config, args.world_size, args.seed)?
        .keep_params(true);
    let e = trainer.engine_config();
    println!(
        "MLP {} -> {} x {} -> {} classes ({} parameters, {} units), ZeRO stage {}, {} ranks, \
         global batch {} = {} per micro-batch x {} accumulation x {} ranks",
        cfg.features,
        cfg.hidden,
        cfg.layers + 1,
        cfg.classes,
        model.units().spec().num_params(),
        model.units().spec().units.len(),
        e.stage.index(),
        e.world_size,
        e.micro_batch * e.grad_accum * e.world_size,
        e.micro_batch,
        e.grad_accum,
        e.world_size,
    );

    let data = |at: BatchIndex| Ok::<_, String>(train.micro_batch(at));
    let outcome = trainer.run(&data, args.steps, &[&PrintLoss])?;

    let params = outcome
        .params
        .expect("keep_params(true) hands the parameters back");
    let held_out = test.rows(0, 3000);
    let predicted = predict(&cfg, model.units(), &params, &held_out)?;
    println!(
        "accuracy on {} held-out points: {:.1}%",
        held_out.n,
        100.0 * accuracy(&predicted, &held_out)
    );
    Ok(())
}
