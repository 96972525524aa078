//! Rounding `f32` to bf16 with non-temporal stores, for the optimizer's 16-bit parameter copy.
//!
//! The copy is a write-only stream: with ordinary stores every cache line of it is first read
//! from memory (the read-for-ownership), so a shard larger than the cache moves 2 extra bytes per
//! parameter on top of the 28 the in-place Adam step moves. Non-temporal stores write whole lines
//! without reading them. They also bypass the cache, which is right only when the copy would be
//! evicted before anyone reads it: the caller uses them for long shards only (see
//! `optim::adam`), and must end each thread's run of them with a store fence (`_mm_sfence`) before
//! another thread may read the copy.
//!
//! The rounding is [`crate::flat::f32_to_bf16_bits`], vectorised: ties to even, NaNs
//! quietened, denormals kept (AVX-512 BF16's `vcvtneps2bf16` would flush them, so it is not used).

#[cfg(target_arch = "x86_64")]
use crate::flat::f32_to_bf16_bits;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Alignment of one streaming store of 16 bf16 values.
#[cfg(target_arch = "x86_64")]
const STORE_ALIGN: usize = 32;

/// Elements before `dst`'s first [`STORE_ALIGN`]-byte boundary (at most `dst.len()`); they are
/// rounded one by one, as is the tail after the last whole vector.
#[cfg(target_arch = "x86_64")]
fn unaligned_head(dst: &[u16]) -> usize {
    let misalign = dst.as_ptr() as usize % STORE_ALIGN;
    let head = if misalign == 0 {
        0
    } else {
        (STORE_ALIGN - misalign) / 2
    };
    head.min(dst.len())
}

/// Scalar rounding of a head or tail.
#[cfg(target_arch = "x86_64")]
fn narrow_scalar(src: &[f32], dst: &mut [u16]) {
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = f32_to_bf16_bits(x);
    }
}

/// `dst[i] = bf16(src[i])` with 32-byte non-temporal stores, AVX-512F.
///
/// # Safety
/// The CPU has AVX-512F. The caller issues `_mm_sfence` before the copy is read by another thread.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn narrow_bf16_avx512(src: &[f32], dst: &mut [u16]) {
    debug_assert_eq!(src.len(), dst.len(), "bf16 narrow: lengths differ");
    let head = unaligned_head(dst);
    narrow_scalar(&src[..head], &mut dst[..head]);
    let (src, dst) = (&src[head..], &mut dst[head..]);
    let whole = src.len() / 16 * 16;
    let bias = _mm512_set1_epi32(0x7fff);
    let one = _mm512_set1_epi32(1);
    let quiet = _mm512_set1_epi32(0x0040);
    for (s, d) in src[..whole]
        .chunks_exact(16)
        .zip(dst[..whole].chunks_exact_mut(16))
    {
        // SAFETY: `s` holds 16 f32 (unaligned load); `d` holds 16 u16 starting on a 32-byte
        // boundary (the head was peeled off and every chunk is 32 bytes).
        unsafe {
            let x = _mm512_loadu_ps(s.as_ptr());
            let b = _mm512_castps_si512(x);
            let hi = _mm512_srli_epi32::<16>(b);
            let lsb = _mm512_and_si512(hi, one);
            let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, _mm512_add_epi32(bias, lsb)));
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
            let bits = _mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(hi, quiet));
            _mm256_stream_si256(d.as_mut_ptr().cast(), _mm512_cvtepi32_epi16(bits));
        }
    }
    narrow_scalar(&src[whole..], &mut dst[whole..]);
}

/// Eight lanes of the rounding, AVX2: the 32-bit results, each below 2^16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn round_bf16_x8(x: __m256) -> __m256i {
    let b = _mm256_castps_si256(x);
    let hi = _mm256_srli_epi32::<16>(b);
    let lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    let bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb);
    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(b, bias));
    let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
    let quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x0040));
    _mm256_blendv_epi8(rounded, quiet, nan)
}

/// `dst[i] = bf16(src[i])` with 32-byte non-temporal stores, AVX2.
///
/// # Safety
/// The CPU has AVX2. The caller issues `_mm_sfence` before the copy is read by another thread.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn narrow_bf16_avx2(src: &[f32], dst: &mut [u16]) {
    debug_assert_eq!(src.len(), dst.len(), "bf16 narrow: lengths differ");
    let head = unaligned_head(dst);
    narrow_scalar(&src[..head], &mut dst[..head]);
    let (src, dst) = (&src[head..], &mut dst[head..]);
    let whole = src.len() / 16 * 16;
    for (s, d) in src[..whole]
        .chunks_exact(16)
        .zip(dst[..whole].chunks_exact_mut(16))
    {
        // SAFETY: as in `narrow_bf16_avx512`.
        unsafe {
            let lo = round_bf16_x8(_mm256_loadu_ps(s.as_ptr()));
            let hi = round_bf16_x8(_mm256_loadu_ps(s.as_ptr().add(8)));
            // packus interleaves 128-bit halves: [lo0-3, hi0-3, lo4-7, hi4-7]; put them in order.
            let packed = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(lo, hi));
            _mm256_stream_si256(d.as_mut_ptr().cast(), packed);
        }
    }
    narrow_scalar(&src[whole..], &mut dst[whole..]);
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// One of the streaming kernels.
    type Narrow = unsafe fn(&[f32], &mut [u16]);

    /// Bit patterns over the whole `u32` range, ties and their neighbours, NaNs and denormals.
    fn patterns() -> Vec<f32> {
        let mut src = Vec::new();
        let mut b: u32 = 0;
        while let Some(next) = b.checked_add(65_521) {
            let tie = (b & 0xffff_0000) | 0x8000;
            src.extend([b, tie, tie ^ 0x1_0000, b | 1].map(f32::from_bits));
            b = next;
        }
        src.extend([
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::MIN_POSITIVE / 3.0,
            -0.0,
        ]);
        src
    }

    #[test]
    fn streaming_rounding_equals_the_scalar_rounding_at_every_offset() {
        let src = patterns();
        let expect: Vec<u16> = src.iter().map(|&x| f32_to_bf16_bits(x)).collect();
        // Offsets 0..16 put the destination at every 2-byte misalignment of a 32-byte line, and
        // lengths below one vector exercise the head and tail alone.
        for offset in 0..16 {
            for len in [src.len() - offset, 15, 3, 0] {
                let (s, e) = (&src[offset..offset + len], &expect[offset..offset + len]);
                let mut paths: Vec<(&str, Narrow)> = Vec::new();
                if std::arch::is_x86_feature_detected!("avx2") {
                    paths.push(("avx2", narrow_bf16_avx2));
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    paths.push(("avx512", narrow_bf16_avx512));
                }
                for (name, narrow) in paths {
                    let mut buf = vec![0u16; len + 16];
                    let dst = &mut buf[offset % 16..offset % 16 + len];
                    // SAFETY: the feature was detected above; this thread reads its own stores
                    // after the fence.
                    unsafe {
                        narrow(s, dst);
                        _mm_sfence();
                    }
                    assert!(dst == e, "{name}: offset {offset}, len {len}");
                }
            }
        }
    }
}
