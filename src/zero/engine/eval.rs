//! Held-out evaluation: the mean token loss of batches the model does not train on, computed
//! data-parallel with the parameters as the last step left them.
//!
//! Every rank runs the same number of rounds (one micro-batch each, or none where its share has
//! run out), unit by unit and without a graph. At stage 3 each unit is gathered for the round
//! and released after it, so every rank takes part in every gather whether or not it has a batch
//! left. The ranks' sums are exchanged bit for bit and added in rank order, so every rank ends
//! with the same number, and the same number at any world size up to the f32 rounding inside each
//! batch's loss.

use super::{Engine, EngineError};
use crate::comm::Communicator;
use crate::flat::Buffer;
use crate::zero::schedule::needs_of;
use crate::zero::state::StageState;
use crate::zero::unit::{ForwardMode, ModelError, UnitModel};
use std::time::Instant;

/// The held-out loss over every rank's batches.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EvalLoss {
    /// The mean token cross-entropy: the sum of every token's loss over `tokens`.
    pub loss: f64,
    /// The tokens it is the mean of (the trained targets: [`crate::zero::UnitModel::loss_tokens`]).
    pub tokens: u64,
    /// Wall-clock seconds the evaluation took on this rank.
    pub seconds: f64,
}

impl EvalLoss {
    /// `exp(loss)`.
    pub fn perplexity(&self) -> f64 {
        self.loss.exp()
    }
}

impl<M: UnitModel> Engine<'_, M> {
    /// The mean loss over `rounds` rounds of `batch_of(round)` (`None` where this rank has no
    /// batch in that round), over every rank. Every rank must call it with the same `rounds`.
    /// The parameters and the optimizer state are not touched.
    pub fn evaluate(
        &mut self,
        rounds: usize,
        mut batch_of: impl FnMut(usize) -> Result<Option<M::Batch>, EngineError>,
    ) -> Result<EvalLoss, EngineError> {
        let start = Instant::now();
        self.upload_if_behind()?;
        let (mut loss_sum, mut tokens) = (0.0f64, 0u64);
        for round in 0..rounds {
            let batch = batch_of(round)?;
            if let Some(loss) = self.eval_round(batch.as_ref())? {
                let n = batch.as_ref().map_or(0, |b| self.model.loss_tokens(b));
                loss_sum += f64::from(loss) * n as f64;
                tokens += n as u64;
            }
        }
        self.release_all()?;
        let (loss_sum, tokens) = sum_over_ranks(self.comm, loss_sum, tokens)?;
        Ok(EvalLoss {
            loss: loss_sum / tokens.max(1) as f64,
            tokens,
            seconds: start.elapsed().as_secs_f64(),
        })
    }

    /// One round: every unit in order (gathered first at stage 3), run on `batch` when this rank
    /// has one; its mean loss.
    fn eval_round(&mut self, batch: Option<&M::Batch>) -> Result<Option<f32>, EngineError> {
        let n = self.layout.num_units();
        let mut x: Option<M::Act> = None;
        let mut loss = None;
        for u in 0..n {
            let needs = needs_of(&self.spec, u);
            self.gather_for_eval(&needs)?;
            if let Some(batch) = batch {
                let out = self.run_forward(u, x.as_ref(), batch, ForwardMode::NoGrad)?;
                x = out.output;
                loss = out.loss.or(loss);
            }
            if let StageState::ShardedParams { coordinator, .. } = &mut self.state.stage {
                coordinator.release_now(&needs);
            }
        }
        match (batch, loss) {
            (Some(_), None) => Err(ModelError::Invalid(format!(
                "the last unit ({}) returned no loss",
                self.spec.units[n - 1].name
            ))
            .into()),
            _ => Ok(loss),
        }
    }

    /// Stage 3 on the host: gather `units` (a collective every rank joins).
    fn gather_for_eval(&mut self, units: &[usize]) -> Result<(), EngineError> {
        if self.device().is_some() {
            return Ok(());
        }
        if let StageState::ShardedParams { coordinator, .. } = &mut self.state.stage {
            coordinator.gather_now(units, self.comm, &mut self.ledger)?;
        }
        Ok(())
    }
}

/// Every rank's `(loss_sum, tokens)`, exchanged as the bits of two f64 (an all-gather moves bytes
/// and adds nothing) and added in rank order: the same total on every rank, rounded once per rank.
pub(super) fn sum_over_ranks(
    comm: &dyn Communicator,
    loss_sum: f64,
    tokens: u64,
) -> Result<(f64, u64), EngineError> {
    let world = comm.world_size();
    if world == 1 {
        return Ok((loss_sum, tokens));
    }
    let words = |bits: u64| {
        [
            f32::from_bits((bits >> 32) as u32),
            f32::from_bits(bits as u32),
        ]
    };
    let [a, b] = words(loss_sum.to_bits());
    let [c, d] = words(tokens);
    let out = Buffer::F32(vec![0.0; 4 * world]);
    let (_, all) = comm
        .all_gather(Buffer::F32(vec![a, b, c, d]), out)
        .wait_pair()?;
    let all = crate::comm::returned_f32(all, comm.rank())?;
    let bits = |hi: f32, lo: f32| (u64::from(hi.to_bits()) << 32) | u64::from(lo.to_bits());
    let (mut sum, mut count) = (0.0f64, 0u64);
    for r in all.chunks_exact(4) {
        sum += f64::from_bits(bits(r[0], r[1]));
        count += bits(r[2], r[3]);
    }
    Ok((sum, count))
}
