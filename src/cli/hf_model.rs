//! Hugging Face model directories on the command line: `train --model-dir DIR` (fine-tune from a
//! directory's weights), `train --model-config FILE` (the model a config describes, from scratch)
//! and `ckpt export CKPT OUT_DIR` (a directory `transformers` loads), for GPT-2 and Llama; the
//! reading and writing is [`zerodp::model::hf`], the model built from them
//! [`zerodp::model::train_model`].
//!
//! A run from a config records it in every checkpoint it saves (the manifest's `config`, under
//! [`CHECKPOINT_KEY`], with the model directory), so that `ckpt export` needs nothing but the
//! checkpoint: the config comes back with the trained weights and the tokenizer files are copied
//! from the directory the run started from.

use anyhow::{bail, Context};
use std::io::Write;
use std::path::{Path, PathBuf};
use zerodp::atomic_file::{AtomicDir, AtomicFile};
use zerodp::checkpoint::{load_manifest, read_params, Manifest, ModelDescription};
use zerodp::model::hf::{self, ExportDtype, HfConfig};
use zerodp::model::train_model::{build_model, spec_of, HfModel, TrainModel, CHECKPOINT_KEY};
use zerodp::model::GptConfig;
use zerodp::outputs::{check_outputs, NamedPath};

/// `train`'s model-directory flags.
#[derive(clap::Args, Debug, Clone)]
pub struct HfModelArgs {
    /// Fine-tune a Hugging Face GPT-2 or Llama model directory (config.json; model.safetensors
    /// or a sharded model.safetensors.index.json; F32/BF16/F16): the config is the model, the
    /// weights the start.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["model_config", "init", "preset", "layers", "width", "heads", "context"])]
    pub model_dir: Option<PathBuf>,
    /// Train the model a Hugging Face GPT-2 or Llama config.json describes, from the seeded
    /// initialisation.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["preset", "layers", "width", "heads", "context"])]
    pub model_config: Option<PathBuf>,
}

impl HfModelArgs {
    /// The model the flags name, if any (its notes printed).
    pub fn read(&self) -> anyhow::Result<Option<HfModel>> {
        let (path, dir) = match (&self.model_dir, &self.model_config) {
            (Some(d), _) => (d.join(hf::CONFIG_FILE), Some(d.clone())),
            (None, Some(f)) => (f.clone(), None),
            (None, None) => return Ok(None),
        };
        let config = HfConfig::read(&path)?;
        for note in &config.notes {
            errln!("note: {note}");
        }
        Ok(Some(HfModel { config, dir }))
    }

    /// Every file the flags make a run read, as inputs of the output-path checks: `--model-config`,
    /// or the model directory and each of its files (config, weights, index and shards, tokenizer
    /// files), so that a link to one elsewhere is caught too.
    pub fn inputs(&self) -> Vec<(&'static str, PathBuf)> {
        let mut inputs = Vec::new();
        if let Some(f) = &self.model_config {
            inputs.push(("--model-config", f.clone()));
        }
        let Some(dir) = &self.model_dir else {
            return inputs;
        };
        inputs.push(("--model-dir", dir.clone()));
        let files = [hf::CONFIG_FILE, hf::WEIGHTS_FILE, hf::INDEX_FILE]
            .into_iter()
            .chain(hf::TOKENIZER_FILES)
            .map(|n| dir.join(n))
            .chain(hf::weight_files(dir).unwrap_or_default());
        inputs.extend(files.filter(|p| p.is_file()).map(|p| ("--model-dir", p)));
        inputs
    }
}

/// The models the `ranks` ranks of this process compute with. On a GPU one per rank, rank r's on
/// its GPU (`--device cuda` spreads in-process ranks over the GPUs, `cuda:N` puts them all
/// there), each keeping there what the run allows it ([`TrainModel::keep_on_gpu`]: its own device
/// tier at stages 0-2); on the CPU one model for all (it holds nothing of a rank's). `first` is
/// `args` opened for rank 0.
pub fn rank_models(
    gpt: &GptConfig,
    model: Option<&HfModel>,
    (args, precision, first): (
        &super::device_args::DeviceArgs,
        zerodp::config::Precision,
        &super::device_args::OpenDevice,
    ),
    (cfg, ranks): (&zerodp::zero::EngineConfig, usize),
) -> anyhow::Result<Vec<TrainModel>> {
    if first.gpu.is_none() {
        return Ok(vec![build_model(gpt, model, first.on())?]);
    }
    let mut models = vec![build_model(gpt, model, first.on())?.keep_on_gpu(cfg)];
    for r in 1..ranks {
        let device = args.open_rank(precision, r)?;
        models.push(build_model(gpt, model, device.on())?.keep_on_gpu(cfg));
    }
    Ok(models)
}

/// `zerodp ckpt export`'s arguments.
#[derive(clap::Args, Debug)]
pub struct ExportArgs {
    /// A --save-dir (its `latest` checkpoint) or one checkpoint directory.
    pub dir: PathBuf,
    /// The Hugging Face directory to write (created if missing; outside any checkpoint and any
    /// model directory read).
    pub out: PathBuf,
    /// Weights dtype: f32, bf16 or f16 [default: the config's torch_dtype, else f32].
    #[arg(long)]
    pub dtype: Option<String>,
    /// Take the config and tokenizer files from this model directory rather than the ones the
    /// checkpoint recorded.
    #[arg(long, value_name = "DIR", conflicts_with = "model_config")]
    pub model_dir: Option<PathBuf>,
    /// Take the config from this Hugging Face config.json rather than the one the checkpoint
    /// recorded.
    #[arg(long, value_name = "FILE")]
    pub model_config: Option<PathBuf>,
    /// For a checkpoint of a zerodp preset (no Hugging Face config): the head count, the one size
    /// its tensors do not show.
    #[arg(long, conflicts_with_all = ["model_dir", "model_config"])]
    pub heads: Option<usize>,
}

/// Where the export's config and tokenizer files come from.
struct Source {
    config: HfConfig,
    tokenizer_dir: Option<PathBuf>,
    /// The `--tokenizer` file the run recorded, written as `tokenizer.json`.
    tokenizer_file: Option<PathBuf>,
}

pub fn run_export(a: ExportArgs) -> anyhow::Result<i32> {
    let (manifest, _) = load_manifest(&a.dir)?;
    let source = export_source(&a, &manifest)?;
    let spec = spec_of(&source.config)?;
    if let Some(what) = manifest.model.difference(&ModelDescription::of(&spec)) {
        bail!(
            "checkpoint {} does not match the config's {} ({} layers, width {}, {} heads, \
             vocabulary {}, context {}): {what}",
            a.dir.display(),
            if source.config.llama.is_some() {
                "Llama"
            } else {
                "GPT-2"
            },
            source.config.gpt.layers,
            source.config.gpt.width,
            source.config.gpt.heads,
            source.config.gpt.vocab_size,
            source.config.gpt.context
        );
    }
    let dtype = export_dtype(a.dtype.as_deref(), &source.config)?;
    check_export_paths(&a, &source)?;
    // Built beside OUT_DIR and renamed into place: OUT_DIR is what it was or a whole export.
    let building = AtomicDir::create(&a.out)
        .with_context(|| format!("creating a directory beside {}", a.out.display()))?;
    let (_, params) = read_params(&a.dir)?;
    let built = || -> anyhow::Result<hf::Exported> {
        let mut done = hf::export(
            building.path(),
            &source.config,
            &spec,
            &params,
            dtype,
            source.tokenizer_dir.as_deref(),
        )?;
        copy_tokenizer(&source, building.path(), &mut done.copied)?;
        write_export_marker(building.path(), &a.dir)?;
        Ok(done)
    };
    let done = built().with_context(|| {
        format!(
            "exporting to {} failed; it is as it was, and the partial export beside it is removed",
            a.out.display()
        )
    })?;
    building
        .commit()
        .with_context(|| format!("putting the export in place at {}", a.out.display()))?;
    errln!(
        "wrote {}: config.json, model.safetensors ({} bytes, {}){}",
        a.out.display(),
        done.weight_bytes,
        dtype.torch_name(),
        if done.copied.is_empty() {
            String::new()
        } else {
            format!(", {}", done.copied.join(", "))
        }
    );
    Ok(0)
}

/// `--dtype`, else the config's own dtype where it is one zerodp writes, else f32.
fn export_dtype(flag: Option<&str>, config: &HfConfig) -> anyhow::Result<ExportDtype> {
    if let Some(text) = flag {
        return ExportDtype::parse(text)
            .with_context(|| format!("--dtype {text}: choose f32, bf16 or f16"));
    }
    match config.dtype() {
        None => Ok(ExportDtype::F32),
        Some(text) => Ok(ExportDtype::parse(text).unwrap_or_else(|| {
            errln!("note: the config's dtype {text} is not f32, bf16 or f16: writing f32");
            ExportDtype::F32
        })),
    }
}

/// The config and tokenizer directory: the flags', else what the checkpoint recorded, else a
/// GPT-2 config of the checkpoint's shapes with `--heads`.
fn export_source(a: &ExportArgs, manifest: &Manifest) -> anyhow::Result<Source> {
    let entry = manifest.config.get(CHECKPOINT_KEY);
    let recorded = |key: &str| entry.and_then(|e| e[key].as_str()).map(PathBuf::from);
    let recorded_config = entry.map(|e| &e["config"]).filter(|c| !c.is_null());
    let (config, tokenizer_dir) = if let Some(dir) = &a.model_dir {
        (
            HfConfig::read(&dir.join(hf::CONFIG_FILE))?,
            Some(dir.clone()),
        )
    } else if let Some(file) = &a.model_config {
        (HfConfig::read(file)?, None)
    } else if let Some(json) = recorded_config {
        if a.heads.is_some() {
            bail!(
                "--heads is for a checkpoint of a zerodp preset; checkpoint {} records the Hugging \
                 Face config it was trained from, whose head count is exported: drop --heads",
                a.dir.display()
            );
        }
        let config = HfConfig::from_json(json.clone(), &a.dir.join("manifest.json"))?;
        (config, recorded("model_dir").filter(|d| d.is_dir()))
    } else if let Some(heads) = a.heads {
        (HfConfig::for_gpt(&gpt_of(manifest, heads)?), None)
    } else {
        bail!(
            "checkpoint {} was not trained from a Hugging Face config: pass --model-config FILE \
             (a GPT-2 config.json of the same sizes), --model-dir DIR, or --heads N for a zerodp \
             preset",
            a.dir.display()
        );
    };
    Ok(Source {
        config,
        tokenizer_dir,
        tokenizer_file: recorded("tokenizer").filter(|f| f.is_file()),
    })
}

/// Copies the run's `--tokenizer` file as `tokenizer.json` (with the `tokenizer_config.json` and
/// `special_tokens_map.json` beside it), unless the model directory's were copied.
fn copy_tokenizer(source: &Source, out: &Path, copied: &mut Vec<String>) -> anyhow::Result<()> {
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
        let bytes = std::fs::read(&src).with_context(|| format!("reading {}", src.display()))?;
        let dst = out.join(name);
        let mut f =
            AtomicFile::create(&dst).with_context(|| format!("writing {}", dst.display()))?;
        f.write_all(&bytes)
            .and_then(|()| f.commit())
            .with_context(|| format!("writing {}", dst.display()))?;
        copied.push(name.to_string());
    }
    Ok(())
}

/// A GPT's sizes from a checkpoint's tensor shapes (`wte` `[V, C]`, `wpe` `[T, C]`, one unit per
/// block between the embeddings and the head) and the head count.
fn gpt_of(manifest: &Manifest, heads: usize) -> anyhow::Result<GptConfig> {
    let units = &manifest.model.units;
    let shape = |name: &str| {
        units
            .first()
            .and_then(|u| u.params.iter().find(|p| p.name == name))
            .map(|p| p.shape.clone())
            .filter(|s| s.len() == 2)
            .with_context(|| format!("the checkpoint has no 2-d {name}: not a zerodp GPT"))
    };
    let (wte, wpe) = (shape("wte.weight")?, shape("wpe.weight")?);
    Ok(GptConfig {
        vocab_size: wte[0],
        context: wpe[0],
        layers: units.len().saturating_sub(2),
        heads,
        width: wte[1],
    })
}

/// The file that marks a directory as a zerodp export (what it was exported from), so that a
/// later export may replace it and nothing else.
const EXPORT_MARKER: &str = ".zerodp-export.json";

fn write_export_marker(dir: &Path, checkpoint: &Path) -> anyhow::Result<()> {
    let checkpoint = std::fs::canonicalize(checkpoint).unwrap_or_else(|_| checkpoint.into());
    let text = serde_json::json!({ "exported_from": checkpoint.to_string_lossy() }).to_string();
    let path = dir.join(EXPORT_MARKER);
    zerodp::atomic_file::write_atomic(&path, format!("{text}\n").as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

/// An existing `OUT_DIR` may be replaced when it is empty, or an earlier export holding only the
/// files an export writes; anything else would be lost, so it is refused, naming it.
fn check_replaceable(out: &Path) -> anyhow::Result<()> {
    if !out.is_dir() {
        bail!("OUT_DIR {} exists and is not a directory", out.display());
    }
    let mut names: Vec<String> = std::fs::read_dir(out)
        .with_context(|| format!("reading OUT_DIR {}", out.display()))?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_, _>>()
        .with_context(|| format!("reading OUT_DIR {}", out.display()))?;
    names.sort();
    if names.is_empty() {
        return Ok(());
    }
    if !names.iter().any(|n| n == EXPORT_MARKER) {
        bail!(
            "OUT_DIR {} is not empty and is not an earlier zerodp export (it holds {}): an export \
             replaces the whole directory; choose a new or empty directory",
            out.display(),
            listed(&names)
        );
    }
    let written = [hf::CONFIG_FILE, hf::WEIGHTS_FILE, EXPORT_MARKER];
    let other: Vec<String> = names
        .into_iter()
        .filter(|n| !written.contains(&n.as_str()) && !hf::TOKENIZER_FILES.contains(&n.as_str()))
        .collect();
    if !other.is_empty() {
        bail!(
            "OUT_DIR {} is an earlier zerodp export that now also holds {}, which a new export \
             would delete: move it out, or choose another directory",
            out.display(),
            listed(&other)
        );
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
/// ([`check_replaceable`]); it is built beside `OUT_DIR`, so that directory must be writable.
fn check_export_paths(a: &ExportArgs, source: &Source) -> anyhow::Result<()> {
    let mut inputs = vec![NamedPath {
        name: "checkpoint",
        path: &a.dir,
    }];
    for (name, p) in [
        ("--model-dir", a.model_dir.as_deref()),
        ("--model-config", a.model_config.as_deref()),
        ("the model directory", source.tokenizer_dir.as_deref()),
        ("the tokenizer", source.tokenizer_file.as_deref()),
    ] {
        if let Some(path) = p {
            inputs.push(NamedPath { name, path });
        }
    }
    // OUT_DIR as a path (where it will be, not inside what is read or a checkpoint), checked
    // as the file it replaces when it is new, else through a name inside it.
    let probe = a.out.join(EXPORT_MARKER);
    let as_output = match a.out.exists() {
        false => &a.out,
        true => &probe,
    };
    check_outputs(
        &inputs,
        &[NamedPath {
            name: "OUT_DIR",
            path: as_output,
        }],
    )?;
    if a.out.exists() {
        check_replaceable(&a.out)?;
    }
    Ok(())
}
