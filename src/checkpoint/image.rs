//! A rank file's bytes, laid out once in a page-aligned buffer: the safetensors length and header
//! (padded with spaces so the data starts on a 4 KiB boundary), then the F32 data. A save copies
//! the state into the data region and writes the whole image with direct I/O (no copy through the
//! page cache), falling back to ordinary writes where the file system refuses `O_DIRECT`.

use super::format::{header_bytes, TensorEntry};
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

const ALIGN: usize = 4096;

/// The file image; see the module docs.
pub(crate) struct FileImage {
    ptr: *mut u8,
    /// Allocated bytes: the file's length rounded up to [`ALIGN`].
    cap: usize,
    /// The file's exact length.
    len: usize,
    data_start: usize,
}

// The buffer is owned and only reached through &self / &mut self.
unsafe impl Send for FileImage {}

impl FileImage {
    /// An image for `tensors` (1-D F32, in data order), every page touched now.
    pub fn new(tensors: &[TensorEntry]) -> Self {
        let mut header = header_bytes(tensors, "F32", 4);
        while (8 + header.len()) % ALIGN != 0 {
            header.push(b' ');
        }
        let data_start = 8 + header.len();
        let elems: usize = tensors.iter().map(TensorEntry::len).sum();
        let len = data_start + 4 * elems;
        let cap = len.div_ceil(ALIGN).max(1) * ALIGN;
        let layout = Layout::from_size_align(cap, ALIGN).expect("a valid layout");
        // SAFETY: cap > 0; a null result is handled.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        let mut image = FileImage {
            ptr,
            cap,
            len,
            data_start,
        };
        let bytes = image.bytes_mut();
        bytes[..8].copy_from_slice(&(header.len() as u64).to_le_bytes());
        bytes[8..data_start].copy_from_slice(&header);
        // Touch every page now rather than during the first save (a volatile write of the byte
        // already there, which the compiler may not drop).
        for page in bytes.chunks_mut(ALIGN) {
            let last = page.len() - 1;
            // SAFETY: `last` is in bounds of `page`.
            unsafe { std::ptr::write_volatile(&mut page[last], page[last]) };
        }
        image
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr points to cap initialised (zeroed) bytes owned by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.cap) }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: as in bytes_mut.
        unsafe { std::slice::from_raw_parts(self.ptr, self.cap) }
    }

    /// The F32 data region, tensors in order.
    pub(crate) fn data_mut(&mut self) -> &mut [f32] {
        let (start, len) = (self.data_start, self.len);
        bytemuck::cast_slice_mut(&mut self.bytes_mut()[start..len])
    }

    /// Write the image to `path` (direct I/O where possible), fsynced; its size and CRC-32.
    pub fn write(&self, path: &Path) -> std::io::Result<(u64, u32)> {
        let direct = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .and_then(|f| self.write_direct(f));
        let file = match direct {
            Ok(f) => f,
            // tmpfs and some others refuse O_DIRECT, at open or at the first write.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                let mut f = File::create(path)?;
                f.write_all(&self.bytes()[..self.len])?;
                f
            }
            Err(e) => return Err(e),
        };
        file.sync_all()?;
        let crc = crc32fast::hash(&self.bytes()[..self.len]);
        Ok((self.len as u64, crc))
    }

    /// Whole aligned blocks with `O_DIRECT`, then the length cut back to the exact size.
    fn write_direct(&self, f: File) -> std::io::Result<File> {
        const CHUNK: usize = 8 << 20;
        let mut at = 0;
        while at < self.cap {
            let end = (at + CHUNK).min(self.cap);
            f.write_all_at(&self.bytes()[at..end], at as u64)?;
            at = end;
        }
        f.set_len(self.len as u64)?;
        Ok(f)
    }
}

impl Drop for FileImage {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.cap, ALIGN).expect("the layout it was made with");
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr, layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::format::{file_crc, SliceReader};

    /// Direct I/O on the disk, the buffered fallback on tmpfs (which refuses `O_DIRECT`): the
    /// same bytes, read back by tensor.
    #[test]
    fn an_image_written_directly_or_not_reads_back() {
        let tensors = [
            TensorEntry::flat("a".into(), 3),
            TensorEntry::flat("b".into(), 5000),
        ];
        let mut image = FileImage::new(&tensors);
        let values: Vec<f32> = (0..5003).map(|i| i as f32 * 0.5).collect();
        image.data_mut().copy_from_slice(&values);
        let disk = std::env::temp_dir().join(format!("zerodp-image-{}", std::process::id()));
        let shm = Path::new("/dev/shm").join(format!("zerodp-image-{}", std::process::id()));
        for path in [disk, shm] {
            if path.parent().is_some_and(|d| !d.is_dir()) {
                continue;
            }
            let (bytes, crc) = image.write(&path).unwrap();
            assert_eq!(file_crc(&path).unwrap(), (bytes, crc));
            let r = SliceReader::open(&path).unwrap();
            let mut b = vec![0.0; 4];
            r.read("b", 10, &mut b).unwrap();
            assert_eq!(b, values[13..17]);
            let mut a = vec![0.0; 3];
            r.read("a", 0, &mut a).unwrap();
            assert_eq!(a, values[..3]);
            std::fs::remove_file(&path).unwrap();
        }
    }
}
