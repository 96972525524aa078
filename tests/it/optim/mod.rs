//! The optimizer and its benchmark (`src/optim`).

mod bench_cli;
