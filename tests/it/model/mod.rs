//! Models on candle, Hugging Face directories, data and tokenization (`src/model`).

mod candle_unit;
mod data;
mod gpt;
mod hf_cli;
mod hf_gpt2;
mod hf_inputs;
mod hf_llama;
mod kernel_math;
mod token_data;
mod token_data_cli;
mod var_units;
mod weights;
