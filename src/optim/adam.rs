//! Adam and AdamW over a flat `f32` shard, with PyTorch's and DeepSpeed's semantics.
//!
//! This is the optimizer step of every ZeRO stage: rank r updates only the shard it owns (its
//! `f32` master weights and Adam's `m` and `v`), so the kernel works on flat slices and knows
//! nothing about tensors or units.
//!
//! Per element, in `f32` (PyTorch `torch.optim.Adam`/`AdamW`, single-tensor path; DeepSpeed's
//! `DeepSpeedCPUAdam` computes the same quantities):
//!
//! ```text
//! g  = grad * grad_scale                      // fused unscale (1/loss_scale) and clip factor
//! g  = g + weight_decay * p                   // classic Adam only (L2 in the gradient)
//! p  = p * (1 - lr * weight_decay)            // AdamW only (decoupled weight decay)
//! m  = lerp(m, g, 1 - beta1)                  // = beta1 * m + (1 - beta1) * g
//! v  = beta2 * v + (1 - beta2) * g * g
//! p  = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
//! ```
//!
//! with `bc1 = 1 - beta1^t`, `bc2 = 1 - beta2^t` when `bias_correction` is on (both 1 when off,
//! as DeepSpeed's `bias_correction=False`). Scalars are computed in `f64` from `f64`
//! hyperparameters and rounded to `f32` once, as PyTorch does with its Python-float arguments.
//!
//! The gradient is only read: `grad_scale` is applied on the fly, so the engine never rewrites
//! the gradient buffer to unscale or clip it. Gradients may be `f32`, bf16 (widened in the loop)
//! or f16 (widened per tile); [`adam_step_with_copy`] also writes the updated parameters rounded
//! to a 16-bit copy, the buffer that is then all-gathered in mixed precision, while the tile is
//! still in cache (with non-temporal stores when the shard is far larger than the cache).
//!
//! The moments may be kept in bf16 ([`AdamState<bf16>`](AdamState), half the optimizer memory and
//! traffic): each step widens them exactly, runs the same `f32` formulas and rounds them to
//! nearest even once.
//!
//! The update asks for the cache lines it will need a few KiB ahead (`crate::prefetch`): with
//! the hardware prefetchers alone the bf16-state step drew only about 80% of the bandwidth its
//! streams allow.
//!
//! The chunk kernel is compiled three times, for baseline x86-64 (SSE2), AVX2 and AVX-512F, and
//! the widest the CPU runs is chosen once per process ([`adam_isa`]; [`ADAM_ISA_ENV`] forces one).
//! All three give the same bits (see [`AdamIsa`]).

use crate::prefetch;
use half::bf16;
use rayon::prelude::*;

use crate::flat::slices::{Element, PAR_CHUNK, PAR_MIN_LEN, TILE};

#[cfg(target_arch = "x86_64")]
mod bf16_avx2;

/// Adam/AdamW hyperparameters. Defaults are DeepSpeed's `DeepSpeedCPUAdam` defaults (which are
/// PyTorch's, with AdamW mode on).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamParams {
    /// Learning rate of this step (the scheduler's value).
    pub lr: f64,
    /// Decay of the first moment `m`.
    pub beta1: f64,
    /// Decay of the second moment `v`.
    pub beta2: f64,
    /// Added to `sqrt(v)` (after bias correction) to avoid division by zero.
    pub eps: f64,
    /// Weight decay coefficient; how it is applied depends on `adam_w_mode`.
    pub weight_decay: f64,
    /// `true`: AdamW, decoupled decay `p *= 1 - lr * wd`. `false`: classic Adam, `wd * p` added
    /// to the gradient. Note that DeepSpeed's `"type": "Adam"` also defaults to `true` (its
    /// `adam_w_mode` key); only `"adam_w_mode": false` gives classic L2 decay.
    pub adam_w_mode: bool,
    /// Divide `m` and `v` by `1 - beta^t` (PyTorch always does; DeepSpeed lets it be turned off).
    pub bias_correction: bool,
}

impl Default for AdamParams {
    /// The config's optimizer defaults ([`crate::config::OptimizerSettings`]), written once there.
    fn default() -> Self {
        let d = crate::config::OptimizerSettings::default();
        Self {
            lr: d.lr,
            beta1: d.betas[0],
            beta2: d.betas[1],
            eps: d.eps,
            weight_decay: d.weight_decay,
            adam_w_mode: d.adam_w_mode,
            bias_correction: d.bias_correction,
        }
    }
}

/// The `f32` constants of one step, derived once from [`AdamParams`] and the step number: the one
/// place the formula's scalars are computed, for this CPU kernel and for a device tier's Adam
/// ([`crate::zero::DeviceTier`]), which applies the same per-element formula with them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepConsts {
    pub grad_scale: f32,
    /// AdamW (decoupled decay, `decay` applies) or classic Adam (`l2` applies).
    pub adamw: bool,
    /// Classic-Adam L2 coefficient (0 in AdamW mode).
    pub l2: f32,
    /// AdamW multiplier `1 - lr * wd` (1 in classic-Adam mode).
    pub decay: f32,
    /// `1 - beta1`, the lerp weight.
    pub w1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    pub bc2_sqrt: f32,
    /// `1 / bc2_sqrt`, for 16-bit moments (the CPU kernel multiplies by it there).
    pub inv_bc2_sqrt: f32,
    pub eps: f32,
    /// `-lr / bc1`.
    pub neg_step_size: f32,
}

impl StepConsts {
    /// The constants of update number `step` (from 1) with gradients multiplied by `grad_scale`.
    pub fn new(hp: &AdamParams, step: u64, grad_scale: f32) -> Self {
        assert!(step >= 1, "adam step numbers start at 1 (got {step})");
        let (bc1, bc2) = if hp.bias_correction {
            // powf on f64 is exact enough for any realistic step count and matches Python's `**`.
            let t = step as f64;
            (1.0 - hp.beta1.powf(t), 1.0 - hp.beta2.powf(t))
        } else {
            (1.0, 1.0)
        };
        let (l2, decay) = if hp.adam_w_mode {
            (0.0, 1.0 - hp.lr * hp.weight_decay)
        } else {
            (hp.weight_decay, 1.0)
        };
        Self {
            grad_scale,
            adamw: hp.adam_w_mode,
            l2: l2 as f32,
            decay: decay as f32,
            w1: (1.0 - hp.beta1) as f32,
            beta2: hp.beta2 as f32,
            one_minus_beta2: (1.0 - hp.beta2) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            inv_bc2_sqrt: (1.0 / bc2.sqrt()) as f32,
            eps: hp.eps as f32,
            neg_step_size: (-hp.lr / bc1) as f32,
        }
    }
}

/// [`StepConsts`] as the C kernels read them (`struct zdp_adam_consts` of
/// `kernels/adam_math.h`, the GPU's fused step): fourteen 4-byte fields, no padding, passed by
/// value. The one mapping from the Rust constants to the C formula's.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct KernelConsts {
    pub grad_scale: f32,
    pub l2: f32,
    pub decay: f32,
    pub w1: f32,
    pub one_minus_w1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    pub bc2_sqrt: f32,
    pub inv_bc2_sqrt: f32,
    pub eps: f32,
    pub neg_step_size: f32,
    /// AdamW (1) or classic Adam's L2 (0).
    pub adamw: i32,
    /// `w1 < 0.5`: `adam_block`'s `LERP_LOW` form of the first moment's update.
    pub lerp_low: i32,
    /// 16-bit moments: the denominator multiplies by `inv_bc2_sqrt` (the CPU kernel's 16-bit form).
    pub moments_16: i32,
}

impl KernelConsts {
    pub fn new(c: &StepConsts, moments_16: bool) -> Self {
        KernelConsts {
            grad_scale: c.grad_scale,
            l2: c.l2,
            decay: c.decay,
            w1: c.w1,
            // As `adam_block` computes it, in f32.
            one_minus_w1: 1.0 - c.w1,
            beta2: c.beta2,
            one_minus_beta2: c.one_minus_beta2,
            bc2_sqrt: c.bc2_sqrt,
            inv_bc2_sqrt: c.inv_bc2_sqrt,
            eps: c.eps,
            neg_step_size: c.neg_step_size,
            adamw: c.adamw.into(),
            lerp_low: (c.w1 < 0.5).into(),
            moments_16: moments_16.into(),
        }
    }
}

/// The instruction set the Adam chunk kernel is compiled for, chosen once per process.
///
/// The crate is built for baseline x86-64 (SSE2), so the auto-vectorised loop of [`adam_step`]
/// uses 4-lane vectors unless it is compiled again with wider ones. Every path runs the same Rust
/// formula: Rust never contracts `a * b + c` into an FMA and `sqrt` and `/` are correctly
/// rounded, so the paths give the same bits (the unit tests check it on every path the CPU has).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AdamIsa {
    /// The baseline build (SSE2 on x86-64; whatever the target allows elsewhere).
    Portable,
    /// Compiled with AVX2 (8 lanes). Not FMA: the formula has no fused operations to use.
    Avx2,
    /// Compiled with AVX-512F (16 lanes).
    Avx512,
}

/// The environment variable that forces an [`AdamIsa`]: `portable`, `avx2` or `avx512`. Read once,
/// at the first step (see [`adam_isa`]).
pub const ADAM_ISA_ENV: &str = "ZERODP_ADAM_ISA";

/// [`ADAM_ISA_ENV`] names no path, or one this CPU cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdamIsaError {
    #[error("ZERODP_ADAM_ISA={value:?} names no Adam kernel path; use portable, avx2 or avx512")]
    Unknown { value: String },
    #[error("ZERODP_ADAM_ISA={isa}: this CPU cannot run that path (or ZERODP_ISA holds the kernels below it); it has {available}")]
    Unavailable {
        isa: &'static str,
        available: String,
    },
}

impl AdamIsa {
    /// Every path, narrowest first.
    pub(crate) const ALL: [AdamIsa; 3] = [AdamIsa::Portable, AdamIsa::Avx2, AdamIsa::Avx512];

    /// The name used by [`ADAM_ISA_ENV`] and in benchmark output.
    pub fn name(self) -> &'static str {
        match self {
            AdamIsa::Portable => "portable",
            AdamIsa::Avx2 => "avx2",
            AdamIsa::Avx512 => "avx512",
        }
    }

    /// The path named `name` (as [`AdamIsa::name`] spells it, any case).
    pub(crate) fn from_name(name: &str) -> Option<AdamIsa> {
        Self::ALL
            .into_iter()
            .find(|isa| isa.name().eq_ignore_ascii_case(name.trim()))
    }

    /// Whether this CPU can run the path (`std` caches the CPUID query).
    pub(crate) fn is_available(self) -> bool {
        match self {
            AdamIsa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            AdamIsa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && crate::isa::allows(crate::isa::Isa::Avx2)
            }
            #[cfg(target_arch = "x86_64")]
            AdamIsa::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && crate::isa::allows(crate::isa::Isa::Avx512)
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The paths this CPU can run, narrowest first.
    pub fn available() -> Vec<AdamIsa> {
        Self::ALL.into_iter().filter(|i| i.is_available()).collect()
    }

    /// The widest path this CPU can run.
    pub fn best() -> AdamIsa {
        Self::ALL
            .into_iter()
            .rev()
            .find(|i| i.is_available())
            .unwrap_or(AdamIsa::Portable)
    }

    /// The path [`ADAM_ISA_ENV`] asks for: `Ok(None)` when it is unset or empty.
    pub fn from_env() -> Result<Option<AdamIsa>, AdamIsaError> {
        let Some(value) = std::env::var_os(ADAM_ISA_ENV) else {
            return Ok(None);
        };
        let value = value.to_string_lossy();
        if value.trim().is_empty() {
            return Ok(None);
        }
        let isa = AdamIsa::from_name(&value).ok_or_else(|| AdamIsaError::Unknown {
            value: value.to_string(),
        })?;
        if !isa.is_available() {
            let names: Vec<&str> = Self::available().iter().map(|i| i.name()).collect();
            return Err(AdamIsaError::Unavailable {
                isa: isa.name(),
                available: names.join(", "),
            });
        }
        Ok(Some(isa))
    }
}

/// The path every step of this process uses: the one [`ADAM_ISA_ENV`] forces, else the widest
/// available ([`AdamIsa::best`]). Decided at the first call and cached, so that all steps of a
/// run take the same code. A bad [`ADAM_ISA_ENV`] is ignored here (a library must not exit);
/// `zerodp bench adam` checks [`AdamIsa::from_env`] itself and refuses it.
pub fn adam_isa() -> AdamIsa {
    static ISA: std::sync::OnceLock<AdamIsa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        AdamIsa::from_env()
            .ok()
            .flatten()
            .unwrap_or_else(AdamIsa::best)
    })
}

/// An element type for Adam's moments `m` and `v`: `f32`, or bf16 to halve the optimizer state.
/// (f16 is not one: its range ends at 65504 and `v` holds squared gradients.) Conversions are per
/// element and branch-free, so that the update loop stays one vectorised pass over the tile:
/// widening bf16 is a shift, rounding is to nearest even with NaNs kept NaN, the bits of
/// `half`'s `bf16::from_f32`.
pub trait StateElement: Element {
    /// The value as `f32` (exact).
    fn load(self) -> f32;
    /// `x` rounded to this type.
    fn store(x: f32) -> Self;
}

impl StateElement for f32 {
    #[inline(always)]
    fn load(self) -> f32 {
        self
    }
    #[inline(always)]
    fn store(x: f32) -> f32 {
        x
    }
}

impl StateElement for bf16 {
    #[inline(always)]
    fn load(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
    #[inline(always)]
    fn store(x: f32) -> bf16 {
        bf16::from_bits(crate::flat::f32_to_bf16_bits(x))
    }
}

/// The update of one tile. `LERP_LOW` selects PyTorch's lerp formula for a weight `w1 < 0.5`
/// (`m + w1 * (g - m)`, the usual case) or `>= 0.5` (`g - (g - m) * (1 - w1)`); `ADAMW` applies
/// the decoupled decay `p * (1 - lr * wd)`, else the classic L2 term `g + wd * p` (each only where
/// PyTorch applies it, so the bits stay PyTorch's). Const generics keep the loop branch-free so
/// that it vectorises, and free the registers of the term not taken (AVX2 has 16). 16-bit moments
/// are widened and rounded in the same loop, once per step.
#[inline(always)]
fn adam_tile<S: StateElement, G: StateElement, const LERP_LOW: bool, const ADAMW: bool>(
    p: &mut [f32],
    g: &[G],
    m: &mut [S],
    v: &mut [S],
    c: &StepConsts,
) {
    let blocks = p
        .chunks_mut(prefetch::BLOCK)
        .zip(g.chunks(prefetch::BLOCK))
        .zip(m.chunks_mut(prefetch::BLOCK))
        .zip(v.chunks_mut(prefetch::BLOCK));
    for (((p, g), m), v) in blocks {
        // With the hardware prefetchers alone the bf16-state step drew about 80% of the bandwidth
        // a pass with its streams and no arithmetic draws (100M elements, 2 threads: 1.22x the
        // `f32`-state step where its bytes allow 1.4x); asking ahead, 96-99%.
        prefetch::block_ahead(p);
        prefetch::block_ahead(g);
        prefetch::block_ahead(m);
        prefetch::block_ahead(v);
        adam_block::<S, G, LERP_LOW, ADAMW>(p, g, m, v, c);
    }
}

/// [`adam_tile`]'s update of one block.
#[inline(always)]
fn adam_block<S: StateElement, G: StateElement, const LERP_LOW: bool, const ADAMW: bool>(
    p: &mut [f32],
    g: &[G],
    m: &mut [S],
    v: &mut [S],
    c: &StepConsts,
) {
    let one_minus_w1 = 1.0 - c.w1;
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let (m_old, v_old) = (m.load(), v.load());
        let g = g.load() * c.grad_scale;
        let (g, decayed) = match ADAMW {
            true => (g, *p * c.decay),
            false => (g + c.l2 * *p, *p),
        };
        let m_new = if LERP_LOW {
            m_old + c.w1 * (g - m_old)
        } else {
            g - (g - m_old) * one_minus_w1
        };
        let v_new = v_old * c.beta2 + c.one_minus_beta2 * g * g;
        let denom = if S::IS_F32 {
            v_new.sqrt() / c.bc2_sqrt + c.eps
        } else {
            v_new.sqrt() * c.inv_bc2_sqrt + c.eps
        };
        *p = decayed + c.neg_step_size * m_new / denom;
        *m = S::store(m_new);
        *v = S::store(v_new);
    }
}

/// [`adam_tile`] with its branch-free variant picked by the step's constants.
#[inline(always)]
fn adam_tile_for<S: StateElement, G: StateElement>(
    p: &mut [f32],
    g: &[G],
    m: &mut [S],
    v: &mut [S],
    c: &StepConsts,
) {
    match (c.w1 < 0.5, c.adamw) {
        (true, true) => adam_tile::<S, G, true, true>(p, g, m, v, c),
        (true, false) => adam_tile::<S, G, true, false>(p, g, m, v, c),
        (false, true) => adam_tile::<S, G, false, true>(p, g, m, v, c),
        (false, false) => adam_tile::<S, G, false, false>(p, g, m, v, c),
    }
}

/// [`adam_tile_for`], or with `AVX2_STATES` (the AVX2 chunk variant only) bf16 moments on the
/// AVX2 intrinsics of [`bf16_avx2`], which give the same bits.
#[inline(always)]
fn adam_tile_on<S: StateElement, G: StateElement, const AVX2_STATES: bool>(
    p: &mut [f32],
    g: &[G],
    m: &mut [S],
    v: &mut [S],
    c: &StepConsts,
) {
    #[cfg(target_arch = "x86_64")]
    if AVX2_STATES && is_bf16::<S>() {
        let (m, v): (&mut [bf16], &mut [bf16]) =
            (bytemuck::cast_slice_mut(m), bytemuck::cast_slice_mut(v));
        // SAFETY: only `adam_chunk_avx2` sets AVX2_STATES, on a CPU checked to have AVX2; `G` is
        // f32 or bf16 (`adam_chunk_body` widens f16 gradients first).
        unsafe {
            match (c.w1 < 0.5, c.adamw) {
                (true, true) => bf16_avx2::tile::<G, true, true>(p, g, m, v, c),
                (true, false) => bf16_avx2::tile::<G, true, false>(p, g, m, v, c),
                (false, true) => bf16_avx2::tile::<G, false, true>(p, g, m, v, c),
                (false, false) => bf16_avx2::tile::<G, false, false>(p, g, m, v, c),
            }
        }
        return;
    }
    adam_tile_for::<S, G>(p, g, m, v, c)
}

/// `src` as `f32`: itself when it is `f32`, else widened into `buf` (same length).
#[inline(always)]
fn f32_view<'a, E: Element>(src: &'a [E], buf: &'a mut [f32]) -> &'a [f32] {
    if E::IS_F32 {
        bytemuck::cast_slice(src)
    } else {
        E::widen(src, buf);
        buf
    }
}

/// One chunk, tile by tile: bf16 gradients are widened inside the update loop (a shift), f16
/// ones into a stack buffer first, and the optional 16-bit copy of the new parameters is written
/// by `narrow` while the tile is hot (the AVX2 and AVX-512 variants stream a long shard's bf16
/// copy, see [`CopyStores`]). Widening bf16 gradients in the loop rather than through the buffer
/// made the step with bf16 gradients and a bf16 copy as fast as the plain one (100M elements, 2
/// threads: 74 ms -> 59 ms against 59 ms; the streamed copy gave 6 ms of it). Inlined into each
/// [`AdamIsa`] variant, so that the bf16 conversions (of the moments, and `Element`'s
/// `#[inline(always)]` widening and rounding of gradients and copy) are vectorised at that width
/// too; f16 goes through `half`, which uses F16C where the CPU has it.
#[inline(always)]
fn adam_chunk_body<G: Element, S: StateElement, T: Element, const AVX2_STATES: bool>(
    p: &mut [f32],
    g: &[G],
    m: &mut [S],
    v: &mut [S],
    mut out: Option<&mut [T]>,
    c: &StepConsts,
    narrow: impl Fn(&[f32], &mut [T]),
) {
    let mut gbuf = [0f32; TILE];
    for (i, ((p, m), v)) in p
        .chunks_mut(TILE)
        .zip(m.chunks_mut(TILE))
        .zip(v.chunks_mut(TILE))
        .enumerate()
    {
        let range = i * TILE..i * TILE + p.len();
        let g = &g[range.clone()];
        if is_bf16::<G>() {
            // Widened in the update loop itself (a shift), not through the stack buffer.
            adam_tile_on::<S, bf16, AVX2_STATES>(p, bytemuck::cast_slice(g), m, v, c);
        } else {
            let g = f32_view(g, &mut gbuf[..p.len()]);
            adam_tile_on::<S, f32, AVX2_STATES>(p, g, m, v, c);
        }
        if let Some(out) = out.as_deref_mut() {
            narrow(p, &mut out[range]);
        }
    }
}

/// [`adam_chunk_body`] compiled with AVX2.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments)]
unsafe fn adam_chunk_avx2<G: Element, S: StateElement, T: Element>(
    p: &mut [f32],
    g: &[G],
    m: &mut [S],
    v: &mut [S],
    out: Option<&mut [T]>,
    c: &StepConsts,
    stores: CopyStores,
) {
    // SAFETY: the caller checked AVX2.
    unsafe {
        chunk_streaming::<G, S, T, true>(
            p,
            g,
            m,
            v,
            out,
            c,
            stores,
            super::stream::narrow_bf16_avx2,
        )
    }
}

/// [`adam_chunk_body`] compiled with AVX-512F.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn adam_chunk_avx512<G: Element, S: StateElement, T: Element>(
    p: &mut [f32],
    g: &[G],
    m: &mut [S],
    v: &mut [S],
    out: Option<&mut [T]>,
    c: &StepConsts,
    stores: CopyStores,
) {
    // SAFETY: the caller checked AVX-512F.
    unsafe {
        chunk_streaming::<G, S, T, false>(
            p,
            g,
            m,
            v,
            out,
            c,
            stores,
            super::stream::narrow_bf16_avx512,
        )
    }
}

/// [`adam_chunk_body`] for a SIMD path: a long shard's bf16 copy goes through `stream`, that
/// path's non-temporal rounding, and the fence after it ends this thread's streaming stores;
/// otherwise the copy is written with ordinary stores.
///
/// # Safety
/// The CPU runs `stream`. Inlined into the caller, so that the body is compiled for its features.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn chunk_streaming<G: Element, S: StateElement, T: Element, const AVX2_STATES: bool>(
    p: &mut [f32],
    g: &[G],
    m: &mut [S],
    v: &mut [S],
    out: Option<&mut [T]>,
    c: &StepConsts,
    stores: CopyStores,
    stream: unsafe fn(&[f32], &mut [u16]),
) {
    if stores == CopyStores::Streaming && is_bf16::<T>() {
        // SAFETY: the caller's CPU runs `stream`.
        let narrow =
            |src: &[f32], dst: &mut [T]| unsafe { stream(src, bytemuck::cast_slice_mut(dst)) };
        adam_chunk_body::<G, S, T, AVX2_STATES>(p, g, m, v, out, c, narrow);
        // SAFETY: SSE, part of x86-64.
        unsafe { std::arch::x86_64::_mm_sfence() };
    } else {
        adam_chunk_body::<G, S, T, AVX2_STATES>(p, g, m, v, out, c, T::narrow)
    }
}

/// One chunk on the path `isa`, which the caller has checked is available.
#[inline]
#[allow(clippy::too_many_arguments)]
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn adam_chunk<G: Element, S: StateElement, T: Element>(
    isa: AdamIsa,
    p: &mut [f32],
    g: &[G],
    m: &mut [S],
    v: &mut [S],
    out: Option<&mut [T]>,
    c: &StepConsts,
    stores: CopyStores,
) {
    match isa {
        // SAFETY: `adam_impl` only passes a path whose `is_available` is true.
        #[cfg(target_arch = "x86_64")]
        AdamIsa::Avx512 => unsafe { adam_chunk_avx512(p, g, m, v, out, c, stores) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        AdamIsa::Avx2 => unsafe { adam_chunk_avx2(p, g, m, v, out, c, stores) },
        _ => adam_chunk_body::<G, S, T, false>(p, g, m, v, out, c, T::narrow),
    }
}

/// How the 16-bit copy of the parameters is stored. Only a bf16 copy on the AVX2 and AVX-512
/// paths streams; f16 and the portable path always use ordinary stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CopyStores {
    /// Ordinary stores: the copy stays in cache for a reader that comes soon.
    Cached,
    /// Non-temporal stores (see `optim::stream`): no read-for-ownership of a copy that would be
    /// evicted before it is read anyway.
    Streaming,
}

/// Shards of at least this many elements write their bf16 copy with non-temporal stores: at 30
/// bytes per element the step's working set (about 60 MiB here) is well past the last-level
/// cache, so the copy would be evicted before the all-gather reads it.
const STREAM_COPY_MIN_LEN: usize = 1 << 21;

impl CopyStores {
    /// The stores for a shard of `len` elements.
    fn for_len(len: usize) -> Self {
        if len >= STREAM_COPY_MIN_LEN {
            CopyStores::Streaming
        } else {
            CopyStores::Cached
        }
    }
}

/// Whether `T` is bf16 (the only copy type with a streaming kernel).
fn is_bf16<T: 'static>() -> bool {
    std::any::TypeId::of::<T>() == std::any::TypeId::of::<bf16>()
}

/// The shard's slices must be equally long (a caller's bug otherwise: the engine sizes them from
/// one layout).
fn same_shard(n: usize, grads: usize, m: usize, v: usize) {
    assert!(
        grads == n && m == n && v == n,
        "adam_step: params has {n} elements but grads {grads}, m {m}, v {v}; all must be the \
         same shard"
    );
}

#[allow(clippy::too_many_arguments)]
fn adam_impl<G: Element, S: StateElement, T: Element>(
    isa: AdamIsa,
    params: &mut [f32],
    grads: &[G],
    m: &mut [S],
    v: &mut [S],
    out: Option<&mut [T]>,
    c: &StepConsts,
    stores: CopyStores,
) {
    let n = params.len();
    same_shard(n, grads.len(), m.len(), v.len());
    if let Some(out) = out.as_deref() {
        assert_eq!(
            out.len(),
            n,
            "adam_step_with_copy: params has {n} elements but the {} copy has {}",
            T::NAME,
            out.len()
        );
    }
    assert!(
        isa.is_available(),
        "adam_step: this CPU cannot run the {} path",
        isa.name()
    );
    if n < PAR_MIN_LEN {
        adam_chunk(isa, params, grads, m, v, out, c, stores);
        return;
    }
    let chunks = params
        .par_chunks_mut(PAR_CHUNK)
        .zip(grads.par_chunks(PAR_CHUNK))
        .zip(m.par_chunks_mut(PAR_CHUNK))
        .zip(v.par_chunks_mut(PAR_CHUNK));
    match out {
        Some(out) => chunks
            .zip(out.par_chunks_mut(PAR_CHUNK))
            .for_each(|((((p, g), m), v), o)| adam_chunk(isa, p, g, m, v, Some(o), c, stores)),
        None => chunks
            .for_each(|(((p, g), m), v)| adam_chunk::<G, S, T>(isa, p, g, m, v, None, c, stores)),
    }
}

/// One Adam/AdamW step over a flat shard, in place on `params`, `m` and `v`.
///
/// `step` is the 1-based number of this update (bias correction uses `beta^step`); `grad_scale`
/// multiplies every gradient before use, so that unscaling and clipping cost no extra pass:
/// pass `1 / combined` with DeepSpeed's `combined = loss_scale * max(1, norm / clip)` (`norm`
/// being the unscaled global norm), or `1.0` when there is neither a loss scale nor clipping.
/// Deterministic and independent of the thread count and of the [`AdamIsa`] path (the update is
/// element-wise). Long shards run in parallel on the rayon pool.
///
/// The moments `m` and `v` may be `f32` or 16-bit (`S` = bf16 halves the optimizer state): they
/// are widened, updated in `f32` and rounded to nearest even once per step.
///
/// # Panics
/// If the slices differ in length or `step == 0`.
pub fn adam_step<G: Element, S: StateElement>(
    params: &mut [f32],
    grads: &[G],
    m: &mut [S],
    v: &mut [S],
    step: u64,
    hp: &AdamParams,
    grad_scale: f32,
) {
    let c = StepConsts::new(hp, step, grad_scale);
    adam_impl::<G, S, f32>(
        adam_isa(),
        params,
        grads,
        m,
        v,
        None,
        &c,
        CopyStores::Cached,
    );
}

/// [`adam_step`], also writing the updated parameters rounded to nearest even into `params_16`
/// (bf16 or f16): the compute copy of mixed precision, produced in the same pass.
///
/// # Panics
/// If the slices differ in length or `step == 0`.
#[allow(clippy::too_many_arguments)]
pub fn adam_step_with_copy<G: Element, S: StateElement, T: Element>(
    params: &mut [f32],
    grads: &[G],
    m: &mut [S],
    v: &mut [S],
    step: u64,
    hp: &AdamParams,
    grad_scale: f32,
    params_16: &mut [T],
) {
    let c = StepConsts::new(hp, step, grad_scale);
    let stores = CopyStores::for_len(params.len());
    adam_impl(adam_isa(), params, grads, m, v, Some(params_16), &c, stores);
}

/// Where a shard updated without an fp32 master sits, so that the random bits of its stochastic
/// rounding depend on each element's place in the model and the step, not on how the model is
/// sharded or threaded: `key` names the (run, step, unit) ([`rounding_key`]) and `offset` is the
/// place of the shard's first element in the unit. Every world size and stage then rounds every
/// element the same way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RoundingKey {
    pub key: u32,
    pub offset: u64,
}

/// The key of unit `unit`'s stochastic rounding at update `step` of a run seeded `seed`.
pub(crate) fn rounding_key(seed: u64, step: u64, unit: usize) -> u32 {
    let mut h = seed
        ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (unit as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    // MurmurHash3's 64-bit finaliser.
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^= h >> 33;
    h as u32
}

/// MurmurHash3's 32-bit finaliser: 16 well-mixed bits per element from its index and the key.
#[inline(always)]
fn mix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

/// `x` rounded to bf16 stochastically: up with probability equal to the dropped fraction of an
/// ulp (so the expected result is `x`, and updates smaller than half an ulp are not all lost, as
/// they are under rounding to nearest), by adding 16 random bits below the kept ones and
/// truncating. NaNs stay NaN (quiet), infinities stay infinite.
#[inline(always)]
fn bf16_stochastic_bits(x: f32, random: u32) -> u16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(random & 0xffff) >> 16;
    (if x.is_nan() {
        (b >> 16) | 0x0040
    } else {
        rounded
    }) as u16
}

/// `src` rounded stochastically into `dst` (same length); element `i` draws its bits from
/// `at.offset + i` and `at.key`.
fn round_stochastic(src: &[f32], dst: &mut [bf16], at: RoundingKey) {
    for (i, (x, d)) in src.iter().zip(dst.iter_mut()).enumerate() {
        let place = at.offset + i as u64;
        let random = mix32((place ^ (place >> 32)) as u32 ^ at.key);
        *d = bf16::from_bits(bf16_stochastic_bits(*x, random));
    }
}

/// One Adam/AdamW step on bf16 parameters that are their own master
/// (`bf16_master_weights_and_grads`): each tile is widened to f32, updated as [`adam_step`]
/// updates f32 parameters, and rounded back stochastically ([`RoundingKey`]). Deterministic, and
/// independent of the thread count, the [`AdamIsa`] path and the sharding.
///
/// # Panics
/// If the slices differ in length or `step == 0`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn adam_step_bf16_master<G: Element, S: StateElement>(
    params: &mut [bf16],
    grads: &[G],
    m: &mut [S],
    v: &mut [S],
    step: u64,
    hp: &AdamParams,
    grad_scale: f32,
    at: RoundingKey,
) {
    let n = params.len();
    same_shard(n, grads.len(), m.len(), v.len());
    let c = StepConsts::new(hp, step, grad_scale);
    let isa = adam_isa();
    let chunk = |k: usize, p: &mut [bf16], g: &[G], m: &mut [S], v: &mut [S]| {
        let mut buf = [0f32; TILE];
        for (t, (((p, g), m), v)) in p
            .chunks_mut(TILE)
            .zip(g.chunks(TILE))
            .zip(m.chunks_mut(TILE))
            .zip(v.chunks_mut(TILE))
            .enumerate()
        {
            let w = &mut buf[..p.len()];
            <bf16 as Element>::widen(p, w);
            adam_chunk::<G, S, f32>(isa, w, g, m, v, None, &c, CopyStores::Cached);
            let offset = at.offset + (k * PAR_CHUNK + t * TILE) as u64;
            round_stochastic(w, p, RoundingKey { offset, ..at });
        }
    };
    if n < PAR_MIN_LEN {
        return chunk(0, params, grads, m, v);
    }
    params
        .par_chunks_mut(PAR_CHUNK)
        .zip(grads.par_chunks(PAR_CHUNK))
        .zip(m.par_chunks_mut(PAR_CHUNK))
        .zip(v.par_chunks_mut(PAR_CHUNK))
        .enumerate()
        .for_each(|(k, (((p, g), m), v))| chunk(k, p, g, m, v));
}

/// Adam's state for one shard: the moments and the number of updates applied so far. `S` is the
/// moments' element type: `f32` (the default, 8 bytes per element) or bf16 (4 bytes per element;
/// the update still runs in `f32`, see [`adam_step`]).
#[derive(Debug, Clone, PartialEq)]
pub struct AdamState<S: StateElement = f32> {
    /// First moment, one `S` per shard element.
    pub m: Vec<S>,
    /// Second moment, one `S` per shard element.
    pub v: Vec<S>,
    /// Updates applied so far (0 before the first step).
    pub step: u64,
}

impl AdamState {
    /// Zeroed `f32` state for a shard of `len` elements.
    pub fn new(len: usize) -> Self {
        Self::zeroed(len)
    }
}

impl<S: StateElement> AdamState<S> {
    /// Zeroed state of element type `S` for a shard of `len` elements.
    pub fn zeroed(len: usize) -> Self {
        Self {
            m: vec![S::zeroed(); len],
            v: vec![S::zeroed(); len],
            step: 0,
        }
    }

    /// Shard length.
    pub fn len(&self) -> usize {
        self.m.len()
    }

    /// Whether the shard is empty (a rank whose shard is all padding can own nothing).
    pub fn is_empty(&self) -> bool {
        self.m.is_empty()
    }

    /// Bytes held (`m` and `v`: 8 bytes per element in `f32`, 4 in bf16), for memory accounting.
    pub fn bytes(&self) -> usize {
        (self.m.len() + self.v.len()) * S::BYTES
    }

    /// Counts one more step and applies [`adam_step`]. Call only for steps that are not skipped
    /// (an fp16 overflow must not advance the step, as in DeepSpeed).
    pub fn update<G: Element>(
        &mut self,
        params: &mut [f32],
        grads: &[G],
        hp: &AdamParams,
        grad_scale: f32,
    ) {
        self.step += 1;
        adam_step(
            params,
            grads,
            &mut self.m,
            &mut self.v,
            self.step,
            hp,
            grad_scale,
        );
    }

    /// Counts one more step and applies [`adam_step_with_copy`].
    pub fn update_with_copy<G: Element, T: Element>(
        &mut self,
        params: &mut [f32],
        grads: &[G],
        hp: &AdamParams,
        grad_scale: f32,
        params_16: &mut [T],
    ) {
        self.step += 1;
        adam_step_with_copy(
            params,
            grads,
            &mut self.m,
            &mut self.v,
            self.step,
            hp,
            grad_scale,
            params_16,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale
            })
            .collect()
    }

    /// PyTorch's single-tensor Adam written element by element in `f32`, one scalar at a time,
    /// with the scalars prepared in `f64` like Python floats.
    fn reference_f32(
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        t: u64,
        hp: &AdamParams,
        gs: f32,
    ) {
        let (bc1, bc2) = if hp.bias_correction {
            (1.0 - hp.beta1.powf(t as f64), 1.0 - hp.beta2.powf(t as f64))
        } else {
            (1.0, 1.0)
        };
        for i in 0..p.len() {
            let mut grad = g[i] * gs;
            if !hp.adam_w_mode && hp.weight_decay != 0.0 {
                grad += hp.weight_decay as f32 * p[i];
            }
            if hp.adam_w_mode {
                p[i] *= (1.0 - hp.lr * hp.weight_decay) as f32;
            }
            let w = (1.0 - hp.beta1) as f32;
            m[i] = if w < 0.5 {
                m[i] + w * (grad - m[i])
            } else {
                grad - (grad - m[i]) * (1.0 - w)
            };
            v[i] = v[i] * hp.beta2 as f32 + (1.0 - hp.beta2) as f32 * grad * grad;
            let denom = v[i].sqrt() / bc2.sqrt() as f32 + hp.eps as f32;
            p[i] += (-hp.lr / bc1) as f32 * m[i] / denom;
        }
    }

    /// The same formulas entirely in `f64` (the mathematical value, up to f64 rounding).
    fn reference_f64(
        p: &mut [f64],
        g: &[f64],
        m: &mut [f64],
        v: &mut [f64],
        t: u64,
        hp: &AdamParams,
    ) {
        let (bc1, bc2) = if hp.bias_correction {
            (1.0 - hp.beta1.powf(t as f64), 1.0 - hp.beta2.powf(t as f64))
        } else {
            (1.0, 1.0)
        };
        for i in 0..p.len() {
            let mut grad = g[i];
            if !hp.adam_w_mode {
                grad += hp.weight_decay * p[i];
            } else {
                p[i] *= 1.0 - hp.lr * hp.weight_decay;
            }
            m[i] = hp.beta1 * m[i] + (1.0 - hp.beta1) * grad;
            v[i] = hp.beta2 * v[i] + (1.0 - hp.beta2) * grad * grad;
            p[i] -= hp.lr / bc1 * m[i] / (v[i].sqrt() / bc2.sqrt() + hp.eps);
        }
    }

    fn all_variants() -> Vec<AdamParams> {
        let mut out = Vec::new();
        for adam_w_mode in [true, false] {
            for weight_decay in [0.0, 0.1] {
                for bias_correction in [true, false] {
                    out.push(AdamParams {
                        lr: 1e-2,
                        weight_decay,
                        adam_w_mode,
                        bias_correction,
                        ..AdamParams::default()
                    });
                }
            }
        }
        // A beta1 below 0.5 takes PyTorch's other lerp branch.
        out.push(AdamParams {
            beta1: 0.3,
            beta2: 0.9,
            weight_decay: 0.01,
            ..AdamParams::default()
        });
        out
    }

    #[test]
    fn matches_scalar_reference_bitwise() {
        for hp in all_variants() {
            for n in [5, TILE + 3, PAR_MIN_LEN + 1000] {
                let mut p = values(n, 1, 1.0);
                let mut state = AdamState::new(n);
                let (mut rp, mut rm, mut rv) = (p.clone(), vec![0f32; n], vec![0f32; n]);
                for t in 1..=4u64 {
                    let g = values(n, 10 + t, 0.5);
                    let gs = if t == 3 { 0.37 } else { 1.0 };
                    state.update(&mut p, &g, &hp, gs);
                    reference_f32(&mut rp, &g, &mut rm, &mut rv, t, &hp, gs);
                }
                assert_eq!(state.step, 4);
                for i in 0..n {
                    assert_eq!(p[i].to_bits(), rp[i].to_bits(), "{hp:?} n={n} p[{i}]");
                    assert_eq!(state.m[i].to_bits(), rm[i].to_bits(), "{hp:?} n={n} m[{i}]");
                    assert_eq!(state.v[i].to_bits(), rv[i].to_bits(), "{hp:?} n={n} v[{i}]");
                }
            }
        }
    }

    #[test]
    fn each_step_is_within_rounding_of_the_f64_formulas() {
        // Every step starts the f64 reference from the kernel's own f32 state, so that the check
        // measures the error of one step: two f32 roundings of p (decay, update), i.e. at most
        // about one f32 ulp.
        for hp in all_variants() {
            let n = 4096;
            let mut p = values(n, 2, 1.0);
            // Keep parameters away from 0 so that a relative comparison is meaningful.
            for x in &mut p {
                *x += x.signum() * 0.5;
            }
            let mut m = vec![0f32; n];
            let mut v = vec![0f32; n];
            for t in 1..=3u64 {
                let widen = |x: &[f32]| x.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>();
                let (mut p64, mut m64, mut v64) = (widen(&p), widen(&m), widen(&v));
                let (m_before, v_before, p_before) = (m64.clone(), v64.clone(), p64.clone());
                let g = values(n, 20 + t, 0.5);
                adam_step(&mut p, &g, &mut m, &mut v, t, &hp, 1.0);
                reference_f64(&mut p64, &widen(&g), &mut m64, &mut v64, t, &hp);
                for i in 0..n {
                    let rel = (f64::from(p[i]) - p64[i]).abs() / p64[i].abs();
                    assert!(
                        rel <= 1.5 * f64::from(f32::EPSILON),
                        "{hp:?} t={t} p[{i}] {} vs {} ({rel:e})",
                        p[i],
                        p64[i]
                    );
                    // m = beta1*m + (1-beta1)*g may cancel: bound the error by the terms' size.
                    // The classic-Adam gradient g + wd*p may cancel as well.
                    let l2 = if hp.adam_w_mode { 0.0 } else { hp.weight_decay };
                    let g_size = f64::from(g[i].abs()) + l2 * p_before[i].abs();
                    let terms = m_before[i].abs() + g_size;
                    let err_m = (f64::from(m[i]) - m64[i]).abs();
                    assert!(
                        err_m <= 4.0 * f64::from(f32::EPSILON) * terms,
                        "{hp:?} t={t} m[{i}] {} vs {}",
                        m[i],
                        m64[i]
                    );
                    let err_v = (f64::from(v[i]) - v64[i]).abs();
                    let v_size = v_before[i] + g_size * g_size;
                    assert!(
                        err_v <= 8.0 * f64::from(f32::EPSILON) * v_size,
                        "{hp:?} t={t} v[{i}] {} vs {}",
                        v[i],
                        v64[i]
                    );
                }
            }
        }
    }

    #[test]
    fn first_step_moves_each_parameter_by_lr_against_the_gradient_sign() {
        // With bias correction, step 1 gives m/bc1 = g and sqrt(v/bc2) = |g|: a step of lr*sign(g).
        let hp = AdamParams {
            lr: 0.01,
            eps: 0.0,
            ..AdamParams::default()
        };
        let mut p = vec![1.0f32, 1.0, -2.0];
        let (mut m, mut v) = (vec![0f32; 3], vec![0f32; 3]);
        adam_step(&mut p, &[0.5f32, -3.0, 1e-3], &mut m, &mut v, 1, &hp, 1.0);
        let expect = [0.99f32, 1.01, -2.01];
        for (a, b) in p.iter().zip(expect) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
    }

    #[test]
    fn grad_scale_equals_prescaled_gradient() {
        let n = PAR_MIN_LEN + 5;
        let hp = AdamParams {
            weight_decay: 0.05,
            adam_w_mode: false,
            ..AdamParams::default()
        };
        let g = values(n, 3, 1000.0);
        let scaled: Vec<f32> = g.iter().map(|&x| x * 0.001_3).collect();
        let mut a = AdamState::new(n);
        let mut b = AdamState::new(n);
        let mut pa = values(n, 4, 1.0);
        let mut pb = pa.clone();
        a.update(&mut pa, &g, &hp, 0.001_3);
        b.update(&mut pb, &scaled, &hp, 1.0);
        assert_eq!(pa, pb);
        assert_eq!(a, b);
    }

    #[test]
    fn independent_of_thread_count() {
        let n = 4 * PAR_MIN_LEN + 333;
        let hp = AdamParams {
            weight_decay: 0.1,
            ..AdamParams::default()
        };
        let run = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("build rayon pool")
                .install(|| {
                    let mut p = values(n, 5, 1.0);
                    let mut out = vec![bf16::ZERO; n];
                    let mut s = AdamState::new(n);
                    for t in 0..3 {
                        let g = values(n, 50 + t, 0.1);
                        s.update_with_copy(&mut p, &g, &hp, 0.5, &mut out);
                    }
                    (p, s, out)
                })
        };
        let one = run(1);
        for threads in [2, 5] {
            assert_eq!(one, run(threads), "{threads} threads");
        }
    }

    #[test]
    fn sixteen_bit_copy_and_gradients() {
        let n = PAR_MIN_LEN + 4099;
        let hp = AdamParams::default();
        let g = values(n, 6, 0.1);
        let g_bf16: Vec<bf16> = g.iter().map(|&x| bf16::from_f32(x)).collect();
        let g_wide: Vec<f32> = g_bf16.iter().map(|x| x.to_f32()).collect();

        // bf16 gradients give the same update as their exact f32 widening.
        let mut p1 = values(n, 7, 1.0);
        let mut p2 = p1.clone();
        let (mut s1, mut s2) = (AdamState::new(n), AdamState::new(n));
        let mut copy_bf16 = vec![bf16::ZERO; n];
        let mut copy_f16 = vec![f16::ZERO; n];
        s1.update_with_copy(&mut p1, &g_bf16, &hp, 1.0, &mut copy_bf16);
        s2.update_with_copy(&mut p2, &g_wide, &hp, 1.0, &mut copy_f16);
        assert_eq!(p1, p2);
        assert_eq!(s1, s2);
        for i in 0..n {
            assert_eq!(
                copy_bf16[i].to_bits(),
                bf16::from_f32(p1[i]).to_bits(),
                "bf16 copy [{i}]"
            );
            assert_eq!(
                copy_f16[i].to_bits(),
                f16::from_f32(p1[i]).to_bits(),
                "f16 copy [{i}]"
            );
        }
    }

    /// Raw bytes of a slice, to compare results bit for bit whatever the element type.
    fn bytes_of<E: Element>(x: &[E]) -> Vec<u8> {
        bytemuck::cast_slice(x).to_vec()
    }

    /// Three steps on path `isa` from fixed inputs; the bytes of p, m, v and the copy (if any).
    /// The first step's gradients hold NaN and +-Inf at three distinct elements, so that their
    /// propagation (and the NaN rounding of 16-bit outputs) is compared too.
    fn run_on<G: Element, S: StateElement, T: Element>(
        isa: AdamIsa,
        hp: &AdamParams,
        copy: Option<CopyStores>,
        n: usize,
    ) -> [Vec<u8>; 4] {
        let mut p = values(n, 31, 1.0);
        let mut m = vec![S::zeroed(); n];
        let mut v = vec![S::zeroed(); n];
        let mut out = vec![T::zeroed(); if copy.is_some() { n } else { 0 }];
        for t in 1..=3u64 {
            let mut g32 = values(n, 40 + t, 0.5);
            if t == 1 {
                (g32[1], g32[n / 2], g32[n - 2]) = (f32::NAN, f32::INFINITY, f32::NEG_INFINITY);
            }
            let mut g = vec![G::zeroed(); n];
            G::narrow(&g32, &mut g);
            let c = StepConsts::new(hp, t, if t == 2 { 0.37 } else { 1.0 });
            let stores = copy.unwrap_or(CopyStores::Cached);
            let out = copy.is_some().then_some(out.as_mut_slice());
            adam_impl(isa, &mut p, &g, &mut m, &mut v, out, &c, stores);
        }
        [bytes_of(&p), bytes_of(&m), bytes_of(&v), bytes_of(&out)]
    }

    /// Every available path against the portable one, for one (gradient, state) type pair, with
    /// no copy and with bf16 and f16 copies, over Adam, AdamW and both lerp branches.
    fn paths_agree<G: Element, S: StateElement>() {
        let n = PAR_MIN_LEN + TILE + 7;
        let mut hps = Vec::new();
        for adam_w_mode in [true, false] {
            for beta1 in [0.9, 0.3] {
                hps.push(AdamParams {
                    lr: 1e-2,
                    beta1,
                    weight_decay: 0.1,
                    adam_w_mode,
                    ..AdamParams::default()
                });
            }
        }
        for hp in &hps {
            let cached = Some(CopyStores::Cached);
            let base = [
                run_on::<G, S, f32>(AdamIsa::Portable, hp, None, n),
                run_on::<G, S, bf16>(AdamIsa::Portable, hp, cached, n),
                run_on::<G, S, f16>(AdamIsa::Portable, hp, cached, n),
            ];
            let streaming = Some(CopyStores::Streaming);
            for isa in AdamIsa::available() {
                let got = [
                    run_on::<G, S, f32>(isa, hp, None, n),
                    run_on::<G, S, bf16>(isa, hp, cached, n),
                    run_on::<G, S, f16>(isa, hp, cached, n),
                    run_on::<G, S, bf16>(isa, hp, streaming, n),
                    run_on::<G, S, f16>(isa, hp, streaming, n),
                ];
                let copies = ["none", "bf16", "f16", "bf16 streamed", "f16 streamed"];
                let base = base.iter().chain(&base[1..]);
                for (copy, (b, o)) in copies.iter().zip(base.zip(&got)) {
                    for (what, (x, y)) in ["p", "m", "v", "copy"].iter().zip(b.iter().zip(o)) {
                        assert!(
                            x == y,
                            "{} path: {what} differs from portable (grads {}, states {}, \
                             copy {copy}, {hp:?})",
                            isa.name(),
                            G::NAME,
                            S::NAME
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn every_isa_path_gives_the_portable_bits() {
        eprintln!(
            "adam paths on this CPU: {:?} (chosen: {})",
            AdamIsa::available(),
            adam_isa().name()
        );
        paths_agree::<f32, f32>();
        paths_agree::<bf16, f32>();
        paths_agree::<f16, f32>();
        paths_agree::<f32, bf16>();
        paths_agree::<bf16, bf16>();
        paths_agree::<f16, bf16>();
    }

    #[test]
    fn bf16_rounding_on_every_path_matches_half_across_all_exponents() {
        // With lr = 0, zero gradients and AdamW, the step leaves p as it is (p * 1 + -0; NaNs
        // are quietened), so the bf16 copy is the rounding of about 1M bit patterns over the
        // whole u32 range and their tie neighbourhoods, done by each path's vectorised narrow.
        let mut src = Vec::with_capacity(3 << 20);
        let mut b: u32 = 0;
        while let Some(next) = b.checked_add(4093) {
            let tie = (b & 0xffff_0000) | 0x8000;
            src.extend([b, tie, tie ^ 0x1_0000].map(f32::from_bits));
            b = next;
        }
        let hp = AdamParams {
            lr: 0.0,
            weight_decay: 0.1,
            adam_w_mode: true,
            ..AdamParams::default()
        };
        let n = src.len();
        let g = vec![bf16::ZERO; n];
        for isa in AdamIsa::available() {
            let mut p = src.clone();
            let (mut m, mut v) = (vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
            let mut out = vec![bf16::ZERO; n];
            let c = StepConsts::new(&hp, 1, 1.0);
            let stores = CopyStores::for_len(n);
            assert_eq!(stores, CopyStores::Streaming, "{n} elements should stream");
            adam_impl(isa, &mut p, &g, &mut m, &mut v, Some(&mut out), &c, stores);
            for ((x, y), got) in src.iter().zip(&p).zip(&out) {
                if !x.is_nan() {
                    assert_eq!(x.to_bits(), y.to_bits(), "{}: p changed", isa.name());
                }
                assert_eq!(
                    got.to_bits(),
                    bf16::from_f32(*y).to_bits(),
                    "{}: bf16 of {:#010x}",
                    isa.name(),
                    x.to_bits()
                );
            }
        }
    }

    #[test]
    fn bf16_state_conversions_are_halfs() {
        // Every bf16 widens to half's value (NaNs: a NaN); rounding matches half bit for bit on
        // about 1M f32 patterns over the whole range and their tie neighbourhoods, NaNs included.
        for b in 0..=u16::MAX {
            let h = bf16::from_bits(b);
            let w = h.load();
            assert!(w.to_bits() == h.to_f32().to_bits() || (w.is_nan() && h.is_nan()));
        }
        let mut b: u32 = 0;
        while let Some(next) = b.checked_add(4093) {
            let tie = (b & 0xffff_0000) | 0x8000;
            for x in [b, tie, tie ^ 0x1_0000].map(f32::from_bits) {
                let (got, want) = (bf16::store(x).to_bits(), bf16::from_f32(x).to_bits());
                assert_eq!(got, want, "{:#010x}", x.to_bits());
            }
            b = next;
        }
    }

    #[test]
    fn bf16_states_track_f32_states_on_a_quadratic() {
        // Minimise sum_i a_i (p_i - t_i)^2 / 2 (curvatures 0.1..10) with AdamW, 100 steps of
        // lr 1e-2, once with f32 moments and once with bf16 moments. Rounding m and v to 8
        // significant bits perturbs each step's m/sqrt(v) by a few 2^-8 relative, i.e. a few
        // 2^-8 * lr per element per step, which the gradient feedback partly undoes; measured
        // here: max |p_bf16 - p_f32| = 6.3e-3 after 100 steps. Bound: 0.02 (2 lr, 3x that).
        let n = 4096;
        let targets = values(n, 61, 1.0);
        let curv: Vec<f32> = values(n, 62, 1.0).iter().map(|x| 5.05 + 4.95 * x).collect();
        let hp = AdamParams {
            lr: 1e-2,
            weight_decay: 0.01,
            ..AdamParams::default()
        };
        let grad = |p: &[f32]| -> Vec<f32> {
            p.iter()
                .zip(&targets)
                .zip(&curv)
                .map(|((p, t), a)| a * (p - t))
                .collect()
        };
        let loss = |p: &[f32]| -> f64 {
            p.iter()
                .zip(&targets)
                .zip(&curv)
                .map(|((p, t), a)| 0.5 * f64::from(*a) * f64::from(p - t).powi(2))
                .sum()
        };
        let (mut p32, mut p16) = (vec![0f32; n], vec![0f32; n]);
        let mut s32 = AdamState::new(n);
        let mut s16 = AdamState::<bf16>::zeroed(n);
        let loss0 = loss(&p32);
        let mut max_diff = 0f32;
        for _ in 0..100 {
            let (g32, g16) = (grad(&p32), grad(&p16));
            s32.update(&mut p32, &g32, &hp, 1.0);
            s16.update(&mut p16, &g16, &hp, 1.0);
            let d = p32.iter().zip(&p16).map(|(a, b)| (a - b).abs());
            max_diff = d.fold(max_diff, f32::max);
        }
        let (l32, l16) = (loss(&p32), loss(&p16));
        assert!(
            l32 < 0.5 * loss0,
            "f32-state Adam did not learn: {loss0} -> {l32}"
        );
        assert!(
            max_diff <= 0.02,
            "bf16 states parted from f32 by {max_diff}"
        );
        // Near the optimum the loss is Adam's own jitter (steps of about lr around each target),
        // so the losses are compared against the starting loss: the same progress within 0.5%.
        assert!(
            (l16 - l32).abs() <= 0.005 * loss0,
            "losses from {loss0}: f32 states {l32}, bf16 states {l16}"
        );
        assert_eq!(s16.bytes(), s32.bytes() / 2);
        eprintln!("bf16 vs f32 states, 100 steps: max |dp| {max_diff:e}, loss {l16} vs {l32}");
    }

    #[test]
    fn isa_names_and_availability() {
        for isa in AdamIsa::ALL {
            assert_eq!(AdamIsa::from_name(isa.name()), Some(isa));
        }
        assert_eq!(AdamIsa::from_name(" AVX2 "), Some(AdamIsa::Avx2));
        assert_eq!(AdamIsa::from_name("sse9"), None);
        assert!(AdamIsa::Portable.is_available());
        assert!(AdamIsa::best().is_available());
        assert!(adam_isa().is_available());
        assert_eq!(AdamIsa::available().last(), Some(&AdamIsa::best()));
    }

    /// bf16 parameters as their own master: an update far below half a bf16 ulp, lost entirely
    /// by rounding to nearest, moves the parameters on average as the f32 update does; the bits
    /// depend on each element's place, not on how the shard is split or threaded.
    #[test]
    fn bf16_master_rounds_stochastically_and_by_place() {
        // Each element's rounding error is at most half an ulp (2^-9 below 1.0) per step, so over
        // 100 steps the mean of 65536 elements has a standard deviation under 1e-4.
        let n = 65536;
        let hp = AdamParams {
            lr: 1e-4,
            weight_decay: 0.0,
            ..AdamParams::default()
        };
        let g = vec![1.0f32; n];
        let run = |p: &mut [bf16], parts: usize, key: u32| {
            let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
            for step in 1..=100u64 {
                let len = n / parts;
                for k in 0..parts {
                    let r = k * len..(k + 1) * len;
                    let at = RoundingKey {
                        key: key ^ rounding_key(7, step, 0),
                        offset: r.start as u64,
                    };
                    let (m, v) = (&mut m[r.clone()], &mut v[r.clone()]);
                    adam_step_bf16_master(&mut p[r.clone()], &g[r], m, v, step, &hp, 1.0, at);
                }
            }
        };
        let mut p = vec![bf16::ONE; n];
        run(&mut p, 1, 0);
        // Adam's normalised step is lr per update: 100 updates of 1e-4 each take 1.0 to 0.99,
        // though one update is 1/78 of a bf16 ulp at 1.0 (2^-7).
        let mean = p.iter().map(|x| f64::from(x.to_f32())).sum::<f64>() / n as f64;
        assert!((mean - 0.99).abs() < 5e-4, "mean {mean}");
        assert!(
            p.iter().any(|&x| x != p[0]),
            "stochastic: not every element lands alike"
        );
        // The same places give the same bits split in four, on any thread count.
        let mut split = vec![bf16::ONE; n];
        rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap()
            .install(|| run(&mut split, 4, 0));
        assert_eq!(bytes_of(&p), bytes_of(&split));
        // Another key draws other bits.
        let mut other = vec![bf16::ONE; n];
        run(&mut other, 1, 1);
        assert_ne!(bytes_of(&p), bytes_of(&other));
        // NaN stays NaN, infinities stay infinite.
        for (x, want) in [
            (f32::NAN, None),
            (f32::INFINITY, Some(f32::INFINITY)),
            (f32::NEG_INFINITY, Some(f32::NEG_INFINITY)),
        ] {
            for random in [0, 0x7fff, 0xffff] {
                let got = bf16::from_bits(bf16_stochastic_bits(x, random)).to_f32();
                match want {
                    None => assert!(got.is_nan()),
                    Some(w) => assert_eq!(got, w),
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "params has 4 elements but grads 3")]
    fn mismatched_shard_lengths_panic() {
        let mut p = [0f32; 4];
        let (mut m, mut v) = ([0f32; 4], [0f32; 4]);
        adam_step(
            &mut p,
            &[0f32; 3],
            &mut m,
            &mut v,
            1,
            &AdamParams::default(),
            1.0,
        );
    }
}
