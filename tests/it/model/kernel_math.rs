//! The per-element math of zerodp's CUDA kernels, compiled for the host and checked here without a
//! GPU. The GPU's fused Adam step (`kernels/adam.cu`) computes each element with
//! `kernels/adam_math.h`. Compiled for the host here (C99, no contraction into fused
//! multiply-adds, as the kernel's correctly rounded intrinsics forbid them on the GPU) and fed the
//! constants through `KernelConsts`, the one mapping from the Rust constants to the C struct, it
//! gives the CPU kernel's bits: for f32 and bf16 moments, AdamW and classic Adam, both forms of
//! the first moment's update, with and without bias correction and gradient scaling. A wrong
//! operation, order or constant in the kernel's formula fails here, without a GPU.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use half::bf16;
use zerodp::optim::adam::{adam_step, AdamParams, KernelConsts, StepConsts};

/// The C driver. `adam` (no argument): reads the constants, `n`, then `n` parameters, gradients
/// and both moments as f32 from stdin; writes the updated parameters and moments. `gelu` and
/// `silu`: read `n` and `n` f32; write each one's GELU (SiLU) and its derivative.
const DRIVER: &str = r#"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "adam_math.h"
#include "gelu_math.h"
#include "silu_math.h"
/* Reads n and n f32; writes f(x) and g(x) for each. */
static int pointwise(float (*f)(float), float (*g)(float)) {
    uint64_t n;
    if (fread(&n, sizeof n, 1, stdin) != 1) return 2;
    for (uint64_t i = 0; i < n; i++) {
        float x;
        if (fread(&x, sizeof x, 1, stdin) != 1) return 3;
        float out[2] = {f(x), g(x)};
        fwrite(out, sizeof(float), 2, stdout);
    }
    return 0;
}
int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "gelu") == 0) return pointwise(zdp_gelu, zdp_gelu_grad);
    if (argc > 1 && strcmp(argv[1], "silu") == 0) return pointwise(zdp_silu, zdp_silu_grad);
    struct zdp_adam_consts c;
    uint64_t n;
    if (fread(&c, sizeof c, 1, stdin) != 1 || fread(&n, sizeof n, 1, stdin) != 1) return 2;
    float *in = malloc(4 * n * sizeof(float));
    if (in == NULL || fread(in, sizeof(float), 4 * n, stdin) != 4 * n) return 3;
    for (uint64_t i = 0; i < n; i++) {
        struct zdp_adam_out o = zdp_adam_element(in[i], in[n + i], in[2 * n + i], in[3 * n + i], &c);
        float out[3] = {o.param, o.m, o.v};
        fwrite(out, sizeof(float), 3, stdout);
    }
    return 0;
}
"#;

/// The driver, compiled once per test binary into cargo's scratch folder for integration tests
/// (under `target/`, so no run leaves a folder in the system's temporary directory); `None`
/// (with the reason printed) where the machine has no C compiler.
fn driver() -> Option<PathBuf> {
    static BUILT: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
                .join(format!("zerodp-kernel-math-{}", std::process::id()));
            std::fs::create_dir_all(&dir).ok()?;
            let source = dir.join("driver.c");
            std::fs::write(&source, DRIVER).ok()?;
            let exe = dir.join("driver");
            let kernels = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
            let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
            let out = Command::new(&cc)
                .args([
                    "-std=c99",
                    "-O2",
                    "-ffp-contract=off",
                    "-fno-fast-math",
                    "-I",
                ])
                .arg(&kernels)
                .arg(&source)
                .arg("-o")
                .arg(&exe)
                .arg("-lm")
                .output();
            match out {
                Ok(o) if o.status.success() => Some(exe),
                Ok(o) => panic!(
                    "{cc} could not compile kernels/adam_math.h, gelu_math.h and silu_math.h:\n{}",
                    String::from_utf8_lossy(&o.stderr)
                ),
                Err(e) => {
                    eprintln!("skipped: no C compiler `{cc}` to build the host driver ({e})");
                    None
                }
            }
        })
        .clone()
}

/// Run the driver with `args` on `input`; its output as f32.
fn run(exe: &Path, args: &[&str], input: Vec<u8>) -> Vec<f32> {
    let mut child = Command::new(exe)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run the driver");
    let mut stdin = child.stdin.take().expect("driver stdin");
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let out = child.wait_with_output().expect("driver output");
    writer.join().expect("writer").expect("write to the driver");
    assert!(out.status.success(), "driver failed: {:?}", out.status);
    bytemuck::pod_collect_to_vec::<u8, f32>(&out.stdout)
}

/// The C formula's updated parameters and moments (unrounded f32).
fn c_step(
    exe: &Path,
    consts: &KernelConsts,
    p: &[f32],
    g: &[f32],
    m: &[f32],
    v: &[f32],
) -> Vec<[f32; 3]> {
    let n = p.len();
    let mut input = bytemuck::bytes_of(consts).to_vec();
    input.extend_from_slice(&(n as u64).to_le_bytes());
    for x in [p, g, m, v] {
        input.extend_from_slice(bytemuck::cast_slice(x));
    }
    let out = run(exe, &[], input);
    assert_eq!(out.len(), 3 * n);
    out.chunks(3).map(|c| [c[0], c[1], c[2]]).collect()
}

/// Deterministic values in `[-scale, scale)`, a few of them zero.
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|i| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (x >> 40) as f32 / (1u64 << 24) as f32;
            if i % 97 == 0 {
                0.0
            } else {
                (2.0 * u - 1.0) * scale
            }
        })
        .collect()
}

struct Case {
    hp: AdamParams,
    step: u64,
    grad_scale: f32,
}

fn cases() -> Vec<Case> {
    let base = AdamParams {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        adam_w_mode: true,
        bias_correction: true,
    };
    let mut out = Vec::new();
    for adam_w_mode in [true, false] {
        // beta1 0.9: `w1 = 0.1`, the low form; beta1 0.3: `w1 = 0.7`, PyTorch's high form.
        for beta1 in [0.9, 0.3] {
            for bias_correction in [true, false] {
                for (step, grad_scale) in [(1, 1.0), (7, 1.0 / 1024.0)] {
                    let hp = AdamParams {
                        adam_w_mode,
                        beta1,
                        bias_correction,
                        ..base
                    };
                    out.push(Case {
                        hp,
                        step,
                        grad_scale,
                    });
                }
            }
        }
    }
    out
}

const N: usize = 4099;

#[test]
fn the_kernels_formula_gives_the_cpu_kernels_bits_with_f32_moments() {
    let Some(exe) = driver() else { return };
    for (k, case) in cases().iter().enumerate() {
        let p0 = values(N, 4 * k as u64, 1.0);
        let g = values(N, 4 * k as u64 + 1, 2.0);
        let m0 = values(N, 4 * k as u64 + 2, 0.1);
        let v0: Vec<f32> = values(N, 4 * k as u64 + 3, 0.1)
            .iter()
            .map(|x| x * x)
            .collect();
        let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
        adam_step::<f32, f32>(
            &mut p,
            &g,
            &mut m,
            &mut v,
            case.step,
            &case.hp,
            case.grad_scale,
        );
        let consts = KernelConsts::new(
            &StepConsts::new(&case.hp, case.step, case.grad_scale),
            false,
        );
        let c = c_step(&exe, &consts, &p0, &g, &m0, &v0);
        for i in 0..N {
            let want = [p[i], m[i], v[i]].map(f32::to_bits);
            assert_eq!(
                c[i].map(f32::to_bits),
                want,
                "case {k} ({:?}, step {}), element {i}",
                case.hp,
                case.step
            );
        }
    }
}

#[test]
fn the_kernels_formula_gives_the_cpu_kernels_bits_with_bf16_moments() {
    let Some(exe) = driver() else { return };
    for (k, case) in cases().iter().enumerate() {
        let p0 = values(N, 8 * k as u64, 1.0);
        let g = values(N, 8 * k as u64 + 1, 2.0);
        let m0: Vec<bf16> = values(N, 8 * k as u64 + 2, 0.1)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        let v0: Vec<bf16> = values(N, 8 * k as u64 + 3, 0.1)
            .iter()
            .map(|x| bf16::from_f32(x * x))
            .collect();
        let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
        adam_step::<f32, bf16>(
            &mut p,
            &g,
            &mut m,
            &mut v,
            case.step,
            &case.hp,
            case.grad_scale,
        );
        let consts =
            KernelConsts::new(&StepConsts::new(&case.hp, case.step, case.grad_scale), true);
        let wide = |x: &[bf16]| x.iter().map(|x| x.to_f32()).collect::<Vec<_>>();
        let c = c_step(&exe, &consts, &p0, &g, &wide(&m0), &wide(&v0));
        for i in 0..N {
            // The kernel rounds the moments to nearest even as it stores them.
            let got = [
                c[i][0].to_bits(),
                bf16::from_f32(c[i][1]).to_bits().into(),
                bf16::from_f32(c[i][2]).to_bits().into(),
            ];
            let want = [p[i].to_bits(), m[i].to_bits().into(), v[i].to_bits().into()];
            assert_eq!(
                got, want,
                "case {k} ({:?}, step {}), element {i}",
                case.hp, case.step
            );
        }
    }
}

#[test]
fn a_changed_constant_changes_the_bits() {
    // The comparison above can fail: the same inputs with another epsilon differ somewhere.
    let Some(exe) = driver() else { return };
    let case = &cases()[0];
    let (p0, g) = (values(N, 1, 1.0), values(N, 2, 2.0));
    let (m0, v0) = (
        values(N, 3, 1e-3),
        values(N, 4, 1e-6).iter().map(|x| x * x).collect::<Vec<_>>(),
    );
    let mut consts = KernelConsts::new(&StepConsts::new(&case.hp, 3, 1.0), false);
    let a = c_step(&exe, &consts, &p0, &g, &m0, &v0);
    consts.eps *= 2.0;
    let b = c_step(&exe, &consts, &p0, &g, &m0, &v0);
    assert!(a
        .iter()
        .zip(&b)
        .any(|(a, b)| a[0].to_bits() != b[0].to_bits()));
}

/// GELU with the tanh approximation and its derivative, in f64 with the exact tanh.
fn gelu_f64(x: f64) -> (f64, f64) {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    let inner = k * (x + 0.044715 * x * x * x);
    let t = inner.tanh();
    let d_inner = k * (1.0 + 3.0 * 0.044715 * x * x);
    (
        0.5 * x * (1.0 + t),
        0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner,
    )
}

#[test]
fn the_gelu_kernels_formula_follows_the_exact_tanh_gelu() {
    // tanh through one exp in f32.
    assert_pointwise_follows("gelu", gelu_f64);
}

/// The driver's `mode` (a function and its derivative in C) on -12..12 in small steps and the
/// saturated ends, each value within 2e-6 of the larger of |want| and 1 of `exact`'s: f32
/// arithmetic, a few ulps.
fn assert_pointwise_follows(mode: &str, exact: fn(f64) -> (f64, f64)) {
    let Some(exe) = driver() else { return };
    let mut xs: Vec<f32> = (-1200..=1200).map(|i| i as f32 / 100.0).collect();
    xs.extend([-100.0, -80.0, -40.0, 40.0, 80.0, 100.0, 1e-6, -1e-6]);
    let mut input = (xs.len() as u64).to_le_bytes().to_vec();
    input.extend_from_slice(bytemuck::cast_slice(&xs));
    let out = run(&exe, &[mode], input);
    assert_eq!(out.len(), 2 * xs.len());
    let close = |got: f32, want: f64| (f64::from(got) - want).abs() <= 2e-6 * want.abs().max(1.0);
    for (x, got) in xs.iter().zip(out.chunks(2)) {
        let (y, dy) = exact(f64::from(*x));
        assert!(
            close(got[0], y),
            "{mode}({x}) = {} in C, {y} exactly",
            got[0]
        );
        assert!(
            close(got[1], dy),
            "{mode}'({x}) = {} in C, {dy} exactly",
            got[1]
        );
    }
}

/// SiLU and its derivative, in f64.
fn silu_f64(x: f64) -> (f64, f64) {
    let s = 1.0 / (1.0 + (-x).exp());
    (x * s, s * (1.0 + x * (1.0 - s)))
}

/// SwiGLU's gate on the GPU (`kernels/silu_math.h`): SiLU and its derivative within a few f32
/// ulps of the exact ones, saturating to 0 (and to x, and 1) at the ends without Inf or NaN.
#[test]
fn the_silu_kernels_formula_follows_the_exact_silu() {
    assert_pointwise_follows("silu", silu_f64);
}
