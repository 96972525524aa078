//! The communicator contract shared by every backend (in-process threads, MPI, NCCL) and by the
//! engine that calls it.
//!
//! Buffers are passed **by value** and handed back by [`CommHandle::wait`]: the collective runs on a
//! per-rank communication thread while the caller computes, and ownership makes that overlap safe
//! without lifetimes or locks. No collective allocates a result: the caller provides every output
//! buffer up front (llm.c style), so steady-state training allocates nothing here.

use half::{bf16, f16};
use std::fmt;
use std::sync::mpsc;
use std::time::Duration;

/// Element type of a communication buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    BF16,
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An owned, typed communication buffer.
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
pub fn zeroed_vec<T: bytemuck::Zeroable + Clone>(len: usize) -> Vec<T> {
    // `alloc_zeroed` (calloc): a large block is fresh mmap'd memory, not yet touched.
    let v: Vec<T> = bytemuck::allocation::zeroed_vec(len);
    advise_huge_pages(&v);
    v
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
    /// The f32 vector of a buffer a collective handed back on `rank`, which is the f32 buffer it
    /// was given: a backend returning another dtype breaks the [`Communicator`] contract, and that
    /// is an error, not a panic.
    pub fn into_returned_f32(self, rank: usize) -> Result<Vec<f32>, CommError> {
        let dtype = self.dtype();
        self.into_f32().ok_or_else(|| CommError::InvalidArgument {
            rank,
            what: format!("a collective given an f32 buffer returned a {dtype:?} one"),
        })
    }
    pub fn as_f32(&self) -> Option<&[f32]> {
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
    /// Element `i` widened to f32 (for tests and small reads; not for hot loops).
    pub fn get_f32(&self, i: usize) -> f32 {
        match self {
            Buffer::F32(v) => v[i],
            Buffer::BF16(v) => v[i].to_f32(),
            Buffer::F16(v) => v[i].to_f32(),
        }
    }
}

/// Reduction applied by `all_reduce` and `reduce_scatter`. 16-bit inputs are accumulated in f32 and
/// rounded once (round to nearest even) at the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the world size.
    Avg,
    Max,
}

/// The kinds of collective, used to key traffic counters and traces.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveKind {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    Barrier,
}

impl CollectiveKind {
    pub const ALL: [CollectiveKind; 5] = [
        CollectiveKind::AllReduce,
        CollectiveKind::ReduceScatter,
        CollectiveKind::AllGather,
        CollectiveKind::Broadcast,
        CollectiveKind::Barrier,
    ];
    /// The snake_case name used in traces, metrics and JSON (`all_reduce`, ...).
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::Barrier => "barrier",
        }
    }
}

impl fmt::Display for CollectiveKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The half-open element range `[start, end)` of a buffer of `len` elements that rank `rank` of
/// `world` owns in `reduce_scatter` and contributes in `all_gather`. Contiguous, in rank order; the
/// first `len % world` ranks get one element more (as `torch.tensor_split`). The engine pads its flat
/// buffers to a multiple of the world size, so there every shard is equal.
pub fn shard_range(len: usize, world: usize, rank: usize) -> std::ops::Range<usize> {
    assert!(
        world > 0 && rank < world,
        "rank {rank} out of world {world}"
    );
    let base = len / world;
    let extra = len % world;
    let start = rank * base + rank.min(extra);
    let size = base + usize::from(rank < extra);
    start..start + size
}

/// Bytes sent and received per collective kind, counted by the ring-algorithm formulas (so numbers
/// are comparable across backends): for a full buffer of B bytes, reduce-scatter and all-gather move
/// B minus this rank's shard each way, all-reduce twice that, broadcast B (received by non-roots,
/// sent by the root to each of the other ranks), barrier nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TrafficCounters {
    /// Indexed by `CollectiveKind as usize`.
    pub sent_bytes: [u64; 5],
    pub recv_bytes: [u64; 5],
    pub calls: [u64; 5],
}

impl TrafficCounters {
    pub fn sent(&self, kind: CollectiveKind) -> u64 {
        self.sent_bytes[kind as usize]
    }
    pub fn recv(&self, kind: CollectiveKind) -> u64 {
        self.recv_bytes[kind as usize]
    }
    pub fn calls(&self, kind: CollectiveKind) -> u64 {
        self.calls[kind as usize]
    }
    pub fn total_sent(&self) -> u64 {
        self.sent_bytes.iter().sum()
    }
    pub fn total_recv(&self) -> u64 {
        self.recv_bytes.iter().sum()
    }
    /// `self - earlier`: the traffic between two snapshots (for per-step numbers).
    pub fn since(&self, earlier: &TrafficCounters) -> TrafficCounters {
        let mut d = TrafficCounters::default();
        for i in 0..5 {
            d.sent_bytes[i] = self.sent_bytes[i] - earlier.sent_bytes[i];
            d.recv_bytes[i] = self.recv_bytes[i] - earlier.recv_bytes[i];
            d.calls[i] = self.calls[i] - earlier.calls[i];
        }
        d
    }
}

/// Why a collective failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommError {
    #[error(
        "collective timed out: {op} (sequence #{seq}) on rank {rank} waited {waited:?}; \
         ranks that arrived: {arrived:?}; ranks that did not: {missing:?}. \
         Raise the timeout with ZERODP_TIMEOUT=<seconds> or --timeout if this is expected"
    )]
    Timeout {
        op: CollectiveKind,
        seq: u64,
        rank: usize,
        waited: Duration,
        arrived: Vec<usize>,
        missing: Vec<usize>,
    },
    #[error("rank {failed_rank} failed ({reason}); rank {rank} stopped at {op} (sequence #{seq})")]
    PeerFailed {
        rank: usize,
        failed_rank: usize,
        reason: String,
        op: CollectiveKind,
        seq: u64,
    },
    #[error(
        "collective mismatch at sequence #{seq}: rank {rank} called {mine} but rank {other_rank} \
         called {theirs}; every rank must issue the same collectives, with the same sizes and dtypes, \
         in the same order"
    )]
    Mismatch {
        seq: u64,
        rank: usize,
        mine: String,
        other_rank: usize,
        theirs: String,
    },
    #[error("invalid collective call on rank {rank}: {what}")]
    InvalidArgument { rank: usize, what: String },
    /// A handle waited on for a number of buffers its collective does not return.
    #[error("{call} expects a collective that returns {want} buffer(s), this one returned {got} (wait on a barrier with `wait()`)")]
    WrongBufferCount {
        call: &'static str,
        want: usize,
        got: usize,
    },
    #[error("communicator shut down: {0}")]
    Closed(String),
}

/// The result of a finished collective: the caller's buffers handed back in the order they were
/// given (`all_reduce`/`broadcast` and the in-place forms: `[buf]`; `reduce_scatter`/`all_gather`:
/// `[input, output]`; `barrier`: `[]`).
pub type Completion = Result<Vec<Buffer>, CommError>;

/// A function applied to a completion's buffers (see [`CommHandle::map_buffers`]).
type MapBuffers = Box<dyn FnOnce(Vec<Buffer>) -> Vec<Buffer> + Send>;

/// A collective in flight. Dropping a handle without waiting is allowed (the buffers are dropped when
/// the collective finishes) but loses its error.
#[must_use = "a collective's result and buffers come back through wait()"]
pub struct CommHandle {
    rx: mpsc::Receiver<Completion>,
    /// Applied to the buffers of a successful completion before `wait` returns them (how a
    /// fallback built from another collective hands back the buffers its own contract promises).
    then: Option<MapBuffers>,
}

impl CommHandle {
    /// A handle and the sender that completes it (used by backends).
    pub fn channel() -> (mpsc::Sender<Completion>, CommHandle) {
        let (tx, rx) = mpsc::channel();
        (tx, CommHandle { rx, then: None })
    }
    /// This handle with `f` applied to the returned buffers when the collective succeeds (after any
    /// function given earlier). Does not block.
    pub fn map_buffers(
        mut self,
        f: impl FnOnce(Vec<Buffer>) -> Vec<Buffer> + Send + 'static,
    ) -> CommHandle {
        self.then = Some(match self.then.take() {
            None => Box::new(f),
            Some(g) => Box::new(move |b| f(g(b))),
        });
        self
    }
    /// A handle that is already complete (used by backends for trivial cases and errors).
    pub fn ready(result: Completion) -> CommHandle {
        let (tx, h) = CommHandle::channel();
        let _ = tx.send(result);
        h
    }
    /// Block until the collective finishes; returns the buffers.
    pub fn wait(self) -> Completion {
        let done = self
            .rx
            .recv()
            .unwrap_or_else(|_| Err(CommError::Closed("communication thread exited".into())));
        match self.then {
            Some(f) => done.map(f),
            None => done,
        }
    }
    /// For single-buffer collectives (`all_reduce`, `broadcast`). A collective that returned a
    /// different number of buffers (a `barrier` returns none) is an error, not a panic.
    pub fn wait_one(self) -> Result<Buffer, CommError> {
        let v = self.wait()?;
        match <[Buffer; 1]>::try_from(v) {
            Ok([one]) => Ok(one),
            Err(v) => Err(CommError::WrongBufferCount {
                call: "wait_one",
                want: 1,
                got: v.len(),
            }),
        }
    }
    /// For two-buffer collectives (`reduce_scatter`, `all_gather`): `(input, output)`.
    pub fn wait_pair(self) -> Result<(Buffer, Buffer), CommError> {
        let v = self.wait()?;
        match <[Buffer; 2]>::try_from(v) {
            Ok([input, output]) => Ok((input, output)),
            Err(v) => Err(CommError::WrongBufferCount {
                call: "wait_pair",
                want: 2,
                got: v.len(),
            }),
        }
    }
}

/// A group of ranks that run collectives together. Every call is enqueued on this rank's
/// communication thread in issue order and returns at once; all ranks must issue the same sequence
/// of collectives (same kinds, lengths and dtypes).
///
/// Shapes: for a full buffer of `len` elements, rank `r` owns `shard_range(len, world, r)`.
/// * `all_reduce(buf)`: every rank ends with the reduction of all ranks' `buf`.
/// * `reduce_scatter(input, output)`: `input.len() == len`, `output.len()` == this rank's shard;
///   `output` receives the reduction of every rank's shard `r` of `input`.
/// * `all_gather(input, output)`: `input` is this rank's shard, `output.len() == len`.
/// * `broadcast(buf, root)`: every rank ends with root's `buf`.
///
/// In-place variants (NCCL's in-place all-gather, `sendbuff == recvbuff + rank * count`, and
/// in-place reduce-scatter, `recvbuff == sendbuff + rank * recvcount`) work on one full-size buffer:
/// * `all_gather_in_place(buf)`: the caller has written its shard into `shard_range(len, world,
///   rank)` of `buf`; afterwards `buf` holds every rank's shard.
/// * `reduce_scatter_in_place(buf, op)`: afterwards this rank's `shard_range` of `buf` holds the
///   reduced shard, bit-identical to `reduce_scatter`'s output; the rest of `buf` is unspecified.
///
/// Both hand back `[buf]` (use [`CommHandle::wait_one`]), count the same traffic as their
/// out-of-place forms and match them at the rendezvous (ranks may mix the two forms). The default
/// implementations call the out-of-place collective and copy the shard (one allocation); a backend
/// that can reduce or gather straight into the buffer overrides them.
///
/// Results are deterministic: bit-identical on every rank and every run for the same inputs.
pub trait Communicator: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    fn all_reduce(&self, buf: Buffer, op: ReduceOp) -> CommHandle;
    fn reduce_scatter(&self, input: Buffer, output: Buffer, op: ReduceOp) -> CommHandle;
    fn all_gather(&self, input: Buffer, output: Buffer) -> CommHandle;
    fn broadcast(&self, buf: Buffer, root: usize) -> CommHandle;
    fn barrier(&self) -> CommHandle;
    /// Cumulative traffic of this rank since the communicator was created.
    fn traffic(&self) -> TrafficCounters;

    /// Tells the other ranks that this rank failed outside a collective (its own code returned an
    /// error or panicked) and will not issue more: their waiting collectives fail promptly with
    /// [`CommError::PeerFailed`] naming this rank and `reason`, instead of timing out.
    fn report_failure(&self, reason: String) {
        let _ = reason;
    }

    /// In-place all-gather (see the trait docs): `buf` holds this rank's shard in its
    /// `shard_range`; returns `[buf]` holding every shard.
    fn all_gather_in_place(&self, buf: Buffer) -> CommHandle {
        let mine = shard_range(buf.len(), self.world_size(), self.rank());
        let shard = buf.copy_range(mine);
        self.all_gather(shard, buf)
            .map_buffers(|mut bufs| vec![bufs.swap_remove(1)])
    }

    /// In-place reduce-scatter (see the trait docs): returns `[buf]` whose `shard_range` for this
    /// rank holds the reduced shard.
    fn reduce_scatter_in_place(&self, buf: Buffer, op: ReduceOp) -> CommHandle {
        let mine = shard_range(buf.len(), self.world_size(), self.rank());
        let output = Buffer::zeros(buf.dtype(), mine.len());
        self.reduce_scatter(buf, output, op)
            .map_buffers(move |mut bufs| {
                let output = bufs.swap_remove(1);
                let mut buf = bufs.swap_remove(0);
                buf.write_at(mine.start, &output);
                vec![buf]
            })
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
            // Only a kernel whose THP mode is `madvise` or `always` can honour the advice.
            if mode.is_ok_and(|m| !m.contains("[never]")) {
                let middle = big.as_ptr() as usize + HUGE_PAGE_MIN_BYTES * 2;
                assert_eq!(thp_eligible(middle), Some(true), "f32 buffer not advised");
            }
        }
    }
}
