//! `zerodp train` on chat and instruction JSONL (issue 44): recognised without a flag, one
//! example per row with the loss on the answers only, a step's loss the mean over the global
//! batch's trained tokens: the same at every world size and stage.

use serde_json::Value;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat")
}

/// Rank 0's `(loss, eval_loss)` per step of a run on `data` at `world` ranks with `config`.
fn run(dir: &Path, data: &str, world: &str, config: &str) -> Vec<(f64, Option<f64>)> {
    let metrics = dir.join(format!("m-{world}-{data}.jsonl"));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args([
            "train",
            "--config",
            config,
            "--world-size",
            world,
            "--model",
            "tiny",
        ])
        .args([
            "--context",
            "256",
            "--steps",
            "4",
            "--no-progress",
            "--tokenizer",
        ])
        .arg(fixtures().join("chatml/tokenizer.json"))
        .arg("--data")
        .arg(fixtures().join(data))
        .args(["--eval-split", "0.25", "--eval-every", "2", "--metrics"])
        .arg(&metrics)
        .current_dir(dir)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("examples)"),
        "the banner counts examples: {err}"
    );
    std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|l| l["rank"] == 0)
        .map(|l| (l["loss"].as_f64().unwrap(), l["eval_loss"].as_f64()))
        .collect()
}

#[test]
fn chat_data_trains_to_the_same_losses_at_every_world_size_and_stage() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let write = |name: &str, text: &str| std::fs::write(d.join(name), text).unwrap();
    let opt = r#""optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}"#;
    write(
        "one.json",
        &format!(
            r#"{{"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, {opt}, "zero_optimization": {{"stage": 0}}}}"#
        ),
    );
    write(
        "two.json",
        &format!(
            r#"{{"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, {opt}, "zero_optimization": {{"stage": 3, "stage3_param_persistence_threshold": 0}}}}"#
        ),
    );
    for data in ["messages.jsonl", "prompt_completion.jsonl"] {
        let base = run(d, data, "1", "one.json");
        let other = run(d, data, "2", "two.json");
        assert_eq!(base.len(), 4);
        assert_eq!(
            base.iter().filter(|(_, e)| e.is_some()).count(),
            2,
            "eval at steps 2 and 4"
        );
        for ((a, ea), (b, eb)) in base.iter().zip(&other) {
            assert!(
                (a - b).abs() <= 1e-5 * a.abs(),
                "{data}: {base:?} vs {other:?}"
            );
            if let (Some(ea), Some(eb)) = (ea, eb) {
                assert!(
                    (ea - eb).abs() <= 1e-6 * ea.abs(),
                    "{data}: eval {ea} vs {eb}"
                );
            }
        }
    }
}

#[test]
fn mixed_or_too_long_chat_data_is_refused_naming_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("c.json"), r#"{"train_batch_size": 1}"#).unwrap();
    std::fs::write(d.join("text.jsonl"), "{\"text\": \"plain text\"}\n").unwrap();
    let train = |extra: &[&str], data: &[PathBuf]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_zerodp"))
            .args([
                "train", "--config", "c.json", "--model", "tiny", "--steps", "1",
            ])
            .arg("--tokenizer")
            .arg(fixtures().join("chatml/tokenizer.json"))
            .args(extra)
            .arg("--data")
            .args(data)
            .current_dir(d)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let chat = fixtures().join("messages.jsonl");
    let (ok, err) = train(&["--context", "256"], &[chat.clone(), d.join("text.jsonl")]);
    assert!(!ok && err.contains("one kind at a time"), "{err}");
    let (ok, err) = train(&["--context", "32"], std::slice::from_ref(&chat));
    assert!(
        !ok && err.contains("line 1") && err.contains("--max-example-tokens"),
        "{err}"
    );
    let (ok, err) = train(&["--context", "32", "--max-example-tokens", "33"], &[chat]);
    assert!(ok, "cut to the row: {err}");
}
