//! The foundation below every other module: the dtype tag, owned flat buffers, zeroed memory
//! advised onto huge pages, and the 16-bit rounding, widening and narrowing every layer shares.
//! `comm` moves these buffers, `optim` steps them, `zero` lays units out in them and `model`
//! computes from them; none of those needs another's module for them.

mod buffer;
mod dtype;
pub(crate) mod lanes;
pub mod slices;
mod view;

pub(crate) use buffer::touch_pages;
pub use buffer::{zeroed_vec, Buffer, HUGE_PAGE_MIN_BYTES};
pub use dtype::DType;
pub use lanes::f32_to_bf16_bits;
pub(crate) use view::with_slice;
pub use view::{Slice, SliceMut};
