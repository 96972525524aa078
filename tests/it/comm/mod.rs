//! The collectives and their command line (`src/comm`).

mod bench_cli;
mod collectives;
mod faults;
mod in_place;
