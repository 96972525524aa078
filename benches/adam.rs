//! CPU Adam throughput on one large flat shard, 1 thread and all threads.
//!
//! `cargo bench --bench adam` (optional: `ZERODP_BENCH_ELEMS=N`, `ZERODP_BENCH_RUNS=N`, and
//! `ZERODP_ADAM_ISA=portable|avx2|avx512` to force the kernel path; `zerodp bench adam` measures
//! the same step per shard size next to the memory bandwidth).
//! Prints the median of several timed runs (after one warm-up run) as milliseconds per step,
//! parameters per second and the memory traffic that implies, and the share of the cores the
//! process actually got (CPU time / wall time / threads), since the machine may be shared. No criterion: the step is long
//! (tens of milliseconds) and the median of a handful of runs is stable enough to compare.

use std::time::{Duration, Instant};

use half::bf16;
use zerodp::flat::slices::{has_non_finite, sum_of_squares};
use zerodp::flat::zeroed_vec;
use zerodp::optim::adam::{adam_isa, adam_step, adam_step_with_copy, AdamParams};

fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// CPU time the threads of this process have run so far, in seconds, summed from
/// `/proc/self/task/*/schedstat` (nanoseconds; Linux only, `None` elsewhere). Compared with wall
/// time it shows how much of the cores the benchmark actually got on a shared machine.
fn process_cpu_seconds() -> Option<f64> {
    let mut ns = 0u64;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let stat = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
        ns += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(ns as f64 * 1e-9)
}

/// A measurement: median wall time of the timed runs, and the share of `threads` cores the
/// process got over all of them (1.0 = the cores were all ours).
struct Timing {
    median: Duration,
    core_share: Option<f64>,
}

/// Times `runs` calls of `f` after one untimed warm-up call.
fn measure(runs: usize, threads: usize, mut f: impl FnMut()) -> Timing {
    f();
    let cpu0 = process_cpu_seconds();
    let wall0 = Instant::now();
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    let wall = wall0.elapsed().as_secs_f64();
    let core_share = match (cpu0, process_cpu_seconds()) {
        (Some(a), Some(b)) if wall > 0.0 => Some((b - a) / wall / threads as f64),
        _ => None,
    };
    times.sort();
    Timing {
        median: times[times.len() / 2],
        core_share,
    }
}

fn report(name: &str, threads: usize, n: usize, bytes_per_elem: usize, t: &Timing) {
    let s = t.median.as_secs_f64();
    let share = t
        .core_share
        .map_or("  n/a".to_owned(), |c| format!("{:>4.0}%", c * 100.0));
    println!(
        "{name:<34} threads={threads:<2} {:>8.2} ms  {:>7.0} M params/s  {:>6.1} GB/s  cores got {share}",
        s * 1e3,
        n as f64 / s / 1e6,
        (n * bytes_per_elem) as f64 / s / 1e9
    );
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --all-targets` runs this file without it, and
    // there a small smoke run (64K elements, one run) checks that the benchmark still works
    // without spending CI minutes on 32M-element timings.
    let full = std::env::args().any(|a| a == "--bench");
    let n = env_usize("ZERODP_BENCH_ELEMS", if full { 32 << 20 } else { 1 << 16 });
    let runs = env_usize("ZERODP_BENCH_RUNS", if full { 7 } else { 1 });
    let all = std::thread::available_parallelism().map_or(1, |v| v.get());
    println!(
        "adam bench: {n} elements ({} MiB of f32 params), median of {runs} runs, {} path",
        (n * 4) >> 20,
        adam_isa().name()
    );

    // Allocated as the engine allocates its flat buffers (huge pages for large ones).
    let mut params: Vec<f32> = zeroed_vec(n);
    let mut grads: Vec<f32> = zeroed_vec(n);
    let mut grads_bf16: Vec<bf16> = zeroed_vec(n);
    for (i, ((p, g), g16)) in params
        .iter_mut()
        .zip(&mut grads)
        .zip(&mut grads_bf16)
        .enumerate()
    {
        *p = ((i % 1000) as f32 - 500.0) * 1e-3;
        *g = ((i % 777) as f32 - 388.0) * 1e-4;
        *g16 = bf16::from_f32(*g);
    }
    let mut m = zeroed_vec::<f32>(n);
    let mut v = zeroed_vec::<f32>(n);
    let mut m16 = zeroed_vec::<bf16>(n);
    let mut v16 = zeroed_vec::<bf16>(n);
    let mut copy = zeroed_vec::<bf16>(n);
    let hp = AdamParams {
        weight_decay: 0.01,
        ..AdamParams::default()
    };

    let mut thread_counts = vec![1];
    if all > 1 {
        thread_counts.push(all);
    }
    for &threads in &thread_counts {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("build rayon pool");
        pool.install(|| {
            let mut step = 0u64;
            let t = measure(runs, threads, || {
                step += 1;
                adam_step(&mut params, &grads, &mut m, &mut v, step, &hp, 0.5);
            });
            // Read p, g, m, v; write p, m, v: 28 bytes per element.
            report("adamw f32 grads", threads, n, 28, &t);

            let t = measure(runs, threads, || {
                step += 1;
                adam_step_with_copy(
                    &mut params,
                    &grads_bf16,
                    &mut m,
                    &mut v,
                    step,
                    &hp,
                    0.5,
                    &mut copy,
                );
            });
            // Read p, m, v (f32) and g (bf16); write p, m, v and the bf16 copy: 28 bytes.
            report("adamw bf16 grads + bf16 copy-out", threads, n, 28, &t);

            let t = measure(runs, threads, || {
                step += 1;
                adam_step(&mut params, &grads, &mut m16, &mut v16, step, &hp, 0.5);
            });
            // Read p, g (f32) and m, v (bf16); write p (f32), m, v (bf16): 20 bytes.
            report("adamw f32 grads, bf16 states", threads, n, 20, &t);

            let mut sink = 0f64;
            let t = measure(runs, threads, || sink += sum_of_squares(&grads));
            report("sum_of_squares f32", threads, n, 4, &t);
            let t = measure(runs, threads, || {
                sink += f64::from(u8::from(has_non_finite(&grads)))
            });
            report("has_non_finite f32", threads, n, 4, &t);
            std::hint::black_box(sink);
        });
    }
    std::hint::black_box((&params, &copy));
}
