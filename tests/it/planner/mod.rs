//! The planner and the pre-flight check (`src/planner`).

mod cli;
mod engine;
mod model;
mod train_preflight;
