//! 16-bit widening and narrowing, branch-free and eight lanes at a time: the conversions the
//! reduction kernels, the optimizer's casts and the model's bf16 products share, each computing
//! exactly the bits of `half`'s conversions (the unit tests of `comm::reduce` check them).

use half::{bf16, f16};

/// Lanes processed together by the lane kernel: 32 bytes of f32, so the loops below compile to
/// packed loads, one packed operation and packed stores.
pub(crate) const LANES: usize = 8;

/// An element type the lane kernel reduces: widening to f32 is exact and narrowing rounds exactly
/// as the `half` slice conversions of the generic path do, so both paths give the same bits.
pub(crate) trait Lane: Copy + 'static {
    fn widen(self) -> f32;
    fn narrow(x: f32) -> Self;
    /// [`LANES`] elements widened at once. `F16C`: the caller is the build compiled with the F16C
    /// conversion instructions (checked at run time), which f16 uses.
    #[inline(always)]
    fn widen_lanes<const F16C: bool>(x: [Self; LANES]) -> [f32; LANES] {
        x.map(Self::widen)
    }
    /// [`LANES`] elements narrowed at once; `F16C` as for [`Lane::widen_lanes`].
    #[inline(always)]
    fn narrow_lanes<const F16C: bool>(v: [f32; LANES]) -> [Self; LANES] {
        v.map(Self::narrow)
    }
}

impl Lane for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
    #[inline(always)]
    fn narrow(x: f32) -> f32 {
        x
    }
}

/// bf16 widening is a shift and its rounding a few integer operations. They are written here
/// without branches (`half`'s scalar versions branch on NaN and on the rounding bit, which keeps the
/// loops from vectorising) but compute exactly `bf16::to_f32` and `bf16::from_f32`: NaNs get the
/// quiet bit, other values round to nearest even. The unit tests check the bits against `half`.
impl Lane for bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        let i = self.to_bits() as u32;
        let quiet = if i & 0x7FFF > 0x7F80 { 0x40 } else { 0 };
        f32::from_bits((i | quiet) << 16)
    }
    #[inline(always)]
    fn narrow(x: f32) -> bf16 {
        bf16::from_bits(f32_to_bf16_bits(x))
    }
    /// A shift alone, without `widen`'s quiet bit: in the kernel every bf16 result leaves through
    /// `narrow`, which quietens NaNs itself, and on x86 nothing on the way tells a quiet NaN from a
    /// signalling one (sums and maxima pick among NaNs by position, not by that bit), so the output
    /// bits are the same. Saves a third of the instructions of a two-input bf16 lane group. Not on
    /// ARM, whose `fmaxnm` answers a signalling NaN with a NaN where a quiet one loses to a number.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn widen_lanes<const F16C: bool>(x: [bf16; LANES]) -> [f32; LANES] {
        x.map(|h| f32::from_bits((h.to_bits() as u32) << 16))
    }
}

/// f16 as bf16: branch-free conversions with the bits of `f16::to_f32` / `f16::from_f32` (and of
/// the F16C instructions that `half`'s slice conversions use): exact widening with NaNs quietened,
/// narrowing to nearest even with subnormals, overflow to Inf and NaN payloads kept. Every select
/// below computes both sides. They are the portable path; where the CPU has F16C the lane kernel
/// converts eight at a time with its instructions (the same bits). The unit tests check the bits
/// against `half` for every f16 and for every rounding case of f32.
impl Lane for f16 {
    #[inline(always)]
    fn widen_lanes<const F16C: bool>(x: [f16; LANES]) -> [f32; LANES] {
        #[cfg(target_arch = "x86_64")]
        if F16C {
            // SAFETY: `F16C` is only set in the build compiled with F16C, run on CPUs that have it.
            return unsafe { f16c::widen(x) };
        }
        x.map(Self::widen)
    }
    #[inline(always)]
    fn narrow_lanes<const F16C: bool>(v: [f32; LANES]) -> [f16; LANES] {
        #[cfg(target_arch = "x86_64")]
        if F16C {
            // SAFETY: as in `widen_lanes`.
            return unsafe { f16c::narrow(v) };
        }
        v.map(Self::narrow)
    }
    #[inline(always)]
    fn widen(self) -> f32 {
        let h = self.to_bits() as u32;
        let sign = (h & 0x8000) << 16;
        let bits = (h & 0x7fff) << 13;
        let exp = bits & (0x7c00 << 13);
        // Normal numbers: rebias the exponent (112 = 127 - 15).
        let normal = bits + (112 << 23);
        // Inf and NaN: exponent all ones; NaNs also get the quiet bit, as F16C and `half` do.
        let quiet = if bits & (0x3ff << 13) != 0 {
            0x0040_0000
        } else {
            0
        };
        let special = (normal + ((128 - 16) << 23)) | quiet;
        // Zero and subnormals: the mantissa scaled by 2^-24, exactly (one f32 subtraction).
        let magic = f32::from_bits(113 << 23);
        let sub = (f32::from_bits(normal + (1 << 23)) - magic).to_bits();
        let o = if exp == 0x7c00 << 13 {
            special
        } else if exp == 0 {
            sub
        } else {
            normal
        };
        f32::from_bits(o | sign)
    }
    #[inline(always)]
    fn narrow(x: f32) -> f16 {
        let b = x.to_bits();
        let sign = ((b >> 16) & 0x8000) as u16;
        let a = b & 0x7fff_ffff;
        // NaN keeps the top of its payload with the quiet bit set; Inf and overflow give Inf.
        let nan = (0x7e00 | ((a & 0x007f_ffff) >> 13)) as u16;
        let big = if a > 0x7f80_0000 { nan } else { 0x7c00 };
        // Subnormal results (and zero): adding 0.5 lines the 10 kept bits up at the bottom of the
        // f32 mantissa, the FPU rounding to nearest even on the way.
        let denorm_magic = ((127 - 15) + (23 - 10) + 1) << 23;
        let sub =
            ((f32::from_bits(a) + f32::from_bits(denorm_magic)).to_bits() - denorm_magic) as u16;
        // Normal results: rebias, add just under half an ulp plus the lowest kept bit, truncate.
        let odd = (a >> 13) & 1;
        let normal = (a.wrapping_sub(112 << 23).wrapping_add(0xfff + odd) >> 13) as u16;
        let o = if a >= (127 + 16) << 23 {
            big
        } else if a < 113 << 23 {
            sub
        } else {
            normal
        };
        f16::from_bits(o | sign)
    }
}

/// The F16C conversions of eight lanes: IEEE widening, and narrowing rounded to nearest even.
#[cfg(target_arch = "x86_64")]
mod f16c {
    use super::LANES;
    use half::f16;
    use std::arch::x86_64::{
        __m128i, _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_loadu_ps, _mm256_storeu_ps,
        _mm_loadu_si128, _mm_storeu_si128, _MM_FROUND_TO_NEAREST_INT,
    };

    /// # Safety
    /// The CPU has F16C.
    #[target_feature(enable = "f16c")]
    #[inline]
    pub(super) unsafe fn widen(x: [f16; LANES]) -> [f32; LANES] {
        let mut out = [0f32; LANES];
        let v = _mm256_cvtph_ps(_mm_loadu_si128(x.as_ptr() as *const __m128i));
        _mm256_storeu_ps(out.as_mut_ptr(), v);
        out
    }

    /// # Safety
    /// The CPU has F16C.
    #[target_feature(enable = "f16c")]
    #[inline]
    pub(super) unsafe fn narrow(v: [f32; LANES]) -> [f16; LANES] {
        let mut out = [f16::ZERO; LANES];
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(v.as_ptr()));
        _mm_storeu_si128(out.as_mut_ptr() as *mut __m128i, h);
        out
    }
}

/// `f32` -> bf16 bits, round to nearest even, NaN kept NaN (quietened), overflow to Inf: the same
/// bits as `bf16::from_f32`, but branch-free so that slice loops vectorise (the `half` crate
/// converts bf16 one element at a time with branches). The one copy of this rounding in the crate:
/// the reduction kernels of `comm` and the slice casts of `flat::slices` both use it.
#[inline(always)]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    // Adding 0x7fff plus the lowest kept bit carries into the kept half exactly when the dropped
    // half is above one half-ulp, or equal to it with an odd kept half (ties to even).
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let quiet_nan = (b >> 16) | 0x0040;
    // `is_nan` (a float compare, one `vcmpunordps` per vector) rather than testing the bits: the
    // same set of inputs, and the Adam kernel's bf16 moments spend fewer registers and µops on it.
    (if x.is_nan() { quiet_nan } else { rounded }) as u16
}
