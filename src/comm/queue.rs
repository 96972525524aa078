//! What every backend's communication thread shares: the queued call, its validation and
//! descriptor, and the trace lines of a finished collective.

use crate::comm::rendezvous::{CallDesc, Straggler};
use crate::comm::stats::{bandwidths, count_traffic, CommStats, Placement};
use crate::comm::{
    shard_range, CollectiveKind, CommError, CommOptions, Completion, Partition, ReduceOp,
    TraceLevel, TrafficCounters,
};
use crate::flat::Buffer;
use std::sync::{mpsc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// A collective as queued to the communication thread.
pub(crate) enum Call {
    AllReduce(Buffer, ReduceOp),
    ReduceScatter(Buffer, Buffer, ReduceOp),
    AllGather(Buffer, Buffer),
    /// In place: the rank's shard sits in its own range of the full buffer.
    ReduceScatterInPlace(Buffer, ReduceOp),
    AllGatherInPlace(Buffer),
    /// In place within each group of the partition: the rank's shard sits in its group's range.
    AllGatherGroup(Buffer, Partition),
    /// Within each group of the partition: (input, output), one chunk per member.
    AllToAll(Buffer, Buffer, Partition),
    Broadcast(Buffer, usize),
    Barrier,
}

pub(crate) struct Job {
    pub call: Call,
    pub done: mpsc::Sender<Completion>,
}

/// A backend's communication thread and the queue that feeds it. Dropping it closes the queue,
/// which lets the thread drain what is queued and exit, and then joins the thread.
pub(crate) struct CommThread<M> {
    queue: Option<mpsc::Sender<M>>,
    thread: Option<JoinHandle<()>>,
}

impl<M> CommThread<M> {
    pub(crate) fn new(queue: mpsc::Sender<M>, thread: JoinHandle<()>) -> Self {
        CommThread {
            queue: Some(queue),
            thread: Some(thread),
        }
    }

    /// Queue `message`, or hand it back when the thread has exited.
    pub(crate) fn send(&self, message: M) -> Result<(), M> {
        match &self.queue {
            Some(queue) => queue.send(message).map_err(|mpsc::SendError(m)| m),
            None => Err(message),
        }
    }
}

impl<M> Drop for CommThread<M> {
    fn drop(&mut self) {
        self.queue.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The collectives of a backend whose calls all go through its own `submit(&self, Call) ->
/// CommHandle` (validation, then its communication thread's queue): written once for every
/// backend, inside its `impl Communicator`.
macro_rules! queued_collectives {
    () => {
        fn all_reduce(
            &self,
            buf: $crate::flat::Buffer,
            op: $crate::comm::ReduceOp,
        ) -> $crate::comm::CommHandle {
            self.submit($crate::comm::queue::Call::AllReduce(buf, op))
        }
        fn reduce_scatter(
            &self,
            input: $crate::flat::Buffer,
            output: $crate::flat::Buffer,
            op: $crate::comm::ReduceOp,
        ) -> $crate::comm::CommHandle {
            self.submit($crate::comm::queue::Call::ReduceScatter(input, output, op))
        }
        fn all_gather(
            &self,
            input: $crate::flat::Buffer,
            output: $crate::flat::Buffer,
        ) -> $crate::comm::CommHandle {
            self.submit($crate::comm::queue::Call::AllGather(input, output))
        }
        fn broadcast(&self, buf: $crate::flat::Buffer, root: usize) -> $crate::comm::CommHandle {
            self.submit($crate::comm::queue::Call::Broadcast(buf, root))
        }
        fn barrier(&self) -> $crate::comm::CommHandle {
            self.submit($crate::comm::queue::Call::Barrier)
        }
        fn all_gather_in_place(&self, buf: $crate::flat::Buffer) -> $crate::comm::CommHandle {
            self.submit($crate::comm::queue::Call::AllGatherInPlace(buf))
        }
        fn all_gather_group_in_place(
            &self,
            part: $crate::comm::Partition,
            buf: $crate::flat::Buffer,
        ) -> $crate::comm::CommHandle {
            self.submit($crate::comm::queue::Call::AllGatherGroup(buf, part))
        }
        fn all_to_all_group(
            &self,
            part: $crate::comm::Partition,
            input: $crate::flat::Buffer,
            output: $crate::flat::Buffer,
        ) -> $crate::comm::CommHandle {
            self.submit($crate::comm::queue::Call::AllToAll(input, output, part))
        }
        fn reduce_scatter_in_place(
            &self,
            buf: $crate::flat::Buffer,
            op: $crate::comm::ReduceOp,
        ) -> $crate::comm::CommHandle {
            self.submit($crate::comm::queue::Call::ReduceScatterInPlace(buf, op))
        }
    };
}
pub(crate) use queued_collectives;

/// Checks a call's shapes before it is queued: an invalid call never reaches a meeting.
pub(crate) fn validate(call: &Call, n: usize, rank: usize) -> Result<(), CommError> {
    let bad = |what: String| Err(CommError::InvalidArgument { rank, what });
    match call {
        Call::ReduceScatter(input, output, _) => {
            let want = shard_range(input.len(), n, rank).len();
            if input.dtype() != output.dtype() {
                return bad(format!(
                    "reduce_scatter input is {} but output is {}; use the same dtype",
                    input.dtype(),
                    output.dtype()
                ));
            }
            if output.len() != want {
                return bad(format!(
                    "reduce_scatter of {} elements over {n} ranks: rank {}'s output must hold \
                     its shard of {want} elements (shard_range), not {}",
                    input.len(),
                    rank,
                    output.len()
                ));
            }
        }
        Call::AllGather(input, output) => {
            let want = shard_range(output.len(), n, rank).len();
            if input.dtype() != output.dtype() {
                return bad(format!(
                    "all_gather input is {} but output is {}; use the same dtype",
                    input.dtype(),
                    output.dtype()
                ));
            }
            if input.len() != want {
                return bad(format!(
                    "all_gather into {} elements over {n} ranks: rank {}'s input must be its \
                     shard of {want} elements (shard_range), not {}",
                    output.len(),
                    rank,
                    input.len()
                ));
            }
        }
        Call::AllToAll(input, output, part) => {
            if !part.fits(n) {
                return bad(format!(
                    "a collective within groups ({part:?}) needs groups that divide the world of \
                     {n} ranks"
                ));
            }
            let g = part.group_size(n);
            if input.dtype() != output.dtype() || input.len() != output.len() {
                return bad(format!(
                    "all_to_all input is {} elements of {} but output {} of {}; give both the \
                     same length and dtype",
                    input.len(),
                    input.dtype(),
                    output.len(),
                    output.dtype()
                ));
            }
            if input.len() % g != 0 {
                return bad(format!(
                    "all_to_all of {} elements within groups of {g} ranks: the length must be a \
                     multiple of the group size (one equal chunk per member)",
                    input.len()
                ));
            }
        }
        Call::AllGatherGroup(_, part) if !part.fits(n) => {
            return bad(format!(
                "a collective within groups ({part:?}) needs groups that divide the world of {n} \
                 ranks"
            ));
        }
        Call::Broadcast(_, root) if *root >= n => {
            return bad(format!(
                "broadcast root {root} is not a rank of this world of {n} (0..{n})"
            ));
        }
        _ => {}
    }
    Ok(())
}

/// Books one finished collective of rank `rank` of `world` ranks, in the same way for every
/// backend: its ring-formula traffic, its timing row, and its trace lines.
#[allow(clippy::too_many_arguments)]
pub(crate) fn account(
    (traffic, stats): (&Mutex<TrafficCounters>, &Mutex<CommStats>),
    options: &CommOptions,
    (world, rank): (usize, usize),
    seq: u64,
    desc: &CallDesc,
    elapsed: Duration,
    straggler: Option<Straggler>,
) {
    let elem_bytes = desc.dtype.map_or(0, |d| d.size());
    let bytes = (desc.len * elem_bytes) as u64;
    let at = Placement {
        world,
        rank,
        group: desc.group,
        ranks_per_host: options.ranks_per_host,
    };
    let mut this = TrafficCounters::default();
    count_traffic(&mut this, desc.kind, at, desc.len, elem_bytes, desc.root);
    traffic.lock().unwrap_or_else(|e| e.into_inner()).add(&this);
    stats.lock().unwrap_or_else(|e| e.into_inner()).record(
        desc.kind,
        desc.dtype,
        bytes,
        elapsed,
        straggler.is_some(),
    );
    let inter_host = options.ranks_per_host.map(|_| this.inter_host_sent());
    let sizes = (bytes, inter_host);
    trace(options, world, rank, seq, desc, sizes, elapsed, straggler);
}

/// Writes the trace lines of one finished collective (straggler note at `Warn`, one line per
/// collective at `Info`), in the same format for every backend. `bytes`: the full tensor's;
/// `inter_host`: what this rank sent to other hosts, where the world spans hosts.
#[allow(clippy::too_many_arguments)]
pub(crate) fn trace(
    options: &CommOptions,
    world_size: usize,
    rank: usize,
    seq: u64,
    desc: &CallDesc,
    (bytes, inter_host): (u64, Option<u64>),
    elapsed: Duration,
    straggler: Option<Straggler>,
) {
    let level = options.trace;
    if level >= TraceLevel::Warn {
        if let Some(s) = straggler {
            options.trace_sink.emit(format!(
                "zerodp WARN rank {rank}: straggler at {} #{seq}: arrived {:.3} ms after the first \
                 rank (rank {}); threshold {:.3} ms",
                desc.kind,
                s.late.as_secs_f64() * 1e3,
                s.first_rank,
                options.straggler_threshold.as_secs_f64() * 1e3
            ));
        }
    }
    if level >= TraceLevel::Info {
        let time_us = elapsed.as_secs_f64() * 1e6;
        let line = match desc.dtype {
            None => format!(
                "zerodp INFO rank {rank}: {} #{seq} time={time_us:.1}us world={}",
                desc.kind, world_size
            ),
            Some(dtype) => {
                let (alg, bus) = bandwidths(desc.kind, world_size, bytes, elapsed);
                let mut line = format!(
                    "zerodp INFO rank {rank}: {} #{seq} dtype={dtype} elements={} bytes={bytes} \
                     time={time_us:.1}us algbw={alg:.3}GB/s busbw={bus:.3}GB/s world={}",
                    desc.kind, desc.len, world_size
                );
                match desc.group {
                    Partition::World => {}
                    Partition::Within(h) => line.push_str(&format!(" within={h}")),
                    Partition::Across(h) => line.push_str(&format!(" across={h}")),
                }
                if let Some(b) = inter_host {
                    line.push_str(&format!(" inter_host_sent={b}"));
                }
                line
            }
        };
        options.trace_sink.emit(line);
    }
}

/// The descriptor every rank must present equally for a collective.
pub(crate) fn describe(call: &Call) -> CallDesc {
    match call {
        Call::AllReduce(b, op) => CallDesc {
            kind: CollectiveKind::AllReduce,
            dtype: Some(b.dtype()),
            len: b.len(),
            op: Some(*op),
            root: None,
            group: Partition::World,
        },
        Call::ReduceScatter(i, _, op) | Call::ReduceScatterInPlace(i, op) => CallDesc {
            kind: CollectiveKind::ReduceScatter,
            dtype: Some(i.dtype()),
            len: i.len(),
            op: Some(*op),
            root: None,
            group: Partition::World,
        },
        Call::AllGather(_, o) | Call::AllGatherInPlace(o) => CallDesc {
            kind: CollectiveKind::AllGather,
            dtype: Some(o.dtype()),
            len: o.len(),
            op: None,
            root: None,
            group: Partition::World,
        },
        Call::AllGatherGroup(o, part) => CallDesc {
            kind: CollectiveKind::AllGather,
            dtype: Some(o.dtype()),
            len: o.len(),
            op: None,
            root: None,
            group: *part,
        },
        Call::AllToAll(i, _, part) => CallDesc {
            kind: CollectiveKind::AllToAll,
            dtype: Some(i.dtype()),
            len: i.len(),
            op: None,
            root: None,
            group: *part,
        },
        Call::Broadcast(b, root) => CallDesc {
            kind: CollectiveKind::Broadcast,
            dtype: Some(b.dtype()),
            len: b.len(),
            op: None,
            root: Some(*root),
            group: Partition::World,
        },
        Call::Barrier => CallDesc::barrier(),
    }
}
