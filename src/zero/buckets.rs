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
//! With two buckets (`overlap_comm`) one fills while the other is in flight; with one, each bucket
//! is waited for as soon as it is launched. Every decision depends only on the layout and the order
//! of pushes, never on timing, so every rank issues the same collectives in the same order.

use super::buffers::BufferPlan;
use super::flat::FlatLayout;
use crate::comm::{Buffer, CommError, CommHandle, Communicator, ReduceOp};
use crate::optim::kernels::add_in_place;

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

/// The flat buffers buckets read from and write to.
#[derive(Debug, Default)]
pub struct FlatState {
    /// Full padded parameters per unit (stages 0-2; empty at stage 3).
    pub params: Vec<Vec<f32>>,
    /// Full padded gradients per unit: persistent at stages 0-1, transient at stages 2-3 (a unit's
    /// entry is empty while it holds no gradient).
    pub grads: Vec<Vec<f32>>,
    /// The rank's gradient shards of every unit, concatenated (stages 2-3).
    pub grad_shards: Vec<f32>,
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

#[derive(Default)]
struct Slot {
    /// `world * region` elements (or the whole bucket at stage 0).
    big: Vec<f32>,
    /// One region (reduce-scatter output, all-gather input).
    small: Vec<f32>,
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
}

impl Buckets {
    /// Allocate the buckets of `plan` (once, for the whole run).
    pub fn new(plan: &BufferPlan, world: usize) -> Self {
        let region = plan.bucket_elems / world;
        let slots = (0..plan.bucket_count)
            .map(|_| Slot {
                big: vec![0.0; plan.bucket_elems],
                small: vec![0.0; plan.region_elems],
                ..Slot::default()
            })
            .collect();
        Buckets {
            slots,
            current: 0,
            region,
            world,
            overlap: plan.bucket_count > 1,
            mode: BucketMode::AllReduce,
        }
    }

    /// Switch what the buckets do; only between flushes.
    pub fn set_mode(&mut self, mode: BucketMode) {
        assert!(
            self.is_idle(),
            "bucket mode changed while a bucket is in use"
        );
        self.mode = mode;
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
                    slot.big[seg.offset..seg.offset + len]
                        .copy_from_slice(&state.grads[unit][start..start + len]);
                }
                BucketMode::ReduceScatterStore | BucketMode::ReduceScatterAccumulate => {
                    let src = &state.grads[unit];
                    for q in 0..self.world {
                        let from = q * u.shard_len + start;
                        let to = q * region + seg.offset;
                        slot.big[to..to + len].copy_from_slice(&src[from..from + len]);
                    }
                }
                BucketMode::AllGather => {
                    let from = own.start + start;
                    slot.small[seg.offset..seg.offset + len]
                        .copy_from_slice(&state.params[unit][from..from + len]);
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
        let mut big = std::mem::take(&mut slot.big);
        let mut small = match mode {
            BucketMode::AllReduce => Vec::new(),
            _ => std::mem::take(&mut slot.small),
        };
        let handle = match mode {
            BucketMode::AllReduce => {
                big.truncate(used);
                comm.all_reduce(Buffer::F32(big), ReduceOp::Avg)
            }
            BucketMode::ReduceScatterStore | BucketMode::ReduceScatterAccumulate => {
                // Close the gaps between partly filled regions: region q moves from q*region to
                // q*used (leftwards, so increasing q never overwrites unread data).
                for q in 1..world {
                    big.copy_within(q * region..q * region + used, q * used);
                }
                big.truncate(world * used);
                small.truncate(used);
                comm.reduce_scatter(Buffer::F32(big), Buffer::F32(small), ReduceOp::Avg)
            }
            BucketMode::AllGather => {
                small.truncate(used);
                big.truncate(world * used);
                comm.all_gather(Buffer::F32(small), Buffer::F32(big))
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
        let (big, small) = match mode {
            BucketMode::AllReduce => (handle.wait_one()?, Buffer::F32(Vec::new())),
            BucketMode::ReduceScatterStore | BucketMode::ReduceScatterAccumulate => {
                let (input, output) = handle.wait_pair()?;
                (input, output)
            }
            BucketMode::AllGather => {
                let (input, output) = handle.wait_pair()?;
                (output, input)
            }
        };
        let mut big = big.into_f32().expect("f32 bucket");
        let mut small = small.into_f32().expect("f32 bucket");
        for seg in slot.segments.drain(..) {
            let u = layout.units[seg.unit];
            let res = seg.offset..seg.offset + seg.len;
            match mode {
                BucketMode::AllReduce => {
                    state.grads[seg.unit][seg.start..seg.start + seg.len]
                        .copy_from_slice(&big[res]);
                }
                BucketMode::ReduceScatterStore => {
                    let at = layout.own_shard(seg.unit).start + seg.start;
                    state.grads[seg.unit][at..at + seg.len].copy_from_slice(&small[res]);
                }
                BucketMode::ReduceScatterAccumulate => {
                    let at = layout.shard_slot(seg.unit).start + seg.start;
                    add_in_place(&mut state.grad_shards[at..at + seg.len], &small[res]);
                }
                BucketMode::AllGather => {
                    for q in 0..world {
                        let to = q * u.shard_len + seg.start;
                        let from = q * used + seg.offset;
                        state.params[seg.unit][to..to + seg.len]
                            .copy_from_slice(&big[from..from + seg.len]);
                    }
                }
            }
        }
        big.resize(region * world, 0.0);
        slot.big = big;
        if mode != BucketMode::AllReduce {
            small.resize(region, 0.0);
            slot.small = small;
        }
        slot.used = 0;
        Ok(())
    }
}
