//! NCCL between GPUs (feature `cuda`): one rank per GPU, its collectives run by NCCL over the
//! GPUs' links (NVLink, PCIe, InfiniBand), behind the same [`Communicator`] as every backend: the
//! same buffers, shard layout, traffic counters, statistics and traces.
//!
//! The contract's buffers live in host memory, so each collective stages them: one copy onto the
//! rank's GPU, NCCL's collective there, one copy back, on a stream of the rank's own, on a
//! communication thread per rank (the caller computes meanwhile, as with the other backends).
//! * Reductions run in f32: 16-bit buffers are widened on the way in and rounded once (to nearest
//!   even) on the way out, as the contract asks (NCCL's own 16-bit reductions round at every hop),
//!   at twice their bytes on the wire. The traffic counters count the buffers' own dtype.
//! * NCCL's reduce-scatter and all-gather take equal shards; zerodp's [`shard_range`] gives the
//!   first `len % world` ranks one element more. Each rank's shard is placed at a stride of the
//!   largest shard on the way in and taken out of it on the way back.
//! * All-gathers and broadcasts move bytes, so every dtype arrives bit for bit.
//!
//! * An average is NCCL's sum divided by the world size in f32, as the contract computes it (NCCL's
//!   own multiplies by `1/n`). With two ranks every result equals the in-process backend's bit for
//!   bit; with more, NCCL's ring adds in another order than the in-process backend's fixed one, so
//!   sums may differ from it in their last bits (they are still equal on every rank).
//!
//! Ranks are threads of one process ([`NcclComm::group`], one GPU each) or processes
//! ([`NcclComm::over`]: another communicator, MPI's, carries NCCL's unique id from rank 0, and
//! stays with the rank). Every rank opens its GPU before any enters NCCL's initialisation (which
//! waits for all, without a timeout), so a rank that cannot start fails the group instead of
//! hanging it.
//!
//! NCCL itself has no timeout and no way to tell peers that a rank failed outside a collective;
//! a collective a peer never joins waits forever. So each rank's thread waits for its collective
//! by polling, and gives up by aborting its NCCL communicator (`ncclCommAbort`, which ends the
//! waiting kernel): when the collective timeout passes ([`CommOptions::timeout`]), or when a rank
//! of an in-process group reports a failure ([`Communicator::report_failure`], which every rank
//! of the group sees: their collectives fail naming it, as the in-process backend's do). Under
//! MPI a rank's report goes to the carrier too (whose peers are told, and which then skips
//! `MPI_Finalize`, so the failed process exits and `mpirun` ends the job); peers waiting in NCCL
//! in other processes see the timeout. After a failed collective every later one on that rank
//! fails with the same error.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DeviceRepr, HostSlice};
use cudarc::nccl::{Comm, Id};
use half::slice::HalfFloatSliceExt;

use crate::comm::queue::{account, describe, validate, Call, CommThread, Job};
use crate::comm::stats::CommStats;
use crate::comm::{
    shard_range, CollectiveKind, CommError, CommHandle, CommOptions, Communicator, ReduceOp,
    TrafficCounters,
};
use crate::flat::Buffer;

/// What the communication thread shares with the handle the ranks' code holds.
#[derive(Default)]
struct Shared {
    traffic: Mutex<TrafficCounters>,
    stats: Mutex<CommStats>,
}

/// A world's failure notice, shared by the ranks of an in-process group (one per process under
/// MPI): the first rank to report a failure and why. Every rank's thread reads it while it waits
/// for a collective.
#[derive(Default)]
struct Abort {
    failed: Mutex<Option<(usize, String)>>,
}

impl Abort {
    fn set(&self, rank: usize, reason: String) {
        let mut failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        failed.get_or_insert((rank, reason));
    }

    fn get(&self) -> Option<(usize, String)> {
        self.failed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// One rank of a world whose collectives NCCL runs; see the [module docs](self).
pub struct NcclComm {
    rank: usize,
    world: usize,
    ordinal: usize,
    shared: Arc<Shared>,
    abort: Arc<Abort>,
    /// Declared before `carrier`: fields drop in order, so the NCCL thread is joined (and its
    /// communicator gone) before MPI can shut down.
    thread: CommThread<Job>,
    /// Under MPI, the communicator that carried NCCL's id: told of this rank's failure, and kept
    /// for as long as this rank lives.
    carrier: Option<Arc<dyn Communicator>>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclComm(rank {} of {} on GPU {})",
            self.rank, self.world, self.ordinal
        )
    }
}

/// What a starting rank's thread reports, twice: its GPU and stream opened, then NCCL joined.
type Report = Result<(), CommError>;

/// The next report of a starting rank, or why there is none.
fn next_report(reports: &mpsc::Receiver<Report>) -> Report {
    reports.recv().unwrap_or_else(|_| {
        Err(CommError::Closed(
            "an NCCL communication thread exited during initialisation".into(),
        ))
    })
}

/// An NCCL or CUDA failure on `rank`, with what to check.
fn failed(rank: usize, what: &str, e: impl std::fmt::Debug) -> CommError {
    CommError::Closed(format!(
        "NCCL on rank {rank}: {what} failed ({e:?}); check the GPU (nvidia-smi), that every rank \
         has its own GPU, and NCCL_DEBUG=WARN's output"
    ))
}

impl NcclComm {
    /// A world of `ordinals.len()` ranks as threads of this process, rank `r` on GPU
    /// `ordinals[r]` (each GPU once: NCCL refuses two ranks on one device).
    pub fn group(ordinals: &[usize], options: CommOptions) -> Result<Vec<NcclComm>, CommError> {
        let mut seen = ordinals.to_vec();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != ordinals.len() || ordinals.is_empty() {
            return Err(CommError::InvalidArgument {
                rank: 0,
                what: format!(
                    "NCCL ranks need one GPU each, got GPUs {ordinals:?}: use as many ranks as \
                     GPUs, or the in-process backend for ranks sharing a GPU"
                ),
            });
        }
        let id = Id::new().map_err(|e| failed(0, "ncclGetUniqueId", e))?;
        let world = ordinals.len();
        eager_connections();
        let (report, reports) = mpsc::channel();
        let (mut comms, mut gos) = (Vec::new(), Vec::new());
        let abort = Arc::new(Abort::default());
        for (rank, &ordinal) in ordinals.iter().enumerate() {
            let (go, go_rx) = mpsc::channel();
            // On an error the ranks started so far see their `go` dropped and exit.
            let at = (ordinal, rank, world, id);
            let comm = Self::start(at, &options, (report.clone(), go_rx), abort.clone())?;
            comms.push(comm);
            gos.push(go);
        }
        drop(report);
        // Every rank opens its GPU first: NCCL's initialisation waits for all ranks without a
        // timeout, so a rank that cannot start must be known before any enters it.
        let opened: Vec<Report> = (0..world).map(|_| next_report(&reports)).collect();
        if let Some(Err(e)) = opened.into_iter().find(Result::is_err) {
            return Err(e);
        }
        for go in &gos {
            let _ = go.send(true);
        }
        for _ in 0..world {
            if let Err(e) = next_report(&reports) {
                // The others wait inside ncclCommInitRank for good: leave their threads behind
                // rather than join them.
                comms.into_iter().for_each(std::mem::forget);
                return Err(e);
            }
        }
        Ok(comms)
    }

    /// This process's rank of `carrier`'s world (an MPI communicator: one process per GPU), on GPU
    /// `ordinal`: rank 0 draws NCCL's unique id and `carrier` broadcasts it. The rank keeps
    /// `carrier` (MPI stays up while it lives) and reports its failure there too.
    pub fn over(
        carrier: Arc<dyn Communicator>,
        ordinal: usize,
        options: CommOptions,
    ) -> Result<NcclComm, CommError> {
        let (rank, world) = (carrier.rank(), carrier.world_size());
        let mut id_bytes = [0u8; 128];
        if rank == 0 {
            let id = Id::new().map_err(|e| failed(0, "ncclGetUniqueId", e));
            // The peers wait in the broadcast below: tell them rather than let them time out.
            let id = id.inspect_err(|e| carrier.report_failure(e.to_string()))?;
            for (b, &c) in id_bytes.iter_mut().zip(id.internal()) {
                *b = c as u8;
            }
        }
        // 128 bytes as 32 f32 bit patterns: a broadcast copies them unchanged.
        let words: Vec<f32> = (id_bytes.chunks_exact(4))
            .map(|w| f32::from_bits(u32::from_le_bytes([w[0], w[1], w[2], w[3]])))
            .collect();
        let words = carrier.broadcast(Buffer::F32(words), 0).wait_one()?;
        let words = crate::comm::returned_f32(words, rank)?;
        let mut internal = [0 as std::ffi::c_char; 128];
        for (c, b) in internal
            .iter_mut()
            .zip(words.iter().flat_map(|w| w.to_bits().to_le_bytes()))
        {
            *c = b as std::ffi::c_char;
        }
        let (report, reports) = mpsc::channel();
        let (go, go_rx) = mpsc::channel();
        let at = (ordinal, rank, world, Id::uninit(internal));
        let abort = Arc::new(Abort::default());
        eager_connections();
        let joined = Self::start(at, &options, (report, go_rx), abort).and_then(|comm| {
            next_report(&reports)?;
            let _ = go.send(true);
            next_report(&reports)?;
            Ok(comm)
        });
        match joined {
            Ok(mut comm) => {
                comm.carrier = Some(carrier);
                Ok(comm)
            }
            Err(e) => {
                // The peers may wait in NCCL's initialisation for good; the carrier's failure
                // notice lets this process exit (MPI skips its finalisation) so mpirun ends the
                // job.
                carrier.report_failure(e.to_string());
                Err(e)
            }
        }
    }

    /// Start rank `rank`'s thread on GPU `ordinal`: it opens the GPU and reports, waits for
    /// `go`, joins NCCL's world and reports again, then serves collectives.
    fn start(
        (ordinal, rank, world, id): (usize, usize, usize, Id),
        options: &CommOptions,
        (report, go): (mpsc::Sender<Report>, mpsc::Receiver<bool>),
        abort: Arc<Abort>,
    ) -> Result<NcclComm, CommError> {
        let shared = Arc::new(Shared::default());
        shared
            .stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .world_size = world;
        let (tx, rx) = mpsc::channel::<Job>();
        let thread = {
            let (shared, options, abort) = (shared.clone(), options.clone(), abort.clone());
            std::thread::Builder::new()
                .name(format!("zerodp-nccl-{rank}"))
                .spawn(move || {
                    let stream = match open_stream(ordinal, rank) {
                        Ok(stream) => stream,
                        Err(e) => return drop(report.send(Err(e))),
                    };
                    let _ = report.send(Ok(()));
                    if go.recv() != Ok(true) {
                        return;
                    }
                    let at = (rank, world);
                    let engine = match Engine::join(stream, at, id, (options, shared, abort)) {
                        Ok(engine) => engine,
                        Err(e) => return drop(report.send(Err(e))),
                    };
                    let _ = report.send(Ok(()));
                    engine.serve(rx);
                })
                .map_err(|e| {
                    CommError::Closed(format!(
                        "could not start the NCCL thread of rank {rank}: {e}"
                    ))
                })?
        };
        Ok(NcclComm {
            rank,
            world,
            ordinal,
            shared,
            abort,
            thread: CommThread::new(tx, thread),
            carrier: None,
        })
    }

    /// The GPU this rank's collectives run on.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Timing statistics of this rank's collectives per op, dtype and size.
    pub fn stats(&self) -> CommStats {
        self.shared
            .stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn submit(&self, call: Call) -> CommHandle {
        if let Err(e) = validate(&call, self.world, self.rank) {
            return CommHandle::ready(Err(e));
        }
        let (done, handle) = CommHandle::channel();
        if let Err(job) = self.thread.send(Job { call, done }) {
            let _ = job.done.send(Err(CommError::Closed(
                "the NCCL communication thread has exited".into(),
            )));
        }
        handle
    }
}

impl Communicator for NcclComm {
    crate::comm::queue::queued_collectives!();
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn traffic(&self) -> TrafficCounters {
        self.shared
            .traffic
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
    /// Every rank of the group gives up its waiting collectives, naming this rank; under MPI the
    /// carrier tells its peers too.
    fn report_failure(&self, reason: String) {
        self.abort.set(self.rank, reason.clone());
        if let Some(carrier) = &self.carrier {
            carrier.report_failure(reason);
        }
    }
}

/// What ends a wait for a collective: the world's failure notice, and the collective timeout.
type Until<'a> = (&'a Abort, Duration);

/// A rank and the collective it runs (kind, sequence number), for the errors of a wait.
type At = (usize, (CollectiveKind, u64));

/// NCCL 2.28 makes a collective's connections when it first runs (`NCCL_RUNTIME_CONNECT=1`), on
/// the host inside the call, waiting for the peers there, where no timeout or failure notice can
/// reach it. Unless the user chose otherwise, make them all in `ncclCommInitRank` instead, whose
/// wait is the initialisation's (every rank has opened its GPU by then).
fn eager_connections() {
    if std::env::var_os("NCCL_RUNTIME_CONNECT").is_none() {
        std::env::set_var("NCCL_RUNTIME_CONNECT", "0");
    }
}

/// Wait for the NCCL collective queued last on `stream`, polling, so that a reported failure or
/// the collective timeout can end the wait: then abort NCCL's communicator (its kernel exits;
/// `comm` becomes `None`) and fail. `at` is the rank and the collective (kind, sequence number).
fn wait_queued(
    stream: &CudaStream,
    comm: &mut Option<Comm>,
    (abort, timeout): Until<'_>,
    at: At,
    what: &str,
) -> Result<(), CommError> {
    let rank = at.0;
    let event = (stream.record_event(None))
        .map_err(|e| failed(rank, "recording the collective's end", e))?;
    let started = Instant::now();
    let mut polls: u32 = 0;
    loop {
        match event.try_is_complete() {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => return Err(failed(rank, what, e)),
        }
        if let Some(failure) = abort.get() {
            *comm = None;
            return Err(peer_failed(at, failure));
        }
        if started.elapsed() > timeout {
            *comm = None;
            return Err(CommError::Closed(format!(
                "NCCL on rank {rank}: {what} (collective #{}) did not finish within the \
                 collective timeout of {timeout:?}, so its communicator was aborted: a peer may \
                 have died or stopped issuing collectives. Raise the timeout with \
                 ZERODP_TIMEOUT=<seconds> or --timeout if this is expected",
                at.1 .1
            )));
        }
        // Spin briefly (most collectives end within microseconds), then sleep.
        polls = polls.saturating_add(1);
        match polls < 1000 {
            true => std::thread::yield_now(),
            false => std::thread::sleep(Duration::from_micros(50)),
        }
    }
}

/// The end of every collective: [`wait_queued`] for it (`what`, on rank and collective `at`),
/// then its result from the GPU staging `src` into the host's `dst`, and the stream drained.
fn finish_queued<T, Src, Dst>(
    stream: &Arc<CudaStream>,
    comm: &mut Option<Comm>,
    (until, at, what): (Until<'_>, At, &str),
    (src, dst): (&Src, &mut Dst),
) -> Result<(), CommError>
where
    T: DeviceRepr,
    Src: DevicePtr<T>,
    Dst: HostSlice<T> + ?Sized,
{
    let rank = at.0;
    wait_queued(stream, comm, until, at, what)?;
    (stream.memcpy_dtoh(src, dst)).map_err(|e| failed(rank, "copying between host and GPU", e))?;
    (stream.synchronize()).map_err(|e| failed(rank, "the collective's stream", e))
}

/// The error of collective `at.1` on rank `at.0`, given up because rank `failure.0` reported
/// `failure.1`.
fn peer_failed((rank, (op, seq)): At, (failed_rank, reason): (usize, String)) -> CommError {
    CommError::PeerFailed {
        rank,
        failed_rank,
        reason,
        op,
        seq,
    }
}

/// NCCL's communicator, unless an earlier wait aborted it.
fn live(comm: &Option<Comm>, rank: usize) -> Result<&Comm, CommError> {
    comm.as_ref().ok_or_else(|| {
        CommError::Closed(format!(
            "NCCL on rank {rank}: the communicator was aborted after an earlier failure"
        ))
    })
}

/// GPU `ordinal`'s primary context, and a stream of this rank's own on it.
fn open_stream(ordinal: usize, rank: usize) -> Result<Arc<CudaStream>, CommError> {
    let ctx = CudaContext::new(ordinal).map_err(|e| failed(rank, "opening the GPU", e))?;
    ctx.new_stream()
        .map_err(|e| failed(rank, "creating a stream", e))
}

/// The communication thread's state: NCCL's communicator (not `Send`: it lives and dies on this
/// thread), its stream, and staging buffers grown to the largest collective so far, on the GPU
/// and in host memory (steady-state collectives allocate nothing).
struct Engine {
    /// `None` once aborted (dropping a `Comm` calls `ncclCommAbort`).
    comm: Option<Comm>,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    options: CommOptions,
    shared: Arc<Shared>,
    /// The world's failure notice, read while waiting.
    abort: Arc<Abort>,
    /// The collective being run and its sequence number, for the errors of [`wait_queued`].
    current: (CollectiveKind, u64),
    /// The first failure: every later collective fails with it (NCCL's communicator may be
    /// broken).
    failure: Option<CommError>,
    /// f32 staging of reductions on the GPU: the full tensor, then (reduce-scatter) the shard.
    floats: Option<CudaSlice<f32>>,
    /// Byte staging of all-gathers and broadcasts on the GPU: the shard, then the full tensor.
    bytes: Option<CudaSlice<u8>>,
    /// Host staging: a reduction's f32 values (padded for a reduce-scatter).
    wide: Vec<f32>,
    /// Host staging: a reduce-scatter's reduced shard.
    shard: Vec<f32>,
    /// Host staging: an all-gather's padded shard and gathered shards.
    send: Vec<u8>,
    gathered: Vec<u8>,
}

impl Engine {
    fn join(
        stream: Arc<CudaStream>,
        (rank, world): (usize, usize),
        id: Id,
        (options, shared, abort): (CommOptions, Arc<Shared>, Arc<Abort>),
    ) -> Result<Engine, CommError> {
        let comm = Comm::from_rank(stream.clone(), rank, world, id)
            .map_err(|e| failed(rank, "ncclCommInitRank", e))?;
        Ok(Engine {
            comm: Some(comm),
            stream,
            rank,
            world,
            options,
            shared,
            abort,
            current: (CollectiveKind::Barrier, 0),
            failure: None,
            floats: None,
            bytes: None,
            wide: Vec::new(),
            shard: Vec::new(),
            send: Vec::new(),
            gathered: Vec::new(),
        })
    }

    fn serve(mut self, rx: mpsc::Receiver<Job>) {
        let mut seq: u64 = 0;
        while let Ok(job) = rx.recv() {
            let result = catch_unwind(AssertUnwindSafe(|| self.run_one(seq, job.call)))
                .unwrap_or_else(|p| {
                    let msg = crate::comm::inproc::panic_message(&*p);
                    Err(CommError::Closed(format!(
                        "the NCCL thread of rank {} panicked in collective #{seq}: {msg}",
                        self.rank
                    )))
                });
            if let Err(e) = &result {
                self.failure.get_or_insert_with(|| e.clone());
            }
            seq += 1;
            let _ = job.done.send(result);
        }
    }

    fn run_one(&mut self, seq: u64, call: Call) -> Result<Vec<Buffer>, CommError> {
        if let Some(failure) = &self.failure {
            return Err(failure.clone());
        }
        let desc = describe(&call);
        self.current = (desc.kind, seq);
        if let Some(failed) = self.abort.get() {
            return Err(peer_failed((self.rank, self.current), failed));
        }
        let started = Instant::now();
        let out = self.execute(call)?;
        let stats = (&self.shared.traffic, &self.shared.stats);
        let at = (self.world, self.rank);
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

    fn execute(&mut self, call: Call) -> Result<Vec<Buffer>, CommError> {
        match call {
            Call::AllReduce(Buffer::F32(mut v), op) => {
                self.all_reduce_f32(&mut v, op)?;
                Ok(vec![Buffer::F32(v)])
            }
            Call::AllReduce(mut buf, op) => {
                let mut wide = std::mem::take(&mut self.wide);
                wide.resize(buf.len(), 0.0);
                widen_range(&buf, 0..buf.len(), &mut wide);
                let reduced = self.all_reduce_f32(&mut wide, op);
                narrow_into(&wide, &mut buf, 0..wide.len());
                self.wide = wide;
                reduced.map(|()| vec![buf])
            }
            Call::ReduceScatter(input, mut output, op) => {
                self.reduce_scatter_f32(&input, op)?;
                let all = 0..output.len();
                narrow_into(&self.shard, &mut output, all);
                Ok(vec![input, output])
            }
            Call::ReduceScatterInPlace(mut buf, op) => {
                let mine = shard_range(buf.len(), self.world, self.rank);
                self.reduce_scatter_f32(&buf, op)?;
                narrow_into(&self.shard, &mut buf, mine);
                Ok(vec![buf])
            }
            Call::AllGather(input, mut output) => {
                let size = input.dtype().size();
                self.all_gather_bytes(bytes_of(&input), bytes_of_mut(&mut output), size)?;
                Ok(vec![input, output])
            }
            Call::AllGatherInPlace(mut buf) => {
                let size = buf.dtype().size();
                let mine = shard_range(buf.len(), self.world, self.rank);
                let mut shard = std::mem::take(&mut self.send);
                shard.clear();
                shard.extend_from_slice(&bytes_of(&buf)[mine.start * size..mine.end * size]);
                let gathered = self.all_gather_bytes(&shard, bytes_of_mut(&mut buf), size);
                self.send = shard;
                gathered.map(|()| vec![buf])
            }
            Call::AllGatherGroup(buf, part) if part.group_size(self.world) == self.world => {
                self.execute(Call::AllGatherInPlace(buf))
            }
            Call::AllGatherGroup(_, part) => Err(CommError::InvalidArgument {
                rank: self.rank,
                what: format!(
                    "NCCL runs no collectives within groups of ranks ({part:?}); turn \
                     zero_hpz_partition_size off on GPUs"
                ),
            }),
            Call::AllToAll(_, _, part) => Err(CommError::InvalidArgument {
                rank: self.rank,
                what: format!(
                    "NCCL runs no all-to-all here ({part:?}); turn zero_quantized_gradients off \
                     on GPUs"
                ),
            }),
            Call::Broadcast(mut buf, root) => {
                self.broadcast_bytes(bytes_of_mut(&mut buf), root)?;
                Ok(vec![buf])
            }
            Call::Barrier => {
                self.all_reduce_f32(&mut [0.0], ReduceOp::Sum)?;
                Ok(Vec::new())
            }
        }
    }

    /// `ReduceOp::Avg` as the contract computes it, the f32 sum divided by the world size (NCCL's
    /// own average multiplies by `1/n`).
    fn finish_average(&self, values: &mut [f32], op: ReduceOp) {
        if op == ReduceOp::Avg {
            let n = self.world as f32;
            values.iter_mut().for_each(|v| *v /= n);
        }
    }

    fn all_reduce_f32(&mut self, host: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        let (rank, n, stream) = (self.rank, host.len(), &self.stream);
        let staging = grown(&mut self.floats, stream, n, rank)?;
        let mut view = staging.slice_mut(0..n);
        let copy = |e| failed(rank, "copying between host and GPU", e);
        stream.memcpy_htod(host, &mut view).map_err(copy)?;
        (live(&self.comm, rank)?.all_reduce_in_place(&mut view, &nccl_op(op)))
            .map_err(|e| failed(rank, "ncclAllReduce", e))?;
        let until = (&*self.abort, self.options.timeout);
        let at = (rank, self.current);
        finish_queued(
            stream,
            &mut self.comm,
            (until, at, "ncclAllReduce"),
            (&view, host),
        )?;
        self.finish_average(host, op);
        Ok(())
    }

    /// This rank's reduced shard of `input` into `self.shard` (f32, its own length), each rank's
    /// shard placed at a stride of the largest for NCCL's equal shards.
    fn reduce_scatter_f32(&mut self, input: &Buffer, op: ReduceOp) -> Result<(), CommError> {
        let (rank, world, len) = (self.rank, self.world, input.len());
        let stride = len.div_ceil(world);
        let mut padded = std::mem::take(&mut self.wide);
        padded.clear();
        padded.resize(stride * world, 0.0);
        for r in 0..world {
            let range = shard_range(len, world, r);
            widen_range(
                input,
                range.clone(),
                &mut padded[r * stride..][..range.len()],
            );
        }
        let mut shard = std::mem::take(&mut self.shard);
        shard.resize(stride, 0.0);
        let reduced = self.reduce_scatter_padded(&padded, &mut shard, op);
        self.wide = padded;
        shard.truncate(shard_range(len, world, rank).len());
        self.finish_average(&mut shard, op);
        self.shard = shard;
        reduced
    }

    /// NCCL's reduce-scatter of `padded` (`world` equal shards) into `shard` (one of them).
    fn reduce_scatter_padded(
        &mut self,
        padded: &[f32],
        shard: &mut [f32],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let (rank, stride, stream) = (self.rank, shard.len(), &self.stream);
        let staging = grown(&mut self.floats, stream, padded.len() + stride, rank)?;
        let (mut send, mut recv) = staging.split_at_mut(padded.len());
        let copy = |e| failed(rank, "copying between host and GPU", e);
        stream.memcpy_htod(padded, &mut send).map_err(copy)?;
        let mut recv = recv.slice_mut(0..stride);
        (live(&self.comm, rank)?.reduce_scatter(&send, &mut recv, &nccl_op(op)))
            .map_err(|e| failed(rank, "ncclReduceScatter", e))?;
        let until = (&*self.abort, self.options.timeout);
        let at = (rank, self.current);
        finish_queued(
            stream,
            &mut self.comm,
            (until, at, "ncclReduceScatter"),
            (&recv, shard),
        )
    }

    /// Every rank's shard (`shard`, elements of `size` bytes) into `full`, through NCCL's equal
    /// shards at a stride of the largest.
    fn all_gather_bytes(
        &mut self,
        shard: &[u8],
        full: &mut [u8],
        size: usize,
    ) -> Result<(), CommError> {
        let (world, len) = (self.world, full.len() / size);
        let stride = len.div_ceil(world) * size;
        let mut gathered = std::mem::take(&mut self.gathered);
        gathered.resize(stride * world, 0);
        let done = self.all_gather_padded(shard, stride, &mut gathered);
        if done.is_ok() {
            for r in 0..world {
                let range = shard_range(len, world, r);
                let bytes = range.len() * size;
                full[range.start * size..][..bytes]
                    .copy_from_slice(&gathered[r * stride..][..bytes]);
            }
        }
        self.gathered = gathered;
        done
    }

    /// NCCL's all-gather of `shard` padded to `stride` bytes into `gathered` (`world` strides).
    fn all_gather_padded(
        &mut self,
        shard: &[u8],
        stride: usize,
        gathered: &mut [u8],
    ) -> Result<(), CommError> {
        let (rank, stream) = (self.rank, &self.stream);
        let staging = grown(&mut self.bytes, stream, stride + gathered.len(), rank)?;
        let (mut send, mut recv) = staging.split_at_mut(stride);
        let copy = |e| failed(rank, "copying between host and GPU", e);
        // The padding's bytes are never read back: only the shard's own are copied up.
        stream
            .memcpy_htod(shard, &mut send.slice_mut(0..shard.len()))
            .map_err(copy)?;
        let mut recv = recv.slice_mut(0..gathered.len());
        (live(&self.comm, rank)?.all_gather(&send, &mut recv))
            .map_err(|e| failed(rank, "ncclAllGather", e))?;
        let until = (&*self.abort, self.options.timeout);
        let at = (rank, self.current);
        finish_queued(
            stream,
            &mut self.comm,
            (until, at, "ncclAllGather"),
            (&recv, gathered),
        )
    }

    fn broadcast_bytes(&mut self, buf: &mut [u8], root: usize) -> Result<(), CommError> {
        let (rank, n, stream) = (self.rank, buf.len(), &self.stream);
        let staging = grown(&mut self.bytes, stream, n, rank)?;
        let mut view = staging.slice_mut(0..n);
        let copy = |e| failed(rank, "copying between host and GPU", e);
        stream.memcpy_htod(&*buf, &mut view).map_err(copy)?;
        (live(&self.comm, rank)?.broadcast_in_place(&mut view, root as i32))
            .map_err(|e| failed(rank, "ncclBroadcast", e))?;
        let until = (&*self.abort, self.options.timeout);
        let at = (rank, self.current);
        finish_queued(
            stream,
            &mut self.comm,
            (until, at, "ncclBroadcast"),
            (&view, buf),
        )
    }
}

/// `staging` grown to at least `len` elements (zeroed when it grows; 1 at least).
fn grown<'a, T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    staging: &'a mut Option<CudaSlice<T>>,
    stream: &Arc<CudaStream>,
    len: usize,
    rank: usize,
) -> Result<&'a mut CudaSlice<T>, CommError> {
    if staging.as_ref().is_none_or(|s| s.len() < len) {
        *staging = None;
        let s = stream.alloc_zeros::<T>(len.max(1));
        *staging = Some(s.map_err(|e| failed(rank, "allocating GPU staging", e))?);
    }
    staging
        .as_mut()
        .ok_or_else(|| failed(rank, "allocating GPU staging", "none"))
}

/// NCCL's reduction for `op`: an average is NCCL's sum, divided afterwards
/// ([`Engine::finish_average`]).
fn nccl_op(op: ReduceOp) -> cudarc::nccl::ReduceOp {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => cudarc::nccl::ReduceOp::Sum,
        ReduceOp::Max => cudarc::nccl::ReduceOp::Max,
    }
}

/// Elements `range` of `buf` in f32, into `out` (as long as the range).
fn widen_range(buf: &Buffer, range: std::ops::Range<usize>, out: &mut [f32]) {
    match buf {
        Buffer::F32(v) => out.copy_from_slice(&v[range]),
        Buffer::BF16(v) => v[range].convert_to_f32_slice(out),
        Buffer::F16(v) => v[range].convert_to_f32_slice(out),
    }
}

/// `values` rounded to nearest even into elements `range` of `buf` (as long as `values`).
fn narrow_into(values: &[f32], buf: &mut Buffer, range: std::ops::Range<usize>) {
    match buf {
        Buffer::F32(v) => v[range].copy_from_slice(values),
        Buffer::BF16(v) => v[range].convert_from_f32_slice(values),
        Buffer::F16(v) => v[range].convert_from_f32_slice(values),
    }
}

fn bytes_of(buf: &Buffer) -> &[u8] {
    match buf {
        Buffer::F32(v) => bytemuck::cast_slice(v),
        Buffer::BF16(v) => bytemuck::cast_slice(v),
        Buffer::F16(v) => bytemuck::cast_slice(v),
    }
}

fn bytes_of_mut(buf: &mut Buffer) -> &mut [u8] {
    match buf {
        Buffer::F32(v) => bytemuck::cast_slice_mut(v),
        Buffer::BF16(v) => bytemuck::cast_slice_mut(v),
        Buffer::F16(v) => bytemuck::cast_slice_mut(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn ranks_sharing_a_gpu_or_none_are_refused_before_touching_one() {
        for ordinals in [&[0, 0][..], &[1, 0, 1], &[]] {
            let err = NcclComm::group(ordinals, CommOptions::default()).unwrap_err();
            assert!(err.to_string().contains("one GPU each"), "{err}");
        }
    }

    #[test]
    fn widening_and_rounding_once_keep_every_dtype() {
        let bf = Buffer::BF16(vec![bf16::from_f32(1.5), bf16::from_f32(-2.25)]);
        let mut wide = vec![0.0; 2];
        widen_range(&bf, 0..2, &mut wide);
        assert_eq!(wide, vec![1.5, -2.25]);
        // 1 + 2^-9 is between two bf16 values: rounded once, to nearest even.
        wide[0] = 1.0 + 1.0 / 512.0;
        let mut out = bf.clone();
        narrow_into(&wide, &mut out, 0..2);
        assert_eq!(out.get_f32(0), 1.0);
        let mut half_buf = Buffer::F16(vec![f16::ZERO; 3]);
        narrow_into(&[0.5, 0.25], &mut half_buf, 1..3);
        assert_eq!(
            (0..3).map(|i| half_buf.get_f32(i)).collect::<Vec<_>>(),
            [0.0, 0.5, 0.25]
        );
        assert_eq!(bytes_of(&half_buf).len(), 6);
    }
}
