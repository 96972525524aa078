//! Every stage at every world size trains to the same losses and parameters as one rank.

use crate::common;

use common::*;
use zerodp::zero::Stage;

const GLOBAL: usize = 12;
const SEQ: usize = 4;
const STEPS: usize = 4;

fn check(ga: usize, clip: f32, overlap: bool, bucket: usize, ckpt: bool, tied: bool) {
    let model = Toy::new(16, 8, 2, tied);
    let mut base_cfg = test_config(Stage::Zero0, 1, ga, GLOBAL);
    base_cfg.gradient_clipping = clip;
    let reference = train(&model, &base_cfg, STEPS, GLOBAL, SEQ);
    let ref_losses = reference.losses();
    assert!(
        ref_losses[STEPS - 1] < ref_losses[0],
        "the toy must learn: {ref_losses:?}"
    );
    // Stage 3 twice: strict (every unit released after forward and recomputed) and with
    // DeepSpeed's default reuse distance (graphs kept while the budget allows).
    let variants = [
        (Stage::Zero0, 0),
        (Stage::Zero1, 0),
        (Stage::Zero2, 0),
        (Stage::Zero3, 0),
        (Stage::Zero3, 1_000_000_000),
    ];
    for (stage, reuse) in variants {
        for world in [1, 2, 3, 4] {
            if GLOBAL % (world * ga) != 0 {
                continue;
            }
            let mut cfg = test_config(stage, world, ga, GLOBAL);
            cfg.gradient_clipping = clip;
            cfg.overlap_comm = overlap;
            cfg.reduce_bucket_size = bucket;
            cfg.activation_checkpointing = ckpt;
            cfg.param_persistence_threshold = 0;
            cfg.prefetch_bucket_size = 1000;
            cfg.max_reuse_distance = reuse;
            let run = train(&model, &cfg, STEPS, GLOBAL, SEQ);
            for (rank, reports) in run.reports.iter().enumerate() {
                for (s, (r, want)) in reports.iter().zip(&ref_losses).enumerate() {
                    let rel = (r.loss - want).abs() / want.abs();
                    assert!(
                        rel <= 1e-5,
                        "{stage:?} (reuse {reuse}) world {world} rank {rank} step {s}: loss {} vs {want} (rel {rel})",
                        r.loss
                    );
                }
            }
            let d = max_rel_diff(&reference.params, &run.params);
            assert!(
                d <= 1e-5,
                "{stage:?} world {world}: final params differ by {d} (relative)"
            );
        }
    }
}

#[test]
fn stages_match_one_rank_plain() {
    check(1, 0.0, true, 500_000_000, false, true);
}

#[test]
fn stages_match_one_rank_with_accumulation_and_small_buckets() {
    check(2, 0.0, true, 40, false, true);
}

#[test]
fn stages_match_one_rank_with_clipping_without_overlap() {
    check(1, 0.05, false, 64, false, true);
}

#[test]
fn stages_match_one_rank_with_checkpointing_untied() {
    check(3, 0.5, true, 100, true, false);
}

#[test]
fn stages_match_one_rank_with_no_bucket() {
    // reduce_bucket_size 0 (DeepSpeed: each gradient on its own): every unit in place.
    check(1, 0.0, true, 0, false, true);
    check(2, 0.05, false, 0, false, true);
}

/// `reduce_bucket_size` 0 reduces each unit's gradient on its own (in place, or through a staging
/// bucket of one unit where the gradient is converted to a 16-bit communication dtype): the same
/// sums in the same rank order as the buckets, so the same bits, at every stage.
#[test]
fn no_bucket_trains_bit_for_bit_as_the_default_bucket() {
    use zerodp::flat::DType;
    let model = Toy::new(16, 8, 2, true);
    // (parameter and communication dtype, gradients kept in f32)
    let precisions = [
        (DType::F32, false),
        (DType::BF16, false),
        (DType::BF16, true),
        (DType::F16, true),
    ];
    for (dtype, f32_grads) in precisions {
        for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
            for (ga, overlap) in [(1, true), (2, false)] {
                let mut cfg = test_config(stage, 2, ga, GLOBAL).with_precision(dtype);
                if f32_grads {
                    cfg.grad_accum_dtype = DType::F32;
                }
                cfg.overlap_comm = overlap;
                let bucketed = train(&model, &cfg, STEPS, GLOBAL, SEQ);
                cfg.reduce_bucket_size = 0;
                let alone = train(&model, &cfg, STEPS, GLOBAL, SEQ);
                let what = format!("{stage:?} {dtype:?} f32 grads {f32_grads} ga {ga}");
                assert_eq!(bucketed.losses(), alone.losses(), "{what}");
                assert_eq!(bucketed.params, alone.params, "{what}");
            }
        }
    }
}
