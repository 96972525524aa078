//! The Llama-family decoder's generation step over a KV cache ([`crate::model::generate`]): the
//! same norms, products, rotary tables and gate as its training forward (composite ops),
//! grouped-query attention over the cached keys, within the layer's window where it has one.

use super::Llama;
use crate::model::generate::{cached_attention, KvCache};
use candle_core::Tensor;

impl Llama {
    /// Logits `[1, vocab]` after `tokens`, which follow the `cache.len()` positions cached.
    /// `w`: each unit's tensors as its forward reads them.
    pub(crate) fn decode_step(
        &self,
        w: &[Vec<Tensor>],
        tokens: &[u32],
        cache: &mut KvCache,
    ) -> candle_core::Result<Tensor> {
        let (n, pos) = (tokens.len(), cache.len());
        let ids = Tensor::from_slice(tokens, n, &self.device)?;
        let mut x = w[0][0].index_select(&ids, 0)?;
        if self.config.embed_scale {
            x = (x * self.embed_scale()?)?;
        }
        let rope = self.rope_tables_at(pos, n)?;
        for layer in 0..self.config.layers {
            x = self.decode_layer(&x, &w[layer + 1], layer, (&rope, cache))?;
        }
        let head = &w[self.config.layers + 1];
        let last = x.narrow(0, n - 1, 1)?.contiguous()?;
        let h = self.rms_norm(&last, &head[0])?;
        h.matmul(&head[1].t()?)
    }

    /// One decoder layer on the `n` new rows `x [n, hidden]`; their keys and values join the
    /// cache of `layer`.
    fn decode_layer(
        &self,
        x: &Tensor,
        p: &[Tensor],
        layer: usize,
        ((cos, sin), cache): (&(Tensor, Tensor), &mut KvCache),
    ) -> candle_core::Result<Tensor> {
        let (c, s) = (&self.config, &self.slots);
        let (nh, nkv, d, n) = (c.heads, c.kv_heads, c.head_dim, x.dim(0)?);
        let h = self.rms_norm(x, &p[s.input_norm])?;
        let q = self.head_norm(Self::linear(&h, p, s.q)?, s.q_norm.map(|w| &p[w]), nh)?;
        let k = self.head_norm(Self::linear(&h, p, s.k)?, s.k_norm.map(|w| &p[w]), nkv)?;
        let q = Self::rotate(&Self::heads_of(&q, 1, n, nh, d)?, cos, sin)?;
        let k = Self::rotate(&Self::heads_of(&k, 1, n, nkv, d)?, cos, sin)?;
        let v = Self::heads_of(&Self::linear(&h, p, s.v)?, 1, n, nkv, d)?;
        let (k, v) = cache.append(layer, k, v)?;
        let l = k.dim(2)?;
        // Each key/value head serves `nh / nkv` consecutive query heads (transformers' repeat_kv).
        let repeat = |x: Tensor| -> candle_core::Result<Tensor> {
            x.unsqueeze(2)?
                .broadcast_as((1, nkv, nh / nkv, l, d))?
                .reshape((1, nh, l, d))
        };
        let att = cached_attention(&q, &repeat(k)?, &repeat(v)?, c.window_of(layer))?;
        let x = (x + Self::linear(&att, p, s.o)?)?;
        let h = self.rms_norm(&x, &p[s.post_norm])?;
        let (gate, up) = (Self::linear(&h, p, s.gate)?, Self::linear(&h, p, s.up)?);
        let gated = self.gated(gate, up)?;
        x + Self::linear(&gated, p, s.down)?
    }
}
