//! `zerodp train` end to end: a tiny GPT on a generated text, metrics lines checked.

use std::process::Command;

#[test]
fn train_writes_one_metrics_line_per_step_and_rank() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("text.txt");
    std::fs::write(
        &text,
        "to be or not to be, that is the question. ".repeat(200),
    )
    .unwrap();
    let config = dir.path().join("ds.json");
    std::fs::write(
        &config,
        r#"{ "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
             "optimizer": { "type": "AdamW", "params": { "lr": 3e-3 } },
             "gradient_clipping": 1.0,
             "zero_optimization": { "stage": 3, "stage3_max_reuse_distance": 0,
                                    "stage3_param_persistence_threshold": 0 } }"#,
    )
    .unwrap();
    let metrics = dir.path().join("m.jsonl");
    let saved = dir.path().join("w.safetensors");
    let out = Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(["train", "--config"])
        .arg(&config)
        .args([
            "--world-size",
            "2",
            "--model",
            "tiny",
            "--steps",
            "4",
            "--no-progress",
        ])
        .arg("--data")
        .arg(&text)
        .arg("--metrics")
        .arg(&metrics)
        .arg("--save")
        .arg(&saved)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "train failed: {stderr}");
    assert!(saved.exists());
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 8, "4 steps x 2 ranks");
    for step in 1..=4u64 {
        let of_step: Vec<_> = lines.iter().filter(|l| l["step"] == step).collect();
        assert_eq!(of_step.len(), 2);
        assert_eq!(
            of_step[0]["loss"], of_step[1]["loss"],
            "the loss is the global-batch mean"
        );
        for l in of_step {
            assert_eq!(l["world_size"], 2);
            assert_eq!(l["stage"], 3);
            assert!(l["num_params"].as_u64().unwrap() > 30_000);
            let m = &l["model_state_bytes"];
            let parts: u64 = [
                "params",
                "grads",
                "master",
                "optimizer_states",
                "buffers",
                "gather",
            ]
            .iter()
            .map(|k| m[k].as_u64().unwrap())
            .sum();
            assert_eq!(m["total"].as_u64().unwrap(), parts);
            assert!(l["peak_bytes"].as_u64().unwrap() >= parts);
            for kind in ["all_reduce", "reduce_scatter", "all_gather", "broadcast"] {
                assert!(l["sent_bytes"][kind].is_u64() && l["recv_bytes"][kind].is_u64());
            }
            assert!(l["sent_bytes"]["reduce_scatter"].as_u64().unwrap() > 0);
            assert!(l["tokens_per_s"].as_f64().unwrap() > 0.0);
            // The phases are parts of the step: each measured, together within its time.
            let phases: f64 = ["forward", "recompute", "backward", "comm", "optimizer"]
                .iter()
                .map(|k| l["phase_s"][k].as_f64().unwrap())
                .sum();
            assert!(l["phase_s"]["optimizer"].as_f64().unwrap() > 0.0);
            assert_eq!(l["device_tier_bytes"], 0, "no GPU: the host holds the tier");
            assert!(phases <= l["step_time_s"].as_f64().unwrap() * 1.001);
            assert!(l["grad_norm"].as_f64().unwrap() > 0.0);
            assert!((l["lr"].as_f64().unwrap() - 3e-3).abs() < 1e-9);
        }
    }
}

#[test]
fn train_without_the_demo_corpus_says_how_to_get_it() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("ds.json");
    std::fs::write(&config, r#"{ "train_batch_size": 2 }"#).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .current_dir(dir.path())
        .args(["train", "--config"])
        .arg(&config)
        .args(["--model", "tiny", "--steps", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("scripts/fetch_corpus.sh"), "{stderr}");
}

/// `wall_clock_breakdown`: rank 0's phase times, DeepSpeed's `time (ms) | ...` line, at every
/// `steps_per_print` steps (and only there), with the phases adding up to no more than the step.
#[test]
fn wall_clock_breakdown_prints_the_phases_at_steps_per_print() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("text.txt");
    std::fs::write(&text, "a rose is a rose is a rose. ".repeat(200)).unwrap();
    let config = dir.path().join("ds.json");
    std::fs::write(
        &config,
        r#"{ "train_batch_size": 4, "steps_per_print": 2, "wall_clock_breakdown": true,
             "zero_optimization": { "stage": 3 } }"#,
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(["train", "--config"])
        .arg(&config)
        .args(["--world-size", "2", "--model", "tiny", "--steps", "5"])
        .args(["--no-progress", "--data"])
        .arg(&text)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "train failed: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| l.contains("time (ms)")).collect();
    assert_eq!(lines.len(), 2, "steps 2 and 4: {stderr}");
    for (line, step) in lines.iter().zip([2, 4]) {
        assert!(
            line.starts_with(&format!("step {step} time (ms) | fwd: ")),
            "{line}"
        );
        let ms: Vec<f64> = line
            .split('|')
            .skip(1)
            .map(|f| f.trim().rsplit(' ').next().unwrap().parse().unwrap())
            .collect();
        let (phases, total) = (&ms[..5], ms[5]);
        assert!(phases.iter().all(|&t| t >= 0.0) && total > 0.0, "{line}");
        assert!(phases.iter().sum::<f64>() <= total * 1.01 + 0.05, "{line}");
    }
}
