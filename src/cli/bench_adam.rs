//! `zerodp bench adam`: parameters per second of the CPU Adam step per shard size, thread count
//! and state dtype, beside the machine's memory bandwidth measured in the same run.
//!
//! The step is memory-bound on large shards: it reads p, g, m, v and writes p, m, v once each
//! (28 bytes per parameter with f32 states and gradients, 20 with bf16 states), so the useful
//! comparison is its traffic (`gbps`) against what the memory delivers. The reference,
//! `mem_bw_gbps`, is a STREAM-style in-place update `a[i] += s * b[i]` over two 256 MiB buffers
//! (far above the 32 MiB LLC) on every hardware thread at once, counted as bytes read plus written
//! (12 per element): Adam's own access pattern, where every written line was just read. STREAM's
//! triad `a = b + s * c` is measured beside it (`triad_gbps`, also 12 bytes per element); it
//! comes out lower because each store to `a` first reads the line (write-allocate), traffic
//! STREAM does not count.
//!
//! Each thread count runs in its own rayon pool of that size; each number is the median of
//! `--runs` timed steps after one warm-up step (which also maps the pages of m and v). With a
//! copy (the default), the step is timed again as `adam_step_with_copy` into a bf16 copy of the
//! parameters, the mixed-precision step, so that the cost of the fused 16-bit write shows.

use anyhow::{bail, Context};
use half::bf16;
use std::time::Instant;
use zerodp::comm::zeroed_vec;
use zerodp::optim::adam::{
    adam_isa, adam_step, adam_step_with_copy, AdamIsa, AdamParams, StateElement,
};
use zerodp::optim::kernels::{Element, TILE};

use super::bench_comm::{available_memory, median, Format};

#[derive(clap::Args, Debug)]
pub struct BenchAdamArgs {
    /// Shard sizes in parameters, comma-separated, decimal multiples: `10M` is 10,000,000, `1G`
    /// (or `1B`) 10^9; `K` also works. Sizes whose buffers do not fit the available memory are
    /// refused.
    #[arg(long, default_value = "10M,100M,1G")]
    pub params: String,
    /// Thread counts, comma-separated; each runs in its own rayon pool of that many threads.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub threads: Vec<usize>,
    /// Element types of Adam's moments m and v, comma-separated.
    #[arg(long, value_delimiter = ',', value_enum, default_value = "f32,bf16")]
    pub state_dtypes: Vec<DtypeChoice>,
    /// Element type of the gradients.
    #[arg(long, value_enum, default_value_t = DtypeChoice::F32)]
    pub grad_dtype: DtypeChoice,
    /// Skip the second timing with the fused bf16 copy of the parameters.
    #[arg(long)]
    pub no_copy: bool,
    /// Timed steps per point (the median is reported), after one warm-up step.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DtypeChoice {
    F32,
    Bf16,
}

impl DtypeChoice {
    fn bytes(self) -> usize {
        match self {
            DtypeChoice::F32 => 4,
            DtypeChoice::Bf16 => 2,
        }
    }
}

/// Bytes of each bandwidth buffer.
const STREAM_BYTES: usize = 256 << 20;

/// One measured point. `params`, `threads`, `state_dtype`, `params_per_s` and `bytes_per_param`
/// are the contract of `--format json`; the rest are extras.
#[derive(serde::Serialize, Debug, Clone)]
struct Row {
    params: usize,
    threads: usize,
    state_dtype: &'static str,
    grad_dtype: &'static str,
    params_per_s: f64,
    /// Bytes the step moves per parameter: reads p, g, m, v and writes p, m, v.
    bytes_per_param: usize,
    ms_per_step: f64,
    /// `bytes_per_param * params_per_s / 1e9`: the memory traffic the step draws.
    gbps: f64,
    /// The same step with the fused bf16 copy of the parameters (`None` with `--no-copy`).
    fused_copy_params_per_s: Option<f64>,
    fused_copy_ms_per_step: Option<f64>,
    /// `bytes_per_param` plus the 2 bytes of the copy.
    fused_copy_bytes_per_param: Option<usize>,
}

#[derive(serde::Serialize, Debug)]
struct Report {
    /// `a += s * b`: bytes read plus written per second / 1e9, all `mem_bw_threads` threads.
    mem_bw_gbps: f64,
    /// STREAM triad `a = b + s * c`, counted the same way (write-allocate reads not counted).
    triad_gbps: f64,
    mem_bw_threads: usize,
    /// The Adam kernel path every step ran on.
    isa: &'static str,
    isa_available: Vec<&'static str>,
    runs: usize,
    results: Vec<Row>,
}

/// One count: `4096`, `1K`, `10M`, `1G` or `1B` (decimal multiples).
fn parse_count(s: &str) -> anyhow::Result<usize> {
    let t = s.trim();
    let (num, mult) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 1_000usize),
        Some('M' | 'm') => (&t[..t.len() - 1], 1_000_000),
        Some('G' | 'g' | 'B' | 'b') => (&t[..t.len() - 1], 1_000_000_000),
        _ => (t, 1),
    };
    let n: usize = num.trim().parse().ok().with_context(|| {
        format!(
            "--params: {s:?} is not a parameter count; expected a whole number with an optional \
             K, M or G (= B) suffix, decimal (10M = 10,000,000), such as --params 10M,100M,1G"
        )
    })?;
    match n.checked_mul(mult) {
        Some(0) => bail!("--params: {s:?} is zero; give a positive parameter count"),
        Some(n) => Ok(n),
        None => bail!("--params: {s:?} is too large"),
    }
}

/// `--params`: a comma-separated list of counts.
fn parse_params(spec: &str) -> anyhow::Result<Vec<usize>> {
    let out = spec
        .split(',')
        .filter(|p| !p.trim().is_empty())
        .map(parse_count)
        .collect::<anyhow::Result<Vec<_>>>()?;
    if out.is_empty() {
        bail!("--params {spec:?} names no size; try --params 10M,100M,1G");
    }
    Ok(out)
}

/// Bytes held at once for a shard of `n` parameters: p (4), g, m and v, and the bf16 copy.
fn bytes_needed(n: usize, grad: DtypeChoice, state: DtypeChoice, copy: bool) -> u128 {
    let per = 4 + grad.bytes() + 2 * state.bytes() + if copy { 2 } else { 0 };
    n as u128 * per as u128
}

/// Refuses a run whose largest shard (buffers of one size and state dtype live at a time) or
/// bandwidth buffers would not fit `available` bytes.
fn check_fits(args: &BenchAdamArgs, sizes: &[usize], available: u64) -> anyhow::Result<()> {
    let gib = |b: u128| b as f64 / (1u64 << 30) as f64;
    let copy = !args.no_copy;
    for &n in sizes {
        for &s in &args.state_dtypes {
            let need = bytes_needed(n, args.grad_dtype, s, copy).max(3 * STREAM_BYTES as u128);
            if need > available as u128 {
                bail!(
                    "--params {n}: with {s:?} states, {:?} gradients{} it needs {:.1} GiB, more \
                     than the {:.1} GiB this machine has available (MemAvailable in \
                     /proc/meminfo); lower --params",
                    args.grad_dtype,
                    if copy { " and the bf16 copy" } else { "" },
                    gib(need),
                    gib(available as u128)
                );
            }
        }
    }
    Ok(())
}

/// Median seconds of `runs` calls of `f` after one untimed call.
fn time_median(runs: usize, mut f: impl FnMut()) -> f64 {
    f();
    let samples = (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    median(samples)
}

/// Bytes read plus written per second / 1e9 at the median of `runs` passes (after one that maps
/// the pages) of `a += s * b` (`triad` false) or `a = b + s * c` (`triad` true), 12 bytes per
/// element either way, on `threads` threads each over its own contiguous part.
fn stream_gbps(threads: usize, runs: usize, triad: bool) -> f64 {
    let len = STREAM_BYTES / 4;
    let mut a = filled(len, 0.0);
    let b = filled(len, 1.0);
    let c = if triad { filled(len, 2.0) } else { Vec::new() };
    let chunk = len.div_ceil(threads);
    let secs = time_median(runs, || {
        std::thread::scope(|s| {
            for (k, (a, b)) in a.chunks_mut(chunk).zip(b.chunks(chunk)).enumerate() {
                let c = if triad {
                    &c[k * chunk..k * chunk + a.len()]
                } else {
                    &[][..]
                };
                s.spawn(move || {
                    if triad {
                        for ((a, b), c) in a.iter_mut().zip(b).zip(c) {
                            *a = b + 3.0 * c;
                        }
                    } else {
                        for (a, b) in a.iter_mut().zip(b) {
                            *a += 3.0 * b;
                        }
                    }
                });
            }
        });
    });
    std::hint::black_box(&a);
    (3 * STREAM_BYTES) as f64 / secs / 1e9
}

/// Parameters per second of zerodp's CPU Adam on this machine as an offloaded mixed-precision step
/// runs it (bf16 gradients in, fp32 master and moments, the bf16 copy written in the same pass), on
/// every core, over 16M parameters (448 MiB of traffic per step, far above the last-level cache):
/// the host Adam rate `zerodp plan --host-adam-rate measure` prices the CPU step with.
pub fn host_adam_rate() -> anyhow::Result<f64> {
    const N: usize = 16 << 20;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let hp = AdamParams::default();
    let mut p = filled(N, 0.01f32);
    let g = filled(N, bf16::from_f32(1e-3));
    let (mut m, mut v) = (zeroed_vec::<f32>(N), zeroed_vec::<f32>(N));
    let mut copy = zeroed_vec::<bf16>(N);
    let mut step = 0u64;
    let secs = pool(threads)?.install(|| {
        time_median(5, || {
            step += 1;
            adam_step_with_copy(&mut p, &g, &mut m, &mut v, step, &hp, 1.0, &mut copy);
        })
    });
    std::hint::black_box((&p, &copy));
    Ok(N as f64 / secs)
}

/// `len` copies of `x` in memory allocated as the engine allocates its flat buffers (huge pages
/// for large ones, [`zeroed_vec`]), so that the bandwidth and the Adam rate are the engine's.
fn filled<T: bytemuck::Zeroable + Copy>(len: usize, x: T) -> Vec<T> {
    let mut v = zeroed_vec(len);
    v.fill(x);
    v
}

fn pool(threads: usize) -> anyhow::Result<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .with_context(|| format!("building a rayon pool of {threads} threads"))
}

/// All thread counts on one shard of `n` parameters with gradients `G` and moments `S`.
fn measure<G: Element, S: StateElement>(
    n: usize,
    args: &BenchAdamArgs,
    pools: &[(usize, rayon::ThreadPool)],
) -> Vec<Row> {
    let hp = AdamParams {
        weight_decay: 0.01,
        ..AdamParams::default()
    };
    let mut p: Vec<f32> = zeroed_vec(n);
    for (i, x) in p.iter_mut().enumerate() {
        *x = ((i % 1000) as f32 - 500.0) * 1e-3;
    }
    let mut g = zeroed_vec::<G>(n);
    let mut gbuf = [0f32; TILE];
    for (k, tile) in g.chunks_mut(TILE).enumerate() {
        let buf = &mut gbuf[..tile.len()];
        for (j, x) in buf.iter_mut().enumerate() {
            *x = (((k * TILE + j) % 777) as f32 - 388.0) * 1e-4;
        }
        G::narrow(buf, tile);
    }
    let mut m = zeroed_vec::<S>(n);
    let mut v = zeroed_vec::<S>(n);
    let mut copy = zeroed_vec::<bf16>(if args.no_copy { 0 } else { n });
    let bytes_per_param = 8 + G::BYTES + 4 * S::BYTES;
    let mut step = 0u64;
    let mut rows = Vec::new();
    for (threads, pool) in pools {
        let secs = pool.install(|| {
            time_median(args.runs, || {
                step += 1;
                adam_step(&mut p, &g, &mut m, &mut v, step, &hp, 0.5);
            })
        });
        let copy_secs = (!args.no_copy).then(|| {
            pool.install(|| {
                time_median(args.runs, || {
                    step += 1;
                    adam_step_with_copy(&mut p, &g, &mut m, &mut v, step, &hp, 0.5, &mut copy);
                })
            })
        });
        rows.push(Row {
            params: n,
            threads: *threads,
            state_dtype: S::NAME,
            grad_dtype: G::NAME,
            params_per_s: n as f64 / secs,
            bytes_per_param,
            ms_per_step: secs * 1e3,
            gbps: (n * bytes_per_param) as f64 / secs / 1e9,
            fused_copy_params_per_s: copy_secs.map(|s| n as f64 / s),
            fused_copy_ms_per_step: copy_secs.map(|s| s * 1e3),
            fused_copy_bytes_per_param: copy_secs.map(|_| bytes_per_param + 2),
        });
    }
    std::hint::black_box((&p, &copy));
    rows
}

pub fn run(args: BenchAdamArgs) -> anyhow::Result<i32> {
    let sizes = parse_params(&args.params)?;
    if args.threads.is_empty() || args.threads.contains(&0) {
        bail!(
            "--threads {:?}: give positive thread counts, such as --threads 1,2",
            args.threads
        );
    }
    if args.state_dtypes.is_empty() {
        bail!("--state-dtypes names no dtype; use f32, bf16 or f32,bf16");
    }
    if args.runs == 0 {
        bail!("--runs 0: give at least one timed step");
    }
    // A forced path this CPU lacks, or a misspelt one, is an error here rather than a silent
    // measurement of another path.
    AdamIsa::from_env()?;
    if let Some(available) = available_memory() {
        check_fits(&args, &sizes, available)?;
    }
    let isa = adam_isa();
    let all = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mem_bw_gbps = stream_gbps(all, args.runs.max(5), false);
    let triad_gbps = stream_gbps(all, args.runs.max(5), true);
    let pools = args
        .threads
        .iter()
        .map(|&t| pool(t).map(|p| (t, p)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut results = Vec::new();
    for &n in &sizes {
        for &state in &args.state_dtypes {
            results.extend(match (args.grad_dtype, state) {
                (DtypeChoice::F32, DtypeChoice::F32) => measure::<f32, f32>(n, &args, &pools),
                (DtypeChoice::F32, DtypeChoice::Bf16) => measure::<f32, bf16>(n, &args, &pools),
                (DtypeChoice::Bf16, DtypeChoice::F32) => measure::<bf16, f32>(n, &args, &pools),
                (DtypeChoice::Bf16, DtypeChoice::Bf16) => measure::<bf16, bf16>(n, &args, &pools),
            });
        }
    }
    let report = Report {
        mem_bw_gbps,
        triad_gbps,
        mem_bw_threads: all,
        isa: isa.name(),
        isa_available: AdamIsa::available().iter().map(|i| i.name()).collect(),
        runs: args.runs,
        results,
    };
    match args.format {
        Format::Json => outln!("{}", serde_json::to_string(&report)?),
        Format::Table => print_table(&report)?,
    }
    Ok(0)
}

fn print_table(r: &Report) -> anyhow::Result<()> {
    outln!(
        "# adam step, {} path (available: {}); memory bandwidth {:.2} GB/s (a += s*b, read+write, \
         {} threads; STREAM triad {:.2}); median of {} steps",
        r.isa,
        r.isa_available.join(", "),
        r.mem_bw_gbps,
        r.mem_bw_threads,
        r.triad_gbps,
        r.runs
    );
    outln!(
        "{:>13} {:>7} {:>6} {:>5} {:>9} {:>10} {:>7} {:>5} {:>16} {:>16}",
        "params",
        "threads",
        "states",
        "grads",
        "ms/step",
        "Mparams/s",
        "GB/s",
        "%bw",
        "+copy ms/step",
        "+copy Mparams/s"
    );
    for row in &r.results {
        let opt =
            |x: Option<f64>, scale: f64| x.map_or("-".into(), |x| format!("{:.1}", x * scale));
        outln!(
            "{:>13} {:>7} {:>6} {:>5} {:>9.2} {:>10.1} {:>7.2} {:>5.0} {:>16} {:>16}",
            row.params,
            row.threads,
            row.state_dtype,
            row.grad_dtype,
            row.ms_per_step,
            row.params_per_s / 1e6,
            row.gbps,
            100.0 * row.gbps / r.mem_bw_gbps,
            opt(row.fused_copy_ms_per_step, 1.0),
            opt(row.fused_copy_params_per_s, 1e-6)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_are_decimal_counts() {
        assert_eq!(
            parse_params("10M,100M,1G").unwrap(),
            [10_000_000, 100_000_000, 1_000_000_000]
        );
        assert_eq!(
            parse_params("1B, 5k,42").unwrap(),
            [1_000_000_000, 5_000, 42]
        );
        for bad in ["lots", "", "0", "1.5M", "99999999999999999999G"] {
            let e = parse_params(bad).unwrap_err().to_string();
            assert!(e.contains("--params"), "{bad}: {e}");
        }
    }

    #[test]
    fn bytes_needed_counts_every_buffer() {
        let (f, b) = (DtypeChoice::F32, DtypeChoice::Bf16);
        assert_eq!(bytes_needed(10, f, f, false), 160);
        assert_eq!(bytes_needed(10, f, b, true), 140);
        assert_eq!(bytes_needed(10, b, b, false), 100);
    }
}
