//! A checkpoint as a Hugging Face directory that `transformers` loads: what `zerodp ckpt export`
//! does, for a Rust program that trained with the [`crate::trainer::Trainer`] too.
//!
//! The config comes from a model directory or config file the caller names, else from the one the
//! run recorded in its checkpoints (the manifest's `config` under [`CHECKPOINT_KEY`]), else, for a
//! checkpoint of a zerodp preset, from its tensor shapes and a head count. The directory is built
//! beside `out` and renamed into place ([`AtomicDir`]): `out` afterwards is what it was or a whole
//! export. An existing `out` is replaced only when it is empty or an earlier export (marked by
//! [`EXPORT_MARKER`]) holding only files an export writes.
//!
//! ```no_run
//! use zerodp::model::export::{export_checkpoint, ConfigSource, ExportRequest};
//! use zerodp::model::hf::ExportDtype;
//!
//! let report = export_checkpoint(&ExportRequest {
//!     checkpoint: "runs/llama".into(), // a save directory: its `latest` checkpoint
//!     out: "llama-tuned".into(),
//!     dtype: Some(ExportDtype::Bf16),
//!     source: ConfigSource::Recorded { heads: None },
//! })?;
//! println!("{} bytes of weights", report.exported.weight_bytes);
//! # Ok::<(), zerodp::model::export::ExportError>(())
//! ```

use std::io::Write;
use std::path::{Path, PathBuf};

use super::hf::{self, ExportDtype, Exported, HfConfig, HfError};
use super::train_model::{spec_of, CHECKPOINT_KEY};
use super::GptConfig;
use crate::atomic_file::{write_atomic, AtomicDir, AtomicFile};
use crate::checkpoint::{load_manifest, read_params, CheckpointError, Manifest, ModelDescription};
use crate::outputs::{check_outputs, NamedPath, OutputPathError};
use crate::zero::unit::ModelError;

/// The file that marks a directory as a zerodp export (what it was exported from), so that a
/// later export may replace it and nothing else.
pub const EXPORT_MARKER: &str = ".zerodp-export.json";

/// Where an export's config (and tokenizer files) come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConfigSource {
    /// A Hugging Face model directory: its `config.json` and tokenizer files.
    ModelDir(PathBuf),
    /// A Hugging Face `config.json`.
    ModelConfig(PathBuf),
    /// What the checkpoint recorded; for a checkpoint of a zerodp preset (which records no
    /// config), a GPT-2 config of its shapes with `heads` (the one size its tensors do not show).
    Recorded { heads: Option<usize> },
}

/// One export: the checkpoint (a save directory's `latest` or one step's directory), the
/// directory to write, its weights' dtype (`None`: the config's, else f32) and the config's source.
#[derive(Clone, Debug)]
pub struct ExportRequest {
    pub checkpoint: PathBuf,
    pub out: PathBuf,
    pub dtype: Option<ExportDtype>,
    pub source: ConfigSource,
}

/// What an export wrote, and what the caller should know about it.
#[derive(Clone, Debug)]
pub struct ExportReport {
    pub exported: Exported,
    /// Remarks for the user (a config dtype zerodp does not write, say).
    pub notes: Vec<String>,
}

/// An export refused or failed; `out` is as it was.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Hf(#[from] HfError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Paths(#[from] OutputPathError),
    #[error("{what} {path}: {source}", path = .path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// Writing the export failed: `out` is untouched and the partial export beside it removed.
    #[error(
        "exporting to {out} failed; it is as it was, and the partial export beside it is \
         removed: {source}",
        out = .out.display()
    )]
    Failed {
        out: PathBuf,
        source: Box<ExportError>,
    },
    /// The request cannot be met as asked; the message says what to change.
    #[error("{0}")]
    Refused(String),
}

fn io_err<'a>(
    what: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> ExportError + 'a {
    move |source| ExportError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// Where the export's config and tokenizer files come from, resolved.
struct Source {
    config: HfConfig,
    tokenizer_dir: Option<PathBuf>,
    /// The `--tokenizer` file the run recorded, written as `tokenizer.json`.
    tokenizer_file: Option<PathBuf>,
}

/// Writes `req.out`: `config.json`, `model.safetensors` and the tokenizer files, all or nothing.
pub fn export_checkpoint(req: &ExportRequest) -> Result<ExportReport, ExportError> {
    let (manifest, _) = load_manifest(&req.checkpoint)?;
    let source = resolve_source(req, &manifest)?;
    let spec = spec_of(&source.config)?;
    if let Some(what) = manifest.model.difference(&ModelDescription::of(&spec)) {
        let g = &source.config.gpt;
        let family = match source.config.llama.is_some() {
            true => "Llama",
            false => "GPT-2",
        };
        return Err(ExportError::Refused(format!(
            "checkpoint {} does not match the config's {family} ({} layers, width {}, {} heads, \
             vocabulary {}, context {}): {what}",
            req.checkpoint.display(),
            g.layers,
            g.width,
            g.heads,
            g.vocab_size,
            g.context
        )));
    }
    let mut notes = Vec::new();
    let dtype = req
        .dtype
        .unwrap_or_else(|| config_dtype(&source.config, &mut notes));
    check_export_paths(req, &source)?;
    // Built beside `out` and renamed into place: `out` is what it was or a whole export.
    let building =
        AtomicDir::create(&req.out).map_err(io_err("creating a directory beside", &req.out))?;
    let (_, params) = read_params(&req.checkpoint)?;
    let built = || -> Result<Exported, ExportError> {
        let dir = building.path();
        let tokenizer_dir = source.tokenizer_dir.as_deref();
        let mut done = hf::export(dir, &source.config, &spec, &params, dtype, tokenizer_dir)?;
        copy_tokenizer(&source, dir, &mut done.copied)?;
        write_export_marker(dir, &req.checkpoint)?;
        Ok(done)
    };
    let exported = built().map_err(|e| ExportError::Failed {
        out: req.out.clone(),
        source: Box::new(e),
    })?;
    building
        .commit()
        .map_err(io_err("putting the export in place at", &req.out))?;
    Ok(ExportReport { exported, notes })
}

/// The config's own dtype where it is one zerodp writes, else f32 (with a note).
fn config_dtype(config: &HfConfig, notes: &mut Vec<String>) -> ExportDtype {
    match config.dtype() {
        None => ExportDtype::F32,
        Some(text) => ExportDtype::parse(text).unwrap_or_else(|| {
            notes.push(format!(
                "the config's dtype {text} is not f32, bf16 or f16: writing f32"
            ));
            ExportDtype::F32
        }),
    }
}

/// The config and tokenizer directory: the request's, else what the checkpoint recorded, else a
/// GPT-2 config of the checkpoint's shapes with `heads`.
fn resolve_source(req: &ExportRequest, manifest: &Manifest) -> Result<Source, ExportError> {
    let entry = manifest.config.get(CHECKPOINT_KEY);
    let recorded = |key: &str| entry.and_then(|e| e[key].as_str()).map(PathBuf::from);
    let recorded_config = entry.map(|e| &e["config"]).filter(|c| !c.is_null());
    let (config, tokenizer_dir) = match (&req.source, recorded_config) {
        (ConfigSource::ModelDir(dir), _) => (
            HfConfig::read(&dir.join(hf::CONFIG_FILE))?,
            Some(dir.clone()),
        ),
        (ConfigSource::ModelConfig(file), _) => (HfConfig::read(file)?, None),
        (ConfigSource::Recorded { heads: Some(_) }, Some(_)) => {
            return Err(ExportError::Refused(format!(
                "--heads is for a checkpoint of a zerodp preset; checkpoint {} records the \
                 Hugging Face config it was trained from, whose head count is exported: drop \
                 --heads",
                req.checkpoint.display()
            )))
        }
        (ConfigSource::Recorded { heads: None }, Some(json)) => {
            let manifest_path = req.checkpoint.join("manifest.json");
            let config = HfConfig::from_json(json.clone(), &manifest_path)?;
            (config, recorded("model_dir").filter(|d| d.is_dir()))
        }
        (ConfigSource::Recorded { heads: Some(heads) }, None) => {
            (HfConfig::for_gpt(&gpt_of(manifest, *heads)?), None)
        }
        (ConfigSource::Recorded { heads: None }, None) => {
            return Err(ExportError::Refused(format!(
                "checkpoint {} was not trained from a Hugging Face config: pass --model-config \
                 FILE (a GPT-2 config.json of the same sizes), --model-dir DIR, or --heads N for \
                 a zerodp preset",
                req.checkpoint.display()
            )))
        }
    };
    Ok(Source {
        config,
        tokenizer_dir,
        tokenizer_file: recorded("tokenizer").filter(|f| f.is_file()),
    })
}

/// Copies the run's `--tokenizer` file as `tokenizer.json` (with the `tokenizer_config.json` and
/// `special_tokens_map.json` beside it), unless the model directory's were copied.
fn copy_tokenizer(
    source: &Source,
    out: &Path,
    copied: &mut Vec<String>,
) -> Result<(), ExportError> {
    let Some(file) = &source.tokenizer_file else {
        return Ok(());
    };
    if copied.iter().any(|c| c == "tokenizer.json") {
        return Ok(());
    }
    let beside =
        ["tokenizer_config.json", "special_tokens_map.json"].map(|n| (file.with_file_name(n), n));
    for (src, name) in [(file.clone(), "tokenizer.json")].into_iter().chain(beside) {
        if !src.is_file() || copied.iter().any(|c| c == name) {
            continue;
        }
        let bytes = std::fs::read(&src).map_err(io_err("reading", &src))?;
        let dst = out.join(name);
        let mut f = AtomicFile::create(&dst).map_err(io_err("writing", &dst))?;
        f.write_all(&bytes)
            .and_then(|()| f.commit())
            .map_err(io_err("writing", &dst))?;
        copied.push(name.to_string());
    }
    Ok(())
}

/// A GPT's sizes from a checkpoint's tensor shapes (`wte` `[V, C]`, `wpe` `[T, C]`, one unit per
/// block between the embeddings and the head) and the head count.
fn gpt_of(manifest: &Manifest, heads: usize) -> Result<GptConfig, ExportError> {
    let units = &manifest.model.units;
    let shape = |name: &str| {
        units
            .first()
            .and_then(|u| u.params.iter().find(|p| p.name == name))
            .map(|p| p.shape.clone())
            .filter(|s| s.len() == 2)
            .ok_or_else(|| {
                ExportError::Refused(format!(
                    "the checkpoint has no 2-d {name}: not a zerodp GPT"
                ))
            })
    };
    let (wte, wpe) = (shape("wte.weight")?, shape("wpe.weight")?);
    let layers = units.len().saturating_sub(2);
    Ok(GptConfig::sized(wte[0], wpe[0], layers, heads, wte[1]))
}

fn write_export_marker(dir: &Path, checkpoint: &Path) -> Result<(), ExportError> {
    let checkpoint = std::fs::canonicalize(checkpoint).unwrap_or_else(|_| checkpoint.into());
    let text = serde_json::json!({ "exported_from": checkpoint.to_string_lossy() }).to_string();
    let path = dir.join(EXPORT_MARKER);
    write_atomic(&path, format!("{text}\n").as_bytes()).map_err(io_err("writing", &path))
}

/// An existing `out` may be replaced when it is empty, or an earlier export holding only the
/// files an export writes; anything else would be lost, so it is refused, naming it.
fn check_replaceable(out: &Path) -> Result<(), ExportError> {
    if !out.is_dir() {
        return Err(ExportError::Refused(format!(
            "OUT_DIR {} exists and is not a directory",
            out.display()
        )));
    }
    let mut names: Vec<String> = std::fs::read_dir(out)
        .and_then(|d| {
            d.map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
                .collect::<Result<_, _>>()
        })
        .map_err(io_err("reading OUT_DIR", out))?;
    names.sort();
    if names.is_empty() {
        return Ok(());
    }
    if !names.iter().any(|n| n == EXPORT_MARKER) {
        return Err(ExportError::Refused(format!(
            "OUT_DIR {} is not empty and is not an earlier zerodp export (it holds {}): an export \
             replaces the whole directory; choose a new or empty directory",
            out.display(),
            listed(&names)
        )));
    }
    let written = [hf::CONFIG_FILE, hf::WEIGHTS_FILE, EXPORT_MARKER];
    let other: Vec<String> = names
        .into_iter()
        .filter(|n| !written.contains(&n.as_str()) && !hf::TOKENIZER_FILES.contains(&n.as_str()))
        .collect();
    if !other.is_empty() {
        return Err(ExportError::Refused(format!(
            "OUT_DIR {} is an earlier zerodp export that now also holds {}, which a new export \
             would delete: move it out, or choose another directory",
            out.display(),
            listed(&other)
        )));
    }
    Ok(())
}

/// Up to three names, and how many more.
fn listed(names: &[String]) -> String {
    let mut text = names.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
    if names.len() > 3 {
        text.push_str(&format!(" and {} more", names.len() - 3));
    }
    text
}

/// The export may not land in the checkpoint read, a model directory read, or any other
/// checkpoint, and may replace only an empty directory or an earlier export
/// ([`check_replaceable`]); it is built beside `out`, so that directory must be writable.
fn check_export_paths(req: &ExportRequest, source: &Source) -> Result<(), ExportError> {
    let mut inputs = vec![NamedPath {
        name: "checkpoint",
        path: &req.checkpoint,
    }];
    let (model_dir, model_config) = match &req.source {
        ConfigSource::ModelDir(d) => (Some(d.as_path()), None),
        ConfigSource::ModelConfig(f) => (None, Some(f.as_path())),
        ConfigSource::Recorded { .. } => (None, None),
    };
    for (name, p) in [
        ("--model-dir", model_dir),
        ("--model-config", model_config),
        ("the model directory", source.tokenizer_dir.as_deref()),
        ("the tokenizer", source.tokenizer_file.as_deref()),
    ] {
        if let Some(path) = p {
            inputs.push(NamedPath { name, path });
        }
    }
    // `out` as a path (where it will be, not inside what is read or a checkpoint), checked as
    // the file it replaces when it is new, else through a name inside it.
    let probe = req.out.join(EXPORT_MARKER);
    let as_output = match req.out.exists() {
        false => &req.out,
        true => &probe,
    };
    check_outputs(
        &inputs,
        &[NamedPath {
            name: "OUT_DIR",
            path: as_output,
        }],
    )?;
    if req.out.exists() {
        check_replaceable(&req.out)?;
    }
    Ok(())
}
