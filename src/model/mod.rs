//! The model side: the [`UnitModel`] contract, a GPT reference model on candle, and data loading.

mod unit;

pub use unit::*;
