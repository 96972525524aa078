//! The trainer: configs, reliability, outputs and inputs (`src/trainer`).

mod chat_training;
mod config;
mod evaluation;
mod input_checks;
mod output_safety;
mod reliability;
