//! Memory and traffic per rank match the ZeRO formulas (fp32 Adam), measured from the engine's
//! ledger and the communicator's counters.

use crate::common;

use common::*;
use zerodp::comm::{shard_range, CollectiveKind};
use zerodp::zero::buffers::plan;
use zerodp::zero::layout::FlatLayout;
use zerodp::zero::Stage;

const GLOBAL: usize = 12;
const SEQ: usize = 4;
const STAGES: [Stage; 4] = [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3];

#[test]
fn model_state_bytes_follow_the_zero_formulas() {
    let model = Toy::new(16, 8, 3, true);
    for stage in STAGES {
        for world in [1, 2, 3, 4] {
            let mut cfg = test_config(stage, world, 1, GLOBAL);
            cfg.reduce_bucket_size = 100;
            let run = train(&model, &cfg, 1, GLOBAL, SEQ);
            let layout = FlatLayout::new(&model_spec(&model), world, 0);
            let psi = layout.padded_numel() as u64;
            let n = world as u64;
            // Padding is below one aligned quantum per unit.
            assert!(psi - layout.numel() as u64 <= (layout.num_units() * world * 8) as u64);
            let (params, grads, opt) = match stage {
                Stage::Zero0 => (4 * psi, 4 * psi, 8 * psi),
                Stage::Zero1 => (4 * psi, 4 * psi, 8 * psi / n),
                Stage::Zero2 => (4 * psi, 4 * psi / n, 8 * psi / n),
                Stage::Zero3 => (4 * psi / n, 4 * psi / n, 8 * psi / n),
            };
            let buffers = plan(&model_spec(&model), &cfg).buffer_bytes();
            for reports in &run.reports {
                let m = reports[0].memory;
                assert_eq!(
                    (m.params, m.grads, m.optimizer_states, m.master, m.buffers),
                    (params, grads, opt, 0, buffers),
                    "{stage:?} world {world}"
                );
                assert_eq!(m.total, params + grads + opt + buffers + m.gather);
                assert!(reports[0].peak_bytes >= m.total);
            }
        }
    }
}

fn model_spec(model: &Toy) -> zerodp::zero::unit::ModelSpec {
    use zerodp::zero::unit::UnitModel;
    model.spec().clone()
}

#[test]
fn stage3_gathers_stay_under_max_live_parameters() {
    let model = Toy::new(16, 8, 4, true);
    let spec = model_spec(&model);
    let layout = FlatLayout::new(&spec, 2, 0);
    let largest = layout.largest_padded();
    // The smallest pool the engine accepts: the head's visit (head + the embedding it reads).
    let mut tight = test_config(Stage::Zero3, 2, 2, GLOBAL);
    tight.param_persistence_threshold = 0;
    tight.max_live_parameters = 0;
    tight.max_reuse_distance = 0;
    let working_set = plan(&spec, &tight).gather_pool_elems;
    assert!(working_set > largest);
    let reference = train(
        &model,
        &test_config(Stage::Zero0, 1, 1, GLOBAL),
        2,
        GLOBAL,
        SEQ,
    );
    let sizes = [working_set, 2 * largest + 16, layout.padded_numel()];
    for (max_live, reuse) in sizes.iter().flat_map(|&m| [(m, 0), (m, 1_000_000_000)]) {
        let mut cfg = test_config(Stage::Zero3, 2, 2, GLOBAL);
        cfg.param_persistence_threshold = 0;
        cfg.prefetch_bucket_size = 1 << 20;
        cfg.max_live_parameters = max_live;
        cfg.max_reuse_distance = reuse;
        let run = train(&model, &cfg, 2, GLOBAL, SEQ);
        for reports in &run.reports {
            let peak = reports[1].peak_gather_bytes;
            assert!(peak > 0);
            assert!(
                peak <= (max_live * 4) as u64,
                "max_live {max_live} reuse {reuse}: gather peak {peak} bytes over {} bytes",
                max_live * 4
            );
        }
        assert!(max_rel_diff(&reference.params, &run.params) <= 1e-5);
    }
    // With room for everything, prefetch fills the pool beyond one unit.
    let mut cfg = test_config(Stage::Zero3, 2, 1, GLOBAL);
    cfg.param_persistence_threshold = 0;
    cfg.prefetch_bucket_size = 1 << 20;
    cfg.max_reuse_distance = 0;
    let run = train(&model, &cfg, 1, GLOBAL, SEQ);
    assert!(run.reports[0][0].peak_gather_bytes > (largest * 4) as u64);
}

/// Bytes a ring collective moves per rank for a buffer of `len` f32 (reduce-scatter/all-gather).
fn ring(len: usize, world: usize, rank: usize) -> u64 {
    ((len - shard_range(len, world, rank).len()) * 4) as u64
}

#[test]
fn traffic_per_step_follows_the_zero_formulas() {
    // Untied, no persistent units, one bucket for everything, one micro-step.
    let model = Toy::new(16, 8, 3, false);
    let spec = model_spec(&model);
    for world in [2, 3, 4] {
        let layout = FlatLayout::new(&spec, world, 0);
        let psi = layout.padded_numel();
        let last = layout.units.last().unwrap().padded;
        for stage in STAGES {
            let mut cfg = test_config(stage, world, 1, GLOBAL);
            cfg.param_persistence_threshold = 0;
            cfg.max_reuse_distance = 0;
            let run = train(&model, &cfg, 2, GLOBAL, SEQ);
            for (rank, reports) in run.reports.iter().enumerate() {
                let t = &reports[1].traffic;
                // The loss and squared-norm scalars: one two-float all-reduce per step.
                let scalars = 2 * ring(2, world, rank);
                let per_rank = |elems: usize| (elems * (world - 1) / world * 4) as u64;
                let (ar, rs, ag) = match stage {
                    Stage::Zero0 => (2 * per_rank(psi) + scalars, 0, 0),
                    Stage::Zero1 | Stage::Zero2 => (scalars, per_rank(psi), per_rank(psi)),
                    // Forward gathers every unit, backward every unit but the last, which stays
                    // gathered from its forward: 3Ψ(n-1)/n less the last unit.
                    Stage::Zero3 => (scalars, per_rank(psi), per_rank(2 * psi - last)),
                };
                let got = (
                    t.sent(CollectiveKind::AllReduce),
                    t.sent(CollectiveKind::ReduceScatter),
                    t.sent(CollectiveKind::AllGather),
                );
                assert_eq!(got, (ar, rs, ag), "{stage:?} world {world} rank {rank}");
                assert_eq!(t.total_recv(), t.total_sent());
                let elems = (t.total_sent() - scalars) / 4;
                let factor = if stage == Stage::Zero3 { 3 } else { 2 };
                let formula = (factor * psi * (world - 1) / world) as u64;
                assert!(elems <= formula && formula - elems <= last as u64);
            }
        }
    }
}

#[test]
fn stage3_kept_graphs_skip_the_second_gather() {
    let model = Toy::new(16, 8, 3, false);
    let spec = model_spec(&model);
    let layout = FlatLayout::new(&spec, 2, 0);
    let psi = layout.padded_numel();
    let mut cfg = test_config(Stage::Zero3, 2, 1, GLOBAL);
    cfg.param_persistence_threshold = 0;
    let p = plan(&spec, &cfg);
    assert!(p.keep_graph.iter().filter(|&&k| k).count() > 1);
    let kept_elems: usize = (0..layout.num_units())
        .filter(|&u| p.keep_graph[u])
        .map(|u| layout.units[u].padded)
        .sum();
    let run = train(&model, &cfg, 1, GLOBAL, SEQ);
    let ag = run.reports[0][0].traffic.sent(CollectiveKind::AllGather);
    // Forward gathers everything once; backward only the units that were not kept.
    assert_eq!(ag, ((2 * psi - kept_elems) / 2 * 4) as u64);
    assert!(run.reports[0][0].peak_gather_bytes <= p.gather_bytes());
}
