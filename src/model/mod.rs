//! The model side: the [`UnitModel`] contract, a GPT reference model on candle, and data loading.

pub mod data;
pub mod gpt;
mod kernels;
mod rng;
mod unit;
pub mod weights;

pub use data::{Corpus, DataError, DataLoader, DEFAULT_CORPUS_PATH};
pub use gpt::{run_candle_elementwise_on_caller_thread, GptConfig, GptModel, GptSaved};
pub use rng::{mix_seed, SplitMix64};
pub use unit::*;
pub use weights::{load_safetensors, save_safetensors, WeightsError};
