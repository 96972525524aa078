//! Command-line tools that belong to no one module (`src/cli`).

mod bench_ops;
mod plot;
