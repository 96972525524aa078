//! The engine: stages 0-3 against one rank, memory and traffic, precision, the device tier (`src/zero`).

mod cli;
mod device_tier;
mod equivalence;
mod example_mlp;
mod gpt;
mod memory_traffic;
mod mixed_precision;
mod mixed_precision_cli;
mod zeropp;
