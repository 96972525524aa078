//! What the products' packing holds on this CPU, for the pre-flight's plan: the `gemm` crate's
//! buffers for f32 products ([`gemm_footprint`]), or the bf16 panels of zerodp's AVX512-BF16
//! products ([`bf16_footprint`]).
//!
//! The crate sizes its buffers from the CPU's caches and kernel shapes, so the same model holds a
//! different number of bytes on another CPU kind: a slab of the L2 cache's size per thread that
//! runs its tasks (allocated at the thread's first product and kept), and per product a buffer
//! for the packed right operand (`kc x nc` elements, `kc` from the L1 cache, `nc` from the L3 or
//! the operand's width) and the packed left one, allocated on the calling thread and freed when
//! the product ends. Both are computed here with the crate's own `kernel_params` and cache
//! table, rather than fitted on one CPU.

use super::super::gpt::GptConfig;

/// The `gemm` crate's memory for a model's f32 products on this CPU, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GemmFootprint {
    /// Per thread of a rank's compute pool: what the products write of its packing slab (the L2
    /// cache's size, allocated at the thread's first product).
    pub per_thread: u64,
    /// Per rank: the largest product's packing buffers, alive while it runs (products run one
    /// at a time on a rank's thread below [`super::two_products`]' pool size).
    pub per_rank: u64,
    /// What the LM head's backward packs beside its own tensors, counted at that moment of the
    /// step rather than throughout: zerodp's bf16 panels of the token table in both layouts and
    /// of a chunk's logits gradient (0 on the other paths, whose head products count in
    /// `per_rank`).
    pub head_backward: u64,
}

/// The f32 micro-kernel shape the `gemm` crate dispatches to on this CPU: rows (`MR`, a multiple
/// of the vector width) and columns (`NR`) of its register block.
fn kernel_shape() -> (usize, usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            return (64, 6);
        }
        if std::is_x86_feature_detected!("fma") {
            return (16, 6);
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        return (16, 4);
    }
    #[allow(unreachable_code)]
    (8, 4)
}

/// Bytes one product `[m, k] @ [k, n]` touches of the crate's packing memory, as its
/// `gemm_basic_generic` sizes it (f32 elements, a cache line of alignment each): the packed
/// right and left operands it allocates on the calling thread (the left one planned whenever the
/// crate may prepack it, which depends on the operands' strides), and the part of each task
/// thread's L2 slab its left panels fill (`kc x mc`; the slab is allocated whole but only those
/// pages are ever written).
fn packing_bytes((m, n, k): (usize, usize, usize)) -> (u64, u64) {
    if m == 0 || n == 0 || k == 0 || (m <= 64 && n <= 64) {
        return (0, 0);
    }
    let (mr, nr) = kernel_shape();
    let p = gemm_common::cache::kernel_params(m, n, k, mr, nr, 4);
    let nc = match p.nc {
        0 => n.div_ceil(nr) * nr,
        nc => nc,
    };
    let rhs = p.kc * nc;
    let lhs = match m <= 2 * p.mc {
        true => p.kc * m.div_ceil(mr) * mr,
        false => 0,
    };
    (4 * (rhs + lhs) as u64 + 2 * 64, 4 * (p.kc * p.mc) as u64)
}

/// The products of one micro-step of zerodp's GPT on `tokens` rows, `(m, n, k)` for
/// `[m, k] @ [k, n]`: each linear layer's forward, input gradient and weight gradient, and the
/// LM head's over its chunks of rows.
pub fn gpt_products(gpt: &GptConfig, tokens: usize) -> Vec<(usize, usize, usize)> {
    let c = gpt.width;
    let inner = gpt.mlp_width.unwrap_or(4 * c);
    let layers = [(c, 3 * c), (c, c), (c, inner), (inner, c)];
    linear_products(&layers, (c, gpt.vocab_size), tokens)
}

/// [`gpt_products`] of a Llama-family decoder: q, k, v and o, gate, up and down, and the head.
pub fn llama_products(
    c: &crate::model::hf::LlamaConfig,
    tokens: usize,
) -> Vec<(usize, usize, usize)> {
    let (h, q, kv, i) = (
        c.hidden,
        c.heads * c.head_dim,
        c.kv_heads * c.head_dim,
        c.intermediate,
    );
    let layers = [(h, q), (h, kv), (q, h), (h, i), (i, h)];
    linear_products(&layers, (h, c.vocab_size), tokens)
}

/// The three products of each `(in, out)` linear layer on `tokens` rows, then the head's
/// (`(width, vocab)`) on one chunk of rows.
fn linear_products(
    layers: &[(usize, usize)],
    (width, vocab): (usize, usize),
    tokens: usize,
) -> Vec<(usize, usize, usize)> {
    let rows = tokens.min(crate::limits::lm_head_chunk_rows(vocab as u64) as usize);
    let head = (width, vocab, rows);
    let each = layers.iter().map(|&(inp, outp)| (inp, outp, tokens));
    each.chain(std::iter::once(head))
        .flat_map(|(inp, outp, m)| [(m, outp, inp), (m, inp, outp), (outp, inp, m)])
        .collect()
}

/// Bytes of zerodp's bf16 packing of `X [k, n]` in groups of `w` columns: pairs of rows in a u32
/// (`gemm::bf16`'s `pack_pairs`).
fn bf16_panels(k: usize, n: usize, w: usize) -> u64 {
    (n.div_ceil(w) * w * k.div_ceil(2) * 4) as u64
}

/// Bytes one product `[m, k] @ [k, n]` packs on zerodp's AVX512-BF16 kernels: its left operand
/// in blocks of 8 rows, its right one in panels of 32 columns.
fn bf16_packing((m, n, k): (usize, usize, usize)) -> u64 {
    bf16_panels(k, m, 8) + bf16_panels(k, n, 32)
}

/// What zerodp's AVX512-BF16 products pack: each product its left operand in blocks of 8 rows
/// and its right one in panels of 32 columns, bf16 pairs, for the length of the call (nothing is
/// kept between calls). The LM head's backward packs the most, counted at its moment
/// ([`GemmFootprint::head_backward`]): the token table in both layouts for all its chunks of rows,
/// and beside them the weight gradient's product packing a chunk's logits gradient (`[V, r]`) and
/// its rows; the other products per rank. `products` as [`gpt_products`] gives them, the head's
/// three last, its weight gradient `(V, c, r)` the last.
pub fn bf16_footprint(products: &[(usize, usize, usize)]) -> GemmFootprint {
    let (body, head) = products.split_at(products.len().saturating_sub(3));
    let largest = body.iter().map(|&p| bf16_packing(p)).max().unwrap_or(0);
    let head_backward = head.last().map_or(0, |&(v, c, r)| {
        bf16_panels(c, v, 32) + bf16_panels(v, c, 32) + bf16_packing((v, c, r))
    });
    GemmFootprint {
        per_thread: 0,
        per_rank: largest,
        head_backward,
    }
}

/// The packing memory of `products` on the path this process runs them
/// ([`super::gemm_path`]) on a rank of `threads` compute threads: the `gemm` crate's, zerodp's
/// bf16 panels, or on AMX tiles the buffers that path keeps for the products it takes (beside the
/// `gemm` crate's for the small ones it leaves), counted once more where a backward runs its two
/// products side by side ([`super::two_products`]).
pub fn products_footprint(products: &[(usize, usize, usize)], threads: usize) -> GemmFootprint {
    match super::gemm_path() {
        "avx512-bf16" => bf16_footprint(products),
        "amx" => {
            let (tiles, rest): (Vec<_>, Vec<_>) =
                products.iter().partition(|&&p| super::amx::worth_it(p));
            let left = gemm_footprint(&rest);
            let (caller, task) = super::amx::kept_bytes(&tiles, threads);
            let callers = 1 + u64::from(threads >= super::SIDE_BY_SIDE_THREADS);
            GemmFootprint {
                per_thread: left.per_thread + task,
                per_rank: left.per_rank + callers * caller,
                head_backward: 0,
            }
        }
        _ => gemm_footprint(products),
    }
}

/// The `gemm` crate's memory for `products` on this CPU.
pub fn gemm_footprint(products: &[(usize, usize, usize)]) -> GemmFootprint {
    let slab = gemm_common::cache::CACHE_INFO[1].cache_bytes as u64;
    let each = products.iter().map(|&p| packing_bytes(p));
    let (per_rank, panels) = each.fold((0, 0), |(a, b), (c, d)| (a.max(c), b.max(d)));
    GemmFootprint {
        per_thread: panels.min(slab),
        per_rank,
        head_backward: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_follows_the_operand_and_the_caches() {
        let gpt = GptConfig::small();
        let products = gpt_products(&gpt, 4 * 128);
        // Four linears and the head, three products each.
        assert_eq!(products.len(), 15);
        let f = gemm_footprint(&products);
        let slab = gemm_common::cache::CACHE_INFO[1].cache_bytes as u64;
        assert!(f.per_thread > 0 && f.per_thread <= slab, "{f:?}");
        // At least one packed right operand of the widest layer's kc rows, and never more than
        // both operands whole.
        let widest = products.iter().map(|&p| packing_bytes(p).0).max().unwrap();
        assert_eq!(f.per_rank, widest);
        assert!(f.per_rank >= 4 * 256 * 1024, "{f:?}");
        assert!(f.per_rank <= 4 * 2 * 1024 * 1024, "{f:?}");
        assert_eq!(packing_bytes((32, 32, 32)), (0, 0));
    }

    /// The bf16 panels counted are the ones `gemm::bf16` packs, for odd and even shapes.
    #[test]
    fn bf16_packing_is_counted_as_the_kernels_pack() {
        for (m, n, k) in [(1, 1, 1), (9, 33, 7), (64, 96, 128), (17, 1000, 257)] {
            let a = vec![0.5f32; m * k];
            let b = vec![0.5f32; k * n];
            let pa = super::super::bf16::pack_a((&a, (k, 1)), m, k);
            let pb = super::super::bf16::pack_b((&b, (n, 1)), k, n);
            let bytes = 4 * (pa.len() + pb.len()) as u64;
            assert_eq!(bf16_packing((m, n, k)), bytes, "{m}x{n}x{k}");
        }
        // At a large vocabulary the head's backward holds the most: the table in both layouts
        // beside its weight gradient's operands (a chunk's logits gradient transposed, its rows).
        let (c, v, r) = (512, 16384, 512);
        let gpt = GptConfig::sized(v, 128, 4, 8, c);
        let products = gpt_products(&gpt, 4 * 128);
        let table = bf16_panels(c, v, 32) + bf16_panels(v, c, 32);
        let f = bf16_footprint(&products);
        assert_eq!(f.per_thread, 0);
        assert_eq!(f.head_backward, table + bf16_packing((v, c, r)));
        assert!(products.iter().all(|&p| bf16_packing(p) < f.head_backward));
        // The blocks' products per rank: the MLP's input gradient, [512, 2048] @ [2048, 512].
        assert_eq!(f.per_rank, bf16_packing((512, 512, 2048)));
    }
}
