//! Reliability of the command line on bad or extreme input: configs as editors write them, and
//! values that would silently cripple a run refused where they are written.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

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

fn write(dir: &Path, name: &str, text: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

const CONFIG: &str = r#"{ "train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
    "optimizer": { "type": "AdamW", "params": { "lr": 1e-3 } },
    "zero_optimization": { "stage": 1 } }"#;

// ---- C: small items ----

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
