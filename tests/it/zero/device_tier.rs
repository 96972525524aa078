//! The device tier in a model's device memory (`Candle::with_device_tier`, what `train --device
//! cuda` runs on one GPU without offload): parameters, gradients and Adam's state stay on the
//! model's device and the engine's arithmetic runs there. On candle's CPU backend the same code
//! trains as the engine's host tier (one rank at every stage; two ranks at stages 0-2, where
//! stages 1-2 shard the master and moments over them), resumes bit for bit from its checkpoints,
//! and is refused where a run needs its state in host memory.

use std::path::Path;

use candle_core::DType;
use zerodp::comm::{run_ranks, Communicator};
use zerodp::config::{load_str, ResolveContext, Settings};
use zerodp::data::{Corpus, DataLoader};
use zerodp::model::{Candle, Gpt, GptConfig};
use zerodp::trainer::{CheckpointOptions, ReportLog, Resume, Trainer};
use zerodp::zero::layout::FlatLayout;
use zerodp::zero::unit::UnitModel;
use zerodp::zero::{Engine, EngineConfig, EngineError, OptimizerTier, Stage, TierDtypes};

const GLOBAL: usize = 8;

fn loader() -> DataLoader {
    let text = "the quick brown fox jumps over the lazy dog; pack my box with five dozen jugs. "
        .repeat(40);
    DataLoader::new(
        Corpus::from_text("pangrams", &text),
        GptConfig::tiny().context,
        3,
    )
    .unwrap()
}

/// The tiny GPT on candle's composite ops (what a GPU runs), the device tier on or off.
fn gpt(tier: bool) -> Candle<Gpt> {
    let units = Gpt::with_options(GptConfig::tiny(), DType::F32, false).unwrap();
    Candle::new(units)
        .with_flat_transfers(true)
        .with_device_tier(tier)
}

/// One rank, two micro-batches a step, AdamW with weight decay, a warmup, clipping at 1.
fn settings(stage: u8, precision: &str) -> Settings {
    settings_on(1, stage, precision)
}

/// [`settings`] on `world` ranks (the same global batch).
fn settings_on(world: usize, stage: u8, precision: &str) -> Settings {
    let text = format!(
        r#"{{ "train_batch_size": {GLOBAL}, "gradient_accumulation_steps": 2,
             "optimizer": {{ "type": "AdamW", "params": {{ "lr": 0.003, "weight_decay": 0.01 }} }},
             "scheduler": {{ "type": "WarmupLR", "params": {{ "warmup_num_steps": 4,
                             "warmup_max_lr": 0.003 }} }},
             "gradient_clipping": 1.0,
             "zero_optimization": {{ "stage": {stage} }} {precision} }}"#
    );
    let ctx = ResolveContext {
        world_size: world,
        ..Default::default()
    };
    load_str(&text, "<test>", &ctx).unwrap().settings
}

const BF16: &str = r#", "bf16": { "enabled": true }"#;
const BF16_MOMENTS: &str =
    r#", "bf16": { "enabled": true }, "zerodp": { "optimizer_states_dtype": "bf16" }"#;
// fp16 from 2^24: the first steps overflow and are skipped while the scale comes down.
const FP16: &str = r#", "fp16": { "enabled": true, "initial_scale_power": 24, "hysteresis": 1 }"#;

struct Run {
    losses: Vec<f32>,
    skipped: Vec<bool>,
    params: Vec<Vec<f32>>,
}

/// Train `model` to step `steps`, saving into `save` at the end and resuming from `resume`.
fn run(
    model: &Candle<Gpt>,
    s: &Settings,
    steps: u64,
    save: Option<&Path>,
    resume: Option<&Path>,
) -> Run {
    run_checkpointed(&[model], s, steps, (save, resume))
}

/// [`run`] on `models.len()` in-process ranks, rank r on `models[r]`
/// (`Trainer::with_rank_models`; the trainer checks that every rank ends with the same
/// parameters).
fn run_checkpointed(
    models: &[&Candle<Gpt>],
    s: &Settings,
    steps: u64,
    (save, resume): (Option<&Path>, Option<&Path>),
) -> Run {
    let mut t = Trainer::from_settings(models[0], s, models.len(), 5)
        .unwrap()
        .keep_params(true);
    if models.len() > 1 {
        t = t.with_rank_models(models.to_vec());
    }
    if let Some(dir) = save {
        t = t.with_checkpoints(CheckpointOptions {
            dir: dir.to_path_buf(),
            every: None,
            keep_last: None,
            config: s.to_json(),
        });
    }
    if let Some(dir) = resume {
        t = t.with_resume(Resume::from_dir(dir).unwrap());
    }
    train(t, steps)
}

/// Run `t` to step `steps`: rank 0's losses and skipped steps, and the kept parameters.
fn train(t: Trainer<'_, Candle<Gpt>>, steps: u64) -> Run {
    train_logged(t, steps).0
}

/// [`train`], and every rank's step reports.
fn train_logged(
    t: Trainer<'_, Candle<Gpt>>,
    steps: u64,
) -> (Run, Vec<Vec<zerodp::zero::StepReport>>) {
    let log = ReportLog::new();
    let out = t.run(&loader(), steps, &[&log]).unwrap();
    let all = log.into_reports();
    let run = Run {
        losses: all[0].iter().map(|r| r.loss).collect(),
        skipped: all[0].iter().map(|r| r.skipped).collect(),
        params: out.params.expect("kept"),
    };
    (run, all)
}

/// Every loss of `got` within `tol` relative of `want`'s, and every parameter within `tol`
/// absolute.
fn assert_follows(got: &Run, want: &Run, tol: f32, what: &str) {
    assert_eq!(got.skipped, want.skipped, "{what}: skipped steps");
    for (a, b) in got.losses.iter().zip(&want.losses) {
        assert!(
            (a - b).abs() <= tol * b.abs(),
            "{what}: {:?} vs {:?}",
            got.losses,
            want.losses
        );
    }
    for (g, w) in got.params.iter().zip(&want.params) {
        let worst = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(worst <= tol, "{what}: a parameter differs by {worst}");
    }
}

/// The same run with the tier on the model's device and in the engine's host buffers: the
/// same losses, skipped steps (fp16 gradients overflow in both) and parameters, up to the
/// rounding of the candle ops' order (f32 to 1e-5; bf16 and fp16 to 2e-3, where one such
/// difference can flip a 16-bit rounding), at every stage (one rank holds everything at each).
#[test]
fn the_device_tier_trains_as_the_host_tier() {
    let (host, device) = (gpt(false), gpt(true));
    for (precision, tol) in [("", 1e-5), (BF16, 2e-3), (BF16_MOMENTS, 2e-3), (FP16, 2e-3)] {
        for stage in 0..=3u8 {
            let s = settings(stage, precision);
            let want = run(&host, &s, 8, None, None);
            let got = run(&device, &s, 8, None, None);
            let what = format!("stage {stage} {precision}");
            match precision == FP16 {
                true => assert!(want.skipped[0], "{what}: 2^24 overflows at first"),
                false => assert!(want.losses[7] < want.losses[0], "{what}: {:?}", want.losses),
            }
            assert_follows(&got, &want, tol, &what);
        }
    }
}

/// A checkpoint of a device-tier run holds the tier's state (the engine brings it back to host
/// memory first), and a resumed run continues bit for bit.
#[test]
fn a_device_tier_run_resumes_bit_for_bit() {
    let model = gpt(true);
    for precision in ["", BF16, BF16_MOMENTS] {
        let s = settings(0, precision);
        let straight = run(&model, &s, 6, None, None);
        let dir = tempfile::tempdir().unwrap();
        run(&model, &s, 3, Some(dir.path()), None);
        let resumed = run(&model, &s, 6, None, Some(dir.path()));
        assert_eq!(resumed.losses, straight.losses[3..], "{precision}");
        assert_eq!(resumed.params, straight.params, "{precision}");
    }
}

/// A model holding the tier is refused, with the reason, by a run that needs its state in host
/// memory.
#[test]
fn the_engine_refuses_the_tier_where_the_run_needs_host_memory() {
    let model = gpt(true);
    let mut offloaded = EngineConfig::new(Stage::Zero2, 1);
    offloaded.offload_optimizer = OptimizerTier::Host;
    for (cfg, why) in [
        (
            EngineConfig::new(Stage::Zero3, 2),
            "stage 3 on more than one rank",
        ),
        (offloaded, "offload_optimizer"),
    ] {
        let e = run_ranks(cfg.world_size, Default::default(), |comm, _| {
            let refused = Engine::new(&model, &*comm, cfg.clone()).err();
            Ok::<_, EngineError>(refused.map(|e| e.to_string()))
        })
        .unwrap();
        let e = e[0].clone().expect("refused");
        assert!(e.contains(why) && e.contains("with_device_tier"), "{e}");
    }
}

/// After a step on the device the host buffers are behind: the optimizer state is refused until
/// `sync_host` brings it back, and then it is what the step made. The step reports the tier's
/// bytes: 16 a parameter in fp32.
#[test]
fn the_host_copy_is_read_only_after_a_sync() {
    let model = gpt(true);
    run_ranks(1, Default::default(), |comm, _| {
        let mut cfg = EngineConfig::new(Stage::Zero0, 1);
        cfg.micro_batch = GLOBAL;
        let mut engine = Engine::new(&model, &*comm, cfg)?;
        let before = engine.optimizer_state(1)?.master.into_owned();
        let batch = loader().micro_batch(0, GLOBAL, 1, 0, GLOBAL, 0).unwrap();
        let report = engine.train_step(&[batch], 1e-3)?;
        // fp32: the parameters (their own master), the gradients and two moments.
        let psi = model.spec().num_params() as u64;
        assert_eq!(report.device_tier_bytes, 16 * psi);
        assert!(matches!(
            engine.optimizer_state(1),
            Err(EngineError::HostBehind)
        ));
        engine.sync_host()?;
        let state = engine.optimizer_state(1)?;
        let moved = (state.master.iter().zip(&before))
            .filter(|(a, b)| a != b)
            .count();
        assert!(
            moved > before.len() / 2,
            "{moved} of {} moved",
            before.len()
        );
        assert!(state.exp_avg_sq.iter().any(|&v| v > 0.0));
        Ok::<_, EngineError>(())
    })
    .unwrap();
}

/// Train on `models.len()` in-process ranks, rank r on `models[r]`.
fn run_ranks_on(models: &[&Candle<Gpt>], s: &Settings, steps: u64) -> Run {
    run_checkpointed(models, s, steps, (None, None))
}

/// Stage 0 on two ranks, each with its own model holding its tier: the ranks average their
/// gradients through host memory (the host tier's buckets and all-reduce) and take the same Adam
/// step on the device, so they train as two ranks of the host tier: the same losses, skipped fp16
/// steps and parameters, within the candle ops' rounding.
#[test]
fn stage_0_on_two_ranks_keeps_the_tier_on_the_device() {
    let host = gpt(false);
    let devices = [gpt(true), gpt(true)];
    for (precision, tol) in [("", 1e-5), (BF16, 2e-3), (FP16, 2e-3)] {
        let s = settings_on(2, 0, precision);
        let want = run_ranks_on(&[&host, &host], &s, 12);
        let got = run_ranks_on(&[&devices[0], &devices[1]], &s, 12);
        let what = format!("two ranks {precision}");
        match precision == FP16 {
            true => assert!(
                want.skipped[0] && !want.skipped[11],
                "{what}: {:?}",
                want.skipped
            ),
            false => assert!(
                want.losses[11] < want.losses[0],
                "{what}: {:?}",
                want.losses
            ),
        }
        assert_follows(&got, &want, tol, &what);
        // Not one rank's run: the average of two ranks' gradients moved the parameters.
        let alone = run_ranks_on(&[&devices[0]], &settings_on(1, 0, precision), 12);
        assert_ne!(alone.params, got.params, "{what}");
    }
    // One model for two ranks is not a model each.
    let s = settings_on(2, 0, "");
    let t = Trainer::from_settings(&devices[0], &s, 2, 5).unwrap();
    let Err(e) = t.with_rank_models(vec![&devices[0]]).run(&loader(), 1, &[]) else {
        panic!("one model for two ranks was accepted");
    };
    assert!(e.to_string().contains("1 rank models for 2"), "{e}");
    // A rank model of another shape is not the same model.
    let config = GptConfig {
        layers: GptConfig::tiny().layers + 1,
        ..GptConfig::tiny()
    };
    let other = Candle::new(Gpt::with_options(config, DType::F32, false).unwrap());
    let t = Trainer::from_settings(&devices[0], &s, 2, 5).unwrap();
    let Err(e) = t
        .with_rank_models(vec![&devices[0], &other])
        .run(&loader(), 1, &[])
    else {
        panic!("a rank model of another shape was accepted");
    };
    assert!(
        e.to_string().contains("rank 1's model has other units"),
        "{e}"
    );
}

/// Two in-process ranks given one model holding the tier: the second engine is refused (the
/// tier holds one rank's gradients), naming the fix; once the first is dropped the tier is free.
#[test]
fn two_ranks_cannot_share_one_model_s_tier() {
    let model = gpt(true);
    let cfg = EngineConfig::new(Stage::Zero0, 2);
    let refused = run_ranks(2, Default::default(), |comm, _| {
        let engine = Engine::new(&model, &*comm, cfg.clone());
        // Both engines exist (or failed) before either is dropped.
        comm.barrier().wait()?;
        Ok::<_, EngineError>(engine.err().map(|e| e.to_string()))
    })
    .unwrap();
    let errors: Vec<&String> = refused.iter().flatten().collect();
    assert_eq!(errors.len(), 1, "{refused:?}");
    assert!(
        errors[0].contains("held by another rank") && errors[0].contains("a model of its own"),
        "{}",
        errors[0]
    );
    run_ranks(1, Default::default(), |comm, _| {
        Engine::new(&model, &*comm, EngineConfig::new(Stage::Zero0, 1)).map(|_| ())
    })
    .expect("the tier is free again");
}

/// Stages 1-2 on two ranks, each with its own model holding its tier: each rank keeps the
/// master and moments of its own shard on the device, the ranks reduce-scatter their gradients
/// through host memory, each updates its shard there, and the host all-gather gives both the
/// whole parameters. They train as two ranks of the host tier (the same losses, skipped fp16
/// steps and parameters, within the candle ops' rounding), and each rank's tier holds the
/// parameters and gradients whole and the rest over its shard only.
#[test]
fn stages_1_and_2_on_two_ranks_shard_the_tier_s_optimizer_state() {
    let host = gpt(false);
    let devices = [gpt(true), gpt(true)];
    let spec = host.spec().clone();
    for stage in [1u8, 2] {
        for (precision, tol) in [("", 1e-5), (BF16, 2e-3), (BF16_MOMENTS, 2e-3), (FP16, 2e-3)] {
            let s = settings_on(2, stage, precision);
            let want = run_ranks_on(&[&host, &host], &s, 12);
            let t = Trainer::from_settings(&devices[0], &s, 2, 5)
                .unwrap()
                .keep_params(true)
                .with_rank_models(vec![&devices[0], &devices[1]]);
            let (got, reports) = train_logged(t, 12);
            let what = format!("stage {stage} on two ranks {precision}");
            match precision == FP16 {
                true => assert!(want.skipped[0], "{what}: {:?}", want.skipped),
                false => assert!(
                    want.losses[11] < want.losses[0],
                    "{what}: {:?}",
                    want.losses
                ),
            }
            assert_follows(&got, &want, tol, &what);
            // Each rank's tier: the parameters and gradients of every unit, the master, the
            // moments and the reduced gradient of its own shard.
            let trainer = Trainer::from_settings(&host, &s, 2, 5).unwrap();
            let engine = trainer.engine_config().clone();
            for (rank, steps) in reports.iter().enumerate() {
                let layout = FlatLayout::new(&spec, 2, rank);
                let want_bytes: u64 = (0..spec.units.len())
                    .map(|u| {
                        let numel = layout.units[u].numel;
                        let own = layout.own_shard(u);
                        let part = own.end.min(numel).saturating_sub(own.start);
                        TierDtypes::of(&engine).bytes(numel as u64, part as u64, 4)
                    })
                    .sum();
                assert_eq!(
                    steps[11].device_tier_bytes, want_bytes,
                    "{what}: rank {rank}"
                );
            }
        }
    }
}

/// A stage-2 run on two ranks' tiers resumes bit for bit from its sharded checkpoint (each
/// rank's tier brought back to host memory and written as its shard), and a one-rank run of the
/// host tier resumes from the same checkpoint.
#[test]
fn a_sharded_device_tier_run_resumes_bit_for_bit() {
    let devices = [gpt(true), gpt(true)];
    let models = [&devices[0], &devices[1]];
    let s = settings_on(2, 2, BF16);
    let straight = run_ranks_on(&models, &s, 6);
    let dir = tempfile::tempdir().unwrap();
    run_checkpointed(&models, &s, 3, (Some(dir.path()), None));
    let resumed = run_checkpointed(&models, &s, 6, (None, Some(dir.path())));
    assert_eq!(resumed.losses, straight.losses[3..]);
    assert_eq!(resumed.params, straight.params);
    // The checkpoint holds the master and moments both ranks' tiers had: one rank of the host
    // tier, with the same global batch, continues from them.
    let host = gpt(false);
    let one = run_checkpointed(
        &[&host],
        &settings_on(1, 2, BF16),
        6,
        (None, Some(dir.path())),
    );
    assert_follows(
        &one,
        &Run {
            losses: straight.losses[3..].to_vec(),
            skipped: straight.skipped[3..].to_vec(),
            params: straight.params.clone(),
        },
        2e-3,
        "resumed on one rank",
    );
}

/// Sixteen ranks at stage 2: the last unit (the final LayerNorm, 64 elements) pads to 128, so
/// ranks 8-15's shards of it are all padding and their part of it is empty (on a GPU it lives in
/// host memory, which allocates nothing). The tiers still train as the host tier's sixteen ranks.
#[test]
fn ranks_whose_shard_is_all_padding_train_as_the_host_tier() {
    let world = 16;
    let host = gpt(false);
    let spec = host.spec().clone();
    let last = spec.units.len() - 1;
    let empty = (0..world)
        .filter(|&r| {
            let layout = FlatLayout::new(&spec, world, r);
            layout.own_shard(last).start >= layout.units[last].numel
        })
        .count();
    assert_eq!(
        empty, 8,
        "the premise: half the ranks hold only padding of the last unit"
    );
    let devices: Vec<Candle<Gpt>> = (0..world).map(|_| gpt(true)).collect();
    for (precision, tol) in [("", 1e-5), (BF16, 2e-3)] {
        let text = format!(
            r#"{{ "train_batch_size": 16, "gradient_accumulation_steps": 1,
                 "optimizer": {{ "type": "AdamW", "params": {{ "lr": 0.003 }} }},
                 "gradient_clipping": 1.0, "zero_optimization": {{ "stage": 2 }} {precision} }}"#
        );
        let ctx = ResolveContext {
            world_size: world,
            ..Default::default()
        };
        let s = load_str(&text, "<test>", &ctx).unwrap().settings;
        let want = run_ranks_on(&vec![&host; world], &s, 4);
        let got = run_ranks_on(&devices.iter().collect::<Vec<_>>(), &s, 4);
        assert!(want.losses[3] < want.losses[0], "{:?}", want.losses);
        assert_follows(&got, &want, tol, &format!("sixteen ranks {precision}"));
    }
}
