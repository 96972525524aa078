//! The planner against zerodp's own runs: for the model the engine trains, the planner's model-state
//! and buffer bytes equal the engine's memory ledger and its traffic per step equals the measured
//! byte and call counters, stage by stage, for world sizes 1, 2 and 4.
//!
//! What makes the comparison exact, and how the tests set it up:
//! - the ledger's `gather` kind at the end of a step holds the gather-pool slabs created so far; it
//!   equals the planned budget once a step has gathered everything the budget allows at once, which
//!   happens when the pool holds the whole model (`stage3_max_live_parameters` ≥ Ψ, the default)
//!   and nothing of it goes to kept forward graphs: either the units are all persistent, or
//!   `stage3_max_reuse_distance` is 0 (strict ZeRO-3) with a prefetch bucket as large as the
//!   model. With kept graphs the planned budget is an upper bound on the peak (checked as such);
//! - the loss and gradient-norm all-reduce moves two floats, which split unevenly over 4 ranks, so
//!   all-reduce bytes are compared as the sum over ranks (the planner gives the mean per device);
//!   reduce-scatter and all-gather bytes, and the calls of every kind, are compared rank by rank.

use crate::common;

use common::*;
use zerodp::comm::CollectiveKind;
use zerodp::flat::DType;
use zerodp::planner::{
    interconnect, plan_option, planned_engine_config, BufferOverrides, Cluster, Collective,
    DtypeOverrides, HostLinks, ModelSize, Offload, PlanInput, PlanOption, Precision, ZeroChoice,
};
use zerodp::zero::buffers;
use zerodp::zero::unit::UnitModel;
use zerodp::zero::{EngineConfig, Stage};

const GLOBAL: usize = 8;
const SEQ: usize = 4;
const STAGES: [Stage; 4] = [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3];

/// The planner's input for a run of `model` under `cfg`: the same knobs, as a config states them.
fn input_for(model: &Toy, cfg: &EngineConfig) -> PlanInput {
    let pcie = interconnect("pcie").unwrap();
    PlanInput {
        model: ModelSize::from_model_spec(model.spec(), None),
        cluster: Cluster {
            nodes: 1,
            devices_per_node: cfg.world_size as u64,
            device_memory: 1 << 40,
            host_memory: 1 << 40,
            intra: pcie,
            inter: pcie,
            host: HostLinks::default(),
            device_flops: 1e12,
        },
        precision: precision_of(cfg.param_dtype),
        micro_batch: cfg.micro_batch as u64,
        seq_len: SEQ as u64,
        grad_accum: cfg.grad_accum as u64,
        activation_checkpointing: cfg.activation_checkpointing,
        buffers: BufferOverrides {
            reduce_bucket_size: Some(cfg.reduce_bucket_size as u64),
            overlap_comm: Some(cfg.overlap_comm),
            max_live_parameters: Some(cfg.max_live_parameters as u64),
            param_persistence_threshold: Some(cfg.param_persistence_threshold as u64),
            max_reuse_distance: Some(cfg.max_reuse_distance as u64),
            prefetch_bucket_size: Some(cfg.prefetch_bucket_size as u64),
            max_in_cpu: None,
            offload_ratio: None,
        },
        dtypes: DtypeOverrides {
            communication: Some(precision_of(cfg.comm_dtype)),
            grad_accum: Some(precision_of(cfg.grad_accum_dtype)),
            optimizer_states: Some(precision_of(cfg.optimizer_states_dtype)),
            bf16_master: cfg.bf16_master_weights,
        },
        configured: None,
        process: None,
    }
}

fn precision_of(d: DType) -> Precision {
    match d {
        DType::F32 => Precision::Fp32,
        DType::BF16 => Precision::Bf16,
        DType::F16 => Precision::Fp16,
    }
}

fn choice(stage: Stage) -> ZeroChoice {
    ZeroChoice::new(stage.index(), Offload::None, Offload::None)
}

/// Planned bytes per device and calls of one collective kind.
fn planned(o: &PlanOption, op: Collective) -> (u64, u64) {
    o.collectives
        .iter()
        .filter(|t| t.op == op)
        .fold((0, 0), |(b, c), t| (b + t.bytes_per_device, c + t.calls))
}

/// Whether the ledger's gather bytes should equal the plan (see the module docs), else be under it.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Gather {
    Exact,
    AtMost,
}

/// Trains two steps and checks the second step's reports of every rank against the plan.
fn check(model: &Toy, cfg: &EngineConfig, expect_gather: Gather) -> PlanOption {
    let input = input_for(model, cfg);
    let o = plan_option(&input, choice(cfg.stage));
    // The planner sizes the run the engine will make.
    let spec = model.spec();
    let mine = planned_engine_config(&input, cfg.stage.index());
    assert_eq!(buffers::plan(spec, &mine), buffers::plan(spec, cfg));
    assert_eq!(
        (mine.param_dtype, mine.comm_dtype, mine.grad_accum_dtype),
        (cfg.param_dtype, cfg.comm_dtype, cfg.grad_accum_dtype)
    );
    assert_eq!(
        (mine.grad_accum, mine.world_size),
        (cfg.grad_accum, cfg.world_size)
    );

    let run = train(model, cfg, 2, GLOBAL, SEQ);
    let what = format!(
        "{:?} world {} ga {} bucket {} overlap {} persistence {} reuse {}",
        cfg.stage,
        cfg.world_size,
        cfg.grad_accum,
        cfg.reduce_bucket_size,
        cfg.overlap_comm,
        cfg.param_persistence_threshold,
        cfg.max_reuse_distance
    );
    let b = &o.bytes_per_device;
    let mut all_reduce_sent = 0;
    for (rank, reports) in run.reports.iter().enumerate() {
        let r = &reports[1];
        let m = r.memory;
        assert_eq!(
            (m.params, m.grads, m.master, m.optimizer_states),
            (b.params, b.grads, b.master, b.adam_m + b.adam_v),
            "model states, {what} rank {rank}"
        );
        assert_eq!(
            b.model_states,
            m.params + m.grads + m.master + m.optimizer_states
        );
        assert_eq!(
            m.buffers,
            b.reduce_buckets + b.scratch_buffers,
            "buffers, {what}"
        );
        let gather = b.gather_pool + b.persistent_params;
        match expect_gather {
            Gather::Exact => assert_eq!(m.gather, gather, "gather, {what} rank {rank}"),
            Gather::AtMost => assert!(m.gather <= gather, "gather, {what} rank {rank}"),
        }
        assert!(r.peak_gather_bytes <= gather, "gather peak, {what}");
        let t = &r.traffic;
        for (kind, op) in [
            (CollectiveKind::ReduceScatter, Collective::ReduceScatter),
            (CollectiveKind::AllGather, Collective::AllGather),
        ] {
            assert_eq!(
                (t.sent(kind), t.calls(kind)),
                planned(&o, op),
                "{kind:?}, {what} rank {rank}"
            );
        }
        let (_, ar_calls) = planned(&o, Collective::AllReduce);
        assert_eq!(
            t.calls(CollectiveKind::AllReduce),
            ar_calls,
            "all-reduce calls, {what}"
        );
        assert_eq!(t.total_recv(), t.total_sent());
        all_reduce_sent += t.sent(CollectiveKind::AllReduce);
    }
    let world = cfg.world_size as u64;
    assert_eq!(
        all_reduce_sent,
        world * planned(&o, Collective::AllReduce).0,
        "all-reduce bytes over the ranks, {what}"
    );
    let rs_ag_ar: u64 = o.collectives.iter().map(|t| t.bytes_per_device).sum();
    assert_eq!(o.comm_bytes_per_step, rs_ag_ar);
    o
}

fn config(stage: Stage, world: usize, ga: usize) -> EngineConfig {
    let mut cfg = test_config(stage, world, ga, GLOBAL);
    // Several buckets per reduction, a partly filled last one.
    cfg.reduce_bucket_size = 100;
    cfg
}

#[test]
fn stages_0_to_3_match_the_engine_with_the_default_knobs() {
    // Tied head: the head reads the embedding, two gradient buffers at stages 2-3; every toy unit
    // is under the 1e5 persistence threshold, so stage 3 keeps them all gathered.
    let model = Toy::new(16, 8, 3, true);
    for stage in STAGES {
        for world in [1, 2, 4] {
            check(&model, &config(stage, world, 1), Gather::Exact);
        }
    }
}

#[test]
fn accumulation_and_one_bucket_without_overlap() {
    let model = Toy::new(16, 8, 2, false);
    let units = model.spec().units.len() as u64;
    for bucketed in [false, true] {
        for stage in STAGES {
            for world in [2, 4] {
                let mut cfg = config(stage, world, 2);
                if bucketed {
                    // bf16 reductions of gradients kept in f32: through the buckets at every stage.
                    cfg = cfg.with_precision(DType::BF16);
                    cfg.grad_accum_dtype = DType::F32;
                }
                cfg.overlap_comm = false;
                cfg.reduce_bucket_size = 1 << 20;
                let o = check(&model, &cfg, Gather::Exact);
                let (_, rs_calls) = planned(&o, Collective::ReduceScatter);
                // Stage 1 reduces once per step, stages 2-3 once per micro-step: one bucket per
                // reduction, or in place in each unit's gradient, one call per unit.
                let per_reduction = if bucketed { 1 } else { units };
                let expect = match stage {
                    Stage::Zero0 => 0,
                    Stage::Zero1 => per_reduction,
                    _ => 2 * per_reduction,
                };
                assert_eq!(
                    rs_calls, expect,
                    "{stage:?} world {world} bucketed {bucketed}"
                );
            }
        }
    }
}

#[test]
fn strict_stage3_gathers_every_unit_again_in_backward_but_the_last() {
    for tied in [true, false] {
        let model = Toy::new(16, 8, 3, tied);
        for world in [1, 2, 4] {
            for ga in [1, 2] {
                let mut cfg = config(Stage::Zero3, world, ga);
                cfg.param_persistence_threshold = 0;
                cfg.max_reuse_distance = 0;
                cfg.prefetch_bucket_size = 1 << 20;
                let o = check(&model, &cfg, Gather::Exact);
                let calls = |what: &str| {
                    o.collectives
                        .iter()
                        .find(|t| t.what == what)
                        .map_or(0, |t| t.calls)
                };
                // Forward gathers all 5 units, and the embedding again for a tied head; the
                // embedding stays gathered from one micro-step's backward into the next one's
                // forward. Backward gathers all but the head, which stays from its forward with
                // the embedding it reads.
                let (units, ga) = (5, ga as u64);
                let forward = ga * (units + u64::from(tied)) - (ga - 1);
                assert_eq!(
                    calls("params (forward)"),
                    forward,
                    "tied {tied} world {world}"
                );
                assert_eq!(calls("params (backward)"), (units - 1) * ga);
            }
        }
    }
}

#[test]
fn stage3_kept_graphs_and_checkpointing() {
    let model = Toy::new(16, 8, 3, true);
    for world in [2, 4] {
        // Default reuse distance: the last units keep their forward graph and skip the second
        // gather; the planned budget bounds the pool and the kept graphs together.
        let mut cfg = config(Stage::Zero3, world, 1);
        cfg.param_persistence_threshold = 0;
        let kept = check(&model, &cfg, Gather::AtMost);
        // Activation checkpointing keeps no graph: every unit but the last is gathered again.
        cfg.activation_checkpointing = true;
        cfg.prefetch_bucket_size = 1 << 20;
        let recomputed = check(&model, &cfg, Gather::Exact);
        assert!(
            planned(&kept, Collective::AllGather).0 < planned(&recomputed, Collective::AllGather).0
        );
    }
}

#[test]
fn bucket_advice_on_the_engine_path_counts_the_buckets_alone() {
    use zerodp::planner::plan;
    let model = Toy::new(64, 16, 3, true);
    // bf16 reductions go through buckets (f32 ones would run in place in the units' gradients).
    let mut cfg = config(Stage::Zero2, 4, 1).with_precision(DType::BF16);
    cfg.reduce_bucket_size = 1 << 30;
    let mut input = input_for(&model, &cfg);
    let o = plan_option(&input, choice(Stage::Zero2));
    let b = o.bytes_per_device;
    // A capacity the buckets alone break: half of them fits beside everything else.
    let room = b.reduce_buckets / 2;
    input.cluster.device_memory = b.total - b.reduce_buckets + room;
    input.configured = Some(choice(Stage::Zero2));
    let p = plan(&input).unwrap();
    let advice = p.recommendation.config_advice.join("\n");
    let bound: f64 = advice
        .split("reduce_bucket_size to at most ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .unwrap_or_else(|| panic!("no bucket bound in: {advice}"))
        .parse()
        .unwrap();
    // The buckets' collectives run in place, so the bound is the room over the two bf16 buckets,
    // up to the advice's three significant digits (counting a second, one-region buffer per bucket
    // would give only 4/5 of it at world size 4).
    let exact = (room / (2 * 2)) as f64;
    assert!(
        bound <= exact && bound >= exact * 0.99,
        "{advice}: the room holds two bf16 buckets of {exact} elements"
    );
    // The bound it gives makes the option fit, and the planner counts the engine's buckets.
    input.buffers.reduce_bucket_size = Some(bound as u64);
    let fixed = plan_option(&input, choice(Stage::Zero2));
    assert!(fixed.fits, "{advice}: {:?}", fixed.bytes_per_device);
    cfg.reduce_bucket_size = bound as usize;
    assert_eq!(
        fixed.bytes_per_device.reduce_buckets,
        buffers::plan(model.spec(), &cfg).bucket_bytes()
    );
}

#[test]
fn mixed_precision_with_every_grad_accum_and_communication_dtype() {
    // bf16 and fp16 parameters, gradients kept in fp32 or the 16-bit type, reduced in fp32 or the
    // 16-bit type: the planner sizes what the engine's ledger holds, through the one mapping.
    let model = Toy::new(16, 8, 2, true);
    for dtype in [DType::BF16, DType::F16] {
        for grad_accum in [DType::F32, dtype] {
            for comm in [DType::F32, dtype] {
                for stage in STAGES {
                    for world in [1, 2] {
                        let mut cfg = config(stage, world, 2).with_precision(dtype);
                        cfg.grad_accum_dtype = grad_accum;
                        cfg.comm_dtype = comm;
                        check(&model, &cfg, Gather::Exact);
                    }
                }
            }
        }
    }
}

#[test]
fn bf16_optimizer_states_are_sized_as_the_engine_holds_them() {
    // Adam's m and v in bf16, in fp32 and in bf16 training: half the moments' bytes, planned as
    // the ledger counts them.
    let model = Toy::new(16, 8, 2, true);
    for dtype in [DType::F32, DType::BF16] {
        for stage in STAGES {
            for world in [1, 2] {
                let mut cfg = config(stage, world, 2).with_precision(dtype);
                cfg.optimizer_states_dtype = DType::BF16;
                let o = check(&model, &cfg, Gather::Exact);
                let fp32 = plan_option(
                    &input_for(&model, &config(stage, world, 2).with_precision(dtype)),
                    choice(stage),
                );
                let half = |b: &zerodp::planner::DeviceBytes| b.adam_m + b.adam_v;
                assert_eq!(half(&o.bytes_per_device) * 2, half(&fp32.bytes_per_device));
            }
        }
    }
}

#[test]
fn the_planner_resolves_unset_dtypes_as_the_config_reader_does() {
    use zerodp::config::{load_str, ResolveContext};
    use zerodp::planner::config_precision;
    let model = Toy::new(16, 8, 2, true);
    for (block, precision) in [("bf16", Precision::Bf16), ("fp16", Precision::Fp16)] {
        for stage in 0..=3u8 {
            let text = format!(
                r#"{{"train_batch_size": 4, "zero_optimization": {{"stage": {stage}}},
                    "{block}": {{"enabled": true}}}}"#
            );
            let ctx = ResolveContext {
                world_size: 2,
                ..Default::default()
            };
            let settings = load_str(&text, "<test>", &ctx).unwrap().settings;
            let engine = zerodp::setup::engine_config(&settings, 2, 0).unwrap();
            let mut input = input_for(&model, &engine);
            // A plan made without a config: precision alone, every dtype unset.
            input.dtypes = DtypeOverrides::default();
            input.buffers = BufferOverrides::default();
            assert_eq!(config_precision(precision), settings.precision);
            let planned = planned_engine_config(&input, stage);
            assert_eq!(
                (planned.comm_dtype, planned.grad_accum_dtype),
                (engine.comm_dtype, engine.grad_accum_dtype),
                "{block} stage {stage}"
            );
        }
    }
}

#[test]
fn max_in_cpu_splits_parameter_shards_as_the_engine_does() {
    // Stage 3 with parameters on NVMe: for max_in_cpu limits that keep none, some and all of the
    // rank's units (a sweep of small limits), the planner puts in host memory exactly the shard bytes the engine keeps
    // there (its own rule over units), and the rest on NVMe.
    let model = Toy::new(16, 8, 3, true);
    for world in [1, 2, 4] {
        let mut cfg = config(Stage::Zero3, world, 1);
        let mut kept_bytes = Vec::new();
        for max_in_cpu in (0..1000).step_by(5).chain([1_000_000]) {
            cfg.offload_param = zerodp::zero::ParamTier::Nvme {
                dir: std::env::temp_dir(),
                buffer_count: 2,
                buffer_size: 1 << 10,
                max_in_cpu,
            };
            let mut inp = input_for(&model, &cfg);
            inp.buffers.max_in_cpu = Some(max_in_cpu as u64);
            let nvme = ZeroChoice::new(3, Offload::None, Offload::Nvme);
            let o = plan_option(&inp, nvme);
            let kept = zerodp::zero::resident_param_bytes(model.spec(), &cfg);
            kept_bytes.push(kept);
            let per_node = world as u64;
            assert_eq!(
                o.bytes_per_node.host_params,
                kept * per_node,
                "world {world}, max_in_cpu {max_in_cpu}"
            );
            let shard_bytes = o.bytes_per_node.host_params + o.bytes_per_node.nvme_params;
            let none = plan_option(&inp, ZeroChoice::new(3, Offload::None, Offload::Cpu));
            assert_eq!(
                shard_bytes, none.bytes_per_node.host_params,
                "world {world}"
            );
        }
        // The limits cover none, part and all of the rank's shards.
        let (first, last) = (kept_bytes[0], kept_bytes[kept_bytes.len() - 1]);
        assert_eq!(first, 0, "world {world}: {kept_bytes:?}");
        assert!(
            kept_bytes.iter().any(|&k| k > 0 && k < last),
            "world {world}: {kept_bytes:?}"
        );
    }
}

#[test]
fn a_partial_optimizer_offload_keeps_on_the_device_what_the_engine_keeps() {
    // Stage 3 with offload_optimizer.ratio: the planner's device-tier Adam moments are exactly
    // those of the units the engine keeps there (DeepSpeed's rule over units), for ratios that
    // keep all, some and none of them, and the host tier gets the offloaded share.
    let model = Toy::new(16, 8, 3, true);
    let host = ZeroChoice::new(3, Offload::Cpu, Offload::None);
    for world in [1, 2, 4] {
        let mut kept = Vec::new();
        for ratio in [0.0, 0.25, 0.5, 0.75, 1.0] {
            let mut cfg = config(Stage::Zero3, world, 1);
            cfg.offload_optimizer = zerodp::zero::OptimizerTier::Host;
            cfg.offload_ratio = ratio;
            let mut inp = input_for(&model, &cfg);
            inp.buffers.offload_ratio = Some(ratio);
            let o = plan_option(&inp, host);
            let held = train(&model, &cfg, 1, GLOBAL, SEQ).reports[0][0].memory;
            let planned = o.bytes_per_device.adam_m + o.bytes_per_device.adam_v;
            assert_eq!(
                planned, held.optimizer_states,
                "world {world}, ratio {ratio}"
            );
            let full = plan_option(&inp, ZeroChoice::new(3, Offload::None, Offload::None));
            let all = full.bytes_per_device.adam_m + full.bytes_per_device.adam_v;
            let moved = o.bytes_per_node.host_optimizer_states;
            assert_eq!(moved == 0, planned == all, "world {world}, ratio {ratio}");
            kept.push(planned);
        }
        // The ratios cover all, part and none of the units.
        assert_eq!(kept[kept.len() - 1], 0, "world {world}: {kept:?}");
        assert!(
            kept.windows(2).all(|w| w[0] >= w[1]),
            "world {world}: {kept:?}"
        );
        assert!(
            kept.iter().any(|&k| k > 0 && k < kept[0]),
            "world {world}: {kept:?}"
        );
    }
}

#[test]
fn a_bf16_master_is_sized_as_the_engine_holds_it() {
    // bf16_master_weights_and_grads: no fp32 master on the device, with f32 and bf16 moments, at
    // every stage, planned as the ledger counts it.
    let model = Toy::new(16, 8, 2, true);
    for states in [DType::F32, DType::BF16] {
        for stage in STAGES {
            for world in [1, 2] {
                let mut cfg = config(stage, world, 2).with_precision(DType::BF16);
                cfg.optimizer_states_dtype = states;
                cfg.bf16_master_weights = true;
                let o = check(&model, &cfg, Gather::Exact);
                assert_eq!(o.bytes_per_device.master, 0, "{stage:?} world {world}");
                assert!(o.bytes_per_device.adam_m > 0);
            }
        }
    }
}

#[test]
fn no_bucket_matches_the_engine_one_reduction_per_unit() {
    // reduce_bucket_size 0: each unit's gradient on its own, in place (f32) or through a staging
    // bucket of one unit (bf16 reductions of f32 gradients), with and without overlap.
    let model = Toy::new(16, 8, 2, false);
    let units = model.spec().units.len() as u64;
    for staged in [false, true] {
        for overlap in [true, false] {
            for stage in STAGES {
                let mut cfg = config(stage, 2, 2);
                if staged {
                    cfg = cfg.with_precision(DType::BF16);
                    cfg.grad_accum_dtype = DType::F32;
                }
                cfg.overlap_comm = overlap;
                cfg.reduce_bucket_size = 0;
                let plan = buffers::plan(model.spec(), &cfg);
                let what = format!("{stage:?} staged {staged} overlap {overlap}");
                assert_eq!(plan.bucket_bytes() > 0, staged, "{what}");
                let o = check(&model, &cfg, Gather::Exact);
                let grads = |op: Collective| {
                    o.collectives
                        .iter()
                        .find(|t| t.op == op && t.what == "grads")
                        .map_or(0, |t| t.calls)
                };
                let expect = match stage {
                    Stage::Zero0 | Stage::Zero1 => units,
                    _ => 2 * units,
                };
                let op = match stage {
                    Stage::Zero0 => Collective::AllReduce,
                    _ => Collective::ReduceScatter,
                };
                assert_eq!(grads(op), expect, "{what}");
            }
        }
    }
}
