//! Keeping freed blocks above glibc's mmap threshold for the next step, within a bound.
//!
//! WHY: glibc serves every block of 32 MiB or more with a fresh mapping and unmaps it on free, so
//! the kernel faults in and zeroes it page by page the next time. A model with a large vocabulary
//! allocates such blocks every step: at Qwen2.5-0.5B's shape (vocabulary 151,936, width 896) the
//! head's f32 copy of the token table candle's tensor is made from (545 MB), its gradient, its
//! bf16 packing for the products (272 MB) in forward and again in backward, chunks of logits.
//! There 29-36% of a rank's samples were the kernel's `clear_page_erms`, a third of the process's
//! time was system time, and each step faulted 2-4 GB back in. Serving those blocks from glibc's
//! heap instead (`M_MMAP_MAX` 0) removed it but fragmented the heap past a cgroup's limit.
//!
//! [`ReuseAlloc`] keeps a freed large block and hands it out again for a request of the same size
//! and alignment, as PyTorch's caching allocator does on a GPU. Unlike that allocator it holds
//! the process to the peak it would have without it: [`BlockCache`] reads what the process holds
//! besides the kept blocks (its resident set from `/proc/self/statm` less their resident pages,
//! plus the pages a block handed out is about to touch) at every large allocation and each time
//! the small blocks have grown 64 MiB, keeps the most of that seen as the peak, and frees the
//! oldest kept blocks until they fit under it. What grows between two checks can pass it.
//!
//! Measured at Qwen2.5-0.5B's shape (context 512, bf16, stage 2, Zen 4): one rank, steps of
//! 8.4-9.5 s instead of 10.9-13.3 at the same peak resident set (14.31 GiB); two ranks in one
//! process, 15.5-19.3 s instead of 20.4-21.5 at 22.36 GiB instead of 22.15 (0.9% above).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;

/// Blocks at least this large are kept when freed: glibc's mmap threshold as
/// [`crate::model::keep_freed_buffers`] sets it (smaller blocks stay in glibc's heap already).
pub const REUSE_MIN_BYTES: usize = 32 << 20;
/// How many freed blocks are kept at most: a step frees a few dozen large blocks.
const SLOTS: usize = 128;
/// Small blocks growing by this much enforce the bound again (they are counted on every
/// allocation; the resident set is read only then and at large allocations).
const SMALL_STEP: usize = 64 << 20;
/// Alignments above a page go straight to the inner allocator (nothing asks for them).
const PAGE: usize = 4096;

#[derive(Clone, Copy)]
struct Kept {
    addr: usize,
    size: usize,
    align: usize,
    /// When it was freed (a counter): the oldest go first.
    freed_at: u64,
    /// Bytes of its pages resident when it was freed (a block can be freed before all of it was
    /// written): what handing it out again may add to the process.
    resident: usize,
}

impl Kept {
    /// Gives the block back to the allocator it came from.
    ///
    /// # Safety
    /// `inner` made the block, with this size and alignment.
    unsafe fn free(self, inner: &impl GlobalAlloc) {
        inner.dealloc(
            self.addr as *mut u8,
            Layout::from_size_align_unchecked(self.size, self.align),
        );
    }
}

/// `inner`'s block for `l`, zeroed where asked.
///
/// # Safety
/// As [`GlobalAlloc::alloc`].
unsafe fn inner_alloc(inner: &impl GlobalAlloc, l: Layout, zeroed: bool) -> *mut u8 {
    match zeroed {
        true => inner.alloc_zeroed(l),
        false => inner.alloc(l),
    }
}

struct State {
    kept: [Option<Kept>; SLOTS],
    /// Bytes of large blocks in use.
    live: usize,
    /// The most the process has held at once, as far as seen: small high-water plus large in use.
    peak: usize,
    /// Bytes of kept blocks, and of their pages resident.
    cached: usize,
    cached_resident: usize,
    /// Blocks in use that calloc mapped fresh: pages only read map the shared zero page, which
    /// `mincore` reports resident and the resident set does not count, so when one is freed its
    /// residency is not known and counts as none.
    calloced: [usize; SLOTS],
    clock: u64,
    hits: u64,
    misses: u64,
}

/// What a [`BlockCache`] has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReuseStats {
    /// Large allocations served from a kept block.
    pub hits: u64,
    /// Large allocations the inner allocator served.
    pub misses: u64,
    /// Bytes of large blocks in use now.
    pub live_bytes: usize,
    /// The most bytes of small blocks in use at once.
    pub small_high_bytes: usize,
    /// The most the process has held at once besides kept blocks, as far as the cache has seen:
    /// kept blocks fit under it.
    pub peak_bytes: usize,
    /// Bytes of freed large blocks kept now.
    pub cached_bytes: usize,
}

/// Freed large blocks kept for reuse, bounded by the process's peak; see the [module
/// docs](self). Its state sits behind a `Mutex` (a futex, which allocates nothing) taken only for
/// large blocks and when the small blocks' high-water mark rises while blocks are kept; a step
/// makes a few dozen large allocations, so the lock is never contended.
pub struct BlockCache {
    state: Mutex<State>,
    small_live: AtomicUsize,
    small_high: AtomicUsize,
    /// `small_live` when the bound was last enforced, or its lowest since: small blocks growing
    /// [`SMALL_STEP`] beyond it enforce the bound again.
    small_checked: AtomicUsize,
    /// `State::cached`, readable without the lock.
    cached: AtomicUsize,
    /// What the process holds now, where it can be read ([`resident_bytes`]).
    resident: fn() -> Option<usize>,
}

impl Default for BlockCache {
    fn default() -> Self {
        Self::new()
    }
}

impl BlockCache {
    /// A cache reading the process's resident set.
    pub const fn new() -> Self {
        Self::reading(resident_bytes)
    }

    /// A cache that reads what the process holds with `resident` (tests give one that cannot
    /// read it, so that the estimate decides).
    const fn reading(resident: fn() -> Option<usize>) -> Self {
        let state = State {
            kept: [None; SLOTS],
            live: 0,
            peak: 0,
            cached: 0,
            cached_resident: 0,
            calloced: [0; SLOTS],
            clock: 0,
            hits: 0,
            misses: 0,
        };
        Self {
            state: Mutex::new(state),
            small_live: AtomicUsize::new(0),
            small_high: AtomicUsize::new(0),
            small_checked: AtomicUsize::new(0),
            cached: AtomicUsize::new(0),
            resident,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // Nothing panics while the lock is held; a poisoned lock still holds consistent state.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn stats(&self) -> ReuseStats {
        let s = self.state();
        ReuseStats {
            hits: s.hits,
            misses: s.misses,
            live_bytes: s.live,
            small_high_bytes: self.small_high.load(Relaxed),
            peak_bytes: s.peak,
            cached_bytes: s.cached,
        }
    }

    fn is_large(l: Layout) -> bool {
        l.size() >= REUSE_MIN_BYTES && l.align() <= PAGE
    }

    /// Allocates through `inner`, or hands out a kept block of `l`'s size and alignment.
    ///
    /// # Safety
    /// As [`GlobalAlloc::alloc`]; every block must go back through [`Self::dealloc`] with the same
    /// `inner`.
    pub unsafe fn alloc(&self, l: Layout, zeroed: bool, inner: &impl GlobalAlloc) -> *mut u8 {
        if !Self::is_large(l) {
            let p = inner_alloc(inner, l, zeroed);
            if !p.is_null() {
                self.count_small(l.size(), inner);
            }
            return p;
        }
        let hit = {
            let mut s = self.state();
            let found = s
                .kept
                .iter_mut()
                .find(|k| matches!(k, Some(k) if k.size == l.size() && k.align == l.align()))
                .and_then(Option::take);
            if let Some(k) = found {
                s.cached -= k.size;
                s.cached_resident -= k.resident;
                self.cached.store(s.cached, Relaxed);
                s.live += k.size;
                s.hits += 1;
            }
            found
        };
        if let Some(k) = hit {
            let p = k.addr as *mut u8;
            // Its pages not yet the process's own will be: room is made first.
            let untouched = k.size - k.resident;
            if untouched > 0 {
                self.evict_to_bound(untouched, inner);
            }
            if zeroed {
                std::ptr::write_bytes(p, 0, k.size);
            }
            return p;
        }
        let p = inner_alloc(inner, l, zeroed);
        if !p.is_null() {
            let mut s = self.state();
            s.misses += 1;
            s.live += l.size();
            if zeroed {
                if let Some(slot) = s.calloced.iter_mut().find(|a| **a == 0) {
                    *slot = p as usize;
                }
            }
            drop(s);
            self.evict_to_bound(l.size(), inner);
        }
        p
    }

    /// Counts `size` more bytes of small blocks in use; where they have grown [`SMALL_STEP`] since
    /// the bound was last enforced while blocks are kept, it is enforced again.
    unsafe fn count_small(&self, size: usize, inner: &impl GlobalAlloc) {
        let now = self.small_live.fetch_add(size, Relaxed) + size;
        if now > self.small_high.load(Relaxed) {
            self.small_high.fetch_max(now, Relaxed);
        }
        if now > self.small_checked.load(Relaxed).saturating_add(SMALL_STEP)
            && self.cached.load(Relaxed) > 0
        {
            self.small_checked.store(now, Relaxed);
            self.evict_to_bound(0, inner);
        }
    }

    /// What the process holds besides the kept blocks once `fresh` bytes more are touched: its
    /// resident set less the kept blocks' resident pages, plus `fresh`; or where the resident set
    /// cannot be read, the small blocks' high-water mark plus the large blocks in use (counted
    /// whole already). A block mapped now and touched only much later would be missed: the
    /// engine touches its zeroed buffers when it makes them ([`crate::flat::zeroed_vec`]).
    fn held(&self, s: &State, fresh: usize) -> usize {
        match (self.resident)() {
            Some(rss) => rss.saturating_sub(s.cached_resident) + fresh,
            None => self.small_high.load(Relaxed) + s.live,
        }
    }

    /// Raises the peak to what the process holds (with `fresh` more bytes touched) where that is
    /// more, then frees the oldest kept blocks until they fit under the peak beside it.
    unsafe fn evict_to_bound(&self, fresh: usize, inner: &impl GlobalAlloc) {
        let mut evicted: [Option<Kept>; SLOTS] = [None; SLOTS];
        {
            let mut s = self.state();
            let held = self.held(&s, fresh);
            s.peak = s.peak.max(held);
            let mut n = 0;
            while held + s.cached > s.peak {
                let oldest = s
                    .kept
                    .iter_mut()
                    .filter(|k| k.is_some())
                    .min_by_key(|k| k.map_or(u64::MAX, |k| k.freed_at));
                let Some(k) = oldest.and_then(Option::take) else {
                    break;
                };
                s.cached -= k.size;
                s.cached_resident -= k.resident;
                evicted[n] = Some(k);
                n += 1;
            }
            self.cached.store(s.cached, Relaxed);
        }
        // Outside the lock: the inner allocator may take its own.
        evicted.into_iter().flatten().for_each(|k| k.free(inner));
    }

    /// Keeps a freed large block (or frees it through `inner` when every slot is taken).
    ///
    /// # Safety
    /// As [`GlobalAlloc::dealloc`], for a block [`Self::alloc`] returned with the same `inner`.
    pub unsafe fn dealloc(&self, p: *mut u8, l: Layout, inner: &impl GlobalAlloc) {
        if !Self::is_large(l) {
            let now = self
                .small_live
                .fetch_sub(l.size(), Relaxed)
                .wrapping_sub(l.size());
            self.small_checked.fetch_min(now, Relaxed);
            return inner.dealloc(p, l);
        }
        let mut resident = l.size() - nonresident_bytes(p as usize, l.size());
        let kept = {
            let mut s = self.state();
            s.live = s.live.saturating_sub(l.size());
            if let Some(slot) = s.calloced.iter_mut().find(|a| **a == p as usize) {
                *slot = 0;
                resident = 0;
            }
            s.clock += 1;
            let freed_at = s.clock;
            let slot = s.kept.iter_mut().find(|k| k.is_none());
            let kept = slot.map(|slot| {
                *slot = Some(Kept {
                    addr: p as usize,
                    size: l.size(),
                    align: l.align(),
                    freed_at,
                    resident,
                })
            });
            if kept.is_some() {
                s.cached += l.size();
                s.cached_resident += resident;
                self.cached.store(s.cached, Relaxed);
            }
            kept.is_some()
        };
        if !kept {
            inner.dealloc(p, l);
        }
    }

    /// Resizes a block through `inner` where both sizes are small, else by a new block and a copy.
    ///
    /// # Safety
    /// As [`GlobalAlloc::realloc`], for a block [`Self::alloc`] returned with the same `inner`.
    pub unsafe fn realloc(
        &self,
        p: *mut u8,
        l: Layout,
        new_size: usize,
        inner: &impl GlobalAlloc,
    ) -> *mut u8 {
        let new_layout = Layout::from_size_align_unchecked(new_size, l.align());
        if Self::is_large(l) || Self::is_large(new_layout) {
            let q = self.alloc(new_layout, false, inner);
            if !q.is_null() {
                std::ptr::copy_nonoverlapping(p, q, l.size().min(new_size));
                self.dealloc(p, l, inner);
            }
            return q;
        }
        let q = inner.realloc(p, l, new_size);
        if !q.is_null() {
            let now = self
                .small_live
                .fetch_sub(l.size(), Relaxed)
                .wrapping_sub(l.size());
            self.small_checked.fetch_min(now, Relaxed);
            self.count_small(new_size, inner);
        }
        q
    }

    /// Frees every kept block through `inner` (the peak stays what it was).
    ///
    /// # Safety
    /// `inner` is the allocator the kept blocks came from.
    pub unsafe fn release(&self, inner: &impl GlobalAlloc) {
        let taken = {
            let mut s = self.state();
            s.cached = 0;
            s.cached_resident = 0;
            self.cached.store(0, Relaxed);
            std::mem::replace(&mut s.kept, [None; SLOTS])
        };
        taken.into_iter().flatten().for_each(|k| k.free(inner));
    }
}

/// Bytes of `addr..addr + bytes` (a large block: whole pages of its own mapping) whose pages are
/// not resident (`mincore`); all of them where that cannot be told, which errs towards keeping
/// less.
fn nonresident_bytes(addr: usize, bytes: usize) -> usize {
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        let mut resident = [0u8; 4096];
        let end = addr + bytes;
        let mut page = addr / PAGE * PAGE;
        let mut missing = 0;
        while page < end {
            let n = (end - page).div_ceil(PAGE).min(resident.len());
            // SAFETY: the pages lie within the block's mapping; the vector holds one byte per
            // page asked for.
            let rc = unsafe {
                libc::mincore(page as *mut libc::c_void, n * PAGE, resident.as_mut_ptr())
            };
            if rc != 0 {
                return bytes;
            }
            missing += resident[..n].iter().filter(|&&r| r & 1 == 0).count() * PAGE;
            page += n * PAGE;
        }
        missing.min(bytes)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = addr;
        bytes
    }
}

/// The process's resident set from `/proc/self/statm`, read into a buffer on the stack (an
/// allocator cannot allocate); None off Linux or where it cannot be read.
fn resident_bytes() -> Option<usize> {
    #[cfg(target_os = "linux")]
    // SAFETY: a NUL-terminated path, a buffer of the length passed, the descriptor closed.
    unsafe {
        let fd = libc::open(
            c"/proc/self/statm".as_ptr(),
            libc::O_RDONLY | libc::O_CLOEXEC,
        );
        if fd < 0 {
            return None;
        }
        let mut buf = [0u8; 128];
        let n = libc::read(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len());
        libc::close(fd);
        let text = buf.get(..usize::try_from(n).ok()?)?;
        // "size resident shared ...", in pages.
        let pages = text.split(|&b| b == b' ').nth(1)?;
        let pages = std::str::from_utf8(pages).ok()?.parse::<usize>().ok()?;
        let page = usize::try_from(libc::sysconf(libc::_SC_PAGESIZE)).ok()?;
        Some(pages * page)
    }
    #[cfg(not(target_os = "linux"))]
    None
}

static CACHE: BlockCache = BlockCache::new();

/// The system allocator with freed large blocks kept for reuse (see the [module docs](self)): the
/// binary's global allocator. A library user gets the same with
/// `#[global_allocator] static ALLOC: zerodp::memory::ReuseAlloc = zerodp::memory::ReuseAlloc;`.
pub struct ReuseAlloc;

impl ReuseAlloc {
    /// What the process-wide cache has done (all zero unless `ReuseAlloc` is the global allocator).
    pub fn stats() -> ReuseStats {
        CACHE.stats()
    }
}

// SAFETY: every block comes from `System`, directly or as a block `System` gave earlier and the
// program freed, handed out again only for the same size and alignment; blocks go back to `System`
// with the layout they were allocated with.
unsafe impl GlobalAlloc for ReuseAlloc {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        CACHE.alloc(l, false, &System)
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        CACHE.alloc(l, true, &System)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        CACHE.dealloc(p, l, &System)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new_size: usize) -> *mut u8 {
        CACHE.realloc(p, l, new_size, &System)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    fn layout(bytes: usize) -> Layout {
        Layout::from_size_align(bytes, 64).unwrap()
    }

    /// Large blocks are mapped lazily by the system allocator: these tests touch only a few pages.
    #[test]
    fn a_freed_large_block_serves_the_next_request_of_its_size_and_only_that_size() {
        let cache = BlockCache::reading(|| None);
        unsafe {
            let a = cache.alloc(layout(40 * MIB), false, &System);
            let other = cache.alloc(layout(48 * MIB), false, &System);
            assert!(!a.is_null() && !other.is_null());
            a.write(7);
            cache.dealloc(a, layout(40 * MIB), &System);
            let s = cache.stats();
            assert_eq!((s.live_bytes, s.cached_bytes), (48 * MIB, 40 * MIB));
            let again = cache.alloc(layout(40 * MIB), true, &System);
            assert_eq!(again, a, "the kept block comes back for its own size");
            assert_eq!(again.read(), 0, "alloc_zeroed zeroes a reused block");
            cache.dealloc(other, layout(48 * MIB), &System);
            let bigger = cache.alloc(layout(56 * MIB), false, &System);
            let s = cache.stats();
            assert_eq!(
                (s.hits, s.misses),
                (1, 3),
                "a kept block of another size is not handed out"
            );
            cache.dealloc(bigger, layout(56 * MIB), &System);
            let other = cache.alloc(layout(48 * MIB), false, &System);
            let small = cache.alloc(layout(MIB), false, &System);
            cache.dealloc(small, layout(MIB), &System);
            assert_eq!(
                cache.stats(),
                ReuseStats {
                    hits: 1,
                    misses: 4,
                    live_bytes: 88 * MIB,
                    small_high_bytes: MIB,
                    peak_bytes: 96 * MIB,
                    cached_bytes: 0,
                },
                "blocks under the threshold are not counted; the 48 MiB block came back fresh (the \
                 56 MiB one evicted it)"
            );
            cache.dealloc(other, layout(48 * MIB), &System);
            cache.dealloc(again, layout(40 * MIB), &System);
            assert_eq!(cache.stats().cached_bytes, 88 * MIB);
            cache.release(&System);
            assert_eq!(cache.stats().cached_bytes, 0);
        }
    }

    #[test]
    fn kept_and_used_blocks_stay_within_the_peak_in_use() {
        let cache = BlockCache::reading(|| None);
        unsafe {
            let a = cache.alloc(layout(64 * MIB), false, &System);
            let b = cache.alloc(layout(64 * MIB), false, &System);
            cache.dealloc(a, layout(64 * MIB), &System);
            cache.dealloc(b, layout(64 * MIB), &System);
            // Peak 128 MiB, both kept. 96 MiB in use: kept + used may reach 128 MiB, so the
            // oldest (a) goes, then b too (96 + 64 > 128).
            let c = cache.alloc(layout(96 * MIB), false, &System);
            let s = cache.stats();
            assert_eq!(
                (s.live_bytes, s.cached_bytes, s.peak_bytes),
                (96 * MIB, 0, 128 * MIB)
            );
            cache.dealloc(c, layout(96 * MIB), &System);
            // 32 MiB in use with 96 kept: 128, nothing evicted.
            let d = cache.alloc(layout(32 * MIB), false, &System);
            let s = cache.stats();
            assert_eq!((s.live_bytes, s.cached_bytes), (32 * MIB, 96 * MIB));
            // Another 40 MiB: 72 + 96 > 128, so the 96 MiB goes.
            let e = cache.alloc(layout(40 * MIB), false, &System);
            let s = cache.stats();
            assert_eq!((s.live_bytes, s.cached_bytes), (72 * MIB, 0));
            assert!(s.live_bytes + s.cached_bytes <= s.peak_bytes);
            cache.dealloc(d, layout(32 * MIB), &System);
            cache.dealloc(e, layout(40 * MIB), &System);
            cache.release(&System);
        }
    }

    /// glibc's heap keeps its high-water mark, so small blocks growing past theirs take room from
    /// the kept blocks (checked each time they have grown 64 MiB).
    #[test]
    fn small_blocks_growing_evict_kept_blocks_past_the_peak() {
        let cache = BlockCache::reading(|| None);
        unsafe {
            let a = cache.alloc(layout(64 * MIB), false, &System);
            cache.dealloc(a, layout(64 * MIB), &System);
            let small: Vec<*mut u8> = (0..2)
                .map(|_| cache.alloc(layout(30 * MIB), false, &System))
                .collect();
            let s = cache.stats();
            assert_eq!((s.small_high_bytes, s.cached_bytes), (60 * MIB, 64 * MIB));
            // 90 MiB of small blocks: held 90 against a peak of 64, so the kept block goes.
            let third = cache.realloc(small[1], layout(30 * MIB), 31 * MIB, &System);
            let fourth = cache.alloc(layout(30 * MIB), false, &System);
            let s = cache.stats();
            assert_eq!((s.small_high_bytes, s.cached_bytes), (91 * MIB, 0));
            assert_eq!(s.peak_bytes, 91 * MIB);
            cache.dealloc(small[0], layout(30 * MIB), &System);
            cache.dealloc(third, layout(31 * MIB), &System);
            cache.dealloc(fourth, layout(30 * MIB), &System);
        }
    }

    /// A block freed before all of it was written is kept with its resident bytes, so that
    /// handing it out again counts the pages it will touch.
    #[test]
    fn untouched_pages_of_a_block_are_found() {
        if !cfg!(target_os = "linux") || std::env::var_os("QEMU_LD_PREFIX").is_some() {
            eprintln!(
                "SKIPPED: mincore is Linux's; under qemu-user page residency is the emulator's"
            );
            return;
        }
        unsafe {
            let bytes = 64 * MIB;
            // Alignment 8: calloc, fresh pages (above 16 the system allocator zeroes by writing).
            let l = Layout::from_size_align(bytes, 8).unwrap();
            let p = System.alloc_zeroed(l);
            let before = nonresident_bytes(p as usize, bytes);
            assert!(before >= bytes - 4 * MIB, "{before}");
            std::ptr::write_bytes(p, 1, bytes / 2);
            let after = nonresident_bytes(p as usize, bytes);
            assert!(after.abs_diff(bytes / 2) <= 2 * MIB, "{after}");
            std::ptr::write_bytes(p, 1, bytes);
            assert_eq!(nonresident_bytes(p as usize, bytes), 0);
            System.dealloc(p, l);
        }
    }

    #[test]
    fn the_resident_set_is_read() {
        if cfg!(target_os = "linux") {
            let rss = resident_bytes().expect("/proc/self/statm");
            assert!(rss > 1 << 20 && rss < 1 << 40, "{rss}");
        }
    }
}
