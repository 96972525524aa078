//! Arbitrary bytes and arbitrary JSON never panic the config reader: every input ends in settings
//! or a typed error. The JSON generator draws keys from DeepSpeed's real names (and near misses)
//! so that the walk reaches deep into every block.

use proptest::prelude::*;
use serde_json::{Map, Value};
use zerodp::config::{self, Precision, ResolveContext};

const KEYS: &[&str] = &[
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "zero_optimization",
    "stage",
    "offload_optimizer",
    "offload_param",
    "device",
    "nvme_path",
    "ratio",
    "reduce_bucket_size",
    "stage3_prefetch_bucket_size",
    "prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "overlap_comm",
    "cpu_offload",
    "cpu_offload_param",
    "cpu_offload_use_pin_memory",
    "stage3_gather_fp16_weights_on_model_save",
    "mics_shard_size",
    "zeropp_loco_param",
    "optimizer",
    "type",
    "params",
    "lr",
    "betas",
    "scheduler",
    "warmup_num_steps",
    "total_num_steps",
    "cycle_min_lr",
    "cycle_max_lr",
    "cycle_first_step_size",
    "lr_range_test_step_size",
    "fp16",
    "bf16",
    "bfloat16",
    "enabled",
    "initial_scale_power",
    "gradient_clipping",
    "steps_per_print",
    "communication_data_type",
    "comms_logger",
    "prof_ops",
    "checkpoint",
    "tag_validation",
    "parallel_write",
    "activation_checkpointing",
    "data_types",
    "grad_accum_dtype",
    "flops_profiler",
    "stage3_param_persitence_threshold",
];

const STRINGS: &[&str] = &[
    "auto",
    "cpu",
    "nvme",
    "none",
    "Adam",
    "AdamW",
    "Lamb",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "OneCycle",
    "LRRangeTest",
    "fp16",
    "bf16",
    "fp32",
    "linear",
    "log",
    "WARN",
    "/tmp/x",
    "",
];

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        (0u64..10).prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        (-3.0f64..3.0).prop_map(Value::from),
        prop::sample::select(STRINGS).prop_map(Value::from),
        "\\PC{0,8}".prop_map(Value::from),
    ]
}

fn json() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec(
                (
                    prop_oneof![
                        prop::sample::select(KEYS).prop_map(String::from),
                        "[a-z_]{1,12}"
                    ],
                    inner
                ),
                0..6
            )
            .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

fn context() -> impl Strategy<Value = ResolveContext> {
    (
        0usize..9,
        any::<bool>(),
        prop::option::of(0usize..64),
        prop::option::of(0usize..64),
        prop::option::of(0usize..100_000),
        prop::option::of(prop::sample::select(vec![
            Precision::Fp32,
            Precision::Fp16,
            Precision::Bf16,
        ])),
    )
        .prop_map(|(w, check, tb, mb, h, p)| ResolveContext {
            world_size: w,
            world_size_source: "proptest".into(),
            train_batch_size: tb,
            micro_batch: mb,
            hidden_size: h,
            precision_override: p,
            lr: Some(1e-3),
            total_steps: Some(100),
            check_mode: check,
            ranks_per_host: None,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256), ctx in context()) {
        let text = String::from_utf8_lossy(&bytes);
        let _ = config::load_str(&text, "fuzz", &ctx);
    }

    #[test]
    fn arbitrary_json_never_panics(v in json(), ctx in context()) {
        let text = v.to_string();
        if let Ok(loaded) = config::load_str(&text, "fuzz", &ctx) {
            // Whatever resolves also serialises.
            let _ = loaded.to_json();
        }
    }

    #[test]
    fn arbitrary_configs_under_real_blocks_never_panic(
        zero in json(), opt in json(), sched in json(), fp16 in json(), ctx in context()
    ) {
        let v = serde_json::json!({
            "train_batch_size": 16,
            "zero_optimization": zero,
            "optimizer": opt,
            "scheduler": sched,
            "fp16": fp16,
        });
        let text = serde_json::to_string_pretty(&v).unwrap();
        let _ = config::load_str(&text, "fuzz", &ctx);
    }
}
