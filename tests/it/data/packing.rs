//! Packed chat examples (issue 44): several examples share a row, each attending only to itself
//! from position 0, so a packed batch gives the loss and gradients of the same examples one per
//! row, on the GPT (learned positions) and on a Llama (rotary positions, grouped-query).

use std::path::Path;
use zerodp::data::chat::Example;
use zerodp::data::{ExampleLoader, TokenBatch};
use zerodp::model::hf::{self, LlamaConfig};
use zerodp::model::llama::Llama;
use zerodp::model::{Candle, GptConfig, GptModel};
use zerodp::zero::unit::UnitModel;

/// Examples of 3 to 17 tokens below `vocab`, each training on its second half.
fn examples(vocab: u32) -> Vec<(usize, Example)> {
    (0..9)
        .map(|i| {
            let len = 3 + (i * 7) % 15;
            let ids = (0..len)
                .map(|k| ((i * 31 + k * 17) as u32) % (vocab - 1) + 1)
                .collect();
            let trained = (0..len).map(|k| k >= len / 2).collect();
            (i + 1, Example { ids, trained })
        })
        .collect()
}

fn batches(vocab: u32, context: usize) -> (TokenBatch, TokenBatch) {
    let make = |pack| {
        ExampleLoader::new("t".into(), examples(vocab), (context, 0, 1), (None, pack)).unwrap()
    };
    let (packed, alone) = (make(true), make(false));
    assert!(
        packed.len() < alone.len(),
        "{} rows packed, {} alone",
        packed.len(),
        alone.len()
    );
    assert_eq!(alone.len(), 9);
    (packed.batch(0..packed.len()), alone.batch(0..alone.len()))
}

fn assert_same(
    model: &impl ModelEndToEnd,
    weights: &[Vec<f32>],
    packed: &TokenBatch,
    alone: &TokenBatch,
) {
    let (lp, gp) = model.run(weights, packed);
    let (la, ga) = model.run(weights, alone);
    assert!(
        (lp - la).abs() <= 1e-5 * la.abs(),
        "loss packed {lp}, alone {la}"
    );
    let worst = gp
        .iter()
        .flatten()
        .zip(ga.iter().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let scale = ga.iter().flatten().fold(0f32, |m, g| m.max(g.abs()));
    assert!(
        worst <= 1e-4 * scale,
        "gradients differ by {worst} (largest {scale})"
    );
}

trait ModelEndToEnd {
    fn run(&self, weights: &[Vec<f32>], batch: &TokenBatch) -> (f64, Vec<Vec<f32>>);
}

impl ModelEndToEnd for GptModel {
    fn run(&self, w: &[Vec<f32>], b: &TokenBatch) -> (f64, Vec<Vec<f32>>) {
        let s: Vec<&[f32]> = w.iter().map(Vec::as_slice).collect();
        self.end_to_end(&s, b, 1.0).unwrap()
    }
}

impl ModelEndToEnd for Candle<Llama> {
    fn run(&self, w: &[Vec<f32>], b: &TokenBatch) -> (f64, Vec<Vec<f32>>) {
        let s: Vec<&[f32]> = w.iter().map(Vec::as_slice).collect();
        self.end_to_end(&s, b, 1.0).unwrap()
    }
}

#[test]
fn a_packed_gpt_batch_equals_its_examples_one_per_row() {
    let mut config = GptConfig::tiny();
    config.context = 32;
    let model = GptModel::new(config.clone()).unwrap();
    let weights: Vec<Vec<f32>> = (0..model.spec().units.len())
        .map(|u| {
            let mut v = vec![0.0; model.spec().units[u].numel()];
            model.init_params(u, 5, &mut v);
            v
        })
        .collect();
    let (packed, alone) = batches(config.vocab_size as u32, 32);
    assert_same(&model, &weights, &packed, &alone);
}

#[test]
fn a_packed_llama_batch_equals_its_examples_one_per_row() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/qwen2-tiny");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let config = LlamaConfig::from_hf_json(&json, &dir).unwrap();
    let model = Candle::new(Llama::new(config).unwrap());
    let weights = hf::load_weights(&dir, model.spec()).unwrap();
    // Rows of 24 positions with a window of 8 on the second layer: windows inside examples too.
    let (packed, alone) = batches(300, 24);
    assert_same(&model, &weights, &packed, &alone);
}

/// One AdamW step over every row, packed and not, through the engine (the GPT's blocks on its
/// own kernels): the same loss and the same parameters after it.
#[test]
fn a_training_step_on_packed_rows_equals_the_step_on_one_example_per_row() {
    use zerodp::trainer::{LrSchedule, ReportLog, Trainer};
    use zerodp::zero::{EngineConfig, Stage};
    let mut config = GptConfig::tiny();
    config.context = 32;
    let model = GptModel::new(config.clone()).unwrap();
    let step = |pack: bool| {
        let loader = ExampleLoader::new(
            "t".into(),
            examples(config.vocab_size as u32),
            (32, 0, 1),
            (None, pack),
        )
        .unwrap();
        let mut cfg = EngineConfig::new(Stage::Zero2, 1);
        cfg.micro_batch = loader.len();
        cfg.loss_per_token = true;
        let log = ReportLog::new();
        let outcome = Trainer::new(&model, cfg)
            .with_schedule(LrSchedule::Constant(1e-3))
            .keep_params(true)
            .run(&loader, 1, &[&log])
            .unwrap();
        let r = &log.into_reports()[0][0];
        ((r.loss, r.grad_norm), outcome.params.unwrap())
    };
    let (((lp, np), pp), ((la, na), pa)) = (step(true), step(false));
    assert!(
        (lp - la).abs() <= 1e-5 * la.abs(),
        "loss packed {lp}, alone {la}"
    );
    assert!(
        (np - na).abs() <= 1e-5 * na.abs(),
        "gradient norm packed {np}, alone {na}"
    );
    let worst = pp
        .iter()
        .flatten()
        .zip(pa.iter().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    // Adam's first step moves each weight by about lr x sign(g): a gradient at rounding level
    // may move its weight another way, by a part of lr, in either layout.
    assert!(worst <= 1e-3 * 1e-3, "parameters differ by {worst}");
}

/// Segment starts that describe no sequences are refused before any compute, not a panic.
#[test]
fn bad_segment_starts_are_errors() {
    let model = GptModel::new(GptConfig::tiny()).unwrap();
    let weights: Vec<Vec<f32>> = (0..model.spec().units.len())
        .map(|u| vec![0.01; model.spec().units[u].numel()])
        .collect();
    let slices: Vec<&[f32]> = weights.iter().map(Vec::as_slice).collect();
    let batch = |starts: Vec<u32>| TokenBatch {
        tokens: vec![1; 8],
        targets: vec![2; 8],
        batch_size: 2,
        seq_len: 4,
        segment_starts: starts,
    };
    assert!(model
        .end_to_end(&slices, &batch(vec![0, 0, 2, 2, 0, 1, 1, 3]), 1.0)
        .is_ok());
    for (starts, why) in [
        (vec![0, 0, 3, 3, 0, 0, 0, 0], "a start after its token"),
        (vec![0, 0, 1, 1, 0, 0, 0, 0], "a start no token begins"),
        (vec![0, 0, 0], "too few"),
    ] {
        let e = model.end_to_end(&slices, &batch(starts), 1.0).unwrap_err();
        assert!(e.to_string().contains("segment start"), "{why}: {e}");
    }
}
