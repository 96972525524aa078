//! What the planner knows about a model: Ψ, its units (what one stage-3 gather holds), and, when
//! given, a decoder's shape for activations (a GPT-2's, or a Llama-family decoder's).

use super::PlanError;
use crate::limits::{check_gpt_size, MAX_PARAMS};
use crate::zero::unit::ModelSpec;

/// A decoder's shape: a GPT-2-architecture one (learned positions, tied LM head, 4x MLP, biases
/// everywhere), or with [`GptShape::llama`] a Llama-family one (Llama, Qwen2/3, Mistral, Gemma)
/// whose `width` is its hidden size and `heads` its query heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct GptShape {
    pub layers: u64,
    pub width: u64,
    pub heads: u64,
    pub vocab: u64,
    pub context: u64,
    /// The widths and options of a Llama-family decoder; `None` for a GPT-2.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub llama: Option<LlamaDims>,
}

/// What a Llama-family decoder has that the GPT of the same width does not: grouped-query
/// attention with heads of their own width, a gated MLP of its own width, and the options that
/// add parameters (and the activations computed with them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct LlamaDims {
    pub kv_heads: u64,
    pub head_dim: u64,
    pub intermediate: u64,
    /// Biases on the q, k and v projections (Qwen2, Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// A bias on the output projection (Llama's `attention_bias`).
    pub o_bias: bool,
    /// Biases on the MLP's three projections (`mlp_bias`).
    pub mlp_bias: bool,
    /// RMSNorm of each head's queries and keys (Qwen3).
    pub qk_norm: bool,
    /// The embeddings are scaled by the square root of the width (Gemma), a tensor of their own.
    pub embed_scale: bool,
    /// The config names a padding token, whose rows the embedding lookup cuts from the graph.
    pub pad_rows: bool,
    /// The LM head is the token embedding.
    pub tied: bool,
}

impl LlamaDims {
    /// Elements of the queries (`heads · head_dim`) and of the keys or values.
    pub(crate) fn qk(&self, heads: u64) -> (u64, u64) {
        (heads * self.head_dim, self.kv_heads * self.head_dim)
    }

    /// One decoder layer: two norms, q, k, v and o, gate, up and down, and the options' biases
    /// and head norms.
    fn block_params(&self, c: u64, heads: u64) -> u64 {
        let (q, kv, i) = (self.qk(heads).0, self.qk(heads).1, self.intermediate);
        let mut block = 2 * c + 2 * c * q + 2 * c * kv + 3 * c * i;
        block += u64::from(self.qkv_bias) * (q + 2 * kv) + u64::from(self.o_bias) * c;
        block += u64::from(self.mlp_bias) * (2 * i + c);
        block + u64::from(self.qk_norm) * 2 * self.head_dim
    }
}

/// Named GPT shapes (GPT-2 sizes from the GPT-2 release, GPT-3 sizes from the GPT-3 paper, table 2.1,
/// with 13B at width 5120 so that its 40 heads divide it).
pub const GPT_PRESETS: &[(&str, GptShape)] = &[
    ("gpt2", gpt(12, 768, 12, 1024)),
    ("gpt2-medium", gpt(24, 1024, 16, 1024)),
    ("gpt2-large", gpt(36, 1280, 20, 1024)),
    ("gpt2-xl", gpt(48, 1600, 25, 1024)),
    ("gpt3-2.7b", gpt(32, 2560, 32, 2048)),
    ("gpt3-6.7b", gpt(32, 4096, 32, 2048)),
    ("gpt3-13b", gpt(40, 5120, 40, 2048)),
    ("gpt3-175b", gpt(96, 12288, 96, 2048)),
];

const fn gpt(layers: u64, width: u64, heads: u64, context: u64) -> GptShape {
    GptShape {
        layers,
        width,
        heads,
        vocab: 50257,
        context,
        llama: None,
    }
}

impl GptShape {
    /// Looks a preset up by name; the error lists the names.
    pub fn preset(name: &str) -> Result<GptShape, PlanError> {
        GPT_PRESETS
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, s)| *s)
            .ok_or_else(|| {
                let names: Vec<&str> = GPT_PRESETS.iter().map(|(n, _)| *n).collect();
                PlanError::Input(format!(
                    "--preset {name:?} is not a known model; choose one of {}",
                    names.join(", ")
                ))
            })
    }

    /// Checks the shape is usable (positive, heads divide width).
    pub fn validate(&self) -> Result<(), PlanError> {
        let fields = [
            ("--layers", self.layers),
            ("--width", self.width),
            ("--heads", self.heads),
            ("--vocab", self.vocab),
            ("--context", self.context),
        ];
        for (flag, v) in fields {
            if v == 0 {
                return Err(PlanError::Input(format!("{flag} must be at least 1")));
            }
        }
        if self.width % self.heads != 0 && self.llama.is_none() {
            return Err(PlanError::Input(format!(
                "--width {} is not a multiple of --heads {}; pick heads that divide the width",
                self.width, self.heads
            )));
        }
        check_gpt_size(self.vocab, self.context, self.layers, self.width)
            .map_err(PlanError::Input)?;
        Ok(())
    }

    /// Parameters of one transformer block: ln_1 (2w) + c_attn (3w² + 3w) + attn c_proj (w² + w)
    /// + ln_2 (2w) + c_fc (4w² + 4w) + mlp c_proj (4w² + w) = 12w² + 13w.
    ///
    /// A Llama's layer counts by its [`LlamaDims`].
    pub(crate) fn block_params(&self) -> u64 {
        let w = self.width;
        match &self.llama {
            Some(l) => l.block_params(w, self.heads),
            None => 12 * w * w + 13 * w,
        }
    }

    /// Token (vocab·w) plus position (context·w) embeddings; the LM head reuses the token
    /// embedding. A Llama has no position embeddings (rotary positions).
    pub(crate) fn embedding_params(&self) -> u64 {
        match self.llama {
            Some(_) => self.vocab * self.width,
            None => (self.vocab + self.context) * self.width,
        }
    }

    /// The last unit: ln_f (2w) with the tied head; a Llama's final RMSNorm (w) and its own head
    /// (vocab·w) where untied.
    fn head_params(&self) -> u64 {
        match self.llama {
            Some(l) => self.width + u64::from(!l.tied) * self.vocab * self.width,
            None => 2 * self.width,
        }
    }

    /// Ψ = (vocab + context)·w + L·(12w² + 13w) + 2w (ln_f) for a GPT; the tied head adds nothing.
    pub fn num_params(&self) -> u64 {
        self.embedding_params() + self.layers * self.block_params() + self.head_params()
    }

    /// The units the planner assumes for this shape, in forward order: the embeddings, one unit per
    /// block, and the final norm with the head (the embedding's, where tied).
    pub fn unit_numels(&self) -> Vec<u64> {
        let mut units = Vec::with_capacity(self.layers as usize + 2);
        units.push(self.embedding_params());
        units.extend(std::iter::repeat_n(
            self.block_params(),
            self.layers as usize,
        ));
        units.push(self.head_params());
        units
    }
}

/// The model as the planner sees it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ModelSize {
    /// Ψ, tied parameters counted once.
    pub params: u64,
    /// Elements of the largest unit (the smallest possible stage-3 gather pool).
    pub largest_unit: u64,
    /// Every unit's elements in forward order, when known (a GPT shape or the engine's
    /// [`ModelSpec`]); empty when only counts were given. Drives the stage-3 persistence rule and the
    /// number of collectives (latency terms).
    pub unit_numels: Vec<u64>,
    /// The GPT shape, when known; activations are modelled only with one.
    pub shape: Option<GptShape>,
    /// True when `largest_unit` was estimated rather than given (see [`ModelSize::from_count`]).
    pub largest_unit_estimated: bool,
    /// The engine's own layout, when planning the model `train` builds: buffers, model states and
    /// traffic then follow the engine exactly (see `planner::engine`) instead of the estimates.
    #[serde(skip)]
    pub spec: Option<ModelSpec>,
}

impl ModelSize {
    /// A bare parameter count. Without `largest_unit`, it is estimated as one transformer block
    /// (12w²) of a GPT with GPT-3's aspect ratio, width = 128 · layers, so Ψ ≈ 12·L·w² gives
    /// w = (128·Ψ/12)^(1/3); for Ψ = 7.5e9 that is ≈ 2.2e8 elements (Ψ/34).
    pub fn from_count(params: u64, largest_unit: Option<u64>) -> Result<ModelSize, PlanError> {
        if params == 0 {
            return Err(PlanError::Input("--params must be at least 1".into()));
        }
        if params > MAX_PARAMS {
            return Err(PlanError::Input(format!(
                "--params {:.2e} is more than zerodp's limit of {:.0e} parameters",
                params as f64, MAX_PARAMS as f64
            )));
        }
        let (largest, estimated) = match largest_unit {
            Some(0) => {
                return Err(PlanError::Input(
                    "--largest-unit must be at least 1 (the elements of the largest unit)".into(),
                ))
            }
            Some(l) if l > params => {
                return Err(PlanError::Input(format!(
                "--largest-unit {l} is larger than --params {params}; a unit is part of the model"
            )))
            }
            Some(l) => (l, false),
            None => {
                let w = (128.0 * params as f64 / 12.0).cbrt();
                (((12.0 * w * w) as u64).clamp(1, params), true)
            }
        };
        Ok(ModelSize {
            params,
            largest_unit: largest,
            unit_numels: Vec::new(),
            shape: None,
            largest_unit_estimated: estimated,
            spec: None,
        })
    }

    /// A GPT shape: exact Ψ and units.
    pub fn from_gpt(shape: GptShape) -> Result<ModelSize, PlanError> {
        shape.validate()?;
        let units = shape.unit_numels();
        Ok(ModelSize {
            params: shape.num_params(),
            largest_unit: units.iter().copied().max().unwrap_or(0),
            unit_numels: units,
            shape: Some(shape),
            largest_unit_estimated: false,
            spec: None,
        })
    }

    /// The engine's own layout (what `train` builds); pass the shape too for activations. Plans of
    /// this model use the engine's own rules: its padded flat layout for the model states,
    /// [`crate::zero::buffers::plan`] for the buffers and its step schedule for the traffic.
    pub fn from_model_spec(spec: &ModelSpec, shape: Option<GptShape>) -> ModelSize {
        let units: Vec<u64> = spec.units.iter().map(|u| u.numel() as u64).collect();
        ModelSize {
            params: spec.num_params() as u64,
            largest_unit: spec.largest_unit() as u64,
            unit_numels: units,
            shape,
            largest_unit_estimated: false,
            spec: Some(spec.clone()),
        }
    }

    /// Number of units: known, or Ψ / largest unit rounded up when only counts are known.
    pub fn num_units(&self) -> u64 {
        if self.unit_numels.is_empty() {
            self.params.div_ceil(self.largest_unit.max(1))
        } else {
            self.unit_numels.len() as u64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_small_has_124m_params() {
        // The published GPT-2 small count with tied head: 124,439,808.
        let s = GptShape::preset("gpt2").unwrap();
        assert_eq!(s.num_params(), 124_439_808);
        let m = ModelSize::from_gpt(s).unwrap();
        assert_eq!(m.unit_numels.len(), 14);
        assert_eq!(m.unit_numels.iter().sum::<u64>(), m.params);
        assert_eq!(m.largest_unit, (50257 + 1024) * 768);
    }

    #[test]
    fn gpt2_xl_has_1_56b_params() {
        // GPT-2 XL: 1,557,611,200 parameters.
        assert_eq!(
            GptShape::preset("gpt2-xl").unwrap().num_params(),
            1_557_611_200
        );
    }

    #[test]
    fn estimated_largest_unit_is_a_block_of_a_gpt3_shaped_model() {
        let m = ModelSize::from_count(7_500_000_000, None).unwrap();
        assert!(m.largest_unit_estimated);
        assert!(
            m.largest_unit > 150_000_000 && m.largest_unit < 300_000_000,
            "{}",
            m.largest_unit
        );
        assert!(ModelSize::from_count(10, Some(11)).is_err());
    }

    #[test]
    fn bad_shapes_are_refused_with_the_flag() {
        let mut s = GptShape::preset("gpt2").unwrap();
        s.heads = 7;
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("--heads"), "{e}");
    }
}
