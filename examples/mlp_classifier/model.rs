//! An MLP classifier written on zerodp's candle helper, as a user would write it outside the
//! crate (only `zerodp::` public API, `candle_core` and `candle_nn`). Shared by the example's
//! `main.rs` and by `tests/it/zero/example_mlp.rs`.
//!
//! # Model
//! `features -> hidden` (ReLU), `layers` times `hidden -> hidden` (ReLU), `hidden -> classes`,
//! softmax cross-entropy (`candle_nn::loss::cross_entropy`, composite ops that have a backward).
//! Every layer is a `candle_nn::linear`, made from a `VarBuilder` as candle-transformers makes its
//! layers: [`mlp_units`] wraps each in a unit in a few lines ([`zerodp::model::VarUnits`] finds
//! the parameters' names, shapes and initialisers from what `candle_nn::linear` asks for), and
//! [`predict`] builds the same layers again from the trained parameters.
//!
//! # Units
//! | unit | name | owns |
//! | --- | --- | --- |
//! | 0 | `input` | `input.weight [H, F]`, `input.bias [H]` |
//! | 1..=L | `hidden.{i}` | `hidden.{i}.weight [H, H]`, `hidden.{i}.bias [H]` |
//! | L+1 | `head` | `head.weight [K, H]`, `head.bias [K]` |
//!
//! Linear weights are `[out, in]` (`y = x W^T + b`), like `torch.nn.Linear`, initialised as
//! `candle_nn::linear` asks: Kaiming-normal weights, biases uniform in `±1/sqrt(in)`.
//!
//! # Data
//! [`Spirals`]: `classes` interleaved noisy spiral arms in the plane, generated from a seed. Sample
//! `i` is a pure function of `(seed, i)`, and the micro-batch of a [`BatchIndex`] holds the samples
//! `step * train_batch_size + (micro * world_size + rank) * micro_batch_size ..` (the next
//! `micro_batch_size`), so a step's global batch is the same samples at every world size.
#![allow(dead_code)]

use candle_core::{Device, Tensor};
use candle_nn::{linear, Module};
use zerodp::model::VarUnits;
use zerodp::rng::{mix_seed, SplitMix64};
use zerodp::trainer::BatchIndex;
use zerodp::zero::unit::{BatchCounts, ModelError};

/// The sizes of the MLP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlpConfig {
    /// Input features per sample.
    pub features: usize,
    /// Width of every hidden layer.
    pub hidden: usize,
    /// Hidden `hidden -> hidden` layers after the input layer.
    pub layers: usize,
    pub classes: usize,
}

impl MlpConfig {
    /// The linear layers in order: `(name, in, out)`; one unit each.
    pub fn layers(&self) -> Vec<(String, usize, usize)> {
        let mut layers = vec![("input".to_string(), self.features, self.hidden)];
        for i in 0..self.layers {
            layers.push((format!("hidden.{i}"), self.hidden, self.hidden));
        }
        layers.push(("head".to_string(), self.hidden, self.classes));
        layers
    }
}

/// One micro-batch: `n` rows of `features` values (row-major) and one class label per row.
#[derive(Clone, Debug, PartialEq)]
pub struct Rows {
    pub features: Vec<f32>,
    pub labels: Vec<u32>,
    pub n: usize,
}

impl Rows {
    fn x(&self) -> candle_core::Result<Tensor> {
        let width = self.features.len() / self.n.max(1);
        Tensor::from_slice(&self.features, (self.n, width), &Device::Cpu)
    }
}

/// The MLP's units: `zerodp::model::Candle::new(mlp_units(cfg)?)` is the `UnitModel` the trainer
/// runs. Each unit is a `candle_nn::linear` and what follows it.
pub fn mlp_units(cfg: MlpConfig) -> Result<VarUnits<Rows>, ModelError> {
    if cfg.features == 0 || cfg.hidden == 0 || cfg.classes < 2 {
        return Err(ModelError::Invalid(format!(
            "an MLP needs at least one feature, one hidden unit and two classes, got {cfg:?}"
        )));
    }
    let mut units = VarUnits::new(|b: &Rows| BatchCounts {
        samples: b.n,
        tokens: b.n,
    })
    .check_batch(move |b| check_rows(&cfg, b));
    let mut layers = cfg.layers();
    let (head, h, k) = layers.pop().expect("an MLP has a head");
    for (i, (name, inp, out)) in layers.into_iter().enumerate() {
        let prefix = name.clone();
        units = units.unit(
            name,
            move |vb| linear(inp, out, vb.pp(&prefix)),
            move |layer, x, b: &Rows| match (i, x) {
                (0, _) => layer.forward(&b.x()?)?.relu(),
                (_, Some(x)) => layer.forward(x)?.relu(),
                (_, None) => candle_core::bail!("unit {i} needs the previous unit's output"),
            },
        )?;
    }
    // Mean softmax cross-entropy over the micro-batch (log_softmax + nll, both composite).
    units.unit(
        head.clone(),
        move |vb| linear(h, k, vb.pp(&head)),
        |layer, x, b: &Rows| {
            let x = x.ok_or_else(|| candle_core::Error::Msg("the head needs an input".into()))?;
            let labels = Tensor::from_slice(&b.labels, b.n, &Device::Cpu)?;
            candle_nn::loss::cross_entropy(&layer.forward(x)?, &labels)
        },
    )
}

/// Predicted classes of `rows` from the trained parameters (one flat buffer per unit, as
/// `Trainer::keep_params` hands them back): the same layers, built from them by name.
pub fn predict(
    cfg: &MlpConfig,
    units: &VarUnits<Rows>,
    params: &[Vec<f32>],
    rows: &Rows,
) -> Result<Vec<u32>, Box<dyn std::error::Error>> {
    let vb = units.var_builder(params)?;
    let layers = cfg.layers();
    let mut x = rows.x()?;
    for (i, (name, inp, out)) in layers.iter().enumerate() {
        x = linear(*inp, *out, vb.pp(name))?.forward(&x)?;
        if i + 1 < layers.len() {
            x = x.relu()?;
        }
    }
    Ok(x.argmax(1)?.to_vec1::<u32>()?)
}

/// Sizes and labels of a micro-batch, before any unit computes on it.
fn check_rows(cfg: &MlpConfig, batch: &Rows) -> Result<(), ModelError> {
    if batch.n == 0
        || batch.features.len() != batch.n * cfg.features
        || batch.labels.len() != batch.n
    {
        return Err(ModelError::Invalid(format!(
            "a batch of {} rows needs {} features and {} labels, got {} and {}",
            batch.n,
            batch.n * cfg.features,
            batch.n,
            batch.features.len(),
            batch.labels.len()
        )));
    }
    match batch.labels.iter().find(|&&l| l as usize >= cfg.classes) {
        Some(bad) => Err(ModelError::Invalid(format!(
            "label {bad} is not one of the {} classes",
            cfg.classes
        ))),
        None => Ok(()),
    }
}

/// Noisy spiral arms in the plane, one per class (2 features).
#[derive(Clone, Copy, Debug)]
pub struct Spirals {
    pub seed: u64,
    pub classes: usize,
    /// Standard deviation of the angle noise, in radians.
    pub noise: f64,
}

impl Spirals {
    pub const FEATURES: usize = 2;

    /// Sample `index`: class `index % classes`, radius `r` uniform in `[0, 1)`, angle
    /// `2 pi class / classes + 4 r + noise`, features `(r sin angle, r cos angle)`.
    pub fn sample(&self, index: u64) -> ([f32; 2], u32) {
        let class = (index % self.classes as u64) as u32;
        let mut rng = SplitMix64::new(mix_seed(&[self.seed, index]));
        let r = rng.next_f64();
        let angle = std::f64::consts::TAU * f64::from(class) / self.classes as f64
            + 4.0 * r
            + self.noise * rng.normal();
        ([(r * angle.sin()) as f32, (r * angle.cos()) as f32], class)
    }

    /// Samples `start..start + n`.
    pub fn rows(&self, start: u64, n: usize) -> Rows {
        let mut features = Vec::with_capacity(n * Self::FEATURES);
        let mut labels = Vec::with_capacity(n);
        for i in 0..n as u64 {
            let (x, y) = self.sample(start + i);
            features.extend_from_slice(&x);
            labels.push(y);
        }
        Rows {
            features,
            labels,
            n,
        }
    }

    /// The micro-batch `at` names: the same global batch per step at every world size.
    pub fn micro_batch(&self, at: BatchIndex) -> Rows {
        let first = at.step * at.train_batch_size as u64
            + ((at.micro * at.world_size + at.rank) * at.micro_batch_size) as u64;
        self.rows(first, at.micro_batch_size)
    }
}

/// The fraction of `predicted` equal to `rows.labels`.
pub fn accuracy(predicted: &[u32], rows: &Rows) -> f64 {
    let right = predicted
        .iter()
        .zip(&rows.labels)
        .filter(|(p, l)| p == l)
        .count();
    right as f64 / rows.n.max(1) as f64
}
