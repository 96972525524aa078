//! The Llama's fused operations on a GPU (`kernels/llama_ops.cu`): the `cuda_fwd` of
//! [`super::super::ops::RmsNorm`], [`super::super::ops::Rope`] and [`super::super::ops::Gated::SwiGlu`] and their backward passes, each one kernel (RMSNorm's
//! backward two, and a sum of parts for the weight's gradient) where candle's composite ops and
//! their autograd take several full passes each. They compute in f32 from f32, bf16 or f16.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, PushKernelArg};
use candle_core::cuda_backend::CudaStorage;
use candle_core::{bail, DType, Layout, Result, Shape, Tensor};

use super::super::ops::Rope;
use super::launch::{
    arg, elementwise, kernel_name, launched, norm_dx, output, param_parts, per_part, per_row, push,
    push_slice, rows_of, sum_parts, tensor, with_cuda, with_cuda3,
};

const MODULE: &str = "zerodp_llama_ops";
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/llama_ops.ptx"));

/// RMSNorm over the last dimension, forward: `x` `[.., c]`, `w` `[c]`.
pub(in crate::model) fn rms_norm_fwd(
    (x, xl): (&CudaStorage, &Layout),
    (w, wl): (&CudaStorage, &Layout),
    eps: f64,
) -> Result<(CudaStorage, Shape)> {
    let (rows, c) = rows_of(xl.shape())?;
    let (device, dtype) = (&x.device, x.dtype());
    if wl.shape().elem_count() != c {
        bail!("rms norm: input {:?}, weight {:?}", xl.shape(), wl.shape());
    }
    let (xa, wa) = (arg(x, xl)?, arg(w, wl)?);
    if wa.dtype() != dtype {
        bail!("rms norm: input and weight in one dtype ({dtype:?})");
    }
    let y = output(device, dtype, rows * c)?;
    let func = device.get_or_load_custom_func(&kernel_name("rms_norm_fwd", dtype)?, MODULE, PTX)?;
    let (rows64, c32, eps32) = (rows as u64, c as i32, eps as f32);
    let mut b = func.builder();
    push(&mut b, &xa);
    push(&mut b, &wa);
    push_slice(&mut b, &y.slice)?;
    b.arg(&rows64).arg(&c32).arg(&eps32);
    // SAFETY: `zerodp_rms_norm_fwd_<dtype>(x, w, y, rows, c, eps)`: x and y of `rows * c`
    // elements, w of `c`, all of `dtype`.
    launched("rms_norm_fwd", unsafe { b.launch(per_row(rows)) })?;
    Ok((y, xl.shape().clone()))
}

/// RMSNorm's backward: `(dx, dw)`. One kernel gives dx and each row's `1 / rms`, a second the
/// weight's gradient in f32 parts of rows, which candle sums.
pub(in crate::model) fn rms_norm_bwd(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let (rows, c) = rows_of(x.shape())?;
    if dy.shape() != x.shape() || w.elem_count() != c {
        bail!(
            "rms norm backward: input {:?}, weight {:?}, gradient {:?}",
            x.shape(),
            w.shape(),
            dy.shape()
        );
    }
    let (per_part_rows, parts) = param_parts(rows);
    let (dx, dw_parts) = with_cuda3(x, w, dy, |[(xs, xl), (ws, wl), (ds, dl)]| {
        let (device, dtype) = (&xs.device, xs.dtype());
        let (xa, wa, da) = (arg(xs, xl)?, arg(ws, wl)?, arg(ds, dl)?);
        // Each row's `1 / rms`.
        let kernel = (MODULE, PTX, "rms_norm_bwd");
        let (dx, stats) = norm_dx(kernel, device, (&xa, &wa, &da), (rows, c, eps, 1))?;
        let (rows64, c32) = (rows as u64, c as i32);

        let dw_parts = output(device, DType::F32, parts * c)?;
        let per_part_rows = per_part_rows as u64;
        let name = kernel_name("rms_norm_weight_parts", dtype)?;
        let func = device.get_or_load_custom_func(&name, MODULE, PTX)?;
        let mut b = func.builder();
        push(&mut b, &xa);
        push(&mut b, &da);
        push_slice(&mut b, &stats.slice)?;
        push_slice(&mut b, &dw_parts.slice)?;
        b.arg(&rows64).arg(&c32).arg(&per_part_rows);
        // SAFETY: `zerodp_rms_norm_weight_parts_<dtype>(x, dy, stats, dw_parts, rows, c,
        // rows_per_part)`: the parts of `parts * c` f32, one block row per part.
        launched("rms_norm_weight_parts", unsafe {
            b.launch(per_part(c, parts))
        })?;
        Ok((dx, dw_parts))
    })?;
    Ok((
        tensor(dx, x.shape().clone()),
        sum_parts(dw_parts, (parts, c), w)?,
    ))
}

/// A rotary op's f32 cosine and sine tables in GPU memory ([`Rope::gpu_tables`]).
pub(crate) struct GpuTables {
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
}

/// The rotary embedding of rows `[n, width]` (heads of `op.head_dim`), or its backward (the
/// opposite rotation) when `inverse`. The op's f32 cosine and sine tables go to the GPU at its
/// first call (the model keeps the op per sequence length).
pub(in crate::model) fn rope(
    (x, l): (&CudaStorage, &Layout),
    op: &Rope,
    inverse: bool,
) -> Result<(CudaStorage, Shape)> {
    let (rows, width) = rows_of(l.shape())?;
    if op.positions.is_some() {
        bail!("rope: rows packed with several sequences (chat examples) are not built on the GPU; train them on the CPU");
    }
    let (d, half) = (op.head_dim, op.head_dim / 2);
    if d == 0 || d % 2 != 0 || width % d != 0 || op.seq == 0 || rows % op.seq != 0 {
        bail!(
            "rope: {rows} rows of {width} for heads of {d} in sequences of {}",
            op.seq
        );
    }
    if op.cos.len() != op.seq * half || op.sin.len() != op.seq * half {
        bail!(
            "rope: tables of {} for {} positions of {half}",
            op.cos.len(),
            op.seq
        );
    }
    let (device, dtype) = (&x.device, x.dtype());
    let xa = arg(x, l)?;
    if op.gpu_tables.get().is_none() {
        let tables = GpuTables {
            cos: device.clone_htod(op.cos.as_slice())?,
            sin: device.clone_htod(op.sin.as_slice())?,
        };
        // A concurrent call may have set them first: its copy is the same.
        let _ = op.gpu_tables.set(tables);
    }
    let Some(GpuTables { cos, sin }) = op.gpu_tables.get() else {
        bail!("rope: the cosine and sine tables did not reach the GPU");
    };
    let y = output(device, dtype, rows * width)?;
    let func = device.get_or_load_custom_func(&kernel_name("rope", dtype)?, MODULE, PTX)?;
    let (rows64, width32, d32, seq32) = (rows as u64, width as i32, d as i32, op.seq as i32);
    let sign: f32 = if inverse { -1.0 } else { 1.0 };
    let mut b = func.builder();
    push(&mut b, &xa);
    b.arg(cos).arg(sin);
    push_slice(&mut b, &y.slice)?;
    b.arg(&rows64)
        .arg(&width32)
        .arg(&d32)
        .arg(&seq32)
        .arg(&sign);
    // SAFETY: `zerodp_rope_<dtype>(x, cos, sin, y, rows, width, d, seq, sign)`: x and y of
    // `rows * width` elements of `dtype`, the tables of `seq * d / 2` f32.
    launched("rope", unsafe { b.launch(elementwise(rows * width / 2)) })?;
    Ok((y, l.shape().clone()))
}

/// [`rope`]'s backward on a tensor: the gradient rotated by the opposite angles.
pub(in crate::model) fn rope_bwd(dy: &Tensor, op: &Rope) -> Result<Tensor> {
    let (dx, shape) = with_cuda(dy, |s, l| rope((s, l), op, true))?;
    Ok(tensor(dx, shape))
}

/// SwiGLU's gate, forward: `silu(g) * u`.
pub(in crate::model) fn swiglu_fwd(
    (g, gl): (&CudaStorage, &Layout),
    (u, ul): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    let n = gl.shape().elem_count();
    let (device, dtype) = (&g.device, g.dtype());
    let (ga, ua) = (arg(g, gl)?, arg(u, ul)?);
    if gl.shape() != ul.shape() || ua.dtype() != dtype {
        bail!(
            "swiglu: gate {:?} and up {:?} differ",
            gl.shape(),
            ul.shape()
        );
    }
    let y = output(device, dtype, n)?;
    let func = device.get_or_load_custom_func(&kernel_name("swiglu_fwd", dtype)?, MODULE, PTX)?;
    let n64 = n as u64;
    let mut b = func.builder();
    push(&mut b, &ga);
    push(&mut b, &ua);
    push_slice(&mut b, &y.slice)?;
    b.arg(&n64);
    // SAFETY: `zerodp_swiglu_fwd_<dtype>(g, u, y, n)`, each of `n` elements of `dtype`.
    launched("swiglu_fwd", unsafe { b.launch(elementwise(n)) })?;
    Ok((y, gl.shape().clone()))
}

/// SwiGLU's backward: `(dg, du)`.
pub(in crate::model) fn swiglu_bwd(
    g: &Tensor,
    u: &Tensor,
    dy: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let n = g.elem_count();
    if u.shape() != g.shape() || dy.shape() != g.shape() {
        bail!(
            "swiglu backward: gate {:?}, up {:?}, gradient {:?}",
            g.shape(),
            u.shape(),
            dy.shape()
        );
    }
    let (dg, du) = with_cuda3(g, u, dy, |[(gs, gl), (us, ul), (ds, dl)]| {
        let (device, dtype) = (&gs.device, gs.dtype());
        let (ga, ua, da) = (arg(gs, gl)?, arg(us, ul)?, arg(ds, dl)?);
        if ua.dtype() != dtype || da.dtype() != dtype {
            bail!("swiglu backward: gate, up and gradient in one dtype");
        }
        let (dg, du) = (output(device, dtype, n)?, output(device, dtype, n)?);
        let name = kernel_name("swiglu_bwd", dtype)?;
        let func = device.get_or_load_custom_func(&name, MODULE, PTX)?;
        let n64 = n as u64;
        let mut b = func.builder();
        for a in [&ga, &ua, &da] {
            push(&mut b, a);
        }
        push_slice(&mut b, &dg.slice)?;
        push_slice(&mut b, &du.slice)?;
        b.arg(&n64);
        // SAFETY: `zerodp_swiglu_bwd_<dtype>(g, u, dy, dg, du, n)`, each of `n`
        // elements of `dtype`.
        launched("swiglu_bwd", unsafe { b.launch(elementwise(n)) })?;
        Ok((dg, du))
    })?;
    Ok((tensor(dg, g.shape().clone()), tensor(du, g.shape().clone())))
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
            "rms_norm_fwd",
            "rms_norm_bwd",
            "rms_norm_weight_parts",
            "rope",
            "swiglu_fwd",
            "swiglu_bwd",
        ];
        for op in ops {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let entry = format!(".entry {}(", kernel_name(op, dtype).unwrap());
                assert!(PTX.contains(&entry), "kernels/llama_ops.cu has no {entry}");
            }
        }
    }
}
