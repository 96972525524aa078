//! Off x86-64 there are no AMX tiles: every f32 product runs on the gemm crate. The same face as
//! the x86-64 module (`amx.rs`), so that the rest of the crate asks one question everywhere.

/// The environment variable that forces the `gemm` crate on x86-64 (`ZERODP_GEMM=gemm`); here it
/// is always the gemm crate.
pub const GEMM_ENV: &str = "ZERODP_GEMM";

/// Whether products go through AMX: never off x86-64.
pub fn enabled() -> bool {
    false
}

/// The name of the GEMM path products of `f32` run on.
pub fn path_name() -> &'static str {
    "gemm"
}

/// What the AMX path keeps for these products: nothing off x86-64.
pub(super) fn kept_bytes(_products: &[(usize, usize, usize)], _threads: usize) -> (u64, u64) {
    (0, 0)
}

/// Whether a product would go to AMX: never off x86-64.
pub(super) fn worth_it(_dims: (usize, usize, usize)) -> bool {
    false
}
