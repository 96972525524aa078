//! Software prefetch for the streaming loops: the CPU Adam and the model's element-wise kernels.
//!
//! WHY: one core streaming a few arrays from memory, with the hardware prefetchers alone, keeps
//! too few misses in flight on the hosts we measure on. The CPU Adam's bf16-state step drew only
//! 80% of the bandwidth a pass with its streams and no arithmetic draws, and the GELU over a cold
//! `[1024, 2048]` activation ran at 6-8 GB/s. Asking for the lines a couple of KiB ahead, a few
//! at a time as the loop goes, took the first to 96-99% and the second from 2.0-2.9 ms to
//! 1.6-1.9 ms (`zerodp bench ops`, which evicts the caches before every timed call).
//!
//! A prefetch is a hint: it reads nothing the program sees and never faults, so the addresses
//! may run past the end of a slice (the lines are then simply not used).

/// Elements per block of a blocked streaming loop: each block asks for the lines of the block
/// [`DISTANCE`] elements ahead (one or two 64-byte lines per stream).
pub(crate) const BLOCK: usize = 32;

/// How far ahead, in elements, [`block_ahead`] asks for lines: 2 KiB of an `f32` stream. For the
/// CPU Adam 256 to 1024 elements gave the same gain, 2048 less.
pub(crate) const DISTANCE: usize = 512;

/// Asks for the cache lines of the `len` elements that start `from` elements past the start of
/// `s` (a hint; see the module's doc).
#[inline(always)]
pub fn lines<T>(s: &[T], from: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let size = std::mem::size_of::<T>();
        let start = s.as_ptr().cast::<i8>().wrapping_add(from * size);
        for line in (0..len * size).step_by(64) {
            // SAFETY: a prefetch reads nothing the program sees and cannot fault, whatever the
            // address (`wrapping_add` keeps the pointer arithmetic itself defined).
            unsafe { _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(line)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (s, from, len);
}

/// Asks for the lines of the block [`DISTANCE`] elements past the start of `block` (a block of
/// [`BLOCK`] elements of a streaming loop).
#[inline(always)]
pub(crate) fn block_ahead<T>(block: &[T]) {
    lines(block, DISTANCE, BLOCK);
}
