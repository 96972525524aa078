//! Chat and instruction examples as training rows ([`ExampleLoader`]): one example per row of
//! `context` positions, its answer's tokens the only trained targets.
//!
//! Row of an example of `L <= context + 1` ids: inputs `ids[..L - 1]`, targets `ids[1..]` where
//! the target is trained ([`super::chat::Example::trained`]) and [`IGNORE_INDEX`] elsewhere; the
//! rest of the row is padding (the pad id as input, [`IGNORE_INDEX`] as target). Causal attention
//! keeps each example from seeing the padding after it, and each starts at position 0, so an
//! example's loss is what it is alone. Examples are visited in the seeded order of windows
//! ([`super::order`]), split across ranks and micro-batches the same way, and a step's loss is
//! the mean over the global batch's trained targets
//! ([`crate::zero::EngineConfig::loss_per_token`]).

use super::chat::Example;
use super::order::{sample_range, EpochOrders};
use super::{DataError, TokenBatch, IGNORE_INDEX};
use std::ops::Range;

/// Chat or instruction examples served as rows (see the module docs).
#[derive(Debug)]
pub struct ExampleLoader {
    name: String,
    examples: Vec<Example>,
    context: usize,
    pad: u32,
    orders: EpochOrders,
}

impl ExampleLoader {
    /// Rows of `context` positions of `examples` (with their line numbers, for messages). An
    /// example longer than `context + 1` tokens is cut to `cut` tokens where given (at most
    /// `context + 1`), else refused naming its line.
    pub fn new(
        name: String,
        examples: Vec<(usize, Example)>,
        (context, pad, seed): (usize, u32, u64),
        cut: Option<usize>,
    ) -> Result<Self, DataError> {
        if examples.is_empty() || context == 0 {
            return Err(DataError::Split(format!("{name} holds no example")));
        }
        let room = context + 1;
        let keep = cut.map_or(room, |c| c.min(room));
        let mut kept = Vec::with_capacity(examples.len());
        for (line, mut e) in examples {
            if e.ids.len() > room && cut.is_none() {
                return Err(DataError::Split(format!(
                    "{name}: line {line}: the example has {} tokens, more than a row of context \
                     {context} + 1 holds; --max-example-tokens N cuts every example to its first \
                     N tokens (N at most {room}), or use a longer --context",
                    e.ids.len()
                )));
            }
            e.ids.truncate(keep);
            e.trained.truncate(keep);
            kept.push(e);
        }
        let n = kept.len();
        Ok(ExampleLoader {
            name,
            examples: kept,
            context,
            pad,
            orders: EpochOrders::new(n, seed),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Examples, i.e. samples per epoch.
    pub fn len(&self) -> usize {
        self.examples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.examples.is_empty()
    }

    pub fn context(&self) -> usize {
        self.context
    }

    pub fn examples(&self) -> &[Example] {
        &self.examples
    }

    /// The largest id of every example.
    pub fn max_id(&self) -> u32 {
        self.examples
            .iter()
            .flat_map(|e| e.ids.iter().copied())
            .max()
            .unwrap_or(0)
    }

    /// Trained targets over all examples (each example's first token is no target).
    pub fn trained_tokens(&self) -> usize {
        let of = |e: &Example| e.trained.iter().skip(1).filter(|&&t| t).count();
        self.examples.iter().map(of).sum()
    }

    /// SHA-256 of every example's ids and mask: what checkpoints record of the data.
    pub fn fingerprint(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut hash = Sha256::new();
        for e in &self.examples {
            hash.update((e.ids.len() as u64).to_le_bytes());
            for (&id, &t) in e.ids.iter().zip(&e.trained) {
                hash.update(id.to_le_bytes());
                hash.update([u8::from(t)]);
            }
        }
        super::token_data::hex(&hash.finalize())
    }

    /// Splits off a seeded `fraction` of the examples as held-out ones (in their order), never
    /// trained on: `(training, held out)`.
    pub fn split(self, fraction: f64, seed: u64) -> Result<(Self, Self), DataError> {
        let d = self.examples.len();
        if !(fraction > 0.0 && fraction < 1.0) || d < 2 {
            return Err(DataError::Split(format!(
                "--eval-split {fraction} of {d} examples: the fraction must lie strictly between \
                 0 and 1 and leave at least one example on each side"
            )));
        }
        let held = ((fraction * d as f64).round() as usize).clamp(1, d - 1);
        let mut order: Vec<u32> = (0..d as u32).collect();
        let stream = crate::rng::mix_seed(&[seed, 0x6576_616c]);
        crate::rng::SplitMix64::new(stream).shuffle(&mut order);
        let mut is_held = vec![false; d];
        order[..held]
            .iter()
            .for_each(|&i| is_held[i as usize] = true);
        let (mut train, mut eval) = (Vec::new(), Vec::new());
        for (e, h) in self.examples.into_iter().zip(is_held) {
            match h {
                true => eval.push(e),
                false => train.push(e),
            }
        }
        let side = |examples: Vec<Example>, what: &str| ExampleLoader {
            name: format!("{} ({what} of --eval-split {fraction})", self.name),
            orders: EpochOrders::new(examples.len(), seed),
            examples,
            context: self.context,
            pad: self.pad,
        };
        Ok((side(train, "training part"), side(eval, "held-out part")))
    }

    /// The first `k` examples only (`--eval-windows K` of held-out examples).
    pub fn take(mut self, k: usize) -> Self {
        self.examples.truncate(k.max(1));
        self.orders = EpochOrders::new(self.examples.len(), 0);
        self
    }

    /// Examples `indices` as rows of one batch.
    fn rows(&self, indices: impl Iterator<Item = usize>) -> TokenBatch {
        let t = self.context;
        let (mut tokens, mut targets, mut n) = (Vec::new(), Vec::new(), 0);
        for i in indices {
            let e = &self.examples[i];
            let len = e.ids.len().saturating_sub(1);
            tokens.extend_from_slice(&e.ids[..len]);
            let trained = e.ids[1..].iter().zip(&e.trained[1..]);
            targets.extend(trained.map(|(&id, &t)| if t { id } else { IGNORE_INDEX }));
            tokens.resize((n + 1) * t, self.pad);
            targets.resize((n + 1) * t, IGNORE_INDEX);
            n += 1;
        }
        TokenBatch {
            tokens,
            targets,
            batch_size: n,
            seq_len: t,
        }
    }

    /// Examples `range`, in order, as one batch (evaluation).
    pub fn batch(&self, range: Range<usize>) -> TokenBatch {
        self.rows(range)
    }
}

impl crate::trainer::DataSource<TokenBatch> for ExampleLoader {
    fn micro_batch(&self, at: crate::trainer::BatchIndex) -> Result<TokenBatch, String> {
        let split = (at.train_batch_size, at.world_size, at.rank);
        let samples = sample_range(at.step, split, at.micro_batch_size, at.micro)
            .map_err(|e| e.to_string())?;
        Ok(self.rows(samples.map(|g| self.orders.sample(g))))
    }
}

impl crate::trainer::EvalData<TokenBatch> for ExampleLoader {
    fn len(&self) -> usize {
        self.examples.len()
    }

    fn batch(&self, range: Range<usize>) -> Result<TokenBatch, String> {
        if range.end > self.examples.len() {
            return Err(format!(
                "examples {range:?} past the {} held out",
                self.len()
            ));
        }
        Ok(self.rows(range))
    }
}
