//! ZeRO++'s quantized weights (qwZ, `zero_quantized_weights`): stage 3's all-gathers carry each
//! rank's parameter shard as block-wise int8 and every rank widens the gathered bytes back.
//!
//! A shard is cut into blocks of [`BLOCK`] elements; each block travels as its f32 scale
//! (largest magnitude / 127) and one signed byte per element (`round(x / scale)`), symmetric, as
//! DeepSpeed's quantizer does for weights. The payload rides in a 16-bit buffer the collectives
//! carry as opaque bytes (an all-gather copies and never computes). Every rank, this one
//! included, computes with the widened values, so all ranks hold the same parameters; the fp32
//! master and the optimizer step stay exact.

use crate::flat::{Buffer, DType};
use half::f16;

/// Elements per quantization block: one f32 scale per block (DeepSpeed's quantizer aims at
/// groups of a few thousand elements).
pub const BLOCK: usize = 2048;

/// Bytes of the quantized form of `len` elements: a scale per block and a byte per element.
pub fn payload_bytes(len: usize) -> usize {
    len.div_ceil(BLOCK) * 4 + len
}

/// Elements of the 16-bit buffer that carries the quantized form of `len` elements.
pub fn payload_elems(len: usize) -> usize {
    payload_bytes(len).div_ceil(2)
}

/// A buffer to carry `count` payloads of `len` elements each.
pub fn payload_buffer(len: usize, count: usize) -> Buffer {
    Buffer::zeros(DType::F16, payload_elems(len) * count)
}

/// The bytes of a buffer (the payloads ride in 16-bit buffers).
pub(crate) fn bytes_mut(b: &mut Buffer) -> &mut [u8] {
    match b {
        Buffer::F16(v) => bytemuck::cast_slice_mut::<f16, u8>(v),
        Buffer::BF16(v) => bytemuck::cast_slice_mut(v),
        Buffer::F32(v) => bytemuck::cast_slice_mut(v),
    }
}

/// The bytes of a buffer, read-only.
pub(crate) fn bytes(b: &Buffer) -> &[u8] {
    match b {
        Buffer::F16(v) => bytemuck::cast_slice::<f16, u8>(v),
        Buffer::BF16(v) => bytemuck::cast_slice(v),
        Buffer::F32(v) => bytemuck::cast_slice(v),
    }
}

/// Writes the quantized form of all of `src` into the start of `payload` (sized by
/// [`payload_buffer`] for `src.len()` elements).
pub fn quantize_into(src: &Buffer, payload: &mut Buffer) {
    let len = src.len();
    let out = bytes_mut(payload);
    assert!(out.len() >= payload_bytes(len), "qwZ payload too small");
    let blocks = len.div_ceil(BLOCK);
    let (scales, values) = out.split_at_mut(blocks * 4);
    let mut wide = [0.0f32; BLOCK];
    for b in 0..blocks {
        let r = b * BLOCK..((b + 1) * BLOCK).min(len);
        let x = &mut wide[..r.len()];
        match src {
            Buffer::F32(v) => x.copy_from_slice(&v[r.clone()]),
            Buffer::BF16(v) => x
                .iter_mut()
                .zip(&v[r.clone()])
                .for_each(|(d, s)| *d = s.to_f32()),
            Buffer::F16(v) => x
                .iter_mut()
                .zip(&v[r.clone()])
                .for_each(|(d, s)| *d = s.to_f32()),
        }
        quantize_block(x, &mut scales[b * 4..b * 4 + 4], &mut values[r]);
    }
}

/// Writes the quantized form of the f32 `src` into the start of `out` (at least
/// [`payload_bytes`] of `src.len()` bytes): qgZ's gradients, with no widening copy.
pub fn quantize_f32(src: &[f32], out: &mut [u8]) {
    let blocks = src.len().div_ceil(BLOCK);
    let (scales, values) = out[..payload_bytes(src.len())].split_at_mut(blocks * 4);
    for (b, (x, q)) in src.chunks(BLOCK).zip(values.chunks_mut(BLOCK)).enumerate() {
        quantize_block(x, &mut scales[b * 4..b * 4 + 4], q);
    }
}

/// One block: its scale (largest magnitude / 127; 0 for a block of zeros) and a signed byte per
/// element. A block holding an Inf or NaN gets a NaN scale, so that it widens to NaN: an
/// overflow travels on to the loss scaler's check instead of vanishing into zeros.
fn quantize_block(x: &[f32], scale_out: &mut [u8], values: &mut [u8]) {
    // The largest magnitude as bits: an integer maximum vectorizes where a float one does not,
    // and any Inf or NaN has the largest bits of all.
    let bits = x.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff));
    let (peak, finite) = (f32::from_bits(bits), bits < 0x7f80_0000);
    let scale = match (finite, peak > 0.0) {
        (false, _) => f32::NAN,
        (true, true) => peak / 127.0,
        (true, false) => 0.0,
    };
    scale_out.copy_from_slice(&scale.to_le_bytes());
    if !(finite && peak > 0.0) {
        values.fill(0);
        return;
    }
    let inv = 1.0 / scale;
    // Round to nearest (ties to even) by adding and taking away 1.5 x 2^23, which needs no
    // rounding instruction and so vectorizes on every x86-64.
    const MAGIC: f32 = 12_582_912.0;
    for (q, &v) in values.iter_mut().zip(x) {
        let t = ((v * inv).clamp(-127.0, 127.0) + MAGIC) - MAGIC;
        // SAFETY: `t` is finite (the block is) and within [-127, 127].
        *q = unsafe { t.to_int_unchecked::<i32>() } as i8 as u8;
    }
}

/// Adds the widened values of the quantized form of `dst.len()` elements at the start of
/// `payload` into `dst` (qgZ's reduction of the payloads that arrive, in f32).
pub fn accumulate_f32(payload: &[u8], dst: &mut [f32]) {
    let blocks = dst.len().div_ceil(BLOCK);
    let (scales, values) = payload.split_at(blocks * 4);
    for (b, (d, q)) in dst.chunks_mut(BLOCK).zip(values.chunks(BLOCK)).enumerate() {
        let at = &scales[b * 4..b * 4 + 4];
        let s = f32::from_le_bytes([at[0], at[1], at[2], at[3]]);
        d.iter_mut()
            .zip(q)
            .for_each(|(d, &q)| *d += q as i8 as f32 * s);
    }
}

/// Widens the quantized form of `len` elements at the start of `payload` into `dst` from element
/// `start` on, in `dst`'s dtype (rounded once from f32 for 16-bit parameters).
pub fn dequantize_into(payload: &[u8], len: usize, dst: &mut Buffer, start: usize) {
    let blocks = len.div_ceil(BLOCK);
    let (scales, values) = payload.split_at(blocks * 4);
    let mut wide = [0.0f32; BLOCK];
    for b in 0..blocks {
        let r = b * BLOCK..((b + 1) * BLOCK).min(len);
        let at = &scales[b * 4..b * 4 + 4];
        let s = f32::from_le_bytes([at[0], at[1], at[2], at[3]]);
        let x = &mut wide[..r.len()];
        x.iter_mut()
            .zip(&values[r.clone()])
            .for_each(|(d, &q)| *d = q as i8 as f32 * s);
        let out = start + r.start..start + r.end;
        match dst {
            Buffer::F32(v) => v[out].copy_from_slice(x),
            Buffer::BF16(v) => v[out]
                .iter_mut()
                .zip(x.iter())
                .for_each(|(d, &w)| *d = half::bf16::from_f32(w)),
            Buffer::F16(v) => v[out]
                .iter_mut()
                .zip(x.iter())
                .for_each(|(d, &w)| *d = f16::from_f32(w)),
        }
    }
}

/// Widens every rank's payload of a gathered `payloads` buffer (one per rank, `shard` elements
/// each, in rank order) into the full `dst`.
pub fn dequantize_gathered(payloads: &Buffer, shard: usize, dst: &mut Buffer) {
    let all = bytes(payloads);
    let stride = payload_elems(shard) * 2;
    let ranks = dst.len() / shard.max(1);
    for r in 0..ranks {
        dequantize_into(&all[r * stride..], shard, dst, r * shard);
    }
}

/// The largest and the root-mean-square relative error of `approx` against `exact`, relative
/// to the largest magnitude of `exact` (for reports and tests of a quantized collective).
pub fn relative_error(exact: &[f32], approx: &[f32]) -> (f64, f64) {
    let peak = exact.iter().fold(0.0f64, |m, &v| m.max(f64::from(v).abs()));
    if peak == 0.0 || exact.is_empty() {
        return (0.0, 0.0);
    }
    let (mut max, mut sq) = (0.0f64, 0.0f64);
    for (&e, &a) in exact.iter().zip(approx) {
        let d = (f64::from(e) - f64::from(a)).abs() / peak;
        max = max.max(d);
        sq += d * d;
    }
    (max, (sq / exact.len() as f64).sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((i as f32 * 0.37).sin() * 0.05) * if i % 97 == 0 { 8.0 } else { 1.0 })
            .collect()
    }

    #[test]
    fn a_round_trip_is_within_half_a_step_of_each_block() {
        let len = 3 * BLOCK + 100;
        let x = sample(len);
        let src = Buffer::F32(x.clone());
        let mut payload = payload_buffer(len, 1);
        quantize_into(&src, &mut payload);
        let mut back = Buffer::zeros(DType::F32, len);
        dequantize_into(bytes(&payload), len, &mut back, 0);
        let back = back.into_f32().unwrap();
        for b in 0..len.div_ceil(BLOCK) {
            let r = b * BLOCK..((b + 1) * BLOCK).min(len);
            let peak = x[r.clone()].iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for i in r {
                assert!(
                    (x[i] - back[i]).abs() <= peak / 127.0 * 0.5 + 1e-9,
                    "element {i}"
                );
            }
        }
        let (max, rms) = relative_error(&x, &back);
        eprintln!("qwZ gather round trip against f32: relative max {max:.3e} rms {rms:.3e}");
        assert!(max < 0.5 / 127.0 + 1e-6 && rms < max, "{max} {rms}");
        // A block of zeros stays zeros.
        let zeros = Buffer::zeros(DType::BF16, 10);
        let mut p = payload_buffer(10, 1);
        quantize_into(&zeros, &mut p);
        let mut back = Buffer::F32(vec![1.0; 10]);
        dequantize_into(bytes(&p), 10, &mut back, 0);
        assert_eq!(back.into_f32().unwrap(), vec![0.0; 10]);
    }

    #[test]
    fn gradients_accumulate_in_f32_and_an_overflow_stays_an_overflow() {
        let len = BLOCK + 9;
        let x = sample(len);
        let mut payload = vec![0u8; payload_bytes(len)];
        quantize_f32(&x, &mut payload);
        let mut sum = vec![1.0f32; len];
        accumulate_f32(&payload, &mut sum);
        accumulate_f32(&payload, &mut sum);
        let want: Vec<f32> = x.iter().map(|v| 1.0 + 2.0 * v).collect();
        let (max, _) = relative_error(&want, &sum);
        assert!(max < 2.0 * 0.5 / 127.0 * 0.4, "{max}");
        for bad in [f32::INFINITY, f32::NAN] {
            let mut y = x.clone();
            y[BLOCK + 3] = bad;
            quantize_f32(&y, &mut payload);
            let mut out = vec![0.0f32; len];
            accumulate_f32(&payload, &mut out);
            assert!(
                out[..BLOCK].iter().all(|v| v.is_finite()),
                "{bad}: first block"
            );
            assert!(out[BLOCK..].iter().all(|v| v.is_nan()), "{bad}: its block");
        }
    }

    #[test]
    fn gathered_payloads_widen_in_rank_order() {
        let shard = BLOCK + 5;
        let full: Vec<f32> = sample(3 * shard);
        let mut gathered = payload_buffer(shard, 3);
        let stride = payload_elems(shard);
        for r in 0..3 {
            let mut p = payload_buffer(shard, 1);
            quantize_into(
                &Buffer::F32(full[r * shard..(r + 1) * shard].to_vec()),
                &mut p,
            );
            let Buffer::F16(src) = p else { unreachable!() };
            let Buffer::F16(dst) = &mut gathered else {
                unreachable!()
            };
            dst[r * stride..(r + 1) * stride].copy_from_slice(&src);
        }
        let mut out = Buffer::zeros(DType::F32, 3 * shard);
        dequantize_gathered(&gathered, shard, &mut out);
        let (max, _) = relative_error(&full, &out.into_f32().unwrap());
        assert!(max < 0.5 / 127.0 + 1e-6, "{max}");
        assert_eq!(payload_bytes(shard), 2 * 4 + shard);
    }
}
