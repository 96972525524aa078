//! With the `cuda` feature: compile zerodp's own CUDA kernels (`kernels/*.cu`) to PTX with nvcc,
//! as candle-kernels does with candle's; the driver compiles the PTX for the GPU at load. Without
//! the feature nothing is built and nvcc is not needed.

use std::path::PathBuf;
use std::process::{exit, Command};

/// Each kernel source and the PTX file `src/model/cuda_*.rs` includes from `OUT_DIR`.
const KERNELS: &[(&str, &str)] = &[
    ("kernels/adam.cu", "adam.ptx"),
    ("kernels/gpt_ops.cu", "gpt_ops.ptx"),
    ("kernels/llama_ops.cu", "llama_ops.ptx"),
];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=NVCC");
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    // The GPU generation PTX is written for: candle's variable (90 for H100 and H200).
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let cap: String = cap.chars().filter(char::is_ascii_digit).collect();
    if cap.is_empty() {
        fail("CUDA_COMPUTE_CAP names no compute capability: set it like 90 (H100, H200) or 80 (A100)");
    }
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    for (source, ptx) in KERNELS {
        let out = out_dir.join(ptx);
        let status = Command::new(&nvcc)
            .args(["--ptx", &format!("-arch=compute_{cap}"), "-O3", "-o"])
            .arg(&out)
            .arg(source)
            .status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => fail(&format!("`{nvcc} --ptx {source}` failed ({s})")),
            Err(e) => fail(&format!(
                "cannot run `{nvcc}` ({e}): the cuda feature compiles kernels/*.cu with nvcc; \
                 scripts/cuda-build.sh installs it (README \"GPUs\"), or set NVCC to its path"
            )),
        }
    }
}

fn fail(message: &str) -> ! {
    eprintln!("error: {message}");
    exit(1)
}
