//! Training data: a token stream cut into windows, visited in a seeded order that does not depend
//! on the world size or the micro-batch split.
//!
//! * Tokens are a UTF-8 corpus's bytes (vocabulary 256, [`Corpus`]), or the ids of a tokenized
//!   corpus ([`TokenCorpus`], see [`token_data`]); the windows, order and split below are
//!   the same for both.
//! * The corpus is cut into consecutive, non-overlapping windows of `context + 1` tokens; window
//!   `w` covers bytes `[w * (context + 1), (w + 1) * (context + 1))` (a trailing partial window is
//!   dropped). A window's inputs are its first `context` tokens, its targets the last `context`.
//! * The sample stream is infinite: epoch `e` visits every window exactly once, in a Fisher-Yates
//!   order drawn from `mix_seed([seed, e])`. Global sample `g` is position `g % W` of epoch `g / W`
//!   (`W` windows).
//! * Optimizer step `k` trains on samples `[k * B, (k + 1) * B)` (`B` = `train_batch_size`). Rank
//!   `r` of `N` takes the contiguous slice `[r * B / N, (r + 1) * B / N)` of them, and its
//!   micro-batch `m` the `m`-th run of `micro_batch_size` samples inside that slice.
//!
//! So step `k` sees the same samples whatever `N` and the micro-batch size: the property behind
//! "every stage at every world size trains to the same losses".

pub mod chat;
pub mod examples;
pub mod held_out;
mod order;
pub mod token_data;
pub mod token_inputs;

pub use examples::ExampleLoader;
pub use held_out::{split_documents, DocumentSplit, EvalWindows, Parts};
pub use token_data::{CacheStatus, TextTokenizer, TokenCorpus, TokenDataOptions};

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::zero::unit::BatchCounts;

/// Where `scripts/fetch_corpus.sh` writes the demo corpus (relative to the repository root).
pub const DEFAULT_CORPUS_PATH: &str = "data/corpus.txt";

/// A target that is not trained on (a prompt's token in chat data, padding): it adds nothing to
/// the loss, and the loss is the mean over the other targets (PyTorch's `ignore_index`, -100 in
/// transformers' labels).
pub const IGNORE_INDEX: u32 = u32::MAX;

/// Vocabulary of the byte-level tokenizer.
pub(crate) const BYTE_VOCAB: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("cannot read corpus {path}: {source}{hint}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
        hint: &'static str,
    },
    #[error("corpus {name} is not valid UTF-8 (first bad byte at offset {offset}); convert it to UTF-8 text, for example with iconv")]
    NotUtf8 { name: String, offset: usize },
    #[error("corpus {name} has {len} bytes, too short for one window of context {context} + 1 = {} bytes; use a longer text or a model with a shorter context", context + 1)]
    TooShort {
        name: String,
        len: usize,
        context: usize,
    },
    #[error("{0}")]
    Split(String),
    #[error("{0}")]
    NoInputs(String),
    #[error("{path}: line 1: the file is empty (it holds no document)")]
    EmptyFile { path: PathBuf },
    #[error("{path}: line {line}: not valid UTF-8 (first bad byte at file offset {offset}); convert the file to UTF-8, for example with iconv")]
    FileNotUtf8 {
        path: PathBuf,
        line: usize,
        offset: u64,
    },
    #[error("{path}: line {line}: {msg}")]
    Jsonl {
        path: PathBuf,
        line: usize,
        msg: String,
    },
    #[error("{path}: line {line}: the tokenizer failed: {msg}")]
    Encode {
        path: PathBuf,
        line: usize,
        msg: String,
    },
    #[error("tokenizer {path}: {msg}")]
    Tokenizer { path: PathBuf, msg: String },
    #[error("token cache {path}: {action}: {source}")]
    Cache {
        path: PathBuf,
        action: &'static str,
        source: std::io::Error,
    },
    #[error("the model's vocabulary ({model}) is smaller than the tokenizer's ({tokenizer}, {path}); a token id past the model's last row cannot be embedded")]
    VocabTooSmall {
        model: usize,
        tokenizer: usize,
        path: PathBuf,
    },
    #[error(
        "the data {data} holds token id {id}, past the model's vocabulary of {model} (ids 0 to \
         {last}){tokenizer}: it would fail the first step that reads it; train with the model's \
         own tokenizer, or a model with at least {need} rows (vocab_size)",
        last = .model.saturating_sub(1),
        need = .id + 1
    )]
    TokenPastVocab {
        data: String,
        id: u64,
        model: usize,
        /// `, made by the tokenizer PATH` for a tokenized corpus, else empty.
        tokenizer: String,
    },
    #[error("{name} has {len} tokens, too few for one window of context {context} + 1 tokens; add text or use a model with a shorter context")]
    TooFewTokens {
        name: String,
        len: usize,
        context: usize,
    },
}

/// A tokenized corpus (bytes of a UTF-8 text).
#[derive(Clone, Debug)]
pub struct Corpus {
    name: String,
    tokens: Vec<u8>,
}

impl Corpus {
    /// Read a UTF-8 text file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, DataError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| DataError::Read {
            path: path.to_path_buf(),
            hint: if path == Path::new(DEFAULT_CORPUS_PATH)
                && source.kind() == std::io::ErrorKind::NotFound
            {
                " (the demo corpus is fetched by `scripts/fetch_corpus.sh`; or pass --data FILE)"
            } else {
                ""
            },
            source,
        })?;
        Self::from_bytes(path.display().to_string(), bytes)
    }

    /// A corpus from text in memory (tests make their own).
    pub fn from_text(name: impl Into<String>, text: &str) -> Self {
        Self {
            name: name.into(),
            tokens: text.as_bytes().to_vec(),
        }
    }

    /// A corpus from bytes that must be UTF-8 text.
    pub fn from_bytes(name: impl Into<String>, bytes: Vec<u8>) -> Result<Self, DataError> {
        let name = name.into();
        if let Err(e) = std::str::from_utf8(&bytes) {
            return Err(DataError::NotUtf8 {
                name,
                offset: e.valid_up_to(),
            });
        }
        Ok(Self {
            name,
            tokens: bytes,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Number of tokens (bytes).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn tokens(&self) -> &[u8] {
        &self.tokens
    }
}

/// What a [`DataLoader`] cuts into windows: a byte corpus or a tokenized one
/// ([`token_data`]); both convert into it, so `DataLoader::new` takes either.
#[derive(Debug)]
pub enum TokenSource {
    Bytes(Corpus),
    /// Boxed: a token file's manifest is far larger than a byte corpus's handle.
    Ids(Box<TokenCorpus>),
    /// Some documents of another stream ([`held_out`]): a side of `--eval-split`.
    Parts(Box<Parts>),
}

impl From<Corpus> for TokenSource {
    fn from(c: Corpus) -> Self {
        TokenSource::Bytes(c)
    }
}

impl From<TokenCorpus> for TokenSource {
    fn from(c: TokenCorpus) -> Self {
        TokenSource::Ids(Box::new(c))
    }
}

impl TokenSource {
    pub fn name(&self) -> &str {
        match self {
            TokenSource::Bytes(c) => c.name(),
            TokenSource::Ids(c) => c.name(),
            TokenSource::Parts(p) => p.name(),
        }
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        match self {
            TokenSource::Bytes(c) => c.len(),
            TokenSource::Ids(c) => c.len(),
            TokenSource::Parts(p) => p.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The ids run from 0 to this (exclusive): a model needs at least this many embedding rows.
    pub fn vocab_size(&self) -> usize {
        match self {
            TokenSource::Bytes(_) => BYTE_VOCAB,
            TokenSource::Ids(c) => c.vocab_size(),
            TokenSource::Parts(p) => p.base().vocab_size(),
        }
    }

    /// The largest id in the stream (0 when it is empty).
    pub(crate) fn max_id(&self) -> u64 {
        match self {
            TokenSource::Bytes(c) => c.tokens.iter().copied().max().map_or(0, u64::from),
            TokenSource::Ids(c) => u64::from(c.max_id()),
            // The whole stream's: a bound, which is what the vocabulary check needs.
            TokenSource::Parts(p) => p.base().max_id(),
        }
    }

    /// Refuses a model with fewer embedding rows than the stream's largest id needs, naming the
    /// data and the tokenizer: checked before any step, since the step that reads such a token
    /// may come hours into a run.
    pub fn check_vocab(&self, model_vocab: usize) -> Result<(), DataError> {
        if let TokenSource::Parts(p) = self {
            return p.base().check_vocab(model_vocab);
        }
        let id = self.max_id();
        if id < model_vocab as u64 || self.is_empty() {
            return Ok(());
        }
        let (data, tokenizer) = match self {
            TokenSource::Bytes(c) => (
                format!("{} (its bytes are the ids)", c.name()),
                String::new(),
            ),
            TokenSource::Ids(c) => (
                format!("{} (token file {})", c.name(), c.token_file().display()),
                format!(
                    ", made by the tokenizer {}",
                    c.manifest().tokenizer.display()
                ),
            ),
            TokenSource::Parts(p) => (p.name().to_string(), String::new()),
        };
        Err(DataError::TokenPastVocab {
            data,
            id,
            model: model_vocab,
            tokenizer,
        })
    }

    /// SHA-256 of the token stream, each id as 4 little-endian bytes (as `sha256sum` prints it):
    /// the same for the same ids whether they came from bytes or a token file, on any machine.
    /// Checkpoints record it, so that a resumed run can tell it was given other data. A token
    /// file's is its manifest's, checked against its bytes when it was opened.
    pub fn fingerprint(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut hash = Sha256::new();
        match self {
            TokenSource::Bytes(c) => {
                for chunk in c.tokens.chunks(1 << 16) {
                    let wide: Vec<u8> = chunk
                        .iter()
                        .flat_map(|&b| u32::from(b).to_le_bytes())
                        .collect();
                    hash.update(&wide);
                }
            }
            TokenSource::Ids(c) => return c.sha256().to_string(),
            // The whole stream is the stream itself.
            TokenSource::Parts(p) if p.len() == p.base().len() => return p.base().fingerprint(),
            // The whole stream's and which parts of it: another split is other data.
            TokenSource::Parts(p) => {
                hash.update(p.base().fingerprint().as_bytes());
                for r in p.ranges() {
                    hash.update((r.start as u64).to_le_bytes());
                    hash.update((r.end as u64).to_le_bytes());
                }
            }
        }
        token_data::hex(&hash.finalize())
    }

    /// Every token (for tests and tools; a training run reads windows).
    pub fn to_vec(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len());
        self.read_into(0, self.len(), &mut out);
        out
    }

    /// Tokens `[start, start + len)` appended to `out`.
    fn read_into(&self, start: usize, len: usize, out: &mut Vec<u32>) {
        match self {
            TokenSource::Bytes(c) => {
                out.extend(c.tokens[start..start + len].iter().map(|&b| u32::from(b)))
            }
            TokenSource::Ids(c) => c.read_into(start, len, out),
            TokenSource::Parts(p) => p.read_into(start, len, out),
        }
    }

    /// Windows `windows` (of `context + 1` tokens, window `w` at token `w * (context + 1)`) as
    /// the rows of one batch: inputs their first `context` tokens, targets their last.
    pub(crate) fn windows_batch(
        &self,
        context: usize,
        windows: impl Iterator<Item = usize>,
    ) -> TokenBatch {
        let (n, t) = (windows.size_hint().0, context);
        let mut tokens = Vec::with_capacity(n * t);
        let mut targets = Vec::with_capacity(n * t);
        let mut window = Vec::with_capacity(t + 1);
        let mut rows = 0;
        for w in windows {
            rows += 1;
            window.clear();
            self.read_into(w * (t + 1), t + 1, &mut window);
            tokens.extend_from_slice(&window[..t]);
            targets.extend_from_slice(&window[1..]);
        }
        TokenBatch {
            tokens,
            targets,
            batch_size: rows,
            seq_len: t,
            segment_starts: Vec::new(),
        }
    }

    fn too_short(&self, context: usize) -> DataError {
        let (name, len) = (self.name().to_string(), self.len());
        match self {
            TokenSource::Bytes(_) => DataError::TooShort { name, len, context },
            TokenSource::Parts(p) if matches!(p.base(), TokenSource::Bytes(_)) => {
                DataError::TooShort { name, len, context }
            }
            TokenSource::Ids(_) | TokenSource::Parts(_) => {
                DataError::TooFewTokens { name, len, context }
            }
        }
    }
}

/// Serves micro-batches of windows in the seeded order described in the module docs.
#[derive(Debug)]
pub struct DataLoader {
    source: TokenSource,
    context: usize,
    num_windows: usize,
    orders: order::EpochOrders,
}

impl DataLoader {
    /// Windows of `context + 1` tokens of a byte [`Corpus`] or a [`TokenCorpus`].
    pub fn new(
        source: impl Into<TokenSource>,
        context: usize,
        seed: u64,
    ) -> Result<Self, DataError> {
        let source = source.into();
        let num_windows = if context == 0 {
            0
        } else {
            source.len() / (context + 1)
        };
        if num_windows == 0 {
            return Err(source.too_short(context));
        }
        if num_windows > u32::MAX as usize {
            return Err(DataError::Split(format!(
                "corpus {} has {num_windows} windows, more than 2^32",
                source.name()
            )));
        }
        Ok(Self {
            source,
            context,
            num_windows,
            orders: order::EpochOrders::new(num_windows, seed),
        })
    }

    /// The byte corpus, when the loader reads one.
    pub fn corpus(&self) -> Option<&Corpus> {
        match &self.source {
            TokenSource::Bytes(c) => Some(c),
            TokenSource::Ids(_) | TokenSource::Parts(_) => None,
        }
    }

    /// The tokens the windows are cut from.
    pub fn source(&self) -> &TokenSource {
        &self.source
    }

    pub fn context(&self) -> usize {
        self.context
    }

    /// Number of windows, i.e. samples per epoch.
    pub fn num_windows(&self) -> usize {
        self.num_windows
    }

    /// The order in which epoch `epoch` visits the windows.
    pub fn epoch_order(&self, epoch: u64) -> Arc<Vec<u32>> {
        self.orders.order(epoch)
    }

    /// The window index of global sample `g`.
    pub fn window_of_sample(&self, g: u64) -> usize {
        self.orders.sample(g)
    }

    /// The global sample indices (positions in the infinite sample stream) that micro-batch
    /// `micro_index` of rank `rank` trains on at optimizer step `step`.
    pub fn micro_batch_samples(
        &self,
        step: u64,
        train_batch_size: usize,
        world_size: usize,
        rank: usize,
        micro_batch_size: usize,
        micro_index: usize,
    ) -> Result<std::ops::Range<u64>, DataError> {
        let split = (train_batch_size, world_size, rank);
        order::sample_range(step, split, micro_batch_size, micro_index)
    }

    /// The tokens and targets of that micro-batch (see [`Self::micro_batch_samples`]).
    pub fn micro_batch(
        &self,
        step: u64,
        train_batch_size: usize,
        world_size: usize,
        rank: usize,
        micro_batch_size: usize,
        micro_index: usize,
    ) -> Result<TokenBatch, DataError> {
        let samples = self.micro_batch_samples(
            step,
            train_batch_size,
            world_size,
            rank,
            micro_batch_size,
            micro_index,
        )?;
        let windows = samples.map(|g| self.window_of_sample(g));
        Ok(self.source.windows_batch(self.context, windows))
    }
}

/// A language model's micro-batch: `batch_size` windows of `seq_len` tokens and their next-token
/// targets, row-major.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenBatch {
    pub tokens: Vec<u32>,
    pub targets: Vec<u32>,
    pub batch_size: usize,
    pub seq_len: usize,
    /// Rows packed with several sequences (chat examples): for each token, where its sequence
    /// starts in its row. A token attends only to the earlier tokens of its own sequence, and
    /// its position is its place in that sequence. Empty: each row is one sequence.
    pub segment_starts: Vec<u32>,
}

impl TokenBatch {
    /// Samples are the windows, tokens their positions.
    pub fn counts(&self) -> BatchCounts {
        BatchCounts {
            samples: self.batch_size,
            tokens: self.tokens.len(),
        }
    }

    /// Each token's position in its sequence (see [`TokenBatch::segment_starts`]), when the rows
    /// are packed (checked by [`TokenBatch::check_segments`]; a start past its token counts 0).
    pub fn positions(&self) -> Option<Vec<u32>> {
        if self.segment_starts.is_empty() {
            return None;
        }
        let t = self.seq_len.max(1);
        let pos = self.segment_starts.iter().enumerate();
        Some(
            pos.map(|(k, &s)| ((k % t) as u32).saturating_sub(s))
                .collect(),
        )
    }

    /// Refuses segment starts that do not describe sequences of the rows: one per token, each at
    /// or before its token, a token starting its own sequence or continuing the one before it.
    pub fn check_segments(&self) -> Result<(), String> {
        let starts = &self.segment_starts;
        if starts.is_empty() {
            return Ok(());
        }
        if starts.len() != self.tokens.len() || self.seq_len == 0 {
            return Err(format!(
                "{} segment starts for {} tokens: give one per token, or none",
                starts.len(),
                self.tokens.len()
            ));
        }
        for (k, &s) in starts.iter().enumerate() {
            let i = k % self.seq_len;
            let continues = i > 0 && starts[k - 1] == s;
            if s as usize > i || (s as usize != i && !continues) {
                return Err(format!(
                    "segment start {s} of row {} position {i} is not where its sequence starts",
                    k / self.seq_len
                ));
            }
        }
        Ok(())
    }

    /// The targets the loss is over: those that are not [`IGNORE_INDEX`].
    pub fn loss_tokens(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE_INDEX).count()
    }
}

/// The trainer draws a language model's micro-batches straight from the loader: step `step`'s
/// global batch of `train_batch_size` windows, this rank's `micro`-th micro-batch of it.
impl crate::trainer::DataSource<TokenBatch> for DataLoader {
    fn micro_batch(&self, at: crate::trainer::BatchIndex) -> Result<TokenBatch, String> {
        DataLoader::micro_batch(
            self,
            at.step,
            at.train_batch_size,
            at.world_size,
            at.rank,
            at.micro_batch_size,
            at.micro,
        )
        .map_err(|e| e.to_string())
    }
}

/// What a run trains on: windows of a token stream, or chat and instruction examples (one per
/// row, the loss on the answers).
#[derive(Debug)]
pub enum TrainData {
    Windows(DataLoader),
    Examples(ExampleLoader),
}

impl TrainData {
    pub fn name(&self) -> &str {
        match self {
            TrainData::Windows(d) => d.source().name(),
            TrainData::Examples(e) => e.name(),
        }
    }

    /// Samples per epoch, and what they are: `624 windows`, `12 rows of 40 examples`.
    pub fn samples(&self) -> String {
        match self {
            TrainData::Windows(d) => format!("{} windows", d.num_windows()),
            TrainData::Examples(e) => {
                format!("{} rows of {} examples", e.len(), e.examples().len())
            }
        }
    }

    /// Whether a step's loss should be the mean over its trained targets
    /// ([`crate::zero::EngineConfig::loss_per_token`]): examples train on unequal numbers.
    pub fn loss_per_token(&self) -> bool {
        matches!(self, TrainData::Examples(_))
    }

    /// What checkpoints record of the data (and what a resumed run checks it against): its
    /// name, size, window length and the SHA-256 of what it trains on.
    pub fn record(&self) -> serde_json::Value {
        match self {
            TrainData::Windows(d) => serde_json::json!({
                "source": d.source().name(),
                "tokens": d.source().len(),
                "vocab_size": d.source().vocab_size(),
                "context": d.context(),
                "sha256": d.source().fingerprint(),
            }),
            TrainData::Examples(e) => serde_json::json!({
                "source": e.name(),
                "examples": e.len(),
                "context": e.context(),
                "sha256": e.fingerprint(),
            }),
        }
    }
}

impl crate::trainer::DataSource<TokenBatch> for TrainData {
    fn micro_batch(&self, at: crate::trainer::BatchIndex) -> Result<TokenBatch, String> {
        match self {
            TrainData::Windows(d) => crate::trainer::DataSource::micro_batch(d, at),
            TrainData::Examples(e) => crate::trainer::DataSource::micro_batch(e, at),
        }
    }
}

/// Held-out data: windows of a token stream, or examples.
#[derive(Debug)]
pub enum HeldOutData {
    Windows(EvalWindows),
    Examples(ExampleLoader),
}

impl crate::trainer::EvalData<TokenBatch> for HeldOutData {
    fn len(&self) -> usize {
        match self {
            HeldOutData::Windows(w) => w.windows(),
            HeldOutData::Examples(e) => crate::trainer::EvalData::len(e),
        }
    }

    fn batch(&self, range: std::ops::Range<usize>) -> Result<TokenBatch, String> {
        match self {
            HeldOutData::Windows(w) => crate::trainer::EvalData::batch(w, range),
            HeldOutData::Examples(e) => crate::trainer::EvalData::batch(e, range),
        }
    }
}
