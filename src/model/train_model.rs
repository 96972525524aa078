//! The GPT-or-Llama model a program trains by name: a zerodp GPT preset, a GPT-2 config or a
//! Llama config ([`TrainModel`], one [`UnitModel`] either way), built on a device
//! ([`build_model`]), with the Hugging Face directory it may start from ([`HfModel`]: its config,
//! its weights checked from their headers and loaded) and what checkpoints record of it
//! ([`checkpoint_config`]). `zerodp train` and `bench train` are its users; a Rust program
//! fine-tuning a Llama directory uses it the same way.

use candle_core::{DType, Device, Tensor};
use serde_json::Value;
use std::path::{Path, PathBuf};

use super::hf::{self, HfConfig, HfError};
use super::llama::Llama;
use super::{Candle, CandleSaved, CandleUnits, Gpt, GptConfig, GptModel, GptSaved};
use crate::data::TokenBatch;
use crate::zero::unit::{BatchCounts, ForwardMode, ModelError, ModelSpec, UnitForward, UnitModel};

/// The key of the resolved config recorded in checkpoints that holds the model's Hugging Face
/// config and directory and the `--tokenizer` file.
pub const CHECKPOINT_KEY: &str = "zerodp_hf_model";

/// A model read from Hugging Face files: its config and, for `--model-dir`, the directory.
pub struct HfModel {
    pub config: HfConfig,
    pub dir: Option<PathBuf>,
}

impl HfModel {
    /// The directory's weight files checked against `spec` from their headers alone (names,
    /// shapes, dtypes, sizes): a broken file is found before the data is tokenized.
    pub fn check_weights(&self, spec: &ModelSpec) -> Result<(), HfError> {
        match &self.dir {
            Some(dir) => hf::check_weights(dir, spec),
            None => Ok(()),
        }
    }

    /// The directory's weights for `spec` (`None` from a bare config: the seeded start).
    pub fn initial_weights(&self, spec: &ModelSpec) -> Result<Option<Vec<Vec<f32>>>, HfError> {
        let Some(dir) = &self.dir else {
            return Ok(None);
        };
        hf::load_weights(dir, spec).map(Some)
    }
}

/// The resolved config recorded in checkpoints, with the Hugging Face config and directory added
/// under [`CHECKPOINT_KEY`] (so that `ckpt export` needs only the checkpoint).
pub fn checkpoint_config(
    mut config: Value,
    model: Option<&HfModel>,
    tokenizer: Option<&Path>,
) -> Value {
    let Some(map) = config.as_object_mut() else {
        return config;
    };
    if model.is_none() && tokenizer.is_none() {
        return config;
    }
    let absolute = |p: &Path| {
        let p = std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
        Value::from(p.to_string_lossy().into_owned())
    };
    let entry = serde_json::json!({
        "config": model.map(|m| &m.config.json),
        "model_dir": model.and_then(|m| m.dir.as_deref()).map(absolute),
        "tokenizer": tokenizer.map(absolute),
    });
    map.insert(CHECKPOINT_KEY.into(), entry);
    config
}

/// The model `train` trains: the GPT (presets, GPT-2 configs) or a Llama config's model, one
/// [`UnitModel`] for the trainer either way.
pub enum TrainModel {
    Gpt(GptModel),
    Llama(Candle<Llama>),
}

/// What a [`TrainModel`]'s forward keeps for backward.
pub enum TrainSaved {
    Gpt(GptSaved),
    Llama(CandleSaved),
}

impl TrainModel {
    /// The whole model as one graph, forward and backward once: the loss and every unit's
    /// gradient (the reference the engine's unit-by-unit passes are tested against).
    pub fn end_to_end(
        &self,
        params: &[&[f32]],
        batch: &TokenBatch,
        loss_weight: f32,
    ) -> Result<(f64, Vec<Vec<f32>>), ModelError> {
        match self {
            TrainModel::Gpt(m) => m.end_to_end(params, batch, loss_weight),
            TrainModel::Llama(m) => m.end_to_end(params, batch, loss_weight),
        }
    }

    /// Model FLOPs of one training token (the PaLM convention, [`GptConfig::flops_per_token`]) at
    /// the context of `gpt` (the GPT's config, or the Llama's GPT of the same widths).
    pub fn flops_per_token(&self, gpt: &GptConfig) -> f64 {
        match self {
            TrainModel::Gpt(_) => gpt.flops_per_token(),
            TrainModel::Llama(m) => m.units().config().flops_per_token(gpt.context),
        }
    }

    /// The same model on candle's composite ops (CPU only: what a GPU runs, and the fused
    /// kernels' reference in `bench train --composite-ops`).
    pub fn on_composite_ops(self) -> Result<TrainModel, ModelError> {
        Ok(match self {
            TrainModel::Gpt(m) => {
                let c = m.config().clone();
                TrainModel::Gpt(GptModel::with_options(c, DType::F32, false)?)
            }
            TrainModel::Llama(m) => TrainModel::Llama(Candle::new(m.into_units().composite())),
        })
    }

    /// On a GPU, keep there what the run allows one rank's model: the device tier (parameters,
    /// gradients, the fp32 master and Adam's moments of the rank's part, and Adam itself;
    /// [`Candle::with_device_tier`]) where [`crate::zero::device_tier::refusal`] finds nothing
    /// against it, else the parameters between steps where every rank holds them all anyway
    /// (stages 0-2, [`Candle::with_resident_params`]; at stage 3 each unit's are copied there
    /// when it runs). Nothing changes on the CPU.
    pub fn keep_on_gpu(self, cfg: &crate::zero::EngineConfig) -> TrainModel {
        let tier = crate::zero::device_tier::refusal(cfg).is_none();
        let resident = !tier && !cfg.stage.shards_params();
        match self {
            TrainModel::Gpt(m) if !m.candle().device().is_cpu() => {
                TrainModel::Gpt(m.with_resident_params(resident).with_device_tier(tier))
            }
            TrainModel::Llama(m) if !m.device().is_cpu() => {
                TrainModel::Llama(m.with_resident_params(resident).with_device_tier(tier))
            }
            other => other,
        }
    }

    /// The architecture's name, for the run's banner.
    pub fn arch(&self) -> &'static str {
        match self {
            TrainModel::Gpt(_) => "GPT",
            TrainModel::Llama(_) => "Llama",
        }
    }
}

/// The model of `gpt` (a preset), of the GPT-2 config `model` holds (all its positions, however
/// long the windows `gpt.context` says), or of its Llama-family config, on `device`, computing in
/// `dtype`.
pub fn build_model(
    gpt: &GptConfig,
    model: Option<&HfModel>,
    (on, dtype): (Device, DType),
) -> Result<TrainModel, ModelError> {
    match model.and_then(|m| m.config.llama.clone()) {
        Some(llama) => Ok(TrainModel::Llama(Candle::new(
            Llama::new(llama)?.on_device(on, dtype)?,
        ))),
        None => Ok(TrainModel::Gpt(GptModel::on_device(
            model.map_or(gpt, |m| &m.config.gpt).clone(),
            dtype,
            on,
        )?)),
    }
}

/// What `Trainer::with_rank_models` takes for the models of each rank: each rank's, or none where
/// one model serves every rank.
pub fn per_rank<'m>(models: impl IntoIterator<Item = &'m TrainModel>) -> Vec<&'m TrainModel> {
    let models: Vec<&TrainModel> = models.into_iter().collect();
    match models.len() > 1 {
        true => models,
        false => Vec::new(),
    }
}

/// The units and parameters of the model `config` describes.
pub fn spec_of(config: &HfConfig) -> Result<ModelSpec, ModelError> {
    Ok(match &config.llama {
        Some(l) => CandleUnits::spec(&Llama::new(l.clone())?).clone(),
        None => CandleUnits::spec(&Gpt::new(config.gpt.clone())?).clone(),
    })
}

fn mismatched(unit: usize) -> ModelError {
    ModelError::Invalid(format!(
        "backward of unit {unit} was given another model's saved state"
    ))
}

impl UnitModel for TrainModel {
    type Batch = TokenBatch;
    type Act = Tensor;
    type Saved = TrainSaved;

    fn spec(&self) -> &ModelSpec {
        match self {
            TrainModel::Gpt(m) => m.spec(),
            TrainModel::Llama(m) => m.spec(),
        }
    }

    fn batch_counts(&self, batch: &TokenBatch) -> BatchCounts {
        batch.counts()
    }

    fn loss_tokens(&self, batch: &TokenBatch) -> usize {
        batch.loss_tokens()
    }

    fn init_params(&self, unit: usize, seed: u64, out: &mut [f32]) {
        match self {
            TrainModel::Gpt(m) => m.init_params(unit, seed, out),
            TrainModel::Llama(m) => m.init_params(unit, seed, out),
        }
    }

    fn forward(
        &self,
        unit: usize,
        params: &[&[f32]],
        input: Option<&Tensor>,
        batch: &TokenBatch,
        mode: ForwardMode,
    ) -> Result<UnitForward<Tensor, TrainSaved>, ModelError> {
        Ok(match self {
            TrainModel::Gpt(m) => {
                let f = m.forward(unit, params, input, batch, mode)?;
                UnitForward {
                    output: f.output,
                    loss: f.loss,
                    saved: f.saved.map(TrainSaved::Gpt),
                }
            }
            TrainModel::Llama(m) => {
                let f = m.forward(unit, params, input, batch, mode)?;
                UnitForward {
                    output: f.output,
                    loss: f.loss,
                    saved: f.saved.map(TrainSaved::Llama),
                }
            }
        })
    }

    fn parameters_changed(&self) {
        match self {
            TrainModel::Gpt(m) => m.parameters_changed(),
            TrainModel::Llama(m) => m.parameters_changed(),
        }
    }

    fn backward(
        &self,
        unit: usize,
        saved: TrainSaved,
        grad_output: Option<&Tensor>,
        loss_weight: f32,
        grads: &mut [&mut [f32]],
    ) -> Result<Option<Tensor>, ModelError> {
        match (self, saved) {
            (TrainModel::Gpt(m), TrainSaved::Gpt(s)) => {
                m.backward(unit, s, grad_output, loss_weight, grads)
            }
            (TrainModel::Llama(m), TrainSaved::Llama(s)) => {
                m.backward(unit, s, grad_output, loss_weight, grads)
            }
            _ => Err(mismatched(unit)),
        }
    }
}
