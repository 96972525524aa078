//! zerodp's integration tests, one binary (one link) whose modules mirror `src/`. The tests that
//! need a feature or a device have binaries of their own: `tests/mpi_backend.rs` (`--features
//! mpi`, under `mpirun`) and `tests/gpu.rs` (a GPU; each test skips without one).

mod common;
/// The model of `examples/mlp_classifier`, included as is (tests of the library path use it).
#[path = "../../examples/mlp_classifier/model.rs"]
mod mlp;

mod checkpoint;
mod cli;
mod comm;
mod config;
mod data;
mod model;
mod offload;
mod optim;
mod planner;
mod trainer;
mod zero;
