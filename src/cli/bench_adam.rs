//! `zerodp bench adam`: parameters per second of the CPU Adam step per shard size, thread count
//! and state dtype, beside the machine's memory bandwidth measured in the same run.
//!
//! The step is memory-bound on large shards: it reads p, g, m, v and writes p, m, v once each
//! (28 bytes per parameter with f32 states and gradients, 20 with bf16 states), so the useful
//! comparison is its traffic (`gbps`) against what the memory delivers to that access pattern.
//! The reference is a pass with the step's own streams and integer adds for arithmetic (see
//! `traffic_gbps`), on the same threads, over 64M elements per buffer: `bound_gbps` per row (its
//! state and gradient widths and thread count) and `mem_bw_gbps`, the f32-state shape on every
//! hardware thread. STREAM's two- and three-stream kernels are not used: on this kind of host a
//! core's bandwidth grows with the streams it keeps in flight, and they measured half of what the
//! step itself draws.
//!
//! Each thread count runs in its own rayon pool of that size; each number is the median of
//! `--runs` timed steps after one warm-up step (which also maps the pages of m and v). With a
//! copy (the default), the step is timed again as `adam_step_with_copy` into a bf16 copy of the
//! parameters, the mixed-precision step, so that the cost of the fused 16-bit write shows.

use anyhow::{bail, Context};
use half::bf16;
use rayon::prelude::*;
use std::time::Instant;
use zerodp::flat::slices::{Element, PAR_CHUNK, TILE};
use zerodp::flat::zeroed_vec;
use zerodp::optim::adam::{
    adam_isa, adam_step, adam_step_with_copy, AdamIsa, AdamParams, StateElement,
};

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

/// Elements of each buffer of the bandwidth pass ([`traffic_gbps`]): 64M, so that even its bf16
/// buffers (128 MiB) are four times the last-level cache.
const TRAFFIC_ELEMS: usize = 64 << 20;

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
    /// The traffic the same access pattern draws with no arithmetic, on the same threads
    /// (`traffic_gbps`): the bound `gbps` is held to.
    bound_gbps: f64,
    /// The same step with the fused bf16 copy of the parameters (`None` with `--no-copy`).
    fused_copy_params_per_s: Option<f64>,
    fused_copy_ms_per_step: Option<f64>,
    /// `bytes_per_param` plus the 2 bytes of the copy.
    fused_copy_bytes_per_param: Option<usize>,
}

#[derive(serde::Serialize, Debug)]
struct Report {
    /// Bytes read plus written per second / 1e9 of the f32-state step's memory traffic with no
    /// arithmetic (`traffic_gbps`), the run's gradient dtype, all `mem_bw_threads` threads.
    mem_bw_gbps: f64,
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
            let bound = bytes_needed(TRAFFIC_ELEMS, args.grad_dtype, s, false);
            let need = bytes_needed(n, args.grad_dtype, s, copy).max(bound);
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

/// A machine word a bandwidth pass reads and writes with next to no arithmetic.
trait Word: bytemuck::Pod + Send + Sync {
    fn bump(self) -> Self;
    fn as_u32(self) -> u32;
}

impl Word for u32 {
    #[inline(always)]
    fn bump(self) -> Self {
        self.wrapping_add(1)
    }
    #[inline(always)]
    fn as_u32(self) -> u32 {
        self
    }
}

impl Word for u16 {
    #[inline(always)]
    fn bump(self) -> Self {
        self.wrapping_add(1)
    }
    #[inline(always)]
    fn as_u32(self) -> u32 {
        u32::from(self)
    }
}

/// One chunk of [`traffic_gbps`]'s pass: `p += g`, `m += 1`, `v += 1` (integer adds: nothing a
/// core waits for), so the pass draws exactly the Adam step's loads and stores and nothing else.
#[inline(always)]
fn traffic_chunk<G: Word, S: Word>(p: &mut [u32], g: &[G], m: &mut [S], v: &mut [S]) {
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        *p = p.wrapping_add(g.as_u32());
        *m = m.bump();
        *v = v.bump();
    }
}

/// [`traffic_chunk`] at the widest vectors the CPU has, as the Adam kernel runs (its AVX-512
/// path draws about 10% more bandwidth than a baseline SSE2 loop on this kind of host).
fn traffic_chunk_wide<G: Word, S: Word>(p: &mut [u32], g: &[G], m: &mut [S], v: &mut [S]) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn avx512<G: Word, S: Word>(p: &mut [u32], g: &[G], m: &mut [S], v: &mut [S]) {
            traffic_chunk(p, g, m, v)
        }
        #[target_feature(enable = "avx2")]
        unsafe fn avx2<G: Word, S: Word>(p: &mut [u32], g: &[G], m: &mut [S], v: &mut [S]) {
            traffic_chunk(p, g, m, v)
        }
        if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
            // SAFETY: the CPU has AVX-512F and BW (checked just above).
            return unsafe { avx512(p, g, m, v) };
        }
        if is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { avx2(p, g, m, v) };
        }
    }
    traffic_chunk(p, g, m, v)
}

/// The memory bandwidth an Adam step of this shape can draw at most: bytes read plus written per
/// second / 1e9 of a pass with the step's own streams (p 4 bytes read and written, g read, m and
/// v read and written, of `G`'s and `S`'s widths) and integer adds for arithmetic, over
/// [`TRAFFIC_ELEMS`] elements (far above the last-level cache) in the step's chunks on `pool`;
/// median of `runs` passes after one.
///
/// WHY this and not STREAM: a core's bandwidth here is bounded by the misses it keeps in flight,
/// and that grows with the number of streams, so a two-stream kernel (`a += s * b`) measured
/// half of what the seven-stream Adam step itself draws. The step's own shape is the bound it
/// can be held to; the ratio of the two is how much of the step the arithmetic costs.
fn traffic_gbps<G: Word, S: Word>(pool: &rayon::ThreadPool, runs: usize) -> f64 {
    let n = TRAFFIC_ELEMS;
    // Written once so that every page is mapped (a never-written page reads as the shared zero
    // page, from cache).
    let mut p = filled(n, 1u32);
    let g = filled(n, G::zeroed());
    let (mut m, mut v) = (filled(n, S::zeroed()), filled(n, S::zeroed()));
    let secs = pool.install(|| {
        time_median(runs, || {
            p.par_chunks_mut(PAR_CHUNK)
                .zip(g.par_chunks(PAR_CHUNK))
                .zip(m.par_chunks_mut(PAR_CHUNK))
                .zip(v.par_chunks_mut(PAR_CHUNK))
                .for_each(|(((p, g), m), v)| traffic_chunk_wide(p, g, m, v));
        })
    });
    std::hint::black_box((&p, &m, &v));
    let per = step_bytes_per_param(std::mem::size_of::<G>(), std::mem::size_of::<S>());
    (n * per) as f64 / secs / 1e9
}

/// Bytes the step moves per parameter: reads p, g, m, v and writes p, m, v (the copy apart).
fn step_bytes_per_param(grad_bytes: usize, state_bytes: usize) -> usize {
    8 + grad_bytes + 4 * state_bytes
}

/// [`traffic_gbps`] for a gradient and state dtype choice.
fn traffic_gbps_for(
    grad: DtypeChoice,
    state: DtypeChoice,
    pool: &rayon::ThreadPool,
    runs: usize,
) -> f64 {
    match (grad, state) {
        (DtypeChoice::F32, DtypeChoice::F32) => traffic_gbps::<u32, u32>(pool, runs),
        (DtypeChoice::F32, DtypeChoice::Bf16) => traffic_gbps::<u32, u16>(pool, runs),
        (DtypeChoice::Bf16, DtypeChoice::F32) => traffic_gbps::<u16, u32>(pool, runs),
        (DtypeChoice::Bf16, DtypeChoice::Bf16) => traffic_gbps::<u16, u16>(pool, runs),
    }
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
    bounds: &[f64],
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
    let bytes_per_param = step_bytes_per_param(G::BYTES, S::BYTES);
    let mut step = 0u64;
    let mut rows = Vec::new();
    for ((threads, pool), &bound_gbps) in pools.iter().zip(bounds) {
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
            bound_gbps,
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
    let pools = args
        .threads
        .iter()
        .map(|&t| pool(t).map(|p| (t, p)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let bound_runs = args.runs.max(5);
    let mem_bw_gbps = traffic_gbps_for(args.grad_dtype, DtypeChoice::F32, &pool(all)?, bound_runs);
    // The bound of each state dtype's shape at each thread count, measured before any step.
    let bounds: Vec<Vec<f64>> = args
        .state_dtypes
        .iter()
        .map(|&s| {
            let at = |(_, p): &(usize, rayon::ThreadPool)| {
                traffic_gbps_for(args.grad_dtype, s, p, bound_runs)
            };
            pools.iter().map(at).collect()
        })
        .collect();
    let mut results = Vec::new();
    for &n in &sizes {
        for (&state, bounds) in args.state_dtypes.iter().zip(&bounds) {
            let rows = match (args.grad_dtype, state) {
                (DtypeChoice::F32, DtypeChoice::F32) => {
                    measure::<f32, f32>(n, &args, &pools, bounds)
                }
                (DtypeChoice::F32, DtypeChoice::Bf16) => {
                    measure::<f32, bf16>(n, &args, &pools, bounds)
                }
                (DtypeChoice::Bf16, DtypeChoice::F32) => {
                    measure::<bf16, f32>(n, &args, &pools, bounds)
                }
                (DtypeChoice::Bf16, DtypeChoice::Bf16) => {
                    measure::<bf16, bf16>(n, &args, &pools, bounds)
                }
            };
            results.extend(rows);
        }
    }
    let report = Report {
        mem_bw_gbps,
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
        "# adam step, {} path (available: {}); memory bandwidth {:.2} GB/s (the f32-state step's \
         traffic with no arithmetic, read+write, {} threads; %bw: each row against its own \
         shape's at its threads); median of {} steps",
        r.isa,
        r.isa_available.join(", "),
        r.mem_bw_gbps,
        r.mem_bw_threads,
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
            100.0 * row.gbps / row.bound_gbps,
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
