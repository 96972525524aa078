//! One rank's NVMe swap file: f32 records at fixed offsets, read and written with direct I/O
//! where the file system allows it (no page-cache copy, and the page cache does not grow with the
//! states, which is the point of putting them on disk).
//!
//! The whole file is reserved when it is created (`posix_fallocate`), so a disk that cannot hold
//! the states fails at start-up, naming the bytes, not half-way through a step. The file is
//! created new (never over an existing file) and removed when the [`SwapFile`] is dropped.

use super::OffloadError;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Records start and are padded to multiples of this many f32 (4 KiB), as direct I/O requires
/// of offsets and lengths.
pub const SWAP_ALIGN_ELEMS: usize = 1024;
const ALIGN_BYTES: usize = SWAP_ALIGN_ELEMS * 4;

/// A page-aligned f32 buffer of a length that is a multiple of [`SWAP_ALIGN_ELEMS`], allocated
/// once (direct I/O needs aligned memory).
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<f32>,
    len: usize,
}

// SAFETY: owns its allocation exclusively, like a Vec<f32>.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of at least `elems` elements, rounded up to the alignment.
    pub fn zeroed(elems: usize) -> AlignedBuf {
        let len = elems.max(1).div_ceil(SWAP_ALIGN_ELEMS) * SWAP_ALIGN_ELEMS;
        let layout = Self::layout(len);
        // SAFETY: a non-zero size and a valid power-of-two alignment.
        let p = unsafe { std::alloc::alloc_zeroed(layout) } as *mut f32;
        let ptr =
            std::ptr::NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len }
    }

    fn layout(len: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(len * 4, ALIGN_BYTES).expect("swap buffer layout")
    }

    /// Bytes held (for the ledger).
    pub fn bytes(&self) -> usize {
        self.len * 4
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: `len` initialised elements owned by this buffer.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as above, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr() as *mut u8, Self::layout(self.len)) }
    }
}

/// One rank's swap file of `elems` f32 (a multiple of [`SWAP_ALIGN_ELEMS`]).
pub struct SwapFile {
    file: File,
    path: PathBuf,
    /// Whether the file is open with `O_DIRECT` (tmpfs and some others refuse it).
    direct: bool,
    /// Bytes read and written so far (for the metrics and the benchmark).
    read: AtomicU64,
    written: AtomicU64,
}

impl SwapFile {
    /// Creates `zerodp-swap-<pid>-rank<rank>.bin` under `dir` with room for `elems` f32, zeroed,
    /// for the optimizer states (`offload_optimizer.nvme_path`).
    pub fn create(dir: &Path, rank: usize, elems: usize) -> Result<SwapFile, OffloadError> {
        Self::create_for(dir, "offload_optimizer", &format!("rank{rank}"), elems)
    }

    /// [`SwapFile::create`] for the file `zerodp-swap-<pid>-<tag>.bin` under the `nvme_path` of
    /// the config block `key` (which its errors name).
    pub(crate) fn create_for(
        dir: &Path,
        key: &'static str,
        tag: &str,
        elems: usize,
    ) -> Result<SwapFile, OffloadError> {
        let bad = |what: String| OffloadError::BadDir {
            key,
            path: dir.to_path_buf(),
            what,
        };
        match std::fs::metadata(dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(bad("is not a directory".into())),
            Err(e) => return Err(bad(format!("cannot be used ({e})"))),
        }
        let path = dir.join(format!("zerodp-swap-{}-{tag}.bin", std::process::id()));
        let open = |direct: bool| {
            let mut o = OpenOptions::new();
            o.read(true).write(true).create_new(true).mode(0o600);
            if direct {
                o.custom_flags(libc::O_DIRECT);
            }
            o.open(&path)
        };
        let (file, direct) = match open(true) {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                // The file system refuses O_DIRECT: buffered I/O instead.
                let _ = std::fs::remove_file(&path);
                (
                    open(false).map_err(|e| bad(format!("refuses a new file ({e})")))?,
                    false,
                )
            }
            Err(e) => return Err(bad(format!("refuses a new file ({e})"))),
        };
        let swap = SwapFile {
            file,
            path,
            direct,
            read: AtomicU64::new(0),
            written: AtomicU64::new(0),
        };
        let bytes = (elems.div_ceil(SWAP_ALIGN_ELEMS) * ALIGN_BYTES) as u64;
        if bytes > 0 {
            use std::os::fd::AsRawFd;
            // SAFETY: a valid open descriptor.
            let rc = unsafe { libc::posix_fallocate(swap.file.as_raw_fd(), 0, bytes as i64) };
            if rc != 0 {
                return Err(OffloadError::Reserve {
                    key,
                    path: swap.path.clone(),
                    bytes,
                    source: std::io::Error::from_raw_os_error(rc),
                });
            }
        }
        Ok(swap)
    }

    /// Flushes written data to the disk (`fdatasync`).
    pub fn sync(&self) -> Result<(), OffloadError> {
        self.file
            .sync_data()
            .map_err(|source| self.io_error("sync", 0, 0, source))
    }

    /// Whether reads and writes bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes read so far.
    pub(crate) fn bytes_read(&self) -> u64 {
        self.read.load(Ordering::Relaxed)
    }

    /// Bytes written so far.
    pub(crate) fn bytes_written(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }

    /// Reads `dst.len()` f32 (a multiple of the alignment, `dst` aligned) from element `at`.
    pub fn read(&self, at: usize, dst: &mut [f32]) -> Result<(), OffloadError> {
        let off = (at * 4) as u64;
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(dst);
        let n = bytes.len();
        self.file
            .read_exact_at(bytes, off)
            .map_err(|source| self.io_error("read", n, off, source))?;
        self.read.fetch_add(n as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Writes `src` (a multiple of the alignment, aligned) at element `at`.
    pub fn write(&self, at: usize, src: &[f32]) -> Result<(), OffloadError> {
        let off = (at * 4) as u64;
        let bytes: &[u8] = bytemuck::cast_slice(src);
        self.file
            .write_all_at(bytes, off)
            .map_err(|source| self.io_error("write", bytes.len(), off, source))?;
        self.written
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn io_error(
        &self,
        op: &'static str,
        bytes: usize,
        offset: u64,
        source: std::io::Error,
    ) -> OffloadError {
        OffloadError::Io {
            path: self.path.clone(),
            op,
            bytes,
            offset,
            source,
        }
    }
}

impl Drop for SwapFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_the_file_goes_with_the_swap() {
        let dir = tempfile::tempdir().unwrap();
        let s = SwapFile::create(dir.path(), 3, 3000).unwrap();
        let path = s.path().to_path_buf();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 3 * 4096);
        let mut a = AlignedBuf::zeroed(2048);
        for (i, x) in a.iter_mut().enumerate() {
            *x = i as f32 * 0.5;
        }
        s.write(1024, &a).unwrap();
        let mut b = AlignedBuf::zeroed(2048);
        s.read(1024, &mut b).unwrap();
        assert_eq!(&a[..], &b[..]);
        assert_eq!((s.bytes_read(), s.bytes_written()), (8192, 8192));
        drop(s);
        assert!(!path.exists());
    }

    #[test]
    fn a_missing_directory_or_a_file_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope");
        let e = SwapFile::create(&missing, 0, 10).err().unwrap().to_string();
        assert!(e.contains("nope") && e.contains("nvme_path"), "{e}");
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        let e = SwapFile::create(&file, 0, 10).err().unwrap().to_string();
        assert!(e.contains("is not a directory"), "{e}");
    }
}
