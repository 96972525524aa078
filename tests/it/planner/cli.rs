//! `zerodp plan` end to end: the simplest call, JSON keys, the SVG chart, a DeepSpeed config.

use std::process::Command;

fn zerodp(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .arg("plan")
        .args(args)
        .output()
        .expect("run zerodp");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn simplest_call_prints_a_table_and_a_recommendation() {
    let (code, out, err) = zerodp(&[
        "--params",
        "7.5e9",
        "--devices",
        "64",
        "--device-memory",
        "80GiB",
    ]);
    assert_eq!(code, 0, "{err}");
    for label in [
        "stage 0",
        "stage 1",
        "stage 2",
        "stage 3",
        "stage 3 +opt cpu +param cpu",
    ] {
        assert!(out.contains(label), "{label} missing:\n{out}");
    }
    assert!(
        out.contains("120 GB")
            && out.contains("31.4 GB")
            && out.contains("16.6 GB")
            && out.contains("1.9 GB")
    );
    assert!(out.contains("recommendation: stage 1\n"), "{out}");
}

#[test]
fn json_lists_every_option_with_the_required_keys() {
    let (code, out, err) = zerodp(&[
        "--params",
        "70B",
        "--devices",
        "8",
        "--device-memory",
        "80GB",
        "--format",
        "json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("valid JSON");
    let options = v.as_array().expect("a list of options");
    assert_eq!(options.len(), 11);
    for o in options {
        for key in [
            "stage",
            "offload_optimizer",
            "offload_param",
            "bytes_per_device",
            "fits",
            "comm_bytes_per_step",
            "predicted_comm_s",
            "predicted_compute_s",
        ] {
            assert!(o.get(key).is_some(), "{key} missing in {o}");
        }
        let b = &o["bytes_per_device"];
        for kind in [
            "params",
            "grads",
            "master",
            "adam_m",
            "adam_v",
            "model_states",
            "reduce_buckets",
            "gather_pool",
            "activations",
            "total",
        ] {
            assert!(b[kind].is_u64(), "{kind} missing in {b}");
        }
    }
    let s0 = &options[0];
    assert_eq!(
        (s0["stage"].as_u64(), s0["offload_optimizer"].as_str()),
        (Some(0), Some("none"))
    );
    assert_eq!(
        s0["bytes_per_device"]["model_states"].as_u64(),
        Some(1_120_000_000_000)
    );
    assert_eq!(s0["fits"].as_bool(), Some(false));
    let fitting: Vec<String> = options
        .iter()
        .filter(|o| o["fits"].as_bool() == Some(true))
        .map(|o| {
            format!(
                "{}/{}/{}",
                o["stage"],
                o["offload_optimizer"].as_str().unwrap(),
                o["offload_param"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(fitting[0], "3/cpu/none", "{fitting:?}");
    let recommended: Vec<&serde_json::Value> = options
        .iter()
        .filter(|o| o["recommended"] == true)
        .collect();
    assert_eq!(recommended.len(), 1);
    assert_eq!(recommended[0]["label"], "stage 3 +opt cpu");
    assert!(fitting.iter().all(|f| f.starts_with("3/")), "{fitting:?}");
}

/// A minimal XML well-formedness check: tags nest and close, attributes are quoted, `&` starts an
/// entity.
fn assert_well_formed(svg: &str) {
    let mut stack: Vec<String> = Vec::new();
    let mut rest = svg;
    while let Some(open) = rest.find('<') {
        let text = &rest[..open];
        for (i, _) in text.match_indices('&') {
            let t = &text[i..];
            assert!(t.find(';').is_some_and(|e| e < 10), "bare & in {t:.30}");
        }
        let close = rest[open..].find('>').expect("unclosed tag") + open;
        let tag = &rest[open + 1..close];
        assert_eq!(
            tag.matches('"').count() % 2,
            0,
            "unbalanced quotes in <{tag}>"
        );
        if let Some(name) = tag.strip_prefix('/') {
            assert_eq!(
                stack.pop().as_deref(),
                Some(name.trim()),
                "mismatched </{name}>"
            );
        } else if !tag.ends_with('/') && !tag.starts_with('?') && !tag.starts_with('!') {
            stack.push(tag.split_whitespace().next().unwrap().to_string());
        }
        rest = &rest[close + 1..];
    }
    assert!(stack.is_empty(), "unclosed: {stack:?}");
}

#[test]
fn chart_is_well_formed_svg_with_the_stage_labels() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mem.svg");
    let (code, _, err) = zerodp(&[
        "--preset",
        "gpt2-xl",
        "--devices",
        "8",
        "--device-memory",
        "24GB",
        "--micro-batch",
        "8",
        "--chart",
        path.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let svg = std::fs::read_to_string(&path).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert_well_formed(&svg);
    for label in [
        "stage 0",
        "stage 1",
        "stage 2",
        "stage 3",
        "device memory",
        "activations",
    ] {
        assert!(svg.contains(label), "{label} missing");
    }
    assert!(svg.matches("<rect").count() > 30);
}

#[test]
fn a_deepspeed_config_is_read_and_advised_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ds.json");
    std::fs::write(
        &path,
        r#"{"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": true},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e9, "overlap_comm": true}}"#,
    )
    .unwrap();
    let (code, out, err) = zerodp(&[
        "--params",
        "7.5e9",
        "--largest-unit",
        "2e8",
        "--devices",
        "64",
        "--device-memory",
        "16GB",
        "--config",
        path.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("micro-batch 2"), "{out}");
    assert!(
        out.contains("config:") && out.contains("set reduce_bucket_size to at most"),
        "{out}"
    );
}

#[test]
fn bad_input_says_what_and_how_to_fix() {
    let (code, _, err) = zerodp(&[
        "--params",
        "7.5e9",
        "--devices",
        "64",
        "--device-memory",
        "80 parsecs",
    ]);
    assert_ne!(code, 0);
    assert!(
        err.contains("--device-memory") && err.contains("80GiB"),
        "{err}"
    );
    let (code, _, err) = zerodp(&["--devices", "8"]);
    assert_ne!(code, 0);
    assert!(err.contains("--params"), "{err}");
    let (code, _, err) = zerodp(&[
        "--params",
        "1e9",
        "--devices",
        "12",
        "--interconnect",
        "token-ring",
    ]);
    assert_ne!(code, 0);
    assert!(
        err.contains("ib-ndr") || err.contains("multiple of 8"),
        "{err}"
    );
}

/// The offload rates come from flags: the host Adam rate prices the CPU step (Ψ/N elements per
/// device, every device of the node on the host's Adam), `measure` times zerodp's own Adam here and
/// says so, and a bad rate is refused naming the flag.
#[test]
fn offload_costs_follow_the_host_adam_rate() {
    let offload_s = |rate: &str| -> f64 {
        let (code, out, err) = zerodp(&[
            "--params",
            "1e9",
            "--devices",
            "8",
            "--devices-per-node",
            "8",
            "--device-memory",
            "80GB",
            "--host-adam-rate",
            rate,
            "--format",
            "json",
        ]);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).expect("valid JSON");
        let opt = v
            .as_array()
            .unwrap()
            .iter()
            .find(|o| o["label"] == "stage 3 +opt cpu")
            .expect("stage 3 +opt cpu listed")
            .clone();
        opt["offload"]["predicted_s"].as_f64().unwrap()
    };
    // 1e9 / 8 parameters per device, 8 devices on one host: 1e9 updates per step on the host.
    let slow = offload_s("1e9");
    let fast = offload_s("4e9");
    assert!(((slow - fast) - 0.75).abs() < 1e-9, "{slow} {fast}");

    let (code, out, err) = zerodp(&[
        "--params",
        "1e9",
        "--devices",
        "8",
        "--host-adam-rate",
        "measure",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("zerodp's CPU Adam measured on this machine"),
        "{out}"
    );

    let (code, _, err) = zerodp(&[
        "--params",
        "1e9",
        "--devices",
        "8",
        "--host-adam-rate",
        "fast",
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("--host-adam-rate"), "{err}");
    let (code, _, err) = zerodp(&[
        "--params",
        "1e9",
        "--devices",
        "8",
        "--nvme-bandwidth",
        "quick",
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("--nvme-bandwidth"), "{err}");
}

/// When only parameter offload to NVMe fits, the planner recommends it (and `zerodp train` runs
/// it: tests/it/offload/engine.rs), pricing the shards' NVMe traffic.
#[test]
fn a_param_nvme_recommendation_is_one_train_runs() {
    let (code, out, err) = zerodp(&[
        "--params",
        "4e11",
        "--devices",
        "8",
        "--device-memory",
        "80GB",
        "--host-memory",
        "2TB",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("recommendation: stage 3 +opt nvme +param nvme\n"),
        "{out}"
    );
    assert!(!out.contains("refuses"), "{out}");
}

/// Elements of every tensor a safetensors file holds, from its header.
fn safetensors_elements(path: &str) -> u64 {
    let bytes = std::fs::read(path).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    let tensors = header.as_object().unwrap().iter();
    let shapes = tensors.filter(|(name, _)| *name != "__metadata__");
    shapes
        .map(|(_, t)| t["shape"].as_array().unwrap().iter())
        .map(|dims| dims.map(|d| d.as_u64().unwrap()).product::<u64>())
        .sum()
}

/// `--model-config` plans a Hugging Face GPT-2 from its config.json alone (or the directory
/// holding it): the same plan as the shape given by flags; a Llama-family decoder with its exact
/// parameters and its own activations; a config zerodp cannot run is refused naming the field.
#[test]
fn plan_reads_a_hugging_face_config() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.json");
    std::fs::write(
        &config,
        r#"{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 768,
            "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257,
            "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}"#,
    )
    .unwrap();
    let common = ["--devices", "2", "--format", "json"];
    let plan = |model: &[&str]| {
        let args: Vec<&str> = model.iter().chain(&common).copied().collect();
        let (code, out, err) = zerodp(&args);
        assert_eq!(code, 0, "{err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let by_file = plan(&["--model-config", config.to_str().unwrap()]);
    let by_dir = plan(&["--model-config", dir.path().to_str().unwrap()]);
    let by_flags = plan(&[
        "--layers",
        "12",
        "--width",
        "768",
        "--heads",
        "12",
        "--vocab",
        "50257",
        "--context",
        "1024",
    ]);
    assert_eq!(by_file, by_flags);
    assert_eq!(by_dir, by_flags);
    // GPT-2 small: 124,439,808 parameters, 2 bytes each in bf16 at stage 0.
    assert_eq!(by_file[0]["bytes_per_device"]["params"], 2 * 124_439_808u64);

    // A Llama (GQA, untied head): its exact parameter count, 112,448 in the fixture's
    // model.safetensors, 2 bytes each.
    let llama = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf/llama-tiny");
    let by_llama = plan(&["--model-config", llama]);
    assert_eq!(by_llama[0]["bytes_per_device"]["params"], 2 * 112_448u64);
    // Its activations by its own widths (hidden 64, 4 query heads of 16 on 2 key/value heads,
    // MLP 128, vocabulary 300), one sequence of 16 tokens, 2 bytes an element: per layer and
    // row 4 hidden, 2 query and 2 key/value widths, 4 MLP widths and one row of probabilities
    // per head; the head 2 x (hidden + vocabulary) a row.
    let short = plan(&[
        "--model-config",
        llama,
        "--micro-batch",
        "1",
        "--seq-len",
        "16",
    ]);
    let layer = 16 * (4 * 64 + 2 * 64 + 2 * 32 + 4 * 128 + 4 * 16);
    let head = 16 * 2 * (64 + 300);
    let want = 2 * (2 * layer + head);
    assert_eq!(short[0]["bytes_per_device"]["activations"], want);
    // Every family's exact parameter count: the elements of the fixture's weights.
    for family in [
        "gpt2-fields",
        "llama-bias",
        "qwen2",
        "qwen3",
        "mistral",
        "gemma",
    ] {
        let dir = format!(
            "{}/tests/fixtures/hf/{family}-tiny",
            env!("CARGO_MANIFEST_DIR")
        );
        let weights = safetensors_elements(&format!("{dir}/model.safetensors"));
        let by_dir = plan(&["--model-config", &dir]);
        assert_eq!(
            by_dir[0]["bytes_per_device"]["params"],
            2 * weights,
            "{family}"
        );
    }

    std::fs::write(
        &config,
        r#"{"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 32,
            "vocab_size": 300, "activation_function": "relu"}"#,
    )
    .unwrap();
    let (code, _, err) = zerodp(&["--model-config", config.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("activation_function") && !err.contains("panicked"),
        "{err}"
    );
}

/// `--device-memory gpu` plans for the memory free on this process's GPU: where there is none
/// (no `cuda` build, no driver) it says so, naming the flag and the size to give instead; on a
/// GPU machine the plan's device memory is the GPU's free memory.
#[test]
fn device_memory_gpu_reads_this_process_gpu_or_says_why_not() {
    let (code, out, err) = zerodp(&[
        "--params",
        "1e9",
        "--devices",
        "1",
        "--device-memory",
        "gpu",
        "--format",
        "json",
    ]);
    let gpu = zerodp::device::resolve(zerodp::device::ComputeDevice::Cuda(None));
    match gpu {
        Ok(Some(gpu)) => {
            assert_eq!(code, 0, "{err}");
            let v: serde_json::Value = serde_json::from_str(&out).unwrap();
            // Each option's margin is the device memory less what the option needs.
            let first = &v[0];
            let planned = (first["device_margin_bytes"].as_i64().unwrap()
                + first["bytes_per_device"]["total"].as_i64().unwrap())
                as u64;
            // Free memory moves a little between two reads (other processes, the context).
            let diff = planned.abs_diff(gpu.free_bytes);
            assert!(
                diff <= gpu.total_bytes / 20,
                "{planned} vs {}",
                gpu.free_bytes
            );
        }
        _ => {
            assert_eq!(code, 1, "{err}");
            assert!(
                err.contains("--device-memory gpu") && err.contains("80GiB"),
                "{err}"
            );
            assert!(!err.contains("panicked"), "{err}");
        }
    }
}

/// ZeRO++'s hpZ across hosts: recommended where the network between hosts is the bottleneck,
/// not where it is fast; JSON gives its bytes and times beside stage 3's.
#[test]
fn hpz_is_chosen_on_a_slow_link_and_not_on_a_fast_one() {
    let run = |bandwidth: &str, format: &str| across_hosts("45e9", bandwidth, &[], format);
    let stage3 = |bandwidth: &str| {
        let v: serde_json::Value = serde_json::from_str(&run(bandwidth, "json")).unwrap();
        let options = v.as_array().expect("a list of options");
        options
            .iter()
            .find(|o| o["label"] == "stage 3")
            .cloned()
            .unwrap()
    };
    let slow = stage3("10Gbps");
    let h = &slow["hpz"];
    assert_eq!(h["ranks_per_host"], 8);
    assert!(h["worth_it"].as_bool().unwrap(), "{h}");
    // Only the backward's gathers leave the network: a third of stage 3's 3Ψ.
    let (plain, hpz) = (
        h["inter_node_bytes"].as_f64().unwrap(),
        h["inter_node_bytes_hpz"].as_f64().unwrap(),
    );
    assert!((hpz / plain - 2.0 / 3.0).abs() < 0.01, "{hpz} vs {plain}");
    assert!(h["step_s"].as_f64().unwrap() < slow["predicted_step_s"].as_f64().unwrap());
    // qwZ halves the bf16 forward gathers that still cross: a sixth of 3Ψ saved again.
    let with_qwz = h["inter_node_bytes_with_qwz"].as_f64().unwrap();
    assert!(
        (with_qwz / plain - 0.5).abs() < 0.01,
        "{with_qwz} vs {plain}"
    );
    assert!(h["step_s_with_qwz"].as_f64().unwrap() < h["step_s"].as_f64().unwrap());
    // qgZ: the reduce-scatter's third in int8 (half of bf16), and only a node's 1/8 of it
    // crosses: (1/2 + 1/2 / 8) / 3 of plain stage 3's bytes.
    let with_qgz = h["inter_node_bytes_with_qgz"].as_f64().unwrap();
    assert!(
        (with_qgz / plain - 0.1875).abs() < 0.002,
        "{with_qgz} vs {plain}"
    );
    assert!(h["step_s_with_qgz"].as_f64().unwrap() < h["step_s_with_qwz"].as_f64().unwrap());
    // The secondary partition: the 16-bit parameters over a node's 8 devices.
    assert_eq!(h["secondary_bytes"].as_f64().unwrap(), 45e9 * 2.0 / 8.0);
    let table = run("10Gbps", "table");
    assert!(table.contains("recommendation: stage 3\n"), "{table}");
    assert!(
        table.contains("turn on ZeRO++'s hpZ (zero_hpz_partition_size: 8)"),
        "{table}"
    );
    let fast = stage3("3200Gbps");
    assert!(
        !fast["hpz"]["worth_it"].as_bool().unwrap(),
        "{}",
        fast["hpz"]
    );
    let table = run("3200Gbps", "table");
    assert!(!table.contains("turn on ZeRO++'s hpZ"), "{table}");
    assert!(
        table.contains("would gain little on this network"),
        "{table}"
    );
}

/// HSDP across hosts (stage 3 within a node, data parallel across): its model states are the
/// node's shard, only the gradient shards' all-reduce crosses nodes, and the recommendation
/// names it, as something zerodp does not run, where it is faster and fits.
#[test]
fn hsdp_is_priced_beside_stage_3_across_hosts() {
    // Too little host memory to offload: stage 3 is the choice.
    let host = ["--host-memory", "100GB"];
    let stage3 = |params: &str, format: &str| across_hosts(params, "10Gbps", &host, format);
    let json = |params: &str| {
        let v: serde_json::Value = serde_json::from_str(&stage3(params, "json")).unwrap();
        let o = v
            .as_array()
            .unwrap()
            .iter()
            .find(|o| o["label"] == "stage 3")
            .cloned();
        o.unwrap()["hsdp"].clone()
    };
    // bf16 mixed precision: 16 bytes of model states per parameter over a node's 8 devices; the
    // bf16 gradient shard (2 bytes x params / 8) all-reduced with the other node: 2 x 1/2 of it.
    let h = json("30e9");
    assert_eq!(h["shard_size"], 8);
    assert_eq!(h["model_state_bytes"].as_f64().unwrap(), 16.0 * 30e9 / 8.0);
    let inter = h["inter_node_bytes"].as_f64().unwrap();
    assert!((inter / (2.0 * 30e9 / 8.0) - 1.0).abs() < 1e-6, "{h}");
    assert!(
        h["fits"].as_bool().unwrap() && h["worth_it"].as_bool().unwrap(),
        "{h}"
    );
    let table = stage3("30e9", "table");
    assert!(
        table.contains("HSDP (stage 3 within each node of 8 devices"),
        "{table}"
    );
    assert!(table.contains("zerodp does not run it"), "{table}");
    // 45e9 parameters: a node's shard of the model states (90 GB) does not fit 80 GB.
    let h = json("45e9");
    assert!(!h["fits"].as_bool().unwrap(), "{h}");
    assert!(!stage3("45e9", "table").contains("HSDP ("));
}

/// `zerodp plan` of `params` on 2 hosts of 8 devices of 80 GB joined at `bandwidth`, with
/// `extra` flags, in `format`: its stdout.
fn across_hosts(params: &str, bandwidth: &str, extra: &[&str], format: &str) -> String {
    let mut args = vec![
        "--params",
        params,
        "--hosts",
        "2",
        "--ranks-per-host",
        "8",
        "--device-memory",
        "80GB",
        "--inter-host-bandwidth",
        bandwidth,
        "--format",
        format,
    ];
    args.extend_from_slice(extra);
    let (code, out, err) = zerodp(&args);
    assert_eq!(code, 0, "{err}");
    out
}
