//! The model side: the [`UnitModel`] contract, a GPT reference model on candle, and data loading.

pub mod gpt;
mod rng;
mod unit;

pub use gpt::{GptConfig, GptModel, GptSaved};
pub use rng::{mix_seed, SplitMix64};
pub use unit::*;
