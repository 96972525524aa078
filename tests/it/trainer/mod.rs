//! The trainer: configs, reliability, outputs and inputs (`src/trainer`).

mod config;
mod input_checks;
mod output_safety;
mod reliability;
