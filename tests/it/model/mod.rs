//! Models on candle and Hugging Face directories (`src/model`).

mod candle_unit;
mod generate;
mod gpt;
mod hf_cli;
mod hf_families;
pub mod hf_fixture;
mod hf_gpt2;
mod hf_inputs;
mod hf_llama;
mod isa;
mod kernel_math;
mod masked_loss;
mod var_units;
mod weights;
