//! The Adam update of one flat shard, whatever the element types of its parameters, gradients,
//! moments and master copy: the one dispatch from dtype-tagged slices onto the typed kernels of
//! [`super::adam`].

use super::adam::{AdamParams, RoundingKey, StateElement};
use crate::flat::{with_slice, Buffer, DType, Slice, SliceMut};
use std::borrow::Cow;
use std::ops::Range;

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
    pub(crate) fn f32_range(&self, r: Range<usize>) -> (Cow<'_, [f32]>, Cow<'_, [f32]>) {
        (self.m.range_f32(r.clone()), self.v.range_f32(r))
    }
    /// Sets `m` and `v` over `r` from `f32` values (rounded once to the moments' type).
    pub(crate) fn set_f32(&mut self, r: Range<usize>, m: &[f32], v: &[f32]) {
        self.m.slice_mut(r.clone()).copy_from(Slice::F32(m));
        self.v.slice_mut(r).copy_from(Slice::F32(v));
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
    /// The rounding key of update `step` ([`super::adam::rounding_key`]).
    fn key(self, step: u64) -> RoundingKey {
        RoundingKey {
            key: super::adam::rounding_key(self.seed, step, self.unit),
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
    use super::adam::{adam_step, adam_step_bf16_master, adam_step_with_copy};
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

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// Slices that cannot make an update are an error, and nothing is updated.
    #[test]
    fn mismatched_update_slices_are_errors() {
        let hp = AdamParams::default();
        let place = ShardPlace {
            seed: 0,
            unit: 0,
            offset: 0,
        };
        let g = Buffer::from_f32(DType::F32, &[0.5, -0.5]);
        let mut p16 = Buffer::from_f32(DType::F16, &[1.0, -1.0]);
        let mut state = Moments::new(DType::F32, 2);
        let r = adam_update(&mut state, None, (p16.all_mut(), place), g.all(), &hp, 1.0);
        assert_eq!(r, Err(UpdateError::F16WithoutMaster));
        assert_eq!(state.step, 0);
        let mut p = Buffer::from_f32(DType::F32, &[1.0, -1.0, 0.0]);
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
        let mut p = Buffer::from_f32(DType::F32, &[1.0, -1.0]);
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
        let mut p16 = Buffer::from_f32(DType::BF16, &master);
        let mut state = Moments::new(DType::F32, 2);
        let g = Buffer::from_f32(DType::BF16, &[0.5, -0.5]);
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
}
