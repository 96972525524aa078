//! Tokenized training data: text and JSONL files through a Hugging Face `tokenizer.json`, into a
//! token file that is built once and memory-mapped on every later run.
//!
//! * The token stream: every document (see [`super::token_inputs`]: a text file, or a JSONL
//!   line's text field) encoded on its own with the tokenizer's special tokens, as
//!   `tokenizer(text)` does in `transformers` (so a Llama tokenizer puts `<s>` before each), and
//!   the documents joined with the EOS id *between* them (none after the last; a document with
//!   empty text is skipped). The tokenizer's truncation and padding are switched off: a document
//!   is never truncated or padded (a long one is encoded in pieces, to the same ids: see
//!   `pieces.rs`). Files follow each other in `--data` order.
//! * The EOS token: the one given, else `eos_token` of a `tokenizer_config.json` beside the
//!   tokenizer, else the first of `<|endoftext|>`, `<|end_of_text|>`, `</s>`, `<eos>` the
//!   tokenizer knows.
//! * The cache: `tokens-<key>.u32` (the ids, little-endian u32) and `tokens-<key>.json` (the
//!   [`Manifest`]) in the cache directory (`--data-cache`, default `.zerodp-tokens/` beside the
//!   first input), `<key>` a hash of the input paths and the text field. The next run reuses them
//!   when the tokenizer's SHA-256, the EOS id, the field and every file's size and modification
//!   time are the manifest's and the token file's own SHA-256 is the one the manifest recorded
//!   (so a file damaged in place, even with its size kept, is never trained on); otherwise it
//!   rebuilds them in place and says why. The check reads the whole token file once per run
//!   (SHA-256: 0.56 s a GB with the CPU's SHA instructions, `cargo bench --bench token_cache`).
//!   Both files are
//!   written atomically, the manifest removed first and written last, so a run killed half way
//!   leaves a cache that the next run rebuilds, never one that lies. Processes that find the cache
//!   stale at once (an MPI job's ranks) build it one at a time under a lock beside it
//!   (`tokens-<key>.lock`): the first builds, the rest reuse.
//! * [`super::DataLoader`] cuts the stream into `context + 1` windows exactly as it cuts the
//!   byte corpus, so the data order stays a pure function of the seed and the step.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::token_inputs::{read_documents, resolve_inputs, Document, InputFile};
use super::DataError;
use crate::atomic_file::{write_atomic, AtomicFile};

mod pieces;

/// The JSONL field read when none is named.
pub const DEFAULT_TEXT_FIELD: &str = "text";

/// EOS tokens recognised by name when nothing says which one the tokenizer ends a text with.
pub(crate) const EOS_CANDIDATES: [&str; 4] = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"];

/// Bumped whenever the token stream's definition changes, so that old caches are rebuilt.
const FORMAT_VERSION: u32 = 2;

/// Token ids and each token's byte range `[start, end)` in the text they encode
/// ([`TextTokenizer::encode_with_offsets`]).
pub type IdsWithOffsets = (Vec<u32>, Vec<(usize, usize)>);

/// A Hugging Face `tokenizer.json`, its SHA-256 and the EOS id put between documents.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    sha256: String,
    eos: (String, u32),
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("path", &self.path)
            .field("sha256", &self.sha256)
            .field("eos", &self.eos)
            .finish()
    }
}

impl TextTokenizer {
    /// Loads `path`; `eos` names the EOS token (see the module docs for the default).
    pub fn from_file(path: &Path, eos: Option<&str>) -> Result<Self, DataError> {
        let bad = |msg: String| DataError::Tokenizer {
            path: path.to_path_buf(),
            msg,
        };
        let bytes = std::fs::read(path).map_err(|e| bad(format!("cannot read it: {e}")))?;
        let mut inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| bad(e.to_string()))?;
        inner
            .with_truncation(None)
            .map_err(|e| bad(e.to_string()))?;
        inner.with_padding(None);
        let eos_name = match eos {
            Some(name) => name.to_string(),
            None => default_eos(path, &inner)?,
        };
        let eos_id = inner.token_to_id(&eos_name).ok_or_else(|| {
            bad(format!(
                "the EOS token {eos_name:?} is not in its vocabulary; name another with --eos-token"
            ))
        })?;
        Ok(Self {
            inner,
            path: std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf()),
            sha256: hex(&Sha256::digest(&bytes)),
            eos: (eos_name, eos_id),
        })
    }

    /// Vocabulary size, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// One past the largest id the tokenizer can produce, added tokens included: a model must
    /// have at least this many embedding rows (more than [`Self::vocab_size`] where the ids have
    /// gaps, as when an added token takes an id past the base vocabulary).
    pub fn id_bound(&self) -> usize {
        let largest = self.inner.get_vocab(true).into_values().max();
        largest.map_or(0, |id| id as usize + 1)
    }

    pub fn eos_token(&self) -> &str {
        &self.eos.0
    }

    pub fn eos_id(&self) -> u32 {
        self.eos.1
    }

    /// The text of `ids`, special tokens left out (`decode(..., skip_special_tokens=True)`).
    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self.inner.decode(ids, true).map_err(|e| e.to_string())
    }

    /// The id of `token`, if the vocabulary has it (added tokens included).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// SHA-256 of the tokenizer.json bytes, as `sha256sum` prints it.
    pub fn sha256(&self) -> &str {
        &self.sha256
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The ids of one document (with the tokenizer's special tokens).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.inner
            .encode_fast(text, true)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }

    /// The ids of `text` and each token's byte range in it (`[start, end)`), for the masks of
    /// chat data ([`super::chat`]): a token is trained by where its text lies. A special token
    /// the tokenizer adds itself (`add_special_tokens`) has the empty range `(0, 0)`.
    /// `apply_chat_template` encodes with `add_special_tokens = false`, the template having
    /// written the BOS. No truncation or padding (switched off at load).
    pub fn encode_with_offsets(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<IdsWithOffsets, String> {
        let e = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| e.to_string())?;
        Ok((e.get_ids().to_vec(), e.get_offsets().to_vec()))
    }
}

/// `eos_token` of `tokenizer_config.json` beside the tokenizer, else the first known name.
fn default_eos(path: &Path, tok: &tokenizers::Tokenizer) -> Result<String, DataError> {
    let config = path.with_file_name("tokenizer_config.json");
    if let Ok(text) = std::fs::read_to_string(&config) {
        let value: Option<serde_json::Value> = serde_json::from_str(&text).ok();
        let eos = value.as_ref().and_then(|v| v.get("eos_token"));
        let name = eos.and_then(|e| e.as_str().or_else(|| e.get("content")?.as_str()));
        if let Some(name) = name {
            return Ok(name.to_string());
        }
    }
    EOS_CANDIDATES
        .iter()
        .find(|c| tok.token_to_id(c).is_some())
        .map(|c| c.to_string())
        .ok_or_else(|| DataError::Tokenizer {
            path: path.to_path_buf(),
            msg: format!(
                "cannot tell its EOS token (no tokenizer_config.json beside it names one, and it \
                 has none of {}); name it with --eos-token",
                EOS_CANDIDATES.join(" ")
            ),
        })
}

/// The token file's checksum as its manifest records it: SHA-256 of its bytes, in hex (what
/// `sha256sum` prints). Every reuse of a cache computes it over the whole file.
pub fn checksum(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What a token file holds and what it was made from; see the module docs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    pub tokenizer: PathBuf,
    pub tokenizer_sha256: String,
    pub eos_token: String,
    pub eos_id: u32,
    pub vocab_size: usize,
    pub text_field: String,
    pub files: Vec<InputFile>,
    pub documents: u64,
    pub tokens: u64,
    /// The largest id in the token file (0 when it is empty).
    pub max_id: u32,
    /// SHA-256 of the token file's bytes, as `sha256sum` prints it: checked on every reuse.
    pub sha256: String,
}

impl Manifest {
    /// Why a cache made from `self` does not fit `want`, or `None` when it does.
    fn stale_reason(&self, want: &Manifest) -> Option<String> {
        if self.format != want.format {
            return Some("the token file format changed".into());
        }
        if self.tokenizer_sha256 != want.tokenizer_sha256 {
            return Some(format!(
                "the tokenizer changed (sha256 {:.12} -> {:.12})",
                self.tokenizer_sha256, want.tokenizer_sha256
            ));
        }
        if (self.eos_id, &self.text_field) != (want.eos_id, &want.text_field) {
            return Some("the EOS token or the text field changed".into());
        }
        let paths = |m: &Manifest| m.files.iter().map(|f| f.path.clone()).collect::<Vec<_>>();
        if paths(self) != paths(want) {
            return Some("the list of input files changed".into());
        }
        let changed = self.files.iter().zip(&want.files).find(|(a, b)| a != b);
        changed.map(|(_, b)| format!("{} changed (size or modification time)", b.path.display()))
    }
}

/// Where the token file and its manifest live, and whether to draw a progress bar.
#[derive(Clone, Debug, Default)]
pub struct TokenDataOptions {
    /// The JSONL field holding the text [default: [`DEFAULT_TEXT_FIELD`]].
    pub text_field: Option<String>,
    /// The cache directory [default: `.zerodp-tokens/` beside the first input].
    pub cache_dir: Option<PathBuf>,
    /// Draw a progress bar over the input bytes while tokenizing (on a terminal only).
    pub progress: bool,
    /// A document longer than this is encoded in pieces of about this many bytes where that
    /// gives the same ids (see `pieces.rs`) [0: [`DEFAULT_PIECE_BYTES`]].
    pub piece_bytes: usize,
}

/// 256 KiB: `tokenizers` holds some 300 bytes per token while it encodes, so each thread
/// encoding a piece holds a few tens of MB.
pub const DEFAULT_PIECE_BYTES: usize = 256 << 10;

/// How a [`TokenCorpus`] came to be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheStatus {
    /// The token file was up to date and is reused.
    Reused,
    /// The token file was (re)built; the reason, e.g. "the tokenizer changed".
    Built(String),
}

/// A memory-mapped token file and its manifest.
#[derive(Debug)]
pub struct TokenCorpus {
    name: String,
    map: Option<memmap2::Mmap>,
    manifest: Manifest,
    token_file: PathBuf,
    status: CacheStatus,
}

impl TokenCorpus {
    /// Tokenizes `files` (text, JSONL or directories of them) with the tokenizer at
    /// `tokenizer`, or reuses the cache made from the same inputs: the entry point for a caller
    /// that has the paths (`zerodp train --data ... --tokenizer ...`, or `--model-dir DIR` with
    /// `DIR/tokenizer.json`). Draws no progress bar; see [`TokenCorpus::build_with`].
    pub fn build(
        files: &[PathBuf],
        tokenizer: &Path,
        field: Option<&str>,
        cache: Option<&Path>,
    ) -> Result<TokenCorpus, DataError> {
        let tokenizer = TextTokenizer::from_file(tokenizer, None)?;
        let options = TokenDataOptions {
            text_field: field.map(str::to_string),
            cache_dir: cache.map(Path::to_path_buf),
            ..Default::default()
        };
        Self::build_with(files, &tokenizer, &options)
    }

    /// [`TokenCorpus::build`] with a loaded tokenizer and every option.
    pub fn build_with(
        files: &[PathBuf],
        tokenizer: &TextTokenizer,
        options: &TokenDataOptions,
    ) -> Result<TokenCorpus, DataError> {
        let inputs = resolve_inputs(files)?;
        let field = options.text_field.as_deref().unwrap_or(DEFAULT_TEXT_FIELD);
        let want = Manifest {
            format: FORMAT_VERSION,
            tokenizer: tokenizer.path().to_path_buf(),
            tokenizer_sha256: tokenizer.sha256().to_string(),
            eos_token: tokenizer.eos_token().to_string(),
            eos_id: tokenizer.eos_id(),
            vocab_size: tokenizer.vocab_size(),
            text_field: field.to_string(),
            files: inputs,
            documents: 0,
            tokens: 0,
            max_id: 0,
            sha256: String::new(),
        };
        let (token_file, manifest_file) = cache_paths(files, &want, options.cache_dir.as_deref())?;
        if let Ok(corpus) = Self::reuse(&manifest_file, &token_file, &want)? {
            return Ok(corpus);
        }
        // Another process may be building this very file: wait for it, then look again.
        let _lock = build_lock(&token_file.with_extension("lock"), options.progress);
        let status = match Self::reuse(&manifest_file, &token_file, &want)? {
            Ok(corpus) => return Ok(corpus),
            Err(reason) => reason,
        };
        let _ = std::fs::remove_file(&manifest_file);
        let manifest = write_tokens(&token_file, tokenizer, want, options)?;
        let json = serde_json::to_vec_pretty(&manifest).map_err(std::io::Error::other);
        json.and_then(|j| write_atomic(&manifest_file, &j))
            .map_err(|e| cache_error(&manifest_file, "writing", e))?;
        Self::open(token_file, manifest, CacheStatus::Built(status))
    }

    /// The cached token file when it fits `want` and its bytes are still the ones its manifest
    /// recorded (`Ok(Err(why))` when it must be rebuilt).
    fn reuse(
        manifest_file: &Path,
        token_file: &Path,
        want: &Manifest,
    ) -> Result<Result<TokenCorpus, String>, DataError> {
        let old = match usable_cache(manifest_file, token_file, want) {
            Ok(old) => old,
            Err(reason) => return Ok(Err(reason)),
        };
        let corpus = Self::open(token_file.to_path_buf(), old, CacheStatus::Reused)?;
        // Hashed on the mapping itself: what is checked is what training will read.
        let sha256 = checksum(corpus.id_bytes());
        if sha256 != corpus.manifest.sha256 {
            return Ok(Err(format!(
                "the token file was damaged since it was built (sha256 {sha256:.12}, the \
                 manifest's {:.12})",
                corpus.manifest.sha256
            )));
        }
        Ok(Ok(corpus))
    }

    /// Maps `token_file`, which `manifest` describes.
    fn open(
        token_file: PathBuf,
        manifest: Manifest,
        status: CacheStatus,
    ) -> Result<Self, DataError> {
        let map = if manifest.tokens == 0 {
            None
        } else {
            let f = std::fs::File::open(&token_file)
                .map_err(|e| cache_error(&token_file, "opening", e))?;
            // Safety: the file is ours (written through a rename, never modified in place); a
            // rebuild replaces the name, and this mapping keeps the old inode alive.
            let map = unsafe { memmap2::Mmap::map(&f) };
            let map = map.map_err(|e| cache_error(&token_file, "mapping", e))?;
            // Checked again on the mapping itself (the name may have been replaced since), so
            // that reading a window can never run past its end.
            if map.len() as u64 != manifest.tokens * 4 {
                let msg = format!(
                    "holds {} bytes, not the manifest's {} tokens",
                    map.len(),
                    manifest.tokens
                );
                return Err(cache_error(
                    &token_file,
                    "mapping",
                    std::io::Error::other(msg),
                ));
            }
            Some(map)
        };
        let name = match manifest.files.as_slice() {
            [one] => one.path.display().to_string(),
            files => format!("{} files", files.len()),
        };
        Ok(Self {
            name,
            map,
            manifest,
            token_file,
            status,
        })
    }

    /// The input file (or "N files").
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.manifest.tokens as usize
    }

    pub fn is_empty(&self) -> bool {
        self.manifest.tokens == 0
    }

    pub fn vocab_size(&self) -> usize {
        self.manifest.vocab_size
    }

    /// The largest id in the token file.
    pub(crate) fn max_id(&self) -> u32 {
        self.manifest.max_id
    }

    /// SHA-256 of the token file (checked against the bytes when the cache was reused, computed
    /// while writing when it was built).
    pub fn sha256(&self) -> &str {
        &self.manifest.sha256
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    pub fn token_file(&self) -> &Path {
        &self.token_file
    }

    pub fn status(&self) -> &CacheStatus {
        &self.status
    }

    /// The token file's bytes: every id as 4 little-endian bytes.
    pub(super) fn id_bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }

    /// Tokens `[start, start + len)` appended to `out` (little-endian in the file, so the bytes
    /// are read one id at a time rather than cast in place).
    pub(crate) fn read_into(&self, start: usize, len: usize, out: &mut Vec<u32>) {
        let bytes = self.map.as_deref().unwrap_or(&[]);
        let window = &bytes[start * 4..(start + len) * 4];
        out.extend(
            window
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        );
    }

    /// Every token (for tests and tools; a training run reads windows).
    pub fn to_vec(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len());
        self.read_into(0, self.len(), &mut out);
        out
    }

    /// Refuses a model whose vocabulary has fewer rows than the tokenizer has ids.
    pub fn check_vocab(&self, model_vocab: usize) -> Result<(), DataError> {
        if model_vocab < self.vocab_size() {
            return Err(DataError::VocabTooSmall {
                model: model_vocab,
                tokenizer: self.vocab_size(),
                path: self.manifest.tokenizer.clone(),
            });
        }
        Ok(())
    }
}

fn cache_error(path: &Path, action: &'static str, source: std::io::Error) -> DataError {
    DataError::Cache {
        path: path.to_path_buf(),
        action,
        source,
    }
}

/// The cache directory when none is named: `.zerodp-tokens/` in the first input (a directory) or
/// beside it (a file).
pub fn default_cache_dir(first_input: PathBuf) -> PathBuf {
    let base = match first_input.is_dir() {
        true => first_input,
        false => first_input
            .parent()
            .map_or(first_input.clone(), Path::to_path_buf),
    };
    base.join(".zerodp-tokens")
}

/// The token file and manifest paths: `tokens-<key>.{u32,json}` in the cache directory.
fn cache_paths(
    args: &[PathBuf],
    want: &Manifest,
    cache_dir: Option<&Path>,
) -> Result<(PathBuf, PathBuf), DataError> {
    let first = &want.files[0].path;
    let dir = match cache_dir {
        Some(d) => d.to_path_buf(),
        None => {
            default_cache_dir(std::fs::canonicalize(&args[0]).unwrap_or_else(|_| first.clone()))
        }
    };
    std::fs::create_dir_all(&dir)
        .map_err(|e| cache_error(&dir, "creating (choose another with --data-cache DIR)", e))?;
    let mut key = Sha256::new();
    for f in &want.files {
        key.update(f.path.as_os_str().as_encoded_bytes());
        key.update([0]);
    }
    key.update(want.text_field.as_bytes());
    let key = hex(&key.finalize()[..8]);
    Ok((
        dir.join(format!("tokens-{key}.u32")),
        dir.join(format!("tokens-{key}.json")),
    ))
}

/// The manifest at `path` when it parses and its token file has the size it records.
fn cached_manifest(path: &Path, token_file: &Path) -> Option<Manifest> {
    let manifest: Manifest = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
    let size = std::fs::metadata(token_file).ok()?.len();
    (size == manifest.tokens * 4).then_some(manifest)
}

/// The cached manifest when the token file it describes fits `want`, else why it does not.
fn usable_cache(manifest: &Path, token_file: &Path, want: &Manifest) -> Result<Manifest, String> {
    let Some(old) = cached_manifest(manifest, token_file) else {
        return Err("no token file yet".to_string());
    };
    match old.stale_reason(want) {
        None => Ok(old),
        Some(reason) => Err(reason),
    }
}

/// Serialises the builds of one token file between processes (the ranks of an MPI job on a host
/// start together): the first builds, the others wait, then find it built and reuse it. The
/// kernel drops the lock when its holder exits, so a killed build blocks nobody. Where the file
/// system has no locks every process builds (the same bytes, each renamed into place whole).
fn build_lock(path: &Path, progress: bool) -> Option<std::fs::File> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .ok()?;
    match file.try_lock() {
        Ok(()) => return Some(file),
        Err(std::fs::TryLockError::WouldBlock) => {}
        Err(std::fs::TryLockError::Error(_)) => return None,
    }
    let spinner = match progress {
        true => indicatif::ProgressBar::new_spinner(),
        false => indicatif::ProgressBar::hidden(),
    };
    spinner.set_message(format!(
        "waiting for another process building {}",
        path.with_extension("u32").display()
    ));
    spinner.enable_steady_tick(std::time::Duration::from_millis(200));
    let locked = file.lock().is_ok();
    spinner.finish_and_clear();
    locked.then_some(file)
}

/// Documents are encoded in parallel in batches of about this many bytes of text.
const BATCH_BYTES: usize = 4 << 20;

/// Streams the ids into the token file: EOS between documents, counts for the manifest.
struct TokenWriter<'a> {
    out: BufWriter<AtomicFile>,
    hash: Sha256,
    path: &'a Path,
    tokenizer: &'a TextTokenizer,
    bar: &'a indicatif::ProgressBar,
    piece_bytes: usize,
    documents: u64,
    tokens: u64,
    max_id: u32,
}

impl TokenWriter<'_> {
    /// Encodes `docs` of `file` (each with the file bytes it took), in parallel, and appends
    /// them in order.
    fn write_batch(
        &mut self,
        file: &Path,
        docs: &mut Vec<(Document, u64)>,
    ) -> Result<(), DataError> {
        let (tokenizer, bar, piece_bytes) = (self.tokenizer, self.bar, self.piece_bytes);
        let encoded: Vec<Result<Vec<u32>, DataError>> = docs
            .par_iter()
            .filter(|(d, n)| {
                bar.inc(if d.text.is_empty() { *n } else { 0 });
                !d.text.is_empty()
            })
            .map(|(d, n)| {
                let ids = tokenizer.encode_document(&d.text, piece_bytes, &|b| bar.inc(b));
                bar.inc(n.saturating_sub(d.text.len() as u64));
                ids.map_err(|msg| DataError::Encode {
                    path: file.to_path_buf(),
                    line: d.line,
                    msg,
                })
            })
            .collect();
        docs.clear();
        for ids in encoded {
            let ids = ids?;
            if self.documents > 0 {
                self.push(tokenizer.eos_id())?;
            }
            self.documents += 1;
            for id in ids {
                self.push(id)?;
            }
        }
        Ok(())
    }

    fn push(&mut self, id: u32) -> Result<(), DataError> {
        self.tokens += 1;
        self.max_id = self.max_id.max(id);
        self.hash.update(id.to_le_bytes());
        self.out
            .write_all(&id.to_le_bytes())
            .map_err(|e| cache_error(self.path, "writing", e))
    }

    fn commit(self) -> Result<(), DataError> {
        let path = self.path;
        let file = self
            .out
            .into_inner()
            .map_err(|e| cache_error(path, "writing", e.into_error()))?;
        file.commit().map_err(|e| cache_error(path, "writing", e))
    }
}

/// Tokenizes every input of `want` into `token_file`; `want` comes back with the counts (and the
/// vocabulary raised to the largest id + 1, for a tokenizer whose ids have gaps).
fn write_tokens(
    token_file: &Path,
    tokenizer: &TextTokenizer,
    mut want: Manifest,
    options: &TokenDataOptions,
) -> Result<Manifest, DataError> {
    let bar = progress_bar(want.files.iter().map(|f| f.size).sum(), options.progress);
    let out = AtomicFile::create(token_file).map_err(|e| cache_error(token_file, "creating", e))?;
    let mut writer = TokenWriter {
        out: BufWriter::with_capacity(1 << 20, out),
        hash: Sha256::new(),
        path: token_file,
        tokenizer,
        bar: &bar,
        piece_bytes: match options.piece_bytes {
            0 => DEFAULT_PIECE_BYTES,
            n => n,
        },
        documents: 0,
        tokens: 0,
        max_id: 0,
    };
    for file in &want.files {
        bar.set_message(file.path.display().to_string());
        let (mut docs, mut bytes) = (Vec::new(), 0usize);
        read_documents(file, &want.text_field, &mut |doc, n| {
            bytes += doc.text.len();
            docs.push((doc, n));
            if bytes < BATCH_BYTES {
                return Ok(());
            }
            bytes = 0;
            writer.write_batch(&file.path, &mut docs)
        })?;
        writer.write_batch(&file.path, &mut docs)?;
    }
    bar.finish_and_clear();
    (want.documents, want.tokens) = (writer.documents, writer.tokens);
    if writer.tokens > 0 {
        want.vocab_size = want.vocab_size.max(writer.max_id as usize + 1);
    }
    want.max_id = writer.max_id;
    want.sha256 = hex(&writer.hash.clone().finalize());
    writer.commit()?;
    Ok(want)
}

fn progress_bar(total: u64, show: bool) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total);
    let style = indicatif::ProgressStyle::with_template(
        "tokenizing {bar:30} {bytes}/{total_bytes} {bytes_per_sec} [{elapsed_precise}<{eta_precise}] {wide_msg}",
    );
    bar.set_style(style.unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()));
    bar
}
