//! The ZeRO engine: flat buffers, partitions, stages 0-3.

pub mod loss_scaler;
