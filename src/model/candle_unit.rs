//! Bring your own model: write a candle model's units as plain tensor code and let [`Candle`]
//! turn it into a [`UnitModel`] the engine trains at any ZeRO stage.
//!
//! The engine's contract ([`crate::zero::unit`]) speaks flat `f32` slices: each call gets the
//! gathered parameters of one unit, and backward must add gradients into flat slices. Everything
//! between those slices and candle is the same for every candle model, and [`Candle`] does it:
//!
//! * it turns each parameter slice into a tensor of the compute dtype ([`CandleUnits::dtype`]),
//!   a gradient-tracking leaf (candle [`Var`]) in [`ForwardMode::Train`] and a plain constant in
//!   [`ForwardMode::NoGrad`];
//! * it makes the unit's input a fresh leaf in `Train`, so backward stops at the unit boundary and
//!   reports the input's gradient, which becomes the previous unit's output gradient;
//! * it seeds backward with the surrogate objective `sum(output * grad_output)` (whose gradient
//!   with respect to the output is exactly `grad_output`), or `loss * loss_weight` for the last
//!   unit, and adds (`+=`) each parameter's gradient into its place in the flat gradient slices,
//!   the tied weights' into their owner's slice;
//! * it checks slice counts and lengths, the input's presence and the output gradient's shape,
//!   and names the unit in every error.
//!
//! What you write is a [`CandleUnits`]: the layout ([`CandleUnits::spec`]), the initial values,
//! a batch type, and each unit's forward on tensors ([`CandleUnits::forward_unit`]). A model made
//! of `candle_nn` layers need not list its parameters: [`VarUnits`](super::VarUnits) builds the
//! `CandleUnits` from one closure per unit that makes the layers from a `candle_nn::VarBuilder`.
//!
//! # Writing `forward_unit`
//! * `params` holds the unit's own parameter tensors in
//!   [`ParamSpec`](crate::zero::unit::ParamSpec) order, then those of each unit in its
//!   [`UnitSpec::uses`] in order (all of that unit's tensors, in its `ParamSpec` order). Shapes are
//!   the `ParamSpec` shapes.
//! * `input` is `None` for unit 0 (it reads its input from the batch) and the previous unit's
//!   output for every other unit.
//! * Every unit but the last returns its output activation; the last returns the **mean** loss
//!   over the micro-batch as a rank-0 (scalar) tensor. The engine averages micro-batch losses, so
//!   a mean over equal micro-batches trains alike at every world size.
//! * Use only ops with a backward. candle-nn's fused `ops::softmax_last_dim`, `ops::layer_norm`
//!   and `ops::rms_norm` have **none** and drop gradients silently; compose them from primitive
//!   ops instead (`candle_nn::ops::softmax`, `candle_nn::ops::log_softmax` and
//!   `candle_nn::loss::cross_entropy` are composite and fine), or write a custom op with a
//!   backward as the GPT does (`kernels.rs`).
//! * Be deterministic given the parameters and the batch (no dropout from a global RNG), so that
//!   every rank and world size computes alike and a recomputed forward equals the first.
//!
//! # Tied weights
//! A unit that reads another unit's parameters lists that unit in [`UnitSpec::uses`]: a language
//! model's head with `uses: vec![0]` finds the embedding table after its own tensors in `params`.
//! The tensors are stored, sharded and updated once, by their owner; [`Candle`] adds the reader's
//! gradient into the owner's gradient slice, and the engine sums every use before reducing.
//!
//! # Train and NoGrad
//! The engine runs a unit in `Train` when it will run its backward from what this forward saved,
//! and in `NoGrad` when it only needs the output: activation checkpointing, and stage 3 for units
//! whose gathered parameters it does not keep, run the unit `NoGrad` in the forward pass and again
//! in `Train` just before its backward, with the same parameters and input; evaluation runs
//! `NoGrad`. `forward_unit` is the same function in both modes:
//! [`Candle`] decides whether the tensors track gradients.
//!
//! # Example
//! Linear regression in two units: a hidden layer `tanh(x W1^T + b1)`, and a head
//! `h W2^T + b2` with the mean squared error.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use zerodp::model::{Candle, CandleUnits};
//! use zerodp::rng::{SplitMix64, mix_seed};
//! use zerodp::zero::unit::{BatchCounts, ModelSpec, ParamSpec, UnitSpec};
//!
//! /// One micro-batch: `n` rows of 3 features and one target each.
//! struct Rows { x: Vec<f32>, y: Vec<f32>, n: usize }
//!
//! struct Regression { spec: ModelSpec }
//!
//! fn param(name: &str, shape: &[usize]) -> ParamSpec {
//!     ParamSpec { name: name.into(), shape: shape.to_vec() }
//! }
//!
//! impl Regression {
//!     fn new() -> Self {
//!         let hidden = UnitSpec {
//!             name: "hidden".into(),
//!             params: vec![param("w1", &[8, 3]), param("b1", &[8])],
//!             uses: vec![],
//!         };
//!         let head = UnitSpec {
//!             name: "head".into(),
//!             params: vec![param("w2", &[1, 8]), param("b2", &[1])],
//!             uses: vec![],
//!         };
//!         Regression { spec: ModelSpec { units: vec![hidden, head] } }
//!     }
//! }
//!
//! impl CandleUnits for Regression {
//!     type Batch = Rows;
//!
//!     fn spec(&self) -> &ModelSpec {
//!         &self.spec
//!     }
//!     fn batch_counts(&self, b: &Rows) -> BatchCounts {
//!         BatchCounts { samples: b.n, tokens: b.n }
//!     }
//!     fn init_params(&self, unit: usize, seed: u64, out: &mut [f32]) {
//!         // Weights normal(0, 0.5) from a stream of (seed, unit), biases (the tail) zero.
//!         let mut rng = SplitMix64::new(mix_seed(&[seed, unit as u64]));
//!         let weights = self.spec.units[unit].params[0].numel();
//!         for (i, v) in out.iter_mut().enumerate() {
//!             *v = if i < weights { (rng.normal() * 0.5) as f32 } else { 0.0 };
//!         }
//!     }
//!     fn forward_unit(
//!         &self,
//!         unit: usize,
//!         p: &[Tensor],
//!         input: Option<&Tensor>,
//!         b: &Rows,
//!     ) -> candle_core::Result<Tensor> {
//!         match unit {
//!             0 => {
//!                 let x = Tensor::from_slice(&b.x, (b.n, 3), &Device::Cpu)?;
//!                 x.matmul(&p[0].t()?)?.broadcast_add(&p[1])?.tanh()
//!             }
//!             _ => {
//!                 let h = input.expect("Candle passes the hidden output");
//!                 let y_hat = h.matmul(&p[0].t()?)?.broadcast_add(&p[1])?;
//!                 let y = Tensor::from_slice(&b.y, (b.n, 1), &Device::Cpu)?;
//!                 (y_hat - y)?.sqr()?.mean_all()
//!             }
//!         }
//!     }
//! }
//!
//! // `Candle<Regression>` is a `UnitModel`: hand it to `zerodp::trainer::Trainer`.
//! let model = Candle::new(Regression::new());
//! let batch = Rows { x: vec![0.5; 12], y: vec![1.0; 4], n: 4 };
//! let params: Vec<Vec<f32>> = (0..2)
//!     .map(|u| {
//!         let mut buf = vec![0.0; model.units().spec().units[u].numel()];
//!         model.units().init_params(u, 7, &mut buf);
//!         buf
//!     })
//!     .collect();
//! let refs: Vec<&[f32]> = params.iter().map(Vec::as_slice).collect();
//! let (loss, grads) = model.end_to_end(&refs, &batch, 1.0).unwrap();
//! assert!(loss > 0.0);
//! assert_eq!(grads[1].len(), 9);
//! ```
//!
//! `examples/mlp_classifier/` is a complete program: an MLP classifier on this helper, trained
//! through [`crate::trainer::Trainer`] from a DeepSpeed config file.

use candle_core::{DType, Device, Storage, Tensor, Var};

use crate::zero::unit::{
    BatchCounts, ForwardMode, ModelError, ModelSpec, UnitForward, UnitModel, UnitSpec,
};

/// A model's units as candle tensor code; wrap it in [`Candle`] to train it. See the
/// [module docs](self).
pub trait CandleUnits: Send + Sync {
    /// One rank's micro-batch, of the model's choosing (token ids, feature rows, images...).
    type Batch;

    /// The units in forward order, their parameters and tied weights (see [`crate::zero::unit`]).
    fn spec(&self) -> &ModelSpec;

    /// How many samples and tokens `batch` holds (for reports only; models without tokens report
    /// the samples again).
    fn batch_counts(&self, batch: &Self::Batch) -> BatchCounts;

    /// The terms `batch`'s mean loss averages ([`UnitModel::loss_tokens`]). [default: the
    /// tokens of `batch_counts`]
    fn loss_tokens(&self, batch: &Self::Batch) -> usize {
        self.batch_counts(batch).tokens
    }

    /// Deterministic initial values of unit `unit`'s own flat parameters (the concatenation of
    /// its [`ParamSpec`](crate::zero::unit::ParamSpec)s, row-major), a function of `seed` alone.
    /// [`crate::rng::SplitMix64`] and [`crate::rng::mix_seed`] give a stream per tensor.
    fn init_params(&self, unit: usize, seed: u64, out: &mut [f32]);

    /// The forward of unit `unit` on tensors: the output activation (every unit but the last) or
    /// the mean loss as a scalar tensor (the last unit). `params`: the unit's own parameter
    /// tensors in `ParamSpec` order, then those of each unit in `uses`, in order. `input`: `None`
    /// for unit 0, else the previous unit's output. Errors are reported naming the unit.
    fn forward_unit(
        &self,
        unit: usize,
        params: &[Tensor],
        input: Option<&Tensor>,
        batch: &Self::Batch,
    ) -> candle_core::Result<Tensor>;

    /// The dtype parameters are computed in [default: F32]. Parameters and gradients stay `f32`
    /// slices at the engine's interface; F64 is useful for finite-difference gradient checks.
    fn dtype(&self) -> DType {
        DType::F32
    }

    /// The device the tensors live on [default: the CPU].
    fn device(&self) -> Device {
        Device::Cpu
    }

    /// Check a micro-batch before any unit computes on it (sizes, label ranges...). Called on
    /// every forward; the default accepts everything.
    fn check_batch(&self, batch: &Self::Batch) -> Result<(), ModelError> {
        let _ = batch;
        Ok(())
    }

    /// Whether backward refuses an own parameter of the unit that got no gradient, and (past the
    /// first unit) an input that got none, naming it: in candle both are the sign of an op without backward
    /// (candle-nn's fused ops cut the graph silently), which would leave weights untrained
    /// without a word. [default: false: such a parameter's gradient is zero, as the engine's
    /// contract allows an unused parameter.]
    fn require_gradients(&self) -> bool {
        false
    }
}

/// A [`CandleUnits`] as a [`UnitModel`] (activations are candle [`Tensor`]s). See the
/// [module docs](self).
pub struct Candle<T> {
    units: T,
    dtype: DType,
    device: Device,
    /// Move each parameter group to the device as one flat copy (views cut from it) and its
    /// gradients back as one: one host-to-device and one device-to-host transfer per group and
    /// call, where a GPU would otherwise pay a transfer's latency per tensor. On for every device
    /// but the CPU, whose tensors are made from the slices directly.
    flat_transfers: bool,
    /// With flat transfers: each unit's flat parameters, kept on the device between calls until
    /// [`UnitModel::parameters_changed`] (by owner unit; `None` when not kept). See
    /// [`Candle::with_resident_params`].
    resident: Option<std::sync::Mutex<Vec<Option<Tensor>>>>,
    /// The engine's device tier in the device's memory ([`Self::with_device_tier`]).
    tier: Option<super::candle_tier::CandleTier>,
}

/// What a `Train` forward keeps for backward: the unit's parameter leaves (gradients are keyed by
/// them), its input leaf and its result, still attached to its graph. Dropping it releases the
/// unit's activations.
pub struct CandleSaved {
    unit: usize,
    params: Vec<SavedParam>,
    input: Option<Var>,
    /// The output (every unit but the last) or the loss (the last unit).
    result: Tensor,
}

/// A parameter leaf and where its gradient goes: group (0 = own, 1.. = `uses`) and element offset.
struct SavedParam {
    group: usize,
    offset: usize,
    var: Var,
}

impl<T: CandleUnits> Candle<T> {
    /// Wrap `units`; its [`CandleUnits::dtype`] and [`CandleUnits::device`] are read once, here.
    pub fn new(units: T) -> Self {
        let dtype = units.dtype();
        let device = units.device();
        Candle {
            units,
            dtype,
            flat_transfers: !device.is_cpu(),
            device,
            resident: None,
            tier: None,
        }
    }

    /// Hold the engine's device tier in the device's memory ([`crate::zero::device_tier`]): each
    /// unit's parameters and gradient, and the fp32 master and Adam's moments of the part the
    /// rank updates (all of it on one rank and at stage 0, its shard at stages 1-2), stay on the
    /// device; backward accumulates into them there and the engine's Adam runs there, so that a
    /// step on one rank moves no parameter or gradient between host and device (on more than one
    /// rank the reductions go through host memory). Costs 16 bytes a parameter of device memory
    /// on one rank (18 with f32 gradients of 16-bit parameters;
    /// [`crate::zero::TierDtypes::rank_bytes`]). The engine refuses it where the run needs its
    /// state in host memory ([`crate::zero::device_tier::refusal`]: offload, stage 3 on more than
    /// one rank). `train` and `bench train` turn it on on a GPU where it applies.
    pub fn with_device_tier(mut self, on: bool) -> Self {
        let units = self.units.spec().units.len();
        let tier = super::candle_tier::CandleTier::new(self.device.clone(), self.dtype, units);
        self.tier = on.then_some(tier);
        self
    }

    /// The device tier, once the engine has filled it (the model computes from it then).
    fn loaded_tier(&self) -> Option<&super::candle_tier::CandleTier> {
        self.tier.as_ref().filter(|t| t.is_loaded())
    }

    /// Keep each unit's parameters on the device between calls, in the compute dtype, until the
    /// engine says they changed (after each optimizer step): one copy to a GPU per unit and step
    /// instead of one per unit and call (every micro-batch, and a stage-3 or checkpointed unit's
    /// second forward). Costs the whole model's parameters in device memory, so `train` and
    /// `bench train` turn it on at stages 0-2 on a GPU, where every rank holds every parameter
    /// anyway, and leave it off at stage 3. Only with flat transfers (a device other than the
    /// CPU, or [`Self::with_flat_transfers`]).
    pub fn with_resident_params(mut self, on: bool) -> Self {
        let units = self.units.spec().units.len();
        self.resident = on.then(|| std::sync::Mutex::new(vec![None; units]));
        self
    }

    /// Flat transfers on or off whatever the device: tests run a GPU's path on the CPU with it.
    #[doc(hidden)]
    pub fn with_flat_transfers(mut self, on: bool) -> Self {
        self.flat_transfers = on;
        self
    }

    /// The wrapped model.
    pub fn units(&self) -> &T {
        &self.units
    }

    pub(crate) fn into_units(self) -> T {
        self.units
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Forward the whole model as one graph and backward once: the loss, and the gradient of
    /// `loss * loss_weight` per unit (tied contributions summed into their owner). `params` holds
    /// every unit's own flat buffer in unit order. This is the reference that the engine's
    /// unit-by-unit backward must reproduce; tests compare the two.
    pub fn end_to_end(
        &self,
        params: &[&[f32]],
        batch: &T::Batch,
        loss_weight: f32,
    ) -> Result<(f64, Vec<Vec<f32>>), ModelError> {
        let spec = self.units.spec();
        let n_units = spec.units.len();
        if n_units == 0 {
            return Err(ModelError::Invalid("the model has no units".into()));
        }
        if params.len() != n_units {
            return Err(ModelError::Invalid(format!(
                "end_to_end needs {n_units} parameter buffers, got {}",
                params.len()
            )));
        }
        self.check_dtype()?;
        self.units.check_batch(batch)?;
        let err = compute_err("model");
        let mut leaves: Vec<Vec<Tensor>> = Vec::with_capacity(n_units);
        for (u, us) in spec.units.iter().enumerate() {
            if params[u].len() != us.numel() {
                return Err(ModelError::Invalid(format!(
                    "end_to_end: unit {} has {} elements, its buffer {}",
                    us.name,
                    us.numel(),
                    params[u].len()
                )));
            }
            let own = us
                .params
                .iter()
                .zip(us.offsets())
                .map(|(p, off)| self.param_tensor(&params[u][off..off + p.numel()], &p.shape, true))
                .collect::<candle_core::Result<Vec<_>>>()
                .map_err(&err)?;
            leaves.push(own);
        }
        let mut x: Option<Tensor> = None;
        for (u, us) in spec.units.iter().enumerate() {
            if let Some(&g) = us.uses.iter().find(|&&g| g >= n_units || g == u) {
                return Err(ModelError::Invalid(format!(
                    "unit {u} ({}) uses unit {g}, which is not another unit of the model",
                    us.name
                )));
            }
            let mut p = leaves[u].clone();
            for &g in &us.uses {
                p.extend(leaves[g].iter().cloned());
            }
            let out = self
                .units
                .forward_unit(u, &p, x.as_ref(), batch)
                .map_err(compute_err(&us.name))?;
            x = Some(out);
        }
        let loss = x.expect("the model has units");
        let last = &spec.units[n_units - 1].name;
        let loss_value = loss_scalar(&loss, last)?;
        let store = loss
            .affine(f64::from(loss_weight), 0.0)
            .and_then(|o| o.backward())
            .map_err(&err)?;
        let mut grads: Vec<Vec<f32>> = spec.units.iter().map(|u| vec![0.0; u.numel()]).collect();
        for (u, us) in spec.units.iter().enumerate() {
            for ((leaf, off), p) in leaves[u].iter().zip(us.offsets()).zip(&us.params) {
                if let Some(g) = store.get(leaf) {
                    add_into(g, &mut grads[u][off..off + p.numel()]).map_err(&err)?;
                }
            }
        }
        Ok((loss_value, grads))
    }

    /// The checks every forward makes before computing: the unit exists, one parameter slice per
    /// group of the right length, a float dtype, a valid batch, an input for every unit but the
    /// first. Returns the unit's spec.
    pub(super) fn check_call(
        &self,
        unit: usize,
        params: &[&[f32]],
        input: Option<&Tensor>,
        batch: &T::Batch,
    ) -> Result<&UnitSpec, ModelError> {
        let spec = self.unit_spec(unit)?;
        // With the device tier loaded the engine passes no parameters: the tier holds them.
        if self.loaded_tier().is_none() {
            let lengths: Vec<usize> = params.iter().map(|p| p.len()).collect();
            self.check_groups(spec, &lengths)?;
        }
        self.check_dtype()?;
        self.units.check_batch(batch)?;
        if unit > 0 && input.is_none() {
            return Err(ModelError::Invalid(format!(
                "unit {} needs the previous unit's output as input",
                spec.name
            )));
        }
        Ok(spec)
    }

    fn unit_spec(&self, unit: usize) -> Result<&UnitSpec, ModelError> {
        let units = &self.units.spec().units;
        units.get(unit).ok_or_else(|| {
            ModelError::Invalid(format!(
                "unit {unit} does not exist: this model has {} units (0..{})",
                units.len(),
                units.len()
            ))
        })
    }

    /// Check that `lengths` has one entry per parameter group (own, then `uses`) of the right size.
    fn check_groups(&self, spec: &UnitSpec, lengths: &[usize]) -> Result<(), ModelError> {
        let units = &self.units.spec().units;
        let expected: Vec<usize> = std::iter::once(spec.numel())
            .chain(
                spec.uses
                    .iter()
                    .map(|&u| units.get(u).map_or(0, UnitSpec::numel)),
            )
            .collect();
        if lengths != expected.as_slice() {
            return Err(ModelError::ParamShape {
                unit: spec.name.clone(),
                expected: expected.len(),
                lengths: expected,
                got: lengths.to_vec(),
            });
        }
        Ok(())
    }

    fn check_dtype(&self) -> Result<(), ModelError> {
        if self.dtype.is_float() {
            Ok(())
        } else {
            Err(ModelError::Invalid(format!(
                "the compute dtype must be a float type, got {:?}",
                self.dtype
            )))
        }
    }

    /// A tensor in the compute dtype holding a copy of `data`: a leaf [`Var`] when `train` (so
    /// that backward reports its gradient), a plain constant otherwise.
    fn param_tensor(
        &self,
        data: &[f32],
        shape: &[usize],
        train: bool,
    ) -> candle_core::Result<Tensor> {
        let device = &self.device;
        match (self.dtype, train) {
            (DType::F32, true) => Ok(Var::from_slice(data, shape, device)?.into_inner()),
            (DType::F32, false) => Tensor::from_slice(data, shape, device),
            (DType::F64, train) => {
                let wide: Vec<f64> = data.iter().map(|&x| f64::from(x)).collect();
                if train {
                    Ok(Var::from_vec(wide, shape, device)?.into_inner())
                } else {
                    Tensor::from_vec(wide, shape, device)
                }
            }
            (dtype, train) => {
                let t = Tensor::from_slice(data, shape, device)?.to_dtype(dtype)?;
                if train {
                    Ok(Var::from_tensor(&t)?.into_inner())
                } else {
                    Ok(t)
                }
            }
        }
    }
}

impl<T: CandleUnits> Candle<T> {
    /// Unit `owner`'s flat parameters on the device: kept from an earlier call when resident
    /// ([`Self::with_resident_params`]), else copied now.
    fn group_tensor(&self, owner: usize, data: &[f32]) -> candle_core::Result<Tensor> {
        if let Some(params) = self.loaded_tier().and_then(|t| t.params(owner)) {
            return Ok(params);
        }
        let Some(resident) = &self.resident else {
            return self.flat_tensor(data);
        };
        let mut kept = resident.lock().unwrap_or_else(|e| e.into_inner());
        match kept.get(owner) {
            Some(Some(t)) if t.elem_count() == data.len() => Ok(t.clone()),
            _ => {
                let t = self.flat_tensor(data)?;
                if let Some(slot) = kept.get_mut(owner) {
                    *slot = Some(t.clone());
                }
                Ok(t)
            }
        }
    }

    /// One parameter group on the device in the compute dtype: one transfer, one cast there.
    fn flat_tensor(&self, data: &[f32]) -> candle_core::Result<Tensor> {
        let t = Tensor::from_slice(data, data.len(), &self.device)?;
        match self.dtype {
            DType::F32 => Ok(t),
            dtype => t.to_dtype(dtype),
        }
    }

    /// The parameter at `offset` of `shape`, a view of its group's flat tensor: a leaf [`Var`]
    /// when `train` (its gradient has the parameter's shape), a plain constant otherwise.
    fn view_of(
        flat: &Tensor,
        offset: usize,
        shape: &[usize],
        train: bool,
    ) -> candle_core::Result<Tensor> {
        let numel = shape.iter().product();
        let t = flat.narrow(0, offset, numel)?.reshape(shape)?;
        if train {
            Ok(Var::from_tensor(&t)?.into_inner())
        } else {
            Ok(t)
        }
    }

    /// [`CandleUnits::require_gradients`]: every own parameter of `saved`, and its input past the
    /// first unit, got a gradient in `store`; else an error naming the first that did not.
    fn check_reached(
        &self,
        unit: usize,
        saved: &CandleSaved,
        store: &candle_core::backprop::GradStore,
    ) -> Result<(), ModelError> {
        let spec = &self.units.spec().units[unit];
        let missing = |what: String| ModelError::Compute {
            unit: spec.name.clone(),
            message: format!(
                "{what} got no gradient: an op between it and the loss has no backward. \
                 candle-nn's fused ops cut the graph silently: ops::softmax_last_dim, \
                 ops::layer_norm, ops::rms_norm, and the LayerNorm and RmsNorm modules \
                 (candle_nn::layer_norm, candle_nn::rms_norm) on contiguous input; use \
                 ops::softmax(x, D::Minus1), ops::layer_norm_slow, ops::rms_norm_slow or \
                 primitive ops (or, for a parameter unused on purpose, allow_unused_params)"
            ),
        };
        // Own parameters only: a reader may use some of a tied unit's parameters and not others.
        for p in saved.params.iter().filter(|p| p.group == 0) {
            if store.get(p.var.as_tensor()).is_none() {
                let name = (spec.params.iter().zip(spec.offsets()))
                    .find(|(_, off)| *off == p.offset)
                    .map_or("?", |(ps, _)| ps.name.as_str());
                return Err(missing(format!("parameter {name}")));
            }
        }
        match &saved.input {
            Some(x) if store.get(x.as_tensor()).is_none() => {
                Err(missing("the unit's input".into()))
            }
            _ => Ok(()),
        }
    }
}

impl<T> std::fmt::Debug for Candle<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Candle")
            .field("units", &std::any::type_name::<T>())
            .field("dtype", &self.dtype)
            .field("device", &self.device)
            .finish()
    }
}

pub(super) fn compute_err(unit: &str) -> impl Fn(candle_core::Error) -> ModelError + '_ {
    move |e| {
        let mut message = e.to_string();
        if message.contains("OUT_OF_MEMORY") {
            message.push_str(
                ": the GPU ran out of memory. Lower train_micro_batch_size_per_gpu, turn on \
                 activation checkpointing, train in bf16, or use ZeRO stage 3 (parameters copied \
                 to the GPU unit by unit instead of kept there)",
            );
        }
        ModelError::Compute {
            unit: unit.to_string(),
            message,
        }
    }
}

/// The value of the last unit's loss, which must be a scalar.
fn loss_scalar(loss: &Tensor, unit: &str) -> Result<f64, ModelError> {
    if loss.rank() != 0 {
        return Err(ModelError::Compute {
            unit: unit.to_string(),
            message: format!(
                "the last unit must return the mean loss as a scalar (rank-0) tensor, got shape {:?}",
                loss.dims()
            ),
        });
    }
    loss.to_dtype(DType::F64)
        .and_then(|l| l.to_scalar::<f64>())
        .map_err(compute_err(unit))
}

/// `out += t` elementwise, any layout; fast for F32 and F64 on the CPU.
fn add_into(t: &Tensor, out: &mut [f32]) -> candle_core::Result<()> {
    if t.elem_count() != out.len() {
        candle_core::bail!(
            "gradient of {} elements for a slice of {}",
            t.elem_count(),
            out.len()
        );
    }
    let t = t.contiguous()?;
    {
        let (storage, layout) = t.storage_and_layout();
        let start = layout.start_offset();
        let n = out.len();
        if let Storage::Cpu(cpu) = &*storage {
            match t.dtype() {
                DType::F32 => {
                    let src = &cpu.as_slice::<f32>()?[start..start + n];
                    out.iter_mut().zip(src).for_each(|(o, s)| *o += s);
                    return Ok(());
                }
                DType::F64 => {
                    let src = &cpu.as_slice::<f64>()?[start..start + n];
                    out.iter_mut().zip(src).for_each(|(o, s)| *o += *s as f32);
                    return Ok(());
                }
                _ => {}
            }
        }
    }
    let values = t
        .flatten_all()?
        .to_dtype(DType::F32)?
        .to_device(&Device::Cpu)?
        .to_vec1::<f32>()?;
    out.iter_mut().zip(&values).for_each(|(o, s)| *o += s);
    Ok(())
}

/// Add each `(parameter, gradient)` into its place in `grads`, one device-to-host transfer per
/// parameter group: the group's gradients, flattened to f32 and concatenated on the device, come
/// back as one vector.
fn add_flat(found: &[(&SavedParam, &Tensor)], grads: &mut [&mut [f32]]) -> candle_core::Result<()> {
    for (group, dst) in grads.iter_mut().enumerate() {
        let parts: Vec<(usize, Tensor)> = (found.iter())
            .filter(|(p, _)| p.group == group)
            .map(|(p, g)| Ok((p.offset, g.flatten_all()?.to_dtype(DType::F32)?)))
            .collect::<candle_core::Result<_>>()?;
        if parts.is_empty() {
            continue;
        }
        let joined = Tensor::cat(&parts.iter().map(|(_, t)| t).collect::<Vec<_>>(), 0)?;
        let host = joined.to_device(&Device::Cpu)?.to_vec1::<f32>()?;
        let mut at = 0;
        for (offset, t) in &parts {
            let n = t.elem_count();
            let src = &host[at..at + n];
            dst[*offset..*offset + n]
                .iter_mut()
                .zip(src)
                .for_each(|(o, s)| *o += s);
            at += n;
        }
    }
    Ok(())
}

/// Add one backward's gradients into the device tier, each parameter group into its owner unit's.
fn add_to_tier(
    tier: &super::candle_tier::CandleTier,
    unit: usize,
    spec: &UnitSpec,
    found: &[(&SavedParam, &Tensor)],
) -> Result<(), ModelError> {
    let owners = std::iter::once(unit).chain(spec.uses.iter().copied());
    for (group, owner) in owners.enumerate() {
        let parts: Vec<(usize, &Tensor)> = (found.iter())
            .filter(|(p, _)| p.group == group)
            .map(|(p, g)| (p.offset, *g))
            .collect();
        tier.add_grads(owner, &parts)?;
    }
    Ok(())
}

impl<T: CandleUnits> Candle<T> {
    /// Add one backward's gradients into the engine's host slices `grads` (one flat transfer per
    /// group from a device), after checking that each fits its place.
    fn add_to_host(
        &self,
        spec: &UnitSpec,
        found: &[(&SavedParam, &Tensor)],
        grads: &mut [&mut [f32]],
    ) -> Result<(), ModelError> {
        let err = compute_err(&spec.name);
        for &(p, g) in found {
            let n = g.elem_count();
            if grads[p.group].get(p.offset..p.offset + n).is_none() {
                return Err(ModelError::Invalid(format!(
                    "backward of unit {}: a gradient of {n} elements at offset {} does not fit parameter group {}",
                    spec.name, p.offset, p.group
                )));
            }
        }
        if self.flat_transfers {
            return add_flat(found, grads).map_err(&err);
        }
        for &(p, g) in found {
            let n = g.elem_count();
            add_into(g, &mut grads[p.group][p.offset..p.offset + n]).map_err(&err)?;
        }
        Ok(())
    }
}

impl<T: CandleUnits> UnitModel for Candle<T> {
    type Batch = T::Batch;
    type Act = Tensor;
    type Saved = CandleSaved;

    fn spec(&self) -> &ModelSpec {
        self.units.spec()
    }

    fn batch_counts(&self, batch: &T::Batch) -> BatchCounts {
        self.units.batch_counts(batch)
    }

    fn loss_tokens(&self, batch: &T::Batch) -> usize {
        self.units.loss_tokens(batch)
    }

    fn init_params(&self, unit: usize, seed: u64, out: &mut [f32]) {
        let spec = &self.units.spec().units[unit];
        assert_eq!(
            out.len(),
            spec.numel(),
            "init_params: unit {} has {} elements, buffer has {}",
            spec.name,
            spec.numel(),
            out.len()
        );
        self.units.init_params(unit, seed, out);
    }

    fn forward(
        &self,
        unit: usize,
        params: &[&[f32]],
        input: Option<&Tensor>,
        batch: &T::Batch,
        mode: ForwardMode,
    ) -> Result<UnitForward<Tensor, CandleSaved>, ModelError> {
        let spec = self.check_call(unit, params, input, batch)?;
        let err = compute_err(&spec.name);
        let train = mode == ForwardMode::Train;
        let units = &self.units.spec().units;

        let mut tensors = Vec::new();
        let mut places = Vec::new();
        for (group, &owner_unit) in std::iter::once(&unit).chain(&spec.uses).enumerate() {
            let owner = &units[owner_unit];
            let flat = match self.flat_transfers || self.loaded_tier().is_some() {
                true => Some(self.group_tensor(owner_unit, params[group]).map_err(&err)?),
                false => None,
            };
            for (p, offset) in owner.params.iter().zip(owner.offsets()) {
                let t = match &flat {
                    Some(flat) => Self::view_of(flat, offset, &p.shape, train),
                    None => {
                        let data = &params[group][offset..offset + p.numel()];
                        self.param_tensor(data, &p.shape, train)
                    }
                };
                tensors.push(t.map_err(&err)?);
                places.push((group, offset));
            }
        }
        // A fresh leaf per unit: backward stops here and reports d(input).
        let input_var = match (input, train) {
            (Some(x), true) => Some(Var::from_tensor(&x.detach()).map_err(&err)?),
            _ => None,
        };
        let input_t = match (&input_var, input) {
            (Some(v), _) => Some(v.as_tensor().clone()),
            (None, Some(x)) => Some(x.detach()),
            (None, None) => None,
        };
        let result = self
            .units
            .forward_unit(unit, &tensors, input_t.as_ref(), batch)
            .map_err(&err)?;

        let (output, loss) = if unit + 1 == units.len() {
            (None, Some(loss_scalar(&result, &spec.name)? as f32))
        } else {
            (Some(result.detach()), None)
        };
        let saved = if !train {
            None
        } else {
            Some(CandleSaved {
                unit,
                // The tensors were made as variables, so `from_tensor` wraps them without a copy.
                params: places
                    .into_iter()
                    .zip(&tensors)
                    .map(|((group, offset), t)| {
                        Var::from_tensor(t).map(|var| SavedParam { group, offset, var })
                    })
                    .collect::<candle_core::Result<Vec<_>>>()
                    .map_err(&err)?,
                input: input_var,
                result,
            })
        };
        Ok(UnitForward {
            output,
            loss,
            saved,
        })
    }

    fn device_tier(&self) -> Option<&dyn crate::zero::DeviceTier> {
        self.tier
            .as_ref()
            .map(|t| t as &dyn crate::zero::DeviceTier)
    }

    fn parameters_changed(&self) {
        if let Some(resident) = &self.resident {
            let mut kept = resident.lock().unwrap_or_else(|e| e.into_inner());
            kept.iter_mut().for_each(|t| *t = None);
        }
    }

    fn backward(
        &self,
        unit: usize,
        saved: CandleSaved,
        grad_output: Option<&Tensor>,
        loss_weight: f32,
        grads: &mut [&mut [f32]],
    ) -> Result<Option<Tensor>, ModelError> {
        let spec = self.unit_spec(unit)?;
        if saved.unit != unit {
            return Err(ModelError::Invalid(format!(
                "backward of unit {} was given the saved state of unit {}",
                spec.name, saved.unit
            )));
        }
        let tier = self.loaded_tier();
        if tier.is_none() {
            let lengths: Vec<usize> = grads.iter().map(|g| g.len()).collect();
            self.check_groups(spec, &lengths)?;
        }
        let err = compute_err(&spec.name);
        let last = unit + 1 == self.units.spec().units.len();
        let objective = if last && loss_weight == 0.0 {
            // candle's backprop stops at an affine of factor 0; a product by a zero tensor
            // carries the zero gradients on (a micro-batch without trained targets).
            let zero = Tensor::zeros((), saved.result.dtype(), saved.result.device());
            zero.and_then(|z| saved.result.broadcast_mul(&z))
                .map_err(&err)?
        } else if last {
            saved
                .result
                .affine(f64::from(loss_weight), 0.0)
                .map_err(&err)?
        } else {
            let g = grad_output.ok_or_else(|| {
                ModelError::Invalid(format!(
                    "backward of unit {} needs the gradient of its output",
                    spec.name
                ))
            })?;
            if g.shape() != saved.result.shape() {
                return Err(ModelError::Invalid(format!(
                    "backward of unit {}: output gradient has shape {:?}, output has {:?}",
                    spec.name,
                    g.shape(),
                    saved.result.shape()
                )));
            }
            // Surrogate scalar whose gradient w.r.t. the output is exactly `g`.
            (&saved.result * g)
                .and_then(|s| s.sum_all())
                .map_err(&err)?
        };
        let store = objective.backward().map_err(&err)?;
        if self.units.require_gradients() {
            self.check_reached(unit, &saved, &store)?;
        }
        let found: Vec<(&SavedParam, &Tensor)> = (saved.params.iter())
            .filter_map(|p| store.get(p.var.as_tensor()).map(|g| (p, g)))
            .collect();
        match tier {
            Some(tier) => add_to_tier(tier, unit, spec, &found)?,
            None => self.add_to_host(spec, &found, grads)?,
        }
        let grad_input = saved
            .input
            .as_ref()
            .and_then(|v| store.get(v.as_tensor()))
            .map(Tensor::detach);
        // Dropping the store and the saved graph here releases every activation of this unit.
        drop(store);
        drop(saved);
        Ok(grad_input)
    }
}
