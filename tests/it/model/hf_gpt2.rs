//! Hugging Face GPT-2 parity (issue 31): a tiny GPT-2 written by `transformers` with random weights
//! (tests/fixtures/hf/gpt2-tiny, made by scripts/make_hf_fixtures.py) loads into zerodp's GPT and
//! gives `transformers`' loss on the same tokens at step 0 and over 10 AdamW steps at every stage;
//! an export loads back to the same weights and loss; sharded and 16-bit directories load; configs
//! and files zerodp cannot compute are refused by name.

use super::hf_fixture::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use zerodp::data::TokenBatch;
use zerodp::model::hf::{self, ExportDtype, HfConfig};
use zerodp::model::GptModel;
use zerodp::trainer::{BatchIndex, LrSchedule, ReportLog, Trainer};
use zerodp::zero::unit::UnitModel;
use zerodp::zero::{EngineConfig, Stage};

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/gpt2-tiny")
}

fn expected() -> Value {
    let path = fixture_dir().with_file_name("gpt2-tiny-expected.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn load(dir: &Path) -> (GptModel, Vec<Vec<f32>>) {
    let config = HfConfig::read(&dir.join("config.json")).unwrap();
    let model = GptModel::new(config.gpt).unwrap();
    let weights = hf::load_weights(dir, model.spec()).unwrap_or_else(|e| panic!("{e}"));
    (model, weights)
}

fn loss(model: &GptModel, weights: &[Vec<f32>], batch: &TokenBatch) -> f64 {
    let slices: Vec<&[f32]> = weights.iter().map(Vec::as_slice).collect();
    model.end_to_end(&slices, batch, 1.0).unwrap().0
}

#[test]
fn step_0_loss_equals_transformers() {
    let exp = expected();
    let (model, weights) = load(&fixture_dir());
    let got = loss(&model, &weights, &batch(&exp, 0, 0, 4));
    let want = exp["losses"][0].as_f64().unwrap();
    eprintln!(
        "step 0: zerodp {got}, transformers {want}, relative {:.2e}",
        rel(got, want)
    );
    assert!(rel(got, want) <= 1e-5, "zerodp {got}, transformers {want}");
}

/// Rank losses of 10 AdamW steps from the fixture's weights at `stage` on `world` ranks.
fn train(stage: Stage, world: usize, steps: u64) -> (Vec<f32>, Vec<Vec<f32>>) {
    let exp = expected();
    let (model, weights) = load(&fixture_dir());
    let o = &exp["optimizer"];
    let global = exp["batch"].as_u64().unwrap() as usize;
    let mut cfg = EngineConfig::new(stage, world);
    cfg.micro_batch = global / world;
    cfg.adam.beta1 = o["betas"][0].as_f64().unwrap();
    cfg.adam.beta2 = o["betas"][1].as_f64().unwrap();
    cfg.adam.eps = o["eps"].as_f64().unwrap();
    cfg.adam.weight_decay = o["weight_decay"].as_f64().unwrap();
    cfg.adam.adam_w_mode = true;
    cfg.adam.bias_correction = true;
    // Units of this model are a few thousand elements: let stage 3 shard every one of them.
    cfg.param_persistence_threshold = 0;
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
    for (stage, world) in [
        (Stage::Zero0, 1),
        (Stage::Zero1, 2),
        (Stage::Zero2, 2),
        (Stage::Zero3, 2),
    ] {
        let (got, params) = train(stage, world, want.len() as u64);
        let (model, _) = load(&fixture_dir());
        let after = loss(&model, &params, &batch(&exp, 0, 0, 4));
        let after_want = exp["loss_after_steps_on_batch_0"].as_f64().unwrap();
        assert!(
            rel(after, after_want) <= 1e-5,
            "{stage:?} world {world}: after the steps zerodp {after}, transformers {after_want}"
        );
        let worst = got
            .iter()
            .zip(&want)
            .map(|(&g, &w)| rel(g as f64, w))
            .fold(0.0, f64::max);
        eprintln!(
            "{stage:?} world {world}: worst relative difference {worst:.2e} over {} steps, \
             {:.2e} after them",
            got.len(),
            rel(after, after_want)
        );
        assert!(
            worst <= 1e-5,
            "{stage:?} world {world}: worst relative difference {worst:.2e}\nzerodp       {got:?}\ntransformers {want:?}"
        );
    }
}

#[test]
fn export_loads_back_to_the_same_weights_and_loss() {
    let exp = expected();
    let (trained_losses, params) = train(Stage::Zero2, 2, 3);
    assert_eq!(trained_losses.len(), 3);
    let config = HfConfig::read(&fixture_dir().join("config.json")).unwrap();
    let out = tempfile::tempdir().unwrap();
    let model = GptModel::new(config.gpt.clone()).unwrap();
    let done = hf::export(
        out.path(),
        &config,
        model.spec(),
        &params,
        ExportDtype::F32,
        None,
    )
    .unwrap();
    assert!(done.weight_bytes > 0);
    let written: Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(written["dtype"], "float32");
    assert_eq!(written["n_layer"], 2);
    let (model2, back) = load(out.path());
    assert_eq!(
        back, params,
        "the export does not load back to the trained weights"
    );
    let b = batch(&exp, 0, 0, 4);
    assert_eq!(loss(&model, &params, &b), loss(&model2, &back, &b));
}

#[test]
fn sixteen_bit_exports_load_rounded() {
    let (model, weights) = load(&fixture_dir());
    let config = HfConfig::read(&fixture_dir().join("config.json")).unwrap();
    for (dtype, round) in [
        (
            ExportDtype::Bf16,
            (|x: f32| half::bf16::from_f32(x).to_f32()) as fn(f32) -> f32,
        ),
        (ExportDtype::F16, |x: f32| half::f16::from_f32(x).to_f32()),
    ] {
        let out = tempfile::tempdir().unwrap();
        hf::export(out.path(), &config, model.spec(), &weights, dtype, None).unwrap();
        let again = HfConfig::read(&out.path().join("config.json")).unwrap();
        assert_eq!(again.dtype(), Some(dtype.torch_name()));
        let (_, back) = load(out.path());
        let rounded: Vec<Vec<f32>> = weights
            .iter()
            .map(|u| u.iter().map(|&x| round(x)).collect())
            .collect();
        assert_eq!(back, rounded, "{dtype:?}");
    }
}

/// Writes the fixture's tensors into two shards and an index, as `save_pretrained` does for
/// large models.
fn write_sharded(dir: &Path) {
    use safetensors::SafeTensors;
    let bytes = std::fs::read(fixture_dir().join("model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors = file.tensors();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let half = tensors.len() / 2;
    let mut map = serde_json::Map::new();
    for (k, part) in [&tensors[..half], &tensors[half..]].into_iter().enumerate() {
        let name = format!("model-0000{}-of-00002.safetensors", k + 1);
        for (t, _) in part {
            map.insert(t.clone(), name.clone().into());
        }
        let views = part.iter().map(|(n, v)| (n.clone(), v.clone()));
        safetensors::serialize_to_file(views, None, &dir.join(&name)).unwrap();
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": map });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    std::fs::copy(fixture_dir().join("config.json"), dir.join("config.json")).unwrap();
}

#[test]
fn a_sharded_directory_loads_the_same_weights() {
    let dir = tempfile::tempdir().unwrap();
    write_sharded(dir.path());
    let (_, single) = load(&fixture_dir());
    let (_, sharded) = load(dir.path());
    assert_eq!(single, sharded);
}

fn config_error(change: impl Fn(&mut serde_json::Map<String, Value>)) -> String {
    let mut json: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture_dir().join("config.json")).unwrap())
            .unwrap();
    change(json.as_object_mut().unwrap());
    HfConfig::from_json(json, Path::new("cfg.json"))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default()
}

#[test]
fn configs_zerodp_cannot_compute_are_refused_by_name() {
    // An untied head, another LayerNorm epsilon and another MLP width are built (the
    // gpt2-fields-tiny fixture of tests/it/model/hf_families.rs); what they may not be is refused.
    let cases: [(&str, Value); 9] = [
        ("activation_function", 5.into()),
        ("scale_attn_by_inverse_layer_idx", true.into()),
        ("scale_attn_weights", false.into()),
        ("add_cross_attention", true.into()),
        ("tie_word_embeddings", "no".into()),
        ("activation_function", "gelu".into()),
        ("layer_norm_epsilon", (-1e-6).into()),
        ("n_inner", 0.into()),
        ("model_type", "gemma2".into()),
    ];
    for (field, value) in cases {
        let e = config_error(|m| {
            m.insert(field.into(), value.clone());
        });
        assert!(
            e.contains(field) && e.contains("cfg.json"),
            "{field} {value}: {e:?}"
        );
    }
    let e = config_error(|m| {
        m.insert("n_head".into(), 5.into());
    });
    assert!(e.contains("divisible"), "{e}");
    let e = config_error(|m| {
        m.insert("n_embd".into(), "wide".into());
    });
    assert!(e.contains("n_embd"), "{e}");
    // Dropout is read and said, not refused: fine-tuning without it is common.
    let ok = HfConfig::from_json(
        serde_json::json!({"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 1,
                           "vocab_size": 300, "n_positions": 32, "resid_pdrop": 0.1}),
        Path::new("c.json"),
    )
    .unwrap();
    assert!(
        ok.notes.iter().any(|n| n.contains("resid_pdrop")),
        "{:?}",
        ok.notes
    );
    // reorder_and_upcast_attn (softmax in f32) is what zerodp computes anyway.
    assert_eq!(
        config_error(|m| {
            m.insert("reorder_and_upcast_attn".into(), true.into());
        }),
        ""
    );
}

#[test]
fn files_that_do_not_match_the_config_are_refused_by_tensor() {
    let (model, weights) = load(&fixture_dir());
    let config = HfConfig::read(&fixture_dir().join("config.json")).unwrap();
    // One block fewer in the config than in the weights: the extra tensors are named.
    let mut small = config.json.clone();
    small["n_layer"] = 1.into();
    let small = HfConfig::from_json(small, Path::new("c.json")).unwrap();
    let small_model = GptModel::new(small.gpt).unwrap();
    let e = hf::load_weights(&fixture_dir(), small_model.spec())
        .unwrap_err()
        .to_string();
    assert!(e.contains("transformer.h.1.ln_1.weight"), "{e}");
    // An untied lm_head is refused.
    let dir = tempfile::tempdir().unwrap();
    hf::export(
        dir.path(),
        &config,
        model.spec(),
        &weights,
        ExportDtype::F32,
        None,
    )
    .unwrap();
    let bytes = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> = file.tensors();
    let lm = vec![0u8; 300 * 64 * 4];
    let lm_view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![300, 64], &lm).unwrap();
    tensors.push(("lm_head.weight".into(), lm_view));
    let untied = tempfile::tempdir().unwrap();
    safetensors::serialize_to_file(tensors, None, &untied.path().join("model.safetensors"))
        .unwrap();
    let e = hf::load_weights(untied.path(), model.spec())
        .unwrap_err()
        .to_string();
    assert!(e.contains("lm_head.weight"), "{e}");
    // An empty (or truncated) file is named.
    let broken = tempfile::tempdir().unwrap();
    std::fs::write(broken.path().join("model.safetensors"), b"").unwrap();
    let e = hf::load_weights(broken.path(), model.spec())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.safetensors") && e.contains("safetensors file"),
        "{e}"
    );
    // No weights at all: both file names are said.
    let empty = tempfile::tempdir().unwrap();
    let e = hf::load_weights(empty.path(), model.spec())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.safetensors") && e.contains("index"),
        "{e}"
    );
}
