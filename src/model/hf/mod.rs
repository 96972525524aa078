//! Hugging Face model directories in and out: GPT-2 (`GPT2LMHeadModel`) onto zerodp's GPT, and
//! Llama (`LlamaForCausalLM`) onto [`super::llama`] (whose names are Hugging Face's already): the
//! shared field reading is `fields`, the Llama's config [`LlamaConfig`] (so that neither model
//! module and this one import each other).
//!
//! A directory holds `config.json` and `model.safetensors`, or a sharded
//! `model.safetensors.index.json` whose `weight_map` names the shard of every tensor; weights may
//! be F32, F64, BF16 or F16 (converted to f32). [`HfConfig::read`] maps the config onto a
//! [`GptConfig`] and refuses by name every field whose value changes the math in a way zerodp's
//! GPT does not implement; [`load_weights`] reads the tensors into the engine's per-unit flat
//! buffers; [`export`] writes a directory `transformers.AutoModelForCausalLM` loads.
//!
//! # Names and layouts
//! zerodp's GPT is GPT-2's architecture with GPT-2's names ([`super::gpt`]) minus the
//! `transformer.` prefix. Hugging Face stores the four projections of a block (`attn.c_attn`,
//! `attn.c_proj`, `mlp.c_fc`, `mlp.c_proj`) as `Conv1D` weights `[in, out]`; zerodp stores every
//! linear weight `[out, in]` like `torch.nn.Linear`, so those are transposed on load and back on
//! export. Files without the `transformer.` prefix (the original `gpt2` checkpoints) load too, and
//! the attention-mask buffers older files carry (`h.N.attn.bias`, `h.N.attn.masked_bias`) are
//! skipped. The LM head is tied to `wte.weight` unless the config unties it
//! (`tie_word_embeddings: false`, then `lm_head.weight` is a parameter of the head unit): a tied
//! file's `lm_head.weight` must equal it, and the export leaves it out, as `save_pretrained`
//! does, so that `transformers` ties it on load.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde_json::Value;

use super::gpt::GptConfig;
use crate::atomic_file::AtomicFile;
use crate::zero::unit::ModelSpec;

mod fields;
mod llama_config;

pub(in crate::model) use fields::{field_err, read_json, unsupported, Fields};
pub use llama_config::{Family, LlamaConfig, MlpAct, RopeScaling};

/// The config file of a model directory.
pub const CONFIG_FILE: &str = "config.json";
/// The single-file weights of a model directory.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The index of sharded weights.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Files an export copies from the model directory when they exist: the tokenizer's and the
/// generation defaults, which `transformers` and `tokenizers` read beside the weights.
pub const TOKENIZER_FILES: [&str; 7] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
];
/// The LayerNorm epsilon zerodp's GPT computes with (GPT-2's).
const LN_EPS: f64 = 1e-5;
/// The token embeddings a tied LM head is (GPT-2's, Llama's).
const TIED_TO: [&str; 2] = ["wte.weight", "model.embed_tokens.weight"];
/// The four weights Hugging Face's GPT-2 stores as `Conv1D` (`[in, out]`).
const CONV1D: [&str; 4] = [
    "attn.c_attn.weight",
    "attn.c_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_proj.weight",
];

/// What can go wrong reading or writing a Hugging Face model directory; every variant names the
/// file and, where one is at fault, the field or tensor.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error("cannot read {path}: {source}", path = .path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}", path = .path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}", path = .path.display())]
    Format { path: PathBuf, message: String },
    #[error("{path}: field `{field}`: {message}", path = .path.display())]
    Field {
        path: PathBuf,
        field: String,
        message: String,
    },
    #[error(
        "{path}: `{field}` is {value}, which zerodp does not implement: {why}",
        path = .path.display()
    )]
    Unsupported {
        path: PathBuf,
        field: String,
        value: String,
        why: String,
    },
    #[error("{path}: {problems}", path = .path.display())]
    Mismatch { path: PathBuf, problems: String },
    #[error(
        "{path}: tensor {name} has dtype {dtype}; only F32, F64, BF16 and F16 load",
        path = .path.display()
    )]
    Dtype {
        path: PathBuf,
        name: String,
        dtype: String,
    },
    #[error(
        "{path}: tensor {name} holds {value} at flat index {index}; training from non-finite \
         weights gives a NaN loss",
        path = .path.display()
    )]
    NonFinite {
        path: PathBuf,
        name: String,
        index: usize,
        value: f32,
    },
}

/// A config read from a Hugging Face `config.json`: the GPT-2 it describes (for a Llama, the GPT
/// of the same sizes, which the planner and the pre-flight estimate from), the Llama where it is
/// one, the original JSON (written back on export, so that fields zerodp does not use survive),
/// and notes on fields that are read but do not change what zerodp computes (dropout).
#[derive(Clone, Debug)]
pub struct HfConfig {
    pub gpt: GptConfig,
    pub llama: Option<LlamaConfig>,
    pub json: Value,
    pub notes: Vec<String>,
}

impl HfConfig {
    /// Reads and maps `path` (a `config.json`); see [`HfConfig::from_json`].
    pub fn read(path: &Path) -> Result<HfConfig, HfError> {
        Self::from_json(read_json(path)?, path)
    }

    /// Maps a GPT-2 config onto a [`GptConfig`]. Every field that changes the math is read, with
    /// transformers' `GPT2Config` defaults where absent; a value zerodp does not compute is
    /// refused by name rather than trained differently from what the user asked.
    pub fn from_json(json: Value, path: &Path) -> Result<HfConfig, HfError> {
        let Some(map) = json.as_object() else {
            return Err(HfError::Format {
                path: path.to_path_buf(),
                message: "the config is not a JSON object".into(),
            });
        };
        let f = Fields { path, map };
        if f.text("model_type").and_then(Family::of).is_some() {
            return Self::llama(&json, path);
        }
        check_model_type(&f)?;
        let gpt = sizes(&f)?;
        check_math(&f)?;
        let notes = dropout_notes(&f)?;
        gpt.validate().map_err(|e| HfError::Format {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        Ok(HfConfig {
            gpt,
            llama: None,
            json,
            notes,
        })
    }

    /// A config of the Llama's decoder family ([`LlamaConfig::from_hf_json`]).
    fn llama(json: &Value, path: &Path) -> Result<HfConfig, HfError> {
        let llama = LlamaConfig::from_hf_json(json, path)?;
        let mut notes = Vec::new();
        let dropout = json.get("attention_dropout").and_then(Value::as_f64);
        if dropout.is_some_and(|p| p != 0.0) {
            notes.push(format!(
                "{}: attention_dropout is ignored: zerodp trains without dropout",
                path.display()
            ));
        }
        Ok(HfConfig {
            gpt: llama.gpt_shape(),
            llama: Some(llama),
            json: json.clone(),
            notes,
        })
    }

    /// A config for a GPT zerodp built itself (a preset): GPT-2's fields with its sizes and no
    /// dropout, so that any GPT checkpoint can be exported.
    pub fn for_gpt(gpt: &GptConfig) -> HfConfig {
        let json = serde_json::json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": gpt.vocab_size,
            "n_positions": gpt.context,
            "n_embd": gpt.width,
            "n_layer": gpt.layers,
            "n_head": gpt.heads,
            "n_inner": gpt.mlp_width,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": gpt.eps(),
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "initializer_range": 0.02,
            "scale_attn_weights": true,
            "tie_word_embeddings": !gpt.untied_head,
        });
        HfConfig {
            gpt: gpt.clone(),
            llama: None,
            json,
            notes: Vec::new(),
        }
    }

    /// The dtype the config names for its weights (`dtype`, or the older `torch_dtype`), if any.
    pub fn dtype(&self) -> Option<&str> {
        ["dtype", "torch_dtype"]
            .iter()
            .find_map(|k| self.json.get(*k).and_then(Value::as_str))
    }
}

/// GPT-2 only for now: `model_type` gpt2 and, where listed, the `GPT2LMHeadModel` (or the
/// headless `GPT2Model`, whose head is the tied embedding anyway) architecture.
fn check_model_type(f: &Fields<'_>) -> Result<(), HfError> {
    match f.text("model_type") {
        Some("gpt2") => {}
        Some(other) => {
            return Err(unsupported(
                f.path,
                "model_type",
                &Value::from(other),
                "zerodp reads GPT-2 (`gpt2`), Llama (`llama`), Qwen2 and Qwen2.5 (`qwen2`), Qwen3 \
                 (`qwen3`) and Mistral (`mistral`) model directories",
            ))
        }
        None => {
            return Err(field_err(
                f.path,
                "model_type",
                "is missing (expected \"gpt2\")",
            ))
        }
    }
    if let Some(archs) = f.map.get("architectures").and_then(Value::as_array) {
        let known = ["GPT2LMHeadModel", "GPT2Model"];
        if let Some(bad) = archs
            .iter()
            .find(|a| !known.iter().any(|k| a.as_str() == Some(*k)))
        {
            return Err(unsupported(
                f.path,
                "architectures",
                bad,
                "zerodp trains GPT2LMHeadModel (a language-model head tied to the embedding)",
            ));
        }
    }
    Ok(())
}

/// The sizes, with `GPT2Config`'s defaults; `n_ctx` (older configs) where `n_positions` is absent.
fn sizes(f: &Fields<'_>) -> Result<GptConfig, HfError> {
    let context = match f.map.get("n_positions") {
        Some(_) => f.size("n_positions", None)?,
        None => f.size("n_ctx", Some(1024))?,
    };
    let width = f.size("n_embd", Some(768))?;
    let mlp_width = match f.map.get("n_inner") {
        None | Some(Value::Null) => None,
        Some(_) => Some(f.size("n_inner", None)?).filter(|&m| m != 4 * width),
    };
    let eps = f.number("layer_norm_epsilon", LN_EPS)?;
    if !(eps > 0.0 && eps.is_finite()) {
        return Err(field_err(
            f.path,
            "layer_norm_epsilon",
            "must be a positive number",
        ));
    }
    Ok(GptConfig {
        vocab_size: f.size("vocab_size", Some(50257))?,
        context,
        layers: f.size("n_layer", Some(12))?,
        heads: f.size("n_head", Some(12))?,
        width,
        mlp_width,
        ln_eps: (eps != LN_EPS).then_some(eps),
        untied_head: !f.flag("tie_word_embeddings", true)?,
    })
}

/// Every field that changes the forward or backward: refused unless it is what zerodp computes.
fn check_math(f: &Fields<'_>) -> Result<(), HfError> {
    let act = f.map.get("activation_function").unwrap_or(&Value::Null);
    if !matches!(act.as_str(), Some("gelu_new" | "gelu_pytorch_tanh")) && !act.is_null() {
        return Err(unsupported(
            f.path,
            "activation_function",
            act,
            "zerodp's MLP uses the tanh-approximated GELU (gelu_new, gelu_pytorch_tanh)",
        ));
    }
    f.require_flag(
        "scale_attn_weights",
        true,
        "attention scores are always scaled by 1/sqrt(head_dim)",
    )?;
    f.require_flag(
        "scale_attn_by_inverse_layer_idx",
        false,
        "attention scores are not scaled by 1/(layer index + 1)",
    )?;
    f.require_flag(
        "add_cross_attention",
        false,
        "the blocks have no cross-attention",
    )?;
    // `reorder_and_upcast_attn` computes the attention scores and softmax in f32: zerodp's
    // attention always does, so either value is the same math here.
    f.flag("reorder_and_upcast_attn", false)?;
    if let Some(q) = f.map.get("quantization_config") {
        return Err(unsupported(
            f.path,
            "quantization_config",
            q,
            "weights must be F32/F64/BF16/F16",
        ));
    }
    Ok(())
}

/// zerodp has no dropout: a nonzero rate trains without it (said, not refused: every released
/// GPT-2 sets 0.1, and fine-tuning without dropout is common practice).
fn dropout_notes(f: &Fields<'_>) -> Result<Vec<String>, HfError> {
    let mut notes = Vec::new();
    for field in ["resid_pdrop", "embd_pdrop", "attn_pdrop"] {
        let rate = f.number(field, 0.1)?;
        if rate != 0.0 {
            notes.push(format!(
                "{}: {field} {rate} is ignored: zerodp trains without dropout",
                f.path.display()
            ));
        }
    }
    Ok(notes)
}

/// Whether the zerodp parameter `name` of `shape` is one of the `Conv1D` weights stored
/// `[in, out]` (a matrix: any other model's 1-d tensor of such a name is stored as it is).
fn is_conv1d(name: &str, shape: &[usize]) -> bool {
    shape.len() == 2 && CONV1D.iter().any(|s| name.ends_with(s))
}

/// `[rows, cols]` row-major into `[cols, rows]`.
fn transpose(src: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; src.len()];
    for (r, row) in src.chunks_exact(cols).enumerate() {
        for (c, &x) in row.iter().enumerate() {
            out[c * rows + r] = x;
        }
    }
    out
}

/// The attention-mask buffers older GPT-2 files store beside the weights (`h.N.attn.bias`,
/// `h.N.attn.masked_bias`): constants, not parameters.
fn is_mask_buffer(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("h.") else {
        return false;
    };
    let Some((layer, tail)) = rest.split_once('.') else {
        return false;
    };
    layer.bytes().all(|b| b.is_ascii_digit()) && matches!(tail, "attn.bias" | "attn.masked_bias")
}

/// A tensor's values as f32, from any float dtype a checkpoint uses.
fn to_f32(path: &Path, name: &str, view: &TensorView<'_>) -> Result<Vec<f32>, HfError> {
    super::weights::widen_to_f32(view).ok_or_else(|| HfError::Dtype {
        path: path.to_path_buf(),
        name: name.into(),
        dtype: format!("{:?}", view.dtype()),
    })
}

/// A tensor's dtype is one [`to_f32`] converts.
fn check_dtype(path: &Path, name: &str, view: &TensorView<'_>) -> Result<(), HfError> {
    match view.dtype() {
        Dtype::F32 | Dtype::F64 | Dtype::BF16 | Dtype::F16 => Ok(()),
        other => Err(HfError::Dtype {
            path: path.to_path_buf(),
            name: name.into(),
            dtype: format!("{other:?}"),
        }),
    }
}

/// The weight files of a model directory: `model.safetensors`, or every shard the index's
/// `weight_map` names (each once, in name order).
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, HfError> {
    let single = dir.join(WEIGHTS_FILE);
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join(INDEX_FILE);
    if !index.is_file() {
        return Err(HfError::Read {
            path: single,
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("neither it nor {INDEX_FILE} exists"),
            ),
        });
    }
    let json = read_json(&index)?;
    let Some(map) = json.get("weight_map").and_then(Value::as_object) else {
        return Err(field_err(
            &index,
            "weight_map",
            "is missing or not an object",
        ));
    };
    let mut files = Vec::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .filter(|f| !f.contains('/') && !f.starts_with('.'));
        let Some(file) = file else {
            return Err(field_err(
                &index,
                "weight_map",
                format!("{name}: not a file name"),
            ));
        };
        files.push(dir.join(file));
    }
    files.sort();
    files.dedup();
    Ok(files)
}

/// Where each parameter of `spec` lives: its unit, offset and shape.
type Places<'a> = BTreeMap<&'a str, (usize, usize, &'a [usize])>;

fn places(spec: &ModelSpec) -> Places<'_> {
    let mut wanted = BTreeMap::new();
    for (u, unit) in spec.units.iter().enumerate() {
        for (p, off) in unit.params.iter().zip(unit.offsets()) {
            wanted.insert(p.name.as_str(), (u, off, p.shape.as_slice()));
        }
    }
    wanted
}

/// What reading the files found, before it is checked as a whole.
#[derive(Default)]
struct Found {
    names: Vec<String>,
    unexpected: Vec<String>,
    problems: Vec<String>,
    lm_head: Option<(PathBuf, Vec<usize>, Vec<f32>)>,
}

/// Reads the weights of the model directory `dir` into one flat f32 buffer per unit of `spec`
/// (a [`super::GptModel`]'s): every parameter exactly once, shapes checked (Hugging Face's), the
/// `Conv1D` weights transposed, a stored `lm_head.weight` checked equal to the embedding.
pub fn load_weights(dir: &Path, spec: &ModelSpec) -> Result<Vec<Vec<f32>>, HfError> {
    let wanted = places(spec);
    let mut buffers: Vec<Vec<f32>> = spec.units.iter().map(|u| vec![0.0; u.numel()]).collect();
    let mut found = Found::default();
    for file in weight_files(dir)? {
        read_file_into(&file, &wanted, Some(&mut buffers), &mut found)?;
    }
    check_found(dir, &wanted, Some(&buffers), found)?;
    Ok(buffers)
}

/// Checks the weights of the model directory `dir` against `spec` as [`load_weights`] does,
/// from the files' headers alone (every file a valid safetensors file of the size its header
/// says; every parameter once, of its shape and a float dtype; nothing unexpected), without
/// reading or converting a value: a broken directory is refused before any slow work.
pub fn check_weights(dir: &Path, spec: &ModelSpec) -> Result<(), HfError> {
    let wanted = places(spec);
    let mut found = Found::default();
    for file in weight_files(dir)? {
        read_file_into(&file, &wanted, None, &mut found)?;
    }
    check_found(dir, &wanted, None, found)
}

/// Reads one safetensors file's tensors into `buffers`, noting names and problems in `found`;
/// without buffers, checks the tensors' names, shapes and dtypes only.
fn read_file_into(
    path: &Path,
    wanted: &Places<'_>,
    mut buffers: Option<&mut [Vec<f32>]>,
    found: &mut Found,
) -> Result<(), HfError> {
    let read_err = |source| HfError::Read {
        path: path.to_path_buf(),
        source,
    };
    let opened = std::fs::File::open(path).map_err(read_err)?;
    // Mapped, not read: a shard of a large model is gigabytes, and only one tensor at a time is
    // converted into the f32 buffers, so the file's bytes need not be held twice.
    // SAFETY: the map is read-only and dropped before this function returns; a file changed
    // under it by another process is the same hazard every safetensors reader accepts.
    let bytes = unsafe { memmap2::Mmap::map(&opened) }.map_err(read_err)?;
    let file = SafeTensors::deserialize(&bytes).map_err(|e| HfError::Format {
        path: path.to_path_buf(),
        message: format!("not a valid safetensors file: {e}"),
    })?;
    for (hf_name, view) in file.tensors() {
        let name = hf_name.strip_prefix("transformer.").unwrap_or(&hf_name);
        if is_mask_buffer(name) {
            continue;
        }
        // A model with its own head (an untied Llama) reads it like any parameter.
        if name == "lm_head.weight" && !wanted.contains_key(name) {
            let values = match buffers {
                Some(_) => to_f32(path, &hf_name, &view)?,
                None => check_dtype(path, &hf_name, &view).map(|()| Vec::new())?,
            };
            found.lm_head = Some((path.to_path_buf(), view.shape().to_vec(), values));
            continue;
        }
        let Some(&(u, off, shape)) = wanted.get(name) else {
            found.unexpected.push(hf_name.clone());
            continue;
        };
        let conv = is_conv1d(name, shape);
        let stored: Vec<usize> = if conv {
            shape.iter().rev().copied().collect()
        } else {
            shape.to_vec()
        };
        if view.shape() != stored.as_slice() {
            found.problems.push(format!(
                "{hf_name} in {} has shape {:?}, the config makes it {stored:?}",
                path.display(),
                view.shape()
            ));
            continue;
        }
        let Some(buffers) = buffers.as_deref_mut() else {
            check_dtype(path, &hf_name, &view)?;
            found.names.push(name.to_string());
            continue;
        };
        let mut values = to_f32(path, &hf_name, &view)?;
        if let Some(index) = values.iter().position(|x| !x.is_finite()) {
            return Err(HfError::NonFinite {
                path: path.to_path_buf(),
                name: hf_name,
                index,
                value: values[index],
            });
        }
        if conv {
            values = transpose(&values, stored[0], stored[1]);
        }
        buffers[u][off..off + values.len()].copy_from_slice(&values);
        found.names.push(name.to_string());
    }
    Ok(())
}

/// Every parameter found exactly once, nothing unexpected, and a stored head equal to `wte` (its
/// shape alone without `buffers`).
fn check_found(
    dir: &Path,
    wanted: &Places<'_>,
    buffers: Option<&[Vec<f32>]>,
    found: Found,
) -> Result<(), HfError> {
    let mut problems = found.problems;
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for n in &found.names {
        *seen.entry(n.as_str()).or_default() += 1;
    }
    let missing: Vec<&str> = wanted
        .keys()
        .copied()
        .filter(|n| !seen.contains_key(n))
        .collect();
    if !missing.is_empty() {
        problems.push(format!("missing tensors: {}", missing.join(", ")));
    }
    let twice: Vec<&str> = seen
        .iter()
        .filter(|(_, &k)| k > 1)
        .map(|(n, _)| *n)
        .collect();
    if !twice.is_empty() {
        problems.push(format!(
            "tensors stored more than once: {}",
            twice.join(", ")
        ));
    }
    if !found.unexpected.is_empty() {
        problems.push(format!(
            "tensors a GPT-2 of this config does not have: {}",
            found.unexpected.join(", ")
        ));
    }
    if !problems.is_empty() {
        return Err(HfError::Mismatch {
            path: dir.to_path_buf(),
            problems: problems.join("; "),
        });
    }
    if let Some((path, shape, values)) = found.lm_head {
        // Equal shapes make the lengths equal; a model without `wte.weight` has no tied head.
        let embedding = TIED_TO.iter().find_map(|n| wanted.get(n));
        let tied = embedding.is_some_and(|&(u, off, wte)| {
            shape == wte && buffers.is_none_or(|b| values == b[u][off..off + values.len()])
        });
        if !tied {
            return Err(HfError::Mismatch {
                path,
                problems: "lm_head.weight differs from the token embedding, to which this model \
                           ties the LM head (tie_word_embeddings true)"
                    .into(),
            });
        }
    }
    Ok(())
}

/// The dtype of exported weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportDtype {
    F32,
    Bf16,
    F16,
}

impl ExportDtype {
    /// `f32`/`float32`, `bf16`/`bfloat16` or `f16`/`float16` (also as a config's `torch_dtype`).
    pub fn parse(text: &str) -> Option<ExportDtype> {
        match text {
            "f32" | "fp32" | "float32" => Some(ExportDtype::F32),
            "bf16" | "bfloat16" => Some(ExportDtype::Bf16),
            "f16" | "fp16" | "float16" => Some(ExportDtype::F16),
            _ => None,
        }
    }

    /// The name `transformers` writes in `torch_dtype`.
    pub fn torch_name(self) -> &'static str {
        match self {
            ExportDtype::F32 => "float32",
            ExportDtype::Bf16 => "bfloat16",
            ExportDtype::F16 => "float16",
        }
    }

    fn safetensors(self) -> Dtype {
        match self {
            ExportDtype::F32 => Dtype::F32,
            ExportDtype::Bf16 => Dtype::BF16,
            ExportDtype::F16 => Dtype::F16,
        }
    }

    /// Little-endian bytes of `values` in this dtype (round to nearest even for 16-bit).
    fn bytes(self, values: &[f32]) -> Vec<u8> {
        match self {
            ExportDtype::F32 => values.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ExportDtype::Bf16 => values
                .iter()
                .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
                .collect(),
            ExportDtype::F16 => values
                .iter()
                .flat_map(|&x| f16::from_f32(x).to_le_bytes())
                .collect(),
        }
    }
}

/// What [`export`] wrote.
#[derive(Clone, Debug)]
pub struct Exported {
    pub dtype: ExportDtype,
    /// Bytes of `model.safetensors`.
    pub weight_bytes: u64,
    /// The tokenizer (and generation) files copied from the model directory.
    pub copied: Vec<String>,
}

/// Writes a Hugging Face GPT-2 directory into the existing directory `out`: `config.json` (the
/// original config with the dtype set), `model.safetensors` (Hugging Face names and `Conv1D`
/// layout, no `lm_head.weight`: it is tied) and the tokenizer files found in `copy_from`. Each
/// file is written whole or not at all ([`AtomicFile`]); that `out` is a safe place to write is
/// the caller's check ([`crate::outputs`]).
pub fn export(
    out: &Path,
    config: &HfConfig,
    spec: &ModelSpec,
    params: &[Vec<f32>],
    dtype: ExportDtype,
    copy_from: Option<&Path>,
) -> Result<Exported, HfError> {
    let weights = weight_bytes(out, spec, params, dtype, config.llama.is_none())?;
    write_file(&out.join(WEIGHTS_FILE), &weights)?;
    let json = export_config(config, dtype);
    let text = serde_json::to_string_pretty(&json).map_err(|e| HfError::Format {
        path: out.join(CONFIG_FILE),
        message: e.to_string(),
    })?;
    write_file(&out.join(CONFIG_FILE), format!("{text}\n").as_bytes())?;
    let mut copied = Vec::new();
    if let Some(dir) = copy_from {
        for name in TOKENIZER_FILES {
            let src = dir.join(name);
            if src.is_file() {
                let bytes =
                    std::fs::read(&src).map_err(|source| HfError::Read { path: src, source })?;
                write_file(&out.join(name), &bytes)?;
                copied.push(name.to_string());
            }
        }
    }
    Ok(Exported {
        dtype,
        weight_bytes: weights.len() as u64,
        copied,
    })
}

/// The config as exported: the original, with the architecture, the sizes and the dtype zerodp
/// wrote (`dtype` where the original used transformers 5's key, `torch_dtype` otherwise or also).
pub(crate) fn export_config(config: &HfConfig, dtype: ExportDtype) -> Value {
    let mut json = config.json.clone();
    let Some(map) = json.as_object_mut() else {
        return json;
    };
    if config.llama.is_none() {
        let g = &config.gpt;
        map.insert(
            "architectures".into(),
            serde_json::json!(["GPT2LMHeadModel"]),
        );
        map.insert("model_type".into(), "gpt2".into());
        for (k, v) in [
            ("vocab_size", g.vocab_size),
            ("n_positions", g.context),
            ("n_embd", g.width),
            ("n_layer", g.layers),
            ("n_head", g.heads),
        ] {
            map.insert(k.into(), v.into());
        }
    }
    let keys = match (map.contains_key("dtype"), map.contains_key("torch_dtype")) {
        (true, false) => &["dtype"][..],
        (true, true) => &["dtype", "torch_dtype"][..],
        _ => &["torch_dtype"][..],
    };
    for k in keys {
        map.insert((*k).into(), dtype.torch_name().into());
    }
    json
}

/// `model.safetensors`'s bytes: every parameter under its Hugging Face name, `Conv1D` weights
/// `[in, out]`, with the `format: pt` metadata `transformers` requires of a safetensors file.
fn weight_bytes(
    out: &Path,
    spec: &ModelSpec,
    params: &[Vec<f32>],
    dtype: ExportDtype,
    gpt2: bool,
) -> Result<Vec<u8>, HfError> {
    let path = out.join(WEIGHTS_FILE);
    let bad = |message: String| HfError::Format {
        path: path.clone(),
        message,
    };
    if params.len() != spec.units.len() {
        return Err(bad(format!(
            "{} unit buffers for {} units",
            params.len(),
            spec.units.len()
        )));
    }
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (unit, buf) in spec.units.iter().zip(params) {
        if buf.len() < unit.numel() {
            return Err(bad(format!(
                "unit {} has {} of {} values",
                unit.name,
                buf.len(),
                unit.numel()
            )));
        }
        for (p, off) in unit.params.iter().zip(unit.offsets()) {
            let values = &buf[off..off + p.numel()];
            let (shape, data) = if gpt2 && is_conv1d(&p.name, &p.shape) {
                let (rows, cols) = (p.shape[0], p.shape[1]);
                (
                    vec![cols, rows],
                    dtype.bytes(&transpose(values, rows, cols)),
                )
            } else {
                (p.shape.clone(), dtype.bytes(values))
            };
            // GPT-2's names carry the `transformer.` prefix (its own LM head excepted); Llama's
            // are zerodp's already.
            let name = if gpt2 && p.name != "lm_head.weight" {
                format!("transformer.{}", p.name)
            } else {
                p.name.clone()
            };
            tensors.push((name, shape, data));
        }
    }
    let views = tensors
        .iter()
        .map(|(name, shape, data)| {
            TensorView::new(dtype.safetensors(), shape.clone(), data)
                .map(|v| (name.clone(), v))
                .map_err(|e| bad(e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize(views, Some(metadata)).map_err(|e| bad(e.to_string()))
}

/// Writes `bytes` to `path` whole or not at all.
fn write_file(path: &Path, bytes: &[u8]) -> Result<(), HfError> {
    let err = |source| HfError::Write {
        path: path.to_path_buf(),
        source,
    };
    let mut file = AtomicFile::create(path).map_err(err)?;
    file.write_all(bytes).map_err(err)?;
    file.commit().map_err(err)
}
