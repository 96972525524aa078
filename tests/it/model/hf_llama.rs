//! Hugging Face Llama parity (issue 31): a tiny Llama written by `transformers` with random
//! weights (grouped-query attention, 4 query heads on 2 key/value heads, an untied head;
//! tests/fixtures/hf/llama-tiny, made by scripts/make_hf_fixtures.py) loads into zerodp's Llama
//! and gives `transformers`' loss on the same tokens at step 0 and over 10 AdamW steps at every
//! stage.

use super::hf_fixture::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use zerodp::data::TokenBatch;
use zerodp::model::hf;
use zerodp::model::hf::LlamaConfig;
use zerodp::model::llama::Llama;
use zerodp::model::Candle;
use zerodp::trainer::{BatchIndex, LrSchedule, ReportLog, Trainer};
use zerodp::zero::unit::UnitModel;
use zerodp::zero::Stage;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama-tiny")
}

fn expected() -> Value {
    read_json(&fixture_dir().with_file_name("llama-tiny-expected.json"))
}

fn config_of(json: &Value) -> Result<LlamaConfig, String> {
    LlamaConfig::from_hf_json(json, Path::new("cfg.json")).map_err(|e| e.to_string())
}

fn load() -> (Candle<Llama>, Vec<Vec<f32>>) {
    let config = config_of(&read_json(&fixture_dir().join("config.json"))).unwrap();
    assert_eq!((config.heads, config.kv_heads, config.tied), (4, 2, false));
    let model = Candle::new(Llama::new(config).unwrap());
    let weights = hf::load_weights(&fixture_dir(), model.spec()).unwrap_or_else(|e| panic!("{e}"));
    (model, weights)
}

fn loss(model: &Candle<Llama>, weights: &[Vec<f32>], batch: &TokenBatch) -> f64 {
    let slices: Vec<&[f32]> = weights.iter().map(Vec::as_slice).collect();
    model.end_to_end(&slices, batch, 1.0).unwrap().0
}

#[test]
fn step_0_loss_equals_transformers() {
    let exp = expected();
    let (model, weights) = load();
    let got = loss(&model, &weights, &batch(&exp, 0, 0, 4));
    let want = exp["losses"][0].as_f64().unwrap();
    eprintln!(
        "step 0: zerodp {got}, transformers {want}, relative {:.2e}",
        rel(got, want)
    );
    assert!(rel(got, want) <= 1e-5, "zerodp {got}, transformers {want}");
}

/// Rank 0's losses and the final weights of `steps` AdamW steps at `stage` on `world` ranks.
fn train(stage: Stage, world: usize, steps: u64) -> (Vec<f32>, Vec<Vec<f32>>) {
    let exp = expected();
    let (model, weights) = load();
    let o = &exp["optimizer"];
    let cfg = adamw_config(&exp, stage, world);
    let source = |at: BatchIndex| -> Result<TokenBatch, String> {
        let n = at.micro_batch_size;
        let first = (at.micro * at.world_size + at.rank) * n;
        Ok(batch(&exp, at.step as usize, first, n))
    };
    let log = ReportLog::new();
    let outcome = Trainer::new(&model, cfg)
        .with_init(weights)
        .with_schedule(LrSchedule::Constant(o["lr"].as_f64().unwrap() as f32))
        .keep_params(true)
        .run(&source, steps, &[&log])
        .unwrap_or_else(|e| panic!("{stage:?} world {world}: {e}"));
    let losses = log.into_reports()[0].iter().map(|r| r.loss).collect();
    (losses, outcome.params.unwrap())
}

#[test]
fn ten_adamw_steps_equal_transformers_at_every_stage() {
    let exp = expected();
    let want: Vec<f64> = exp["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    let after_want = exp["loss_after_steps_on_batch_0"].as_f64().unwrap();
    let (model, _) = load();
    for (stage, world) in [
        (Stage::Zero0, 1),
        (Stage::Zero1, 2),
        (Stage::Zero2, 2),
        (Stage::Zero3, 2),
    ] {
        let (got, params) = train(stage, world, want.len() as u64);
        let after = loss(&model, &params, &batch(&exp, 0, 0, 4));
        let worst = got
            .iter()
            .zip(&want)
            .map(|(&g, &w)| rel(g as f64, w))
            .fold(rel(after, after_want), f64::max);
        eprintln!("{stage:?} world {world}: worst relative difference {worst:.2e}");
        assert!(
            worst <= 1e-5,
            "{stage:?} world {world}: {worst:.2e}\nzerodp       {got:?} then {after}\ntransformers {want:?} then {after_want}"
        );
    }
}

#[test]
fn llama_configs_zerodp_cannot_compute_are_refused_by_name() {
    let base = read_json(&fixture_dir().join("config.json"));
    let cases: [(&str, Value); 4] = [
        ("hidden_act", "gelu".into()),
        ("num_key_value_heads", 3.into()),
        (
            "rope_parameters",
            serde_json::json!({"rope_type": "dynamic", "factor": 8.0, "rope_theta": 5e5}),
        ),
        ("model_type", "gemma2".into()),
    ];
    for (field, value) in cases {
        let mut json = base.clone();
        json[field] = value.clone();
        let e = config_of(&json).unwrap_err();
        assert!(e.contains(field) && e.contains("cfg.json"), "{field}: {e}");
    }
    // transformers 4's top-level rope_theta is read too.
    let mut json = base.clone();
    json.as_object_mut().unwrap().remove("rope_parameters");
    json["rope_theta"] = 500000.0.into();
    assert_eq!(config_of(&json).unwrap().rope_theta, 500000.0);
}

#[test]
fn export_loads_back_to_the_same_weights_and_loss() {
    let exp = expected();
    let (_, params) = train(Stage::Zero3, 2, 3);
    let config = hf::HfConfig::read(&fixture_dir().join("config.json")).unwrap();
    assert!(config.llama.is_some());
    let (model, _) = load();
    let out = tempfile::tempdir().unwrap();
    hf::export(
        out.path(),
        &config,
        model.spec(),
        &params,
        hf::ExportDtype::F32,
        None,
    )
    .unwrap();
    let written = read_json(&out.path().join("config.json"));
    assert_eq!(written["model_type"], "llama");
    assert_eq!(written["num_key_value_heads"], 2);
    let back = hf::load_weights(out.path(), model.spec()).unwrap();
    assert_eq!(back, params);
    let b = batch(&exp, 0, 0, 4);
    assert_eq!(loss(&model, &params, &b), loss(&model, &back, &b));
}

/// The fixture's weights under a changed config (`variant["config"]` merged in, the tensors in
/// `variant["drop"]` left out of the file), in a new directory.
fn variant_dir(variant: &Value) -> (tempfile::TempDir, Value) {
    let dir = tempfile::tempdir().unwrap();
    let mut config = read_json(&fixture_dir().join("config.json"));
    for (k, v) in variant["config"].as_object().unwrap() {
        config[k] = v.clone();
    }
    let drop: Vec<&str> = variant["drop"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    let bytes = std::fs::read(fixture_dir().join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept = file
        .tensors()
        .into_iter()
        .filter(|(n, _)| !drop.contains(&n.as_str()));
    safetensors::serialize_to_file(kept, None, &dir.path().join("model.safetensors")).unwrap();
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    (dir, config)
}

#[test]
fn rope_scalings_and_a_tied_head_equal_transformers() {
    let exp = expected();
    let variants = exp["variants"].as_array().unwrap();
    assert_eq!(variants.len(), 3);
    for v in variants {
        let (dir, config) = variant_dir(v);
        let config = config_of(&config).unwrap();
        let model = Candle::new(Llama::new(config).unwrap());
        let weights = hf::load_weights(dir.path(), model.spec()).unwrap();
        let got = loss(&model, &weights, &batch(&exp, 0, 0, 4));
        let want = v["loss"].as_f64().unwrap();
        eprintln!("{}: relative {:.2e}", v["config"], rel(got, want));
        assert!(
            rel(got, want) <= 1e-5,
            "{}: zerodp {got}, transformers {want}",
            v["config"]
        );
    }
}

/// The fused CPU kernels (the default on the CPU) against the composite candle ops (what a GPU
/// runs): the same loss and gradients, grouped-query attention with an untied head and a tied one
/// with as many key/value heads as query heads.
#[test]
fn fused_kernels_equal_the_composite_ops() {
    let exp = expected();
    let base = read_json(&fixture_dir().join("config.json"));
    let mut tied = base.clone();
    tied["tie_word_embeddings"] = Value::from(true);
    tied["num_key_value_heads"] = Value::from(4);
    for json in [base, tied] {
        let config = config_of(&json).unwrap();
        let fused = Candle::new(Llama::new(config.clone()).unwrap());
        let composite = Candle::new(Llama::new(config.clone()).unwrap().composite());
        let weights: Vec<Vec<f32>> = (0..fused.spec().units.len())
            .map(|u| {
                let mut w = vec![0.0; fused.spec().units[u].numel()];
                fused.init_params(u, 5, &mut w);
                w
            })
            .collect();
        let slices: Vec<&[f32]> = weights.iter().map(Vec::as_slice).collect();
        let b = batch(&exp, 0, 0, 4);
        let (lf, gf) = fused.end_to_end(&slices, &b, 1.0).unwrap();
        let (lc, gc) = composite.end_to_end(&slices, &b, 1.0).unwrap();
        assert!(rel(lf, lc) <= 1e-6, "{config:?}: loss {lf} vs {lc}");
        for (u, (f, c)) in gf.iter().zip(&gc).enumerate() {
            let scale = c.iter().fold(0f32, |m, x| m.max(x.abs()));
            let worst = f.iter().zip(c).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                scale > 0.0 && worst <= 1e-4 * scale,
                "unit {u} of {config:?}: gradients differ by {worst} (largest {scale})"
            );
        }
    }
}
