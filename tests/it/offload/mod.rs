//! Offload to host memory and NVMe (`src/offload`).

mod cli;
mod engine;
