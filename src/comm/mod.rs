//! Collectives: the [`Communicator`] trait, asynchronous handles, backends and traces.
//!
//! * [`api`](Communicator): the contract every backend implements and the engine calls.
//! * [`inproc`]: the embedded backend, N ranks as threads of one process; [`run_ranks`] runs a
//!   function on every rank and turns one rank's failure into a prompt failure of the others.
//! * [`options`]: timeout, tracing (`ZERODP_DEBUG`), straggler threshold ([`CommOptions`]).
//! * [`stats`]: nccl-tests bandwidth conventions, ring-formula byte counts, the summary table.
//! * `mpi` (cargo feature `mpi`): ranks as processes started by `mpirun`, `MpiComm`;
//!   [`launch`] tells whether this process was started by an MPI launcher.
//! * `nccl` (cargo feature `cuda`): NCCL between GPUs, one rank per GPU, `NcclComm`.
//! * [`reduce`]: the reduction and copy kernels (f32 accumulation, one rounding, fixed order).

mod api;
pub mod inproc;
pub mod launch;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "mpi")]
pub mod mpi_shm;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod options;
mod queue;
pub mod reduce;
mod rendezvous;
pub mod stats;

#[cfg(feature = "mpi")]
pub use self::mpi::{MpiComm, MpiTopology};
#[cfg(feature = "mpi")]
pub use self::mpi_shm::ShmAlloc;
#[cfg(feature = "cuda")]
pub use self::nccl::NcclComm;
pub use api::*;
pub use inproc::{run_ranks, run_ranks_on, InprocComm, RankFailure, RanksError};
pub use launch::{detect_mpi_launch, MpiLaunch};
pub use options::{
    timeout_from_secs, CommOptions, CommOptionsError, Spin, TraceLevel, TraceSink, NO_TIMEOUT,
};
pub use stats::{CommStats, OpRow, OpStats};
