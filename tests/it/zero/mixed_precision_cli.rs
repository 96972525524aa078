//! `zerodp train` with the config's `bf16` and `fp16` blocks: the metrics lines carry the loss
//! scale, the skip flag and a nonzero fp32 master.

use std::process::Command;

fn train(precision_block: &str, stage: u8) -> Vec<serde_json::Value> {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("ds.json");
    std::fs::write(
        &config,
        format!(
            r#"{{ "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
                 "optimizer": {{ "type": "AdamW", "params": {{ "lr": 3e-3 }} }},
                 {precision_block},
                 "zero_optimization": {{ "stage": {stage} }} }}"#
        ),
    )
    .unwrap();
    train_file(&config, dir.path(), 3)
}

/// `steps` steps of the tiny GPT at world size 2 with `config`; the metrics lines.
fn train_file(
    config: &std::path::Path,
    dir: &std::path::Path,
    steps: u32,
) -> Vec<serde_json::Value> {
    let text = dir.join("text.txt");
    std::fs::write(
        &text,
        "to be or not to be, that is the question. ".repeat(200),
    )
    .unwrap();
    let metrics = dir.join("m.jsonl");
    let out = Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(["train", "--config"])
        .arg(config)
        .args(["--world-size", "2", "--model", "tiny", "--steps"])
        .arg(steps.to_string())
        .args(["--no-progress", "--max-skipped-steps", "3", "--data"])
        .arg(&text)
        .arg("--metrics")
        .arg(&metrics)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "train failed: {stderr}");
    std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn bf16_and_fp16_blocks_train_with_an_fp32_master() {
    for (block, scale) in [
        (r#""bf16": { "enabled": true }"#, 1.0),
        // No dynamic key given: the documented 2^16, not DeepSpeed's hidden 2^32.
        (r#""fp16": { "enabled": true }"#, 65536.0),
        (r#""fp16": { "enabled": true, "loss_scale": 128 }"#, 128.0),
    ] {
        let lines = train(block, 2);
        assert_eq!(lines.len(), 6, "{block}");
        for l in &lines {
            assert_eq!(l["loss_scale"], scale, "{block}");
            assert_eq!(l["skipped"], false, "{block}");
            let m = &l["model_state_bytes"];
            let psi = l["num_params"].as_u64().unwrap();
            // Stage 2, N = 2: 16-bit params in full, the fp32 master of half of them.
            assert!(m["params"].as_u64().unwrap() < 3 * psi, "{block}: {m}");
            assert!(m["master"].as_u64().unwrap() >= 2 * psi, "{block}: {m}");
            assert!(l["loss"].as_f64().unwrap().is_finite());
        }
    }
}

#[test]
fn fp32_metrics_report_no_scale_and_no_master() {
    let lines = train(r#""bf16": { "enabled": false }"#, 1);
    for l in &lines {
        assert_eq!(l["loss_scale"], 1.0);
        assert_eq!(l["skipped"], false);
        assert_eq!(l["model_state_bytes"]["master"], 0);
    }
}

#[test]
fn the_mixed_precision_examples_train() {
    for (name, scale) in [("stage2_bf16.json", 1.0), ("stage2_fp16.json", 65536.0)] {
        let dir = tempfile::tempdir().unwrap();
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("examples")
            .join(name);
        let lines = train_file(&path, dir.path(), 3);
        assert_eq!(lines.len(), 6, "{name}");
        assert!(lines.iter().all(|l| l["loss_scale"] == scale), "{name}");
        assert!(lines.iter().all(|l| l["model_state_bytes"]["master"] != 0));
    }
}

#[test]
fn fp16_overflows_skip_steps_halve_the_scale_and_hold_the_scheduler() {
    // 2^20 overflows the tiny GPT's fp16 gradients: the first steps are skipped while the scale
    // halves (hysteresis 1), and the warmup schedule waits for the first applied step.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("ds.json");
    std::fs::write(
        &config,
        r#"{ "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
             "optimizer": { "type": "AdamW", "params": { "lr": 1e-3 } },
             "scheduler": { "type": "WarmupLR", "params": { "warmup_min_lr": 1e-4,
                 "warmup_max_lr": 1e-3, "warmup_num_steps": 100, "warmup_type": "linear" } },
             "fp16": { "enabled": true, "initial_scale_power": 20, "hysteresis": 1 },
             "zero_optimization": { "stage": 2 } }"#,
    )
    .unwrap();
    let lines: Vec<_> = train_file(&config, dir.path(), 10)
        .into_iter()
        .filter(|l| l["rank"] == 0)
        .collect();
    let skipped = lines.iter().filter(|l| l["skipped"] == true).count();
    assert!((1..10).contains(&skipped), "{skipped} of 10 skipped");
    // The lr is a function of the applied steps before it (DeepSpeed: skipped steps do not step
    // the scheduler): by_applied[k] is the lr after k applied steps.
    let mut by_applied: Vec<f64> = Vec::new();
    let mut applied = 0;
    for w in lines.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        let (sa, sb) = (
            a["loss_scale"].as_f64().unwrap(),
            b["loss_scale"].as_f64().unwrap(),
        );
        if a["skipped"] == true {
            assert_eq!(sb, sa / 2.0, "an overflow halves the scale: {a} {b}");
            assert!(a["grad_norm"].is_null());
        }
    }
    for l in &lines {
        let lr = l["lr"].as_f64().unwrap();
        match by_applied.get(applied) {
            Some(&seen) => assert_eq!(lr, seen, "step {}", l["step"]),
            None => by_applied.push(lr),
        }
        if l["skipped"] == false {
            applied += 1;
        }
    }
    assert!(by_applied.len() >= 3, "{by_applied:?}");
    // WarmupLR: the first two applied steps run at warmup_min_lr, then the lr rises.
    assert!(
        by_applied[1..].windows(2).all(|w| w[1] > w[0]),
        "{by_applied:?}"
    );
    assert!((lines[0]["lr"].as_f64().unwrap() - 1e-4).abs() < 1e-9);
}
