//! Keeping freed activation buffers in the process instead of returning them to the OS.
//!
//! WHY: a training step allocates and frees the same large buffers every step (activations,
//! their gradients, GEMM outputs of 1-8 MiB). glibc serves blocks above its mmap threshold with
//! fresh mappings and trims freed heap tops back to the kernel, so every step page-faults those
//! megabytes in again and the kernel zeroes them: 2.5% of a rank's samples were the kernel's
//! `clear_page_erms` on the 25M GPT. Raising the thresholds keeps the blocks for reuse, what
//! PyTorch's caching allocator and llm.c's buffers-sized-once get by other means. The cost is
//! that memory freed after a step stays with the process (its high-water mark, which the ledger
//! already plans for).
//!
//! With nothing trimmed, the process also keeps one arena: glibc gives threads arenas of their
//! own (up to eight per core), each keeps its own high-water mark, and a block freed into one
//! cannot serve an allocation from another. On the 25M GPT at stage 2, world 2, that held 2.28 GB
//! where one arena holds 1.57 (the same 1.55-1.60 GB as stages 0, 1 and 3), at the same tokens/s:
//! a step makes a few dozen large allocations, so the one lock is never contended.

/// The largest block glibc will serve from its heaps instead of a fresh mapping (glibc caps the
/// setting at 32 MiB on 64-bit hosts): above every activation of the benchmark GPTs.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: libc::c_int = 32 << 20;

/// Call once at start-up, before the ranks start (the binary does): freed buffers of up to 32
/// MiB stay in the process for the next step, in one arena. A no-op off glibc. Library users may
/// call it too.
pub fn keep_freed_buffers() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tunables; it is safe to call at any time.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX);
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}
