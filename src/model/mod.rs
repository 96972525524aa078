//! The model side: a GPT reference model on candle implementing the engine's unit contract
//! ([`crate::zero::unit`]), and data loading.

pub mod data;
pub mod gpt;
mod kernels;
mod rng;
pub mod weights;

pub use data::{Corpus, DataError, DataLoader, TokenBatch, DEFAULT_CORPUS_PATH};
pub use gpt::{run_candle_elementwise_on_caller_thread, GptConfig, GptModel, GptSaved};
pub use rng::{mix_seed, SplitMix64};
pub use weights::{load_safetensors, save_safetensors, WeightsError};
