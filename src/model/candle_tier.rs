//! The engine's device tier in a candle device's memory ([`crate::zero::device_tier`]): each
//! unit's parameters in the compute dtype, its fp32 master (a second tensor only when the compute
//! dtype is not f32), its gradient and Adam's moments (in the engine's dtypes for them), as flat tensors on the model's
//! device, and the engine's arithmetic on them as candle ops: gradient accumulation, the squared
//! sums, and Adam with the CPU kernel's constants ([`StepConsts`]) and formula (on a GPU one
//! fused kernel per unit, `cuda_adam`). On a GPU a step then moves no parameter or gradient
//! between host and device. The same code runs on candle's
//! CPU backend, where the tests compare it with the engine's own host tier.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use candle_core::{DType, Device, Tensor};

use crate::optim::adam::StepConsts;
use crate::zero::device_tier::{DeviceTier, TierDtypes, UnitValues};
use crate::zero::precision::{Slice, SliceMut};
use crate::zero::unit::ModelError;

use super::candle_unit::compute_err;

/// One unit's state in the tier: flat tensors of the unit's length.
struct TierUnit {
    /// The parameters in the compute dtype (the master itself in f32).
    params: Tensor,
    /// The fp32 master.
    master: Tensor,
    /// The gradient, in the engine's gradient dtype.
    grad: Tensor,
    /// Adam's moments, in the engine's moment dtype (f32 or bf16).
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    /// The engine's dtypes, which the tier keeps.
    dtypes: TierDtypes,
}

impl TierUnit {
    /// Whether `params` is the master itself (fp32 stored and computed: [`CandleTier::rounded`]
    /// returns the master then).
    #[cfg(feature = "cuda")]
    fn params_are_master(&self) -> bool {
        self.params.dtype() == DType::F32 && self.dtypes.params == crate::comm::DType::F32
    }

    /// The Adam step as one fused kernel where the unit is on a GPU: `Ok(false)` elsewhere.
    #[cfg(feature = "cuda")]
    fn fused_adam(&self, c: &StepConsts) -> candle_core::Result<bool> {
        let tensors = super::cuda_adam::AdamTensors {
            grad: &self.grad,
            master: &self.master,
            exp_avg: &self.exp_avg,
            exp_avg_sq: &self.exp_avg_sq,
            params: (!self.params_are_master()).then_some(&self.params),
            stored: self.dtypes.params,
        };
        super::cuda_adam::fused_adam(&tensors, c)
    }

    #[cfg(not(feature = "cuda"))]
    fn fused_adam(&self, _c: &StepConsts) -> candle_core::Result<bool> {
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
    fn rounded(&self, master: &Tensor, stored: crate::comm::DType) -> candle_core::Result<Tensor> {
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

/// Refuses a host slice of `dtype` for a gradient of `grad` (its dtype and elements).
fn check_host_grad(unit: usize, grad: &Tensor, dtype: DType, len: usize) -> Result<(), ModelError> {
    if grad.dtype() != dtype || len < grad.elem_count() {
        return Err(ModelError::Invalid(format!(
            "unit {unit}'s gradient ({} {:?} elements) does not fit a host buffer of {len} {:?}",
            grad.elem_count(),
            grad.dtype(),
            dtype
        )));
    }
    Ok(())
}

/// The first elements of `dst` from `grad`, in one transfer.
fn copy_down<T: candle_core::WithDType>(grad: &Tensor, dst: &mut [T]) -> candle_core::Result<()> {
    let n = grad.elem_count();
    dst[..n].copy_from_slice(&grad.to_vec1::<T>()?);
    Ok(())
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
fn adam_unit(u: &TierUnit, c: &StepConsts) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let f = f64::from;
    let g = u.grad.to_dtype(DType::F32)?.affine(f(c.grad_scale), 0.0)?;
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
    fn upload(
        &self,
        unit: usize,
        values: &UnitValues,
        dtypes: TierDtypes,
    ) -> Result<(), ModelError> {
        let err = compute_err("device tier");
        let n = values.master.len();
        if values.exp_avg.len() != n || values.exp_avg_sq.len() != n {
            return Err(ModelError::Invalid(format!(
                "device tier upload of unit {unit}: master {n}, moments {} and {} elements",
                values.exp_avg.len(),
                values.exp_avg_sq.len()
            )));
        }
        let put = |v: &[f32], dtype| {
            (Tensor::from_slice(v, n, &self.device))
                .and_then(|t| t.to_dtype(super::candle_dtype(dtype)))
                .map_err(&err)
        };
        let master = put(&values.master, crate::comm::DType::F32)?;
        let grad_dtype = super::candle_dtype(dtypes.grads);
        let state = TierUnit {
            params: self.rounded(&master, dtypes.params).map_err(&err)?,
            grad: Tensor::zeros(n, grad_dtype, &self.device).map_err(&err)?,
            exp_avg: put(&values.exp_avg, dtypes.moments)?,
            exp_avg_sq: put(&values.exp_avg_sq, dtypes.moments)?,
            dtypes,
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
        }
        Ok(())
    }

    fn grad_to_host(&self, unit: usize, dst: SliceMut<'_>) -> Result<(), ModelError> {
        let units = self.lock();
        let grad = &loaded(&units, unit)?.grad;
        // One transfer of the gradient as it is stored, into the host buffer of its dtype.
        let (dtype, len) = match &dst {
            SliceMut::F32(d) => (DType::F32, d.len()),
            SliceMut::BF16(d) => (DType::BF16, d.len()),
            SliceMut::F16(d) => (DType::F16, d.len()),
        };
        check_host_grad(unit, grad, dtype, len)?;
        match dst {
            SliceMut::F32(d) => copy_down(grad, d),
            SliceMut::BF16(d) => copy_down(grad, d),
            SliceMut::F16(d) => copy_down(grad, d),
        }
        .map_err(compute_err("device tier"))
    }

    fn grad_from_host(&self, unit: usize, src: Slice<'_>) -> Result<(), ModelError> {
        let mut units = self.lock();
        let u = loaded_mut(&mut units, unit)?;
        check_host_grad(unit, &u.grad, super::candle_dtype(src.dtype()), src.len())?;
        let n = u.grad.elem_count();
        let grad = match src {
            Slice::F32(s) => Tensor::from_slice(&s[..n], n, &self.device),
            Slice::BF16(s) => Tensor::from_slice(&s[..n], n, &self.device),
            Slice::F16(s) => Tensor::from_slice(&s[..n], n, &self.device),
        };
        u.grad = grad.map_err(compute_err("device tier"))?;
        Ok(())
    }

    fn grad_squares(&self) -> Result<Vec<f64>, ModelError> {
        let err = compute_err("device tier");
        let units = self.lock();
        // In f64, as the host tier sums (through f32: every backend casts 16-bit floats to it);
        // all units' sums come back in one transfer.
        let sums = (units.iter().enumerate())
            .map(|(i, u)| {
                let u = u.as_ref().ok_or_else(|| missing(i))?;
                (u.grad.to_dtype(DType::F32))
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
            let err = compute_err("device tier");
            if u.fused_adam(consts).map_err(&err)? {
                continue;
            }
            let (master, m, v) = adam_unit(u, consts).map_err(&err)?;
            u.params = self.rounded(&master, u.dtypes.params).map_err(&err)?;
            (u.master, u.exp_avg, u.exp_avg_sq) = (master, m, v);
        }
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
            .map(|u| u.dtypes.bytes(u.master.elem_count() as u64, compute))
            .sum()
    }
}
