//! `offload_optimizer.device = "nvme"`: Adam's moments of every unit's updated part in the rank's
//! swap file, streamed during the optimizer step through a ring of fixed buffer sets (`m` and `v`
//! of `chunk` elements each; `buffer_count` buffers make `buffer_count / 2` sets, at least two) so
//! that the disk and the CPU work at once: while Adam updates chunk k in one set, an I/O thread
//! writes chunk k-1 back from the set before it and reads chunk k+S-1 into that same set (write
//! behind, read ahead S-1 chunks for S sets), across unit boundaries.
//!
//! File layout: per unit, its `m` record then its `v` record, each padded to the direct-I/O
//! alignment. Each chunk runs the same Adam kernel as an in-memory run, so the bits are equal.
//! The fp32 master stays in host memory: it is also what the parameters are rebuilt from, and it
//! is 4 of the 12 optimizer bytes per parameter.

use crate::offload::{AlignedBuf, OffloadError, SwapFile, SWAP_ALIGN_ELEMS};
use std::ops::Range;
use std::path::Path;

pub(super) struct NvmeMoments {
    file: SwapFile,
    /// The ring of stream buffer sets (at least two), each `m` then `v`.
    sets: Vec<[AlignedBuf; 2]>,
    /// Elements per streamed chunk (a multiple of the alignment).
    chunk: usize,
    /// Per unit: the element offset of its `m` record and its length (unpadded).
    records: Vec<(usize, usize)>,
}

fn padded(len: usize) -> usize {
    len.div_ceil(SWAP_ALIGN_ELEMS) * SWAP_ALIGN_ELEMS
}

/// Buffer sets (`m` and `v`) the stream keeps for `buffer_count` buffers: half of them, at least
/// two (double buffering; DeepSpeed asks for at least 4 buffers for Adam, its default).
fn set_count(buffer_count: usize) -> usize {
    (buffer_count / 2).max(2)
}

/// Elements of each stream buffer for `chunk` requested and `longest` updated part: no longer
/// than the longest part, padded to the direct-I/O alignment.
fn buffer_elems(chunk: usize, longest: usize) -> usize {
    padded(chunk.clamp(1, longest.max(1)))
}

/// Host bytes of the NVMe stream buffers: `buffer_count` buffers (rounded down to whole sets of `m`
/// and `v`, at least four) of `chunk` f32 elements, capped at the `longest` updated part and
/// padded. The engine allocates exactly this; the pre-flight check counts it before a run.
pub fn stream_buffer_bytes(chunk: usize, buffer_count: usize, longest: usize) -> u64 {
    (2 * set_count(buffer_count) * buffer_elems(chunk, longest) * 4) as u64
}

impl NvmeMoments {
    /// A zeroed swap file under `dir` for moments of `lens[u]` elements per unit, streamed
    /// `chunk` elements at a time through `buffer_count` buffers.
    pub(super) fn new(
        dir: &Path,
        rank: usize,
        lens: &[usize],
        chunk: usize,
        buffer_count: usize,
    ) -> Result<NvmeMoments, OffloadError> {
        let longest = lens.iter().copied().max().unwrap_or(0);
        let chunk = buffer_elems(chunk, longest);
        let mut records = Vec::with_capacity(lens.len());
        let mut at = 0;
        for &len in lens {
            records.push((at, len));
            at += 2 * padded(len);
        }
        Ok(NvmeMoments {
            file: SwapFile::create(dir, rank, at)?,
            sets: (0..set_count(buffer_count))
                .map(|_| std::array::from_fn(|_| AlignedBuf::zeroed(chunk)))
                .collect(),
            chunk,
            records,
        })
    }

    /// Bytes of the stream buffers (host tier).
    pub(super) fn buffer_bytes(&self) -> u64 {
        self.sets.iter().flatten().map(|b| b.bytes() as u64).sum()
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

    /// Every unit's chunks in step order: `(unit, offset in its updated part, elements)`.
    fn chunks(&self) -> Vec<(usize, usize, usize)> {
        let mut out = Vec::new();
        for (u, &(_, len)) in self.records.iter().enumerate() {
            let mut off = 0;
            while off < len {
                let n = self.chunk.min(len - off);
                out.push((u, off, n));
                off += n;
            }
        }
        out
    }

    /// Runs `f(unit, range, m, v)` over every unit's moments a chunk at a time, in unit order:
    /// `range` is the chunk's place in the unit's updated part, `m` and `v` its moments, read
    /// before `f` and written after it, the I/O of the neighbouring chunks overlapping `f`. An
    /// error from `f` stops the stream after the chunk's I/O.
    pub(super) fn step(
        &mut self,
        mut f: impl FnMut(usize, Range<usize>, &mut [f32], &mut [f32]) -> Result<(), OffloadError>,
    ) -> Result<(), OffloadError> {
        let chunks = self.chunks();
        let records = &self.records;
        // Element offsets of chunk `c`'s m and v in the file, and its I/O length (padded).
        let place = |(u, off, n): (usize, usize, usize)| {
            let (at, len) = records[u];
            (at + off, at + padded(len) + off, padded(n))
        };
        let n = chunks.len();
        let ring = self.sets.len();
        let file = &self.file;
        // Chunk j lives in set j % ring. Before the first update, read the first ring-1 chunks.
        for (j, &c) in chunks.iter().enumerate().take(ring - 1) {
            read_chunk(file, place(c), &mut self.sets[j])?;
        }
        for (k, &(u, off, n_elems)) in chunks.iter().enumerate() {
            // The I/O set is the one before the current set: it holds chunk k-1 to write back,
            // then receives chunk k+ring-1.
            let io_set = (k + ring - 1) % ring;
            let (cur, other) = two_mut(&mut self.sets, k % ring, io_set);
            let behind = k.checked_sub(1).map(|j| place(chunks[j]));
            let ahead = chunks.get(k + ring - 1).map(|&c| place(c));
            std::thread::scope(|s| {
                let worker = s.spawn(move || -> Result<(), OffloadError> {
                    if let Some(p) = behind {
                        write_chunk(file, p, other)?;
                    }
                    if let Some(p) = ahead {
                        read_chunk(file, p, other)?;
                    }
                    Ok(())
                });
                let [m, v] = cur;
                let updated = f(u, off..off + n_elems, &mut m[..n_elems], &mut v[..n_elems]);
                worker.join().unwrap_or_else(|_| {
                    Err(OffloadError::io_thread_panicked(file.path(), "stream"))
                })?;
                updated
            })?;
        }
        match n.checked_sub(1) {
            Some(last) => write_chunk(file, place(chunks[last]), &self.sets[last % ring]),
            None => Ok(()),
        }
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

/// Reads a chunk's m and v (`(m at, v at, padded length)`) into `set`.
fn read_chunk(
    file: &SwapFile,
    (m_at, v_at, io): (usize, usize, usize),
    set: &mut [AlignedBuf; 2],
) -> Result<(), OffloadError> {
    let [m, v] = set;
    file.read(m_at, &mut m[..io])?;
    file.read(v_at, &mut v[..io])
}

/// Writes a chunk's m and v back from `set`.
fn write_chunk(
    file: &SwapFile,
    (m_at, v_at, io): (usize, usize, usize),
    set: &[AlignedBuf; 2],
) -> Result<(), OffloadError> {
    file.write(m_at, &set[0][..io])?;
    file.write(v_at, &set[1][..io])
}

/// Two distinct elements of `v` mutably (`a != b`).
fn two_mut<T>(v: &mut [T], a: usize, b: usize) -> (&mut T, &mut T) {
    debug_assert_ne!(a, b);
    if a < b {
        let (lo, hi) = v.split_at_mut(b);
        (&mut lo[a], &mut hi[0])
    } else {
        let (lo, hi) = v.split_at_mut(a);
        (&mut hi[0], &mut lo[b])
    }
}
