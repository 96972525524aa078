//! What the optimizer step updates on this rank, unit by unit: the parameters over the rank's
//! part and their reduced gradient. At stages 0-2 both are in memory; at stage 3 the parameter
//! shard is taken out of the [`ShardStore`] for its unit's update (read from the parameter swap
//! file under `offload_param` to NVMe) and put back, written, before the next unit's is taken, so
//! that at most one shard is out at a time; where the shards must be read (fp32), the next unit's
//! is read ahead on a thread while this one is updated, and each updated shard is written behind
//! on a thread while the next one updates.

use super::UnitState;
use crate::flat::Buffer;
use crate::flat::{Slice, SliceMut};
use crate::offload::OffloadError;
use crate::zero::layout::FlatLayout;
use crate::zero::shards::ShardStore;
use crate::zero::state::{full_grad_of, FlatState, StageState};

/// Per unit, the parameters Adam updates on this rank and their gradients.
pub(super) enum UpdateParts<'s> {
    /// Stages 0-2: every unit's part, in memory.
    Resident(Vec<(SliceMut<'s>, Slice<'s>)>),
    /// Stage 3: the shards, one out at a time.
    Sharded {
        store: &'s mut ShardStore,
        grad_shards: &'s Buffer,
        layout: &'s FlatLayout,
        /// The unit whose shard is out, and the shard.
        out: Option<(usize, Buffer)>,
        /// Whether Adam overwrites the shards whole (16-bit parameters are the rounded copy of
        /// the fp32 master), so that they need not be read first.
        overwritten: bool,
    },
}

impl<'s> UpdateParts<'s> {
    pub(super) fn new(
        state: &'s mut FlatState,
        layout: &'s FlatLayout,
        units: &[UnitState],
        overwritten: bool,
    ) -> UpdateParts<'s> {
        let FlatState { grads, stage, .. } = state;
        let part = |u: usize| units[u].updated.clone();
        match stage {
            StageState::Replicated { params, kept_grads } => {
                let kept = kept_grads.as_deref();
                let grads = &*grads;
                let parts = params
                    .iter_mut()
                    .enumerate()
                    .map(|(u, p)| (p.slice_mut(part(u)), full_grad_of(kept, grads, u, part(u))));
                UpdateParts::Resident(parts.collect())
            }
            StageState::ShardedGrads {
                params,
                grad_shards,
            } => {
                let parts = params.iter_mut().enumerate().map(|(u, p)| {
                    let g = grad_shards.slice(layout.shard_slot(u));
                    (p.slice_mut(part(u)), g)
                });
                UpdateParts::Resident(parts.collect())
            }
            StageState::ShardedParams {
                coordinator,
                grad_shards,
            } => UpdateParts::Sharded {
                store: coordinator.shards_mut(),
                grad_shards,
                layout,
                out: None,
                overwritten,
            },
        }
    }

    /// Unit `unit`'s parameters over the updated part and their gradient. At stage 3 this puts
    /// back the shard of the unit asked for before, if it was another.
    pub(super) fn get(&mut self, unit: usize) -> Result<(SliceMut<'_>, Slice<'_>), OffloadError> {
        match self {
            UpdateParts::Resident(parts) => {
                let (p, g) = &mut parts[unit];
                let len = g.len();
                Ok((p.sub_mut(0..len), *g))
            }
            UpdateParts::Sharded {
                store,
                grad_shards,
                layout,
                out,
                overwritten,
            } => {
                if out.as_ref().is_some_and(|(u, _)| *u != unit) {
                    if let Some((u, shard)) = out.take() {
                        store.put_back(u, shard)?;
                    }
                }
                let (_, shard) = match out.take() {
                    Some(kept) => out.insert(kept),
                    None => {
                        let shard = match overwritten {
                            true => store.take_to_overwrite(unit)?,
                            false => store.take(unit)?,
                        };
                        if !*overwritten {
                            // The next unit's shard is read while this one is updated (units are
                            // updated in order).
                            store.read_ahead(unit + 1);
                        }
                        out.insert((unit, shard))
                    }
                };
                Ok((shard.all_mut(), grad_shards.slice(layout.shard_slot(unit))))
            }
        }
    }

    /// Puts back the last shard taken (stage 3).
    pub(super) fn finish(self) -> Result<(), OffloadError> {
        match self {
            UpdateParts::Resident(_) => Ok(()),
            UpdateParts::Sharded { store, out, .. } => {
                let put = match out {
                    Some((u, shard)) => store.put_back(u, shard),
                    None => Ok(()),
                };
                // The last shard's write behind must land before anything reads the shards.
                let flushed = store.flush();
                store.settle();
                put.and(flushed)
            }
        }
    }
}
