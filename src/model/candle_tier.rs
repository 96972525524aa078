//! The engine's device tier in a candle device's memory ([`crate::zero::device_tier`]): each
//! unit's parameters in the compute dtype and its gradient, whole; the fp32 master (a tensor of
//! its own unless the parameters are the master) and Adam's moments over the part of the unit the
//! rank updates (in the engine's dtypes for them), as flat tensors on the model's device; and the
//! engine's arithmetic on them as candle ops: gradient accumulation, the squared sums, and Adam
//! with the CPU kernel's constants ([`StepConsts`]) and formula (on a GPU one fused kernel per
//! unit, `cuda::adam`). On one GPU a step then moves no parameter or gradient between host and
//! device. The same code runs on candle's CPU backend, where the tests compare it with the
//! engine's own host tier.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use candle_core::{DType, Device, Tensor};

use crate::flat::{Slice, SliceMut};
use crate::optim::adam::StepConsts;
use crate::zero::device_tier::{DeviceTier, TierDtypes, UnitUpload, UnitValues};
use crate::zero::unit::ModelError;

use super::candle_unit::compute_err;

/// One unit's state in the tier: flat tensors of the unit's length (the parameters and the
/// gradient) or of its part's (the rest).
struct TierUnit {
    /// The parameters in the compute dtype (the master itself in f32 where the part is the
    /// whole unit).
    params: Tensor,
    /// The fp32 master over the part.
    master: Tensor,
    /// The accumulated gradient, in the engine's gradient dtype.
    grad: Tensor,
    /// Where the part is not the whole unit: the ranks' reduced gradient over it, which Adam
    /// reads ([`DeviceTier::grad_from_host`]); `None` until the engine sets it.
    reduced: Option<Tensor>,
    /// Adam's moments over the part, in the engine's moment dtype (f32 or bf16).
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    /// The elements the rank updates.
    part: Range<usize>,
    /// The engine's dtypes, which the tier keeps.
    dtypes: TierDtypes,
}

impl TierUnit {
    /// Whether the rank updates every element: Adam then reads the gradient itself and writes
    /// the parameters.
    fn is_whole(&self) -> bool {
        self.part == (0..self.grad.elem_count())
    }

    /// The gradient Adam reads: the accumulated one over the whole unit, else the reduced part.
    fn adam_grad(&self, unit: usize) -> Result<&Tensor, ModelError> {
        match (self.is_whole(), &self.reduced) {
            (true, _) => Ok(&self.grad),
            (false, Some(reduced)) => Ok(reduced),
            (false, None) => Err(ModelError::Invalid(format!(
                "unit {unit}'s reduced gradient is not in the device tier: the engine sets it \
                 before the step"
            ))),
        }
    }

    /// Whether `params` is the master itself (fp32 stored and computed over the whole unit:
    /// [`CandleTier::rounded`] returns the master then).
    #[cfg(feature = "cuda")]
    fn params_are_master(&self) -> bool {
        self.params.dtype() == DType::F32
            && self.dtypes.params == crate::flat::DType::F32
            && self.is_whole()
    }

    /// The Adam step as one fused kernel where the unit is on a GPU: `Ok(false)` elsewhere. Over
    /// a part of the unit it leaves the parameters to the all-gather.
    #[cfg(feature = "cuda")]
    fn fused_adam(&self, grad: &Tensor, c: &StepConsts) -> candle_core::Result<bool> {
        let writes_params = self.is_whole() && !self.params_are_master();
        let tensors = super::cuda::adam::AdamTensors {
            grad,
            master: &self.master,
            exp_avg: &self.exp_avg,
            exp_avg_sq: &self.exp_avg_sq,
            params: writes_params.then_some(&self.params),
            stored: self.dtypes.params,
        };
        super::cuda::adam::fused_adam(&tensors, c)
    }

    #[cfg(not(feature = "cuda"))]
    fn fused_adam(&self, _grad: &Tensor, _c: &StepConsts) -> candle_core::Result<bool> {
        Ok(false)
    }
}

/// The device tier of a [`super::Candle`] model: one slot per unit, filled by the engine's
/// first upload.
pub(super) struct CandleTier {
    device: Device,
    dtype: DType,
    units: Mutex<Vec<Option<TierUnit>>>,
    /// Every slot is filled: set by the upload that fills the last, read on every call of the
    /// model (without taking the lock).
    loaded: AtomicBool,
    /// An engine holds the tier ([`DeviceTier::claim`]).
    claimed: AtomicBool,
}

impl CandleTier {
    pub(super) fn new(device: Device, dtype: DType, units: usize) -> Self {
        let slots = (0..units).map(|_| None).collect();
        CandleTier {
            device,
            dtype,
            units: Mutex::new(slots),
            loaded: AtomicBool::new(units == 0),
            claimed: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Option<TierUnit>>> {
        self.units.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The parameters of `master`: rounded to the dtype the engine stores them in, then in the
    /// compute dtype (no copy where both are f32).
    fn rounded(&self, master: &Tensor, stored: crate::flat::DType) -> candle_core::Result<Tensor> {
        let t = match super::candle_dtype(stored) {
            DType::F32 => master.clone(),
            dtype => master.to_dtype(dtype)?,
        };
        match t.dtype() == self.dtype {
            true => Ok(t),
            false => t.to_dtype(self.dtype),
        }
    }

    /// Unit `unit`'s parameters in the compute dtype, once the engine has uploaded them.
    pub(super) fn params(&self, unit: usize) -> Option<Tensor> {
        self.lock().get(unit)?.as_ref().map(|u| u.params.clone())
    }

    /// Whether the engine has uploaded the tier (the model then reads and writes it).
    pub(super) fn is_loaded(&self) -> bool {
        self.loaded.load(Ordering::Acquire)
    }

    /// Add one backward's gradient parts of unit `owner` (element offset, flat tensor of any
    /// float dtype) into its gradient; elements no part covers get nothing.
    pub(super) fn add_grads(
        &self,
        owner: usize,
        parts: &[(usize, &Tensor)],
    ) -> Result<(), ModelError> {
        let err = compute_err("device tier");
        let mut units = self.lock();
        let unit = loaded_mut(&mut units, owner)?;
        let numel = unit.grad.elem_count();
        let mut sorted: Vec<(usize, &Tensor)> = parts.to_vec();
        sorted.sort_by_key(|(offset, _)| *offset);
        let mut pieces = Vec::with_capacity(2 * sorted.len() + 1);
        let mut at = 0;
        for (offset, t) in sorted {
            let n = t.elem_count();
            if offset < at || offset + n > numel {
                return Err(ModelError::Invalid(format!(
                    "a gradient of {n} elements at offset {offset} does not fit unit {owner} \
                     ({numel} elements) beside the others"
                )));
            }
            if offset > at {
                pieces.push(Tensor::zeros(offset - at, DType::F32, &self.device).map_err(&err)?);
            }
            pieces.push(
                t.flatten_all()
                    .and_then(|t| t.to_dtype(DType::F32))
                    .map_err(&err)?,
            );
            at = offset + n;
        }
        if at < numel {
            pieces.push(Tensor::zeros(numel - at, DType::F32, &self.device).map_err(&err)?);
        }
        let full = Tensor::cat(&pieces, 0).map_err(&err)?;
        // Added in f32 and rounded once to the gradient's dtype, as the host tier accumulates.
        let dtype = unit.grad.dtype();
        unit.grad = (unit.grad.to_dtype(DType::F32))
            .and_then(|g| g + full)
            .and_then(|g| g.to_dtype(dtype))
            .map_err(&err)?;
        Ok(())
    }
}

/// Refuses a host buffer of `len` elements for `what` of `need`.
fn check_host_len(unit: usize, what: &str, need: usize, len: usize) -> Result<(), ModelError> {
    if len < need {
        return Err(ModelError::Invalid(format!(
            "unit {unit}'s {what} ({need} elements) does not fit a host buffer of {len}"
        )));
    }
    Ok(())
}

/// The first elements of `dst` from `t`, converted to `dst`'s dtype on the device (exactly, or
/// rounding to nearest even where it is narrower), in one transfer (none for an empty `t`).
fn copy_down(unit: usize, what: &str, t: &Tensor, dst: SliceMut<'_>) -> Result<(), ModelError> {
    let n = t.elem_count();
    check_host_len(unit, what, n, dst.as_slice().len())?;
    if n == 0 {
        return Ok(());
    }
    fn put<T: candle_core::WithDType>(t: &Tensor, d: &mut [T]) -> candle_core::Result<()> {
        let v = t.to_dtype(T::DTYPE)?.to_vec1::<T>()?;
        d[..v.len()].copy_from_slice(&v);
        Ok(())
    }
    match dst {
        SliceMut::F32(d) => put(t, d),
        SliceMut::BF16(d) => put(t, d),
        SliceMut::F16(d) => put(t, d),
    }
    .map_err(compute_err("device tier"))
}

/// The first `n` elements of `src` as a flat tensor of its dtype on `device` (on the CPU where
/// `n` is 0: see [`on_device_unless_empty`]).
fn copy_up(
    unit: usize,
    what: &str,
    src: Slice<'_>,
    n: usize,
    device: &Device,
) -> Result<Tensor, ModelError> {
    check_host_len(unit, what, n, src.len())?;
    let device = on_device_unless_empty(device, n);
    match src {
        Slice::F32(s) => Tensor::from_slice(&s[..n], n, device),
        Slice::BF16(s) => Tensor::from_slice(&s[..n], n, device),
        Slice::F16(s) => Tensor::from_slice(&s[..n], n, device),
    }
    .map_err(compute_err("device tier"))
}

/// Where a tensor of `n` elements goes: `device`, or the CPU where `n` is 0. A rank's part of a
/// small unit is empty when its shard is all padding; a GPU refuses to allocate or launch on
/// nothing, so such a part's (empty) master, moments and reduced gradient live in host memory,
/// where nothing computes on them (Adam and the squared sums skip them).
fn on_device_unless_empty(device: &Device, n: usize) -> &Device {
    match n {
        0 => &Device::Cpu,
        _ => device,
    }
}

/// Unit `unit` of the tier, once the engine has uploaded it.
fn loaded(units: &[Option<TierUnit>], unit: usize) -> Result<&TierUnit, ModelError> {
    units
        .get(unit)
        .and_then(Option::as_ref)
        .ok_or_else(|| missing(unit))
}

/// [`loaded`], to change.
fn loaded_mut(units: &mut [Option<TierUnit>], unit: usize) -> Result<&mut TierUnit, ModelError> {
    units
        .get_mut(unit)
        .and_then(Option::as_mut)
        .ok_or_else(|| missing(unit))
}

fn missing(unit: usize) -> ModelError {
    ModelError::Invalid(format!(
        "unit {unit} is not in the device tier: the engine uploads it before the first step"
    ))
}

/// One Adam/AdamW update of a unit's master and moments, the formula of
/// [`crate::optim::adam`] with its constants, in f32 on the unit's device (16-bit moments widened
/// and rounded back once).
fn adam_unit(
    u: &TierUnit,
    grad: &Tensor,
    c: &StepConsts,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let f = f64::from;
    let g = grad.to_dtype(DType::F32)?.affine(f(c.grad_scale), 0.0)?;
    let (g, decayed) = match c.adamw {
        true => (g, u.master.affine(f(c.decay), 0.0)?),
        false => ((g + u.master.affine(f(c.l2), 0.0)?)?, u.master.clone()),
    };
    let m_old = u.exp_avg.to_dtype(DType::F32)?;
    let v_old = u.exp_avg_sq.to_dtype(DType::F32)?;
    let m = (&m_old + (&g - &m_old)?.affine(f(c.w1), 0.0)?)?;
    let v = (v_old.affine(f(c.beta2), 0.0)? + (g.affine(f(c.one_minus_beta2), 0.0)? * &g)?)?;
    let denom = v.sqrt()?.affine(1.0 / f(c.bc2_sqrt), f(c.eps))?;
    let master = (decayed + (m.affine(f(c.neg_step_size), 0.0)? / denom)?)?;
    let moments = u.exp_avg.dtype();
    Ok((master, m.to_dtype(moments)?, v.to_dtype(moments)?))
}

impl DeviceTier for CandleTier {
    fn upload(&self, unit: usize, up: UnitUpload<'_>) -> Result<(), ModelError> {
        let err = compute_err("device tier");
        let (n, values) = (up.part.len(), &up.values);
        if values.master.len() != n || values.exp_avg.len() != n || values.exp_avg_sq.len() != n {
            return Err(ModelError::Invalid(format!(
                "device tier upload of unit {unit}: a part of {n} elements, master {}, moments \
                 {} and {} elements",
                values.master.len(),
                values.exp_avg.len(),
                values.exp_avg_sq.len()
            )));
        }
        let put = |v: &[f32], dtype| {
            (Tensor::from_slice(v, n, on_device_unless_empty(&self.device, n)))
                .and_then(|t| t.to_dtype(super::candle_dtype(dtype)))
                .map_err(&err)
        };
        let master = put(&values.master, crate::flat::DType::F32)?;
        let params = match (up.is_whole(), up.params) {
            (true, _) => self.rounded(&master, up.dtypes.params).map_err(&err)?,
            (false, Some(src)) => (copy_up(unit, "parameters", src, up.numel, &self.device)?)
                .to_dtype(self.dtype)
                .map_err(&err)?,
            (false, None) => {
                return Err(ModelError::Invalid(format!(
                    "device tier upload of unit {unit}: a part ({:?} of {}) without the \
                     unit's parameters",
                    up.part, up.numel
                )))
            }
        };
        let grad_dtype = super::candle_dtype(up.dtypes.grads);
        let state = TierUnit {
            params,
            grad: Tensor::zeros(up.numel, grad_dtype, &self.device).map_err(&err)?,
            reduced: None,
            exp_avg: put(&values.exp_avg, up.dtypes.moments)?,
            exp_avg_sq: put(&values.exp_avg_sq, up.dtypes.moments)?,
            part: up.part,
            dtypes: up.dtypes,
            master,
        };
        let mut units = self.lock();
        let slot = units.get_mut(unit).ok_or_else(|| missing(unit))?;
        *slot = Some(state);
        let all = units.iter().all(Option::is_some);
        self.loaded.store(all, Ordering::Release);
        Ok(())
    }

    fn download(&self, unit: usize) -> Result<UnitValues, ModelError> {
        let err = compute_err("device tier");
        let units = self.lock();
        let u = loaded(&units, unit)?;
        let host = |t: &Tensor| {
            (t.to_dtype(DType::F32))
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(&err)
        };
        Ok(UnitValues {
            master: host(&u.master)?,
            exp_avg: host(&u.exp_avg)?,
            exp_avg_sq: host(&u.exp_avg_sq)?,
        })
    }

    fn zero_grads(&self) -> Result<(), ModelError> {
        let err = compute_err("device tier");
        for u in self.lock().iter_mut().flatten() {
            u.grad = u.grad.zeros_like().map_err(&err)?;
            u.reduced = None;
        }
        Ok(())
    }

    fn grad_to_host(&self, unit: usize, dst: SliceMut<'_>) -> Result<(), ModelError> {
        let units = self.lock();
        copy_down(unit, "gradient", &loaded(&units, unit)?.grad, dst)
    }

    fn grad_from_host(&self, unit: usize, src: Slice<'_>) -> Result<(), ModelError> {
        let mut units = self.lock();
        let u = loaded_mut(&mut units, unit)?;
        if super::candle_dtype(src.dtype()) != u.grad.dtype() {
            return Err(ModelError::Invalid(format!(
                "unit {unit}'s gradient is {:?}, the host's reduction of it {:?}",
                u.grad.dtype(),
                src.dtype()
            )));
        }
        let reduced = copy_up(unit, "reduced gradient", src, u.part.len(), &self.device)?;
        match u.is_whole() {
            true => u.grad = reduced,
            false => u.reduced = Some(reduced),
        }
        Ok(())
    }

    fn grad_squares(&self) -> Result<Vec<f64>, ModelError> {
        let err = compute_err("device tier");
        let units = self.lock();
        // In f64, as the host tier sums (through f32: every backend casts 16-bit floats to it);
        // all units' sums come back in one transfer.
        let sums = (units.iter().enumerate())
            .map(|(i, u)| {
                let grad = u.as_ref().ok_or_else(|| missing(i))?.adam_grad(i)?;
                if grad.elem_count() == 0 {
                    return Tensor::zeros((), DType::F64, &self.device).map_err(&err);
                }
                (grad.to_dtype(DType::F32))
                    .and_then(|g| g.to_dtype(DType::F64))
                    .and_then(|g| g.sqr())
                    .and_then(|g| g.sum_all())
                    .map_err(&err)
            })
            .collect::<Result<Vec<_>, _>>()?;
        if sums.is_empty() {
            return Ok(Vec::new());
        }
        (Tensor::stack(&sums, 0))
            .and_then(|s| s.to_vec1::<f64>())
            .map_err(&err)
    }

    fn adam(&self, consts: &StepConsts) -> Result<(), ModelError> {
        let mut units = self.lock();
        for (i, slot) in units.iter_mut().enumerate() {
            let u = slot.as_mut().ok_or_else(|| missing(i))?;
            if u.part.is_empty() {
                // A shard of padding only: nothing to update.
                continue;
            }
            let err = compute_err("device tier");
            let grad = u.adam_grad(i)?.clone();
            if u.fused_adam(&grad, consts).map_err(&err)? {
                continue;
            }
            let (master, m, v) = adam_unit(u, &grad, consts).map_err(&err)?;
            if u.is_whole() {
                u.params = self.rounded(&master, u.dtypes.params).map_err(&err)?;
            }
            (u.master, u.exp_avg, u.exp_avg_sq) = (master, m, v);
        }
        Ok(())
    }

    fn params_to_host(&self, unit: usize, dst: SliceMut<'_>) -> Result<(), ModelError> {
        let units = self.lock();
        // The master rounded to the stored dtype on the device, as `rounded` rounds it.
        copy_down(unit, "parameters", &loaded(&units, unit)?.master, dst)
    }

    fn params_from_host(&self, unit: usize, src: Slice<'_>) -> Result<(), ModelError> {
        let mut units = self.lock();
        let u = loaded_mut(&mut units, unit)?;
        let numel = u.grad.elem_count();
        u.params = (copy_up(unit, "parameters", src, numel, &self.device)?)
            .to_dtype(self.dtype)
            .map_err(compute_err("device tier"))?;
        Ok(())
    }

    fn synchronize(&self) -> Result<(), ModelError> {
        self.device
            .synchronize()
            .map_err(compute_err("device tier"))
    }

    fn claim(&self) -> bool {
        (self.claimed)
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    fn unclaim(&self) {
        self.claimed.store(false, Ordering::Release);
    }

    fn bytes(&self) -> u64 {
        let units = self.lock();
        let compute = self.dtype.size_in_bytes() as u64;
        (units.iter().flatten())
            .map(|u| {
                let (numel, part) = (u.grad.elem_count() as u64, u.part.len() as u64);
                u.dtypes.bytes(numel, part, compute)
            })
            .sum()
    }
}
