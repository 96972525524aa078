//! ZeRO++'s int8 blocks (qwZ's gathers, qgZ's gradients): quantizing f32 and adding widened
//! payloads into f32, in elements per second and the bytes that implies, on one thread.
//!
//! `cargo bench --bench quantize` (optional: `ZERODP_BENCH_ELEMS=N`, `ZERODP_BENCH_RUNS=N`).
//! Prints the median of the timed runs after one warm-up run. `cargo test --all-targets` runs a
//! small smoke run of it.

use std::time::{Duration, Instant};
use zerodp::zero::quantize::{accumulate_f32, payload_bytes, quantize_f32};

fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(runs: usize, mut f: impl FnMut()) -> Duration {
    f();
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    times.sort();
    times[times.len() / 2]
}

fn report(name: &str, n: usize, bytes_per_elem: f64, t: Duration) {
    let s = t.as_secs_f64();
    println!(
        "{name:<28} {:>8.2} ms  {:>7.0} M elements/s  {:>6.1} GB/s",
        s * 1e3,
        n as f64 / s / 1e6,
        n as f64 * bytes_per_elem / s / 1e9
    );
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let n = env_usize("ZERODP_BENCH_ELEMS", if full { 32 << 20 } else { 1 << 16 });
    let runs = env_usize("ZERODP_BENCH_RUNS", if full { 7 } else { 1 });
    println!("quantize bench: {n} elements, median of {runs} runs, one thread");
    let x: Vec<f32> = (0..n)
        .map(|i| ((i as f32) * 0.013).sin() * if i % 977 == 0 { 0.4 } else { 0.02 })
        .collect();
    let mut payload = vec![0u8; payload_bytes(n)];
    let t = median(runs, || quantize_f32(&x, &mut payload));
    report("quantize f32 -> int8", n, 5.0, t);
    let mut sum = vec![0.0f32; n];
    let t = median(runs, || accumulate_f32(&payload, &mut sum));
    report("widen int8 and add into f32", n, 9.0, t);
    assert!(sum.iter().all(|v| v.is_finite()));
}
