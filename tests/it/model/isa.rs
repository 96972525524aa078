//! `ZERODP_ISA` (issue 46): one cap on every kernel's dispatch, so that an AVX-512 machine runs
//! what an AVX2 server or a portable build runs. The kernels keep their bits across paths, so a
//! run's losses are the same under every cap; a misspelt cap is refused.

use std::process::Command;

/// Rank 0's losses of 4 steps of the tiny GPT at stage 3 on 2 ranks (bf16 when `bf16`), under
/// `ZERODP_ISA=isa`, and what the run said.
fn losses(dir: &std::path::Path, isa: &str, bf16: bool) -> (Vec<f64>, String) {
    let config = dir.join(format!("c{bf16}.json"));
    let mixed = if bf16 {
        r#", "bf16": {"enabled": true}"#
    } else {
        ""
    };
    std::fs::write(
        &config,
        format!(
            r#"{{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                "zero_optimization": {{"stage": 3}}{mixed}}}"#
        ),
    )
    .unwrap();
    let metrics = dir.join(format!("m-{isa}-{bf16}.jsonl"));
    let out = Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .env("ZERODP_ISA", isa)
        .args([
            "train",
            "--model",
            "tiny",
            "--world-size",
            "2",
            "--steps",
            "4",
        ])
        .args(["--no-progress", "--config"])
        .arg(&config)
        .arg("--data")
        .arg(dir.join("t.txt"))
        .arg("--metrics")
        .arg(&metrics)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{isa}: {stderr}");
    let losses = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|l| l["rank"] == 0)
        .map(|l| l["loss"].as_f64().unwrap())
        .collect();
    (losses, stderr)
}

#[test]
fn every_cap_trains_to_the_same_losses_and_a_bad_one_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let text = "to be or not to be, that is the question. ".repeat(300);
    std::fs::write(dir.path().join("t.txt"), text).unwrap();
    for bf16 in [false, true] {
        let (base, _) = losses(dir.path(), "", bf16);
        let (avx2, stderr) = losses(dir.path(), "avx2", bf16);
        assert!(stderr.contains("ZERODP_ISA=avx2 holds"), "{stderr}");
        let (portable, _) = losses(dir.path(), "portable", bf16);
        // Below AVX-512 a bf16 run's products are f32 rather than AVX512-BF16's (bf16 operands,
        // f32 sums): the bf16 tolerance there; everything else keeps its bits.
        let avx512_bf16 = bf16 && zerodp::model::bf16_products_available();
        let wide = if avx512_bf16 { 1e-4 } else { 1e-6 };
        assert_eq!(avx2.len(), 4);
        for ((a, p), b) in avx2.iter().zip(&portable).zip(&base) {
            assert!(
                (a - p).abs() <= 1e-6 * p.abs(),
                "bf16 {bf16}: {avx2:?} vs {portable:?}"
            );
            assert!(
                (a - b).abs() <= wide * b.abs(),
                "bf16 {bf16}: {avx2:?} vs {base:?}"
            );
        }
    }
    let out = Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .env("ZERODP_ISA", "sse9")
        .args(["plan", "--params", "1e9"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("ZERODP_ISA=\"sse9\" names no instruction set"),
        "{stderr}"
    );
}
