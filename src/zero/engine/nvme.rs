//! `offload_optimizer.device = "nvme"`: Adam's moments of every unit's updated part in the rank's
//! swap file, streamed through two fixed buffers of `chunk` elements during the optimizer step.
//!
//! File layout: per unit, its `m` record then its `v` record, each padded to the direct-I/O
//! alignment. A step reads a chunk of both, runs the same Adam kernel on it (so the bits equal an
//! in-memory run's), and writes it back. The fp32 master stays in host memory: it is also what
//! the parameters are rebuilt from, and it is 4 of the 12 optimizer bytes per parameter.

use crate::offload::{AlignedBuf, OffloadError, SwapFile, SWAP_ALIGN_ELEMS};
use std::ops::Range;
use std::path::Path;

pub(super) struct NvmeMoments {
    file: SwapFile,
    m: AlignedBuf,
    v: AlignedBuf,
    /// Elements per streamed chunk (a multiple of the alignment).
    chunk: usize,
    /// Per unit: the element offset of its `m` record and its length (unpadded).
    records: Vec<(usize, usize)>,
}

fn padded(len: usize) -> usize {
    len.div_ceil(SWAP_ALIGN_ELEMS) * SWAP_ALIGN_ELEMS
}

impl NvmeMoments {
    /// A zeroed swap file under `dir` for moments of `lens[u]` elements per unit.
    pub(super) fn new(
        dir: &Path,
        rank: usize,
        lens: &[usize],
        chunk: usize,
    ) -> Result<NvmeMoments, OffloadError> {
        let longest = lens.iter().copied().max().unwrap_or(0);
        let chunk = padded(chunk.clamp(1, longest.max(1)));
        let mut records = Vec::with_capacity(lens.len());
        let mut at = 0;
        for &len in lens {
            records.push((at, len));
            at += 2 * padded(len);
        }
        Ok(NvmeMoments {
            file: SwapFile::create(dir, rank, at)?,
            m: AlignedBuf::zeroed(chunk),
            v: AlignedBuf::zeroed(chunk),
            chunk,
            records,
        })
    }

    /// Bytes of the two stream buffers (host tier).
    pub(super) fn buffer_bytes(&self) -> u64 {
        (self.m.bytes() + self.v.bytes()) as u64
    }

    /// Bytes of the swap file (NVMe tier).
    pub(super) fn file_bytes(&self) -> u64 {
        let last = self
            .records
            .last()
            .map_or(0, |&(at, len)| at + 2 * padded(len));
        (last * 4) as u64
    }

    /// Bytes read from and written to the swap file so far.
    pub(super) fn traffic(&self) -> (u64, u64) {
        (self.file.bytes_read(), self.file.bytes_written())
    }

    /// Runs `f(range, m, v)` over unit `unit`'s moments a chunk at a time: `range` is the chunk's
    /// place in the unit's updated part, `m` and `v` its moments, read before and written after.
    pub(super) fn stream(
        &mut self,
        unit: usize,
        mut f: impl FnMut(Range<usize>, &mut [f32], &mut [f32]),
    ) -> Result<(), OffloadError> {
        let (at, len) = self.records[unit];
        let v_at = at + padded(len);
        let mut off = 0;
        while off < len {
            let n = self.chunk.min(len - off);
            let io = padded(n);
            self.file.read(at + off, &mut self.m[..io])?;
            self.file.read(v_at + off, &mut self.v[..io])?;
            f(off..off + n, &mut self.m[..n], &mut self.v[..n]);
            self.file.write(at + off, &self.m[..io])?;
            self.file.write(v_at + off, &self.v[..io])?;
            off += n;
        }
        Ok(())
    }

    /// Unit `unit`'s moments over `range` of its updated part (for a checkpoint).
    pub(super) fn read(
        &self,
        unit: usize,
        range: Range<usize>,
    ) -> Result<(Vec<f32>, Vec<f32>), OffloadError> {
        let (at, len) = self.records[unit];
        let mut whole = AlignedBuf::zeroed(len);
        let mut out = Vec::with_capacity(2);
        for rec in [at, at + padded(len)] {
            self.file.read(rec, &mut whole[..padded(len)])?;
            out.push(whole[range.clone()].to_vec());
        }
        let v = out.pop().unwrap_or_default();
        let m = out.pop().unwrap_or_default();
        Ok((m, v))
    }

    /// Overwrites unit `unit`'s moments over `range` of its updated part (a restore).
    pub(super) fn write(
        &mut self,
        unit: usize,
        range: Range<usize>,
        m: &[f32],
        v: &[f32],
    ) -> Result<(), OffloadError> {
        let (at, len) = self.records[unit];
        let mut whole = AlignedBuf::zeroed(len);
        for (rec, values) in [(at, m), (at + padded(len), v)] {
            self.file.read(rec, &mut whole[..padded(len)])?;
            whole[range.clone()].copy_from_slice(values);
            self.file.write(rec, &whole[..padded(len)])?;
        }
        Ok(())
    }
}
