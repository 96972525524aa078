//! An MLP classifier written on zerodp's candle helper, as a user would write it outside the
//! crate (only `zerodp::` public API, `candle_core` and `candle_nn`). Shared by the example's
//! `main.rs` and by `tests/example_mlp.rs`.
//!
//! # Model
//! `features -> hidden` (ReLU), `layers` times `hidden -> hidden` (ReLU), `hidden -> classes`,
//! softmax cross-entropy (`candle_nn::loss::cross_entropy`, composite ops that have a backward).
//!
//! # Units
//! | unit | name | owns |
//! | --- | --- | --- |
//! | 0 | `input` | `input.weight [H, F]`, `input.bias [H]` |
//! | 1..=L | `hidden.{i}` | `hidden.{i}.weight [H, H]`, `hidden.{i}.bias [H]` |
//! | L+1 | `head` | `head.weight [K, H]`, `head.bias [K]` |
//!
//! Linear weights are `[out, in]` (`y = x W^T + b`), like `torch.nn.Linear`. Nothing is tied, so
//! every unit's `uses` is empty.
//!
//! # Data
//! [`Spirals`]: `classes` interleaved noisy spiral arms in the plane, generated from a seed. Sample
//! `i` is a pure function of `(seed, i)`, and the micro-batch of a [`BatchIndex`] holds the samples
//! `step * train_batch_size + (micro * world_size + rank) * micro_batch_size ..` (the next
//! `micro_batch_size`), so a step's global batch is the same samples at every world size.
#![allow(dead_code)]

use candle_core::{Device, Tensor};
use zerodp::model::{mix_seed, CandleUnits, SplitMix64};
use zerodp::trainer::BatchIndex;
use zerodp::zero::unit::{BatchCounts, ModelError, ModelSpec, ParamSpec, UnitSpec};

/// The sizes of an [`Mlp`].
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

/// One micro-batch: `n` rows of `features` values (row-major) and one class label per row.
#[derive(Clone, Debug, PartialEq)]
pub struct Rows {
    pub features: Vec<f32>,
    pub labels: Vec<u32>,
    pub n: usize,
}

/// The MLP's units (a [`CandleUnits`]); `zerodp::model::Candle::new(Mlp::new(cfg)?)` is the
/// `UnitModel` the trainer runs.
pub struct Mlp {
    cfg: MlpConfig,
    spec: ModelSpec,
}

fn linear_unit(name: String, out: usize, inp: usize) -> UnitSpec {
    UnitSpec {
        params: vec![
            ParamSpec {
                name: format!("{name}.weight"),
                shape: vec![out, inp],
            },
            ParamSpec {
                name: format!("{name}.bias"),
                shape: vec![out],
            },
        ],
        name,
        uses: vec![],
    }
}

impl Mlp {
    pub fn new(cfg: MlpConfig) -> Result<Self, ModelError> {
        if cfg.features == 0 || cfg.hidden == 0 || cfg.classes < 2 {
            return Err(ModelError::Invalid(format!(
                "an MLP needs at least one feature, one hidden unit and two classes, got {cfg:?}"
            )));
        }
        let mut units = vec![linear_unit("input".into(), cfg.hidden, cfg.features)];
        for i in 0..cfg.layers {
            units.push(linear_unit(format!("hidden.{i}"), cfg.hidden, cfg.hidden));
        }
        units.push(linear_unit("head".into(), cfg.classes, cfg.hidden));
        Ok(Mlp {
            cfg,
            spec: ModelSpec { units },
        })
    }

    pub fn config(&self) -> &MlpConfig {
        &self.cfg
    }

    fn is_head(&self, unit: usize) -> bool {
        unit + 1 == self.spec.units.len()
    }

    /// The logits `[n, classes]` of the head from its parameters and the last hidden activation.
    fn logits(p: &[Tensor], x: &Tensor) -> candle_core::Result<Tensor> {
        x.matmul(&p[0].t()?)?.broadcast_add(&p[1])
    }

    /// Every unit but the head: `relu(x W^T + b)`, `x` the batch's features for unit 0.
    fn layer(
        &self,
        unit: usize,
        p: &[Tensor],
        input: Option<&Tensor>,
        batch: &Rows,
    ) -> candle_core::Result<Tensor> {
        let x = match input {
            Some(x) => x.clone(),
            None if unit == 0 => {
                Tensor::from_slice(&batch.features, (batch.n, self.cfg.features), &Device::Cpu)?
            }
            None => candle_core::bail!("unit {unit} needs the previous unit's output"),
        };
        x.matmul(&p[0].t()?)?.broadcast_add(&p[1])?.relu()
    }

    /// Predicted classes of `rows` from the trained parameters (one flat buffer per unit, as
    /// `Trainer::keep_params` hands them back).
    pub fn predict(&self, params: &[Vec<f32>], rows: &Rows) -> candle_core::Result<Vec<u32>> {
        let mut x: Option<Tensor> = None;
        for (u, spec) in self.spec.units.iter().enumerate() {
            let p = spec
                .params
                .iter()
                .zip(spec.offsets())
                .map(|(ps, off)| {
                    Tensor::from_slice(
                        &params[u][off..off + ps.numel()],
                        ps.shape.as_slice(),
                        &Device::Cpu,
                    )
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            if self.is_head(u) {
                let x = x.as_ref().expect("the head comes after the input unit");
                return Self::logits(&p, x)?.argmax(1)?.to_vec1::<u32>();
            }
            x = Some(self.layer(u, &p, x.as_ref(), rows)?);
        }
        candle_core::bail!("the model has no head")
    }
}

impl CandleUnits for Mlp {
    type Batch = Rows;

    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn batch_counts(&self, batch: &Rows) -> BatchCounts {
        BatchCounts {
            samples: batch.n,
            tokens: batch.n,
        }
    }

    /// He-normal weights (`std = sqrt(2 / fan_in)`, the head `sqrt(1 / fan_in)`), zero biases; one
    /// splitmix64 stream per unit from `(seed, unit)`.
    fn init_params(&self, unit: usize, seed: u64, out: &mut [f32]) {
        let weight = &self.spec.units[unit].params[0];
        let fan_in = weight.shape[1] as f64;
        let gain = if self.is_head(unit) { 1.0 } else { 2.0 };
        let std = (gain / fan_in).sqrt();
        let mut rng = SplitMix64::new(mix_seed(&[seed, unit as u64]));
        let (w, b) = out.split_at_mut(weight.numel());
        w.iter_mut().for_each(|v| *v = (rng.normal() * std) as f32);
        b.fill(0.0);
    }

    fn forward_unit(
        &self,
        unit: usize,
        params: &[Tensor],
        input: Option<&Tensor>,
        batch: &Rows,
    ) -> candle_core::Result<Tensor> {
        if !self.is_head(unit) {
            return self.layer(unit, params, input, batch);
        }
        let x = input.ok_or_else(|| candle_core::Error::Msg("the head needs an input".into()))?;
        let labels = Tensor::from_slice(&batch.labels, batch.n, &Device::Cpu)?;
        // Mean softmax cross-entropy over the micro-batch (log_softmax + nll, both composite).
        candle_nn::loss::cross_entropy(&Self::logits(params, x)?, &labels)
    }

    fn check_batch(&self, batch: &Rows) -> Result<(), ModelError> {
        if batch.n == 0
            || batch.features.len() != batch.n * self.cfg.features
            || batch.labels.len() != batch.n
        {
            return Err(ModelError::Invalid(format!(
                "a batch of {} rows needs {} features and {} labels, got {} and {}",
                batch.n,
                batch.n * self.cfg.features,
                batch.n,
                batch.features.len(),
                batch.labels.len()
            )));
        }
        if let Some(&bad) = batch
            .labels
            .iter()
            .find(|&&l| l as usize >= self.cfg.classes)
        {
            return Err(ModelError::Invalid(format!(
                "label {bad} is not one of the {} classes",
                self.cfg.classes
            )));
        }
        Ok(())
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
