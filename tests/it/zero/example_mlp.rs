//! The "bring your own model" path: the MLP classifier of `examples/mlp_classifier` (its model file
//! included as is) trains alike at every stage and world size and learns; and a model defined here
//! trains through a `Trainer` built from a DeepSpeed config file, using nothing from the CLI.

use crate::mlp;

use candle_core::{Device, Tensor};
use mlp::{accuracy, mlp_units, predict, MlpConfig, Rows, Spirals};
use zerodp::model::{Candle, CandleUnits, VarUnits};
use zerodp::rng::{mix_seed, SplitMix64};
use zerodp::trainer::{BatchIndex, LrSchedule, ReportLog, Trainer};
use zerodp::zero::unit::{BatchCounts, ModelSpec, ParamSpec, UnitSpec};
use zerodp::zero::{EngineConfig, Stage};

/// Divisible by 1, 2, 3 and 4 ranks.
const GLOBAL: usize = 24;

const CFG: MlpConfig = MlpConfig {
    features: Spirals::FEATURES,
    hidden: 16,
    layers: 2,
    classes: 3,
};

fn mlp() -> Candle<VarUnits<Rows>> {
    Candle::new(mlp_units(CFG).unwrap())
}

fn spirals() -> Spirals {
    Spirals {
        seed: 5,
        classes: 3,
        noise: 0.2,
    }
}

/// Every rank's per-step losses, checked equal across ranks; rank 0's are returned.
fn rank_losses(log: ReportLog) -> Vec<f32> {
    let all: Vec<Vec<f32>> = log
        .into_reports()
        .iter()
        .map(|r| r.iter().map(|s| s.loss).collect())
        .collect();
    for l in &all {
        assert_eq!(l, &all[0], "ranks disagree on the loss");
    }
    all.into_iter().next().unwrap()
}

/// Rank 0's per-step losses of the MLP at `stage` on `world` ranks, `ga` micro-batches per step.
fn mlp_losses(stage: Stage, world: usize, ga: usize, steps: u64, recompute: bool) -> Vec<f32> {
    let model = mlp();
    let data = spirals();
    let mut cfg = EngineConfig::new(stage, world);
    cfg.grad_accum = ga;
    cfg.micro_batch = GLOBAL / (world * ga);
    cfg.gradient_clipping = 1.0;
    // Only the input and head units (48 and 51 elements) stay gathered at stage 3.
    cfg.param_persistence_threshold = 100;
    cfg.reduce_bucket_size = 300;
    cfg.activation_checkpointing = recompute;
    cfg.seed = 3;
    let source = |at: BatchIndex| Ok::<_, String>(data.micro_batch(at));
    let log = ReportLog::new();
    Trainer::new(&model, cfg)
        .with_schedule(LrSchedule::Constant(1e-2))
        .run(&source, steps, &[&log])
        .unwrap_or_else(|e| panic!("{stage:?} world {world}: {e}"));
    rank_losses(log)
}

#[test]
fn mlp_stages_and_world_sizes_match_one_rank() {
    let reference = mlp_losses(Stage::Zero0, 1, 1, 4, false);
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        for world in 1..=4 {
            // Accumulate over 2 micro-batches where the global batch allows.
            let ga = if world <= 2 { 2 } else { 1 };
            let recompute = stage == Stage::Zero3 && world == 2;
            let l = mlp_losses(stage, world, ga, 4, recompute);
            for (a, b) in l.iter().zip(&reference) {
                assert!(
                    (a - b).abs() <= 1e-5 * b.abs(),
                    "{stage:?} world {world} ga {ga}: {l:?} vs {reference:?}"
                );
            }
        }
    }
}

#[test]
fn mlp_loss_falls_and_it_classifies() {
    let model = mlp();
    let data = spirals();
    let mut cfg = EngineConfig::new(Stage::Zero3, 2);
    cfg.micro_batch = 12;
    cfg.param_persistence_threshold = 100;
    let source = |at: BatchIndex| Ok::<_, String>(data.micro_batch(at));
    let log = ReportLog::new();
    let out = Trainer::new(&model, cfg)
        .with_schedule(LrSchedule::Constant(1e-2))
        .keep_params(true)
        .run(&source, 150, &[&log])
        .unwrap();
    let l = rank_losses(log);
    let first: f32 = l[..5].iter().sum::<f32>() / 5.0;
    let last: f32 = l[l.len() - 5..].iter().sum::<f32>() / 5.0;
    assert!(first > 0.9, "3 classes start near ln 3: {l:?}");
    assert!(last < 0.5 * first, "loss did not fall: {first} -> {last}");
    let held_out = Spirals { seed: 99, ..data }.rows(0, 600);
    let predicted = predict(&CFG, model.units(), out.params.as_ref().unwrap(), &held_out).unwrap();
    let acc = accuracy(&predicted, &held_out);
    assert!(acc > 0.8, "held-out accuracy {acc}");
}

/// A model written here, as a user would: a tied autoencoder. Unit 0 (`encoder`) computes
/// `h = tanh(x W^T + b)`; unit 1 (`decoder`) owns only `c` and reads the encoder's `W` through
/// `uses = [0]` to reconstruct `x_hat = h W + c`; the loss is the mean squared error.
struct TiedAutoencoder {
    spec: ModelSpec,
    features: usize,
}

/// `n` rows of `features` values.
struct Points {
    x: Vec<f32>,
    n: usize,
}

impl TiedAutoencoder {
    const FEATURES: usize = 6;
    const CODE: usize = 3;

    fn new() -> Self {
        let (f, h) = (Self::FEATURES, Self::CODE);
        let p = |name: &str, shape: &[usize]| ParamSpec {
            name: name.into(),
            shape: shape.to_vec(),
        };
        let encoder = UnitSpec {
            name: "encoder".into(),
            params: vec![p("enc.weight", &[h, f]), p("enc.bias", &[h])],
            uses: vec![],
        };
        let decoder = UnitSpec {
            name: "decoder".into(),
            params: vec![p("dec.bias", &[f])],
            uses: vec![0],
        };
        TiedAutoencoder {
            spec: ModelSpec {
                units: vec![encoder, decoder],
            },
            features: f,
        }
    }

    /// Points on a 2-dimensional plane inside the 6-dimensional space; sample `i` depends on `i`.
    fn points(start: u64, n: usize) -> Points {
        let basis = [
            [0.9, -0.3],
            [0.2, 0.8],
            [-0.5, 0.4],
            [0.3, 0.3],
            [0.0, -0.7],
            [0.6, 0.1],
        ];
        let mut x = Vec::with_capacity(n * Self::FEATURES);
        for i in start..start + n as u64 {
            let mut rng = SplitMix64::new(mix_seed(&[17, i]));
            let z = [rng.normal(), rng.normal()];
            x.extend(basis.iter().map(|b| (b[0] * z[0] + b[1] * z[1]) as f32));
        }
        Points { x, n }
    }
}

impl CandleUnits for TiedAutoencoder {
    type Batch = Points;

    fn spec(&self) -> &ModelSpec {
        &self.spec
    }
    fn batch_counts(&self, b: &Points) -> BatchCounts {
        BatchCounts {
            samples: b.n,
            tokens: b.n,
        }
    }
    fn init_params(&self, unit: usize, seed: u64, out: &mut [f32]) {
        let mut rng = SplitMix64::new(mix_seed(&[seed, unit as u64]));
        let weights = if unit == 0 {
            Self::CODE * Self::FEATURES
        } else {
            0
        };
        for (i, v) in out.iter_mut().enumerate() {
            *v = if i < weights {
                (rng.normal() * 0.4) as f32
            } else {
                0.0
            };
        }
    }
    fn forward_unit(
        &self,
        unit: usize,
        p: &[Tensor],
        input: Option<&Tensor>,
        b: &Points,
    ) -> candle_core::Result<Tensor> {
        let x = Tensor::from_slice(&b.x, (b.n, self.features), &Device::Cpu)?;
        match unit {
            // p: enc.weight, enc.bias
            0 => x.matmul(&p[0].t()?)?.broadcast_add(&p[1])?.tanh(),
            // p: dec.bias (own), then the encoder's enc.weight and enc.bias (uses = [0])
            _ => {
                let h = input.expect("the decoder gets the code");
                let x_hat = h.matmul(&p[1])?.broadcast_add(&p[0])?;
                (x_hat - x)?.sqr()?.mean_all()
            }
        }
    }
}

fn write_config(dir: &std::path::Path, name: &str, stage: u32) -> std::path::PathBuf {
    let path = dir.join(name);
    let json = format!(
        r#"// A user's DeepSpeed config.
{{
  "train_batch_size": 16,
  "train_micro_batch_size_per_gpu": 4,
  "gradient_clipping": 1.0,
  "optimizer": {{ "type": "AdamW", "params": {{ "lr": 2e-2, "weight_decay": 0.0 }} }},
  "zero_optimization": {{ "stage": {stage}, "stage3_param_persistence_threshold": 0 }}
}}"#
    );
    std::fs::write(&path, json).unwrap();
    path
}

fn autoencoder_losses(config: &std::path::Path, world: usize, steps: u64) -> Vec<f32> {
    let model = Candle::new(TiedAutoencoder::new());
    let trainer = Trainer::from_config_file(&model, config, world, 7).unwrap();
    let e = trainer.engine_config();
    assert_eq!(e.micro_batch * e.grad_accum * world, 16);
    let source = |at: BatchIndex| {
        let first = at.step * at.train_batch_size as u64
            + ((at.micro * at.world_size + at.rank) * at.micro_batch_size) as u64;
        Ok::<_, String>(TiedAutoencoder::points(first, at.micro_batch_size))
    };
    let log = ReportLog::new();
    trainer.run(&source, steps, &[&log]).unwrap();
    rank_losses(log)
}

#[test]
fn a_model_defined_here_trains_from_a_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let stage3 = write_config(dir.path(), "stage3.json", 3);
    let stage0 = write_config(dir.path(), "stage0.json", 0);

    let l3 = autoencoder_losses(&stage3, 2, 60);
    let first: f32 = l3[..5].iter().sum::<f32>() / 5.0;
    let last: f32 = l3[l3.len() - 5..].iter().sum::<f32>() / 5.0;
    assert!(
        last < 0.3 * first,
        "reconstruction loss did not fall: {first} -> {last}: {l3:?}"
    );

    // The tied weight's two uses are summed the same way at stage 0 on one rank.
    let l0 = autoencoder_losses(&stage0, 1, 5);
    for (a, b) in l3.iter().zip(&l0) {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "{l3:?} vs {l0:?}");
    }
}

#[test]
fn mlp_rejects_a_bad_batch_naming_the_problem() {
    use zerodp::zero::unit::{ForwardMode, UnitModel};
    let model = mlp();
    let spec = model.spec().clone();
    let params: Vec<Vec<f32>> = spec.units.iter().map(|u| vec![0.0; u.numel()]).collect();
    let bad = Rows {
        features: vec![0.0; 4],
        labels: vec![0, 7],
        n: 2,
    };
    let err = model
        .forward(0, &[&params[0]], None, &bad, ForwardMode::NoGrad)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("label 7"), "{err}");
}
