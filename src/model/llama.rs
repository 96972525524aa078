//! A Llama (`LlamaForCausalLM`) on the candle helper: RMSNorm, rotary position embeddings,
//! grouped-query attention, a SwiGLU MLP, a tied or untied LM head; and the families on its
//! decoder, which differ in the config's fields only (Qwen2's q, k and v biases, Qwen3's query
//! and key norms, Llama's optional attention and MLP biases: [`super::hf::Family`]). Read from a
//! Hugging Face config ([`LlamaConfig::from_hf_json`]) with Hugging Face's parameter names, so that
//! [`super::hf::load_weights`] reads a directory's weights as they are (Llama's projections are
//! `torch.nn.Linear`, `[out, in]`: nothing is transposed).
//!
//! # Units
//! | unit | name | owns |
//! | --- | --- | --- |
//! | 0 | `embeddings` | `model.embed_tokens.weight` `[V, C]` |
//! | 1..=L | `model.layers.{i}` | `input_layernorm.weight`, `self_attn.{q,k,v,o}_proj.weight` (each `.bias` after its weight where the config has one), `self_attn.{q,k}_norm.weight` (Qwen3), `post_attention_layernorm.weight`, `mlp.{gate,up,down}_proj.weight` (and biases) |
//! | L+1 | `head` | `model.norm.weight`, and `lm_head.weight` `[V, C]` when untied (tied: `uses = [0]`) |
//!
//! The math is `transformers`' `modeling_llama.py`: RMSNorm as `w * (x * rsqrt(mean(x²) + eps))`,
//! the rotary embedding as `x * cos + rotate_half(x) * sin` with the frequencies repeated over both
//! halves, each key/value head shared by `heads / kv_heads` consecutive query heads. On the CPU it
//! runs on fused kernels with their backward on the rayon pool (`ops::llama`: bias-free
//! products on the GPT's GEMM paths, AMX included, RMSNorm, rotary embeddings, SwiGLU's gate; the
//! GPT's causal attention on the rotated queries and the repeated keys and values; the GPT's
//! chunked head loss, so that a large vocabulary's logits are never held whole). On a GPU, and as
//! the reference the fused path is tested against ([`Llama::composite`]), it runs on composite
//! candle ops with candle's autograd.

use candle_core::{DType, Device, Tensor, D};

use super::candle_unit::CandleUnits;

mod decode;
use super::hf::{LlamaConfig, MlpAct};
use super::ops;
use crate::data::TokenBatch;
use crate::rng::{fill_normal, mix_seed};
use crate::zero::unit::{BatchCounts, ModelError, ModelSpec, ParamSpec, UnitSpec};

fn param(name: String, shape: &[usize]) -> ParamSpec {
    ParamSpec {
        name,
        shape: shape.to_vec(),
    }
}

/// A Llama's units as candle compute; wrap it in [`super::Candle`] for the engine.
pub struct Llama {
    config: LlamaConfig,
    spec: ModelSpec,
    /// Where each tensor of a decoder layer sits among its unit's parameters.
    slots: Box<LayerSlots>,
    device: Device,
    /// The compute dtype: f32 on the CPU, f32 or 16-bit on a GPU ([`super::compute_dtype`]).
    dtype: DType,
    /// On the fused CPU kernels ([`super::ops`]: products, RMSNorm, rotary embeddings, SwiGLU,
    /// the GPT's causal attention, the chunked head loss); else on composite candle ops (a GPU,
    /// and the reference the fused path is tested against).
    fused: bool,
    /// On composite ops, RMSNorm, the rotary embeddings, SwiGLU's gate and the causal softmax
    /// as zerodp's custom ops (their CUDA kernels on a GPU, [`super::compute::uses_cuda_kernels`]).
    cuda_kernels: bool,
    /// The rotary op of the last sequence length ([`Self::cached_rope_op`]).
    rope: std::sync::Mutex<Option<ops::Rope>>,
}

impl Llama {
    pub fn new(config: LlamaConfig) -> Result<Self, ModelError> {
        let c = &config;
        for (name, v) in [
            ("vocab_size", c.vocab_size),
            ("hidden_size", c.hidden),
            ("num_hidden_layers", c.layers),
            ("num_key_value_heads", c.kv_heads),
        ] {
            if v == 0 {
                return Err(ModelError::Invalid(format!(
                    "Llama {name} must be at least 1"
                )));
            }
        }
        let spec = llama_spec(c);
        let slots = Box::new(layer_params(c).1);
        Ok(Llama {
            config,
            spec,
            slots,
            device: Device::Cpu,
            dtype: DType::F32,
            fused: true,
            cuda_kernels: false,
            rope: std::sync::Mutex::new(None),
        })
    }

    /// The same model on composite candle ops (the reference the fused kernels are tested
    /// against; what a GPU runs).
    #[doc(hidden)]
    pub fn composite(mut self) -> Self {
        self.fused = false;
        self
    }

    /// The ops a GPU runs (composite products and attention around the RMSNorm, rotary, SwiGLU
    /// and causal softmax custom ops), through candle's graph on the CPU, where those run their
    /// CPU implementations: the GPU's graph, checked without a GPU.
    #[doc(hidden)]
    pub fn with_gpu_ops(mut self) -> Self {
        self.fused = false;
        self.cuda_kernels = true;
        self
    }

    /// The same model computing on `device` in `dtype` (f32 on the CPU; f32, bf16 or f16 on a GPU).
    pub fn on_device(mut self, device: Device, dtype: DType) -> Result<Self, ModelError> {
        let allowed = match device {
            Device::Cpu => dtype == DType::F32,
            _ => matches!(dtype, DType::F32 | DType::BF16 | DType::F16),
        };
        if !allowed {
            return Err(ModelError::Invalid(format!(
                "Llama compute dtype must be F32 on the CPU, F32, BF16 or F16 on a GPU; got \
                 {dtype:?} on {device:?}"
            )));
        }
        self.fused = device.is_cpu();
        self.cuda_kernels = super::compute::uses_cuda_kernels(&device);
        self.device = device;
        self.dtype = dtype;
        Ok(self)
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }
}

/// Where each tensor of a decoder layer sits among its unit's parameters: the biases and the
/// query and key norms only where the config has them, each bias right after its weight.
#[derive(Clone, Copy, Debug)]
struct LayerSlots {
    input_norm: usize,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Option<usize>,
    k_norm: Option<usize>,
    post_norm: usize,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// A decoder layer's parameters as they are listed: names after `model.layers.{i}.`, shapes.
#[derive(Default)]
struct LayerList(Vec<(&'static str, Vec<usize>)>);

impl LayerList {
    fn push(&mut self, name: &'static str, shape: &[usize]) -> usize {
        self.0.push((name, shape.to_vec()));
        self.0.len() - 1
    }

    /// A weight `[out, in]` and, where the config has one, its bias `[out]` right after it
    /// (`names`: the weight's, the bias's).
    fn linear(
        &mut self,
        names: [&'static str; 2],
        (out, inp): (usize, usize),
        bias: bool,
    ) -> Linear {
        let w = self.push(names[0], &[out, inp]);
        (w, bias.then(|| self.push(names[1], &[out])))
    }
}

/// A projection's slots: its weight and its bias, if any.
type Linear = (usize, Option<usize>);

/// A decoder layer's parameters and their slots, in the order the unit has always stored them
/// (checkpoints keep it), the optional ones inserted.
fn layer_params(c: &LlamaConfig) -> (LayerList, LayerSlots) {
    let (h, q, kv, i, d) = (
        c.hidden,
        c.heads * c.head_dim,
        c.kv_heads * c.head_dim,
        c.intermediate,
        c.head_dim,
    );
    let mut l = LayerList::default();
    let input_norm = l.push("input_layernorm.weight", &[h]);
    let q_slots = l.linear(
        ["self_attn.q_proj.weight", "self_attn.q_proj.bias"],
        (q, h),
        c.qkv_bias,
    );
    let k_slots = l.linear(
        ["self_attn.k_proj.weight", "self_attn.k_proj.bias"],
        (kv, h),
        c.qkv_bias,
    );
    let v_slots = l.linear(
        ["self_attn.v_proj.weight", "self_attn.v_proj.bias"],
        (kv, h),
        c.qkv_bias,
    );
    let o_slots = l.linear(
        ["self_attn.o_proj.weight", "self_attn.o_proj.bias"],
        (h, q),
        c.o_bias,
    );
    let q_norm = c.qk_norm.then(|| l.push("self_attn.q_norm.weight", &[d]));
    let k_norm = c.qk_norm.then(|| l.push("self_attn.k_norm.weight", &[d]));
    let post_norm = l.push("post_attention_layernorm.weight", &[h]);
    let slots = LayerSlots {
        input_norm,
        q: q_slots,
        k: k_slots,
        v: v_slots,
        o: o_slots,
        q_norm,
        k_norm,
        post_norm,
        gate: l.linear(
            ["mlp.gate_proj.weight", "mlp.gate_proj.bias"],
            (i, h),
            c.mlp_bias,
        ),
        up: l.linear(
            ["mlp.up_proj.weight", "mlp.up_proj.bias"],
            (i, h),
            c.mlp_bias,
        ),
        down: l.linear(
            ["mlp.down_proj.weight", "mlp.down_proj.bias"],
            (h, i),
            c.mlp_bias,
        ),
    };
    (l, slots)
}

/// The units and their parameters, in Hugging Face's names.
fn llama_spec(c: &LlamaConfig) -> ModelSpec {
    let h = c.hidden;
    let mut units = vec![UnitSpec {
        name: "embeddings".into(),
        params: vec![param(
            "model.embed_tokens.weight".into(),
            &[c.vocab_size, h],
        )],
        uses: vec![],
    }];
    let (layer, _) = layer_params(c);
    for l in 0..c.layers {
        units.push(UnitSpec {
            name: format!("model.layers.{l}"),
            params: (layer.0.iter())
                .map(|(name, shape)| param(format!("model.layers.{l}.{name}"), shape))
                .collect(),
            uses: vec![],
        });
    }
    let mut head = vec![param("model.norm.weight".into(), &[h])];
    if !c.tied {
        head.push(param("lm_head.weight".into(), &[c.vocab_size, h]));
    }
    units.push(UnitSpec {
        name: "head".into(),
        params: head,
        uses: if c.tied { vec![0] } else { vec![] },
    });
    ModelSpec { units }
}

impl Llama {
    /// `w * (x * rsqrt(mean(x²) + eps))` over the last dimension.
    /// In a 16-bit run (a GPU) the statistics and the normalised rows in f32, rounded back before
    /// the weight, as transformers' `LlamaRMSNorm` computes it.
    /// Gemma's (`norm_offset`) scales by `1 + weight` in f32 before the rounding instead.
    fn rms_norm(&self, x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
        if self.cuda_kernels {
            let norm = ops::RmsNorm {
                eps: self.config.rms_eps,
            };
            return x.contiguous()?.apply_op2(&self.norm_weight(w)?, norm);
        }
        let x32 = match super::compute::is_16_bit(self.dtype) {
            true => x.to_dtype(DType::F32)?,
            false => x.clone(),
        };
        let ms = x32.sqr()?.mean_keepdim(D::Minus1)?;
        let inv = (ms + self.config.rms_eps)?.sqrt()?.recip()?;
        let normed = x32.broadcast_mul(&inv)?;
        match self.config.norm_offset {
            true => {
                let scale = (w.to_dtype(DType::F32)? + 1.0)?;
                normed.broadcast_mul(&scale)?.to_dtype(self.dtype)
            }
            false => normed.to_dtype(self.dtype)?.broadcast_mul(w),
        }
    }

    /// The looked-up rows `x` with the rows of `pad_token_id` cut from the graph, so that they
    /// train no embedding (`torch.nn.Embedding`'s `padding_idx`).
    fn without_padding_grads(&self, x: Tensor, tokens: &[u32]) -> candle_core::Result<Tensor> {
        let Some(pad) = self.config.padding_idx.filter(|p| tokens.contains(p)) else {
            return Ok(x);
        };
        let is_pad: Vec<u8> = tokens.iter().map(|&t| u8::from(t == pad)).collect();
        let mask = Tensor::from_vec(is_pad, (tokens.len(), 1), &self.device)?;
        mask.broadcast_as(x.shape())?.where_cond(&x.detach(), &x)
    }

    /// `sqrt(hidden_size)` as f32, rounded to the compute dtype (transformers' `embed_scale`).
    fn embed_scale(&self) -> candle_core::Result<f64> {
        let scale = (self.config.hidden as f64).sqrt() as f32;
        Tensor::new(scale, &Device::Cpu)?
            .to_dtype(self.dtype)?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()
    }

    /// The rotary frequencies, in f32 as the tables are computed.
    fn inv_freq(&self) -> Vec<f32> {
        (self.config.rope_scaling)
            .inv_freq(self.config.rope_theta, self.config.head_dim)
            .into_iter()
            .map(|f| f as f32)
            .collect()
    }

    /// The fused rotary op for sequences of `t`: the same angles and cosines as
    /// [`Self::rope_tables`], each frequency once.
    fn rope_op(&self, t: usize) -> ops::Rope {
        let inv = self.inv_freq();
        let angles: Vec<f32> = (0..t)
            .flat_map(|pos| inv.iter().map(move |f| pos as f32 * f))
            .collect();
        let scale = self.config.rope_scaling.attention_factor() as f32;
        ops::Rope::new(
            t,
            self.config.head_dim,
            angles.iter().map(|a| a.cos() * scale).collect(),
            angles.iter().map(|a| a.sin() * scale).collect(),
        )
    }

    /// [`Self::rope_op`] for sequences of `t`, kept from the last call of the same length: its
    /// tables are computed once (and, on a GPU, copied there once), not in every block.
    fn cached_rope_op(&self, t: usize) -> ops::Rope {
        let mut kept = self.rope.lock().unwrap_or_else(|e| e.into_inner());
        match &*kept {
            Some(op) if op.seq == t => op.clone(),
            _ => {
                let op = self.rope_op(t);
                *kept = Some(op.clone());
                op
            }
        }
    }

    /// A decoder layer on the fused kernels: the same math as [`Self::block`].
    fn block_fused(
        &self,
        x: &Tensor,
        p: &[Tensor],
        batch: &TokenBatch,
        window: Option<usize>,
    ) -> candle_core::Result<Tensor> {
        let (b, t) = (batch.batch_size, batch.seq_len);
        let (c, s) = (&self.config, &self.slots);
        let norm = ops::RmsNorm { eps: c.rms_eps };
        let linear = |x: &Tensor, (w, bias): Linear| -> candle_core::Result<Tensor> {
            let y = x.contiguous()?.apply_op2(&p[w], ops::MatMulT)?;
            match bias {
                Some(bias) => y.broadcast_add(&p[bias]),
                None => Ok(y),
            }
        };
        let x = x.contiguous()?;
        let h = x.apply_op2(&self.norm_weight(&p[s.input_norm])?, norm)?;
        let mut rope = self.cached_rope_op(t);
        // Packed rows: each token rotated by its position in its own sequence.
        rope.positions = batch.positions().map(std::sync::Arc::new);
        let q = self.head_norm(linear(&h, s.q)?, s.q_norm.map(|w| &p[w]), c.heads)?;
        let k = self.head_norm(linear(&h, s.k)?, s.k_norm.map(|w| &p[w]), c.kv_heads)?;
        let q = q.apply_op1(rope.clone())?;
        let k = k.apply_op1(rope)?;
        // The kernel reads each key/value head for its group of query heads: no repeated copies.
        let qkv = Tensor::cat(&[&q, &k, &linear(&h, s.v)?], 1)?;
        let attention = ops::CausalAttention::new(b, t, c.heads, window)
            .with_kv_heads(c.kv_heads)
            .with_segments(&batch.segment_starts);
        let x = (&x + linear(&qkv.apply_op1(attention)?, s.o)?)?;
        let h = x.apply_op2(&self.norm_weight(&p[s.post_norm])?, norm)?;
        let gated = self.gated(linear(&h, s.gate)?, linear(&h, s.up)?)?;
        &x + linear(&gated, s.down)?
    }

    /// The MLP's gate applied: `silu(gate) * up` (the fused SwiGLU op where the path has it) or
    /// Gemma's `gelu_tanh(gate) * up` (the fused GeGLU op on the CPU).
    fn gated(&self, gate: Tensor, up: Tensor) -> candle_core::Result<Tensor> {
        match self.config.mlp_act {
            MlpAct::Silu if self.fused || self.cuda_kernels => {
                gate.apply_op2(&up, ops::Gated::SwiGlu)
            }
            MlpAct::Silu => candle_nn::ops::silu(&gate)? * up,
            MlpAct::GeluTanh if self.fused => gate.apply_op2(&up, ops::Gated::GeGlu),
            MlpAct::GeluTanh => gate.gelu()? * up,
        }
    }

    /// An RMSNorm's weight as it scales: the stored weight, or Gemma's `1 + weight`.
    fn norm_weight(&self, w: &Tensor) -> candle_core::Result<Tensor> {
        match self.config.norm_offset {
            true => w + 1.0,
            false => Ok(w.clone()),
        }
    }

    /// Qwen3's RMSNorm of each head's `head_dim` values (`[rows, n*d]` rows of `n` heads), where
    /// the config has it (`w`: the norm's weight `[d]`); the rows as they are otherwise.
    fn head_norm(&self, x: Tensor, w: Option<&Tensor>, n: usize) -> candle_core::Result<Tensor> {
        let Some(w) = w else {
            return Ok(x);
        };
        let (rows, d) = (x.dim(0)?, self.config.head_dim);
        let heads = x.contiguous()?.reshape((rows * n, d))?;
        let normed = match self.fused || self.cuda_kernels {
            true => heads.apply_op2(
                w,
                ops::RmsNorm {
                    eps: self.config.rms_eps,
                },
            )?,
            false => self.rms_norm(&heads, w)?,
        };
        normed.reshape((rows, n * d))
    }

    /// `cos` and `sin` `[t, head_dim]` of positions `0..t` (frequencies repeated over both halves).
    fn rope_tables(&self, t: usize) -> candle_core::Result<(Tensor, Tensor)> {
        self.rope_tables_at(0, t)
    }

    /// [`Self::rope_tables`] of positions `start..start + t` (generation's new positions).
    fn rope_tables_at(&self, start: usize, t: usize) -> candle_core::Result<(Tensor, Tensor)> {
        let d = self.config.head_dim;
        let inv = self.inv_freq();
        let mut angles = Vec::with_capacity(t * d);
        for pos in start..start + t {
            let row: Vec<f32> = inv.iter().map(|f| pos as f32 * f).collect();
            angles.extend_from_slice(&row);
            angles.extend_from_slice(&row);
        }
        let a = Tensor::from_vec(angles, (t, d), &self.device)?;
        let scale = self.config.rope_scaling.attention_factor();
        Ok((
            (a.cos()? * scale)?.to_dtype(self.dtype)?,
            (a.sin()? * scale)?.to_dtype(self.dtype)?,
        ))
    }

    /// `x * cos + rotate_half(x) * sin` for `x [b, heads, t, d]`.
    fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
        let d = x.dim(D::Minus1)?;
        let (x1, x2) = (
            x.narrow(D::Minus1, 0, d / 2)?,
            x.narrow(D::Minus1, d / 2, d / 2)?,
        );
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
        x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?
    }

    /// `[b*t, n*d]` rows into `[b, n, t, d]` heads.
    fn heads_of(x: &Tensor, b: usize, t: usize, n: usize, d: usize) -> candle_core::Result<Tensor> {
        x.reshape((b, t, n, d))?.transpose(1, 2)?.contiguous()
    }

    /// Causal grouped-query attention of a block, before the output projection: `[b*t, H*d]`;
    /// with a sliding `window`, each query sees the keys less than `window` positions back.
    fn attention(
        &self,
        h: &Tensor,
        p: &[Tensor],
        (b, t): (usize, usize),
        window: Option<usize>,
    ) -> candle_core::Result<Tensor> {
        let (c, s) = (&self.config, &self.slots);
        let (nh, nkv, d) = (c.heads, c.kv_heads, c.head_dim);
        let q = self.head_norm(Self::linear(h, p, s.q)?, s.q_norm.map(|w| &p[w]), nh)?;
        let k = self.head_norm(Self::linear(h, p, s.k)?, s.k_norm.map(|w| &p[w]), nkv)?;
        let (q, k) = match self.cuda_kernels {
            // The rotary op on the rows, before they become heads.
            true => {
                let rope = self.cached_rope_op(t);
                let q = Self::heads_of(&q.apply_op1(rope.clone())?, b, t, nh, d)?;
                (q, Self::heads_of(&k.apply_op1(rope)?, b, t, nkv, d)?)
            }
            false => {
                let (cos, sin) = self.rope_tables(t)?;
                let q = Self::rotate(&Self::heads_of(&q, b, t, nh, d)?, &cos, &sin)?;
                (
                    q,
                    Self::rotate(&Self::heads_of(&k, b, t, nkv, d)?, &cos, &sin)?,
                )
            }
        };
        let v = Self::heads_of(&Self::linear(h, p, s.v)?, b, t, nkv, d)?;
        // Each key/value head serves `nh / nkv` consecutive query heads (transformers' repeat_kv).
        let repeat = |x: Tensor| -> candle_core::Result<Tensor> {
            x.unsqueeze(2)?
                .broadcast_as((b, nkv, nh / nkv, t, d))?
                .reshape((b, nh, t, d))
        };
        let (k, v) = (repeat(k)?, repeat(v)?);
        let scores = (q.matmul(&k.t()?)? * (1.0 / (d as f64).sqrt()))?;
        // A window shorter than the sequence masks keys the fused softmax would keep.
        let window = window.filter(|&w| w < t);
        let att = if self.cuda_kernels && window.is_none() {
            // The mask and the softmax in one op, in f32 inside (one rounding in 16 bits).
            scores.contiguous()?.apply_op1(ops::CausalSoftmax)?
        } else if super::compute::is_16_bit(self.dtype) {
            // The softmax in f32, as transformers computes it (`dtype=torch.float32`).
            let mask = self.causal_mask(t, window)?.to_dtype(DType::F32)?;
            let scores = scores.to_dtype(DType::F32)?.broadcast_add(&mask)?;
            candle_nn::ops::softmax(&scores, D::Minus1)?.to_dtype(self.dtype)?
        } else {
            let masked = scores.broadcast_add(&self.causal_mask(t, window)?)?;
            candle_nn::ops::softmax(&masked, D::Minus1)?
        };
        att.matmul(&v)?.transpose(1, 2)?.reshape((b * t, nh * d))
    }

    /// `-inf` where query `i` (the row) may not see key `j`: later keys, and with a window those
    /// `window` or more positions back (transformers' `kv_idx > q_idx - sliding_window`).
    fn causal_mask(&self, t: usize, window: Option<usize>) -> candle_core::Result<Tensor> {
        let data: Vec<f32> = (0..t * t)
            .map(|k| {
                let (i, j) = (k / t, k % t);
                let too_far = window.is_some_and(|w| j + w <= i);
                match j > i || too_far {
                    true => f32::NEG_INFINITY,
                    false => 0.0,
                }
            })
            .collect();
        Tensor::from_vec(data, (t, t), &self.device)?.to_dtype(self.dtype)
    }

    /// `x @ w^T (+ bias)` on composite ops.
    fn linear(x: &Tensor, p: &[Tensor], (w, bias): Linear) -> candle_core::Result<Tensor> {
        let y = x.matmul(&p[w].t()?)?;
        match bias {
            Some(bias) => y.broadcast_add(&p[bias]),
            None => Ok(y),
        }
    }

    /// A decoder layer: `x + attn(norm(x))`, then `+ down(silu(gate(h)) * up(h))`.
    fn block(
        &self,
        x: &Tensor,
        p: &[Tensor],
        bt: (usize, usize),
        window: Option<usize>,
    ) -> candle_core::Result<Tensor> {
        let s = &self.slots;
        let h = self.rms_norm(x, &p[s.input_norm])?;
        let x = (x + Self::linear(&self.attention(&h, p, bt, window)?, p, s.o)?)?;
        let h = self.rms_norm(&x, &p[s.post_norm])?;
        let (gate, up) = (Self::linear(&h, p, s.gate)?, Self::linear(&h, p, s.up)?);
        let gated = self.gated(gate, up)?;
        x + Self::linear(&gated, p, s.down)?
    }
}

impl CandleUnits for Llama {
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

    /// Norm weights 1, biases 0, every matrix normal(0, `initializer_range`), as `transformers`
    /// starts one.
    fn init_params(&self, unit: usize, seed: u64, out: &mut [f32]) {
        let spec = &self.spec.units[unit];
        for (k, (p, off)) in spec.params.iter().zip(spec.offsets()).enumerate() {
            let Some(dst) = out.get_mut(off..off + p.numel()) else {
                return;
            };
            if p.name.ends_with(".bias") {
                dst.fill(0.0);
                continue;
            }
            if p.shape.len() == 1 {
                // Gemma's norms scale by 1 + weight: their weights start at 0.
                dst.fill(if self.config.norm_offset { 0.0 } else { 1.0 });
                continue;
            }
            let stream = mix_seed(&[seed, unit as u64, k as u64]);
            fill_normal(dst, stream, self.config.init_std);
        }
    }

    fn forward_unit(
        &self,
        unit: usize,
        p: &[Tensor],
        input: Option<&Tensor>,
        batch: &TokenBatch,
    ) -> candle_core::Result<Tensor> {
        let (b, t) = (batch.batch_size, batch.seq_len);
        if unit == 0 {
            let tokens = Tensor::from_slice(&batch.tokens, b * t, &self.device)?;
            let x = self.without_padding_grads(p[0].index_select(&tokens, 0)?, &batch.tokens)?;
            return match self.config.embed_scale {
                // Gemma's `sqrt(hidden)` as an f32, rounded to the compute dtype as its buffer is.
                true => x * self.embed_scale()?,
                false => Ok(x),
            };
        }
        let x = input.ok_or_else(|| candle_core::Error::Msg("no input activation".into()))?;
        if unit <= self.config.layers {
            let window = self.config.window_of(unit - 1);
            return match self.fused {
                true => self.block_fused(x, p, batch, window),
                false if !batch.segment_starts.is_empty() => candle_core::bail!(
                    "rows packed with several sequences need the fused CPU kernels; this model \
                     runs on composite ops (a GPU)"
                ),
                false => self.block(x, p, (b, t), window),
            };
        }
        if self.fused {
            // The head's norm, then the loss over chunks of rows, never all the logits at once.
            let norm = ops::RmsNorm {
                eps: self.config.rms_eps,
            };
            let h = x.contiguous()?.apply_op2(&self.norm_weight(&p[0])?, norm)?;
            let op = ops::HeadLoss {
                targets: batch.targets.clone(),
            };
            return h.apply_op2(&p[1].contiguous()?, op);
        }
        // The head: own norm, then its own lm_head or (tied) unit 0's embedding.
        let h = self.rms_norm(x, &p[0])?;
        // The softmax of a 16-bit run in f32, as PyTorch's autocast computes its cross-entropy.
        let logits = h.matmul(&p[1].t()?)?.to_dtype(DType::F32)?;
        super::compute::masked_cross_entropy(&logits, &batch.targets)
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn device(&self) -> Device {
        self.device.clone()
    }

    fn check_batch(&self, batch: &TokenBatch) -> Result<(), ModelError> {
        let n = batch.batch_size * batch.seq_len;
        if n == 0 || batch.tokens.len() != n || batch.targets.len() != n {
            return Err(ModelError::Invalid(format!(
                "batch of {} x {} with {} tokens and {} targets",
                batch.batch_size,
                batch.seq_len,
                batch.tokens.len(),
                batch.targets.len()
            )));
        }
        self.config
            .check_seq_len(batch.seq_len)
            .map_err(ModelError::Invalid)?;
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

    fn require_gradients(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Candle;

    /// A GPU's 16-bit composite ops, run on candle's CPU backend: every dtype meets (masks, rotary
    /// tables, norms and softmax in f32, the loss in f32), and the loss and gradients follow the
    /// f32 model's, with grouped-query attention and an untied head.
    #[test]
    fn the_16_bit_composite_ops_agree_with_f32() {
        let json = serde_json::json!({
            "model_type": "llama", "vocab_size": 300, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 32,
            "tie_word_embeddings": false
        });
        let config = LlamaConfig::from_hf_json(&json, std::path::Path::new("config.json")).unwrap();
        let f32_model = Candle::new(Llama::new(config.clone()).unwrap().composite());
        let spec = f32_model.units().spec().clone();
        let params: Vec<Vec<f32>> = (0..spec.units.len())
            .map(|u| {
                let mut p = vec![0.0; spec.units[u].numel()];
                f32_model.units().init_params(u, 3, &mut p);
                p
            })
            .collect();
        let slices: Vec<&[f32]> = params.iter().map(Vec::as_slice).collect();
        let ids: Vec<u32> = (0..65u32).map(|i| (i * 37 + 11) % 300).collect();
        let batch = TokenBatch {
            tokens: ids[..64].to_vec(),
            targets: ids[1..].to_vec(),
            batch_size: 4,
            seq_len: 16,
            segment_starts: Vec::new(),
        };
        let (want, want_grads) = f32_model.end_to_end(&slices, &batch, 1.0).unwrap();
        for dtype in [DType::BF16, DType::F16] {
            let mut half = Llama::new(config.clone()).unwrap().composite();
            half.dtype = dtype;
            let half = Candle::new(half);
            let got = half.end_to_end(&slices, &batch, 1.0).unwrap();
            super::super::compute::assert_follows_f32(
                &format!("{dtype:?}"),
                (got.0, &got.1),
                (want, &want_grads),
            );
        }
    }
}
