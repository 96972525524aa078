//! Gradient reduction: gradients are copied into a few preallocated buckets and reduced one bucket
//! at a time, DeepSpeed's IPG buckets with a true reduce-scatter; or, where a unit's own buffer
//! serves, reduced in place in it. (The stage 1-2 all-gather of updated parameters always runs in
//! place in each unit's parameters: `Engine::gather_updated`.)
//!
//! A reduce-scatter bucket is laid out rank-major: `world` regions of `region` elements each, where
//! region q holds the pieces of rank q's shards of the units in the bucket. Reduce-scattering the
//! bucket then hands every rank exactly its own shard pieces, whatever mix of units the bucket holds,
//! and a unit larger than a bucket is split into pieces at the same shard offsets on every rank. An
//! all-reduce bucket (stage 0, gradients kept in another dtype) is plain concatenation.
//!
//! The reduce-scatter runs in place (NCCL's in-place form): it leaves the rank's reduced pieces in
//! its own region of the bucket. A bucket therefore needs no second, one-region buffer for the
//! shard: it costs exactly its own bytes (as DeepSpeed's `reduce_bucket_size` reads).
//!
//! Where a unit's own buffer already is what a collective needs, the buckets step aside and the
//! collective runs in place in it, one per unit (FSDP2's way): no copy in, no copy out, and no
//! bucket memory (see [`reduction_plan`](super::buffers::reduction_plan)). That is the stage 0-1
//! reduction of gradients kept in the communication dtype (the all-reduce, or the reduce-scatter
//! that leaves the rank's shard at its place in the unit's full gradient). Stages 2-3
//! reduce-scatter each transient gradient in place when the plan has room
//! for it (f32 reductions, units no larger than a bucket): the buffer goes back to the free ones
//! when its collective is done, after its shard has been added to the rank's gradient shards;
//! otherwise a bucket copies it and it is free at once.
//!
//! With `reduce_bucket_size` 0 (DeepSpeed's "each gradient on its own") every unit's gradient is
//! reduced on its own: in place where the dtypes allow it at any unit size, else through a bucket
//! of one unit that is launched as soon as the unit is in it (`BufferPlan::per_unit`).
//!
//! With two buckets (`overlap_comm`) one fills while the other is in flight; with one, each bucket
//! is waited for as soon as it is launched. In-place unit collectives stay in flight until the
//! flush with `overlap_comm` (the stage 2-3 ones, which hold transient buffers, at most
//! `buffers::units_in_flight` of them: the oldest is waited for before
//! another is issued), and are waited for one by one without it. Every decision depends only on
//! the layout and the order of pushes, never on timing, so every rank issues the same collectives
//! in the same order.

use super::buffers::BufferPlan;
use super::layout::FlatLayout;
use super::state::FlatState;
use crate::flat::Slice;
use std::collections::VecDeque;

use super::qgz;
use crate::comm::{CommError, CommHandle, Communicator, ReduceOp};
use crate::flat::Buffer;

/// Which reduction the buckets do and where its results go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BucketMode {
    /// Stage 0: all-reduce (average) full gradients in place.
    AllReduce,
    /// Stage 1: reduce-scatter (average) full gradients; the own shard of the full gradient buffer
    /// receives the result.
    ReduceScatterStore,
    /// Stages 2-3: reduce-scatter (average) transient full gradients; the result is added to the
    /// rank's gradient shard accumulator.
    ReduceScatterAccumulate,
}

/// A piece of one unit in a bucket.
#[derive(Clone, Copy, Debug)]
struct Segment {
    unit: usize,
    /// Start inside the unit (all-reduce) or inside each rank's shard of the unit.
    start: usize,
    len: usize,
    /// Position inside the bucket region.
    offset: usize,
}

struct Slot {
    /// `world * region` elements (or the whole bucket at stage 0); the sharded collectives work
    /// on it in place.
    big: Buffer,
    segments: Vec<Segment>,
    used: usize,
    flight: Option<CommHandle>,
}

/// A unit's in-place reduction in flight.
enum InFlight {
    /// One collective in the unit's own buffer.
    Plain(usize, CommHandle),
    /// qgZ's all-to-alls, one phase after the other ([`qgz`]).
    Quantized(qgz::Flight),
}

/// qgZ's hosts and its spare payload buffers (one pair per unit that can be in flight).
struct Qgz {
    hosts: qgz::Hosts,
    spare: Vec<(Buffer, Buffer)>,
}

/// The engine's reduction buckets.
pub struct Buckets {
    slots: Vec<Slot>,
    current: usize,
    region: usize,
    world: usize,
    overlap: bool,
    mode: BucketMode,
    /// Whether the gradient reductions run in place in each unit's own gradient buffer.
    reduce_in_place: bool,
    /// Whether a bucket holds one unit and is launched as soon as that unit is in it.
    per_unit: bool,
    /// In-place unit collectives in flight, in the order they were issued.
    units_in_flight: VecDeque<InFlight>,
    /// ZeRO++'s quantized gradients (qgZ): the hosts, and the payload buffers not in flight.
    qgz: Option<Qgz>,
    /// Stages 2-3: transient gradients in flight at most (the plan's `units_in_flight`).
    max_in_flight: usize,
}

impl Buckets {
    /// Allocate the buckets of `plan` (once, for the whole run); `overlap` is `overlap_comm`.
    pub fn new(plan: &BufferPlan, world: usize, overlap: bool) -> Self {
        let region = plan.bucket_elems / world;
        let slots = (0..plan.bucket_count)
            .map(|_| Slot {
                big: Buffer::zeros(plan.comm_dtype, plan.bucket_elems),
                segments: Vec::new(),
                used: 0,
                flight: None,
            })
            .collect();
        Buckets {
            slots,
            current: 0,
            region,
            world,
            overlap,
            mode: BucketMode::AllReduce,
            reduce_in_place: plan.reduce_in_place,
            per_unit: plan.per_unit,
            units_in_flight: VecDeque::new(),
            max_in_flight: plan.units_in_flight,
            qgz: None,
        }
    }

    /// With ZeRO++'s quantized gradients (qgZ): the stage 2-3 reductions, which `plan` runs per
    /// unit in place, go through [`qgz`]'s two all-to-alls over `hosts` (world and ranks per
    /// host), with the payload buffers the plan sized (`qgz_payload_pairs` pairs for units of
    /// `qgz_payload_elems` elements).
    pub(crate) fn with_quantized_gradients(mut self, plan: &BufferPlan, hosts: qgz::Hosts) -> Self {
        let spare = (0..plan.qgz_payload_pairs)
            .map(|_| qgz::payload_pair(plan.qgz_payload_elems))
            .collect();
        self.qgz = Some(Qgz { hosts, spare });
        self
    }

    /// Switch what the buckets do; only between flushes.
    pub(crate) fn set_mode(&mut self, mode: BucketMode) {
        assert!(
            self.is_idle(),
            "bucket mode changed while a bucket is in use"
        );
        self.mode = mode;
    }

    fn is_idle(&self) -> bool {
        self.units_in_flight.is_empty()
            && self.slots.iter().all(|s| s.used == 0 && s.flight.is_none())
    }

    /// Elements one bucket takes per rank region.
    fn capacity(&self) -> usize {
        match self.mode {
            BucketMode::AllReduce => self.region * self.world,
            _ => self.region,
        }
    }

    /// Add unit `unit`'s gradient, launching buckets as they fill, or its own collective in place.
    /// A transient gradient (stages 2-3) is consumed: its buffer goes back to the free ones, now
    /// or when its collective in place is done.
    pub fn push(
        &mut self,
        comm: &dyn Communicator,
        unit: usize,
        state: &mut FlatState,
        layout: &FlatLayout,
    ) -> Result<(), CommError> {
        if self.reduce_in_place {
            return self.launch_unit(comm, unit, state, layout);
        }
        let u = layout.units[unit];
        let total = match self.mode {
            BucketMode::AllReduce => u.padded,
            _ => u.shard_len,
        };
        let cap = self.capacity();
        let mut start = 0;
        while start < total {
            if self.slots[self.current].flight.is_some() {
                self.complete(self.current, state, layout)?;
            }
            let region = self.region;
            let slot = &mut self.slots[self.current];
            let len = (cap - slot.used).min(total - start);
            let seg = Segment {
                unit,
                start,
                len,
                offset: slot.used,
            };
            match self.mode {
                BucketMode::AllReduce => {
                    slot.big
                        .slice_mut(seg.offset..seg.offset + len)
                        .copy_from(state.full_grad(unit, start..start + len));
                }
                BucketMode::ReduceScatterStore => {
                    for q in 0..self.world {
                        let from = q * u.shard_len + start;
                        let to = q * region + seg.offset;
                        slot.big
                            .slice_mut(to..to + len)
                            .copy_from(state.full_grad(unit, from..from + len));
                    }
                }
                BucketMode::ReduceScatterAccumulate => {
                    let src = &state.grads[unit];
                    for q in 0..self.world {
                        let from = q * u.shard_len + start;
                        let to = q * region + seg.offset;
                        slot.big
                            .slice_mut(to..to + len)
                            .copy_from(Slice::F32(&src[from..from + len]));
                    }
                }
            }
            slot.segments.push(seg);
            slot.used += len;
            start += len;
            if slot.used == cap {
                self.launch(comm, state, layout)?;
            }
        }
        let slot = &self.slots[self.current];
        if self.per_unit && slot.used > 0 && slot.flight.is_none() {
            self.launch(comm, state, layout)?;
        }
        if self.mode == BucketMode::ReduceScatterAccumulate {
            state.grad_pool.give(&mut state.grads[unit]);
        }
        Ok(())
    }

    /// Issue unit `unit`'s collective in place in its own buffer, which the unit lacks until
    /// [`Buckets::complete_units`] puts it back.
    fn launch_unit(
        &mut self,
        comm: &dyn Communicator,
        unit: usize,
        state: &mut FlatState,
        layout: &FlatLayout,
    ) -> Result<(), CommError> {
        if layout.units[unit].padded == 0 {
            if self.mode == BucketMode::ReduceScatterAccumulate {
                state.grad_pool.give(&mut state.grads[unit]);
            }
            return Ok(());
        }
        // A unit in qgZ's first phase goes back in line for its second, so wait until one is
        // done: every rank decides alike, from the order of pushes alone.
        while self.mode == BucketMode::ReduceScatterAccumulate
            && self.units_in_flight.len() >= self.max_in_flight.max(1)
        {
            self.complete_oldest_unit(comm, state, layout)?;
        }
        let quantized = self.mode == BucketMode::ReduceScatterAccumulate;
        let flight = match self.qgz.as_mut().filter(|_| quantized) {
            Some(q) => {
                let grad = std::mem::take(&mut state.grads[unit]);
                let payloads = q.spare.pop().ok_or_else(|| CommError::InvalidArgument {
                    rank: layout.rank,
                    what: "qgZ ran out of its planned payload buffers".into(),
                })?;
                InFlight::Quantized(qgz::start(comm, q.hosts, unit, grad, payloads)?)
            }
            None => {
                let grad = state.take_grad(unit);
                InFlight::Plain(
                    unit,
                    match self.mode {
                        BucketMode::AllReduce => comm.all_reduce(grad, ReduceOp::Avg),
                        BucketMode::ReduceScatterStore | BucketMode::ReduceScatterAccumulate => {
                            comm.reduce_scatter_in_place(grad, ReduceOp::Avg)
                        }
                    },
                )
            }
        };
        self.units_in_flight.push_back(flight);
        if !self.overlap {
            self.complete_units(comm, state, layout)?;
        }
        Ok(())
    }

    /// Wait for the in-place unit collectives in flight, in the order they were issued.
    fn complete_units(
        &mut self,
        comm: &dyn Communicator,
        state: &mut FlatState,
        layout: &FlatLayout,
    ) -> Result<(), CommError> {
        while !self.units_in_flight.is_empty() {
            self.complete_oldest_unit(comm, state, layout)?;
        }
        Ok(())
    }

    /// Wait for the oldest in-place unit collective and give its unit the buffer back, the reduced
    /// gradient (at stage 1, its own shard at its place); a transient gradient's shard is added to
    /// the rank's gradient shards and the buffer freed. A unit in qgZ's first phase goes on to its
    /// second, at the back of the line.
    fn complete_oldest_unit(
        &mut self,
        comm: &dyn Communicator,
        state: &mut FlatState,
        layout: &FlatLayout,
    ) -> Result<(), CommError> {
        let (unit, buf) = match self.units_in_flight.pop_front() {
            None => return Ok(()),
            Some(InFlight::Plain(unit, handle)) => (unit, handle.wait_one()?),
            Some(InFlight::Quantized(flight)) => {
                let Some(q) = self.qgz.as_mut() else {
                    return Err(CommError::InvalidArgument {
                        rank: layout.rank,
                        what: "a quantized reduction in flight without qgZ's buffers".into(),
                    });
                };
                match qgz::advance(comm, q.hosts, flight)? {
                    qgz::Advanced::InFlight(next) => {
                        self.units_in_flight.push_back(InFlight::Quantized(next));
                        return Ok(());
                    }
                    qgz::Advanced::Done {
                        unit,
                        grad,
                        payloads,
                    } => {
                        q.spare.push(payloads);
                        (unit, Buffer::F32(grad))
                    }
                }
            }
        };
        match self.mode {
            BucketMode::AllReduce | BucketMode::ReduceScatterStore => {
                state.put_grad(unit, buf, layout.rank)?
            }
            BucketMode::ReduceScatterAccumulate => {
                let own = layout.own_shard(unit);
                let at = layout.shard_slot(unit);
                state.grad_shards_mut().slice_mut(at).add(buf.slice(own));
                let mut grad = crate::comm::returned_f32(buf, layout.rank)?;
                state.grad_pool.give(&mut grad);
            }
        }
        Ok(())
    }

    /// Launch the partly filled bucket, wait for every bucket and unit collective in flight and
    /// apply the results.
    pub fn flush(
        &mut self,
        comm: &dyn Communicator,
        state: &mut FlatState,
        layout: &FlatLayout,
    ) -> Result<(), CommError> {
        self.complete_units(comm, state, layout)?;
        if self.slots.is_empty() {
            return Ok(());
        }
        let cur = &self.slots[self.current];
        if cur.used > 0 && cur.flight.is_none() {
            self.launch(comm, state, layout)?;
        }
        for i in 0..self.slots.len() {
            if self.slots[i].flight.is_some() {
                self.complete(i, state, layout)?;
            }
        }
        Ok(())
    }

    /// Issue the collective of the current bucket and move on to the next one.
    fn launch(
        &mut self,
        comm: &dyn Communicator,
        state: &mut FlatState,
        layout: &FlatLayout,
    ) -> Result<(), CommError> {
        let idx = self.current;
        let (world, region, mode) = (self.world, self.region, self.mode);
        let slot = &mut self.slots[idx];
        let used = slot.used;
        let dtype = slot.big.dtype();
        let mut big = std::mem::replace(&mut slot.big, Buffer::zeros(dtype, 0));
        let handle = match mode {
            BucketMode::AllReduce => {
                big.truncate(used);
                comm.all_reduce(big, ReduceOp::Avg)
            }
            BucketMode::ReduceScatterStore | BucketMode::ReduceScatterAccumulate => {
                // Close the gaps between partly filled regions: region q moves from q*region to
                // q*used (leftwards, so increasing q never overwrites unread data).
                for q in 1..world {
                    big.copy_within(q * region..q * region + used, q * used);
                }
                big.truncate(world * used);
                comm.reduce_scatter_in_place(big, ReduceOp::Avg)
            }
        };
        slot.flight = Some(handle);
        self.current = (idx + 1) % self.slots.len();
        if !self.overlap {
            self.complete(idx, state, layout)?;
        }
        Ok(())
    }

    /// Wait for bucket `idx`, write its results to their destinations and make it reusable.
    fn complete(
        &mut self,
        idx: usize,
        state: &mut FlatState,
        layout: &FlatLayout,
    ) -> Result<(), CommError> {
        let (world, region, mode) = (self.world, self.region, self.mode);
        let slot = &mut self.slots[idx];
        let handle = slot.flight.take().expect("bucket in flight");
        let used = slot.used;
        let mut big = handle.wait_one()?;
        // The reduce-scatter leaves the rank's reduced region at its place in the closed-up bucket.
        let own = layout.rank * used;
        for seg in slot.segments.drain(..) {
            let res = seg.offset..seg.offset + seg.len;
            match mode {
                BucketMode::AllReduce => {
                    state
                        .full_grad_mut(seg.unit, seg.start..seg.start + seg.len)
                        .copy_from(big.slice(res));
                }
                BucketMode::ReduceScatterStore => {
                    let at = layout.own_shard(seg.unit).start + seg.start;
                    state
                        .full_grad_mut(seg.unit, at..at + seg.len)
                        .copy_from(big.slice(own + res.start..own + res.end));
                }
                BucketMode::ReduceScatterAccumulate => {
                    let at = layout.shard_slot(seg.unit).start + seg.start;
                    state
                        .grad_shards_mut()
                        .slice_mut(at..at + seg.len)
                        .add(big.slice(own + res.start..own + res.end));
                }
            }
        }
        big.resize_zeroed(region * world);
        slot.big = big;
        slot.used = 0;
        Ok(())
    }
}
