//! The widest vector extension zerodp's own kernels may use: the CPU's, or less where
//! `ZERODP_ISA` caps it (`avx2`, `portable`), so that a machine with AVX-512 can measure and test
//! what an AVX2-only server runs. Every kernel's run-time dispatch asks [`allows`]: the
//! element-wise ops and attention, the Adam step, the bf16 products (AVX512-BF16) and AMX, the
//! 16-bit reductions. The f32 products of the `gemm` crate use AVX2 with FMA either way (its
//! AVX-512 kernels need a nightly compiler). On aarch64 `portable` turns off the hand-written NEON
//! kernels ([`neon`]). Decided once per process.

/// The environment variable that caps the kernels: `avx512` (no cap), `avx2` or `portable`.
pub const ISA_ENV: &str = "ZERODP_ISA";

/// Vector extensions, narrowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// No vector extension beyond the build's baseline (SSE2 on x86-64, NEON on aarch64).
    Portable,
    Avx2,
    /// AVX-512 and what comes with it here (AVX512-BF16, AMX).
    Avx512,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// The extension `name` spells (any case).
    pub fn from_name(name: &str) -> Option<Isa> {
        [Isa::Portable, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .find(|i| i.name().eq_ignore_ascii_case(name.trim()))
    }
}

/// The cap [`ISA_ENV`] sets: `Ok(None)` when unset or empty, an error naming the value when it
/// names no extension.
pub fn cap_from_env() -> Result<Option<Isa>, String> {
    match std::env::var(ISA_ENV) {
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => Isa::from_name(&v).map(Some).ok_or_else(|| {
            format!("{ISA_ENV}={v:?} names no instruction set; use avx512, avx2 or portable")
        }),
        Err(_) => Ok(None),
    }
}

/// The cap of this process (none when [`ISA_ENV`] is unset or unreadable: the binary reports a
/// bad value at start, see [`cap_from_env`]).
pub fn cap() -> Isa {
    static CAP: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *CAP.get_or_init(|| cap_from_env().ok().flatten().unwrap_or(Isa::Avx512))
}

/// Whether kernels may use `isa` (the CPU must have it too: each kernel checks that itself).
pub fn allows(isa: Isa) -> bool {
    isa <= cap()
}

/// Whether aarch64's hand-written NEON kernels run: on every aarch64 CPU (NEON is its baseline)
/// unless `ZERODP_ISA=portable`, which leaves the portable loops the compiler vectorises itself.
pub fn neon() -> bool {
    cfg!(target_arch = "aarch64") && cap() > Isa::Portable
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_order_narrowest_first() {
        for isa in [Isa::Portable, Isa::Avx2, Isa::Avx512] {
            assert_eq!(Isa::from_name(&isa.name().to_uppercase()), Some(isa));
        }
        assert!(Isa::Portable < Isa::Avx2 && Isa::Avx2 < Isa::Avx512);
        assert_eq!(Isa::from_name("sse9"), None);
    }
}
