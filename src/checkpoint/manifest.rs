//! The manifest: everything needed to check and read a checkpoint, in plain JSON.

use super::CheckpointError;
use crate::zero::unit::ModelSpec;
use crate::zero::EngineCounters;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The `format` every manifest carries.
pub const FORMAT: &str = "zerodp-checkpoint";
/// The manifest version this build writes and reads.
pub const VERSION: u32 = 1;

/// One checkpoint's description.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    /// Optimizer steps taken when it was saved; a resumed run continues with the next one.
    pub step: u64,
    pub world_size: usize,
    pub stage: u8,
    /// The training precision (`fp32`, `bf16`, `fp16`).
    pub precision: String,
    /// The seed of the data order (and of the initialisation the run started from).
    pub seed: u64,
    /// Step counters and the loss scaler; the scheduler's position is `counters.adam_step`
    /// (skipped steps do not advance it), and the data's is `step`.
    pub counters: EngineCounters,
    /// The resolved DeepSpeed config of the run that saved it (`null` when trained without one).
    pub config: serde_json::Value,
    pub model: ModelDescription,
    pub files: Vec<FileEntry>,
    /// The held-out loss of the saved parameters, when the run evaluated at this step (absent
    /// otherwise, and in checkpoints of earlier builds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval: Option<EvalRecord>,
}

/// A held-out evaluation, as a manifest records it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalRecord {
    /// The mean token cross-entropy.
    pub eval_loss: f64,
    /// `exp(eval_loss)`.
    pub eval_ppl: f64,
    /// The tokens scored.
    pub eval_tokens: u64,
}

impl From<crate::zero::EvalLoss> for EvalRecord {
    fn from(e: crate::zero::EvalLoss) -> Self {
        EvalRecord {
            eval_loss: e.loss,
            eval_ppl: e.perplexity(),
            eval_tokens: e.tokens,
        }
    }
}

/// Every unit and parameter: names, shapes and places in the unit's flat buffer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelDescription {
    pub units: Vec<UnitDescription>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UnitDescription {
    pub name: String,
    pub numel: usize,
    pub params: Vec<ParamDescription>,
    /// Units whose parameters this unit also reads (tied weights).
    pub uses: Vec<usize>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParamDescription {
    pub name: String,
    pub shape: Vec<usize>,
    /// Element offset in the unit's flat buffer.
    pub offset: usize,
    /// Element type of the saved values (always `F32`: master weights and Adam moments).
    pub dtype: String,
}

/// One rank's file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    pub rank: usize,
    pub name: String,
    pub bytes: u64,
    pub crc32: u32,
    /// Per unit, the element range `[start, end)` of the unit's flat buffer the file holds.
    pub ranges: Vec<[usize; 2]>,
}

impl ModelDescription {
    pub fn of(spec: &ModelSpec) -> Self {
        ModelDescription {
            units: spec
                .units
                .iter()
                .map(|u| UnitDescription {
                    name: u.name.clone(),
                    numel: u.numel(),
                    params: u
                        .params
                        .iter()
                        .zip(u.offsets())
                        .map(|(p, offset)| ParamDescription {
                            name: p.name.clone(),
                            shape: p.shape.clone(),
                            offset,
                            dtype: "F32".into(),
                        })
                        .collect(),
                    uses: u.uses.clone(),
                })
                .collect(),
        }
    }

    /// The first difference from `other` (the model being resumed), in words.
    pub fn difference(&self, other: &ModelDescription) -> Option<String> {
        if self.units.len() != other.units.len() {
            return Some(format!(
                "it has {} units, this model has {}",
                self.units.len(),
                other.units.len()
            ));
        }
        for (a, b) in self.units.iter().zip(&other.units) {
            if a.params.len() != b.params.len() || a.numel != b.numel {
                return Some(format!(
                    "unit {} has {} parameters ({} elements), this model's {} has {} ({})",
                    a.name,
                    a.params.len(),
                    a.numel,
                    b.name,
                    b.params.len(),
                    b.numel
                ));
            }
            for (p, q) in a.params.iter().zip(&b.params) {
                if p.name != q.name || p.shape != q.shape || p.offset != q.offset {
                    return Some(format!(
                        "parameter {} {:?} where this model has {} {:?}",
                        p.name, p.shape, q.name, q.shape
                    ));
                }
            }
        }
        None
    }
}

impl Manifest {
    /// Read and check `dir/manifest.json`.
    pub fn read(dir: &Path) -> Result<Manifest, CheckpointError> {
        let path = dir.join(super::MANIFEST_FILE);
        let text = std::fs::read_to_string(&path).map_err(|source| match source.kind() {
            std::io::ErrorKind::NotFound => CheckpointError::NotFound {
                dir: dir.to_path_buf(),
                why: "manifest.json is missing: the save did not complete".into(),
            },
            _ => CheckpointError::Io {
                path: path.clone(),
                source,
            },
        })?;
        let bad = |what: String| CheckpointError::Manifest {
            path: path.clone(),
            what,
        };
        let m: Manifest =
            serde_json::from_str(&text).map_err(|e| bad(format!("not a valid manifest: {e}")))?;
        if m.format != FORMAT {
            return Err(bad(format!("format is {:?}, not {FORMAT:?}", m.format)));
        }
        if m.version != VERSION {
            return Err(bad(format!(
                "manifest version {} (this zerodp reads version {VERSION})",
                m.version
            )));
        }
        if m.files.len() != m.world_size || m.files.iter().enumerate().any(|(r, f)| f.rank != r) {
            return Err(bad(format!(
                "lists {} files for a world size of {}",
                m.files.len(),
                m.world_size
            )));
        }
        for f in &m.files {
            if f.ranges.len() != m.model.units.len() {
                return Err(bad(format!(
                    "file {} has ranges for {} units",
                    f.name,
                    f.ranges.len()
                )));
            }
        }
        Ok(m)
    }
}
