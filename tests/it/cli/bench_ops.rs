//! `zerodp bench ops` and the model-FLOPs columns of `zerodp bench train`: the per-op table's
//! FLOPs are the ops' own (checked against the shapes), the rows cover the whole step, and MFU is
//! model FLOP/s over the GEMM rate of the same run.

use std::process::Command;

fn zerodp_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(args)
        .output()
        .expect("run zerodp");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

/// `bench ops` on the tiny GPT, 2 sequences per rank, one timed call and step, JSON, plus `extra`.
fn tiny_ops_json(extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "bench",
        "ops",
        "--model",
        "tiny",
        "--per-rank",
        "2",
        "--reps",
        "1",
        "--steps",
        "1",
        "--format",
        "json",
    ];
    args.extend_from_slice(extra);
    zerodp_json(&args)
}

#[test]
fn bench_ops_times_every_op_of_the_step_with_its_flops() {
    // tiny: 2 layers, width 32, 2 heads, vocab 256; context 16, 2 sequences = 32 rows.
    let v = tiny_ops_json(&[]);
    let ops = v["ops"].as_array().unwrap();
    let (n, c, l, vocab, t) = (32.0, 32.0, 2.0, 256.0, 16.0);
    let find = |name: &str| {
        ops.iter()
            .find(|o| o["op"].as_str().unwrap().starts_with(name))
            .unwrap_or_else(|| panic!("no row {name}"))
    };
    // Each linear: 2 n in out forward, twice that backward; once per layer.
    for (name, inp, out) in [
        ("linear qkv", c, 3.0 * c),
        ("linear proj", c, c),
        ("linear fc ", c, 4.0 * c),
        ("linear fc2", 4.0 * c, c),
    ] {
        let o = find(name);
        assert_eq!(
            o["forward_flops"].as_f64(),
            Some(2.0 * n * inp * out),
            "{name}"
        );
        assert_eq!(
            o["backward_flops"].as_f64(),
            Some(4.0 * n * inp * out),
            "{name}"
        );
        assert_eq!(o["count"].as_f64(), Some(l), "{name}");
    }
    assert_eq!(
        find("attention")["forward_flops"].as_f64(),
        Some(2.0 * n * t * c)
    );
    assert_eq!(
        find("head logits")["forward_flops"].as_f64(),
        Some(2.0 * n * c * vocab)
    );
    assert_eq!(find("layer norm")["count"].as_f64(), Some(2.0 * l + 1.0));
    let mut sum = 0.0;
    for o in ops {
        let (f, b) = (
            o["forward_ms"].as_f64().unwrap(),
            o["backward_ms"].as_f64().unwrap(),
        );
        assert!(f > 0.0 && b > 0.0, "{o}");
        let step = o["step_ms"].as_f64().unwrap();
        assert!((step - o["count"].as_f64().unwrap() * (f + b)).abs() < 1e-9);
        sum += step;
    }
    assert!((v["ops_ms"].as_f64().unwrap() - sum).abs() < 1e-9);
    assert!(v["step_ms"].as_f64().unwrap() > 0.0);
    assert!(v["gemm_flops_per_s"].as_f64().unwrap() > 1e6);
    // 6 per weight of the blocks' matrices and the tied head, plus attention's 12 L t c, per token.
    let per_token = 6.0 * (12.0 * c * c * l + vocab * c) + 12.0 * l * t * c;
    assert_eq!(v["model_flops_per_step"].as_f64(), Some(per_token * n));
}

#[test]
fn bench_train_reports_model_flops_utilisation_against_the_measured_gemm_rate() {
    let v = zerodp_json(&[
        "bench",
        "train",
        "--model",
        "tiny",
        "--world-sizes",
        "1",
        "--stages",
        "0",
        "--warmup",
        "1",
        "--steps",
        "2",
        "--per-rank",
        "2",
        "--backend",
        "inprocess",
        "--format",
        "json",
    ]);
    let row = &v.as_array().unwrap()[0];
    let tokens_per_s = row["tokens_per_s"].as_f64().unwrap();
    let (c, l, vocab, t) = (32.0, 2.0, 256.0, 16.0);
    let per_token = 6.0 * (12.0 * c * c * l + vocab * c) + 12.0 * l * t * c;
    let model = row["model_flops_per_s"].as_f64().unwrap();
    assert!((model - per_token * tokens_per_s).abs() <= 1e-9 * model);
    let gemm = row["gemm_flops_per_s"].as_f64().unwrap();
    assert!(gemm > 1e6 && gemm.is_finite());
    assert!((row["mfu"].as_f64().unwrap() - model / gemm).abs() <= 1e-12);
}

/// Measured at several world sizes, each stage's fastest split of the host is marked once, on
/// the row with the most tokens/s; a stage measured at one world size has none.
#[test]
fn bench_train_marks_the_fastest_split_of_the_host() {
    let v = zerodp_json(&[
        "bench",
        "train",
        "--model",
        "tiny",
        "--world-sizes",
        "1,2",
        "--stages",
        "0,1",
        "--warmup",
        "1",
        "--steps",
        "2",
        "--per-rank",
        "2",
        "--backend",
        "inprocess",
        "--format",
        "json",
    ]);
    let rows = v.as_array().unwrap();
    for stage in [0, 1] {
        let same: Vec<_> = rows.iter().filter(|r| r["stage"] == stage).collect();
        let marked: Vec<_> = same.iter().filter(|r| r["fastest_split"] == true).collect();
        assert_eq!(marked.len(), 1, "stage {stage}");
        let best = same
            .iter()
            .map(|r| r["tokens_per_s"].as_f64().unwrap())
            .fold(0.0, f64::max);
        assert_eq!(marked[0]["tokens_per_s"].as_f64(), Some(best));
    }
    let one = zerodp_json(&[
        "bench",
        "train",
        "--model",
        "tiny",
        "--world-sizes",
        "1",
        "--stages",
        "0",
        "--warmup",
        "1",
        "--steps",
        "1",
        "--per-rank",
        "2",
        "--backend",
        "inprocess",
        "--format",
        "json",
    ]);
    assert_eq!(one[0]["fastest_split"], false);
}

#[test]
fn bench_ops_rejects_zero_threads_with_a_message() {
    let out = Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(["bench", "ops", "--model", "tiny", "--threads", "0"])
        .output()
        .expect("run zerodp");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--threads") && !err.contains("panicked"),
        "{err}"
    );
}

/// A bf16 run names where its products ran: bf16 operands with f32 sums on a CPU with
/// AVX512-BF16 and no AMX, f32 otherwise or with ZERODP_BF16_PRODUCTS=0; a Llama config is
/// benchmarked with its own FLOPs per token; every row says where it computed.
#[test]
fn bench_train_names_the_products_path_and_the_device() {
    let args = |precision: &str| {
        vec![
            "bench".to_string(),
            "train".into(),
            "--model-config".into(),
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/fixtures/hf/llama-tiny/config.json"
            )
            .into(),
            "--context".into(),
            "16".into(),
            "--world-sizes".into(),
            "1".into(),
            "--stages".into(),
            "0".into(),
            "--warmup".into(),
            "1".into(),
            "--steps".into(),
            "1".into(),
            "--per-rank".into(),
            "2".into(),
            "--precision".into(),
            precision.into(),
            "--format".into(),
            "json".into(),
        ]
    };
    let run = |precision: &str, env: Option<&str>| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_zerodp"));
        c.args(args(precision));
        if let Some(v) = env {
            c.env("ZERODP_BF16_PRODUCTS", v);
        }
        let out = c.output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v[0].clone()
    };
    let f32_row = run("fp32", None);
    assert_eq!(f32_row["device"], "cpu");
    assert_ne!(f32_row["gemm_path"], "avx512-bf16");
    let bf16 = run("bf16", None);
    let expect_bf16 = zerodp::model::bf16_products_available() && f32_row["gemm_path"] != "amx";
    assert_eq!(bf16["gemm_path"] == "avx512-bf16", expect_bf16, "{bf16}");
    assert_ne!(run("bf16", Some("0"))["gemm_path"], "avx512-bf16");
    // The Llama's own FLOPs (6 per weight of q, k, v, o, the three SwiGLU products and the untied
    // head, plus attention's 12 L t q): 4 heads of 16 on 2 key/value heads, width 64, 128 wide MLP.
    let (h, q, kv, i, v, l, t) = (64.0, 64.0, 32.0, 128.0, 300.0, 2.0, 16.0);
    let per_token =
        6.0 * (l * (2.0 * h * q + 2.0 * h * kv + 3.0 * h * i) + v * h) + 12.0 * l * t * q;
    let got = f32_row["model_flops_per_s"].as_f64().unwrap();
    let tokens_per_s = f32_row["tokens_per_s"].as_f64().unwrap();
    assert!(
        (got - per_token * tokens_per_s).abs() <= 1e-9 * got,
        "{got} vs {per_token} per token"
    );
}

/// Several `--threads` measure each count and add the scaling table: per op its time at each
/// count, the speedup, a serial fraction in [0, 1] that agrees with the speedup (Karp-Flatt) and
/// an Amdahl projection to `--project-threads` between the serial part and the fewest threads'
/// time; the step's phases follow the ops.
#[test]
fn bench_ops_scaling_table_over_thread_counts() {
    let v = tiny_ops_json(&["--threads", "1,2", "--project-threads", "8"]);
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[0]["threads"], 1);
    assert_eq!(runs[1]["threads"], 2);
    let s = &v["scaling"];
    assert_eq!(s["project_threads"], 8);
    let rows = s["rows"].as_array().unwrap();
    let n_ops = runs[0]["ops"].as_array().unwrap().len();
    assert_eq!(rows.len(), n_ops + 4, "every op, then the step's phases");
    assert_eq!(rows[n_ops + 3]["op"], "step (measured)");
    for (i, r) in rows.iter().enumerate() {
        let ms: Vec<f64> = r["ms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m.as_f64().unwrap())
            .collect();
        if i < n_ops {
            assert_eq!(ms[0], runs[0]["ops"][i]["step_ms"].as_f64().unwrap());
            assert_eq!(ms[1], runs[1]["ops"][i]["step_ms"].as_f64().unwrap());
        }
        let speedup = r["speedup"].as_f64().unwrap();
        assert!((speedup - ms[0] / ms[1]).abs() <= 1e-9 * speedup, "{r}");
        let e = r["serial_fraction"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&e), "{r}");
        if speedup > 1.0 && speedup < 2.0 {
            // Karp-Flatt from 1 to 2 threads: e = 2 / S - 1.
            assert!((e - (2.0 / speedup - 1.0)).abs() < 1e-9, "{r}");
        }
        let projected = r["projected_ms"].as_f64().unwrap();
        let expected = ms[0] * (e + (1.0 - e) / 8.0);
        assert!((projected - expected).abs() <= 1e-9 * expected, "{r}");
        assert!(projected <= ms[0] * (1.0 + 1e-12) && projected >= e * ms[0] * (1.0 - 1e-12));
    }
}
