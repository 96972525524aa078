//! Checkpoints: saved, verified, resumed at any world size (`src/checkpoint`).

mod cli;
mod engine;
