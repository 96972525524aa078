//! What a checkpoint reads from and writes into one rank's engine: the optimizer state of the
//! part of each unit this rank updates (fp32 master weights, Adam's m and v), the step counters
//! and the loss-scaling policy. Parameters are not saved separately: they are the master weights
//! (fp32), or the master rounded to 16 bits exactly as every Adam step rounds them, so a restore
//! rebuilds them bit for bit.

use super::{Engine, EngineError, UnitModel};
use crate::comm::CommError;
use crate::flat::Slice;
use crate::zero::shards::ShardStore;
use crate::zero::state::StageState;
use crate::zero::step_policy::PolicySnapshot;
use std::borrow::Cow;
use std::ops::Range;

/// The counters a resumed engine continues from.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EngineCounters {
    /// Optimizer steps taken (skipped ones included).
    pub step: u64,
    /// Adam updates applied (skipped steps excluded); Adam's bias correction counts these.
    pub adam_step: u64,
    pub policy: PolicySnapshot,
}

/// One unit's optimizer state over a range of its (unpadded) flat elements.
pub struct UnitOptimizerState<'e> {
    /// Elements of the unit's flat buffer the slices cover.
    pub range: Range<usize>,
    /// The fp32 master weights (the parameters themselves in fp32 training, read from the
    /// parameter swap file under `offload_param` to NVMe).
    pub master: Cow<'e, [f32]>,
    /// Adam's first moment (read from the swap file under NVMe offload; bf16 moments widened,
    /// exactly).
    pub exp_avg: Cow<'e, [f32]>,
    /// Adam's second moment.
    pub exp_avg_sq: Cow<'e, [f32]>,
}

impl<M: UnitModel> Engine<'_, M> {
    /// The elements of unit `unit` this rank writes into a checkpoint: its own shard, clipped to
    /// the unit's real elements. At stage 0 every rank holds everything, and each still writes only
    /// its shard, so no two ranks write the same bytes.
    pub fn saved_range(&self, unit: usize) -> Range<usize> {
        clip(self.layout.own_shard(unit), self.layout.units[unit].numel)
    }

    /// The elements of unit `unit` whose optimizer state this rank holds and a restore must fill:
    /// the whole unit at stage 0, the own shard otherwise (clipped to the real elements).
    pub(crate) fn restored_range(&self, unit: usize) -> Range<usize> {
        clip(
            self.units[unit].updated.clone(),
            self.layout.units[unit].numel,
        )
    }

    /// Unit `unit`'s optimizer state over [`Engine::saved_range`]. Fails only when the NVMe
    /// swap file cannot be read.
    pub fn optimizer_state(&self, unit: usize) -> Result<UnitOptimizerState<'_>, EngineError> {
        if self.host_behind {
            return Err(EngineError::HostBehind);
        }
        let range = self.saved_range(unit);
        let us = &self.units[unit];
        let local = range.start - us.updated.start..range.end - us.updated.start;
        let master = match &us.master {
            Some(m) => Cow::Borrowed(&m[local.clone()]),
            None => match self.fp32_updated_params(unit)? {
                Cow::Borrowed(p) => Cow::Borrowed(&p[local.clone()]),
                Cow::Owned(mut p) => {
                    p.truncate(local.end);
                    p.drain(..local.start);
                    Cow::Owned(p)
                }
            },
        };
        let (exp_avg, exp_avg_sq) = match self.nvme.as_ref().filter(|_| us.swapped) {
            Some(nvme) => {
                let (m, v) = nvme.read(unit, local)?;
                (Cow::Owned(m), Cow::Owned(v))
            }
            None => us.adam.f32_range(local),
        };
        Ok(UnitOptimizerState {
            range,
            master,
            exp_avg,
            exp_avg_sq,
        })
    }

    /// The step counters and the loss-scaling state.
    pub fn counters(&self) -> EngineCounters {
        EngineCounters {
            step: self.step,
            adam_step: self.units.first().map_or(0, |u| u.adam.step),
            policy: self.policy.snapshot(),
        }
    }

    /// Fill unit `unit`'s optimizer state over [`Engine::restored_range`] (the slices' length) and
    /// the parameters it determines on this rank. Call for every unit, then
    /// [`Engine::finish_restore`] on every rank.
    pub(crate) fn restore_unit(
        &mut self,
        unit: usize,
        master: &[f32],
        exp_avg: &[f32],
        exp_avg_sq: &[f32],
    ) -> Result<(), EngineError> {
        let range = self.restored_range(unit);
        for got in [master.len(), exp_avg.len(), exp_avg_sq.len()] {
            if got != range.len() {
                return Err(EngineError::ParamLength {
                    unit,
                    name: self.spec.units[unit].name.clone(),
                    expected: range.len(),
                    got,
                });
            }
        }
        self.sync_host()?;
        self.device_behind = true;
        self.write_host(unit, range, (master, exp_avg, exp_avg_sq))
    }

    /// Write unit `unit`'s master, moments and the parameters they determine over `range` (of its
    /// flat elements, inside [`Engine::restored_range`]) into the host buffers.
    pub(super) fn write_host(
        &mut self,
        unit: usize,
        range: Range<usize>,
        (master, exp_avg, exp_avg_sq): (&[f32], &[f32], &[f32]),
    ) -> Result<(), EngineError> {
        let us = &mut self.units[unit];
        let local = range.start - us.updated.start..range.end - us.updated.start;
        match self.nvme.as_mut().filter(|_| us.swapped) {
            Some(nvme) => nvme.write(unit, local.clone(), exp_avg, exp_avg_sq)?,
            None => us.adam.set_f32(local.clone(), exp_avg, exp_avg_sq),
        }
        if let Some(m) = &mut us.master {
            m[local.clone()].copy_from_slice(master);
        }
        // The parameters are the master (rounded to 16 bits as Adam's copy is).
        let updated = us.updated.clone();
        match &mut self.state.stage {
            StageState::ShardedParams { coordinator, .. } => {
                coordinator.invalidate()?;
                coordinator
                    .shards_mut()
                    .modify(unit, |s| s.slice_mut(local).copy_from(Slice::F32(master)))?;
            }
            StageState::Replicated { params, .. } | StageState::ShardedGrads { params, .. } => {
                let at = updated.start + local.start..updated.start + local.end;
                params[unit].slice_mut(at).copy_from(Slice::F32(master));
            }
        }
        Ok(())
    }

    /// Set the counters and the loss-scaling state, and at stages 1-2 all-gather the restored
    /// parameter shards into every rank's full parameters (a collective: every rank calls it).
    pub(crate) fn finish_restore(&mut self, c: &EngineCounters) -> Result<(), CommError> {
        self.step = c.step;
        for u in &mut self.units {
            u.adam.step = c.adam_step;
        }
        self.policy.restore(&c.policy);
        self.device_behind = true;
        self.gather_updated()?;
        self.model.parameters_changed();
        Ok(())
    }

    /// Without an fp32 master (fp32 training, or bf16 parameters that are their own master): the
    /// parameters over the updated part as f32 (read from the parameter swap file under
    /// `offload_param` to NVMe; bf16 widened exactly).
    pub(super) fn fp32_updated_params(&self, unit: usize) -> Result<Cow<'_, [f32]>, EngineError> {
        let updated = self.units[unit].updated.clone();
        Ok(match &self.state.stage {
            StageState::ShardedParams { coordinator, .. } => match coordinator.shards() {
                ShardStore::Memory(shards) => shards[unit].range_f32(0..shards[unit].len()),
                store => match store.read(unit)?.range_f32(0..updated.len()) {
                    Cow::Borrowed(p) => Cow::Owned(p.to_vec()),
                    Cow::Owned(p) => Cow::Owned(p),
                },
            },
            StageState::Replicated { params, .. } | StageState::ShardedGrads { params, .. } => {
                params[unit].range_f32(updated)
            }
        })
    }
}

/// `r` without the padding past `numel` (an empty range at `r.start` when it is all padding, so
/// that offsets into the shard stay valid).
fn clip(r: Range<usize>, numel: usize) -> Range<usize> {
    match r.start < numel {
        true => r.start..r.end.min(numel),
        false => r.start..r.start,
    }
}
