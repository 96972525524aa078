//! Text generation: a causal LM run forward over a cache of each layer's keys and values, so that
//! each new token costs one position's compute, not the whole sequence's again.
//!
//! The prompt goes through in one pass (its keys and values fill the cache), then one token a
//! step. Each architecture's step is its own (`gpt/decode.rs`, `llama/decode.rs`),
//! on the same weights and the same norms, products and rotary tables as training; what they
//! share is here: the cache, the attention of new queries over the cached keys (causal, with a
//! sliding window where the layer has one) and the choice of the next token ([`Sampler`]:
//! greedy, or temperature, top-k and top-p from a seeded stream, as transformers' `generate`
//! applies them).

use super::train_model::TrainModel;
use crate::rng::SplitMix64;
use crate::zero::unit::{ModelError, ModelSpec};
use candle_core::{DType, Device, Tensor, D};
use std::time::Instant;

/// Each layer's keys and values so far, `[1, kv_heads, positions, head_dim]`.
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    len: usize,
}

impl KvCache {
    pub fn new(layers: usize) -> Self {
        KvCache {
            layers: (0..layers).map(|_| None).collect(),
            len: 0,
        }
    }

    /// Positions cached (the same in every layer once a step is done).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends layer `layer`'s new keys and values (`[1, heads, n, d]`) and returns all of them.
    pub(crate) fn append(
        &mut self,
        layer: usize,
        k: Tensor,
        v: Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let all = match self.layers[layer].take() {
            None => (k, v),
            Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 2)?, Tensor::cat(&[&pv, &v], 2)?),
        };
        self.layers[layer] = Some(all.clone());
        Ok(all)
    }

    /// Ends a step of `n` new positions.
    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }
}

/// Attention of `n` new queries `q [1, H, n, d]` over every cached key and value
/// (`[1, H, L, d]`, the new ones last): query `i` sits at position `L - n + i` and sees the keys
/// at or before it, and with a `window` only the `window` latest of them. The softmax in f32.
/// Returns `[n, H * d]`.
pub(crate) fn cached_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    window: Option<usize>,
) -> candle_core::Result<Tensor> {
    let (_, h, n, d) = q.dims4()?;
    let l = k.dim(2)?;
    let start = l - n;
    let mask: Vec<f32> = (0..n * l)
        .map(|x| {
            let (i, j) = (start + x / l, x % l);
            let hidden = j > i || window.is_some_and(|w| j + w <= i);
            if hidden {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, (n, l), q.device())?;
    let scores = (q.matmul(&k.t()?)? * (1.0 / (d as f64).sqrt()))?;
    let scores = scores.to_dtype(DType::F32)?.broadcast_add(&mask)?;
    let att = candle_nn::ops::softmax(&scores, D::Minus1)?.to_dtype(v.dtype())?;
    att.matmul(v)?.transpose(1, 2)?.reshape((n, h * d))
}

/// Every unit's parameters as tensors in the order its forward reads them: its own (the
/// [`ModelSpec`] order), then those of the units it uses.
pub struct UnitTensors(pub(crate) Vec<Vec<Tensor>>);

impl UnitTensors {
    /// From each unit's flat f32 values (unpadded, as [`crate::trainer::TrainOutcome::params`]
    /// and the weight loaders give them).
    pub fn new(
        spec: &ModelSpec,
        weights: &[Vec<f32>],
        (device, dtype): (&Device, DType),
    ) -> Result<Self, ModelError> {
        let err = |e: candle_core::Error| ModelError::Invalid(format!("weights: {e}"));
        if weights.len() != spec.units.len() {
            return Err(ModelError::Invalid(format!(
                "{} units of weights for a model of {}",
                weights.len(),
                spec.units.len()
            )));
        }
        let mut own = Vec::with_capacity(spec.units.len());
        for (unit, values) in spec.units.iter().zip(weights) {
            if values.len() != unit.numel() {
                return Err(ModelError::Invalid(format!(
                    "unit {}: {} weights for {} parameters",
                    unit.name,
                    values.len(),
                    unit.numel()
                )));
            }
            let tensors = unit.params.iter().zip(unit.offsets()).map(|(p, at)| {
                Tensor::from_slice(&values[at..at + p.numel()], p.shape.as_slice(), device)?
                    .to_dtype(dtype)
            });
            own.push(
                tensors
                    .collect::<candle_core::Result<Vec<_>>>()
                    .map_err(err)?,
            );
        }
        let with_uses = spec.units.iter().enumerate().map(|(u, unit)| {
            let mut t = own[u].clone();
            t.extend(unit.uses.iter().flat_map(|&k| own[k].iter().cloned()));
            t
        });
        Ok(UnitTensors(with_uses.collect()))
    }
}

/// How the next token is chosen.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    /// 0 is greedy (the most likely token, the first of equals); otherwise the logits are divided
    /// by it before the softmax.
    pub temperature: f32,
    /// Only the `k` most likely tokens are drawn from.
    pub top_k: Option<usize>,
    /// Only the smallest set of most likely tokens whose probabilities reach `p`.
    pub top_p: Option<f32>,
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
        }
    }
}

/// Picks next tokens from logits (see [`Sampling`]); seeded, so a run repeats.
pub struct Sampler {
    sampling: Sampling,
    rng: SplitMix64,
}

impl Sampler {
    pub fn new(sampling: Sampling) -> Self {
        let rng = SplitMix64::new(sampling.seed);
        Sampler { sampling, rng }
    }

    /// The next token of `logits` (one per vocabulary entry).
    pub fn pick(&mut self, logits: &[f32]) -> u32 {
        let s = &self.sampling;
        if s.temperature <= 0.0 {
            let best = (0..logits.len()).fold(0, |b, i| if logits[i] > logits[b] { i } else { b });
            return best as u32;
        }
        let mut order: Vec<usize> = (0..logits.len()).collect();
        // Most likely first; equal logits keep their ids' order.
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        order.truncate(s.top_k.unwrap_or(order.len()).max(1));
        let top = f64::from(logits[order[0]]);
        let t = f64::from(s.temperature);
        let mut probs: Vec<f64> = order
            .iter()
            .map(|&i| ((f64::from(logits[i]) - top) / t).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        if let Some(p) = s.top_p {
            // Keep tokens while the mass before them is below p (the first always).
            let mut mass = 0.0;
            let keep = probs
                .iter()
                .take_while(|&&q| {
                    let before = mass;
                    mass += q;
                    before < f64::from(p)
                })
                .count();
            probs.truncate(keep.max(1));
        }
        let total: f64 = probs.iter().sum();
        let u = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
        let mut acc = 0.0;
        for (k, q) in probs.iter().enumerate() {
            acc += q;
            if u < acc {
                return order[k] as u32;
            }
        }
        order[probs.len() - 1] as u32
    }
}

/// What a generation does.
#[derive(Clone, Debug, Default)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    pub sampling: Sampling,
    /// Tokens that end the text (EOS, end of turn); the one met is not part of it.
    pub stop: Vec<u32>,
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// A stop token came (the token).
    Stop(u32),
    /// `max_new_tokens` were written.
    Length,
    /// The model's positions ran out.
    Context,
    /// The caller's `on_token` asked to stop.
    Caller,
}

/// A generation's tokens and timings.
#[derive(Clone, Debug)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub ended: Ended,
    /// The prompt's pass, and the steps of the tokens after the first.
    pub prompt_s: f64,
    pub decode_s: f64,
}

impl TrainModel {
    /// The most positions the model can attend over.
    pub fn max_positions(&self) -> usize {
        match self {
            TrainModel::Gpt(m) => m.config().context,
            TrainModel::Llama(m) => m.units().config().context,
        }
    }

    /// Logits `[vocab]` (f32) after `tokens`, which follow what `cache` holds; their keys and
    /// values join it.
    pub fn decode_step(
        &self,
        w: &UnitTensors,
        tokens: &[u32],
        cache: &mut KvCache,
    ) -> Result<Vec<f32>, ModelError> {
        let logits = match self {
            TrainModel::Gpt(m) => m.gpt().decode_step(&w.0, tokens, cache),
            TrainModel::Llama(m) => m.units().decode_step(&w.0, tokens, cache),
        };
        let logits = logits.and_then(|l| l.to_dtype(DType::F32)?.flatten_all()?.to_vec1());
        cache.advance(tokens.len());
        logits.map_err(|e| ModelError::Invalid(format!("generation: {e}")))
    }

    /// Continues `prompt` (at least one token): each new token goes to `on_token`, which returns
    /// false to stop.
    pub fn generate(
        &self,
        w: &UnitTensors,
        prompt: &[u32],
        options: &GenerateOptions,
        mut on_token: impl FnMut(u32) -> bool,
    ) -> Result<Generation, ModelError> {
        let room = self.max_positions();
        if prompt.is_empty() || prompt.len() >= room {
            return Err(ModelError::Invalid(format!(
                "a prompt of {} tokens: the model attends over {room} positions, so the prompt \
                 needs 1 to {} tokens",
                prompt.len(),
                room - 1
            )));
        }
        let mut cache = KvCache::new(self.num_layers());
        let mut sampler = Sampler::new(options.sampling.clone());
        let t = Instant::now();
        let mut logits = self.decode_step(w, prompt, &mut cache)?;
        let prompt_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut tokens = Vec::new();
        let ended = loop {
            if tokens.len() == options.max_new_tokens {
                break Ended::Length;
            }
            let next = sampler.pick(&logits);
            if options.stop.contains(&next) {
                break Ended::Stop(next);
            }
            tokens.push(next);
            if !on_token(next) {
                break Ended::Caller;
            }
            if cache.len() == room {
                break Ended::Context;
            }
            logits = self.decode_step(w, &[next], &mut cache)?;
        };
        Ok(Generation {
            tokens,
            ended,
            prompt_s,
            decode_s: t.elapsed().as_secs_f64(),
        })
    }

    fn num_layers(&self) -> usize {
        match self {
            TrainModel::Gpt(m) => m.config().layers,
            TrainModel::Llama(m) => m.units().config().layers,
        }
    }
}
