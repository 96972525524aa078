//! `zerodp bench train`: training throughput (tokens/s) per ZeRO stage and world size.
//!
//! For every (stage, world size) pair: build the GPT, run warm-up steps, then time steps; a step's
//! time is the slowest rank's, and the reported throughput is the global batch's tokens over the
//! median step time. With `--rounds R` the pairs run R times, interleaved, and the median is over
//! all rounds (a shared machine's load drifts; interleaving spreads the drift evenly). fp32, DeepSpeed's default bucket and stage-3 knobs unless overridden. The data
//! are seeded random ASCII bytes (the corpus must be UTF-8): throughput does not depend on the text.
//!
//! Under `mpirun` (`--backend auto` or `mpi`) every process is one rank: the world size is the
//! process count (`--world-sizes` is ignored), each step counts as its slowest rank's time (the
//! ranks' times are max-reduced) and rank 0 prints.

use super::train::ModelArgs;
use anyhow::bail;
use std::sync::Arc;
use zerodp::comm::{CommOptions, Communicator, ReduceOp};
use zerodp::config::{defaults, Precision};
use zerodp::data::{Corpus, DataLoader};
use zerodp::flat::Buffer;
use zerodp::model::train_model::{self, TrainModel};
use zerodp::model::GptConfig;
use zerodp::rng::SplitMix64;
use zerodp::trainer::{Backend, LrSchedule, ReportLog, Trainer};
use zerodp::zero::unit::UnitModel;
use zerodp::zero::{EngineConfig, OptimizerTier, ParamTier, PhaseTimes, Stage, StepReport};

#[derive(clap::Args, Debug)]
pub struct BenchTrainArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Benchmark the model a Hugging Face GPT-2 or Llama config.json describes (seeded weights)
    /// instead of a GPT preset; `--context` sets its sequence length [default: the config's
    /// max_position_embeddings or n_positions].
    #[arg(long, value_name = "FILE", conflicts_with_all = ["preset", "layers", "width", "heads"])]
    pub model_config: Option<std::path::PathBuf>,
    /// Stages to run, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = vec![0u8, 1, 2, 3])]
    pub stages: Vec<u8>,
    /// World sizes to run, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 2, 4])]
    pub world_sizes: Vec<usize>,
    /// Sequences per rank per step (one micro-batch, no accumulation).
    #[arg(long, default_value_t = 8)]
    pub per_rank: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Timed steps per round (the median over all rounds is reported).
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Run every configuration this many times, interleaved, so that a change in the machine's
    /// load spreads over all of them instead of favouring one.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Gradient bucket size in elements (0: each unit's gradient reduced on its own, as the
    /// config's reduce_bucket_size 0).
    #[arg(long, default_value_t = 500_000_000)]
    pub reduce_bucket_size: usize,
    /// Reduce and gather without overlapping compute.
    #[arg(long)]
    pub no_overlap: bool,
    /// Stage 3: `stage3_max_reuse_distance` (0 = strict: release after forward, gather again and
    /// recompute in backward).
    #[arg(long, default_value_t = 1_000_000_000)]
    pub max_reuse_distance: usize,
    /// Recompute units in backward at every stage.
    #[arg(long)]
    pub checkpoint_activations: bool,
    /// Where Adam's states live, comma-separated: `none`, `cpu` (host tier), `nvme` (a swap
    /// file per rank under --nvme-path, streamed --sub-group-size elements at a time) or
    /// `nvme-all` (`nvme`, and at stage 3 the parameter shards in a second swap file, DeepSpeed's
    /// offload_param to nvme). With NVMe the disk's sequential direct-I/O speed is measured in the
    /// same run.
    #[arg(long, value_delimiter = ',', default_values_t = vec![Offload::None])]
    pub offload: Vec<Offload>,
    /// Directory of the NVMe swap files [default: the system's temporary directory].
    #[arg(long)]
    pub nvme_path: Option<std::path::PathBuf>,
    /// Elements of Adam's moments streamed at a time under NVMe offload (`sub_group_size`).
    #[arg(long, default_value_t = 1_000_000)]
    pub sub_group_size: usize,
    /// Stream buffers of that many elements under NVMe offload, half for m and half for v
    /// (`offload_optimizer.buffer_count`; DeepSpeed's default 4 is double buffering).
    #[arg(long, default_value_t = 4)]
    pub buffer_count: usize,
    /// Adam's moments in `f32` or `bf16` for every row (`zerodp.optimizer_states_dtype`; with
    /// `nvme` the swap file holds them so, half the disk traffic).
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    pub optimizer_states: String,
    /// Parameters and gradients in `fp32` or `bf16` (fp32 master weights and Adam moments on the
    /// owning shard, as the config's bf16 block): what the model computes in on a GPU.
    #[arg(long, default_value = "fp32", value_parser = ["fp32", "bf16"])]
    pub precision: String,
    #[command(flatten)]
    pub device: super::device_args::DeviceArgs,
    /// Run the model on candle's composite ops rather than zerodp's fused CPU kernels (what a GPU
    /// runs; on the CPU, the fused kernels' reference and the measure of what they gain).
    #[arg(long)]
    pub composite_ops: bool,
    /// `table` or `json`.
    #[arg(long, default_value = "table")]
    pub format: String,
    /// Where the ranks run: `inprocess` (threads), `mpi` (one rank per process, under mpirun) or
    /// `auto` (MPI when started by an MPI launcher).
    #[arg(long, value_enum, default_value_t = super::launch::BackendChoice::Auto)]
    pub backend: super::launch::BackendChoice,
}

/// Where Adam's states live in a benchmark row.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Offload {
    None,
    Cpu,
    Nvme,
    /// Optimizer states and, at stage 3, parameter shards on NVMe.
    #[serde(rename = "nvme-all")]
    NvmeAll,
}

impl Offload {
    fn uses_nvme(self) -> bool {
        matches!(self, Offload::Nvme | Offload::NvmeAll)
    }
}

impl std::fmt::Display for Offload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Offload::None => "none",
            Offload::Cpu => "cpu",
            Offload::Nvme => "nvme",
            Offload::NvmeAll => "nvme-all",
        })
    }
}

/// Under MPI: this process's rank and the rayon threads it computes with.
type MpiRank = (Arc<dyn Communicator>, usize);

/// One measured configuration.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchRow {
    pub stage: u8,
    /// Where Adam's states lived: `none`, `cpu` or `nvme`.
    pub offload: Offload,
    pub world_size: usize,
    pub num_params: usize,
    pub tokens_per_step: usize,
    /// Timed steps over all rounds.
    pub timed_steps: usize,
    pub median_step_s: f64,
    pub min_step_s: f64,
    pub tokens_per_s: f64,
    /// Rank 0's model states and buffers at the end, in bytes.
    pub bytes_per_rank: u64,
    pub peak_bytes_per_rank: u64,
    pub rayon_threads_per_rank: usize,
    /// Rank 0's time split of its median-time step, in seconds.
    pub phases: zerodp::zero::PhaseTimes,
    /// The model's FLOPs per second at the median step ([`GptConfig::flops_per_token`] times
    /// tokens/s).
    ///
    /// [`GptConfig::flops_per_token`]: zerodp::model::GptConfig::flops_per_token
    pub model_flops_per_s: f64,
    /// The machine's f32 GEMM rate on the block's largest product (rows of one rank's batch,
    /// width, 4 x width), one thread per compute thread of the run, all at once, measured after
    /// the timed steps of the same run, on the path the model's products take (`gemm_path`).
    pub gemm_flops_per_s: f64,
    /// Model FLOPs utilisation against that rate: `model_flops_per_s / gemm_flops_per_s`.
    pub mfu: f64,
    /// The GEMM the model's f32 products ran on: `amx` or `gemm` (see `zerodp::model::GEMM_ENV`),
    /// or `cuda` on a GPU (`--device`), where `gemm_flops_per_s` and `mfu` are 0 (not measured).
    pub gemm_path: &'static str,
    /// Where the Adam step ran: `cpu` (the CPU Adam on host memory), or `gpu` (the device tier in
    /// the GPU's memory: one rank, or stages 0-2, without offload, `zerodp::zero::device_tier`).
    pub adam_on: &'static str,
    /// Where the units computed (`--device`): `cpu`, or the GPU's ordinal, name, compute
    /// capability and memory, and the compute dtype.
    pub device: String,
    /// NVMe offload: rank 0's swap-file bytes read and written per step, and their rate over the
    /// median step and over its optimizer phase (when the disk works), in GB/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nvme: Option<NvmeRates>,
    /// Among the rows of this stage and offload, this world size (ranks x cores / ranks
    /// threads) ran the most tokens/s: the split of this host to train with.
    pub fastest_split: bool,
}

/// Swap-file traffic of an NVMe-offloaded row, beside the disk's own sequential speed.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct NvmeRates {
    pub read_bytes_per_step: u64,
    pub written_bytes_per_step: u64,
    pub gbps_over_step: f64,
    pub gbps_over_optimizer: f64,
    /// The disk under --nvme-path, measured in the same run: 1 GiB written then read, direct I/O.
    pub disk_write_gbps: f64,
    pub disk_read_gbps: f64,
}

pub fn run(args: BenchTrainArgs) -> anyhow::Result<i32> {
    check_args(&args)?;
    let (world_sizes, mpi) = ranks(&args)?;
    let rank = mpi.as_ref().map_or(0, |(c, _)| c.rank());
    let bench = BenchModel::open(&args)?;
    let data = random_windows(bench.gpt.context)?;
    let samples = measure_all(&args, &bench, &data, &world_sizes, mpi.as_ref())?;
    let disk = match args.offload.iter().any(|o| o.uses_nvme()) && rank == 0 {
        true => Some(zerodp::offload::sequential_speed(
            &nvme_dir(&args),
            1 << 30,
        )?),
        false => None,
    };
    let num_params = bench.model.spec().num_params();
    let mut rows: Vec<BenchRow> = samples
        .iter()
        .map(|x| x.row(num_params, data.context(), disk))
        .collect();
    fill_rates(&args, &bench, &mut rows, mpi.as_ref())?;
    if rank != 0 {
        return Ok(0);
    }
    mark_fastest_splits(&mut rows);
    if args.format == "json" {
        outln!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        rows.iter().for_each(print_phases);
        print_table(
            &rows,
            (bench.model.arch(), &bench.gpt),
            (args.per_rank, &args.precision),
        )?;
    }
    Ok(0)
}

/// The arguments' own checks, before any work.
fn check_args(args: &BenchTrainArgs) -> anyhow::Result<()> {
    if args.format != "table" && args.format != "json" {
        bail!("--format must be table or json, got {}", args.format);
    }
    if args.steps == 0 || args.per_rank == 0 || args.rounds == 0 {
        bail!("--steps, --per-rank and --rounds must be at least 1");
    }
    Ok(())
}

/// The world sizes to measure and, under MPI, this process's rank: MPI measures its own world.
fn ranks(args: &BenchTrainArgs) -> anyhow::Result<(Vec<usize>, Option<MpiRank>)> {
    match super::launch::resolve(args.backend, None)? {
        super::launch::Resolved::Mpi { world } => {
            let (comm, topo) = super::launch::start_mpi(CommOptions::from_env()?, world)?;
            let threads = super::launch::threads_for_local_ranks(topo.local_size);
            Ok((vec![world], Some((comm, threads))))
        }
        super::launch::Resolved::InProcess { .. } => Ok((args.world_sizes.clone(), None)),
    }
}

/// The benchmarked model, where it computes, and what builds it again (a GPU case builds its own).
struct BenchModel {
    gpt: GptConfig,
    hf: Option<train_model::HfModel>,
    device: super::device_args::OpenDevice,
    model: TrainModel,
    /// `--device` and the precision, which open each rank's GPU.
    device_args: (super::device_args::DeviceArgs, zerodp::config::Precision),
}

impl BenchModel {
    /// The model of `--model-config` or the GPT preset, on `--device`.
    fn open(args: &BenchTrainArgs) -> anyhow::Result<Self> {
        let hf = super::hf_model::HfModelArgs {
            model_dir: None,
            model_config: args.model_config.clone(),
        }
        .read()?;
        let gpt = match &hf {
            Some(m) => {
                let mut gpt = m.config.gpt.clone();
                gpt.context = args.model.context.unwrap_or(gpt.context);
                gpt
            }
            None => args.model.build("small")?,
        };
        let device = args.device.open(precision_of(args))?;
        if device.gpu.is_some() {
            errln!("device: {}", device.describe());
        }
        let mut model = train_model::build_model(&gpt, hf.as_ref(), device.on())?;
        if args.composite_ops {
            if device.gpu.is_some() {
                bail!("--composite-ops is the CPU's reference: on a GPU every model runs on composite ops");
            }
            model = model.on_composite_ops()?;
        }
        Ok(BenchModel {
            gpt,
            hf,
            device,
            model,
            device_args: (args.device.clone(), precision_of(args)),
        })
    }

    /// The models case `cfg` runs: on a GPU fresh ones, one per rank of this process, each
    /// keeping there what `cfg` allows (the parameters between steps, or its device tier); on the
    /// CPU none (every case runs the one model). Under MPI (`mpi`) this process runs one rank.
    fn for_case(&self, cfg: &EngineConfig, mpi: bool) -> anyhow::Result<Vec<TrainModel>> {
        if self.device.gpu.is_none() {
            return Ok(Vec::new());
        }
        let ranks = if mpi { 1 } else { cfg.world_size };
        let (args, precision) = &self.device_args;
        super::hf_model::rank_models(
            &self.gpt,
            self.hf.as_ref(),
            (args, *precision, &self.device),
            (cfg, ranks),
        )
    }
}

/// Every round of every world size, stage and offload, merged per case.
fn measure_all(
    args: &BenchTrainArgs,
    bench: &BenchModel,
    data: &DataLoader,
    world_sizes: &[usize],
    mpi: Option<&MpiRank>,
) -> anyhow::Result<Vec<Samples>> {
    let rank = mpi.map_or(0, |(c, _)| c.rank());
    let mut samples: Vec<Samples> = Vec::new();
    for round in 0..args.rounds {
        for &world in world_sizes {
            for &s in &args.stages {
                for &offload in &args.offload {
                    let stage = Stage::from_index(s)
                        .ok_or_else(|| anyhow::anyhow!("stage {s}: use 0-3"))?;
                    let cfg = case_config(args, (stage, offload), world)?;
                    let own = bench.for_case(&cfg, mpi.is_some())?;
                    let on: Vec<&TrainModel> = match own.is_empty() {
                        true => vec![&bench.model],
                        false => own.iter().collect(),
                    };
                    let got = measure(args, &on, data, (cfg, offload), mpi)?;
                    if args.format == "table" && rank == 0 {
                        let mut times = got.steps.clone();
                        times.sort_by(f64::total_cmp);
                        errln!(
                            "round {} stage {s} offload {offload} world {world}: median step {:.1} ms",
                            round + 1,
                            times[times.len() / 2] * 1e3
                        );
                    }
                    let same =
                        |x: &Samples| x.stage == stage && x.offload == offload && x.world == world;
                    match samples.iter_mut().find(|x| same(x)) {
                        Some(x) => x.merge(got),
                        None => samples.push(got),
                    }
                }
            }
        }
    }
    Ok(samples)
}

/// Each row's device, model FLOP rate and, on the CPU, the machine's GEMM rate and the MFU
/// against it (probed once per split of ranks and threads); on a GPU no utilisation.
fn fill_rates(
    args: &BenchTrainArgs,
    bench: &BenchModel,
    rows: &mut [BenchRow],
    mpi: Option<&MpiRank>,
) -> anyhow::Result<()> {
    let gpt = &bench.gpt;
    let shape = (args.per_rank * gpt.context, gpt.width, 4 * gpt.width);
    let mut probed: Vec<(usize, usize, f64)> = Vec::new();
    for r in rows {
        r.device = bench.device.describe();
        r.model_flops_per_s = bench.model.flops_per_token(gpt) * r.tokens_per_s;
        if bench.device.gpu.is_some() {
            // The CPU's GEMM rate says nothing of a GPU run: no utilisation is claimed.
            r.gemm_path = "cuda";
            continue;
        }
        let key = (r.world_size, r.rayon_threads_per_rank);
        let rate = match probed.iter().find(|p| (p.0, p.1) == key) {
            Some(p) => p.2,
            None => {
                let rate = machine_gemm_rate(shape, key, mpi)?;
                probed.push((key.0, key.1, rate));
                rate
            }
        };
        r.gemm_flops_per_s = rate;
        r.mfu = r.model_flops_per_s / rate;
    }
    Ok(())
}

/// The table format's line per row: tokens/s, the median step and rank 0's phases (and NVMe's
/// rates).
fn print_phases(r: &BenchRow) {
    let p = &r.phases;
    errln!(
        "stage {} offload {} world {}: {:.0} tokens/s, median step {:.1} ms (rank 0: \
         forward {:.1}, recompute {:.1}, backward {:.1}, comm {:.1}, optimizer {:.1} ms)",
        r.stage,
        r.offload,
        r.world_size,
        r.tokens_per_s,
        r.median_step_s * 1e3,
        p.forward * 1e3,
        p.recompute * 1e3,
        p.backward * 1e3,
        p.comm * 1e3,
        p.optimizer * 1e3
    );
    if let Some(n) = &r.nvme {
        errln!(
            "  nvme: {:.1} MB read + {:.1} MB written per step on rank 0, {:.2} GB/s over \
             the step, {:.2} GB/s over the optimizer phase; the disk: {:.2} GB/s write, \
             {:.2} GB/s read (sequential, direct I/O, same run)",
            n.read_bytes_per_step as f64 / 1e6,
            n.written_bytes_per_step as f64 / 1e6,
            n.gbps_over_step,
            n.gbps_over_optimizer,
            n.disk_write_gbps,
            n.disk_read_gbps
        );
    }
}

/// The benchmarks' data: 4096 windows of `context + 1` seeded random ASCII bytes (throughput
/// does not depend on the text).
pub(super) fn random_windows(context: usize) -> anyhow::Result<DataLoader> {
    let mut rng = SplitMix64::new(1);
    let bytes: Vec<u8> = (0..(context + 1) * 4096)
        .map(|_| (rng.next_u64() % 128) as u8)
        .collect();
    Ok(DataLoader::new(
        Corpus::from_bytes("random bytes", bytes)?,
        context,
        1,
    )?)
}

/// Timed steps of one configuration, over one or more rounds.
struct Samples {
    stage: Stage,
    offload: Offload,
    world: usize,
    per_rank: usize,
    threads: usize,
    /// Each step's time: its slowest rank's.
    steps: Vec<f64>,
    /// Rank 0's phase split of each step.
    phases: Vec<PhaseTimes>,
    last: StepReport,
    /// Rank 0's swap-file bytes (read, written) per timed step.
    swap_per_step: (u64, u64),
}

impl Samples {
    fn merge(&mut self, other: Samples) {
        self.steps.extend(other.steps);
        self.phases.extend(other.phases);
        self.last = other.last;
    }

    fn row(&self, num_params: usize, context: usize, disk: Option<(f64, f64)>) -> BenchRow {
        let mut order: Vec<usize> = (0..self.steps.len()).collect();
        order.sort_by(|&a, &b| self.steps[a].total_cmp(&self.steps[b]));
        let median_index = order[order.len() / 2];
        let median = self.steps[median_index];
        let tokens = self.per_rank * self.world * context;
        let phases = self.phases[median_index];
        let nvme = match (self.offload, disk) {
            (o, Some((w, r))) if o.uses_nvme() => {
                let (read, written) = self.swap_per_step;
                let bytes = (read + written) as f64;
                Some(NvmeRates {
                    read_bytes_per_step: read,
                    written_bytes_per_step: written,
                    gbps_over_step: bytes / median / 1e9,
                    gbps_over_optimizer: bytes / phases.optimizer / 1e9,
                    disk_write_gbps: w / 1e9,
                    disk_read_gbps: r / 1e9,
                })
            }
            _ => None,
        };
        BenchRow {
            stage: self.stage.index(),
            offload: self.offload,
            world_size: self.world,
            num_params,
            tokens_per_step: tokens,
            timed_steps: self.steps.len(),
            median_step_s: median,
            min_step_s: self.steps[order[0]],
            tokens_per_s: tokens as f64 / median,
            bytes_per_rank: self.last.memory.total,
            peak_bytes_per_rank: self.last.peak_bytes,
            rayon_threads_per_rank: self.threads,
            phases,
            model_flops_per_s: 0.0,
            gemm_flops_per_s: 0.0,
            gemm_path: zerodp::model::gemm_path(),
            // The device tier held state on the GPU exactly when Adam ran there.
            adam_on: match self.last.device_tier_bytes {
                0 => "cpu",
                _ => "gpu",
            },
            device: String::new(),
            mfu: 0.0,
            nvme,
            fastest_split: false,
        }
    }
}

/// The GEMM rate the run's compute threads can reach together: in-process, one probe thread per
/// compute thread of all ranks (at most the machine's cores); under MPI, every process probes
/// with its own threads at the same time and the rates are summed.
fn machine_gemm_rate(
    shape: (usize, usize, usize),
    (world, threads_per_rank): (usize, usize),
    mpi: Option<&MpiRank>,
) -> anyhow::Result<f64> {
    const PROBE_SECS: f64 = 1.0;
    let Some((comm, threads)) = mpi else {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = (world * threads_per_rank).clamp(1, cores);
        return Ok(zerodp::model::gemm_flops_per_s(shape, threads, PROBE_SECS));
    };
    // Start together, so that the probes share the machine as the ranks did.
    comm.barrier().wait()?;
    let mine = zerodp::model::gemm_flops_per_s(shape, *threads, PROBE_SECS);
    // In GFLOP/s: an f32 sum of a few processes' rates keeps 7 digits.
    let total = comm
        .all_reduce(Buffer::F32(vec![(mine / 1e9) as f32]), ReduceOp::Sum)
        .wait_one()?;
    Ok(f64::from(total.get_f32(0)) * 1e9)
}

/// The run's precision (`--precision`, fp32 or bf16: fp16 needs a loss-scale config).
fn precision_of(args: &BenchTrainArgs) -> Precision {
    match args.precision.as_str() {
        "bf16" => Precision::Bf16,
        _ => Precision::Fp32,
    }
}

/// Where the NVMe swap files go.
fn nvme_dir(args: &BenchTrainArgs) -> std::path::PathBuf {
    args.nvme_path.clone().unwrap_or_else(std::env::temp_dir)
}

/// The engine configuration of one measured case.
fn case_config(
    args: &BenchTrainArgs,
    (stage, offload): (Stage, Offload),
    world: usize,
) -> anyhow::Result<EngineConfig> {
    if world == 0 {
        bail!("world sizes must be at least 1");
    }
    let mut cfg = EngineConfig::new(stage, world);
    cfg.micro_batch = args.per_rank;
    cfg.reduce_bucket_size = args.reduce_bucket_size;
    cfg.overlap_comm = !args.no_overlap;
    cfg.activation_checkpointing = args.checkpoint_activations;
    cfg.max_reuse_distance = args.max_reuse_distance;
    if args.optimizer_states == "bf16" {
        cfg.optimizer_states_dtype = zerodp::flat::DType::BF16;
    }
    let precision = precision_of(args);
    cfg.param_dtype = zerodp::setup::dtype_of(precision);
    cfg.comm_dtype = zerodp::setup::dtype_of(defaults::communication_data_type(precision));
    cfg.grad_accum_dtype =
        zerodp::setup::dtype_of(defaults::grad_accum_dtype(precision, stage.index()));
    cfg.offload_optimizer = match offload {
        Offload::None => OptimizerTier::Device,
        Offload::Cpu => OptimizerTier::Host,
        Offload::Nvme | Offload::NvmeAll => OptimizerTier::Nvme {
            dir: nvme_dir(args),
            chunk: args
                .sub_group_size
                .clamp(1, zerodp::offload::MAX_STREAM_CHUNK),
            buffer_count: args.buffer_count,
        },
    };
    if offload == Offload::NvmeAll && stage.shards_params() {
        // DeepSpeed's offload_param defaults for the staging buffers.
        let d = zerodp::config::OffloadParamSettings::default();
        cfg.offload_param = ParamTier::Nvme {
            dir: nvme_dir(args),
            buffer_count: usize::try_from(d.buffer_count).unwrap_or(usize::MAX),
            buffer_size: usize::try_from(d.buffer_size).unwrap_or(usize::MAX),
            // Every shard to the swap file (DeepSpeed's default would keep them all in memory).
            max_in_cpu: 0,
        };
    }
    Ok(cfg)
}

fn measure(
    args: &BenchTrainArgs,
    models: &[&TrainModel],
    data: &DataLoader,
    (cfg, offload): (EngineConfig, Offload),
    mpi: Option<&MpiRank>,
) -> anyhow::Result<Samples> {
    let (stage, world) = (cfg.stage, cfg.world_size);
    let mut trainer = Trainer::new(models[0], cfg)
        .with_rank_models(train_model::per_rank(models.iter().copied()))
        .with_schedule(LrSchedule::Constant(1e-4))
        .with_comm_options(CommOptions::from_env()?);
    if let Some((comm, threads)) = mpi {
        trainer = trainer
            .with_backend(Backend::Process(comm.clone()))
            .with_threads_per_rank(*threads);
    }
    let threads = trainer.threads_per_rank();
    let log = ReportLog::new();
    trainer.run(data, (args.warmup + args.steps) as u64, &[&log])?;
    // The ranks this process ran (all in-process, its own under MPI).
    let per_rank: Vec<Vec<StepReport>> = log
        .into_reports()
        .into_iter()
        .filter(|r| !r.is_empty())
        .map(|mut r| r.split_off(args.warmup))
        .collect();
    // A step takes as long as its slowest rank.
    let mut steps: Vec<f64> = (0..args.steps)
        .map(|i| {
            per_rank
                .iter()
                .map(|r| r[i].elapsed.as_secs_f64())
                .fold(0.0, f64::max)
        })
        .collect();
    if let Some((comm, _)) = mpi {
        let mine = Buffer::F32(steps.iter().map(|&t| t as f32).collect());
        let slowest = comm.all_reduce(mine, ReduceOp::Max).wait_one()?;
        steps = (0..steps.len())
            .map(|i| f64::from(slowest.get_f32(i)))
            .collect();
    }
    let phases = per_rank[0].iter().map(|r| r.phases).collect();
    let last = per_rank[0].last().expect("at least one timed step").clone();
    Ok(Samples {
        stage,
        offload,
        world,
        per_rank: args.per_rank,
        threads,
        steps,
        phases,
        swap_per_step: swap_per_step(&per_rank[0]),
        last,
    })
}

/// Swap-file bytes (read, written) per step over the timed steps `reports` (cumulative counters).
fn swap_per_step(reports: &[StepReport]) -> (u64, u64) {
    match (reports.first(), reports.last()) {
        (Some(a), Some(b)) if reports.len() > 1 => {
            let steps = (reports.len() - 1) as u64;
            (
                (b.swap_io.0 - a.swap_io.0) / steps,
                (b.swap_io.1 - a.swap_io.1) / steps,
            )
        }
        _ => (0, 0),
    }
}

/// Marks, for each stage and offload measured at more than one world size, the row whose split
/// of the host's cores into ranks x threads ran the most tokens/s.
fn mark_fastest_splits(rows: &mut [BenchRow]) {
    for i in 0..rows.len() {
        let (stage, offload) = (rows[i].stage, rows[i].offload);
        let same: Vec<usize> = (0..rows.len())
            .filter(|&j| rows[j].stage == stage && rows[j].offload == offload)
            .collect();
        let best = same
            .iter()
            .copied()
            .max_by(|&a, &b| rows[a].tokens_per_s.total_cmp(&rows[b].tokens_per_s));
        rows[i].fastest_split = same.len() > 1 && best == Some(i);
    }
}

/// One line per stage and offload measured at several world sizes: the fastest split.
fn print_fastest_splits(rows: &[BenchRow]) -> anyhow::Result<()> {
    for best in rows.iter().filter(|r| r.fastest_split) {
        let slowest = rows
            .iter()
            .filter(|r| r.stage == best.stage && r.offload == best.offload)
            .map(|r| r.tokens_per_s)
            .fold(f64::INFINITY, f64::min);
        outln!(
            "fastest split at stage {} (offload {}): {} rank(s) x {} thread(s), {:.0} tokens/s \
             ({:.2}x the slowest measured; --world-size {} with zerodp train)",
            best.stage,
            best.offload,
            best.world_size,
            best.rayon_threads_per_rank,
            best.tokens_per_s,
            best.tokens_per_s / slowest,
            best.world_size
        );
    }
    Ok(())
}

fn print_table(
    rows: &[BenchRow],
    (arch, gpt): (&str, &zerodp::model::GptConfig),
    (per_rank, precision): (usize, &str),
) -> anyhow::Result<()> {
    outln!(
        "{arch} {} layers, width {}, {} heads, context {}, vocab {} ({} parameters), {} sequences per rank, {precision}, GEMM on {} ({}=gemm forces the gemm crate)",
        gpt.layers,
        gpt.width,
        gpt.heads,
        gpt.context,
        gpt.vocab_size,
        rows.first().map_or(0, |r| r.num_params),
        per_rank,
        zerodp::model::gemm_path(),
        zerodp::model::GEMM_ENV,
    );
    outln!(
        "{:>5} {:>7} {:>5} {:>12} {:>12} {:>12} {:>9} {:>12} {:>12} {:>14} {:>14} {:>6}",
        "stage",
        "offload",
        "world",
        "tokens/step",
        "median ms",
        "tokens/s",
        "vs ZeRO-0",
        "MiB/rank",
        "peak MiB",
        "model GFLOP/s",
        "GEMM GFLOP/s",
        "MFU"
    );
    for r in rows {
        let base = rows
            .iter()
            .find(|b| b.stage == 0 && b.offload == Offload::None && b.world_size == r.world_size)
            .map(|b| format!("{:+.1}%", (r.tokens_per_s / b.tokens_per_s - 1.0) * 100.0))
            .unwrap_or_else(|| "-".into());
        outln!(
            "{:>5} {:>7} {:>5} {:>12} {:>12.1} {:>12.0} {:>9} {:>12.1} {:>12.1} {:>14.1} {:>14.1} {:>5.1}%",
            r.stage,
            r.offload.to_string(),
            r.world_size,
            r.tokens_per_step,
            r.median_step_s * 1e3,
            r.tokens_per_s,
            base,
            r.bytes_per_rank as f64 / (1024.0 * 1024.0),
            r.peak_bytes_per_rank as f64 / (1024.0 * 1024.0),
            r.model_flops_per_s / 1e9,
            r.gemm_flops_per_s / 1e9,
            r.mfu * 100.0
        );
    }
    print_fastest_splits(rows)
}
