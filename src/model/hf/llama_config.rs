//! The `config.json` of a Llama and of the families built on its decoder (Qwen2 and Qwen2.5,
//! Qwen3, Mistral): every field that changes the math read (each family's transformers defaults
//! where absent), the rotary scalings computed as transformers computes them, and a value zerodp
//! does not compute refused by name. The model itself is [`crate::model::llama`].

use std::path::Path;

use serde_json::Value;

use super::fields::{field_err, unsupported, Fields};
use super::HfError;
use crate::model::gpt::GptConfig;

/// The families that share the Llama's decoder, by `model_type`: what differs is in
/// [`LlamaConfig`]'s fields (biases, the query and key norms, defaults), not in code paths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Llama,
    /// Qwen2 and Qwen2.5: biases on the q, k and v projections.
    Qwen2,
    /// Qwen3: RMSNorm of each head's queries and keys before the rotary embedding.
    Qwen3,
    Mistral,
    /// Gemma: GeGLU with the tanh GELU, RMSNorm scaled by 1 + weight, the embeddings scaled by
    /// the square root of the width, a tied head.
    Gemma,
}

impl Family {
    pub const ALL: [Family; 5] = [
        Family::Llama,
        Family::Qwen2,
        Family::Qwen3,
        Family::Mistral,
        Family::Gemma,
    ];

    /// The `model_type` of the family's configs.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Mistral => "mistral",
            Family::Gemma => "gemma",
        }
    }

    /// The family of a `model_type`, if it is one of these.
    pub fn of(model_type: &str) -> Option<Family> {
        Family::ALL
            .into_iter()
            .find(|f| f.model_type() == model_type)
    }
}

/// A Llama-family decoder's sizes and the constants of its math.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub family: Family,
    pub vocab_size: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// `max_position_embeddings`: the longest sequence trained on.
    pub context: usize,
    pub rms_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub tied: bool,
    /// Biases on the q, k and v projections (Qwen2's, and Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// A bias on the output projection (Llama's `attention_bias`).
    pub o_bias: bool,
    /// Biases on the MLP's three projections (`mlp_bias`).
    pub mlp_bias: bool,
    /// RMSNorm of each head's queries and keys (weights `[head_dim]`) before the rotation (Qwen3).
    pub qk_norm: bool,
    /// The MLP's activation on the gate: SiLU (SwiGLU), or the tanh GELU (Gemma's GeGLU).
    pub mlp_act: MlpAct,
    /// Every RMSNorm scales by `1 + weight` (Gemma: the weight is stored, decayed and starts at 0).
    pub norm_offset: bool,
    /// The embeddings are multiplied by `sqrt(hidden_size)` (Gemma), as f32, before the first layer.
    pub embed_scale: bool,
    /// `pad_token_id`: the embedding row that lookups do not train (`torch.nn.Embedding`'s
    /// `padding_idx`, which every family sets from it).
    pub padding_idx: Option<u32>,
    /// The attention window of the layers that have one (Mistral's `sliding_window`, Qwen's
    /// with `use_sliding_window`): a query sees the keys less than this many positions back.
    pub sliding_window: Option<usize>,
    /// Which layers have the window (every layer for Mistral; Qwen's by `layer_types`, else
    /// from `max_window_layers` on). Empty without a window.
    pub window_layers: Vec<bool>,
    /// Standard deviation of the seeded initialisation (`initializer_range`).
    pub init_std: f64,
}

impl LlamaConfig {
    /// Model FLOPs of one training token at sequence length `t`, by the convention of
    /// [`GptConfig::flops_per_token`]: 6 per weight of every product (per layer the q, k, v and o
    /// projections and the three of SwiGLU; the head's `V x hidden`) plus attention's
    /// `12 · layers · t · heads · head_dim`.
    pub fn flops_per_token(&self, t: usize) -> f64 {
        let (v, h, i) = (
            self.vocab_size as f64,
            self.hidden as f64,
            self.intermediate as f64,
        );
        let q = (self.heads * self.head_dim) as f64;
        let kv = (self.kv_heads * self.head_dim) as f64;
        let l = self.layers as f64;
        let products = l * (2.0 * h * q + 2.0 * h * kv + 3.0 * h * i) + v * h;
        6.0 * products + 12.0 * l * t as f64 * q
    }

    /// Maps a `LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM` or
    /// `MistralForCausalLM` config, with the family's transformers defaults where a field is
    /// absent; a value zerodp does not compute (a rope scaling it does not build, another
    /// activation) is refused by name.
    pub fn from_hf_json(json: &Value, path: &Path) -> Result<LlamaConfig, HfError> {
        let Some(map) = json.as_object() else {
            return Err(field_err(path, "(root)", "the config is not a JSON object"));
        };
        let f = Fields { path, map };
        let Some(family) = f.text("model_type").and_then(Family::of) else {
            let v = map.get("model_type").cloned().unwrap_or(Value::Null);
            let why = "expected \"llama\", \"qwen2\", \"qwen3\" or \"mistral\"";
            return Err(unsupported(path, "model_type", &v, why));
        };
        let c = sizes(&f, family)?;
        check_math(&f)?;
        if c.heads % c.kv_heads != 0 {
            let v = &map["num_key_value_heads"];
            let why = "num_attention_heads must be a multiple of it";
            return Err(unsupported(path, "num_key_value_heads", v, why));
        }
        if c.head_dim % 2 != 0 {
            let why = "the rotary embedding needs an even head dimension";
            return Err(unsupported(path, "head_dim", &c.head_dim.into(), why));
        }
        Ok(c)
    }

    /// The sizes the planner and the pre-flight model this decoder by, its sequences `context`
    /// tokens long.
    pub fn shape(&self, context: usize) -> crate::planner::GptShape {
        crate::planner::GptShape {
            layers: self.layers as u64,
            width: self.hidden as u64,
            heads: self.heads as u64,
            vocab: self.vocab_size as u64,
            context: context as u64,
            llama: Some(crate::planner::LlamaDims {
                kv_heads: self.kv_heads as u64,
                head_dim: self.head_dim as u64,
                intermediate: self.intermediate as u64,
                qkv_bias: self.qkv_bias,
                o_bias: self.o_bias,
                mlp_bias: self.mlp_bias,
                qk_norm: self.qk_norm,
                embed_scale: self.embed_scale,
                pad_rows: self.padding_idx.is_some(),
                tied: self.tied,
            }),
        }
    }

    /// The GPT of the same vocabulary, context, depth, width and heads: the sizes the training
    /// command reads beside the model (its context, the banner's widths); the planner reads
    /// [`Self::shape`].
    pub fn gpt_shape(&self) -> GptConfig {
        let width = self.heads * self.head_dim;
        GptConfig::sized(
            self.vocab_size,
            self.context,
            self.layers,
            self.heads,
            width,
        )
    }

    /// Ψ: the number of parameters (a tied head counted once).
    pub fn num_params(&self) -> usize {
        // The planner's count of the same layout, so that the two never differ.
        self.shape(self.context).num_params() as usize
    }
}

impl LlamaConfig {
    /// Sequences of `t` tokens fit the model: no longer than its context.
    pub fn check_seq_len(&self, t: usize) -> Result<(), String> {
        match t > self.context {
            true => Err(format!(
                "sequence length {t} exceeds max_position_embeddings {}",
                self.context
            )),
            false => Ok(()),
        }
    }

    /// The attention window of decoder layer `layer` (0-based), if it has one.
    pub fn window_of(&self, layer: usize) -> Option<usize> {
        self.sliding_window
            .filter(|_| self.window_layers.get(layer).copied().unwrap_or(false))
    }
}

/// The activation of the MLP's gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpAct {
    Silu,
    /// `gelu_pytorch_tanh`: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
    GeluTanh,
}

/// transformers' defaults of a family's config class, for the fields they differ in.
struct Defaults {
    tied: bool,
    vocab: usize,
    intermediate: usize,
    kv_heads: Option<usize>,
    head_dim: Option<usize>,
    context: usize,
}

impl Family {
    fn defaults(self) -> Defaults {
        let qwen = |head_dim| Defaults {
            tied: false,
            vocab: 151936,
            intermediate: 22016,
            kv_heads: Some(32),
            head_dim,
            context: 32768,
        };
        match self {
            Family::Llama => Defaults {
                tied: false,
                vocab: 32000,
                intermediate: 11008,
                kv_heads: None,
                head_dim: None,
                context: 2048,
            },
            Family::Qwen2 => qwen(None),
            Family::Qwen3 => qwen(Some(128)),
            Family::Mistral => Defaults {
                tied: false,
                vocab: 32000,
                intermediate: 14336,
                kv_heads: Some(8),
                head_dim: None,
                context: 4096 * 32,
            },
            Family::Gemma => Defaults {
                tied: true,
                vocab: 256000,
                intermediate: 24576,
                kv_heads: Some(16),
                head_dim: Some(256),
                context: 8192,
            },
        }
    }
}

/// The sizes, with the family's defaults.
fn sizes(f: &Fields<'_>, family: Family) -> Result<LlamaConfig, HfError> {
    let d = family.defaults();
    let gemma = family == Family::Gemma;
    let hidden = f.size("hidden_size", Some(if gemma { 3072 } else { 4096 }))?;
    let heads = f.size("num_attention_heads", Some(if gemma { 16 } else { 32 }))?;
    let head_dim = d.head_dim.unwrap_or(hidden / heads.max(1));
    let context = f.size("max_position_embeddings", Some(d.context))?;
    let layers = f.size("num_hidden_layers", Some(if gemma { 28 } else { 32 }))?;
    let windows = sliding_window(f, family, layers)?;
    // Llama's `attention_bias` puts biases on all four projections; Qwen2 always has them on
    // q, k and v and never on o; Qwen3 reads `attention_bias` as Llama does; Mistral has none.
    let attention_bias = match family {
        Family::Llama | Family::Qwen3 | Family::Gemma => f.flag("attention_bias", false)?,
        Family::Qwen2 | Family::Mistral => false,
    };
    Ok(LlamaConfig {
        family,
        vocab_size: f.size("vocab_size", Some(d.vocab))?,
        hidden,
        intermediate: f.size("intermediate_size", Some(d.intermediate))?,
        layers,
        heads,
        kv_heads: f.size("num_key_value_heads", Some(d.kv_heads.unwrap_or(heads)))?,
        head_dim: f.size("head_dim", Some(head_dim))?,
        context,
        rms_eps: f.number("rms_norm_eps", 1e-6)?,
        rope_theta: rope_theta(f)?,
        rope_scaling: rope_scaling(f, context)?,
        tied: f.flag("tie_word_embeddings", d.tied)?,
        qkv_bias: attention_bias || family == Family::Qwen2,
        o_bias: attention_bias,
        mlp_bias: family == Family::Llama && f.flag("mlp_bias", false)?,
        qk_norm: family == Family::Qwen3,
        mlp_act: mlp_act(f, family)?,
        norm_offset: gemma,
        embed_scale: gemma,
        padding_idx: padding_idx(f, family)?,
        sliding_window: windows.0,
        window_layers: windows.1,
        init_std: f.number("initializer_range", 0.02)?,
    })
}

/// The window and the layers that have it: Mistral's `sliding_window` on every layer; Qwen's
/// only with `use_sliding_window`, on the layers `layer_types` names `sliding_attention` (where
/// the config lists them, transformers 4.53 on), else on those from `max_window_layers` on.
fn sliding_window(
    f: &Fields<'_>,
    family: Family,
    layers: usize,
) -> Result<(Option<usize>, Vec<bool>), HfError> {
    let window = match f.map.get("sliding_window") {
        None | Some(Value::Null) => None,
        Some(_) => Some(f.size("sliding_window", None)?),
    };
    let on = match family {
        Family::Llama | Family::Gemma => return Ok((None, Vec::new())),
        Family::Mistral => vec![true; layers],
        Family::Qwen2 | Family::Qwen3 => {
            if !f.flag("use_sliding_window", false)? {
                return Ok((None, Vec::new()));
            }
            match f.map.get("layer_types").and_then(Value::as_array) {
                Some(types) if types.len() == layers => (types.iter())
                    .map(|t| t.as_str() == Some("sliding_attention"))
                    .collect(),
                Some(types) => {
                    let why = format!("lists {} layer types for {layers} layers", types.len());
                    return Err(field_err(f.path, "layer_types", why));
                }
                None => {
                    let first = f.size("max_window_layers", Some(28))?;
                    (0..layers).map(|l| l >= first).collect()
                }
            }
        }
    };
    match window.filter(|_| on.contains(&true)) {
        Some(w) => Ok((Some(w), on)),
        None => Ok((None, Vec::new())),
    }
}

/// How the rotary frequencies are rescaled for a longer context (`rope_type`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// `default`: `theta^(-2k/d)`.
    None,
    /// `linear`: every frequency divided by `factor`.
    Linear { factor: f64 },
    /// `llama3`: low frequencies divided by `factor`, high ones kept, a smooth ramp between
    /// (wavelengths against `original_max_position_embeddings` / the two frequency factors).
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_context: f64,
    },
    /// `yarn`: frequencies blended between interpolated (divided by `factor`) and kept along a
    /// ramp over the dimensions whose rotations at `original_context` lie between `beta_slow`
    /// and `beta_fast` (floored and ceiled with `truncate`), and cos and sin scaled by
    /// `attention_factor`.
    Yarn {
        factor: f64,
        original_context: f64,
        beta_fast: f64,
        beta_slow: f64,
        truncate: bool,
        attention_factor: f64,
    },
}

/// The rope block: `rope_parameters` (transformers 5) or `rope_scaling` (transformers 4).
fn rope_block<'a>(f: &Fields<'a>) -> Option<(&'static str, &'a Value)> {
    ["rope_parameters", "rope_scaling"]
        .into_iter()
        .find_map(|k| f.map.get(k).filter(|v| !v.is_null()).map(|v| (k, v)))
}

/// `rope_theta`, in `rope_parameters` (transformers 5) or top-level (transformers 4).
fn rope_theta(f: &Fields<'_>) -> Result<f64, HfError> {
    if let Some((field, theta)) = rope_block(f).and_then(|(k, b)| Some((k, b.get("rope_theta")?))) {
        return theta
            .as_f64()
            .ok_or_else(|| field_err(f.path, &format!("{field}.rope_theta"), "not a number"));
    }
    f.number("rope_theta", 10000.0)
}

/// The scaling the rope block names; one zerodp does not compute (`dynamic`, `yarn`,
/// `longrope`...) is refused by name.
fn rope_scaling(f: &Fields<'_>, context: usize) -> Result<RopeScaling, HfError> {
    let Some((field, block)) = rope_block(f) else {
        return Ok(RopeScaling::None);
    };
    let kind = block.get("rope_type").or_else(|| block.get("type"));
    let number = |key: &str| {
        block
            .get(key)
            .and_then(Value::as_f64)
            .filter(|x| *x > 0.0)
            .ok_or_else(|| {
                field_err(
                    f.path,
                    &format!("{field}.{key}"),
                    "missing or not a positive number",
                )
            })
    };
    match kind.and_then(Value::as_str).unwrap_or("default") {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear {
            factor: number("factor")?,
        }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: number("factor")?,
            low_freq_factor: number("low_freq_factor")?,
            high_freq_factor: number("high_freq_factor")?,
            original_context: number("original_max_position_embeddings")?,
        }),
        "yarn" => yarn(f, (field, block), context as f64),
        _ => {
            let why = "the rotary scalings implemented are default, linear, llama3 and yarn";
            Err(unsupported(f.path, field, block, why))
        }
    }
}

/// A `yarn` block read as transformers 5 reads it: `original_max_position_embeddings` from the
/// config's top level, else the block, else `max_position_embeddings`; `factor`, else their
/// ratio; the attention factor given, else `0.1 ln(factor) + 1` (over the same of `mscale_all_dim`
/// when `mscale` and `mscale_all_dim` are both set).
fn yarn(
    f: &Fields<'_>,
    (field, block): (&str, &Value),
    context: f64,
) -> Result<RopeScaling, HfError> {
    let positive = |key: &str| -> Result<Option<f64>, HfError> {
        match block.get(key).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => match v.as_f64().filter(|x| *x > 0.0) {
                Some(x) => Ok(Some(x)),
                None => Err(field_err(
                    f.path,
                    &format!("{field}.{key}"),
                    "not a positive number",
                )),
            },
        }
    };
    let original = match f.map.get("original_max_position_embeddings") {
        Some(v) if !v.is_null() => Some(f.size("original_max_position_embeddings", None)? as f64),
        _ => positive("original_max_position_embeddings")?,
    };
    let original = original.unwrap_or(context);
    let factor = positive("factor")?.unwrap_or(context / original);
    let mscale = |scale: f64, m: f64| match scale <= 1.0 {
        true => 1.0,
        false => 0.1 * m * scale.ln() + 1.0,
    };
    let attention_factor = match (positive("attention_factor")?, positive("mscale")?) {
        (Some(a), _) => a,
        (None, Some(m)) => match positive("mscale_all_dim")? {
            Some(all) => mscale(factor, m) / mscale(factor, all),
            None => mscale(factor, 1.0),
        },
        (None, None) => mscale(factor, 1.0),
    };
    let truncate = match block.get("truncate") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            let path = format!("{field}.truncate");
            return Err(field_err(f.path, &path, "not true or false"));
        }
    };
    Ok(RopeScaling::Yarn {
        factor,
        original_context: original,
        beta_fast: positive("beta_fast")?.unwrap_or(32.0),
        beta_slow: positive("beta_slow")?.unwrap_or(1.0),
        truncate,
        attention_factor,
    })
}

impl RopeScaling {
    /// What cos and sin are multiplied by (yarn's attention factor; 1 for the others).
    pub fn attention_factor(self) -> f64 {
        match self {
            RopeScaling::Yarn {
                attention_factor, ..
            } => attention_factor,
            _ => 1.0,
        }
    }

    /// Yarn's inverse frequencies (transformers' `_compute_yarn_parameters`).
    fn yarn_inv_freq(
        (theta, d): (f64, usize),
        (factor, original_context): (f64, f64),
        (beta_fast, beta_slow): (f64, f64),
        truncate: bool,
    ) -> Vec<f64> {
        let dim = d as f64;
        let correction = |rotations: f64| {
            dim * (original_context / (rotations * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * theta.ln())
        };
        let (mut low, mut high) = (correction(beta_fast), correction(beta_slow));
        if truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
        if low == high {
            high += 0.001;
        }
        (0..d / 2)
            .map(|k| {
                let extrapolated = 1.0 / theta.powf((2 * k) as f64 / dim);
                let ramp = ((k as f64 - low) / (high - low)).clamp(0.0, 1.0);
                // transformers' extrapolation factor is 1 - ramp.
                extrapolated / factor * ramp + extrapolated * (1.0 - ramp)
            })
            .collect()
    }

    /// The inverse frequencies `theta^(-2k/d)`, rescaled as transformers'
    /// `ROPE_INIT_FUNCTIONS` rescale them (in f64; the tables are rounded to f32 once).
    pub(in crate::model) fn inv_freq(self, theta: f64, d: usize) -> Vec<f64> {
        let base = (0..d / 2).map(|k| 1.0 / theta.powf((2 * k) as f64 / d as f64));
        match self {
            RopeScaling::None => base.collect(),
            RopeScaling::Linear { factor } => base.map(|f| f / factor).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_context: old,
            } => base
                .map(|f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen > old / low {
                        f / factor
                    } else if wavelen < old / high {
                        f
                    } else {
                        let smooth = (old / wavelen - low) / (high - low);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect(),
            RopeScaling::Yarn {
                factor,
                original_context,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => Self::yarn_inv_freq(
                (theta, d),
                (factor, original_context),
                (beta_fast, beta_slow),
                truncate,
            ),
        }
    }
}

/// `pad_token_id` (Gemma's default 0; the others' none).
fn padding_idx(f: &Fields<'_>, family: Family) -> Result<Option<u32>, HfError> {
    match f.map.get("pad_token_id") {
        None => Ok((family == Family::Gemma).then_some(0)),
        Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64().and_then(|n| u32::try_from(n).ok()) {
            Some(n) => Ok(Some(n)),
            None => Err(field_err(
                f.path,
                "pad_token_id",
                format!("{v} is not a token id"),
            )),
        },
    }
}

/// The MLP's activation: `hidden_act` (Gemma: `hidden_activation` where set, as transformers 4
/// took it, and the legacy `gelu` meaning the tanh GELU, as transformers 5 takes it).
fn mlp_act(f: &Fields<'_>, family: Family) -> Result<MlpAct, HfError> {
    let (field, default) = match family {
        Family::Gemma if f.map.get("hidden_activation").is_some_and(|v| !v.is_null()) => {
            ("hidden_activation", "gelu_pytorch_tanh")
        }
        Family::Gemma => ("hidden_act", "gelu_pytorch_tanh"),
        _ => ("hidden_act", "silu"),
    };
    let value = f.map.get(field).filter(|v| !v.is_null());
    let name = match value {
        None => default,
        Some(v) => v
            .as_str()
            .ok_or_else(|| field_err(f.path, field, format!("{v} is not a string")))?,
    };
    match (family, name) {
        (Family::Gemma, "gelu" | "gelu_pytorch_tanh" | "gelu_new") => Ok(MlpAct::GeluTanh),
        (Family::Gemma, _) => Err(unsupported(
            f.path,
            field,
            &Value::from(name),
            "Gemma's GeGLU is built with the tanh GELU (gelu_pytorch_tanh)",
        )),
        (_, "silu") => Ok(MlpAct::Silu),
        (_, _) => Err(unsupported(
            f.path,
            field,
            &Value::from(name),
            "the MLP is SwiGLU (silu)",
        )),
    }
}

/// The fields that change the math and have one implemented value.
fn check_math(f: &Fields<'_>) -> Result<(), HfError> {
    f.require_flag("use_bidirectional_attention", false, "attention is causal")?;
    Ok(())
}
