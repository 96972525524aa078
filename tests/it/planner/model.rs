//! The planner's memory, traffic and time model against the ZeRO paper's formulas, DeepSpeed's
//! estimators and the classic worked examples.

use zerodp::flat::DType;
use zerodp::planner::{
    engine_buffer_bytes, interconnect, model_state_bytes, plan, plan_option, BufferOverrides,
    Cluster, Collective, HostLinks, ModelSize, Offload, PlanInput, Precision, ReductionDtypes,
    ZeroChoice,
};

const GIB: u64 = 1 << 30;

fn cluster(nodes: u64, per_node: u64, device_memory: u64, inter: &str) -> Cluster {
    Cluster {
        nodes,
        devices_per_node: per_node,
        device_memory,
        host_memory: 2 << 40,
        intra: interconnect("nvlink").unwrap(),
        inter: interconnect(inter).unwrap(),
        host: HostLinks::default(),
        device_flops: 400e12,
    }
}

fn input(params: u64, largest: u64, c: Cluster) -> PlanInput {
    PlanInput {
        model: ModelSize::from_count(params, Some(largest)).unwrap(),
        cluster: c,
        precision: Precision::Bf16,
        micro_batch: 1,
        seq_len: 2048,
        grad_accum: 1,
        activation_checkpointing: false,
        buffers: BufferOverrides::default(),
        dtypes: Default::default(),
        configured: None,
        process: None,
    }
}

fn none(stage: u8) -> ZeroChoice {
    ZeroChoice::new(stage, Offload::None, Offload::None)
}

/// Decimal GB rounded to one digit, as the paper's table prints them.
fn gb1(bytes: u64) -> f64 {
    (bytes as f64 / 1e8).round() / 10.0
}

#[test]
fn paper_table_psi_7_5b_on_64_devices() {
    let psi = 7_500_000_000;
    let got: Vec<f64> = (0..=3)
        .map(|s| {
            gb1(model_state_bytes(none(s), Precision::Bf16, psi, 64)
                .0
                .model_states)
        })
        .collect();
    assert_eq!(got, vec![120.0, 31.4, 16.6, 1.9]);
    // The formulas themselves: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N (Ψ/N = 117,187,500 exactly).
    let shard = psi / 64;
    let exact: Vec<u64> = (0..=3)
        .map(|s| {
            model_state_bytes(none(s), Precision::Bf16, psi, 64)
                .0
                .model_states
        })
        .collect();
    assert_eq!(
        exact,
        vec![
            16 * psi,
            4 * psi + 12 * shard,
            2 * psi + 14 * shard,
            16 * shard
        ]
    );
}

#[test]
fn fp32_training_counts_4_4_8_without_master() {
    let (d, _) = model_state_bytes(none(2), Precision::Fp32, 1_000_000, 4);
    assert_eq!(d.params, 4_000_000);
    assert_eq!(d.grads, 1_000_000);
    assert_eq!(d.master, 0);
    assert_eq!(d.adam_m + d.adam_v, 2_000_000);
}

#[test]
fn psi_terms_match_deepspeed_estimators() {
    // estimate_zero2/3_model_states_mem_needs, cold, 2 nodes x 8 GPUs, without the 1.5 fudge
    // factor and the 4L largest-layer term (the planner models the gather pool itself).
    let psi: u64 = 1_600_000_000;
    let (g, nodes) = (16u64, 2u64);
    let gpn = g / nodes;
    let shard = psi / g;
    let host_per_node = |c: ZeroChoice| model_state_bytes(c, Precision::Fp16, psi, g).1.host * gpn;
    let dev = |c: ZeroChoice| model_state_bytes(c, Precision::Fp16, psi, g).0.model_states;
    // zero2, offload_optimizer=cpu: per GPU 2Ψ.
    assert_eq!(
        dev(ZeroChoice::new(2, Offload::Cpu, Offload::None)),
        2 * psi
    );
    // zero2, none: DeepSpeed's 2Ψ + 18Ψ/G counts a transient fp32 gradient partition (4Ψ/G) on top of
    // the paper's 2Ψ + 14Ψ/G.
    assert_eq!(dev(none(2)) + 4 * shard, 2 * psi + 18 * shard);
    // zero3 cpu/cpu (zero_init): per GPU 4L only, per CPU 18Ψ/nodes.
    assert_eq!(dev(ZeroChoice::new(3, Offload::Cpu, Offload::Cpu)), 0);
    assert_eq!(
        host_per_node(ZeroChoice::new(3, Offload::Cpu, Offload::Cpu)),
        18 * psi / nodes
    );
    let off = model_state_bytes(
        ZeroChoice::new(3, Offload::Cpu, Offload::Cpu),
        Precision::Fp16,
        psi,
        g,
    )
    .1;
    assert_eq!(
        (
            off.host_optimizer_states,
            off.host_fp32_grads,
            off.host_params,
            off.nvme
        ),
        (12 * shard, 4 * shard, 2 * shard, 0)
    );
    let off = model_state_bytes(
        ZeroChoice::new(3, Offload::Nvme, Offload::Nvme),
        Precision::Fp16,
        psi,
        g,
    )
    .1;
    assert_eq!(
        (off.host, off.nvme_optimizer_states, off.nvme_params),
        (4 * shard, 12 * shard, 2 * shard)
    );
    // zero3 none/cpu: per GPU 4L + 2Ψ/G, per CPU 16Ψ/nodes.
    assert_eq!(
        dev(ZeroChoice::new(3, Offload::Cpu, Offload::None)),
        2 * shard
    );
    assert_eq!(
        host_per_node(ZeroChoice::new(3, Offload::Cpu, Offload::None)),
        16 * psi / nodes
    );
    // zero3 none/none: per GPU 4L + 18Ψ/G = 2 (16-bit params) + 4 (fp32 grads) + 12: DeepSpeed keeps
    // an fp32 gradient partition where the paper counts a 16-bit one, 2Ψ/G more.
    assert_eq!(dev(none(3)) + 2 * shard, 18 * shard);
}

#[test]
fn seventy_billion_in_plain_dp_needs_over_a_terabyte() {
    let psi = 70_000_000_000;
    let (d, _) = model_state_bytes(none(0), Precision::Bf16, psi, 8);
    assert_eq!(d.model_states, 1_120_000_000_000);
    assert!(d.model_states > 1_000_000_000_000);
    let o = plan_option(
        &input(psi, 1_000_000_000, cluster(1, 8, 80_000_000_000, "ib-ndr")),
        none(0),
    );
    assert!(!o.fits);
}

#[test]
fn seventy_billion_on_eight_80gb_devices() {
    let inp = input(
        70_000_000_000,
        1_000_000_000,
        cluster(1, 8, 80_000_000_000, "ib-ndr"),
    );
    let p = plan(&inp).unwrap();
    let fits = |c: ZeroChoice| p.options.iter().find(|o| o.choice() == c).unwrap().fits;
    use Offload::*;
    // Sharding alone: stage 3 holds 16Ψ/8 = 140 GB of model states, over 80 GB.
    for c in [none(0), none(1), none(2), none(3)] {
        assert!(!fits(c), "{} should not fit", c.label());
    }
    // Offloading to CPU below stage 3 keeps the full 2Ψ = 140 GB of 16-bit params on the device.
    assert!(!fits(ZeroChoice::new(1, Cpu, None)));
    assert!(!fits(ZeroChoice::new(2, Cpu, None)));
    // Stage 3 with the optimizer on the host: 2Ψ/8 = 17.5 GB of params + buffers on the device,
    // 16Ψ = 1120 GB on the 2 TiB host.
    for c in [
        ZeroChoice::new(3, Cpu, None),
        ZeroChoice::new(3, Cpu, Cpu),
        ZeroChoice::new(3, Nvme, Nvme),
    ] {
        assert!(fits(c), "{} should fit", c.label());
    }
    let lowest = p
        .options
        .iter()
        .filter(|o| o.fits)
        .min_by_key(|o| o.choice().preference_rank())
        .unwrap();
    assert_eq!(p.recommendation.choice, Some(lowest.choice()));
    assert_eq!(p.recommendation.choice, Some(ZeroChoice::new(3, Cpu, None)));
    assert!(p.recommendation.reasons[0].contains("stage 3 +opt cpu"));
    assert!(p
        .recommendation
        .reasons
        .iter()
        .any(|r| r.starts_with("stage 3 needs")));

    // With 1 TiB of host memory, CPU offload of 1120 GB no longer fits the host: NVMe is next.
    let mut small_host = inp.clone();
    small_host.cluster.host_memory = 1 << 40;
    let p = plan(&small_host).unwrap();
    let s3cpu = p
        .options
        .iter()
        .find(|o| o.choice() == ZeroChoice::new(3, Cpu, None))
        .unwrap();
    assert!(s3cpu.fits_device && !s3cpu.fits_host);
    assert_eq!(
        p.recommendation.choice,
        Some(ZeroChoice::new(3, Nvme, None))
    );
}

#[test]
fn nothing_fits_says_so_and_how_many_devices_would() {
    let p = plan(&input(
        70_000_000_000,
        1_000_000_000,
        cluster(1, 1, 80 * GIB, "ib-ndr"),
    ))
    .unwrap();
    // One device: stage 3 shards nothing, but offloading everything still fits...
    assert!(p.recommendation.choice.is_some());
    let mut tiny = input(70_000_000_000, 1_000_000_000, cluster(1, 1, GIB, "ib-ndr"));
    tiny.cluster.host_memory = GIB;
    let p = plan(&tiny).unwrap();
    assert_eq!(p.recommendation.choice, None);
    assert!(p.recommendation.reasons[0].contains("no stage or offload choice fits"));
}

#[test]
fn traffic_per_step_follows_2psi_and_3psi() {
    let psi: u64 = 1_000_000_000;
    let n = 16;
    let inp = input(psi, 50_000_000, cluster(2, 8, 80 * GIB, "ib-ndr"));
    let per_dev = |stage| plan_option(&inp, none(stage)).comm_bytes_per_step;
    // 2 bytes per element, (n-1)/n of each full tensor per rank.
    let two_psi = 2 * psi * 2 * (n - 1) / n;
    let three_psi = 3 * psi * 2 * (n - 1) / n;
    assert_eq!(per_dev(0), two_psi);
    assert_eq!(per_dev(1), two_psi);
    assert_eq!(per_dev(2), two_psi);
    assert_eq!(per_dev(3), three_psi);
    let ops: Vec<Collective> = plan_option(&inp, none(3))
        .collectives
        .iter()
        .map(|c| c.op)
        .collect();
    assert_eq!(
        ops,
        vec![
            Collective::AllGather,
            Collective::AllGather,
            Collective::ReduceScatter
        ]
    );
    assert_eq!(
        plan_option(&inp, none(0)).collectives[0].op,
        Collective::AllReduce
    );
    // fp32 doubles the bytes; gradient accumulation repeats stage 3's gathers every micro-step.
    let mut fp32 = inp.clone();
    fp32.precision = Precision::Fp32;
    assert_eq!(plan_option(&fp32, none(2)).comm_bytes_per_step, 2 * two_psi);
    let mut gas = inp.clone();
    gas.grad_accum = 4;
    assert_eq!(
        plan_option(&gas, none(3)).comm_bytes_per_step,
        4 * three_psi
    );
    assert_eq!(plan_option(&gas, none(1)).comm_bytes_per_step, two_psi);
}

#[test]
fn comm_time_is_monotone_and_hierarchical_wins_small_messages() {
    let c = cluster(8, 8, 80 * GIB, "ib-ndr");
    let mut last = 0.0;
    for bytes in [1e3, 1e5, 1e7, 1e9, 1e11] {
        for op in [
            Collective::AllReduce,
            Collective::ReduceScatter,
            Collective::AllGather,
        ] {
            assert!(c.ring_time(op, bytes) > 0.0 && c.hierarchical_time(op, bytes) > 0.0);
        }
        let (t, _) = c.collective_time(Collective::AllReduce, bytes, 1);
        assert!(t > last, "{bytes}: {t} <= {last}");
        last = t;
    }
    // Latency-bound: 63 inter-node steps on a flat ring vs 7 + 7 on the hierarchy.
    assert!(
        c.hierarchical_time(Collective::AllGather, 1e4) < c.ring_time(Collective::AllGather, 1e4)
    );
    // Bandwidth-bound: the hierarchy pays both the intra- and the inter-node bandwidth terms.
    assert!(
        c.ring_time(Collective::AllGather, 1e11) < c.hierarchical_time(Collective::AllGather, 1e11)
    );
    // An all-reduce costs about two all-gathers of the same size.
    let ar = c.ring_time(Collective::AllReduce, 1e10);
    let ag = c.ring_time(Collective::AllGather, 1e10);
    assert!((ar / ag - 2.0).abs() < 1e-9);
    // More calls for the same bytes only add latency.
    let (one, _) = c.collective_time(Collective::AllGather, 1e9, 1);
    let (many, _) = c.collective_time(Collective::AllGather, 1e9, 1000);
    assert!(many > one);
}

#[test]
fn slow_networks_make_stage_3_communication_dominate() {
    let fast = input(
        7_500_000_000,
        200_000_000,
        cluster(8, 8, 80 * GIB, "ib-ndr"),
    );
    let mut slow = fast.clone();
    slow.cluster.inter = interconnect("eth-100g").unwrap();
    let f = plan_option(&fast, none(3));
    let s = plan_option(&slow, none(3));
    assert_eq!(f.comm_bytes_per_step, s.comm_bytes_per_step);
    assert!(s.predicted_comm_s > 10.0 * f.predicted_comm_s);
    assert!(s.predicted_comm_s > s.predicted_compute_s);
    assert!(
        plan_option(&slow, none(3)).predicted_comm_s > plan_option(&slow, none(2)).predicted_comm_s
    );
}

#[test]
fn compute_time_is_6_psi_tokens_and_8_with_checkpointing() {
    let mut inp = input(1_000_000_000, 50_000_000, cluster(1, 8, 80 * GIB, "ib-ndr"));
    inp.micro_batch = 4;
    inp.seq_len = 1000;
    let t = plan_option(&inp, none(0)).predicted_compute_s;
    assert!((t - 6.0 * 1e9 * 4000.0 / 400e12).abs() < 1e-12);
    inp.activation_checkpointing = true;
    let t = plan_option(&inp, none(0)).predicted_compute_s;
    assert!((t - 8.0 * 1e9 * 4000.0 / 400e12).abs() < 1e-12);
}

#[test]
fn buffers_follow_the_engine_rules_in_the_options() {
    let inp = input(
        7_500_000_000,
        200_000_000,
        cluster(8, 8, 80 * GIB, "ib-ndr"),
    );
    let s3 = plan_option(&inp, none(3));
    // DeepSpeed defaults at stage 3: 5e8-element buckets, overlap on (two), max live 1e9.
    assert_eq!(s3.bytes_per_device.reduce_buckets, 2 * 500_000_000 * 2);
    assert_eq!(s3.bytes_per_device.gather_pool, 1_000_000_000 * 2);
    let b = engine_buffer_bytes(
        3,
        Precision::Bf16,
        &inp.model,
        &s3.buffer_settings,
        ReductionDtypes {
            grad_accum: DType::BF16,
            comm: DType::BF16,
        },
    );
    assert_eq!(
        b.reduce_buckets + b.gather_pool + b.persistent_params,
        s3.buffer_bytes()
    );
    let s2 = plan_option(&inp, none(2));
    assert_eq!(s2.bytes_per_device.reduce_buckets, 500_000_000 * 2);
    assert_eq!(s2.bytes_per_device.gather_pool, 0);
    let d = &s3.bytes_per_device;
    assert_eq!(
        d.total,
        d.model_states + d.reduce_buckets + d.gather_pool + d.persistent_params + d.activations
    );
}

/// `reduce_bucket_size` 0 (DeepSpeed: each gradient on its own): no bucket term in the bytes,
/// one reduction call per unit; a 16-bit reduction of f32 gradients stages one unit at a time.
#[test]
fn a_zero_bucket_plans_no_bucket_bytes_and_one_reduction_per_unit() {
    let (psi, largest) = (7_500_000_000u64, 200_000_000u64);
    let units = psi.div_ceil(largest);
    let mut inp = input(psi, largest, cluster(8, 8, 80 * GIB, "ib-ndr"));
    inp.precision = Precision::Fp32;
    for stage in 0..=3 {
        // Without overlap nothing is in flight beside the backward: the bytes are those of a
        // bucketed run (buckets smaller than a unit) less its bucket term.
        inp.buffers = BufferOverrides {
            reduce_bucket_size: Some(1_000_000),
            overlap_comm: Some(false),
            ..BufferOverrides::default()
        };
        let bucketed = plan_option(&inp, none(stage)).bytes_per_device;
        // (Stages 0-1 reduce f32 gradients in place in the units' own buffers whatever the size.)
        assert_eq!(bucketed.reduce_buckets > 0, stage >= 2, "stage {stage}");
        inp.buffers.reduce_bucket_size = Some(0);
        let o = plan_option(&inp, none(stage));
        let b = o.bytes_per_device;
        assert_eq!(b.reduce_buckets, 0, "stage {stage}");
        assert_eq!(
            b.total,
            bucketed.total - bucketed.reduce_buckets,
            "stage {stage}"
        );
        assert_eq!(
            b.total,
            b.model_states
                + b.scratch_buffers
                + b.gather_pool
                + b.persistent_params
                + b.activations
        );
        let calls = |op: Collective| -> u64 {
            o.collectives
                .iter()
                .filter(|t| t.op == op && t.what == "grads")
                .map(|t| t.calls)
                .sum()
        };
        let reduce = match stage {
            0 => calls(Collective::AllReduce),
            _ => calls(Collective::ReduceScatter),
        };
        assert_eq!(reduce, units, "stage {stage}");
        // With overlap (stage 3's default) one reduce-scatter in flight: no bucket either.
        inp.buffers.overlap_comm = None;
        assert_eq!(
            plan_option(&inp, none(stage))
                .bytes_per_device
                .reduce_buckets,
            0
        );
    }
    // bf16 reductions of f32 gradients (stage 0): a staging bucket of the largest unit, two with
    // overlap.
    let b = engine_buffer_bytes(
        0,
        Precision::Bf16,
        &inp.model,
        &zerodp::planner::BufferSettings {
            reduce_bucket_size: 0,
            overlap_comm: true,
            ..zerodp::planner::BufferSettings::deepspeed_defaults(0)
        },
        ReductionDtypes {
            grad_accum: DType::F32,
            comm: DType::BF16,
        },
    );
    assert_eq!(b.reduce_buckets, 2 * largest * 2);
}

#[test]
fn config_advice_names_a_bucket_size_that_breaks_the_budget() {
    let mut inp = input(
        7_500_000_000,
        200_000_000,
        cluster(8, 8, 16_000_000_000, "ib-ndr"),
    );
    inp.configured = Some(none(3));
    inp.buffers = BufferOverrides {
        reduce_bucket_size: Some(5_000_000_000),
        overlap_comm: Some(true),
        ..BufferOverrides::default()
    };
    let p = plan(&inp).unwrap();
    let s3 = p.options.iter().find(|o| o.choice() == none(3)).unwrap();
    assert!(!s3.fits);
    assert!(s3.bytes_per_device.total - s3.bytes_per_device.reduce_buckets < 16_000_000_000);
    let advice = p.recommendation.config_advice.join("\n");
    assert!(advice.contains("reduce_bucket_size"), "{advice}");
    // The bound it gives makes the option fit.
    let bound =
        (16_000_000_000 - (s3.bytes_per_device.total - s3.bytes_per_device.reduce_buckets)) / 4;
    let mut fixed = inp.clone();
    fixed.buffers.reduce_bucket_size = Some(bound);
    assert!(plan_option(&fixed, none(3)).fits);
}

#[test]
fn the_engine_path_uses_its_own_unit_layout() {
    use zerodp::zero::unit::{ModelSpec, ParamSpec, UnitSpec};
    let unit = |name: &str, shapes: &[&[usize]]| UnitSpec {
        name: name.into(),
        params: shapes
            .iter()
            .enumerate()
            .map(|(i, s)| ParamSpec {
                name: format!("{name}.{i}"),
                shape: s.to_vec(),
            })
            .collect(),
        uses: Vec::new(),
    };
    let spec = ModelSpec {
        units: vec![
            unit("wte", &[&[1000, 64], &[128, 64]]),
            unit("h.0", &[&[64, 192], &[192], &[64, 64]]),
            unit("h.1", &[&[64, 192], &[192], &[64, 64]]),
            unit("ln_f", &[&[64], &[64]]),
        ],
    };
    let model = ModelSize::from_model_spec(&spec, None);
    assert_eq!(model.params, spec.num_params() as u64);
    assert_eq!(model.largest_unit, 1128 * 64);
    let mut inp = input(1, 1, cluster(1, 4, 80 * GIB, "ib-ndr"));
    inp.model = model;
    inp.precision = Precision::Fp32;
    inp.buffers = BufferOverrides {
        reduce_bucket_size: Some(10_000),
        overlap_comm: Some(false),
        max_live_parameters: Some(0),
        param_persistence_threshold: Some(20_000),
        max_reuse_distance: None,
        prefetch_bucket_size: None,
        max_in_cpu: None,
        offload_ratio: None,
    };
    let o = plan_option(&inp, none(3));
    // Every unit is already a multiple of 4 x 8 elements: no padding.
    let psi = spec.num_params() as u64;
    // The engine's own rules: one f32 bucket of 10k elements (nothing beside it: its collectives
    // run in place), one gradient buffer of the largest unit, a gather budget of the largest unit
    // (wte) beside the persistent units h.0, h.1 and ln_f (≤ 20k elements).
    assert_eq!(o.bytes_per_device.reduce_buckets, 10_000 * 4);
    assert_eq!(o.bytes_per_device.scratch_buffers, 1128 * 64 * 4);
    assert_eq!(o.bytes_per_device.gather_pool, 1128 * 64 * 4);
    let persistent = 2 * (64 * 192 + 192 + 64 * 64) + 128;
    assert_eq!(o.bytes_per_device.persistent_params, persistent * 4);
    let mut cfg = zerodp::zero::EngineConfig::new(zerodp::zero::Stage::Zero3, 4);
    cfg.reduce_bucket_size = 10_000;
    cfg.overlap_comm = false;
    cfg.max_live_parameters = 0;
    cfg.param_persistence_threshold = 20_000;
    let engine = zerodp::zero::buffers::plan(&spec, &cfg);
    assert_eq!(
        o.buffer_bytes(),
        engine.buffer_bytes() + engine.gather_bytes()
    );
    // wte is gathered in forward and again in backward, the persistent units once; the grads are
    // reduce-scattered in 11 region-sized calls; plus the two-float loss/grad-norm all-reduce.
    let n = 4;
    let expect =
        (2 * (psi - persistent) + persistent + psi) * 4 * (n - 1) / n + 2 * 8 * (n - 1) / n;
    assert_eq!(o.comm_bytes_per_step, expect);
    let calls = |what: &str| {
        o.collectives
            .iter()
            .find(|t| t.what == what)
            .map(|t| t.calls)
    };
    assert_eq!(calls("grads"), Some(psi.div_ceil(4).div_ceil(2_500)));
    assert_eq!(calls("params (forward)"), Some(1));
    assert_eq!(calls("params (backward)"), Some(1));
    assert_eq!(calls("persistent params"), Some(3));
}

#[test]
fn max_in_cpu_keeps_parameter_shards_in_host_memory_and_off_the_disk() {
    // Stage 3, parameters to NVMe, 1e9 parameters on 8 devices: 125M-element shards of 2 bytes.
    let psi = 1_000_000_000u64;
    let mut inp = input(psi, 50_000_000, cluster(1, 8, 80 * GIB, "ib-ndr"));
    let choice = ZeroChoice::new(3, Offload::Cpu, Offload::Nvme);
    let shard = psi / 8;
    let at = |inp: &PlanInput| {
        let o = plan_option(inp, choice);
        (o.bytes_per_node, o.offload)
    };
    // DeepSpeed's default (1e9 elements) holds the whole shard: nothing of it on NVMe, no reads.
    let (off, traffic) = at(&inp);
    assert_eq!((off.host_params, off.nvme_params), (8 * 2 * shard, 0));
    assert_eq!(traffic.nvme_bytes_per_node, 0);
    // max_in_cpu 0: every shard on NVMe, read for each gather (forward and backward), written
    // after the step.
    inp.buffers.max_in_cpu = Some(0);
    let (off, traffic) = at(&inp);
    assert_eq!((off.host_params, off.nvme_params), (0, 8 * 2 * shard));
    assert_eq!(traffic.nvme_bytes_per_node, 8 * (2 + 1) * 2 * shard);
    // A quarter of the shard kept: the other three quarters on NVMe and in its traffic.
    inp.buffers.max_in_cpu = Some(shard / 4);
    let (off, traffic) = at(&inp);
    let kept = 8 * 2 * (shard / 4);
    assert_eq!(
        (off.host_params, off.nvme_params),
        (kept, 8 * 2 * shard - kept)
    );
    assert_eq!(traffic.nvme_bytes_per_node, 3 * (8 * 2 * shard - kept));
    // The host-link copies to the device are the whole shard's either way.
    let full = plan_option(
        &input(psi, 50_000_000, cluster(1, 8, 80 * GIB, "ib-ndr")),
        choice,
    );
    assert_eq!(traffic.host_link_bytes, full.offload.host_link_bytes);
}

#[test]
fn a_partial_optimizer_offload_splits_states_and_traffic_by_its_ratio() {
    // Stage 3, optimizer to NVMe, 1e9 bf16 parameters on 8 devices: offload_optimizer.ratio 0.25
    // keeps three quarters of the master and moments on the device and moves a quarter, with a
    // quarter of the full offload's NVMe traffic; 1.0 is the full offload.
    let psi = 1_000_000_000u64;
    let mut inp = input(psi, 50_000_000, cluster(1, 8, 80 * GIB, "ib-ndr"));
    let nvme = ZeroChoice::new(3, Offload::Nvme, Offload::None);
    let full = plan_option(&inp, nvme);
    let kept = plan_option(&inp, none(3));
    inp.buffers.offload_ratio = Some(0.25);
    let part = plan_option(&inp, nvme);
    let states = |o: &zerodp::planner::PlanOption| {
        let b = &o.bytes_per_device;
        b.master + b.adam_m + b.adam_v
    };
    assert_eq!(states(&full), 0);
    assert_eq!(states(&part), states(&kept) * 3 / 4);
    assert_eq!(
        part.bytes_per_node.nvme_optimizer_states,
        full.bytes_per_node.nvme_optimizer_states / 4
    );
    assert_eq!(
        part.offload.nvme_bytes_per_node,
        full.offload.nvme_bytes_per_node / 4
    );
    assert!(part.offload.predicted_s < full.offload.predicted_s);
    assert!(part.label.contains("ratio 0.25"), "{}", part.label);
    // Below stage 3 a ratio does not apply (the config reader refuses it there).
    let stage2 = plan_option(&inp, ZeroChoice::new(2, Offload::Nvme, Offload::None));
    inp.buffers.offload_ratio = None;
    assert_eq!(
        stage2,
        plan_option(&inp, ZeroChoice::new(2, Offload::Nvme, Offload::None))
    );
}

#[test]
fn a_bf16_master_drops_the_fp32_copy_on_the_device_and_where_it_is_offloaded() {
    // 1e9 bf16 parameters at stage 3 on 8 devices: the device keeps 2 + 2 + 8 bytes per shard
    // element instead of 2 + 2 + 12; offloaded, the host holds m and v (8 bytes), 4 with bf16
    // moments, instead of the fp32 copy, m and v (12).
    let psi = 1_000_000_000u64;
    let shard = psi / 8;
    let mut inp = input(psi, 50_000_000, cluster(1, 8, 80 * GIB, "ib-ndr"));
    inp.dtypes.bf16_master = true;
    let o = plan_option(&inp, none(3));
    let b = &o.bytes_per_device;
    assert_eq!(
        (b.params, b.grads, b.master, b.adam_m + b.adam_v),
        (2 * shard, 2 * shard, 0, 8 * shard)
    );
    let cpu = ZeroChoice::new(3, Offload::Cpu, Offload::None);
    assert_eq!(
        plan_option(&inp, cpu).bytes_per_node.host_optimizer_states,
        8 * 8 * shard
    );
    inp.dtypes.optimizer_states = Some(Precision::Bf16);
    assert_eq!(
        plan_option(&inp, cpu).bytes_per_node.host_optimizer_states,
        8 * 4 * shard
    );
    // Only bf16 runs have it.
    inp.precision = Precision::Fp16;
    assert!(plan_option(&inp, none(3)).bytes_per_device.master > 0);
}
