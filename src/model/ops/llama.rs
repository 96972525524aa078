//! The Llama's fused ops, each one graph node with its backward on the rayon pool, as the GPT's
//! are (RMSNorm, rotary embeddings and SwiGLU also on a GPU: `cuda::llama_ops`): a product without bias ([`MatMulT`]), RMSNorm ([`RmsNorm`]), rotary embeddings ([`Rope`])
//! and a gated MLP's gate, SwiGLU's or Gemma's GeGLU ([`Gated`]). Attention is the GPT's fused
//! causal attention on the rotated queries, each key/value head read for its group of query heads
//! (`super::super::llama`).
//!
//! Every op splits its rows at fixed [`ROWS_PER_TASK`] boundaries and sums across rows in task
//! order, so that its bits depend on the inputs alone, never on the threads.

use super::*;

// ---------------------------------------------------------------------------------------------
// y = x @ w^T for x [n, in], w [out, in]: a bias-free linear layer (every Llama projection).

pub(crate) struct MatMulT;

impl MatMulT {
    fn dims(x: usize, w: (usize, usize)) -> Result<(usize, usize, usize)> {
        let (out, inp) = w;
        if out == 0 || inp == 0 || x % inp != 0 {
            bail!("matmul: x of {x} elements against w [{out}, {inp}]");
        }
        Ok((x / inp, out, inp))
    }
}

impl CustomOp2 for MatMulT {
    fn name(&self) -> &'static str {
        "zerodp-matmul-t"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, out, inp) = Self::dims(l1.shape().elem_count(), l2.shape().dims2()?)?;
        by_dtype!(storage_dtype(s1), self.name(), |T| {
            let (x, w) = (slice_of::<T>(s1, l1)?, slice_of::<T>(s2, l2)?);
            let y = gemm_written((n, out, inp), (x, (inp, 1)), (w, (1, inp)));
            Ok((T::to_cpu_storage_owned(y), Shape::from((n, out))))
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (n, out, inp) = Self::dims(x.elem_count(), w.dims2()?)?;
        by_dtype!(x.dtype(), self.name(), |T| {
            let (dx, dw) = with_slice::<T, _>(x, |x| {
                with_slice::<T, _>(w, |w| {
                    with_slice::<T, _>(dy, |dy| {
                        // dx [n, in] = dy @ w and dw [out, in] = dy^T @ x, side by side.
                        Ok(two_products(
                            || gemm_written((n, inp, out), (dy, (out, 1)), (w, (inp, 1))),
                            || gemm_written((out, inp, n), (dy, (1, out)), (x, (inp, 1))),
                        ))
                    })
                })
            })?;
            Ok((Some(tensor(dx, x.shape())?), Some(tensor(dw, w.shape())?)))
        })
    }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm over the last dimension: y = (x * rsqrt(mean(x^2) + eps)) * w, in transformers' order.

#[derive(Clone, Copy)]
pub(crate) struct RmsNorm {
    pub eps: f64,
}

impl RmsNorm {
    /// `1 / sqrt(mean(row^2) + eps)`.
    #[inline(always)]
    fn inv_rms<T: Real>(&self, row: &[T]) -> T {
        let ms = lane_sum(row, |v| v * v) / lit::<T>(row.len() as f64);
        lit::<T>(1.0) / (ms + lit::<T>(self.eps)).sqrt()
    }

    fn fwd<T: Real>(&self, x: &[T], w: &[T]) -> Result<Vec<T>> {
        let h = w.len();
        if h == 0 || x.len() % h != 0 {
            bail!("rms norm: x of {} elements, weight of {h}", x.len());
        }
        let mut y = vec![lit::<T>(0.0); x.len()];
        y.par_chunks_mut(h * ROWS_PER_TASK)
            .zip(x.par_chunks(h * ROWS_PER_TASK))
            .for_each(|(ys, xs)| {
                wide(
                    #[inline(always)]
                    || {
                        for (yr, xr) in ys.chunks_mut(h).zip(xs.chunks(h)) {
                            let inv = self.inv_rms(xr);
                            for ((y, &x), &w) in yr.iter_mut().zip(xr).zip(w) {
                                *y = (x * inv) * w;
                            }
                        }
                    },
                )
            });
        Ok(y)
    }

    /// `(dx, dw)`: with `u = x * inv`, `dw = sum over rows of dy * u` and
    /// `dx = inv * (dy * w - u * mean(dy * w * u))`.
    fn bwd<T: Real>(&self, x: &[T], w: &[T], dy: &[T]) -> (Vec<T>, Vec<T>) {
        let h = w.len();
        let mut dx = vec![lit::<T>(0.0); x.len()];
        let partials: Vec<Vec<T>> = dx
            .par_chunks_mut(h * ROWS_PER_TASK)
            .zip(x.par_chunks(h * ROWS_PER_TASK))
            .zip(dy.par_chunks(h * ROWS_PER_TASK))
            .map(|((dxs, xs), dys)| {
                let mut dw = vec![lit::<T>(0.0); h];
                wide(
                    #[inline(always)]
                    || {
                        let rows = dxs.chunks_mut(h).zip(xs.chunks(h)).zip(dys.chunks(h));
                        for ((dxr, xr), dyr) in rows {
                            let inv = self.inv_rms(xr);
                            let mut dot = [lit::<T>(0.0); LANES];
                            for (k, ((&x, &g), &w)) in xr.iter().zip(dyr).zip(w).enumerate() {
                                dot[k % LANES] += g * w * (x * inv);
                            }
                            let mean = fold_lanes(&dot) / lit::<T>(h as f64);
                            for ((((d, &x), &g), &w), dw) in
                                dxr.iter_mut().zip(xr).zip(dyr).zip(w).zip(dw.iter_mut())
                            {
                                let u = x * inv;
                                *dw += g * u;
                                *d = inv * (g * w - u * mean);
                            }
                        }
                    },
                );
                dw
            })
            .collect();
        (dx, sum_partials(partials, h))
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "zerodp-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        by_dtype!(storage_dtype(s1), self.name(), |T| {
            let y = self.fwd(slice_of::<T>(s1, l1)?, slice_of::<T>(s2, l2)?)?;
            Ok((T::to_cpu_storage_owned(y), l1.shape().clone()))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::super::cuda::llama_ops::rms_norm_fwd((s1, l1), (s2, l2), self.eps)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            let (dx, dw) = super::super::cuda::llama_ops::rms_norm_bwd(x, w, dy, self.eps)?;
            return Ok((Some(dx), Some(dw)));
        }
        by_dtype!(x.dtype(), self.name(), |T| {
            let (dx, dw) = with_slice::<T, _>(x, |x| {
                with_slice::<T, _>(w, |w| with_slice::<T, _>(dy, |dy| Ok(self.bwd(x, w, dy))))
            })?;
            Ok((Some(tensor(dx, x.shape())?), Some(tensor(dw, w.shape())?)))
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Rotary embeddings on rows [b*t, heads*d]: per head, with (x1, x2) its two halves and (c, s) the
// cosines and sines of the row's position, y = (x1*c - x2*s, x2*c + x1*s).

#[derive(Clone)]
pub(crate) struct Rope {
    /// Sequence length: row r is position r % seq.
    pub seq: usize,
    /// Packed rows: each row's position in its sequence (`TokenBatch::positions`), instead of
    /// `r % seq`.
    pub positions: Option<std::sync::Arc<Vec<u32>>>,
    pub head_dim: usize,
    /// `cos` and `sin` of positions `0..seq` by frequency `0..head_dim/2`, `[seq, head_dim/2]`.
    pub cos: std::sync::Arc<Vec<f32>>,
    pub sin: std::sync::Arc<Vec<f32>>,
    /// `cos` and `sin` in GPU memory, copied there by the first GPU call of the op or a clone.
    #[cfg(feature = "cuda")]
    pub gpu_tables: std::sync::Arc<std::sync::OnceLock<super::super::cuda::llama_ops::GpuTables>>,
}

impl Rope {
    /// The op for sequences of `seq` with `head_dim`-wide heads and those tables.
    pub fn new(seq: usize, head_dim: usize, cos: Vec<f32>, sin: Vec<f32>) -> Self {
        Rope {
            seq,
            positions: None,
            head_dim,
            cos: std::sync::Arc::new(cos),
            sin: std::sync::Arc::new(sin),
            #[cfg(feature = "cuda")]
            gpu_tables: Default::default(),
        }
    }
}

impl Rope {
    /// Rotate every head of `x` by its position's angles, backwards (the transpose) when
    /// `inverse`: the backward of a rotation is the rotation by the opposite angles.
    fn rotate<T: Real>(&self, x: &[T], width: usize, inverse: bool) -> Result<Vec<T>> {
        let (d, half) = (self.head_dim, self.head_dim / 2);
        if d == 0 || d % 2 != 0 || width % d != 0 || x.len() % width != 0 {
            bail!("rope: rows of {width} for heads of {d}");
        }
        if x.len() / width % self.seq != 0 || self.cos.len() != self.seq * half {
            bail!(
                "rope: {} rows for sequences of {}",
                x.len() / width,
                self.seq
            );
        }
        if let Some(p) = &self.positions {
            if p.len() != x.len() / width || p.iter().any(|&q| q as usize >= self.seq) {
                bail!(
                    "rope: positions do not fit {} rows of sequences of {}",
                    x.len() / width,
                    self.seq
                );
            }
        }
        let sign = lit::<T>(if inverse { -1.0 } else { 1.0 });
        let mut y = vec![lit::<T>(0.0); x.len()];
        y.par_chunks_mut(width * ROWS_PER_TASK)
            .zip(x.par_chunks(width * ROWS_PER_TASK))
            .enumerate()
            .for_each(|(task, (ys, xs))| {
                wide(
                    #[inline(always)]
                    || {
                        for (r, (yr, xr)) in ys.chunks_mut(width).zip(xs.chunks(width)).enumerate()
                        {
                            let row = task * ROWS_PER_TASK + r;
                            let pos = match &self.positions {
                                Some(p) => p[row] as usize,
                                None => row % self.seq,
                            };
                            let cos = &self.cos[pos * half..][..half];
                            let sin = &self.sin[pos * half..][..half];
                            for (yh, xh) in yr.chunks_mut(d).zip(xr.chunks(d)) {
                                let (x1, x2) = xh.split_at(half);
                                let (y1, y2) = yh.split_at_mut(half);
                                for i in 0..half {
                                    let (c, s) = (lit::<T>(cos[i].into()), lit::<T>(sin[i].into()));
                                    let s = sign * s;
                                    y1[i] = x1[i] * c + (lit::<T>(0.0) - x2[i]) * s;
                                    y2[i] = x2[i] * c + x1[i] * s;
                                }
                            }
                        }
                    },
                )
            });
        Ok(y)
    }
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "zerodp-rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, width) = l.shape().dims2()?;
        by_dtype!(storage_dtype(s), self.name(), |T| {
            let y = self.rotate(slice_of::<T>(s, l)?, width, false)?;
            Ok((T::to_cpu_storage_owned(y), l.shape().clone()))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::super::cuda::llama_ops::rope((s, l), self, false)
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if dy.device().is_cuda() {
            return Ok(Some(super::super::cuda::llama_ops::rope_bwd(dy, self)?));
        }
        let (_, width) = x.dims2()?;
        by_dtype!(x.dtype(), self.name(), |T| {
            let dx = with_slice::<T, _>(dy, |g| self.rotate(g, width, true))?;
            Ok(Some(tensor(dx, x.shape())?))
        })
    }
}

// ---------------------------------------------------------------------------------------------
// A gated MLP's gate, element-wise: SwiGLU's y = silu(g) * u = (g / (1 + e^-g)) * u (Llama,
// Qwen, Mistral), GeGLU's y = gelu_tanh(g) * u (Gemma).

/// The gate of a gated MLP as one graph node. GeGLU has no GPU kernel: a GPU's Gemma runs
/// candle's composite ops, whose backward keeps a dozen temporaries of the MLP's width alive
/// (this op keeps none beyond its two gradients).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Gated {
    SwiGlu,
    GeGlu,
}

/// `y = act(g) * u` element-wise, on the pool.
fn gated_fwd<T: Real>(g: &[T], u: &[T], act: impl Fn(T) -> T + Sync) -> Vec<T> {
    let mut y = vec![lit::<T>(0.0); g.len()];
    y.par_chunks_mut(ELEMS_PER_TASK)
        .zip(
            g.par_chunks(ELEMS_PER_TASK)
                .zip(u.par_chunks(ELEMS_PER_TASK)),
        )
        .for_each(|(ys, (gs, us))| {
            wide(
                #[inline(always)]
                || {
                    for ((y, &g), &u) in ys.iter_mut().zip(gs).zip(us) {
                        *y = act(g) * u;
                    }
                },
            )
        });
    y
}

/// `(dg, du)` of [`gated_fwd`], `grads(g, u, dy)` giving each element's pair.
fn gated_bwd<T: Real>(
    g: &[T],
    u: &[T],
    dy: &[T],
    grads: impl Fn(T, T, T) -> (T, T) + Sync,
) -> (Vec<T>, Vec<T>) {
    let mut dg = vec![lit::<T>(0.0); g.len()];
    let mut du = vec![lit::<T>(0.0); g.len()];
    dg.par_chunks_mut(ELEMS_PER_TASK)
        .zip(du.par_chunks_mut(ELEMS_PER_TASK))
        .zip(g.par_chunks(ELEMS_PER_TASK))
        .zip(
            u.par_chunks(ELEMS_PER_TASK)
                .zip(dy.par_chunks(ELEMS_PER_TASK)),
        )
        .for_each(|(((dgs, dus), gs), (us, dys))| {
            wide(
                #[inline(always)]
                || {
                    let each = dgs.iter_mut().zip(dus.iter_mut()).zip(gs).zip(us).zip(dys);
                    for ((((dg, du), &g), &u), &d) in each {
                        (*dg, *du) = grads(g, u, d);
                    }
                },
            )
        });
    (dg, du)
}

impl Gated {
    fn forward<T: Real>(self, g: &[T], u: &[T]) -> Vec<T> {
        match self {
            Gated::SwiGlu => gated_fwd(g, u, |g| g / (lit::<T>(1.0) + (lit::<T>(0.0) - g).exp())),
            Gated::GeGlu => gated_fwd(g, u, super::gelu),
        }
    }

    /// `(dg, du)`. SwiGLU, with `s = 1 / (1 + e^-g)`: `dg = dy * u * s * (1 + g * (1 - s))` and
    /// `du = dy * g * s`. GeGLU: `dg = (dy * u) * gelu'(g)` and `du = dy * gelu(g)`, the product's
    /// gradient then the GELU's, in the order the two ops apart round them.
    fn backward<T: Real>(self, g: &[T], u: &[T], dy: &[T]) -> (Vec<T>, Vec<T>) {
        let one = lit::<T>(1.0);
        match self {
            Gated::SwiGlu => gated_bwd(g, u, dy, |g, u, d| {
                let s = one / (one + (lit::<T>(0.0) - g).exp());
                (d * u * (s * (one + g * (one - s))), d * (g * s))
            }),
            Gated::GeGlu => gated_bwd(g, u, dy, |g, u, d| {
                ((d * u) * super::gelu_grad(g), d * super::gelu(g))
            }),
        }
    }
}

impl CustomOp2 for Gated {
    fn name(&self) -> &'static str {
        match self {
            Gated::SwiGlu => "zerodp-swiglu",
            Gated::GeGlu => "zerodp-geglu",
        }
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if l1.shape() != l2.shape() {
            bail!(
                "{}: gate {:?} and up {:?} differ",
                self.name(),
                l1.shape(),
                l2.shape()
            );
        }
        by_dtype!(storage_dtype(s1), self.name(), |T| {
            let y = self.forward(slice_of::<T>(s1, l1)?, slice_of::<T>(s2, l2)?);
            Ok((T::to_cpu_storage_owned(y), l1.shape().clone()))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        match self {
            Gated::SwiGlu => super::super::cuda::llama_ops::swiglu_fwd((s1, l1), (s2, l2)),
            Gated::GeGlu => bail!("geglu: no GPU kernel (a GPU's Gemma runs composite ops)"),
        }
    }

    fn bwd(
        &self,
        g: &Tensor,
        u: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if g.device().is_cuda() && *self == Gated::SwiGlu {
            let (dg, du) = super::super::cuda::llama_ops::swiglu_bwd(g, u, dy)?;
            return Ok((Some(dg), Some(du)));
        }
        by_dtype!(g.dtype(), self.name(), |T| {
            let (dg, du) = with_slice::<T, _>(g, |gs| {
                with_slice::<T, _>(u, |us| {
                    with_slice::<T, _>(dy, |d| Ok(self.backward(gs, us, d)))
                })
            })?;
            Ok((Some(tensor(dg, g.shape())?), Some(tensor(du, u.shape())?)))
        })
    }
}
