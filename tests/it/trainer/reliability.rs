//! `zerodp train` against careless input and a hostile machine: outputs that are inputs, signals,
//! a full disk for the metrics, non-finite initial weights, runs that train nothing. Each case
//! checks the message and that no input changed.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

struct Setup {
    dir: tempfile::TempDir,
    text: PathBuf,
    config: PathBuf,
}

fn setup(config: &str) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("text.txt");
    std::fs::write(
        &text,
        "to be or not to be, that is the question. ".repeat(200),
    )
    .unwrap();
    let path = dir.path().join("ds.json");
    std::fs::write(&path, config).unwrap();
    Setup {
        dir,
        text,
        config: path,
    }
}

const STAGE2: &str = r#"{ "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
    "optimizer": { "type": "AdamW", "params": { "lr": 1e-3 } },
    "zero_optimization": { "stage": 2 } }"#;

fn train(s: &Setup, extra: &[&std::ffi::OsStr]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_zerodp"));
    c.args([
        "train",
        "--world-size",
        "2",
        "--model",
        "tiny",
        "--no-progress",
    ])
    .arg("--config")
    .arg(&s.config)
    .arg("--data")
    .arg(&s.text)
    .args(extra);
    c
}

fn os(s: &str) -> &std::ffi::OsStr {
    s.as_ref()
}

fn run(s: &Setup, extra: &[&std::ffi::OsStr]) -> (Output, String) {
    let out = train(s, extra).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, err)
}

fn snapshot(paths: &[&Path]) -> Vec<Vec<u8>> {
    paths.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

/// Weights of the tiny GPT, trained one step (a valid `--init` file).
fn weights(s: &Setup) -> PathBuf {
    let w = s.dir.path().join("w.safetensors");
    let (out, err) = run(s, &[os("--steps"), os("1"), os("--save"), w.as_os_str()]);
    assert!(out.status.success(), "{err}");
    w
}

#[test]
fn an_output_that_is_an_input_is_refused_before_any_work() {
    let s = setup(STAGE2);
    let init = weights(&s);
    let before = snapshot(&[&init, &s.text, &s.config]);
    let cases: [(&str, &Path, &str); 4] = [
        ("--metrics", &init, "is the same file as --init"),
        ("--save", &s.text, "is the same file as --data"),
        ("--metrics", &s.config, "is the same file as --config"),
        ("--save", &init, "is the same file as --init"),
    ];
    for (flag, path, expect) in cases {
        let (out, err) = run(
            &s,
            &[
                os("--steps"),
                os("2"),
                os("--init"),
                init.as_os_str(),
                os(flag),
                path.as_os_str(),
            ],
        );
        assert_eq!(out.status.code(), Some(1), "{flag} {err}");
        assert!(err.contains(expect), "{flag}: {err}");
        assert!(
            !err.contains("pre-flight"),
            "refused before the pre-flight: {err}"
        );
    }
    assert_eq!(snapshot(&[&init, &s.text, &s.config]), before);
}

#[test]
fn a_save_in_a_missing_directory_is_refused_before_the_first_step() {
    let s = setup(STAGE2);
    let save = s.dir.path().join("no").join("such").join("w.safetensors");
    let started = Instant::now();
    let (out, err) = run(
        &s,
        &[os("--steps"), os("500"), os("--save"), save.as_os_str()],
    );
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("does not exist"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "it trained first"
    );
}

#[test]
fn sigterm_during_a_two_rank_run_ends_it_cleanly() {
    let s = setup(STAGE2);
    let metrics = s.dir.path().join("m.jsonl");
    let save = s.dir.path().join("w.safetensors");
    let child = train(
        &s,
        &[
            os("--steps"),
            os("100000"),
            os("--metrics"),
            metrics.as_os_str(),
            os("--save"),
            save.as_os_str(),
        ],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count()) < 4 {
        assert!(Instant::now() < deadline, "no metrics lines");
        std::thread::sleep(Duration::from_millis(50));
    }
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(143), "{err}");
    assert!(err.contains("interrupted by SIGTERM"), "{err}");
    let text = std::fs::read_to_string(&metrics).unwrap();
    assert!(text.ends_with('\n'));
    let steps: Vec<u64> = text
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect();
    // Both ranks stopped after the same step.
    let last = *steps.iter().max().unwrap();
    assert_eq!(steps.iter().filter(|&&s| s == last).count(), 2, "{text}");
    // Nothing half-written is left: no save at all, no temporary files.
    let names: Vec<String> = std::fs::read_dir(s.dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!save.exists());
    assert!(
        names
            .iter()
            .all(|n| !n.contains("tmp") && !n.contains("probe")),
        "{names:?}"
    );
}

#[test]
fn non_finite_initial_weights_are_refused_naming_the_tensor() {
    use zerodp::model::{load_safetensors, save_safetensors, GptConfig, GptModel};
    use zerodp::zero::UnitModel;
    let s = setup(STAGE2);
    let init = weights(&s);
    let model = GptModel::new(GptConfig::tiny()).unwrap();
    let mut params = load_safetensors(&init, model.spec()).unwrap();
    params[1][5] = f32::NAN;
    let bad = s.dir.path().join("bad.safetensors");
    let slices: Vec<&[f32]> = params.iter().map(Vec::as_slice).collect();
    save_safetensors(&bad, model.spec(), &slices).unwrap();
    let before = snapshot(&[&bad]);
    let (out, err) = run(&s, &[os("--steps"), os("2"), os("--init"), bad.as_os_str()]);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("tensor h.0.ln_1.weight holds NaN at flat index 5"),
        "{err}"
    );
    assert_eq!(snapshot(&[&bad]), before);
}

#[test]
fn a_run_whose_every_step_was_skipped_exits_non_zero() {
    // fp16 with a static loss scale far past fp16's range: every gradient overflows, every step
    // is skipped, and nothing is trained.
    let s = setup(
        r#"{ "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
             "fp16": { "enabled": true, "loss_scale": 1e30 },
             "zero_optimization": { "stage": 1 } }"#,
    );
    let save = s.dir.path().join("w.safetensors");
    let (out, err) = run(
        &s,
        &[os("--steps"), os("3"), os("--save"), save.as_os_str()],
    );
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("every one of the 3 steps was skipped"),
        "{err}"
    );
    assert!(!save.exists(), "nothing trained, nothing saved");
}

#[test]
fn a_full_disk_for_the_metrics_keeps_training_and_whole_lines() {
    let s = setup(STAGE2);
    let mnt = s.dir.path().join("small");
    std::fs::create_dir(&mnt).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=8k", "tmpfs"])
        .arg(&mnt)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        eprintln!("skipped: cannot mount a small tmpfs here (needs root)");
        return;
    }
    let metrics = mnt.join("m.jsonl");
    let save = s.dir.path().join("w.safetensors");
    let (out, err) = run(
        &s,
        &[
            os("--steps"),
            os("20"),
            os("--metrics"),
            metrics.as_os_str(),
            os("--save"),
            save.as_os_str(),
        ],
    );
    let text = std::fs::read_to_string(&metrics).unwrap_or_default();
    let _ = Command::new("umount").arg(&mnt).status();
    assert!(out.status.success(), "{err}");
    assert!(err.contains("warning: metrics file"), "{err}");
    assert_eq!(
        err.matches("warning: metrics file").count(),
        1,
        "warned once: {err}"
    );
    assert!(save.exists(), "training went on and saved");
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        !lines.is_empty() && lines.len() < 40,
        "{} lines",
        lines.len()
    );
    assert!(text.ends_with('\n'));
    for l in lines {
        serde_json::from_str::<serde_json::Value>(l).unwrap();
    }
}
