//! Held-out evaluation during and after training: which samples each rank scores, when, and the
//! [`EvalData`] contract a data source meets to be scored.
//!
//! The held-out samples are taken in order (never shuffled), `0..len`; rank `r` of `N` scores the
//! contiguous share `[r * len / N, (r + 1) * len / N)`, in micro-batches of the training
//! micro-batch size. So the samples scored do not depend on the world size, and neither does
//! the mean (see [`crate::zero::EvalLoss`]).

use super::TrainerError;
use crate::zero::{Engine, EngineError, EvalLoss, UnitModel};
use std::ops::Range;

/// Held-out samples: `len()` of them, each rank reading its share as batches of consecutive ones.
/// Every rank calls it from its own thread, so it must be `Sync`.
pub trait EvalData<B>: Sync {
    /// How many samples are scored.
    fn len(&self) -> usize;
    /// Samples `range` (within `0..len()`) as one batch.
    fn batch(&self, range: Range<usize>) -> Result<B, String>;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What to score and when.
pub struct Evaluation<'d, B> {
    pub data: &'d dyn EvalData<B>,
    /// Also after every `every` optimizer steps (counted from the start of training); the last
    /// step is always evaluated.
    pub every: Option<u64>,
}

impl<B> Evaluation<'_, B> {
    /// Whether the run evaluates after optimizer step `done` (1-based) of `steps`.
    pub(super) fn due(&self, done: u64, steps: u64) -> bool {
        done == steps || self.every.is_some_and(|n| n > 0 && done % n == 0)
    }

    /// Score every held-out sample on `engine`'s current parameters, with this rank's share cut
    /// into micro-batches of `micro_batch` samples.
    pub(super) fn run<M: UnitModel<Batch = B>>(
        &self,
        engine: &mut Engine<'_, M>,
        (rank, world): (usize, usize),
        micro_batch: usize,
        step: u64,
    ) -> Result<EvalLoss, TrainerError> {
        let len = self.data.len();
        let share = rank * len / world..(rank + 1) * len / world;
        let micro_batch = micro_batch.max(1);
        // Every rank runs as many rounds as the largest share needs (stage 3 gathers together).
        let rounds = len.div_ceil(world).div_ceil(micro_batch);
        let batch_of = |round: usize| {
            let start = share.start + round * micro_batch;
            let end = (start + micro_batch).min(share.end);
            if start >= end {
                return Ok(None);
            }
            self.data.batch(start..end).map(Some).map_err(|message| {
                EngineError::EvalData(format!(
                    "after step {step}, rank {rank}: held-out samples {start}..{end}: {message}"
                ))
            })
        };
        Ok(engine.evaluate(rounds, batch_of)?)
    }
}
