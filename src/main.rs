//! The `zerodp` binary: parse the command line, run, map errors to an exit status.

use clap::Parser;

mod cli;

/// Under MPI, large buffers live in shared memory so that ranks on one host exchange them
/// directly (see `zerodp::comm::mpi_shm`); without an MPI launcher, and in a build without MPI,
/// it is the system allocator keeping freed blocks above 32 MiB for the next step
/// (`zerodp::memory::ReuseAlloc`).
#[cfg(feature = "mpi")]
#[global_allocator]
static ALLOC: zerodp::comm::ShmAlloc = zerodp::comm::ShmAlloc;
#[cfg(not(feature = "mpi"))]
#[global_allocator]
static ALLOC: zerodp::memory::ReuseAlloc = zerodp::memory::ReuseAlloc;

fn main() {
    // Before any thread starts: candle's element-wise ops otherwise share one process-wide spinning
    // pool, on which rank threads serialise (measured 2-4x slower steps for the demo model).
    zerodp::model::run_candle_elementwise_on_caller_thread();
    // Before any thread starts too: freed activation buffers stay for the next step.
    zerodp::model::keep_freed_buffers();
    let parsed = cli::Cli::parse();
    match cli::run(parsed) {
        Ok(code) => std::process::exit(code),
        // The reader of standard output has gone (`zerodp plan | head`): done, as a filter is.
        Err(e) if cli::is_stdout_closed(&e) => std::process::exit(0),
        Err(e) => {
            cli::write_stderr(format_args!("error: {}\n", cli::error_text(&e)));
            std::process::exit(1);
        }
    }
}
