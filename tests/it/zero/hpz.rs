//! ZeRO++'s hierarchical partitioning (hpZ, `zero_hpz_partition_size`): in-process ranks stand
//! for two hosts of two. The later gathers of a step come from the secondary shards within a
//! host, so training is bit for bit plain stage 3's, and the bytes that cross between the hosts
//! fall by the backward's gathers.

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
    let comm = CommOptions {
        ranks_per_host: Some(PER_HOST),
        ..CommOptions::default()
    };
    let log = ReportLog::new();
    let outcome = Trainer::new(&model, cfg)
        .with_comm_options(comm)
        .with_schedule(LrSchedule::Constant(3e-3))
        .keep_params(true)
        .run(&data, 4, &[&log])
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
