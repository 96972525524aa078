//! The trainer's side of checkpoints: when to save, resuming before the first step, and the save
//! timings it reports. The bytes and their atomicity are [`crate::checkpoint`]'s.

use super::TrainerError;
use crate::checkpoint::{
    self, CheckpointWriter, Manifest, ModelDescription, RunDescription, SaveTiming,
};
use crate::comm::Communicator;
use crate::zero::{Engine, EngineConfig, UnitModel};
use std::path::{Path, PathBuf};

/// When and where a run saves checkpoints.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckpointOptions {
    pub dir: PathBuf,
    /// Save after every `every` optimizer steps (counted from the start of training); `None`
    /// saves only at the end and when a stop flag ends the run.
    pub every: Option<u64>,
    /// Keep the newest `keep_last` checkpoints; `None` keeps all.
    pub keep_last: Option<usize>,
    /// The resolved config, recorded in every manifest (`null` when there is none).
    pub config: serde_json::Value,
}

/// A run's checkpoint to resume from: its manifest and directory.
#[derive(Clone, Debug)]
pub struct Resume {
    pub manifest: Manifest,
    pub dir: PathBuf,
}

impl Resume {
    /// The checkpoint `dir` names (its `latest`, or itself), manifest read and checked.
    pub fn from_dir(dir: &Path) -> Result<Resume, TrainerError> {
        let (manifest, dir) = checkpoint::load_manifest(dir)?;
        Ok(Resume { manifest, dir })
    }
}

/// One rank's saving state across the run.
pub(super) struct RankCheckpoints {
    writer: Option<CheckpointWriter>,
    every: Option<u64>,
    pub timings: Vec<SaveTiming>,
}

impl RankCheckpoints {
    pub fn new<M: UnitModel>(
        options: Option<&CheckpointOptions>,
        engine: &Engine<'_, M>,
        model: &M,
        cfg: &EngineConfig,
        rank: usize,
    ) -> Self {
        let writer = options.map(|o| {
            let run = RunDescription {
                stage: cfg.stage.index(),
                precision: cfg.precision_name().into(),
                seed: cfg.seed,
                config: o.config.clone(),
                model: ModelDescription::of(model.spec()),
            };
            let mut w = CheckpointWriter::new(&o.dir, rank, cfg.world_size, run, o.keep_last);
            w.prepare(engine);
            w
        });
        RankCheckpoints {
            writer,
            every: options.and_then(|o| o.every),
            timings: Vec::new(),
        }
    }

    /// The held-out loss after optimizer step `done`, recorded in the manifest of a checkpoint
    /// of that step.
    pub(crate) fn set_eval(&mut self, done: u64, eval: crate::zero::EvalLoss) {
        if let Some(w) = &mut self.writer {
            w.set_eval(done, eval);
        }
    }

    /// After optimizer step `done` (1-based): finish the previous save if one is pending, and
    /// start one if `done` is a multiple of `every`, or synchronously when `last` (the end of the
    /// run, or a stop).
    pub(crate) fn after_step<M: UnitModel>(
        &mut self,
        engine: &mut Engine<'_, M>,
        comm: &dyn Communicator,
        done: u64,
        last: bool,
    ) -> Result<(), TrainerError> {
        let Some(w) = &mut self.writer else {
            return Ok(());
        };
        let due = self.every.is_some_and(|n| n > 0 && done % n == 0);
        if due || last {
            // A device tier in GPU memory: its state comes back to the host buffers first.
            engine.sync_host()?;
            self.timings.extend(w.start(engine, comm)?);
        } else {
            self.timings.extend(w.finish(comm)?);
        }
        if last {
            self.timings.extend(w.finish(comm)?);
        }
        Ok(())
    }
}
