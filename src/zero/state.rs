//! What one rank keeps of the model between visits, by stage: the parameters, the gradients the
//! model writes and the reduced gradients. The engine trains on it and the
//! [`Buckets`](super::buckets::Buckets) reduce and gather through it.
//!
//! The stages differ in what they keep, so [`StageState`] has one variant per layout: code that
//! depends on the stage matches on it and finds there exactly the buffers the stage has.

use super::buffers::BufferPlan;
use super::gather::Coordinator;
use crate::comm::CommError;
use crate::flat::{Buffer, Slice, SliceMut};
use std::ops::Range;

/// A rank's flat buffers.
pub struct FlatState {
    /// Full padded f32 gradients per unit, as the model writes them: persistent (and the kept
    /// gradients themselves) at stages 0-1 with f32 accumulation, transient otherwise (a unit's
    /// entry is empty while it holds no gradient; see [`StageState::transient_grads`]).
    pub grads: Vec<Vec<f32>>,
    /// The free transient gradient buffers (empty where the gradients are kept).
    pub grad_pool: GradPool,
    /// The parameters and reduced gradients, as the stage keeps them.
    pub stage: StageState,
}

/// The free transient full-unit f32 gradient buffers, allocated once (as many and as large as
/// the plan says): a unit takes one when a backward first writes its gradient and gives it back
/// once the gradient has been accumulated or reduced.
pub struct GradPool {
    free: Vec<Vec<f32>>,
    /// Each unit's buffer size, as the plan replayed the backward (`BufferPlan::grad_buffer_of`).
    size_of: Vec<usize>,
}

impl GradPool {
    /// Every buffer is written once here, so its memory is the process's from the start: the
    /// plan and the pre-flight count all of them, and a buffer first used in the middle of a run
    /// (when more reductions happen to be in flight) would otherwise commit its pages only then,
    /// past the check, and the resident set would follow the threads' timing.
    pub fn new(plan: &BufferPlan) -> Self {
        let free = (plan.grad_scratch.iter())
            .map(|&elems| {
                let mut g = vec![0.0f32; elems];
                crate::flat::touch_pages(&mut g);
                g.clear();
                g
            })
            .collect();
        let size_of = (plan.grad_buffer_of.iter())
            .map(|&b| plan.grad_scratch[b])
            .collect();
        GradPool { free, size_of }
    }
    /// A zeroed buffer for unit `unit`'s gradient of `len` elements: one of the size the plan
    /// gave the unit (buffers of a size are alike), else the smallest free one that holds it. A
    /// take the plan did not foresee gets a buffer of its own rather than failing the step.
    pub fn take(&mut self, unit: usize, len: usize) -> Vec<f32> {
        let planned = self.size_of.get(unit).copied().filter(|&c| c >= len);
        let at = match planned.and_then(|c| self.free.iter().position(|g| g.capacity() == c)) {
            Some(i) => Some(i),
            None => (self.free.iter().enumerate())
                .filter(|(_, g)| g.capacity() >= len)
                .min_by_key(|(_, g)| g.capacity())
                .map(|(i, _)| i),
        };
        let mut g = match at {
            Some(i) => self.free.swap_remove(i),
            None => Vec::with_capacity(len),
        };
        g.resize(len, 0.0);
        g
    }
    /// Take the buffer out of `slot` (leaving it empty) and keep it for reuse.
    pub fn give(&mut self, slot: &mut Vec<f32>) {
        let mut g = std::mem::take(slot);
        g.clear();
        self.free.push(g);
    }
}

/// The stage-dependent buffers. Dtypes: parameters in the parameter dtype, kept gradients in the
/// accumulation dtype.
pub enum StageState {
    /// Stages 0-1: full parameters and full gradients on every rank (stage 1 reduces and reads
    /// only the own shard of the gradients).
    Replicated {
        /// Full padded parameters per unit.
        params: Vec<Buffer>,
        /// Accumulation in a 16-bit dtype: the kept full gradients per unit, into which each
        /// micro-step's transient f32 `grads` are added. `None`: the f32 `grads` are kept.
        kept_grads: Option<Vec<Buffer>>,
    },
    /// Stage 2: full parameters, and only the rank's gradient shards.
    ShardedGrads {
        /// Full padded parameters per unit.
        params: Vec<Buffer>,
        /// The rank's gradient shards of every unit, concatenated.
        grad_shards: Buffer,
    },
    /// Stage 3: only shards of both; the coordinator holds the parameter shards and gathers
    /// units for their visits.
    ShardedParams {
        coordinator: Coordinator,
        /// The rank's gradient shards of every unit, concatenated.
        grad_shards: Buffer,
    },
}

impl StageState {
    /// Whether the f32 gradients the model writes are transient (taken for a backward, given
    /// back once reduced or accumulated): everywhere but stages 0-1 with f32 accumulation.
    pub fn transient_grads(&self) -> bool {
        !matches!(
            self,
            StageState::Replicated {
                kept_grads: None,
                ..
            }
        )
    }
}

impl FlatState {
    /// Unit `unit`'s padded parameters as the model reads them: at stage 3 the gathered ones,
    /// which must be ready.
    pub fn params(&self, unit: usize) -> &Buffer {
        match &self.stage {
            StageState::Replicated { params, .. } | StageState::ShardedGrads { params, .. } => {
                &params[unit]
            }
            StageState::ShardedParams { coordinator, .. } => coordinator.params(unit),
        }
    }
    /// Unit `unit`'s full padded parameters at stages 0-2, as the post-step all-gather writes them.
    pub(crate) fn full_params_mut(&mut self, unit: usize) -> &mut Buffer {
        match &mut self.stage {
            StageState::Replicated { params, .. } | StageState::ShardedGrads { params, .. } => {
                &mut params[unit]
            }
            StageState::ShardedParams { .. } => panic!("stage 3 keeps no full parameters"),
        }
    }
    /// Unit `unit`'s full gradient at stages 0-1, as the buckets and the optimizer read it.
    pub(crate) fn full_grad(&self, unit: usize, r: Range<usize>) -> Slice<'_> {
        match &self.stage {
            StageState::Replicated { kept_grads, .. } => {
                full_grad_of(kept_grads.as_deref(), &self.grads, unit, r)
            }
            _ => panic!("stages 2-3 keep no full gradients"),
        }
    }
    /// Unit `unit`'s full gradient at stages 0-1, as the buckets write it.
    pub(crate) fn full_grad_mut(&mut self, unit: usize, r: Range<usize>) -> SliceMut<'_> {
        match &mut self.stage {
            StageState::Replicated {
                kept_grads: Some(kept),
                ..
            } => kept[unit].slice_mut(r),
            StageState::Replicated {
                kept_grads: None, ..
            } => SliceMut::F32(&mut self.grads[unit][r]),
            _ => panic!("stages 2-3 keep no full gradients"),
        }
    }
    /// Take the buffer holding unit `unit`'s gradient out, for a collective to run in place in
    /// it: the kept 16-bit gradient at stages 0-1 with 16-bit accumulation, else the f32 one the
    /// model wrote (kept at stages 0-1, transient at stages 2-3). The unit holds no gradient until
    /// [`FlatState::put_grad`] gives it back (or, transient, until the pool gets it).
    pub(crate) fn take_grad(&mut self, unit: usize) -> Buffer {
        match &mut self.stage {
            StageState::Replicated {
                kept_grads: Some(kept),
                ..
            } => {
                let dtype = kept[unit].dtype();
                std::mem::replace(&mut kept[unit], Buffer::zeros(dtype, 0))
            }
            _ => Buffer::F32(std::mem::take(&mut self.grads[unit])),
        }
    }
    /// Give back what [`FlatState::take_grad`] took, as the collective on `rank` returned it.
    pub(crate) fn put_grad(
        &mut self,
        unit: usize,
        buf: Buffer,
        rank: usize,
    ) -> Result<(), CommError> {
        match &mut self.stage {
            StageState::Replicated {
                kept_grads: Some(kept),
                ..
            } => kept[unit] = buf,
            _ => self.grads[unit] = crate::comm::returned_f32(buf, rank)?,
        }
        Ok(())
    }
    /// The rank's concatenated gradient shards at stages 2-3, as the buckets accumulate into them.
    pub(crate) fn grad_shards_mut(&mut self) -> &mut Buffer {
        match &mut self.stage {
            StageState::ShardedGrads { grad_shards, .. }
            | StageState::ShardedParams { grad_shards, .. } => grad_shards,
            StageState::Replicated { .. } => panic!("stages 0-1 keep no gradient shards"),
        }
    }
}

/// Unit `unit`'s full gradient at stages 0-1 from the pieces of [`StageState::Replicated`] and
/// [`FlatState::grads`], for callers that hold the parameters mutably at the same time.
pub(crate) fn full_grad_of<'g>(
    kept_grads: Option<&'g [Buffer]>,
    grads: &'g [Vec<f32>],
    unit: usize,
    r: Range<usize>,
) -> Slice<'g> {
    match kept_grads {
        Some(kept) => kept[unit].slice(r),
        None => Slice::F32(&grads[unit][r]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zero::unit::ModelSpec;
    use crate::zero::{EngineConfig, Stage};

    #[test]
    fn each_unit_takes_a_buffer_of_its_planned_size_and_an_unplanned_take_still_gets_one() {
        // An embedding of 1024 read by a head of 16 (tied), a block of 256 between them.
        let unit = crate::zero::unit::test_unit;
        let spec = ModelSpec {
            units: vec![
                unit(0, 1024, vec![]),
                unit(1, 256, vec![]),
                unit(2, 16, vec![0]),
            ],
        };
        let mut cfg = EngineConfig::new(Stage::Zero2, 2);
        cfg.comm_dtype = crate::flat::DType::BF16;
        let plan = crate::zero::buffers::plan(&spec, &cfg);
        assert_eq!(plan.grad_scratch, vec![256, 1024]);
        let mut pool = GradPool::new(&plan);
        let mut head = pool.take(2, 16);
        let embedding = pool.take(0, 1024);
        assert_eq!((head.capacity(), embedding.capacity()), (256, 1024));
        pool.give(&mut head);
        let block = pool.take(1, 256);
        assert_eq!(block.capacity(), 256);
        assert!(block.iter().all(|&x| x == 0.0) && block.len() == 256);
        // Both planned buffers are out: a take the plan did not foresee gets its own.
        let extra = pool.take(1, 256);
        assert_eq!(extra.len(), 256);
    }
}
