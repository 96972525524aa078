//! The GPT's transformer block straight on the fused kernels' slice functions, without a candle
//! graph: the forward keeps what its backward reads in plain vectors, the backward walks the block
//! in reverse and adds the parameter gradients into the unit's flat gradient slice.
//!
//! WHY: the candle path ([`super::Gpt`]'s `compute` on [`super::Candle`]) runs the same kernels,
//! but candle's backward pays for its generality on every node: each gradient starts as a zeros
//! tensor and is summed into (`GradStore::or_insert`, a memset and an add over the tensor), each
//! parameter is copied into a variable and its gradient out of one, and the graph keeps every
//! intermediate (the two projections' outputs and the block's output too). Profiled on the
//! benchmark GPT that bookkeeping was about a tenth of a step.
//!
//! The arithmetic is the candle path's, op for op: the same kernel functions, the residual sums as
//! `input + branch`, and each tensor with two consumers (the block input, the first residual)
//! receives the sum of its two gradients, which is the same in either order. So the two paths give
//! the same bits; `tests/it/model/gpt.rs` checks it against the candle path.

use super::ops::{
    par_add_into, par_copy, with_slice, CausalAttention, Finish, Gelu, LayerNorm, Linear,
};
use candle_core::{Device, Result, Tensor};
use std::ops::Range;

/// A block's shapes: width, heads, and the micro-batch's sequences and their length.
#[derive(Clone, Debug)]
pub(super) struct BlockShape {
    pub width: usize,
    pub heads: usize,
    pub batch: usize,
    pub seq: usize,
    pub eps: f64,
    /// The MLP's inner width.
    pub mlp: usize,
    /// Rows packed with several sequences, each attending to itself only.
    pub segments: Option<std::sync::Arc<super::attention::Segments>>,
}

/// What a block's training forward keeps for its backward.
pub(crate) struct BlockSaved {
    /// A copy of the unit's flat parameters (the engine may release its gathered buffer).
    params: Vec<f32>,
    shape: BlockShape,
    /// The block's input, as the previous unit returned it.
    input: Tensor,
    ln1: Vec<f32>,
    qkv: Vec<f32>,
    att: Vec<f32>,
    x1: Vec<f32>,
    ln2: Vec<f32>,
    fc: Vec<f32>,
    h: Vec<f32>,
}

impl BlockShape {
    fn rows(&self) -> usize {
        self.batch * self.seq
    }

    /// Element ranges of the block's twelve tensors in its flat buffer, in `ParamSpec` order:
    /// ln_1 w, b; c_attn w, b; attn c_proj w, b; ln_2 w, b; c_fc w, b; mlp c_proj w, b.
    fn ranges(&self) -> [Range<usize>; 12] {
        let (c, m) = (self.width, self.mlp);
        let sizes = [c, c, 3 * c * c, 3 * c, c * c, c, c, c, m * c, m, m * c, c];
        let mut at = 0;
        sizes.map(|n| {
            at += n;
            at - n..at
        })
    }

    fn attention(&self) -> CausalAttention {
        let mut attention = CausalAttention::new(self.batch, self.seq, self.heads, None);
        attention.segments = self.segments.clone();
        attention
    }
}

/// `dst += src`, element by element: a tensor with two consumers gets the sum of its two
/// gradients (the same bits in either order), written over one of them.
fn add_into(dst: &mut [f32], src: &[f32]) {
    par_add_into(dst, src)
}

/// The block's forward on `input` (`[rows, width]`) with its flat parameters `p`: the output, and
/// with `keep` what backward needs.
pub(super) fn forward(
    shape: BlockShape,
    p: &[f32],
    input: &Tensor,
    keep: bool,
) -> Result<(Tensor, Option<BlockSaved>)> {
    let (c, rows) = (shape.width, shape.rows());
    if input.dims() != [rows, c] {
        candle_core::bail!(
            "block input has shape {:?}, expected [{rows}, {c}]",
            input.dims()
        );
    }
    let r = shape.ranges();
    let ln = LayerNorm { eps: shape.eps };
    // Without `keep`, each activation is freed after its last use (a forward without a graph holds
    // little beside its output, as activation checkpointing and stage-3 recomputation expect).
    let kept = |v: Vec<f32>| if keep { v } else { Vec::new() };
    // The input is read where it lies (the previous unit's output tensor), not copied out.
    let (ln1, qkv, att, x1) = with_slice::<f32, _>(input, |x| {
        let ln1 = ln.fwd(x, &p[r[0].clone()], &p[r[1].clone()])?;
        let qkv = Linear::fwd_finished(&ln1, &p[r[2].clone()], &Finish::Bias(&p[r[3].clone()]))?;
        let ln1 = kept(ln1);
        let att = shape.attention().forward(&qkv, 3 * c)?;
        let qkv = kept(qkv);
        // x1 = x + c_proj(att): the residual added as the projection is written.
        let x1 = Linear::fwd_finished(
            &att,
            &p[r[4].clone()],
            &Finish::BiasResidual(&p[r[5].clone()], x),
        )?;
        Ok((ln1, qkv, kept(att), x1))
    })?;
    let ln2 = ln.fwd(&x1, &p[r[6].clone()], &p[r[7].clone()])?;
    let fc = Linear::fwd_finished(&ln2, &p[r[8].clone()], &Finish::Bias(&p[r[9].clone()]))?;
    let h = Gelu::fwd(&fc);
    let ln2 = kept(ln2);
    let fc = kept(fc);
    // out = x1 + c_proj(h).
    let out = Linear::fwd_finished(
        &h,
        &p[r[10].clone()],
        &Finish::BiasResidual(&p[r[11].clone()], &x1),
    )?;
    let h = kept(h);
    let out = Tensor::from_vec(out, (rows, c), &Device::Cpu)?;
    let saved = keep.then(|| BlockSaved {
        params: par_copy(p),
        shape,
        input: input.clone(),
        ln1,
        qkv,
        att,
        x1,
        ln2,
        fc,
        h,
    });
    Ok((out, saved))
}

/// The block's backward from `saved` and the gradient of its output: adds the parameter gradients
/// into `grads` (the unit's flat gradient slice) and returns the gradient of its input.
pub(super) fn backward(s: BlockSaved, grad_output: &Tensor, grads: &mut [f32]) -> Result<Tensor> {
    let (c, rows) = (s.shape.width, s.shape.rows());
    if grad_output.dims() != [rows, c] {
        candle_core::bail!(
            "output gradient has shape {:?}, the output [{rows}, {c}]",
            grad_output.dims()
        );
    }
    let r = s.shape.ranges();
    if grads.len() != r[11].end || s.params.len() != r[11].end {
        candle_core::bail!(
            "block gradient slice of {} elements, parameters of {}, expected {}",
            grads.len(),
            s.params.len(),
            r[11].end
        );
    }
    let p = &s.params;
    let ln = LayerNorm { eps: s.shape.eps };
    // Adds a parameter's gradient into its range of the flat gradient.
    let add = |grads: &mut [f32], k: usize, g: Vec<f32>| par_add_into(&mut grads[r[k].clone()], &g);
    // A linear layer's backward: the weight gradient (parameter `w`) accumulated in place by the
    // GEMM, the bias gradient (`w + 1`) added; returns the input gradient.
    let linear = |grads: &mut [f32], x: &[f32], w: usize, dy: &[f32], out: usize| {
        let (dx, db) = Linear::bwd_into(x, &p[r[w].clone()], dy, out, &mut grads[r[w].clone()]);
        add(grads, w + 1, db);
        dx
    };
    // The output gradient is read where it lies, not copied out.
    let dx1 = with_slice::<f32, _>(grad_output, |dout| {
        // out = x1 + c_proj(gelu(c_fc(ln_2(x1)))): both terms get dout.
        let dh = linear(grads, &s.h, 10, dout, c);
        let dfc = Gelu::bwd(&s.fc, &dh)?;
        drop(dh);
        let dln2 = linear(grads, &s.ln2, 8, &dfc, s.shape.mlp);
        drop(dfc);
        let (mut dx1, dw, db) = ln.bwd(&s.x1, &p[r[6].clone()], &dln2);
        add(grads, 6, dw);
        add(grads, 7, db);
        add_into(&mut dx1, dout);
        Ok(dx1)
    })?;
    // x1 = x + c_proj(attention(c_attn(ln_1(x)))).
    let datt = linear(grads, &s.att, 4, &dx1, c);
    let dqkv = s.shape.attention().backward(&s.qkv, &datt, 3 * c)?;
    drop(datt);
    let dln1 = linear(grads, &s.ln1, 2, &dqkv, 3 * c);
    drop(dqkv);
    let (mut dx, dw, db) =
        with_slice::<f32, _>(&s.input, |x| Ok(ln.bwd(x, &p[r[0].clone()], &dln1)))?;
    add(grads, 0, dw);
    add(grads, 1, db);
    add_into(&mut dx, &dx1);
    Tensor::from_vec(dx, (rows, c), &Device::Cpu)
}
