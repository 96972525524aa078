//! Configs in the shapes real projects ship (DeepSpeedExamples, Hugging Face, LLaMA-Factory,
//! axolotl, DeepSpeed-Chat), and the mistakes people make in them: resolved values, warnings,
//! and errors with their JSON paths and line:column.

use zerodp::config::{
    self, ConfigError, Loaded, OffloadDevice, OptimizerKind, Precision, ResolveContext,
    SchedulerSettings, TagValidation, WarmupType,
};

fn ctx(world: usize) -> ResolveContext {
    ResolveContext {
        world_size: world,
        world_size_source: "--world-size".into(),
        ..Default::default()
    }
}

fn ok(text: &str, ctx: &ResolveContext) -> Loaded {
    match config::load_str(text, "ds_config.json", ctx) {
        Ok(l) => l,
        Err(e) => panic!("unexpected error: {e}"),
    }
}

fn err(text: &str, ctx: &ResolveContext) -> ConfigError {
    match config::load_str(text, "ds_config.json", ctx) {
        Ok(l) => panic!("expected an error, got {:?}", l.settings),
        Err(e) => e,
    }
}

/// Asserts the error's path and line:column and returns its message.
fn at(e: &ConfigError, path: &str, line: usize, column: usize) -> String {
    let w = e.at().expect("error has a position");
    assert_eq!(w.path, path, "{e}");
    let l = w.location.as_ref().expect("error has a line and column");
    assert_eq!((l.line, l.column), (line, column), "{e}");
    let msg = e.to_string();
    assert!(
        msg.starts_with(&format!("ds_config.json:{line}:{column}: {path}")),
        "{msg}"
    );
    msg
}

fn has_warning(l: &Loaded, needle: &str) -> bool {
    l.warnings.iter().any(|w| w.contains(needle))
}

const DEEPSPEED_EXAMPLES_CIFAR: &str = r#"{
  "train_batch_size": 16,
  "steps_per_print": 2000,
  "optimizer": {
    "type": "Adam",
    "params": {
      "lr": 0.001,
      "betas": [0.8, 0.999],
      "eps": 1e-8,
      "weight_decay": 3e-7
    }
  },
  "scheduler": {
    "type": "WarmupLR",
    "params": {
      "warmup_min_lr": 0,
      "warmup_max_lr": 0.001,
      "warmup_num_steps": 1000
    }
  },
  "gradient_clipping": 1.0,
  "prescale_gradients": false,
  "fp16": {
    "enabled": true,
    "fp16_master_weights_and_grads": false,
    "loss_scale": 0,
    "loss_scale_window": 500,
    "hysteresis": 2,
    "min_loss_scale": 1,
    "initial_scale_power": 15
  },
  "wall_clock_breakdown": false,
  "zero_optimization": {
    "stage": 0,
    "allgather_partitions": true,
    "reduce_scatter": true,
    "allgather_bucket_size": 50000000,
    "reduce_bucket_size": 50000000,
    "overlap_comm": true,
    "contiguous_gradients": true,
    "cpu_offload": false
  }
}"#;

#[test]
fn deepspeed_examples_cifar() {
    let l = ok(DEEPSPEED_EXAMPLES_CIFAR, &ctx(4));
    let s = &l.settings;
    assert_eq!(s.batch.train_batch_size, 16);
    assert_eq!(s.batch.micro_batch_per_gpu, 4);
    assert_eq!(s.batch.gradient_accumulation_steps, 1);
    assert_eq!(s.precision, Precision::Fp16);
    assert!(s.fp16.enabled);
    assert_eq!(s.fp16.initial_scale_power, 15);
    assert_eq!(s.fp16.initial_scale(), 32768.0);
    assert_eq!(s.fp16.loss_scale_window, 500);
    assert!(s.fp16.dynamic_args_given);
    assert_eq!(s.communication_data_type, Precision::Fp16);
    assert_eq!(s.grad_accum_dtype, Precision::Fp16);
    let o = s.optimizer.as_ref().unwrap();
    assert_eq!(o.kind, OptimizerKind::Adam);
    assert_eq!(o.betas, [0.8, 0.999]);
    assert!(o.adam_w_mode, "DeepSpeed's adam_w_mode defaults to true");
    assert_eq!(
        s.scheduler,
        Some(SchedulerSettings::WarmupLR {
            warmup_min_lr: 0.0,
            warmup_max_lr: Some(0.001),
            warmup_num_steps: 1000,
            warmup_type: WarmupType::Log,
        })
    );
    assert_eq!(s.zero_optimization.reduce_bucket_size, 50_000_000);
    assert!(s.zero_optimization.overlap_comm);
    assert_eq!(s.steps_per_print, Some(2000));
    assert!(has_warning(
        &l,
        "zero_optimization.cpu_offload is deprecated"
    ));
    assert!(has_warning(&l, "adam_w_mode defaults to true"));
    assert!(has_warning(&l, "ignored"));
    assert!(has_warning(&l, "prescale_gradients"));
    // The legacy `cpu_offload: false` turns nothing on.
    assert_eq!(
        s.zero_optimization.offload_optimizer.device,
        OffloadDevice::None
    );
}

const HF_ZERO2: &str = r#"{
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
        "params": {
            "lr": "auto",
            "betas": "auto",
            "eps": "auto",
            "weight_decay": "auto"
        }
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto"
        }
    },
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {
            "device": "cpu",
            "pin_memory": true
        },
        "allgather_partitions": true,
        "allgather_bucket_size": 2e8,
        "overlap_comm": true,
        "reduce_scatter": true,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": true
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false
}"#;

#[test]
fn hugging_face_zero2_in_check_mode_lists_every_unresolved_auto() {
    let c = ResolveContext {
        check_mode: true,
        ..ctx(2)
    };
    let l = ok(HF_ZERO2, &c);
    let s = &l.settings;
    assert_eq!(s.zero_optimization.stage, 2);
    assert_eq!(s.zero_optimization.allgather_bucket_size, 200_000_000);
    assert_eq!(
        s.zero_optimization.offload_optimizer.device,
        OffloadDevice::Cpu
    );
    assert_eq!(
        s.precision,
        Precision::Fp32,
        "fp16 \"auto\" is off unless asked"
    );
    for path in [
        "optimizer.params.lr",
        "optimizer.params.betas",
        "optimizer.params.eps",
        "optimizer.params.weight_decay",
        "scheduler.params.warmup_min_lr",
        "scheduler.params.warmup_max_lr",
        "scheduler.params.warmup_num_steps",
        "gradient_clipping",
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
    ] {
        assert!(
            s.unresolved.iter().any(|u| u == path),
            "{path} not in {:?}",
            s.unresolved
        );
    }
    let j = l.to_json();
    assert!(j["optimizer"]["lr"].is_null());
    assert!(j["optimizer"]["betas"].is_null());
    assert!(j["scheduler"]["params"]["warmup_max_lr"].is_null());
    assert!(j["train_batch_size"].is_null());
    assert_eq!(j["precision"], "fp32");
    assert!(has_warning(
        &l,
        "optimizer.params.lr: \"auto\" is unresolved"
    ));
}

#[test]
fn hugging_face_zero2_for_training_resolves_from_the_command_line_or_names_the_key() {
    let c = ResolveContext {
        micro_batch: Some(8),
        train_batch_size: Some(32),
        precision_override: Some(Precision::Fp16),
        lr: Some(3e-4),
        ..ctx(2)
    };
    // betas are still "auto": training refuses, naming the key and its line.
    let e = err(HF_ZERO2, &c);
    let msg = at(&e, "optimizer.params.betas", 14, 13);
    assert!(msg.contains("\"auto\" cannot be resolved"), "{msg}");

    let fixed = HF_ZERO2
        .replace(r#""betas": "auto""#, r#""betas": [0.9, 0.999]"#)
        .replace(r#""eps": "auto""#, r#""eps": 1e-8"#)
        .replace(r#""weight_decay": "auto""#, r#""weight_decay": 0.0"#)
        .replace(r#""warmup_min_lr": "auto""#, r#""warmup_min_lr": 0"#)
        .replace(
            r#""warmup_num_steps": "auto""#,
            r#""warmup_num_steps": 100"#,
        )
        .replace(
            r#""gradient_clipping": "auto""#,
            r#""gradient_clipping": 1.0"#,
        );
    let l = ok(&fixed, &c);
    let s = &l.settings;
    assert_eq!(s.batch.train_batch_size, 32);
    assert_eq!(s.batch.micro_batch_per_gpu, 8);
    assert_eq!(s.batch.gradient_accumulation_steps, 2);
    assert_eq!(s.precision, Precision::Fp16);
    assert_eq!(s.optimizer.as_ref().unwrap().lr, 3e-4);
    assert!(matches!(
        s.scheduler,
        Some(SchedulerSettings::WarmupLR { warmup_max_lr: Some(m), .. }) if m == 3e-4
    ));
    assert!(has_warning(
        &l,
        "gradient_accumulation_steps: \"auto\" resolved to 2"
    ));
    assert!(s.unresolved.is_empty());
}

const LLAMA_FACTORY_Z3: &str = r#"{
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto",
  "gradient_accumulation_steps": "auto",
  "gradient_clipping": "auto",
  "zero_allow_untested_optimizer": true,
  "fp16": {
    "enabled": "auto",
    "loss_scale": 0,
    "loss_scale_window": 1000,
    "initial_scale_power": 16,
    "hysteresis": 2,
    "min_loss_scale": 1
  },
  "bf16": {
    "enabled": "auto"
  },
  "zero_optimization": {
    "stage": 3,
    "overlap_comm": false,
    "contiguous_gradients": true,
    "sub_group_size": 1e9,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": true
  }
}"#;

#[test]
fn llama_factory_zero3_resolves_buckets_from_the_hidden_size() {
    let c = ResolveContext {
        micro_batch: Some(2),
        hidden_size: Some(4096),
        precision_override: Some(Precision::Bf16),
        check_mode: true,
        ..ctx(8)
    };
    let l = ok(LLAMA_FACTORY_Z3, &c);
    let s = &l.settings;
    let z = &s.zero_optimization;
    assert_eq!(z.stage, 3);
    assert!(!z.overlap_comm);
    assert_eq!(z.reduce_bucket_size, 4096 * 4096);
    assert_eq!(z.prefetch_bucket_size, 15_099_494); // floor(0.9 * 4096^2)
    assert_eq!(z.param_persistence_threshold, 40_960);
    assert_eq!(z.max_live_parameters, 1_000_000_000);
    assert!(z.gather_16bit_weights_on_model_save);
    assert_eq!(s.precision, Precision::Bf16);
    assert!(s.bf16.enabled && !s.fp16.enabled);
    assert_eq!(
        s.grad_accum_dtype,
        Precision::Bf16,
        "DeepSpeed: bf16 + ZeRO accumulates in bf16"
    );
    assert_eq!(s.batch.train_batch_size, 16);
    assert_eq!(s.batch.gradient_accumulation_steps, 1);
    assert_eq!(s.unresolved, vec!["gradient_clipping".to_string()]);
    assert!(has_warning(&l, "zero_allow_untested_optimizer"));
    let j = l.to_json();
    assert_eq!(j["zero_optimization"]["prefetch_bucket_size"], 15_099_494);
    assert!(j["gradient_clipping"].is_null());
}

#[test]
fn without_a_hidden_size_auto_buckets_are_an_error_naming_the_key() {
    let c = ResolveContext {
        micro_batch: Some(2),
        ..ctx(8)
    };
    let e = err(LLAMA_FACTORY_Z3, &c);
    let msg = at(&e, "zero_optimization.reduce_bucket_size", 23, 5);
    assert!(msg.contains("--hidden-size"), "{msg}");
    let c = ResolveContext {
        hidden_size: Some(1024),
        ..c
    };
    let e = err(LLAMA_FACTORY_Z3, &c);
    let msg = at(&e, "gradient_clipping", 5, 3);
    assert!(msg.contains("max_grad_norm"), "{msg}");
}

const AXOLOTL_ZERO3_BF16: &str = r#"{
  "zero_optimization": {
    "stage": 3,
    "overlap_comm": true,
    "contiguous_gradients": true,
    "sub_group_size": 0,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": 0,
    "stage3_max_reuse_distance": 0,
    "stage3_gather_16bit_weights_on_model_save": true
  },
  "bf16": {
    "enabled": true
  },
  "fp16": {
    "enabled": "auto",
    "auto_cast": false,
    "loss_scale": 0,
    "initial_scale_power": 32,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1
  },
  "gradient_accumulation_steps": "auto",
  "gradient_clipping": "auto",
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto",
  "wall_clock_breakdown": false
}"#;

#[test]
fn axolotl_zero3_bf16() {
    let c = ResolveContext {
        micro_batch: Some(1),
        hidden_size: Some(2048),
        ..ctx(4)
    };
    let text = AXOLOTL_ZERO3_BF16.replace(
        r#""gradient_clipping": "auto""#,
        r#""gradient_clipping": 1.0"#,
    );
    let l = ok(&text, &c);
    let s = &l.settings;
    assert_eq!(s.precision, Precision::Bf16);
    assert_eq!(s.fp16.initial_scale_power, 32);
    let z = &s.zero_optimization;
    assert_eq!(z.sub_group_size, 0);
    assert_eq!(z.max_live_parameters, 0);
    assert_eq!(z.max_reuse_distance, 0);
    assert_eq!(z.reduce_bucket_size, 2048 * 2048);
    assert_eq!(s.batch.train_batch_size, 4);
    // A command line asking for fp16 contradicts the explicit bf16.
    let c16 = ResolveContext {
        precision_override: Some(Precision::Fp16),
        ..c
    };
    let e = err(&text, &c16);
    let msg = at(&e, "bf16.enabled", 15, 5);
    assert!(msg.contains("command line asks for fp16"), "{msg}");
}

const DEEPSPEED_CHAT_Z3: &str = r#"{
  "train_batch_size": 64,
  "train_micro_batch_size_per_gpu": 8,
  "steps_per_print": 10,
  "zero_optimization": {
    "stage": 3,
    "offload_param": {"device": "none"},
    "offload_optimizer": {"device": "none"},
    "stage3_param_persistence_threshold": 1e4,
    "stage3_max_live_parameters": 3e7,
    "stage3_prefetch_bucket_size": 3e7,
    "memory_efficient_linear": false
  },
  "bfloat16": {"enabled": true},
  "gradient_clipping": 1.0,
  "prescale_gradients": false,
  "wall_clock_breakdown": false,
  "hybrid_engine": {"enabled": false, "max_out_tokens": 512},
  "tensorboard": {"enabled": false, "output_path": "step1_tensorboard/ds_tensorboard_logs/"}
}"#;

#[test]
fn deepspeed_chat_zero3_with_legacy_bfloat16() {
    let l = ok(DEEPSPEED_CHAT_Z3, &ctx(4));
    let s = &l.settings;
    assert_eq!(s.batch.gradient_accumulation_steps, 2);
    assert_eq!(s.precision, Precision::Bf16);
    let z = &s.zero_optimization;
    assert_eq!(z.param_persistence_threshold, 10_000);
    assert_eq!(z.max_live_parameters, 30_000_000);
    assert_eq!(z.prefetch_bucket_size, 30_000_000);
    assert!(!z.memory_efficient_linear);
    assert!(z.overlap_comm, "code default at stage 3");
    assert!(has_warning(&l, "bfloat16 is a deprecated name"));
    let ignored: Vec<&String> = l
        .warnings
        .iter()
        .filter(|w| w.starts_with("ignored"))
        .collect();
    assert_eq!(ignored.len(), 1, "one warning lists everything ignored");
    for k in ["prescale_gradients", "hybrid_engine", "tensorboard"] {
        assert!(ignored[0].contains(k), "{k} missing from {}", ignored[0]);
    }
}

#[test]
fn tolerant_syntax_comments_trailing_commas_and_numbers_as_written() {
    let text = "# a shell-style header\n{\n  // line comment\n  \"train_batch_size\": 32, # trailing hash\n  /* block\n     comment */\n  \"train_micro_batch_size_per_gpu\": 4.0,\n  \"zero_optimization\": {\n    \"stage\": 2,\n    \"reduce_bucket_size\": 5e8,\n    \"allgather_bucket_size\": 500000000,\n    'overlap_comm': true,\n    contiguous_gradients: false,\n  },\n  \"fp16\": {\"enabled\": true, \"initial_scale_power\": 16.0, \"loss_scale_window\": 1e3,},\n}\n";
    let l = ok(text, &ctx(2));
    let s = &l.settings;
    assert_eq!(s.batch.gradient_accumulation_steps, 4);
    assert_eq!(s.zero_optimization.reduce_bucket_size, 500_000_000);
    assert_eq!(s.zero_optimization.allgather_bucket_size, 500_000_000);
    assert!(s.zero_optimization.overlap_comm);
    assert!(!s.zero_optimization.contiguous_gradients);
    assert_eq!(s.fp16.loss_scale_window, 1000);
}

#[test]
fn defaults_follow_deepspeed_code_not_its_docs() {
    let l = ok(
        r#"{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}"#,
        &ctx(1),
    );
    let z = &l.settings.zero_optimization;
    assert_eq!(z.prefetch_bucket_size, 50_000_000, "code 5e7, docs 5e8");
    assert!(z.overlap_comm, "code: true at stage 3");
    assert_eq!(
        z.offload_optimizer.device,
        OffloadDevice::None,
        "code: none, docs: cpu"
    );
    assert_eq!(z.reduce_bucket_size, 500_000_000);
    assert_eq!(z.param_persistence_threshold, 100_000);
    assert_eq!(z.model_persistence_threshold, i64::MAX as u64);
    assert_eq!(z.sub_group_size, 1_000_000_000);
    assert_eq!(z.offload_param.buffer_count, 5);
    assert_eq!(z.offload_optimizer.buffer_count, 4);
    assert_eq!(l.settings.steps_per_print, None, "code None, docs 10");
    assert_eq!(l.settings.gradient_clipping, 0.0);
    let l = ok(
        r#"{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}"#,
        &ctx(1),
    );
    assert!(!l.settings.zero_optimization.overlap_comm);
    assert_eq!(l.settings.batch.train_batch_size, 2);
    assert_eq!(l.settings.batch.gradient_accumulation_steps, 1);
}

#[test]
fn legacy_forms_warn_and_map_to_modern_keys() {
    let l = ok(
        r#"{"train_batch_size": 8, "zero_optimization": true}"#,
        &ctx(2),
    );
    assert_eq!(l.settings.zero_optimization.stage, 1);
    assert!(has_warning(&l, "boolean form is deprecated"));

    let l = ok(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3, "cpu_offload": true,
            "cpu_offload_param": true, "cpu_offload_use_pin_memory": true,
            "stage3_gather_fp16_weights_on_model_save": true}}"#,
        &ctx(2),
    );
    let z = &l.settings.zero_optimization;
    assert_eq!(z.offload_optimizer.device, OffloadDevice::Cpu);
    assert_eq!(z.offload_param.device, OffloadDevice::Cpu);
    assert!(z.offload_optimizer.pin_memory && z.offload_param.pin_memory);
    assert!(z.gather_16bit_weights_on_model_save);
    assert_eq!(
        l.warnings
            .iter()
            .filter(|w| w.contains("deprecated"))
            .count(),
        4
    );
}

#[test]
fn legacy_and_modern_together_are_errors() {
    let e = err(
        "{\"train_batch_size\": 8,\n \"zero_optimization\": {\"stage\": 2,\n  \"offload_optimizer\": {\"device\": \"cpu\"},\n  \"cpu_offload\": true}}",
        &ctx(1),
    );
    let msg = at(&e, "zero_optimization.cpu_offload", 4, 3);
    assert!(msg.contains("keep only \"offload_optimizer\""), "{msg}");

    let e = err(
        "{\"train_batch_size\": 8,\n \"zero_optimization\": {\"stage\": 3,\n  \"stage3_gather_16bit_weights_on_model_save\": true,\n  \"stage3_gather_fp16_weights_on_model_save\": true}}",
        &ctx(1),
    );
    at(
        &e,
        "zero_optimization.stage3_gather_fp16_weights_on_model_save",
        4,
        3,
    );

    let e = err(
        "{\"train_batch_size\": 8,\n \"bf16\": {\"enabled\": true},\n \"bfloat16\": {\"enabled\": true}}",
        &ctx(1),
    );
    at(&e, "bfloat16", 3, 2);

    let e = err(
        "{\"train_batch_size\": 8,\n \"zero_optimization\": {\"stage\": 3,\n  \"prefetch_bucket_size\": 1,\n  \"stage3_prefetch_bucket_size\": 2}}",
        &ctx(1),
    );
    let msg = at(&e, "zero_optimization.stage3_prefetch_bucket_size", 4, 3);
    assert!(msg.contains("two names for the same setting"), "{msg}");
}

#[test]
fn unknown_zero_keys_are_errors_with_a_suggestion() {
    let text = "{\n  \"train_batch_size\": 8,\n  \"zero_optimization\": {\n    \"stage\": 3,\n    \"stage3_param_persitence_threshold\": 1e4\n  }\n}";
    let e = err(text, &ctx(1));
    let msg = at(
        &e,
        "zero_optimization.stage3_param_persitence_threshold",
        5,
        5,
    );
    assert!(
        msg.contains("did you mean \"stage3_param_persistence_threshold\"?"),
        "{msg}"
    );

    let text = "{\"train_batch_size\": 8,\n\"zero_optimization\": {\"stage\": 3,\n\"offload_param\": {\"device\": \"cpu\", \"pin_memmory\": true}}}";
    let e = err(text, &ctx(1));
    let msg = at(&e, "zero_optimization.offload_param.pin_memmory", 3, 36);
    assert!(msg.contains("did you mean \"pin_memory\"?"), "{msg}");

    // DeepSpeed documents grad_hooks but rejects it; so do we.
    let e = err(
        r#"{"train_batch_size": 8, "zero_optimization": {"grad_hooks": true}}"#,
        &ctx(1),
    );
    assert!(matches!(e, ConfigError::UnknownKey { .. }), "{e}");
}

#[test]
fn keys_without_effect_in_zerodp_warn_with_why_when_set() {
    // A tuned HF-style ZeRO-2 block: the keys zerodp reads but does not act on are named, each
    // with why; DeepSpeed's defaults are not.
    let l = ok(
        r#"{"train_batch_size": 8, "wall_clock_breakdown": true,
            "zero_optimization": {"stage": 2, "allgather_partitions": true,
            "allgather_bucket_size": 2e8, "ignore_unused_parameters": false,
            "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "pipeline_read": true}},
            "checkpoint": {"load_universal": true}}"#,
        &ctx(1),
    );
    for want in [
        "allgather_bucket_size (each unit's parameters are all-gathered in one call",
        "ignore_unused_parameters (a parameter without a gradient gets a zero gradient",
        "offload_optimizer.pipeline_read/pipeline_write (the NVMe stream always",
        "checkpoint.load_universal (zerodp's checkpoints load at any world size",
    ] {
        assert!(has_warning(&l, want), "{want}");
    }
    // Set to DeepSpeed's defaults, or implemented (wall_clock_breakdown): no warning.
    assert!(!has_warning(&l, "allgather_partitions"));
    assert!(!has_warning(&l, "wall_clock_breakdown"));
    let l = ok(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3,
            "allgather_bucket_size": 5e8, "elastic_checkpoint": false}}"#,
        &ctx(1),
    );
    assert!(!has_warning(&l, "without effect"));
}

#[test]
fn keys_without_effect_at_the_stage_warn() {
    let l = ok(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2,
            "offload_param": {"device": "cpu"}, "stage3_max_live_parameters": 1e9,
            "round_robin_gradients": true}}"#,
        &ctx(1),
    );
    assert!(has_warning(
        &l,
        "stage3_max_live_parameters, offload_param only act at stage 3 and have no effect at stage 2"
    ));
    // It acts at stage 2 in DeepSpeed (an ordering of gradient copies), never here.
    assert!(!has_warning(&l, "round_robin_gradients only acts"));
    assert!(has_warning(
        &l,
        "without effect in zerodp: round_robin_gradients (it orders"
    ));
    let l = ok(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 0,
            "offload_optimizer": {"device": "cpu"}}}"#,
        &ctx(1),
    );
    assert!(has_warning(
        &l,
        "offload_optimizer has no effect at stage 0"
    ));
    let l = ok(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3,
            "zero_quantized_weights": true, "zero_hpz_partition_size": 8, "mics_shard_size": 4}}"#,
        &ctx(1),
    );
    assert!(has_warning(
        &l,
        "ZeRO++ / MiCS (mics_shard_size) are not supported yet"
    ));
    // hpZ is acted on, where the world has more than one host of that many ranks.
    assert!(has_warning(&l, "zero_hpz_partition_size 8 on 1 rank(s)"));
    let l = ok(
        r#"{"train_batch_size": 16, "zero_optimization": {"stage": 3,
            "zero_hpz_partition_size": "auto"}}"#,
        &ctx(16),
    );
    assert!(
        !l.warnings.iter().any(|w| w.contains("hpz")),
        "{:?}",
        l.warnings
    );
    assert_eq!(l.settings.zero_optimization.zero_hpz_partition_size, 1);
}

#[test]
fn numbers_that_are_not_integers_or_negative_are_errors() {
    let e = err(
        "{\"train_batch_size\": 8,\n \"zero_optimization\": {\"reduce_bucket_size\": 2.5}}",
        &ctx(1),
    );
    let msg = at(&e, "zero_optimization.reduce_bucket_size", 2, 46);
    assert!(msg.contains("2.5 is not a whole number"), "{msg}");
    let e = err(
        "{\"train_batch_size\": 8,\n \"zero_optimization\": {\"stage\": 3, \"stage3_max_live_parameters\": -1}}",
        &ctx(1),
    );
    let msg = at(&e, "zero_optimization.stage3_max_live_parameters", 2, 66);
    assert!(msg.contains("negative"), "{msg}");
    let e = err("{\"train_batch_size\": -8}", &ctx(1));
    at(&e, "train_batch_size", 1, 22);
    let e = err("{\"train_batch_size\": 0}", &ctx(1));
    assert!(e.to_string().contains("at least 1"), "{e}");
    let e = err("{\"train_batch_size\": \"16\"}", &ctx(1));
    assert!(
        e.to_string()
            .contains("expected an integer, found the string \"16\""),
        "{e}"
    );
}

#[test]
fn batch_mismatch_states_numbers_world_size_source_and_choices() {
    let text = "{\n  \"train_batch_size\": 256,\n  \"train_micro_batch_size_per_gpu\": 4,\n  \"gradient_accumulation_steps\": 8\n}";
    let c = ResolveContext {
        world_size: 1,
        world_size_source: "the default 1 (no --world-size given)".into(),
        ..Default::default()
    };
    let e = err(text, &c);
    let msg = at(&e, "train_batch_size", 2, 3);
    assert!(
        msg.contains("train_batch_size 256 must equal train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 8 x world size 1 = 32"),
        "{msg}"
    );
    assert!(
        msg.contains("the default 1 (no --world-size given)"),
        "{msg}"
    );
    assert!(msg.contains("train_batch_size 32"), "{msg}");
    assert!(msg.contains("gradient_accumulation_steps 64"), "{msg}");
    assert!(msg.contains("train_micro_batch_size_per_gpu 32"), "{msg}");
    assert!(msg.contains("world size 8"), "{msg}");
    assert!(ok(text, &ctx(8)).warnings.is_empty());

    // DeepSpeed floor-divides (10 // 3 = 3, then "10 != 3 * 3 * 1"); we say why.
    let e = err(
        r#"{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3}"#,
        &ctx(1),
    );
    let msg = e.to_string();
    assert!(msg.contains("not a multiple of 3 x 1 = 3"), "{msg}");
    assert!(msg.contains("train_batch_size 9 or 12"), "{msg}");
    assert!(
        msg.contains("train_micro_batch_size_per_gpu 2 or 5"),
        "{msg}"
    );

    let e = err(r#"{"gradient_accumulation_steps": 4}"#, &ctx(1));
    assert!(
        e.to_string()
            .contains("give train_batch_size or train_micro_batch_size_per_gpu"),
        "{e}"
    );

    // A command-line value contradicting an explicit config value.
    let c = ResolveContext {
        micro_batch: Some(2),
        ..ctx(1)
    };
    let e = err(
        "{\"train_batch_size\": 8,\n \"train_micro_batch_size_per_gpu\": 4}",
        &c,
    );
    let msg = at(&e, "train_micro_batch_size_per_gpu", 2, 2);
    assert!(msg.contains("--micro-batch says 2"), "{msg}");
}

#[test]
fn duplicate_keys_and_syntax_errors_have_positions() {
    let e = err(
        "{\n  \"zero_optimization\": {\"stage\": 2},\n  \"zero_optimization\": {\"stage\": 3}\n}",
        &ctx(1),
    );
    let msg = at(&e, "zero_optimization", 3, 3);
    assert!(msg.contains("first given at line 2, column 3"), "{msg}");
    let e = err(
        "{\n  \"train_batch_size\": 8\n  \"fp16\": {\"enabled\": tru}\n}",
        &ctx(1),
    );
    assert!(matches!(e, ConfigError::Syntax { .. }), "{e}");
    assert_eq!(e.at().unwrap().location.as_ref().unwrap().line, 3);
    let e = err("", &ctx(1));
    assert!(e.to_string().contains("empty"), "{e}");
    let e = err("[1, 2]", &ctx(1));
    assert!(e.to_string().contains("expected an object"), "{e}");
}

#[test]
fn optimizer_rules() {
    let e = err(
        "{\"train_batch_size\": 8,\n \"optimizer\": {\"type\": \"Lamb\", \"params\": {\"lr\": 1e-3}}}",
        &ctx(1),
    );
    let msg = at(&e, "optimizer.type", 2, 24);
    assert!(
        msg.contains("the DeepSpeed optimizer \"Lamb\" is not supported"),
        "{msg}"
    );
    let e = err(
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}}"#,
        &ctx(1),
    );
    assert!(e.to_string().contains("gradient_clipping"), "{e}");
    let e = err(
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"learning_rate": 1e-3}}}"#,
        &ctx(1),
    );
    assert!(matches!(e, ConfigError::UnknownKey { .. }), "{e}");
    let l = ok(
        r#"{"train_batch_size": 8, "optimizer": {"type": "adam", "params": {"lr": 2e-4, "adam_w_mode": false, "weight_decay": 0.1, "bias_correction": false, "torch_adam": true}}}"#,
        &ctx(1),
    );
    let o = l.settings.optimizer.unwrap();
    assert_eq!(o.kind, OptimizerKind::Adam);
    assert!(!o.adam_w_mode && !o.bias_correction);
    assert_eq!(o.weight_decay, 0.1);
    let l = ok(
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}}"#,
        &ctx(1),
    );
    assert!(l.settings.optimizer.as_ref().unwrap().adam_w_mode);
    assert!(has_warning(&l, "still apply decoupled weight decay"));
}

#[test]
fn scheduler_rules() {
    let l = ok(
        r#"{"train_batch_size": 8,
            "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 1000, "warmup_num_steps": 50}}}"#,
        &ctx(1),
    );
    assert_eq!(
        l.settings.scheduler,
        Some(SchedulerSettings::WarmupDecayLR {
            total_num_steps: 1000,
            warmup_min_lr: 0.0,
            warmup_max_lr: 0.001,
            warmup_num_steps: 50,
            warmup_type: WarmupType::Log,
        })
    );
    let l = ok(
        r#"{"train_batch_size": 8,
            "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}}"#,
        &ctx(1),
    );
    assert!(matches!(
        l.settings.scheduler,
        Some(SchedulerSettings::OneCycle {
            cycle_first_step_size: 2000,
            cycle_second_step_size: None,
            cycle_momentum: true,
            ..
        })
    ));
    let l = ok(
        r#"{"train_batch_size": 8, "scheduler": {"type": "LRRangeTest", "params": {}}}"#,
        &ctx(1),
    );
    assert!(matches!(
        l.settings.scheduler,
        Some(SchedulerSettings::LRRangeTest {
            lr_range_test_step_size: 2000,
            ..
        })
    ));
    let e = err(
        "{\"train_batch_size\": 8,\n \"scheduler\": {\"type\": \"WarmupCosineLR\", \"params\": {\"warmup_num_steps\": 10}}}",
        &ctx(1),
    );
    assert!(
        e.to_string().contains("missing key \"total_num_steps\""),
        "{e}"
    );
    let e = err(
        r#"{"train_batch_size": 8, "scheduler": {"type": "CosineAnnealingLR", "params": {}}}"#,
        &ctx(1),
    );
    assert!(e.to_string().contains("not supported"), "{e}");
    let e = err(
        r#"{"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 10}}}"#,
        &ctx(1),
    );
    assert!(
        e.to_string().contains("did you mean \"warmup_num_steps\"?"),
        "{e}"
    );
    let c = ResolveContext {
        total_steps: Some(500),
        ..ctx(1)
    };
    let l = ok(
        r#"{"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_type": "cosine"}}}"#,
        &c,
    );
    assert!(matches!(
        l.settings.scheduler,
        Some(SchedulerSettings::WarmupDecayLR {
            total_num_steps: 500,
            warmup_type: WarmupType::Log,
            ..
        })
    ));
    assert!(has_warning(&l, "warmup_type \"cosine\" is unknown"));
}

#[test]
fn precision_and_the_loss_scale_trap() {
    let l = ok(
        r#"{"train_batch_size": 8, "fp16": {"enabled": true}, "zero_optimization": {"stage": 2}}"#,
        &ctx(1),
    );
    assert_eq!(l.settings.fp16.initial_scale(), 65536.0);
    assert_eq!(l.settings.fp16.hysteresis, 2);
    assert!(has_warning(&l, "2^32 with hysteresis 1"));
    let e = err(
        "{\"train_batch_size\": 8,\n \"fp16\": {\"enabled\": true},\n \"bf16\": {\"enabled\": true}}",
        &ctx(1),
    );
    at(&e, "bf16.enabled", 3, 11);
    let l = ok(
        r#"{"train_batch_size": 8, "bf16": {"enabled": true}, "communication_data_type": "FP32",
            "data_types": {"grad_accum_dtype": "fp32"}}"#,
        &ctx(1),
    );
    assert_eq!(l.settings.communication_data_type, Precision::Fp32);
    assert_eq!(l.settings.grad_accum_dtype, Precision::Fp32);
    let l = ok(
        r#"{"train_batch_size": 8, "bf16": {"enabled": true}}"#,
        &ctx(1),
    );
    assert_eq!(
        l.settings.grad_accum_dtype,
        Precision::Fp32,
        "bf16 at stage 0 accumulates in fp32"
    );
    let e = err(
        r#"{"train_batch_size": 8, "communication_data_type": "int8"}"#,
        &ctx(1),
    );
    assert!(matches!(e, ConfigError::InvalidChoice { .. }), "{e}");
}

#[test]
fn offload_validation() {
    let e = err(
        "{\"train_batch_size\": 8,\n \"zero_optimization\": {\"stage\": 3,\n  \"offload_param\": {\"device\": \"nvme\"}}}",
        &ctx(1),
    );
    let msg = at(&e, "zero_optimization.offload_param.device", 3, 31);
    assert!(msg.contains("needs \"nvme_path\""), "{msg}");
    let e = err(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}"#,
        &ctx(1),
    );
    assert!(e.to_string().contains("needs stage 3"), "{e}");
    let e = err(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "gpu"}}}"#,
        &ctx(1),
    );
    assert!(
        e.to_string()
            .contains("\"gpu\" is not one of \"none\", \"cpu\", \"nvme\""),
        "{e}"
    );
    let l = ok(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}, "offload_param": null}}"#,
        &ctx(1),
    );
    assert_eq!(l.settings.zero_optimization.offload_optimizer.ratio, 0.3);
}

#[test]
fn comms_logger_checkpoint_and_activation_checkpointing() {
    let l = ok(
        r#"{"train_batch_size": 8,
            "comms_logger": {"enabled": false, "verbose": true, "prof_ops": ["all_reduce"]},
            "checkpoint": {"tag_validation": "fail", "load_universal": true, "unknown_thing": 1},
            "activation_checkpointing": {"partition_activations": true, "number_checkpoints": 4, "cpu_checkpointing": true}}"#,
        &ctx(1),
    );
    let s = &l.settings;
    assert!(!s.comms_logger.enabled, "zerodp honours enabled");
    assert!(s.comms_logger.verbose);
    assert_eq!(s.comms_logger.prof_ops, vec!["all_reduce".to_string()]);
    assert!(has_warning(
        &l,
        "DeepSpeed turns logging on whenever the block exists"
    ));
    assert_eq!(s.checkpoint.tag_validation, TagValidation::Fail);
    assert!(s.checkpoint.load_universal);
    assert!(has_warning(&l, "checkpoint.unknown_thing"));
    assert!(s.activation_checkpointing.partition_activations);
    assert_eq!(s.activation_checkpointing.number_checkpoints, Some(4));
    let e = err(
        r#"{"train_batch_size": 8, "comms_logger": {"enabled": true, "verbos": true}}"#,
        &ctx(1),
    );
    assert!(e.to_string().contains("did you mean \"verbose\"?"), "{e}");
}

#[test]
fn keys_from_newer_deepspeed_are_accepted_and_reported_as_ignored() {
    let l = ok(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3,
            "stage3_allgather_sequential": true, "enable_sanity_checks": false,
            "leaf_module": {"classes": []}}}"#,
        &ctx(1),
    );
    assert!(has_warning(
        &l,
        "zero_optimization.stage3_allgather_sequential"
    ));
    assert!(has_warning(&l, "zero_optimization.leaf_module"));
    let e = err(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage3_partition_stream_chunk_size": -4}}"#,
        &ctx(1),
    );
    assert!(e.to_string().contains("negative"), "{e}");
}

#[test]
fn a_misspelt_top_level_block_is_ignored_loudly() {
    let l = ok(
        r#"{"train_batch_size": 8, "zero_optimisation": {"stage": 3}, "fp16": {"enabeld": true}}"#,
        &ctx(1),
    );
    assert_eq!(l.settings.zero_optimization.stage, 0);
    assert!(has_warning(
        &l,
        "zero_optimisation (did you mean \"zero_optimization\"?)"
    ));
    assert!(has_warning(&l, "fp16.enabeld (did you mean \"enabled\"?)"));
    assert_eq!(l.settings.precision, Precision::Fp32);
}

#[test]
fn bf16_master_weights_and_grads_is_read_with_its_gradients() {
    // The key keeps bf16 gradients even at stage 0 (where bf16 accumulates in fp32 by default),
    // unless data_types says otherwise; outside a bf16 run it warns and does nothing.
    let l = ok(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 0},
            "bf16": {"enabled": true, "bf16_master_weights_and_grads": true}}"#,
        &ctx(1),
    );
    assert!(l.settings.bf16.bf16_master_weights_and_grads);
    assert_eq!(l.settings.grad_accum_dtype, Precision::Bf16);
    assert!(!has_warning(&l, "bf16_master_weights_and_grads"));
    let l = ok(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 0},
            "data_types": {"grad_accum_dtype": "fp32"},
            "bf16": {"enabled": true, "bf16_master_weights_and_grads": true}}"#,
        &ctx(1),
    );
    assert_eq!(l.settings.grad_accum_dtype, Precision::Fp32);
    let l = ok(
        r#"{"train_batch_size": 8, "bf16": {"enabled": false, "bf16_master_weights_and_grads": true}}"#,
        &ctx(1),
    );
    assert!(has_warning(
        &l,
        "bf16_master_weights_and_grads has no effect unless"
    ));
}

/// Hugging Face's `tests/deepspeed/ds_config_zero3.json` as it shipped (transformers, fp16 on, no
/// batch sizes: the Trainer fills them), with the zeros DeepSpeed accepts.
const HF_TESTS_ZERO3: &str = r#"{
    "fp16": {
        "enabled": true,
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1
    },

    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "cpu",
            "pin_memory": true
        },
        "offload_param": {
            "device": "cpu",
            "pin_memory": true
        },
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

    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": 3e-5,
            "betas": [0.8, 0.999],
            "eps": 1e-8,
            "weight_decay": 3e-7
        }
    },

    "scheduler": {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": 0,
            "warmup_max_lr": 3e-5,
            "warmup_num_steps": 500
        }
    },

    "steps_per_print": 2000,
    "wall_clock_breakdown": false
}"#;

#[test]
fn hugging_face_tests_zero3_takes_a_zero_bucket_as_deepspeed_does() {
    let c = ResolveContext {
        micro_batch: Some(2),
        ..ctx(2)
    };
    let l = ok(HF_TESTS_ZERO3, &c);
    let z = &l.settings.zero_optimization;
    // 0: no bucket, each gradient reduced on its own; no prefetch; nothing kept gathered.
    assert_eq!(z.reduce_bucket_size, 0);
    assert_eq!(z.prefetch_bucket_size, 0);
    assert_eq!(z.param_persistence_threshold, 0);
    assert_eq!(z.sub_group_size, 100_000_000_000_000);
    assert!(z.gather_16bit_weights_on_model_save);
    assert_eq!(l.settings.precision, Precision::Fp16);
    assert_eq!(l.settings.batch.train_batch_size, 4);
    // The legacy spelling gets its deprecation warning; the zeros none.
    assert!(has_warning(&l, "stage3_gather_fp16_weights_on_model_save"));
    assert!(!has_warning(&l, "reduce_bucket_size"), "{:?}", l.warnings);
    assert_eq!(l.to_json()["zero_optimization"]["reduce_bucket_size"], 0);
}

/// Step counts DeepSpeed divides by are refused at 0 with the key's position; a OneCycle without
/// its learning rates, and a `last_batch_iteration` zerodp does not honour, are said.
#[test]
fn scheduler_step_counts_and_required_rates_are_checked_where_they_are_written() {
    for (kind, key) in [
        ("WarmupLR", "warmup_num_steps"),
        ("OneCycle", "cycle_first_step_size"),
        ("LRRangeTest", "lr_range_test_step_size"),
    ] {
        let rates = match kind {
            "OneCycle" => r#""cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "#,
            _ => "",
        };
        let text = format!(
            "{{\"train_batch_size\": 8,\n \"scheduler\": {{\"type\": \"{kind}\", \"params\": \
             {{{rates}\"{key}\": 0}}}}}}"
        );
        let e = err(&text, &ctx(1));
        assert!(matches!(e, ConfigError::OutOfRange { .. }), "{e}");
        let column = text.lines().nth(1).unwrap().find("0}").unwrap() + 1;
        let msg = at(&e, &format!("scheduler.params.{key}"), 2, column);
        assert!(msg.contains("at least 1"), "{msg}");
    }
    let e = err(
        r#"{"train_batch_size": 8, "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4}}}"#,
        &ctx(1),
    );
    assert!(
        e.to_string().contains("missing key \"cycle_max_lr\""),
        "{e}"
    );
    let l = ok(
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
            "scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 7}}}"#,
        &ctx(1),
    );
    assert!(has_warning(&l, "last_batch_iteration 7 is ignored"));
    assert!(has_warning(&l, "warmup rises to the optimizer's lr 0.0003"));
    assert!(matches!(
        l.settings.scheduler,
        Some(SchedulerSettings::WarmupLR {
            warmup_max_lr: None,
            warmup_num_steps: 1000,
            ..
        })
    ));
}

/// The precision and optimizer blocks' refusals and warnings, each for its own reason.
#[test]
fn precision_and_optimizer_mistakes_are_refused_or_said() {
    let e = err(
        "{\"train_batch_size\": 8,\n \"fp16\": {\"enabled\": true},\n \"bf16\": {\"enabled\": true}}",
        &ctx(1),
    );
    let msg = at(&e, "bf16.enabled", 3, 11);
    assert!(msg.contains("both enabled"), "{msg}");
    let e = err(
        r#"{"train_batch_size": 8, "bf16": {"enabled": true}, "bfloat16": {"enabled": true}}"#,
        &ctx(1),
    );
    assert!(matches!(e, ConfigError::DeprecatedConflict { .. }), "{e}");
    let e = err(
        r#"{"train_batch_size": 8, "fp16": {"enabled": true, "initial_scale_power": 65}}"#,
        &ctx(1),
    );
    assert!(e.to_string().contains("keep it <= 64"), "{e}");
    let l = ok(
        r#"{"train_batch_size": 8, "fp16": {"enabled": true, "fp16_master_weights_and_grads": true}}"#,
        &ctx(1),
    );
    assert!(has_warning(&l, "only acts at stage 2"));

    let adam = |params: &str| {
        format!(
            "{{\"train_batch_size\": 8,\n \"optimizer\": {{\"type\": \"Adam\", \"params\": {{{params}}}}}}}"
        )
    };
    let e = err(&adam(r#""amsgrad": true"#), &ctx(1));
    assert!(e.to_string().contains("amsgrad"), "{e}");
    let text = adam(r#""betas": [0.9, 1.5]"#);
    let e = err(&text, &ctx(1));
    let column = text.lines().nth(1).unwrap().find("1.5").unwrap() + 1;
    let msg = at(&e, "optimizer.params.betas[1]", 2, column);
    assert!(msg.contains("must be in [0, 1)"), "{msg}");
    let l = ok(&adam(r#""weight_decay": 0.1"#), &ctx(1));
    assert!(has_warning(&l, "classic L2 weight decay"));
    assert!(l.settings.optimizer.as_ref().is_some_and(|o| o.adam_w_mode));
    let l = ok(
        &adam(r#""weight_decay": 0.1, "adam_w_mode": false"#),
        &ctx(1),
    );
    assert!(l.warnings.is_empty(), "{:?}", l.warnings);
    assert!(l
        .settings
        .optimizer
        .as_ref()
        .is_some_and(|o| !o.adam_w_mode));
    let l = ok(
        &adam(r#""adam_w_mode": false"#).replace("\"Adam\"", "\"AdamW\""),
        &ctx(1),
    );
    assert!(has_warning(
        &l,
        "adam_w_mode is false but the type is AdamW"
    ));
    assert!(l.settings.optimizer.as_ref().is_some_and(|o| o.adam_w_mode));
}
