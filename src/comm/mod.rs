//! Collectives: the [`Communicator`] trait, asynchronous handles, backends and traces.
//!
//! * [`api`](Communicator): the contract every backend implements and the engine calls.
//! * [`inproc`]: the embedded backend, N ranks as threads of one process; [`run_ranks`] runs a
//!   function on every rank and turns one rank's failure into a prompt failure of the others.
//! * [`options`]: timeout, tracing (`ZERODP_DEBUG`), straggler threshold ([`CommOptions`]).
//! * [`stats`]: nccl-tests bandwidth conventions, ring-formula byte counts, the summary table.
//! * [`kernels`]: the reduction and copy kernels (f32 accumulation, one rounding, fixed order).

mod api;
pub mod inproc;
pub mod kernels;
pub mod options;
mod rendezvous;
pub mod stats;

pub use api::*;
pub use inproc::{run_ranks, InprocComm, RankFailure, RanksError};
pub use options::{
    timeout_from_secs, CommOptions, CommOptionsError, Spin, TraceLevel, TraceSink, NO_TIMEOUT,
};
pub use stats::{CommStats, OpRow, OpStats};
