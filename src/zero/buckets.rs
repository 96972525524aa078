//! Communication buckets: gradients (and, after the optimizer step, parameter shards) are copied into
//! a few preallocated buckets and reduced or gathered one bucket at a time, DeepSpeed's IPG buckets
//! with a true reduce-scatter.
//!
//! A reduce-scatter bucket is laid out rank-major: `world` regions of `region` elements each, where
//! region q holds the pieces of rank q's shards of the units in the bucket. Reduce-scattering the
//! bucket then hands every rank exactly its own shard pieces, whatever mix of units the bucket holds,
//! and a unit larger than a bucket is split into pieces at the same shard offsets on every rank. An
//! all-gather bucket is the mirror image. An all-reduce bucket (stage 0) is plain concatenation.
//!
//! The sharded collectives run in place (NCCL's in-place forms): the reduce-scatter leaves the
//! rank's reduced pieces in its own region of the bucket, and the all-gather takes the rank's
//! pieces from there. A bucket therefore needs no second, one-region buffer for the shard: it
//! costs exactly its own bytes (as DeepSpeed's `reduce_bucket_size` reads), and the in-place forms
//! also skip the copy between the two buffers.
//!
//! With two buckets (`overlap_comm`) one fills while the other is in flight; with one, each bucket
//! is waited for as soon as it is launched. Every decision depends only on the layout and the order
//! of pushes, never on timing, so every rank issues the same collectives in the same order.

use super::buffers::BufferPlan;
use super::flat::FlatLayout;
use super::precision::{FlatBuffer, Slice};
use super::state::FlatState;
use crate::comm::{Buffer, CommError, CommHandle, Communicator, DType, ReduceOp};

/// What a bucket does and where its results go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BucketMode {
    /// Stage 0: all-reduce (average) full gradients in place.
    AllReduce,
    /// Stage 1: reduce-scatter (average) full gradients; the own shard of the full gradient buffer
    /// receives the result.
    ReduceScatterStore,
    /// Stages 2-3: reduce-scatter (average) transient full gradients; the result is added to the
    /// rank's gradient shard accumulator.
    ReduceScatterAccumulate,
    /// Stages 1-2 after the optimizer step: all-gather the updated parameter shards into the full
    /// parameter buffers.
    AllGather,
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

/// The engine's reduction buckets.
pub struct Buckets {
    slots: Vec<Slot>,
    current: usize,
    region: usize,
    world: usize,
    overlap: bool,
    mode: BucketMode,
    /// Dtype of gradient reductions (`communication_data_type`).
    comm_dtype: DType,
    /// Dtype of the post-step all-gather (the parameters').
    param_dtype: DType,
}

impl Buckets {
    /// Allocate the buckets of `plan` (once, for the whole run).
    pub fn new(plan: &BufferPlan, world: usize) -> Self {
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
            overlap: plan.bucket_count > 1,
            mode: BucketMode::AllReduce,
            comm_dtype: plan.comm_dtype,
            param_dtype: plan.param_dtype,
        }
    }

    /// Switch what the buckets do; only between flushes. The all-gather moves parameters in their
    /// own dtype: where gradients are reduced in another (16-bit parameters, f32 reductions) the
    /// buckets are re-typed, never larger than planned since the reduction dtype is the wider.
    pub fn set_mode(&mut self, mode: BucketMode) {
        assert!(
            self.is_idle(),
            "bucket mode changed while a bucket is in use"
        );
        self.mode = mode;
        let dtype = match mode {
            BucketMode::AllGather => self.param_dtype,
            _ => self.comm_dtype,
        };
        for slot in &mut self.slots {
            if slot.big.dtype() != dtype {
                slot.big = Buffer::zeros(dtype, slot.big.len());
            }
        }
    }

    fn is_idle(&self) -> bool {
        self.slots.iter().all(|s| s.used == 0 && s.flight.is_none())
    }

    /// Elements one bucket takes per rank region.
    fn capacity(&self) -> usize {
        match self.mode {
            BucketMode::AllReduce => self.region * self.world,
            _ => self.region,
        }
    }

    /// Add all of unit `unit` (its gradient, or at [`BucketMode::AllGather`] its parameter shard),
    /// launching buckets as they fill. The source may be released when this returns.
    pub fn push(
        &mut self,
        comm: &dyn Communicator,
        unit: usize,
        state: &mut FlatState,
        layout: &FlatLayout,
    ) -> Result<(), CommError> {
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
            let own = layout.own_shard(unit);
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
                BucketMode::AllGather => {
                    // The rank's own region, as the reduce-scatter lays regions out.
                    let from = own.start + start;
                    let to = layout.rank * region + seg.offset;
                    slot.big
                        .slice_mut(to..to + len)
                        .copy_from(state.params(unit).slice(from..from + len));
                }
            }
            slot.segments.push(seg);
            slot.used += len;
            start += len;
            if slot.used == cap {
                self.launch(comm, state, layout)?;
            }
        }
        Ok(())
    }

    /// Launch the partly filled bucket, wait for every bucket in flight and apply the results.
    pub fn flush(
        &mut self,
        comm: &dyn Communicator,
        state: &mut FlatState,
        layout: &FlatLayout,
    ) -> Result<(), CommError> {
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
            BucketMode::AllGather => {
                // The rank's region moves to where the gathered bucket of `world * used` elements
                // has it (leftwards, as above; the other regions are overwritten by the gather).
                let own = layout.rank * region;
                big.copy_within(own..own + used, layout.rank * used);
                big.truncate(world * used);
                comm.all_gather_in_place(big)
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
            let u = layout.units[seg.unit];
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
                BucketMode::AllGather => {
                    for q in 0..world {
                        let to = q * u.shard_len + seg.start;
                        let from = q * used + seg.offset;
                        state
                            .full_params_mut(seg.unit)
                            .slice_mut(to..to + seg.len)
                            .copy_from(big.slice(from..from + seg.len));
                    }
                }
            }
        }
        big.resize_zeroed(region * world);
        slot.big = big;
        slot.used = 0;
        Ok(())
    }
}
