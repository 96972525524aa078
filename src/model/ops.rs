//! Fused CPU kernels with hand-written backward passes, as candle custom ops (LayerNorm, GELU and
//! the causal softmax also run on a GPU: their `cuda_fwd` and GPU backward are `cuda::gpt_ops`).
//!
//! WHY: candle's autograd turns every primitive op into a graph node whose backward allocates a
//! zero tensor and adds into it, and a LayerNorm, a softmax or the tanh-GELU's backward take 5-20
//! such full-size passes. On the benchmark GPT that overhead was 3-4x the matmul time. Each op
//! here does its forward in one pass and its backward in one or two, so a transformer block is
//! about a dozen graph nodes instead of about fifty.
//!
//! These are *not* candle-nn's fused ops (`softmax_last_dim`, `layer_norm`, `rms_norm`), which have
//! no backward and silently drop gradients: every op below implements `bwd`, and the tests check
//! them against the composite candle path and against finite differences in F64.
//!
//! Ops: [`LayerNorm`], [`Gelu`] (tanh approximation), [`Linear`] (`x @ w^T + b` straight on gemm,
//! torch.nn.Linear's `[out, in]` weight layout), [`CausalAttention`] (the whole multi-head causal
//! attention core, probabilities recomputed in backward) and [`CrossEntropy`].
//!
//! Reductions across rows (the LayerNorm weight and bias gradients, the bias gradient) are summed
//! over a fixed chunking, in chunk order, so results do not depend on the number of threads.

use crate::data::IGNORE_INDEX;
use crate::prefetch::{self, BLOCK};
use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Device, Layout, Result, Shape,
    Storage, Tensor, WithDType,
};
use rayon::prelude::*;

pub(crate) use super::attention::CausalAttention;
pub(super) use super::gemm::Finish;
use super::gemm::{
    gemm_finished, gemm_into, gemm_into_packed, gemm_written, two_products, PackedRhs,
};

/// Rows per parallel task: enough work per task to amortise scheduling, and a fixed split so
/// that cross-row sums are reproducible.
pub(super) const ROWS_PER_TASK: usize = 32;
/// Elements per parallel task for elementwise maps.
const ELEMS_PER_TASK: usize = 16 * 1024;

/// The float types the kernels run in (F32 for training, F64 for gradient checks).
pub(crate) trait Real: WithDType + bytemuck::Pod {
    /// `self * a + b` rounded once (a fused multiply-add: one instruction where the loop is
    /// compiled for AVX2+FMA or AVX-512, a correctly rounded library call otherwise).
    fn mul_add(self, a: Self, b: Self) -> Self;
    /// `e^x`: for f32 a branch-free polynomial that loops vectorise ([`exp_f32`]); for f64 libm's,
    /// so that the gradient checks keep their reference accuracy.
    fn exp(self) -> Self;
    fn sqrt(self) -> Self;
    fn ln(self) -> Self;
}

impl Real for f32 {
    #[inline(always)]
    fn mul_add(self, a: Self, b: Self) -> Self {
        f32::mul_add(self, a, b)
    }
    #[inline(always)]
    fn exp(self) -> Self {
        exp_f32(self)
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    fn ln(self) -> Self {
        f32::ln(self)
    }
}

impl Real for f64 {
    #[inline(always)]
    fn mul_add(self, a: Self, b: Self) -> Self {
        f64::mul_add(self, a, b)
    }
    fn exp(self) -> Self {
        f64::exp(self)
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    fn ln(self) -> Self {
        f64::ln(self)
    }
}

/// `e^x` in f32 without a call or a branch, so that the loops of GELU, the attention softmax and
/// the cross-entropy vectorise (libm's `expf` is a scalar call: GELU's forward spent 4.4 ns per
/// element in it). Cephes' `expf`: `x = n ln2 + r` with `|r| <= ln2 / 2` (n rounded by the
/// 1.5 * 2^23 trick, which needs no SSE4.1 rounding instruction), a degree-6 polynomial for
/// `e^r`, and `2^n` built in the exponent bits. Error within 2 ulp of the true value over the
/// clamped range, measured against f64 in the tests; `x` is clamped to `[-87.3, 88]`, so the
/// result saturates at about 1.2e-38 below and 1.7e38 above instead of reaching 0 and Inf, which
/// every caller here tolerates (tanh saturates, softmax terms are relative to the row maximum
/// and at most 1). NaN gives NaN.
#[inline(always)]
fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23
    let x = x.clamp(-87.3, 88.0);
    let shifted = x * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let er = p * r * r + r + 1.0;
    // n in [-126, 127] after the clamp: the low mantissa bits of `shifted` hold it.
    let n_int = (shifted.to_bits() as i32) - 0x4B40_0000;
    er * f32::from_bits(((n_int + 127) as u32) << 23)
}

pub(super) fn lit<T: Real>(x: f64) -> T {
    T::from_f64(x)
}

/// Runs an element-wise loop compiled for AVX-512 (16 lanes) or AVX2 with FMA (8 lanes) when the
/// CPU has it, else as built (SSE2 on x86-64). `f` is inlined into the wide function, so that its
/// loop is vectorised at that width; a large closure needs `#[inline(always)]` for that (LLVM
/// otherwise leaves it a call, compiled as built: the layer norms ran as SSE2 so). Every build
/// gives the same bits (Rust never contracts `a * b + c` into a fused multiply-add on its own, an
/// explicit [`Real::mul_add`] is one rounding on every path, and the lane sums fix their order in
/// the source).
#[inline(always)]
pub(super) fn wide<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,fma")]
        unsafe fn avx512<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        match Width::of_cpu() {
            // SAFETY: the CPU has AVX-512F and FMA (`Width::of_cpu`).
            Width::Avx512 => return unsafe { avx512(f) },
            // SAFETY: the CPU has AVX2 and FMA (`Width::of_cpu`).
            Width::Avx2 => return unsafe { avx2(f) },
            Width::Baseline => {}
        }
    }
    f()
}

/// The widest build of the kernels this CPU runs: the one choice behind [`wide`] and the
/// attention's per-width functions.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Width {
    /// AVX-512F with FMA.
    Avx512,
    /// AVX2 with FMA.
    Avx2,
    /// As built (SSE2 on x86-64).
    Baseline,
}

#[cfg(target_arch = "x86_64")]
impl Width {
    pub(super) fn of_cpu() -> Width {
        let fma = std::arch::is_x86_feature_detected!("fma");
        use crate::isa::{allows, Isa};
        if std::arch::is_x86_feature_detected!("avx512f") && fma && allows(Isa::Avx512) {
            return Width::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") && fma && allows(Isa::Avx2) {
            return Width::Avx2;
        }
        Width::Baseline
    }
}

/// The contiguous elements of a CPU storage under `layout`.
fn slice_of<'a, T: Real>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&T::cpu_storage_as_slice(s)?[a..b]),
        None => bail!("fused kernel input must be contiguous"),
    }
}

/// Run `f` on the contiguous elements of `t` (no copy when `t` is already contiguous).
pub(super) fn with_slice<T: Real, R>(t: &Tensor, f: impl FnOnce(&[T]) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(cpu) => f(slice_of::<T>(cpu, layout)?),
        _ => bail!("fused kernels run on the CPU only"),
    }
}

fn tensor<T: Real>(data: Vec<T>, shape: impl Into<Shape>) -> Result<Tensor> {
    Tensor::from_vec(data, shape, &Device::Cpu)
}

/// Dispatch a generic kernel body on the dtype of `$dtype`.
macro_rules! by_dtype {
    ($dtype:expr, $name:expr, |$t:ident| $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                $body
            }
            other => bail!("{}: unsupported dtype {other:?}", $name),
        }
    };
}

/// A vector of `len` elements, each written by `fill` into the vector's uninitialised capacity:
/// no zeroing pass for an output that is overwritten whole anyway (on the benchmark GPT the
/// per-op zeroing was about 4% of a rank's time). The vector's length is set after `fill`
/// returns (if it panics, the vector is dropped empty).
///
/// # Safety
/// `fill` writes every element of the slice it is given.
pub(super) unsafe fn written<T: Real>(
    len: usize,
    fill: impl FnOnce(&mut [std::mem::MaybeUninit<T>]),
) -> Vec<T> {
    let mut v: Vec<T> = Vec::with_capacity(len);
    fill(&mut v.spare_capacity_mut()[..len]);
    // SAFETY: `fill` wrote all `len` elements (the caller's contract).
    unsafe { v.set_len(len) };
    v
}

fn storage_dtype(s: &CpuStorage) -> DType {
    s.dtype()
}

/// Sum per-task partial vectors in task order (deterministic).
fn sum_partials<T: Real>(partials: Vec<Vec<T>>, len: usize) -> Vec<T> {
    let mut out = vec![lit::<T>(0.0); len];
    for p in partials {
        out.iter_mut().zip(p).for_each(|(o, x)| *o += x);
    }
    out
}

// ---------------------------------------------------------------------------------------------
// LayerNorm over the last dimension: y = (x - mean) / sqrt(var + eps) * w + b.

pub(crate) struct LayerNorm {
    pub eps: f64,
}

/// Elements summed per lane by [`lane_sum`].
const LANES: usize = 8;

/// The [`LANES`] partial sums combined in one fixed tree (the order every lane sum here uses).
#[inline(always)]
fn fold_lanes<T: Real>(s: &[T; LANES]) -> T {
    ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]))
}

/// `sum f(x)` over `row` in [`LANES`] interleaved partial sums combined in a fixed tree: the
/// loop vectorises (a single running sum cannot, its order is fixed) and the result still
/// depends only on the row, never on threads or the CPU.
#[inline(always)]
pub(super) fn lane_sum<T: Real>(row: &[T], f: impl Fn(T) -> T) -> T {
    let mut acc = [lit::<T>(0.0); LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += f(x);
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(lit::<T>(0.0), |a, &x| a + f(x));
    fold_lanes(&acc) + tail
}

/// The largest element of a non-empty `row`, over [`LANES`] interleaved maxima (exact: the
/// order of a maximum does not matter).
#[inline(always)]
pub(super) fn lane_max<T: Real>(row: &[T]) -> T {
    let max = |a: T, b: T| if b > a { b } else { a };
    let mut acc = [row[0]; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = max(*a, x);
        }
    }
    let m = acc.iter().fold(acc[0], |m, &x| max(m, x));
    chunks.remainder().iter().fold(m, |m, &x| max(m, x))
}

/// `sum a_j b_j` in [`LANES`] interleaved partial sums, combined by [`fold_lanes`].
#[inline(always)]
pub(super) fn lane_dot<T: Real>(a: &[T], b: &[T]) -> T {
    let mut acc = [lit::<T>(0.0); LANES];
    let (mut ca, mut cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    for (x, y) in (&mut ca).zip(&mut cb) {
        for ((s, &x), &y) in acc.iter_mut().zip(x).zip(y) {
            *s += x * y;
        }
    }
    let tail = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .fold(lit::<T>(0.0), |s, (&x, &y)| s + x * y);
    fold_lanes(&acc) + tail
}

/// LayerNorm backward's two row sums, `sum g` and `sum g xhat` with `g = dy w`, in [`LANES`]
/// interleaved partial sums each, combined by [`fold_lanes`].
#[inline(always)]
fn lane_sums_g_gx<T: Real>(dy: &[T], w: &[T], xhat: &[T]) -> (T, T) {
    let (mut sg, mut sgx) = ([lit::<T>(0.0); LANES], [lit::<T>(0.0); LANES]);
    let mut rows = (
        dy.chunks_exact(LANES),
        w.chunks_exact(LANES),
        xhat.chunks_exact(LANES),
    );
    for ((d8, w8), x8) in (&mut rows.0).zip(&mut rows.1).zip(&mut rows.2) {
        let lanes = sg.iter_mut().zip(sgx.iter_mut());
        for ((a, b), ((&d, &w), &x)) in lanes.zip(d8.iter().zip(w8).zip(x8)) {
            let g = d * w;
            *a += g;
            *b += g * x;
        }
    }
    let (mut g_sum, mut gx_sum) = (fold_lanes(&sg), fold_lanes(&sgx));
    let tail = rows.0.remainder().iter().zip(rows.1.remainder());
    for ((&d, &w), &x) in tail.zip(rows.2.remainder()) {
        g_sum += d * w;
        gx_sum += d * w * x;
    }
    (g_sum, gx_sum)
}

#[inline(always)]
fn ln_stats<T: Real>(row: &[T], eps: f64) -> (T, T) {
    let n = lit::<T>(row.len() as f64);
    let mean = lane_sum(row, |x| x) / n;
    let var = lane_sum(row, |x| (x - mean) * (x - mean)) / n;
    (mean, lit::<T>(1.0) / (var + lit(eps)).sqrt())
}

impl LayerNorm {
    pub(super) fn fwd<T: Real>(&self, x: &[T], w: &[T], b: &[T]) -> Result<Vec<T>> {
        let cols = w.len();
        if b.len() != cols {
            bail!(
                "layer norm: weight of {cols} elements but bias of {}",
                b.len()
            );
        }
        let fill = |y: &mut [std::mem::MaybeUninit<T>]| {
            y.par_chunks_mut(cols * ROWS_PER_TASK)
                .zip(x.par_chunks(cols * ROWS_PER_TASK))
                .for_each(|(ys, xs)| {
                    wide(
                        #[inline(always)]
                        || {
                            for (yr, xr) in ys.chunks_mut(cols).zip(xs.chunks(cols)) {
                                let (mean, rstd) = ln_stats(xr, self.eps);
                                for (((y, &x), &w), &b) in yr.iter_mut().zip(xr).zip(w).zip(b) {
                                    y.write((x - mean) * rstd * w + b);
                                }
                            }
                        },
                    )
                })
        };
        // SAFETY: `y`'s chunks and rows pair with `x`'s, of the same lengths, and `w` and `b`
        // are as long as a row: every element is written.
        Ok(unsafe { written(x.len(), fill) })
    }

    pub(super) fn bwd<T: Real>(&self, x: &[T], w: &[T], dy: &[T]) -> (Vec<T>, Vec<T>, Vec<T>) {
        let cols = w.len();
        let n = lit::<T>(cols as f64);
        let mut dx = vec![lit::<T>(0.0); x.len()];
        let partials: Vec<(Vec<T>, Vec<T>)> = dx
            .par_chunks_mut(cols * ROWS_PER_TASK)
            .zip(x.par_chunks(cols * ROWS_PER_TASK))
            .zip(dy.par_chunks(cols * ROWS_PER_TASK))
            .map(|((dxs, xs), dys)| {
                let mut dw = vec![lit::<T>(0.0); cols];
                let mut db = vec![lit::<T>(0.0); cols];
                // Per row: xhat into dx (reused as scratch), the weight and bias gradients, then
                // the two row means and dx itself; every loop element-wise or a lane sum.
                wide(
                    #[inline(always)]
                    || {
                        for ((dxr, xr), dyr) in dxs
                            .chunks_mut(cols)
                            .zip(xs.chunks(cols))
                            .zip(dys.chunks(cols))
                        {
                            let (mean, rstd) = ln_stats(xr, self.eps);
                            for (xhat, &x) in dxr.iter_mut().zip(xr) {
                                *xhat = (x - mean) * rstd;
                            }
                            for (((dw, db), &g), &xhat) in
                                dw.iter_mut().zip(&mut db).zip(dyr).zip(&*dxr)
                            {
                                *dw += g * xhat;
                                *db += g;
                            }
                            let (sum_g, sum_gx) = lane_sums_g_gx(dyr, w, dxr);
                            let (mean_g, mean_gx) = (sum_g / n, sum_gx / n);
                            for ((dx, &g), &w) in dxr.iter_mut().zip(dyr).zip(w) {
                                let xhat = *dx;
                                *dx = rstd * (g * w - mean_g - xhat * mean_gx);
                            }
                        }
                    },
                );
                (dw, db)
            })
            .collect();
        let (dws, dbs): (Vec<_>, Vec<_>) = partials.into_iter().unzip();
        (dx, sum_partials(dws, cols), sum_partials(dbs, cols))
    }
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "zerodp-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        by_dtype!(storage_dtype(s1), self.name(), |T| {
            let (x, w, b) = (
                slice_of::<T>(s1, l1)?,
                slice_of::<T>(s2, l2)?,
                slice_of::<T>(s3, l3)?,
            );
            if w.is_empty() || x.len() % w.len() != 0 || b.len() != w.len() {
                bail!(
                    "layer norm: bad shapes {:?} {:?} {:?}",
                    l1.shape(),
                    l2.shape(),
                    l3.shape()
                );
            }
            Ok((
                T::to_cpu_storage_owned(self.fwd(x, w, b)?),
                l1.shape().clone(),
            ))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::gpt_ops::layer_norm_fwd((s1, l1), (s2, l2), (s3, l3), self.eps)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            let (dx, dw, db) = super::cuda::gpt_ops::layer_norm_bwd(x, w, dy, self.eps)?;
            return Ok((Some(dx), Some(dw), Some(db)));
        }
        by_dtype!(x.dtype(), self.name(), |T| {
            let (dx, dw, db) = with_slice::<T, _>(x, |x| {
                with_slice::<T, _>(w, |w| with_slice::<T, _>(dy, |dy| Ok(self.bwd(x, w, dy))))
            })?;
            Ok((
                Some(tensor(dx, x.shape())?),
                Some(tensor(dw, w.shape())?),
                Some(tensor(db, w.shape())?),
            ))
        })
    }
}

// ---------------------------------------------------------------------------------------------
// GELU, tanh approximation (GPT-2): y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).

pub(crate) struct Gelu;

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const GELU_C: f64 = 0.044_715;

/// tanh through one `exp`: `1 - 2 / (1 + e^(2u))`, which saturates correctly at both ends
/// (e^(2u) = inf gives 1, e^(2u) = 0 gives -1). About 2x faster than libm's `tanhf`; its absolute
/// error (a few ulps of 1) is what matters inside GELU's `1 + tanh`.
#[inline(always)]
fn fast_tanh<T: Real>(u: T) -> T {
    lit::<T>(1.0) - lit::<T>(2.0) / (lit::<T>(1.0) + (u + u).exp())
}

#[inline(always)]
fn gelu<T: Real>(x: T) -> T {
    let inner = lit::<T>(SQRT_2_OVER_PI) * (x + lit::<T>(GELU_C) * x * x * x);
    lit::<T>(0.5) * x * (lit::<T>(1.0) + fast_tanh(inner))
}

#[inline(always)]
fn gelu_grad<T: Real>(x: T) -> T {
    let inner = lit::<T>(SQRT_2_OVER_PI) * (x + lit::<T>(GELU_C) * x * x * x);
    let t = fast_tanh(inner);
    let d_inner = lit::<T>(SQRT_2_OVER_PI) * (lit::<T>(1.0) + lit::<T>(3.0 * GELU_C) * x * x);
    lit::<T>(0.5) * (lit::<T>(1.0) + t) + lit::<T>(0.5) * x * (lit::<T>(1.0) - t * t) * d_inner
}

/// The GELU's passes stream `[rows, 4c]` activations that backward reads long after forward wrote
/// them (and forward reads the `c_fc` output a layer's worth of data after): they ask for their
/// inputs' lines ahead ([`crate::prefetch`]), which took the 25M GPT's forward from 2.5-2.7 to
/// 1.6-1.9 ms and its backward about 0.7 ms faster (`zerodp bench ops`, caches evicted before
/// each call). The layer norms' rows, asked for two rows ahead, gained nothing.
impl Gelu {
    pub(super) fn fwd<T: Real>(x: &[T]) -> Vec<T> {
        let fill = |y: &mut [std::mem::MaybeUninit<T>]| {
            y.par_chunks_mut(ELEMS_PER_TASK)
                .zip(x.par_chunks(ELEMS_PER_TASK))
                .for_each(|(ys, xs)| {
                    wide(
                        #[inline(always)]
                        || {
                            for (ys, xs) in ys.chunks_mut(BLOCK).zip(xs.chunks(BLOCK)) {
                                prefetch::block_ahead(xs);
                                for (y, &x) in ys.iter_mut().zip(xs) {
                                    y.write(gelu(x));
                                }
                            }
                        },
                    )
                })
        };
        // SAFETY: `y`'s chunks pair with `x`'s, of the same lengths: every element is written.
        unsafe { written(x.len(), fill) }
    }

    pub(super) fn bwd<T: Real>(x: &[T], dy: &[T]) -> Result<Vec<T>> {
        if x.len() != dy.len() {
            bail!(
                "gelu backward: input of {} elements, gradient of {}",
                x.len(),
                dy.len()
            );
        }
        let fill = |dx: &mut [std::mem::MaybeUninit<T>]| {
            dx.par_chunks_mut(ELEMS_PER_TASK)
                .zip(x.par_chunks(ELEMS_PER_TASK))
                .zip(dy.par_chunks(ELEMS_PER_TASK))
                .for_each(|((d, xs), gs)| {
                    wide(
                        #[inline(always)]
                        || {
                            let blocks = d.chunks_mut(BLOCK).zip(xs.chunks(BLOCK));
                            for ((d, xs), gs) in blocks.zip(gs.chunks(BLOCK)) {
                                prefetch::block_ahead(xs);
                                prefetch::block_ahead(gs);
                                for ((d, &x), &g) in d.iter_mut().zip(xs).zip(gs) {
                                    d.write(g * gelu_grad(x));
                                }
                            }
                        },
                    )
                })
        };
        // SAFETY: as in `fwd`, `dy` as long as `x` (checked): every element is written.
        Ok(unsafe { written(x.len(), fill) })
    }
}

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "zerodp-gelu-tanh"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        by_dtype!(storage_dtype(s), self.name(), |T| {
            let y = Self::fwd(slice_of::<T>(s, l)?);
            Ok((T::to_cpu_storage_owned(y), l.shape().clone()))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::gpt_ops::gelu_fwd(s, l)
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return Ok(Some(super::cuda::gpt_ops::gelu_bwd(x, dy)?));
        }
        by_dtype!(x.dtype(), self.name(), |T| {
            let dx = with_slice::<T, _>(x, |x| with_slice::<T, _>(dy, |dy| Self::bwd(x, dy)))?;
            Ok(Some(tensor(dx, x.shape())?))
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Causal softmax of attention scores `[.., t, t]`: row `r` is query position `r % t`, which sees
// keys `0..=r % t`; the others get probability 0 (the additive -inf mask's result). The GPU's
// attention uses it between candle's batched matmuls (`kernels/gpt_ops.cu`); the CPU's
// implementation below is the reference its semantics are tested on.

pub(crate) struct CausalSoftmax;

/// The rows and row length `t` of attention scores of shape `[.., t, t]`, or an error naming it.
pub(super) fn causal_rows(shape: &Shape) -> Result<(usize, usize)> {
    match shape.dims() {
        [.., q, t] if q == t && *t > 0 && *t <= i32::MAX as usize => {
            Ok((shape.elem_count() / t, *t))
        }
        _ => bail!("causal softmax: scores of shape {shape:?} are not [.., t, t]"),
    }
}

impl CausalSoftmax {
    pub(super) fn fwd<T: Real>(x: &[T], t: usize) -> Vec<T> {
        let mut y = vec![lit::<T>(0.0); x.len()];
        y.par_chunks_mut(t * ROWS_PER_TASK)
            .zip(x.par_chunks(t * ROWS_PER_TASK))
            .enumerate()
            .for_each(|(task, (ys, xs))| {
                for (k, (yr, xr)) in ys.chunks_mut(t).zip(xs.chunks(t)).enumerate() {
                    let seen = (task * ROWS_PER_TASK + k) % t + 1;
                    let max = lane_max(&xr[..seen]);
                    let sum = lane_sum(&xr[..seen], |v| (v - max).exp());
                    for (y, &v) in yr[..seen].iter_mut().zip(&xr[..seen]) {
                        *y = (v - max).exp() / sum;
                    }
                }
            });
        y
    }
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "zerodp-causal-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, t) = causal_rows(l.shape())?;
        by_dtype!(storage_dtype(s), self.name(), |T| {
            let y = Self::fwd(slice_of::<T>(s, l)?, t);
            Ok((T::to_cpu_storage_owned(y), l.shape().clone()))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::gpt_ops::causal_softmax_fwd(s, l)
    }

    /// `y (dy - sum(y dy))` per row: one kernel on a GPU, candle's ops elsewhere.
    fn bwd(&self, _x: &Tensor, y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if y.device().is_cuda() {
            return Ok(Some(super::cuda::gpt_ops::softmax_bwd(y, dy)?));
        }
        let dot = (y * dy)?.sum_keepdim(candle_core::D::Minus1)?;
        Ok(Some((dy.broadcast_sub(&dot)? * y)?))
    }
}

// ---------------------------------------------------------------------------------------------
// Linear layer: y = x @ w^T + b for x [n, in], w [out, in] (torch.nn.Linear layout), b [out].
// One graph node instead of candle's three (transpose, matmul, broadcast add), and the weight
// gradient comes out contiguous in [out, in] order.

pub(crate) struct Linear;

/// Part `i` of `0..len` cut into `parts` ranges that differ in length by at most one.
pub(super) fn even_split(len: usize, parts: usize, i: usize) -> std::ops::Range<usize> {
    let (base, extra) = (len / parts, len % parts);
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

/// `dst += src` element by element over the pool (the same bits at any thread count).
pub(super) fn par_add_into(dst: &mut [f32], src: &[f32]) {
    dst.par_chunks_mut(ELEMS_PER_TASK)
        .zip(src.par_chunks(ELEMS_PER_TASK))
        .for_each(|(d, s)| wide(|| d.iter_mut().zip(s).for_each(|(d, &s)| *d += s)));
}

/// A copy of `src` made over the pool: a block's parameters (12c² floats) copied by one thread
/// took a 16-thread rank's step as long as a layer norm.
pub(super) fn par_copy<T: Real>(src: &[T]) -> Vec<T> {
    let fill = |dst: &mut [std::mem::MaybeUninit<T>]| {
        dst.par_chunks_mut(ELEMS_PER_TASK)
            .zip(src.par_chunks(ELEMS_PER_TASK))
            .for_each(|(d, s)| {
                d.iter_mut().zip(s).for_each(|(d, &s)| {
                    d.write(s);
                })
            })
    };
    // SAFETY: the chunks of `dst` pair with those of `src`, of the same lengths: every element
    // is written.
    unsafe { written(src.len(), fill) }
}

impl Linear {
    /// `x @ w^T + b`: the product, then the bias on top (as [`Finish::Bias`]).
    pub(super) fn fwd<T: Real>(x: &[T], w: &[T], b: &[T]) -> Result<Vec<T>> {
        Self::fwd_finished(x, w, &Finish::Bias(b))
    }

    /// `x @ w^T` with `finish` (the bias and whatever follows it) applied as each block of the
    /// product is written: no separate pass over the output. Same bits as the unfused ops.
    pub(super) fn fwd_finished<T: Real>(
        x: &[T],
        w: &[T],
        finish: &Finish<'_, T>,
    ) -> Result<Vec<T>> {
        let out = finish.columns();
        let inp = w.len() / out.max(1);
        if out == 0 || inp == 0 || w.len() != out * inp || x.len() % inp != 0 {
            bail!("linear: bad sizes x {} w {} b {out}", x.len(), w.len());
        }
        let n = x.len() / inp;
        finish.check(n)?;
        Ok(gemm_finished(
            (n, out, inp),
            (x, (inp, 1)),
            (w, (1, inp)),
            finish,
        ))
    }

    pub(super) fn bwd<T: Real>(x: &[T], w: &[T], dy: &[T], out: usize) -> (Vec<T>, Vec<T>, Vec<T>) {
        let inp = w.len() / out;
        let n = x.len() / inp;
        // dx [n, in] = dy [n, out] @ w [out, in]; dw [out, in] = dy^T [out, n] @ x [n, in]:
        // independent, so side by side on a large pool ([`two_products`]).
        let ((dx, dw), db) = rayon::join(
            || {
                two_products(
                    || gemm_written((n, inp, out), (dy, (out, 1)), (w, (inp, 1))),
                    || gemm_written((out, inp, n), (dy, (1, out)), (x, (inp, 1))),
                )
            },
            || Self::bias_grad(dy, out),
        );
        (dx, dw, db)
    }

    /// [`Linear::bwd`] with the weight gradient added into `dw` (`[out, in]`) by the GEMM
    /// itself: no temporary the size of the weight and no separate pass to add it in (the
    /// block's backward accumulates into its flat gradient). Returns `dx` and `db`.
    pub(super) fn bwd_into(
        x: &[f32],
        w: &[f32],
        dy: &[f32],
        out: usize,
        dw: &mut [f32],
    ) -> (Vec<f32>, Vec<f32>) {
        let inp = w.len() / out;
        let n = x.len() / inp;
        // The input gradient, the weight gradient and the bias gradient read the same operands
        // and write different outputs: the bias gradient beside the products, and the products
        // side by side on a large pool ([`two_products`]), where each product's tasks fill the
        // threads the other leaves idle. Each is the same arithmetic as alone.
        let ((dx, ()), db) = rayon::join(
            || {
                two_products(
                    || gemm_written((n, inp, out), (dy, (out, 1)), (w, (inp, 1))),
                    || gemm_into((out, inp, n), dw, true, dy, (1, out), x, (inp, 1)),
                )
            },
            || Self::bias_grad(dy, out),
        );
        (dx, db)
    }

    /// db [out] = column sums of dy, over a fixed row split summed in order.
    fn bias_grad<T: Real>(dy: &[T], out: usize) -> Vec<T> {
        let partials: Vec<Vec<T>> = dy
            .par_chunks(out * ROWS_PER_TASK)
            .map(|rows| {
                let mut acc = vec![lit::<T>(0.0); out];
                wide(|| {
                    for r in rows.chunks(out) {
                        acc.iter_mut().zip(r).for_each(|(a, &g)| *a += g);
                    }
                });
                acc
            })
            .collect();
        sum_partials(partials, out)
    }
}

impl CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        "zerodp-linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, _) = l1.shape().dims2()?;
        let (out, _) = l2.shape().dims2()?;
        by_dtype!(storage_dtype(s1), self.name(), |T| {
            let (x, w, b) = (
                slice_of::<T>(s1, l1)?,
                slice_of::<T>(s2, l2)?,
                slice_of::<T>(s3, l3)?,
            );
            let y = Self::fwd(x, w, b)?;
            Ok((T::to_cpu_storage_owned(y), Shape::from((n, out))))
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let out = b.elem_count();
        by_dtype!(x.dtype(), self.name(), |T| {
            let (dx, dw, db) = with_slice::<T, _>(x, |x| {
                with_slice::<T, _>(w, |w| {
                    with_slice::<T, _>(dy, |dy| Ok(Self::bwd(x, w, dy, out)))
                })
            })?;
            Ok((
                Some(tensor(dx, x.shape())?),
                Some(tensor(dw, w.shape())?),
                Some(tensor(db, b.shape())?),
            ))
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Token plus position embeddings: y[i] = wte[tokens[i]] + wpe[i % seq] for wte [vocab, c],
// wpe [positions, c]. One graph node whose backward runs on the pool: candle's index_select
// backward (an index_add) and its broadcast add's sum ran on one thread (6 ms of a 16-thread
// rank's step).

pub(crate) struct Embedding {
    /// The token ids of `rows` rows, row `i` at position `i % seq`.
    pub tokens: Vec<u32>,
    pub seq: usize,
    /// Packed rows: each row's position in its sequence (`TokenBatch::positions`), instead of
    /// `i % seq`.
    pub positions: Option<Vec<u32>>,
}

/// Columns of the embedding tables per backward task: every task reads all rows' slice of them.
const EMBED_COLS_PER_TASK: usize = 16;

impl Embedding {
    fn check(&self, (vocab, positions): (usize, usize)) -> Result<()> {
        if self.seq == 0 || self.seq > positions || self.tokens.len() % self.seq != 0 {
            bail!(
                "embedding: {} tokens in sequences of {} against {positions} positions",
                self.tokens.len(),
                self.seq
            );
        }
        if let Some(&bad) = self.tokens.iter().find(|&&t| t as usize >= vocab) {
            bail!("embedding: token id {bad} outside the vocabulary of {vocab}");
        }
        if let Some(p) = &self.positions {
            if p.len() != self.tokens.len() || p.iter().any(|&x| x as usize >= self.seq) {
                bail!(
                    "embedding: positions do not fit {} tokens in sequences of {}",
                    self.tokens.len(),
                    self.seq
                );
            }
        }
        Ok(())
    }

    /// Row `i`'s position.
    #[inline(always)]
    fn position(&self, i: usize) -> usize {
        match &self.positions {
            Some(p) => p[i] as usize,
            None => i % self.seq,
        }
    }

    fn fwd<T: Real>(&self, wte: &[T], wpe: &[T], c: usize) -> Vec<T> {
        let fill = |y: &mut [std::mem::MaybeUninit<T>]| {
            y.par_chunks_mut(c).enumerate().for_each(|(i, row)| {
                let tok = &wte[self.tokens[i] as usize * c..][..c];
                let pos = &wpe[self.position(i) * c..][..c];
                for ((y, &a), &b) in row.iter_mut().zip(tok).zip(pos) {
                    y.write(a + b);
                }
            })
        };
        // SAFETY: one row of c per token, each written whole.
        unsafe { written(self.tokens.len() * c, fill) }
    }

    /// `dwte` (rows added in row order per element, as an index_add over zeros) and `dwpe` (per
    /// position, the sequences' rows added in order; positions past `seq` zero).
    fn bwd<T: Real>(
        &self,
        dy: &[T],
        (vocab, positions, c): (usize, usize, usize),
    ) -> (Vec<T>, Vec<T>) {
        let zero = lit::<T>(0.0);
        let mut dwte = vec![zero; vocab * c];
        let cols: Vec<usize> = (0..c).step_by(EMBED_COLS_PER_TASK).collect();
        let out = SharedCols(dwte.as_mut_ptr());
        cols.par_iter().for_each(|&j0| {
            let j1 = (j0 + EMBED_COLS_PER_TASK).min(c);
            for (i, &tok) in self.tokens.iter().enumerate() {
                let src = &dy[i * c + j0..i * c + j1];
                // SAFETY: this task alone writes columns j0..j1 of every row of dwte, inside
                // its vocab x c elements (tokens were checked against vocab).
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(out.at(tok as usize * c + j0), j1 - j0)
                };
                dst.iter_mut().zip(src).for_each(|(d, &g)| *d += g);
            }
        });
        let mut dwpe = vec![zero; positions * c];
        if self.positions.is_some() {
            // Packed rows: positions repeat within a row, so tasks split the columns instead.
            let out = SharedCols(dwpe.as_mut_ptr());
            cols.par_iter().for_each(|&j0| {
                let j1 = (j0 + EMBED_COLS_PER_TASK).min(c);
                for i in 0..self.tokens.len() {
                    let src = &dy[i * c + j0..i * c + j1];
                    // SAFETY: this task alone writes columns j0..j1 of every row of dwpe, inside
                    // its positions x c elements (positions were checked against seq).
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(out.at(self.position(i) * c + j0), j1 - j0)
                    };
                    dst.iter_mut().zip(src).for_each(|(d, &g)| *d += g);
                }
            });
            return (dwte, dwpe);
        }
        let seqs = self.tokens.len() / self.seq;
        dwpe[..self.seq * c]
            .par_chunks_mut(c)
            .enumerate()
            .for_each(|(p, row)| {
                for s in 0..seqs {
                    let g = &dy[(s * self.seq + p) * c..][..c];
                    row.iter_mut().zip(g).for_each(|(d, &g)| *d += g);
                }
            });
        (dwte, dwpe)
    }
}

/// The base of a buffer whose column ranges tasks write (see [`Embedding::bwd`]).
struct SharedCols<T>(*mut T);

impl<T> SharedCols<T> {
    /// The address of element `i` (a method, so that closures capture the Sync wrapper).
    fn at(&self, i: usize) -> *mut T {
        self.0.wrapping_add(i)
    }
}
// SAFETY: tasks write disjoint columns of the buffer, which outlives the parallel loop.
unsafe impl<T: Send> Send for SharedCols<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SharedCols<T> {}

impl CustomOp2 for Embedding {
    fn name(&self) -> &'static str {
        "zerodp-embedding"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (vocab, c) = l1.shape().dims2()?;
        let (positions, c2) = l2.shape().dims2()?;
        if c2 != c {
            bail!("embedding: token table width {c}, position table width {c2}");
        }
        self.check((vocab, positions))?;
        by_dtype!(storage_dtype(s1), self.name(), |T| {
            let y = self.fwd(slice_of::<T>(s1, l1)?, slice_of::<T>(s2, l2)?, c);
            Ok((
                T::to_cpu_storage_owned(y),
                Shape::from((self.tokens.len(), c)),
            ))
        })
    }

    fn bwd(
        &self,
        wte: &Tensor,
        wpe: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (vocab, c) = wte.dims2()?;
        let positions = wpe.dims2()?.0;
        by_dtype!(wte.dtype(), self.name(), |T| {
            let (dwte, dwpe) =
                with_slice::<T, _>(dy, |dy| Ok(self.bwd(dy, (vocab, positions, c))))?;
            Ok((
                Some(tensor(dwte, (vocab, c))?),
                Some(tensor(dwpe, (positions, c))?),
            ))
        })
    }
}

// ---------------------------------------------------------------------------------------------
// The causal attention core's candle op (its kernels are in `super::attention`).

impl CustomOp1 for CausalAttention {
    fn name(&self) -> &'static str {
        "zerodp-causal-attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (rows, cols3) = l.shape().dims2()?;
        if rows != self.batch * self.seq {
            bail!("attention: {rows} rows for {} x {}", self.batch, self.seq);
        }
        by_dtype!(storage_dtype(s), self.name(), |T| {
            let y = self.forward(slice_of::<T>(s, l)?, cols3)?;
            let cols = y.len() / rows.max(1);
            Ok((T::to_cpu_storage_owned(y), Shape::from((rows, cols))))
        })
    }

    fn bwd(&self, qkv: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let (_, cols3) = qkv.dims2()?;
        by_dtype!(qkv.dtype(), self.name(), |T| {
            let d = with_slice::<T, _>(qkv, |x| {
                with_slice::<T, _>(dy, |g| self.backward(x, g, cols3))
            })?;
            Ok(Some(tensor(d, qkv.shape())?))
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Mean cross-entropy of logits [n, vocab] against u32 targets [n] -> scalar.

pub(crate) struct CrossEntropy;

impl CrossEntropy {
    /// Per row: the log-sum-exp of the logits, its sum in [`LANES`] interleaved partial sums
    /// (vectorised; a single running sum over a 32k-50k vocabulary row cannot be, and was 5% of
    /// a Llama's step).
    fn lse<T: Real>(row: &[T]) -> T {
        wide(
            #[inline(always)]
            || {
                let max = lane_max(row);
                max + lane_sum(row, |x| (x - max).exp()).ln()
            },
        )
    }

    /// The summed loss of `logits` (rows of `v`) against `targets`: a partial sum per task of
    /// [`ROWS_PER_TASK`] rows, the partials added in task order (the same value at every thread
    /// count).
    /// Rows whose target is [`IGNORE_INDEX`] add nothing.
    fn loss_sum<T: Real>(logits: &[T], targets: &[u32], v: usize) -> f64 {
        let partials: Vec<f64> = logits
            .par_chunks(v * ROWS_PER_TASK)
            .zip(targets.par_chunks(ROWS_PER_TASK))
            .map(|(rows, ts)| {
                rows.chunks(v)
                    .zip(ts)
                    .filter(|(_, &t)| t != IGNORE_INDEX)
                    .map(|(row, &t)| (Self::lse(row) - row[t as usize]).to_f64())
                    .sum::<f64>()
            })
            .collect();
        partials.iter().sum()
    }

    /// The targets a mean is over: those not [`IGNORE_INDEX`] (at least 1, so that a batch
    /// with none has loss and gradient 0).
    pub(crate) fn trained(targets: &[u32]) -> usize {
        targets
            .iter()
            .filter(|&&t| t != IGNORE_INDEX)
            .count()
            .max(1)
    }

    /// Refuses a target past the vocabulary ([`IGNORE_INDEX`] is no target).
    fn check_targets(what: &str, targets: &[u32], v: usize) -> Result<()> {
        let bad = targets
            .iter()
            .find(|&&t| t as usize >= v && t != IGNORE_INDEX);
        if let Some(&bad) = bad {
            bail!("{what}: target {bad} outside the vocabulary of {v}");
        }
        Ok(())
    }

    /// The logits in `d` (rows of `v`) replaced by their gradient `(softmax - onehot) * scale`.
    fn grad_in_place<T: Real>(d: &mut [T], targets: &[u32], v: usize, scale: T) {
        d.par_chunks_mut(v * ROWS_PER_TASK)
            .zip(targets.par_chunks(ROWS_PER_TASK))
            .for_each(|(ds, ts)| {
                for (dr, &t) in ds.chunks_mut(v).zip(ts) {
                    if t == IGNORE_INDEX {
                        dr.fill(lit::<T>(0.0));
                        continue;
                    }
                    let lse = Self::lse(dr);
                    dr.iter_mut().for_each(|x| *x = (*x - lse).exp() * scale);
                    dr[t as usize] -= scale;
                }
            });
    }
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "zerodp-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, v) = l1.shape().dims2()?;
        let targets = slice_of_u32(s2, l2)?;
        if targets.len() != n {
            bail!("cross entropy: {n} rows, {} targets", targets.len());
        }
        Self::check_targets("cross entropy", targets, v)?;
        by_dtype!(storage_dtype(s1), self.name(), |T| {
            let total = Self::loss_sum(slice_of::<T>(s1, l1)?, targets, v);
            let mean = total / Self::trained(targets) as f64;
            Ok((
                T::to_cpu_storage_owned(vec![T::from_f64(mean)]),
                Shape::from(()),
            ))
        })
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _loss: &Tensor,
        dloss: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (n, v) = logits.dims2()?;
        let targets = targets.to_vec1::<u32>()?;
        let g = dloss.to_dtype(DType::F64)?.to_scalar::<f64>()? / Self::trained(&targets) as f64;
        let d = by_dtype!(logits.dtype(), self.name(), |T| {
            with_slice::<T, _>(logits, |x| {
                let mut d = x.to_vec();
                Self::grad_in_place(&mut d, &targets, v, lit::<T>(g));
                tensor(d, (n, v))
            })?
        });
        Ok((Some(d), None))
    }
}

// ---------------------------------------------------------------------------------------------
// The LM head and its loss fused over chunks of rows: mean cross-entropy of `h [n, c] @ wte^T`
// against u32 targets, without the `[n, vocab]` logits. At vocabulary 50257 a micro-batch of
// 8 x 1024 tokens has 1.6 GB of f32 logits (and as much again for their gradient); here one
// chunk of rows (about [`crate::limits::LM_HEAD_CHUNK_BYTES`]) is alive at a time, forward and backward, and the
// backward recomputes each chunk's logits instead of keeping them.

pub(crate) struct HeadLoss {
    pub targets: Vec<u32>,
}

impl HeadLoss {
    /// Rows per chunk for a vocabulary of `v` ([`crate::limits::lm_head_chunk_rows`], which the
    /// planner counts too): a whole number of [`ROWS_PER_TASK`], so that the loss sums in the
    /// same row groups as [`CrossEntropy`]'s.
    fn chunk_rows(v: usize) -> usize {
        const _: () = assert!(ROWS_PER_TASK == 32);
        crate::limits::lm_head_chunk_rows(v as u64) as usize
    }

    fn check(&self, n: usize, v: usize) -> Result<()> {
        if self.targets.len() != n {
            bail!("lm head loss: {n} rows, {} targets", self.targets.len());
        }
        CrossEntropy::check_targets("lm head loss", &self.targets, v)
    }

    /// One chunk's logits `h[rows] @ wte^T` into `logits` (rows x v), `wte_t` the token table
    /// as the right operand `[c, v]`, packed once for every chunk.
    fn logits<T: Real>(h: &[T], wte_t: &PackedRhs<'_, T>, c: usize, logits: &mut [T]) {
        gemm_into_packed(h.len() / c, logits, false, (h, (c, 1)), wte_t);
    }

    fn fwd<T: Real>(&self, h: &[T], wte: &[T], c: usize) -> f64 {
        let v = wte.len() / c;
        let rows = Self::chunk_rows(v);
        let wte_t = PackedRhs::new((c, v), (wte, (1, c)));
        let mut logits = vec![lit::<T>(0.0); rows.min(self.targets.len()) * v];
        let mut total = 0f64;
        for (hs, ts) in h.chunks(rows * c).zip(self.targets.chunks(rows)) {
            let x = &mut logits[..ts.len() * v];
            Self::logits(hs, &wte_t, c, x);
            total += CrossEntropy::loss_sum(x, ts, v);
        }
        total / CrossEntropy::trained(&self.targets) as f64
    }

    /// `(dh, dwte)` for a loss gradient `g` (d loss / d mean): per chunk, the logits again, their
    /// gradient `(softmax - onehot) g / n` in place, then `dh = d @ wte` and `dwte += d^T @ h`.
    fn bwd<T: Real>(&self, h: &[T], wte: &[T], c: usize, g: f64) -> (Vec<T>, Vec<T>) {
        let v = wte.len() / c;
        let n = self.targets.len();
        let rows = Self::chunk_rows(v);
        let scale = lit::<T>(g / CrossEntropy::trained(&self.targets) as f64);
        let mut logits = vec![lit::<T>(0.0); rows.min(n) * v];
        let mut dh = vec![lit::<T>(0.0); h.len()];
        let mut dwte = vec![lit::<T>(0.0); wte.len()];
        // Both layouts of the table, packed once for all the chunks.
        let (wte_t, wte_rows) = rayon::join(
            || PackedRhs::new((c, v), (wte, (1, c))),
            || PackedRhs::new((v, c), (wte, (c, 1))),
        );
        let chunks = h.chunks(rows * c).zip(self.targets.chunks(rows));
        for ((hs, ts), dhs) in chunks.zip(dh.chunks_mut(rows * c)) {
            let d = &mut logits[..ts.len() * v];
            Self::logits(hs, &wte_t, c, d);
            CrossEntropy::grad_in_place(d, ts, v, scale);
            let r = ts.len();
            gemm_into_packed(r, dhs, false, (d, (v, 1)), &wte_rows);
            gemm_into((v, c, r), &mut dwte, true, d, (1, v), hs, (c, 1));
        }
        (dh, dwte)
    }
}

impl CustomOp2 for HeadLoss {
    fn name(&self) -> &'static str {
        "zerodp-lm-head-loss"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, c) = l1.shape().dims2()?;
        let (v, c2) = l2.shape().dims2()?;
        if c2 != c || v == 0 || c == 0 {
            bail!("lm head loss: hidden [{n}, {c}] against a token table [{v}, {c2}]");
        }
        self.check(n, v)?;
        by_dtype!(storage_dtype(s1), self.name(), |T| {
            let loss = self.fwd(slice_of::<T>(s1, l1)?, slice_of::<T>(s2, l2)?, c);
            Ok((
                T::to_cpu_storage_owned(vec![T::from_f64(loss)]),
                Shape::from(()),
            ))
        })
    }

    fn bwd(
        &self,
        h: &Tensor,
        wte: &Tensor,
        _loss: &Tensor,
        dloss: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let c = h.dims2()?.1;
        let g = dloss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        by_dtype!(h.dtype(), self.name(), |T| {
            let (dh, dwte) =
                with_slice::<T, _>(h, |h| with_slice::<T, _>(wte, |w| Ok(self.bwd(h, w, c, g))))?;
            Ok((
                Some(tensor(dh, h.shape())?),
                Some(tensor(dwte, wte.shape())?),
            ))
        })
    }
}

fn slice_of_u32<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [u32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::U32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => bail!("cross entropy targets must be a contiguous u32 tensor"),
    }
}

#[cfg(test)]
mod tests {
    use super::{exp_f32, gelu, gelu_grad, lane_sum, wide, Embedding, Finish, Linear};
    use candle_core::{Device, Tensor};

    /// The distance between `y` and the next f32 away from zero.
    fn ulp(y: f32) -> f64 {
        let next = f32::from_bits(y.abs().to_bits() + 1);
        f64::from(next) - f64::from(y.abs())
    }

    #[test]
    fn exp_f32_is_within_two_ulp_of_the_exact_value() {
        let mut worst = 0f64;
        let mut i = 0;
        loop {
            let x = -87.0f32 + i as f32 * 1e-3;
            if x > 88.0 {
                break;
            }
            let want = f64::from(x).exp();
            let err = (f64::from(exp_f32(x)) - want).abs() / ulp(want as f32);
            worst = worst.max(err);
            i += 1;
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
        assert_eq!(exp_f32(0.0), 1.0);
    }

    /// The element-wise loops give the same bits at every vector width `wide` picks (AVX-512,
    /// AVX2) as one element at a time in the baseline build: GELU and its gradient (through
    /// `exp_f32`), and the fixed-order lane sums.
    #[test]
    fn wide_loops_equal_the_scalar_baseline_bit_for_bit() {
        #[inline(never)]
        fn scalar(x: &[f32]) -> (Vec<u32>, Vec<u32>, u32) {
            let y = x.iter().map(|&v| gelu(v).to_bits()).collect();
            let g = x.iter().map(|&v| gelu_grad(v).to_bits()).collect();
            (y, g, lane_sum(x, |v| v * v).to_bits())
        }
        let x: Vec<f32> = (0..10_007)
            .map(|i| ((i as f32) * 0.618_034).sin() * 9.0 - (i % 7) as f32)
            .collect();
        let wide_out = wide(
            #[inline(always)]
            || {
                let y: Vec<u32> = x.iter().map(|&v| gelu(v).to_bits()).collect();
                let g: Vec<u32> = x.iter().map(|&v| gelu_grad(v).to_bits()).collect();
                (y, g, lane_sum(&x, |v| v * v).to_bits())
            },
        );
        assert!(wide_out == scalar(&x));
    }

    /// The causal softmax op (the GPU attention's, reference on the CPU) against the additive
    /// -inf mask and candle_nn's softmax, in f64: the same probabilities, and through autograd the
    /// same score gradients, on two sequences of two heads with a row longer than a warp.
    #[test]
    fn causal_softmax_equals_the_masked_composite_forward_and_backward() -> candle_core::Result<()>
    {
        use super::CausalSoftmax;
        use candle_core::{DType, Var, D};
        let (b, h, t) = (2, 2, 37);
        let data: Vec<f64> = (0..b * h * t * t)
            .map(|i| ((i as f64) * 0.37).sin() * 4.0)
            .collect();
        let scores = Var::from_vec(data, (b, h, t, t), &Device::Cpu)?;
        let mask: Vec<f64> = (0..t * t)
            .map(|k| {
                if k % t > k / t {
                    f64::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu)?;
        let upstream = Tensor::rand(-1.0f64, 1.0, (b, h, t, t), &Device::Cpu)?;
        let fused = scores.apply_op1(CausalSoftmax)?;
        let composite = candle_nn::ops::softmax(&scores.broadcast_add(&mask)?, D::Minus1)?;
        let diff = (&fused - &composite)?
            .abs()?
            .max_all()?
            .to_scalar::<f64>()?;
        assert!(diff < 1e-14, "forward differs by {diff}");
        let g_fused = (&fused * &upstream)?.sum_all()?.backward()?;
        let g_composite = (&composite * &upstream)?.sum_all()?.backward()?;
        let (a, c) = (
            g_fused.get(&scores).unwrap(),
            g_composite.get(&scores).unwrap(),
        );
        let diff = (a - c)?.abs()?.max_all()?.to_scalar::<f64>()?;
        assert!(diff < 1e-13, "gradients differ by {diff}");
        // Masked keys get exactly zero probability and zero gradient.
        let row0 = fused.flatten_all()?.narrow(0, 0, t)?.to_vec1::<f64>()?;
        assert_eq!(row0[0], 1.0);
        assert!(row0[1..].iter().all(|&p| p == 0.0));
        assert!(scores
            .to_dtype(DType::F32)?
            .apply_op1(CausalSoftmax)
            .is_ok());
        let not_square = Tensor::zeros((2, 3, 4), DType::F64, &Device::Cpu)?;
        let err = not_square.apply_op1(CausalSoftmax).unwrap_err().to_string();
        assert!(err.contains("not [.., t, t]"), "{err}");
        Ok(())
    }

    #[test]
    fn exp_f32_saturates_instead_of_overflowing_and_keeps_nan() {
        let low = exp_f32(-1e4);
        assert!(low > 0.0 && low < 1.3e-38, "{low}");
        let high = exp_f32(1e4);
        assert!(high.is_finite() && high > 1e38, "{high}");
        assert!(exp_f32(f32::NAN).is_nan());
        // tanh through it saturates to exactly +-1.
        let tanh = |u: f32| 1.0 - 2.0 / (1.0 + exp_f32(u + u));
        assert_eq!(tanh(50.0), 1.0);
        assert_eq!(tanh(-50.0), -1.0);
    }

    /// Every fused write-out gives the bits of the unfused ops, on shapes the AMX path takes
    /// (where the CPU has it: the finish then runs per 32 x 32 block, ragged edges included)
    /// and on ones it leaves to the gemm crate (one pass over the rows).
    /// The chunked head loss against the logits materialised and candle's cross-entropy: the
    /// same loss and gradients to f32 rounding, over one chunk (a byte vocabulary) and over two
    /// (a 40k vocabulary), and the same bits at one thread and at three.
    #[test]
    fn chunked_head_loss_matches_logits_then_cross_entropy() -> candle_core::Result<()> {
        use super::HeadLoss;
        use candle_core::Var;
        for (n, c, v) in [(96, 16, 256), (256, 8, 40_000)] {
            assert_eq!(n > HeadLoss::chunk_rows(v), v > 256, "chunks as intended");
            let val = |len: usize, s: u64| {
                let mut r = crate::rng::SplitMix64::new(s);
                (0..len)
                    .map(|_| r.next_f64() as f32 - 0.5)
                    .collect::<Vec<f32>>()
            };
            let h = Var::from_vec(val(n * c, 1), (n, c), &Device::Cpu)?;
            let wte = Var::from_vec(val(v * c, 2), (v, c), &Device::Cpu)?;
            let targets: Vec<u32> = (0..n).map(|i| (i * 7919 % v) as u32).collect();
            let ids = Tensor::from_slice(&targets, n, &Device::Cpu)?;
            let logits = h.matmul(&wte.t()?)?;
            let want = candle_nn::loss::cross_entropy(&logits, &ids)?;
            let wg = (&want * 3.0)?.backward()?;
            let run = |threads: usize| -> candle_core::Result<(f32, Vec<f32>, Vec<f32>)> {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                pool.install(|| {
                    let op = HeadLoss {
                        targets: targets.clone(),
                    };
                    let loss = h.apply_op2(&wte, op)?;
                    let g = (&loss * 3.0)?.backward()?;
                    let flat = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
                    Ok((
                        loss.to_scalar::<f32>()?,
                        flat(g.get(&h).unwrap())?,
                        flat(g.get(&wte).unwrap())?,
                    ))
                })
            };
            let got = run(1)?;
            assert!(run(3)? == got, "thread count changed the bits");
            let close = |a: &[f32], b: &Tensor, what: &str| -> candle_core::Result<()> {
                let b = b.flatten_all()?.to_vec1::<f32>()?;
                let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
                for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                    assert!(
                        (x - y).abs() <= 1e-5 * scale,
                        "{what}[{i}] {x} vs {y} (v {v})"
                    );
                }
                Ok(())
            };
            let want_loss = want.to_scalar::<f32>()?;
            assert!(
                (got.0 - want_loss).abs() <= 1e-6 * want_loss.abs(),
                "{} vs {want_loss}",
                got.0
            );
            close(&got.1, wg.get(&h).unwrap(), "dh")?;
            close(&got.2, wg.get(&wte).unwrap(), "dwte")?;
        }
        Ok(())
    }

    /// The embedding op against candle's index_select + broadcast add: the same outputs and the
    /// same gradients for both tables (repeated tokens summed, positions past `seq` zero), at one
    /// thread and at four.
    #[test]
    fn embedding_matches_index_select_and_broadcast_add() -> candle_core::Result<()> {
        use candle_core::Var;
        let (vocab, positions, c, b, t) = (11, 9, 40, 3, 7);
        let val = |n: usize, s: u64| {
            let mut r = crate::rng::SplitMix64::new(s);
            (0..n)
                .map(|_| r.next_f64() as f32 - 0.5)
                .collect::<Vec<f32>>()
        };
        let wte = Var::from_vec(val(vocab * c, 1), (vocab, c), &Device::Cpu)?;
        let wpe = Var::from_vec(val(positions * c, 2), (positions, c), &Device::Cpu)?;
        let tokens: Vec<u32> = (0..b * t).map(|i| (i * 7 % 5) as u32).collect();
        let dy = Tensor::from_vec(val(b * t * c, 3), (b * t, c), &Device::Cpu)?;
        let reference = {
            let ids = Tensor::from_slice(&tokens, b * t, &Device::Cpu)?;
            let tok = wte.index_select(&ids, 0)?.reshape((b, t, c))?;
            let y = tok
                .broadcast_add(&wpe.narrow(0, 0, t)?)?
                .reshape((b * t, c))?;
            let g = (&y * &dy)?.sum_all()?.backward()?;
            let grads = (
                g.get(&wte).unwrap().to_vec2::<f32>()?,
                g.get(&wpe).unwrap().to_vec2::<f32>()?,
            );
            (y.to_vec2::<f32>()?, grads)
        };
        for threads in [1, 4] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let got = pool.install(|| -> candle_core::Result<_> {
                let op = Embedding {
                    tokens: tokens.clone(),
                    seq: t,
                    positions: None,
                };
                let y = wte.apply_op2(&wpe, op)?;
                let g = (&y * &dy)?.sum_all()?.backward()?;
                let grads = (
                    g.get(&wte).unwrap().to_vec2::<f32>()?,
                    g.get(&wpe).unwrap().to_vec2::<f32>()?,
                );
                Ok((y.to_vec2::<f32>()?, grads))
            })?;
            assert_eq!(got.0, reference.0, "forward, {threads} threads");
            assert_eq!(
                got.1 .0, reference.1 .0,
                "token table gradient, {threads} threads"
            );
            assert_eq!(
                got.1 .1, reference.1 .1,
                "position table gradient, {threads} threads"
            );
        }
        let bad = Embedding {
            tokens: vec![11; t],
            seq: t,
            positions: None,
        };
        assert!(
            wte.apply_op2(&wpe, bad).is_err(),
            "a token past the vocabulary is an error"
        );
        Ok(())
    }

    #[test]
    fn fused_write_outs_equal_the_unfused_ops_bit_for_bit() -> candle_core::Result<()> {
        let mut rng = crate::rng::SplitMix64::new(5);
        let mut values = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| (rng.next_f64() as f32 - 0.5) * 2.0)
                .collect()
        };
        for (rows, inp, out) in [(300, 150, 200), (256, 256, 128), (8, 5, 7)] {
            let (x, w, b, res) = (
                values(rows * inp),
                values(out * inp),
                values(out),
                values(rows * out),
            );
            // The unfused ops: the product, then the bias added in a pass of its own.
            let mut plain = super::gemm_written((rows, out, inp), (&x, (inp, 1)), (&w, (1, inp)));
            for row in plain.chunks_mut(out) {
                row.iter_mut().zip(&b).for_each(|(y, &b)| *y += b);
            }
            let biased = Linear::fwd_finished(&x, &w, &Finish::Bias(&b))?;
            assert!(biased == plain, "{rows}x{inp}x{out}: bias");
            let with_res = Linear::fwd_finished(&x, &w, &Finish::BiasResidual(&b, &res))?;
            let want: Vec<f32> = res.iter().zip(&plain).map(|(r, p)| r + p).collect();
            assert!(with_res == want, "{rows}x{inp}x{out}: residual");
        }
        let (x, w, b) = (values(6), values(6), values(3));
        let res = values(5);
        assert!(Linear::fwd_finished(&x, &w, &Finish::BiasResidual(&b, &res)).is_err());
        Ok(())
    }
}

mod llama;
pub(crate) use llama::{Gated, MatMulT, RmsNorm, Rope};
