//! The GPT reference model trained through the engine: the loss falls, and stages agree.

use zerodp::data::{Corpus, DataLoader};
use zerodp::model::{GptConfig, GptModel};
use zerodp::trainer::{LrSchedule, ReportLog, Trainer};
use zerodp::zero::{EngineConfig, Stage};

const GLOBAL: usize = 8;

fn loader(context: usize) -> DataLoader {
    let text =
        "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. "
            .repeat(40);
    DataLoader::new(Corpus::from_text("pangrams", &text), context, 3).unwrap()
}

/// Per-step losses of rank 0 (every rank is checked to report the same).
fn losses(stage: Stage, world: usize, ga: usize, steps: usize, reuse: usize) -> Vec<f32> {
    let model = GptModel::new(GptConfig::tiny()).unwrap();
    let data = loader(GptConfig::tiny().context);
    let micro = GLOBAL / (world * ga);
    let mut cfg = EngineConfig::new(stage, world);
    cfg.grad_accum = ga;
    cfg.micro_batch = micro;
    cfg.gradient_clipping = 1.0;
    cfg.param_persistence_threshold = 1000;
    cfg.reduce_bucket_size = 5000;
    cfg.seed = 11;
    cfg.max_reuse_distance = reuse;
    let log = ReportLog::new();
    Trainer::new(&model, cfg)
        .with_schedule(LrSchedule::Constant(3e-3))
        .run(&data, steps as u64, &[&log])
        .unwrap_or_else(|e| panic!("{e}"));
    let out: Vec<Vec<f32>> = log
        .into_reports()
        .iter()
        .map(|r| r.iter().map(|s| s.loss).collect())
        .collect();
    for l in &out {
        assert_eq!(l, &out[0], "ranks disagree on the loss");
    }
    out.into_iter().next().unwrap()
}

#[test]
fn tiny_gpt_loss_falls_at_stage_3() {
    let l = losses(Stage::Zero3, 2, 2, 12, 0);
    let first = l[0];
    let last = *l.last().unwrap();
    assert!(first > 4.0, "a byte model starts near ln 256: {l:?}");
    assert!(last < first - 1.0, "loss did not fall: {l:?}");
}

#[test]
fn tiny_gpt_stages_match_one_rank() {
    let reference = losses(Stage::Zero0, 1, 1, 3, 0);
    let runs = [
        (Stage::Zero1, 2, 1, 0),
        (Stage::Zero2, 4, 2, 0),
        (Stage::Zero3, 2, 2, 0),
        (Stage::Zero3, 4, 1, 1_000_000_000),
    ];
    for (stage, world, ga, reuse) in runs {
        let l = losses(stage, world, ga, 3, reuse);
        for (a, b) in l.iter().zip(&reference) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "{stage:?} world {world}: {l:?} vs {reference:?}"
            );
        }
    }
}
