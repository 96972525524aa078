//! Offload (`offload_optimizer` to cpu or nvme, `offload_param` to cpu or nvme at stage 3): the same
//! losses, norms and parameters as the same stage without offload, bit for bit, in fp32 and bf16
//! at world sizes 1, 2 and 4; the bytes leave the device tier as the tiers say; the NVMe swap
//! files exist only during the run; a bad `nvme_path` is a clear error before any step.

use crate::common;

use common::*;
use zerodp::data::TokenBatch as Batch;
use zerodp::flat::DType;
use zerodp::trainer::{ReportLog, Trainer};
use zerodp::zero::unit::UnitModel;
use zerodp::zero::{EngineConfig, OptimizerTier, ParamTier, Stage, StepReport};

const GLOBAL: usize = 8;
const SEQ: usize = 4;
const STEPS: usize = 4;

/// `(loss bits, grad norm bits)` per step and the final parameters' bits, every rank's reports.
/// Per rank, per step `(loss bits, grad norm bits)`.
type StepBits = Vec<Vec<(u32, u32)>>;

fn fingerprint(run: &Run) -> (StepBits, Vec<Vec<u32>>) {
    let steps = run
        .reports
        .iter()
        .map(|r| {
            r.iter()
                .map(|s| (s.loss.to_bits(), s.grad_norm.to_bits()))
                .collect()
        })
        .collect();
    let params = run
        .params
        .iter()
        .map(|p| p.iter().map(|x| x.to_bits()).collect())
        .collect();
    (steps, params)
}

fn config(stage: Stage, world: usize, dtype: DType) -> EngineConfig {
    let mut c = test_config(stage, world, 1, GLOBAL).with_precision(dtype);
    c.gradient_clipping = 1.0;
    c
}

#[test]
fn offloaded_runs_equal_the_same_stage_bit_for_bit() {
    let model = Toy::new(16, 8, 2, true);
    let dir = tempfile::tempdir().unwrap();
    for world in [1usize, 2, 4] {
        for stage in [Stage::Zero1, Stage::Zero2, Stage::Zero3] {
            for dtype in [DType::F32, DType::BF16] {
                let base = config(stage, world, dtype);
                let want = fingerprint(&train(&model, &base, STEPS, GLOBAL, SEQ));
                // The smallest chunk (one 4 KiB alignment; `moments_on_nvme_...` below streams a
                // part in several).
                let nvme = OptimizerTier::Nvme {
                    dir: dir.path().to_path_buf(),
                    chunk: 100,
                    buffer_count: 4,
                };
                // A ring of three buffer sets: chunks read two ahead.
                let ring = OptimizerTier::Nvme {
                    dir: dir.path().to_path_buf(),
                    chunk: 100,
                    buffer_count: 6,
                };
                // Parameter shards on NVMe through one staging buffer (raised to what a visit
                // gathers) and through DeepSpeed's default five.
                let param_nvme = |buffer_count| ParamTier::Nvme {
                    dir: dir.path().to_path_buf(),
                    buffer_count,
                    buffer_size: 100_000_000,
                    max_in_cpu: 0,
                };
                for (tier, params) in [
                    (OptimizerTier::Host, ParamTier::Device),
                    (nvme.clone(), ParamTier::Device),
                    (ring, ParamTier::Device),
                    (OptimizerTier::Host, ParamTier::Host),
                    (nvme.clone(), ParamTier::Host),
                    (OptimizerTier::Host, param_nvme(1)),
                    (nvme, param_nvme(5)),
                ] {
                    if params != ParamTier::Device && stage != Stage::Zero3 {
                        continue;
                    }
                    let mut cfg = base.clone();
                    cfg.offload_optimizer = tier.clone();
                    cfg.offload_param = params.clone();
                    let got = fingerprint(&train(&model, &cfg, STEPS, GLOBAL, SEQ));
                    assert_eq!(
                        got, want,
                        "world {world} {stage:?} {dtype} {tier:?} params {params:?}"
                    );
                }
                let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
                assert!(left.is_empty(), "swap files left behind: {left:?}");
            }
        }
    }
}

/// Moments on NVMe in f32 and in bf16 (`bf16_optimizer_states`, two to a word of the swap file):
/// the same bits as the same moments in memory. Units of 48x48 parameters, so that a rank's part
/// streams in several chunks at world 1 and 2 (a chunk is at least one 4 KiB alignment: 1024 f32
/// or 2048 bf16 moments) and the chunk boundaries fall inside a part.
#[test]
fn moments_on_nvme_in_f32_and_bf16_equal_the_moments_in_memory() {
    let model = Toy::new(64, 48, 2, true);
    let dir = tempfile::tempdir().unwrap();
    for world in [1usize, 2, 4] {
        for stage in [Stage::Zero1, Stage::Zero2, Stage::Zero3] {
            for (dtype, states) in [
                (DType::F32, DType::BF16),
                (DType::BF16, DType::BF16),
                (DType::F32, DType::F32),
            ] {
                let mut base = config(stage, world, dtype);
                base.optimizer_states_dtype = states;
                let want = fingerprint(&train(&model, &base, STEPS, GLOBAL, SEQ));
                for buffer_count in [4, 6] {
                    let mut cfg = base.clone();
                    cfg.offload_optimizer = OptimizerTier::Nvme {
                        dir: dir.path().to_path_buf(),
                        chunk: 100,
                        buffer_count,
                    };
                    let got = fingerprint(&train(&model, &cfg, STEPS, GLOBAL, SEQ));
                    assert_eq!(
                        got, want,
                        "world {world} {stage:?} {dtype} states {states} buffers {buffer_count}"
                    );
                }
                let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
                assert!(left.is_empty(), "swap files left behind: {left:?}");
            }
        }
    }
}

/// `offload_optimizer.ratio` (DeepSpeed's partial offload, stage 3): DeepSpeed's rule picks the
/// last units, the first ones keep their master and moments in the device tier, and no bit of the
/// run changes, in memory or on NVMe, at world sizes 1, 2 and 4.
#[test]
fn a_partial_offload_moves_the_last_units_and_changes_no_bit() {
    use zerodp::zero::engine_config::first_offloaded_unit;
    // DeepSpeed's `i >= int((1 - ratio) * n)` in f64, its rounding included: 1 - 0.9 is just
    // below 0.1, so a ratio of 0.9 over 10 sub-groups offloads all ten.
    for (n, ratio, first) in [
        (10, 0.9, 0),
        (10, 0.5, 5),
        (4, 0.25, 3),
        (4, 0.0, 4),
        (4, 1.0, 0),
    ] {
        assert_eq!(
            first_offloaded_unit(n, ratio),
            first,
            "{n} units, ratio {ratio}"
        );
    }
    let model = Toy::new(16, 8, 3, true);
    let units = model.spec().units.len();
    let dir = tempfile::tempdir().unwrap();
    for world in [1usize, 2, 4] {
        for dtype in [DType::F32, DType::BF16] {
            let base = config(Stage::Zero3, world, dtype);
            let plain = train(&model, &base, STEPS, GLOBAL, SEQ);
            let want = fingerprint(&plain);
            let plain_mem = plain.reports[0][0].memory;
            let nvme = OptimizerTier::Nvme {
                dir: dir.path().to_path_buf(),
                chunk: 100,
                buffer_count: 4,
            };
            let mut host_bytes = Vec::new();
            for ratio in [0.0, 0.25, 0.5, 1.0] {
                for tier in [OptimizerTier::Host, nvme.clone()] {
                    let mut cfg = base.clone();
                    cfg.offload_optimizer = tier.clone();
                    cfg.offload_ratio = ratio;
                    let run = train(&model, &cfg, STEPS, GLOBAL, SEQ);
                    assert_eq!(
                        fingerprint(&run),
                        want,
                        "world {world} {dtype} {ratio} {tier:?}"
                    );
                    let m = run.reports[0][0].memory;
                    let kept = first_offloaded_unit(units, ratio);
                    if tier == OptimizerTier::Host {
                        // What leaves the device tier is what the host tier gains.
                        assert_eq!(
                            m.master + m.optimizer_states + m.offloaded_host,
                            plain_mem.master + plain_mem.optimizer_states,
                            "world {world} {dtype} ratio {ratio}"
                        );
                        assert_eq!(m.offloaded_host == 0, kept == units, "ratio {ratio}");
                        assert_eq!(m.optimizer_states == 0, kept == 0, "ratio {ratio}");
                        host_bytes.push(m.offloaded_host);
                    } else {
                        assert_eq!(m.offloaded_nvme == 0, kept == units, "ratio {ratio}");
                        assert_eq!(m.optimizer_states == 0, kept == 0, "ratio {ratio}");
                    }
                }
            }
            // A larger ratio never offloads less.
            assert!(
                host_bytes.windows(2).all(|w| w[0] <= w[1]),
                "{host_bytes:?}"
            );
            let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
            assert!(left.is_empty(), "swap files left behind: {left:?}");
        }
    }
}

/// A partial offload below stage 3 is refused, as DeepSpeed refuses it.
#[test]
fn a_partial_offload_below_stage_3_is_an_engine_error() {
    let model = Toy::new(16, 8, 2, true);
    let mut cfg = config(Stage::Zero2, 1, DType::F32);
    cfg.offload_optimizer = OptimizerTier::Host;
    cfg.offload_ratio = 0.5;
    let source = |_: zerodp::trainer::BatchIndex| -> Result<Batch, String> {
        panic!("no batch may be asked for when the configuration is refused")
    };
    let text = Trainer::new(&model, cfg)
        .run(&source, 1, &[])
        .map(|_| ())
        .expect_err("a partial offload at stage 2 must be refused")
        .to_string();
    assert!(
        text.contains("ratio 0.5") && text.contains("stage 3"),
        "{text}"
    );
}

#[test]
fn offloaded_bytes_leave_the_device_tier() {
    let model = Toy::new(16, 8, 2, true);
    let dir = tempfile::tempdir().unwrap();
    let base = config(Stage::Zero3, 2, DType::BF16);
    let plain = train(&model, &base, 1, GLOBAL, SEQ).reports[0][0].memory;
    assert!(plain.master > 0 && plain.optimizer_states > 0 && plain.params > 0);
    assert_eq!((plain.offloaded_host, plain.offloaded_nvme), (0, 0));

    let mut cpu = base.clone();
    cpu.offload_optimizer = OptimizerTier::Host;
    cpu.offload_param = ParamTier::Host;
    let m = train(&model, &cpu, 1, GLOBAL, SEQ).reports[0][0].memory;
    assert_eq!((m.master, m.optimizer_states, m.params), (0, 0, 0));
    assert_eq!(
        m.offloaded_host,
        plain.master + plain.optimizer_states + plain.params
    );
    assert_eq!(m.total, plain.total - m.offloaded_host);

    let mut nvme = base.clone();
    nvme.offload_optimizer = OptimizerTier::Nvme {
        dir: dir.path().to_path_buf(),
        chunk: 1 << 20,
        buffer_count: 4,
    };
    let m = train(&model, &nvme, 1, GLOBAL, SEQ).reports[0][0].memory;
    assert_eq!((m.master, m.optimizer_states), (0, 0));
    // The moments on disk, each unit's record padded to 4 KiB; the master and the two stream
    // buffers (as long as the longest part, padded) in host memory.
    assert!(m.offloaded_nvme >= plain.optimizer_states, "{m:?}");
    let units = model.spec().units.len() as u64;
    assert!(
        m.offloaded_nvme <= plain.optimizer_states + units * 2 * 4096,
        "{m:?}"
    );
    assert!(m.offloaded_host >= plain.master + 2 * 4096, "{m:?}");

    // offload_optimizer.buffer_count: 8 buffers hold twice the stream bytes of 4, and fewer than 4
    // count as 4 (double buffering).
    let stream_with = |buffer_count: usize| {
        let mut cfg = nvme.clone();
        cfg.offload_optimizer = OptimizerTier::Nvme {
            dir: dir.path().to_path_buf(),
            chunk: 1 << 20,
            buffer_count,
        };
        let m = train(&model, &cfg, 1, GLOBAL, SEQ).reports[0][0].memory;
        m.offloaded_host - plain.master
    };
    let four = stream_with(4);
    assert_eq!(stream_with(8), 2 * four);
    assert_eq!(stream_with(1), four);

    // bf16 moments: half the bytes in memory, and on NVMe as they are (each record padded).
    let mut base16 = base.clone();
    base16.optimizer_states_dtype = DType::BF16;
    let plain16 = train(&model, &base16, 1, GLOBAL, SEQ).reports[0][0].memory;
    assert_eq!(2 * plain16.optimizer_states, plain.optimizer_states);
    let mut nvme16 = nvme.clone();
    nvme16.optimizer_states_dtype = DType::BF16;
    let m = train(&model, &nvme16, 1, GLOBAL, SEQ).reports[0][0].memory;
    assert_eq!(m.optimizer_states, 0, "{m:?}");
    assert!(m.offloaded_nvme >= plain16.optimizer_states, "{m:?}");
    assert!(
        m.offloaded_nvme <= plain16.optimizer_states + units * 2 * 4096,
        "{m:?}"
    );
}

/// `offload_param` to NVMe: the parameter shards leave memory for the swap file (each unit's
/// record padded to 4 KiB), the staging buffers come into the host tier, and the shards are read
/// for every gather and written once per step.
#[test]
fn swapped_parameter_shards_are_charged_to_the_nvme_tier_and_read_per_gather() {
    let model = Toy::new(16, 8, 2, true);
    let dir = tempfile::tempdir().unwrap();
    let base = config(Stage::Zero3, 2, DType::BF16);
    let plain = train(&model, &base, 1, GLOBAL, SEQ).reports[0][0].clone();
    let mut cfg = base.clone();
    cfg.offload_param = ParamTier::Nvme {
        dir: dir.path().to_path_buf(),
        buffer_count: 5,
        buffer_size: 100_000_000,
        max_in_cpu: 0,
    };
    let run = train(&model, &cfg, 2, GLOBAL, SEQ);
    let (one, two) = (&run.reports[0][0], &run.reports[0][1]);
    let m = one.memory;
    assert_eq!(m.params, 0, "{m:?}");
    let units = model.spec().units.len() as u64;
    assert!(m.offloaded_nvme >= plain.memory.params, "{m:?}");
    assert!(
        m.offloaded_nvme <= plain.memory.params + units * 4096,
        "{m:?}"
    );
    assert_eq!(
        m.offloaded_host,
        zerodp::zero::param_staging_bytes(model.spec(), &cfg),
        "{m:?}"
    );
    assert_eq!(m.total, plain.memory.total - plain.memory.params);
    // Each step reads at least every shard once per gather and writes every shard once
    // (bf16: Adam overwrites the shard from the master, so the step does not read it first).
    let (read, written) = (two.swap_io.0 - one.swap_io.0, two.swap_io.1 - one.swap_io.1);
    assert!(read >= 2 * plain.memory.params, "{read} {:?}", plain.memory);
    assert!(written >= plain.memory.params, "{written}");
    assert!(written <= plain.memory.params + units * 4096, "{written}");
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "swap files left behind: {left:?}");
}

/// `offload_param.max_in_cpu` (DeepSpeed's rule): the rank's first units whose shards fit in that
/// many elements together stay in host memory and only the rest go to the swap file; a limit that
/// holds every shard (DeepSpeed's default 1e9 does for a small model) makes no swap file at all.
/// The results are the same bits wherever the shards are.
#[test]
fn max_in_cpu_keeps_the_first_shards_in_host_memory() {
    let model = Toy::new(64, 48, 3, true);
    let dir = tempfile::tempdir().unwrap();
    let base = config(Stage::Zero3, 2, DType::BF16);
    let nvme = |max_in_cpu| {
        let mut cfg = base.clone();
        cfg.offload_param = ParamTier::Nvme {
            dir: dir.path().to_path_buf(),
            buffer_count: 5,
            buffer_size: 100_000_000,
            max_in_cpu,
        };
        cfg
    };
    let lens: Vec<usize> = zerodp::zero::layout::FlatLayout::new(model.spec(), 2, 0)
        .units
        .iter()
        .map(|u| u.shard_len)
        .collect();
    assert!(lens.len() >= 4, "{lens:?}");
    // The first two units fit exactly; the third would not.
    let two = lens[0] + lens[1];
    let want = fingerprint(&train(&model, &base, STEPS, GLOBAL, SEQ));
    let runs = [0, two, two + lens[2] - 1, usize::MAX].map(|max_in_cpu| {
        let cfg = nvme(max_in_cpu);
        let run = train(&model, &cfg, 2, GLOBAL, SEQ);
        assert_eq!(
            fingerprint(&train(&model, &cfg, STEPS, GLOBAL, SEQ)),
            want,
            "max_in_cpu {max_in_cpu}"
        );
        (cfg, run.reports[0][0].clone(), run.reports[0][1].clone())
    });
    let reads =
        |(_, one, two): &(EngineConfig, StepReport, StepReport)| two.swap_io.0 - one.swap_io.0;
    let [(_, none, _), (cfg, part, _), (_, still_two, _), (_, all, _)] = &runs;
    // Two units' shards in host memory (bf16), the staging buffers beside them.
    let resident = (two * 2) as u64;
    assert_eq!(
        zerodp::zero::resident_param_bytes(model.spec(), cfg),
        resident
    );
    let staging = zerodp::zero::param_staging_bytes(model.spec(), cfg);
    assert_eq!(
        part.memory.offloaded_host,
        resident + staging,
        "{:?}",
        part.memory
    );
    assert!(part.memory.offloaded_nvme < none.memory.offloaded_nvme);
    assert_eq!(still_two.memory.offloaded_host, part.memory.offloaded_host);
    assert!(reads(&runs[1]) < reads(&runs[0]));
    // Every shard in memory: no swap file, no swap traffic.
    assert_eq!(all.memory.offloaded_nvme, 0, "{:?}", all.memory);
    assert_eq!(all.swap_io, (0, 0));
    let plain = train(&model, &base, 1, GLOBAL, SEQ).reports[0][0].memory;
    assert_eq!(all.memory.offloaded_host, plain.params);
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "swap files left behind: {left:?}");
}

/// A shard longer than `offload_param.buffer_size` is refused before any step, naming the key
/// and the size that would do, as DeepSpeed refuses a parameter larger than its buffers; a
/// missing `offload_param.nvme_path` names that key.
#[test]
fn param_swap_config_errors_name_the_key_and_the_fix() {
    let model = Toy::new(16, 8, 2, true);
    let dir = tempfile::tempdir().unwrap();
    let source = |_: zerodp::trainer::BatchIndex| -> Result<Batch, String> {
        panic!("no batch may be asked for before the parameter swap file exists")
    };
    let mut cfg = config(Stage::Zero3, 2, DType::F32);
    cfg.offload_param = ParamTier::Nvme {
        dir: dir.path().to_path_buf(),
        buffer_count: 5,
        buffer_size: 10,
        max_in_cpu: 0,
    };
    let err = Trainer::new(&model, cfg.clone())
        .run(&source, 1, &[])
        .map(|_| ())
        .expect_err("a buffer_size below the longest shard must be refused")
        .to_string();
    assert!(
        err.contains("offload_param.buffer_size") && err.contains("at least"),
        "{err}"
    );
    cfg.offload_param = ParamTier::Nvme {
        dir: dir.path().join("gone"),
        buffer_count: 5,
        buffer_size: 100_000_000,
        max_in_cpu: 0,
    };
    let err = Trainer::new(&model, cfg)
        .run(&source, 1, &[])
        .map(|_| ())
        .expect_err("a missing nvme_path must fail")
        .to_string();
    assert!(
        err.contains("gone") && err.contains("offload_param.nvme_path"),
        "{err}"
    );
}

#[test]
fn a_missing_nvme_path_fails_before_any_step_naming_it() {
    let model = Toy::new(16, 8, 2, true);
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-disk");
    let mut cfg = config(Stage::Zero2, 2, DType::F32);
    cfg.offload_optimizer = OptimizerTier::Nvme {
        dir: missing.clone(),
        chunk: 1000,
        buffer_count: 4,
    };
    let source = |_: zerodp::trainer::BatchIndex| -> Result<Batch, String> {
        panic!("no batch may be asked for before the swap file exists")
    };
    let log = ReportLog::new();
    let err = Trainer::new(&model, cfg)
        .run(&source, 2, &[&log])
        .map(|_| ())
        .expect_err("a missing nvme_path must fail")
        .to_string();
    assert!(
        err.contains("no-such-disk") && err.contains("nvme_path"),
        "{err}"
    );
}

#[test]
fn a_device_budget_is_held_to_by_the_engine_before_it_allocates() {
    let model = Toy::new(16, 8, 2, true);
    let peak = |cfg: &EngineConfig| zerodp::zero::device_peak(model.spec(), cfg, 0);
    let stage0 = config(Stage::Zero0, 2, DType::F32);
    let mut offloaded = config(Stage::Zero3, 2, DType::F32);
    offloaded.offload_optimizer = OptimizerTier::Host;
    offloaded.offload_param = ParamTier::Host;
    // Stage 0 reduces in place (no buckets): the offloaded run's buckets must be small too.
    offloaded.reduce_bucket_size = 32;
    let budget = peak(&offloaded);
    assert!(budget < peak(&stage0), "{budget} {}", peak(&stage0));

    let mut refused = stage0.clone();
    refused.device_budget = Some(budget);
    let source = |_: zerodp::trainer::BatchIndex| -> Result<Batch, String> {
        panic!("no batch may be asked for when the budget refuses the run")
    };
    let err = Trainer::new(&model, refused)
        .run(&source, 1, &[])
        .map(|_| ())
        .expect_err("stage 0 over the budget must be refused")
        .to_string();
    for want in ["bytes asked", "held: params", "offload"] {
        assert!(err.contains(want), "{want:?} missing: {err}");
    }

    offloaded.device_budget = Some(budget);
    let run = train(&model, &offloaded, 2, GLOBAL, SEQ);
    for rank in &run.reports {
        for r in rank {
            assert!(r.peak_bytes <= budget, "{} > {budget}", r.peak_bytes);
        }
    }
}

/// The moments' NVMe stream buffers as the pre-flight sizes them (`moment_stream_bytes`) are what
/// the engine allocates, for a full and a partial offload (whose buffers hold the longest
/// offloaded unit's part only).
#[test]
fn moment_stream_bytes_are_what_the_engine_allocates() {
    let model = Toy::new(16, 8, 3, true);
    let dir = tempfile::tempdir().unwrap();
    for world in [1usize, 2] {
        let mut sizes = Vec::new();
        for ratio in [1.0, 0.5] {
            // fp32: no master, so the host tier holds the stream buffers alone.
            let mut cfg = config(Stage::Zero3, world, DType::F32);
            cfg.offload_optimizer = OptimizerTier::Nvme {
                dir: dir.path().to_path_buf(),
                chunk: 1 << 20,
                buffer_count: 4,
            };
            cfg.offload_ratio = ratio;
            let m = train(&model, &cfg, 1, GLOBAL, SEQ).reports[0][0].memory;
            let planned = zerodp::zero::moment_stream_bytes(model.spec(), &cfg);
            assert_eq!(m.offloaded_host, planned, "world {world}, ratio {ratio}");
            sizes.push(planned);
        }
        assert!(sizes[1] <= sizes[0], "world {world}: {sizes:?}");
    }
}
