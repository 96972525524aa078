//! Every config in examples/ resolves to what its comments promise, at world sizes 1, 2 and 4,
//! without warnings; and `zerodp config check` prints it (table and JSON) with exit status 0.

use std::path::PathBuf;
use std::process::Command;

use zerodp::config::{
    self, OffloadDevice, OptimizerKind, Precision, ResolveContext, SchedulerSettings, Settings,
    WarmupType,
};

fn example(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(name)
}

fn load(name: &str, world: usize) -> Settings {
    let ctx = ResolveContext {
        world_size: world,
        world_size_source: "the test".into(),
        ..Default::default()
    };
    let loaded = config::load_file(example(name), &ctx).unwrap();
    assert!(
        loaded.warnings.is_empty(),
        "{name}: unexpected warnings {:?}",
        loaded.warnings
    );
    loaded.settings
}

fn check_common(s: &Settings, world: usize) {
    assert_eq!(s.batch.train_batch_size, 16);
    assert_eq!(s.batch.micro_batch_per_gpu, 4);
    assert_eq!(s.batch.gradient_accumulation_steps, 4 / world);
    assert_eq!(s.batch.world_size, world);
    assert_eq!(s.precision, Precision::Fp32);
    assert_eq!(s.communication_data_type, Precision::Fp32);
    assert_eq!(s.gradient_clipping, 1.0);
    assert_eq!(s.steps_per_print, Some(10));
    let o = s.optimizer.as_ref().unwrap();
    assert_eq!(o.kind, OptimizerKind::AdamW);
    assert_eq!(o.lr, 1e-3);
    assert_eq!(o.betas, [0.9, 0.95]);
    assert_eq!(o.weight_decay, 0.01);
    assert!(o.adam_w_mode);
}

#[test]
fn all_examples_resolve_at_world_sizes_1_2_4() {
    for world in [1, 2, 4] {
        let s0 = load("stage0.json", world);
        check_common(&s0, world);
        assert_eq!(s0.zero_optimization.stage, 0);
        assert!(!s0.zero_optimization.overlap_comm);
        assert_eq!(
            s0.scheduler,
            Some(SchedulerSettings::WarmupLR {
                warmup_min_lr: 0.0,
                warmup_max_lr: Some(1e-3),
                warmup_num_steps: 20,
                warmup_type: WarmupType::Linear,
            })
        );

        let s1 = load("stage1.json", world);
        check_common(&s1, world);
        assert_eq!(s1.zero_optimization.stage, 1);
        assert_eq!(s1.zero_optimization.reduce_bucket_size, 2_000_000);

        let s2 = load("stage2.json", world);
        check_common(&s2, world);
        let z = &s2.zero_optimization;
        assert_eq!(z.stage, 2);
        assert!(z.overlap_comm && z.contiguous_gradients && z.reduce_scatter);
        assert_eq!(z.reduce_bucket_size, 2_000_000);
        // Not set: each unit is all-gathered in one call (the key would be warned about).
        assert_eq!(z.allgather_bucket_size, 500_000_000);
        assert_eq!(z.offload_optimizer.device, OffloadDevice::None);
        assert_eq!(z.offload_param.device, OffloadDevice::None);

        let s2o = load("stage2_offload_cpu.json", world);
        check_common(&s2o, world);
        let z = &s2o.zero_optimization;
        assert_eq!(z.stage, 2);
        assert_eq!(z.offload_optimizer.device, OffloadDevice::Cpu);
        assert!(z.offload_optimizer.pin_memory);
        assert_eq!(z.offload_optimizer.ratio, 1.0);

        let s3 = load("stage3.json", world);
        check_common(&s3, world);
        let z = &s3.zero_optimization;
        assert_eq!(z.stage, 3);
        assert!(z.overlap_comm);
        assert_eq!(z.prefetch_bucket_size, 2_000_000);
        assert_eq!(z.param_persistence_threshold, 10_000);
        assert_eq!(z.max_live_parameters, 100_000_000);
        assert_eq!(z.max_reuse_distance, 100_000_000);
        assert!(z.gather_16bit_weights_on_model_save);
        assert_eq!(z.sub_group_size, 1_000_000_000);
        assert!(matches!(
            s3.scheduler,
            Some(SchedulerSettings::WarmupCosineLR {
                total_num_steps: 200,
                warmup_num_steps: 20,
                ..
            })
        ));

        let s3n = load("stage3_nvme.json", world);
        check_common(&s3n, world);
        let z = &s3n.zero_optimization;
        assert_eq!(z.stage, 3);
        assert_eq!(z.offload_param.device, OffloadDevice::Nvme);
        assert!(z.offload_param.pin_memory);
        assert_eq!(
            z.offload_param.nvme_path.as_deref(),
            Some(std::path::Path::new("/tmp"))
        );
        assert_eq!(z.offload_optimizer.device, OffloadDevice::Nvme);
        assert_eq!(
            z.offload_optimizer.nvme_path.as_deref(),
            Some(std::path::Path::new("/tmp"))
        );
        assert_eq!(z.offload_optimizer.buffer_count, 4);
    }
}

#[test]
fn examples_fail_clearly_at_a_world_size_that_does_not_divide() {
    let ctx = ResolveContext {
        world_size: 3,
        world_size_source: "--world-size".into(),
        ..Default::default()
    };
    let e = config::load_file(example("stage2.json"), &ctx).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("stage2.json:"), "{msg}");
    assert!(
        msg.contains("world size 3 (world size from --world-size)"),
        "{msg}"
    );
    assert!(msg.contains("train_batch_size 12 or 24"), "{msg}");
    assert!(msg.contains("world size 2 or 4"), "{msg}");
}

fn zerodp(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn config_check_prints_json_with_the_promised_keys() {
    let path = example("stage2_offload_cpu.json");
    let out = zerodp(&[
        "config",
        "check",
        path.to_str().unwrap(),
        "--world-size",
        "2",
        "--format",
        "json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["stage"], 2);
    assert_eq!(v["offload_optimizer"], "cpu");
    assert_eq!(v["offload_param"], "none");
    assert_eq!(v["precision"], "fp32");
    assert_eq!(v["train_batch_size"], 16);
    assert_eq!(v["train_micro_batch_size_per_gpu"], 4);
    assert_eq!(v["gradient_accumulation_steps"], 2);
    assert_eq!(v["reduce_bucket_size"], 2_000_000);
    assert_eq!(v["overlap_comm"], true);
    assert_eq!(v["gradient_clipping"], 1.0);
    assert_eq!(v["warnings"], serde_json::json!([]));
}

#[test]
fn config_check_prints_a_table_and_exits_1_on_errors() {
    let path = example("stage3.json");
    let out = zerodp(&["config", "check", path.to_str().unwrap()]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("zero stage"), "{text}");
    assert!(text.contains("prefetch_bucket_size"), "{text}");
    assert!(text.contains("no warnings"), "{text}");

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.json");
    std::fs::write(
        &bad,
        "{\n  \"train_batch_size\": 8,\n  \"zero_optimization\": {\"stage\": 5}\n}\n",
    )
    .unwrap();
    let out = zerodp(&["config", "check", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("bad.json:3:34: zero_optimization.stage"),
        "{err}"
    );
}

#[test]
fn config_check_json_shows_unresolved_auto_as_null() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("hf.json");
    std::fs::write(
        &f,
        r#"{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}"#,
    )
    .unwrap();
    let out = zerodp(&["config", "check", f.to_str().unwrap(), "--format", "json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["train_batch_size"].is_null());
    assert!(v["train_micro_batch_size_per_gpu"].is_null());
    assert!(v["reduce_bucket_size"].is_null());
    assert!(v["gradient_clipping"].is_null());
    let warnings = v["warnings"].as_array().unwrap();
    assert!(warnings.iter().any(|w| w
        .as_str()
        .unwrap()
        .contains("zero_optimization.reduce_bucket_size")));

    // The command line resolves them.
    let out = zerodp(&[
        "config",
        "check",
        f.to_str().unwrap(),
        "--format",
        "json",
        "--world-size",
        "2",
        "--micro-batch",
        "4",
        "--train-batch-size",
        "32",
        "--hidden-size",
        "1024",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["train_batch_size"], 32);
    assert_eq!(v["gradient_accumulation_steps"], 4);
    assert_eq!(v["reduce_bucket_size"], 1024 * 1024);
    assert!(v["gradient_clipping"].is_null());
}

/// A ZeRO++ config as DeepSpeed's tutorial writes it: `config check` reports hpZ, qwZ and qgZ as
/// acted on at stage 3, with no warning.
#[test]
fn config_check_reports_zeropp_keys_as_acted_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("zeropp.json");
    std::fs::write(
        &path,
        r#"{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 10000000,
              "zero_quantized_weights": true, "zero_hpz_partition_size": 8,
              "zero_quantized_gradients": true, "overlap_comm": true}}"#,
    )
    .unwrap();
    let out = zerodp(&[
        "config",
        "check",
        path.to_str().unwrap(),
        "--world-size",
        "16",
    ]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("8 ranks per host (hpZ: acted on)"), "{text}");
    assert!(text.contains("int8 all-gathers (qwZ: acted on)"), "{text}");
    assert!(
        text.contains("int8 all-to-alls within, then across hosts (qgZ: acted on)"),
        "{text}"
    );
    assert!(!text.contains("not supported yet"), "{text}");
}
