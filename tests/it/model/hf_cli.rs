//! Hugging Face directories from the command line: `train --model-dir` fine-tunes the fixture
//! GPT-2 and records it in its checkpoints, `ckpt export` writes a directory that loads back to
//! the checkpoint's weights (with the config, dtype and tokenizer-side files), `--model-config`
//! trains from scratch, and exports into an input or a checkpoint are refused.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use zerodp::model::hf::{self, HfConfig};
use zerodp::model::GptModel;
use zerodp::zero::unit::UnitModel;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/gpt2-tiny")
}

struct Setup {
    dir: tempfile::TempDir,
    model: PathBuf,
    text: PathBuf,
    config: PathBuf,
}

/// A copy of the fixture (with a generation_config.json to be copied on export), a text and an
/// fp32 stage-2 config.
fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("gpt2-tiny");
    std::fs::create_dir(&model).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture_dir().join(f), model.join(f)).unwrap();
    }
    std::fs::write(
        model.join("generation_config.json"),
        r#"{"max_length": 20}"#,
    )
    .unwrap();
    let text = dir.path().join("text.txt");
    std::fs::write(
        &text,
        "to be or not to be, that is the question. ".repeat(50),
    )
    .unwrap();
    let config = dir.path().join("ds.json");
    std::fs::write(
        &config,
        r#"{ "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
             "optimizer": { "type": "AdamW", "params": { "lr": 1e-3 } },
             "zero_optimization": { "stage": 2 } }"#,
    )
    .unwrap();
    Setup {
        dir,
        model,
        text,
        config,
    }
}

fn zerodp(args: &[&str], paths: &[&Path]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_zerodp"));
    c.args(args).args(paths);
    c.output().unwrap()
}

fn train(s: &Setup, flags: &[(&str, &Path)], steps: &str) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_zerodp"));
    c.args([
        "train",
        "--world-size",
        "2",
        "--no-progress",
        "--steps",
        steps,
    ])
    .arg("--config")
    .arg(&s.config)
    .arg("--data")
    .arg(&s.text);
    for (flag, p) in flags {
        c.arg(flag).arg(p);
    }
    c.output().unwrap()
}

fn ok(out: &Output) {
    assert!(
        out.status.success(),
        "status {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn model_dir_fine_tunes_and_exports_a_directory_that_loads_back() {
    let s = setup();
    let ckpt = s.dir.path().join("ckpt");
    ok(&train(
        &s,
        &[("--model-dir", &s.model), ("--save-dir", &ckpt)],
        "2",
    ));
    let out = s.dir.path().join("export");
    let run = zerodp(&["ckpt", "export"], &[&ckpt, &out]);
    ok(&run);
    assert!(
        stderr(&run).contains("generation_config.json"),
        "{}",
        stderr(&run)
    );
    let config = HfConfig::read(&out.join("config.json")).unwrap();
    assert_eq!(config.dtype(), Some("float32"));
    let model = GptModel::new(config.gpt).unwrap();
    let exported = hf::load_weights(&out, model.spec()).unwrap();
    let (_, trained) = zerodp::checkpoint::read_params(&ckpt).unwrap();
    assert_eq!(exported, trained);
    let start = hf::load_weights(&s.model, model.spec()).unwrap();
    assert_ne!(exported, start, "two steps changed nothing");
    assert!(out.join("generation_config.json").is_file());

    // --dtype bf16 rounds the weights and says so in the config.
    let out16 = s.dir.path().join("export16");
    ok(&zerodp(
        &["ckpt", "export", "--dtype", "bf16"],
        &[&ckpt, &out16],
    ));
    let config = HfConfig::read(&out16.join("config.json")).unwrap();
    assert_eq!(config.dtype(), Some("bfloat16"));

    // Not into the model directory it came from, nor into the checkpoint.
    for bad in [s.model.join("out"), ckpt.join("out")] {
        let run = zerodp(&["ckpt", "export"], &[&ckpt, &bad]);
        assert!(!run.status.success(), "exported into {}", bad.display());
        assert!(!bad.exists(), "{} was created", bad.display());
    }
}

#[test]
fn model_config_trains_from_scratch_and_flags_conflict() {
    let s = setup();
    let save = s.dir.path().join("w.safetensors");
    let config = s.model.join("config.json");
    let run = train(&s, &[("--model-config", &config), ("--save", &save)], "1");
    ok(&run);
    assert!(save.is_file());
    // A preset and a model directory cannot both be the model.
    let mut c = Command::new(env!("CARGO_BIN_EXE_zerodp"));
    let run = c
        .args(["train", "--model", "tiny", "--config"])
        .arg(&s.config)
        .arg("--model-dir")
        .arg(&s.model)
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(2), "{}", stderr(&run));
    // A config zerodp cannot compute is refused by field, before any step.
    let bad = s.dir.path().join("bad.json");
    let text = std::fs::read_to_string(&config).unwrap().replace(
        "\"scale_attn_by_inverse_layer_idx\": false",
        "\"scale_attn_by_inverse_layer_idx\": true",
    );
    std::fs::write(&bad, text).unwrap();
    let run = train(&s, &[("--model-config", &bad)], "1");
    assert!(!run.status.success());
    assert!(
        stderr(&run).contains("scale_attn_by_inverse_layer_idx"),
        "{}",
        stderr(&run)
    );
}

#[test]
fn a_preset_checkpoint_exports_with_its_head_count() {
    let s = setup();
    let ckpt = s.dir.path().join("ckpt");
    let mut c = Command::new(env!("CARGO_BIN_EXE_zerodp"));
    let run = c
        .args([
            "train",
            "--model",
            "tiny",
            "--world-size",
            "1",
            "--no-progress",
            "--steps",
            "1",
        ])
        .arg("--config")
        .arg(&s.config)
        .arg("--data")
        .arg(&s.text)
        .arg("--save-dir")
        .arg(&ckpt)
        .output()
        .unwrap();
    ok(&run);
    let out = s.dir.path().join("export");
    let run = zerodp(&["ckpt", "export"], &[&ckpt, &out]);
    assert!(!run.status.success());
    assert!(stderr(&run).contains("--heads"), "{}", stderr(&run));
    ok(&zerodp(&["ckpt", "export", "--heads", "2"], &[&ckpt, &out]));
    let config = HfConfig::read(&out.join("config.json")).unwrap();
    assert_eq!(
        (config.gpt.layers, config.gpt.heads, config.gpt.width),
        (2, 2, 32)
    );
    let model = GptModel::new(config.gpt).unwrap();
    let (_, trained) = zerodp::checkpoint::read_params(&ckpt).unwrap();
    assert_eq!(hf::load_weights(&out, model.spec()).unwrap(), trained);
}

#[test]
fn a_llama_directory_fine_tunes_and_exports() {
    let s = setup();
    let llama = s.dir.path().join("llama-tiny");
    std::fs::create_dir(&llama).unwrap();
    let fixture = fixture_dir().with_file_name("llama-tiny");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(f), llama.join(f)).unwrap();
    }
    let ckpt = s.dir.path().join("ckpt");
    ok(&train(
        &s,
        &[("--model-dir", &llama), ("--save-dir", &ckpt)],
        "2",
    ));
    let out = s.dir.path().join("export");
    ok(&zerodp(
        &["ckpt", "export", "--dtype", "f16"],
        &[&ckpt, &out],
    ));
    let config = HfConfig::read(&out.join("config.json")).unwrap();
    assert_eq!(config.dtype(), Some("float16"));
    let llama_config = config.llama.clone().expect("a Llama config");
    let model = zerodp::model::Candle::new(zerodp::model::llama::Llama::new(llama_config).unwrap());
    let exported = hf::load_weights(&out, model.spec()).unwrap();
    let (_, trained) = zerodp::checkpoint::read_params(&ckpt).unwrap();
    let rounded: Vec<Vec<f32>> = trained
        .iter()
        .map(|u| u.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect())
        .collect();
    assert_eq!(exported, rounded);
}

#[test]
fn the_runs_tokenizer_is_copied_into_the_export() {
    let s = setup();
    let tokenizer =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokens/tokenizer.json");
    let ckpt = s.dir.path().join("ckpt");
    let mut c = Command::new(env!("CARGO_BIN_EXE_zerodp"));
    let run = c
        .args([
            "train",
            "--model",
            "tiny",
            "--world-size",
            "1",
            "--no-progress",
            "--steps",
            "1",
        ])
        .arg("--config")
        .arg(&s.config)
        .arg("--data")
        .arg(&s.text)
        .arg("--tokenizer")
        .arg(&tokenizer)
        .arg("--save-dir")
        .arg(&ckpt)
        .output()
        .unwrap();
    ok(&run);
    let out = s.dir.path().join("export");
    let run = zerodp(&["ckpt", "export", "--heads", "2"], &[&ckpt, &out]);
    ok(&run);
    assert_eq!(
        std::fs::read(out.join("tokenizer.json")).unwrap(),
        std::fs::read(&tokenizer).unwrap()
    );
}
