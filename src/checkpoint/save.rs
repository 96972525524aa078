//! One rank's side of a save: stage, write in the background, agree, and (rank 0) commit.

use super::format::{sync_dir, write_atomic, TensorEntry};
use super::image::FileImage;
use super::manifest::{EvalRecord, FileEntry, Manifest, ModelDescription, FORMAT, VERSION};
use super::{
    rank_file_name, step_dir_name, tensor_names, CheckpointError, LATEST_FILE, MANIFEST_FILE,
};
use crate::comm::{Communicator, ReduceOp};
use crate::flat::Buffer;
use crate::zero::{Engine, EngineCounters, UnitModel};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::Instant;

/// What the manifest says about the run, fixed for its whole length.
#[derive(Clone, Debug)]
pub struct RunDescription {
    pub stage: u8,
    pub precision: String,
    pub seed: u64,
    pub config: serde_json::Value,
    pub model: ModelDescription,
}

/// Where one save's time went on this rank.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SaveTiming {
    pub step: u64,
    /// Time the step loop was blocked: copying into the staging buffer, plus waiting for the
    /// write at the next boundary if it was still running, plus the commit.
    pub blocked_s: f64,
    /// Wall time of the background write (file and fsync).
    pub write_s: f64,
    /// Bytes this rank wrote.
    pub bytes: u64,
}

/// A write in flight.
struct Pending {
    step: u64,
    counters: EngineCounters,
    eval: Option<EvalRecord>,
    copy_s: f64,
    handle: JoinHandle<(FileImage, Result<FileEntry, CheckpointError>, f64)>,
}

/// One rank's checkpoint writer. Every rank of a run makes one with the same directory and
/// calls [`CheckpointWriter::start`] and [`CheckpointWriter::finish`] at the same steps.
pub struct CheckpointWriter {
    dir: PathBuf,
    rank: usize,
    world: usize,
    run: RunDescription,
    keep_last: Option<usize>,
    /// The staging buffer, reused between saves; `None` before [`CheckpointWriter::prepare`] and
    /// while a write holds it.
    staging: Option<FileImage>,
    /// The element range of each unit this rank's file holds.
    ranges: Vec<[usize; 2]>,
    pending: Option<Pending>,
    /// The latest held-out loss and the step it was scored after.
    eval: Option<(u64, EvalRecord)>,
}

impl CheckpointWriter {
    pub fn new(
        dir: &Path,
        rank: usize,
        world: usize,
        run: RunDescription,
        keep_last: Option<usize>,
    ) -> Self {
        CheckpointWriter {
            dir: dir.to_path_buf(),
            rank,
            world,
            run,
            keep_last,
            staging: None,
            ranges: Vec::new(),
            pending: None,
            eval: None,
        }
    }

    /// Size the staging buffer for `engine`'s state and touch every page of it now, before the
    /// first step, so that no save pays for the first touch inside the step loop. It is held for
    /// the whole run: one copy of this rank's shard of master weights and Adam moments, laid out
    /// as the file it becomes.
    pub fn prepare<M: UnitModel>(&mut self, engine: &Engine<'_, M>) {
        self.ranges.clear();
        let mut entries = Vec::new();
        for u in 0..engine.layout().num_units() {
            let r = engine.saved_range(u);
            for name in tensor_names(u) {
                entries.push(TensorEntry::flat(name, r.len()));
            }
            self.ranges.push([r.start, r.end]);
        }
        self.staging = Some(FileImage::new(&entries));
    }

    /// Whether a save is written but not yet committed.
    pub fn is_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// The held-out loss after optimizer step `step`, for the manifest of a save of that step.
    pub fn set_eval(&mut self, step: u64, eval: crate::zero::EvalLoss) {
        self.eval = Some((step, eval.into()));
    }

    /// Copy the engine's state into the staging buffer and start writing it in the background.
    /// A previous save still pending is finished first (every rank calls this at the same step).
    pub fn start<M: UnitModel>(
        &mut self,
        engine: &Engine<'_, M>,
        comm: &dyn Communicator,
    ) -> Result<Option<SaveTiming>, CheckpointError> {
        let earlier = self.finish(comm)?;
        if self.staging.is_none() {
            self.prepare(engine);
        }
        let t = Instant::now();
        let counters = engine.counters();
        let step = counters.step;
        let mut image = self.staging.take().expect("prepared above");
        let data = image.data_mut();
        let mut at = 0;
        for u in 0..engine.layout().num_units() {
            let s = engine.optimizer_state(u)?;
            for values in [&s.master[..], &s.exp_avg[..], &s.exp_avg_sq[..]] {
                data[at..at + values.len()].copy_from_slice(values);
                at += values.len();
            }
        }
        let tmp = self.dir.join(format!(".tmp-{}", step_dir_name(step)));
        let (rank, ranges) = (self.rank, self.ranges.clone());
        let copy_s = t.elapsed().as_secs_f64();
        let handle = std::thread::Builder::new()
            .name(format!("zerodp-ckpt-{rank}"))
            .spawn(move || {
                let t = Instant::now();
                let r = write_rank_file(&tmp, rank, &image, ranges);
                (image, r, t.elapsed().as_secs_f64())
            })
            .map_err(|source| CheckpointError::Io {
                path: self.dir.clone(),
                source,
            })?;
        let eval = self.eval.filter(|(at, _)| *at == step).map(|(_, e)| e);
        self.pending = Some(Pending {
            step,
            counters,
            eval,
            copy_s,
            handle,
        });
        Ok(earlier)
    }

    /// Wait for the pending write (if any), agree with the other ranks that every part is on
    /// disk, and commit (rank 0): manifest, rename into place, `latest`. A collective when a save
    /// is pending; every rank calls it at the same step boundaries.
    pub fn finish(
        &mut self,
        comm: &dyn Communicator,
    ) -> Result<Option<SaveTiming>, CheckpointError> {
        let Some(p) = self.pending.take() else {
            return Ok(None);
        };
        let t = Instant::now();
        let (written, write_s) = match p.handle.join() {
            Ok((image, written, write_s)) => {
                self.staging = Some(image);
                (written, write_s)
            }
            Err(_) => {
                let message = "the checkpoint writer thread panicked".to_string();
                let rank = self.rank;
                let e = CheckpointError::RankFailed {
                    rank,
                    step: p.step,
                    message,
                };
                (Err(e), 0.0)
            }
        };
        // Agree: the highest failed rank + 1, or 0 when every rank wrote its part.
        let mine = if written.is_err() {
            self.rank as f32 + 1.0
        } else {
            0.0
        };
        let tmp = self.dir.join(format!(".tmp-{}", step_dir_name(p.step)));
        let agreed = comm
            .all_reduce(Buffer::F32(vec![mine]), ReduceOp::Max)
            .wait_one();
        // A save that will not be committed leaves nothing behind. Once the agreement is in,
        // every rank's writer has finished, so any rank may remove the temporary directory; the
        // ranks that know of the failure do (rank 1's own failure can end the world before rank
        // 0 reads the agreement, which it then sees as a failed collective).
        let all = match agreed {
            Ok(all) => all,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&tmp);
                return Err(e.into());
            }
        };
        let failed = all.get_f32(0);
        let bytes = match (&written, failed > 0.0) {
            (Err(_), _) | (Ok(_), true) => {
                let _ = std::fs::remove_dir_all(&tmp);
                return Err(match written {
                    Err(e) => e,
                    Ok(_) => CheckpointError::RankFailed {
                        rank: failed as usize - 1,
                        step: p.step,
                        message: "its write failed (see its own error)".into(),
                    },
                });
            }
            (Ok(entry), false) => entry.bytes,
        };
        // Rank 0 commits; every rank learns whether it did before going on, so no rank starts
        // the next save (or trains on) past a checkpoint that could not be committed.
        let committed = match self.rank {
            0 => self
                .commit(&tmp, (p.step, &p.counters), p.eval)
                .inspect_err(|_| {
                    let _ = std::fs::remove_dir_all(&tmp);
                }),
            _ => Ok(()),
        };
        let flag = if committed.is_err() { 1.0 } else { 0.0 };
        let all = comm
            .all_reduce(Buffer::F32(vec![flag]), ReduceOp::Max)
            .wait_one()?;
        committed?;
        if all.get_f32(0) > 0.0 {
            return Err(CheckpointError::RankFailed {
                rank: 0,
                step: p.step,
                message: "it could not commit the checkpoint (see its own error)".into(),
            });
        }
        Ok(Some(SaveTiming {
            step: p.step,
            blocked_s: p.copy_s + t.elapsed().as_secs_f64(),
            write_s,
            bytes,
        }))
    }

    /// Rank 0, once every rank's part is on disk: the manifest, the rename, `latest`, pruning.
    fn commit(
        &self,
        tmp: &Path,
        (step, counters): (u64, &EngineCounters),
        eval: Option<EvalRecord>,
    ) -> Result<(), CheckpointError> {
        let mut files = Vec::with_capacity(self.world);
        for r in 0..self.world {
            let side = tmp.join(format!("rank{r:05}.json"));
            let text = std::fs::read_to_string(&side).map_err(|source| CheckpointError::Io {
                path: side.clone(),
                source,
            })?;
            let entry: FileEntry =
                serde_json::from_str(&text).map_err(|e| CheckpointError::Manifest {
                    path: side.clone(),
                    what: e.to_string(),
                })?;
            files.push(entry);
            let _ = std::fs::remove_file(&side);
        }
        let manifest = Manifest {
            format: FORMAT.into(),
            version: VERSION,
            step,
            world_size: self.world,
            stage: self.run.stage,
            precision: self.run.precision.clone(),
            seed: self.run.seed,
            counters: counters.clone(),
            config: self.run.config.clone(),
            model: self.run.model.clone(),
            files,
            eval,
        };
        let json = serde_json::to_vec_pretty(&manifest).expect("a manifest serialises");
        write_atomic(&tmp.join(MANIFEST_FILE), &json)?;
        let name = step_dir_name(step);
        let target = self.dir.join(&name);
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| CheckpointError::Io { path, source }
        };
        // A checkpoint of the same step from an earlier run is replaced only now that the new
        // one is complete.
        let old = self.dir.join(format!(".old-{name}"));
        if target.exists() {
            let _ = std::fs::remove_dir_all(&old);
            std::fs::rename(&target, &old).map_err(io(&target))?;
        }
        std::fs::rename(tmp, &target).map_err(io(tmp))?;
        sync_dir(&self.dir)?;
        write_atomic(&self.dir.join(LATEST_FILE), name.as_bytes())?;
        let _ = std::fs::remove_dir_all(&old);
        if let Some(k) = self.keep_last {
            prune(&self.dir, k, &name, step);
        }
        Ok(())
    }
}

/// This rank's file and its sidecar (size, checksum, ranges) into `tmp`, both fsynced.
fn write_rank_file(
    tmp: &Path,
    rank: usize,
    image: &FileImage,
    ranges: Vec<[usize; 2]>,
) -> Result<FileEntry, CheckpointError> {
    std::fs::create_dir_all(tmp).map_err(|source| CheckpointError::Io {
        path: tmp.to_path_buf(),
        source,
    })?;
    let name = rank_file_name(rank);
    let path = tmp.join(&name);
    let (bytes, crc32) = image
        .write(&path)
        .map_err(|source| CheckpointError::Io { path, source })?;
    let entry = FileEntry {
        rank,
        name,
        bytes,
        crc32,
        ranges,
    };
    let side = serde_json::to_vec(&entry).expect("an entry serialises");
    write_atomic(&tmp.join(format!("rank{rank:05}.json")), &side)?;
    Ok(entry)
}

/// Keep the newest `keep` checkpoints (by step) and the one `latest` names; remove older ones
/// and leftovers of interrupted saves of earlier steps (a later step's temporary directory may be
/// another rank's write in progress). Best effort: what cannot be removed stays.
fn prune(dir: &Path, keep: usize, latest: &str, committed: u64) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut steps: Vec<(u64, PathBuf)> = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(n) = name
            .strip_prefix("step")
            .and_then(|s| s.parse::<u64>().ok())
        {
            steps.push((n, e.path()));
        } else if let Some(n) = name
            .strip_prefix(".tmp-step")
            .and_then(|s| s.parse::<u64>().ok())
        {
            if n < committed {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    steps.sort();
    let cut = steps.len().saturating_sub(keep.max(1));
    for (_, path) in &steps[..cut] {
        if !path.ends_with(latest) {
            let _ = std::fs::remove_dir_all(path);
        }
    }
}
