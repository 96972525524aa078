//! The communicator contract shared by every backend (in-process threads, MPI, NCCL) and by the
//! engine that calls it.
//!
//! Buffers are passed **by value** and handed back by [`CommHandle::wait`]: the collective runs on a
//! per-rank communication thread while the caller computes, and ownership makes that overlap safe
//! without lifetimes or locks. No collective allocates a result: the caller provides every output
//! buffer up front (llm.c style), so steady-state training allocates nothing here.

use crate::flat::Buffer;
use std::fmt;
use std::sync::mpsc;
use std::time::Duration;

/// The f32 vector of a buffer a collective handed back on `rank`, which is the f32 buffer it was
/// given: a backend returning another dtype breaks the [`Communicator`] contract, and that is an
/// error, not a panic.
pub fn returned_f32(buf: Buffer, rank: usize) -> Result<Vec<f32>, CommError> {
    let dtype = buf.dtype();
    buf.into_f32().ok_or_else(|| CommError::InvalidArgument {
        rank,
        what: format!("a collective given an f32 buffer returned a {dtype:?} one"),
    })
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
    /// Within groups ([`Partition`]): chunk j of a rank's input goes to the group's member j.
    AllToAll,
}

/// How many kinds of collective there are (the length of the traffic counters' arrays).
pub const COLLECTIVE_KINDS: usize = 6;

impl CollectiveKind {
    pub(crate) const ALL: [CollectiveKind; COLLECTIVE_KINDS] = [
        CollectiveKind::AllReduce,
        CollectiveKind::ReduceScatter,
        CollectiveKind::AllGather,
        CollectiveKind::Broadcast,
        CollectiveKind::Barrier,
        CollectiveKind::AllToAll,
    ];
    /// The snake_case name used in traces, metrics and JSON (`all_reduce`, ...).
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::Barrier => "barrier",
            CollectiveKind::AllToAll => "all_to_all",
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

/// The ranks a grouped collective runs among. The world is numbered host by host (rank = host x
/// ranks per host + local rank, as `mpirun` places ranks by slot), so `Within(h)` is the ranks of
/// one host and `Across(h)` the ranks of one local rank on every host, for `h` ranks per host.
/// Every rank of the world calls a grouped collective at the same point; each group runs it on
/// its own, and a rank's shard is its index in its group (`shard_range(len, group size, index)`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum Partition {
    /// One group: the whole world.
    #[default]
    World,
    /// Groups of `h` consecutive ranks: one host's ranks.
    Within(usize),
    /// Groups of the ranks `h` apart: one local rank of every host.
    Across(usize),
}

impl Partition {
    /// Whether `world` ranks split into these groups: `h` at least 1 and dividing the world.
    pub fn fits(self, world: usize) -> bool {
        match self {
            Partition::World => true,
            Partition::Within(h) | Partition::Across(h) => h >= 1 && world % h == 0,
        }
    }
    /// Ranks in each group of a world of `world` ranks.
    pub fn group_size(self, world: usize) -> usize {
        match self {
            Partition::World => world,
            Partition::Within(h) => h,
            Partition::Across(h) => world / h.max(1),
        }
    }
    /// `rank`'s index in its group.
    pub fn index(self, rank: usize) -> usize {
        match self {
            Partition::World => rank,
            Partition::Within(h) => rank % h.max(1),
            Partition::Across(h) => rank / h.max(1),
        }
    }
    /// The world rank at index `i` of `rank`'s group.
    pub fn member(self, rank: usize, i: usize) -> usize {
        match self {
            Partition::World => i,
            Partition::Within(h) => rank / h.max(1) * h + i,
            Partition::Across(h) => rank % h.max(1) + i * h,
        }
    }
}

/// Bytes sent and received per collective kind, counted by the ring-algorithm formulas (so numbers
/// are comparable across backends): for a full buffer of B bytes, reduce-scatter and all-gather move
/// B minus this rank's shard each way, all-reduce twice that, broadcast B (received by non-roots,
/// sent by the root to each of the other ranks), barrier nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TrafficCounters {
    /// Indexed by `CollectiveKind as usize`.
    pub sent_bytes: [u64; COLLECTIVE_KINDS],
    pub recv_bytes: [u64; COLLECTIVE_KINDS],
    pub calls: [u64; COLLECTIVE_KINDS],
    /// Of `sent_bytes` and `recv_bytes`, those to and from ranks on other hosts
    /// ([`crate::comm::CommOptions::ranks_per_host`]; all zero on one host).
    #[serde(default)]
    pub inter_host_sent_bytes: [u64; COLLECTIVE_KINDS],
    #[serde(default)]
    pub inter_host_recv_bytes: [u64; COLLECTIVE_KINDS],
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
    /// Bytes sent to ranks on other hosts, every kind.
    pub fn inter_host_sent(&self) -> u64 {
        self.inter_host_sent_bytes.iter().sum()
    }
    /// Bytes received from ranks on other hosts, every kind.
    pub fn inter_host_recv(&self) -> u64 {
        self.inter_host_recv_bytes.iter().sum()
    }
    /// Adds `other`'s bytes and calls to these.
    pub fn add(&mut self, other: &TrafficCounters) {
        for i in 0..COLLECTIVE_KINDS {
            self.sent_bytes[i] += other.sent_bytes[i];
            self.recv_bytes[i] += other.recv_bytes[i];
            self.calls[i] += other.calls[i];
            self.inter_host_sent_bytes[i] += other.inter_host_sent_bytes[i];
            self.inter_host_recv_bytes[i] += other.inter_host_recv_bytes[i];
        }
    }
    /// `self - earlier`: the traffic between two snapshots (for per-step numbers).
    pub fn since(&self, earlier: &TrafficCounters) -> TrafficCounters {
        let mut d = TrafficCounters::default();
        for i in 0..COLLECTIVE_KINDS {
            d.sent_bytes[i] = self.sent_bytes[i] - earlier.sent_bytes[i];
            d.recv_bytes[i] = self.recv_bytes[i] - earlier.recv_bytes[i];
            d.calls[i] = self.calls[i] - earlier.calls[i];
            d.inter_host_sent_bytes[i] =
                self.inter_host_sent_bytes[i] - earlier.inter_host_sent_bytes[i];
            d.inter_host_recv_bytes[i] =
                self.inter_host_recv_bytes[i] - earlier.inter_host_recv_bytes[i];
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
pub(crate) type Completion = Result<Vec<Buffer>, CommError>;

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
    pub(crate) fn map_buffers(
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

    /// In-place all-gather within this rank's group of `part` ([`Partition`]): `buf` holds this
    /// rank's shard at `shard_range(len, group size, index)`; returns `[buf]` holding every
    /// shard of its group. Every rank of the world calls it at the same point. Backends that run
    /// no grouped collectives refuse partitions other than the world.
    fn all_gather_group_in_place(&self, part: Partition, buf: Buffer) -> CommHandle {
        match part.group_size(self.world_size()) == self.world_size() {
            true => self.all_gather_in_place(buf),
            false => CommHandle::ready(Err(CommError::InvalidArgument {
                rank: self.rank(),
                what: format!(
                    "this backend runs no collectives within groups of ranks ({part:?}); \
                     use the in-process or MPI backend, or turn zero_hpz_partition_size off"
                ),
            })),
        }
    }

    /// All-to-all within this rank's group of `part` ([`Partition`]): `input` and `output` hold
    /// one chunk per member of the group (equal chunks, `len / group size` elements each); chunk
    /// j of this rank's input goes to member j, and chunk j of its output receives member j's
    /// chunk for this rank (its own chunk is copied across). Returns `[input, output]` (use
    /// [`CommHandle::wait_pair`]). Every rank of the world calls it at the same point; buffers
    /// carry bytes, never reduced, so a 16-bit buffer may carry any payload. Backends that run
    /// no all-to-all refuse groups of more than one rank.
    fn all_to_all_group(&self, part: Partition, input: Buffer, mut output: Buffer) -> CommHandle {
        let same = input.len() == output.len() && input.dtype() == output.dtype();
        if part.group_size(self.world_size()) == 1 && same {
            output.write_at(0, &input);
            return CommHandle::ready(Ok(vec![input, output]));
        }
        CommHandle::ready(Err(CommError::InvalidArgument {
            rank: self.rank(),
            what: format!(
                "this backend runs no all-to-all ({part:?}); use the in-process or MPI backend, \
                 or turn zero_quantized_gradients off"
            ),
        }))
    }

    /// Ranks per host where this communicator's world spans hosts numbered host by host (as
    /// `mpirun` places ranks by slot, or as [`crate::comm::CommOptions::ranks_per_host`] says
    /// in one process); `None` on one host or where it is not known.
    fn ranks_per_host(&self) -> Option<usize> {
        None
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
