//! A GPT in the GPT-2 architecture on candle (CPU, f32 compute), cut into units for the engine.
//!
//! # Architecture
//! Token embedding plus learned position embedding; `layers` pre-LayerNorm transformer blocks
//! (`x += attn(ln_1(x))`, `x += mlp(ln_2(x))`, causal multi-head self-attention with a fused QKV
//! projection, MLP `width -> 4*width -> width` with the tanh-approximated GELU of GPT-2); a final
//! LayerNorm; the LM head is the token embedding itself (weight tying, no bias). The loss is the
//! mean cross-entropy over every token of the micro-batch. LayerNorm epsilon is 1e-5 and the MLP
//! 4C wide (a Hugging Face config may set either: [`GptConfig::mlp_width`], [`GptConfig::ln_eps`]).
//!
//! # Units
//! | unit | name | owns | reads from other units |
//! | --- | --- | --- | --- |
//! | 0 | `embeddings` | `wte.weight`, `wpe.weight` | - |
//! | 1..=L | `h.{i}` (i = unit - 1) | the block's 12 tensors | - |
//! | L+1 | `head` | `ln_f.weight`, `ln_f.bias` (and `lm_head.weight` `[V, C]` when untied) | unit 0 (`wte.weight`, the tied LM head), none when untied |
//!
//! The head's `uses = [0]`: it receives unit 0's flat buffer as its second parameter slice and
//! adds its gradient contribution to `wte.weight` into unit 0's gradient slice, so the tied weight
//! gets the sum of both uses (the embedding lookup and the LM head).
//!
//! The model is written as a [`CandleUnits`] ([`Gpt`]: the layout, the initialisation and each
//! unit's forward on tensors); [`GptModel`] wraps it in the candle helper [`Candle`], which does
//! the rest of the contract (tensors from the flat slices, backward, gradient write-back), the
//! same helper any other candle model uses (see [`super::candle_unit`]). In f32 on the fused
//! kernels [`GptModel`] runs the blocks on the kernels' slice functions instead, without a candle
//! graph (`gpt_block`), with the same bits.
//!
//! Activations between units ([`UnitModel::Act`]) are `[batch * seq, width]` tensors in the
//! compute dtype, rows in (sequence, position) order.
//!
//! # Parameter names and layouts
//! Row-major, in this order inside each unit's flat buffer (`C` = width, `V` = vocab_size,
//! `T` = context). Linear weights are stored `[out, in]` as `torch.nn.Linear` stores them (so
//! `y = x @ W^T + b`), **not** transposed like Hugging Face's `Conv1D` (`[in, out]`); to load a
//! Hugging Face GPT-2 checkpoint, transpose its `c_attn`, `c_proj` and `c_fc` weights.
//!
//! | name | shape | init |
//! | --- | --- | --- |
//! | `wte.weight` | `[V, C]` | normal(0, 0.02) |
//! | `wpe.weight` | `[T, C]` | normal(0, 0.02) |
//! | `h.{i}.ln_1.weight`, `h.{i}.ln_1.bias` | `[C]` | 1, 0 |
//! | `h.{i}.attn.c_attn.weight` | `[3C, C]`, rows: q, then k, then v; head h uses rows `h*C/H..(h+1)*C/H` of each | normal(0, 0.02) |
//! | `h.{i}.attn.c_attn.bias` | `[3C]` | 0 |
//! | `h.{i}.attn.c_proj.weight` | `[C, C]` | normal(0, 0.02 / sqrt(2 L)) |
//! | `h.{i}.attn.c_proj.bias` | `[C]` | 0 |
//! | `h.{i}.ln_2.weight`, `h.{i}.ln_2.bias` | `[C]` | 1, 0 |
//! | `h.{i}.mlp.c_fc.weight` | `[4C, C]` | normal(0, 0.02) |
//! | `h.{i}.mlp.c_fc.bias` | `[4C]` | 0 |
//! | `h.{i}.mlp.c_proj.weight` | `[C, 4C]` | normal(0, 0.02 / sqrt(2 L)) |
//! | `h.{i}.mlp.c_proj.bias` | `[C]` | 0 |
//! | `ln_f.weight`, `ln_f.bias` | `[C]` | 1, 0 |
//!
//! Initial values come from a splitmix64 stream per tensor seeded by (seed, unit, tensor index),
//! so they do not depend on the rank or the world size.
//!
//! # Compute paths
//! By default the blocks run on the fused CPU kernels of `kernels.rs` (LayerNorm, linear layers
//! straight on gemm, the whole causal attention core, tanh-GELU, cross-entropy), each a candle
//! custom op with a hand-written backward: about a dozen graph nodes per block instead of about
//! fifty, 2-3x faster than composite candle ops on this CPU. [`GptModel::with_options`] can select
//! the composite path instead (LayerNorm built from primitive ops, `candle_nn::ops::softmax`,
//! `candle_nn::loss::cross_entropy`), which is the reference the fused kernels are tested against.
//! On a GPU the matrix products are cuBLAS's through candle and the LayerNorm, the GELU and the
//! attention's causal softmax are the same custom ops run by zerodp's CUDA kernels
//! (`cuda::gpt_ops`, `kernels/gpt_ops.cu`; `ZERODP_CUDA_KERNELS=0` keeps the composite ops).
//! candle-nn's own fused `softmax_last_dim`, `layer_norm` and `rms_norm` are never used: they have
//! no backward and drop gradients silently. The tests check that every parameter gets a gradient
//! and that both paths match finite differences in F64.
//!
//! # Threads
//! Matmuls and the fused kernels run on the caller's rayon pool (so a rank confined to its own
//! pool stays there). Call [`run_candle_elementwise_on_caller_thread`] at the start of `main`
//! to keep candle's remaining element-wise ops off its process-wide spinning thread pool.

use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::{DType, Device, Tensor, D};

use super::candle_unit::{compute_err, Candle, CandleSaved, CandleUnits};
use super::gpt_block::{self, BlockSaved, BlockShape};
use super::ops;

mod decode;
use crate::data::TokenBatch;
use crate::rng::{fill_normal, mix_seed};
use crate::zero::unit::{
    BatchCounts, ForwardMode, ModelError, ModelSpec, ParamSpec, UnitForward, UnitModel, UnitSpec,
};

/// LayerNorm epsilon (GPT-2's value).
const LN_EPS: f64 = 1e-5;
/// Standard deviation of GPT-2's normal initialisation.
const INIT_STD: f64 = 0.02;

/// The size of a GPT, and the three settings of GPT-2's math a Hugging Face config may change.
#[derive(Clone, Debug, PartialEq)]
pub struct GptConfig {
    pub vocab_size: usize,
    /// Maximum sequence length (rows of `wpe.weight`).
    pub context: usize,
    pub layers: usize,
    pub heads: usize,
    pub width: usize,
    /// The MLP's inner width (GPT-2's `n_inner`); `None`: 4 x `width`.
    pub mlp_width: Option<usize>,
    /// The LayerNorm epsilon (GPT-2's `layer_norm_epsilon`); `None`: 1e-5.
    pub ln_eps: Option<f64>,
    /// An LM head of its own (`lm_head.weight` in the head unit) rather than the token embedding.
    pub untied_head: bool,
}

impl GptConfig {
    /// A GPT of these sizes with GPT-2's math: MLP 4 x width, LayerNorm epsilon 1e-5, the head
    /// tied to the token embedding.
    pub fn sized(
        vocab_size: usize,
        context: usize,
        layers: usize,
        heads: usize,
        width: usize,
    ) -> Self {
        GptConfig {
            vocab_size,
            context,
            layers,
            heads,
            width,
            mlp_width: None,
            ln_eps: None,
            untied_head: false,
        }
    }

    /// The MLP's inner width.
    pub fn mlp(&self) -> usize {
        self.mlp_width.unwrap_or(4 * self.width)
    }

    /// The LayerNorm epsilon.
    pub fn eps(&self) -> f64 {
        self.ln_eps.unwrap_or(LN_EPS)
    }

    /// The sizes the planner and the pre-flight model a GPT by.
    pub fn shape(&self) -> crate::planner::GptShape {
        crate::planner::GptShape {
            layers: self.layers as u64,
            width: self.width as u64,
            heads: self.heads as u64,
            vocab: self.vocab_size as u64,
            context: self.context as u64,
            llama: None,
        }
    }

    /// Names accepted by [`GptConfig::preset`], smallest first.
    pub const PRESETS: [&'static str; 3] = ["tiny", "demo", "small"];

    /// For tests: 2 layers, width 32, 2 heads, context 16, byte vocabulary (about 34K parameters).
    pub fn tiny() -> Self {
        Self::sized(256, 16, 2, 2, 32)
    }

    /// Trains visibly within minutes on 2 cores: 3 layers, width 128, 4 heads, context 64, byte
    /// vocabulary (about 0.64M parameters).
    pub fn demo() -> Self {
        Self::sized(256, 64, 3, 4, 128)
    }

    /// The benchmark model: 4 layers, width 256, 4 heads, context 128, byte vocabulary (3,257,856
    /// parameters).
    pub fn small() -> Self {
        Self::sized(256, 128, 4, 4, 256)
    }

    /// The preset called `name` (one of [`GptConfig::PRESETS`]).
    pub fn preset(name: &str) -> Result<Self, ModelError> {
        match name {
            "tiny" => Ok(Self::tiny()),
            "demo" => Ok(Self::demo()),
            "small" => Ok(Self::small()),
            _ => Err(ModelError::Invalid(format!(
                "unknown model preset `{name}`; choose one of {}",
                Self::PRESETS.join(", ")
            ))),
        }
    }

    /// Check that the sizes make a valid model.
    pub fn validate(&self) -> Result<(), ModelError> {
        let fields = [
            ("vocab_size", self.vocab_size),
            ("context", self.context),
            ("layers", self.layers),
            ("heads", self.heads),
            ("width", self.width),
            ("mlp width", self.mlp()),
        ];
        for (name, value) in fields {
            if value == 0 {
                return Err(ModelError::Invalid(format!(
                    "GPT {name} must be at least 1, got 0"
                )));
            }
        }
        if self.width % self.heads != 0 {
            return Err(ModelError::Invalid(format!(
                "GPT width {} is not divisible by heads {}; pick a width that is a multiple of the head count",
                self.width, self.heads
            )));
        }
        // Before anything multiplies the sizes: Ψ and every tensor stay inside the limits.
        crate::limits::check_gpt_size(
            self.vocab_size as u64,
            self.context as u64,
            self.layers as u64,
            self.width as u64,
        )
        .map_err(ModelError::Invalid)?;
        Ok(())
    }

    /// Ψ: the number of parameters (a tied LM head counted once).
    pub fn num_params(&self) -> usize {
        let (v, t, c, l, m) = (
            self.vocab_size,
            self.context,
            self.width,
            self.layers,
            self.mlp(),
        );
        let head = if self.untied_head { v * c } else { 0 };
        v * c + t * c + l * (4 * c * c + 2 * c * m + 9 * c + m) + 2 * c + head
    }

    /// Model FLOPs of one training token (forward and backward) at full context, by the
    /// convention of PaLM's model FLOPs utilisation: 6 per weight of every matrix multiply (the
    /// blocks' 12c² per layer and the tied head's Vc; the embedding lookups multiply nothing)
    /// plus attention's 12·L·t·c (scores and weighted sum, forward 2·2·t·c per layer, backward
    /// twice that, counted over the full t×t square as the convention does, although the causal
    /// mask makes half of it unnecessary). Biases, norms and activations are left out.
    pub fn flops_per_token(&self) -> f64 {
        let (v, t, c, l) = (
            self.vocab_size as f64,
            self.context as f64,
            self.width as f64,
            self.layers as f64,
        );
        let m = self.mlp() as f64;
        6.0 * ((4.0 * c * c + 2.0 * c * m) * l + v * c) + 12.0 * l * t * c
    }
}

/// Make candle's element-wise ops run on the calling thread (sets `CANDLE_NUM_THREADS=1` unless
/// the user set it). Call at the start of `main`, before any candle op and before spawning
/// threads: candle reads the variable once, and setting environment variables while other threads
/// run is not safe.
///
/// WHY: candle 0.11.1 runs element-wise ops of 64K+ elements on one process-wide "barrier pool"
/// whose workers and caller spin-wait, and callers take turns on a mutex. Ranks running as threads
/// then serialise on that mutex, and whenever the cores are busy the spinning burns the time the
/// ranks need. Measured on the 2-core box under load (dev profile, one rank): `small` at 8 x 128
/// took 1441 ms per step with the pool and 1090 ms without; `demo` 160-330 ms and 75 ms. The
/// fused kernels do their own element-wise work on the caller's rayon pool, so little is lost.
/// Matmul threading (`RAYON_NUM_THREADS`) is not affected.
pub fn run_candle_elementwise_on_caller_thread() {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
}

/// How one parameter tensor starts.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Init {
    Normal(f64),
    Zeros,
    Ones,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum UnitKind {
    Embeddings,
    Block,
    Head,
}

/// What a `Train` forward of the GPT keeps for backward: the candle helper's saved state (the
/// embeddings and the head), or a block's activations (`gpt_block`).
pub struct GptSaved(SavedBy);

enum SavedBy {
    Candle(CandleSaved),
    Block { unit: usize, saved: Box<BlockSaved> },
}

/// The GPT's units as candle compute: a [`CandleUnits`], which [`GptModel`] wraps in the helper
/// [`Candle`] to make the [`UnitModel`] the engine trains.
pub struct Gpt {
    config: GptConfig,
    spec: ModelSpec,
    /// Per unit, per own parameter: its initialisation.
    inits: Vec<Vec<Init>>,
    dtype: DType,
    /// Use the fused kernels of [`super::ops`] (the default) rather than composite candle ops.
    fused: bool,
    /// On a GPU: LayerNorm, GELU and the causal softmax as zerodp's CUDA kernels
    /// ([`super::compute::uses_cuda_kernels`]), the rest on candle's ops.
    cuda_kernels: bool,
    device: Device,
    /// Additive causal masks (`0` on and below the diagonal, `-inf` above) by sequence length.
    masks: Mutex<HashMap<usize, Tensor>>,
}

fn param(name: String, shape: &[usize]) -> ParamSpec {
    ParamSpec {
        name,
        shape: shape.to_vec(),
    }
}

impl Gpt {
    /// A GPT computing in f32 on the fused kernels.
    pub fn new(config: GptConfig) -> Result<Self, ModelError> {
        Self::with_options(config, DType::F32, true)
    }

    /// A GPT computing in `dtype` (F32 or F64), on the fused kernels (`fused`, the default, fast)
    /// or on composite candle ops (the reference the fused kernels are tested against).
    #[doc(hidden)]
    pub fn with_options(config: GptConfig, dtype: DType, fused: bool) -> Result<Self, ModelError> {
        Self::build(config, dtype, fused, Device::Cpu)
    }

    /// A GPT on `device` computing in `dtype`: on the CPU as [`Self::with_options`]; on a GPU in
    /// f32 or a 16-bit dtype, on candle's ops and zerodp's CUDA kernels for the LayerNorm, the
    /// GELU and the causal softmax ([`super::compute::uses_cuda_kernels`]).
    pub fn on_device(config: GptConfig, dtype: DType, device: Device) -> Result<Self, ModelError> {
        let fused = device.is_cpu();
        Self::build(config, dtype, fused, device)
    }

    fn build(
        config: GptConfig,
        dtype: DType,
        fused: bool,
        device: Device,
    ) -> Result<Self, ModelError> {
        config.validate()?;
        let allowed = match device {
            Device::Cpu => matches!(dtype, DType::F32 | DType::F64),
            _ => matches!(dtype, DType::F32 | DType::BF16 | DType::F16),
        };
        if !allowed {
            return Err(ModelError::Invalid(format!(
                "GPT compute dtype must be F32 or F64 on the CPU, F32, BF16 or F16 on a GPU; \
                 got {dtype:?} on {device:?}"
            )));
        }
        Self::build_any(config, dtype, fused, device)
    }

    /// [`Self::build`] without the dtype check (tests run a GPU's 16-bit ops on the CPU).
    fn build_any(
        config: GptConfig,
        dtype: DType,
        fused: bool,
        device: Device,
    ) -> Result<Self, ModelError> {
        let (v, t, c, l, m) = (
            config.vocab_size,
            config.context,
            config.width,
            config.layers,
            config.mlp(),
        );
        let proj_std = INIT_STD / ((2 * l) as f64).sqrt();
        let mut units = Vec::with_capacity(l + 2);
        let mut inits = Vec::with_capacity(l + 2);

        units.push(UnitSpec {
            name: "embeddings".into(),
            params: vec![
                param("wte.weight".into(), &[v, c]),
                param("wpe.weight".into(), &[t, c]),
            ],
            uses: vec![],
        });
        inits.push(vec![Init::Normal(INIT_STD), Init::Normal(INIT_STD)]);

        for i in 0..l {
            let p = |s: &str, shape: &[usize]| param(format!("h.{i}.{s}"), shape);
            units.push(UnitSpec {
                name: format!("h.{i}"),
                params: vec![
                    p("ln_1.weight", &[c]),
                    p("ln_1.bias", &[c]),
                    p("attn.c_attn.weight", &[3 * c, c]),
                    p("attn.c_attn.bias", &[3 * c]),
                    p("attn.c_proj.weight", &[c, c]),
                    p("attn.c_proj.bias", &[c]),
                    p("ln_2.weight", &[c]),
                    p("ln_2.bias", &[c]),
                    p("mlp.c_fc.weight", &[m, c]),
                    p("mlp.c_fc.bias", &[m]),
                    p("mlp.c_proj.weight", &[c, m]),
                    p("mlp.c_proj.bias", &[c]),
                ],
                uses: vec![],
            });
            inits.push(vec![
                Init::Ones,
                Init::Zeros,
                Init::Normal(INIT_STD),
                Init::Zeros,
                Init::Normal(proj_std),
                Init::Zeros,
                Init::Ones,
                Init::Zeros,
                Init::Normal(INIT_STD),
                Init::Zeros,
                Init::Normal(proj_std),
                Init::Zeros,
            ]);
        }

        // The head also reads unit 0 (the tied `wte.weight`, the first of unit 0's tensors), or
        // holds its own `lm_head.weight`: either way its third tensor is the head's weight.
        let mut head = vec![
            param("ln_f.weight".into(), &[c]),
            param("ln_f.bias".into(), &[c]),
        ];
        let mut head_inits = vec![Init::Ones, Init::Zeros];
        if config.untied_head {
            head.push(param("lm_head.weight".into(), &[v, c]));
            head_inits.push(Init::Normal(INIT_STD));
        }
        units.push(UnitSpec {
            name: "head".into(),
            params: head,
            uses: if config.untied_head { vec![] } else { vec![0] },
        });
        inits.push(head_inits);

        let spec = ModelSpec { units };
        debug_assert_eq!(spec.num_params(), config.num_params());
        Ok(Self {
            config,
            spec,
            inits,
            dtype,
            fused,
            cuda_kernels: super::compute::uses_cuda_kernels(&device),
            device,
            masks: Mutex::new(HashMap::new()),
        })
    }

    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    fn kind(&self, unit: usize) -> candle_core::Result<UnitKind> {
        let last = self.config.layers + 1;
        match unit {
            0 => Ok(UnitKind::Embeddings),
            u if u < last => Ok(UnitKind::Block),
            u if u == last => Ok(UnitKind::Head),
            u => candle_core::bail!(
                "unit {u} does not exist: this GPT has {} units (0..={last})",
                last + 1
            ),
        }
    }

    fn causal_mask(&self, seq: usize) -> candle_core::Result<Tensor> {
        let mut masks = self.masks.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = masks.get(&seq) {
            return Ok(m.clone());
        }
        let data: Vec<f32> = (0..seq * seq)
            .map(|k| {
                if k % seq > k / seq {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let m = Tensor::from_vec(data, (seq, seq), &self.device)?.to_dtype(self.dtype)?;
        masks.insert(seq, m.clone());
        Ok(m)
    }

    /// The differentiable compute of one unit on tensors: returns the output activation (units
    /// before the last) or the mean loss (the last unit). `p`: the unit's own tensors in
    /// [`ParamSpec`] order; the head's are followed by unit 0's (`wte.weight`, `wpe.weight`).
    fn compute(
        &self,
        kind: UnitKind,
        p: &[Tensor],
        input: Option<&Tensor>,
        batch: &TokenBatch,
    ) -> candle_core::Result<Tensor> {
        let (b, t) = (batch.batch_size, batch.seq_len);
        let need_input = || {
            input.ok_or_else(|| {
                candle_core::Error::Msg("this unit needs an input activation".into())
            })
        };
        match kind {
            UnitKind::Embeddings => self.embed_batch(&p[0], &p[1], batch),
            UnitKind::Block => {
                let x = need_input()?;
                let h = self.layer_norm(x, &p[0], &p[1])?;
                let qkv = self.linear(&h, &p[2], &p[3])?;
                let att = self.attention_packed(&qkv, (b, t), &batch.segment_starts)?;
                let x = (x + self.linear(&att, &p[4], &p[5])?)?;
                let h = self.layer_norm(&x, &p[6], &p[7])?;
                let h = self.gelu(&self.linear(&h, &p[8], &p[9])?)?;
                x + self.linear(&h, &p[10], &p[11])?
            }
            UnitKind::Head => {
                let x = need_input()?;
                let h = self.layer_norm(x, &p[0], &p[1])?;
                // p[2] is the tied `wte.weight` of unit 0.
                self.head_loss(&h, &p[2], &batch.targets)
            }
        }
    }

    // The ops below are `#[doc(hidden)] pub` for `zerodp bench ops` (src/cli/bench_ops.rs), which
    // times each on its own; they are the exact code the units run.

    /// [`Gpt::embed`] of a batch, at each token's position in its sequence where rows are packed.
    fn embed_batch(
        &self,
        wte: &Tensor,
        wpe: &Tensor,
        batch: &TokenBatch,
    ) -> candle_core::Result<Tensor> {
        let (b, t) = (batch.batch_size, batch.seq_len);
        let Some(positions) = batch.positions() else {
            return self.embed(wte, wpe, &batch.tokens, b, t);
        };
        if !self.fused {
            let tokens = Tensor::from_slice(&batch.tokens, b * t, &self.device)?;
            let pos = Tensor::from_slice(&positions, b * t, &self.device)?;
            return wte.index_select(&tokens, 0)? + wpe.index_select(&pos, 0)?;
        }
        let op = ops::Embedding {
            tokens: batch.tokens.clone(),
            seq: t,
            positions: Some(positions),
        };
        wte.contiguous()?.apply_op2(&wpe.contiguous()?, op)
    }

    /// [`Gpt::attention_core`], each packed sequence (`starts`, empty for none) attending to
    /// itself only: on the fused kernel; the composite ops refuse packed rows.
    fn attention_packed(
        &self,
        qkv: &Tensor,
        (b, t): (usize, usize),
        starts: &[u32],
    ) -> candle_core::Result<Tensor> {
        if starts.is_empty() {
            return self.attention_core(qkv, b, t);
        }
        if !self.fused {
            candle_core::bail!("rows packed with several sequences need the fused CPU kernels; this GPT runs on composite ops (a GPU)");
        }
        let attn = ops::CausalAttention::new(b, t, self.config.heads, None).with_segments(starts);
        qkv.apply_op1(attn)
    }

    /// Token plus position embeddings of `b x t` token ids: `[b*t, c]`.
    #[doc(hidden)]
    pub fn embed(
        &self,
        wte: &Tensor,
        wpe: &Tensor,
        tokens: &[u32],
        b: usize,
        t: usize,
    ) -> candle_core::Result<Tensor> {
        let c = self.config.width;
        if self.fused {
            if tokens.len() != b * t {
                candle_core::bail!("embedding: {} tokens for {b} x {t}", tokens.len());
            }
            let op = ops::Embedding {
                tokens: tokens.to_vec(),
                seq: t,
                positions: None,
            };
            return wte.contiguous()?.apply_op2(&wpe.contiguous()?, op);
        }
        let tokens = Tensor::from_slice(tokens, b * t, &self.device)?;
        let tok = wte.index_select(&tokens, 0)?.reshape((b, t, c))?;
        let pos = wpe.narrow(0, 0, t)?;
        tok.broadcast_add(&pos)?.reshape((b * t, c))
    }

    /// The mean cross-entropy of the LM head's logits `h @ wte^T` (tied weights) against
    /// `targets`: on the fused kernels over chunks of rows, never holding all `[n, vocab]` logits
    /// (see `kernels::HeadLoss`); else the logits, then the loss.
    #[doc(hidden)]
    pub(crate) fn head_loss(
        &self,
        h: &Tensor,
        wte: &Tensor,
        targets: &[u32],
    ) -> candle_core::Result<Tensor> {
        if self.fused {
            let op = ops::HeadLoss {
                targets: targets.to_vec(),
            };
            return h.contiguous()?.apply_op2(&wte.contiguous()?, op);
        }
        // The softmax of a 16-bit run in f32, as PyTorch's autocast computes its cross-entropy.
        let mut logits = self.lm_logits(h, wte)?;
        if super::compute::is_16_bit(self.dtype) {
            logits = logits.to_dtype(DType::F32)?;
        }
        super::compute::masked_cross_entropy(&logits, targets)
    }

    /// The LM head's logits `h @ wte^T` (tied weights): `[n, vocab]`.
    #[doc(hidden)]
    pub fn lm_logits(&self, h: &Tensor, wte: &Tensor) -> candle_core::Result<Tensor> {
        h.matmul(&wte.t()?)
    }

    /// Mean cross-entropy of `logits [n, vocab]` against u32 `targets [n]`.
    #[doc(hidden)]
    pub fn cross_entropy(&self, logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        if self.fused {
            logits.apply_op2(targets, ops::CrossEntropy)
        } else {
            candle_nn::loss::cross_entropy(logits, targets)
        }
    }

    /// `y = x @ w^T + bias` for `x: [n, in]`, `w: [out, in]`, `bias: [out]`.
    #[doc(hidden)]
    pub fn linear(&self, x: &Tensor, w: &Tensor, bias: &Tensor) -> candle_core::Result<Tensor> {
        if self.fused {
            x.contiguous()?.apply_op3(w, bias, ops::Linear)
        } else {
            x.matmul(&w.t()?)?.broadcast_add(bias)
        }
    }

    /// LayerNorm over the last dimension.
    #[doc(hidden)]
    pub fn layer_norm(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
    ) -> candle_core::Result<Tensor> {
        if self.fused || self.cuda_kernels {
            x.contiguous()?.apply_op3(
                weight,
                bias,
                ops::LayerNorm {
                    eps: self.config.eps(),
                },
            )
        } else if super::compute::is_16_bit(self.dtype) {
            // Statistics in f32, as PyTorch's 16-bit norm kernels and autocast compute them.
            let f32 = |t: &Tensor| t.to_dtype(DType::F32);
            let eps = self.config.eps();
            layer_norm_composite(&f32(x)?, (&f32(weight)?, &f32(bias)?), eps)?.to_dtype(self.dtype)
        } else {
            layer_norm_composite(x, (weight, bias), self.config.eps())
        }
    }

    #[doc(hidden)]
    pub fn gelu(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if self.fused || self.cuda_kernels {
            x.contiguous()?.apply_op1(ops::Gelu)
        } else {
            x.gelu()
        }
    }

    /// The causal multi-head attention core: `qkv [b*t, 3c]` -> `[b*t, c]` (before the output
    /// projection).
    #[doc(hidden)]
    pub fn attention_core(&self, qkv: &Tensor, b: usize, t: usize) -> candle_core::Result<Tensor> {
        let c = self.config.width;
        let nh = self.config.heads;
        let hd = c / nh;
        if self.fused {
            let attn = ops::CausalAttention::new(b, t, nh, None);
            return qkv.apply_op1(attn);
        }
        let qkv = qkv.reshape((b, t, 3, nh, hd))?;
        // [b, t, nh, hd] -> [b, nh, t, hd], contiguous for the batched matmuls.
        let split = |i: usize| {
            qkv.narrow(2, i, 1)?
                .squeeze(2)?
                .transpose(1, 2)?
                .contiguous()
        };
        let q = split(0)?.affine(1.0 / (hd as f64).sqrt(), 0.0)?;
        let k = split(1)?;
        let v = split(2)?;
        let scores = q.matmul(&k.t()?)?;
        let att = if self.cuda_kernels {
            // In f32 inside the kernel, rounded once to the scores' dtype.
            scores.contiguous()?.apply_op1(ops::CausalSoftmax)?
        } else if super::compute::is_16_bit(self.dtype) {
            // The softmax in f32, as PyTorch's 16-bit softmax and autocast compute it.
            let mask = self.causal_mask(t)?.to_dtype(DType::F32)?;
            let scores = scores.to_dtype(DType::F32)?.broadcast_add(&mask)?;
            candle_nn::ops::softmax(&scores, D::Minus1)?.to_dtype(self.dtype)?
        } else {
            let scores = scores.broadcast_add(&self.causal_mask(t)?)?;
            candle_nn::ops::softmax(&scores, D::Minus1)?
        };
        att.matmul(&v)?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((b * t, c))
    }

    fn validate_batch(&self, batch: &TokenBatch) -> Result<(), ModelError> {
        let n = batch.batch_size * batch.seq_len;
        if batch.batch_size == 0 || batch.seq_len == 0 {
            return Err(ModelError::Invalid(format!(
                "empty batch ({} x {} tokens)",
                batch.batch_size, batch.seq_len
            )));
        }
        if batch.seq_len > self.config.context {
            return Err(ModelError::Invalid(format!(
                "sequence length {} exceeds the model context {}; use shorter windows or a model with a longer context",
                batch.seq_len, self.config.context
            )));
        }
        if batch.tokens.len() != n || batch.targets.len() != n {
            return Err(ModelError::Invalid(format!(
                "batch of {} x {} needs {n} tokens and targets, got {} and {}",
                batch.batch_size,
                batch.seq_len,
                batch.tokens.len(),
                batch.targets.len()
            )));
        }
        batch.check_segments().map_err(ModelError::Invalid)?;
        let v = self.config.vocab_size as u32;
        let targets = batch
            .targets
            .iter()
            .filter(|&&t| t != crate::data::IGNORE_INDEX);
        if let Some(&bad) = batch.tokens.iter().chain(targets).find(|&&x| x >= v) {
            return Err(ModelError::Invalid(format!(
                "token id {bad} is outside the vocabulary of {v}"
            )));
        }
        Ok(())
    }
}

/// LayerNorm over the last dimension, from primitive differentiable ops.
fn layer_norm_composite(
    x: &Tensor,
    (weight, bias): (&Tensor, &Tensor),
    eps: f64,
) -> candle_core::Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let inv_std = (var + eps)?.sqrt()?.recip()?;
    xc.broadcast_mul(&inv_std)?
        .broadcast_mul(weight)?
        .broadcast_add(bias)
}

impl CandleUnits for Gpt {
    type Batch = TokenBatch;

    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn batch_counts(&self, batch: &TokenBatch) -> BatchCounts {
        batch.counts()
    }

    fn loss_tokens(&self, batch: &TokenBatch) -> usize {
        batch.loss_tokens()
    }

    fn init_params(&self, unit: usize, seed: u64, out: &mut [f32]) {
        let spec = &self.spec.units[unit];
        assert_eq!(
            out.len(),
            spec.numel(),
            "init_params: unit {} has {} elements, buffer has {}",
            spec.name,
            spec.numel(),
            out.len()
        );
        for (k, ((p, off), init)) in spec
            .params
            .iter()
            .zip(spec.offsets())
            .zip(&self.inits[unit])
            .enumerate()
        {
            let dst = &mut out[off..off + p.numel()];
            match *init {
                Init::Zeros => dst.fill(0.0),
                Init::Ones => dst.fill(1.0),
                Init::Normal(std) => {
                    fill_normal(dst, mix_seed(&[seed, unit as u64, k as u64]), std);
                }
            }
        }
    }

    fn forward_unit(
        &self,
        unit: usize,
        params: &[Tensor],
        input: Option<&Tensor>,
        batch: &TokenBatch,
    ) -> candle_core::Result<Tensor> {
        self.compute(self.kind(unit)?, params, input, batch)
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn device(&self) -> Device {
        self.device.clone()
    }

    fn check_batch(&self, batch: &TokenBatch) -> Result<(), ModelError> {
        self.validate_batch(batch)
    }
}

/// The GPT as a [`UnitModel`]: [`Gpt`] on the candle helper ([`Candle`]), which turns the flat
/// parameter slices into tensors, runs backward and writes the gradients back; in f32 on the fused
/// kernels (the default) the transformer blocks skip candle's graph and run the same kernels on
/// slices (`gpt_block`), with the same bits.
pub struct GptModel {
    inner: Candle<Gpt>,
    /// Blocks on `gpt_block` rather than through candle's graph.
    direct_blocks: bool,
}

impl GptModel {
    /// A GPT computing in f32.
    pub fn new(config: GptConfig) -> Result<Self, ModelError> {
        Self::with_dtype(config, DType::F32)
    }

    /// A GPT computing in `dtype` (F32 or F64); parameters and gradients stay `f32` slices at the
    /// interface. F64 exists for finite-difference gradient checks.
    #[doc(hidden)]
    pub(crate) fn with_dtype(config: GptConfig, dtype: DType) -> Result<Self, ModelError> {
        Self::with_options(config, dtype, true)
    }

    /// As [`Self::with_dtype`], choosing between the fused kernels (`fused`, the default, fast)
    /// and the composite candle ops (the reference the fused kernels are tested against).
    #[doc(hidden)]
    pub fn with_options(config: GptConfig, dtype: DType, fused: bool) -> Result<Self, ModelError> {
        Ok(Self {
            inner: Candle::new(Gpt::with_options(config, dtype, fused)?),
            direct_blocks: fused && dtype == DType::F32,
        })
    }

    /// The ops a GPU runs ([`Gpt::on_device`] on a GPU: candle's products and attention, the
    /// LayerNorm, GELU and causal softmax custom ops), through candle's graph on the CPU, where
    /// those three run their CPU implementations: the GPU's graph, checked without a GPU.
    #[doc(hidden)]
    pub fn with_gpu_ops(config: GptConfig) -> Result<Self, ModelError> {
        let mut gpt = Gpt::with_options(config, DType::F32, false)?;
        gpt.cuda_kernels = true;
        Ok(Self {
            inner: Candle::new(gpt),
            direct_blocks: false,
        })
    }

    /// A GPT on `device` (a GPU from [`super::candle_device`], or the CPU) computing in `dtype`
    /// ([`super::compute_dtype`]): on a GPU every unit runs candle's graph (candle's ops and
    /// zerodp's CUDA kernels).
    pub fn on_device(config: GptConfig, dtype: DType, device: Device) -> Result<Self, ModelError> {
        let direct_blocks = device.is_cpu() && dtype == DType::F32;
        Ok(Self {
            inner: Candle::new(Gpt::on_device(config, dtype, device)?),
            direct_blocks,
        })
    }

    /// Keep each unit's parameters on the device between steps ([`Candle::with_resident_params`]).
    pub fn with_resident_params(mut self, on: bool) -> Self {
        self.inner = self.inner.with_resident_params(on);
        self
    }

    /// Hold the engine's device tier in the device's memory ([`Candle::with_device_tier`]). The
    /// blocks then run through candle's graph on the tier's parameters (on the CPU too, where
    /// they would otherwise run on slices, `gpt_block`).
    pub fn with_device_tier(mut self, on: bool) -> Self {
        self.inner = self.inner.with_device_tier(on);
        self.direct_blocks &= !on;
        self
    }

    /// As [`Self::new`], with the blocks through candle's graph (`direct_blocks` false) or on
    /// slices (true, the default): the reference the direct blocks are tested against.
    #[doc(hidden)]
    pub fn with_direct_blocks(config: GptConfig, direct_blocks: bool) -> Result<Self, ModelError> {
        let mut model = Self::new(config)?;
        model.direct_blocks = direct_blocks;
        Ok(model)
    }

    /// Whether unit `unit` runs on `gpt_block`.
    fn runs_direct(&self, unit: usize) -> bool {
        self.direct_blocks && matches!(self.gpt().kind(unit), Ok(UnitKind::Block))
    }

    fn block_shape(&self, batch: &TokenBatch) -> BlockShape {
        let c = self.config();
        BlockShape {
            width: c.width,
            heads: c.heads,
            batch: batch.batch_size,
            seq: batch.seq_len,
            eps: self.config().eps(),
            mlp: self.config().mlp(),
            segments: (!batch.segment_starts.is_empty()).then(|| {
                let s = super::attention::Segments::new(&batch.segment_starts, batch.seq_len);
                std::sync::Arc::new(s)
            }),
        }
    }

    pub fn config(&self) -> &GptConfig {
        self.inner.units().config()
    }

    /// The GPT's units, as the candle helper sees them.
    pub fn gpt(&self) -> &Gpt {
        self.inner.units()
    }

    /// The GPT on the candle helper (what this type delegates to).
    pub fn candle(&self) -> &Candle<Gpt> {
        &self.inner
    }

    /// Forward the whole model as one graph and backward once: returns the loss and the gradient
    /// of `loss * loss_weight` per unit (tied contributions summed into unit 0). The reference
    /// that unit-by-unit backward must reproduce.
    #[doc(hidden)]
    pub fn end_to_end(
        &self,
        params: &[&[f32]],
        batch: &TokenBatch,
        loss_weight: f32,
    ) -> Result<(f64, Vec<Vec<f32>>), ModelError> {
        self.inner.end_to_end(params, batch, loss_weight)
    }
}

impl UnitModel for GptModel {
    type Batch = TokenBatch;
    type Act = Tensor;
    type Saved = GptSaved;

    fn spec(&self) -> &ModelSpec {
        self.inner.spec()
    }

    fn batch_counts(&self, batch: &TokenBatch) -> BatchCounts {
        self.inner.batch_counts(batch)
    }

    fn loss_tokens(&self, batch: &TokenBatch) -> usize {
        batch.loss_tokens()
    }

    fn init_params(&self, unit: usize, seed: u64, out: &mut [f32]) {
        self.inner.init_params(unit, seed, out)
    }

    fn forward(
        &self,
        unit: usize,
        params: &[&[f32]],
        input: Option<&Tensor>,
        batch: &TokenBatch,
        mode: ForwardMode,
    ) -> Result<UnitForward<Tensor, GptSaved>, ModelError> {
        if !self.runs_direct(unit) {
            let f = self.inner.forward(unit, params, input, batch, mode)?;
            return Ok(UnitForward {
                output: f.output,
                loss: f.loss,
                saved: f.saved.map(|s| GptSaved(SavedBy::Candle(s))),
            });
        }
        let spec = self.inner.check_call(unit, params, input, batch)?;
        let input =
            input.ok_or_else(|| ModelError::Invalid(format!("unit {} has no input", spec.name)))?;
        let keep = mode == ForwardMode::Train;
        let (output, saved) = gpt_block::forward(self.block_shape(batch), params[0], input, keep)
            .map_err(compute_err(&spec.name))?;
        Ok(UnitForward {
            output: Some(output),
            loss: None,
            saved: saved.map(|saved| {
                GptSaved(SavedBy::Block {
                    unit,
                    saved: Box::new(saved),
                })
            }),
        })
    }

    fn parameters_changed(&self) {
        self.inner.parameters_changed()
    }

    fn device_tier(&self) -> Option<&dyn crate::zero::DeviceTier> {
        self.inner.device_tier()
    }

    fn backward(
        &self,
        unit: usize,
        saved: GptSaved,
        grad_output: Option<&Tensor>,
        loss_weight: f32,
        grads: &mut [&mut [f32]],
    ) -> Result<Option<Tensor>, ModelError> {
        let (saved_unit, saved) = match saved.0 {
            SavedBy::Candle(s) => {
                return self
                    .inner
                    .backward(unit, s, grad_output, loss_weight, grads)
            }
            SavedBy::Block { unit, saved } => (unit, *saved),
        };
        let name = &self.spec().units[saved_unit].name;
        if saved_unit != unit {
            return Err(ModelError::Invalid(format!(
                "backward of unit {} was given the saved state of unit {name}",
                self.spec().units.get(unit).map_or("?", |u| u.name.as_str())
            )));
        }
        let grad_output = grad_output.ok_or_else(|| {
            ModelError::Invalid(format!(
                "backward of unit {name} needs the gradient of its output"
            ))
        })?;
        let Some(own) = grads.first_mut() else {
            return Err(ModelError::Invalid(format!(
                "backward of unit {name} was given no gradient slice"
            )));
        };
        gpt_block::backward(saved, grad_output, own)
            .map(Some)
            .map_err(compute_err(name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 4 sequences of 16 byte tokens, each target the next token.
    fn byte_batch() -> TokenBatch {
        let ids: Vec<u32> = (0..65u32).map(|i| (i * 37 + 11) % 256).collect();
        let tokens = ids[..64].to_vec();
        let targets = ids[1..].to_vec();
        TokenBatch {
            tokens,
            targets,
            batch_size: 4,
            seq_len: 16,
            segment_starts: Vec::new(),
        }
    }

    /// A GPU's 16-bit composite ops, run on candle's CPU backend: every dtype meets (masks, norms
    /// and softmax in f32, the loss in f32), and the loss and gradients follow the f32 model's.
    #[test]
    fn the_16_bit_composite_ops_agree_with_f32() {
        let batch = byte_batch();
        let f32_model =
            Candle::new(Gpt::build_any(GptConfig::tiny(), DType::F32, false, Device::Cpu).unwrap());
        let params: Vec<Vec<f32>> = (0..f32_model.units().spec().units.len())
            .map(|u| {
                let mut p = vec![0.0; f32_model.units().spec().units[u].numel()];
                f32_model.units().init_params(u, 3, &mut p);
                p
            })
            .collect();
        let slices: Vec<&[f32]> = params.iter().map(Vec::as_slice).collect();
        let (want, want_grads) = f32_model.end_to_end(&slices, &batch, 1.0).unwrap();
        for dtype in [DType::BF16, DType::F16] {
            let half =
                Candle::new(Gpt::build_any(GptConfig::tiny(), dtype, false, Device::Cpu).unwrap());
            let got = half.end_to_end(&slices, &batch, 1.0).unwrap();
            super::super::compute::assert_follows_f32(
                &format!("{dtype:?}"),
                (got.0, &got.1),
                (want, &want_grads),
            );
        }
    }
}
