//! Offload tiers: where a rank's optimizer states live when they do not stay in the device tier.
//!
//! * **Host** (`offload_optimizer.device = "cpu"`, `offload_param.device = "cpu"`): the bytes sit
//!   in host memory and the step runs on the CPU. On a machine without accelerators the device and
//!   host tiers are the same DRAM, so this changes no computation, only which budget the bytes are
//!   charged to (the ledger's tiers), exactly as ZeRO-Offload moves them out of device memory.
//! * **NVMe** (`device = "nvme"`): Adam's moments live in a swap file per rank under `nvme_path`
//!   ([`SwapFile`]) and are streamed through a few fixed buffers during the optimizer step.
//!
//! This module is storage only (files, aligned buffers, their errors); it knows nothing of ZeRO.
//! It sits below `zero`, like the byte accountant: the engine's update phase streams through it.

mod swap;

pub use swap::{AlignedBuf, SwapFile, SWAP_ALIGN_ELEMS};

use std::path::{Path, PathBuf};
use std::time::Instant;

/// Sequential speed of the disk under `dir` as the swap file sees it: `bytes` written then read
/// back in 16 MiB requests through a [`SwapFile`] (direct I/O where the file system allows it),
/// in bytes per second `(write, read)`. The file is removed afterwards.
pub fn sequential_speed(dir: &Path, bytes: usize) -> Result<(f64, f64), OffloadError> {
    const REQUEST: usize = 4 << 20; // elements: 16 MiB
    let elems = bytes.div_ceil(4).div_ceil(REQUEST) * REQUEST;
    let file = SwapFile::create_for(dir, "offload_optimizer", "speed-probe", elems)?;
    let mut buf = AlignedBuf::zeroed(REQUEST);
    buf.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32);
    let t = Instant::now();
    for at in (0..elems).step_by(REQUEST) {
        file.write(at, &buf)?;
    }
    file.sync()?;
    let write = (elems * 4) as f64 / t.elapsed().as_secs_f64();
    let t = Instant::now();
    for at in (0..elems).step_by(REQUEST) {
        file.read(at, &mut buf)?;
    }
    let read = (elems * 4) as f64 / t.elapsed().as_secs_f64();
    Ok((write, read))
}

/// The most elements of each moment streamed through memory at once under NVMe offload
/// (64 MiB per buffer): DeepSpeed's `sub_group_size` defaults to 1e9 elements, which would make
/// the stream buffers as large as the states they keep out of memory.
pub const MAX_STREAM_CHUNK: usize = 1 << 24;

impl OffloadError {
    /// The thread doing `op` on the swap file `path` stopped with a panic (its I/O is lost).
    pub(crate) fn io_thread_panicked(path: &Path, op: &'static str) -> OffloadError {
        OffloadError::Io {
            path: path.to_path_buf(),
            op,
            bytes: 0,
            offset: 0,
            source: std::io::Error::other("the I/O thread stopped with a panic"),
        }
    }
}

/// An offload tier could not be set up or used. Every message says what, where and how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum OffloadError {
    #[error(
        "{key}.nvme_path {path} {what}; set zero_optimization.{key}.nvme_path to an existing, \
         writable directory on a local disk"
    )]
    BadDir {
        /// The config block whose `nvme_path` it is (`offload_optimizer` or `offload_param`).
        key: &'static str,
        path: PathBuf,
        what: String,
    },
    #[error(
        "cannot reserve {bytes} bytes for the NVMe swap file {path}: {source}; free space on that \
         disk, point {key}.nvme_path at a larger one, or use more ranks (each holds 1/N of the \
         states)"
    )]
    Reserve {
        key: &'static str,
        path: PathBuf,
        bytes: u64,
        source: std::io::Error,
    },
    #[error("NVMe swap file {path}: {op} of {bytes} bytes at offset {offset} failed: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        bytes: usize,
        offset: u64,
        source: std::io::Error,
    },
}
