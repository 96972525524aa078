//! Checkpoints from the command line: SIGTERM saves the last completed step and the run resumes
//! exactly; SIGKILL at any moment of a save leaves `latest` naming a complete, verified
//! checkpoint; `ckpt consolidate` writes weights that `--init` loads.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

struct Setup {
    dir: tempfile::TempDir,
    text: PathBuf,
    config: PathBuf,
}

fn setup() -> Setup {
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
             "optimizer": { "type": "AdamW", "params": { "lr": 1e-3 } },
             "scheduler": { "type": "WarmupLR", "params": { "warmup_num_steps": 50 } },
             "bf16": { "enabled": true },
             "zero_optimization": { "stage": 3 } }"#,
    )
    .unwrap();
    Setup { dir, text, config }
}

fn train(s: &Setup, args: &[&str], paths: &[(&str, &Path)]) -> Command {
    train_with_data(s, &s.text, args, paths)
}

/// [`train`] on `data` instead of the setup's text.
fn train_with_data(s: &Setup, data: &Path, args: &[&str], paths: &[(&str, &Path)]) -> Command {
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
    .arg(data)
    .args(args);
    for (flag, p) in paths {
        c.arg(flag).arg(p);
    }
    c
}

/// `(step, rank) -> loss` of a metrics file.
fn losses(path: &Path) -> Vec<(u64, u64, f64)> {
    let mut v: Vec<(u64, u64, f64)> = std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let j: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                j["step"].as_u64().unwrap(),
                j["rank"].as_u64().unwrap(),
                j["loss"].as_f64().unwrap(),
            )
        })
        .collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v
}

fn wait_for_lines(path: &Path, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while std::fs::read_to_string(path).map_or(0, |t| t.lines().count()) < n {
        assert!(Instant::now() < deadline, "no metrics");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sigterm_saves_the_last_step_and_the_run_resumes_exactly() {
    let s = setup();
    let ckpt = s.dir.path().join("ckpt");
    let straight_m = s.dir.path().join("straight.jsonl");
    let out = train(&s, &["--steps", "40"], &[("--metrics", &straight_m)])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let straight = losses(&straight_m);

    let first_m = s.dir.path().join("first.jsonl");
    let child = train(
        &s,
        &["--steps", "100000"],
        &[("--metrics", &first_m), ("--save-dir", &ckpt)],
    )
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    wait_for_lines(&first_m, 6);
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(143), "{err}");
    assert!(
        err.contains("checkpoint of the last step is saved"),
        "{err}"
    );
    let first = losses(&first_m);
    let stopped_at = first.last().unwrap().0;
    let latest = std::fs::read_to_string(ckpt.join("latest")).unwrap();
    assert_eq!(latest, format!("step{stopped_at:06}"));
    eprintln!("stopped at step {stopped_at}");
    if stopped_at >= 40 {
        return; // the machine was too slow to stop before the comparison's end; nothing to resume
    }

    let resumed_m = s.dir.path().join("resumed.jsonl");
    let out = train(
        &s,
        &["--steps", "40", "--resume"],
        &[("--metrics", &resumed_m), ("--save-dir", &ckpt)],
    )
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains(&format!("at step {stopped_at}")), "{err}");
    let resumed = losses(&resumed_m);
    // Steps stopped_at+1..=12, numbered as in the unbroken run, with its exact losses.
    assert_eq!(resumed.first().unwrap().0, stopped_at + 1);
    assert_eq!(resumed, straight[2 * stopped_at as usize..]);
    assert_eq!(first, straight[..first.len()]);
}

#[test]
fn sigkill_during_saves_always_leaves_a_loadable_latest() {
    let s = setup();
    let ckpt = s.dir.path().join("ckpt");
    for (i, delay_ms) in [60u64, 90, 130, 170, 230, 300, 400, 520].iter().enumerate() {
        let mut child = train(
            &s,
            &["--steps", "100000", "--save-every", "1", "--keep-last", "2"],
            &[("--save-dir", &ckpt)],
        )
        .args(if i > 0 && ckpt.join("latest").exists() {
            vec!["--resume"]
        } else {
            vec![]
        })
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
        std::thread::sleep(Duration::from_millis(*delay_ms));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        if !ckpt.join("latest").exists() {
            continue;
        }
        let out = Command::new(env!("CARGO_BIN_EXE_zerodp"))
            .args(["ckpt", "inspect"])
            .arg(&ckpt)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "kill {i}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert!(ckpt.join("latest").exists(), "no save completed in any run");
}

#[test]
fn consolidated_weights_load_with_init() {
    let s = setup();
    let ckpt = s.dir.path().join("ckpt");
    let saved = s.dir.path().join("saved.safetensors");
    let out = train(
        &s,
        &["--steps", "3"],
        &[("--save-dir", &ckpt), ("--save", &saved)],
    )
    .output()
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let full = s.dir.path().join("full.safetensors");
    let out = Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(["ckpt", "consolidate"])
        .arg(&ckpt)
        .arg(&full)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // `--save` writes the fp32 master weights: the consolidated file holds the same tensors.
    use zerodp::model::{load_safetensors, GptConfig, GptModel};
    use zerodp::zero::UnitModel;
    let model = GptModel::new(GptConfig::tiny()).unwrap();
    assert_eq!(
        load_safetensors(&full, model.spec()).unwrap(),
        load_safetensors(&saved, model.spec()).unwrap()
    );
    let out = train(&s, &["--steps", "1"], &[("--init", &full)])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_full_disk_during_a_save_fails_clearly_and_keeps_the_last_checkpoint() {
    let s = setup();
    let mnt = s.dir.path().join("small");
    std::fs::create_dir(&mnt).unwrap();
    // Room for a few checkpoints of the tiny GPT (about 0.7 MB each), not for twenty.
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=3m", "tmpfs"])
        .arg(&mnt)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        eprintln!("skipped: cannot mount a small tmpfs here (needs root)");
        return;
    }
    let ckpt = mnt.join("ckpt");
    let out = train(
        &s,
        &["--steps", "20", "--save-every", "1"],
        &[("--save-dir", &ckpt)],
    )
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let inspect = Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(["ckpt", "inspect"])
        .arg(&ckpt)
        .output()
        .unwrap();
    let latest = std::fs::read_to_string(ckpt.join("latest")).unwrap_or_default();
    let leftovers: Vec<String> = std::fs::read_dir(&ckpt)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(".tmp"))
                .collect()
        })
        .unwrap_or_default();
    let _ = Command::new("umount").arg(&mnt).status();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("No space left on device"), "{err}");
    assert!(
        latest.starts_with("step"),
        "a checkpoint was saved before the disk filled"
    );
    assert!(
        inspect.status.success(),
        "the last complete checkpoint verifies: {}",
        String::from_utf8_lossy(&inspect.stdout)
    );
    assert!(
        leftovers.is_empty(),
        "the failed save left {leftovers:?}; the run said:\n{err}"
    );
}

/// [`train_with_data`], run to the end.
fn train_on(s: &Setup, data: &Path, args: &[&str]) -> std::process::Output {
    train_with_data(s, data, args, &[]).output().unwrap()
}

/// Checkpoints record the data they were trained on (the SHA-256 of its token stream, each id as
/// 4 little-endian bytes); resuming on the same text says nothing, on other text warns naming
/// both, and trains on.
#[test]
fn checkpoints_record_their_data_and_a_resume_on_other_data_says_so() {
    use sha2::{Digest, Sha256};
    let s = setup();
    let save = s.dir.path().join("ckpt");
    let save_arg = save.to_str().unwrap();
    let out = train_on(&s, &s.text, &["--steps", "2", "--save-dir", save_arg]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let latest = std::fs::read_to_string(save.join("latest")).unwrap();
    let manifest: serde_json::Value = serde_json::from_slice(
        &std::fs::read(save.join(latest.trim()).join("manifest.json")).unwrap(),
    )
    .unwrap();
    let text = std::fs::read(&s.text).unwrap();
    let ids: Vec<u8> = text
        .iter()
        .flat_map(|&b| u32::from(b).to_le_bytes())
        .collect();
    let want: String = Sha256::digest(&ids)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let record = &manifest["config"]["zerodp_data"];
    assert_eq!(record["sha256"], want.as_str(), "{record}");
    assert_eq!(record["tokens"], text.len());

    let same = train_on(
        &s,
        &s.text,
        &["--steps", "3", "--save-dir", save_arg, "--resume"],
    );
    let err = String::from_utf8_lossy(&same.stderr);
    assert!(same.status.success(), "{err}");
    assert!(!err.contains("was trained on"), "{err}");

    let other = s.dir.path().join("other.txt");
    std::fs::write(
        &other,
        "a different text altogether, with other words. ".repeat(200),
    )
    .unwrap();
    let moved = train_on(
        &s,
        &other,
        &["--steps", "4", "--save-dir", save_arg, "--resume"],
    );
    let err = String::from_utf8_lossy(&moved.stderr);
    assert!(moved.status.success(), "{err}");
    assert!(
        err.contains("was trained on") && err.contains("text.txt"),
        "{err}"
    );
    assert!(err.contains("other.txt"), "{err}");
}
