//! The `zerodp` binary: parse the command line, run, map errors to an exit status.

use clap::Parser;

mod cli;

/// Under MPI, large buffers live in shared memory so that ranks on one host exchange them
/// directly (see `zerodp::comm::mpi_shm`); without an MPI launcher it is the system allocator.
#[cfg(feature = "mpi")]
#[global_allocator]
static ALLOC: zerodp::comm::ShmAlloc = zerodp::comm::ShmAlloc;

fn main() {
    // Before any thread starts: candle's element-wise ops otherwise share one process-wide spinning
    // pool, on which rank threads serialise (measured 2-4x slower steps for the demo model).
    zerodp::model::run_candle_elementwise_on_caller_thread();
    let parsed = cli::Cli::parse();
    match cli::run(parsed) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
}
