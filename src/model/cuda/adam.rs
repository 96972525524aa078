//! The device tier's Adam step on a GPU as one fused kernel per unit (`kernels/adam.cu`, compiled
//! to PTX by `build.rs`): one pass that reads the gradient, the fp32 master and both moments and
//! writes the master, the moments and (where the rank updates the whole unit) the compute-dtype
//! parameters in place, where candle's
//! element-wise ops take about a dozen passes and allocate each intermediate. The kernel's
//! arithmetic is the CPU kernel's operation for operation (`kernels/adam_math.h`, checked bit for
//! bit against it by `tests/it/model/kernel_math.rs`), so the GPU's update is the host tier's.

use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, PushKernelArg};
use candle_core::{DType, Device, Storage, Tensor};

use super::launch::{dtype_name, elementwise, launched, push_slice};
use crate::optim::adam::{KernelConsts, StepConsts};

/// The kernels' PTX, which the driver compiles for the GPU at the first step.
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/adam.ptx"));

// SAFETY: plain old data of fourteen 4-byte fields, laid out as the C struct the kernel reads.
unsafe impl DeviceRepr for KernelConsts {}

/// One unit's flat tensors, which [`fused_adam`] updates in place.
pub(in crate::model) struct AdamTensors<'a> {
    pub grad: &'a Tensor,
    pub master: &'a Tensor,
    pub exp_avg: &'a Tensor,
    pub exp_avg_sq: &'a Tensor,
    /// The compute-dtype parameters, or `None` where the kernel leaves them: they are the master
    /// itself (fp32), or the master is a shard of the unit (the all-gather sets them).
    pub params: Option<&'a Tensor>,
    /// The dtype the engine stores parameters in: the compute copy is rounded through it.
    pub stored: crate::flat::DType,
}

/// Update `t` in place with one fused kernel when its tensors are on a CUDA device; `Ok(false)`
/// (nothing done) on any other device, where the caller runs candle's ops.
pub(in crate::model) fn fused_adam(t: &AdamTensors, c: &StepConsts) -> candle_core::Result<bool> {
    let Device::Cuda(device) = t.master.device() else {
        return Ok(false);
    };
    let n = t.master.elem_count();
    let moments = t.exp_avg.dtype();
    if t.exp_avg_sq.dtype() != moments {
        candle_core::bail!("the fused Adam kernel needs both moments in one dtype");
    }
    let params_name = match t.params {
        Some(p) => dtype_name(p.dtype())?,
        None => "f32",
    };
    let name = format!(
        "zerodp_adam_{}_{}_{params_name}",
        dtype_name(t.grad.dtype())?,
        dtype_name(moments)?
    );
    let func = device.get_or_load_custom_func(&name, "zerodp_adam", PTX)?;
    let stored: i32 = match t.stored {
        crate::flat::DType::BF16 => 1,
        crate::flat::DType::F16 => 2,
        _ => 0,
    };
    let consts = KernelConsts::new(c, moments != DType::F32);
    let n_arg = n as u64;
    // A null pointer where the parameters are the master (the kernel skips them).
    let null: u64 = 0;
    // Read guards keep each storage alive through the launch; the kernel writes the master, the
    // moments and the parameters through their device pointers (device memory, which no Rust
    // reference covers), in the stream order of everything candle queued on them. cudarc records
    // no write event for them (they are pushed as shared slices): none is needed while candle
    // runs each device on one stream, as 0.11.1 does.
    let guards: Vec<_> = [t.grad, t.master, t.exp_avg, t.exp_avg_sq]
        .into_iter()
        .chain(t.params)
        .map(|tensor| {
            let (storage, layout) = tensor.storage_and_layout();
            match layout.is_contiguous() && layout.start_offset() == 0 && tensor.elem_count() == n {
                true => Ok(storage),
                false => candle_core::bail!("the fused Adam kernel needs whole flat tensors"),
            }
        })
        .collect::<candle_core::Result<_>>()?;
    let slices = guards
        .iter()
        .map(|storage| match &**storage {
            Storage::Cuda(s) => Ok(&s.slice),
            _ => candle_core::bail!("the fused Adam kernel's tensors must all be on the GPU"),
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let mut builder = func.builder();
    for slice in &slices[..4] {
        push_slice(&mut builder, slice)?;
    }
    match slices.get(4) {
        Some(params) => push_slice(&mut builder, params)?,
        None => {
            builder.arg(&null);
        }
    }
    builder.arg(&stored).arg(&consts).arg(&n_arg);
    // SAFETY: the arguments are those of `zerodp_adam_*` in kernels/adam.cu in order (four
    // pointers to `n` elements of the dtypes its name says, the parameters' pointer or null, the
    // stored dtype, the constants, `n`), and each tensor was checked to hold `n` contiguous
    // elements from its start.
    launched(&name, unsafe { builder.launch(elementwise(n)) })?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ptx_has_every_variant_the_tier_can_ask_for() {
        if PTX.is_empty() {
            eprintln!(
                "skipped: built with scripts/cuda-check's nvcc stand-in, which writes no PTX"
            );
            return;
        }
        let dtypes = [DType::F32, DType::BF16, DType::F16];
        for g in dtypes {
            for m in [DType::F32, DType::BF16] {
                for p in dtypes {
                    let name = [g, m, p].map(|d| dtype_name(d).unwrap()).join("_");
                    let entry = format!(".entry zerodp_adam_{name}(");
                    assert!(PTX.contains(&entry), "kernels/adam.cu has no {entry}");
                }
            }
        }
    }
}
