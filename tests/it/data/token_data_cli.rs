//! `zerodp train --data ... --tokenizer ...` end to end: a tiny GPT sized to the tokenizer's
//! vocabulary trains on the fixtures' token file, which the second run reuses.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tokens");

fn copy(dir: &Path, name: &str) -> PathBuf {
    let to = dir.join(name);
    std::fs::copy(Path::new(FIXTURES).join(name), &to).unwrap();
    to
}

/// `zerodp train` in `dir`: 2 steps at world size 2, the tiny preset unless `extra` names a
/// `--model-dir`.
fn train(dir: &Path, extra: &[&str]) -> Output {
    let config = dir.join("ds.json");
    std::fs::write(
        &config,
        r#"{ "train_batch_size": 4, "train_micro_batch_size_per_gpu": 1,
             "optimizer": { "type": "AdamW", "params": { "lr": 1e-3 } },
             "zero_optimization": { "stage": 2 } }"#,
    )
    .unwrap();
    Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .current_dir(dir)
        .args(["train", "--config", "ds.json", "--world-size", "2"])
        .args(["--steps", "2", "--no-progress"])
        .args(match extra.contains(&"--model-dir") {
            true => &[][..],
            false => &["--model", "tiny"][..],
        })
        .args(["--metrics", "m.jsonl"])
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn train_tokenizes_once_and_reuses_the_token_file() {
    let dir = tempfile::tempdir().unwrap();
    for f in ["tokenizer.json", "a.txt", "b.jsonl"] {
        copy(dir.path(), f);
    }
    let args = [
        "--data",
        "a.txt",
        "b.jsonl",
        "--tokenizer",
        "tokenizer.json",
    ];
    let out = train(dir.path(), &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "train failed: {stderr}");
    assert!(
        stderr.contains("tokens: built (no token file yet)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("165 tokens from 4 documents in 2 files"),
        "{stderr}"
    );
    // The model took the tokenizer's vocabulary: the first loss is about ln(vocab).
    let first: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(dir.path().join("m.jsonl"))
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    let loss = first["loss"].as_f64().unwrap();
    assert!((loss - 457f64.ln()).abs() < 0.5, "first loss {loss}");

    let out = train(dir.path(), &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "train failed: {stderr}");
    assert!(stderr.contains("tokens: reusing"), "{stderr}");
}

#[test]
fn train_names_the_file_and_line_of_bad_data() {
    let dir = tempfile::tempdir().unwrap();
    copy(dir.path(), "tokenizer.json");
    std::fs::write(
        dir.path().join("x.jsonl"),
        "{\"text\": \"a\"}\n{\"txt\": \"b\"}\n",
    )
    .unwrap();
    let out = train(
        dir.path(),
        &["--data", "x.jsonl", "--tokenizer", "tokenizer.json"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("x.jsonl: line 2: no \"text\" field"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");

    copy(dir.path(), "a.txt");
    let out = train(dir.path(), &["--data", "a.txt", "x.jsonl"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("need a tokenizer"), "{stderr}");

    let out = train(dir.path(), &["--data", "a.txt", "--text-field", "body"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--text-field needs a tokenizer"),
        "{stderr}"
    );
}

/// The tiny GPT-2 directory of the Hugging Face fixtures with `tokenizer` as its tokenizer.json.
fn model_dir(dir: &Path, tokenizer: &str) -> PathBuf {
    let model = dir.join("model");
    std::fs::create_dir(&model).unwrap();
    let hf = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/gpt2-tiny");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(hf.join(f), model.join(f)).unwrap();
    }
    std::fs::copy(
        Path::new(FIXTURES).join(tokenizer),
        model.join("tokenizer.json"),
    )
    .unwrap();
    model
}

#[test]
fn model_dir_supplies_the_tokenizer_and_must_hold_its_vocabulary() {
    let dir = tempfile::tempdir().unwrap();
    copy(dir.path(), "a.txt");
    copy(dir.path(), "b.jsonl");
    // 300 ids, as many as the model's rows.
    model_dir(dir.path(), "tokenizer_regex.json");
    let out = train(
        dir.path(),
        &["--model-dir", "model", "--data", "a.txt", "b.jsonl"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "train failed: {stderr}");
    assert!(
        stderr.contains("258 tokens") && stderr.contains("model/tokenizer.json"),
        "{stderr}"
    );

    // 457 ids do not fit the model's 300 rows.
    let other = tempfile::tempdir().unwrap();
    copy(other.path(), "a.txt");
    model_dir(other.path(), "tokenizer.json");
    let out = train(other.path(), &["--model-dir", "model", "--data", "a.txt"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("vocab_size 300 is smaller than the tokenizer's vocabulary 457"),
        "{stderr}"
    );
}
