//! Sharded checkpoints: every rank writes what it alone holds, in the background; a save becomes
//! visible atomically; a load reshards to any world size and stage.
//!
//! # Layout on disk
//! ```text
//! DIR/latest                     the name of the newest complete checkpoint ("step000120")
//! DIR/step000120/manifest.json   format version, config, model description, world size, stage,
//!                                counters (step, Adam step, loss scaler), data position, files
//!                                with their sizes, CRC-32s and the element ranges they hold
//! DIR/step000120/rank00000.safetensors
//!                                rank 0's slice of every unit: `u{k}.master`, `u{k}.exp_avg`,
//!                                `u{k}.exp_avg_sq` (plain F32 tensors; no pickles, no code)
//! DIR/.zerodp.lock               held by the run writing DIR while it runs ([`SaveDirLock`]);
//!                                no checkpoint's file, never verified or loaded
//! ```
//! A rank writes its own shard of each unit (at stage 0, where every rank holds everything, each
//! still writes only its 1/N), so no byte is written twice. Ranges are element ranges of a unit's
//! unpadded flat buffer, described parameter by parameter in the manifest: no file depends on the
//! world size it was written at, and a load at another world size or stage reads, on each rank,
//! only the slices it now owns.
//!
//! # Atomicity
//! A save is written into `DIR/.tmp-step000120/`; every file is fsynced; once every rank has
//! finished (they agree over the communicator), rank 0 writes the manifest, renames the directory
//! into place, fsyncs `DIR` and only then moves `latest`. A crash at any moment leaves the previous
//! checkpoint named by `latest` whole; a directory without a manifest, or with files whose
//! checksums fail, is never loaded.
//!
//! # Asynchrony
//! Shards change only in the optimizer step, so a save copies each rank's state once into a
//! staging buffer (allocated once, reused) and a background thread writes it; the step loop goes
//! on, and waits for the write only at the next step boundary if it is still running.

mod format;
mod image;
pub mod layout;
mod load;
mod lock;
mod manifest;
mod save;

pub use format::{file_crc, SliceReader};
pub use layout::{LATEST_FILE, MANIFEST_FILE};
pub use load::{
    consolidate, inspect, load_manifest, read_params, resolve_dir, restore_engine, Inspection,
};
pub use lock::{acquire_for_job, Acquired, LockError, LockOwner, SaveDirLock, LOCK_FILE};
pub use manifest::{EvalRecord, FileEntry, Manifest, ModelDescription, FORMAT, VERSION};
pub use save::{CheckpointWriter, RunDescription, SaveTiming};

use std::path::PathBuf;

/// Why a checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {source}", path = .path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("checkpoint file {path} is damaged: {what}", path = .path.display())]
    Damaged { path: PathBuf, what: String },
    #[error(
        "checkpoint file {path} fails its checksum (CRC-32 {got:08x}, the manifest says \
         {expected:08x}; {bytes} bytes, the manifest says {expected_bytes}): it was changed or \
         damaged after the save; load an older checkpoint",
        path = .path.display()
    )]
    Checksum {
        path: PathBuf,
        got: u32,
        expected: u32,
        bytes: u64,
        expected_bytes: u64,
    },
    #[error("{dir}: no checkpoint here ({why})", dir = .dir.display())]
    NotFound { dir: PathBuf, why: String },
    #[error("{path}: {what}", path = .path.display())]
    Manifest { path: PathBuf, what: String },
    #[error(
        "checkpoint {dir} was saved from another model: {what}; resume with the model it was \
         saved from, or start a new --save-dir",
        dir = .dir.display()
    )]
    ModelMismatch { dir: PathBuf, what: String },
    #[error("rank {rank} could not write its part of checkpoint step {step}: {message}")]
    RankFailed {
        rank: usize,
        step: u64,
        message: String,
    },
    #[error(transparent)]
    Engine(#[from] crate::zero::EngineError),
    #[error(transparent)]
    Comm(#[from] crate::comm::CommError),
}

/// The directory name of the checkpoint of optimizer step `step`.
pub(crate) fn step_dir_name(step: u64) -> String {
    format!("step{step:06}")
}

/// The file name of rank `rank`'s part.
pub(crate) fn rank_file_name(rank: usize) -> String {
    format!("rank{rank:05}.safetensors")
}

/// The tensor names of unit `unit` in a rank file.
pub(crate) fn tensor_names(unit: usize) -> [String; 3] {
    [
        format!("u{unit}.master"),
        format!("u{unit}.exp_avg"),
        format!("u{unit}.exp_avg_sq"),
    ]
}
