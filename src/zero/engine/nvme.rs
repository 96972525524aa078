//! `offload_optimizer.device = "nvme"`: Adam's moments of every unit's updated part in the rank's
//! swap file, streamed during the optimizer step through a ring of fixed buffer sets (`m` and `v`
//! of `chunk` elements each; `buffer_count` buffers make `buffer_count / 2` sets, at least two) so
//! that the disk and the CPU work at once: while Adam updates chunk k in one set, an I/O thread
//! writes chunk k-1 back from the set before it and reads chunk k+S-1 into that same set (write
//! behind, read ahead S-1 chunks for S sets), across unit boundaries.
//!
//! File layout: per unit, its `m` record then its `v` record, each padded to the direct-I/O
//! alignment. The moments are stored as they are kept, f32 or bf16
//! (`bf16.bf16_optimizer_states`: half the file, half the traffic); the file and its buffers are
//! addressed in 4-byte words, two bf16 moments to a word. Each chunk runs the same Adam kernel
//! as an in-memory run, so the bits are equal. The fp32 master stays in host memory: it is also
//! what the parameters are rebuilt from, and it is 4 of the 12 optimizer bytes per parameter.

use crate::flat::{DType, Slice, SliceMut};
use crate::offload::{AlignedBuf, OffloadError, SwapFile, SWAP_ALIGN_ELEMS};
use half::{bf16, f16};
use std::ops::Range;
use std::path::Path;

pub(super) struct NvmeMoments {
    file: SwapFile,
    /// The moments' element type: f32 or bf16.
    dtype: DType,
    /// The ring of stream buffer sets (at least two), each `m` then `v`.
    sets: Vec<[AlignedBuf; 2]>,
    /// Elements per streamed chunk (whole words, a multiple of the alignment).
    chunk: usize,
    /// Per unit: the word offset of its `m` record and its length in elements (unpadded).
    records: Vec<(usize, usize)>,
}

/// `words` rounded up to the direct-I/O alignment.
fn padded(words: usize) -> usize {
    words.div_ceil(SWAP_ALIGN_ELEMS) * SWAP_ALIGN_ELEMS
}

/// Moments of `dtype` per 4-byte word of the file: 1 (f32) or 2 (bf16).
fn per_word(dtype: DType) -> usize {
    4 / dtype.size()
}

/// Words of a record of `elems` moments, padded to the alignment.
fn record_words(dtype: DType, elems: usize) -> usize {
    padded(elems.div_ceil(per_word(dtype)))
}

/// `buf` (words) as moments of `dtype`, the first `elems` of them.
fn typed(dtype: DType, buf: &mut [f32], elems: usize) -> SliceMut<'_> {
    match dtype {
        DType::F32 => SliceMut::F32(&mut buf[..elems]),
        DType::BF16 => SliceMut::BF16(&mut bytemuck::cast_slice_mut::<f32, bf16>(buf)[..elems]),
        DType::F16 => SliceMut::F16(&mut bytemuck::cast_slice_mut::<f32, f16>(buf)[..elems]),
    }
}

/// Buffer sets (`m` and `v`) the stream keeps for `buffer_count` buffers: half of them, at least
/// two (double buffering; DeepSpeed asks for at least 4 buffers for Adam, its default).
fn set_count(buffer_count: usize) -> usize {
    (buffer_count / 2).max(2)
}

/// Words of each stream buffer for `chunk` moments of `dtype` requested and `longest` updated
/// part: no longer than the longest part, padded to the direct-I/O alignment.
fn buffer_words(dtype: DType, chunk: usize, longest: usize) -> usize {
    record_words(dtype, chunk.clamp(1, longest.max(1)))
}

/// Host bytes of the NVMe stream buffers: `buffer_count` buffers (rounded down to whole sets of `m`
/// and `v`, at least four) of `chunk` moments of `dtype` (f32 or bf16), capped at the `longest`
/// updated part and padded. The engine allocates exactly this; the pre-flight check counts it
/// before a run.
pub fn stream_buffer_bytes(dtype: DType, chunk: usize, buffer_count: usize, longest: usize) -> u64 {
    (2 * set_count(buffer_count) * buffer_words(dtype, chunk, longest) * 4) as u64
}

impl NvmeMoments {
    /// A zeroed swap file under `dir` for moments of `dtype` (f32 or bf16), `lens[u]` elements
    /// per unit, streamed `chunk` elements at a time through `buffer_count` buffers.
    pub(super) fn new(
        dir: &Path,
        rank: usize,
        dtype: DType,
        lens: &[usize],
        chunk: usize,
        buffer_count: usize,
    ) -> Result<NvmeMoments, OffloadError> {
        let longest = lens.iter().copied().max().unwrap_or(0);
        let words = buffer_words(dtype, chunk, longest);
        let mut records = Vec::with_capacity(lens.len());
        let mut at = 0;
        for &len in lens {
            records.push((at, len));
            at += 2 * record_words(dtype, len);
        }
        Ok(NvmeMoments {
            file: SwapFile::create(dir, rank, at)?,
            dtype,
            sets: (0..set_count(buffer_count))
                .map(|_| std::array::from_fn(|_| AlignedBuf::zeroed(words)))
                .collect(),
            chunk: words * per_word(dtype),
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
            .map_or(0, |&(at, len)| at + 2 * record_words(self.dtype, len));
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
    /// `range` is the chunk's place in the unit's updated part, `m` and `v` its moments (of the
    /// stream's dtype), read before `f` and written after it, the I/O of the neighbouring chunks
    /// overlapping `f`. An error from `f` (of the caller's type, which the stream's own I/O errors
    /// convert into) stops the stream after the chunk's I/O.
    pub(super) fn step<E: From<OffloadError>>(
        &mut self,
        mut f: impl FnMut(usize, Range<usize>, SliceMut<'_>, SliceMut<'_>) -> Result<(), E>,
    ) -> Result<(), E> {
        let chunks = self.chunks();
        let (records, dtype) = (&self.records, self.dtype);
        // Word offsets of chunk `c`'s m and v in the file, and its I/O length (padded). Chunks
        // start at multiples of `self.chunk`, whole words.
        let place = |(u, off, n): (usize, usize, usize)| {
            let (at, len) = records[u];
            let off = off / per_word(dtype);
            (
                at + off,
                at + record_words(dtype, len) + off,
                record_words(dtype, n),
            )
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
                let (m, v) = (typed(dtype, m, n_elems), typed(dtype, v, n_elems));
                let updated = f(u, off..off + n_elems, m, v);
                worker.join().unwrap_or_else(|_| {
                    Err(OffloadError::io_thread_panicked(file.path(), "stream"))
                })?;
                updated
            })?;
        }
        match n.checked_sub(1) {
            Some(last) => Ok(write_chunk(
                file,
                place(chunks[last]),
                &self.sets[last % ring],
            )?),
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
        let words = record_words(self.dtype, len);
        let mut whole = AlignedBuf::zeroed(words);
        let mut out = Vec::with_capacity(2);
        for rec in [at, at + words] {
            self.file.read(rec, &mut whole)?;
            let mut values = vec![0.0; range.len()];
            let moments = typed(self.dtype, &mut whole, len);
            moments
                .as_slice()
                .range(range.clone())
                .widen_into(&mut values);
            out.push(values);
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
        let words = record_words(self.dtype, len);
        let mut whole = AlignedBuf::zeroed(words);
        for (rec, values) in [(at, m), (at + words, v)] {
            self.file.read(rec, &mut whole)?;
            let mut moments = typed(self.dtype, &mut whole, len);
            moments.sub_mut(range.clone()).copy_from(Slice::F32(values));
            self.file.write(rec, &whole)?;
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
