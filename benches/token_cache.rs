//! What reusing a token cache costs: the SHA-256 of the token file that every reuse computes over
//! the mapped file before training reads it (`zerodp::data::token_data::checksum`).
//!
//! `cargo bench --bench token_cache` (optional: `ZERODP_BENCH_MB=N`, the file's size, default
//! 512; `ZERODP_BENCH_RUNS=N`, default 3). Writes a file of random ids in the system's temporary
//! directory, maps it as a reuse does, and prints the median seconds per GB over the runs (the
//! file is in the page cache after the first, as it is on a machine that just wrote or read it;
//! a cold read adds the disk's own time).

use std::io::Write;
use std::time::Instant;

fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> std::io::Result<()> {
    let mb = env_usize("ZERODP_BENCH_MB", 512);
    let runs = env_usize("ZERODP_BENCH_RUNS", 3).max(1);
    let path = std::env::temp_dir().join(format!("zerodp-bench-tokens-{}.u32", std::process::id()));
    let mut file = std::io::BufWriter::new(std::fs::File::create(&path)?);
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for _ in 0..(mb << 20) / 4 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        file.write_all(&((x % 151_936) as u32).to_le_bytes())?;
    }
    file.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    let opened = std::fs::File::open(&path)?;
    // SAFETY: a read-only map of a file this process wrote and nobody else changes.
    let map = unsafe { memmap2::Mmap::map(&opened)? };
    let mut times: Vec<f64> = (0..=runs)
        .map(|_| {
            let t = Instant::now();
            let sum = zerodp::data::token_data::checksum(&map);
            std::hint::black_box(sum);
            t.elapsed().as_secs_f64()
        })
        .skip(1)
        .collect();
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let gb = map.len() as f64 / 1e9;
    println!(
        "token cache check: SHA-256 of a {mb} MiB token file in {:.3} s (median of {runs}): \
         {:.2} s per GB, {:.2} GB/s; CPU SHA instructions: {}",
        median,
        median / gb,
        gb / median,
        sha_extensions()
    );
    drop(map);
    std::fs::remove_file(&path)
}

/// Whether the CPU has the SHA extensions the hash uses where present.
fn sha_extensions() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("sha") {
        return "yes (x86 SHA-NI)";
    }
    #[cfg(target_arch = "aarch64")]
    if std::arch::is_aarch64_feature_detected!("sha2") {
        return "yes (ARMv8 SHA2)";
    }
    "no"
}
