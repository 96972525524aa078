//! `zerodp bench adam --format json`: the schema the issue specifies, on a tiny shard, and a clear
//! error (no panic) for a bad `--params`.

use std::process::Command;

#[test]
fn bench_adam_json_has_bandwidth_isa_and_one_result_per_thread_count_and_state_dtype() {
    let out = Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args([
            "bench",
            "adam",
            "--params",
            "1M",
            "--threads",
            "1,2",
            "--runs",
            "2",
            "--format",
            "json",
        ])
        .env_remove("ZERODP_ADAM_ISA")
        .output()
        .expect("run zerodp");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert!(v["mem_bw_gbps"].as_f64().unwrap() > 0.0);
    let isa = v["isa"].as_str().unwrap();
    assert!(["portable", "avx2", "avx512"].contains(&isa), "{isa}");
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 4); // 2 thread counts x 2 state dtypes
    let mut seen = Vec::new();
    for r in results {
        assert_eq!(r["params"].as_u64(), Some(1_000_000));
        let threads = r["threads"].as_u64().unwrap();
        let state = r["state_dtype"].as_str().unwrap().to_string();
        let bytes = r["bytes_per_param"].as_u64().unwrap();
        // f32 gradients: read p, g, m, v and write p, m, v.
        assert_eq!(bytes, if state == "f32" { 28 } else { 20 }, "{state}");
        let pps = r["params_per_s"].as_f64().unwrap();
        assert!(pps > 0.0 && pps.is_finite());
        // The bound of the row's own access pattern, measured at its thread count.
        let bound = r["bound_gbps"].as_f64().unwrap();
        assert!(bound > 0.0 && bound.is_finite(), "{bound}");
        let ms = r["ms_per_step"].as_f64().unwrap();
        assert!((1e6 / (ms * 1e-3) - pps).abs() <= 1e-6 * pps);
        assert!(r["fused_copy_params_per_s"].as_f64().unwrap() > 0.0);
        assert_eq!(r["fused_copy_bytes_per_param"].as_u64(), Some(bytes + 2));
        seen.push((threads, state));
    }
    for threads in [1, 2] {
        for state in ["f32", "bf16"] {
            assert!(
                seen.contains(&(threads, state.to_string())),
                "{threads} {state}"
            );
        }
    }
}

#[test]
fn bench_adam_rejects_a_bad_params_value_with_a_hint() {
    let out = Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(["bench", "adam", "--params", "lots"])
        .output()
        .expect("run zerodp");
    let code = out.status.code();
    assert!(matches!(code, Some(1 | 2)), "exit status {code:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--params") && err.contains("10M"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(out.stdout.is_empty());
}

#[test]
fn bench_adam_refuses_a_shard_larger_than_memory() {
    let out = Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(["bench", "adam", "--params", "100000G"])
        .output()
        .expect("run zerodp");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("GiB") && err.contains("lower --params"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bench_adam_refuses_an_unknown_forced_isa() {
    let out = Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(["bench", "adam", "--params", "1K", "--runs", "1"])
        .env("ZERODP_ADAM_ISA", "sse9")
        .output()
        .expect("run zerodp");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("ZERODP_ADAM_ISA") && err.contains("avx512"),
        "{err}"
    );
}
