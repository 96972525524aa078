//! `zerodp bench comm --format json`: the schema the issue specifies, on tiny sizes, with an
//! out-of-place and an in-place row for reduce-scatter and all-gather.

use std::process::Command;

#[test]
fn bench_comm_json_has_the_memcpy_reference_and_one_result_per_op_form_and_size() {
    let out = Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args([
            "bench",
            "comm",
            "--world-size",
            "3",
            "--op",
            "all",
            "--sizes",
            "1K..4K",
            "--iters",
            "2",
            "--format",
            "json",
        ])
        .env_remove("ZERODP_DEBUG")
        .env_remove("ZERODP_TIMEOUT")
        .output()
        .expect("run zerodp");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    for k in ["one_thread", "all_threads"] {
        assert!(v["memcpy_gbps"][k].as_f64().unwrap() > 0.0, "{k}");
    }
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 15); // 3 sizes x (all_reduce + 2 forms of the other two ops)
    let mut seen = Vec::new();
    for r in results {
        assert_eq!(r["world_size"], 3);
        let (time, alg, bus) = (
            r["time_s"].as_f64().unwrap(),
            r["algbw_gbps"].as_f64().unwrap(),
            r["busbw_gbps"].as_f64().unwrap(),
        );
        let bytes = r["bytes"].as_u64().unwrap();
        assert!(time > 0.0);
        assert!((alg - bytes as f64 / time / 1e9).abs() <= 1e-3 * alg);
        let factor = if r["op"] == "all_reduce" {
            4.0 / 3.0
        } else {
            2.0 / 3.0
        };
        assert!((bus - alg * factor).abs() <= 1e-9 + 1e-9 * bus);
        let in_place = r["in_place"].as_bool().expect("in_place is a bool");
        seen.push((r["op"].as_str().unwrap().to_string(), in_place, bytes));
    }
    for (op, in_place) in [
        ("all_reduce", true),
        ("reduce_scatter", false),
        ("reduce_scatter", true),
        ("all_gather", false),
        ("all_gather", true),
    ] {
        for b in [1024, 2048, 4096] {
            assert!(
                seen.contains(&(op.to_string(), in_place, b)),
                "{op} in_place={in_place} {b}"
            );
        }
    }
}

#[test]
fn bench_comm_rejects_a_bad_size_with_a_hint() {
    let out = Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(["bench", "comm", "--sizes", "lots"])
        .output()
        .expect("run zerodp");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("64M"), "{err}");
}

/// `--nccl` in a build without the `cuda` feature is refused before any work, saying how to get a
/// GPU build (in a `cuda` build on a machine without a GPU, with the driver's reason).
#[test]
fn bench_comm_nccl_without_a_gpu_build_says_how_to_get_one() {
    if zerodp::device::gpu_count().is_ok_and(|n| n > 0) {
        eprintln!("skipped: this machine has a GPU (tests/gpu.rs runs NCCL there)");
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(["bench", "comm", "--nccl", "--sizes", "1K", "--iters", "1"])
        .output()
        .expect("run zerodp");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    if cfg!(feature = "cuda") {
        assert!(err.contains("GPU"), "{err}");
    } else {
        assert!(err.contains("--nccl needs a GPU build"), "{err}");
        assert!(err.contains("cuda-build.sh"), "{err}");
    }
}
