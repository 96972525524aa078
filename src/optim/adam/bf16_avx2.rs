//! The Adam update of bf16 moments, written with AVX2 intrinsics.
//!
//! WHY: compiled for AVX2, the auto-vectorised loop of [`super::adam_block`] ran the bf16-moment
//! step at 1.45-1.6 G parameters/s even with the shard in cache (the f32-moment step 2.3 G/s): 16
//! vector registers do not hold its constants and both moments' widening and rounding, so it spilled,
//! and each 8-lane rounding was narrowed on its own (an extract and a pack per vector). A step
//! from memory was then bound by this arithmetic, not by the bytes that bf16 moments save (one
//! thread: 0.71-0.98x the f32-moment step instead of faster). Here 16 elements go per iteration,
//! the two 8-lane roundings of each moment share one pack, and the constants are loaded once.
//!
//! The arithmetic is [`super::adam_block`]'s, operation by operation in the same order (no FMA,
//! IEEE `sqrt` and division, the same ties-to-even rounding with NaNs quietened), so the bits are
//! the portable path's; the unit tests of `adam` compare every path.

use std::arch::x86_64::*;

use half::bf16;

use super::{StateElement, StepConsts};
use crate::prefetch;

/// Elements per iteration: two 8-lane vectors, whose rounded moments share one pack.
const STEP: usize = 16;

/// The step's constants broadcast once per tile.
struct Consts {
    grad_scale: __m256,
    l2: __m256,
    decay: __m256,
    w1: __m256,
    one_minus_w1: __m256,
    beta2: __m256,
    one_minus_beta2: __m256,
    inv_bc2_sqrt: __m256,
    eps: __m256,
    neg_step_size: __m256,
}

impl Consts {
    #[target_feature(enable = "avx2")]
    #[inline]
    fn new(c: &StepConsts) -> Self {
        Self {
            grad_scale: _mm256_set1_ps(c.grad_scale),
            l2: _mm256_set1_ps(c.l2),
            decay: _mm256_set1_ps(c.decay),
            w1: _mm256_set1_ps(c.w1),
            one_minus_w1: _mm256_set1_ps(1.0 - c.w1),
            beta2: _mm256_set1_ps(c.beta2),
            one_minus_beta2: _mm256_set1_ps(c.one_minus_beta2),
            inv_bc2_sqrt: _mm256_set1_ps(c.inv_bc2_sqrt),
            eps: _mm256_set1_ps(c.eps),
            neg_step_size: _mm256_set1_ps(c.neg_step_size),
        }
    }
}

/// Eight bf16 values widened to f32 (a shift: exact).
///
/// # Safety
/// `src` points at 8 readable bf16 values.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn load_bf16_x8(src: *const u16) -> __m256 {
    // SAFETY: the caller's 16 bytes.
    let raw = unsafe { _mm_loadu_si128(src.cast()) };
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(raw)))
}

/// Eight gradients as f32: loaded, or widened from bf16.
///
/// # Safety
/// `src` points at 8 readable values of `G` (f32 or bf16).
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn load_grads_x8<G: StateElement>(src: *const G) -> __m256 {
    // SAFETY: the caller's 8 values; `G` is f32 or bf16 (see `tile`).
    unsafe {
        if G::IS_F32 {
            _mm256_loadu_ps(src.cast())
        } else {
            load_bf16_x8(src.cast())
        }
    }
}

/// Sixteen f32 values rounded to bf16 (ties to even, NaNs quietened) and stored.
///
/// # Safety
/// `dst` points at 16 writable bf16 values.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn store_bf16_x16(dst: *mut u16, lo: __m256, hi: __m256) {
    let lo = crate::optim::stream::round_bf16_x8(lo);
    let hi = crate::optim::stream::round_bf16_x8(hi);
    // packus interleaves 128-bit halves: [lo0-3, hi0-3, lo4-7, hi4-7]; put them in order.
    let packed = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(lo, hi));
    // SAFETY: the caller's 32 bytes.
    unsafe { _mm256_storeu_si256(dst.cast(), packed) };
}

/// The update of 8 elements, as [`super::adam_block`] writes it: the new parameters, `m` and `v`
/// (f32, not yet rounded).
#[target_feature(enable = "avx2")]
#[inline]
fn update_x8<const LERP_LOW: bool, const ADAMW: bool>(
    k: &Consts,
    p: __m256,
    g: __m256,
    m_old: __m256,
    v_old: __m256,
) -> (__m256, __m256, __m256) {
    let g = _mm256_mul_ps(g, k.grad_scale);
    let (g, decayed) = if ADAMW {
        (g, _mm256_mul_ps(p, k.decay))
    } else {
        (_mm256_add_ps(g, _mm256_mul_ps(k.l2, p)), p)
    };
    let m_new = if LERP_LOW {
        _mm256_add_ps(m_old, _mm256_mul_ps(k.w1, _mm256_sub_ps(g, m_old)))
    } else {
        _mm256_sub_ps(g, _mm256_mul_ps(_mm256_sub_ps(g, m_old), k.one_minus_w1))
    };
    let v_new = _mm256_add_ps(
        _mm256_mul_ps(v_old, k.beta2),
        _mm256_mul_ps(_mm256_mul_ps(k.one_minus_beta2, g), g),
    );
    let denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(v_new), k.inv_bc2_sqrt), k.eps);
    let step = _mm256_div_ps(_mm256_mul_ps(k.neg_step_size, m_new), denom);
    (_mm256_add_ps(decayed, step), m_new, v_new)
}

/// One tile with bf16 moments: blocks of [`prefetch::BLOCK`] elements asking for their lines
/// ahead (as [`super::adam_tile`]), 16 elements per iteration, the remainder on the portable
/// formula.
///
/// # Safety
/// The CPU has AVX2. `G` is f32 or bf16 (the only gradient types the caller passes here).
#[target_feature(enable = "avx2")]
pub(super) unsafe fn tile<G: StateElement, const LERP_LOW: bool, const ADAMW: bool>(
    p: &mut [f32],
    g: &[G],
    m: &mut [bf16],
    v: &mut [bf16],
    c: &StepConsts,
) {
    let n = p.len();
    assert!(
        g.len() == n && m.len() == n && v.len() == n,
        "adam tile: lengths differ"
    );
    let k = Consts::new(c);
    let whole = n / STEP * STEP;
    for i in (0..whole).step_by(STEP) {
        if i % prefetch::BLOCK == 0 {
            prefetch::block_ahead(&p[i..]);
            prefetch::block_ahead(&g[i..]);
            prefetch::block_ahead(&m[i..]);
            prefetch::block_ahead(&v[i..]);
        }
        let (p, g) = (&mut p[i..i + STEP], &g[i..i + STEP]);
        let m: &mut [u16] = bytemuck::cast_slice_mut(&mut m[i..i + STEP]);
        let v: &mut [u16] = bytemuck::cast_slice_mut(&mut v[i..i + STEP]);
        // SAFETY: each slice holds the 16 elements read and written here.
        unsafe {
            let (p0, m0, v0) = update_x8::<LERP_LOW, ADAMW>(
                &k,
                _mm256_loadu_ps(p.as_ptr()),
                load_grads_x8(g.as_ptr()),
                load_bf16_x8(m.as_ptr()),
                load_bf16_x8(v.as_ptr()),
            );
            let (p1, m1, v1) = update_x8::<LERP_LOW, ADAMW>(
                &k,
                _mm256_loadu_ps(p.as_ptr().add(8)),
                load_grads_x8(g.as_ptr().add(8)),
                load_bf16_x8(m.as_ptr().add(8)),
                load_bf16_x8(v.as_ptr().add(8)),
            );
            _mm256_storeu_ps(p.as_mut_ptr(), p0);
            _mm256_storeu_ps(p.as_mut_ptr().add(8), p1);
            store_bf16_x16(m.as_mut_ptr(), m0, m1);
            store_bf16_x16(v.as_mut_ptr(), v0, v1);
        }
    }
    super::adam_block::<bf16, G, LERP_LOW, ADAMW>(
        &mut p[whole..],
        &g[whole..],
        &mut m[whole..],
        &mut v[whole..],
        c,
    );
}
