//! Every stage at every world size trains to the same losses and parameters as one rank.

mod common;

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
