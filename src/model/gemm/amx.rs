//! f32 matrix products on AMX tiles at f32 accuracy (Intel Sapphire Rapids and later).
//!
//! WHY: the step is compute bound and about two thirds of it is GEMM; one core's AVX-512 FMA
//! units peak at about 230 GFLOP/s of f32, while its AMX unit does about 3.5 TFLOP/s of bf16
//! products with f32 accumulation (`tdpbf16ps`, measured here). Rounding the operands to bf16
//! would lose the f32 match with PyTorch, so each operand is split into three bf16 planes,
//! `x = x0 + x1 + x2` (each the round-to-nearest of what the previous ones leave: 27 bits
//! together), and the six products that weigh more than 2^-24 (`x0y0`, `x0y1`, `x1y0`, `x0y2`,
//! `x1y1`, `x2y0`; the dropped ones are below 2^-27) accumulate in f32 tiles. Each bf16 product is
//! exact in f32 and each accumulation rounds once, so the result is as accurate as an f32 GEMM's
//! (the tests hold it to the gemm crate's error against an f64 reference). Six products at 3.5T
//! leave about 580 GFLOP/s of f32 work; the kernel reaches about 450-500, the whole product with
//! its packing about 1.3x the `gemm` crate's AVX-512 kernel on the GPT's shapes.
//!
//! Layout (llm.c-style: one obvious place per step): B is packed once per call into panels of 32
//! columns (`[k/32][plane][2 halves][16 pairs][16 cols][2]`, the VNNI pairs `tdpbf16ps` reads),
//! A per group of 32-row blocks (`[k/32][plane][32 rows][32]`), so that every tile is 16 rows of
//! 64 contiguous, line-aligned bytes; a 32 x 32 block of C lives in four accumulator tiles over
//! the whole k. Buffers are per thread and grow to the largest product seen, then stay.
//!
//! Packing reads 4 bytes and writes 6 per element, and in a training step its operands come from
//! memory, not cache: it is bandwidth- and latency-bound, so it reads each source row whole and
//! in order (a row-contiguous B packs all its panels in one pass down its rows; a transposed A
//! packs step by step across a group's blocks), asks for rows a few ahead, and splits 16 lanes
//! at a time. Each block's destination lines are prefetched for writing before its product, and a
//! whole block with nothing to add or finish is stored by the tiles straight into place.
//!
//! Non-finite inputs give non-finite outputs (an infinity may come out as NaN: `inf - inf` in the
//! split); inputs whose bf16 rounding overflows (|x| above 3.39e38) likewise.
//!
//! The path is chosen once per process ([`enabled`]): the CPU must report AMX-TILE and AMX-BF16
//! and Linux must grant the tile state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); `ZERODP_GEMM=gemm`
//! forces the `gemm` crate everywhere (to compare the two, or to rule AMX out).

use super::super::ops::even_split;
use super::{Finish, Strided};
use rayon::prelude::*;
use std::arch::asm;
use std::cell::Cell;

/// Rows of a C block: two 16-row tiles.
const MR: usize = 32;
/// Columns of a C block: two 16-column tiles.
const NR: usize = 32;
/// k per tile step: a tile row holds 32 bf16 (64 bytes).
const KB: usize = 32;
/// bf16 planes per operand.
const PLANES: usize = 3;
/// Bytes of packed A blocks kept in L2 (2 MiB here) while a B panel is reused across them.
const A_GROUP_BYTES: usize = 1 << 20;
/// k per chunk of a longer product (see [`product`]): a packed block's chunk is 96 KiB, so ten
/// of them and a panel's chunk sit in a 2 MiB L2.
const KC: usize = 512;
/// Products smaller than this many multiply-adds stay on the `gemm` crate: packing costs more
/// than AMX saves (attention's per-head 128 x 128 x 64 ran at 0.75x).
const MIN_WORK: usize = 1 << 23;

/// The environment variable that forces the `gemm` crate: `ZERODP_GEMM=gemm`.
pub const GEMM_ENV: &str = "ZERODP_GEMM";

/// Whether products go through AMX: the CPU has it, Linux grants the tile state, and
/// [`GEMM_ENV`] does not say `gemm`. Decided once per process.
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| match std::env::var(GEMM_ENV).as_deref() {
        Ok("gemm") => false,
        _ => usable() && crate::isa::allows(crate::isa::Isa::Avx512),
    })
}

/// The name of the GEMM path products of `f32` run on: `amx` or `gemm`.
pub fn path_name() -> &'static str {
    if super::bf16::enabled() {
        "avx512-bf16"
    } else if enabled() {
        "amx"
    } else {
        "gemm"
    }
}

/// Whether the CPU has AMX-TILE and AMX-BF16 and the kernel lets this process use the tiles.
fn usable() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let l7 = std::arch::x86_64::__cpuid_count(7, 0);
        let cpu = (l7.edx >> 24) & 1 == 1 && (l7.edx >> 22) & 1 == 1;
        // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) only changes which XSAVE
        // components the process may use; it fails cleanly where they are not offered.
        cpu && unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XTILEDATA) } == 0
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
const XTILEDATA: libc::c_long = 18;

/// `k` padded to whole tile steps (the packers fill the padding with zeros).
fn padded(k: usize) -> usize {
    k.div_ceil(KB) * KB
}

/// Elements of one packed 32-row block of A over a padded `kp`.
fn a_block_len(kp: usize) -> usize {
    PLANES * MR * kp
}

/// Elements of one packed 32-column panel of B over a padded `kp`.
fn b_panel_len(kp: usize) -> usize {
    PLANES * kp * NR
}

/// Whether a product of these dimensions is worth packing for AMX.
pub(super) fn worth_it((m, n, k): (usize, usize, usize)) -> bool {
    m >= MR && n >= NR && k >= KB && m.saturating_mul(n).saturating_mul(k) >= MIN_WORK
}

/// The tile palette: all eight tiles 16 rows of 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

const TILE_CONFIG: TileConfig = {
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut t = 0;
    while t < 8 {
        c[16 + 2 * t] = 64;
        c[48 + t] = 16;
        t += 1;
    }
    TileConfig(c)
};

macro_rules! tload {
    ($t:literal, $p:expr, $s:expr) => {
        asm!(concat!("tileloadd tmm", $t, ", [{p} + {s}*1]"), p = in(reg) $p, s = in(reg) $s,
            options(nostack, readonly))
    };
}

macro_rules! dp {
    ($c:literal, $a:literal, $b:literal) => {
        asm!(
            concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm", $b),
            options(nostack, nomem)
        )
    };
}

/// C[32x32] (scratch, rows of NR) = packed A block . packed B panel over kp.
///
/// Tile registers are not renamed: a load into an operand tile waits for the products reading
/// it, so each operand is reloaded right after its last reader, while the other half computes
/// (measured: the same products with the loads grouped ran at the same rate only once the
/// buffers were line-aligned; see [`Packed`]).
///
/// With `init`, the accumulators start from the 32 x 32 partial sums there (rows [`NR`] apart)
/// instead of zero: a product over k in chunks stores and reloads them exactly, so the sums come
/// out the same bits as in one call.
///
/// # Safety
/// This thread's tiles are configured with [`TILE_CONFIG`]; `a` and `b` hold `kp / KB` steps of
/// a packed block and panel; `init`, if any, is valid for reads of 32 rows of 32 f32; `c` is
/// valid for writes of 32 rows of 32 f32, `c_rs` apart.
#[inline(always)]
unsafe fn kernel(
    a: *const u16,
    b: *const u16,
    kp: usize,
    init: Option<*const f32>,
    (c, c_rs): (*mut f32, usize),
) {
    let step = PLANES * MR * KB;
    let a_tile = |kb: usize, p: usize| unsafe { a.add(kb * step + p * MR * KB) };
    let b_tile = |kb: usize, p: usize| unsafe { b.add(kb * step + p * KB * NR) };
    let nk = kp / KB;
    unsafe {
        match init {
            Some(p) => {
                let s = NR * 4;
                tload!("0", p, s);
                tload!("1", p.add(16), s);
                tload!("2", p.add(16 * NR), s);
                tload!("3", p.add(16 * NR + 16), s);
            }
            None => asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem)
            ),
        }
        if nk > 0 {
            // The first product of the first step: A plane 0, B plane 2.
            tload!("4", a_tile(0, 0), 64usize);
            tload!("5", a_tile(0, 0).add(16 * KB), 64usize);
            tload!("6", b_tile(0, 2), 64usize);
            tload!("7", b_tile(0, 2).add(16 * 32), 64usize);
        }
        // One k step, unrolled: products (0,2) (0,1) (1,1) (1,0) (0,0) (2,0), each reloading
        // one operand after its last reader; the last one loads the next step's (0,2).
        macro_rules! next_b {
            ($p:expr) => {{
                let p = $p;
                dp!("0", "4", "6");
                dp!("2", "5", "6");
                tload!("6", p, 64usize);
                dp!("1", "4", "7");
                dp!("3", "5", "7");
                tload!("7", p.add(16 * 32), 64usize);
            }};
        }
        macro_rules! next_a {
            ($p:expr) => {{
                let p = $p;
                dp!("0", "4", "6");
                dp!("1", "4", "7");
                tload!("4", p, 64usize);
                dp!("2", "5", "6");
                dp!("3", "5", "7");
                tload!("5", p.add(16 * KB), 64usize);
            }};
        }
        for kb in 0..nk {
            next_b!(b_tile(kb, 1));
            next_a!(a_tile(kb, 1));
            next_b!(b_tile(kb, 0));
            next_a!(a_tile(kb, 0));
            next_a!(a_tile(kb, 2));
            if kb + 1 < nk {
                let (na, nb) = (a_tile(kb + 1, 0), b_tile(kb + 1, 2));
                dp!("0", "4", "6");
                dp!("1", "4", "7");
                tload!("4", na, 64usize);
                dp!("2", "5", "6");
                tload!("6", nb, 64usize);
                dp!("3", "5", "7");
                tload!("5", na.add(16 * KB), 64usize);
                tload!("7", nb.add(16 * 32), 64usize);
            } else {
                dp!("0", "4", "6");
                dp!("1", "4", "7");
                dp!("2", "5", "6");
                dp!("3", "5", "7");
            }
        }
        let s = c_rs * 4;
        asm!("tilestored [{p} + {s}*1], tmm0", p = in(reg) c, s = in(reg) s, options(nostack));
        asm!("tilestored [{p} + {s}*1], tmm1", p = in(reg) c.add(16), s = in(reg) s, options(nostack));
        asm!("tilestored [{p} + {s}*1], tmm2", p = in(reg) c.add(16 * c_rs), s = in(reg) s, options(nostack));
        asm!("tilestored [{p} + {s}*1], tmm3", p = in(reg) c.add(16 * c_rs + 16), s = in(reg) s, options(nostack));
    }
}

/// An f32 operand: its elements and (row, column) strides.
type Mat<'a> = Strided<'a, f32>;

#[inline(always)]
fn at(x: Mat<'_>, r: usize, c: usize) -> f32 {
    x.0[r * x.1 .0 + c * x.1 .1]
}

/// A 32 x 32 block of `x` at (r0, c0), `rows` x `cols` of it valid, the rest zero, as `t[r][c]`.
#[inline(always)]
fn gather(
    x: Mat<'_>,
    (r0, rows): (usize, usize),
    (c0, cols): (usize, usize),
    t: &mut [[f32; 32]; 32],
) {
    if rows < 32 || cols < 32 {
        *t = [[0.0; 32]; 32];
    }
    let (rs, cs) = x.1;
    if cs == 1 {
        for (r, row) in t[..rows].iter_mut().enumerate() {
            let src = &x.0[(r0 + r) * rs + c0..];
            if let Ok(src) = <&[f32; 32]>::try_from(&src[..cols]) {
                // SAFETY: the callers are the AVX-512 pack functions.
                unsafe { copy32(row, src) };
            } else {
                row[..cols].copy_from_slice(&src[..cols]);
            }
        }
    } else if rs == 1 && rows == 32 && cols == 32 && x.0.len() >= (c0 + 31) * cs + r0 + 32 {
        for (rb, cb) in [(0, 0), (0, 16), (16, 0), (16, 16)] {
            let src = x.0[(c0 + cb) * cs + r0 + rb..].as_ptr();
            // SAFETY: the length test keeps the 16 source rows of 16 inside `x`; `t` is 32 x 32;
            // the callers are the AVX-512 pack functions.
            unsafe { transpose16(src, cs, t[rb][cb..].as_mut_ptr(), 32) };
        }
    } else if rs == 1 {
        for c in 0..cols {
            let col = &x.0[(c0 + c) * cs + r0..][..rows];
            for (row, &v) in t.iter_mut().zip(col) {
                row[c] = v;
            }
        }
    } else {
        for (r, row) in t[..rows].iter_mut().enumerate() {
            for (c, v) in row[..cols].iter_mut().enumerate() {
                *v = at(x, r0 + r, c0 + c);
            }
        }
    }
}

/// `dst[..32] = src[..32]` in two vector moves: the compiler made each such copy a `memmove`
/// call, 4% of a small GPT's step.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn copy32(dst: &mut [f32; 32], src: &[f32; 32]) {
    use std::arch::x86_64::*;
    // SAFETY: both hold 32 elements (their types).
    unsafe {
        _mm512_storeu_ps(dst.as_mut_ptr(), _mm512_loadu_ps(src.as_ptr()));
        _mm512_storeu_ps(
            dst.as_mut_ptr().add(16),
            _mm512_loadu_ps(src.as_ptr().add(16)),
        );
    }
}

/// `dst[i][j] = src[j][i]` for a 16 x 16 block of f32 whose rows start `src_stride` and
/// `dst_stride` elements apart, in registers (the compiler's vectorisation of the scalar loop
/// scattered each element, and the scatters took half of the packing time).
///
/// # Safety
/// The CPU has AVX-512F; the 16 rows of 16 at `src` and at `dst` are valid for reads and writes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose16(src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize) {
    use std::arch::x86_64::*;
    let mut r = [_mm512_setzero_ps(); 16];
    for (j, row) in r.iter_mut().enumerate() {
        // SAFETY: row j of the source block (the caller's contract).
        *row = unsafe { _mm512_loadu_ps(src.add(j * src_stride)) };
    }
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for q in (0..16).step_by(4) {
        r[q] = _mm512_shuffle_ps::<0x44>(t[q], t[q + 2]);
        r[q + 1] = _mm512_shuffle_ps::<0xEE>(t[q], t[q + 2]);
        r[q + 2] = _mm512_shuffle_ps::<0x44>(t[q + 1], t[q + 3]);
        r[q + 3] = _mm512_shuffle_ps::<0xEE>(t[q + 1], t[q + 3]);
    }
    for b in [0, 8] {
        for i in 0..4 {
            t[b + i] = _mm512_shuffle_f32x4::<0x88>(r[b + i], r[b + 4 + i]);
            t[b + 4 + i] = _mm512_shuffle_f32x4::<0xDD>(r[b + i], r[b + 4 + i]);
        }
    }
    for i in 0..8 {
        r[i] = _mm512_shuffle_f32x4::<0x88>(t[i], t[8 + i]);
        r[8 + i] = _mm512_shuffle_f32x4::<0xDD>(t[i], t[8 + i]);
    }
    for (i, row) in r.iter().enumerate() {
        // SAFETY: row i of the destination block (the caller's contract).
        unsafe { _mm512_storeu_ps(dst.add(i * dst_stride), *row) };
    }
}

/// Packs rows r0..r0+rows (<= MR) of A (m x k) into `out` = [kp/KB][PLANES][MR][KB].
///
/// # Safety
/// The CPU has AVX-512F/BW/VL (every AMX CPU has).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pack_a(a: Mat<'_>, r0: usize, rows: usize, k: usize, out: &mut [u16]) {
    use std::arch::x86_64::*;
    let step_len = PLANES * MR * KB;
    let full_steps = if a.1 .1 == 1 { k / KB } else { 0 };
    // Rows with contiguous elements are read whole, one after the other, straight from A (no
    // 32 x 32 gather through a scratch block).
    for r in 0..MR {
        let row = (r < rows).then(|| &a.0[(r0 + r) * a.1 .0..]);
        if r + AHEAD < rows && full_steps > 0 {
            prefetch_lines(&a.0[(r0 + r + AHEAD) * a.1 .0..][..full_steps * KB]);
        }
        for kb in 0..full_steps {
            let o = &mut out[kb * step_len..][..step_len];
            // SAFETY: a full step reads elements kb*KB..kb*KB+32 of the row, inside `a` (the
            // caller's bounds); `store_a_row` writes row r of the step.
            unsafe {
                let (lo, hi) = match row {
                    Some(row) => {
                        let x = row[kb * KB..][..KB].as_ptr();
                        (_mm512_loadu_ps(x), _mm512_loadu_ps(x.add(16)))
                    }
                    None => (_mm512_setzero_ps(), _mm512_setzero_ps()),
                };
                store_a_row(o, r, lo, hi);
            }
        }
    }
    // SAFETY: the caller's contract.
    unsafe { pack_a_gathered(a, (r0, rows), full_steps..k.div_ceil(KB), k, out) };
}

/// Packs steps `steps` of rows r0..r0+rows (<= MR) of A (m x k) into `out` (laid out as
/// [`pack_a`]'s) through a 32 x 32 gather: any strides, ragged edges zero-filled.
///
/// # Safety
/// The CPU has AVX-512F/BW/VL.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pack_a_gathered(
    a: Mat<'_>,
    (r0, rows): (usize, usize),
    steps: std::ops::Range<usize>,
    k: usize,
    out: &mut [u16],
) {
    use std::arch::x86_64::*;
    let step_len = PLANES * MR * KB;
    let mut t = [[0f32; 32]; 32];
    for kb in steps {
        let c0 = kb * KB;
        gather(a, (r0, rows), (c0, (k - c0).min(KB)), &mut t);
        let o = &mut out[kb * step_len..][..step_len];
        for (r, row) in t.iter().enumerate() {
            // SAFETY: `row` holds 32 elements; `store_a_row` writes row r of the step.
            unsafe {
                let lo = _mm512_loadu_ps(row.as_ptr());
                store_a_row(o, r, lo, _mm512_loadu_ps(row.as_ptr().add(16)));
            }
        }
    }
}

/// Rows of A fetched ahead of the one being packed.
const AHEAD: usize = 2;

/// Asks for every cache line of `x` (a hint: it reads nothing the program sees).
#[inline(always)]
fn prefetch_lines(x: &[f32]) {
    for line in x.chunks(16) {
        // SAFETY: a prefetch never faults and reads nothing; the address is inside `x`.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                line.as_ptr().cast(),
            )
        };
    }
}

/// Splits 32 elements of A (`lo`, `hi`: columns 0..16, 16..32 of a step) and writes them as
/// row `r` of each plane of the packed step `o` (`[PLANES][MR][KB]`).
///
/// # Safety
/// The CPU has AVX-512F/BW; `r < MR`, `o` holds a whole step.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn store_a_row(
    o: &mut [u16],
    r: usize,
    lo: std::arch::x86_64::__m512,
    hi: std::arch::x86_64::__m512,
) {
    use std::arch::x86_64::*;
    // Word 2i + 1 of the pair (lo, hi): the high halves of lo's 16 lanes, then hi's.
    let odd_words = _mm512_set_epi16(
        63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23, 21, 19,
        17, 15, 13, 11, 9, 7, 5, 3, 1,
    );
    // SAFETY: the caller's contract (AVX-512F).
    let (lo, hi) = unsafe { (split16(lo), split16(hi)) };
    for p in 0..PLANES {
        let words = _mm512_permutex2var_epi16(lo[p], odd_words, hi[p]);
        let dst = o[p * MR * KB + r * KB..][..KB].as_mut_ptr();
        // SAFETY: 32 u16 of `o`.
        unsafe { _mm512_storeu_si512(dst.cast(), words) };
    }
}

/// Packs columns c0..c0+cols (<= NR) of B (k x n) into `out` =
/// [kp/KB][PLANES][2 halves][KB/2 pairs][16 cols][2].
///
/// # Safety
/// The CPU has AVX-512F/BW/VL (every AMX CPU has).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pack_b(b: Mat<'_>, c0: usize, cols: usize, k: usize, out: &mut [u16]) {
    let step_len = PLANES * KB * NR;
    let mut t = [[0f32; 32]; 32];
    for kb in 0..k.div_ceil(KB) {
        let k0 = kb * KB;
        gather(b, (k0, (k - k0).min(KB)), (c0, cols), &mut t);
        let o = &mut out[kb * step_len..][..step_len];
        for half in 0..2 {
            for pair in 0..KB / 2 {
                let (even, odd) = (&t[2 * pair][16 * half..], &t[2 * pair + 1][16 * half..]);
                // SAFETY: 16 elements of each row; `o` is a whole step.
                unsafe { store_b_pair(o, (half, pair), even.as_ptr(), odd.as_ptr()) };
            }
        }
    }
}

/// Packs every full 32-column panel of B (k x n) with contiguous rows (column stride 1) into
/// `out` (panels `panel_len` apart, each laid out as [`pack_b`]'s), for the full 32-row steps of
/// k, in one pass down B's rows: each row read once, left to right, where packing panel by panel
/// reads 128 bytes of every row per panel (rows up to 16 KiB apart, which the hardware
/// prefetchers do not follow).
///
/// # Safety
/// The CPU has AVX-512F/BW/VL; B's rows are contiguous and hold n elements each; `n` and `k`
/// are multiples of 32; `out` holds `n / NR` panels of `panel_len`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pack_b_rows(b: Mat<'_>, (n, k): (usize, usize), out: &mut [u16], panel_len: usize) {
    let step_len = PLANES * KB * NR;
    for kb in 0..k / KB {
        for pair in 0..KB / 2 {
            let row = kb * KB + 2 * pair;
            for ahead in (row + 2 * AHEAD..k).take(2) {
                prefetch_lines(&b.0[ahead * b.1 .0..][..n]);
            }
            let even = &b.0[row * b.1 .0..][..n];
            let odd = &b.0[(row + 1) * b.1 .0..][..n];
            for (nb, panel) in out.chunks_mut(panel_len).take(n / NR).enumerate() {
                let o = &mut panel[kb * step_len..][..step_len];
                for half in 0..2 {
                    let c = nb * NR + 16 * half;
                    // SAFETY: columns c..c+16 < n of both rows; `o` is a whole step.
                    unsafe { store_b_pair(o, (half, pair), even[c..].as_ptr(), odd[c..].as_ptr()) };
                }
            }
        }
    }
}

/// Splits 16 columns of two consecutive rows of B (`even`, `odd`) and writes them as the VNNI
/// pairs `pair` of `half` in each plane of the packed step `o`.
///
/// # Safety
/// The CPU has AVX-512F; `even` and `odd` are valid for 16 reads; `o` holds a whole step.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store_b_pair(
    o: &mut [u16],
    (half, pair): (usize, usize),
    even: *const f32,
    odd: *const f32,
) {
    use std::arch::x86_64::*;
    let high = _mm512_set1_epi32(0xffff_0000_u32 as i32);
    // SAFETY: the caller's contract.
    let (even, odd) = unsafe {
        (
            split16(_mm512_loadu_ps(even)),
            split16(_mm512_loadu_ps(odd)),
        )
    };
    for p in 0..PLANES {
        // Lane j: the even row's bf16 in the low word, the odd row's above it.
        let words = _mm512_or_si512(
            _mm512_srli_epi32::<16>(even[p]),
            _mm512_and_si512(odd[p], high),
        );
        let at = p * KB * NR + (half * 16 + pair) * 32;
        // SAFETY: 32 u16 inside the step.
        unsafe { _mm512_storeu_si512(o[at..][..32].as_mut_ptr().cast(), words) };
    }
}

/// The three bf16 planes of 16 lanes, `x = x0 + x1 + x2` within 2^-27 of x (each rounds to
/// nearest what the previous ones leave; the tests hold it bit for bit to the scalar statement): each plane's bf16 in the high half of its 32-bit lane
/// (the packers drop the low half). Vector integer ops rather than `vcvtne2ps2bf16`, which
/// treats subnormal inputs as zero and so would not equal the crate's rounding.
///
/// # Safety
/// The CPU has AVX-512F.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn split16(x: std::arch::x86_64::__m512) -> [std::arch::x86_64::__m512i; PLANES] {
    use std::arch::x86_64::*;
    let (one, half_ulp) = (_mm512_set1_epi32(1), _mm512_set1_epi32(0x7fff));
    let (high, quiet) = (
        _mm512_set1_epi32(0xffff_0000_u32 as i32),
        _mm512_set1_epi32(0x0040_0000),
    );
    let mut rest = x;
    let mut planes = [_mm512_setzero_si512(); PLANES];
    for plane in &mut planes {
        let bits = _mm512_castps_si512(rest);
        // As `f32_to_bf16_bits`: add 0x7fff plus the lowest kept bit (ties to even) ...
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), one);
        let rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, half_ulp));
        // ... and a NaN keeps its high half, quietened.
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(rest, rest);
        *plane = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, quiet));
        let kept = _mm512_castsi512_ps(_mm512_and_si512(*plane, high));
        rest = _mm512_sub_ps(rest, kept);
    }
    planes
}

/// A u16 buffer aligned to cache lines: an unaligned 64-byte tile row would straddle two lines
/// and halve the kernel's rate (measured: 270 -> 480 GFLOP/s).
#[derive(Default)]
struct Packed(Vec<Line>);

#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u16; 32]);

impl Packed {
    /// The first `len` elements, after growing to hold them.
    fn slice(&mut self, len: usize) -> &mut [u16] {
        if self.0.len() * 32 < len {
            self.0.resize(len.div_ceil(32), Line([0; 32]));
        }
        &mut bytemuck::cast_slice_mut::<Line, u16>(&mut self.0)[..len]
    }
}

// SAFETY: `Line` is 32 u16 with no padding (size 64, align 64).
unsafe impl bytemuck::Zeroable for Line {}
// SAFETY: as above; every bit pattern is valid.
unsafe impl bytemuck::Pod for Line {}

thread_local! {
    /// Per-thread packing buffers, taken out for a call (so that a product started by a task
    /// this thread steals mid-call gets its own) and put back after.
    static B_PACK: Cell<Packed> = Cell::new(Packed::default());
    static A_PACK: Cell<Packed> = Cell::new(Packed::default());
    /// Per-thread partial sums of a product over k in chunks ([`product`]).
    static PARTIALS: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// The destination's base pointer, shared by tasks that write disjoint rows.
#[derive(Clone, Copy)]
struct Dst(*mut f32);
// SAFETY: tasks write disjoint row ranges of the destination (see `sgemm`).
unsafe impl Send for Dst {}
// SAFETY: as above.
unsafe impl Sync for Dst {}

/// `dst[m, n] (+)= a[m, k] @ b[k, n]`, `dst` given by pointer and row stride (column stride
/// 1), on `threads` threads of the current rayon pool (1: this thread only).
///
/// With one thread, each group of A's 32-row blocks is packed and run against every B panel in
/// turn. With more, the whole of A is packed first (a task per few blocks), then the product runs
/// as a grid of (row group, panel range) tasks, at least two per thread where the shape has them:
/// a training step's products have 1024 rows (32 blocks), which as row groups alone gave a
/// 16-thread rank 2-4 tasks. Every block of C is still one kernel call over the whole k, so the
/// result is the same bits at every thread count.
///
/// # Safety
/// [`enabled`] is true; `k >= 1` (the callers go through [`worth_it`]); `dst` is valid for reads
/// (when `accumulate`) and writes of the `m x n` elements its row stride reaches and aliases
/// neither operand; the operands hold every element their strides reach (the caller checks the
/// bounds).
pub(super) unsafe fn sgemm(
    (m, n, k): (usize, usize, usize),
    (dst, dst_rs): (*mut f32, usize),
    accumulate: bool,
    (a, b): (Mat<'_>, Mat<'_>),
    threads: usize,
    finish: Option<&Finish<'_, f32>>,
) {
    let kp = padded(k);
    let (ablock, panel) = (a_block_len(kp), b_panel_len(kp));
    let panels = n.div_ceil(NR);
    let mut bp = B_PACK.take();
    let b_packed = bp.slice(panels * panel);
    let pack = |(nb, out): (usize, &mut [u16])| {
        let cols = (n - nb * NR).min(NR);
        // SAFETY: AMX CPUs have AVX-512 (the caller checked `enabled`).
        unsafe { pack_b(b, nb * NR, cols, k, out) }
    };
    if threads > 1 {
        b_packed.par_chunks_mut(panel).enumerate().for_each(pack);
    } else if b.1 .1 == 1 && k % KB == 0 && n % NR == 0 {
        // SAFETY: AMX CPUs have AVX-512; B's rows are contiguous and hold n; every panel is full.
        unsafe { pack_b_rows(b, (n, k), b_packed, panel) };
    } else {
        b_packed.chunks_mut(panel).enumerate().for_each(pack);
    }
    let b_packed = &*b_packed;
    let out = Out {
        dst: Dst(dst),
        dst_rs,
        accumulate,
        finish,
    };
    let grid = Grid::new(m.div_ceil(MR), panels, a_block_len(chunk_k(kp)), threads);
    let mut ap = A_PACK.take();
    if threads > 1 {
        let a_packed = ap.slice(grid.blocks * ablock);
        let per_task = grid.blocks.div_ceil(threads);
        a_packed
            .par_chunks_mut(per_task * ablock)
            .enumerate()
            // SAFETY: AMX CPUs have AVX-512; the chunk holds its blocks.
            .for_each(|(t, blocks)| unsafe { pack_blocks(a, t * per_task, (m, k), blocks) });
        let a_packed = &*a_packed;
        (0..grid.tasks()).into_par_iter().for_each(|t| {
            let (rows, cols) = grid.task(t);
            let blocks = &a_packed[rows.start * ablock..rows.end * ablock];
            // SAFETY: the caller's contract; this task writes rows `rows` x panels `cols` only.
            unsafe { product(&out, (rows.start, blocks), (m, n, k), (cols, b_packed)) };
        });
    } else {
        for g in 0..grid.row_groups {
            let rows = grid.rows(g);
            let blocks = ap.slice(rows.len() * ablock);
            // SAFETY: AMX CPUs have AVX-512; `blocks` holds the group's blocks.
            unsafe { pack_blocks(a, rows.start, (m, k), blocks) };
            // SAFETY: the caller's contract.
            unsafe { product(&out, (rows.start, blocks), (m, n, k), (0..panels, b_packed)) };
        }
    }
    A_PACK.set(ap);
    B_PACK.set(bp);
}

/// Bytes this path keeps for `products` (those [`worth_it`]) on a pool of `threads`: the thread
/// that calls [`sgemm`] keeps its B and A packing buffers grown to the largest product's (B
/// whole; A whole on several threads, one row group on one), and every thread that runs a
/// product's tasks keeps its partial sums for the largest task of a product longer than [`KC`].
/// Returns `(per calling thread, per task thread)`, each rounded to the buffers' 64-byte lines.
pub(super) fn kept_bytes(products: &[(usize, usize, usize)], threads: usize) -> (u64, u64) {
    let (mut b, mut a, mut partials) = (0usize, 0usize, 0usize);
    for &(m, n, k) in products.iter().filter(|&&p| worth_it(p)) {
        let kp = padded(k);
        let panels = n.div_ceil(NR);
        let grid = Grid::new(m.div_ceil(MR), panels, a_block_len(chunk_k(kp)), threads);
        b = b.max(panels * b_panel_len(kp));
        let a_blocks = match threads > 1 {
            true => grid.blocks,
            false => (0..grid.row_groups)
                .map(|g| grid.rows(g).len())
                .max()
                .unwrap_or(0),
        };
        a = a.max(a_blocks * a_block_len(kp));
        if kp > KC {
            let task = (0..grid.tasks())
                .map(|t| grid.task(t))
                .map(|(r, c)| r.len() * c.len());
            partials = partials.max(task.max().unwrap_or(0) * MR * NR);
        }
    }
    let lines = |u16s: usize| (u16s.div_ceil(32) * 64) as u64;
    (lines(b) + lines(a), 4 * partials as u64)
}

/// How a product's blocks of C split into tasks: row groups of A's blocks small enough to stay
/// in L2 while a B panel is reused across them, times ranges of B panels when the row groups
/// alone are fewer than two per thread.
struct Grid {
    /// A's 32-row blocks.
    blocks: usize,
    row_groups: usize,
    panels: usize,
    col_groups: usize,
}

impl Grid {
    /// `ablock`: elements of one packed block over a k chunk ([`chunk_k`]). The row groups are at
    /// least as many as keep a group's chunk in L2; with several threads, the (row groups, panel
    /// ranges) pair is the one whose largest task times its rounds over the threads is least
    /// (ties: fewer tasks), so that no thread idles through a last, part-filled round.
    fn new(blocks: usize, panels: usize, ablock: usize, threads: usize) -> Self {
        let most = (A_GROUP_BYTES / (2 * ablock)).clamp(1, 16);
        let fewest = blocks.div_ceil(most).max(1);
        let mut best = (fewest, 1);
        if threads > 1 {
            let cost = |(rg, cg): (usize, usize)| {
                let rounds = (rg * cg).div_ceil(threads);
                (rounds * blocks.div_ceil(rg) * panels.div_ceil(cg), rg * cg)
            };
            for rg in fewest..=blocks.min(4 * fewest).max(fewest) {
                for cg in 1..=panels.clamp(1, 4 * threads) {
                    if cost((rg, cg)) < cost(best) {
                        best = (rg, cg);
                    }
                }
            }
        }
        Self {
            blocks,
            row_groups: best.0,
            panels,
            col_groups: best.1,
        }
    }

    fn tasks(&self) -> usize {
        self.row_groups * self.col_groups
    }

    /// The blocks of row group `g`: the groups differ by at most one block.
    fn rows(&self, g: usize) -> std::ops::Range<usize> {
        even_split(self.blocks, self.row_groups, g)
    }

    /// Task `t`'s blocks and panels.
    fn task(&self, t: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let (g, c) = (t / self.col_groups, t % self.col_groups);
        (self.rows(g), even_split(self.panels, self.col_groups, c))
    }
}

/// Packs A's blocks `first..` (as many as `out` holds) for the kernel.
///
/// # Safety
/// The CPU has AVX-512F; A holds every element its strides reach for `m` rows of `k`.
unsafe fn pack_blocks(a: Mat<'_>, first: usize, (m, k): (usize, usize), out: &mut [u16]) {
    let kp = padded(k);
    let ablock = a_block_len(kp);
    if a.1 .0 == 1 && a.1 .1 != 1 {
        // A transposed (its columns contiguous): step by step across the blocks, so that each
        // source row is read along all of their width at once, not 128 bytes of it per block.
        for kb in 0..kp / KB {
            for (i, block) in out.chunks_mut(ablock).enumerate() {
                let r0 = (first + i) * MR;
                // SAFETY: the caller's contract.
                unsafe { pack_a_gathered(a, (r0, (m - r0).min(MR)), kb..kb + 1, k, block) };
            }
        }
    } else {
        for (i, block) in out.chunks_mut(ablock).enumerate() {
            let r0 = (first + i) * MR;
            // SAFETY: the caller's contract.
            unsafe { pack_a(a, r0, (m - r0).min(MR), k, block) };
        }
    }
}

/// The k of one chunk of a product over a padded `kp`: all of it up to [`KC`], else [`KC`].
fn chunk_k(kp: usize) -> usize {
    kp.min(KC)
}

/// Packed blocks of A (the first is block `first`) against B panels `cols`: the kernel on each
/// (block, panel) pair with the panel reused across the blocks, C written as each block ends.
/// Over a k longer than [`KC`], chunk by chunk: a chunk of the blocks stays in L2 while the
/// panels' chunks stream past, the partial sums kept per (block, panel) in between (over the
/// whole k at once, a 2048-long panel was reused by only two blocks and the product ran at half
/// the rate of a 512-long one).
///
/// # Safety
/// As [`sgemm`]; no other task writes these blocks' rows in these panels' columns.
unsafe fn product(
    out: &Out<'_>,
    (first, a_packed): (usize, &[u16]),
    (m, n, k): (usize, usize, usize),
    (cols, b_packed): (std::ops::Range<usize>, &[u16]),
) {
    let kp = padded(k);
    let (ablock, panel) = (a_block_len(kp), b_panel_len(kp));
    let kc = chunk_k(kp);
    let chunks = kp.div_ceil(kc);
    let blocks = a_packed.len() / ablock;
    let mut partials = PARTIALS.take();
    if chunks > 1 && partials.len() < blocks * cols.len() * MR * NR {
        partials.resize(blocks * cols.len() * MR * NR, 0.0);
    }
    let mut c = [0f32; MR * NR];
    let direct = !out.accumulate && out.finish.is_none();
    // SAFETY: the tile state was granted (`enabled`); the config is a valid palette 1.
    unsafe { asm!("ldtilecfg [{}]", in(reg) &TILE_CONFIG, options(nostack, readonly)) };
    for chunk in 0..chunks {
        let (k0, last) = (chunk * kc, chunk + 1 == chunks);
        let (steps, off) = ((kp - k0).min(kc), k0 / KB * PLANES * MR * KB);
        for (j, nb) in cols.clone().enumerate() {
            let panel = &b_packed[nb * panel + off..(nb + 1) * panel];
            let (c0, cols) = (nb * NR, (n - nb * NR).min(NR));
            for (i, block) in a_packed.chunks(ablock).enumerate() {
                let (a, r0) = (&block[off..], (first + i) * MR);
                let rows = (m - r0).min(MR);
                let part = partials
                    .as_mut_ptr()
                    .wrapping_add((j * blocks + i) * MR * NR);
                let init = (chunk > 0).then_some(part.cast_const());
                if !last {
                    // SAFETY: `a` and `panel` hold this chunk's steps; `part` is this pair's
                    // 32 x 32 partial sums (sized above).
                    unsafe { kernel(a.as_ptr(), panel.as_ptr(), steps, init, (part, NR)) };
                    continue;
                }
                // The block's destination lines, asked for with intent to write: their misses
                // then resolve while the block computes instead of stalling its stores at the end.
                for r in 0..rows {
                    let d = out.dst.0.wrapping_add((r0 + r) * out.dst_rs + c0);
                    for line in (0..cols).step_by(16) {
                        // SAFETY: a prefetch never faults and reads nothing; the address is inside
                        // the destination (row r0 + r, column c0 + line < n).
                        unsafe {
                            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_ET0 }>(
                                d.wrapping_add(line).cast(),
                            )
                        };
                    }
                }
                // SAFETY: `a` and `panel` hold this chunk's steps; `init` as above; `c` is 32 x 32;
                // the block's rows and columns lie inside the caller's destination, this task's.
                unsafe {
                    if direct && rows == MR && cols == NR {
                        // A whole block with nothing to add: the tiles store straight into dst.
                        let d = out.dst.0.add(r0 * out.dst_rs + c0);
                        kernel(a.as_ptr(), panel.as_ptr(), steps, init, (d, out.dst_rs));
                    } else {
                        kernel(
                            a.as_ptr(),
                            panel.as_ptr(),
                            steps,
                            init,
                            (c.as_mut_ptr(), NR),
                        );
                        write_out(out, n, (r0, rows), (c0, cols), &mut c);
                    }
                }
            }
        }
    }
    // SAFETY: releases this thread's tile state (it was configured above).
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
    PARTIALS.set(partials);
}

/// Where and how a product's blocks land.
struct Out<'a> {
    dst: Dst,
    dst_rs: usize,
    accumulate: bool,
    finish: Option<&'a Finish<'a, f32>>,
}

/// Writes the `rows` x `cols` valid part of block `c` (rows `r0..`, columns `c0..` of an
/// `[m, n]` product): the finish applied first (in L1), then added to or stored over `dst`.
///
/// # Safety
/// The CPU has AVX-512F; the block's rows and columns lie inside `out`'s destination, which no
/// other task writes.
#[target_feature(enable = "avx512f")]
unsafe fn write_out(
    out: &Out<'_>,
    n: usize,
    (r0, rows): (usize, usize),
    (c0, cols): (usize, usize),
    c: &mut [f32; MR * NR],
) {
    if let Some(finish) = out.finish {
        finish.apply(n, (r0, c0), (cols, &mut c[..rows * NR], NR));
    }
    for (r, row) in c.chunks(NR).take(rows).enumerate() {
        // SAFETY: row r0 + r and columns c0..c0+cols are inside the caller's destination.
        let d = unsafe {
            std::slice::from_raw_parts_mut(out.dst.0.add((r0 + r) * out.dst_rs + c0), cols)
        };
        if out.accumulate {
            d.iter_mut().zip(row).for_each(|(d, x)| *d += x);
        } else if let (Ok(d), Ok(row)) = (
            <&mut [f32; NR]>::try_from(&mut *d),
            <&[f32; NR]>::try_from(row),
        ) {
            // SAFETY: the caller's contract (AVX-512F).
            unsafe { copy32(d, row) };
        } else {
            d.copy_from_slice(&row[..cols]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flat::f32_to_bf16_bits as bf16_bits;

    /// What the pre-flight counts of this path's kept buffers follows the packing's own lengths
    /// (pure arithmetic: it runs without AMX).
    #[test]
    fn the_kept_buffers_are_the_largest_products_packing() {
        // Too small for AMX: nothing kept.
        assert_eq!(kept_bytes(&[(64, 64, 64)], 4), (0, 0));
        // A token table's input gradient, [512, 151936] @ [151936, 896], and a block's product.
        let (head, block) = ((512, 896, 151_936), (512, 4864, 896));
        let b = 28 * b_panel_len(151_936) * 2;
        let whole_a = 16 * a_block_len(151_936) * 2;
        let (caller, task) = kept_bytes(&[head, block], 4);
        assert_eq!(caller, (b + whole_a) as u64);
        // Both k are longer than a chunk: each task thread keeps the partial sums of its blocks x
        // panels, never more than the whole product's.
        assert!(
            task > 0 && task <= (16 * 152 * MR * NR * 4) as u64,
            "{task}"
        );
        // On one thread A is packed a row group at a time, no more than 16 blocks.
        let (one, _) = kept_bytes(&[head, block], 1);
        assert!(
            one >= b as u64 + 2 * a_block_len(151_936) as u64 && one <= caller,
            "{one}"
        );
        // A k of one chunk keeps no partial sums.
        assert_eq!(kept_bytes(&[(512, 4864, 512)], 4).1, 0);
    }

    fn widen(h: u16) -> f32 {
        f32::from_bits(u32::from(h) << 16)
    }

    /// `x` as three bf16 whose sum is `x` within 2^-27 of it (each rounds what the previous leave):
    /// the scalar statement of what [`split16`] does, which the tests hold it to.
    fn split(x: f32) -> [u16; 3] {
        let h0 = bf16_bits(x);
        let r1 = x - widen(h0);
        let h1 = bf16_bits(r1);
        let r2 = r1 - widen(h1);
        [h0, h1, bf16_bits(r2)]
    }

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = crate::rng::SplitMix64::new(seed);
        (0..n)
            .map(|_| (rng.next_f64() as f32 - 0.5) * 0.2)
            .collect()
    }

    #[test]
    fn three_planes_hold_an_f32_to_within_2_pow_minus_24() {
        for x in values(10_000, 7)
            .into_iter()
            .chain([1.0, -3.5e-20, 6.1e30, 0.0])
        {
            let [a, b, c] = split(x).map(widen);
            let sum = f64::from(a) + f64::from(b) + f64::from(c);
            let err = (sum - f64::from(x)).abs();
            assert!(err <= f64::from(x).abs() * 2f64.powi(-24), "{x}: {sum}");
        }
    }

    /// AMX against an f64 reference on ragged shapes, every stride pattern the model uses, with
    /// and without accumulation, on one and two threads: the error, relative to the sum of the
    /// products' magnitudes, within what the gemm crate's f32 kernel shows (about 2e-7).
    #[test]
    fn products_match_an_f64_reference_like_an_f32_gemm() {
        if !enabled() {
            eprintln!("skipped: no AMX on this CPU (or {GEMM_ENV}=gemm)");
            return;
        }
        let shapes = [
            (70, 45, 100),
            (32, 32, 32),
            (96, 200, 531),
            (129, 33, 64),
            (64, 96, 128),
        ];
        for (m, n, k) in shapes {
            for (a_t, b_t, accumulate, threads) in [
                (false, false, false, 1),
                (false, true, true, 1),
                (true, false, false, 2),
                (true, true, true, 2),
            ] {
                let (a, b) = (values(m * k, 1), values(k * n, 2));
                let a_s = if a_t { (1, m) } else { (k, 1) };
                let b_s = if b_t { (1, k) } else { (n, 1) };
                let dst_rs = n + 3;
                let init = values(m * dst_rs, 3);
                let mut dst = init.clone();
                // SAFETY: dst holds m rows of dst_rs >= n; the operands every strided element.
                unsafe {
                    sgemm(
                        (m, n, k),
                        (dst.as_mut_ptr(), dst_rs),
                        accumulate,
                        ((&a, a_s), (&b, b_s)),
                        threads,
                        None,
                    )
                };
                for i in 0..m {
                    for j in 0..dst_rs {
                        let got = f64::from(dst[i * dst_rs + j]);
                        if j >= n {
                            assert_eq!(got, f64::from(init[i * dst_rs + j]), "wrote past n");
                            continue;
                        }
                        let (mut sum, mut mag) = (0f64, 0f64);
                        for kk in 0..k {
                            let x = f64::from(a[i * a_s.0 + kk * a_s.1]);
                            let p = x * f64::from(b[kk * b_s.0 + j * b_s.1]);
                            sum += p;
                            mag += p.abs();
                        }
                        if accumulate {
                            sum += f64::from(init[i * dst_rs + j]);
                            mag += f64::from(init[i * dst_rs + j]).abs();
                        }
                        let rel = (got - sum).abs() / mag.max(1e-30);
                        assert!(rel < 5e-7, "{m}x{n}x{k} ({i},{j}): {got} vs {sum}: {rel:e}");
                    }
                }
            }
        }
    }

    /// The vector split equals the scalar one bit for bit, subnormals, infinities and NaN
    /// included.
    #[test]
    fn split16_equals_split() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            eprintln!("skipped: no AVX-512 on this CPU");
            return;
        }
        let specials = [
            0.0,
            -0.0,
            1e-40,
            -3e-39,
            f32::MIN_POSITIVE,
            f32::MAX,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x7f80_0001),
            1.0 + f32::EPSILON * 64.0,
            1.0 + f32::EPSILON * 192.0,
        ];
        let xs: Vec<f32> = values(4096, 11)
            .into_iter()
            .chain(specials)
            .chain((0..4).map(|_| 0.5))
            .collect();
        for chunk in xs.chunks_exact(16) {
            let mut planes = [[0u32; 16]; PLANES];
            // SAFETY: checked AVX-512F; 16 f32 in, 16 u32 out per plane.
            unsafe {
                use std::arch::x86_64::*;
                let got = split16(_mm512_loadu_ps(chunk.as_ptr()));
                for (out, v) in planes.iter_mut().zip(got) {
                    _mm512_storeu_si512(out.as_mut_ptr().cast(), v);
                }
            }
            for (i, &x) in chunk.iter().enumerate() {
                let got = planes.map(|p| (p[i] >> 16) as u16);
                assert_eq!(got, split(x), "{x:e} ({:#x})", x.to_bits());
            }
        }
    }

    #[test]
    fn transpose16_transposes() {
        if !enabled() {
            return;
        }
        let src: Vec<f32> = (0..16 * 20).map(|i| i as f32).collect();
        let mut dst = vec![0f32; 16 * 17];
        // SAFETY: AMX CPUs have AVX-512; 16 rows of 20 and of 17 hold the blocks.
        unsafe { transpose16(src.as_ptr(), 20, dst.as_mut_ptr(), 17) };
        for i in 0..16 {
            for j in 0..16 {
                assert_eq!(dst[i * 17 + j], src[j * 20 + i], "({i}, {j})");
            }
        }
    }

    /// Every block of C is one kernel call over the whole k at any thread count: the same bits
    /// from one thread as from a grid of row groups and panel ranges.
    #[test]
    fn products_are_the_same_bits_at_every_thread_count() {
        if !enabled() {
            eprintln!("skipped: no AMX on this CPU (or {GEMM_ENV}=gemm)");
            return;
        }
        for (m, n, k, a_t) in [
            (1024, 512, 512, false),
            (512, 96, 1024, true),
            (70, 300, 64, false),
        ] {
            let (a, b) = (values(m * k, 4), values(k * n, 5));
            let a_s = if a_t { (1, m) } else { (k, 1) };
            let run = |threads: usize| {
                let mut dst = values(m * n, 6);
                // SAFETY: dst holds m rows of n; the operands every strided element.
                unsafe {
                    sgemm(
                        (m, n, k),
                        (dst.as_mut_ptr(), n),
                        true,
                        ((&a, a_s), (&b, (n, 1))),
                        threads,
                        None,
                    )
                };
                dst
            };
            let one = run(1);
            for threads in [2, 3, 16] {
                assert!(one == run(threads), "{m}x{n}x{k} at {threads} threads");
            }
        }
    }

    /// The grid covers every (block, panel) pair once, splits panels only when row groups are
    /// fewer than two per thread, and keeps its parts within one of each other.
    #[test]
    fn the_task_grid_covers_each_block_and_panel_once() {
        for (blocks, panels, kp, threads) in [
            (32, 16, 512, 16),
            (32, 64, 2048, 16),
            (3, 1, 64, 8),
            (40, 5, 96, 1),
        ] {
            let g = Grid::new(blocks, panels, a_block_len(chunk_k(kp)), threads);
            let mut seen = vec![0u8; blocks * panels];
            for t in 0..g.tasks() {
                let (rows, cols) = g.task(t);
                for r in rows {
                    for c in cols.clone() {
                        seen[r * panels + c] += 1;
                    }
                }
            }
            assert!(seen.iter().all(|&s| s == 1), "{blocks} x {panels}");
        }
        // The GPT's products (1024 rows, 16-64 panels) keep 16 threads at least 90% busy.
        for panels in [16, 48, 64] {
            let g = Grid::new(32, panels, a_block_len(512), 16);
            let (rows, cols) = g.task(0);
            let busiest = g.tasks().div_ceil(16) * rows.len() * cols.len();
            let load = (32 * panels) as f64 / (16 * busiest) as f64;
            assert!(
                load >= 0.9,
                "{panels} panels: {} x {} tasks, {load}",
                g.row_groups,
                g.col_groups
            );
        }
        assert_eq!(even_split(10, 4, 0), 0..3);
        assert_eq!(even_split(10, 4, 3), 8..10);
    }

    #[test]
    fn small_products_stay_on_the_gemm_crate() {
        assert!(!worth_it((128, 128, 64)), "attention's per-head products");
        assert!(worth_it((1024, 512, 512)));
        assert!(!worth_it((16, 4096, 4096)), "fewer rows than a block");
    }
}
