//! Reliability of the command line on bad or extreme input: no panic on a closed standard output,
//! sizes that would overflow refused with the flag and the limit, each cause said once, and the
//! files a refused run was given left as they were.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use zerodp::config::{self, ResolveContext};
use zerodp::model::GptConfig;

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

// ---- B: sizes are checked ----

#[test]
fn an_overflowing_width_is_refused_by_train_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let config = write(dir.path(), "ds.json", CONFIG.as_bytes());
    let metrics = dir.path().join("m.jsonl");
    let saved = dir.path().join("w.safetensors");
    for width in ["4294967296", "1000000000"] {
        let out = Command::new(env!("CARGO_BIN_EXE_zerodp"))
            .args(["train", "--model", "tiny", "--heads", "1", "--width", width])
            .arg("--config")
            .arg(&config)
            .arg("--metrics")
            .arg(&metrics)
            .arg("--save")
            .arg(&saved)
            .output()
            .unwrap();
        assert_refused(
            &out,
            &[&format!("width {width}"), "limit of 1e15", "--width"],
        );
    }
    assert!(!metrics.exists() && !saved.exists());
    assert_eq!(std::fs::read_to_string(&config).unwrap(), CONFIG);
    // The library says the same.
    let mut huge = GptConfig::tiny();
    huge.width = 1 << 32;
    huge.heads = 1;
    let e = huge.validate().unwrap_err().to_string();
    assert!(e.contains("limit of 1e15"), "{e}");
}

#[test]
fn plan_refuses_overflowing_shapes_and_counts() {
    let dir = tempfile::tempdir().unwrap();
    let chart = dir.path().join("c.svg");
    let chart_arg = chart.to_str().unwrap();
    let out = zerodp(&[
        "plan",
        "--layers",
        "3",
        "--width",
        "4294967296",
        "--heads",
        "1",
        "--chart",
        chart_arg,
    ]);
    assert_refused(&out, &["width 4294967296", "limit of 1e15", "--width"]);
    assert!(!chart.exists(), "a refused plan writes no chart");
    // "fits: yes" for 4.6e18 parameters was a wrapped total.
    let out = zerodp(&["plan", "--params", "4.6e18"]);
    assert_refused(&out, &["--params 4.60e18", "limit of 1e15"]);
    let out = zerodp(&["plan", "--layers", "200000", "--width", "8", "--heads", "1"]);
    assert_refused(&out, &["--layers 200000", "limit of 100000"]);
    let out = zerodp(&["plan", "--params", "7e9", "--devices", "4294967296"]);
    assert_refused(&out, &["limit of 1048576 devices", "--devices"]);
    let out = zerodp(&["plan", "--params", "7e9", "--device-memory", "1e19"]);
    assert_refused(&out, &["--device-memory", "limit of 1 EiB"]);
    let out = zerodp(&["plan", "--preset", "gpt2", "--micro-batch", "2147483647"]);
    assert_refused(&out, &["activations", "limit of 1 EiB", "--micro-batch"]);
    let out = zerodp(&[
        "plan",
        "--params",
        "1e15",
        "--devices",
        "1048576",
        "--grad-accum",
        "2147483648",
    ]);
    assert_refused(
        &out,
        &["2147483648 micro-steps", "2^64 bytes", "--grad-accum"],
    );
}

#[test]
fn plan_refuses_what_train_would_refuse() {
    let out = zerodp(&["plan", "--params", "7e9", "--grad-accum", "0"]);
    assert_refused(&out, &["--grad-accum 0 must be between 1 and 2^31"]);
    let out = zerodp(&["plan", "--params", "7e9", "--devices", "0"]);
    assert_refused(&out, &["--devices must be at least 1"]);
    let out = zerodp(&["plan", "--params", "7e9", "--largest-unit", "0"]);
    assert_refused(&out, &["--largest-unit must be at least 1"]);
    let out = zerodp(&["plan", "--params", "7e9", "--micro-batch", "4294967296"]);
    assert_refused(
        &out,
        &["--micro-batch 4294967296 must be between 1 and 2^31"],
    );
}

#[test]
fn an_infinite_timeout_means_no_timeout_and_a_huge_one_is_refused() {
    let out = zerodp(&[
        "bench",
        "comm",
        "--sizes",
        "1K",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--op",
        "all_reduce",
        "--timeout",
        "inf",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = zerodp(&["bench", "comm", "--sizes", "1K", "--timeout", "1e300"]);
    assert_refused(&out, &["--timeout 1e300", "inf for no timeout"]);

    let dir = tempfile::tempdir().unwrap();
    let config = write(dir.path(), "ds.json", CONFIG.as_bytes());
    let text = write(
        dir.path(),
        "text.txt",
        "to be or not to be. ".repeat(50).as_bytes(),
    );
    let train = |timeout: &str| {
        Command::new(env!("CARGO_BIN_EXE_zerodp"))
            .args(["train", "--model", "tiny", "--steps", "1", "--no-progress"])
            .args(["--timeout", timeout])
            .arg("--config")
            .arg(&config)
            .arg("--data")
            .arg(&text)
            .output()
            .unwrap()
    };
    let out = train("inf");
    assert!(out.status.success(), "{}", stderr(&out));
    assert_refused(&train("1e300"), &["--timeout 1e300"]);
    assert_refused(&train("0"), &["--timeout 0.0"]);
}

#[test]
fn an_environment_timeout_of_inf_is_accepted() {
    let out = Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args([
            "bench", "comm", "--sizes", "1K", "--iters", "1", "--warmup", "0",
        ])
        .args(["--op", "all_gather"])
        .env("ZERODP_TIMEOUT", "inf")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn bench_comm_refuses_what_it_cannot_hold() {
    let out = zerodp(&[
        "bench",
        "comm",
        "--sizes",
        "1K",
        "--iters",
        "100000000000000000",
    ]);
    assert_refused(&out, &["--iters and --warmup take at most 1000000 rounds"]);
    if !Path::new("/proc/meminfo").exists() {
        return;
    }
    let out = zerodp(&["bench", "comm", "--sizes", "1T"]);
    assert_refused(
        &out,
        &[
            "--sizes 1T",
            "two buffers on each of 2 rank(s)",
            "MemAvailable",
        ],
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

/// Hugging Face's `tests/deepspeed/ds_config_zero3.json` as it shipped with `"auto"` values and
/// the zeros DeepSpeed takes as "no bucket" / "no prefetch" / "nothing persistent".
const HF_ZERO3: &str = r#"{
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1
    },
    "optimizer": {
        "type": "AdamW",
        "params": { "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto" }
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": { "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto" }
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": { "device": "cpu", "pin_memory": true },
        "offload_param": { "device": "cpu", "pin_memory": true },
        "overlap_comm": true,
        "contiguous_gradients": true,
        "sub_group_size": 1e14,
        "reduce_bucket_size": 0,
        "stage3_prefetch_bucket_size": 0,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_fp16_weights_on_model_save": true
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false
}"#;

#[test]
fn a_zero_reduce_bucket_is_accepted_and_explained() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "ds_config_zero3.json", HF_ZERO3.as_bytes());
    let file = path.to_str().unwrap();
    let out = zerodp(&["config", "check", file, "--world-size", "2"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}{text}", stderr(&out));
    let row = text
        .lines()
        .find(|l| l.starts_with("reduce_bucket_size"))
        .unwrap_or_else(|| panic!("no reduce_bucket_size row: {text}"));
    assert!(
        row.contains("0 (no bucket: each unit's gradient is reduced on its own"),
        "{row}"
    );
    // A note in the table, not a warning.
    assert!(
        !text.contains("warning(s):\n  - zero_optimization.reduce_bucket_size"),
        "{text}"
    );
    let out = zerodp(&["config", "check", file, "--format", "json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["zero_optimization"]["reduce_bucket_size"], 0);
    // Zero prefetch (no prefetching) and a zero all-gather bucket (unused) stay valid.
    let ok = r#"{"train_batch_size": 1, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0,
                 "allgather_bucket_size": 0}}"#;
    assert!(config::load_str(ok, "ok.json", &ResolveContext::default()).is_ok());
}
