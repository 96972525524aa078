//! `train`'s data flags: the byte corpus (one UTF-8 file, bytes are tokens) or, with a tokenizer,
//! text and JSONL files tokenized once into a cached token file
//! ([`zerodp::data::token_data`]).
//!
//! The tokenizer is `--tokenizer FILE`, else `DIR/tokenizer.json` of `--model-dir DIR`. It is
//! loaded before the model is built, because it sizes the model: a preset GPT takes the
//! tokenizer's vocabulary, a Hugging Face config must already have at least as many rows.

use anyhow::{bail, Context};
use std::path::{Path, PathBuf};
use zerodp::data::token_data::{CacheStatus, TextTokenizer, TokenCorpus, TokenDataOptions};
use zerodp::data::{
    chat, Corpus, DataError, DataLoader, ExampleLoader, TokenSource, DEFAULT_CORPUS_PATH,
};
use zerodp::model::GptConfig;

#[derive(clap::Args, Debug, Clone)]
pub struct DataArgs {
    /// Training data. Without a tokenizer: one UTF-8 text file, its bytes the tokens [default:
    /// the demo corpus, data/corpus.txt]. With one: text files, JSONL files (.jsonl, .ndjson,
    /// .json) and directories of them, tokenized once into a cached token file.
    #[arg(long = "data", value_name = "FILE_OR_DIR", num_args = 1..)]
    pub paths: Vec<PathBuf>,
    /// A Hugging Face tokenizer.json [default with --model-dir: DIR/tokenizer.json].
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// The JSONL field holding each document's text [default: text].
    #[arg(long, value_name = "NAME")]
    pub text_field: Option<String>,
    /// The token put between documents [default: eos_token of tokenizer_config.json beside the
    /// tokenizer, else <|endoftext|>, <|end_of_text|>, </s> or <eos>, whichever it has].
    #[arg(long, value_name = "TOKEN")]
    pub eos_token: Option<String>,
    /// Where the token file and its manifest go [default: .zerodp-tokens/ beside the first
    /// --data path].
    #[arg(long, value_name = "DIR")]
    pub data_cache: Option<PathBuf>,
    /// Chat and instruction data: cut every example to its first N tokens (at most the context
    /// + 1) [default: an example longer than a row is refused, naming its line].
    #[arg(long, value_name = "N")]
    pub max_example_tokens: Option<usize>,
    /// Chat and instruction data: one example per row, the rest padding [default: examples
    /// share rows where they fit, each attending only to itself from position 0; on the CPU
    /// kernels only, so a GPU run takes one per row].
    #[arg(long)]
    pub no_packing: bool,
}

impl DataArgs {
    /// The tokenizer file: `--tokenizer`, else `model_dir/tokenizer.json` when it exists.
    fn tokenizer_path(&self, model_dir: Option<&Path>) -> Option<PathBuf> {
        let from_dir = model_dir
            .map(|d| d.join("tokenizer.json"))
            .filter(|p| p.is_file());
        self.tokenizer.clone().or(from_dir)
    }

    /// Loads the tokenizer, if any, and fits the model to it: a preset GPT (`from_config`
    /// false) takes its vocabulary; a model from a config must have a row for its largest id.
    pub fn fit_model(
        &self,
        mut gpt: GptConfig,
        model_dir: Option<&Path>,
        from_config: bool,
    ) -> anyhow::Result<(GptConfig, Option<TextTokenizer>)> {
        let Some(path) = self.tokenizer_path(model_dir) else {
            self.check_byte_corpus()?;
            return Ok((gpt, None));
        };
        warn_overridden_tokenizer(self.tokenizer.as_deref(), model_dir);
        let tokenizer = TextTokenizer::from_file(&path, self.eos_token.as_deref())?;
        let bound = tokenizer.id_bound();
        if !from_config {
            gpt.vocab_size = bound;
        } else if gpt.vocab_size < bound {
            bail!(
                "the model's vocab_size {} is smaller than the tokenizer's vocabulary {bound} ({}: \
                 its largest id is {}, among {} tokens); the tokenizer does not belong to this \
                 model: use the model's own tokenizer.json",
                gpt.vocab_size,
                path.display(),
                bound - 1,
                tokenizer.vocab_size()
            );
        }
        Ok((gpt, Some(tokenizer)))
    }

    /// Without a tokenizer the data is one UTF-8 file of bytes: refuses what only a tokenizer
    /// would use.
    fn check_byte_corpus(&self) -> anyhow::Result<()> {
        if self.paths.len() > 1 {
            bail!("several --data paths need a tokenizer (--tokenizer FILE or --model-dir DIR); without one the data is a single UTF-8 text file");
        }
        let flags = [
            ("--text-field", self.text_field.is_some()),
            ("--eos-token", self.eos_token.is_some()),
            ("--data-cache", self.data_cache.is_some()),
        ];
        if let Some((flag, _)) = flags.iter().find(|(_, set)| *set) {
            bail!("{flag} needs a tokenizer (--tokenizer FILE or --model-dir DIR with a tokenizer.json); without one the data's bytes are its tokens");
        }
        Ok(())
    }

    /// Every file and directory the data flags make a run read, as inputs of the output-path
    /// checks: the `--data` paths, the tokenizer and the `tokenizer_config.json` read beside it
    /// (for its EOS token), and the token cache (`model_dir`'s tokenizer is the directory's).
    pub fn inputs(&self, model_dir: Option<&Path>) -> Vec<(&'static str, PathBuf)> {
        let mut inputs: Vec<(&'static str, PathBuf)> =
            self.paths.iter().map(|p| ("--data", p.clone())).collect();
        if let Some(t) = &self.tokenizer {
            inputs.push(("--tokenizer", t.clone()));
            let beside = t.with_file_name("tokenizer_config.json");
            if beside.is_file() {
                inputs.push(("the tokenizer_config.json beside --tokenizer", beside));
            }
        }
        if self.tokenizer_path(model_dir).is_some() {
            inputs.push(("the token cache", self.cache_dir()));
        }
        inputs
    }

    /// Where the token file is cached: `--data-cache`, else beside the first input.
    fn cache_dir(&self) -> PathBuf {
        match &self.data_cache {
            Some(d) => d.clone(),
            None => {
                let first = self.default_paths().remove(0);
                let first = std::fs::canonicalize(&first).unwrap_or(first);
                zerodp::data::token_data::default_cache_dir(first)
            }
        }
    }

    /// Bytes of the input files, for the memory plan (a missing file counts 0; it is reported
    /// when it is read).
    pub fn input_bytes(&self) -> u64 {
        let paths = self.default_paths();
        zerodp::data::token_inputs::resolve_inputs(&paths)
            .map(|files| files.iter().map(|f| f.size).sum())
            .unwrap_or_else(|_| {
                paths
                    .iter()
                    .map(|p| std::fs::metadata(p).map_or(0, |m| m.len()))
                    .sum()
            })
    }

    fn default_paths(&self) -> Vec<PathBuf> {
        match self.paths.is_empty() {
            true => vec![PathBuf::from(DEFAULT_CORPUS_PATH)],
            false => self.paths.clone(),
        }
    }

    /// The loader over `source` (the training data of [`DataArgs::source`], or its training
    /// part): its largest id is checked against `gpt`'s vocabulary before any step.
    pub fn loader_over(
        &self,
        source: TokenSource,
        gpt: &GptConfig,
        seed: u64,
    ) -> anyhow::Result<DataLoader> {
        let loader = DataLoader::new(source, gpt.context, seed).map_err(anyhow::Error::from);
        let loader = loader.map_err(|e| match e.downcast_ref::<DataError>() {
            Some(DataError::TooShort { .. } | DataError::TooFewTokens { .. }) => {
                e.context(format!(
                "the data cannot fill one window of {} tokens (shorter windows are --context N)",
                gpt.context
            ))
            }
            _ => e,
        })?;
        loader.source().check_vocab(gpt.vocab_size)?;
        Ok(loader)
    }

    /// Chat or instruction examples, when `paths` (with a tokenizer) are JSONL files of
    /// `messages` or `prompt`/`completion` lines ([`zerodp::data::chat::is_chat_file`]): rendered
    /// with the chat template beside the tokenizer, one example per row of `gpt.context`.
    pub fn examples(
        &self,
        paths: &[PathBuf],
        tokenizer: Option<&TextTokenizer>,
        (gpt, seed, on_cpu): (&GptConfig, u64, bool),
    ) -> anyhow::Result<Option<ExampleLoader>> {
        let Some(tokenizer) = tokenizer else {
            return Ok(None);
        };
        let files = zerodp::data::token_inputs::resolve_inputs(paths)?;
        let chat = files.iter().filter(|f| chat::is_chat_file(&f.path)).count();
        if chat == 0 {
            return Ok(None);
        }
        if chat < files.len() {
            bail!("{} of {} data files are chat or instruction JSONL (messages, prompt/completion) and the others are not: train on one kind at a time", chat, files.len());
        }
        let dir = tokenizer.path().parent().unwrap_or(Path::new("."));
        let template = match dir.join("tokenizer_config.json").is_file() {
            true => Some(chat::ChatTemplate::from_tokenizer_dir(dir)?),
            false => None,
        };
        let mut examples = Vec::new();
        for f in &files {
            examples.extend(chat::read_numbered_examples(
                &f.path,
                template.as_ref(),
                tokenizer,
            )?);
        }
        let name = files
            .iter()
            .map(|f| f.path.display().to_string())
            .collect::<Vec<_>>();
        let pad = tokenizer.eos_id();
        let shape = (gpt.context, pad, seed);
        let fit = (self.max_example_tokens, on_cpu && !self.no_packing);
        let loader = ExampleLoader::new(name.join(", "), examples, shape, fit)?;
        if loader.max_id() as usize >= gpt.vocab_size {
            bail!(
                "{}: token id {} is past the model's vocabulary of {}",
                loader.name(),
                loader.max_id(),
                gpt.vocab_size
            );
        }
        Ok(Some(loader))
    }

    /// The token stream of `--data` (the demo corpus when none is given): the byte corpus, or
    /// with `tokenizer` the token file, built or reused.
    pub fn source(
        &self,
        tokenizer: Option<&TextTokenizer>,
        flags: (bool, bool),
    ) -> anyhow::Result<TokenSource> {
        let paths = self.default_paths();
        self.source_of(&paths, ("--data", self.paths.is_empty()), tokenizer, flags)
    }

    /// The token stream of `paths` (given as `flag`; `is_default` for the demo corpus), encoded
    /// as `--data` is: the one UTF-8 file's bytes without a tokenizer, else a token file (in
    /// `--data-cache` when given, else beside `paths[0]`), with rank 0's note on it.
    pub fn source_of(
        &self,
        paths: &[PathBuf],
        (flag, is_default): (&str, bool),
        tokenizer: Option<&TextTokenizer>,
        (rank0, progress): (bool, bool),
    ) -> anyhow::Result<TokenSource> {
        let Some(tokenizer) = tokenizer else {
            if paths.len() > 1 {
                bail!("several {flag} paths need a tokenizer (--tokenizer FILE or --model-dir DIR); without one the data is a single UTF-8 text file");
            }
            return Ok(read_corpus(&paths[0], flag, is_default)?.into());
        };
        if is_default {
            check_exists(&paths[0], flag, true)?;
        }
        let options = TokenDataOptions {
            text_field: self.text_field.clone(),
            cache_dir: self.data_cache.clone(),
            progress: rank0 && progress,
            ..Default::default()
        };
        let corpus = TokenCorpus::build_with(paths, tokenizer, &options)
            .with_context(|| format!("tokenizing {flag}"))?;
        if rank0 {
            report(&corpus, tokenizer);
        }
        Ok(corpus.into())
    }
}

/// `--tokenizer T` beside a `--model-dir` whose own `tokenizer.json` differs: allowed (a new
/// tokenizer for a model is a choice) but said, naming both.
fn warn_overridden_tokenizer(flag: Option<&Path>, model_dir: Option<&Path>) {
    let (Some(flag), Some(dir)) = (flag, model_dir) else {
        return;
    };
    let own = dir.join("tokenizer.json");
    let (Ok(a), Ok(b)) = (std::fs::read(flag), std::fs::read(&own)) else {
        return;
    };
    if a != b {
        errln!(
            "warning: --tokenizer {} replaces the model directory's own tokenizer {}, which \
             differs: the model's embeddings were trained on the ids of its own; drop \
             --tokenizer to use it",
            flag.display(),
            own.display()
        );
    }
}

fn report(corpus: &TokenCorpus, tokenizer: &TextTokenizer) {
    let m = corpus.manifest();
    let what = match corpus.status() {
        CacheStatus::Reused => "reusing".to_string(),
        CacheStatus::Built(why) => format!("built ({why})"),
    };
    errln!(
        "tokens: {what} {}: {} tokens from {} documents in {} files, tokenizer {} (vocabulary {}, \
         EOS {} = {})",
        corpus.token_file().display(),
        m.tokens,
        m.documents,
        m.files.len(),
        tokenizer.path().display(),
        m.vocab_size,
        m.eos_token,
        m.eos_id
    );
}

/// A missing demo corpus gets the command that fetches it.
fn check_exists(path: &Path, flag: &str, is_default: bool) -> anyhow::Result<()> {
    if !path.exists() {
        if is_default {
            bail!(
                "the demo corpus {} is missing: run scripts/fetch_corpus.sh to download it (about 5 MB), \
                 or pass --data FILE with any UTF-8 text",
                path.display()
            );
        }
        bail!("{flag} {}: no such file", path.display());
    }
    Ok(())
}

fn read_corpus(path: &Path, flag: &str, is_default: bool) -> anyhow::Result<Corpus> {
    check_exists(path, flag, is_default)?;
    if path.is_dir() {
        bail!(
            "{flag} {} is a directory: a directory of text or JSONL files needs a tokenizer \
             (--tokenizer FILE or --model-dir DIR)",
            path.display()
        );
    }
    Ok(Corpus::from_file(path)?)
}
