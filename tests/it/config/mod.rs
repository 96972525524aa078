//! DeepSpeed configs read as DeepSpeed reads them (`src/config`).

mod examples;
mod fuzz;
mod realistic;
