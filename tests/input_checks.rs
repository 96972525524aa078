//! Reliability of the command line on bad or extreme input: no panic on a closed standard output,
//! each cause said once, configs as editors write them, and values that would silently cripple a
//! run refused where they are written, with the files a refused run was given left as they were.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use zerodp::config::{self, ResolveContext};

fn zerodp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(args)
        .output()
        .expect("run zerodp")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A refusal: exit status 1, a last line `error: ...`, every one of `expected` said, no panic.
fn assert_refused(out: &Output, expected: &[&str]) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let last = err.trim_end().lines().last().unwrap_or("");
    assert!(last.starts_with("error: "), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    for e in expected {
        assert!(err.contains(e), "{e:?} missing from: {err}");
    }
}

fn write(dir: &Path, name: &str, text: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

const CONFIG: &str = r#"{ "train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
    "optimizer": { "type": "AdamW", "params": { "lr": 1e-3 } },
    "zero_optimization": { "stage": 1 } }"#;

// ---- A: writing never panics ----

#[test]
fn plan_into_a_closed_pipe_ends_quietly() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(["plan", "--preset", "gpt2-xl", "--devices", "16"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The reader goes away before reading anything (`zerodp plan | head -0`).
    drop(child.stdout.take());
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let status = child.wait().unwrap();
    assert_ne!(status.code(), Some(101), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(status.code(), Some(0), "{err}");
    assert_eq!(err, "");
}

#[test]
fn a_full_stdout_is_an_error_not_a_panic() {
    if !Path::new("/dev/full").exists() {
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(["plan", "--params", "7e9"])
        .stdout(std::fs::File::create("/dev/full").unwrap())
        .output()
        .unwrap();
    assert_refused(
        &out,
        &["writing to standard output", "No space left on device"],
    );
}

// ---- C: small items ----

#[test]
fn an_os_error_is_said_once() {
    let dir = tempfile::tempdir().unwrap();
    let out = zerodp(&["train", "--config", dir.path().to_str().unwrap()]);
    assert_refused(&out, &["cannot read config file", "Is a directory"]);
    let err = stderr(&out);
    assert_eq!(err.matches("Is a directory").count(), 1, "{err}");
}

#[test]
fn a_config_with_a_byte_order_mark_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = b"\xef\xbb\xbf".to_vec();
    bytes.extend_from_slice(CONFIG.as_bytes());
    let path = write(dir.path(), "bom.json", &bytes);
    let out = zerodp(&["config", "check", path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        std::fs::read(&path).unwrap(),
        bytes,
        "the file is left as it was"
    );
    let text = String::from_utf8(bytes).unwrap();
    let loaded = config::load_str(&text, "bom.json", &ResolveContext::default()).unwrap();
    assert_eq!(loaded.settings.zero_optimization.stage, 1);
    // Positions after the mark are counted as an editor shows them.
    let bad = "\u{feff}{\"zero_optimization\": {\"stage\": 7}}";
    let e = config::load_str(bad, "bom.json", &ResolveContext::default())
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("bom.json:1:33:"), "{e}");
}

#[test]
fn a_zero_reduce_bucket_is_refused_where_it_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let text = "{ \"train_batch_size\": 2,\n  \"zero_optimization\": { \"stage\": 2, \"reduce_bucket_size\": 0 } }";
    let path = write(dir.path(), "ds.json", text.as_bytes());
    let out = zerodp(&["config", "check", path.to_str().unwrap()]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("ds.json:2:60: zero_optimization.reduce_bucket_size: 0 would reduce"),
        "{err}"
    );
    assert!(err.contains("5e8"), "{err}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
    // Zero prefetch (no prefetching) and a zero all-gather bucket (unused) stay valid.
    let ok = r#"{"train_batch_size": 1, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0,
                 "allgather_bucket_size": 0}}"#;
    assert!(config::load_str(ok, "ok.json", &ResolveContext::default()).is_ok());
}
