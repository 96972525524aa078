//! Launching zerodp's own CUDA kernels (`kernels/*.cu`, compiled to PTX by `build.rs`) on
//! candle's tensors: the kernels' arguments from candle's CUDA storage, output storage, and the
//! two launch shapes the kernels use. The kernels are named `zerodp_<op>_<dtype>`.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaView, LaunchArgs, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, CudaStorageSlice};
use candle_core::op::BackpropOp;
use candle_core::{bail, DType, Layout, Result, Shape, Storage, Tensor};
use half::{bf16, f16};

/// Rows a block of the row kernels takes: one warp each.
pub(in crate::model) const ROWS_PER_BLOCK: u32 = 8;

/// The kernels' name for `dtype`.
pub(in crate::model) fn dtype_name(dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 | DType::BF16 | DType::F16 => Ok(dtype.as_str()),
        other => bail!("zerodp's CUDA kernels take f32, bf16 or f16, not {other:?}"),
    }
}

/// The name of kernel `op` for `dtype`: `zerodp_<op>_<dtype>` (load it with candle's
/// `CudaDevice::get_or_load_custom_func`, once per device and module).
pub(in crate::model) fn kernel_name(op: &str, dtype: DType) -> Result<String> {
    Ok(format!("zerodp_{op}_{}", dtype_name(dtype)?))
}

/// A tensor's elements as a kernel argument: a view from its layout's start.
pub(in crate::model) enum Arg<'a> {
    F32(CudaView<'a, f32>),
    BF16(CudaView<'a, bf16>),
    F16(CudaView<'a, f16>),
}

impl Arg<'_> {
    pub(in crate::model) fn dtype(&self) -> DType {
        match self {
            Arg::F32(_) => DType::F32,
            Arg::BF16(_) => DType::BF16,
            Arg::F16(_) => DType::F16,
        }
    }
}

/// The elements `layout` covers in `storage`, which must be contiguous.
pub(in crate::model) fn arg<'a>(storage: &'a CudaStorage, layout: &Layout) -> Result<Arg<'a>> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("zerodp's CUDA kernels take contiguous tensors");
    };
    Ok(match &storage.slice {
        CudaStorageSlice::F32(s) => Arg::F32(s.slice(start..end)),
        CudaStorageSlice::BF16(s) => Arg::BF16(s.slice(start..end)),
        CudaStorageSlice::F16(s) => Arg::F16(s.slice(start..end)),
        _ => bail!(
            "zerodp's CUDA kernels take f32, bf16 or f16, not {:?}",
            storage.dtype()
        ),
    })
}

/// Push `arg` as a pointer argument.
pub(in crate::model) fn push<'a>(builder: &mut LaunchArgs<'a>, arg: &'a Arg<'a>) {
    match arg {
        Arg::F32(v) => builder.arg(v),
        Arg::BF16(v) => builder.arg(v),
        Arg::F16(v) => builder.arg(v),
    };
}

/// Push a whole float storage slice as a pointer argument.
pub(in crate::model) fn push_slice<'a>(
    builder: &mut LaunchArgs<'a>,
    slice: &'a CudaStorageSlice,
) -> Result<()> {
    match slice {
        CudaStorageSlice::F32(s) => builder.arg(s),
        CudaStorageSlice::BF16(s) => builder.arg(s),
        CudaStorageSlice::F16(s) => builder.arg(s),
        _ => bail!("zerodp's CUDA kernels take f32, bf16 or f16 tensors"),
    };
    Ok(())
}

/// `n` elements of `dtype` on `device`, not initialised: for a kernel's output that it writes
/// whole.
pub(in crate::model) fn output(device: &CudaDevice, dtype: DType, n: usize) -> Result<CudaStorage> {
    // SAFETY: the kernels given this storage write each of its `n` elements before anything
    // reads it.
    let slice = unsafe {
        match dtype {
            DType::F32 => CudaStorageSlice::F32(device.alloc::<f32>(n)?),
            DType::BF16 => CudaStorageSlice::BF16(device.alloc::<bf16>(n)?),
            DType::F16 => CudaStorageSlice::F16(device.alloc::<f16>(n)?),
            other => bail!("zerodp's CUDA kernels write f32, bf16 or f16, not {other:?}"),
        }
    };
    Ok(CudaStorage {
        slice,
        device: device.clone(),
    })
}

/// A tensor of `shape` over a kernel's output storage (no autograd: backward passes' results).
pub(in crate::model) fn tensor(storage: CudaStorage, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
}

/// One thread per element, grid-stride past 65,535 blocks of 256.
pub(in crate::model) fn elementwise(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 65_535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One warp per row.
pub(in crate::model) fn per_row(rows: usize) -> LaunchConfig {
    let blocks = rows.div_ceil(ROWS_PER_BLOCK as usize).max(1);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (32, ROWS_PER_BLOCK, 1),
        shared_mem_bytes: 0,
    }
}

/// The first kernel of a norm's backward (LayerNorm's, RMSNorm's):
/// `zerodp_<op>_<dtype>(x, w, dy, dx, stats, rows, c, eps)` of PTX module `module`, all three
/// inputs in x's dtype. Returns dx (`rows * c` elements of that dtype) and the rows' statistics
/// (`stats_per_row * rows` f32), which the kernel of the weights' gradients reads.
pub(in crate::model) fn norm_dx(
    (module, ptx, op): (&str, &'static str, &str),
    device: &CudaDevice,
    (xa, wa, da): (&Arg, &Arg, &Arg),
    (rows, c, eps, stats_per_row): (usize, usize, f64, usize),
) -> Result<(CudaStorage, CudaStorage)> {
    let dtype = xa.dtype();
    if wa.dtype() != dtype || da.dtype() != dtype {
        bail!("{op}: input, weight and gradient in one dtype");
    }
    let dx = output(device, dtype, rows * c)?;
    let stats = output(device, DType::F32, stats_per_row * rows)?;
    let (rows64, c32, eps32) = (rows as u64, c as i32, eps as f32);
    let name = kernel_name(op, dtype)?;
    let func = device.get_or_load_custom_func(&name, module, ptx)?;
    let mut b = func.builder();
    for a in [xa, wa, da] {
        push(&mut b, a);
    }
    push_slice(&mut b, &dx.slice)?;
    push_slice(&mut b, &stats.slice)?;
    b.arg(&rows64).arg(&c32).arg(&eps32);
    // SAFETY: `zerodp_<op>_<dtype>(x, w, dy, dx, stats, rows, c, eps)`: x, dy, dx of `rows * c`
    // elements of one dtype (checked above), w of `c` (checked by the caller), stats of
    // `stats_per_row * rows` f32.
    launched(op, unsafe { b.launch(per_row(rows)) })?;
    Ok((dx, stats))
}

/// The driver's error of a launch, naming the kernel.
pub(in crate::model) fn launched(
    op: &str,
    result: std::result::Result<
        Option<(
            candle_core::cuda_backend::cudarc::driver::CudaEvent,
            candle_core::cuda_backend::cudarc::driver::CudaEvent,
        )>,
        candle_core::cuda_backend::cudarc::driver::DriverError,
    >,
) -> Result<()> {
    result
        .map(|_| ())
        .map_err(|e| candle_core::Error::Msg(format!("zerodp's CUDA kernel {op}: {e}")))
}

/// Run `f` on the CUDA storage and layout of `t` (contiguous).
pub(in crate::model) fn with_cuda<R>(
    t: &Tensor,
    f: impl FnOnce(&CudaStorage, &Layout) -> Result<R>,
) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cuda(s) => f(s, layout),
        _ => bail!("zerodp's CUDA kernels were given a tensor that is not on the GPU"),
    }
}

/// [`with_cuda`] on two tensors at once.
pub(in crate::model) fn with_cuda2<R>(
    a: &Tensor,
    b: &Tensor,
    f: impl FnOnce([(&CudaStorage, &Layout); 2]) -> Result<R>,
) -> Result<R> {
    with_cuda(a, |sa, la| with_cuda(b, |sb, lb| f([(sa, la), (sb, lb)])))
}

/// [`with_cuda`] on three tensors at once.
pub(in crate::model) fn with_cuda3<R>(
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    f: impl FnOnce([(&CudaStorage, &Layout); 3]) -> Result<R>,
) -> Result<R> {
    with_cuda(a, |sa, la| {
        with_cuda2(b, c, |[pb, pc]| f([(sa, la), pb, pc]))
    })
}

/// The rows and row length of a tensor whose last dimension is the row.
pub(in crate::model) fn rows_of(shape: &Shape) -> Result<(usize, usize)> {
    let cols = shape.dims().last().copied().unwrap_or(0);
    if cols == 0 || cols > i32::MAX as usize {
        bail!("zerodp's row kernels need rows of 1 to 2^31 elements, got shape {shape:?}");
    }
    Ok((shape.elem_count() / cols, cols))
}

/// Rows each part of a norm's weight (and bias) gradient sums at least.
pub(in crate::model) const PARAM_PART_ROWS: usize = 256;

/// `(rows per part, parts)` for a norm's weight gradient over `rows` rows: one part per block row
/// of the grid, at most 65,535 of them.
pub(in crate::model) fn param_parts(rows: usize) -> (usize, usize) {
    let per_part = PARAM_PART_ROWS.max(rows.div_ceil(65_535));
    (per_part, rows.div_ceil(per_part).max(1))
}

/// The launch of a parts kernel: a thread per column of `c`, a block row per part.
pub(in crate::model) fn per_part(c: usize, parts: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (c.div_ceil(128) as u32, parts as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A parameter's gradient from its f32 parts `[parts, c]`: summed, in `param`'s dtype and shape.
pub(in crate::model) fn sum_parts(
    parts: CudaStorage,
    (n, c): (usize, usize),
    param: &Tensor,
) -> Result<Tensor> {
    tensor(parts, (n, c))
        .sum(0)?
        .to_dtype(param.dtype())?
        .reshape(param.shape())
}
