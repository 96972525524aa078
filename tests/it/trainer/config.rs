//! The library's `Trainer` built from a DeepSpeed config file with a model defined here (no code
//! from the CLI): every stage agrees with one rank, the scheduler drives the learning rate, and
//! OneCycle's `cycle_momentum` cycles Adam's betas as DeepSpeed does.

use crate::common;

use common::*;
use std::path::Path;
use std::sync::Arc;
use zerodp::comm::{run_ranks, CommOptions, Communicator, InprocComm};
use zerodp::config::{load_str, ResolveContext};
use zerodp::optim::scheduler::{betas_at, lr_at};
use zerodp::trainer::{Backend, BatchIndex, ReportLog, Trainer};
use zerodp::zero::{Engine, EngineError};

const GLOBAL: usize = 12;
const SEQ: usize = 4;

fn write_config(dir: &Path, stage: u8, extra: &str) -> std::path::PathBuf {
    let path = dir.join(format!("ds_{stage}.json"));
    std::fs::write(
        &path,
        format!(
            r#"{{ "train_batch_size": {GLOBAL}, "gradient_accumulation_steps": 1,
                 "optimizer": {{ "type": "AdamW", "params": {{ "lr": 0.01, "weight_decay": 0.01 }} }},
                 "gradient_clipping": 1.0,
                 "zero_optimization": {{ "stage": {stage}, "reduce_bucket_size": 50 }}
                 {extra} }}"#
        ),
    )
    .unwrap();
    path
}

/// Per-step losses of rank 0, every rank checked equal.
fn losses(model: &Toy, config: &Path, world: usize, steps: u64) -> Vec<f32> {
    losses_on(model, config, world, steps, Backend::InProcess)
}

/// [`losses`] with the ranks on `backend`.
fn losses_on(model: &Toy, config: &Path, world: usize, steps: u64, backend: Backend) -> Vec<f32> {
    let trainer = Trainer::from_config_file(model, config, world, 7)
        .unwrap()
        .with_backend(backend);
    let ga = trainer.engine_config().grad_accum;
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
    trainer.run(&source, steps, &[&log]).unwrap();
    let reports = log.into_reports();
    for r in &reports {
        let l: Vec<f32> = r.iter().map(|s| s.loss).collect();
        let l0: Vec<f32> = reports[0].iter().map(|s| s.loss).collect();
        assert_eq!(l, l0, "ranks disagree");
    }
    reports[0].iter().map(|s| s.loss).collect()
}

#[test]
fn a_trainer_from_a_config_file_trains_every_stage_like_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let model = Toy::new(16, 8, 2, true);
    let reference = losses(&model, &write_config(dir.path(), 0, ""), 1, 4);
    assert!(reference[3] < reference[0], "loss falls: {reference:?}");
    for stage in 0..=3u8 {
        for world in [2, 3, 4] {
            let got = losses(&model, &write_config(dir.path(), stage, ""), world, 4);
            for (a, b) in got.iter().zip(&reference) {
                assert!(
                    (a - b).abs() <= 1e-5 * b.abs(),
                    "stage {stage} world {world}: {got:?} vs {reference:?}"
                );
            }
        }
    }
}

/// In-process ranks on `world` communicators made by the caller (as `train --nccl` hands the
/// trainer NCCL's group), in rank order.
fn group(world: usize) -> Vec<Arc<dyn Communicator>> {
    (InprocComm::create_world(world, CommOptions::default()).unwrap())
        .into_iter()
        .map(|c| Arc::new(c) as Arc<dyn Communicator>)
        .collect()
}

/// `Backend::Group`: ranks as threads on communicators the caller made (NCCL's, under `train
/// --nccl`) train bit for bit as the trainer's own in-process ranks; a group of the wrong size,
/// or out of rank order, is refused.
#[test]
fn a_trainer_on_the_caller_s_communicators_trains_as_its_own_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let model = Toy::new(16, 8, 2, true);
    for stage in [0u8, 2, 3] {
        let config = write_config(dir.path(), stage, "");
        let own = losses(&model, &config, 3, 4);
        let comms = group(3);
        let given = losses_on(&model, &config, 3, 4, Backend::Group(comms.clone()));
        assert_eq!(given, own, "stage {stage}");
        // The ranks ran on the given communicators.
        for c in &comms {
            assert!(
                c.traffic().total_sent() > 0,
                "rank {} moved nothing",
                c.rank()
            );
        }
    }
    let config = write_config(dir.path(), 2, "");
    let trainer = || Trainer::from_config_file(&model, &config, 3, 7).unwrap();
    let source = |at: BatchIndex| -> Result<_, String> {
        Ok(rank_batches(at.step as usize, at.rank, at.world_size, 1, GLOBAL, SEQ, 16)[0].clone())
    };
    let e = (trainer().with_backend(Backend::Group(group(2))))
        .run(&source, 1, &[])
        .unwrap_err();
    assert!(e.to_string().contains("2 communicators for 3 ranks"), "{e}");
    let mut reversed = group(3);
    reversed.reverse();
    let e = (trainer().with_backend(Backend::Group(reversed)))
        .run(&source, 1, &[])
        .unwrap_err();
    assert!(e.to_string().contains("not rank 0 of 3"), "{e}");
}

const ONE_CYCLE: &str = r#", "scheduler": { "type": "OneCycle", "params": {
    "cycle_min_lr": 0.001, "cycle_max_lr": 0.02, "cycle_first_step_size": 3,
    "cycle_min_mom": 0.8, "cycle_max_mom": 0.95 CYCLE } }"#;

#[test]
fn one_cycle_cycles_adams_betas_as_deepspeed_does() {
    let dir = tempfile::tempdir().unwrap();
    let model = Toy::new(16, 8, 2, true);
    let cycling = write_config(dir.path(), 2, &ONE_CYCLE.replace("CYCLE", ""));
    let steps = 6;
    let got = losses(&model, &cycling, 2, steps);

    // The same run by hand: DeepSpeed's formulas for the lr and the betas of every step, written
    // into the engine before each step.
    let text = std::fs::read_to_string(&cycling).unwrap();
    let ctx = ResolveContext {
        world_size: 2,
        ..Default::default()
    };
    let settings = load_str(&text, "<test>", &ctx).unwrap().settings;
    let sched = settings.scheduler.clone().unwrap();
    let cfg = zerodp::setup::engine_config(&settings, 2, 7).unwrap();
    let by_hand = run_ranks(2, CommOptions::default(), |comm, rank| {
        let mut engine = Engine::new(&model, &*comm, cfg.clone())?;
        let mut out = Vec::new();
        for step in 0..steps {
            let [b1, b2] = betas_at(&sched, step).unwrap();
            engine.set_betas(b1, b2);
            let lr = lr_at(&sched, 0.01, step) as f32;
            let b = rank_batches(step as usize, rank, 2, 1, GLOBAL, SEQ, 16);
            out.push(engine.train_step(&b, lr)?.loss);
        }
        Ok::<_, EngineError>(out)
    })
    .unwrap();
    assert_eq!(got, by_hand[0], "the trainer applies DeepSpeed's betas");
    assert_eq!(betas_at(&sched, 0), Some([0.8, 0.99]));

    // Without cycling the betas stay the optimizer's, and the losses part ways.
    let fixed = write_config(
        dir.path(),
        1,
        &ONE_CYCLE.replace("CYCLE", r#", "cycle_momentum": false"#),
    );
    let fixed_losses = losses(&model, &fixed, 2, steps);
    assert_eq!(got[0], fixed_losses[0]);
    assert_ne!(got[steps as usize - 1], fixed_losses[steps as usize - 1]);
}
