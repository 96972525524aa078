//! Flat-buffer numeric kernels: norms, overflow checks, scaling, gradient accumulation and
//! dtype casts over `f32`, `bf16` and `f16` slices.
//!
//! Every kernel here works on plain slices (no tensor library) and follows three rules:
//!
//! * **Deterministic.** Element-wise kernels are trivially so. Reductions ([`sum_of_squares`]) cut
//!   the slice into fixed [`REDUCE_BLOCK`]-element blocks and combine the block sums in a binary
//!   tree whose shape depends only on the slice length, never on the thread count or on which
//!   thread finished first. A run with 1 thread and a run with 16 give the same bits, which the
//!   ZeRO equivalence tests (every stage, every world size, same losses) rely on.
//! * **Fast.** Inner loops are straight slice loops the compiler vectorises; slices of at least
//!   [`PAR_MIN_LEN`] elements are split into [`PAR_CHUNK`]-element chunks across the rayon pool.
//! * **No allocation.** 16-bit data is widened to `f32` in [`TILE`]-element stack buffers, so the
//!   `f32` arithmetic is shared by all dtypes and nothing touches the heap.
//!
//! 16-bit rounding is round-to-nearest-even (the `half` crate's conversions, which use F16C when
//! the CPU has it), the same as `torch.Tensor.to(torch.bfloat16)` and DeepSpeed's AVX-512 path.

use half::{bf16, f16, slice::HalfFloatSliceExt};
use rayon::prelude::*;

/// Slices with at least this many elements are processed in parallel; shorter ones run on the
/// calling thread, where rayon's fork/join overhead (a few microseconds) would dominate.
pub const PAR_MIN_LEN: usize = 1 << 16;

/// Elements per parallel work item: 32K elements = 128 KiB per `f32` stream, so the 3-5 streams of
/// an Adam step stay in L2 while a core works on its chunk.
pub const PAR_CHUNK: usize = 1 << 15;

/// Elements per leaf of the deterministic reduction tree. Fixed, so that the summation order is a
/// function of the slice length alone.
pub const REDUCE_BLOCK: usize = 1 << 14;

/// Elements per stack tile used to widen 16-bit data to `f32` (4 KiB per buffer).
pub const TILE: usize = 1024;

/// Independent `f64` accumulators per reduction leaf: enough to fill a vector register pair and
/// break the add dependency chain, while keeping a fixed order of summation.
const LANES: usize = 8;

/// A floating-point element type the kernels accept: `f32`, [`bf16`](struct@half::bf16) or [`f16`](struct@half::f16).
///
/// The trait only moves data between the type and `f32`; all arithmetic happens in `f32` (or
/// `f64` for reductions), which is how mixed precision keeps its accuracy.
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// `true` only for `f32`, whose slices are used in place instead of being copied to a tile.
    const IS_F32: bool;
    /// Name used in messages and benchmark output.
    const NAME: &'static str;
    /// Bytes per element.
    const BYTES: usize = std::mem::size_of::<Self>();

    /// Writes `src` widened to `f32` into `dst` (same length). Exact for every type.
    fn widen(src: &[Self], dst: &mut [f32]);
    /// Writes `src` rounded to nearest even into `dst` (same length).
    fn narrow(src: &[f32], dst: &mut [Self]);
    /// Whether any element of `src` is +-Inf or NaN, from the exponent bits alone (vectorises).
    fn any_non_finite(src: &[Self]) -> bool;
}

impl Element for f32 {
    const IS_F32: bool = true;
    const NAME: &'static str = "f32";

    #[inline(always)]
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    #[inline(always)]
    fn narrow(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    fn any_non_finite(src: &[f32]) -> bool {
        const EXP: u32 = 0x7f80_0000;
        let bits: &[u32] = bytemuck::cast_slice(src);
        bits.iter()
            .fold(0u32, |acc, &b| acc | u32::from(b & EXP == EXP))
            != 0
    }
}

impl Element for bf16 {
    const IS_F32: bool = false;
    const NAME: &'static str = "bf16";

    // inline(always) here and in `narrow`: the Adam kernel's AVX2 and AVX-512 builds must
    // inline these loops to vectorise them at their width.
    #[inline(always)]
    fn widen(src: &[bf16], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len(), "bf16 widen: lengths differ");
        let bits: &[u16] = bytemuck::cast_slice(src);
        for (d, &b) in dst.iter_mut().zip(bits) {
            *d = f32::from_bits(u32::from(b) << 16);
        }
    }

    #[inline(always)]
    fn narrow(src: &[f32], dst: &mut [bf16]) {
        assert_eq!(src.len(), dst.len(), "bf16 narrow: lengths differ");
        let bits: &mut [u16] = bytemuck::cast_slice_mut(dst);
        for (d, &x) in bits.iter_mut().zip(src) {
            *d = crate::flat::f32_to_bf16_bits(x);
        }
    }

    fn any_non_finite(src: &[bf16]) -> bool {
        const EXP: u16 = 0x7f80;
        let bits: &[u16] = bytemuck::cast_slice(src);
        bits.iter()
            .fold(0u16, |acc, &b| acc | u16::from(b & EXP == EXP))
            != 0
    }
}

impl Element for f16 {
    const IS_F32: bool = false;
    const NAME: &'static str = "f16";

    fn widen(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }

    fn narrow(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
    }

    fn any_non_finite(src: &[f16]) -> bool {
        const EXP: u16 = 0x7c00;
        let bits: &[u16] = bytemuck::cast_slice(src);
        bits.iter()
            .fold(0u16, |acc, &b| acc | u16::from(b & EXP == EXP))
            != 0
    }
}

/// Calls `f` on consecutive `f32` views of `src`, at most [`TILE`] elements each: `src` itself
/// when it is `f32`, otherwise a widened copy in a stack buffer.
#[inline]
pub(crate) fn for_each_f32_tile<E: Element>(src: &[E], mut f: impl FnMut(&[f32])) {
    if E::IS_F32 {
        f(bytemuck::cast_slice(src));
        return;
    }
    let mut buf = [0f32; TILE];
    for tile in src.chunks(TILE) {
        let view = &mut buf[..tile.len()];
        E::widen(tile, view);
        f(view);
    }
}

/// Applies `op(dst_f32, src_f32)` tile by tile, widening 16-bit operands into stack buffers and
/// rounding a 16-bit destination back once per tile. `dst.len() == src.len()`.
#[inline]
fn zip_tiles<D: Element, S: Element>(dst: &mut [D], src: &[S], op: &impl Fn(&mut [f32], &[f32])) {
    if D::IS_F32 && S::IS_F32 {
        op(bytemuck::cast_slice_mut(dst), bytemuck::cast_slice(src));
        return;
    }
    let mut dbuf = [0f32; TILE];
    let mut sbuf = [0f32; TILE];
    for (d, s) in dst.chunks_mut(TILE).zip(src.chunks(TILE)) {
        let n = d.len();
        let s32: &[f32] = if S::IS_F32 {
            bytemuck::cast_slice(s)
        } else {
            S::widen(s, &mut sbuf[..n]);
            &sbuf[..n]
        };
        if D::IS_F32 {
            op(bytemuck::cast_slice_mut(d), s32);
        } else {
            let d32 = &mut dbuf[..n];
            D::widen(d, d32);
            op(d32, s32);
            D::narrow(d32, d);
        }
    }
}

/// Element-wise `op` over `dst` and `src`, in parallel chunks for long slices.
fn zip_apply<D: Element, S: Element>(
    dst: &mut [D],
    src: &[S],
    op: impl Fn(&mut [f32], &[f32]) + Sync,
) {
    assert_eq!(
        dst.len(),
        src.len(),
        "element-wise kernel: destination has {} elements but source has {}",
        dst.len(),
        src.len()
    );
    if dst.len() >= PAR_MIN_LEN {
        dst.par_chunks_mut(PAR_CHUNK)
            .zip(src.par_chunks(PAR_CHUNK))
            .for_each(|(d, s)| zip_tiles(d, s, &op));
    } else {
        zip_tiles(dst, src, &op);
    }
}

/// Sum of squares of one leaf block, in `f64`, in a fixed order: element `i` goes to lane
/// `i % LANES`, lanes are added left to right at the end.
fn block_sum_of_squares<E: Element>(block: &[E]) -> f64 {
    let mut lanes = [0f64; LANES];
    let mut tail = 0f64;
    // Tiles are multiples of LANES long except possibly the last, so the lane of an element is
    // the same whether or not the data went through a tile buffer.
    for_each_f32_tile(block, |x| {
        let mut chunks = x.chunks_exact(LANES);
        for c in &mut chunks {
            for (acc, &v) in lanes.iter_mut().zip(c) {
                let v = f64::from(v);
                *acc += v * v;
            }
        }
        for &v in chunks.remainder() {
            let v = f64::from(v);
            tail += v * v;
        }
    });
    lanes.iter().sum::<f64>() + tail
}

/// Sums the blocks `lo..hi` of `x` as a balanced binary tree split at the midpoint. The tree's
/// shape depends only on `hi - lo`; `rayon::join` may run the halves on different threads but
/// the addition `left + right` is always the same.
fn tree_sum_of_squares<E: Element>(x: &[E], lo: usize, hi: usize) -> f64 {
    if hi - lo == 1 {
        let start = lo * REDUCE_BLOCK;
        let end = (start + REDUCE_BLOCK).min(x.len());
        return block_sum_of_squares(&x[start..end]);
    }
    let mid = lo + (hi - lo) / 2;
    let (left, right) = if (hi - lo) * REDUCE_BLOCK >= PAR_MIN_LEN {
        rayon::join(
            || tree_sum_of_squares(x, lo, mid),
            || tree_sum_of_squares(x, mid, hi),
        )
    } else {
        (
            tree_sum_of_squares(x, lo, mid),
            tree_sum_of_squares(x, mid, hi),
        )
    };
    left + right
}

/// Sum of the squares of all elements, accumulated in `f64`, bitwise reproducible whatever the
/// thread count (see the module docs). The square root of the total over all shards is the
/// global gradient norm that `gradient_clipping` uses.
///
/// The result is not finite exactly when some element is Inf or NaN: an `f32` squared is at most
/// about 1.2e77, so finite inputs cannot overflow `f64`. That makes this also the fused overflow
/// check: see [`norm_and_finite`].
pub fn sum_of_squares<E: Element>(x: &[E]) -> f64 {
    if x.is_empty() {
        return 0.0;
    }
    tree_sum_of_squares(x, 0, x.len().div_ceil(REDUCE_BLOCK))
}

/// The sum of squares of `x` and whether every element is finite, in one pass over the data.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NormAndFinite {
    /// Sum of squares in `f64` (Inf or NaN when `finite` is false).
    pub sum_sq: f64,
    /// `true` when no element is Inf or NaN.
    pub finite: bool,
}

/// One pass computing [`sum_of_squares`] and the overflow flag together, as the fp16 step needs
/// both (the overflow check decides whether to skip, the norm feeds clipping).
pub fn norm_and_finite<E: Element>(x: &[E]) -> NormAndFinite {
    let sum_sq = sum_of_squares(x);
    NormAndFinite {
        sum_sq,
        finite: sum_sq.is_finite(),
    }
}

/// Whether any element is +-Inf or NaN. Reads exponent bits only and stops early (per chunk) once
/// one is found, so it costs less than a norm when the norm is not needed.
pub fn has_non_finite<E: Element>(x: &[E]) -> bool {
    if x.len() >= PAR_MIN_LEN {
        x.par_chunks(PAR_CHUNK).any(E::any_non_finite)
    } else {
        x.chunks(TILE * 4).any(E::any_non_finite)
    }
}

/// `x *= s` element-wise (for example averaging summed gradients by `1/world_size`). A 16-bit
/// `x` is multiplied in `f32` and rounded once.
pub fn scale_in_place<E: Element>(x: &mut [E], s: f32) {
    let scale = |d: &mut [f32]| {
        for v in d.iter_mut() {
            *v *= s;
        }
    };
    if x.len() >= PAR_MIN_LEN {
        x.par_chunks_mut(PAR_CHUNK)
            .for_each(|c| map_tiles(c, &scale));
    } else {
        map_tiles(x, &scale);
    }
}

/// Applies `op` to `f32` views of `x`, widening and rounding back 16-bit tiles.
fn map_tiles<E: Element>(x: &mut [E], op: &impl Fn(&mut [f32])) {
    if E::IS_F32 {
        op(bytemuck::cast_slice_mut(x));
        return;
    }
    let mut buf = [0f32; TILE];
    for tile in x.chunks_mut(TILE) {
        let view = &mut buf[..tile.len()];
        E::widen(tile, view);
        op(view);
        E::narrow(view, tile);
    }
}

/// `dst += src` element-wise: gradient accumulation across micro-steps. Any combination of dtypes
/// works; the sum is formed in `f32` and rounded once when `dst` is 16-bit (so accumulating
/// bf16 gradients into an `f32` buffer is exact up to the final `f32` rounding).
///
/// # Panics
/// If the lengths differ.
pub(crate) fn add_in_place<D: Element, S: Element>(dst: &mut [D], src: &[S]) {
    zip_apply(dst, src, |d, s| {
        for (a, &b) in d.iter_mut().zip(s) {
            *a += b;
        }
    });
}

/// `dst += alpha * src` element-wise (accumulation with a weight, for example `1/world_size`).
///
/// # Panics
/// If the lengths differ.
pub fn axpy_in_place<D: Element, S: Element>(dst: &mut [D], alpha: f32, src: &[S]) {
    zip_apply(dst, src, |d, s| {
        for (a, &b) in d.iter_mut().zip(s) {
            *a += alpha * b;
        }
    });
}

/// Copies `src` into `dst` converting the dtype: widening to `f32` is exact, narrowing to
/// bf16/f16 rounds to nearest even (values beyond the f16 range become Inf, NaN stays NaN).
///
/// # Panics
/// If the lengths differ.
pub(crate) fn cast<D: Element, S: Element>(dst: &mut [D], src: &[S]) {
    zip_apply(dst, src, |d, s| d.copy_from_slice(s));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic pseudo-random values in about [-2, 2] (xorshift), without a rand dependency.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
            })
            .collect()
    }

    fn with_threads<R: Send>(n: usize, f: impl FnOnce() -> R + Send) -> R {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .expect("build rayon pool")
            .install(f)
    }

    #[test]
    fn sum_of_squares_matches_f64_reference() {
        for n in [
            0,
            1,
            7,
            8,
            9,
            1000,
            REDUCE_BLOCK,
            REDUCE_BLOCK + 3,
            3 * PAR_MIN_LEN + 17,
        ] {
            let x = values(n, n as u64);
            let exact: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
            let got = sum_of_squares(&x);
            assert!(
                (got - exact).abs() <= 1e-12 * exact.max(1.0),
                "n={n}: {got} vs {exact}"
            );
        }
        assert_eq!(sum_of_squares(&[3.0f32, 4.0]), 25.0);
    }

    #[test]
    fn sum_of_squares_is_identical_for_any_thread_count() {
        let x = values(5 * PAR_MIN_LEN + 12345, 7);
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let one = with_threads(1, || (sum_of_squares(&x), sum_of_squares(&xb)));
        for t in [2, 3, 8] {
            let many = with_threads(t, || (sum_of_squares(&x), sum_of_squares(&xb)));
            assert_eq!(one.0.to_bits(), many.0.to_bits(), "f32, {t} threads");
            assert_eq!(one.1.to_bits(), many.1.to_bits(), "bf16, {t} threads");
        }
    }

    #[test]
    fn sum_of_squares_16_bit_matches_widened_f32() {
        let x = values(2 * PAR_MIN_LEN + 5, 3);
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        let wb: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
        let wh: Vec<f32> = xh.iter().map(|v| v.to_f32()).collect();
        // Same values, same blocks, same lanes: the same bits.
        assert_eq!(sum_of_squares(&xb).to_bits(), sum_of_squares(&wb).to_bits());
        assert_eq!(sum_of_squares(&xh).to_bits(), sum_of_squares(&wh).to_bits());
    }

    #[test]
    fn non_finite_is_found_at_every_position() {
        for n in [1, 9, TILE + 1, PAR_MIN_LEN + 100] {
            let clean = values(n, 11);
            assert!(!has_non_finite(&clean));
            assert!(norm_and_finite(&clean).finite);
            let positions = [0, n / 2, n - 1];
            for &pos in &positions {
                for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                    let mut x = clean.clone();
                    x[pos] = bad;
                    assert!(has_non_finite(&x), "n={n} pos={pos} {bad}");
                    let nf = norm_and_finite(&x);
                    assert!(
                        !nf.finite && !nf.sum_sq.is_finite(),
                        "n={n} pos={pos} {bad}"
                    );
                    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
                    let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
                    assert!(has_non_finite(&xb) && !norm_and_finite(&xb).finite);
                    assert!(has_non_finite(&xh) && !norm_and_finite(&xh).finite);
                }
            }
        }
        // Largest finite values are finite; f16 overflow on narrowing becomes Inf and is caught.
        assert!(!has_non_finite(&[f32::MAX, f32::MIN, f32::MIN_POSITIVE]));
        assert!(!has_non_finite(&[bf16::MAX, bf16::MIN]));
        assert!(!has_non_finite(&[f16::MAX, f16::MIN]));
        let mut h = [f16::ZERO; 2];
        cast(&mut h, &[70000.0f32, 1.0]);
        assert!(has_non_finite(&h));
    }

    #[test]
    fn scale_add_axpy_all_dtypes() {
        let n = PAR_MIN_LEN + 77;
        let a = values(n, 1);
        let b = values(n, 2);

        let mut x = a.clone();
        scale_in_place(&mut x, 0.25);
        assert!(x.iter().zip(&a).all(|(x, a)| *x == a * 0.25));

        let mut x = a.clone();
        add_in_place(&mut x, &b);
        assert!(x
            .iter()
            .zip(a.iter().zip(&b))
            .all(|(x, (a, b))| *x == a + b));

        let mut x = a.clone();
        axpy_in_place(&mut x, 0.5, &b);
        assert!(x
            .iter()
            .zip(a.iter().zip(&b))
            .all(|(x, (a, b))| *x == a + 0.5 * b));

        // bf16 gradients accumulated into f32: exact widening, one f32 add.
        let bb: Vec<bf16> = b.iter().map(|&v| bf16::from_f32(v)).collect();
        let mut x = a.clone();
        add_in_place(&mut x, &bb);
        assert!(x
            .iter()
            .zip(a.iter().zip(&bb))
            .all(|(x, (a, b))| *x == a + b.to_f32()));

        // 16-bit accumulator: f32 sum rounded once.
        let ab: Vec<bf16> = a.iter().map(|&v| bf16::from_f32(v)).collect();
        let mut xb = ab.clone();
        add_in_place(&mut xb, &bb);
        for ((x, a), b) in xb.iter().zip(&ab).zip(&bb) {
            assert_eq!(
                x.to_bits(),
                bf16::from_f32(a.to_f32() + b.to_f32()).to_bits()
            );
        }
        let ah: Vec<f16> = a.iter().map(|&v| f16::from_f32(v)).collect();
        let mut xh = ah.clone();
        scale_in_place(&mut xh, 3.0);
        for (x, a) in xh.iter().zip(&ah) {
            assert_eq!(x.to_bits(), f16::from_f32(a.to_f32() * 3.0).to_bits());
        }
    }

    #[test]
    fn casts_round_to_nearest_even() {
        // 1 + 2^-8 lies exactly between bf16 neighbours 1 and 1 + 2^-7: ties go to the even one (1).
        // 1 + 3 * 2^-8 lies between 1 + 2^-7 and 1 + 2^-6: ties go to 1 + 2^-6 (even mantissa).
        let src = [
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            -2.5,
            f32::NAN,
        ];
        let mut b = [bf16::ZERO; 4];
        cast(&mut b, &src);
        assert_eq!(b[0].to_f32(), 1.0);
        assert_eq!(b[1].to_f32(), 1.0 + 2f32.powi(-6));
        assert_eq!(b[2].to_f32(), -2.5);
        assert!(b[3].is_nan());
        // f16 has 10 mantissa bits: 1 + 2^-11 ties to 1, 1 + 3 * 2^-11 ties to 1 + 2^-9.
        let src = [1.0 + 2f32.powi(-11), 1.0 + 3.0 * 2f32.powi(-11)];
        let mut h = [f16::ZERO; 2];
        cast(&mut h, &src);
        assert_eq!(h[0].to_f32(), 1.0);
        assert_eq!(h[1].to_f32(), 1.0 + 2f32.powi(-9));

        // Long slices (parallel path) agree with the scalar conversion, both directions.
        let x = values(PAR_MIN_LEN * 2 + 3, 5);
        let mut xb = vec![bf16::ZERO; x.len()];
        let mut xh = vec![f16::ZERO; x.len()];
        cast(&mut xb, &x);
        cast(&mut xh, &x);
        let mut back = vec![0f32; x.len()];
        cast(&mut back, &xb);
        for ((v, b), w) in x.iter().zip(&xb).zip(&back) {
            assert_eq!(b.to_bits(), bf16::from_f32(*v).to_bits());
            assert_eq!(*w, b.to_f32());
        }
        cast(&mut back, &xh);
        for ((v, h), w) in x.iter().zip(&xh).zip(&back) {
            assert_eq!(h.to_bits(), f16::from_f32(*v).to_bits());
            assert_eq!(*w, h.to_f32());
        }
    }

    #[test]
    fn bf16_rounding_matches_half_on_special_values() {
        let mut specials = vec![
            0.0f32,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            f32::from_bits(1),           // smallest subnormal
            f32::from_bits(0x7f7f_8000), // rounds up to Inf
            f32::from_bits(0x3f80_8000), // tie, even below: stays
            f32::from_bits(0x3f81_8000), // tie, odd below: rounds up
            f32::from_bits(0x3f80_8001), // just above the tie
            f32::from_bits(0x3f80_7fff), // just below the tie
            f32::NAN,
            f32::from_bits(0x7f80_0001), // signalling NaN with a low payload
            f32::from_bits(0xffc0_0000), // negative NaN
        ];
        specials.extend(values(10_000, 99).iter().map(|v| v * 1e30));
        let mut ours = vec![bf16::ZERO; specials.len()];
        cast(&mut ours, &specials);
        for (x, b) in specials.iter().zip(&ours) {
            let expect = bf16::from_f32(*x);
            if x.is_nan() {
                assert!(b.is_nan(), "{x}");
            } else {
                assert_eq!(b.to_bits(), expect.to_bits(), "{x:e} ({:#x})", x.to_bits());
            }
        }
    }

    #[test]
    fn bf16_rounding_matches_half_bit_for_bit_across_all_exponents() {
        // About 1M bit patterns spread over the whole u32 range (every sign, exponent, NaN
        // payload), plus each one's tie neighbourhood: the branch-free rounding must give exactly
        // half's bits, NaNs included.
        let mut src = Vec::with_capacity(3 << 20);
        let mut b: u32 = 0;
        while let Some(next) = b.checked_add(4093) {
            let tie = (b & 0xffff_0000) | 0x8000;
            src.extend([
                f32::from_bits(b),
                f32::from_bits(tie),
                f32::from_bits(tie ^ 0x1_0000),
            ]);
            b = next;
        }
        let mut ours = vec![bf16::ZERO; src.len()];
        cast(&mut ours, &src);
        for (x, got) in src.iter().zip(&ours) {
            assert_eq!(
                got.to_bits(),
                bf16::from_f32(*x).to_bits(),
                "{:#010x}",
                x.to_bits()
            );
        }
    }

    #[test]
    #[should_panic(expected = "destination has 3 elements but source has 2")]
    fn length_mismatch_panics_with_both_lengths() {
        add_in_place(&mut [0f32; 3], &[1f32; 2]);
    }
}
