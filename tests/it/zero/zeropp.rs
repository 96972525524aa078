//! ZeRO++ in one process, whose ranks stand for two hosts of two. hpZ
//! (`zero_hpz_partition_size`): the later gathers of a step come from the secondary shards within a
//! host, so training is bit for bit plain stage 3's, and the bytes that cross between the hosts
//! fall by the backward's gathers. qwZ (`zero_quantized_weights`): the gathers carry int8, a
//! quarter of the f32 bytes, and training follows the exact run closely. qgZ
//! (`zero_quantized_gradients`): the gradients cross hosts once, in int8; with all three the
//! bytes between the hosts equal the formula of docs/mpi.md, at most a quarter of plain stage 3's.

use zerodp::comm::{CollectiveKind, CommOptions};
use zerodp::data::{Corpus, DataLoader};
use zerodp::model::{GptConfig, GptModel};
use zerodp::trainer::{LrSchedule, ReportLog, Trainer};
use zerodp::zero::{EngineConfig, Stage, StepReport};

const WORLD: usize = 4;
const PER_HOST: usize = 2;

struct Run {
    losses: Vec<f32>,
    params: Vec<Vec<f32>>,
    /// Rank 0's reports.
    reports: Vec<StepReport>,
}

fn run(hpz: usize, reuse: usize, checkpointing: bool) -> Run {
    run_with(hpz, false, reuse, checkpointing, 4)
}

fn run_with(hpz: usize, qwz: bool, reuse: usize, checkpointing: bool, steps: u64) -> Run {
    run_zeropp(hpz, (qwz, false), (reuse, checkpointing), steps, |_| {})
}

/// A run of `steps` steps with hpZ's partition `hpz`, qwZ and qgZ as `(qwz, qgz)`, and
/// `(max_reuse_distance, activation checkpointing)`; `tweak` changes the rest of the config.
fn run_zeropp(
    hpz: usize,
    (qwz, qgz): (bool, bool),
    (reuse, checkpointing): (usize, bool),
    steps: u64,
    tweak: impl Fn(&mut EngineConfig),
) -> Run {
    let model = GptModel::new(GptConfig::tiny()).unwrap();
    let text = "the quick brown fox jumps over the lazy dog; pack my box with five dozen jugs. "
        .repeat(40);
    let data = DataLoader::new(
        Corpus::from_text("pangrams", &text),
        GptConfig::tiny().context,
        3,
    )
    .unwrap();
    let mut cfg = EngineConfig::new(Stage::Zero3, WORLD);
    cfg.micro_batch = 2;
    cfg.gradient_clipping = 1.0;
    cfg.param_persistence_threshold = 1000;
    cfg.seed = 5;
    cfg.max_reuse_distance = reuse;
    cfg.activation_checkpointing = checkpointing;
    cfg.hpz_partition_size = hpz;
    cfg.quantized_weights = qwz;
    cfg.quantized_gradients = qgz;
    tweak(&mut cfg);
    let comm = CommOptions {
        ranks_per_host: Some(PER_HOST),
        ..CommOptions::default()
    };
    let log = ReportLog::new();
    let outcome = Trainer::new(&model, cfg)
        .with_comm_options(comm)
        .with_schedule(LrSchedule::Constant(3e-3))
        .keep_params(true)
        .run(&data, steps, &[&log])
        .unwrap_or_else(|e| panic!("{e}"));
    let reports = log.into_reports().swap_remove(0);
    Run {
        losses: reports.iter().map(|r| r.loss).collect(),
        params: outcome.params.expect("kept parameters"),
        reports,
    }
}

fn inter_host_gather_bytes(r: &StepReport) -> (u64, u64) {
    let k = CollectiveKind::AllGather as usize;
    (r.traffic.inter_host_recv_bytes[k], r.traffic.recv_bytes[k])
}

#[test]
fn hpz_trains_bit_for_bit_as_plain_stage_3_and_keeps_later_gathers_in_the_host() {
    for (reuse, checkpointing) in [(0, false), (0, true), (1_000_000_000, false)] {
        let plain = run(1, reuse, checkpointing);
        let hpz = run(PER_HOST, reuse, checkpointing);
        let case = format!("reuse {reuse}, checkpointing {checkpointing}");
        assert_eq!(plain.losses, hpz.losses, "{case}");
        for (u, (a, b)) in plain.params.iter().zip(&hpz.params).enumerate() {
            let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{case}: unit {u}'s parameters differ");
        }
        // The same gathers, in bytes; those within a host do not cross.
        let (plain_inter, plain_all) = inter_host_gather_bytes(&plain.reports[1]);
        let (hpz_inter, hpz_all) = inter_host_gather_bytes(&hpz.reports[1]);
        assert!(plain_inter > 0, "{case}: two hosts exchange gathers");
        assert!(
            hpz_inter < plain_inter,
            "{case}: {hpz_inter} vs {plain_inter}"
        );
        // Plain: of the three shards a rank receives, two come from the other host. hpZ: only
        // the first gather of each unit crosses; within the host a rank receives its one peer's
        // half.
        assert_eq!(plain_inter * 3, plain_all * 2, "{case}");
        if reuse == 0 {
            // Every gathered unit but the last is gathered twice (forward and backward), so
            // hpZ saves the backward's share of the crossing bytes.
            assert!(
                hpz_inter * 10 < plain_inter * 7,
                "{case}: {hpz_inter} vs {plain_inter}"
            );
        }
        assert!(hpz_all <= plain_all, "{case}");
    }
}

#[test]
fn quantized_gathers_carry_a_quarter_of_the_bytes_and_training_follows_the_exact_run() {
    let steps = 30;
    let exact = run_with(1, false, 0, false, steps);
    let qwz = run_with(1, true, 0, false, steps);
    let both = run_with(PER_HOST, true, 0, false, steps);
    let gathered = |r: &Run| {
        let k = CollectiveKind::AllGather as usize;
        r.reports[1].traffic.sent_bytes[k]
    };
    // int8 values and one f32 scale per 2048 elements instead of f32 values.
    let ratio = gathered(&qwz) as f64 / gathered(&exact) as f64;
    assert!((0.25..0.26).contains(&ratio), "{ratio}");
    // The parameters computed with are the widened int8 ones: the losses move a little, and
    // follow the exact run.
    assert_ne!(exact.losses, qwz.losses);
    let last = |r: &Run| *r.losses.last().unwrap();
    let drift = (last(&qwz) - last(&exact)).abs() / last(&exact);
    eprintln!(
        "after {steps} steps: exact {} qwZ {} (drift {drift:.2e}); all-gather bytes {ratio:.4} of f32",
        last(&exact),
        last(&qwz)
    );
    assert!(drift < 0.02, "{} vs {}", last(&qwz), last(&exact));
    assert!(last(&qwz) < qwz.losses[0] - 1.0, "{:?}", qwz.losses);
    // With hpZ the backward's gathers come from the secondary partition of the widened
    // parameters: the same bits as qwZ alone, and only the forward crosses hosts, in int8.
    assert_eq!(both.losses, qwz.losses);
    let (inter_exact, _) = inter_host_gather_bytes(&exact.reports[1]);
    let (inter_both, _) = inter_host_gather_bytes(&both.reports[1]);
    eprintln!(
        "gather bytes to the other host per step: plain {inter_exact}, hpZ + qwZ {inter_both}"
    );
    assert!(
        inter_both * 7 < inter_exact,
        "{inter_both} vs {inter_exact}"
    );
}

/// docs/mpi.md's bytes a rank sends to other hosts per step at stage 3 with hpZ, qwZ and qgZ,
/// no persistent unit: every unit crosses once as the forward's int8 gather, a quantized shard to
/// each of the `W - H` ranks of other hosts, and once as qgZ's second phase, a quantized shard
/// of its host's sum to each of the `W/H - 1` other hosts.
fn zeropp_formula(paddeds: &[usize]) -> u64 {
    let quantized = |elems: usize| (zerodp::zero::quantize::payload_elems(elems) * 2) as u64;
    let (w, h) = (WORLD, PER_HOST);
    paddeds
        .iter()
        .map(|&p| ((w - h) + (w / h - 1)) as u64 * quantized(p / w))
        .sum()
}

/// Bytes to other hosts per step in the collectives that move parameters and gradients.
fn inter_host_model_bytes(r: &StepReport) -> u64 {
    [
        CollectiveKind::AllGather,
        CollectiveKind::ReduceScatter,
        CollectiveKind::AllToAll,
    ]
    .iter()
    .map(|&k| r.traffic.inter_host_sent_bytes[k as usize])
    .sum()
}

#[test]
fn quantized_gradients_follow_the_exact_run_and_all_three_send_the_formula_across_hosts() {
    let steps = 30;
    let no_persistence = |c: &mut EngineConfig| c.param_persistence_threshold = 0;
    let exact = run_zeropp(1, (false, false), (0, false), steps, no_persistence);
    let qgz = run_zeropp(1, (false, true), (0, false), steps, no_persistence);
    let all = run_zeropp(PER_HOST, (true, true), (0, false), steps, no_persistence);
    // qgZ replaces the reduce-scatter by all-to-alls; the gradients are rounded, so the losses
    // move a little and follow the exact run.
    let k = |c: CollectiveKind| c as usize;
    let t = &qgz.reports[1].traffic;
    assert_eq!(t.calls[k(CollectiveKind::ReduceScatter)], 0);
    assert!(t.calls[k(CollectiveKind::AllToAll)] > 0);
    assert_ne!(exact.losses, qgz.losses);
    let last = |r: &Run| *r.losses.last().unwrap();
    for (name, run) in [("qgZ", &qgz), ("hpZ + qwZ + qgZ", &all)] {
        let drift = (last(run) - last(&exact)).abs() / last(&exact);
        eprintln!(
            "after {steps} steps: exact {} {name} {} (drift {drift:.2e})",
            last(&exact),
            last(run)
        );
        assert!(drift < 0.02, "{name}: {} vs {}", last(run), last(&exact));
        assert!(last(run) < run.losses[0] - 1.0, "{name}: {:?}", run.losses);
    }
    // The bytes that cross between the hosts: the formula exactly, and at most a quarter.
    let model = GptModel::new(GptConfig::tiny()).unwrap();
    let layout =
        zerodp::zero::layout::FlatLayout::new(zerodp::zero::UnitModel::spec(&model), WORLD, 0);
    let paddeds: Vec<usize> = layout.units.iter().map(|u| u.padded).collect();
    let plain = inter_host_model_bytes(&exact.reports[1]);
    let zeropp = inter_host_model_bytes(&all.reports[1]);
    eprintln!("bytes to the other host per step and rank: plain stage 3 {plain}, hpZ + qwZ + qgZ {zeropp} ({:.3}x)", zeropp as f64 / plain as f64);
    assert_eq!(zeropp, zeropp_formula(&paddeds));
    assert!(zeropp * 4 <= plain, "{zeropp} vs {plain}");
}
