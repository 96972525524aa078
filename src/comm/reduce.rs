//! Element kernels of the in-process backend: the reduction of N ranks' slices into one and the
//! widening/narrowing of 16-bit types.
//!
//! Reductions run over blocks small enough to stay in L1 (an f32 accumulator of 2048 elements):
//! each rank's block is read once, combined into the accumulator in rank order 0..N-1 (a fixed
//! order, so the result is bit-identical whoever computes it), and the result is written once. 16-bit
//! inputs are widened to f32, accumulated in f32 and rounded once (round to nearest even).
//!
//! Every dtype takes the lane path (`reduce_lanes`): the large reductions are memory-bound only
//! if the core does little more than one packed operation per loaded vector, and the generic
//! path's extra copies through L1 scratch (load into the accumulator, round into a block, copy
//! out) made the 1 GiB reduce-scatter compute-bound on this machine's cores. The generic path,
//! built on `half`'s slice conversions, stays in the tests as the oracle the lane path must match
//! bit for bit.

use crate::comm::ReduceOp;
use crate::flat::lanes::{Lane, LANES};
use crate::flat::DType;
#[cfg(test)]
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Elements per accumulator block: 2 x 8 KiB of f32 scratch, well inside L1.
const BLOCK: usize = 2048;

/// An element type that can be reduced in f32 (the generic path).
#[cfg(test)]
trait Elem: Copy + 'static {
    /// `acc = src` widened.
    fn load(src: &[Self], acc: &mut [f32]);
    /// `acc = acc (op) src`, widening through `tmp` when needed.
    fn combine(op: ReduceOp, acc: &mut [f32], src: &[Self], tmp: &mut [f32]);
    /// `dst = acc` rounded to this type.
    fn store(acc: &[f32], dst: &mut [Self]);
}

#[cfg(test)]
fn combine_f32(op: ReduceOp, acc: &mut [f32], src: &[f32]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            for (a, &b) in acc.iter_mut().zip(src) {
                *a += b;
            }
        }
        ReduceOp::Max => {
            for (a, &b) in acc.iter_mut().zip(src) {
                *a = a.max(b);
            }
        }
    }
}

#[cfg(test)]
impl Elem for f32 {
    fn load(src: &[f32], acc: &mut [f32]) {
        acc.copy_from_slice(src);
    }
    fn combine(op: ReduceOp, acc: &mut [f32], src: &[f32], _tmp: &mut [f32]) {
        combine_f32(op, acc, src);
    }
    fn store(acc: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(acc);
    }
}

#[cfg(test)]
macro_rules! half_elem {
    ($t:ty) => {
        impl Elem for $t {
            fn load(src: &[$t], acc: &mut [f32]) {
                src.convert_to_f32_slice(acc);
            }
            fn combine(op: ReduceOp, acc: &mut [f32], src: &[$t], tmp: &mut [f32]) {
                let tmp = &mut tmp[..src.len()];
                src.convert_to_f32_slice(tmp);
                combine_f32(op, acc, tmp);
            }
            fn store(acc: &[f32], dst: &mut [$t]) {
                dst.convert_from_f32_slice(acc);
            }
        }
    };
}
#[cfg(test)]
half_elem!(bf16);
#[cfg(test)]
half_elem!(f16);

/// How a reduced block is written to its destinations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Store {
    /// Ordinary stores: right when the destination was just read (in-place all-reduce: the lines
    /// are already in cache) or is small.
    Cached,
    /// Streaming (non-temporal) stores: for large outputs that were not just read, they skip the
    /// read-for-ownership of every destination line, a third of the memory traffic of a
    /// reduce-scatter.
    Streaming,
}

/// The generic path: reduces `len` elements of type `T` from every source, in source order, and
/// writes the result to every destination.
///
/// # Safety
/// As `reduce_lanes`.
#[cfg(test)]
unsafe fn reduce_typed<T: Elem>(
    op: ReduceOp,
    srcs: &[*const T],
    dsts: &[*mut T],
    len: usize,
    store: Store,
) {
    let n = srcs.len();
    let mut acc = [0f32; BLOCK];
    let mut tmp = [0f32; BLOCK];
    // The rounded block, written once and copied to every destination. `T` is at most 4 bytes, so
    // BLOCK f32 words hold BLOCK elements of it.
    let mut out = [0f32; BLOCK];
    let mut off = 0;
    while off < len {
        let m = BLOCK.min(len - off);
        let acc = &mut acc[..m];
        // Each source slice lives only inside its own statement, so no shared borrow overlaps the
        // writes below even when a destination aliases a source.
        T::load(std::slice::from_raw_parts(srcs[0].add(off), m), acc);
        for src in &srcs[1..] {
            T::combine(
                op,
                acc,
                std::slice::from_raw_parts(src.add(off), m),
                &mut tmp,
            );
        }
        if op == ReduceOp::Avg {
            let n = n as f32;
            for a in acc.iter_mut() {
                *a /= n;
            }
        }
        let rounded = out.as_mut_ptr() as *mut T;
        T::store(acc, std::slice::from_raw_parts_mut(rounded, m));
        let bytes = m * std::mem::size_of::<T>();
        for dst in dsts {
            let d = dst.add(off) as *mut u8;
            match store {
                Store::Cached => std::ptr::copy_nonoverlapping(rounded as *const u8, d, bytes),
                Store::Streaming => stream_copy(rounded as *const u8, d, bytes),
            }
        }
        off += m;
    }
    if store == Store::Streaming {
        stream_fence();
    }
}

/// The lane reduction: per tile of [`BLOCK`] elements, the N inputs folded in rank order, widening
/// on load, the last pass rounding and writing straight to the destination.
///
/// Up to four inputs (worlds of 2 to 4) fold in one pass, `dst = ((src0 (op) src1) (op) src2) ...`,
/// reading every input stream at once: every input byte is read once and every output byte written
/// once, with no scratch round trip. (One pass per input through an accumulator ran four inputs at
/// 60% of this speed: the short bursts of each stream kept the prefetchers from ramping up.) More
/// inputs fold into an L1-resident f32 accumulator, three more per pass. The arithmetic is the
/// generic path's, element by element and in the same order, so results are bit-identical to it.
///
/// # Safety
/// Every `srcs[s]` must be valid for reads and every `dsts[d]` for writes of `len` elements, for
/// the whole call, with no other thread accessing the destinations or writing the sources. A
/// destination may alias a source (in-place all-reduce): each block is fully read before any of it
/// is written.
unsafe fn reduce_lanes<T: Lane>(
    op: ReduceOp,
    srcs: &[*const T],
    dsts: &[*mut T],
    len: usize,
    store: Store,
) {
    // The same code compiled for AVX2 where the CPU has it (checked once, cached by std): twice the
    // lanes per instruction, and bf16 rounding packs without SSE2's shuffles. Same IEEE operations
    // in the same order, so the same bits.
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("f16c")
        && crate::isa::allows(crate::isa::Isa::Avx2)
    {
        return reduce_lanes_avx2(op, srcs, dsts, len, store);
    }
    reduce_lanes_body::<T, false>(op, srcs, dsts, len, store)
}

/// [`reduce_lanes_body`] compiled with AVX2 and F16C enabled.
///
/// # Safety
/// As `reduce_lanes`, on a CPU with AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn reduce_lanes_avx2<T: Lane>(
    op: ReduceOp,
    srcs: &[*const T],
    dsts: &[*mut T],
    len: usize,
    store: Store,
) {
    reduce_lanes_body::<T, true>(op, srcs, dsts, len, store)
}

/// The body of `reduce_lanes`, inlined into each instruction-set variant.
///
/// # Safety
/// As `reduce_lanes`.
#[inline(always)]
unsafe fn reduce_lanes_body<T: Lane, const F16C: bool>(
    op: ReduceOp,
    srcs: &[*const T],
    dsts: &[*mut T],
    len: usize,
    store: Store,
) {
    let n = srcs.len();
    let esz = std::mem::size_of::<T>();
    let div = (op == ReduceOp::Avg).then_some(n as f32);
    let mut acc = [0f32; BLOCK];
    let acc_ptr = acc.as_mut_ptr();
    // The rounded tile when several destinations take streaming stores: written once, copied to
    // each. `T` is at most 4 bytes, so BLOCK f32 words hold BLOCK elements of it.
    let mut out = [0f32; BLOCK];
    let out_ptr = out.as_mut_ptr() as *mut T;
    // Otherwise the last pass writes into the first destination directly.
    let direct = dsts.len() == 1 || store == Store::Cached;
    let mut off = 0;
    while off < len {
        let m = BLOCK.min(len - off);
        let target = if direct { dsts[0].add(off) } else { out_ptr };
        let target_store = if direct { store } else { Store::Cached };
        let s = |k: usize| srcs[k].add(off);
        // Up to four inputs fold in one pass (every stream read at once, the sum in registers);
        // more go through the accumulator in passes of three more inputs each.
        match n {
            1 => pass::<T, T, T, F16C, 0>(op, target, s(0), [], m, div, target_store),
            2 => pass::<T, T, T, F16C, 1>(op, target, s(0), [s(1)], m, div, target_store),
            3 => pass::<T, T, T, F16C, 2>(op, target, s(0), [s(1), s(2)], m, div, target_store),
            4 => {
                let rest = [s(1), s(2), s(3)];
                pass::<T, T, T, F16C, 3>(op, target, s(0), rest, m, div, target_store)
            }
            _ => {
                let cached = Store::Cached;
                let rest = [s(1), s(2), s(3)];
                pass::<T, T, f32, F16C, 3>(op, acc_ptr, s(0), rest, m, None, cached);
                let mut k = 4;
                while n - k > 3 {
                    let rest = [s(k), s(k + 1), s(k + 2)];
                    pass::<f32, T, f32, F16C, 3>(op, acc_ptr, acc_ptr, rest, m, None, cached);
                    k += 3;
                }
                let (acc, st) = (acc_ptr as *const f32, target_store);
                match n - k {
                    1 => pass::<f32, T, T, F16C, 1>(op, target, acc, [s(k)], m, div, st),
                    2 => pass::<f32, T, T, F16C, 2>(op, target, acc, [s(k), s(k + 1)], m, div, st),
                    _ => {
                        let rest = [s(k), s(k + 1), s(k + 2)];
                        pass::<f32, T, T, F16C, 3>(op, target, acc, rest, m, div, st)
                    }
                }
            }
        }
        let first = target as *const u8;
        for (d, dst) in dsts.iter().enumerate() {
            if direct && d == 0 {
                continue;
            }
            let to = dst.add(off) as *mut u8;
            match store {
                Store::Cached => std::ptr::copy_nonoverlapping(first, to, m * esz),
                Store::Streaming => stream_copy(first, to, m * esz),
            }
        }
        off += m;
    }
    if store == Store::Streaming {
        stream_fence();
    }
}

/// `dst[i] = narrow(fin(((widen(a[i]) (op) widen(b0[i])) (op) widen(b1[i])) ...))` over the `K`
/// inputs `bs` (left to right, as the generic path folds), where `fin` divides by `div` when given,
/// for `m` elements. Each group of [`LANES`] elements is loaded before any of it is stored, so `dst`
/// may be exactly `a` or one of `bs` (the accumulator, an in-place destination) but must not
/// overlap them otherwise.
///
/// # Safety
/// `a` and every `bs[j]` valid for reads and `dst` for writes of `m` elements.
#[inline(always)]
unsafe fn pass<A: Lane, B: Lane, D: Lane, const F16C: bool, const K: usize>(
    op: ReduceOp,
    dst: *mut D,
    a: *const A,
    bs: [*const B; K],
    m: usize,
    div: Option<f32>,
    store: Store,
) {
    let one = |i: usize| -> D {
        let mut x = (*a.add(i)).widen();
        for b in bs {
            x = combine_one(op, x, (*b.add(i)).widen());
        }
        D::narrow(div.map_or(x, |d| x / d))
    };
    // Streaming stores need 16-byte aligned destinations: ordinary stores up to the boundary.
    let head = match store {
        Store::Cached => 0,
        Store::Streaming => ((dst as *mut u8).align_offset(16) / std::mem::size_of::<D>()).min(m),
    };
    for i in 0..head {
        *dst.add(i) = one(i);
    }
    let mut i = head;
    while i + LANES <= m {
        let x: [A; LANES] = std::ptr::read_unaligned(a.add(i) as *const [A; LANES]);
        let mut v: [f32; LANES] = A::widen_lanes::<F16C>(x);
        for b in bs {
            let y = B::widen_lanes::<F16C>(std::ptr::read_unaligned(b.add(i) as *const [B; LANES]));
            for l in 0..LANES {
                v[l] = combine_one(op, v[l], y[l]);
            }
        }
        if let Some(d) = div {
            for x in v.iter_mut() {
                *x /= d;
            }
        }
        let w: [D; LANES] = D::narrow_lanes::<F16C>(v);
        match store {
            Store::Cached => std::ptr::write_unaligned(dst.add(i) as *mut [D; LANES], w),
            Store::Streaming => stream_lanes(dst.add(i), &w),
        }
        i += LANES;
    }
    while i < m {
        *dst.add(i) = one(i);
        i += 1;
    }
}

/// One element of `acc (op) src`, exactly as [`combine_f32`] computes it.
#[inline(always)]
fn combine_one(op: ReduceOp, acc: f32, src: f32) -> f32 {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => acc + src,
        ReduceOp::Max => acc.max(src),
    }
}

/// Writes [`LANES`] elements to a 16-byte aligned `dst` with streaming stores.
///
/// # Safety
/// `dst` 16-byte aligned and valid for writes of [`LANES`] elements.
#[inline(always)]
unsafe fn stream_lanes<D: Lane>(dst: *mut D, v: &[D; LANES]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        let (s, d) = (v.as_ptr() as *const __m128i, dst as *mut __m128i);
        for k in 0..std::mem::size_of::<[D; LANES]>() / 16 {
            _mm_stream_si128(d.add(k), _mm_loadu_si128(s.add(k)));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    std::ptr::write_unaligned(dst as *mut [D; LANES], *v);
}

/// Type-erased `reduce_lanes`: addresses are of element 0 of each slice.
///
/// # Safety
/// As `reduce_lanes`, with `len` elements of `dtype` at every address, suitably aligned.
pub(crate) unsafe fn reduce_into(
    dtype: DType,
    op: ReduceOp,
    srcs: &[usize],
    dsts: &[usize],
    len: usize,
    store: Store,
) {
    if len == 0 || srcs.is_empty() {
        return;
    }
    // The casts below only reinterpret the addresses.
    match dtype {
        DType::F32 => reduce_lanes::<f32>(op, cast_ptrs(srcs), cast_ptrs_mut(dsts), len, store),
        DType::BF16 => reduce_lanes::<bf16>(op, cast_ptrs(srcs), cast_ptrs_mut(dsts), len, store),
        DType::F16 => reduce_lanes::<f16>(op, cast_ptrs(srcs), cast_ptrs_mut(dsts), len, store),
    }
}

/// Copies `bytes` from `src` to `dst` with streaming stores where the CPU has them (x86-64: SSE2,
/// always present); the caller issues [`stream_fence`] before others may read `dst`.
///
/// # Safety
/// As `copy_nonoverlapping`.
unsafe fn stream_copy(src: *const u8, dst: *mut u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        // Ordinary stores up to the first 16-byte boundary of the destination, streaming stores
        // for the aligned middle, ordinary stores for the tail. (Aligning to whole lines instead
        // measured slower: the ordinary stores then share a line with streaming ones at every
        // call.)
        let head = (dst.align_offset(16)).min(bytes);
        std::ptr::copy_nonoverlapping(src, dst, head);
        let mut i = head;
        while i + 64 <= bytes {
            let s = src.add(i) as *const __m128i;
            let d = dst.add(i) as *mut __m128i;
            _mm_stream_si128(d, _mm_loadu_si128(s));
            _mm_stream_si128(d.add(1), _mm_loadu_si128(s.add(1)));
            _mm_stream_si128(d.add(2), _mm_loadu_si128(s.add(2)));
            _mm_stream_si128(d.add(3), _mm_loadu_si128(s.add(3)));
            i += 64;
        }
        while i + 16 <= bytes {
            _mm_stream_si128(
                dst.add(i) as *mut __m128i,
                _mm_loadu_si128(src.add(i) as *const __m128i),
            );
            i += 16;
        }
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), bytes - i);
    }
    #[cfg(not(target_arch = "x86_64"))]
    std::ptr::copy_nonoverlapping(src, dst, bytes);
}

/// Orders streaming stores before the stores that follow (the meeting that hands the data over).
fn stream_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE2 is part of the x86-64 baseline.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// Views a slice of addresses as a slice of typed pointers (same size and layout).
fn cast_ptrs<T>(addrs: &[usize]) -> &[*const T] {
    // SAFETY: `usize` and `*const T` (T: Sized) have the same size and alignment, and every bit
    // pattern of a usize is a valid raw pointer value.
    unsafe { std::slice::from_raw_parts(addrs.as_ptr() as *const *const T, addrs.len()) }
}

/// [`cast_ptrs`] for destinations.
fn cast_ptrs_mut<T>(addrs: &[usize]) -> &[*mut T] {
    // SAFETY: as `cast_ptrs`.
    unsafe { std::slice::from_raw_parts(addrs.as_ptr() as *const *mut T, addrs.len()) }
}

/// Copies `bytes` bytes from `src` to `dst` (distinct buffers).
///
/// # Safety
/// Both ranges valid and not overlapping, no concurrent writer of either.
pub(crate) unsafe fn copy_bytes(src: usize, dst: usize, bytes: usize) {
    if bytes > 0 {
        std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes);
    }
}

/// Bytes of the source copied to every destination before moving on: small enough to stay in the
/// core's L1 between the first destination (which reads it from memory) and the last.
const FAN_OUT_BLOCK: usize = 16 << 10;

/// Copies `bytes` bytes from `src` to every address in `dsts`, block by block, so the source is
/// read from memory once whatever the number of destinations (the all-gather's push: one read of
/// the shard, n writes). With [`Store::Streaming`] the writes bypass the cache (no
/// read-for-ownership of lines that are only overwritten) and are fenced before returning.
///
/// # Safety
/// `src` valid for reads and every destination valid for writes of `bytes` bytes; no destination
/// overlaps the source or another destination, and nothing else writes them concurrently.
pub(crate) unsafe fn fan_out_copy(src: usize, dsts: &[usize], bytes: usize, store: Store) {
    if bytes == 0 || dsts.is_empty() {
        return;
    }
    let mut off = 0;
    while off < bytes {
        let m = FAN_OUT_BLOCK.min(bytes - off);
        let from = (src + off) as *const u8;
        for &dst in dsts {
            let to = (dst + off) as *mut u8;
            match store {
                Store::Cached => std::ptr::copy_nonoverlapping(from, to, m),
                Store::Streaming => stream_copy(from, to, m),
            }
        }
        off += m;
    }
    if store == Store::Streaming {
        stream_fence();
    }
}

/// The serial reference reduction of whole buffers (rank order 0..N-1, f32 accumulation, one
/// rounding): what every backend must reproduce bit for bit. Used by tests and by callers that need a
/// local reduction with identical numerics.
pub fn reduce_reference(inputs: &[&crate::flat::Buffer], op: ReduceOp) -> crate::flat::Buffer {
    assert!(
        !inputs.is_empty(),
        "reduce_reference needs at least one input"
    );
    let dtype = inputs[0].dtype();
    let len = inputs[0].len();
    assert!(
        inputs.iter().all(|b| b.dtype() == dtype && b.len() == len),
        "reduce_reference: inputs differ in dtype or length"
    );
    let mut out = crate::flat::Buffer::zeros(dtype, len);
    let srcs: Vec<usize> = inputs.iter().map(|b| buffer_addr(b)).collect();
    let dst = [buffer_addr_mut(&mut out)];
    // SAFETY: every input has `len` elements of `dtype`, `out` is a fresh buffer of the same shape,
    // and nothing else touches them during the call.
    unsafe { reduce_into(dtype, op, &srcs, &dst, len, Store::Cached) };
    out
}

/// Address of element 0 of a buffer.
pub(crate) fn buffer_addr(b: &crate::flat::Buffer) -> usize {
    use crate::flat::Buffer;
    match b {
        Buffer::F32(v) => v.as_ptr() as usize,
        Buffer::BF16(v) => v.as_ptr() as usize,
        Buffer::F16(v) => v.as_ptr() as usize,
    }
}

/// Mutable address of element 0 of a buffer.
pub(crate) fn buffer_addr_mut(b: &mut crate::flat::Buffer) -> usize {
    use crate::flat::Buffer;
    match b {
        Buffer::F32(v) => v.as_mut_ptr() as usize,
        Buffer::BF16(v) => v.as_mut_ptr() as usize,
        Buffer::F16(v) => v.as_mut_ptr() as usize,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flat::Buffer;

    #[test]
    fn sixteen_bit_sums_accumulate_in_f32_and_round_once() {
        // [1, 2^-8, 2^-8]: summed step by step in bf16 (7 mantissa bits) each addition would round
        // back to 1.0 (a tie, to even); accumulated in f32 the total 1 + 2^-7 is exact in bf16.
        let vals = [1.0f32, 1.0 / 256.0, 1.0 / 256.0];
        let bufs: Vec<Buffer> = vals
            .iter()
            .map(|&v| Buffer::BF16(vec![bf16::from_f32(v); 3]))
            .collect();
        let refs: Vec<&Buffer> = bufs.iter().collect();
        let sum = reduce_reference(&refs, ReduceOp::Sum);
        assert_eq!(sum.get_f32(2), 1.0 + 1.0 / 128.0);
        let f = f16::from_f32(1000.0);
        let bufs: Vec<Buffer> = (0..2).map(|_| Buffer::F16(vec![f; 5000])).collect();
        let refs: Vec<&Buffer> = bufs.iter().collect();
        let sum = reduce_reference(&refs, ReduceOp::Sum);
        assert_eq!(sum.get_f32(4999), 2000.0);
    }

    #[test]
    fn max_and_in_place_reduction() {
        let mut a = Buffer::F32((0..5000).map(|i| i as f32).collect());
        let mut b = Buffer::F32((0..5000).map(|i| 4999.0 - i as f32).collect());
        let mut c = Buffer::BF16(vec![bf16::ZERO; 5000]);
        let srcs = [buffer_addr(&a), buffer_addr(&b)];
        let dsts = [buffer_addr_mut(&mut a), buffer_addr_mut(&mut b)];
        // SAFETY: both buffers hold 5000 f32; the destinations alias the sources, which the kernel
        // allows.
        unsafe { reduce_into(DType::F32, ReduceOp::Max, &srcs, &dsts, 5000, Store::Cached) };
        for i in 0..5000 {
            let want = (i as f32).max(4999.0 - i as f32);
            assert_eq!((a.get_f32(i), b.get_f32(i)), (want, want));
        }
        // Streaming stores into an odd offset: the unaligned head and tail take ordinary stores.
        let x = Buffer::BF16((0..5000).map(|i| bf16::from_f32(i as f32)).collect());
        let srcs = [buffer_addr(&x) + 2 * 3, buffer_addr(&x) + 2 * 3];
        let dst = [buffer_addr_mut(&mut c) + 2 * 7];
        // SAFETY: 4990 elements from offsets 3 and 7 stay inside both 5000-element buffers.
        unsafe {
            reduce_into(
                DType::BF16,
                ReduceOp::Sum,
                &srcs,
                &dst,
                4990,
                Store::Streaming,
            )
        };
        for i in 0..4990 {
            assert_eq!(
                c.get_f32(i + 7),
                bf16::from_f32(2.0 * (i + 3) as f32).to_f32()
            );
        }
        assert_eq!((c.get_f32(6), c.get_f32(4997)), (0.0, 0.0));
    }

    /// Runs the lane kernel and the generic kernel on the same inputs (given as f32 values, converted
    /// with `conv`) and compares every bit of one and two destinations.
    /// `snan` is a signalling NaN of the type (which no conversion from f32 produces): its bits in
    /// the output show whether every path quietens NaNs alike.
    fn lanes_match_generic<T: Lane + Elem + PartialEq + std::fmt::Debug>(
        conv: fn(f32) -> T,
        snan: T,
    ) {
        // Values with rounding in every sum, signed zeros, infinities, NaNs with different signs
        // and payloads, quiet and signalling, and subnormals; lengths around the block and lane
        // sizes; offsets that misalign the streaming stores.
        let len = 2 * BLOCK + 13;
        let special = [
            0.0f32,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0xFFE1_2345),
            1e-40,
        ];
        let input = |s: usize| -> Vec<T> {
            (0..len + 8)
                .map(|i| {
                    let k = (i + s) % (special.len() + 1);
                    if (i * 7 + s) % 29 != 0 {
                        conv(((i * 31 + s * 17) % 1000) as f32 * 0.001 + 1.0 / (1 + s) as f32)
                    } else if k == special.len() {
                        snan
                    } else {
                        conv(special[k])
                    }
                })
                .collect()
        };
        let fill = conv(7.0);
        // 1 to 4 inputs fold in one pass; 5 to 9 cover every way the accumulator passes end.
        for n in 1..=9 {
            let inputs: Vec<Vec<T>> = (0..n).map(input).collect();
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                for store in [Store::Cached, Store::Streaming] {
                    for (m, off) in [(len, 0), (len - 3, 1), (5, 3), (LANES - 1, 2)] {
                        let srcs: Vec<*const T> =
                            inputs.iter().map(|v| v[off..].as_ptr()).collect();
                        let mut fast = vec![vec![fill; len + 8]; 2];
                        let mut slow = vec![vec![fill; len + 8]; 2];
                        let fd: Vec<*mut T> =
                            fast.iter_mut().map(|v| v[off..].as_mut_ptr()).collect();
                        let sd: Vec<*mut T> =
                            slow.iter_mut().map(|v| v[off..].as_mut_ptr()).collect();
                        for k in 1..=4 {
                            // SAFETY: every pointer has at least `m` elements behind it.
                            unsafe {
                                // The build this CPU runs, then the portable one.
                                if k <= 2 {
                                    reduce_lanes(op, &srcs, &fd[..k], m, store);
                                } else {
                                    reduce_lanes_body::<T, false>(
                                        op,
                                        &srcs,
                                        &fd[..k - 2],
                                        m,
                                        store,
                                    );
                                }
                                reduce_typed::<T>(op, &srcs, &sd[..(k - 1) % 2 + 1], m, store);
                            }
                            // Bytes, so that NaNs compare by their bits.
                            let bytes = |v: &Vec<Vec<T>>| -> Vec<u8> {
                                v.iter()
                                    .flat_map(|b| {
                                        // SAFETY: plain numbers, viewed as their bytes.
                                        unsafe {
                                            std::slice::from_raw_parts(
                                                b.as_ptr() as *const u8,
                                                std::mem::size_of_val(&b[..]),
                                            )
                                        }
                                        .to_vec()
                                    })
                                    .collect()
                            };
                            assert!(
                                bytes(&fast) == bytes(&slow),
                                "n {n} {op:?} {store:?} m {m} k {k}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn lane_path_is_bit_identical_to_the_generic_path() {
        lanes_match_generic::<f32>(|x| x, f32::from_bits(0x7F80_0123));
        lanes_match_generic::<bf16>(bf16::from_f32, bf16::from_bits(0x7F83));
        lanes_match_generic::<f16>(f16::from_f32, f16::from_bits(0x7C05));
    }

    #[test]
    fn branchless_f16_conversions_equal_halfs() {
        for i in 0..=u16::MAX {
            let h = f16::from_bits(i);
            assert_eq!(h.widen().to_bits(), h.to_f32().to_bits(), "widen {i:#06x}");
        }
        // Every sign, exponent and top-10 mantissa pattern of f32, with low 13 bits that hit each
        // rounding case of a normal result (a subnormal result rounds at a higher bit, which the
        // top patterns enumerate with these lows).
        for hi in 0..1u32 << 19 {
            for lo in [0u32, 1, 0x0FFF, 0x1000, 0x1001, 0x1FFF] {
                let x = f32::from_bits(hi << 13 | lo);
                assert_eq!(
                    <f16 as Lane>::narrow(x).to_bits(),
                    f16::from_f32(x).to_bits(),
                    "narrow {:#010x}",
                    x.to_bits()
                );
            }
        }
    }

    #[test]
    fn lane_reduction_may_write_over_one_of_its_inputs() {
        // In-place reduce-scatter: the destination is one rank's own input, at any position.
        for n in 1..=6 {
            for own in 0..n {
                let mut bufs: Vec<Vec<f32>> = (0..n)
                    .map(|s| (0..3000).map(|i| (i * (s + 1)) as f32 * 0.5).collect())
                    .collect();
                let want: Vec<f32> = (0..3000)
                    .map(|i| (0..n).fold(0.0, |a, s| a + (i * (s + 1)) as f32 * 0.5))
                    .collect();
                let srcs: Vec<*const f32> = bufs.iter().map(|v| v.as_ptr()).collect();
                let dst = [bufs[own].as_mut_ptr()];
                // SAFETY: all buffers hold 3000 elements; the destination is exactly a source.
                unsafe { reduce_lanes(ReduceOp::Sum, &srcs, &dst, 3000, Store::Cached) };
                assert_eq!(bufs[own], want, "n {n} own {own}");
            }
        }
    }

    #[test]
    fn branchless_bf16_conversions_equal_halfs() {
        for i in 0..=u16::MAX {
            let b = bf16::from_bits(i);
            assert_eq!(b.widen().to_bits(), b.to_f32().to_bits(), "widen {i:#06x}");
        }
        // Every 16-bit top half with low halves that hit each rounding case.
        for hi in 0..=u16::MAX as u32 {
            for lo in [0u32, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF] {
                let x = f32::from_bits(hi << 16 | lo);
                assert_eq!(
                    <bf16 as Lane>::narrow(x).to_bits(),
                    bf16::from_f32(x).to_bits(),
                    "narrow {:#010x}",
                    x.to_bits()
                );
            }
        }
    }
}
