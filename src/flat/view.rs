//! Borrowed, typed views of flat storage ([`Slice`], [`SliceMut`]) and the range operations on a
//! [`Buffer`]: copies that cast with round-to-nearest-even, accumulation and squared norms,
//! dispatched once per slice (not per element) onto the generic kernels of [`super::slices`].

use super::slices;
use super::{Buffer, DType};
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
pub(crate) use with_slice;

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
    pub(crate) fn widen_into(&self, dst: &mut [f32]) {
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
    pub(crate) fn sub_mut(&mut self, r: Range<usize>) -> SliceMut<'_> {
        match self {
            SliceMut::F32(v) => SliceMut::F32(&mut v[r]),
            SliceMut::BF16(v) => SliceMut::BF16(&mut v[r]),
            SliceMut::F16(v) => SliceMut::F16(&mut v[r]),
        }
    }
}

impl SliceMut<'_> {
    /// `self = src`, cast with round to nearest even where the types differ.
    pub(crate) fn copy_from(self, src: Slice<'_>) {
        with_slice!(SliceMut, self, d => with_slice!(Slice, src, s => slices::cast(d, s)))
    }
    /// `self += src`, accumulated in f32 and rounded once into the destination type.
    pub fn add(self, src: Slice<'_>) {
        with_slice!(SliceMut, self, d => with_slice!(Slice, src, s => slices::add_in_place(d, s)))
    }
}

impl Buffer {
    /// Elements `r`, borrowed.
    pub fn slice(&self, r: Range<usize>) -> Slice<'_> {
        match self {
            Buffer::F32(v) => Slice::F32(&v[r]),
            Buffer::BF16(v) => Slice::BF16(&v[r]),
            Buffer::F16(v) => Slice::F16(&v[r]),
        }
    }
    /// Elements `r`, borrowed mutably.
    pub(crate) fn slice_mut(&mut self, r: Range<usize>) -> SliceMut<'_> {
        match self {
            Buffer::F32(v) => SliceMut::F32(&mut v[r]),
            Buffer::BF16(v) => SliceMut::BF16(&mut v[r]),
            Buffer::F16(v) => SliceMut::F16(&mut v[r]),
        }
    }
    pub fn capacity(&self) -> usize {
        with_buffer!(self, v => v.capacity())
    }
    pub fn truncate(&mut self, len: usize) {
        with_buffer!(self, v => v.truncate(len))
    }
    /// Grows (with zeros) or shrinks to `len` elements.
    pub fn resize_zeroed(&mut self, len: usize) {
        with_buffer!(self, v => v.resize(len, Default::default()))
    }
    pub(crate) fn copy_within(&mut self, src: Range<usize>, dest: usize) {
        with_buffer!(self, v => v.copy_within(src, dest))
    }
    pub(crate) fn fill_zero(&mut self) {
        with_buffer!(self, v => v.fill(Default::default()))
    }
    /// All elements, borrowed.
    pub fn all(&self) -> Slice<'_> {
        self.slice(0..self.len())
    }
    /// All elements, borrowed mutably.
    pub(crate) fn all_mut(&mut self) -> SliceMut<'_> {
        let n = self.len();
        self.slice_mut(0..n)
    }
    /// `values` (f32) cast into a new buffer of `dtype`, rounded to nearest even.
    pub fn from_f32(dtype: DType, values: &[f32]) -> Buffer {
        let mut b = Buffer::zeros(dtype, values.len());
        b.all_mut().copy_from(Slice::F32(values));
        b
    }
    /// Elements `r` as `f32`: borrowed when the buffer is `f32`, widened (exactly) otherwise.
    pub(crate) fn range_f32(&self, r: Range<usize>) -> Cow<'_, [f32]> {
        match self {
            Buffer::F32(v) => Cow::Borrowed(&v[r]),
            other => {
                let mut out = vec![0.0; r.len()];
                other.slice(r).widen_into(&mut out);
                Cow::Owned(out)
            }
        }
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
        let mut b = Buffer::from_f32(DType::F16, &[1.0, 2.0, 3.0, 4.0]);
        b.copy_within(2..4, 0);
        b.truncate(2);
        assert_eq!((b.get_f32(0), b.get_f32(1), b.len()), (3.0, 4.0, 2));
        b.resize_zeroed(3);
        assert_eq!(b.get_f32(2), 0.0);
        b.fill_zero();
        assert_eq!(b.all().sum_of_squares(), 0.0);
        assert_eq!(b.dtype(), DType::F16);
    }
}
