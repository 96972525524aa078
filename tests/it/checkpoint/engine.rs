//! Sharded checkpoints through the library's `Trainer`: a resumed run equals the unbroken run bit
//! for bit at every stage and precision; a checkpoint loads at any world size and stage; the
//! consolidated weights equal the trained ones; damage is caught.

use crate::common;

use common::*;
use std::path::Path;
use zerodp::checkpoint::{consolidate, inspect, CheckpointError};
use zerodp::config::{load_str, ResolveContext, Settings};
use zerodp::trainer::{BatchIndex, CheckpointOptions, ReportLog, Resume, Trainer, TrainerError};

const GLOBAL: usize = 12;
const SEQ: usize = 4;

fn settings(stage: u8, world: usize, ga: usize, extra: &str) -> Settings {
    settings_with(stage, world, ga, "", extra)
}

/// [`settings`] with `zero_extra` inside `zero_optimization` (offload blocks).
fn settings_with(stage: u8, world: usize, ga: usize, zero_extra: &str, extra: &str) -> Settings {
    let text = format!(
        r#"{{ "train_batch_size": {GLOBAL}, "gradient_accumulation_steps": {ga},
             "optimizer": {{ "type": "AdamW", "params": {{ "lr": 0.01, "weight_decay": 0.01 }} }},
             "scheduler": {{ "type": "WarmupLR", "params": {{ "warmup_num_steps": 10,
                             "warmup_max_lr": 0.01 }} }},
             "gradient_clipping": 1.0,
             "zero_optimization": {{ "stage": {stage}, "reduce_bucket_size": 50 {zero_extra} }}
             {extra} }}"#
    );
    let ctx = ResolveContext {
        world_size: world,
        ..Default::default()
    };
    load_str(&text, "<test>", &ctx).unwrap().settings
}

struct Run {
    losses: Vec<f32>,
    params: Vec<Vec<f32>>,
}

/// Train to `steps` (counted from the start), optionally resuming from and saving into `dir`.
fn run(
    model: &Toy,
    s: &Settings,
    world: usize,
    steps: u64,
    save: Option<&Path>,
    resume: Option<&Path>,
) -> Result<Run, TrainerError> {
    let mut t = Trainer::from_settings(model, s, world, 7)?.keep_params(true);
    if let Some(dir) = save {
        t = t.with_checkpoints(CheckpointOptions {
            dir: dir.to_path_buf(),
            every: None,
            keep_last: None,
            config: s.to_json(),
        });
    }
    if let Some(dir) = resume {
        t = t.with_resume(Resume::from_dir(dir)?);
    }
    let ga = t.engine_config().grad_accum;
    let source = |at: BatchIndex| -> Result<_, String> {
        let b = rank_batches(
            at.step as usize,
            at.rank,
            at.world_size,
            ga,
            GLOBAL,
            SEQ,
            16,
        );
        Ok(b[at.micro].clone())
    };
    let log = ReportLog::new();
    let out = t.run(&source, steps, &[&log])?;
    let losses = log.into_reports()[0].iter().map(|r| r.loss).collect();
    Ok(Run {
        losses,
        params: out.params.expect("kept"),
    })
}

const PRECISIONS: [&str; 3] = [
    "",
    r#", "bf16": { "enabled": true }"#,
    // fp16 starting at 2^20 with hysteresis 2: early steps overflow and the scale is mid-way
    // through its adjustment when the checkpoint is taken.
    r#", "fp16": { "enabled": true, "initial_scale_power": 20, "hysteresis": 2,
                   "loss_scale_window": 2 }"#,
];

#[test]
fn a_resumed_run_equals_the_unbroken_run_bit_for_bit() {
    let model = Toy::new(16, 8, 2, true);
    for stage in 0..=3u8 {
        for extra in PRECISIONS {
            let s = settings(stage, 2, 2, extra);
            let straight = run(&model, &s, 2, 6, None, None).unwrap();
            let dir = tempfile::tempdir().unwrap();
            run(&model, &s, 2, 3, Some(dir.path()), None).unwrap();
            if extra.contains("fp16") {
                let m = inspect(dir.path()).unwrap().manifest;
                let scale = m.counters.policy.scaler.unwrap().loss_scale();
                assert!(
                    scale < 2f64.powi(20),
                    "the scale moved before the save: {scale}"
                );
            }
            let resumed = run(&model, &s, 2, 6, None, Some(dir.path())).unwrap();
            let what = format!("stage {stage} {extra}");
            assert_eq!(resumed.losses, straight.losses[3..], "{what}");
            assert_eq!(resumed.params, straight.params, "{what}");
        }
    }
}

/// Offloaded optimizer states (host memory, the NVMe swap file), offloaded parameters (host
/// memory, the parameter swap file) and bf16 moments are saved and resumed like any other state:
/// bit for bit.
#[test]
fn offloaded_and_bf16_states_resume_bit_for_bit() {
    let model = Toy::new(16, 8, 2, true);
    let swap = tempfile::tempdir().unwrap();
    let nvme = format!(
        r#", "sub_group_size": 7, "offload_optimizer": {{ "device": "nvme", "nvme_path": "{}" }}"#,
        swap.path().display()
    );
    let cpu = r#", "offload_optimizer": { "device": "cpu" }"#;
    let params = r#", "offload_param": { "device": "cpu" }"#;
    let params_nvme = format!(
        r#", "offload_param": {{ "device": "nvme", "nvme_path": "{}", "max_in_cpu": 0 }}"#,
        swap.path().display()
    );
    // DeepSpeed's partial offload: half the units' moments on NVMe, the rest in memory.
    let partial = format!(
        r#", "sub_group_size": 7, "offload_optimizer": {{ "device": "nvme", "nvme_path": "{}",
             "ratio": 0.5 }}"#,
        swap.path().display()
    );
    let bf16_states = r#", "bf16": { "enabled": true, "bf16_optimizer_states": true }"#;
    // No fp32 master: the stochastic rounding is keyed by the restored step.
    let bf16_master = r#", "bf16": { "enabled": true, "bf16_master_weights_and_grads": true }"#;
    let fp32_bf16_states = r#", "zerodp": { "optimizer_states_dtype": "bf16" }"#;
    let cases = [
        (2, cpu.to_string(), ""),
        (1, nvme.clone(), ""),
        (3, format!("{nvme}{params}"), PRECISIONS[1]),
        (3, format!("{cpu}{params}"), bf16_states),
        (3, format!("{nvme}{params_nvme}"), ""),
        (3, format!("{cpu}{params_nvme}"), PRECISIONS[1]),
        (2, String::new(), fp32_bf16_states),
        (0, String::new(), bf16_states),
        // bf16 moments in the NVMe swap file, two to a word.
        (2, nvme.clone(), bf16_states),
        (3, format!("{nvme}{params_nvme}"), fp32_bf16_states),
        (3, partial.clone(), ""),
        (1, String::new(), bf16_master),
        (3, format!("{nvme}{params_nvme}"), bf16_master),
        (3, format!("{partial}{params}"), bf16_states),
    ];
    for (stage, zero_extra, extra) in cases {
        let s = settings_with(stage, 2, 2, &zero_extra, extra);
        let straight = run(&model, &s, 2, 6, None, None).unwrap();
        let dir = tempfile::tempdir().unwrap();
        run(&model, &s, 2, 3, Some(dir.path()), None).unwrap();
        let resumed = run(&model, &s, 2, 6, None, Some(dir.path())).unwrap();
        let what = format!("stage {stage} {zero_extra} {extra}");
        assert_eq!(resumed.losses, straight.losses[3..], "{what}");
        assert_eq!(resumed.params, straight.params, "{what}");
        let left: Vec<_> = std::fs::read_dir(swap.path()).unwrap().collect();
        assert!(left.is_empty(), "swap files left: {left:?}");
    }
}

#[test]
fn a_checkpoint_loads_at_other_world_sizes_and_stages() {
    let model = Toy::new(16, 8, 3, true);
    let saved_at = settings(1, 4, 1, "");
    let straight = run(&model, &saved_at, 4, 6, None, None).unwrap();
    let dir = tempfile::tempdir().unwrap();
    run(&model, &saved_at, 4, 3, Some(dir.path()), None).unwrap();
    for (world, stage) in [(1, 1), (2, 1), (3, 1), (2, 0), (3, 3), (1, 3)] {
        let s = settings(stage, world, 1, "");
        let got = run(&model, &s, world, 6, None, Some(dir.path())).unwrap();
        for (a, b) in got.losses.iter().zip(&straight.losses[3..]) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "world {world} stage {stage}: {:?} vs {:?}",
                got.losses,
                &straight.losses[3..]
            );
        }
    }
}

#[test]
fn consolidated_weights_equal_the_trained_parameters() {
    use safetensors::SafeTensors;
    use zerodp::zero::UnitModel;
    let model = Toy::new(16, 8, 2, false);
    let s = settings(3, 4, 1, r#", "bf16": { "enabled": true }"#);
    let dir = tempfile::tempdir().unwrap();
    let trained = run(&model, &s, 4, 3, Some(dir.path()), None).unwrap();
    let out = dir.path().join("full.safetensors");
    consolidate(dir.path(), &out, false).unwrap();
    let bytes = std::fs::read(&out).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    for (unit, values) in model.spec().units.iter().zip(&trained.params) {
        for (p, off) in unit.params.iter().zip(unit.offsets()) {
            let t = file.tensor(&p.name).unwrap();
            assert_eq!(t.shape(), p.shape.as_slice());
            let got: Vec<f32> = t
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            assert_eq!(got, values[off..off + p.numel()], "{}", p.name);
        }
    }
    // bf16 output: every value rounded once.
    let out16 = dir.path().join("full16.safetensors");
    consolidate(dir.path(), &out16, true).unwrap();
    assert!(std::fs::metadata(&out16).unwrap().len() < bytes.len() as u64);
}

#[test]
fn damaged_and_mismatched_checkpoints_are_refused() {
    let model = Toy::new(16, 8, 2, true);
    let s = settings(2, 2, 1, "");
    let dir = tempfile::tempdir().unwrap();
    run(&model, &s, 2, 2, Some(dir.path()), None).unwrap();
    assert!(inspect(dir.path())
        .unwrap()
        .problems
        .iter()
        .all(|(_, p)| p.is_none()));
    let step = dir.path().join("step000002");
    let file = step.join("rank00001.safetensors");
    let good = std::fs::read(&file).unwrap();

    // Another model.
    let other = Toy::new(16, 8, 3, true);
    let e = run(&other, &s, 2, 4, None, Some(dir.path())).err().unwrap();
    assert!(e.to_string().contains("saved from another model"), "{e}");

    // A flipped byte in the data.
    let mut bad = good.clone();
    let at = bad.len() - 3;
    bad[at] ^= 0x10;
    std::fs::write(&file, &bad).unwrap();
    let e = run(&model, &s, 2, 4, None, Some(dir.path())).err().unwrap();
    assert!(e.to_string().contains("fails its checksum"), "{e}");
    let i = inspect(dir.path()).unwrap();
    assert!(i.problems[1].1.as_deref().unwrap().contains("checksum"));

    // Truncated.
    std::fs::write(&file, &good[..good.len() / 2]).unwrap();
    let e = run(&model, &s, 2, 4, None, Some(dir.path())).err().unwrap();
    assert!(e.to_string().contains("fails its checksum"), "{e}");

    // A save that never completed (no manifest) is not a checkpoint.
    std::fs::write(&file, &good).unwrap();
    std::fs::remove_file(step.join("manifest.json")).unwrap();
    let e = Resume::from_dir(dir.path()).err().unwrap();
    assert!(e.to_string().contains("did not complete"), "{e}");
    assert!(matches!(
        e,
        TrainerError::Checkpoint(CheckpointError::NotFound { .. })
    ));
}

#[test]
fn periodic_saves_keep_the_newest_and_move_latest_last() {
    let model = Toy::new(16, 8, 2, true);
    let s = settings(3, 2, 1, "");
    let dir = tempfile::tempdir().unwrap();
    let t = Trainer::from_settings(&model, &s, 2, 7)
        .unwrap()
        .with_checkpoints(CheckpointOptions {
            dir: dir.path().to_path_buf(),
            every: Some(2),
            keep_last: Some(2),
            config: serde_json::Value::Null,
        });
    let source = |at: BatchIndex| -> Result<_, String> {
        Ok(rank_batches(at.step as usize, at.rank, 2, 1, GLOBAL, SEQ, 16)[0].clone())
    };
    let out = t.run(&source, 7, &[]).unwrap();
    // Saves after steps 2, 4, 6 and at the end (7); the newest two are kept.
    assert_eq!(
        out.saves.iter().map(|s| s.step).collect::<Vec<_>>(),
        vec![2, 4, 6, 7]
    );
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, vec!["latest", "step000006", "step000007"]);
    assert_eq!(
        std::fs::read_to_string(dir.path().join("latest")).unwrap(),
        "step000007"
    );
}
