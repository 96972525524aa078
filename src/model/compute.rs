//! The candle side of [`crate::device`]: the candle device a rank's units compute on, and the dtype
//! they compute in there.
//!
//! On a GPU every candle model of this crate (the GPT on its composite ops, the Llama, a user's
//! [`super::CandleUnits`] or [`super::VarUnits`]) runs as it does on the CPU: [`super::Candle`]
//! makes each unit's parameters tensors on the model's device, candle's CUDA backend (cuBLAS and
//! its kernels) runs forward and backward, and the gradients come back into the engine's flat host
//! buffers. The engine, its shards, its communicator and the CPU Adam do not change.

use candle_core::{DType, Device};

use crate::device::GpuInfo;
use crate::zero::unit::ModelError;

/// The candle device of `gpu` (`None`: the CPU).
pub fn candle_device(gpu: Option<&GpuInfo>) -> Result<Device, ModelError> {
    match gpu {
        None => Ok(Device::Cpu),
        Some(g) => Device::new_cuda(g.ordinal).map_err(|e| {
            ModelError::Invalid(format!(
                "cuda:{} ({}): candle could not open the GPU: {e}",
                g.ordinal, g.name
            ))
        }),
    }
}

/// The dtype units compute in on `device` for a run whose parameters are `half` (bf16 or f16;
/// `None` under fp32): the 16-bit dtype itself on a GPU (its tensor cores), f32 on the CPU, where
/// candle's 16-bit compute is slow and the engine hands every unit its parameters widened to f32.
pub fn compute_dtype(device: &Device, half: Option<DType>) -> DType {
    match (device, half) {
        (Device::Cpu, _) | (_, None) => DType::F32,
        (_, Some(h)) => h,
    }
}

/// The candle dtype of the engine's element type `dtype`.
pub fn candle_dtype(dtype: crate::flat::DType) -> DType {
    match dtype {
        crate::flat::DType::F32 => DType::F32,
        crate::flat::DType::BF16 => DType::BF16,
        crate::flat::DType::F16 => DType::F16,
    }
}

/// `ZERODP_CUDA_KERNELS=0` runs a GPU's LayerNorm, GELU and causal softmax on candle's
/// composite ops instead of zerodp's kernels (`kernels/gpt_ops.cu`): for comparing the two.
pub const CUDA_KERNELS_ENV: &str = "ZERODP_CUDA_KERNELS";

/// Whether a model on `device` computes its LayerNorm, GELU and causal softmax with zerodp's
/// CUDA kernels: on a GPU, unless [`CUDA_KERNELS_ENV`] is `0`.
pub fn uses_cuda_kernels(device: &Device) -> bool {
    device.is_cuda() && std::env::var(CUDA_KERNELS_ENV).map_or(true, |v| v.trim() != "0")
}

/// Whether `dtype` is a 16-bit float: a model computing in one (on a GPU) keeps its norms,
/// softmaxes and loss in f32, as PyTorch does.
pub(crate) fn is_16_bit(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

/// For the models' unit tests: a 16-bit run's loss within 2e-2 of the f32 run's, and each unit's
/// gradient pointing the same way (cosine above 0.98).
#[cfg(test)]
pub(crate) fn assert_follows_f32(
    what: &str,
    (got, grads): (f64, &[Vec<f32>]),
    (want, want_grads): (f64, &[Vec<f32>]),
) {
    assert!(
        (got - want).abs() <= 2e-2 * want,
        "{what}: loss {got} vs {want}"
    );
    let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    for (g, w) in grads.iter().zip(want_grads) {
        let dot: f64 = g
            .iter()
            .zip(w)
            .map(|(a, b)| f64::from(*a) * f64::from(*b))
            .sum();
        let cosine = dot / (norm(g) * norm(w)).max(1e-30);
        assert!(cosine > 0.98, "{what}: gradient cosine {cosine}");
    }
}

/// The mean cross-entropy of `logits [n, vocab]` against `targets`, over the targets that are not
/// [`crate::data::IGNORE_INDEX`] (candle's `cross_entropy` on those rows; 0, with gradient 0,
/// when there are none): the composite ops' counterpart of the fused kernels' masking.
pub(crate) fn masked_cross_entropy(
    logits: &candle_core::Tensor,
    targets: &[u32],
) -> candle_core::Result<candle_core::Tensor> {
    use crate::data::IGNORE_INDEX;
    let device = logits.device();
    if !targets.contains(&IGNORE_INDEX) {
        let t = candle_core::Tensor::from_slice(targets, targets.len(), device)?;
        return candle_nn::loss::cross_entropy(logits, &t);
    }
    let keep: Vec<u32> = (0..targets.len() as u32)
        .filter(|&i| targets[i as usize] != IGNORE_INDEX)
        .collect();
    if keep.is_empty() {
        return logits.sum_all()? * 0.0;
    }
    let kept: Vec<u32> = keep.iter().map(|&i| targets[i as usize]).collect();
    let rows = candle_core::Tensor::from_slice(&keep, keep.len(), device)?;
    let t = candle_core::Tensor::from_slice(&kept, kept.len(), device)?;
    candle_nn::loss::cross_entropy(&logits.index_select(&rows, 0)?, &t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_computes_in_f32_whatever_the_run_stores() {
        for half in [None, Some(DType::BF16), Some(DType::F16)] {
            assert_eq!(compute_dtype(&Device::Cpu, half), DType::F32);
        }
        assert!(candle_device(None).unwrap().is_cpu());
    }
}
