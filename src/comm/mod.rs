//! Collectives: the [`Communicator`] trait, asynchronous handles, backends and traces.

mod api;

pub use api::*;
