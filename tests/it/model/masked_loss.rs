//! Loss on some targets only (issue 44, chat data): targets set to `IGNORE_INDEX` add nothing, a
//! micro-batch's loss is the mean over the rest, and with `loss_per_token` a step's loss is the
//! mean over every trained target of the global batch, as transformers' Trainer computes it
//! across devices (fixture: scripts/make_masked_fixture.py).

use super::hf_fixture::*;
use std::path::{Path, PathBuf};
use zerodp::data::{TokenBatch, IGNORE_INDEX};
use zerodp::model::hf::{self, LlamaConfig};
use zerodp::model::llama::Llama;
use zerodp::model::Candle;
use zerodp::trainer::{BatchIndex, LrSchedule, ReportLog, Trainer};
use zerodp::zero::unit::UnitModel;
use zerodp::zero::{EngineConfig, Stage};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama-tiny")
}

fn model(fused: bool) -> (Candle<Llama>, Vec<Vec<f32>>) {
    let json = read_json(&dir().join("config.json"));
    let config = LlamaConfig::from_hf_json(&json, Path::new("config.json")).unwrap();
    let llama = Llama::new(config).unwrap();
    let model = Candle::new(if fused { llama } else { llama.composite() });
    let weights = hf::load_weights(&dir(), model.spec()).unwrap();
    (model, weights)
}

/// Rows `rows` of the fixture's batch, -100 as `IGNORE_INDEX`.
fn rows(first: usize, n: usize) -> TokenBatch {
    let exp = read_json(&dir().with_file_name("llama-tiny-masked.json"));
    let flat = |key: &str| -> Vec<u32> {
        exp[key].as_array().unwrap()[first..first + n]
            .iter()
            .flat_map(|r| r.as_array().unwrap().iter())
            .map(|x| x.as_i64().unwrap())
            .map(|x| if x < 0 { IGNORE_INDEX } else { x as u32 })
            .collect()
    };
    TokenBatch {
        tokens: flat("tokens"),
        targets: flat("targets"),
        batch_size: n,
        seq_len: 16,
        segment_starts: Vec::new(),
    }
}

fn want() -> f64 {
    read_json(&dir().with_file_name("llama-tiny-masked.json"))["loss"]
        .as_f64()
        .unwrap()
}

#[test]
fn the_masked_loss_equals_transformers_on_the_fused_and_composite_ops() {
    for fused in [true, false] {
        let (model, weights) = model(fused);
        let slices: Vec<&[f32]> = weights.iter().map(Vec::as_slice).collect();
        let got = model.end_to_end(&slices, &rows(0, 4), 1.0).unwrap().0;
        assert!(
            rel(got, want()) <= 1e-5,
            "fused {fused}: {got} vs {}",
            want()
        );
    }
    // A batch with no trained target has loss 0 and no gradient.
    let (model, weights) = model(true);
    let slices: Vec<&[f32]> = weights.iter().map(Vec::as_slice).collect();
    let mut none = rows(0, 1);
    none.targets.fill(IGNORE_INDEX);
    let (loss, grads) = model.end_to_end(&slices, &none, 1.0).unwrap();
    assert_eq!(loss, 0.0);
    assert!(grads.iter().flatten().all(|&g| g == 0.0));
}

/// Rank 0's losses of 3 steps on the fixture's batch, one row per micro-batch and rank.
fn losses(stage: Stage, world: usize, per_token: bool) -> (Vec<f32>, Vec<Vec<f32>>) {
    let (model, weights) = model(true);
    let mut cfg = EngineConfig::new(stage, world);
    cfg.micro_batch = 1;
    cfg.grad_accum = 4 / world;
    cfg.loss_per_token = per_token;
    cfg.param_persistence_threshold = 0;
    let source = |at: BatchIndex| -> Result<TokenBatch, String> {
        Ok(rows(at.rank * at.grad_accum + at.micro, 1))
    };
    let log = ReportLog::new();
    let outcome = Trainer::new(&model, cfg)
        .with_init(weights)
        .with_schedule(LrSchedule::Constant(1e-3))
        .keep_params(true)
        .run(&source, 3, &[&log])
        .unwrap();
    let losses = log.into_reports()[0].iter().map(|r| r.loss).collect();
    (losses, outcome.params.unwrap())
}

#[test]
fn a_step_averages_over_the_global_batchs_trained_tokens_at_every_stage() {
    // One micro-batch of all four rows on one rank: the mean over its 30 trained targets.
    let (base, base_params) = {
        let (model, weights) = model(true);
        let mut cfg = EngineConfig::new(Stage::Zero0, 1);
        cfg.micro_batch = 4;
        let log = ReportLog::new();
        let source = |_: BatchIndex| -> Result<TokenBatch, String> { Ok(rows(0, 4)) };
        let outcome = Trainer::new(&model, cfg)
            .with_init(weights)
            .with_schedule(LrSchedule::Constant(1e-3))
            .keep_params(true)
            .run(&source, 3, &[&log])
            .unwrap();
        let l: Vec<f32> = log.into_reports()[0].iter().map(|r| r.loss).collect();
        (l, outcome.params.unwrap())
    };
    assert!(
        rel(base[0] as f64, want()) <= 1e-5,
        "{} vs {}",
        base[0],
        want()
    );
    for (stage, world) in [
        (Stage::Zero0, 1),
        (Stage::Zero1, 2),
        (Stage::Zero2, 2),
        (Stage::Zero3, 4),
    ] {
        let (got, params) = losses(stage, world, true);
        for (g, b) in got.iter().zip(&base) {
            assert!(
                rel(*g as f64, *b as f64) <= 1e-5,
                "{stage:?} world {world}: {got:?} vs {base:?}"
            );
        }
        let worst = params
            .iter()
            .flatten()
            .zip(base_params.iter().flatten())
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst <= 1e-5,
            "{stage:?} world {world}: parameters differ by {worst}"
        );
    }
    // Without it each row's mean counts equally: another number when rows train on unequal counts.
    let (equal, _) = losses(Stage::Zero0, 2, false);
    assert!(
        rel(equal[0] as f64, want()) > 1e-3,
        "{} vs {}",
        equal[0],
        want()
    );
}
