//! Owned, typed flat buffers and the zeroed, huge-page-advised memory they start from.

use super::DType;
use half::{bf16, f16};

/// An owned, typed flat buffer: a unit's parameters, gradients or shard, and what the
/// collectives take and hand back by value.
#[derive(Clone, Debug, PartialEq)]
pub enum Buffer {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
}

/// Buffers of at least this many bytes ask for transparent huge pages (see [`zeroed_vec`]).
pub const HUGE_PAGE_MIN_BYTES: usize = 2 << 20;

/// `len` zeroed elements, in fresh memory that the kernel is asked to back with transparent huge
/// pages (`madvise(MADV_HUGEPAGE)`, before any page is touched) when the buffer spans at least
/// [`HUGE_PAGE_MIN_BYTES`]. Flat buffers are streamed end to end (the optimizer step touches
/// 28 bytes per parameter), and with 4 KiB pages every 4 KiB of each stream is a TLB miss: on
/// 100M parameters the CPU Adam step ran 10-12% faster with huge pages. The advice is only that:
/// on a kernel with THP off, or where it fails, the buffer is ordinary memory. Linux only.
///
/// A buffer of [`crate::memory::REUSE_MIN_BYTES`] or more is then touched, one write per page, so
/// that it is resident from the start rather than from its first use: the allocator's bound on the
/// blocks it keeps for reuse reads the process's resident set, and the optimizer states first
/// written in the first step would otherwise arrive unseen while blocks are kept. The pages are
/// faulted in once either way.
pub fn zeroed_vec<T: bytemuck::Zeroable + Clone>(len: usize) -> Vec<T> {
    // `alloc_zeroed` (calloc): a large block is fresh mmap'd memory, not yet touched.
    let mut v: Vec<T> = bytemuck::allocation::zeroed_vec(len);
    advise_huge_pages(&v);
    if std::mem::size_of_val(v.as_slice()) >= crate::memory::REUSE_MIN_BYTES {
        touch_pages(&mut v);
    }
    v
}

/// Writes a zero byte into every 4 KiB page of a buffer that is all zero bytes already, so that
/// calloc's fresh pages are the process's now rather than at their first use.
pub(crate) fn touch_pages<T: bytemuck::Zeroable>(buf: &mut [T]) {
    let bytes = std::mem::size_of_val(buf);
    let base = buf.as_mut_ptr() as *mut u8;
    for offset in (0..bytes).step_by(4096) {
        // SAFETY: `offset` lies within the buffer, whose bytes are all zero (a `Zeroable` buffer
        // from `alloc_zeroed`); volatile, so that the write to calloc's memory is not elided.
        unsafe { std::ptr::write_volatile(base.add(offset), 0) };
    }
}

/// Advises huge pages for the whole 4 KiB pages of `buf` (best effort, errors ignored).
fn advise_huge_pages<T>(buf: &[T]) {
    let bytes = std::mem::size_of_val(buf);
    #[cfg(target_os = "linux")]
    if bytes >= HUGE_PAGE_MIN_BYTES {
        const PAGE: usize = 4096;
        let start = buf.as_ptr() as usize;
        let first = start.next_multiple_of(PAGE);
        let end = (start + bytes) / PAGE * PAGE;
        if end > first {
            // SAFETY: [first, end) lies inside `buf`'s allocation; MADV_HUGEPAGE changes how the
            // kernel backs the range, never its contents.
            unsafe { libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = bytes;
}

impl Buffer {
    /// `len` zeroed elements of `dtype` (huge pages for a large buffer, see [`zeroed_vec`]).
    pub fn zeros(dtype: DType, len: usize) -> Buffer {
        match dtype {
            DType::F32 => Buffer::F32(zeroed_vec(len)),
            DType::BF16 => Buffer::BF16(zeroed_vec(len)),
            DType::F16 => Buffer::F16(zeroed_vec(len)),
        }
    }
    pub fn dtype(&self) -> DType {
        match self {
            Buffer::F32(_) => DType::F32,
            Buffer::BF16(_) => DType::BF16,
            Buffer::F16(_) => DType::F16,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            Buffer::F32(v) => v.len(),
            Buffer::BF16(v) => v.len(),
            Buffer::F16(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.len() * self.dtype().size()
    }
    /// The f32 vector inside, or `None` for a 16-bit buffer.
    pub fn into_f32(self) -> Option<Vec<f32>> {
        match self {
            Buffer::F32(v) => Some(v),
            _ => None,
        }
    }
    pub(crate) fn as_f32(&self) -> Option<&[f32]> {
        match self {
            Buffer::F32(v) => Some(v),
            _ => None,
        }
    }
    pub fn as_f32_mut(&mut self) -> Option<&mut [f32]> {
        match self {
            Buffer::F32(v) => Some(v),
            _ => None,
        }
    }
    /// A new buffer holding a copy of elements `range` (allocates; for fallbacks and tests).
    pub fn copy_range(&self, range: std::ops::Range<usize>) -> Buffer {
        match self {
            Buffer::F32(v) => Buffer::F32(v[range].to_vec()),
            Buffer::BF16(v) => Buffer::BF16(v[range].to_vec()),
            Buffer::F16(v) => Buffer::F16(v[range].to_vec()),
        }
    }
    /// Copies all of `src` into `self` from element `start` on.
    ///
    /// # Panics
    /// If the dtypes differ or `src` does not fit.
    pub fn write_at(&mut self, start: usize, src: &Buffer) {
        let end = start + src.len();
        match (self, src) {
            (Buffer::F32(d), Buffer::F32(s)) => d[start..end].copy_from_slice(s),
            (Buffer::BF16(d), Buffer::BF16(s)) => d[start..end].copy_from_slice(s),
            (Buffer::F16(d), Buffer::F16(s)) => d[start..end].copy_from_slice(s),
            (d, s) => panic!(
                "Buffer::write_at: a {} buffer cannot take {} elements",
                d.dtype(),
                s.dtype()
            ),
        }
    }
    /// Copies elements `range` of `src` over the start of `self` (no allocation).
    ///
    /// # Panics
    /// If the dtypes differ or the range does not fit.
    pub fn copy_from_range(&mut self, src: &Buffer, range: std::ops::Range<usize>) {
        let len = range.len();
        match (self, src) {
            (Buffer::F32(d), Buffer::F32(s)) => d[..len].copy_from_slice(&s[range]),
            (Buffer::BF16(d), Buffer::BF16(s)) => d[..len].copy_from_slice(&s[range]),
            (Buffer::F16(d), Buffer::F16(s)) => d[..len].copy_from_slice(&s[range]),
            (d, s) => panic!(
                "Buffer::copy_from_range: a {} buffer cannot take {} elements",
                d.dtype(),
                s.dtype()
            ),
        }
    }
    /// Element `i` widened to f32 (for tests and small reads; not for hot loops).
    pub fn get_f32(&self, i: usize) -> f32 {
        match self {
            Buffer::F32(v) => v[i],
            Buffer::BF16(v) => v[i].to_f32(),
            Buffer::F16(v) => v[i].to_f32(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `THPeligible` flag of the mapping of `/proc/self/smaps` that holds `addr`.
    #[cfg(target_os = "linux")]
    fn thp_eligible(addr: usize) -> Option<bool> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if let Some((lo, hi)) = first.split_once('-') {
                if let (Ok(lo), Ok(hi)) =
                    (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
                {
                    inside = (lo..hi).contains(&addr);
                    continue;
                }
            }
            if inside {
                if let Some(flag) = line.strip_prefix("THPeligible:") {
                    return Some(flag.trim() == "1");
                }
            }
        }
        None
    }

    #[test]
    fn large_buffers_are_zeroed_and_advised_huge_pages() {
        let big: Vec<f32> = zeroed_vec(HUGE_PAGE_MIN_BYTES); // 4x the threshold in bytes
        assert_eq!(big.len(), HUGE_PAGE_MIN_BYTES);
        assert!(big.iter().all(|&x| x == 0.0));
        let b = Buffer::zeros(DType::BF16, 3 << 20);
        assert_eq!(b.len(), 3 << 20);
        #[cfg(target_os = "linux")]
        {
            let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled");
            // Only a kernel whose THP mode is `madvise` or `always` can honour the advice, and
            // qemu-user (the aarch64 tests' runner, which sets QEMU_LD_PREFIX) drops it.
            let emulated = std::env::var_os("QEMU_LD_PREFIX").is_some();
            if emulated {
                eprintln!("SKIPPED the huge-page check: qemu-user ignores MADV_HUGEPAGE");
            }
            if mode.is_ok_and(|m| !m.contains("[never]")) && !emulated {
                let middle = big.as_ptr() as usize + HUGE_PAGE_MIN_BYTES * 2;
                assert_eq!(thp_eligible(middle), Some(true), "f32 buffer not advised");
            }
        }
    }
}
