//! The embedded backend: N ranks as threads of one process, exchanging through shared memory.
//!
//! Each rank owns an [`InprocComm`] whose calls are queued to a dedicated communication thread and
//! run there in issue order, so the caller computes while collectives progress. At every collective
//! the communication threads meet at a rendezvous that publishes the addresses of their buffers;
//! each thread then reads its peers' buffers directly (no staging copies on the large-message path):
//!
//! * reduce-scatter: rank r reduces shard r of every rank's input, in rank order, into its output;
//! * all-gather: rank r pushes its shard into range r of every rank's output (its right neighbour's
//!   first), block by block, so the shard is read from memory once and written n times: per rank
//!   1/n read and 1 write of the buffer, against 1 read and 1 write for pulling every shard;
//! * all-reduce: rank r reduces shard r of every rank's buffer and writes the result into shard r of
//!   every rank's buffer, in one pass (a reduce-scatter and an all-gather fused: each byte is read
//!   once and written once, instead of the reduce-scatter's write plus the all-gather's copy);
//! * broadcast: every non-root copies the root's buffer.
//!
//! Each rank exposes an input and an output address. The in-place forms expose the same ones as
//! the out-of-place forms (for reduce-scatter: the full input and the rank's shard of it as the
//! output; for all-gather: the rank's shard as the input and the full buffer as the output), so
//! ranks may mix the two forms.
//! In-place reduce-scatter writes the reduced shard over the rank's own shard of its input (the
//! lines it has just read, so no read-for-ownership and no streaming stores); in-place all-gather
//! skips the copy of a rank's shard onto itself: per rank (n-1)/n of the buffer is written instead
//! of all of it.
//!
//! Every collective ends with a meeting after the last read of or write into a peer's buffer, so
//! buffers are only handed back once no peer can still touch them. Each element is reduced by
//! exactly one formula (rank order 0..N-1, f32 accumulation, one rounding), so every rank and every
//! run gets the same bits.

use crate::comm::queue::{account, describe, validate, Call, CommThread, Job};
use crate::comm::reduce::{
    buffer_addr, buffer_addr_mut, copy_bytes, fan_out_copy, reduce_into, Store,
};
use crate::comm::rendezvous::{Exposed, Meeting, Rendezvous, Straggler};
use crate::comm::stats::CommStats;
use crate::comm::{
    shard_range, CommError, CommHandle, CommOptions, Communicator, Completion, Partition, ReduceOp,
    TrafficCounters,
};
use crate::flat::{Buffer, DType};
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Reduce-scatter outputs of at least this many bytes are written with streaming stores: far
/// larger than a core's share of the last-level cache, they would be evicted before use anyway.
const STREAMING_STORE_BYTES: usize = 4 << 20;

/// What a rank publishes at a collective's meeting.
fn expose(input: usize, output: usize) -> Exposed {
    Exposed { input, output }
}

/// State shared by every rank of one world.
struct World {
    size: usize,
    options: CommOptions,
    rendezvous: Rendezvous,
}

/// What a rank's caller and its communication thread share.
struct RankShared {
    traffic: Mutex<TrafficCounters>,
    stats: Mutex<CommStats>,
}

/// One rank of an in-process world. Implements [`Communicator`]; dropping it lets its communication
/// thread finish the queued collectives and exit (the drop waits for that).
pub struct InprocComm {
    rank: usize,
    world: Arc<World>,
    shared: Arc<RankShared>,
    thread: CommThread<Job>,
}

impl fmt::Debug for InprocComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "InprocComm(rank {} of {})", self.rank, self.world.size)
    }
}

impl InprocComm {
    /// Creates the communicators of a world of `world_size` ranks, one per rank (index = rank), each
    /// with its communication thread running. Hand each to its own thread; if that thread fails
    /// outside a collective, call [`InprocComm::fail`] so the others stop promptly ([`run_ranks`]
    /// does all of this).
    pub fn create_world(
        world_size: usize,
        options: CommOptions,
    ) -> Result<Vec<InprocComm>, CommError> {
        if world_size == 0 {
            return Err(CommError::InvalidArgument {
                rank: 0,
                what: "world size 0: a world needs at least one rank".into(),
            });
        }
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        let world = Arc::new(World {
            size: world_size,
            rendezvous: Rendezvous::new(world_size, options.spin.resolve(world_size, cores)),
            options,
        });
        (0..world_size)
            .map(|rank| {
                let shared = Arc::new(RankShared {
                    traffic: Mutex::new(TrafficCounters::default()),
                    stats: Mutex::new(CommStats {
                        world_size,
                        ..CommStats::default()
                    }),
                });
                let (tx, rx) = mpsc::channel();
                let thread = {
                    let world = world.clone();
                    let shared = shared.clone();
                    std::thread::Builder::new()
                        .name(format!("zerodp-comm-{rank}"))
                        .spawn(move || comm_thread(world, shared, rank, rx))
                        .map_err(|e| {
                            CommError::Closed(format!(
                                "could not start the communication thread of rank {rank}: {e}"
                            ))
                        })?
                };
                Ok(InprocComm {
                    rank,
                    world: world.clone(),
                    shared,
                    thread: CommThread::new(tx, thread),
                })
            })
            .collect()
    }

    /// Marks this rank as failed: every collective that waits for it, now or later, fails promptly
    /// with [`CommError::PeerFailed`] naming this rank and `reason`.
    pub fn fail(&self, reason: impl Into<String>) {
        self.world.rendezvous.fail(self.rank, reason.into());
    }

    /// Timing statistics of this rank's collectives per op, dtype and size (always kept).
    pub fn stats(&self) -> CommStats {
        self.shared
            .stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The summary table of [`InprocComm::stats`], ready to print.
    pub fn summary(&self) -> String {
        format!("rank {}:\n{}", self.rank, self.stats().summary_table())
    }

    pub fn options(&self) -> &CommOptions {
        &self.world.options
    }

    fn submit(&self, call: Call) -> CommHandle {
        if let Err(e) = validate(&call, self.world.size, self.rank) {
            // This rank will not take part in the collective, so its peers would wait for it: fail
            // the world so that they stop promptly instead of timing out.
            self.world.rendezvous.fail(self.rank, e.to_string());
            return CommHandle::ready(Err(e));
        }
        let (done, handle) = CommHandle::channel();
        if let Err(job) = self.thread.send(Job { call, done }) {
            let _ = job.done.send(Err(CommError::Closed(format!(
                "the communication thread of rank {} has exited",
                self.rank
            ))));
        }
        handle
    }
}

impl Communicator for InprocComm {
    crate::comm::queue::queued_collectives!();
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world.size
    }
    fn report_failure(&self, reason: String) {
        self.fail(reason);
    }
    fn ranks_per_host(&self) -> Option<usize> {
        self.world.options.ranks_per_host
    }
    fn traffic(&self) -> TrafficCounters {
        self.shared
            .traffic
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// Scratch a communication thread reuses across collectives (grown, never shrunk).
#[derive(Default)]
struct Scratch {
    peers: Vec<Exposed>,
    /// The addresses one collective reads from or writes to (reduction sources, gather targets).
    addrs: Vec<usize>,
}

fn comm_thread(world: Arc<World>, shared: Arc<RankShared>, rank: usize, rx: mpsc::Receiver<Job>) {
    let mut seq: u64 = 0;
    let mut scratch = Scratch::default();
    while let Ok(job) = rx.recv() {
        let result = catch_unwind(AssertUnwindSafe(|| {
            run_one(&world, &shared, rank, seq, job.call, &mut scratch)
        }))
        .unwrap_or_else(|panic| {
            let msg = panic_message(&*panic);
            world
                .rendezvous
                .fail(rank, format!("its communication thread panicked: {msg}"));
            Err(CommError::Closed(format!(
                "the communication thread of rank {rank} panicked in collective #{seq}: {msg}"
            )))
        });
        seq += 1;
        let _ = job.done.send(result);
    }
    world.rendezvous.depart(rank, seq);
}

/// The text of a panic payload.
pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// Runs one collective and does its bookkeeping (counters, statistics, trace).
fn run_one(
    world: &World,
    shared: &RankShared,
    rank: usize,
    seq: u64,
    call: Call,
    scratch: &mut Scratch,
) -> Completion {
    let desc = describe(&call);
    let started = Instant::now();
    let meeting = Meeting {
        rank,
        seq,
        desc: &desc,
        started,
        timeout: world.options.timeout,
    };
    let mut ex = Exec {
        world,
        meeting,
        straggler: None,
        scratch,
    };
    let out = ex.execute(call)?;
    let stats = (&shared.traffic, &shared.stats);
    let at = (world.size, rank);
    account(
        stats,
        &world.options,
        at,
        seq,
        &desc,
        started.elapsed(),
        ex.straggler,
    );
    Ok(out)
}

/// One collective in progress on one rank.
struct Exec<'a> {
    world: &'a World,
    meeting: Meeting<'a>,
    straggler: Option<Straggler>,
    scratch: &'a mut Scratch,
}

impl Exec<'_> {
    /// The arrival meeting: waits for every rank (or fails: timeout, peer failure, mismatch); with
    /// `input`, publishes this rank's buffer and fills `scratch.peers` with every rank's.
    fn arrive(&mut self, exposed: Option<Exposed>) -> Result<(), CommError> {
        let threshold = self.world.options.straggler_threshold;
        let expose = exposed.map(|e| (e, &mut self.scratch.peers));
        self.straggler = self
            .world
            .rendezvous
            .meet(&self.meeting, expose, threshold)?;
        Ok(())
    }

    /// All-gather by pushing: rank r reads its shard once and writes it into range r of every
    /// rank's output (its own last, and not at all when the shard already sits there: the in-place
    /// form). Per rank that is one read of a shard and n writes of it, against n reads and n
    /// writes for pulling every shard: the least memory traffic an out-of-place all-gather can
    /// draw. `len` and `dtype` describe the full output.
    /// Within a [`Partition`]'s groups, the same among the ranks of this rank's group (every
    /// rank of the world meets).
    fn push_gather(
        &mut self,
        shard: usize,
        output: usize,
        (len, dtype): (usize, DType),
        part: Partition,
    ) -> Result<(), CommError> {
        let r = self.meeting.rank;
        let (g, me) = (part.group_size(self.world.size), part.index(r));
        let esz = dtype.size();
        let mine = shard_range(len, g, me);
        self.arrive(Some(expose(shard, output)))?;
        let departure = Departure::new(self.world, r);
        let sc = &mut *self.scratch;
        sc.addrs.clear();
        sc.addrs.extend(
            (1..=g)
                .map(|k| sc.peers[part.member(r, (me + k) % g)].output + mine.start * esz)
                .filter(|&dst| dst != shard),
        );
        let bytes = mine.len() * esz;
        let store = if bytes >= STREAMING_STORE_BYTES {
            Store::Streaming
        } else {
            Store::Cached
        };
        // SAFETY: range r of every output is written by rank r alone until the final meeting,
        // and nobody reads an output before it; the shard is only read; the meeting compared
        // descriptors, so every output holds `len` elements of `dtype`.
        unsafe { fan_out_copy(shard, &sc.addrs, bytes, store) };
        departure.finish_written_by_peers(&self.meeting)
    }

    fn execute(&mut self, call: Call) -> Completion {
        match call {
            Call::Barrier => {
                self.arrive(None)?;
                Ok(vec![])
            }
            Call::AllReduce(buf, op) => self.all_reduce(buf, op),
            Call::ReduceScatter(input, output, op) => self.reduce_scatter(input, output, op),
            Call::AllGather(input, mut output) => {
                let out = buffer_addr_mut(&mut output);
                let full = (output.len(), output.dtype());
                self.push_gather(buffer_addr(&input), out, full, Partition::World)?;
                Ok(vec![input, output])
            }
            Call::ReduceScatterInPlace(buf, op) => self.reduce_scatter_in_place(buf, op),
            Call::AllGatherInPlace(buf) => self.gather_in_place(buf, Partition::World),
            Call::AllGatherGroup(buf, part) => self.gather_in_place(buf, part),
            Call::AllToAll(input, output, part) => self.all_to_all(input, output, part),
            Call::Broadcast(buf, root) => self.broadcast(buf, root),
        }
    }

    /// All-to-all within `part`'s groups by pulling: this rank copies its chunk of every member's
    /// input into that member's chunk of its own output. Inputs are only read and each output is
    /// written by its own rank, so nothing is staged.
    fn all_to_all(&mut self, input: Buffer, mut output: Buffer, part: Partition) -> Completion {
        let r = self.meeting.rank;
        let (g, me) = (part.group_size(self.world.size), part.index(r));
        let chunk = input.bytes() / g;
        let out = buffer_addr_mut(&mut output);
        self.arrive(Some(expose(buffer_addr(&input), out)))?;
        let departure = Departure::new(self.world, r);
        for j in 0..g {
            let src = self.scratch.peers[part.member(r, j)].input + me * chunk;
            // SAFETY: inputs are only read until the final meeting; the output is this rank's
            // own, and the meeting compared descriptors, so every input holds `g` chunks.
            unsafe { copy_bytes(src, out + j * chunk, chunk) };
        }
        drop(departure);
        Ok(vec![input, output])
    }

    /// In-place all-gather within `part`'s groups: this rank's shard sits in its group's range.
    fn gather_in_place(&mut self, mut buf: Buffer, part: Partition) -> Completion {
        let (len, dtype) = (buf.len(), buf.dtype());
        let addr = buffer_addr_mut(&mut buf);
        let r = self.meeting.rank;
        let mine = shard_range(len, part.group_size(self.world.size), part.index(r));
        self.push_gather(addr + mine.start * dtype.size(), addr, (len, dtype), part)?;
        Ok(vec![buf])
    }

    /// All-reduce in place: rank r reduces shard r of every rank's buffer into all of them.
    fn all_reduce(&mut self, mut buf: Buffer, op: ReduceOp) -> Completion {
        let world = self.world;
        let n = self.world.size;
        let r = self.meeting.rank;
        let len = buf.len();
        let esz = buf.dtype().size();
        let dtype = buf.dtype();
        if n == 1 {
            // The reduction of one buffer is itself (Avg divides by 1, Max of one value).
            self.arrive(None)?;
            return Ok(vec![buf]);
        }
        let addr = buffer_addr_mut(&mut buf);
        self.arrive(Some(expose(addr, addr)))?;
        let departure = Departure::new(world, r);
        // Rank r alone owns shard r of every buffer until the final meeting: it reduces
        // shard r of all ranks block by block and writes the result back into shard r of
        // every rank's buffer (each block read before it is overwritten). One pass, one
        // read and one write of each byte, no second phase and no staging copy.
        let mine = shard_range(len, n, r);
        let addrs = self.peer_inputs_at(mine.start * esz);
        // SAFETY: until the final meeting, shard r of any buffer is touched by rank r only;
        // every buffer holds `len` elements of `dtype` (the meeting compared descriptors)
        // and lives until the final meeting.
        unsafe { reduce_into(dtype, op, addrs, addrs, mine.len(), Store::Cached) };
        departure.finish_written_by_peers(&self.meeting)?;
        Ok(vec![buf])
    }

    /// Reduce-scatter: rank r reduces shard r of every rank's input into its own output.
    fn reduce_scatter(&mut self, input: Buffer, mut output: Buffer, op: ReduceOp) -> Completion {
        let world = self.world;
        let n = self.world.size;
        let r = self.meeting.rank;
        let len = input.len();
        let esz = input.dtype().size();
        let mine = shard_range(len, n, r);
        let dst = [buffer_addr_mut(&mut output)];
        self.arrive(Some(expose(buffer_addr(&input), dst[0])))?;
        let departure = Departure::new(world, r);
        let store = if mine.len() * esz >= STREAMING_STORE_BYTES {
            Store::Streaming
        } else {
            Store::Cached
        };
        let addrs = self.peer_inputs_at(mine.start * esz);
        // SAFETY: inputs are only read until the final meeting; the output is private.
        unsafe { reduce_into(input.dtype(), op, addrs, &dst, mine.len(), store) };
        drop(departure);
        Ok(vec![input, output])
    }

    /// Reduce-scatter in place: rank r reduces shard r of every buffer into its own shard r.
    fn reduce_scatter_in_place(&mut self, mut buf: Buffer, op: ReduceOp) -> Completion {
        let world = self.world;
        let n = self.world.size;
        let r = self.meeting.rank;
        let len = buf.len();
        let esz = buf.dtype().size();
        let dtype = buf.dtype();
        let mine = shard_range(len, n, r);
        let addr = buffer_addr_mut(&mut buf);
        self.arrive(Some(expose(addr, addr + mine.start * esz)))?;
        let departure = Departure::new(world, r);
        let dst = [addr + mine.start * esz];
        let addrs = self.peer_inputs_at(mine.start * esz);
        // SAFETY: until the final meeting, shard r of every buffer is read by rank r only
        // and written by nobody else (peers write only their own shard of their own
        // buffer); the destination is exactly this rank's source, which the kernel allows.
        unsafe { reduce_into(dtype, op, addrs, &dst, mine.len(), Store::Cached) };
        drop(departure);
        Ok(vec![buf])
    }

    /// The address `offset` bytes into every rank's exposed input, in rank order (in the reused
    /// scratch list: no allocation per collective).
    fn peer_inputs_at(&mut self, offset: usize) -> &[usize] {
        let sc = &mut *self.scratch;
        sc.addrs.clear();
        sc.addrs.extend(sc.peers.iter().map(|p| p.input + offset));
        &sc.addrs
    }

    /// Broadcast: every rank but `root` copies the root's buffer.
    fn broadcast(&mut self, mut buf: Buffer, root: usize) -> Completion {
        let world = self.world;
        let r = self.meeting.rank;
        let bytes = buf.bytes();
        let addr = buffer_addr_mut(&mut buf);
        self.arrive(Some(expose(addr, addr)))?;
        let departure = Departure::new(world, r);
        if r != root {
            // SAFETY: the root's buffer is only read until the final meeting.
            unsafe { copy_bytes(self.scratch.peers[root].input, addr, bytes) };
        }
        drop(departure);
        Ok(vec![buf])
    }
}

/// The final meeting of a collective, held when this guard drops: after its arrival, a rank's
/// buffers are read and written by its peers, so it must not hand them back (or free them) before
/// every peer has finished with them. The final meeting therefore ignores timeouts and failures:
/// every rank that passed the arrival is in its data phase, which never blocks, so it always comes.
/// If this rank panics in its data phase, the guard still meets (before the unwinding frees the
/// buffers) and marks the world failed.
struct Departure<'a> {
    rendezvous: &'a Rendezvous,
    rank: usize,
}

impl<'a> Departure<'a> {
    fn new(world: &'a World, rank: usize) -> Departure<'a> {
        Departure {
            rendezvous: &world.rendezvous,
            rank,
        }
    }

    /// Holds the final meeting of a collective in which peers write parts of this rank's result
    /// (all-reduce, all-gather), then fails if the world failed meanwhile: a peer that panicked in
    /// its data phase may have left its part unwritten, and a result with a hole must not be handed
    /// back as if whole.
    fn finish_written_by_peers(self, m: &Meeting<'_>) -> Result<(), CommError> {
        let rendezvous = self.rendezvous;
        drop(self);
        rendezvous.check(m)
    }
}

impl Drop for Departure<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.rendezvous.fail(
                self.rank,
                "its communication thread panicked inside a collective".into(),
            );
        }
        self.rendezvous.depart_collective(self.rank);
    }
}

/// Why one rank of [`run_ranks`] failed.
#[derive(Debug)]
pub enum RankFailure<E> {
    /// The rank's function returned this error.
    Error(E),
    /// The rank's function panicked with this message.
    Panic(String),
}

impl<E: fmt::Display> fmt::Display for RankFailure<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RankFailure::Error(e) => write!(f, "{e}"),
            RankFailure::Panic(m) => write!(f, "panicked: {m}"),
        }
    }
}

/// At least one rank of [`run_ranks`] failed.
#[derive(Debug)]
pub struct RanksError<E> {
    /// The rank that failed first (the root cause; the others usually failed because of it).
    pub first_failed: usize,
    /// Every failed rank, in rank order.
    pub failures: Vec<(usize, RankFailure<E>)>,
}

impl<E> RanksError<E> {
    /// The root cause: the first failed rank's failure.
    pub fn first(&self) -> &RankFailure<E> {
        &self
            .failures
            .iter()
            .find(|(r, _)| *r == self.first_failed)
            .expect("first_failed is among failures")
            .1
    }
}

/// `rank 3` or `ranks 0, 1, 2`.
fn rank_list(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
    match ranks.len() {
        1 => format!("rank {}", list[0]),
        _ => format!("ranks {}", list.join(", ")),
    }
}

/// Each distinct message once, with the ranks that failed with it: the root cause's first
/// (`ranks 0, 1, 2, 3 failed (rank 2 first): X`, `rank 2 failed: X`), then the others in rank
/// order (` (then rank 1: Y; ranks 0, 3: Z)`). Ranks often fail alike (every rank sees the same
/// non-finite gradients), and one message per rank would only repeat it.
impl<E: fmt::Display> fmt::Display for RanksError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
        for (rank, e) in &self.failures {
            let message = e.to_string();
            match groups.iter_mut().find(|(m, _)| *m == message) {
                Some((_, ranks)) => ranks.push(*rank),
                None => groups.push((message, vec![*rank])),
            }
        }
        let root = self.first().to_string();
        let alone = [self.first_failed];
        let ranks = groups
            .iter()
            .find(|(m, _)| *m == root)
            .map_or(&alone[..], |(_, ranks)| ranks);
        if ranks.len() == 1 {
            write!(f, "rank {} failed: {root}", self.first_failed)?;
        } else {
            write!(
                f,
                "{} failed (rank {} first): {root}",
                rank_list(ranks),
                self.first_failed
            )?;
        }
        let others: Vec<String> = groups
            .iter()
            .filter(|(m, _)| *m != root)
            .map(|(m, ranks)| format!("{}: {m}", rank_list(ranks)))
            .collect();
        if !others.is_empty() {
            write!(f, " (then {})", others.join("; "))?;
        }
        Ok(())
    }
}

impl<E: fmt::Display + fmt::Debug> std::error::Error for RanksError<E> {}

/// Runs `f(comm, rank)` on `world_size` threads, one per rank of a fresh in-process world, and
/// returns the results in rank order. A rank whose function returns an error or panics marks the
/// world failed at once, so the other ranks' collectives fail promptly with
/// [`CommError::PeerFailed`] naming it instead of waiting for the timeout; the error returned then
/// lists every failed rank and which failed first.
///
/// The `Arc<InprocComm>` can be cloned into other threads of the rank or coerced to
/// `Arc<dyn Communicator>`.
///
/// ```
/// use zerodp::comm::{run_ranks, CommError, CommOptions, Communicator, ReduceOp};
/// use zerodp::flat::Buffer;
///
/// let sums = run_ranks(4, CommOptions::default(), |comm, rank| {
///     let grads = Buffer::F32(vec![rank as f32; 1000]);
///     let handle = comm.all_reduce(grads, ReduceOp::Sum); // returns at once
///     // ... compute here while the collective runs ...
///     let summed = handle.wait_one()?;
///     Ok::<_, CommError>(summed.get_f32(999))
/// })
/// .unwrap();
/// assert_eq!(sums, vec![6.0; 4]);
/// ```
pub fn run_ranks<T, E, F>(
    world_size: usize,
    options: CommOptions,
    f: F,
) -> Result<Vec<T>, RanksError<E>>
where
    T: Send,
    E: fmt::Display + Send + From<CommError>,
    F: Fn(Arc<InprocComm>, usize) -> Result<T, E> + Sync,
{
    let comms = match InprocComm::create_world(world_size, options) {
        Ok(c) => c,
        Err(e) => {
            return Err(RanksError {
                first_failed: 0,
                failures: vec![(0, RankFailure::Error(E::from(e)))],
            })
        }
    };
    run_threads(comms.into_iter().map(Arc::new).collect(), f)
}

/// [`run_ranks`] on communicators the caller made, one thread per rank: `comms[r]` must be rank
/// `r` of one world (NCCL's group of one rank per GPU, `crate::comm::NcclComm::group`, with the
/// `cuda` feature). A rank that fails is reported to the others through
/// [`Communicator::report_failure`] (a backend that cannot tell them leaves them to its own
/// timeout or failure).
pub fn run_ranks_on<T, E, F>(
    comms: Vec<Arc<dyn Communicator>>,
    f: F,
) -> Result<Vec<T>, RanksError<E>>
where
    T: Send,
    E: fmt::Display + Send + From<CommError>,
    F: Fn(Arc<dyn Communicator>, usize) -> Result<T, E> + Sync,
{
    let world = comms.len();
    if let Some(r) = (0..world).find(|&r| comms[r].rank() != r || comms[r].world_size() != world) {
        let e = CommError::InvalidArgument {
            rank: r,
            what: format!(
                "the communicator at place {r} is rank {} of {}, not rank {r} of {world}: give \
                 one communicator per rank of one world, in rank order",
                comms[r].rank(),
                comms[r].world_size()
            ),
        };
        return Err(RanksError {
            first_failed: r,
            failures: vec![(r, RankFailure::Error(E::from(e)))],
        });
    }
    run_threads(comms, f)
}

/// One thread per communicator, rank r's running `f(comms[r], r)`; see [`run_ranks`].
fn run_threads<C, T, E, F>(comms: Vec<Arc<C>>, f: F) -> Result<Vec<T>, RanksError<E>>
where
    C: Communicator + ?Sized,
    T: Send,
    E: fmt::Display + Send + From<CommError>,
    F: Fn(Arc<C>, usize) -> Result<T, E> + Sync,
{
    let world_size = comms.len();
    // Order in which ranks failed, to name the root cause.
    let order = Mutex::new(Vec::<usize>::new());
    let outcomes: Vec<Result<T, RankFailure<E>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let f = &f;
                let order = &order;
                let rank = comm.rank();
                std::thread::Builder::new()
                    .name(format!("zerodp-rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        let out = catch_unwind(AssertUnwindSafe(|| f(comm.clone(), rank)));
                        let out = match out {
                            Ok(Ok(v)) => Ok(v),
                            Ok(Err(e)) => Err(RankFailure::Error(e)),
                            Err(p) => Err(RankFailure::Panic(panic_message(&*p))),
                        };
                        if let Err(e) = &out {
                            order.lock().unwrap_or_else(|e| e.into_inner()).push(rank);
                            comm.report_failure(match e {
                                RankFailure::Error(e) => format!("it returned an error: {e}"),
                                RankFailure::Panic(m) => format!("it panicked: {m}"),
                            });
                        }
                        out
                    })
                    .expect("spawn a rank thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|p| Err(RankFailure::Panic(panic_message(&*p))))
            })
            .collect()
    });
    let order = order.into_inner().unwrap_or_else(|e| e.into_inner());
    let mut results = Vec::with_capacity(world_size);
    let mut failures = Vec::new();
    for (rank, o) in outcomes.into_iter().enumerate() {
        match o {
            Ok(v) => results.push(v),
            Err(e) => failures.push((rank, e)),
        }
    }
    if failures.is_empty() {
        Ok(results)
    } else {
        Err(RanksError {
            first_failed: order.first().copied().unwrap_or(failures[0].0),
            failures,
        })
    }
}
