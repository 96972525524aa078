//! The families on the Llama's decoder (issue 43): Qwen2 (q, k and v biases, a tied head, a
//! sliding window of half the batches' length on its second layer), Mistral (a window of half the
//! batches' length on every layer), Qwen3 (the query and key norms, head_dim apart from the
//! width), a Llama with attention and MLP biases and yarn rope scaling, and Gemma
//! (GeGLU, RMSNorm by 1 + weight, scaled embeddings, a padding row that lookups do not train); and
//! a GPT-2 with the fields zerodp once refused (LayerNorm epsilon 1e-6, an MLP of 1.5 x the width,
//! an untied head). Each is a tiny
//! directory written by `transformers` (tests/fixtures/hf/*-tiny, made by
//! scripts/make_family_fixtures.py) that loads into zerodp by its config alone and gives
//! transformers' losses and gradient norms over 10 AdamW steps with clipping and weight decay at
//! every stage, counts its parameters as transformers does, and exports back as its own family.

use super::hf_fixture::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use zerodp::data::TokenBatch;
use zerodp::flat::DType;
use zerodp::model::hf::{self, HfConfig};
use zerodp::model::llama::Llama;
use zerodp::model::train_model::{build_model, HfModel, TrainModel};
use zerodp::model::Candle;
use zerodp::trainer::{BatchIndex, LrSchedule, ReportLog, Trainer};
use zerodp::zero::unit::UnitModel;
use zerodp::zero::{EngineConfig, Stage};

const FAMILIES: [&str; 6] = [
    "qwen2-tiny",
    "qwen3-tiny",
    "mistral-tiny",
    "llama-bias-tiny",
    "gemma-tiny",
    "gpt2-fields-tiny",
];

fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

fn expected(name: &str) -> Value {
    read_json(&fixture_dir(name).with_file_name(format!("{name}-expected.json")))
}

/// The directory's model, from its config alone (as `train --model-dir` builds it), and its
/// weights.
fn load(name: &str) -> (HfConfig, TrainModel, Vec<Vec<f32>>) {
    let config = HfConfig::read(&fixture_dir(name).join(hf::CONFIG_FILE)).unwrap();
    let hf_model = HfModel {
        config: config.clone(),
        dir: Some(fixture_dir(name)),
    };
    let on = (candle_core::Device::Cpu, candle_core::DType::F32);
    let model = build_model(&config.gpt, Some(&hf_model), on).unwrap();
    let weights =
        hf::load_weights(&fixture_dir(name), model.spec()).unwrap_or_else(|e| panic!("{e}"));
    (config, model, weights)
}

fn loss(model: &TrainModel, weights: &[Vec<f32>], batch: &TokenBatch) -> f64 {
    let slices: Vec<&[f32]> = weights.iter().map(Vec::as_slice).collect();
    model.end_to_end(&slices, batch, 1.0).unwrap().0
}

/// Rank 0's losses and gradient norms and the final weights of the fixture's AdamW steps, with
/// its clipping, at `stage` on `world` ranks.
fn train(name: &str, stage: Stage, world: usize) -> (Vec<f64>, Vec<f64>, Vec<Vec<f32>>) {
    train_in(name, (stage, world), DType::F32)
}

/// [`train`] with the engine's parameters, gradients and collectives in `dtype`.
fn train_in(
    name: &str,
    (stage, world): (Stage, usize),
    dtype: DType,
) -> (Vec<f64>, Vec<f64>, Vec<Vec<f32>>) {
    let exp = expected(name);
    let (_, model, weights) = load(name);
    let o = &exp["optimizer"];
    let global = exp["batch"].as_u64().unwrap() as usize;
    let mut cfg = EngineConfig::new(stage, world).with_precision(dtype);
    cfg.micro_batch = global / world;
    cfg.adam.beta1 = o["betas"][0].as_f64().unwrap();
    cfg.adam.beta2 = o["betas"][1].as_f64().unwrap();
    cfg.adam.eps = o["eps"].as_f64().unwrap();
    cfg.adam.weight_decay = o["weight_decay"].as_f64().unwrap();
    cfg.adam.adam_w_mode = true;
    cfg.adam.bias_correction = true;
    cfg.gradient_clipping = exp["gradient_clipping"].as_f64().unwrap() as f32;
    cfg.param_persistence_threshold = 0;
    let source = |at: BatchIndex| -> Result<TokenBatch, String> {
        let n = at.micro_batch_size;
        let first = (at.micro * at.world_size + at.rank) * n;
        Ok(batch(&exp, at.step as usize, first, n))
    };
    let steps = exp["losses"].as_array().unwrap().len() as u64;
    let log = ReportLog::new();
    let outcome = Trainer::new(&model, cfg)
        .with_init(weights)
        .with_schedule(LrSchedule::Constant(o["lr"].as_f64().unwrap() as f32))
        .keep_params(true)
        .run(&source, steps, &[&log])
        .unwrap_or_else(|e| panic!("{name} {stage:?} world {world}: {e}"));
    let reports = log.into_reports().swap_remove(0);
    let losses = reports.iter().map(|r| r.loss as f64).collect();
    let norms = reports.iter().map(|r| r.grad_norm as f64).collect();
    (losses, norms, outcome.params.unwrap())
}

#[test]
fn each_family_reads_its_config_and_counts_its_parameters_as_transformers() {
    for name in FAMILIES {
        let (config, model, _) = load(name);
        let want = expected(name)["num_params"].as_u64().unwrap() as usize;
        assert_eq!(model.spec().num_params(), want, "{name}: the spec's count");
        let counted = match &config.llama {
            Some(llama) => llama.num_params(),
            None => config.gpt.num_params(),
        };
        assert_eq!(counted, want, "{name}: the config's count");
        let spec = zerodp::model::train_model::spec_of(&config).unwrap();
        assert_eq!(spec.num_params(), want, "{name}: what plan and train count");
    }
    let qwen2 = load("qwen2-tiny").0.llama.unwrap();
    assert!(qwen2.qkv_bias && !qwen2.o_bias && !qwen2.mlp_bias && qwen2.tied);
    assert_eq!(qwen2.sliding_window, Some(8));
    let qwen3 = load("qwen3-tiny").0.llama.unwrap();
    assert!(qwen3.qk_norm && !qwen3.qkv_bias && qwen3.head_dim == 24);
    let gemma = load("gemma-tiny").0.llama.unwrap();
    assert!(gemma.norm_offset && gemma.embed_scale && gemma.tied && gemma.head_dim == 24);
    assert_eq!(gemma.padding_idx, Some(0));
    let gpt2 = load("gpt2-fields-tiny").0.gpt;
    assert_eq!((gpt2.mlp(), gpt2.eps(), gpt2.untied_head), (96, 1e-6, true));
    let biased = load("llama-bias-tiny").0.llama.unwrap();
    assert!(biased.qkv_bias && biased.o_bias && biased.mlp_bias);
    assert!(biased.rope_scaling.attention_factor() > 1.0);
}

#[test]
fn each_family_gives_transformers_step_0_loss() {
    for name in FAMILIES {
        let exp = expected(name);
        let (_, model, weights) = load(name);
        let got = loss(&model, &weights, &batch(&exp, 0, 0, 4));
        let want = exp["losses"][0].as_f64().unwrap();
        eprintln!("{name}: zerodp {got}, transformers {want}");
        assert!(
            rel(got, want) <= 1e-5,
            "{name}: zerodp {got}, transformers {want}"
        );
    }
}

/// Ten AdamW steps with weight decay and clipping: every loss, every gradient norm (before
/// clipping) and the loss after the last step within 1e-5 of transformers', at stages 0-3.
#[test]
fn each_family_trains_as_transformers_at_every_stage() {
    for name in FAMILIES {
        let exp = expected(name);
        let (want_losses, want_norms) = (numbers(&exp["losses"]), numbers(&exp["grad_norms"]));
        let after_want = exp["loss_after_steps_on_batch_0"].as_f64().unwrap();
        let (_, model, _) = load(name);
        for (stage, world) in [
            (Stage::Zero0, 1),
            (Stage::Zero1, 2),
            (Stage::Zero2, 2),
            (Stage::Zero3, 2),
        ] {
            let (losses, norms, params) = train(name, stage, world);
            let after = loss(&model, &params, &batch(&exp, 0, 0, 4));
            let pairs = losses
                .iter()
                .zip(&want_losses)
                .chain(norms.iter().zip(&want_norms));
            let worst = pairs
                .map(|(&g, &w)| rel(g, w))
                .fold(rel(after, after_want), f64::max);
            eprintln!("{name} {stage:?} world {world}: worst relative difference {worst:.2e}");
            assert!(
                worst <= 1e-5,
                "{name} {stage:?}: losses {losses:?} vs {want_losses:?}, norms {norms:?} vs \
                 {want_norms:?}, after {after} vs {after_want}"
            );
        }
    }
}

/// bf16 parameters, gradients and collectives (an fp32 master) follow the f32 run: every loss
/// within two bf16 half-ulps (2^-8 relative, the bound of the engine's bf16 tests), at stage 0 on
/// one rank and stage 3 on two.
#[test]
fn each_family_in_bf16_follows_f32() {
    for name in FAMILIES {
        let (f32_losses, _, _) = train(name, Stage::Zero0, 1);
        for at in [(Stage::Zero0, 1), (Stage::Zero3, 2)] {
            let (bf16, _, _) = train_in(name, at, DType::BF16);
            let worst = (bf16.iter().zip(&f32_losses))
                .map(|(&b, &f)| rel(b, f))
                .fold(0.0, f64::max);
            eprintln!("{name} {at:?} bf16 vs f32: worst relative difference {worst:.2e}");
            assert!(
                worst < 2.0 / 512.0,
                "{name} {at:?}: {bf16:?} vs {f32_losses:?}"
            );
        }
    }
}

/// The export writes each family back as itself: its `model_type` and architecture, its
/// tensors under its own names, loading back to the same weights and loss.
#[test]
fn each_family_exports_as_itself() {
    for name in FAMILIES {
        let exp = expected(name);
        let (config, model, weights) = load(name);
        let out = tempfile::tempdir().unwrap();
        let f32 = hf::ExportDtype::F32;
        hf::export(out.path(), &config, model.spec(), &weights, f32, None).unwrap();
        let written = read_json(&out.path().join(hf::CONFIG_FILE));
        let original = read_json(&fixture_dir(name).join(hf::CONFIG_FILE));
        for key in [
            "model_type",
            "architectures",
            "tie_word_embeddings",
            "head_dim",
        ] {
            assert_eq!(written.get(key), original.get(key), "{name}: {key}");
        }
        let back = hf::load_weights(out.path(), model.spec()).unwrap();
        assert_eq!(back, weights, "{name}");
        let b = batch(&exp, 0, 0, 4);
        assert_eq!(
            loss(&model, &weights, &b),
            loss(&model, &back, &b),
            "{name}"
        );
    }
}

/// The windows matter: the batches are twice the window, and the same weights without the
/// window (`use_sliding_window: false`, or a Mistral window as long as the context) give another
/// loss than the one transformers computes with it, which the windowed model matches (above).
#[test]
fn the_sliding_windows_change_the_loss() {
    for (name, field, off) in [
        ("qwen2-tiny", "use_sliding_window", Value::from(false)),
        ("mistral-tiny", "sliding_window", Value::from(32)),
    ] {
        let (config, _, weights) = load(name);
        let llama = config.llama.as_ref().unwrap();
        assert_eq!(llama.sliding_window, Some(8), "{name}");
        let mut json = config.json.clone();
        json[field] = off;
        let full = HfConfig::from_json(json, Path::new("cfg.json")).unwrap();
        let full = TrainModel::Llama(Candle::new(Llama::new(full.llama.unwrap()).unwrap()));
        let exp = expected(name);
        let got = loss(&full, &weights, &batch(&exp, 0, 0, 4));
        let windowed = exp["losses"][0].as_f64().unwrap();
        assert!(
            rel(got, windowed) > 1e-4,
            "{name}: without the window {got}, with it {windowed}"
        );
    }
    let qwen2 = load("qwen2-tiny").0.llama.unwrap();
    assert_eq!(qwen2.window_layers, vec![false, true], "layer_types");
    assert_eq!((qwen2.window_of(0), qwen2.window_of(1)), (None, Some(8)));
}
