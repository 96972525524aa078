//! Held-out data: a seeded, document-level split of the training data (`--eval-split F`), and the
//! consecutive windows an evaluation scores ([`EvalWindows`]).
//!
//! * Documents: in a token file, each document with the EOS id that follows it (the token file
//!   puts one EOS between documents); in a byte corpus, each paragraph with the blank line that
//!   ends it (`"\n\n"`). A split never cuts a document.
//! * The held-out documents: `round(F x D)` of the `D` documents (at least one, and at least one
//!   left to train on), the first of a Fisher-Yates order drawn from the run's seed. Each side
//!   is its documents in their order in the data, joined as they were ([`Parts`]), so the
//!   training windows are cut from training documents only.
//! * Evaluation windows are cut from the start of the held-out stream, consecutive, `context + 1`
//!   tokens each, the last partial one dropped, as training cuts its own; scored in order.

use super::{DataError, TokenBatch, TokenSource};
use crate::rng::{mix_seed, SplitMix64};
use std::ops::Range;
use std::sync::Arc;

/// Some ranges of a token stream, read as one stream: a side of a document split.
#[derive(Debug)]
pub struct Parts {
    base: Arc<TokenSource>,
    /// The ranges of `base`, in order, adjacent ones merged.
    ranges: Vec<Range<usize>>,
    /// `starts[i]`: where range `i` begins in this stream; one more entry, the length.
    starts: Vec<usize>,
    name: String,
}

impl Parts {
    fn new(base: Arc<TokenSource>, ranges: Vec<Range<usize>>, name: String) -> Self {
        let mut starts = Vec::with_capacity(ranges.len() + 1);
        let mut at = 0;
        for r in &ranges {
            starts.push(at);
            at += r.len();
        }
        starts.push(at);
        Parts {
            base,
            ranges,
            starts,
            name,
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn len(&self) -> usize {
        self.starts.last().copied().unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn base(&self) -> &TokenSource {
        &self.base
    }

    /// The base stream's ranges this stream is made of.
    pub fn ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    /// Tokens `[start, start + len)` of this stream appended to `out`.
    pub(super) fn read_into(&self, mut start: usize, mut len: usize, out: &mut Vec<u32>) {
        let mut i = self.starts.partition_point(|&s| s <= start) - 1;
        while len > 0 {
            let offset = start - self.starts[i];
            let take = (self.ranges[i].len() - offset).min(len);
            self.base
                .read_into(self.ranges[i].start + offset, take, out);
            (start, len, i) = (start + take, len - take, i + 1);
        }
    }
}

/// What `--eval-split` leaves: the documents to train on and the held-out ones.
pub struct DocumentSplit {
    pub train: TokenSource,
    pub held_out: TokenSource,
    /// Documents on each side.
    pub train_documents: usize,
    pub held_out_documents: usize,
}

/// Splits `source` into training and held-out documents (see the module docs).
pub fn split_documents(
    source: TokenSource,
    fraction: f64,
    seed: u64,
) -> Result<DocumentSplit, DataError> {
    if !(fraction > 0.0 && fraction < 1.0) {
        return Err(DataError::Split(format!(
            "--eval-split {fraction}: the held-out fraction must lie strictly between 0 and 1 \
             (for example 0.05)"
        )));
    }
    let docs = documents(&source);
    let d = docs.len();
    if d < 2 {
        return Err(DataError::Split(format!(
            "--eval-split needs at least 2 documents, and {} holds {d} ({}); give held-out data \
             with --eval-data FILE instead",
            source.name(),
            match source {
                TokenSource::Bytes(_) => "paragraphs, separated by a blank line",
                _ => "documents, separated by the EOS token",
            }
        )));
    }
    let (is_held, held) = held_out_choice(d, fraction, seed);
    let side = |keep: bool| merged(docs.iter().zip(&is_held).filter(|(_, &h)| h == keep));
    let (train_ranges, held_ranges) = (side(false), side(true));
    let base = Arc::new(source);
    let name = |what: &str| format!("{} ({what} of --eval-split {fraction})", base.name());
    Ok(DocumentSplit {
        train: TokenSource::Parts(Box::new(Parts::new(
            base.clone(),
            train_ranges,
            name("training part"),
        ))),
        held_out: TokenSource::Parts(Box::new(Parts::new(
            base.clone(),
            held_ranges,
            name("held-out part"),
        ))),
        train_documents: d - held,
        held_out_documents: held,
    })
}

/// Which of `d >= 2` documents (or examples) are held out, and how many: `round(F x d)`, at
/// least one and at least one left, the first of a Fisher-Yates order drawn from `seed`.
pub(crate) fn held_out_choice(d: usize, fraction: f64, seed: u64) -> (Vec<bool>, usize) {
    let held = ((fraction * d as f64).round() as usize).clamp(1, d.max(2) - 1);
    let mut order: Vec<u32> = (0..d as u32).collect();
    SplitMix64::new(mix_seed(&[seed, 0x6576_616c])).shuffle(&mut order);
    let mut is_held = vec![false; d];
    for &i in &order[..held.min(d)] {
        is_held[i as usize] = true;
    }
    (is_held, held)
}

/// The whole of `source` twice, one stream read once: training data that is also scored
/// (`zerodp eval`, or `--eval-data` naming `--data`).
pub fn shared(source: TokenSource) -> (TokenSource, TokenSource) {
    let all: Vec<Range<usize>> = std::iter::once(0..source.len()).collect();
    let name = source.name().to_string();
    let base = Arc::new(source);
    let side = || {
        TokenSource::Parts(Box::new(Parts::new(
            base.clone(),
            all.clone(),
            name.clone(),
        )))
    };
    (side(), side())
}

/// The documents of `source`, each with its separator (see the module docs).
fn documents(source: &TokenSource) -> Vec<Range<usize>> {
    let ends: Vec<usize> = match source {
        TokenSource::Bytes(c) => c
            .tokens()
            .windows(2)
            .enumerate()
            .filter(|(i, w)| w == b"\n\n" && !c.tokens()[..*i].ends_with(b"\n"))
            .map(|(i, _)| i + 2)
            .collect(),
        TokenSource::Ids(c) => {
            // In chunks: a token file may be far larger than memory.
            const CHUNK: usize = 1 << 20;
            let eos = c.manifest().eos_id;
            let (mut ends, mut ids) = (Vec::new(), Vec::with_capacity(CHUNK));
            for at in (0..c.len()).step_by(CHUNK) {
                ids.clear();
                c.read_into(at, CHUNK.min(c.len() - at), &mut ids);
                let found = ids.iter().enumerate().filter(|(_, &t)| t == eos);
                ends.extend(found.map(|(i, _)| at + i + 1));
            }
            ends
        }
        TokenSource::Parts(p) => return std::iter::once(0..p.len()).collect(),
    };
    let mut docs = Vec::with_capacity(ends.len() + 1);
    let mut start = 0;
    for end in ends.into_iter().chain([source.len()]) {
        if end > start {
            docs.push(start..end);
            start = end;
        }
    }
    docs
}

/// The ranges of the chosen documents, adjacent ones joined.
fn merged<'a>(docs: impl Iterator<Item = (&'a Range<usize>, &'a bool)>) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    for (r, _) in docs {
        match out.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => out.push(r.clone()),
        }
    }
    out
}

/// The held-out windows an evaluation scores: the first `windows` consecutive windows of
/// `context + 1` tokens of a stream, in order.
#[derive(Debug)]
pub struct EvalWindows {
    source: TokenSource,
    context: usize,
    windows: usize,
}

impl EvalWindows {
    /// Every whole window of `source`, or the first `limit` of them.
    pub fn new(
        source: TokenSource,
        context: usize,
        limit: Option<usize>,
    ) -> Result<Self, DataError> {
        let whole = match context {
            0 => 0,
            _ => source.len() / (context + 1),
        };
        if whole == 0 {
            return Err(source.too_short(context));
        }
        let windows = limit.map_or(whole, |k| k.min(whole));
        Ok(EvalWindows {
            source,
            context,
            windows,
        })
    }

    pub fn source(&self) -> &TokenSource {
        &self.source
    }

    /// Windows scored.
    pub fn windows(&self) -> usize {
        self.windows
    }

    /// Tokens scored (targets): `context` per window.
    pub fn tokens(&self) -> usize {
        self.windows * self.context
    }

    /// Windows `range` as one batch (inputs and next-token targets).
    pub fn batch(&self, range: Range<usize>) -> TokenBatch {
        self.source.windows_batch(self.context, range)
    }
}

impl crate::trainer::EvalData<TokenBatch> for EvalWindows {
    fn len(&self) -> usize {
        self.windows
    }

    fn batch(&self, range: Range<usize>) -> Result<TokenBatch, String> {
        if range.end > self.windows {
            return Err(format!(
                "windows {range:?} run past the {} held-out windows",
                self.windows
            ));
        }
        Ok(EvalWindows::batch(self, range))
    }
}
