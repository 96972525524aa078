//! Memory: byte accounting per kind (what a rank holds now and at its peak) and the planner
//! (what a configuration will hold, before a run).

pub mod accounting;
pub mod planner;
