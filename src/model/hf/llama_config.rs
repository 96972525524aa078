//! A Llama's `config.json`: every field that changes the math read (transformers' `LlamaConfig`
//! defaults where absent), the rotary scalings computed as transformers computes them, and a
//! value zerodp does not compute refused by name. The model itself is [`crate::model::llama`].

use std::path::Path;

use serde_json::Value;

use super::fields::{field_err, unsupported, Fields};
use super::HfError;
use crate::model::gpt::GptConfig;

/// A Llama's sizes and the constants of its math.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
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

    /// Maps a `LlamaForCausalLM` config, with `LlamaConfig`'s defaults where a field is absent;
    /// a value zerodp does not compute (a rope scaling other than linear and llama3, biases,
    /// another activation) is refused by
    /// name.
    pub fn from_hf_json(json: &Value, path: &Path) -> Result<LlamaConfig, HfError> {
        let Some(map) = json.as_object() else {
            return Err(field_err(path, "(root)", "the config is not a JSON object"));
        };
        let f = Fields { path, map };
        if f.text("model_type") != Some("llama") {
            let v = map.get("model_type").cloned().unwrap_or(Value::Null);
            return Err(unsupported(path, "model_type", &v, "expected \"llama\""));
        }
        let c = sizes(&f)?;
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

    /// The GPT of the same vocabulary, context, depth, width and heads: what the planner's and
    /// the pre-flight's GPT-based estimates take for this model (the MLP and the head differ, so
    /// they are estimates).
    pub fn gpt_shape(&self) -> GptConfig {
        GptConfig {
            vocab_size: self.vocab_size,
            context: self.context,
            layers: self.layers,
            heads: self.heads,
            width: self.heads * self.head_dim,
        }
    }

    /// Ψ: the number of parameters (a tied head counted once).
    pub fn num_params(&self) -> usize {
        let (c, q, kv) = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
        );
        let block = 2 * c + 2 * c * q + 2 * c * kv + 3 * c * self.intermediate;
        let head = if self.tied { 0 } else { self.vocab_size * c };
        self.vocab_size * c + self.layers * block + c + head
    }
}

/// The sizes, with `LlamaConfig`'s defaults.
fn sizes(f: &Fields<'_>) -> Result<LlamaConfig, HfError> {
    let hidden = f.size("hidden_size", Some(4096))?;
    let heads = f.size("num_attention_heads", Some(32))?;
    Ok(LlamaConfig {
        vocab_size: f.size("vocab_size", Some(32000))?,
        hidden,
        intermediate: f.size("intermediate_size", Some(11008))?,
        layers: f.size("num_hidden_layers", Some(32))?,
        heads,
        kv_heads: f.size("num_key_value_heads", Some(heads))?,
        head_dim: f.size("head_dim", Some(hidden / heads.max(1)))?,
        context: f.size("max_position_embeddings", Some(2048))?,
        rms_eps: f.number("rms_norm_eps", 1e-6)?,
        rope_theta: rope_theta(f)?,
        rope_scaling: rope_scaling(f)?,
        tied: f.flag("tie_word_embeddings", false)?,
        init_std: f.number("initializer_range", 0.02)?,
    })
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
fn rope_scaling(f: &Fields<'_>) -> Result<RopeScaling, HfError> {
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
        _ => {
            let why = "the rotary scalings implemented are default, linear and llama3";
            Err(unsupported(f.path, field, block, why))
        }
    }
}

impl RopeScaling {
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
        }
    }
}

/// The fields that change the math and have one implemented value.
fn check_math(f: &Fields<'_>) -> Result<(), HfError> {
    if let Some(act) = f
        .map
        .get("hidden_act")
        .filter(|v| v.as_str() != Some("silu"))
    {
        return Err(unsupported(
            f.path,
            "hidden_act",
            act,
            "the MLP is SwiGLU (silu)",
        ));
    }
    f.require_flag("attention_bias", false, "the projections have no bias")?;
    f.require_flag("mlp_bias", false, "the MLP has no bias")?;
    Ok(())
}
