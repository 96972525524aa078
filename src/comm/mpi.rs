//! The MPI backend (cargo feature `mpi`): one rank per process, started by `mpirun` (or any MPI
//! launcher), with the same collectives, dtypes, in-place forms, determinism, traces and byte
//! counters as the in-process backend.
//!
//! # Threads
//! [`MpiComm::init`] starts the backend's communication thread, which initialises MPI
//! (`MPI_THREAD_SERIALIZED`: only that thread ever calls MPI), serves the collectives in issue
//! order and finalises MPI when the communicator is dropped. Open MPI makes no progress outside MPI
//! calls, so a collective runs to its end on that thread while the caller computes: the overlap
//! the engine relies on.
//!
//! # Determinism: the same bits as the in-process backend
//! Reductions are never left to MPI (whose reduction order depends on the algorithm and the
//! message size). A reduce-scatter is built from point-to-point messages: rank r receives every
//! peer's part of shard r, then reduces the n parts **in rank order with the in-process backend's
//! kernel** ([`crate::comm::reduce`]: f32 accumulation, one rounding for bf16/f16, the same
//! per-element formula). An all-reduce is that reduce-scatter followed by an all-gather. So every
//! rank, every run and both backends produce the same bits.
//!
//! # Two paths
//! When every rank is on this host and a collective's buffers are in shared memory (large ones
//! are, through [`crate::comm::mpi_shm::ShmAlloc`]), the ranks run the in-process backend's
//! algorithms on each other's buffers mapped into their address space: zero copies, and only the
//! arrival and a departure exchange through MPI ([`crate::comm::mpi_shm`] says why not staging or
//! `process_vm_readv`). Otherwise the bytes travel as MPI point-to-point messages, composed as
//! follows, except between two ranks of the same host when the world spans hosts: those
//! (`Engine::near`) read each other's parts in place and copy results straight into each
//! other's buffers inside the same reduce-scatter and all-gather, and end with the departure
//! exchange of the shared-memory path. Measured at 1 GiB f32 on this 2-vCPU VM under other jobs' load (busbw GB/s, `bench
//! comm`, in-process and MPI runs back to back, 22:50 UTC):
//!
//! | world | path | all_reduce | reduce_scatter (in-place) | all_gather (in-place) |
//! | --- | --- | --- | --- | --- |
//! | 2 | in-process | 10.8 | 4.9 (6.2) | 4.7 (7.6) |
//! | 2 | MPI, shared memory | 6.6 | 3.2 (3.6) | 4.1 (7.3) |
//! | 2 | Open MPI's own | 0.93 | 0.20 | 1.75 |
//! | 4 | in-process | 5.8 | 3.3 (3.8) | 4.3 (5.1) |
//! | 4 | MPI, shared memory | 4.9 | 2.3 (2.7) | 4.3 (5.4) |
//! | 4 | Open MPI's own | 0.38 | 0.23 | 1.40 |
//!
//! All-gathers (copies into peers' buffers) match the in-process backend; reductions reach 60-85%
//! of it (not yet explained: the kernels, the stores and the meetings are the same; CPU binding
//! makes no difference). Earlier runs under heavier load had the MPI backend ahead.
//!
//! # Compositions of the message path, and why
//! * reduce-scatter: point-to-point, because of determinism above; it is also faster than
//!   Open MPI's own `MPI_Reduce_scatter_block`, which measured slower than a whole all-reduce on
//!   this machine kind (0.4 GB/s busbw against 1.1-1.4, reference §2a).
//! * all-reduce: reduce-scatter + all-gather (not `MPI_Allreduce`, whose summation order is not
//!   rank order).
//! * all-gather: point-to-point (every rank sends its shard to every other): the same code serves
//!   the in-place form (the safe API has no `MPI_IN_PLACE`), and at the world sizes measured it
//!   moves the bytes of a ring; `bench comm --raw-mpi` prints `MPI_Allgather` next to it.
//! * broadcast: `MPI_Ibcast` (order does not matter, and MPI's trees beat sending from the root).
//! * barrier: the arrival exchange every collective starts with (below).
//!
//! # Arrival, mismatches, timeouts, failures
//! Every collective starts with each rank sending its call's descriptor (sequence number, op,
//! dtype, length, reduction, root) to every peer. A rank proceeds when it has every peer's; if
//! they differ it fails with [`CommError::Mismatch`] showing both calls. Every wait polls
//! non-blocking requests (busy for the configured spin, then yielding, then sleeping briefly),
//! so a collective past the timeout fails with [`CommError::Timeout`] naming the op, its
//! sequence number and the ranks whose messages never came. A rank whose own code fails calls
//! [`Communicator::report_failure`], which sends the reason to every peer: their waits fail with
//! [`CommError::PeerFailed`] naming it. A rank whose process dies (killed) cannot send anything:
//! when every rank is on one host, waiting ranks check their peers' process ids every 50 ms and
//! fail naming the dead rank; across hosts `mpirun` notices the death, names the rank and
//! terminates the job.
//!
//! After any failure the communicator is poisoned (every later call fails with the same error)
//! and MPI is not finalised (`MPI_Finalize` could wait for a dead peer): the process should exit
//! non-zero, and `mpirun` then ends the job.

use crate::comm::mpi_shm::{region_of, PeerMaps, RegionRef};
use crate::comm::queue::{account, describe, validate, Call, CommThread, Job};
use crate::comm::reduce::fan_out_copy;
use crate::comm::reduce::{buffer_addr, buffer_addr_mut, copy_bytes, reduce_into, Store};
use crate::comm::rendezvous::CallDesc;
use crate::comm::stats::CommStats;
use crate::comm::{
    shard_range, CollectiveKind, CommError, CommHandle, CommOptions, Communicator, Completion,
    Partition, ReduceOp, TrafficCounters,
};
use crate::flat::{Buffer, DType};
use ::mpi::ffi;
use std::ffi::c_void;
use std::fmt;
use std::os::raw::c_int;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// Tag of the descriptor every collective starts with.
const TAG_DESC: c_int = 11;
/// Tag of collective payloads.
const TAG_DATA: c_int = 12;
/// Tag of a failure notice (a rank's reason, UTF-8, at most [`REASON_BYTES`]).
const TAG_FAIL: c_int = 13;
const REASON_BYTES: usize = 1024;
/// Largest single message: counts are C ints.
const MAX_MSG: usize = 1 << 30;
/// Bytes of a rank's shard reduced per round of a reduce-scatter: bounds the staging memory at
/// (n-1) pieces and overlaps receiving the next piece with reducing this one.
const PIECE_BYTES: usize = 8 << 20;
/// Words of a collective's descriptor: what must match ([`MATCH_WORDS`]), then the process id
/// and where its buffers live for the shared-memory path (input and output: fd, region id, region
/// length, offset; `u64::MAX` for none).
const DESC_WORDS: usize = 16;
/// The leading descriptor words every rank must present equally.
const MATCH_WORDS: usize = 7;
/// Tag of the departure messages of a shared-memory collective.
const TAG_DONE: c_int = 14;
/// Peers' mappings kept at most: beyond this the cache is emptied at the next collective
/// (mappings of freed buffers would otherwise keep their memory alive).
const MAX_PEER_MAPS: usize = 64;

/// Where this rank sits: global rank and size, and the processes sharing its host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MpiTopology {
    pub rank: usize,
    pub size: usize,
    /// Ranks on this rank's host (`MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`).
    pub local_size: usize,
    pub local_rank: usize,
    /// Distinct hosts in the job.
    pub hosts: usize,
    /// Ranks are numbered host by host, equally many on every host (rank = host x `local_size`
    /// plus `local_rank`, as `mpirun` places them by slot): what collectives within a host or
    /// across hosts ([`crate::comm::Partition`]) and the inter-host byte counts assume.
    pub host_major: bool,
}

impl MpiTopology {
    /// Ranks per host for [`CommOptions::ranks_per_host`]: where the job spans hosts numbered
    /// host by host.
    pub fn ranks_per_host(&self) -> Option<usize> {
        (self.hosts > 1 && self.host_major).then_some(self.local_size)
    }
}

/// What the caller's side and the communication thread share.
struct Shared {
    traffic: Mutex<TrafficCounters>,
    stats: Mutex<CommStats>,
    /// A failure reason to send to every peer, set by `report_failure`; the thread sends it.
    failure_notice: Mutex<Option<String>>,
    poisoned: AtomicBool,
    /// Collectives that exchanged with at least one peer through shared memory.
    shm_calls: AtomicU64,
}

enum Msg {
    Job(Job),
    /// Times MPI's own collective (for `bench comm --raw-mpi`).
    Raw(RawJob),
    /// Sends the failure notice (already stored) now.
    Notify,
}

/// A timing of one of MPI's own collectives on f32 buffers.
struct RawJob {
    kind: CollectiveKind,
    bytes: usize,
    warmup: usize,
    iters: usize,
    done: mpsc::Sender<Result<Vec<f64>, CommError>>,
}

/// One rank of an MPI world; see the [module docs](self). At most one per process.
pub struct MpiComm {
    topo: MpiTopology,
    options: CommOptions,
    shared: Arc<Shared>,
    thread: CommThread<Msg>,
}

impl fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "MpiComm(rank {} of {}, {} on this host)",
            self.topo.rank, self.topo.size, self.topo.local_size
        )
    }
}

impl MpiComm {
    /// Initialises MPI on a new communication thread and returns this process's rank of
    /// `MPI_COMM_WORLD`. Fails if MPI was already initialised in this process.
    pub fn init(options: CommOptions) -> Result<MpiComm, CommError> {
        let shared = Arc::new(Shared {
            traffic: Mutex::new(TrafficCounters::default()),
            stats: Mutex::new(CommStats::default()),
            failure_notice: Mutex::new(None),
            poisoned: AtomicBool::new(false),
            shm_calls: AtomicU64::new(0),
        });
        let (tx, rx) = mpsc::channel::<Msg>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<MpiTopology, CommError>>();
        let thread = {
            let shared = shared.clone();
            let options = options.clone();
            std::thread::Builder::new()
                .name("zerodp-mpi".into())
                .spawn(move || comm_thread(options, shared, rx, ready_tx))
                .map_err(|e| {
                    CommError::Closed(format!("could not start the MPI communication thread: {e}"))
                })?
        };
        let topo = ready_rx.recv().unwrap_or_else(|_| {
            Err(CommError::Closed(
                "the MPI communication thread exited during initialisation".into(),
            ))
        })?;
        shared
            .stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .world_size = topo.size;
        let mut options = options;
        options.ranks_per_host = topo.ranks_per_host();
        Ok(MpiComm {
            topo,
            options,
            shared,
            thread: CommThread::new(tx, thread),
        })
    }

    pub fn topology(&self) -> MpiTopology {
        self.topo
    }
    pub fn options(&self) -> &CommOptions {
        &self.options
    }
    /// Timing statistics of this rank's collectives per op, dtype and size.
    pub fn stats(&self) -> CommStats {
        self.shared
            .stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
    /// Collectives so far that exchanged with at least one peer through shared memory (the rest
    /// used MPI messages only): shows which path a world's collectives take.
    pub fn shared_memory_calls(&self) -> u64 {
        self.shared.shm_calls.load(Ordering::Relaxed)
    }

    /// The summary table of [`MpiComm::stats`].
    pub fn summary(&self) -> String {
        format!("rank {}:\n{}", self.topo.rank, self.stats().summary_table())
    }

    /// Times MPI's own collective (`MPI_Allreduce`, `MPI_Reduce_scatter_block`, `MPI_Allgather`,
    /// `MPI_Bcast` from rank 0, on f32 with `MPI_SUM`) on a full tensor of `bytes`: `iters`
    /// timings after `warmup` untimed calls, each behind an `MPI_Barrier`, as this rank saw them.
    /// For comparison with zerodp's compositions (`bench comm --raw-mpi`); every rank must call
    /// it with the same arguments, between collectives.
    pub fn raw_collective_times(
        &self,
        kind: CollectiveKind,
        bytes: usize,
        warmup: usize,
        iters: usize,
    ) -> Result<Vec<f64>, CommError> {
        let (done, rx) = mpsc::channel();
        self.thread
            .send(Msg::Raw(RawJob {
                kind,
                bytes,
                warmup,
                iters,
                done,
            }))
            .map_err(|_| CommError::Closed("the MPI communication thread has exited".into()))?;
        rx.recv().unwrap_or_else(|_| {
            Err(CommError::Closed(
                "the MPI communication thread exited".into(),
            ))
        })
    }

    fn submit(&self, call: Call) -> CommHandle {
        if let Err(e) = validate(&call, self.topo.size, self.topo.rank) {
            self.report_failure(e.to_string());
            return CommHandle::ready(Err(e));
        }
        let (done, handle) = CommHandle::channel();
        if let Err(Msg::Job(job)) = self.thread.send(Msg::Job(Job { call, done })) {
            let _ = job.done.send(Err(CommError::Closed(
                "the MPI communication thread has exited".into(),
            )));
        }
        handle
    }
}

impl Communicator for MpiComm {
    crate::comm::queue::queued_collectives!();
    fn rank(&self) -> usize {
        self.topo.rank
    }
    fn world_size(&self) -> usize {
        self.topo.size
    }
    fn ranks_per_host(&self) -> Option<usize> {
        self.topology().ranks_per_host()
    }
    fn traffic(&self) -> TrafficCounters {
        self.shared
            .traffic
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
    /// Sends `reason` to every peer (their waits fail naming this rank) and poisons this
    /// communicator.
    fn report_failure(&self, reason: String) {
        // A rank that failed because of a collective's failure (a dead, failed or late peer)
        // has nothing new to tell: its peers see that failure themselves.
        if self.shared.poisoned.load(Ordering::SeqCst) {
            return;
        }
        let mut notice = self
            .shared
            .failure_notice
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if notice.is_none() {
            *notice = Some(reason);
            drop(notice);
            let _ = self.thread.send(Msg::Notify);
        }
    }
}

/// One `c_int` reduced with `op` over `comm` (start-up queries only).
///
/// # Safety
/// MPI is initialised and `comm` is a live communicator this thread may use.
unsafe fn all_reduce_int(
    value: c_int,
    op: ffi::MPI_Op,
    comm: ffi::MPI_Comm,
) -> Result<c_int, CommError> {
    let mut out: c_int = 0;
    check(
        ffi::MPI_Allreduce(
            &value as *const c_int as *const c_void,
            &mut out as *mut c_int as *mut c_void,
            1,
            ffi::RSMPI_INT32_T,
            op,
            comm,
        ),
        "MPI_Allreduce",
    )?;
    Ok(out)
}

/// Checks an MPI return code.
fn check(rc: c_int, what: &str) -> Result<(), CommError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(CommError::Closed(format!(
            "{what} failed with MPI error {rc}"
        )))
    }
}

/// The communication thread's state: the only place MPI is called from.
struct Engine {
    topo: MpiTopology,
    options: CommOptions,
    shared: Arc<Shared>,
    world: ffi::MPI_Comm,
    spin: Duration,
    /// The pre-posted receive of a failure notice from any peer.
    fail_req: ffi::MPI_Request,
    fail_buf: Box<[u8; REASON_BYTES]>,
    /// The first failure; every later collective fails with it.
    failure: Option<CommError>,
    /// Reused staging of a reduce-scatter: one piece per rank.
    staging: Vec<u8>,
    reqs: Vec<ffi::MPI_Request>,
    /// For each request in `reqs`: the peer, and whether it is a receive.
    req_peer: Vec<(usize, bool)>,
    /// Whether shared memory may be used between the ranks of this host (more than one rank
    /// here, `ZERODP_SHM` not 0).
    shm: bool,
    /// For every rank: whether it runs on this host (its process ids and memory mean something
    /// here).
    local: Vec<bool>,
    /// For every rank at the current collective: whether this rank exchanges with it through
    /// shared memory (a local rank whose buffers are shared) rather than MPI messages.
    near: Vec<bool>,
    peer_maps: PeerMaps,
    /// Every rank's descriptor at the current collective (own at this rank's index).
    descs: Vec<[u64; DESC_WORDS]>,
    /// Every rank's process id (checked for local ranks only).
    pids: Vec<u64>,
    last_liveness: Instant,
}

fn comm_thread(
    options: CommOptions,
    shared: Arc<Shared>,
    rx: mpsc::Receiver<Msg>,
    ready: mpsc::Sender<Result<MpiTopology, CommError>>,
) {
    let Some((universe, _threading)) =
        ::mpi::initialize_with_threading(::mpi::Threading::Serialized)
    else {
        let _ = ready.send(Err(CommError::Closed(
            "MPI is already initialised in this process: create one MpiComm per process".into(),
        )));
        return;
    };
    let mut engine = match Engine::new(options, shared.clone()) {
        Ok(e) => e,
        Err(e) => {
            let _ = ready.send(Err(e));
            std::mem::forget(universe);
            return;
        }
    };
    let _ = ready.send(Ok(engine.topo));
    let mut seq: u64 = 0;
    while let Ok(msg) = rx.recv() {
        match msg {
            Msg::Notify => engine.send_failure_notice(),
            Msg::Raw(job) => {
                let _ = job.done.send(engine.raw_times(&job));
            }
            Msg::Job(job) => {
                let result = catch_unwind(AssertUnwindSafe(|| engine.run_one(seq, job.call)))
                    .unwrap_or_else(|p| {
                        let msg = crate::comm::inproc::panic_message(&*p);
                        Err(engine.poison(CommError::Closed(format!(
                            "the MPI communication thread of rank {} panicked in collective \
                             #{seq}: {msg}",
                            engine.topo.rank
                        ))))
                    });
                seq += 1;
                let _ = job.done.send(result);
            }
        }
    }
    if engine.failure.is_some() || shared.failure_notice.lock().map_or(true, |n| n.is_some()) {
        // A peer may be dead or stuck: MPI_Finalize could wait for it forever. The process is
        // expected to exit non-zero, which makes mpirun end the job.
        std::mem::forget(universe);
    } else {
        // SAFETY: the pending receive of a failure notice must not outlive MPI.
        unsafe {
            ffi::MPI_Cancel(&mut engine.fail_req);
            ffi::MPI_Request_free(&mut engine.fail_req);
        }
        drop(universe);
    }
}

impl Engine {
    fn new(options: CommOptions, shared: Arc<Shared>) -> Result<Engine, CommError> {
        // SAFETY: plain MPI queries on the world communicator, MPI being initialised.
        unsafe {
            let world = ffi::RSMPI_COMM_WORLD;
            let (mut rank, mut size) = (0, 0);
            check(ffi::MPI_Comm_rank(world, &mut rank), "MPI_Comm_rank")?;
            check(ffi::MPI_Comm_size(world, &mut size), "MPI_Comm_size")?;
            let mut local: ffi::MPI_Comm = std::mem::zeroed();
            check(
                ffi::MPI_Comm_split_type(
                    world,
                    ffi::RSMPI_COMM_TYPE_SHARED,
                    rank,
                    ffi::RSMPI_INFO_NULL,
                    &mut local,
                ),
                "MPI_Comm_split_type",
            )?;
            let (mut local_rank, mut local_size) = (0, 0);
            check(ffi::MPI_Comm_rank(local, &mut local_rank), "MPI_Comm_rank")?;
            check(ffi::MPI_Comm_size(local, &mut local_size), "MPI_Comm_size")?;
            let leader: c_int = c_int::from(local_rank == 0);
            let hosts = all_reduce_int(leader, ffi::RSMPI_SUM, world)?;
            // A host's name: the lowest world rank on it.
            let host = all_reduce_int(rank, ffi::RSMPI_MIN, local)?;
            ffi::MPI_Comm_free(&mut local);
            // Every rank's process id (to tell a dead local peer from a slow one while waiting)
            // and host.
            let me = [u64::from(std::process::id()), host as u64];
            let mut ids = vec![0u64; 2 * size as usize];
            check(
                ffi::MPI_Allgather(
                    me.as_ptr() as *const c_void,
                    2,
                    ffi::RSMPI_UINT64_T,
                    ids.as_mut_ptr() as *mut c_void,
                    2,
                    ffi::RSMPI_UINT64_T,
                    world,
                ),
                "MPI_Allgather",
            )?;
            let pids: Vec<u64> = ids.iter().step_by(2).copied().collect();
            let local: Vec<bool> = ids.iter().skip(1).step_by(2).map(|&h| h == me[1]).collect();
            // Every rank's host is named by its lowest rank: host by host means rank k's is
            // k rounded down to a multiple of the ranks per host (the same test on every rank).
            let per_host = (local_size as u64).max(1);
            let host_major = (size as u64) % per_host == 0
                && ids
                    .iter()
                    .skip(1)
                    .step_by(2)
                    .enumerate()
                    .all(|(k, &h)| h == k as u64 / per_host * per_host);
            let topo = MpiTopology {
                rank: rank as usize,
                size: size as usize,
                local_size: local_size as usize,
                local_rank: local_rank as usize,
                hosts: hosts as usize,
                host_major,
            };
            let mut options = options;
            options.ranks_per_host = topo.ranks_per_host();
            let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
            let spin = options.spin.resolve(topo.local_size, cores);
            let mut e = Engine {
                topo,
                options,
                shared,
                world,
                spin,
                fail_req: ffi::RSMPI_REQUEST_NULL,
                fail_buf: Box::new([0u8; REASON_BYTES]),
                failure: None,
                staging: Vec::new(),
                reqs: Vec::new(),
                req_peer: Vec::new(),
                shm: topo.local_size > 1
                    && std::env::var("ZERODP_SHM").map_or(true, |v| v.trim() != "0"),
                near: vec![false; topo.size],
                local,
                peer_maps: PeerMaps::default(),
                descs: Vec::new(),
                pids,
                last_liveness: Instant::now(),
            };
            check(
                ffi::MPI_Irecv(
                    e.fail_buf.as_mut_ptr() as *mut c_void,
                    REASON_BYTES as c_int,
                    ffi::RSMPI_UINT8_T,
                    ffi::RSMPI_ANY_SOURCE,
                    TAG_FAIL,
                    world,
                    &mut e.fail_req,
                ),
                "MPI_Irecv",
            )?;
            Ok(e)
        }
    }

    /// Records `e` as the world's failure (the first one wins) and returns the error to hand back.
    fn poison(&mut self, e: CommError) -> CommError {
        self.shared.poisoned.store(true, Ordering::SeqCst);
        if self.failure.is_none() {
            self.failure = Some(e.clone());
        }
        e
    }

    /// See [`MpiComm::raw_collective_times`].
    fn raw_times(&mut self, job: &RawJob) -> Result<Vec<f64>, CommError> {
        let n = self.topo.size;
        let count = job.bytes / 4;
        let shard = count / n;
        if count % n != 0 || count > i32::MAX as usize {
            return Err(CommError::InvalidArgument {
                rank: self.topo.rank,
                what: format!(
                    "raw MPI timing of {} bytes: needs a multiple of {n} f32 elements below 2^31",
                    job.bytes
                ),
            });
        }
        let a = vec![1.0f32 + self.topo.rank as f32; count];
        let mut b = vec![0.0f32; count];
        let mut times = Vec::with_capacity(job.iters);
        for i in 0..job.warmup + job.iters {
            // SAFETY: blocking MPI calls on this thread's own vectors, sized as the counts say.
            unsafe {
                check(ffi::MPI_Barrier(self.world), "MPI_Barrier")?;
                let t0 = Instant::now();
                let (src, dst) = (a.as_ptr() as *const c_void, b.as_mut_ptr() as *mut c_void);
                let f = ffi::RSMPI_FLOAT;
                let rc = match job.kind {
                    CollectiveKind::AllReduce => {
                        ffi::MPI_Allreduce(src, dst, count as c_int, f, ffi::RSMPI_SUM, self.world)
                    }
                    CollectiveKind::ReduceScatter => ffi::MPI_Reduce_scatter_block(
                        src,
                        dst,
                        shard as c_int,
                        f,
                        ffi::RSMPI_SUM,
                        self.world,
                    ),
                    CollectiveKind::AllGather => ffi::MPI_Allgather(
                        src,
                        shard as c_int,
                        f,
                        dst,
                        shard as c_int,
                        f,
                        self.world,
                    ),
                    CollectiveKind::Broadcast => {
                        ffi::MPI_Bcast(dst, count as c_int, f, 0, self.world)
                    }
                    CollectiveKind::Barrier => ffi::MPI_Barrier(self.world),
                    CollectiveKind::AllToAll => ffi::MPI_Alltoall(
                        src,
                        shard as c_int,
                        f,
                        dst,
                        shard as c_int,
                        f,
                        self.world,
                    ),
                };
                check(rc, "raw MPI collective")?;
                if i >= job.warmup {
                    times.push(t0.elapsed().as_secs_f64());
                }
            }
        }
        Ok(times)
    }

    /// Sends this rank's failure reason to every peer, waiting at most a second for the sends.
    fn send_failure_notice(&mut self) {
        let reason = self
            .shared
            .failure_notice
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_default();
        let mut bytes = reason.into_bytes();
        bytes.truncate(REASON_BYTES);
        let bytes = Box::leak(bytes.into_boxed_slice());
        let mut reqs = Vec::new();
        for peer in (0..self.topo.size).filter(|&p| p != self.topo.rank) {
            // SAFETY: the leaked buffer outlives the send.
            unsafe {
                let mut r = ffi::RSMPI_REQUEST_NULL;
                ffi::MPI_Isend(
                    bytes.as_ptr() as *const c_void,
                    bytes.len() as c_int,
                    ffi::RSMPI_UINT8_T,
                    peer as c_int,
                    TAG_FAIL,
                    self.world,
                    &mut r,
                );
                reqs.push(r);
            }
        }
        let until = Instant::now() + Duration::from_secs(1);
        while Instant::now() < until {
            let mut flag = 0;
            // SAFETY: valid requests of this thread.
            unsafe {
                ffi::MPI_Testall(
                    reqs.len() as c_int,
                    reqs.as_mut_ptr(),
                    &mut flag,
                    ffi::RSMPI_STATUSES_IGNORE,
                )
            };
            if flag != 0 {
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        self.shared.poisoned.store(true, Ordering::SeqCst);
    }

    fn run_one(&mut self, seq: u64, call: Call) -> Completion {
        if let Some(f) = &self.failure {
            return Err(f.clone());
        }
        let desc = describe(&call);
        let started = Instant::now();
        let out = match self.execute(seq, &desc, started, call) {
            Ok(out) => out,
            Err(e) => return Err(self.poison(e)),
        };
        let stats = (&self.shared.traffic, &self.shared.stats);
        let at = (self.topo.size, self.topo.rank);
        account(
            stats,
            &self.options,
            at,
            seq,
            &desc,
            started.elapsed(),
            None,
        );
        Ok(out)
    }

    fn execute(&mut self, seq: u64, desc: &CallDesc, started: Instant, call: Call) -> Completion {
        let w = Wait {
            seq,
            kind: desc.kind,
            started,
        };
        let (n, r) = (self.topo.size, self.topo.rank);
        let (input, output) = exposed(&call);
        let region = |x: Option<(usize, usize)>| x.and_then(|(a, b)| region_of(a, b));
        let (in_ref, out_ref) = match self.shm {
            true => (region(input), region(output)),
            false => (None, None),
        };
        self.arrive(&w, desc, in_ref, out_ref)?;
        self.near.fill(false);
        if self.shm && self.all_shared(desc) {
            let every_rank_here = self.topo.local_size == n;
            let mixed = !matches!(
                desc.kind,
                CollectiveKind::Barrier | CollectiveKind::Broadcast
            );
            if every_rank_here || mixed {
                for k in (0..n).filter(|&k| k != r) {
                    self.near[k] = self.local[k];
                }
            }
            if every_rank_here {
                return self.shm_execute(&w, call);
            }
        }
        let out = self.message_execute(&w, call)?;
        match self.near.iter().any(|&x| x) {
            true => self.depart(&w, out),
            false => Ok(out),
        }
    }

    /// The message path: MPI point-to-point with every peer, except those in `Engine::near`,
    /// with which this rank exchanges through shared memory inside the same algorithm.
    fn message_execute(&mut self, w: &Wait, call: Call) -> Completion {
        let (n, r) = (self.topo.size, self.topo.rank);
        if n == 1 {
            return Ok(match call {
                Call::Barrier => vec![],
                Call::AllReduce(b, _)
                | Call::ReduceScatterInPlace(b, _)
                | Call::AllGatherInPlace(b)
                | Call::AllGatherGroup(b, _)
                | Call::Broadcast(b, _) => vec![b],
                Call::ReduceScatter(i, mut o, op) => {
                    self.reduce_scatter(
                        w,
                        buffer_addr(&i),
                        buffer_addr_mut(&mut o),
                        i.len(),
                        i.dtype(),
                        op,
                    )
                    .map_err(|e| self.leak_on(e, vec![]))?;
                    vec![i, o]
                }
                Call::AllGather(i, mut o) | Call::AllToAll(i, mut o, _) => {
                    // SAFETY: distinct buffers, `i` is the whole of `o` here.
                    unsafe { copy_bytes(buffer_addr(&i), buffer_addr_mut(&mut o), i.bytes()) };
                    vec![i, o]
                }
            });
        }
        match call {
            Call::Barrier => Ok(vec![]),
            Call::AllReduce(mut buf, op) => {
                let (len, dtype) = (buf.len(), buf.dtype());
                let addr = buffer_addr_mut(&mut buf);
                let mine = shard_range(len, n, r);
                let res = self
                    .reduce_scatter(w, addr, addr + mine.start * dtype.size(), len, dtype, op)
                    .and_then(|()| self.all_gather(w, addr, (len, dtype), IN_AT, Partition::World));
                match res {
                    Ok(()) => Ok(vec![buf]),
                    Err(e) => Err(self.leak_on(e, vec![buf])),
                }
            }
            Call::ReduceScatter(input, mut output, op) => {
                let res = self.reduce_scatter(
                    w,
                    buffer_addr(&input),
                    buffer_addr_mut(&mut output),
                    input.len(),
                    input.dtype(),
                    op,
                );
                match res {
                    Ok(()) => Ok(vec![input, output]),
                    Err(e) => Err(self.leak_on(e, vec![input, output])),
                }
            }
            Call::ReduceScatterInPlace(mut buf, op) => {
                let (len, dtype) = (buf.len(), buf.dtype());
                let addr = buffer_addr_mut(&mut buf);
                let mine = shard_range(len, n, r);
                match self.reduce_scatter(w, addr, addr + mine.start * dtype.size(), len, dtype, op)
                {
                    Ok(()) => Ok(vec![buf]),
                    Err(e) => Err(self.leak_on(e, vec![buf])),
                }
            }
            Call::AllGather(input, mut output) => {
                let (len, dtype) = (output.len(), output.dtype());
                let out = buffer_addr_mut(&mut output);
                let mine = shard_range(len, n, r);
                // SAFETY: the input is this rank's shard and the output holds `len` elements.
                unsafe {
                    copy_bytes(
                        buffer_addr(&input),
                        out + mine.start * dtype.size(),
                        input.bytes(),
                    )
                };
                match self.all_gather(w, out, (len, dtype), OUT_AT, Partition::World) {
                    Ok(()) => Ok(vec![input, output]),
                    Err(e) => Err(self.leak_on(e, vec![input, output])),
                }
            }
            Call::AllGatherInPlace(buf) => self.gather_in_place(w, buf, Partition::World),
            Call::AllGatherGroup(buf, part) => self.gather_in_place(w, buf, part),
            Call::AllToAll(input, mut output, part) => {
                let (bytes, out) = (input.bytes(), buffer_addr_mut(&mut output));
                match self.all_to_all(w, buffer_addr(&input), out, bytes, part) {
                    Ok(()) => Ok(vec![input, output]),
                    Err(e) => Err(self.leak_on(e, vec![input, output])),
                }
            }
            Call::Broadcast(mut buf, root) => {
                let bytes = buf.bytes();
                let addr = buffer_addr_mut(&mut buf);
                match self.broadcast(w, addr, bytes, root) {
                    Ok(()) => Ok(vec![buf]),
                    Err(e) => Err(self.leak_on(e, vec![buf])),
                }
            }
        }
    }

    /// The message path's in-place all-gather within `part`'s groups.
    fn gather_in_place(&mut self, w: &Wait, mut buf: Buffer, part: Partition) -> Completion {
        let (len, dtype) = (buf.len(), buf.dtype());
        let addr = buffer_addr_mut(&mut buf);
        match self.all_gather(w, addr, (len, dtype), OUT_AT, part) {
            Ok(()) => Ok(vec![buf]),
            Err(e) => Err(self.leak_on(e, vec![buf])),
        }
    }

    /// Whether every buffer the shared-memory algorithm of `desc` reads or writes in a peer on
    /// this host is in a shared region (decided from the descriptors of every rank here, so they
    /// all decide alike).
    fn all_shared(&self, desc: &CallDesc) -> bool {
        let has = |d: &[u64; DESC_WORDS], at: usize| d[at] != u64::MAX;
        let mut here = self.descs.iter().zip(&self.local).filter(|(_, l)| **l);
        match desc.kind {
            CollectiveKind::Barrier => false,
            CollectiveKind::AllReduce
            | CollectiveKind::ReduceScatter
            | CollectiveKind::AllToAll => here.all(|(d, _)| has(d, IN_AT)),
            CollectiveKind::AllGather => here.all(|(d, _)| has(d, OUT_AT)),
            CollectiveKind::Broadcast => {
                let root = desc.root.unwrap_or(0);
                has(&self.descs[root], IN_AT)
            }
        }
    }

    /// The local address of rank `k`'s input (`at = IN_AT`) or output (`OUT_AT`) this collective.
    /// Every rank's input buffer `offset` bytes in, in rank order: this rank's at `own`, the
    /// peers' as mapped here.
    fn rank_addrs(
        &mut self,
        own: usize,
        offset: usize,
        addrs: &mut Vec<usize>,
    ) -> Result<(), CommError> {
        for k in 0..self.topo.size {
            let a = match k == self.topo.rank {
                true => own,
                false => self.peer_addr(k, IN_AT)?,
            };
            addrs.push(a + offset);
        }
        Ok(())
    }

    fn peer_addr(&mut self, k: usize, at: usize) -> Result<usize, CommError> {
        let d = self.descs[k];
        let r = RegionRef {
            fd: d[at] as i32,
            id: d[at + 1],
            len: d[at + 2] as usize,
            offset: d[at + 3] as usize,
        };
        self.peer_maps
            .resolve(k, d[PID_AT] as u32, r)
            .map_err(|what| CommError::InvalidArgument {
                rank: self.topo.rank,
                what,
            })
    }

    /// The shared-memory path: the in-process backend's algorithms on peers' buffers mapped into
    /// this process, then a departure exchange so no buffer is handed back while a peer may still
    /// read or write it.
    fn shm_execute(&mut self, w: &Wait, call: Call) -> Completion {
        let (n, r) = (self.topo.size, self.topo.rank);
        let mut addrs = Vec::with_capacity(n);
        let out = match call {
            Call::Barrier => vec![],
            Call::AllReduce(mut buf, op) => {
                let (len, dtype) = (buf.len(), buf.dtype());
                let esz = dtype.size();
                let mine = shard_range(len, n, r);
                let own = buffer_addr_mut(&mut buf);
                self.rank_addrs(own, mine.start * esz, &mut addrs)?;
                // SAFETY: until the departure, shard r of every rank's buffer is read and written
                // by rank r alone (the arrival compared descriptors: every buffer holds `len`
                // elements of `dtype`); each block is read before it is overwritten.
                unsafe { reduce_into(dtype, op, &addrs, &addrs, mine.len(), Store::Cached) };
                vec![buf]
            }
            Call::ReduceScatter(input, mut output, op) => {
                let (len, dtype) = (input.len(), input.dtype());
                let esz = dtype.size();
                let mine = shard_range(len, n, r);
                self.rank_addrs(buffer_addr(&input), mine.start * esz, &mut addrs)?;
                let store = if mine.len() * esz >= STREAMING_STORE_BYTES {
                    Store::Streaming
                } else {
                    Store::Cached
                };
                let dst = [buffer_addr_mut(&mut output)];
                // SAFETY: inputs are only read until the departure; the output is private.
                unsafe { reduce_into(dtype, op, &addrs, &dst, mine.len(), store) };
                vec![input, output]
            }
            Call::ReduceScatterInPlace(mut buf, op) => {
                let (len, dtype) = (buf.len(), buf.dtype());
                let esz = dtype.size();
                let mine = shard_range(len, n, r);
                let own = buffer_addr_mut(&mut buf);
                self.rank_addrs(own, mine.start * esz, &mut addrs)?;
                let dst = [own + mine.start * esz];
                // SAFETY: shard r of every buffer is read by rank r only and written by nobody
                // else until the departure; the destination is exactly this rank's own source.
                unsafe { reduce_into(dtype, op, &addrs, &dst, mine.len(), Store::Cached) };
                vec![buf]
            }
            Call::AllGather(input, mut output) => {
                let full = (output.len(), output.dtype());
                let own = buffer_addr_mut(&mut output);
                self.shm_push(buffer_addr(&input), own, full, Partition::World, &mut addrs)?;
                vec![input, output]
            }
            Call::AllGatherInPlace(buf) => self.shm_gather(buf, Partition::World, &mut addrs)?,
            Call::AllGatherGroup(buf, part) => self.shm_gather(buf, part, &mut addrs)?,
            Call::AllToAll(input, mut output, part) => {
                let out = buffer_addr_mut(&mut output);
                self.all_to_all(w, buffer_addr(&input), out, input.bytes(), part)?;
                vec![input, output]
            }
            Call::Broadcast(mut buf, root) => {
                if r != root {
                    let src = self.peer_addr(root, IN_AT)?;
                    // SAFETY: the root's buffer is only read until the departure.
                    unsafe { copy_bytes(src, buffer_addr_mut(&mut buf), buf.bytes()) };
                }
                vec![buf]
            }
        };
        self.depart(w, out)
    }

    /// The shared-memory path's in-place all-gather within `part`'s groups.
    fn shm_gather(
        &mut self,
        mut buf: Buffer,
        part: Partition,
        addrs: &mut Vec<usize>,
    ) -> Result<Vec<Buffer>, CommError> {
        let (len, dtype) = (buf.len(), buf.dtype());
        let own = buffer_addr_mut(&mut buf);
        let mine = shard_range(
            len,
            part.group_size(self.topo.size),
            part.index(self.topo.rank),
        );
        let shard = own + mine.start * dtype.size();
        self.shm_push(shard, own, (len, dtype), part, addrs)?;
        Ok(vec![buf])
    }

    /// The departure of a collective that used shared memory: an empty message to and from every
    /// near peer, so that no buffer is handed back while one of them may still read or write it.
    fn depart(&mut self, w: &Wait, out: Vec<crate::flat::Buffer>) -> Completion {
        self.shared.shm_calls.fetch_add(1, Ordering::Relaxed);
        // Every write into a peer's buffer happens before this rank's departure messages.
        std::sync::atomic::fence(Ordering::SeqCst);
        for k in 0..self.topo.size {
            if self.near[k] {
                self.post_recv(0, 0, k, TAG_DONE)?;
                self.post_send(0, 0, k, TAG_DONE)?;
            }
        }
        if let Err(e) = self.wait_all(w) {
            // A peer may still be writing into these buffers.
            std::mem::forget(out);
            return Err(e);
        }
        std::sync::atomic::fence(Ordering::SeqCst);
        Ok(out)
    }

    /// All-gather by pushing, as in-process: this rank's shard into its range of every rank's
    /// output (its right neighbour's first; not onto itself when already in place).
    /// Within a [`Partition`]'s groups, into the outputs of this rank's group.
    fn shm_push(
        &mut self,
        shard: usize,
        own_out: usize,
        (len, dtype): (usize, DType),
        part: Partition,
        addrs: &mut Vec<usize>,
    ) -> Result<(), CommError> {
        let r = self.topo.rank;
        let (g, me) = (part.group_size(self.topo.size), part.index(r));
        let esz = dtype.size();
        let mine = shard_range(len, g, me);
        for j in 1..=g {
            let k = part.member(r, (me + j) % g);
            let base = if k == r {
                own_out
            } else {
                self.peer_addr(k, OUT_AT)?
            };
            let dst = base + mine.start * esz;
            if dst != shard {
                addrs.push(dst);
            }
        }
        let bytes = mine.len() * esz;
        let store = if bytes >= STREAMING_STORE_BYTES {
            Store::Streaming
        } else {
            Store::Cached
        };
        // SAFETY: range r of every output is written by rank r alone until the departure, and
        // nobody reads an output before it; the shard is only read.
        unsafe { fan_out_copy(shard, addrs, bytes, store) };
        Ok(())
    }

    /// A collective failed with requests possibly still pointing into `buffers`: MPI may write
    /// into them later, so they are leaked rather than freed (the world is failed; the process is
    /// about to exit).
    fn leak_on(&mut self, e: CommError, buffers: Vec<crate::flat::Buffer>) -> CommError {
        if !self.reqs.is_empty() || self.near.iter().any(|&x| x) {
            std::mem::forget(buffers);
            std::mem::forget(std::mem::take(&mut self.staging));
            self.reqs.clear();
            self.req_peer.clear();
        }
        e
    }

    /// The arrival: sends this call's descriptor to every peer and waits for theirs; fails with a
    /// mismatch when one differs, with a timeout naming the ranks that did not come.
    fn arrive(
        &mut self,
        w: &Wait,
        desc: &CallDesc,
        input: Option<RegionRef>,
        output: Option<RegionRef>,
    ) -> Result<(), CommError> {
        let (n, r) = (self.topo.size, self.topo.rank);
        if n == 1 {
            return Ok(());
        }
        if self.peer_maps.len() > MAX_PEER_MAPS {
            self.peer_maps = PeerMaps::default();
        }
        let mut mine = Box::new([u64::MAX; DESC_WORDS]);
        mine[..MATCH_WORDS].copy_from_slice(&encode(w.seq, desc));
        mine[PID_AT] = u64::from(std::process::id());
        for (at, reg) in [(IN_AT, input), (OUT_AT, output)] {
            if let Some(g) = reg {
                mine[at..at + 4].copy_from_slice(&[
                    g.fd as u64,
                    g.id,
                    g.len as u64,
                    g.offset as u64,
                ]);
            }
        }
        let mut theirs = vec![[0u64; DESC_WORDS]; n];
        for peer in (0..n).filter(|&p| p != r) {
            self.post_recv(
                theirs[peer].as_mut_ptr() as usize,
                DESC_WORDS * 8,
                peer,
                TAG_DESC,
            )?;
            self.post_send(mine.as_ptr() as usize, DESC_WORDS * 8, peer, TAG_DESC)?;
        }
        if let Err(e) = self.wait_all(w) {
            // The descriptors live on this frame: keep them alive for MPI.
            std::mem::forget(theirs);
            std::mem::forget(mine);
            self.reqs.clear();
            self.req_peer.clear();
            return Err(e);
        }
        for (peer, t) in theirs.iter().enumerate().filter(|&(p, _)| p != r) {
            if t[..MATCH_WORDS] != mine[..MATCH_WORDS] {
                return Err(CommError::Mismatch {
                    seq: w.seq,
                    rank: r,
                    mine: format!("{desc} (sequence #{})", w.seq),
                    other_rank: peer,
                    theirs: decode(t),
                });
            }
        }
        theirs[r] = *mine;
        self.descs = theirs;
        Ok(())
    }

    fn post_send(
        &mut self,
        addr: usize,
        bytes: usize,
        peer: usize,
        tag: c_int,
    ) -> Result<(), CommError> {
        self.post(addr, bytes, peer, tag, false)
    }
    fn post_recv(
        &mut self,
        addr: usize,
        bytes: usize,
        peer: usize,
        tag: c_int,
    ) -> Result<(), CommError> {
        self.post(addr, bytes, peer, tag, true)
    }

    /// Posts a send or receive of `bytes` at `addr`, split into messages of at most [`MAX_MSG`]
    /// (messages between two ranks on one tag arrive in order).
    fn post(
        &mut self,
        addr: usize,
        bytes: usize,
        peer: usize,
        tag: c_int,
        recv: bool,
    ) -> Result<(), CommError> {
        let mut off = 0;
        loop {
            let m = MAX_MSG.min(bytes - off);
            let mut req = null_request();
            // SAFETY: the caller keeps `addr..addr+bytes` valid (and, for receives, unaliased)
            // until the request completes or the buffer is leaked.
            let rc = unsafe {
                if recv {
                    ffi::MPI_Irecv(
                        (addr + off) as *mut c_void,
                        m as c_int,
                        ffi::RSMPI_UINT8_T,
                        peer as c_int,
                        tag,
                        self.world,
                        &mut req,
                    )
                } else {
                    ffi::MPI_Isend(
                        (addr + off) as *const c_void,
                        m as c_int,
                        ffi::RSMPI_UINT8_T,
                        peer as c_int,
                        tag,
                        self.world,
                        &mut req,
                    )
                }
            };
            check(rc, if recv { "MPI_Irecv" } else { "MPI_Isend" })?;
            self.reqs.push(req);
            self.req_peer.push((peer, recv));
            off += m;
            if off >= bytes {
                return Ok(());
            }
        }
    }

    /// Waits for every posted request: busy for the spin, then yielding, then sleeping 100 us
    /// between polls after 10 ms; fails on a peer's failure notice or past the timeout.
    fn wait_all(&mut self, w: &Wait) -> Result<(), CommError> {
        let deadline = w.started + self.options.timeout;
        let begun = Instant::now();
        let mut done = vec![false; self.reqs.len()];
        let mut remaining = self.reqs.len();
        let mut indices = vec![0 as c_int; self.reqs.len()];
        while remaining > 0 {
            let mut outcount: c_int = 0;
            // SAFETY: `reqs` are live requests of this thread; completed ones are set to null by
            // MPI and ignored on later calls.
            let rc = unsafe {
                ffi::MPI_Testsome(
                    self.reqs.len() as c_int,
                    self.reqs.as_mut_ptr(),
                    &mut outcount,
                    indices.as_mut_ptr(),
                    ffi::RSMPI_STATUSES_IGNORE,
                )
            };
            check(rc, "MPI_Testsome")?;
            if outcount > 0 {
                for &i in &indices[..outcount as usize] {
                    done[i as usize] = true;
                }
                remaining -= outcount as usize;
                continue;
            }
            if outcount < 0 {
                // MPI_UNDEFINED: no active request left.
                break;
            }
            self.check_failure_notice(w)?;
            let now = Instant::now();
            if now - begun > Duration::from_millis(10)
                && now - self.last_liveness > Duration::from_millis(50)
            {
                self.last_liveness = now;
                self.check_peers_alive(w, &done)?;
            }
            if now >= deadline {
                let mut missing: Vec<usize> = self
                    .req_peer
                    .iter()
                    .zip(&done)
                    .filter(|((_, recv), d)| *recv && !**d)
                    .map(|((p, _), _)| *p)
                    .collect();
                missing.sort_unstable();
                missing.dedup();
                let arrived = (0..self.topo.size)
                    .filter(|p| !missing.contains(p))
                    .collect();
                return Err(CommError::Timeout {
                    op: w.kind,
                    seq: w.seq,
                    rank: self.topo.rank,
                    waited: w.started.elapsed(),
                    arrived,
                    missing,
                });
            }
            let waited = now - begun;
            if waited < self.spin {
                std::hint::spin_loop();
            } else if waited < Duration::from_millis(10) && !self.spin.is_zero() {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        self.reqs.clear();
        self.req_peer.clear();
        Ok(())
    }

    /// Fails with `PeerFailed` naming a peer on this host whose process has died (killed,
    /// crashed) while this rank still waits for its messages. Across hosts `mpirun` detects
    /// deaths.
    fn check_peers_alive(&self, w: &Wait, done: &[bool]) -> Result<(), CommError> {
        let waiting_for = self
            .req_peer
            .iter()
            .zip(done)
            .filter(|(_, d)| !**d)
            .map(|((p, _), _)| *p)
            .filter(|&p| self.local[p]);
        for peer in waiting_for {
            let pid = self.pids[peer];
            if !process_alive(pid) {
                return Err(CommError::PeerFailed {
                    rank: self.topo.rank,
                    failed_rank: peer,
                    reason: format!("its process (pid {pid}) died"),
                    op: w.kind,
                    seq: w.seq,
                });
            }
        }
        Ok(())
    }

    /// Fails with `PeerFailed` if a peer has sent a failure notice.
    fn check_failure_notice(&mut self, w: &Wait) -> Result<(), CommError> {
        let mut flag = 0;
        let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
        // SAFETY: the pre-posted receive of this thread.
        check(
            unsafe { ffi::MPI_Test(&mut self.fail_req, &mut flag, &mut status) },
            "MPI_Test",
        )?;
        if flag == 0 {
            return Ok(());
        }
        let mut count: c_int = 0;
        // SAFETY: a completed receive's status.
        unsafe { ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut count) };
        let reason = String::from_utf8_lossy(&self.fail_buf[..count.max(0) as usize]).into_owned();
        Err(CommError::PeerFailed {
            rank: self.topo.rank,
            failed_rank: status.MPI_SOURCE as usize,
            reason,
            op: w.kind,
            seq: w.seq,
        })
    }

    /// Reduce-scatter of `len` elements at `input` into this rank's shard at `output` (which may
    /// be the shard's own place in `input`): in pieces, each rank receives every peer's part of
    /// its shard and reduces the parts in rank order with the in-process backend's kernel.
    fn reduce_scatter(
        &mut self,
        w: &Wait,
        input: usize,
        output: usize,
        len: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let (n, r) = (self.topo.size, self.topo.rank);
        let esz = dtype.size();
        let shards: Vec<_> = (0..n).map(|k| shard_range(len, n, k)).collect();
        let piece = (PIECE_BYTES / esz).max(1);
        let longest = shards.iter().map(|s| s.len()).max().unwrap_or(0);
        let need = n * piece * esz;
        if self.staging.len() < need {
            self.staging = vec![0u8; need];
        }
        let stage = self.staging.as_mut_ptr() as usize;
        // Near peers' inputs, read in place.
        let near = self.near.clone();
        let mut near_in = vec![0usize; n];
        for k in (0..n).filter(|&k| near[k]) {
            near_in[k] = self.peer_addr(k, IN_AT)?;
        }
        let mut srcs = vec![0usize; n];
        let mut off = 0;
        while off < longest {
            for (k, s) in shards.iter().enumerate() {
                if k == r || near[k] {
                    continue;
                }
                let m = piece.min(s.len().saturating_sub(off));
                if m > 0 {
                    self.post_send(input + (s.start + off) * esz, m * esz, k, TAG_DATA)?;
                }
            }
            let mine = &shards[r];
            let m = piece.min(mine.len().saturating_sub(off));
            if m > 0 {
                for k in (0..n).filter(|&k| k != r && !near[k]) {
                    self.post_recv(stage + k * piece * esz, m * esz, k, TAG_DATA)?;
                }
            }
            self.wait_all(w)?;
            if m > 0 {
                for (k, src) in srcs.iter_mut().enumerate() {
                    *src = if k == r {
                        input + (mine.start + off) * esz
                    } else if near[k] {
                        near_in[k] + (mine.start + off) * esz
                    } else {
                        stage + k * piece * esz
                    };
                }
                // SAFETY: every source holds `m` elements of `dtype` (staging pieces were just
                // received, the own part is in `input`, near peers' parts are in their inputs,
                // which only this rank reads there until the departure); the destination is this
                // rank's shard, possibly exactly its own source, which the kernel allows.
                unsafe { reduce_into(dtype, op, &srcs, &[output + off * esz], m, Store::Cached) };
            }
            off += piece;
        }
        Ok(())
    }

    /// In-place all-gather over `buf` of `len` elements: this rank's shard is in place; every
    /// rank sends it to every other and receives theirs into their ranges, except that it copies
    /// its shard straight into the buffers of near peers (their region `peer_at` of this call).
    /// Within a [`Partition`]'s groups, the same among this rank's group.
    fn all_gather(
        &mut self,
        w: &Wait,
        buf: usize,
        (len, dtype): (usize, DType),
        peer_at: usize,
        part: Partition,
    ) -> Result<(), CommError> {
        let r = self.topo.rank;
        let (g, me) = (part.group_size(self.topo.size), part.index(r));
        let esz = dtype.size();
        let mine = shard_range(len, g, me);
        let near = self.near.clone();
        for j in (0..g).filter(|&j| j != me) {
            let k = part.member(r, j);
            if near[k] {
                continue;
            }
            let s = shard_range(len, g, j);
            if !s.is_empty() {
                self.post_recv(buf + s.start * esz, s.len() * esz, k, TAG_DATA)?;
            }
            if !mine.is_empty() {
                self.post_send(buf + mine.start * esz, mine.len() * esz, k, TAG_DATA)?;
            }
        }
        let mut dsts = Vec::new();
        for j in (0..g).filter(|&j| j != me) {
            let k = part.member(r, j);
            if near[k] {
                dsts.push(self.peer_addr(k, peer_at)? + mine.start * esz);
            }
        }
        if !dsts.is_empty() && !mine.is_empty() {
            // SAFETY: range r of a near peer's buffer is written by this rank alone until the
            // departure, and nobody reads it before; this rank's shard is only read.
            unsafe {
                fan_out_copy(
                    buf + mine.start * esz,
                    &dsts,
                    mine.len() * esz,
                    Store::Cached,
                )
            };
        }
        self.wait_all(w)
    }

    /// All-to-all within `part`'s groups of `bytes` at `input` into `output`, one equal chunk
    /// per member: the chunk of a near peer is pulled from its input (which only this rank reads
    /// there until the departure), every other is a message each way; this rank's own chunk is
    /// copied across.
    fn all_to_all(
        &mut self,
        w: &Wait,
        input: usize,
        output: usize,
        bytes: usize,
        part: Partition,
    ) -> Result<(), CommError> {
        let r = self.topo.rank;
        let (g, me) = (part.group_size(self.topo.size), part.index(r));
        let chunk = bytes / g;
        for j in 0..g {
            let k = part.member(r, j);
            let (from, to) = (input + j * chunk, output + j * chunk);
            if k == r {
                // SAFETY: distinct buffers of `g` chunks each (the call was validated).
                unsafe { copy_bytes(input + me * chunk, to, chunk) };
            } else if self.near[k] {
                let src = self.peer_addr(k, IN_AT)? + me * chunk;
                // SAFETY: a near peer's input is only read until the departure.
                unsafe { copy_bytes(src, to, chunk) };
            } else if chunk > 0 {
                self.post_recv(to, chunk, k, TAG_DATA)?;
                self.post_send(from, chunk, k, TAG_DATA)?;
            }
        }
        self.wait_all(w)
    }

    /// `MPI_Ibcast` in messages of at most [`MAX_MSG`], polled like every wait.
    fn broadcast(
        &mut self,
        w: &Wait,
        buf: usize,
        bytes: usize,
        root: usize,
    ) -> Result<(), CommError> {
        let mut off = 0;
        while off < bytes {
            let m = MAX_MSG.min(bytes - off);
            let mut req = null_request();
            // SAFETY: `buf` holds `bytes` bytes and is kept (or leaked) until completion.
            check(
                unsafe {
                    ffi::MPI_Ibcast(
                        (buf + off) as *mut c_void,
                        m as c_int,
                        ffi::RSMPI_UINT8_T,
                        root as c_int,
                        self.world,
                        &mut req,
                    )
                },
                "MPI_Ibcast",
            )?;
            self.reqs.push(req);
            self.req_peer.push((root, true));
            self.wait_all(w)?;
            off += m;
        }
        Ok(())
    }
}

/// Whether process `pid` exists and is not a zombie.
fn process_alive(pid: u64) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_none_or(|(_, rest)| !matches!(rest.trim_start().chars().next(), Some('Z' | 'X'))),
        Err(_) => false,
    }
}

/// `MPI_REQUEST_NULL`.
fn null_request() -> ffi::MPI_Request {
    // SAFETY: reading an immutable constant the MPI library exports.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

/// The collective a wait belongs to (for its errors).
struct Wait {
    seq: u64,
    kind: CollectiveKind,
    started: Instant,
}

/// Where the process id and the input and output regions sit in a descriptor.
const PID_AT: usize = MATCH_WORDS;
const IN_AT: usize = MATCH_WORDS + 1;
const OUT_AT: usize = MATCH_WORDS + 5;

/// Reduce-scatter outputs of at least this many bytes are written with streaming stores (as
/// in-process).
const STREAMING_STORE_BYTES: usize = 4 << 20;

/// The buffers a call exposes to peers on the shared-memory path, as (address, bytes): the input
/// peers read (all-reduce and broadcast: the buffer; reduce-scatter: the full input) and the
/// output peers write (all-gather: the full output).
/// A buffer's (address, bytes).
type Span = Option<(usize, usize)>;

fn exposed(call: &Call) -> (Span, Span) {
    let whole = |b: &crate::flat::Buffer| Some((buffer_addr(b), b.bytes()));
    match call {
        Call::AllReduce(b, _) | Call::ReduceScatterInPlace(b, _) | Call::Broadcast(b, _) => {
            (whole(b), None)
        }
        Call::ReduceScatter(i, _, _) | Call::AllToAll(i, _, _) => (whole(i), None),
        Call::AllGather(_, o) | Call::AllGatherInPlace(o) | Call::AllGatherGroup(o, _) => {
            (None, whole(o))
        }
        Call::Barrier => (None, None),
    }
}

fn encode(seq: u64, d: &CallDesc) -> [u64; MATCH_WORDS] {
    let dtype = match d.dtype {
        None => 0,
        Some(DType::F32) => 1,
        Some(DType::BF16) => 2,
        Some(DType::F16) => 3,
    };
    let op = match d.op {
        None => 0,
        Some(ReduceOp::Sum) => 1,
        Some(ReduceOp::Avg) => 2,
        Some(ReduceOp::Max) => 3,
    };
    let group = match d.group {
        Partition::World => 0,
        Partition::Within(h) => (1 << 32) | h as u64,
        Partition::Across(h) => (2 << 32) | h as u64,
    };
    [
        seq,
        d.kind as u64,
        dtype,
        d.len as u64,
        op,
        d.root.map_or(u64::MAX, |r| r as u64),
        group,
    ]
}

/// A peer's descriptor as text, for mismatch errors.
fn decode(w: &[u64; DESC_WORDS]) -> String {
    let kind = CollectiveKind::ALL
        .get(w[1] as usize)
        .copied()
        .unwrap_or(CollectiveKind::Barrier);
    let desc = CallDesc {
        kind,
        dtype: match w[2] {
            1 => Some(DType::F32),
            2 => Some(DType::BF16),
            3 => Some(DType::F16),
            _ => None,
        },
        len: w[3] as usize,
        op: match w[4] {
            1 => Some(ReduceOp::Sum),
            2 => Some(ReduceOp::Avg),
            3 => Some(ReduceOp::Max),
            _ => None,
        },
        root: (w[5] != u64::MAX).then_some(w[5] as usize),
        group: match w[6] >> 32 {
            1 => Partition::Within((w[6] & 0xffff_ffff) as usize),
            2 => Partition::Across((w[6] & 0xffff_ffff) as usize),
            _ => Partition::World,
        },
    };
    format!("{desc} (sequence #{})", w[0])
}
