//! Mixed precision (bf16/fp16 parameters and gradients, fp32 master weights and Adam moments):
//! memory by the ZeRO formulas, loss curves against fp32, halved traffic, and Inf/NaN steps
//! skipped on every rank.

use crate::common;

use common::*;
use zerodp::comm::{run_ranks, CollectiveKind, CommOptions};
use zerodp::data::TokenBatch as Batch;
use zerodp::flat::DType;
use zerodp::zero::buffers::plan;
use zerodp::zero::layout::FlatLayout;
use zerodp::zero::unit::{BatchCounts, ForwardMode, ModelError, ModelSpec, UnitForward, UnitModel};
use zerodp::zero::{Engine, EngineConfig, EngineError, Stage, StepReport};

const GLOBAL: usize = 12;
const SEQ: usize = 4;
const STAGES: [Stage; 4] = [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3];

fn spec_of<M: UnitModel>(m: &M) -> ModelSpec {
    m.spec().clone()
}

#[test]
fn bf16_model_state_bytes_follow_the_zero_formulas() {
    let model = Toy::new(16, 8, 3, true);
    for stage in STAGES {
        for world in [1, 2, 4] {
            let mut cfg = test_config(stage, world, 1, GLOBAL).with_precision(DType::BF16);
            cfg.reduce_bucket_size = 100;
            let run = train(&model, &cfg, 1, GLOBAL, SEQ);
            let layout = FlatLayout::new(&spec_of(&model), world, 0);
            let psi = layout.padded_numel() as u64;
            let n = world as u64;
            // (params, grads, master, Adam m and v) in bytes: 2 + 2 + 4 + 8 per element, the
            // sharded kinds divided by N.
            let (params, grads, master, opt) = match stage {
                Stage::Zero0 => (2 * psi, 2 * psi, 4 * psi, 8 * psi),
                Stage::Zero1 => (2 * psi, 2 * psi, 4 * psi / n, 8 * psi / n),
                Stage::Zero2 => (2 * psi, 2 * psi / n, 4 * psi / n, 8 * psi / n),
                Stage::Zero3 => (2 * psi / n, 2 * psi / n, 4 * psi / n, 8 * psi / n),
            };
            let formula = match stage {
                Stage::Zero0 => 16 * psi,
                Stage::Zero1 => 4 * psi + 12 * psi / n,
                Stage::Zero2 => 2 * psi + 14 * psi / n,
                Stage::Zero3 => 16 * psi / n,
            };
            assert_eq!(params + grads + master + opt, formula);
            let plan = plan(&spec_of(&model), &cfg);
            let buffers = plan.buffer_bytes();
            for reports in &run.reports {
                let m = reports[0].memory;
                assert_eq!(
                    (m.params, m.grads, m.master, m.optimizer_states, m.buffers),
                    (params, grads, master, opt, buffers),
                    "{stage:?} world {world}"
                );
                assert_eq!(m.total, formula + buffers + m.gather);
                // Stage 3 gathers 16-bit parameters: the pool is sized in bf16.
                assert!(reports[0].peak_gather_bytes <= plan.gather_bytes());
            }
        }
    }
}

/// Relative difference of two loss curves, step by step.
fn curve_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / x.abs().max(1e-6))
        .fold(0.0, f32::max)
}

/// bf16 rounds every parameter the model reads to 8 significant bits (relative error up to
/// 2^-9 ~ 2e-3 per value, one bf16 half-ulp) and every gradient too, while the fp32 master keeps
/// the updates exact, so the rounding does not accumulate across steps: the loss differs from
/// fp32's by at most about one bf16 rounding of its inputs. Measured: at most 3.5e-4 relative
/// over 12 steps at world sizes 1, 2 and 4. The bound is two bf16 half-ulps (2 * 2^-9); a lost
/// update, a wrong loss scale or a misplaced shard moves the loss by far more.
const BF16_VS_FP32: f32 = 2.0 / 512.0;

#[test]
fn bf16_tracks_fp32_and_every_stage_matches_stage_0() {
    let model = Toy::new(16, 8, 3, true);
    let steps = 12;
    for world in [1, 2, 4] {
        let fp32 = train(
            &model,
            &test_config(Stage::Zero0, world, 1, GLOBAL),
            steps,
            GLOBAL,
            SEQ,
        )
        .losses();
        assert!(fp32[steps - 1] < fp32[0], "the loss falls: {fp32:?}");
        let mut stage0 = None;
        for stage in STAGES {
            let cfg = test_config(stage, world, 1, GLOBAL).with_precision(DType::BF16);
            let run = train(&model, &cfg, steps, GLOBAL, SEQ);
            let bf16 = run.losses();
            let d = curve_diff(&fp32, &bf16);
            assert!(
                d < BF16_VS_FP32,
                "{stage:?} world {world}: bf16 {bf16:?} vs fp32 {fp32:?} ({d})"
            );
            assert!(run.reports.iter().flatten().all(|r| !r.skipped));
            match &stage0 {
                None => stage0 = Some(run),
                Some(s0) => {
                    // Without accumulation every stage rounds the same values in the same places
                    // (the f32 gradient to bf16 once, the f32-accumulated reduction to bf16
                    // once, the master to bf16 once): the runs are bitwise equal.
                    assert_eq!(s0.losses(), bf16, "{stage:?} world {world} vs stage 0");
                    assert_eq!(s0.params, run.params, "{stage:?} world {world} vs stage 0");
                }
            }
        }
    }
}

#[test]
fn bf16_with_accumulation_and_clipping_matches_across_stages() {
    let model = Toy::new(16, 8, 3, true);
    let steps = 8;
    let base = |stage| {
        let mut c = test_config(stage, 2, 2, GLOBAL).with_precision(DType::BF16);
        c.gradient_clipping = 0.5;
        c
    };
    let s0 = train(&model, &base(Stage::Zero0), steps, GLOBAL, SEQ);
    for stage in [Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        let run = train(&model, &base(stage), steps, GLOBAL, SEQ);
        // Stages 0-1 accumulate each rank's bf16 gradient before reducing, stages 2-3 reduce each
        // micro-step and accumulate the reduced bf16 shard: the gradients are one bf16 rounding
        // apart (2^-9), and so are the losses at most (measured: 2.1e-4 at stages 2-3, 0 at 1).
        let d = curve_diff(&s0.losses(), &run.losses());
        assert!(d < 1.0 / 512.0, "{stage:?}: {d}");
        if stage == Stage::Zero1 {
            assert_eq!(s0.losses(), run.losses());
        }
    }
}

#[test]
fn sixteen_bit_collectives_move_half_the_bytes() {
    let model = Toy::new(16, 8, 3, true);
    let traffic = |stage, dtype| {
        let cfg = test_config(stage, 2, 1, GLOBAL).with_precision(dtype);
        train(&model, &cfg, 2, GLOBAL, SEQ).reports[0][1]
            .traffic
            .clone()
    };
    // Stage 1 all-reduces only the two f32 scalars (loss, squared norm).
    let scalars = traffic(Stage::Zero1, DType::F32).sent(CollectiveKind::AllReduce);
    assert!(scalars > 0);
    for stage in STAGES {
        let full = traffic(stage, DType::F32);
        for dtype in [DType::BF16, DType::F16] {
            let half = traffic(stage, dtype);
            for kind in [CollectiveKind::ReduceScatter, CollectiveKind::AllGather] {
                assert_eq!(
                    full.sent(kind),
                    2 * half.sent(kind),
                    "{stage:?} {dtype} {kind:?}"
                );
                assert_eq!(
                    full.recv(kind),
                    2 * half.recv(kind),
                    "{stage:?} {dtype} {kind:?}"
                );
            }
            let ar =
                |t: &zerodp::comm::TrafficCounters| t.sent(CollectiveKind::AllReduce) - scalars;
            assert_eq!(ar(&full), 2 * ar(&half), "{stage:?} {dtype} all_reduce");
            let moved = half.total_sent();
            assert!(moved > 0 && 2 * (moved - scalars) == full.total_sent() - scalars);
        }
    }
}

/// The toy model with a test-only fault: backward writes `value` into the first gradient element
/// of unit `unit` for every batch whose tokens are `trigger` (one rank's micro-batch of one step).
struct Poisoned {
    inner: Toy,
    unit: usize,
    value: f32,
    triggers: Vec<Vec<u32>>,
}

impl UnitModel for Poisoned {
    type Batch = Batch;
    type Act = Act;
    type Saved = (Saved, bool);

    fn batch_counts(&self, batch: &Batch) -> BatchCounts {
        batch.counts()
    }

    fn spec(&self) -> &ModelSpec {
        self.inner.spec()
    }
    fn init_params(&self, unit: usize, seed: u64, out: &mut [f32]) {
        self.inner.init_params(unit, seed, out)
    }
    fn forward(
        &self,
        unit: usize,
        params: &[&[f32]],
        input: Option<&Act>,
        batch: &Batch,
        mode: ForwardMode,
    ) -> Result<UnitForward<Act, Self::Saved>, ModelError> {
        let out = self.inner.forward(unit, params, input, batch, mode)?;
        let hit = unit == self.unit && self.triggers.contains(&batch.tokens);
        Ok(UnitForward {
            output: out.output,
            loss: out.loss,
            saved: out.saved.map(|s| (s, hit)),
        })
    }
    fn backward(
        &self,
        unit: usize,
        (saved, hit): Self::Saved,
        grad_output: Option<&Act>,
        loss_weight: f32,
        grads: &mut [&mut [f32]],
    ) -> Result<Option<Act>, ModelError> {
        let g = self
            .inner
            .backward(unit, saved, grad_output, loss_weight, grads)?;
        if hit {
            grads[0][0] = self.value;
        }
        Ok(g)
    }
}

/// Every rank's reports, and the master weights after every step (index 0: before the first).
struct Traced {
    reports: Vec<Vec<StepReport>>,
    params: Vec<Vec<Vec<Vec<f32>>>>,
}

fn train_traced(model: &Poisoned, cfg: &EngineConfig, steps: usize) -> Result<Traced, String> {
    let world = cfg.world_size;
    let out = run_ranks(world, CommOptions::default(), |comm, rank| {
        let mut engine = Engine::new(model, &*comm, cfg.clone())?;
        let mut reports = Vec::new();
        let mut params = vec![engine.full_params()?];
        for step in 0..steps {
            let b = rank_batches(step, rank, world, 1, GLOBAL, SEQ, model.inner.vocab);
            reports.push(engine.train_step(&b, LR)?);
            params.push(engine.full_params()?);
        }
        Ok::<_, EngineError>((reports, params))
    })
    .map_err(|e| e.to_string())?;
    let (reports, params) = out.into_iter().unzip();
    Ok(Traced { reports, params })
}

/// Poison rank 1's micro-batch at each of `steps` in a world of 2 (`layer0` is unit 1).
fn poisoned(value: f32, steps: &[usize]) -> Poisoned {
    let inner = Toy::new(16, 8, 2, true);
    let triggers = steps
        .iter()
        .map(|&s| {
            rank_batches(s, 1, 2, 1, GLOBAL, SEQ, inner.vocab)[0]
                .tokens
                .clone()
        })
        .collect();
    Poisoned {
        inner,
        unit: 1,
        value,
        triggers,
    }
}

#[test]
fn an_inf_on_one_rank_skips_the_fp16_step_everywhere_and_halves_after_the_hysteresis() {
    let model = poisoned(f32::INFINITY, &[1, 2]);
    for stage in STAGES {
        let cfg = test_config(stage, 2, 1, GLOBAL).with_precision(DType::F16);
        let t = train_traced(&model, &cfg, 4).unwrap();
        for (rank, reports) in t.reports.iter().enumerate() {
            let what = format!("{stage:?} rank {rank}");
            let skipped: Vec<bool> = reports.iter().map(|r| r.skipped).collect();
            assert_eq!(skipped, [false, true, true, false], "{what}");
            let scales: Vec<f32> = reports.iter().map(|r| r.loss_scale).collect();
            // Hysteresis 2: the first overflow only uses it up, the second halves the scale.
            assert_eq!(scales, [65536.0, 65536.0, 65536.0, 32768.0], "{what}");
            assert_eq!(reports[1].non_finite_units, ["layer0"], "{what}");
            // Skipped steps leave every parameter exactly as it was, on every rank.
            assert_eq!(t.params[rank][1], t.params[rank][3], "{what}");
            assert_ne!(t.params[rank][3], t.params[rank][4], "{what}");
            assert_eq!(t.params[rank], t.params[0], "{what}");
        }
    }
}

#[test]
fn a_nan_under_bf16_is_caught_and_the_step_skipped() {
    let model = poisoned(f32::NAN, &[1]);
    for stage in STAGES {
        let cfg = test_config(stage, 2, 1, GLOBAL).with_precision(DType::BF16);
        let t = train_traced(&model, &cfg, 3).unwrap();
        for (rank, reports) in t.reports.iter().enumerate() {
            let skipped: Vec<bool> = reports.iter().map(|r| r.skipped).collect();
            assert_eq!(skipped, [false, true, false], "{stage:?} rank {rank}");
            assert!(reports.iter().all(|r| r.loss_scale == 1.0));
            assert_eq!(reports[1].non_finite_units, ["layer0"]);
            assert_eq!(t.params[rank][1], t.params[rank][2]);
            assert!(t.params[rank][3].iter().flatten().all(|x| x.is_finite()));
        }
    }
}

#[test]
fn too_many_non_finite_steps_in_a_row_stop_the_run_naming_the_unit() {
    let model = poisoned(f32::NAN, &[1, 2]);
    for dtype in [DType::F32, DType::BF16] {
        let mut cfg = test_config(Stage::Zero2, 2, 1, GLOBAL).with_precision(dtype);
        cfg.max_skipped_steps = 2;
        let err = train_traced(&model, &cfg, 4).err().expect("the run stops");
        assert!(
            err.contains("2 optimizer steps in a row") && err.contains("layer0"),
            "{err}"
        );
        cfg.max_skipped_steps = 3;
        assert!(train_traced(&model, &cfg, 4).is_ok());
    }
}

#[test]
fn fp16_at_the_minimum_scale_is_an_error_naming_the_unit() {
    let model = poisoned(f32::INFINITY, &[0, 1, 2]);
    let mut cfg = test_config(Stage::Zero1, 2, 1, GLOBAL).with_precision(DType::F16);
    cfg.overflow = zerodp::zero::step_policy::OverflowPolicy::LossScale {
        loss_scale: 0.0,
        dynamic: zerodp::zero::loss_scaler::DynamicScaleParams {
            initial_scale_power: 1,
            hysteresis: 1,
            min_scale: 1.0,
            ..Default::default()
        },
    };
    // 2 -> 1 on the first overflow, then the second overflow is at the minimum.
    let err = train_traced(&model, &cfg, 3).err().expect("the run stops");
    assert!(
        err.contains("minimum") && err.contains("layer0") && err.contains("2 optimizer steps"),
        "{err}"
    );
}

#[test]
fn fp32_reductions_and_accumulation_with_bf16_parameters() {
    // DeepSpeed's bf16 default at stage 0 accumulates gradients in fp32, and
    // communication_data_type fp32 reduces in fp32. Parameters still travel in bf16.
    let model = Toy::new(16, 8, 3, true);
    let (world, n) = (2, 2u64);
    let psi = FlatLayout::new(&spec_of(&model), world, 0).padded_numel() as u64;
    for stage in STAGES {
        let fp32 = train(
            &model,
            &test_config(stage, world, 1, GLOBAL),
            3,
            GLOBAL,
            SEQ,
        );
        let mut cfg = test_config(stage, world, 1, GLOBAL).with_precision(DType::BF16);
        cfg.comm_dtype = DType::F32;
        cfg.grad_accum_dtype = DType::F32;
        let run = train(&model, &cfg, 3, GLOBAL, SEQ);
        let d = curve_diff(&fp32.losses(), &run.losses());
        assert!(d < BF16_VS_FP32, "{stage:?}: {d}");
        let m = run.reports[0][2].memory;
        let grads = if stage.shards_grads() {
            4 * psi / n
        } else {
            4 * psi
        };
        assert_eq!(
            (m.params, m.grads),
            (2 * psi / if stage == Stage::Zero3 { n } else { 1 }, grads)
        );
        let (t, f) = (&run.reports[0][2].traffic, &fp32.reports[0][2].traffic);
        for kind in [CollectiveKind::ReduceScatter, CollectiveKind::AllReduce] {
            assert_eq!(t.sent(kind), f.sent(kind), "{stage:?} {kind:?} in f32");
        }
        let ag = CollectiveKind::AllGather;
        assert_eq!(2 * t.sent(ag), f.sent(ag), "{stage:?}: parameters in bf16");
    }
}

#[test]
fn strict_bf16_stage3_gathers_in_16_bits_and_matches_stage_0() {
    // Nothing persistent, nothing kept between forward and backward: every unit is gathered in
    // bf16 from its shards before each use, recomputed in backward, and released.
    let model = Toy::new(16, 8, 4, true);
    const G16: usize = 16;
    for world in [2, 4] {
        let s0 = train(
            &model,
            &test_config(Stage::Zero0, world, 2, G16).with_precision(DType::BF16),
            5,
            G16,
            SEQ,
        );
        let mut cfg = test_config(Stage::Zero3, world, 2, G16).with_precision(DType::BF16);
        cfg.param_persistence_threshold = 0;
        cfg.max_reuse_distance = 0;
        cfg.prefetch_bucket_size = 1 << 20;
        let run = train(&model, &cfg, 5, G16, SEQ);
        let d = curve_diff(&s0.losses(), &run.losses());
        assert!(d < 1.0 / 512.0, "world {world}: {d}");
        let plan = plan(&spec_of(&model), &cfg);
        let largest = FlatLayout::new(&spec_of(&model), world, 0).largest_padded() as u64;
        for r in &run.reports {
            let peak = r[4].peak_gather_bytes;
            // The pool holds bf16: at least one whole unit was gathered, 2 bytes per element.
            assert!(peak >= 2 * largest && peak <= plan.gather_bytes(), "{peak}");
            assert!(r.iter().all(|s| !s.skipped));
        }
    }
}

/// `bf16_master_weights_and_grads`: no fp32 master (params 2 + grads 2 + moments 8 bytes per
/// element, sharded by stage: 12Ψ, 4Ψ + 8Ψ/N, 2Ψ + 10Ψ/N, 12Ψ/N), the bf16 parameters updated in
/// place with stochastic rounding keyed by each element's place: every stage, and host and NVMe
/// offload, give the same bits as stage 0 at each world size; the loss tracks the run with an fp32
/// master within the bound below.
#[test]
fn bf16_master_weights_drop_the_master_and_match_across_stages_and_offloads() {
    let model = Toy::new(16, 8, 3, true);
    let steps = 12;
    let dir = tempfile::tempdir().unwrap();
    for world in [1, 2, 4] {
        let with_master = train(
            &model,
            &test_config(Stage::Zero0, world, 1, GLOBAL).with_precision(DType::BF16),
            steps,
            GLOBAL,
            SEQ,
        )
        .losses();
        let mut stage0: Option<Run> = None;
        for stage in STAGES {
            let mut cfg = test_config(stage, world, 1, GLOBAL).with_precision(DType::BF16);
            cfg.bf16_master_weights = true;
            let run = train(&model, &cfg, steps, GLOBAL, SEQ);
            let psi = FlatLayout::new(&spec_of(&model), world, 0).padded_numel() as u64;
            let n = world as u64;
            let (params, grads, opt) = match stage {
                Stage::Zero0 => (2 * psi, 2 * psi, 8 * psi),
                Stage::Zero1 => (2 * psi, 2 * psi, 8 * psi / n),
                Stage::Zero2 => (2 * psi, 2 * psi / n, 8 * psi / n),
                Stage::Zero3 => (2 * psi / n, 2 * psi / n, 8 * psi / n),
            };
            for reports in &run.reports {
                let m = reports[0].memory;
                let got = (m.params, m.grads, m.master, m.optimizer_states);
                assert_eq!(got, (params, grads, 0, opt), "{stage:?} world {world}");
            }
            let d = curve_diff(&with_master, &run.losses());
            assert!(
                d < BF16_MASTER_VS_FP32_MASTER,
                "{stage:?} world {world}: {d}"
            );
            let mut offloaded = Vec::new();
            if stage != Stage::Zero0 {
                let mut host = cfg.clone();
                host.offload_optimizer = zerodp::zero::OptimizerTier::Host;
                offloaded.push(host);
                let mut nvme = cfg.clone();
                nvme.offload_optimizer = zerodp::zero::OptimizerTier::Nvme {
                    dir: dir.path().to_path_buf(),
                    chunk: 100,
                    buffer_count: 4,
                };
                offloaded.push(nvme);
            }
            for off in offloaded {
                let o = train(&model, &off, steps, GLOBAL, SEQ);
                assert_eq!(
                    o.losses(),
                    run.losses(),
                    "{stage:?} world {world} offloaded"
                );
                assert_eq!(o.params, run.params, "{stage:?} world {world} offloaded");
            }
            match &stage0 {
                None => stage0 = Some(run),
                Some(s0) => {
                    assert_eq!(
                        s0.losses(),
                        run.losses(),
                        "{stage:?} world {world} vs stage 0"
                    );
                    assert_eq!(s0.params, run.params, "{stage:?} world {world} vs stage 0");
                }
            }
        }
    }
}

/// Without a master the parameters themselves carry 8 significant bits and each update adds a
/// stochastic rounding of up to one bf16 ulp; measured against the run with an fp32 master: at
/// most 4.5e-4 relative over 12 steps at world sizes 1, 2 and 4. The bound is one bf16 half-ulp
/// (2^-9), four times that.
const BF16_MASTER_VS_FP32_MASTER: f32 = 1.0 / 512.0;

/// A bf16 master needs bf16 parameters.
#[test]
fn bf16_master_weights_need_bf16_parameters() {
    let model = Toy::new(16, 8, 2, true);
    let mut cfg = test_config(Stage::Zero2, 1, 1, GLOBAL);
    cfg.bf16_master_weights = true;
    let source = |_: zerodp::trainer::BatchIndex| -> Result<Batch, String> {
        panic!("no batch may be asked for when the configuration is refused")
    };
    let err = zerodp::trainer::Trainer::new(&model, cfg)
        .run(&source, 1, &[])
        .map(|_| ())
        .expect_err("fp32 parameters with a bf16 master must be refused")
        .to_string();
    assert!(
        err.contains("bf16_master_weights_and_grads needs bf16 parameters"),
        "{err}"
    );
}

/// Over 100 steps the run without an fp32 master ends where the run with one ends: the mean loss of
/// the last 10 steps (the toy model learns its data: 2.77 falls to 0.060) differs by 0.0017,
/// 6.2e-4 of the starting loss; the bound is 2e-3 of it.
#[test]
fn a_bf16_master_ends_100_steps_where_the_fp32_master_ends() {
    let model = Toy::new(16, 8, 3, true);
    let mut cfg = test_config(Stage::Zero2, 2, 1, GLOBAL).with_precision(DType::BF16);
    let with_master = train(&model, &cfg, 100, GLOBAL, SEQ).losses();
    cfg.bf16_master_weights = true;
    let without = train(&model, &cfg, 100, GLOBAL, SEQ).losses();
    let tail = |l: &[f32]| l[90..].iter().sum::<f32>() / 10.0;
    let d = (tail(&without) - tail(&with_master)).abs() / with_master[0];
    assert!(
        tail(&with_master) < 0.1 * with_master[0],
        "the loss falls: {with_master:?}"
    );
    assert!(d < 2e-3, "{d}: {with_master:?} vs {without:?}");
}
