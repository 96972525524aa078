//! `zerodp bench ops`: where one rank's training step spends its time, op by op.
//!
//! Every op of the GPT's step runs alone on the shapes of one rank's batch (`--per-rank`
//! sequences of the model's context), forward and then backward, on `--threads` compute threads
//! (one per rank when two ranks share the two cores). Each row gives the op's count per step, its
//! median time, the FLOPs and bytes it must move, the rate it reaches and its share of the sum;
//! below the table, the same model's measured step (one rank, stage 0) and the machine's GEMM rate
//! on the block's largest product, both from this run. The FLOPs are the op's own (attention's
//! causal half only); the bytes are its inputs read and outputs written once, in f32.

use super::train::ModelArgs;
use anyhow::Context as _;
use candle_core::{Device, Tensor, Var};
use zerodp::model::{Gpt, GptConfig, GptModel};
use zerodp::rng::SplitMix64;
use zerodp::trainer::{LrSchedule, ReportLog, Trainer};
use zerodp::zero::{EngineConfig, Stage};

#[derive(clap::Args, Debug)]
pub struct BenchOpsArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Sequences per rank (the rows of every op are these times the context).
    #[arg(long, default_value_t = 8)]
    pub per_rank: usize,
    /// Compute threads of the rank (its rayon pool); several (`1,2`) measure each and add the
    /// scaling table: each op's speedup, its serial fraction and its time projected to
    /// `--project-threads`.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub threads: Vec<usize>,
    /// With several `--threads`: the thread count the scaling table projects each op to.
    #[arg(long, default_value_t = 16)]
    pub project_threads: usize,
    /// Timed calls per op and direction (the median is reported; the caches are evicted before
    /// each), after one warm-up call.
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Training steps of the whole model timed for comparison (after two warm-up steps).
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// `table` or `json`.
    #[arg(long, default_value = "table")]
    pub format: String,
}

/// One op of the step, measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct OpRow {
    pub op: String,
    /// Calls per training step.
    pub count: usize,
    pub forward_ms: f64,
    pub backward_ms: f64,
    pub forward_flops: f64,
    pub backward_flops: f64,
    pub forward_bytes: f64,
    pub backward_bytes: f64,
    /// `count * (forward_ms + backward_ms)`.
    pub step_ms: f64,
}

/// The whole report of one thread count (`--format json`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct OpsReport {
    /// The rank's compute threads.
    pub threads: usize,
    pub ops: Vec<OpRow>,
    /// Sum of the rows' `step_ms`.
    pub ops_ms: f64,
    /// The measured training step of the same model (one rank, stage 0, fp32), median, and its
    /// phases.
    pub step_ms: f64,
    pub step_phases: zerodp::zero::PhaseTimes,
    /// The machine's GEMM rate on `[rows, width] @ [width, 4 width]`, `--threads` threads.
    pub gemm_flops_per_s: f64,
    pub model_flops_per_step: f64,
}

/// An op's forward on its inputs.
type Forward = Box<dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>>;

/// An op to time: its inputs are built once; `run` is the forward.
struct Op {
    name: &'static str,
    count: usize,
    flops: f64,
    /// Forward bytes (in + out); backward moves the forward's inputs and the output gradient in
    /// and the input gradients out, estimated as 1.5x.
    bytes: f64,
    inputs: Vec<Var>,
    run: Forward,
}

pub fn run(args: BenchOpsArgs) -> anyhow::Result<i32> {
    if args.format != "table" && args.format != "json" {
        anyhow::bail!("--format must be table or json, got {}", args.format);
    }
    if args.per_rank == 0 || args.reps == 0 || args.steps == 0 || args.project_threads == 0 {
        anyhow::bail!("--per-rank, --reps, --steps and --project-threads must be at least 1");
    }
    if args.threads.is_empty() || args.threads.contains(&0) {
        anyhow::bail!("--threads must be one or more counts of at least 1, e.g. 1 or 1,2");
    }
    let gpt = args.model.build("small")?;
    let reports = args
        .threads
        .iter()
        .map(|&threads| measure_report(&gpt, &args, threads))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if let [report] = reports.as_slice() {
        match args.format.as_str() {
            "json" => outln!("{}", serde_json::to_string_pretty(report)?),
            _ => print_table(report, &gpt, &args)?,
        }
        return Ok(0);
    }
    let scaling = super::op_scaling::scaling(&reports, args.project_threads);
    match args.format.as_str() {
        "json" => {
            let all = serde_json::json!({ "runs": reports, "scaling": scaling });
            outln!("{}", serde_json::to_string_pretty(&all)?)
        }
        _ => {
            for report in &reports {
                print_table(report, &gpt, &args)?;
                outln!("");
            }
            super::op_scaling::print(&scaling)?;
        }
    }
    Ok(0)
}

/// Every op and the model's step on `threads` threads.
fn measure_report(
    gpt: &GptConfig,
    args: &BenchOpsArgs,
    threads: usize,
) -> anyhow::Result<OpsReport> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("could not start the benchmark's thread pool")?;
    let ops = pool.install(|| measure_ops(gpt, args))?;
    let (step_ms, step_phases) = measure_step(gpt, args, threads)?;
    let rows = args.per_rank * gpt.context;
    let gemm = zerodp::model::gemm_flops_per_s((rows, gpt.width, 4 * gpt.width), threads, 1.0);
    Ok(OpsReport {
        threads,
        ops_ms: ops.iter().map(|o| o.step_ms).sum(),
        ops,
        step_ms,
        step_phases,
        gemm_flops_per_s: gemm,
        model_flops_per_step: gpt.flops_per_token() * rows as f64,
    })
}

fn var(shape: &[usize], seed: u64, scale: f64) -> candle_core::Result<Var> {
    let mut rng = SplitMix64::new(seed);
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n).map(|_| (rng.normal() * scale) as f32).collect();
    Var::from_tensor(&Tensor::from_vec(data, shape, &Device::Cpu)?)
}

/// The ops of one step of `gpt` on `b` sequences, with their counts, FLOPs and bytes.
fn step_ops(
    gpt: &GptConfig,
    model: &std::sync::Arc<Gpt>,
    b: usize,
) -> candle_core::Result<Vec<Op>> {
    let (t, c, v, l) = (gpt.context, gpt.width, gpt.vocab_size, gpt.layers);
    let n = b * t;
    let nf = n as f64;
    let f4 = 4.0;
    let tokens: Vec<u32> = (0..n).map(|i| (i * 7 % v) as u32).collect();
    let targets = Tensor::from_vec(tokens.clone(), n, &Device::Cpu)?;
    let linear =
        |name: &'static str, inp: usize, out: usize, seed: u64| -> candle_core::Result<Op> {
            let m = model.clone();
            Ok(Op {
                name,
                count: l,
                flops: 2.0 * nf * (inp * out) as f64,
                bytes: f4 * (nf * (inp + out) as f64 + (inp * out) as f64),
                inputs: vec![
                    var(&[n, inp], seed, 1.0)?,
                    var(&[out, inp], seed + 1, 0.02)?,
                    var(&[out], seed + 2, 0.02)?,
                ],
                run: Box::new(move |x| m.linear(&x[0], &x[1], &x[2])),
            })
        };
    let (m1, m2, m3, m4, m5, m6) = (
        model.clone(),
        model.clone(),
        model.clone(),
        model.clone(),
        model.clone(),
        model.clone(),
    );
    Ok(vec![
        Op {
            name: "embed (wte + wpe)",
            count: 1,
            flops: 0.0,
            bytes: f4 * 3.0 * nf * c as f64,
            inputs: vec![var(&[v, c], 1, 0.02)?, var(&[t, c], 2, 0.02)?],
            run: Box::new(move |x| m1.embed(&x[0], &x[1], &tokens, b, t)),
        },
        Op {
            name: "layer norm",
            count: 2 * l + 1,
            flops: 0.0,
            bytes: f4 * 2.0 * nf * c as f64,
            inputs: vec![
                var(&[n, c], 3, 1.0)?,
                var(&[c], 4, 1.0)?,
                var(&[c], 5, 0.02)?,
            ],
            run: Box::new(move |x| m2.layer_norm(&x[0], &x[1], &x[2])),
        },
        linear("linear qkv (c -> 3c)", c, 3 * c, 10)?,
        Op {
            name: "attention core (causal)",
            count: l,
            flops: 2.0 * nf * (t * c) as f64,
            bytes: f4 * 4.0 * nf * c as f64,
            inputs: vec![var(&[n, 3 * c], 6, 1.0)?],
            run: Box::new(move |x| m3.attention_core(&x[0], b, t)),
        },
        linear("linear proj (c -> c)", c, c, 20)?,
        Op {
            name: "residual add",
            count: 2 * l,
            flops: 0.0,
            bytes: f4 * 3.0 * nf * c as f64,
            inputs: vec![var(&[n, c], 7, 1.0)?, var(&[n, c], 8, 1.0)?],
            run: Box::new(|x| x[0].add(&x[1])),
        },
        linear("linear fc (c -> 4c)", c, 4 * c, 30)?,
        Op {
            name: "gelu (tanh)",
            count: l,
            flops: 0.0,
            bytes: f4 * 2.0 * nf * 4.0 * c as f64,
            inputs: vec![var(&[n, 4 * c], 9, 1.0)?],
            run: Box::new(move |x| m4.gelu(&x[0])),
        },
        linear("linear fc2 (4c -> c)", 4 * c, c, 40)?,
        Op {
            name: "head logits (h @ wte^T)",
            count: 1,
            flops: 2.0 * nf * (c * v) as f64,
            bytes: f4 * (nf * (c + v) as f64 + (c * v) as f64),
            inputs: vec![var(&[n, c], 11, 1.0)?, var(&[v, c], 12, 0.02)?],
            run: Box::new(move |x| m5.lm_logits(&x[0], &x[1])),
        },
        Op {
            name: "cross-entropy",
            count: 1,
            flops: 0.0,
            bytes: f4 * nf * v as f64,
            inputs: vec![var(&[n, v], 13, 1.0)?],
            run: Box::new(move |x| m6.cross_entropy(&x[0], &targets)),
        },
    ])
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Bytes [`evict_caches`] writes: twice the last-level cache of the hosts we measure on (32 MiB).
const EVICT_BYTES: usize = 64 << 20;

/// Writes every cache line of `buf`, so that an op timed next finds its inputs in memory, not in
/// cache, as it does inside a training step (forward's activations are read by backward long after
/// they were written; each op's output was written by the op before, a layer's worth of data ago).
fn evict_caches(buf: &mut [u8]) {
    for line in buf.chunks_mut(64) {
        line[0] = line[0].wrapping_add(1);
    }
    std::hint::black_box(buf);
}

fn measure_ops(gpt: &GptConfig, args: &BenchOpsArgs) -> anyhow::Result<Vec<OpRow>> {
    let model = std::sync::Arc::new(Gpt::new(gpt.clone())?);
    let mut evictor = vec![0u8; EVICT_BYTES];
    let mut rows = Vec::new();
    for op in step_ops(gpt, &model, args.per_rank)? {
        let inputs: Vec<Tensor> = op.inputs.iter().map(|v| v.as_tensor().clone()).collect();
        let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
        for rep in 0..=args.reps {
            evict_caches(&mut evictor);
            let start = std::time::Instant::now();
            let y = (op.run)(&inputs)?;
            let forward = start.elapsed().as_secs_f64();
            evict_caches(&mut evictor);
            let start = std::time::Instant::now();
            let grads = y.backward()?;
            let backward = start.elapsed().as_secs_f64();
            drop((grads, y));
            if rep > 0 {
                fwd.push(forward * 1e3);
                bwd.push(backward * 1e3);
            }
        }
        let (forward_ms, backward_ms) = (median(fwd), median(bwd));
        rows.push(OpRow {
            op: op.name.to_string(),
            count: op.count,
            forward_ms,
            backward_ms,
            forward_flops: op.flops,
            backward_flops: 2.0 * op.flops,
            forward_bytes: op.bytes,
            backward_bytes: 1.5 * op.bytes,
            step_ms: op.count as f64 * (forward_ms + backward_ms),
        });
    }
    Ok(rows)
}

/// The model's real step: one rank, stage 0, fp32, `threads` threads; median step and phases.
fn measure_step(
    gpt: &GptConfig,
    args: &BenchOpsArgs,
    threads: usize,
) -> anyhow::Result<(f64, zerodp::zero::PhaseTimes)> {
    let model = GptModel::new(gpt.clone())?;
    let data = super::bench_train::random_windows(gpt.context)?;
    let mut cfg = EngineConfig::new(Stage::Zero0, 1);
    cfg.micro_batch = args.per_rank;
    let trainer = Trainer::new(&model, cfg)
        .with_schedule(LrSchedule::Constant(1e-4))
        .with_threads_per_rank(threads);
    let log = ReportLog::new();
    trainer.run(&data, 2 + args.steps as u64, &[&log])?;
    let reports = log.into_reports().into_iter().next().unwrap_or_default();
    let mut timed: Vec<_> = reports.into_iter().skip(2).collect();
    anyhow::ensure!(!timed.is_empty(), "the training run reported no steps");
    timed.sort_by_key(|r| r.elapsed);
    let mid = &timed[timed.len() / 2];
    Ok((mid.elapsed.as_secs_f64() * 1e3, mid.phases))
}

fn print_table(r: &OpsReport, gpt: &GptConfig, args: &BenchOpsArgs) -> anyhow::Result<()> {
    outln!(
        "GPT {} layers, width {}, {} heads, context {}, vocab {}; {} sequences ({} rows) per op, {} thread(s), median of {}",
        gpt.layers,
        gpt.width,
        gpt.heads,
        gpt.context,
        gpt.vocab_size,
        args.per_rank,
        args.per_rank * gpt.context,
        r.threads,
        args.reps
    );
    outln!(
        "{:<26} {:>5} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>9} {:>6}",
        "op",
        "count",
        "fwd ms",
        "bwd ms",
        "fwd GF/s",
        "bwd GF/s",
        "fwd GB/s",
        "bwd GB/s",
        "step ms",
        "share"
    );
    let rate = |work: f64, ms: f64| match work > 0.0 && ms > 0.0 {
        true => format!("{:.1}", work / (ms * 1e-3) / 1e9),
        false => "-".into(),
    };
    for o in &r.ops {
        outln!(
            "{:<26} {:>5} {:>9.3} {:>9.3} {:>9} {:>9} {:>8} {:>8} {:>9.2} {:>5.1}%",
            o.op,
            o.count,
            o.forward_ms,
            o.backward_ms,
            rate(o.forward_flops, o.forward_ms),
            rate(o.backward_flops, o.backward_ms),
            rate(o.forward_bytes, o.forward_ms),
            rate(o.backward_bytes, o.backward_ms),
            o.step_ms,
            o.step_ms / r.ops_ms * 100.0
        );
    }
    let p = &r.step_phases;
    outln!(
        "ops: {:.1} ms per step; the measured step: {:.1} ms (forward {:.1}, backward {:.1}, optimizer {:.1}, comm {:.1})",
        r.ops_ms,
        r.step_ms,
        p.forward * 1e3,
        p.backward * 1e3,
        p.optimizer * 1e3,
        p.comm * 1e3
    );
    let achieved = r.model_flops_per_step / (r.step_ms * 1e-3);
    outln!(
        "model: {:.2} GFLOP per step, {:.1} GFLOP/s at the measured step; GEMM [{}, {}] @ [{}, {}] on {} thread(s): {:.1} GFLOP/s; MFU {:.1}%",
        r.model_flops_per_step / 1e9,
        achieved / 1e9,
        args.per_rank * gpt.context,
        gpt.width,
        gpt.width,
        4 * gpt.width,
        r.threads,
        r.gemm_flops_per_s / 1e9,
        achieved / r.gemm_flops_per_s * 100.0
    );
    Ok(())
}
