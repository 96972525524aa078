//! `zerodp train`'s pre-flight check: a run that cannot fit in `--device-memory` is refused before
//! any rank starts, with the planner's explanation; a run that fits starts as before.

use std::path::Path;
use std::process::{Command, Output};

fn train(dir: &Path, stage: u8, extra: &[&str]) -> Output {
    let text = dir.join("text.txt");
    std::fs::write(
        &text,
        "to be or not to be, that is the question. ".repeat(50),
    )
    .unwrap();
    let config = dir.join(format!("ds{stage}.json"));
    std::fs::write(
        &config,
        format!(
            r#"{{ "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
                 "zero_optimization": {{ "stage": {stage}, "reduce_bucket_size": 1000 }} }}"#
        ),
    )
    .unwrap();
    Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(["train", "--config"])
        .arg(&config)
        .args([
            "--world-size",
            "2",
            "--model",
            "tiny",
            "--steps",
            "1",
            "--no-progress",
        ])
        .arg("--data")
        .arg(&text)
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn a_run_that_cannot_fit_is_refused_with_the_planners_explanation() {
    let dir = tempfile::tempdir().unwrap();
    // The tiny GPT (~34K parameters) on 2 ranks with 1000-element buckets: stage 0 needs about
    // 760 KB per rank (547 KB of model states, 4 KB of buckets, 213 KB of activations), stage 1
    // about 630 KB.
    let out = train(dir.path(), 0, &["--device-memory", "700KB"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("pre-flight check"), "{stderr}");
    assert!(stderr.contains("stage 0 needs"), "{stderr}");
    assert!(stderr.contains("--device-memory"), "{stderr}");
    // Bytes by kind, and where to go instead.
    for kind in [
        "params",
        "grads",
        "Adam m+v",
        "reduce buckets",
        "activations",
    ] {
        assert!(stderr.contains(kind), "{kind} missing: {stderr}");
    }
    assert!(
        stderr.contains("the lowest stage that fits: stage 1"),
        "{stderr}"
    );
    assert!(
        stderr.contains("zero_optimization.stage = 1"),
        "config advice missing: {stderr}"
    );
    // Refused before any rank ran a step.
    assert!(!stderr.contains("done:"), "{stderr}");

    // Nothing fits in 10 KB.
    let out = train(dir.path(), 3, &["--device-memory", "10KB"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("no ZeRO stage fits"), "{stderr}");
}

#[test]
fn a_run_that_fits_starts_and_says_what_it_needs() {
    let dir = tempfile::tempdir().unwrap();
    let out = train(dir.path(), 1, &["--device-memory", "700KB"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("pre-flight: ZeRO stage 1 needs"),
        "{stderr}"
    );
    assert!(stderr.contains("done: 1 steps"), "{stderr}");
    // The default capacity is this machine's memory shared by the ranks.
    let out = train(dir.path(), 0, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("this machine's memory / --world-size"),
        "{stderr}"
    );
}
