//! safetensors I/O of a model's parameters, by name, into and out of the engine's per-unit flat
//! `f32` buffers (the layout of [`ModelSpec`]: each unit's tensors concatenated row-major).
//!
//! * Loading accepts F32, F64, BF16 and F16 tensors (converted to f32) and requires exactly the
//!   spec's names with exactly its shapes: missing names, unexpected names and shape mismatches
//!   are errors that list the offending names. A shape that is the transpose of the expected one
//!   gets a hint about Hugging Face's `Conv1D` layout (`[in, out]`), since linear weights here are
//!   `[out, in]` like `torch.nn.Linear`.
//! * Tied weights: the GPT's LM head is `wte.weight` and is not stored separately. A file that
//!   also carries `lm_head.weight` (as `GPT2LMHeadModel.state_dict()` does) is accepted only if
//!   that tensor equals `wte.weight` exactly; otherwise loading fails, because this model cannot
//!   represent an untied head.
//! * Saving writes every spec tensor as F32 (no `lm_head.weight`), to `FILE.tmp` first and then
//!   renames, so an interrupted save never leaves a truncated file under the final name.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

use crate::zero::unit::ModelSpec;

/// Names a checkpoint may carry for a tied tensor, and the parameter they must equal.
pub(crate) const TIED_ALIASES: [(&str, &str); 1] = [("lm_head.weight", "wte.weight")];

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a valid safetensors file: {message}")]
    Format { path: PathBuf, message: String },
    #[error("{path} does not match the model: {problems}")]
    Mismatch { path: PathBuf, problems: String },
    #[error("{path}: tensor {name} has dtype {dtype}; only F32, F64, BF16 and F16 can be loaded")]
    Dtype {
        path: PathBuf,
        name: String,
        dtype: String,
    },
    #[error("{path}: {alias} differs from {target}; this model ties them (the LM head is the token embedding), so drop {alias} from the file or make it equal to {target}")]
    Untied {
        path: PathBuf,
        alias: String,
        target: String,
    },
    #[error(
        "{path}: tensor {name} holds {value} at flat index {index}; training from non-finite \
         weights gives a NaN loss, so fix or regenerate the file"
    )]
    NonFinite {
        path: PathBuf,
        name: String,
        index: usize,
        value: f32,
    },
    #[error("cannot save: {got} unit buffers given, the model has {expected} units")]
    UnitCount { expected: usize, got: usize },
    #[error("cannot save: unit {unit} buffer has {got} elements, the model needs {expected}")]
    BufferSize {
        unit: String,
        expected: usize,
        got: usize,
    },
}

/// A tensor's values as f32 from any float dtype a checkpoint uses; `None` for another dtype.
/// The one widening of stored tensors: zerodp's own weight files and Hugging Face's.
pub(crate) fn widen_to_f32(view: &TensorView<'_>) -> Option<Vec<f32>> {
    let data = view.data();
    Some(match view.dtype() {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F64 => data
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32)
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => return None,
    })
}

fn to_f32(path: &Path, name: &str, view: &TensorView<'_>) -> Result<Vec<f32>, WeightsError> {
    widen_to_f32(view).ok_or_else(|| WeightsError::Dtype {
        path: path.to_path_buf(),
        name: name.to_string(),
        dtype: format!("{:?}", view.dtype()),
    })
}

/// Read `path` into one flat `f32` buffer per unit of `spec`.
pub fn load_safetensors(path: &Path, spec: &ModelSpec) -> Result<Vec<Vec<f32>>, WeightsError> {
    let bytes = std::fs::read(path).map_err(|source| WeightsError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let file = SafeTensors::deserialize(&bytes).map_err(|e| WeightsError::Format {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    let views: HashMap<String, TensorView<'_>> = file.tensors().into_iter().collect();

    // Where each expected name lives: (unit, offset, shape).
    let mut wanted: BTreeMap<&str, (usize, usize, &[usize])> = BTreeMap::new();
    for (u, unit) in spec.units.iter().enumerate() {
        for (p, off) in unit.params.iter().zip(unit.offsets()) {
            wanted.insert(p.name.as_str(), (u, off, p.shape.as_slice()));
        }
    }
    let aliases: Vec<(&str, &str)> = TIED_ALIASES
        .iter()
        .copied()
        .filter(|(_, target)| wanted.contains_key(target))
        .collect();

    let mut problems = Vec::new();
    let missing: Vec<&str> = wanted
        .keys()
        .copied()
        .filter(|n| !views.contains_key(*n))
        .collect();
    if !missing.is_empty() {
        problems.push(format!("missing tensors: {}", missing.join(", ")));
    }
    let mut unexpected: Vec<&str> = views
        .keys()
        .map(String::as_str)
        .filter(|n| !wanted.contains_key(n) && !aliases.iter().any(|(a, _)| a == n))
        .collect();
    unexpected.sort_unstable();
    if !unexpected.is_empty() {
        let hint = if unexpected.iter().any(|n| n.starts_with("transformer.")) {
            " (strip the `transformer.` prefix of Hugging Face names)"
        } else {
            ""
        };
        problems.push(format!(
            "unexpected tensors: {}{hint}",
            unexpected.join(", ")
        ));
    }
    for (name, &(_, _, shape)) in &wanted {
        if let Some(v) = views.get(*name) {
            if v.shape() != shape {
                let transposed = shape.len() == 2 && v.shape() == [shape[1], shape[0]];
                problems.push(format!(
                    "{name} has shape {:?}, the model needs {shape:?}{}",
                    v.shape(),
                    if transposed {
                        " (transposed: linear weights are [out, in] like torch.nn.Linear, \
                         not Hugging Face Conv1D's [in, out]; transpose it)"
                    } else {
                        ""
                    }
                ));
            }
        }
    }
    if !problems.is_empty() {
        return Err(WeightsError::Mismatch {
            path: path.to_path_buf(),
            problems: problems.join("; "),
        });
    }

    let mut buffers: Vec<Vec<f32>> = spec.units.iter().map(|u| vec![0.0; u.numel()]).collect();
    for (name, &(u, off, shape)) in &wanted {
        let values = to_f32(path, name, &views[*name])?;
        if let Some(index) = values.iter().position(|x| !x.is_finite()) {
            return Err(WeightsError::NonFinite {
                path: path.to_path_buf(),
                name: name.to_string(),
                index,
                value: values[index],
            });
        }
        let n: usize = shape.iter().product();
        buffers[u][off..off + n].copy_from_slice(&values);
    }
    for (alias, target) in aliases {
        if let Some(v) = views.get(alias) {
            let (u, off, shape) = wanted[target];
            let n: usize = shape.iter().product();
            let same = v.shape() == shape && to_f32(path, alias, v)? == buffers[u][off..off + n];
            if !same {
                return Err(WeightsError::Untied {
                    path: path.to_path_buf(),
                    alias: alias.to_string(),
                    target: target.to_string(),
                });
            }
        }
    }
    Ok(buffers)
}

/// Write the per-unit flat buffers `params` (one per unit of `spec`) to `path` as F32 tensors.
/// A buffer may be longer than its unit (sharding padding); the extra elements are ignored.
pub fn save_safetensors(
    path: &Path,
    spec: &ModelSpec,
    params: &[&[f32]],
) -> Result<(), WeightsError> {
    if params.len() != spec.units.len() {
        return Err(WeightsError::UnitCount {
            expected: spec.units.len(),
            got: params.len(),
        });
    }
    let mut bytes: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (unit, buf) in spec.units.iter().zip(params) {
        if buf.len() < unit.numel() {
            return Err(WeightsError::BufferSize {
                unit: unit.name.clone(),
                expected: unit.numel(),
                got: buf.len(),
            });
        }
        for (p, off) in unit.params.iter().zip(unit.offsets()) {
            let data: Vec<u8> = buf[off..off + p.numel()]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect();
            bytes.push((p.name.clone(), p.shape.clone(), data));
        }
    }
    let format_err = |message: String| WeightsError::Format {
        path: path.to_path_buf(),
        message,
    };
    let views = bytes
        .iter()
        .map(|(name, shape, data)| {
            TensorView::new(Dtype::F32, shape.clone(), data)
                .map(|v| (name.clone(), v))
                .map_err(|e| format_err(e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let tmp = {
        let mut s = path.as_os_str().to_owned();
        s.push(".tmp");
        PathBuf::from(s)
    };
    // Written beside the target and renamed over it only once complete and on disk, so a crash,
    // a full disk or a signal leaves the previous file whole; a failed write leaves no temporary.
    let written = safetensors::serialize_to_file(views, None, &tmp)
        .map_err(|e| match e {
            safetensors::SafeTensorError::IoError(source) => WeightsError::Write {
                path: tmp.clone(),
                source,
            },
            other => format_err(other.to_string()),
        })
        .and_then(|()| {
            std::fs::File::open(&tmp)
                .and_then(|f| f.sync_all())
                .map_err(|source| WeightsError::Write {
                    path: tmp.clone(),
                    source,
                })
        })
        .and_then(|()| {
            std::fs::rename(&tmp, path).map_err(|source| WeightsError::Write {
                path: path.to_path_buf(),
                source,
            })
        });
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}
