//! `zerodp generate`: text from a model, a token at a time over a KV cache
//! ([`zerodp::model::generate`]), streamed to standard output as it comes.
//!
//! The model: a Hugging Face directory (`--model-dir`: config, weights, tokenizer), a checkpoint
//! (`--checkpoint`: the Hugging Face config and tokenizer its run recorded, or a preset's shape
//! from `--model`), or a preset or config with `--init` weights. The prompt is encoded with the
//! tokenizer's special tokens, as `transformers` encodes it (a Llama tokenizer's `<s>` first);
//! without a tokenizer (a preset trained on bytes) its bytes are the tokens. Generation stops at
//! the EOS and end-of-turn tokens the tokenizer has, after `--max-new-tokens`, or at the model's
//! last position. Standard output holds only the text; the statistics go to standard error.

use super::hf_model::HfModelArgs;
use super::train::ModelArgs;
use anyhow::{bail, Context};
use std::io::Write;
use std::path::PathBuf;
use zerodp::data::{chat, TextTokenizer};
use zerodp::model::generate::{Ended, GenerateOptions, Sampling, UnitTensors};
use zerodp::model::hf::HfConfig;
use zerodp::model::train_model::{build_model, HfModel, TrainModel, CHECKPOINT_KEY};
use zerodp::model::{load_safetensors, GptConfig};
use zerodp::zero::unit::UnitModel;

/// Tokens that end a turn in the chat formats people fine-tune with; each stops generation where
/// the tokenizer has it, besides its EOS.
const END_OF_TURN: [&str; 5] = [
    "<|im_end|>",
    "<|eot_id|>",
    "<end_of_turn>",
    "<|end|>",
    "<|endoftext|>",
];

#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub hf: HfModelArgs,
    #[command(flatten)]
    pub model: ModelArgs,
    /// A checkpoint (a --save-dir, its `latest`, or one checkpoint directory).
    #[arg(long, value_name = "DIR", conflicts_with_all = ["model_dir", "init"])]
    pub checkpoint: Option<PathBuf>,
    /// Weights for a preset or --model-config model.
    #[arg(long, value_name = "FILE.safetensors")]
    pub init: Option<PathBuf>,
    /// A Hugging Face tokenizer.json [default: the model directory's, or the one the
    /// checkpoint's run used; none: bytes are tokens].
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// The text to continue.
    #[arg(long, required_unless_present = "chat", conflicts_with = "chat")]
    pub prompt: Option<String>,
    /// Conversations to answer: a JSONL file of `{"messages": [{"role", "content"}, ...]}`
    /// lines, each rendered with the tokenizer's chat template and a generation prompt; the
    /// answers are written one after the other, a blank line between.
    #[arg(long, value_name = "JSONL")]
    pub chat: Option<PathBuf>,
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    /// 0 is greedy (the most likely token each step); above 0 samples from the softmax of the
    /// logits divided by it.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Sample only from the most likely tokens whose probabilities reach P.
    #[arg(long, value_name = "P")]
    pub top_p: Option<f32>,
    /// Sample only from the K most likely tokens.
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// Seed of the sampling (the same seed writes the same text).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Where the model computes: the CPU (all its cores) or `cuda[:N]` (a `cuda` build), in f32.
    #[command(flatten)]
    pub device: super::device_args::DeviceArgs,
}

pub fn run(a: GenerateArgs) -> anyhow::Result<i32> {
    check_sampling(&a)?;
    let open = a.device.open(zerodp::config::Precision::Fp32)?;
    let on = open.on();
    let (model, weights, tokenizer) = load(&a, on.clone())?;
    let w = UnitTensors::new(model.spec(), &weights, (&on.0, on.1))?;
    let prompts = prompts(&a, tokenizer.as_ref())?;
    let options = GenerateOptions {
        max_new_tokens: a.max_new_tokens,
        sampling: Sampling {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            seed: a.seed,
        },
        stop: tokenizer.as_ref().map(stop_tokens).unwrap_or_default(),
    };
    for (i, prompt) in prompts.iter().enumerate() {
        if i > 0 {
            outln!("");
        }
        let mut text = Streamed::new(tokenizer.as_ref());
        let g = model.generate(&w, prompt, &options, |t| text.push(t))?;
        let closed = g.ended == Ended::Caller;
        text.finish()?;
        report(prompt.len(), &g);
        if closed {
            break;
        }
    }
    Ok(0)
}

/// The token ids of `--prompt` (with the tokenizer's special tokens; its bytes without a
/// tokenizer), or of each conversation of `--chat` rendered by the chat template beside the
/// tokenizer with a generation prompt (the template writes the special tokens itself).
fn prompts(a: &GenerateArgs, tokenizer: Option<&TextTokenizer>) -> anyhow::Result<Vec<Vec<u32>>> {
    let Some(path) = &a.chat else {
        let text = a.prompt.as_deref().unwrap_or_default();
        return Ok(vec![match tokenizer {
            Some(t) => t.encode(text).map_err(anyhow::Error::msg)?,
            None => text.bytes().map(u32::from).collect(),
        }]);
    };
    let Some(tokenizer) = tokenizer else {
        bail!(
            "--chat needs a tokenizer with a chat template (a model directory's, or --tokenizer)"
        );
    };
    let dir = tokenizer
        .path()
        .parent()
        .unwrap_or(std::path::Path::new("."));
    let template = chat::ChatTemplate::from_tokenizer_dir(dir)?;
    let text =
        std::fs::read_to_string(path).with_context(|| format!("--chat {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let at = || format!("--chat {}: line {}", path.display(), i + 1);
        let value: serde_json::Value = serde_json::from_str(line).with_context(at)?;
        let list = value["messages"]
            .as_array()
            .with_context(|| format!("{}: no `messages` list", at()))?;
        let messages = (list.iter().enumerate())
            .map(|(k, m)| chat::Message::from_json(m, k))
            .collect::<Result<Vec<_>, _>>()
            .with_context(at)?;
        let rendered = template.render(&messages, true).with_context(at)?;
        let (ids, _) = tokenizer
            .encode_with_offsets(&rendered.text, false)
            .map_err(anyhow::Error::msg)?;
        out.push(ids);
    }
    if out.is_empty() {
        bail!("--chat {}: no conversation in it", path.display());
    }
    Ok(out)
}

/// One generation's statistics, on standard error.
fn report(prompt: usize, g: &zerodp::model::generate::Generation) {
    let ended = match g.ended {
        Ended::Stop(_) => "a stop token",
        Ended::Length => "--max-new-tokens",
        Ended::Context => "the model's last position",
        Ended::Caller => "standard output closed",
    };
    errln!(
        "{prompt} prompt tokens in {:.2} s, {} new tokens at {:.1} tokens/s; ended by {ended}",
        g.prompt_s,
        g.tokens.len(),
        g.tokens.len().saturating_sub(1) as f64 / g.decode_s.max(1e-9)
    );
}

fn check_sampling(a: &GenerateArgs) -> anyhow::Result<()> {
    if !(a.temperature >= 0.0 && a.temperature.is_finite()) {
        bail!("--temperature {}: give 0 (greedy) or more", a.temperature);
    }
    if a.top_p.is_some_and(|p| !(p > 0.0 && p <= 1.0)) {
        bail!("--top-p must lie in (0, 1]");
    }
    if a.top_k == Some(0) {
        bail!("--top-k must be at least 1");
    }
    Ok(())
}

/// The model, its weights and its tokenizer, from the flags.
fn load(
    a: &GenerateArgs,
    on: (candle_core::Device, candle_core::DType),
) -> anyhow::Result<(TrainModel, Vec<Vec<f32>>, Option<TextTokenizer>)> {
    if let Some(dir) = &a.checkpoint {
        let (manifest, weights) = zerodp::checkpoint::read_params(dir)
            .with_context(|| format!("--checkpoint {}", dir.display()))?;
        let entry = manifest.config.get(CHECKPOINT_KEY);
        let recorded = |key: &str| entry.and_then(|e| e[key].as_str()).map(PathBuf::from);
        let hf = match entry.map(|e| &e["config"]).filter(|c| c.is_object()) {
            Some(json) => Some(HfModel {
                config: HfConfig::from_json(json.clone(), &dir.join("manifest.json"))?,
                dir: None,
            }),
            None => None,
        };
        let beside = recorded("model_dir").map(|d| d.join("tokenizer.json"));
        let tokenizer = tokenizer(a.tokenizer.clone().or(recorded("tokenizer")).or(beside))?;
        let gpt = gpt_of(a, hf.as_ref(), tokenizer.as_ref())?;
        let model = build_model(&gpt, hf.as_ref(), on)?;
        return Ok((model, weights, tokenizer));
    }
    let hf = a.hf.read()?;
    let from_dir = a.hf.model_dir.as_ref().map(|d| d.join("tokenizer.json"));
    let tokenizer = tokenizer(a.tokenizer.clone().or(from_dir))?;
    let gpt = gpt_of(a, hf.as_ref(), tokenizer.as_ref())?;
    let model = build_model(&gpt, hf.as_ref(), on)?;
    let spec = model.spec().clone();
    let weights = match (&a.init, hf.as_ref().filter(|m| m.dir.is_some())) {
        (Some(p), _) => load_safetensors(p, &spec)?,
        (None, Some(m)) => m
            .initial_weights(&spec)?
            .context("the model directory's weights")?,
        (None, None) => bail!(
            "no weights: give --model-dir DIR, --checkpoint DIR, or --init FILE.safetensors with \
             --model or --model-config"
        ),
    };
    Ok((model, weights, tokenizer))
}

/// The GPT's shape: the Hugging Face config's, else the preset's with the tokenizer's vocabulary.
fn gpt_of(
    a: &GenerateArgs,
    hf: Option<&HfModel>,
    tokenizer: Option<&TextTokenizer>,
) -> anyhow::Result<GptConfig> {
    if let Some(m) = hf {
        return Ok(m.config.gpt.clone());
    }
    let mut gpt = a.model.build("demo")?;
    if let Some(t) = tokenizer {
        gpt.vocab_size = t.id_bound();
    }
    Ok(gpt)
}

fn tokenizer(path: Option<PathBuf>) -> anyhow::Result<Option<TextTokenizer>> {
    let Some(path) = path.filter(|p| p.is_file()) else {
        return Ok(None);
    };
    Ok(Some(TextTokenizer::from_file(&path, None)?))
}

/// The EOS and every end-of-turn token the tokenizer has.
fn stop_tokens(t: &TextTokenizer) -> Vec<u32> {
    let mut stop = vec![t.eos_id()];
    stop.extend(END_OF_TURN.iter().filter_map(|name| t.token_id(name)));
    stop.sort_unstable();
    stop.dedup();
    stop
}

/// The text so far, written to standard output as each token completes it: the whole
/// continuation is decoded again and only what is new and whole is written (a token may end
/// inside a UTF-8 character, or change how the previous ones read).
struct Streamed<'t> {
    tokenizer: Option<&'t TextTokenizer>,
    tokens: Vec<u32>,
    written: usize,
    error: Option<anyhow::Error>,
}

impl<'t> Streamed<'t> {
    fn new(tokenizer: Option<&'t TextTokenizer>) -> Self {
        Streamed {
            tokenizer,
            tokens: Vec::new(),
            written: 0,
            error: None,
        }
    }

    fn text(&self) -> anyhow::Result<String> {
        match self.tokenizer {
            Some(t) => t.decode(&self.tokens).map_err(anyhow::Error::msg),
            None => {
                let bytes: Vec<u8> = self.tokens.iter().map(|&t| t.min(255) as u8).collect();
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
        }
    }

    /// Takes a token; false once standard output cannot take more.
    fn push(&mut self, token: u32) -> bool {
        self.tokens.push(token);
        match self.write(false) {
            Ok(()) => true,
            Err(e) => {
                self.error = Some(e);
                false
            }
        }
    }

    fn write(&mut self, last: bool) -> anyhow::Result<()> {
        let text = self.text()?;
        // A replacement character at the end may be a character still arriving.
        let whole = match last {
            true => text.len(),
            false => text.trim_end_matches('\u{fffd}').len(),
        };
        if whole > self.written && text.is_char_boundary(self.written) {
            let mut out = std::io::stdout().lock();
            out.write_all(&text.as_bytes()[self.written..whole])?;
            out.flush()?;
            self.written = whole;
        }
        Ok(())
    }

    fn finish(mut self) -> anyhow::Result<()> {
        if let Some(e) = self.error.take() {
            return match e.downcast_ref::<std::io::Error>() {
                Some(io) if io.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
                _ => Err(e),
            };
        }
        self.write(true)?;
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(b"\n");
        Ok(())
    }
}
