//! Collectives: the [`Communicator`] trait, asynchronous handles, backends and traces.

mod api;
pub mod inproc;
pub mod kernels;
pub mod options;
mod rendezvous;
pub mod stats;

pub use api::*;
pub use inproc::{run_ranks, InprocComm, RankFailure, RanksError};
pub use options::{CommOptions, CommOptionsError, TraceLevel, TraceSink};
pub use stats::{CommStats, OpRow, OpStats};
