//! Mixed precision for the engine: dtype-tagged flat storage, the handful of operations the engine
//! does on it, and the per-step overflow policy.
//!
//! The engine keeps its flat buffers as [`Buffer`]s (f32, bf16 or f16), so that 16-bit parameters,
//! gradients and communication buckets really take 2 bytes per element. Everything the engine does
//! to them is here, dispatched once per slice (not per element) onto the generic kernels of
//! [`crate::optim::slices`]: copies that cast with round-to-nearest-even, accumulation, squared
//! norms, and the Adam update that writes the fp32 master shard and its 16-bit copy in one pass.
//! The model itself always computes in f32: 16-bit parameters are widened into a preallocated f32
//! scratch before each unit runs (candle's bf16 matmuls are several times slower on CPU).
//!
//! [`StepPolicy`] decides, once per optimizer step and with the verdict agreed across ranks, whether
//! a step is skipped: fp16 uses DeepSpeed's [`LossScaler`], bf16 and fp32 (and fp16 with a static
//! scale) a [`NonFiniteGuard`] that stops the run after too many skipped steps in a row.

use super::loss_scaler::{DynamicScaleParams, LossScaleError, LossScaler, NonFiniteGuard};
use crate::flat::{Buffer, DType};
use crate::optim::adam::{AdamParams, RoundingKey, StateElement};
use crate::optim::slices;
use half::{bf16, f16};
use std::borrow::Cow;
use std::ops::Range;

/// A borrowed flat slice of any element type the engine stores.
#[derive(Clone, Copy, Debug)]
pub enum Slice<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
}

/// A mutably borrowed flat slice of any element type the engine stores.
#[derive(Debug)]
pub enum SliceMut<'a> {
    F32(&'a mut [f32]),
    BF16(&'a mut [bf16]),
    F16(&'a mut [f16]),
}

/// Runs `$body` with `$v` bound to the typed slice inside a [`Slice`] or [`SliceMut`].
macro_rules! with_slice {
    ($ty:ident, $s:expr, $v:ident => $body:expr) => {
        match $s {
            $ty::F32($v) => $body,
            $ty::BF16($v) => $body,
            $ty::F16($v) => $body,
        }
    };
}

/// Runs `$body` with `$v` bound to the typed vector inside a [`Buffer`].
macro_rules! with_buffer {
    ($b:expr, $v:ident => $body:expr) => {
        match $b {
            Buffer::F32($v) => $body,
            Buffer::BF16($v) => $body,
            Buffer::F16($v) => $body,
        }
    };
}

impl<'a> Slice<'a> {
    pub fn len(&self) -> usize {
        with_slice!(Slice, self, v => v.len())
    }
    pub fn dtype(&self) -> DType {
        match self {
            Slice::F32(_) => DType::F32,
            Slice::BF16(_) => DType::BF16,
            Slice::F16(_) => DType::F16,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The sum of squares in f64 (non-finite exactly when an element is Inf or NaN).
    pub fn sum_of_squares(&self) -> f64 {
        with_slice!(Slice, *self, v => slices::sum_of_squares(v))
    }
    /// Writes the elements widened to f32 into `dst` (same length).
    pub fn widen_into(&self, dst: &mut [f32]) {
        SliceMut::F32(dst).copy_from(*self);
    }
}

impl<'a> Slice<'a> {
    /// Elements `r` of the slice.
    pub fn range(self, r: Range<usize>) -> Slice<'a> {
        match self {
            Slice::F32(v) => Slice::F32(&v[r]),
            Slice::BF16(v) => Slice::BF16(&v[r]),
            Slice::F16(v) => Slice::F16(&v[r]),
        }
    }
}

impl<'a> SliceMut<'a> {
    /// The slice, borrowed read-only.
    pub fn as_slice(&self) -> Slice<'_> {
        match self {
            SliceMut::F32(v) => Slice::F32(v),
            SliceMut::BF16(v) => Slice::BF16(v),
            SliceMut::F16(v) => Slice::F16(v),
        }
    }
    /// Elements `r` of the slice, borrowed (the slice stays usable after).
    pub fn sub_mut(&mut self, r: Range<usize>) -> SliceMut<'_> {
        match self {
            SliceMut::F32(v) => SliceMut::F32(&mut v[r]),
            SliceMut::BF16(v) => SliceMut::BF16(&mut v[r]),
            SliceMut::F16(v) => SliceMut::F16(&mut v[r]),
        }
    }
}

impl SliceMut<'_> {
    /// `self = src`, cast with round to nearest even where the types differ.
    pub fn copy_from(self, src: Slice<'_>) {
        with_slice!(SliceMut, self, d => with_slice!(Slice, src, s => slices::cast(d, s)))
    }
    /// `self += src`, accumulated in f32 and rounded once into the destination type.
    pub fn add(self, src: Slice<'_>) {
        with_slice!(SliceMut, self, d => with_slice!(Slice, src, s => slices::add_in_place(d, s)))
    }
}

/// The range operations the engine needs on a [`Buffer`], whatever its element type.
pub trait FlatBuffer {
    fn slice(&self, r: Range<usize>) -> Slice<'_>;
    fn slice_mut(&mut self, r: Range<usize>) -> SliceMut<'_>;
    fn all(&self) -> Slice<'_> {
        self.slice(0..self.elems())
    }
    fn all_mut(&mut self) -> SliceMut<'_> {
        let n = self.elems();
        self.slice_mut(0..n)
    }
    fn elems(&self) -> usize;
    fn capacity(&self) -> usize;
    fn truncate(&mut self, len: usize);
    /// Grows (with zeros) or shrinks to `len` elements.
    fn resize_zeroed(&mut self, len: usize);
    fn copy_within(&mut self, src: Range<usize>, dest: usize);
    fn fill_zero(&mut self);
}

impl FlatBuffer for Buffer {
    fn slice(&self, r: Range<usize>) -> Slice<'_> {
        match self {
            Buffer::F32(v) => Slice::F32(&v[r]),
            Buffer::BF16(v) => Slice::BF16(&v[r]),
            Buffer::F16(v) => Slice::F16(&v[r]),
        }
    }
    fn slice_mut(&mut self, r: Range<usize>) -> SliceMut<'_> {
        match self {
            Buffer::F32(v) => SliceMut::F32(&mut v[r]),
            Buffer::BF16(v) => SliceMut::BF16(&mut v[r]),
            Buffer::F16(v) => SliceMut::F16(&mut v[r]),
        }
    }
    fn elems(&self) -> usize {
        self.len()
    }
    fn capacity(&self) -> usize {
        with_buffer!(self, v => v.capacity())
    }
    fn truncate(&mut self, len: usize) {
        with_buffer!(self, v => v.truncate(len))
    }
    fn resize_zeroed(&mut self, len: usize) {
        with_buffer!(self, v => v.resize(len, Default::default()))
    }
    fn copy_within(&mut self, src: Range<usize>, dest: usize) {
        with_buffer!(self, v => v.copy_within(src, dest))
    }
    fn fill_zero(&mut self) {
        with_buffer!(self, v => v.fill(Default::default()))
    }
}

/// `values` (f32) cast into a new buffer of `dtype`, rounded to nearest even.
pub fn buffer_from_f32(dtype: DType, values: &[f32]) -> Buffer {
    let mut b = Buffer::zeros(dtype, values.len());
    b.all_mut().copy_from(Slice::F32(values));
    b
}

/// Adam's moments of the part of a unit a rank updates, and the updates applied so far. The
/// moments are `f32`, or bf16 (`bf16.bf16_optimizer_states`): half the bytes, updated in `f32`
/// and rounded to nearest even once per step.
#[derive(Clone, Debug, PartialEq)]
pub struct Moments {
    pub m: Buffer,
    pub v: Buffer,
    pub step: u64,
}

impl Moments {
    /// Zeroed moments of `len` elements of `dtype` (`F32` or `BF16`).
    pub fn new(dtype: DType, len: usize) -> Self {
        assert!(dtype != DType::F16, "Adam's moments are f32 or bf16");
        Moments {
            m: Buffer::zeros(dtype, len),
            v: Buffer::zeros(dtype, len),
            step: 0,
        }
    }
    /// Bytes held (`m` and `v`).
    pub fn bytes(&self) -> usize {
        (self.m.len() + self.v.len()) * self.m.dtype().size()
    }
    /// `m` and `v` over `r` as `f32` (borrowed when they are `f32`, widened exactly otherwise).
    pub fn f32_range(&self, r: Range<usize>) -> (Cow<'_, [f32]>, Cow<'_, [f32]>) {
        (as_f32(&self.m, r.clone()), as_f32(&self.v, r))
    }
    /// Sets `m` and `v` over `r` from `f32` values (rounded once to the moments' type).
    pub fn set_f32(&mut self, r: Range<usize>, m: &[f32], v: &[f32]) {
        self.m.slice_mut(r.clone()).copy_from(Slice::F32(m));
        self.v.slice_mut(r).copy_from(Slice::F32(v));
    }
}

/// `b` over `r` as `f32`: borrowed when it is `f32`, widened (exactly) otherwise.
pub(crate) fn as_f32(b: &Buffer, r: Range<usize>) -> Cow<'_, [f32]> {
    match b {
        Buffer::F32(v) => Cow::Borrowed(&v[r]),
        other => {
            let mut out = vec![0.0; r.len()];
            other.slice(r).widen_into(&mut out);
            Cow::Owned(out)
        }
    }
}

/// An Adam update asked of slices that cannot make one (a caller's mistake through the public
/// [`adam_update`] and [`adam_apply`]; the engine sizes and types them from one layout).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UpdateError {
    #[error("Adam's moments must both be f32 or both bf16, got m {m} and v {v}")]
    MixedMoments { m: DType, v: DType },
    #[error(
        "f16 parameters need an fp32 master copy (only bf16 parameters can be their own master: \
         bf16_master_weights_and_grads)"
    )]
    F16WithoutMaster,
    #[error(
        "an Adam update needs equally long slices: params {params}, grads {grads}, m {m}, \
         v {v}, master {master:?}"
    )]
    Lengths {
        params: usize,
        grads: usize,
        m: usize,
        v: usize,
        master: Option<usize>,
    },
}

/// Where a shard sits for stochastic rounding (bf16 parameters without an fp32 master): the run's
/// seed, the unit, and the place of the shard's first element in the unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardPlace {
    pub seed: u64,
    pub unit: usize,
    pub offset: usize,
}

impl ShardPlace {
    /// The rounding key of update `step` ([`crate::optim::adam::rounding_key`]).
    fn key(self, step: u64) -> RoundingKey {
        RoundingKey {
            key: crate::optim::adam::rounding_key(self.seed, step, self.unit),
            offset: self.offset as u64,
        }
    }
}

/// One Adam/AdamW update of a shard. Without a master copy `params` is the shard itself (f32, or
/// bf16 rounded stochastically at `place` under `bf16_master_weights_and_grads`); with one, the
/// fp32 `master` is updated and `params` (16-bit) receives its rounded copy in the same pass.
/// `grads` may be of any element type.
pub fn adam_update(
    state: &mut Moments,
    master: Option<&mut [f32]>,
    (params, place): (SliceMut<'_>, ShardPlace),
    grads: Slice<'_>,
    hp: &AdamParams,
    grad_scale: f32,
) -> Result<(), UpdateError> {
    let step = state.step + 1;
    let Moments { m, v, .. } = state;
    adam_apply(
        m.all_mut(),
        v.all_mut(),
        step,
        master,
        (params, place),
        grads,
        hp,
        grad_scale,
    )?;
    state.step = step;
    Ok(())
}

/// [`adam_update`] on explicit moments `m` and `v` (as long as `params`, both `f32` or both
/// bf16) at update number `step`: the form for moments streamed in chunks from a swap file.
/// Nothing is updated when the slices do not fit together ([`UpdateError`]).
#[allow(clippy::too_many_arguments)]
pub fn adam_apply(
    m: SliceMut<'_>,
    v: SliceMut<'_>,
    step: u64,
    master: Option<&mut [f32]>,
    params: (SliceMut<'_>, ShardPlace),
    grads: Slice<'_>,
    hp: &AdamParams,
    grad_scale: f32,
) -> Result<(), UpdateError> {
    let lens = (
        params.0.as_slice().len(),
        grads.len(),
        m.as_slice().len(),
        v.as_slice().len(),
    );
    let master_len = master.as_deref().map(<[f32]>::len);
    if lens.1 != lens.0
        || lens.2 != lens.0
        || lens.3 != lens.0
        || master_len.is_some_and(|w| w != lens.0)
    {
        return Err(UpdateError::Lengths {
            params: lens.0,
            grads: lens.1,
            m: lens.2,
            v: lens.3,
            master: master_len,
        });
    }
    match (m, v) {
        (SliceMut::F32(m), SliceMut::F32(v)) => {
            adam_typed(m, v, step, master, params, grads, hp, grad_scale)
        }
        (SliceMut::BF16(m), SliceMut::BF16(v)) => {
            adam_typed(m, v, step, master, params, grads, hp, grad_scale)
        }
        (m, v) => Err(UpdateError::MixedMoments {
            m: m.as_slice().dtype(),
            v: v.as_slice().dtype(),
        }),
    }
}

#[allow(clippy::too_many_arguments)]
fn adam_typed<S: StateElement>(
    m: &mut [S],
    v: &mut [S],
    step: u64,
    master: Option<&mut [f32]>,
    (params, place): (SliceMut<'_>, ShardPlace),
    grads: Slice<'_>,
    hp: &AdamParams,
    grad_scale: f32,
) -> Result<(), UpdateError> {
    use crate::optim::adam::{adam_step, adam_step_bf16_master, adam_step_with_copy};
    match master {
        None => match params {
            SliceMut::F32(p) => {
                with_slice!(Slice, grads, g => adam_step(p, g, m, v, step, hp, grad_scale))
            }
            SliceMut::BF16(p) => with_slice!(Slice, grads, g => {
                adam_step_bf16_master(p, g, m, v, step, hp, grad_scale, place.key(step))
            }),
            SliceMut::F16(_) => return Err(UpdateError::F16WithoutMaster),
        },
        Some(w) => with_slice!(SliceMut, params, p => with_slice!(Slice, grads, g => {
            adam_step_with_copy(w, g, m, v, step, hp, grad_scale, p)
        })),
    }
    Ok(())
}

/// How a run treats Inf/NaN gradients and, for fp16, the loss scale.
#[derive(Clone, Debug, PartialEq)]
pub enum OverflowPolicy {
    /// Skip non-finite steps; error after `max_skipped_steps` in a row (bf16, fp32).
    Guard,
    /// fp16: multiply the loss by a scale (`loss_scale > 0`: that static scale, skipped steps
    /// counted by the guard; `0`: DeepSpeed's dynamic scaling with `dynamic`).
    LossScale {
        loss_scale: f64,
        dynamic: DynamicScaleParams,
    },
}

/// The per-step decision: the loss scale to use and whether a step is skipped.
#[derive(Clone, Debug)]
pub struct StepPolicy {
    scaler: Option<LossScaler>,
    /// Counts skipped steps in a row wherever the scale does not (everything but dynamic fp16).
    guard: Option<NonFiniteGuard>,
}

/// The loss scaler's and the skip guard's state, as a checkpoint keeps it.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PolicySnapshot {
    /// The fp16 loss scaler (scale, hysteresis, window position); `None` without loss scaling.
    pub scaler: Option<LossScaler>,
    pub consecutive_skipped: u64,
    pub total_skipped: u64,
}

/// The verdict on one optimizer step.
#[derive(Clone, Debug, PartialEq)]
pub struct StepVerdict {
    pub skipped: bool,
    /// The scale the step's loss was multiplied by.
    pub loss_scale: f64,
    /// DeepSpeed's log line for an fp16 step (overflow or scale change), if any.
    pub message: Option<String>,
}

impl StepPolicy {
    /// `precision` names the gradients in the guard's error (`"bf16"`, `"fp32"`, `"fp16"`).
    pub fn new(
        policy: &OverflowPolicy,
        max_skipped_steps: u64,
        precision: &'static str,
    ) -> Result<Self, LossScaleError> {
        Ok(match policy {
            OverflowPolicy::Guard => StepPolicy {
                scaler: None,
                guard: Some(NonFiniteGuard::new(max_skipped_steps, precision)?),
            },
            OverflowPolicy::LossScale {
                loss_scale,
                dynamic,
            } => {
                let scaler = LossScaler::new(*loss_scale, *dynamic)?;
                let guard = match scaler.is_dynamic() {
                    true => None,
                    false => Some(NonFiniteGuard::new(max_skipped_steps, precision)?),
                };
                StepPolicy {
                    scaler: Some(scaler),
                    guard,
                }
            }
        })
    }

    /// The scale to multiply the next step's loss by (1 without loss scaling).
    pub fn loss_scale(&self) -> f64 {
        self.scaler.as_ref().map_or(1.0, LossScaler::loss_scale)
    }

    /// What a checkpoint must keep to resume the policy exactly.
    pub fn snapshot(&self) -> PolicySnapshot {
        PolicySnapshot {
            scaler: self.scaler.clone(),
            consecutive_skipped: self.guard.as_ref().map_or(0, |g| g.consecutive_skipped()),
            total_skipped: self.guard.as_ref().map_or(0, |g| g.total_skipped()),
        }
    }

    /// Resume from a snapshot. The scaler is taken only if this policy scales too (a checkpoint of
    /// another precision resumes with this run's own scaling from its start).
    pub fn restore(&mut self, s: &PolicySnapshot) {
        if let (Some(mine), Some(saved)) = (&mut self.scaler, &s.scaler) {
            *mine = saved.clone();
        }
        if let Some(g) = &mut self.guard {
            g.set_counts(s.consecutive_skipped, s.total_skipped);
        }
    }

    /// Record one step: `finite` as agreed across ranks, `bad_units` the units whose gradients
    /// held Inf/NaN. Errors at the minimum fp16 scale or after too many skipped steps in a row.
    pub fn record(
        &mut self,
        finite: bool,
        bad_units: &[String],
    ) -> Result<StepVerdict, LossScaleError> {
        let loss_scale = self.loss_scale();
        let mut message = None;
        if let Some(s) = &mut self.scaler {
            let update = s.update_scale(!finite, bad_units)?;
            if update.skipped || update.next_scale != update.attempted_scale {
                message = Some(update.to_string());
            }
        }
        if let Some(g) = &mut self.guard {
            g.check(finite, bad_units)?;
        }
        Ok(StepVerdict {
            skipped: !finite,
            loss_scale,
            message,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_round_to_nearest_even_and_add_accumulates_in_f32() {
        let mut b = Buffer::zeros(DType::BF16, 3);
        // 1 + 2^-8 is a tie between 1 and 1 + 2^-7 in bf16: to even gives 1.
        b.all_mut()
            .copy_from(Slice::F32(&[1.0 + 1.0 / 256.0, 2.0, -3.0]));
        assert_eq!(b.get_f32(0), 1.0);
        b.slice_mut(1..3).add(Slice::F32(&[0.5, 0.25]));
        assert_eq!((b.get_f32(1), b.get_f32(2)), (2.5, -2.75));
        let mut wide = [0.0f32; 3];
        b.all().widen_into(&mut wide);
        assert_eq!(wide, [1.0, 2.5, -2.75]);
        assert_eq!(b.all().sum_of_squares(), 1.0 + 6.25 + 7.5625);
    }

    #[test]
    fn buffer_range_operations_keep_the_dtype() {
        let mut b = buffer_from_f32(DType::F16, &[1.0, 2.0, 3.0, 4.0]);
        b.copy_within(2..4, 0);
        b.truncate(2);
        assert_eq!((b.get_f32(0), b.get_f32(1), b.elems()), (3.0, 4.0, 2));
        b.resize_zeroed(3);
        assert_eq!(b.get_f32(2), 0.0);
        b.fill_zero();
        assert_eq!(b.all().sum_of_squares(), 0.0);
        assert_eq!(b.dtype(), DType::F16);
    }

    /// Slices that cannot make an update are an error, and nothing is updated.
    #[test]
    fn mismatched_update_slices_are_errors() {
        let hp = AdamParams::default();
        let place = ShardPlace {
            seed: 0,
            unit: 0,
            offset: 0,
        };
        let g = buffer_from_f32(DType::F32, &[0.5, -0.5]);
        let mut p16 = buffer_from_f32(DType::F16, &[1.0, -1.0]);
        let mut state = Moments::new(DType::F32, 2);
        let r = adam_update(&mut state, None, (p16.all_mut(), place), g.all(), &hp, 1.0);
        assert_eq!(r, Err(UpdateError::F16WithoutMaster));
        assert_eq!(state.step, 0);
        let mut p = buffer_from_f32(DType::F32, &[1.0, -1.0, 0.0]);
        let r = adam_update(&mut state, None, (p.all_mut(), place), g.all(), &hp, 1.0);
        assert!(
            matches!(
                r,
                Err(UpdateError::Lengths {
                    params: 3,
                    grads: 2,
                    ..
                })
            ),
            "{r:?}"
        );
        assert_eq!(p.get_f32(0), 1.0);
        let (mut m, mut v) = (Buffer::zeros(DType::F32, 2), Buffer::zeros(DType::BF16, 2));
        let mut p = buffer_from_f32(DType::F32, &[1.0, -1.0]);
        let r = adam_apply(
            m.all_mut(),
            v.all_mut(),
            1,
            None,
            (p.all_mut(), place),
            g.all(),
            &hp,
            1.0,
        );
        assert_eq!(
            r,
            Err(UpdateError::MixedMoments {
                m: DType::F32,
                v: DType::BF16
            })
        );
    }

    #[test]
    fn adam_with_a_master_writes_the_rounded_copy() {
        let hp = AdamParams::default();
        let mut master = vec![1.0f32, -1.0];
        let mut p16 = buffer_from_f32(DType::BF16, &master);
        let mut state = Moments::new(DType::F32, 2);
        let g = buffer_from_f32(DType::BF16, &[0.5, -0.5]);
        let place = ShardPlace {
            seed: 0,
            unit: 0,
            offset: 0,
        };
        adam_update(
            &mut state,
            Some(&mut master),
            (p16.all_mut(), place),
            g.all(),
            &hp,
            1.0,
        )
        .unwrap();
        assert_eq!(state.step, 1);
        assert!(master[0] < 1.0 && master[1] > -1.0);
        assert_eq!(p16.get_f32(0), bf16::from_f32(master[0]).to_f32());
        assert_eq!(p16.get_f32(1), bf16::from_f32(master[1]).to_f32());
    }

    #[test]
    fn the_guard_skips_and_stops_after_the_limit() {
        let mut p = StepPolicy::new(&OverflowPolicy::Guard, 2, "bf16").unwrap();
        assert_eq!(p.loss_scale(), 1.0);
        let units = vec!["layer1".to_string()];
        assert!(p.record(false, &units).unwrap().skipped);
        assert!(!p.record(true, &[]).unwrap().skipped);
        assert!(p.record(false, &units).unwrap().skipped);
        let err = p.record(false, &units).unwrap_err();
        assert!(err.to_string().contains("layer1"), "{err}");
    }

    #[test]
    fn dynamic_fp16_halves_after_the_hysteresis() {
        let policy = OverflowPolicy::LossScale {
            loss_scale: 0.0,
            dynamic: DynamicScaleParams::DOCUMENTED_DEFAULTS,
        };
        let mut p = StepPolicy::new(&policy, 1, "fp16").unwrap();
        assert_eq!(p.loss_scale(), 65536.0);
        let v = p.record(false, &[]).unwrap();
        assert!(v.skipped && v.message.is_some());
        assert_eq!(p.loss_scale(), 65536.0);
        assert_eq!(p.record(false, &[]).unwrap().loss_scale, 65536.0);
        assert_eq!(p.loss_scale(), 32768.0);
    }
}
