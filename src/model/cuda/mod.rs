//! zerodp's own CUDA kernels on a candle device, behind the `cuda` feature in one place: the
//! launchers ([`launch`]: PTX modules built by `build.rs` from `kernels/*.cu`, launch
//! configurations, the weight-gradient parts), the GPT's ops ([`gpt_ops`]: GELU, causal softmax,
//! LayerNorm), the Llama's ([`llama_ops`]: RMSNorm, rotary embeddings, SwiGLU) and the device
//! tier's fused Adam ([`adam`]). Each op is the `cuda_fwd` and GPU backward of the same custom op
//! the CPU runs (`super::ops`).

pub(super) mod adam;
pub(super) mod gpt_ops;
pub(super) mod launch;
pub(super) mod llama_ops;
