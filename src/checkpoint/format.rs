//! The bytes on disk: safetensors files of flat F32 tensors (written from a file image,
//! [`super::image`]), checksummed with CRC-32, and read back a slice at a time (only the elements a rank
//! needs) after parsing the header alone.

use super::CheckpointError;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// One tensor of a file being written, in data order.
pub(crate) struct TensorEntry {
    pub name: String,
    pub shape: Vec<usize>,
}

impl TensorEntry {
    /// A flat tensor of `len` elements.
    pub fn flat(name: String, len: usize) -> Self {
        TensorEntry {
            name,
            shape: vec![len],
        }
    }
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The JSON header of a safetensors file of tensors of `dtype` (`elem` bytes each), padded with
/// spaces to a multiple of 8 bytes as the format recommends.
pub(crate) fn header_bytes(tensors: &[TensorEntry], dtype: &str, elem: usize) -> Vec<u8> {
    let mut map = serde_json::Map::new();
    let mut offset = 0usize;
    for t in tensors {
        let end = offset + t.len() * elem;
        map.insert(
            t.name.clone(),
            serde_json::json!({ "dtype": dtype, "shape": t.shape, "data_offsets": [offset, end] }),
        );
        offset = end;
    }
    let mut header = serde_json::Value::Object(map).to_string().into_bytes();
    while header.len() % 8 != 0 {
        header.push(b' ');
    }
    header
}

/// A writer that counts and checksums what passes through it.
pub(crate) struct CrcWriter<W: Write> {
    inner: W,
    hasher: crc32fast::Hasher,
    bytes: u64,
}

impl<W: Write> CrcWriter<W> {
    pub fn new(inner: W) -> Self {
        CrcWriter {
            inner,
            hasher: crc32fast::Hasher::new(),
            bytes: 0,
        }
    }
    /// The writer, the bytes written and their CRC-32.
    pub fn finish(self) -> (W, u64, u32) {
        (self.inner, self.bytes, self.hasher.finalize())
    }
}

impl<W: Write> Write for CrcWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Size and CRC-32 of a whole file, read in 4 MiB blocks.
pub fn file_crc(path: &Path) -> Result<(u64, u32), CheckpointError> {
    let io = |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut f = File::open(path).map_err(io)?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 4 << 20];
    let mut bytes = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
    Ok((bytes, hasher.finalize()))
}

/// A safetensors file opened for slice reads: its header parsed, its data read on demand.
pub struct SliceReader {
    path: PathBuf,
    file: File,
    data_start: u64,
    /// Name -> (element count, byte offset in the data section).
    tensors: BTreeMap<String, (usize, u64)>,
}

impl SliceReader {
    pub fn open(path: &Path) -> Result<Self, CheckpointError> {
        let damaged = |what: String| CheckpointError::Damaged {
            path: path.to_path_buf(),
            what,
        };
        let file = File::open(path).map_err(|source| CheckpointError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        let mut len = [0u8; 8];
        file.read_exact_at(&mut len, 0)
            .map_err(|_| damaged("shorter than a safetensors header".into()))?;
        let n = u64::from_le_bytes(len);
        if n > size.saturating_sub(8) || n > 100 << 20 {
            return Err(damaged(format!("header length {n} exceeds the file")));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact_at(&mut header, 8)
            .map_err(|_| damaged("truncated header".into()))?;
        let json: serde_json::Value = serde_json::from_slice(&header)
            .map_err(|e| damaged(format!("header is not JSON: {e}")))?;
        let mut tensors = BTreeMap::new();
        let data_len = size - 8 - n;
        for (name, t) in json.as_object().into_iter().flatten() {
            if name == "__metadata__" {
                continue;
            }
            let dtype = t["dtype"].as_str().unwrap_or("");
            let shape: Vec<u64> = t["shape"]
                .as_array()
                .map(|a| a.iter().filter_map(|x| x.as_u64()).collect())
                .unwrap_or_default();
            let offs: Vec<u64> = t["data_offsets"]
                .as_array()
                .map(|a| a.iter().filter_map(|x| x.as_u64()).collect())
                .unwrap_or_default();
            let elems = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
            let span = (offs.len() == 2)
                .then(|| offs[1].checked_sub(offs[0]))
                .flatten();
            let bytes = elems.and_then(|e| e.checked_mul(4));
            if dtype != "F32" || span.is_none() || span != bytes {
                return Err(damaged(format!("tensor {name} is not a plain F32 tensor")));
            }
            if offs[1] > data_len {
                return Err(damaged(format!(
                    "tensor {name} ends at byte {} of a {data_len}-byte data section (truncated?)",
                    offs[1]
                )));
            }
            let elems = usize::try_from(elems.unwrap_or(0))
                .map_err(|_| damaged(format!("tensor {name} is too large")))?;
            tensors.insert(name.clone(), (elems, offs[0]));
        }
        Ok(SliceReader {
            path: path.to_path_buf(),
            file,
            data_start: 8 + n,
            tensors,
        })
    }

    /// Elements of tensor `name`.
    pub(crate) fn len_of(&self, name: &str) -> Result<usize, CheckpointError> {
        self.tensors
            .get(name)
            .map(|t| t.0)
            .ok_or_else(|| CheckpointError::Damaged {
                path: self.path.clone(),
                what: format!("tensor {name} is missing"),
            })
    }

    /// Elements `start..start + out.len()` of tensor `name` into `out`.
    pub fn read(&self, name: &str, start: usize, out: &mut [f32]) -> Result<(), CheckpointError> {
        let len = self.len_of(name)?;
        let offset = self.tensors[name].1;
        if start + out.len() > len {
            return Err(CheckpointError::Damaged {
                path: self.path.clone(),
                what: format!(
                    "tensor {name} has {len} elements, {} wanted from {start}",
                    out.len()
                ),
            });
        }
        let at = self.data_start + offset + 4 * start as u64;
        self.file
            .read_exact_at(bytemuck::cast_slice_mut(out), at)
            .map_err(|source| CheckpointError::Io {
                path: self.path.clone(),
                source,
            })
    }
}

/// fsync a directory, so that the names created or renamed in it are on disk.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|source| CheckpointError::Io {
            path: dir.to_path_buf(),
            source,
        })
}

/// Write `text` to `path` atomically ([`crate::atomic_file`]): a temporary beside it, fsynced,
/// renamed over it, and the directory fsynced.
pub fn write_atomic(path: &Path, text: &[u8]) -> Result<(), CheckpointError> {
    crate::atomic_file::write_atomic(path, text).map_err(|source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    })
}
