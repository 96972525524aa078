//! The matrix products of the CPU kernels, and the one place that chooses their path: bf16
//! operands with f32 sums on AVX512-BF16 ([`bf16`], bf16 runs as autocast computes them), f32 on
//! AMX tiles ([`amx`], exact f32 in three bf16 parts, x86-64 only), else the `gemm` crate's f32
//! kernels. A product's path visits the op that asks for it ([`super::ops`]), [`gemm_raw`] here,
//! and the one kernel file it runs on.

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(not(target_arch = "x86_64"))]
#[path = "amx_off.rs"]
mod amx;
mod bf16;
mod footprint;

pub use amx::{path_name as gemm_path, GEMM_ENV};
pub use bf16::{available as bf16_products_available, set_bf16_products};
pub use footprint::{
    gemm_footprint, gpt_products, llama_products, products_footprint, GemmFootprint,
};

use super::ops::{lit, wide, written, Real, ROWS_PER_TASK};
use candle_core::{bail, DType, Result};
use rayon::prelude::*;

/// `dst[m, n] (+)= lhs[m, k] @ rhs[k, n]` with explicit (row, column) strides, on the current
/// rayon pool.
#[allow(clippy::too_many_arguments)]
pub(in crate::model) fn gemm_into<T: Real>(
    (m, n, k): (usize, usize, usize),
    dst: &mut [T],
    accumulate: bool,
    lhs: &[T],
    lhs_strides: (usize, usize),
    rhs: &[T],
    rhs_strides: (usize, usize),
) {
    let parallelism = gemm_parallelism();
    let dst = (dst, n);
    gemm_strided(
        (m, n, k),
        dst,
        accumulate,
        (lhs, lhs_strides),
        (rhs, rhs_strides),
        parallelism,
    );
}

/// A right operand packed once for several products with it (the LM head's weight over its chunks
/// of rows): bf16 panels where the AVX512-BF16 products run; elsewhere each product packs its own
/// (the gemm crate keeps nothing between calls), as [`gemm_into`] does.
pub(in crate::model) struct PackedRhs<'a, T> {
    rhs: Strided<'a, T>,
    k: usize,
    n: usize,
    bf16: Option<bf16::PackedB>,
}

impl<'a, T: Real> PackedRhs<'a, T> {
    /// `rhs [k, n]`, packed now where that pays.
    pub fn new((k, n): (usize, usize), rhs: Strided<'a, T>) -> Self {
        let (data, (rs, cs)) = rhs;
        let fits = k == 0 || n == 0 || data.len() > (k - 1) * rs + (n - 1) * cs;
        assert!(fits, "packed gemm operand too small");
        let bf16 = (T::DTYPE == DType::F32 && bf16::enabled() && k > 0 && n > 0)
            .then(|| bf16::PackedB::new((bytemuck::cast_slice(data), (rs, cs)), k, n));
        PackedRhs { rhs, k, n, bf16 }
    }
}

/// [`gemm_into`] against a [`PackedRhs`]: `dst[m, n] (+)= lhs[m, k] @ rhs`.
pub(in crate::model) fn gemm_into_packed<T: Real>(
    m: usize,
    dst: &mut [T],
    accumulate: bool,
    lhs: Strided<'_, T>,
    rhs: &PackedRhs<'_, T>,
) {
    let (k, n) = (rhs.k, rhs.n);
    let Some(packed) = &rhs.bf16 else {
        let (r, rs) = rhs.rhs;
        return gemm_into((m, n, k), dst, accumulate, lhs.0, lhs.1, r, rs);
    };
    let (a, (a_rs, a_cs)) = lhs;
    assert!(m == 0 || dst.len() >= m * n, "gemm destination too small");
    assert!(m == 0 || k == 0 || a.len() > (m - 1) * a_rs + (k - 1) * a_cs);
    // SAFETY: the destination holds m rows of n (checked), the operands every element their
    // strides reach (checked here and in `PackedRhs::new`), and `packed` exists only where the
    // CPU has AVX512-BF16.
    unsafe {
        bf16::gemm_packed(
            m,
            (dst.as_mut_ptr().cast::<f32>(), n),
            accumulate,
            (bytemuck::cast_slice(a), (a_rs, a_cs)),
            packed,
        )
    }
}

/// A matrix operand: the slice its first element starts and its (row, column) strides.
pub(in crate::model) type Strided<'a, T> = (&'a [T], (usize, usize));

/// `lhs[m, k] @ rhs[k, n]` as a new row-major `[m, n]` vector, the GEMM writing straight into
/// its uninitialised capacity (it overwrites every element without reading it: `read_dst`
/// false), on the current rayon pool.
pub(in crate::model) fn gemm_written<T: Real>(
    (m, n, k): (usize, usize, usize),
    (lhs, lhs_strides): Strided<'_, T>,
    (rhs, rhs_strides): Strided<'_, T>,
) -> Vec<T> {
    if k == 0 {
        return vec![lit::<T>(0.0); m * n];
    }
    let fill = |dst: &mut [std::mem::MaybeUninit<T>]| {
        let len = dst.len();
        // SAFETY: `dst` is valid for writes of its `m * n` elements, in rows of `n` (column
        // stride 1), and aliases no operand.
        unsafe {
            gemm_raw(
                (m, n, k),
                (dst.as_mut_ptr().cast::<T>(), len, n),
                false,
                (lhs, lhs_strides),
                (rhs, rhs_strides),
                gemm_parallelism(),
            )
        }
    };
    // SAFETY: with `accumulate` false and k > 0 the GEMM writes every element of the `m x n`
    // destination and reads none (gemm's `read_dst = false`).
    unsafe { written(m * n, fill) }
}

/// `lhs[m, k] @ rhs[k, n]` (k >= 1) as a new row-major `[m, n]` vector, `finish` applied to
/// each block as the AMX path writes it, or in one pass over the rows after the `gemm` crate's
/// product: both orders give the same bits (the finish reads only the finished product).
pub(in crate::model) fn gemm_finished<T: Real>(
    (m, n, k): (usize, usize, usize),
    (lhs, lhs_strides): Strided<'_, T>,
    (rhs, rhs_strides): Strided<'_, T>,
    finish: &Finish<'_, T>,
) -> Vec<T> {
    #[cfg(target_arch = "x86_64")]
    if T::DTYPE == DType::F32 && !bf16::enabled() && amx_takes((m, n, k)) {
        let fill = |dst: &mut [std::mem::MaybeUninit<T>]| {
            let operands = (
                (bytemuck::cast_slice(lhs), lhs_strides),
                (bytemuck::cast_slice(rhs), rhs_strides),
            );
            // SAFETY: `dst` holds m rows of n, aliases no operand; the operands hold every
            // strided element (`Linear` checked the sizes); `enabled` was checked; T is f32.
            unsafe {
                amx::sgemm(
                    (m, n, k),
                    (dst.as_mut_ptr().cast::<f32>(), n),
                    false,
                    operands,
                    amx_threads(gemm_parallelism()),
                    Some(&finish.as_f32()),
                )
            }
        };
        // SAFETY: without `accumulate` the AMX product writes every element of the m x n block.
        return unsafe { written(m * n, fill) };
    }
    let mut y = gemm_written((m, n, k), (lhs, lhs_strides), (rhs, rhs_strides));
    y.par_chunks_mut(n * ROWS_PER_TASK)
        .enumerate()
        .for_each(|(t, rows)| finish.apply(n, (t * ROWS_PER_TASK, 0), (n, rows, n)));
    y
}

/// The threads an AMX product runs on under `parallelism`.
#[cfg(target_arch = "x86_64")]
fn amx_threads(parallelism: ::gemm::Parallelism) -> usize {
    match parallelism {
        ::gemm::Parallelism::Rayon(t) => t,
        _ => 1,
    }
}

/// Whether `gemm_raw` sends an f32 product of these dimensions to AMX.
#[cfg(target_arch = "x86_64")]
fn amx_takes(dims: (usize, usize, usize)) -> bool {
    amx::enabled() && amx::worth_it(dims)
}

/// What a product's write-out does to each row before it lands: fused into the AMX path's
/// write-out (the block is still in L1), one pass over the rows after the `gemm` crate's. Each arm
/// repeats the unfused ops' arithmetic in their order, so fusing changes no bit; what it saves is
/// a pass over the output through memory. (The GELU fused here too ran slower than its own
/// streaming pass: its second output, written a 32 x 32 block at a time with rows 4 KiB apart,
/// missed where the streaming pass is prefetched. Its backward fused into the `c_proj` input
/// gradient's write-out, `p * gelu'(x)` reading x a block at a time, made the 25M GPT's backward
/// 9% slower for the same reason: 573/551/588 ms against 624/683/641 in interleaved runs.)
pub(in crate::model) enum Finish<'a, T> {
    /// `y = b + p`: a linear layer's bias.
    Bias(&'a [T]),
    /// `y = r + (b + p)`: the bias, then the residual stream `r` (`[m, n]`) the layer adds to.
    BiasResidual(&'a [T], &'a [T]),
}

impl<'a, T: Real> Finish<'a, T> {
    /// The same finish on f32 slices, for the AMX path; only called when T is f32 (the cast
    /// checks it).
    #[cfg(target_arch = "x86_64")]
    fn as_f32(&self) -> Finish<'a, f32> {
        match *self {
            Self::Bias(b) => Finish::Bias(bytemuck::cast_slice(b)),
            Self::BiasResidual(b, r) => {
                Finish::BiasResidual(bytemuck::cast_slice(b), bytemuck::cast_slice(r))
            }
        }
    }

    /// The product's width `n`.
    pub(in crate::model) fn columns(&self) -> usize {
        match self {
            Self::Bias(b) | Self::BiasResidual(b, _) => b.len(),
        }
    }

    /// Its `[m, n]` operands hold `m` rows.
    pub(in crate::model) fn check(&self, m: usize) -> Result<()> {
        let want = m * self.columns();
        let len = match self {
            Self::Bias(_) => want,
            Self::BiasResidual(_, r) => r.len(),
        };
        if len != want {
            bail!(
                "fused write-out: an operand of {len} elements, expected {m} x {}",
                self.columns()
            );
        }
        Ok(())
    }

    /// Rows `i0..` of an `[m, n]` product at columns `j0..j0 + cols`, held in `y` `stride` apart.
    pub(in crate::model) fn apply(
        &self,
        n: usize,
        (i0, j0): (usize, usize),
        (cols, y, stride): (usize, &mut [T], usize),
    ) {
        // `inline(always)`: a closure this large is otherwise not inlined into `wide`'s vector
        // instances and runs as built (SSE2).
        wide(
            #[inline(always)]
            || self.apply_rows(n, (i0, j0), (cols, y, stride)),
        )
    }

    #[inline(always)]
    fn apply_rows(
        &self,
        n: usize,
        (i0, j0): (usize, usize),
        (cols, y, stride): (usize, &mut [T], usize),
    ) {
        for (r, row) in y.chunks_mut(stride).enumerate() {
            let row = &mut row[..cols];
            let at = (i0 + r) * n + j0;
            match self {
                Self::Bias(b) => {
                    let b = &b[j0..][..cols];
                    row.iter_mut().zip(b).for_each(|(y, &b)| *y += b);
                }
                Self::BiasResidual(b, res) => {
                    let (b, res) = (&b[j0..][..cols], &res[at..][..cols]);
                    for ((y, &b), &r) in row.iter_mut().zip(b).zip(res) {
                        *y = r + (b + *y);
                    }
                }
            }
        }
    }
}

/// Pools of at least this many threads run a backward's two independent products side by side
/// ([`two_products`]); smaller pools run them one after the other.
const SIDE_BY_SIDE_THREADS: usize = 8;

/// Two independent products of a backward (the input and the weight gradient), side by side on
/// the pool from [`SIDE_BY_SIDE_THREADS`] threads, else one after the other on this thread.
///
/// WHY: a product run side by side starts on a pool worker, and the `gemm` crate allocates its
/// packing buffers (0.5-2 MiB) on the thread that calls it, at a moment the threads' timing
/// decides. In the process's one malloc arena those blocks land among the step's activations,
/// and the heap's high-water mark moved 5-15% from run to run (the small GPT with activation
/// checkpointing on 2 threads: 95-106 MiB, against 90-94 one after the other), which the
/// pre-flight cannot plan. One after the other, a step's allocations come in program order on the
/// rank's thread, and each product alone fills a small pool: on 2 cores the same tokens/s (small
/// GPT 7,928 against 7,754; 25M GPT 1,043 against 1,034). On 16 threads a small model's products
/// alone left the pool about half idle, so large pools keep them side by side.
pub(in crate::model) fn two_products<A: Send, B: Send>(
    a: impl FnOnce() -> A + Send,
    b: impl FnOnce() -> B + Send,
) -> (A, B) {
    match rayon::current_num_threads() >= SIDE_BY_SIDE_THREADS {
        true => rayon::join(a, b),
        false => (a(), b()),
    }
}

/// The parallelism of a GEMM called on the current rayon pool: the pool's size (a rank's own pool
/// when the engine runs ranks as threads), capped by candle's thread count (physical cores, or
/// RAYON_NUM_THREADS).
fn gemm_parallelism() -> ::gemm::Parallelism {
    let threads = rayon::current_num_threads().min(candle_core::utils::get_num_threads());
    if threads > 1 {
        ::gemm::Parallelism::Rayon(threads)
    } else {
        ::gemm::Parallelism::None
    }
}

/// `dst[m, n] (+)= lhs[m, k] @ rhs[k, n]`, `dst` given with its row stride (column stride 1),
/// with the given parallelism (`None` inside tasks that are already parallel).
fn gemm_strided<T: Real>(
    (m, n, k): (usize, usize, usize),
    (dst, dst_rs): (&mut [T], usize),
    accumulate: bool,
    lhs: Strided<'_, T>,
    rhs: Strided<'_, T>,
    parallelism: ::gemm::Parallelism,
) {
    let len = dst.len();
    // SAFETY: `dst` is a live, exclusively borrowed slice of `len` initialised elements.
    unsafe {
        gemm_raw(
            (m, n, k),
            (dst.as_mut_ptr(), len, dst_rs),
            accumulate,
            lhs,
            rhs,
            parallelism,
        )
    }
}

/// [`gemm_strided`] on a destination given as a pointer, its length and row stride.
///
/// # Safety
/// `dst` is valid for writes of `dst_len` elements, not aliased by `lhs` or `rhs`, and (when
/// `accumulate`) initialised; the bounds are checked here.
unsafe fn gemm_raw<T: Real>(
    (m, n, k): (usize, usize, usize),
    (dst, dst_len, dst_rs): (*mut T, usize, usize),
    accumulate: bool,
    (lhs, (lhs_rs, lhs_cs)): Strided<'_, T>,
    (rhs, (rhs_rs, rhs_cs)): Strided<'_, T>,
    parallelism: ::gemm::Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        dst_len > (m - 1) * dst_rs + (n - 1),
        "gemm destination too small"
    );
    assert!(n <= dst_rs, "gemm destination rows overlap");
    assert!(k == 0 || lhs.len() > (m - 1) * lhs_rs + (k - 1) * lhs_cs);
    assert!(k == 0 || rhs.len() > (k - 1) * rhs_rs + (n - 1) * rhs_cs);
    if T::DTYPE == DType::F32 && bf16::enabled() {
        // SAFETY: as below; T is f32, and `enabled` implies the CPU has AVX512-BF16.
        unsafe {
            bf16::gemm(
                (m, n, k),
                (dst.cast::<f32>(), dst_rs),
                accumulate,
                (bytemuck::cast_slice(lhs), (lhs_rs, lhs_cs)),
                (bytemuck::cast_slice(rhs), (rhs_rs, rhs_cs)),
            )
        };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if T::DTYPE == DType::F32 && amx_takes((m, n, k)) {
        // SAFETY: as below; T is f32 (same size and layout), and `enabled` checked AMX.
        unsafe {
            amx::sgemm(
                (m, n, k),
                (dst.cast::<f32>(), dst_rs),
                accumulate,
                (
                    (bytemuck::cast_slice(lhs), (lhs_rs, lhs_cs)),
                    (bytemuck::cast_slice(rhs), (rhs_rs, rhs_cs)),
                ),
                amx_threads(parallelism),
                None,
            )
        };
        return;
    }
    // SAFETY: the asserts above keep every index the strides can reach inside the operands and
    // the destination, whose rows (n <= dst_rs) do not overlap; the caller guarantees that dst
    // is writable and aliases neither operand.
    unsafe {
        ::gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            accumulate,
            lhs.as_ptr(),
            lhs_cs as isize,
            lhs_rs as isize,
            rhs.as_ptr(),
            rhs_cs as isize,
            rhs_rs as isize,
            lit::<T>(1.0),
            lit::<T>(1.0),
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// The machine's f32 GEMM rate in FLOP/s for an `[m, k] @ [k, n]` product, as the model's
/// kernels call it (the `gemm` crate, one thread each): `threads` threads at once, each on its own
/// matrices, for at least `min_secs`, summed. The denominator of `bench train`'s model FLOPs
/// utilisation, measured in the same run because a shared machine's rate drifts.
pub fn gemm_flops_per_s((m, k, n): (usize, usize, usize), threads: usize, min_secs: f64) -> f64 {
    // Each thread in a one-thread rayon pool, so that `gemm_into` runs it unparallelised.
    let one = move || -> f64 {
        let Ok(pool) = rayon::ThreadPoolBuilder::new().num_threads(1).build() else {
            return 0.0;
        };
        pool.install(|| {
            let lhs: Vec<f32> = (0..m * k).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect();
            let rhs: Vec<f32> = (0..k * n).map(|i| ((i % 7) as f32 - 3.0) * 0.01).collect();
            let mut dst = vec![0f32; m * n];
            let mut call = || gemm_into((m, n, k), &mut dst, false, &lhs, (k, 1), &rhs, (n, 1));
            call(); // warm-up: packing buffers, page faults
            let start = std::time::Instant::now();
            let mut calls = 0u32;
            while calls == 0 || start.elapsed().as_secs_f64() < min_secs {
                call();
                calls += 1;
            }
            2.0 * (m * k * n) as f64 * f64::from(calls) / start.elapsed().as_secs_f64()
        })
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads.max(1)).map(|_| s.spawn(one)).collect();
        handles.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
    })
}
