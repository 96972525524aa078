//! The model side: the candle helper that turns a model written as per-unit tensor code into the
//! engine's unit contract ([`candle_unit`]: [`CandleUnits`], [`Candle`]; the contract itself is
//! [`crate::zero::unit`]), units built by closures from a `candle_nn::VarBuilder` on it
//! ([`var_units`]: [`VarUnits`]), the GPT reference model and the Hugging Face GPT-2 and Llama on
//! it, and the GPT-or-Llama model a program trains by name ([`train_model`]). The data they train
//! on is [`crate::data`]'s.

mod attention;
mod candle_tier;
pub mod candle_unit;
pub mod compute;
#[cfg(feature = "cuda")]
mod cuda;
pub mod export;
mod gemm;
pub mod generate;
pub mod gpt;
mod gpt_block;
mod heap;
pub mod hf;
pub mod llama;
mod ops;
pub mod train_model;
pub mod var_units;
pub mod weights;

pub use candle_unit::{Candle, CandleSaved, CandleUnits};
pub use compute::{candle_device, candle_dtype, compute_dtype};
pub use gemm::{
    bf16_products_available, gemm_flops_per_s, gemm_footprint, gemm_path, gpt_products,
    llama_products, products_footprint, set_bf16_products, GemmFootprint, GEMM_ENV,
};
pub use gpt::{run_candle_elementwise_on_caller_thread, Gpt, GptConfig, GptModel, GptSaved};
pub use heap::keep_freed_buffers;
pub use var_units::{init_values, VarUnits};
pub use weights::{load_safetensors, save_safetensors, WeightsError};
