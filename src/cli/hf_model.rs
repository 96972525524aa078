//! Hugging Face model directories on the command line: `train --model-dir DIR` (fine-tune from a
//! directory's weights), `train --model-config FILE` (the model a config describes, from scratch)
//! and `ckpt export CKPT OUT_DIR` (a directory `transformers` loads), for GPT-2 and Llama; the
//! reading and writing is [`zerodp::model::hf`], the model built from them
//! [`zerodp::model::train_model`], the export [`zerodp::model::export`].

use anyhow::Context;
use std::path::PathBuf;
use zerodp::model::export::{export_checkpoint, ConfigSource, ExportRequest};
use zerodp::model::hf::{self, ExportDtype, HfConfig};
use zerodp::model::train_model::{build_model, HfModel, TrainModel};
use zerodp::model::GptConfig;

/// `train`'s model-directory flags.
#[derive(clap::Args, Debug, Clone)]
pub struct HfModelArgs {
    /// Fine-tune a Hugging Face GPT-2 or Llama model directory (config.json; model.safetensors
    /// or a sharded model.safetensors.index.json; F32/BF16/F16): the config is the model, the
    /// weights the start.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["model_config", "init", "preset", "layers", "width", "heads"])]
    pub model_dir: Option<PathBuf>,
    /// Train the model a Hugging Face GPT-2 or Llama config.json describes, from the seeded
    /// initialisation.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["preset", "layers", "width", "heads"])]
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

pub fn run_export(a: ExportArgs) -> anyhow::Result<i32> {
    let dtype = match a.dtype.as_deref() {
        None => None,
        Some(text) => Some(
            ExportDtype::parse(text)
                .with_context(|| format!("--dtype {text}: choose f32, bf16 or f16"))?,
        ),
    };
    let source = match (a.model_dir, a.model_config) {
        (Some(dir), _) => ConfigSource::ModelDir(dir),
        (None, Some(file)) => ConfigSource::ModelConfig(file),
        (None, None) => ConfigSource::Recorded { heads: a.heads },
    };
    let request = ExportRequest {
        checkpoint: a.dir,
        out: a.out,
        dtype,
        source,
    };
    let report = export_checkpoint(&request)?;
    for note in &report.notes {
        errln!("note: {note}");
    }
    let done = &report.exported;
    errln!(
        "wrote {}: config.json, model.safetensors ({} bytes, {}){}",
        request.out.display(),
        done.weight_bytes,
        done.dtype.torch_name(),
        if done.copied.is_empty() {
            String::new()
        } else {
            format!(", {}", done.copied.join(", "))
        }
    );
    Ok(0)
}
