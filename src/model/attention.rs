//! Causal multi-head self-attention core: qkv `[b*t, 3c]` (q, k, v blocks of `c` columns, head
//! `h` at columns `h*hd..(h+1)*hd` of each) -> y `[b*t, c]`. The probabilities are recomputed in
//! backward rather than kept, so the op holds no `[b, heads, t, t]` tensor between forward and
//! backward.
//!
//! WHY its own products: per (sequence, head) the products are small (`t x hd` by `hd x t` and
//! back: 128 x 64 x 128 on the benchmark GPT), and through the `gemm` crate each of the five per
//! head paid packing and set-up on every call: the core ran at about 36 GFLOP/s where the linears
//! run at 170. Here each head's q, k, v (and dy) are copied once into contiguous, padded panels
//! (also transposed where a product reads them by column), and every product runs in register
//! tiles of [`MR`] rows by [`NR`] columns with fused multiply-adds, over exactly the keys the
//! causal mask leaves live for that tile's rows (about half the square instead of three quarters).
//!
//! The tiles sum each output over its inner index in order, one fused multiply-add per term, so
//! results depend only on the inputs (never on threads or on the vector width: `mul_add` is one
//! correctly rounded operation on every path).

use rayon::prelude::*;
use std::ops::Range;

#[cfg(target_arch = "x86_64")]
use super::ops::Width;
use super::ops::{even_split, lane_dot, lane_max, lane_sum, lit, written, Real};
use candle_core::{bail, Result};

/// Rows of a register tile.
const MR: usize = 6;
/// Columns of a register tile: two AVX-512 vectors of f32. With [`MR`], 12 accumulators and 2
/// loads plus 6 broadcasts per 12 fused multiply-adds.
const NR: usize = 32;

/// The vector width a caller of [`tile`] was compiled for (its `W`): none assumed, AVX2 with FMA,
/// AVX-512F with FMA.
const BASE: u8 = 0;
#[cfg(target_arch = "x86_64")]
const AVX2: u8 = 1;
#[cfg(target_arch = "x86_64")]
const AVX512: u8 = 2;

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

/// A matrix read element by element: `data[i * row + p * col]` is its entry `(i, p)`.
#[derive(Clone, Copy)]
struct Strided<'a, T> {
    data: &'a [T],
    row: usize,
    col: usize,
}

impl<'a, T: Real> Strided<'a, T> {
    /// Row-major `data` with rows `ld` apart.
    fn by_row(data: &'a [T], ld: usize) -> Self {
        Strided {
            data,
            row: ld,
            col: 1,
        }
    }

    /// The transpose of row-major `data` with rows `ld` apart.
    fn by_col(data: &'a [T], ld: usize) -> Self {
        Strided {
            data,
            row: 1,
            col: ld,
        }
    }

    /// The same matrix from row `i` on.
    #[inline(always)]
    fn rows_from(self, i: usize) -> Strided<'a, T> {
        Strided {
            data: &self.data[i * self.row..],
            ..self
        }
    }
}

/// `R` rows by [`NR`] columns of `A B`, summed over `ks`: `b` holds row `p` of `B` at
/// `b[p * ldb..]`, at least [`NR`] columns of it.
///
/// Where the caller runs compiled for AVX-512F or AVX2 with FMA (`W`), f32 tiles take
/// [`tile_f32_avx512`] or [`tile_f32_avx2`], the same fused multiply-adds in the same order
/// written with intrinsics: LLVM's own vectorisation of this loop kept the accumulators in memory
/// and assembled each row of `b` from shuffles.
#[inline(always)]
fn tile<T: Real, const R: usize, const W: u8>(
    a: Strided<'_, T>,
    b: &[T],
    ldb: usize,
    ks: Range<usize>,
) -> [[T; NR]; R] {
    let acc = [[lit::<T>(0.0); NR]; R];
    if ks.is_empty() {
        return acc;
    }
    // Every entry the loop reads, checked once here rather than at each of its reads per step
    // (those checks cost as much as the multiply-adds). The panels and strides come from
    // `CausalAttention::width`'s checked shapes, so this holds; were it not to, the bounds-checked
    // loop below would run instead of the unchecked one.
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    let in_bounds = {
        let last = (R - 1) * a.row + (ks.end - 1) * a.col;
        last < a.data.len() && (ks.end - 1) * ldb + NR <= b.len()
    };
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    let f32_tile = in_bounds && std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>();
    #[cfg(target_arch = "aarch64")]
    if f32_tile && crate::isa::neon() {
        // SAFETY: the reads are in bounds (`in_bounds`).
        return as_f32_tile(a, b, |a, b| unsafe { tile_f32_neon::<R>(a, b, ldb, ks) });
    }
    #[cfg(target_arch = "x86_64")]
    if W == AVX512 && f32_tile {
        // SAFETY: W is AVX512 only in code compiled for AVX-512F and FMA, run on a CPU that has
        // them; the reads are in bounds (`in_bounds`).
        return as_f32_tile(a, b, |a, b| unsafe { tile_f32_avx512::<R>(a, b, ldb, ks) });
    }
    #[cfg(target_arch = "x86_64")]
    if W == AVX2 && f32_tile {
        // SAFETY: W is AVX2 only in code compiled for AVX2 and FMA, run on a CPU that has them;
        // the reads are in bounds (`in_bounds`).
        return as_f32_tile(a, b, |a, b| unsafe { tile_f32_avx2::<R>(a, b, ldb, ks) });
    }
    tile_portable(a, b, ldb, ks, acc)
}

/// Runs an f32 tile `kernel` on `a` and `b` of a `T` that is f32 (the caller checked), and
/// hands its result back as `T`: the same bits.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
fn as_f32_tile<T: Real, const R: usize>(
    a: Strided<'_, T>,
    b: &[T],
    kernel: impl FnOnce(Strided<'_, f32>, &[f32]) -> [[f32; NR]; R],
) -> [[T; NR]; R] {
    let a32 = Strided {
        data: bytemuck::cast_slice::<T, f32>(a.data),
        row: a.row,
        col: a.col,
    };
    let tile = kernel(a32, bytemuck::cast_slice(b));
    let mut acc = [[lit::<T>(0.0); NR]; R];
    for (acc, row) in acc.iter_mut().zip(&tile) {
        bytemuck::cast_slice_mut::<T, f32>(acc).copy_from_slice(row);
    }
    acc
}

/// [`tile`]'s loop as written, bounds-checked: what any CPU without a hand-written tile runs.
#[inline(always)]
fn tile_portable<T: Real, const R: usize>(
    a: Strided<'_, T>,
    b: &[T],
    ldb: usize,
    ks: Range<usize>,
    mut acc: [[T; NR]; R],
) -> [[T; NR]; R] {
    for p in ks {
        let b_row = &b[p * ldb..][..NR];
        for (i, acc) in acc.iter_mut().enumerate() {
            let x = a.data[i * a.row + p * a.col];
            for (s, &y) in acc.iter_mut().zip(b_row) {
                *s = x.mul_add(y, *s);
            }
        }
    }
    acc
}

/// [`tile`] for f32 with NEON intrinsics (aarch64's baseline), the same fused multiply-adds in
/// the same order, so the same bits. A row's 32 columns are 8 vectors: all of them for 6 rows
/// would need 48 accumulators of NEON's 32 registers, so the tile runs as two halves of 16
/// columns (24 accumulators and 4 loads), each over every `p`.
///
/// # Safety
/// `a` and `b` hold every entry the loop reads (see [`tile`]).
#[cfg(target_arch = "aarch64")]
#[inline]
unsafe fn tile_f32_neon<const R: usize>(
    a: Strided<'_, f32>,
    b: &[f32],
    ldb: usize,
    ks: Range<usize>,
) -> [[f32; NR]; R] {
    use std::arch::aarch64::*;
    let mut out = [[0f32; NR]; R];
    for half in 0..2 {
        // SAFETY: the caller checked that every read is in bounds; `out` rows hold NR floats.
        unsafe {
            let mut acc = [[vdupq_n_f32(0.0); 4]; R];
            for p in ks.clone() {
                let bp = b.as_ptr().add(p * ldb + half * 16);
                let bv = [
                    vld1q_f32(bp),
                    vld1q_f32(bp.add(4)),
                    vld1q_f32(bp.add(8)),
                    vld1q_f32(bp.add(12)),
                ];
                for (i, acc) in acc.iter_mut().enumerate() {
                    let x = vdupq_n_f32(*a.data.get_unchecked(i * a.row + p * a.col));
                    for (s, &y) in acc.iter_mut().zip(&bv) {
                        *s = vfmaq_f32(*s, x, y);
                    }
                }
            }
            for (o, acc) in out.iter_mut().zip(&acc) {
                for (j, &v) in acc.iter().enumerate() {
                    vst1q_f32(o.as_mut_ptr().add(half * 16 + 4 * j), v);
                }
            }
        }
    }
    out
}

/// [`tile`] for f32 with AVX-512 intrinsics: two vectors of accumulators per row.
///
/// # Safety
/// The CPU has AVX-512F and FMA; `a` and `b` hold every entry the loop reads (see [`tile`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
#[inline]
unsafe fn tile_f32_avx512<const R: usize>(
    a: Strided<'_, f32>,
    b: &[f32],
    ldb: usize,
    ks: Range<usize>,
) -> [[f32; NR]; R] {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    for p in ks {
        // SAFETY: the caller checked that every read is in bounds.
        unsafe {
            let bp = b.as_ptr().add(p * ldb);
            let (b0, b1) = (_mm512_loadu_ps(bp), _mm512_loadu_ps(bp.add(16)));
            for (i, acc) in acc.iter_mut().enumerate() {
                let x = _mm512_set1_ps(*a.data.get_unchecked(i * a.row + p * a.col));
                acc[0] = _mm512_fmadd_ps(x, b0, acc[0]);
                acc[1] = _mm512_fmadd_ps(x, b1, acc[1]);
            }
        }
    }
    let mut out = [[0f32; NR]; R];
    for (o, acc) in out.iter_mut().zip(&acc) {
        // SAFETY: `o` holds NR = 32 f32, two vectors.
        unsafe {
            _mm512_storeu_ps(o.as_mut_ptr(), acc[0]);
            _mm512_storeu_ps(o.as_mut_ptr().add(16), acc[1]);
        }
    }
    out
}

/// [`tile`] for f32 with AVX2 intrinsics: a row's 32 columns are 4 vectors, and all of them for
/// 6 rows would need 24 accumulators of AVX2's 16 registers, so the tile runs as two halves of 16
/// columns (12 accumulators, 2 loads and a broadcast), each over every `p`, as the NEON tile does.
///
/// # Safety
/// The CPU has AVX2 and FMA; `a` and `b` hold every entry the loop reads (see [`tile`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn tile_f32_avx2<const R: usize>(
    a: Strided<'_, f32>,
    b: &[f32],
    ldb: usize,
    ks: Range<usize>,
) -> [[f32; NR]; R] {
    use std::arch::x86_64::*;
    let mut out = [[0f32; NR]; R];
    for half in 0..2 {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for p in ks.clone() {
            // SAFETY: the caller checked that every read is in bounds.
            unsafe {
                let bp = b.as_ptr().add(p * ldb + half * 16);
                let (b0, b1) = (_mm256_loadu_ps(bp), _mm256_loadu_ps(bp.add(8)));
                for (i, acc) in acc.iter_mut().enumerate() {
                    let x = _mm256_set1_ps(*a.data.get_unchecked(i * a.row + p * a.col));
                    acc[0] = _mm256_fmadd_ps(x, b0, acc[0]);
                    acc[1] = _mm256_fmadd_ps(x, b1, acc[1]);
                }
            }
        }
        for (o, acc) in out.iter_mut().zip(&acc) {
            // SAFETY: `o` holds NR = 32 f32; this half's 16 are two vectors.
            unsafe {
                _mm256_storeu_ps(o.as_mut_ptr().add(half * 16), acc[0]);
                _mm256_storeu_ps(o.as_mut_ptr().add(half * 16 + 8), acc[1]);
            }
        }
    }
    out
}

/// Where a product's rows go: row `i` of the result at `data[i * ld..]`. A pointer and a length
/// rather than a `&mut [T]`: tasks for different heads of one sequence write disjoint columns of
/// the same rows, which no slice borrow can express.
struct Dest<'a, T> {
    data: *mut T,
    len: usize,
    ld: usize,
    _rows: std::marker::PhantomData<&'a mut [T]>,
}

impl<'a, T: Real> Dest<'a, T> {
    /// The rows of `data`, `ld` apart.
    fn of(data: &'a mut [T], ld: usize) -> Self {
        Dest {
            data: data.as_mut_ptr(),
            len: data.len(),
            ld,
            _rows: std::marker::PhantomData,
        }
    }

    /// The rows of `rows` from element `at` on, `ld` apart.
    ///
    /// # Safety
    /// No other live `Dest` of `rows` writes the elements this one's products write (tasks
    /// own disjoint column ranges of each row).
    unsafe fn columns(rows: SharedRows<T>, at: usize, ld: usize) -> Self {
        assert!(
            at <= rows.len,
            "attention: columns from {at} of {}",
            rows.len
        );
        Dest {
            // SAFETY: `at` is inside the buffer (checked above).
            data: unsafe { rows.ptr.add(at) },
            len: rows.len - at,
            ld,
            _rows: std::marker::PhantomData,
        }
    }

    /// A `[t, dp]` panel's `hd` columns into these rows.
    fn store_panel(&mut self, panel: &[T], pn: &Panels) {
        for (i, row) in panel.chunks(pn.dp).take(pn.t).enumerate() {
            let at = i * self.ld;
            assert!(at + pn.hd <= self.len, "attention: store past the rows");
            // SAFETY: `at..at + hd` is inside the rows (checked above), which this Dest may
            // write (see `Dest::columns`); `row` is a scratch panel.
            unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), self.data.add(at), pn.hd) };
        }
    }

    #[inline(always)]
    fn store<const R: usize>(&mut self, r0: usize, j0: usize, cols: usize, tile: &[[T; NR]; R]) {
        for (i, row) in tile.iter().enumerate() {
            let at = (r0 + i) * self.ld + j0;
            assert!(at + cols <= self.len, "attention: store past the rows");
            // SAFETY: `at..at + cols` is inside the rows (checked above), which this Dest may
            // write (see `Dest::columns`); `row` is a local tile.
            unsafe {
                let dst = self.data.add(at);
                match cols == NR {
                    // A constant length: inline moves instead of a memcpy call per row.
                    true => std::ptr::copy_nonoverlapping(row.as_ptr(), dst, NR),
                    false => std::ptr::copy_nonoverlapping(row.as_ptr(), dst, cols),
                }
            }
        }
    }
}

/// A row-major buffer that tasks write in disjoint column ranges (one per head).
struct SharedRows<T> {
    ptr: *mut T,
    len: usize,
}

impl<T> Clone for SharedRows<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SharedRows<T> {}
// SAFETY: a pointer into a buffer that outlives the parallel loop sharing it; writers own
// disjoint elements (`Dest::columns`).
unsafe impl<T: Send> Send for SharedRows<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SharedRows<T> {}

impl<T> SharedRows<T> {
    /// The buffer an op is filling (see `kernels::written`): written through the pointer only.
    fn new(data: &mut [std::mem::MaybeUninit<T>]) -> Self {
        SharedRows {
            ptr: data.as_mut_ptr().cast(),
            len: data.len(),
        }
    }
}

/// `C = A B` for `m` rows, in tiles: the rows `r0..r1` of a tile sum over `shape(r0, r1).0` and
/// fill columns `0..shape(r0, r1).1` of `C` (computed [`NR`] at a time, so `b` must hold that
/// many columns rounded up to [`NR`]; the extra ones are not stored).
#[inline(always)]
fn product<T: Real, const W: u8>(
    m: usize,
    a: Strided<'_, T>,
    (b, ldb): (&[T], usize),
    mut c: Dest<'_, T>,
    shape: impl Fn(usize, usize) -> (Range<usize>, Range<usize>),
) {
    let mut r0 = 0;
    while r0 < m {
        let rows = MR.min(m - r0);
        let (ks, cols) = shape(r0, r0 + rows);
        // Whole tiles from the one holding the first column (the others are not computed).
        for j0 in (cols.start / NR * NR..cols.end).step_by(NR) {
            let (b, width) = (&b[j0..], NR.min(cols.end - j0));
            if rows == MR {
                let t = tile::<T, MR, W>(a.rows_from(r0), b, ldb, ks.clone());
                c.store(r0, j0, width, &t);
            } else {
                for r in r0..r0 + rows {
                    let t = tile::<T, 1, W>(a.rows_from(r), b, ldb, ks.clone());
                    c.store(r, j0, width, &t);
                }
            }
        }
        r0 += rows;
    }
}

/// One head's operands, copied out of the row-major activations into zero-padded panels:
/// `rows` panels are `[t, dp]` (row `i` at `i * dp`), `cols` panels `[hd, tp]` (the transpose).
struct Panels {
    t: usize,
    hd: usize,
    /// `hd` rounded up to [`NR`].
    dp: usize,
    /// `t` rounded up to [`NR`].
    tp: usize,
}

impl Panels {
    fn new(t: usize, hd: usize) -> Self {
        Panels {
            t,
            hd,
            dp: round_up(hd, NR),
            tp: round_up(t, NR),
        }
    }

    /// `[t, dp]` panel of the `hd` columns at `src[i * ld..]` for row `i`, into `out` (from
    /// [`Scratch::new`]: its padding columns are zero and stay so).
    #[inline(always)]
    fn rows_of<T: Real>(&self, src: &[T], ld: usize, out: &mut [T]) {
        for (i, row) in out.chunks_mut(self.dp).enumerate() {
            row[..self.hd].copy_from_slice(&src[i * ld..i * ld + self.hd]);
        }
    }

    /// `[hd, tp]` panel: the transpose of the `[t, dp]` panel `rows` (from [`Panels::rows_of`]),
    /// into `out` (from [`Scratch::new`]: its padding columns are zero and stay so). Transposed
    /// from the packed panel, which is in L1, rather than from the activations: read by column
    /// there, each element was a cache miss of its own (13% of the forward).
    #[inline(always)]
    fn transpose<T: Real>(&self, rows: &[T], out: &mut [T]) {
        const B: usize = 16;
        for i0 in (0..self.t).step_by(B) {
            for e0 in (0..self.hd).step_by(B) {
                for e in e0..(e0 + B).min(self.hd) {
                    let dst = &mut out[e * self.tp..];
                    for i in i0..(i0 + B).min(self.t) {
                        dst[i] = rows[i * self.dp + e];
                    }
                }
            }
        }
    }
}

/// Asks for the `width` elements at `src[i * ld..]` of each of `rows` rows to be brought into L2,
/// for the next head while this one computes: a head's columns are 256-byte pieces of rows 6 KiB
/// apart, which the hardware prefetchers do not follow, and copied one row at a time each piece
/// waited out the last-level cache's latency (a fifth of the attention's time).
#[inline(always)]
fn prefetch_rows<T>(src: &[T], ld: usize, width: usize, rows: usize) {
    prefetch_raw_rows((src.as_ptr(), src.len()), ld, width, rows)
}

/// [`prefetch_rows`] on a buffer given by pointer and length (one that other tasks are writing).
#[inline(always)]
fn prefetch_raw_rows<T>((src, len): (*const T, usize), ld: usize, width: usize, rows: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let bytes = width * std::mem::size_of::<T>();
        for i in 0..rows {
            if i * ld + width > len {
                return;
            }
            let base = src.wrapping_add(i * ld).cast::<i8>();
            for off in (0..bytes).step_by(64) {
                // SAFETY: a prefetch is a hint, never a read; the address is inside the buffer.
                unsafe { _mm_prefetch::<_MM_HINT_T1>(base.wrapping_add(off)) };
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (src, len, ld, width, rows);
}

/// [`prefetch_rows`] for a head's q, k and v columns (`at`, from [`CausalAttention::head_cols`])
/// of qkv rows `ld` apart, given by pointer and length.
#[inline(always)]
fn prefetch_qkv<T>((rows, len): (*const T, usize), at: [usize; 3], ld: usize, pn: &Panels) {
    for from in at {
        if from < len {
            prefetch_raw_rows((rows.wrapping_add(from), len - from), ld, pn.hd, pn.t);
        }
    }
}

/// Scratch for one sequence's heads, reused across heads and across the sequences of a rayon job:
/// allocated zeroed once, after which every product and softmax writes whole rows and the panel
/// copies leave the padding as it is.
struct Scratch<T> {
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    kt: Vec<T>,
    vt: Vec<T>,
    dy: Vec<T>,
    p: Vec<T>,
    ds: Vec<T>,
    /// Grouped-query attention's backward: one query head's dk and dv, and their sums over the
    /// query heads of a key/value head (`[t, dp]` panels).
    dk: Vec<T>,
    dv: Vec<T>,
    dk_sum: Vec<T>,
    dv_sum: Vec<T>,
}

impl<T: Real> Scratch<T> {
    fn new(pn: &Panels) -> Self {
        let zeros = |n: usize| vec![lit::<T>(0.0); n];
        let (rows, cols, square) = (pn.t * pn.dp, pn.hd * pn.tp, pn.t * pn.tp);
        Scratch {
            q: zeros(rows),
            k: zeros(rows),
            v: zeros(rows),
            kt: zeros(cols),
            vt: zeros(cols),
            dy: zeros(rows),
            p: zeros(square),
            ds: zeros(square),
            dk: zeros(rows),
            dv: zeros(rows),
            dk_sum: zeros(rows),
            dv_sum: zeros(rows),
        }
    }
}

/// Rows packed with several sequences (`TokenBatch::segment_starts`): for every row of the
/// batch, where its sequence starts in its row and one past where it ends.
#[derive(Debug)]
pub(crate) struct Segments {
    starts: Vec<u32>,
    ends: Vec<u32>,
}

impl Segments {
    /// From each row's start (rows of `seq`).
    pub fn new(starts: &[u32], seq: usize) -> Self {
        let mut ends = vec![0u32; starts.len()];
        let seq = seq.max(1);
        for (row_starts, row_ends) in starts.chunks(seq).zip(ends.chunks_mut(seq)) {
            let mut end = row_starts.len() as u32;
            for i in (0..row_starts.len()).rev() {
                row_ends[i] = end;
                if row_starts[i] as usize == i {
                    end = i as u32;
                }
            }
        }
        Segments {
            starts: starts.to_vec(),
            ends,
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) struct CausalAttention {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    /// Key and value heads, each serving `heads / kv_heads` consecutive query heads
    /// (grouped-query attention, without the copies of repeating them); `heads` for multi-head.
    pub kv_heads: usize,
    /// A sliding window: query `i` sees keys `i + 1 - window ..= i` (Mistral's, Qwen's), and the
    /// tiles wholly outside it are not computed. `None`: every earlier key.
    pub window: Option<usize>,
    /// Packed rows: a query sees only its own sequence's keys, and the tiles wholly outside it
    /// are not computed. `None`: each row is one sequence.
    pub segments: Option<std::sync::Arc<Segments>>,
    /// The first row of the sequence a task computes (its place in `segments`).
    offset: usize,
}

impl CausalAttention {
    pub fn new(batch: usize, seq: usize, heads: usize, window: Option<usize>) -> Self {
        CausalAttention {
            batch,
            seq,
            heads,
            kv_heads: heads,
            window,
            segments: None,
            offset: 0,
        }
    }

    /// Grouped-query attention: `kv_heads` key and value heads, the rows `[q | k | v]` with
    /// `heads`, `kv_heads` and `kv_heads` heads' columns.
    pub fn with_kv_heads(mut self, kv_heads: usize) -> Self {
        self.kv_heads = kv_heads;
        self
    }

    /// Query heads per key/value head.
    fn group(&self) -> usize {
        self.heads / self.kv_heads.max(1)
    }

    /// Where query head `h`'s q, k and v columns start in a qkv row, for heads `hd` wide.
    #[inline(always)]
    fn head_cols(&self, h: usize, hd: usize) -> [usize; 3] {
        let (qc, kc, kv) = (self.heads * hd, self.kv_heads * hd, h / self.group());
        [h * hd, qc + kv * hd, qc + kc + kv * hd]
    }

    /// Packed rows (`starts`: `TokenBatch::segment_starts`, or empty for none).
    pub fn with_segments(mut self, starts: &[u32]) -> Self {
        if !starts.is_empty() {
            self.segments = Some(std::sync::Arc::new(Segments::new(starts, self.seq)));
        }
        self
    }

    /// The op for sequence `bi` of the batch.
    fn in_sequence(&self, bi: usize) -> CausalAttention {
        CausalAttention {
            offset: bi * self.seq,
            ..self.clone()
        }
    }

    /// The first key query `i` sees.
    #[inline(always)]
    fn first_key(&self, i: usize) -> usize {
        let window = match self.window {
            Some(w) => (i + 1).saturating_sub(w),
            None => 0,
        };
        match &self.segments {
            Some(s) => window.max(s.starts[self.offset + i] as usize),
            None => window,
        }
    }

    /// One past the last query that sees key `j`.
    #[inline(always)]
    fn queries_end(&self, j: usize) -> usize {
        let window = match self.window {
            Some(w) => (j + w).min(self.seq),
            None => self.seq,
        };
        match &self.segments {
            Some(s) => window.min(s.ends[self.offset + j] as usize),
            None => window,
        }
    }

    /// The output width (the queries' columns) for qkv rows of `cols3` columns, after checking
    /// that `qkv` holds `batch x seq` such rows: every slice and tile below is in bounds by
    /// construction from here.
    fn width(&self, qkv_len: usize, cols3: usize) -> Result<usize> {
        let heads = self.heads + 2 * self.kv_heads;
        let grouped = self.kv_heads > 0 && self.heads % self.kv_heads == 0;
        if self.heads == 0 || !grouped || cols3 == 0 || cols3 % heads != 0 {
            bail!(
                "attention: qkv width {cols3} is not (heads {} + 2 x key/value heads {}) x a \
                 positive head width",
                self.heads,
                self.kv_heads
            );
        }
        let rows = self.batch * self.seq;
        if self.seq == 0 || qkv_len != rows * cols3 {
            bail!(
                "attention: qkv of {qkv_len} elements for {} sequences of {} rows of {cols3}",
                self.batch,
                self.seq
            );
        }
        Ok(cols3 / heads * self.heads)
    }

    /// The causal softmax of `scale * q k^T` for one head into `s.p` (`[t, tp]`, zero above the
    /// diagonal and before a window), from the panels `s.q` and `s.kt`.
    #[inline(always)]
    fn probs<T: Real, const W: u8>(&self, pn: &Panels, s: &mut Scratch<T>, scale: f64) {
        let (t, tp) = (self.seq, pn.tp);
        let q = Strided {
            data: &s.q,
            row: pn.dp,
            col: 1,
        };
        let dest = Dest::of(&mut s.p, tp);
        // Rows r0..r1 see keys first_key(r0)..r1.
        let keys = |r0, r1| (0..pn.hd, self.first_key(r0)..r1);
        product::<T, W>(t, q, (&s.kt, tp), dest, keys);
        for (i, row) in s.p.chunks_mut(tp).enumerate() {
            let (before, row) = row.split_at_mut(self.first_key(i));
            before.fill(lit::<T>(0.0));
            let (live, masked) = row.split_at_mut(i + 1 - before.len());
            let max = lane_max(live);
            for x in live.iter_mut() {
                *x = ((*x - max) * lit::<T>(scale)).exp();
            }
            let inv = lit::<T>(1.0) / lane_sum(live, |x| x);
            live.iter_mut().for_each(|x| *x *= inv);
            masked.fill(lit::<T>(0.0));
        }
    }

    /// `y [b*t, c]`: per sequence and head, `softmax(q k^T) v`, in parallel over sequences and,
    /// where the sequences are fewer than two per thread, over groups of their heads.
    pub(super) fn forward<T: Real>(&self, qkv: &[T], cols3: usize) -> Result<Vec<T>> {
        let c = self.width(qkv.len(), cols3)?;
        let t = self.seq;
        let pn = self.per_sequence(cols3).3;
        let groups = self.head_groups();
        let fill = |out: &mut [std::mem::MaybeUninit<T>]| {
            let y = SharedRows::new(out);
            // One scratch per rayon job, reused by the tasks it runs.
            (0..self.batch * groups).into_par_iter().for_each_init(
                || Scratch::new(&pn),
                |s, task| {
                    let (bi, heads) =
                        (task / groups, even_split(self.heads, groups, task % groups));
                    let x = &qkv[bi * t * cols3..(bi + 1) * t * cols3];
                    let att = self.in_sequence(bi);
                    // SAFETY: this task writes only its heads' columns of sequence bi's rows.
                    unsafe { forward_seq_wide(&att, x, (y, bi * t * c), heads, cols3, s) };
                },
            )
        };
        // SAFETY: every (sequence, head) is one task's, and a head's product writes all t rows
        // of its hd columns: every element is written.
        Ok(unsafe { written(self.batch * t * c, fill) })
    }

    /// Groups of heads each sequence's work splits into: one where the sequences alone give
    /// every thread of the pool two tasks, else enough for that (at most one per head).
    fn head_groups(&self) -> usize {
        let want = 2 * rayon::current_num_threads();
        if self.batch >= want {
            1
        } else {
            want.div_ceil(self.batch.max(1)).clamp(1, self.heads.max(1))
        }
    }

    /// `dqkv [b*t, 3c]` from `dy [b*t, c]`, the probabilities recomputed per (sequence, head):
    /// `dv = p^T dy`, `dp = dy v^T`, `ds = scale p (dp - rowsum(p dp))`, `dq = ds k`,
    /// `dk = ds^T q`.
    pub(super) fn backward<T: Real>(&self, qkv: &[T], dy: &[T], cols3: usize) -> Result<Vec<T>> {
        let c = self.width(qkv.len(), cols3)?;
        let t = self.seq;
        if dy.len() != self.batch * t * c {
            bail!(
                "attention backward: output gradient of {} elements, the output has {}",
                dy.len(),
                self.batch * t * c
            );
        }
        let pn = self.per_sequence(cols3).3;
        // A key/value head's gradient sums over its query heads in one task: the tasks split the
        // key/value heads, each with its whole group of query heads.
        let group = self.group();
        let groups = self.head_groups().min(self.kv_heads);
        let fill = |dqkv: &mut [std::mem::MaybeUninit<T>]| {
            let dx = SharedRows::new(dqkv);
            (0..self.batch * groups).into_par_iter().for_each_init(
                || Scratch::new(&pn),
                |s, task| {
                    let kv = even_split(self.kv_heads, groups, task % groups);
                    let (bi, heads) = (task / groups, kv.start * group..kv.end * group);
                    let x = &qkv[bi * t * cols3..(bi + 1) * t * cols3];
                    let g = &dy[bi * t * c..(bi + 1) * t * c];
                    let att = self.in_sequence(bi);
                    // SAFETY: this task writes only its heads' columns of sequence bi's rows.
                    unsafe { backward_seq_wide(&att, x, g, (dx, bi * t * cols3), heads, cols3, s) };
                },
            )
        };
        // SAFETY: every (sequence, head) is one task's, and its dq, dk and dv products each write
        // all t rows of the head's hd columns: every element is written.
        Ok(unsafe { written(qkv.len(), fill) })
    }

    /// What every head of a sequence shares: the model width, the head width, the softmax scale
    /// and the panels' shapes.
    fn per_sequence(&self, cols3: usize) -> (usize, usize, f64, Panels) {
        let hd = cols3 / (self.heads + 2 * self.kv_heads).max(1);
        let c = hd * self.heads;
        (c, hd, 1.0 / (hd as f64).sqrt(), Panels::new(self.seq, hd))
    }

    /// Heads `heads` of one sequence's forward: `x` its qkv rows, `y` the output and where the
    /// sequence's rows start in it, `s` scratch from [`Scratch::new`] for these shapes (every
    /// head overwrites what it reads of it).
    ///
    /// # Safety
    /// No other task writes these heads' columns of the sequence's output rows.
    #[inline(always)]
    unsafe fn forward_seq<T: Real, const W: u8>(
        &self,
        x: &[T],
        (y, at): (SharedRows<T>, usize),
        heads: Range<usize>,
        cols3: usize,
        s: &mut Scratch<T>,
    ) {
        let (c, hd, scale, pn) = self.per_sequence(cols3);
        for h in heads.clone() {
            if h + 1 < heads.end {
                prefetch_qkv((x.as_ptr(), x.len()), self.head_cols(h + 1, hd), cols3, &pn);
            }
            let [oq, ok, ov] = self.head_cols(h, hd);
            pn.rows_of(&x[oq..], cols3, &mut s.q);
            // The query heads of one key/value head share its panels.
            if h == heads.start || h % self.group() == 0 {
                pn.rows_of(&x[ok..], cols3, &mut s.k);
                pn.transpose(&s.k, &mut s.kt);
                pn.rows_of(&x[ov..], cols3, &mut s.v);
            }
            self.probs::<T, W>(&pn, s, scale);
            let probs = Strided::by_row(&s.p, pn.tp);
            // SAFETY: head h's columns of this sequence's rows are this task's (the caller's
            // contract).
            let dest = unsafe { Dest::columns(y, at + h * hd, c) };
            // Rows r0..r1 weigh the values of keys first_key(r0)..r1 (the rest of their row is
            // zero).
            let keys = |r0, r1| (self.first_key(r0)..r1, 0..hd);
            product::<T, W>(self.seq, probs, (&s.v, pn.dp), dest, keys);
        }
    }

    /// Heads `heads` of one sequence's backward: `x` its qkv rows, `g` its output gradient rows,
    /// `dx` the qkv gradient and where the sequence's rows start in it, `s` as in
    /// [`CausalAttention::forward_seq`]. With grouped-query attention `heads` holds whole groups:
    /// each key/value head's dk and dv are the sums over its query heads, in their order.
    ///
    /// # Safety
    /// No other task writes these heads' columns of the sequence's qkv gradient rows (nor their
    /// key/value heads').
    #[inline(always)]
    unsafe fn backward_seq<T: Real, const W: u8>(
        &self,
        x: &[T],
        g: &[T],
        (dx, at): (SharedRows<T>, usize),
        heads: Range<usize>,
        cols3: usize,
        s: &mut Scratch<T>,
    ) {
        let (c, hd, scale, pn) = self.per_sequence(cols3);
        let group = self.group();
        for h in heads.clone() {
            if h + 1 < heads.end {
                let next = self.head_cols(h + 1, hd);
                prefetch_qkv((x.as_ptr(), x.len()), next, cols3, &pn);
                let rows = (
                    dx.ptr.wrapping_add(at).cast_const(),
                    dx.len.saturating_sub(at),
                );
                prefetch_qkv(rows, next, cols3, &pn);
                prefetch_rows(&g[(h + 1) * hd..], c, hd, self.seq);
            }
            let cols = self.head_cols(h, hd);
            let first = h % group == 0;
            // SAFETY: head h's q columns, and below its key/value head's, are this task's (the
            // caller's contract).
            let dq = unsafe { Dest::columns(dx, at + cols[0], cols3) };
            let operands = (x, g, dq, cols, cols3);
            if group == 1 {
                // SAFETY: as above.
                let dk = unsafe { Dest::columns(dx, at + cols[1], cols3) };
                let dv = unsafe { Dest::columns(dx, at + cols[2], cols3) };
                self.head_backward::<T, W>(&pn, s, operands, (dk, dv), scale);
                continue;
            }
            let (mut dk, mut dv) = (std::mem::take(&mut s.dk), std::mem::take(&mut s.dv));
            let into = (Dest::of(&mut dk, pn.dp), Dest::of(&mut dv, pn.dp));
            self.head_backward::<T, W>(&pn, s, operands, into, scale);
            for (sum, part) in [(&mut s.dk_sum, &dk), (&mut s.dv_sum, &dv)] {
                match first {
                    true => sum.copy_from_slice(part),
                    false => sum.iter_mut().zip(part.iter()).for_each(|(a, &b)| *a += b),
                }
            }
            (s.dk, s.dv) = (dk, dv);
            if h % group == group - 1 {
                // SAFETY: as above.
                unsafe { Dest::columns(dx, at + cols[1], cols3) }.store_panel(&s.dk_sum, &pn);
                unsafe { Dest::columns(dx, at + cols[2], cols3) }.store_panel(&s.dv_sum, &pn);
            }
        }
    }

    /// One query head's share of [`CausalAttention::backward`] for one sequence: `x` its qkv
    /// rows, `g` its output gradient rows, `dq` where the head's query gradient goes, `cols` its
    /// q, k and v columns ([`CausalAttention::head_cols`]); its dk and dv into `dkv`. The head's
    /// k and v panels are read again only for the first head of a key/value head's group.
    #[inline(always)]
    fn head_backward<T: Real, const W: u8>(
        &self,
        pn: &Panels,
        s: &mut Scratch<T>,
        (x, g, dq, [oq, ok, ov], cols3): (&[T], &[T], Dest<'_, T>, [usize; 3], usize),
        (dk, dv): (Dest<'_, T>, Dest<'_, T>),
        scale: f64,
    ) {
        let (t, hd, dp, tp) = (self.seq, pn.hd, pn.dp, pn.tp);
        pn.rows_of(&x[oq..], cols3, &mut s.q);
        if (oq / hd) % self.group() == 0 {
            pn.rows_of(&x[ok..], cols3, &mut s.k);
            pn.transpose(&s.k, &mut s.kt);
            pn.rows_of(&x[ov..], cols3, &mut s.v);
            pn.transpose(&s.v, &mut s.vt);
        }
        pn.rows_of(&g[oq..], self.heads * hd, &mut s.dy);
        self.probs::<T, W>(pn, s, scale);
        // Keys j0..j1 are seen by queries j0..queries_end(j1 - 1): dv = p^T dy over those.
        let keys_seen = |j0: usize, j1: usize| (j0..self.queries_end(j1 - 1), 0..hd);
        product::<T, W>(t, Strided::by_col(&s.p, tp), (&s.dy, dp), dv, keys_seen);
        // dp = dy v^T, rows r0..r1 over keys first_key(r0)..r1, into ds.
        let dy = Strided {
            data: &s.dy,
            row: dp,
            col: 1,
        };
        let keys = |r0, r1| (0..hd, self.first_key(r0)..r1);
        product::<T, W>(t, dy, (&s.vt, tp), Dest::of(&mut s.ds, tp), keys);
        for (i, (dsr, pr)) in s.ds.chunks_mut(tp).zip(s.p.chunks(tp)).enumerate() {
            let live = self.first_key(i)..i + 1;
            let dot = lane_dot(&pr[live.clone()], &dsr[live.clone()]);
            for (d, &p) in dsr[live.clone()].iter_mut().zip(&pr[live.clone()]) {
                *d = lit::<T>(scale) * p * (*d - dot);
            }
            dsr[..live.start].fill(lit::<T>(0.0));
            dsr[live.end..].fill(lit::<T>(0.0));
        }
        // dq = ds k over keys first_key(r0)..r1; dk = ds^T q over the queries that see a key.
        let queries = |r0, r1| (self.first_key(r0)..r1, 0..hd);
        product::<T, W>(t, Strided::by_row(&s.ds, tp), (&s.k, dp), dq, queries);
        product::<T, W>(t, Strided::by_col(&s.ds, tp), (&s.q, dp), dk, keys_seen);
    }
}

/// `$body` (an `#[inline(always)]` method of [`CausalAttention`]) compiled for AVX-512 with FMA,
/// AVX2 with FMA, or as built, chosen at run time. A named function per width rather than
/// `kernels::wide`'s closure: LLVM does not inline a body this large into the wide function, and
/// outside it `mul_add` is a library call. Unsafe as the bodies are: the caller owns what they
/// write.
macro_rules! wide_fn {
    ($name:ident, $body:ident, ($($arg:ident: $ty:ty),*)) => {
        unsafe fn $name<T: Real>(att: &CausalAttention, $($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,fma")]
                unsafe fn avx512<T: Real>(att: &CausalAttention, $($arg: $ty),*) {
                    att.$body::<T, AVX512>($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2<T: Real>(att: &CausalAttention, $($arg: $ty),*) {
                    att.$body::<T, AVX2>($($arg),*)
                }
                match Width::of_cpu() {
                    // SAFETY: the CPU has AVX-512F and FMA (`Width::of_cpu`).
                    Width::Avx512 => return unsafe { avx512(att, $($arg),*) },
                    // SAFETY: the CPU has AVX2 and FMA (`Width::of_cpu`).
                    Width::Avx2 => return unsafe { avx2(att, $($arg),*) },
                    Width::Baseline => {}
                }
            }
            // SAFETY: the caller's contract, passed on.
            unsafe { att.$body::<T, BASE>($($arg),*) }
        }
    };
}

wide_fn!(forward_seq_wide, forward_seq, (x: &[T], y: (SharedRows<T>, usize), heads: Range<usize>, cols3: usize, s: &mut Scratch<T>));
wide_fn!(backward_seq_wide, backward_seq, (x: &[T], g: &[T], dx: (SharedRows<T>, usize), heads: Range<usize>, cols3: usize, s: &mut Scratch<T>));

#[cfg(test)]
mod tests {
    use super::CausalAttention;

    /// The hand-written f32 tiles of this CPU (NEON on aarch64; AVX2 and AVX-512 where it has them)
    /// gives the portable loop's bits, for every row count and inner lengths around the lanes.
    #[test]
    fn the_intrinsic_tiles_equal_the_portable_loop_bit_for_bit() {
        use super::{tile_portable, Strided, MR, NR};
        let (rows, inner) = (MR, 37);
        let a: Vec<f32> = (0..rows * inner)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        let b: Vec<f32> = (0..inner * NR)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.021)
            .collect();
        let strided = Strided {
            data: &a[..],
            row: inner,
            col: 1,
        };
        let bits =
            |t: &[[f32; NR]; MR]| -> Vec<u32> { t.iter().flatten().map(|v| v.to_bits()).collect() };
        let mut checked = 0;
        for ks in [0..inner, 3..inner, 0..1, 5..6, 0..0] {
            let want = tile_portable::<f32, MR>(strided, &b, NR, ks.clone(), [[0.0; NR]; MR]);
            #[cfg(target_arch = "aarch64")]
            if !ks.is_empty() {
                // SAFETY: every read of a 6 x 37 matrix and a 37 x 32 one is in bounds.
                let got = unsafe { super::tile_f32_neon::<MR>(strided, &b, NR, ks.clone()) };
                assert_eq!(bits(&got), bits(&want), "NEON tile over {ks:?}");
                checked += 1;
            }
            #[cfg(target_arch = "x86_64")]
            if !ks.is_empty()
                && std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("fma")
            {
                // SAFETY: the CPU has AVX-512F and FMA; the reads are in bounds as above.
                let got = unsafe { super::tile_f32_avx512::<MR>(strided, &b, NR, ks.clone()) };
                assert_eq!(bits(&got), bits(&want), "AVX-512 tile over {ks:?}");
                checked += 1;
            }
            #[cfg(target_arch = "x86_64")]
            if !ks.is_empty()
                && std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                // SAFETY: the CPU has AVX2 and FMA; the reads are in bounds as above.
                let got = unsafe { super::tile_f32_avx2::<MR>(strided, &b, NR, ks.clone()) };
                assert_eq!(bits(&got), bits(&want), "AVX2 tile over {ks:?}");
                checked += 1;
            }
        }
        if checked == 0 {
            eprintln!("SKIPPED: this CPU has no hand-written attention tile");
        }
    }

    /// Causal attention in f64 from the definition, for one sequence: `y [t, c]` and, for the
    /// output gradient `dy`, `dqkv [t, 3c]`.
    /// The definition in f64, each query `i` over keys `lo(i)..=i` (`lo` 0 without a window).
    fn attention_f64(
        qkv: &[f64],
        dy: &[f64],
        (t, heads): (usize, usize),
        window: Option<usize>,
    ) -> (Vec<f64>, Vec<f64>) {
        let c3 = qkv.len() / t;
        let (c, hd) = (c3 / 3, c3 / 3 / heads);
        let scale = 1.0 / (hd as f64).sqrt();
        let (mut y, mut d) = (vec![0.0; t * c], vec![0.0; t * c3]);
        let at = |i: usize, part: usize, h: usize, e: usize| i * c3 + part * c + h * hd + e;
        for h in 0..heads {
            for i in 0..t {
                let keys = window.map_or(0, |w| (i + 1).saturating_sub(w))..i + 1;
                let s: Vec<f64> = (keys.clone())
                    .map(|j| {
                        scale
                            * (0..hd)
                                .map(|e| qkv[at(i, 0, h, e)] * qkv[at(j, 1, h, e)])
                                .sum::<f64>()
                    })
                    .collect();
                let max = s.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = s.iter().map(|x| (x - max).exp()).sum();
                let p: Vec<f64> = s.iter().map(|x| (x - max).exp() / z).collect();
                for e in 0..hd {
                    y[i * c + h * hd + e] = keys
                        .clone()
                        .zip(&p)
                        .map(|(j, pj)| pj * qkv[at(j, 2, h, e)])
                        .sum();
                }
                // dp_j = dy_i . v_j; ds_j = p_j (dp_j - sum_k p_k dp_k)
                let g = |e: usize| dy[i * c + h * hd + e];
                let dp: Vec<f64> = (keys.clone())
                    .map(|j| (0..hd).map(|e| g(e) * qkv[at(j, 2, h, e)]).sum())
                    .collect();
                let dot: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for (n, j) in keys.enumerate() {
                    let ds = scale * p[n] * (dp[n] - dot);
                    for e in 0..hd {
                        d[at(i, 0, h, e)] += ds * qkv[at(j, 1, h, e)];
                        d[at(j, 1, h, e)] += ds * qkv[at(i, 0, h, e)];
                        d[at(j, 2, h, e)] += p[n] * g(e);
                    }
                }
            }
        }
        (y, d)
    }

    /// Deterministic qkv rows and output gradients for `batch` sequences of `t` rows, and the
    /// qkv width.
    fn inputs(batch: usize, t: usize, heads: usize, hd: usize) -> (Vec<f32>, Vec<f32>, usize) {
        let c3 = 3 * heads * hd;
        let qkv = (0..batch * t * c3)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.7)
            .collect();
        let dy = (0..batch * t * c3 / 3)
            .map(|i| (i * 104_729 % 1000) as f32 / 500.0 - 1.0)
            .collect();
        (qkv, dy, c3)
    }

    /// `attn`'s forward and backward against the definition in f64, sequence by sequence.
    fn assert_matches_the_definition(attn: CausalAttention, hd: usize) {
        let (batch, t, heads) = (attn.batch, attn.seq, attn.heads);
        let (qkv, dy, c3) = inputs(batch, t, heads, hd);
        let y = attn.forward(&qkv, c3).unwrap();
        let d = attn.backward(&qkv, &dy, c3).unwrap();
        for b in 0..batch {
            let wide = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
            let (rq, ry) = (b * t * c3, b * t * c3 / 3);
            let (y64, d64) = attention_f64(
                &wide(&qkv[rq..rq + t * c3]),
                &wide(&dy[ry..ry + t * c3 / 3]),
                (t, heads),
                attn.window,
            );
            let close = |got: &[f32], want: &[f64], what: &str| {
                for (i, (g, w)) in got.iter().zip(want).enumerate() {
                    let err = (f64::from(*g) - w).abs();
                    assert!(
                        err <= 1e-5 * (1.0 + w.abs()),
                        "{what}[{i}] {g} vs {w} (t {t}, window {:?})",
                        attn.window
                    );
                }
            };
            close(&y[ry..ry + t * c3 / 3], &y64, "y");
            close(&d[rq..rq + t * c3], &d64, "dqkv");
        }
    }

    #[test]
    fn blocked_causal_attention_matches_the_definition() {
        // Odd and even lengths (uneven query blocks), one row, two sequences.
        for (batch, t, heads, hd) in [(2, 7, 2, 4), (1, 8, 1, 3), (1, 1, 2, 2), (2, 33, 3, 5)] {
            let attn = CausalAttention::new(batch, t, heads, None);
            assert_matches_the_definition(attn, hd);
        }
    }

    /// Packed rows: each sequence of a row attends only to itself, exactly as if it were a row
    /// of its own (the definition run on each sequence's rows alone); sequences shorter and
    /// longer than a 32-row tile, with and without a window.
    #[test]
    fn packed_rows_attend_within_their_own_sequence() {
        let (heads, hd, t) = (2, 4, 80);
        let row0: Vec<(usize, usize)> = vec![(0, 13), (13, 50), (50, 51), (51, 80)];
        let row1: Vec<(usize, usize)> = vec![(0, 80)];
        let starts: Vec<u32> = [&row0, &row1]
            .iter()
            .flat_map(|segs| {
                segs.iter()
                    .flat_map(|&(a, b)| (a..b).map(move |_| a as u32))
            })
            .collect();
        for window in [None, Some(20)] {
            let attn = CausalAttention::new(2, t, heads, window).with_segments(&starts);
            let (qkv, dy, c3) = inputs(2, t, heads, hd);
            let y = attn.forward(&qkv, c3).unwrap();
            let d = attn.backward(&qkv, &dy, c3).unwrap();
            let wide = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
            for (b, segs) in [&row0, &row1].iter().enumerate() {
                for &(lo, hi) in segs.iter() {
                    let (r0, r1) = (b * t + lo, b * t + hi);
                    let (y64, d64) = attention_f64(
                        &wide(&qkv[r0 * c3..r1 * c3]),
                        &wide(&dy[r0 * c3 / 3..r1 * c3 / 3]),
                        (hi - lo, heads),
                        window,
                    );
                    let close = |got: &[f32], want: &[f64], what: &str| {
                        for (g, w) in got.iter().zip(want) {
                            let err = (f64::from(*g) - w).abs();
                            assert!(
                                err <= 1e-5 * (1.0 + w.abs()),
                                "{what} row {b} {lo}..{hi}: {g} vs {w}"
                            );
                        }
                    };
                    close(&y[r0 * c3 / 3..r1 * c3 / 3], &y64, "y");
                    close(&d[r0 * c3..r1 * c3], &d64, "dqkv");
                }
            }
        }
    }

    /// A sliding window: query i over keys i + 1 - w ..= i, the tiles before it skipped (a
    /// window of 20 over 80 rows skips whole 32-column tiles), also windows of 1, of a tile's
    /// width and of the whole sequence.
    #[test]
    fn windowed_attention_matches_the_definition() {
        for (batch, t, heads, hd, w) in [
            (1, 80, 2, 8, 20),
            (2, 33, 3, 5, 7),
            (1, 70, 1, 4, 32),
            (1, 9, 2, 3, 1),
            (1, 12, 2, 4, 12),
        ] {
            let attn = CausalAttention::new(batch, t, heads, Some(w));
            assert_matches_the_definition(attn, hd);
        }
    }

    /// Heads split into groups across threads (when sequences are fewer than two per thread)
    /// compute exactly what one thread computes: every head is the same arithmetic either way.
    #[test]
    fn head_groups_give_the_same_bits_as_one_thread() {
        let (batch, t, heads, hd) = (2, 19, 6, 8);
        let (qkv, dy, c3) = inputs(batch, t, heads, hd);
        let attn = CausalAttention::new(batch, t, heads, None);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                assert_eq!(
                    attn.head_groups(),
                    if threads == 1 { 1 } else { heads.min(threads) }
                );
                (
                    attn.forward(&qkv, c3).unwrap(),
                    attn.backward(&qkv, &dy, c3).unwrap(),
                )
            })
        };
        let one = run(1);
        for threads in [3, 6] {
            assert!(run(threads) == one, "{threads} threads");
        }
    }

    /// Grouped-query attention reads each key/value head for its group of query heads: the
    /// output and dq are the multi-head kernel's on the keys and values repeated to every query
    /// head, bit for bit, and each key/value head's dk and dv the sum of its query heads'
    /// (summed in their order), with and without a window, on one thread and on several.
    #[test]
    fn grouped_query_attention_is_multi_head_on_repeated_keys_and_values() {
        for (batch, t, heads, kv, hd, window) in [
            (2, 19, 6, 2, 8, None),
            (1, 40, 6, 3, 5, Some(9)),
            (3, 7, 4, 1, 4, None),
        ] {
            let group = heads / kv;
            let (q, k) = (heads * hd, kv * hd);
            let cols = q + 2 * k;
            let (full, dy, c3) = inputs(batch, t, heads, hd);
            // The first head of each group's k and v, packed after the queries.
            let rows = batch * t;
            let mut gqa = vec![0f32; rows * cols];
            for r in 0..rows {
                let src = &full[r * c3..(r + 1) * c3];
                gqa[r * cols..r * cols + q].copy_from_slice(&src[..q]);
                for j in 0..kv {
                    let h = j * group;
                    for (part, at) in [(1, q + j * hd), (2, q + k + j * hd)] {
                        let from = part * q + h * hd;
                        gqa[r * cols + at..r * cols + at + hd]
                            .copy_from_slice(&src[from..from + hd]);
                    }
                }
            }
            // The same keys and values repeated to every query head.
            let mut mha = vec![0f32; rows * c3];
            for r in 0..rows {
                mha[r * c3..r * c3 + q].copy_from_slice(&gqa[r * cols..r * cols + q]);
                for h in 0..heads {
                    for (part, at) in [(1, q + h / group * hd), (2, q + k + h / group * hd)] {
                        let to = r * c3 + part * q + h * hd;
                        mha[to..to + hd].copy_from_slice(&gqa[r * cols + at..r * cols + at + hd]);
                    }
                }
            }
            let multi = CausalAttention::new(batch, t, heads, window);
            let grouped = multi.clone().with_kv_heads(kv);
            let (y_m, d_m) = (
                multi.forward(&mha, c3).unwrap(),
                multi.backward(&mha, &dy, c3).unwrap(),
            );
            for threads in [1, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let (y, d) = pool.install(|| {
                    (
                        grouped.forward(&gqa, cols).unwrap(),
                        grouped.backward(&gqa, &dy, cols).unwrap(),
                    )
                });
                assert!(y == y_m, "y: {heads} heads on {kv}, {threads} threads");
                for r in 0..rows {
                    let (got, want) = (&d[r * cols..(r + 1) * cols], &d_m[r * c3..(r + 1) * c3]);
                    assert!(got[..q] == want[..q], "dq row {r}");
                    for j in 0..kv {
                        for (part, at) in [(1, q + j * hd), (2, q + k + j * hd)] {
                            for e in 0..hd {
                                let head = |h: usize| want[part * q + h * hd + e];
                                let sum = (j * group + 1..(j + 1) * group)
                                    .fold(head(j * group), |a, h| a + head(h));
                                assert!(got[at + e] == sum, "d{part} row {r} kv head {j}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn mismatched_shapes_are_errors_not_panics() {
        let attn = CausalAttention::new(2, 4, 2, None);
        let c3 = 3 * 2 * 3;
        let qkv = vec![0.1f32; 2 * 4 * c3];
        let dy = vec![0.1f32; 2 * 4 * c3 / 3];
        assert!(attn.forward(&qkv, c3).is_ok());
        assert!(attn.forward(&qkv[1..], c3).is_err());
        assert!(attn.forward(&qkv, c3 - 1).is_err());
        assert!(attn.forward::<f32>(&[], 0).is_err());
        assert!(attn.backward(&qkv, &dy[1..], c3).is_err());
        assert!(attn.backward(&qkv[3..], &dy, c3).is_err());
        let empty = CausalAttention {
            seq: 0,
            ..attn.clone()
        };
        assert!(empty.forward::<f32>(&[], c3).is_err());
    }
}
