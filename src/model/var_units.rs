//! A candle model's units built by closures from a `candle_nn::VarBuilder`, the way
//! candle-transformers writes its blocks, instead of listing every parameter by hand.
//!
//! [`VarUnits`] is a [`CandleUnits`]: wrap it in [`Candle`](super::Candle) and hand it to the
//! [`Trainer`](crate::trainer::Trainer). Each unit is two closures:
//!
//! * `build(vb) -> M` makes the unit's layers from a [`VarBuilder`], as any candle model does
//!   (`candle_nn::linear(64, 64, vb.pp("fc1"))`, or a candle-transformers block's `new`);
//! * `forward(&M, input, batch) -> Tensor` runs them: the unit's output, or the mean loss from the
//!   last unit (the rules of [`CandleUnits::forward_unit`]).
//!
//! `build` runs once when the unit is added, against a recording backend: the parameters it asks
//! the `VarBuilder` for (full dotted names, shapes, and the `candle_nn::Init` each layer gives
//! them) become the unit's [`ParamSpec`]s, in the order it asks for them. On every forward `build`
//! runs again, cheaply, against the unit's gathered parameter tensors bound to the same names, so
//! the module code runs unchanged. Initial values follow each parameter's `Init` (the same
//! distributions candle's `Init::var` draws from) from zerodp's deterministic stream per
//! `(seed, unit, parameter)` ([`init_values`]), not candle's thread RNG, so that every rank and
//! world size starts equal.
//!
//! # Example
//! A two-layer regression: each unit one `candle_nn::linear`, the head with the mean squared
//! error.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use candle_nn::{linear, Module};
//! use zerodp::model::{Candle, CandleUnits, VarUnits};
//! use zerodp::zero::unit::BatchCounts;
//!
//! struct Rows { x: Vec<f32>, y: Vec<f32>, n: usize }
//!
//! let units = VarUnits::new(|b: &Rows| BatchCounts { samples: b.n, tokens: b.n })
//!     .unit(
//!         "hidden",
//!         |vb| linear(3, 8, vb.pp("hidden")),
//!         |l, _, b: &Rows| l.forward(&Tensor::from_slice(&b.x, (b.n, 3), &Device::Cpu)?)?.tanh(),
//!     )?
//!     .unit(
//!         "head",
//!         |vb| linear(8, 1, vb.pp("head")),
//!         |l, h, b: &Rows| {
//!             let y = Tensor::from_slice(&b.y, (b.n, 1), &Device::Cpu)?;
//!             let h = h.ok_or_else(|| candle_core::Error::Msg("the head needs the hidden output".into()))?;
//!             (l.forward(h)? - y)?.sqr()?.mean_all()
//!         },
//!     )?;
//! let names: Vec<&str> = units.spec().units[1].params.iter().map(|p| p.name.as_str()).collect();
//! assert_eq!(names, ["head.weight", "head.bias"]);
//! let model = Candle::new(units); // a `UnitModel`: hand it to `zerodp::trainer::Trainer`
//! # Ok::<(), zerodp::zero::unit::ModelError>(())
//! ```
//!
//! # Rules
//! * Names are unique across units: a closure gets the root `VarBuilder`, so give each unit its
//!   own prefix (`vb.pp(format!("h.{i}"))`). A name another unit created is refused, unless that
//!   unit is listed in the unit's `uses` ([`VarUnits::unit_using`]): then it is that unit's tied
//!   weight (a language model's head reading the embedding table).
//! * `build` must ask for the same names and shapes every time (no branching on data).
//! * A unit must create or use at least one parameter (fold a parameter-free step into its
//!   neighbour).
//! * candle-nn's fused ops have no backward and cut the graph silently:
//!   `candle_nn::ops::softmax_last_dim`, `ops::layer_norm`, `ops::rms_norm`, and the `LayerNorm`
//!   and `RmsNorm` modules (`candle_nn::layer_norm`, `candle_nn::rms_norm`), which call them on
//!   contiguous input. Backward therefore refuses a unit's own parameter (or, past the first
//!   unit, its input) that got no gradient, naming it; use `ops::softmax(x, D::Minus1)`, `ops::layer_norm_slow` and
//!   `ops::rms_norm_slow`, or [`VarUnits::allow_unused_params`] for a parameter unused on purpose.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::init::NormalOrUniform;
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};

use super::candle_unit::{compute_err, CandleUnits};
use crate::rng::{mix_seed, SplitMix64};
use crate::zero::unit::{BatchCounts, ModelError, ModelSpec, ParamSpec, UnitSpec};

/// A unit's forward: `build` against the bound parameters, then the user's `forward`.
type Run<B> = Box<
    dyn Fn(VarBuilder<'static>, Option<&Tensor>, &B) -> candle_core::Result<Tensor> + Send + Sync,
>;
type Counts<B> = Box<dyn Fn(&B) -> BatchCounts + Send + Sync>;
type Check<B> = Box<dyn Fn(&B) -> Result<(), ModelError> + Send + Sync>;

/// A model whose units are built by closures from a [`VarBuilder`]. See the [module docs](self).
pub struct VarUnits<B> {
    spec: ModelSpec,
    /// Per unit, the `Init` of each own parameter, in `ParamSpec` order.
    inits: Vec<Vec<Init>>,
    runs: Vec<Run<B>>,
    /// Which unit created each parameter name.
    owners: HashMap<String, usize>,
    counts: Counts<B>,
    check: Option<Check<B>>,
    allow_unused: bool,
}

impl<B: 'static> VarUnits<B> {
    /// An empty model; `counts` says how many samples and tokens a batch holds (for reports).
    pub fn new(counts: impl Fn(&B) -> BatchCounts + Send + Sync + 'static) -> Self {
        VarUnits {
            spec: ModelSpec { units: Vec::new() },
            inits: Vec::new(),
            runs: Vec::new(),
            owners: HashMap::new(),
            counts: Box::new(counts),
            check: None,
            allow_unused: false,
        }
    }

    /// Check every micro-batch before any unit computes on it ([`CandleUnits::check_batch`]).
    pub fn check_batch(
        mut self,
        check: impl Fn(&B) -> Result<(), ModelError> + Send + Sync + 'static,
    ) -> Self {
        self.check = Some(Box::new(check));
        self
    }

    /// Let parameters get no gradient (they then get a zero one) instead of refusing them: for a
    /// parameter unused on purpose. Without it, a parameter without a gradient is taken for the
    /// sign of an op without backward (see the [module docs](self)).
    pub fn allow_unused_params(mut self) -> Self {
        self.allow_unused = true;
        self
    }

    /// Add the next unit, its parameters found by running `build` once (see the
    /// [module docs](self)).
    pub fn unit<M, Bu, Fw>(
        self,
        name: impl Into<String>,
        build: Bu,
        forward: Fw,
    ) -> Result<Self, ModelError>
    where
        M: 'static,
        Bu: Fn(VarBuilder<'static>) -> candle_core::Result<M> + Send + Sync + 'static,
        Fw: Fn(&M, Option<&Tensor>, &B) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    {
        self.unit_using(name, &[], build, forward)
    }

    /// [`VarUnits::unit`] for a unit that also reads the parameters of the earlier units `uses`
    /// (tied weights): `build` asks for them by their names, as their owners created them.
    pub fn unit_using<M, Bu, Fw>(
        mut self,
        name: impl Into<String>,
        uses: &[usize],
        build: Bu,
        forward: Fw,
    ) -> Result<Self, ModelError>
    where
        M: 'static,
        Bu: Fn(VarBuilder<'static>) -> candle_core::Result<M> + Send + Sync + 'static,
        Fw: Fn(&M, Option<&Tensor>, &B) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    {
        let name = name.into();
        let unit = self.spec.units.len();
        if let Some(&bad) = uses.iter().find(|&&u| u >= unit) {
            return Err(ModelError::Invalid(format!(
                "unit {name} uses unit {bad}, which is not an earlier unit (0..{unit})"
            )));
        }
        let params = self.discover(&name, uses, &build)?;
        for p in &params {
            self.owners.insert(p.0.name.clone(), unit);
        }
        let (specs, inits) = params.into_iter().unzip();
        self.spec.units.push(UnitSpec {
            name,
            params: specs,
            uses: uses.to_vec(),
        });
        self.inits.push(inits);
        self.runs.push(Box::new(move |vb, input, batch| {
            let module = build(vb)?;
            forward(&module, input, batch)
        }));
        Ok(self)
    }

    /// Run `build` against a [`Recorder`]: the unit's new parameters with their `Init`s, or why
    /// the unit is refused.
    fn discover<M>(
        &self,
        name: &str,
        uses: &[usize],
        build: &dyn Fn(VarBuilder<'static>) -> candle_core::Result<M>,
    ) -> Result<Vec<(ParamSpec, Init)>, ModelError> {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let recorder = Recorder {
            unit: name.to_string(),
            tied: self.tied_names(uses),
            owners: self.owner_names(),
            seen: Arc::clone(&seen),
        };
        let vb = VarBuilder::from_backend(Box::new(recorder), self.dtype(), self.device());
        let built = build(vb).map(drop);
        let seen = std::mem::take(&mut *lock(&seen));
        if let Some(refused) = seen.refused {
            return Err(ModelError::Invalid(refused));
        }
        built.map_err(compute_err(name))?;
        if seen.params.is_empty() && !seen.used_tied {
            return Err(ModelError::Invalid(format!(
                "unit {name}: its closure created no parameters (nothing asked of the \
                 VarBuilder); a unit needs at least one, so fold a parameter-free step into \
                 its neighbour"
            )));
        }
        Ok(seen.params)
    }

    /// Names and shapes of the parameters of the units in `uses`.
    fn tied_names(&self, uses: &[usize]) -> HashMap<String, Vec<usize>> {
        uses.iter()
            .flat_map(|&u| &self.spec.units[u].params)
            .map(|p| (p.name.clone(), p.shape.clone()))
            .collect()
    }

    /// Every parameter name created so far, with its unit's name.
    fn owner_names(&self) -> HashMap<String, String> {
        self.owners
            .iter()
            .map(|(p, &u)| (p.clone(), self.spec.units[u].name.clone()))
            .collect()
    }

    /// A `VarBuilder` over every unit's parameters by name, from one flat buffer per unit (as
    /// [`Trainer::keep_params`](crate::trainer::Trainer::keep_params) hands them back): build the
    /// whole model from it with the same layer code, for evaluation or export.
    pub fn var_builder(&self, params: &[Vec<f32>]) -> Result<VarBuilder<'static>, ModelError> {
        if params.len() != self.spec.units.len() {
            return Err(ModelError::Invalid(format!(
                "var_builder needs {} parameter buffers (one per unit), got {}",
                self.spec.units.len(),
                params.len()
            )));
        }
        let mut tensors = HashMap::new();
        for (unit, flat) in self.spec.units.iter().zip(params) {
            if flat.len() != unit.numel() {
                return Err(ModelError::Invalid(format!(
                    "var_builder: unit {} has {} elements, its buffer {}",
                    unit.name,
                    unit.numel(),
                    flat.len()
                )));
            }
            for (p, off) in unit.params.iter().zip(unit.offsets()) {
                let t = Tensor::from_slice(
                    &flat[off..off + p.numel()],
                    p.shape.as_slice(),
                    &self.device(),
                )
                .map_err(compute_err(&unit.name))?;
                tensors.insert(p.name.clone(), t);
            }
        }
        let bound = Bound {
            unit: "the model".into(),
            tensors,
        };
        Ok(VarBuilder::from_backend(
            Box::new(bound),
            self.dtype(),
            self.device(),
        ))
    }
}

impl<B: 'static> CandleUnits for VarUnits<B> {
    type Batch = B;

    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn batch_counts(&self, batch: &B) -> BatchCounts {
        (self.counts)(batch)
    }

    /// Each parameter from its `Init`, one stream per `(seed, unit, parameter index)`.
    fn init_params(&self, unit: usize, seed: u64, out: &mut [f32]) {
        let spec = &self.spec.units[unit];
        let params = spec
            .params
            .iter()
            .zip(spec.offsets())
            .zip(&self.inits[unit]);
        for (i, ((p, off), init)) in params.enumerate() {
            let mut rng = SplitMix64::new(mix_seed(&[seed, unit as u64, i as u64]));
            init_values(*init, &p.shape, &mut rng, &mut out[off..off + p.numel()]);
        }
    }

    /// `build` against `params` bound to the names it created (then those of `uses`), then the
    /// user's forward.
    fn forward_unit(
        &self,
        unit: usize,
        params: &[Tensor],
        input: Option<&Tensor>,
        batch: &B,
    ) -> candle_core::Result<Tensor> {
        let spec = &self.spec.units[unit];
        let names = std::iter::once(unit)
            .chain(spec.uses.iter().copied())
            .flat_map(|u| &self.spec.units[u].params)
            .map(|p| p.name.clone());
        let bound = Bound {
            unit: spec.name.clone(),
            tensors: names.zip(params.iter().cloned()).collect(),
        };
        let vb = VarBuilder::from_backend(Box::new(bound), self.dtype(), self.device());
        (self.runs[unit])(vb, input, batch)
    }

    fn check_batch(&self, batch: &B) -> Result<(), ModelError> {
        self.check.as_ref().map_or(Ok(()), |check| check(batch))
    }

    fn require_gradients(&self) -> bool {
        !self.allow_unused
    }
}

impl<B> std::fmt::Debug for VarUnits<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VarUnits")
            .field("spec", &self.spec)
            .field("allow_unused", &self.allow_unused)
            .finish()
    }
}

/// Fill `out` (the elements of a tensor of `shape`, row-major) from `init`, drawing from `rng`:
/// the distributions of candle's `Init::var` (`Const`, `Randn`, `Uniform`, `Kaiming` with its fan
/// and gain), the values of [`VarUnits`]' initialisation. A model written the explicit way
/// reproduces a `VarUnits` model's start with it and the stream
/// `SplitMix64::new(mix_seed(&[seed, unit, parameter index]))`.
pub fn init_values(init: Init, shape: &[usize], rng: &mut SplitMix64, out: &mut [f32]) {
    let normal = |rng: &mut SplitMix64, mean: f64, std: f64| (mean + std * rng.normal()) as f32;
    let uniform = |rng: &mut SplitMix64, lo: f64, up: f64| (lo + (up - lo) * rng.next_f64()) as f32;
    match init {
        Init::Const(v) => out.fill(v as f32),
        Init::Randn { mean, stdev } => out.iter_mut().for_each(|x| *x = normal(rng, mean, stdev)),
        Init::Uniform { lo, up } => out.iter_mut().for_each(|x| *x = uniform(rng, lo, up)),
        Init::Kaiming {
            dist,
            fan,
            non_linearity,
        } => {
            let fan = fan.for_shape(&Shape::from(shape)).max(1);
            let std = non_linearity.gain() / (fan as f64).sqrt();
            match dist {
                NormalOrUniform::Normal => out.iter_mut().for_each(|x| *x = normal(rng, 0.0, std)),
                NormalOrUniform::Uniform => {
                    let bound = 3f64.sqrt() * std;
                    out.iter_mut()
                        .for_each(|x| *x = uniform(rng, -bound, bound));
                }
            }
        }
    }
}

/// What a unit's first `build` asked for.
#[derive(Default)]
struct Seen {
    /// New parameters, in the order they were asked for.
    params: Vec<(ParamSpec, Init)>,
    /// Whether it asked for a tied parameter of a unit in `uses`.
    used_tied: bool,
    /// Why the unit is refused (the first reason), said without candle's wrapping.
    refused: Option<String>,
}

/// The backend of a unit's first `build`: records every parameter asked for and hands back a
/// zero view of its shape (one element broadcast, nothing allocated).
struct Recorder {
    unit: String,
    tied: HashMap<String, Vec<usize>>,
    owners: HashMap<String, String>,
    seen: Arc<Mutex<Seen>>,
}

impl Recorder {
    /// Record `name` of `shape`, or say why it is refused.
    fn record(&self, name: &str, shape: &Shape, init: Init) -> Result<(), String> {
        let dims = shape.dims().to_vec();
        let mut seen = lock(&self.seen);
        let earlier = seen.params.iter().find(|(p, _)| p.name == name);
        let known = match earlier {
            Some((p, _)) => Some(&p.shape),
            None => self.tied.get(name),
        };
        match known {
            Some(s) if *s != dims => Err(format!(
                "unit {}: parameter {name} is asked for with shape {dims:?} but has shape {s:?}",
                self.unit
            )),
            Some(_) => {
                seen.used_tied |= earlier.is_none();
                Ok(())
            }
            None => match self.owners.get(name) {
                Some(owner) => Err(format!(
                    "unit {}: parameter {name} was already created by unit {owner}; names must be \
                     unique across units (give each unit's closure its own prefix, \
                     vb.pp(\"...\")), or add the unit with unit_using and unit {owner} in its \
                     uses to tie the weight",
                    self.unit
                )),
                None => {
                    let spec = ParamSpec {
                        name: name.to_string(),
                        shape: dims,
                    };
                    seen.params.push((spec, init));
                    Ok(())
                }
            },
        }
    }
}

impl SimpleBackend for Recorder {
    fn get(
        &self,
        s: Shape,
        name: &str,
        init: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        if let Err(why) = self.record(name, &s, init) {
            lock(&self.seen).refused.get_or_insert(why.clone());
            candle_core::bail!("{why}");
        }
        Tensor::zeros((), dtype, dev)?.broadcast_as(s)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        let why = format!(
            "unit {}: parameter {name} is asked for without a shape (get_unchecked); zerodp \
             learns each parameter's shape from the VarBuilder, so ask with vb.get(shape, name)",
            self.unit
        );
        lock(&self.seen).refused.get_or_insert(why.clone());
        candle_core::bail!("{why}")
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.tied.contains_key(name) || lock(&self.seen).params.iter().any(|(p, _)| p.name == name)
    }
}

/// The backend of every later `build`: the unit's parameter tensors by name.
struct Bound {
    unit: String,
    tensors: HashMap<String, Tensor>,
}

impl Bound {
    fn tensor(&self, name: &str, dtype: DType) -> candle_core::Result<Tensor> {
        let Some(t) = self.tensors.get(name) else {
            candle_core::bail!(
                "{}: parameter {name} was not created by the unit's first build; a unit's \
                 closure must ask for the same parameters every time",
                self.unit
            )
        };
        match t.dtype() == dtype {
            // The same tensor, so that its gradient is found under it.
            true => Ok(t.clone()),
            false => t.to_dtype(dtype),
        }
    }
}

impl SimpleBackend for Bound {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: Init,
        dtype: DType,
        _: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.tensor(name, dtype)?;
        if t.shape() != &s {
            candle_core::bail!(
                "{}: parameter {name} is asked for with shape {s:?} but has shape {:?}",
                self.unit,
                t.shape()
            );
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, _: &Device) -> candle_core::Result<Tensor> {
        self.tensor(name, dtype)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}

/// The recording state, also after a panic elsewhere (nothing in it is left half-written).
fn lock(seen: &Mutex<Seen>) -> std::sync::MutexGuard<'_, Seen> {
    seen.lock().unwrap_or_else(|e| e.into_inner())
}
