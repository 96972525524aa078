//! Element kernels of the in-process backend: the reduction of N ranks' slices into one and the
//! widening/narrowing of 16-bit types.
//!
//! Reductions run over blocks small enough to stay in L1 (an f32 accumulator of [`BLOCK`] elements):
//! each rank's block is read once, combined into the accumulator in rank order 0..N-1 (a fixed
//! order, so the result is bit-identical whoever computes it), and the result is written once. 16-bit
//! inputs are widened to f32, accumulated in f32 and rounded once (round to nearest even).

use crate::comm::{DType, ReduceOp};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Elements per accumulator block: 2 x 8 KiB of f32 scratch, well inside L1.
const BLOCK: usize = 2048;

/// An element type that can be reduced in f32.
trait Elem: Copy + 'static {
    /// `acc = src` widened.
    fn load(src: &[Self], acc: &mut [f32]);
    /// `acc = acc (op) src`, widening through `tmp` when needed.
    fn combine(op: ReduceOp, acc: &mut [f32], src: &[Self], tmp: &mut [f32]);
    /// `dst = acc` rounded to this type.
    fn store(acc: &[f32], dst: &mut [Self]);
}

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
half_elem!(bf16);
half_elem!(f16);

/// Reduces `len` elements of type `T` from every source into `dst`, in source order.
///
/// # Safety
/// Every `srcs[s]` must be valid for reads of `len` elements and `dst` for writes of `len` elements,
/// for the whole call, with no other thread writing them. `dst` may be one of the sources (in-place
/// all-reduce): each block is fully read before it is written.
unsafe fn reduce_typed<T: Elem>(op: ReduceOp, srcs: &[*const T], dst: *mut T, len: usize) {
    let n = srcs.len();
    let mut acc = [0f32; BLOCK];
    let mut tmp = [0f32; BLOCK];
    let mut off = 0;
    while off < len {
        let m = BLOCK.min(len - off);
        let acc = &mut acc[..m];
        // Each source slice lives only inside its own statement, so no shared borrow overlaps the
        // mutable borrow of `dst` below even when `dst` aliases a source.
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
        T::store(acc, std::slice::from_raw_parts_mut(dst.add(off), m));
        off += m;
    }
}

/// Type-erased [`reduce_typed`]: addresses are of element 0 of each slice.
///
/// # Safety
/// As [`reduce_typed`], with `len` elements of `dtype` at every address, suitably aligned.
pub(crate) unsafe fn reduce_into(
    dtype: DType,
    op: ReduceOp,
    srcs: &[usize],
    dst: usize,
    len: usize,
    ptr_scratch: &mut Vec<usize>,
) {
    if len == 0 || srcs.is_empty() {
        return;
    }
    ptr_scratch.clear();
    ptr_scratch.extend_from_slice(srcs);
    // The casts below only reinterpret the addresses; `ptr_scratch` holds them for the call.
    match dtype {
        DType::F32 => {
            let p: &[*const f32] = cast_ptrs(ptr_scratch);
            reduce_typed::<f32>(op, p, dst as *mut f32, len)
        }
        DType::BF16 => {
            let p: &[*const bf16] = cast_ptrs(ptr_scratch);
            reduce_typed::<bf16>(op, p, dst as *mut bf16, len)
        }
        DType::F16 => {
            let p: &[*const f16] = cast_ptrs(ptr_scratch);
            reduce_typed::<f16>(op, p, dst as *mut f16, len)
        }
    }
}

/// Views a slice of addresses as a slice of typed pointers (same size and layout).
fn cast_ptrs<T>(addrs: &[usize]) -> &[*const T] {
    // SAFETY: `usize` and `*const T` (T: Sized) have the same size and alignment, and every bit
    // pattern of a usize is a valid raw pointer value.
    unsafe { std::slice::from_raw_parts(addrs.as_ptr() as *const *const T, addrs.len()) }
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

/// The serial reference reduction of whole buffers (rank order 0..N-1, f32 accumulation, one
/// rounding): what every backend must reproduce bit for bit. Used by tests and by callers that need a
/// local reduction with identical numerics.
pub fn reduce_reference(inputs: &[&crate::comm::Buffer], op: ReduceOp) -> crate::comm::Buffer {
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
    let mut out = crate::comm::Buffer::zeros(dtype, len);
    let srcs: Vec<usize> = inputs.iter().map(|b| buffer_addr(b)).collect();
    let mut scratch = Vec::new();
    // SAFETY: every input has `len` elements of `dtype`, `out` is a fresh buffer of the same shape,
    // and nothing else touches them during the call.
    unsafe {
        reduce_into(
            dtype,
            op,
            &srcs,
            buffer_addr_mut(&mut out),
            len,
            &mut scratch,
        )
    };
    out
}

/// Address of element 0 of a buffer.
pub(crate) fn buffer_addr(b: &crate::comm::Buffer) -> usize {
    use crate::comm::Buffer;
    match b {
        Buffer::F32(v) => v.as_ptr() as usize,
        Buffer::BF16(v) => v.as_ptr() as usize,
        Buffer::F16(v) => v.as_ptr() as usize,
    }
}

/// Mutable address of element 0 of a buffer.
pub(crate) fn buffer_addr_mut(b: &mut crate::comm::Buffer) -> usize {
    use crate::comm::Buffer;
    match b {
        Buffer::F32(v) => v.as_mut_ptr() as usize,
        Buffer::BF16(v) => v.as_mut_ptr() as usize,
        Buffer::F16(v) => v.as_mut_ptr() as usize,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::Buffer;

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
        let a = Buffer::F32((0..5000).map(|i| i as f32).collect());
        let mut b = Buffer::F32((0..5000).map(|i| 4999.0 - i as f32).collect());
        let srcs = [buffer_addr(&a), buffer_addr(&b)];
        let dst = buffer_addr_mut(&mut b);
        let mut scratch = Vec::new();
        // SAFETY: both buffers hold 5000 f32; `dst` aliases source 1, which the kernel allows.
        unsafe { reduce_into(DType::F32, ReduceOp::Max, &srcs, dst, 5000, &mut scratch) };
        for i in 0..5000 {
            assert_eq!(b.get_f32(i), (i as f32).max(4999.0 - i as f32));
        }
    }
}
