//! Stage 3: where a rank keeps its parameter shards between gathers.
//!
//! In memory ([`ShardStore::Memory`]: the device tier, or the host tier under
//! `offload_param.device = "cpu"`, which on a machine without accelerators is the same DRAM charged
//! to another budget), or in a swap file under `offload_param.nvme_path` ([`ShardStore::Nvme`],
//! ZeRO-Infinity's parameter offload): a gather reads the shard from the file into one of a fixed
//! set of staging buffers, which travels inside the all-gather and is free again once the gather
//! completes. A shard changes only in the optimizer step, so forward and backward only read it;
//! the step reads each unit's shard, updates it and writes it back, one unit at a time.
//!
//! Under `offload_param.max_in_cpu` (DeepSpeed's key and rule) the rank's first units whose
//! shards fit in that many elements together stay in host memory inside the swap store, as in
//! [`ShardStore::Memory`]; only the rest are in the file ([`resident_units`]).
//!
//! Reads overlap compute: the coordinator names the next unit it will gather
//! ([`ShardStore::read_ahead`]) and a thread reads that shard into a free staging buffer while the
//! current visit computes; the gather then takes it ready. A read ahead is discarded when the
//! shards are about to change ([`ShardStore::settle`]) and when a demand fetch needs its buffer.
//! Writes overlap the optimizer step: an updated shard is written on a thread while the next
//! unit updates ([`ShardStore::put_back`]); the step waits for the last one
//! ([`ShardStore::flush`]) before anything reads the shards again. Taking the shard being written,
//! or needing its staging buffer, waits for the write; other reads go on beside it.

use crate::flat::{Buffer, DType};
use crate::offload::{AlignedBuf, OffloadError, SwapFile, SWAP_ALIGN_ELEMS};
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;

/// The config key whose `nvme_path` the parameter swap file lives under (for its errors).
const KEY: &str = "offload_param";

/// A stage-3 rank's parameter shards, one per unit, in the parameters' dtype.
pub enum ShardStore {
    /// Every shard in memory.
    Memory(Vec<Buffer>),
    /// Every shard in the rank's parameter swap file (boxed: the file, its records and buffers
    /// would make every stage's state as large).
    Nvme(Box<SwappedShards>),
}

/// How many of the rank's first units keep their shards in host memory under
/// `offload_param.max_in_cpu`: the longest prefix whose shards hold at most `max_in_cpu` elements
/// together. DeepSpeed's rule over its sub-groups: its host buffer holds `max_in_cpu` elements and
/// each sub-group in order lives there if it still fits whole, else (and every later one) on
/// NVMe. zerodp's sub-groups are its units.
pub fn resident_units(shard_lens: impl IntoIterator<Item = usize>, max_in_cpu: usize) -> usize {
    let mut total = 0usize;
    shard_lens
        .into_iter()
        .take_while(|&len| {
            total = total.saturating_add(len);
            total <= max_in_cpu
        })
        .count()
}

/// The shards in a swap file, read into staging buffers for gathers and updates.
pub struct SwappedShards {
    /// The shards of the first units, kept in host memory (`max_in_cpu`); an empty buffer stands
    /// in for one that is out.
    host: Vec<Buffer>,
    /// Shared with the read-ahead thread (reads and writes are positioned, `pread`/`pwrite`).
    file: Arc<SwapFile>,
    dtype: DType,
    /// Per unit: the 4-byte word its record starts at in the file, and its length in elements
    /// (the units in `host` have no record in the file).
    records: Vec<(usize, usize)>,
    /// Free staging buffers, each with room for the longest shard; the others are inside gathers.
    free: Vec<Buffer>,
    /// Staging buffers in existence, free or not.
    staging: usize,
    /// Elements of the longest shard in the file: the length of every staging buffer.
    longest: usize,
    /// Direct I/O needs page-aligned memory: records pass through this buffer of the longest one
    /// (lent to the write behind while one is in flight).
    bounce: Option<AlignedBuf>,
    /// The read-ahead's own bounce buffer, here while no read ahead is in flight.
    spare: Option<AlignedBuf>,
    /// The read ahead in flight, if any.
    ahead: Option<ReadAhead>,
    /// The write behind in flight, if any.
    behind: Option<WriteBehind>,
}

/// An updated shard being written on a thread of its own: the unit, and the thread, which hands
/// back the staging buffer, the bounce buffer and whether the write succeeded.
struct WriteBehind {
    unit: usize,
    thread: JoinHandle<Option<IoDone>>,
}

/// What an I/O thread hands back: the staging buffer, the bounce buffer, and how the I/O went.
type IoDone = (Buffer, AlignedBuf, Result<(), OffloadError>);

/// A shard being read on a thread of its own: the unit, and the thread, which hands back the
/// staging buffer, the bounce buffer and whether the read succeeded.
struct ReadAhead {
    unit: usize,
    thread: JoinHandle<IoDone>,
}

/// 4-byte words of a record of `len` elements of `dtype`, padded to the direct-I/O alignment.
fn record_words(dtype: DType, len: usize) -> usize {
    (len * dtype.size()).div_ceil(4 * SWAP_ALIGN_ELEMS) * SWAP_ALIGN_ELEMS
}

/// Host bytes a parameter swap file streams through: `staging` buffers of the `longest` shard
/// and the two aligned bounce buffers direct I/O passes through (the compute thread's and the
/// read-ahead's).
pub(crate) fn staging_bytes(dtype: DType, longest: usize, staging: usize) -> u64 {
    (staging * longest * dtype.size() + 2 * record_words(dtype, longest) * 4) as u64
}

fn bytes_of(b: &Buffer) -> &[u8] {
    match b {
        Buffer::F32(v) => bytemuck::cast_slice(v),
        Buffer::BF16(v) => bytemuck::cast_slice(v),
        Buffer::F16(v) => bytemuck::cast_slice(v),
    }
}

fn bytes_of_mut(b: &mut Buffer) -> &mut [u8] {
    match b {
        Buffer::F32(v) => bytemuck::cast_slice_mut(v),
        Buffer::BF16(v) => bytemuck::cast_slice_mut(v),
        Buffer::F16(v) => bytemuck::cast_slice_mut(v),
    }
}

impl SwappedShards {
    /// A swap file under `dir` holding `shards` past the first `resident` (which are written to it
    /// and dropped; the first `resident` stay in memory), read through `staging` buffers of the
    /// longest shard in the file.
    pub fn new(
        dir: &Path,
        rank: usize,
        mut shards: Vec<Buffer>,
        staging: usize,
        resident: usize,
    ) -> Result<SwappedShards, OffloadError> {
        let dtype = shards.first().map_or(DType::F32, Buffer::dtype);
        let resident = resident.min(shards.len());
        let mut records = Vec::with_capacity(shards.len());
        let mut at = 0;
        for (u, s) in shards.iter().enumerate() {
            records.push((at, s.len()));
            if u >= resident {
                at += record_words(dtype, s.len());
            }
        }
        let longest = shards[resident..]
            .iter()
            .map(Buffer::len)
            .max()
            .unwrap_or(0);
        let file = SwapFile::create_for(dir, KEY, &format!("rank{rank}-params"), at)?;
        let swapped = shards.split_off(resident);
        let mut store = SwappedShards {
            host: shards,
            file: Arc::new(file),
            dtype,
            records,
            free: Vec::with_capacity(staging),
            staging,
            longest,
            bounce: Some(AlignedBuf::zeroed(record_words(dtype, longest))),
            spare: Some(AlignedBuf::zeroed(record_words(dtype, longest))),
            ahead: None,
            behind: None,
        };
        store.free = (0..staging).map(|_| store.new_staging()).collect();
        for (i, s) in swapped.iter().enumerate() {
            store.store(resident + i, s)?;
        }
        Ok(store)
    }

    /// Whether unit `unit`'s shard is kept in host memory (`max_in_cpu`) rather than the file.
    fn is_resident(&self, unit: usize) -> bool {
        unit < self.host.len()
    }

    /// Moves resident unit `unit`'s shard out (an empty buffer in its place).
    fn take_resident(&mut self, unit: usize) -> Buffer {
        std::mem::replace(&mut self.host[unit], Buffer::F32(Vec::new()))
    }

    /// Reads unit `unit`'s shard into `dst` (resized to the shard's length), through the compute
    /// thread's bounce buffer, or the read ahead's while a write behind has the first (so that a
    /// demand read need not wait for the write).
    fn load(&mut self, unit: usize, dst: &mut Buffer) -> Result<(), OffloadError> {
        let (mut bounce, spare) = match (self.bounce.take(), self.spare.take()) {
            (Some(b), spare) => {
                self.spare = spare;
                (b, false)
            }
            (None, Some(b)) => (b, true),
            (None, None) => (self.own_bounce()?, false),
        };
        let r = load_via(
            &self.file,
            self.records[unit],
            self.dtype,
            dst,
            &mut bounce[..],
        );
        match spare {
            true => self.spare = Some(bounce),
            false => self.bounce = Some(bounce),
        }
        r
    }

    /// The compute thread's bounce buffer, taken out (waiting for the write behind that has it).
    /// Put it back in `self.bounce`.
    fn own_bounce(&mut self) -> Result<AlignedBuf, OffloadError> {
        self.flush()?;
        Ok(self
            .bounce
            .take()
            .unwrap_or_else(|| AlignedBuf::zeroed(record_words(self.dtype, self.longest))))
    }

    /// Writes unit `unit`'s updated shard on a thread while the caller goes on (after the previous
    /// write behind has finished: one at a time); the staging buffer is free again when it is
    /// done. When the previous write failed, or no thread can start, this shard is written now
    /// (so that an update is never dropped) and the error of the previous write is returned.
    fn write_behind(&mut self, unit: usize, shard: Buffer) -> Result<(), OffloadError> {
        if self.ahead.as_ref().is_some_and(|a| a.unit == unit) {
            // A read of the old contents must not be served after the write.
            self.discard_read_ahead();
        }
        if let Err(e) = self.flush() {
            let stored = self.store(unit, &shard);
            self.free.push(shard);
            return stored.and(Err(e));
        }
        let bounce = self.own_bounce()?;
        let (file, record, dtype) = (self.file.clone(), self.records[unit], self.dtype);
        // The shard goes to the thread once it runs, so that a failed spawn leaves it here.
        let (tx, rx) = std::sync::mpsc::channel::<(Buffer, AlignedBuf)>();
        let spawned = std::thread::Builder::new()
            .name("zerodp-param-write".into())
            .spawn(move || {
                let (shard, mut bounce) = rx.recv().ok()?;
                let r = store_via(&file, record, dtype, &shard, &mut bounce);
                Some((shard, bounce, r))
            });
        let unsent = match spawned {
            Ok(thread) => match tx.send((shard, bounce)) {
                Ok(()) => {
                    self.behind = Some(WriteBehind { unit, thread });
                    return Ok(());
                }
                Err(std::sync::mpsc::SendError(back)) => back,
            },
            Err(_) => (shard, bounce),
        };
        let (shard, bounce) = unsent;
        self.bounce = Some(bounce);
        let stored = self.store(unit, &shard);
        self.free.push(shard);
        stored
    }

    /// Waits for the write behind in flight (if any): its staging buffer free again and the bounce
    /// buffer back, its error returned.
    fn flush(&mut self) -> Result<(), OffloadError> {
        let Some(WriteBehind { thread, .. }) = self.behind.take() else {
            return Ok(());
        };
        let Ok(Some((buf, bounce, r))) = thread.join() else {
            self.free.push(self.new_staging());
            self.bounce = Some(AlignedBuf::zeroed(record_words(self.dtype, self.longest)));
            return Err(OffloadError::io_thread_panicked(
                self.file.path(),
                "write behind",
            ));
        };
        self.free.push(buf);
        self.bounce = Some(bounce);
        r
    }

    /// Starts reading unit `unit`'s shard on a thread, when no read ahead is in flight and a
    /// staging buffer is free.
    fn start_read_ahead(&mut self, unit: usize) {
        let swapped = unit < self.records.len() && !self.is_resident(unit);
        let being_written = self.behind.as_ref().is_some_and(|w| w.unit == unit);
        if self.ahead.is_some() || self.free.is_empty() || !swapped || being_written {
            return;
        }
        let Some(mut bounce) = self.spare.take() else {
            return;
        };
        let mut dst = self.take_staging();
        let (file, record, dtype) = (self.file.clone(), self.records[unit], self.dtype);
        let spawned = std::thread::Builder::new()
            .name("zerodp-param-read".into())
            .spawn(move || {
                let r = load_via(&file, record, dtype, &mut dst, &mut bounce);
                (dst, bounce, r)
            });
        // Without a thread the gather reads the shard itself (a failed spawn is rare: out of
        // threads).
        match spawned {
            Ok(thread) => self.ahead = Some(ReadAhead { unit, thread }),
            Err(_) => self.replace_lost_buffers(),
        }
    }

    /// A zeroed staging buffer with room for the longest shard.
    fn new_staging(&self) -> Buffer {
        Buffer::zeros(self.dtype, self.longest)
    }

    /// The read ahead's staging and bounce buffers went with a thread that never gave them back
    /// (it could not start, or it panicked): allocate their like again.
    fn replace_lost_buffers(&mut self) {
        self.free.push(self.new_staging());
        self.spare = Some(AlignedBuf::zeroed(record_words(self.dtype, self.longest)));
    }

    /// Waits for the read ahead in flight (if any): the shard it read, or its error (the staging
    /// buffer then free again); the bounce buffer back either way.
    fn join_read_ahead(&mut self) -> Option<Result<Buffer, OffloadError>> {
        let ReadAhead { thread, .. } = self.ahead.take()?;
        let Ok((buf, bounce, r)) = thread.join() else {
            self.replace_lost_buffers();
            let e = OffloadError::io_thread_panicked(self.file.path(), "read ahead");
            return Some(Err(e));
        };
        self.spare = Some(bounce);
        Some(match r {
            Ok(()) => Ok(buf),
            Err(e) => {
                self.free.push(buf);
                Err(e)
            }
        })
    }

    /// Discards the read ahead in flight (if any), its staging buffer free again. Its error, if
    /// it had one, is dropped with its data: the next read of that shard meets the disk again.
    fn discard_read_ahead(&mut self) {
        if let Some(Ok(buf)) = self.join_read_ahead() {
            self.free.push(buf);
        }
    }

    /// Unit `unit`'s shard in a staging buffer: the read ahead's if it was this unit's, else read
    /// now (discarding another unit's read ahead when it holds the last free buffer).
    fn fetch(&mut self, unit: usize) -> Result<Buffer, OffloadError> {
        if self.ahead.as_ref().is_some_and(|a| a.unit == unit) {
            if let Some(r) = self.join_read_ahead() {
                return r;
            }
        }
        if self.free.is_empty() {
            self.discard_read_ahead();
        }
        if self.free.is_empty() || self.behind.as_ref().is_some_and(|w| w.unit == unit) {
            self.flush()?;
        }
        let mut b = self.take_staging();
        match self.load(unit, &mut b) {
            Ok(()) => Ok(b),
            Err(e) => {
                self.free.push(b);
                Err(e)
            }
        }
    }
}

/// Writes `src` as the shard of `record` (`(word offset, elements)`) through the aligned buffer
/// `bounce` (as long as the record).
fn store_via(
    file: &SwapFile,
    (at, len): (usize, usize),
    dtype: DType,
    src: &Buffer,
    bounce: &mut [f32],
) -> Result<(), OffloadError> {
    debug_assert_eq!(src.len(), len);
    let words = record_words(dtype, len);
    let n = len * dtype.size();
    bytemuck::cast_slice_mut(&mut bounce[..words])[..n].copy_from_slice(bytes_of(src));
    file.write(at, &bounce[..words])
}

/// Reads the shard of `record` (`(word offset, elements)`) into `dst` (resized to the shard's
/// length) through the aligned buffer `bounce` (as long as the record).
fn load_via(
    file: &SwapFile,
    record: (usize, usize),
    dtype: DType,
    dst: &mut Buffer,
    bounce: &mut [f32],
) -> Result<(), OffloadError> {
    let (at, len) = record;
    let words = record_words(dtype, len);
    file.read(at, &mut bounce[..words])?;
    dst.resize_zeroed(len);
    let n = len * dtype.size();
    bytes_of_mut(dst).copy_from_slice(&bytemuck::cast_slice(&bounce[..words])[..n]);
    Ok(())
}

impl SwappedShards {
    /// Writes `src` as unit `unit`'s shard, now.
    fn store(&mut self, unit: usize, src: &Buffer) -> Result<(), OffloadError> {
        let mut bounce = self.own_bounce()?;
        let r = store_via(&self.file, self.records[unit], self.dtype, src, &mut bounce);
        self.bounce = Some(bounce);
        r
    }

    /// A free staging buffer. The coordinator keeps its gathers within the staging buffers, so
    /// one is always free; should that ever fail, the pool grows by one (and `host_bytes` says
    /// so) rather than the step stopping.
    fn take_staging(&mut self) -> Buffer {
        match self.free.pop() {
            Some(b) => b,
            None => {
                debug_assert!(false, "no free staging buffer");
                self.staging += 1;
                self.new_staging()
            }
        }
    }

    /// Host bytes of the staging buffers and the bounce buffers.
    pub fn host_bytes(&self) -> u64 {
        staging_bytes(self.dtype, self.longest, self.staging)
    }

    /// Bytes of the swap file.
    pub(crate) fn file_bytes(&self) -> u64 {
        let words: usize = self.records[self.host.len()..]
            .iter()
            .map(|&(_, len)| record_words(self.dtype, len))
            .sum();
        (words * 4) as u64
    }

    /// Bytes read from and written to the swap file so far.
    pub fn traffic(&self) -> (u64, u64) {
        (self.file.bytes_read(), self.file.bytes_written())
    }
}

impl ShardStore {
    /// Unit `unit`'s shard, to travel inside its gather: moved out of memory, or read from the swap
    /// file into a staging buffer. Give it back with [`ShardStore::give_back`].
    pub fn take(&mut self, unit: usize) -> Result<Buffer, OffloadError> {
        match self {
            ShardStore::Memory(v) => Ok(std::mem::replace(&mut v[unit], Buffer::F32(Vec::new()))),
            ShardStore::Nvme(s) if s.is_resident(unit) => Ok(s.take_resident(unit)),
            ShardStore::Nvme(s) => s.fetch(unit),
        }
    }

    /// Unit `unit`'s shard to be overwritten whole: [`ShardStore::take`] without reading the swap
    /// file (its contents are unspecified there). Put it back with [`ShardStore::put_back`].
    pub(crate) fn take_to_overwrite(&mut self, unit: usize) -> Result<Buffer, OffloadError> {
        Ok(match self {
            ShardStore::Memory(v) => std::mem::replace(&mut v[unit], Buffer::F32(Vec::new())),
            ShardStore::Nvme(s) if s.is_resident(unit) => s.take_resident(unit),
            ShardStore::Nvme(s) => {
                if s.free.is_empty() || s.ahead.as_ref().is_some_and(|a| a.unit == unit) {
                    s.discard_read_ahead();
                }
                if s.free.is_empty() {
                    s.flush()?;
                }
                let mut b = s.take_staging();
                b.resize_zeroed(s.records[unit].1);
                b
            }
        })
    }

    /// The shard [`ShardStore::take`] gave out, unchanged, back from its gather.
    pub fn give_back(&mut self, unit: usize, shard: Buffer) {
        match self {
            ShardStore::Memory(v) => v[unit] = shard,
            ShardStore::Nvme(s) if s.is_resident(unit) => s.host[unit] = shard,
            ShardStore::Nvme(s) => s.free.push(shard),
        }
    }

    /// A shard [`ShardStore::take`] gave out, changed: kept as unit `unit`'s shard (under NVMe
    /// offload written to the swap file on a thread while the caller goes on, its staging buffer
    /// free again when that is done: [`ShardStore::flush`] waits for it). The error of the
    /// previous write, if it failed, is returned here.
    pub fn put_back(&mut self, unit: usize, shard: Buffer) -> Result<(), OffloadError> {
        match self {
            ShardStore::Memory(v) => {
                v[unit] = shard;
                Ok(())
            }
            ShardStore::Nvme(s) if s.is_resident(unit) => {
                s.host[unit] = shard;
                Ok(())
            }
            ShardStore::Nvme(s) => s.write_behind(unit, shard),
        }
    }

    /// Waits for the shard [`ShardStore::put_back`] is writing, and returns the error if the write
    /// failed (nothing to do in memory).
    pub fn flush(&mut self) -> Result<(), OffloadError> {
        match self {
            ShardStore::Memory(_) => Ok(()),
            ShardStore::Nvme(s) => s.flush(),
        }
    }

    /// Whether unit `unit`'s shard can be taken now without waiting for a buffer: a staging
    /// buffer is free, or the read ahead is this unit's.
    pub(crate) fn can_take(&self, unit: usize) -> bool {
        match self {
            ShardStore::Memory(_) => true,
            ShardStore::Nvme(s) => {
                s.is_resident(unit)
                    || !s.free.is_empty()
                    || s.ahead.as_ref().is_some_and(|a| a.unit == unit)
            }
        }
    }

    /// Starts reading unit `unit`'s shard on a thread of its own, to be taken by its gather (under
    /// NVMe offload, when no other read ahead is in flight and a staging buffer is free; nothing
    /// in memory).
    pub fn read_ahead(&mut self, unit: usize) {
        if let ShardStore::Nvme(s) = self {
            s.start_read_ahead(unit);
        }
    }

    /// Discards any read ahead: the shards are about to change (or be read for an update).
    pub fn settle(&mut self) {
        if let ShardStore::Nvme(s) = self {
            s.discard_read_ahead();
        }
    }

    /// A copy of unit `unit`'s shard (for checkpoints and full-parameter reads: under NVMe
    /// offload it reads through a buffer of its own, so that it needs no `&mut`). Call after
    /// [`ShardStore::flush`], which the optimizer step ends with.
    pub fn read(&self, unit: usize) -> Result<Buffer, OffloadError> {
        if let ShardStore::Nvme(s) = self {
            debug_assert!(
                s.behind.is_none(),
                "a shard read while a write is in flight"
            );
        }
        match self {
            ShardStore::Memory(v) => Ok(v[unit].clone()),
            ShardStore::Nvme(s) if s.is_resident(unit) => Ok(s.host[unit].clone()),
            ShardStore::Nvme(s) => {
                let mut b = Buffer::zeros(s.dtype, 0);
                let mut bounce = AlignedBuf::zeroed(record_words(s.dtype, s.records[unit].1));
                load_via(&s.file, s.records[unit], s.dtype, &mut b, &mut bounce)?;
                Ok(b)
            }
        }
    }

    /// Runs `f` on unit `unit`'s shard and keeps what it leaves there (read from and written back
    /// to the swap file under NVMe offload). Every shard must be home (no gather in flight).
    pub(crate) fn modify<R>(
        &mut self,
        unit: usize,
        f: impl FnOnce(&mut Buffer) -> R,
    ) -> Result<R, OffloadError> {
        let mut shard = self.take(unit)?;
        let out = f(&mut shard);
        self.put_back(unit, shard)?;
        self.flush()?;
        Ok(out)
    }

    /// Bytes read from and written to the parameter swap file so far (`(0, 0)` in memory).
    pub fn traffic(&self) -> (u64, u64) {
        match self {
            ShardStore::Memory(_) => (0, 0),
            ShardStore::Nvme(s) => s.traffic(),
        }
    }

    /// The dtype of the shards.
    pub fn dtype(&self) -> DType {
        match self {
            ShardStore::Memory(v) => v.first().map_or(DType::F32, Buffer::dtype),
            ShardStore::Nvme(s) => s.dtype,
        }
    }
}

impl Drop for SwappedShards {
    /// The read-ahead thread holds the file too: join it, so that the file is gone when the store
    /// is.
    fn drop(&mut self) {
        self.discard_read_ahead();
        // A failed write is reported by the step that made it; here only the thread is joined.
        let _ = self.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An updated shard is written behind: taking that unit again, or another unit when its
    /// staging buffer is the last one, waits for the write; the file then holds the update.
    #[test]
    fn written_behind_shards_are_read_back_updated() {
        let dir = tempfile::tempdir().unwrap();
        for staging in [1, 3] {
            let shards: Vec<Buffer> = (0..3)
                .map(|u| Buffer::from_f32(DType::F32, &vec![u as f32; 1500]))
                .collect();
            let s = SwappedShards::new(dir.path(), 0, shards, staging, 0).unwrap();
            let mut store = ShardStore::Nvme(Box::new(s));
            for round in 1..=3 {
                for u in 0..3 {
                    let mut shard = store.take(u).unwrap();
                    let want = (10 * round + u) as f32;
                    shard
                        .all_mut()
                        .copy_from(Buffer::from_f32(DType::F32, &[want; 1500]).all());
                    store.put_back(u, shard).unwrap();
                }
                // The same unit again at once: its write lands first.
                let again = store.take(2).unwrap();
                assert_eq!(again.get_f32(1499), (10 * round + 2) as f32);
                store.give_back(2, again);
                store.flush().unwrap();
                for u in 0..3 {
                    assert_eq!(store.read(u).unwrap().get_f32(7), (10 * round + u) as f32);
                }
            }
            assert!(store.can_take(0), "every staging buffer is free again");
            let record = (record_words(DType::F32, 1500) * 4) as u64;
            assert_eq!(store.traffic().1, (3 + 9) * record, "written once each");
        }
    }

    #[test]
    fn swapped_shards_round_trip_through_the_file_in_every_dtype() {
        let dir = tempfile::tempdir().unwrap();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let shards: Vec<Buffer> = [3usize, 2000, 1]
                .iter()
                .map(|&n| {
                    let v: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 7.0).collect();
                    Buffer::from_f32(dtype, &v)
                })
                .collect();
            let s = SwappedShards::new(dir.path(), 0, shards.clone(), 2, 0).unwrap();
            let mut store = ShardStore::Nvme(Box::new(s));
            for (u, want) in shards.iter().enumerate() {
                assert_eq!(&store.read(u).unwrap(), want);
            }
            // Two takes exhaust two staging buffers; giving one back frees one.
            let a = store.take(1).unwrap();
            let b = store.take(0).unwrap();
            assert_eq!((&a, &b), (&shards[1], &shards[0]));
            assert!(!store.can_take(2));
            store.give_back(1, a);
            assert!(store.can_take(2));
            store.give_back(0, b);
            // A read ahead is taken ready by its unit's fetch, and is discarded when another
            // unit needs its buffer.
            store.read_ahead(1);
            assert!(store.can_take(1));
            let a = store.take(1).unwrap();
            assert_eq!(a, shards[1]);
            store.read_ahead(0);
            assert!(!store.can_take(2) && store.can_take(0));
            let c = store.take(2).unwrap();
            assert_eq!(c, shards[2]);
            store.give_back(1, a);
            store.give_back(2, c);
            store.read_ahead(0);
            store.settle();
            assert!(store.can_take(2));
            store
                .modify(2, |b| {
                    b.all_mut().copy_from(Buffer::from_f32(dtype, &[5.0]).all())
                })
                .unwrap();
            assert_eq!(store.read(2).unwrap(), Buffer::from_f32(dtype, &[5.0]));
            assert_eq!(store.read(1).unwrap(), shards[1]);
        }
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");
    }
}
