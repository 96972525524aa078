//! Chat and instruction examples as training rows ([`ExampleLoader`]) of `context` positions,
//! their answers' tokens the only trained targets.
//!
//! An example of `L <= context + 1` ids takes `L - 1` positions: inputs `ids[..L - 1]`, targets
//! `ids[1..]` where the target is trained ([`super::chat::Example::trained`]) and
//! [`IGNORE_INDEX`] elsewhere. Packed (the default on the CPU), consecutive examples in the
//! files' order share a row while they fit, each marked as its own sequence
//! ([`TokenBatch::segment_starts`]): it attends only to its own tokens and its positions start at
//! 0, so its loss is what it would be alone. Unpacked, each example has a row. The rest of a row
//! is padding (the pad id as input, [`IGNORE_INDEX`] as target, a sequence of its own). Rows are
//! visited in the seeded order of windows ([`super::order`]), split across ranks and
//! micro-batches the same way, and a step's loss is the mean over the global batch's trained
//! targets ([`crate::zero::EngineConfig::loss_per_token`]).

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
    /// Several examples per row where they fit.
    pack: bool,
    /// The examples of each row.
    rows: Vec<Range<usize>>,
    orders: EpochOrders,
}

/// Rows of consecutive examples: as many as fit `context` positions (`L - 1` each) when
/// `pack`, else one each.
fn rows_of(examples: &[Example], context: usize, pack: bool) -> Vec<Range<usize>> {
    let mut rows: Vec<Range<usize>> = Vec::new();
    let mut used = 0;
    for (i, e) in examples.iter().enumerate() {
        let n = e.ids.len().saturating_sub(1);
        match rows.last_mut() {
            Some(row) if pack && used + n <= context => {
                row.end = i + 1;
                used += n;
            }
            _ => {
                rows.push(i..i + 1);
                used = n;
            }
        }
    }
    rows
}

impl ExampleLoader {
    /// Rows of `context` positions of `examples` (with their line numbers, for messages). An
    /// example longer than `context + 1` tokens is cut to `cut` tokens where given (at most
    /// `context + 1`), else refused naming its line.
    pub fn new(
        name: String,
        examples: Vec<(usize, Example)>,
        (context, pad, seed): (usize, u32, u64),
        (cut, pack): (Option<usize>, bool),
    ) -> Result<Self, DataError> {
        if examples.is_empty() || context == 0 {
            return Err(DataError::Split(format!("{name} holds no example")));
        }
        if cut.is_some_and(|c| c < 2) {
            return Err(DataError::Split(
                "--max-example-tokens must be at least 2: an example trains on the tokens after \
                 its first"
                    .into(),
            ));
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
        Ok(Self::over(name, kept, (context, pad, seed), pack))
    }

    /// The loader of examples already cut to fit.
    fn over(
        name: String,
        examples: Vec<Example>,
        (context, pad, seed): (usize, u32, u64),
        pack: bool,
    ) -> Self {
        let rows = rows_of(&examples, context, pack);
        ExampleLoader {
            name,
            orders: EpochOrders::new(rows.len(), seed),
            rows,
            examples,
            context,
            pad,
            pack,
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Rows, i.e. samples per epoch.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
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
        let (is_held, _) = super::held_out::held_out_choice(d, fraction, seed);
        let (mut train, mut eval) = (Vec::new(), Vec::new());
        for (e, h) in self.examples.into_iter().zip(is_held) {
            match h {
                true => eval.push(e),
                false => train.push(e),
            }
        }
        let shape = (self.context, self.pad, seed);
        let side = |examples: Vec<Example>, what: &str| {
            let name = format!("{} ({what} of --eval-split {fraction})", self.name);
            Self::over(name, examples, shape, self.pack)
        };
        Ok((side(train, "training part"), side(eval, "held-out part")))
    }

    /// The same examples again, in their order (the training data scored as held out).
    pub fn copy(&self) -> ExampleLoader {
        let shape = (self.context, self.pad, 0);
        Self::over(self.name.clone(), self.examples.clone(), shape, self.pack)
    }

    /// The first `k` examples only (`--eval-windows K` of held-out examples).
    pub fn take(mut self, k: usize) -> Self {
        self.examples.truncate(k.max(1));
        let shape = (self.context, self.pad, 0);
        Self::over(self.name, self.examples, shape, self.pack)
    }

    /// Rows `indices` as one batch; packed rows with each example's sequence marked.
    fn rows(&self, indices: impl Iterator<Item = usize>) -> TokenBatch {
        let t = self.context;
        let mut b = TokenBatch {
            seq_len: t,
            ..Default::default()
        };
        for r in indices {
            let row = b.batch_size * t;
            for e in &self.examples[self.rows[r].clone()] {
                let (at, len) = (b.tokens.len(), e.ids.len().saturating_sub(1));
                b.tokens.extend_from_slice(&e.ids[..len]);
                let trained = e.ids.iter().zip(&e.trained).skip(1);
                b.targets
                    .extend(trained.map(|(&id, &t)| if t { id } else { IGNORE_INDEX }));
                let start = (at - row) as u32;
                b.segment_starts.extend(std::iter::repeat_n(start, len));
            }
            let pad = (b.tokens.len() - row) as u32;
            b.segment_starts.resize(row + t, pad);
            b.tokens.resize(row + t, self.pad);
            b.targets.resize(row + t, IGNORE_INDEX);
            b.batch_size += 1;
        }
        if !self.pack {
            b.segment_starts.clear();
        }
        b
    }

    /// Rows `range`, in order, as one batch (evaluation).
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
        self.rows.len()
    }

    fn batch(&self, range: Range<usize>) -> Result<TokenBatch, String> {
        if range.end > self.rows.len() {
            return Err(format!(
                "rows {range:?} past the {} held out",
                self.rows.len()
            ));
        }
        Ok(self.rows(range))
    }
}
