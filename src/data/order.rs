//! The seeded order of samples (windows, or chat examples) and which of them each rank's
//! micro-batch takes at each step; see the [module docs](super).

use super::DataError;
use crate::rng::{mix_seed, SplitMix64};
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// Epoch `e`'s Fisher-Yates order of `n` samples, drawn from `mix_seed([seed, e])`; the last two
/// are kept (a step can straddle two epochs).
#[derive(Debug)]
pub(crate) struct EpochOrders {
    n: usize,
    seed: u64,
    kept: Mutex<Vec<(u64, Arc<Vec<u32>>)>>,
}

impl EpochOrders {
    pub fn new(n: usize, seed: u64) -> Self {
        EpochOrders {
            n,
            seed,
            kept: Mutex::new(Vec::new()),
        }
    }

    /// The order in which epoch `epoch` visits the samples.
    pub fn order(&self, epoch: u64) -> Arc<Vec<u32>> {
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, o)) = kept.iter().find(|(e, _)| *e == epoch) {
            return o.clone();
        }
        let mut order: Vec<u32> = (0..self.n as u32).collect();
        SplitMix64::new(mix_seed(&[self.seed, epoch])).shuffle(&mut order);
        let order = Arc::new(order);
        if kept.len() >= 2 {
            kept.remove(0);
        }
        kept.push((epoch, order.clone()));
        order
    }

    /// The sample at position `g` of the infinite stream.
    pub fn sample(&self, g: u64) -> usize {
        let n = self.n as u64;
        self.order(g / n)[(g % n) as usize] as usize
    }
}

/// The positions in the sample stream that micro-batch `micro` of rank `rank` takes at optimizer
/// step `step`: rank `r` of `N` takes `[r B / N, (r + 1) B / N)` of the step's `B` samples, its
/// micro-batch `m` the `m`-th run of `micro_batch` samples in that share.
pub(crate) fn sample_range(
    step: u64,
    (train_batch_size, world_size, rank): (usize, usize, usize),
    micro_batch_size: usize,
    micro_index: usize,
) -> Result<Range<u64>, DataError> {
    if world_size == 0 || rank >= world_size {
        return Err(DataError::Split(format!(
            "rank {rank} is outside world size {world_size}"
        )));
    }
    if micro_batch_size == 0 {
        return Err(DataError::Split(
            "micro-batch size must be at least 1".into(),
        ));
    }
    let lo = rank * train_batch_size / world_size;
    let hi = (rank + 1) * train_batch_size / world_size;
    let start = lo + micro_index * micro_batch_size;
    let end = start + micro_batch_size;
    if end > hi {
        return Err(DataError::Split(format!(
            "micro-batch {micro_index} of {micro_batch_size} samples runs past rank {rank}'s \
             share [{lo}, {hi}) of train_batch_size {train_batch_size} over {world_size} ranks; \
             train_batch_size must equal micro-batch size x accumulation steps x world size"
        )));
    }
    let base = step * train_batch_size as u64;
    Ok(base + start as u64..base + end as u64)
}
