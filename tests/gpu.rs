//! The GPU path (`--device cuda`, feature `cuda`): the same run on the CPU and on a GPU gives the
//! same losses at every stage, and a machine or build without a GPU says so clearly.
//!
//! The parity tests need a build with `--features cuda` and a GPU; elsewhere they print why they
//! skip and pass. Run them on a GPU machine with
//! `cargo test --release --features cuda --test gpu -- --nocapture` (docs/gpus.md).

use candle_core::DType;
use zerodp::data::{Corpus, DataLoader, TokenBatch};
use zerodp::device::{ComputeDevice, GpuInfo};
use zerodp::model::hf::LlamaConfig;
use zerodp::model::llama::Llama;
use zerodp::model::{Candle, Gpt, GptConfig, GptModel};
use zerodp::trainer::{LrSchedule, ReportLog, Trainer};
use zerodp::zero::unit::UnitModel;
use zerodp::zero::{EngineConfig, Stage};

const GLOBAL: usize = 8;
const STEPS: u64 = 10;

fn loader(context: usize) -> DataLoader {
    let text =
        "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. "
            .repeat(40);
    DataLoader::new(Corpus::from_text("pangrams", &text), context, 3).unwrap()
}

/// Every step's loss of `got` within 1e-4 relative of `want`'s.
fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (a, b) in got.iter().zip(want) {
        assert!(
            (a - b).abs() <= 1e-4 * b.abs(),
            "{what}: {got:?} vs {want:?}"
        );
    }
}

/// The GPU to test on, or `None` after printing why there is none.
fn gpu_or_skip(test: &str) -> Option<GpuInfo> {
    match zerodp::device::resolve(ComputeDevice::Cuda(None)) {
        Ok(gpu) => gpu,
        Err(e) => {
            eprintln!("{test}: skipped: {e}");
            None
        }
    }
}

/// Rank 0's per-step losses of the tiny GPT on `model` (every rank checked to agree).
fn losses<M: UnitModel<Batch = TokenBatch>>(model: &M, stage: Stage, world: usize) -> Vec<f32> {
    losses_on(&[model], stage, world)
}

/// [`losses`] with rank r on `models[r]` when there is one model per rank, else every rank on
/// the one.
fn losses_on<M: UnitModel<Batch = TokenBatch>>(
    models: &[&M],
    stage: Stage,
    world: usize,
) -> Vec<f32> {
    let data = loader(GptConfig::tiny().context);
    let mut cfg = EngineConfig::new(stage, world);
    cfg.micro_batch = GLOBAL / world;
    cfg.gradient_clipping = 1.0;
    cfg.param_persistence_threshold = 1000;
    cfg.reduce_bucket_size = 5000;
    cfg.seed = 11;
    let log = ReportLog::new();
    let rank_models = match models.len() == world && world > 1 {
        true => models.to_vec(),
        false => Vec::new(),
    };
    Trainer::new(models[0], cfg)
        .with_rank_models(rank_models)
        .with_schedule(LrSchedule::Constant(3e-3))
        .run(&data, STEPS, &[&log])
        .unwrap_or_else(|e| panic!("{stage:?} world {world}: {e}"));
    let out: Vec<Vec<f32>> = log
        .into_reports()
        .iter()
        .map(|r| r.iter().map(|s| s.loss).collect())
        .collect();
    for l in &out {
        assert_eq!(l, &out[0], "ranks disagree on the loss");
    }
    out.into_iter().next().unwrap()
}

/// fp32 with TF32 off (candle's default, as PyTorch's): the GPU's losses equal the CPU's to 1e-4
/// relative over 10 steps, at stage 0 on one rank and at stages 1-3 on two ranks sharing the GPU
/// (their collectives on host buffers, as every rank's shards are).
#[test]
fn gpu_losses_equal_the_cpu_at_every_stage() {
    let Some(gpu) = gpu_or_skip("gpu_losses_equal_the_cpu_at_every_stage") else {
        return;
    };
    let device = zerodp::model::candle_device(Some(&gpu)).unwrap();
    let cpu = GptModel::new(GptConfig::tiny()).unwrap();
    let on_gpu = GptModel::on_device(GptConfig::tiny(), DType::F32, device).unwrap();
    for (stage, world) in [
        (Stage::Zero0, 1),
        (Stage::Zero1, 2),
        (Stage::Zero2, 2),
        (Stage::Zero3, 2),
    ] {
        let want = losses(&cpu, stage, world);
        let got = losses(&on_gpu, stage, world);
        eprintln!("{stage:?} world {world}: cpu {want:?}\n  gpu {got:?}");
        assert!(want[0] > 4.0, "a byte model starts near ln 256: {want:?}");
        assert_close(
            &got,
            &want,
            &format!("{stage:?} world {world} on {} (GPU) vs the CPU", gpu.name),
        );
    }
}

/// What a GPU runs, checked on every machine: the GPT's graph of a GPU (candle's products and
/// attention around the LayerNorm, GELU and causal softmax custom ops, whose CPU implementations
/// run here), and the same with every op composite (`ZERODP_CUDA_KERNELS=0` on a GPU), on the CPU,
/// give the fused kernels' losses at every stage. The GPU tests above then compare the two
/// devices.
#[test]
fn the_ops_a_gpu_runs_give_the_fused_kernels_losses_on_the_cpu() {
    let fused = GptModel::new(GptConfig::tiny()).unwrap();
    let gpu_ops = GptModel::with_gpu_ops(GptConfig::tiny()).unwrap();
    assert_composite_follows_fused(&gpu_ops, &fused);
    let composite = GptModel::with_options(GptConfig::tiny(), DType::F32, false).unwrap();
    assert_composite_follows_fused(&composite, &fused);
}

/// `composite`'s losses equal `fused`'s over 10 steps at stage 0 on one rank and stage 3 on two.
fn assert_composite_follows_fused<M: UnitModel<Batch = TokenBatch>>(composite: &M, fused: &M) {
    for (stage, world) in [(Stage::Zero0, 1), (Stage::Zero3, 2)] {
        let want = losses(fused, stage, world);
        let got = losses(composite, stage, world);
        assert_close(
            &got,
            &want,
            &format!("{stage:?} world {world}: composite vs fused"),
        );
    }
}

/// A GPU moves each unit's parameters in one copy and its gradients back in one (views of a flat
/// tensor, gradients concatenated): on the CPU that path gives the per-tensor path's bits, tied
/// weights included, at stage 0 and at stage 3 on two ranks.
#[test]
fn flat_transfers_give_the_per_tensor_bits() {
    let gpt = || Gpt::with_options(GptConfig::tiny(), DType::F32, false).unwrap();
    let per_tensor = Candle::new(gpt()).with_flat_transfers(false);
    let flat = Candle::new(gpt()).with_flat_transfers(true);
    for (stage, world) in [(Stage::Zero0, 1), (Stage::Zero3, 2)] {
        assert_eq!(
            losses(&flat, stage, world),
            losses(&per_tensor, stage, world),
            "{stage:?} world {world}"
        );
    }
}

/// Parameters kept on the device between calls (a GPU at stages 0-2) are dropped when the
/// engine steps: on the CPU, with flat transfers forced, every step's loss keeps the bits of a
/// run that copies them every call, over steps with two micro-batches each, at stages 0, 2 and 3
/// (stage 3 runs units twice).
#[test]
fn resident_parameters_follow_every_update() {
    let gpt = || Gpt::with_options(GptConfig::tiny(), DType::F32, false).unwrap();
    let copied = Candle::new(gpt()).with_flat_transfers(true);
    let resident = Candle::new(gpt())
        .with_flat_transfers(true)
        .with_resident_params(true);
    for (stage, world) in [(Stage::Zero0, 1), (Stage::Zero2, 2), (Stage::Zero3, 2)] {
        let accumulated = |m: &Candle<Gpt>| {
            let data = loader(GptConfig::tiny().context);
            let mut cfg = EngineConfig::new(stage, world);
            cfg.grad_accum = 2;
            cfg.micro_batch = GLOBAL / (2 * world);
            cfg.seed = 11;
            let log = ReportLog::new();
            Trainer::new(m, cfg)
                .with_schedule(LrSchedule::Constant(3e-3))
                .run(&data, 4, &[&log])
                .unwrap();
            let l: Vec<f32> = log.into_reports()[0].iter().map(|s| s.loss).collect();
            l
        };
        let want = accumulated(&copied);
        let got = accumulated(&resident);
        assert!(want[3] < want[0], "{want:?}");
        assert_eq!(got, want, "{stage:?} world {world}");
    }
}

/// What `train` runs on a GPU at stages 0-2: the parameters kept there between steps. Two ranks
/// sharing the GPU (and its one copy of the parameters) at stage 2 give the CPU's losses.
#[test]
fn gpu_resident_parameters_equal_the_cpu() {
    let keep = |m: GptModel| m.with_resident_params(true);
    assert_gpu_follows_cpu(
        "gpu_resident_parameters_equal_the_cpu",
        keep,
        (Stage::Zero2, 2),
    );
}

/// What `train` runs on one GPU without offload: the device tier there (parameters, gradients and
/// Adam's state on the GPU, Adam as GPU ops). The CPU's losses to 1e-4 relative over 10 steps.
#[test]
fn gpu_device_tier_equals_the_cpu() {
    let tier = |m: GptModel| m.with_device_tier(true);
    assert_gpu_follows_cpu("gpu_device_tier_equals_the_cpu", tier, (Stage::Zero0, 1));
}

/// Stages 0-2 on two ranks with a model each on the GPU, each keeping its device tier there: the
/// ranks reduce their gradients through host memory and step on the GPU (stage 0 all of each
/// unit; stages 1-2 each rank its shard, whose master and moments only it holds, then the host
/// all-gather). The CPU's losses (two ranks of the host tier) to 1e-4 relative over 10 steps.
#[test]
fn gpu_device_tier_on_two_ranks_equals_the_cpu() {
    let Some(gpu) = gpu_or_skip("gpu_device_tier_on_two_ranks_equals_the_cpu") else {
        return;
    };
    let device = zerodp::model::candle_device(Some(&gpu)).unwrap();
    let on_gpu = || {
        let m = GptModel::on_device(GptConfig::tiny(), DType::F32, device.clone()).unwrap();
        m.with_device_tier(true)
    };
    let (a, b) = (on_gpu(), on_gpu());
    let cpu = GptModel::new(GptConfig::tiny()).unwrap();
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2] {
        let want = losses(&cpu, stage, 2);
        let got = losses_on(&[&a, &b], stage, 2);
        eprintln!(
            "gpu_device_tier_on_two_ranks_equals_the_cpu {stage:?}: cpu {want:?}\n  gpu {got:?}"
        );
        assert_close(
            &got,
            &want,
            &format!("{stage:?}: two ranks' tiers on the GPU vs the CPU"),
        );
    }
}

/// The tiny GPT on the GPU, set up by `setup`, gives the CPU's losses to 1e-4 relative at `stage`
/// on `world` ranks (skipped, saying why, without a GPU).
fn assert_gpu_follows_cpu(
    test: &str,
    setup: impl Fn(GptModel) -> GptModel,
    (stage, world): (Stage, usize),
) {
    let Some(gpu) = gpu_or_skip(test) else {
        return;
    };
    let device = zerodp::model::candle_device(Some(&gpu)).unwrap();
    let cpu = GptModel::new(GptConfig::tiny()).unwrap();
    let on_gpu = setup(GptModel::on_device(GptConfig::tiny(), DType::F32, device).unwrap());
    let want = losses(&cpu, stage, world);
    let got = losses(&on_gpu, stage, world);
    eprintln!("{test}: cpu {want:?}\n  gpu {got:?}");
    assert_close(&got, &want, &format!("{test}: the GPU vs the CPU"));
}

/// A Llama of 2 layers, width 64, 4 query heads on 2 key/value heads, an untied head.
fn llama_tiny() -> LlamaConfig {
    let json = serde_json::json!({
        "model_type": "llama", "vocab_size": 300, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 32, "tie_word_embeddings": false
    });
    LlamaConfig::from_hf_json(&json, std::path::Path::new("config.json")).unwrap()
}

/// What a GPU runs of the Llama, checked on every machine: its op mix (composite products and
/// attention around the RMSNorm, rotary, SwiGLU and causal softmax custom ops, whose CPU
/// implementations run here), and candle's composite ops alone (`ZERODP_CUDA_KERNELS=0`), give
/// the fused kernels' losses over 10 steps on the CPU, at stage 0 on one rank and stage 3 on two.
#[test]
fn the_llama_ops_a_gpu_runs_give_the_fused_kernels_losses_on_the_cpu() {
    let fused = Candle::new(Llama::new(llama_tiny()).unwrap());
    let gpu_ops = Candle::new(Llama::new(llama_tiny()).unwrap().with_gpu_ops());
    assert_composite_follows_fused(&gpu_ops, &fused);
    let composite = Candle::new(Llama::new(llama_tiny()).unwrap().composite());
    assert_composite_follows_fused(&composite, &fused);
}

/// The families on the Llama's decoder (Qwen2's biases, tied head and sliding window, Qwen3's
/// query and key norms, Mistral's window, a Llama with attention and MLP biases and yarn scaling,
/// Gemma), as a GPU runs them (a window as a mask), checked on every machine: the GPU's op mix on
/// the CPU gives the fused kernels' losses over 10 steps.
#[test]
fn the_families_ops_a_gpu_runs_give_the_fused_kernels_losses_on_the_cpu() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf");
    for name in [
        "qwen2-tiny",
        "qwen3-tiny",
        "mistral-tiny",
        "llama-bias-tiny",
        "gemma-tiny",
    ] {
        let path = root.join(name).join("config.json");
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let config = LlamaConfig::from_hf_json(&json, &path).unwrap();
        let fused = Candle::new(Llama::new(config.clone()).unwrap());
        let gpu_ops = Candle::new(Llama::new(config).unwrap().with_gpu_ops());
        assert_composite_follows_fused(&gpu_ops, &fused);
    }
}

/// The Llama on a GPU (composite ops around zerodp's CUDA kernels for RMSNorm, the rotary
/// embeddings, SwiGLU and the causal softmax) against the Llama on the CPU (fused kernels): grouped-query
/// attention and an untied head, stage 0 on one rank and stage 3 on two, losses within 1e-4.
#[test]
fn gpu_llama_equals_the_cpu() {
    let Some(gpu) = gpu_or_skip("gpu_llama_equals_the_cpu") else {
        return;
    };
    let config = llama_tiny();
    let device = zerodp::model::candle_device(Some(&gpu)).unwrap();
    let cpu = Candle::new(Llama::new(config.clone()).unwrap());
    let on_gpu = Candle::new(
        Llama::new(config)
            .unwrap()
            .on_device(device, DType::F32)
            .unwrap(),
    );
    for (stage, world) in [(Stage::Zero0, 1), (Stage::Zero3, 2)] {
        let want = losses(&cpu, stage, world);
        let got = losses(&on_gpu, stage, world);
        eprintln!("Llama {stage:?} world {world}: cpu {want:?}\n  gpu {got:?}");
        assert_close(
            &got,
            &want,
            &format!("Llama {stage:?} world {world}: GPU vs the CPU"),
        );
    }
}

/// bf16 on the GPU computes in bf16 and still trains: the loss falls over 10 steps.
#[test]
fn gpu_bf16_trains() {
    let Some(gpu) = gpu_or_skip("gpu_bf16_trains") else {
        return;
    };
    let device = zerodp::model::candle_device(Some(&gpu)).unwrap();
    let model = GptModel::on_device(GptConfig::tiny(), DType::BF16, device).unwrap();
    let data = loader(GptConfig::tiny().context);
    let mut cfg = EngineConfig::new(Stage::Zero2, 1);
    cfg.micro_batch = GLOBAL;
    cfg.param_dtype = zerodp::flat::DType::BF16;
    cfg.comm_dtype = zerodp::flat::DType::BF16;
    cfg.grad_accum_dtype = zerodp::flat::DType::BF16;
    let log = ReportLog::new();
    Trainer::new(&model, cfg)
        .with_schedule(LrSchedule::Constant(3e-3))
        .run(&data, STEPS, &[&log])
        .unwrap();
    let l: Vec<f32> = log.into_reports()[0].iter().map(|s| s.loss).collect();
    assert!(
        l.iter().all(|x| x.is_finite()) && *l.last().unwrap() < l[0] - 0.5,
        "{l:?}"
    );
}

/// `zerodp train` of the tiny GPT for 5 steps at `stage`, two sequences a micro-batch (so
/// accumulation steps), with `args` (the world, the device): rank 0's losses and the run's
/// stdout and stderr (the banner; NCCL's version line, `NCCL_DEBUG=VERSION`, where it runs).
fn train_cli(stage: u8, args: &[&str]) -> (Vec<f32>, String) {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("ds.json");
    std::fs::write(
        &config,
        format!(
            r#"{{ "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                 "optimizer": {{ "type": "AdamW", "params": {{ "lr": 3e-3 }} }},
                 "gradient_clipping": 1.0, "zero_optimization": {{ "stage": {stage} }} }}"#
        ),
    )
    .unwrap();
    let text = dir.path().join("corpus.txt");
    std::fs::write(
        &text,
        "the quick brown fox jumps over the lazy dog. ".repeat(60),
    )
    .unwrap();
    let metrics = dir.path().join("metrics.jsonl");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(["train", "--model", "tiny", "--steps", "5", "--no-progress"])
        .args(args)
        .env("NCCL_DEBUG", "VERSION")
        .arg("--config")
        .arg(&config)
        .arg("--data")
        .arg(&text)
        .arg("--metrics")
        .arg(&metrics)
        .output()
        .unwrap();
    let err =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?}: {err}");
    let losses: Vec<f32> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|l| l["rank"] == 0)
        .map(|l| l["loss"].as_f64().unwrap() as f32)
        .collect();
    (losses, err)
}

/// `train` on two in-process ranks of one GPU at stages 0 and 2: each rank gets a model of its
/// own keeping its device tier there (the banner says Adam runs on the GPU; at stage 2 each
/// rank's shard of its state), and the run's losses follow the same run on the CPU to 1e-4
/// relative.
#[test]
fn gpu_train_on_two_in_process_ranks_keeps_a_tier_each() {
    if gpu_or_skip("gpu_train_on_two_in_process_ranks_keeps_a_tier_each").is_none() {
        return;
    }
    for stage in [0u8, 2] {
        let two = ["--world-size", "2", "--device"];
        let (want, _) = train_cli(stage, &[&two[..], &["cpu"]].concat());
        let (got, banner) = train_cli(stage, &[&two[..], &["cuda"]].concat());
        assert!(banner.contains("optimizer: Adam on the GPU"), "{banner}");
        let what = format!("train --device cuda on two ranks at stage {stage} vs the CPU");
        assert_close(&got, &want, &what);
    }
}

/// `train --nccl`: one in-process rank per GPU (one on a machine with one GPU), the collectives
/// through NCCL (its version line shows it ran); the CPU's losses to 1e-4 relative, at stages 0
/// and 2.
#[test]
fn gpu_train_over_nccl_equals_the_cpu() {
    if gpu_or_skip("gpu_train_over_nccl_equals_the_cpu").is_none() {
        return;
    }
    let world = zerodp::device::gpu_count().unwrap().min(2).to_string();
    for stage in [0u8, 2] {
        let ranks = ["--world-size", world.as_str(), "--device"];
        let (want, _) = train_cli(stage, &[&ranks[..], &["cpu"]].concat());
        let (got, banner) = train_cli(stage, &[&ranks[..], &["cuda", "--nccl"]].concat());
        assert!(banner.contains("collectives over NCCL"), "{banner}");
        assert!(
            banner.contains("NCCL version"),
            "NCCL did not run: {banner}"
        );
        assert_close(
            &got,
            &want,
            &format!("train --nccl at stage {stage} vs the CPU"),
        );
    }
}

/// `zerodp train` of the tiny GPT for a step with `args`, in a build without the `cuda`
/// feature: refused before any work (exit 1, no panic); its stderr.
#[cfg(not(feature = "cuda"))]
fn refused_without_cuda(config: &str, args: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ds.json");
    std::fs::write(&path, config).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(["train", "--model", "tiny", "--steps", "1"])
        .args(args)
        .arg("--config")
        .arg(&path)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

/// Without a GPU build, `--nccl` is refused before any work, saying how to get one.
#[cfg(not(feature = "cuda"))]
#[test]
fn train_over_nccl_without_the_feature_says_how_to_build_it() {
    let err = refused_without_cuda(r#"{"train_batch_size": 2}"#, &["--nccl"]);
    assert!(err.contains("--nccl needs a GPU build"), "{err}");
}

/// Without a GPU build, `--device cuda` is refused before any work, saying how to get one.
#[cfg(not(feature = "cuda"))]
#[test]
fn train_on_cuda_without_the_feature_says_how_to_build_it() {
    let config = r#"{"train_batch_size": 2, "zero_optimization": {"stage": 1}}"#;
    let err = refused_without_cuda(config, &["--device", "cuda"]);
    assert!(err.contains("--features cuda"), "{err}");
    assert!(err.contains("--device cpu"), "{err}");
}

/// A device name zerodp does not know is refused by the argument parser, naming the choices.
#[test]
fn an_unknown_device_is_refused_naming_the_choices() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_zerodp"))
        .args(["train", "--config", "x.json", "--device", "tpu"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("cuda:N"), "{err}");
}

/// Every collective on rank-dependent inputs of an uneven length (7 elements over two ranks), as
/// each rank sees the results (bits) and its traffic counters.
#[cfg(feature = "cuda")]
fn exercise(c: &dyn zerodp::comm::Communicator) -> (Vec<Vec<u32>>, zerodp::comm::TrafficCounters) {
    use zerodp::comm::{shard_range, ReduceOp};
    use zerodp::flat::Buffer;
    let (rank, world) = (c.rank(), c.world_size());
    let values: Vec<f32> = (0..7)
        .map(|i| ((i * 3 + rank * 5) as f32 * 0.37).sin() * 3.0)
        .collect();
    let bits = |b: &Buffer| {
        (0..b.len())
            .map(|i| b.get_f32(i).to_bits())
            .collect::<Vec<_>>()
    };
    let bf16 = Buffer::BF16(values.iter().map(|&v| half::bf16::from_f32(v)).collect());
    let mut seen = Vec::new();
    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
        let out = c
            .all_reduce(Buffer::F32(values.clone()), op)
            .wait_one()
            .unwrap();
        seen.push(bits(&out));
    }
    seen.push(bits(
        &c.all_reduce(bf16.clone(), ReduceOp::Sum)
            .wait_one()
            .unwrap(),
    ));
    let mine = shard_range(7, world, rank);
    let shard = Buffer::zeros(zerodp::flat::DType::F32, mine.len());
    let (_, out) = (c.reduce_scatter(Buffer::F32(values.clone()), shard, ReduceOp::Sum))
        .wait_pair()
        .unwrap();
    seen.push(bits(&out));
    let out = (c.reduce_scatter_in_place(bf16.clone(), ReduceOp::Sum))
        .wait_one()
        .unwrap();
    seen.push(bits(&out.copy_range(mine.clone())));
    let full = Buffer::zeros(zerodp::flat::DType::BF16, 7);
    let (_, out) = c
        .all_gather(bf16.copy_range(mine.clone()), full)
        .wait_pair()
        .unwrap();
    seen.push(bits(&out));
    seen.push(bits(
        &c.all_gather_in_place(Buffer::F32(values.clone()))
            .wait_one()
            .unwrap(),
    ));
    seen.push(bits(
        &c.broadcast(Buffer::F32(values), world - 1)
            .wait_one()
            .unwrap(),
    ));
    c.barrier().wait().unwrap();
    (seen, c.traffic())
}

/// NCCL (`comm::NcclComm`), one rank per GPU, against the in-process backend on the same inputs:
/// every collective's results bit for bit (sums in f32, 16-bit ones rounded once; uneven shards)
/// and the same traffic counters. Two ranks where the machine has two GPUs, else one.
#[cfg(feature = "cuda")]
#[test]
fn gpu_nccl_collectives_equal_the_in_process_backends() {
    use zerodp::comm::{run_ranks, CommError, CommOptions, NcclComm};
    if gpu_or_skip("gpu_nccl_collectives_equal_the_in_process_backends").is_none() {
        return;
    }
    let world = zerodp::device::gpu_count().unwrap().min(2);
    if world < 2 {
        eprintln!("gpu_nccl: one GPU, so a world of one rank (two ranks need two GPUs)");
    }
    let ordinals: Vec<usize> = (0..world).collect();
    let comms = NcclComm::group(&ordinals, CommOptions::default()).unwrap();
    let nccl: Vec<_> = std::thread::scope(|s| {
        let ranks: Vec<_> = (comms.iter())
            .map(|c| s.spawn(move || exercise(c)))
            .collect();
        ranks.into_iter().map(|r| r.join().unwrap()).collect()
    });
    let inproc = run_ranks(world, CommOptions::default(), |c, _| {
        Ok::<_, CommError>(exercise(&*c))
    })
    .unwrap();
    assert_eq!(nccl, inproc);
}

/// Generation on the GPU writes the CPU's greedy tokens (which equal transformers', see
/// tests/it/model/generate.rs), for the GPT-2 and the Llama fixtures.
#[test]
fn generation_on_the_gpu_writes_the_cpus_greedy_tokens() {
    use zerodp::model::generate::{GenerateOptions, UnitTensors};
    use zerodp::model::hf::{self, HfConfig};
    use zerodp::model::train_model::{build_model, HfModel};
    let Some(gpu) = gpu_or_skip("generation_on_the_gpu_writes_the_cpus_greedy_tokens") else {
        return;
    };
    let device = zerodp::model::candle_device(Some(&gpu)).unwrap();
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf");
    for name in ["gpt2-tiny", "llama-tiny", "mistral-tiny"] {
        let dir = fixtures.join(name);
        let hf_model = HfModel {
            config: HfConfig::read(&dir.join("config.json")).unwrap(),
            dir: Some(dir.clone()),
        };
        let run = |on: candle_core::Device| {
            let model = build_model(
                &hf_model.config.gpt,
                Some(&hf_model),
                (on.clone(), DType::F32),
            )
            .unwrap();
            let weights = hf::load_weights(&dir, model.spec()).unwrap();
            let w = UnitTensors::new(model.spec(), &weights, (&on, DType::F32)).unwrap();
            let options = GenerateOptions {
                max_new_tokens: 20,
                ..Default::default()
            };
            model
                .generate(&w, &[5, 17, 42, 7], &options, |_| true)
                .unwrap()
                .tokens
        };
        assert_eq!(run(device.clone()), run(candle_core::Device::Cpu), "{name}");
    }
}
