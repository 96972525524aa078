//! The GPT's generation step over a KV cache ([`crate::model::generate`]): the same norms,
//! products and GELU as its training forward, attention over the cached keys.

use super::Gpt;
use crate::model::generate::{cached_attention, KvCache};
use candle_core::Tensor;

impl Gpt {
    /// Logits `[1, vocab]` after `tokens`, which follow the `cache.len()` positions cached.
    /// `w`: each unit's tensors as its forward reads them.
    pub(crate) fn decode_step(
        &self,
        w: &[Vec<Tensor>],
        tokens: &[u32],
        cache: &mut KvCache,
    ) -> candle_core::Result<Tensor> {
        let (n, pos, c) = (tokens.len(), cache.len(), self.config.width);
        let ids = Tensor::from_slice(tokens, n, &self.device)?;
        let e = &w[0];
        let mut x = e[0]
            .index_select(&ids, 0)?
            .broadcast_add(&e[1].narrow(0, pos, n)?)?;
        for layer in 0..self.config.layers {
            let p = &w[layer + 1];
            let h = self.layer_norm(&x, &p[0], &p[1])?;
            let qkv = self.linear(&h, &p[2], &p[3])?;
            let att = self.cached_attention(&qkv, layer, cache)?;
            x = (x + self.linear(&att, &p[4], &p[5])?)?;
            let h = self.layer_norm(&x, &p[6], &p[7])?;
            let h = self.gelu(&self.linear(&h, &p[8], &p[9])?)?;
            x = (x + self.linear(&h, &p[10], &p[11])?)?;
        }
        let head = &w[self.config.layers + 1];
        let last = x.narrow(0, n - 1, 1)?.contiguous()?;
        let h = self.layer_norm(&last, &head[0], &head[1])?;
        debug_assert_eq!(h.dim(1)?, c);
        h.matmul(&head[2].t()?)
    }

    /// `qkv [n, 3c]` of the new positions: their queries over every cached key of `layer`.
    fn cached_attention(
        &self,
        qkv: &Tensor,
        layer: usize,
        cache: &mut KvCache,
    ) -> candle_core::Result<Tensor> {
        let (c, nh) = (self.config.width, self.config.heads);
        let n = qkv.dim(0)?;
        let heads = |i: usize| -> candle_core::Result<Tensor> {
            qkv.narrow(1, i * c, c)?
                .reshape((1, n, nh, c / nh))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (k, v) = cache.append(layer, heads(1)?, heads(2)?)?;
        cached_attention(&heads(0)?, &k, &v, None)
    }
}
