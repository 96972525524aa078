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
//! Ranks are threads of one process ([`NcclComm::group`], one GPU each) or processes
//! ([`NcclComm::over`]: another communicator, MPI's, carries NCCL's unique id from rank 0).
//! NCCL has no timeout: a rank that dies mid-collective leaves its peers waiting in NCCL (the MPI
//! launcher ends the job when a process exits non-zero).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::{Comm, Id};
use half::{bf16, f16};

use crate::comm::queue::{account, describe, validate, Call, Job};
use crate::comm::stats::CommStats;
use crate::comm::{
    shard_range, Buffer, CommError, CommHandle, CommOptions, Communicator, ReduceOp,
    TrafficCounters,
};

/// What the communication thread shares with the handle the ranks' code holds.
#[derive(Default)]
struct Shared {
    traffic: Mutex<TrafficCounters>,
    stats: Mutex<CommStats>,
}

/// One rank of a world whose collectives NCCL runs; see the [module docs](self).
pub struct NcclComm {
    rank: usize,
    world: usize,
    ordinal: usize,
    shared: Arc<Shared>,
    queue: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
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

/// A rank whose thread is joining NCCL's initialisation (which waits for every rank).
struct Starting {
    comm: NcclComm,
    ready: mpsc::Receiver<Result<(), CommError>>,
}

impl Starting {
    fn ready(self) -> Result<NcclComm, CommError> {
        let started = self.ready.recv().unwrap_or_else(|_| {
            Err(CommError::Closed(
                "the NCCL communication thread exited during initialisation".into(),
            ))
        });
        started.map(|()| self.comm)
    }
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
        // Every rank's thread must be in NCCL's initialisation at once: start all, then wait.
        let starting = (ordinals.iter().enumerate())
            .map(|(rank, &ordinal)| Self::start(ordinal, rank, world, id, options.clone()))
            .collect::<Result<Vec<_>, _>>()?;
        starting.into_iter().map(Starting::ready).collect()
    }

    /// This process's rank of `carrier`'s world (an MPI communicator: one process per GPU), on GPU
    /// `ordinal`: rank 0 draws NCCL's unique id and `carrier` broadcasts it.
    pub fn over(
        carrier: &dyn Communicator,
        ordinal: usize,
        options: CommOptions,
    ) -> Result<NcclComm, CommError> {
        let (rank, world) = (carrier.rank(), carrier.world_size());
        let mut id_bytes = [0u8; 128];
        if rank == 0 {
            let id = Id::new().map_err(|e| failed(0, "ncclGetUniqueId", e))?;
            for (b, &c) in id_bytes.iter_mut().zip(id.internal()) {
                *b = c as u8;
            }
        }
        // 128 bytes as 32 f32 bit patterns: a broadcast copies them unchanged.
        let words: Vec<f32> = (id_bytes.chunks_exact(4))
            .map(|w| f32::from_bits(u32::from_le_bytes([w[0], w[1], w[2], w[3]])))
            .collect();
        let words = carrier
            .broadcast(Buffer::F32(words), 0)
            .wait_one()?
            .into_returned_f32(rank)?;
        let mut internal = [0 as std::ffi::c_char; 128];
        for (c, b) in internal
            .iter_mut()
            .zip(words.iter().flat_map(|w| w.to_bits().to_le_bytes()))
        {
            *c = b as std::ffi::c_char;
        }
        Self::start(ordinal, rank, world, Id::uninit(internal), options)?.ready()
    }

    fn start(
        ordinal: usize,
        rank: usize,
        world: usize,
        id: Id,
        options: CommOptions,
    ) -> Result<Starting, CommError> {
        let shared = Arc::new(Shared::default());
        shared
            .stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .world_size = world;
        let (tx, rx) = mpsc::channel::<Job>();
        let (ready_tx, ready) = mpsc::channel();
        let thread = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("zerodp-nccl-{rank}"))
                .spawn(move || {
                    let engine = match Engine::new(ordinal, rank, world, id, options, shared) {
                        Ok(engine) => engine,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let _ = ready_tx.send(Ok(()));
                    engine.serve(rx);
                })
                .map_err(|e| {
                    CommError::Closed(format!(
                        "could not start the NCCL thread of rank {rank}: {e}"
                    ))
                })?
        };
        let comm = NcclComm {
            rank,
            world,
            ordinal,
            shared,
            queue: Some(tx),
            thread: Some(thread),
        };
        Ok(Starting { comm, ready })
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
        let Some(queue) = self.queue.as_ref() else {
            return CommHandle::ready(Err(CommError::Closed("NCCL communicator dropped".into())));
        };
        if let Err(mpsc::SendError(job)) = queue.send(Job { call, done }) {
            let _ = job.done.send(Err(CommError::Closed(
                "the NCCL communication thread has exited".into(),
            )));
        }
        handle
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        self.queue.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
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
}

/// The communication thread's state: NCCL's communicator (not `Send`: it lives and dies on this
/// thread), its stream, and staging buffers on the GPU grown to the largest collective so far.
struct Engine {
    comm: Comm,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    options: CommOptions,
    shared: Arc<Shared>,
    /// f32 staging of reductions: the full tensor, then (reduce-scatter) the rank's shard.
    floats: Option<CudaSlice<f32>>,
    /// Byte staging of all-gathers and broadcasts: this rank's shard, then the full tensor.
    bytes: Option<CudaSlice<u8>>,
}

impl Engine {
    fn new(
        ordinal: usize,
        rank: usize,
        world: usize,
        id: Id,
        options: CommOptions,
        shared: Arc<Shared>,
    ) -> Result<Engine, CommError> {
        let ctx = CudaContext::new(ordinal).map_err(|e| failed(rank, "opening the GPU", e))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| failed(rank, "creating a stream", e))?;
        let comm = Comm::from_rank(stream.clone(), rank, world, id)
            .map_err(|e| failed(rank, "ncclCommInitRank", e))?;
        Ok(Engine {
            comm,
            stream,
            rank,
            world,
            options,
            shared,
            floats: None,
            bytes: None,
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
            seq += 1;
            let _ = job.done.send(result);
        }
    }

    fn run_one(&mut self, seq: u64, call: Call) -> Result<Vec<Buffer>, CommError> {
        let desc = describe(&call);
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
            Call::AllReduce(mut buf, op) => {
                let mut wide = widen(&buf);
                self.all_reduce_f32(&mut wide, op)?;
                narrow_into(&wide, &mut buf, 0..wide.len());
                Ok(vec![buf])
            }
            Call::ReduceScatter(input, mut output, op) => {
                let shard = self.reduce_scatter_f32(&input, op)?;
                let all = 0..output.len();
                narrow_into(&shard, &mut output, all);
                Ok(vec![input, output])
            }
            Call::ReduceScatterInPlace(mut buf, op) => {
                let mine = shard_range(buf.len(), self.world, self.rank);
                let shard = self.reduce_scatter_f32(&buf, op)?;
                narrow_into(&shard, &mut buf, mine);
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
                let shard = bytes_of(&buf)[mine.start * size..mine.end * size].to_vec();
                self.all_gather_bytes(&shard, bytes_of_mut(&mut buf), size)?;
                Ok(vec![buf])
            }
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

    fn sync(&self) -> Result<(), CommError> {
        self.stream
            .synchronize()
            .map_err(|e| failed(self.rank, "the collective's stream", e))
    }

    fn all_reduce_f32(&mut self, host: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        let (rank, n, stream) = (self.rank, host.len(), &self.stream);
        let staging = grown(&mut self.floats, stream, n, rank)?;
        let mut view = staging.slice_mut(0..n);
        let copy = |e| failed(rank, "copying between host and GPU", e);
        stream.memcpy_htod(host, &mut view).map_err(copy)?;
        (self.comm.all_reduce_in_place(&mut view, &nccl_op(op)))
            .map_err(|e| failed(rank, "ncclAllReduce", e))?;
        stream.memcpy_dtoh(&view, host).map_err(copy)?;
        self.sync()
    }

    /// This rank's reduced shard (f32, its own length) of `input`, each rank's shard placed at a
    /// stride of the largest for NCCL's equal shards.
    fn reduce_scatter_f32(&mut self, input: &Buffer, op: ReduceOp) -> Result<Vec<f32>, CommError> {
        let (rank, world, len) = (self.rank, self.world, input.len());
        let stride = len.div_ceil(world);
        let mut padded = vec![0f32; stride * world];
        for r in 0..world {
            let range = shard_range(len, world, r);
            widen_range(
                input,
                range.clone(),
                &mut padded[r * stride..][..range.len()],
            );
        }
        let stream = &self.stream;
        let staging = grown(&mut self.floats, stream, stride * (world + 1), rank)?;
        let (mut send, mut recv) = staging.split_at_mut(stride * world);
        let copy = |e| failed(rank, "copying between host and GPU", e);
        stream.memcpy_htod(&padded, &mut send).map_err(copy)?;
        let mut recv = recv.slice_mut(0..stride);
        (self.comm.reduce_scatter(&send, &mut recv, &nccl_op(op)))
            .map_err(|e| failed(rank, "ncclReduceScatter", e))?;
        let mut shard = vec![0f32; stride];
        stream.memcpy_dtoh(&recv, &mut shard).map_err(copy)?;
        self.sync()?;
        shard.truncate(shard_range(len, world, rank).len());
        Ok(shard)
    }

    /// Every rank's shard (`shard`, elements of `size` bytes) into `full`, through NCCL's equal
    /// shards at a stride of the largest.
    fn all_gather_bytes(
        &mut self,
        shard: &[u8],
        full: &mut [u8],
        size: usize,
    ) -> Result<(), CommError> {
        let (rank, world, len) = (self.rank, self.world, full.len() / size);
        let stride = len.div_ceil(world) * size;
        let stream = &self.stream;
        let staging = grown(&mut self.bytes, stream, stride * (world + 1), rank)?;
        let (mut send, mut recv) = staging.split_at_mut(stride);
        let copy = |e| failed(rank, "copying between host and GPU", e);
        let mut padded = vec![0u8; stride];
        padded[..shard.len()].copy_from_slice(shard);
        stream.memcpy_htod(&padded, &mut send).map_err(copy)?;
        let mut recv = recv.slice_mut(0..stride * world);
        (self.comm.all_gather(&send, &mut recv)).map_err(|e| failed(rank, "ncclAllGather", e))?;
        let mut gathered = vec![0u8; stride * world];
        stream.memcpy_dtoh(&recv, &mut gathered).map_err(copy)?;
        self.sync()?;
        for r in 0..world {
            let range = shard_range(len, world, r);
            let bytes = range.len() * size;
            full[range.start * size..][..bytes].copy_from_slice(&gathered[r * stride..][..bytes]);
        }
        Ok(())
    }

    fn broadcast_bytes(&mut self, buf: &mut [u8], root: usize) -> Result<(), CommError> {
        let (rank, n, stream) = (self.rank, buf.len(), &self.stream);
        let staging = grown(&mut self.bytes, stream, n, rank)?;
        let mut view = staging.slice_mut(0..n);
        let copy = |e| failed(rank, "copying between host and GPU", e);
        stream.memcpy_htod(&*buf, &mut view).map_err(copy)?;
        (self.comm.broadcast_in_place(&mut view, root as i32))
            .map_err(|e| failed(rank, "ncclBroadcast", e))?;
        stream.memcpy_dtoh(&view, buf).map_err(copy)?;
        self.sync()
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

fn nccl_op(op: ReduceOp) -> cudarc::nccl::ReduceOp {
    match op {
        ReduceOp::Sum => cudarc::nccl::ReduceOp::Sum,
        ReduceOp::Avg => cudarc::nccl::ReduceOp::Avg,
        ReduceOp::Max => cudarc::nccl::ReduceOp::Max,
    }
}

/// The buffer's elements in f32 (a copy).
fn widen(buf: &Buffer) -> Vec<f32> {
    let mut out = vec![0f32; buf.len()];
    widen_range(buf, 0..buf.len(), &mut out);
    out
}

/// Elements `range` of `buf` in f32, into `out` (as long as the range).
fn widen_range(buf: &Buffer, range: std::ops::Range<usize>, out: &mut [f32]) {
    match buf {
        Buffer::F32(v) => out.copy_from_slice(&v[range]),
        Buffer::BF16(v) => (out.iter_mut().zip(&v[range])).for_each(|(o, x)| *o = x.to_f32()),
        Buffer::F16(v) => (out.iter_mut().zip(&v[range])).for_each(|(o, x)| *o = x.to_f32()),
    }
}

/// `values` rounded to nearest even into elements `range` of `buf` (as long as `values`).
fn narrow_into(values: &[f32], buf: &mut Buffer, range: std::ops::Range<usize>) {
    match buf {
        Buffer::F32(v) => v[range].copy_from_slice(values),
        Buffer::BF16(v) => {
            (v[range].iter_mut().zip(values)).for_each(|(o, &x)| *o = bf16::from_f32(x))
        }
        Buffer::F16(v) => {
            (v[range].iter_mut().zip(values)).for_each(|(o, &x)| *o = f16::from_f32(x))
        }
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
        let mut wide = widen(&bf);
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
