//! No command destroys a checkpoint: every writer refuses an output inside or on a checkpoint
//! before any work (exit 1, naming both paths, every byte left as it was); outputs are renamed
//! into place, so a failed write leaves the previous file; one run owns a `--save-dir` while it
//! runs, and a lock left by a killed run is taken over.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const LOCK: &str = ".zerodp.lock";

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
             "bf16": { "enabled": true },
             "zero_optimization": { "stage": 3 } }"#,
    )
    .unwrap();
    Setup { dir, text, config }
}

fn zerodp() -> Command {
    Command::new(env!("CARGO_BIN_EXE_zerodp"))
}

/// `zerodp train` on the tiny GPT, two in-process ranks.
fn train(s: &Setup, args: &[&str], paths: &[(&str, &Path)]) -> Command {
    let mut c = zerodp();
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
    .args(args);
    for (flag, p) in paths {
        c.arg(flag).arg(p);
    }
    c
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn assert_ok(out: &Output) {
    assert!(out.status.success(), "{}", stderr(out));
}

/// Exit status 1 with an `error:` line that says each of `expected`, and no panic.
fn assert_refused(out: &Output, expected: &[&str]) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("error: ") && !err.contains("panicked"),
        "{err}"
    );
    for e in expected {
        assert!(err.contains(e), "{e:?} missing from: {err}");
    }
}

/// Every file under `dir` (recursively), with its bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let path = e.unwrap().path();
            if path.is_dir() {
                todo.push(path);
            } else {
                files.insert(path.clone(), std::fs::read(&path).unwrap());
            }
        }
    }
    files
}

fn inspect(ck: &Path) -> Output {
    zerodp().args(["ckpt", "inspect"]).arg(ck).output().unwrap()
}

fn consolidate(ck: &Path, out: &Path) -> Output {
    zerodp()
        .args(["ckpt", "consolidate"])
        .arg(ck)
        .arg(out)
        .output()
        .unwrap()
}

fn text(p: &Path) -> String {
    p.display().to_string()
}

/// Two checkpoints (steps 1 and 2) of a two-rank run in `<tmp>/ck`.
fn trained(s: &Setup) -> PathBuf {
    let ck = s.dir.path().join("ck");
    let out = train(
        s,
        &["--steps", "2", "--save-every", "1"],
        &[("--save-dir", &ck)],
    )
    .output()
    .unwrap();
    assert_ok(&out);
    assert!(!ck.join(LOCK).exists(), "the lock is removed at the end");
    ck
}

#[test]
fn no_writer_touches_a_checkpoint_and_a_failed_write_keeps_the_old_file() {
    let s = setup();
    let ck = trained(&s);
    let step = ck.join("step000002");
    let before = snapshot(&ck);
    let elsewhere = s.dir.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    let soft = elsewhere.join("soft.safetensors");
    std::os::unix::fs::symlink(step.join("rank00001.safetensors"), &soft).unwrap();
    let hard = elsewhere.join("hard.safetensors");
    std::fs::hard_link(step.join("rank00000.safetensors"), &hard).unwrap();
    let cases: Vec<(PathBuf, PathBuf)> = vec![
        (ck.clone(), step.join("rank00000.safetensors")),
        (ck.clone(), step.join("manifest.json")),
        (ck.clone(), ck.join("latest")),
        (ck.clone(), ck.join("full.safetensors")),
        (
            ck.clone(),
            ck.join("step000001").join("rank00001.safetensors"),
        ),
        (ck.join("step000001"), step.join("rank00000.safetensors")),
        (ck.join("step000001"), ck.join("latest")),
        (ck.clone(), soft.clone()),
        (ck.clone(), hard.clone()),
        (ck.clone(), step.clone()),
    ];
    for (input, output) in &cases {
        let t = Instant::now();
        let out = consolidate(input, output);
        assert_refused(&out, &[&text(output)]);
        let err = stderr(&out);
        assert!(
            err.contains("checkpoint") || err.contains("is a directory"),
            "{err}"
        );
        assert!(t.elapsed() < Duration::from_secs(5));
        assert_eq!(snapshot(&ck), before, "consolidate {input:?} {output:?}");
    }
    // The other writers: `plan --chart` and `train`'s outputs and save directory.
    let plan = |chart: &Path| {
        zerodp()
            .args(["plan", "--params", "1e9", "--devices", "8", "--chart"])
            .arg(chart)
            .output()
            .unwrap()
    };
    for chart in [ck.join("latest"), step.join("chart.svg"), soft.clone()] {
        assert_refused(&plan(&chart), &[&text(&chart), "checkpoint"]);
    }
    let refusals: Vec<(&str, PathBuf, Vec<&str>)> = vec![
        ("--metrics", step.join("m.jsonl"), vec![]),
        ("--save", ck.join("latest"), vec![]),
        ("--save-dir", step.clone(), vec![]),
        (
            "--metrics",
            ck.join("m.jsonl"),
            vec!["--resume", "--save-dir"],
        ),
    ];
    for (flag, path, extra) in &refusals {
        let mut args = vec!["--steps", "3"];
        args.extend(extra.iter().copied());
        if extra.contains(&"--save-dir") {
            args.push(ck.to_str().unwrap());
        }
        let out = train(&s, &args, &[(flag, path)]).output().unwrap();
        assert_refused(&out, &[flag, &text(path)]);
    }
    assert_eq!(
        snapshot(&ck),
        before,
        "a refused command changed the checkpoint"
    );
    assert_ok(&inspect(&ck));

    // A write that fails half way (a damaged copy of the checkpoint, found while streaming)
    // leaves the previous output whole and no temporary beside it.
    let full = s.dir.path().join("out").join("full.safetensors");
    std::fs::create_dir(full.parent().unwrap()).unwrap();
    assert_ok(&consolidate(&ck, &full));
    let good = std::fs::read(&full).unwrap();
    let bad = s.dir.path().join("bad");
    std::fs::create_dir(&bad).unwrap();
    for (rel, bytes) in &before {
        let to = bad.join(rel.strip_prefix(&ck).unwrap());
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::write(&to, bytes).unwrap();
    }
    let shard = bad.join("step000002").join("rank00001.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let at = bytes.len() - 5;
    bytes[at] ^= 0x40;
    std::fs::write(&shard, bytes).unwrap();
    let out = consolidate(&bad, &full);
    assert_refused(&out, &["rank00001.safetensors", "checksum"]);
    assert_eq!(std::fs::read(&full).unwrap(), good);
    let names: Vec<String> = std::fs::read_dir(full.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["full.safetensors"]);
}

/// Waits until `path` holds `n` lines (the run has taken its lock and trained).
fn wait_for_lines(child: &mut Child, path: &Path, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while std::fs::read_to_string(path).map_or(0, |t| t.lines().count()) < n {
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        assert!(Instant::now() < deadline, "no metrics");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn lock_pid(ck: &Path) -> u64 {
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ck.join(LOCK)).unwrap()).unwrap();
    record["pid"].as_u64().unwrap()
}

#[test]
fn a_second_run_on_a_save_dir_is_refused_at_once_and_the_first_saves() {
    let s = setup();
    let ck = s.dir.path().join("ck");
    let m1 = s.dir.path().join("first.jsonl");
    let mut first = train(
        &s,
        &["--steps", "100000", "--save-every", "2"],
        &[("--save-dir", &ck), ("--metrics", &m1)],
    )
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    wait_for_lines(&mut first, &m1, 4);
    assert_eq!(lock_pid(&ck), u64::from(first.id()));

    let m2 = s.dir.path().join("second.jsonl");
    let t = Instant::now();
    let out = train(
        &s,
        &["--steps", "2"],
        &[("--save-dir", &ck), ("--metrics", &m2)],
    )
    .output()
    .unwrap();
    let took = t.elapsed();
    let want = format!(
        "{} is being written by another zerodp run (pid {}, started at ",
        ck.display(),
        first.id()
    );
    assert_refused(&out, &[&want]);
    assert!(took < Duration::from_secs(1), "refused after {took:?}");
    assert!(!m2.exists(), "the refused run wrote its metrics");

    // The first run goes on, saves on SIGTERM, and releases the directory.
    let kill = Command::new("kill")
        .args(["-TERM", &first.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let out = first.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(143), "{}", stderr(&out));
    assert!(!ck.join(LOCK).exists(), "SIGTERM released the lock");
    assert_ok(&inspect(&ck));
    // The directory is free again: a run resumes from it and finishes normally.
    let steps = std::fs::read_to_string(&m1).unwrap().lines().count() / 2 + 2;
    let out = train(
        &s,
        &["--steps", &steps.to_string(), "--resume"],
        &[("--save-dir", &ck)],
    )
    .output()
    .unwrap();
    assert_ok(&out);
    assert!(!stderr(&out).contains("taking over"), "{}", stderr(&out));
    assert!(!ck.join(LOCK).exists());
    assert_ok(&inspect(&ck));
}

#[test]
fn a_lock_left_by_a_killed_run_is_taken_over() {
    let s = setup();
    let ck = s.dir.path().join("ck");
    let m = s.dir.path().join("m.jsonl");
    let mut killed = train(
        &s,
        &["--steps", "100000", "--save-every", "1"],
        &[("--save-dir", &ck), ("--metrics", &m)],
    )
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    wait_for_lines(&mut killed, &m, 2);
    let pid = killed.id();
    killed.kill().unwrap(); // SIGKILL: nothing runs on the way out
    killed.wait().unwrap();
    assert_eq!(lock_pid(&ck), u64::from(pid), "the dead run's lock is left");

    let out = train(&s, &["--steps", "2"], &[("--save-dir", &ck)])
        .output()
        .unwrap();
    assert_ok(&out);
    let err = stderr(&out);
    assert!(
        err.contains("taking over") && err.contains(&format!("pid {pid}")),
        "{err}"
    );
    assert!(!ck.join(LOCK).exists());
    assert_ok(&inspect(&ck));
}
