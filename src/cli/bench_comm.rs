//! `zerodp bench comm`: an nccl-tests-style bandwidth table of the in-process collectives, next to the
//! machine's memcpy bandwidth measured in the same run.
//!
//! Each iteration starts behind a barrier, every rank times its own collective, and the iteration
//! counts as the slowest rank's time (a collective is done when its last rank is done); the table
//! shows the median over iterations. The ops and forms of one size run interleaved, one iteration
//! of each per round, so that a drifting load on a shared host weighs on all of them alike. Sizes
//! are full tensors (nccl-tests' convention), and busbw follows nccl-tests: all-reduce
//! algbw·2(n-1)/n, reduce-scatter and all-gather algbw·(n-1)/n.
//!
//! Under `mpirun` (`--backend auto`, the default, or `mpi`) every process is one rank of an MPI
//! world: the same cases run through the MPI backend, each iteration counts as its slowest rank's
//! time (the ranks' times are max-reduced), rank 0 measures the memcpy reference (the others wait)
//! and prints the table. `--raw-mpi` adds rows for MPI's own collectives (`MPI_Allreduce`,
//! `MPI_Reduce_scatter_block`, `MPI_Allgather` on f32), timed the same way.
//!
//! Like nccl-tests' out-of-place and in-place columns, reduce-scatter and all-gather are measured in
//! both forms (`reduce_scatter` / `reduce_scatter (in-place)` rows; `in_place` in JSON). All-reduce
//! has only one form here, in place (the communicator reduces into the caller's buffer).

use anyhow::{bail, Context};
use std::time::{Duration, Instant};
use zerodp::comm::stats::bandwidths;
use zerodp::comm::{
    run_ranks, shard_range, CollectiveKind, CommError, CommOptions, Communicator, ReduceOp,
};
use zerodp::flat::{Buffer, DType};

#[derive(clap::Args, Debug)]
pub struct BenchCommArgs {
    /// Ranks (threads) in the in-process world [default: 2; under MPI the process count, which
    /// it must equal if given].
    #[arg(long)]
    pub world_size: Option<usize>,
    /// Where the ranks run: `inprocess` (threads), `mpi` (one rank per process, under mpirun) or
    /// `auto` (MPI when started by an MPI launcher).
    #[arg(long, value_enum, default_value_t = super::launch::BackendChoice::Auto)]
    pub backend: super::launch::BackendChoice,
    /// Under MPI, also time MPI's own collectives (f32 only) for comparison.
    #[arg(long)]
    pub raw_mpi: bool,
    /// Run the collectives through NCCL on the GPUs (a `cuda` build): in-process rank r on GPU r
    /// (one rank per GPU; the world defaults to every GPU), under MPI each process on its local
    /// rank's GPU. Buffers stay in host memory, staged through the GPU for each collective.
    #[arg(long)]
    pub nccl: bool,
    /// Collective to measure.
    #[arg(long, value_enum, default_value_t = OpChoice::All)]
    pub op: OpChoice,
    /// Full-tensor sizes in bytes: `1K`, `64M`, `1G` (powers of 2), a list `1K,1M`, or a range
    /// `1K..1G` doubling from the first to the last. Every rank holds two buffers of the largest
    /// size: sizes that do not fit this machine's available memory are refused.
    #[arg(long, default_value = "1K..256M")]
    pub sizes: String,
    /// Timed rounds per size: each round runs one iteration of every op and form of the size, in
    /// turn (the median over rounds is reported).
    #[arg(long, default_value_t = 5)]
    pub iters: usize,
    /// Untimed rounds per size before the timed ones (first touch of the pages, caches).
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Element type of the buffers.
    #[arg(long, value_enum, default_value_t = DTypeChoice::F32)]
    pub dtype: DTypeChoice,
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// Collective timeout in seconds, or inf for none (overrides ZERODP_TIMEOUT).
    #[arg(long)]
    pub timeout: Option<f64>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
#[value(rename_all = "snake_case")]
pub enum OpChoice {
    #[value(alias = "all-reduce")]
    AllReduce,
    #[value(alias = "reduce-scatter")]
    ReduceScatter,
    #[value(alias = "all-gather")]
    AllGather,
    All,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DTypeChoice {
    F32,
    Bf16,
    F16,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Table,
    Json,
}

impl DTypeChoice {
    fn dtype(self) -> DType {
        match self {
            DTypeChoice::F32 => DType::F32,
            DTypeChoice::Bf16 => DType::BF16,
            DTypeChoice::F16 => DType::F16,
        }
    }
}

impl OpChoice {
    fn kinds(self) -> Vec<CollectiveKind> {
        match self {
            OpChoice::AllReduce => vec![CollectiveKind::AllReduce],
            OpChoice::ReduceScatter => vec![CollectiveKind::ReduceScatter],
            OpChoice::AllGather => vec![CollectiveKind::AllGather],
            OpChoice::All => vec![
                CollectiveKind::AllReduce,
                CollectiveKind::ReduceScatter,
                CollectiveKind::AllGather,
            ],
        }
    }
}

/// One size: `4096`, `1K`, `64M`, `1G`, `1T` (binary multiples; `B` suffix allowed).
fn parse_size(s: &str) -> anyhow::Result<usize> {
    let t = s.trim().trim_end_matches(['B', 'b']);
    let (num, mult) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 1usize << 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 1 << 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 1 << 30),
        Some('T' | 't') => (&t[..t.len() - 1], 1 << 40),
        _ => (t, 1),
    };
    let n: usize = num.trim().parse().with_context(|| {
        format!("size {s:?}: expected a number with an optional K, M, G or T suffix, such as 64M")
    })?;
    n.checked_mul(mult)
        .with_context(|| format!("size {s:?} is too large"))
}

/// `--sizes`: a comma-separated list of sizes or `a..b` ranges (doubling from a while <= b).
pub fn parse_sizes(spec: &str) -> anyhow::Result<Vec<usize>> {
    let mut out = Vec::new();
    for part in spec.split(',').filter(|p| !p.trim().is_empty()) {
        if let Some((a, b)) = part.split_once("..") {
            let (a, b) = (parse_size(a)?, parse_size(b)?);
            if a == 0 || a > b {
                bail!("size range {part:?}: the start must be positive and not above the end");
            }
            let mut s = a;
            while s <= b {
                out.push(s);
                s = match s.checked_mul(2) {
                    Some(x) => x,
                    None => break,
                };
            }
        } else {
            out.push(parse_size(part)?);
        }
    }
    if out.is_empty() {
        bail!("--sizes {spec:?} names no size; try --sizes 1K..1G");
    }
    Ok(out)
}

/// One measured (op, size) point.
#[derive(serde::Serialize, Debug, Clone)]
pub struct BenchResult {
    pub op: CollectiveKind,
    /// Whether the collective ran in place (`*_in_place` methods; all-reduce always is).
    pub in_place: bool,
    /// MPI's own collective (`--raw-mpi`) rather than zerodp's.
    pub raw_mpi: bool,
    pub world_size: usize,
    /// Full tensor bytes.
    pub bytes: usize,
    /// Elements of the full tensor.
    pub count: usize,
    pub dtype: DType,
    /// Median over iterations of the slowest rank's time.
    pub time_s: f64,
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
}

#[derive(serde::Serialize, Debug, Clone, Copy)]
pub struct MemcpyGbps {
    /// One thread copying a buffer: bytes copied per second / 1e9.
    pub one_thread: f64,
    /// Every hardware thread copying its own part of the buffer at once: total bytes copied per
    /// second / 1e9.
    pub all_threads: f64,
    /// The number of threads behind `all_threads`.
    pub threads: usize,
    /// Bytes copied per measurement.
    pub bytes: usize,
}

#[derive(serde::Serialize, Debug)]
struct Report {
    memcpy_gbps: MemcpyGbps,
    results: Vec<BenchResult>,
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// Times of `iters` copies of `bytes` (after one warm-up copy): `(one thread, all threads)`, the
/// latter with `threads` threads each copying its own contiguous part at once.
fn memcpy_times(bytes: usize, iters: usize, threads: usize) -> (Vec<f64>, Vec<f64>) {
    let src = vec![1u8; bytes];
    let mut dst = vec![2u8; bytes];
    let mut time = |threads: usize| -> Vec<f64> {
        let chunk = bytes.div_ceil(threads);
        let mut samples = Vec::with_capacity(iters);
        for _ in 0..iters + 1 {
            let t0 = Instant::now();
            std::thread::scope(|s| {
                for (d, sr) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
                    s.spawn(move || d.copy_from_slice(sr));
                }
            });
            samples.push(t0.elapsed().as_secs_f64());
        }
        samples.remove(0); // warm-up
        samples
    };
    (time(1), time(threads))
}

/// The memcpy reference from timings (bytes copied per second / 1e9, at the median time).
fn memcpy_gbps(bytes: usize, threads: usize, one: Vec<f64>, all: Vec<f64>) -> MemcpyGbps {
    MemcpyGbps {
        one_thread: bytes as f64 / median(one) / 1e9,
        all_threads: bytes as f64 / median(all) / 1e9,
        threads,
        bytes,
    }
}

/// A buffer of `len` elements filled with non-zero values written by the calling thread (so its
/// pages are really mapped by the rank that owns them, not the shared zero page).
fn filled(dtype: DType, len: usize, rank: usize) -> Buffer {
    let v = 1.0 + rank as f32;
    match dtype {
        DType::F32 => Buffer::F32(vec![v; len]),
        DType::BF16 => Buffer::BF16(vec![half::bf16::from_f32(v); len]),
        DType::F16 => Buffer::F16(vec![half::f16::from_f32(v); len]),
    }
}

/// One measured point: an op, its form and a full-tensor size in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Case {
    kind: CollectiveKind,
    in_place: bool,
    bytes: usize,
}

impl Case {
    /// The row label: `all_gather`, `all_gather (in-place)`; all-reduce is always in place and
    /// keeps its plain name.
    fn label(kind: CollectiveKind, in_place: bool) -> String {
        if in_place && kind != CollectiveKind::AllReduce {
            format!("{} (in-place)", kind.name())
        } else {
            kind.name().to_string()
        }
    }
}

/// Every case, per op and size: the out-of-place form, then the in-place one.
fn cases(kinds: &[CollectiveKind], sizes: &[usize]) -> Vec<Case> {
    let mut v = Vec::new();
    for &kind in kinds {
        for &bytes in sizes {
            let forms: &[bool] = if kind == CollectiveKind::AllReduce {
                &[true]
            } else {
                &[false, true]
            };
            for &in_place in forms {
                v.push(Case {
                    kind,
                    in_place,
                    bytes,
                });
            }
        }
    }
    v
}

/// Times every case of one size on this rank, round by round: each round runs one iteration of
/// every case in turn (the first `warmup` rounds untimed), so a drift in the machine's load (other
/// tenants of a shared host, whose memory bandwidth comes and goes over seconds) falls on every
/// case alike instead of on whichever case ran during it. Returns the times per case.
///
/// Two full-size buffers per rank serve every form (llm.c style: allocated once, travelling through
/// each call and back): all-reduce and the in-place forms use `a`; the out-of-place reduce-scatter
/// reduces `a` into `b` cut to the shard, the out-of-place all-gather gathers `a` cut to the shard
/// into `b`. Cutting and restoring the lengths happens outside the timed region and never
/// reallocates.
fn run_size(
    comm: &dyn Communicator,
    cases: &[Case],
    dtype: DType,
    warmup: usize,
    iters: usize,
) -> Result<Vec<Vec<f64>>, CommError> {
    let (n, rank) = (comm.world_size(), comm.rank());
    let len = cases.first().map_or(0, |c| c.bytes / dtype.size());
    let shard = shard_range(len, n, rank).len();
    let mut a = filled(dtype, len, rank);
    let mut b = filled(dtype, len, 0);
    let mut times = vec![Vec::with_capacity(iters); cases.len()];
    for round in 0..warmup + iters {
        for (c, case) in cases.iter().enumerate() {
            a.resize_zeroed(len);
            b.resize_zeroed(len);
            comm.barrier().wait()?;
            let t0 = Instant::now();
            match (case.kind, case.in_place) {
                (CollectiveKind::AllReduce, _) => {
                    a = comm.all_reduce(a, ReduceOp::Sum).wait_one()?;
                }
                (CollectiveKind::ReduceScatter, true) => {
                    a = comm.reduce_scatter_in_place(a, ReduceOp::Sum).wait_one()?;
                }
                (_, true) => {
                    a = comm.all_gather_in_place(a).wait_one()?;
                }
                (CollectiveKind::ReduceScatter, false) => {
                    b.truncate(shard);
                    (a, b) = comm.reduce_scatter(a, b, ReduceOp::Sum).wait_pair()?;
                }
                (_, false) => {
                    a.truncate(shard);
                    (a, b) = comm.all_gather(a, b).wait_pair()?;
                }
            }
            if round >= warmup {
                times[c].push(t0.elapsed().as_secs_f64());
            }
        }
    }
    Ok(times)
}

pub fn run(args: BenchCommArgs) -> anyhow::Result<i32> {
    let (n, mpi) = world_of(&args)?;
    let dtype = args.dtype.dtype();
    let sizes = message_sizes(&args.sizes, dtype)?;
    let mut options = CommOptions::from_env()?;
    if let Some(t) = args.timeout {
        options.timeout = super::timeout_flag(t)?;
    }
    let cases = cases(&args.op.kinds(), &sizes);

    // Memcpy reference over a buffer above the last-level cache (at least 64 MiB) and no larger
    // than the largest message (at most 1 GiB), measured while no rank runs.
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    let max_size = sizes.iter().copied().max().unwrap_or(0);
    let memcpy_bytes = max_size.clamp(64 << 20, 1 << 30);
    if let Some(available) = available_memory() {
        buffers_fit(max_size, n, memcpy_bytes, available)
            .map_err(|e| anyhow::anyhow!("--sizes {}: {e}", args.sizes))?;
    }
    // Half the memcpy samples before the collectives and half after, so that the reference spans
    // the same stretch of time as the measurements (the load of a shared machine drifts).
    let half = args.iters.div_ceil(2);
    let measure = |rank: usize| match rank {
        0 => memcpy_times(memcpy_bytes, half, threads),
        _ => (vec![1.0], vec![1.0]),
    };

    let all_cases = |comm: &dyn Communicator| {
        time_cases(comm, (&cases, &sizes), dtype, (args.warmup, args.iters))
    };
    let (one, all, per_rank, raw, header) = if mpi {
        let m = mpi_times(&args, options, n, &cases, &all_cases, &measure)?;
        match m {
            Some(m) => m,
            // Not rank 0: rank 0 prints.
            None => return Ok(0),
        }
    } else {
        let (mut one, mut all) = measure(0);
        let per_rank = match args.nccl {
            true => super::nccl::in_process(n, options, &all_cases)?,
            false => run_ranks(n, options, |comm, _rank| all_cases(&*comm))
                .map_err(|e| anyhow::anyhow!("{e}"))?,
        };
        let (one_after, all_after) = measure(0);
        one.extend(one_after);
        all.extend(all_after);
        let header = match args.nccl {
            true => format!("in-process NCCL world of {n} GPUs"),
            false => format!("in-process world of {n} ranks"),
        };
        (one, all, per_rank, Vec::new(), header)
    };
    let memcpy = memcpy_gbps(memcpy_bytes, threads, one, all);

    let mut results: Vec<BenchResult> = (cases.iter().enumerate())
        .map(|(c, case)| {
            // An iteration lasts as long as its slowest rank.
            let slowest: Vec<f64> = (0..args.iters)
                .map(|i| per_rank.iter().map(|r| r[c][i]).fold(0.0, f64::max))
                .collect();
            result_of(case, (n, dtype), false, slowest)
        })
        .collect();
    for (case, times) in raw {
        results.push(result_of(
            &Case {
                in_place: false,
                ..case
            },
            (n, dtype),
            true,
            times,
        ));
    }

    match args.format {
        Format::Json => {
            let report = Report {
                memcpy_gbps: memcpy,
                results,
            };
            outln!("{}", serde_json::to_string_pretty(&report)?);
        }
        Format::Table => print_table(&args, &header, n, dtype, &memcpy, &results)?,
    }
    Ok(0)
}

/// The world size and whether it runs under MPI, after the flags' own checks.
fn world_of(args: &BenchCommArgs) -> anyhow::Result<(usize, bool)> {
    if args.nccl {
        super::nccl::available()?;
    }
    let resolved = super::launch::resolve(args.backend, args.world_size)?;
    let mpi = matches!(resolved, super::launch::Resolved::Mpi { .. });
    let n = match resolved {
        super::launch::Resolved::Mpi { world } => world,
        super::launch::Resolved::InProcess { .. } if args.nccl => match args.world_size {
            Some(n) => n,
            None => super::nccl::gpus()?,
        },
        super::launch::Resolved::InProcess { .. } => args.world_size.unwrap_or(2),
    };
    if n == 0 {
        bail!("--world-size must be at least 1");
    }
    if args.raw_mpi && !mpi {
        bail!("--raw-mpi times MPI's own collectives: run under mpirun (or with --backend mpi)");
    }
    if args.raw_mpi && args.dtype != DTypeChoice::F32 {
        bail!("--raw-mpi measures f32 only (MPI has no bf16/f16 type)");
    }
    if args.iters == 0 {
        bail!("--iters must be at least 1");
    }
    // The times of every round are kept: bound the rounds before allocating for them.
    const MAX_ROUNDS: usize = 1_000_000;
    if args.iters > MAX_ROUNDS || args.warmup > MAX_ROUNDS {
        bail!("--iters and --warmup take at most {MAX_ROUNDS} rounds each");
    }
    Ok((n, mpi))
}

/// `--sizes`, each a whole number of `dtype` elements.
fn message_sizes(text: &str, dtype: DType) -> anyhow::Result<Vec<usize>> {
    let sizes = parse_sizes(text)?;
    if let Some(s) = sizes.iter().find(|&&s| s % dtype.size() != 0) {
        bail!("size {s} bytes is not a whole number of {dtype} elements");
    }
    Ok(sizes)
}

/// The times of every case of `cases` (built from `sizes`), in `cases` order: the sizes one after
/// the other, the cases of one size interleaved.
fn time_cases(
    comm: &dyn Communicator,
    (cases, sizes): (&[Case], &[usize]),
    dtype: DType,
    (warmup, iters): (usize, usize),
) -> Result<Vec<Vec<f64>>, CommError> {
    let mut times = vec![Vec::new(); cases.len()];
    let mut distinct = sizes.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    for &size in &distinct {
        let of_size: Vec<usize> = (0..cases.len())
            .filter(|&c| cases[c].bytes == size)
            .collect();
        let picked: Vec<Case> = of_size.iter().map(|&c| cases[c]).collect();
        let measured = run_size(comm, &picked, dtype, warmup, iters)?;
        for (c, t) in of_size.into_iter().zip(measured) {
            times[c] = t;
        }
    }
    Ok(times)
}

/// One case's result from its iterations' times (the median) on `n` ranks of `dtype` elements;
/// `raw_mpi` for MPI's own collective.
fn result_of(
    case: &Case,
    (n, dtype): (usize, DType),
    raw_mpi: bool,
    times: Vec<f64>,
) -> BenchResult {
    let time_s = median(times);
    let duration = Duration::from_secs_f64(time_s);
    let (algbw, busbw) = bandwidths(case.kind, n, case.bytes as u64, duration);
    BenchResult {
        op: case.kind,
        in_place: case.in_place,
        raw_mpi,
        world_size: n,
        bytes: case.bytes,
        count: case.bytes / dtype.size(),
        dtype,
        time_s,
        algbw_gbps: algbw,
        busbw_gbps: busbw,
    }
}

/// Bytes this machine can still give without swapping (`MemAvailable` in /proc/meminfo), when
/// known.
pub(crate) fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = text
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse::<u64>()
        .ok()?;
    kib.checked_mul(1024)
}

/// Whether the buffers of a run fit `available` bytes: every rank holds two buffers of the largest
/// size at once ([`run_size`]), and the memcpy reference, measured while no rank runs, two of
/// `memcpy_bytes`. The error says what was needed against what is available.
fn buffers_fit(
    largest: usize,
    ranks: usize,
    memcpy_bytes: usize,
    available: u64,
) -> Result<(), String> {
    // u128: the product of two usizes fits; the doubling saturates.
    let collectives = (largest as u128 * ranks as u128).saturating_mul(2);
    let needed = collectives.max(2 * memcpy_bytes as u128);
    if needed <= available as u128 {
        return Ok(());
    }
    let gib = |b: u128| b as f64 / (1u64 << 30) as f64;
    Err(format!(
        "the largest size, {}, needs two buffers on each of {ranks} rank(s), {:.1} GiB in all, \
         more than the {:.1} GiB this machine has available (MemAvailable in /proc/meminfo); \
         lower --sizes or --world-size",
        human(largest),
        gib(needed),
        gib(available as u128)
    ))
}

/// Runs every case on one rank: per case, the times of its iterations.
type AllCases<'a> = dyn Fn(&dyn Communicator) -> Result<Vec<Vec<f64>>, CommError> + 'a;

/// What an MPI run measured: memcpy samples (rank 0's), the slowest rank's time per case and
/// iteration, raw MPI timings per case, and the table's header.
type Measured = (
    Vec<f64>,
    Vec<f64>,
    Vec<Vec<Vec<f64>>>,
    Vec<(Case, Vec<f64>)>,
    String,
);

/// Under MPI: this process's rank runs every case; the ranks' times are max-reduced (an iteration
/// lasts as long as its slowest rank). `None` on ranks other than 0, which print nothing.
#[cfg(feature = "mpi")]
fn mpi_times(
    args: &BenchCommArgs,
    options: CommOptions,
    n: usize,
    cases: &[Case],
    all_cases: &AllCases<'_>,
    measure: &dyn Fn(usize) -> (Vec<f64>, Vec<f64>),
) -> anyhow::Result<Option<Measured>> {
    let comm = std::sync::Arc::new(zerodp::comm::MpiComm::init(options.clone())?);
    let topo = comm.topology();
    if topo.size != n {
        bail!(
            "MPI reports {} processes but the launcher said {n}",
            topo.size
        );
    }
    let rank = topo.rank;
    // Rank 0 measures memcpy while the others wait at the barrier.
    let (mut one, mut all) = measure(rank);
    comm.barrier().wait()?;
    let mine = match args.nccl {
        true => {
            // Each process on its local rank's GPU.
            let gpus = super::nccl::gpus()?;
            let at = (topo.local_rank % gpus, topo.local_size, false);
            all_cases(&*super::nccl::over_mpi(comm.clone(), at, options)?)?
        }
        false => all_cases(&*comm)?,
    };
    let mut raw = Vec::new();
    if args.raw_mpi {
        let mut seen = Vec::new();
        for c in cases
            .iter()
            .filter(|c| !c.in_place || c.kind == CollectiveKind::AllReduce)
        {
            if seen.contains(&(c.kind, c.bytes)) {
                continue;
            }
            seen.push((c.kind, c.bytes));
            let t = comm.raw_collective_times(c.kind, c.bytes, args.warmup, args.iters)?;
            raw.push((*c, t));
        }
    }
    comm.barrier().wait()?;
    let (one_after, all_after) = measure(rank);
    one.extend(one_after);
    all.extend(all_after);
    // The slowest rank's time of every (case, iteration), and of every raw timing.
    let flat: Vec<f32> = mine
        .iter()
        .flatten()
        .chain(raw.iter().flat_map(|(_, t)| t))
        .map(|&t| t as f32)
        .collect();
    let slowest = comm
        .all_reduce(Buffer::F32(flat), ReduceOp::Max)
        .wait_one()?;
    let slowest = zerodp::comm::returned_f32(slowest, rank)?;
    if rank != 0 {
        return Ok(None);
    }
    let mut it = slowest.into_iter().map(f64::from);
    let per_case: Vec<Vec<f64>> = mine
        .iter()
        .map(|t| it.by_ref().take(t.len()).collect())
        .collect();
    let raw: Vec<(Case, Vec<f64>)> = raw
        .into_iter()
        .map(|(c, t)| (c, it.by_ref().take(t.len()).collect()))
        .collect();
    let header = format!(
        "{}MPI world of {n} processes on {} host(s) ({} on rank 0's host)",
        if args.nccl { "NCCL over an " } else { "" },
        topo.hosts,
        topo.local_size
    );
    Ok(Some((one, all, vec![per_case], raw, header)))
}

#[cfg(not(feature = "mpi"))]
fn mpi_times(
    _args: &BenchCommArgs,
    _options: CommOptions,
    _n: usize,
    _cases: &[Case],
    _all_cases: &AllCases<'_>,
    _measure: &dyn Fn(usize) -> (Vec<f64>, Vec<f64>),
) -> anyhow::Result<Option<Measured>> {
    bail!("{}", zerodp::comm::launch::MPI_BUILD_HINT)
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 40 && b % (1 << 40) == 0 => format!("{}T", b >> 40),
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => format!("{b}"),
    }
}

/// Bytes read plus written in memory, summed over all ranks, by one collective of the in-process
/// backend on a full tensor of `bytes` (its algorithms are traffic-minimal): all-reduce reads every
/// buffer once and writes every buffer once (2nB); reduce-scatter reads every input once and writes
/// each shard once, with streaming stores out of place or over the lines just read in place
/// (nB + B); all-gather copies the full tensor into every output (2nB), or in place only the other
/// ranks' shards (2(n-1)B). Dividing by the time gives the memory bandwidth the collective drew,
/// comparable with the all-thread memcpy (which moves 2 bytes per byte copied).
fn memory_traffic(kind: CollectiveKind, in_place: bool, n: usize, bytes: usize) -> f64 {
    let (n, b) = (n as f64, bytes as f64);
    match kind {
        CollectiveKind::ReduceScatter => n * b + b,
        CollectiveKind::AllGather if in_place => 2.0 * (n - 1.0) * b,
        _ => 2.0 * n * b,
    }
}

fn print_table(
    args: &BenchCommArgs,
    header: &str,
    n: usize,
    dtype: DType,
    memcpy: &MemcpyGbps,
    results: &[BenchResult],
) -> anyhow::Result<()> {
    // A rank's "link" here is memory: the fair per-rank reference is the copy bandwidth one rank
    // gets while the others copy too, the all-thread rate shared among min(ranks, threads).
    let per_rank_ref = memcpy.all_threads / n.min(memcpy.threads) as f64;
    outln!(
        "# zerodp bench comm: {header}, dtype {dtype}, median of {} iterations after {} warm-up",
        args.iters,
        args.warmup
    );
    outln!(
        "# memcpy reference ({} copied, median of runs before and after): one thread {:.2} GB/s, all {} threads {:.2} GB/s \
         (per rank when {} ranks share them: {:.2} GB/s)",
        human(memcpy.bytes),
        memcpy.one_thread,
        memcpy.threads,
        memcpy.all_threads,
        n.min(memcpy.threads),
        per_rank_ref
    );
    outln!(
        "# busbw as % of the one-thread memcpy (%1thr) and of the per-rank share (%share); %mem: \
         memory traffic drawn by all ranks as % of the all-thread memcpy's"
    );
    outln!(
        "# {:>25} {:>8} {:>12} {:>5} {:>12} {:>11} {:>11} {:>6} {:>6} {:>6}",
        "op",
        "size",
        "count",
        "type",
        "time(us)",
        "algbw(GB/s)",
        "busbw(GB/s)",
        "%1thr",
        "%share",
        "%mem"
    );
    for r in results {
        let mem = memory_traffic(r.op, r.in_place, n, r.bytes)
            / r.time_s
            / 1e9
            / (2.0 * memcpy.all_threads);
        outln!(
            "  {:>25} {:>8} {:>12} {:>5} {:>12.1} {:>11.2} {:>11.2} {:>5.0}% {:>5.0}% {:>5.0}%",
            if r.raw_mpi {
                format!("{} [raw MPI]", r.op.name())
            } else {
                Case::label(r.op, r.in_place)
            },
            human(r.bytes),
            r.count,
            r.dtype.name(),
            r.time_s * 1e6,
            r.algbw_gbps,
            r.busbw_gbps,
            100.0 * r.busbw_gbps / memcpy.one_thread,
            100.0 * r.busbw_gbps / per_rank_ref,
            100.0 * mem
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_as_binary_multiples_lists_and_doubling_ranges() {
        assert_eq!(parse_sizes("1K").unwrap(), vec![1024]);
        assert_eq!(parse_sizes("1G").unwrap(), vec![1 << 30]);
        assert_eq!(
            parse_sizes("1K..8K,64M").unwrap(),
            vec![1024, 2048, 4096, 8192, 64 << 20]
        );
        assert_eq!(parse_sizes("3..13").unwrap(), vec![3, 6, 12]);
        assert_eq!(parse_sizes("1T").unwrap(), vec![1 << 40]);
        assert!(parse_sizes("8K..1K").is_err());
        assert!(parse_sizes("lots").is_err());
        assert!(parse_sizes("").is_err());
    }

    #[test]
    fn buffers_must_fit_the_available_memory() {
        const GIB: u64 = 1 << 30;
        // 2 ranks x 2 buffers x 1 GiB = 4 GiB.
        assert!(buffers_fit(1 << 30, 2, 1 << 30, 4 * GIB).is_ok());
        let e = buffers_fit(1 << 30, 2, 1 << 30, 3 * GIB).unwrap_err();
        assert!(
            e.contains("1G") && e.contains("4.0 GiB") && e.contains("3.0 GiB"),
            "{e}"
        );
        // The memcpy reference's two buffers count too, even for small messages.
        assert!(buffers_fit(1024, 2, 1 << 30, GIB).is_err());
        assert!(buffers_fit(usize::MAX, usize::MAX, 1 << 30, u64::MAX).is_err());
    }
}
