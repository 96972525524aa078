//! The GPT's fused operations on a GPU (`kernels/gpt_ops.cu`): the `cuda_fwd` of
//! [`super::super::ops::Gelu`], [`super::super::ops::LayerNorm`] and [`super::super::ops::CausalSoftmax`]
//! and their backward passes, each one kernel (LayerNorm's backward two, and a sum of parts for
//! the weight's and bias's gradients) where candle's composite ops and their autograd take five
//! to twenty full passes each. They compute in f32 from f32, bf16 or f16 and round once on store.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::CudaStorage;
use candle_core::{bail, DType, Layout, Result, Shape, Tensor};

use super::launch::{
    arg, elementwise, kernel_name, launched, norm_dx, output, per_row, push, push_slice, rows_of,
    sum_parts, tensor, with_cuda2, with_cuda3,
};

const MODULE: &str = "zerodp_gpt_ops";
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gpt_ops.ptx"));

/// GELU (tanh approximation), forward.
pub(in crate::model) fn gelu_fwd(x: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
    let n = l.shape().elem_count();
    let device = &x.device;
    let dtype = x.dtype();
    let x = arg(x, l)?;
    let y = output(device, dtype, n)?;
    let func = device.get_or_load_custom_func(&kernel_name("gelu_fwd", dtype)?, MODULE, PTX)?;
    let n64 = n as u64;
    let mut b = func.builder();
    push(&mut b, &x);
    push_slice(&mut b, &y.slice)?;
    b.arg(&n64);
    // SAFETY: `zerodp_gelu_fwd_<dtype>(x, y, n)`, both of `n` elements of `dtype`.
    launched("gelu_fwd", unsafe { b.launch(elementwise(n)) })?;
    Ok((y, l.shape().clone()))
}

/// GELU's backward: `dy * gelu'(x)`.
pub(in crate::model) fn gelu_bwd(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let n = x.elem_count();
    if dy.elem_count() != n || dy.dtype() != x.dtype() {
        bail!(
            "gelu backward: input {:?}, gradient {:?}",
            x.shape(),
            dy.shape()
        );
    }
    let dx = with_cuda2(x, dy, |[(xs, xl), (ds, dl)]| {
        let (device, dtype) = (&xs.device, xs.dtype());
        let (xa, da) = (arg(xs, xl)?, arg(ds, dl)?);
        let dx = output(device, dtype, n)?;
        let name = kernel_name("gelu_bwd", dtype)?;
        let func = device.get_or_load_custom_func(&name, MODULE, PTX)?;
        let n64 = n as u64;
        let mut b = func.builder();
        push(&mut b, &xa);
        push(&mut b, &da);
        push_slice(&mut b, &dx.slice)?;
        b.arg(&n64);
        // SAFETY: `zerodp_gelu_bwd_<dtype>(x, dy, dx, n)`, each of `n` elements of `dtype`.
        launched("gelu_bwd", unsafe { b.launch(elementwise(n)) })?;
        Ok(dx)
    })?;
    Ok(tensor(dx, x.shape().clone()))
}

/// The causal softmax of attention scores `[.., t, t]`, forward.
pub(in crate::model) fn causal_softmax_fwd(
    x: &CudaStorage,
    l: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let (rows, t) = super::super::ops::causal_rows(l.shape())?;
    let device = &x.device;
    let dtype = x.dtype();
    let x = arg(x, l)?;
    let y = output(device, dtype, rows * t)?;
    let name = kernel_name("causal_softmax_fwd", dtype)?;
    let func = device.get_or_load_custom_func(&name, MODULE, PTX)?;
    let (rows64, t32) = (rows as u64, t as i32);
    let mut b = func.builder();
    push(&mut b, &x);
    push_slice(&mut b, &y.slice)?;
    b.arg(&rows64).arg(&t32);
    // SAFETY: `zerodp_causal_softmax_fwd_<dtype>(x, y, rows, t)`, both of `rows * t` elements.
    launched("causal_softmax_fwd", unsafe { b.launch(per_row(rows)) })?;
    Ok((y, l.shape().clone()))
}

/// A softmax's backward from its output `y`: `y (dy - sum(y dy))` per row.
pub(in crate::model) fn softmax_bwd(y: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let (rows, t) = rows_of(y.shape())?;
    if dy.shape() != y.shape() || dy.dtype() != y.dtype() {
        bail!(
            "softmax backward: output {:?}, gradient {:?}",
            y.shape(),
            dy.shape()
        );
    }
    let dx = with_cuda2(y, dy, |[(ys, yl), (ds, dl)]| {
        let (device, dtype) = (&ys.device, ys.dtype());
        let (ya, da) = (arg(ys, yl)?, arg(ds, dl)?);
        let dx = output(device, dtype, rows * t)?;
        let name = kernel_name("softmax_bwd", dtype)?;
        let func = device.get_or_load_custom_func(&name, MODULE, PTX)?;
        let (rows64, t32) = (rows as u64, t as i32);
        let mut b = func.builder();
        push(&mut b, &ya);
        push(&mut b, &da);
        push_slice(&mut b, &dx.slice)?;
        b.arg(&rows64).arg(&t32);
        // SAFETY: `zerodp_softmax_bwd_<dtype>(y, dy, dx, rows, t)`, each `rows * t` long.
        launched("softmax_bwd", unsafe { b.launch(per_row(rows)) })?;
        Ok(dx)
    })?;
    Ok(tensor(dx, y.shape().clone()))
}

/// LayerNorm over the last dimension, forward: `x` `[.., c]`, `w` and `b` `[c]`.
pub(in crate::model) fn layer_norm_fwd(
    (x, xl): (&CudaStorage, &Layout),
    (w, wl): (&CudaStorage, &Layout),
    (b, bl): (&CudaStorage, &Layout),
    eps: f64,
) -> Result<(CudaStorage, Shape)> {
    let (rows, c) = rows_of(xl.shape())?;
    let dtype = x.dtype();
    if wl.shape().elem_count() != c || bl.shape().elem_count() != c {
        bail!(
            "layer norm: input {:?}, weight {:?}, bias {:?}",
            xl.shape(),
            wl.shape(),
            bl.shape()
        );
    }
    let device = &x.device;
    let (xa, wa, ba) = (arg(x, xl)?, arg(w, wl)?, arg(b, bl)?);
    if wa.dtype() != dtype || ba.dtype() != dtype {
        bail!("layer norm: input, weight and bias in one dtype ({dtype:?})");
    }
    let y = output(device, dtype, rows * c)?;
    let name = kernel_name("layer_norm_fwd", dtype)?;
    let func = device.get_or_load_custom_func(&name, MODULE, PTX)?;
    let (rows64, c32, eps32) = (rows as u64, c as i32, eps as f32);
    let mut builder = func.builder();
    for a in [&xa, &wa, &ba] {
        push(&mut builder, a);
    }
    push_slice(&mut builder, &y.slice)?;
    builder.arg(&rows64).arg(&c32).arg(&eps32);
    // SAFETY: `zerodp_layer_norm_fwd_<dtype>(x, w, b, y, rows, c, eps)`: x and y of `rows * c`
    // elements, w and b of `c`, all of `dtype`.
    launched("layer_norm_fwd", unsafe { builder.launch(per_row(rows)) })?;
    Ok((y, xl.shape().clone()))
}

/// LayerNorm's backward: `(dx, dw, db)`. One kernel gives dx and each row's statistics, a second
/// the weight's and bias's gradients in parts of [`super::launch::PARAM_PART_ROWS`] rows (f32), which candle
/// sums.
pub(in crate::model) fn layer_norm_bwd(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (rows, c) = rows_of(x.shape())?;
    if dy.shape() != x.shape() || w.elem_count() != c {
        bail!(
            "layer norm backward: input {:?}, weight {:?}, gradient {:?}",
            x.shape(),
            w.shape(),
            dy.shape()
        );
    }
    let (per_part, parts) = super::launch::param_parts(rows);
    let (dx, dw_parts, db_parts) = with_cuda3(x, w, dy, |[(xs, xl), (ws, wl), (ds, dl)]| {
        let (device, dtype) = (&xs.device, xs.dtype());
        let (xa, wa, da) = (arg(xs, xl)?, arg(ws, wl)?, arg(ds, dl)?);
        // Each row's mean and `1 / std`.
        let kernel = (MODULE, PTX, "layer_norm_bwd");
        let (dx, stats) = norm_dx(kernel, device, (&xa, &wa, &da), (rows, c, eps, 2))?;
        let (rows64, c32) = (rows as u64, c as i32);

        let dw_parts = output(device, DType::F32, parts * c)?;
        let db_parts = output(device, DType::F32, parts * c)?;
        let per_part = per_part as u64;
        let name = kernel_name("layer_norm_param_parts", dtype)?;
        let func = device.get_or_load_custom_func(&name, MODULE, PTX)?;
        let mut b = func.builder();
        push(&mut b, &xa);
        push(&mut b, &da);
        push_slice(&mut b, &stats.slice)?;
        push_slice(&mut b, &dw_parts.slice)?;
        push_slice(&mut b, &db_parts.slice)?;
        b.arg(&rows64).arg(&c32).arg(&per_part);
        let cfg = super::launch::per_part(c, parts);
        // SAFETY: `zerodp_layer_norm_param_parts_<dtype>(x, dy, stats, dw_parts,
        // db_parts, rows, c, rows_per_part)`: the parts of `parts * c` f32, one block
        // row per part.
        launched("layer_norm_param_parts", unsafe { b.launch(cfg) })?;
        Ok((dx, dw_parts, db_parts))
    })?;
    Ok((
        tensor(dx, x.shape().clone()),
        sum_parts(dw_parts, (parts, c), w)?,
        sum_parts(db_parts, (parts, c), w)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ptx_has_every_op_in_every_dtype() {
        if PTX.is_empty() {
            eprintln!(
                "skipped: built with scripts/cuda-check's nvcc stand-in, which writes no PTX"
            );
            return;
        }
        let ops = [
            "gelu_fwd",
            "gelu_bwd",
            "causal_softmax_fwd",
            "softmax_bwd",
            "layer_norm_fwd",
            "layer_norm_bwd",
            "layer_norm_param_parts",
        ];
        for op in ops {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let entry = format!(".entry {}(", kernel_name(op, dtype).unwrap());
                assert!(PTX.contains(&entry), "kernels/gpt_ops.cu has no {entry}");
            }
        }
    }
}
