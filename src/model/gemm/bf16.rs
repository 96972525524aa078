//! Matrix products with bf16 operands and f32 sums, on AVX512-BF16 (`VDPBF16PS`): what a bf16 run
//! computes on a CPU that has it, as PyTorch's bf16 autocast does.
//!
//! WHY: a bf16 run keeps 16-bit parameters and gradients but computed every product in f32, so a
//! CPU with native bf16 dot products (AMD Zen 4 and later, Intel Cooper Lake; Sapphire Rapids too,
//! where its AMX tiles keep the exact f32 path instead)
//! gave PyTorch's autocast a lead zerodp did not take: one `VDPBF16PS` does two multiply-adds per
//! lane, twice the f32 FMA's work per instruction.
//!
//! The operands are rounded to bf16 (round to nearest even, as `torch.bfloat16` rounds) while they
//! are packed: A in blocks of [`MR`] rows, B in panels of [`NR`] columns, both as pairs of
//! consecutive k (the instruction's unit). Each output element is one sum over k in a fixed order,
//! so the result depends on the operands alone, never on the threads. Turned on per process by
//! [`set_bf16_products`] (the command line does for bf16 runs on such a CPU); off, every product is
//! f32 as before.

use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

/// Rows of a micro-tile: eight rows of two 16-lane accumulators are 16 of the 32 vector registers.
const MR: usize = 8;
/// Columns of a panel: two 16-lane vectors.
const NR: usize = 32;
/// Rows per parallel task (a whole number of [`MR`]).
const ROWS_PER_TASK: usize = 64;
/// Pairs of k a tile sums before the next A block reuses the same stretch of the panel: 256 pairs
/// are 32 KiB of a B panel and 8 KiB of an A block, which stay in L1 and L2 while a task's blocks
/// pass over them. Summed over the whole k at once, the LM head's input gradient (k = the
/// vocabulary) streamed a 9.7 MB panel from memory once per block of [`MR`] rows.
const KC: usize = 256;

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Whether this CPU has AVX512-BF16 (and AVX-512F).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16")
            && crate::isa::allows(crate::isa::Isa::Avx512)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Compute f32 products of this process with bf16 operands (`on`) or in f32; returns whether they
/// now are bf16: never without [`available`], nor where the f32 products run on AMX tiles (a
/// Sapphire Rapids Xeon has both; its tiles' exact f32 path was measured, this one was not there).
pub fn set_bf16_products(on: bool) -> bool {
    let on = on && available() && !super::amx::enabled();
    ENABLED.store(on, Ordering::Relaxed);
    on
}

/// Whether f32 products take this path.
pub(super) fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// `x` rounded to bf16 (to nearest, ties to even; a NaN stays a quiet NaN), the bits: the same as
/// `half::bf16::from_f32`, branch-free so that the packing loops vectorise.
#[inline(always)]
fn bits(x: f32) -> u32 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16;
    let nan = (b & 0x7FFF_FFFF) > 0x7F80_0000;
    if nan {
        (b >> 16) | 0x40
    } else {
        rounded
    }
}

/// A strided f32 matrix: its elements, row and column strides.
type Operand<'a> = (&'a [f32], (usize, usize));

/// The pair of `lo` and `hi` rounded to bf16, `lo` in the low half.
#[inline(always)]
fn pair(lo: f32, hi: f32) -> u32 {
    bits(lo) | (bits(hi) << 16)
}

/// `out[i] = pair(lo[i], hi[i])` (`hi` shorter than `out`: zeros), vectorised.
#[inline(always)]
fn pairs_of_rows(out: &mut [u32], lo: &[f32], hi: Option<&[f32]>) {
    super::super::ops::wide(
        #[inline(always)]
        || match hi {
            Some(hi) => out
                .iter_mut()
                .zip(lo.iter().zip(hi))
                .for_each(|(o, (&l, &h))| *o = pair(l, h)),
            None => out.iter_mut().zip(lo).for_each(|(o, &l)| *o = bits(l)),
        },
    )
}

/// `out[p] = pair(run[2p], run[2p + 1])` over a run of `k` consecutive values, vectorised.
#[inline(always)]
fn pairs_of_run(out: &mut [u32], run: &[f32]) {
    super::super::ops::wide(
        #[inline(always)]
        || {
            let mut chunks = run.chunks_exact(2);
            for (o, c) in out.iter_mut().zip(&mut chunks) {
                *o = pair(c[0], c[1]);
            }
            if let ([last], Some(o)) = (chunks.remainder(), out.get_mut(run.len() / 2)) {
                *o = bits(*last);
            }
        },
    )
}

/// `B [k, n]` as panels of [`NR`] columns, each `kp` pairs of rows: `out[(q * kp + p) * NR + j]`
/// holds `B[2p][q NR + j]` in its low half and `B[2p + 1][q NR + j]` in its high half (zero past
/// the matrix).
pub(super) fn pack_b((b, (rs, cs)): Operand<'_>, k: usize, n: usize) -> Vec<u32> {
    pack_pairs::<NR>((b, (rs, cs)), k, n)
}

/// `A [m, k]` as blocks of [`MR`] rows, each `kp` pairs of columns: `out[(i * kp + p) * MR + r]`
/// holds `A[i MR + r][2p]` low and `A[i MR + r][2p + 1]` high (zero past the matrix): the
/// packing of `A^T [k, m]` as [`pack_b`] packs, in groups of [`MR`].
pub(super) fn pack_a((a, (rs, cs)): Operand<'_>, m: usize, k: usize) -> Vec<u32> {
    pack_pairs::<MR>((a, (cs, rs)), k, m)
}

/// `X [k, n]` (element `(t, j)` at `t * ks + j * js`) in groups of `W` columns, each `kp` pairs of
/// rows: `out[(q * kp + p) * W + j]` holds `X[2p][q W + j]` low and `X[2p + 1][q W + j]` high (zero
/// past the matrix). Contiguous columns (an activation) and contiguous k (a weight used
/// transposed) are packed by vectorised runs; other strides element by element.
fn pack_pairs<const W: usize>((x, (ks, js)): Operand<'_>, k: usize, n: usize) -> Vec<u32> {
    let kp = k.div_ceil(2);
    let groups = n.div_ceil(W);
    // Zeroes written, not calloc'd: the block (272 MB for Qwen2.5-0.5B's head) comes back from
    // the allocator's kept blocks each step, and one it saw written is known resident, where a
    // calloc'd one may map the zero page (`memory::ReuseAlloc` counts it whole again).
    #[allow(clippy::slow_vector_initialization)]
    let mut out = {
        let mut v = Vec::with_capacity(groups * kp * W);
        v.resize(groups * kp * W, 0u32);
        v
    };
    out.par_chunks_mut(kp * W)
        .enumerate()
        .for_each(|(q, group)| {
            let cols = W.min(n - q * W);
            if js == 1 {
                for (p, lanes) in group.chunks_mut(W).enumerate() {
                    let lo = &x[2 * p * ks + q * W..][..cols];
                    let hi = (2 * p + 1 < k).then(|| &x[(2 * p + 1) * ks + q * W..][..cols]);
                    pairs_of_rows(&mut lanes[..cols], lo, hi);
                }
            } else if ks == 1 {
                let mut column = vec![0u32; kp];
                for j in 0..cols {
                    pairs_of_run(&mut column, &x[(q * W + j) * js..][..k]);
                    for (p, &v) in column.iter().enumerate() {
                        group[p * W + j] = v;
                    }
                }
            } else {
                for (p, lanes) in group.chunks_mut(W).enumerate() {
                    for (j, v) in lanes.iter_mut().take(cols).enumerate() {
                        let col = (q * W + j) * js;
                        let hi = match 2 * p + 1 < k {
                            true => x[(2 * p + 1) * ks + col],
                            false => 0.0,
                        };
                        *v = pair(x[2 * p * ks + col], hi);
                    }
                }
            }
        });
    out
}

/// A destination pointer that tasks writing disjoint tiles share.
#[derive(Clone, Copy)]
struct Dst(*mut f32);
// SAFETY: every task writes its own (row range, panel) tile of the destination; no two tiles
// overlap and nothing reads the destination while they run.
unsafe impl Send for Dst {}
unsafe impl Sync for Dst {}

impl Dst {
    /// The pointer (a method, so that closures capture the whole `Dst`, not its raw field).
    fn ptr(self) -> *mut f32 {
        self.0
    }
}

/// `dst[m, n] (+)= A[m, k] @ B[k, n]` with A and B rounded to bf16 and f32 sums, on the current
/// rayon pool. `dst` rows are `ldd` apart.
///
/// # Safety
/// [`available`] is true; `dst` is valid for writes (and, when `accumulate`, reads) of rows
/// `0..m` of `n` elements `ldd` apart and aliases neither operand; the operands hold every element
/// their strides reach (the caller, `gemm::gemm_raw`, checks all of it).
pub(super) unsafe fn gemm(
    (m, n, k): (usize, usize, usize),
    (dst, ldd): (*mut f32, usize),
    accumulate: bool,
    a: Operand<'_>,
    b: Operand<'_>,
) {
    if m == 0 || n == 0 {
        return;
    }
    let (pa, pb) = rayon::join(|| pack_a(a, m, k), || pack_b(b, k, n));
    // SAFETY: the caller's contract, passed on.
    unsafe { products((m, n, k), (dst, ldd), accumulate, &pa, &pb) }
}

/// `B [k, n]` packed once for several [`gemm_packed`] products with it: the LM head's weight over
/// its chunks of rows is 270 MB of panels at a 150k vocabulary, packed again for every chunk
/// otherwise.
pub(super) struct PackedB {
    panels: Vec<u32>,
    k: usize,
    n: usize,
}

impl PackedB {
    pub fn new(b: Operand<'_>, k: usize, n: usize) -> Self {
        PackedB {
            panels: pack_b(b, k, n),
            k,
            n,
        }
    }

    /// Its `(k, n)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.k, self.n)
    }
}

/// [`gemm`] with `B` packed beforehand.
///
/// # Safety
/// As [`gemm`]'s.
pub(super) unsafe fn gemm_packed(
    m: usize,
    (dst, ldd): (*mut f32, usize),
    accumulate: bool,
    a: Operand<'_>,
    b: &PackedB,
) {
    let (k, n) = b.dims();
    if m == 0 || n == 0 {
        return;
    }
    let pa = pack_a(a, m, k);
    // SAFETY: the caller's contract, passed on.
    unsafe { products((m, n, k), (dst, ldd), accumulate, &pa, &b.panels) }
}

/// The tiles of `dst[m, n] (+)= A @ B` from packed operands, in parallel.
///
/// # Safety
/// As [`gemm`]'s; `pa` and `pb` are `A` and `B` packed by [`pack_a`] and [`pack_b`].
unsafe fn products(
    (m, n, k): (usize, usize, usize),
    (dst, ldd): (*mut f32, usize),
    accumulate: bool,
    pa: &[u32],
    pb: &[u32],
) {
    let kp = k.div_ceil(2);
    let row_tasks = m.div_ceil(ROWS_PER_TASK);
    let panels = n.div_ceil(NR);
    let out = Dst(dst);
    (0..row_tasks * panels).into_par_iter().for_each(|t| {
        let (rt, q) = (t / panels, t % panels);
        let cols = NR.min(n - q * NR);
        let rows = rt * ROWS_PER_TASK..((rt + 1) * ROWS_PER_TASK).min(m);
        let panel = &pb[q * kp * NR..(q + 1) * kp * NR];
        // Each element's sum runs over k in stretches of KC pairs, always in this order, the
        // later ones added into what the earlier left: the result still depends on the operands
        // alone.
        // (One empty stretch when k is 0, so that the tiles are still written.)
        for p0 in (0..kp.max(1)).step_by(KC) {
            let pairs = p0..(p0 + KC).min(kp);
            let stretch = &panel[pairs.start * NR..pairs.end * NR];
            for i0 in rows.clone().step_by(MR) {
                let block = &pa[(i0 / MR) * kp * MR..][pairs.start * MR..pairs.end * MR];
                let valid = MR.min(m - i0);
                // SAFETY: the tile's rows i0..i0 + valid and columns q NR..q NR + cols are inside
                // the destination and belong to this task alone; the CPU has AVX512-BF16 (the
                // caller).
                unsafe {
                    let at = out.ptr().add(i0 * ldd + q * NR);
                    let add = accumulate || p0 > 0;
                    tile(block, stretch, pairs.len(), (at, ldd), (valid, cols), add);
                }
            }
        }
    });
}

/// One [`MR`] x [`NR`] tile: the sums over `kp` pairs of one A block and one B panel, stored
/// (or added) into the first `rows` x `cols` of the destination.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile(
    block: &[u32],
    panel: &[u32],
    kp: usize,
    (dst, ldd): (*mut f32, usize),
    (rows, cols): (usize, usize),
    accumulate: bool,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    for p in 0..kp {
        // SAFETY: the panel holds kp pairs of NR lanes and the block kp pairs of MR rows.
        let (b0, b1, a) = unsafe {
            let bp = panel.as_ptr().add(p * NR);
            (
                _mm512_loadu_si512(bp.cast()),
                _mm512_loadu_si512(bp.add(16).cast()),
                block.as_ptr().add(p * MR),
            )
        };
        // The instruction reads each 32-bit lane as a pair of bf16: the bits as they are.
        let bh = |v: __m512i| std::mem::transmute::<__m512i, __m512bh>(v);
        let (b0, b1) = (bh(b0), bh(b1));
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: r < MR, inside the block's pair p.
            let av = bh(_mm512_set1_epi32(unsafe { *a.add(r) } as i32));
            acc[0] = _mm512_dpbf16_ps(acc[0], av, b0);
            acc[1] = _mm512_dpbf16_ps(acc[1], av, b1);
        }
    }
    for (r, acc) in acc.iter().enumerate().take(rows) {
        for (h, &v) in acc.iter().enumerate() {
            let c0 = h * 16;
            if c0 >= cols {
                break;
            }
            let lanes = (cols - c0).min(16);
            let mask: __mmask16 = if lanes == 16 {
                0xFFFF
            } else {
                (1u16 << lanes) - 1
            };
            // SAFETY: row r < rows and the masked lanes c0..c0 + lanes < cols are inside the tile.
            unsafe {
                let at = dst.add(r * ldd + c0);
                let v = match accumulate {
                    true => _mm512_add_ps(_mm512_maskz_loadu_ps(mask, at), v),
                    false => v,
                };
                _mm512_mask_storeu_ps(at, mask, v);
            }
        }
    }
}

/// [`tile`] in scalar code, for targets without AVX512-BF16. Never called there today (`available`
/// is false, so products stay f32), but a caller that got here anyway gets the same sums of bf16
/// pairs rather than a panic.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn tile(
    block: &[u32],
    panel: &[u32],
    kp: usize,
    (dst, ldd): (*mut f32, usize),
    (rows, cols): (usize, usize),
    accumulate: bool,
) {
    let widen = |bits: u32| f32::from_bits(bits << 16);
    for r in 0..rows {
        for c in 0..cols {
            let mut sum = 0.0f32;
            for p in 0..kp {
                let (a, b) = (block[p * MR + r], panel[p * NR + c]);
                sum += widen(a & 0xFFFF) * widen(b & 0xFFFF) + widen(a >> 16) * widen(b >> 16);
            }
            // SAFETY: row r < rows and column c < cols are inside the tile (the caller's bounds).
            unsafe {
                let at = dst.add(r * ldd + c);
                *at = if accumulate { *at + sum } else { sum };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against a product of the same bf16-rounded operands summed in f64: every shape edge (rows
    /// past a micro-tile, columns past a panel, odd k, k over several stretches), strided
    /// operands, and accumulation.
    #[test]
    fn products_equal_the_rounded_operands_product() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX512-BF16");
            return;
        }
        let round = |x: f32| half::bf16::from_f32(x).to_f32();
        for &(m, n, k) in &[
            (1, 1, 1),
            (8, 32, 2),
            (13, 45, 7),
            (70, 33, 64),
            (9, 100, 129),
            // k over two stretches of KC pairs, the last one partial.
            (9, 40, 4 * KC + 37),
        ] {
            let a: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7919) % 113) as f32 / 37.0 - 1.5)
                .collect();
            // B given transposed ([n, k] in memory, as a linear layer's weight).
            let b: Vec<f32> = (0..n * k)
                .map(|i| ((i * 104729) % 97) as f32 / 29.0 - 1.7)
                .collect();
            for accumulate in [false, true] {
                let mut dst = vec![0.5f32; m * n];
                // SAFETY: checked above; dst holds m x n; strides stay inside a and b.
                unsafe {
                    gemm(
                        (m, n, k),
                        (dst.as_mut_ptr(), n),
                        accumulate,
                        (&a, (k, 1)),
                        (&b, (1, k)),
                    )
                };
                // The same product from A stored transposed ([k, m]) and B stored [k, n]: the
                // other packing paths (a weight gradient's operands).
                let a_t: Vec<f32> = (0..k * m).map(|x| a[(x % m) * k + x / m]).collect();
                let b_kn: Vec<f32> = (0..k * n).map(|x| b[(x % n) * k + x / n]).collect();
                let mut other = vec![0.5f32; m * n];
                // SAFETY: as above, with the transposed strides.
                unsafe {
                    gemm(
                        (m, n, k),
                        (other.as_mut_ptr(), n),
                        accumulate,
                        (&a_t, (1, m)),
                        (&b_kn, (n, 1)),
                    )
                };
                assert_eq!(other, dst, "{m}x{n}x{k}: the packing paths disagree");
                // B packed once and used for two row blocks: the same bits as packed per call.
                let packed = PackedB::new((&b, (1, k)), k, n);
                let mut halves = vec![0.5f32; m * n];
                let top = m / 2;
                for (rows, at) in [(0..top, 0), (top..m, top)] {
                    // SAFETY: as above, rows `rows` of a and of the destination.
                    unsafe {
                        gemm_packed(
                            rows.len(),
                            (halves.as_mut_ptr().add(at * n), n),
                            accumulate,
                            (&a[rows.start * k..], (k, 1)),
                            &packed,
                        )
                    };
                }
                assert_eq!(halves, dst, "{m}x{n}x{k}: B packed once");
                for i in 0..m {
                    for j in 0..n {
                        let want: f64 = (0..k)
                            .map(|l| {
                                f64::from(round(a[i * k + l])) * f64::from(round(b[j * k + l]))
                            })
                            .sum::<f64>()
                            + if accumulate { 0.5 } else { 0.0 };
                        let got = f64::from(dst[i * n + j]);
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()) * (k as f64).sqrt(),
                            "{m}x{n}x{k} ({accumulate}) at {i},{j}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// The branch-free rounding is `half`'s, NaN, infinities, ties and subnormals included.
    #[test]
    fn rounding_to_bf16_is_halfs() {
        let mut x = 0x9E37_79B9u32;
        let special = [
            0.0f32,
            -0.0,
            1.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            f32::MIN_POSITIVE / 3.0,
        ];
        let ties = [
            f32::from_bits(0x3F80_8000),
            f32::from_bits(0x3F81_8000),
            f32::from_bits(0x7F7F_FFFF),
        ];
        let random = (0..100_000).map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            f32::from_bits(x)
        });
        for v in special.into_iter().chain(ties).chain(random) {
            let want = half::bf16::from_f32(v);
            let got = half::bf16::from_bits(bits(v) as u16);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{v:e}: {got} vs {want}"
            );
        }
    }

    /// The same bits at 1 and 3 threads.
    #[test]
    fn products_do_not_depend_on_the_threads() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX512-BF16");
            return;
        }
        let (m, n, k) = (200, 77, 300);
        let a: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.1 - 0.8).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i % 23) as f32 * 0.07 - 0.7).collect();
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut dst = vec![0f32; m * n];
            // SAFETY: checked above; dst holds m x n; strides stay inside a and b.
            pool.install(|| unsafe {
                gemm(
                    (m, n, k),
                    (dst.as_mut_ptr(), n),
                    false,
                    (&a, (k, 1)),
                    (&b, (n, 1)),
                )
            });
            dst
        };
        assert_eq!(run(1), run(3));
    }
}
